/* test_moe_experts.c - grouped SwiGLU experts (separate and fused gate_up, both orders), LoRA on
 * gate/up/down, empty experts; forward against fp64, backward (dx, dA, dB) by central differences;
 * and the row references that test_moe_cuda's bf16 emulation is built on, against the same. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#define REF_CPU_TEST "test_moe_experts" /* moe_ref.h: dev, rng and their setup */
#include "moe_ref.h"

typedef struct {
	int E, H, I, r;
	const int *rows;   /* [E] */
	int fused, order;  /* gate_up in one matrix, and its order */
	int lora_mask;     /* bit 0 gate, 1 up, 2 down */
	int frozen_up;     /* LoRA on up without gradients (da, db NULL) */
} ecase;

typedef struct { float **a, **b, **da, **db; double **ad, **bd; } lbuf;

#define arr(E, n, scale) ref_arr(&rng, E, n, scale)
#define darr ref_darr
#define afree ref_afree

/* sum_rows y . R in fp64 with the experts of the current (double) parameters. */
static double ref_loss(const ecase *c, const int32_t *off, const double *xg, double **gd, double **ud, double **dd,
		       lbuf *lb, const double *R, double *yout)
{
	double L = 0.0, *y = malloc(8 * (size_t)c->H);
	for (int e = 0; e < c->E; e++) {
		ref_lora l[3];
		for (int q = 0; q < 3; q++)
			l[q] = (c->lora_mask >> q & 1) ? (ref_lora){ lb[q].ad[e], lb[q].bd[e], c->r, 0.5 } : (ref_lora){ 0 };
		for (int row = off[e]; row < off[e + 1]; row++) {
			ref_swiglu(c->H, c->I, xg + (size_t)row * c->H, gd[e], ud[e], dd[e], l[0], l[1], l[2], y);
			for (int h = 0; h < c->H; h++) {
				L += y[h] * R[(size_t)row * c->H + h];
				if (yout)
					yout[(size_t)row * c->H + h] = y[h];
			}
		}
	}
	free(y);
	return L;
}

/* Central difference of ref_loss in one parameter. */
static double fd(const ecase *c, const int32_t *off, const double *xg, double **gd, double **ud, double **dd,
		 lbuf *lb, const double *R, double *p)
{
	double keep = *p, eps = 1e-5, a, b;
	*p = keep + eps;
	a = ref_loss(c, off, xg, gd, ud, dd, lb, R, NULL);
	*p = keep - eps;
	b = ref_loss(c, off, xg, gd, ud, dd, lb, R, NULL);
	*p = keep;
	return (a - b) / (2 * eps);
}

/* The row references of tests/moe_ref.h with their bf16 rounding off (test_moe_cuda's yardstick
 * with it on) compute the same function as the CPU experts: g, u, y forward; dxg and the adapters'
 * increments (over da0, db0) backward from dy = R. */
