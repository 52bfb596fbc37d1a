/* test_attn.c - CPU attention and RoPE against a naive fp64 attention (materialised scores, masked
 * fp64 softmax, analytic gradients), central finite differences, a direct fp64 RoPE, sequence
 * independence and bad input. */
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
#define SEEDED_CPU_TEST "test_attn" /* seeded_cpu.h: cpu, rng and seed, set up for the group */
#include "seeded_cpu.h"

#define TOL 1e-5

typedef struct {
	tier_attn_params p;
	size_t nq, nk;                       /* elements of q (= o) and of k (= v) */
	float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv, *ws;
	size_t ws_bytes;
	double *ro, *rlse, *rdq, *rdk, *rdv;
} problem;

static void fill(float *x, size_t n, float sd)
{
	for (size_t i = 0; i < n; i++)
		x[i] = sd * tier_rng_normal(&rng);
}

static problem *problem_new(int64_t B, int64_t S, int64_t H, int64_t KH, int64_t D, int causal)
{
	problem *t = calloc(1, sizeof *t);
	tier_attn_params_init(&t->p, B, S, H, KH, D);
	t->p.causal = causal;
	t->nq = (size_t)(B * S * H * D), t->nk = (size_t)(B * S * KH * D);
	t->q = malloc(t->nq * 4), t->o = malloc(t->nq * 4), t->dout = malloc(t->nq * 4), t->dq = malloc(t->nq * 4);
	t->k = malloc(t->nk * 4), t->v = malloc(t->nk * 4), t->dk = malloc(t->nk * 4), t->dv = malloc(t->nk * 4);
	t->lse = malloc((size_t)(B * S * H) * 4);
	t->ro = malloc(t->nq * 8), t->rdq = malloc(t->nq * 8), t->rdk = malloc(t->nk * 8), t->rdv = malloc(t->nk * 8);
	t->rlse = malloc((size_t)(B * S * H) * 8);
	fill(t->q, t->nq, 1.5f), fill(t->k, t->nk, 1.0f), fill(t->v, t->nk, 1.0f), fill(t->dout, t->nq, 1.0f);
	assert_int_equal(tier_attn_workspace_bytes(cpu, &t->p, &t->ws_bytes), 0);
	t->ws = malloc(t->ws_bytes);
	memset(t->ws, 0xff, t->ws_bytes);
	return t;
}

static void problem_free(problem *t)
{
	free(t->q), free(t->k), free(t->v), free(t->o), free(t->lse), free(t->dout), free(t->dq), free(t->dk);
	free(t->dv), free(t->ws), free(t->ro), free(t->rlse), free(t->rdq), free(t->rdk), free(t->rdv), free(t);
}

/* The naive attention in fp64: scores of one (sequence, head) materialised, masked, softmaxed;
 * gradients by the textbook formulas dP = dO V^T, dS = P (dP - rowsum(P dP)). */
