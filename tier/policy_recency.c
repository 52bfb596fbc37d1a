/* policy_recency.c - LRU (least recently used) and LFU with decay (least decayed access count). */
#include "tier/policy.h"

static double lru_key(tier_store *s, tier_id t, const store_copy *c) { return (double)c->obj->last_use; }

static size_t lru_pick(void *state, tier_store *s, tier_id t, store_copy *const *cands, size_t n)
{
	return policy_pick_min(s, t, cands, n, lru_key);
}

static double lfu_key(tier_store *s, tier_id t, const store_copy *c) { return hot_count(s, c->obj); }

static size_t lfu_pick(void *state, tier_store *s, tier_id t, store_copy *const *cands, size_t n)
{
	return policy_pick_min(s, t, cands, n, lfu_key);
}

const store_policy store_policy_lru = { .name = "lru", .pick_victim = lru_pick };
const store_policy store_policy_lfu = { .name = "lfu", .pick_victim = lfu_pick };
