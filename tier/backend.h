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

#include <stdint.h>
#include "tier/store.h"

/* A range allocator over [0, capacity): best fit with coalescing of neighbours on free. */
typedef struct tier_range tier_range;
int range_create(tier_range **out, uint64_t capacity, uint64_t align);   /* 0, -ENOMEM, -EINVAL */
void range_destroy(tier_range *r);
/* 0 and the offset, or -ENOSPC (no free run large enough; *off untouched). */
int range_alloc(tier_range *r, uint64_t size, uint64_t *off);
void range_free(tier_range *r, uint64_t off, uint64_t size);
uint64_t range_used(const tier_range *r);      /* sum of rounded sizes allocated */
uint64_t range_largest_free(const tier_range *r);
uint64_t range_align(const tier_range *r);
/* Check the free list (sorted, coalesced, inside capacity, sums agree). 0 or -EPROTO. */
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

/* Reserve the tier. Returns 0 or -E2BIG / -ENOMEM / -ENOENT / -EACCES / -ENOTDIR / -ENOSPC with a
 * message naming the tier, the budget or the directory, and how to fix it; nothing left behind. */
int backend_create(tier_backend **out, const tier_backend_config *cfg);
/* Free the reservation; NVMe files are closed and removed. */
void backend_destroy(tier_backend *b);
/* Allocate an extent of at least `size` bytes. 0 or -ENOSPC (*ext untouched). */
int backend_alloc(tier_backend *b, uint64_t size, tier_extent *ext);
void backend_free(tier_backend *b, const tier_extent *ext);
uint64_t backend_capacity(const tier_backend *b); /* after clamping */
uint64_t backend_used(const tier_backend *b);
uint64_t backend_largest_free(const tier_backend *b);
/* Bytes `size` takes from the budget once rounded (for admission checks). */
uint64_t backend_rounded(const tier_backend *b, uint64_t size);
/* 1 when this tier is host memory standing in for HBM. */
int backend_emulated(const tier_backend *b);
/* Check the allocator's invariants. 0 or -EPROTO with a message. */
int backend_check(const tier_backend *b);

#endif