static void reference(problem *t)
{
	const tier_attn_params *p = &t->p;
	const int64_t S = p->seq, H = p->n_heads, KH = p->n_kv_heads, D = p->head_dim;
	double *P = malloc((size_t)(S * S) * 8), *dP = malloc((size_t)(S * S) * 8);
	memset(t->rdq, 0, t->nq * 8), memset(t->rdk, 0, t->nk * 8), memset(t->rdv, 0, t->nk * 8);
	for (int64_t b = 0; b < p->batch; b++)
		for (int64_t h = 0; h < H; h++) {
			int64_t kh = h / (H / KH);
#define Q(i) (t->q + ((b * S + (i)) * H + h) * D)
#define K(j) (t->k + ((b * S + (j)) * KH + kh) * D)
#define V(j) (t->v + ((b * S + (j)) * KH + kh) * D)
#define DO(i) (t->dout + ((b * S + (i)) * H + h) * D)
			for (int64_t i = 0; i < S; i++) {
				double mx = -INFINITY, sum = 0, rs = 0;
				for (int64_t j = 0; j < S; j++) {
					double s = 0;
					for (int64_t d = 0; d < D; d++)
						s += (double)Q(i)[d] * K(j)[d];
					P[i * S + j] = (p->causal && j > i) ? -INFINITY : s * p->scale;
					mx = fmax(mx, P[i * S + j]);
				}
				for (int64_t j = 0; j < S; j++)
					sum += (P[i * S + j] = exp(P[i * S + j] - mx));
				t->rlse[(b * S + i) * H + h] = mx + log(sum);
				for (int64_t j = 0; j < S; j++) {
					double dp = 0;
					P[i * S + j] /= sum;
					for (int64_t d = 0; d < D; d++)
						dp += (double)DO(i)[d] * V(j)[d];
					dP[i * S + j] = dp;
					rs += P[i * S + j] * dp;
				}
				for (int64_t d = 0; d < D; d++) {
					double acc = 0;
					for (int64_t j = 0; j < S; j++)
						acc += P[i * S + j] * V(j)[d];
					t->ro[((b * S + i) * H + h) * D + d] = acc;
				}
				for (int64_t j = 0; j < S; j++) {
					double ds = P[i * S + j] * (dP[i * S + j] - rs) * p->scale;
					for (int64_t d = 0; d < D; d++) {
						t->rdq[((b * S + i) * H + h) * D + d] += ds * K(j)[d];
						t->rdk[((b * S + j) * KH + kh) * D + d] += ds * Q(i)[d];
						t->rdv[((b * S + j) * KH + kh) * D + d] += P[i * S + j] * DO(i)[d];
					}
				}
			}
#undef Q
#undef K
#undef V
#undef DO
		}
	free(P), free(dP);
}

/* max |a - ref| / max(max |ref|, floor) */
static double rel_err(const float *a, const double *ref, size_t n, double floor)
{
	double e = 0, m = floor;
	for (size_t i = 0; i < n; i++) {
		if (isnan(a[i]))
			return INFINITY;
		e = fmax(e, fabs(a[i] - ref[i])), m = fmax(m, fabs(ref[i]));
	}
	return e / m;
}

static double max_abs(const double *x, size_t n)
{
	double m = 1e-30;
	for (size_t i = 0; i < n; i++)
		m = fmax(m, fabs(x[i]));
	return m;
}

static void poison(float *x, size_t n)
{
	memset(x, 0xff, n * 4);
}

static void run_fwd(problem *t)
{
	poison(t->o, t->nq), poison(t->lse, t->nq / (size_t)t->p.head_dim);
	assert_int_equal(tier_attn_fwd(cpu, &t->p, t->q, t->k, t->v, t->o, t->lse, t->ws, t->ws_bytes), 0);
}

static void run_bwd(problem *t)
{
	poison(t->dq, t->nq), poison(t->dk, t->nk), poison(t->dv, t->nk);
	assert_int_equal(tier_attn_bwd(cpu, &t->p, t->q, t->k, t->v, t->o, t->lse, t->dout, t->dq, t->dk, t->dv,
				       t->ws, t->ws_bytes), 0);
}

static void check_case(int64_t B, int64_t S, int64_t H, int64_t KH, int64_t D, int causal)
{
	problem *t = problem_new(B, S, H, KH, D, causal);
	double e[5];
	reference(t);
	run_fwd(t);
	run_bwd(t);
	e[0] = rel_err(t->o, t->ro, t->nq, 1e-30);
	e[1] = rel_err(t->lse, t->rlse, t->nq / (size_t)D, 1.0);
	/* dq and dk vanish where a row sees one key (S = 1): measure them against dv's scale there. */
	e[2] = rel_err(t->dq, t->rdq, t->nq, max_abs(t->rdv, t->nk));
	e[3] = rel_err(t->dk, t->rdk, t->nk, max_abs(t->rdv, t->nk));
	e[4] = rel_err(t->dv, t->rdv, t->nk, 1e-30);
	for (int i = 0; i < 5; i++)
		if (!(e[i] <= TOL))
			print_message("B=%lld S=%lld H=%lld KH=%lld D=%lld causal=%d: %s rel err %.3g\n", (long long)B,
				      (long long)S, (long long)H, (long long)KH, (long long)D, causal,
				      (const char *[]){ "o", "lse", "dq", "dk", "dv" }[i], e[i]);
	for (int i = 0; i < 5; i++)
		assert_true(e[i] <= TOL);
	problem_free(t);
}

