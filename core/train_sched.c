/* train_sched.c - the training step's schedule for the store: the objects of every operation. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/trainer.h"

static size_t add_ids(uint64_t *ids, size_t n, tier_object *o)
{
	if (o)
		ids[n++] = tier_obj_id(o);
	return n;
}

static size_t group_ids(uint64_t *ids, size_t n, const lora_group *g, int grads)
{
	if (!g || g->own != g) /* a member of a layer's expert set: its owner lists the objects */
		return n;
	n = add_ids(ids, n, g->param);
	return grads ? add_ids(ids, n, g->grad) : n;
}

/* Layer inputs a and b (of each micro-batch in a layer-major step). */
static size_t ckpt_ids(const tier_trainer *t, int a, int b, uint64_t *ids, size_t n)
{
	for (int r = 0; r < t->nck; r++) {
		tier_object *const *row = t->ckpt + (size_t)r * (t->m->L + 1);
		n = add_ids(ids, n, row[a]);
		if (b != a)
			n = add_ids(ids, n, row[b]);
	}
	return n;
}

/* Whether expert i (of layer i / E) is left out of a forward (bwd 0) or backward operation: no token
 * of the latest forward (nor, for a forward, the one before) went to it. */
static int skipped(const tier_trainer *t, size_t i, int bwd)
{
	return t->have_mbcounts && (bwd || t->sched_routed == 2) && !t->mbcounts[i] && (bwd || !t->prevcounts[i]);
}

/* The objects of layer l's forward (bwd = 1: backward) operation. */
static size_t layer_ids(const tier_trainer *t, int l, int bwd, uint64_t *ids)
{
	const tier_model *m = t->m;
	const model_layer *ly = &m->layers[l];
	size_t n = 0;
	for (int s = 0; s < W_NSLOTS; s++)
		n = add_ids(ids, n, ly->w[s]);
	n = group_ids(ids, n, ly->attn, bwd);
	n = group_ids(ids, n, ly->mlp, bwd);
	for (int e = 0; ly->moe && e < m->E; e++) {
		if (skipped(t, (size_t)l * m->E + e, bwd))
			continue;
		n = add_ids(ids, n, ly->experts[e]);
		n = group_ids(ids, n, ly->exp ? ly->exp[e] : NULL, bwd);
	}
	return ckpt_ids(t, l, bwd ? l : l + 1, ids, n);
}

/* Record which experts this schedule leaves out (bit 0: of the forwards, bit 1: of the backwards);
 * 1 when that is what the schedule last built left out (the same schedule: nothing to build). */
static int skips_unchanged(tier_trainer *t)
{
	const tier_model *m = t->m;
	size_t n = m->E > 0 ? (size_t)m->L * m->E : 0;
	int same = t->sched_built;
	for (size_t i = 0; i < n; i++) {
		uint8_t v = (uint8_t)(skipped(t, i, 0) | skipped(t, i, 1) << 1);
		same &= v == t->sched_skip[i];
		t->sched_skip[i] = v;
	}
	return same;
}

/* Deferred updates: the layers due as the step's end (or a settle) left them, listed from now on
 * (rebuilt only when that changes: the first step, the one after a settle). */
int trainer_sched_due(tier_trainer *t)
{
	if (!t->defer || !memcmp(t->sched_due, t->opt_due, (size_t)t->m->L))
		return 0;
	memcpy(t->sched_due, t->opt_due, (size_t)t->m->L);
	t->sched_built = 0; /* built again even where the experts it leaves out are the same */
	return trainer_set_schedule(t);
}

/* The optimizer is one operation per layer, last layer first (its sets' parameters, gradients and
 * moments; trainer_optim_step), so that the prefetcher brings layer l - 1's state while layer l is
 * updated, and the first layers' updates bring the next step's embedding and first layer. As one
 * operation it left no room to prefetch: its 13 GiB of state, not yet in HBM, was all "needed
 * now". Deferred (t->defer), layer l's update is the operation before its forward in the step's
 * first pass: its state comes while the layer before runs. */
