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
#include "core/trainer.h"
#include "core/dec_ops.h"
#include "core/ops_cuda.h"
#include "tier/formats.h"

const char *tier_step_part_name(int part)
{
	static const char *const n[TIER_NPARTS] = { "embed", "attn_fwd", "route", "mlp_fwd", "loss",
						    "mlp_bwd", "attn_bwd", "optim", "pin" };
	return part >= 0 && part < TIER_NPARTS ? n[part] : NULL;
}

/* Charge the time since the last mark to `part` (on the host's clock; a step also puts a device
 * mark, whose times replace the host's at its end: see step_parts). */
void trainer_charge(tier_trainer *t, int part)
{
	if (t->profile)
		tier_dev_sync(t->m->dev);
	else if (t->marking)
		tier_marks_put(t->marks, part); /* a failure shows in tier_marks_collect */
	uint64_t now = tier_now_ns();
	t->part[part] += now - t->mark;
	t->mark = now;
	t->pin_part[part] += t->pin_since;
	t->pin_since = 0;
}

/* Count the time since t0 as pinning (PIN overlaps the part it happens in; the part's share is
 * charged with it). */
static void pin_time(tier_trainer *t, uint64_t t0)
{
	uint64_t dt = tier_now_ns() - t0;
	t->part[TIER_PART_PIN] += dt;
	t->pin_since += dt;
}

/* pin() with its time counted. Refused for room, or for a fill not yet ended, while the operation
 * before still holds its pins (train_pending.c): that one is finished first and the pin retried. */
int trainer_pin(tier_trainer *t, tier_object *o, unsigned flags, int dirty, float **p)
{
	uint64_t t0 = tier_now_ns();
	int rc = pin(&t->ps, o, flags, dirty, p);
	if ((rc == -ENOSPC || rc == -EBUSY) && t->prev_on) {
		t->n_early++;
		int r = trainer_finish_prev(t);
		rc = r ? r : pin(&t->ps, o, flags, dirty, p);
	}
	pin_time(t, t0);
	return rc;
}

static int scratch_end(tier_trainer *t, int keep);

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
		n += rsz(ly->experts[e]) + (ly->exp && ly->exp[e] && ly->exp[e]->own == ly->exp[e] ? 2 * rsz(ly->exp[e]->param) : 0);
	return n;
}

/* Floats of LoRA parameters one layer's operation uses (attention, MLP and every expert group). */
static size_t layer_lora_floats(const tier_model *m, int l)
{
	const model_layer *ly = &m->layers[l];
	size_t n = (ly->attn ? ly->attn->n + 32 : 0) + (ly->mlp ? ly->mlp->n + 32 : 0);
	for (int e = 0; ly->moe && ly->exp && e < m->E; e++)
		n += ly->exp[e] ? ly->exp[e]->n + 32 : 0; /* + 32: each group's copy starts 64-byte aligned */
	return n;
}

/* The scratch the CUDA path adds after the loss workspace: bf16 LoRA copies of the largest layer,
 * tokens, labels and the loss's scalars. Carved at c (NULL: only counted);
 * returns its bytes, 0 on the CPU. */
static uint64_t dev_extra(tier_trainer *t, char *c)
{
	const tier_model *m = t->m;
	if (!m->cuda)
		return 0;
	size_t most = 0, T = (size_t)t->sh.T;
	for (int l = 0; l < m->L; l++)
		most = layer_lora_floats(m, l) > most ? layer_lora_floats(m, l) : most;
	struct { void **p; uint64_t bytes; } part[] = {
		{ (void **)&t->l16, 2 * (most + 64) },
		{ (void **)&t->tok_d, sizeof(int32_t) * T }, { (void **)&t->lab_d, sizeof(int32_t) * T },
		{ (void **)&t->acc_d, 256 }, /* acc_d, then loss_d and count_d in the same 256 bytes */
	};
	uint64_t off = 0;
	for (size_t i = 0; i < sizeof part / sizeof part[0]; i++) {
		if (c)
			*part[i].p = c + off;
		off += tier_align_up(part[i].bytes, 256);
	}
	if (c)
		t->loss_d = (float *)((char *)t->acc_d + 8), t->count_d = (int64_t *)((char *)t->acc_d + 16);
	return off;
}

/* The environment's switches: $TIER_PROFILE (each part waits for the device; no device marks) and
 * $TIER_SCHED_ROUTED, which operations list only the routed experts: "bwd" (default) the
 * backward's, whose routing is known; "all" the forwards' too, from the latest two forwards'
 * routing (an expert routed outside that prediction is fetched when the layer has routed, behind
 * the prefetches queued on the link: on the H200 that stalled more than the unused forward
 * prefetches it saved cost); "0" none. $TIER_MOE_ROUTED=0 has the MoE block route and read its
 * offsets back itself, as before the routed halves (dec_shape.routed), for comparison;
 * $TIER_QK_FUSED=0 takes q and k through their norms and RoPE, forward and backward, in separate
 * steps (dec_shape.qk_fused); $TIER_QKV_CAT=0 takes the q, k and v projections' backward a product
 * each (dec_shape.qkv_cat); $TIER_QKV_FWD_CAT=1 makes their forward's adapters' x A^T one product
 * (dec_shape.qkv_fwd_cat: its tests pass, and on an H100 in session 25 it gained nothing
 * measurable, so it is off by default); $TIER_QKV16=0 has the q, k and v projections write fp32
 * as before session 38 (dec_shape.qkv16); $TIER_MOE_KEEP_H=0 leaves h out of the MoE states the op
 * cache keeps (dec_shape.keep_h): their backward makes it again, as before session 26;
 * $TIER_MOE_RES=0 adds the residual after the MoE block in a pass of its own (dec_shape.moe_res),
 * $TIER_ATTN_RES=0 after the o projection (dec_shape.attn_res). */
/* Whether $name is set to value. */
static int env_is(const char *name, const char *value)
{
	const char *v = getenv(name);
	return v && !strcmp(v, value);
}

static void trainer_env(tier_trainer *t)
{
	const char *prof = getenv("TIER_PROFILE");
	t->profile = prof && *prof && strcmp(prof, "0");
	const char *pipe = getenv("TIER_PIPELINE"); /* 0 off; force: even where two operations' pins
						     * do not fit (tests: the early finishes) */
	t->pipeline = !t->profile && !(pipe && !strcmp(pipe, "0"));
	t->pipe_force = t->pipeline && pipe && !strcmp(pipe, "force");
	const char *routed = getenv("TIER_SCHED_ROUTED");
	t->sched_routed = !routed || !strcmp(routed, "bwd") ? 1 : !strcmp(routed, "all") ? 2 : 0;
	t->moe_routed = !env_is("TIER_MOE_ROUTED", "0");
	t->qk_fused = !env_is("TIER_QK_FUSED", "0");
	t->qkv_cat = !env_is("TIER_QKV_CAT", "0");
	t->qkv_fwd_cat = env_is("TIER_QKV_FWD_CAT", "1"); /* off: no gain measured */
	t->qkv16 = !env_is("TIER_QKV16", "0");
	t->attn_res = !env_is("TIER_ATTN_RES", "0");
	t->keep_h = !env_is("TIER_MOE_KEEP_H", "0");
	t->moe_res = !env_is("TIER_MOE_RES", "0");
}

