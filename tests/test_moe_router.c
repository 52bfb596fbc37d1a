/* test_moe_router.c - MoE router forms, their backward, the aux and z losses, against fp64 references. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#define REF_CPU_TEST "test_moe_router" /* moe_ref.h: dev, rng and their setup */
#include "moe_ref.h"

typedef struct {
	tier_moe_router_kind kind;
	int E, k, norm, G, tg;
	float rsf;
	int T, H;
} rcase;

static const rcase cases[] = {
	{ TIER_MOE_ROUTER_SOFTMAX_TOPK, 8, 2, 0, 0, 0, 0, 37, 29 },
	{ TIER_MOE_ROUTER_SOFTMAX_TOPK, 60, 4, 1, 0, 0, 0, 19, 13 },
	{ TIER_MOE_ROUTER_TOPK_SOFTMAX, 8, 2, 0, 0, 0, 0, 23, 17 },
	{ TIER_MOE_ROUTER_SIGMOID_GROUP, 64, 6, 1, 8, 3, 2.5f, 21, 15 },
	{ TIER_MOE_ROUTER_SIGMOID_GROUP, 32, 4, 0, 1, 0, 1.0f, 9, 7 },
	{ TIER_MOE_ROUTER_SOFTMAX_TOPK, 5, 5, 1, 0, 0, 0, 11, 6 },           /* k = E */
	{ TIER_MOE_ROUTER_TOPK_SOFTMAX, 3, 3, 0, 0, 0, 0, 4, 3 },            /* k = E */
	{ TIER_MOE_ROUTER_SIGMOID_GROUP, 16, 16, 1, 4, 4, 1.0f, 5, 9 },      /* k = E */
	{ TIER_MOE_ROUTER_SOFTMAX_TOPK, 16, 3, 0, 0, 0, 0, 1, 5 },           /* T = 1 */
	{ TIER_MOE_ROUTER_SOFTMAX_TOPK, 896, 16, 1, 0, 0, 0, 3, 16 },        /* E = 896, k = 16 */
	{ TIER_MOE_ROUTER_SIGMOID_GROUP, 896, 16, 1, 8, 4, 2.5f, 3, 16 },
	{ TIER_MOE_ROUTER_TOPK_SOFTMAX, 1024, 16, 0, 0, 0, 0, 2, 4 },        /* E = 1024 */
};

static tier_moe_router_cfg cfg_of(const rcase *c)
{
	return (tier_moe_router_cfg){ .kind = c->kind, .n_experts = c->E, .top_k = c->k, .norm_topk_prob = c->norm,
				      .n_group = c->G, .topk_group = c->tg, .routed_scaling_factor = c->rsf };
}

/* The kernel's selection holds the k best criteria (up to near-ties of fp32 rounding), all distinct. */
static void check_selection(const tier_moe_router_cfg *cfg, const double *l, const double *bias, const int32_t *idx)
{
	int E = cfg->n_experts, k = cfg->top_k, best[TIER_MOE_MAX_TOPK];
	double crit[TIER_MOE_MAX_EXPERTS];
	char seen[TIER_MOE_MAX_EXPERTS] = { 0 };
	ref_criterion(cfg, l, bias, crit);
	ref_topn(crit, E, k, best);
	for (int j = 0; j < k; j++) {
		assert_true(idx[j] >= 0 && idx[j] < E);
		assert_false(seen[idx[j]]);
		seen[idx[j]] = 1;
		assert_true(fabs(crit[idx[j]] - crit[best[j]]) <= 1e-6);
	}
}

