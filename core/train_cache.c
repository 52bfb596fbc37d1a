/* train_cache.c - the operator cache under the training step: per layer and micro-batch the two
 * halves of dec_bufs.save and, when the attention half is not kept, the attention's output alone
 * (o and lse: a recompute then runs the projections but not the attention; docs/trainer.md). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/trainer.h"
#include "core/dec_ops.h"

int trainer_cache_open(tier_trainer *t)
{
	if (!t->c.opcache || !*t->c.opcache)
		return 0;
	tier_cache_config cc;
	int rc = tier_cache_config_parse(t->c.opcache, &cc);
	if (rc)
		return tier_fail(rc, "--op-cache: %s", tier_last_error());
	return tier_cache_create(&t->cache, t->m->s, t->m->dev, &cc, NULL);
}

/* The key of the attention's output (op 0 and 1 are the halves). */
#define OP_CORE 2

static tier_cache_key ckey(const tier_trainer *t, int l, int half)
{
	return (tier_cache_key){ .layer = (uint32_t)l, .op = (uint32_t)half, .microbatch = t->mb };
}

/* What recomputing a half costs (the cache weighs it against the bytes it would hold). */
static tier_op_cost half_cost(const tier_trainer *t, int l, int half)
{
	const tier_model *m = t->m;
	double T = t->sh.T, H = m->H, qd = (double)m->nh * m->hd, kvd = (double)m->nkv * m->hd;
	tier_op_cost c = { .kind = TIER_OP_MATMUL, .bytes = (double)t->b.save_bytes[half] };
	if (half == 0) /* q, k, v, o projections and causal attention (half of the seq x seq scores) */
		c.kind = TIER_OP_ATTENTION, c.flops = 2 * T * H * (qd + 2 * kvd) + 2 * T * qd * H + 2 * T * t->sh.seq * qd;
	/* the MLP half's recompute makes the state alone: gate and up, not down (nor the combine) */
	else if (m->layers[l].moe)
		c.kind = TIER_OP_GROUPED_GEMM, c.flops = 2 * T * m->k * 2 * H * m->Ie + 2 * T * H * m->E;
	else
		c.flops = 2 * T * 2 * H * m->I;
	return c;
}

/* The attention's output: its recompute is the attention alone (the causal half of QK^T and PV).
 * Its copies overlap the step: out on the copy stream, back a layer ahead (bwd_body). */
static tier_op_cost core_cost(const tier_trainer *t, size_t bytes)
{
	double T = t->sh.T, qd = (double)t->m->nh * t->m->hd;
	return (tier_op_cost){ .kind = TIER_OP_ATTENTION, .flops = 2 * T * t->sh.seq * qd, .bytes = (double)bytes,
			       .overlapped = 1 };
}

/* Whether half h of layer l goes to the cache: not MoE's in chunks (its backward runs each
 * chunk's forward again), not an empty one. */
static int half_cached(const tier_trainer *t, int l, int h)
{
	return t->b.save_bytes[h] && (h == 0 || dec_mlp_recompute(&t->sh, t->m->layers[l].moe));
}

/* Pipelined, the halves go to the cache without a copy: reserved before the forward and written
 * there in place when the entry is in HBM (dec_bufs_place), copied on the stream when in DDR
 * (tier_cache_offer_fill), finished at the operation's end (train_pending.c). */
int trainer_cache_reserve(tier_trainer *t, int l)
{
	t->reserved[0] = t->reserved[1] = t->kept[0] = t->kept[1] = 0;
	for (int h = 0; h < 2 && t->cache && t->pipeline; h++) {
		if (!half_cached(t, l, h) || t->opc.nkeys == OP_KEYS)
			continue;
		tier_op_cost c = half_cost(t, l, h);
		void *at;
		tier_id where;
		int rc = tier_cache_reserve(t->cache, ckey(t, l, h), t->b.save_bytes[h], &c, &at, &where);
		if (rc)
			return rc;
		(void)trainer_op_key(t, ckey(t, l, h), 0); /* room checked above */
		t->reserved[h] = 1, t->kept[h] = where != TIER_NTIERS;
		if (at)
			trainer_cache_place(t, h, at);
	}
	return 0;
}

