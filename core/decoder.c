/* decoder.c - one qwen3_moe decoder layer as HF's Qwen3MoeDecoderLayer computes it:
 *   a = norm1(x); q, k, v = a Wq^T, a Wk^T, a Wv^T (+LoRA); q, k = q_norm, k_norm per head;
 *   RoPE; o = attention; h1 = x + o Wo^T (+LoRA); b = norm2(h1); out = h1 + MoE(b) or MLP(b)
 * and its explicit backward, over buffers that the forward fills and the backward reads. */
#include "config.h"
#include <errno.h>
#include <string.h>
#include "core/decoder.h"
#include "core/dec_ops.h"
#include "core/ops_cuda.h"

#define AL 64
static size_t al(size_t n) { return (n + AL - 1) / AL * AL; }

/* The experts' adapters as the MoE block's sizes read them: rank r on each projection some layer's
 * experts adapt (only rank and a, b being set are read). */
static void expert_lora_shape(const tier_model *m, tier_moe_loras *lo)
{
	static const float *const dummy[1] = { NULL };
	tier_moe_lora *q[3] = { &lo->gate, &lo->up, &lo->down };
	memset(lo, 0, sizeof *lo);
	for (int l = 0; l < m->L; l++) {
		const lora_group *g = m->layers[l].exp ? m->layers[l].exp[0] : NULL;
		for (int p = 0; g && p < 3; p++)
			if (g->idx[p] >= 0)
				*q[p] = (tier_moe_lora){ .a = dummy, .b = dummy, .rank = m->lora.r };
	}
}

int dec_shape_init(const tier_model *m, int batch, int seq, int moe_chunks, dec_shape *sh)
{
	memset(sh, 0, sizeof *sh);
	if (batch < 1 || seq < 1 || (int64_t)batch * seq > (1 << 24))
		return tier_fail(-EINVAL, "batch %d x seq %d: both must be >= 1 and the product at most 2^24", batch, seq);
	sh->T = batch * seq, sh->batch = batch, sh->seq = seq;
	sh->mchunks = moe_chunks > 1 ? moe_chunks : 1;
	if (moe_chunks < 0 || sh->T % sh->mchunks)
		return tier_fail(-EINVAL, "MoE chunks %d (--moe-chunks): the micro-batch's %d tokens (batch %d x seq %d) must divide by it",
				 moe_chunks, sh->T, batch, seq);
	sh->mT = sh->T / sh->mchunks;
	sh->moe.router.kind = m->mixtral ? TIER_MOE_ROUTER_TOPK_SOFTMAX : TIER_MOE_ROUTER_SOFTMAX_TOPK;
	sh->moe.router.n_experts = m->E > 0 ? m->E : 1;
	sh->moe.router.top_k = m->k > 0 ? m->k : 1;
	sh->moe.router.norm_topk_prob = m->cfg.norm_topk_prob;
	sh->moe.hidden = m->H;
	sh->moe.inter = m->Ie > 0 ? m->Ie : 1;
	sh->moe.aux_coef = m->cfg.output_router_logits ? (float)m->cfg.router_aux_loss_coef : 0.0f;
	sh->moe.dtype = m->cuda ? TIER_MOE_BF16 : TIER_MOE_F32;
	if (sh->mchunks > 1 && m->E > 0 && (sh->moe.aux_coef != 0.0f || sh->moe.z_coef != 0.0f ||
					     sh->moe.capacity_factor > 0.0f))
		return tier_fail(-EINVAL, "MoE chunks %d (--moe-chunks): the router's aux loss (output_router_logits), z-loss or capacity "
				 "limit depends on every token of the micro-batch; use 1 chunk or turn them off",
				 sh->mchunks);
	expert_lora_shape(m, &sh->elora);
	tier_attn_params_init(&sh->ap, batch, seq, m->nh, m->nkv, m->hd);
	sh->rq = (tier_rope_params){ .tokens = sh->T, .seq = seq, .n_heads = m->nh, .head_dim = m->hd, .theta = m->theta };
	sh->rk = sh->rq;
	sh->rk.n_heads = m->nkv;
	return 0;
}

