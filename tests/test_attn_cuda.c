/* test_attn_cuda.c - the CUDA attention (bf16 q, k, v, o, dout; fp32 lse and gradients) and RoPE
 * against the CPU reference on the same bf16-rounded inputs: odd lengths, head_dim 32..128, GQA
 * 1:1 to 8:1, batches, non-causal, under every kernel variant (TIER_ATTN_FWD, TIER_ATTN_BWD), bad
 * input. Skips (exit 77) without a GPU. */
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
#include "env_keep.h"
#include "test_seed.h"

#define TOL 2e-2
static tier_rng rng;
static tier_dev *cpu, *gpu;

/* The kernel variants of attn/attn_cuda.cu (its fwd_variants and bwd_variants tables). Each case
 * runs max(NFWD, NBWD) times with the pairs (fwd[i % NFWD], bwd[i % NBWD]), so every variant of
 * both lists runs on every shape. */
static const char *const fwd_variants[] = { "v2", "w8", "v1", "wg", "wgo" };
/* wgo runs wg's operations in another overlap: its o and lse must be wg's bits (wg runs first) */
#define FWD_SAME_AS_WG "wgo"
static const char *const bwd_variants[] = { "k128", "q64", "v2", "v1", "wg" };
#define NFWD (sizeof fwd_variants / sizeof fwd_variants[0])
#define NBWD (sizeof bwd_variants / sizeof bwd_variants[0])
#define NVAR (NFWD > NBWD ? NFWD : NBWD)
static const char *cur_fwd = "", *cur_bwd = "";

/* Random values already on the bf16 grid (f) and their bf16 bits (h). */
static void fill_bf16(float *f, uint16_t *h, size_t n, float sd)
{
	for (size_t i = 0; i < n; i++) {
		h[i] = tier_f32_to_bf16(sd * tier_rng_normal(&rng));
		f[i] = tier_bf16_to_f32(h[i]);
	}
}

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
	void *h = malloc(n ? n : 1), *d;
	memset(h, 0xff, n);                                      /* NaN as fp32 and as bf16 */
	d = dev_copy(h, n);
	free(h);
	return d;
}

static void fetch(void *dst, const void *src, size_t n)
{
	assert_int_equal(tier_dev_memcpy_d2h(gpu, dst, src, n), 0);
}

/* max |a - ref| / max(max |ref|, floor), infinite on a NaN. */
static double rel_err(const float *a, const float *ref, size_t n, double floor)
{
	double e = 0, m = floor;
	for (size_t i = 0; i < n; i++) {
		if (isnan(a[i]))
			return INFINITY;
		e = fmax(e, fabs((double)a[i] - ref[i])), m = fmax(m, fabs(ref[i]));
	}
	return e / m;
}

static double max_abs(const float *x, size_t n)
{
	double m = 1e-30;
	for (size_t i = 0; i < n; i++)
		m = fmax(m, fabs(x[i]));
	return m;
}

static void check(const char *what, const tier_attn_params *p, const float *a, const float *ref, size_t n, double floor)
{
	double e = rel_err(a, ref, n, floor);
	print_message("# fwd %-4s bwd %-4s B=%lld S=%lld H=%lld KH=%lld D=%lld causal=%d: %s rel err %.3g%s\n", cur_fwd,
		      cur_bwd, (long long)p->batch, (long long)p->seq, (long long)p->n_heads, (long long)p->n_kv_heads,
		      (long long)p->head_dim, p->causal, what, e, e <= TOL ? "" : " FAIL");
	assert_true(e <= TOL);
}