static void check_row_ref(const ecase *c, const int32_t *off, float **gate, float **up, float **down, lbuf *lb,
			  const float *xg, const float *g, const float *u, const float *y, const float *R,
			  const float *dxg, double **da0[3], double **db0[3])
{
	int E = c->E, H = c->H, I = c->I, r = c->r, n = off[E];
	const size_t ins[3] = { (size_t)H, (size_t)H, (size_t)I }, outs[3] = { (size_t)I, (size_t)I, (size_t)H };
	float *g2 = malloc(4 * (size_t)n * I + 4), *u2 = malloc(4 * (size_t)n * I + 4), *y2 = malloc(4 * (size_t)n * H + 4);
	float *dx2 = malloc(4 * (size_t)n * H + 4);
	double **ia[3] = { 0 }, **ib[3] = { 0 };
	for (int q = 0; q < 3; q++)
		if (lb[q].a) {
			ia[q] = calloc((size_t)E, sizeof(double *)), ib[q] = calloc((size_t)E, sizeof(double *));
			for (int e = 0; e < E; e++)
				ia[q][e] = calloc(r * ins[q], sizeof(double)), ib[q][e] = calloc(outs[q] * r, sizeof(double));
		}
	for (int e = 0; e < E; e++) {
		ref_expert ex = { .gate = gate[e], .up = up[e], .down = down[e], .r = r, .s = 0.5 };
		for (int q = 0; q < 3; q++)
			if (lb[q].a && !(q == 1 && c->frozen_up))
				ex.a[q] = lb[q].a[e], ex.b[q] = lb[q].b[e], ex.da[q] = ia[q][e], ex.db[q] = ib[q][e];
			else if (lb[q].a)
				ex.a[q] = lb[q].a[e], ex.b[q] = lb[q].b[e];
		for (int row = off[e]; row < off[e + 1]; row++) {
			ref_row_fwd(0, H, I, &ex, xg + (size_t)row * H, g2 + (size_t)row * I, u2 + (size_t)row * I,
				    y2 + (size_t)row * H);
			ref_row_bwd(0, H, I, &ex, xg + (size_t)row * H, g2 + (size_t)row * I, u2 + (size_t)row * I,
				    R + (size_t)row * H, dx2 + (size_t)row * H, NULL);
		}
	}
	double *gd = ref_dup(g2, (size_t)n * I), *ud = ref_dup(u2, (size_t)n * I), *yd = ref_dup(y2, (size_t)n * H);
	double *dxd = ref_dup(dx2, (size_t)n * H);
	assert_true(ref_relerr(g, gd, (size_t)n * I) <= REF_TOL);
	assert_true(ref_relerr(u, ud, (size_t)n * I) <= REF_TOL);
	assert_true(ref_relerr(y, yd, (size_t)n * H) <= REF_TOL);
	assert_true(ref_relerr(dxg, dxd, (size_t)n * H) <= REF_TOL);
	for (int q = 0; q < 3; q++)
		for (int e = 0; lb[q].a && e < E; e++) {
			size_t na = r * ins[q], nb = outs[q] * r;
			float *inc = malloc(4 * (na > nb ? na : nb));
			for (size_t i = 0; i < na; i++)
				inc[i] = (float)(lb[q].da[e][i] - da0[q][e][i]);
			assert_true(ref_relerr(inc, ia[q][e], na) <= REF_TOL);
			for (size_t i = 0; i < nb; i++)
				inc[i] = (float)(lb[q].db[e][i] - db0[q][e][i]);
			assert_true(ref_relerr(inc, ib[q][e], nb) <= REF_TOL);
			free(inc);
		}
	for (int q = 0; q < 3; q++)
		ref_afree((void **)ia[q], E), ref_afree((void **)ib[q], E);
	free(g2), free(u2), free(y2), free(dx2), free(gd), free(ud), free(yd), free(dxd);
}

