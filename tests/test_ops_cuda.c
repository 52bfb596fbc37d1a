/* test_ops_cuda.c - the trainer's CUDA operations (core/ops_cuda.h) against fp64 references on the
 * same bf16-rounded inputs: odd sizes, outputs poisoned with NaN, accumulation checked against the
 * initial contents. Skips (exit 77) without a GPU. */
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
#include "core/ops_cuda.h"
#include "env_keep.h"
#include "test_seed.h"

#define TOL_BF16 1e-2  /* bf16 outputs, and products of bf16 operands (bf16 intermediates) */
#define TOL_F32 1e-5   /* fp32 elementwise arithmetic */
#define TOL_F64 1e-9   /* sums kept in fp64 */
#define CUDA_R_16BF 14 /* cudaDataType_t values (library_types.h) without the CUDA headers */
#define CUDA_R_32F 0

static tier_rng rng;
static tier_dev *cpu, *gpu;
static float l_dummy[4];
#define L_NONNULL ((void *)l_dummy) /* a pointer the argument checks refuse on other grounds first */

static void *up(const void *h, size_t n)
{
	void *d = NULL;
	assert_int_equal(tier_dev_malloc(gpu, n ? n : 4, &d), 0);
	if (n)
		assert_int_equal(tier_dev_memcpy_h2d(gpu, d, h, n), 0);
	return d;
}

static void *poisoned(size_t n)
{
	void *h = malloc(n ? n : 4), *d;
	memset(h, 0xff, n ? n : 4);                              /* NaN as fp32 and as bf16 */
	d = up(h, n);
	free(h);
	return d;
}

static void down(void *h, const void *d, size_t n)
{
	assert_int_equal(tier_dev_sync(gpu), 0);
	assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, n), 0);
}

/* Random values rounded to bf16: bits for the GPU, the same values in fp64 for the reference. */
static uint16_t *rand_bf16(double *ref, size_t n, float scale, float shift)
{
	uint16_t *b = malloc(2 * (n ? n : 1));
	for (size_t i = 0; i < n; i++) {
		b[i] = tier_f32_to_bf16(shift + scale * tier_rng_normal(&rng));
		ref[i] = tier_bf16_to_f32(b[i]);
	}
	return b;
}

static float *rand_f32(double *ref, size_t n, float scale)
{
	float *f = malloc(4 * (n ? n : 1));
	for (size_t i = 0; i < n; i++) {
		f[i] = scale * tier_rng_normal(&rng);
		if (ref)
			ref[i] = f[i];
	}
	return f;
}

static double max_abs(const double *r, size_t n)
{
	double m = 0;
	for (size_t i = 0; i < n; i++)
		m = fabs(r[i]) > m ? fabs(r[i]) : m;
	return m;
}

/* max |got - ref| / norm (norm 0: max |ref|); NaN anywhere is an infinite error. */
static double err_f32(const float *got, const double *ref, size_t n, double norm)
{
	double e = 0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - ref[i]);
		if (isnan(d))
			return INFINITY;
		e = d > e ? d : e;
	}
	norm = norm > 0 ? norm : max_abs(ref, n);
	return norm > 0 ? e / norm : e;
}

static double err_bf16(const uint16_t *got, const double *ref, size_t n)
{
	float *f = malloc(4 * (n ? n : 1));
	for (size_t i = 0; i < n; i++)
		f[i] = tier_bf16_to_f32(got[i]);
	double e = err_f32(f, ref, n, 0);
	free(f);
	return e;
}

static void check(const char *what, double err, double tol)
{
	print_message("  %-34s rel err %.3g (tol %.0g)\n", what, err, tol);
	assert_true(err <= tol);
}

/* Y [M, N] += alpha op(X) op(Z), row-major: op(X) [M, K] is X [M, K] (tx 0) or X [K, M] transposed
 * (tx 1); op(Z) [K, N] is Z [K, N] (tz 0) or Z [N, K] transposed (tz 1). */
static void ref_mm(int M, int N, int K, double alpha, const double *X, int tx, const double *Z, int tz, double *Y)
{
	for (int m = 0; m < M; m++)
		for (int n = 0; n < N; n++) {
			double s = 0;
			for (int k = 0; k < K; k++)
				s += (tx ? X[(size_t)k * M + m] : X[(size_t)m * K + k]) *
				     (tz ? Z[(size_t)n * K + k] : Z[(size_t)k * N + n]);
			Y[(size_t)m * N + n] += alpha * s;
		}
}

/* ---- cuBLASLt product ------------------------------------------------------------------------ */

/* Column-major C [m x n] = alpha op(A) op(B) + beta C with padded lds, both operand types, every
 * transpose pair; beta 0 must not read the poisoned C. */
static void gemm_case(int type, int ta, int tb, float beta)
{
	int m = 13, n = 7, k = 29, esz = type == CUDA_R_16BF ? 2 : 4;
	int ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n, lda = ra + 3, ldb = rb + 1, ldc = m + 2;
	size_t na = (size_t)lda * ca, nb = (size_t)ldb * cb, nc = (size_t)ldc * n;
	double *a = calloc(na, 8), *b = calloc(nb, 8), *c = calloc(nc, 8);
	uint16_t *ab = type == CUDA_R_16BF ? rand_bf16(a, na, 1.0f, 0) : NULL, *bb = ab ? rand_bf16(b, nb, 1.0f, 0) : NULL;
	float *af = ab ? NULL : rand_f32(a, na, 1.0f), *bf = ab ? NULL : rand_f32(b, nb, 1.0f);
	float *c0 = rand_f32(c, nc, 1.0f), *cg = malloc(4 * nc);
	void *dA = up(ab ? (void *)ab : (void *)af, na * esz), *dB = up(bb ? (void *)bb : (void *)bf, nb * esz);
	void *dC = beta == 0 ? poisoned(4 * nc) : up(c0, 4 * nc);
	char name[64];
	for (int j = 0; j < n; j++)
		for (int i = 0; i < m; i++) {
			double s = 0, *ci = &c[i + (size_t)j * ldc];
			for (int l = 0; l < k; l++)
				s += (ta ? a[l + (size_t)i * lda] : a[i + (size_t)l * lda]) *
				     (tb ? b[j + (size_t)l * ldb] : b[l + (size_t)j * ldb]);
			*ci = 0.5 * s + (beta == 0 ? 0 : beta * *ci);
		}
	opsc_operand A = { ta, dA, type, lda }, B = { tb, dB, type, ldb };
	assert_int_equal(opsc_gemm(gpu, m, n, k, 0.5f, A, B, beta, dC, ldc), 0);
	down(cg, dC, 4 * nc);
	for (int j = 0; j < n; j++)                     /* padding rows below m untouched, then skipped */
		for (int i = m; i < ldc; i++) {
			float *gi = &cg[i + (size_t)j * ldc];
			uint32_t bits;
			memcpy(&bits, gi, 4);
			assert_true(beta == 0 ? bits == 0xffffffffu : *gi == c0[i + (size_t)j * ldc]);
			*gi = (float)c[i + (size_t)j * ldc];
		}
	snprintf(name, sizeof name, "gemm %s %c%c beta %.2g", ab ? "bf16" : "fp32", ta ? 'T' : 'N', tb ? 'T' : 'N', beta);
	check(name, err_f32(cg, c, nc, 0), TOL_BF16);
	tier_dev_free(gpu, dA), tier_dev_free(gpu, dB), tier_dev_free(gpu, dC);
	free(a), free(b), free(c), free(ab), free(bb), free(af), free(bf), free(c0), free(cg);
}

static void test_gemm(void **state)
{
	(void)state;
	for (int type = 0; type < 2; type++)
		for (int t = 0; t < 4; t++)
			gemm_case(type ? CUDA_R_16BF : CUDA_R_32F, t & 1, t >> 1, t == 3 ? 0.0f : 0.25f);
	/* k = 0: C = beta C; beta 0 writes zeros over the poison */
	float c[6], z[6] = { 0 };
	void *dC = poisoned(sizeof c), *dA = poisoned(64);
	opsc_operand A = { 0, dA, CUDA_R_16BF, 2 }, B = { 0, dA, CUDA_R_16BF, 1 };
	assert_int_equal(opsc_gemm(gpu, 2, 3, 0, 1.0f, A, B, 0.0f, dC, 2), 0);
	down(c, dC, sizeof c);
	assert_memory_equal(c, z, sizeof c);
	tier_dev_free(gpu, dC), tier_dev_free(gpu, dA);
}

/* ---- Linear layer with LoRA ------------------------------------------------------------------
 * Without dropout against fp64 products; with dropout against the CPU layer (tier_linear_fwd /
 * _bwd, fp32) on the same bf16 values and mask key, so the mask under test is tier_lora_keep's. */

enum { NO_LORA, LORA, LORA_FROZEN };

typedef struct {
	int T, in, out, r;
	double scale;
	double *x, *w, *a, *b, *dy;
	uint16_t *xb, *wb, *ab, *bb;
	float *dyf;
	void *dx_, *dw_, *da_, *db_, *ddy;
} lin;

static void lin_init(lin *L)
{
	size_t T = L->T, in = L->in, out = L->out, r = L->r;
	L->x = malloc(8 * T * in), L->w = malloc(8 * out * in), L->a = malloc(8 * r * in), L->b = malloc(8 * out * r);
	L->dy = malloc(8 * T * out);
	L->xb = rand_bf16(L->x, T * in, 1.0f, 0), L->wb = rand_bf16(L->w, out * in, 1.0f / sqrtf((float)in), 0);
	/* A and B of the same size as W's contribution, so that a LoRA mistake shows */
	L->ab = rand_bf16(L->a, r * in, 1.0f / sqrtf((float)in), 0), L->bb = rand_bf16(L->b, out * r, 0.5f / sqrtf((float)r), 0);
	uint16_t *dyb = rand_bf16(L->dy, T * out, 1.0f, 0);      /* dy exact in bf16: its conversion is exact */
	L->dyf = malloc(4 * T * out);
	for (size_t i = 0; i < T * out; i++)
		L->dyf[i] = (float)L->dy[i];
	free(dyb);
	L->dx_ = up(L->xb, 2 * T * in), L->dw_ = up(L->wb, 2 * out * in), L->da_ = up(L->ab, 2 * r * in);
	L->db_ = up(L->bb, 2 * out * r), L->ddy = up(L->dyf, 4 * T * out);
}

static void lin_free(lin *L)
{
	free(L->x), free(L->w), free(L->a), free(L->b), free(L->dy), free(L->xb), free(L->wb), free(L->ab), free(L->bb);
	free(L->dyf);
	tier_dev_free(gpu, L->dx_), tier_dev_free(gpu, L->dw_), tier_dev_free(gpu, L->da_), tier_dev_free(gpu, L->db_);
	tier_dev_free(gpu, L->ddy);
}

static float *f32_of(const double *v, size_t n)
{
	float *f = malloc(4 * (n ? n : 1));
	for (size_t i = 0; i < n; i++)
		f[i] = (float)v[i];
	return f;
}

static void widen(double *d, const float *f, size_t n)
{
	for (size_t i = 0; i < n; i++)
		d[i] = f[i];
}

/* fp32 copies of a case's values for the CPU layer; l is lr (its dropout and key) on them. */
typedef struct {
	float *x, *w, *a, *b, *dy, *ws;
	tier_lora_ref l;
} lin_cpu;

static void cpu_init(lin_cpu *C, const lin *L, const tier_lora_ref *lr)
{
	size_t T = L->T, in = L->in, out = L->out, r = L->r;
	C->x = f32_of(L->x, T * in), C->w = f32_of(L->w, out * in), C->a = f32_of(L->a, r * in);
	C->b = f32_of(L->b, out * r), C->dy = f32_of(L->dy, T * out);
	C->l = *lr;
	C->l.a = C->a, C->l.b = C->b, C->l.da = C->l.db = NULL;
	C->ws = malloc(4 * tier_linear_ws_floats(L->T, L->in, &C->l));
}

static void cpu_free(lin_cpu *C)
{
	free(C->x), free(C->w), free(C->a), free(C->b), free(C->dy), free(C->ws);
}

/* y [T, out] = the CPU layer's forward with dropout. */
static void cpu_fwd(const lin *L, const tier_lora_ref *lr, double *y)
{
	lin_cpu C;
	float *yf = malloc(4 * (size_t)L->T * L->out);
	cpu_init(&C, L, lr);
	assert_int_equal(tier_linear_fwd(cpu, L->T, L->in, L->out, C.x, C.w, &C.l, yf, C.ws), 0);
	widen(y, yf, (size_t)L->T * L->out);
	cpu_free(&C), free(yf);
}

