/* safetensors.c - validating safetensors reader (header parser, lookups, reads, conversion). */
#include "config.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "core/safetensors_int.h"

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#endif

struct st_name {
	const char *name;
	size_t idx;                 /* into tier_st.t */
};

struct tier_st {
	char *path;
	int fd;                     /* -1 for a header parsed from memory */
	size_t n;
	tier_st_tensor *t;          /* sorted by offset */
	struct st_name *by_name;    /* sorted by name */
	size_t n_meta;
	char **meta;                /* key, value, key, value ... */
};

int tier_st_no_jansson(const char *what)
{
	return tier_fail(-ENOTSUP, "%s: this build has no JSON support; install libjansson-dev and "
			 "run configure again", what);
}

void tier_st_close(tier_st *st)
{
	if (!st)
		return;
	for (size_t i = 0; i < st->n; i++)
		free((char *)st->t[i].name);
	for (size_t i = 0; i < 2 * st->n_meta; i++)
		free(st->meta[i]);
	if (st->fd >= 0)
		close(st->fd);
	free(st->meta);
	free(st->t);
	free(st->by_name);
	free(st->path);
	free(st);
}

const char *tier_st_path(const tier_st *st) { return st->path; }
size_t tier_st_count(const tier_st *st) { return st->n; }

const tier_st_tensor *tier_st_at(const tier_st *st, size_t i)
{
	return i < st->n ? &st->t[i] : NULL;
}

const tier_st_tensor *tier_st_find(const tier_st *st, const char *name)
{
	size_t lo = 0, hi = st->n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		int c = strcmp(st->by_name[mid].name, name);
		if (c == 0)
			return &st->t[st->by_name[mid].idx];
		if (c < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return NULL;
}

const char *tier_st_metadata(const tier_st *st, const char *key)
{
	for (size_t i = 0; i < st->n_meta; i++)
		if (strcmp(st->meta[2 * i], key) == 0)
			return st->meta[2 * i + 1];
	return NULL;
}

uint64_t tier_st_numel(const tier_st_tensor *t)
{
	uint64_t n = 1;
	for (int d = 0; d < t->ndim; d++)
		n *= t->shape[d];      /* validated not to overflow */
	return n;
}

#ifdef TIER_HAVE_JANSSON
/* ---- The header parser ------------------------------------------------------------------- */

static int bad(const char *what, const char *tensor, const char *fmt, const char *detail, int code)
{
	if (tensor)
		return tier_fail(code, "%s: tensor '%s': %s%s", what, tensor, fmt, detail ? detail : "");
	return tier_fail(code, "%s: %s%s", what, fmt, detail ? detail : "");
}

static int get_u64(json_t *v, uint64_t *out)
{
	if (!json_is_integer(v) || json_integer_value(v) < 0)
		return -1;
	*out = (uint64_t)json_integer_value(v);
	return 0;
}

/* Dtypes of newer safetensors versions (complex, sub-byte and scale formats): the file is
 * valid, tier just cannot use them. */
static int newer_dtype(const char *name)
{
	static const char *const names[] = { "C64", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0" };
	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
		if (strcmp(name, names[i]) == 0)
			return 1;
	return 0;
}

static int parse_tensor(const char *what, const char *name, json_t *v, uint64_t data_size, tier_st_tensor *t)
{
	char msg[160];
	if (!json_is_object(v))
		return bad(what, name, "entry is not a JSON object", NULL, -EBADMSG);
	json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
	json_t *offs = json_object_get(v, "data_offsets");
	if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs))
		return bad(what, name, "needs \"dtype\" (string), \"shape\" (array) and \"data_offsets\" (array)",
			   NULL, -EBADMSG);
	int rc = tier_dtype_parse(json_string_value(dt), &t->dtype);
	if (rc < 0 && newer_dtype(json_string_value(dt)))
		return bad(what, name, "is valid safetensors but tier does not support its dtype ",
			   json_string_value(dt), -ENOTSUP);
	if (rc < 0)
		return bad(what, name, "unknown dtype ", json_string_value(dt), -EBADMSG);
	size_t nd = json_array_size(shape);
	if (nd > TIER_ST_MAX_DIMS) {
		snprintf(msg, sizeof msg, "%zu dimensions (tier supports up to %d)", nd, TIER_ST_MAX_DIMS);
		return bad(what, name, msg, NULL, -ENOTSUP);
	}
	uint64_t bytes = tier_dtype_size(t->dtype), begin, end;
	t->ndim = (int)nd;
	for (size_t d = 0; d < nd; d++) {
		if (get_u64(json_array_get(shape, d), &t->shape[d]) < 0)
			return bad(what, name, "shape entries must be non-negative integers", NULL, -EBADMSG);
		if (tier_mul_overflow(bytes, t->shape[d], &bytes))
			return bad(what, name, "shape overflows 64-bit byte size", NULL, -EOVERFLOW);
	}
	if (json_array_size(offs) != 2 || get_u64(json_array_get(offs, 0), &begin) < 0 ||
	    get_u64(json_array_get(offs, 1), &end) < 0)
		return bad(what, name, "data_offsets must be two non-negative integers [begin, end]", NULL, -EBADMSG);
	if (begin > end) {
		snprintf(msg, sizeof msg, "data_offsets begin %llu > end %llu",
			 (unsigned long long)begin, (unsigned long long)end);
		return bad(what, name, msg, NULL, -EBADMSG);
	}
	if (end > data_size) {
		snprintf(msg, sizeof msg, "data_offsets end %llu is beyond the data region (%llu bytes): "
			 "the file is truncated or the header is wrong",
			 (unsigned long long)end, (unsigned long long)data_size);
		return bad(what, name, msg, NULL, -EBADMSG);
	}
	if (end - begin != bytes) {
		snprintf(msg, sizeof msg, "shape and dtype give %llu bytes but data_offsets span %llu",
			 (unsigned long long)bytes, (unsigned long long)(end - begin));
		return bad(what, name, msg, NULL, -EBADMSG);
	}
	t->offset = begin;          /* relative for now; made absolute once the layout is checked */
	t->nbytes = bytes;
	return 0;
}

