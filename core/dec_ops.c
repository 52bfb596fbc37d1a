/* dec_ops.c - the decoder's operations dispatched by device: see dec_ops.h. */
#include "config.h"
#include <errno.h>
#include <string.h>
#include "core/dec_ops.h"
#include "core/ops_cuda.h"

int dop_norm(const tier_model *m, int rows, int dim, const float *x, const void *w, void *y, float *rstd)
{
	if (m->cuda)
		return opsc_rmsnorm_fwd(m->dev, rows, dim, m->eps, x, w, y, rstd);
	return tier_rmsnorm_fwd(m->dev, rows, dim, m->eps, x, w, y, rstd);
}

int dop_norm_bwd(const tier_model *m, int rows, int dim, const float *x, const void *w, const float *rstd,
		 const float *dy, float *dx)
{
	if (m->cuda)
		return opsc_rmsnorm_bwd(m->dev, rows, dim, x, w, rstd, dy, dx);
	return tier_rmsnorm_bwd(m->dev, rows, dim, x, w, rstd, dy, dx, NULL);
}

int dop_norm_bwd_add(const tier_model *m, int rows, int dim, const float *x, const void *w, const float *rstd,
		     const float *dy, const float *res, float *dx, float *tmp)
{
	if (m->cuda)
		return opsc_rmsnorm_bwd_add(m->dev, rows, dim, x, w, rstd, dy, res, dx);
	int rc = dop_norm_bwd(m, rows, dim, x, w, rstd, dy, tmp);
	return rc ? rc : dop_add(m, (size_t)rows * dim, res, tmp, dx);
}

size_t dop_linear_ws(const tier_model *m, int T, int in, int out, int r)
{
	if (m->cuda)
		return opsc_linear_ws_bytes(T, in, out, r, m->lora.dropout);
	tier_lora_ref l = { .rank = r, .dropout = m->lora.dropout };
	float dummy = 0.0f;
	l.a = l.b = r ? &dummy : NULL;
	return sizeof(float) * tier_linear_ws_floats(T, in, &l);
}

int dop_linear(const tier_model *m, int T, int in, int out, const void *x, const void *w, const tier_lora_ref *l,
	       float *y, void *ws)
{
	if (m->cuda)
		return opsc_linear_fwd(m->dev, T, in, out, x, w, l, y, ws);
	return tier_linear_fwd(m->dev, T, in, out, x, w, l, y, ws);
}

int dop_linear_to(const tier_model *m, int T, int in, int out, const void *x, const void *w, const tier_lora_ref *l,
		  void *y, int y16, void *ws)
{
	if (!y16)
		return dop_linear(m, T, in, out, x, w, l, y, ws);
	if (!m->cuda)
		return tier_fail(-EINVAL, "dop_linear_to: bf16 outputs are the CUDA path's (T=%d in=%d out=%d)", T, in, out);
	return opsc_linear_fwd16(m->dev, T, in, out, x, w, l, y, ws);
}

int dop_linear_res(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		   const tier_lora_ref *l, const float *res, float *y, void *ws)
{
	if (m->cuda)
		return opsc_linear_fwd_res(m->dev, T, in, out, x, w, l, res, y, ws);
	if (y == res) /* the product would overwrite the residual before the add */
		return tier_fail(-EINVAL, "dop_linear_res: y is res on the CPU");
	int rc = tier_linear_fwd(m->dev, T, in, out, x, w, l, y, ws);
	return rc ? rc : dop_add(m, (size_t)T * out, y, res, y);
}

int dop_linear_bwd(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		   const tier_lora_ref *l, const float *dy, float *dx, int accumulate, void *ws)
{
	if (m->cuda)
		return opsc_linear_bwd(m->dev, T, in, out, x, w, l, dy, dx, accumulate, ws);
	return tier_linear_bwd(m->dev, T, in, out, x, w, l, dy, dx, accumulate, ws);
}

int dop_linear_bwd_act(const tier_model *m, int T, int in, int out, const void *x, const void *w,
		       const tier_lora_ref *l, const void *dy, float *dx, int accumulate, void *ws)
{
	if (m->cuda)
		return opsc_linear_bwd_bf16(m->dev, T, in, out, x, w, l, dy, dx, accumulate, ws);
	return tier_linear_bwd(m->dev, T, in, out, x, w, l, dy, dx, accumulate, ws);
}