/* dx [T, in] (NULL: not wanted) and da, db (NULL: frozen) = the CPU layer's backward with dropout,
 * the gradients from zero. */
static void cpu_bwd(const lin *L, const tier_lora_ref *lr, double *dx, double *da, double *db)
{
	size_t nx = (size_t)L->T * L->in, na = (size_t)L->r * L->in, nb = (size_t)L->out * L->r;
	lin_cpu C;
	float *dxf = malloc(4 * nx), *daf = calloc(na, 4), *dbf = calloc(nb, 4);
	cpu_init(&C, L, lr);
	C.l.da = da ? daf : NULL, C.l.db = db ? dbf : NULL;
	assert_int_equal(tier_linear_bwd(cpu, L->T, L->in, L->out, C.x, C.w, &C.l, C.dy, dx ? dxf : NULL, 0, C.ws), 0);
	if (dx)
		widen(dx, dxf, nx);
	if (da)
		widen(da, daf, na);
	if (db)
		widen(db, dbf, nb);
	cpu_free(&C), free(dxf), free(daf), free(dbf);
}

static void lin_fwd(const lin *L, const tier_lora_ref *lr, void *ws)
{
	size_t Tout = (size_t)L->T * L->out;
	double *y = calloc(Tout, 8), *ylora = calloc(Tout, 8), *xa = calloc((size_t)L->T * L->r, 8);
	float *yg = malloc(4 * Tout);
	void *dy = poisoned(4 * Tout);
	ref_mm(L->T, L->out, L->in, 1, L->x, 0, L->w, 1, y);              /* x W^T */
	if (lr) {
		ref_mm(L->T, L->r, L->in, 1, L->x, 0, L->a, 1, xa);       /* x A^T */
		ref_mm(L->T, L->out, L->r, L->scale, xa, 0, L->b, 1, ylora);
		assert_true(max_abs(ylora, Tout) > 0.1 * max_abs(y, Tout));
		for (size_t i = 0; i < Tout; i++)
			y[i] += ylora[i];
	}
	if (lr && lr->dropout > 0) {
		double *yd = malloc(8 * Tout);
		float *yf = f32_of(y, Tout);
		cpu_fwd(L, lr, yd);
		/* the mask changes y well beyond the tolerance: a GPU that ignored it would fail */
		assert_true(err_f32(yf, yd, Tout, 0) > 10 * TOL_BF16);
		memcpy(y, yd, 8 * Tout);
		free(yd), free(yf);
	}
	assert_int_equal(opsc_linear_fwd(gpu, L->T, L->in, L->out, L->dx_, L->dw_, lr, dy, ws), 0);
	down(yg, dy, 4 * Tout);
	check(!lr ? "linear fwd y" : lr->dropout > 0 ? "linear fwd y (LoRA, dropout)" : "linear fwd y (LoRA)",
	      err_f32(yg, y, Tout, 0), TOL_BF16);
	/* in bf16 (opsc_linear_fwd16): the adapter's part rounded, then the main product added */
	void *dy16 = poisoned(2 * Tout);
	uint16_t *y16 = malloc(2 * Tout);
	assert_int_equal(opsc_linear_fwd16(gpu, L->T, L->in, L->out, L->dx_, L->dw_, lr, dy16, ws), 0);
	down(y16, dy16, 2 * Tout);
	check(!lr ? "linear fwd16 y" : lr->dropout > 0 ? "linear fwd16 y (LoRA, dropout)" : "linear fwd16 y (LoRA)",
	      err_bf16(y16, y, Tout), TOL_BF16);
	tier_dev_free(gpu, dy16), free(y16);
	/* with a residual (opsc_linear_fwd_res): y + res, into fresh poison and in place over res */
	float *res = rand_f32(NULL, Tout, 2.0f);
	for (size_t i = 0; i < Tout; i++)
		y[i] += res[i];
	for (int inplace = 0; inplace < 2; inplace++) {
		void *dres = up(res, 4 * Tout), *dout = inplace ? dres : poisoned(4 * Tout);
		assert_int_equal(opsc_linear_fwd_res(gpu, L->T, L->in, L->out, L->dx_, L->dw_, lr, dres, dout, ws), 0);
		down(yg, dout, 4 * Tout);
		check(inplace ? "linear fwd y + res, in place" : "linear fwd y + res", err_f32(yg, y, Tout, 0), TOL_BF16);
		tier_dev_free(gpu, dres);
		if (!inplace)
			tier_dev_free(gpu, dout);
	}
	free(res), free(y), free(ylora), free(xa), free(yg);
	tier_dev_free(gpu, dy);
}

/* got (accumulated onto init) against init + grad, relative to the gradient alone. */
static void check_acc(const char *what, const void *dev, const float *init, const double *grad, size_t n)
{
	float *g = malloc(4 * n);
	double *tot = malloc(8 * n);
	down(g, dev, 4 * n);
	for (size_t i = 0; i < n; i++)
		tot[i] = (init ? init[i] : 0) + grad[i];
	check(what, err_f32(g, tot, n, max_abs(grad, n)), TOL_BF16);
	free(g), free(tot);
}

/* trainable: the adapter gets da, db (accumulated onto random contents); else it is frozen. */
static void lin_bwd(const lin *L, tier_lora_ref *lr, int trainable, int accumulate, int want_dx, void *ws)
{
	int T = L->T, in = L->in, out = L->out, r = L->r;
	size_t nx = (size_t)T * in, na = (size_t)r * in, nb = (size_t)out * r;
	double *dx = calloc(nx, 8), *da = calloc(na, 8), *db = calloc(nb, 8), *xa = calloc((size_t)T * r, 8);
	double *dxa = calloc((size_t)T * r, 8);
	float *dx0 = rand_f32(NULL, nx, 1.0f), *da0 = rand_f32(NULL, na, 0.1f), *db0 = rand_f32(NULL, nb, 0.1f);
	void *ddx = !want_dx ? NULL : accumulate ? up(dx0, 4 * nx) : poisoned(4 * nx);
	void *dda = up(da0, 4 * na), *ddb = up(db0, 4 * nb);
	ref_mm(T, in, out, 1, L->dy, 0, L->w, 0, dx);                       /* dy W */
	if (lr) {
		ref_mm(T, r, in, 1, L->x, 0, L->a, 1, xa);                  /* x A^T */
		ref_mm(out, r, T, L->scale, L->dy, 1, xa, 0, db);           /* scale dy^T xa */
		ref_mm(T, r, out, L->scale, L->dy, 0, L->b, 0, dxa);        /* scale dy B */
		ref_mm(r, in, T, 1, dxa, 1, L->x, 0, da);                   /* dxa^T x */
		ref_mm(T, in, r, 1, dxa, 0, L->a, 0, dx);                   /* dx += dxa A */
		lr->da = trainable ? dda : NULL, lr->db = trainable ? ddb : NULL;
	}
	if (lr && lr->dropout > 0)                                          /* all three rewritten */
		cpu_bwd(L, lr, want_dx ? dx : NULL, trainable ? da : NULL, trainable ? db : NULL);
	assert_int_equal(opsc_linear_bwd(gpu, T, in, out, L->dx_, L->dw_, lr, L->ddy, ddx, accumulate, ws), 0);
	if (want_dx)
		check_acc(accumulate ? "linear bwd dx (accumulated)" : "linear bwd dx", ddx, accumulate ? dx0 : NULL, dx, nx);
	if (lr && lr->da)
		check_acc("linear bwd da (accumulated)", dda, da0, da, na);
	if (lr && lr->db)
		check_acc("linear bwd db (accumulated)", ddb, db0, db, nb);
	free(dx), free(da), free(db), free(xa), free(dxa), free(dx0), free(da0), free(db0);
	if (ddx)
		tier_dev_free(gpu, ddx);
	tier_dev_free(gpu, dda), tier_dev_free(gpu, ddb);
}

/* The case's adapter in *ref (NULL without one); p > 0: LoRA dropout with a fresh random mask key
 * (its high bits set, as the trainer's are). */
static tier_lora_ref *lin_lora(const lin *L, int mode, float p, tier_lora_ref *ref)
{
	memset(ref, 0, sizeof *ref);
	if (mode == NO_LORA)
		return NULL;
	ref->a = (const float *)L->da_, ref->b = (const float *)L->db_, ref->rank = L->r, ref->scale = (float)L->scale;
	ref->dropout = p, ref->mask_key = tier_rng_next(&rng) | 1ull << 63;
	return ref;
}

static void linear_case(int mode, float p, int accumulate, int want_dx)
{
	lin L = { .T = 37, .in = 91, .out = 53, .r = 5, .scale = 2.0 };
	tier_lora_ref ref, *lr;
	lin_init(&L);
	lr = lin_lora(&L, mode, p, &ref);
	print_message("linear T=%d in=%d out=%d %s dropout %.2g accumulate %d dx %d\n", L.T, L.in, L.out,
		      mode == NO_LORA ? "no LoRA" : mode == LORA ? "LoRA r=5" : "frozen LoRA r=5", p, accumulate, want_dx);
	size_t wsb = opsc_linear_ws_bytes(L.T, L.in, L.out, lr ? L.r : 0, p);
	void *ws = poisoned(wsb);
	lin_fwd(&L, lr, ws);
	tier_dev_free(gpu, ws);
	ws = poisoned(wsb); /* the backward remakes what it needs (the masked x): none of the forward's */
	lin_bwd(&L, lr, mode == LORA, accumulate, want_dx, ws);
	tier_dev_free(gpu, ws);
	lin_free(&L);
}

/* Whether $TIER_LORA_FIRST asks for the adapter's part first, as ops_cuda.cu reads it (unset: its
 * default, 1 since session 23; the cases below always set it). */
static int first_on(void)
{
	const char *v = getenv("TIER_LORA_FIRST");
	return v && *v ? strcmp(v, "0") != 0 : 1;
}

/* Each linear case under both orders of $TIER_LORA_FIRST (ops_cuda.cu), the caller's setting put
 * back after. */
static void both_orders(void (*cases)(void))
{
	env_keep k;
	env_save(&k, "TIER_LORA_FIRST");
	for (int first = 1; first >= 0; first--) {
		env_put("TIER_LORA_FIRST", first ? "1" : "0");
		print_message("TIER_LORA_FIRST=%d\n", first);
		cases();
	}
	env_back(&k);
}

static void linear_cases(void)
{
	linear_case(NO_LORA, 0, 0, 1);
	linear_case(NO_LORA, 0, 1, 1);
	linear_case(LORA, 0, 0, 1);
	linear_case(LORA, 0, 1, 1);
	linear_case(LORA_FROZEN, 0, 0, 1);
	linear_case(LORA_FROZEN, 0, 1, 1);
	linear_case(LORA, 0, 0, 0);
}

static void test_linear(void **state)
{
	(void)state;
	both_orders(linear_cases);
}

/* opsc_linear_bwd_bf16 from dy in bf16 (the case's dy is exact in bf16) gives opsc_linear_bwd's
 * dx, da and db bit for bit: the same products after the conversion the latter makes. */
