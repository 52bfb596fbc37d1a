/* train.c - the training step: per micro-batch the embedding, layers 0..L-1 forward keeping only
 * each layer's input (a store object), the loss, then layers L-1..0 recomputed and run backward;
 * LoRA gradients accumulated over micro-batches, global-norm clipping, AdamW. Every weight is
 * acquired from the store for the operation that uses it and released after; the step's
 * schedule is handed to the store up front and each operation announced (tier_store_at_op). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/decoder.h"
#include "tier/loss.h"

struct tier_trainer {
	tier_model *m;
	tier_train_cfg c;
	dec_shape sh;
	dec_bufs b;
	tier_object *scratch;  /* ACT, discardable: the buffers above, the loss's lse and workspace */
	tier_object **ckpt;    /* [L + 1] ACT: the input of each layer (ckpt[L]: the last output) */
	size_t dec_bytes, loss_ws;
	tier_loss_params lp;
	float *gcur, *gnext, *lse, *hn;  /* in scratch: gradient ping-pong [T, H], loss lse [T], final norm [T, H] */
	void *lws;
	pinset ps;             /* the current operation's pins */
	size_t op;             /* index into the schedule */
	int64_t step;
	int32_t *counts;       /* [E] */
	int64_t *lcounts;      /* [L E]: tokens routed to each expert by the last step's (or eval's) forwards */
	const float **ptr;     /* [15 E]: expert weight and LoRA pointer arrays */
	uint64_t min_hbm;
};

void tier_train_cfg_init(tier_train_cfg *c)
{
	memset(c, 0, sizeof *c);
	c->batch = 4, c->seq = 64, c->micro_batches = 1, c->steps = 100, c->warmup = 5;
	c->lr = 2e-3f, c->min_lr_ratio = 0.1f, c->beta1 = 0.9f, c->beta2 = 0.999f, c->eps = 1e-8f;
	c->clip = 1.0f;
}

static int check_cfg(const tier_train_cfg *c)
{
	if (c->batch < 1 || c->seq < 1 || c->micro_batches < 1 || c->steps < 1 || c->warmup < 0)
		return tier_fail(-EINVAL, "training: batch %d, seq %d, micro-batches %d, steps %d must be >= 1 and warmup "
				 ">= 0", c->batch, c->seq, c->micro_batches, c->steps);
	if (!(c->lr >= 0) || !isfinite(c->lr) || !(c->min_lr_ratio >= 0 && c->min_lr_ratio <= 1) ||
	    !(c->beta1 >= 0 && c->beta1 < 1) || !(c->beta2 >= 0 && c->beta2 < 1) || !(c->eps > 0) ||
	    !(c->weight_decay >= 0) || !(c->clip >= 0))
		return tier_fail(-EINVAL, "training: lr >= 0, min_lr_ratio in [0, 1], betas in [0, 1), eps > 0, weight "
				 "decay >= 0 and clip >= 0 are required");
	return 0;
}

/* ---- The schedule ---------------------------------------------------------------------------- */
enum { OP_EMBED, OP_FWD, OP_LOSS, OP_BWD, OP_OPTIM };

static size_t add_ids(uint64_t *ids, size_t n, tier_object *o)
{
	if (o)
		ids[n++] = tier_obj_id(o);
	return n;
}

static size_t group_ids(uint64_t *ids, size_t n, const lora_group *g, int grads)
{
	if (!g)
		return n;
	n = add_ids(ids, n, g->param);
	return grads ? add_ids(ids, n, g->grad) : n;
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
		n = add_ids(ids, n, ly->experts[e]);
		n = group_ids(ids, n, ly->exp ? ly->exp[e] : NULL, bwd);
	}
	n = add_ids(ids, n, t->ckpt[l]);
	return bwd ? n : add_ids(ids, n, t->ckpt[l + 1]);
}

