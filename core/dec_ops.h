/* dec_ops.h - (internal) the decoder's small operations on either device: the CPU reference
 * (tier/model.h's layer functions, fp32 everywhere) or the CUDA kernels of core/ops_cuda.h (bf16
 * weights and GEMM inputs, fp32 residual stream and gradients). Pointers typed void are "weight"
 * (w) or "activation" (x, y of norms and linears) element types: fp32 on the CPU, bf16 on CUDA. */
#ifndef TIER_CORE_DEC_OPS_H
#define TIER_CORE_DEC_OPS_H

#include "core/core_internal.h"
#include "tier/attn.h"

/* Bytes per activation element that feeds a product: 4 on the CPU, 2 on CUDA. */
static inline size_t dop_act_size(const tier_model *m) { return m->cuda ? 2 : sizeof(float); }

int dop_norm(const tier_model *m, int rows, int dim, const float *x, const void *w, void *y, float *rstd);
int dop_norm_bwd(const tier_model *m, int rows, int dim, const float *x, const void *w, const float *rstd,
		 const float *dy, float *dx);
/* dop_norm_bwd plus a residual's gradient: dx = the norm's dx + res (CUDA in one pass; the CPU
 * adds after, through scratch tmp [rows, dim] fp32). */
int dop_norm_bwd_add(const tier_model *m, int rows, int dim, const float *x, const void *w, const float *rstd,
		     const float *dy, const float *res, float *dx, float *tmp);
/* Workspace bytes of the model's linear layers: at most `in` inputs and `out` outputs, LoRA rank r
 * (0: none) with the model's LoRA dropout. */
size_t dop_linear_ws(const tier_model *m, int T, int in, int out, int r);
int dop_linear(const tier_model *m, int T, int in, int out, const void *x, const void *w, const tier_lora_ref *l,
	       float *y, void *ws);
/* dop_linear with y in the activations' type where y16 (CUDA only: opsc_linear_fwd16, the adapter's
 * part and the product rounded into bf16), else fp32 as dop_linear. */
int dop_linear_to(const tier_model *m, int T, int in, int out, const void *x, const void *w, const tier_lora_ref *l,
		  void *y, int y16, void *ws);
/* y = dop_linear's + res (y may be res): on CUDA in the first product's epilogue
 * (opsc_linear_fwd_res), on the CPU an add after it (the bits of dop_linear then dop_add). */
int dop_linear_res(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		   const tier_lora_ref *l, const float *res, float *y, void *ws);
int dop_linear_bwd(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		   const tier_lora_ref *l, const float *dy, float *dx, int accumulate, void *ws);
/* dop_linear_bwd from dy in the activations' type (bf16 on CUDA: no conversion; fp32 on the CPU). */
int dop_linear_bwd_act(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		       const tier_lora_ref *l, const void *dy, float *dx, int accumulate, void *ws);
/* dop_linear_bwd (accumulate 0) with dx in the activations' type at dx_act: on CUDA bf16 straight
 * from the products (dx32, fp32 [T, in], is scratch for LoRA dropout only); on the CPU dx into dx32,
 * then dx_act (dx32 itself there, or a copy). */
int dop_linear_bwd_to_act(const tier_model *m, int T, int in, int out, const void *x, const void *w,
			  const tier_lora_ref *l, const float *dy, void *dx_act, float *dx32, void *ws);
/* The q or k gradient for its projection's backward: dq [tokens * heads, head_dim] taken back
 * through RoPE (r: the forward's parameters) and the q/k RMSNorm (x its input, w, rstd; w NULL:
 * no norm) into out, in the activations' type. fused on CUDA: one kernel (opsc_qk_grad), dq left
 * as it is; otherwise the separate steps: RoPE's backward on dq in place, the norm's into the fp32
 * scratch tmp [tokens * heads, head_dim] (on the CPU out itself), the conversion into out. ld:
 * out's row stride a token (0: packed, heads * head_dim); a wider one (dec_shape.qkv_cat's stacked
 * gradients) the fused CUDA kernels alone write. x16: x is bf16 (dec_shape.qkv16), which the fused
 * CUDA kernels alone take (-EINVAL otherwise); the same for dop_qk_fwd. */
int dop_qk_grad(const tier_model *m, const tier_rope_params *r, float *dq, const float *x, const void *w,
		const float *rstd, void *out, int64_t ld, float *tmp, int fused, int x16);
/* The forward's: out = RoPE(the q/k RMSNorm of x, rstd written; w NULL: x as it is) in the
 * activations' type; fused on CUDA one kernel (opsc_qk_fwd), otherwise the separate steps. */
int dop_qk_fwd(const tier_model *m, const tier_rope_params *r, const float *x, const void *w, void *out,
	       float *rstd, int fused, int x16);
int dop_swiglu(const tier_model *m, size_t n, const float *g, const float *u, void *h);
int dop_swiglu_bwd(const tier_model *m, size_t n, const float *g, const float *u, const float *dh, float *dg,
		   float *du);
int dop_add(const tier_model *m, size_t n, const float *a, const float *b, float *out);
/* y (activation type) = x (fp32): a copy on the CPU, a rounding to bf16 on CUDA. */
int dop_to_act(const tier_model *m, size_t n, const float *x, void *y);
int dop_from_act(const tier_model *m, size_t n, const void *x, float *y); /* back to fp32 */
int dop_copy(const tier_model *m, void *dst, const void *src, size_t bytes);

#endif
