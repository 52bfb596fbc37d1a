/* test_moe_wgmma.c - the Hopper grouped GEMMs (moe/moe_wgmma.cu) against an fp64 reference on
 * bf16-rounded inputs: both weight layouts (W_e [N, K] and [K, N]) and the fused gate/up + SwiGLU,
 * every CTA tile shape, fp32 and bf16 C, alpha and beta, empty, one-row and many-tile groups, up to
 * 1024 experts, few CTAs (many tiles through one ring), rows outside the groups untouched, bad
 * arguments refused. Skips (77) without a compute capability 9.0 GPU. It runs whole under any
 * setting of TIER_MOE_WGMMA_IDLE (idle consumers skip their products under 1), and some products
 * under the others; each form (forms[]: CTA pairs, TMA stores, either tile schedule) runs the
 * 128-row tiles' cases. */
#include "config.h"
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>
#include "env_keep.h"
#ifdef TIER_HAVE_CUDA
#define REF_GPU_TEST "test_moe_wgmma"
#endif
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include "base/tmap_cuda.h"
#include "moe/moe_wgmma.h"

/* Both sides multiply the same bf16 values; the GPU sums in fp32 (in another order), which stays
 * far below 1e-3 of the largest output. bf16 C adds one rounding (2^-9 relative). */
#define F32_TOL 1e-3
#define BF16_TOL 1e-2

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
static void *up_bf16(const float *f, size_t n)
{
	void *d = ref_dev_bf16(gpu, f, n);
	assert_non_null(d);
	return d;
}

/* W [N, K] as bf16 [K, N]: the w_kn 1 layout of the same weights. */
static void *up_bf16_t(const float *f, int N, int K)
{
	void *d = ref_dev_bf16_t(gpu, f, (size_t)N, (size_t)K);
	assert_non_null(d);
	return d;
}

/* ---- a problem: groups, bf16-rounded x and W_e on both sides, the fp64 reference x W_e^T ---- */
/* A gate/up problem has N = 2 I: W_e stacks gate_e (rows 0..I-1) over up_e, so the reference holds g
 * in its first I columns and u in the last I; the device gets gate_e and up_e as separate buffers. */
typedef struct {
	int E, N, K, rows, rb; /* rb: rows_bound = rows + extra rows that belong to no group */
	int32_t *off;
	float *x, **w;
	double *ref; /* [rows, N] */
	void *dx, *doff;
	void **dw[2]; /* W_e [N, K] and [K, N] (w_kn 0 and 1); gate/up: gate_e and up_e [I, K] */
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

/* Weights only for the experts that have rows: the others stay NULL, as the API allows. gu: a
 * gate/up problem (N = 2 I). */
static void prob_make(wprob *p, int E, int N, int K, const int *nrows, int extra, int gu)
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
	p->dw[0] = calloc((size_t)E, sizeof *p->dw[0]);
	p->dw[1] = calloc((size_t)E, sizeof *p->dw[1]);
	for (int e = 0; e < E; e++) {
		if (!nrows[e])
			continue;
		size_t half = (size_t)N / 2 * K;
		p->w[e] = malloc(4 * (size_t)N * K);
		for (size_t i = 0; i < (size_t)N * K; i++)
			p->w[e][i] = rnd_bf16(0.1f);
		p->dw[0][e] = gu ? up_bf16(p->w[e], half) : up_bf16(p->w[e], (size_t)N * K);
		p->dw[1][e] = gu ? up_bf16(p->w[e] + half, half) : up_bf16_t(p->w[e], N, K);
	}
	p->dx = up_bf16(p->x, xn);
	p->doff = up(p->off, 4 * (size_t)(E + 1));
	prob_ref(p);
}

static void prob_free(wprob *p)
{
	for (int e = 0; e < p->E; e++) {
		free(p->w[e]);
		tier_dev_free(gpu, p->dw[0][e]), tier_dev_free(gpu, p->dw[1][e]);
	}
	tier_dev_free(gpu, p->dx), tier_dev_free(gpu, p->doff);
	free(p->w), free(p->dw[0]), free(p->dw[1]), free(p->off), free(p->x), free(p->ref);
}

/* ---- one call and its checks ---- */
/* TIER_MOE_WGMMA_TMA for a sweep (tma_put), then the run's own value back (tma_back): the parts
 * that do not set it run under the run's setting, as bench/validate-forms.sh means them to. */
static env_keep tma_run;

static void tma_put(const char *value) { env_sweep(&tma_run, "TIER_MOE_WGMMA_TMA", value); }
static void tma_back(void) { env_back(&tma_run); }

/* The tile and CTA knobs of moe_wgmma.h for a sweep (knobs; NULL unsets: the default), then the
 * run's own values back (knobs_back), as tma_put and tma_back do for the loads. */
static env_keep knob_run[2];

static void knobs(const char *tile, const char *ctas)
{
	env_sweep(&knob_run[0], "TIER_MOE_WGMMA_TILE", tile);
	env_sweep(&knob_run[1], "TIER_MOE_WGMMA_CTAS", ctas);
}

static void knobs_back(void) { env_back(&knob_run[0]), env_back(&knob_run[1]); }

/* The forms that each run must take whatever the defaults pick (TMA loads required): CTA pairs, the
 * TMA-store epilogue, and both tile schedules (unset, the schedule follows the groups' mean size);
 * their knob and launch counter. */
static const struct {
	const char *knob, *value, *name;
	unsigned long long (*launches)(void);
	int bf16_only; /* a product with an fp32 C does not take it */
} forms[] = {
	{ "TIER_MOE_WGMMA_CLUSTER", "2", "pairs", moe_cuda_wgmma_pair_launches, 0 },
	{ "TIER_MOE_WGMMA_EPI", "tma", "TMA stores", moe_cuda_wgmma_tma_store_launches, 1 },
	{ "TIER_MOE_WGMMA_SCHED", "static", "fixed order", moe_cuda_wgmma_fixed_launches, 0 },
	{ "TIER_MOE_WGMMA_SCHED", "dynamic", "claimed tiles", moe_cuda_wgmma_dynamic_launches, 0 },
};
#define NFORMS (sizeof forms / sizeof forms[0])

