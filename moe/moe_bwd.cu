/* moe_bwd.cu - CUDA backward of the MoE steps around the experts: combine (d expert outputs, d router
 * weights), the gather (scatter back to tokens), and the router fused with the aux and z losses,
 * plus the aux statistics of the forward. One block per token where a token's row is the unit;
 * same formulas as router.c, combine.c and permute.c (docs/moe.md). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/bf16x4.cuh"
#include "base/pdl.cuh"
#include "base/fill_cuda.h"

#define TOK_THREADS 256

/* ---- combine ---- */
__global__ void combine_bwd_kernel(int k, int H, const int32_t *pair_row, const float *w, const bf16 *y,
				   const float *d_out, bf16 *dy, float *d_topk_w)
{
	pdl_enter();
	__shared__ float red[33];
	int t = blockIdx.x;
	const float *g = d_out + (size_t)t * H;
	for (int j = 0; j < k; j++) {
		int p = t * k + j, r = pair_row[p]; /* the same r for the whole block: no divergence at sync */
		float dot = 0.0f;
		if (r >= 0) {
			float wp = w[p];
			const bf16 *yr = y ? y + (size_t)r * H : NULL;
			bf16 *dr = dy + (size_t)r * H;
			for (int h = threadIdx.x; h < H; h += blockDim.x) {
				float gh = g[h];
				if (yr)
					dot += gh * __bfloat162float(yr[h]);
				dr[h] = __float2bfloat16(wp * gh);
			}
		}
		if (!d_topk_w) /* the same for the whole grid: no divergence at block_sum's barriers */
			continue;
		dot = block_sum(dot, red);
		if (threadIdx.x == 0)
			d_topk_w[p] = r >= 0 ? dot : 0.0f;
	}
}

/* dy alone (the layer's form: no y, no d_topk_w), four columns a thread (H a multiple of 4, d_out
 * 16-byte and dy 8-byte aligned): the token's d_out read once into registers, each of its k rows
 * written in 8-byte stores, the same roundings as above. The scalar kernel read d_out again for
 * every row and wrote 2 bytes at a time: 0.53 of the copy's rate in (a)'s profile. */
template <int NV>
__global__ void combine_bwd4_kernel(int k, int H4, const int32_t *pair_row, const float *w, const float4 *d_out,
				    bf16 *dy)
{
	pdl_enter();
	int t = blockIdx.x;
	float4 g[NV];
#pragma unroll
	for (int i = 0; i < NV; i++) {
		int h = threadIdx.x + i * TOK_THREADS;
		g[i] = h < H4 ? d_out[(size_t)t * H4 + h] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
	}
	for (int j = 0; j < k; j++) {
		int p = t * k + j, r = pair_row[p];
		if (r < 0)
			continue;
		float wp = w[p];
		bf16 *dr = dy + (size_t)r * H4 * 4;
#pragma unroll
		for (int i = 0; i < NV; i++) {
			int h = threadIdx.x + i * TOK_THREADS;
			if (h < H4)
				bf16x4_store(dr + 4 * h, wp * g[i].x, wp * g[i].y, wp * g[i].z, wp * g[i].w);
		}
	}
}

/* tier_moe_combine_dw: a thread a pair. */
__global__ void combine_dw_kernel(int n, const int32_t *pair_row, const float *w, const float *row_dot, float *d_topk_w)
{
	pdl_enter();
	for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
		int r = pair_row[p];
		float wp = w[p];
		d_topk_w[p] = r >= 0 && !(fabsf(wp) < FLT_MIN) ? row_dot[r] / wp : 0.0f; /* a NaN weight stays NaN */
	}
}

