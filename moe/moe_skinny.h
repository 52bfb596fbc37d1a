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

/* moe_cuda_grouped_dzdb (moe_lora_dzdb.cu): a LoRA adapter's two products over dY in one pass. For
 * every expert e and its rows i in [off[e], off[e + 1]):
 *     dZ[i, :] = bf16(s dY[i, :] B_e)                      (B_e bf16 [out, r]; dZ bf16 [rows, r])
 *     dB_e    += alpha sum_i dY[i, :]^T Z[i, :]             (dB_e fp32 [out, r]; Z bf16 [rows, r])
 * dY bf16 [rows, out]; sums in fp32. dZ is moe_cuda_grouped_skinny's (w_kn 1, alpha s) bit for bit
 * (the same products in the same order); dB equals moe_cuda_grouped_wgrad's (dY, Z, alpha) to fp32
 * rounding (another order), and is deterministic: the same inputs give the same bits.
 * off: the host's offsets [E + 1] (from 0, nondecreasing; they plan the work), d_off the same on the
 * device (the kernels read the rows from them). db: host array of E device pointers, each 16-byte
 * aligned or NULL (that expert's dB not wanted: its dZ is still written); alpha 0 wants none, and z
 * is read only where some dB is wanted. b: E device pointers, 16-byte aligned (NULL only for
 * experts without rows). Rows outside the groups are neither read nor written; experts without rows
 * are left as they are.
 *
 * Work: chunks of about off[E] / SMs rows, one CTA each, an expert under twice that whole (its CTA
 * owns dB_e: no atomics). A larger expert is split, and its chunks' partial dB go to scratch (16-byte
 * aligned: E counters, then out x r fp32 a chunk); the last of its chunks sums them in chunk order.
 * Without scratch room every expert stays whole: correct, but as slow as the largest group at one
 * SM's rate. Requirements: E in 1..TIER_MOE_MAX_EXPERTS; r 8 or 16; out a multiple of 8, at most
 * moe_cuda_dzdb_max_out (the shared dB, out x 16 fp32, beside three pipeline stages: about 2,900 on
 * an H100 or H200); s and alpha finite; dy, dz (and z where read) 16-byte aligned; off, d_off, db
 * not NULL. -EINVAL on the host before any launch otherwise (dZ, dB untouched); -EIO for a CUDA
 * error. off[E] 0 launches nothing. */
int moe_cuda_grouped_dzdb(tier_dev *dev, int E, int out, int r, const int32_t *off, const int32_t *d_off,
			  const void *const *b, const void *dy, const void *z, float s, float alpha, void *dz,
			  float *const *db, void *scratch, size_t scratch_bytes);
/* The scratch that lets moe_cuda_grouped_dzdb split every expert it would: E counters and a partial
 * dB [out, r] fp32 for each chunk (at most off[E] / 64 + E chunks). */
size_t moe_cuda_dzdb_scratch_bytes(int E, int out, int r, int rows);
/* The largest out moe_cuda_grouped_dzdb takes on dev's GPU; 0 for a context that is not CUDA. */
int moe_cuda_dzdb_max_out(tier_dev *dev);

#ifdef __cplusplus
}
#endif
#endif
