/* uring.c - DDR<->NVMe on io_uring: one ring driven by a dedicated thread, fixed file slots,
 * up to queue_depth requests in flight, short transfers resubmitted for their remainder. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "offload_impl.h"

#ifdef TIER_HAVE_LIBURING
#include <liburing.h>

#define URING_SLOTS 1024u   /* fixed-file table size; file ids beyond it use plain descriptors */

/* Synchronization: mu guards head, tail and stopping (submitters push, the ring thread takes the
 * whole list). Everything else belongs to the ring thread. The thread sleeps on cv when the ring is
 * empty and blocks in the ring only while requests are in flight (they complete by themselves), so
 * no eventfd poll is needed and valgrind, which cannot see into a blocked io_uring_enter, works. */
struct off_uring {
	struct io_uring ring;
	pthread_t thread;
	pthread_mutex_t mu;
	chunk *head, *tail;
	pthread_cond_t cv;  /* the ring thread sleeps on it when nothing is in flight */
	int stopping;
	int fixed;      /* the fixed-file table is registered */
	unsigned depth;
};

void uring_submit(tier_offload *off, chunk *c)
{
	off_uring *u = off->uring;
	int was_empty;
	c->next = NULL;
	pthread_mutex_lock(&u->mu);
	was_empty = !u->head;
	if (u->tail)
		u->tail->next = c;
	else
		u->head = c;
	u->tail = c;
	if (was_empty)
		pthread_cond_signal(&u->cv);
	pthread_mutex_unlock(&u->mu);
}

void uring_file_slot(tier_offload *off, int id, int fd)
{
	off_uring *u = off->uring;
	if (!u || !u->fixed || id < 0 || (unsigned)id >= URING_SLOTS)
		return;
	int r = io_uring_register_files_update(&u->ring, (unsigned)id, &fd, 1);
	if (r < 0)
		tier_log(TIER_LOG_WARN, "offload: io_uring cannot update fixed file slot %d: %s", id, strerror(-r));
}

/* Prepare the next request of a chunk. Returns 0, or an injected error (the chunk is finished). */
static int prep_chunk(tier_offload *off, off_uring *u, chunk *c, struct io_uring_sqe *sqe)
{
	job *j = c->job;
	int fd, is_read;
	uint64_t foff;
	char *mem;
	chunk_ends(c, &fd, &foff, &mem, &is_read);
	int slot = is_read ? j->slot_src : j->slot_dst;
	uint64_t n = c->len - c->done;
	int rc = fault_io(off, !is_read, &n, j->direct, &c->corrupt);
	if (rc)
		return rc;
	c->io_len = n;
	int use_slot = u->fixed && slot >= 0 && (unsigned)slot < URING_SLOTS;
	if (is_read)
		io_uring_prep_read(sqe, use_slot ? slot : fd, mem + c->done, (unsigned)n, foff + c->done);
	else
		io_uring_prep_write(sqe, use_slot ? slot : fd, mem + c->done, (unsigned)n, foff + c->done);
	if (use_slot)
		sqe->flags |= IOSQE_FIXED_FILE;
	io_uring_sqe_set_data(sqe, c);
	return 0;
}

/* A request completed: 1 when the chunk needs another request, 0 when it is finished. */
static int complete_chunk(tier_offload *off, chunk *c, int res)
{
	job *j = c->job;
	int is_read = j->x.src.kind == TIER_MEM_FILE;
	uint64_t foff = (is_read ? j->x.src.offset : j->x.dst.offset) + c->off + c->done;
	if (res == -EINTR || res == -EAGAIN)
		return 1;
	if (res < 0) {
		job_chunk_done(j, res, "file %s of %llu bytes at offset %llu failed: %s", is_read ? "read" : "write",
			       (unsigned long long)c->io_len, (unsigned long long)foff, strerror(-res));
		return 0;
	}
	if (res == 0) {
		job_chunk_done(j, is_read ? -EIO : -ENOSPC, "file %s at offset %llu moved 0 bytes: %s",
			       is_read ? "read" : "write", (unsigned long long)foff,
			       is_read ? "the file ends before the extent; was it truncated?" : "device full?");
		return 0;
	}
	if (c->corrupt)
		fault_corrupt((char *)j->x.dst.ptr + c->off + c->done, (uint64_t)res);
	c->done += (uint64_t)res;
	if (c->done < c->len) {
		atomic_fetch_add(&off->resubmits, 1);
		return 1;
	}
	job_chunk_done(j, 0, "%s", "");
	return 0;
}

/* Chunks taken from the queue but not yet in the ring, in order. */
typedef struct {
	chunk *head, *tail;
} waitq;

static void waitq_append(waitq *w, chunk *head, chunk *tail)
{
	if (w->tail)
		w->tail->next = head;
	else
		w->head = head;
	w->tail = tail;
}

static chunk *waitq_pop(waitq *w)
{
	chunk *c = w->head;
	if ((w->head = c->next) == NULL)
		w->tail = NULL;
	return c;
}

static void waitq_push_front(waitq *w, chunk *c)
{
	c->next = w->head;
	w->head = c;
	if (!w->tail)
		w->tail = c;
}