static int any_moe(const tier_model *m)
{
	for (int l = 0; l < m->L; l++)
		if (m->layers[l].moe)
			return 1;
	return 0;
}

static int any_dense(const tier_model *m)
{
	for (int l = 0; l < m->L; l++)
		if (!m->layers[l].moe)
			return 1;
	return 0;
}

/* The q, k and v projections as opsc_linear_bwd_cat's segments (w NULL: for sizes only, each
 * with an adapter of the model's rank where it has LoRA at all; lo holds those stand-ins). */
static void qkv_segs(const tier_model *m, const dec_weights *w, opsc_lin_seg s[3], tier_lora_ref lo[3])
{
	static const float dummy[1];
	static const int slot[3] = { W_Q, W_K, W_V }, pr[3] = { P_Q, P_K, P_V };
	for (int j = 0; j < 3; j++) {
		s[j].out = (j ? m->nkv : m->nh) * m->hd;
		s[j].w = (const opsc_bf16 *)(w ? w->w[slot[j]] : dummy);
		lo[j] = (tier_lora_ref){ .a = m->lora.r > 0 ? dummy : NULL, .b = dummy, .rank = m->lora.r };
		s[j].lora = w ? &w->lora[pr[j]] : &lo[j];
	}
}

/* The workspace of the one-product backward (dy bf16 [T, cols], then opsc_linear_bwd_cat's) or of
 * the forward's opsc_linear_fwd_cat, the larger. */
static size_t qkv_cat_ws(const tier_model *m, const dec_shape *sh)
{
	opsc_lin_seg s[3];
	tier_lora_ref lo[3];
	if (!sh->qkv_cat)
		return 0;
	qkv_segs(m, NULL, s, lo);
	size_t bwd = al((size_t)sh->T * opsc_linear_cat_cols(3, s) * 2) + opsc_linear_cat_ws_bytes(sh->T, m->H, 3, s);
	size_t fwd = opsc_linear_cat_fwd_ws_bytes(sh->T, m->H, 3, s);
	return bwd > fwd ? bwd : fwd;
}

typedef struct { float **p; size_t n, esz; } piece; /* esz 0: fp32 */

/* The pieces at *off on: at buf + *off, or at at + (*off - from) when at is set (a save half
 * placed elsewhere: dec_bufs_place). */
static void carve(const piece *f, size_t n, char *buf, size_t *off, char *at, size_t from)
{
	for (size_t i = 0; i < n; i++) {
		if (buf)
			*f[i].p = f[i].n ? (float *)(at ? at + (*off - from) : buf + *off) : NULL;
		*off += al((f[i].esz ? f[i].esz : sizeof(float)) * f[i].n);
	}
}

/* The sizes of every buffer, in the order dec_bufs_bind hands them out; `bind` NULL only counts.
 * Buffers that feed products (a, q, k, v, o, b, act, dO16) take the activation type (bf16 on
 * CUDA), the rest fp32. What the backward reads of the
 * forward comes first, in two contiguous halves (save[0]: attention, save[1]: MLP or MoE) that
 * the operator cache can keep instead of recomputing them; then the gradients, then the workspace. */