static void run_case(const rcase *c)
{
	tier_moe_router_cfg cfg = cfg_of(c);
	int T = c->T, H = c->H, E = c->E, k = c->k;
	size_t TE = (size_t)T * E, Tk = (size_t)T * k;
	float *x = malloc(4 * (size_t)T * H), *w = malloc(4 * (size_t)E * H), *bias = malloc(4 * (size_t)E);
	float *lg = malloc(4 * TE), *tw = malloc(4 * Tk), *dtw = malloc(4 * Tk), *dl = malloc(4 * TE);
	float *dx = malloc(4 * (size_t)T * H), *dw = malloc(4 * (size_t)E * H);
	int32_t *idx = malloc(4 * Tk);
	ref_fill(&rng, x, (size_t)T * H, 1.0f);
	ref_fill(&rng, w, (size_t)E * H, 0.5f);
	ref_fill(&rng, bias, (size_t)E, 0.1f);
	ref_fill(&rng, dtw, Tk, 1.0f);
	ref_poison(lg, 4 * TE);
	ref_poison(tw, 4 * Tk);
	ref_poison(idx, 4 * Tk);
	const float *b = c->kind == TIER_MOE_ROUTER_SIGMOID_GROUP ? bias : NULL;
	assert_int_equal(tier_moe_router_fwd(dev, &cfg, T, H, x, w, b, lg, idx, tw), 0);

	double *xd = ref_dup(x, (size_t)T * H), *wd = ref_dup(w, (size_t)E * H), *bd = ref_dup(bias, E);
	double *lref = calloc(TE, sizeof(double)), *lk = ref_dup(lg, TE), *wref = malloc(8 * Tk), *dlref = calloc(TE, 8);
	for (int t = 0; t < T; t++)
		for (int e = 0; e < E; e++)
			for (int h = 0; h < H; h++)
				lref[t * E + e] += xd[t * H + h] * wd[e * H + h];
	assert_true(ref_relerr(lg, lref, TE) <= REF_TOL);
	int sel[TIER_MOE_MAX_TOPK];
	for (int t = 0; t < T; t++) {
		check_selection(&cfg, lk + t * E, b ? bd : NULL, idx + t * k);
		for (int j = 0; j < k; j++)
			sel[j] = idx[t * k + j];
		ref_weights(&cfg, lk + t * E, sel, wref + t * k);
		/* backward: central differences of sum_j dtw_j w_j(l) in fp64, selection fixed */
		for (int e = 0; e < E; e++) {
			double *l = lk + t * E, keep = l[e], wp[TIER_MOE_MAX_TOPK], wm[TIER_MOE_MAX_TOPK], eps = 1e-6;
			l[e] = keep + eps;
			ref_weights(&cfg, l, sel, wp);
			l[e] = keep - eps;
			ref_weights(&cfg, l, sel, wm);
			l[e] = keep;
			for (int j = 0; j < k; j++)
				dlref[t * E + e] += dtw[t * k + j] * (wp[j] - wm[j]) / (2 * eps);
		}
	}
	assert_true(ref_relerr(tw, wref, Tk) <= REF_TOL);
	ref_poison(dl, 4 * TE);
	assert_int_equal(tier_moe_router_weights_bwd(dev, &cfg, T, lg, idx, dtw, dl), 0);
	assert_true(ref_relerr(dl, dlref, TE) <= REF_TOL);

	/* linear backward, accumulating into random dx, dw */
	ref_fill(&rng, dx, (size_t)T * H, 1.0f);
	ref_fill(&rng, dw, (size_t)E * H, 1.0f);
	double *dxr = ref_dup(dx, (size_t)T * H), *dwr = ref_dup(dw, (size_t)E * H);
	for (int t = 0; t < T; t++)
		for (int e = 0; e < E; e++)
			for (int h = 0; h < H; h++) {
				dxr[t * H + h] += (double)dl[t * E + e] * wd[e * H + h];
				dwr[e * H + h] += (double)dl[t * E + e] * xd[t * H + h];
			}
	assert_int_equal(tier_moe_router_linear_bwd(dev, T, H, E, x, w, dl, dx, dw), 0);
	assert_true(ref_relerr(dx, dxr, (size_t)T * H) <= REF_TOL);
	assert_true(ref_relerr(dw, dwr, (size_t)E * H) <= REF_TOL);
	free(x), free(w), free(bias), free(lg), free(tw), free(dtw), free(dl), free(dx), free(dw), free(idx);
	free(xd), free(wd), free(bd), free(lref), free(lk), free(wref), free(dlref), free(dxr), free(dwr);
}