int dop_linear_bwd_to_act(const tier_model *m, int T, int in, int out, const void *x, const void *w,
			  const tier_lora_ref *l, const float *dy, void *dx_act, float *dx32, void *ws)
{
	if (m->cuda)
		return opsc_linear_bwd_to16(m->dev, T, in, out, x, w, l, dy, dx_act, dx32, ws);
	int rc = tier_linear_bwd(m->dev, T, in, out, x, w, l, dy, dx32, 0, ws);
	return rc ? rc : dop_to_act(m, (size_t)T * in, dx32, dx_act);
}

/* A bf16 projection has only the fused CUDA kernels to read it. */
static int x16_check(const char *op, const tier_model *m, int fused, int x16)
{
	if (x16 && !(m->cuda && fused))
		return tier_fail(-EINVAL, "%s: a bf16 projection needs the fused CUDA kernel", op);
	return 0;
}

int dop_qk_grad(const tier_model *m, const tier_rope_params *r, float *dq, const float *x, const void *w,
		const float *rstd, void *out, int64_t ld, float *tmp, int fused, int x16)
{
	int rc = x16_check("dop_qk_grad", m, fused, x16);
	if (rc)
		return rc;
	const int64_t packed = r->n_heads * r->head_dim;
	ld = ld ? ld : packed;
	if (x16)
		return opsc_qk_grad16_ld(m->dev, r, dq, (const opsc_bf16 *)x, w, rstd, out, ld);
	if (m->cuda && fused)
		return opsc_qk_grad_ld(m->dev, r, dq, x, w, rstd, out, ld);
	if (ld != packed) /* the separate steps write packed rows */
		return tier_fail(-EINVAL, "dop_qk_grad: a row stride (%lld, not %lld) needs the fused CUDA kernel",
				 (long long)ld, (long long)packed);
	int rows = (int)(r->tokens * r->n_heads), dim = (int)r->head_dim;
	rc = tier_attn_rope_bwd(m->dev, r, NULL, dq);
	const float *g = dq;
	if (!rc && w && !(rc = dop_norm_bwd(m, rows, dim, x, w, rstd, dq, tmp)))
		g = tmp;
	return rc ? rc : dop_to_act(m, (size_t)rows * dim, g, out);
}

int dop_qk_fwd(const tier_model *m, const tier_rope_params *r, const float *x, const void *w, void *out,
	       float *rstd, int fused, int x16)
{
	int rc = x16_check("dop_qk_fwd", m, fused, x16);
	if (rc)
		return rc;
	if (x16)
		return opsc_qk_fwd16(m->dev, r, (const opsc_bf16 *)x, w, m->eps, out, rstd);
	if (m->cuda && fused)
		return opsc_qk_fwd(m->dev, r, x, w, m->eps, out, rstd);
	int rows = (int)(r->tokens * r->n_heads), dim = (int)r->head_dim;
	rc = w ? dop_norm(m, rows, dim, x, w, out, rstd) : dop_to_act(m, (size_t)rows * dim, x, out);
	return rc ? rc : tier_attn_rope_fwd(m->dev, r, NULL, out);
}

int dop_swiglu(const tier_model *m, size_t n, const float *g, const float *u, void *h)
{
	if (m->cuda)
		return opsc_swiglu_fwd(m->dev, n, g, u, h);
	return tier_swiglu_fwd(m->dev, n, g, u, h);
}

int dop_swiglu_bwd(const tier_model *m, size_t n, const float *g, const float *u, const float *dh, float *dg,
		   float *du)
{
	if (m->cuda)
		return opsc_swiglu_bwd(m->dev, n, g, u, dh, dg, du);
	return tier_swiglu_bwd(m->dev, n, g, u, dh, dg, du);
}

int dop_add(const tier_model *m, size_t n, const float *a, const float *b, float *out)
{
	if (m->cuda)
		return opsc_add(m->dev, n, a, b, out);
	for (size_t i = 0; i < n; i++)
		out[i] = a[i] + b[i];
	return 0;
}

int dop_to_act(const tier_model *m, size_t n, const float *x, void *y)
{
	if (m->cuda)
		return opsc_to_bf16(m->dev, n, x, y);
	if (y != x)
		memmove(y, x, sizeof(float) * n);
	return 0;
}

int dop_from_act(const tier_model *m, size_t n, const void *x, float *y)
{
	if (m->cuda)
		return opsc_from_bf16(m->dev, n, x, y);
	if (y != x)
		memmove(y, x, sizeof(float) * n);
	return 0;
}

int dop_copy(const tier_model *m, void *dst, const void *src, size_t bytes)
{
	return tier_dev_memcpy_d2d(m->dev, dst, src, bytes);
}