size_t trainer_sched_optim_at(const tier_trainer *t, int l)
{
	int L = t->m->L, reps = t->nck > 1 ? 1 : t->c.micro_batches;
	return t->defer ? 1 + 2 * (size_t)l : (size_t)(2 * L + 2) * reps + (size_t)(L - 1 - l);
}

/* The objects of the step's operations of each kind into pool p: the embedding's, each layer's
 * forward and backward, the loss's and each layer's optimizer's (op[0], fwd[L], bwd[L], op[1],
 * opt[L]). */
static void sched_kinds(tier_trainer *t, uint64_t *p, tier_sched_op *op, tier_sched_op *fwd,
			     tier_sched_op *bwd, tier_sched_op *opt)
{
	tier_model *m = t->m;
	int L = m->L;
	size_t n = ckpt_ids(t, 0, 0, p, add_ids(p, 0, m->embed));
	op[0] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
	p += n;
	for (int l = 0; l < L; l++) {
		n = layer_ids(t, l, 0, p);
		fwd[l] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
		p += n;
		n = layer_ids(t, l, 1, p);
		bwd[l] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
		p += n;
	}
	n = ckpt_ids(t, L, L, p, add_ids(p, add_ids(p, 0, m->norm), m->lm_head));
	op[1] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
	p += n;
	size_t g = 0;
	for (int l = 0; l < L; l++) {
		n = 0;
		for (; g < m->n_groups && m->groups[g].layer == l; g += m->groups[g].n_members) {
			if (t->defer && !t->sched_due[l])
				continue;
			n = add_ids(p, n, m->groups[g].optim); /* in adamw_set's pin order */
			n = group_ids(p, n, &m->groups[g], 1);
		}
		opt[l] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
		p += n;
	}
}

int trainer_set_schedule(tier_trainer *t)
{
	tier_model *m = t->m;
	/* after each step's forward with routing (sched_routed) this ran again: 0.6-0.9 ms of the host's
	 * time a step with the (a) job, between the forward and the loss, where every expert gets
	 * tokens every step and the schedule came out the same */
	if (skips_unchanged(t))
		return 0;
	/* micro-batch-major: the operations repeat for each micro-batch; layer-major: once */
	int L = m->L, per = L * 2 + 2, reps = t->nck > 1 ? 1 : t->c.micro_batches, nops = per * reps + L;
	size_t cap = (size_t)W_NSLOTS + 4 + 4 * (size_t)m->E + 3 * m->n_groups + 8 + 2 * (size_t)t->nck;
	tier_sched_op *ops = calloc((size_t)nops + 3 * (size_t)L + 2, sizeof *ops);
	uint64_t *pool = calloc((size_t)per * cap + 3 * m->n_groups + 8, sizeof *pool);
	if (!ops || !pool) {
		free(ops);
		free(pool);
		return tier_fail(-ENOMEM, "out of memory for the step schedule");
	}
	tier_sched_op *kind = ops + nops, *fwd = kind + 2, *bwd = fwd + L, *opt = bwd + L;
	sched_kinds(t, pool, kind, fwd, bwd, opt);
	size_t k = 0;
	for (int r = 0; r < reps; r++) {
		ops[k++] = kind[0];
		for (int l = 0; l < L; l++) {
			if (t->defer && r == 0)
				ops[k++] = opt[l];
			ops[k++] = fwd[l];
		}
		ops[k++] = kind[1];
		for (int l = L - 1; l >= 0; l--)
			ops[k++] = bwd[l];
	}
	for (int l = L - 1; l >= 0 && !t->defer; l--)
		ops[k++] = opt[l];
	int rc = tier_store_set_schedule(m->s, ops, (size_t)nops, 1);
	t->sched_built = rc == 0;
	free(ops);
	free(pool);
	return rc;
}
