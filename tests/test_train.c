/* test_train.c - the whole training step on a tiny qwen3_moe model: LoRA gradients against central
 * differences of the loss, a falling loss, determinism, a store that is transparent under small
 * budgets, and bad input (config, tokens, budgets, data). */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "env_keep.h"
#define SEEDED_CPU_TEST "test_train" /* seeded_cpu.h: cpu, rng and seed, set up for the group */
#include "seeded_cpu.h"

/* Layer 0 MoE (4 experts of 8, k 2), layer 1 a dense MLP of 12; odd vocabulary; untied head. */
static void tiny_config(tier_hf_config *c)
{
	tier_model_config_default(c);
	c->hidden_size = 16, c->num_hidden_layers = 2, c->num_attention_heads = 2, c->num_key_value_heads = 1;
	c->head_dim = 8, c->num_experts = 4, c->num_experts_per_tok = 2, c->moe_intermediate_size = 8;
	c->intermediate_size = 12, c->vocab_size = 23, c->tie_word_embeddings = 0;
	memset(c->mlp_only, 0, sizeof c->mlp_only);
	c->mlp_only[0] = 1ull << 1;
}

/* 16 experts of 128, 4 layers of 32: enough weights for a budget that spills; default LoRA. */
static void wider_config(tier_hf_config *c, tier_lora_cfg *lc)
{
	tiny_config(c);
	c->num_experts = 16, c->moe_intermediate_size = 128, c->num_hidden_layers = 4, c->hidden_size = 32;
	tier_lora_cfg_init(lc);
}

/* tiny_config with LoRA on every target, PEFT's init (B zero). */
static void tiny_all_targets(tier_hf_config *c, tier_lora_cfg *lc)
{
	tiny_config(c);
	tier_lora_cfg_init(lc);
	lc->targets = 0x3f, lc->seed = seed;
}

/* wider_config with LoRA on every target, B initialised non-zero (so that every gradient is). */
static void wider_all_targets(tier_hf_config *c, tier_lora_cfg *lc)
{
	wider_config(c, lc);
	lc->targets = 0x3f, lc->init_b_std = 0.2f, lc->seed = seed;
}

typedef struct {
	tier_store *s;
	tier_model *m;
	tier_trainer *t;
	tier_train_cfg tc;
	int32_t *tok, *lab;
} rig;

static const char *rig_opcache; /* operator cache rules of the next rig (NULL: none) */
static int rig_micro = 1;        /* micro-batches of the next rig */
static int rig_chunks = 0;       /* MoE chunks of the next rig (tier_train_cfg.moe_chunks) */
static int rig_lmajor = 0;       /* tier_train_cfg.layer_major of the next rig */
static int rig_optfwd = 0;       /* tier_train_cfg.optim_in_forward of the next rig */

/* The next rigs' settings back to the above: a test that changed them ends with this. */
static void rig_defaults(void)
{
	rig_opcache = NULL, rig_micro = 1, rig_chunks = 0, rig_lmajor = 0, rig_optfwd = 0;
}

static int rig_open(rig *r, const tier_hf_config *c, const tier_lora_cfg *lc, uint64_t hbm, int batch, int seq,
		    uint64_t wseed, double init)
{
	memset(r, 0, sizeof *r);
	tier_store_config sc = { .dev = cpu, .capacity = { hbm, 64u << 20, 0 }, .policy = TIER_POLICY_SCHEDULE };
	int rc = tier_store_create(&r->s, &sc);
	if (rc)
		return rc;
	if ((rc = tier_model_create(r->s, cpu, c, lc, &r->m)) || (rc = tier_model_init_random(r->m, wseed, init)))
		return rc;
	tier_train_cfg_init(&r->tc);
	r->tc.batch = batch, r->tc.seq = seq, r->tc.steps = 30, r->tc.warmup = 0, r->tc.lr = 1e-2f;
	r->tc.opcache = rig_opcache, r->tc.micro_batches = rig_micro, r->tc.moe_chunks = rig_chunks;
	r->tc.layer_major = rig_lmajor, r->tc.optim_in_forward = rig_optfwd;
	if ((rc = tier_trainer_create(r->m, &r->tc, &r->t)))
		return rc;
	size_t T = (size_t)batch * seq * 4;
	r->tok = malloc(sizeof(int32_t) * T);
	r->lab = malloc(sizeof(int32_t) * T);
	return 0;
}

static void rig_close(rig *r)
{
	tier_trainer_destroy(r->t);
	tier_model_destroy(r->m);
	if (r->s)
		assert_int_equal(tier_store_check(r->s), 0);
	tier_store_destroy(r->s);
	free(r->tok);
	free(r->lab);
}

/* A fresh directory dir (n bytes) under $TMPDIR (else P_tmpdir) named NAME.XXXXXX. */
static void temp_dir(char *dir, size_t n, const char *name)
{
	const char *base = getenv("TMPDIR");
	snprintf(dir, n, "%s/%s.XXXXXX", base && *base ? base : P_tmpdir, name);
	assert_non_null(mkdtemp(dir));
}

static void fill_batch(rig *r, int V, uint64_t s, size_t n)
{
	tier_rng g;
	tier_rng_seed(&g, s);
	for (size_t i = 0; i < n; i++) {
		r->tok[i] = (int32_t)tier_rng_below(&g, (uint64_t)V);
		r->lab[i] = i % 7 == 3 ? -100 : (int32_t)tier_rng_below(&g, (uint64_t)V);
	}
}

static float loss_at(rig *r)
{
	float l = -1.0f;
	assert_int_equal(tier_trainer_eval(r->t, r->tok, r->lab, 0, &l, NULL), 0);
	return l;
}

/* Central difference of the loss in one adapter coordinate *x (restored after). */
static double central_diff(rig *r, tier_peft_adapter *p, float *x, float h)
{
	float x0 = *x;
	*x = x0 + h;
	assert_int_equal(tier_model_lora_import(r->m, p), 0);
	double lp = loss_at(r);
	*x = x0 - h;
	assert_int_equal(tier_model_lora_import(r->m, p), 0);
	double lm = loss_at(r);
	*x = x0;
	return (lp - lm) / (2.0 * (double)h);
}

/* d loss / d (one LoRA coordinate) against a central difference, for a few coordinates of every module. */
static void check_grads_fd(const tier_hf_config *cfg, size_t n_modules)
{
	tier_hf_config c = *cfg;
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.r = 2, lc.alpha = 4, lc.targets = 0x3f, lc.init_b_std = 0.3f, lc.seed = seed;
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 5, seed + 1, 0.3), 0);
	fill_batch(&r, 23, seed + 2, 10);
	float loss;
	assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 1, &loss, NULL), 0);
	tier_peft_adapter *g, *p;
	assert_int_equal(tier_model_lora_export(r.m, 1, &g), 0);
	assert_int_equal(tier_model_lora_export(r.m, 0, &p), 0);
	assert_true(g->n_modules == p->n_modules && g->n_modules == n_modules);
	int checked = 0, bad = 0, kinks = 0, round = 0, per_round = 4 * (int)p->n_modules;
	double worst = 0.0;
	/* rounds of 4 coordinates per module until 7/8 of a round's worth were away from routing
	 * switches (a seed whose routing has many near-ties needs more: one in ~40 crossed 26 of 128),
	 * at most 4 rounds */
	for (; round < 4 && checked - kinks < per_round * 7 / 8; round++)
	for (size_t i = 0; i < p->n_modules; i++)
		for (int q = 0; q < 4; q++) {
			tier_peft_module *pm = &p->modules[i];
			int isb = q & 1;
			size_t n = (size_t)lc.r * (isb ? pm->out : pm->in), j = tier_rng_below(&rng, n);
			float *x = isb ? pm->b : pm->a;
			double an = isb ? g->modules[i].b[j] : g->modules[i].a[j], fd[2];
			for (int k = 0; k < 2; k++)
				fd[k] = central_diff(&r, p, x + j, k ? 1e-3f : 2e-3f);
			double err = fabs(fd[0] - an), tol = 1e-3 + 2e-2 * fabs(an);
			checked++;
			if (fabs(fd[0] - fd[1]) > tol) {
				/* a top-k switch inside +-h makes the loss jump: the difference then scales with
				 * 1/h instead of converging; such a coordinate says nothing about the gradient */
				kinks++;
				continue;
			}
			worst = err > worst ? err : worst;
			if (err > tol) {
				bad++;
				printf("# layers.%d.%s lora_%c[%zu]: analytic %.6g, central difference %.6g\n", pm->layer,
				       pm->module, isb ? 'B' : 'A', j, an, fd[0]);
			}
		}
	printf("# %d coordinates checked in %d round(s), %d across a routing switch skipped, worst |analytic - fd| "
	       "%.3g, %d outside tolerance\n", checked, round, kinks, worst, bad);
	assert_int_equal(bad, 0);
	assert_true(checked - kinks >= per_round * 7 / 8);
	tier_peft_free(g);
	tier_peft_free(p);
	rig_close(&r);
}

static void test_lora_grads_fd(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	check_grads_fd(&c, 2 * 4 + 3 * 4 + 3); /* attention x 2 layers, 4 experts, the dense MLP */
}

/* Mixtral: no q/k norms, top-k-then-softmax router, every layer MoE, block_sparse_moe names. */
static void test_lora_grads_fd_mixtral(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	strcpy(c.model_type, "mixtral");
	memset(c.mlp_only, 0, sizeof c.mlp_only);
	c.moe_intermediate_size = c.intermediate_size;
	check_grads_fd(&c, 2 * 4 + 2 * 3 * 4);
}

static tier_cache_stats last_cs; /* run_losses': its op cache's (zero without one) */

