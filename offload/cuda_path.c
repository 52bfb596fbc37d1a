/* cuda_path.c - HBM<->DDR on two non-blocking copy streams with events as fences, fed through the
 * metered queues of cuda_feed.c, and NVMe<->HBM pipelined through a ring of pinned staging buffers. Without CUDA (or with a CPU context), HBM is
 * host memory and this file only says so. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "offload_impl.h"

#ifdef TIER_HAVE_CUDA

/* Synchronization: mu guards the free list of staging buffers (free_idx[0..nfree)). Streams and
 * buffers are created once and read-only afterwards. */
struct off_cuda {
	int ordinal;
	cudaStream_t h2d, d2h;
	off_feed *feed_h2d, *feed_d2h; /* what goes on h2d (with d2d) and d2h, and when */
	void **stage;
	cudaEvent_t *stage_ev;  /* recorded after the copy that last used the buffer */
	unsigned nstage;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	unsigned *free_idx, nfree;
};

#define CU_FAIL(call, code, ...)                                                                   \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess) {                                                           \
			char m_[160];                                                              \
			snprintf(m_, sizeof m_, __VA_ARGS__);                                      \
			return tier_fail(code, "%s: %s: %s", m_, #call, cudaGetErrorString(e_));   \
		}                                                                                  \
	} while (0)

int cuda_create(tier_offload *off)
{
	tier_dev *dev = off->cfg.dev;
	off->cuda = NULL;
	if (!dev || tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return 0;
	off_cuda *c = calloc(1, sizeof *c);
	if (!c)
		return tier_fail(-ENOMEM, "offload: out of memory for the CUDA state");
	off->cuda = c; /* from here cuda_destroy frees what was made */
	c->ordinal = tier_dev_ordinal(dev);
	pthread_mutex_init(&c->mu, NULL);
	pthread_cond_init(&c->cv, NULL);
	CU_FAIL(cudaSetDevice(c->ordinal), -EIO, "offload: device %d", c->ordinal);
	CU_FAIL(cudaStreamCreateWithFlags(&c->h2d, cudaStreamNonBlocking), -EIO, "offload: h2d copy stream");
	CU_FAIL(cudaStreamCreateWithFlags(&c->d2h, cudaStreamNonBlocking), -EIO, "offload: d2h copy stream");
	int rc;
	if ((rc = feed_create(c->ordinal, c->h2d, off->cfg.chunk_bytes, &c->feed_h2d)) ||
	    (rc = feed_create(c->ordinal, c->d2h, off->cfg.chunk_bytes, &c->feed_d2h)))
		return rc;
	unsigned n = off->cfg.staging_count;
	c->stage = calloc(n, sizeof *c->stage);
	c->stage_ev = calloc(n, sizeof *c->stage_ev);
	c->free_idx = calloc(n, sizeof *c->free_idx);
	if (!c->stage || !c->stage_ev || !c->free_idx)
		return tier_fail(-ENOMEM, "offload: out of memory for the staging ring");
	for (; c->nstage < n; c->nstage++) {
		unsigned i = c->nstage;
		CU_FAIL(cudaHostAlloc(&c->stage[i], off->cfg.staging_bytes, cudaHostAllocDefault), -ENOMEM,
			"offload: pinned staging buffer %u of %llu bytes (lower staging_bytes or staging_count)", i,
			(unsigned long long)off->cfg.staging_bytes);
		if (cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming) != cudaSuccess) {
			cudaFreeHost(c->stage[i]);
			return tier_fail(-EIO, "offload: cannot create a staging event");
		}
		c->free_idx[c->nfree++] = i;
	}
	return 0;
}

void cuda_destroy(tier_offload *off)
{
	off_cuda *c = off->cuda;
	if (!c)
		return;
	cudaSetDevice(c->ordinal);
	feed_destroy(c->feed_h2d); /* issues what is queued: the streams are synchronized below */
	feed_destroy(c->feed_d2h);
	if (c->h2d)
		cudaStreamSynchronize(c->h2d), cudaStreamDestroy(c->h2d);
	if (c->d2h)
		cudaStreamSynchronize(c->d2h), cudaStreamDestroy(c->d2h);
	for (unsigned i = 0; i < c->nstage; i++) {
		cudaEventDestroy(c->stage_ev[i]);
		cudaFreeHost(c->stage[i]);
	}
	free(c->stage);
	free(c->stage_ev);
	free(c->free_idx);
	pthread_mutex_destroy(&c->mu);
	pthread_cond_destroy(&c->cv);
	free(c);
	off->cuda = NULL;
}

