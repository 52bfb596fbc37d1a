/* test_moe_dh_swiglu.c - the experts' dh product with SwiGLU's backward in its epilogue
 * (moe_cuda_grouped_dh_swiglu_sm90) against the two steps it replaces on the same GPU: the bf16 dh
 * product (moe_cuda_grouped_mm_sm90_segs, W_e [K, N]) and the elementwise backward
 * (moe_cuda_swiglu_bwd16). dg and du must be the same bits, rows outside the groups untouched; each
 * row's dot of dh and silu(g) u within fp32 rounding of an fp64 sum over the two-step dh. Every
 * tile shape, cp.async and TMA loads, few CTAs, a LoRA-like segment, columns that end inside a
 * 128-column slot, empty and one-row groups; bad arguments refused. Skips (77) without a compute
 * capability 9.0 GPU. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>
#include "env_keep.h"
#ifdef TIER_HAVE_CUDA
#define REF_GPU_TEST "test_moe_dh_swiglu"
#endif
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include "moe/moe_cuda.h"
#include "moe/moe_wgmma.h"

static void *dev_bf16(size_t n, float scale, float *keep)
{
	float *f = keep ? keep : malloc(4 * n + 4);
	for (size_t i = 0; i < n; i++)
		f[i] = ref_rnd_bf16(&rng, scale);
	void *d = ref_dev_bf16(gpu, f, n);
	assert_non_null(d);
	if (!keep)
		free(f);
	return d;
}

static void *dev_poison(size_t bytes)
{
	unsigned char *h = malloc(bytes);
	memset(h, 0xff, bytes);
	void *d = ref_dev_copy(gpu, h, bytes);
	assert_non_null(d);
	free(h);
	return d;
}

static float bf(uint16_t b) { return tier_bf16_to_f32(b); }

/* Two bf16 of one sign at most one unit apart (their bits adjacent). */
static int one_ulp(uint16_t a, uint16_t b)
{
	return (a & 0x8000) == (b & 0x8000) && (a > b ? a - b : b - a) <= 1;
}

/* A problem: E groups of nrows[e] rows, rb = rows + extra (rows past the groups: TMA reads them,
 * nothing may write them); dY [rb, H], g, u [rb, I], down_e [H, I] (the [K, N] layout); with r > 0
 * a segment dZ [rb, r] times A_e [r, I]. */
typedef struct {
	int E, H, I, r, rows, rb;
	int32_t *off;
	void *doff, *dy, *g, *u, *dz, *tab;
	void **down, **a;
	float *gh, *uh; /* g and u as floats */
} dprob;

static void prob_make(dprob *p, int E, int H, int I, int r, const int *nrows, int extra)
{
	memset(p, 0, sizeof *p);
	p->E = E, p->H = H, p->I = I, p->r = r;
	p->off = malloc(4 * (size_t)(E + 1));
	p->off[0] = 0;
	for (int e = 0; e < E; e++)
		p->off[e + 1] = p->off[e] + nrows[e];
	p->rows = p->off[E], p->rb = p->rows + extra;
	size_t rb = (size_t)p->rb;
	p->doff = ref_dev_copy(gpu, p->off, 4 * (size_t)(E + 1));
	p->dy = dev_bf16(rb * H, 0.5f, NULL);
	p->gh = malloc(4 * rb * I + 4), p->uh = malloc(4 * rb * I + 4);
	p->g = dev_bf16(rb * I, 2.0f, p->gh); /* past the sigmoid's knee both ways */
	p->u = dev_bf16(rb * I, 1.0f, p->uh);
	p->down = calloc((size_t)E, sizeof(void *)), p->a = calloc((size_t)E, sizeof(void *));
	for (int e = 0; e < E; e++) {
		if (!nrows[e])
			continue;
		p->down[e] = dev_bf16((size_t)H * I, 0.05f, NULL);
		if (r)
			p->a[e] = dev_bf16((size_t)r * I, 0.1f, NULL);
	}
	if (r) {
		p->dz = dev_bf16(rb * r, 0.5f, NULL);
		p->tab = ref_dev_copy(gpu, NULL, MOE_WG_TAB_BYTES);
	}
}

static void prob_free(dprob *p)
{
	for (int e = 0; e < p->E; e++)
		tier_dev_free(gpu, p->down[e]), tier_dev_free(gpu, p->a[e]);
	void *d[] = { p->doff, p->dy, p->g, p->u, p->dz, p->tab };
	for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
		tier_dev_free(gpu, d[i]);
	free(p->down), free(p->a), free(p->off), free(p->gh), free(p->uh);
}

