/* test_moe_layer.c - the whole MoE block: forward against an fp64 reference, backward (dx, router
 * weight, LoRA A and B, through the router weights, aux loss and z-loss) by central differences. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#define REF_CPU_TEST "test_moe_layer" /* moe_ref.h: dev, rng and their setup */
#include "moe_ref.h"

typedef struct {
	tier_moe_cfg cfg;
	int T, r, skew; /* skew: every token's best expert is 0 (all tokens to one expert) */
} lcase;

typedef struct {
	const lcase *c;
	int T, E, k, H, I, r;
	float *x, *wr, *bias, *R, **w[3], **a[3], **b[3], **da[3], **db[3]; /* w: gate, up, down */
	double *xd, *wrd, *bd, *Rd, **wd[3], **ad[3], **bdd[3];
	const int32_t *idx, *pair_row; /* the kernel's selection and drops, held fixed */
} layer;

#define arr(E, n, scale) ref_arr(&rng, E, n, scale)
#define darr ref_darr
#define afree ref_afree

/* sum(out . R) + aux + z in fp64, selection and drops fixed; out [T, H] when not NULL. */
static double ref_loss(layer *L, double *out)
{
	int T = L->T, E = L->E, k = L->k, H = L->H, I = L->I, sel[TIER_MOE_MAX_TOPK];
	double *lg = calloc((size_t)T * E, 8), *y = malloc(8 * (size_t)H), w[TIER_MOE_MAX_TOPK], loss = 0.0;
	int *idx = malloc(sizeof(int) * (size_t)T * k);
	for (int t = 0; t < T; t++)
		for (int e = 0; e < E; e++)
			for (int h = 0; h < H; h++)
				lg[t * E + e] += L->xd[t * H + h] * L->wrd[e * H + h];
	for (int i = 0; i < T * k; i++)
		idx[i] = L->idx[i];
	for (int t = 0; t < T; t++) {
		for (int j = 0; j < k; j++)
			sel[j] = idx[t * k + j];
		ref_weights(&L->c->cfg.router, lg + t * E, sel, w);
		for (int h = 0; h < H; h++)
			if (out)
				out[t * H + h] = 0.0;
		for (int j = 0; j < k; j++) {
			int e = sel[j];
			if (L->pair_row[t * k + j] < 0)
				continue; /* dropped by capacity */
			ref_lora l[3];
			for (int q = 0; q < 3; q++)
				l[q] = L->a[q] ? (ref_lora){ L->ad[q][e], L->bdd[q][e], L->r, 0.75 } : (ref_lora){ 0 };
			ref_swiglu(H, I, L->xd + t * H, L->wd[0][e], L->wd[1][e], L->wd[2][e], l[0], l[1], l[2], y);
			for (int h = 0; h < H; h++) {
				loss += w[j] * y[h] * L->Rd[t * H + h];
				if (out)
					out[t * H + h] += w[j] * y[h];
			}
		}
	}
	loss += ref_aux(T, E, k, L->c->cfg.aux_coef, L->c->cfg.z_coef, lg, idx, NULL, NULL, NULL);
	free(lg), free(y), free(idx);
	return loss;
}

static double fd(layer *L, double *p)
{
	double keep = *p, eps = 1e-5, a, b;
	*p = keep + eps;
	a = ref_loss(L, NULL);
	*p = keep - eps;
	b = ref_loss(L, NULL);
	*p = keep;
	return (a - b) / (2 * eps);
}

/* Analytic gradient g (accumulated onto g0) against central differences of params pd. */
static void check_grad(layer *L, const float *g, const double *g0, double *pd, size_t n)
{
	double *ref = malloc(8 * n);
	for (size_t i = 0; i < n; i++)
		ref[i] = (g0 ? g0[i] : 0.0) + fd(L, &pd[i]);
	assert_true(ref_relerr(g, ref, n) <= REF_TOL);
	free(ref);
}

