/* test_moe_skinny.c - the LoRA rank products over the permuted rows (moe/moe_skinny.cu) against an
 * fp64 reference on bf16-rounded inputs: both weight layouts, one and two products per pass, ranks 8
 * to 64, K from 8 to 2056 (odd multiples of 8: partial 64-k stages), 1 to 1024 experts with empty,
 * one-row and all-rows groups, both row tiles, rows_bound past the groups, every byte outside the
 * groups untouched, bad arguments refused before any write. TIER_SKINNY_BENCH=1 also times the
 * model's shape (printed, never asserted). Skips (77) without a CUDA GPU. */
#include "config.h"
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>
#include "env_keep.h"
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#include "moe/moe_skinny.h"

/* Both sides multiply the same bf16 values; the GPU sums in fp32 and rounds the result to bf16 once
 * (2^-9 relative), far below 1e-2 of the largest output. */
#define TOL 1e-2

static tier_dev *cpu, *gpu;
static tier_rng rng;

static float rnd_bf16(float scale) { return ref_rnd_bf16(&rng, scale); }

static void *up(const void *h, size_t n)
{
	void *d = ref_dev_copy(gpu, h, n);
	assert_non_null(d);
	return d;
}
static void down(void *h, const void *d, size_t n)
{
	if (n)
		assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, n), 0);
}

/* f [rows, cols] as bf16, as it is (tr 0) or transposed to [cols, rows] (tr 1). */
static void *up_bf16(const float *f, size_t rows, size_t cols, int tr)
{
	void *d = tr ? ref_dev_bf16_t(gpu, f, rows, cols) : ref_dev_bf16(gpu, f, rows * cols);
	assert_non_null(d);
	return d;
}

/* ---- a problem: groups, bf16-rounded X and W_j,e on both sides, the fp64 references ---- */
/* W_j,e is held as [r, K] (row c: column c of the product), the w_kn 0 layout; the device also gets
 * it transposed, [K, r], for w_kn 1: both layouts compute the same Z_j = X W_j,e^T. */
typedef struct {
	int E, r, K, rows, rb; /* rb: rows_bound = rows + rows of no group */
	int32_t *off;
	float *x, **w[2];
	double *ref[2];   /* [rows, r] */
	void *dx, *doff;  /* X holds only the rows of the groups: the kernel reads no other */
	void **dw[2][2];  /* [j][w_kn]; NULL for experts without rows, as the callers pass them */
} sprob;

/* Four partial sums break the add chain; the order does not matter at 1e-2. */
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

static void prob_ref(sprob *p)
{
	for (int j = 0; j < 2; j++) {
		p->ref[j] = calloc((size_t)p->rows * p->r + 1, sizeof(double));
		for (int e = 0; e < p->E; e++)
			for (int i = p->off[e]; i < p->off[e + 1]; i++)
				for (int c = 0; c < p->r; c++)
					p->ref[j][(size_t)i * p->r + c] =
						dot(p->x + (size_t)i * p->K, p->w[j][e] + (size_t)c * p->K, p->K);
	}
}

static void prob_make(sprob *p, int E, int r, int K, const int *nrows, int extra)
{
	p->E = E, p->r = r, p->K = K;
	p->off = malloc(4 * (size_t)(E + 1));
	p->off[0] = 0;
	for (int e = 0; e < E; e++)
		p->off[e + 1] = p->off[e] + nrows[e];
	p->rows = p->off[E], p->rb = p->rows + extra;
	size_t xn = (size_t)p->rows * K, wn = (size_t)r * K;
	p->x = malloc(4 * xn + 4);
	for (size_t i = 0; i < xn; i++)
		p->x[i] = rnd_bf16(1.0f);
	for (int j = 0; j < 2; j++) {
		p->w[j] = calloc((size_t)E, sizeof *p->w[j]);
		p->dw[j][0] = calloc((size_t)E, sizeof(void *));
		p->dw[j][1] = calloc((size_t)E, sizeof(void *));
		for (int e = 0; e < E; e++) {
			if (!nrows[e])
				continue;
			p->w[j][e] = malloc(4 * wn);
			for (size_t i = 0; i < wn; i++)
				p->w[j][e][i] = rnd_bf16(0.1f);
			p->dw[j][0][e] = up_bf16(p->w[j][e], r, K, 0);
			p->dw[j][1][e] = up_bf16(p->w[j][e], r, K, 1);
		}
	}
	p->dx = up_bf16(p->x, p->rows, K, 0);
	p->doff = up(p->off, 4 * (size_t)(E + 1));
	prob_ref(p);
}