static size_t layout(const tier_model *m, const dec_shape *sh, char *buf, dec_bufs *b, char *const at[2])
{
	size_t T = (size_t)sh->T, H = m->H, qd = (size_t)m->nh * m->hd, kvd = (size_t)m->nkv * m->hd;
	size_t I = any_dense(m) ? (size_t)m->I : 0, off = 0, cu = m->cuda ? 1 : 0;
	size_t A = dop_act_size(m), P = sh->qkv16 ? A : 0; /* qp, kp: the projections' type */
	const piece fa[] = {
		{ &b->a, T * H, A }, { &b->r1, T, 0 }, { &b->qp, T * qd, P }, { &b->kp, T * kvd, P }, { &b->v, T * kvd, A },
		{ &b->rq, T * m->nh, 0 }, { &b->rk, T * m->nkv, 0 }, { &b->q, T * qd, A }, { &b->k, T * kvd, A },
		{ &b->o, T * qd, A }, { &b->lse, T * m->nh, 0 }, { &b->h1, T * H, 0 }, { &b->b, T * H, A }, { &b->r2, T, 0 },
	};
	const piece fm[] = { { &b->g, T * I, 0 }, { &b->u, T * I, 0 }, { &b->act, T * I, A } };
	const piece fg[] = {
		{ &b->mo, T * H, 0 }, { &b->dh1, T * H, 0 }, { &b->dtmp, T * H, 0 }, { &b->db, T * H, 0 },
		{ &b->dq, T * qd, 0 }, { &b->dk, T * kvd, 0 }, { &b->dv, T * kvd, 0 }, { &b->dO, T * qd, 0 },
		{ &b->dkp, T * kvd, 0 }, { &b->dact, T * I, 0 }, { &b->dg, T * I, 0 }, { &b->du, T * I, 0 },
		{ &b->v32, (sh->qkv16 ? 0 : cu) * T * kvd, 0 }, { &b->dO16, cu * T * qd, A },
		{ &b->o2, sh->core2 ? T * qd : 0, A }, { &b->lse2, sh->core2 ? T * m->nh : 0, 0 }, /* as o, lse */
	};
	carve(fa, sizeof fa / sizeof fa[0], buf, &off, at[0], 0);
	size_t mlp0 = off;
	carve(fm, sizeof fm / sizeof fm[0], buf, &off, at[1], mlp0);
	size_t dense_end = off; /* g, u, act: a dense layer's MLP half */
	/* with the adapters' Z the LoRA backward would make again (tier_moe_saved's kept_z) */
	size_t saved = any_moe(m) ? tier_moe_saved_bytes_keep(&sh->moe, sh->mT, &sh->elora, sh->keep_h) : 0;
	if (buf && saved) {
		char *ms = at[1] && sh->mchunks <= 1 ? at[1] + (off - mlp0) : buf + off;
		tier_moe_saved_bind_keep(&sh->moe, sh->mT, &sh->elora, sh->keep_h, ms, saved, &b->ms);
		/* a backward right after its recompute takes h from the workspace (train.c clears
		 * TIER_MOE_KEPT_H on a state the op cache gives back: other layers used it since) */
		b->ms.h_in_ws = m->cuda;
	}
	off += al(saved);
	/* in chunks, the MoE state holds the last chunk's only: the MLP half keeps g, u, act */
	b->save_bytes[0] = mlp0, b->save_bytes[1] = (sh->mchunks > 1 ? dense_end : off) - mlp0;
	if (buf) {
		b->save[0] = at[0] ? at[0] : buf;
		b->save[1] = at[1] ? at[1] : buf + mlp0;
		b->home = buf;
	}
	carve(fg, sizeof fg / sizeof fg[0], buf, &off, NULL, 0);
	/* one workspace for the largest user: the MoE block, attention, a LoRA linear */
	size_t ws = 0, aw = 0, out = H > qd ? H : qd, lw;
	out = out > I ? out : I;
	lw = dop_linear_ws(m, sh->T, (int)out, (int)out, m->lora.r); /* out: the largest of H, q dim, I */
	/* the MoE block's room for the adapters' Z and dZ: only the projections some layer's experts
	 * adapt (dec_shape.elora), none where the experts have no adapters */
	if (any_moe(m))
		ws = tier_moe_workspace_bytes(&sh->moe, sh->mT, &sh->elora);
	tier_attn_workspace_bytes(m->dev, &sh->ap, &aw);
	ws = ws > aw ? ws : aw;
	ws = ws > lw ? ws : lw;
	ws = ws > qkv_cat_ws(m, sh) ? ws : qkv_cat_ws(m, sh);
	if (buf) {
		b->ws = buf + off;
		b->ws_bytes = ws;
	}
	return off + al(ws);
}