/* The op cache's HBM budget where it may keep the MoE half (grouped_gemm among its rules' kinds),
 * else 0: only states kept in HBM keep h too (dec_shape.keep_h, keep_h_fits); elsewhere the
 * backward's recompute leaves h in the workspace. */
static uint64_t cache_moe_hbm(const tier_trainer *t)
{
	tier_cache_config cc;
	if (!t->c.opcache || !*t->c.opcache || tier_cache_config_parse(t->c.opcache, &cc))
		return 0; /* a bad text is refused with its message when the cache opens */
	for (unsigned i = 0; i < cc.n_rules; i++)
		if (cc.rules[i].kinds & (1u << TIER_OP_GROUPED_GEMM))
			return cc.budget[0];
	return 0;
}

/* Whether the op cache's states with h (dec_shape.keep_h; save: their halves' bytes) fit: the
 * states alive at once, every layer's for each micro-batch a layer-major step holds (t->nck; else
 * one: a micro-batch's backward frees its entries before the next forward), within the cache's HBM
 * budget (cache_hbm) and, beside all else a step touches (trainer_budget's sum), in HBM. Where they
 * do not, the larger states would crowd out other states or the weights: on an 80 GB card, whose
 * store cannot hold the weights beside the cache anyway, keeping h cost (a) 1.6% (session 26). */
static int keep_h_fits(const tier_trainer *t, uint64_t cache_hbm, uint64_t sbytes, size_t ta, size_t nckpt,
		       const size_t save[2])
{
	const tier_model *m = t->m;
	uint64_t states = (uint64_t)m->L * (uint64_t)t->nck * (save[0] + save[1]);
	uint64_t all = m->base_bytes + 16 * m->lora_n + nckpt * tier_align_up(ta, 4096) + sbytes;
	tier_stats st;
	tier_store_stats(m->s, &st);
	return states <= cache_hbm && all + states <= st.tier[TIER_HBM].capacity;
}

/* The host tables sized by the experts and the tokens, and the checkpoint slots. */
static int trainer_tables(tier_trainer *t, size_t nckpt)
{
	const tier_model *m = t->m;
	size_t E = m->E > 0 ? (size_t)m->E : 1, T = (size_t)t->sh.T;
	if (!(t->ckpt = calloc(nckpt, sizeof *t->ckpt)) || !(t->counts = calloc(E, sizeof(int32_t))) ||
	    !(t->fcounts = calloc(nckpt * E, sizeof(int32_t))) || !(t->fvalid = calloc(nckpt, 1)) ||
	    !(t->mkept = calloc(nckpt, 1)) ||
	    !(t->core_kept = calloc((size_t)t->c.micro_batches * m->L, 1)) ||
	    !(t->lcounts = calloc((size_t)m->L * E, sizeof(int64_t))) ||
	    !(t->mbcounts = calloc((size_t)m->L * E, sizeof(int64_t))) ||
	    !(t->prevcounts = calloc((size_t)m->L * E, sizeof(int64_t))) ||
	    !(t->sched_skip = calloc((size_t)m->L * E, 1)) ||
	    !(t->ptr = calloc(15 * E, sizeof *t->ptr)) || !(t->cv_src = calloc(E + 2, sizeof *t->cv_src)) ||
	    !(t->cv_dst = calloc(E + 2, sizeof *t->cv_dst)) || !(t->cv_len = calloc(E + 2, sizeof(size_t))) ||
	    !(t->hidx = calloc(T * (m->k > 0 ? (size_t)m->k : 1), sizeof(int32_t))) ||
	    !(t->glo = calloc((size_t)m->L + 1, sizeof *t->glo)) || !(t->opt_due = calloc((size_t)m->L + 1, 1)) ||
	    !(t->sched_due = calloc((size_t)m->L + 1, 1)))
		return tier_fail(-ENOMEM, "out of memory for the trainer's tables");
	size_t g = 0; /* groups are in layer order */
	for (int l = 0; l <= m->L; l++) {
		t->glo[l] = g;
		while (l < m->L && g < m->n_groups && m->groups[g].layer == l)
			g++;
	}
	return 0;
}

/* What the HBM budget must hold (t->min_hbm: the scratch of sbytes, an operation's layer inputs and
 * outputs of ta bytes each, the largest layer or optimizer set) and whether the step spills; -ENOSPC
 * naming both sizes when the budget is smaller. */
static int trainer_budget(tier_trainer *t, uint64_t sbytes, size_t ta, size_t nckpt, const size_t save[2])
{
	const tier_model *m = t->m;
	uint64_t most = rsz(m->embed) + rsz(m->lm_head) + rsz(m->norm), opt = 0;
	for (size_t g = 0; g < m->n_groups; g += m->groups[g].n_members) /* the optimizer pins a set's objects */
		opt = 4 * rsz(m->groups[g].param) > opt ? 4 * rsz(m->groups[g].param) : opt;
	most = opt > most ? opt : most;
	for (int l = 0; l < m->L; l++)
		most = layer_bytes(m, l) > most ? layer_bytes(m, l) : most;
	/* an operation pins a layer's input and output for each of its micro-batches */
	t->min_hbm = tier_align_up(sbytes, 4096) + 2 * t->nck * tier_align_up(ta, 4096) + most;
	/* everything a step touches: the weights, the LoRA parameters with their gradients and two
	 * moments, the layer inputs and the scratch. All of it lives somewhere at the end of a forward:
	 * a store that cannot hold it fails (or thrashes) only minutes into the job, after the weights
	 * were made */
	uint64_t all = m->base_bytes + 16 * m->lora_n + nckpt * tier_align_up(ta, 4096) + sbytes;
	tier_stats st;
	tier_store_stats(m->s, &st);
	t->hbm_cap = st.tier[TIER_HBM].capacity;
	uint64_t room = 0;
	for (int i = 0; i < TIER_NTIERS; i++)
		room += st.tier[i].capacity;
	if (all > room) {
		char need[32], have[32], h[32], d[32], n[32];
		return tier_fail(-ENOSPC, "the budgets hold %s (hbm %s, ddr %s, nvme %s) but the model's weights, its LoRA "
				 "state, the layer inputs of %d micro-batch%s and the scratch take %s: raise --ddr or give "
				 "--nvme DIR:SIZE%s", tier_format_size(room, have, sizeof have),
				 tier_format_size(st.tier[TIER_HBM].capacity, h, sizeof h),
				 tier_format_size(st.tier[TIER_DDR].capacity, d, sizeof d),
				 tier_format_size(st.tier[TIER_NVME].capacity, n, sizeof n), t->nck, t->nck > 1 ? "es" : "",
				 tier_format_size(all, need, sizeof need),
				 t->nck > 1 ? " (or use fewer layer-major micro-batches)" : "");
	}
	t->spill = all > t->hbm_cap;
	t->scratch_keep = t->hbm_cap >= t->min_hbm + opt; /* an optimizer set's room to spare */
	/* pipelined operations (train_pending.c) hold two operations' pins at once, and with the op
	 * cache the entries of both (reserved before a forward's pins, restored before a backward's
	 * experts, held to the operation's end): below that room the next one's pins would be
	 * refused, or split the free space so that a large object no longer fits where the operation
	 * alone fitted */
	uint64_t op = 2 * t->nck * tier_align_up(ta, 4096) + most;
	uint64_t held = t->cache ? 2 * t->nck * (uint64_t)(save[0] + save[1]) : 0;
	if (held) { /* the cache holds no more than its HBM budget */
		tier_cache_stats cs;
		tier_cache_stats_get(t->cache, &cs);
		held = cs.budget[0] < held ? cs.budget[0] : held;
	}
	if (t->hbm_cap < t->min_hbm + op + held && !t->pipe_force)
		t->pipeline = 0;
	if (t->hbm_cap >= t->min_hbm)
		return 0;
	char need[32], have[32];
	return tier_fail(-ENOSPC, "the HBM budget (%s) cannot hold one layer's weights with the activations of a "
			 "micro-batch: %s needed; raise --hbm or lower --batch/--seq",
			 tier_format_size(t->hbm_cap, have, sizeof have), tier_format_size(t->min_hbm, need, sizeof need));
}

