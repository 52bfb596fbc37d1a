/* moe_wgmma.h - the experts' grouped GEMMs on Hopper tensor cores (wgmma, sm_90a; moe_wgmma.cu).
 *
 * Rows of x (bf16 [rows, K], row stride K) are sorted by expert: expert e owns rows
 * [d_off[e], d_off[e + 1]) of the device offsets [E + 1] (groups may be empty), which the host need
 * not know: rows_bound >= d_off[E] bounds the work (row tiles past it are never computed). Weights
 * come as a host array of E device pointers, bf16, 16-byte aligned, NULL only for empty experts.
 * Rows outside every group are never touched. E in 1..TIER_MOE_MAX_EXPERTS; x and every output
 * 16-byte aligned.
 *
 * moe_cuda_grouped_mm_sm90: for every row r of expert e,
 *     C[r, :] = alpha x[r, :] W_e^T + beta C[r, :]   (w_kn 0: W_e [N, K] row-major, the forward)
 *     C[r, :] = alpha x[r, :] W_e   + beta C[r, :]   (w_kn 1: W_e [K, N] row-major, e.g. dX = dY W)
 * with C [rows, N] row-major, fp32 (c_bf16 0) or bf16 (c_bf16 1: the sum in fp32, rounded once).
 * beta is 0 (C only written: it may hold NaN) or 1. N and K multiples of 8.
 *
 * moe_cuda_grouped_gate_up_sm90: the experts' gate and up products and SwiGLU in one pass over x
 * (K = H): for every row r of expert e, with gate_e and up_e bf16 [I, H] row-major,
 *     g[r, :] = x[r, :] gate_e^T,  u[r, :] = x[r, :] up_e^T   (fp32 [rows, I])
 *     h[r, :] = bf16(silu(g[r, :]) u[r, :]), silu(v) = v / (1 + exp(-v))   (bf16 [rows, I])
 * g, u and h only written (they may hold NaN before); H and I multiples of 8; g, u and h must not
 * overlap.
 *
 * Both: one persistent launch on the context's stream. Return 0; -EINVAL for bad arguments and
 * -ENOTSUP on a device whose compute capability is not 9.0 (both checked on the host: nothing was
 * launched, the outputs untouched); -EIO for a CUDA error (its text in the message).
 *
 * Tuning and testing knobs (environment, read at each call):
 *   TIER_MOE_WGMMA_TILE=128x256|128x128|64x256  the CTA tile (rows x columns of the product;
 *                                               gate/up: of g and u together, half of it each).
 *                                               Default: 64x256 when groups of the mean size
 *                                               rows_bound / E fill 64-row tiles 1.2x better than
 *                                               128-row ones, else 128x256 (128x128 when N <= 128,
 *                                               gate/up: I <= 64).
 *   TIER_MOE_WGMMA_CTAS=n                       at most n CTAs (default one per SM); small values
 *                                               push many tiles through each CTA's ring.
 * A malformed value is -EINVAL. */
#ifndef TIER_MOE_WGMMA_H
#define TIER_MOE_WGMMA_H

#include <stdint.h>
#include "tier/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when dev is a CUDA context on a compute capability 9.0 device (the kernel's sm_90a code runs
 * there and nowhere else), else 0. */
int moe_cuda_wgmma_supported(tier_dev *dev);

int moe_cuda_grouped_mm_sm90(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
			     const void *const *w, int w_kn, const void *x, void *c, int c_bf16, float alpha, float beta);

int moe_cuda_grouped_gate_up_sm90(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
				  const void *const *gate, const void *const *up, const void *x, float *g, float *u,
				  void *h);

#ifdef __cplusplus
}
#endif
#endif