size_t dec_bufs_save_bytes(const tier_model *m, const dec_shape *sh, size_t save[2])
{
	dec_bufs b;
	char *const none[2] = { NULL, NULL };
	size_t n = layout(m, sh, NULL, &b, none);
	if (save)
		save[0] = b.save_bytes[0], save[1] = b.save_bytes[1];
	return n;
}

void dec_bufs_bind(const tier_model *m, const dec_shape *sh, void *buf, dec_bufs *b)
{
	memset(b, 0, sizeof *b);
	char *const none[2] = { NULL, NULL };
	layout(m, sh, buf, b, none);
	b->o_home = b->o;
}

void dec_bufs_place(const tier_model *m, const dec_shape *sh, dec_bufs *b, int h, void *at)
{
	dec_bufs n;
	char *where[2] = { NULL, NULL };
	where[h] = at;
	memset(&n, 0, sizeof n);
	layout(m, sh, b->home, &n, where);
	if (h == 0) {
		float **dst[] = { &b->a, &b->r1, &b->qp, &b->kp, &b->v, &b->rq, &b->rk, &b->q, &b->k, &b->o, &b->lse,
				  &b->h1, &b->b, &b->r2 };
		float *src[] = { n.a, n.r1, n.qp, n.kp, n.v, n.rq, n.rk, n.q, n.k, n.o, n.lse, n.h1, n.b, n.r2 };
		for (size_t i = 0; i < sizeof src / sizeof src[0]; i++)
			*dst[i] = src[i];
	} else {
		float aux = b->ms.aux, z = b->ms.z; /* the forward's results, kept where the data moves */
		b->g = n.g, b->u = n.u, b->act = n.act, b->ms = n.ms;
		b->ms.aux = aux, b->ms.z = z;
	}
	b->save[h] = n.save[h];
}

/* Qwen3's per-head q/k RMSNorm and RoPE, q and k from their projections; Mixtral has no norm (q, k
 * are the projections, in the activations' type). On CUDA one kernel each (opsc_qk_fwd) unless
 * $TIER_QK_FUSED=0. */
static int qk_fwd(const tier_model *m, const dec_shape *sh, dec_bufs *b, const dec_weights *w)
{
	const void *wq = m->mixtral ? NULL : w->w[W_QN], *wk = m->mixtral ? NULL : w->w[W_KN];
	int rc = dop_qk_fwd(m, &sh->rq, b->qp, wq, b->q, b->rq, sh->qk_fused, sh->qkv16);
	return rc ? rc : dop_qk_fwd(m, &sh->rk, b->kp, wk, b->k, b->rk, sh->qk_fused, sh->qkv16);
}

/* The gradients of the q, k, v projections' outputs from the attention's (dq, dk, dv), back
 * through RoPE and the q/k norms, in the activations' type: on the CPU (fp32) d qp into b->dO
 * (free by then), d kp into b->dkp and dv as it is; on CUDA (bf16) d qp into b->dO16 (the
 * attention's backward has read it), d kp and dv in the two halves of b->dkp. The separate steps'
 * fp32 scratch ($TIER_QK_FUSED=0 on CUDA): b->dO for q, then b->dq (free once q's is done) for k. */
static int qkv_grads(const tier_model *m, const dec_shape *sh, dec_bufs *b, const dec_weights *w, void **gq,
		     void **gk, void **gv)
{
	size_t nkv = (size_t)sh->T * m->nkv * m->hd;
	const void *wq = m->mixtral ? NULL : w->w[W_QN], *wk = m->mixtral ? NULL : w->w[W_KN];
	*gq = m->cuda ? (void *)b->dO16 : (void *)b->dO;
	*gk = b->dkp;
	*gv = m->cuda ? (void *)((uint16_t *)b->dkp + nkv) : (void *)b->dv;
	int rc = dop_qk_grad(m, &sh->rq, b->dq, b->qp, wq, b->rq, *gq, 0, b->dO, sh->qk_fused, sh->qkv16);
	if (!rc)
		rc = dop_qk_grad(m, &sh->rk, b->dk, b->kp, wk, b->rk, *gk, 0, m->cuda ? b->dq : b->dkp, sh->qk_fused,
				 sh->qkv16);
	return rc ? rc : dop_to_act(m, nkv, b->dv, *gv);
}