/* tier_model.settle: the deferred update still due, run outside a step. */
static int settle_cb(void *arg)
{
	return trainer_optim_settle(arg);
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
	t->m = m, t->c = *c, t->ps.s = t->ps_prev.s = m->s, t->op_seq = 1;
	trainer_env(t);
	if (!t->profile && (rc = tier_marks_open(&t->marks, m->dev)))
		goto fail;
	if ((rc = tier_waypoint_open(&t->wp, m->dev)))
		goto fail;
	if ((rc = dec_shape_init(m, c->batch, c->seq, c->moe_chunks, &t->sh)))
		goto fail;
	t->sh.core2 = c->opcache && *c->opcache; /* the attention's output may come from the op cache */
	t->sh.routed = t->moe_routed && t->sh.mchunks == 1; /* chunks route each chunk in the block */
	t->sh.qk_fused = t->qk_fused;
	/* the one-product backward of q, k, v needs the fused q/k kernels (they write into its buffer)
	 * and no LoRA dropout (whose dx goes back through the mask in fp32) */
	t->sh.qkv_cat = t->qkv_cat && m->cuda && t->qk_fused && !(m->lora.dropout > 0);
	t->sh.qkv_fwd_cat = t->sh.qkv_cat && t->qkv_fwd_cat;
	/* bf16 projections feed the fused q/k kernels only, and opsc_linear_fwd_cat writes fp32 */
	t->sh.qkv16 = t->qkv16 && m->cuda && t->qk_fused && !t->sh.qkv_fwd_cat;
	t->sh.moe_res = t->moe_res;
	t->sh.attn_res = t->attn_res;
	uint64_t cache_hbm = t->keep_h && m->cuda && t->sh.mchunks == 1 ? cache_moe_hbm(t) : 0;
	t->sh.keep_h = cache_hbm > 0;
	size_t aws; /* the attention's limits on this device (CUDA: head_dim 32, 64, 96 or 128), up front */
	if ((rc = tier_attn_workspace_bytes(m->dev, &t->sh.ap, &aws))) {
		rc = tier_fail(rc, "%s; this model cannot train on this device (use --device cpu)", tier_last_error());
		goto fail;
	}
	int T = t->sh.T, E = m->E > 0 ? m->E : 1;
	tier_loss_params_init(&t->lp, T, m->V, m->H);
	size_t lws = 0;
	if ((rc = tier_loss_workspace_bytes(&t->lp, tier_dev_kind_of(m->dev), &lws)))
		goto fail;
	t->loss_ws = (lws + 63) / 64 * 64;
	size_t save[2]; /* the op cache's halves of the layout */
	t->dec_bytes = dec_bufs_save_bytes(m, &t->sh, save);
	size_t th = t->th = (sizeof(float) * (size_t)T * m->H + 63) / 64 * 64, tl = (sizeof(float) * (size_t)T + 63) / 64 * 64;
	/* layer-major: every micro-batch's layer inputs, and its running gradient in the scratch */
	t->nck = c->layer_major && c->micro_batches > 1 ? c->micro_batches : 1;
	uint64_t sbytes = t->dec_bytes + 3 * th + tl + t->loss_ws + dev_extra(t, NULL) + (t->nck > 1 ? t->nck * th : 0);
	/* the layer inputs kept between the forward and the backward, in the activations' type (bf16 on
	 * CUDA, as HF keeps its hidden states; each operation works on an fp32 copy in the scratch) */
	size_t ta = (dop_act_size(m) * (size_t)T * m->H + 63) / 64 * 64;
	size_t nckpt = ((size_t)m->L + 1) * t->nck;
	if (t->sh.keep_h && !keep_h_fits(t, cache_hbm, sbytes, ta, nckpt, save)) {
		t->sh.keep_h = 0; /* the op cache's states without h: their backward makes it again */
		uint64_t with = t->dec_bytes;
		t->dec_bytes = dec_bufs_save_bytes(m, &t->sh, save);
		sbytes -= with - t->dec_bytes;
	}
	if ((size_t)t->nck * (W_NSLOTS + (size_t)E + 3) + 64 > PIN_MAX) { /* each micro-batch pins the layer again */
		rc = tier_fail(-EINVAL, "layer-major with %d micro-batches of a layer of %d experts pins more than %d "
			       "objects an operation; use fewer micro-batches", t->nck, E, PIN_MAX);
		goto fail;
	}
	if ((rc = trainer_tables(t, nckpt)) ||
	    (rc = tier_obj_create(m->s, sbytes, TIER_CLASS_ACT, TIER_OBJ_DISCARDABLE, &t->scratch)))
		goto fail;
	for (size_t i = 0; i < nckpt; i++)
		if ((rc = tier_obj_create(m->s, ta, TIER_CLASS_ACT, 0, &t->ckpt[i])))
			goto fail;
	t->ck = t->ckpt;
	if ((rc = trainer_cache_open(t)) || (rc = trainer_budget(t, sbytes, ta, nckpt, save)))
		goto fail;
	t->defer = c->optim_in_forward && t->scratch_keep; /* the scratch stays pinned beside a set */
	if ((rc = trainer_set_schedule(t)))
		goto fail;
	if (t->defer)
		m->settle = settle_cb, m->settle_arg = t;
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
	if (t->m->settle_arg == t) { /* an update still due is made before the state goes */
		(void)model_settle(t->m); /* a failure is kept in settle_err */
		t->m->settle = NULL, t->m->settle_arg = NULL;
	}
	if (t->prev_on || t->ps.n)
		(void)tier_dev_sync(t->m->dev);
	pin_release_all(&t->ps_prev);
	pin_release_all(&t->ps);
	if (t->scratch_p) /* kept from the last step: unpinned clean, which drops it (-EINVAL says so)
			   * without a dirty release in an access trace after its last step */
		(void)tier_release(t->m->s, t->scratch, TIER_HBM, 0);
	tier_cache_destroy(t->cache);
	if (t->scratch)
		tier_obj_destroy(t->m->s, t->scratch);
	for (size_t i = 0; t->ckpt && i < ((size_t)t->m->L + 1) * t->nck; i++)
		if (t->ckpt[i])
			tier_obj_destroy(t->m->s, t->ckpt[i]);
	tier_store_set_schedule(t->m->s, NULL, 0, 0);
	free(t->ckpt);
	free(t->counts);
	free(t->lcounts);
	free(t->mbcounts);
	free(t->prevcounts);
	free(t->sched_skip);
	free(t->fcounts);
	free(t->fvalid);
	free(t->mkept);
	free(t->core_kept);
	free(t->ptr);
	free(t->cv_src);
	free(t->cv_dst);
	free(t->cv_len);
	free(t->hidx);
	tier_marks_close(t->marks);
	tier_waypoint_close(t->wp);
	free(t->aw);
	free(t->aw_grp);
	free(t->glo);
	free(t->opt_due);
	free(t->sched_due);
	free(t);
}

