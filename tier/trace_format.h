/* trace_format.h - (internal) byte layout of trace files, shared by the writer and the reader.
 * Header (32 bytes): "TIERTRC1", u32 version, u32 record size, u32 flags, 12 bytes zero.
 * Record (32 bytes): u64 object, u64 size, u32 op, u32 step, u8 kind, tier, class, hit, 4 zero.
 * All integers little-endian. See docs/trace.md. */
#ifndef TIER_TRACE_FORMAT_H
#define TIER_TRACE_FORMAT_H

#include <stdint.h>
#include <string.h>
#include "tier/store.h"

#define TRACE_MAGIC "TIERTRC1"
#define TRACE_VERSION 2u /* 2 added the discard record; version 1 files are read too */
#define TRACE_HDR_SIZE 32u
#define TRACE_REC_SIZE 32u

static inline void trace_put32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}
static inline void trace_put64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t trace_get32(const unsigned char *p)
{
	uint32_t v = 0;
	for (int i = 3; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}
static inline uint64_t trace_get64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static inline void trace_encode_header(unsigned char *p)
{
	memset(p, 0, TRACE_HDR_SIZE);
	memcpy(p, TRACE_MAGIC, 8);
	trace_put32(p + 8, TRACE_VERSION);
	trace_put32(p + 12, TRACE_REC_SIZE);
	trace_put32(p + 16, 0); /* flags: none defined */
}

static inline void trace_encode(unsigned char *p, const tier_trace_rec *r)
{
	trace_put64(p, r->object);
	trace_put64(p + 8, r->size);
	trace_put32(p + 16, r->op);
	trace_put32(p + 20, r->step);
	p[24] = r->kind;
	p[25] = r->tier;
	p[26] = r->cls;
	p[27] = r->hit;
	trace_put32(p + 28, 0);
}

static inline void trace_decode(const unsigned char *p, tier_trace_rec *r)
{
	r->object = trace_get64(p);
	r->size = trace_get64(p + 8);
	r->op = trace_get32(p + 16);
	r->step = trace_get32(p + 20);
	r->kind = p[24];
	r->tier = p[25];
	r->cls = p[26];
	r->hit = p[27];
}

#endif
