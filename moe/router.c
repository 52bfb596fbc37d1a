/* router.c - MoE router: logits, the three top-k forms of real checkpoints, their backward, and the
 * auxiliary load-balancing and z losses. The formulas match Hugging Face transformers:
 *   Qwen3-MoE  (models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeSparseMoeBlock.forward): softmax over E
 *              in fp32, torch.topk, routing_weights /= sum when norm_topk_prob.
 *   Mixtral    (models/mixtral/modeling_mixtral.py): softmax then top-k then renormalise, which is the
 *              softmax over the k chosen logits computed here directly.
 *   DeepSeek-V3 (models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3TopkRouter / route_tokens_to_experts):
 *              sigmoid scores; scores_for_choice = scores + e_score_correction_bias; group score = sum of
 *              the top-2 of each group; keep topk_group groups; masked_fill(~mask, 0.0) (zero, not -inf,
 *              as HF does); top-k; weights = scores.gather(chosen), / (sum + 1e-20) when norm_topk_prob,
 *              * routed_scaling_factor.
 *   aux loss   (load_balancing_loss_func in the same files): one_hot(top-k).mean(0) summed over the k
 *              slots gives f_e = count_e / T; P_e = softmax(logits).mean(0); loss = E * sum f_e P_e,
 *              times router_aux_loss_coef in the model's forward. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

int tier_moe_router_check(const tier_moe_router_cfg *c)
{
	const char *fn = "tier_moe_router";
	if (!c)
		return tier_fail(-EINVAL, "%s: config is NULL", fn);
	int rc = moe_check_tk(fn, 1, c->top_k, c->n_experts);
	if (rc)
		return rc;
	if (c->kind < TIER_MOE_ROUTER_SOFTMAX_TOPK || c->kind > TIER_MOE_ROUTER_SIGMOID_GROUP)
		return tier_fail(-EINVAL, "%s: unknown router kind %d", fn, (int)c->kind);
	if (c->kind != TIER_MOE_ROUTER_SIGMOID_GROUP || c->n_group <= 1)
		return 0;
	int E = c->n_experts, G = c->n_group;
	if (E % G)
		return tier_fail(-EINVAL, "%s: n_group %d does not divide the %d experts; use a divisor of E", fn, G, E);
	if (c->topk_group < 1 || c->topk_group > G)
		return tier_fail(-EINVAL, "%s: topk_group %d must be 1..n_group (%d)", fn, c->topk_group, G);
	if (c->top_k > c->topk_group * (E / G))
		return tier_fail(-EINVAL, "%s: top_k %d exceeds the %d experts of the %d kept groups; raise topk_group",
				 fn, c->top_k, c->topk_group * (E / G), c->topk_group);
	if (!isfinite(c->routed_scaling_factor))
		return tier_fail(-EINVAL, "%s: routed_scaling_factor is not finite", fn);
	return 0;
}

static float rsf_of(const tier_moe_router_cfg *c)
{
	return c->routed_scaling_factor == 0.0f ? 1.0f : c->routed_scaling_factor;
}

/* p [E] = softmax(l); returns logsumexp(l). */
static float softmax_row(const float *l, int E, float *p)
{
	float m = l[0];
	for (int e = 1; e < E; e++)
		m = l[e] > m ? l[e] : m;
	double s = 0.0;
	for (int e = 0; e < E; e++)
		s += (p[e] = expf(l[e] - m));
	float inv = (float)(1.0 / s);
	for (int e = 0; e < E; e++)
		p[e] *= inv;
	return m + (float)log(s);
}

/* DeepSeek-V3 selection: group-limited top-k of c = sigmoid + bias. */
static void select_grouped(const tier_moe_router_cfg *c, const float *ch, int32_t *idx)
{
	int E = c->n_experts, k = c->top_k, G = c->n_group > 1 ? c->n_group : 1, gs = E / G, n = 0, ng = 0;
	int keep = G > 1 ? c->topk_group : 1;
	float vals[TIER_MOE_MAX_TOPK], gv[TIER_MOE_MAX_EXPERTS], masked[TIER_MOE_MAX_EXPERTS];
	int32_t gi[TIER_MOE_MAX_EXPERTS];
	char kept[TIER_MOE_MAX_EXPERTS];
	if (G > 1) {
		for (int g = 0; g < G; g++) { /* group score: sum of its top-2 (top-1 when groups of 1) */
			float tv[2] = { 0.0f, 0.0f };
			int32_t ti[2];
			int tn = 0;
			for (int e = g * gs; e < (g + 1) * gs; e++)
				moe_topk_push(tv, ti, &tn, gs < 2 ? 1 : 2, ch[e], e);
			float sc = tv[0] + (tn > 1 ? tv[1] : 0.0f);
			moe_topk_push(gv, gi, &ng, keep, sc, g);
		}
		memset(kept, 0, (size_t)G);
		for (int i = 0; i < keep; i++)
			kept[gi[i]] = 1;
	}
	for (int e = 0; e < E; e++)
		masked[e] = G > 1 && !kept[e / gs] ? 0.0f : ch[e];
	for (int e = 0; e < E; e++)
		moe_topk_push(vals, idx, &n, k, masked[e], e);
}