/* Returns the HBM evictions of the run. */
static uint64_t run_losses(const tier_hf_config *c, uint64_t hbm, int steps, float *out)
{
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.seed = seed;
	lc.r = 4;
	rig r;
	assert_int_equal(rig_open(&r, c, &lc, hbm, 2, 8, seed + 5, 0.1), 0);
	fill_batch(&r, (int)c->vocab_size, seed + 6, 16 * rig_micro);
	for (int s = 0; s < steps; s++) {
		tier_step_result res;
		int rc = tier_trainer_step(r.t, r.tok, r.lab, &res);
		if (rc)
			printf("# step %d: %s\n", s, tier_last_error());
		assert_int_equal(rc, 0);
		out[s] = res.loss;
	}
	tier_cache_stats cs;
	memset(&last_cs, 0, sizeof last_cs);
	if (!tier_trainer_cache_stats(r.t, &cs))
		last_cs = cs, printf("# op cache %s: %llu hits (%llu from ddr), %llu misses, %llu dropped\n", rig_opcache,
		       (unsigned long long)(cs.total.hits[0] + cs.total.hits[1]), (unsigned long long)cs.total.hits[1],
		       (unsigned long long)cs.total.misses, (unsigned long long)cs.total.dropped);
	if (rig_opcache) { /* the runs below keep some results: make sure the test exercises hits */
		assert_int_equal(tier_trainer_cache_stats(r.t, &cs), 0);
		assert_true(cs.total.hits[0] + cs.total.hits[1] > 0);
	}
	tier_stats st;
	tier_store_stats(r.s, &st);
	uint64_t ev = 0;
	for (int k = 0; k < TIER_STATS_NCLASSES; k++)
		ev += st.cls[TIER_HBM][k].evictions;
	rig_close(&r);
	return ev;
}

static void test_loss_falls_and_determinism(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	float a[30], b[30];
	run_losses(&c, 64u << 20, 30, a);
	printf("# repeated batch: loss %.4f -> %.4f over 30 steps\n", a[0], a[29]);
	assert_true(a[29] < 0.7f * a[0]);
	run_losses(&c, 64u << 20, 30, b);
	assert_memory_equal(a, b, sizeof a);
}

/* The smallest HBM budget the trainer accepts evicts and refetches, and changes nothing. */
static void test_store_transparent(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_config(&c, &lc);
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 8, 1, 0.1), 0);
	uint64_t need = tier_trainer_min_hbm(r.t), base = tier_model_base_bytes(r.m);
	rig_close(&r);
	printf("# model %llu bytes, HBM budget %llu bytes\n", (unsigned long long)base, (unsigned long long)need);
	assert_true(need + need / 4 < base);
	float a[8], b[8];
	uint64_t ev_big, ev_small;
	ev_big = run_losses(&c, 64u << 20, 8, a);
	ev_small = run_losses(&c, need + need / 4, 8, b);
	printf("# evictions from hbm: %llu unbounded, %llu with the small budget\n", (unsigned long long)ev_big,
	       (unsigned long long)ev_small);
	assert_true(ev_small > 0);
	assert_memory_equal(a, b, sizeof a);
	/* one byte less is refused with a message naming the budget */
	assert_int_equal(rig_open(&r, &c, &lc, need - 1, 2, 8, 1, 0.1), -ENOSPC);
	assert_non_null(strstr(tier_last_error(), "--hbm"));
	rig_close(&r);
}

/* The smallest HBM budget the trainer accepts for these configs (tier_trainer_min_hbm), at batch 2
 * x seq 8 with the next rig's micro-batches and cache. */
static uint64_t min_hbm_of(const tier_hf_config *c, const tier_lora_cfg *lc)
{
	rig q;
	assert_int_equal(rig_open(&q, c, lc, 64u << 20, 2, 8, 3, 0.1), 0);
	uint64_t need = tier_trainer_min_hbm(q.t);
	rig_close(&q);
	return need;
}

/* The step's gradient norm (summed layer by layer as the backward finishes each) equals the norm
 * of the gradients an evaluation exports, under a budget that spills and one that does not; after
 * the step, whose optimizer dropped them, exporting gradients is refused with a way out. */
static void test_grad_norm_and_spent_grads(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_all_targets(&c, &lc);
	rig r;
	uint64_t small = min_hbm_of(&c, &lc) * 5 / 4;
	for (int v = 0; v < 2; v++) {
		assert_int_equal(rig_open(&r, &c, &lc, v ? small : 64u << 20, 2, 8, 3, 0.1), 0);
		fill_batch(&r, 23, seed + 7, 16);
		float loss;
		assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 1, &loss, NULL), 0);
		tier_peft_adapter *g;
		assert_int_equal(tier_model_lora_export(r.m, 1, &g), 0);
		double ss = 0.0;
		for (size_t i = 0; i < g->n_modules; i++) {
			const tier_peft_module *pm = &g->modules[i];
			for (size_t j = 0; j < (size_t)g->r * pm->in; j++)
				ss += (double)pm->a[j] * pm->a[j];
			for (size_t j = 0; j < (size_t)g->r * pm->out; j++)
				ss += (double)pm->b[j] * pm->b[j];
		}
		tier_peft_free(g);
		tier_step_result res;
		int rc = tier_trainer_step(r.t, r.tok, r.lab, &res);
		if (rc)
			printf("# step: %s\n", tier_last_error());
		assert_int_equal(rc, 0);
		printf("# %s budget: |g| %.7f from the step, %.7f from the exported gradients\n", v ? "spilling" : "large",
		       res.grad_norm, sqrt(ss));
		uint64_t pins = 0; /* the pinning time of each part is inside the part and adds up to PIN */
		for (int p = 0; p < TIER_PART_PIN; p++) {
			assert_true(res.ns_pin_part[p] <= res.ns_part[p]);
			pins += res.ns_pin_part[p];
		}
		assert_int_equal(res.ns_pin_part[TIER_PART_PIN], 0);
		assert_true(pins == res.ns_part[TIER_PART_PIN] && pins > 0);
		uint64_t parts = 0; /* the parts (the device's marks) lie inside the step's wall time */
		for (int p = 0; p < TIER_PART_PIN; p++)
			parts += res.ns_part[p];
		assert_true(parts <= res.ns && parts >= res.ns / 2);
		const char *pf = getenv("TIER_PROFILE"); /* the trainer's rule: no marks when profiling */
		assert_int_equal(res.parts_on_device, !(pf && *pf && strcmp(pf, "0"))); /* a CPU context's marks */
		assert_true(ss > 0 && fabs(res.grad_norm - sqrt(ss)) <= 1e-5 * sqrt(ss));
		assert_int_equal(tier_model_lora_export(r.m, 1, &g), -ENODATA);
		assert_non_null(strstr(tier_last_error(), "tier_trainer_eval"));
		assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 1, &loss, NULL), 0);
		assert_int_equal(tier_model_lora_export(r.m, 1, &g), 0); /* computed again: exported */
		tier_peft_free(g);
		rig_close(&r);
	}
}

/* The LoRA gradients of the last eval with grads into *out, and their largest relative difference
 * (L2, per module) from ref's when ref is given (0 without). */
static double grads_vs(rig *r, const tier_peft_adapter *ref, tier_peft_adapter **out)
{
	assert_int_equal(tier_model_lora_export(r->m, 1, out), 0);
	double worst = 0.0;
	for (size_t i = 0; ref && i < ref->n_modules; i++) {
		const tier_peft_module *a = &ref->modules[i], *b = &(*out)->modules[i];
		size_t na = (size_t)ref->r * a->in, nb = (size_t)ref->r * a->out;
		double dd = 0, nn = 0;
		for (size_t j = 0; j < na; j++)
			dd += pow((double)a->a[j] - b->a[j], 2), nn += (double)a->a[j] * a->a[j];
		for (size_t j = 0; j < nb; j++)
			dd += pow((double)a->b[j] - b->b[j], 2), nn += (double)a->b[j] * a->b[j];
		if (nn > 0 && sqrt(dd / nn) > worst)
			worst = sqrt(dd / nn);
	}
	return worst;
}

/* Every MoE layer's expert counts of the trainer's last step into out [4 x 16] (wider_all_targets'
 * 4 layers of 16 experts; zeros for a dense layer). */
enum { CL = 4, CE = 16 };
static void step_counts(const tier_trainer *t, int64_t *out)
{
	memset(out, 0, sizeof(int64_t) * CL * CE);
	for (int l = 0; l < CL; l++)
		(void)tier_trainer_expert_counts(t, l, out + l * CE); /* -ENOENT for a dense layer */
}

/* Training losses of a chunked run against one piece: step 1 (the same parameters) within 1e-6
 * and with the same routing; later steps within 1e-3 while every step so far routed alike. AdamW's
 * normalised updates amplify the gradients' rounding, and once a near-tie in the router's top-k
 * flips (seen with TIER_SEED=1796199846) the two runs train on different routes: from there the
 * losses are only printed. */
static void losses_alike(const float *l, const float *l0, const int64_t *cnt, const int64_t *cnt0, const char *what)
{
	int alike = 1;
	for (int st = 0; st < 3; st++) {
		alike = alike && !memcmp(cnt + st * CL * CE, cnt0 + st * CL * CE, sizeof(int64_t) * CL * CE);
		if (st == 0)
			assert_true(alike);
		if (alike)
			assert_true(fabs(l[st] - l0[st]) <= (st ? 1e-3 : 1e-6) * fabs(l0[st]));
		else
			printf("# %s, step %d: the routing differs from one piece's (a top-k near-tie flipped); losses "
			       "%.7f and %.7f not compared\n", what, st + 1, l[st], l0[st]);
	}
}

/* The MoE half in token chunks: the same hidden states, loss, expert counts and LoRA gradients as
 * in one piece (up to the order of the gradient sums), training losses alike, a smaller scratch;
 * also with the op cache (which then keeps no MoE half), with odd chunks of 7 tokens and with 2
 * micro-batches. Chunks that do not divide the micro-batch, or a router with an aux loss, are
 * refused. */
