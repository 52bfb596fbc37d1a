/* test_loss.c - the CPU loss against a naive fp64 loss and gradient: shapes, chunk and block sweeps,
 * ignored labels, extreme logits, options, filtering, the fused pass, planning and bad input. */
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
#include "loss_ref.h"
#define SEEDED_CPU_TEST "test_loss" /* seeded_cpu.h: cpu, rng and seed, set up for the group */
#include "seeded_cpu.h"

#define TOL 1e-6

/* One problem: fp32 inputs, the fp64 reference, and poisoned outputs of the code under test. */
typedef struct {
	tier_loss_params p;
	float *H, *W, *lse, *dH, *dW, loss;
	int32_t *labels;
	int64_t count;
	double *rlse, *rdH, *rdW, rloss;
	int64_t rcount;
	double tol_dH, tol_dW;               /* grad_tol's, for this reference */
	void *ws;
	size_t ws_bytes;
} problem;

static void fill(float *x, size_t n, float scale)
{
	for (size_t i = 0; i < n; i++)
		x[i] = scale * tier_rng_normal(&rng);
}

static void poison(problem *q)
{
	const tier_loss_params *p = &q->p;
	memset(q->lse, 0xff, (size_t)p->N * sizeof *q->lse);        /* NaN */
	memset(q->dH, 0xff, (size_t)(p->N * p->D) * sizeof *q->dH);
	memset(q->dW, 0xff, (size_t)(p->V * p->D) * sizeof *q->dW);
	q->loss = NAN, q->count = -1;
}

/* ignore_pct: share of labels set to the ignore index. */
static problem *problem_new(int64_t N, int64_t V, int64_t D, int ignore_pct, float hscale)
{
	problem *q = calloc(1, sizeof *q);
	tier_loss_params_init(&q->p, N, V, D);
	q->H = malloc((size_t)(N * D) * sizeof(float));
	q->W = malloc((size_t)(V * D) * sizeof(float));
	q->lse = malloc((size_t)N * sizeof(float));
	q->dH = malloc((size_t)(N * D) * sizeof(float));
	q->dW = malloc((size_t)(V * D) * sizeof(float));
	q->labels = malloc((size_t)N * sizeof(int32_t));
	q->rlse = malloc((size_t)N * sizeof(double));
	q->rdH = malloc((size_t)(N * D) * sizeof(double));
	q->rdW = malloc((size_t)(V * D) * sizeof(double));
	fill(q->H, (size_t)(N * D), hscale);
	fill(q->W, (size_t)(V * D), 1.0f / sqrtf((float)D));
	for (int64_t i = 0; i < N; i++)
		q->labels[i] = (int)tier_rng_below(&rng, 100) < ignore_pct ? -100 : (int32_t)tier_rng_below(&rng, (uint64_t)V);
	return q;
}

static void problem_free(problem *q)
{
	free(q->H), free(q->W), free(q->lse), free(q->dH), free(q->dW), free(q->labels);
	free(q->rlse), free(q->rdH), free(q->rdW), free(q->ws), free(q);
}

static double norm2(const double *x, size_t n)
{
	double s = 0;
	for (size_t i = 0; i < n; i++)
		s += x[i] * x[i];
	return sqrt(s);
}

/* Normwise relative tolerance of a gradient whose error from the fp32 lse is at most e (absolute).
 *
 * The backward reads lse as the forward rounded it to fp32, off by up to u |lse_i| (u = 2^-24),
 * and that shift of every log-probability of token i is the one rounding the gradient does not
 * damp: dl/dz_iy = p_iy - 1 shrinks as the token is predicted confidently, while the error
 * -d_i p_iy w_y it causes does not. Token i alone: relative error ~ u |lse_i| p_iy / (1 - p_iy),
 * 2.6e-7 * 0.88 / 0.12 = 1.9e-6 for lse 4.34 and p_iy 0.88 (seed 520's N=1, V=7 case; measured
 * 1.15e-6). loss_ref_lse_bound bounds this part exactly (first order in d_i, which is tight).
 *
 * TOL covers the rest, all of it relative to |dl/dx_iv| rather than to p_iv: the fp32 tile
 * products and softcap move z_iv - lse_i by z_iv's error minus the p-weighted mean of all of them,
 * which carries a (1 - p_iv) factor where p_iv is near 1; the fp32 rounding of the scaled dlogits
 * and their fp32 sums are relative to |dl/dx_iv| by construction. (Measured over 2000 seeds, the
 * whole error stays below 0.35 of TOL plus the lse term, including logits of 1e3.) */
