/* test_loss_cuda.c - the CUDA loss (bf16 inputs) against the CPU reference on the same rounded
 * inputs: odd shapes, split vocabularies, the fused pass, options, ignored labels, bad input.
 * Skips (exit 77) without a GPU. */
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
#include "test_seed.h"

#define TOL 1e-2
static tier_rng rng;
static tier_dev *cpu, *gpu;

static void *dev_copy(const void *src, size_t n)
{
	void *d = NULL;
	assert_int_equal(tier_dev_malloc(gpu, n ? n : 1, &d), 0);
	if (n)
		assert_int_equal(tier_dev_memcpy_h2d(gpu, d, src, n), 0);
	return d;
}

static void *dev_poisoned(size_t n)
{
	void *h = malloc(n), *d;
	memset(h, 0xff, n);                                      /* NaN as fp32 */
	d = dev_copy(h, n);
	free(h);
	return d;
}

static void fetch(void *dst, const void *src, size_t n)
{
	assert_int_equal(tier_dev_memcpy_d2h(gpu, dst, src, n), 0);
}

static double rel(double a, double ref)
{
	return isnan(a) ? INFINITY : ref == 0 ? fabs(a) : fabs(a - ref) / fabs(ref);
}

/* Compare the CUDA forward, backward and fused pass with the CPU on bf16-rounded inputs. */
static void compare(tier_loss_params p, int ignore_pct, float hscale, int with_dw)
{
	int64_t N = p.N, V = p.V, D = p.D, cnt_c, cnt_g;
	float *H = malloc((size_t)(N * D) * 4), *W = malloc((size_t)(V * D) * 4), loss_c, loss_g;
	uint16_t *Hb = malloc((size_t)(N * D) * 2), *Wb = malloc((size_t)(V * D) * 2);
	int32_t *y = malloc((size_t)N * 4);
	float *lse_c = malloc((size_t)N * 4), *lse_g = malloc((size_t)N * 4);
	float *dH_c = malloc((size_t)(N * D) * 4), *dH_g = malloc((size_t)(N * D) * 4);
	float *dW_c = malloc((size_t)(V * D) * 4), *dW_g = malloc((size_t)(V * D) * 4);
	double *dH_ref = malloc((size_t)(N * D) * 8), *dW_ref = malloc((size_t)(V * D) * 8);
	size_t ws_c, ws_g;
	void *wc, *wg, *dH, *dW, *dHd, *dWd, *dy, *dlse, *dloss, *dcnt;
	for (int64_t i = 0; i < N * D; i++)
		Hb[i] = tier_f32_to_bf16(hscale * tier_rng_normal(&rng)), H[i] = tier_bf16_to_f32(Hb[i]);
	for (int64_t i = 0; i < V * D; i++)
		Wb[i] = tier_f32_to_bf16(tier_rng_normal(&rng) / sqrtf((float)D)), W[i] = tier_bf16_to_f32(Wb[i]);
	for (int64_t i = 0; i < N; i++)
		y[i] = (int)tier_rng_below(&rng, 100) < ignore_pct ? p.ignore_index : (int32_t)tier_rng_below(&rng, (uint64_t)V);
	/* CPU reference: same rounded inputs, whole-vocabulary chunks of 64. */
	{
		tier_loss_params pc = p;
		pc.chunk_tokens = 0, pc.block_vocab = 0;
		assert_int_equal(tier_loss_workspace_bytes(&pc, TIER_DEV_CPU, &ws_c), 0);
		wc = malloc(ws_c);
		assert_int_equal(tier_loss_fwd_bwd(cpu, &pc, H, W, y, 1.0f, lse_c, &loss_c, &cnt_c, dH_c, dW_c, wc, ws_c), 0);
		free(wc);
	}
	assert_int_equal(tier_loss_workspace_bytes(&p, TIER_DEV_CUDA, &ws_g), 0);
	wg = dev_poisoned(ws_g);
	dH = dev_copy(Hb, (size_t)(N * D) * 2), dW = dev_copy(Wb, (size_t)(V * D) * 2), dy = dev_copy(y, (size_t)N * 4);
	for (int mode = 0; mode < 2; mode++) {                  /* 0: fwd then bwd, 1: fused */
		double e;
		dlse = dev_poisoned((size_t)N * 4), dloss = dev_poisoned(4), dcnt = dev_poisoned(8);
		dHd = dev_poisoned((size_t)(N * D) * 4), dWd = dev_poisoned((size_t)(V * D) * 4);
		if (mode == 0) {
			assert_int_equal(tier_loss_fwd(gpu, &p, dH, dW, dy, dlse, dloss, dcnt, wg, ws_g), 0);
			assert_int_equal(tier_loss_bwd(gpu, &p, dH, dW, dy, dlse, 1.0f, dHd, with_dw ? dWd : NULL, wg, ws_g), 0);
		} else {
			assert_int_equal(tier_loss_fwd_bwd(gpu, &p, dH, dW, dy, 1.0f, dlse, dloss, dcnt, dHd,
							   with_dw ? dWd : NULL, wg, ws_g), 0);
		}
		assert_int_equal(tier_dev_sync(gpu), 0);
		fetch(lse_g, dlse, (size_t)N * 4), fetch(&loss_g, dloss, 4), fetch(&cnt_g, dcnt, 8);
		fetch(dH_g, dHd, (size_t)(N * D) * 4);
		assert_int_equal(cnt_g, cnt_c);
		e = rel(loss_g, loss_c);
		print_message("N=%lld V=%lld D=%lld chunk=%lld block=%lld %s: loss %.6f (cpu %.6f) rel %.2g\n",
			      (long long)N, (long long)V, (long long)D, (long long)p.chunk_tokens, (long long)p.block_vocab,
			      mode ? "fused" : "fwd+bwd", loss_g, loss_c, e);
		assert_true(e <= TOL);
		for (int64_t i = 0; i < N; i++)
			assert_true(rel(lse_g[i], lse_c[i]) <= TOL);
		for (int64_t i = 0; i < N * D; i++)
			dH_ref[i] = dH_c[i];
		e = loss_rel_err(dH_g, dH_ref, (size_t)(N * D));
		print_message("  dH rel err %.3g\n", e);
		assert_true(e <= TOL);
		if (with_dw) {
			fetch(dW_g, dWd, (size_t)(V * D) * 4);
			for (int64_t i = 0; i < V * D; i++)
				dW_ref[i] = dW_c[i];
			e = loss_rel_err(dW_g, dW_ref, (size_t)(V * D));
			print_message("  dW rel err %.3g\n", e);
			assert_true(e <= TOL);
		}
		tier_dev_free(gpu, dlse), tier_dev_free(gpu, dloss), tier_dev_free(gpu, dcnt);
		tier_dev_free(gpu, dHd), tier_dev_free(gpu, dWd);
	}
	tier_dev_free(gpu, wg), tier_dev_free(gpu, dH), tier_dev_free(gpu, dW), tier_dev_free(gpu, dy);
	free(H), free(W), free(Hb), free(Wb), free(y), free(lse_c), free(lse_g), free(dH_c), free(dH_g);
	free(dW_c), free(dW_g), free(dH_ref), free(dW_ref);
}