static void test_moe_chunks(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_all_targets(&c, &lc);
	assert_true(c.num_hidden_layers == CL && c.num_experts == CE); /* step_counts' sizes */
	tier_peft_adapter *ref = NULL, *g;
	float ev[4], tr[4][3];
	static int64_t trc[4][3][CL * CE];
	uint64_t scratch[4];
	static const int chunks[4] = { 1, 2, 4, 4 };
	enum { NH = (4 + 2) * 24 * 32 }; /* (layers + 2) x tokens x hidden */
	static float hid[4][NH];
	int64_t counts[4][16];
	for (int v = 0; v < 4; v++) {
		rig r;
		rig_chunks = chunks[v], rig_opcache = v == 3 ? "all:hbm=16M" : NULL;
		assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 12, 3, 0.1), 0);
		scratch[v] = tier_trainer_scratch_bytes(r.t);
		fill_batch(&r, 23, seed + 5, 24);
		assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 1, &ev[v], hid[v]), 0);
		assert_int_equal(tier_trainer_expert_counts(r.t, 0, counts[v]), 0);
		assert_memory_equal(counts[v], counts[0], sizeof counts[0]); /* every chunk routed, once */
		double hmax = 0, hd = 0;
		for (size_t i = 0; i < NH; i++)
			hmax = fmax(hmax, fabs(hid[0][i])), hd = fmax(hd, fabs((double)hid[v][i] - hid[0][i]));
		if (!(hd <= 1e-5 * hmax)) {
			size_t worst = 0;
			for (size_t i = 0; i < NH; i++)
				if (fabs((double)hid[v][i] - hid[0][i]) >= hd)
					worst = i;
			printf("# hidden differs by %.3g of %.3g at layer %zu token %zu; counts %lld %lld\n", hd, hmax,
			       worst / (24 * 32), worst / 32 % 24, (long long)counts[v][0], (long long)counts[0][0]);
		}
		assert_true(hd <= 1e-5 * hmax); /* every token's hidden states, each layer */
		double d = grads_vs(&r, ref, &g);
		printf("# %d chunks%s: scratch %llu bytes, loss %.7f, LoRA gradients %.2e from one chunk's\n", chunks[v],
		       v == 3 ? " with the op cache" : "", (unsigned long long)scratch[v], ev[v], d);
		/* d: the gradient sums in another order, per module relative to its norm, which cancellation in
		 * a module's sum can make small: over 60 seeds at most 7.9e-6, one seed (TIER_SEED=1796200233)
		 * 1.73e-5 with 4 chunks; a chunk left out or counted twice is O(1) */
		assert_true(fabs(ev[v] - ev[0]) <= 1e-6 * fabs(ev[0]) && d <= 3e-5);
		if (ref)
			tier_peft_free(g);
		else
			ref = g;
		for (int st = 0; st < 3; st++) {
			tier_step_result res;
			assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
			tr[v][st] = res.loss; /* the first step's forward is the eval's */
			step_counts(r.t, trc[v][st]);
		}
		losses_alike(tr[v], tr[0], trc[v][0], trc[0][0], "chunks");
		tier_cache_stats cs;
		if (v == 3) { /* the attention and dense MLP halves came from the cache; no MoE half went in */
			assert_int_equal(tier_trainer_cache_stats(r.t, &cs), 0);
			assert_true(cs.total.hits[0] + cs.total.hits[1] > 0 && cs.kind[TIER_OP_GROUPED_GEMM].offers == 0);
		}
		rig_close(&r);
	}
	tier_peft_free(ref);
	assert_true(scratch[1] < scratch[0] && scratch[2] < scratch[1]);
	/* chunks of an odd 7 tokens (3 x 7), and chunks with 2 micro-batches: the same training losses */
	static const int shp[2][4] = { { 3, 7, 3, 1 }, { 2, 12, 2, 2 } }; /* batch, seq, chunks, micro */
	for (int k = 0; k < 2; k++) {
		float l2[2][3];
		static int64_t c2[2][3][CL * CE];
		for (int v = 0; v < 2; v++) {
			rig q;
			rig_chunks = v ? shp[k][2] : 1, rig_micro = shp[k][3];
			assert_int_equal(rig_open(&q, &c, &lc, 64u << 20, shp[k][0], shp[k][1], 3, 0.1), 0);
			fill_batch(&q, 23, seed + 9, (size_t)shp[k][0] * shp[k][1] * shp[k][3]);
			for (int st = 0; st < 3; st++) {
				tier_step_result res;
				assert_int_equal(tier_trainer_step(q.t, q.tok, q.lab, &res), 0);
				l2[v][st] = res.loss;
				step_counts(q.t, c2[v][st]);
			}
			rig_close(&q);
		}
		for (int st = 0; st < 3; st++) {
			printf("# batch %d x seq %d, %d micro-batches, step %d: loss %.7f in one piece, %.7f in %d chunks\n",
			       shp[k][0], shp[k][1], shp[k][3], st + 1, l2[0][st], l2[1][st], shp[k][2]);
		}
		losses_alike(l2[1], l2[0], c2[1][0], c2[0][0], "odd chunks or micro-batches");
	}
	rig_micro = 1;
	rig r;
	rig_chunks = 5; /* 24 tokens */
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 12, 3, 0.1), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "must divide"));
	rig_close(&r);
	c.output_router_logits = 1;
	rig_chunks = 2;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 12, 3, 0.1), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "aux loss"));
	rig_close(&r);
	rig_defaults();
}

/* Two adapters with the same modules hold the same bits. */
static void assert_adapters_equal(const tier_peft_adapter *x, const tier_peft_adapter *y)
{
	assert_int_equal(x->n_modules, y->n_modules);
	for (size_t j = 0; j < x->n_modules; j++) {
		const tier_peft_module *a = &x->modules[j], *b = &y->modules[j];
		assert_memory_equal(a->a, b->a, sizeof(float) * x->r * a->in);
		assert_memory_equal(a->b, b->b, sizeof(float) * x->r * a->out);
	}
}

/* Layer-major steps (tier_train_cfg.layer_major) equal micro-batch-major ones bit for bit: the
 * losses of 4 steps of 3 micro-batches and the LoRA weights after them, with a budget that holds
 * everything and with one that spills (writebacks and discards of every micro-batch's layer
 * inputs), with the op cache, and with the MoE half in 2 token chunks (the GPU's best configuration
 * under a cap combines both); the weights of a layer cross into HBM fewer times. */
static void test_layer_major(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_all_targets(&c, &lc);
	lc.dropout = 0.0f;
	rig q;
	rig_micro = 3;
	uint64_t small = min_hbm_of(&c, &lc) * 3 / 2;
	int n_moe = 0;
	for (int l = 0; l < (int)c.num_hidden_layers; l++)
		n_moe += tier_hf_layer_is_moe(&c, l);
	static const char *what[4] = { "large budget", "spilling budget", "spilling budget, op cache",
				       "spilling budget, 2 MoE chunks" };
	for (int k = 0; k < 4; k++) {
		float loss[2][4];
		tier_peft_adapter *w[2];
		uint64_t dense_in[2];
		int64_t counts[2][16];
		for (int v = 0; v < 2; v++) {
			rig_lmajor = v, rig_opcache = k == 2 ? "all:hbm=1M" : NULL, rig_chunks = k == 3 ? 2 : 0;
			assert_int_equal(rig_open(&q, &c, &lc, k ? small : 64u << 20, 2, 8, 3, 0.1), 0);
			fill_batch(&q, 23, seed + 11, 3 * 16);
			for (int st = 0; st < 4; st++) {
				tier_step_result res;
				int rc = tier_trainer_step(q.t, q.tok, q.lab, &res);
				if (rc)
					printf("# step %d: %s\n", st, tier_last_error());
				assert_int_equal(rc, 0);
				loss[v][st] = res.loss;
				/* each MoE layer routed once a micro-batch: the backward took its forward's experts */
				assert_int_equal(res.routes, n_moe * 3);
			}
			assert_int_equal(tier_model_lora_export(q.m, 0, &w[v]), 0);
			assert_int_equal(tier_trainer_expert_counts(q.t, 2, counts[v]), 0);
			tier_stats stt;
			tier_store_stats(q.s, &stt);
			dense_in[v] = stt.cls[TIER_HBM][TIER_CLASS_DENSE].bytes_in;
			rig_close(&q);
		}
		printf("# %s: losses %.7f %.7f %.7f %.7f; dense weights into hbm %llu bytes micro-batch-major, %llu "
"layer-major\n", what[k], loss[1][0],
		       loss[1][1], loss[1][2], loss[1][3], (unsigned long long)dense_in[0], (unsigned long long)dense_in[1]);
		assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
		assert_memory_equal(counts[0], counts[1], sizeof counts[0]);
		assert_adapters_equal(w[0], w[1]);
		if (k) /* under the spilling budget each layer's weights cross once a step, not 3 times */
			assert_true(dense_in[1] < dense_in[0]);
		tier_peft_free(w[0]);
		tier_peft_free(w[1]);
	}
	rig_defaults();
}

/* One configuration of test_optim_in_forward: 5 steps with the optimizer at each step's end (v 0)
 * and in the next step's forward (v 1), a checkpoint saved after step 2; the losses, the
 * checkpoints' bytes, an evaluation after the steps and the adapters equal bit for bit. *deferred
 * gets the updates the forwards ran; v 1's adapter is exported after its trainer is destroyed (its
 * last update made then). Returns whether v 1 deferred (the budget allowed it). */
