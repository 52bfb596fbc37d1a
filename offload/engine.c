/* engine.c - the offload engine: creation, the worker pool and its queue, submission, completion. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "offload_impl.h"
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif

static const char *const link_names[TIER_NLINKS] = {
	"h2d", "d2h", "nvme-read", "nvme-write", "nvme-to-hbm", "hbm-to-nvme", "d2d", "h2h",
};

const char *tier_link_name(tier_link link)
{
	return (unsigned)link < TIER_NLINKS ? link_names[link] : "unknown";
}

/* ---- links: stats and the token bucket ---------------------------------------------------- */

void link_begin(tier_offload *off, tier_link link)
{
	off_link *l = &off->links[link];
	pthread_mutex_lock(&l->mu);
	if (l->active++ == 0)
		l->active_since = tier_now_ns();
	pthread_mutex_unlock(&l->mu);
}

void link_end(tier_offload *off, tier_link link, uint64_t bytes, int failed, int started)
{
	off_link *l = &off->links[link];
	pthread_mutex_lock(&l->mu);
	if (started && --l->active == 0)
		l->busy_ns += tier_now_ns() - l->active_since;
	l->transfers++;
	if (failed)
		l->errors++;
	else
		l->bytes += bytes;
	pthread_mutex_unlock(&l->mu);
}

/* The link is booked back to back: a booking starts when the previous one ends (or now, when the
 * link was idle: no credit accumulates), and lasts bytes / rate. The caller moves the bytes, then
 * sleeps until the booking ends, so the link's aggregate rate never exceeds the cap. */
uint64_t link_book(tier_offload *off, tier_link link, uint64_t bytes)
{
	off_link *l = &off->links[link];
	uint64_t end;
	if (l->ns_per_byte <= 0)
		return 0;
	pthread_mutex_lock(&l->mu);
	uint64_t now = tier_now_ns();
	uint64_t start = l->next_free > now ? l->next_free : now;
	end = start + (uint64_t)((double)bytes * l->ns_per_byte);
	l->next_free = end;
	pthread_mutex_unlock(&l->mu);
	return end;
}

void link_wait_until(uint64_t t_ns)
{
	uint64_t now = tier_now_ns();
	if (!t_ns || now >= t_ns)
		return;
	struct timespec ts = { (time_t)((t_ns - now) / 1000000000u), (long)((t_ns - now) % 1000000000u) };
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

void tier_offload_link_stats(const tier_offload *off, tier_link link, tier_link_stats *out)
{
	if (!out)
		return;
	memset(out, 0, sizeof *out);
	if (!off || (unsigned)link >= TIER_NLINKS)
		return;
	off_link *l = (off_link *)&off->links[link];
	pthread_mutex_lock(&l->mu);
	out->bytes = l->bytes;
	out->transfers = l->transfers;
	out->errors = l->errors;
	out->busy_ns = l->busy_ns + (l->active ? tier_now_ns() - l->active_since : 0);
	pthread_mutex_unlock(&l->mu);
}

/* Internal (tests): how many times short file I/O was resubmitted for its remainder. */
uint64_t offload_resubmits(const tier_offload *off);
uint64_t offload_resubmits(const tier_offload *off)
{
	return atomic_load(&((tier_offload *)off)->resubmits);
}

/* ---- jobs --------------------------------------------------------------------------------- */

void job_chunk_start(job *j)
{
	if (atomic_exchange(&j->started, 1) == 0) {
		j->t_start = tier_now_ns();
		link_begin(j->off, j->link);
	}
}

/* The memory end whose bytes the checksum covers: the destination, or the source of a file write. */
static const void *job_crc_mem(const job *j)
{
	return j->x.dst.kind == TIER_MEM_FILE ? j->x.src.ptr : j->x.dst.ptr;
}

static void job_finish(job *j)
{
	int rc = atomic_load(&j->err);
	uint32_t crc = 0;
	char msg[OFF_MSG];
	snprintf(msg, sizeof msg, "%s", rc ? j->errmsg : "");
	if (!rc && (j->x.flags & (TIER_XFER_CRC_COMPUTE | TIER_XFER_CRC_VERIFY))) {
		crc = j->crc_done ? j->crc : tier_crc32c(0, job_crc_mem(j), j->x.len);
		if ((j->x.flags & TIER_XFER_CRC_VERIFY) && crc != j->x.crc) {
			rc = -EBADMSG;
			snprintf(msg, sizeof msg,
				 "%s transfer of %llu bytes: crc32c %08x does not match the expected %08x; "
				 "the data is damaged, fetch it from another copy",
				 tier_link_name(j->link), (unsigned long long)j->x.len, crc, j->x.crc);
		}
	}
	int started = atomic_load(&j->started);
	uint64_t busy = started ? tier_now_ns() - j->t_start : 0;
	link_end(j->off, j->link, j->x.len, rc != 0, started);
	if (rc)
		tier_log(TIER_LOG_DEBUG, "offload: %s", msg);
	fence_complete(j->fence, rc, msg, crc, busy);
	tier_fence_put(j->fence);
	free(j);
}

void job_chunk_done(job *j, int err, const char *fmt, ...)
{
	int zero = 0;
	if (err && atomic_compare_exchange_strong(&j->err, &zero, err)) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(j->errmsg, sizeof j->errmsg, fmt, ap);
		va_end(ap);
	}
	if (atomic_fetch_sub(&j->remaining, 1) == 1)
		job_finish(j);
}

