/* moe_ref.h - naive fp64 references of the MoE steps and test helpers, shared by tests/test_moe_*.c.
 * Written independently of moe/ (full sorts instead of insertion top-k, plain loops, doubles). */
#ifndef TIER_TEST_MOE_REF_H
#define TIER_TEST_MOE_REF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "test_seed.h"

/* Test tolerance of the fp32 kernels against fp64: max |a - b| / max |b| over the array. */
#define REF_TOL 1e-5

static inline uint64_t ref_seed(const char *what)
{
	return test_seed(what, (uint64_t)(uintptr_t)what);
}

/* A fixture's start: r seeded for the test name (TIER_TEST_SEED repeats a run), a CPU device in *d. */
static inline int ref_seed_cpu(tier_rng *r, const char *name, tier_dev **d)
{
	tier_rng_seed(r, ref_seed(name));
	return tier_dev_open(d, TIER_DEV_CPU, 0);
}

static inline void ref_fill(tier_rng *r, float *a, size_t n, float scale)
{
	for (size_t i = 0; i < n; i++)
		a[i] = scale * tier_rng_normal(r);
}

static inline void ref_poison(void *p, size_t bytes) { memset(p, 0xff, bytes); } /* NaN / -1 */

static inline double *ref_dup(const float *a, size_t n)
{
	double *d = malloc(sizeof(double) * (n ? n : 1));
	for (size_t i = 0; i < n; i++)
		d[i] = a[i];
	return d;
}

/* ---- the CPU tests' fixture ---- */
#ifdef REF_CPU_TEST
/* A test that defines REF_CPU_TEST (its name, for the seed line) before including this header runs
 * on this CPU device and draws from this generator: cmocka_run_group_tests(tests, ref_setup,
 * ref_teardown) opens the one and seeds the other (TIER_TEST_SEED repeats a run). */
static tier_dev *dev;
static tier_rng rng;

static int ref_setup(void **state)
{
	(void)state;
	return ref_seed_cpu(&rng, REF_CPU_TEST, &dev);
}

static int ref_teardown(void **state)
{
	(void)state;
	tier_dev_close(dev);
	return 0;
}
#endif

/* ---- the CUDA tests' device buffers and start ---- */
/* n bytes at h (NULL: left as they are) in a new buffer on d (16 bytes when n is 0); NULL on failure. */
static inline void *ref_dev_copy(tier_dev *d, const void *h, size_t n)
{
	void *p = NULL;
	if (tier_dev_malloc(d, n ? n : 16, &p))
		return NULL;
	if (h && n && tier_dev_memcpy_h2d(d, p, h, n)) {
		tier_dev_free(d, p);
		return NULL;
	}
	return p;
}

/* The n floats f rounded to bf16 in a new buffer on d; NULL on failure. */
static inline void *ref_dev_bf16(tier_dev *d, const float *f, size_t n)
{
	uint16_t *b = malloc(2 * n + 2);
	if (!b)
		return NULL;
	for (size_t i = 0; i < n; i++)
		b[i] = tier_f32_to_bf16(f[i]);
	void *p = ref_dev_copy(d, b, 2 * n);
	free(b);
	return p;
}

/* f [rows, cols] rounded to bf16 and transposed, [cols, rows], in a new buffer on d (the w_kn 1
 * layout of the same weights); NULL on failure. */
static inline void *ref_dev_bf16_t(tier_dev *d, const float *f, size_t rows, size_t cols)
{
	uint16_t *b = malloc(2 * rows * cols + 2);
	if (!b)
		return NULL;
	for (size_t i = 0; i < rows; i++)
		for (size_t j = 0; j < cols; j++)
			b[j * rows + i] = tier_f32_to_bf16(f[i * cols + j]);
	void *p = ref_dev_copy(d, b, 2 * rows * cols);
	free(b);
	return p;
}

/* scale N(0, 1), rounded to bf16: a value both sides hold exactly. */
static inline float ref_rnd_bf16(tier_rng *r, float scale)
{
	return tier_bf16_to_f32(tier_f32_to_bf16(scale * tier_rng_normal(r)));
}