static void linear_bf16_case(int mode, float p, int accumulate)
{
	lin L = { .T = 37, .in = 91, .out = 53, .r = 5, .scale = 2.0 };
	tier_lora_ref ref, *lr;
	lin_init(&L);
	lr = lin_lora(&L, mode, p, &ref);
	size_t nx = (size_t)L.T * L.in, na = (size_t)L.r * L.in, nb = (size_t)L.out * L.r, ny = (size_t)L.T * L.out;
	size_t wsb = opsc_linear_ws_bytes(L.T, L.in, L.out, lr ? L.r : 0, p);
	float *dx0 = rand_f32(NULL, nx, 1.0f), *da0 = rand_f32(NULL, na, 0.1f), *db0 = rand_f32(NULL, nb, 0.1f);
	float *got[2][3];
	for (int v = 0; v < 2; v++) {
		void *ddx = up(dx0, 4 * nx), *dda = up(da0, 4 * na), *ddb = up(db0, 4 * nb), *ws = poisoned(wsb);
		void *dy16 = poisoned(2 * ny);
		if (lr)
			lr->da = mode == LORA ? dda : NULL, lr->db = mode == LORA ? ddb : NULL;
		if (!v) {
			assert_int_equal(opsc_linear_bwd(gpu, L.T, L.in, L.out, L.dx_, L.dw_, lr, L.ddy, ddx, accumulate, ws), 0);
		} else {
			assert_int_equal(opsc_to_bf16(gpu, ny, L.ddy, dy16), 0);
			assert_int_equal(opsc_linear_bwd_bf16(gpu, L.T, L.in, L.out, L.dx_, L.dw_, lr, dy16, ddx, accumulate, ws),
					 0);
		}
		got[v][0] = malloc(4 * nx), got[v][1] = malloc(4 * na), got[v][2] = malloc(4 * nb);
		down(got[v][0], ddx, 4 * nx), down(got[v][1], dda, 4 * na), down(got[v][2], ddb, 4 * nb);
		tier_dev_free(gpu, ddx), tier_dev_free(gpu, dda), tier_dev_free(gpu, ddb), tier_dev_free(gpu, ws);
		tier_dev_free(gpu, dy16);
	}
	print_message("linear bwd from bf16 dy: mode %d dropout %.2g accumulate %d: equal\n", mode, p, accumulate);
	assert_memory_equal(got[0][0], got[1][0], 4 * nx);
	assert_memory_equal(got[0][1], got[1][1], 4 * na);
	assert_memory_equal(got[0][2], got[1][2], 4 * nb);
	for (int v = 0; v < 2; v++)
		free(got[v][0]), free(got[v][1]), free(got[v][2]);
	free(dx0), free(da0), free(db0);
	lin_free(&L);
}

static void test_linear_bwd_bf16(void **state)
{
	(void)state;
	linear_bf16_case(NO_LORA, 0, 0);
	linear_bf16_case(LORA, 0, 1);
	linear_bf16_case(LORA_FROZEN, 0, 0);
	linear_bf16_case(LORA, 0.3f, 0);
	assert_int_equal(opsc_linear_bwd_bf16(gpu, 3, 4, 5, L_NONNULL, L_NONNULL, NULL, NULL, L_NONNULL, 0, NULL), -EINVAL);
}

/* opsc_linear_bwd_to16: dx in bf16 straight from the products against the fp64 reference (the
 * adapter's part large enough that leaving it out fails), and da, db bit for bit opsc_linear_bwd's
 * (the same products). With dropout the fp32 path through dx32, against the CPU layer. */
static void linear_to16_case(int mode, float p)
{
	lin L = { .T = 37, .in = 91, .out = 53, .r = 5, .scale = 2.0 };
	tier_lora_ref ref, *lr;
	lin_init(&L);
	lr = lin_lora(&L, mode, p, &ref);
	int T = L.T, in = L.in, out = L.out, r = L.r;
	size_t nx = (size_t)T * in, na = (size_t)r * in, nb = (size_t)out * r;
	size_t wsb = opsc_linear_ws_bytes(T, in, out, lr ? r : 0, p);
	double *dx = calloc(nx, 8), *dxl = calloc(nx, 8), *dxa = calloc((size_t)T * r, 8);
	float *da0 = rand_f32(NULL, na, 0.1f), *db0 = rand_f32(NULL, nb, 0.1f), *got[2][2];
	uint16_t *dx16 = malloc(2 * nx);
	ref_mm(T, in, out, 1, L.dy, 0, L.w, 0, dx); /* dy W */
	if (lr) {
		ref_mm(T, r, out, L.scale, L.dy, 0, L.b, 0, dxa); /* scale dy B */
		ref_mm(T, in, r, 1, dxa, 0, L.a, 0, dxl);         /* dxa A */
		assert_true(max_abs(dxl, nx) > 0.1 * max_abs(dx, nx));
		for (size_t i = 0; i < nx; i++)
			dx[i] += dxl[i];
	}
	if (lr && p > 0)
		cpu_bwd(&L, lr, dx, NULL, NULL);
	for (int v = 0; v < 2; v++) {
		void *dda = up(da0, 4 * na), *ddb = up(db0, 4 * nb), *ws = poisoned(wsb), *ddx = poisoned(4 * nx);
		void *d16 = poisoned(2 * nx);
		if (lr)
			lr->da = mode == LORA ? dda : NULL, lr->db = mode == LORA ? ddb : NULL;
		if (!v)
			assert_int_equal(opsc_linear_bwd(gpu, T, in, out, L.dx_, L.dw_, lr, L.ddy, ddx, 0, ws), 0);
		else
			/* dx32 is needed only with dropout or the main product first (TIER_LORA_FIRST=0) */
			assert_int_equal(opsc_linear_bwd_to16(gpu, T, in, out, L.dx_, L.dw_, lr, L.ddy, d16,
							      first_on() && !(p > 0) ? NULL : ddx, ws),
					 0);
		got[v][0] = malloc(4 * na), got[v][1] = malloc(4 * nb);
		down(got[v][0], dda, 4 * na), down(got[v][1], ddb, 4 * nb);
		if (v)
			down(dx16, d16, 2 * nx);
		tier_dev_free(gpu, dda), tier_dev_free(gpu, ddb), tier_dev_free(gpu, ws), tier_dev_free(gpu, ddx);
		tier_dev_free(gpu, d16);
	}
	print_message("linear bwd to bf16 dx: mode %d dropout %.2g\n", mode, p);
	check("linear bwd dx (bf16)", err_bf16(dx16, dx, nx), TOL_BF16);
	assert_memory_equal(got[0][0], got[1][0], 4 * na);
	assert_memory_equal(got[0][1], got[1][1], 4 * nb);
	for (int v = 0; v < 2; v++)
		free(got[v][0]), free(got[v][1]);
	free(dx), free(dxl), free(dxa), free(da0), free(db0), free(dx16);
	lin_free(&L);
}

static void to16_cases(void)
{
	linear_to16_case(NO_LORA, 0);
	linear_to16_case(LORA, 0);
	linear_to16_case(LORA_FROZEN, 0);
	linear_to16_case(LORA, 0.3f);
}

static void test_linear_bwd_to16(void **state)
{
	(void)state;
	both_orders(to16_cases);
	/* no dx16; dropout without the fp32 scratch, with the adapter's part first (where dx32 is
	 * otherwise not needed) */
	tier_lora_ref drop = { .a = L_NONNULL, .b = L_NONNULL, .rank = 4, .scale = 1.0f, .dropout = 0.3f };
	env_keep k;
	env_set(&k, "TIER_LORA_FIRST", "1");
	tier_clear_error();
	assert_int_equal(opsc_linear_bwd_to16(gpu, 3, 4, 5, L_NONNULL, L_NONNULL, NULL, L_NONNULL, NULL, NULL, L_NONNULL),
			 -EINVAL);
	assert_non_null(strstr(tier_last_error(), "dx16"));
	assert_int_equal(opsc_linear_bwd_to16(gpu, 3, 4, 5, L_NONNULL, L_NONNULL, &drop, L_NONNULL, L_NONNULL, NULL,
					      L_NONNULL),
			 -EINVAL);
	assert_non_null(strstr(tier_last_error(), "dx32"));
	env_back(&k);
}

static void dropout_cases(void)
{
	linear_case(LORA, 0.3f, 0, 1);
	linear_case(LORA, 0.3f, 1, 1);
	linear_case(LORA_FROZEN, 0.3f, 0, 1);
	linear_case(LORA_FROZEN, 0.3f, 1, 1);
	linear_case(LORA, 0.3f, 0, 0);
}

/* The same cases with dropout 0.3; the workspace grows by one 4 T in piece, only with an adapter. */
static void test_linear_dropout(void **state)
{
	(void)state;
	assert_int_equal(opsc_linear_ws_bytes(37, 91, 53, 5, 0.3f) - opsc_linear_ws_bytes(37, 91, 53, 5, 0),
			 (4 * 37 * 91 + 255) / 256 * 256);
	assert_int_equal(opsc_linear_ws_bytes(37, 91, 53, 0, 0.3f), opsc_linear_ws_bytes(37, 91, 53, 0, 0));
	both_orders(dropout_cases);
}

/* ---- Row and elementwise kernels ------------------------------------------------------------- */

static void rmsnorm_case(int rows, int dim)
{
	size_t n = (size_t)rows * dim;
	double *x = malloc(8 * n), *w = malloc(8 * dim), *dy = malloc(8 * n), *y = malloc(8 * n), *dx = malloc(8 * n);
	double *r = malloc(8 * rows);
	float *xf = rand_f32(x, n, 3.0f), *dyf = rand_f32(dy, n, 1.0f), *rg = malloc(4 * rows), *dxg = malloc(4 * n);
	uint16_t *wb = rand_bf16(w, dim, 0.1f, 1.0f), *yg = malloc(2 * n);
	const float eps = 1e-6f;
	for (int i = 0; i < rows; i++) {
		const double *xr = x + (size_t)i * dim, *dyr = dy + (size_t)i * dim;
		double ss = 0, s = 0;
		for (int j = 0; j < dim; j++)
			ss += xr[j] * xr[j], s += w[j] * dyr[j] * xr[j];
		r[i] = 1 / sqrt(ss / dim + eps);
		for (int j = 0; j < dim; j++) {
			y[(size_t)i * dim + j] = xr[j] * r[i] * w[j];
			dx[(size_t)i * dim + j] = r[i] * w[j] * dyr[j] - xr[j] * r[i] * r[i] * r[i] / dim * s;
		}
	}
	void *dX = up(xf, 4 * n), *dW = up(wb, 2 * dim), *dY = poisoned(2 * n), *dR = poisoned(4 * rows);
	void *dDY = up(dyf, 4 * n), *dDX = poisoned(4 * n);
	assert_int_equal(opsc_rmsnorm_fwd(gpu, rows, dim, eps, dX, dW, dY, dR), 0);
	assert_int_equal(opsc_rmsnorm_bwd(gpu, rows, dim, dX, dW, dR, dDY, dDX), 0);
	down(yg, dY, 2 * n), down(rg, dR, 4 * rows), down(dxg, dDX, 4 * n);
	print_message("rmsnorm rows=%d dim=%d\n", rows, dim);
	check("rmsnorm fwd y (bf16)", err_bf16(yg, y, n), TOL_BF16);
	check("rmsnorm fwd rstd", err_f32(rg, r, rows, 0), TOL_F32);
	check("rmsnorm bwd dx", err_f32(dxg, dx, n, 0), TOL_F32);
	/* with a residual's gradient added: into a fresh buffer, then onto the residual itself */
	double *res = malloc(8 * n);
	float *resf = rand_f32(res, n, 1.0f);
	for (size_t i = 0; i < n; i++)
		res[i] += dx[i];
	void *dRes = up(resf, 4 * n), *dOut = poisoned(4 * n);
	assert_int_equal(opsc_rmsnorm_bwd_add(gpu, rows, dim, dX, dW, dR, dDY, dRes, dOut), 0);
	down(dxg, dOut, 4 * n);
	check("rmsnorm bwd + residual", err_f32(dxg, res, n, 0), TOL_F32);
	assert_int_equal(opsc_rmsnorm_bwd_add(gpu, rows, dim, dX, dW, dR, dDY, dRes, dRes), 0);
	down(dxg, dRes, 4 * n);
	check("rmsnorm bwd + residual, in place", err_f32(dxg, res, n, 0), TOL_F32);
	tier_dev_free(gpu, dRes), tier_dev_free(gpu, dOut), free(res), free(resf);
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dW), tier_dev_free(gpu, dY), tier_dev_free(gpu, dR);
	tier_dev_free(gpu, dDY), tier_dev_free(gpu, dDX);
	free(x), free(w), free(dy), free(y), free(dx), free(r), free(xf), free(dyf), free(rg), free(dxg), free(wb), free(yg);
}

static void test_rmsnorm(void **state)
{
	(void)state;
	rmsnorm_case(29, 77);   /* one block a row (dim % 4 != 0) */
	rmsnorm_case(5, 1537);
	rmsnorm_case(333, 128); /* one warp a row: a q/k head, the rows not a multiple of the block's 8 */
	rmsnorm_case(67, 2048); /* a hidden state: a block a row, the row in registers */
	rmsnorm_case(41, 1028); /* the same with a partial last float4 pass (2 a thread) */
	rmsnorm_case(6, 3072);  /* 6 float4 a thread, in the 8-wide kernel */
	rmsnorm_case(7, 516);   /* 129 float4: the register kernel's smallest */
	rmsnorm_case(9, 4100);  /* a partial last pass of the warp */
	rmsnorm_case(3, 4);
}