static double grad_tol(double e, const double *ref, size_t n)
{
	double r = norm2(ref, n);
	return TOL + (r > 0 ? e / r : e);       /* loss_rel_err is absolute for a zero reference */
}

static void reference(problem *q, double dloss)
{
	const tier_loss_params *p = &q->p;
	double eh, ew;
	q->rloss = loss_ref(p, q->H, q->W, q->labels, dloss, q->rlse, &q->rcount, q->rdH, q->rdW);
	loss_ref_lse_bound(p, q->H, q->W, q->labels, dloss, q->rlse, &eh, &ew);
	q->tol_dH = grad_tol(eh, q->rdH, (size_t)(p->N * p->D));
	q->tol_dW = grad_tol(ew, q->rdW, (size_t)(p->V * p->D));
}

static void workspace(problem *q)
{
	assert_int_equal(tier_loss_workspace_bytes(&q->p, TIER_DEV_CPU, &q->ws_bytes), 0);
	free(q->ws);
	q->ws = malloc(q->ws_bytes);
	memset(q->ws, 0xff, q->ws_bytes);
}

static double rel_scalar(double a, double ref)
{
	return ref == 0 ? fabs(a) : fabs(a - ref) / fabs(ref);
}

static void check_fwd(const problem *q)
{
	double e = 0;
	assert_int_equal(q->count, q->rcount);
	assert_false(isnan(q->loss));
	assert_true(rel_scalar(q->loss, q->rloss) <= TOL);
	for (int64_t i = 0; i < q->p.N; i++)
		e = fmax(e, rel_scalar(q->lse[i], q->rlse[i]));
	assert_true(e <= TOL);
}

static void check_grad(const char *name, double e, double tol, const problem *q)
{
	if (e > tol)
		print_message("%s rel err %.3g > tol %.3g (N=%lld V=%lld D=%lld chunk=%lld block=%lld)\n", name, e, tol,
			      (long long)q->p.N, (long long)q->p.V, (long long)q->p.D, (long long)q->p.chunk_tokens,
			      (long long)q->p.block_vocab);
	assert_true(e <= tol);
}

static void check_bwd(const problem *q, int with_dw)
{
	check_grad("dH", loss_rel_err(q->dH, q->rdH, (size_t)(q->p.N * q->p.D)), q->tol_dH, q);
	if (with_dw)
		check_grad("dW", loss_rel_err(q->dW, q->rdW, (size_t)(q->p.V * q->p.D)), q->tol_dW, q);
}

/* Forward, backward (with and without dW) and the fused pass, each against the reference. */
static void run_all(problem *q, float dloss)
{
	tier_loss_params *p = &q->p;
	workspace(q);
	poison(q);
	assert_int_equal(tier_loss_fwd(cpu, p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), 0);
	check_fwd(q);
	memset(q->dH, 0xff, (size_t)(p->N * p->D) * sizeof *q->dH);
	assert_int_equal(tier_loss_bwd(cpu, p, q->H, q->W, q->labels, q->lse, dloss, q->dH, q->dW, q->ws, q->ws_bytes), 0);
	check_bwd(q, 1);
	memset(q->dH, 0xff, (size_t)(p->N * p->D) * sizeof *q->dH);
	assert_int_equal(tier_loss_bwd(cpu, p, q->H, q->W, q->labels, q->lse, dloss, q->dH, NULL, q->ws, q->ws_bytes), 0);
	check_bwd(q, 0);
	poison(q);
	assert_int_equal(tier_loss_fwd_bwd(cpu, p, q->H, q->W, q->labels, dloss, q->lse, &q->loss, &q->count,
					   q->dH, q->dW, q->ws, q->ws_bytes), 0);
	check_fwd(q);
	check_bwd(q, 1);
}