static int set_schedule(tier_trainer *t)
{
	tier_model *m = t->m;
	int L = m->L, per = L * 2 + 2, nops = per * t->c.micro_batches + 1;
	size_t cap = (size_t)W_NSLOTS + 4 + 4 * (size_t)m->E + 3 * m->n_groups + 8;
	tier_sched_op *ops = calloc((size_t)nops, sizeof *ops);
	uint64_t *pool = calloc((size_t)per * cap + 3 * m->n_groups + 8, sizeof *pool), *p = pool;
	if (!ops || !pool) {
		free(ops);
		free(pool);
		return tier_fail(-ENOMEM, "out of memory for the step schedule");
	}
	for (int i = 0; i < per; i++) {
		size_t n = 0;
		if (i == 0) {
			n = add_ids(p, add_ids(p, 0, m->embed), t->ckpt[0]);
		} else if (i <= L) {
			n = layer_ids(t, i - 1, 0, p);
		} else if (i == L + 1) {
			n = add_ids(p, add_ids(p, add_ids(p, 0, m->norm), m->lm_head), t->ckpt[L]);
		} else {
			n = layer_ids(t, 2 * L + 1 - i, 1, p);
		}
		for (int mb = 0; mb < t->c.micro_batches; mb++)
			ops[mb * per + i] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
		p += n;
	}
	size_t n = 0;
	for (size_t g = 0; g < m->n_groups; g++) {
		n = group_ids(p, n, &m->groups[g], 1);
		n = add_ids(p, n, m->groups[g].optim);
	}
	ops[nops - 1] = (tier_sched_op){ .objects = p, .n_objects = (unsigned)n, .tier = TIER_HBM };
	int rc = tier_store_set_schedule(m->s, ops, (size_t)nops, 1);
	free(ops);
	free(pool);
	return rc;
}

/* ---- Creation ---------------------------------------------------------------------------------- */
/* Bytes an object takes in the emulated HBM tier: the store rounds extents to 4 KiB on the host
 * (256 bytes on a GPU, so this is conservative there). */
static uint64_t rsz(const tier_object *o) { return o ? tier_align_up(tier_obj_size(o), 4096) : 0; }

static uint64_t layer_bytes(const tier_model *m, int l)
{
	const model_layer *ly = &m->layers[l];
	uint64_t n = 0;
	for (int s = 0; s < W_NSLOTS; s++)
		n += rsz(ly->w[s]);
	const lora_group *gs[2] = { ly->attn, ly->mlp };
	for (int i = 0; i < 2; i++)
		n += gs[i] ? 2 * rsz(gs[i]->param) : 0;
	for (int e = 0; ly->moe && e < m->E; e++)
		n += rsz(ly->experts[e]) + (ly->exp && ly->exp[e] ? 2 * rsz(ly->exp[e]->param) : 0);
	return n;
}