/* bf16 bit patterns a and b against each other in units in the last place: every element within one
 * ulp, and at most 1% of them differing at all. A fused kernel that rounds where the separate steps
 * round differs from them only where a sum's order moved a value across a rounding boundary; one
 * that skips or adds a rounding differs by an ulp in a large share of elements. One exception: a
 * value that cancels to near zero can move by many of its own ulps, or change sign, when a sum's
 * order moves its terms; it passes when within 2^near of the largest |b|. The norm's backward
 * subtracts two terms of the row's scale, moved by an fp32 rounding: near -13 (a thirty-second of a
 * bf16 ulp there). RoPE after the forward's norm takes differences of bf16 values, one of which a
 * row sum's order may have rounded the other way: a bf16 ulp of an input, up to 2^-7 of the largest
 * output (seen: 2 of 630,784 elements 30,307 ulps apart on an H100, test_qk_fwd); near -6. */
static int bf16_ord(uint16_t v) { return v & 0x8000 ? -(int)(v & 0x7fff) : (int)v; }

static void check_ulps(const char *what, const uint16_t *a, const uint16_t *b, size_t n, int near)
{
	size_t diff = 0, near0 = 0;
	int worst = 0;
	float big = 0;
	for (size_t i = 0; i < n; i++)
		big = fmaxf(big, fabsf(tier_bf16_to_f32(b[i])));
	for (size_t i = 0; i < n; i++) {
		int d = abs(bf16_ord(a[i]) - bf16_ord(b[i]));
		diff += d != 0;
		if (d > 1 && fabsf(tier_bf16_to_f32(a[i]) - tier_bf16_to_f32(b[i])) <= ldexpf(big, near))
			near0++, d = 1;
		worst = d > worst ? d : worst;
	}
	print_message("  %-34s %zu of %zu differ, by at most %d ulp (%zu more near zero)\n", what, diff, n, worst,
		      near0);
	assert_true(worst <= 1 && diff * 100 <= n);
}

/* opsc_qk_grad against fp64: dq taken back through RoPE (positions t % seq, the host's inverse
 * frequencies), then the norm's backward with the forward's rstd (or none), rounded to bf16; and
 * against the separate CUDA steps it replaces (tier_attn_rope_bwd, opsc_rmsnorm_bwd, opsc_to_bf16),
 * which differ from it only in the order of a row's sum. dq must come back unchanged. */
static void qk_grad_case(int tokens, int seq, int heads, int hd, int with_norm)
{
	size_t rows = (size_t)tokens * heads, n = rows * hd;
	int half = hd / 2;
	double *x = malloc(8 * n), *dq = malloc(8 * n), *w = malloc(8 * hd), *ref = malloc(8 * n), *d = malloc(8 * hd);
	float *xf = rand_f32(x, n, 2.0f), *dqf = rand_f32(dq, n, 1.0f), *rg = malloc(4 * rows), *back = malloc(4 * n);
	uint16_t *wb = rand_bf16(w, hd, 0.1f, 1.0f), *got = malloc(2 * n), *sep = malloc(2 * n);
	void *dX = up(xf, 4 * n), *dW = up(wb, 2 * hd), *dR = poisoned(4 * rows), *dY = poisoned(2 * n);
	void *dDQ = up(dqf, 4 * n), *dOut = poisoned(2 * n), *dCopy = up(dqf, 4 * n), *dTmp = poisoned(4 * n);
	void *dSep = poisoned(2 * n);
	tier_rope_params rp = { .tokens = tokens, .seq = seq, .n_heads = heads, .head_dim = hd, .theta = 1e6f };
	assert_int_equal(opsc_rmsnorm_fwd(gpu, (int)rows, hd, 1e-6f, dX, dW, dY, dR), 0);
	assert_int_equal(opsc_qk_grad(gpu, &rp, dDQ, dX, with_norm ? dW : NULL, dR, dOut), 0);
	/* the separate steps */
	assert_int_equal(tier_attn_rope_bwd(gpu, &rp, NULL, dCopy), 0);
	if (with_norm)
		assert_int_equal(opsc_rmsnorm_bwd(gpu, (int)rows, hd, dX, dW, dR, dCopy, dTmp), 0);
	assert_int_equal(opsc_to_bf16(gpu, n, with_norm ? dTmp : dCopy, dSep), 0);
	down(got, dOut, 2 * n), down(rg, dR, 4 * rows), down(back, dDQ, 4 * n), down(sep, dSep, 2 * n);
	assert_memory_equal(back, dqf, 4 * n);
	for (size_t row = 0; row < rows; row++) {
		const double pos = (double)(int)((row / heads) % seq), *xr = x + row * hd, *g = dq + row * hd;
		for (int i = 0; i < half; i++) { /* the inverse rotation */
			float inv = 1.0f / powf(1e6f, (float)(2 * i) / (float)hd);
			double c = cos(pos * inv), sn = sin(pos * inv);
			d[i] = g[i] * c + g[i + half] * sn;
			d[i + half] = g[i + half] * c - g[i] * sn;
		}
		double s = 0, r = rg[row];
		for (int j = 0; j < hd; j++)
			s += w[j] * d[j] * xr[j];
		for (int j = 0; j < hd; j++)
			ref[row * hd + j] = with_norm ? r * w[j] * d[j] - xr[j] * r * r * r / hd * s : d[j];
	}
	print_message("qk grad tokens=%d seq=%d heads=%d head_dim=%d %s\n", tokens, seq, heads, hd,
		      with_norm ? "with norm" : "no norm");
	check("qk grad (bf16) against fp64", err_bf16(got, ref, n), TOL_BF16);
	check_ulps("qk grad against the separate steps", got, sep, n, -13);
	void *dp[] = { dX, dW, dR, dY, dDQ, dOut, dCopy, dTmp, dSep };
	for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
		tier_dev_free(gpu, dp[i]);
	free(x), free(dq), free(w), free(ref), free(d), free(xf), free(dqf), free(rg), free(back), free(wb), free(got);
	free(sep);
}

/* opsc_qk_fwd against fp64 (the norm, rounded to bf16 as the separate norm rounds, then RoPE) and
 * against the separate CUDA steps it replaces (opsc_rmsnorm_fwd or opsc_to_bf16, then
 * tier_attn_rope_fwd); its rstd against opsc_rmsnorm_fwd's. */
static void qk_fwd_case(int tokens, int seq, int heads, int hd, int with_norm)
{
	size_t rows = (size_t)tokens * heads, n = rows * hd;
	int half = hd / 2;
	double *x = malloc(8 * n), *w = malloc(8 * hd), *ref = malloc(8 * n);
	float *xf = rand_f32(x, n, 2.0f), *rg = malloc(4 * rows), *rs = malloc(4 * rows);
	uint16_t *wb = rand_bf16(w, hd, 0.1f, 1.0f), *got = malloc(2 * n), *sep = malloc(2 * n);
	void *dX = up(xf, 4 * n), *dW = up(wb, 2 * hd), *dR = poisoned(4 * rows), *dRs = poisoned(4 * rows);
	void *dOut = poisoned(2 * n), *dSep = poisoned(2 * n);
	tier_rope_params rp = { .tokens = tokens, .seq = seq, .n_heads = heads, .head_dim = hd, .theta = 1e6f };
	assert_int_equal(opsc_qk_fwd(gpu, &rp, dX, with_norm ? dW : NULL, 1e-6f, dOut, dR), 0);
	if (with_norm)
		assert_int_equal(opsc_rmsnorm_fwd(gpu, (int)rows, hd, 1e-6f, dX, dW, dSep, dRs), 0);
	else
		assert_int_equal(opsc_to_bf16(gpu, n, dX, dSep), 0);
	assert_int_equal(tier_attn_rope_fwd(gpu, &rp, NULL, dSep), 0);
	down(got, dOut, 2 * n), down(sep, dSep, 2 * n);
	if (with_norm)
		down(rg, dR, 4 * rows), down(rs, dRs, 4 * rows);
	for (size_t row = 0; row < rows; row++) {
		const double pos = (double)(int)((row / heads) % seq), *xr = x + row * hd;
		double ss = 0, y[512];
		for (int j = 0; j < hd; j++)
			ss += xr[j] * xr[j];
		double r = 1 / sqrt(ss / hd + 1e-6);
		for (int j = 0; j < hd; j++)
			y[j] = tier_bf16_to_f32(tier_f32_to_bf16((float)(with_norm ? xr[j] * r * w[j] : xr[j])));
		for (int i = 0; i < half; i++) {
			float inv = 1.0f / powf(1e6f, (float)(2 * i) / (float)hd);
			double c = cos(pos * inv), sn = sin(pos * inv);
			ref[row * hd + i] = y[i] * c - y[i + half] * sn;
			ref[row * hd + i + half] = y[i + half] * c + y[i] * sn;
		}
	}
	print_message("qk fwd tokens=%d seq=%d heads=%d head_dim=%d %s\n", tokens, seq, heads, hd,
		      with_norm ? "with norm" : "no norm");
	check("qk fwd (bf16) against fp64", err_bf16(got, ref, n), TOL_BF16);
	check_ulps("qk fwd against the separate steps", got, sep, n, -6);
	if (with_norm) {
		double *rsd = malloc(8 * rows);
		for (size_t i = 0; i < rows; i++)
			rsd[i] = rs[i];
		check("qk fwd rstd against the norm's", err_f32(rg, rsd, rows, 0), TOL_F32);
		free(rsd);
	}
	void *dp[] = { dX, dW, dR, dRs, dOut, dSep };
	for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
		tier_dev_free(gpu, dp[i]);
	free(x), free(w), free(ref), free(xf), free(rg), free(rs), free(wb), free(got), free(sep);
}

/* The q/k gradient's shapes (test_qk_grad). */
static const struct { int tokens, seq, heads, hd, norm; } qk_shapes[] = {
	{ 2 * 77, 77, 32, 128, 1 }, /* Qwen3's q heads: 2 sequences of 77 */
	{ 37, 37, 4, 128, 1 },      /* k heads */
	{ 50, 25, 3, 64, 1 },
	{ 9, 9, 5, 8, 1 },          /* half below a warp */
	{ 11, 11, 2, 256, 1 },      /* the largest head_dim */
	{ 40, 20, 8, 128, 0 },      /* Mixtral: RoPE alone */
};
#define QK_SHAPES (sizeof qk_shapes / sizeof qk_shapes[0])

static void test_qk_fwd(void **state)
{
	(void)state;
	qk_fwd_case(2 * 77, 77, 32, 128, 1);
	qk_fwd_case(37, 37, 4, 128, 1);
	qk_fwd_case(9, 9, 5, 8, 1);
	qk_fwd_case(11, 11, 2, 256, 1);
	qk_fwd_case(40, 20, 8, 128, 0);
	tier_rope_params bad = { .tokens = 4, .seq = 4, .n_heads = 1, .head_dim = 7, .theta = 1e4f };
	assert_int_equal(opsc_qk_fwd(gpu, &bad, L_NONNULL, NULL, 1e-6f, L_NONNULL, NULL), -EINVAL);
}

static void test_qk_grad(void **state)
{
	(void)state;
	for (size_t i = 0; i < QK_SHAPES; i++)
		qk_grad_case(qk_shapes[i].tokens, qk_shapes[i].seq, qk_shapes[i].heads, qk_shapes[i].hd, qk_shapes[i].norm);
	tier_rope_params bad = { .tokens = 4, .seq = 4, .n_heads = 1, .head_dim = 512, .theta = 1e4f };
	assert_int_equal(opsc_qk_grad(gpu, &bad, L_NONNULL, L_NONNULL, NULL, NULL, L_NONNULL), -EINVAL);
	assert_int_equal(opsc_qk_grad(cpu, &bad, L_NONNULL, L_NONNULL, NULL, NULL, L_NONNULL), -EINVAL);
}

/* opsc_qk_fwd16 and opsc_qk_grad16_ld from a bf16 projection: the bits of opsc_qk_fwd and
 * opsc_qk_grad_ld from the same values in fp32 (the fp64 checks above hold for those), out's gaps
 * at stride ld untouched. */
