/* experts.c - grouped SwiGLU experts over the permuted rows: gate_up product with the SiLU-gate
 * product as its epilogue, then down; optional LoRA per expert on gate, up and down, computed as
 * (X A^T) B^T so that B A is never formed; and the backward of all of it. Rows of expert e are
 * offsets[e] .. offsets[e+1]-1; empty experts are skipped (their weights may be NULL). */
#include "config.h"
#include <errno.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

int moe_lora_max_rank(const tier_moe_loras *lo)
{
	int r = 0;
	if (!lo)
		return 0;
	const tier_moe_lora *ls[3] = { &lo->gate, &lo->up, &lo->down };
	for (int i = 0; i < 3; i++)
		if (moe_lora_on(ls[i]) && ls[i]->rank > r)
			r = ls[i]->rank;
	return r;
}

size_t tier_moe_experts_ws_bytes(int I, int rows, const tier_moe_loras *lora)
{
	if (I < 1 || rows < 0)
		return 0;
	/* the CPU's h, dh, du, Z and dZ in fp32; CUDA's dh, h, dg, du and moe_lora_z/dz_bytes fit in it */
	int r = moe_lora_max_rank(lora);
	return sizeof(float) * ((size_t)3 * rows * I + (size_t)2 * rows * r) + (r > 0 ? MOE_LORA_TAB_BYTES : 0);
}

/* The gate and up matrices of expert e. */
static void gate_up_of(const tier_moe_experts *w, int e, int I, int H, const float **gate, const float **up)
{
	if (!w->gate_up) {
		*gate = w->gate[e];
		*up = w->up[e];
		return;
	}
	const float *b = w->gate_up[e], *second = b ? b + (size_t)I * H : NULL;
	*gate = w->order == TIER_MOE_UP_FIRST ? second : b;
	*up = w->order == TIER_MOE_UP_FIRST ? b : second;
}

static int lora_check(const char *fn, const char *name, const tier_moe_lora *l, int E, const int32_t *offsets)
{
	if (!l || (!l->a && !l->b))
		return 0;
	if (!l->a || !l->b)
		return tier_fail(-EINVAL, "%s: LoRA on %s has only one of A and B; give both or neither", fn, name);
	if (l->rank < 1 || l->rank > 4096 || !isfinite(l->scale))
		return tier_fail(-EINVAL, "%s: LoRA on %s: rank %d must be 1..4096 and scale finite", fn, name, l->rank);
	for (int e = 0; e < E; e++)
		if (offsets[e + 1] > offsets[e] && (!l->a[e] || !l->b[e]))
			return tier_fail(-EINVAL, "%s: LoRA on %s of expert %d (which has rows) is NULL", fn, name, e);
	return 0;
}

static int experts_check(const char *fn, tier_dev *dev, int E, int H, int I, const int32_t *offsets,
			 const tier_moe_experts *w, const tier_moe_loras *lora)
{
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "H", H)) || (rc = moe_check_dim(fn, "I", I)))
		return rc;
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(w, fn);
	MOE_NONNULL(w->down, fn);
	if (!w->gate_up && (!w->gate || !w->up))
		return tier_fail(-EINVAL, "%s: expert weights need gate and up, or gate_up", fn);
	if (offsets[0] != 0)
		return tier_fail(-EINVAL, "%s: offsets[0] = %d; it must be 0", fn, offsets[0]);
	for (int e = 0; e < E; e++) {
		if (offsets[e + 1] < offsets[e])
			return tier_fail(-EINVAL, "%s: offsets decrease at expert %d", fn, e);
		const float *g, *u;
		gate_up_of(w, e, I, H, &g, &u);
		if (offsets[e + 1] > offsets[e] && (!g || !u || !w->down[e]))
			return tier_fail(-EINVAL, "%s: expert %d has %d rows but a NULL weight; acquire it from the store first",
					 fn, e, offsets[e + 1] - offsets[e]);
	}
	if (lora && ((rc = lora_check(fn, "gate", &lora->gate, E, offsets)) ||
		     (rc = lora_check(fn, "up", &lora->up, E, offsets)) || (rc = lora_check(fn, "down", &lora->down, E, offsets))))
		return rc;
	return 0;
}

/* Y [n, out] += s (X A^T) B^T through Z [n, r]. */
static void lora_fwd(const tier_moe_lora *l, int e, int n, int in, int out, const float *X, float *Y, float *Z)
{
	if (!moe_lora_on(l))
		return;
	int r = l->rank;
	moe_gemm(0, 1, n, r, in, 1.0f, X, in, l->a[e], in, 0.0f, Z, r);
	moe_gemm(0, 1, n, out, r, l->scale, Z, r, l->b[e], r, 1.0f, Y, out);
}

/* From dY [n, out]: dB += s dY^T (X A^T), dA += (s dY B)^T X, dX [n, in] += (s dY B) A. */
static void lora_bwd(const tier_moe_lora *l, int e, int n, int in, int out, const float *X, const float *dY,
		     float *dX, float *Z, float *dZ)
{
	if (!moe_lora_on(l))
		return;
	int r = l->rank;
	moe_gemm(0, 0, n, r, out, l->scale, dY, out, l->b[e], r, 0.0f, dZ, r);
	if (l->db && l->db[e]) {
		moe_gemm(0, 1, n, r, in, 1.0f, X, in, l->a[e], in, 0.0f, Z, r);
		moe_gemm(1, 0, out, r, n, l->scale, dY, out, Z, r, 1.0f, l->db[e], r);
	}
	if (l->da && l->da[e])
		moe_gemm(1, 0, r, in, n, 1.0f, dZ, r, X, in, 1.0f, l->da[e], in);
	moe_gemm(0, 0, n, in, r, 1.0f, dZ, r, l->a[e], in, 1.0f, dX, in);
}