static int optim_fwd_case(const tier_hf_config *c, const tier_lora_cfg *lc, const char *what, uint64_t hbm,
			  const char *ck[2], int *deferred)
{
	float loss[2][5], ev[2];
	tier_peft_adapter *w[2];
	int on = 0;
	*deferred = 0;
	for (int v = 0; v < 2; v++) {
		rig q;
		rig_optfwd = v;
		assert_int_equal(rig_open(&q, c, lc, hbm, 2, 8, 3, 0.1), 0);
		on = tier_trainer_optim_in_forward(q.t);
		if (!v)
			assert_int_equal(on, 0);
		for (int st = 0; st < 5; st++) {
			fill_batch(&q, 23, seed + 17 + (uint64_t)st, 16 * (size_t)rig_micro);
			tier_step_result res;
			int rc = tier_trainer_step(q.t, q.tok, q.lab, &res);
			if (rc)
				printf("# %s, step %d: %s\n", what, st, tier_last_error());
			assert_int_equal(rc, 0);
			loss[v][st] = res.loss;
			/* the first step has nothing due, nor the one after the checkpoint (saving ran it) */
			if (!on || st == 0 || st == 2)
				assert_int_equal(res.updates_in_forward, 0);
			else
				assert_true(res.updates_in_forward > 0);
			*deferred += v ? res.updates_in_forward : 0;
			if (st == 1)
				assert_int_equal(tier_trainer_save(q.t, ck[v]), 0);
		}
		assert_int_equal(tier_trainer_eval(q.t, q.tok, q.lab, 0, &ev[v], NULL), 0);
		int rs = tier_trainer_step(q.t, q.tok, q.lab, &(tier_step_result){ 0 });
		if (rs)
			printf("# %s, the step after the evaluation: %s\n", what, tier_last_error());
		assert_int_equal(rs, 0);
		tier_trainer_destroy(q.t); /* v 1: the sixth step's update made here */
		q.t = NULL;
		assert_int_equal(tier_model_lora_export(q.m, 0, &w[v]), 0);
		rig_close(&q);
	}
	printf("# %s: losses %.7f .. %.7f, %d updates in the next forward%s\n", what, loss[1][0], loss[1][4], *deferred,
	       on ? "" : " (the budget holds no optimizer set beside the scratch: at the step's end)");
	assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
	assert_memory_equal(&ev[0], &ev[1], sizeof ev[0]);
	assert_adapters_equal(w[0], w[1]);
	tier_peft_free(w[0]);
	tier_peft_free(w[1]);
	FILE *f[2] = { fopen(ck[0], "rb"), fopen(ck[1], "rb") };
	assert_true(f[0] && f[1]);
	for (int a, b;;) { /* the same checkpoint, byte for byte */
		a = fgetc(f[0]), b = fgetc(f[1]);
		assert_int_equal(a, b);
		if (a == EOF)
			break;
	}
	fclose(f[0]);
	fclose(f[1]);
	return on;
}

/* The optimizer in the next step's forward (tier_train_cfg.optim_in_forward) changes no value:
 * losses, checkpoints, evaluations and adapters equal the step-end optimizer's bit for bit, under a
 * large budget, a spilling one, layer-major with 3 micro-batches, 2 micro-batches with the op cache,
 * and not pipelined; a budget a quarter over the smallest, with no room for an optimizer set beside
 * the scratch, falls back to the step's end. Resuming from the deferred run's checkpoint continues
 * it exactly. */
static void test_optim_in_forward(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_all_targets(&c, &lc);
	lc.dropout = 0.0f;
	char dir[256], p0[300], p1[300];
	temp_dir(dir, sizeof dir, "tier-train-optfwd");
	snprintf(p0, sizeof p0, "%s/end.safetensors", dir);
	snprintf(p1, sizeof p1, "%s/fwd.safetensors", dir);
	const char *ck[2] = { p0, p1 };
	uint64_t need = min_hbm_of(&c, &lc);
	int n;
	assert_true(optim_fwd_case(&c, &lc, "large budget", 64u << 20, ck, &n) && n > 0);
	assert_true(optim_fwd_case(&c, &lc, "spilling budget", need * 2, ck, &n) && n > 0);
	assert_false(optim_fwd_case(&c, &lc, "a quarter over the smallest budget", need * 5 / 4, ck, &n));
	rig_micro = 3, rig_lmajor = 1;
	assert_true(optim_fwd_case(&c, &lc, "layer-major, 3 micro-batches, spilling", need * 5 / 2, ck, &n) && n > 0);
	rig_lmajor = 0, rig_micro = 2, rig_opcache = "all:hbm=4M:ddr=8M";
	assert_true(optim_fwd_case(&c, &lc, "2 micro-batches, op cache", 64u << 20, ck, &n) && n > 0);
	rig_micro = 1, rig_opcache = NULL;
	env_keep pipe_kept;
	env_set(&pipe_kept, "TIER_PIPELINE", "0");
	assert_true(optim_fwd_case(&c, &lc, "not pipelined", need * 2, ck, &n) && n > 0);
	env_back(&pipe_kept);
	/* resumed from the deferred run's checkpoint (after step 2): steps 3 to 5 as that run's */
	float whole[5], part[5];
	for (int run = 0; run < 2; run++) {
		rig q;
		rig_optfwd = 1;
		assert_int_equal(rig_open(&q, &c, &lc, 64u << 20, 2, 8, 3, 0.1), 0);
		if (run)
			assert_int_equal(tier_trainer_load(q.t, p1), 0);
		for (int st = run ? 2 : 0; st < 5; st++) {
			fill_batch(&q, 23, seed + 17 + (uint64_t)st, 16);
			tier_step_result res;
			assert_int_equal(tier_trainer_step(q.t, q.tok, q.lab, &res), 0);
			(run ? part : whole)[st] = res.loss;
		}
		rig_close(&q);
	}
	assert_memory_equal(whole + 2, part + 2, 3 * sizeof whole[0]);
	rig_defaults();
	unlink(p0);
	unlink(p1);
	rmdir(dir);
}

/* Pipelined operations (train_pending.c: an operation's end put off behind the next one's kernels)
 * change nothing: losses, adapters and expert counts equal $TIER_PIPELINE=0's bit for bit, under a
 * large budget, the smallest one (two operations' pins do not fit: not pipelined), twice that
 * (pins refused for room finish the operation before early), the op cache in HBM and DDR with 2
 * micro-batches, and layer-major with 3 and the cache; the store's own check passes at the end
 * (rig_close). */
/* One configuration of test_pipeline_transparent: 4 steps pipelined and with $TIER_PIPELINE=0,
 * equal bit for bit; *piped, *early and the op cache's hits get the pipelined run's counts. */
static void pipeline_case(const tier_hf_config *c, const tier_lora_cfg *lc, const char *what, uint64_t hbm,
			  int *piped, int *early, uint64_t *hbm_hits, uint64_t *ddr_hits)
{
	float loss[2][4];
	tier_peft_adapter *w[2];
	int64_t counts[2][16];
	int pp[2] = { 0, 0 }, ee[2] = { 0, 0 };
	uint64_t hits[2][2] = { { 0, 0 }, { 0, 0 } };
	env_keep mode; /* the pipelined run's $TIER_PIPELINE, as the caller left it */
	for (int v = 0; v < 2; v++) {
		rig q;
		if (!v)
			env_set(&mode, "TIER_PIPELINE", "0");
		else
			env_back(&mode);
		assert_int_equal(rig_open(&q, c, lc, hbm, 2, 8, 3, 0.1), 0);
		fill_batch(&q, 23, seed + 13, 16 * (size_t)rig_micro);
		for (int st = 0; st < 4; st++) {
			tier_step_result res;
			int rc = tier_trainer_step(q.t, q.tok, q.lab, &res);
			if (rc)
				printf("# %s, %s, step %d: %s\n", what, v ? "pipelined" : "TIER_PIPELINE=0", st,
				       tier_last_error());
			assert_int_equal(rc, 0);
			loss[v][st] = res.loss;
			pp[v] += res.ops_pipelined, ee[v] += res.ops_finished_early;
		}
		assert_int_equal(tier_model_lora_export(q.m, 0, &w[v]), 0);
		assert_int_equal(tier_trainer_expert_counts(q.t, 2, counts[v]), 0);
		tier_cache_stats cs;
		if (rig_opcache) { /* the pipelined run's entries: written in place (HBM) or filled (DDR) */
			assert_int_equal(tier_trainer_cache_stats(q.t, &cs), 0);
			hits[v][0] = cs.total.hits[0], hits[v][1] = cs.total.hits[1];
		}
		rig_close(&q);
	}
	printf("# %s: losses %.7f .. %.7f; %d operations pipelined, %d of them finished early; op cache hits %llu "
	       "from hbm, %llu from ddr (%llu, %llu with TIER_PIPELINE=0)\n", what, loss[1][0], loss[1][3], pp[1], ee[1],
	       (unsigned long long)hits[1][0], (unsigned long long)hits[1][1], (unsigned long long)hits[0][0],
	       (unsigned long long)hits[0][1]);
	/* the counts may differ: a pipelined operation's entries are held, never victims, until the
	 * next one's kernels are queued */
	if (rig_opcache)
		assert_true(hits[1][0] + hits[1][1] > 0);
	*hbm_hits = hits[1][0], *ddr_hits = hits[1][1];
	assert_int_equal(pp[0], 0);
	assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
	assert_memory_equal(counts[0], counts[1], sizeof counts[0]);
	assert_adapters_equal(w[0], w[1]);
	tier_peft_free(w[0]);
	tier_peft_free(w[1]);
	*piped = pp[1], *early = ee[1];
}

/* Pipelined operations (train_pending.c: an operation's end put off behind the next one's kernels)
 * change nothing: losses, adapters and expert counts equal $TIER_PIPELINE=0's bit for bit under a
 * large budget; under budgets from test_store_transparent's smallest (a quarter over
 * tier_trainer_min_hbm: two operations' pins do not fit, so not pipelined) up to 2.5 times it;
 * forced below that, where pins refused for room finish the operation before early; with the op
 * cache in HBM (its entries written and read in place) and in DDR (filled by a copy) with 2
 * micro-batches, and with the MoE half in 2 chunks (its half not cached: recomputed per chunk);
 * layer-major with 3 and the cache. The store's own check passes at the end of each
 * run (rig_close). */
