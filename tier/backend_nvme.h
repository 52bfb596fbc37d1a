/* backend_nvme.h - (internal) the NVMe tier's files: one preallocated file per directory, striped.
 * Used by backend.c; tests reach the knobs below through it. Not thread-safe (the store's lock). */
#ifndef TIER_BACKEND_NVME_H
#define TIER_BACKEND_NVME_H

#include <stdint.h>
#include "tier/backend.h"

typedef struct tier_nvme tier_nvme;

/* Check every directory, create, preallocate and register one file in each. The budget is split
 * evenly (4 KiB multiples); the returned capacity is the sum of the shares. 0, or -EINVAL,
 * -ENOENT, -ENOTDIR, -EACCES, -EROFS, -ENOSPC, -EIO, -ENOMEM with a message naming the directory;
 * nothing is left behind on failure (no file, no registration). */
int nvme_create(tier_nvme **out, uint64_t capacity, const char *const *dirs, unsigned n_dirs,
		tier_offload *offload);
void nvme_destroy(tier_nvme *n);
int nvme_alloc(tier_nvme *n, uint64_t size, tier_extent *ext);   /* 0, -ENOSPC, -EINVAL, -ENOMEM */
void nvme_free(tier_nvme *n, const tier_extent *ext);
uint64_t nvme_capacity(const tier_nvme *n);
uint64_t nvme_used(const tier_nvme *n);
uint64_t nvme_largest_free(const tier_nvme *n);
int nvme_check(const tier_nvme *n);
unsigned nvme_files(const tier_nvme *n);
/* 1 when file i was opened O_DIRECT, 0 when its file system refused and buffered I/O is used. */
int nvme_file_direct(const tier_nvme *n, unsigned i);
/* Tests: make every following open behave as if O_DIRECT were refused with EINVAL (the kernel's
 * answer on file systems without direct I/O), to exercise the buffered fallback. Not thread-safe. */
void nvme_test_refuse_direct(int on);

#endif