int tier_trainer_create(tier_model *m, const tier_train_cfg *c, tier_trainer **out)
{
	if (!out)
		return tier_fail(-EINVAL, "tier_trainer_create: out is NULL");
	*out = NULL;
	if (!m || !c)
		return tier_fail(-EINVAL, "tier_trainer_create: model and config are required");
	int rc = check_cfg(c);
	if (rc)
		return rc;
	tier_trainer *t = calloc(1, sizeof *t);
	if (!t)
		return tier_fail(-ENOMEM, "out of memory for the trainer");
	t->m = m, t->c = *c, t->ps.s = m->s;
	if ((rc = dec_shape_init(m, c->batch, c->seq, &t->sh)))
		goto fail;
	int T = t->sh.T, E = m->E > 0 ? m->E : 1;
	tier_loss_params_init(&t->lp, T, m->V, m->H);
	size_t lws = 0;
	if ((rc = tier_loss_workspace_bytes(&t->lp, TIER_DEV_CPU, &lws)))
		goto fail;
	t->loss_ws = (lws + 63) / 64 * 64;
	t->dec_bytes = dec_bufs_bytes(m, &t->sh);
	size_t th = (sizeof(float) * (size_t)T * m->H + 63) / 64 * 64, tl = (sizeof(float) * (size_t)T + 63) / 64 * 64;
	uint64_t sbytes = t->dec_bytes + 3 * th + tl + t->loss_ws;
	if (!(t->ckpt = calloc((size_t)m->L + 1, sizeof *t->ckpt)) || !(t->counts = calloc((size_t)E, sizeof(int32_t))) ||
	    !(t->lcounts = calloc((size_t)m->L * E, sizeof(int64_t))) ||
	    !(t->ptr = calloc(15 * (size_t)E, sizeof *t->ptr))) {
		rc = tier_fail(-ENOMEM, "out of memory for the trainer's tables");
		goto fail;
	}
	if ((rc = tier_obj_create(m->s, sbytes, TIER_CLASS_ACT, TIER_OBJ_DISCARDABLE, &t->scratch)))
		goto fail;
	for (int l = 0; l <= m->L; l++)
		if ((rc = tier_obj_create(m->s, th, TIER_CLASS_ACT, 0, &t->ckpt[l])))
			goto fail;
	uint64_t most = rsz(m->embed) + rsz(m->lm_head) + rsz(m->norm), opt = 0;
	for (size_t g = 0; g < m->n_groups; g++) /* the optimizer pins one group's three objects */
		opt = 4 * rsz(m->groups[g].param) > opt ? 4 * rsz(m->groups[g].param) : opt;
	most = opt > most ? opt : most;
	for (int l = 0; l < m->L; l++)
		most = layer_bytes(m, l) > most ? layer_bytes(m, l) : most;
	t->min_hbm = tier_align_up(sbytes, 4096) + 2 * tier_align_up(th, 4096) + most;
	tier_stats st;
	tier_store_stats(m->s, &st);
	if (st.tier[TIER_HBM].capacity < t->min_hbm) {
		char need[32], have[32];
		rc = tier_fail(-ENOSPC, "the HBM budget (%s) cannot hold one layer's weights with the activations of a "
			       "micro-batch: %s needed; raise --hbm or lower --batch/--seq",
			       tier_format_size(st.tier[TIER_HBM].capacity, have, sizeof have),
			       tier_format_size(t->min_hbm, need, sizeof need));
		goto fail;
	}
	if ((rc = set_schedule(t)))
		goto fail;
	*out = t;
	return 0;
fail:
	tier_trainer_destroy(t);
	return rc;
}

void tier_trainer_destroy(tier_trainer *t)
{
	if (!t)
		return;
	pin_release_all(&t->ps);
	if (t->scratch)
		tier_obj_destroy(t->m->s, t->scratch);
	for (int l = 0; t->ckpt && l <= t->m->L; l++)
		if (t->ckpt[l])
			tier_obj_destroy(t->m->s, t->ckpt[l]);
	tier_store_set_schedule(t->m->s, NULL, 0, 0);
	free(t->ckpt);
	free(t->counts);
	free(t->lcounts);
	free(t->ptr);
	free(t);
}

uint64_t tier_trainer_min_hbm(const tier_trainer *t) { return t->min_hbm; }
int64_t tier_trainer_steps_done(const tier_trainer *t) { return t->step; }

int tier_trainer_expert_counts(const tier_trainer *t, int layer, int64_t *out)
{
	if (!t || !out)
		return tier_fail(-EINVAL, "tier_trainer_expert_counts: trainer and output are required");
	if (layer < 0 || layer >= t->m->L)
		return tier_fail(-EINVAL, "tier_trainer_expert_counts: layer %d is not in 0..%d", layer, t->m->L - 1);
	if (!t->m->layers[layer].moe)
		return tier_fail(-ENOENT, "layer %d is a dense MLP layer: it has no experts to count", layer);
	memcpy(out, t->lcounts + (size_t)layer * t->m->E, sizeof *out * (size_t)t->m->E);
	return 0;
}
tier_model *trainer_model(tier_trainer *t) { return t->m; }
int64_t trainer_step_index(const tier_trainer *t) { return t->step; }
void trainer_set_step(tier_trainer *t, int64_t step) { t->step = step; }

/* ---- Operations -------------------------------------------------------------------------------- */
/* Pin the scratch object for the step and carve it. */
static int scratch_begin(tier_trainer *t, pinset *sp)
{
	float *p;
	int rc = pin(sp, t->scratch, TIER_ACQ_INIT, 1, &p);
	if (rc)
		return rc;
	char *c = (char *)p;
	size_t th = (sizeof(float) * (size_t)t->sh.T * t->m->H + 63) / 64 * 64;
	dec_bufs_bind(t->m, &t->sh, c, &t->b);
	c += t->dec_bytes;
	t->gcur = (float *)c, t->gnext = (float *)(c + th), t->hn = (float *)(c + 2 * th);
	t->lse = (float *)(c + 3 * th);
	t->lws = c + 3 * th + (sizeof(float) * (size_t)t->sh.T + 63) / 64 * 64;
	return 0;
}

