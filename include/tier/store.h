/* store.h - the tiered store: objects whose copies live in HBM, DDR and NVMe within budgets.
 *
 * An object is a fixed-size blob with a class and flags. It has up to one copy per tier, each
 * ABSENT, LOADING, VALID or DIRTY (newer than the copies below it). acquire() pins a valid copy in
 * a tier (fetching it from the nearest valid copy on a miss, evicting unpinned victims chosen by
 * the policy when the tier is full) and returns its address and a fence; release() unpins and
 * says whether the caller wrote it. Eviction drops a copy when that loses nothing (a frozen
 * object with a valid copy below, a clean copy with a valid copy below, or a discardable object),
 * and otherwise demotes it to the next tier down first.
 *
 * Thread-safety: every function taking a tier_store may be called from any thread concurrently
 * (one lock per store); an address returned by acquire stays valid until the matching release. */
#ifndef TIER_STORE_H
#define TIER_STORE_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/offload.h"
#include "tier/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TIER_HBM = 0, TIER_DDR = 1, TIER_NVME = 2, TIER_NTIERS = 3 } tier_id;
const char *tier_name(tier_id t); /* "hbm", "ddr", "nvme" */

typedef enum {
	TIER_CLASS_EXPERT = 0, /* routed expert weights (frozen base) */
	TIER_CLASS_DENSE,      /* dense weights: attention, norms, embeddings (frozen base) */
	TIER_CLASS_LORA,       /* LoRA parameters and their gradients */
	TIER_CLASS_OPTIM,      /* optimizer state */
	TIER_CLASS_OPCACHE,    /* operator-cache entries (discardable) */
	TIER_CLASS_ACT,        /* activations and scratch */
	TIER_NCLASSES
} tier_class;
const char *tier_class_name(tier_class c);

enum {
	TIER_OBJ_FROZEN = 1u << 0,      /* contents never change after the first fill: never written back */
	TIER_OBJ_DISCARDABLE = 1u << 1, /* may be dropped on eviction; acquire then reports -ENODATA */
};

typedef enum { TIER_COPY_ABSENT = 0, TIER_COPY_LOADING, TIER_COPY_VALID, TIER_COPY_DIRTY } tier_copy_state;

typedef enum {
	TIER_POLICY_LRU = 0,  /* least recently used */
	TIER_POLICY_LFU,      /* least decayed access count (half-life in steps) */
	TIER_POLICY_COST,     /* least benefit per byte: decayed count x refetch cost / size */
	TIER_POLICY_SCHEDULE, /* furthest next use in the step schedule (Belady on a known schedule) */
	TIER_NPOLICIES
} tier_policy_kind;
const char *tier_policy_name(tier_policy_kind p);
/* "lru", "lfu", "cost", "schedule" -> kind. 0 or -EINVAL with a message listing the names. */
int tier_policy_parse(const char *name, tier_policy_kind *out);

typedef struct tier_store tier_store;
typedef struct tier_object tier_object;

/* A budget of "all the machine has": clamped (with clamp_budgets) to what is free, without the
 * warning an over-large number gets. Larger values count as the same request. */
#define TIER_BUDGET_MAX (UINT64_MAX / 4)

typedef struct {
	tier_dev *dev;               /* CUDA context: HBM is device memory; CPU (or NULL): emulated HBM */
	uint64_t capacity[TIER_NTIERS]; /* budgets in bytes; 0 disables a tier (HBM and DDR must be > 0) */
	const char *const *nvme_dirs;/* directories for NVMe files (striped); required when NVMe > 0 */
	unsigned n_nvme_dirs;
	tier_policy_kind policy;
	double half_life_steps;      /* decay of access counts (0: 4 steps) */
	int nvme_checksum;           /* 1: crc32c every NVMe copy, verified on read */
	int clamp_budgets;           /* 1: clamp budgets above what the machine has (with a warning);
	                                0: fail with -E2BIG naming the budget */
	int publish_stats;           /* 1: publish the shared-memory stats segment for tier-stat */
	tier_offload *offload;       /* the movers to use; NULL: the store creates one (CPU or dev) */
	const tier_offload_config *offload_config; /* for the store-created engine; NULL: defaults */
} tier_store_config;

/* Create a store. Reserves HBM (one device allocation) and DDR (one host reservation, pinned with
 * CUDA, bound to the GPU's NUMA node) up front, checks the NVMe directories (exist, writable,
 * O_DIRECT; falls back to buffered I/O with a warning where O_DIRECT is refused). Returns 0, or
 * -EINVAL (bad config), -E2BIG (budget larger than the machine), -ENOENT/-EACCES/-ENOTDIR (NVMe
 * directory), -ENOMEM, each with a message; nothing is left allocated on failure. */
int tier_store_create(tier_store **out, const tier_store_config *cfg);
/* Destroy: waits for transfers, frees every object and reservation, removes NVMe files and the
 * stats segment. Objects still pinned are freed too (their addresses die). NULL is fine. */
void tier_store_destroy(tier_store *s);