static void test_pipeline_transparent(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	wider_all_targets(&c, &lc);
	lc.dropout = 0.0f;
	uint64_t need = min_hbm_of(&c, &lc);
	int piped, early, any_early = 0;
	uint64_t hh, dh;
	char what[96];
	pipeline_case(&c, &lc, "large budget", 64u << 20, &piped, &early, &hh, &dh);
	assert_true(piped > 0);
	for (int k = 10; k <= 20; k += 2) {
		snprintf(what, sizeof what, "budget %d/8 of the smallest", k);
		pipeline_case(&c, &lc, what, need * (uint64_t)k / 8, &piped, &early, &hh, &dh);
		if (k == 10)
			assert_int_equal(piped, 0);
	}
	/* forced where two operations' pins do not fit: pins refused for room finish the one before */
	env_keep pipe_kept;
	env_set(&pipe_kept, "TIER_PIPELINE", "force");
	for (int k = 10; k <= 14; k += 2) {
		snprintf(what, sizeof what, "budget %d/8 of the smallest, TIER_PIPELINE=force", k);
		pipeline_case(&c, &lc, what, need * (uint64_t)k / 8, &piped, &early, &hh, &dh);
		any_early |= piped > 0 && early > 0;
	}
	env_back(&pipe_kept);
	assert_true(any_early);
	rig_micro = 2, rig_opcache = "all:hbm=4M:ddr=8M";
	pipeline_case(&c, &lc, "op cache in hbm, 2 micro-batches", 64u << 20, &piped, &early, &hh, &dh);
	assert_true(piped > 0 && hh > 0); /* written in place */
	rig_opcache = "all:hbm=64k:ddr=8M";
	pipeline_case(&c, &lc, "op cache in ddr, 2 micro-batches", 64u << 20, &piped, &early, &hh, &dh);
	assert_true(piped > 0 && dh > 0); /* filled by a copy */
	rig_micro = 1, rig_chunks = 2, rig_opcache = "all:hbm=4M";
	pipeline_case(&c, &lc, "op cache in hbm, MoE in 2 chunks", 64u << 20, &piped, &early, &hh, &dh);
	assert_true(piped > 0 && hh > 0);
	rig_chunks = 0;
	rig_micro = 3, rig_lmajor = 1, rig_opcache = "all:hbm=1M";
	pipeline_case(&c, &lc, "layer-major, 3 micro-batches, op cache", 64u << 20, &piped, &early, &hh, &dh);
	assert_true(piped > 0);
	pipeline_case(&c, &lc, "layer-major, 3 micro-batches, op cache, spilling", need * 5 / 2, &piped, &early, &hh, &dh);
	rig_defaults();
}

/* LoRA dropout: training steps use it (their losses differ from dropout 0's after the first
 * update) and evaluation does not (equal losses); dropout on expert targets is refused. */
static void test_lora_dropout(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	float loss[2][6], ev[2];
	for (int v = 0; v < 2; v++) {
		tier_lora_cfg lc;
		tier_lora_cfg_init(&lc);
		lc.targets = TIER_LORA_Q | TIER_LORA_K | TIER_LORA_V | TIER_LORA_O | TIER_LORA_MLP;
		lc.init_b_std = 0.2f, lc.dropout = v ? 0.3f : 0.0f, lc.seed = 7;
		rig r;
		assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 8, 3, 0.1), 0);
		fill_batch(&r, (int)c.vocab_size, 11, 16);
		assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 0, &ev[v], NULL), 0);
		for (int st = 0; st < 6; st++) {
			tier_step_result res;
			assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
			loss[v][st] = res.loss;
		}
		rig_close(&r);
	}
	printf("# dropout 0 / 0.3: eval %.6f / %.6f; step 1 %.6f / %.6f, step 6 %.6f / %.6f\n", ev[0], ev[1], loss[0][0],
	       loss[1][0], loss[0][5], loss[1][5]);
	assert_true(ev[0] == ev[1]);
	assert_true(loss[0][0] != loss[1][0]); /* B != 0 from the start: the masked adapter changes the loss */
	assert_true(loss[1][5] < loss[1][0]);
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.dropout = 0.1f; /* the default targets include the experts */
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 8, 3, 0.1), -ENOTSUP);
	assert_non_null(strstr(tier_last_error(), "expert"));
	rig_close(&r);
}

/* The operator cache changes no number: results kept (all of them, or some: the rest dropped
 * and recomputed) give the losses of full recomputation, over two micro-batches. */
static void test_opcache_transparent(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	float a[6], b[6], d[6];
	rig_micro = 2;
	run_losses(&c, 64u << 20, 6, a);
	rig_opcache = "all:hbm=16M";
	run_losses(&c, 64u << 20, 6, b);
	assert_memory_equal(a, b, sizeof a);
	assert_int_equal(last_cs.total.misses, 0); /* all kept: nothing else looked up (the outputs alone) */
	rig_opcache = "attention,grouped_gemm:hbm=48k:ddr=8M";
	run_losses(&c, 64u << 20, 6, d);
	assert_memory_equal(a, d, sizeof a);
	rig_opcache = "nonsense";
	rig r;
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 8, 1, 0.1), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "op-cache"));
	rig_close(&r);
	rig_defaults();
}

/* The attention's output alone (train_cache.c's OP_CORE): with no HBM budget the cache keeps no
 * attention half (nor in DDR: a get would bring it back into HBM), but o and lse go to DDR by a
 * copy lane and come back straight into the scratch for the backward, whose recompute then skips
 * the attention: every attention hit is one of them, from DDR. The losses equal full
 * recomputation's bit for bit, over 2 micro-batches in order and 3 layer-major. */
static void test_opcache_attention_output(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	for (int lm = 0; lm < 2; lm++) {
		float a[6], b[6];
		rig_micro = lm ? 3 : 2, rig_lmajor = lm, rig_opcache = NULL;
		run_losses(&c, 64u << 20, 6, a);
		rig_opcache = "attention:ddr=1M";
		run_losses(&c, 64u << 20, 6, b);
		const tier_cache_kind_stats *at = &last_cs.kind[TIER_OP_ATTENTION];
		printf("# %s: attention offers %llu, into ddr %llu, hits from ddr %llu, misses %llu\n",
		       lm ? "layer-major" : "in order", (unsigned long long)at->offers, (unsigned long long)at->admitted[1],
		       (unsigned long long)at->hits[1], (unsigned long long)at->misses);
		assert_true(at->admitted[1] > 0 && at->hits[1] > 0);
		assert_int_equal(at->admitted[0] + at->hits[0], 0);
		assert_memory_equal(a, b, sizeof a);
	}
	rig_defaults();
}

/* The MoE block in routed halves (dec_shape.routed: one read back of the counts a layer's forward,
 * none in its backward or recompute) computes what the block routing and reading back by itself
 * ($TIER_MOE_ROUTED=0) does: the losses equal bit for bit with the router's aux loss on, under
 * full recomputation, with the op cache keeping the MoE half, layer-major with the attention's
 * output in DDR, and under a budget that evicts. MoE chunks (not routed) are test_moe_chunks'. */
static void test_moe_routed_transparent(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	c.output_router_logits = 1, c.router_aux_loss_coef = 0.02;
	struct {
		const char *cache;
		int micro, lmajor;
		uint64_t hbm;
	} runs[] = { { NULL, 2, 0, 64u << 20 }, { "all:hbm=16M", 2, 0, 64u << 20 },
		     { "attention:ddr=1M", 3, 1, 64u << 20 }, { NULL, 1, 0, 0 } };
	tier_lora_cfg lc; /* run_losses' */
	tier_lora_cfg_init(&lc);
	lc.seed = seed, lc.r = 4;
	runs[3].hbm = min_hbm_of(&c, &lc) * 5 / 4;
	for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
		float a[4], b[4];
		rig_opcache = runs[i].cache, rig_micro = runs[i].micro, rig_lmajor = runs[i].lmajor;
		env_keep routed; /* the run's own setting, back after; b routed by default (unset) */
		env_set(&routed, "TIER_MOE_ROUTED", "0");
		run_losses(&c, runs[i].hbm, 4, a);
		env_put("TIER_MOE_ROUTED", NULL);
		uint64_t ev = run_losses(&c, runs[i].hbm, 4, b);
		env_back(&routed);
		printf("# routed, run %zu: losses %.7f .. %.7f, %llu evictions\n", i, b[0], b[3], (unsigned long long)ev);
		if (i == 3)
			assert_true(ev > 0);
		assert_memory_equal(a, b, sizeof a);
	}
	rig_defaults();
}

static void test_bad_input(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 1, 4, 1, 0.1), 0);
	tier_step_result res;
	fill_batch(&r, 23, 9, 4);
	r.tok[2] = 23;
	assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "vocabulary"));
	r.tok[2] = 1, r.lab[1] = -5;
	assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), -EINVAL);
	r.lab[1] = 1;
	assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
	rig_close(&r);

	tier_store *s;
	tier_model *m = (tier_model *)1;
	tier_store_config sc = { .dev = cpu, .capacity = { 8u << 20, 8u << 20, 0 } };
	assert_int_equal(tier_store_create(&s, &sc), 0);
	tier_hf_config bad = c;
	strcpy(bad.model_type, "llama");
	assert_int_equal(tier_model_create(s, cpu, &bad, &lc, &m), -ENOTSUP);
	assert_null(m);
	bad = c, bad.num_key_value_heads = 3;
	assert_int_equal(tier_model_create(s, cpu, &bad, &lc, &m), -EINVAL);
	tier_lora_cfg bl = lc;
	bl.dropout = 0.1f;
	assert_int_equal(tier_model_create(s, cpu, &c, &bl, &m), -ENOTSUP);
	bl = lc, bl.r = 0;
	assert_int_equal(tier_model_create(s, cpu, &c, &bl, &m), -EINVAL);
	unsigned t;
	assert_int_equal(tier_lora_targets_parse("q,v,experts", &t), 0);
	assert_int_equal(t, TIER_LORA_Q | TIER_LORA_V | TIER_LORA_EXPERTS);
	assert_int_equal(tier_lora_targets_parse("q,gate", &t), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "gate"));
	/* a model without weights refuses to train */
	assert_int_equal(tier_model_create(s, cpu, &c, &lc, &m), 0);
	tier_train_cfg tc;
	tier_train_cfg_init(&tc);
	tc.batch = 1, tc.seq = 4;
	tier_trainer *tr;
	assert_int_equal(tier_trainer_create(m, &tc, &tr), 0);
	int32_t tok[4] = { 1, 2, 3, 4 };
	assert_int_equal(tier_trainer_step(tr, tok, tok, &res), -ENODATA);
	tier_trainer_destroy(tr);
	tc.batch = 0;
	assert_int_equal(tier_trainer_create(m, &tc, &tr), -EINVAL);
	tier_model_destroy(m);
	tier_store_destroy(s);
}

