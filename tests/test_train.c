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
#include <time.h>
#include <unistd.h>
#include <cmocka.h>
#include "tier/tier.h"

static tier_dev *cpu;
static tier_rng rng;
static uint64_t seed;

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

typedef struct {
	tier_store *s;
	tier_model *m;
	tier_trainer *t;
	tier_train_cfg tc;
	int32_t *tok, *lab;
} rig;

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

/* d loss / d (one LoRA coordinate) against a central difference, for a few coordinates of every module. */
static void test_lora_grads_fd(void **state)
{
	(void)state;
	tier_hf_config c;
	tiny_config(&c);
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
	assert_true(g->n_modules == p->n_modules && g->n_modules == 4 + 3 * 4 + 3);
	int checked = 0, bad = 0;
	double worst = 0.0;
	for (size_t i = 0; i < p->n_modules; i++)
		for (int q = 0; q < 4; q++) {
			tier_peft_module *pm = &p->modules[i];
			int isb = q & 1;
			size_t n = (size_t)lc.r * (isb ? pm->out : pm->in), j = tier_rng_below(&rng, n);
			float *x = isb ? pm->b : pm->a, x0 = x[j], h = 2e-3f;
			double an = isb ? g->modules[i].b[j] : g->modules[i].a[j];
			x[j] = x0 + h;
			assert_int_equal(tier_model_lora_import(r.m, p), 0);
			double lp = loss_at(&r);
			x[j] = x0 - h;
			assert_int_equal(tier_model_lora_import(r.m, p), 0);
			double lm = loss_at(&r);
			x[j] = x0;
			double fd = (lp - lm) / (2.0 * h), err = fabs(fd - an), tol = 2e-3 + 3e-2 * fabs(an);
			worst = err > worst ? err : worst;
			checked++;
			if (err > tol) {
				bad++;
				printf("# layers.%d.%s lora_%c[%zu]: analytic %.6g, central difference %.6g\n", pm->layer,
				       pm->module, isb ? 'B' : 'A', j, an, fd);
			}
		}
	printf("# %d coordinates checked, worst |analytic - fd| %.3g, %d outside tolerance\n", checked, worst, bad);
	/* a top-k switch inside +-h can spoil a difference now and then; more than one is a bug */
	assert_true(bad <= 1);
	tier_peft_free(g);
	tier_peft_free(p);
	rig_close(&r);
}

static void run_losses(const tier_hf_config *c, uint64_t hbm, int steps, float *out)
{
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.seed = seed;
	lc.r = 4;
	rig r;
	assert_int_equal(rig_open(&r, c, &lc, hbm, 2, 8, seed + 5, 0.1), 0);
	fill_batch(&r, (int)c->vocab_size, seed + 6, 16);
	for (int s = 0; s < steps; s++) {
		tier_step_result res;
		assert_int_equal(tier_trainer_step(r.t, r.tok, r.lab, &res), 0);
		out[s] = res.loss;
	}
	rig_close(&r);
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
	tiny_config(&c);
	c.num_experts = 16, c.moe_intermediate_size = 32, c.num_hidden_layers = 3;
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	rig r;
	assert_int_equal(rig_open(&r, &c, &lc, 64u << 20, 2, 8, 1, 0.1), 0);
	uint64_t need = tier_trainer_min_hbm(r.t), base = tier_model_base_bytes(r.m);
	rig_close(&r);
	printf("# model %llu bytes, HBM budget %llu bytes\n", (unsigned long long)base, (unsigned long long)need);
	float a[8], b[8];
	run_losses(&c, 64u << 20, 8, a);
	run_losses(&c, need, 8, b);
	assert_memory_equal(a, b, sizeof a);
	/* one byte less is refused with a message naming the budget */
	assert_int_equal(rig_open(&r, &c, &lc, need - 1, 2, 8, 1, 0.1), -ENOSPC);
	assert_non_null(strstr(tier_last_error(), "--hbm"));
	rig_close(&r);
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
	strcpy(bad.model_type, "mixtral");
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
	const char *base = getenv("TMPDIR");
	snprintf(dir, sizeof dir, "%s/tier-train-test.XXXXXX", base && *base ? base : P_tmpdir);
	assert_non_null(mkdtemp(dir));
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
	FILE *f = fopen(path, "r+b");
	assert_non_null(f);
	assert_int_equal(ftruncate(fileno(f), 30), 0);
	fclose(f);
	assert_int_equal(tier_data_open(path, &d), -EBADMSG);
	assert_null(d);
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

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_lora_grads_fd),
		cmocka_unit_test(test_loss_falls_and_determinism),
		cmocka_unit_test(test_store_transparent),
		cmocka_unit_test(test_bad_input),
		cmocka_unit_test(test_data),
	};
	seed = getenv("TIER_SEED") ? strtoull(getenv("TIER_SEED"), NULL, 0) : (uint64_t)time(NULL);
	printf("# test_train seed %llu (TIER_SEED=%llu reproduces)\n", (unsigned long long)seed, (unsigned long long)seed);
	tier_rng_seed(&rng, seed);
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0))
		return 1;
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	tier_dev_close(cpu);
	return rc;
}
