/* train_optim.c - the learning-rate schedule, the global gradient norm (summed as the backward
 * finishes each layer) and AdamW over the LoRA groups, in batches of pinned groups: at the step's
 * end, or each layer's just before its next forward (tier_train_cfg.optim_in_forward). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/trainer.h"
#include "core/ops_cuda.h"

float trainer_lr_at(const tier_train_cfg *c, int64_t s)
{
	if (s < c->warmup)
		return c->lr * (float)(s + 1) / (float)c->warmup;
	double span = c->steps - c->warmup, prog = span > 0 ? (double)(s - c->warmup) / span : 1.0;
	prog = prog > 1 ? 1 : prog;
	double cosv = 0.5 * (1.0 + cos(M_PI * prog));
	return (float)(c->lr * (c->min_lr_ratio + (1.0 - c->min_lr_ratio) * cosv));
}

/* The optimizer pins a layer's groups in batches (one wait on the device per batch, not per
 * group): up to OPT_BATCH groups and an eighth of the HBM budget. */
#define OPT_BATCH 256

static int batch_full(tier_trainer *t, int *n, uint64_t *bytes, uint64_t add)
{
	*bytes += add;
	if (++*n < OPT_BATCH && *bytes < t->hbm_cap / 8)
		return 0;
	*n = 0, *bytes = 0;
	return 1;
}

int trainer_grad_norm_reset(tier_trainer *t)
{
	t->gss = 0.0;
	return t->m->cuda ? tier_dev_memset(t->m->dev, t->acc_d, 0, sizeof(double)) : 0;
}

/* Layer l's gradients are final (its last micro-batch's backward, still pinned): add their squares
 * to the step's sum (whole gradient objects: the parts of experts that got no tokens were zeroed
 * with the rest). */
int trainer_grads_done(tier_trainer *t, int l)
{
	tier_model *m = t->m;
	int rc = 0;
	for (size_t i = 0; i < m->n_groups && !rc; i += m->groups[i].n_members) {
		lora_group *g = &m->groups[i];
		if (g->layer != l || !g->zeroed)
			continue;
		float *p = g->pin_seq == t->op_seq ? g->pin_grad : NULL;
		if (!p && (rc = trainer_pin(t, g->grad, 0, 0, &p))) /* written by an earlier micro-batch only */
			break;
		if (m->cuda)
			rc = opsc_sumsq(m->dev, g->n_total, p, t->acc_d);
		else
			for (size_t j = 0; j < g->n_total; j++)
				t->gss += (double)p[j] * p[j];
	}
	return rc;
}

int trainer_grad_norm(tier_trainer *t, double *out)
{
	double ss = t->gss;
	int rc = t->m->cuda ? core_get(t->m, &ss, t->acc_d, sizeof ss) : 0;
	*out = sqrt(ss);
	return rc;
}

/* PyTorch's AdamW: p *= 1 - lr wd; m, v moments; p -= lr mhat / (sqrt(vhat) + eps). Groups whose
 * gradients were never written in the step (experts that got no tokens) are skipped, as PyTorch
 * skips parameters whose grad is None. */
static void adamw_cpu(const tier_train_cfg *c, size_t n, float *p, const float *gr, float *mm, float *vv, float lr,
		      float bc1, float bc2, float gscale)
{
	float decay = 1.0f - lr * c->weight_decay;
	for (size_t j = 0; j < n; j++) {
		float gj = gr[j] * gscale;
		mm[j] = c->beta1 * mm[j] + (1.0f - c->beta1) * gj;
		vv[j] = c->beta2 * vv[j] + (1.0f - c->beta2) * gj * gj;
		p[j] = p[j] * decay - lr * (mm[j] / bc1) / (sqrtf(vv[j] / bc2) + c->eps);
	}
}