static void test_data(void **state)
{
	(void)state;
	char dir[256], path[300], text[300];
	temp_dir(dir, sizeof dir, "tier-train-test");
	snprintf(path, sizeof path, "%s/t.tok", dir);
	uint32_t tk[50];
	for (int i = 0; i < 50; i++)
		tk[i] = (uint32_t)tier_rng_below(&rng, 30);
	assert_int_equal(tier_data_write(path, tk, 50, 30, 29), 0);
	tier_data *d;
	assert_int_equal(tier_data_open(path, &d), 0);
	assert_int_equal(tier_data_count(d), 50);
	assert_int_equal(tier_data_vocab(d), 30);
	int32_t t1[49], l1[49], t2[49], l2[49];
	assert_int_equal(tier_data_sample(d, 3, 7, 49, t1, l1), 0);
	for (int i = 0; i < 49; i++)
		assert_true(t1[i] == (int32_t)tk[i] && l1[i] == (int32_t)tk[i + 1]);
	assert_int_equal(tier_data_sample(d, 3, 7, 50, t1, l1), -EINVAL); /* shorter than seq + 1 */
	assert_non_null(strstr(tier_last_error(), "shorter"));
	assert_int_equal(tier_data_sample(d, 3, 7, 10, t1, l1), 0);
	assert_int_equal(tier_data_sample(d, 3, 7, 10, t2, l2), 0);
	assert_memory_equal(t1, t2, 40);
	tier_data_close(d);
	/* a token beyond the vocabulary and a truncated file are refused */
	tk[3] = 30;
	assert_int_equal(tier_data_write(path, tk, 50, 30, 29), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "token 3 is 30, not below the vocab size 30"));
	assert_int_equal(tier_data_from_tokens(tk, 50, 30, 29, &d), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "token 3 is 30"));
	assert_null(d);
	FILE *f = fopen(path, "r+b");
	assert_non_null(f);
	assert_int_equal(ftruncate(fileno(f), 30), 0);
	fclose(f);
	assert_int_equal(tier_data_open(path, &d), -EBADMSG);
	assert_null(d);
	/* a vocabulary past int32 (sampled tokens would turn negative) is refused, named */
	uint32_t big[2] = { 5, 0x80000001u };
	assert_int_equal(tier_data_from_tokens(big, 2, 0x80000002u, 0, &d), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "vocab size 2147483650"));
	/* text: bytes, an empty line separates documents */
	snprintf(text, sizeof text, "%s/c.txt", dir);
	f = fopen(text, "w");
	fputs("ab\n\n\ncd", f);
	fclose(f);
	assert_int_equal(tier_data_open(text, &d), 0);
	assert_int_equal(tier_data_count(d), 5);
	assert_int_equal(tier_data_sample(d, 1, 0, 4, t1, l1), 0);
	int32_t want[5] = { 'a', 'b', TIER_TOK_SEP, 'c', 'd' };
	assert_memory_equal(t1, want, 16);
	assert_int_equal(l1[3], 'd');
	tier_data_close(d);
	unlink(text);
	unlink(path);
	rmdir(dir);
}


/* ---- Loading an HF checkpoint: per-expert, fused and BF16 files of the same values ------------ */
typedef struct {
	tier_st_wtensor t[64];
	float *data[64];
	uint16_t *half[64];
	char names[64][96];
	size_t n;
} ckpt_w;

static void cw_add(ckpt_w *w, const char *name, int ndim, uint64_t d0, uint64_t d1, uint64_t d2, const float *src)
{
	size_t k = w->n++, numel = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
	snprintf(w->names[k], sizeof w->names[k], "%s", name);
	w->data[k] = malloc(sizeof(float) * numel);
	w->half[k] = malloc(sizeof(uint16_t) * numel);
	for (size_t i = 0; i < numel; i++) {
		float v = src ? src[i] : 0.3f * tier_rng_normal(&rng);
		w->half[k][i] = tier_f32_to_bf16(v);
		w->data[k][i] = tier_bf16_to_f32(w->half[k][i]); /* exact in BF16 so that all files agree */
	}
	w->t[k] = (tier_st_wtensor){ .name = w->names[k], .dtype = TIER_DT_F32, .ndim = ndim,
				     .shape = { d0, d1, d2 }, .data = w->data[k] };
}

static void cw_free(ckpt_w *w)
{
	for (size_t i = 0; i < w->n; i++)
		free(w->data[i]), free(w->half[i]);
	w->n = 0;
}

/* The tensors of tiny_config; fused: experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]. */
static void tiny_tensors(ckpt_w *w, ckpt_w *fused)
{
	int H = 16, V = 23, nh = 2, nkv = 1, hd = 8, E = 4, Ie = 8, I = 12;
	char n[96];
	memset(w, 0, sizeof *w);
	memset(fused, 0, sizeof *fused);
	ckpt_w *both[2] = { w, fused };
	for (int f = 0; f < 2; f++) {
		tier_rng_seed(&rng, seed + 77); /* the same values in both */
		ckpt_w *c = both[f];
		cw_add(c, "model.embed_tokens.weight", 2, V, H, 0, NULL);
		cw_add(c, "model.norm.weight", 1, H, 0, 0, NULL);
		cw_add(c, "lm_head.weight", 2, V, H, 0, NULL);
		for (int l = 0; l < 2; l++) {
			static const char *const vec[4] = { "input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
							    "self_attn.k_norm" };
			for (int i = 0; i < 4; i++) {
				snprintf(n, sizeof n, "model.layers.%d.%s.weight", l, vec[i]);
				cw_add(c, n, 1, i < 2 ? H : hd, 0, 0, NULL);
			}
			static const char *const pr[4] = { "q_proj", "k_proj", "v_proj", "o_proj" };
			int rows[4] = { nh * hd, nkv * hd, nkv * hd, H }, cols[4] = { H, H, H, nh * hd };
			for (int i = 0; i < 4; i++) {
				snprintf(n, sizeof n, "model.layers.%d.self_attn.%s.weight", l, pr[i]);
				cw_add(c, n, 2, rows[i], cols[i], 0, NULL);
			}
			if (l == 1) { /* the dense MLP layer */
				static const char *const mp[3] = { "gate_proj", "up_proj", "down_proj" };
				for (int i = 0; i < 3; i++) {
					snprintf(n, sizeof n, "model.layers.1.mlp.%s.weight", mp[i]);
					cw_add(c, n, 2, i < 2 ? I : H, i < 2 ? H : I, 0, NULL);
				}
				continue;
			}
			cw_add(c, "model.layers.0.mlp.gate.weight", 2, E, H, 0, NULL);
			float *gu = malloc(sizeof(float) * E * 2 * Ie * H), *dn = malloc(sizeof(float) * E * H * Ie);
			for (size_t i = 0; i < (size_t)E * 2 * Ie * H; i++)
				gu[i] = 0.3f * tier_rng_normal(&rng);
			for (size_t i = 0; i < (size_t)E * H * Ie; i++)
				dn[i] = 0.3f * tier_rng_normal(&rng);
			if (f) {
				cw_add(c, "model.layers.0.mlp.experts.gate_up_proj", 3, E, 2 * Ie, H, gu);
				cw_add(c, "model.layers.0.mlp.experts.down_proj", 3, E, H, Ie, dn);
			} else {
				for (int e = 0; e < E; e++) {
					size_t s1 = (size_t)Ie * H;
					snprintf(n, sizeof n, "model.layers.0.mlp.experts.%d.gate_proj.weight", e);
					cw_add(c, n, 2, Ie, H, 0, gu + 2 * s1 * e);
					snprintf(n, sizeof n, "model.layers.0.mlp.experts.%d.up_proj.weight", e);
					cw_add(c, n, 2, Ie, H, 0, gu + 2 * s1 * e + s1);
					snprintf(n, sizeof n, "model.layers.0.mlp.experts.%d.down_proj.weight", e);
					cw_add(c, n, 2, H, Ie, 0, dn + s1 * e);
				}
			}
			free(gu);
			free(dn);
		}
	}
}

/* The load's progress callback: calls, bytes never going back, the last total; it stops the
 * load at call stop_at (0: never). */
typedef struct { int calls, backwards, stop_at; uint64_t done, total; } prog_seen;
static int on_progress(uint64_t done, uint64_t total, void *arg)
{
	prog_seen *p = arg;
	p->backwards += done < p->done || done > total;
	p->calls++, p->done = done, p->total = total;
	return p->calls == p->stop_at;
}

/* stop_at > 0: a first load is stopped by its progress callback at that call, then the same
 * model loads again in full. */