uint64_t tier_trainer_min_hbm(const tier_trainer *t) { return t->min_hbm; }
uint64_t tier_trainer_scratch_bytes(const tier_trainer *t) { return tier_obj_size(t->scratch); }
int tier_trainer_optim_in_forward(const tier_trainer *t) { return t->defer; }

int tier_trainer_cache_stats(tier_trainer *t, tier_cache_stats *out)
{
	if (!t || !out)
		return tier_fail(-EINVAL, "tier_trainer_cache_stats: trainer and output are required");
	if (!t->cache)
		return tier_fail(-ENOENT, "the trainer has no operator cache (no --op-cache rules)");
	tier_cache_stats_get(t->cache, out);
	return 0;
}
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
/* Pin the scratch object for the step (unless still pinned from the last one), carve it, and
 * start the step's gradient norm (its device accumulator lives there). */
static int scratch_begin(tier_trainer *t)
{
	if (!t->scratch_p) {
		void *p;
		uint64_t t0 = tier_now_ns();
		int rc = tier_acquire(t->m->s, t->scratch, TIER_HBM, TIER_ACQ_INIT, &p, NULL);
		pin_time(t, t0); /* room for it is made here */
		if (rc)
			return rc;
		t->scratch_p = p;
	}
	char *c = t->scratch_p;
	size_t th = t->th;
	dec_bufs_bind(t->m, &t->sh, c, &t->b);
	t->b.routed = t->counts; /* the layer's, as pin_experts' route_counts left them */
	c += t->dec_bytes;
	t->gcur = (float *)c, t->gnext = (float *)(c + th), t->hn = (float *)(c + 2 * th);
	t->lse = (float *)(c + 3 * th);
	t->lws = c + 3 * th + (sizeof(float) * (size_t)t->sh.T + 63) / 64 * 64;
	char *e = (char *)t->lws + t->loss_ws;
	t->gmb = (float *)(e + dev_extra(t, e)); /* layer-major: nck running gradients of th bytes */
	t->g0 = t->gcur, t->g1 = t->gnext;
	return trainer_grad_norm_reset(t);
}

int trainer_scratch_drop(tier_trainer *t)
{
	t->scratch_keep = 0; /* it did not fit beside the optimizer: not kept from now on */
	return scratch_end(t, 0);
}

/* Unpin the scratch, unless keep, and drop its contents (dead between steps). Kept, it spares the
 * next step's start the evictions that make room for it (at batch 8 under --hbm 24G that start
 * waited for the optimizer's writebacks); it is kept when the budget holds the optimizer's sets
 * beside it (t->scratch_keep). */
static int scratch_end(tier_trainer *t, int keep)
{
	if (!t->scratch_p || keep)
		return 0;
	t->scratch_p = NULL;
	int rc = tier_release(t->m->s, t->scratch, TIER_HBM, 1);
	return rc ? rc : tier_obj_discard(t->m->s, t->scratch);
}

/* The fp32 values of a layer input x (the activation type) for an operation: x itself on the CPU,
 * its conversion into the scratch buffer buf on CUDA. */
static int input_f32(tier_trainer *t, const void *x, float *buf, float **out)
{
	*out = t->m->cuda ? buf : (float *)x;
	return dop_from_act(t->m, (size_t)t->sh.T * t->m->H, x, *out);
}

/* CUDA: queue a bf16 copy of a group's n LoRA parameters p into the layer's l16 area; the copy's
 * address is returned. An operation's copies are made by one launch in lora_convert. */
static const void *lora_shadow(tier_trainer *t, const float *p, size_t n)
{
	uint16_t *dst = t->l16 + t->l16_off;
	t->l16_off += (n + 31) / 32 * 32;
	t->cv_src[t->cv_n] = p, t->cv_dst[t->cv_n] = dst, t->cv_len[t->cv_n++] = n;
	return dst;
}

static int lora_convert(tier_trainer *t)
{
	int n = t->cv_n;
	t->cv_n = 0;
	return n ? opsc_to_bf16_many(t->m->dev, n, t->cv_src, (opsc_bf16 *const *)t->cv_dst, t->cv_len) : 0;
}

/* The LoRA reference of projection proj of g: fp32 parameters on the CPU, their bf16 copy at
 * shadow on CUDA (same element offsets); gradients fp32 on both. */
static void lora_ref(const tier_trainer *t, const lora_group *g, int proj, const float *param, const void *shadow,
		     float *grad, tier_lora_ref *out)
{
	model_lora_ref(t->m, g, proj, param, grad, out);
	if (out->a && t->training && t->m->lora.dropout > 0) {
		/* one mask per (step, micro-batch, layer, projection): the backward's recompute sees the
		 * forward's (eval runs without dropout, as PEFT in eval mode) */
		out->dropout = t->m->lora.dropout;
		out->mask_key = t->m->lora.seed ^ ((uint64_t)t->step << 40) ^ ((uint64_t)t->mb << 28) ^
				((uint64_t)g->layer << 8) ^ (uint64_t)(g->kind * 4 + proj);
	}
	if (!t->m->cuda || !out->a)
		return;
	const lora_mod *md = &g->mods[g->idx[proj]];
	out->a = (const float *)((const uint16_t *)shadow + md->a);
	out->b = (const float *)((const uint16_t *)shadow + md->b);
}

void trainer_at_op(tier_trainer *t)
{
	tier_store_at_op(t->m->s, t->op++);
}

/* Pin a LoRA group's parameters (and gradients when grads: zeroed at their first use in a step). */
static int pin_group(tier_trainer *t, lora_group *g, int grads, float **param, float **grad)
{
	*param = *grad = NULL;
	if (!g)
		return 0;
	/* a set's objects are pinned once per operation, for all its members (a second acquire of a
	 * copy being filled with TIER_ACQ_INIT would be refused) */
	lora_group *own = g->own;
	int rc;
	if (own->pin_seq != t->op_seq) {
		own->pin_param = own->pin_grad = NULL;
		own->pin_seq = t->op_seq;
	}
	if (!own->pin_param && (rc = trainer_pin(t, own->param, 0, 0, &own->pin_param)))
		return rc;
	*param = own->pin_param + g->off;
	if (!grads)
		return 0;
	if (!own->pin_grad) { /* the first use in a step zeroes the whole object (every member's part) */
		if ((rc = trainer_pin(t, own->grad, own->zeroed ? 0 : TIER_ACQ_INIT, 1, &own->pin_grad)))
			return rc;
		if (!own->zeroed && (rc = tier_dev_memset(t->m->dev, own->pin_grad, 0, sizeof(float) * own->n_total)))
			return rc;
		own->zeroed = 1;
	}
	*grad = own->pin_grad + g->off;
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
		if ((rc = trainer_pin(t, ly->w[s], 0, 0, &p)))
			return rc;
		w->w[s] = p;
	}
	t->l16_off = 0, t->cv_n = 0;
	if ((rc = pin_group(t, ly->attn, grads, &p, &g)))
		return rc;
	const void *sh = m->cuda && p ? lora_shadow(t, p, ly->attn->n) : NULL;
	for (int i = 0; i < 4; i++)
		lora_ref(t, ly->attn, i, p, sh, g, &w->lora[i]);
	if ((rc = pin_group(t, ly->mlp, grads, &p, &g)))
		return rc;
	sh = m->cuda && p ? lora_shadow(t, p, ly->mlp->n) : NULL;
	for (int i = 0; i < 3; i++)
		lora_ref(t, ly->mlp, i, p, sh, g, &w->mlp[i]);
	return lora_convert(t);
}