static void route_token(const tier_moe_router_cfg *c, const float *l, const float *bias, int32_t *idx, float *w)
{
	int E = c->n_experts, k = c->top_k, n = 0;
	float vals[TIER_MOE_MAX_TOPK], p[TIER_MOE_MAX_EXPERTS];
	if (c->kind == TIER_MOE_ROUTER_SIGMOID_GROUP) {
		for (int e = 0; e < E; e++)
			p[e] = moe_sigmoid(l[e]) + (bias ? bias[e] : 0.0f);
		select_grouped(c, p, idx);
		double s = 0.0;
		for (int j = 0; j < k; j++)
			s += (w[j] = moe_sigmoid(l[idx[j]]));
		float scale = rsf_of(c) / (c->norm_topk_prob ? (float)(s + 1e-20) : 1.0f);
		for (int j = 0; j < k; j++)
			w[j] *= scale;
		return;
	}
	for (int e = 0; e < E; e++) /* selection on logits: the same order as on softmax probabilities */
		moe_topk_push(vals, idx, &n, k, l[e], e);
	float m = vals[0];
	double s = 0.0, all = 0.0;
	for (int j = 0; j < k; j++)
		s += (w[j] = expf(vals[j] - m));
	if (c->kind == TIER_MOE_ROUTER_SOFTMAX_TOPK && !c->norm_topk_prob) {
		for (int e = 0; e < E; e++)
			all += expf(l[e] - m);
		s = all;
	}
	for (int j = 0; j < k; j++)
		w[j] = (float)(w[j] / s);
}

int tier_moe_router_fwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, int H, const float *x,
			const float *w_r, const float *bias, float *logits, int32_t *topk_idx, float *topk_w)
{
	const char *fn = "tier_moe_router_fwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_router_fwd(dev, cfg, T, H, x, w_r, bias, logits, topk_idx, topk_w));
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = tier_moe_router_check(cfg)) || (rc = moe_check_tk(fn, T, cfg->top_k, cfg->n_experts)) ||
	    (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(topk_w, fn);
	int E = cfg->n_experts, k = cfg->top_k;
	moe_gemm(0, 1, T, E, H, 1.0f, x, H, w_r, H, 0.0f, logits, E);
	for (int t = 0; t < T; t++)
		route_token(cfg, logits + (size_t)t * E, bias, topk_idx + (size_t)t * k, topk_w + (size_t)t * k);
	return 0;
}

/* d logits of one token from d w, the selection fixed. */
static void route_token_bwd(const tier_moe_router_cfg *c, const float *l, const int32_t *idx, const float *dw,
			    float *dl)
{
	int E = c->n_experts, k = c->top_k;
	float p[TIER_MOE_MAX_EXPERTS], w[TIER_MOE_MAX_TOPK];
	double dot = 0.0;
	memset(dl, 0, sizeof(float) * (size_t)E);
	if (c->kind == TIER_MOE_ROUTER_SIGMOID_GROUP) {
		/* w_j = r s_j / D, D = sum s + 1e-20 (norm) or 1: ds_j = r (dw_j - sum_i dw_i w_i / r) / D */
		double D = c->norm_topk_prob ? 1e-20 : 1.0, r = rsf_of(c);
		for (int j = 0; j < k; j++)
			D += c->norm_topk_prob ? moe_sigmoid(l[idx[j]]) : 0.0;
		for (int j = 0; j < k; j++)
			dot += c->norm_topk_prob ? dw[j] * moe_sigmoid(l[idx[j]]) / D : 0.0;
		for (int j = 0; j < k; j++) {
			float s = moe_sigmoid(l[idx[j]]);
			dl[idx[j]] += (float)(r * (dw[j] - dot) / D) * s * (1.0f - s);
		}
		return;
	}
	if (c->kind == TIER_MOE_ROUTER_TOPK_SOFTMAX || c->norm_topk_prob) {
		/* softmax over the chosen (renormalised Qwen is the same function): dl = w (dw - w.dw) */
		float m = l[idx[0]];
		double s = 0.0;
		for (int j = 0; j < k; j++)
			s += (w[j] = expf(l[idx[j]] - m));
		for (int j = 0; j < k; j++)
			dot += dw[j] * (w[j] /= (float)s);
		for (int j = 0; j < k; j++)
			dl[idx[j]] += w[j] * (float)(dw[j] - dot);
		return;
	}
	softmax_row(l, E, p); /* w_j = p_{idx j}: dl_e = p_e (dp_e - sum_j p_{idx j} dw_j) */
	for (int j = 0; j < k; j++)
		dot += (double)p[idx[j]] * dw[j];
	for (int e = 0; e < E; e++)
		dl[e] = -p[e] * (float)dot;
	for (int j = 0; j < k; j++)
		dl[idx[j]] += p[idx[j]] * dw[j];
}