/* the run's own setting of each knob that form_on set, in the order it set them */
static env_keep form_kept[NFORMS];
static size_t form_nkept;

/* The run's own settings back after a form, in the reverse order of form_on's. */
static void form_off(void)
{
	while (form_nkept)
		env_back(&form_kept[--form_nkept]);
}

/* Form f alone: the other forms' knobs empty (their defaults) while it runs, as some do not combine
 * (CTA pairs take only the fixed order), f's own set last (two forms share the schedule's knob). */
static void form_on(size_t f)
{
	form_off(); /* a form that an assertion left (cmocka jumps past its form_off): its knobs back first */
	for (size_t g = 0; g < NFORMS; g++)
		if (g != f)
			env_set(&form_kept[form_nkept++], forms[g].knob, "");
	env_set(&form_kept[form_nkept++], forms[f].knob, forms[f].value);
}

/* Form f's launches since n0: one where the call launched in it (want), else none. */
static void form_ran(size_t f, unsigned long long n0, int want)
{
	assert_int_equal(forms[f].launches() - n0, want);
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
		uint16_t b = tier_f32_to_bf16(cf[i]);
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
			g[i] = tier_bf16_to_f32(b);
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

static void run_one(const wprob *p, int w_kn, int c_bf16, float alpha, int beta, const char *what)
{
	size_t cn = (size_t)(p->rb + 1) * p->N, bytes = (c_bf16 ? 2 : 4) * cn;
	float *cf = malloc(4 * cn);
	unsigned char *c0 = c_start(p, c_bf16, beta, cf), *got = malloc(bytes);
	void *dc = up(c0, bytes);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, p->E, p->N, p->K, p->doff, p->rb, (const void *const *)p->dw[w_kn],
						  w_kn, p->dx, dc, c_bf16, alpha, (float)beta),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, dc, bytes);
	c_check(p, got, c0, cf, c_bf16, alpha, beta, what);
	tier_dev_free(gpu, dc);
	free(cf), free(c0), free(got);
}

/* The tile shapes (NULL: the default pick) and the output kinds a pass runs. */
static const char *const all_tiles[] = { NULL, "128x256", "128x128", "64x256", "pp64x256", "pp128x128" };
static const struct {
	int c_bf16;
	float alpha;
	int beta;
} kinds[] = { { 0, 1.0f, 0 }, { 0, 0.37f, 1 }, { 1, 0.37f, 0 }, { 1, 1.0f, 1 } };

/* A run on few CTAs: a CTA's ring then carries many tiles, its phases wrapping many times. */
typedef struct {
	const char *tile, *ctas;
	int c_bf16;
	float alpha;
	int beta;
	const char *label;
} few_run;

/* One loader's pass in layout kn (tag names it in the messages): every tile shape with the output
 * kinds i0, i0 + di, ..., then the few-CTA runs. */
static void run_pass(const wprob *p, int kn, const char *tag, size_t i0, size_t di, const few_run *few, size_t nfew)
{
	char what[160];
	for (size_t t = 0; t < sizeof all_tiles / sizeof all_tiles[0]; t++)
		for (size_t i = i0; i < sizeof kinds / sizeof kinds[0]; i += di) {
			knobs(all_tiles[t], NULL);
			snprintf(what, sizeof what, "%sE %d N %d K %d rows %d w_kn %d tile %s c_bf16 %d alpha %g beta %d", tag,
				 p->E, p->N, p->K, p->rows, kn, all_tiles[t] ? all_tiles[t] : "auto", kinds[i].c_bf16,
				 (double)kinds[i].alpha, kinds[i].beta);
			run_one(p, kn, kinds[i].c_bf16, kinds[i].alpha, kinds[i].beta, what);
		}
	for (size_t r = 0; r < nfew; r++) {
		knobs(few[r].tile, few[r].ctas);
		snprintf(what, sizeof what, "%sE %d N %d K %d rows %d w_kn %d, %s", tag, p->E, p->N, p->K, p->rows, kn,
			 few[r].label);
		run_one(p, kn, few[r].c_bf16, few[r].alpha, few[r].beta, what);
	}
}

/* In both weight layouts, with cp.async: every tile shape with each output kind, then few CTAs (in
 * pp128x128 the two consumers' turns and ring parities over many tiles); then the same with the TMA
 * loads required (a fallback to cp.async fails the call), half the output kinds in each layout. */
/* Form f (TMA required) in layout kn: both 128-row tiles with every output kind, then few CTAs
 * (one and two pairs) on many tiles each; every call that the form applies to must have run in it
 * (a bf16 C with beta 1 takes the TMA-store kernel, which adds to it as before; an fp32 C does not). */
static void run_form(const wprob *p, int kn, size_t f)
{
	static const few_run runs[] = {
		{ "128x256", NULL, 0, 1.0f, 0, "128x256" },	      { "128x256", NULL, 0, 0.37f, 1, "128x256" },
		{ "128x256", NULL, 1, 0.37f, 0, "128x256" },	      { "128x256", NULL, 1, 1.0f, 1, "128x256" },
		{ "128x128", NULL, 0, 0.37f, 1, "128x128" },	      { "128x128", NULL, 1, 1.0f, 0, "128x128" },
		{ "128x256", "2", 1, 0.37f, 0, "128x256 on 2 CTAs" }, { "128x128", "3", 0, 1.0f, 1, "128x128 on 3 CTAs" },
		{ "128x256", "4", 0, 0.37f, 1, "128x256 on 4 CTAs" },
	};
	char what[160];
	tma_put("require");
	form_on(f);
	for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
		unsigned long long n0 = forms[f].launches();
		knobs(runs[r].tile, runs[r].ctas);
		snprintf(what, sizeof what, "%s E %d N %d K %d rows %d w_kn %d, %s c_bf16 %d alpha %g beta %d", forms[f].name,
			 p->E, p->N, p->K, p->rows, kn, runs[r].label, runs[r].c_bf16, (double)runs[r].alpha, runs[r].beta);
		run_one(p, kn, runs[r].c_bf16, runs[r].alpha, runs[r].beta, what);
		form_ran(f, n0, p->rb > 0 && (runs[r].c_bf16 || !forms[f].bf16_only));
	}
	form_off();
	tma_back();
	knobs_back();
}

