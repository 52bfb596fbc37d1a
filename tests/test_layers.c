/* test_layers.c - the trainer's layers: RMSNorm, linear with LoRA, embedding and SwiGLU, forward
 * against fp64 references and backward against fp64 analytic gradients and central differences. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tier/tier.h"
#define SEEDED_CPU_TEST "test_layers" /* seeded_cpu.h: cpu, rng and seed, set up for the group */
#include "seeded_cpu.h"
#include "core/ops_cuda.h"

static float *rnd(size_t n, float scale)
{
	float *p = malloc(sizeof(float) * (n ? n : 1));
	for (size_t i = 0; i < n; i++)
		p[i] = scale * tier_rng_normal(&rng);
	return p;
}

static float *poisoned(size_t n)
{
	float *p = malloc(sizeof(float) * (n ? n : 1));
	for (size_t i = 0; i < n; i++)
		p[i] = NAN;
	return p;
}

static void close_to(const float *got, const double *want, size_t n, double tol)
{
	for (size_t i = 0; i < n; i++)
		if (!(fabs(got[i] - want[i]) <= tol * (1.0 + fabs(want[i])))) {
			printf("# element %zu: got %.8g want %.8g\n", i, got[i], want[i]);
			fail();
		}
}

/* fp64 RMSNorm of one row; returns rstd. */
static double ref_rms(const float *x, const float *w, int D, double eps, double *y)
{
	double ss = 0;
	for (int j = 0; j < D; j++)
		ss += (double)x[j] * x[j];
	double r = 1.0 / sqrt(ss / D + eps);
	for (int j = 0; j < D; j++)
		y[j] = w[j] * x[j] * r;
	return r;
}

/* sum(R . rmsnorm(x)) in fp64, for central differences. */
static double rms_obj(const float *x, const float *w, const float *R, int rows, int D, double eps)
{
	double s = 0, *y = malloc(sizeof(double) * D);
	for (int i = 0; i < rows; i++) {
		ref_rms(x + (size_t)i * D, w, D, eps, y);
		for (int j = 0; j < D; j++)
			s += R[(size_t)i * D + j] * y[j];
	}
	free(y);
	return s;
}

static void test_rmsnorm(void **state)
{
	(void)state;
	static const int shapes[][2] = { { 1, 1 }, { 3, 7 }, { 17, 32 }, { 5, 129 } };
	for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
		int rows = shapes[c][0], D = shapes[c][1];
		size_t n = (size_t)rows * D;
		float *x = rnd(n, 2.0f), *w = rnd((size_t)D, 1.0f), *R = rnd(n, 1.0f), *y = poisoned(n), *rs = poisoned(rows);
		float *dx = poisoned(n), *dw = calloc((size_t)D, sizeof(float));
		double *want = malloc(sizeof(double) * n), eps = 1e-6;
		assert_int_equal(tier_rmsnorm_fwd(cpu, rows, D, (float)eps, x, w, y, rs), 0);
		for (int i = 0; i < rows; i++) {
			double r = ref_rms(x + (size_t)i * D, w, D, eps, want + (size_t)i * D);
			assert_true(fabs(rs[i] - r) <= 1e-5 * r);
		}
		close_to(y, want, n, 1e-5);
		assert_int_equal(tier_rmsnorm_bwd(cpu, rows, D, x, w, rs, R, dx, dw), 0);
		for (size_t i = 0; i < n; i++) { /* dx by central differences of the fp64 objective */
			float x0 = x[i];
			/* the step follows the row's scale: rmsnorm bends over sqrt(mean x^2 + eps), so a
			 * one-element row with |x| near 0.01 needs a step far below 1e-3 (seed 1796172720) */
			double ss = eps;
			for (int j = 0; j < D; j++)
				ss += (double)x[i / D * D + j] * x[i / D * D + j] / D;
			double h = 1e-3 * sqrt(ss);
			x[i] = (float)(x0 + h);
			double hp = x[i] - x0, lp = rms_obj(x, w, R, rows, D, eps);
			x[i] = (float)(x0 - h);
			double hm = x0 - x[i], lm = rms_obj(x, w, R, rows, D, eps);
			x[i] = x0;
			want[i] = (lp - lm) / (hp + hm);
		}
		close_to(dx, want, n, 2e-3);
		for (int j = 0; j < D; j++) {
			double s = 0;
			for (int i = 0; i < rows; i++) {
				double yy[1024];
				double r = ref_rms(x + (size_t)i * D, w, D, eps, yy);
				s += R[(size_t)i * D + j] * x[(size_t)i * D + j] * r;
			}
			want[j] = s;
		}
		close_to(dw, want, (size_t)D, 1e-4);
		free(x), free(w), free(R), free(y), free(rs), free(dx), free(dw), free(want);
	}
}