/* dec_shape.qkv_cat: the q and k gradients (back through RoPE and their norms) and v's go into
 * one bf16 buffer at the workspace's start, row stride the three projections' and their adapters'
 * columns, and one product makes b->db (opsc_linear_bwd_cat): dx is written once, not by three
 * products each reading and writing it in fp32 with three adapter products besides. */
static int qkv_bwd_cat(const tier_model *m, const dec_shape *sh, dec_bufs *b, const dec_weights *w)
{
	int T = sh->T, qd = m->nh * m->hd, kvd = m->nkv * m->hd, rc;
	opsc_lin_seg s[3];
	tier_lora_ref lo[3];
	qkv_segs(m, w, s, lo);
	const int ld = opsc_linear_cat_cols(3, s);
	opsc_bf16 *dy = b->ws;
	void *cws = (char *)b->ws + al((size_t)T * ld * 2);
	const void *wq = m->mixtral ? NULL : w->w[W_QN], *wk = m->mixtral ? NULL : w->w[W_KN];
	if ((rc = dop_qk_grad(m, &sh->rq, b->dq, b->qp, wq, b->rq, dy, ld, NULL, sh->qk_fused, sh->qkv16)) ||
	    (rc = dop_qk_grad(m, &sh->rk, b->dk, b->kp, wk, b->rk, dy + qd, ld, NULL, sh->qk_fused, sh->qkv16)) ||
	    (rc = opsc_to_bf16_rows(m->dev, T, kvd, b->dv, dy + qd + kvd, ld)))
		return rc;
	return opsc_linear_bwd_cat(m->dev, T, m->H, (const opsc_bf16 *)b->a, 3, s, dy, ld, b->db, 0, cws);
}

int dec_attn_fwd_in(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b)
{
	int T = sh->T, H = m->H, qd = m->nh * m->hd, kvd = m->nkv * m->hd, rc;
	void *ws = b->ws;
	/* the v projection: bf16 straight into v under qkv16; else fp32, which attention reads as bf16 on
	 * CUDA (v32 -> v) and in place on the CPU */
	const int y16 = sh->qkv16;
	float *v32 = m->cuda && !y16 ? b->v32 : b->v;
	if ((rc = dop_norm(m, T, H, x, w->w[W_LN1], b->a, b->r1)))
		return rc;
	if (sh->qkv_fwd_cat) { /* every adapter's x A^T in one product */
		opsc_lin_seg s[3];
		tier_lora_ref lo[3];
		float *const y[3] = { b->qp, b->kp, v32 };
		qkv_segs(m, w, s, lo);
		rc = opsc_linear_fwd_cat(m->dev, T, H, (const opsc_bf16 *)b->a, 3, s, y, ws);
	} else if (!(rc = dop_linear_to(m, T, H, qd, b->a, w->w[W_Q], &w->lora[P_Q], b->qp, y16, ws)) &&
		   !(rc = dop_linear_to(m, T, H, kvd, b->a, w->w[W_K], &w->lora[P_K], b->kp, y16, ws)))
		rc = dop_linear_to(m, T, H, kvd, b->a, w->w[W_V], &w->lora[P_V], v32, y16, ws);
	if (rc || (!y16 && (rc = dop_to_act(m, (size_t)T * kvd, v32, b->v))))
		return rc;
	return qk_fwd(m, sh, b, w);
}

int dec_attn_fwd_core(const tier_model *m, const dec_shape *sh, dec_bufs *b)
{
	return tier_attn_fwd(m->dev, &sh->ap, b->q, b->k, b->v, b->o, b->lse, b->ws, b->ws_bytes);
}