static void qk16_case(int tokens, int seq, int heads, int hd, int with_norm, int pad)
{
	size_t rows = (size_t)tokens * heads, n = rows * hd, ld = (size_t)heads * hd + pad, nw = (size_t)tokens * ld;
	double *x = malloc(8 * n), *w = malloc(8 * hd);
	uint16_t *xb = rand_bf16(x, n, 2.0f, 0.0f), *wb = rand_bf16(w, hd, 0.1f, 1.0f);
	float *xf = malloc(4 * n), *dqf = rand_f32(NULL, n, 1.0f), *r32 = malloc(4 * rows), *r16 = malloc(4 * rows);
	for (size_t i = 0; i < n; i++)
		xf[i] = (float)x[i];
	uint16_t *o32 = malloc(2 * nw), *o16 = malloc(2 * nw);
	void *dXf = up(xf, 4 * n), *dXb = up(xb, 2 * n), *dW = up(wb, 2 * hd), *dDQ = up(dqf, 4 * n);
	void *dR32 = poisoned(4 * rows), *dR16 = poisoned(4 * rows), *dO32 = poisoned(2 * nw), *dO16 = poisoned(2 * nw);
	const void *wn = with_norm ? dW : NULL;
	tier_rope_params rp = { .tokens = tokens, .seq = seq, .n_heads = heads, .head_dim = hd, .theta = 1e6f };
	assert_int_equal(opsc_qk_fwd(gpu, &rp, dXf, wn, 1e-6f, dO32, dR32), 0);
	assert_int_equal(opsc_qk_fwd16(gpu, &rp, dXb, wn, 1e-6f, dO16, dR16), 0);
	down(o32, dO32, 2 * n), down(o16, dO16, 2 * n), down(r32, dR32, 4 * rows), down(r16, dR16, 4 * rows);
	assert_memory_equal(o16, o32, 2 * n);
	if (with_norm)
		assert_memory_equal(r16, r32, 4 * rows);
	tier_dev_free(gpu, dO32), tier_dev_free(gpu, dO16);
	dO32 = poisoned(2 * nw), dO16 = poisoned(2 * nw);
	assert_int_equal(opsc_qk_grad_ld(gpu, &rp, dDQ, dXf, wn, dR32, dO32, (int64_t)ld), 0);
	assert_int_equal(opsc_qk_grad16_ld(gpu, &rp, dDQ, dXb, wn, dR32, dO16, (int64_t)ld), 0);
	down(o32, dO32, 2 * nw), down(o16, dO16, 2 * nw);
	assert_memory_equal(o16, o32, 2 * nw);
	for (int t = 0; t < tokens; t++)
		for (size_t c = (size_t)heads * hd; c < ld; c++)
			assert_int_equal(o16[t * ld + c], 0xffff);
	print_message("qk fwd16 and grad16 tokens=%d heads=%d head_dim=%d %s, stride %zu: the fp32 entries' bits\n", tokens,
		      heads, hd, with_norm ? "with norm" : "no norm", ld);
	void *dp[] = { dXf, dXb, dW, dDQ, dR32, dR16, dO32, dO16 };
	for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
		tier_dev_free(gpu, dp[i]);
	free(x), free(w), free(xb), free(wb), free(xf), free(dqf), free(r32), free(r16), free(o32), free(o16);
}

static void test_qk16(void **state)
{
	(void)state;
	for (size_t i = 0; i < QK_SHAPES; i++)
		qk16_case(qk_shapes[i].tokens, qk_shapes[i].seq, qk_shapes[i].heads, qk_shapes[i].hd, qk_shapes[i].norm,
			  (int)(i % 3) * 5);
	tier_rope_params bad = { .tokens = 4, .seq = 4, .n_heads = 1, .head_dim = 7, .theta = 1e4f };
	assert_int_equal(opsc_qk_fwd16(gpu, &bad, L_NONNULL, NULL, 1e-6f, L_NONNULL, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_qk_fwd16"));
	tier_rope_params ok = { .tokens = 4, .seq = 4, .n_heads = 2, .head_dim = 8, .theta = 1e4f };
	assert_int_equal(opsc_qk_grad16_ld(gpu, &ok, L_NONNULL, L_NONNULL, NULL, NULL, L_NONNULL, 15), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_qk_grad16: out's row stride 15"));
	assert_int_equal(opsc_qk_grad16_ld(cpu, &ok, L_NONNULL, L_NONNULL, NULL, NULL, L_NONNULL, 16), -EINVAL);
}

/* ---- Projections of one input in one backward product (opsc_linear_bwd_cat) ------------------ */

/* opsc_linear_fwd_cat's outputs (poisoned first) against the fp64 forward yref[j] [T, out_j]. */
static void cat_fwd_check(int T, int in, const void *dX, int n, const opsc_lin_seg *s, double *const *yref)
{
	float *y[OPSC_CAT_MAX];
	void *ws = poisoned(opsc_linear_cat_fwd_ws_bytes(T, in, n, s));
	for (int j = 0; j < n; j++)
		y[j] = poisoned(4 * (size_t)T * s[j].out);
	assert_int_equal(opsc_linear_fwd_cat(gpu, T, in, dX, n, s, y, ws), 0);
	for (int j = 0; j < n; j++) {
		size_t ny = (size_t)T * s[j].out;
		float *g = malloc(4 * ny);
		down(g, y[j], 4 * ny);
		check("cat fwd y", err_f32(g, yref[j], ny, 0), TOL_BF16);
		free(g), free(yref[j]);
		tier_dev_free(gpu, y[j]);
	}
	tier_dev_free(gpu, ws);
}

/* Three segments (outputs 37, 11, 11; the first with an adapter of rank 5, the second with a frozen
 * one, the third none; or each with one): dy's segments in one bf16 buffer of padded row stride
 * whose adapter columns and padding start as NaN; dx, da, db against fp64 (the dy B products
 * rounded to bf16 as the function rounds them), the padding untouched. */
static void cat_case(int T, int in, int all_lora, int accumulate)
{
	enum { NS = 3 };
	const int outs[NS] = { 37, 11, 11 }, r = 5;
	const int mode[NS] = { LORA, all_lora ? LORA : LORA_FROZEN, all_lora ? LORA : NO_LORA };
	const double scale = 1.5;
	opsc_lin_seg s[NS];
	tier_lora_ref ref[NS];
	int cols = 0, off[NS];
	for (int j = 0; j < NS; j++)
		off[j] = cols, cols += outs[j];
	const int acols0 = cols;
	for (int j = 0; j < NS; j++)
		cols += mode[j] != NO_LORA ? r : 0;
	const int ld = cols + 3;
	size_t nx = (size_t)T * in, ndy = (size_t)T * ld;
	double *x = malloc(8 * nx), *dx = calloc(nx, 8);
	uint16_t *xb = rand_bf16(x, nx, 1.0f, 0), *dyh = malloc(2 * ndy), *dyg = malloc(2 * ndy);
	float *dx0 = rand_f32(NULL, nx, 1.0f), *dxg = malloc(4 * nx);
	memset(dyh, 0xff, 2 * ndy);
	if (accumulate)
		for (size_t i = 0; i < nx; i++)
			dx[i] = dx0[i];
	void *dX = up(xb, 2 * nx), *dev[NS][4] = { { 0 } };
	double *a[NS], *b[NS], *da[NS], *db[NS], *yref[NS];
	float *da0[NS], *db0[NS];
	for (int j = 0; j < NS; j++) {
		size_t nw = (size_t)outs[j] * in, na = (size_t)r * in, nb = (size_t)outs[j] * r, ny = (size_t)T * outs[j];
		double *w = malloc(8 * nw), *dy = malloc(8 * ny), *dxa = calloc((size_t)T * r, 8);
		uint16_t *wb = rand_bf16(w, nw, 0.1f, 0), *dyb = rand_bf16(dy, ny, 1.0f, 0);
		for (int t = 0; t < T; t++)
			memcpy(dyh + (size_t)t * ld + off[j], dyb + (size_t)t * outs[j], 2 * outs[j]);
		ref_mm(T, in, outs[j], 1, dy, 0, w, 0, dx); /* dy W */
		yref[j] = calloc(ny, 8);
		ref_mm(T, outs[j], in, 1, x, 0, w, 1, yref[j]); /* the forward's x W^T */
		s[j] = (opsc_lin_seg){ .out = outs[j], .w = dev[j][0] = up(wb, 2 * nw), .lora = NULL };
		a[j] = b[j] = da[j] = db[j] = NULL, da0[j] = db0[j] = NULL;
		if (mode[j] != NO_LORA) {
			a[j] = malloc(8 * na), b[j] = malloc(8 * nb), da[j] = calloc(na, 8), db[j] = calloc(nb, 8);
			uint16_t *ab = rand_bf16(a[j], na, 0.3f, 0), *bb = rand_bf16(b[j], nb, 0.3f, 0);
			da0[j] = rand_f32(NULL, na, 0.1f), db0[j] = rand_f32(NULL, nb, 0.1f);
			for (size_t i = 0; i < na; i++)
				da[j][i] = da0[j][i];
			for (size_t i = 0; i < nb; i++)
				db[j][i] = db0[j][i];
			ref[j] = (tier_lora_ref){ .a = dev[j][1] = up(ab, 2 * na), .b = dev[j][2] = up(bb, 2 * nb),
						  .rank = r, .scale = (float)scale };
			if (mode[j] == LORA)
				ref[j].da = up(da0[j], 4 * na), ref[j].db = dev[j][3] = up(db0[j], 4 * nb);
			s[j].lora = &ref[j];
			double *xa = calloc((size_t)T * r, 8);
			ref_mm(T, r, outs[j], scale, dy, 0, b[j], 0, dxa); /* scale dy B, rounded as the GPU rounds */
			for (size_t i = 0; i < (size_t)T * r; i++)
				dxa[i] = tier_bf16_to_f32(tier_f32_to_bf16((float)dxa[i]));
			ref_mm(T, in, r, 1, dxa, 0, a[j], 0, dx);             /* + dxa A */
			ref_mm(r, in, T, 1, dxa, 1, x, 0, da[j]);             /* da += dxa^T x */
			ref_mm(T, r, in, 1, x, 0, a[j], 1, xa);               /* xa = x A^T, in bf16 */
			for (size_t i = 0; i < (size_t)T * r; i++)
				xa[i] = tier_bf16_to_f32(tier_f32_to_bf16((float)xa[i]));
			ref_mm(outs[j], r, T, scale, dy, 1, xa, 0, db[j]); /* db += scale dy^T xa */
			ref_mm(T, outs[j], r, scale, xa, 0, b[j], 1, yref[j]); /* the forward's scale xa B^T */
			free(ab), free(bb), free(xa);
		}
		free(w), free(dy), free(dxa), free(wb), free(dyb);
	}
	assert_int_equal(opsc_linear_cat_cols(NS, s), cols);
	cat_fwd_check(T, in, dX, NS, s, yref);
	void *dDy = up(dyh, 2 * ndy), *ws = poisoned(opsc_linear_cat_ws_bytes(T, in, NS, s));
	void *dDx = accumulate ? up(dx0, 4 * nx) : poisoned(4 * nx);
	assert_int_equal(opsc_linear_bwd_cat(gpu, T, in, dX, NS, s, dDy, ld, dDx, accumulate, ws), 0);
	down(dxg, dDx, 4 * nx), down(dyg, dDy, 2 * ndy);
	print_message("linear bwd cat T=%d in=%d, adapters on %s, accumulate %d\n", T, in, all_lora ? "all" : "one of 3",
		      accumulate);
	check("cat dx", err_f32(dxg, dx, nx, 0), TOL_BF16);
	for (int t = 0; t < T; t++) { /* the segments' dy unchanged, the padding untouched */
		assert_memory_equal(dyg + (size_t)t * ld, dyh + (size_t)t * ld, 2 * acols0);
		assert_memory_equal(dyg + (size_t)t * ld + cols, dyh + (size_t)t * ld + cols, 2 * (ld - cols));
	}
	for (int j = 0; j < NS; j++) {
		if (mode[j] == LORA) {
			size_t na = (size_t)r * in, nb = (size_t)outs[j] * r;
			float *g = malloc(4 * (na > nb ? na : nb));
			down(g, ref[j].da, 4 * na);
			check("cat da", err_f32(g, da[j], na, 0), TOL_BF16);
			down(g, ref[j].db, 4 * nb);
			check("cat db", err_f32(g, db[j], nb, 0), TOL_BF16);
			free(g);
			tier_dev_free(gpu, ref[j].da);
		}
		for (int i = 0; i < 4; i++)
			if (dev[j][i])
				tier_dev_free(gpu, dev[j][i]);
		free(a[j]), free(b[j]), free(da[j]), free(db[j]), free(da0[j]), free(db0[j]);
	}
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dDy), tier_dev_free(gpu, ws), tier_dev_free(gpu, dDx);
	free(x), free(dx), free(xb), free(dyh), free(dyg), free(dx0), free(dxg);
}

/* opsc_to_bf16_rows and opsc_qk_grad_ld into a wider buffer: the same bits as opsc_to_bf16 and
 * opsc_qk_grad into a packed one, the gaps between rows untouched. */
static void rows_case(int rows, int cols, int ld, int x_off)
{
	size_t n = (size_t)rows * cols, nw = (size_t)rows * ld;
	float *x = rand_f32(NULL, n + x_off, 3.0f);
	uint16_t *packed = malloc(2 * n), *wide = malloc(2 * nw);
	void *dX = up(x, 4 * (n + x_off)), *dP = poisoned(2 * n), *dW = poisoned(2 * nw);
	assert_int_equal(opsc_to_bf16(gpu, n, (float *)dX + x_off, dP), 0);
	assert_int_equal(opsc_to_bf16_rows(gpu, rows, cols, (float *)dX + x_off, dW, ld), 0);
	down(packed, dP, 2 * n), down(wide, dW, 2 * nw);
	for (int i = 0; i < rows; i++) {
		assert_memory_equal(wide + (size_t)i * ld, packed + (size_t)i * cols, 2 * cols);
		for (int c = cols; c < ld; c++)
			assert_int_equal(wide[(size_t)i * ld + c], 0xffff);
	}
	print_message("to bf16 rows %d x %d at stride %d (x offset %d): equal\n", rows, cols, ld, x_off);
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dP), tier_dev_free(gpu, dW);
	free(x), free(packed), free(wide);
}

static void qk_ld_case(int tokens, int heads, int hd, int pad, int with_norm)
{
	size_t rows = (size_t)tokens * heads, n = rows * hd, ld = (size_t)heads * hd + pad;
	float *xf = rand_f32(NULL, n, 2.0f), *dqf = rand_f32(NULL, n, 1.0f);
	double *w = malloc(8 * hd);
	uint16_t *wb = rand_bf16(w, hd, 0.1f, 1.0f), *packed = malloc(2 * n), *wide = malloc(2 * tokens * ld);
	void *dX = up(xf, 4 * n), *dW = up(wb, 2 * hd), *dR = poisoned(4 * rows), *dY = poisoned(2 * n);
	void *dDQ = up(dqf, 4 * n), *dP = poisoned(2 * n), *dWide = poisoned(2 * tokens * ld);
	tier_rope_params rp = { .tokens = tokens, .seq = tokens, .n_heads = heads, .head_dim = hd, .theta = 1e6f };
	assert_int_equal(opsc_rmsnorm_fwd(gpu, (int)rows, hd, 1e-6f, dX, dW, dY, dR), 0);
	assert_int_equal(opsc_qk_grad(gpu, &rp, dDQ, dX, with_norm ? dW : NULL, dR, dP), 0);
	assert_int_equal(opsc_qk_grad_ld(gpu, &rp, dDQ, dX, with_norm ? dW : NULL, dR, dWide, (int64_t)ld), 0);
	down(packed, dP, 2 * n), down(wide, dWide, 2 * tokens * ld);
	for (int t = 0; t < tokens; t++) {
		assert_memory_equal(wide + t * ld, packed + (size_t)t * heads * hd, 2 * (size_t)heads * hd);
		for (size_t c = (size_t)heads * hd; c < ld; c++)
			assert_int_equal(wide[t * ld + c], 0xffff);
	}
	print_message("qk grad into stride %zu (%d heads of %d, %s): equal\n", ld, heads, hd, with_norm ? "norm" : "no norm");
	assert_int_equal(opsc_qk_grad_ld(gpu, &rp, dDQ, dX, dW, dR, dWide, (int64_t)heads * hd - 1), -EINVAL);
	void *dp[] = { dX, dW, dR, dY, dDQ, dP, dWide };
	for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++)
		tier_dev_free(gpu, dp[i]);
	free(xf), free(dqf), free(w), free(wb), free(packed), free(wide);
}