static void test_sweep_chunks_and_blocks(void **state)
{
	static const int64_t shapes[][3] = { { 1, 1, 1 }, { 1, 7, 5 }, { 9, 13, 6 }, { 12, 37, 16 } };
	(void)state;
	for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
		problem *q = problem_new(shapes[s][0], shapes[s][1], shapes[s][2], 20, 1.0f);
		q->p.reduction = s % 2 ? TIER_LOSS_SUM : TIER_LOSS_MEAN;
		reference(q, 0.75);
		for (int64_t c = 1; c <= q->p.N; c++)
			for (int64_t b = 1; b <= q->p.V; b++) {
				q->p.chunk_tokens = c, q->p.block_vocab = b;
				run_all(q, 0.75f);
			}
		problem_free(q);
	}
}

static void test_odd_vocab_and_large(void **state)
{
	problem *q = problem_new(70, 1001, 48, 10, 1.0f);
	(void)state;
	reference(q, 1.0);
	q->p.chunk_tokens = 16, q->p.block_vocab = 128;       /* V is not a multiple of the block */
	run_all(q, 1.0f);
	q->p.chunk_tokens = 0, q->p.block_vocab = 0;          /* automatic */
	run_all(q, 1.0f);
	problem_free(q);
}

static void test_single_token(void **state)
{
	problem *q = problem_new(1, 301, 33, 0, 1.0f);
	(void)state;
	reference(q, 1.0);
	q->p.block_vocab = 64;
	run_all(q, 1.0f);
	problem_free(q);
}

static void test_all_ignored(void **state)
{
	problem *q = problem_new(11, 50, 8, 100, 1.0f);
	(void)state;
	reference(q, 1.0);
	q->p.chunk_tokens = 4, q->p.block_vocab = 16;
	run_all(q, 1.0f);
	assert_true(q->loss == 0.0f && q->count == 0);
	for (int64_t i = 0; i < q->p.N * q->p.D; i++)
		assert_true(q->dH[i] == 0.0f);
	for (int64_t i = 0; i < q->p.V * q->p.D; i++)
		assert_true(q->dW[i] == 0.0f);
	q->p.ignore_index = 7;                                 /* another ignore index works the same */
	for (int64_t i = 0; i < q->p.N; i++)
		q->labels[i] = 7;
	reference(q, 1.0);
	run_all(q, 1.0f);
	assert_true(q->count == 0 && q->loss == 0.0f);
	problem_free(q);
}

static void test_extreme_logits(void **state)
{
	problem *q = problem_new(20, 97, 24, 0, 1000.0f);       /* logits of about +-1e3 */
	(void)state;
	reference(q, 1.0);
	q->p.chunk_tokens = 7, q->p.block_vocab = 10;
	run_all(q, 1.0f);
	assert_true(q->loss > 100);
	problem_free(q);
	q = problem_new(9, 64, 8, 0, 0.0f);                    /* all logits equal: H = 0 */
	reference(q, 1.0);
	q->p.chunk_tokens = 4, q->p.block_vocab = 9;
	run_all(q, 1.0f);
	assert_true(fabs(q->loss - log(64.0)) < 1e-5);
	problem_free(q);
}

static void test_options(void **state)
{
	(void)state;
	for (int o = 0; o < 4; o++) {
		problem *q = problem_new(17, 83, 20, 15, o == 2 ? 4.0f : 1.0f);
		q->p.z_loss = o == 0 || o == 3 ? 1e-2f : 0;
		q->p.label_smoothing = o == 1 || o == 3 ? 0.1f : 0;
		q->p.softcap = o == 2 || o == 3 ? 5.0f : 0;
		reference(q, 1.0);
		q->p.chunk_tokens = 5, q->p.block_vocab = 19;
		run_all(q, 1.0f);
		problem_free(q);
	}
}

/* The reference's gradient against central differences of its own loss, in double. */
static void test_reference_gradient(void **state)
{
	problem *q = problem_new(3, 11, 4, 0, 1.0f);
	double *lse = malloc(3 * sizeof *lse);
	int64_t n;
	(void)state;
	q->p.z_loss = 0.05f, q->p.label_smoothing = 0.2f, q->p.softcap = 2.0f;
	reference(q, 1.0);
	for (int64_t k = 0; k < 12; k++) {
		float keep = q->H[k], h = 1e-2f;
		double up, down;
		q->H[k] = keep + h;
		up = loss_ref(&q->p, q->H, q->W, q->labels, 1, lse, &n, NULL, NULL);
		q->H[k] = keep - h;
		down = loss_ref(&q->p, q->H, q->W, q->labels, 1, lse, &n, NULL, NULL);
		q->H[k] = keep;
		assert_true(fabs((up - down) / (2.0 * h) - q->rdH[k]) < 1e-3);
	}
	free(lse);
	problem_free(q);
}