/* TIER_MOE_WGMMA_IDLE=other on the 128-row tiles, in the schedule the run's settings pick: with 1,
 * a consumer whose 64 rows of a 128-row tile all lie past its group's end skips its products; with
 * 0 it multiplies them. */
static void run_idle(const wprob *p, int kn, const char *other)
{
	static const few_run runs[] = {
		{ "128x256", "2", 1, 1.0f, 0, "128x256 on 2 CTAs" },
		{ "128x128", NULL, 0, 0.37f, 1, "128x128" },
		{ "128x256", NULL, 0, 0.37f, 0, "128x256" },
	};
	char what[160];
	env_keep k;
	env_set(&k, "TIER_MOE_WGMMA_IDLE", other);
	for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
		knobs(runs[r].tile, runs[r].ctas);
		snprintf(what, sizeof what, "idle %s E %d N %d K %d rows %d w_kn %d, %s", other, p->E, p->N, p->K,
			 p->rows, kn, runs[r].label);
		run_one(p, kn, runs[r].c_bf16, runs[r].alpha, runs[r].beta, what);
	}
	env_back(&k);
	knobs_back();
}

/* The settings of TIER_MOE_WGMMA_IDLE other than the run's (the whole test runs under any). Unset,
 * the launch picks by the schedule, which follows the groups' size: then both 0 and 1 run. */
static void run_idle_other(const wprob *p, int kn)
{
	const char *cur = getenv("TIER_MOE_WGMMA_IDLE");
	if (!cur || !*cur)
		run_idle(p, kn, "0"), run_idle(p, kn, "1");
	else
		run_idle(p, kn, strcmp(cur, "0") ? "0" : "1");
}

/* TIER_MOE_WGMMA_TILE=swap (TMA loads required): every output kind on all CTAs, on 1 and on 3 (a
 * CTA's ring over many tiles); in layout 0 each call is one launch of the swapped kernel, in layout 1
 * the knob leaves the product on its default tile (no swapped launch), as it does without TMA. */
static void run_swap(const wprob *p, int kn)
{
	static const char *const ctas[] = { NULL, "1", "3" };
	char what[160];
	tma_put("require");
	for (size_t c = 0; c < sizeof ctas / sizeof ctas[0]; c++)
		for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
			unsigned long long n0 = moe_cuda_wgmma_swap_launches();
			knobs("swap", ctas[c]);
			snprintf(what, sizeof what, "swap E %d N %d K %d rows %d w_kn %d CTAs %s c_bf16 %d alpha %g beta %d",
				 p->E, p->N, p->K, p->rows, kn, ctas[c] ? ctas[c] : "all", kinds[i].c_bf16,
				 (double)kinds[i].alpha, kinds[i].beta);
			run_one(p, kn, kinds[i].c_bf16, kinds[i].alpha, kinds[i].beta, what);
			assert_int_equal(moe_cuda_wgmma_swap_launches() - n0, !kn && p->rb > 0);
		}
	/* without the TMA loads the knob leaves the product on its default tile */
	unsigned long long n0 = moe_cuda_wgmma_swap_launches();
	tma_put("0");
	knobs("swap", NULL);
	snprintf(what, sizeof what, "swap without TMA E %d N %d K %d rows %d w_kn %d", p->E, p->N, p->K, p->rows, kn);
	run_one(p, kn, 1, 0.37f, 0, what);
	assert_int_equal(moe_cuda_wgmma_swap_launches() - n0, 0);
	tma_back();
	knobs_back();
}

static void run_all(const wprob *p)
{
	static const few_run cp_few[] = {
		{ NULL, "2", 0, 1.0f, 0, "2 CTAs" },
		{ "64x256", "1", 1, 0.37f, 1, "64x256 on 1 CTA" },
		{ "pp128x128", "1", 0, 0.37f, 1, "pp128x128 on 1 CTA" },
		{ "pp64x256", "3", 1, 1.0f, 0, "pp64x256 on 3 CTAs" },
	};
	static const few_run tma_few[] = {
		{ "pp128x128", "1", 1, 0.37f, 0, "pp128x128 on 1 CTA" },
		{ "128x256", "2", 0, 1.0f, 0, "128x256 on 2 CTAs" },
		{ "64x256", "1", 1, 1.0f, 1, "64x256 on 1 CTA" },
	};
	for (int kn = 0; kn < 2; kn++) {
		tma_put("0");
		run_pass(p, kn, "", 0, 1, cp_few, sizeof cp_few / sizeof cp_few[0]);
		tma_put("require");
		run_pass(p, kn, "TMA ", (size_t)kn, 2, tma_few, sizeof tma_few / sizeof tma_few[0]);
		tma_back();
		knobs_back();
		for (size_t f = 0; f < NFORMS; f++)
			run_form(p, kn, f);
		run_idle_other(p, kn);
		run_swap(p, kn);
	}
}

static void run_case(int E, int N, int K, const int *nrows, int extra)
{
	wprob p;
	prob_make(&p, E, N, K, nrows, extra, 0);
	run_all(&p);
	prob_free(&p);
}

