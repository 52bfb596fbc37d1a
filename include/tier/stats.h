/* stats.h - the store's statistics: the snapshot layout, and the shared-memory segment that
 * tier-stat attaches to.
 *
 * The segment is named "/tier-stats.<pid>" (POSIX shm, mode 0600), created fresh by the process
 * that publishes and removed at its exit. Its layout is tier_stats below, versioned by
 * TIER_STATS_VERSION; a reader that finds another version refuses it. Writers update it under a
 * sequence counter (odd while writing), so readers copy it and retry until `seq` is even and
 * unchanged across the copy. */
#ifndef TIER_STATS_H
#define TIER_STATS_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TIER_STATS_MAGIC 0x5441545352454954ull /* "TIERSTAT" */
#define TIER_STATS_VERSION 3u
#define TIER_STATS_NTIERS 3
#define TIER_STATS_NCLASSES 6
#define TIER_STATS_NLINKS 8

typedef struct {
	uint64_t capacity;  /* budget in bytes */
	uint64_t used;      /* bytes taken from the budget, allocator overhead (alignment) included */
	uint64_t peak;      /* highest `used` so far */
	uint64_t payload;   /* bytes of object data held (used - payload = overhead) */
	uint64_t copies;    /* object copies held */
	uint64_t pinned;    /* copies pinned right now */
} tier_stats_tier;

typedef struct {
	uint64_t hits;      /* acquire found a valid copy in this tier */
	uint64_t misses;    /* acquire had to fetch into this tier (or recreate) */
	uint64_t evictions; /* copies of this class evicted from this tier */
	uint64_t writebacks;/* evictions that demoted dirty (or only) data to the tier below */
	uint64_t drops;     /* evictions that dropped the copy (frozen with a copy below, discardable) */
	uint64_t bytes_in;  /* bytes transferred into this tier for copies of this class */
	uint64_t unused;    /* prefetched copies of this class evicted before any use */
} tier_stats_class;

typedef struct {
	uint64_t bytes, transfers, errors;
	uint64_t busy_ns;
} tier_stats_link;

typedef struct {
	uint64_t issued;    /* prefetch transfers started */
	uint64_t on_time;   /* needs whose data was ready when asked for */
	uint64_t late;      /* needs that waited for a transfer in flight */
	uint64_t missed;    /* needs with no prefetch at all (a demand miss) */
	uint64_t stall_ns;  /* time acquire callers waited for data */
	uint64_t wasted;    /* prefetched copies evicted before use */
} tier_stats_prefetch;

typedef struct {
	uint64_t magic;     /* TIER_STATS_MAGIC */
	uint32_t version;   /* TIER_STATS_VERSION */
	uint32_t size;      /* sizeof(tier_stats) of the writer */
	volatile uint64_t seq; /* even: stable; odd: being written */
	uint64_t proc_start; /* the writer's start, /proc/PID/stat field 22 (0: unknown): a reader
				tells a live writer from a leftover whose pid another process now has */
	int32_t pid;
	uint32_t hbm_emulated; /* 1 when the HBM tier is host memory (no GPU) */
	uint64_t start_ns;  /* CLOCK_MONOTONIC when the store was created */
	uint64_t update_ns; /* CLOCK_MONOTONIC of this snapshot */
	uint64_t step;      /* training step (tier_store_step) */
	uint64_t objects;   /* live objects */
	uint64_t object_bytes; /* their total size */
	char tier_name[TIER_STATS_NTIERS][24];   /* "hbm", "hbm (emulated)", "ddr", "nvme" */
	char class_name[TIER_STATS_NCLASSES][16];
	char link_name[TIER_STATS_NLINKS][16];
	tier_stats_tier tier[TIER_STATS_NTIERS];
	tier_stats_class cls[TIER_STATS_NTIERS][TIER_STATS_NCLASSES];
	tier_stats_link link[TIER_STATS_NLINKS];
	tier_stats_prefetch prefetch;
	char job[64];       /* free text set by the job ("tier-run", "store demo") */
} tier_stats;

typedef struct tier_stats_pub tier_stats_pub;

/* Create the segment for this process (removing a stale one of the same name). Returns 0, or
 * -EEXIST / -EACCES / -ENOMEM ... with a message; *out NULL on failure. */
int tier_stats_publish_open(tier_stats_pub **out);
/* Copy a snapshot into the segment under the sequence counter. Thread-safe against readers; one
 * writer at a time. */
void tier_stats_publish(tier_stats_pub *pub, const tier_stats *snapshot);
/* Remove the segment and free. NULL is fine. */
void tier_stats_publish_close(tier_stats_pub *pub);
/* Name of a process's segment into buf. */
void tier_stats_segment_name(pid_t pid, char *buf, size_t len);

/* Read one consistent snapshot of process `pid`'s segment. Returns 0, -ESRCH (no such process or
 * it publishes nothing), -EPROTO (another version or not a tier segment), -EAGAIN (could not get a
 * stable copy), each with a message. Read-only: never writes the segment. */
int tier_stats_read(pid_t pid, tier_stats *out);

#ifdef __cplusplus
}
#endif
#endif
