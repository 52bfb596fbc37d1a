/* tune_sim.c - the cache simulator behind tier-tune (docs/trace.md has the model and its limits).
 *
 * Each level (HBM, then DDR) is replayed on its own: the HBM level sees the HBM acquires and dirty
 * releases; what it misses (and what it writes back) becomes the DDR level's stream, together with
 * the DDR acquires. Victims are found by a scan of the level's cached objects (a few hundred in
 * practice), keyed as the store's policies key them. The bytes each level moves are charged to the
 * operation of the request that moved them; the overlap timeline then lays those transfers out
 * behind the compute of the operations before, as the store's prefetch window does. */
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

static int push(sim_trace *t, sim_req q)
{
	if (t->n == t->cap) {
		size_t cap = t->cap ? 2 * t->cap : 4096;
		sim_req *r = realloc(t->req, cap * sizeof *r);
		if (!r)
			return tier_fail(-ENOMEM, "out of memory for %zu trace requests", cap);
		t->req = r, t->cap = cap;
	}
	t->req[t->n++] = q;
	return 0;
}

/* Count the open operation (the first request falls in it). */
static void op_count(sim_trace *t, uint32_t step)
{
	if (!t->nops || step < t->step_lo)
		t->step_lo = step;
	if (!t->nops || step > t->step_hi)
		t->step_hi = step;
	t->nops++;
	t->op_open = 0;
}

void sim_trace_op(sim_trace *t, uint32_t step, int keep)
{
	t->op_open = 1; /* an open operation still empty is replaced: it had no request */
	if (keep)
		op_count(t, step);
}

uint32_t sim_trace_steps(const sim_trace *t)
{
	return t->nops ? t->step_hi - t->step_lo + 1 : 1;
}

