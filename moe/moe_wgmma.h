/* moe_wgmma.h - the experts' grouped GEMM on Hopper tensor cores (wgmma, sm_90a; moe_wgmma.cu).
 *
 * Rows of x (bf16 [rows, K], row stride K) are sorted by expert: expert e owns rows
 * [d_off[e], d_off[e + 1]) of the device offsets [E + 1] (groups may be empty), which the host need
 * not know: rows_bound >= d_off[E] bounds the work (row tiles past it are never computed). w: a host
 * array of E device pointers, W_e bf16 [N, K] row-major, 16-byte aligned, NULL only for empty
 * experts. For every row r of expert e:
 *     C[r, :] = alpha x[r, :] W_e^T + beta C[r, :]
 * with C [rows, N] row-major, fp32 (c_bf16 0) or bf16 (c_bf16 1: the sum in fp32, rounded once).
 * beta is 0 (C only written: it may hold NaN) or 1. Rows outside every group are not touched.
 * N and K multiples of 8, E in 1..TIER_MOE_MAX_EXPERTS, x and c 16-byte aligned.
 *
 * One persistent launch on the context's stream. Returns 0; -EINVAL for bad arguments and
 * -ENOTSUP on a device whose compute capability is not 9.0 (both checked on the host: nothing
 * was launched); -EIO for a CUDA error (its text in the message).
 *
 * Tuning and testing knobs (environment, read at each call):
 *   TIER_MOE_WGMMA_TILE=128x256|128x128|64x256  the CTA tile (rows x columns). Default: 64x256
 *                                               when groups of the mean size rows_bound / E fill
 *                                               64-row tiles 1.2x better than 128-row ones, else
 *                                               128x256 (128x128 when N <= 128).
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
			     const void *const *w, const void *x, void *c, int c_bf16, float alpha, float beta);

#ifdef __cplusplus
}
#endif
#endif
