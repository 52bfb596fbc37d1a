/* safetensors_write.c - write a safetensors file atomically (header JSON padded to 8 bytes). */
#include "config.h"
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "core/safetensors_int.h"

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Names must be present, not "__metadata__", and unique. */
static int check_names(const char *path, const tier_st_wtensor *t, size_t n)
{
	const char **names = malloc((n + 1) * sizeof *names);
	int rc = 0;
	if (!names)
		return tier_fail(-ENOMEM, "%s: out of memory", path);
	for (size_t i = 0; i < n && rc == 0; i++) {
		names[i] = t[i].name;
		if (!t[i].name || !*t[i].name || strcmp(t[i].name, "__metadata__") == 0)
			rc = tier_fail(-EINVAL, "%s: tensor %zu has an empty or reserved name ('%s')", path, i,
				       t[i].name ? t[i].name : "(null)");
	}
	if (rc == 0)
		qsort(names, n, sizeof *names, cmp_str);
	for (size_t i = 1; i < n && rc == 0; i++)
		if (strcmp(names[i - 1], names[i]) == 0)
			rc = tier_fail(-EINVAL, "%s: tensor name '%s' appears twice", path, names[i]);
	free(names);
	return rc;
}

static int tensor_bytes(const char *path, const tier_st_wtensor *t, uint64_t *bytes)
{
	uint64_t b = tier_dtype_size(t->dtype);
	if (b == 0)
		return tier_fail(-EINVAL, "%s: tensor '%s': invalid dtype %d", path, t->name, (int)t->dtype);
	if (t->ndim < 0 || t->ndim > TIER_ST_MAX_DIMS)
		return tier_fail(-EINVAL, "%s: tensor '%s': %d dimensions (0 to %d allowed)", path, t->name,
				 t->ndim, TIER_ST_MAX_DIMS);
	for (int d = 0; d < t->ndim; d++)
		if (t->shape[d] > INT64_MAX || tier_mul_overflow(b, t->shape[d], &b))
			return tier_fail(-EOVERFLOW, "%s: tensor '%s': shape overflows 64-bit sizes", path, t->name);
	if (b > 0 && !t->data)
		return tier_fail(-EINVAL, "%s: tensor '%s': data is NULL", path, t->name);
	*bytes = b;
	return 0;
}

static json_t *tensor_json(const tier_st_wtensor *t, uint64_t begin, uint64_t end)
{
	json_t *o = json_object(), *shape = json_array();
	for (int d = 0; d < t->ndim; d++)
		json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
	json_object_set_new(o, "dtype", json_string(tier_dtype_name(t->dtype)));
	json_object_set_new(o, "shape", shape);
	json_object_set_new(o, "data_offsets", json_pack("[II]", (json_int_t)begin, (json_int_t)end));
	return o;
}

/* Build the header: __metadata__ first, then tensors in the order given, data back to back. */
static int build_header(const char *path, const tier_st_wtensor *t, size_t n, const char *const *meta,
			char **text, size_t *len)
{
	json_t *root = json_object();
	uint64_t pos = 0, b;
	int rc = 0;
	if (meta && *meta) {
		json_t *m = json_object();
		for (size_t i = 0; meta[i] && rc == 0; i += 2) {
			if (!meta[i + 1] || json_object_set_new(m, meta[i], json_string(meta[i + 1])) < 0)
				rc = tier_fail(-EINVAL, "%s: metadata key '%s' has no value or is not UTF-8", path, meta[i]);
		}
		json_object_set_new(root, "__metadata__", m);
	}
	for (size_t i = 0; i < n && rc == 0; i++) {
		rc = tensor_bytes(path, &t[i], &b);
		if (rc == 0 && (tier_add_overflow(pos, b, &pos) || pos > INT64_MAX))
			rc = tier_fail(-EOVERFLOW, "%s: the data region overflows 64-bit sizes", path);
		if (rc == 0 && json_object_set_new(root, t[i].name, tensor_json(&t[i], pos - b, pos)) < 0)
			rc = tier_fail(-EINVAL, "%s: tensor name '%s' is not valid UTF-8", path, t[i].name);
	}
	char *s = rc == 0 ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
	json_decref(root);
	if (rc < 0)
		return rc;
	if (!s)
		return tier_fail(-ENOMEM, "%s: cannot format the header", path);
	/* Pad with spaces so that the data region starts 8-byte aligned, as the reference writer does. */
	size_t l = strlen(s), padded = (size_t)tier_align_up(l, 8);
	char *p = malloc(8 + padded);
	if (!p) {
		free(s);
		return tier_fail(-ENOMEM, "%s: out of memory", path);
	}
	for (int i = 0; i < 8; i++)
		p[i] = (char)((uint64_t)padded >> (8 * i));
	memcpy(p + 8, s, l);
	memset(p + 8 + l, ' ', padded - l);
	free(s);
	*text = p;
	*len = 8 + padded;
	return 0;
}

int tier_st_write(const char *path, const tier_st_wtensor *t, size_t n, const char *const *metadata)
{
	char *hdr = NULL;
	size_t hlen = 0;
	tier_atomic_file *f;
	int rc = check_names(path, t, n);
	if (rc == 0)
		rc = build_header(path, t, n, metadata, &hdr, &hlen);
	if (rc < 0)
		return rc;
	rc = tier_atomic_write_begin(path, &f);
	if (rc == 0)
		rc = tier_atomic_write(f, hdr, hlen);
	free(hdr);
	for (size_t i = 0; i < n && rc == 0; i++) {
		uint64_t b;
		tensor_bytes(path, &t[i], &b);
		rc = tier_atomic_write(f, t[i].data, (size_t)b);
	}
	if (rc < 0) {
		tier_atomic_write_abort(f);
		return rc;
	}
	return tier_atomic_write_commit(f);
}

#else

int tier_st_write(const char *path, const tier_st_wtensor *t, size_t n, const char *const *metadata)
{
	return tier_st_no_jansson(path);
}

#endif
