/* test_golden.c - tier against HF transformers + PEFT: the golden fixtures of tests/golden/ (small
 * random qwen3_moe and mixtral models, an adapter, and what HF computed for them; make_fixtures.py
 * writes them, README.md lists every key). Norm-wise relative errors ||a - b|| / ||b|| in fp64,
 * fp32 everywhere. Data: $TIER_TEST_SRCDIR/tests/golden/data (make check sets it; default ".").
 * Built with GOLDEN_CUDA (test_golden_cuda) it runs the whole model on the trainer's CUDA path
 * (bf16 weights) for the cases whose head_dim the CUDA attention takes: loss, hidden states and
 * logits within the bf16 bound 2e-2 of HF on the same bf16-rounded weights; LoRA gradients on the
 * scale of HF's own bf16 arithmetic (check_grads_bf16). Without a GPU it is skipped (exit 77). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cmocka.h>
#include "tier/tier.h"

#ifdef TIER_HAVE_JANSSON

#ifdef GOLDEN_CUDA
#pragma GCC diagnostic ignored "-Wunused-function" /* the CPU-only checks are compiled but not listed */
#define TOL 2e-2             /* the acceptance bound of the CUDA path: bf16 weights against fp32 */
#else
#define TOL 1e-4             /* the acceptance bound, fp32 against fp32 */
#endif
#define PEFT_PREFIX "base_model.model.model.layers."

/* Each case and what its files must show (make_fixtures.py's CASES). */
typedef struct {
	const char *name;
	tier_expert_layout layout;
	int sharded, tied;
} gcase;
static const gcase cases[] = {
	{ "qwen3_moe_a", TIER_EXPERTS_PER_EXPERT, 0, 0 },
	{ "qwen3_moe_b", TIER_EXPERTS_FUSED, 0, 1 },
	{ "mixtral", TIER_EXPERTS_MIXTRAL, 1, 0 },
	{ "qwen3_moe_c", TIER_EXPERTS_PER_EXPERT, 0, 0 }, /* head_dim 32: also on CUDA */
	{ "mixtral_c", TIER_EXPERTS_MIXTRAL, 0, 0 },      /* head_dim 32: also on CUDA */
};

static tier_dev *cpu, *tdev; /* tdev: the trainer's device (the CPU, or CUDA with GOLDEN_CUDA) */
static char data_root[512];

/* One case opened: its config, checkpoint and fixture file, and the sizes. */
typedef struct {
	const gcase *c;
	char dir[600];
	tier_hf_config cfg;
	tier_ckpt *ck;
	tier_st *fx;
	int B, S, T, H, V, L, E, k, I;
} fixture;

static void fixture_open(fixture *f, const gcase *c)
{
	char p[700];
	memset(f, 0, sizeof *f);
	f->c = c;
	snprintf(f->dir, sizeof f->dir, "%s/%s", data_root, c->name);
	snprintf(p, sizeof p, "%s/model/config.json", f->dir);
	int rc = tier_hf_config_load(p, &f->cfg);
	if (rc)
		fail_msg("%s", tier_last_error());
	snprintf(p, sizeof p, "%s/model", f->dir);
	if ((rc = tier_ckpt_open(p, &f->ck)))
		fail_msg("%s", tier_last_error());
	snprintf(p, sizeof p, "%s/fixture.safetensors", f->dir);
	if ((rc = tier_st_open(p, &f->fx)))
		fail_msg("%s", tier_last_error());
	const tier_st_tensor *ids = tier_st_find(f->fx, "input_ids");
	assert_non_null(ids);
	assert_int_equal(ids->ndim, 2);
	f->B = (int)ids->shape[0], f->S = (int)ids->shape[1], f->T = f->B * f->S;
	f->H = (int)f->cfg.hidden_size, f->V = (int)f->cfg.vocab_size, f->L = (int)f->cfg.num_hidden_layers;
	f->E = (int)f->cfg.num_experts, f->k = (int)f->cfg.num_experts_per_tok;
	f->I = (int)f->cfg.moe_intermediate_size;
}

static void fixture_close(fixture *f)
{
	tier_st_close(f->fx);
	tier_ckpt_close(f->ck);
}

/* A tensor of the fixture: dtype and shape checked, read whole into a new buffer. */
static void *fx_read(const fixture *f, const char *name, tier_dtype dt, int ndim, const uint64_t *shape)
{
	const tier_st_tensor *t = tier_st_find(f->fx, name);
	if (!t)
		fail_msg("%s: fixture has no tensor '%s'", f->c->name, name);
	if (t->dtype != dt || t->ndim != ndim)
		fail_msg("%s: '%s' is %s with %d dims, expected %s with %d", f->c->name, name,
			 tier_dtype_name(t->dtype), t->ndim, tier_dtype_name(dt), ndim);
	for (int d = 0; d < ndim; d++)
		if (t->shape[d] != shape[d])
			fail_msg("%s: '%s' dim %d is %llu, expected %llu", f->c->name, name, d,
				 (unsigned long long)t->shape[d], (unsigned long long)shape[d]);
	void *buf = malloc(t->nbytes + 1);
	assert_int_equal(tier_st_read(f->fx, name, buf, t->nbytes), 0);
	return buf;
}

static float *fx_act(const fixture *f, const char *name)   /* [B, S, H] */
{
	uint64_t sh[3] = { (uint64_t)f->B, (uint64_t)f->S, (uint64_t)f->H };
	return fx_read(f, name, TIER_DT_F32, 3, sh);
}

static float *fx_scalar(const fixture *f, const char *name)
{
	uint64_t sh[1] = { 1 };
	return fx_read(f, name, TIER_DT_F32, 1, sh);
}

/* A checkpoint tensor as fp32 [rows, cols] (cols 0: a vector of rows). */
static float *ck_read(const fixture *f, const char *name, int64_t rows, int64_t cols)
{
	const tier_st *st;
	const tier_st_tensor *t;
	if (tier_ckpt_find(f->ck, name, &st, &t))
		fail_msg("%s", tier_last_error());
	assert_int_equal(t->ndim, cols ? 2 : 1);
	assert_int_equal(t->shape[0], rows);
	if (cols)
		assert_int_equal(t->shape[1], cols);
	size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
	float *buf = malloc(n * sizeof(float));
	assert_int_equal(tier_st_convert(st, name, buf, TIER_DT_F32, n), 0);
	return buf;
}

