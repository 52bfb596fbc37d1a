/* ops_qk_cuda.cu - the q and k paths between their projections and the attention, one kernel each
 * way (core/ops_cuda.h). Forward (opsc_qk_fwd): the q/k RMSNorm of the projection (fp32, or bf16
 * in the *16 entries: the trainer's projections write bf16 since session 38), the bf16 rounding,
 * RoPE. Backward (opsc_qk_grad): the inverse RoPE of the attention's fp32 gradient, the
 * norm's backward, the bf16 rounding the projection's products read.
 *
 * Separately the backward was three passes over [T, heads, head_dim] (RoPE in place on fp32, the
 * norm's backward fp32 to fp32, the projection's conversion to bf16): for q at 4,096 tokens and 32
 * heads of 128 about 410 MB read and written a layer, here 160 MB; the forward two (the norm, RoPE
 * in place on bf16), 160 MB, here 96. The arithmetic is theirs (attn_cuda.cu's rope_tok_kernel,
 * the rmsnorm kernels), rounding where they round, but for the order of a row's sum. */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "core/ops_cuda.h"
#include "base/cuda_reduce.cuh"
#include "base/pdl.cuh"

typedef __nv_bfloat16 bf16;

#define QK_MAX_HALF 128 /* head_dim up to 256 */
#define QK_WARPS 8      /* rows (heads) of one token per block, in turn */
#define QK_PER (QK_MAX_HALF / 32)

struct qk_args {
	float inv[QK_MAX_HALF]; /* RoPE's inverse frequencies, computed on the host as attn_cuda_rope does */
	const float *dq;
	const void *x;      /* the projection: fp32, or bf16 where the projection wrote bf16 (TX) */
	float *rstd;        /* read by the backward, written by the forward */
	const bf16 *w;
	bf16 *out;
	int64_t tokens;
	int64_t ld;         /* out's elements from one token's row to the next (heads * head_dim unless
			     * the grad writes into a wider buffer: opsc_qk_grad_ld) */
	int S, heads, half;
};

/* Token tok's RoPE angles into shared memory, once for its heads: cos, and sin times sign (-1: the
 * inverse rotation), as rope_tok_kernel makes them. The block's barriers around: the last token's
 * angles are no longer read, and these are written for everyone. */
__device__ __forceinline__ void qk_angles(const qk_args &a, int64_t tok, float sign, float *cs, float *sn)
{
	__syncthreads();
	for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
		float pos = (float)(int)(tok % a.S), s, c;
		sincosf(pos * a.inv[i], &s, &c);
		cs[i] = c, sn[i] = s * sign;
	}
	__syncthreads();
}

/* An element of the projection as fp32, whichever type it was stored in. */
__device__ __forceinline__ float qk_f(float v) { return v; }
__device__ __forceinline__ float qk_f(bf16 v) { return __bfloat162float(v); }

/* One block per token (grid-stride): its angles once into shared memory, then a warp per head row:
 * lane j holds the pairs (i, i + half) for i = j, j + 32, ..., inverse-rotates them, and with a
 * norm takes the row's sum of w d x by lanes then the warp. TX: the projection's type. */