static void compare(int64_t B, int64_t S, int64_t H, int64_t KH, int64_t D, int causal)
{
	tier_attn_params p;
	size_t nq = (size_t)(B * S * H * D), nk = (size_t)(B * S * KH * D), nl = (size_t)(B * S * H), cws, gws;
	float *f[4], *o = malloc(nq * 4), *lse = malloc(nl * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4);
	float *dv = malloc(nk * 4), *got = malloc(nq * 4), *cw;
	uint16_t *h[4], *ob = malloc(nq * 2), *wg_o = malloc(nq * 2);
	float *wg_lse = malloc(nl * 4);
	int have_wg = 0;
	size_t n[4] = { nq, nk, nk, nq };
	void *d[4], *go, *glse, *gdq, *gdk, *gdv, *gw;
	tier_attn_params_init(&p, B, S, H, KH, D);
	p.causal = causal;
	for (int i = 0; i < 4; i++) {                            /* q, k, v, dout */
		f[i] = malloc(n[i] * 4), h[i] = malloc(n[i] * 2);
		fill_bf16(f[i], h[i], n[i], i == 0 ? 1.5f : 1.0f);
		d[i] = dev_copy(h[i], n[i] * 2);
	}
	assert_int_equal(tier_attn_workspace_bytes(cpu, &p, &cws), 0);
	assert_int_equal(tier_attn_workspace_bytes(gpu, &p, &gws), 0);
	cw = malloc(cws);
	assert_int_equal(tier_attn_fwd(cpu, &p, f[0], f[1], f[2], o, lse, cw, cws), 0);
	assert_int_equal(tier_attn_bwd(cpu, &p, f[0], f[1], f[2], o, lse, f[3], dq, dk, dv, cw, cws), 0);
	for (size_t var = 0; var < NVAR; var++) {
		cur_fwd = fwd_variants[var % NFWD], cur_bwd = bwd_variants[var % NBWD];
		assert_int_equal(setenv("TIER_ATTN_FWD", cur_fwd, 1), 0);
		assert_int_equal(setenv("TIER_ATTN_BWD", cur_bwd, 1), 0);
		go = dev_poisoned(nq * 2), glse = dev_poisoned(nl * 4), gw = dev_poisoned(gws);
		gdq = dev_poisoned(nq * 4), gdk = dev_poisoned(nk * 4), gdv = dev_poisoned(nk * 4);
		assert_int_equal(tier_attn_fwd(gpu, &p, d[0], d[1], d[2], go, glse, gw, gws), 0);
		assert_int_equal(tier_attn_bwd(gpu, &p, d[0], d[1], d[2], go, glse, d[3], gdq, gdk, gdv, gw, gws), 0);
		assert_int_equal(tier_dev_sync(gpu), 0);
		fetch(ob, go, nq * 2);
		for (size_t i = 0; i < nq; i++)
			got[i] = tier_bf16_to_f32(ob[i]);
		check("o", &p, got, o, nq, 1e-30);
		fetch(got, glse, nl * 4);
		check("lse", &p, got, lse, nl, 1.0);
		if (!strcmp(cur_fwd, "wg")) {
			memcpy(wg_o, ob, nq * 2), memcpy(wg_lse, got, nl * 4);
			have_wg = 1;
		} else if (!strcmp(cur_fwd, FWD_SAME_AS_WG)) {
			assert_true(have_wg);
			assert_memory_equal(ob, wg_o, nq * 2);
			assert_memory_equal(got, wg_lse, nl * 4);
		}
		fetch(got, gdq, nq * 4);
		check("dq", &p, got, dq, nq, max_abs(dv, nk));   /* dq, dk vanish at S = 1 */
		fetch(got, gdk, nk * 4);
		check("dk", &p, got, dk, nk, max_abs(dv, nk));
		fetch(got, gdv, nk * 4);
		check("dv", &p, got, dv, nk, 1e-30);
		tier_dev_free(gpu, go), tier_dev_free(gpu, glse), tier_dev_free(gpu, gw);
		tier_dev_free(gpu, gdq), tier_dev_free(gpu, gdk), tier_dev_free(gpu, gdv);
	}
	for (int i = 0; i < 4; i++)
		free(f[i]), free(h[i]), tier_dev_free(gpu, d[i]);
	free(o), free(lse), free(dq), free(dk), free(dv), free(got), free(cw), free(ob), free(wg_o), free(wg_lse);
}

