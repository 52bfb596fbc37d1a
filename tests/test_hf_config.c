/* test_hf_config.c - config.json for qwen3_moe and mixtral: fields, defaults, and each kind of error. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include "config.h"
#include "tier/tier.h"

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>

/* Qwen3-30B-A3B's and Mixtral-8x7B's published config.json (abridged only of unrelated keys). */
static const char *qwen3 =
	"{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,"
	" \"bos_token_id\": 151643, \"decoder_sparse_step\": 1, \"eos_token_id\": 151645, \"head_dim\": 128,"
	" \"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 6144,"
	" \"max_position_embeddings\": 40960, \"max_window_layers\": 48, \"mlp_only_layers\": [],"
	" \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768, \"norm_topk_prob\": true,"
	" \"num_attention_heads\": 32, \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 48,"
	" \"num_key_value_heads\": 4, \"output_router_logits\": false, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null,"
	" \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.001, \"sliding_window\": null,"
	" \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.51.0\","
	" \"use_cache\": true, \"use_sliding_window\": false, \"vocab_size\": 151936}";
static const char *mixtral =
	"{\"architectures\": [\"MixtralForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": 1,"
	" \"eos_token_id\": 2, \"hidden_act\": \"silu\", \"hidden_size\": 4096, \"initializer_range\": 0.02,"
	" \"intermediate_size\": 14336, \"max_position_embeddings\": 32768, \"model_type\": \"mixtral\","
	" \"num_attention_heads\": 32, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 32,"
	" \"num_key_value_heads\": 8, \"num_local_experts\": 8, \"output_router_logits\": false,"
	" \"rms_norm_eps\": 1e-05, \"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.02,"
	" \"sliding_window\": null, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
	" \"transformers_version\": \"4.36.0.dev0\", \"use_cache\": true, \"vocab_size\": 32000}";

static char path[64];

/* Write `base` with one key replaced (value JSON text) or removed (value NULL). */
static void write_cfg(const char *base, const char *key, const char *value)
{
	json_t *j = json_loads(base, 0, NULL);
	assert_non_null(j);
	if (key && value)
		json_object_set_new(j, key, json_loads(value, JSON_DECODE_ANY, NULL));
	else if (key)
		json_object_del(j, key);
	assert_int_equal(json_dump_file(j, path, JSON_INDENT(2)), 0);
	json_decref(j);
}

static void test_qwen3(void **state)
{
	tier_hf_config c;
	(void)state;
	write_cfg(qwen3, NULL, NULL);
	memset(&c, 0xAA, sizeof c);
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_string_equal(c.model_type, "qwen3_moe");
	assert_int_equal(c.hidden_size, 2048);
	assert_int_equal(c.intermediate_size, 6144);
	assert_int_equal(c.moe_intermediate_size, 768);
	assert_int_equal(c.num_hidden_layers, 48);
	assert_int_equal(c.num_attention_heads, 32);
	assert_int_equal(c.num_key_value_heads, 4);
	assert_int_equal(c.head_dim, 128);
	assert_int_equal(c.vocab_size, 151936);
	assert_int_equal(c.num_experts, 128);
	assert_int_equal(c.num_experts_per_tok, 8);
	assert_int_equal(c.decoder_sparse_step, 1);
	assert_int_equal(c.max_position_embeddings, 40960);
	assert_true(c.rms_norm_eps == 1e-6 && c.rope_theta == 1e6 && c.router_aux_loss_coef == 0.001);
	assert_int_equal(c.norm_topk_prob, 1);
	assert_int_equal(c.tie_word_embeddings, 0);
	assert_int_equal(c.output_router_logits, 0);
	assert_int_equal(c.dtype, TIER_DT_BF16);
	for (int L = 0; L < 48; L++)
		assert_int_equal(tier_hf_layer_is_moe(&c, L), 1);
	assert_int_equal(tier_hf_layer_is_moe(&c, 48), 0);
}

static void test_qwen3_variants(void **state)
{
	tier_hf_config c;
	(void)state;
	write_cfg(qwen3, "mlp_only_layers", "[0, 3]");
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_int_equal(tier_hf_layer_is_moe(&c, 0), 0);
	assert_int_equal(tier_hf_layer_is_moe(&c, 1), 1);
	assert_int_equal(tier_hf_layer_is_moe(&c, 3), 0);
	write_cfg(qwen3, "decoder_sparse_step", "2");
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_int_equal(tier_hf_layer_is_moe(&c, 0), 0);   /* (L + 1) % step == 0, as in HF */
	assert_int_equal(tier_hf_layer_is_moe(&c, 1), 1);
	/* Defaults when optional keys are absent: head_dim = hidden / heads, dtype float32. */
	write_cfg(qwen3, "head_dim", NULL);
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_int_equal(c.head_dim, 64);
	write_cfg(qwen3, "torch_dtype", NULL);
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_int_equal(c.dtype, TIER_DT_F32);
	/* transformers v5 spellings: dtype, rope_parameters. */
	write_cfg(qwen3, "dtype", "\"float16\"");
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_int_equal(c.dtype, TIER_DT_F16);
	write_cfg(qwen3, "rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 5000.0}");
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_true(c.rope_theta == 5000.0);
}