/* The forward in routed halves gives tier_moe_layer_fwd's saved state (sbuf, sb bytes), out and
 * losses bit for bit; a recompute's route (no counts) the same state with the losses untouched;
 * counts that are not the routing's -EIO. */
static void routed_fwd_same(const tier_moe_cfg *cfg, int T, const layer *L, const float *bias,
			    const tier_moe_experts *w, const tier_moe_loras *lo, const tier_moe_saved *s,
			    const void *sbuf, size_t sb, const float *out, void *ws, size_t wb)
{
	int E = L->E, H = L->H;
	void *sbuf2 = malloc(sb);
	float *out2 = malloc(4 * (size_t)T * H);
	int32_t cnt[TIER_MOE_MAX_EXPERTS];
	tier_moe_saved s2;
	assert_int_equal(tier_moe_saved_bind(cfg, T, sbuf2, sb, &s2), 0);
	ref_poison(sbuf2, sb);
	ref_poison(out2, 4 * (size_t)T * H);
	assert_int_equal(tier_moe_layer_route(dev, cfg, T, L->x, L->wr, bias, &s2, ws, wb, cnt), 0);
	for (int e = 0; e < E; e++)
		assert_int_equal(cnt[e], s->counts[e]);
	assert_int_equal(tier_moe_layer_fwd_routed(dev, cfg, T, L->x, w, lo, cnt, out2, &s2, ws, wb), 0);
	assert_memory_equal(sbuf, sbuf2, sb);
	assert_memory_equal(out, out2, 4 * (size_t)T * H);
	assert_true(s2.aux == s->aux && s2.z == s->z);
	{ /* with a residual: out = the block + res bit for bit, into another buffer and into res itself */
		size_t TH = (size_t)T * H;
		float *res = malloc(4 * TH), *out3 = malloc(4 * TH), *want = malloc(4 * TH);
		for (size_t i = 0; i < TH; i++)
			res[i] = (float)(i % 7) * 0.37f - 1.25f, want[i] = out[i] + res[i];
		ref_poison(out3, 4 * TH);
		assert_int_equal(tier_moe_layer_fwd_routed_res(dev, cfg, T, L->x, w, lo, cnt, res, out3, &s2, ws, wb), 0);
		assert_memory_equal(out3, want, 4 * TH);
		assert_int_equal(tier_moe_layer_fwd_routed_res(dev, cfg, T, L->x, w, lo, cnt, res, res, &s2, ws, wb), 0);
		assert_memory_equal(res, out3, 4 * TH);
		assert_int_equal(tier_moe_layer_fwd_routed_res(dev, cfg, T, L->x, w, lo, cnt, res, NULL, &s2, ws, wb),
				 -EINVAL);
		assert_non_null(strstr(tier_last_error(), "residual"));
		assert_memory_equal(sbuf, sbuf2, sb);
		free(res), free(out3), free(want);
	}
	ref_poison(sbuf2, sb);
	s2.aux = s2.z = -1.0f;
	assert_int_equal(tier_moe_layer_route(dev, cfg, T, L->x, L->wr, bias, &s2, ws, wb, NULL), 0);
	assert_int_equal(tier_moe_layer_fwd_routed(dev, cfg, T, L->x, w, lo, cnt, NULL, &s2, ws, wb), 0);
	assert_memory_equal(sbuf, sbuf2, sb);
	assert_true(s2.aux == -1.0f && s2.z == -1.0f);
	int e0 = s->topk_idx[0], e1 = (e0 + 1) % E; /* one pair moved to another expert: same total */
	cnt[e0]--, cnt[e1]++;
	assert_int_equal(tier_moe_layer_fwd_routed(dev, cfg, T, L->x, w, lo, cnt, out2, &s2, ws, wb), -EIO);
	assert_non_null(strstr(tier_last_error(), "expert"));
	free(sbuf2), free(out2);
}

