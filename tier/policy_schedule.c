/* policy_schedule.c - schedule-aware: evict the copy whose next use in the step schedule is the
 * furthest away (objects never used again first): Belady's choice on a known schedule. Ties, and
 * every choice when no schedule is set, go to the least recently used. */
#include <math.h>
#include "tier/policy.h"

static double sched_key(tier_store *s, tier_id t, const store_copy *c)
{
	uint64_t next = hot_next_use(s, c->obj);
	return next == UINT64_MAX ? -INFINITY : -(double)next;
}

static size_t sched_pick(void *state, tier_store *s, tier_id t, store_copy *const *cands, size_t n)
{
	return policy_pick_min(s, t, cands, n, sched_key);
}

const store_policy store_policy_schedule = { .name = "schedule", .pick_victim = sched_pick };
