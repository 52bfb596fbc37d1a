/* opcache.c - the op cache's table of entries, offers in the forward, gets in the backward. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cache/opcache_internal.h"

void tier_cache_rates_default(tier_cache_rates *r, tier_dev_kind kind)
{
	if (kind == TIER_DEV_CUDA) {
		r->flops_per_s = 700e12;
		r->mem_bytes_per_s = 4.0e12;
		r->link_bytes_per_s = 50e9;
	} else {
		r->flops_per_s = 50e9;
		r->mem_bytes_per_s = 20e9;
		r->link_bytes_per_s = 10e9;
	}
	r->measure_link = 1;
}

static int rates_ok(const tier_cache_rates *r)
{
	return r->flops_per_s > 0 && r->mem_bytes_per_s > 0 && r->link_bytes_per_s > 0 && isfinite(r->flops_per_s) &&
	       isfinite(r->mem_bytes_per_s) && isfinite(r->link_bytes_per_s);
}

/* ---- Table ------------------------------------------------------------------------------------ */
static size_t key_hash(tier_cache_key k)
{
	uint64_t h = k.layer * 0x9E3779B97F4A7C15ull ^ k.op * 0xC2B2AE3D27D4EB4Full ^ k.microbatch * 0x165667B19E3779F9ull;
	return (size_t)(h ^ h >> 29);
}

static int key_eq(tier_cache_key a, tier_cache_key b)
{
	return a.layer == b.layer && a.op == b.op && a.microbatch == b.microbatch;
}

static cache_entry *find(tier_cache *c, tier_cache_key k)
{
	for (cache_entry *e = c->buckets[key_hash(k) & (c->nbuckets - 1)]; e; e = e->next)
		if (key_eq(e->key, k))
			return e;
	return NULL;
}

static int grow(tier_cache *c)
{
	size_t nb = c->nbuckets * 2;
	cache_entry **b = calloc(nb, sizeof *b);
	if (!b)
		return tier_fail(-ENOMEM, "op cache: out of memory growing the table");
	for (size_t i = 0; i < c->nbuckets; i++)
		for (cache_entry *e = c->buckets[i], *nx; e; e = nx) {
			nx = e->next;
			size_t h = key_hash(e->key) & (nb - 1);
			e->next = b[h];
			b[h] = e;
		}
	free(c->buckets);
	c->buckets = b;
	c->nbuckets = nb;
	return 0;
}

void cache_foreach(tier_cache *c, void (*fn)(tier_cache *, cache_entry *, void *), void *arg)
{
	for (size_t i = 0; i < c->nbuckets; i++)
		for (cache_entry *e = c->buckets[i]; e; e = e->next)
			fn(c, e, arg);
}

/* ---- Accounting ------------------------------------------------------------------------------- */
void cache_set_in(tier_cache *c, cache_entry *e, tier_id t, int in)
{
	if (e->in[t] == in)
		return;
	e->in[t] = (unsigned char)in;
	if (in) {
		c->used[t] += e->bytes;
		if (c->used[t] > c->peak[t])
			c->peak[t] = c->used[t];
	} else {
		c->used[t] -= e->bytes;
	}
}

void cache_free_obj(tier_cache *c, cache_entry *e)
{
	if (!e->obj)
		return;
	int rc = tier_obj_destroy(c->s, e->obj);
	if (rc) /* pinned by someone else: leave it to the store, it is no longer ours */
		tier_log(TIER_LOG_WARN, "op cache: dropping entry (layer %u op %u mb %u): %s", e->key.layer, e->key.op,
			 e->key.microbatch, tier_last_error());
	e->obj = NULL;
	cache_set_in(c, e, TIER_HBM, 0);
	cache_set_in(c, e, TIER_DDR, 0);
}

static int present(tier_cache *c, cache_entry *e, tier_id t)
{
	return tier_obj_state(c->s, e->obj, t) != TIER_COPY_ABSENT;
}

static void reconcile_one(tier_cache *c, cache_entry *e, void *arg)
{
	if (!e->obj || e->pinned || e->held)
		return;
	for (int t = 0; t < 2; t++)
		cache_set_in(c, e, (tier_id)t, present(c, e, (tier_id)t));
	if (!e->in[0] && !e->in[1]) {
		c->st[e->kind].lost++;
		cache_free_obj(c, e);
	}
}

void cache_reconcile(tier_cache *c)
{
	cache_foreach(c, reconcile_one, NULL);
}