/* The start of a CUDA test's main: 0 with *gpu open, else what main returns (77: no CUDA device,
 * the test skipped; 1: the device cannot be opened), the reason printed. */
static inline int ref_gpu_open(const char *name, tier_dev **gpu)
{
	if (!tier_cuda_available()) {
		fprintf(stderr, "# %s: no CUDA device, skipped\n", name);
		return 77;
	}
	if (tier_dev_open(gpu, TIER_DEV_CUDA, 0)) {
		fprintf(stderr, "# %s: cannot open the CUDA device\n", name);
		return 1;
	}
	return 0;
}

/* ---- the CUDA tests' fixture ----
 * A test that defines REF_GPU_TEST (its name) before including this header (after cmocka.h) has a
 * CPU device (cpu), the GPU (gpu) and a generator (rng): main returns ref_gpu_run(tests, n,
 * supported), which opens the GPU, skips (77) where supported (if not NULL) says no, and runs the
 * group with cpu opened and rng seeded (TIER_TEST_SEED repeats a run). */
#ifdef REF_GPU_TEST
static tier_dev *cpu, *gpu;
static tier_rng rng;

static int ref_gpu_setup(void **state)
{
	(void)state;
	return ref_seed_cpu(&rng, REF_GPU_TEST, &cpu);
}

static int ref_gpu_teardown(void **state)
{
	(void)state;
	tier_dev_close(cpu);
	return 0;
}

static int ref_gpu_run(const struct CMUnitTest *tests, size_t n, int (*supported)(tier_dev *))
{
	int rc = ref_gpu_open(REF_GPU_TEST, &gpu);
	if (rc)
		return rc;
	if (supported && !supported(gpu)) {
		fprintf(stderr, "# %s: %s is not a compute capability 9.0 GPU, skipped\n", REF_GPU_TEST, tier_dev_name(gpu));
		tier_dev_close(gpu);
		return 77;
	}
	rc = _cmocka_run_group_tests(REF_GPU_TEST, tests, n, ref_gpu_setup, ref_gpu_teardown);
	tier_dev_close(gpu);
	return rc;
}
#endif

/* Per-expert arrays: E buffers of n random floats, their fp64 copies, and freeing either kind. */
static inline float **ref_arr(tier_rng *r, int E, size_t n, float scale)
{
	float **p = calloc((size_t)E, sizeof *p);
	for (int e = 0; e < E; e++) {
		p[e] = malloc(4 * n);
		ref_fill(r, p[e], n, scale);
	}
	return p;
}
static inline double **ref_darr(float **p, int E, size_t n)
{
	double **d = calloc((size_t)E, sizeof *d);
	for (int e = 0; e < E; e++)
		d[e] = ref_dup(p[e], n);
	return d;
}
static inline void ref_afree(void **p, int E)
{
	for (int e = 0; p && e < E; e++)
		free(p[e]);
	free(p);
}

static inline double ref_relerr(const float *a, const double *b, size_t n)
{
	double num = 0.0, den = 0.0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)a[i] - b[i]);
		if (!(d <= num)) /* NaN in a propagates as a failure */
			num = d;
		den = fabs(b[i]) > den ? fabs(b[i]) : den;
	}
	return den > 0 ? num / den : num;
}