static tier_loss_params params(int64_t N, int64_t V, int64_t D, int64_t chunk, int64_t block)
{
	tier_loss_params p;
	tier_loss_params_init(&p, N, V, D);
	p.chunk_tokens = chunk, p.block_vocab = block;
	return p;
}

static void test_odd_shapes(void **state)
{
	(void)state;
	compare(params(257, 1001, 64, 0, 0), 10, 1.0f, 1);      /* automatic, whole vocabulary */
	compare(params(1, 50, 8, 0, 0), 0, 1.0f, 1);            /* one token */
	compare(params(300, 5003, 128, 48, 1024), 20, 1.0f, 1); /* split vocabulary, odd V */
	compare(params(129, 777, 32, 1, 1), 0, 1.0f, 0);        /* tiny tiles */
}

static void test_large(void **state)
{
	(void)state;
	compare(params(1024, 32000, 256, 256, 0), 5, 1.0f, 0);
	compare(params(512, 50000, 512, 64, 8192), 5, 2.0f, 1);
}

static void test_options(void **state)
{
	tier_loss_params p = params(200, 3001, 64, 64, 1000);
	(void)state;
	p.z_loss = 1e-3f, p.label_smoothing = 0.1f;
	compare(p, 10, 1.0f, 1);
	p.z_loss = 0, p.label_smoothing = 0, p.softcap = 30.0f, p.reduction = TIER_LOSS_SUM;
	compare(p, 10, 8.0f, 1);
}

