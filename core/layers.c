/* layers.c - the trainer's small layers on the CPU, forward and explicit backward: RMSNorm, linear
 * with LoRA, embedding, SwiGLU. fp32, as HF computes them (RMSNorm statistics in fp32). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "tier/model.h"
#include "core/core_internal.h"

int core_check_dev(tier_dev *dev, const char *fn)
{
	if (!dev)
		return tier_fail(-EINVAL, "%s: device context is NULL; open one with tier_dev_open", fn);
	if (tier_dev_kind_of(dev) != TIER_DEV_CPU)
		return tier_fail(-ENOTSUP, "%s: the layer functions of tier/model.h are the fp32 CPU reference; "
				 "open a CPU context for them (the trainer's CUDA path has its own kernels)", fn);
	return 0;
}

#define NONNULL(p, fn) do { if (!(p)) return tier_fail(-EINVAL, "%s: %s is NULL", fn, #p); } while (0)

static int dims(const char *fn, int a, int b)
{
	if (a < 1 || b < 1 || (int64_t)a * b > (int64_t)1 << 40)
		return tier_fail(-EINVAL, "%s: bad sizes %d x %d; both must be >= 1", fn, a, b);
	return 0;
}

int tier_rmsnorm_fwd(tier_dev *dev, int rows, int dim, float eps, const float *x, const float *w, float *y,
		     float *rstd)
{
	const char *fn = "tier_rmsnorm_fwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, rows, dim)))
		return rc;
	NONNULL(x, fn);
	NONNULL(w, fn);
	NONNULL(y, fn);
	if (!(eps >= 0.0f) || !isfinite(eps))
		return tier_fail(-EINVAL, "%s: eps %g must be finite and >= 0", fn, eps);
	for (int i = 0; i < rows; i++) {
		const float *xi = x + (size_t)i * dim;
		float *yi = y + (size_t)i * dim, ss = 0.0f;
		for (int j = 0; j < dim; j++)
			ss += xi[j] * xi[j];
		float r = 1.0f / sqrtf(ss / (float)dim + eps);
		for (int j = 0; j < dim; j++)
			yi[j] = w[j] * (xi[j] * r);
		if (rstd)
			rstd[i] = r;
	}
	return 0;
}

/* y = w * x * r with r = (mean(x^2) + eps)^-1/2: dx = r (w dy) - x r^3 / dim * sum(w dy x). */
int tier_rmsnorm_bwd(tier_dev *dev, int rows, int dim, const float *x, const float *w, const float *rstd,
		     const float *dy, float *dx, float *dw)
{
	const char *fn = "tier_rmsnorm_bwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, rows, dim)))
		return rc;
	NONNULL(x, fn);
	NONNULL(w, fn);
	NONNULL(rstd, fn);
	NONNULL(dy, fn);
	NONNULL(dx, fn);
	for (int i = 0; i < rows; i++) {
		const float *xi = x + (size_t)i * dim, *gi = dy + (size_t)i * dim;
		float *di = dx + (size_t)i * dim, r = rstd[i], s = 0.0f;
		for (int j = 0; j < dim; j++)
			s += w[j] * gi[j] * xi[j];
		float c = s * r * r * r / (float)dim;
		for (int j = 0; j < dim; j++) {
			if (dw)
				dw[j] += gi[j] * xi[j] * r;
			di[j] = r * w[j] * gi[j] - c * xi[j];
		}
	}
	return 0;
}

static int has_lora(const tier_lora_ref *l) { return l && l->a && l->b; }

size_t tier_linear_ws_floats(int T, int in, const tier_lora_ref *lora)
{
	if (!has_lora(lora) || T <= 0 || lora->rank <= 0)
		return 0;
	return 2 * (size_t)T * lora->rank + (lora->dropout > 0 && in > 0 ? (size_t)T * in : 0);
}

