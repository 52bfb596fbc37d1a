/* cache.h - the selective operator cache: forward results that the backward needs, kept by value.
 *
 * In the forward, an operator offers its output (key = layer, operator, micro-batch) with the cost
 * to recompute it (FLOPs and bytes of memory traffic). The cache turns the cost into time with
 * device rates and admits by value density:
 *   recompute_ns = max(flops / flops_per_s, traffic / mem_bytes_per_s)
 *   link_ns      = 2 * bytes / link_bytes_per_s       (out to DDR in the forward, back in the backward)
 *   HBM density  = recompute_ns / bytes               (time a hit saves per byte of HBM held)
 *   DDR density  = (recompute_ns - link_ns) / bytes   (what is left after the round trip)
 * An offer goes into HBM when it fits in the cache's HBM budget after evicting only entries of
 * lower HBM density (which move to DDR when they are worth it there, else are dropped); else into
 * DDR when link_ns < recompute_ns, it is no larger than the HBM budget (a get brings it back there)
 * and it fits after evicting lower DDR density; else it is dropped. An offer whose copies overlap
 * the caller's compute (tier_op_cost.overlapped) tries DDR first, with link_ns taken as 0 and no
 * bound by the HBM budget (the caller may bring it back itself: tier_cache_get_home), then HBM.
 * In the backward, get() returns a hit (the data in HBM, fetched from DDR if it was spilled there;
 * tier_cache_prefetch_backward starts those fetches ahead of use) or a miss: the caller recomputes.
 *
 * Entries are store objects of class TIER_CLASS_OPCACHE, flag TIER_OBJ_DISCARDABLE: the store may
 * drop them under pressure from other objects, and get() then reports a miss. The budgets count
 * entry bytes (payload) and are shares of the store's tier capacities that the caller sets aside.
 *
 * Thread-safety: one tier_cache is used by one thread at a time (the training loop); the store
 * under it may be shared with other threads. */
#ifndef TIER_CACHE_H
#define TIER_CACHE_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
	TIER_OP_MATMUL = 0,   /* dense matrix products (projections) */
	TIER_OP_GROUPED_GEMM, /* expert grouped GEMMs */
	TIER_OP_ATTENTION,    /* attention outputs */
	TIER_OP_NORM,         /* normalisation outputs */
	TIER_OP_ACTIVATION,   /* elementwise activations */
	TIER_OP_OTHER,
	TIER_NOPKINDS
} tier_op_kind;
const char *tier_op_kind_name(tier_op_kind k); /* "matmul", "grouped_gemm", "attention", "norm", "activation", "other" */
/* Name -> kind. 0, or -EINVAL with a message listing the names (*out unchanged). */
int tier_op_kind_parse(const char *name, tier_op_kind *out);

typedef struct {
	uint32_t layer, op, microbatch; /* op: the operator's index within its layer, chosen by the caller */
} tier_cache_key;

typedef struct {
	tier_op_kind kind;
	double flops;   /* floating-point operations to recompute the output */
	double bytes;   /* device-memory traffic of the recompute (inputs read, output written) */
	int overlapped; /* 1: the caller's copies overlap its compute (out on a side stream, back by
			 * tier_cache_prefetch_backward a layer ahead): the offer goes to DDR first,
			 * leaving the HBM budget to the fetches back, and a DDR hit saves the whole
			 * recompute (the link's time is not the step's) */
} tier_op_cost;

/* Device rates that turn costs into time. Measured by the caller; tier_cache_rates_default gives
 * documented defaults: CUDA (an H200): 700e12 FLOP/s (dense bf16), 4.0e12 B/s HBM, 50e9 B/s link;
 * CPU (emulated HBM): 50e9 FLOP/s, 20e9 B/s memory, 10e9 B/s link (memcpy). */
typedef struct {
	double flops_per_s;
	double mem_bytes_per_s;
	double link_bytes_per_s; /* DDR -> HBM */
	int measure_link;        /* 1: refine link_bytes_per_s from the store's measured h2d transfers */
} tier_cache_rates;
void tier_cache_rates_default(tier_cache_rates *r, tier_dev_kind kind);

typedef enum {
	TIER_CACHE_VALUE = 0, /* value density, HBM then DDR, evicting lower-density entries */
	TIER_CACHE_FCFS,      /* first come first served into HBM only, no eviction, no DDR */
	TIER_CACHE_OFF,       /* admit nothing (every get is a miss) */
	TIER_NCACHE_POLICIES
} tier_cache_policy;