int cuda_submit_copy(tier_offload *off, const tier_xfer *x, tier_link link, tier_fence *f)
{
	off_cuda *c = off->cuda;
	enum cudaMemcpyKind kind = link == TIER_LINK_H2D ? cudaMemcpyHostToDevice
				   : link == TIER_LINK_D2H ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
	CU_FAIL(cudaSetDevice(c->ordinal), -EIO, "offload: device %d", c->ordinal);
	f->cuda = 1;
	f->dev_ordinal = c->ordinal;
	CU_FAIL(cudaEventCreate(&f->start), -EIO, "offload: fence event");
	CU_FAIL(cudaEventCreate(&f->end), -EIO, "offload: fence event");
	feed_push(link == TIER_LINK_D2H ? c->feed_d2h : c->feed_h2d, f, x, kind, (x->flags & TIER_XFER_URGENT) != 0);
	/* the stream will run it: count it now; busy time shows on the fence once waited */
	link_end(off, link, x->len, 0, 0);
	return 0;
}

void cuda_fence_release(tier_fence *f)
{
	if (f->start)
		cudaEventDestroy(f->start);
	if (f->end)
		cudaEventDestroy(f->end);
}

int cuda_fence_wait(tier_fence *f)
{
	int rc = feed_wait_issued(f);
	if (rc)
		return tier_fail(rc, "%s", f->msg);
	cudaError_t e = cudaEventSynchronize(f->end);
	if (e != cudaSuccess)
		return tier_fail(-EIO, "offload: CUDA copy failed: %s", cudaGetErrorString(e));
	pthread_mutex_lock(&f->mu);
	if (!atomic_load(&f->done)) {
		float ms = 0;
		if (cudaEventElapsedTime(&ms, f->start, f->end) == cudaSuccess)
			f->busy_ns = (uint64_t)(ms * 1e6);
		atomic_store(&f->done, 1);
	}
	pthread_mutex_unlock(&f->mu);
	return 0;
}

int cuda_fence_query(const tier_fence *f)
{
	if (!atomic_load(&f->issued))
		return 0;
	return f->result || cudaEventQuery(f->end) != cudaErrorNotReady;
}

int cuda_fence_stream_wait(tier_fence *f, void *stream)
{
	int rc = feed_wait_issued(f); /* the event to wait for must be recorded first */
	if (rc)
		return tier_fail(rc, "%s", f->msg);
	cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, f->end, 0);
	if (e != cudaSuccess)
		return tier_fail(-EIO, "offload: cudaStreamWaitEvent: %s", cudaGetErrorString(e));
	return 0;
}

/* Take up to two staging buffers (at least one): two let the file and the PCIe link overlap. */
static unsigned stage_take(off_cuda *c, unsigned *idx)
{
	unsigned k = 0;
	pthread_mutex_lock(&c->mu);
	while (!c->nfree)
		pthread_cond_wait(&c->cv, &c->mu);
	while (c->nfree && k < 2)
		idx[k++] = c->free_idx[--c->nfree];
	pthread_mutex_unlock(&c->mu);
	return k;
}

static void stage_give(off_cuda *c, const unsigned *idx, unsigned k)
{
	pthread_mutex_lock(&c->mu);
	for (unsigned i = 0; i < k; i++)
		c->free_idx[c->nfree++] = idx[i];
	pthread_cond_broadcast(&c->cv);
	pthread_mutex_unlock(&c->mu);
}

#define CU_MSG(call, ...)                                                                          \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess) {                                                           \
			snprintf(msg, msglen, "offload: %s: %s", #call, cudaGetErrorString(e_));   \
			rc = -EIO;                                                                 \
			goto out;                                                                  \
		}                                                                                  \
	} while (0)

