/* layer.c - the whole MoE block, forward and backward, from the steps of router.c, permute.c,
 * experts.c and combine.c, in caller-provided saved and workspace buffers (nothing allocated). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

#define ALIGN 64

static size_t al(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

int moe_cfg_check(const char *fn, const tier_moe_cfg *c, int T)
{
	int rc;
	if (!c)
		return tier_fail(-EINVAL, "%s: config is NULL", fn);
	if ((rc = tier_moe_router_check(&c->router)) || (rc = moe_check_tk(fn, T, c->router.top_k, c->router.n_experts)) ||
	    (rc = moe_check_dim(fn, "hidden", c->hidden)) || (rc = moe_check_dim(fn, "inter", c->inter)))
		return rc;
	if (!isfinite(c->capacity_factor) || !isfinite(c->aux_coef) || !isfinite(c->z_coef) || c->aux_coef < 0 ||
	    c->z_coef < 0)
		return tier_fail(-EINVAL, "%s: capacity_factor, aux_coef and z_coef must be finite (coefficients >= 0)", fn);
	if (c->dtype != TIER_MOE_F32 && c->dtype != TIER_MOE_BF16)
		return tier_fail(-EINVAL, "%s: unknown dtype %d; use TIER_MOE_F32 (CPU) or TIER_MOE_BF16 (CUDA)", fn,
				 (int)c->dtype);
	return 0;
}

/* The storage must match the device: fp32 on the CPU, bf16 on CUDA. */
static int dtype_check(const char *fn, tier_dev *dev, const tier_moe_cfg *c)
{
	int cuda = dev && tier_dev_kind_of(dev) == TIER_DEV_CUDA;
	if (cuda && c->dtype != TIER_MOE_BF16)
		return tier_fail(-EINVAL, "%s: a CUDA context takes bf16 storage; set cfg.dtype = TIER_MOE_BF16", fn);
	if (!cuda && c->dtype != TIER_MOE_F32)
		return tier_fail(-EINVAL, "%s: cfg.dtype TIER_MOE_BF16 needs a CUDA context; use TIER_MOE_F32 on the CPU", fn);
	return 0;
}

void moe_cuda_ws_layout(const tier_moe_cfg *c, int T, const tier_moe_loras *lora, moe_cuda_ws *l)
{
	size_t n = (size_t)T * c->router.top_k, H = c->hidden, I = c->inter, E = c->router.n_experts;
	size_t r = (size_t)moe_lora_max_rank(lora), o = 0;
	/* 256-byte aligned pieces: cuBLASLt's preferred alignment for whole matrices */
#define PIECE(f, bytes) (l->f = o, o += ((bytes) + 255) / 256 * 256)
	PIECE(xg, 2 * n * H);
	PIECE(h, 2 * n * I);
	PIECE(z, moe_lora_z_bytes(n, (int)r));
	PIECE(dz, moe_lora_dz_bytes(n, (int)r));
	PIECE(dy, 2 * n * H);
	PIECE(dg, 2 * n * I);
	PIECE(du, 2 * n * I);
	PIECE(dh, 4 * n * I);
	PIECE(dxg, 4 * n * H);
	PIECE(dtw, 4 * n);
	PIECE(dot, 4 * n);
	PIECE(dl, 4 * (size_t)T * E);
	PIECE(dlb, 2 * (size_t)T * E);
	PIECE(p, 4 * E);
	PIECE(zs, 4);
#undef PIECE
	l->total = o;
}

/* The kept Z of a saved buffer (tier_moe_saved's kept_z): bf16 only, for these adapters. */
static size_t kept_z_bytes(const tier_moe_cfg *c, int T, const tier_moe_loras *lora, int *cols)
{
	*cols = 0;
	if (c->dtype != TIER_MOE_BF16 || !lora)
		return 0;
	for (int q = 0; q < 3; q++) { /* a bad rank (the calls refuse it) reserves nothing */
		const tier_moe_lora *l = moe_lora_of(lora, q);
		*cols += moe_lora_on(l) && l->rank > 0 && l->rank <= 1024 ? l->rank : 0;
	}
	return 2 * (size_t)T * c->router.top_k * (size_t)*cols;
}