/* Layer l's slot in the tables kept by micro-batch (fcounts, fvalid, mkept). */
static size_t mb_slot(const tier_trainer *t, int l)
{
	return (size_t)(t->nck > 1 ? t->mb : 0) * (size_t)(t->m->L + 1) + (size_t)l;
}

/* The experts' token counts of layer l: routed in a forward (and kept), a backward's recompute
 * taking its forward's. The recompute's block routes again on the device, to the same experts: were
 * it not, the routed block runs on the forward's offsets and tier_moe_routing_check reports it at
 * the step's end (the block outside the routed halves refuses a routed expert without weights,
 * -EINVAL). */
static int route_counts(tier_trainer *t, int l, int bwd, dec_weights *w)
{
	tier_model *m = t->m;
	size_t slot = mb_slot(t, l), E = (size_t)m->E;
	int32_t *fc = t->fcounts + slot * E;
	if (bwd && t->fvalid[slot]) {
		memcpy(t->counts, fc, sizeof(int32_t) * E);
		t->fvalid[slot] = 0;
		return 0;
	}
	int rc = dec_route(m, &t->sh, w, &t->b, t->counts, t->hidx);
	t->n_routes++;
	if (!rc && !bwd)
		memcpy(fc, t->counts, sizeof(int32_t) * E), t->fvalid[slot] = 1;
	return rc;
}

/* Route, then pin only the experts that received tokens (and their LoRA). */
static int pin_experts(tier_trainer *t, int l, int grads, int bwd, dec_weights *w)
{
	tier_model *m = t->m;
	model_layer *ly = &m->layers[l];
	int E = m->E, rc = route_counts(t, l, bwd, w);
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
	/* the experts the schedule did not predict are all on their way before the first is waited for */
	for (int e = 0; e < E; e++)
		if (t->counts[e])
			tier_prefetch(m->s, ly->experts[e], TIER_HBM);
	for (int e = 0; e < E; e++) {
		if (!t->counts[e])
			continue;
		float *p, *g;
		if ((rc = trainer_pin(t, ly->experts[e], 0, 0, &p)))
			return rc;
		/* gate, up, down back to back, in the weights' element type */
		gate[e] = p, up[e] = (const float *)((const char *)p + m->wsz * I * H);
		down[e] = (const float *)((const char *)p + 2 * m->wsz * I * H);
		if (!w->has_elora)
			continue;
		if ((rc = pin_group(t, ly->exp[e], grads, &p, &g)))
			return rc;
		const void *sh = m->cuda ? lora_shadow(t, p, ly->exp[e]->n) : NULL;
		for (int j = 0; j < 3; j++) {
			tier_lora_ref r;
			lora_ref(t, ly->exp[e], j, p, sh, g, &r);
			((const float **)lo[j]->a)[e] = r.a, ((const float **)lo[j]->b)[e] = r.b;
			((float **)lo[j]->da)[e] = r.da, ((float **)lo[j]->db)[e] = r.db;
		}
	}
	return lora_convert(t);
}

/* The attention itself, or in a backward's recompute its output from the op cache when kept
 * there alone (train_cache.c's OP_CORE); a training forward offers it. */
static int attn_core(tier_trainer *t, int l, int bwd)
{
	int rc = 0;
	if (bwd && trainer_cache_restore_core(t, l, &rc))
		return 0;
	if (rc || (rc = dec_attn_fwd_core(t->m, &t->sh, &t->b)))
		return rc;
	return bwd ? 0 : trainer_cache_offer_core(t, l);
}

/* Forward of layer l from its input x into out (NULL: the backward's recompute, which makes only
 * the state the backward reads, each half taken from the operator cache when it kept it). */
static int layer_fwd(tier_trainer *t, int l, int grads, const float *x, float *out, dec_weights *w)
{
	tier_model *m = t->m;
	int rc = pin_dense(t, l, grads, w), bwd = out == NULL;
	if (!(bwd && trainer_cache_restore(t, l, 0, &rc)) && !rc && !(rc = dec_attn_fwd_in(m, &t->sh, x, w, &t->b)) &&
	    !(rc = attn_core(t, l, bwd)))
		rc = dec_attn_fwd_out(m, &t->sh, x, w, &t->b);
	if (rc)
		return rc;
	trainer_charge(t, TIER_PART_ATTN_FWD);
	if (m->layers[l].moe && (rc = pin_experts(t, l, grads, bwd, w)))
		return rc;
	trainer_charge(t, TIER_PART_ROUTE);
	if (bwd && !dec_mlp_recompute(&t->sh, m->layers[l].moe))
		return rc; /* MoE chunks: the backward runs each chunk's forward before its backward */
	if (bwd && trainer_cache_restore(t, l, 1, &rc)) {
		/* what that forward wrote into the state kept; h too where the state holds it
		 * (dec_shape.keep_h), not where the forward left it in the workspace (gone since) */
		t->b.ms.kept = t->mkept[mb_slot(t, l)] & (t->b.ms.kept_h ? ~0 : ~TIER_MOE_KEPT_H);
	} else if (!rc) {
		rc = dec_mlp_fwd(m, &t->sh, m->layers[l].moe, w, &t->b, out); /* NULL: the state only */
		t->mkept[mb_slot(t, l)] = (uint8_t)t->b.ms.kept;
	}
	trainer_charge(t, TIER_PART_MLP_FWD);
	return rc;
}


/* Host values of n int32 for the device: the array itself on the CPU, a copy in `dev` on CUDA. */
static int to_dev_ints(tier_trainer *t, const int32_t *h, int32_t *dev, size_t n, const int32_t **out)
{
	*out = h;
	if (!t->m->cuda)
		return 0;
	*out = dev;
	/* queued, not waited for: a synchronous copy here drained the stream twice a micro-batch (the
	 * tokens, then the labels before the loss), and the host queued the next work from empty */
	return tier_dev_put_async(t->m->dev, dev, h, sizeof(int32_t) * n);
}

/* Copy n activations at src (fp32, or bf16 when is_act on CUDA) to the host as fp32. */
static int get_f32(tier_trainer *t, float *dst, const void *src, size_t n, int is_act)
{
	if (!is_act || !t->m->cuda)
		return core_get(t->m, dst, src, sizeof(float) * n);
	uint16_t *h = (uint16_t *)dst + n; /* the upper half of dst holds the bf16 values first: converted
					     * in ascending order, each float lands below the values still unread */
	int rc = core_get(t->m, h, src, 2 * n);
	return rc ? rc : tier_dtype_convert(dst, TIER_DT_F32, h, TIER_DT_BF16, n);
}