/* The backward on the forward's counts gives tier_moe_layer_bwd's dx and dw_r bit for bit (the
 * LoRA gradients, accumulated by both, come from the same code); other counts -EIO. */
static void routed_bwd_same(const tier_moe_cfg *cfg, int T, const layer *L, const tier_moe_experts *w,
			    const tier_moe_loras *lo, const tier_moe_saved *s, void *ws, size_t wb)
{
	int E = L->E, H = L->H;
	size_t nx = (size_t)T * H, nw = (size_t)E * H;
	float *dx = malloc(4 * nx), *dx2 = malloc(4 * nx), *dwr = calloc(nw, 4), *dwr2 = calloc(nw, 4);
	ref_poison(dx, 4 * nx);
	ref_poison(dx2, 4 * nx);
	assert_int_equal(tier_moe_layer_bwd(dev, cfg, T, L->x, L->wr, w, lo, s, L->R, 1.0f, dx, dwr, ws, wb), 0);
	assert_int_equal(tier_moe_layer_bwd_routed(dev, cfg, T, L->x, L->wr, w, lo, s, s->counts, L->R, 1.0f, dx2, dwr2,
						   ws, wb), 0);
	assert_memory_equal(dx, dx2, 4 * nx);
	assert_memory_equal(dwr, dwr2, 4 * nw);
	int32_t cnt[TIER_MOE_MAX_EXPERTS];
	memcpy(cnt, s->counts, sizeof(int32_t) * (size_t)E);
	int e0 = s->topk_idx[0], e1 = (e0 + 1) % E;
	cnt[e0]--, cnt[e1]++;
	int cap = tier_moe_capacity(T, L->k, E, cfg->capacity_factor);
	/* with a capacity both experts may be full: the kept counts, so the offsets, may not change */
	int moved = !(cap > 0 && cnt[e0] >= cap && cnt[e1] - 1 >= cap);
	assert_int_equal(tier_moe_layer_bwd_routed(dev, cfg, T, L->x, L->wr, w, lo, s, cnt, L->R, 1.0f, dx2, NULL, ws,
						   wb), moved ? -EIO : 0);
	free(dx), free(dx2), free(dwr), free(dwr2);
}