static void cat_cases(void)
{
	cat_case(37, 91, 0, 0);
	cat_case(37, 91, 1, 1);
	cat_case(300, 64, 1, 0); /* aligned sizes: the 16-byte paths */
	cat_case(1, 8, 0, 1);
}

static void test_linear_cat(void **state)
{
	(void)state;
	both_orders(cat_cases); /* the forward's order of its parts follows TIER_LORA_FIRST */
	rows_case(37, 12, 20, 0);  /* four at a time */
	rows_case(37, 11, 13, 0);  /* odd columns: one at a time */
	rows_case(5, 12, 16, 1);   /* x not 16-byte aligned */
	qk_ld_case(20, 4, 128, 8 * 128 + 16, 1);
	qk_ld_case(9, 5, 8, 3, 1);
	qk_ld_case(12, 2, 64, 64, 0);
	assert_int_equal(opsc_to_bf16_rows(gpu, 3, 5, L_NONNULL, L_NONNULL, 4), -EINVAL);
}

static void test_swiglu(void **state)
{
	size_t n = 1001;
	double *g = malloc(8 * n), *u = malloc(8 * n), *dh = malloc(8 * n), *h = malloc(8 * n);
	double *dg = malloc(8 * n), *du = malloc(8 * n);
	float *gf = rand_f32(g, n, 3.0f), *uf = rand_f32(u, n, 1.0f), *dhf = rand_f32(dh, n, 1.0f);
	float *dgg = malloc(4 * n), *dug = malloc(4 * n);
	uint16_t *hg = malloc(2 * n);
	(void)state;
	for (size_t i = 0; i < n; i++) {
		double s = 1 / (1 + exp(-g[i]));
		h[i] = g[i] * s * u[i];
		dg[i] = dh[i] * u[i] * s * (1 + g[i] * (1 - s));
		du[i] = dh[i] * g[i] * s;
	}
	void *dG = up(gf, 4 * n), *dU = up(uf, 4 * n), *dDH = up(dhf, 4 * n), *dH = poisoned(2 * n);
	void *dDG = poisoned(4 * n), *dDU = poisoned(4 * n);
	assert_int_equal(opsc_swiglu_fwd(gpu, n, dG, dU, dH), 0);
	assert_int_equal(opsc_swiglu_bwd(gpu, n, dG, dU, dDH, dDG, dDU), 0);
	down(hg, dH, 2 * n), down(dgg, dDG, 4 * n), down(dug, dDU, 4 * n);
	check("swiglu fwd h (bf16), n=1001", err_bf16(hg, h, n), TOL_BF16);
	check("swiglu bwd dg", err_f32(dgg, dg, n, 0), TOL_F32);
	check("swiglu bwd du", err_f32(dug, du, n, 0), TOL_F32);
	tier_dev_free(gpu, dG), tier_dev_free(gpu, dU), tier_dev_free(gpu, dDH), tier_dev_free(gpu, dH);
	tier_dev_free(gpu, dDG), tier_dev_free(gpu, dDU);
	free(g), free(u), free(dh), free(h), free(dg), free(du), free(gf), free(uf), free(dhf), free(dgg), free(dug);
	free(hg);
}

static void test_embed(void **state)
{
	int T = 37, vocab = 50, dim = 77;
	double *tab = malloc(8 * (size_t)vocab * dim);
	uint16_t *tb = rand_bf16(tab, (size_t)vocab * dim, 1.0f, 0);
	int32_t tok[37];
	float *out = malloc(4 * (size_t)T * dim);
	(void)state;
	for (int t = 0; t < T; t++)
		tok[t] = t == 0 ? 0 : t == 1 ? vocab - 1 : (int32_t)tier_rng_below(&rng, (uint64_t)vocab);
	void *dTok = up(tok, sizeof tok), *dTab = up(tb, 2 * (size_t)vocab * dim), *dOut = poisoned(4 * (size_t)T * dim);
	assert_int_equal(opsc_embed_fwd(gpu, T, vocab, dim, dTok, dTab, dOut), 0);
	down(out, dOut, 4 * (size_t)T * dim);
	for (int t = 0; t < T; t++)
		for (int j = 0; j < dim; j++)
			assert_true(out[(size_t)t * dim + j] == (float)tab[(size_t)tok[t] * dim + j]);
	tier_dev_free(gpu, dTok), tier_dev_free(gpu, dTab), tier_dev_free(gpu, dOut);
	free(tab), free(tb), free(out);
}

static void test_add(void **state)
{
	size_t n = 1001;
	double *a = malloc(8 * n), *b = malloc(8 * n), *s = malloc(8 * n);
	float *af = rand_f32(a, n, 1.0f), *bf = rand_f32(b, n, 1.0f), *g = malloc(4 * n);
	(void)state;
	for (size_t i = 0; i < n; i++)
		s[i] = a[i] + b[i];
	void *dA = up(af, 4 * n), *dB = up(bf, 4 * n), *dO = poisoned(4 * n);
	assert_int_equal(opsc_add(gpu, n, dA, dB, dO), 0);
	down(g, dO, 4 * n);
	check("add, n=1001", err_f32(g, s, n, 0), TOL_F32);
	assert_int_equal(opsc_add(gpu, n, dA, dB, dA), 0);      /* in place */
	down(g, dA, 4 * n);
	check("add in place", err_f32(g, s, n, 0), TOL_F32);
	tier_dev_free(gpu, dA), tier_dev_free(gpu, dB), tier_dev_free(gpu, dO);
	free(a), free(b), free(s), free(af), free(bf), free(g);
}

/* Bit-exact against the host's round-to-nearest-even, over more elements than one grid covers. */
static void test_to_bf16(void **state)
{
	size_t n = 2100003;
	float *x = rand_f32(NULL, n, 10.0f);
	uint16_t *g = malloc(2 * n);
	uint32_t ties[] = { 0x3f808000u, 0x3f818000u, 0xbf808000u, 0x7f7fffffu, 0x7f800000u, 0x00000001u };
	(void)state;
	for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++)
		memcpy(&x[i], &ties[i], 4);
	void *dX = up(x, 4 * n), *dY = poisoned(2 * n);
	assert_int_equal(opsc_to_bf16(gpu, n, dX, dY), 0);
	down(g, dY, 2 * n);
	for (size_t i = 0; i < n; i++)
		if (g[i] != tier_f32_to_bf16(x[i]))
			fail_msg("to_bf16: element %zu (%a) gave 0x%04x, expected 0x%04x", i, (double)x[i], g[i],
				 tier_f32_to_bf16(x[i]));
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dY);
	free(x), free(g);
}

/* bf16 -> fp32 is exact: every one of the 65536 bit patterns (NaNs compared as NaN), then an odd
 * length over more than one grid, with the element after the end left poisoned. */
static void test_from_bf16(void **state)
{
	size_t n = 2100003;
	uint16_t *h = malloc(2 * n);
	float *g = malloc(4 * (n + 1));
	(void)state;
	for (size_t i = 0; i < n; i++)
		h[i] = (uint16_t)(i < 65536 ? i : tier_rng_next(&rng));
	void *dX = up(h, 2 * n), *dY = poisoned(4 * (n + 1));
	assert_int_equal(opsc_from_bf16(gpu, n, dX, dY), 0);
	down(g, dY, 4 * (n + 1));
	for (size_t i = 0; i < n; i++) {
		float want = tier_bf16_to_f32(h[i]);
		if (isnan(want) ? !isnan(g[i]) : memcmp(&g[i], &want, 4))
			fail_msg("from_bf16: 0x%04x gave %a, expected %a", h[i], (double)g[i], (double)want);
	}
	uint32_t tail;
	memcpy(&tail, &g[n], 4);
	assert_int_equal(tail, 0xffffffffu); /* the poison */
	assert_int_equal(opsc_from_bf16(gpu, 0, NULL, NULL), 0);
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dY);
	free(h), free(g);
}

/* ns segments of len[] elements converted in one call; each destination one element longer and
 * that element left poisoned. */
