/* moe_cuda.h - the first CUDA kernels of the MoE block (moe.cu): fused router score + top-k,
 * permute (histogram, scan, stable placement, gather), the weighted combine and the SwiGLU
 * experts' forward (per-expert cuBLASLt products). Not yet behind the
 * public API: tier_moe_* still answer -ENOTSUP on a CUDA context until the backward kernels, LoRA
 * on CUDA and a dtype-aware public signature exist; tests/test_moe_cuda.c drives these against the
 * CPU reference.
 *
 * All pointers are device memory of the context; x, w_r, xg and y are bf16 (__nv_bfloat16 bits),
 * the rest fp32 or int32 as in tier/moe.h. Launches are asynchronous on the context's stream.
 * Returns 0, -EINVAL (bad config or shapes, checked on the host before any launch) or -EIO (CUDA
 * error, with its text). Thread-safety as tier/moe.h. */
#ifndef TIER_MOE_CUDA_H
#define TIER_MOE_CUDA_H

#include <stdint.h>
#include "tier/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

int moe_cuda_router_fwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, int H, const void *x,
			const void *w_r, const float *bias, float *logits, int32_t *topk_idx, float *topk_w);
int moe_cuda_permute(tier_dev *dev, int T, int k, int E, int H, int capacity, const int32_t *topk_idx,
		     const void *x, int32_t *offsets, int32_t *row_pair, int32_t *pair_row, int32_t *counts,
		     void *xg);
int moe_cuda_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const void *y, float *out);
/* SwiGLU experts over the permuted rows, one cuBLASLt product per expert and projection (bf16 in,
 * fp32 accumulate): g, u [rows, I] fp32, h = silu(g) u [rows, I] bf16, y = h down^T [rows, H]
 * bf16. offsets_host: a host copy of the offsets (the caller synchronises once to read them);
 * gate, up, down: host arrays of device pointers to bf16 [I, H], [I, H], [H, I]. No LoRA yet. */
int moe_cuda_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
			 const void *const *gate, const void *const *up, const void *const *down,
			 const void *xg, float *g, float *u, void *h, void *y);

#ifdef __cplusplus
}
#endif
#endif