/* A counter-based hash of (key, t, i) (splitmix64's finaliser twice): the mask needs no state. */
int tier_lora_keep(uint64_t key, float p, int64_t t, int64_t i)
{
	uint64_t z = key ^ ((uint64_t)t * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)i * 0xc2b2ae3d27d4eb4full);
	for (int k = 0; k < 2; k++) {
		z += 0x9e3779b97f4a7c15ull;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
	}
	return (double)(z >> 11) * 0x1.0p-53 >= (double)p;
}

/* out[t, i] = in[t, i] * keep(t, i) / (1 - p): the adapter's view of x (out may be in). */
static void lora_mask(const tier_lora_ref *l, int T, int in, const float *x, float *out)
{
	float s = 1.0f / (1.0f - l->dropout);
	for (int t = 0; t < T; t++)
		for (int i = 0; i < in; i++) {
			size_t k = (size_t)t * in + i;
			out[k] = tier_lora_keep(l->mask_key, l->dropout, t, i) ? x[k] * s : 0.0f;
		}
}

static int lora_check(const char *fn, const tier_lora_ref *l, float *ws)
{
	if (!l || (!l->a && !l->b))
		return 0;
	if (!l->a || !l->b)
		return tier_fail(-EINVAL, "%s: LoRA needs both A and B (one is NULL)", fn);
	if (l->rank < 1 || !isfinite(l->scale))
		return tier_fail(-EINVAL, "%s: LoRA rank %d must be >= 1 and the scale finite", fn, l->rank);
	if (!(l->dropout >= 0.0f && l->dropout < 1.0f))
		return tier_fail(-EINVAL, "%s: LoRA dropout %g must be in [0, 1)", fn, l->dropout);
	if (!ws)
		return tier_fail(-EINVAL, "%s: ws is NULL; LoRA needs tier_linear_ws_floats floats of scratch", fn);
	return 0;
}