static void prob_free(sprob *p)
{
	for (int j = 0; j < 2; j++) {
		for (int e = 0; e < p->E; e++) {
			free(p->w[j][e]);
			tier_dev_free(gpu, p->dw[j][0][e]), tier_dev_free(gpu, p->dw[j][1][e]);
		}
		free(p->w[j]), free(p->dw[j][0]), free(p->dw[j][1]), free(p->ref[j]);
	}
	tier_dev_free(gpu, p->dx), tier_dev_free(gpu, p->doff);
	free(p->off), free(p->x);
}

/* ---- one call and its checks ---- */
/* The row tile knob of moe_skinny.h; NULL unsets (the group runs with it unset, the run's own
 * setting kept in rows_kept and put back at its end). */
static env_keep rows_kept;

static void rows_knob(const char *v) { env_put("TIER_MOE_SKINNY_ROWS", v); }

/* Bytes [from, to) of got still hold the poison 0xff. */
static void untouched(const unsigned char *got, size_t from, size_t to, const char *buf, const char *what)
{
	for (size_t i = from; i < to; i++) {
		if (got[i] != 0xff)
			fprintf(stderr, "# %s: byte %zu of %s, which must not be written, changed\n", what, i, buf);
		assert_int_equal(got[i], 0xff);
	}
}

/* Z_j (bf16, rb + 1 rows: the last a guard past rows_bound) poisoned with 0xff (NaN); one call; the
 * rows of the groups against alpha ref_j, every other byte unchanged. With nw 1, z1 is passed as well
 * and must stay as it was. */
static void run_one(const sprob *p, int nw, int w_kn, float alpha, const char *what)
{
	size_t n = (size_t)p->rows * p->r, bytes = 2 * (size_t)(p->rb + 1) * p->r;
	unsigned char *poison = malloc(bytes), *got = malloc(bytes);
	memset(poison, 0xff, bytes);
	void *dz[2] = { up(poison, bytes), up(poison, bytes) };
	assert_int_equal(moe_cuda_grouped_skinny(gpu, p->E, p->r, p->K, p->doff, p->rb, nw,
						 (const void *const *)p->dw[0][w_kn], (const void *const *)p->dw[1][w_kn],
						 w_kn, p->dx, dz[0], dz[1], alpha),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	float *g = malloc(4 * n + 4);
	double *want = malloc(8 * n + 8);
	for (int j = 0; j < 2; j++) {
		char buf[8];
		snprintf(buf, sizeof buf, "z%d", j);
		down(got, dz[j], bytes);
		if (j >= nw) {
			untouched(got, 0, bytes, buf, what);
			continue;
		}
		for (size_t i = 0; i < n; i++) {
			uint16_t b;
			memcpy(&b, got + 2 * i, 2);
			g[i] = tier_bf16_to_f32(b);
			want[i] = alpha * p->ref[j][i];
		}
		double err = ref_relerr(g, want, n);
		if (!(err <= TOL))
			fprintf(stderr, "# %s: %s relative error %g > %g\n", what, buf, err, TOL);
		assert_true(err <= TOL);
		untouched(got, 2 * n, bytes, buf, what);
	}
	tier_dev_free(gpu, dz[0]), tier_dev_free(gpu, dz[1]);
	free(poison), free(got), free(g), free(want);
}

/* Both layouts, one and two products, on both row tiles (the default 64 and 128). */
static void run_all(const sprob *p)
{
	static const char *tiles[] = { NULL, "128" };
	char what[160];
	for (size_t t = 0; t < sizeof tiles / sizeof tiles[0]; t++) {
		rows_knob(tiles[t]);
		for (int kn = 0; kn < 2; kn++)
			for (int nw = 1; nw <= 2; nw++) {
				float alpha = nw == 1 ? 1.0f : 0.37f;
				snprintf(what, sizeof what, "E %d r %d K %d rows %d rows_bound %d w_kn %d nw %d tile %s",
					 p->E, p->r, p->K, p->rows, p->rb, kn, nw, tiles[t] ? tiles[t] : "default");
				run_one(p, nw, kn, alpha, what);
			}
	}
	rows_knob(NULL);
}

static void run_case(int E, int r, int K, const int *nrows, int extra)
{
	sprob p;
	prob_make(&p, E, r, K, nrows, extra);
	run_all(&p);
	prob_free(&p);
}

/* ---- the cases ---- */
/* Every rank class (padded to 16 columns, or not) with K = 8 (one partial stage), 72 (a full stage
 * and 8 k), 776 and 2056; 8 uneven groups: empty first and inner, one row, sizes around the 64- and
 * 128-row tile edges. */
static void test_shapes(void **state)
{
	(void)state;
	static const int n[] = { 0, 1, 130, 64, 0, 65, 200, 7 }, ranks[] = { 8, 16, 24, 32, 48, 64 },
			 ks[] = { 8, 72, 776, 2056 };
	for (size_t i = 0; i < sizeof ranks / sizeof ranks[0]; i++)
		for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++)
			run_case(8, ranks[i], ks[k], n, 5);
}

