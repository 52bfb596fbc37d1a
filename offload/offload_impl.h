/* offload_impl.h - (internal) the engine's shared structures: fences, jobs, chunks, links, files. */
#ifndef TIER_OFFLOAD_IMPL_H
#define TIER_OFFLOAD_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include "config.h"
#include "tier/offload.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define OFF_ALIGN 4096u       /* O_DIRECT alignment of offsets, lengths and addresses */
#define OFF_MSG 256

/* A fence: the result of one transfer. Synchronization: `mu` guards result, msg, crc, busy_ns and
 * the transition done 0 --> 1 (done is also read without the lock); refs is atomic. A CUDA fence
 * (cuda = 1) is done when its event is. */
struct tier_fence {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	atomic_int refs;
	atomic_int done;
	int result;
	uint32_t crc;
	uint64_t busy_ns;
	char msg[OFF_MSG];
	int cuda;
#ifdef TIER_HAVE_CUDA
	cudaEvent_t start, end;
	int dev_ordinal;
	/* cuda_feed.c: the copy while it waits in a metered queue (see there for the locking) */
	struct off_feed *feed;
	struct tier_fence *qnext, *qprev;
	tier_xfer fx;
	uint64_t fx_done;   /* bytes already on the stream */
	int fx_kind;        /* enum cudaMemcpyKind */
	int fx_front;       /* put at the front (urgent or waited for) */
	atomic_int issued;  /* the end event is recorded (or issuing failed: result says so) */
#endif
};

tier_fence *fence_new(void);
/* Complete a fence once: sets result and message, wakes waiters. */
void fence_complete(tier_fence *f, int result, const char *msg, uint32_t crc, uint64_t busy_ns);

/* A chunk of a job: [off, off + len) of the transfer. `done` counts bytes already moved (short
 * I/O resubmits the rest). */
typedef struct chunk {
	struct chunk *next;
	struct job *job;
	uint64_t off, len, done;
	uint64_t io_len;   /* io_uring: bytes asked by the request in flight */
	int corrupt;       /* fault injection: damage the data of the request in flight */
} chunk;

/* A transfer in flight on the worker threads or the ring. Freed by whoever finishes its last chunk.
 * Synchronization: `remaining` and `err` are atomic; errmsg is written only by the thread that won
 * the compare-and-swap on err. */
typedef struct job {
	tier_offload *off;
	tier_fence *fence;
	tier_xfer x;
	tier_link link;
	int fd_src, fd_dst;        /* resolved at submit (-1 for memory ends) */
	int slot_src, slot_dst;    /* io_uring fixed-file slots, -1 when none */
	int staged;                /* CUDA file<->device through the staging ring: one chunk does all */
	int direct;                /* the file end is O_DIRECT */
	uint32_t crc;              /* staged: crc computed on the way; crc_done says so */
	int crc_done;
	atomic_uint remaining;
	atomic_int err;
	atomic_int started;
	uint64_t t_start;
	char errmsg[OFF_MSG];
	unsigned nchunks;
	chunk chunks[];
} job;

typedef struct {
	pthread_mutex_t mu;
	uint64_t bytes, transfers, errors, busy_ns;
	unsigned active;
	uint64_t active_since;
	/* token bucket: the link is booked until `next_free` (ns) */
	double ns_per_byte;
	uint64_t next_free;
} off_link;

typedef struct {
	int fd;      /* -1: free id */
	int direct;  /* opened O_DIRECT */
} off_file;

typedef struct off_uring off_uring;
typedef struct off_cuda off_cuda;

struct tier_offload {
	tier_offload_config cfg;
	/* worker pool: a FIFO of chunks. Synchronization: mu guards head, tail, stopping, running, held. */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	chunk *head, *tail;
	int stopping;
	int held;                  /* tests (offload_hold): the workers start no chunk while set */
	atomic_uint jitter_us;     /* tests (offload_jitter): random sleep before and after each chunk */
	unsigned nthreads;
	pthread_t *threads;
	off_link links[TIER_NLINKS];
	/* files: fmu guards files and nfiles */
	pthread_mutex_t fmu;
	off_file *files;
	int nfiles;
	/* faults: the per-engine counters of file reads and writes */
	pthread_mutex_t faultmu;
	tier_offload_faults faults;
	atomic_uint_fast64_t nreads, nwrites, resubmits;
	off_uring *uring;  /* NULL: file I/O on worker threads */
	off_cuda *cuda;    /* NULL: HBM is host memory */
};

/* engine.c */
void queue_push(tier_offload *off, chunk *first, chunk *last, int front);
void job_chunk_done(job *j, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void job_chunk_start(job *j);
/* Book `bytes` on a capped link; returns the time (ns) the booking ends, 0 when uncapped. */
uint64_t link_book(tier_offload *off, tier_link link, uint64_t bytes);
void link_wait_until(uint64_t t_ns);
/* Tests: the random sleep set by offload_jitter (none when off). */
void offload_jitter_sleep(tier_offload *off);
/* Resolve a chunk's file and memory ends. */
void chunk_ends(const chunk *c, int *fd, uint64_t *foff, char **mem, int *is_read);

/* fault.c: decide the fate of one file read or write of `len` bytes. Returns 0 (do it, maybe with
 * *len shortened), or the injected error. *corrupt is set when the read's data must be damaged. */
int fault_io(tier_offload *off, int is_write, uint64_t *len, int direct, int *corrupt);
void fault_corrupt(void *buf, uint64_t len);
/* The blocking pread/pwrite loop of a chunk (worker threads): 0 or a negative errno, message set. */
int file_io_chunk(tier_offload *off, chunk *c, char *msg, size_t msglen);
/* Move len bytes between mem and fd at foff, looping over short I/O, with fault injection. */
int file_rw(tier_offload *off, int fd, int direct, int is_read, char *mem, uint64_t len, uint64_t foff,
	    char *msg, size_t msglen);

/* uring.c */
int uring_create(tier_offload *off);
void uring_destroy(tier_offload *off);
void uring_submit(tier_offload *off, chunk *c);
void uring_file_slot(tier_offload *off, int id, int fd);

/* cuda_path.c */
int cuda_create(tier_offload *off);
void cuda_destroy(tier_offload *off);
/* HBM<->DDR and D2D on the copy streams: fills the fence; 0 or -EIO with a message. */
int cuda_submit_copy(tier_offload *off, const tier_xfer *x, tier_link link, tier_fence *f);
/* NVMe<->HBM through the staging ring, on a worker thread: 0 or a negative errno. */
int cuda_staged_chunk(tier_offload *off, job *j, uint32_t *crc, char *msg, size_t msglen);
void cuda_fence_release(tier_fence *f);
int cuda_fence_wait(tier_fence *f);
int cuda_fence_query(const tier_fence *f);
int cuda_fence_stream_wait(tier_fence *f, void *stream);

#ifdef TIER_HAVE_CUDA
/* cuda_feed.c: a metered copy queue per direction */
typedef struct off_feed off_feed;
int feed_create(int ordinal, cudaStream_t s, uint64_t piece, off_feed **out);
void feed_destroy(off_feed *q); /* after issuing everything queued */
void feed_push(off_feed *q, tier_fence *f, const tier_xfer *x, int kind, int urgent);
int feed_wait_issued(tier_fence *f);
#endif

/* link stats helpers */
void link_begin(tier_offload *off, tier_link link);
void link_end(tier_offload *off, tier_link link, uint64_t bytes, int failed, int started);

#endif