static int64_t *fx_tokens(const fixture *f, const char *name)
{
	uint64_t sh[2] = { (uint64_t)f->B, (uint64_t)f->S };
	return fx_read(f, name, TIER_DT_I64, 2, sh);
}

static double rel_err(const float *a, const float *b, size_t n)
{
	double d = 0, r = 0;
	for (size_t i = 0; i < n; i++) {
		d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
		r += (double)b[i] * b[i];
	}
	return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* Compare and report one tensor (llm.c style: one line each). */
static int check_close(const char *what, const float *got, const float *want, size_t n, double tol)
{
	double e = rel_err(got, want, n), mx = 0;
	for (size_t i = 0; i < n; i++)
		mx = fmax(mx, fabs((double)got[i] - want[i]));
	int ok = e <= tol;
	printf("#   %-58s rel %.2e  max abs %.2e  %s\n", what, e, mx, ok ? "ok" : "MISMATCH");
	return ok;
}

static int is_moe(const fixture *f, int layer)
{
	return tier_hf_layer_is_moe(&f->cfg, layer);
}

/* ---- The fixture files themselves ------------------------------------------------------------ */

/* Every key README.md lists is there with its dtype and shape; labels and shift_labels agree. */
static void test_fixture_shapes(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	assert_true(f.B >= 1 && f.S >= 2);
	int64_t *ids = fx_tokens(&f, "input_ids"), *lab = fx_tokens(&f, "labels"), *sh = fx_tokens(&f, "shift_labels");
	int ignored = 0;
	for (int b = 0; b < f.B; b++)
		for (int s = 0; s < f.S; s++) {
			int i = b * f.S + s;
			assert_true(ids[i] >= 0 && ids[i] < f.V);
			assert_true(lab[i] == -100 || (lab[i] >= 0 && lab[i] < f.V));
			assert_true(sh[i] == (s + 1 < f.S ? lab[i + 1] : -100));
			ignored += lab[i] == -100;
		}
	assert_true(ignored > 0 && ignored < f.T / 2);
	char name[64];
	for (int l = 0; l <= f.L; l++) {
		snprintf(name, sizeof name, "hidden.%d", l);
		free(fx_act(&f, name));
	}
	free(fx_act(&f, "final_norm"));
	static const char *const inner[] = { "attn_in", "attn_out", "mlp_in", "mlp_out", "lora.mlp_in", "lora.mlp_out" };
	for (int l = 0; l < f.L; l++)
		for (size_t j = 0; j < sizeof inner / sizeof *inner; j++) {
			snprintf(name, sizeof name, "%s.%d", inner[j], l);
			free(fx_act(&f, name));
		}
	uint64_t lsh[3] = { (uint64_t)f.B, (uint64_t)f.S, (uint64_t)f.V };
	free(fx_read(&f, "logits", TIER_DT_F32, 3, lsh));
	free(fx_read(&f, "lora.logits", TIER_DT_F32, 3, lsh));
	free(fx_scalar(&f, "loss"));
	free(fx_scalar(&f, "lora.loss"));
	free(fx_scalar(&f, "aux_loss"));
	for (int l = 0; l < f.L; l++) {
		snprintf(name, sizeof name, "router_logits.%d", l);
		if (!is_moe(&f, l)) {
			assert_null(tier_st_find(f.fx, name));   /* a dense layer has no router */
			continue;
		}
		uint64_t rsh[2] = { (uint64_t)f.T, (uint64_t)f.E };
		free(fx_read(&f, name, TIER_DT_F32, 2, rsh));
	}
	free(ids);
	free(lab);
	free(sh);
	fixture_close(&f);
}

/* Mean cross-entropy over counted tokens, recomputed in fp64 from the stored logits. */
static double ce_fp64(const float *logits, const int64_t *shift, int T, int V)
{
	double sum = 0;
	int n = 0;
	for (int t = 0; t < T; t++) {
		if (shift[t] == -100)
			continue;
		const float *z = logits + (size_t)t * V;
		double m = z[0], s = 0;
		for (int v = 1; v < V; v++)
			m = fmax(m, z[v]);
		for (int v = 0; v < V; v++)
			s += exp(z[v] - m);
		sum += m + log(s) - z[shift[t]];
		n++;
	}
	return sum / n;
}

static void test_fixture_loss(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	uint64_t lsh[3] = { (uint64_t)f.B, (uint64_t)f.S, (uint64_t)f.V };
	int64_t *sh = fx_tokens(&f, "shift_labels");
	static const char *const pairs[2][2] = { { "logits", "loss" }, { "lora.logits", "lora.loss" } };
	for (int i = 0; i < 2; i++) {
		float *z = fx_read(&f, pairs[i][0], TIER_DT_F32, 3, lsh), *loss = fx_scalar(&f, pairs[i][1]);
		double ce = ce_fp64(z, sh, f.T, f.V);
		printf("# %s %s: stored %.7f, from logits %.7f\n", f.c->name, pairs[i][1], loss[0], ce);
		assert_true(fabs(ce - loss[0]) <= 1e-6 * fabs(ce));
		free(z);
		free(loss);
	}
	free(sh);
	fixture_close(&f);
}

/* ---- The checkpoint, read by tier, against HF's numbers --------------------------------------- */

/* hidden.0 is the embedding lookup (bit-exact), final_norm the RMSNorm of the last layer's output,
 * logits final_norm lm_head^T (the embedding when tied), each recomputed in fp64. */
static void test_checkpoint(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	const gcase *c = f.c;
	printf("# %s: H %d, layers %d, experts %d (k %d, I %d), vocab %d, %zu shard(s)\n", c->name, f.H, f.L, f.E,
	       f.k, f.I, f.V, tier_ckpt_shard_count(f.ck));
	assert_int_equal(tier_ckpt_shard_count(f.ck) > 1, c->sharded);
	assert_int_equal(f.cfg.tie_word_embeddings, c->tied);
	const tier_st *st;
	const tier_st_tensor *t;
	assert_int_equal(tier_ckpt_find(f.ck, "lm_head.weight", &st, &t) == 0, !c->tied);
	for (int l = 0; l < f.L; l++)
		for (int e = 0; e < f.E; e++) {
			tier_expert_weights w;
			int rc = tier_ckpt_expert(f.ck, l, e, &w);
			if (!is_moe(&f, l)) {
				assert_int_equal(rc, -ENOENT);
				break;
			}
			assert_int_equal(rc, 0);
			assert_int_equal(w.layout, c->layout);
			assert_true(w.gate.rows == (uint64_t)f.I && w.gate.cols == (uint64_t)f.H);
			assert_true(w.up.rows == (uint64_t)f.I && w.up.cols == (uint64_t)f.H);
			assert_true(w.down.rows == (uint64_t)f.H && w.down.cols == (uint64_t)f.I);
		}

	int64_t *ids = fx_tokens(&f, "input_ids");
	float *emb = ck_read(&f, "model.embed_tokens.weight", f.V, f.H);
	float *h0 = fx_act(&f, "hidden.0");
	for (int i = 0; i < f.T; i++)
		assert_memory_equal(h0 + (size_t)i * f.H, emb + (size_t)ids[i] * f.H, sizeof(float) * f.H);

	char name[64];
	snprintf(name, sizeof name, "hidden.%d", f.L);
	float *hl = fx_act(&f, name), *fn = fx_act(&f, "final_norm"), *nw = ck_read(&f, "model.norm.weight", f.H, 0);
	float *ref = malloc(sizeof(float) * (size_t)f.T * (f.V > f.H ? f.V : f.H));
	for (int i = 0; i < f.T; i++) {
		double ss = 0;
		for (int j = 0; j < f.H; j++)
			ss += (double)hl[i * f.H + j] * hl[i * f.H + j];
		double r = 1 / sqrt(ss / f.H + f.cfg.rms_norm_eps);
		for (int j = 0; j < f.H; j++)
			ref[i * f.H + j] = (float)(hl[i * f.H + j] * r * nw[j]);
	}
	assert_true(check_close("final_norm = RMSNorm(hidden.L) (fp64)", fn, ref, (size_t)f.T * f.H, 1e-6));

	float *head = c->tied ? emb : ck_read(&f, "lm_head.weight", f.V, f.H);
	uint64_t lsh[3] = { (uint64_t)f.B, (uint64_t)f.S, (uint64_t)f.V };
	float *z = fx_read(&f, "logits", TIER_DT_F32, 3, lsh);
	for (int i = 0; i < f.T; i++)
		for (int v = 0; v < f.V; v++) {
			double s = 0;
			for (int j = 0; j < f.H; j++)
				s += (double)fn[i * f.H + j] * head[(size_t)v * f.H + j];
			ref[(size_t)i * f.V + v] = (float)s;
		}
	assert_true(check_close("logits = final_norm lm_head^T (fp64)", z, ref, (size_t)f.T * f.V, 1e-5));
	if (!c->tied)
		free(head);
	free(ids), free(emb), free(h0), free(hl), free(fn), free(nw), free(ref), free(z);
	fixture_close(&f);
}

/* ---- The adapter ------------------------------------------------------------------------------- */

static const tier_peft_module *find_module(const tier_peft_adapter *a, int layer, const char *module)
{
	for (size_t i = 0; i < a->n_modules; i++)
		if (a->modules[i].layer == layer && !strcmp(a->modules[i].module, module))
			return &a->modules[i];
	return NULL;
}

static void expert_module(const fixture *f, int e, int proj, char *buf, size_t len)
{
	static const char *const qwen[] = { "gate_proj", "up_proj", "down_proj" }, *const mix[] = { "w1", "w3", "w2" };
	if (f->c->layout == TIER_EXPERTS_MIXTRAL)
		snprintf(buf, len, "block_sparse_moe.experts.%d.%s", e, mix[proj]);
	else
		snprintf(buf, len, "mlp.experts.%d.%s", e, qwen[proj]);
}

/* tier_peft_load reads the adapter against the model config: q/k/v/o on every layer, the three
 * projections of every expert of the MoE layers, nothing on the dense MLP (PEFT 0.21 on
 * transformers 5 maps gate_proj/up_proj/down_proj onto the experts only), and a gradient in the
 * fixture for each A and B. The adapter checked against another case's config is refused. */
static void test_adapter(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	char p[700], module[96], key[256];
	snprintf(p, sizeof p, "%s/adapter", f.dir);
	tier_peft_adapter *a = NULL;
	if (tier_peft_load(p, &f.cfg, &a))
		fail_msg("%s", tier_last_error());
	assert_int_equal(a->r, 4);
	assert_true(a->lora_alpha == 8 && !a->use_rslora && a->dtype == TIER_DT_F32);
	size_t want = 0, grads = 0;
	for (int l = 0; l < f.L; l++)
		want += 4 + (is_moe(&f, l) ? 3 * (size_t)f.E : 0);
	assert_int_equal(a->n_modules, want);
	for (size_t i = 0; i < tier_st_count(f.fx); i++)
		grads += strncmp(tier_st_at(f.fx, i)->name, "grad.", 5) == 0;
	assert_int_equal(grads, 2 * want);
	static const char *const attn[] = { "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj" };
	int nonzero_experts = 0;
	for (int l = 0; l < f.L; l++) {
		assert_null(find_module(a, l, "mlp.gate_proj"));
		for (int j = 0; j < 4 + (is_moe(&f, l) ? 3 * f.E : 0); j++) {
			if (j < 4)
				snprintf(module, sizeof module, "%s", attn[j]);
			else
				expert_module(&f, (j - 4) / 3, (j - 4) % 3, module, sizeof module);
			const tier_peft_module *m = find_module(a, l, module);
			if (!m)
				fail_msg("%s: adapter has no layer %d %s", f.c->name, l, module);
			uint64_t sa[2] = { (uint64_t)a->r, (uint64_t)m->in }, sb[2] = { (uint64_t)m->out, (uint64_t)a->r };
			snprintf(key, sizeof key, "grad." PEFT_PREFIX "%d.%s.lora_A.weight", l, module);
			float *ga = fx_read(&f, key, TIER_DT_F32, 2, sa);
			snprintf(key, sizeof key, "grad." PEFT_PREFIX "%d.%s.lora_B.weight", l, module);
			float *gb = fx_read(&f, key, TIER_DT_F32, 2, sb);
			double na = 0, nb = 0, wa = 0, wb = 0;
			for (int64_t x = 0; x < a->r * m->in; x++)
				na += fabs(ga[x]), wa += fabs(m->a[x]);
			for (int64_t x = 0; x < a->r * m->out; x++)
				nb += fabs(gb[x]), wb += fabs(m->b[x]);
			assert_true(wa > 0 && wb > 0);             /* random non-zero A and B */
			if (j < 4)
				assert_true(na > 0 && nb > 0);     /* attention sees every token */
			else
				nonzero_experts += na > 0;
			free(ga);
			free(gb);
		}
	}
	assert_true(nonzero_experts > 0);
	tier_peft_free(a);

	/* Shapes are checked against the model: another case's config is refused. */
	fixture g;
	const gcase *other = f.c == &cases[0] ? &cases[1] : &cases[0];
	fixture_open(&g, other);
	assert_int_equal(tier_peft_load(p, &g.cfg, &a), -EBADMSG);
	assert_null(a);
	printf("# %s adapter with %s's config: %s\n", f.c->name, other->name, tier_last_error());
	fixture_close(&g);
	fixture_close(&f);
}

/* ---- tier's MoE block (moe/) and dense MLP (core/ layers) against HF's, layer by layer ---------- */

static float *read_part(const tier_expert_part *p)
{
	assert_int_equal(p->dtype, TIER_DT_F32);
	float *buf = malloc(p->nbytes);
	assert_int_equal(tier_st_read_range(p->st, p->t, p->off, buf, p->nbytes), 0);
	return buf;
}

static void *alloc64(size_t bytes)
{
	return aligned_alloc(64, (bytes + 127) / 64 * 64);
}

/* The expert weights of one layer (any layout, through tier_ckpt_expert) and, when a is given,
 * their LoRA: arrays of E pointers, freed by free_experts. */
typedef struct {
	float *w[3][TIER_MOE_MAX_EXPERTS];                 /* gate, up, down */
	const float *la[3][TIER_MOE_MAX_EXPERTS], *lb[3][TIER_MOE_MAX_EXPERTS];
	tier_moe_experts ex;
	tier_moe_loras lora;
} layer_experts;

static void load_experts(const fixture *f, int l, const tier_peft_adapter *a, layer_experts *x)
{
	memset(x, 0, sizeof *x);
	char module[96];
	for (int e = 0; e < f->E; e++) {
		tier_expert_weights w;
		assert_int_equal(tier_ckpt_expert(f->ck, l, e, &w), 0);
		x->w[0][e] = read_part(&w.gate), x->w[1][e] = read_part(&w.up), x->w[2][e] = read_part(&w.down);
		for (int p = 0; a && p < 3; p++) {
			expert_module(f, e, p, module, sizeof module);
			const tier_peft_module *m = find_module(a, l, module);
			assert_non_null(m);
			x->la[p][e] = m->a, x->lb[p][e] = m->b;
		}
	}
	x->ex = (tier_moe_experts){ .gate = (const float *const *)x->w[0], .up = (const float *const *)x->w[1],
				    .down = (const float *const *)x->w[2], .order = TIER_MOE_GATE_FIRST };
	tier_moe_lora *ls[3] = { &x->lora.gate, &x->lora.up, &x->lora.down };
	for (int p = 0; a && p < 3; p++)
		*ls[p] = (tier_moe_lora){ .a = x->la[p], .b = x->lb[p], .rank = a->r, .scale = (float)(a->lora_alpha / a->r) };
}

static void free_experts(const fixture *f, layer_experts *x)
{
	for (int p = 0; p < 3; p++)
		for (int e = 0; e < f->E; e++)
			free(x->w[p][e]);
}

static tier_moe_cfg moe_cfg(const fixture *f)
{
	tier_moe_cfg c = { .hidden = f->H, .inter = f->I, .capacity_factor = 0, .aux_coef = 0, .z_coef = 0 };
	c.router = (tier_moe_router_cfg){ .n_experts = f->E, .top_k = f->k, .norm_topk_prob = f->cfg.norm_topk_prob,
		.kind = f->c->layout == TIER_EXPERTS_MIXTRAL ? TIER_MOE_ROUTER_TOPK_SOFTMAX : TIER_MOE_ROUTER_SOFTMAX_TOPK };
	return c;
}

/* One MoE layer through tier_moe_layer_fwd on HF's block input; its router logits and top-k are
 * appended to all_logits / all_idx (for the aux loss). Returns 1 when everything matched. */
static int moe_layer(const fixture *f, int l, const tier_peft_adapter *a, float *all_logits, int32_t *all_idx)
{
	char name[96], what[128];
	const char *pre = a ? "lora." : "";
	tier_moe_cfg mc = moe_cfg(f);
	layer_experts *x = malloc(sizeof *x);
	load_experts(f, l, a, x);
	snprintf(name, sizeof name, f->c->layout == TIER_EXPERTS_MIXTRAL ? "model.layers.%d.block_sparse_moe.gate.weight" :
		 "model.layers.%d.mlp.gate.weight", l);
	float *wr = ck_read(f, name, f->E, f->H);
	snprintf(name, sizeof name, "%smlp_in.%d", pre, l);
	float *in = fx_act(f, name);
	snprintf(name, sizeof name, "%smlp_out.%d", pre, l);
	float *want = fx_act(f, name), *out = malloc(sizeof(float) * (size_t)f->T * f->H);
	size_t sb = tier_moe_saved_bytes(&mc, f->T), wb = tier_moe_workspace_bytes(&mc, f->T, a ? &x->lora : NULL);
	void *sbuf = alloc64(sb), *ws = alloc64(wb);
	tier_moe_saved sv;
	assert_true(sb > 0 && wb > 0);
	assert_int_equal(tier_moe_saved_bind(&mc, f->T, sbuf, sb, &sv), 0);
	for (size_t i = 0; i < (size_t)f->T * f->H; i++)
		out[i] = NAN;                             /* poisoned: the layer must write all of it */
	if (tier_moe_layer_fwd(cpu, &mc, f->T, in, wr, NULL, &x->ex, a ? &x->lora : NULL, out, &sv, ws, wb))
		fail_msg("%s", tier_last_error());
	snprintf(what, sizeof what, "%s layer %d %sMoE block", f->c->name, l, pre);
	int ok = check_close(what, out, want, (size_t)f->T * f->H, TOL);
	if (!a) {
		snprintf(name, sizeof name, "router_logits.%d", l);
		uint64_t rsh[2] = { (uint64_t)f->T, (uint64_t)f->E };
		float *rl = fx_read(f, name, TIER_DT_F32, 2, rsh);
		snprintf(what, sizeof what, "%s layer %d router logits", f->c->name, l);
		ok &= check_close(what, sv.logits, rl, (size_t)f->T * f->E, TOL);
		memcpy(all_logits, sv.logits, sizeof(float) * f->T * f->E);
		memcpy(all_idx, sv.topk_idx, sizeof(int32_t) * f->T * f->k);
		free(rl);
	}
	free(sbuf), free(ws), free(in), free(want), free(out), free(wr);
	free_experts(f, x);
	free(x);
	return ok;
}

/* A dense MLP layer through tier_linear_fwd and tier_swiglu_fwd (no LoRA: PEFT puts none there). */
static int dense_layer(const fixture *f, int l)
{
	char name[96], what[96];
	int I = (int)f->cfg.intermediate_size, T = f->T, H = f->H;
	static const char *const proj[] = { "gate_proj", "up_proj", "down_proj" };
	float *w[3];
	for (int p = 0; p < 3; p++) {
		snprintf(name, sizeof name, "model.layers.%d.mlp.%s.weight", l, proj[p]);
		w[p] = ck_read(f, name, p == 2 ? H : I, p == 2 ? I : H);
	}
	snprintf(name, sizeof name, "mlp_in.%d", l);
	float *in = fx_act(f, name);
	snprintf(name, sizeof name, "mlp_out.%d", l);
	float *want = fx_act(f, name), *g = malloc(sizeof(float) * T * I), *u = malloc(sizeof(float) * T * I);
	float *h = malloc(sizeof(float) * T * I), *out = malloc(sizeof(float) * T * H);
	assert_int_equal(tier_linear_fwd(cpu, T, H, I, in, w[0], NULL, g, NULL), 0);
	assert_int_equal(tier_linear_fwd(cpu, T, H, I, in, w[1], NULL, u, NULL), 0);
	assert_int_equal(tier_swiglu_fwd(cpu, (size_t)T * I, g, u, h), 0);
	assert_int_equal(tier_linear_fwd(cpu, T, I, H, h, w[2], NULL, out, NULL), 0);
	snprintf(what, sizeof what, "%s layer %d dense MLP", f->c->name, l);
	int ok = check_close(what, out, want, (size_t)T * H, TOL);
	for (int p = 0; p < 3; p++)
		free(w[p]);
	free(in), free(want), free(g), free(u), free(h), free(out);
	return ok;
}

/* Every MLP block with and without the adapter, and HF's aux loss (load_balancing_loss_func over
 * the router logits of all MoE layers together, without its coefficient) from tier_moe_aux_fwd on
 * the concatenated logits. */
static void test_moe_blocks(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	char p[700];
	snprintf(p, sizeof p, "%s/adapter", f.dir);
	tier_peft_adapter *a;
	assert_int_equal(tier_peft_load(p, &f.cfg, &a), 0);
	float *logits = malloc(sizeof(float) * f.L * f.T * f.E);
	int32_t *idx = malloc(sizeof(int32_t) * f.L * f.T * f.k);
	int ok = 1, n_moe = 0;
	for (int l = 0; l < f.L; l++) {
		if (!is_moe(&f, l)) {
			ok &= dense_layer(&f, l);
			continue;
		}
		ok &= moe_layer(&f, l, NULL, logits + (size_t)n_moe * f.T * f.E, idx + (size_t)n_moe * f.T * f.k);
		ok &= moe_layer(&f, l, a, NULL, NULL);
		n_moe++;
	}
	float aux = NAN, z = NAN, *want = fx_scalar(&f, "aux_loss");
	assert_int_equal(tier_moe_aux_fwd(cpu, n_moe * f.T, f.E, f.k, 1.0f, 0.0f, logits, idx, &aux, &z, NULL), 0);
	char what[96];
	snprintf(what, sizeof what, "%s aux loss (%d MoE layers)", f.c->name, n_moe);
	ok &= check_close(what, &aux, want, 1, TOL);
	assert_true(ok);
	free(want), free(logits), free(idx);
	tier_peft_free(a);
	fixture_close(&f);
}

/* ---- The whole model through the trainer (include/tier/model.h) ----------------------------------
 * tier_trainer_eval gives the per-layer hidden states, the loss and the LoRA gradients; the logits
 * are checked through the final hidden state and the lm_head. The base model is the adapter with
 * B = 0. A model type the trainer does not build yet is a skip with its message. */
typedef struct {
	tier_store *s;
	tier_model *m;
	tier_trainer *t;
} trainer_rig;

static int rig_open(const fixture *f, trainer_rig *r)
{
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.r = 4, lc.alpha = 8, lc.use_rslora = 0;
	lc.targets = TIER_LORA_Q | TIER_LORA_K | TIER_LORA_V | TIER_LORA_O | TIER_LORA_EXPERTS;
	tier_store_config sc = { .dev = tdev, .capacity = { 64u << 20, 64u << 20, 0 } };
	memset(r, 0, sizeof *r);
	assert_int_equal(tier_store_create(&r->s, &sc), 0);
	int rc = tier_model_create(r->s, tdev, &f->cfg, &lc, &r->m);
	if (rc == -ENOTSUP)
		return rc;
	char dir[700];
	snprintf(dir, sizeof dir, "%s/model", f->dir);
	if (rc || (rc = tier_model_load_hf(r->m, dir)) < 0)
		fail_msg("%s", tier_last_error());
	return 0;
}

static void rig_close(trainer_rig *r)
{
	tier_trainer_destroy(r->t);
	tier_model_destroy(r->m);
	tier_store_destroy(r->s);
}

/* Logits [T, V] from tier's final hidden state (index L + 1 of hid) and the lm_head, in fp64. */
static float *logits_of(const fixture *f, const float *hid)
{
	float *head = ck_read(f, f->c->tied ? "model.embed_tokens.weight" : "lm_head.weight", f->V, f->H);
	float *z = malloc(sizeof(float) * f->T * f->V);
	const float *hn = hid + (size_t)(f->L + 1) * f->T * f->H;
	for (int i = 0; i < f->T; i++)
		for (int v = 0; v < f->V; v++) {
			double s = 0;
			for (int j = 0; j < f->H; j++)
				s += (double)hn[i * f->H + j] * head[(size_t)v * f->H + j];
			z[(size_t)i * f->V + v] = (float)s;
		}
	free(head);
	return z;
}

/* The references a model evaluation is compared with: HF + PEFT in fp32 (""), and on CUDA also
 * the same on the bf16-rounded weights and adapter that the CUDA path computes with ("bf16w.",
 * make_fixtures.py's bf16_reference). The last one is the one asserted; the others are printed. */
#ifdef GOLDEN_CUDA
static const char *const refs[] = { "", "bf16w." };
#define GOLDEN_BF16 1 /* gradients: check_grads_bf16 */
#else
static const char *const refs[] = { "" };
#define GOLDEN_BF16 0
#endif
#define NREFS ((int)(sizeof refs / sizeof refs[0]))

/* Hidden states and logits of one evaluation against reference rp (prefix pre "" or "lora."). */
static int check_hidden(const fixture *f, const char *rp, const char *pre, const float *hid)
{
	char name[96], what[160];
	int ok = 1;
	size_t TH = (size_t)f->T * f->H;
	for (int l = 0; l <= f->L + 1; l++) {
		if (l == 0 && *pre)
			continue;                             /* the adapter does not touch the embeddings */
		if (l <= f->L)
			snprintf(name, sizeof name, "%s%shidden.%d", rp, pre, l);
		else if (!*pre)
			snprintf(name, sizeof name, "%sfinal_norm", rp);
		else
			continue;                             /* no lora.final_norm: the logits cover it */
		float *want = fx_act(f, name);
		snprintf(what, sizeof what, "%s %s", f->c->name, name);
		ok &= check_close(what, hid + (size_t)l * TH, want, TH, TOL);
		free(want);
	}
	float *z = logits_of(f, hid), *want;
	uint64_t lsh[3] = { (uint64_t)f->B, (uint64_t)f->S, (uint64_t)f->V };
	snprintf(name, sizeof name, "%s%slogits", rp, pre);
	want = fx_read(f, name, TIER_DT_F32, 3, lsh);
	snprintf(what, sizeof what, "%s %s (tier's final hidden x lm_head)", f->c->name, name);
	ok &= check_close(what, z, want, (size_t)f->T * f->V, TOL);
	free(z), free(want);
	return ok;
}

/* With TIER_GOLDEN_EXPORT=DIR: DIR/<case>/adapter as tier writes it (tier_model_lora_export +
 * tier_peft_save) and DIR/<case>/logits.safetensors (tier's logits and the token ids), the input
 * of tests/golden/check_peft_adapter.py, which checks them with PEFT (see README.md). */
static void export_for_peft(const fixture *f, tier_model *m, const float *hid, const int64_t *ids)
{
	const char *root = getenv("TIER_GOLDEN_EXPORT");
	char p[1200];
	if (!root || !*root)
		return;
	snprintf(p, sizeof p, "%s/%s", root, f->c->name);
	mkdir(root, 0755);
	mkdir(p, 0755);
	snprintf(p, sizeof p, "%s/%s/adapter", root, f->c->name);
	mkdir(p, 0755);
	tier_peft_adapter *a;
	assert_int_equal(tier_model_lora_export(m, 0, &a), 0);
	if (tier_peft_save(p, a))
		fail_msg("%s", tier_last_error());
	tier_peft_free(a);
	float *z = logits_of(f, hid);
	uint64_t B = (uint64_t)f->B, S = (uint64_t)f->S, V = (uint64_t)f->V;
	tier_st_wtensor t[2] = {
		{ .name = "logits", .dtype = TIER_DT_F32, .ndim = 3, .shape = { B, S, V }, .data = z },
		{ .name = "input_ids", .dtype = TIER_DT_I64, .ndim = 2, .shape = { B, S }, .data = ids },
	};
	snprintf(p, sizeof p, "%s/%s/logits.safetensors", root, f->c->name);
	if (tier_st_write(p, t, 2, NULL))
		fail_msg("%s", tier_last_error());
	printf("# %s: wrote %s/%s/adapter and logits.safetensors for check_peft_adapter.py\n", f->c->name, root,
	       f->c->name);
	free(z);
}

/* The fixture's <rp>grad.<PEFT key> of half (0: A, 1: B) of a module; *n its element count. */
static float *fx_grad(const fixture *f, const char *rp, const tier_peft_adapter *g, const tier_peft_module *mod,
		      int half, size_t *n)
{
	char key[256];
	uint64_t sh[2] = { half ? (uint64_t)mod->out : (uint64_t)g->r, half ? (uint64_t)g->r : (uint64_t)mod->in };
	snprintf(key, sizeof key, "%sgrad." PEFT_PREFIX "%d.%s.lora_%c.weight", rp, mod->layer, mod->module, "AB"[half]);
	*n = sh[0] * sh[1];
	return fx_read(f, key, TIER_DT_F32, 2, sh);
}

/* Every LoRA gradient of the last evaluation against <rp>grad.<PEFT key>. */
static int check_grads(const fixture *f, const char *rp, tier_model *m)
{
	tier_peft_adapter *g;
	char what[200];
	int ok = 1;
	assert_int_equal(tier_model_lora_export(m, 1, &g), 0);
	for (size_t i = 0; i < g->n_modules; i++) {
		const tier_peft_module *mod = &g->modules[i];
		for (int half = 0; half < 2; half++) {
			size_t n;
			float *want = fx_grad(f, rp, g, mod, half, &n);
			snprintf(what, sizeof what, "%s d %d.%s.%c", f->c->name, mod->layer, mod->module, "AB"[half]);
			/* an expert without tokens has zero gradients: rel_err is then the absolute norm */
			ok &= check_close(what, half ? mod->b : mod->a, want, n, TOL);
			free(want);
		}
	}
	tier_peft_free(g);
	return ok;
}

#ifdef GOLDEN_CUDA
/* The LoRA gradients of the CUDA path against HF's fp32 ones, on the scale of what bf16 costs HF
 * itself (hfbf16.*: HF + PEFT run in bf16, make_fixtures.py's hf_bf16): FlashAttention's test rule.
 * Each tensor: error <= max(TOL, 2 x HF-bf16's error); all tensors together: error <= HF-bf16's. */
static int check_grads_bf16(const fixture *f, tier_model *m)
{
	tier_peft_adapter *g;
	char what[200];
	double d2 = 0, h2 = 0, r2 = 0;
	int ok = 1;
	assert_int_equal(tier_model_lora_export(m, 1, &g), 0);
	for (size_t i = 0; i < g->n_modules; i++) {
		const tier_peft_module *mod = &g->modules[i];
		for (int half = 0; half < 2; half++) {
			size_t n;
			const float *got = half ? mod->b : mod->a;
			float *want = fx_grad(f, "", g, mod, half, &n), *hf = fx_grad(f, "hfbf16.", g, mod, half, &n);
			double e = rel_err(got, want, n), eh = rel_err(hf, want, n), bound = fmax(TOL, 2 * eh);
			for (size_t j = 0; j < n; j++) {
				d2 += ((double)got[j] - want[j]) * ((double)got[j] - want[j]);
				h2 += ((double)hf[j] - want[j]) * ((double)hf[j] - want[j]);
				r2 += (double)want[j] * want[j];
			}
			snprintf(what, sizeof what, "%s d %d.%s.%c", f->c->name, mod->layer, mod->module, "AB"[half]);
			printf("#   %-50s tier %.2e  HF bf16 %.2e  bound %.2e  %s\n", what, e, eh, bound,
			       e <= bound ? "ok" : "MISMATCH");
			ok &= e <= bound;
			free(want), free(hf);
		}
	}
	double et = sqrt(d2 / r2), eh = sqrt(h2 / r2);
	printf("# %s: all LoRA gradients against HF fp32: tier (CUDA, bf16) %.2e, HF + PEFT in bf16 %.2e: %s\n",
	       f->c->name, et, eh, et <= eh ? "ok" : "MISMATCH");
	tier_peft_free(g);
	return ok && et <= eh;
}
#endif

static int golden_chunks; /* tier_train_cfg.moe_chunks of test_model_vs_hf: 0 one piece, else the
			   * smallest divisor above 1 of the fixture's token count */
static int golden_opcache; /* test_model_vs_hf with the op cache: 1 the attention's output kept in DDR,
			    * 2 both halves kept in HBM (the MoE states with h: dec_shape.keep_h) */

/* The op cache served a run: some of its entries of `kind` kept in tier `at` (0 HBM, 1 DDR) hit. */
static void check_cache_hits(const char *name, tier_trainer *t, tier_op_kind kind, int at, const char *what)
{
	tier_cache_stats cs;
	assert_int_equal(tier_trainer_cache_stats(t, &cs), 0);
	printf("# %s: op cache: %llu %s kept in %s, %llu hits from there\n", name,
	       (unsigned long long)cs.kind[kind].admitted[at], what, at ? "ddr" : "hbm",
	       (unsigned long long)cs.kind[kind].hits[at]);
	assert_true(cs.kind[kind].hits[at] > 0);
}

static void test_model_vs_hf(void **state)
{
	fixture f;
	fixture_open(&f, *state);
	trainer_rig r;
	if (rig_open(&f, &r) == -ENOTSUP) {
		printf("# %s: the trainer does not build this model: %s\n", f.c->name, tier_last_error());
		rig_close(&r);
		fixture_close(&f);
		skip();
	}
	tier_train_cfg tc;
	tier_train_cfg_init(&tc);
	tc.batch = f.B, tc.seq = f.S;
	for (int d = 2; golden_chunks && d <= f.T && !tc.moe_chunks; d++)
		tc.moe_chunks = f.T % d ? 0 : d;
	if (golden_chunks)
		printf("# %s: the MoE half in %d chunks of %d tokens\n", f.c->name, tc.moe_chunks, f.T / tc.moe_chunks);
	if (golden_opcache == 1) /* no HBM budget: no attention half kept, its output alone from DDR */
		tc.opcache = "attention:ddr=32M";
	else if (golden_opcache == 2) /* every half kept in HBM: the backward reads the kept states */
		tc.opcache = "all:hbm=24M";
	assert_int_equal(tier_trainer_create(r.m, &tc, &r.t), 0);
	int64_t *ids = fx_tokens(&f, "input_ids"), *sh = fx_tokens(&f, "shift_labels");
	int32_t *tok = malloc(sizeof(int32_t) * f.T), *lab = malloc(sizeof(int32_t) * f.T);
	for (int i = 0; i < f.T; i++)
		tok[i] = (int32_t)ids[i], lab[i] = (int32_t)sh[i];
	char p[700];
	snprintf(p, sizeof p, "%s/adapter", f.dir);
	tier_peft_adapter *a;
	assert_int_equal(tier_peft_load(p, &f.cfg, &a), 0);
	size_t hn = (size_t)(f.L + 2) * f.T * f.H;
	float *hid = malloc(sizeof(float) * hn), loss = NAN;
	int ok = 1;
	for (int pass = 0; pass < 2; pass++) {          /* 0: base (B = 0), 1: the adapter */
		for (size_t i = 0; pass == 0 && i < a->n_modules; i++)
			memset(a->modules[i].b, 0, sizeof(float) * a->r * a->modules[i].out);
		if (pass == 1) {
			tier_peft_free(a);
			assert_int_equal(tier_peft_load(p, &f.cfg, &a), 0);
		}
		if (tier_model_lora_import(r.m, a))
			fail_msg("%s", tier_last_error());
		for (size_t i = 0; i < hn; i++)
			hid[i] = NAN;
		if (tier_trainer_eval(r.t, tok, lab, pass, &loss, hid))
			fail_msg("%s", tier_last_error());
		for (int k = 0; k < NREFS; k++) {
			char what[128], name[64];
			int okk = 1;
			printf("# %s against %s\n", f.c->name, *refs[k] ? "HF + PEFT on the bf16-rounded weights and adapter "
			       "(asserted)" : k + 1 < NREFS ? "HF + PEFT in fp32 (printed only)" : "HF + PEFT");
			snprintf(name, sizeof name, "%s%sloss", refs[k], pass ? "lora." : "");
			float *want = fx_scalar(&f, name);
			snprintf(what, sizeof what, "%s %s", f.c->name, name);
			okk &= check_close(what, &loss, want, 1, TOL);
			okk &= check_hidden(&f, refs[k], pass ? "lora." : "", hid);
			if (pass && !GOLDEN_BF16)
				okk &= check_grads(&f, refs[k], r.m);
			if (k == NREFS - 1)
				ok &= okk;
			free(want);
		}
#ifdef GOLDEN_CUDA
		if (pass)
			ok &= check_grads_bf16(&f, r.m);
#endif
		if (pass)
			export_for_peft(&f, r.m, hid, ids);
	}
	assert_true(ok);
	if (golden_opcache == 2) /* the gradients above came through the kept states, MoE's with h */
		check_cache_hits(f.c->name, r.t, TIER_OP_GROUPED_GEMM, 0, "MoE states");
	else if (golden_opcache) /* the gradients above came through the kept outputs */
		check_cache_hits(f.c->name, r.t, TIER_OP_ATTENTION, 1, "attention outputs");
	tier_peft_free(a);
	free(ids), free(sh), free(tok), free(lab), free(hid);
	rig_close(&r);
	fixture_close(&f);
}

/* The same comparison, the backward's recompute taking the attention's output from the op cache
 * in DDR (train_cache.c's OP_CORE) instead of running the attention. */
static void test_model_vs_hf_opcache(void **state)
{
	golden_opcache = 1;
	test_model_vs_hf(state);
	golden_opcache = 0;
}

#ifdef GOLDEN_CUDA
/* The same comparison, the backward reading each layer's two halves from the op cache in HBM:
 * the MoE states there hold h (dec_shape.keep_h), which the backward then takes as it is. */
static void test_model_vs_hf_kept(void **state)
{
	golden_opcache = 2;
	test_model_vs_hf(state);
	golden_opcache = 0;
}
#endif

/* The same comparison with the MoE half run in token chunks (tier_train_cfg.moe_chunks). */
static void test_model_vs_hf_chunked(void **state)
{
	golden_chunks = 1;
	test_model_vs_hf(state);
	golden_chunks = 0;
}

/* Bad input: one case's checkpoint under another case's config is refused with a message that
 * names the tensor, and leaves the model without data (evaluation then fails cleanly). */
static void test_wrong_checkpoint(void **state)
{
	fixture a, b;
	trainer_rig r;
	(void)state;
	fixture_open(&a, &cases[0]);
	fixture_open(&b, &cases[1]);
	char dir[700];
	snprintf(dir, sizeof dir, "%s/model", b.dir);
	assert_int_equal(rig_open(&a, &r), 0);
	int rc = tier_model_load_hf(r.m, dir);
	printf("# %s weights under %s's config: %d (%s)\n", b.c->name, a.c->name, rc, tier_last_error());
	assert_true(rc == -EBADMSG || rc == -ENOENT);
	assert_non_null(strstr(tier_last_error(), "model."));
	tier_train_cfg tc;
	tier_train_cfg_init(&tc);
	tc.batch = a.B, tc.seq = a.S;
	if (tier_trainer_create(r.m, &tc, &r.t) == 0) {
		int32_t tok[1024] = { 0 }, lab[1024] = { 0 };
		float loss;
		assert_true(a.T <= 1024);
		assert_true(tier_trainer_eval(r.t, tok, lab, 0, &loss, NULL) < 0);
	}
	rig_close(&r);
	fixture_close(&a);
	fixture_close(&b);
}

#endif /* TIER_HAVE_JANSSON */

int main(void)
{
#ifdef TIER_HAVE_JANSSON
	const char *src = getenv("TIER_TEST_SRCDIR");
	snprintf(data_root, sizeof data_root, "%s/tests/golden/data", src && *src ? src : ".");
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0))
		return 1;
	tdev = cpu;
	printf("# golden fixtures under %s\n", data_root);
