/* tune_sim.c - the cache simulator behind tier-tune (docs/trace.md has the model and its limits).
 *
 * Each level (HBM, then DDR) is replayed on its own: the HBM level sees the HBM acquires and dirty
 * releases; what it misses (and what it writes back) becomes the DDR level's stream, together with
 * the DDR acquires. Victims are found by a scan of the level's cached objects (a few hundred in
 * practice), keyed as the store's policies key them. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/store.h"
#include "tune_sim.h"

#define NEVER UINT64_MAX

const char *sim_policy_name(sim_policy p)
{
	static const char *const n[SIM_NPOL] = { "lru", "lfu", "cost", "schedule", "min" };
	return (unsigned)p < SIM_NPOL ? n[p] : "?";
}

int sim_trace_add(sim_trace *t, uint32_t obj, uint32_t step, int tier, int kind)
{
	if (t->n == t->cap) {
		size_t cap = t->cap ? 2 * t->cap : 4096;
		sim_req *r = realloc(t->req, cap * sizeof *r);
		if (!r)
			return tier_fail(-ENOMEM, "out of memory for %zu trace requests", cap);
		t->req = r, t->cap = cap;
	}
	t->req[t->n++] = (sim_req){ .obj = obj, .step = step, .tier = (uint8_t)tier, .kind = (uint8_t)kind };
	return 0;
}

int sim_trace_object(sim_trace *t, uint32_t obj, uint64_t size)
{
	if (obj >= t->nobj) {
		size_t n = obj + 1;
		uint64_t *s = realloc(t->size, n * sizeof *s), *id;
		if (s)
			t->size = s;
		id = s ? realloc(t->id, n * sizeof *id) : NULL;
		if (!s || !id)
			return tier_fail(-ENOMEM, "out of memory for %zu trace objects", n);
		t->id = id;
		for (size_t i = t->nobj; i < n; i++)
			t->size[i] = 1, t->id[i] = i;
		t->nobj = n;
	}
	t->size[obj] = size;
	return 0;
}

void sim_trace_free(sim_trace *t)
{
	free(t->req);
	free(t->size);
	free(t->id);
	memset(t, 0, sizeof *t);
}

/* Object id -> dense index: open addressing, grown at half load. */
typedef struct {
	uint64_t *key;
	uint32_t *val;
	size_t cap, n;
} idmap;

static uint32_t *idmap_slot(idmap *m, uint64_t id)
{
	size_t i = (size_t)(id * 0x9e3779b97f4a7c15ull) & (m->cap - 1);
	while (m->key[i] && m->key[i] != id + 1)
		i = (i + 1) & (m->cap - 1);
	if (!m->key[i])
		m->key[i] = id + 1, m->val[i] = UINT32_MAX, m->n++;
	return &m->val[i];
}

static int idmap_grow(idmap *m)
{
	idmap g = { .cap = m->cap ? 2 * m->cap : 1024 };
	g.key = calloc(g.cap, sizeof *g.key);
	g.val = calloc(g.cap, sizeof *g.val);
	if (!g.key || !g.val) {
		free(g.key);
		free(g.val);
		return tier_fail(-ENOMEM, "out of memory for the object map");
	}
	for (size_t i = 0; i < m->cap; i++)
		if (m->key[i])
			*idmap_slot(&g, m->key[i] - 1) = m->val[i];
	free(m->key);
	free(m->val);
	*m = g;
	return 0;
}

static int load_rec(sim_trace *t, idmap *m, const tier_trace_rec *r)
{
	int acc = r->kind == TIER_TRC_ACQUIRE, dirty = r->kind == TIER_TRC_RELEASE && r->hit;
	if ((!acc && !dirty) || r->tier > TIER_DDR)
		return 0;
	if (acc) {
		t->rec_acquires[r->tier]++;
		t->rec_hits[r->tier] += r->hit;
	}
	if ((m->n + 1) * 2 > m->cap && idmap_grow(m))
		return -ENOMEM;
	uint32_t *v = idmap_slot(m, r->object);
	if (*v == UINT32_MAX) {
		*v = (uint32_t)t->nobj;
		if (sim_trace_object(t, *v, r->size ? r->size : 1))
			return -ENOMEM;
		t->id[*v] = r->object;
	}
	return sim_trace_add(t, *v, r->step, r->tier, dirty ? SIM_DIRTY : SIM_ACCESS);
}