static void run_case(const ecase *c)
{
	int E = c->E, H = c->H, I = c->I, r = c->r;
	int32_t *off = malloc(4 * (size_t)(E + 1));
	off[0] = 0;
	for (int e = 0; e < E; e++)
		off[e + 1] = off[e] + c->rows[e];
	int n = off[E];
	float **gate = arr(E, (size_t)I * H, 0.3f), **up = arr(E, (size_t)I * H, 0.3f), **down = arr(E, (size_t)H * I, 0.3f);
	float **gu = calloc((size_t)E, sizeof *gu);
	for (int e = 0; e < E; e++) {
		if (c->rows[e] == 0 && e % 2) { /* a cold expert: no weights at all */
			if (c->fused)
				continue;
			free(gate[e]), free(up[e]), free(down[e]);
			gate[e] = up[e] = down[e] = NULL;
			continue;
		}
		gu[e] = malloc(8 * (size_t)I * H);
		memcpy(gu[e] + (c->order == TIER_MOE_UP_FIRST ? (size_t)I * H : 0), gate[e], 4 * (size_t)I * H);
		memcpy(gu[e] + (c->order == TIER_MOE_UP_FIRST ? 0 : (size_t)I * H), up[e], 4 * (size_t)I * H);
	}
	tier_moe_experts w = { .down = (const float *const *)down, .order = c->order };
	if (c->fused)
		w.gate_up = (const float *const *)gu;
	else
		w.gate = (const float *const *)gate, w.up = (const float *const *)up;
	const int ins[3] = { H, H, I }, outs[3] = { I, I, H };
	lbuf lb[3] = { { 0 } };
	tier_moe_loras lo;
	memset(&lo, 0, sizeof lo);
	tier_moe_lora *lp[3] = { &lo.gate, &lo.up, &lo.down };
	for (int q = 0; q < 3; q++) {
		if (!(c->lora_mask >> q & 1))
			continue;
		lb[q].a = arr(E, (size_t)r * ins[q], 0.3f);
		lb[q].b = arr(E, (size_t)outs[q] * r, 0.3f);
		lb[q].da = arr(E, (size_t)r * ins[q], 1.0f); /* accumulated into */
		lb[q].db = arr(E, (size_t)outs[q] * r, 1.0f);
		lb[q].ad = darr(lb[q].a, E, (size_t)r * ins[q]);
		lb[q].bd = darr(lb[q].b, E, (size_t)outs[q] * r);
		*lp[q] = (tier_moe_lora){ (const float *const *)lb[q].a, (const float *const *)lb[q].b,
					  (q == 1 && c->frozen_up) ? NULL : lb[q].da,
					  (q == 1 && c->frozen_up) ? NULL : lb[q].db, r, 0.5f };
	}
	float *xg = malloc(4 * (size_t)n * H + 4), *g = malloc(4 * (size_t)n * I + 4), *u = malloc(4 * (size_t)n * I + 4);
	float *y = malloc(4 * (size_t)n * H + 4), *R = malloc(4 * (size_t)n * H + 4), *dxg = malloc(4 * (size_t)n * H + 4);
	void *ws = malloc(tier_moe_experts_ws_bytes(I, n, &lo) + 4);
	ref_fill(&rng, xg, (size_t)n * H, 1.0f);
	ref_fill(&rng, R, (size_t)n * H, 1.0f);
	ref_poison(g, 4 * (size_t)n * I);
	ref_poison(u, 4 * (size_t)n * I);
	ref_poison(y, 4 * (size_t)n * H);
	assert_int_equal(tier_moe_experts_fwd(dev, E, H, I, off, &w, &lo, xg, g, u, y, ws), 0);

	double **gd = calloc((size_t)E, sizeof *gd), **ud = calloc((size_t)E, sizeof *ud), **dd = calloc((size_t)E, sizeof *dd);
	for (int e = 0; e < E; e++)
		if (gate[e])
			gd[e] = ref_dup(gate[e], (size_t)I * H), ud[e] = ref_dup(up[e], (size_t)I * H),
			dd[e] = ref_dup(down[e], (size_t)H * I);
	double *xd = ref_dup(xg, (size_t)n * H), *Rd = ref_dup(R, (size_t)n * H), *yr = calloc((size_t)n * H + 1, 8);
	double *gr = calloc((size_t)n * I + 1, 8);
	ref_loss(c, off, xd, gd, ud, dd, lb, Rd, yr);
	assert_true(ref_relerr(y, yr, (size_t)n * H) <= REF_TOL);
	for (int e = 0; e < E; e++) /* the saved pre-activation gate, LoRA included */
		for (int row = off[e]; row < off[e + 1]; row++)
			ref_proj(H, I, xd + (size_t)row * H, gd[e],
				 (c->lora_mask & 1) ? (ref_lora){ lb[0].ad[e], lb[0].bd[e], r, 0.5 } : (ref_lora){ 0 },
				 gr + (size_t)row * I);
	assert_true(ref_relerr(g, gr, (size_t)n * I) <= REF_TOL);
	{ /* y NULL (a recompute): the same g and u, bit for bit */
		float *g2 = malloc(4 * (size_t)n * I + 4), *u2 = malloc(4 * (size_t)n * I + 4);
		ref_poison(g2, 4 * (size_t)n * I);
		ref_poison(u2, 4 * (size_t)n * I);
		assert_int_equal(tier_moe_experts_fwd(dev, E, H, I, off, &w, &lo, xg, g2, u2, NULL, ws), 0);
		assert_memory_equal(g2, g, 4 * (size_t)off[E] * I);
		assert_memory_equal(u2, u, 4 * (size_t)off[E] * I);
		free(g2), free(u2);
	}

	/* backward: dy = R; compare with central differences of the fp64 loss */
	float *gate0 = gate[0] ? malloc(4 * (size_t)I * H) : NULL;
	if (gate0)
		memcpy(gate0, gate[0], 4 * (size_t)I * H);
	double **da0[3] = { 0 }, **db0[3] = { 0 };
	for (int q = 0; q < 3; q++)
		if (lb[q].a)
			da0[q] = darr(lb[q].da, E, (size_t)r * ins[q]), db0[q] = darr(lb[q].db, E, (size_t)outs[q] * r);
	ref_poison(dxg, 4 * (size_t)n * H);
	float *dot = malloc(4 * (size_t)n + 4);
	double *dotr = calloc((size_t)n + 1, 8);
	ref_poison(dot, 4 * (size_t)n);
	assert_int_equal(tier_moe_experts_bwd(dev, E, H, I, off, &w, &lo, xg, g, u, R, dxg, dot, ws), 0);
	check_row_ref(c, off, gate, up, down, lb, xg, g, u, y, R, dxg, da0, db0);
	for (int row = 0; row < off[E]; row++) /* row_dot = dy . y */
		for (int h = 0; h < H; h++)
			dotr[row] += Rd[(size_t)row * H + h] * yr[(size_t)row * H + h];
	assert_true(ref_relerr(dot, dotr, (size_t)off[E]) <= REF_TOL);
	free(dot), free(dotr);
	double *dxr = malloc(8 * (size_t)n * H + 8);
	for (size_t i = 0; i < (size_t)n * H; i++)
		dxr[i] = fd(c, off, xd, gd, ud, dd, lb, Rd, &xd[i]);
	assert_true(ref_relerr(dxg, dxr, (size_t)n * H) <= REF_TOL);
	for (int q = 0; q < 3; q++) {
		if (!lb[q].a)
			continue;
		for (int e = 0; e < E; e++) {
			size_t na = (size_t)r * ins[q], nb = (size_t)outs[q] * r;
			double *ga = malloc(8 * na), *gb = malloc(8 * nb);
			int frozen = q == 1 && c->frozen_up;
			for (size_t i = 0; i < na; i++)
				ga[i] = (frozen ? 0 : da0[q][e][i]) + fd(c, off, xd, gd, ud, dd, lb, Rd, &lb[q].ad[e][i]);
			for (size_t i = 0; i < nb; i++)
				gb[i] = (frozen ? 0 : db0[q][e][i]) + fd(c, off, xd, gd, ud, dd, lb, Rd, &lb[q].bd[e][i]);
			if (frozen) { /* untouched */
				for (size_t i = 0; i < na; i++)
					assert_true(lb[q].da[e][i] == (float)da0[q][e][i]);
			} else {
				assert_true(ref_relerr(lb[q].da[e], ga, na) <= REF_TOL);
				assert_true(ref_relerr(lb[q].db[e], gb, nb) <= REF_TOL);
			}
			free(ga), free(gb);
		}
	}
	if (gate0) { /* frozen base weights: read, never written */
		assert_memory_equal(gate0, gate[0], 4 * (size_t)I * H);
		free(gate0);
	}
	for (int q = 0; q < 3; q++) {
		if (!lb[q].a)
			continue;
		afree((void **)lb[q].a, E), afree((void **)lb[q].b, E), afree((void **)lb[q].da, E), afree((void **)lb[q].db, E);
		afree((void **)lb[q].ad, E), afree((void **)lb[q].bd, E), afree((void **)da0[q], E), afree((void **)db0[q], E);
	}
	afree((void **)gate, E), afree((void **)up, E), afree((void **)down, E), afree((void **)gu, E);
	afree((void **)gd, E), afree((void **)ud, E), afree((void **)dd, E);
	free(off), free(xg), free(g), free(u), free(y), free(R), free(dxg), free(ws), free(xd), free(Rd), free(yr);
	free(gr), free(dxr);
}