/* ---- the fused gate/up ---- */
/* Bytes [from, to) of got still hold the poison 0xff. */
static void untouched(const unsigned char *got, size_t from, size_t to, const char *buf, const char *what)
{
	for (size_t i = from; i < to; i++) {
		if (got[i] != 0xff)
			fprintf(stderr, "# %s: byte %zu of %s, outside the groups, changed\n", what, i, buf);
		assert_int_equal(got[i], 0xff);
	}
}

static void gu_check(const char *buf, const float *got, const double *want, size_t n, double tol, const char *what)
{
	double err = ref_relerr(got, want, n);
	if (!(err <= tol))
		fprintf(stderr, "# %s: %s relative error %g > %g\n", what, buf, err, tol);
	assert_true(err <= tol);
}

/* One call on g, u and h (bf16) poisoned with 0xff (NaN), rb + 1 rows each: g and u against the
 * reference, h against silu(g) u of the fp64 reference, the bytes past the groups unchanged. */
static void gu_one(const wprob *p, const moe_wg_seg *seg, void *tab, const char *what)
{
	int I = p->N / 2;
	size_t rn = (size_t)p->rows * I, all = (size_t)(p->rb + 1) * I;
	unsigned char *poison = malloc(2 * all + 2);
	memset(poison, 0xff, 2 * all + 2);
	void *dg = up(poison, 2 * all), *du = up(poison, 2 * all), *dh = up(poison, 2 * all);
	int K = p->K - (seg ? seg->K0 + seg->K1 : 0); /* the main segment's k */
	if (seg)
		assert_int_equal(moe_cuda_grouped_gate_up_sm90_lora(gpu, p->E, K, I, p->doff, p->rb,
								    (const void *const *)p->dw[0], (const void *const *)p->dw[1],
								    p->dx, seg, tab, dg, du, dh),
				 0);
	else
		assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, p->E, K, I, p->doff, p->rb, (const void *const *)p->dw[0],
							       (const void *const *)p->dw[1], p->dx, dg, du, dh),
				 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	float *g = malloc(4 * rn + 4), *u = malloc(4 * rn + 4), *h = malloc(4 * rn + 4);
	uint16_t *gb = malloc(2 * all + 2), *ub = malloc(2 * all + 2), *hb = malloc(2 * all + 2);
	double *wg = malloc(8 * rn + 8), *wu = malloc(8 * rn + 8), *wh = malloc(8 * rn + 8);
	down(gb, dg, 2 * all), down(ub, du, 2 * all), down(hb, dh, 2 * all);
	for (size_t i = 0; i < rn; i++) {
		size_t r = i / I, c = i % I;
		wg[i] = p->ref[r * p->N + c];
		wu[i] = p->ref[r * p->N + I + c];
		wh[i] = wg[i] / (1.0 + exp(-wg[i])) * wu[i];
		g[i] = tier_bf16_to_f32(gb[i]), u[i] = tier_bf16_to_f32(ub[i]), h[i] = tier_bf16_to_f32(hb[i]);
	}
	gu_check("g", g, wg, rn, BF16_TOL, what);
	gu_check("u", u, wu, rn, BF16_TOL, what);
	gu_check("h", h, wh, rn, BF16_TOL, what);
	untouched((const unsigned char *)gb, 2 * rn, 2 * all, "g", what);
	untouched((const unsigned char *)ub, 2 * rn, 2 * all, "u", what);
	untouched((const unsigned char *)hb, 2 * rn, 2 * all, "h", what);
	tier_dev_free(gpu, dg), tier_dev_free(gpu, du), tier_dev_free(gpu, dh);
	free(poison), free(g), free(u), free(h), free(gb), free(ub), free(hb), free(wg), free(wu), free(wh);
}

/* Every tile shape and the default pick, then few CTAs. */
static void gu_case(int E, int H, int I, const int *nrows, int extra)
{
	static const char *runs[][2] = { { NULL, NULL },	{ "128x256", NULL },  { "128x128", NULL },
					 { "64x256", NULL },	{ "pp64x256", NULL }, { "pp128x128", NULL },
					 { NULL, "2" },		{ "64x256", "1" },    { "pp64x256", "1" },
					 { "pp128x128", "2" },	{ "swap", NULL } };
	wprob p;
	char what[160];
	prob_make(&p, E, 2 * I, H, nrows, extra, 1);
	for (int tma = 0; tma < 2; tma++) { /* cp.async, then the TMA loads (required but where 64x256 may run) */
		for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
			/* swap: gate/up takes its default tile */
			int may_64 = !runs[i][0] || !strcmp(runs[i][0], "64x256") || !strcmp(runs[i][0], "swap");
			tma_put(!tma ? "0" : may_64 ? "1" : "require");
			knobs(runs[i][0], runs[i][1]);
			snprintf(what, sizeof what, "gate/up%s E %d H %d I %d rows %d tile %s CTAs %s", tma ? " TMA" : "", E,
				 H, I, p.rows, runs[i][0] ? runs[i][0] : "auto", runs[i][1] ? runs[i][1] : "all");
			gu_one(&p, NULL, NULL, what);
		}
		tma_back();
	}
	/* each form (TMA required): both 128-row tiles, then few CTAs on many tiles */
	static const char *fruns[][2] = { { "128x256", NULL }, { "128x128", NULL }, { "128x256", "2" }, { "128x128", "4" } };
	tma_put("require");
	for (size_t f = 0; f < NFORMS; f++) {
		form_on(f);
		for (size_t i = 0; i < sizeof fruns / sizeof fruns[0]; i++) {
			unsigned long long n0 = forms[f].launches();
			knobs(fruns[i][0], fruns[i][1]);
			snprintf(what, sizeof what, "gate/up %s E %d H %d I %d rows %d tile %s CTAs %s", forms[f].name, E, H, I,
				 p.rows, fruns[i][0], fruns[i][1] ? fruns[i][1] : "all");
			gu_one(&p, NULL, NULL, what);
			form_ran(f, n0, p.rb > 0);
		}
		form_off();
	}
	tma_back();
	knobs_back();
	prob_free(&p);
}