/* ---- Create, destroy -------------------------------------------------------------------------- */
int tier_cache_create(tier_cache **out, tier_store *s, tier_dev *dev, const tier_cache_config *cfg,
		      const tier_cache_rates *rates)
{
	if (!out || !s || !cfg)
		return tier_fail(-EINVAL, "tier_cache_create: NULL output, store or config");
	*out = NULL;
	if ((unsigned)cfg->policy >= TIER_NCACHE_POLICIES || cfg->n_rules > TIER_CACHE_MAX_RULES)
		return tier_fail(-EINVAL, "tier_cache_create: bad policy %d or rule count %u", (int)cfg->policy, cfg->n_rules);
	tier_stats snap;
	tier_store_stats(s, &snap);
	for (int t = 0; t < 2; t++)
		if (cfg->budget[t] > snap.tier[t].capacity)
			return tier_fail(-EINVAL, "op cache: %s budget of %" PRIu64 " bytes is larger than the store's %s "
					 "tier (%" PRIu64 " bytes): give it a share of the tier", tier_name((tier_id)t),
					 cfg->budget[t], tier_name((tier_id)t), snap.tier[t].capacity);
	tier_cache_rates r;
	if (rates)
		r = *rates;
	else
		tier_cache_rates_default(&r, dev ? tier_dev_kind_of(dev) : TIER_DEV_CPU);
	if (!rates_ok(&r))
		return tier_fail(-EINVAL, "op cache: device rates must be positive and finite (FLOP/s, memory and link B/s)");
	tier_cache *c = calloc(1, sizeof *c);
	if (!c || !(c->buckets = calloc(64, sizeof *c->buckets))) {
		free(c);
		return tier_fail(-ENOMEM, "op cache: out of memory");
	}
	c->nbuckets = 64;
	c->s = s;
	c->dev = dev;
	c->cfg = *cfg;
	c->rates = r;
	tier_link_stats ls;
	tier_offload_link_stats(tier_store_offload(s), TIER_LINK_H2D, &ls);
	c->link_bytes0 = ls.bytes;
	c->link_busy0 = ls.busy_ns;
	*out = c;
	return 0;
}

static void unlink_all(tier_cache *c, uint32_t mb, int *busy, int *freed)
{
	for (size_t i = 0; i < c->nbuckets; i++)
		for (cache_entry **pp = &c->buckets[i], *e; (e = *pp);) {
			if (mb != UINT32_MAX && e->key.microbatch != mb) {
				pp = &e->next;
				continue;
			}
			if ((e->pinned || e->held) && busy) {
				*busy = 1;
				pp = &e->next;
				continue;
			}
			if (e->pinned)
				tier_release(c->s, e->obj, e->got_at, 0);
			if (e->held)
				tier_release(c->s, e->obj, e->home, 0);
			e->pinned = e->held = 0;
			if (e->obj && freed)
				(*freed)++;
			cache_free_obj(c, e);
			*pp = e->next;
			free(e);
			c->n--;
		}
}

void tier_cache_destroy(tier_cache *c)
{
	if (!c)
		return;
	unlink_all(c, UINT32_MAX, NULL, NULL);
	free(c->buckets);
	free(c);
}

void tier_cache_set_rates(tier_cache *c, const tier_cache_rates *r)
{
	if (rates_ok(r))
		c->rates = *r;
	else
		tier_log(TIER_LOG_WARN, "op cache: ignoring rates that are not positive and finite");
}

void tier_cache_get_rates(const tier_cache *c, tier_cache_rates *r)
{
	*r = c->rates;
}

/* Refine the link rate from the store's h2d transfers since the last update (1 MiB at least). */
static void update_link(tier_cache *c)
{
	if (!c->rates.measure_link)
		return;
	tier_link_stats ls;
	tier_offload_link_stats(tier_store_offload(c->s), TIER_LINK_H2D, &ls);
	uint64_t db = ls.bytes - c->link_bytes0, dt = ls.busy_ns - c->link_busy0;
	if (db < (1u << 20) || !dt)
		return;
	double rate = (double)db / ((double)dt * 1e-9);
	c->rates.link_bytes_per_s = 0.5 * c->rates.link_bytes_per_s + 0.5 * rate;
	c->link_bytes0 = ls.bytes;
	c->link_busy0 = ls.busy_ns;
}

/* ---- Forward ---------------------------------------------------------------------------------- */
/* hold: the copy is queued, not waited for, and the entry stays pinned (tier_cache_offer_done);
 * src NULL (a reservation, always held): no copy, the copy's address kept for the fill. */