static void test_swiglu_plain(void **state)
{
	(void)state;
	static const int rows[] = { 4, 0, 7, 1, 0 };
	run_case(&(ecase){ 5, 11, 9, 0, rows, 0, 0, 0, 0 });
	static const int one[] = { 1 };
	run_case(&(ecase){ 1, 3, 5, 0, one, 0, 0, 0, 0 }); /* T = 1 */
}

static void test_swiglu_fused_orders(void **state)
{
	(void)state;
	static const int rows[] = { 3, 5, 0, 2 };
	run_case(&(ecase){ 4, 13, 7, 2, rows, 1, TIER_MOE_GATE_FIRST, 7, 0 });
	run_case(&(ecase){ 4, 13, 7, 2, rows, 1, TIER_MOE_UP_FIRST, 7, 0 });
}

static void test_swiglu_lora(void **state)
{
	(void)state;
	static const int rows[] = { 4, 0, 7, 1, 0 };
	run_case(&(ecase){ 5, 11, 9, 3, rows, 0, 0, 7, 0 });
	run_case(&(ecase){ 5, 11, 9, 3, rows, 0, 0, 5, 0 }); /* gate and down only */
	run_case(&(ecase){ 5, 11, 9, 3, rows, 0, 0, 7, 1 }); /* up adapter frozen */
	static const int all[] = { 0, 0, 12, 0 };            /* all rows to one expert */
	run_case(&(ecase){ 4, 6, 10, 2, all, 1, TIER_MOE_GATE_FIRST, 7, 0 });
}