/* ---- extra K segments ----
 * A product with segments is the product over the concatenated k: x [rows, Kt] and W_e [N, Kt] of a
 * problem with K = Kt are cut by columns into the main part (the first kw[0] k) and the segments'
 * halves (kw[1 + 2 q], kw[2 + 2 q]), each its own device buffer, and the reference stays x W_e^T. */
#define MAX_PARTS (1 + 2 * MOE_WG_SEGS)

typedef struct {
	int np, kw[MAX_PARTS], k0[MAX_PARTS]; /* widths and first k of the parts */
	void *x[MAX_PARTS];                    /* bf16 [rb, kw] */
	void **w[MAX_PARTS];                   /* per expert: its columns of W_e rows [row0, row0 + n) */
	void *tab;
	moe_wg_seg seg[MOE_WG_SEGS];
} cut;

/* Columns [k0, k0 + kw) of rows [row0, row0 + n) of m [*, Kt] as bf16 [n, kw] (kn 0) or [kw, n]. */
static void *slice_up(const float *m, int Kt, int row0, int n, int k0, int kw, int kn)
{
	float *t = malloc(4 * (size_t)n * kw + 4);
	for (int i = 0; i < n; i++)
		for (int j = 0; j < kw; j++)
			t[kn ? (size_t)j * n + i : (size_t)i * kw + j] = m[(size_t)(row0 + i) * Kt + k0 + j];
	void *d = up_bf16(t, (size_t)n * kw);
	free(t);
	return d;
}

/* The parts of p for nseg segments; kn: W_e's layout; gu: a gate/up problem, whose segments' first
 * halves take the gate rows and second halves the up rows. */
static void cut_make(cut *c, const wprob *p, const int *kw, int nseg, int kn, int gu)
{
	memset(c, 0, sizeof *c);
	c->np = 1 + 2 * nseg;
	for (int i = 0, k = 0; i < c->np; k += kw[i++])
		c->kw[i] = kw[i], c->k0[i] = k;
	int I = p->N / 2;
	for (int i = 0; i < c->np; i++) {
		if (!c->kw[i])
			continue;
		c->x[i] = slice_up(p->x, p->K, 0, p->rb, c->k0[i], c->kw[i], 0);
		c->w[i] = calloc((size_t)p->E, sizeof(void *));
		for (int e = 0; e < p->E; e++) {
			if (!p->w[e])
				continue;
			/* gate/up: the main part's gate rows (its up rows go to dw-like w2 below), else by half */
			int row0 = gu && i > 0 && i % 2 == 0 ? I : 0, n = gu ? I : p->N;
			c->w[i][e] = slice_up(p->w[e], p->K, row0, n, c->k0[i], c->kw[i], kn);
		}
	}
	for (int q = 0; q < nseg; q++) {
		moe_wg_seg *sg = &c->seg[q];
		sg->K0 = c->kw[1 + 2 * q], sg->K1 = c->kw[2 + 2 * q];
		sg->x0 = c->x[1 + 2 * q], sg->x1 = c->x[2 + 2 * q];
		sg->w0 = (const void *const *)c->w[1 + 2 * q], sg->w1 = (const void *const *)c->w[2 + 2 * q];
	}
	c->tab = up(NULL, MOE_WG_TAB_BYTES);
}

static void cut_free(cut *c, int E)
{
	for (int i = 0; i < c->np; i++) {
		for (int e = 0; c->w[i] && e < E; e++)
			tier_dev_free(gpu, c->w[i][e]);
		free(c->w[i]);
		tier_dev_free(gpu, c->x[i]);
	}
	tier_dev_free(gpu, c->tab);
}

static void seg_one(const wprob *p, const cut *c, int nseg, int kn, int c_bf16, float alpha, int beta, const char *what)
{
	size_t cn = (size_t)(p->rb + 1) * p->N, bytes = (c_bf16 ? 2 : 4) * cn;
	float *cf = malloc(4 * cn);
	unsigned char *c0 = c_start(p, c_bf16, beta, cf), *got = malloc(bytes);
	void *dc = up(c0, bytes);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, p->E, p->N, c->kw[0], p->doff, p->rb, (const void *const *)c->w[0],
						       kn, c->x[0], nseg, c->seg, c->tab, dc, c_bf16, alpha, (float)beta),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, dc, bytes);
	c_check(p, got, c0, cf, c_bf16, alpha, beta, what);
	tier_dev_free(gpu, dc);
	free(cf), free(c0), free(got);
}

/* Both layouts, every tile, two output kinds, then 2 CTAs (the ring carries main and extra stages
 * of many tiles). kw: 1 + 2 nseg widths summing to K. */