static int parse_metadata(const char *what, tier_st *st, json_t *m)
{
	const char *k;
	json_t *v;
	if (json_is_null(m))
		return 0;                  /* the reference reads null as "no metadata" */
	if (!json_is_object(m))
		return bad(what, NULL, "__metadata__ is not a JSON object", NULL, -EBADMSG);
	st->meta = calloc(2 * json_object_size(m) + 1, sizeof *st->meta);
	if (!st->meta)
		return tier_fail(-ENOMEM, "%s: out of memory", what);
	json_object_foreach(m, k, v) {
		if (!json_is_string(v))
			return bad(what, NULL, "__metadata__ values must be strings; this one is not: ", k, -EBADMSG);
		st->meta[2 * st->n_meta] = strdup(k);
		st->meta[2 * st->n_meta + 1] = strdup(json_string_value(v));
		st->n_meta++;
		if (!st->meta[2 * st->n_meta - 2] || !st->meta[2 * st->n_meta - 1])
			return tier_fail(-ENOMEM, "%s: out of memory", what);
	}
	return 0;
}

static int cmp_offset(const void *a, const void *b)
{
	const tier_st_tensor *x = a, *y = b;
	if (x->offset != y->offset)
		return x->offset < y->offset ? -1 : 1;
	return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

static int cmp_name(const void *a, const void *b)
{
	return strcmp(((const struct st_name *)a)->name, ((const struct st_name *)b)->name);
}

/* The reference implementation requires the tensors, sorted by offset, to tile the data region
 * exactly: the first starts at 0, each starts where the previous ended, the last ends at the end. */
static int check_layout(const char *what, tier_st *st, uint64_t data_size, uint64_t data_start)
{
	char msg[200];
	uint64_t pos = 0;
	qsort(st->t, st->n, sizeof *st->t, cmp_offset);
	for (size_t i = 0; i < st->n; i++) {
		const tier_st_tensor *t = &st->t[i];
		if (t->offset < pos) {
			snprintf(msg, sizeof msg, "bytes [%llu, %llu) overlap tensor '%s'",
				 (unsigned long long)t->offset, (unsigned long long)pos, st->t[i - 1].name);
			return bad(what, t->name, msg, NULL, -EBADMSG);
		}
		if (t->offset > pos) {
			snprintf(msg, sizeof msg, "a hole of %llu bytes before it (data bytes [%llu, %llu) belong "
				 "to no tensor)", (unsigned long long)(t->offset - pos),
				 (unsigned long long)pos, (unsigned long long)t->offset);
			return bad(what, t->name, msg, NULL, -EBADMSG);
		}
		pos = t->offset + t->nbytes;
	}
	if (pos != data_size) {
		snprintf(msg, sizeof msg, "the data region has %llu bytes after the last tensor ends "
			 "(at %llu); no tensor covers them", (unsigned long long)(data_size - pos),
			 (unsigned long long)pos);
		return bad(what, st->n ? st->t[st->n - 1].name : NULL, msg, NULL, -EBADMSG);
	}
	for (size_t i = 0; i < st->n; i++)
		st->t[i].offset += data_start;
	st->by_name = malloc((st->n + 1) * sizeof *st->by_name);
	if (!st->by_name)
		return tier_fail(-ENOMEM, "%s: out of memory", what);
	for (size_t i = 0; i < st->n; i++)
		st->by_name[i] = (struct st_name){ st->t[i].name, i };
	qsort(st->by_name, st->n, sizeof *st->by_name, cmp_name);
	return 0;
}

static int parse_entries(const char *what, tier_st *st, json_t *root, uint64_t data_size)
{
	const char *k;
	json_t *v;
	st->t = calloc(json_object_size(root) + 1, sizeof *st->t);
	if (!st->t)
		return tier_fail(-ENOMEM, "%s: out of memory", what);
	json_object_foreach(root, k, v) {
		int rc;
		if (strcmp(k, "__metadata__") == 0) {
			rc = parse_metadata(what, st, v);
		} else {
			tier_st_tensor *t = &st->t[st->n];
			rc = parse_tensor(what, k, v, data_size, t);
			if (rc == 0 && !(t->name = strdup(k)))
				rc = tier_fail(-ENOMEM, "%s: out of memory", what);
			if (rc == 0)
				st->n++;
		}
		if (rc < 0)
			return rc;
	}
	return 0;
}

static int parse_json(const char *what, const char *text, uint64_t n, uint64_t data_size,
		      uint64_t data_start, tier_st *st)
{
	json_error_t err;
	/* Reject duplicate names in the parser: a JSON object would silently keep only one. */
	json_t *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &err);
	if (!root) {
		char msg[300];
		snprintf(msg, sizeof msg, "header is not valid JSON: %s (at byte %d of the header)",
			 err.text, err.position);
		return bad(what, NULL, msg, NULL, -EBADMSG);
	}
	int rc = json_is_object(root) ? parse_entries(what, st, root, data_size)
				      : bad(what, NULL, "header is JSON but not an object", NULL, -EBADMSG);
	json_decref(root);
	return rc < 0 ? rc : check_layout(what, st, data_size, data_start);
}