/* Filtering changes dH by at most scale * sum of skipped |dlogit| * |w_v| (docs/loss.md). */
static void test_filtering_bound(void **state)
{
	problem *q = problem_new(16, 400, 12, 0, 3.0f);
	double err = 0, bound, wmax = 0;
	float eps = 1e-3f;
	(void)state;
	reference(q, 1.0);
	q->p.chunk_tokens = 4, q->p.block_vocab = 25, q->p.filter_eps = eps;
	workspace(q);
	poison(q);
	assert_int_equal(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), 0);
	assert_int_equal(tier_loss_bwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, 1.0f, q->dH, q->dW, q->ws, q->ws_bytes), 0);
	for (int64_t v = 0; v < q->p.V; v++) {
		double n2 = 0;
		for (int64_t k = 0; k < q->p.D; k++)
			n2 += (double)q->W[v * q->p.D + k] * q->W[v * q->p.D + k];
		wmax = fmax(wmax, sqrt(n2));
	}
	for (int64_t i = 0; i < q->p.N; i++) {
		double d2 = 0;
		for (int64_t k = 0; k < q->p.D; k++) {
			double d = q->dH[i * q->p.D + k] - q->rdH[i * q->p.D + k];
			d2 += d * d;
		}
		err = fmax(err, sqrt(d2));
	}
	bound = 1.0 / q->rcount * fmin(1.0, eps * q->p.V) * wmax + 1e-6;
	print_message("filtering eps %g: max row error of dH %.3g, bound %.3g\n", eps, err, bound);
	assert_true(err <= bound);
	assert_true(err > 0);                                   /* some tiles were skipped */
	problem_free(q);
}

static void test_fused_equals_separate(void **state)
{
	problem *q = problem_new(30, 211, 16, 10, 2.0f);
	float *dH1 = malloc(30 * 16 * sizeof *dH1), *dW1 = malloc(211 * 16 * sizeof *dW1), *lse1 = malloc(30 * sizeof *lse1);
	float loss1;
	(void)state;
	for (int64_t b = 50; b <= 211; b += 161) {              /* split vocabulary, then a whole one */
		q->p.chunk_tokens = 8, q->p.block_vocab = b;
		workspace(q);
		poison(q);
		assert_int_equal(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), 0);
		assert_int_equal(tier_loss_bwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, 1.0f, q->dH, q->dW, q->ws, q->ws_bytes), 0);
		memcpy(dH1, q->dH, 30 * 16 * sizeof *dH1), memcpy(dW1, q->dW, 211 * 16 * sizeof *dW1);
		memcpy(lse1, q->lse, 30 * sizeof *lse1), loss1 = q->loss;
		poison(q);
		assert_int_equal(tier_loss_fwd_bwd(cpu, &q->p, q->H, q->W, q->labels, 1.0f, q->lse, &q->loss, &q->count,
						   q->dH, q->dW, q->ws, q->ws_bytes), 0);
		assert_memory_equal(dH1, q->dH, 30 * 16 * sizeof *dH1);
		assert_memory_equal(dW1, q->dW, 211 * 16 * sizeof *dW1);
		assert_memory_equal(lse1, q->lse, 30 * sizeof *lse1);
		assert_true(loss1 == q->loss);
	}
	free(dH1), free(dW1), free(lse1);
	problem_free(q);
}