/* ---- test hooks: widen the windows in which transfers are in flight ------------------------ */

/* Internal (tests): while `on`, the worker threads start no chunk (those running finish). The
 * io_uring thread is not held: a test that needs file I/O held creates the engine with no_uring. */
void offload_hold(tier_offload *off, int on);
void offload_hold(tier_offload *off, int on)
{
	pthread_mutex_lock(&off->mu);
	off->held = on != 0;
	pthread_cond_broadcast(&off->cv);
	pthread_mutex_unlock(&off->mu);
}

/* Internal (tests): each worker chunk sleeps a random 0..max_us before and after moving its bytes,
 * and the io_uring thread before each request; 0 turns it off. */
void offload_jitter(tier_offload *off, unsigned max_us);
void offload_jitter(tier_offload *off, unsigned max_us)
{
	atomic_store(&off->jitter_us, max_us);
}

void offload_jitter_sleep(tier_offload *off)
{
	static _Thread_local uint64_t x;
	unsigned max = atomic_load(&off->jitter_us);
	if (!max)
		return;
	if (!x)
		x = tier_now_ns() | 1;
	x ^= x << 13, x ^= x >> 7, x ^= x << 17;
	uint64_t ns = (x % ((uint64_t)max + 1)) * 1000u;
	struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static void chunk_run(tier_offload *off, chunk *c)
{
	job *j = c->job;
	char msg[OFF_MSG] = "";
	int rc = 0;
	offload_jitter_sleep(off);
	job_chunk_start(j);
	if (atomic_load(&j->err)) { /* first error wins: the rest of the transfer is moot */
		job_chunk_done(j, 0, "%s", "");
		return;
	}
	uint64_t until = link_book(off, j->link, c->len);
#ifdef TIER_HAVE_CUDA
	if (j->staged)
		rc = cuda_staged_chunk(off, j, &j->crc, msg, sizeof msg);
	else
#endif
	if (j->x.src.kind == TIER_MEM_FILE || j->x.dst.kind == TIER_MEM_FILE)
		rc = file_io_chunk(off, c, msg, sizeof msg);
	else
		memcpy((char *)j->x.dst.ptr + c->off, (const char *)j->x.src.ptr + c->off, c->len);
	if (!rc)
		link_wait_until(until);
	offload_jitter_sleep(off);
	job_chunk_done(j, rc, "%s", msg);
}

static void *worker_main(void *arg)
{
	tier_offload *off = arg;
	for (;;) {
		pthread_mutex_lock(&off->mu);
		while ((!off->head || off->held) && !off->stopping)
			pthread_cond_wait(&off->cv, &off->mu);
		chunk *c = off->head;
		if (!c) {
			pthread_mutex_unlock(&off->mu);
			return NULL;
		}
		off->head = c->next;
		if (!off->head)
			off->tail = NULL;
		pthread_mutex_unlock(&off->mu);
		chunk_run(off, c);
	}
}

/* ---- creation and shutdown ---------------------------------------------------------------- */

static int config_check(const tier_offload_config *cfg)
{
	if (cfg->threads > 1024)
		return tier_fail(-EINVAL, "offload: %u worker threads is too many (use 1..1024, 0 for 2)", cfg->threads);
	if (cfg->queue_depth > 4096)
		return tier_fail(-EINVAL, "offload: queue depth %u is too deep (use 1..4096, 0 for 32)", cfg->queue_depth);
	if (cfg->chunk_bytes > (1ull << 30) || cfg->staging_bytes > (1ull << 30))
		return tier_fail(-EINVAL, "offload: chunk and staging sizes are limited to 1 GiB");
	if (cfg->chunk_bytes && cfg->chunk_bytes % OFF_ALIGN)
		return tier_fail(-EINVAL, "offload: chunk size %llu is not a multiple of 4 KiB (O_DIRECT needs it)",
				 (unsigned long long)cfg->chunk_bytes);
	if (cfg->staging_bytes && cfg->staging_bytes % OFF_ALIGN)
		return tier_fail(-EINVAL, "offload: staging buffer size %llu is not a multiple of 4 KiB",
				 (unsigned long long)cfg->staging_bytes);
	if (cfg->staging_count > 64)
		return tier_fail(-EINVAL, "offload: %u staging buffers is too many (use 1..64, 0 for 4)", cfg->staging_count);
	for (int i = 0; i < TIER_NLINKS; i++)
		if (!(cfg->link_gbps[i] >= 0) || cfg->link_gbps[i] > 1e6)
			return tier_fail(-EINVAL, "offload: cap of link %s is %g GB/s; use 0 (none) or a positive rate",
					 tier_link_name((tier_link)i), cfg->link_gbps[i]);
	return 0;
}

int tier_offload_create(tier_offload **out, const tier_offload_config *cfg)
{
	tier_offload_config def = { 0 };
	tier_offload *off;
	int rc;
	if (!out)
		return tier_fail(-EINVAL, "tier_offload_create: NULL output pointer");
	*out = NULL;
	if (!cfg)
		cfg = &def;
	if ((rc = config_check(cfg)))
		return rc;
	if (!(off = calloc(1, sizeof *off)))
		return tier_fail(-ENOMEM, "offload: out of memory creating the engine");
	off->cfg = *cfg;
	if (!off->cfg.threads)
		off->cfg.threads = 4; /* staged NVMe<->HBM chunks read synchronously: 4 keep the disk busy */
	if (!off->cfg.queue_depth)
		off->cfg.queue_depth = 32;
	if (!off->cfg.chunk_bytes)
		off->cfg.chunk_bytes = 8u << 20;
	if (!off->cfg.staging_bytes)
		off->cfg.staging_bytes = 8u << 20;
	if (!off->cfg.staging_count)
		off->cfg.staging_count = 8; /* two per staged chunk, so four chunks in flight */
	pthread_mutex_init(&off->mu, NULL);
	pthread_cond_init(&off->cv, NULL);
	pthread_mutex_init(&off->fmu, NULL);
	pthread_mutex_init(&off->faultmu, NULL);
	for (int i = 0; i < TIER_NLINKS; i++) {
		pthread_mutex_init(&off->links[i].mu, NULL);
		off->links[i].ns_per_byte = cfg->link_gbps[i] > 0 ? 1.0 / cfg->link_gbps[i] : 0;
	}
	if (!(off->threads = calloc(off->cfg.threads, sizeof *off->threads))) {
		tier_offload_destroy(off);
		return tier_fail(-ENOMEM, "offload: out of memory for %u threads", off->cfg.threads);
	}
	for (unsigned i = 0; i < off->cfg.threads; i++) {
		if ((rc = pthread_create(&off->threads[i], NULL, worker_main, off))) {
			tier_offload_destroy(off);
			return tier_fail(-rc, "offload: cannot start worker thread %u: %s", i, strerror(rc));
		}
		off->nthreads++;
	}
	/* valgrind 3.19 does not model io_uring: completions never arrive under it. */
	if (!off->cfg.no_uring && RUNNING_ON_VALGRIND) {
		tier_log(TIER_LOG_INFO, "offload: running under valgrind: file I/O on worker threads, not io_uring");
		off->cfg.no_uring = 1;
	}
	if ((rc = cuda_create(off)) || (!off->cfg.no_uring && (rc = uring_create(off)))) {
		char msg[OFF_MSG];
		snprintf(msg, sizeof msg, "%s", tier_last_error());
		tier_offload_destroy(off);
		return tier_fail(rc, "%s", msg);
	}
	*out = off;
	return 0;
}

void tier_offload_destroy(tier_offload *off)
{
	if (!off)
		return;
	pthread_mutex_lock(&off->mu);
	off->stopping = 1;
	chunk *c = off->head;
	off->head = off->tail = NULL;
	pthread_cond_broadcast(&off->cv);
	pthread_mutex_unlock(&off->mu);
	while (c) {
		chunk *next = c->next;
		job_chunk_done(c->job, -ECANCELED, "%s transfer cancelled: the offload engine was destroyed before it ran",
			       tier_link_name(c->job->link));
		c = next;
	}
	for (unsigned i = 0; i < off->nthreads; i++)
		pthread_join(off->threads[i], NULL);
	uring_destroy(off);
	cuda_destroy(off);
	free(off->threads);
	free(off->files);
	for (int i = 0; i < TIER_NLINKS; i++)
		pthread_mutex_destroy(&off->links[i].mu);
	pthread_mutex_destroy(&off->mu);
	pthread_cond_destroy(&off->cv);
	pthread_mutex_destroy(&off->fmu);
	pthread_mutex_destroy(&off->faultmu);
	free(off);
}

/* ---- files -------------------------------------------------------------------------------- */

int tier_offload_register_file(tier_offload *off, int fd, int *id)
{
	int fl, i;
	if (!off || !id)
		return tier_fail(-EINVAL, "tier_offload_register_file: NULL engine or id");
	if (fd < 0 || (fl = fcntl(fd, F_GETFL)) < 0)
		return tier_fail(-EINVAL, "tier_offload_register_file: fd %d is not an open file descriptor", fd);
	if ((fl & O_ACCMODE) != O_RDWR)
		return tier_fail(-EINVAL, "tier_offload_register_file: fd %d is not open for reading and writing (open it O_RDWR)", fd);
	pthread_mutex_lock(&off->fmu);
	for (i = 0; i < off->nfiles && off->files[i].fd >= 0; i++)
		;
	if (i == off->nfiles) {
		off_file *f = realloc(off->files, (size_t)(off->nfiles + 8) * sizeof *f);
		if (!f) {
			pthread_mutex_unlock(&off->fmu);
			return tier_fail(-ENOMEM, "offload: out of memory registering a file");
		}
		for (int k = off->nfiles; k < off->nfiles + 8; k++)
			f[k].fd = -1;
		off->files = f;
		off->nfiles += 8;
	}
	off->files[i].fd = fd;
	off->files[i].direct = !!(fl & O_DIRECT);
	uring_file_slot(off, i, fd);
	pthread_mutex_unlock(&off->fmu);
	*id = i;
	return 0;
}

void tier_offload_unregister_file(tier_offload *off, int id)
{
	if (!off)
		return;
	pthread_mutex_lock(&off->fmu);
	if (id >= 0 && id < off->nfiles && off->files[id].fd >= 0) {
		off->files[id].fd = -1;
		uring_file_slot(off, id, -1);
	}
	pthread_mutex_unlock(&off->fmu);
}

/* Queue a list of chunks (linked through next) for the workers: at the end, or at the front (an
 * urgent transfer: the next chunks the workers start). */
void queue_push(tier_offload *off, chunk *first, chunk *last, int front)
{
	pthread_mutex_lock(&off->mu);
	if (front) {
		last->next = off->head;
		off->head = first;
		if (!off->tail)
			off->tail = last;
	} else {
		if (off->tail)
			off->tail->next = first;
		else
			off->head = first;
		off->tail = last;
	}
	pthread_cond_broadcast(&off->cv);
	pthread_mutex_unlock(&off->mu);
}