/* fp64 y = x W^T + s (x A^T) B^T. */
static void ref_linear(int T, int in, int out, int r, float s, const float *x, const float *W, const float *A,
		       const float *B, double *y)
{
	for (int t = 0; t < T; t++) {
		double xa[64] = { 0 };
		for (int q = 0; q < r; q++)
			for (int i = 0; i < in; i++)
				xa[q] += (double)x[t * in + i] * A[q * in + i];
		for (int o = 0; o < out; o++) {
			double v = 0;
			for (int i = 0; i < in; i++)
				v += (double)x[t * in + i] * W[o * in + i];
			for (int q = 0; q < r; q++)
				v += s * xa[q] * B[o * r + q];
			y[t * out + o] = v;
		}
	}
}

static double lin_obj(int T, int in, int out, int r, float s, const float *x, const float *W, const float *A,
		      const float *B, const float *R)
{
	double *y = malloc(sizeof(double) * T * out), v = 0;
	ref_linear(T, in, out, r, s, x, W, A, B, y);
	for (int i = 0; i < T * out; i++)
		v += y[i] * R[i];
	free(y);
	return v;
}

/* Central differences of sum(R . y) with respect to every element of p (n of them). */
static void fd(float *p, size_t n, double *out, int T, int in, int outd, int r, float s, const float *x,
	       const float *W, const float *A, const float *B, const float *R)
{
	for (size_t i = 0; i < n; i++) {
		float p0 = p[i];
		double h = 1e-2;
		p[i] = (float)(p0 + h);
		double hp = p[i] - p0, lp = lin_obj(T, in, outd, r, s, x, W, A, B, R);
		p[i] = (float)(p0 - h);
		double hm = p0 - p[i], lm = lin_obj(T, in, outd, r, s, x, W, A, B, R);
		p[i] = p0;
		out[i] = (lp - lm) / (hp + hm);
	}
}

static void test_linear_lora(void **state)
{
	(void)state;
	static const int shapes[][4] = { { 1, 1, 1, 1 }, { 5, 7, 3, 2 }, { 13, 16, 24, 4 }, { 9, 33, 17, 8 } };
	for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
		int T = shapes[c][0], in = shapes[c][1], out = shapes[c][2], r = shapes[c][3];
		float s = 2.0f / (float)r;
		float *x = rnd((size_t)T * in, 1), *W = rnd((size_t)out * in, 0.5f), *A = rnd((size_t)r * in, 0.5f);
		float *B = rnd((size_t)out * r, 0.5f), *R = rnd((size_t)T * out, 1), *y = poisoned((size_t)T * out);
		float *dx = poisoned((size_t)T * in), *dA = calloc((size_t)r * in, 4), *dB = calloc((size_t)out * r, 4);
		float *ws = poisoned(2 * (size_t)T * r);
		size_t big = (size_t)T * (in > out ? in : out) + (size_t)r * (in > out ? in : out);
		double *want = malloc(sizeof(double) * big);
		tier_lora_ref lo = { .a = A, .b = B, .da = dA, .db = dB, .rank = r, .scale = s };
		assert_int_equal(tier_linear_ws_floats(T, in, &lo), 2 * (size_t)T * r);
		assert_int_equal(tier_linear_fwd(cpu, T, in, out, x, W, &lo, y, ws), 0);
		ref_linear(T, in, out, r, s, x, W, A, B, want);
		close_to(y, want, (size_t)T * out, 1e-5);
		assert_int_equal(tier_linear_bwd(cpu, T, in, out, x, W, &lo, R, dx, 0, ws), 0);
		fd(x, (size_t)T * in, want, T, in, out, r, s, x, W, A, B, R);
		close_to(dx, want, (size_t)T * in, 1e-3);
		fd(A, (size_t)r * in, want, T, in, out, r, s, x, W, A, B, R);
		close_to(dA, want, (size_t)r * in, 1e-3);
		fd(B, (size_t)out * r, want, T, in, out, r, s, x, W, A, B, R);
		close_to(dB, want, (size_t)out * r, 1e-3);
		/* accumulate = 1 adds to dx; LoRA gradients accumulate across calls */
		float *dx2 = malloc(sizeof(float) * T * in);
		memcpy(dx2, dx, sizeof(float) * T * in);
		assert_int_equal(tier_linear_bwd(cpu, T, in, out, x, W, &lo, R, dx2, 1, ws), 0);
		for (int i = 0; i < T * in; i++)
			assert_true(fabsf(dx2[i] - 2 * dx[i]) <= 1e-5f * (1 + fabsf(dx[i])));
		/* without LoRA: the plain product */
		assert_int_equal(tier_linear_fwd(cpu, T, in, out, x, W, NULL, y, NULL), 0);
		ref_linear(T, in, out, 0, s, x, W, A, B, want);
		close_to(y, want, (size_t)T * out, 1e-5);
		free(x), free(W), free(A), free(B), free(R), free(y), free(dx), free(dA), free(dB), free(ws), free(want);
		free(dx2);
	}
}