/* One expert: a single row, and 1000 rows (several tiles, the last partial). */
static void test_one_expert(void **state)
{
	(void)state;
	static const int one[] = { 1 }, many[] = { 1000 };
	run_case(1, 16, 776, one, 0);
	run_case(1, 32, 72, many, 37);
}

/* 128 experts, every row to expert 77: all the other groups empty. */
static void test_all_to_one(void **state)
{
	(void)state;
	int n[128] = { 0 };
	n[77] = 600;
	run_case(128, 16, 2056, n, 3);
}

/* 128 experts of 0-149 rows, a few forced empty or single. */
static void test_128_experts(void **state)
{
	(void)state;
	int n[128];
	for (int e = 0; e < 128; e++)
		n[e] = (int)tier_rng_below(&rng, 150);
	n[0] = 0, n[1] = 1, n[63] = 0, n[64] = 64, n[127] = 0;
	run_case(128, 16, 776, n, 11);
}

/* 896 and 1024 experts (7 and 8 per thread in the tile scan), mostly 0-5 rows, one group of several
 * tiles, the last expert empty. */
static void test_many_experts(void **state)
{
	(void)state;
	static const int Es[] = { 896, 1024 };
	int *n = malloc(sizeof(int) * 1024);
	for (size_t i = 0; i < sizeof Es / sizeof Es[0]; i++) {
		int E = Es[i];
		for (int e = 0; e < E; e++)
			n[e] = (int)tier_rng_below(&rng, 6);
		n[0] = 0, n[383] = 0, n[500] = 200, n[E - 1] = 0;
		run_case(E, i ? 64 : 32, i ? 136 : 72, n, 7);
	}
	free(n);
}

/* No rows at all: every CTA finds no tile (rows_bound 9) or nothing is launched (rows_bound 0). */
static void test_no_rows(void **state)
{
	(void)state;
	static const int none[] = { 0, 0, 0, 0 };
	run_case(4, 16, 72, none, 9);
	run_case(4, 8, 8, none, 0);
}

/* What the host refuses, before any launch: each call returns -EINVAL (-ENOTSUP on a CPU context)
 * and the poisoned outputs stay as they were. */
static void test_bad_input(void **state)
{
	(void)state;
	static const int n[] = { 3, 0, 5 };
	sprob p;
	prob_make(&p, 3, 16, 72, n, 0);
	size_t bytes = 2 * (size_t)p.rows * p.r;
	unsigned char *poison = malloc(bytes), *got = malloc(bytes);
	memset(poison, 0xff, bytes);
	void *z0 = up(poison, bytes), *z1 = up(poison, bytes), *o = p.doff, *x = p.dx;
	const void *const *w0 = (const void *const *)p.dw[0][0], *const *w1 = (const void *const *)p.dw[1][0];
	const void *wodd[3] = { w0[0], (const char *)w0[0] + 8, NULL };
	const char *odd = (const char *)z0 + 8;
#define BAD(rc, E, r, K, off, rb, nw, a0, a1, kn, xx, y0, y1, alpha)                                            \
	assert_int_equal(moe_cuda_grouped_skinny(gpu, E, r, K, off, rb, nw, a0, a1, kn, xx, y0, y1, alpha), rc)
	BAD(-EINVAL, 0, 16, 72, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);    /* E */
	BAD(-EINVAL, 1025, 16, 72, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 12, 72, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);    /* r % 8 */
	BAD(-EINVAL, 3, 0, 72, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);     /* r */
	BAD(-EINVAL, 3, 72, 72, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);    /* r > 64 */
	BAD(-EINVAL, 3, 16, 76, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);    /* K % 8 */
	BAD(-EINVAL, 3, 16, 0, o, 8, 2, w0, w1, 0, x, z0, z1, 1.0f);     /* K */
	BAD(-EINVAL, 3, 16, 72, o, 8, 3, w0, w1, 0, x, z0, z1, 1.0f);    /* nw */
	BAD(-EINVAL, 3, 16, 72, o, 8, 0, w0, w1, 0, x, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 2, x, z0, z1, 1.0f);    /* w_kn */
	BAD(-EINVAL, 3, 16, 72, o, -1, 2, w0, w1, 0, x, z0, z1, 1.0f);   /* rows_bound */
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, z0, z1, NAN);     /* alpha */
	BAD(-EINVAL, 3, 16, 72, NULL, 8, 2, w0, w1, 0, x, z0, z1, 1.0f); /* NULL pointers */
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, NULL, w1, 0, x, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, NULL, 0, x, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, NULL, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, NULL, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, z0, NULL, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, wodd, w1, 0, x, z0, z1, 1.0f);  /* misaligned */
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, wodd, 0, x, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, (const char *)x + 8, z0, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, (void *)odd, z1, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, z0, (void *)odd, 1.0f);
	BAD(-EINVAL, 3, 16, 72, o, 8, 2, w0, w1, 0, x, z0, z0, 1.0f);    /* one buffer for both */