/* ---- router ---- */
typedef struct { double v; int i; } ref_vi;
static int ref_vi_cmp(const void *a, const void *b)
{
	const ref_vi *x = a, *y = b;
	if (x->v != y->v)
		return x->v > y->v ? -1 : 1;
	return x->i - y->i;
}
/* Indices of the n largest of v (ties to the lower index), best first. */
static inline void ref_topn(const double *v, int m, int n, int *out)
{
	ref_vi *s = malloc(sizeof(ref_vi) * (size_t)m);
	for (int i = 0; i < m; i++)
		s[i] = (ref_vi){ v[i], i };
	qsort(s, (size_t)m, sizeof *s, ref_vi_cmp);
	for (int i = 0; i < n; i++)
		out[i] = s[i].i;
	free(s);
}
static inline double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The value each expert is selected by: logits, or for DeepSeek the group-masked scores + bias. */
static inline void ref_criterion(const tier_moe_router_cfg *c, const double *l, const double *bias, double *crit)
{
	int E = c->n_experts;
	if (c->kind != TIER_MOE_ROUTER_SIGMOID_GROUP) {
		memcpy(crit, l, sizeof(double) * (size_t)E);
		return;
	}
	for (int e = 0; e < E; e++)
		crit[e] = ref_sigmoid(l[e]) + (bias ? bias[e] : 0.0);
	if (c->n_group <= 1)
		return;
	int G = c->n_group, gs = E / G, top2[2], keep[TIER_MOE_MAX_EXPERTS];
	double gsc[TIER_MOE_MAX_EXPERTS];
	for (int g = 0; g < G; g++) {
		int nt = gs < 2 ? 1 : 2;
		ref_topn(crit + g * gs, gs, nt, top2);
		gsc[g] = 0;
		for (int i = 0; i < nt; i++)
			gsc[g] += crit[g * gs + top2[i]];
	}
	ref_topn(gsc, G, c->topk_group, keep);
	char kept[TIER_MOE_MAX_EXPERTS] = { 0 };
	for (int i = 0; i < c->topk_group; i++)
		kept[keep[i]] = 1;
	for (int e = 0; e < E; e++)
		if (!kept[e / gs])
			crit[e] = 0.0; /* HF: masked_fill(~score_mask, 0.0) */
}

static inline void ref_select(const tier_moe_router_cfg *c, const double *l, const double *bias, int *idx)
{
	double crit[TIER_MOE_MAX_EXPERTS];
	ref_criterion(c, l, bias, crit);
	ref_topn(crit, c->n_experts, c->top_k, idx);
}

/* Router weights of a fixed selection. */
static inline void ref_weights(const tier_moe_router_cfg *c, const double *l, const int *idx, double *w)
{
	int E = c->n_experts, k = c->top_k;
	double s = 0.0;
	if (c->kind == TIER_MOE_ROUTER_SIGMOID_GROUP) {
		for (int j = 0; j < k; j++)
			s += (w[j] = ref_sigmoid(l[idx[j]]));
		double rsf = c->routed_scaling_factor == 0.0f ? 1.0 : c->routed_scaling_factor;
		for (int j = 0; j < k; j++)
			w[j] = w[j] / (c->norm_topk_prob ? s + 1e-20 : 1.0) * rsf;
		return;
	}
	if (c->kind == TIER_MOE_ROUTER_TOPK_SOFTMAX) {
		for (int j = 0; j < k; j++)
			s += (w[j] = exp(l[idx[j]]));
		for (int j = 0; j < k; j++)
			w[j] /= s;
		return;
	}
	for (int e = 0; e < E; e++)
		s += exp(l[e]);
	double sk = 0.0;
	for (int j = 0; j < k; j++)
		sk += (w[j] = exp(l[idx[j]]) / s);
	if (c->norm_topk_prob)
		for (int j = 0; j < k; j++)
			w[j] /= sk;
}

/* aux + z of logits [T, E] with a fixed selection idx [T, k]; counts [E] out (may be NULL). */
static inline double ref_aux(int T, int E, int k, double ac, double zc, const double *l, const int *idx,
			     int *counts, double *aux_out, double *z_out)
{
	double *P = calloc((size_t)E, sizeof(double)), z = 0.0, a = 0.0;
	int *cnt = calloc((size_t)E, sizeof(int));
	for (int t = 0; t < T; t++) {
		double s = 0.0;
		for (int e = 0; e < E; e++)
			s += exp(l[t * E + e]);
		for (int e = 0; e < E; e++)
			P[e] += exp(l[t * E + e]) / s / T;
		z += log(s) * log(s) / T;
		for (int j = 0; j < k; j++)
			cnt[idx[t * k + j]]++;
	}
	for (int e = 0; e < E; e++)
		a += (double)cnt[e] / T * P[e];
	if (counts)
		memcpy(counts, cnt, sizeof(int) * (size_t)E);
	if (aux_out)
		*aux_out = ac * E * a;
	if (z_out)
		*z_out = zc * z;
	free(P);
	free(cnt);
	return ac * E * a + zc * z;
}