static void seg_case(int E, int N, const int *kw, int nseg, const int *nrows, int extra)
{
	int K = 0;
	for (int i = 0; i < 1 + 2 * nseg; i++)
		K += kw[i];
	wprob p;
	prob_make(&p, E, N, K, nrows, extra, 0);
	char what[200];
	for (int kn = 0; kn < 2; kn++) {
		cut c;
		cut_make(&c, &p, kw, nseg, kn, 0);
		/* cp.async, then TMA for the main part and the one-half segments with cp.async for the others
		 * (required) */
		for (int tma = 0; tma < 2; tma++) {
			tma_put(tma ? "require" : "0");
			for (size_t t = 0; t < sizeof all_tiles / sizeof all_tiles[0]; t++)
				for (int v = 0; v < 2; v++) {
					knobs(all_tiles[t], v ? "2" : NULL);
					snprintf(what, sizeof what, "segments%s E %d N %d k %d+%d,%d+%d,%d w_kn %d tile %s%s",
						 tma ? " TMA" : "", E, N, kw[0], nseg > 0 ? kw[1] : 0, nseg > 0 ? kw[2] : 0,
						 nseg > 1 ? kw[3] : 0, nseg > 1 ? kw[4] : 0, kn, all_tiles[t] ? all_tiles[t] : "auto",
						 v ? " 2 CTAs" : "");
					seg_one(&p, &c, nseg, kn, v, v ? 0.37f : 1.0f, v, what);
				}
		}
		/* each form (pairs: the main part's B shared, the segments' loaded whole in each CTA) */
		for (size_t f = 0; f < NFORMS; f++) {
			form_on(f);
			for (int t = 1; t <= 2; t++)
				for (int v = 0; v < 2; v++) {
					unsigned long long n0 = forms[f].launches();
					knobs(all_tiles[t], v ? "2" : NULL);
					snprintf(what, sizeof what, "segments %s E %d N %d k %d+%d,%d+%d,%d w_kn %d tile %s%s",
						 forms[f].name, E, N, kw[0], nseg > 0 ? kw[1] : 0, nseg > 0 ? kw[2] : 0,
						 nseg > 1 ? kw[3] : 0, nseg > 1 ? kw[4] : 0, kn, all_tiles[t], v ? " 2 CTAs" : "");
					seg_one(&p, &c, nseg, kn, v, v ? 0.37f : 1.0f, v, what);
					form_ran(f, n0, p.rb > 0 && (v || !forms[f].bf16_only));
				}
			form_off();
		}
		tma_back();
		knobs_back();
		cut_free(&c, E);
	}
	prob_free(&p);
}

/* Gate/up with a LoRA-like segment: g gets x0 W0_e^T, u x1 W1_e^T. The reference zeroes the weights
 * each half does not use (the gate rows' x1 columns, the up rows' x0 columns). */
static void gu_seg_case(int E, int H, int I, int r0, int r1, const int *nrows, int extra)
{
	static const char *runs[][2] = { { NULL, NULL },	 { "128x128", NULL }, { "64x256", NULL },
					 { "pp64x256", NULL }, { "pp128x128", "1" }, { NULL, "2" } };
	int kw[3] = { H, r0, r1 };
	wprob p;
	char what[160];
	prob_make(&p, E, 2 * I, H + r0 + r1, nrows, extra, 1);
	for (int e = 0; e < E; e++)
		for (int n = 0; p.w[e] && n < 2 * I; n++) {
			float *row = p.w[e] + (size_t)n * p.K;
			if (n < I)
				memset(row + H + r0, 0, 4 * (size_t)r1);
			else
				memset(row + H, 0, 4 * (size_t)r0);
		}
	free(p.ref);
	prob_ref(&p);
	cut c;
	cut_make(&c, &p, kw, 1, 0, 1);
	/* the main part's up rows: columns [0, H) of rows [I, 2 I) */
	void **upw = calloc((size_t)E, sizeof(void *));
	for (int e = 0; e < E; e++)
		upw[e] = p.w[e] ? slice_up(p.w[e], p.K, I, I, 0, H, 0) : NULL;
	wprob q = p; /* the device sees the main part through dw / dx, the segment through c */
	q.dw[0] = c.w[0], q.dw[1] = upw, q.dx = c.x[0];
	/* both forms (moe_wgmma.h): cp.async under TIER_MOE_WGMMA_TMA=1, TMA by default (all), the
	 * form that hung in session 9 before its barrier fix (a watchdog build, bench/wgmma-watchdog.sh,
	 * reports a hang as an error) */
	for (int tma = 0; tma < 2; tma++) {
		tma_put(tma ? "all" : "1");
		for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
			knobs(runs[i][0], runs[i][1]);
			snprintf(what, sizeof what, "gate/up + segment%s E %d H %d I %d r %d,%d rows %d tile %s CTAs %s",
				 tma ? " TMA all" : "", E, H, I, r0, r1, p.rows, runs[i][0] ? runs[i][0] : "auto",
				 runs[i][1] ? runs[i][1] : "all");
			gu_one(&q, &c.seg[0], c.tab, what);
		}
	}
	/* each form (TMA all, still set; pairs: gate_e's and up_e's boxes shared, the segment whole) */
	static const char *fruns[][2] = { { "128x256", NULL }, { "128x128", "2" } };
	for (size_t f = 0; f < NFORMS; f++) {
		form_on(f);
		for (size_t i = 0; i < sizeof fruns / sizeof fruns[0]; i++) {
			unsigned long long n0 = forms[f].launches();
			knobs(fruns[i][0], fruns[i][1]);
			snprintf(what, sizeof what, "gate/up + segment %s E %d H %d I %d r %d,%d rows %d tile %s CTAs %s",
				 forms[f].name, E, H, I, r0, r1, p.rows, fruns[i][0], fruns[i][1] ? fruns[i][1] : "all");
			gu_one(&q, &c.seg[0], c.tab, what);
			form_ran(f, n0, p.rb > 0);
		}
		form_off();
	}
	tma_back();
	knobs_back();
	for (int e = 0; e < E; e++)
		tier_dev_free(gpu, upw[e]);
	free(upw);
	cut_free(&c, E);
	prob_free(&p);
}

/* One plain segment (LoRA's B in y = h down^T + Z B^T, or its A in dh), one with both halves, then
 * two: a full-depth one (dU up) and a split one (dZ_g A_g; dZ_u A_u), the backward's dX; odd
 * widths, tails of the k tile, 40 uneven groups. */