#undef BAD
	rows_knob("96"); /* a malformed knob */
	assert_int_equal(moe_cuda_grouped_skinny(gpu, 3, 16, 72, o, 8, 1, w0, NULL, 0, x, z0, NULL, 1.0f), -EINVAL);
	rows_knob(NULL);
	assert_int_equal(moe_cuda_grouped_skinny(cpu, 3, 16, 72, o, 8, 1, w0, NULL, 0, x, z0, NULL, 1.0f), -ENOTSUP);
	assert_int_equal(moe_cuda_grouped_skinny(NULL, 3, 16, 72, o, 8, 1, w0, NULL, 0, x, z0, NULL, 1.0f), -EINVAL);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, z0, bytes);
	untouched(got, 0, bytes, "z0", "bad arguments");
	down(got, z1, bytes);
	untouched(got, 0, bytes, "z1", "bad arguments");
	/* nw 1 ignores w1 and z1: NULL is fine */
	assert_int_equal(moe_cuda_grouped_skinny(gpu, 3, 16, 72, o, 8, 1, w0, NULL, 0, x, z0, NULL, 1.0f), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	tier_dev_free(gpu, z0), tier_dev_free(gpu, z1);
	free(poison), free(got);
	prob_free(&p);
}

/* ---- TIER_SKINNY_BENCH=1: the model's shape, timed ---- */
#define BENCH_ROWS 32768
#define BENCH_K 2048
#define BENCH_E 128
#define BENCH_R 16
#define BENCH_WARM 3
#define BENCH_RUNS 20

typedef struct {
	void *x, *z[2], *doff;
	void *w[2][BENCH_E];
	cudaEvent_t e0, e1;
} bench_bufs;

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

/* One pass over X: a call with nw 2, or (split) two calls with nw 1. */
static void bench_pass(bench_bufs *b, int split)
{
	if (!split) {
		assert_int_equal(moe_cuda_grouped_skinny(gpu, BENCH_E, BENCH_R, BENCH_K, b->doff, BENCH_ROWS, 2,
							 (const void *const *)b->w[0], (const void *const *)b->w[1], 0,
							 b->x, b->z[0], b->z[1], 1.0f),
				 0);
		return;
	}
	for (int j = 0; j < 2; j++)
		assert_int_equal(moe_cuda_grouped_skinny(gpu, BENCH_E, BENCH_R, BENCH_K, b->doff, BENCH_ROWS, 1,
							 (const void *const *)b->w[j], NULL, 0, b->x, b->z[j], NULL,
							 1.0f),
				 0);
}

/* The median of BENCH_RUNS timed passes after BENCH_WARM untimed ones, in milliseconds. */
static float bench_median(bench_bufs *b, int split)
{
	cudaStream_t s = (cudaStream_t)tier_dev_stream(gpu);
	float ms[BENCH_RUNS];
	for (int i = 0; i < BENCH_WARM; i++)
		bench_pass(b, split);
	for (int i = 0; i < BENCH_RUNS; i++) {
		assert_int_equal(cudaEventRecord(b->e0, s), cudaSuccess);
		bench_pass(b, split);
		assert_int_equal(cudaEventRecord(b->e1, s), cudaSuccess);
		assert_int_equal(cudaEventSynchronize(b->e1), cudaSuccess);
		assert_int_equal(cudaEventElapsedTime(&ms[i], b->e0, b->e1), cudaSuccess);
	}
	qsort(ms, BENCH_RUNS, sizeof ms[0], cmp_float);
	return (ms[BENCH_RUNS / 2 - 1] + ms[BENCH_RUNS / 2]) / 2;
}

