/* moe_cuda.h - the CUDA MoE kernels behind tier/moe.h (moe.cu: router, permute, combine;
 * moe_bwd.cu: the backward of combine, permute and router with the aux and z losses;
 * moe_experts.cu: the SwiGLU experts with LoRA over per-expert cuBLASLt products; moe_grouped.cu:
 * the device-side grouped GEMM of the experts (tensor cores, offsets read on the device);
 * moe_wgrad.cu: the LoRA weight-gradient reductions; moe_layer.cu: the whole block). The public
 * tier_moe_* functions hand a CUDA context to these.
 *
 * All pointers are device memory of the context (expert pointer arrays: host arrays of device
 * pointers); bf16 arrays are __nv_bfloat16 bits (void * here), the rest fp32 or int32 as in
 * tier/moe.h, whose "CUDA" section lists the dtype of each argument. Launches are asynchronous on
 * the context's stream. Returns 0, -EINVAL (bad config or shapes, checked on the host before any
 * launch) or -EIO (CUDA or cuBLASLt error, with its text). Thread-safety as tier/moe.h. */
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
/* xg [pair_row[p]] = x[p / k] for every kept pair p (the gather alone, as backward redoes it: one
 * warp per token reads its row once); rows of no pair are left alone. */
/* The pairs routed to each expert, counts [E] (device), from topk_idx [T*k]; scratch: T*k int32
 * (permute's row_pair will do). The first steps of moe_cuda_permute. */
int moe_cuda_expert_counts(tier_dev *dev, int T, int k, int E, const int32_t *topk_idx, int32_t *counts,
			   int32_t *scratch);
int moe_cuda_gather(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const void *x, void *xg);
int moe_cuda_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const void *y, float *out);
/* The same from the residual res [T, H] fp32 (NULL: from 0): out = res + the combine; out may be res. */
int moe_cuda_combine_fwd_res(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			     const void *y, const float *res, float *out);

/* ---- backward (moe_bwd.cu) ---- */
/* dy [rows, H] bf16 (kept rows written) = w d_out[t]; d_topk_w [T, k] fp32 = d_out[t] . y[row];
 * y and d_topk_w both NULL: dy only. */
int moe_cuda_combine_bwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const void *y, const float *d_out, void *dy, float *d_topk_w);
/* d_topk_w [T, k] fp32 = row_dot[row] / w (tier_moe_combine_dw's rule). */
int moe_cuda_combine_dw(tier_dev *dev, int T, int k, const int32_t *pair_row, const float *topk_w,
			const float *row_dot, float *d_topk_w);
/* dx [T, H] fp32 accumulated with the rows of dxg (fp32) by atomics (the public step). */
int moe_cuda_permute_bwd(tier_dev *dev, int T, int k, int H, const int32_t *offsets, int E,
			 const int32_t *row_pair, const float *dxg, float *dx);
/* dx [T, H] fp32 written: dx_t = sum_j dxg[pair_row(t, j)] (deterministic; the layer's form), in
 * fp32 from dxg fp32 or (dxg_bf16) bf16. */
int moe_cuda_unpermute_sum(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const void *dxg,
			   int dxg_bf16, float *dx);
/* The router's backward fused with the aux and z losses' (counts [E] of the forward, read only when
 * d_loss != 0 and a coefficient > 0): d_logits [T, E] fp32 written, and its bf16 copy dl_bf16 when
 * not NULL. */
int moe_cuda_router_bwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, const float *logits,
			const int32_t *topk_idx, const float *d_topk_w, const int32_t *counts, float aux_coef,
			float z_coef, float d_loss, float *d_logits, void *dl_bf16);
/* p [E] = sum_t softmax(logits_t), zs [1] = sum_t logsumexp(logits_t)^2 (both zeroed first). */
int moe_cuda_aux_stats(tier_dev *dev, int T, int E, const float *logits, float *p, float *zs);

/* ---- experts (moe_experts.cu) ---- */
/* Row-major C [M, N] = alpha op(A) op(B) + beta C with bf16 A, B (row strides lda, ldb), fp32
 * accumulation, C fp32 (c_bf16 0) or bf16 (1). One cuBLASLt call on the context's stream. */
int moe_cuda_mm(tier_dev *dev, int ta, int tb, int M, int N, int K, float alpha, const void *A, int lda,
		const void *B, int ldb, float beta, void *C, int ldc, int c_bf16);
