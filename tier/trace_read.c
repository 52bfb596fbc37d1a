/* trace_read.c - reading and validating store access traces (docs/trace.md). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/store.h"
#include "trace_format.h"

struct tier_trace_reader {
	FILE *f;
	uint32_t version;
	uint64_t off; /* byte offset of the next record */
	char *path;
};

static int hdr_bad(FILE *f, const char *path, const char *what)
{
	fclose(f);
	return tier_fail(-EBADMSG, "%s: %s", path, what);
}

int tier_trace_open_read(tier_trace_reader **out, const char *path)
{
	if (!out || !path)
		return tier_fail(-EINVAL, "tier_trace_open_read: out and path must not be NULL");
	*out = NULL;
	FILE *f = fopen(path, "rb");
	if (!f)
		return tier_fail(-errno, "cannot open trace %s: %s", path, strerror(errno));
	unsigned char h[TRACE_HDR_SIZE];
	size_t n = fread(h, 1, sizeof h, f);
	if (n < 8 || memcmp(h, TRACE_MAGIC, 8))
		return hdr_bad(f, path, "not a tier trace (offset 0: the magic \"" TRACE_MAGIC "\" is missing)");
	if (n < sizeof h)
		return hdr_bad(f, path, "truncated header (the file ends before offset 32)");
	uint32_t ver = trace_get32(h + 8), rs = trace_get32(h + 12), flags = trace_get32(h + 16);
	if (ver < 1 || ver > TRACE_VERSION) {
		fclose(f);
		return tier_fail(-EBADMSG, "%s: trace version %u at offset 8; this build reads versions 1 to %u: use the tier that "
				 "wrote it", path, ver, TRACE_VERSION);
	}
	if (rs != TRACE_REC_SIZE) {
		fclose(f);
		return tier_fail(-EBADMSG, "%s: record size %u at offset 12; version %u records are %u bytes", path, rs,
				 TRACE_VERSION, TRACE_REC_SIZE);
	}
	if (flags) {
		fclose(f);
		return tier_fail(-EBADMSG, "%s: unknown flags 0x%x at offset 16 (version %u defines none)", path, flags, ver);
	}
	tier_trace_reader *r = calloc(1, sizeof *r);
	char *p = strdup(path);
	if (!r || !p) {
		free(r);
		free(p);
		fclose(f);
		return tier_fail(-ENOMEM, "out of memory opening trace %s", path);
	}
	r->f = f;
	r->version = ver;
	r->off = TRACE_HDR_SIZE;
	r->path = p;
	*out = r;
	return 0;
}

int tier_trace_next(tier_trace_reader *r, tier_trace_rec *rec)
{
	if (!r || !rec)
		return tier_fail(-EINVAL, "tier_trace_next: reader and record must not be NULL");
	unsigned char b[TRACE_REC_SIZE];
	size_t n = fread(b, 1, sizeof b, r->f);
	if (n == 0 && feof(r->f))
		return 0;
	if (n < sizeof b) {
		if (ferror(r->f))
			return tier_fail(-EIO, "%s: read error at offset %llu", r->path, (unsigned long long)r->off);
		return tier_fail(-EBADMSG, "%s: truncated record at offset %llu (%zu of %u bytes): the recorder did not finish",
				 r->path, (unsigned long long)r->off, n, TRACE_REC_SIZE);
	}
	trace_decode(b, rec);
	uint64_t at = r->off;
	r->off += sizeof b;
	int kinds = r->version == 1 ? TIER_TRC_AT_OP : TIER_TRC_NKINDS - 1; /* version 1 had no discard */
	if (rec->kind < TIER_TRC_ACQUIRE || rec->kind > kinds)
		return tier_fail(-EBADMSG, "%s: record at offset %llu has kind %u (1..%d exist in version %u)", r->path,
				 (unsigned long long)at, rec->kind, kinds, r->version);
	if (rec->tier >= TIER_NTIERS || rec->cls >= TIER_NCLASSES || rec->hit > 1 || trace_get32(b + 28))
		return tier_fail(-EBADMSG, "%s: record at offset %llu is corrupt (tier %u, class %u, hit %u)", r->path,
				 (unsigned long long)at, rec->tier, rec->cls, rec->hit);
	return 1;
}

void tier_trace_close_read(tier_trace_reader *r)
{
	if (!r)
		return;
	fclose(r->f);
	free(r->path);
	free(r);
}