int tier_linear_fwd(tier_dev *dev, int T, int in, int out, const float *x, const float *w, const tier_lora_ref *lora,
		    float *y, float *ws)
{
	const char *fn = "tier_linear_fwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, T, in)) || (rc = dims(fn, T, out)) || (rc = lora_check(fn, lora, ws)))
		return rc;
	NONNULL(x, fn);
	NONNULL(w, fn);
	NONNULL(y, fn);
	core_gemm(0, 1, T, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
	if (has_lora(lora)) {
		int r = lora->rank;
		const float *xl = x; /* the adapter's input: x, or x through the dropout mask */
		if (lora->dropout > 0) {
			lora_mask(lora, T, in, x, ws + 2 * (size_t)T * r);
			xl = ws + 2 * (size_t)T * r;
		}
		core_gemm(0, 1, T, r, in, 1.0f, xl, in, lora->a, in, 0.0f, ws, r);           /* xa = x A^T */
		core_gemm(0, 1, T, out, r, lora->scale, ws, r, lora->b, r, 1.0f, y, out);   /* y += s xa B^T */
	}
	return 0;
}

int tier_linear_bwd(tier_dev *dev, int T, int in, int out, const float *x, const float *w, const tier_lora_ref *lora,
		    const float *dy, float *dx, int accumulate, float *ws)
{
	const char *fn = "tier_linear_bwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, T, in)) || (rc = dims(fn, T, out)) || (rc = lora_check(fn, lora, ws)))
		return rc;
	NONNULL(x, fn);
	NONNULL(w, fn);
	NONNULL(dy, fn);
	if (dx)
		core_gemm(0, 0, T, in, out, 1.0f, dy, out, w, in, accumulate ? 1.0f : 0.0f, dx, in);
	if (!has_lora(lora))
		return 0;
	int r = lora->rank;
	float s = lora->scale, *xa = ws, *dyb = ws + (size_t)T * r, *xd = ws + 2 * (size_t)T * r;
	const float *xl = x; /* the adapter's input, as in the forward */
	if (lora->dropout > 0) {
		lora_mask(lora, T, in, x, xd);
		xl = xd;
	}
	core_gemm(0, 0, T, r, out, 1.0f, dy, out, lora->b, r, 0.0f, dyb, r); /* dyb = dy B [T, r] */
	if (lora->db) {
		core_gemm(0, 1, T, r, in, 1.0f, xl, in, lora->a, in, 0.0f, xa, r); /* recomputed, not kept */
		core_gemm(1, 0, out, r, T, s, dy, out, xa, r, 1.0f, lora->db, r);
	}
	if (lora->da)
		core_gemm(1, 0, r, in, T, s, dyb, r, xl, in, 1.0f, lora->da, in);
	if (dx && lora->dropout > 0) { /* through the mask: (s dyb A) * keep / (1 - p) */
		core_gemm(0, 0, T, in, r, s, dyb, r, lora->a, in, 0.0f, xd, in);
		lora_mask(lora, T, in, xd, xd);
		for (size_t k = 0; k < (size_t)T * in; k++)
			dx[k] += xd[k];
	} else if (dx) {
		core_gemm(0, 0, T, in, r, s, dyb, r, lora->a, in, 1.0f, dx, in);
	}
	return 0;
}

int tier_embed_fwd(tier_dev *dev, int T, int vocab, int dim, const int32_t *tokens, const float *table, float *out)
{
	const char *fn = "tier_embed_fwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, T, dim)) || (rc = dims(fn, vocab, dim)))
		return rc;
	NONNULL(tokens, fn);
	NONNULL(table, fn);
	NONNULL(out, fn);
	for (int t = 0; t < T; t++)
		if (tokens[t] < 0 || tokens[t] >= vocab)
			return tier_fail(-EINVAL, "%s: token %d at position %d is outside the vocabulary 0..%d", fn,
					 tokens[t], t, vocab - 1);
	for (int t = 0; t < T; t++)
		memcpy(out + (size_t)t * dim, table + (size_t)tokens[t] * dim, sizeof(float) * (size_t)dim);
	return 0;
}

int tier_embed_bwd(tier_dev *dev, int T, int vocab, int dim, const int32_t *tokens, const float *dout, float *dtable)
{
	const char *fn = "tier_embed_bwd";
	int rc = core_check_dev(dev, fn);
	if (rc || (rc = dims(fn, T, dim)) || (rc = dims(fn, vocab, dim)))
		return rc;
	NONNULL(tokens, fn);
	NONNULL(dout, fn);
	NONNULL(dtable, fn);
	for (int t = 0; t < T; t++)
		if (tokens[t] < 0 || tokens[t] >= vocab)
			return tier_fail(-EINVAL, "%s: token %d at position %d is outside the vocabulary 0..%d", fn,
					 tokens[t], t, vocab - 1);
	for (int t = 0; t < T; t++) {
		float *row = dtable + (size_t)tokens[t] * dim;
		const float *g = dout + (size_t)t * dim;
		for (int j = 0; j < dim; j++)
			row[j] += g[j];
	}
	return 0;
}

int tier_swiglu_fwd(tier_dev *dev, size_t n, const float *g, const float *u, float *h)
{
	const char *fn = "tier_swiglu_fwd";
	int rc = core_check_dev(dev, fn);
	if (rc)
		return rc;
	NONNULL(g, fn);
	NONNULL(u, fn);
	NONNULL(h, fn);
	for (size_t i = 0; i < n; i++)
		h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
	return 0;
}

/* silu'(g) = sig(g) (1 + g (1 - sig(g))). */
int tier_swiglu_bwd(tier_dev *dev, size_t n, const float *g, const float *u, const float *dh, float *dg, float *du)
{
	const char *fn = "tier_swiglu_bwd";
	int rc = core_check_dev(dev, fn);
	if (rc)
		return rc;
	NONNULL(g, fn);
	NONNULL(u, fn);
	NONNULL(dh, fn);
	NONNULL(dg, fn);
	NONNULL(du, fn);
	for (size_t i = 0; i < n; i++) {
		float sg = 1.0f / (1.0f + expf(-g[i])), silu = g[i] * sg;
		dg[i] = dh[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
		du[i] = dh[i] * silu;
	}
	return 0;
}