/* The kept h (tier_moe_saved's kept_h): bf16 only. */
static size_t kept_h_bytes(const tier_moe_cfg *c, int T, int keep_h)
{
	return keep_h && c->dtype == TIER_MOE_BF16 ? 2 * (size_t)T * c->router.top_k * c->inter : 0;
}

size_t tier_moe_saved_bytes_keep(const tier_moe_cfg *c, int T, const tier_moe_loras *lora, int keep_h)
{
	size_t b = tier_moe_saved_bytes(c, T);
	int cols;
	return b ? b + al(kept_z_bytes(c, T, lora, &cols)) + al(kept_h_bytes(c, T, keep_h)) : 0;
}

size_t tier_moe_saved_bytes_lora(const tier_moe_cfg *c, int T, const tier_moe_loras *lora)
{
	return tier_moe_saved_bytes_keep(c, T, lora, 0);
}

size_t tier_moe_saved_bytes(const tier_moe_cfg *c, int T)
{
	if (moe_cfg_check("tier_moe_saved_bytes", c, T))
		return 0;
	/* esz: the element size of g and u, bf16 on CUDA. Not y: the backward takes the router weights'
	 * gradient from the experts' (tier_moe_combine_dw) */
	size_t E = c->router.n_experts, n = (size_t)T * c->router.top_k, esz = c->dtype == TIER_MOE_BF16 ? 2 : 4;
	return al(4 * (size_t)T * E) + 2 * al(4 * n) + al(4 * E) + al(4 * (E + 1)) + 2 * al(4 * n) +
	       2 * al(esz * n * c->inter);
}

size_t tier_moe_workspace_bytes(const tier_moe_cfg *c, int T, const tier_moe_loras *lora)
{
	if (moe_cfg_check("tier_moe_workspace_bytes", c, T))
		return 0;
	if (c->dtype == TIER_MOE_BF16) {
		moe_cuda_ws l;
		moe_cuda_ws_layout(c, T, lora, &l);
		return l.total;
	}
	size_t n = (size_t)T * c->router.top_k, H = c->hidden;
	/* backward's: xg, dy, dxg [n, H], d_topk_w and row_dot [n], d_logits [T, E], expert scratch
	 * (forward's xg, y [n, H] and expert scratch fit in it) */
	return 3 * al(4 * n * H) + 2 * al(4 * n) + al(4 * (size_t)T * c->router.n_experts) +
	       al(tier_moe_experts_ws_bytes(c->inter, (int)n, lora));
}

/* Hands out consecutive aligned pieces of a buffer. */
static void *take(char **p, size_t bytes)
{
	void *r = *p;
	*p += al(bytes);
	return r;
}

int tier_moe_saved_bind(const tier_moe_cfg *c, int T, void *buf, size_t bytes, tier_moe_saved *s)
{
	return tier_moe_saved_bind_lora(c, T, NULL, buf, bytes, s);
}

int tier_moe_saved_bind_lora(const tier_moe_cfg *c, int T, const tier_moe_loras *lora, void *buf, size_t bytes,
			     tier_moe_saved *s)
{
	return tier_moe_saved_bind_keep(c, T, lora, 0, buf, bytes, s);
}

int tier_moe_saved_bind_keep(const tier_moe_cfg *c, int T, const tier_moe_loras *lora, int keep_h, void *buf,
			     size_t bytes, tier_moe_saved *s)
{
	const char *fn = keep_h ? "tier_moe_saved_bind_keep" : lora ? "tier_moe_saved_bind_lora" : "tier_moe_saved_bind";
	int rc = moe_cfg_check(fn, c, T);
	if (rc)
		return rc;
	MOE_NONNULL(buf, fn);
	MOE_NONNULL(s, fn);
	size_t need = tier_moe_saved_bytes_keep(c, T, lora, keep_h);
	if (bytes < need)
		return tier_fail(-EINVAL, "%s: %zu bytes given, %s says %zu", fn, bytes,
				 keep_h ? "tier_moe_saved_bytes_keep" : lora ? "tier_moe_saved_bytes_lora" : "tier_moe_saved_bytes",
				 need);
	size_t E = c->router.n_experts, n = (size_t)T * c->router.top_k, esz = c->dtype == TIER_MOE_BF16 ? 2 : 4;
	char *p = buf;
	memset(s, 0, sizeof *s);
	s->T = T;
	s->logits = take(&p, 4 * (size_t)T * E);
	s->topk_idx = take(&p, 4 * n);
	s->topk_w = take(&p, 4 * n);
	s->counts = take(&p, 4 * E);
	s->offsets = take(&p, 4 * (E + 1));
	s->row_pair = take(&p, 4 * n);
	s->pair_row = take(&p, 4 * n);
	s->g = take(&p, esz * n * c->inter);
	s->u = take(&p, esz * n * c->inter);
	size_t zb = kept_z_bytes(c, T, lora, &s->kept_cols);
	s->kept_z = zb ? take(&p, zb) : NULL;
	size_t hb = kept_h_bytes(c, T, keep_h);
	s->kept_h = hb ? take(&p, hb) : NULL;
	return 0;
}