/* LoRA dropout (PEFT's lora_dropout): the mask keeps about 1 - p of the elements and depends on the
 * key; the layer and its gradients equal an fp64 reference that feeds the adapter the masked and
 * rescaled input; the mean over many masks is the layer without dropout. */
static void test_linear_dropout(void **state)
{
	(void)state;
	int kept = 0, n = 200000, differ = 0;
	for (int k = 0; k < n; k++)
		kept += tier_lora_keep(77, 0.25f, k / 500, k % 500);
	double f = (double)kept / n; /* binomial: sd 0.001 */
	printf("# dropout 0.25: kept %.4f of %d\n", f, n);
	assert_true(f > 0.745 && f < 0.755);
	for (int k = 0; k < 1000; k++) {
		assert_int_equal(tier_lora_keep(77, 0.25f, 3, k), tier_lora_keep(77, 0.25f, 3, k));
		differ += tier_lora_keep(77, 0.25f, 3, k) != tier_lora_keep(78, 0.25f, 3, k);
	}
	assert_true(differ > 250); /* about 2 p (1 - p) = 37.5% */
	int T = 9, in = 33, out = 17, r = 4;
	float s = 0.5f, p = 0.3f, keep = 1.0f / (1.0f - p);
	float *x = rnd((size_t)T * in, 1), *W = rnd((size_t)out * in, 0.5f), *A = rnd((size_t)r * in, 0.5f);
	float *B = rnd((size_t)out * r, 0.5f), *R = rnd((size_t)T * out, 1), *y = poisoned((size_t)T * out);
	float *dx = poisoned((size_t)T * in), *dA = calloc((size_t)r * in, 4), *dB = calloc((size_t)out * r, 4);
	tier_lora_ref lo = { .a = A, .b = B, .da = dA, .db = dB, .rank = r, .scale = s, .dropout = p, .mask_key = 1234 };
	size_t nws = tier_linear_ws_floats(T, in, &lo);
	assert_int_equal(nws, 2 * (size_t)T * r + (size_t)T * in);
	float *ws = poisoned(nws);
	assert_int_equal(tier_linear_fwd(cpu, T, in, out, x, W, &lo, y, ws), 0);
	assert_int_equal(tier_linear_bwd(cpu, T, in, out, x, W, &lo, R, dx, 0, ws), 0);
	double *xm = malloc(sizeof(double) * T * in), *xa = calloc((size_t)T * r, 8), *dyb = calloc((size_t)T * r, 8);
	double *wy = malloc(sizeof(double) * T * out), *wdx = malloc(sizeof(double) * T * in);
	double *wdA = calloc((size_t)r * in, 8), *wdB = calloc((size_t)out * r, 8);
	for (int t = 0; t < T; t++)
		for (int i = 0; i < in; i++)
			xm[t * in + i] = tier_lora_keep(1234, p, t, i) ? (double)x[t * in + i] * keep : 0.0;
	for (int t = 0; t < T; t++) {
		for (int q = 0; q < r; q++)
			for (int i = 0; i < in; i++)
				xa[t * r + q] += xm[t * in + i] * A[q * in + i];
		for (int q = 0; q < r; q++)
			for (int o = 0; o < out; o++)
				dyb[t * r + q] += (double)R[t * out + o] * B[o * r + q];
		for (int o = 0; o < out; o++) {
			double v = 0;
			for (int i = 0; i < in; i++)
				v += (double)x[t * in + i] * W[o * in + i];
			for (int q = 0; q < r; q++)
				v += s * xa[t * r + q] * B[o * r + q];
			wy[t * out + o] = v;
		}
		for (int i = 0; i < in; i++) {
			double v = 0, l = 0;
			for (int o = 0; o < out; o++)
				v += (double)R[t * out + o] * W[o * in + i];
			for (int q = 0; q < r; q++)
				l += s * dyb[t * r + q] * A[q * in + i];
			wdx[t * in + i] = v + (tier_lora_keep(1234, p, t, i) ? l * keep : 0.0);
		}
		for (int q = 0; q < r; q++) {
			for (int i = 0; i < in; i++)
				wdA[q * in + i] += s * dyb[t * r + q] * xm[t * in + i];
			for (int o = 0; o < out; o++)
				wdB[o * r + q] += s * (double)R[t * out + o] * xa[t * r + q];
		}
	}
	close_to(y, wy, (size_t)T * out, 1e-5);
	close_to(dx, wdx, (size_t)T * in, 1e-5);
	close_to(dA, wdA, (size_t)r * in, 1e-5);
	close_to(dB, wdB, (size_t)out * r, 1e-5);
	/* the mean over many masks of the adapter's term is the undropped one */
	int K = 4000, To = 2, io = 8;
	double mean[2 * 17] = { 0 }, want[2 * 17], lt = 0, dev = 0;
	for (int k = 0; k < K; k++) {
		lo.mask_key = 5000 + (uint64_t)k;
		assert_int_equal(tier_linear_fwd(cpu, To, io, out, x, W, &lo, y, ws), 0);
		for (int j = 0; j < To * out; j++)
			mean[j] += (double)y[j] / K;
	}
	ref_linear(To, io, out, r, s, x, W, A, B, want);
	double *base = malloc(sizeof(double) * To * out);
	ref_linear(To, io, out, 0, s, x, W, A, B, base);
	for (int j = 0; j < To * out; j++)
		lt += (want[j] - base[j]) * (want[j] - base[j]), dev += (mean[j] - want[j]) * (mean[j] - want[j]);
	printf("# mean over %d masks: %.3f of the adapter's term away\n", K, sqrt(dev / lt));
	assert_true(sqrt(dev / lt) < 0.05);
	free(x), free(W), free(A), free(B), free(R), free(y), free(dx), free(dA), free(dB), free(ws), free(xm);
	free(xa), free(dyb), free(wy), free(wdx), free(wdA), free(wdB), free(base);
}

