/* offload.h - the movers: asynchronous copies between HBM, DDR and NVMe, with fences.
 *
 * The engine knows bytes, addresses, files and links, never objects or policies: a transfer is
 * (destination, source, length) in and a fence out. HBM<->DDR runs on CUDA copy streams (one per
 * direction) when the engine has a CUDA device, on worker threads otherwise; DDR<->NVMe runs on
 * io_uring (or worker threads with pread/pwrite without liburing); NVMe<->HBM is pipelined through
 * a ring of pinned staging buffers. A transfer completes whole or fails: its fence reports 0 or a
 * negative errno, and a failed transfer's destination must not be trusted by the caller. */
#ifndef TIER_OFFLOAD_H
#define TIER_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where bytes are: host memory (DDR), device memory (HBM; emulated HBM is host memory), or a
 * registered file at an offset (NVMe). */
typedef enum { TIER_MEM_HOST = 0, TIER_MEM_DEVICE = 1, TIER_MEM_FILE = 2 } tier_mem_kind;
typedef struct {
	tier_mem_kind kind;
	void *ptr;       /* HOST, DEVICE */
	int file;        /* FILE: id from tier_offload_register_file */
	uint64_t offset; /* FILE: byte offset */
} tier_loc;

static inline tier_loc tier_loc_host(void *p) { tier_loc l = { TIER_MEM_HOST, p, -1, 0 }; return l; }
static inline tier_loc tier_loc_device(void *p) { tier_loc l = { TIER_MEM_DEVICE, p, -1, 0 }; return l; }
static inline tier_loc tier_loc_file(int file, uint64_t off) { tier_loc l = { TIER_MEM_FILE, NULL, file, off }; return l; }

/* Links, for statistics and throttling. The link of a transfer follows from its two ends. */
typedef enum {
	TIER_LINK_H2D = 0,     /* DDR -> HBM */
	TIER_LINK_D2H,         /* HBM -> DDR */
	TIER_LINK_NVME_READ,   /* NVMe -> DDR */
	TIER_LINK_NVME_WRITE,  /* DDR -> NVMe */
	TIER_LINK_NVME_TO_HBM, /* NVMe -> HBM through the staging ring */
	TIER_LINK_HBM_TO_NVME, /* HBM -> NVMe through the staging ring */
	TIER_LINK_D2D,         /* HBM -> HBM */
	TIER_LINK_H2H,         /* DDR -> DDR */
	TIER_NLINKS
} tier_link;
const char *tier_link_name(tier_link link); /* "h2d", "d2h", "nvme-read", ... */

typedef struct tier_offload tier_offload;
typedef struct tier_fence tier_fence;

/* Fault injection, for tests: the n-th (1-based, counted per engine from the last
 * tier_offload_set_faults; each read or write request counts, resubmissions included) file read or
 * write fails with `error` (-EIO, -ENOSPC; 0 means -EIO), or moves only half its bytes (the engine
 * resubmits the rest, so the transfer still succeeds), or has its data corrupted after it lands (a
 * TIER_XFER_CRC_VERIFY read then fails with -EBADMSG). 0 = off. Thread-safe to set while transfers run. */
typedef struct {
	uint64_t fail_read_nth, fail_write_nth;
	int error;
	uint64_t short_read_nth, short_write_nth;
	uint64_t corrupt_read_nth;
} tier_offload_faults;

typedef struct {
	tier_dev *dev;             /* CUDA context for HBM copies; NULL or a CPU context: worker threads */
	unsigned threads;          /* worker threads for host copies and file I/O without io_uring (0: 4) */
	unsigned queue_depth;      /* io_uring queue depth (0: 32) */
	uint64_t chunk_bytes;      /* large copies are split into chunks of this size (0: 8 MiB) */
	uint64_t staging_bytes;    /* size of one pinned staging buffer for NVMe<->HBM (0: 8 MiB) */
	unsigned staging_count;    /* buffers in the staging ring (0: 8) */
	double link_gbps[TIER_NLINKS]; /* optional bandwidth cap per link in GB/s (1e9 B/s); 0 = none */
	int no_uring;              /* 1: use worker threads for file I/O even when io_uring exists */
} tier_offload_config;