static void test_segments(void **state)
{
	(void)state;
	int n[40];
	for (int e = 0; e < 40; e++)
		n[e] = (int)tier_rng_below(&rng, 160);
	n[0] = 0, n[1] = 1, n[7] = 300, n[8] = 0, n[20] = 129, n[39] = 0;
	static const int one[] = { 200, 16, 0 }, lone[] = { 136, 0, 8 }, both[] = { 136, 16, 8 },
			 two[] = { 200, 200, 0, 16, 24 }, wide[] = { 72, 64, 8, 48, 80 }; /* four tables: two copy launches */
	seg_case(40, 264, one, 1, n, 3);
	seg_case(40, 136, lone, 1, n, 0);
	/* a TMA main part and one cp.async segment with both halves: the pattern of gate/up's LoRA
	 * segment (whose TMA form hung in session 9, moe_wgmma.h), in the other layouts */
	seg_case(40, 264, both, 1, n, 3);
	seg_case(40, 264, two, 2, n, 3);
	seg_case(40, 72, wide, 2, n, 5);
	static const int few[] = { 0, 513, 77, 1, 1000 }, big[] = { 768, 768, 0, 16, 16 };
	seg_case(5, 2048, big, 2, few, 64);
}

/* Gate/up with the segment: both adapters (ranks 16 and 8, 32 and 32), gate alone, up alone; a
 * tail of 72 columns; the trainer's shape. */
static void test_gate_up_segment(void **state)
{
	(void)state;
	int n[40];
	for (int e = 0; e < 40; e++)
		n[e] = (int)tier_rng_below(&rng, 100);
	n[0] = 0, n[1] = 1, n[7] = 300, n[8] = 0, n[20] = 129, n[39] = 0;
	gu_seg_case(40, 136, 200, 16, 8, n, 3);
	gu_seg_case(40, 136, 200, 32, 32, n, 0);
	gu_seg_case(40, 64, 72, 16, 0, n, 3);
	gu_seg_case(40, 64, 72, 0, 24, n, 3);
	static const int few[] = { 0, 513, 77, 1, 1000 };
	gu_seg_case(5, 2048, 768, 16, 16, few, 64);
}

/* ---- the cases ---- */
/* 40 random groups of fewer than `below` rows, empty ones included (first, last, inner), sizes
 * around the tile edges (192: a last 128-row tile of exactly 64 rows, all the first consumer's,
 * none the second's). */
static void groups_40(int *n, int below)
{
	for (int e = 0; e < 40; e++)
		n[e] = (int)tier_rng_below(&rng, (uint64_t)below);
	n[0] = 0, n[1] = 1, n[7] = 300, n[8] = 0, n[20] = 129, n[21] = 64, n[22] = 65, n[30] = 192, n[39] = 0;
}

/* The most experts: mostly 0-3 rows (3 experts per thread in the tile table's scan), one of several
 * tiles, empty ones first and last. */
static int *groups_1024(void)
{
	int *n = malloc(sizeof(int) * 1024);
	for (int e = 0; e < 1024; e++)
		n[e] = (int)tier_rng_below(&rng, 4);
	n[0] = 0, n[383] = 0, n[500] = 200, n[1023] = 0;
	return n;
}

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
	groups_40(n, 160);
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
	int *n = groups_1024();
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

/* Gate/up: a 72-column tail (I = 200: the last tile holds 72 of its 128 or 64 columns), an 8-k tail
 * (H = 136), a one-row and an empty group. */
static void test_gate_up_small(void **state)
{
	(void)state;
	static const int n[] = { 1, 0, 300 };
	gu_case(3, 136, 200, n, 5);
}

/* Gate/up over 40 random groups, I = 768, H = 2048. */
static void test_gate_up_many(void **state)
{
	(void)state;
	int n[40];
	groups_40(n, 100);
	gu_case(40, 2048, 768, n, 3);
}

/* Gate/up: few large groups, I = 512, H = 2048. */
static void test_gate_up_large(void **state)
{
	(void)state;
	static const int n[] = { 0, 513, 77, 1, 1000 };
	gu_case(5, 2048, 512, n, 64);
}

/* Gate/up: 1024 experts of 0-3 rows, I = 64 (the 128x128 tile by default). */
static void test_gate_up_1024_experts(void **state)
{
	(void)state;
	int *n = groups_1024();
	gu_case(1024, 64, 64, n, 7);
	free(n);
}

/* Gate/up: one row of I = H = 8, and no rows at all. */
static void test_gate_up_edges(void **state)
{
	(void)state;
	static const int one[] = { 1 }, none[] = { 0, 0, 0, 0 };
	gu_case(1, 8, 8, one, 0);
	gu_case(4, 8, 8, none, 9);
	gu_case(4, 16, 16, none, 0);
}