#ifdef GOLDEN_CUDA
	if (!tier_cuda_available()) {
		printf("# no CUDA device: skipped\n");
		tier_dev_close(cpu);
		return 77;
	}
	if (tier_dev_open(&tdev, TIER_DEV_CUDA, 0))
		return fprintf(stderr, "%s\n", tier_last_error()), 1;
	const struct CMUnitTest tests[] = {
		{ "qwen3_moe_c: model_vs_hf (cuda)", test_model_vs_hf, NULL, NULL, (void *)&cases[3] },
		{ "mixtral_c: model_vs_hf (cuda)", test_model_vs_hf, NULL, NULL, (void *)&cases[4] },
		{ "qwen3_moe_c: model_vs_hf, MoE in chunks (cuda)", test_model_vs_hf_chunked, NULL, NULL, (void *)&cases[3] },
		{ "mixtral_c: model_vs_hf, MoE in chunks (cuda)", test_model_vs_hf_chunked, NULL, NULL, (void *)&cases[4] },
		{ "qwen3_moe_c: model_vs_hf, attention output from DDR (cuda)", test_model_vs_hf_opcache, NULL, NULL,
		  (void *)&cases[3] },
		{ "mixtral_c: model_vs_hf, attention output from DDR (cuda)", test_model_vs_hf_opcache, NULL, NULL,
		  (void *)&cases[4] },
		{ "qwen3_moe_c: model_vs_hf, both halves kept in HBM (cuda)", test_model_vs_hf_kept, NULL, NULL,
		  (void *)&cases[3] },
		{ "mixtral_c: model_vs_hf, both halves kept in HBM (cuda)", test_model_vs_hf_kept, NULL, NULL,
		  (void *)&cases[4] },
	};