static void run_case(const lcase *c)
{
	const tier_moe_cfg *cfg = &c->cfg;
	layer L = { .c = c, .T = c->T, .E = cfg->router.n_experts, .k = cfg->router.top_k, .H = cfg->hidden,
		    .I = cfg->inter, .r = c->r };
	int T = L.T, E = L.E, k = L.k, H = L.H, I = L.I, r = L.r;
	const size_t wn[3] = { (size_t)I * H, (size_t)I * H, (size_t)H * I }, ins[3] = { H, H, I }, outs[3] = { I, I, H };
	L.x = malloc(4 * (size_t)T * H), L.wr = malloc(4 * (size_t)E * H), L.bias = malloc(4 * (size_t)E);
	L.R = malloc(4 * (size_t)T * H);
	ref_fill(&rng, L.x, (size_t)T * H, 1.0f);
	ref_fill(&rng, L.wr, (size_t)E * H, 0.5f);
	ref_fill(&rng, L.bias, (size_t)E, 0.05f);
	ref_fill(&rng, L.R, (size_t)T * H, 1.0f);
	if (c->skew)
		for (int t = 0; t < T; t++) {
			L.x[t * H] = 3.0f;
			for (int e = 0; e < E; e++)
				L.wr[e * H] = e == 0 ? 5.0f : 0.0f;
		}
	tier_moe_loras lo;
	memset(&lo, 0, sizeof lo);
	tier_moe_lora *lp[3] = { &lo.gate, &lo.up, &lo.down };
	for (int q = 0; q < 3; q++) {
		L.w[q] = arr(E, wn[q], 0.3f);
		L.wd[q] = darr(L.w[q], E, wn[q]);
		if (!r)
			continue;
		L.a[q] = arr(E, r * ins[q], 0.3f), L.b[q] = arr(E, outs[q] * r, 0.3f);
		L.da[q] = arr(E, r * ins[q], 1.0f), L.db[q] = arr(E, outs[q] * r, 1.0f);
		L.ad[q] = darr(L.a[q], E, r * ins[q]), L.bdd[q] = darr(L.b[q], E, outs[q] * r);
		*lp[q] = (tier_moe_lora){ (const float *const *)L.a[q], (const float *const *)L.b[q], L.da[q], L.db[q], r, 0.75f };
	}
	tier_moe_experts w = { .gate = (const float *const *)L.w[0], .up = (const float *const *)L.w[1],
			       .down = (const float *const *)L.w[2] };
	size_t sb = tier_moe_saved_bytes(cfg, T), wb = tier_moe_workspace_bytes(cfg, T, &lo);
	assert_true(sb > 0 && wb > 0);
	void *sbuf = malloc(sb), *ws = malloc(wb);
	tier_moe_saved s;
	assert_int_equal(tier_moe_saved_bind(cfg, T, sbuf, sb, &s), 0);
	ref_poison(sbuf, sb);
	float *out = malloc(4 * (size_t)T * H), *dx = malloc(4 * (size_t)T * H), *dwr = malloc(4 * (size_t)E * H);
	ref_poison(out, 4 * (size_t)T * H);
	const float *bias = cfg->router.kind == TIER_MOE_ROUTER_SIGMOID_GROUP ? L.bias : NULL;
	assert_int_equal(tier_moe_layer_fwd(dev, cfg, T, L.x, L.wr, bias, &w, &lo, out, &s, ws, wb), 0);
	{ /* out NULL (a backward's recompute): the same saved state, bit for bit, without the combine */
		void *sbuf2 = malloc(sb);
		tier_moe_saved s2;
		assert_int_equal(tier_moe_saved_bind(cfg, T, sbuf2, sb, &s2), 0);
		ref_poison(sbuf2, sb);
		assert_int_equal(tier_moe_layer_fwd(dev, cfg, T, L.x, L.wr, bias, &w, &lo, NULL, &s2, ws, wb), 0);
		assert_memory_equal(sbuf, sbuf2, sb);
		assert_true(s2.aux == s.aux && s2.z == s.z);
		free(sbuf2);
	}
	routed_fwd_same(cfg, T, &L, bias, &w, &lo, &s, sbuf, sb, out, ws, wb);
	L.idx = s.topk_idx, L.pair_row = s.pair_row;
	L.xd = ref_dup(L.x, (size_t)T * H), L.wrd = ref_dup(L.wr, (size_t)E * H), L.Rd = ref_dup(L.R, (size_t)T * H);

	/* drops: the first `cap` pairs of each expert in token order stay */
	int cap = tier_moe_capacity(T, k, E, cfg->capacity_factor), *seen = calloc((size_t)E, sizeof(int)), drops = 0;
	int *cnt = calloc((size_t)E, sizeof(int));
	for (int p = 0; p < T * k; p++) {
		int e = s.topk_idx[p];
		cnt[e]++;
		assert_int_equal(s.pair_row[p] < 0, cap > 0 && seen[e]++ >= cap);
		drops += s.pair_row[p] < 0;
	}
	for (int e = 0; e < E; e++)
		assert_int_equal(s.counts[e], cnt[e]);
	if (c->skew && cap > 0)
		assert_true(drops > 0);
	double *outr = malloc(8 * (size_t)T * H), aux, z;
	ref_loss(&L, outr);
	assert_true(ref_relerr(out, outr, (size_t)T * H) <= REF_TOL);
	{
		double *lg = calloc((size_t)T * E, 8);
		int *sel = malloc(sizeof(int) * (size_t)T * k);
		for (int t = 0; t < T; t++)
			for (int e = 0; e < E; e++)
				for (int h = 0; h < H; h++)
					lg[t * E + e] += L.xd[t * H + h] * L.wrd[e * H + h];
		for (int i = 0; i < T * k; i++)
			sel[i] = s.topk_idx[i];
		ref_aux(T, E, k, cfg->aux_coef, cfg->z_coef, lg, sel, NULL, &aux, &z);
		assert_true(fabs(s.aux - aux) <= REF_TOL * fabs(aux) + 1e-30 && fabs(s.z - z) <= REF_TOL * fabs(z) + 1e-30);
		free(lg), free(sel);
	}

	/* backward with d_aux = 1: the losses are part of the total */
	ref_fill(&rng, dwr, (size_t)E * H, 1.0f);
	double *dwr0 = ref_dup(dwr, (size_t)E * H), **da0[3] = { 0 }, **db0[3] = { 0 };
	for (int q = 0; q < 3 && r; q++)
		da0[q] = darr(L.da[q], E, r * ins[q]), db0[q] = darr(L.db[q], E, outs[q] * r);
	ref_poison(dx, 4 * (size_t)T * H);
	assert_int_equal(tier_moe_layer_bwd(dev, cfg, T, L.x, L.wr, &w, &lo, &s, L.R, 1.0f, dx, dwr, ws, wb), 0);
	check_grad(&L, dx, NULL, L.xd, (size_t)T * H);
	check_grad(&L, dwr, dwr0, L.wrd, (size_t)E * H);
	for (int q = 0; q < 3 && r; q++)
		for (int e = 0; e < E; e++) {
			if (s.offsets[e + 1] == s.offsets[e]) { /* no rows: no gradient */
				for (size_t i = 0; i < r * ins[q]; i++)
					assert_true(L.da[q][e][i] == (float)da0[q][e][i]);
				continue;
			}
			check_grad(&L, L.da[q][e], da0[q][e], L.ad[q][e], r * ins[q]);
			check_grad(&L, L.db[q][e], db0[q][e], L.bdd[q][e], outs[q] * r);
		}
	routed_bwd_same(cfg, T, &L, &w, &lo, &s, ws, wb);
	for (int q = 0; q < 3; q++) {
		afree((void **)L.w[q], E), afree((void **)L.wd[q], E);
		afree((void **)L.a[q], E), afree((void **)L.b[q], E), afree((void **)L.da[q], E), afree((void **)L.db[q], E);
		afree((void **)L.ad[q], E), afree((void **)L.bdd[q], E), afree((void **)da0[q], E), afree((void **)db0[q], E);
	}
	free(L.x), free(L.wr), free(L.bias), free(L.R), free(L.xd), free(L.wrd), free(L.Rd), free(sbuf), free(ws);
	free(out), free(dx), free(dwr), free(dwr0), free(seen), free(cnt), free(outr);
}