static void test_embedding(void **state)
{
	(void)state;
	int T = 11, V = 7, D = 5;
	float *tab = rnd((size_t)V * D, 1), *out = poisoned((size_t)T * D), *g = rnd((size_t)T * D, 1);
	float *dt = calloc((size_t)V * D, 4);
	int32_t tok[11];
	double want[35] = { 0 };
	for (int t = 0; t < T; t++)
		tok[t] = (int32_t)tier_rng_below(&rng, 4); /* repeats: the backward must add them up */
	assert_int_equal(tier_embed_fwd(cpu, T, V, D, tok, tab, out), 0);
	for (int t = 0; t < T; t++)
		assert_memory_equal(out + t * D, tab + tok[t] * D, sizeof(float) * D);
	assert_int_equal(tier_embed_bwd(cpu, T, V, D, tok, g, dt), 0);
	for (int t = 0; t < T; t++)
		for (int j = 0; j < D; j++)
			want[tok[t] * D + j] += g[t * D + j];
	close_to(dt, want, (size_t)V * D, 1e-6);
	tok[4] = V;
	assert_int_equal(tier_embed_fwd(cpu, T, V, D, tok, tab, out), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "vocabulary"));
	tok[4] = -1;
	assert_int_equal(tier_embed_bwd(cpu, T, V, D, tok, g, dt), -EINVAL);
	free(tab), free(out), free(g), free(dt);
}

static void test_swiglu(void **state)
{
	(void)state;
	size_t n = 37;
	float *g = rnd(n, 3), *u = rnd(n, 1), *h = poisoned(n), *dh = rnd(n, 1), *dg = poisoned(n), *du = poisoned(n);
	double want[37], wdg[37], wdu[37];
	assert_int_equal(tier_swiglu_fwd(cpu, n, g, u, h), 0);
	for (size_t i = 0; i < n; i++) {
		double s = 1.0 / (1.0 + exp(-(double)g[i])), e = 1e-4;
		want[i] = g[i] * s * u[i];
		double sp = 1.0 / (1.0 + exp(-(g[i] + e))), sm = 1.0 / (1.0 + exp(-(g[i] - e)));
		wdg[i] = dh[i] * u[i] * ((g[i] + e) * sp - (g[i] - e) * sm) / (2 * e);
		wdu[i] = dh[i] * g[i] * s;
	}
	close_to(h, want, n, 1e-5);
	assert_int_equal(tier_swiglu_bwd(cpu, n, g, u, dh, dg, du), 0);
	close_to(dg, wdg, n, 1e-4);
	close_to(du, wdu, n, 1e-5);
	free(g), free(u), free(h), free(dh), free(dg), free(du);
}