static void at_op(tier_trainer *t)
{
	tier_store_at_op(t->m->s, t->op++);
}

/* Pin a LoRA group's parameters (and gradients when grads: zeroed at their first use in a step). */
static int pin_group(tier_trainer *t, lora_group *g, int grads, float **param, float **grad)
{
	*param = *grad = NULL;
	if (!g)
		return 0;
	int rc = pin(&t->ps, g->param, 0, 0, param);
	if (rc || !grads)
		return rc;
	if ((rc = pin(&t->ps, g->grad, g->touched ? 0 : TIER_ACQ_INIT, 1, grad)))
		return rc;
	if (!g->touched)
		memset(*grad, 0, sizeof(float) * g->n);
	g->touched = 1;
	return 0;
}

/* Pin layer l's dense weights and non-expert LoRA into w. */
static int pin_dense(tier_trainer *t, int l, int grads, dec_weights *w)
{
	tier_model *m = t->m;
	model_layer *ly = &m->layers[l];
	float *p, *g;
	int rc;
	memset(w, 0, sizeof *w);
	for (int s = 0; s < W_NSLOTS; s++) {
		if (!ly->w[s])
			continue;
		if ((rc = pin(&t->ps, ly->w[s], 0, 0, &p)))
			return rc;
		w->w[s] = p;
	}
	if ((rc = pin_group(t, ly->attn, grads, &p, &g)))
		return rc;
	for (int i = 0; i < 4; i++)
		model_lora_ref(m, ly->attn, i, p, g, &w->lora[i]);
	if ((rc = pin_group(t, ly->mlp, grads, &p, &g)))
		return rc;
	for (int i = 0; i < 3; i++)
		model_lora_ref(m, ly->mlp, i, p, g, &w->mlp[i]);
	return 0;
}

/* Route, then pin only the experts that received tokens (and their LoRA). */
static int pin_experts(tier_trainer *t, int l, int grads, dec_weights *w)
{
	tier_model *m = t->m;
	model_layer *ly = &m->layers[l];
	int E = m->E, rc = dec_route(m, &t->sh, w, &t->b, t->counts);
	if (rc)
		return rc;
	const float **P = t->ptr;
	memset(P, 0, sizeof *P * 15 * (size_t)E);
	const float **gate = P, **up = P + E, **down = P + 2 * E;
	w->ex = (tier_moe_experts){ .gate = gate, .up = up, .down = down, .order = TIER_MOE_GATE_FIRST };
	tier_moe_lora *lo[3] = { &w->elora.gate, &w->elora.up, &w->elora.down };
	for (int j = 0; j < 3; j++)
		*lo[j] = (tier_moe_lora){ .a = P + (3 + 4 * j) * E, .b = P + (4 + 4 * j) * E,
					  .da = (float *const *)(P + (5 + 4 * j) * E),
					  .db = (float *const *)(P + (6 + 4 * j) * E), .rank = m->lora.r, .scale = m->scale };
	w->has_elora = ly->exp && ly->exp[0];
	size_t I = (size_t)m->Ie, H = (size_t)m->H;
	for (int e = 0; e < E; e++) {
		if (!t->counts[e])
			continue;
		float *p, *g;
		if ((rc = pin(&t->ps, ly->experts[e], 0, 0, &p)))
			return rc;
		gate[e] = p, up[e] = p + I * H, down[e] = p + 2 * I * H;
		if (!w->has_elora)
			continue;
		if ((rc = pin_group(t, ly->exp[e], grads, &p, &g)))
			return rc;
		for (int j = 0; j < 3; j++) {
			tier_lora_ref r;
			model_lora_ref(m, ly->exp[e], j, p, g, &r);
			((const float **)lo[j]->a)[e] = r.a, ((const float **)lo[j]->b)[e] = r.b;
			((float **)lo[j]->da)[e] = r.da, ((float **)lo[j]->db)[e] = r.db;
		}
	}
	return 0;
}

