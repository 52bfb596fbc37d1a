/* test_peft.c - PEFT LoRA adapters: save -> load round trip, PEFT's key names and shapes,
 * adapter_config.json fields, validation against the model config. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>
#include "config.h"
#include "tier/tier.h"

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#include "test_seed.h"

enum { H = 16, HEADS = 4, KV = 2, HD = 8, MOE_I = 12, E = 4, R = 4, LAYERS = 2 };
static uint64_t seed;
static char dir[64];
static tier_hf_config cfg;

/* A 2-layer qwen3_moe: q/k/v/o and every expert's gate/up/down. */
static tier_peft_adapter *make_adapter(tier_rng *r)
{
	static const struct { const char *m; int64_t in, out; } attn[] = {
		{ "self_attn.q_proj", H, HEADS * HD }, { "self_attn.k_proj", H, KV * HD },
		{ "self_attn.v_proj", H, KV * HD }, { "self_attn.o_proj", HEADS * HD, H },
	};
	static const char *const proj[] = { "gate_proj", "up_proj", "down_proj" };
	tier_peft_adapter *a = calloc(1, sizeof *a);
	a->r = R;
	a->lora_alpha = 8;
	a->use_rslora = 1;
	snprintf(a->base_model, sizeof a->base_model, "Qwen/Qwen3-30B-A3B");
	a->dtype = TIER_DT_F32;
	a->modules = calloc(LAYERS * (4 + 3 * E), sizeof *a->modules);
	for (int L = 0; L < LAYERS; L++) {
		for (int i = 0; i < 4 + 3 * E; i++) {
			tier_peft_module *m = &a->modules[a->n_modules++];
			m->layer = L;
			if (i < 4) {
				snprintf(m->module, sizeof m->module, "%s", attn[i].m);
				m->in = attn[i].in;
				m->out = attn[i].out;
			} else {
				int e = (i - 4) / 3, p = (i - 4) % 3;
				snprintf(m->module, sizeof m->module, "mlp.experts.%d.%s", e, proj[p]);
				m->in = p == 2 ? MOE_I : H;
				m->out = p == 2 ? H : MOE_I;
			}
			m->a = malloc(sizeof(float) * R * m->in);
			m->b = malloc(sizeof(float) * R * m->out);
			for (int k = 0; k < R * m->in; k++)
				m->a[k] = tier_rng_normal(r);
			for (int k = 0; k < R * m->out; k++)
				m->b[k] = tier_rng_normal(r);
		}
	}
	return a;
}

static char *in_dir(const char *name)
{
	static char p[2][256];
	static int k;
	k ^= 1;
	snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
	return p[k];
}

static void test_round_trip(void **state)
{
	tier_rng r;
	tier_peft_adapter *back = (tier_peft_adapter *)&back;
	(void)state;
	tier_rng_seed(&r, seed);
	tier_peft_adapter *a = make_adapter(&r);
	assert_int_equal(tier_peft_save(dir, a), 0);
	assert_int_equal(tier_peft_load(dir, &cfg, &back), 0);
	assert_int_equal(back->r, R);
	assert_true(back->lora_alpha == 8 && back->use_rslora == 1 && back->dtype == TIER_DT_F32);
	assert_string_equal(back->base_model, "Qwen/Qwen3-30B-A3B");
	assert_int_equal(back->n_modules, a->n_modules);
	for (size_t i = 0; i < a->n_modules; i++) {
		const tier_peft_module *m = &a->modules[i], *got = NULL;
		for (size_t j = 0; j < back->n_modules; j++)
			if (back->modules[j].layer == m->layer && !strcmp(back->modules[j].module, m->module))
				got = &back->modules[j];
		assert_non_null(got);
		assert_int_equal(got->in, m->in);
		assert_int_equal(got->out, m->out);
		assert_memory_equal(got->a, m->a, sizeof(float) * R * m->in);    /* bit-exact */
		assert_memory_equal(got->b, m->b, sizeof(float) * R * m->out);
	}
	tier_peft_free(back);

	/* BF16 files hold the rounded values. */
	a->dtype = TIER_DT_BF16;
	assert_int_equal(tier_peft_save(dir, a), 0);
	assert_int_equal(tier_peft_load(dir, &cfg, &back), 0);
	assert_int_equal(back->dtype, TIER_DT_BF16);
	const tier_peft_module *m0 = &back->modules[0];
	for (size_t j = 0; j < a->n_modules; j++)
		if (a->modules[j].layer == m0->layer && !strcmp(a->modules[j].module, m0->module))
			for (int k = 0; k < R * m0->in; k++)
				assert_true(m0->a[k] == tier_bf16_to_f32(tier_f32_to_bf16(a->modules[j].a[k])));
	tier_peft_free(back);
	tier_peft_free(a);
}