int tier_moe_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets, const tier_moe_experts *w,
			 const tier_moe_loras *lora, const float *xg, float *g, float *u, float *y, void *ws)
{
	const char *fn = "tier_moe_experts_fwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_experts_fwd_step(dev, E, H, I, offsets, w, lora, xg, g, u, y, ws));
	int rc = experts_check(fn, dev, E, H, I, offsets, w, lora);
	if (rc)
		return rc;
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(ws, fn);
	float *h = ws, *Z = h + (size_t)offsets[E] * I;
	for (int e = 0; e < E; e++) {
		int o = offsets[e], n = offsets[e + 1] - o;
		if (n == 0)
			continue;
		const float *gw, *uw, *X = xg + (size_t)o * H;
		float *G = g + (size_t)o * I, *U = u + (size_t)o * I, *Hh = h + (size_t)o * I;
		gate_up_of(w, e, I, H, &gw, &uw);
		moe_gemm(0, 1, n, I, H, 1.0f, X, H, gw, H, 0.0f, G, I);
		moe_gemm(0, 1, n, I, H, 1.0f, X, H, uw, H, 0.0f, U, I);
		lora_fwd(moe_lora_of(lora, 0), e, n, H, I, X, G, Z);
		lora_fwd(moe_lora_of(lora, 1), e, n, H, I, X, U, Z);
		if (!y) /* g and u are all a recompute for the backward needs */
			continue;
		for (size_t i = 0; i < (size_t)n * I; i++) /* the epilogue: silu(gate) * up */
			Hh[i] = G[i] * moe_sigmoid(G[i]) * U[i];
		moe_gemm(0, 1, n, H, I, 1.0f, Hh, I, w->down[e], I, 0.0f, y + (size_t)o * H, H);
		lora_fwd(moe_lora_of(lora, 2), e, n, I, H, Hh, y + (size_t)o * H, Z);
	}
	return 0;
}

int tier_moe_experts_bwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets, const tier_moe_experts *w,
			 const tier_moe_loras *lora, const float *xg, const float *g, const float *u,
			 const float *dy, float *dxg, float *row_dot, void *ws)
{
	const char *fn = "tier_moe_experts_bwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_experts_bwd_step(dev, E, H, I, offsets, w, lora, xg, g, u, dy, dxg, row_dot, ws));
	int rc = experts_check(fn, dev, E, H, I, offsets, w, lora);
	if (rc)
		return rc;
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(dy, fn);
	MOE_NONNULL(dxg, fn);
	MOE_NONNULL(ws, fn);
	size_t rows = (size_t)offsets[E];
	float *h = ws, *dh = h + rows * I, *du = dh + rows * I, *Z = du + rows * I, *dZ = Z + rows * moe_lora_max_rank(lora);
	for (int e = 0; e < E; e++) {
		int o = offsets[e], n = offsets[e + 1] - o;
		if (n == 0)
			continue;
		const float *gw, *uw, *X = xg + (size_t)o * H, *G = g + (size_t)o * I, *U = u + (size_t)o * I;
		const float *dY = dy + (size_t)o * H;
		float *Hh = h + (size_t)o * I, *dH = dh + (size_t)o * I, *dU = du + (size_t)o * I, *dX = dxg + (size_t)o * H;
		gate_up_of(w, e, I, H, &gw, &uw);
		for (size_t i = 0; i < (size_t)n * I; i++)
			Hh[i] = G[i] * moe_sigmoid(G[i]) * U[i];
		moe_gemm(0, 0, n, I, H, 1.0f, dY, H, w->down[e], I, 0.0f, dH, I);
		lora_bwd(moe_lora_of(lora, 2), e, n, I, H, Hh, dY, dH, Z, dZ);
		for (int r = 0; row_dot && r < n; r++) { /* dH . h = dY . y: the router weight's gradient, times w */
			double d = 0.0;
			for (int i = 0; i < I; i++)
				d += (double)dH[(size_t)r * I + i] * Hh[(size_t)r * I + i];
			row_dot[o + r] = (float)d;
		}
		for (size_t i = 0; i < (size_t)n * I; i++) { /* silu'(g) = s (1 + g (1 - s)) */
			float s = moe_sigmoid(G[i]);
			dU[i] = dH[i] * G[i] * s;
			dH[i] = dH[i] * U[i] * s * (1.0f + G[i] * (1.0f - s));
		}
		moe_gemm(0, 0, n, H, I, 1.0f, dH, I, gw, H, 0.0f, dX, H);
		moe_gemm(0, 0, n, H, I, 1.0f, dU, I, uw, H, 1.0f, dX, H);
		lora_bwd(moe_lora_of(lora, 0), e, n, H, I, X, dH, dX, Z, dZ);
		lora_bwd(moe_lora_of(lora, 1), e, n, H, I, X, dU, dX, Z, dZ);
	}
	return 0;
}