static void test_router_forms(void **state)
{
	(void)state;
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		run_case(&cases[i]);
}

/* Mixtral's top-k-then-softmax equals Qwen's softmax-top-k-renormalise, forward and backward. */
static void test_mixtral_equals_qwen_norm(void **state)
{
	(void)state;
	enum { T = 13, E = 10, k = 3, H = 8 };
	float x[T * H], w[E * H], lg[T * E], tw1[T * k], tw2[T * k], dtw[T * k], dl1[T * E], dl2[T * E];
	int32_t i1[T * k], i2[T * k];
	tier_moe_router_cfg q = { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = E, .top_k = k, .norm_topk_prob = 1 };
	tier_moe_router_cfg m = { .kind = TIER_MOE_ROUTER_TOPK_SOFTMAX, .n_experts = E, .top_k = k };
	ref_fill(&rng, x, T * H, 1.0f);
	ref_fill(&rng, w, E * H, 1.0f);
	ref_fill(&rng, dtw, T * k, 1.0f);
	assert_int_equal(tier_moe_router_fwd(dev, &q, T, H, x, w, NULL, lg, i1, tw1), 0);
	assert_int_equal(tier_moe_router_fwd(dev, &m, T, H, x, w, NULL, lg, i2, tw2), 0);
	assert_memory_equal(i1, i2, sizeof i1);
	for (int i = 0; i < T * k; i++)
		assert_true(fabsf(tw1[i] - tw2[i]) <= 1e-6f);
	assert_int_equal(tier_moe_router_weights_bwd(dev, &q, T, lg, i1, dtw, dl1), 0);
	assert_int_equal(tier_moe_router_weights_bwd(dev, &m, T, lg, i2, dtw, dl2), 0);
	for (int i = 0; i < T * E; i++)
		assert_true(fabsf(dl1[i] - dl2[i]) <= 1e-6f);
}

/* DeepSeek-V3 group limit: a group with the best top-2 sum wins over one with the best single
 * expert; the bias moves the choice but not the weights. */
static void test_group_limited(void **state)
{
	(void)state;
	enum { E = 8, k = 2 };
	const double s[E] = { 0.9, 0.1, 0.6, 0.6, 0.5, 0.5, 0.2, 0.2 }; /* sigmoid scores */
	float x[1] = { 1.0f }, w[E], lg[E], tw[k], bias[E] = { 0 };
	int32_t idx[k];
	for (int e = 0; e < E; e++)
		w[e] = (float)log(s[e] / (1 - s[e])); /* H = 1, x = 1: logits = w */
	tier_moe_router_cfg c = { .kind = TIER_MOE_ROUTER_SIGMOID_GROUP, .n_experts = E, .top_k = k, .norm_topk_prob = 1,
				  .n_group = 4, .topk_group = 1, .routed_scaling_factor = 2.0f };
	assert_int_equal(tier_moe_router_fwd(dev, &c, 1, 1, x, w, bias, lg, idx, tw), 0);
	assert_true((idx[0] == 2 && idx[1] == 3) || (idx[0] == 3 && idx[1] == 2));
	assert_true(fabsf(tw[0] - 1.0f) < 1e-6f && fabsf(tw[1] - 1.0f) < 1e-6f); /* 2 * 0.6 / 1.2 */
	c.topk_group = 4;                                                           /* no limit: 0.9 and a 0.6 */
	assert_int_equal(tier_moe_router_fwd(dev, &c, 1, 1, x, w, bias, lg, idx, tw), 0);
	assert_int_equal(idx[0], 0);
	assert_int_equal(idx[1], 2);
	bias[7] = 1.0f; /* selection-only bias pulls expert 7 in; its weight is its un-biased score */
	assert_int_equal(tier_moe_router_fwd(dev, &c, 1, 1, x, w, bias, lg, idx, tw), 0);
	assert_int_equal(idx[0], 7);
	assert_true(fabs(tw[0] - 2 * 0.2 / 1.1) < 1e-6 && fabs(tw[1] - 2 * 0.9 / 1.1) < 1e-6);
	/* HF fills the experts of dropped groups with 0.0, not -inf: when every kept score + bias is
	 * negative, those zeros win (ties to the lower index here) */
	for (int e = 0; e < E; e++)
		bias[e] = -1.0f;
	c.topk_group = 1;
	assert_int_equal(tier_moe_router_fwd(dev, &c, 1, 1, x, w, bias, lg, idx, tw), 0);
	assert_int_equal(idx[0], 0);
	assert_int_equal(idx[1], 1);
	assert_true(fabsf(tw[0] - 1.8f) < 1e-6f && fabsf(tw[1] - 0.2f) < 1e-6f);
}

