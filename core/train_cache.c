/* train_cache.c - the operator cache under the training step: two entries per layer and
 * micro-batch, the halves of dec_bufs.save (docs/trainer.md). */
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
	t->reserved[0] = t->reserved[1] = 0;
	for (int h = 0; h < 2 && t->cache && t->pipeline; h++) {
		if (!half_cached(t, l, h) || t->opc.nkeys == OP_KEYS)
			continue;
		tier_op_cost c = half_cost(t, l, h);
		void *at;
		int rc = tier_cache_reserve(t->cache, ckey(t, l, h), t->b.save_bytes[h], &c, &at, NULL);
		if (rc)
			return rc;
		(void)trainer_op_key(t, ckey(t, l, h), 0); /* room checked above */
		t->reserved[h] = 1;
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