/* Stopping: queued requests are cancelled; the remainders of running ones stay to finish. */
static void cancel_waiting(waitq *w)
{
	waitq keep = { NULL, NULL };
	while (w->head) {
		chunk *c = waitq_pop(w);
		if (c->done) { /* the remainder of a running request finishes */
			c->next = NULL;
			waitq_append(&keep, c, c);
			continue;
		}
		job_chunk_done(c->job, -ECANCELED, "%s transfer cancelled: the offload engine was destroyed before it ran",
			       tier_link_name(c->job->link));
	}
	*w = keep;
}

/* Move waiting chunks into the ring up to its depth (a chunk whose preparation fails, by an
 * injected fault, takes a no-op slot and is done at once). */
static void submit_waiting(tier_offload *off, off_uring *u, waitq *w, unsigned *inflight)
{
	while (w->head && *inflight < u->depth) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
		if (!sqe)
			break;
		chunk *c = waitq_pop(w);
		offload_jitter_sleep(off);
		job_chunk_start(c->job);
		int rc = prep_chunk(off, u, c, sqe);
		if (rc) {
			io_uring_prep_nop(sqe);
			io_uring_sqe_set_data(sqe, (void *)1); /* a spent slot, ignored on completion */
			job_chunk_done(c->job, rc, "injected fault: file %s fails with %s",
				       c->job->x.src.kind == TIER_MEM_FILE ? "read" : "write", tier_strerror(rc));
			continue;
		}
		(*inflight)++;
	}
	io_uring_submit(&u->ring);
}

/* Wait for completions and finish their chunks; a partial one's remainder goes first in w. */
static void reap(tier_offload *off, off_uring *u, waitq *w, unsigned *inflight)
{
	struct io_uring_cqe *cqe;
	int r = io_uring_wait_cqe(&u->ring, &cqe);
	if (r == -EINTR)
		return;
	if (r < 0) {
		tier_log(TIER_LOG_ERROR, "offload: io_uring wait failed: %s", strerror(-r));
		return;
	}
	unsigned head, seen = 0;
	io_uring_for_each_cqe(&u->ring, head, cqe) {
		void *data = io_uring_cqe_get_data(cqe);
		int res = cqe->res;
		seen++;
		if (data && data != (void *)1) {
			chunk *c = data;
			(*inflight)--;
			if (complete_chunk(off, c, res)) /* the remainder goes first */
				waitq_push_front(w, c);
		}
	}
	io_uring_cq_advance(&u->ring, seen);
}

static void *ring_main(void *arg)
{
	tier_offload *off = arg;
	off_uring *u = off->uring;
	waitq w = { NULL, NULL };
	unsigned inflight = 0;
	for (;;) {
		pthread_mutex_lock(&u->mu);
		while (!u->head && !u->stopping && !inflight && !w.head)
			pthread_cond_wait(&u->cv, &u->mu);
		chunk *got = u->head, *got_tail = u->tail;
		u->head = u->tail = NULL;
		int stop = u->stopping;
		pthread_mutex_unlock(&u->mu);
		if (got)
			waitq_append(&w, got, got_tail);
		if (stop) { /* queued requests are cancelled; those in the ring are waited for */
			cancel_waiting(&w);
			if (!inflight && !w.head)
				break;
		}
		submit_waiting(off, u, &w, &inflight);
		if (inflight)
			reap(off, u, &w, &inflight);
	}
	return NULL;
}

int uring_create(tier_offload *off)
{
	off_uring *u = calloc(1, sizeof *u);
	int r;
	if (!u)
		return tier_fail(-ENOMEM, "offload: out of memory for the io_uring state");
	u->depth = off->cfg.queue_depth;
	if ((r = io_uring_queue_init(u->depth, &u->ring, 0)) < 0) {
		tier_log(TIER_LOG_INFO, "offload: io_uring unavailable (%s); file I/O runs on worker threads", strerror(-r));
		free(u);
		return 0;
	}
	u->fixed = io_uring_register_files_sparse(&u->ring, URING_SLOTS) == 0;
	pthread_mutex_init(&u->mu, NULL);
	pthread_cond_init(&u->cv, NULL);
	off->uring = u;
	if ((r = pthread_create(&u->thread, NULL, ring_main, off))) {
		off->uring = NULL;
		io_uring_queue_exit(&u->ring);
		pthread_mutex_destroy(&u->mu);
		pthread_cond_destroy(&u->cv);
		free(u);
		return tier_fail(-r, "offload: cannot start the io_uring thread: %s", strerror(r));
	}
	return 0;
}

void uring_destroy(tier_offload *off)
{
	off_uring *u = off->uring;
	if (!u)
		return;
	pthread_mutex_lock(&u->mu);
	u->stopping = 1;
	pthread_cond_signal(&u->cv);
	pthread_mutex_unlock(&u->mu);
	pthread_join(u->thread, NULL);
	io_uring_queue_exit(&u->ring);
	pthread_mutex_destroy(&u->mu);
	pthread_cond_destroy(&u->cv);
	free(u);
	off->uring = NULL;
}

#else /* !TIER_HAVE_LIBURING: file I/O runs on the worker threads */

int uring_create(tier_offload *off)
{
	off->uring = NULL;
	return 0;
}
void uring_destroy(tier_offload *off) { (void)off; }
void uring_submit(tier_offload *off, chunk *c) { c->next = NULL; queue_push(off, c, c, 0); }
void uring_file_slot(tier_offload *off, int id, int fd) { (void)off; (void)id; (void)fd; }

#endif
