/* admit.c - admission by value density: HBM first, then DDR where fetching beats recomputing. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include "cache/opcache_internal.h"

double cache_recompute_ns(const tier_cache *c, double flops, double traffic)
{
	double a = flops / c->rates.flops_per_s, b = traffic / c->rates.mem_bytes_per_s;
	return 1e9 * (a > b ? a : b);
}

/* An entry kept in DDR crosses the link twice: out in the forward (the offer's copy, or a
 * demotion, both synchronous) and back in the backward. */
double cache_ddr_ns(const tier_cache *c, uint64_t bytes)
{
	return 2e9 * (double)bytes / c->rates.link_bytes_per_s;
}

/* Time a hit saves per byte held in tier t: a hit from HBM saves the recompute, one from DDR the
 * recompute less the round trip over the link. */
double cache_density(const tier_cache *c, const cache_entry *e, tier_id t)
{
	double saved = e->recompute_ns;
	if (t == TIER_DDR && !e->overlapped)
		saved -= cache_ddr_ns(c, e->bytes);
	return saved / (double)e->bytes;
}

typedef struct {
	const tier_cache *c;
	cache_entry **v;
	size_t n, cap;
	tier_id t;
	double max_density;
	int failed;
} victims;

static int is_victim(const tier_cache *c, const cache_entry *e, tier_id t)
{
	if (!e->obj || e->pinned || e->held || !e->in[t] || e == c->keep)
		return 0;
	return t == TIER_HBM || !e->in[TIER_HBM]; /* DDR: only entries living there alone */
}

static void collect(tier_cache *c, cache_entry *e, void *arg)
{
	victims *vs = arg;
	if (vs->failed || !is_victim(c, e, vs->t) || !(cache_density(c, e, vs->t) < vs->max_density))
		return;
	if (vs->n == vs->cap) {
		size_t cap = vs->cap ? 2 * vs->cap : 32;
		cache_entry **p = realloc(vs->v, cap * sizeof *p);
		if (!p) {
			vs->failed = 1;
			return;
		}
		vs->v = p;
		vs->cap = cap;
	}
	vs->v[vs->n++] = e;
}

static int by_density(const void *a, const void *b, void *arg)
{
	const victims *vs = arg;
	const tier_cache *c = vs->c;
	double x = cache_density(c, *(cache_entry *const *)a, vs->t);
	double y = cache_density(c, *(cache_entry *const *)b, vs->t);
	return x < y ? -1 : x > y;
}

/* An HBM victim goes to DDR when a hit from there still saves time and DDR has room (evicting
 * only DDR entries of lower DDR density); else it is dropped. */
static void evict_hbm(tier_cache *c, cache_entry *e)
{
	tier_cache_kind_stats *st = &c->st[e->kind];
	st->evicted[0]++;
	if (e->in[TIER_DDR]) { /* fetched earlier: the DDR copy is still there */
		if (tier_migrate(c->s, e->obj, TIER_DDR) == 0) {
			cache_set_in(c, e, TIER_HBM, 0);
			e->home = TIER_DDR;
			return;
		}
	} else if (c->cfg.policy == TIER_CACHE_VALUE && cache_density(c, e, TIER_DDR) > 0 &&
		   e->bytes <= c->cfg.budget[1]) {
		int64_t need = (int64_t)(c->used[1] + e->bytes) - (int64_t)c->cfg.budget[1];
		if ((need <= 0 || cache_make_room(c, TIER_DDR, (uint64_t)need, cache_density(c, e, TIER_DDR))) &&
		    tier_migrate(c->s, e->obj, TIER_DDR) == 0) {
			cache_set_in(c, e, TIER_HBM, 0);
			cache_set_in(c, e, TIER_DDR, 1);
			e->home = TIER_DDR;
			st->bytes_spilled += e->bytes;
			return;
		}
	}
	cache_free_obj(c, e);
}

int cache_make_room(tier_cache *c, tier_id t, uint64_t need, double max_density)
{
	victims vs = { c, NULL, 0, 0, t, max_density, 0 };
	cache_foreach(c, collect, &vs);
	if (vs.n > 1)
		qsort_r(vs.v, vs.n, sizeof *vs.v, by_density, &vs);
	uint64_t got = 0;
	size_t k = 0;
	while (k < vs.n && got < need)
		got += vs.v[k++]->bytes;
	int ok = !vs.failed && got >= need;
	for (size_t i = 0; ok && i < k; i++) {
		if (t == TIER_HBM) {
			evict_hbm(c, vs.v[i]);
		} else {
			c->st[vs.v[i]->kind].evicted[1]++;
			cache_free_obj(c, vs.v[i]);
		}
	}
	free(vs.v);
	return ok;
}

/* Room for e in tier t, evicting entries of lower density than e there when `evict`. */
static int room_for(tier_cache *c, cache_entry *e, tier_id t, int evict)
{
	uint64_t budget = c->cfg.budget[t];
	if (e->bytes > budget)
		return 0;
	if (c->used[t] + e->bytes > budget)
		cache_reconcile(c); /* the store may have dropped copies on its own */
	if (c->used[t] + e->bytes <= budget)
		return 1;
	return evict && cache_make_room(c, t, c->used[t] + e->bytes - budget, cache_density(c, e, t));
}

tier_id cache_choose(tier_cache *c, cache_entry *e)
{
	switch (c->cfg.policy) {
	case TIER_CACHE_FCFS:
		return room_for(c, e, TIER_HBM, 0) ? TIER_HBM : TIER_NTIERS;
	case TIER_CACHE_VALUE:
		/* overlapped copies: DDR first, the HBM budget left to the fetches back (or none:
		 * tier_cache_get_home) */
		if (e->overlapped && room_for(c, e, TIER_DDR, 1))
			return TIER_DDR;
		if (room_for(c, e, TIER_HBM, 1))
			return TIER_HBM;
		/* DDR only for what a get can bring into the HBM budget later */
		if (e->bytes <= c->cfg.budget[0] && cache_ddr_ns(c, e->bytes) < e->recompute_ns &&
		    room_for(c, e, TIER_DDR, 1))
			return TIER_DDR;
		return TIER_NTIERS;
	default:
		return TIER_NTIERS;
	}
}