void trainer_cache_place(tier_trainer *t, int h, void *at)
{
	dec_bufs_place(t->m, &t->sh, &t->b, h, at);
	t->placed[h] = at != NULL;
}

void trainer_cache_unplace(tier_trainer *t)
{
	for (int h = 0; h < 2; h++)
		if (t->placed[h])
			trainer_cache_place(t, h, NULL);
	if (t->core_placed) /* o and lse back home with the rest of the attention half */
		dec_bufs_place(t->m, &t->sh, &t->b, 0, NULL), t->core_placed = 0;
}

/* Whether this pass's forward had the cache keep (l, mb)'s attention output. */
static uint8_t *kept_at(const tier_trainer *t, int l, int mb)
{
	return &t->core_kept[(size_t)mb * t->m->L + (size_t)l];
}

int trainer_cache_offer_core(tier_trainer *t, int l)
{
	if (!t->cache || !t->offer || !t->pipeline || t->kept[0] || t->opc.nkeys == OP_KEYS)
		return 0;
	size_t lse_at, n = dec_attn_core_bytes(t->m, &t->sh, &lse_at);
	tier_op_cost c = core_cost(t, n);
	tier_cache_key k = ckey(t, l, OP_CORE);
	void *at, *dst;
	tier_id where;
	int rc = tier_cache_reserve(t->cache, k, n, &c, &at, &where);
	if (rc || where == TIER_NTIERS)
		return rc;
	(void)trainer_op_key(t, k, 0); /* offer_done at the operation's end: the copy is joined by then */
	*kept_at(t, l, (int)t->mb) = 1;
	if ((rc = tier_cache_offer_target(t->cache, k, &dst)) || !dst)
		return rc;
	rc = tier_dev_copy_async(t->m->dev, dst, t->b.o, n, 0);
	t->core_copy = !rc;
	return rc;
}

int trainer_cache_offer(tier_trainer *t, int l)
{
	for (int h = 0; h < 2 && t->cache; h++) {
		if (!half_cached(t, l, h))
			continue;
		int rc = 0;
		if (t->reserved[h]) /* written in place, else its copy queued (nothing when not admitted) */
			rc = t->placed[h] ? 0
					  : tier_cache_offer_fill(t->cache, ckey(t, l, h), t->b.save[h],
								  tier_dev_stream(t->m->dev));
		else {
			tier_op_cost c = half_cost(t, l, h);
			rc = tier_cache_offer(t->cache, ckey(t, l, h), t->b.save[h], t->b.save_bytes[h], &c,
					      tier_dev_stream(t->m->dev), NULL);
		}
		if (rc)
			return rc;
	}
	t->reserved[0] = t->reserved[1] = 0;
	if (t->core_copy) { /* before the next micro-batch's attention writes o, and before the
			     * operation's waypoint (its end releases the entry) */
		t->core_copy = 0;
		return tier_dev_copy_join(t->m->dev, 0);
	}
	return 0;
}

/* Backward: bring half h of layer l's forward back from the cache. 1 when restored, 0 when it
 * must be recomputed (a miss) or on an error (*rc set). */
int trainer_cache_restore(tier_trainer *t, int l, int h, int *rc)
{
	void *p;
	if (!t->cache || *rc)
		return 0;
	int r = tier_cache_get(t->cache, ckey(t, l, h), &p);
	if (r)
		return *rc = r < 0 ? r : 0, 0;
	/* pipelined: the backward reads the entry where it is, pinned until the operation's end */
	if (t->pipeline && !trainer_op_key(t, ckey(t, l, h), 1)) {
		trainer_cache_place(t, h, p);
		return 1;
	}
	/* else copied: the entry is freed on release, so the copy must be done by then */
	*rc = dop_copy(t->m, t->b.save[h], p, t->b.save_bytes[h]);
	if (!*rc)
		*rc = tier_dev_sync(t->m->dev);
	int r2 = tier_cache_release(t->cache, ckey(t, l, h), 1);
	*rc = *rc ? *rc : r2;
	return !*rc;
}

/* The attention's output in the backward. Its entries live in DDR and go straight into one of
 * two blocks of the scratch (dec_shape.core2) on copy lane p = the backward slot's parity: the
 * copy for slot s + 2 is queued once slot s's kernels are, into slot s's block, and runs while
 * slot s + 1 computes; no HBM copy of the entry is made (under --hbm 24G every GiB the cache
 * takes in HBM the experts' prefetches miss). The entry stays pinned in DDR until the operation
 * that reads it ends. */