extern "C" int moe_cuda_combine_bwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
				    const void *y, const float *d_out, void *dy, float *d_topk_w)
{
	const char *fn = "moe_cuda_combine_bwd";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(topk_w, fn);
	MOE_NONNULL(d_out, fn);
	MOE_NONNULL(dy, fn);
	if (!y != !d_topk_w)
		return tier_fail(-EINVAL, "%s: give y and d_topk_w both, or neither (dy only)", fn);
	int H4 = H / 4, nv = (H4 + TOK_THREADS - 1) / TOK_THREADS;
	cudaStream_t st = moe_stream(dev);
	const float4 *g4 = (const float4 *)d_out;
	if (y || H % 4 || nv > 4 || (uintptr_t)d_out % 16 || (uintptr_t)dy % 8)
		tier_launch(combine_bwd_kernel, T, TOK_THREADS, 0, st, k, H, pair_row, topk_w, (const bf16 *)y, d_out,
				(bf16 *)dy, d_topk_w);
	else if (nv <= 2)
		tier_launch(combine_bwd4_kernel<2>, T, TOK_THREADS, 0, st, k, H4, pair_row, topk_w, g4, (bf16 *)dy);
	else
		tier_launch(combine_bwd4_kernel<4>, T, TOK_THREADS, 0, st, k, H4, pair_row, topk_w, g4, (bf16 *)dy);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_combine_dw(tier_dev *dev, int T, int k, const int32_t *pair_row, const float *topk_w,
				   const float *row_dot, float *d_topk_w)
{
	const char *fn = "moe_cuda_combine_dw";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(topk_w, fn);
	MOE_NONNULL(row_dot, fn);
	MOE_NONNULL(d_topk_w, fn);
	int n = T * k, blocks = (n + 255) / 256;
	tier_launch(combine_dw_kernel, blocks < 4096 ? blocks : 4096, 256, 0, moe_stream(dev), n, pair_row, topk_w,
			row_dot, d_topk_w);
	CUDA_LAUNCHED();
	return 0;
}

/* ---- permute ---- */
__global__ void permute_bwd_kernel(int k, int H, int n, const int32_t *offsets, int E, const int32_t *row_pair,
				   const float *dxg, float *dx)
{
	pdl_enter();
	int r = blockIdx.x, rows = offsets[E];
	if (r >= rows || rows > n)
		return;
	int p = row_pair[r];
	if (p < 0 || p >= n)
		return; /* not a pair: the host cannot check device maps; skip rather than write out of bounds */
	float *d = dx + (size_t)(p / k) * H;
	const float *s = dxg + (size_t)r * H;
	for (int h = threadIdx.x; h < H; h += blockDim.x)
		atomicAdd(d + h, s[h]);
}

extern "C" int moe_cuda_permute_bwd(tier_dev *dev, int T, int k, int H, const int32_t *offsets, int E,
				    const int32_t *row_pair, const float *dxg, float *dx)
{
	const char *fn = "moe_cuda_permute_bwd";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(row_pair, fn);
	MOE_NONNULL(dxg, fn);
	MOE_NONNULL(dx, fn);
	tier_launch(permute_bwd_kernel, T * k, 128, 0, moe_stream(dev), k, H, T * k, offsets, E, row_pair, dxg, dx);
	CUDA_LAUNCHED();
	return 0;
}

/* dxg rows as fp32 or bf16 (the fused experts' backward writes bf16: moe_cuda_experts_bwd). */
__device__ __forceinline__ float dxg_at(const float *p) { return *p; }
__device__ __forceinline__ float dxg_at(const bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float4 dxg_at4(const float *p) { return __ldg((const float4 *)p); }
__device__ __forceinline__ float4 dxg_at4(const bf16 *p)
{
	return bf16x4_float4(__ldg((const uint2 *)p));
}

template <typename TI>
__global__ void unpermute_sum_kernel(int k, int H, int n, const int32_t *pair_row, const TI *dxg, float *dx)
{
	pdl_enter();
	int t = blockIdx.x;
	int32_t r[TIER_MOE_MAX_TOPK];
	for (int j = 0; j < k; j++) {
		r[j] = pair_row[t * k + j];
		r[j] = r[j] < n ? r[j] : -1;
	}
	for (int h = threadIdx.x; h < H; h += blockDim.x) {
		float acc = 0.0f;
		for (int j = 0; j < k; j++)
			if (r[j] >= 0)
				acc += dxg_at(dxg + (size_t)r[j] * H + h);
		dx[(size_t)t * H + h] = acc;
	}
}

/* Four columns per thread (H a multiple of 4, dxg's rows 16-byte (fp32) or 8-byte (bf16) aligned,
 * dx 16-byte). The loops over the k rows unrolled to KM >= k: the rows stay in registers and a
 * thread's k loads are in flight together (a loop of k's runtime length kept them in local memory
 * and loaded one row at a time: 0.6 of the copy's rate in (a)'s profile). The sum runs in row order
 * j as before. dxg has n rows (row 0 exists whenever a token has a row). */
template <int KM, typename TI>
__global__ void unpermute_sum4_kernel(int k, int H4, int n, const int32_t *pair_row, const TI *dxg, float4 *dx)
{
	pdl_enter();
	int t = blockIdx.x;
	int32_t r[KM], at[KM], safe = 0; /* at: the row loaded, a kept row (or row 0) for the rest */
#pragma unroll
	for (int j = 0; j < KM; j++) {
		r[j] = j < k ? pair_row[t * k + j] : -1;
		r[j] = r[j] < n ? r[j] : -1;
		safe = r[j] >= 0 ? r[j] : safe;
	}
#pragma unroll
	for (int j = 0; j < KM; j++)
		at[j] = r[j] >= 0 ? r[j] : safe;
	for (int h = threadIdx.x; h < H4; h += blockDim.x) {
		float4 v[KM], acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		/* unconditional loads (a load under a branch went out one at a time): a row not kept
		 * repeats a kept one, which the cache serves */
#pragma unroll
		for (int j = 0; j < KM; j++)
			v[j] = dxg_at4(dxg + ((size_t)at[j] * H4 + h) * 4);
#pragma unroll
		for (int j = 0; j < KM; j++) {
			bool on = r[j] >= 0; /* selects, not a branch around the adds */
			acc.x += on ? v[j].x : 0.0f, acc.y += on ? v[j].y : 0.0f;
			acc.z += on ? v[j].z : 0.0f, acc.w += on ? v[j].w : 0.0f;
		}
		dx[(size_t)t * H4 + h] = acc;
	}
}

template <typename TI>
static void unpermute_launch(cudaStream_t st, int T, int k, int H, const int32_t *pair_row, const TI *dxg, float *dx)
{
	int n = T * k, H4 = H / 4;
	if (H % 4 || (uintptr_t)dxg % (4 * sizeof(TI)) || (uintptr_t)dx % 16)
		tier_launch(unpermute_sum_kernel<TI>, T, TOK_THREADS, 0, st, k, H, n, pair_row, dxg, dx);
	else if (k <= 2)
		tier_launch(unpermute_sum4_kernel<2, TI>, T, TOK_THREADS, 0, st, k, H4, n, pair_row, dxg, (float4 *)dx);
	else if (k <= 4)
		tier_launch(unpermute_sum4_kernel<4, TI>, T, TOK_THREADS, 0, st, k, H4, n, pair_row, dxg, (float4 *)dx);
	else if (k <= 8)
		tier_launch(unpermute_sum4_kernel<8, TI>, T, TOK_THREADS, 0, st, k, H4, n, pair_row, dxg, (float4 *)dx);
	else
		tier_launch(unpermute_sum4_kernel<TIER_MOE_MAX_TOPK, TI>, T, TOK_THREADS, 0, st, k, H4, n, pair_row,
				dxg, (float4 *)dx);
}

extern "C" int moe_cuda_unpermute_sum(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const void *dxg,
				      int dxg_bf16, float *dx)
{
	const char *fn = "moe_cuda_unpermute_sum";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(dxg, fn);
	MOE_NONNULL(dx, fn);
	if (dxg_bf16)
		unpermute_launch(moe_stream(dev), T, k, H, pair_row, (const bf16 *)dxg, dx);
	else
		unpermute_launch(moe_stream(dev), T, k, H, pair_row, (const float *)dxg, dx);
	CUDA_LAUNCHED();
	return 0;
}

/* ---- router ---- */
struct rb_args {
	int kind, E, k, norm, T;
	float rsf, ca, cz; /* ca = d_loss aux_coef E / T; cz = d_loss z_coef 2 / T (times lse per token) */
	int aux;           /* ca or cz != 0: the dense loss terms (counts read) */
};

__device__ static inline float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* One block per token: smem pe [E] softmax (when needed), dle [E] the token's d logits. */
__global__ void router_bwd_kernel(rb_args a, const float *logits, const int32_t *topk_idx, const float *d_topk_w,
				  const int32_t *counts, float *d_logits, bf16 *dl_bf16)
{
	pdl_enter();
	extern __shared__ float sm[];
	float *pe = sm, *dle = sm + a.E;
	__shared__ float red[33];
	__shared__ float dot_all;
	int t = blockIdx.x, E = a.E, k = a.k;
	const float *l = logits + (size_t)t * E;
	const int32_t *idx = topk_idx + (size_t)t * k;
	const float *dw = d_topk_w + (size_t)t * k;
	int dense_softmax = a.kind == TIER_MOE_ROUTER_SOFTMAX_TOPK && !a.norm;
	float lse = 0.0f, pf = 0.0f;
	if (dense_softmax || a.aux) {
		float m = -INFINITY;
		for (int e = threadIdx.x; e < E; e += blockDim.x)
			m = fmaxf(m, l[e]);
		m = block_max(m, red);
		float s = 0.0f;
		for (int e = threadIdx.x; e < E; e += blockDim.x)
			s += (pe[e] = expf(l[e] - m));
		s = block_sum(s, red);
		float inv = 1.0f / s, f = 0.0f;
		lse = m + logf(s);
		for (int e = threadIdx.x; e < E; e += blockDim.x) {
			pe[e] *= inv;
			f += a.aux ? pe[e] * (float)counts[e] / (float)a.T : 0.0f;
		}
		pf = block_sum(f, red); /* its barriers also publish pe */
	}
	if (threadIdx.x == 0) {
		float d = 0.0f;
		if (dense_softmax)
			for (int j = 0; j < k; j++)
				d += pe[idx[j]] * dw[j];
		dot_all = d;
	}
	__syncthreads();
	for (int e = threadIdx.x; e < E; e += blockDim.x) {
		float v = dense_softmax ? -pe[e] * dot_all : 0.0f;
		if (a.aux)
			v += a.ca * pe[e] * ((float)counts[e] / (float)a.T - pf) + a.cz * lse * pe[e];
		dle[e] = v;
	}
	__syncthreads();
	if (threadIdx.x == 0) { /* the k chosen: serial, k <= 16 */
		if (dense_softmax) {
			for (int j = 0; j < k; j++)
				dle[idx[j]] += pe[idx[j]] * dw[j];
		} else if (a.kind == TIER_MOE_ROUTER_SIGMOID_GROUP) {
			float D = a.norm ? 1e-20f : 1.0f, dot = 0.0f;
			for (int j = 0; j < k; j++)
				D += a.norm ? sigm(l[idx[j]]) : 0.0f;
			for (int j = 0; j < k; j++)
				dot += a.norm ? dw[j] * sigm(l[idx[j]]) / D : 0.0f;
			for (int j = 0; j < k; j++) {
				float s = sigm(l[idx[j]]);
				dle[idx[j]] += a.rsf * (dw[j] - dot) / D * s * (1.0f - s);
			}
		} else { /* softmax over the chosen */
			float w[TIER_MOE_MAX_TOPK], m = l[idx[0]], s = 0.0f, dot = 0.0f;
			for (int j = 0; j < k; j++)
				m = fmaxf(m, l[idx[j]]);
			for (int j = 0; j < k; j++)
				s += (w[j] = expf(l[idx[j]] - m));
			for (int j = 0; j < k; j++)
				dot += dw[j] * (w[j] /= s);
			for (int j = 0; j < k; j++)
				dle[idx[j]] += w[j] * (dw[j] - dot);
		}
	}
	__syncthreads();
	for (int e = threadIdx.x; e < E; e += blockDim.x) {
		d_logits[(size_t)t * E + e] = dle[e];
		if (dl_bf16)
			dl_bf16[(size_t)t * E + e] = __float2bfloat16(dle[e]);
	}
}

extern "C" int moe_cuda_router_bwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, const float *logits,
				   const int32_t *topk_idx, const float *d_topk_w, const int32_t *counts, float aux_coef,
				   float z_coef, float d_loss, float *d_logits, void *dl_bf16)
{
	const char *fn = "moe_cuda_router_bwd";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = tier_moe_router_check(cfg)) || (rc = moe_check_tk(fn, T, cfg->top_k, cfg->n_experts)))
		return rc;
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(d_topk_w, fn);
	MOE_NONNULL(d_logits, fn);
	if (!isfinite(aux_coef) || !isfinite(z_coef) || !isfinite(d_loss) || aux_coef < 0 || z_coef < 0)
		return tier_fail(-EINVAL, "%s: loss coefficients and d_loss must be finite (coefficients >= 0)", fn);
	int E = cfg->n_experts, aux = d_loss != 0.0f && (aux_coef > 0 || z_coef > 0);
	if (aux)
		MOE_NONNULL(counts, fn);
	rb_args a = { (int)cfg->kind, E, cfg->top_k, cfg->norm_topk_prob, T,
		      cfg->routed_scaling_factor == 0.0f ? 1.0f : cfg->routed_scaling_factor,
		      d_loss * aux_coef * E / T, d_loss * z_coef * 2.0f / T, aux };
	size_t smem = 2 * sizeof(float) * (size_t)E; /* <= 8 KiB: E <= 1024 */
	tier_launch(router_bwd_kernel, T, TOK_THREADS, smem, moe_stream(dev), a, logits, topk_idx, d_topk_w, counts,
			d_logits, (bf16 *)dl_bf16);
	CUDA_LAUNCHED();
	return 0;
}

