/* submit.c - checking a transfer request, splitting it in chunks and handing them to a mover. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "offload_impl.h"

static const tier_link link_of[3][3] = {
	/* dst:        HOST                 DEVICE                 FILE */
	/* HOST   */ { TIER_LINK_H2H,       TIER_LINK_H2D,         TIER_LINK_NVME_WRITE },
	/* DEVICE */ { TIER_LINK_D2H,       TIER_LINK_D2D,         TIER_LINK_HBM_TO_NVME },
	/* FILE   */ { TIER_LINK_NVME_READ, TIER_LINK_NVME_TO_HBM, TIER_NLINKS },
};

/* Resolve a file end: fd, O_DIRECT, io_uring slot. */
static int file_end(tier_offload *off, const tier_loc *l, uint64_t len, int *fd, int *direct, int *slot)
{
	uint64_t end;
	pthread_mutex_lock(&off->fmu);
	int ok = l->file >= 0 && l->file < off->nfiles && off->files[l->file].fd >= 0;
	if (ok) {
		*fd = off->files[l->file].fd;
		*direct = off->files[l->file].direct;
	}
	pthread_mutex_unlock(&off->fmu);
	if (!ok)
		return tier_fail(-EINVAL, "offload: file id %d is not registered (call tier_offload_register_file first)", l->file);
	if (tier_add_overflow(l->offset, len, &end) || end > (uint64_t)INT64_MAX)
		return tier_fail(-EINVAL, "offload: file range at offset %llu + %llu bytes overflows",
				 (unsigned long long)l->offset, (unsigned long long)len);
	*slot = off->uring ? l->file : -1;
	return 0;
}

static int check_loc(const tier_loc *l, const char *which, uint64_t len)
{
	if ((unsigned)l->kind > TIER_MEM_FILE)
		return tier_fail(-EINVAL, "offload: %s has unknown memory kind %d", which, (int)l->kind);
	if (l->kind != TIER_MEM_FILE && !l->ptr && len)
		return tier_fail(-EINVAL, "offload: %s address is NULL", which);
	return 0;
}

/* Check the request and fill the job's ends. */
static int request_check(tier_offload *off, const tier_xfer *x, job *j)
{
	int rc, direct = 0;
	if ((rc = check_loc(&x->src, "source", x->len)) || (rc = check_loc(&x->dst, "destination", x->len)))
		return rc;
	if (x->flags & ~(unsigned)(TIER_XFER_CRC_COMPUTE | TIER_XFER_CRC_VERIFY | TIER_XFER_URGENT))
		return tier_fail(-EINVAL, "offload: unknown transfer flags 0x%x", x->flags);
	j->link = link_of[x->src.kind][x->dst.kind];
	if (j->link == TIER_NLINKS)
		return tier_fail(-EINVAL, "offload: file-to-file transfers are not supported; go through host memory");
	j->fd_src = j->fd_dst = j->slot_src = j->slot_dst = -1;
	if (x->src.kind == TIER_MEM_FILE && (rc = file_end(off, &x->src, x->len, &j->fd_src, &direct, &j->slot_src)))
		return rc;
	if (x->dst.kind == TIER_MEM_FILE && (rc = file_end(off, &x->dst, x->len, &j->fd_dst, &direct, &j->slot_dst)))
		return rc;
	j->direct = direct;
	j->staged = off->cuda && (j->link == TIER_LINK_NVME_TO_HBM || j->link == TIER_LINK_HBM_TO_NVME);
	if (direct) {
		const tier_loc *f = x->src.kind == TIER_MEM_FILE ? &x->src : &x->dst;
		const tier_loc *m = x->src.kind == TIER_MEM_FILE ? &x->dst : &x->src;
		if (f->offset % OFF_ALIGN || x->len % OFF_ALIGN)
			return tier_fail(-EINVAL, "offload: O_DIRECT file %d needs 4 KiB alignment, but offset %llu or "
					 "length %llu is not a multiple of 4096; align the extent (the engine does not bounce)",
					 f->file, (unsigned long long)f->offset, (unsigned long long)x->len);
		if (!j->staged && (uintptr_t)m->ptr % OFF_ALIGN)
			return tier_fail(-EINVAL, "offload: O_DIRECT file %d needs a 4 KiB-aligned memory address, "
					 "but %p is not; allocate the buffer page-aligned", f->file, m->ptr);
	}
	if (off->cuda && (x->flags & (TIER_XFER_CRC_COMPUTE | TIER_XFER_CRC_VERIFY)) &&
	    (j->link == TIER_LINK_H2D || j->link == TIER_LINK_D2H || j->link == TIER_LINK_D2D))
		return tier_fail(-EINVAL, "offload: checksums are computed on file transfers and host copies only, "
				 "not on the CUDA %s link; checksum the NVMe copy instead", tier_link_name(j->link));
	return 0;
}