#define TIER_CACHE_MAX_RULES 16
#define TIER_CACHE_MAX_RANGES 8
typedef struct {
	uint32_t lo, hi, stride; /* layers lo, lo+stride, ... <= hi */
} tier_cache_range;
typedef struct {
	unsigned kinds;          /* bit (1u << tier_op_kind) per allowed kind */
	unsigned n_ranges;       /* 0: every layer */
	tier_cache_range ranges[TIER_CACHE_MAX_RANGES];
} tier_cache_rule;

typedef struct {
	tier_cache_rule rules[TIER_CACHE_MAX_RULES]; /* an offer is cacheable when any rule matches */
	unsigned n_rules;
	uint64_t budget[2];      /* bytes of entries the cache may hold in HBM [0] and DDR [1] */
	tier_cache_policy policy;
} tier_cache_config;

/* Parse the job configuration's op-cache rules. Syntax: clauses separated by ';', fields of a
 * clause by ':'. A field KINDS (comma list of kind names, or "all") starts a rule; "layers=R"
 * restricts it (R: comma list of N, A-B or A-B/S, or "all"); "hbm=SIZE", "ddr=SIZE" and
 * "policy=value|fcfs|off" set the cache-wide options wherever they appear. Example:
 *   "matmul,grouped_gemm:layers=0-47:hbm=2G:ddr=8G;attention:layers=0-47/4"
 * Returns 0, or -EINVAL with a message naming the bad field (*out unchanged). Thread-safe. */
int tier_cache_config_parse(const char *text, tier_cache_config *out);
/* 1 when (kind, layer) may be cached under cfg, else 0. */
int tier_cache_rules_match(const tier_cache_config *cfg, tier_op_kind kind, uint32_t layer);
const char *tier_cache_policy_name(tier_cache_policy p); /* "value", "fcfs", "off" */

typedef struct tier_cache tier_cache;

/* Create a cache over store s (which must outlive it). dev: the device the operators run on (NULL
 * or CPU: offers are copied with memcpy; CUDA: with cudaMemcpyAsync). rates NULL: the defaults for
 * dev's kind. Returns 0, -EINVAL (budget larger than the store's tier capacity, bad policy, rule
 * count or rates), -ENOMEM; nothing allocated on failure. */
int tier_cache_create(tier_cache **out, tier_store *s, tier_dev *dev, const tier_cache_config *cfg,
		      const tier_cache_rates *rates);
/* Destroy every entry (pinned ones too: their pointers die) and the cache. NULL is fine. */
void tier_cache_destroy(tier_cache *c);
void tier_cache_set_rates(tier_cache *c, const tier_cache_rates *r);
void tier_cache_get_rates(const tier_cache *c, tier_cache_rates *r);

/* Forward: offer `bytes` at `src` (a device pointer on CUDA, host memory on the CPU) for key.
 * `stream` is the caller's CUDA stream (NULL: the default one; ignored on the CPU): the copy is
 * queued on it and waited for before this returns, so src may be reused at once. *where (may be
 * NULL) says where the entry went: TIER_HBM, TIER_DDR, or TIER_NTIERS (not admitted: rules, value,
 * room). Returns 0 (admitted or not), -EEXIST (key held already; nothing changed), -EINVAL (bad
 * arguments), or the store's error on a failed copy (the entry is not kept). */
int tier_cache_offer(tier_cache *c, tier_cache_key key, const void *src, uint64_t bytes, const tier_op_cost *cost,
		     void *stream, tier_id *where);
/* tier_cache_offer without the wait: the copy is only queued on `stream`, and an admitted entry
 * stays pinned (never a victim, not yet gettable: -EBUSY) until tier_cache_offer_done(key), which
 * the caller calls once the stream has passed the copy; src must not change until then. The same
 * returns. */
int tier_cache_offer_async(tier_cache *c, tier_cache_key key, const void *src, uint64_t bytes,
			   const tier_op_cost *cost, void *stream, tier_id *where);
/* An offer whose operator writes its output in place: admitted as tier_cache_offer admits, but
 * nothing is copied. In HBM, *ptr is the entry's copy for the operator to write (device memory on
 * CUDA, ordered on the caller's stream); elsewhere (DDR) *ptr is NULL and the caller hands the
 * output over with tier_cache_offer_fill; not admitted (*where TIER_NTIERS): *ptr NULL, nothing
 * held, fill and done do nothing. The entry is held as an asynchronous offer's until
 * tier_cache_offer_done. The same returns as tier_cache_offer. */
int tier_cache_reserve(tier_cache *c, tier_cache_key key, uint64_t bytes, const tier_op_cost *cost, void **ptr,
		       tier_id *where);