/* Forward of layer l from its input x into out (NULL: backward's recompute, out into b->mo only). */
static int layer_fwd(tier_trainer *t, int l, int grads, const float *x, float *out, dec_weights *w)
{
	tier_model *m = t->m;
	int rc = pin_dense(t, l, grads, w);
	if (rc || (rc = dec_attn_fwd(m, &t->sh, x, w, &t->b)))
		return rc;
	if (m->layers[l].moe && (rc = pin_experts(t, l, grads, w)))
		return rc;
	return dec_mlp_fwd(m, &t->sh, m->layers[l].moe, w, &t->b, out ? out : t->b.dtmp);
}

static int op_end(tier_trainer *t, int rc)
{
	int r2 = pin_release_all(&t->ps);
	return rc ? rc : r2;
}

static int op_embed(tier_trainer *t, const int32_t *tokens)
{
	float *e, *x;
	at_op(t);
	int rc = pin(&t->ps, t->m->embed, 0, 0, &e);
	if (!rc && !(rc = pin(&t->ps, t->ckpt[0], TIER_ACQ_INIT, 1, &x)))
		rc = tier_embed_fwd(t->m->dev, t->sh.T, t->m->V, t->m->H, tokens, e, x);
	return op_end(t, rc);
}

static int op_fwd(tier_trainer *t, int l, float *hidden)
{
	float *x, *y;
	dec_weights w;
	at_op(t);
	int rc = pin(&t->ps, t->ckpt[l], 0, 0, &x);
	if (!rc && !(rc = pin(&t->ps, t->ckpt[l + 1], TIER_ACQ_INIT, 1, &y)))
		rc = layer_fwd(t, l, 0, x, y, &w);
	if (!rc && t->m->layers[l].moe) /* forwards only: the backward's recompute routes the same again */
		for (int e = 0; e < t->m->E; e++)
			t->lcounts[(size_t)l * t->m->E + e] += t->counts[e];
	if (!rc && hidden)
		memcpy(hidden, y, sizeof(float) * (size_t)t->sh.T * t->m->H);
	return op_end(t, rc);
}

/* Final norm and the loss; t->gcur gets d loss / d (last layer output). */
static int op_loss(tier_trainer *t, const int32_t *labels, float dloss, int grads, float *loss, float *hidden)
{
	tier_model *m = t->m;
	float *nw, *W, *x;
	int64_t count;
	int T = t->sh.T, rc;
	at_op(t);
	if ((rc = pin(&t->ps, m->norm, 0, 0, &nw)) || (rc = pin(&t->ps, m->lm_head, 0, 0, &W)) ||
	    (rc = pin(&t->ps, t->ckpt[m->L], 0, 0, &x)) ||
	    (rc = tier_rmsnorm_fwd(m->dev, T, m->H, m->eps, x, nw, t->hn, t->b.r1)))
		return op_end(t, rc);
	if (hidden)
		memcpy(hidden, t->hn, sizeof(float) * (size_t)T * m->H);
	if (grads)
		rc = tier_loss_fwd_bwd(m->dev, &t->lp, t->hn, W, labels, dloss, t->lse, loss, &count, t->b.dtmp, NULL,
				       t->lws, t->loss_ws);
	else
		rc = tier_loss_fwd(m->dev, &t->lp, t->hn, W, labels, t->lse, loss, &count, t->lws, t->loss_ws);
	if (!rc && grads)
		rc = tier_rmsnorm_bwd(m->dev, T, m->H, x, nw, t->b.r1, t->b.dtmp, t->gcur, NULL);
	return op_end(t, rc);
}

static int op_bwd(tier_trainer *t, int l, float d_aux)
{
	float *x;
	dec_weights w;
	at_op(t);
	int rc = pin(&t->ps, t->ckpt[l], 0, 0, &x);
	if (!rc && !(rc = layer_fwd(t, l, 1, x, NULL, &w)))
		rc = dec_bwd(t->m, &t->sh, t->m->layers[l].moe, x, &w, &t->b, t->gcur, d_aux, t->gnext);
	float *s = t->gcur;
	t->gcur = t->gnext, t->gnext = s;
	return op_end(t, rc);
}