static int place(tier_cache *c, cache_entry *e, tier_id t, const void *src, void *stream, int hold)
{
	tier_object *o;
	void *dst;
	int rc = tier_obj_create(c->s, e->bytes, TIER_CLASS_OPCACHE, TIER_OBJ_DISCARDABLE, &o);
	if (rc)
		return rc;
	tier_obj_set_cost(c->s, o, e->recompute_ns);
	rc = tier_acquire(c->s, o, t, TIER_ACQ_INIT, &dst, NULL);
	if (rc) {
		tier_obj_destroy(c->s, o);
		return rc;
	}
	rc = src ? cache_copy_in(c->dev, dst, src, e->bytes, stream, !hold) : 0;
	if (rc || !hold)
		tier_release(c->s, o, t, rc == 0);
	if (rc) {
		tier_obj_destroy(c->s, o);
		return rc;
	}
	e->held = (unsigned char)hold;
	e->fill_at = src ? NULL : dst;
	e->obj = o;
	e->home = t;
	cache_set_in(c, e, t, 1);
	return 0;
}

/* src NULL: a reservation (tier_cache_reserve). */
static int offer(tier_cache *c, tier_cache_key key, const void *src, uint64_t bytes, const tier_op_cost *cost,
		 void *stream, tier_id *where, int hold)
{
	if (where)
		*where = TIER_NTIERS;
	if (!c || (!src && !hold) || !cost || !bytes)
		return tier_fail(-EINVAL, "tier_cache_offer: NULL cache, source or cost, or 0 bytes");
	if ((unsigned)cost->kind >= TIER_NOPKINDS || !(cost->flops >= 0) || !(cost->bytes >= 0) ||
	    !isfinite(cost->flops) || !isfinite(cost->bytes))
		return tier_fail(-EINVAL, "tier_cache_offer: bad cost (kind %d, %g FLOPs, %g bytes): kinds are "
				 "tier_op_kind, costs finite and >= 0", (int)cost->kind, cost->flops, cost->bytes);
	if (find(c, key))
		return tier_fail(-EEXIST, "tier_cache_offer: layer %u op %u micro-batch %u was offered already: end the "
				 "micro-batch (tier_cache_end_microbatch) before offering it again", key.layer, key.op,
				 key.microbatch);
	if (c->n >= 2 * c->nbuckets && grow(c))
		return -ENOMEM;
	cache_entry *e = calloc(1, sizeof *e);
	if (!e)
		return tier_fail(-ENOMEM, "op cache: out of memory");
	e->key = key;
	e->kind = cost->kind;
	e->bytes = bytes;
	e->flops = cost->flops;
	e->recompute_ns = cache_recompute_ns(c, cost->flops, cost->bytes);
	e->overlapped = cost->overlapped != 0;
	size_t h = key_hash(key) & (c->nbuckets - 1);
	e->next = c->buckets[h];
	c->buckets[h] = e;
	c->n++;

	tier_cache_kind_stats *st = &c->st[e->kind];
	st->offers++;
	if (!tier_cache_rules_match(&c->cfg, e->kind, key.layer)) {
		st->rejected++;
		return 0;
	}
	tier_id t = cache_choose(c, e);
	if (t == TIER_NTIERS) {
		st->dropped++;
		return 0;
	}
	int rc = place(c, e, t, src, stream, hold);
	if (rc == -ENOSPC) { /* the store is full of pinned data: not admitted, not an error */
		tier_log(TIER_LOG_DEBUG, "op cache: no room in the store for layer %u op %u: %s", key.layer, key.op,
			 tier_last_error());
		st->dropped++;
		return 0;
	}
	if (rc)
		return rc;
	st->admitted[t]++;
	st->bytes_in += bytes;
	if (where)
		*where = t;
	return 0;
}

int tier_cache_offer(tier_cache *c, tier_cache_key key, const void *src, uint64_t bytes, const tier_op_cost *cost,
		     void *stream, tier_id *where)
{
	return offer(c, key, src, bytes, cost, stream, where, 0);
}

int tier_cache_offer_async(tier_cache *c, tier_cache_key key, const void *src, uint64_t bytes,
			   const tier_op_cost *cost, void *stream, tier_id *where)
{
	return offer(c, key, src, bytes, cost, stream, where, 1);
}