/* Both ways on the current knobs; what names the run in the messages. */
static void run_one(const dprob *p, const char *what)
{
	size_t rb = (size_t)p->rb, n = rb * p->I, all = 2 * (n + p->I); /* one guard row past rb */
	moe_wg_seg seg = { p->dz, NULL, (const void *const *)p->a, NULL, p->r, 0 };
	int nseg = p->r ? 1 : 0;
	/* the two steps: dh in bf16, then the rows kernel */
	void *dh = dev_poison(2 * n + 16), *dg0 = dev_poison(all), *du0 = dev_poison(all), *dot0 = dev_poison(4 * rb + 4);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, p->E, p->I, p->H, p->doff, p->rb, (const void *const *)p->down,
						       1, p->dy, nseg, &seg, p->tab, dh, 1, 1.0f, 0.0f),
			 0);
	assert_int_equal(moe_cuda_swiglu_bwd16(gpu, (size_t)p->rows, p->I, p->g, p->u, dh, dg0, du0, dot0), 0);
	/* the fused product, its outputs poisoned */
	size_t parts = (size_t)(p->I + 127) / 128;
	void *dg1 = dev_poison(all), *du1 = dev_poison(all), *dot1 = dev_poison(4 * rb + 4);
	void *scratch = dev_poison(4 * rb * parts + 4);
	assert_int_equal(moe_cuda_grouped_dh_swiglu_sm90(gpu, p->E, p->I, p->H, p->doff, p->rb,
							 (const void *const *)p->down, p->dy, nseg, &seg, p->tab, p->g, p->u,
							 dg1, du1, (float *)dot1, (float *)scratch),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	uint16_t *h = malloc(2 * n + 16), *a0 = malloc(all), *b0 = malloc(all), *a1 = malloc(all), *b1 = malloc(all);
	float *d0 = malloc(4 * rb + 4), *d1 = malloc(4 * rb + 4);
	tier_dev_memcpy_d2h(gpu, h, dh, 2 * n);
	tier_dev_memcpy_d2h(gpu, a0, dg0, all), tier_dev_memcpy_d2h(gpu, b0, du0, all);
	tier_dev_memcpy_d2h(gpu, a1, dg1, all), tier_dev_memcpy_d2h(gpu, b1, du1, all);
	tier_dev_memcpy_d2h(gpu, d0, dot0, 4 * rb), tier_dev_memcpy_d2h(gpu, d1, dot1, 4 * rb);
	size_t inside = (size_t)p->rows * p->I, ulp = 0;
	for (size_t i = 0; i < all / 2; i++) {
		int want_poison = i >= inside;
		uint16_t wg = want_poison ? 0xffff : a0[i], wu = want_poison ? 0xffff : b0[i];
		int near = !want_poison && one_ulp(a1[i], wg) && one_ulp(b1[i], wu);
		ulp += near && (a1[i] != wg || b1[i] != wu);
		if ((a1[i] != wg || b1[i] != wu) && !near)
			fprintf(stderr, "# %s: element %zu (row %zu col %zu): dg %04x du %04x, want %04x %04x\n", what, i,
				i / p->I, i % p->I, a1[i], b1[i], wg, wu);
		assert_true(near || (a1[i] == wg && b1[i] == wu));
	}
	/* the same arithmetic on the same values: equal bits but where the compiler contracted a
	 * multiply-add differently in the two places, one bf16 unit at most and rarely */
	if (ulp)
		fprintf(stderr, "# %s: %zu of %zu elements one bf16 unit apart\n", what, ulp, inside);
	assert_true(ulp <= inside / 1000);
	for (int r = 0; r < p->rows; r++) {
		double s = 0.0, mag = 0.0;
		for (int c = 0; c < p->I; c++) {
			size_t i = (size_t)r * p->I + c;
			double x = p->gh[i], t = bf(h[i]) * (x / (1.0 + exp(-x))) * p->uh[i];
			s += t, mag += fabs(t);
		}
		double tol = 1e-5 * mag + 1e-30;
		if (!(fabs(d1[r] - s) <= tol) || !(fabs(d0[r] - s) <= tol))
			fprintf(stderr, "# %s: row %d dot %.9g (two steps %.9g), fp64 %.9g, tolerance %.3g\n", what, r,
				(double)d1[r], (double)d0[r], s, tol);
		assert_true(fabs(d1[r] - s) <= tol);
	}
	for (int r = p->rows; r < p->rb; r++) { /* past the groups: the poison */
		uint32_t bits;
		memcpy(&bits, &d1[r], 4);
		assert_int_equal(bits, 0xffffffffu);
	}
	void *f[] = { dh, dg0, du0, dot0, dg1, du1, dot1, scratch };
	for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
		tier_dev_free(gpu, f[i]);
	free(h), free(a0), free(b0), free(a1), free(b1), free(d0), free(d1);
}

/* Every tile shape with TMA loads (the default, or the run's own setting) and with cp.async, then
 * few CTAs; a NULL tile is the knob unset (auto). The run's own tile and CTAs back at the end. */