/* The same on lane `lane` of the context (tier_dev_lanes_fork; < 0: the compute stream). */
int moe_cuda_mm_lane(tier_dev *dev, int lane, int ta, int tb, int M, int N, int K, float alpha, const void *A,
		     int lda, const void *B, int ldb, float beta, void *C, int ldc, int c_bf16);
/* Checks of the expert and LoRA pointers against host offsets [E+1] (NULL only for empty experts). */
int moe_cuda_experts_check(const char *fn, int E, const int32_t *offsets_host, const tier_moe_experts *w,
			   const tier_moe_loras *lora);
/* What a forward keeps for its backward (tier_moe_saved's kept_z, kept_cols, h_in_ws, kept): z
 * NULL when not bound; h_ws 1: h may stay in the h scratch for the backward. The forward sets kept
 * to the TIER_MOE_KEPT_* bits of what it left (the grouped products with LoRA inside the wgmma
 * kernels; the other paths nothing); the backward reads what the bits name and computes the rest
 * as without them. */
typedef struct moe_xg_src moe_xg_src;
typedef struct {
	void *z;
	int z_cols, h_ws, kept;
	const moe_xg_src *xg_src; /* backward: not NULL when xg is not yet gathered (below) */
} moe_keep;
/* The backward's xg left to the experts (moe_cuda_layer_bwd): x [T, H] bf16 and the permutation
 * (pair_row, row_pair, top-k). Where the experts' backward reads xg only through the dA
 * reductions, they read x through row_pair (moe_cuda_grouped_wgrad2_rows) and xg is never written;
 * elsewhere it is gathered into xg first (moe_cuda_gather). */
struct moe_xg_src {
	const void *x;
	const int32_t *pair_row, *row_pair;
	int T, k;
	void *xg; /* the xg the backward was given */
};
/* Gathers xg from keep's source where it has one (nothing otherwise). */
int moe_cuda_xg_fill(tier_dev *dev, const moe_keep *keep, int H);
/* Forward over rows 0..offsets_host[E]-1 of xg (bf16): g, u [rows, I] bf16 (LoRA added in fp32,
 * then rounded once), h bf16, y [rows, H] bf16 (LoRA added; NULL: no down product, and h may
 * be left unwritten). z: scratch of moe_lora_z_bytes(rows,
 * max LoRA rank) bytes (NULL without LoRA). gs: fp32 scratch [rows, I] where a product that is not
 * fused with its adapter meets the adapter's add (needed with LoRA on gate or up; the layer passes
 * its backward's dh piece). keep: what it keeps (above), or NULL. */
int moe_cuda_experts_fwd_lora(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
			      const int32_t *offsets_dev, const tier_moe_experts *w, const tier_moe_loras *lora,
			      const void *xg, void *g, void *u, void *h, void *y, void *z, float *gs, moe_keep *keep);
/* y bf16 = x fp32, n elements, on the compute stream. */
int moe_cuda_to_bf16(tier_dev *dev, size_t n, const float *x, void *y);

/* ---- the device-side grouped GEMM (moe_grouped.cu) ----
 * Rows of x (bf16 [rows, K], row stride K) are sorted by expert: expert e owns rows
 * [d_off[e], d_off[e + 1]) of the device offsets [E + 1] (d_off[0] = 0; groups may be empty), which
 * the host need not know: rows_bound >= d_off[E] sizes the grid (more than 65535 row tiles of 64 or
 * 128 is -EINVAL: split the call). w, gate, up: host arrays of E device pointers, 16-byte aligned,
 * NULL only for empty experts. N and K (I and H) multiples of 8; x and the outputs 16-byte aligned.
 * Rows outside every group are not touched. One launch on the context's stream; on -EINVAL nothing
 * was launched.
 * moe_cuda_grouped_mm: C [rows, N] (fp32, or bf16 with c_bf16) = alpha x op(W_e) + beta C over
 * each expert's rows; w_kn 0: W_e bf16 [N, K] (x W_e^T, the forward), 1: W_e bf16 [K, N] (x W_e, as
 * in dX = dY W). alpha finite; beta 0 (C is only written, never read) or 1 (added to, in fp32; a bf16
 * C is read, summed and rounded once).
 * moe_cuda_grouped_gate_up: g = x gate_e^T, u = x up_e^T (gate_e, up_e bf16 [I, H]) bf16 [rows, I]
 * and h = bf16(silu(g) u) [rows, I] (from the fp32 sums), in one pass.
 * When the experts take these instead of the per-expert loop: moe_cuda_experts_grouped_fits. */
int moe_cuda_grouped_mm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
			const void *const *w, int w_kn, const void *x, void *c, int c_bf16, float alpha, float beta);
