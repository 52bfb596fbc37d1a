/* test_moe_wgmma.c - the Hopper grouped GEMM (moe/moe_wgmma.cu) against an fp64 reference on
 * bf16-rounded inputs: every CTA tile shape, fp32 and bf16 C, alpha and beta, empty, one-row and
 * many-tile groups, up to 1024 experts, few CTAs (many tiles through one ring), rows outside the
 * groups untouched, bad arguments refused. Skips (77) without a compute capability 9.0 GPU. */
#include "config.h"
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include "moe/moe_wgmma.h"

/* Both sides multiply the same bf16 values; the GPU sums in fp32 (in another order), which stays
 * far below 1e-3 of the largest output. bf16 C adds one rounding (2^-9 relative). */
#define F32_TOL 1e-3
#define BF16_TOL 1e-2

static tier_dev *cpu, *gpu;
static tier_rng rng;

static uint16_t to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}
static float rnd_bf16(float scale) { return from_bf16(to_bf16(scale * tier_rng_normal(&rng))); }

static void *up(const void *h, size_t n)
{
	void *d = NULL;
	assert_int_equal(tier_dev_malloc(gpu, n ? n : 4, &d), 0);
	if (h && n)
		assert_int_equal(tier_dev_memcpy_h2d(gpu, d, h, n), 0);
	return d;
}
static void down(void *h, const void *d, size_t n)
{
	if (n)
		assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, n), 0);
}
static void *up_bf16(const float *f, size_t n)
{
	uint16_t *b = malloc(2 * n + 2);
	for (size_t i = 0; i < n; i++)
		b[i] = to_bf16(f[i]);
	void *d = up(b, 2 * n);
	free(b);
	return d;
}

/* ---- a problem: groups, bf16-rounded x and W_e on both sides, the fp64 reference x W_e^T ---- */
typedef struct {
	int E, N, K, rows, rb; /* rb: rows_bound = rows + extra rows that belong to no group */
	int32_t *off;
	float *x, **w;
	double *ref; /* [rows, N] */
	void *dx, *doff, **dw;
} wprob;

/* Four partial sums break the add chain (4x faster); the order does not matter at 1e-3. */
static double dot(const float *a, const float *b, int K)
{
	double s[4] = { 0, 0, 0, 0 };
	int k = 0;
	for (; k + 4 <= K; k += 4)
		for (int i = 0; i < 4; i++)
			s[i] += (double)a[k + i] * b[k + i];
	for (; k < K; k++)
		s[0] += (double)a[k] * b[k];
	return (s[0] + s[1]) + (s[2] + s[3]);
}

static void prob_ref(wprob *p)
{
	p->ref = calloc((size_t)p->rows * p->N + 1, sizeof *p->ref);
	for (int e = 0; e < p->E; e++)
		for (int r = p->off[e]; r < p->off[e + 1]; r++)
			for (int n = 0; n < p->N; n++)
				p->ref[(size_t)r * p->N + n] = dot(p->x + (size_t)r * p->K, p->w[e] + (size_t)n * p->K, p->K);
}

/* Weights only for the experts that have rows: the others stay NULL, as the API allows. */
static void prob_make(wprob *p, int E, int N, int K, const int *nrows, int extra)
{
	p->E = E, p->N = N, p->K = K;
	p->off = malloc(4 * (size_t)(E + 1));
	p->off[0] = 0;
	for (int e = 0; e < E; e++)
		p->off[e + 1] = p->off[e] + nrows[e];
	p->rows = p->off[E], p->rb = p->rows + extra;
	size_t xn = (size_t)p->rb * K;
	p->x = malloc(4 * xn + 4);
	for (size_t i = 0; i < xn; i++)
		p->x[i] = rnd_bf16(1.0f);
	p->w = calloc((size_t)E, sizeof *p->w);
	p->dw = calloc((size_t)E, sizeof *p->dw);
	for (int e = 0; e < E; e++) {
		if (!nrows[e])
			continue;
		p->w[e] = malloc(4 * (size_t)N * K);
		for (size_t i = 0; i < (size_t)N * K; i++)
			p->w[e][i] = rnd_bf16(0.1f);
		p->dw[e] = up_bf16(p->w[e], (size_t)N * K);
	}
	p->dx = up_bf16(p->x, xn);
	p->doff = up(p->off, 4 * (size_t)(E + 1));
	prob_ref(p);
}

static void prob_free(wprob *p)
{
	for (int e = 0; e < p->E; e++) {
		free(p->w[e]);
		tier_dev_free(gpu, p->dw[e]);
	}
	tier_dev_free(gpu, p->dx), tier_dev_free(gpu, p->doff);
	free(p->w), free(p->dw), free(p->off), free(p->x), free(p->ref);
}