static void check_to_bf16_many(int ns, const size_t *len, float scale)
{
	const float **src = calloc((size_t)ns, sizeof *src);
	opsc_bf16 **dst = calloc((size_t)ns, sizeof *dst);
	float **h = calloc((size_t)ns, sizeof *h);
	assert_non_null(src), assert_non_null(dst), assert_non_null(h);
	for (int s = 0; s < ns; s++) {
		h[s] = rand_f32(NULL, len[s], scale);
		src[s] = up(h[s], 4 * len[s]);
		dst[s] = poisoned(2 * (len[s] + 1));
	}
	assert_int_equal(opsc_to_bf16_many(gpu, ns, src, dst, len), 0);
	for (int s = 0; s < ns; s++) {
		uint16_t *g = malloc(2 * (len[s] + 1));
		down(g, dst[s], 2 * (len[s] + 1));
		for (size_t i = 0; i < len[s]; i++)
			assert_int_equal(g[i], tier_f32_to_bf16(h[s][i]));
		assert_int_equal(g[len[s]], 0xffff);
		free(g), free(h[s]);
		tier_dev_free(gpu, (void *)src[s]), tier_dev_free(gpu, dst[s]);
	}
	free(src), free(dst), free(h);
}

/* Five segments, one empty; none at all. */
static void test_to_bf16_many(void **state)
{
	static const size_t len[5] = { 1000, 0, 1, 77, 3000 };
	(void)state;
	check_to_bf16_many(5, len, 5.0f);
	assert_int_equal(opsc_to_bf16_many(gpu, 0, NULL, NULL, NULL), 0);
	const float *one[1] = { NULL };
	opsc_bf16 *none[1] = { NULL };
	size_t n1[1] = { 4 };
	assert_int_equal(opsc_to_bf16_many(gpu, 1, one, none, n1), -EINVAL); /* a segment without pointers */
}

/* 200 segments (the trainer's calls: a layer's experts' groups and its attention's, one launch),
 * then 1,100 (three launches of at most 512, the last partial; some segments empty). */
static void test_to_bf16_many_large(void **state)
{
	size_t len[1100];
	(void)state;
	for (int s = 0; s < 200; s++)
		len[s] = 1 + (size_t)tier_rng_below(&rng, 300);
	check_to_bf16_many(200, len, 3.0f);
	for (int s = 0; s < 1100; s++)
		len[s] = s % 97 == 0 ? 0 : 1 + (size_t)tier_rng_below(&rng, 40);
	check_to_bf16_many(1100, len, 2.0f);
}

/* tier_dev_put_async: 12 uploads from one host buffer, changed right after each call, into their
 * own device buffers (more than the context's 4 staging buffers, so each is reused; sizes growing
 * past each buffer's first size), read back after a sync: each holds what the host had at its call. */
static void test_put_async(void **state)
{
	(void)state;
	enum { N = 12 };
	size_t len[N];
	void *dst[N];
	uint32_t *h = malloc(4 * 300000), *back = malloc(4 * 300000);
	for (int i = 0; i < N; i++) {
		len[i] = (size_t)(i < 6 ? 1000 : 300000) - (size_t)i;
		dst[i] = poisoned(4 * len[i]);
		for (size_t j = 0; j < len[i]; j++)
			h[j] = (uint32_t)(i * 1000003 + j);
		assert_int_equal(tier_dev_put_async(gpu, dst[i], h, 4 * len[i]), 0);
		memset(h, 0xab, 4 * len[i]); /* the staged copy must not see this */
	}
	assert_int_equal(tier_dev_sync(gpu), 0);
	for (int i = 0; i < N; i++) {
		down(back, dst[i], 4 * len[i]);
		for (size_t j = 0; j < len[i]; j++)
			if (back[j] != (uint32_t)(i * 1000003 + j))
				fail_msg("upload %d: element %zu is 0x%08x", i, j, back[j]);
		tier_dev_free(gpu, dst[i]);
	}
	free(h), free(back);
}

/* ---- Optimizer ------------------------------------------------------------------------------- */

static void test_sumsq(void **state)
{
	size_t n = 1000003;
	float *x = rand_f32(NULL, n, 1.0f);
	double acc0 = 1.5, ref = 0, got;
	(void)state;
	for (size_t i = 0; i < n; i++)
		ref += (double)x[i] * x[i];
	void *dX = up(x, 4 * n), *dAcc = up(&acc0, 8);
	assert_int_equal(opsc_sumsq(gpu, n, dX, dAcc), 0);
	assert_int_equal(opsc_sumsq(gpu, 77, dX, dAcc), 0);   /* accumulates: a second, short call */
	for (size_t i = 0; i < 77; i++)
		ref += (double)x[i] * x[i];
	down(&got, dAcc, 8);
	ref += acc0;
	print_message("  sumsq n=%zu + 77: %.12g (ref %.12g)\n", n, got, ref);
	assert_true(fabs(got - ref) <= TOL_F64 * ref);
	tier_dev_free(gpu, dX), tier_dev_free(gpu, dAcc);
	free(x);
}

/* One AdamW step at t = 3 with weight decay and a gradient scale; p is judged on its update. */
static void test_adamw(void **state)
{
	size_t n = 1001;
	const float lr = 0.1f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, decay = 1.0f - 0.1f * 0.01f, gs = 0.5f;
	const float bc1 = 1.0f - b1 * b1 * b1, bc2 = 1.0f - b2 * b2 * b2;
	float *p = rand_f32(NULL, n, 1.0f), *g = rand_f32(NULL, n, 1.0f), *m = rand_f32(NULL, n, 0.1f);
	float *v = rand_f32(NULL, n, 0.1f), *pg = malloc(4 * n), *mg = malloc(4 * n), *vg = malloc(4 * n);
	double *pr = malloc(8 * n), *mr = malloc(8 * n), *vr = malloc(8 * n), *dp = malloc(8 * n);
	(void)state;
	for (size_t i = 0; i < n; i++) {
		v[i] = v[i] * v[i];                                  /* second moments are >= 0 */
		double gj = (double)g[i] * gs;
		mr[i] = b1 * (double)m[i] + (1 - (double)b1) * gj;
		vr[i] = b2 * (double)v[i] + (1 - (double)b2) * gj * gj;
		pr[i] = p[i] * (double)decay - lr * (mr[i] / bc1) / (sqrt(vr[i] / bc2) + eps);
		dp[i] = pr[i] - p[i];
	}
	void *dP = up(p, 4 * n), *dG = up(g, 4 * n), *dM = up(m, 4 * n), *dV = up(v, 4 * n);
	assert_int_equal(opsc_adamw(gpu, n, dP, dG, dM, dV, lr, b1, b2, eps, decay, bc1, bc2, gs), 0);
	down(pg, dP, 4 * n), down(mg, dM, 4 * n), down(vg, dV, 4 * n);
	check("adamw p (relative to the update)", err_f32(pg, pr, n, max_abs(dp, n)), TOL_F32);
	check("adamw m", err_f32(mg, mr, n, 0), TOL_F32);
	check("adamw v", err_f32(vg, vr, n, 0), TOL_F32);
	tier_dev_free(gpu, dP), tier_dev_free(gpu, dG), tier_dev_free(gpu, dM), tier_dev_free(gpu, dV);
	free(p), free(g), free(m), free(v), free(pg), free(mg), free(vg), free(pr), free(mr), free(vr), free(dp);
}

/* The optimizer's batched form: 1000 tensors of random lengths (some empty, so more than two
 * launches), each with its own bias corrections, against opsc_adamw one by one bit for bit; bad
 * tables refused before any launch. */
static void test_adamw_many(void **state)
{
	enum { K = 1000 };
	const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, decay = 1.0f - 0.01f * 0.1f, gs = 0.75f;
	opsc_adamw_t *t = calloc(K, sizeof *t), *u = calloc(K, sizeof *u);
	size_t *n = calloc(K, sizeof *n), total = 0;
	(void)state;
	for (int i = 0; i < K; i++)
		total += n[i] = i % 97 == 5 ? 0 : 1 + tier_rng_below(&rng, i % 10 == 0 ? 40000 : 3000);
	float *h = rand_f32(NULL, 4 * total, 1.0f), *got = malloc(16 * total), *want = malloc(16 * total);
	for (size_t i = 3 * total; i < 4 * total; i++) /* second moments are >= 0 */
		h[i] = h[i] * h[i];
	float *d1 = up(h, 16 * total), *d2 = up(h, 16 * total);
	size_t off = 0;
	for (int i = 0; i < K; i++) {
		int st = 1 + (int)tier_rng_below(&rng, 50);
		float bc1 = 1.0f - powf(b1, (float)st), bc2 = 1.0f - powf(b2, (float)st);
		t[i] = (opsc_adamw_t){ d1 + off, d1 + 2 * total + off, d1 + 3 * total + off, d1 + total + off, n[i], bc1, bc2 };
		u[i] = (opsc_adamw_t){ d2 + off, d2 + 2 * total + off, d2 + 3 * total + off, d2 + total + off, n[i], bc1, bc2 };
		off += n[i];
	}
	assert_int_equal(opsc_adamw_many(gpu, K, t, lr, b1, b2, eps, decay, gs), 0);
	for (int i = 0; i < K; i++)
		assert_int_equal(opsc_adamw(gpu, u[i].n, u[i].p, u[i].g, u[i].m, u[i].v, lr, b1, b2, eps, decay, u[i].bc1,
					    u[i].bc2, gs), 0);
	down(got, d1, 16 * total), down(want, d2, 16 * total);
	assert_memory_equal(got, want, 16 * total);
	size_t changed = 0;
	for (size_t i = 0; i < total; i++)
		changed += got[i] != h[i];
	print_message("  adamw_many: %d tensors, %zu elements, %zu parameters changed, equal to one by one\n", K, total,
		      changed);
	assert_true(changed > total / 2);
	assert_int_equal(opsc_adamw_many(gpu, 0, NULL, lr, b1, b2, eps, decay, gs), 0);
	assert_int_equal(opsc_adamw_many(gpu, -1, t, lr, b1, b2, eps, decay, gs), -EINVAL);
	assert_int_equal(opsc_adamw_many(gpu, 3, NULL, lr, b1, b2, eps, decay, gs), -EINVAL);
	t[1].m = NULL;
	assert_int_equal(opsc_adamw_many(gpu, 3, t, lr, b1, b2, eps, decay, gs), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "tensor 1"));
	tier_dev_free(gpu, d1), tier_dev_free(gpu, d2);
	free(t), free(u), free(n), free(h), free(got), free(want);
}

/* ---- Synthetic weights ----------------------------------------------------------------------- */

static uint16_t *normal_of(size_t n, uint64_t seed, float std)
{
	uint16_t *h = malloc(2 * n);
	void *d = poisoned(2 * n);
	assert_int_equal(opsc_fill_normal(gpu, n, seed, std, d), 0);
	down(h, d, 2 * n);
	tier_dev_free(gpu, d);
	return h;
}

static void test_fill(void **state)
{
	size_t n = 1000001, tails = 0, differ = 0;
	const float std = 0.02f;
	uint16_t *a = normal_of(n, 1234, std), *b = normal_of(n, 1234, std), *c = normal_of(n, 1235, std);
	uint16_t *small = normal_of(1000, 1234, std);
	double s = 0, ss = 0, mean, sd;
	(void)state;
	for (size_t i = 0; i < n; i++) {
		double z = tier_bf16_to_f32(a[i]) / std;
		assert_true(isfinite(z));
		s += z, ss += z * z, tails += fabs(z) > 2;
		differ += a[i] != c[i];
	}
	mean = s / n, sd = sqrt(ss / n - mean * mean);
	print_message("  fill_normal n=%zu: mean %.2e std, std %.4f of asked, %.4f beyond 2 std, %.3f differ "
		      "with another seed\n", n, mean, sd, (double)tails / n, (double)differ / n);
	assert_true(fabs(mean) < 5e-3);                         /* 5 standard errors of the mean */
	assert_true(fabs(sd - 1) < 0.02);
	assert_true(fabs((double)tails / n - 0.0455) < 3e-3);
	assert_memory_equal(a, b, 2 * n);                        /* same seed, same values */
	assert_memory_equal(a, small, 2 * 1000);                 /* independent of the launch shape */
	assert_true(differ > n * 9 / 10);
	free(a), free(b), free(c), free(small);

	uint16_t *k = malloc(2 * 1001);
	void *d = poisoned(2 * 1001);
	assert_int_equal(opsc_fill_const(gpu, 1001, 1.0f / 3, d), 0);
	down(k, d, 2 * 1001);
	for (int i = 0; i < 1001; i++)
		assert_int_equal(k[i], tier_f32_to_bf16(1.0f / 3));
	tier_dev_free(gpu, d);
	free(k);
}