int moe_cuda_grouped_gate_up(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
			     const void *const *gate, const void *const *up, const void *x, void *g, void *u,
			     void *h);
/* The weight gradients of per-expert LoRA factors (dB_e += s dY_e^T Z_e, dA_e += dZ_e^T X_e): for
 * each expert e with rows, C_e [M, N] fp32 += alpha A_e^T B_e, where A_e and B_e are the rows
 * [d_off[e], d_off[e + 1]) of a (bf16 [rows, M]) and b (bf16 [rows, N]), summed in fp32. c: host
 * array of E device pointers, 16-byte aligned; c[e] NULL: expert e's gradient is not wanted and
 * nothing is written for it; experts without rows are left as they are. Deterministic (one CTA per
 * C tile walks all the group's rows and adds once): the same inputs give the same bits. M and N
 * multiples of 8 (fastest with M or N <= 16, the rank of the LoRA), a and b 16-byte aligned, alpha
 * finite; alpha 0 or no wanted gradient launches nothing. -EINVAL before any launch otherwise. C is
 * added to by one atomic add per element pair: the CTA owns its tile, so the bits stay fixed.
 * Knob (environment, read at each call): TIER_MOE_WGRAD_TILE=64x16|128x16|16x64|16x128|64x64, the
 * C tile of a CTA (default auto: 64 x 16 when N <= 16, 16 x 64 when M <= 16, else 64 x 64; the pair
 * below takes 64 x 64 one product at a time); a malformed value is -EINVAL. tier-bench lora times
 * each tile on the trainer's shapes. TIER_MOE_WGRAD_ADD=rmw: C read, added to and written instead of
 * the atomic add (the form before; comparisons). (moe_wgrad.cu) */
int moe_cuda_grouped_wgrad(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound, const void *a,
			   const void *b, float alpha, float *const *c);
/* Two of them sharing B in one pass over it: C0_e += alpha0 A0_e^T B_e and C1_e += alpha1 A1_e^T B_e,
 * each the one-product call's result bit for bit (the gate's and the up adapter's dA, B = X). */
int moe_cuda_grouped_wgrad2(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound, const void *a0,
			    const void *a1, const void *b, float alpha0, float alpha1, float *const *c0,
			    float *const *c1);
/* Both with B's rows gathered (the backward's dA of gate and up from the layer's x, which then need
 * not be gathered into xg): row r of B is row b_rows[r] / b_div of b (bf16, row stride N; a negative
 * entry is a row of zeros), b_rows the permutation's row_pair and b_div its top-k. The same bits as
 * the calls above on the gathered rows. b_rows NULL or b_div < 1 is -EINVAL. */
int moe_cuda_grouped_wgrad_rows(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
				const void *a, const void *b, const int32_t *b_rows, int b_div, float alpha,
				float *const *c);
int moe_cuda_grouped_wgrad2_rows(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
				 const void *a0, const void *a1, const void *b, const int32_t *b_rows, int b_div,
				 float alpha0, float alpha1, float *const *c0, float *const *c1);
/* The first interface (no LoRA, separate gate / up / down arrays), kept for tests/test_moe_cuda.c. */
int moe_cuda_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
			 const void *const *gate, const void *const *up, const void *const *down,
			 const void *xg, void *g, void *u, void *h, void *y);
/* Backward: dxg [rows, H] fp32 written from dy [rows, H] bf16 and the forward's g, u (bf16); LoRA
 * da, db (fp32) accumulated; row_dot [rows] fp32 = dh . silu(g) u when not NULL.
 * Scratch: h, dg, du bf16 [rows, I]; dh fp32 [rows, I]; z and dz of moe_lora_z_bytes and
 * moe_lora_dz_bytes (rows, max rank) bytes. dx16 not NULL: the grouped wgmma products may write
 * dxg in bf16 instead, a row's sums rounded once as torch's grouped products do (half the bytes
 * written, and half read by moe_cuda_unpermute_sum); *dx16 says whether they did. */
int moe_cuda_experts_bwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
			 const int32_t *offsets_dev, const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, const void *g,
			 const void *u, const void *dy, float *dxg, float *row_dot, void *h, void *dg, void *du,
			 float *dh, void *z, void *dz, const moe_keep *keep, int *dx16);

/* SwiGLU on n elements of bf16 g and u (computed in fp32), h bf16 = silu(g) u; and its backward over
 * rows x I elements, dg, du bf16 from dh fp32, and with row_dot (not NULL) row_dot[r] = dh[r] .
 * silu(g[r]) u[r] (fp32 [rows]). */
