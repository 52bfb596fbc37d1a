/* ops_nocuda.c - core/ops_cuda.h in a build without CUDA: every operation fails with -ENOTSUP; the
 * size function keeps its arithmetic (the same as ops_cuda.cu) so that callers can plan. */
#include <errno.h>
#include "core/ops_cuda.h"

#define NOCUDA(op) tier_fail(-ENOTSUP, "%s: libtier was built without CUDA (reconfigure --with-cuda)", op)

static size_t al256(size_t b) { return (b + 255) / 256 * 256; }

size_t opsc_linear_ws_bytes(int T, int in, int out, int rank, float dropout)
{
	size_t t = T > 0 ? (size_t)T : 0, i = in > 0 ? (size_t)in : 0, o = out > 0 ? (size_t)out : 0;
	size_t r = rank > 0 ? (size_t)rank : 0, drop = dropout > 0 && r ? al256(t * i * 4) : 0;
	return al256(t * o * 2) + al256(t * r * 4) + 2 * al256(t * r * 2) + drop;
}

int opsc_rmsnorm_fwd(tier_dev *d, int rows, int dim, float eps, const float *x, const opsc_bf16 *w,
		     opsc_bf16 *y, float *rstd)
{
	return NOCUDA("opsc_rmsnorm_fwd");
}

int opsc_rmsnorm_bwd(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
		     const float *dy, float *dx)
{
	return NOCUDA("opsc_rmsnorm_bwd");
}

int opsc_rmsnorm_bwd_add(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
			 const float *dy, const float *res, float *dx)
{
	return NOCUDA("opsc_rmsnorm_bwd_add");
}

int opsc_swiglu_fwd(tier_dev *d, size_t n, const float *g, const float *u, opsc_bf16 *h)
{
	return NOCUDA("opsc_swiglu_fwd");
}

int opsc_swiglu_bwd(tier_dev *d, size_t n, const float *g, const float *u, const float *dh, float *dg, float *du)
{
	return NOCUDA("opsc_swiglu_bwd");
}

int opsc_embed_fwd(tier_dev *d, int T, int vocab, int dim, const int32_t *tokens, const opsc_bf16 *table,
		   float *out)
{
	return NOCUDA("opsc_embed_fwd");
}

int opsc_add(tier_dev *d, size_t n, const float *a, const float *b, float *out)
{
	return NOCUDA("opsc_add");
}

int opsc_to_bf16(tier_dev *d, size_t n, const float *x, opsc_bf16 *y)
{
	return NOCUDA("opsc_to_bf16");
}

int opsc_from_bf16(tier_dev *d, size_t n, const opsc_bf16 *x, float *y)
{
	return NOCUDA("opsc_from_bf16");
}

int opsc_to_bf16_many(tier_dev *d, int n_seg, const float *const *src, opsc_bf16 *const *dst, const size_t *len)
{
	return NOCUDA("opsc_to_bf16_many");
}

int opsc_linear_fwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, float *y, void *ws)
{
	return NOCUDA("opsc_linear_fwd");
}

int opsc_linear_fwd16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		      const tier_lora_ref *lora, opsc_bf16 *y, void *ws)
{
	return NOCUDA("opsc_linear_fwd16");
}

int opsc_linear_fwd_res(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			const tier_lora_ref *lora, const float *res, float *y, void *ws)
{
	return NOCUDA("opsc_linear_fwd_res");
}

int opsc_linear_bwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, const float *dy, float *dx, int accumulate, void *ws)
{
	return NOCUDA("opsc_linear_bwd");
}

int opsc_linear_bwd_bf16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const opsc_bf16 *dy16, float *dx, int accumulate, void *ws)
{
	return NOCUDA("opsc_linear_bwd_bf16");
}

int opsc_linear_bwd_to16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const float *dy, opsc_bf16 *dx16, float *dx32, void *ws)
{
	return NOCUDA("opsc_linear_bwd_to16");
}

int opsc_qk_fwd(tier_dev *d, const tier_rope_params *r, const float *x, const opsc_bf16 *w, float eps,
		opsc_bf16 *out, float *rstd)
{
	return NOCUDA("opsc_qk_fwd");
}

int opsc_qk_grad(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x, const opsc_bf16 *w,
		 const float *rstd, opsc_bf16 *out)
{
	return NOCUDA("opsc_qk_grad");
}

int opsc_sumsq(tier_dev *d, size_t n, const float *x, double *acc)
{
	return NOCUDA("opsc_sumsq");
}

int opsc_adamw(tier_dev *d, size_t n, float *p, const float *g, float *m, float *v, float lr, float b1, float b2,
	       float eps, float decay, float bc1, float bc2, float gscale)
{
	return NOCUDA("opsc_adamw");
}

int opsc_adamw_many(tier_dev *d, int count, const opsc_adamw_t *t, float lr, float b1, float b2, float eps,
		    float decay, float gscale)
{
	(void)d, (void)count, (void)t, (void)lr, (void)b1, (void)b2, (void)eps, (void)decay, (void)gscale;
	return NOCUDA("opsc_adamw_many");
}

int opsc_fill_normal(tier_dev *d, size_t n, uint64_t seed, float std, opsc_bf16 *out)
{
	return NOCUDA("opsc_fill_normal");
}

int opsc_fill_const(tier_dev *d, size_t n, float v, opsc_bf16 *out)
{
	return NOCUDA("opsc_fill_const");
}

int opsc_gemm(tier_dev *d, int m, int n, int k, float alpha, opsc_operand A, opsc_operand B, float beta, float *C,
	      int ldc)
{
	return NOCUDA("opsc_gemm");
}

int opsc_linear_bwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, opsc_bf16 *dy,
			int ld, float *dx, int accumulate, void *ws)
{
	return NOCUDA("opsc_linear_bwd_cat");
}

int opsc_to_bf16_rows(tier_dev *d, int rows, int cols, const float *x, opsc_bf16 *y, int ldy)
{
	return NOCUDA("opsc_to_bf16_rows");
}

int opsc_qk_grad_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const float *x, const opsc_bf16 *w,
		    const float *rstd, opsc_bf16 *out, int64_t ld)
{
	return NOCUDA("opsc_qk_grad_ld");
}

int opsc_qk_fwd16(tier_dev *d, const tier_rope_params *r, const opsc_bf16 *x, const opsc_bf16 *w, float eps,
		  opsc_bf16 *out, float *rstd)
{
	return NOCUDA("opsc_qk_fwd16");
}

int opsc_qk_grad16_ld(tier_dev *d, const tier_rope_params *r, const float *dq, const opsc_bf16 *x, const opsc_bf16 *w,
		      const float *rstd, opsc_bf16 *out, int64_t ld)
{
	return NOCUDA("opsc_qk_grad16_ld");
}

int opsc_linear_fwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, float *const *y,
			void *ws)
{
	return NOCUDA("opsc_linear_fwd_cat");
}