int dec_attn_fwd_out(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b)
{
	int T = sh->T, H = m->H, qd = m->nh * m->hd, rc;
	/* h1 = x + o_proj(o): the residual in the product's epilogue (sh->attn_res), or an add after */
	if (sh->attn_res)
		rc = dop_linear_res(m, T, qd, H, b->o, w->w[W_O], &w->lora[P_O], x, b->h1, b->ws);
	else if (!(rc = dop_linear(m, T, qd, H, b->o, w->w[W_O], &w->lora[P_O], b->h1, b->ws)))
		rc = dop_add(m, (size_t)T * H, b->h1, x, b->h1);
	if (rc)
		return rc;
	return dop_norm(m, T, H, b->h1, w->w[W_LN2], b->b, b->r2);
}

int dec_attn_fwd(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b)
{
	int rc = dec_attn_fwd_in(m, sh, x, w, b);
	if (!rc)
		rc = dec_attn_fwd_core(m, sh, b);
	return rc ? rc : dec_attn_fwd_out(m, sh, x, w, b);
}

size_t dec_attn_core_bytes(const tier_model *m, const dec_shape *sh, size_t *lse_at)
{
	*lse_at = al((size_t)sh->T * m->nh * m->hd * dop_act_size(m)); /* layout's o piece */
	return *lse_at + sizeof(float) * (size_t)sh->T * m->nh;
}

void *dec_attn_core_home(const dec_bufs *b, int i)
{
	return i ? (void *)b->o2 : b->o_home; /* o2 is never placed elsewhere */
}

void dec_attn_core_place(const tier_model *m, const dec_shape *sh, dec_bufs *b, void *at)
{
	size_t lse_at;
	(void)dec_attn_core_bytes(m, sh, &lse_at);
	b->o = (float *)at, b->lse = (float *)((char *)at + lse_at);
}

/* Rows from row0 on of a [T, H] activation (bf16 on CUDA) or fp32 buffer: a MoE chunk's tokens. */
static const float *act_rows(const tier_model *m, const float *p, size_t row0)
{
	return (const float *)((const char *)p + row0 * (size_t)m->H * dop_act_size(m));
}

static float *f32_rows(const tier_model *m, float *p, size_t row0)
{
	return p + row0 * (size_t)m->H;
}

int dec_route(const tier_model *m, const dec_shape *sh, const dec_weights *w, dec_bufs *b, int32_t *counts,
	      int32_t *hidx)
{
	size_t n = (size_t)sh->mT * m->k;
	if (sh->routed)
		return tier_moe_layer_route(m->dev, &sh->moe, sh->T, b->b, w->w[W_ROUTER], NULL, &b->ms, b->ws, b->ws_bytes,
					    counts);
	memset(counts, 0, sizeof(int32_t) * (size_t)m->E);
	for (int c = 0; c < sh->mchunks; c++) { /* the saved state holds one chunk's routing */
		int rc = tier_moe_router_fwd(m->dev, &sh->moe.router, sh->mT, m->H, act_rows(m, b->b, (size_t)c * sh->mT),
					     w->w[W_ROUTER], NULL, b->ms.logits, b->ms.topk_idx, b->ms.topk_w);
		const int32_t *idx = b->ms.topk_idx;
		if (!rc && m->cuda) {
			rc = core_get(m, hidx, b->ms.topk_idx, sizeof(int32_t) * n);
			idx = hidx;
		}
		if (rc)
			return rc;
		for (size_t i = 0; i < n; i++)
			counts[idx[i]]++;
	}
	return 0;
}

/* The MoE block's forward over chunk c: its state into b->ms, and with out (not a backward's
 * recompute) its output rows there, res (NULL: none; routed only) added by its combine. Routed
 * (one chunk): a forward's dec_route has routed; a recompute routes again on the device, to the
 * forward's counts. */
