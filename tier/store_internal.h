/* store_internal.h - (internal) the store's objects, copies, transfers, policies and hotness.
 *
 * Synchronization: every field below is guarded by tier_store.lock, except where said otherwise.
 * Copy states (per object and tier):
 *
 *   ABSENT --alloc+submit--> LOADING --fence ok, version current--> VALID / DIRTY
 *   ABSENT --TIER_ACQ_INIT--> DIRTY + filling --release(dirty)--> DIRTY (the newest)
 *   LOADING --fence error or object rewritten meanwhile--> ABSENT (extent freed once unpinned)
 *   VALID / DIRTY --evict: drop or demote--> ABSENT
 *
 * A settled copy (VALID or DIRTY) is "current" when its version equals the object's; a dirty
 * release bumps the object's version, so every other copy becomes stale at once and is freed as
 * soon as nothing pins or reads it. Among current settled copies, the one with no current copy in
 * a lower enabled tier (and not itself in the lowest enabled tier) is DIRTY, the others VALID:
 * DIRTY means "newer than everything below", exactly what eviction must write back. */
#ifndef TIER_STORE_INTERNAL_H
#define TIER_STORE_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "tier/store.h"
#include "tier/backend.h"

typedef struct store_xfer store_xfer;

typedef struct store_copy {
	tier_object *obj;
	tier_id tier;
	tier_copy_state state;    /* ABSENT: no extent, off the tier list */
	tier_extent ext;
	unsigned pins;            /* outstanding acquires (and internal holds during waits) */
	unsigned readers;         /* transfers in flight reading this copy: never evicted while > 0 */
	uint64_t version;         /* the object version this copy holds */
	uint32_t crc;             /* NVMe copies with checksums: crc32c of the extent's bytes */
	unsigned filling : 1;     /* pinned by TIER_ACQ_INIT, not yet released */
	unsigned prefetched : 1;  /* brought by a prefetch and not yet used (timeliness stats) */
	int failed;               /* LOADING copy whose fetch failed (negative errno) while pinned */
	store_xfer *xfer;         /* the transfer filling it while LOADING */
	struct store_copy *prev, *next; /* the tier's list of held copies */
} store_copy;

struct tier_object {
	uint64_t id, size, xlen;  /* xlen: bytes moved and allocated (4 KiB multiple with NVMe) */
	tier_class cls;
	unsigned flags;
	double recompute_ns;
	uint64_t version;         /* bumped by each dirty release */
	int has_data;             /* some current copy holds the data (cleared when discardable-dropped) */
	unsigned guard;           /* > 0 while the store works for this object: its copies are no victims */
	store_copy copy[TIER_NTIERS];
	/* hotness (hotness.c) */
	double count;             /* decayed access count as of count_step */
	uint64_t count_step, last_use;
	struct sched_uses *uses;  /* schedule positions of this id, or NULL */
	tier_object *hnext;       /* id hash chain */
	tier_object *prev, *next; /* all live objects */
};

struct store_xfer {
	store_copy *dst, *src;
	tier_fence *fence;
	uint64_t version;         /* object version when started: a rewrite meanwhile makes it stale */
	int prefetch;
	store_xfer *prev, *next;
};

/* Schedule positions of one object id: sorted op indices. */
typedef struct sched_uses {
	uint64_t id;
	size_t n;
	size_t *pos;
	struct sched_uses *hnext;
} sched_uses;

/* A replacement policy: plug-in points in the shape of jemalloc's extent hooks. The hooks are
 * optional (NULL: nothing to do); pick_victim is required and returns an index into cands, the
 * tier's evictable copies (unpinned, settled, not read by a transfer). */
typedef struct store_policy {
	const char *name;
	int (*init)(tier_store *s, void **state);
	void (*fini)(void *state);
	void (*on_access)(void *state, tier_object *o, tier_id t);
	void (*on_insert)(void *state, store_copy *c);
	void (*on_remove)(void *state, store_copy *c);
	size_t (*pick_victim)(void *state, tier_store *s, tier_id t, store_copy *const *cands, size_t n);
} store_policy;

extern const store_policy store_policy_lru, store_policy_lfu, store_policy_cost, store_policy_schedule;
const store_policy *store_policy_get(tier_policy_kind k);

typedef struct {
	uint64_t hits, misses, evictions, writebacks, drops, bytes_in, unused;
} store_cls_stats;

struct tier_store {
	pthread_mutex_t lock;
	tier_dev *dev;
	tier_offload *off;
	int own_off;
	tier_backend *be[TIER_NTIERS];   /* NULL: tier disabled */
	int checksum;
	int urgent;                      /* demand fetches and synchronous writebacks skip the queue
					  * ($TIER_URGENT=0 turns it off, for comparisons) */
	double link_gbps[TIER_NLINKS];   /* configured link caps (0: none), for the cost policy */
	const store_policy *pol;
	void *pol_state;
	tier_policy_kind policy;