/* Each operation: a body per micro-batch (pins and kernels), trainer_op_end, then a post per
 * micro-batch (what is written down or dropped once the kernels are done). The layer-major step
 * runs the bodies of every micro-batch in one operation (step_layer_major). */

/* Micro-batch mb's layer inputs (t->ck) and dropout masks; the layer-major step also keeps each
 * micro-batch's running gradient in the scratch (t->gmb). */
static void use_mb(tier_trainer *t, int mb)
{
	t->mb = (uint32_t)mb;
	t->ck = t->ckpt + (size_t)(t->nck > 1 ? mb : 0) * (t->m->L + 1);
}

static int embed_body(tier_trainer *t, const int32_t *tokens)
{
	float *e, *x;
	const int32_t *tok;
	int rc = trainer_pin(t, t->m->embed, 0, 0, &e);
	if (!rc && !(rc = trainer_pin(t, t->ck[0], TIER_ACQ_INIT, 1, &x)) &&
	    !(rc = to_dev_ints(t, tokens, t->tok_d, (size_t)t->sh.T, &tok))) {
		float *x32 = t->m->cuda ? t->gnext : x;
		rc = t->m->cuda ? opsc_embed_fwd(t->m->dev, t->sh.T, t->m->V, t->m->H, tok, (const opsc_bf16 *)e, x32)
				: tier_embed_fwd(t->m->dev, t->sh.T, t->m->V, t->m->H, tok, e, x32);
		rc = rc ? rc : dop_to_act(t->m, (size_t)t->sh.T * t->m->H, x32, x);
	}
	return rc;
}

static int op_embed(tier_trainer *t, const int32_t *tokens)
{
	trainer_at_op(t);
	int rc = trainer_op_close(t, embed_body(t, tokens), POST_NONE, 0, (int)t->mb, (int)t->mb + 1, -1);
	trainer_charge(t, TIER_PART_EMBED);
	return rc;
}

static int fwd_body(tier_trainer *t, int l, float *hidden)
{
	float *x, *y;
	dec_weights w;
	size_t n = (size_t)t->sh.T * t->m->H;
	int rc = trainer_pin(t, t->ck[l], 0, 0, &x);
	if (!rc && t->offer)
		rc = trainer_cache_reserve(t, l);
	if (!rc && !(rc = trainer_pin(t, t->ck[l + 1], TIER_ACQ_INIT, 1, &y))) {
		float *x32, *y32 = t->m->cuda ? t->gnext : y; /* the output's fp32 values, then y's type */
		if (!(rc = input_f32(t, x, t->hn, &x32)) && !(rc = layer_fwd(t, l, 0, x32, y32, &w)))
			rc = dop_to_act(t->m, n, y32, y);
	}
	if (!rc && t->offer)
		rc = trainer_cache_offer(t, l);
	trainer_cache_unplace(t);
	if (!rc && t->m->layers[l].moe) /* forwards only: the backward's recompute takes the same counts */
		for (int e = 0; e < t->m->E; e++) {
			size_t i = (size_t)l * t->m->E + e;
			t->lcounts[i] += t->counts[e];
			if (t->nck > 1 && t->mb > 0) { /* layer-major: the operation's micro-batches together */
				t->mbcounts[i] += t->counts[e];
				continue;
			}
			t->prevcounts[i] = t->mbcounts[i];
			t->mbcounts[i] = t->counts[e];
		}
	if (!rc && hidden)
		rc = get_f32(t, hidden, y, n, 1);
	return rc;
}

static int op_fwd(tier_trainer *t, int l, float *hidden)
{
	trainer_at_op(t);
	int rc = trainer_op_close(t, fwd_body(t, l, hidden), POST_FWD, l, (int)t->mb, (int)t->mb + 1, -1);
	trainer_charge(t, TIER_PART_MLP_FWD);
	return rc;
}

/* Final norm and the loss; t->gcur gets d loss / d (last layer output). */
static int loss_body(tier_trainer *t, const int32_t *labels, float dloss, int grads, float *loss, float *hidden)
{
	tier_model *m = t->m;
	float *nw, *W, *x, *lossp = m->cuda ? t->loss_d : loss;
	int64_t count, *countp = m->cuda ? t->count_d : &count;
	const int32_t *lab;
	int T = t->sh.T, rc;
	if ((rc = trainer_pin(t, m->norm, 0, 0, &nw)) || (rc = trainer_pin(t, m->lm_head, 0, 0, &W)) ||
	    (rc = trainer_pin(t, t->ck[m->L], 0, 0, &x)) || (rc = to_dev_ints(t, labels, t->lab_d, (size_t)T, &lab)))
		return rc;
	float *x32;
	if ((rc = input_f32(t, x, t->gnext, &x32)) || (rc = dop_norm(m, T, m->H, x32, nw, t->hn, t->b.r1)))
		return rc;
	if (hidden && (rc = get_f32(t, hidden, t->hn, (size_t)T * m->H, 1)))
		return rc;
	if (grads)
		rc = tier_loss_fwd_bwd(m->dev, &t->lp, t->hn, W, lab, dloss, t->lse, lossp, countp, t->b.dtmp, NULL,
				       t->lws, t->loss_ws);
	else
		rc = tier_loss_fwd(m->dev, &t->lp, t->hn, W, lab, t->lse, lossp, countp, t->lws, t->loss_ws);
	if (!rc && grads)
		rc = dop_norm_bwd(m, T, m->H, x32, nw, t->b.r1, t->b.dtmp, t->gcur);
	if (!rc && m->cuda)
		rc = core_get(m, loss, t->loss_d, sizeof *loss);
	return rc;
}

/* The loss waits for its kernels (the host reads the loss); without gradients it has no post. */
static int op_loss(tier_trainer *t, const int32_t *labels, float dloss, int grads, float *loss, float *hidden)
{
	trainer_at_op(t);
	int rc = trainer_op_close(t, loss_body(t, labels, dloss, grads, loss, hidden), grads ? POST_LOSS : POST_NONE,
				  0, (int)t->mb, (int)t->mb + 1, -1);
	trainer_charge(t, TIER_PART_LOSS);
	return rc;
}

/* Start writing layer l's final gradients down: the optimizer reads them after the whole
 * backward, by when HBM has turned over. */
static void layer_grads_writeback(tier_trainer *t, int l)
{
	tier_model *m = t->m;
	for (size_t i = 0; i < m->n_groups; i += m->groups[i].n_members)
		if (m->groups[i].layer == l && m->groups[i].zeroed)
			tier_writeback(m->s, m->groups[i].grad);
}