/* ref_bf16 rounds to the nearest bf16, ties to even, as __float2bfloat16 does. */
static void test_ref_bf16(void **state)
{
	(void)state;
	assert_true(ref_bf16(1.0) == 1.0);
	assert_true(ref_bf16(1.0 + 1.0 / 256) == 1.0);               /* a tie: down to the even 1.0 */
	assert_true(ref_bf16(1.0 + 3.0 / 256) == 1.0 + 4.0 / 256);   /* a tie: up to the even 1 + 2^-6 */
	assert_true(ref_bf16(1.0 + 1.5 / 256) == 1.0 + 2.0 / 256);   /* above the tie */
	assert_true(ref_bf16(-1.0 - 0.9 / 256) == -1.0 && ref_bf16(-1.0 - 1.1 / 256) == -1.0 - 2.0 / 256);
	assert_true(ref_bf16(0.0) == 0.0 && isinf(ref_bf16(INFINITY)) && isnan(ref_bf16(NAN)));
}

static void test_bad_input(void **state)
{
	(void)state;
	float wbuf[64] = { 0 }, x[16] = { 0 }, g[16], u[16], y[16], ws[64];
	const float *ptr[2] = { wbuf, NULL };
	int32_t off[3] = { 0, 1, 2 };
	y[0] = 42.0f;
	tier_moe_experts w = { .gate = ptr, .up = ptr, .down = ptr };
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 2, 2, off, &w, NULL, x, g, u, y, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "expert 1"));
	off[2] = 1; /* expert 1 empty: its NULL weights are fine */
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 2, 2, off, &w, NULL, x, g, u, y, ws), 0);
	off[1] = 2; /* decreasing */
	y[0] = 42.0f;
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 2, 2, off, &w, NULL, x, g, u, y, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "decrease"));
	off[1] = 1;
	tier_moe_loras lo = { .gate = { .a = ptr, .rank = 1, .scale = 1 } };
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 2, 2, off, &w, &lo, x, g, u, y, ws), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "one of A and B"));
	tier_moe_experts nog = { .down = ptr };
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 2, 2, off, &nog, NULL, x, g, u, y, ws), -EINVAL);
	assert_int_equal(tier_moe_experts_fwd(dev, 2, 0, 2, off, &w, NULL, x, g, u, y, ws), -EINVAL);
	assert_int_equal(tier_moe_experts_bwd(dev, 2, 2, 2, off, &w, NULL, x, g, u, NULL, y, NULL, ws), -EINVAL);
	assert_true(y[0] == 42.0f);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_swiglu_plain), cmocka_unit_test(test_swiglu_fused_orders),
		cmocka_unit_test(test_swiglu_lora), cmocka_unit_test(test_ref_bf16), cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, ref_setup, ref_teardown);
}
