/* cuda_feed.c - the metered copy queues of the CUDA links: one per direction (h2d, which also
 * carries d2d, and d2h), each fed to its copy stream by a thread of its own that keeps at most
 * three pieces of chunk_bytes in flight on the GPU.
 *
 * Why a queue in software: the copy engine runs the copies it was given in the order it was given
 * them, whatever their stream. On the H200 a 4 KiB copy on a stream of its own finished only after
 * the 384 MiB queued before it on another stream. A demand fetch can therefore jump ahead of the
 * prefetches only while those still wait here. Urgent transfers join at the front; a transfer that
 * somebody waits for moves to the front (tier_fence_wait, tier_fence_stream_wait).
 *
 * Not metered: the staged NVMe<->HBM pieces that the workers put on the same streams (cuda_path.c),
 * up to staging_count buffers' worth. Waiting on a fence while tier_offload_destroy runs is the
 * caller's race (the queue is freed); waiting after it returns is fine: everything queued was
 * issued before the queue went.
 *
 * Synchronization: q->mu guards the queue (head, tail, the fences' qnext/qprev/fx_done), the
 * in-flight ring and stop. A fence's `issued` flips 0 -> 1 under both q->mu and f->mu, once its
 * last piece and its end event are on the stream (or it failed); waiters sleep on f->cv. Lock
 * order: q->mu before f->mu. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "offload_impl.h"

#ifdef TIER_HAVE_CUDA

#define FEED_RING 64 /* pieces in flight at most, whatever their size */

struct off_feed {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	cudaStream_t s;
	int ordinal;
	uint64_t piece, ahead; /* bytes per cudaMemcpyAsync; bytes in flight before the feeder waits */
	tier_fence *head, *tail;
	cudaEvent_t ring[FEED_RING]; /* recorded after each piece in flight, oldest at r0 */
	uint64_t ring_bytes[FEED_RING], inflight;
	unsigned r0, rn, nev;
	int stop, started;
	pthread_t thr;
};

static void q_unlink(off_feed *q, tier_fence *f)
{
	if (f->qprev)
		f->qprev->qnext = f->qnext;
	else
		q->head = f->qnext;
	if (f->qnext)
		f->qnext->qprev = f->qprev;
	else
		q->tail = f->qprev;
	f->qnext = f->qprev = NULL;
}

/* At the front, but behind a transfer whose first pieces are already on the stream (its start
 * event is recorded, and pieces of another transfer in between would count in its busy time), and
 * behind the transfers put at the front before it: first come, first served among the urgent. */
static void q_insert_front(off_feed *q, tier_fence *f)
{
	tier_fence *after = q->head && q->head->fx_done ? q->head : NULL;
	for (tier_fence *n = after ? after->qnext : q->head; n && n->fx_front; n = n->qnext)
		after = n;
	f->fx_front = 1;
	f->qprev = after;
	f->qnext = after ? after->qnext : q->head;
	if (f->qnext)
		f->qnext->qprev = f;
	else
		q->tail = f;
	if (after)
		after->qnext = f;
	else
		q->head = f;
}

static void q_append(off_feed *q, tier_fence *f)
{
	f->qnext = NULL;
	f->qprev = q->tail;
	if (q->tail)
		q->tail->qnext = f;
	else
		q->head = f;
	q->tail = f;
}

/* The head is wholly on the stream, or failed: out of the queue, waiters woken, the queue's
 * reference dropped. */
static void q_issued(off_feed *q, tier_fence *f, cudaError_t e)
{
	q_unlink(q, f);
	if (e != cudaSuccess) /* its pieces already on the stream still move data: the fence may not
			       * report done (and its memory be reused) before they have */
		(void)cudaStreamSynchronize(q->s);
	pthread_mutex_lock(&f->mu);
	if (e != cudaSuccess) {
		f->result = -EIO;
		snprintf(f->msg, sizeof f->msg, "offload: CUDA copy of %llu bytes could not be issued: %s",
			 (unsigned long long)f->fx.len, cudaGetErrorString(e));
	}
	atomic_store(&f->issued, 1);
	pthread_cond_broadcast(&f->cv);
	pthread_mutex_unlock(&f->mu);
	tier_fence_put(f);
}

/* Drop the pieces the GPU has finished from the ring. */
static void feed_reap(off_feed *q)
{
	while (q->rn && cudaEventQuery(q->ring[q->r0]) != cudaErrorNotReady) {
		q->inflight -= q->ring_bytes[q->r0];
		q->r0 = (q->r0 + 1) % FEED_RING;
		q->rn--;
	}
}

/* Bytes of the head transfer's next piece. */
static uint64_t feed_next_bytes(const off_feed *q)
{
	const tier_fence *f = q->head;
	return f->fx.len - f->fx_done < q->piece ? f->fx.len - f->fx_done : q->piece;
}

/* The wait between two looks at the oldest piece in flight: short against a piece's time on the
 * link (8 MiB: ~160 us on PCIe 5), which the piece behind it covers. */
static void feed_nap(void)
{
	struct timespec ts = { 0, 20000 };
	nanosleep(&ts, NULL);
}