/* ---- experts ---- */
/* One expert on one row x [H]: y [H] = down(silu(gate x) * up x) with optional LoRA (NULL a = none). */
typedef struct { const double *a, *b; int r; double s; } ref_lora;
static inline void ref_proj(int in, int out, const double *x, const double *W, ref_lora l, double *y)
{
	for (int o = 0; o < out; o++) {
		double s = 0.0;
		for (int i = 0; i < in; i++)
			s += W[(size_t)o * in + i] * x[i];
		y[o] = s;
	}
	if (!l.a)
		return;
	for (int q = 0; q < l.r; q++) {
		double z = 0.0;
		for (int i = 0; i < in; i++)
			z += l.a[(size_t)q * in + i] * x[i];
		for (int o = 0; o < out; o++)
			y[o] += l.s * l.b[(size_t)o * l.r + q] * z;
	}
}
static inline void ref_swiglu(int H, int I, const double *x, const double *gate, const double *up, const double *down,
			      ref_lora lg, ref_lora lu, ref_lora ld, double *y)
{
	double *g = malloc(sizeof(double) * 3 * (size_t)I), *u = g + I, *h = u + I;
	ref_proj(H, I, x, gate, lg, g);
	ref_proj(H, I, x, up, lu, u);
	for (int i = 0; i < I; i++)
		h[i] = g[i] * ref_sigmoid(g[i]) * u[i];
	ref_proj(I, H, h, down, ld, y);
	free(g);
}

/* ---- the CUDA path's bf16 storage, emulated ------------------------------------------------------
 * The CUDA block (moe/moe_experts.cu, moe_bwd.cu, moe_layer.cu) stores in bf16: the gathered rows
 * xg, LoRA's Z (s X A^T in the forward, X A^T for the backward's dB) and dZ = s dY B, h = silu(g) u,
 * the expert output y (rounded once after the down product and again after the down adapter adds
 * to it; the wgmma path adds the adapter before its one rounding: 1 ulp within the tolerance), combine's
 * backward dy = w d_out, the SwiGLU backward's dG and dU, and the router's d_logits before the two
 * products with x and W_r. Everything else is fp32 (dh, dxg, dx, logits, LoRA gradients); the saved g
 * and u are bf16 on CUDA, which the tests compare at the bf16 tolerance.
 * The row references below compute in fp64 and, with rnd set, round to bf16 at exactly those
 * points, so that a CUDA result can be held to what its storage allows (rnd 0: the plain fp64
 * reference). Round to nearest even, as __float2bfloat16 does. */
static inline double ref_bf16(double v)
{
	float f = (float)v;
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return v; /* NaN stays NaN */
	u += 0x7fffu + ((u >> 16) & 1u);
	u &= 0xffff0000u;
	memcpy(&f, &u, 4);
	return f;
}
static inline double ref_rnd(int rnd, double v) { return rnd ? ref_bf16(v) : v; }

/* One expert's three weights and its adapters (a[q] NULL: none on projection q = gate, up, down). */
typedef struct {
	const float *gate, *up, *down;      /* [I, H], [I, H], [H, I] */
	const float *a[3], *b[3];           /* [r, in], [out, r] */
	double *da[3], *db[3];              /* increments, accumulated (NULL: not wanted) */
	int r;
	double s;
} ref_expert;

/* y [out] = W x, W [out, in] (fp64). */
static inline void ref_dense(int in, int out, const double *x, const float *W, double *y)
{
	for (int o = 0; o < out; o++) {
		double acc = 0.0;
		for (int i = 0; i < in; i++)
			acc += (double)W[(size_t)o * in + i] * x[i];
		y[o] = acc;
	}
}
/* y [out] += B z with z = R(s A x) [r] (an adapter's forward, the scale in Z as the CUDA path
 * stores it; nothing when a is NULL). */