/* A reservation's memory (HBM or DDR) for the caller's own copy, e.g. tier_dev_copy_async: *dst
 * NULL when it was not admitted. The copy must be done before tier_cache_offer_done. 0, -EINVAL
 * (never reserved, or filled already). */
int tier_cache_offer_target(tier_cache *c, tier_cache_key key, void **dst);
/* Queue the copy of a reservation's bytes from src on `stream` (src unchanged until done). 0
 * (also when not admitted), -EINVAL (never reserved, filled already, NULL src), -EIO. */
int tier_cache_offer_fill(tier_cache *c, tier_cache_key key, const void *src, void *stream);
/* The end of an asynchronous offer or a reservation: unpins its entry, whose data counts as
 * written (nothing when it was not admitted). 0, -EINVAL (never offered), or the store's error. */
int tier_cache_offer_done(tier_cache *c, tier_cache_key key);
/* The end of an asynchronous offer or a reservation whose data was not written (the operator
 * failed, the copy was not queued): the entry is dropped (counted in dropped) and a get misses.
 * 0 (also when it was not admitted), -EINVAL (never offered). */
int tier_cache_offer_drop(tier_cache *c, tier_cache_key key);
/* Backward: 0 on a hit, with *ptr the entry's data in HBM (pinned until tier_cache_release; read
 * only); 1 on a miss (never offered, not admitted, or dropped by the store since): recompute.
 * < 0 on an error (-EBUSY: the entry is pinned by an earlier get; the store's fetch errors, after
 * which the entry is gone). */
int tier_cache_get(tier_cache *c, tier_cache_key key, void **ptr);
/* A get that fetches nothing: the entry pinned where it lives, *ptr its data there and *where
 * TIER_HBM or TIER_DDR (pinned host memory on CUDA), for the caller to copy with its own means
 * (e.g. an overlapped entry straight into its operator's buffer). The same returns as get;
 * tier_cache_release ends it. */
int tier_cache_get_home(tier_cache *c, tier_cache_key key, void **ptr, tier_id *where);
/* Unpin after a hit. done=1: the entry is not needed again and is freed now. 0 or -EINVAL (not
 * pinned; nothing changed). */
int tier_cache_release(tier_cache *c, tier_cache_key key, int done);
/* Start fetching the DDR entries of `layer` (every micro-batch when microbatch is UINT32_MAX)
 * into HBM where the HBM budget has room, so that their get() does not stall. Returns the number
 * of fetches started (>= 0). */
int tier_cache_prefetch_backward(tier_cache *c, uint32_t layer, uint32_t microbatch);
/* Free every entry of a micro-batch (UINT32_MAX: all), at the end of its backward. Returns the
 * number freed, or -EBUSY when one is still pinned (the others are freed). */
int tier_cache_end_microbatch(tier_cache *c, uint32_t microbatch);

/* ---- Stats ------------------------------------------------------------------------------------ */
typedef struct {
	uint64_t offers;
	uint64_t rejected;       /* offers no rule allowed */
	uint64_t admitted[2];    /* into HBM, DDR */
	uint64_t dropped;        /* offers allowed but not admitted (value or room) */
	uint64_t evicted[2];     /* entries pushed out of HBM (to DDR or dropped), out of DDR (dropped) */
	uint64_t lost;           /* entries the store dropped before their get */
	uint64_t hits[2];        /* gets served from HBM, from DDR (fetched) */
	uint64_t misses;
	double flops_saved;      /* recompute FLOPs the hits saved */
	uint64_t bytes_in;       /* bytes copied into the cache by offers */
	uint64_t bytes_fetched;  /* DDR -> HBM */
	uint64_t bytes_spilled;  /* HBM -> DDR (demotions) */
	uint64_t stall_ns;       /* time get() waited for data */
} tier_cache_kind_stats;

typedef struct {
	tier_cache_kind_stats kind[TIER_NOPKINDS];
	tier_cache_kind_stats total;  /* sum over kinds */
	uint64_t budget[2], used[2], peak[2]; /* entry bytes per tier: HBM, DDR */
	uint64_t entries;
	double link_bytes_per_s;      /* the rate admission uses now */
} tier_cache_stats;
void tier_cache_stats_get(tier_cache *c, tier_cache_stats *out);
void tier_cache_stats_reset(tier_cache *c);

/* Check the cache's accounting against the store (every entry's copies, bytes per tier within the
 * budgets) and the store's own invariants. 0, or -EPROTO naming what is broken. For tests. */
int tier_cache_check(tier_cache *c);

#ifdef __cplusplus
}
#endif
#endif