template <typename TX>
__global__ void __launch_bounds__(32 * QK_WARPS) qk_grad_kernel(const __grid_constant__ qk_args a)
{
	pdl_enter();
	__shared__ float cs[QK_MAX_HALF], sn[QK_MAX_HALF];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, dim = 2 * a.half;
	for (int64_t tok = blockIdx.x; tok < a.tokens; tok += gridDim.x) {
		qk_angles(a, tok, -1.0f, cs, sn); /* the inverse rotation */
		for (int hh = warp; hh < a.heads; hh += QK_WARPS) {
			const int64_t row = tok * a.heads + hh;
			const float *dr = a.dq + row * dim;
			float d0[QK_PER], d1[QK_PER];
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half) {
					const float x0 = dr[i], x1 = dr[i + a.half], c = cs[i], sv = sn[i];
					d0[p] = x0 * c - x1 * sv;
					d1[p] = x1 * c + x0 * sv;
				}
			}
			bf16 *o = a.out + tok * a.ld + hh * dim;
			if (!a.w) { /* no norm (Mixtral): the rotated gradient, rounded */
#pragma unroll
				for (int p = 0; p < QK_PER; p++) {
					const int i = lane + 32 * p;
					if (i < a.half)
						o[i] = __float2bfloat16_rn(d0[p]), o[i + a.half] = __float2bfloat16_rn(d1[p]);
				}
				continue;
			}
			const TX *xr = (const TX *)a.x + row * dim;
			const float r = a.rstd[row];
			float s = 0.0f, x0[QK_PER], x1[QK_PER];
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half) {
					x0[p] = qk_f(xr[i]), x1[p] = qk_f(xr[i + a.half]);
					s += __bfloat162float(a.w[i]) * d0[p] * x0[p] + __bfloat162float(a.w[i + a.half]) * d1[p] * x1[p];
				}
			}
			const float c = warp_sum(s) * r * r * r / (float)dim;
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half) {
					const float g0 = __bfloat162float(a.w[i]), g1 = __bfloat162float(a.w[i + a.half]);
					o[i] = __float2bfloat16_rn(r * g0 * d0[p] - x0[p] * c);
					o[i + a.half] = __float2bfloat16_rn(r * g1 * d1[p] - x1[p] * c);
				}
			}
		}
	}
}

/* The forward's counterpart (opsc_qk_fwd): a warp per head row normalises it (the sum of squares by
 * lanes then the warp), rounds to bf16 as the separate norm did, and rotates the rounded pairs;
 * x is read once and the result written once. */
template <typename TX>
__global__ void __launch_bounds__(32 * QK_WARPS) qk_fwd_kernel(const __grid_constant__ qk_args a, float eps)
{
	pdl_enter();
	__shared__ float cs[QK_MAX_HALF], sn[QK_MAX_HALF];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, dim = 2 * a.half;
	for (int64_t tok = blockIdx.x; tok < a.tokens; tok += gridDim.x) {
		qk_angles(a, tok, 1.0f, cs, sn);
		for (int hh = warp; hh < a.heads; hh += QK_WARPS) {
			const int64_t row = tok * a.heads + hh;
			const TX *xr = (const TX *)a.x + row * dim;
			float x0[QK_PER], x1[QK_PER], ss = 0.0f;
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half)
					x0[p] = qk_f(xr[i]), x1[p] = qk_f(xr[i + a.half]), ss += x0[p] * x0[p] + x1[p] * x1[p];
			}
			float r = 1.0f;
			if (a.w) {
				r = rsqrtf(warp_sum(ss) / (float)dim + eps);
				if (lane == 0)
					a.rstd[row] = r;
			}
			bf16 *o = a.out + row * dim;
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i >= a.half)
					continue;
				/* HF: (x * rstd) times the weight, in bf16 (the separate norm's output), then RoPE */
				float y0 = x0[p], y1 = x1[p];
				if (a.w)
					y0 = x0[p] * r * __bfloat162float(a.w[i]), y1 = x1[p] * r * __bfloat162float(a.w[i + a.half]);
				y0 = __bfloat162float(__float2bfloat16_rn(y0)), y1 = __bfloat162float(__float2bfloat16_rn(y1));
				const float c = cs[i], sv = sn[i];
				o[i] = __float2bfloat16_rn(y0 * c - y1 * sv);
				o[i + a.half] = __float2bfloat16_rn(y1 * c + y0 * sv);
			}
		}
	}
}