static int moe_chunk_fwd(const tier_model *m, const dec_shape *sh, const dec_weights *w, dec_bufs *b, int c,
			 const float *res, float *out)
{
	int state_only = !out;
	size_t r0 = (size_t)c * sh->mT;
	if (sh->routed) {
		int rc = 0;
		if (!b->routed)
			return tier_fail(-EINVAL, "decoder: the routed MoE block has no counts (dec_bufs.routed)");
		if (state_only && (rc = tier_moe_layer_route(m->dev, &sh->moe, sh->T, b->b, w->w[W_ROUTER], NULL, &b->ms,
							     b->ws, b->ws_bytes, NULL)))
			return rc;
		return tier_moe_layer_fwd_routed_res(m->dev, &sh->moe, sh->T, b->b, &w->ex,
						     w->has_elora ? &w->elora : NULL, b->routed, res, out, &b->ms, b->ws,
						     b->ws_bytes);
	}
	return tier_moe_layer_fwd(m->dev, &sh->moe, sh->mT, act_rows(m, b->b, r0), w->w[W_ROUTER], NULL, &w->ex,
				  w->has_elora ? &w->elora : NULL, state_only ? NULL : f32_rows(m, out, r0), &b->ms,
				  b->ws, b->ws_bytes);
}

int dec_mlp_recompute(const dec_shape *sh, int moe)
{
	return !moe || sh->mchunks == 1;
}

int dec_mlp_fwd(const tier_model *m, const dec_shape *sh, int moe, const dec_weights *w, dec_bufs *b, float *out)
{
	int T = sh->T, H = m->H, I = m->I, rc = 0;
	if (moe && sh->routed && sh->moe_res) /* one chunk: out = h1 + MoE(b), the residual in the combine */
		return moe_chunk_fwd(m, sh, w, b, 0, out ? b->h1 : NULL, out);
	if (moe)
		for (int c = 0; c < sh->mchunks && !rc; c++)
			rc = moe_chunk_fwd(m, sh, w, b, c, NULL, out ? b->mo : NULL);
	else if (!(rc = dop_linear(m, T, H, I, b->b, w->w[W_GATE], &w->mlp[P_GATE], b->g, b->ws)) &&
		 !(rc = dop_linear(m, T, H, I, b->b, w->w[W_UP], &w->mlp[P_UP], b->u, b->ws)))
		rc = dop_swiglu(m, (size_t)T * I, b->g, b->u, b->act);
	if (rc || !out) /* the state only: what follows makes the output, which no backward reads */
		return rc;
	if (!moe && (rc = dop_linear(m, T, I, H, b->act, w->w[W_DOWN], &w->mlp[P_DOWN], b->mo, b->ws)))
		return rc;
	return dop_add(m, (size_t)T * H, b->h1, b->mo, out);
}

/* The MoE block's backward, chunk by chunk; in chunks each one's forward runs again first (the
 * saved state holds one chunk). */
static int moe_bwd(const tier_model *m, const dec_shape *sh, const dec_weights *w, dec_bufs *b, const float *dout,
		   float d_aux)
{
	int rc = 0;
	for (int c = 0; c < sh->mchunks && !rc; c++) {
		size_t r0 = (size_t)c * sh->mT;
		if (sh->routed)
			rc = tier_moe_layer_bwd_routed(m->dev, &sh->moe, sh->T, b->b, w->w[W_ROUTER], &w->ex,
						       w->has_elora ? &w->elora : NULL, &b->ms, b->routed, dout, d_aux,
						       b->db, NULL, b->ws, b->ws_bytes);
		else if (!(sh->mchunks > 1 && (rc = moe_chunk_fwd(m, sh, w, b, c, NULL, NULL))))
			rc = tier_moe_layer_bwd(m->dev, &sh->moe, sh->mT, act_rows(m, b->b, r0), w->w[W_ROUTER], &w->ex,
						w->has_elora ? &w->elora : NULL, &b->ms, dout + r0 * (size_t)m->H,
						d_aux, f32_rows(m, b->db, r0), NULL, b->ws, b->ws_bytes);
	}
	return rc;
}