/* ---- aux statistics (forward) ---- */
#define AUX_TOKENS 16 /* tokens per block: the per-expert sums go out in one atomic per block */

__global__ void aux_stats_kernel(int T, int E, const float *logits, float *p, float *zs)
{
	pdl_enter();
	extern __shared__ float acc[]; /* [E]: entry e is only touched by thread e % blockDim.x */
	__shared__ float red[33];
	float zacc = 0.0f;
	for (int e = threadIdx.x; e < E; e += blockDim.x)
		acc[e] = 0.0f;
	int t0 = blockIdx.x * AUX_TOKENS, t1 = t0 + AUX_TOKENS < T ? t0 + AUX_TOKENS : T;
	for (int t = t0; t < t1; t++) { /* the same bounds for the whole block: the barriers inside match */
		const float *l = logits + (size_t)t * E;
		float m = -INFINITY, s = 0.0f;
		for (int e = threadIdx.x; e < E; e += blockDim.x)
			m = fmaxf(m, l[e]);
		m = block_max(m, red);
		for (int e = threadIdx.x; e < E; e += blockDim.x)
			s += expf(l[e] - m);
		s = block_sum(s, red);
		float inv = 1.0f / s, lse = m + logf(s);
		for (int e = threadIdx.x; e < E; e += blockDim.x)
			acc[e] += expf(l[e] - m) * inv;
		zacc += lse * lse;
	}
	for (int e = threadIdx.x; e < E; e += blockDim.x)
		atomicAdd(p + e, acc[e]);
	if (threadIdx.x == 0)
		atomicAdd(zs, zacc);
}

extern "C" int moe_cuda_aux_stats(tier_dev *dev, int T, int E, const float *logits, float *p, float *zs)
{
	const char *fn = "moe_cuda_aux_stats";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, 1, E)))
		return rc;
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(p, fn);
	MOE_NONNULL(zs, fn);
	cudaStream_t st = moe_stream(dev);
	CUDA_TRY((cudaError_t)tier_cuda_fill(p, 0, sizeof(float) * (size_t)E, st));
	CUDA_TRY((cudaError_t)tier_cuda_fill(zs, 0, sizeof(float), st));
	tier_launch(aux_stats_kernel, (T + AUX_TOKENS - 1) / AUX_TOKENS, TOK_THREADS, sizeof(float) * (size_t)E, st, T,
			E, logits, p, zs);
	CUDA_LAUNCHED();
	return 0;
}