int tier_offload_submit(tier_offload *off, const tier_xfer *x, tier_fence **fence)
{
	job probe;
	int rc;
	if (!fence)
		return tier_fail(-EINVAL, "tier_offload_submit: NULL fence pointer");
	*fence = NULL;
	if (!off || !x)
		return tier_fail(-EINVAL, "tier_offload_submit: NULL engine or transfer");
	memset(&probe, 0, sizeof probe);
	if ((rc = request_check(off, x, &probe)))
		return rc;
	tier_fence *f = fence_new();
	if (!f)
		return tier_fail(-ENOMEM, "offload: out of memory for a fence");
#ifdef TIER_HAVE_CUDA
	if (off->cuda && (probe.link == TIER_LINK_H2D || probe.link == TIER_LINK_D2H || probe.link == TIER_LINK_D2D)) {
		if ((rc = cuda_submit_copy(off, x, probe.link, f))) {
			tier_fence_put(f);
			return rc;
		}
		*fence = f;
		return 0;
	}
#endif
	uint64_t cb = off->cfg.chunk_bytes;
	uint64_t n = probe.staged ? 1 : (x->len + cb - 1) / cb;
	if (n > (1u << 24)) {
		tier_fence_put(f);
		return tier_fail(-EINVAL, "offload: a transfer of %llu bytes makes %llu chunks; raise chunk_bytes or split it",
				 (unsigned long long)x->len, (unsigned long long)n);
	}
	job *j = calloc(1, sizeof *j + n * sizeof(chunk));
	if (!j) {
		tier_fence_put(f);
		return tier_fail(-ENOMEM, "offload: out of memory for a transfer of %llu chunks", (unsigned long long)n);
	}
	*j = probe;
	j->off = off;
	j->x = *x;
	j->fence = tier_fence_get(f);
	j->nchunks = (unsigned)n;
	atomic_init(&j->remaining, (unsigned)(n ? n : 1));
	atomic_init(&j->err, 0);
	atomic_init(&j->started, 0);
	*fence = f;
	if (!n) { /* nothing to move: complete at once */
		job_chunk_start(j);
		job_chunk_done(j, 0, "%s", "");
		return 0;
	}
	int to_ring = off->uring && !j->staged && (x->src.kind == TIER_MEM_FILE || x->dst.kind == TIER_MEM_FILE) &&
		      off->links[j->link].ns_per_byte <= 0;
	for (uint64_t i = 0; i < n; i++) {
		chunk *c = &j->chunks[i];
		c->job = j;
		c->off = i * cb;
		c->len = probe.staged ? x->len : (x->len - c->off < cb ? x->len - c->off : cb);
		c->next = i + 1 < n ? &j->chunks[i + 1] : NULL;
	}
	/* From here on the job may complete and be freed by another thread at any moment. */
	if (to_ring)
		for (uint64_t i = 0; i < n; i++)
			uring_submit(off, &j->chunks[i]);
	else
		queue_push(off, &j->chunks[0], &j->chunks[n - 1], (x->flags & TIER_XFER_URGENT) != 0);
	return 0;
}

int tier_offload_copy(tier_offload *off, const tier_xfer *x)
{
	tier_fence *f;
	int rc = tier_offload_submit(off, x, &f);
	if (rc)
		return rc;
	rc = tier_fence_wait(f);
	tier_fence_put(f);
	return rc;
}