/* Create an engine. Returns 0, or -ENOMEM / -EIO / -EINVAL with a message; *out NULL on failure. */
int tier_offload_create(tier_offload **out, const tier_offload_config *cfg);
/* Stop the engine: transfers still queued are cancelled (their fences report -ECANCELED), those
 * running are waited for; no callback runs after it returns. Fences held by callers stay valid
 * until put. NULL is fine. Not to be called concurrently with other calls on the same engine. */
void tier_offload_destroy(tier_offload *off);

/* Register an open file descriptor (opened O_DIRECT for NVMe tiers; the engine does not close it).
 * Returns 0 and the id in *id, or -EINVAL / -ENOMEM. Thread-safe. */
int tier_offload_register_file(tier_offload *off, int fd, int *id);
/* Forget a file; no transfer may be in flight on it. */
void tier_offload_unregister_file(tier_offload *off, int id);

/* Transfer flags. Checksums are crc32c of the bytes moved. */
enum {
	TIER_XFER_CRC_COMPUTE = 1u << 0, /* compute the crc32c of the data (read it with tier_fence_crc) */
	TIER_XFER_CRC_VERIFY = 1u << 1,  /* check the data against `crc`; a mismatch fails with -EBADMSG */
	TIER_XFER_URGENT = 1u << 2,      /* someone waits for it now (a demand fetch, a synchronous
					  * writeback): it does not queue behind the transfers submitted
					  * before it (worker queue and CUDA copy queues: at the front);
					  * io_uring file I/O keeps submission order */
};

typedef struct {
	tier_loc dst, src;
	uint64_t len;
	unsigned flags;
	uint32_t crc;     /* expected crc32c with TIER_XFER_CRC_VERIFY */
} tier_xfer;

/* Queue a transfer. File ends need 4 KiB-aligned offsets, lengths and host addresses when the file
 * is O_DIRECT (the engine does not bounce). Returns 0 and a fence (one reference, owned by the
 * caller), or a negative errno with a message when the request is malformed (-EINVAL: misaligned
 * O_DIRECT end, unregistered file, file-to-file, checksum flags on a CUDA h2d/d2h/d2d copy, ...);
 * nothing is queued then and *fence is NULL. Thread-safe. */
int tier_offload_submit(tier_offload *off, const tier_xfer *x, tier_fence **fence);
/* Convenience: submit and wait. */
int tier_offload_copy(tier_offload *off, const tier_xfer *x);

/* Block until done; returns the transfer's result: 0, or -EIO, -ENOSPC, -EBADMSG, -ECANCELED ...
 * (the message of the failure is set for the calling thread). A CUDA copy still queued moves to the
 * front of its queue. Thread-safe. */
int tier_fence_wait(tier_fence *f);
/* 1 when done, 0 when still running. Thread-safe. */
int tier_fence_done(const tier_fence *f);
/* Make a CUDA stream (cudaStream_t) wait for the fence; the host blocks only while the copy is
 * still queued (it moves to the front and the call returns once it is on its copy stream). On a
 * CPU engine or for a NULL stream, this waits on the host. Returns the transfer's result when it waited on
 * the host, else 0 (errors then show in tier_fence_wait). */
int tier_fence_stream_wait(tier_fence *f, void *stream);
/* crc32c of the data, valid after a successful wait with TIER_XFER_CRC_COMPUTE. */
uint32_t tier_fence_crc(const tier_fence *f);
/* Time the transfer took once started (ns), valid after it is done. */
uint64_t tier_fence_busy_ns(const tier_fence *f);
tier_fence *tier_fence_get(tier_fence *f); /* add a reference */
void tier_fence_put(tier_fence *f);        /* drop a reference; NULL is fine */

/* Per-link totals since creation. Thread-safe (a consistent-enough snapshot of counters). */
typedef struct {
	uint64_t bytes, transfers, errors;
	uint64_t busy_ns;  /* wall time during which at least one transfer was active on the link */
} tier_link_stats;
void tier_offload_link_stats(const tier_offload *off, tier_link link, tier_link_stats *out);
void tier_offload_set_faults(tier_offload *off, const tier_offload_faults *faults);

/* crc32c (Castagnoli) of a buffer, continuing from `crc` (start with 0). */
uint32_t tier_crc32c(uint32_t crc, const void *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
