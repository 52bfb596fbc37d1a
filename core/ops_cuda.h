/* ops_cuda.h - (internal) the trainer's small CUDA operations: everything around the attention,
 * MoE and loss kernels that a decoder layer and the optimizer need on the GPU.
 *
 * Conventions (the CUDA path of the trainer): frozen weights are bf16; GEMM inputs (normalised
 * activations, attention inputs and outputs) are bf16; the residual stream, projection outputs,
 * every gradient, LoRA master parameters, gradients and AdamW moments are fp32. `bf16` below is
 * __nv_bfloat16 stored as uint16_t in C. Every pointer is device memory of the context unless said
 * otherwise; calls are queued on the context's stream and do not synchronise unless said so.
 * Each returns 0 or -EIO with a message (a CUDA or cuBLASLt error), or -EINVAL for bad sizes.
 * On a build without CUDA every function returns -ENOTSUP. */
#ifndef TIER_CORE_OPS_CUDA_H
#define TIER_CORE_OPS_CUDA_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/model.h"
#include "tier/attn.h"
#include "base/gemm_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t opsc_bf16;

/* y [rows, dim] (bf16) = x * rsqrt(mean(x^2) + eps) * w, statistics in fp32 as HF computes them;
 * x fp32, w bf16 [dim]; rstd [rows] fp32 (may be NULL). */
int opsc_rmsnorm_fwd(tier_dev *d, int rows, int dim, float eps, const float *x, const opsc_bf16 *w,
		     opsc_bf16 *y, float *rstd);
/* dx [rows, dim] fp32 written = r (w dy) - x r^3 / dim * sum(w dy x); x, dy fp32. */
int opsc_rmsnorm_bwd(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
		     const float *dy, float *dx);

/* opsc_rmsnorm_bwd plus a residual's gradient: dx = that dx + res (res fp32 [rows, dim]; it may be
 * dx itself). One pass where a separate add would write and read the norm's dx again. */
int opsc_rmsnorm_bwd_add(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
			 const float *dy, const float *res, float *dx);

/* h [n] (bf16) = silu(g) * u; g, u fp32. Backward: dg, du fp32 written from dh fp32. */
int opsc_swiglu_fwd(tier_dev *d, size_t n, const float *g, const float *u, opsc_bf16 *h);
int opsc_swiglu_bwd(tier_dev *d, size_t n, const float *g, const float *u, const float *dh, float *dg, float *du);

/* out [T, dim] fp32 = table[tokens[t]] (table bf16 [vocab, dim]; tokens int32 device, checked
 * by the caller to lie in 0..vocab-1). */
int opsc_embed_fwd(tier_dev *d, int T, int vocab, int dim, const int32_t *tokens, const opsc_bf16 *table,
		   float *out);

/* out [n] = a + b (fp32; out may be a or b). */
int opsc_add(tier_dev *d, size_t n, const float *a, const float *b, float *out);
/* y [n] (bf16) = x (fp32), rounded to nearest even. */
int opsc_to_bf16(tier_dev *d, size_t n, const float *x, opsc_bf16 *y);
/* y [n] (fp32) = x (bf16), exact. */
int opsc_from_bf16(tier_dev *d, size_t n, const opsc_bf16 *x, float *y);
/* n_seg conversions at once (one launch per 512 segments): dst[i][0..len[i]) = bf16(src[i][...]).
 * src, dst, len are HOST arrays of device pointers and lengths, read during the call (they go in
 * the launches' parameters: nothing is copied to the device first). */
int opsc_to_bf16_many(tier_dev *d, int n_seg, const float *const *src, opsc_bf16 *const *dst, const size_t *len);

/* Linear layer with LoRA on bf16 operands, fp32 accumulation (cuBLASLt):
 *   y [T, out] fp32 (written) = x W^T + scale (x A^T) B^T
 * x bf16 [T, in], W bf16 [out, in]; lora->a bf16 [r, in] and lora->b bf16 [out, r] (passed in the
 * float-typed fields of tier_lora_ref), da, db fp32 (accumulated in backward; NULL: frozen).
 * lora NULL or lora->a NULL: no adapter. lora->dropout p > 0: the adapter (not the base product)
 * sees bf16(x * keep / (1 - p)) with tier_lora_keep's mask of lora->mask_key, in the forward and
 * the backward alike. ws: opsc_linear_ws_bytes(T, in, out, r, p) device bytes (r 0: no adapter;
 * the dropout piece, 4 T in bytes, only when p > 0 and r > 0). */
