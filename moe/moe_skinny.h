/* moe_skinny.h - the experts' rank-r LoRA products over the permuted rows: a grouped GEMM whose N is
 * the LoRA rank (8..64), bound by reading X once (moe_skinny.cu).
 *
 * moe_cuda_grouped_skinny: for every expert e and every row i in [d_off[e], d_off[e + 1]),
 *     Z_j[i, :] = bf16(alpha X[i, :] W_j,e^T)   (w_kn 0: W_j,e bf16 [r, K] row-major, LoRA A: Z = X A^T)
 *     Z_j[i, :] = bf16(alpha X[i, :] W_j,e)     (w_kn 1: W_j,e bf16 [K, r] row-major, LoRA B as the
 *                                                right operand: dZ = dY B with B [out, r], K = out)
 * for j = 0 and, with nw 2, j = 1: one pass over X serves both (the gate and up LoRA A products read
 * the same X). X is bf16 [rows, K] (row stride K), Z_j bf16 [rows, r] (row stride r), summed in fp32
 * and rounded once. d_off: device int32 [E + 1], nondecreasing, d_off[0] = 0, d_off[E] <= rows_bound;
 * the host need not know them (rows_bound bounds the launch; row tiles past the last group exit).
 * Rows outside [0, d_off[E]) are neither read from X nor written to Z_j, so X needs only d_off[E]
 * rows and Z_j may hold anything (NaN) before: the rows of the groups are only written.
 *
 * w0 (and w1 with nw 2) are host arrays of E device pointers, each 16-byte aligned; an entry may be
 * NULL only for an expert without rows (it is never read). w1 and z1 are ignored with nw 1. Z_j must
 * not overlap X or each other.
 *
 * Requirements: E in 1..TIER_MOE_MAX_EXPERTS; r a multiple of 8 from 8 to 64; K a positive multiple
 * of 8; nw 1 or 2; w_kn 0 or 1; rows_bound >= 0; alpha finite; d_off, x, z0 (z1 with nw 2), w0 (w1)
 * not NULL; x and the Z_j 16-byte aligned. rows_bound 0 launches nothing.
 *
 * Returns 0 (one launch queued on the context's stream); -EINVAL for bad arguments and -ENOTSUP for a
 * device context that is not CUDA (both checked on the host: nothing launched, Z untouched); -EIO for
 * a CUDA error (its text in the message).
 *
 * Knob (environment, read at each call): TIER_MOE_SKINNY_ROWS=64|128, the rows of a CTA tile
 * (default 64; 128 halves the shared-memory and L2 traffic of W per byte of X, and applies only where
 * nw r <= 64: larger products keep 64 rows). A malformed value is -EINVAL. */
#ifndef TIER_MOE_SKINNY_H
#define TIER_MOE_SKINNY_H

#include <stdint.h>
#include "tier/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

int moe_cuda_grouped_skinny(tier_dev *dev, int E, int r, int K, const int32_t *d_off, int rows_bound, int nw,
			    const void *const *w0, const void *const *w1, int w_kn, const void *x, void *z0, void *z1,
			    float alpha);

#ifdef __cplusplus
}
#endif
#endif