int moe_ws_check(const char *fn, const tier_moe_cfg *c, int T, const tier_moe_loras *lora, void *ws, size_t bytes)
{
	MOE_NONNULL(ws, fn);
	size_t need = tier_moe_workspace_bytes(c, T, lora);
	if (bytes < need)
		return tier_fail(-EINVAL, "%s: workspace of %zu bytes; tier_moe_workspace_bytes says %zu", fn, bytes, need);
	return 0;
}

int moe_saved_check(const char *fn, const tier_moe_saved *s, int T)
{
	MOE_NONNULL(s, fn);
	if (!s->logits || !s->topk_idx || !s->topk_w || !s->counts || !s->offsets || !s->row_pair || !s->pair_row ||
	    !s->g || !s->u)
		return tier_fail(-EINVAL, "%s: saved has NULL arrays; bind it with tier_moe_saved_bind", fn);
	if (s->T != T)
		return tier_fail(-EINVAL, "%s: saved was bound for %d tokens, not %d", fn, s->T, T);
	return 0;
}

/* Checks every entry of the block makes before its CUDA version takes over. */
static int entry_checks(const char *fn, tier_dev *dev, const tier_moe_cfg *c, int T)
{
	int rc = moe_cfg_check(fn, c, T);
	return rc ? rc : dtype_check(fn, dev, c);
}

/* The CPU's checks after the CUDA dispatch: device, saved, workspace, and the given pointers. */
static int cpu_checks(const char *fn, tier_dev *dev, const tier_moe_cfg *c, int T, const tier_moe_loras *lora,
		      const tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_saved_check(fn, s, T)) || (rc = moe_ws_check(fn, c, T, lora, ws, ws_bytes)))
		return rc;
	return 0;
}

/* The router into s, and with counts its histogram and the aux losses. */
static int route_cpu(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
		     const float *bias, tier_moe_saved *s, int32_t *counts)
{
	int E = c->router.n_experts, k = c->router.top_k, n = T * k;
	int rc = tier_moe_router_fwd(dev, &c->router, T, c->hidden, x, w_r, bias, s->logits, s->topk_idx, s->topk_w);
	if (rc || !counts)
		return rc;
	if ((rc = tier_moe_aux_fwd(dev, T, E, k, c->aux_coef, c->z_coef, s->logits, s->topk_idx, &s->aux, &s->z, NULL)))
		return rc;
	memset(counts, 0, sizeof(int32_t) * (size_t)E);
	for (int p = 0; p < n; p++) /* the router's indices are in 0..E-1 */
		counts[s->topk_idx[p]]++;
	return 0;
}

/* -EIO unless the routing in s (its counts, made by tier_moe_permute) is the one counts describe. */
static int counts_agree(const char *fn, int E, const int32_t *counts, const int32_t *have)
{
	for (int e = 0; e < E; e++)
		if (counts[e] != have[e])
			return tier_fail(-EIO, "%s: the routing in saved sends %d pairs to expert %d, the counts given %d: "
					 "they are not this routing's (a recompute that routed differently?); route "
					 "again with tier_moe_layer_route", fn, have[e], e, counts[e]);
	return 0;
}

/* The forward after the routing: permute, experts, combine (out NULL: not combined); counts: the
 * caller's, checked against the routing in s (NULL: the routing is this call's own). */
