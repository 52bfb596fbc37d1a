/* test_moe_permute.c - permute (sort by expert, capacity drops, gather), its backward, and the
 * weighted combine with its backward, against naive fp64 references. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#define REF_CPU_TEST "test_moe_permute" /* moe_ref.h: dev, rng and their setup */
#include "moe_ref.h"

enum { SPREAD = 0, ONE_EXPERT = 1 };

/* k distinct experts per token: random, or expert 0 always among them (all tokens to one expert). */
static void make_idx(int T, int k, int E, int how, int32_t *idx)
{
	for (int t = 0; t < T; t++)
		for (int j = 0; j < k; j++) {
			int e, dup;
			do {
				e = (how == ONE_EXPERT && j == 0) ? 0 : (int)tier_rng_below(&rng, (uint64_t)E);
				dup = 0;
				for (int i = 0; i < j; i++)
					dup |= idx[t * k + i] == e;
			} while (dup);
			idx[t * k + j] = e;
		}
}

static void run_case(int T, int k, int E, int H, int how, float cf)
{
	int n = T * k, cap = tier_moe_capacity(T, k, E, cf);
	int32_t *idx = malloc(4 * (size_t)n), *off = malloc(4 * (size_t)(E + 1)), *rp = malloc(4 * (size_t)n);
	int32_t *pr = malloc(4 * (size_t)n), *cnt = malloc(4 * (size_t)E);
	int *ref_pr = malloc(sizeof(int) * (size_t)n), *ref_cnt = calloc((size_t)E, sizeof(int));
	float *x = malloc(4 * (size_t)T * H), *xg = malloc(4 * (size_t)n * H), *dx = malloc(4 * (size_t)T * H);
	float *tw = malloc(4 * (size_t)n), *out = malloc(4 * (size_t)T * H), *dout = malloc(4 * (size_t)T * H);
	float *dy = malloc(4 * (size_t)n * H), *dtw = malloc(4 * (size_t)n);
	make_idx(T, k, E, how, idx);
	ref_fill(&rng, x, (size_t)T * H, 1.0f);
	ref_poison(off, 4 * (size_t)(E + 1));
	ref_poison(rp, 4 * (size_t)n);
	ref_poison(pr, 4 * (size_t)n);
	ref_poison(cnt, 4 * (size_t)E);
	ref_poison(xg, 4 * (size_t)n * H);
	assert_int_equal(tier_moe_permute(dev, T, k, E, H, cap, idx, x, off, rp, pr, cnt, xg), 0);

	/* naive: walk the experts, and for each the pairs in order, keeping the first `cap` */
	int row = 0;
	for (int p = 0; p < n; p++)
		ref_pr[p] = -1;
	for (int e = 0; e < E; e++) {
		assert_int_equal(off[e], row);
		for (int p = 0; p < n; p++)
			if (idx[p] == e && (cap <= 0 || ref_cnt[e]++ < cap)) {
				if (cap <= 0)
					ref_cnt[e]++;
				assert_int_equal(rp[row], p);
				ref_pr[p] = row++;
			}
	}
	assert_int_equal(off[E], row);
	for (int r = row; r < n; r++)
		assert_int_equal(rp[r], -1);
	for (int p = 0; p < n; p++)
		assert_int_equal(pr[p], ref_pr[p]);
	for (int e = 0; e < E; e++)
		assert_int_equal(cnt[e], ref_cnt[e]); /* routed, before drops */
	for (int r = 0; r < row; r++)
		assert_memory_equal(xg + (size_t)r * H, x + (size_t)(rp[r] / k) * H, 4 * (size_t)H);

	/* gather backward: scatter-add into random dx */
	float *dxg = xg; /* reuse as random row gradients */
	ref_fill(&rng, dxg, (size_t)row * H, 1.0f);
	ref_fill(&rng, dx, (size_t)T * H, 1.0f);
	double *dxr = ref_dup(dx, (size_t)T * H);
	for (int p = 0; p < n; p++)
		if (ref_pr[p] >= 0)
			for (int h = 0; h < H; h++)
				dxr[(p / k) * H + h] += dxg[(size_t)ref_pr[p] * H + h];
	assert_int_equal(tier_moe_permute_bwd(dev, T, k, H, off, E, rp, dxg, dx), 0);
	assert_true(ref_relerr(dx, dxr, (size_t)T * H) <= REF_TOL);

	/* combine: y rows = dxg (random), weights random */
	const float *y = dxg;
	ref_fill(&rng, tw, (size_t)n, 1.0f);
	ref_fill(&rng, dout, (size_t)T * H, 1.0f);
	ref_poison(out, 4 * (size_t)T * H);
	assert_int_equal(tier_moe_combine_fwd(dev, T, k, H, pr, tw, y, out), 0);
	double *outr = calloc((size_t)T * H, 8), *dyr = calloc((size_t)n * H, 8), *dtwr = calloc((size_t)n, 8);
	for (int p = 0; p < n; p++) {
		if (ref_pr[p] < 0)
			continue; /* dropped: contributes zero, gets zero gradient */
		for (int h = 0; h < H; h++) {
			int t = p / k;
			double yv = y[(size_t)ref_pr[p] * H + h];
			outr[t * H + h] += (double)tw[p] * yv;
			dyr[(size_t)ref_pr[p] * H + h] = (double)tw[p] * dout[t * H + h];
			dtwr[p] += yv * dout[t * H + h];
		}
	}
	assert_true(ref_relerr(out, outr, (size_t)T * H) <= REF_TOL);
	ref_poison(dy, 4 * (size_t)n * H);
	ref_poison(dtw, 4 * (size_t)n);
	assert_int_equal(tier_moe_combine_bwd(dev, T, k, H, pr, tw, y, dout, dy, dtw), 0);
	assert_true(ref_relerr(dy, dyr, (size_t)row * H) <= REF_TOL);
	assert_true(ref_relerr(dtw, dtwr, (size_t)n) <= REF_TOL);
	for (int p = 0; p < n; p++)
		if (ref_pr[p] < 0)
			assert_true(dtw[p] == 0.0f);
	/* without y: the same dy; then d_topk_w from row dots w dout . y (tier_moe_combine_dw), with a
	 * zero weight getting 0 */
	float *dy2 = malloc(4 * (size_t)n * H + 4), *dot = malloc(4 * (size_t)n + 4), *dtw2 = malloc(4 * (size_t)n);
	ref_poison(dy2, 4 * (size_t)n * H);
	assert_int_equal(tier_moe_combine_bwd(dev, T, k, H, pr, tw, NULL, dout, dy2, NULL), 0);
	assert_memory_equal(dy2, dy, 4 * (size_t)row * H);
	assert_int_equal(tier_moe_combine_bwd(dev, T, k, H, pr, tw, y, dout, dy2, NULL), -EINVAL);
	int z = -1; /* a kept pair's weight zeroed: its gradient is 0 */
	for (int p = n - 1; p >= 0 && z < 0; p--)
		z = ref_pr[p] >= 0 ? p : -1;
	if (z >= 0)
		tw[z] = 0.0f, dtwr[z] = 0.0;
	for (int p = 0; p < n; p++)
		if (ref_pr[p] >= 0)
			dot[ref_pr[p]] = (float)(tw[p] * dtwr[p]);
	ref_poison(dtw2, 4 * (size_t)n);
	assert_int_equal(tier_moe_combine_dw(dev, T, k, pr, tw, dot, dtw2), 0);
	assert_true(ref_relerr(dtw2, dtwr, (size_t)n) <= REF_TOL);
	assert_true(z < 0 || dtw2[z] == 0.0f);
	assert_int_equal(tier_moe_combine_dw(dev, T, k, pr, tw, NULL, dtw2), -EINVAL);
	assert_int_equal(tier_moe_combine_dw(dev, T, k, pr, tw, dot, NULL), -EINVAL);
	free(dy2), free(dot), free(dtw2);
	free(idx), free(off), free(rp), free(pr), free(cnt), free(ref_pr), free(ref_cnt), free(x), free(xg), free(dx);
	free(tw), free(out), free(dout), free(dy), free(dtw), free(dxr), free(outr), free(dyr), free(dtwr);
}