int sim_trace_load(sim_trace *t, const char *path)
{
	memset(t, 0, sizeof *t);
	tier_trace_reader *rd;
	int rc = tier_trace_open_read(&rd, path);
	if (rc)
		return rc;
	idmap m = { 0 };
	tier_trace_rec r;
	while ((rc = tier_trace_next(rd, &r)) == 1) {
		t->records++;
		if ((rc = load_rec(t, &m, &r)) < 0)
			break;
	}
	free(m.key);
	free(m.val);
	tier_trace_close_read(rd);
	return rc;
}

/* ---- one level ---------------------------------------------------------------------------------- */

typedef struct {
	int in, dirty, seen;
	uint64_t last, next; /* last use (clock), next use (stream position; NEVER) */
	double lcount;       /* log2(decayed count) + count_step / half-life: ordered like the count */
	size_t slot;         /* index in the level's cached array */
} sim_obj;

typedef struct {
	const sim_trace *t;
	sim_policy p;
	int tier;                /* 0: the HBM level, 1: the DDR level */
	double hl;
	uint64_t cap, used, clock;
	sim_obj *o;
	uint32_t *cached;
	size_t ncached;
	const uint64_t *nextpos; /* per stream position: the next access of the same object */
	sim_trace *down;         /* the lower level's stream (NULL at the last level) */
	uint64_t *rd, *wr;       /* bytes read up into / written down from this level */
	uint64_t hits, misses, cold;
} level;

static double key(const level *L, uint32_t i)
{
	const sim_obj *o = &L->o[i];
	switch (L->p) {
	case SIM_LRU: return (double)o->last;
	case SIM_LFU: return o->lcount;
	case SIM_COST: return o->lcount + (o->dirty ? 1.0 : 0.0); /* a dirty copy costs a writeback too */
	default: return o->next == NEVER ? -INFINITY : -(double)o->next; /* furthest next use first */
	}
}

/* The victim: the least key, ties to the least recently used. */
static size_t pick(const level *L)
{
	size_t best = 0;
	double bk = key(L, L->cached[0]);
	for (size_t k = 1; k < L->ncached; k++) {
		double v = key(L, L->cached[k]);
		if (v < bk || (v == bk && L->o[L->cached[k]].last < L->o[L->cached[best]].last))
			best = k, bk = v;
	}
	return best;
}

static int write_down(level *L, uint32_t i, uint32_t step)
{
	*L->wr += L->t->size[i];
	return L->down ? sim_trace_add(L->down, i, step, 1, SIM_WRITEBACK) : 0;
}

static int evict(level *L, size_t k, uint32_t step)
{
	uint32_t i = L->cached[k];
	sim_obj *o = &L->o[i];
	int rc = o->dirty ? write_down(L, i, step) : 0;
	o->in = o->dirty = 0;
	L->used -= L->t->size[i];
	L->cached[k] = L->cached[--L->ncached];
	L->o[L->cached[k]].slot = k;
	return rc;
}

/* Make room for object i and cache it; MIN bypasses when i is needed later than every victim. */
static int insert(level *L, uint32_t i, int dirty, uint32_t step)
{
	uint64_t sz = L->t->size[i];
	sim_obj *o = &L->o[i];
	if (sz > L->cap)
		return dirty ? write_down(L, i, step) : 0;
	while (L->used + sz > L->cap) {
		size_t k = pick(L);
		if (L->p == SIM_MIN && L->o[L->cached[k]].next != NEVER && (o->next == NEVER || o->next >= L->o[L->cached[k]].next))
			return dirty ? write_down(L, i, step) : 0;
		int rc = evict(L, k, step);
		if (rc)
			return rc;
	}
	o->in = 1, o->dirty = dirty, o->slot = L->ncached;
	L->cached[L->ncached++] = i;
	L->used += sz;
	return 0;
}

static void touch(level *L, uint32_t i, uint32_t step, uint64_t next)
{
	sim_obj *o = &L->o[i];
	o->last = ++L->clock;
	o->next = next;
	double lc = isinf(L->hl) ? 0 : (double)step / L->hl;
	/* count' = count * 2^-(step - count_step)/hl + 1, kept as log2(count') + step/hl */
	double c = o->seen ? exp2(o->lcount - lc) : 0;
	o->lcount = log2(c + 1) + lc;
}