/* ---- one call and its checks ---- */
/* The knobs of moe_wgmma.h; NULL unsets. */
static void knobs(const char *tile, const char *ctas)
{
	if (tile)
		setenv("TIER_MOE_WGMMA_TILE", tile, 1);
	else
		unsetenv("TIER_MOE_WGMMA_TILE");
	if (ctas)
		setenv("TIER_MOE_WGMMA_CTAS", ctas, 1);
	else
		unsetenv("TIER_MOE_WGMMA_CTAS");
}

/* C's bytes before the call, rb + 1 rows (the last a guard past rows_bound): 0xff (NaN) with beta 0,
 * else bf16-rounded random values (cf: the same as floats). */
static unsigned char *c_start(const wprob *p, int c_bf16, int beta, float *cf)
{
	size_t cn = (size_t)(p->rb + 1) * p->N, es = c_bf16 ? 2 : 4;
	unsigned char *c = malloc(es * cn);
	memset(c, 0xff, es * cn);
	for (size_t i = 0; beta && i < cn; i++) {
		cf[i] = rnd_bf16(1.0f);
		uint16_t b = to_bf16(cf[i]);
		memcpy(c + es * i, c_bf16 ? (const void *)&b : (const void *)&cf[i], es);
	}
	return c;
}

/* The rows of the groups against alpha ref + beta C, every other byte (rows rows..rb) unchanged. */
static void c_check(const wprob *p, const unsigned char *got, const unsigned char *c0, const float *cf, int c_bf16,
		    float alpha, int beta, const char *what)
{
	size_t n = (size_t)p->rows * p->N, es = c_bf16 ? 2 : 4, all = es * (size_t)(p->rb + 1) * p->N;
	float *g = malloc(4 * n + 4);
	double *want = malloc(8 * n + 8);
	for (size_t i = 0; i < n; i++) {
		if (c_bf16) {
			uint16_t b;
			memcpy(&b, got + es * i, 2);
			g[i] = from_bf16(b);
		} else {
			memcpy(&g[i], got + es * i, 4);
		}
		want[i] = alpha * p->ref[i] + (beta ? cf[i] : 0.0);
	}
	double err = ref_relerr(g, want, n), tol = c_bf16 ? BF16_TOL : F32_TOL;
	if (!(err <= tol))
		fprintf(stderr, "# %s: relative error %g > %g\n", what, err, tol);
	assert_true(err <= tol);
	for (size_t i = es * n; i < all; i++) {
		if (got[i] != c0[i])
			fprintf(stderr, "# %s: byte %zu (row %zu), outside the groups, changed\n", what, i, i / es / p->N);
		assert_int_equal(got[i], c0[i]);
	}
	free(g), free(want);
}

static void run_one(const wprob *p, int c_bf16, float alpha, int beta, const char *what)
{
	size_t cn = (size_t)(p->rb + 1) * p->N, bytes = (c_bf16 ? 2 : 4) * cn;
	float *cf = malloc(4 * cn);
	unsigned char *c0 = c_start(p, c_bf16, beta, cf), *got = malloc(bytes);
	void *dc = up(c0, bytes);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, p->E, p->N, p->K, p->doff, p->rb, (const void *const *)p->dw, p->dx,
						  dc, c_bf16, alpha, (float)beta),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, dc, bytes);
	c_check(p, got, c0, cf, c_bf16, alpha, beta, what);
	tier_dev_free(gpu, dc);
	free(cf), free(c0), free(got);
}

/* Every tile shape (and the default pick) with each output kind, then few CTAs: a CTA's ring then
 * carries many tiles, its phases wrapping many times. */
static void run_all(const wprob *p)
{
	static const char *tiles[] = { NULL, "128x256", "128x128", "64x256" };
	static const struct {
		int c_bf16;
		float alpha;
		int beta;
	} v[] = { { 0, 1.0f, 0 }, { 0, 0.37f, 1 }, { 1, 0.37f, 0 }, { 1, 1.0f, 1 } };
	char what[160];
	for (size_t t = 0; t < sizeof tiles / sizeof tiles[0]; t++)
		for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
			knobs(tiles[t], NULL);
			snprintf(what, sizeof what, "E %d N %d K %d rows %d tile %s c_bf16 %d alpha %g beta %d", p->E, p->N, p->K,
				 p->rows, tiles[t] ? tiles[t] : "auto", v[i].c_bf16, (double)v[i].alpha, v[i].beta);
			run_one(p, v[i].c_bf16, v[i].alpha, v[i].beta, what);
		}
	knobs(NULL, "2");
	snprintf(what, sizeof what, "E %d N %d K %d rows %d, 2 CTAs", p->E, p->N, p->K, p->rows);
	run_one(p, 0, 1.0f, 0, what);
	knobs("64x256", "1");
	snprintf(what, sizeof what, "E %d N %d K %d rows %d, 64x256 on 1 CTA", p->E, p->N, p->K, p->rows);
	run_one(p, 1, 0.37f, 1, what);
	knobs(NULL, NULL);
}

static void run_case(int E, int N, int K, const int *nrows, int extra)
{
	wprob p;
	prob_make(&p, E, N, K, nrows, extra);
	run_all(&p);
	prob_free(&p);
}