/* Create an object of `size` bytes with no data yet; its first acquire must pass TIER_ACQ_INIT.
 * Returns 0 and the object, or -EINVAL (size 0, bad class or flags), -E2BIG (size larger than
 * every tier: message names the sizes), with nothing changed. */
int tier_obj_create(tier_store *s, uint64_t size, tier_class cls, unsigned flags, tier_object **out);
/* Destroy an object and all its copies, after waiting (under the store lock) for its transfers in
 * flight. -EBUSY (nothing changed) when a copy is pinned. Thread-safe. */
int tier_obj_destroy(tier_store *s, tier_object *o);
/* Drop the object's data in every tier without writing it anywhere (after waiting for its
 * transfers in flight): for contents that will be rewritten before they are read again (a
 * finished step's gradients or activations), so that neither a prefetch nor an eviction moves
 * them. The object then has no data (the next acquire passes TIER_ACQ_INIT). 0, -EBUSY when a
 * copy is pinned (nothing changed), -EINVAL. Thread-safe. */
int tier_obj_discard(tier_store *s, tier_object *o);
uint64_t tier_obj_size(const tier_object *o);
tier_class tier_obj_class(const tier_object *o);
unsigned tier_obj_flags(const tier_object *o);
uint64_t tier_obj_id(const tier_object *o);        /* unique, stable, for traces and schedules */
tier_copy_state tier_obj_state(tier_store *s, const tier_object *o, tier_id t);
unsigned tier_obj_pins(tier_store *s, const tier_object *o, tier_id t);
/* Cost to recreate the object if dropped (ns); used by the cost-aware policy and the op cache. */
void tier_obj_set_cost(tier_store *s, tier_object *o, double recompute_ns);

enum {
	TIER_ACQ_INIT = 1u << 0,    /* no data is fetched: the caller fills the copy (first use, or a
	                               discardable object being recomputed) and must release it dirty */
	TIER_ACQ_NOEVICT = 1u << 1, /* fail with -ENOSPC instead of evicting */
};

/* Pin a valid copy of `o` in tier `t`. On a miss the copy is fetched from the nearest valid copy
 * (the tiers below first); when `t` is full, unpinned victims are evicted by the policy (dropped,
 * or written back first when DIRTY). *addr is a device pointer (HBM) or a host pointer (DDR);
 * NVMe copies cannot be acquired (-EINVAL).
 * fence == NULL: waits here for the data (without holding the store lock) and reports a failed
 * fetch itself. fence != NULL: returns at once with the copy pinned and LOADING; *fence (or NULL
 * when the data is already there) is a reference the caller puts after its stream waited on it;
 * if that transfer fails, its fence reports the error and tier_release returns it.
 * Returns 0; -ENOSPC when the tier cannot make room (message: bytes pinned, used, the budget),
 * -ENODATA when the object has no data (new, or discardable and dropped: acquire with
 * TIER_ACQ_INIT to fill it), -EBUSY (TIER_ACQ_INIT outstanding on the object, or INIT while it is
 * pinned), -EIO/-EBADMSG/... when fetching failed, or the error of a writeback that eviction
 * needed. On failure nothing is pinned and the object's data is as before. Thread-safe. */
int tier_acquire(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr, tier_fence **fence);
/* Unpin. dirty=1: the caller wrote the copy, which becomes the newest (DIRTY); the copies in the
 * other tiers are stale and freed (once unpinned); the last dirty release wins. For a frozen
 * object this is only allowed after TIER_ACQ_INIT (-EPERM, nothing changed). Returns 0; -EINVAL
 * when the copy is not pinned (nothing changed), or when released clean after TIER_ACQ_INIT (the
 * copy, never filled, is unpinned and dropped); the fetch's error (-EIO, -EBADMSG) when an
 * acquire with a fence out had a failed fetch (the copy is unpinned and dropped). Thread-safe. */
int tier_release(tier_store *s, tier_object *o, tier_id t, int dirty);
/* End a fill (TIER_ACQ_INIT) as a dirty release would, but keep the pin: the copy holds the newest
 * data, others may acquire it, and it stays where it is (never evicted or written back) until its
 * release, which may then be clean. For callers whose writes are queued on a device stream and
 * complete later. 0; -EINVAL when the copy is not pinned or not being filled (nothing changed).
 * Thread-safe. */
int tier_fill_done(tier_store *s, tier_object *o, tier_id t);
/* Hint: start bringing a copy into `t` if it is not there and room can be made by evicting only
 * copies needed later than `o` in the schedule (without a schedule: without evicting). Never fails
 * the caller: returns 0 (started or already there) or 1 (declined: no room, no data, NVMe, already
 * loading). A prefetch that fails later is dropped with a warning. Thread-safe; does not wait for the
 * fetch (a writeback that the room needs is synchronous). */
int tier_prefetch(tier_store *s, tier_object *o, tier_id t);
/* Hint: start writing the object's dirty copy (the newest data, held in a tier with nothing
 * current below it) down to the next tier, without waiting. The copy stays where it is and turns
 * clean when the transfer settles, so that evicting it later costs no synchronous writeback.
 * Never fails the caller: 0 (started, under way, or nothing dirty to write), 1 (declined: the copy is pinned
 * or being filled, or the tier below has no free room without evicting). A dirty release meanwhile
 * makes the written copy stale (dropped). Thread-safe. */