size_t opsc_linear_ws_bytes(int T, int in, int out, int rank, float dropout);
int opsc_linear_fwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, float *y, void *ws);
/* The same with y in bf16 [T, out]: the adapter's part rounded into y, then the main product added
 * to it by cuBLASLt's beta and the sum rounded (the q, k and v projections, whose outputs are read
 * as bf16 or rounded to it after: no fp32 [T, out] written or read). Always the adapter's part
 * first, whatever $TIER_LORA_FIRST says. */
int opsc_linear_fwd16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		      const tier_lora_ref *lora, opsc_bf16 *y, void *ws);
/* The same plus a residual: y = res + x W^T + the adapter's part, res fp32 [T, out] added in the
 * first product's epilogue (cuBLASLt's C read from res): a decoder's h1 = x + o_proj(o) without a
 * pass of its own. y may be res; res NULL: opsc_linear_fwd. */
int opsc_linear_fwd_res(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			const tier_lora_ref *lora, const float *res, float *y, void *ws);
/* Backward from dy fp32 [T, out]: dx [T, in] fp32 = dy W + scale (dy B) A (written, or added to
 * when accumulate; NULL: not wanted); da += scale (dy B)^T x, db += scale dy^T (x A^T). dy is
 * converted to bf16 in ws for the products. With dropout, x in da and db is the masked x, and the
 * adapter's part of dx goes back through the mask. */
int opsc_linear_bwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, const float *dy, float *dx, int accumulate, void *ws);

/* opsc_linear_bwd from dy already in bf16 [T, out] (no conversion; ws as there, its dy piece
 * unused and needed only with an adapter). */
int opsc_linear_bwd_bf16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const opsc_bf16 *dy16, float *dx, int accumulate, void *ws);

/* opsc_linear_bwd (accumulate 0) with dx in bf16: dx16 [T, in] = bf16(bf16(scale (dy B) A) + dy W),
 * the adapter's gradients as there. No fp32 [T, in] is written or read, except with LoRA dropout or
 * $TIER_LORA_FIRST=0 (ops_cuda.cu; its default is 1), which take opsc_linear_bwd into dx32 (fp32
 * [T, in]; may be NULL otherwise) and convert. */
int opsc_linear_bwd_to16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const float *dy, opsc_bf16 *dx16, float *dx32, void *ws);

/* Several projections of one input x in one backward product (the q, k and v projections of a
 * layer): segment j (out_j, W_j bf16 [out_j, in], its adapter or NULL) has its dy bf16 [T, out_j]
 * in columns off_j .. off_j + out_j of dy (row stride ld), off_0 = 0 and off_{j+1} = off_j + out_j;
 * the columns after the last segment's take each adapter's scale (dy_j B_j), rank_j columns in
 * segment order (written here). Then
 *   dx [T, in] fp32 (written, or added to when accumulate) = sum_j dy_j W_j + scale_j (dy_j B_j) A_j
 * in one product over K = opsc_linear_cat_cols (the weights and the adapters' A stacked into ws),
 * which reads and writes dx once where one product a projection read and wrote it each time, and
 * da_j, db_j as opsc_linear_bwd_bf16 makes them (every adapter's x A^T in one product). No
 * adapter may have dropout. ld >= cols; ws: opsc_linear_cat_ws_bytes. n in 1..OPSC_CAT_MAX. */
#define OPSC_CAT_MAX 4
typedef struct {
	int out;
	const opsc_bf16 *w;
	const tier_lora_ref *lora;
} opsc_lin_seg;
int opsc_linear_cat_cols(int n, const opsc_lin_seg *s);
/* The adapters' columns of those: the sum of their ranks. */
int opsc_linear_cat_ranks(int n, const opsc_lin_seg *s);
size_t opsc_linear_cat_ws_bytes(int T, int in, int n, const opsc_lin_seg *s);
/* The arguments' checks (ops_cat.c, every build): 0 or -EINVAL naming op and the problem. */
int opsc_linear_cat_check(const char *op, int T, int in, const void *x, int n, const opsc_lin_seg *s, const void *dy,
			  int ld, const float *dx, const void *ws);
int opsc_linear_bwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, opsc_bf16 *dy,
			int ld, float *dx, int accumulate, void *ws);
/* The forward of the same segments: y[j] [T, out_j] fp32 (written) = x W_j^T + scale_j (x A_j^T)
 * B_j^T, as opsc_linear_fwd makes each (its order of the parts, TIER_LORA_FIRST), but every
 * adapter's x A^T in one product from their A rows stacked in ws (one pass over x, not one an
 * adapter). No adapter may have dropout. ws: opsc_linear_cat_fwd_ws_bytes. */
size_t opsc_linear_cat_fwd_ws_bytes(int T, int in, int n, const opsc_lin_seg *s);
int opsc_linear_fwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, float *const *y,
			void *ws);
/* y rows [rows, cols] bf16 at row stride ldy = x [rows, cols] fp32 (contiguous), rounded: a piece
 * of a wider bf16 buffer (opsc_linear_bwd_cat's dy). */