/* ---- the cases ---- */
/* N and K not multiples of the tiles (a 72-column and an 8-k tail), a one-row and an empty group. */
static void test_small(void **state)
{
	(void)state;
	static const int n[] = { 1, 0, 300 };
	run_case(3, 200, 136, n, 5);
}

/* 40 random groups, empty ones included (first, last, inner), sizes around the tile edges. */
static void test_many(void **state)
{
	(void)state;
	int n[40];
	for (int e = 0; e < 40; e++)
		n[e] = (int)tier_rng_below(&rng, 160);
	n[0] = 0, n[1] = 1, n[7] = 300, n[8] = 0, n[20] = 129, n[21] = 64, n[22] = 65, n[39] = 0;
	run_case(40, 768, 2048, n, 3);
}

/* The model's shapes: few large groups, N = 2048 (8 column tiles of 256), K = 768. */
static void test_large(void **state)
{
	(void)state;
	static const int n[] = { 0, 513, 77, 1, 1000 };
	run_case(5, 2048, 768, n, 64);
}

/* The most experts: 3 per thread in the tile table's scan, mostly 0-3 rows, one of several tiles. */
static void test_1024_experts(void **state)
{
	(void)state;
	int *n = malloc(sizeof(int) * 1024);
	for (int e = 0; e < 1024; e++)
		n[e] = (int)tier_rng_below(&rng, 4);
	n[0] = 0, n[383] = 0, n[500] = 200, n[1023] = 0;
	run_case(1024, 64, 64, n, 7);
	free(n);
}

/* One expert of one row with rows_bound = offsets[E]; no rows at all (every CTA finds no tile); and
 * rows_bound 0 (nothing launched): C untouched. */
static void test_edges(void **state)
{
	(void)state;
	static const int one[] = { 1 }, none[] = { 0, 0, 0, 0 };
	run_case(1, 24, 8, one, 0);
	run_case(4, 8, 8, none, 9);
	run_case(4, 16, 16, none, 0);
}

/* What the host refuses, before any launch (the pointers are never dereferenced). */
static void test_bad_input(void **state)
{
	(void)state;
	int32_t *off = (int32_t *)64;
	const void *w[2] = { (void *)64, (void *)64 }, *wodd[2] = { (void *)64, (void *)72 };
	void *p = (void *)64;
	knobs(NULL, NULL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 12, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* K % 8 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 12, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* N % 8 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 0, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);   /* N */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 0, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);   /* E */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 1025, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, -1, w, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* rows_bound */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.5f), -EINVAL);   /* beta */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, p, p, 2, 1.0f, 0.0f), -EINVAL);   /* c_bf16 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, wodd, p, p, 0, 1.0f, 0.0f), -EINVAL); /* w align */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, (void *)72, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, p, (void *)72, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, NULL, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, NULL, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, NULL, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, p, NULL, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(cpu, 2, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* not CUDA */
	assert_int_equal(moe_cuda_grouped_mm_sm90(NULL, 2, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);
	static const char *bad[][2] = { { "96x96", NULL }, { "128x256x", NULL }, { NULL, "0" }, { NULL, "many" } };
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) { /* malformed knobs */
		knobs(bad[i][0], bad[i][1]);
		assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, p, p, 0, 1.0f, 0.0f), -EINVAL);
	}
	knobs(NULL, NULL);
	assert_int_equal(moe_cuda_wgmma_supported(cpu), 0);
	assert_int_equal(moe_cuda_wgmma_supported(NULL), 0);
}

static int setup(void **state)
{
	(void)state;
	tier_rng_seed(&rng, ref_seed("test_moe_wgmma"));
	return tier_dev_open(&cpu, TIER_DEV_CPU, 0);
}

static int teardown(void **state)
{
	(void)state;
	tier_dev_close(cpu);
	return 0;
}
#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	if (!tier_cuda_available()) {
		fprintf(stderr, "# test_moe_wgmma: no CUDA device, skipped\n");
		return 77;
	}
	if (tier_dev_open(&gpu, TIER_DEV_CUDA, 0)) {
		fprintf(stderr, "# test_moe_wgmma: cannot open the CUDA device\n");
		return 1;
	}
	if (!moe_cuda_wgmma_supported(gpu)) {
		fprintf(stderr, "# test_moe_wgmma: %s is not a compute capability 9.0 GPU, skipped\n", tier_dev_name(gpu));
		tier_dev_close(gpu);
		return 77;
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_small),
		cmocka_unit_test(test_many),
		cmocka_unit_test(test_large),
		cmocka_unit_test(test_1024_experts),
		cmocka_unit_test(test_edges),
		cmocka_unit_test(test_bad_input),
	};
	int rc = cmocka_run_group_tests(tests, setup, teardown);
	tier_dev_close(gpu);
	return rc;
#else
	fprintf(stderr, "# test_moe_wgmma: built without CUDA, skipped\n");
	return 77;
#endif
}