/* What the host refuses, before any launch (the pointers are never dereferenced). */
static void test_bad_input(void **state)
{
	(void)state;
	int32_t *off = (int32_t *)64;
	const void *w[2] = { (void *)64, (void *)64 }, *wodd[2] = { (void *)64, (void *)72 };
	void *p = (void *)64;
	knobs_back();
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 12, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* K % 8 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 12, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* N % 8 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 0, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);   /* N */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 0, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);   /* E */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 1025, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, -1, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* rows_bound */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.5f), -EINVAL);   /* beta */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 2, 1.0f, 0.0f), -EINVAL);   /* c_bf16 */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 2, p, p, 0, 1.0f, 0.0f), -EINVAL);   /* w_kn */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, -1, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, wodd, 0, p, p, 0, 1.0f, 0.0f), -EINVAL); /* w align */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, (void *)72, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, (void *)72, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, NULL, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, NULL, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, NULL, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, NULL, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(cpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);  /* not CUDA */
	assert_int_equal(moe_cuda_grouped_mm_sm90(NULL, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	static const char *bad[][2] = { { "96x96", NULL }, { "128x256x", NULL }, { NULL, "0" }, { NULL, "many" } };
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) { /* malformed knobs */
		knobs(bad[i][0], bad[i][1]);
		assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	}
	knobs_back();
	/* each malformed knob set for one call and the run's own setting put back, so that a run under
	 * (say) TIER_MOE_WGMMA_CLUSTER=2 keeps it for the tests after this one */
	env_keep k;
	env_set(&k, "TIER_MOE_WGMMA_DEBUG", "noproducts"); /* the measurement knob: refused before any launch */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 0, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	env_back(&k);
	env_set(&k, "TIER_MOE_WGMMA_CLUSTER", "4"); /* pairs only */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	env_back(&k);
	env_set(&k, "TIER_MOE_WGMMA_EPI", "bulk");
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	env_back(&k);
	env_set(&k, "TIER_MOE_WGMMA_IDLE", "off"); /* malformed */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	env_back(&k);
	env_set(&k, "TIER_MOE_WGMMA_SCHED", "claimed"); /* malformed */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 0, p, p, 0, 1.0f, 0.0f), -EINVAL);
	env_back(&k);
	if (base_tmap_ok()) { /* the TMA stores' maps: what the encoder cannot take is refused first */
		CUtensorMap m;
		assert_int_equal(base_tmap_bf16_store(&m, (void *)72, 4, 8), -EINVAL); /* base % 16 */
		assert_int_equal(base_tmap_bf16_store(&m, (void *)64, 4, 12), -EINVAL); /* cols % 8 */
		assert_int_equal(base_tmap_bf16_store(&m, (void *)64, 0, 8), -EINVAL);	/* no rows */
		assert_int_equal(base_tmap_bf16_store(NULL, (void *)64, 4, 8), -EINVAL);
		assert_int_equal(base_tmap_bf16_store(&m, (void *)64, 4, 8), 0);
	}
	tma_put("yes"); /* malformed */
	assert_int_equal(moe_cuda_grouped_mm_sm90(gpu, 2, 8, 8, off, 2, w, 1, p, p, 0, 1.0f, 0.0f), -EINVAL);
	tma_back();
	void *f = (void *)64, *fodd = (void *)68; /* g and u */
	tma_put("require"); /* gate/up's 64x256 takes cp.async: refused, nothing launched */
	knobs("64x256", NULL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, f, p), -EINVAL);
	knobs_back();
	tma_back();
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 12, 8, off, 2, w, w, p, f, f, p), -EINVAL);  /* H % 8 */
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 12, off, 2, w, w, p, f, f, p), -EINVAL);  /* I % 8 */
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 0, off, 2, w, w, p, f, f, p), -EINVAL);   /* I */
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 0, 8, 8, off, 2, w, w, p, f, f, p), -EINVAL);   /* E */
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, -1, w, w, p, f, f, p), -EINVAL);  /* rows_bound */
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, NULL, 2, w, w, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, NULL, w, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, NULL, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, wodd, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, wodd, w, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, NULL, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, NULL, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, NULL, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, f, NULL), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, (void *)72, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, fodd, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, fodd, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, f, (void *)72), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(cpu, 2, 8, 8, off, 2, w, w, p, f, f, p), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(NULL, 2, 8, 8, off, 2, w, w, p, f, f, p), -EINVAL);
	knobs("96x96", NULL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90(gpu, 2, 8, 8, off, 2, w, w, p, f, f, p), -EINVAL);
	knobs_back();
	/* segments: K0 % 8, both halves empty, a NULL or odd x or table, no or odd table space, too many */
	moe_wg_seg sg[3] = { { p, p, w, w, 8, 8 }, { p, p, w, w, 8, 8 }, { p, p, w, w, 8, 8 } };
	const moe_wg_seg bad_seg[] = { { p, p, w, w, 12, 8 }, { p, p, w, w, 0, 0 },     { NULL, p, w, w, 8, 8 },
				       { p, (void *)72, w, w, 8, 8 }, { p, p, NULL, w, 8, 8 }, { p, p, w, wodd, 8, 8 },
				       { p, p, w, w, -8, 8 } };
	for (size_t i = 0; i < sizeof bad_seg / sizeof bad_seg[0]; i++) {
		assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, 1, &bad_seg[i], p, p, 0, 1.0f,
							       0.0f),
				 -EINVAL);
		assert_int_equal(moe_cuda_grouped_gate_up_sm90_lora(gpu, 2, 8, 8, off, 2, w, w, p, &bad_seg[i], p, f, f, p),
				 -EINVAL);
	}
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, 1, sg, NULL, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, 1, sg, (void *)72, p, 0, 1.0f, 0.0f),
			 -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, 3, sg, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, -1, sg, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_mm_sm90_segs(gpu, 2, 8, 8, off, 2, w, 0, p, 1, NULL, p, p, 0, 1.0f, 0.0f), -EINVAL);
	assert_int_equal(moe_cuda_grouped_gate_up_sm90_lora(gpu, 2, 8, 8, off, 2, w, w, p, sg, NULL, f, f, p), -EINVAL);
	knobs_back();
	assert_int_equal(moe_cuda_wgmma_supported(cpu), 0);
	assert_int_equal(moe_cuda_wgmma_supported(NULL), 0);
}

#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_small),
		cmocka_unit_test(test_many),
		cmocka_unit_test(test_large),
		cmocka_unit_test(test_1024_experts),
		cmocka_unit_test(test_edges),
		cmocka_unit_test(test_segments),
		cmocka_unit_test(test_gate_up_segment),
		cmocka_unit_test(test_gate_up_small),
		cmocka_unit_test(test_gate_up_many),
		cmocka_unit_test(test_gate_up_large),
		cmocka_unit_test(test_gate_up_1024_experts),
		cmocka_unit_test(test_gate_up_edges),
		cmocka_unit_test(test_bad_input),
	};
	return ref_gpu_run(tests, sizeof tests / sizeof tests[0], moe_cuda_wgmma_supported);
#else
	fprintf(stderr, "# test_moe_wgmma: built without CUDA, skipped\n");
	return 77;
#endif
}