static void test_key_names_and_shapes(void **state)
{
	tier_rng r;
	tier_st *st;
	(void)state;
	tier_rng_seed(&r, seed + 1);
	tier_peft_adapter *a = make_adapter(&r);
	assert_int_equal(tier_peft_save(dir, a), 0);
	assert_int_equal(tier_st_open(in_dir("adapter_model.safetensors"), &st), 0);
	assert_int_equal(tier_st_count(st), 2 * LAYERS * (4 + 3 * E));
	assert_string_equal(tier_st_metadata(st, "format"), "pt");
	/* Names as PEFT's get_peft_model_state_dict writes them, spelled out. */
	static const struct { const char *name; uint64_t rows, cols; } want[] = {
		{ "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", R, H },
		{ "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", HEADS * HD, R },
		{ "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight", KV * HD, R },
		{ "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight", R, HEADS * HD },
		{ "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight", R, H },
		{ "base_model.model.model.layers.1.mlp.experts.0.up_proj.lora_B.weight", MOE_I, R },
		{ "base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_A.weight", R, MOE_I },
		{ "base_model.model.model.layers.1.mlp.experts.2.down_proj.lora_B.weight", H, R },
	};
	for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
		const tier_st_tensor *t = tier_st_find(st, want[i].name);
		if (!t)
			fail_msg("missing %s", want[i].name);
		assert_int_equal(t->dtype, TIER_DT_F32);
		assert_int_equal(t->ndim, 2);
		assert_true(t->shape[0] == want[i].rows && t->shape[1] == want[i].cols);
	}
	tier_st_close(st);

	json_error_t err;
	json_t *c = json_load_file(in_dir("adapter_config.json"), 0, &err), *tm;
	assert_non_null(c);
	assert_string_equal(json_string_value(json_object_get(c, "peft_type")), "LORA");
	assert_string_equal(json_string_value(json_object_get(c, "task_type")), "CAUSAL_LM");
	assert_string_equal(json_string_value(json_object_get(c, "bias")), "none");
	assert_string_equal(json_string_value(json_object_get(c, "base_model_name_or_path")), "Qwen/Qwen3-30B-A3B");
	assert_int_equal(json_integer_value(json_object_get(c, "r")), R);
	assert_true(json_is_integer(json_object_get(c, "lora_alpha")) && json_integer_value(json_object_get(c, "lora_alpha")) == 8);
	assert_true(json_is_true(json_object_get(c, "use_rslora")));
	assert_true(json_is_false(json_object_get(c, "fan_in_fan_out")));
	assert_true(json_is_number(json_object_get(c, "lora_dropout")));
	tm = json_object_get(c, "target_modules");
	static const char *const targets[] = { "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj" };
	assert_int_equal(json_array_size(tm), 7);
	for (size_t i = 0; i < 7; i++) {
		int found = 0;
		for (size_t j = 0; j < 7; j++)
			found |= !strcmp(json_string_value(json_array_get(tm, j)), targets[i]);
		assert_true(found);
	}
	json_decref(c);
	tier_peft_free(a);
}

static void write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	fputs(text, f);
	fclose(f);
}

static void expect_load(int want, const char *word)
{
	tier_peft_adapter *a = (tier_peft_adapter *)&a;
	int rc = tier_peft_load(dir, &cfg, &a);
	if (rc != want || a != NULL || !strstr(tier_last_error(), word))
		fail_msg("load: rc %d (want %d), message \"%s\" (want \"%s\")", rc, want, tier_last_error(), word);
}

/* Entries of directory d (files, no . and ..). */
static int entries(const char *d)
{
	DIR *dd = opendir(d);
	struct dirent *e;
	int n = 0;
	while (dd && (e = readdir(dd)))
		n += e->d_name[0] != '.';
	if (dd)
		closedir(dd);
	return n;
}

