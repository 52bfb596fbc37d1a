/* opcache_internal.h - the op cache's entries, table and accounting (shared by cache/ files). */
#ifndef TIER_CACHE_OPCACHE_INTERNAL_H
#define TIER_CACHE_OPCACHE_INTERNAL_H

#include "tier/cache.h"

/* An entry exists for every offer of the current micro-batches, admitted or not (obj == NULL), so
 * that a miss is counted under its operator kind and a second offer of the key is refused.
 * in[t]: the cache counts a copy in tier t (HBM, DDR) against its budget. A copy the store drops
 * on its own is found by cache_reconcile; the counts are never below what the store holds. */
typedef struct cache_entry {
	tier_cache_key key;
	tier_op_kind kind;
	tier_object *obj;     /* NULL: not admitted, dropped, or done */
	uint64_t bytes;
	double flops;
	double recompute_ns;
	tier_id home;         /* where the data was admitted or spilled to: HBM or DDR */
	unsigned char in[2];
	unsigned char pinned; /* between a hit and its release */
	tier_id got_at;       /* the tier its get pinned (tier_cache_get_home: where it lived) */
	unsigned char held;   /* an asynchronous offer's copy: pinned in home until tier_cache_offer_done */
	unsigned char overlapped; /* tier_op_cost.overlapped: DDR first, its round trip free */
	void *fill_at;        /* a reservation's copy, until written (tier_cache_reserve) */
	struct cache_entry *next;
} cache_entry;

struct tier_cache {
	tier_store *s;
	tier_dev *dev;
	tier_cache_config cfg;
	tier_cache_rates rates;
	cache_entry **buckets;
	size_t nbuckets, n;
	uint64_t used[2], peak[2];
	tier_cache_kind_stats st[TIER_NOPKINDS];
	uint64_t unknown_misses;
	uint64_t link_bytes0, link_busy0; /* h2d counters at the last rate update */
	cache_entry *keep;                /* the entry a get is bringing in: never a victim */
};

/* Time model (ns), see cache.h. */
double cache_recompute_ns(const tier_cache *c, double flops, double traffic);
double cache_ddr_ns(const tier_cache *c, uint64_t bytes); /* spill + fetch over the link */
double cache_density(const tier_cache *c, const cache_entry *e, tier_id t);

/* Accounting. */
void cache_set_in(tier_cache *c, cache_entry *e, tier_id t, int in);
/* Destroy the entry's store object (unpinned) and drop its accounting; the entry stays. */
void cache_free_obj(tier_cache *c, cache_entry *e);
/* Bring the accounting in line with the copies the store still holds. */
void cache_reconcile(tier_cache *c);
/* Iterate: visits every entry; fn may free the entry's object but not unlink it. */
void cache_foreach(tier_cache *c, void (*fn)(tier_cache *, cache_entry *, void *), void *arg);

/* Admission (admit.c): the tier an offer of e goes to (TIER_NTIERS: none), after making room. */
tier_id cache_choose(tier_cache *c, cache_entry *e);
/* Make `need` bytes of room in tier t's budget by evicting unpinned entries of density below
 * max_density there, lowest first (HBM victims move to DDR when worth it). 1 done, 0 not possible
 * (nothing evicted). */
int cache_make_room(tier_cache *c, tier_id t, uint64_t need, double max_density);

/* Copy bytes from an operator's pointer into a store copy (copy.c): memcpy on the CPU, a
 * cudaMemcpyAsync on the caller's stream on CUDA (waited for when wait is set). 0 or -EIO. */
int cache_copy_in(tier_dev *dev, void *dst, const void *src, uint64_t bytes, void *stream, int wait);

#endif