/* Backward of the MLP half: b->db = d mlp / d b from dout. */
static int mlp_bwd(const tier_model *m, const dec_shape *sh, int moe, const dec_weights *w, dec_bufs *b,
		   const float *dout, float d_aux)
{
	int T = sh->T, H = m->H, I = m->I, rc;
	if (moe)
		return moe_bwd(m, sh, w, b, dout, d_aux);
	if ((rc = dop_linear_bwd(m, T, I, H, b->act, w->w[W_DOWN], &w->mlp[P_DOWN], dout, b->dact, 0, b->ws)) ||
	    (rc = dop_swiglu_bwd(m, (size_t)T * I, b->g, b->u, b->dact, b->dg, b->du)) ||
	    (rc = dop_linear_bwd(m, T, H, I, b->b, w->w[W_GATE], &w->mlp[P_GATE], b->dg, b->db, 0, b->ws)))
		return rc;
	return dop_linear_bwd(m, T, H, I, b->b, w->w[W_UP], &w->mlp[P_UP], b->du, b->db, 1, b->ws);
}

int dec_mlp_bwd(const tier_model *m, const dec_shape *sh, int moe, const dec_weights *w, dec_bufs *b,
		const float *dout, float d_aux)
{
	return mlp_bwd(m, sh, moe, w, b, dout, d_aux);
}

/* The q, k and v projections' backward a product each (the CPU; CUDA without dec_shape.qkv_cat):
 * b->db = their dx, from the attention's dq, dk, dv. */
static int qkv_bwd(const tier_model *m, const dec_shape *sh, dec_bufs *b, const dec_weights *w)
{
	int T = sh->T, H = m->H, qd = m->nh * m->hd, kvd = m->nkv * m->hd, rc;
	void *gq, *gk, *gv;
	if ((rc = qkv_grads(m, sh, b, w, &gq, &gk, &gv)) ||
	    (rc = dop_linear_bwd_act(m, T, H, qd, b->a, w->w[W_Q], &w->lora[P_Q], gq, b->db, 0, b->ws)) ||
	    (rc = dop_linear_bwd_act(m, T, H, kvd, b->a, w->w[W_K], &w->lora[P_K], gk, b->db, 1, b->ws)))
		return rc;
	return dop_linear_bwd_act(m, T, H, kvd, b->a, w->w[W_V], &w->lora[P_V], gv, b->db, 1, b->ws);
}

int dec_attn_bwd(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b,
		 const float *dout, float *dx)
{
	tier_dev *d = m->dev;
	int T = sh->T, H = m->H, qd = m->nh * m->hd, rc;
	/* attention's backward reads the gradient of o in bf16 on CUDA */
	float *dO16 = m->cuda ? b->dO16 : b->dO;
	if ((rc = dop_norm_bwd_add(m, T, H, b->h1, w->w[W_LN2], b->r2, b->db, dout, b->dh1, b->dtmp)) ||
	    (rc = dop_linear_bwd_to_act(m, T, qd, H, b->o, w->w[W_O], &w->lora[P_O], b->dh1, dO16, b->dO, b->ws)) ||
	    (rc = tier_attn_bwd(d, &sh->ap, b->q, b->k, b->v, b->o, b->lse, dO16, b->dq, b->dk, b->dv, b->ws,
				b->ws_bytes)) ||
	    (rc = sh->qkv_cat ? qkv_bwd_cat(m, sh, b, w) : qkv_bwd(m, sh, b, w)))
		return rc;
	return dop_norm_bwd_add(m, T, H, x, w->w[W_LN1], b->r1, b->db, b->dh1, dx, b->dtmp);
}

int dec_bwd(const tier_model *m, const dec_shape *sh, int moe, const float *x, const dec_weights *w, dec_bufs *b,
	    const float *dout, float d_aux, float *dx)
{
	int rc = dec_mlp_bwd(m, sh, moe, w, b, dout, d_aux);
	return rc ? rc : dec_attn_bwd(m, sh, x, w, b, dout, dx);
}