static void run_all(const dprob *p)
{
	static const char *const tiles[] = { NULL, "128x256", "128x128", "64x256", "pp64x256", "pp128x128" };
	static const char *const few[][2] = { { NULL, "1" }, { "pp128x128", "1" }, { "64x256", "2" } };
	char what[200];
	env_keep tma_kept, tile_kept, ctas_kept;
	env_save(&tile_kept, "TIER_MOE_WGMMA_TILE"), env_save(&ctas_kept, "TIER_MOE_WGMMA_CTAS");
	for (int tma = 0; tma < 2; tma++) {
		if (tma)
			env_set(&tma_kept, "TIER_MOE_WGMMA_TMA", "0");
		for (size_t t = 0; t < sizeof tiles / sizeof tiles[0]; t++) {
			env_put("TIER_MOE_WGMMA_TILE", tiles[t]);
			snprintf(what, sizeof what, "E %d H %d I %d r %d rows %d tile %s%s", p->E, p->H, p->I, p->r, p->rows,
				 tiles[t] ? tiles[t] : "auto", tma ? " cp.async" : "");
			run_one(p, what);
		}
		if (tma)
			env_back(&tma_kept);
	}
	for (size_t i = 0; i < sizeof few / sizeof few[0]; i++) {
		env_put("TIER_MOE_WGMMA_TILE", few[i][0]);
		env_put("TIER_MOE_WGMMA_CTAS", few[i][1]);
		snprintf(what, sizeof what, "E %d H %d I %d r %d tile %s on %s CTAs", p->E, p->H, p->I, p->r,
			 few[i][0] ? few[i][0] : "auto", few[i][1]);
		run_one(p, what);
	}
	env_back(&tile_kept), env_back(&ctas_kept);
}

static void run_case(int E, int H, int I, int r, const int *nrows, int extra)
{
	dprob p;
	prob_make(&p, E, H, I, r, nrows, extra);
	run_all(&p);
	prob_free(&p);
}

/* Uneven groups with empty and one-row ones; I a whole number of slots, ending inside one, and
 * below one slot; with and without the segment. */
static void test_shapes(void **state)
{
	(void)state;
	int n[24];
	for (int e = 0; e < 24; e++)
		n[e] = (int)tier_rng_below(&rng, 300);
	n[0] = 0, n[1] = 1, n[5] = 0, n[9] = 257, n[23] = 0;
	run_case(24, 264, 256, 16, n, 3);
	run_case(24, 136, 200, 0, n, 0);
	run_case(24, 72, 72, 8, n, 5);
}

/* The trainer's shape at a small batch: I 768 (six slots), H 2048, rank 16. */
static void test_trainer_shape(void **state)
{
	(void)state;
	int n[16];
	for (int e = 0; e < 16; e++)
		n[e] = 100 + (int)tier_rng_below(&rng, 300);
	n[3] = 0;
	run_case(16, 2048, 768, 16, n, 0);
}

static void test_bad_input(void **state)
{
	(void)state;
	int n[2] = { 5, 3 };
	dprob p;
	prob_make(&p, 2, 64, 64, 0, n, 0);
	void *o = dev_poison(2 * 8 * 64), *s = dev_poison(4 * 8);
	const void *const *w = (const void *const *)p.down;
	assert_int_equal(moe_cuda_grouped_dh_swiglu_sm90(gpu, 2, 64, 64, p.doff, 8, w, p.dy, 0, NULL, NULL, p.g, p.u, o,
							 o, NULL, (float *)s),
			 -EINVAL);
	assert_int_equal(moe_cuda_grouped_dh_swiglu_sm90(gpu, 2, 64, 64, p.doff, 8, w, p.dy, 0, NULL, NULL, p.g, p.u, o,
							 (char *)o + 2, (float *)s, (float *)s),
			 -EINVAL);
	assert_int_equal(moe_cuda_grouped_dh_swiglu_sm90(gpu, 2, 60, 64, p.doff, 8, w, p.dy, 0, NULL, NULL, p.g, p.u, o,
							 o, (float *)s, (float *)s),
			 -EINVAL);
	assert_int_not_equal(moe_cuda_grouped_dh_swiglu_sm90(cpu, 2, 64, 64, p.doff, 8, w, p.dy, 0, NULL, NULL, p.g, p.u,
							     o, o, (float *)s, (float *)s),
			     0);
	tier_dev_free(gpu, o), tier_dev_free(gpu, s);
	prob_free(&p);
}

#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes),
		cmocka_unit_test(test_trainer_shape),
		cmocka_unit_test(test_bad_input),
	};
	return ref_gpu_run(tests, sizeof tests / sizeof tests[0], moe_cuda_wgmma_supported);
#else
	fprintf(stderr, "# test_moe_dh_swiglu: built without CUDA, skipped\n");
	return 77;
#endif
}
