/* test_moe_cuda.c - the CUDA MoE kernels (router, permute, combine; bf16 storage) against the CPU
 * reference on the same bf16-rounded inputs. Skips (77) without a GPU. */
#include "config.h"
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include "moe/moe_cuda.h"

/* Both sides read the same bf16-rounded values and accumulate in fp32: only the order of the sums
 * differs, so the bar is far below the 1e-2 that bf16 intermediates would need. */
#define CUDA_TOL 1e-4

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
/* Random values rounded to bf16: bits for the GPU, the same values as floats for the CPU. */
static void fill_bf16(float *f, uint16_t *b, size_t n, float scale)
{
	for (size_t i = 0; i < n; i++) {
		b[i] = to_bf16(scale * tier_rng_normal(&rng));
		f[i] = from_bf16(b[i]);
	}
}
static void *up(const void *h, size_t n)
{
	void *d = NULL;
	assert_int_equal(tier_dev_malloc(gpu, n ? n : 4, &d), 0);
	if (h)
		assert_int_equal(tier_dev_memcpy_h2d(gpu, d, h, n), 0);
	return d;
}
static void down(void *h, const void *d, size_t n) { assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, n), 0); }

static void router_case(tier_moe_router_cfg c, int T, int H, float bias_shift)
{
	int E = c.n_experts, k = c.top_k;
	size_t TE = (size_t)T * E, Tk = (size_t)T * k;
	float *x = malloc(4 * (size_t)T * H), *w = malloc(4 * (size_t)E * H), *bias = malloc(4 * (size_t)E);
	uint16_t *xb = malloc(2 * (size_t)T * H), *wb = malloc(2 * (size_t)E * H);
	float *lc = malloc(4 * TE), *twc = malloc(4 * Tk), *lg = malloc(4 * TE), *tw = malloc(4 * Tk);
	int32_t *ic = malloc(4 * Tk), *ig = malloc(4 * Tk);
	fill_bf16(x, xb, (size_t)T * H, 1.0f);
	fill_bf16(w, wb, (size_t)E * H, 0.5f);
	ref_fill(&rng, bias, (size_t)E, 0.1f);
	for (int e = 0; e < E; e++)
		bias[e] += bias_shift;
	int sig = c.kind == TIER_MOE_ROUTER_SIGMOID_GROUP;
	assert_int_equal(tier_moe_router_fwd(cpu, &c, T, H, x, w, sig ? bias : NULL, lc, ic, twc), 0);
	void *dx = up(xb, 2 * (size_t)T * H), *dw = up(wb, 2 * (size_t)E * H), *db = up(bias, 4 * (size_t)E);
	void *dl = up(NULL, 4 * TE), *di = up(NULL, 4 * Tk), *dt = up(NULL, 4 * Tk);
	assert_int_equal(moe_cuda_router_fwd(gpu, &c, T, H, dx, dw, sig ? db : NULL, dl, di, dt), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(lg, dl, 4 * TE), down(ig, di, 4 * Tk), down(tw, dt, 4 * Tk);
	double *lcd = ref_dup(lc, TE), *lgd = ref_dup(lg, TE), *bd = ref_dup(bias, E), wr[TIER_MOE_MAX_TOPK];
	assert_true(ref_relerr(lg, lcd, TE) <= CUDA_TOL);
	for (int t = 0; t < T; t++) {
		double crit[TIER_MOE_MAX_EXPERTS];
		int best[TIER_MOE_MAX_TOPK], sel[TIER_MOE_MAX_TOPK];
		ref_criterion(&c, lcd + (size_t)t * E, sig ? bd : NULL, crit);
		ref_topn(crit, E, k, best);
		for (int j = 0; j < k; j++) { /* the k best up to near-ties between CPU and GPU sums */
			assert_true(ig[t * k + j] >= 0 && ig[t * k + j] < E);
			assert_true(fabs(crit[ig[t * k + j]] - crit[best[j]]) <= 1e-4);
			sel[j] = ig[t * k + j];
		}
		ref_weights(&c, lgd + (size_t)t * E, sel, wr);
		for (int j = 0; j < k; j++)
			assert_true(fabs(tw[t * k + j] - wr[j]) <= CUDA_TOL * (fabs(wr[j]) + 1e-3));
	}
	tier_dev_free(gpu, dx), tier_dev_free(gpu, dw), tier_dev_free(gpu, db), tier_dev_free(gpu, dl);
	tier_dev_free(gpu, di), tier_dev_free(gpu, dt);
	free(x), free(w), free(bias), free(xb), free(wb), free(lc), free(twc), free(lg), free(tw), free(ic), free(ig);
	free(lcd), free(lgd), free(bd);
}

static void test_router(void **state)
{
	(void)state;
	tier_moe_router_cfg q = { TIER_MOE_ROUTER_SOFTMAX_TOPK, 128, 8, 1, 0, 0, 0 };
	tier_moe_router_cfg q0 = { TIER_MOE_ROUTER_SOFTMAX_TOPK, 60, 4, 0, 0, 0, 0 };
	tier_moe_router_cfg m = { TIER_MOE_ROUTER_TOPK_SOFTMAX, 8, 2, 0, 0, 0, 0 };
	tier_moe_router_cfg d = { TIER_MOE_ROUTER_SIGMOID_GROUP, 256, 8, 1, 8, 4, 2.5f };
	tier_moe_router_cfg big = { TIER_MOE_ROUTER_SIGMOID_GROUP, 896, 16, 1, 8, 4, 1.0f };
	tier_moe_router_cfg kE = { TIER_MOE_ROUTER_SOFTMAX_TOPK, 5, 5, 1, 0, 0, 0 };
	router_case(q, 257, 200, 0);
	router_case(q0, 33, 77, 0);
	router_case(m, 1, 4096, 0);
	router_case(d, 61, 7168, 0);
	router_case(d, 13, 64, -1.5f); /* every kept score + bias < 0: HF's 0.0 fill of dropped groups wins */
	router_case(big, 17, 129, 0);
	router_case(kE, 9, 31, 0);
}

static void permute_case(int T, int k, int E, int H, float cf)
{
	int n = T * k, cap = tier_moe_capacity(T, k, E, cf);
	int32_t *idx = malloc(4 * (size_t)n), *oc = malloc(4 * (size_t)(E + 1)), *og = malloc(4 * (size_t)(E + 1));
	int32_t *rc = malloc(4 * (size_t)n), *rg = malloc(4 * (size_t)n), *pc = malloc(4 * (size_t)n), *pg = malloc(4 * (size_t)n);
	int32_t *cc = malloc(4 * (size_t)E), *cg = malloc(4 * (size_t)E);
	float *x = malloc(4 * (size_t)T * H), *xgc = malloc(4 * (size_t)n * H), *tw = malloc(4 * (size_t)n);
	float *y = malloc(4 * (size_t)n * H), *outc = malloc(4 * (size_t)T * H), *outg = malloc(4 * (size_t)T * H);
	uint16_t *xb = malloc(2 * (size_t)T * H), *xgg = malloc(2 * (size_t)n * H), *yb = malloc(2 * (size_t)n * H);
	for (int t = 0; t < T; t++) /* k distinct experts, skewed to the low ones so that capacity bites */
		for (int j = 0; j < k; j++) {
			int e, dup;
			do {
				e = (int)(tier_rng_below(&rng, (uint64_t)E) * tier_rng_uniform(&rng));
				dup = 0;
				for (int i = 0; i < j; i++)
					dup |= idx[t * k + i] == e;
			} while (dup);
			idx[t * k + j] = e;
		}
	fill_bf16(x, xb, (size_t)T * H, 1.0f);
	assert_int_equal(tier_moe_permute(cpu, T, k, E, H, cap, idx, x, oc, rc, pc, cc, xgc), 0);
	void *di = up(idx, 4 * (size_t)n), *dx = up(xb, 2 * (size_t)T * H), *doff = up(NULL, 4 * (size_t)(E + 1));
	void *drp = up(NULL, 4 * (size_t)n), *dpr = up(NULL, 4 * (size_t)n), *dc = up(NULL, 4 * (size_t)E);
	void *dxg = up(NULL, 2 * (size_t)n * H);
	assert_int_equal(moe_cuda_permute(gpu, T, k, E, H, cap, di, dx, doff, drp, dpr, dc, dxg), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(og, doff, 4 * (size_t)(E + 1)), down(rg, drp, 4 * (size_t)n), down(pg, dpr, 4 * (size_t)n);
	down(cg, dc, 4 * (size_t)E), down(xgg, dxg, 2 * (size_t)n * H);
	assert_memory_equal(og, oc, 4 * (size_t)(E + 1));
	assert_memory_equal(rg, rc, 4 * (size_t)n);
	assert_memory_equal(pg, pc, 4 * (size_t)n);
	assert_memory_equal(cg, cc, 4 * (size_t)E);
	for (size_t i = 0; i < (size_t)oc[E] * H; i++)
		assert_true(from_bf16(xgg[i]) == xgc[i]);
	/* combine */
	int rows = oc[E];
	fill_bf16(y, yb, (size_t)n * H, 1.0f);
	ref_fill(&rng, tw, (size_t)n, 1.0f);
	assert_int_equal(tier_moe_combine_fwd(cpu, T, k, H, pc, tw, y, outc), 0);
	void *dy = up(yb, 2 * (size_t)n * H), *dt = up(tw, 4 * (size_t)n), *dout = up(NULL, 4 * (size_t)T * H);
	assert_int_equal(moe_cuda_combine_fwd(gpu, T, k, H, dpr, dt, dy, dout), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(outg, dout, 4 * (size_t)T * H);
	double *ocd = ref_dup(outc, (size_t)T * H);
	assert_true(ref_relerr(outg, ocd, (size_t)T * H) <= CUDA_TOL);
	(void)rows;
	void *ptrs[] = { di, dx, doff, drp, dpr, dc, dxg, dy, dt, dout };
	for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
		tier_dev_free(gpu, ptrs[i]);
	free(idx), free(oc), free(og), free(rc), free(rg), free(pc), free(pg), free(cc), free(cg), free(x), free(xgc);
	free(tw), free(y), free(outc), free(outg), free(xb), free(xgg), free(yb), free(ocd);
}

static void test_permute_combine(void **state)
{
	(void)state;
	permute_case(1000, 8, 128, 96, 0);
	permute_case(777, 8, 128, 33, 1.0f);  /* drops */
	permute_case(3, 16, 896, 8, 0);
	permute_case(1, 2, 4, 5, 0);
	permute_case(4096, 2, 8, 64, 1.25f);
}

static void experts_case(int E, int H, int I, const int *nrows)
{
	int32_t *off = malloc(4 * (size_t)(E + 1));
	off[0] = 0;
	for (int e = 0; e < E; e++)
		off[e + 1] = off[e] + nrows[e];
	int n = off[E];
	float **wf[3];
	void **wd[3];
	const size_t wn[3] = { (size_t)I * H, (size_t)I * H, (size_t)H * I };
	for (int q = 0; q < 3; q++) {
		wf[q] = calloc((size_t)E, sizeof(float *));
		wd[q] = calloc((size_t)E, sizeof(void *));
		for (int e = 0; e < E; e++) {
			uint16_t *b = malloc(2 * wn[q]);
			wf[q][e] = malloc(4 * wn[q]);
			fill_bf16(wf[q][e], b, wn[q], 0.1f);
			wd[q][e] = up(b, 2 * wn[q]);
			free(b);
		}
	}
	float *x = malloc(4 * (size_t)n * H + 4), *gc = malloc(4 * (size_t)n * I + 4), *uc = malloc(4 * (size_t)n * I + 4);
	float *yc = malloc(4 * (size_t)n * H + 4), *gg = malloc(4 * (size_t)n * I + 4), *ug = malloc(4 * (size_t)n * I + 4);
	float *yg = malloc(4 * (size_t)n * H + 4);
	uint16_t *xb = malloc(2 * (size_t)n * H + 2), *yb = malloc(2 * (size_t)n * H + 2);
	void *ws = malloc(tier_moe_experts_ws_bytes(I, n, NULL) + 4);
	fill_bf16(x, xb, (size_t)n * H, 1.0f);
	tier_moe_experts w = { .gate = (const float *const *)wf[0], .up = (const float *const *)wf[1],
			       .down = (const float *const *)wf[2] };
	assert_int_equal(tier_moe_experts_fwd(cpu, E, H, I, off, &w, NULL, x, gc, uc, yc, ws), 0);
	void *dx = up(xb, 2 * (size_t)n * H), *dg = up(NULL, 4 * (size_t)n * I), *du = up(NULL, 4 * (size_t)n * I);
	void *dh = up(NULL, 2 * (size_t)n * I), *dy = up(NULL, 2 * (size_t)n * H);
	assert_int_equal(moe_cuda_experts_fwd(gpu, E, H, I, off, (const void *const *)wd[0], (const void *const *)wd[1],
					      (const void *const *)wd[2], dx, dg, du, dh, dy), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(gg, dg, 4 * (size_t)n * I), down(ug, du, 4 * (size_t)n * I), down(yb, dy, 2 * (size_t)n * H);
	for (size_t i = 0; i < (size_t)n * H; i++)
		yg[i] = from_bf16(yb[i]);
	double *gcd = ref_dup(gc, (size_t)n * I), *ucd = ref_dup(uc, (size_t)n * I), *ycd = ref_dup(yc, (size_t)n * H);
	assert_true(ref_relerr(gg, gcd, (size_t)n * I) <= CUDA_TOL);
	assert_true(ref_relerr(ug, ucd, (size_t)n * I) <= CUDA_TOL);
	assert_true(ref_relerr(yg, ycd, (size_t)n * H) <= 1e-2); /* h and y are stored in bf16 */
	for (int q = 0; q < 3; q++) {
		for (int e = 0; e < E; e++)
			free(wf[q][e]), tier_dev_free(gpu, wd[q][e]);
		free(wf[q]), free(wd[q]);
	}
	void *ptrs[] = { dx, dg, du, dh, dy };
	for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
		tier_dev_free(gpu, ptrs[i]);
	free(off), free(x), free(gc), free(uc), free(yc), free(gg), free(ug), free(yg), free(xb), free(yb), free(ws);
	free(gcd), free(ucd), free(ycd);
}

static void test_experts(void **state)
{
	(void)state;
	static const int r8[] = { 37, 0, 1, 100, 5, 0, 64, 3 };
	experts_case(8, 256, 128, r8);
	static const int r1[] = { 1 };
	experts_case(1, 64, 32, r1);
	static const int rall[] = { 0, 0, 300, 0 }; /* all rows to one expert */
	experts_case(4, 128, 96, rall);
	static const int rodd[] = { 5, 0, 9 }; /* H, I not multiples of 8 */
	experts_case(3, 33, 17, rodd);
}

static void test_bad_input(void **state)
{
	(void)state;
	tier_moe_router_cfg bad = { TIER_MOE_ROUTER_SOFTMAX_TOPK, 4, 5, 0, 0, 0, 0 };
	assert_int_equal(moe_cuda_router_fwd(gpu, &bad, 1, 1, (void *)8, (void *)8, NULL, (float *)8, (int32_t *)8,
					     (float *)8), -EINVAL);
	assert_int_equal(moe_cuda_router_fwd(cpu, &bad, 1, 1, (void *)8, (void *)8, NULL, (float *)8, (int32_t *)8,
					     (float *)8), -EINVAL);
	assert_int_equal(moe_cuda_combine_fwd(gpu, 1, 1, 1, NULL, (float *)8, (void *)8, (float *)8), -EINVAL);
}

static int setup(void **state)
{
	(void)state;
	tier_rng_seed(&rng, ref_seed("test_moe_cuda"));
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0))
		return -1;
	return tier_dev_open(&gpu, TIER_DEV_CUDA, 0);
}

static int teardown(void **state)
{
	(void)state;
	tier_dev_close(gpu);
	tier_dev_close(cpu);
	return 0;
}
#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	if (!tier_cuda_available()) {
		fprintf(stderr, "# test_moe_cuda: no CUDA device, skipped\n");
		return 77;
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_router),
		cmocka_unit_test(test_permute_combine),
		cmocka_unit_test(test_experts),
		cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
#else
	fprintf(stderr, "# test_moe_cuda: built without CUDA, skipped\n");
	return 77;
#endif
}