/* The arguments both kernels take; the checks of both entries. */
static int qk_setup(const char *op, tier_dev *d, const tier_rope_params *r, const void *in, void *out, int norm,
		    const void *x, const void *rstd, qk_args *a)
{
	if (!d || tier_dev_kind_of(d) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", op);
	if (!r || r->head_dim <= 0 || r->head_dim % 2 || r->head_dim / 2 > QK_MAX_HALF || r->tokens < 0 || r->seq <= 0 ||
	    r->n_heads <= 0 || r->seq > INT32_MAX || r->n_heads > INT32_MAX || !(r->theta > 0 && isfinite(r->theta)) ||
	    !in || !out || (norm && (!x || !rstd)))
		return tier_fail(-EINVAL, "%s: bad arguments (head_dim even and at most %d, positive seq and heads, a "
				 "positive finite theta, the input, out, and with a norm also x and rstd)", op,
				 2 * QK_MAX_HALF);
	const int64_t half = r->head_dim / 2;
	for (int64_t i = 0; i < half; i++) /* attn_cuda_rope's table, the same expression */
		a->inv[i] = 1.0f / powf(r->theta, (float)(2 * i) / (float)r->head_dim);
	a->tokens = r->tokens, a->S = (int)r->seq, a->heads = (int)r->n_heads, a->half = (int)half;
	a->ld = r->n_heads * r->head_dim;
	return 0;
}

static int qk_launched(const char *op, const tier_rope_params *r)
{
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return tier_fail(-EIO, "%s (%lld rows): kernel launch failed: %s", op, (long long)(r->tokens * r->n_heads),
				 cudaGetErrorString(e));
	return 0;
}

static unsigned qk_grid(const tier_rope_params *r) { return (unsigned)(r->tokens < 65536 ? r->tokens : 65536); }

/* The forward from a projection of type TX. */
template <typename TX>
static int qk_fwd(const char *op, tier_dev *d, const tier_rope_params *r, const TX *x, const opsc_bf16 *w, float eps,
		  opsc_bf16 *out, float *rstd)
{
	qk_args a;
	int rc = qk_setup(op, d, r, x, out, w != NULL, x, rstd, &a);
	if (rc || r->tokens == 0)
		return rc;
	a.dq = NULL, a.x = x, a.rstd = rstd, a.w = (const bf16 *)w, a.out = (bf16 *)out;
	tier_launch(qk_fwd_kernel<TX>, qk_grid(r), 32 * QK_WARPS, 0, (cudaStream_t)tier_dev_stream(d), a, eps);
	return qk_launched(op, r);
}

extern "C" int opsc_qk_fwd(tier_dev *d, const tier_rope_params *r, const float *x, const opsc_bf16 *w, float eps,
			   opsc_bf16 *out, float *rstd)
{
	return qk_fwd("opsc_qk_fwd", d, r, x, w, eps, out, rstd);
}

extern "C" int opsc_qk_fwd16(tier_dev *d, const tier_rope_params *r, const opsc_bf16 *x, const opsc_bf16 *w, float eps,
			     opsc_bf16 *out, float *rstd)
{
	return qk_fwd("opsc_qk_fwd16", d, r, (const bf16 *)x, w, eps, out, rstd);
}

/* The gradient, the projection of type TX. */
template <typename TX>
static int qk_grad(const char *op, tier_dev *d, const tier_rope_params *r, const float *dq, const TX *x,
		   const opsc_bf16 *w, const float *rstd, opsc_bf16 *out, int64_t ld)
{
	qk_args a;
	int rc = qk_setup(op, d, r, dq, out, w != NULL, x, rstd, &a);
	if (rc || r->tokens == 0)
		return rc;
	if (ld < a.ld)
		return tier_fail(-EINVAL, "%s: out's row stride %lld is below a token's %lld elements (%lld heads of %lld)", op,
				 (long long)ld, (long long)a.ld, (long long)r->n_heads, (long long)r->head_dim);
	a.dq = dq, a.x = x, a.rstd = (float *)rstd, a.w = (const bf16 *)w, a.out = (bf16 *)out, a.ld = ld;
	tier_launch(qk_grad_kernel<TX>, qk_grid(r), 32 * QK_WARPS, 0, (cudaStream_t)tier_dev_stream(d), a);
	return qk_launched(op, r);
}

extern "C" int opsc_qk_grad_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x,
			       const opsc_bf16 *w, const float *rstd, opsc_bf16 *out, int64_t ld)
{
	return qk_grad("opsc_qk_grad", d, r, dq, x, w, rstd, out, ld);
}

extern "C" int opsc_qk_grad16_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const opsc_bf16 *x,
				 const opsc_bf16 *w, const float *rstd, opsc_bf16 *out, int64_t ld)
{
	return qk_grad("opsc_qk_grad16", d, r, dq, (const bf16 *)x, w, rstd, out, ld);
}

extern "C" int opsc_qk_grad(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x,
			    const opsc_bf16 *w, const float *rstd, opsc_bf16 *out)
{
	return opsc_qk_grad_ld(d, r, dq, x, w, rstd, out, r ? r->n_heads * r->head_dim : 0);
}