/* The backward slot k after the current one: a layer-major step runs every micro-batch of a
 * layer, in order, before the layer below; otherwise the micro-batch's layers. 0 when none. */
static int slot_ahead(const tier_trainer *t, int l, int k, int *l2, int *mb2)
{
	int lm = t->nck > 1, nm = lm ? t->c.micro_batches : 1;
	int idx = (t->m->L - 1 - l) * nm + (lm ? (int)t->mb : 0) + k;
	*l2 = t->m->L - 1 - idx / nm;
	*mb2 = lm ? idx % nm : (int)t->mb;
	return *l2 >= 0;
}

/* Let an entry on its way go: its copy done first (nothing may still read it). */
static int pend_drop(tier_trainer *t, trainer_core_pend *c)
{
	if (!c->on)
		return 0;
	c->on = 0;
	int r1 = tier_dev_sync(t->m->dev), r2 = tier_cache_release(t->cache, c->key, 1);
	return r1 ? r1 : r2;
}

/* Start the copy of (l, mb)'s entry into block p (nothing when it was not kept, or is gone). */
static int core_fetch(tier_trainer *t, int l, int mb, int p)
{
	trainer_core_pend *c = &t->core_pend[p];
	int rc = pend_drop(t, c); /* one that came for a slot that did not read it (its half restored) */
	c->key = (tier_cache_key){ .layer = (uint32_t)l, .op = OP_CORE, .microbatch = (uint32_t)mb };
	uint8_t *kept = kept_at(t, l, mb);
	if (rc || !*kept) /* never kept (the attention half was, or no room): not a miss to count */
		return rc;
	*kept = 0;
	void *src;
	tier_id where;
	int r = tier_cache_get_home(t->cache, c->key, &src, &where);
	if (r)
		return r < 0 ? r : 0;
	size_t lse_at, n = dec_attn_core_bytes(t->m, &t->sh, &lse_at);
	c->on = 1;
	if ((rc = tier_dev_copy_async(t->m->dev, dec_attn_core_home(&t->b, p), src, n, p)))
		(void)pend_drop(t, c);
	return rc;
}

static int core_on(const tier_trainer *t)
{
	return t->cache && t->pipeline;
}

static int pend_for(const trainer_core_pend *c, int l, uint32_t mb)
{
	return c->on && c->key.layer == (uint32_t)l && c->key.microbatch == mb;
}

int trainer_cache_bwd_begin(tier_trainer *t, int l)
{
	if (!core_on(t))
		return 0;
	int p = t->bslot & 1;
	if (p) /* block 0 is the attention half's own o, lse */
		dec_attn_core_place(t->m, &t->sh, &t->b, dec_attn_core_home(&t->b, 1)), t->core_placed = 1;
	/* the first two slots: nothing came ahead */
	return pend_for(&t->core_pend[p], l, t->mb) ? 0 : core_fetch(t, l, (int)t->mb, p);
}

int trainer_cache_bwd_end(tier_trainer *t, int l)
{
	if (!core_on(t))
		return 0;
	int p = t->bslot++ & 1, l2, mb2;
	return slot_ahead(t, l, 2, &l2, &mb2) ? core_fetch(t, l2, mb2, p) : 0;
}

int trainer_cache_restore_core(tier_trainer *t, int l, int *rc)
{
	int p = t->bslot & 1;
	trainer_core_pend *c = &t->core_pend[p];
	if (*rc || !core_on(t) || !pend_for(c, l, t->mb))
		return 0;
	if ((*rc = tier_dev_copy_join(t->m->dev, p)))
		return 0;
	if (!trainer_op_key(t, c->key, 1)) /* released at the operation's end */
		return c->on = 0, 1;
	*rc = pend_drop(t, c); /* the list is full: done with the entry's bytes here */
	return !*rc;
}

int trainer_cache_core_drop(tier_trainer *t)
{
	int rc = 0;
	for (int p = 0; p < 2; p++) {
		int r = pend_drop(t, &t->core_pend[p]);
		rc = rc ? rc : r;
	}
	t->bslot = 0;
	return rc;
}