static void test_bad_adapters(void **state)
{
	tier_rng r;
	(void)state;
	tier_rng_seed(&r, seed + 2);
	tier_peft_adapter *a = make_adapter(&r);
	tier_peft_module keep = a->modules[0];

	float wide[R * (H + 1)];
	for (int k = 0; k < R * (H + 1); k++)
		wide[k] = (float)k;
	a->modules[0].in = H + 1;            /* q_proj with the wrong in-features */
	a->modules[0].a = wide;
	assert_int_equal(tier_peft_save(dir, a), 0);
	expect_load(-EBADMSG, "self_attn.q_proj");
	a->modules[0] = keep;
	a->modules[0].layer = LAYERS;        /* a layer the model does not have */
	assert_int_equal(tier_peft_save(dir, a), 0);
	expect_load(-EBADMSG, "layer 2");
	a->modules[0].layer = 0;
	snprintf(a->modules[4].module, sizeof a->modules[4].module, "mlp.experts.%d.gate_proj", E);
	assert_int_equal(tier_peft_save(dir, a), 0);
	expect_load(-EBADMSG, "mlp.experts.4.gate_proj");
	snprintf(a->modules[4].module, sizeof a->modules[4].module, "mlp.experts.0.gate_proj");
	snprintf(a->modules[5].module, sizeof a->modules[5].module, "mlp.shared_expert.up_proj");
	assert_int_equal(tier_peft_save(dir, a), 0);
	expect_load(-ENOTSUP, "shared_expert");
	snprintf(a->modules[5].module, sizeof a->modules[5].module, "mlp.experts.0.up_proj");
	/* Duplicate modules and bad ranks are refused on save. A save refused while writing the
	 * weights leaves the adapter there as it was: its config too, not a new one beside old weights. */
	a->lora_alpha = 8;
	assert_int_equal(tier_peft_save(dir, a), 0);
	snprintf(a->modules[5].module, sizeof a->modules[5].module, "mlp.experts.0.gate_proj");
	a->lora_alpha = 5;
	assert_int_equal(tier_peft_save(dir, a), -EINVAL);
	a->lora_alpha = 8;
	tier_peft_adapter *back;
	assert_int_equal(tier_peft_load(dir, &cfg, &back), 0);
	assert_true(back->lora_alpha == 8);
	tier_peft_free(back);
	assert_int_equal(entries(dir), 2); /* no temporary left */
	snprintf(a->modules[5].module, sizeof a->modules[5].module, "mlp.experts.0.up_proj");
	a->r = 0;
	assert_int_equal(tier_peft_save(dir, a), -EINVAL);
	a->r = R;
	a->modules[0].b = NULL;
	assert_int_equal(tier_peft_save(dir, a), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "q_proj"));
	a->modules[0] = keep;
	assert_int_equal(tier_peft_save(in_dir("no-such-dir"), a), -ENOENT);

	/* adapter_config.json problems. */
	assert_int_equal(tier_peft_save(dir, a), 0);
	const char *cp = in_dir("adapter_config.json");
	write_text(cp, "{\"peft_type\": \"IA3\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"]}");
	expect_load(-ENOTSUP, "LORA");
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [],"
		   " \"target_parameters\": [\"mlp.experts.gate_up_proj\"]}");
	expect_load(-ENOTSUP, "target_parameters");
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": \"4\", \"lora_alpha\": 8, \"target_modules\": []}");
	expect_load(-EBADMSG, "\"r\"");
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\", 3]}");
	expect_load(-EBADMSG, "target_modules[1]");
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"bias\": \"all\", \"target_modules\": []}");
	expect_load(-ENOTSUP, "bias");
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"]}");
	expect_load(-EBADMSG, "r=8");        /* the file's tensors have rank 4 */
	write_text(cp, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": \"all-linear\"}");
	tier_peft_adapter *b;
	assert_int_equal(tier_peft_load(dir, &cfg, &b), 0);  /* a regex/keyword string is kept as given */
	assert_string_equal(b->target_modules[0], "all-linear");
	tier_peft_free(b);
	assert_int_equal(tier_peft_load(dir, NULL, &b), 0);  /* without a model config: shapes vs r only */
	tier_peft_free(b);

	/* Weight files with a stray key or an A without its B. */
	float x[R * H];
	memset(x, 0, sizeof x);
	tier_st_wtensor t[2] = {
		{ .name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", .dtype = TIER_DT_F32,
		  .ndim = 2, .shape = { R, H }, .data = x },
		{ .name = "model.layers.0.self_attn.q_proj.weight", .dtype = TIER_DT_F32, .ndim = 2,
		  .shape = { R, H }, .data = x },
	};
	assert_int_equal(tier_st_write(in_dir("adapter_model.safetensors"), t, 1, NULL), 0);
	expect_load(-EBADMSG, "lora_B");
	assert_int_equal(tier_st_write(in_dir("adapter_model.safetensors"), t + 1, 1, NULL), 0);
	expect_load(-EBADMSG, "model.layers.0.self_attn.q_proj.weight");
	tier_peft_free(a);
}

static void setup_config(void)
{
	char p[256];
	snprintf(p, sizeof p, "%s/config.json", dir);
	FILE *f = fopen(p, "w");
	fprintf(f, "{\"model_type\": \"qwen3_moe\", \"hidden_size\": %d, \"intermediate_size\": 40,"
		" \"moe_intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d,"
		" \"num_key_value_heads\": %d, \"head_dim\": %d, \"vocab_size\": 50, \"rms_norm_eps\": 1e-6,"
		" \"rope_theta\": 10000.0, \"num_experts\": %d, \"num_experts_per_tok\": 2}",
		H, MOE_I, LAYERS, HEADS, KV, HD, E);
	fclose(f);
	if (tier_hf_config_load(p, &cfg) != 0) {
		fprintf(stderr, "%s\n", tier_last_error());
		exit(1);
	}
	unlink(p);
}

int main(void)
{
	seed = test_seed("test_peft", 0);
	snprintf(dir, sizeof dir, "peft-test-XXXXXX");
	if (!mkdtemp(dir))
		return 1;
	setup_config();
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip), cmocka_unit_test(test_key_names_and_shapes),
		cmocka_unit_test(test_bad_adapters),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	unlink(in_dir("adapter_config.json"));
	unlink(in_dir("adapter_model.safetensors"));
	rmdir(dir);
	return rc;
}

#else

int main(void)
{
	tier_peft_adapter a = { 0 }, *b;
	if (tier_peft_save("x", &a) != -ENOTSUP || tier_peft_load("x", NULL, &b) != -ENOTSUP ||
	    !strstr(tier_last_error(), "libjansson-dev"))
		return 1;
	printf("# built without jansson: PEFT adapters say so; skipping\n");
	return 77;
}

#endif