static float load_and_eval(const tier_hf_config *c, const char *dir, int stop_at, int *rc_out)
{
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.targets = 0x3f, lc.init_b_std = 0.1f, lc.seed = 3;
	tier_store *s;
	tier_store_config sc = { .dev = cpu, .capacity = { 16u << 20, 16u << 20, 0 } };
	assert_int_equal(tier_store_create(&s, &sc), 0);
	tier_model *m;
	assert_int_equal(tier_model_create(s, cpu, c, &lc, &m), 0);
	float loss = NAN;
	prog_seen ps = { .stop_at = stop_at };
	tier_model_set_progress(m, on_progress, &ps);
	int32_t tok[10], lab[10];
	for (int i = 0; i < 10; i++)
		tok[i] = (i * 7 + 3) % 23, lab[i] = (i * 5 + 1) % 23;
	if (stop_at > 0) { /* stopped: no data, so no evaluation; then loaded after all */
		assert_int_equal(tier_model_load_hf(m, dir), -ECANCELED);
		assert_int_equal(ps.calls, stop_at);
		assert_non_null(strstr(tier_last_error(), "stopped by the caller"));
		tier_train_cfg tc0;
		tier_train_cfg_init(&tc0);
		tc0.batch = 2, tc0.seq = 5;
		tier_trainer *t0;
		assert_int_equal(tier_trainer_create(m, &tc0, &t0), 0);
		assert_int_equal(tier_trainer_eval(t0, tok, lab, 0, &loss, NULL), -ENODATA);
		tier_trainer_destroy(t0);
		ps = (prog_seen){ 0 };
	}
	*rc_out = tier_model_load_hf(m, dir);
	if (!*rc_out) { /* one call per object, the last with every byte */
		assert_true(ps.calls > 3 && !ps.backwards);
		assert_true(ps.done == ps.total && ps.total == tier_model_base_bytes(m));
		tier_train_cfg tc;
		tier_train_cfg_init(&tc);
		tc.batch = 2, tc.seq = 5;
		tier_trainer *t;
		assert_int_equal(tier_trainer_create(m, &tc, &t), 0);
		float *hid = malloc(sizeof(float) * 4 * 10 * 16);
		assert_int_equal(tier_trainer_eval(t, tok, lab, 0, &loss, hid), 0);
		/* hidden[0] is the embedding of the tokens */
		free(hid);
		tier_trainer_destroy(t);
	}
	tier_model_destroy(m);
	tier_store_destroy(s);
	return loss;
}

/* skip: index of a tensor to leave out (-1: none). */
static void write_ckpt(const char *dir, ckpt_w *w, int bf16, int skip)
{
	char path[400];
	tier_st_wtensor t[64];
	size_t n = 0;
	snprintf(path, sizeof path, "%s/model.safetensors", dir);
	for (size_t i = 0; i < w->n; i++) {
		if ((int)i == skip)
			continue;
		t[n] = w->t[i];
		t[n].dtype = bf16 ? TIER_DT_BF16 : TIER_DT_F32;
		t[n++].data = bf16 ? (const void *)w->half[i] : (const void *)w->data[i];
	}
	assert_int_equal(tier_st_write(path, t, n, NULL), 0);
}

static void test_load_hf(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	char dir[256];
	temp_dir(dir, sizeof dir, "tier-train-ckpt");
	ckpt_w w, f;
	tiny_tensors(&w, &f);
	int rc;
	write_ckpt(dir, &w, 0, -1);
	float l_per = load_and_eval(&c, dir, 0, &rc);
	assert_int_equal(rc, 0);
	float l_again = load_and_eval(&c, dir, 2, &rc); /* a load stopped by its caller, then done */
	assert_int_equal(rc, 0);
	assert_true(l_again == l_per);
	write_ckpt(dir, &f, 0, -1);
	float l_fused = load_and_eval(&c, dir, 0, &rc);
	assert_int_equal(rc, 0);
	write_ckpt(dir, &w, 1, -1);
	float l_bf16 = load_and_eval(&c, dir, 0, &rc);
	assert_int_equal(rc, 0);
	printf("# loss per-expert F32 %.6f, fused F32 %.6f, per-expert BF16 %.6f\n", l_per, l_fused, l_bf16);
	assert_true(isfinite(l_per) && l_per > 0);
	assert_true(l_per == l_fused && l_per == l_bf16);
	/* a tensor missing, then one of the wrong shape */
	write_ckpt(dir, &w, 0, 5); /* without layer 0's q_norm */
	load_and_eval(&c, dir, 0, &rc);
	assert_int_equal(rc, -ENOENT);
	assert_non_null(strstr(tier_last_error(), "model.layers."));
	w.t[2].shape[0] = 22; /* lm_head [22, 16] (the first 22 rows of the buffer) */
	write_ckpt(dir, &w, 0, -1);
	load_and_eval(&c, dir, 0, &rc);
	assert_int_equal(rc, -EBADMSG);
	assert_non_null(strstr(tier_last_error(), "lm_head"));
	cw_free(&w);
	cw_free(&f);
	char path[400];
	snprintf(path, sizeof path, "%s/model.safetensors", dir);
	unlink(path);
	rmdir(dir);
	tier_rng_seed(&rng, seed + 1);
}

/* Two micro-batches of one sequence accumulate the gradient of one micro-batch of two. */
static void test_grad_accumulation(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.targets = 0x3f, lc.init_b_std = 0.2f, lc.seed = seed;
	tier_step_result res[2];
	int32_t tok[12], lab[12];
	for (int i = 0; i < 12; i++)
		tok[i] = (int32_t)tier_rng_below(&rng, 23), lab[i] = (int32_t)tier_rng_below(&rng, 23);
	for (int v = 0; v < 2; v++) {
		tier_store *s;
		tier_store_config sc = { .dev = cpu, .capacity = { 16u << 20, 16u << 20, 0 } };
		assert_int_equal(tier_store_create(&s, &sc), 0);
		tier_model *m;
		assert_int_equal(tier_model_create(s, cpu, &c, &lc, &m), 0);
		assert_int_equal(tier_model_init_random(m, seed, 0.3), 0);
		tier_train_cfg tc;
		tier_train_cfg_init(&tc);
		tc.batch = v ? 1 : 2, tc.micro_batches = v ? 2 : 1, tc.seq = 6, tc.clip = 0;
		tier_trainer *t;
		assert_int_equal(tier_trainer_create(m, &tc, &t), 0);
		assert_int_equal(tier_trainer_step(t, tok, lab, &res[v]), 0);
		tier_trainer_destroy(t);
		tier_model_destroy(m);
		tier_store_destroy(s);
	}
	printf("# one micro-batch of 2: loss %.6f |g| %.6f; two of 1: loss %.6f |g| %.6f\n", res[0].loss,
	       res[0].grad_norm, res[1].loss, res[1].grad_norm);
	assert_true(fabsf(res[0].loss - res[1].loss) <= 1e-5f * res[0].loss);
	assert_true(fabsf(res[0].grad_norm - res[1].grad_norm) <= 1e-4f * res[0].grad_norm);
	assert_true(res[0].grad_norm > 0 && res[0].tokens == 12 && res[1].tokens == 12);
}

/* PEFT's init (A uniform within 1/sqrt(in), B zero), and an adapter saved and loaded back. */
static void test_lora_init_and_adapter(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	tiny_all_targets(&c, &lc);
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 5, seed, 0.3), 0);
	tier_peft_adapter *a;
	assert_int_equal(tier_model_lora_export(r.m, 0, &a), 0);
	for (size_t i = 0; i < a->n_modules; i++) {
		tier_peft_module *pm = &a->modules[i];
		double bound = 1.0 / sqrt((double)pm->in), mx = 0;
		for (int64_t j = 0; j < lc.r * pm->in; j++)
			mx = fabs(pm->a[j]) > mx ? fabs(pm->a[j]) : mx;
		assert_true(mx <= bound && mx > 0.5 * bound);
		for (int64_t j = 0; j < lc.r * pm->out; j++)
			assert_true(pm->b[j] == 0.0f);
	}
	assert_true(a->r == 8 && a->lora_alpha == 16);
	/* non-zero B, a loss, then save, change, load: the loss comes back */
	for (size_t i = 0; i < a->n_modules; i++)
		for (int64_t j = 0; j < lc.r * a->modules[i].out; j++)
			a->modules[i].b[j] = 0.2f * tier_rng_normal(&rng);
	assert_int_equal(tier_model_lora_import(r.m, a), 0);
	fill_batch(&r, 23, seed, 10);
	float l0 = loss_at(&r);
	char dir[256];
	temp_dir(dir, sizeof dir, "tier-train-adapter");
	assert_int_equal(tier_peft_save(dir, a), 0);
	a->modules[0].b[0] += 1.0f;
	assert_int_equal(tier_model_lora_import(r.m, a), 0);
	assert_true(loss_at(&r) != l0);
	tier_peft_adapter *back;
	assert_int_equal(tier_peft_load(dir, &c, &back), 0);
	assert_int_equal(tier_model_lora_import(r.m, back), 0);
	assert_true(loss_at(&r) == l0);
	/* an adapter missing a module, or of another rank, is refused */
	back->n_modules--;
	assert_int_equal(tier_model_lora_import(r.m, back), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "no module"));
	back->n_modules++;
	back->r = 4;
	assert_int_equal(tier_model_lora_import(r.m, back), -EINVAL);
	tier_peft_free(back);
	tier_peft_free(a);
	char path[400];
	snprintf(path, sizeof path, "%s/adapter_config.json", dir);
	unlink(path);
	snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
	unlink(path);
	rmdir(dir);
	rig_close(&r);
}

/* Save after 3 steps, rebuild everything, load, 3 more: the same losses as 6 in one go. */

/* Overwrite `bytes` at element `at` of tensor `name` of the checkpoint at path (the old bytes into
 * `old` to put back). */
static void patch_tensor(const char *path, const char *name, size_t at, const void *val, size_t bytes, void *old)
{
	tier_st *st;
	assert_int_equal(tier_st_open(path, &st), 0);
	const tier_st_tensor *x = tier_st_find(st, name);
	assert_non_null(x);
	uint64_t off = x->offset + at * bytes;
	tier_st_close(st);
	FILE *f = fopen(path, "r+b");
	assert_non_null(f);
	assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
	assert_int_equal(fread(old, 1, bytes, f), bytes);
	assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
	assert_int_equal(fwrite(val, 1, bytes, f), bytes);
	assert_int_equal(fclose(f), 0);
}

/* A checkpoint damaged in its steps or values (a NaN parameter, a negative second moment) is
 * refused, naming the tensor, before anything changes; put right, it loads. */
