/* train_optim.c - the learning-rate schedule, the global gradient norm and AdamW over the LoRA
 * groups, in batches of pinned groups. */
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

/* The optimizer's walks over the groups pin a batch of groups per operation (one wait on the
 * device per batch, not per group): up to OPT_BATCH groups and an eighth of the HBM budget. */
#define OPT_BATCH 256

static int batch_full(tier_trainer *t, int *n, uint64_t *bytes, uint64_t add)
{
	*bytes += add;
	if (++*n < OPT_BATCH && *bytes < t->hbm_cap / 8)
		return 0;
	*n = 0, *bytes = 0;
	return 1;
}

int trainer_grad_norm(tier_trainer *t, double *out)
{
	tier_model *m = t->m;
	double ss = 0.0;
	int rc = m->cuda ? tier_dev_memset(m->dev, t->acc_d, 0, sizeof(double)) : 0, in_batch = 0;
	uint64_t bytes = 0;
	/* whole gradient objects: the parts of experts that got no tokens were zeroed with the rest */
	for (size_t i = 0; i < m->n_groups && !rc; i += m->groups[i].n_members) {
		lora_group *g = &m->groups[i];
		float *p;
		if (!g->zeroed)
			continue;
		if ((rc = trainer_pin(t, g->grad, 0, 0, &p)))
			break;
		if (m->cuda)
			rc = opsc_sumsq(m->dev, g->n_total, p, t->acc_d);
		else
			for (size_t j = 0; j < g->n_total; j++)
				ss += (double)p[j] * p[j];
		if (!rc && batch_full(t, &in_batch, &bytes, tier_obj_size(g->grad)))
			rc = trainer_op_end(t, 0);
	}
	if (!rc && m->cuda)
		rc = core_get(m, &ss, t->acc_d, sizeof ss);
	rc = trainer_op_end(t, rc);
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
	if (t->m->cuda)
		return opsc_adamw(t->m->dev, g->n, p, gr, mv, mv + g->n, lr, c->beta1, c->beta2, c->eps,
				  1.0f - lr * c->weight_decay, bc1, bc2, gscale);
	adamw_cpu(c, g->n, p, gr, mv, mv + g->n, lr, bc1, bc2, gscale);
	return 0;
}

int trainer_adamw(tier_trainer *t, float lr, float gscale)
{
	int rc = 0, in_batch = 0;
	uint64_t bytes = 0;
	for (size_t i = 0; i < t->m->n_groups && !rc; i += t->m->groups[i].n_members) {
		lora_group *own = &t->m->groups[i];
		float *p, *gr, *mv;
		if (!own->zeroed)
			continue;
		if ((rc = trainer_pin(t, own->param, 0, 1, &p)) || (rc = trainer_pin(t, own->grad, 0, 0, &gr)) ||
		    (rc = trainer_pin(t, own->optim, 0, 1, &mv)))
			break;
		for (int j = 0; j < own->n_members && !rc; j++)
			if (own[j].touched)
				rc = adamw_group(t, own + j, p, gr, mv, lr, gscale);
		if (!rc && batch_full(t, &in_batch, &bytes, 4 * tier_obj_size(own->grad)))
			rc = trainer_op_end(t, 0);
	}
	return trainer_op_end(t, rc);
}