static void test_ignored_and_extreme(void **state)
{
	(void)state;
	compare(params(100, 1000, 32, 16, 0), 100, 1.0f, 1);   /* every label ignored: loss 0, count 0 */
	compare(params(100, 1000, 32, 16, 256), 0, 300.0f, 1); /* logits of about +-300 */
	compare(params(64, 1000, 32, 0, 0), 0, 0.0f, 1);       /* all logits equal */
}

static void test_bad_input(void **state)
{
	tier_loss_params p = params(4, 10, 12, 0, 0);
	void *ws;
	(void)state;
	assert_int_equal(tier_dev_malloc(gpu, 1 << 20, &ws), 0);
	assert_int_equal(tier_loss_fwd(gpu, &p, ws, ws, ws, ws, ws, ws, ws, 1 << 20), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "multiple of 8"));
	p.D = 16, p.filter_eps = 1e-3f;
	assert_int_equal(tier_loss_bwd(gpu, &p, ws, ws, ws, ws, 1.0f, ws, NULL, ws, 1 << 20), -ENOTSUP);
	assert_non_null(strstr(tier_last_error(), "filter"));
	p.filter_eps = 0;
	assert_int_equal(tier_loss_fwd(gpu, &p, ws, ws, ws, ws, ws, ws, ws, 64), -ENOSPC);
	tier_dev_free(gpu, ws);
}

/* Labels outside [0, V) other than the ignore index count as ignored on CUDA (they are not read). */
static void test_out_of_range_label(void **state)
{
	tier_loss_params p = params(8, 16, 8, 0, 0);
	uint16_t Hb[64], Wb[128];
	int32_t y[8] = { 1, 2, 99, -7, 3, 4, 5, 6 };
	int64_t cnt;
	size_t wsb;
	void *dH, *dW, *dy, *lse, *loss, *dcnt, *ws;
	(void)state;
	for (int i = 0; i < 64; i++)
		Hb[i] = tier_f32_to_bf16(tier_rng_normal(&rng));
	for (int i = 0; i < 128; i++)
		Wb[i] = tier_f32_to_bf16(tier_rng_normal(&rng));
	assert_int_equal(tier_loss_workspace_bytes(&p, TIER_DEV_CUDA, &wsb), 0);
	ws = dev_poisoned(wsb), dH = dev_copy(Hb, sizeof Hb), dW = dev_copy(Wb, sizeof Wb), dy = dev_copy(y, sizeof y);
	lse = dev_poisoned(32), loss = dev_poisoned(4), dcnt = dev_poisoned(8);
	assert_int_equal(tier_loss_fwd(gpu, &p, dH, dW, dy, lse, loss, dcnt, ws, wsb), 0);
	fetch(&cnt, dcnt, 8);
	assert_int_equal(cnt, 6);
	tier_dev_free(gpu, ws), tier_dev_free(gpu, dH), tier_dev_free(gpu, dW), tier_dev_free(gpu, dy);
	tier_dev_free(gpu, lse), tier_dev_free(gpu, loss), tier_dev_free(gpu, dcnt);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_odd_shapes),
		cmocka_unit_test(test_large),
		cmocka_unit_test(test_options),
		cmocka_unit_test(test_ignored_and_extreme),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_out_of_range_label),
	};
	int rc;
	if (!tier_cuda_available()) {
		printf("# test_loss_cuda: no CUDA device, skipped\n");
		return 77;
	}
	tier_rng_seed(&rng, test_seed("test_loss_cuda", 0));
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0) || tier_dev_open(&gpu, TIER_DEV_CUDA, 0)) {
		fprintf(stderr, "test_loss_cuda: %s\n", tier_last_error());
		return 1;
	}
	rc = cmocka_run_group_tests(tests, NULL, NULL);
	tier_dev_close(gpu);
	tier_dev_close(cpu);
	return rc;
}