static void bench_alloc(bench_bufs *b)
{
	size_t xn = (size_t)BENCH_ROWS * BENCH_K, wn = (size_t)BENCH_R * BENCH_K;
	uint16_t *h = malloc(2 * xn);
	for (size_t i = 0; i < xn; i++) /* any finite values: the time does not depend on them */
		h[i] = tier_f32_to_bf16((float)((int)(i % 17) - 8) * 0.125f);
	b->x = up(h, 2 * xn);
	for (int j = 0; j < 2; j++) {
		b->z[j] = up(NULL, 2 * (size_t)BENCH_ROWS * BENCH_R);
		for (int e = 0; e < BENCH_E; e++)
			b->w[j][e] = up(h + (size_t)(2 * e + j) * wn, 2 * wn);
	}
	free(h);
	int32_t off[BENCH_E + 1];
	for (int e = 0; e <= BENCH_E; e++)
		off[e] = e * (BENCH_ROWS / BENCH_E);
	b->doff = up(off, sizeof off);
	assert_int_equal(cudaEventCreate(&b->e0), cudaSuccess);
	assert_int_equal(cudaEventCreate(&b->e1), cudaSuccess);
}

static void bench_free(bench_bufs *b)
{
	tier_dev_free(gpu, b->x), tier_dev_free(gpu, b->doff);
	for (int j = 0; j < 2; j++) {
		tier_dev_free(gpu, b->z[j]);
		for (int e = 0; e < BENCH_E; e++)
			tier_dev_free(gpu, b->w[j][e]);
	}
	cudaEventDestroy(b->e0), cudaEventDestroy(b->e1);
}

/* The bandwidth model: a pass must read X (rows x K bf16) once; X_GB/s is those bytes over the
 * time, read_GB/s the bytes of X actually read (twice when split). W (2 x 1 MiB) and Z are small. */
static void test_bench(void **state)
{
	(void)state;
	const char *v = getenv("TIER_SKINNY_BENCH");
	if (!v || strcmp(v, "1"))
		return;
	static const char *tiles[] = { "64", "128" };
	bench_bufs b;
	bench_alloc(&b);
	double xbytes = 2.0 * BENCH_ROWS * BENCH_K;
	printf("# moe_cuda_grouped_skinny on %s: rows %d, K %d, E %d (%d rows each), r %d, w_kn 0\n",
	       tier_dev_name(gpu), BENCH_ROWS, BENCH_K, BENCH_E, BENCH_ROWS / BENCH_E, BENCH_R);
	printf("# median of %d after %d warm-up passes\n", BENCH_RUNS, BENCH_WARM);
	printf("%-6s %-10s %10s %10s %10s\n", "tile", "pass", "time", "X", "read");
	printf("%-6s %-10s %10s %10s %10s\n", "rows", "", "us", "GB/s", "GB/s");
	for (size_t t = 0; t < sizeof tiles / sizeof tiles[0]; t++) {
		rows_knob(tiles[t]);
		for (int split = 0; split < 2; split++) {
			double us = 1e3 * bench_median(&b, split);
			printf("%-6s %-10s %10.1f %10.1f %10.1f\n", tiles[t], split ? "2 x nw 1" : "nw 2", us,
			       xbytes / us * 1e-3, xbytes * (split ? 2 : 1) / us * 1e-3);
		}
	}
	rows_knob(NULL);
	fflush(stdout);
	bench_free(&b);
}

static int setup(void **state)
{
	(void)state;
	tier_rng_seed(&rng, ref_seed("test_moe_skinny"));
	env_set(&rows_kept, "TIER_MOE_SKINNY_ROWS", NULL);
	return tier_dev_open(&cpu, TIER_DEV_CPU, 0);
}

static int teardown(void **state)
{
	(void)state;
	env_back(&rows_kept);
	tier_dev_close(cpu);
	return 0;
}
#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	int rc = ref_gpu_open("test_moe_skinny", &gpu);
	if (rc)
		return rc;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes),
		cmocka_unit_test(test_one_expert),
		cmocka_unit_test(test_all_to_one),
		cmocka_unit_test(test_128_experts),
		cmocka_unit_test(test_many_experts),
		cmocka_unit_test(test_no_rows),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_bench),
	};
	rc = cmocka_run_group_tests(tests, setup, teardown);
	tier_dev_close(gpu);
	return rc;
#else
	fprintf(stderr, "# test_moe_skinny: built without CUDA, skipped\n");
	return 77;
#endif
}