/* S = 1, S off the 64-row block, head_dim 64/128/24/odd, GQA ratios 1, 2, 8, batches, non-causal. */
static void test_against_fp64(void **state)
{
	static const int64_t cases[][6] = {
		{ 1, 1, 2, 1, 64, 1 },    { 1, 1, 1, 1, 7, 1 },     { 2, 77, 4, 2, 64, 1 },
		{ 1, 130, 8, 1, 24, 1 },  { 3, 65, 2, 2, 128, 1 },  { 1, 64, 4, 4, 32, 1 },
		{ 1, 129, 2, 1, 16, 0 },  { 2, 200, 4, 2, 24, 1 },  { 1, 45, 3, 1, 13, 0 },
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		check_case(cases[i][0], cases[i][1], cases[i][2], cases[i][3], cases[i][4], (int)cases[i][5]);
}

/* L = sum(o * dout), summed in fp64 from the fp32 forward. */
static double loss_of(problem *t)
{
	double L = 0;
	assert_int_equal(tier_attn_fwd(cpu, &t->p, t->q, t->k, t->v, t->o, t->lse, t->ws, t->ws_bytes), 0);
	for (size_t i = 0; i < t->nq; i++)
		L += (double)t->o[i] * t->dout[i];
	return L;
}

/* Every gradient entry against (L(x + h) - L(x - h)) / 2h on tiny shapes. */
static void fd_case(int64_t B, int64_t S, int64_t H, int64_t KH, int64_t D, int causal)
{
	problem *t = problem_new(B, S, H, KH, D, causal);
	float *xs[3] = { t->q, t->k, t->v }, *gs[3] = { t->dq, t->dk, t->dv };
	size_t ns[3] = { t->nq, t->nk, t->nk };
	const float h = 1e-2f;
	run_fwd(t);
	run_bwd(t);
	for (int a = 0; a < 3; a++)
		for (size_t i = 0; i < ns[a]; i++) {
			float x0 = xs[a][i];
			double lp, lm, fd;
			xs[a][i] = x0 + h, lp = loss_of(t);
			xs[a][i] = x0 - h, lm = loss_of(t);
			xs[a][i] = x0;
			fd = (lp - lm) / ((double)(x0 + h) - (double)(x0 - h));
			if (!(fabs(fd - gs[a][i]) <= 2e-3 * fmax(1.0, fabs(fd))))
				print_message("finite differences: %s[%zu] analytic %.6g numeric %.6g\n",
					      (const char *[]){ "q", "k", "v" }[a], i, gs[a][i], fd);
			assert_true(fabs(fd - gs[a][i]) <= 2e-3 * fmax(1.0, fabs(fd)));
		}
	problem_free(t);
}

static void test_finite_differences(void **state)
{
	fd_case(2, 5, 4, 2, 6, 1);
	fd_case(1, 4, 2, 2, 3, 0);
	fd_case(1, 3, 8, 1, 4, 1);
}

/* Changing one sequence leaves the others' outputs and gradients bit for bit. */
static void test_sequences_independent(void **state)
{
	problem *t = problem_new(3, 70, 4, 2, 24, 1);
	size_t sq = t->nq / 3, sk = t->nk / 3, sl = sq / 24;
	float *o0 = malloc(t->nq * 4), *l0 = malloc(sl * 3 * 4), *g0[3];
	float *gs[3] = { t->dq, t->dk, t->dv };
	size_t ns[3] = { t->nq, t->nk, t->nk };
	run_fwd(t), run_bwd(t);
	memcpy(o0, t->o, t->nq * 4), memcpy(l0, t->lse, sl * 3 * 4);
	for (int a = 0; a < 3; a++)
		g0[a] = malloc(ns[a] * 4), memcpy(g0[a], gs[a], ns[a] * 4);
	fill(t->q + sq, sq, 1.5f), fill(t->k + sk, sk, 1.0f), fill(t->v + sk, sk, 1.0f), fill(t->dout + sq, sq, 1.0f);
	run_fwd(t), run_bwd(t);
	for (int s = 0; s < 3; s += 2) {
		assert_memory_equal(o0 + s * sq, t->o + s * sq, sq * 4);
		assert_memory_equal(l0 + s * sl, t->lse + s * sl, sl * 4);
		for (int a = 0; a < 3; a++) {
			size_t n = ns[a] / 3;
			assert_memory_equal(g0[a] + s * n, gs[a] + s * n, n * 4);
		}
	}
	assert_memory_not_equal(o0 + sq, t->o + sq, sq * 4);
	for (int a = 0; a < 3; a++)
		free(g0[a]);
	free(o0), free(l0);
	problem_free(t);
}

/* HF's rotary embedding: theta^(2i/d) rounded to fp32, inverted in fp32, times pos in fp32
 * (as HF computes them), the rotation itself in fp64. */
static void rope_ref(const tier_rope_params *r, const int32_t *pos, const float *x, double *y)
{
	int64_t D = r->head_dim, half = D / 2;
	for (int64_t t = 0; t < r->tokens; t++)
		for (int64_t i = 0; i < half; i++) {
			float inv = 1.0f / (float)pow((double)r->theta, (double)((float)(2 * i) / (float)D));
			double ang = (double)((float)(pos ? pos[t] : t % r->seq) * inv);
			for (int64_t h = 0; h < r->n_heads; h++) {
				const float *e = x + (t * r->n_heads + h) * D;
				double *f = y + (t * r->n_heads + h) * D;
				f[i] = e[i] * cos(ang) - e[i + half] * sin(ang);
				f[i + half] = e[i + half] * cos(ang) + e[i] * sin(ang);
			}
		}
}

static void rope_case(int64_t T, int64_t S, int64_t H, int64_t D, float theta, int with_pos)
{
	tier_rope_params r = { .tokens = T, .seq = S, .n_heads = H, .head_dim = D, .theta = theta };
	size_t n = (size_t)(T * H * D);
	float *x = malloc(n * 4), *y = malloc(n * 4), *z = malloc(n * 4);
	double *ref = malloc(n * 8), dot1 = 0, dot2 = 0, err = 0, big = 0;
	int32_t *pos = with_pos ? malloc((size_t)T * 4) : NULL;
	for (int64_t t = 0; with_pos && t < T; t++)
		pos[t] = (int32_t)tier_rng_below(&rng, 4096);
	fill(x, n, 1.0f);
	memcpy(y, x, n * 4);
	rope_ref(&r, pos, x, ref);
	assert_int_equal(tier_attn_rope_fwd(cpu, &r, pos, y), 0);
	err = rel_err(y, ref, n, 1e-30);
	if (!(err <= TOL))
		print_message("rope T=%lld D=%lld theta=%g: rel err %.3g\n", (long long)T, (long long)D, theta, err);
	assert_true(err <= TOL);
	err = 0;
	/* The backward is the transpose: <R x, z> = <x, R^T z>; and R^T R x = x. */
	fill(z, n, 1.0f);
	for (size_t i = 0; i < n; i++)
		dot1 += (double)y[i] * z[i];
	assert_int_equal(tier_attn_rope_bwd(cpu, &r, pos, z), 0);
	for (size_t i = 0; i < n; i++)
		dot2 += (double)x[i] * z[i];
	assert_true(fabs(dot1 - dot2) <= TOL * fmax(1.0, fabs(dot1)) * sqrt((double)n));
	assert_int_equal(tier_attn_rope_bwd(cpu, &r, pos, y), 0);
	for (size_t i = 0; i < n; i++)
		err = fmax(err, fabs(y[i] - x[i])), big = fmax(big, fabs(x[i]));
	assert_true(err <= TOL * big);
	free(x), free(y), free(z), free(ref), free(pos);
}

static void test_rope(void **state)
{
	rope_case(2 * 37, 37, 3, 128, 1e6f, 0);
	rope_case(50, 50, 2, 6, 1e4f, 1);
	rope_case(4096, 4096, 1, 128, 1e6f, 0);
	rope_case(33, 11, 4, 64, 1e6f, 1);
}

#define EXPECT_FAIL(code, call, word)                                                              \
	do {                                                                                       \
		tier_clear_error();                                                                \
		assert_int_equal((call), (code));                                                  \
		assert_non_null(strstr(tier_last_error(), (word)));                                \
	} while (0)

static void test_bad_input(void **state)
{
	tier_attn_params p, b;
	tier_rope_params r = { .tokens = 4, .seq = 4, .n_heads = 1, .head_dim = 8, .theta = 1e4f };
	float buf[1024] = { 0 }, *f = buf;
	size_t bytes = 0;
	int32_t pos[4] = { 0, 1, -2, 3 };
	tier_attn_params_init(&p, 1, 4, 4, 2, 8);
	assert_int_equal(tier_attn_workspace_bytes(cpu, &p, &bytes), 0);
	char *ws = malloc(bytes);
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(NULL, &p, f, f, f, f, f, ws, bytes), "device");
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, NULL, f, f, f, f, f, ws, bytes), "params");
	b = p, b.n_heads = 3;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), "multiple");
	b = p, b.batch = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), ">= 1");
	b = p, b.seq = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_bwd(cpu, &b, f, f, f, f, f, f, f, f, f, ws, bytes), ">= 1");
	b = p, b.head_dim = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_workspace_bytes(cpu, &b, &bytes), ">= 1");
	b = p, b.n_kv_heads = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), ">= 1");
	b = p, b.scale = NAN;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), "scale");
	b = p, b.causal = 2;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), "causal");
	b = p, b.seq = 1ll << 40;
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &b, f, f, f, f, f, ws, bytes), "2^40");
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &p, f, NULL, f, f, f, ws, bytes), "k is NULL");
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &p, f, f, f, f, NULL, ws, bytes), "lse is NULL");
	EXPECT_FAIL(-EINVAL, tier_attn_bwd(cpu, &p, f, f, f, f, f, NULL, f, f, f, ws, bytes), "dout is NULL");
	EXPECT_FAIL(-EINVAL, tier_attn_bwd(cpu, &p, f, f, f, f, f, f, f, f, NULL, ws, bytes), "dv is NULL");
	EXPECT_FAIL(-EINVAL, tier_attn_fwd(cpu, &p, f, f, f, f, f, NULL, bytes), "workspace is NULL");
	EXPECT_FAIL(-ENOSPC, tier_attn_fwd(cpu, &p, f, f, f, f, f, ws, bytes - 1), "workspace");
	EXPECT_FAIL(-EINVAL, tier_attn_workspace_bytes(cpu, &p, NULL), "bytes");
	EXPECT_FAIL(-EINVAL, tier_attn_rope_fwd(cpu, &r, pos, f), "negative");
	EXPECT_FAIL(-EINVAL, tier_attn_rope_fwd(cpu, &r, NULL, NULL), "x is NULL");
	EXPECT_FAIL(-EINVAL, tier_attn_rope_bwd(cpu, NULL, NULL, f), "rope params");
	r.head_dim = 7;
	EXPECT_FAIL(-EINVAL, tier_attn_rope_fwd(cpu, &r, NULL, f), "even");
	r.head_dim = 8, r.theta = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_rope_bwd(cpu, &r, NULL, f), "theta");
	r.theta = 1e4f, r.tokens = 0;
	EXPECT_FAIL(-EINVAL, tier_attn_rope_fwd(cpu, &r, NULL, f), ">= 1");
	for (int i = 0; i < 1024; i++)
		assert_true(buf[i] == 0);   /* nothing written by a refused call */
	free(ws);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_against_fp64),
		cmocka_unit_test(test_finite_differences),
		cmocka_unit_test(test_sequences_independent),
		cmocka_unit_test(test_rope),
		cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, seeded_cpu_setup, seeded_cpu_teardown);
}