static int level_run(level *L, const sim_trace *s)
{
	for (size_t n = 0; n < s->n; n++) {
		const sim_req *q = &s->req[n];
		sim_obj *o = &L->o[q->obj];
		int rc = 0;
		if (q->tier != L->tier) { /* a DDR request passes the HBM level, in its place in time */
			if (L->down && (rc = sim_trace_add(L->down, q->obj, q->step, q->tier, q->kind)))
				return rc;
			continue;
		}
		if (q->kind == SIM_DIRTY) {
			if (o->in)
				o->dirty = 1;
			continue;
		}
		if (q->kind == SIM_WRITEBACK) { /* data written into this level from above */
			o->next = L->nextpos[n];
			if (o->in)
				o->dirty = 1;
			else
				rc = insert(L, q->obj, 1, q->step);
			o->seen = 1;
			if (rc)
				return rc;
			continue;
		}
		int first = !o->seen;
		touch(L, q->obj, q->step, L->nextpos[n]);
		o->seen = 1;
		if (o->in) {
			L->hits++;
			continue;
		}
		if (first) {
			L->cold++; /* first touch: the caller fills it (TIER_ACQ_INIT); new data, dirty */
		} else {
			L->misses++;
			*L->rd += L->t->size[q->obj];
			if (L->down && (rc = sim_trace_add(L->down, q->obj, q->step, 1, SIM_ACCESS)))
				return rc;
		}
		if ((rc = insert(L, q->obj, first, q->step)))
			return rc;
	}
	return 0;
}

/* next[i]: the position of the next access of the same object after i (NEVER if none). */
static uint64_t *next_uses(const sim_trace *s, size_t nobj, int tier)
{
	uint64_t *next = malloc((s->n ? s->n : 1) * sizeof *next), *after = malloc((nobj ? nobj : 1) * sizeof *after);
	if (!next || !after) {
		free(next);
		free(after);
		return NULL;
	}
	for (size_t i = 0; i < nobj; i++)
		after[i] = NEVER;
	for (size_t n = s->n; n-- > 0;) {
		next[n] = after[s->req[n].obj];
		if (s->req[n].kind == SIM_ACCESS && s->req[n].tier == tier)
			after[s->req[n].obj] = n;
	}
	free(after);
	return next;
}

static int run_level(level *L, const sim_trace *s)
{
	L->o = calloc(L->t->nobj ? L->t->nobj : 1, sizeof *L->o);
	L->cached = malloc((L->t->nobj ? L->t->nobj : 1) * sizeof *L->cached);
	uint64_t *next = next_uses(s, L->t->nobj, L->tier);
	int rc = L->o && L->cached && next ? 0 : tier_fail(-ENOMEM, "out of memory simulating %zu requests", s->n);
	L->nextpos = next;
	if (!rc)
		rc = level_run(L, s);
	free(L->o);
	free(L->cached);
	free(next);
	return rc;
}

int sim_run(const sim_trace *t, sim_policy p, const sim_config *c, sim_result *r)
{
	memset(r, 0, sizeof *r);
	if ((unsigned)p >= SIM_NPOL || !c->cap[0] || !c->cap[1] || !(c->gbps[0] > 0) || !(c->gbps[1] > 0) ||
	    !(c->half_life > 0))
		return tier_fail(-EINVAL, "simulator: policy, capacities, link rates and half-life must be positive");
	sim_trace down = { .size = t->size, .id = t->id, .nobj = t->nobj };
	level h = { .t = t, .p = p, .tier = 0, .hl = c->half_life, .cap = c->cap[0], .down = &down,
		    .rd = &r->bytes[0][0], .wr = &r->bytes[0][1] };
	level d = { .t = t, .p = p, .tier = 1, .hl = c->half_life, .cap = c->cap[1], .rd = &r->bytes[1][0],
		    .wr = &r->bytes[1][1] };
	int rc = run_level(&h, t);
	if (!rc)
		rc = run_level(&d, &down);
	r->hits[0] = h.hits, r->misses[0] = h.misses, r->cold[0] = h.cold;
	r->hits[1] = d.hits, r->misses[1] = d.misses, r->cold[1] = d.cold;
	free(down.req);
	for (int l = 0; l < 2; l++)
		r->stall_s += (double)(r->bytes[l][0] + r->bytes[l][1]) / (c->gbps[l] * 1e9);
	return rc;
}
