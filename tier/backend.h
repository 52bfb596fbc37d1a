/* backend.h - (internal) the memory behind each tier: one reservation per tier carved by a range
 * allocator, so that a tier's budget bounds exactly what the process takes, overhead included.
 *
 *   HBM:  one device allocation (emulated: host memory) of the HBM budget.
 *   DDR:  one host reservation of the DDR budget, pinned when CUDA is present, bound to the GPU's
 *         NUMA node (hwloc + libnuma).
 *   NVMe: one preallocated file per directory (striped round-robin), opened O_DIRECT where the
 *         file system allows, registered with the offload engine; 4 KiB-aligned extents.
 *
 * Every extent's size is rounded up to the tier's alignment; `used` counts the rounded sizes, so
 * budgets include the allocator's overhead. Not thread-safe: the store calls under its lock. */
#ifndef TIER_BACKEND_H
#define TIER_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include "tier/store.h"

/* A range allocator over [0, capacity): best fit (smallest free run that fits, lowest offset among
 * equals) with coalescing of neighbours on free; O(log n) per operation (two treaps over the free
 * runs, by offset and by size). Sizes are rounded up to `align`. Not thread-safe. */
typedef struct tier_range tier_range;
/* align: a power of two; capacity is rounded down to it (must stay > 0). 0, -ENOMEM, -EINVAL. */
int range_create(tier_range **out, uint64_t capacity, uint64_t align);
void range_destroy(tier_range *r);       /* NULL is fine */
/* 0 and the offset (a multiple of align), or -ENOSPC (no free run large enough; no message is set,
 * the caller names the tier), -EINVAL (size 0), -ENOMEM (bookkeeping); *off untouched on failure. */
int range_alloc(tier_range *r, uint64_t size, uint64_t *off);
/* Give back [off, off + size) as returned by range_alloc with the same size. Never fails; a range
 * that was not allocated (out of bounds, misaligned, overlapping free space) is logged at ERROR
 * and ignored. */
void range_free(tier_range *r, uint64_t off, uint64_t size);
uint64_t range_used(const tier_range *r);      /* sum of rounded sizes allocated */
uint64_t range_largest_free(const tier_range *r);
uint64_t range_align(const tier_range *r);
uint64_t range_capacity(const tier_range *r);  /* after rounding down to align */
size_t range_runs(const tier_range *r);        /* number of free runs (1 when all is free) */
uint64_t range_rounded(const tier_range *r, uint64_t size); /* size rounded up to align */
/* Check the free runs (sorted by offset and by size, coalesced, aligned, inside capacity, both
 * trees agree, free + used == capacity). 0 or -EPROTO with a message naming the broken one. */
int range_check(const tier_range *r);

typedef struct tier_backend tier_backend;

/* An allocated extent: a memory address (HBM, DDR) or a file and offset (NVMe). */
typedef struct {
	uint64_t offset;   /* in the tier's address space (stripe-major for NVMe) */
	uint64_t bytes;    /* rounded size taken from the budget */
	tier_loc loc;      /* where the offload engine finds it */
} tier_extent;

typedef struct {
	tier_id tier;
	uint64_t capacity;
	tier_dev *dev;              /* HBM: where to reserve; DDR: for pinning and the NUMA node */
	tier_offload *offload;      /* NVMe: files are registered here */
	const char *const *dirs;    /* NVMe directories */
	unsigned n_dirs;
	int clamp;                  /* clamp a budget above the machine with a warning instead of -E2BIG */
} tier_backend_config;

/* Reserve the tier. Returns 0 or -EINVAL (budget 0, no directories or offload engine for NVMe),
 * -E2BIG (HBM/DDR budget above what the machine has, unless cfg->clamp: then clamped with a
 * warning), -ENOMEM, -ENODEV, and for NVMe -ENOENT / -ENOTDIR / -EACCES / -EROFS (directory) or
 * -ENOSPC (its file system lacks the space; NVMe budgets are never clamped, so that a clamp never
 * fills a disk to the brim) or -EIO, each with a message naming the tier, the budget or the
 * directory, and how to fix it; nothing is left behind (no memory, file or registration). */
int backend_create(tier_backend **out, const tier_backend_config *cfg);
/* Free the reservation; NVMe files are unregistered and closed (they were unlinked when created,
 * so their space returns to the file system even when the process dies). NULL is fine. */
void backend_destroy(tier_backend *b);
/* Allocate an extent of at least `size` bytes. 0, or -ENOSPC (no message: the caller evicts or
 * names the tier), -EINVAL (size 0), -ENOMEM; *ext untouched on failure. HBM extents are DEVICE
 * locations (host pointers when emulated), DDR extents HOST, NVMe extents FILE (registered id and
 * offset in that file; `offset` is in the tier's address space, the files laid end to end). */
int backend_alloc(tier_backend *b, uint64_t size, tier_extent *ext);
/* Give an extent back (as backend_alloc filled it). An extent not from this tier is logged at
 * ERROR and ignored. */
void backend_free(tier_backend *b, const tier_extent *ext);
uint64_t backend_capacity(const tier_backend *b); /* after clamping */
uint64_t backend_used(const tier_backend *b);
uint64_t backend_largest_free(const tier_backend *b);
/* Bytes `size` takes from the budget once rounded (for admission checks). */
uint64_t backend_rounded(const tier_backend *b, uint64_t size);
/* 1 when this tier is host memory standing in for HBM. */
int backend_emulated(const tier_backend *b);
/* Check the allocator's invariants (range_check of every allocator, capacity and use agree, the
 * reservation is there and aligned, NVMe files still hold their share). 0 or -EPROTO with a message. */
int backend_check(const tier_backend *b);
/* DDR: the NUMA node the reservation prefers, -1 when placement was left to the kernel. */
int backend_numa_node(const tier_backend *b);
/* DDR: 1 when the reservation is page-locked for CUDA. */
int backend_pinned(const tier_backend *b);
/* NVMe: the files (see backend_nvme.h); NULL for the other tiers. */
struct tier_nvme;
const struct tier_nvme *backend_nvme(const tier_backend *b);

#endif
