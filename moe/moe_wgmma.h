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
 *     g[r, :] = x[r, :] gate_e^T,  u[r, :] = x[r, :] up_e^T   (bf16 [rows, I])
 *     h[r, :] = bf16(silu(g[r, :]) u[r, :]), silu(v) = v / (1 + exp(-v))   (bf16 [rows, I])
 * (h from the fp32 sums, before g and u are rounded)
 * g, u and h only written (they may hold NaN before); H and I multiples of 8; g, u and h must not
 * overlap.
 *
 * Extra K segments (the _segs and _lora forms): a segment adds, for every row r of expert e,
 *     x0[r, :] op(W0_e) + x1[r, :] op(W1_e)
 * to the product before alpha and beta, with x0 bf16 [rows, K0] and x1 [rows, K1] (row strides K0
 * and K1) and W0_e, W1_e in the product's layout with K0 and K1 for K (w_kn 0: [N, K0]; 1: [K0, N]).
 * K0 and K1 are multiples of 8; one of them may be 0 (that half's x and w are not read). This is how
 * LoRA joins a product without another pass over C: y = h down^T + Z B^T takes x0 = Z = s h A^T and
 * W0 = B; dX = dG gate + dU up + dZ_g A_g + dZ_u A_u takes one segment (dU, up) and one (dZ_g, A_g;
 * dZ_u, A_u). In the gate/up product a segment's first half goes to g only and its second to u:
 * g += x0 W0_e^T, u += x1 W1_e^T (W0_e [I, K0], W1_e [I, K1]: the two adapters' B), before SwiGLU.
 * The segments' weight tables are written into `tab` (MOE_WG_TAB_BYTES of device memory, 16-byte
 * aligned) by a small kernel on the same stream, so tab may be reused by the next call at once.
 *
 * All: one persistent launch on the context's stream (and one or two table copies with segments). Return 0; -EINVAL for bad arguments and
 * -ENOTSUP on a device whose compute capability is not 9.0 (both checked on the host: nothing was
 * launched, the outputs untouched); -EIO for a CUDA error (its text in the message).
 *
 * Tuning and testing knobs (environment, read at each call):
 *   TIER_MOE_WGMMA_TILE=128x256|128x128|64x256|pp64x256|pp128x128|swap
 *       the tile (rows x columns of the product; gate/up: of g and u together, half of it each).
 *       The first three are one tile a CTA, both consumer warpgroups on it; the pp ones are one
 *       tile a consumer warpgroup, the two taking turns (ping-pong: one stores while the other
 *       multiplies). Default: 64x256 when groups of the mean size rows_bound / E fit one 64-row
 *       tile; else for the forward's products (w_kn 0, gate/up) with N > 128 (gate/up: I > 64)
 *       and K >= 256 with cp.async loads (TIER_MOE_WGMMA_TMA=0), pp64x256 up to a mean of 192
 *       rows (with the TMA loads 128x256 won there since session 29); else
 *       128x256 (128x128 when N <= 128, gate/up: I <= 64).
 *       swap (session 36, off; passes test_moe_wgmma on an H100): moe_cuda_grouped_mm_sm90
 *       with w_kn 0 and no extra segment computes C^T = W_e X^T per group (moe_wgmma_swap.cu), the
 *       group's rows as wgmma's N in multiples of 32 (up to 256 a tile) instead of its M in blocks
 *       of 64: a group of 146 rows multiplies 160 instead of 192 or 256. It needs the TMA loads (not
 *       under TIER_MOE_WGMMA_TMA=0 or TIER_MOE_WGMMA_DEBUG: then the default tile); every other
 *       product takes its default tile.
 *   TIER_MOE_WGMMA_CTAS=n       at most n CTAs (default one per SM; on CTA pairs n / 2 pairs, at
 *                               least one); small values push many tiles through each CTA's ring.
 *   TIER_MOE_WGMMA_DEBUG=nostore|nomma|noload
 *       for measurements only, the outputs are wrong: the forward's products (w_kn 0, gate/up) on
 *       the 128x256 tiles (pp128x128 where TIER_MOE_WGMMA_TILE asks for it) leave out the stores,
 *       the products or the loads, to see which part bounds the time. The 128x256 kernels load
 *       through TMA as the products do (cp.async under TIER_MOE_WGMMA_TMA=0, or with segments);
 *       nostore keeps the epilogue behind a branch no call takes, so the products stay in the
 *       code (before session 28 ptxas dropped them and nostore timed the loads alone).
 *   TIER_MOE_WGMMA_TMA=all|1|0|require
 *       all (the default since session 24, also unset or empty): the loads go through TMA, one
 *       producer thread and a tensor map per expert (base/tmap_cuda.h), where they apply: every
 *       product but gate/up on its cooperative 64x256 tiles (its two consumers would split g from
 *       u) and the measurement kernels. The main part and the extra segments with one half (K0 or
 *       K1 0) load by TMA, the other segments by cp.async from the producer warpgroup. The maps
 *       are written on the device by a small kernel into stream-ordered memory (cudaMallocAsync)
 *       at each call. TMA reads x (and a segment's x0 or x1) as rows_bound rows, rows past
 *       offsets[E] too (never stored): the buffers must hold them. 1 (the default before session
 *       24): as all, but gate/up with a segment on cp.async (its TMA form hung in session 9,
 *       before the fix of the producers' named barrier; it has passed since; test_moe_wgmma runs
 *       both forms, and in a build whose NVCCFLAGS add -DTIER_WG_WATCHDOG=1 a wait over 2 s is
 *       reported as -EIO naming the barrier, and the kernel ends instead of hanging). 0: cp.async
 *       everywhere (128 producer threads). require: as 1, and -EINVAL for a product that would
 *       take cp.async (tests: no silent fallback). A driver without cuTensorMapEncodeTiled takes
 *       cp.async.
 *   TIER_MOE_WGMMA_CLUSTER=2|1
 *       2: the products on 128x256 or 128x128 tiles (TIER_MOE_WGMMA_TILE or the default pick) with
 *       TMA loads run on CTA pairs (clusters of 2) that share B: a pair takes 256 rows of one
 *       expert (a group's tile count rounded up to even), each CTA loads its own 128 rows of A and
 *       half of the main segment's B, multicast to both, so the weights cross from L2 to shared
 *       memory once for the pair (extra segments load whole in each CTA). The others run as under
 *       1 (the default): one CTA a tile.
 *       moe_cuda_wgmma_pair_launches counts the launches on pairs.
 *   TIER_MOE_WGMMA_EPI=tma|copy
 *       tma: the bf16 outputs (beta 0: gate/up's g, u and h, a bf16 C) of the products on 128x256 or
 *       128x128 tiles with TMA loads and one CTA a tile leave by TMA stores of 64 x 32 subtiles
 *       from two stagings a consumer, issued by one thread while the consumer goes back to its
 *       products; a 64-row block cut by its group's end is stored by the threads. copy (the
 *       default): the threads copy every block out of the staging. First run in session 30 (H200):
 *       it passes the tests and is 2-6% slower than copy (the consumers still store together
 *       while the tensor cores wait; the TMA stores only add barriers); stays off.
 *       moe_cuda_wgmma_tma_store_launches counts its launches.
 *   TIER_MOE_WGMMA_IDLE=1|0
 *       1: in the cooperative 128-row tiles a consumer whose 64 rows all lie past its group's end
 *       (the second consumer of a group's last tile when that holds 64 rows or fewer; with CTA
 *       pairs also the second CTA's whole half) skips its products and only hands the ring's
 *       stages back, so the other consumer has the tensor cores alone. 0: every consumer
 *       multiplies its rows, in or out of the group. Unset or empty (the default): 1 where the
 *       tiles are claimed from a counter (the dynamic schedule, below), else 0. In the fixed order it is
 *       correct and up to 1.63x slower (session 31, H100, seed-896 uniform gate-up-mm 1.77 ->
 *       2.88 ms): an expert's row tiles of one column tile share its weights through L2 only
 *       while the CTAs run in lockstep (every tile the same cost); a tile that idles lets its CTA
 *       run ahead, and the weights come from HBM twice. Claimed in turn they keep the reuse
 *       (session 32, H100).
 *   TIER_MOE_WGMMA_SCHED=dynamic|static
 *       dynamic: in the cooperative one-CTA kernels with TMA loads (the defaults' kernels; not
 *       ping-pong, CTA pairs, cp.async or the measurement kernels) the CTAs claim their tiles in
 *       order from a counter of the launch, which the TMA map kernel zeroes, instead of CTA b
 *       taking tiles b, b + grid, ...: the row tiles that share an expert's weights then start
 *       close together whatever each costs, which idle consumers need (above). The producer's
 *       TMA thread claims each tile STAGES stages before the previous tile's last load and posts
 *       it in a ring of 8 slots in shared memory that the consumers (and the producer's other
 *       threads where they load segments by cp.async) read. static: the fixed order
 *       (moe_cuda_wgmma_fixed_launches counts the launches that took it where the dynamic
 *       schedule could have run). Unset or empty (the default): dynamic where the mean group
 *       (rows_bound / E) is at most 192 rows, where 128-row tiles pad most, else static. First run
 *       in session 32 (H100, seed-896): correct; with idle consumers 0.92-0.96x the fixed order's
 *       time in every product but uniform gate-up-mm (1.04x, with the claim after the last load,
 *       since moved), the experts' backward 0.73x. Session 34 (H100): seed-896's block
 *       forward+backward 0.87x (uniform) and 0.94x (Zipf 1.2); qwen3-30b's (1024 rows a group)
 *       1.00x and 0.98x; the trainer's (a) (768 rows a group) 0.99x the tokens/s.
 *       moe_cuda_wgmma_dynamic_launches counts its launches.
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

/* moe_cuda_wgmma_supported, and TIER_MOE_WGMMA is not 0 (the knob that keeps the experts' grouped
 * products on mma.sync): whether the experts take these kernels. */
int moe_cuda_wgmma_on(tier_dev *dev);

/* The launches so far (this process) that ran on CTA pairs (TIER_MOE_WGMMA_CLUSTER=2), with the
 * TMA-store epilogue (TIER_MOE_WGMMA_EPI=tma), and that claimed their tiles from a counter
 * (TIER_MOE_WGMMA_SCHED=dynamic). */
unsigned long long moe_cuda_wgmma_pair_launches(void);
unsigned long long moe_cuda_wgmma_tma_store_launches(void);
unsigned long long moe_cuda_wgmma_dynamic_launches(void);
/* The launches of kernels that take the dynamic schedule but ran in the fixed order
 * (TIER_MOE_WGMMA_SCHED=static, or unset where the mean group exceeds 192 rows). */
unsigned long long moe_cuda_wgmma_fixed_launches(void);
/* The launches of the plain forward product on swapped operands (TIER_MOE_WGMMA_TILE=swap). */
unsigned long long moe_cuda_wgmma_swap_launches(void);

int moe_cuda_grouped_mm_sm90(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
			     const void *const *w, int w_kn, const void *x, void *c, int c_bf16, float alpha, float beta);

/* An extra K segment (above). */
typedef struct {
	const void *x0, *x1;               /* bf16 [rows, K0], [rows, K1] */
	const void *const *w0, *const *w1; /* host arrays of E device pointers */
	int K0, K1;
} moe_wg_seg;
#define MOE_WG_SEGS 2 /* extra segments a product takes */
#define MOE_WG_TAB_BYTES ((size_t)2 * MOE_WG_SEGS * TIER_MOE_MAX_EXPERTS * sizeof(void *))

int moe_cuda_grouped_mm_sm90_segs(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
				  const void *const *w, int w_kn, const void *x, int nseg, const moe_wg_seg *seg,
				  void *tab, void *c, int c_bf16, float alpha, float beta);

/* The experts' dh = dY down_e (+ the segments: dZ_d A_d) with SwiGLU's backward in the epilogue: for
 * every row r of expert e, down_e bf16 [H, I] row-major (the [K, N] of the product, N = I, K = H),
 *     dh[r, :] = bf16(dY[r, :] down_e + segments)   (never written)
 *     dg[r, :], du[r, :] = SwiGLU's backward at g, u (bf16 [rows, I]) and dh, as
 *                          moe_cuda_swiglu_bwd16 gives them (the same bits)
 *     row_dot[r] = dh[r, :] . silu(g[r, :]) u[r, :]   (fp32; summed in another order than
 *                          moe_cuda_swiglu_bwd16's, so equal to rounding)
 * dot_scratch: rows_bound x ceil(I / 128) floats of device memory (per 128-column slot partial
 * sums, added up in slot order by a second small kernel). Rows outside the groups are untouched in
 * dg, du and row_dot. One launch of the product and one of the
 * sum; the rows kernel's pass over g, u and dh, and dh's write and read, are gone. dg, du must not
 * overlap g, u; all bf16 arrays 16-byte aligned. Return values as below. */
int moe_cuda_grouped_dh_swiglu_sm90(tier_dev *dev, int E, int I, int H, const int32_t *d_off, int rows_bound,
				    const void *const *down, const void *dy, int nseg, const moe_wg_seg *seg, void *tab,
				    const void *g, const void *u, void *dg, void *du, float *row_dot,
				    float *dot_scratch);

/* lora: NULL, or one segment (gate's half x0 W0, up's x1 W1). */
int moe_cuda_grouped_gate_up_sm90_lora(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
				       const void *const *gate, const void *const *up, const void *x,
				       const moe_wg_seg *lora, void *tab, void *g, void *u, void *h);

int moe_cuda_grouped_gate_up_sm90(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
				  const void *const *gate, const void *const *up, const void *x, void *g, void *u,
				  void *h);

#ifdef __cplusplus
}
#endif
#endif