/* Layer l's backward from t->gcur into t->gnext, then the two swap. */
static int bwd_body(tier_trainer *t, int l, float d_aux)
{
	float *x;
	dec_weights w;
	if (t->cache && l > 0) /* the next layer's entries, if they spilled to DDR, come back meanwhile */
		tier_cache_prefetch_backward(t->cache, (uint32_t)l - 1, t->mb);
	int rc = trainer_cache_bwd_begin(t, l);
	if (!rc)
		rc = trainer_pin(t, t->ck[l], 0, 0, &x);
	if (!rc && !(rc = input_f32(t, x, t->hn, &x)) && !(rc = layer_fwd(t, l, 1, x, NULL, &w)) &&
	    !(rc = dec_mlp_bwd(t->m, &t->sh, t->m->layers[l].moe, &w, &t->b, t->gcur, d_aux))) {
		trainer_charge(t, TIER_PART_MLP_BWD);
		rc = dec_attn_bwd(t->m, &t->sh, x, &w, &t->b, t->gcur, t->gnext);
	}
	if (!rc) /* the attention's output for the slot after next, into the block this one used */
		rc = trainer_cache_bwd_end(t, l);
	trainer_cache_unplace(t);
	if (!rc && t->last_mb)
		rc = trainer_grads_done(t, l);
	float *s = t->gcur;
	t->gcur = t->gnext, t->gnext = s;
	return rc;
}

/* Micro-batch mb's layer inputs (the row of ckpt use_mb picks). */
static tier_object **ck_row(const tier_trainer *t, int mb)
{
	return t->ckpt + (size_t)(t->nck > 1 ? mb : 0) * (t->m->L + 1);
}

int trainer_post(tier_trainer *t, int post, int l, int mb0, int mb1, int last_at)
{
	int rc = 0;
	if (post == POST_OPTIM)
		return trainer_optim_post(t, (size_t)mb0, (size_t)mb1);
	for (int mb = mb0; mb < mb1 && !rc; mb++) {
		tier_object **ck = ck_row(t, mb);
		if (post == POST_FWD && t->spill) /* the layer's input, read again by its backward long
						   * after HBM has turned over (unpinned only now) */
			tier_writeback(t->m->s, ck[l]);
		else if (post == POST_LOSS) /* read by nothing after: dropped, so that no eviction or
					     * prefetch moves it */
			rc = tier_obj_discard(t->m->s, ck[t->m->L]);
		else if (post == POST_BWD) { /* the layer's input is spent; its gradients are final after
					      * the last micro-batch */
			rc = tier_obj_discard(t->m->s, ck[l]);
			if (!rc && t->spill && mb == last_at)
				layer_grads_writeback(t, l);
		}
	}
	return rc;
}

static int op_bwd(tier_trainer *t, int l, float d_aux)
{
	trainer_at_op(t);
	int rc = trainer_op_close(t, bwd_body(t, l, d_aux), POST_BWD, l, (int)t->mb, (int)t->mb + 1,
				  t->last_mb ? (int)t->mb : -1);
	trainer_charge(t, TIER_PART_ATTN_BWD);
	return rc;
}

/* One micro-batch forward (and backward when grads); *aux gets the router losses added. */
static int micro(tier_trainer *t, const int32_t *tok, const int32_t *lab, float dloss, int grads, float *loss,
		 float *aux, float *hidden)
{
	tier_model *m = t->m;
	size_t th = (size_t)t->sh.T * m->H;
	t->offer = grads && t->cache;
	use_mb(t, (int)t->mb);
	int rc = op_embed(t, tok);
	if (!rc && hidden) {
		float *x;
		if (!(rc = trainer_pin(t, t->ck[0], 0, 0, &x)))
			rc = get_f32(t, hidden, x, th, 1);
		rc = trainer_op_end(t, rc);
	}
	for (int l = 0; l < m->L && !rc; l++) {
		if (t->mb == 0) /* the step's first forward of the layer: its last update when deferred */
			rc = trainer_optim_due(t, l);
		rc = rc ? rc : op_fwd(t, l, hidden ? hidden + (l + 1) * th : NULL);
		if (m->layers[l].moe)
			*aux += t->b.ms.aux + t->b.ms.z;
	}
	if (!rc && grads && m->E > 0 && t->sched_routed) { /* the backward's experts are known now */
		t->have_mbcounts = 1;
		rc = trainer_set_schedule(t);
	}
	if (!rc)
		rc = op_loss(t, lab, dloss, grads, loss, hidden ? hidden + (m->L + 1) * th : NULL);
	if (!rc && grads)
		rc = trainer_cache_core_drop(t); /* the backward's slots from the first */
	for (int l = m->L - 1; l >= 0 && !rc && grads; l--)
		rc = op_bwd(t, l, dloss);
	int r2 = trainer_cache_core_drop(t); /* pending only after a failure */
	return trainer_op_end(t, rc ? rc : r2); /* what follows pins the same objects and reads results */
}

/* Micro-batch mb's running gradient in a layer-major step (th-aligned rows of the scratch). */
static float *gmb_of(const tier_trainer *t, int mb)
{
	return (float *)((char *)t->gmb + (size_t)mb * t->th);
}

/* A training step's forward and backward, layer-major (tier_train_cfg.layer_major): each
 * operation runs the body of every micro-batch, its weights pinned once. *loss_sum and *aux get
 * the micro-batches' losses and router losses added. */
static int step_layer_major(tier_trainer *t, const int32_t *tok, const int32_t *lab, float dloss, float *loss_sum,
			    float *aux)
{
	tier_model *m = t->m;
	int nm = t->c.micro_batches, rc = 0;
	size_t T = (size_t)t->sh.T;
	t->offer = t->cache != NULL, t->training = 1;
	trainer_at_op(t);
	for (int mb = 0; mb < nm && !rc; mb++)
		use_mb(t, mb), rc = embed_body(t, tok + mb * T);
	rc = trainer_op_close(t, rc, POST_NONE, 0, 0, nm, -1);
	trainer_charge(t, TIER_PART_EMBED);
	for (int l = 0; l < m->L && !rc; l++) {
		if ((rc = trainer_optim_due(t, l))) /* its last update when deferred */
			break;
		trainer_at_op(t);
		for (int mb = 0; mb < nm && !rc; mb++) {
			use_mb(t, mb);
			if (!(rc = fwd_body(t, l, NULL)) && m->layers[l].moe)
				*aux += t->b.ms.aux + t->b.ms.z;
			trainer_charge(t, TIER_PART_MLP_FWD); /* before the next micro-batch's attention */
		}
		rc = trainer_op_close(t, rc, POST_FWD, l, 0, nm, -1);
		trainer_charge(t, TIER_PART_MLP_FWD);
	}
	if (!rc && m->E > 0 && t->sched_routed) { /* the backward's experts are known now */
		t->have_mbcounts = 1;
		rc = trainer_set_schedule(t);
	}
	trainer_at_op(t);
	for (int mb = 0; mb < nm && !rc; mb++) { /* each loss gradient straight into its running gradient */
		float l = 0.0f;
		use_mb(t, mb);
		t->gcur = gmb_of(t, mb), t->gnext = t->g1;
		rc = loss_body(t, lab + mb * T, dloss, 1, &l, NULL);
		*loss_sum += l;
	}
	rc = trainer_op_close(t, rc, POST_LOSS, 0, 0, nm, -1);
	trainer_charge(t, TIER_PART_LOSS);
	if (!rc)
		rc = trainer_cache_core_drop(t); /* the backward's slots from the first */
	for (int l = m->L - 1; l >= 0 && !rc; l--) {
		trainer_at_op(t);
		for (int mb = 0; mb < nm && !rc; mb++) {
			use_mb(t, mb);
			t->last_mb = mb == nm - 1;
			t->gcur = gmb_of(t, mb), t->gnext = t->g1; /* the body leaves dx in g1, then swaps */
			if (!(rc = bwd_body(t, l, dloss)))
				rc = dop_copy(m, gmb_of(t, mb), t->g1, sizeof(float) * T * m->H);
			trainer_charge(t, TIER_PART_ATTN_BWD);
		}
		rc = trainer_op_close(t, rc, POST_BWD, l, 0, nm, nm - 1);
		trainer_charge(t, TIER_PART_ATTN_BWD);
	}
	t->gcur = t->g0, t->gnext = t->g1, t->training = 0;
	int r2 = trainer_cache_core_drop(t); /* pending only after a failure */
	return trainer_op_end(t, rc ? rc : r2);
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
	t->m->grads_spent = 0;
	for (size_t i = 0; i < t->m->n_groups; i++)
		t->m->groups[i].touched = 0, t->m->groups[i].zeroed = 0;
}