int tier_cache_reserve(tier_cache *c, tier_cache_key key, uint64_t bytes, const tier_op_cost *cost, void **ptr,
		       tier_id *where)
{
	tier_id w;
	if (!ptr)
		return tier_fail(-EINVAL, "tier_cache_reserve: NULL output");
	*ptr = NULL;
	int rc = offer(c, key, NULL, bytes, cost, NULL, &w, 1);
	if (where)
		*where = w;
	if (!rc && w == TIER_HBM)
		*ptr = find(c, key)->fill_at;
	return rc;
}

/* A reservation's memory, handed over once (fn: the caller's name for the messages); its size in
 * *bytes when bytes is not NULL. */
static int take_target(tier_cache *c, tier_cache_key key, const char *fn, void **dst, size_t *bytes)
{
	cache_entry *e = c ? find(c, key) : NULL;
	if (!dst || !e)
		return tier_fail(-EINVAL, "%s: layer %u op %u micro-batch %u was not reserved, or a NULL argument", fn,
				 key.layer, key.op, key.microbatch);
	*dst = NULL;
	if (!e->held) /* not admitted */
		return 0;
	if (!e->fill_at)
		return tier_fail(-EINVAL, "%s: layer %u op %u micro-batch %u is filled already", fn, key.layer, key.op,
				 key.microbatch);
	*dst = e->fill_at;
	e->fill_at = NULL;
	if (bytes)
		*bytes = e->bytes;
	return 0;
}

int tier_cache_offer_target(tier_cache *c, tier_cache_key key, void **dst)
{
	return take_target(c, key, "tier_cache_offer_target", dst, NULL);
}

int tier_cache_offer_fill(tier_cache *c, tier_cache_key key, const void *src, void *stream)
{
	void *dst = NULL;
	size_t n = 0;
	int rc = src ? take_target(c, key, "tier_cache_offer_fill", &dst, &n)
		     : tier_fail(-EINVAL, "tier_cache_offer_fill: a NULL source");
	return rc || !dst ? rc : cache_copy_in(c->dev, dst, src, n, stream, 0);
}

int tier_cache_offer_done(tier_cache *c, tier_cache_key key)
{
	cache_entry *e = c ? find(c, key) : NULL;
	if (!e)
		return tier_fail(-EINVAL, "tier_cache_offer_done: layer %u op %u micro-batch %u was not offered",
				 key.layer, key.op, key.microbatch);
	if (!e->held) /* not admitted: nothing was queued */
		return 0;
	e->held = 0, e->fill_at = NULL;
	return tier_release(c->s, e->obj, e->home, 1);
}

int tier_cache_offer_drop(tier_cache *c, tier_cache_key key)
{
	cache_entry *e = c ? find(c, key) : NULL;
	if (!e)
		return tier_fail(-EINVAL, "tier_cache_offer_drop: layer %u op %u micro-batch %u was not offered",
				 key.layer, key.op, key.microbatch);
	if (!e->held)
		return 0;
	e->held = 0, e->fill_at = NULL;
	/* released clean after its TIER_ACQ_INIT: the store drops the copy (and says so: expected) */
	(void)tier_release(c->s, e->obj, e->home, 0);
	cache_free_obj(c, e);
	c->st[e->kind].dropped++;
	return 0;
}

/* ---- Backward --------------------------------------------------------------------------------- */
/* A miss on an entry whose data is gone: forget the object, keep the entry for the stats. */
static int miss(tier_cache *c, cache_entry *e, int lost)
{
	if (lost)
		c->st[e->kind].lost++;
	cache_free_obj(c, e);
	c->st[e->kind].misses++;
	return 1;
}

/* The entry a get may pin: 0 with *out, 1 a miss (counted), -EBUSY when it is held. */
static int get_entry(tier_cache *c, tier_cache_key key, const char *fn, cache_entry **out)
{
	cache_entry *e = *out = find(c, key);
	if (!e) {
		c->unknown_misses++;
		return 1;
	}
	if (!e->obj)
		return miss(c, e, 0);
	if (e->pinned || e->held)
		return tier_fail(-EBUSY, "%s: layer %u op %u micro-batch %u is held by %s: %s first", fn, key.layer, key.op,
				 key.microbatch, e->pinned ? "an earlier get" : "its asynchronous offer",
				 e->pinned ? "release it" : "call tier_cache_offer_done");
	return 0;
}