#define RT(kind_, E_, k_, norm_, G_, tg_, rsf_) \
	{ .kind = (kind_), .n_experts = (E_), .top_k = (k_), .norm_topk_prob = (norm_), .n_group = (G_), \
	  .topk_group = (tg_), .routed_scaling_factor = (rsf_) }

static void test_layer_qwen_mixtral(void **state)
{
	(void)state;
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 4, 2, 0, 0, 0, 0), 13, 11, 0, 0.01f, 0.001f, TIER_MOE_F32 }, 7, 2, 0 });
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 6, 3, 1, 0, 0, 0), 9, 5, 0, 0.02f, 0, TIER_MOE_F32 }, 5, 1, 0 });
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_TOPK_SOFTMAX, 5, 2, 0, 0, 0, 0), 7, 6, 0, 0, 0.01f, TIER_MOE_F32 }, 6, 2, 0 });
}

static void test_layer_deepseek(void **state)
{
	(void)state;
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SIGMOID_GROUP, 6, 2, 1, 3, 2, 2.5f), 7, 5, 0, 0.01f, 0.001f, TIER_MOE_F32 }, 8, 2, 0 });
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SIGMOID_GROUP, 4, 2, 0, 1, 0, 1.0f), 5, 3, 0, 0, 0, TIER_MOE_F32 }, 3, 0, 0 });
}