	/* objects */
	tier_object **hash;
	size_t hash_size, nobjects;
	uint64_t object_bytes, next_id;
	tier_object *objects;

	/* per tier */
	store_copy *held[TIER_NTIERS];   /* copies holding an extent */
	uint64_t peak[TIER_NTIERS], payload[TIER_NTIERS], ncopies[TIER_NTIERS];
	uint64_t npinned[TIER_NTIERS], pinned_bytes[TIER_NTIERS];
	uint64_t outstanding;            /* acquires not yet released (external pins) */
	uint64_t holds;                  /* internal pins of threads waiting for a late prefetch */
	store_xfer *xfers;               /* transfers in flight (LOADING copies) */
	store_copy **cands[TIER_NTIERS]; /* eviction candidate buffers */
	size_t cands_cap[TIER_NTIERS];

	/* stats */
	store_cls_stats cls[TIER_NTIERS][TIER_NCLASSES];
	tier_stats_prefetch pf;
	uint64_t start_ns, last_pub_ns;
	tier_stats_pub *pub;
	char job[64];

	/* hotness and schedule */
	double half_life;
	uint64_t step, clock;
	tier_sched_op *ops;              /* copied schedule; objects arrays owned */
	size_t n_ops, cur_op;
	int cyclic, have_cur;
	unsigned window;
	sched_uses **uses;
	size_t uses_size;

	struct store_trace *trace;       /* access trace being recorded (trace.c), or NULL */
};

/* object.c */
tier_object *store_obj_find(tier_store *s, uint64_t id);
void store_obj_quiesce(tier_store *s, tier_object *o);
int store_copy_current(const store_copy *c);
tier_id store_lowest_tier(const tier_store *s);
tier_id store_tier_below(const tier_store *s, tier_id t); /* the next enabled tier below t; TIER_NTIERS: none */
void store_refresh(tier_store *s, tier_object *o);
int store_copy_alloc(tier_store *s, store_copy *c, int noevict, tier_object *for_obj,
		     int (*filter)(tier_store *, store_copy *, void *), void *arg);
void store_copy_free(tier_store *s, store_copy *c);
void store_copy_gc(tier_store *s, store_copy *c);
void store_pin(tier_store *s, store_copy *c);
void store_unpin(tier_store *s, store_copy *c);
store_copy *store_pick_source(tier_store *s, tier_object *o, tier_id t);
tier_link store_link(tier_id from, tier_id to);

void store_free_all_objects(tier_store *s);

/* evict.c: 0 (room made), 1 (no room could be made), or a negative errno of a failed writeback. */
int store_copy_evictable(const store_copy *c); /* unpinned, settled, not read or filled */
int store_evict_one(tier_store *s, tier_id t, int (*filter)(tier_store *, store_copy *, void *), void *arg);
int store_no_room(tier_store *s, tier_id t, uint64_t bytes, const char *why);

/* access.c */
/* prefetch: 0 a demand-free transfer (an asynchronous writeback), 1 a prefetch, STORE_FETCH_URGENT
 * a transfer waited for at once (a demand fetch, a synchronous writeback). */
enum { STORE_FETCH_URGENT = 2 };
int store_start_fetch(tier_store *s, store_copy *c, store_copy *src, int prefetch);
void store_reap(tier_store *s);
void store_settle(tier_store *s, store_xfer *x);
int store_wait_copy(tier_store *s, store_copy *c);
int store_xfer_sync(tier_store *s, store_copy *dst, store_copy *src);

/* hotness.c */
void hot_access(tier_store *s, tier_object *o);
double hot_count(const tier_store *s, const tier_object *o);
uint64_t hot_next_use(const tier_store *s, const tier_object *o); /* ops away; UINT64_MAX: never */
void hot_link(tier_store *s, tier_object *o);
void hot_free_schedule(tier_store *s);

/* prefetch.c */
int store_prefetch_locked(tier_store *s, tier_object *o, tier_id t);

/* store.c */
void store_maybe_publish(tier_store *s, int force);
double store_link_gbps(tier_store *s, tier_link l);

/* trace.c: append one record (lock held); op is read for TIER_TRC_AT_OP only. The inline test keeps tracing-off to one branch. */
void store_trace_put(tier_store *s, tier_trace_kind kind, const tier_object *o, tier_id t, int hit, uint64_t op);
void store_trace_destroy(tier_store *s);
static inline void store_trace(tier_store *s, tier_trace_kind kind, const tier_object *o, tier_id t, int hit)
{
	if (__builtin_expect(s->trace != NULL, 0))
		store_trace_put(s, kind, o, t, hit, 0);
}

static inline void store_lock(tier_store *s) { pthread_mutex_lock(&s->lock); }
static inline void store_unlock(tier_store *s) { pthread_mutex_unlock(&s->lock); }

#endif