#else
#define CASE_TESTS(i, n)                                                                          \
	{ n ": fixture_shapes", test_fixture_shapes, NULL, NULL, (void *)&cases[i] },             \
	{ n ": fixture_loss", test_fixture_loss, NULL, NULL, (void *)&cases[i] },                 \
	{ n ": checkpoint", test_checkpoint, NULL, NULL, (void *)&cases[i] },                     \
	{ n ": adapter", test_adapter, NULL, NULL, (void *)&cases[i] },                           \
	{ n ": moe_blocks", test_moe_blocks, NULL, NULL, (void *)&cases[i] },                     \
	{ n ": model_vs_hf", test_model_vs_hf, NULL, NULL, (void *)&cases[i] }
	const struct CMUnitTest tests[] = {
		CASE_TESTS(0, "qwen3_moe_a"), CASE_TESTS(1, "qwen3_moe_b"), CASE_TESTS(2, "mixtral"),
		CASE_TESTS(3, "qwen3_moe_c"), CASE_TESTS(4, "mixtral_c"),
		{ "qwen3_moe_a: model_vs_hf, MoE in chunks", test_model_vs_hf_chunked, NULL, NULL, (void *)&cases[0] },
		{ "mixtral: model_vs_hf, MoE in chunks", test_model_vs_hf_chunked, NULL, NULL, (void *)&cases[2] },
		{ "qwen3_moe_a: model_vs_hf, attention output from DDR", test_model_vs_hf_opcache, NULL, NULL,
		  (void *)&cases[0] },
		{ "mixtral: model_vs_hf, attention output from DDR", test_model_vs_hf_opcache, NULL, NULL, (void *)&cases[2] },
		cmocka_unit_test(test_wrong_checkpoint),
	};
#endif
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	if (tdev != cpu)
		tier_dev_close(tdev);
	tier_dev_close(cpu);
	return rc;
#else
	printf("# tier built without jansson: safetensors and config.json cannot be read; skipping\n");
	return 77;
#endif
}