static void test_layer_edges(void **state)
{
	(void)state;
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 3, 3, 1, 0, 0, 0), 5, 3, 0, 0.01f, 0, TIER_MOE_F32 }, 4, 1, 0 });  /* k = E */
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_TOPK_SOFTMAX, 8, 2, 0, 0, 0, 0), 7, 3, 0, 0.01f, 0.01f, TIER_MOE_F32 }, 1, 2, 0 }); /* T = 1, empty experts */
	/* all tokens to expert 0, capacity half of them: drops, and the dropped pairs get no gradient */
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 4, 1, 0, 0, 0, 0), 6, 5, 2.0f, 0.01f, 0, TIER_MOE_F32 }, 8, 1, 1 });
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_TOPK_SOFTMAX, 4, 2, 0, 0, 0, 0), 6, 5, 0, 0.01f, 0, TIER_MOE_F32 }, 8, 1, 1 });  /* dropless skew */
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 5, 2, 1, 0, 0, 0), 7, 3, 1.0f, 0.01f, 0, TIER_MOE_F32 }, 9, 1, 0 }); /* cf 1 */
}

static void test_layer_896_experts(void **state)
{
	(void)state;
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 896, 16, 1, 0, 0, 0), 8, 4, 0, 0.001f, 0.0001f, TIER_MOE_F32 }, 3, 1, 0 });
	run_case(&(lcase){ { RT(TIER_MOE_ROUTER_SIGMOID_GROUP, 896, 16, 1, 8, 4, 2.5f), 5, 3, 1.0f, 0, 0, TIER_MOE_F32 }, 2, 1, 0 });
}