static void test_mixtral(void **state)
{
	tier_hf_config c;
	(void)state;
	write_cfg(mixtral, NULL, NULL);
	memset(&c, 0xAA, sizeof c);
	assert_int_equal(tier_hf_config_load(path, &c), 0);
	assert_string_equal(c.model_type, "mixtral");
	assert_int_equal(c.num_experts, 8);
	assert_int_equal(c.num_experts_per_tok, 2);
	assert_int_equal(c.moe_intermediate_size, 14336);
	assert_int_equal(c.head_dim, 128);
	assert_int_equal(c.norm_topk_prob, 1);
	assert_true(c.router_aux_loss_coef == 0.02 && c.rms_norm_eps == 1e-5);
	assert_int_equal(c.dtype, TIER_DT_BF16);
	assert_int_equal(tier_hf_layer_is_moe(&c, 31), 1);
}

struct bad { const char *base, *key, *value; int rc; const char *words[3]; };

static void test_errors(void **state)
{
	const struct bad cases[] = {
		{ qwen3, "model_type", "\"llama\"", -ENOTSUP, { "llama", "qwen3_moe, mixtral", NULL } },
		{ qwen3, "model_type", NULL, -EBADMSG, { "model_type", NULL, NULL } },
		{ qwen3, "hidden_size", NULL, -EBADMSG, { "\"hidden_size\"", "missing", NULL } },
		{ qwen3, "num_experts", NULL, -EBADMSG, { "\"num_experts\"", "missing", NULL } },
		{ mixtral, "num_local_experts", NULL, -EBADMSG, { "num_local_experts", NULL, NULL } },
		{ qwen3, "hidden_size", "\"2048\"", -EBADMSG, { "hidden_size", "integer", NULL } },
		{ qwen3, "num_hidden_layers", "-4", -EBADMSG, { "num_hidden_layers", NULL, NULL } },
		{ qwen3, "norm_topk_prob", "1", -EBADMSG, { "norm_topk_prob", "true or false", NULL } },
		{ qwen3, "rms_norm_eps", "\"small\"", -EBADMSG, { "rms_norm_eps", "number", NULL } },
		{ qwen3, "rope_scaling", "{\"type\": \"yarn\", \"factor\": 4.0}", -ENOTSUP, { "rope_scaling", NULL, NULL } },
		{ qwen3, "rope_parameters", "{\"rope_type\": \"yarn\"}", -ENOTSUP, { "yarn", NULL, NULL } },
		{ qwen3, "torch_dtype", "\"float8\"", -ENOTSUP, { "torch_dtype", NULL, NULL } },
		{ qwen3, "torch_dtype", "7", -EBADMSG, { "torch_dtype", NULL, NULL } },
		{ qwen3, "mlp_only_layers", "[48]", -EBADMSG, { "mlp_only_layers", NULL, NULL } },
		{ qwen3, "mlp_only_layers", "3", -EBADMSG, { "mlp_only_layers", NULL, NULL } },
		{ qwen3, "num_experts_per_tok", "129", -EBADMSG, { "num_experts_per_tok", NULL, NULL } },
		{ qwen3, "num_key_value_heads", "5", -EBADMSG, { "num_key_value_heads", NULL, NULL } },
		/* above tier's limits: counts made of them would leave 64 bits (found by fuzz_hf_config) */
		{ qwen3, "hidden_size", "4611686018427387904", -EBADMSG, { "hidden_size", "262144", "accepts" } },
		{ qwen3, "vocab_size", "4194305", -EBADMSG, { "vocab_size", "4194304", NULL } },
		{ qwen3, "num_experts", "16385", -EBADMSG, { "num_experts 16385", NULL, NULL } },
		{ qwen3, "head_dim", "65536", -EBADMSG, { "head_dim x num_attention_heads", NULL, NULL } },
	};
	tier_hf_config c, poison;
	(void)state;
	memset(&poison, 0x5A, sizeof poison);
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		write_cfg(cases[i].base, cases[i].key, cases[i].value);
		c = poison;
		int rc = tier_hf_config_load(path, &c);
		const char *m = tier_last_error();
		int ok = rc == cases[i].rc && strstr(m, path) && memcmp(&c, &poison, sizeof c) == 0;
		for (int w = 0; w < 3 && cases[i].words[w]; w++)
			ok = ok && strstr(m, cases[i].words[w]);
		if (!ok)
			fail_msg("case %zu (%s = %s): rc %d, want %d, message \"%s\"", i, cases[i].key,
				 cases[i].value ? cases[i].value : "(removed)", rc, cases[i].rc, m);
	}
	FILE *f = fopen(path, "w");
	fputs("{\"model_type\": \"qwen3_moe\",", f);
	fclose(f);
	assert_int_equal(tier_hf_config_load(path, &c), -EBADMSG);
	assert_non_null(strstr(tier_last_error(), "not valid JSON"));
	f = fopen(path, "w");
	fputs("[1]", f);
	fclose(f);
	assert_int_equal(tier_hf_config_load(path, &c), -EBADMSG);
	assert_int_equal(tier_hf_config_load("no-such-config.json", &c), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "no-such-config.json"));
}

int main(void)
{
	snprintf(path, sizeof path, "hf-config-%d.json", (int)getpid());
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_qwen3), cmocka_unit_test(test_qwen3_variants),
		cmocka_unit_test(test_mixtral), cmocka_unit_test(test_errors),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	unlink(path);
	return rc;
}

#else

int main(void)
{
	tier_hf_config c;
	if (tier_hf_config_load("config.json", &c) != -ENOTSUP || !strstr(tier_last_error(), "libjansson-dev"))
		return 1;
	printf("# built without jansson: config.json reading says so; skipping\n");
	return 77;
}

#endif