int tier_st_parse_header(const void *buf, size_t len, uint64_t file_size, const char *what, tier_st **out)
{
	const unsigned char *b = buf;
	uint64_t n = 0;
	char msg[200];
	*out = NULL;
	what = what ? what : "safetensors";
	if (len > file_size)
		return tier_fail(-EINVAL, "%s: %zu bytes given of a %llu-byte file", what, len,
				 (unsigned long long)file_size);
	if (len < 8) {
		snprintf(msg, sizeof msg, "the file has %zu bytes, fewer than the 8-byte header length", len);
		return bad(what, NULL, msg, NULL, -EBADMSG);
	}
	for (int i = 7; i >= 0; i--)
		n = n << 8 | b[i];
	if (n > TIER_ST_MAX_HEADER || n > file_size - 8) {
		snprintf(msg, sizeof msg, "header length %llu is beyond the file (%llu bytes) or the %llu-byte "
			 "limit: the file is truncated or not safetensors", (unsigned long long)n,
			 (unsigned long long)file_size, TIER_ST_MAX_HEADER);
		return bad(what, NULL, msg, NULL, -EBADMSG);
	}
	if (n > len - 8)
		return tier_fail(-EINVAL, "%s: only %zu bytes given, the header needs %llu", what, len,
				 (unsigned long long)(n + 8));
	tier_st *st = calloc(1, sizeof *st);
	if (!st || !(st->path = strdup(what))) {
		free(st);
		return tier_fail(-ENOMEM, "%s: out of memory", what);
	}
	st->fd = -1;
	int rc = parse_json(what, (const char *)b + 8, n, file_size - 8 - n, 8 + n, st);
	if (rc < 0) {
		tier_st_close(st);
		return rc;
	}
	*out = st;
	return 0;
}

#else /* !TIER_HAVE_JANSSON */

int tier_st_parse_header(const void *buf, size_t len, uint64_t file_size, const char *what, tier_st **out)
{
	*out = NULL;
	return tier_st_no_jansson(what ? what : "safetensors");
}

#endif

/* ---- Files ----------------------------------------------------------------------------------- */

int tier_st_pread(int fd, const char *path, void *dst, size_t bytes, uint64_t off)
{
	char *p = dst;
	while (bytes > 0) {
		ssize_t r = pread(fd, p, bytes, (off_t)off);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return tier_fail(-errno, "%s: read at %llu failed: %s", path, (unsigned long long)off,
					 strerror(errno));
		if (r == 0)
			return tier_fail(-EIO, "%s: file ended at byte %llu (was it truncated after opening?)",
					 path, (unsigned long long)off);
		p += r;
		bytes -= (size_t)r;
		off += (uint64_t)r;
	}
	return 0;
}