static void test_shapes(void **state)
{
	static const int64_t cases[][6] = {
		{ 1, 77, 4, 1, 64, 1 },  { 3, 77, 4, 4, 128, 1 }, { 1, 1, 8, 2, 128, 1 }, { 3, 1, 4, 1, 64, 1 },
		{ 1, 77, 4, 4, 64, 1 },  { 3, 77, 8, 2, 128, 1 }, { 1, 200, 2, 2, 32, 1 }, { 2, 100, 4, 1, 96, 1 },
		{ 2, 77, 4, 1, 64, 0 },  { 1, 64, 2, 1, 128, 1 }, { 1, 513, 8, 1, 128, 1 }, { 1, 130, 4, 4, 128, 0 },
		{ 1, 1000, 2, 1, 128, 1 }, { 1, 333, 4, 2, 128, 0 }, { 2, 257, 4, 2, 96, 1 }, { 1, 300, 2, 1, 32, 0 },
	};
	env_keep fwd, bwd, dqv, dsv; /* the run's settings, put back after the cases */
	env_save(&fwd, "TIER_ATTN_FWD"), env_save(&bwd, "TIER_ATTN_BWD"); /* compare sets both */
	env_save(&dsv, "TIER_ATTN_BWD_DS");
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		compare(cases[i][0], cases[i][1], cases[i][2], cases[i][3], cases[i][4], (int)cases[i][5]);
	/* the wgmma backward's other paths (head_dim 128; the default is dS by stmatrix and dQ by TMA
	 * reductions): dQ by atomics with dS by stmatrix, then with the scalar dS stores as well */
	env_set(&dqv, "TIER_ATTN_BWD_DQ", "atomic");
	for (int scalar = 0; scalar < 2; scalar++) {
		env_put("TIER_ATTN_BWD_DS", scalar ? "scalar" : "stm");
		for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
			if (cases[i][4] == 128)
				compare(cases[i][0], cases[i][1], cases[i][2], cases[i][3], cases[i][4], (int)cases[i][5]);
	}
	env_back(&dsv), env_back(&dqv), env_back(&fwd), env_back(&bwd);
}

/* RoPE: the forward on bf16 against the CPU on the same rounded values; the backward (fp32) tight.
 * head_dim 128 takes the per-token kernel (16-byte accesses), 36 (half not a multiple of 8) the
 * per-pair one. */
static void rope_case(int head_dim)
{
	tier_rope_params r = { .tokens = 2 * 77, .seq = 77, .n_heads = 4, .head_dim = head_dim, .theta = 1e6f };
	size_t n = (size_t)(r.tokens * r.n_heads * r.head_dim);
	float *x = malloc(n * 4), *y = malloc(n * 4);
	uint16_t *h = malloc(n * 2);
	int32_t *pos = malloc((size_t)r.tokens * 4);
	void *gx, *gp;
	for (int64_t t = 0; t < r.tokens; t++)
		pos[t] = (int32_t)tier_rng_below(&rng, 4096);
	for (int with_pos = 0; with_pos < 2; with_pos++) {
		const int32_t *cp = with_pos ? pos : NULL;
		fill_bf16(x, h, n, 1.0f);
		gx = dev_copy(h, n * 2), gp = dev_copy(pos, (size_t)r.tokens * 4);
		assert_int_equal(tier_attn_rope_fwd(gpu, &r, with_pos ? gp : NULL, gx), 0);
		assert_int_equal(tier_attn_rope_fwd(cpu, &r, cp, x), 0);
		fetch(h, gx, n * 2);
		for (size_t i = 0; i < n; i++)
			y[i] = tier_bf16_to_f32(h[i]);
		assert_true(rel_err(y, x, n, 1e-30) <= TOL);
		tier_dev_free(gpu, gx);
		gx = dev_copy(x, n * 4);
		assert_int_equal(tier_attn_rope_bwd(gpu, &r, with_pos ? gp : NULL, gx), 0);
		assert_int_equal(tier_attn_rope_bwd(cpu, &r, cp, x), 0);
		fetch(y, gx, n * 4);
		assert_true(rel_err(y, x, n, 1e-30) <= 1e-4);
		tier_dev_free(gpu, gx), tier_dev_free(gpu, gp);
	}
	free(x), free(y), free(h), free(pos);
}