/* ---- Argument checks ------------------------------------------------------------------------- */

static void test_bad_args(void **state)
{
	void *p = poisoned(4096);
	tier_lora_ref half = { .a = p, .b = NULL, .rank = 4, .scale = 1 }, all = { .a = p, .b = p, .rank = 4, .dropout = 1 };
	opsc_operand A = { 0, p, CUDA_R_16BF, 4 }, B = { 0, p, CUDA_R_16BF, 8 };
	(void)state;
	assert_int_equal(opsc_add(cpu, 4, p, p, p), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "CUDA device"));
	assert_int_equal(opsc_rmsnorm_fwd(gpu, -1, 8, 1e-6f, p, p, p, NULL), -EINVAL);
	assert_int_equal(opsc_rmsnorm_bwd(gpu, 2, 8, p, p, NULL, p, p), -EINVAL);
	assert_int_equal(opsc_linear_fwd(gpu, 4, 8, 8, p, p, &half, p, p), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_linear_fwd"));
	assert_int_equal(opsc_linear_fwd16(gpu, 4, 8, 8, p, p, &half, p, p), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_linear_fwd16"));
	assert_int_equal(opsc_linear_fwd16(gpu, 4, 8, 8, p, p, NULL, NULL, p), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "opsc_linear_fwd16: y is NULL"));
	assert_int_equal(opsc_linear_bwd(gpu, 4, 8, 8, p, p, &all, p, p, 0, p), -EINVAL);  /* dropout 1 */
	assert_non_null(strstr(tier_last_error(), "dropout"));
	assert_int_equal(opsc_gemm(gpu, 8, 2, 2, 1.0f, A, B, 0.0f, p, 8), -EINVAL);  /* lda 4 < m 8 */
	assert_non_null(strstr(tier_last_error(), "8 x 2 x 2"));
	A.ld = 8, A.type = 3;
	assert_int_equal(opsc_gemm(gpu, 8, 2, 2, 1.0f, A, B, 0.0f, p, 8), -EINVAL);  /* not bf16 or fp32 */
	assert_int_equal(opsc_linear_bwd(gpu, 0, 8, 8, NULL, NULL, NULL, NULL, NULL, 0, NULL), 0);
	tier_dev_free(gpu, p);
}

/* tier_dev_memset (base/fill_cuda.cu's kernel on CUDA: 16-byte stores in the aligned middle, bytes
 * at the ends) at every start offset 0..17 of a poisoned buffer and sizes around the 16-byte
 * boundaries: exactly [off, off + n) takes the value, every byte around it keeps the poison. */
static void test_memset(void **state)
{
	(void)state;
	const size_t sizes[] = { 0, 1, 2, 5, 15, 16, 17, 31, 32, 33, 100, 4096 + 7, ((size_t)1 << 20) + 3 };
	const size_t cap = ((size_t)1 << 20) + 64;
	unsigned char *h = malloc(cap), *want = malloc(cap);
	void *d;
	assert_non_null(h), assert_non_null(want);
	assert_int_equal(tier_dev_malloc(gpu, cap, &d), 0);
	for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
		for (size_t off = 0; off < 18; off++) {
			const size_t n = sizes[si];
			const int v = (int)(0x100 + 17 * si + off); /* only the low byte counts */
			memset(want, 0xab, cap);
			assert_int_equal(tier_dev_memcpy_h2d(gpu, d, want, cap), 0);
			memset(want + off, v & 0xff, n);
			assert_int_equal(tier_dev_memset(gpu, (unsigned char *)d + off, v, n), 0);
			assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, cap), 0);
			if (memcmp(h, want, cap))
				fail_msg("memset of %zu bytes at offset %zu: wrong bytes", n, off);
		}
	tier_dev_free(gpu, d);
	free(h), free(want);
}

/* n memsets of a buffer, queued. */
static void memsets(void *buf, size_t bytes, int n)
{
	for (int i = 0; i < n; i++)
		assert_int_equal(tier_dev_memset(gpu, buf, i & 0xff, bytes), 0);
}

/* A waypoint waits for the work queued before it and not for the work after: 16 memsets of 1 GiB
 * (about 4 ms on an H200), a waypoint, 16 more; its wait takes over a millisecond and the sync
 * after it another (loose bounds: ordering, not speed). */
static void test_waypoint(void **state)
{
	(void)state;
	size_t bytes = (size_t)1 << 30;
	void *buf;
	tier_waypoint *w;
	assert_int_equal(tier_dev_malloc(gpu, bytes, &buf), 0);
	assert_int_equal(tier_waypoint_open(&w, gpu), 0);
	memsets(buf, bytes, 2); /* warm */
	assert_int_equal(tier_dev_sync(gpu), 0);
	memsets(buf, bytes, 16);
	assert_int_equal(tier_waypoint_put(w), 0);
	assert_int_equal(tier_waypoint_pending(w), 1);
	memsets(buf, bytes, 16);
	uint64_t t0 = tier_now_ns();
	assert_int_equal(tier_waypoint_wait(w), 0);
	uint64_t t1 = tier_now_ns();
	assert_int_equal(tier_dev_sync(gpu), 0);
	uint64_t t2 = tier_now_ns();
	print_message("  waypoint: waited %.3f ms, then %.3f ms for the work after it\n", (t1 - t0) / 1e6,
		      (t2 - t1) / 1e6);
	assert_true(t1 - t0 > 1000000 && t2 - t1 > 1000000);
	assert_int_equal(tier_waypoint_pending(w), 0);
	tier_waypoint_close(w);
	tier_dev_free(gpu, buf);
}

/* Copy lanes (tier_dev_copy_async, _join): a lane's copy waits for the compute stream's work
 * queued before it (16 memsets of 256 MiB, the last one's 0x0f the only bytes it may read), the
 * compute stream's work after a join waits for the copy (a memset of 0x77 right after must not
 * reach it), and the two lanes carry a device-to-host and a host-to-device copy side by side. */
static void test_copy_lanes(void **state)
{
	(void)state;
	size_t n = (size_t)256 << 20;
	void *a, *b, *h1, *h2;
	assert_int_equal(tier_dev_malloc(gpu, n, &a), 0);
	assert_int_equal(tier_dev_malloc(gpu, n, &b), 0);
	assert_int_equal(tier_host_malloc(n, 1, &h1), 0);
	assert_int_equal(tier_host_malloc(n, 1, &h2), 0);
	memset(h1, 0, n), memset(h2, 0x5a, n);
	assert_int_equal(tier_dev_memset(gpu, b, 0, n), 0);
	memsets(a, n, 16);
	assert_int_equal(tier_dev_copy_async(gpu, h1, a, n, 0), 0);
	assert_int_equal(tier_dev_copy_async(gpu, b, h2, n, 1), 0);
	assert_int_equal(tier_dev_copy_join(gpu, 0), 0);
	assert_int_equal(tier_dev_copy_join(gpu, 1), 0);
	assert_int_equal(tier_dev_memset(gpu, a, 0x77, n), 0);
	assert_int_equal(tier_dev_memcpy_d2h(gpu, h2, b, n), 0); /* on the compute stream: after the join */
	assert_int_equal(tier_dev_sync(gpu), 0);
	const unsigned char *p1 = h1, *p2 = h2;
	size_t bad1 = 0, bad2 = 0;
	for (size_t i = 0; i < n; i++)
		bad1 += p1[i] != 0x0f, bad2 += p2[i] != 0x5a;
	assert_int_equal(bad1, 0);
	assert_int_equal(bad2, 0);
	assert_int_equal(tier_dev_copy_async(gpu, h1, a, n, TIER_DEV_COPY_LANES), -EINVAL);
	assert_int_equal(tier_dev_copy_async(gpu, NULL, a, n, 0), -EINVAL);
	assert_int_equal(tier_dev_copy_join(gpu, -1), -EINVAL);
	tier_host_free(h1, 1), tier_host_free(h2, 1);
	tier_dev_free(gpu, a), tier_dev_free(gpu, b);
}

/* Marks on the GPU measure the device's time, not the host's: 8 memsets of 1 GiB queued between
 * two marks (the host returns at once) take about as long as the same 8 timed with a sync, and 16
 * between the next two about twice that; 600 more marks make the arrays (and their events) grow.
 * The first span after the origin goes to no tag: on the H200 it ran 0.8 ms longer than its work
 * (2.68 ms for 8 memsets timed at 1.89 ms with a sync, 3.76 ms for the 16 after it), the device
 * having idled while the events were made. */
static void test_marks(void **state)
{
	(void)state;
	size_t bytes = (size_t)1 << 30;
	void *buf;
	tier_marks *m;
	assert_int_equal(tier_dev_malloc(gpu, bytes, &buf), 0);
	memsets(buf, bytes, 2); /* warm */
	assert_int_equal(tier_dev_sync(gpu), 0);
	uint64_t t0 = tier_now_ns();
	memsets(buf, bytes, 8);
	assert_int_equal(tier_dev_sync(gpu), 0);
	uint64_t synced = tier_now_ns() - t0, ns[2] = { 0, 0 };
	assert_int_equal(tier_marks_open(&m, gpu), 0);
	tier_marks_begin(m);
	assert_int_equal(tier_marks_put(m, -1), 0);
	memsets(buf, bytes, 2); /* to a tag out of range: the first span ran 0.8 ms long on the H200 */
	assert_int_equal(tier_marks_put(m, 2), 0);
	memsets(buf, bytes, 8);
	uint64_t h0 = tier_now_ns();
	assert_int_equal(tier_marks_put(m, 0), 0);
	memsets(buf, bytes, 16);
	assert_int_equal(tier_marks_put(m, 1), 0);
	uint64_t queued = tier_now_ns() - h0;
	for (int i = 0; i < 600; i++) /* to a tag out of range: the host's time making events is no one's */
		assert_int_equal(tier_marks_put(m, 2), 0);
	assert_int_equal(tier_marks_collect(m, ns, 2), 0);
	printf("# marks: 8 memsets of 1 GiB %.3f ms on the device clock, %.3f ms timed with a sync; 16: %.3f ms "
	       "(queued in %.3f ms of host time)\n", ns[0] / 1e6, synced / 1e6, ns[1] / 1e6, queued / 1e6);
	assert_true(queued < ns[1] / 2); /* the host did not wait: the time is the device's */
	assert_true(ns[0] >= synced / 2 && ns[0] <= synced * 2);
	assert_true(ns[1] >= ns[0] * 7 / 5 && ns[1] <= ns[0] * 13 / 5);
	tier_marks_close(m);
	tier_dev_free(gpu, buf);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_gemm),        cmocka_unit_test(test_linear),   cmocka_unit_test(test_linear_dropout),
		cmocka_unit_test(test_rmsnorm),     cmocka_unit_test(test_qk_fwd),   cmocka_unit_test(test_qk_grad),
		cmocka_unit_test(test_qk16),
		cmocka_unit_test(test_linear_bwd_bf16),
		cmocka_unit_test(test_linear_bwd_to16), cmocka_unit_test(test_linear_cat),
		cmocka_unit_test(test_swiglu),      cmocka_unit_test(test_embed),    cmocka_unit_test(test_add),
		cmocka_unit_test(test_to_bf16),     cmocka_unit_test(test_from_bf16),    cmocka_unit_test(test_to_bf16_many),
		cmocka_unit_test(test_to_bf16_many_large), cmocka_unit_test(test_put_async), cmocka_unit_test(test_sumsq),
		cmocka_unit_test(test_adamw),       cmocka_unit_test(test_adamw_many),
		cmocka_unit_test(test_fill),        cmocka_unit_test(test_bad_args),
		cmocka_unit_test(test_marks),       cmocka_unit_test(test_waypoint), cmocka_unit_test(test_copy_lanes),
		cmocka_unit_test(test_memset),
	};
	int rc;
	if (!tier_cuda_available()) {
		printf("# test_ops_cuda: no CUDA device, skipped\n");
		return 77;
	}
	tier_rng_seed(&rng, test_seed("test_ops_cuda", 0));
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0) || tier_dev_open(&gpu, TIER_DEV_CUDA, 0)) {
		fprintf(stderr, "test_ops_cuda: %s\n", tier_last_error());
		return 1;
	}
	rc = cmocka_run_group_tests(tests, NULL, NULL);
	tier_dev_close(gpu);
	tier_dev_close(cpu);
	return rc;
}