static void aux_case(int T, int E, int k)
{
	float *lg = malloc(4 * (size_t)T * E), *dl = malloc(4 * (size_t)T * E), aux = NAN, z = NAN;
	int32_t *idx = malloc(4 * (size_t)T * k), *cnt = malloc(4 * (size_t)E);
	int *sel = malloc(sizeof(int) * (size_t)T * k), *cref = malloc(sizeof(int) * (size_t)E);
	const float ac = 0.013f, zc = 0.0021f, dloss = 0.7f;
	tier_moe_router_cfg c = { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = E, .top_k = k };
	ref_fill(&rng, lg, (size_t)T * E, 2.0f);
	double *ld = ref_dup(lg, (size_t)T * E);
	for (int t = 0; t < T; t++)
		ref_select(&c, ld + t * E, NULL, sel + t * k);
	for (int i = 0; i < T * k; i++)
		idx[i] = sel[i];
	ref_poison(cnt, 4 * (size_t)E);
	assert_int_equal(tier_moe_aux_fwd(dev, T, E, k, ac, zc, lg, idx, &aux, &z, cnt), 0);
	double ar, zr;
	ref_aux(T, E, k, ac, zc, ld, sel, cref, &ar, &zr);
	assert_true(fabs(aux - ar) <= REF_TOL * fabs(ar) && fabs(z - zr) <= REF_TOL * fabs(zr));
	for (int e = 0; e < E; e++)
		assert_int_equal(cnt[e], cref[e]);
	ref_fill(&rng, dl, (size_t)T * E, 0.01f); /* accumulated into */
	double *dref = ref_dup(dl, (size_t)T * E);
	for (int i = 0; i < T * E; i++) {
		double keep = ld[i], eps = 1e-6, p, m;
		ld[i] = keep + eps;
		p = ref_aux(T, E, k, ac, zc, ld, sel, NULL, NULL, NULL);
		ld[i] = keep - eps;
		m = ref_aux(T, E, k, ac, zc, ld, sel, NULL, NULL, NULL);
		ld[i] = keep;
		dref[i] += dloss * (p - m) / (2 * eps);
	}
	assert_int_equal(tier_moe_aux_bwd(dev, T, E, k, ac, zc, lg, idx, dloss, dl), 0);
	assert_true(ref_relerr(dl, dref, (size_t)T * E) <= 1e-4); /* fp64 differences of an O(1e-2) loss */
	free(lg), free(dl), free(idx), free(cnt), free(sel), free(cref), free(ld), free(dref);
}

static void test_aux_and_z_loss(void **state)
{
	(void)state;
	aux_case(29, 12, 3);
	aux_case(1, 7, 7);
	aux_case(4, 896, 16);
}