/* A hit, counted by where the entry lives (home), pinned in tier `at` until its release. */
static void pin_hit(tier_cache *c, cache_entry *e, tier_id at)
{
	c->st[e->kind].hits[e->home == TIER_DDR]++;
	c->st[e->kind].flops_saved += e->flops;
	e->pinned = 1, e->got_at = at;
}

int tier_cache_get(tier_cache *c, tier_cache_key key, void **ptr)
{
	if (!c || !ptr)
		return tier_fail(-EINVAL, "tier_cache_get: NULL cache or output");
	*ptr = NULL;
	cache_entry *e;
	int r = get_entry(c, key, "tier_cache_get", &e);
	if (r)
		return r;
	tier_cache_kind_stats *st = &c->st[e->kind];
	tier_copy_state was = tier_obj_state(c->s, e->obj, TIER_HBM);
	if (was == TIER_COPY_ABSENT && !e->in[TIER_HBM]) {
		/* Fetch from DDR into HBM: the copy must fit the HBM budget too. */
		int64_t need = (int64_t)(c->used[0] + e->bytes) - (int64_t)c->cfg.budget[0];
		if (need > 0)
			cache_reconcile(c);
		if (!e->obj)
			return miss(c, e, 0); /* reconcile found it gone (and counted it lost) */
		need = (int64_t)(c->used[0] + e->bytes) - (int64_t)c->cfg.budget[0];
		c->keep = e;
		int ok = need <= 0 || cache_make_room(c, TIER_HBM, (uint64_t)need, INFINITY);
		c->keep = NULL;
		if (!ok) {
			c->st[e->kind].misses++; /* no room to bring it in now: recompute, keep the entry */
			return 1;
		}
	}
	uint64_t t0 = tier_now_ns();
	void *p;
	int rc = tier_acquire(c->s, e->obj, TIER_HBM, 0, &p, NULL);
	st->stall_ns += tier_now_ns() - t0;
	if (rc == -ENODATA)
		return miss(c, e, 1);
	if (rc == -ENOSPC) {
		st->misses++;
		return 1;
	}
	if (rc) {
		cache_free_obj(c, e);
		return rc;
	}
	if (was == TIER_COPY_ABSENT)
		st->bytes_fetched += e->bytes;
	cache_set_in(c, e, TIER_HBM, 1);
	cache_set_in(c, e, TIER_DDR, present(c, e, TIER_DDR));
	pin_hit(c, e, TIER_HBM);
	update_link(c);
	*ptr = p;
	return 0;
}

int tier_cache_get_home(tier_cache *c, tier_cache_key key, void **ptr, tier_id *where)
{
	if (!c || !ptr || !where)
		return tier_fail(-EINVAL, "tier_cache_get_home: NULL cache or output");
	*ptr = NULL, *where = TIER_NTIERS;
	cache_entry *e;
	int r = get_entry(c, key, "tier_cache_get_home", &e);
	if (r)
		return r;
	tier_id t = e->in[TIER_HBM] ? TIER_HBM : TIER_DDR;
	void *p;
	int rc = tier_acquire(c->s, e->obj, t, 0, &p, NULL);
	if (rc == -ENODATA || rc == -ENOSPC) /* gone: the store dropped it */
		return miss(c, e, 1);
	if (rc) {
		cache_free_obj(c, e);
		return rc;
	}
	pin_hit(c, e, t);
	*ptr = p, *where = t;
	return 0;
}

int tier_cache_release(tier_cache *c, tier_cache_key key, int done)
{
	cache_entry *e = c ? find(c, key) : NULL;
	if (!e || !e->pinned)
		return tier_fail(-EINVAL, "tier_cache_release: layer %u op %u micro-batch %u is not held by a get",
				 key.layer, key.op, key.microbatch);
	int rc = tier_release(c->s, e->obj, e->got_at, 0);
	e->pinned = 0;
	if (done || rc)
		cache_free_obj(c, e);
	return rc;
}

typedef struct {
	uint32_t layer, mb;
	int started;
} pf_arg;

static void prefetch_one(tier_cache *c, cache_entry *e, void *arg)
{
	pf_arg *a = arg;
	if (!e->obj || e->pinned || e->held || e->key.layer != a->layer || (a->mb != UINT32_MAX && e->key.microbatch != a->mb) ||
	    e->in[TIER_HBM] || c->used[0] + e->bytes > c->cfg.budget[0])
		return;
	if (tier_prefetch(c->s, e->obj, TIER_HBM) == 0) {
		cache_set_in(c, e, TIER_HBM, 1);
		c->st[e->kind].bytes_fetched += e->bytes;
		a->started++;
	}
}