int tier_st_open(const char *path, tier_st **out)
{
	unsigned char len8[8];
	struct stat sb;
	*out = NULL;
#ifndef TIER_HAVE_JANSSON
	return tier_st_no_jansson(path);
#endif
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return tier_fail(-errno, "cannot open %s: %s", path, strerror(errno));
	int rc = 0;
	if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode))
		rc = tier_fail(-EINVAL, "%s is not a regular file", path);
	uint64_t size = (uint64_t)sb.st_size, n = 0;
	if (rc == 0 && size < 8)
		rc = tier_fail(-EBADMSG, "%s: the file has %llu bytes, fewer than the 8-byte header length",
			       path, (unsigned long long)size);
	if (rc == 0)
		rc = tier_st_pread(fd, path, len8, 8, 0);
	for (int i = 7; rc == 0 && i >= 0; i--)
		n = n << 8 | len8[i];
	/* Read at most what the parser may accept; it reports a bad length with the file's name. */
	size_t want = rc == 0 && n <= TIER_ST_MAX_HEADER && n <= size - 8 ? (size_t)n + 8 : 8;
	unsigned char *buf = rc == 0 ? malloc(want) : NULL;
	if (rc == 0 && !buf)
		rc = tier_fail(-ENOMEM, "%s: no memory for a %zu-byte header", path, want);
	if (rc == 0)
		rc = tier_st_pread(fd, path, buf, want, 0);
	if (rc == 0)
		rc = tier_st_parse_header(buf, want, size, path, out);
	free(buf);
	if (rc < 0) {
		close(fd);
		return rc;
	}
	(*out)->fd = fd;
	return 0;
}

int tier_st_read_range(const tier_st *st, const tier_st_tensor *t, uint64_t off, void *dst, size_t bytes)
{
	if (off > t->nbytes || bytes > t->nbytes - off)
		return tier_fail(-EINVAL, "%s: tensor '%s': bytes [%llu, +%zu) are outside its %llu bytes",
				 st->path, t->name, (unsigned long long)off, bytes, (unsigned long long)t->nbytes);
	if (st->fd < 0)
		return tier_fail(-EBADF, "%s: parsed from memory, there is no file to read from", st->path);
	return tier_st_pread(st->fd, st->path, dst, bytes, t->offset + off);
}

int tier_st_read(const tier_st *st, const char *name, void *dst, size_t bytes)
{
	const tier_st_tensor *t = tier_st_find(st, name);
	if (!t)
		return tier_fail(-ENOENT, "%s: no tensor named '%s'", st->path, name);
	if (bytes != t->nbytes)
		return tier_fail(-EINVAL, "%s: tensor '%s' has %llu bytes, the buffer %zu", st->path, name,
				 (unsigned long long)t->nbytes, bytes);
	return tier_st_read_range(st, t, 0, dst, bytes);
}

int tier_st_convert(const tier_st *st, const char *name, void *dst, tier_dtype dst_dt, size_t count)
{
	const tier_st_tensor *t = tier_st_find(st, name);
	if (!t)
		return tier_fail(-ENOENT, "%s: no tensor named '%s'", st->path, name);
	if (count != tier_st_numel(t))
		return tier_fail(-EINVAL, "%s: tensor '%s' has %llu elements, the buffer %zu", st->path, name,
				 (unsigned long long)tier_st_numel(t), count);
	if (t->dtype == dst_dt)
		return tier_st_read(st, name, dst, t->nbytes);
	void *tmp = malloc(t->nbytes ? t->nbytes : 1);
	if (!tmp)
		return tier_fail(-ENOMEM, "%s: tensor '%s': no memory to stage %llu bytes", st->path, name,
				 (unsigned long long)t->nbytes);
	int rc = tier_st_read(st, name, tmp, t->nbytes);
	if (rc == 0)
		rc = tier_dtype_convert(dst, dst_dt, tmp, t->dtype, count);
	if (rc < 0 && rc != -EIO) {
		char why[256];
		snprintf(why, sizeof why, "%s", tier_last_error());
		tier_fail(rc, "%s: tensor '%s': %s", st->path, name, why);
	}
	free(tmp);
	return rc;
}

int tier_read_text_file(const char *path, size_t max_bytes, char **out)
{
	struct stat sb;
	*out = NULL;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return tier_fail(-errno, "cannot open %s: %s", path, strerror(errno));
	int rc = 0;
	if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode))
		rc = tier_fail(-EINVAL, "%s is not a regular file", path);
	else if ((uint64_t)sb.st_size > max_bytes)
		rc = tier_fail(-EFBIG, "%s has %lld bytes, more than the %zu this reader accepts", path,
			       (long long)sb.st_size, max_bytes);
	char *buf = rc == 0 ? malloc((size_t)sb.st_size + 1) : NULL;
	if (rc == 0 && !buf)
		rc = tier_fail(-ENOMEM, "%s: out of memory", path);
	if (rc == 0)
		rc = tier_st_pread(fd, path, buf, (size_t)sb.st_size, 0);
	close(fd);
	if (rc < 0) {
		free(buf);
		return rc;
	}
	buf[sb.st_size] = '\0';
	*out = buf;
	return 0;
}