static void test_rope(void **state)
{
	(void)state;
	rope_case(128);
	rope_case(36);
}

/* The backward with name=value set refuses (-EINVAL) and names the setting; the run's own value
 * of name back after. */
static void bwd_refuses(const tier_attn_params *p, char *b, size_t bytes, const char *name, const char *value)
{
	char want[64];
	env_keep k;
	snprintf(want, sizeof want, "%s=%s", name, value);
	env_set(&k, name, value);
	tier_clear_error();
	assert_int_equal(tier_attn_bwd(gpu, p, b, b, b, b, (float *)b, b, (float *)b, (float *)b, (float *)b, b, bytes),
			 -EINVAL);
	assert_non_null(strstr(tier_last_error(), want));
	env_back(&k);
}

static void test_bad_input(void **state)
{
	tier_attn_params p;
	size_t bytes;
	env_keep k;
	void *buf = dev_poisoned(1 << 16);
	char *b = buf;
	tier_attn_params_init(&p, 1, 8, 4, 2, 24);
	tier_clear_error();
	assert_int_equal(tier_attn_workspace_bytes(gpu, &p, &bytes), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "head_dim"));
	p.head_dim = 64;
	assert_int_equal(tier_attn_workspace_bytes(gpu, &p, &bytes), 0);
	tier_clear_error();
	assert_int_equal(tier_attn_fwd(gpu, &p, b + 2, b, b, b, (float *)b, b, bytes), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "aligned"));
	/* An unknown kernel variant fails before any launch and names the variable. */
	env_set(&k, "TIER_ATTN_FWD", "nope");
	assert_int_equal(tier_attn_fwd(gpu, &p, b, b, b, b, (float *)b, b, bytes), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "TIER_ATTN_FWD=nope"));
	env_back(&k);
	bwd_refuses(&p, b, bytes, "TIER_ATTN_BWD", "nope");
	tier_dev_free(gpu, buf);
	/* unknown values of the wgmma backward's switches: refused by name before any kernel, on any
	 * device (attn_cuda_bwd checks them whichever kernel would run) */
	tier_attn_params_init(&p, 1, 8, 4, 2, 128);
	assert_int_equal(tier_attn_workspace_bytes(gpu, &p, &bytes), 0);
	buf = dev_poisoned(bytes + 8 * 4 * 128 * 4), b = buf;
	env_set(&k, "TIER_ATTN_BWD", "wg");
	bwd_refuses(&p, b, bytes, "TIER_ATTN_BWD_DQ", "nope");
	bwd_refuses(&p, b, bytes, "TIER_ATTN_BWD_DS", "nope");
	bwd_refuses(&p, b, bytes, "TIER_ATTN_BWD_DEBUG", "nope");
	env_back(&k);
	tier_dev_free(gpu, buf);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes),
		cmocka_unit_test(test_rope),
		cmocka_unit_test(test_bad_input),
	};
	int rc;
	if (!tier_cuda_available()) {
		printf("# test_attn_cuda: no CUDA device, skipped\n");
		return 77;
	}
	tier_rng_seed(&rng, test_seed("test_attn_cuda", 0));
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0) || tier_dev_open(&gpu, TIER_DEV_CUDA, 0)) {
		fprintf(stderr, "test_attn_cuda: %s\n", tier_last_error());
		return 1;
	}
	rc = cmocka_run_group_tests(tests, NULL, NULL);
	tier_dev_close(gpu);
	tier_dev_close(cpu);
	return rc;
}