int tier_cache_prefetch_backward(tier_cache *c, uint32_t layer, uint32_t microbatch)
{
	if (!c)
		return 0;
	pf_arg a = { layer, microbatch, 0 };
	cache_foreach(c, prefetch_one, &a);
	return a.started;
}

int tier_cache_end_microbatch(tier_cache *c, uint32_t microbatch)
{
	if (!c)
		return tier_fail(-EINVAL, "tier_cache_end_microbatch: NULL cache");
	int busy = 0, freed = 0;
	unlink_all(c, microbatch, &busy, &freed);
	if (busy)
		return tier_fail(-EBUSY, "tier_cache_end_microbatch: an entry of micro-batch %u is still held by a get: "
				 "release it first", microbatch);
	return freed;
}

/* ---- Stats and checks ------------------------------------------------------------------------- */
static void add_stats(tier_cache_kind_stats *a, const tier_cache_kind_stats *b)
{
	uint64_t *x = (uint64_t *)a;
	const uint64_t *y = (const uint64_t *)b;
	double fs = a->flops_saved + b->flops_saved;
	for (size_t i = 0; i < sizeof *a / sizeof(uint64_t); i++)
		x[i] += y[i]; /* flops_saved is overwritten below */
	a->flops_saved = fs;
}

void tier_cache_stats_get(tier_cache *c, tier_cache_stats *out)
{
	memset(out, 0, sizeof *out);
	for (int k = 0; k < TIER_NOPKINDS; k++) {
		out->kind[k] = c->st[k];
		add_stats(&out->total, &c->st[k]);
	}
	out->total.misses += c->unknown_misses;
	for (int t = 0; t < 2; t++) {
		out->budget[t] = c->cfg.budget[t];
		out->used[t] = c->used[t];
		out->peak[t] = c->peak[t];
	}
	out->entries = c->n;
	out->link_bytes_per_s = c->rates.link_bytes_per_s;
}

void tier_cache_stats_reset(tier_cache *c)
{
	memset(c->st, 0, sizeof c->st);
	c->unknown_misses = 0;
	c->peak[0] = c->used[0];
	c->peak[1] = c->used[1];
}

typedef struct {
	uint64_t sum[2];
	char msg[200];
} check_arg;

static void check_one(tier_cache *c, cache_entry *e, void *arg)
{
	check_arg *a = arg;
	for (int t = 0; t < 2; t++) {
		if (e->in[t])
			a->sum[t] += e->bytes;
		if (e->obj && !e->in[t] && present(c, e, (tier_id)t) && !a->msg[0])
			snprintf(a->msg, sizeof a->msg, "layer %u op %u has a %s copy the cache does not count",
				 e->key.layer, e->key.op, tier_name((tier_id)t));
	}
	if (!e->obj && (e->in[0] || e->in[1] || e->pinned || e->held) && !a->msg[0])
		snprintf(a->msg, sizeof a->msg, "layer %u op %u counts copies without an object", e->key.layer, e->key.op);
	int hbm_pin = (e->pinned && e->got_at == TIER_HBM) || (e->held && e->home == TIER_HBM);
	if (e->obj && (tier_obj_pins(c->s, e->obj, TIER_HBM) > 0) != hbm_pin && !a->msg[0])
		snprintf(a->msg, sizeof a->msg, "layer %u op %u: pinned %d but the store has %u pins", e->key.layer,
			 e->key.op, hbm_pin, tier_obj_pins(c->s, e->obj, TIER_HBM));
}

int tier_cache_check(tier_cache *c)
{
	check_arg a = { { 0, 0 }, "" };
	cache_foreach(c, check_one, &a);
	if (a.msg[0])
		return tier_fail(-EPROTO, "op cache check: %s", a.msg);
	for (int t = 0; t < 2; t++) {
		if (a.sum[t] != c->used[t])
			return tier_fail(-EPROTO, "op cache check: %s entries sum to %" PRIu64 " bytes, the cache counts %" PRIu64,
					 tier_name((tier_id)t), a.sum[t], c->used[t]);
		if (c->used[t] > c->cfg.budget[t])
			return tier_fail(-EPROTO, "op cache check: %s holds %" PRIu64 " bytes over its budget of %" PRIu64,
					 tier_name((tier_id)t), c->used[t], c->cfg.budget[t]);
	}
	return tier_store_check(c->s);
}
