/* meta_alloc.h - (internal) host memory for the store's small metadata (object records, lists).
 *
 * With jemalloc, from a private arena without thread cache, so that metadata churn neither
 * fragments nor is fragmented by the rest of the process, and its footprint can be read from the
 * arena's stats; without jemalloc (or under valgrind, so that memcheck sees every block), plain
 * malloc. Never used for tier memory: that is carved from the tier reservations (backend.h).
 * Thread-safe. */
#ifndef TIER_META_ALLOC_H
#define TIER_META_ALLOC_H

#include <stddef.h>

/* NULL when out of memory (or size 0); no message is set: the caller names what it was for. */
void *tier_meta_alloc(size_t size);
/* Zeroed; NULL on overflow of n * size, or out of memory. */
void *tier_meta_calloc(size_t n, size_t size);
/* NULL is fine. Only for pointers from tier_meta_alloc / tier_meta_calloc. */
void tier_meta_free(void *p);
/* 1 when the private jemalloc arena serves the calls (for reports and tests). */
int tier_meta_uses_arena(void);

#endif