int tier_writeback(tier_store *s, tier_object *o);
/* Move the object so that its copy lives in `t` (valid; NVMe allowed), dropping copies in the other
 * tiers (dirty data is carried along). Returns 0, -ENOSPC, -EBUSY (pinned), -ENODATA, -EIO...;
 * on failure the object's data is where it was. Waits, holding the store lock. Thread-safe. */
int tier_migrate(tier_store *s, tier_object *o, tier_id t);

/* ---- Hotness and schedule -------------------------------------------------------------------- */
/* Advance the step counter (access counts decay by the half-life per step); publishes the stats
 * segment. Thread-safe. */
void tier_store_step(tier_store *s);
/* Hand the store a step schedule: ops[i] lists the object ids the i-th operation needs, in order.
 * The schedule-aware policy and the prefetcher read it; the array is copied (ids of objects not
 * created yet are fine). 0, -EINVAL (nothing changed), -ENOMEM (the store then has no schedule).
 * cyclic: the schedule repeats (next uses wrap around). Thread-safe. */
typedef struct {
	const uint64_t *objects; /* ids of the objects this operation needs */
	unsigned n_objects;
	tier_id tier;            /* where it needs them (HBM for compute) */
} tier_sched_op;
int tier_store_set_schedule(tier_store *s, const tier_sched_op *ops, size_t n_ops, int cyclic);
/* The operation about to run (index into the schedule; taken modulo its length when cyclic).
 * Prefetches the objects of the next `window` ops into their tiers (as tier_prefetch). Thread-safe. */
void tier_store_at_op(tier_store *s, size_t op);
/* How many operations ahead the prefetcher looks (default 2). */
void tier_store_set_prefetch_window(tier_store *s, unsigned ops);

/* ---- Stats ------------------------------------------------------------------------------------ */
/* Fill a snapshot of the store's statistics (layout in stats.h). Thread-safe. */
void tier_store_stats(tier_store *s, tier_stats *out);
/* Label the job in the published stats ("tier-run", "store demo"). */
void tier_store_set_job(tier_store *s, const char *job);
/* Check every invariant (budgets, accounting, pin counts, copy states); 0 or -EPROTO with a message
 * naming the broken one. For tests; takes the lock. */
int tier_store_check(tier_store *s);
/* The offload engine the store uses. */
tier_offload *tier_store_offload(tier_store *s);

/* ---- Access traces (format: docs/trace.md) ------------------------------------------------------- */
/* Record every store access from now on into `path` (created or truncated): one fixed-size record
 * per acquire, release, prefetch, object create/destroy, step and tier_store_at_op, written through
 * a buffer of a few MiB. Returns 0, -EBUSY (a trace is already open), -EINVAL, or the open error,
 * each with a message; on failure nothing is recorded. A later write error is logged once and
 * stops recording; tier_store_trace_close returns it. Thread-safe. */
int tier_store_trace_open(tier_store *s, const char *path);
/* Flush and close the trace: 0, -ENOENT (none open), or the first write/close error (the file is
 * then incomplete). tier_store_destroy closes an open trace (logging an error). Thread-safe. */
int tier_store_trace_close(tier_store *s);

typedef enum {
	TIER_TRC_ACQUIRE = 1, /* hit: 1 when the copy was there (or loading) already */
	TIER_TRC_RELEASE,     /* hit: 1 when released dirty */
	TIER_TRC_PREFETCH,    /* hit: 1 when started or already there, 0 when declined */
	TIER_TRC_CREATE,
	TIER_TRC_DESTROY,
	TIER_TRC_STEP,        /* step: the new step number; object fields 0 */
	TIER_TRC_AT_OP,       /* op: the operation index passed to tier_store_at_op */
	TIER_TRC_DISCARD,     /* tier_obj_discard: the data is gone from every tier (version 2) */
	TIER_TRC_NKINDS
} tier_trace_kind;

typedef struct {
	uint64_t object, size; /* object id and size in bytes (0 for step and at_op records) */
	uint32_t op, step;     /* current operation index (low 32 bits) and step number */
	uint8_t kind, tier, cls, hit;
} tier_trace_rec;

typedef struct tier_trace_reader tier_trace_reader;
/* Open a trace for reading and validate its header. 0, or -ENOENT/-EACCES..., -EBADMSG (not a
 * trace, other version or record size: the message names the file and offset), -ENOMEM. */
int tier_trace_open_read(tier_trace_reader **out, const char *path);
/* Next record: 1 (filled *rec), 0 (end of file), -EBADMSG (truncated record, or a bad kind/tier/
 * class: the message names the file and byte offset), -EIO. Not thread-safe per reader. */
int tier_trace_next(tier_trace_reader *r, tier_trace_rec *rec);
void tier_trace_close_read(tier_trace_reader *r); /* NULL is fine */

#ifdef __cplusplus
}
#endif
#endif
