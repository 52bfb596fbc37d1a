/* moe_layer.cu - the whole MoE block on CUDA (the CUDA side of tier_moe_layer_fwd / _route /
 * _fwd_routed / _bwd / _bwd_routed): router, aux statistics, permute, experts, combine, and their
 * backward, in the caller's saved buffer and workspace (moe_cuda_ws_layout). The per-expert
 * dispatch needs the expert offsets on the host: the forward reads the routed counts (and the aux
 * statistics) back once, in the route; the _routed calls take the counts from the caller and read
 * nothing, and the device checks that its offsets are the ones those counts give. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/pdl.cuh"
#include "base/fill_cuda.h"

/* Reads what is asked of offsets [E+1], counts [E], and p [E] with zs on the host after the queued
 * work: one synchronisation. */
static int read_back(tier_dev *dev, int E, const int32_t *d_off, int32_t *off, const int32_t *d_cnt, int32_t *cnt,
		     const float *d_p, float *p, const float *d_zs, float *zs)
{
	cudaStream_t st = moe_stream(dev);
	if (off)
		CUDA_TRY(cudaMemcpyAsync(off, d_off, sizeof(int32_t) * (size_t)(E + 1), cudaMemcpyDeviceToHost, st));
	if (cnt)
		CUDA_TRY(cudaMemcpyAsync(cnt, d_cnt, sizeof(int32_t) * (size_t)E, cudaMemcpyDeviceToHost, st));
	if (p) {
		CUDA_TRY(cudaMemcpyAsync(p, d_p, sizeof(float) * (size_t)E, cudaMemcpyDeviceToHost, st));
		CUDA_TRY(cudaMemcpyAsync(zs, d_zs, sizeof(float), cudaMemcpyDeviceToHost, st));
	}
	CUDA_TRY(cudaStreamSynchronize(st));
	return 0;
}

/* ---- the routed calls' check: the device's offsets against the host's ----
 * The first mismatch since the last tier_moe_routing_check: set, the offset's index, the device's
 * value, the host's. A mismatched offset is replaced by the host's, so that the call's kernels
 * follow the host's tables (an expert the host saw no rows for may have no weights: a kernel
 * scheduled by the device's offsets would read them). The host's offsets ride in the parameters
 * (4 KiB at E = 1024). */
__device__ int moe_route_err[4];

struct route_offsets {
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
};

__global__ void route_check_kernel(int32_t *__restrict__ d_off, int E, const __grid_constant__ route_offsets h)
{
	pdl_enter();
	for (int e = threadIdx.x; e <= E; e += blockDim.x) {
		int v = d_off[e];
		if (v == h.off[e])
			continue;
		if (atomicCAS(&moe_route_err[0], 0, 1) == 0)
			moe_route_err[1] = e, moe_route_err[2] = v, moe_route_err[3] = h.off[e];
		d_off[e] = h.off[e];
	}
}

static int route_check(tier_dev *dev, int E, int32_t *d_off, const int32_t *off)
{
	route_offsets h;
	memcpy(h.off, off, sizeof(int32_t) * (size_t)(E + 1));
	tier_launch(route_check_kernel, 1, 256, 0, moe_stream(dev), d_off, E, h);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_routing_check(tier_dev *dev)
{
	int rc = moe_cuda_dev(dev, "tier_moe_routing_check"), v[4];
	if (rc)
		return rc;
	/* on the work stream (non-blocking: the legacy stream's symbol copies would not order with it) */
	cudaStream_t st = moe_stream(dev);
	void *flag = NULL;
	CUDA_TRY(cudaGetSymbolAddress(&flag, moe_route_err));
	CUDA_TRY(cudaMemcpyAsync(v, flag, sizeof v, cudaMemcpyDeviceToHost, st));
	CUDA_TRY(cudaStreamSynchronize(st));
	if (!v[0])
		return 0;
	CUDA_TRY((cudaError_t)tier_cuda_fill(flag, 0, sizeof v, st));
	CUDA_TRY(cudaStreamSynchronize(st));
	return tier_fail(-EIO, "tier_moe_routing_check: a routed MoE call had offsets[%d] = %d on the device where the "
			 "counts it was given make %d: those counts were not its routing's (a recompute that routed "
			 "differently from its forward), so its results are wrong; run without the routed calls "
			 "(TIER_MOE_ROUTED=0 for tier-run) and report it", v[1], v[2], v[3]);
}

static int offsets_sane(const char *fn, int E, int n, const int32_t *off)
{
	if (off[E] < 0 || off[E] > n)
		return tier_fail(-EINVAL, "%s: offsets[E] = %d is outside 0..T*k; is saved from this forward?", fn, off[E]);
	return 0;
}

static int common_checks(const char *fn, tier_dev *dev, const tier_moe_cfg *c, int T, const tier_moe_loras *lora,
			 const tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_cfg_check(fn, c, T)) || (rc = moe_saved_check(fn, s, T)) ||
	    (rc = moe_ws_check(fn, c, T, lora, ws, ws_bytes)))
		return rc;
	if (c->dtype != TIER_MOE_BF16)
		return tier_fail(-EINVAL, "%s: a CUDA context takes bf16 storage; set cfg.dtype = TIER_MOE_BF16", fn);
	return 0;
}