int sim_trace_add(sim_trace *t, uint32_t obj, uint32_t step, int tier, int kind)
{
	int open = t->op_open || !t->nops;
	int rc = push(t, (sim_req){ .obj = obj, .step = step, .op = (uint32_t)(open ? t->nops : t->nops - 1),
				     .tier = (uint8_t)tier, .kind = (uint8_t)kind });
	if (!rc && open)
		op_count(t, step);
	return rc;
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
	if (r->kind == TIER_TRC_AT_OP || r->kind == TIER_TRC_STEP) {
		sim_trace_op(t, r->step, r->kind == TIER_TRC_AT_OP);
		return 0;
	}
	int acc = r->kind == TIER_TRC_ACQUIRE, dirty = r->kind == TIER_TRC_RELEASE && r->hit;
	int gone = r->kind == TIER_TRC_DISCARD;
	if ((!acc && !dirty && !gone) || r->tier > TIER_DDR)
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
	return sim_trace_add(t, *v, r->step, r->tier, gone ? SIM_DISCARD : dirty ? SIM_DIRTY : SIM_ACCESS);
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
	uint64_t *op_bytes;      /* per operation: bytes over this level's link (NULL: not kept) */
	uint64_t *op_in;         /* per operation: bytes read up into this level (HBM only; or NULL) */
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

/* Bytes over this level's link, charged to the operation of request q. */
static void charge(level *L, const sim_req *q, uint64_t bytes, int up)
{
	*(up ? L->rd : L->wr) += bytes;
	if (L->op_bytes)
		L->op_bytes[q->op] += bytes;
	if (up && L->op_in)
		L->op_in[q->op] += bytes;
}

static int write_down(level *L, uint32_t i, const sim_req *q)
{
	charge(L, q, L->t->size[i], 0);
	return L->down ? push(L->down, (sim_req){ .obj = i, .step = q->step, .op = q->op, .tier = 1,
						  .kind = SIM_WRITEBACK }) : 0;
}

/* Take the k-th cached object out, without writing it anywhere. */
static void drop(level *L, size_t k)
{
	uint32_t i = L->cached[k];
	L->o[i].in = L->o[i].dirty = 0;
	L->used -= L->t->size[i];
	L->cached[k] = L->cached[--L->ncached];
	L->o[L->cached[k]].slot = k;
}

static int evict(level *L, size_t k, const sim_req *q)
{
	uint32_t i = L->cached[k];
	int rc = L->o[i].dirty ? write_down(L, i, q) : 0;
	drop(L, k);
	return rc;
}

/* Make room for object i and cache it; MIN bypasses when i is needed later than every victim. */
static int insert(level *L, uint32_t i, int dirty, const sim_req *q)
{
	uint64_t sz = L->t->size[i];
	sim_obj *o = &L->o[i];
	if (sz > L->cap)
		return dirty ? write_down(L, i, q) : 0;
	while (L->used + sz > L->cap) {
		size_t k = pick(L);
		if (L->p == SIM_MIN && L->o[L->cached[k]].next != NEVER && (o->next == NEVER || o->next >= L->o[L->cached[k]].next))
			return dirty ? write_down(L, i, q) : 0;
		int rc = evict(L, k, q);
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
		if (q->kind == SIM_DISCARD) { /* dropped at every level, unwritten; the next access fills it */
			if (o->in)
				drop(L, o->slot);
			o->seen = 0;
			if (L->down && (rc = push(L->down, *q)))
				return rc;
			continue;
		}
		if (q->tier != L->tier) { /* a DDR request passes the HBM level, in its place in time */
			if (L->down && (rc = push(L->down, *q)))
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
				rc = insert(L, q->obj, 1, q);
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
			charge(L, q, L->t->size[q->obj], 1);
			if (L->down && (rc = push(L->down, (sim_req){ .obj = q->obj, .step = q->step, .op = q->op,
								      .tier = 1, .kind = SIM_ACCESS })))
				return rc;
		}
		if ((rc = insert(L, q->obj, first, q)))
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

/* ---- the overlap timeline ------------------------------------------------------------------------ */

/* The operation at whose start operation i's transfer is issued: the earliest k in i-w .. i-1 where
 * what k holds and the data of k+1 .. i fit in HBM (the store tries at each tier_store_at_op of the
 * window and a declined prefetch is tried again at the next); i itself (a demand fetch) if none. */
static size_t issue_op(const sim_op *op, size_t i, unsigned w, uint64_t cap)
{
	size_t at = i, lo = i > w ? i - w : 0;
	uint64_t need = op[i].in;
	for (size_t k = i; k-- > lo && need <= cap;) { /* need only grows as k goes back */
		if (op[k].ws <= cap - need)
			at = k;
		need += op[k].in;
	}
	return at;
}

double sim_overlap(sim_op *op, size_t n, double op_s, unsigned window, uint64_t hbm_cap)
{
	double now = 0, link = 0, total = 0; /* now: the start of operation i; link: free from then on */
	for (size_t i = 0; i < n; i++) {
		sim_op *o = &op[i];
		o->start_s = o->ready_s = now, o->stall_s = 0, o->demand = 0;
		if (o->xfer_s > 0) { /* transfers take the link one at a time, in operation order */
			size_t k = issue_op(op, i, window, hbm_cap);
			o->demand = k == i;
			o->ready_s = fmax(op[k].start_s, link) + o->xfer_s;
			link = o->ready_s;
			o->stall_s = fmax(0, o->ready_s - now);
		}
		total += o->stall_s;
		now += o->stall_s + op_s;
	}
	return total;
}

/* Operations in the trace: nops, or more if a caller set request ops by hand. */
static size_t trace_ops(const sim_trace *t)
{
	size_t n = t->nops;
	for (size_t i = 0; i < t->n; i++)
		n = t->req[i].op >= n ? (size_t)t->req[i].op + 1 : n;
	return n;
}

/* Fill the operations from the per-op bytes of the replay (ob: pcie, nvme, in) and run the timeline. */
static int timeline(const sim_trace *t, const sim_config *c, sim_op *ops, const uint64_t *ob, size_t nops,
		    sim_result *r)
{
	uint32_t *last = calloc(t->nobj ? t->nobj : 1, sizeof *last); /* last op + 1 that held the object */
	if (!last)
		return tier_fail(-ENOMEM, "out of memory for the overlap timeline");
	for (size_t i = 0; i < nops; i++)
		ops[i] = (sim_op){ .xfer_s = (double)ob[i] / (c->gbps[0] * 1e9) + (double)ob[nops + i] / (c->gbps[1] * 1e9),
				   .in = ob[2 * nops + i] };
	for (size_t n = 0; n < t->n; n++) {
		const sim_req *q = &t->req[n];
		if (q->tier == 0 && q->kind == SIM_ACCESS && last[q->obj] != q->op + 1u) {
			ops[q->op].ws += t->size[q->obj];
			last[q->obj] = q->op + 1u;
		}
	}
	free(last);
	r->overlap_s = sim_overlap(ops, nops, c->op_s, c->window, c->cap[0]);
	r->compute_s = (double)nops * c->op_s;
	for (size_t i = 0; i < nops; i++) {
		r->xfer_ops += ops[i].xfer_s > 0;
		r->demand_ops += ops[i].xfer_s > 0 && ops[i].demand;
		r->stalled_ops += ops[i].stall_s > 0;
	}
	return 0;
}

int sim_run(const sim_trace *t, sim_policy p, const sim_config *c, sim_result *r)
{
	memset(r, 0, sizeof *r);
	r->overlap_s = NAN;
	if ((unsigned)p >= SIM_NPOL || !c->cap[0] || !c->cap[1] || !(c->gbps[0] > 0) || !(c->gbps[1] > 0) ||
	    !(c->half_life > 0) || !(c->op_s < INFINITY))
		return tier_fail(-EINVAL, "simulator: policy, capacities, link rates and half-life must be positive, "
					  "the compute per operation finite");
	int tl = c->op_s >= 0;
	size_t nops = tl ? trace_ops(t) : 0, m = nops ? nops : 1;
	uint64_t *ob = tl ? calloc(3 * m, sizeof *ob) : NULL; /* per op: pcie bytes, nvme bytes, bytes into HBM */
	sim_op *ops = tl ? malloc(m * sizeof *ops) : NULL;
	if (tl && (!ob || !ops)) {
		free(ob);
		free(ops);
		return tier_fail(-ENOMEM, "out of memory for %zu operations", nops);
	}
	sim_trace down = { .size = t->size, .id = t->id, .nobj = t->nobj };
	level h = { .t = t, .p = p, .tier = 0, .hl = c->half_life, .cap = c->cap[0], .down = &down,
		    .rd = &r->bytes[0][0], .wr = &r->bytes[0][1], .op_bytes = ob, .op_in = ob ? ob + 2 * m : NULL };
	level d = { .t = t, .p = p, .tier = 1, .hl = c->half_life, .cap = c->cap[1], .rd = &r->bytes[1][0],
		    .wr = &r->bytes[1][1], .op_bytes = ob ? ob + m : NULL };
	int rc = run_level(&h, t);
	if (!rc)
		rc = run_level(&d, &down);
	r->hits[0] = h.hits, r->misses[0] = h.misses, r->cold[0] = h.cold;
	r->hits[1] = d.hits, r->misses[1] = d.misses, r->cold[1] = d.cold;
	free(down.req);
	for (int l = 0; l < 2; l++)
		r->stall_s += (double)(r->bytes[l][0] + r->bytes[l][1]) / (c->gbps[l] * 1e9);
	if (!rc && tl && nops)
		rc = timeline(t, c, ops, ob, nops, r);
	else if (!rc && tl)
		r->overlap_s = 0; /* no operation, nothing to wait for */
	free(ob);
	free(ops);
	return rc;
}