static int fwd_cpu(const char *fn, tier_dev *dev, const tier_moe_cfg *c, int T, const float *x,
		   const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts, const float *res,
		   float *out, tier_moe_saved *s, void *ws)
{
	int E = c->router.n_experts, k = c->router.top_k, H = c->hidden, n = T * k, rc;
	char *p = ws;
	float *xg = take(&p, 4 * (size_t)n * H), *y = out ? take(&p, 4 * (size_t)n * H) : NULL;
	int cap = tier_moe_capacity(T, k, E, c->capacity_factor);
	if ((rc = tier_moe_permute(dev, T, k, E, H, cap, s->topk_idx, x, s->offsets, s->row_pair, s->pair_row,
				   s->counts, xg)) ||
	    (counts && (rc = counts_agree(fn, E, counts, s->counts))) ||
	    (rc = tier_moe_experts_fwd(dev, E, H, c->inter, s->offsets, w, lora, xg, s->g, s->u, y, p)))
		return rc;
	return out ? moe_combine_fwd_res(dev, T, k, H, s->pair_row, s->topk_w, y, res, out) : 0;
}

int tier_moe_layer_fwd(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
		       const float *bias, const tier_moe_experts *w, const tier_moe_loras *lora, float *out,
		       tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_fwd";
	int rc = entry_checks(fn, dev, c, T);
	if (rc)
		return rc;
	MOE_CUDA_DISPATCH(dev, moe_cuda_layer_fwd(dev, c, T, x, w_r, bias, w, lora, out, s, ws, ws_bytes));
	if ((rc = cpu_checks(fn, dev, c, T, lora, s, ws, ws_bytes)))
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(w, fn);
	int32_t counts[TIER_MOE_MAX_EXPERTS];
	if ((rc = route_cpu(dev, c, T, x, w_r, bias, s, counts))) /* counts: the aux losses' */
		return rc;
	return fwd_cpu(fn, dev, c, T, x, w, lora, NULL, NULL, out, s, ws);
}

int tier_moe_layer_route(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
			 const float *bias, tier_moe_saved *s, void *ws, size_t ws_bytes, int32_t *counts)
{
	const char *fn = "tier_moe_layer_route";
	int rc = entry_checks(fn, dev, c, T);
	if (rc)
		return rc;
	MOE_CUDA_DISPATCH(dev, moe_cuda_layer_route(dev, c, T, x, w_r, bias, s, ws, ws_bytes, counts));
	if ((rc = cpu_checks(fn, dev, c, T, NULL, s, ws, ws_bytes)))
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	return route_cpu(dev, c, T, x, w_r, bias, s, counts);
}

int tier_moe_layer_fwd_routed(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x,
			      const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts, float *out,
			      tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	return tier_moe_layer_fwd_routed_res(dev, c, T, x, w, lora, counts, NULL, out, s, ws, ws_bytes);
}

int tier_moe_layer_fwd_routed_res(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x,
				  const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts,
				  const float *res, float *out, tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_fwd_routed";
	int rc = entry_checks(fn, dev, c, T);
	if (rc)
		return rc;
	MOE_NONNULL(counts, fn);
	if (res && !out)
		return tier_fail(-EINVAL, "%s: a residual was given without an output", fn);
	MOE_CUDA_DISPATCH(dev, moe_cuda_layer_fwd_routed(dev, c, T, x, w, lora, counts, res, out, s, ws, ws_bytes));
	if ((rc = cpu_checks(fn, dev, c, T, lora, s, ws, ws_bytes)))
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w, fn);
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int E = c->router.n_experts, k = c->router.top_k;
	if ((rc = moe_offsets_of(fn, counts, E, T * k, tier_moe_capacity(T, k, E, c->capacity_factor), off)))
		return rc;
	return fwd_cpu(fn, dev, c, T, x, w, lora, counts, res, out, s, ws);
}