static void damaged_checkpoints(const tier_hf_config *c, const tier_lora_cfg *lc, const char *path, uint64_t wseed)
{
	const int64_t neg = -1;
	const float nan = NAN, minus = -1.0f;
	const size_t HALF = SIZE_MAX; /* the first element of the upper half */
	const struct { const char *name; size_t at; const void *val; size_t bytes; const char *says; } cases[] = {
		{ "step", 0, &neg, 8, "step is -1" },
		{ "group_steps", 1, &neg, 8, "group_steps[1] is -1" },
		{ "layers.0.attn.lora", 5, &nan, 4, "layers.0.attn.lora[5] is nan" },
		{ "layers.1.attn.adamw", 0, &nan, 4, "not finite" },
		{ "layers.1.attn.adamw", 0, &minus, 4, NULL }, /* a negative first moment is fine */
		{ "layers.1.attn.adamw", HALF, &minus, 4, "negative second moment" }, /* v: the upper half */
	};
	tier_st *st;
	assert_int_equal(tier_st_open(path, &st), 0);
	size_t half = (size_t)(tier_st_find(st, "layers.1.attn.adamw")->nbytes / 8);
	tier_st_close(st);
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		char old[8];
		size_t at = cases[i].at == HALF ? half : cases[i].at;
		patch_tensor(path, cases[i].name, at, cases[i].val, cases[i].bytes, old);
		rig r;
		assert_int_equal(rig_open(&r, c, lc, 64u << 20, 2, 6, wseed, 0.2), 0);
		int rc = tier_trainer_load(r.t, path);
		if (cases[i].says) {
			if (rc != -EBADMSG)
				printf("# damaged case %zu (%s) loaded: rc %d\n", i, cases[i].name, rc);
			assert_int_equal(rc, -EBADMSG);
			assert_non_null(strstr(tier_last_error(), cases[i].says));
			assert_int_equal(tier_trainer_steps_done(r.t), 0);
		} else {
			if (rc)
				printf("# %s\n", tier_last_error());
			assert_int_equal(rc, 0);
		}
		rig_close(&r);
		char back[8];
		patch_tensor(path, cases[i].name, at, old, cases[i].bytes, back);
	}
	rig r; /* put right, it loads */
	assert_int_equal(rig_open(&r, c, lc, 64u << 20, 2, 6, wseed, 0.2), 0);
	assert_int_equal(tier_trainer_load(r.t, path), 0);
	assert_int_equal(tier_trainer_steps_done(r.t), 3);
	rig_close(&r);
}
static void test_resume(void **state)
{
	(void)state;
	tier_hf_config c;
	tier_lora_cfg lc;
	tiny_all_targets(&c, &lc);
	char dir[256], path[300];
	temp_dir(dir, sizeof dir, "tier-train-resume");
	snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
	float whole[6], part[6];
	tier_step_result res;
	for (int run = 0; run < 3; run++) { /* 0: six steps; 1: three and save; 2: load and three */
		rig r;
		assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 6, seed, 0.2), 0);
		if (run == 2) {
			assert_int_equal(tier_trainer_load(r.t, path), 0);
			assert_int_equal(tier_trainer_steps_done(r.t), 3);
		}
		for (int s = run == 2 ? 3 : 0; s < (run == 1 ? 3 : 6); s++) {
			fill_batch(&r, 23, seed + (uint64_t)s, 12); /* the batch depends on the step only */
			assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
			(run ? part : whole)[s] = res.loss;
		}
		if (run == 1)
			assert_int_equal(tier_trainer_save(r.t, path), 0);
		rig_close(&r);
	}
	assert_memory_equal(whole, part, sizeof whole);
	/* a checkpoint of another LoRA rank is refused before anything changes */
	const int r0 = lc.r;
	lc.r = r0 == 4 ? 8 : 4;
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 6, seed, 0.2), 0);
	assert_int_equal(tier_trainer_load(r.t, path), -EBADMSG);
	assert_non_null(strstr(tier_last_error(), "layers.0.attn"));
	assert_int_equal(tier_trainer_steps_done(r.t), 0);
	rig_close(&r);
	lc.r = r0;
	damaged_checkpoints(&c, &lc, path, seed);
	unlink(path);
	rmdir(dir);
}

/* Experts that receive no tokens are never acquired: one token routes to k = 2 of 16 experts. */
static void test_cold_experts_not_fetched(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	c.num_experts = 16;
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 1, 1, seed, 0.2), 0);
	tier_stats a, b;
	tier_store_stats(r.s, &a);
	r.tok[0] = 5, r.lab[0] = 7;
	float loss;
	assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 1, &loss, NULL), 0);
	tier_store_stats(r.s, &b);
	uint64_t acq = b.cls[TIER_HBM][TIER_CLASS_EXPERT].hits + b.cls[TIER_HBM][TIER_CLASS_EXPERT].misses -
		       a.cls[TIER_HBM][TIER_CLASS_EXPERT].hits - a.cls[TIER_HBM][TIER_CLASS_EXPERT].misses;
	printf("# expert acquires for one token through 1 MoE layer, forward and backward: %llu\n",
	       (unsigned long long)acq);
	assert_int_equal(acq, 2 * 2); /* 2 experts in the forward, the same 2 again in the backward */
	rig_close(&r);

	/* Under a budget that spills, the store does not bring the cold experts either (with the
	 * forwards' lists predicted from the latest routing; by default only the backward's are cut):
	 * after a first step (whose forwards know no routing yet) a step moves at most the routed
	 * experts' bytes, each once for the forward and once for the backward. Without routing in the
	 * schedule it brought all 16 of every layer. */
	c.num_hidden_layers = 6, c.num_experts_per_tok = 1;
	memset(c.mlp_only, 0, sizeof c.mlp_only);
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 1, 1, seed, 0.2), 0);
	uint64_t small = tier_trainer_min_hbm(r.t) * 3 / 2;
	rig_close(&r);
	env_keep sched;
	env_set(&sched, "TIER_SCHED_ROUTED", "all"); /* the forwards too, from the latest routing */
	assert_int_equal(rig_open(&r, &c, &lc, small, 1, 1, seed, 0.2), 0);
	env_back(&sched);
	uint64_t esz = 3ull * c.moe_intermediate_size * c.hidden_size * sizeof(float), moved[3];
	tier_step_result res;
	for (int s = 0; s < 3; s++) {
		r.tok[0] = 5, r.lab[0] = 7;
		tier_store_stats(r.s, &a);
		assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
		tier_store_stats(r.s, &b);
		moved[s] = b.cls[TIER_HBM][TIER_CLASS_EXPERT].bytes_in - a.cls[TIER_HBM][TIER_CLASS_EXPERT].bytes_in;
	}
	printf("# expert bytes into HBM per step, one token, top-1 of 16, 6 layers: %llu, %llu, %llu (one expert "
	       "%llu)\n", (unsigned long long)moved[0], (unsigned long long)moved[1], (unsigned long long)moved[2],
	       (unsigned long long)esz);
	assert_true(moved[1] <= 2 * 6 * tier_align_up(esz, 4096) && moved[2] <= 2 * 6 * tier_align_up(esz, 4096));
	rig_close(&r);
}

/* Per-expert token counts of a step: each target position of each micro-batch goes to k experts of
 * the MoE layer, so a layer's counts add up to micro * batch * seq * k; eval counts its one batch. */
static void test_expert_counts(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	rig r;
	int batch = 3, seq = 5, E = (int)c.num_experts, k = (int)c.num_experts_per_tok;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, batch, seq, seed, 0.2), 0);
	int64_t cnt[4];
	for (int e = 0; e < E; e++)
		cnt[e] = -7;
	assert_int_equal(tier_trainer_expert_counts(r.t, 0, cnt), 0); /* no step yet: zeros */
	for (int e = 0; e < E; e++)
		assert_int_equal(cnt[e], 0);
	fill_batch(&r, (int)c.vocab_size, seed + 3, (size_t)batch * seq);
	tier_step_result res;
	for (int step = 0; step < 2; step++) {
		assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
		for (int e = 0; e < E; e++)
			cnt[e] = -7;
		assert_int_equal(tier_trainer_expert_counts(r.t, 0, cnt), 0);
		int64_t sum = 0;
		for (int e = 0; e < E; e++) {
			assert_true(cnt[e] >= 0 && cnt[e] <= batch * seq);
			sum += cnt[e];
		}
		assert_int_equal(sum, (int64_t)batch * seq * k); /* not doubled by the backward's recompute */
	}
	float loss;
	assert_int_equal(tier_trainer_eval(r.t, r.tok, r.lab, 0, &loss, NULL), 0);
	assert_int_equal(tier_trainer_expert_counts(r.t, 0, cnt), 0);
	assert_int_equal(cnt[0] + cnt[1] + cnt[2] + cnt[3], (int64_t)batch * seq * k);
	cnt[0] = -7;
	assert_int_equal(tier_trainer_expert_counts(r.t, 1, cnt), -ENOENT); /* layer 1 is dense */
	assert_int_equal(tier_trainer_expert_counts(r.t, 2, cnt), -EINVAL);
	assert_int_equal(tier_trainer_expert_counts(r.t, -1, cnt), -EINVAL);
	assert_int_equal(tier_trainer_expert_counts(r.t, 0, NULL), -EINVAL);
	assert_int_equal(tier_trainer_expert_counts(NULL, 0, cnt), -EINVAL);
	assert_int_equal(cnt[0], -7);
	rig_close(&r);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_lora_grads_fd),
		cmocka_unit_test(test_lora_grads_fd_mixtral),
		cmocka_unit_test(test_loss_falls_and_determinism),
		cmocka_unit_test(test_store_transparent),
		cmocka_unit_test(test_grad_norm_and_spent_grads),
		cmocka_unit_test(test_moe_chunks),
		cmocka_unit_test(test_layer_major),
		cmocka_unit_test(test_optim_in_forward),
		cmocka_unit_test(test_pipeline_transparent),
		cmocka_unit_test(test_opcache_transparent),
		cmocka_unit_test(test_opcache_attention_output),
		cmocka_unit_test(test_moe_routed_transparent),
		cmocka_unit_test(test_lora_dropout),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_data),
		cmocka_unit_test(test_load_hf),
		cmocka_unit_test(test_grad_accumulation),
		cmocka_unit_test(test_lora_init_and_adapter),
		cmocka_unit_test(test_resume),
		cmocka_unit_test(test_cold_experts_not_fetched),
		cmocka_unit_test(test_expert_counts),
	};
	return cmocka_run_group_tests(tests, seeded_cpu_setup, seeded_cpu_teardown);
}
