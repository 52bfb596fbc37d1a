/* ops_qk_cuda.cu - the attention's q and k gradients between the attention backward and their
 * projections' backward in one kernel (opsc_qk_grad, core/ops_cuda.h): the inverse RoPE of the
 * fp32 gradient, the q/k RMSNorm's backward, the bf16 rounding the projection's products read.
 *
 * Separately these were three passes over [T, heads, head_dim] (RoPE in place on fp32, the norm's
 * backward fp32 to fp32, the projection's conversion to bf16): for q at 4,096 tokens and 32 heads
 * of 128 about 410 MB read and written a layer, here 160 MB. The arithmetic is theirs
 * (attn_cuda.cu's rope_tok_kernel, rmsnorm_bwd4_kernel) but for the order of the row's sum. */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "core/ops_cuda.h"
#include "base/cuda_reduce.cuh"

typedef __nv_bfloat16 bf16;

#define QK_MAX_HALF 128 /* head_dim up to 256 */
#define QK_WARPS 8      /* rows (heads) of one token per block, in turn */
#define QK_PER (QK_MAX_HALF / 32)

struct qk_args {
	float inv[QK_MAX_HALF]; /* RoPE's inverse frequencies, computed on the host as attn_cuda_rope does */
	const float *dq, *x, *rstd;
	const bf16 *w;
	bf16 *out;
	int64_t tokens;
	int S, heads, half;
};

/* One block per token (grid-stride): its angles once into shared memory, then a warp per head row:
 * lane j holds the pairs (i, i + half) for i = j, j + 32, ..., inverse-rotates them, and with a
 * norm takes the row's sum of w d x by lanes then the warp. */
__global__ void __launch_bounds__(32 * QK_WARPS) qk_grad_kernel(const __grid_constant__ qk_args a)
{
	__shared__ float cs[QK_MAX_HALF], sn[QK_MAX_HALF];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, dim = 2 * a.half;
	for (int64_t tok = blockIdx.x; tok < a.tokens; tok += gridDim.x) {
		__syncthreads(); /* the last token's angles are no longer read */
		for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
			float pos = (float)(int)(tok % a.S), s, c;
			sincosf(pos * a.inv[i], &s, &c);
			cs[i] = c, sn[i] = -s; /* the inverse rotation */
		}
		__syncthreads();
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
			bf16 *o = a.out + row * dim;
			if (!a.w) { /* no norm (Mixtral): the rotated gradient, rounded */
#pragma unroll
				for (int p = 0; p < QK_PER; p++) {
					const int i = lane + 32 * p;
					if (i < a.half)
						o[i] = __float2bfloat16_rn(d0[p]), o[i + a.half] = __float2bfloat16_rn(d1[p]);
				}
				continue;
			}
			const float *xr = a.x + row * dim, r = a.rstd[row];
			float s = 0.0f;
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half)
					s += __bfloat162float(a.w[i]) * d0[p] * xr[i] +
					     __bfloat162float(a.w[i + a.half]) * d1[p] * xr[i + a.half];
			}
			const float c = warp_sum(s) * r * r * r / (float)dim;
#pragma unroll
			for (int p = 0; p < QK_PER; p++) {
				const int i = lane + 32 * p;
				if (i < a.half) {
					const float g0 = __bfloat162float(a.w[i]), g1 = __bfloat162float(a.w[i + a.half]);
					o[i] = __float2bfloat16_rn(r * g0 * d0[p] - xr[i] * c);
					o[i + a.half] = __float2bfloat16_rn(r * g1 * d1[p] - xr[i + a.half] * c);
				}
			}
		}
	}
}

extern "C" int opsc_qk_grad(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x,
			    const opsc_bf16 *w, const float *rstd, opsc_bf16 *out)
{
	const char *op = "opsc_qk_grad";
	if (!d || tier_dev_kind_of(d) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", op);
	if (!r || r->head_dim <= 0 || r->head_dim % 2 || r->head_dim / 2 > QK_MAX_HALF || r->tokens < 0 || r->seq <= 0 ||
	    r->n_heads <= 0 || r->seq > INT32_MAX || r->n_heads > INT32_MAX || !dq || !out || (w && (!x || !rstd)))
		return tier_fail(-EINVAL, "%s: bad arguments (head_dim even and at most %d, positive seq and heads, dq, "
				 "out, and with w also x and rstd)", op, 2 * QK_MAX_HALF);
	if (r->tokens == 0)
		return 0;
	qk_args a;
	const int64_t half = r->head_dim / 2;
	for (int64_t i = 0; i < half; i++) /* attn_cuda_rope's table, the same expression */
		a.inv[i] = 1.0f / powf(r->theta, (float)(2 * i) / (float)r->head_dim);
	a.dq = dq, a.x = x, a.rstd = rstd, a.w = (const bf16 *)w, a.out = (bf16 *)out;
	a.tokens = r->tokens, a.S = (int)r->seq, a.heads = (int)r->n_heads, a.half = (int)half;
	const unsigned grid = (unsigned)(r->tokens < 65536 ? r->tokens : 65536);
	qk_grad_kernel<<<grid, 32 * QK_WARPS, 0, (cudaStream_t)tier_dev_stream(d)>>>(a);
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return tier_fail(-EIO, "%s (%lld rows): kernel launch failed: %s", op, (long long)(r->tokens * r->n_heads),
				 cudaGetErrorString(e));
	return 0;
}