static inline void ref_lora_add(int rnd, int in, int out, const double *x, const float *a, const float *b, int r,
				double s, double *y)
{
	if (!a)
		return;
	double *z = malloc(sizeof(double) * (size_t)r);
	ref_dense(in, r, x, a, z);
	for (int q = 0; q < r; q++)
		z[q] = ref_rnd(rnd, s * z[q]);
	for (int o = 0; o < out; o++) {
		double acc = 0.0;
		for (int q = 0; q < r; q++)
			acc += (double)b[(size_t)o * r + q] * z[q];
		y[o] += acc;
	}
	free(z);
}

/* Forward of one row x [H]: g, u [I] (fp32, before the CUDA path's bf16 store), y [H] (bf16 with rnd).
 * rnd 0: no rounding; 1: the CUDA path's bf16 roundings with h from g and u in fp32 (SwiGLU fused
 * into the gate/up product's epilogue); 2: the same with h from g and u as stored in bf16 (SwiGLU
 * as a kernel of its own: the per-expert loop, or an adapter on gate or up). The two orders differ
 * by more than 1% (max-relative) in about 2% of random draws of a small case (T 64, H 64, I 32, k 1:
 * session 14), so a CUDA check accepts either (check_close2). */
static inline void ref_row_fwd(int rnd, int H, int I, const ref_expert *w, const float *xr, float *g, float *u, float *y)
{
	int m = H > I ? H : I;
	double *x = malloc(sizeof(double) * 3 * (size_t)m), *t = x + m, *h = t + m;
	for (int i = 0; i < H; i++)
		x[i] = xr[i];
	ref_dense(H, I, x, w->gate, t);
	ref_lora_add(rnd, H, I, x, w->a[0], w->b[0], w->r, w->s, t);
	for (int i = 0; i < I; i++)
		g[i] = (float)t[i];
	ref_dense(H, I, x, w->up, t);
	ref_lora_add(rnd, H, I, x, w->a[1], w->b[1], w->r, w->s, t);
	for (int i = 0; i < I; i++) {
		u[i] = (float)t[i];
		double gi = rnd == 2 ? ref_bf16(g[i]) : g[i], ui = rnd == 2 ? ref_bf16(u[i]) : u[i];
		h[i] = ref_rnd(rnd, gi * ref_sigmoid(gi) * ui);
	}
	ref_dense(I, H, h, w->down, t);
	for (int o = 0; o < H; o++)
		t[o] = ref_rnd(rnd, t[o]); /* the down product writes bf16 y, ... */
	if (w->a[2]) {                     /* ... to which the adapter adds, rounding again */
		ref_lora_add(rnd, I, H, h, w->a[2], w->b[2], w->r, w->s, t);
		for (int o = 0; o < H; o++)
			t[o] = ref_rnd(rnd, t[o]);
	}
	for (int o = 0; o < H; o++)
		y[o] = (float)t[o];
	free(x);
}

/* Backward of a projection's adapter for one row: from dY [out] (as stored), input x [in]:
 * dZ = R(s B^T dY), Z = R(A x); db += s dY Z^T, da += dZ x^T, dx [in] += A^T dZ. zk: Z as the
 * forward kept it, R(s A x), and db += dY Z^T. */
static inline void ref_lora_row_bwd(int rnd, int in, int out, const float *a, const float *b, int r, double s,
				    double *da, double *db, const double *x, const double *dY, double *dx, int zk)
{
	double *dz = malloc(sizeof(double) * 2 * (size_t)r), *z = dz + r;
	for (int q = 0; q < r; q++) {
		double acc = 0.0, az = 0.0;
		for (int o = 0; o < out; o++)
			acc += (double)b[(size_t)o * r + q] * dY[o];
		for (int i = 0; i < in; i++)
			az += (double)a[(size_t)q * in + i] * x[i];
		dz[q] = ref_rnd(rnd, s * acc);
		z[q] = ref_rnd(rnd, zk ? s * az : az);
	}
	for (int o = 0; db && o < out; o++)
		for (int q = 0; q < r; q++)
			db[(size_t)o * r + q] += (zk ? 1.0 : s) * dY[o] * z[q];
	for (int q = 0; da && q < r; q++)
		for (int i = 0; i < in; i++)
			da[(size_t)q * in + i] += dz[q] * x[i];
	for (int i = 0; i < in; i++) {
		double acc = 0.0;
		for (int q = 0; q < r; q++)
			acc += (double)a[(size_t)q * in + i] * dz[q];
		dx[i] += acc;
	}
	free(dz);
}