static void test_dropless(void **state)
{
	(void)state;
	run_case(37, 2, 8, 13, SPREAD, 0);
	run_case(5, 3, 40, 7, SPREAD, 0);    /* most experts empty */
	run_case(1, 4, 6, 5, SPREAD, 0);     /* T = 1 */
	run_case(9, 4, 4, 3, SPREAD, 0);     /* k = E */
	run_case(23, 1, 6, 11, ONE_EXPERT, 0); /* all tokens to one expert */
	run_case(3, 16, 896, 8, SPREAD, 0);  /* E = 896, k = 16 */
}

static void test_capacity_drops(void **state)
{
	(void)state;
	run_case(37, 2, 8, 13, SPREAD, 1.0f);
	run_case(31, 2, 6, 9, ONE_EXPERT, 1.25f); /* expert 0 overflows */
	run_case(17, 1, 4, 5, ONE_EXPERT, 0.5f);
	run_case(6, 16, 896, 4, SPREAD, 1.0f);
}

static void test_capacity_rule(void **state)
{
	(void)state;
	assert_int_equal(tier_moe_capacity(10, 2, 4, 1.0f), 5);
	assert_int_equal(tier_moe_capacity(10, 2, 4, 1.25f), 7); /* ceil(6.25) */
	assert_int_equal(tier_moe_capacity(10, 2, 4, 0.0f), 0);   /* dropless */
	assert_int_equal(tier_moe_capacity(10, 2, 4, -1.0f), 0);
	assert_int_equal(tier_moe_capacity(10, 2, 4, 100.0f), 20); /* never above T*k */
	/* all 5 tokens to expert 1 with capacity 2: tokens 0 and 1 stay, in token order */
	int32_t idx[5] = { 1, 1, 1, 1, 1 }, off[4], rp[5], pr[5];
	assert_int_equal(tier_moe_permute(dev, 5, 1, 3, 1, 2, idx, NULL, off, rp, pr, NULL, NULL), 0);
	assert_int_equal(off[1], 0);
	assert_int_equal(off[2], 2);
	assert_int_equal(off[3], 2);
	assert_int_equal(pr[0], 0);
	assert_int_equal(pr[1], 1);
	assert_int_equal(pr[2], -1);
	assert_int_equal(pr[4], -1);
}