/* One micro-batch forward (and backward when grads); *aux gets the router losses added. */
static int micro(tier_trainer *t, const int32_t *tok, const int32_t *lab, float dloss, int grads, float *loss,
		 float *aux, float *hidden)
{
	tier_model *m = t->m;
	size_t th = (size_t)t->sh.T * m->H;
	int rc = op_embed(t, tok);
	if (!rc && hidden) {
		float *x;
		if (!(rc = pin(&t->ps, t->ckpt[0], 0, 0, &x)))
			memcpy(hidden, x, sizeof(float) * th);
		rc = op_end(t, rc);
	}
	for (int l = 0; l < m->L && !rc; l++) {
		rc = op_fwd(t, l, hidden ? hidden + (l + 1) * th : NULL);
		if (m->layers[l].moe)
			*aux += t->b.ms.aux + t->b.ms.z;
	}
	if (!rc)
		rc = op_loss(t, lab, dloss, grads, loss, hidden ? hidden + (m->L + 1) * th : NULL);
	for (int l = m->L - 1; l >= 0 && !rc && grads; l--)
		rc = op_bwd(t, l, dloss);
	return rc;
}

/* ---- AdamW ------------------------------------------------------------------------------------- */
static float lr_at(const tier_train_cfg *c, int64_t s)
{
	if (s < c->warmup)
		return c->lr * (float)(s + 1) / (float)c->warmup;
	double span = c->steps - c->warmup, prog = span > 0 ? (double)(s - c->warmup) / span : 1.0;
	prog = prog > 1 ? 1 : prog;
	double cosv = 0.5 * (1.0 + cos(M_PI * prog));
	return (float)(c->lr * (c->min_lr_ratio + (1.0 - c->min_lr_ratio) * cosv));
}

static int grad_norm(tier_trainer *t, double *out)
{
	double ss = 0.0;
	for (size_t i = 0; i < t->m->n_groups; i++) {
		lora_group *g = &t->m->groups[i];
		float *p;
		if (!g->touched)
			continue;
		int rc = pin(&t->ps, g->grad, 0, 0, &p);
		if (rc)
			return op_end(t, rc);
		for (size_t j = 0; j < g->n; j++)
			ss += (double)p[j] * p[j];
		if ((rc = op_end(t, 0)))
			return rc;
	}
	*out = sqrt(ss);
	return 0;
}

/* PyTorch's AdamW: p *= 1 - lr wd; m, v moments; p -= lr mhat / (sqrt(vhat) + eps). Groups whose
 * gradients were never written in the step (experts that got no tokens) are skipped, as PyTorch
 * skips parameters whose grad is None. */
static int adamw(tier_trainer *t, float lr, float gscale)
{
	const tier_train_cfg *c = &t->c;
	for (size_t i = 0; i < t->m->n_groups; i++) {
		lora_group *g = &t->m->groups[i];
		float *p, *gr, *mv;
		if (!g->touched)
			continue;
		int rc;
		if ((rc = pin(&t->ps, g->param, 0, 1, &p)) || (rc = pin(&t->ps, g->grad, 0, 0, &gr)) ||
		    (rc = pin(&t->ps, g->optim, 0, 1, &mv)))
			return op_end(t, rc);
		g->t++;
		float bc1 = 1.0f - powf(c->beta1, (float)g->t), bc2 = 1.0f - powf(c->beta2, (float)g->t);
		float *mm = mv, *vv = mv + g->n, decay = 1.0f - lr * c->weight_decay;
		for (size_t j = 0; j < g->n; j++) {
			float gj = gr[j] * gscale;
			mm[j] = c->beta1 * mm[j] + (1.0f - c->beta1) * gj;
			vv[j] = c->beta2 * vv[j] + (1.0f - c->beta2) * gj * gj;
			p[j] = p[j] * decay - lr * (mm[j] / bc1) / (sqrtf(vv[j] / bc2) + c->eps);
		}
		if ((rc = op_end(t, 0)))
			return rc;
	}
	return 0;
}