static int bwd_cpu(const char *fn, tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
		   const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *s, const float *d_out,
		   float d_aux, float *dx, float *dw_r, void *ws)
{
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(w, fn);
	MOE_NONNULL(d_out, fn);
	MOE_NONNULL(dx, fn);
	if (!isfinite(d_aux))
		return tier_fail(-EINVAL, "%s: d_aux is not finite", fn);
	int E = c->router.n_experts, k = c->router.top_k, H = c->hidden, n = T * k, rc;
	char *p = ws;
	float *xg = take(&p, 4 * (size_t)n * H), *dy = take(&p, 4 * (size_t)n * H), *dxg = take(&p, 4 * (size_t)n * H);
	float *dtw = take(&p, 4 * (size_t)n), *dot = take(&p, 4 * (size_t)n), *dl = take(&p, 4 * (size_t)T * E);
	int rows = s->offsets[E];
	for (int r = 0; r < rows; r++) /* gather again rather than keep xg: a copy, cheaper than storing */
		memcpy(xg + (size_t)r * H, x + (size_t)(s->row_pair[r] / k) * H, sizeof(float) * (size_t)H);
	memset(dx, 0, sizeof(float) * (size_t)T * H);
	if ((rc = tier_moe_combine_bwd(dev, T, k, H, s->pair_row, s->topk_w, NULL, d_out, dy, NULL)) ||
	    (rc = tier_moe_experts_bwd(dev, E, H, c->inter, s->offsets, w, lora, xg, s->g, s->u, dy, dxg, dot, p)) ||
	    (rc = tier_moe_combine_dw(dev, T, k, s->pair_row, s->topk_w, dot, dtw)) ||
	    (rc = tier_moe_permute_bwd(dev, T, k, H, s->offsets, E, s->row_pair, dxg, dx)) ||
	    (rc = tier_moe_router_weights_bwd(dev, &c->router, T, s->logits, s->topk_idx, dtw, dl)))
		return rc;
	if (d_aux != 0.0f && (c->aux_coef > 0 || c->z_coef > 0) &&
	    (rc = tier_moe_aux_bwd(dev, T, E, k, c->aux_coef, c->z_coef, s->logits, s->topk_idx, d_aux, dl)))
		return rc;
	return tier_moe_router_linear_bwd(dev, T, H, E, x, w_r, dl, dx, dw_r);
}

int tier_moe_layer_bwd(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
		       const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *s,
		       const float *d_out, float d_aux, float *dx, float *dw_r, void *ws, size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_bwd";
	int rc = entry_checks(fn, dev, c, T);
	if (rc)
		return rc;
	MOE_CUDA_DISPATCH(dev, moe_cuda_layer_bwd(dev, c, T, x, w_r, w, lora, s, NULL, d_out, d_aux, dx, dw_r, ws,
						  ws_bytes));
	if ((rc = cpu_checks(fn, dev, c, T, lora, s, ws, ws_bytes)))
		return rc;
	return bwd_cpu(fn, dev, c, T, x, w_r, w, lora, s, d_out, d_aux, dx, dw_r, ws);
}

int tier_moe_layer_bwd_routed(tier_dev *dev, const tier_moe_cfg *c, int T, const float *x, const float *w_r,
			      const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *s,
			      const int32_t *counts, const float *d_out, float d_aux, float *dx, float *dw_r, void *ws,
			      size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_bwd_routed";
	int rc = entry_checks(fn, dev, c, T);
	if (rc)
		return rc;
	MOE_NONNULL(counts, fn);
	MOE_CUDA_DISPATCH(dev, moe_cuda_layer_bwd(dev, c, T, x, w_r, w, lora, s, counts, d_out, d_aux, dx, dw_r, ws,
						  ws_bytes));
	if ((rc = cpu_checks(fn, dev, c, T, lora, s, ws, ws_bytes)))
		return rc;
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int E = c->router.n_experts, k = c->router.top_k;
	if ((rc = moe_offsets_of(fn, counts, E, T * k, tier_moe_capacity(T, k, E, c->capacity_factor), off)))
		return rc;
	for (int e = 0; e <= E; e++)
		if (off[e] != s->offsets[e])
			return tier_fail(-EIO, "%s: saved's expert offsets differ from the counts' at expert %d (%d, %d): "
					 "the counts are not this forward's; pass the ones its tier_moe_layer_route gave",
					 fn, e > 0 ? e - 1 : 0, s->offsets[e], off[e]);
	return bwd_cpu(fn, dev, c, T, x, w_r, w, lora, s, d_out, d_aux, dx, dw_r, ws);
}

int tier_moe_routing_check(tier_dev *dev)
{
	MOE_CUDA_DISPATCH(dev, moe_cuda_routing_check(dev));
	return 0;
}