/* Piece i of the transfer: [i * sb, ...). */
static int staged_to_hbm(tier_offload *off, job *j, const unsigned *b, unsigned k, uint32_t *crc, char *msg, size_t msglen)
{
	off_cuda *c = off->cuda;
	uint64_t sb = off->cfg.staging_bytes, len = j->x.len;
	int rc = 0, want = !!(j->x.flags & (TIER_XFER_CRC_COMPUTE | TIER_XFER_CRC_VERIFY));
	for (uint64_t o = 0, i = 0; o < len; o += sb, i++) {
		uint64_t n = len - o < sb ? len - o : sb;
		unsigned s = b[i % k];
		CU_MSG(cudaEventSynchronize(c->stage_ev[s])); /* the buffer's previous copy is done */
		if ((rc = file_rw(off, j->fd_src, j->direct, 1, c->stage[s], n, j->x.src.offset + o, msg, msglen)))
			goto out;
		if (want)
			*crc = tier_crc32c(*crc, c->stage[s], n);
		CU_MSG(cudaMemcpyAsync((char *)j->x.dst.ptr + o, c->stage[s], n, cudaMemcpyHostToDevice, c->h2d));
		CU_MSG(cudaEventRecord(c->stage_ev[s], c->h2d));
	}
out:
	for (unsigned i = 0; i < k; i++)
		cudaEventSynchronize(c->stage_ev[b[i]]);
	return rc;
}

static int staged_from_hbm(tier_offload *off, job *j, const unsigned *b, unsigned k, uint32_t *crc, char *msg, size_t msglen)
{
	off_cuda *c = off->cuda;
	uint64_t sb = off->cfg.staging_bytes, len = j->x.len, np = (len + sb - 1) / sb;
	int rc = 0, want = !!(j->x.flags & (TIER_XFER_CRC_COMPUTE | TIER_XFER_CRC_VERIFY));
	/* copy piece i into buffer i % k; piece i + 1 is copied while piece i is written */
	for (uint64_t i = 0; i < np && i < k; i++) {
		uint64_t o = i * sb, n = len - o < sb ? len - o : sb;
		CU_MSG(cudaMemcpyAsync(c->stage[b[i]], (const char *)j->x.src.ptr + o, n, cudaMemcpyDeviceToHost, c->d2h));
		CU_MSG(cudaEventRecord(c->stage_ev[b[i]], c->d2h));
	}
	for (uint64_t i = 0; i < np; i++) {
		uint64_t o = i * sb, n = len - o < sb ? len - o : sb;
		unsigned s = b[i % k];
		CU_MSG(cudaEventSynchronize(c->stage_ev[s]));
		if (want)
			*crc = tier_crc32c(*crc, c->stage[s], n);
		if ((rc = file_rw(off, j->fd_dst, j->direct, 0, c->stage[s], n, j->x.dst.offset + o, msg, msglen)))
			goto out;
		if (i + k < np) {
			uint64_t o2 = (i + k) * sb, n2 = len - o2 < sb ? len - o2 : sb;
			CU_MSG(cudaMemcpyAsync(c->stage[s], (const char *)j->x.src.ptr + o2, n2, cudaMemcpyDeviceToHost, c->d2h));
			CU_MSG(cudaEventRecord(c->stage_ev[s], c->d2h));
		}
	}
out:
	for (unsigned i = 0; i < k; i++)
		cudaEventSynchronize(c->stage_ev[b[i]]);
	return rc;
}

int cuda_staged_chunk(tier_offload *off, job *j, uint32_t *crc, char *msg, size_t msglen)
{
	off_cuda *c = off->cuda;
	unsigned b[2];
	int rc;
	if (cudaSetDevice(c->ordinal) != cudaSuccess) {
		snprintf(msg, msglen, "offload: cannot select CUDA device %d", c->ordinal);
		return -EIO;
	}
	unsigned k = stage_take(c, b);
	*crc = 0;
	if (j->link == TIER_LINK_NVME_TO_HBM)
		rc = staged_to_hbm(off, j, b, k, crc, msg, msglen);
	else
		rc = staged_from_hbm(off, j, b, k, crc, msg, msglen);
	stage_give(c, b, k);
	j->crc_done = 1;
	return rc;
}

#else /* !TIER_HAVE_CUDA */

int cuda_create(tier_offload *off)
{
	off->cuda = NULL;
	if (off->cfg.dev && tier_dev_kind_of(off->cfg.dev) == TIER_DEV_CUDA)
		return tier_fail(-ENODEV, "offload: this build has no CUDA; use a CPU device context");
	return 0;
}

void cuda_destroy(tier_offload *off) { (void)off; }

#endif