/* TIER_MOE_EARLY_PERMUTE=1: a route that reads the counts back queues the permute right after (it
 * needs no host offsets), so that the device permutes while the host pins the routed experts; the
 * H100 timeline of session 18 shows the device idle ~40 us a layer there. Off by default until
 * measured against the default in the same call. */
static int early_permute(void)
{
	const char *v = getenv("TIER_MOE_EARLY_PERMUTE");
	return v && *v && strcmp(v, "0") != 0;
}

/* x's rows into xg by the routing in s, under the block's capacity (the offsets on the device). */
static int permute_x(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x, tier_moe_saved *s, void *xg)
{
	int E = c->router.n_experts, k = c->router.top_k;
	return moe_cuda_permute(dev, T, k, E, c->hidden, tier_moe_capacity(T, k, E, c->capacity_factor), s->topk_idx, x,
				s->offsets, s->row_pair, s->pair_row, s->counts, xg);
}

/* The router, and with counts the routed counts and the aux losses on the host (one sync). */
static int route(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x, const void *w_r, const float *bias,
		 tier_moe_saved *s, void *ws, int32_t *counts)
{
	int E = c->router.n_experts, k = c->router.top_k, H = c->hidden;
	int stats = c->aux_coef > 0 || c->z_coef > 0;
	moe_cuda_ws l;
	moe_cuda_ws_layout(c, T, NULL, &l); /* p, zs and xg: the layout without LoRA is this call's own */
	char *b = (char *)ws;
	float P[TIER_MOE_MAX_EXPERTS], zs = 0.0f;
	s->permuted = 0;
	int rc = moe_cuda_router_fwd(dev, &c->router, T, H, x, w_r, bias, s->logits, s->topk_idx, s->topk_w);
	if (rc || !counts)
		return rc;
	if ((rc = moe_cuda_expert_counts(dev, T, k, E, s->topk_idx, s->counts, s->row_pair)) ||
	    (stats && (rc = moe_cuda_aux_stats(dev, T, E, s->logits, (float *)(b + l.p), (float *)(b + l.zs)))) ||
	    (rc = read_back(dev, E, NULL, NULL, s->counts, counts, stats ? (float *)(b + l.p) : NULL, stats ? P : NULL,
			    (float *)(b + l.zs), &zs)))
		return rc;
	/* xg sits first in the workspace with or without LoRA: fwd_routed finds it where this wrote it */
	if (early_permute()) {
		if ((rc = permute_x(dev, c, T, x, s, b + l.xg)))
			return rc;
		s->permuted = 1;
	}
	double a = 0.0;
	for (int e = 0; stats && e < E; e++)
		a += (double)counts[e] / T * ((double)P[e] / T);
	s->aux = (float)(c->aux_coef * E * a);
	s->z = stats ? (float)(c->z_coef * (double)zs / T) : 0.0f;
	return 0;
}

/* Where h lives between the forward and its backward: the saved state's kept_h when bound, else the
 * workspace (ws at b). */
static char *h_at(const tier_moe_saved *s, char *b, const moe_cuda_ws *l)
{
	return s->kept_h ? (char *)s->kept_h : b + l->h;
}

/* Permute, experts and combine on the host's offsets (made from the routed counts), which the
 * device checks against its own. */
static int fwd_routed(tier_dev *dev, const char *fn, const tier_moe_cfg *c, int T, const void *x,
		      const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts, const float *res,
		      float *out, tier_moe_saved *s, void *ws)
{
	int E = c->router.n_experts, k = c->router.top_k, H = c->hidden, n = T * k;
	int cap = tier_moe_capacity(T, k, E, c->capacity_factor);
	moe_cuda_ws l;
	moe_cuda_ws_layout(c, T, lora, &l);
	char *b = (char *)ws;
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int rc = moe_offsets_of(fn, counts, E, n, cap, off), permuted = s->permuted;
	char *hb = h_at(s, b, &l);
	moe_keep keep = { s->kept_z, s->kept_cols, s->h_in_ws || s->kept_h, 0 };
	s->permuted = 0; /* the route's permute serves this call alone */
	s->kept = 0;
	if (rc || (!permuted && (rc = permute_x(dev, c, T, x, s, b + l.xg))) ||
	    (rc = route_check(dev, E, s->offsets, off)) ||
	    /* y in the backward's dy piece, and only when combined: the backward does not read it */
	    (rc = moe_cuda_experts_fwd_lora(dev, E, H, c->inter, off, s->offsets, w, lora, b + l.xg, s->g, s->u, hb,
					    out ? b + l.dy : NULL, b + l.z, (float *)(b + l.dh), &keep)))
		return rc;
	s->kept = keep.kept;
	return out ? moe_cuda_combine_fwd_res(dev, T, k, H, s->pair_row, s->topk_w, b + l.dy, res, out) : 0;
}