static void test_bad_input(void **state)
{
	(void)state;
	float x[8] = { 0 }, w[64] = { 0 }, lg[64], tw[16] = { 0 };
	int32_t idx[16] = { 0 };
	struct { tier_moe_router_cfg c; const char *what; } bad[] = {
		{ { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = 4, .top_k = 5 }, "exceeds" },
		{ { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = 4, .top_k = 0 }, "top_k" },
		{ { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = 1025, .top_k = 2 }, "experts" },
		{ { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = 64, .top_k = 17 }, "top_k" },
		{ { .kind = TIER_MOE_ROUTER_SIGMOID_GROUP, .n_experts = 10, .top_k = 2, .n_group = 3, .topk_group = 1 }, "divide" },
		{ { .kind = TIER_MOE_ROUTER_SIGMOID_GROUP, .n_experts = 8, .top_k = 2, .n_group = 4, .topk_group = 5 }, "topk_group" },
		{ { .kind = TIER_MOE_ROUTER_SIGMOID_GROUP, .n_experts = 8, .top_k = 2, .n_group = 4, .topk_group = 0 }, "topk_group" },
		{ { .kind = TIER_MOE_ROUTER_SIGMOID_GROUP, .n_experts = 8, .top_k = 3, .n_group = 4, .topk_group = 1 }, "kept groups" },
		{ { .kind = (tier_moe_router_kind)7, .n_experts = 8, .top_k = 3 }, "kind" },
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		memset(lg, 0x55, sizeof lg);
		assert_int_equal(tier_moe_router_fwd(dev, &bad[i].c, 1, 1, x, w, NULL, lg, idx, tw), -EINVAL);
		assert_non_null(strstr(tier_last_error(), bad[i].what));
		assert_true(lg[0] != 0.0f); /* nothing written */
	}
	tier_moe_router_cfg ok = { .kind = TIER_MOE_ROUTER_SOFTMAX_TOPK, .n_experts = 4, .top_k = 2 };
	assert_int_equal(tier_moe_router_fwd(dev, &ok, 1, 1, NULL, w, NULL, lg, idx, tw), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "x is NULL"));
	assert_int_equal(tier_moe_router_fwd(dev, &ok, 1, 1, x, NULL, NULL, lg, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_fwd(dev, &ok, 1, 1, x, w, NULL, NULL, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_fwd(dev, &ok, 0, 1, x, w, NULL, lg, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_fwd(dev, &ok, 1, 0, x, w, NULL, lg, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_fwd(NULL, &ok, 1, 1, x, w, NULL, lg, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_fwd(dev, NULL, 1, 1, x, w, NULL, lg, idx, tw), -EINVAL);
	assert_int_equal(tier_moe_router_weights_bwd(dev, &ok, 1, lg, idx, NULL, lg), -EINVAL);
	idx[1] = 9; /* not an expert */
	float a, z;
	assert_int_equal(tier_moe_aux_fwd(dev, 1, 4, 2, 0.1f, 0, lg, idx, &a, &z, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "topk_idx"));
	idx[1] = 1;
	assert_int_equal(tier_moe_aux_fwd(dev, 1, 4, 2, -0.1f, 0, lg, idx, &a, &z, NULL), -EINVAL);
}

/* On a CUDA context the steps without a CUDA version (the aux loss: the layer does it there) are an
 * honest unsupported case, refused before any pointer is read. */
static void test_cuda_unsupported(void **state)
{
	(void)state;
	tier_dev *gpu = NULL;
	if (tier_dev_open(&gpu, TIER_DEV_CUDA, 0) != 0)
		skip(); /* no GPU here: nothing to check */
	float lg[4] = { 0 }, aux, z;
	int32_t idx[2] = { 0 };
	int rc = tier_moe_aux_fwd(gpu, 2, 2, 1, 0.01f, 0.0f, lg, idx, &aux, &z, NULL);
	tier_dev_close(gpu);
	assert_int_equal(rc, -ENOTSUP);
	assert_non_null(strstr(tier_last_error(), "CPU"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_router_forms),   cmocka_unit_test(test_mixtral_equals_qwen_norm),
		cmocka_unit_test(test_group_limited),  cmocka_unit_test(test_aux_and_z_loss),
		cmocka_unit_test(test_bad_input),      cmocka_unit_test(test_cuda_unsupported),
	};
	return cmocka_run_group_tests(tests, ref_setup, ref_teardown);
}
