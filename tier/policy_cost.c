/* policy_cost.c - cost-aware: evict the least benefit per byte, where benefit is the decayed
 * access count times the time it takes to have the copy back once evicted. */
#include "tier/policy.h"

/* Nanoseconds to move `bytes` over a link. */
static double link_ns(tier_store *s, tier_link l, uint64_t bytes)
{
	return (double)bytes / store_link_gbps(s, l); /* GB/s = bytes per ns */
}

/* Time to get the copy in t back after evicting it: refetch from the nearest current copy below,
 * or, when there is none, write it back and read it again. A discardable object with a recompute
 * cost may be recomputed instead, whichever is cheaper. */
static double comeback_ns(tier_store *s, tier_id t, const store_copy *c)
{
	const tier_object *o = c->obj;
	double ns = -1;
	for (int u = (int)t + 1; u < TIER_NTIERS && ns < 0; u++)
		if (store_copy_current(&o->copy[u]))
			ns = link_ns(s, store_link((tier_id)u, t), o->size);
	if (ns < 0) {
		tier_id d = t == TIER_HBM ? TIER_DDR : TIER_NVME;
		if (o->flags & TIER_OBJ_DISCARDABLE)
			ns = o->recompute_ns > 0 ? o->recompute_ns : link_ns(s, store_link(d, t), o->size);
		else
			ns = link_ns(s, store_link(t, d), o->size) + link_ns(s, store_link(d, t), o->size);
	} else if ((o->flags & TIER_OBJ_DISCARDABLE) && o->recompute_ns > 0 && o->recompute_ns < ns) {
		ns = o->recompute_ns;
	}
	return ns;
}

static double cost_key(tier_store *s, tier_id t, const store_copy *c)
{
	/* A floor on the count keeps never-used objects ordered by their cost too. */
	double count = hot_count(s, c->obj) + 1e-3;
	return count * comeback_ns(s, t, c) / (double)c->obj->size;
}

static size_t cost_pick(void *state, tier_store *s, tier_id t, store_copy *const *cands, size_t n)
{
	return policy_pick_min(s, t, cands, n, cost_key);
}

const store_policy store_policy_cost = { .name = "cost", .pick_victim = cost_pick };