int opsc_to_bf16_rows(tier_dev *d, int rows, int cols, const float *x, opsc_bf16 *y, int ldy);

/* The q (or k) path from its projection to the attention (ops_qk_cuda.cu): out [tokens * heads,
 * head_dim] bf16 = RoPE (r: positions t % seq) of bf16(the q/k RMSNorm of x with w, eps), rstd
 * [tokens * heads] written; w NULL: no norm (Mixtral), RoPE of bf16(x), rstd not touched. */
int opsc_qk_fwd(tier_dev *d, const tier_rope_params *r, const float *x, const opsc_bf16 *w, float eps,
		opsc_bf16 *out, float *rstd);
/* The q (or k) gradient between the attention's backward and its projection's (ops_qk_cuda.cu):
 * out [tokens * heads, head_dim] bf16 = the q/k RMSNorm's backward (x: its fp32 input, the
 * projection; w bf16 [head_dim]; rstd from the forward) of dq [tokens * heads, head_dim] fp32 taken
 * back through RoPE (r: the forward's parameters, positions t % seq). w NULL: no norm (Mixtral),
 * the gradient through RoPE alone. dq is read only. head_dim even, up to 256. */
int opsc_qk_grad(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x, const opsc_bf16 *w,
		 const float *rstd, opsc_bf16 *out);

/* opsc_qk_grad with out's tokens ld elements apart (ld >= heads * head_dim): a piece of a wider
 * buffer (opsc_linear_bwd_cat's dy). */
int opsc_qk_grad_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x, const opsc_bf16 *w,
		    const float *rstd, opsc_bf16 *out, int64_t ld);
/* Both from a projection written in bf16 (opsc_linear_fwd16): x bf16, read as its fp32 value; the
 * arithmetic is the fp32 entries' on those values, bit for bit. */
int opsc_qk_fwd16(tier_dev *d, const tier_rope_params *r, const opsc_bf16 *x, const opsc_bf16 *w, float eps,
		  opsc_bf16 *out, float *rstd);
int opsc_qk_grad16_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const opsc_bf16 *x, const opsc_bf16 *w,
		      const float *rstd, opsc_bf16 *out, int64_t ld);

/* *acc (device double) += sum x[i]^2 (fp32 x, summed in fp64 per block). */
int opsc_sumsq(tier_dev *d, size_t n, const float *x, double *acc);
/* PyTorch's AdamW on fp32 p, g, m, v [n]: gj = g * gscale; m = b1 m + (1 - b1) gj;
 * v = b2 v + (1 - b2) gj^2; p = p * decay - lr (m / bc1) / (sqrt(v / bc2) + eps). */
int opsc_adamw(tier_dev *d, size_t n, float *p, const float *g, float *m, float *v, float lr, float b1, float b2,
	       float eps, float decay, float bc1, float bc2, float gscale);
/* opsc_adamw over many tensors at once (the optimizer's batch: one launch per OPSC_ADAMW_MANY,
 * the table passed as the kernel's parameter), each with its own arrays, length and bias
 * corrections; the same arithmetic, so the same bits. Entries of length 0 are skipped. */
typedef struct {
	float *p, *m, *v;
	const float *g;
	size_t n;
	float bc1, bc2;
} opsc_adamw_t;
#define OPSC_ADAMW_MANY 384
int opsc_adamw_many(tier_dev *d, int count, const opsc_adamw_t *t, float lr, float b1, float b2, float eps,
		    float decay, float gscale);

/* Synthetic weights: out [n] bf16 = std * N(0, 1) from a counter-based generator keyed by
 * (seed, index) (deterministic, independent of launch shape); opsc_fill_const writes v. */
int opsc_fill_normal(tier_dev *d, size_t n, uint64_t seed, float std, opsc_bf16 *out);
int opsc_fill_const(tier_dev *d, size_t n, float v, opsc_bf16 *out);

/* Column-major cuBLASLt product C [m x n] fp32 = alpha op(A) op(B) + beta C, fp32 accumulation,
 * A and B of type `type` (CUDA_R_16BF = 14 or CUDA_R_32F = 0), ld as stored; real alignments are
 * passed to cuBLASLt so any size works. Used by the linear layer here and by loss/. The checked
 * front of base/gemm_cuda.h's tier_cuda_gemm (which caches the chosen algorithms), taking also the
 * empty sizes: m or n 0 does nothing, k 0 scales C by beta. */
typedef tier_gemm_operand opsc_operand;
int opsc_gemm(tier_dev *d, int m, int n, int k, float alpha, opsc_operand A, opsc_operand B, float beta, float *C,
	      int ldc);

#ifdef __cplusplus
}
#endif
#endif