/* AdamW on one group's part of its set's objects (p, gr, mv: the set's addresses). */
static int adamw_group(tier_trainer *t, lora_group *g, float *p, float *gr, float *mv, float lr, float gscale)
{
	const tier_train_cfg *c = &t->c;
	g->t++;
	float bc1 = 1.0f - powf(c->beta1, (float)g->t), bc2 = 1.0f - powf(c->beta2, (float)g->t);
	p += g->off, gr += g->off, mv += 2 * g->off;
	if (t->m->cuda) { /* queued for the batch's one launch (adamw_flush) */
		if (t->aw_n == t->aw_cap) {
			int cap = t->aw_cap ? 2 * t->aw_cap : 1024;
			opsc_adamw_t *a = realloc(t->aw, sizeof *a * (size_t)cap);
			if (a)
				t->aw = a;
			lora_group **gg = a ? realloc(t->aw_grp, sizeof *gg * (size_t)cap) : NULL;
			if (!gg) {
				g->t--;
				return tier_fail(-ENOMEM, "out of host memory for the optimizer's table");
			}
			t->aw_grp = gg, t->aw_cap = cap;
		}
		t->aw_grp[t->aw_n] = g;
		t->aw[t->aw_n++] = (opsc_adamw_t){ .p = p, .g = gr, .m = mv, .v = mv + g->n, .n = g->n, .bc1 = bc1,
						   .bc2 = bc2 };
		return 0;
	}
	adamw_cpu(c, g->n, p, gr, mv, mv + g->n, lr, bc1, bc2, gscale);
	return 0;
}

/* CUDA: the batch's queued updates in one launch (per OPSC_ADAMW_MANY groups): 1,451 launches of
 * a few microseconds each, with a gap after each, in a step of the H200 (a) job before. */
static int adamw_flush(tier_trainer *t, float lr, float gscale, int rc)
{
	const tier_train_cfg *c = &t->c;
	if (!rc && t->aw_n)
		rc = opsc_adamw_many(t->m->dev, t->aw_n, t->aw, lr, c->beta1, c->beta2, c->eps,
				     1.0f - lr * c->weight_decay, gscale);
	for (int i = 0; rc && i < t->aw_n; i++) /* not applied: their step counts go back */
		t->aw_grp[i]->t--;
	t->aw_n = 0;
	return rc;
}

/* After a batch of updates (groups [from, to)), once its kernels are done: the gradients are
 * spent, dropped without a writeback (and never prefetched again: the next step refills them); in
 * a spilling step the new parameters and moments start their way down ahead of their eviction. */
int trainer_optim_post(tier_trainer *t, size_t from, size_t to)
{
	tier_model *m = t->m;
	int rc = 0;
	for (size_t i = from; i < to && !rc; i += m->groups[i].n_members) {
		lora_group *own = &m->groups[i];
		if (!own->set_due)
			continue;
		own->set_due = 0;
		rc = tier_obj_discard(m->s, own->grad);
		if (t->spill)
			tier_writeback(m->s, own->param), tier_writeback(m->s, own->optim);
	}
	m->grads_spent = 1;
	return rc;
}

/* A batch ends as the layer operations do (train_pending.c): pipelined, the next batch is queued
 * before this one's pins go back. */
static int adamw_batch_end(tier_trainer *t, size_t from, size_t to, float lr, float gscale, int rc)
{
	return trainer_op_close(t, adamw_flush(t, lr, gscale, rc), POST_OPTIM, -1, (int)from, (int)to, -1);
}

/* Pin a set's moments, parameters and gradients and update its members. The moments, twice the
 * others' size, are pinned first: placed last, they found the free space split by the other two
 * (pinned, so not moved) under budgets that held all three: test_train failed about one run in
 * 25 under its smallest budgets. Placed first, the moments take the longest run; the halves left
 * beside them are longer than when two pieces split the space. */
static int adamw_set(tier_trainer *t, lora_group *own, float lr, float gscale)
{
	float *p, *gr, *mv;
	int rc;
	if ((rc = trainer_pin(t, own->optim, 0, 1, &mv)) || (rc = trainer_pin(t, own->param, 0, 1, &p)) ||
	    (rc = trainer_pin(t, own->grad, 0, 0, &gr)))
		return rc;
	for (int j = 0; j < own->n_members && !rc; j++)
		if (own[j].due)
			rc = adamw_group(t, own + j, p, gr, mv, lr, gscale);
	return rc;
}