/* Put the next piece of the head transfer on the stream (and its events). */
static void feed_issue(off_feed *q)
{
	tier_fence *f = q->head;
	uint64_t n = feed_next_bytes(q);
	unsigned slot = (q->r0 + q->rn) % FEED_RING;
	cudaError_t e = cudaSuccess;
	if (!f->fx_done)
		e = cudaEventRecord(f->start, q->s);
	if (e == cudaSuccess && n)
		e = cudaMemcpyAsync((char *)f->fx.dst.ptr + f->fx_done, (const char *)f->fx.src.ptr + f->fx_done, n,
				    (enum cudaMemcpyKind)f->fx_kind, q->s);
	if (e == cudaSuccess && (e = cudaEventRecord(q->ring[slot], q->s)) == cudaSuccess) {
		q->ring_bytes[slot] = n;
		q->inflight += n;
		q->rn++;
	}
	f->fx_done += n;
	if (e == cudaSuccess && f->fx_done == f->fx.len)
		e = cudaEventRecord(f->end, q->s);
	if (e != cudaSuccess || f->fx_done == f->fx.len)
		q_issued(q, f, e);
}

static void *feed_main(void *arg)
{
	off_feed *q = arg;
	cudaSetDevice(q->ordinal);
	pthread_mutex_lock(&q->mu);
	for (;;) {
		while (!q->head && !q->stop)
			pthread_cond_wait(&q->cv, &q->mu);
		if (!q->head)
			break; /* stopping, and everything queued is on the stream */
		feed_reap(q);
		if (q->rn == FEED_RING || (q->rn && q->inflight + feed_next_bytes(q) > q->ahead)) {
			pthread_mutex_unlock(&q->mu);
			feed_nap(); /* polled: cudaEventSynchronize would spin a core all step long */
			pthread_mutex_lock(&q->mu);
			continue; /* the head may have changed meanwhile */
		}
		feed_issue(q);
	}
	pthread_mutex_unlock(&q->mu);
	return NULL;
}

void feed_destroy(off_feed *q)
{
	if (!q)
		return;
	if (q->started) {
		pthread_mutex_lock(&q->mu);
		q->stop = 1;
		pthread_cond_broadcast(&q->cv);
		pthread_mutex_unlock(&q->mu);
		pthread_join(q->thr, NULL);
	}
	for (unsigned i = 0; i < q->nev; i++)
		cudaEventDestroy(q->ring[i]);
	pthread_mutex_destroy(&q->mu);
	pthread_cond_destroy(&q->cv);
	free(q);
}

int feed_create(int ordinal, cudaStream_t s, uint64_t piece, off_feed **out)
{
	off_feed *q = calloc(1, sizeof *q);
	*out = NULL;
	if (!q)
		return tier_fail(-ENOMEM, "offload: out of memory for a copy queue");
	pthread_mutex_init(&q->mu, NULL);
	pthread_cond_init(&q->cv, NULL);
	q->s = s;
	q->ordinal = ordinal;
	q->piece = piece;
	q->ahead = 3 * piece; /* the GPU does not run dry while the feeder naps */
	for (; q->nev < FEED_RING; q->nev++)
		if (cudaEventCreateWithFlags(&q->ring[q->nev], cudaEventDisableTiming) != cudaSuccess) {
			feed_destroy(q);
			return tier_fail(-EIO, "offload: cannot create the copy queue's events");
		}
	if (pthread_create(&q->thr, NULL, feed_main, q)) {
		feed_destroy(q);
		return tier_fail(-EAGAIN, "offload: cannot start a copy queue thread");
	}
	q->started = 1;
	*out = q;
	return 0;
}

/* Queue a copy (fence events already made). The queue holds a reference to f until it is issued. */
void feed_push(off_feed *q, tier_fence *f, const tier_xfer *x, int kind, int urgent)
{
	f->feed = q;
	f->fx = *x;
	f->fx_kind = kind;
	f->fx_done = 0;
	f->fx_front = 0;
	tier_fence_get(f);
	pthread_mutex_lock(&q->mu);
	if (urgent)
		q_insert_front(q, f);
	else
		q_append(q, f);
	pthread_cond_signal(&q->cv);
	pthread_mutex_unlock(&q->mu);
}

/* Somebody waits for f: to the front of its queue (unless already on the stream), then wait until
 * its end event is recorded. 0, or the error of issuing it. */
int feed_wait_issued(tier_fence *f)
{
	off_feed *q = f->feed;
	int rc;
	if (!q || atomic_load(&f->issued))
		return f->result;
	pthread_mutex_lock(&q->mu);
	if (!atomic_load(&f->issued) && q->head != f && !f->fx_done && !f->fx_front) {
		q_unlink(q, f);
		q_insert_front(q, f);
		pthread_cond_signal(&q->cv);
	}
	pthread_mutex_unlock(&q->mu);
	pthread_mutex_lock(&f->mu);
	while (!atomic_load(&f->issued))
		pthread_cond_wait(&f->cv, &f->mu);
	rc = f->result;
	pthread_mutex_unlock(&f->mu);
	return rc;
}

#endif
