/* policy.c - the replacement policy table: names, parsing, and the shared victim scan.
 *
 * Every policy here keeps its state in the objects' hotness (hotness.c), so its hooks are NULL and
 * pick_victim is a linear scan over the tier's evictable copies: O(candidates) per eviction, fine
 * for thousands of objects. A policy that wants its own index (an LRU list, a heap) fills in
 * init/fini and the on_* hooks. */
#include <errno.h>
#include <string.h>
#include "tier/store_internal.h"
#include "tier/policy.h"

static const store_policy *const policies[TIER_NPOLICIES] = {
	[TIER_POLICY_LRU] = &store_policy_lru,
	[TIER_POLICY_LFU] = &store_policy_lfu,
	[TIER_POLICY_COST] = &store_policy_cost,
	[TIER_POLICY_SCHEDULE] = &store_policy_schedule,
};

const store_policy *store_policy_get(tier_policy_kind k)
{
	return (unsigned)k < TIER_NPOLICIES ? policies[k] : NULL;
}

const char *tier_policy_name(tier_policy_kind p)
{
	return (unsigned)p < TIER_NPOLICIES ? policies[p]->name : "unknown";
}

int tier_policy_parse(const char *name, tier_policy_kind *out)
{
	for (int k = 0; name && k < TIER_NPOLICIES; k++)
		if (!strcmp(name, policies[k]->name)) {
			if (out)
				*out = (tier_policy_kind)k;
			return 0;
		}
	return tier_fail(-EINVAL, "unknown policy '%s': use lru, lfu, cost or schedule", name ? name : "(null)");
}

/* The candidate with the smallest key; ties go to the least recently used. */
size_t policy_pick_min(tier_store *s, tier_id t, store_copy *const *cands, size_t n, policy_key_fn key)
{
	size_t best = 0;
	double bk = key(s, t, cands[0]);
	for (size_t i = 1; i < n; i++) {
		double k = key(s, t, cands[i]);
		if (k < bk || (k == bk && cands[i]->obj->last_use < cands[best]->obj->last_use)) {
			best = i;
			bk = k;
		}
	}
	return best;
}