extern "C" int moe_cuda_layer_fwd(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x, const void *w_r,
				  const float *bias, const tier_moe_experts *w, const tier_moe_loras *lora, float *out,
				  tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_fwd";
	int rc = common_checks(fn, dev, c, T, lora, s, ws, ws_bytes);
	if (rc)
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(w, fn);
	int32_t counts[TIER_MOE_MAX_EXPERTS];
	if ((rc = route(dev, c, T, x, w_r, bias, s, ws, counts)))
		return rc;
	return fwd_routed(dev, fn, c, T, x, w, lora, counts, NULL, out, s, ws);
}

extern "C" int moe_cuda_layer_route(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x, const void *w_r,
				    const float *bias, tier_moe_saved *s, void *ws, size_t ws_bytes, int32_t *counts)
{
	const char *fn = "tier_moe_layer_route";
	int rc = common_checks(fn, dev, c, T, NULL, s, ws, ws_bytes);
	if (rc)
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	return route(dev, c, T, x, w_r, bias, s, ws, counts);
}

extern "C" int moe_cuda_layer_fwd_routed(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x,
					 const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts,
					 const float *res, float *out, tier_moe_saved *s, void *ws, size_t ws_bytes)
{
	const char *fn = "tier_moe_layer_fwd_routed";
	int rc = common_checks(fn, dev, c, T, lora, s, ws, ws_bytes);
	if (rc)
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w, fn);
	return fwd_routed(dev, fn, c, T, x, w, lora, counts, res, out, s, ws);
}

extern "C" int moe_cuda_layer_bwd(tier_dev *dev, const tier_moe_cfg *c, int T, const void *x, const void *w_r,
				  const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *s,
				  const int32_t *counts, const float *d_out, float d_aux, float *dx, float *dw_r,
				  void *ws, size_t ws_bytes)
{
	const char *fn = counts ? "tier_moe_layer_bwd_routed" : "tier_moe_layer_bwd";
	int rc = common_checks(fn, dev, c, T, lora, s, ws, ws_bytes);
	if (rc)
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(w, fn);
	MOE_NONNULL(d_out, fn);
	MOE_NONNULL(dx, fn);
	if (!isfinite(d_aux))
		return tier_fail(-EINVAL, "%s: d_aux is not finite", fn);
	int E = c->router.n_experts, k = c->router.top_k, H = c->hidden, I = c->inter, n = T * k;
	moe_cuda_ws l;
	moe_cuda_ws_layout(c, T, lora, &l);
	char *b = (char *)ws;
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	float *dxg = (float *)(b + l.dxg), *dtw = (float *)(b + l.dtw), *dot = (float *)(b + l.dot), *dl = (float *)(b + l.dl);
	/* xg is gathered by the experts' backward, and only where it reads it whole */
	const moe_xg_src xs = { x, s->pair_row, s->row_pair, T, k, b + l.xg };
	const moe_keep keep = { s->kept_z, s->kept_cols, s->h_in_ws, s->kept, &xs };
	int dx16 = 0; /* whether the experts wrote dxg in bf16 */
	if (counts) { /* the forward's: no read back, the device checks */
		if ((rc = moe_offsets_of(fn, counts, E, n, tier_moe_capacity(T, k, E, c->capacity_factor), off)) ||
		    (rc = route_check(dev, E, s->offsets, off)))
			return rc;
	} else if ((rc = read_back(dev, E, s->offsets, off, NULL, NULL, NULL, NULL, NULL, NULL))) {
		return rc;
	}
	if ((rc = offsets_sane(fn, E, n, off)) ||
	    (rc = moe_cuda_experts_check(fn, E, off, w, lora)))
		return rc;
	/* the router weights' gradient from the experts' dh . h (tier_moe_combine_dw), not from a saved y */
	if ((rc = moe_cuda_combine_bwd(dev, T, k, H, s->pair_row, s->topk_w, NULL, d_out, b + l.dy, NULL)) ||
	    (off[E] > 0 && (rc = moe_cuda_experts_bwd(dev, E, H, I, off, s->offsets, w, lora, b + l.xg, s->g, s->u, b + l.dy, dxg,
						      dot, h_at(s, b, &l), b + l.dg, b + l.du, (float *)(b + l.dh), b + l.z,
						      b + l.dz, &keep, &dx16))) ||
	    (rc = moe_cuda_combine_dw(dev, T, k, s->pair_row, s->topk_w, dot, dtw)) ||
	    (rc = moe_cuda_unpermute_sum(dev, T, k, H, s->pair_row, dxg, dx16, dx)) ||
	    (rc = moe_cuda_router_bwd(dev, &c->router, T, s->logits, s->topk_idx, dtw, s->counts, c->aux_coef, c->z_coef,
				      d_aux, dl, b + l.dlb)) ||
	    (rc = moe_cuda_mm(dev, 0, 0, T, H, E, 1.0f, b + l.dlb, E, w_r, H, 1.0f, dx, H, 0)))
		return rc;
	if (dw_r && (rc = moe_cuda_mm(dev, 1, 0, E, H, T, 1.0f, b + l.dlb, E, x, H, 1.0f, dw_r, H, 0)))
		return rc;
	return 0;
}