int tier_moe_router_weights_bwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, const float *logits,
				const int32_t *topk_idx, const float *d_topk_w, float *d_logits)
{
	const char *fn = "tier_moe_router_weights_bwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_router_bwd(dev, cfg, T, logits, topk_idx, d_topk_w, NULL, 0.0f, 0.0f, 0.0f, d_logits, NULL));
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = tier_moe_router_check(cfg)) || (rc = moe_check_tk(fn, T, cfg->top_k, cfg->n_experts)))
		return rc;
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(d_topk_w, fn);
	MOE_NONNULL(d_logits, fn);
	int E = cfg->n_experts, k = cfg->top_k;
	for (int t = 0; t < T; t++)
		route_token_bwd(cfg, logits + (size_t)t * E, topk_idx + (size_t)t * k, d_topk_w + (size_t)t * k,
				d_logits + (size_t)t * E);
	return 0;
}

int tier_moe_router_linear_bwd(tier_dev *dev, int T, int H, int E, const float *x, const float *w_r,
			       const float *d_logits, float *dx, float *dw_r)
{
	const char *fn = "tier_moe_router_linear_bwd";
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, 1, E)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(d_logits, fn);
	if (dx) {
		MOE_NONNULL(w_r, fn);
		moe_gemm(0, 0, T, H, E, 1.0f, d_logits, E, w_r, H, 1.0f, dx, H);
	}
	if (dw_r) {
		MOE_NONNULL(x, fn);
		moe_gemm(1, 0, E, H, T, 1.0f, d_logits, E, x, H, 1.0f, dw_r, H);
	}
	return 0;
}

static int aux_check(const char *fn, tier_dev *dev, int T, int E, int k, float ac, float zc, const float *logits,
		     const int32_t *topk_idx)
{
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)))
		return rc;
	if (!isfinite(ac) || !isfinite(zc) || ac < 0 || zc < 0)
		return tier_fail(-EINVAL, "%s: loss coefficients %g, %g must be finite and >= 0", fn, ac, zc);
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(topk_idx, fn);
	for (size_t i = 0; i < (size_t)T * k; i++)
		if (topk_idx[i] < 0 || topk_idx[i] >= E)
			return tier_fail(-EINVAL, "%s: topk_idx[%zu] = %d is not an expert of 0..%d", fn, i, topk_idx[i], E - 1);
	return 0;
}

int tier_moe_aux_fwd(tier_dev *dev, int T, int E, int k, float aux_coef, float z_coef, const float *logits,
		     const int32_t *topk_idx, float *aux, float *z, int32_t *counts)
{
	const char *fn = "tier_moe_aux_fwd";
	int rc = aux_check(fn, dev, T, E, k, aux_coef, z_coef, logits, topk_idx);
	if (rc)
		return rc;
	MOE_NONNULL(aux, fn);
	MOE_NONNULL(z, fn);
	double P[TIER_MOE_MAX_EXPERTS] = { 0 }, zs = 0.0, a = 0.0;
	int32_t cnt[TIER_MOE_MAX_EXPERTS] = { 0 };
	float p[TIER_MOE_MAX_EXPERTS];
	for (int t = 0; t < T; t++) {
		float lse = softmax_row(logits + (size_t)t * E, E, p);
		zs += (double)lse * lse;
		for (int e = 0; e < E; e++)
			P[e] += p[e];
		for (int j = 0; j < k; j++)
			cnt[topk_idx[(size_t)t * k + j]]++;
	}
	for (int e = 0; e < E; e++)
		a += (double)cnt[e] / T * (P[e] / T);
	*aux = (float)(aux_coef * E * a);
	*z = (float)(z_coef * zs / T);
	if (counts)
		memcpy(counts, cnt, sizeof(int32_t) * (size_t)E);
	return 0;
}

int tier_moe_aux_bwd(tier_dev *dev, int T, int E, int k, float aux_coef, float z_coef, const float *logits,
		     const int32_t *topk_idx, float d_loss, float *d_logits)
{
	const char *fn = "tier_moe_aux_bwd";
	int rc = aux_check(fn, dev, T, E, k, aux_coef, z_coef, logits, topk_idx);
	if (rc)
		return rc;
	MOE_NONNULL(d_logits, fn);
	float f[TIER_MOE_MAX_EXPERTS], p[TIER_MOE_MAX_EXPERTS];
	int32_t cnt[TIER_MOE_MAX_EXPERTS] = { 0 };
	for (size_t i = 0; i < (size_t)T * k; i++)
		cnt[topk_idx[i]]++;
	for (int e = 0; e < E; e++)
		f[e] = (float)cnt[e] / T;
	float ca = d_loss * aux_coef * E / T;
	for (int t = 0; t < T; t++) {
		float *dl = d_logits + (size_t)t * E;
		float lse = softmax_row(logits + (size_t)t * E, E, p), cz = d_loss * z_coef * 2.0f * lse / T;
		double pf = 0.0;
		for (int e = 0; e < E; e++)
			pf += (double)p[e] * f[e];
		for (int e = 0; e < E; e++) /* d P_e / d l: softmax Jacobian; d lse / d l = p */
			dl[e] += ca * p[e] * (f[e] - (float)pf) + cz * p[e];
	}
	return 0;
}
