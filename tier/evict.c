/* evict.c - making room in a tier: the policy picks a victim, which is dropped or demoted.
 *
 * A victim is dropped when that loses nothing: the object is discardable, or the copy is VALID
 * (a current copy lies below it). Otherwise (DIRTY: newer than everything below) it is written to
 * the next enabled tier down first, making room there the same way (HBM -> DDR -> NVMe). When the
 * tier below cannot take it, the next victim is tried. Writebacks run synchronously under the
 * store lock: eviction is short and bounded by the tiers' depth, and no other thread may see a
 * half-demoted copy. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include "tier/store_internal.h"

int store_copy_evictable(const store_copy *c)
{
	return (c->state == TIER_COPY_VALID || c->state == TIER_COPY_DIRTY) && !c->pins && !c->readers &&
	       !c->filling && !c->xfer && !c->obj->guard;
}

tier_id store_tier_below(const tier_store *s, tier_id t)
{
	for (int u = (int)t + 1; u < TIER_NTIERS; u++)
		if (s->be[u])
			return (tier_id)u;
	return TIER_NTIERS;
}

static void count_eviction(tier_store *s, store_copy *c, int writeback)
{
	store_cls_stats *st = &s->cls[c->tier][c->obj->cls];
	st->evictions++;
	if (writeback)
		st->writebacks++;
	else
		st->drops++;
	if (c->prefetched)
		s->pf.wasted++, st->unused++;
}

/* Evict one copy: 0 done, 1 it cannot go anywhere, < 0 its writeback failed (copy kept). */
static int evict_copy(tier_store *s, store_copy *c)
{
	tier_object *o = c->obj;
	if (o->flags & TIER_OBJ_DISCARDABLE || c->state == TIER_COPY_VALID) {
		int other = 0;
		for (int u = 0; u < TIER_NTIERS; u++)
			if ((tier_id)u != c->tier && store_copy_current(&o->copy[u]))
				other = 1;
		if (other || o->flags & TIER_OBJ_DISCARDABLE) {
			count_eviction(s, c, 0);
			store_copy_free(s, c);
			if (!other)
				o->has_data = 0; /* discardable, dropped everywhere: refill with TIER_ACQ_INIT */
			store_refresh(s, o);
			return 0;
		}
	}
	tier_id d = store_tier_below(s, c->tier);
	if (d == TIER_NTIERS || o->copy[d].state != TIER_COPY_ABSENT)
		return 1;
	store_copy *dc = &o->copy[d];
	int rc = store_copy_alloc(s, dc, 0, o, NULL, NULL);
	if (rc)
		return rc;
	o->guard++;
	rc = store_xfer_sync(s, dc, c);
	o->guard--;
	if (rc < 0)
		return rc; /* dc is freed, the victim keeps its data */
	count_eviction(s, c, 1);
	store_copy_free(s, c);
	store_refresh(s, o);
	return 0;
}

/* The candidate buffer is per tier: a demotion recurses into the tiers below with their own. */
int store_evict_one(tier_store *s, tier_id t, int (*filter)(tier_store *, store_copy *, void *), void *arg)
{
	size_t n = 0;
	for (store_copy *c = s->held[t]; c; c = c->next) {
		if (!store_copy_evictable(c) || (filter && !filter(s, c, arg)))
			continue;
		if (c->version != c->obj->version) { /* stale and unused: free room at no cost */
			store_copy_free(s, c);
			return 0;
		}
		if (n == s->cands_cap[t]) {
			size_t cap = s->cands_cap[t] ? 2 * s->cands_cap[t] : 64;
			store_copy **p = realloc(s->cands[t], cap * sizeof *p);
			if (!p)
				return tier_fail(-ENOMEM, "out of memory listing eviction candidates");
			s->cands[t] = p;
			s->cands_cap[t] = cap;
		}
		s->cands[t][n++] = c;
	}
	while (n) {
		size_t i = s->pol->pick_victim(s->pol_state, s, t, s->cands[t], n);
		int rc = evict_copy(s, s->cands[t][i]);
		if (rc <= 0)
			return rc;
		s->cands[t][i] = s->cands[t][--n]; /* cannot go anywhere: try the next victim */
	}
	return 1;
}

int store_no_room(tier_store *s, tier_id t, uint64_t bytes, const char *why)
{
	char a[32], b[32], c[32], d[32];
	tier_backend *be = s->be[t];
	if (!be)
		return tier_fail(-EINVAL, "the %s tier is disabled (budget 0): give it a budget", tier_name(t));
	if (backend_rounded(be, bytes) > backend_capacity(be))
		return tier_fail(-ENOSPC, "%s: %s does not fit in the %s budget of %s: raise the budget or use another tier",
				 why, tier_format_size(bytes, a, sizeof a), tier_name(t),
				 tier_format_size(backend_capacity(be), d, sizeof d));
	const char *hint = s->pinned_bytes[t] + backend_rounded(be, bytes) > backend_capacity(be)
				   ? " (release pinned objects or raise the budget)"
				   : " (the tiers below are full of data that cannot move: raise their budgets)";
	char frag[160], e[32];
	if (backend_used(be) + backend_rounded(be, bytes) <= backend_capacity(be)) {
		/* enough bytes are free, but copies that cannot move split them into smaller runs: pinned
		 * ones, or with nothing pinned, ones the full tiers below cannot take */
		snprintf(frag, sizeof frag, " (free space split by %s: the largest free run is %s; raise the budget%s)",
			 s->pinned_bytes[t] ? "pinned copies" : "copies that the tiers below have no room for",
			 tier_format_size(backend_largest_free(be), e, sizeof e),
			 s->pinned_bytes[t] ? "" : "s below");
		hint = frag;
	}
	return tier_fail(-ENOSPC, "%s: no room for %s in %s: %s pinned, %s used of a %s budget%s",
			 why, tier_format_size(bytes, a, sizeof a), tier_name(t),
			 tier_format_size(s->pinned_bytes[t], b, sizeof b), tier_format_size(backend_used(be), c, sizeof c),
			 tier_format_size(backend_capacity(be), d, sizeof d), hint);
}