/* The end of a step's timing: the parts on the device's clock replace the host's, which say only
 * where the host waited (it queues kernels and blocks later, wherever a result is first needed).
 * PIN stays host time: it is the host's own waiting. After a failed step (whose message must
 * stand) or failed marks the host's times stand; r->parts_on_device says which. */
static void step_parts(tier_trainer *t, int rc, tier_step_result *r)
{
	int was = t->marking;
	t->marking = 0;
	uint64_t dev[TIER_NPARTS] = { 0 };
	if (!was || rc || tier_marks_collect(t->marks, dev, TIER_NPARTS))
		return;
	for (int p = 0; p < TIER_NPARTS; p++)
		if (p != TIER_PART_PIN)
			t->part[p] = dev[p];
	r->parts_on_device = 1;
}

/* What a step and an evaluation start with: the op cache's entries of an earlier failed pass, the
 * expert counts and the LoRA gradients cleared, the schedule at its first operation, the scratch
 * acquired (released again should that fail). */
static int pass_begin(tier_trainer *t)
{
	if (t->cache) /* entries a failed step left behind must not stand in for this pass's */
		tier_cache_end_microbatch(t->cache, UINT32_MAX);
	memset(t->core_kept, 0, (size_t)t->c.micro_batches * t->m->L);
	memset(t->lcounts, 0, sizeof *t->lcounts * (size_t)t->m->L * (t->m->E > 0 ? t->m->E : 1));
	zero_grads(t);
	t->op = 0;
	int rc = scratch_begin(t);
	if (rc)
		scratch_end(t, 0);
	return rc;
}

/* A step's start: its timing zeroed (and the device marks' origin put), then pass_begin. */
static int step_begin(tier_trainer *t)
{
	memset(t->part, 0, sizeof t->part);
	memset(t->pin_part, 0, sizeof t->pin_part);
	t->pin_since = 0;
	t->mark = tier_now_ns();
	if (t->marks) { /* the step's origin */
		tier_marks_begin(t->marks);
		tier_marks_put(t->marks, -1);
		t->marking = 1;
	}
	int rc = pass_begin(t);
	if (rc)
		t->marking = 0;
	return rc;
}

/* A step's forward and backward over its micro-batches, in the default order or layer-major. */
static int step_passes(tier_trainer *t, const int32_t *tokens, const int32_t *labels, float *loss_sum, float *aux)
{
	size_t T = (size_t)t->sh.T;
	int nm = t->c.micro_batches, rc = 0;
	float dloss = 1.0f / (float)nm;
	if (t->nck > 1)
		return step_layer_major(t, tokens, labels, dloss, loss_sum, aux);
	for (int mb = 0; mb < nm && !rc; mb++) {
		float l = 0.0f;
		t->mb = (uint32_t)mb, t->training = 1, t->last_mb = mb == nm - 1;
		rc = micro(t, tokens + mb * T, labels + mb * T, dloss, 1, &l, aux, NULL);
		t->training = 0;
		*loss_sum += l;
	}
	return rc;
}

/* The routed MoE blocks' check (tier_moe_routing_check): whether a backward's recompute routed as
 * its forward did, which a wrong gradient would otherwise hide. Only where there are routed
 * blocks; it clears what it reports, so a failure is never blamed on a later pass. */
static int routing_check(tier_trainer *t)
{
	return t->sh.routed && t->m->E > 0 ? tier_moe_routing_check(t->m->dev) : 0;
}

/* A step's end: the gradient norm, the routed MoE blocks' check, the scratch released (kept when
 * the budget allows), AdamW with clipping, the time by part into r. */
static int step_end(tier_trainer *t, int rc, double *norm, float *lr, tier_step_result *r)
{
	if (!rc)
		rc = trainer_grad_norm(t, norm);
	int rk = routing_check(t); /* before any update; cleared even when the step failed otherwise */
	rc = rc ? rc : rk;
	int r2 = scratch_end(t, !rc && t->scratch_keep); /* else its room goes to the LoRA state */
	rc = rc ? rc : r2;
	*lr = trainer_lr_at(&t->c, t->step);
	float gs = t->c.clip > 0 && *norm > t->c.clip ? (float)(t->c.clip / (*norm + 1e-6)) : 1.0f;
	if (!rc) /* now, announcing its operations, one per layer; or due before each layer's next use */
		rc = trainer_optim_step(t, *lr, gs);
	trainer_charge(t, TIER_PART_OPTIM);
	step_parts(t, rc, r);
	memcpy(r->ns_part, t->part, sizeof r->ns_part);
	memcpy(r->ns_pin_part, t->pin_part, sizeof r->ns_pin_part);
	return rc;
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
	memset(r, 0, sizeof *r);
	t->n_piped = t->n_early = t->n_routes = t->n_deferred = 0;
	if ((rc = step_begin(t)))
		return rc;
	float loss_sum = 0.0f, lr = 0.0f;
	double norm = 0.0;
	rc = step_passes(t, tokens, labels, &loss_sum, &r->aux);
	if ((rc = step_end(t, rc, &norm, &lr, r)))
		return rc;
	tier_store_step(t->m->s);
	t->step++;
	r->loss = loss_sum / (float)nm, r->aux /= (float)nm, r->grad_norm = (float)norm, r->lr = lr;
	r->loss += r->aux;
	for (size_t i = 0; i < T * nm; i++)
		r->tokens += labels[i] != t->lp.ignore_index;
	r->ns = tier_now_ns() - t0;
	r->ops_pipelined = t->n_piped, r->ops_finished_early = t->n_early, r->routes = t->n_routes;
	r->updates_in_forward = t->n_deferred;
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
	float aux = 0.0f;
	if ((rc = trainer_optim_settle(t)) || (rc = pass_begin(t))) /* on the weights the last step left */
		return rc;
	t->mb = 0, t->last_mb = 1;
	rc = micro(t, tokens, labels, 1.0f, grads, loss, &aux, hidden);
	int rk = routing_check(t); /* the gradients' backward recomputed its routing */
	rc = rc ? rc : rk;
	int r2 = scratch_end(t, !rc && t->scratch_keep);
	*loss += aux;
	return rc ? rc : r2;
}