static void test_layer_bad_input(void **state)
{
	(void)state;
	tier_moe_cfg cfg = { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 4, 2, 0, 0, 0, 0), 3, 2, 0, 0.01f, 0, TIER_MOE_F32 };
	int T = 2;
	size_t sb = tier_moe_saved_bytes(&cfg, T), wb = tier_moe_workspace_bytes(&cfg, T, NULL);
	void *sbuf = malloc(sb), *ws = malloc(wb);
	float x[6] = { 0 }, wr[12] = { 0 }, out[6], wbuf[6] = { 0 };
	const float *p[4] = { wbuf, wbuf, wbuf, wbuf };
	tier_moe_experts w = { .gate = p, .up = p, .down = p };
	tier_moe_saved s;
	assert_int_equal(tier_moe_saved_bind(&cfg, T, sbuf, sb - 1, &s), -EINVAL);
	assert_int_equal(tier_moe_saved_bind(&cfg, T, sbuf, sb, &s), 0);
	out[0] = 42.0f;
	assert_int_equal(tier_moe_layer_fwd(dev, &cfg, T, x, wr, NULL, &w, NULL, out, &s, ws, wb - 1), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "workspace"));
	assert_int_equal(tier_moe_layer_fwd(dev, &cfg, T + 1, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	assert_int_equal(tier_moe_layer_fwd(dev, &cfg, T, NULL, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	assert_int_equal(tier_moe_layer_fwd(dev, &cfg, T, x, wr, NULL, NULL, NULL, out, &s, ws, wb), -EINVAL);
	assert_true(out[0] == 42.0f);
	tier_moe_cfg bad = cfg;
	bad.router.top_k = 5;
	assert_true(tier_moe_saved_bytes(&bad, T) == 0 && tier_moe_workspace_bytes(&bad, T, NULL) == 0);
	assert_int_equal(tier_moe_layer_fwd(dev, &bad, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	bad = cfg;
	bad.inter = 0;
	assert_int_equal(tier_moe_layer_fwd(dev, &bad, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	bad = cfg;
	bad.aux_coef = NAN;
	assert_int_equal(tier_moe_layer_fwd(dev, &bad, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	assert_int_equal(tier_moe_layer_fwd(dev, &cfg, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), 0);
	assert_int_equal(tier_moe_layer_bwd(dev, &cfg, T, x, wr, &w, NULL, &s, NULL, 1.0f, out, NULL, ws, wb), -EINVAL);
	assert_int_equal(tier_moe_layer_bwd(dev, &cfg, T, x, wr, &w, NULL, &s, x, NAN, out, NULL, ws, wb), -EINVAL);
	assert_int_equal(tier_moe_layer_bwd(dev, &cfg, T, x, wr, &w, NULL, &s, x, 1.0f, out, NULL, ws, wb), 0);
	{ /* the routed halves' counts: NULL, negative, more pairs than T k */
		int32_t cnt[4] = { 0 };
		assert_int_equal(tier_moe_layer_route(dev, &cfg, T, x, wr, NULL, &s, ws, wb, cnt), 0);
		assert_int_equal(cnt[0] + cnt[1] + cnt[2] + cnt[3], T * 2);
		assert_int_equal(tier_moe_layer_fwd_routed(dev, &cfg, T, x, &w, NULL, NULL, out, &s, ws, wb), -EINVAL);
		int32_t neg[4] = { -1, 0, 0, 0 }, many[4] = { 4, 1, 0, 0 };
		assert_int_equal(tier_moe_layer_fwd_routed(dev, &cfg, T, x, &w, NULL, neg, out, &s, ws, wb), -EINVAL);
		assert_non_null(strstr(tier_last_error(), "counts[0] = -1"));
		assert_int_equal(tier_moe_layer_fwd_routed(dev, &cfg, T, x, &w, NULL, many, out, &s, ws, wb), -EINVAL);
		assert_non_null(strstr(tier_last_error(), "more than T*k"));
		assert_int_equal(tier_moe_layer_bwd_routed(dev, &cfg, T, x, wr, &w, NULL, &s, many, x, 1.0f, out, NULL, ws,
							   wb), -EINVAL);
		assert_int_equal(tier_moe_layer_bwd_routed(dev, &cfg, T, x, wr, &w, NULL, &s, NULL, x, 1.0f, out, NULL, ws,
							   wb), -EINVAL);
		assert_int_equal(tier_moe_layer_route(dev, &cfg, T, NULL, wr, NULL, &s, ws, wb, cnt), -EINVAL);
		assert_int_equal(tier_moe_routing_check(dev), 0);
	}
	bad = cfg; /* bf16 storage is CUDA's; a CPU context refuses it */
	bad.dtype = TIER_MOE_BF16;
	assert_int_equal(tier_moe_layer_fwd(dev, &bad, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "CUDA"));
	bad.dtype = (tier_moe_dtype)7;
	assert_true(tier_moe_saved_bytes(&bad, T) == 0);
	tier_dev *gpu = NULL;
	if (tier_dev_open(&gpu, TIER_DEV_CUDA, 0) == 0) { /* fp32 storage on CUDA: refused (tests/test_moe_cuda.c) */
		assert_int_equal(tier_moe_layer_fwd(gpu, &cfg, T, x, wr, NULL, &w, NULL, out, &s, ws, wb), -EINVAL);
		assert_int_equal(tier_moe_layer_bwd(gpu, &cfg, T, x, wr, &w, NULL, &s, x, 1.0f, out, NULL, ws, wb), -EINVAL);
		tier_dev_close(gpu);
	}
	free(sbuf), free(ws);
}

/* The saved state's room for the adapters' kept Z (tier_moe_saved_bytes_lora): bf16 storage only,
 * one bf16 column a rank of each adapter present, and a buffer sized without it refused. With h
 * (tier_moe_saved_bytes_keep): T k I bf16 more past kept_z, bf16 only, keep_h 0 the _lora size, a
 * buffer sized without it refused by name. */
static void test_saved_lora(void **state)
{
	(void)state;
	tier_moe_cfg b16 = { RT(TIER_MOE_ROUTER_SOFTMAX_TOPK, 4, 2, 0, 0, 0, 0), 8, 8, 0, 0, 0, TIER_MOE_BF16 }, f32 = b16;
	f32.dtype = TIER_MOE_F32;
	const float *arr[4] = { NULL };
	tier_moe_loras lo;
	memset(&lo, 0, sizeof lo);
	lo.gate = (tier_moe_lora){ .a = arr, .b = arr, .rank = 8 };
	lo.down = (tier_moe_lora){ .a = arr, .b = arr, .rank = 16 }; /* up: no adapter */
	int T = 5;
	size_t plain = tier_moe_saved_bytes(&b16, T), with = tier_moe_saved_bytes_lora(&b16, T, &lo);
	size_t hb = 2 * (size_t)T * 2 * 8, keep = tier_moe_saved_bytes_keep(&b16, T, &lo, 1), fb = tier_moe_saved_bytes(&f32, T);
	assert_true(plain > 0 && with >= plain + 2 * (size_t)T * 2 * 24 && with < plain + 2 * (size_t)T * 2 * 24 + 64);
	assert_true(tier_moe_saved_bytes_lora(&b16, T, NULL) == plain);
	assert_true(tier_moe_saved_bytes_lora(&f32, T, &lo) == fb);
	assert_true(keep >= with + hb && keep < with + hb + 64 && tier_moe_saved_bytes_keep(&b16, T, &lo, 0) == with);
	assert_true(tier_moe_saved_bytes_keep(&b16, T, NULL, 1) >= plain + hb);
	assert_true(tier_moe_saved_bytes_keep(&f32, T, &lo, 1) == fb);
	char *buf = malloc(keep > fb ? keep : fb);
	tier_moe_saved s;
	assert_int_equal(tier_moe_saved_bind_lora(&b16, T, &lo, buf, plain, &s), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "tier_moe_saved_bytes_lora"));
	assert_int_equal(tier_moe_saved_bind_lora(&b16, T, &lo, buf, with, &s), 0);
	assert_int_equal(s.kept_cols, 24);
	assert_true((char *)s.kept_z >= (char *)s.u + 2 * (size_t)T * 2 * 8 &&
		    (char *)s.kept_z + 2 * (size_t)T * 2 * 24 <= buf + with);
	assert_true(s.kept == 0 && s.h_in_ws == 0 && s.kept_h == NULL);
	assert_int_equal(tier_moe_saved_bind_keep(&b16, T, &lo, 1, buf, with, &s), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "tier_moe_saved_bytes_keep"));
	assert_int_equal(tier_moe_saved_bind_keep(&b16, T, &lo, 1, buf, keep, &s), 0);
	assert_true((char *)s.kept_h >= (char *)s.kept_z + 2 * (size_t)T * 2 * 24 && (char *)s.kept_h + hb <= buf + keep);
	assert_true((((uintptr_t)s.kept_h - (uintptr_t)buf) & 63) == 0 && s.kept == 0 && s.h_in_ws == 0);
	assert_int_equal(tier_moe_saved_bind_keep(&f32, T, &lo, 1, buf, fb, &s), 0); /* no h in fp32 */
	assert_true(s.kept_h == NULL && s.kept_z == NULL);
	assert_int_equal(tier_moe_saved_bind(&b16, T, buf, plain, &s), 0);
	assert_true(s.kept_z == NULL && s.kept_cols == 0 && s.kept_h == NULL);
	free(buf);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_saved_lora),
		cmocka_unit_test(test_layer_qwen_mixtral), cmocka_unit_test(test_layer_deepseek),
		cmocka_unit_test(test_layer_edges),        cmocka_unit_test(test_layer_896_experts),
		cmocka_unit_test(test_layer_bad_input),
	};
	return cmocka_run_group_tests(tests, ref_setup, ref_teardown);
}