static void test_bad_input(void **state)
{
	(void)state;
	float x[4] = { 1, 2, 3, 4 }, w[4] = { 1, 1, 1, 1 }, y[4], r[2];
	assert_int_equal(tier_rmsnorm_fwd(cpu, 0, 2, 1e-6f, x, w, y, r), -EINVAL);
	assert_int_equal(tier_rmsnorm_fwd(cpu, 2, 2, -1.0f, x, w, y, r), -EINVAL);
	assert_int_equal(tier_rmsnorm_fwd(cpu, 2, 2, 1e-6f, NULL, w, y, r), -EINVAL);
	assert_int_equal(tier_rmsnorm_fwd(NULL, 2, 2, 1e-6f, x, w, y, r), -EINVAL);
	assert_int_equal(tier_rmsnorm_bwd(cpu, 2, 2, x, w, NULL, x, y, NULL), -EINVAL);
	tier_lora_ref half = { .a = x, .rank = 1, .scale = 1 };
	float ws[8];
	assert_int_equal(tier_linear_fwd(cpu, 2, 2, 2, x, w, &half, y, ws), -EINVAL);
	tier_lora_ref nows = { .a = x, .b = w, .rank = 1, .scale = 1 };
	assert_int_equal(tier_linear_fwd(cpu, 2, 2, 2, x, w, &nows, y, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "ws"));
	assert_int_equal(tier_linear_bwd(cpu, 2, 0, 2, x, w, NULL, x, y, 0, NULL), -EINVAL);
	assert_int_equal(tier_swiglu_fwd(cpu, 4, x, NULL, y), -EINVAL);
}

/* The one-product backward of several projections (core/ops_cat.c, every build): its columns,
 * its workspace, and each refusal naming its problem. */
static void test_linear_cat_args(void **state)
{
	(void)state;
	float a[4], b[4];
	const uint16_t w[4] = { 0 };
	tier_lora_ref lo = { .a = a, .b = b, .rank = 16, .scale = 2 }, frozen = lo, drop = lo, half = { .a = a, .rank = 4 };
	frozen.rank = 8, drop.dropout = 0.1f;
	opsc_lin_seg s[3] = { { 4096, w, &lo }, { 512, w, &frozen }, { 512, w, NULL } };
	int dy[1], ws[1];
	float dx[1];
	assert_int_equal(opsc_linear_cat_cols(3, s), 4096 + 512 + 512 + 16 + 8);
	/* the stacked weights [cols, in] bf16, then every adapter's x A^T [T, 16 + 8] bf16, each piece
	 * 256-byte aligned */
	assert_int_equal(opsc_linear_cat_ws_bytes(100, 2048, 3, s), (size_t)5144 * 2048 * 2 + (100 * 24 * 2 + 255) / 256 * 256);
	/* the forward's: the adapters' A rows [16 + 8, in], then x A^T [T, 16 + 8], both bf16 */
	assert_int_equal(opsc_linear_cat_fwd_ws_bytes(100, 2048, 3, s), (size_t)24 * 2048 * 2 + (100 * 24 * 2 + 255) / 256 * 256);
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5144, dx, ws), 0);
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 0, 2048, NULL, 3, s, NULL, 5144, NULL, NULL), 0);
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5143, dx, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_linear_bwd_cat: dy's row stride 5143"));
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 0, s, dy, 5144, dx, ws), -EINVAL);
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, OPSC_CAT_MAX + 1, s, dy, 5144, dx, ws), -EINVAL);
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5144, dx, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "workspace"));
	s[1].lora = &drop;
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5160, dx, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "dropout"));
	s[1].lora = &half;
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5160, dx, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "needs a and b"));
	s[1].lora = NULL, s[2].out = 0;
	assert_int_equal(opsc_linear_cat_check("opsc_linear_bwd_cat", 100, 2048, w, 3, s, dy, 5160, dx, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "segment 2"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_rmsnorm),
		cmocka_unit_test(test_linear_lora),
		cmocka_unit_test(test_linear_dropout),
		cmocka_unit_test(test_embedding),
		cmocka_unit_test(test_swiglu),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_linear_cat_args),
	};
	return cmocka_run_group_tests(tests, seeded_cpu_setup, seeded_cpu_teardown);
}