/* Backward of one row: from x [H], the saved g, u [I] and dy [H] (as stored), dx [H] (fp32, as
 * stored) written and the adapters' increments accumulated. dot (not NULL): the row's dh . silu(g)
 * u, dh in fp32 and h unrounded as the CUDA kernel sums them. hk (not NULL): the down adapter's
 * input h as the forward left it (else made again from g and u); zk: the adapters' Z as the forward
 * kept them (ref_lora_row_bwd). */
static inline void ref_row_bwd_k(int rnd, int H, int I, const ref_expert *w, const float *xr, const float *g,
				 const float *u, const float *dyr, float *dxr, float *dot, const float *hk, int zk, int dh16)
{
	int m = H > I ? H : I;
	double *x = malloc(sizeof(double) * 7 * (size_t)m), *h = x + m, *dy = h + m, *dh = dy + m, *dG = dh + m;
	double *dU = dG + m, *dx = dU + m;
	for (int i = 0; i < H; i++)
		x[i] = xr[i], dy[i] = dyr[i];
	for (int i = 0; i < I; i++) /* CUDA recomputes h (bf16) for the down adapter, unless kept */
		h[i] = hk ? hk[i] : ref_rnd(rnd, g[i] * ref_sigmoid(g[i]) * u[i]);
	for (int i = 0; i < I; i++) {
		double acc = 0.0;
		for (int o = 0; o < H; o++)
			acc += (double)w->down[(size_t)o * I + i] * dy[o];
		dh[i] = acc;
	}
	if (w->a[2])
		ref_lora_row_bwd(rnd, I, H, w->a[2], w->b[2], w->r, w->s, w->da[2], w->db[2], h, dy, dh, zk);
	for (int i = 0; i < I; i++) /* dh is stored in fp32, or in bf16 (dh16: the fused LoRA backward's) */
		dh[i] = dh16 ? ref_bf16(dh[i]) : (double)(float)dh[i];
	double dd = 0.0;
	for (int i = 0; i < I; i++)
		dd += dh[i] * (g[i] * ref_sigmoid(g[i]) * u[i]);
	if (dot)
		*dot = (float)dd;
	for (int i = 0; i < I; i++) {
		double d = dh[i], sg = ref_sigmoid(g[i]);
		dG[i] = ref_rnd(rnd, d * u[i] * sg * (1.0 + g[i] * (1.0 - sg)));
		dU[i] = ref_rnd(rnd, d * g[i] * sg);
	}
	for (int o = 0; o < H; o++) {
		double acc = 0.0;
		for (int i = 0; i < I; i++)
			acc += (double)w->gate[(size_t)i * H + o] * dG[i] + (double)w->up[(size_t)i * H + o] * dU[i];
		dx[o] = acc;
	}
	for (int q = 0; q < 2; q++)
		if (w->a[q])
			ref_lora_row_bwd(rnd, H, I, w->a[q], w->b[q], w->r, w->s, w->da[q], w->db[q], x, q == 0 ? dG : dU, dx,
					 zk);
	for (int o = 0; o < H; o++)
		dxr[o] = (float)dx[o];
	free(x);
}

static inline void ref_row_bwd(int rnd, int H, int I, const ref_expert *w, const float *xr, const float *g,
			       const float *u, const float *dyr, float *dxr, float *dot)
{
	ref_row_bwd_k(rnd, H, I, w, xr, g, u, dyr, dxr, dot, NULL, 0, 0);
}

#endif