int moe_cuda_swiglu(tier_dev *dev, size_t n, const void *g, const void *u, void *h);
int moe_cuda_swiglu_bwd(tier_dev *dev, size_t rows, int I, const void *g, const void *u, const float *dh, void *dg,
			void *du, float *row_dot);
/* The same from dh in bf16 (a product that rounded it), row_dot required. */
/* Whether moe_cuda_experts_bwd with the rows' dot (a layer's backward) rounds dh to bf16 on these
 * experts, adapters and host offsets (the fused LoRA backward under TIER_MOE_DH16), given aligned
 * buffers: what a test's emulation of that backward follows. */
int moe_cuda_experts_dh16(tier_dev *dev, int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
			  const tier_moe_loras *lora);
int moe_cuda_swiglu_bwd16(tier_dev *dev, size_t rows, int I, const void *g, const void *u, const void *dh, void *dg,
			  void *du, float *row_dot);

/* ---- the experts through the grouped GEMMs (moe_experts_grouped.cu) ----
 * Whether they run for these shapes and pointers: TIER_MOE_GROUPED=1 (where everything fits: H, I
 * and LoRA ranks multiples of 8, every pointer, including io[0..n_io-1], 16-byte aligned), 0
 * (never), unset or auto (when it fits and one expert's product of the mean group would not fill
 * the GPU on its own, where the per-expert loop is launch-bound or leaves SMs idle). The forward and backward have the loop's arguments and
 * results (moe_cuda_experts_fwd_lora, moe_cuda_experts_bwd) with the offsets also on the device. */
int moe_cuda_experts_grouped_fits(int E, int H, int I, const int32_t *offsets_host, const tier_moe_experts *w,
				  const tier_moe_loras *lora, const void *const *io, int n_io);
int moe_cuda_experts_fwd_grouped(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
				 const int32_t *offsets_dev, const tier_moe_experts *w, const tier_moe_loras *lora,
				 const void *xg, void *g, void *u, void *h, void *y, void *z, float *gs,
				 moe_keep *keep);
int moe_cuda_experts_bwd_grouped(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
				 const int32_t *offsets_dev, const tier_moe_experts *w, const tier_moe_loras *lora,
				 const void *xg, const void *g, const void *u, const void *dy, float *dxg, float *row_dot,
				 void *h, void *dg, void *du, float *dh, void *z, void *dz, const moe_keep *keep,
				 int *dx16);

/* The public steps on CUDA: offsets on the device (read with one synchronisation), g and u bf16,
 * scratch ws of tier_moe_experts_ws_bytes (more than these need). */
int moe_cuda_experts_fwd_step(tier_dev *dev, int E, int H, int I, const int32_t *offsets, const tier_moe_experts *w,
			      const tier_moe_loras *lora, const void *xg, void *g, void *u, void *y, void *ws);
int moe_cuda_experts_bwd_step(tier_dev *dev, int E, int H, int I, const int32_t *offsets, const tier_moe_experts *w,
			      const tier_moe_loras *lora, const void *xg, const void *g, const void *u, const void *dy,
			      float *dxg, float *row_dot, void *ws);

/* ---- the block (moe_layer.cu): the CUDA side of tier_moe_layer_fwd / _route / _fwd_routed / _bwd
 * / _bwd_routed (counts NULL: the offsets read back) and tier_moe_routing_check ---- */
int moe_cuda_layer_fwd(tier_dev *dev, const tier_moe_cfg *cfg, int T, const void *x, const void *w_r,
		       const float *bias, const tier_moe_experts *w, const tier_moe_loras *lora, float *out,
		       tier_moe_saved *saved, void *ws, size_t ws_bytes);
int moe_cuda_layer_route(tier_dev *dev, const tier_moe_cfg *cfg, int T, const void *x, const void *w_r,
			 const float *bias, tier_moe_saved *saved, void *ws, size_t ws_bytes, int32_t *counts);
int moe_cuda_layer_fwd_routed(tier_dev *dev, const tier_moe_cfg *cfg, int T, const void *x,
			      const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts,
			      const float *res, float *out, tier_moe_saved *saved, void *ws, size_t ws_bytes);
int moe_cuda_layer_bwd(tier_dev *dev, const tier_moe_cfg *cfg, int T, const void *x, const void *w_r,
		       const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *saved,
		       const int32_t *counts, const float *d_out, float d_aux, float *dx, float *dw_r, void *ws,
		       size_t ws_bytes);
int moe_cuda_routing_check(tier_dev *dev);

#ifdef __cplusplus
}
#endif
#endif