static void test_bad_input(void **state)
{
	(void)state;
	int32_t idx[4] = { 0, 1, 2, 7 }, off[5], rp[4], pr[4] = { 0, 1, 2, 9 };
	float x[4] = { 0 }, xg[16], y[16] = { 0 }, w[4] = { 0 }, out[4];
	off[0] = 1234;
	assert_int_equal(tier_moe_permute(dev, 2, 2, 4, 1, 0, idx, x, off, rp, pr, NULL, xg), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "topk_idx"));
	idx[3] = 3;
	assert_int_equal(tier_moe_permute(dev, 2, 2, 4, 1, 0, idx, x, NULL, rp, pr, NULL, xg), -EINVAL);
	assert_int_equal(tier_moe_permute(dev, 2, 2, 4, 1, 0, idx, x, off, rp, pr, NULL, NULL), -EINVAL);
	assert_int_equal(tier_moe_permute(dev, 2, 5, 4, 1, 0, idx, x, off, rp, pr, NULL, xg), -EINVAL);
	assert_int_equal(tier_moe_permute(dev, 2, 2, 1025, 1, 0, idx, x, off, rp, pr, NULL, xg), -EINVAL);
	assert_int_equal(tier_moe_permute(NULL, 2, 2, 4, 1, 0, idx, x, off, rp, pr, NULL, xg), -EINVAL);
	assert_int_equal(off[0], 1234); /* nothing written */
	assert_int_equal(tier_moe_combine_fwd(dev, 2, 2, 1, pr, w, y, out), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "pair_row"));
	assert_int_equal(tier_moe_combine_fwd(dev, 2, 2, 1, NULL, w, y, out), -EINVAL);
	off[0] = 0, off[1] = 3, off[2] = 3, off[3] = 3, off[4] = 9;
	assert_int_equal(tier_moe_permute_bwd(dev, 2, 2, 1, off, 4, rp, y, x), -EINVAL);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_dropless),      cmocka_unit_test(test_capacity_drops),
		cmocka_unit_test(test_capacity_rule), cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, ref_setup, ref_teardown);
}