/* One layer's sets, groups [lo, hi): pinned together in batches, updated, released. */
static int adamw_layer(tier_trainer *t, size_t lo, size_t hi, float lr, float gscale)
{
	int rc = 0, in_batch = 0;
	uint64_t bytes = 0;
	size_t from = lo, i;
	for (i = lo; i < hi && !rc; i += t->m->groups[i].n_members) {
		lora_group *own = &t->m->groups[i];
		if (!own->set_due)
			continue;
		rc = adamw_set(t, own, lr, gscale);
		/* no room: end the batch (its pins split the budget) and try the set alone; alone, drop
		 * the scratch kept between steps and try once more (not inside a step: it is in use) */
		while (rc == -ENOSPC && (in_batch || (t->scratch_p && !t->in_fwd))) {
			if ((rc = adamw_batch_end(t, from, i, lr, gscale, 0)) || (!in_batch && (rc = trainer_scratch_drop(t))))
				return rc;
			from = i, in_batch = 0, bytes = 0;
			rc = adamw_set(t, own, lr, gscale);
		}
		if (!rc && batch_full(t, &in_batch, &bytes, 4 * tier_obj_size(own->grad))) {
			rc = adamw_batch_end(t, from, i + own->n_members, lr, gscale, 0);
			from = i + own->n_members;
		}
	}
	return adamw_batch_end(t, from, i, lr, gscale, rc);
}

/* Layer l's update when due: its groups' batches, each ended as an operation (pipelined). */
static int optim_layer(tier_trainer *t, int l)
{
	if (!t->opt_due[l])
		return 0;
	t->opt_due[l] = 0;
	int rc = adamw_layer(t, t->glo[l], t->glo[l + 1], t->opt_lr, t->opt_gs);
	if (rc == -ENOSPC && t->in_fwd)
		rc = tier_fail(rc, "%s; layer %d's optimizer state found no room in HBM beside the step's activations: "
			       "run with the optimizer at the step's end (tier-run --optimizer-at end)", tier_last_error(), l);
	if (rc && !t->m->settle_err) /* part of the update may be in: no export of such weights */
		t->m->settle_err = rc;
	return rc;
}

/* Mark what the step updates: the sets whose gradients were zeroed in it (they received some) and
 * the groups written since; the next step clears zeroed and touched, not these. */
static void optim_mark(tier_trainer *t, float lr, float gscale)
{
	tier_model *m = t->m;
	memset(t->opt_due, 0, (size_t)m->L);
	for (size_t i = 0; i < m->n_groups; i++) {
		lora_group *g = &m->groups[i];
		g->due = g->touched;
		g->set_due = g->own == g && g->zeroed;
		t->opt_due[g->layer] |= (uint8_t)g->set_due;
	}
	t->opt_lr = lr, t->opt_gs = gscale;
}

/* Layer by layer, last to first, each layer an operation of the schedule (train_sched.c). That
 * order ends on the state the next step's forward reads first, still in HBM, while the last
 * layers' state, updated first, has been written down by then and is evicted without a wait.
 * Deferred, each layer's update waits for its next use instead (trainer_optim_due): its state's
 * transfers then overlap the forward of the layer before, not a phase of their own. */
int trainer_optim_step(tier_trainer *t, float lr, float gscale)
{
	optim_mark(t, lr, gscale);
	/* deferred: the next step's schedule lists the updates; else they run now */
	return t->defer ? trainer_sched_due(t) : trainer_optim_settle(t);
}

int trainer_optim_due(tier_trainer *t, int l)
{
	if (!t->defer)
		return 0;
	trainer_at_op(t); /* the slot is in the schedule whether or not an update is due */
	if (!t->opt_due[l])
		return 0;
	t->in_fwd = 1;
	int rc = optim_layer(t, l);
	t->in_fwd = 0;
	t->n_deferred++;
	trainer_charge(t, TIER_PART_OPTIM);
	return rc;
}

/* Each layer's operation announced at its place in the schedule (at the step's end: where the
 * step's operations left off), its update run when due. */
int trainer_optim_settle(tier_trainer *t)
{
	if (!memchr(t->opt_due, 1, (size_t)t->m->L))
		return 0;
	int rc = 0;
	for (int l = t->m->L - 1; l >= 0 && !rc; l--) {
		tier_store_at_op(t->m->s, trainer_sched_optim_at(t, l));
		rc = optim_layer(t, l);
	}
	rc = trainer_op_end(t, rc); /* the last batch's gradients dropped before the next step */
	int r2 = trainer_sched_due(t); /* deferred: none due now */
	return rc ? rc : r2;
}

void trainer_optim_drop(tier_trainer *t)
{
	memset(t->opt_due, 0, (size_t)t->m->L);
	for (size_t i = 0; i < t->m->n_groups; i++)
		t->m->groups[i].due = t->m->groups[i].set_due = 0;
	(void)trainer_sched_due(t); /* a failure leaves the old schedule: hints only */
}
