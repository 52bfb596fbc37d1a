/* policy.h - (internal) helpers shared by the replacement policies. */
#ifndef TIER_POLICY_H
#define TIER_POLICY_H

#include "tier/store_internal.h"

/* Lower key = evicted first. */
typedef double (*policy_key_fn)(tier_store *s, tier_id t, const store_copy *c);
size_t policy_pick_min(tier_store *s, tier_id t, store_copy *const *cands, size_t n, policy_key_fn key);

#endif