static void test_plan(void **state)
{
	tier_loss_params p;
	int64_t c = -1, b = -1;
	size_t bytes;
	(void)state;
	tier_loss_params_init(&p, 8192, 256000, 2304);
	assert_int_equal(tier_loss_plan(&p, TIER_DEV_CUDA, 400ull << 20, &c, &b), 0);
	assert_true(b == 256000 && c >= 128 && c % 128 == 0);     /* whole vocabulary, chunked tokens */
	p.chunk_tokens = c, p.block_vocab = b;
	assert_int_equal(tier_loss_workspace_bytes(&p, TIER_DEV_CUDA, &bytes), 0);
	assert_true(bytes <= 400ull << 20);
	tier_loss_params_init(&p, 8192, 256000, 2304);           /* small bound: the vocabulary is split */
	assert_int_equal(tier_loss_plan(&p, TIER_DEV_CUDA, 16ull << 20, &c, &b), 0);
	assert_true(c == 64 && b < 256000 && b % 128 == 0);
	p.chunk_tokens = c, p.block_vocab = b;
	assert_int_equal(tier_loss_workspace_bytes(&p, TIER_DEV_CUDA, &bytes), 0);
	assert_true(bytes <= 16ull << 20);
	tier_loss_params_init(&p, 100, 1000, 64);                /* overrides are kept */
	p.block_vocab = 100;
	assert_int_equal(tier_loss_plan(&p, TIER_DEV_CPU, 1ull << 20, &c, &b), 0);
	assert_true(b == 100 && c == 100);
	c = b = 5;
	assert_int_equal(tier_loss_plan(&p, TIER_DEV_CPU, 64, &c, &b), -ENOSPC);
	assert_true(c == 5 && b == 5);                           /* untouched on failure */
	assert_non_null(strstr(tier_last_error(), "memory bound"));
}

static void test_bad_input(void **state)
{
	problem *q = problem_new(4, 10, 3, 0, 1.0f);
	tier_loss_params p;
	(void)state;
	workspace(q);
#define BAD(call, code, word)                                                  \
	do {                                                                   \
		assert_int_equal((call), (code));                              \
		assert_non_null(strstr(tier_last_error(), (word)));            \
	} while (0)
	p = q->p, p.N = 0;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "N=0");
	p = q->p, p.D = -3;
	BAD(tier_loss_workspace_bytes(&p, TIER_DEV_CPU, &q->ws_bytes), -EINVAL, "D=-3");
	q->labels[2] = 10;
	BAD(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "label 10");
	q->labels[2] = -1;
	BAD(tier_loss_fwd_bwd(cpu, &q->p, q->H, q->W, q->labels, 1, q->lse, &q->loss, &q->count, q->dH, NULL, q->ws, q->ws_bytes), -EINVAL, "label -1");
	q->labels[2] = 0;
	BAD(tier_loss_fwd(cpu, &q->p, NULL, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "NULL");
	BAD(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, NULL, &q->count, q->ws, q->ws_bytes), -EINVAL, "loss and count");
	BAD(tier_loss_bwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, 1, NULL, NULL, q->ws, q->ws_bytes), -EINVAL, "dH");
	BAD(tier_loss_bwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, NAN, q->dH, NULL, q->ws, q->ws_bytes), -EINVAL, "dloss");
	BAD(tier_loss_fwd(NULL, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "device");
	BAD(tier_loss_fwd(cpu, NULL, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "params");
	BAD(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, 16), -ENOSPC, "memory bound");
	q->p.chunk_tokens = 4, q->p.block_vocab = 10;
	BAD(tier_loss_fwd(cpu, &q->p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, 300), -ENOSPC, "memory bound");
	p = q->p, p.label_smoothing = 1.0f;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "label_smoothing");
	p = q->p, p.z_loss = -1;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "z_loss");
	p = q->p, p.softcap = NAN;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "softcap");
	p = q->p, p.reduction = (tier_loss_reduction)7;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "reduction");
	p = q->p, p.chunk_tokens = -2;
	BAD(tier_loss_fwd(cpu, &p, q->H, q->W, q->labels, q->lse, &q->loss, &q->count, q->ws, q->ws_bytes), -EINVAL, "chunk_tokens");
	p = q->p, p.filter_eps = 2;
	BAD(tier_loss_bwd(cpu, &p, q->H, q->W, q->labels, q->lse, 1, q->dH, NULL, q->ws, q->ws_bytes), -EINVAL, "filter_eps");
#undef BAD
	problem_free(q);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_reference_gradient),
		cmocka_unit_test(test_sweep_chunks_and_blocks),
		cmocka_unit_test(test_odd_vocab_and_large),
		cmocka_unit_test(test_single_token),
		cmocka_unit_test(test_all_ignored),
		cmocka_unit_test(test_extreme_logits),
		cmocka_unit_test(test_options),
		cmocka_unit_test(test_filtering_bound),
		cmocka_unit_test(test_fused_equals_separate),
		cmocka_unit_test(test_plan),
		cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, seeded_cpu_setup, seeded_cpu_teardown);
}