static int check_tokens(const tier_trainer *t, const int32_t *tokens, const int32_t *labels, size_t n)
{
	if (!tokens || !labels)
		return tier_fail(-EINVAL, "tokens and labels are required");
	for (size_t i = 0; i < n; i++) {
		if (tokens[i] < 0 || tokens[i] >= t->m->V)
			return tier_fail(-EINVAL, "token %d at position %zu is outside the vocabulary 0..%d", tokens[i], i,
					 t->m->V - 1);
		if (labels[i] != t->lp.ignore_index && (labels[i] < 0 || labels[i] >= t->m->V))
			return tier_fail(-EINVAL, "label %d at position %zu is outside the vocabulary 0..%d (or %d to ignore)",
					 labels[i], i, t->m->V - 1, t->lp.ignore_index);
	}
	return 0;
}

static void zero_grads(tier_trainer *t)
{
	for (size_t i = 0; i < t->m->n_groups; i++)
		t->m->groups[i].touched = 0;
}

int tier_trainer_step(tier_trainer *t, const int32_t *tokens, const int32_t *labels, tier_step_result *r)
{
	if (!t || !r)
		return tier_fail(-EINVAL, "tier_trainer_step: trainer and result are required");
	size_t T = (size_t)t->sh.T;
	int nm = t->c.micro_batches, rc = check_tokens(t, tokens, labels, T * nm);
	if (rc)
		return rc;
	if (!t->m->have_data)
		return tier_fail(-ENODATA, "the model has no base weights; load them (tier_model_load_hf) or make them "
				 "(tier_model_init_random) first");
	uint64_t t0 = tier_now_ns();
	pinset sp = { .s = t->m->s };
	memset(r, 0, sizeof *r);
	memset(t->lcounts, 0, sizeof *t->lcounts * (size_t)t->m->L * (t->m->E > 0 ? t->m->E : 1));
	zero_grads(t);
	t->op = 0;
	if ((rc = scratch_begin(t, &sp)))
		return rc;
	float dloss = 1.0f / (float)nm, loss_sum = 0.0f;
	for (int mb = 0; mb < nm && !rc; mb++) {
		float l = 0.0f;
		rc = micro(t, tokens + mb * T, labels + mb * T, dloss, 1, &l, &r->aux, NULL);
		loss_sum += l;
	}
	double norm = 0.0;
	if (!rc)
		rc = grad_norm(t, &norm);
	float lr = lr_at(&t->c, t->step);
	float gs = t->c.clip > 0 && norm > t->c.clip ? (float)(t->c.clip / (norm + 1e-6)) : 1.0f;
	if (!rc) {
		at_op(t);
		rc = adamw(t, lr, gs);
	}
	int r2 = pin_release_all(&sp);
	rc = rc ? rc : r2;
	if (rc)
		return rc;
	tier_store_step(t->m->s);
	t->step++;
	r->loss = loss_sum / (float)nm, r->aux /= (float)nm, r->grad_norm = (float)norm, r->lr = lr;
	r->loss += r->aux;
	for (size_t i = 0; i < T * nm; i++)
		r->tokens += labels[i] != t->lp.ignore_index;
	r->ns = tier_now_ns() - t0;
	return 0;
}

int tier_trainer_eval(tier_trainer *t, const int32_t *tokens, const int32_t *labels, int grads, float *loss,
		      float *hidden)
{
	if (!t || !loss)
		return tier_fail(-EINVAL, "tier_trainer_eval: trainer and loss are required");
	int rc = check_tokens(t, tokens, labels, (size_t)t->sh.T);
	if (rc)
		return rc;
	if (!t->m->have_data)
		return tier_fail(-ENODATA, "the model has no base weights; load or make them first");
	pinset sp = { .s = t->m->s };
	float aux = 0.0f;
	memset(t->lcounts, 0, sizeof *t->lcounts * (size_t)t->m->L * (t->m->E > 0 ? t->m->E : 1));
	zero_grads(t);
	t->op = 0;
	if ((rc = scratch_begin(t, &sp)))
		return rc;
	rc = micro(t, tokens, labels, 1.0f, grads, loss, &aux, hidden);
	int r2 = pin_release_all(&sp);
	*loss += aux;
	return rc ? rc : r2;
}
