/* hf_config.c - read a Hugging Face config.json for the MoE models tier trains (qwen3_moe, mixtral). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "core/safetensors_int.h"

int tier_hf_layer_is_moe(const tier_hf_config *c, int layer)
{
	if (layer < 0 || layer >= c->num_hidden_layers || layer >= TIER_HF_MAX_LAYERS)
		return 0;
	if (c->mlp_only[layer / 64] >> (layer % 64) & 1)
		return 0;
	return c->num_experts > 0 && (layer + 1) % c->decoder_sparse_step == 0;
}

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>

enum kind { K_INT, K_REAL, K_BOOL };
/* A field: its JSON key, where it goes, whether it must be present, its default. */
struct field {
	const char *key;
	enum kind kind;
	size_t off;
	int required;
	double def;
};
#define F(k, kind, member, req, def) { k, kind, offsetof(tier_hf_config, member), req, def }

static const struct field qwen3_moe[] = {
	F("hidden_size", K_INT, hidden_size, 1, 0), F("intermediate_size", K_INT, intermediate_size, 1, 0),
	F("moe_intermediate_size", K_INT, moe_intermediate_size, 1, 0),
	F("num_hidden_layers", K_INT, num_hidden_layers, 1, 0),
	F("num_attention_heads", K_INT, num_attention_heads, 1, 0),
	F("num_key_value_heads", K_INT, num_key_value_heads, 1, 0), F("head_dim", K_INT, head_dim, 0, 0),
	F("vocab_size", K_INT, vocab_size, 1, 0), F("rms_norm_eps", K_REAL, rms_norm_eps, 1, 0),
	F("rope_theta", K_REAL, rope_theta, 0, 10000.0), F("num_experts", K_INT, num_experts, 1, 0),
	F("num_experts_per_tok", K_INT, num_experts_per_tok, 1, 0),
	F("norm_topk_prob", K_BOOL, norm_topk_prob, 0, 0), F("decoder_sparse_step", K_INT, decoder_sparse_step, 0, 1),
	F("tie_word_embeddings", K_BOOL, tie_word_embeddings, 0, 0),
	F("max_position_embeddings", K_INT, max_position_embeddings, 0, 32768),
	F("router_aux_loss_coef", K_REAL, router_aux_loss_coef, 0, 0.001),
	F("output_router_logits", K_BOOL, output_router_logits, 0, 0), { NULL, 0, 0, 0, 0 },
};

static const struct field mixtral[] = {
	F("hidden_size", K_INT, hidden_size, 1, 0), F("intermediate_size", K_INT, intermediate_size, 1, 0),
	F("num_hidden_layers", K_INT, num_hidden_layers, 1, 0),
	F("num_attention_heads", K_INT, num_attention_heads, 1, 0),
	F("num_key_value_heads", K_INT, num_key_value_heads, 1, 0), F("head_dim", K_INT, head_dim, 0, 0),
	F("vocab_size", K_INT, vocab_size, 1, 0), F("rms_norm_eps", K_REAL, rms_norm_eps, 1, 0),
	F("rope_theta", K_REAL, rope_theta, 0, 1e6), F("num_local_experts", K_INT, num_experts, 1, 0),
	F("num_experts_per_tok", K_INT, num_experts_per_tok, 1, 0),
	F("tie_word_embeddings", K_BOOL, tie_word_embeddings, 0, 0),
	F("max_position_embeddings", K_INT, max_position_embeddings, 0, 131072),
	F("router_aux_loss_coef", K_REAL, router_aux_loss_coef, 0, 0.001),
	F("output_router_logits", K_BOOL, output_router_logits, 0, 0), { NULL, 0, 0, 0, 0 },
};

static int load_field(const char *path, json_t *root, const struct field *f, tier_hf_config *c)
{
	json_t *v = json_object_get(root, f->key);
	char *dst = (char *)c + f->off;
	/* transformers 5 writes qwen3_moe's num_experts under its attribute name num_local_experts. */
	if ((!v || json_is_null(v)) && strcmp(f->key, "num_experts") == 0)
		v = json_object_get(root, "num_local_experts");
	if (!v || json_is_null(v)) {
		if (f->required)
			return tier_fail(-EBADMSG, "%s: required key \"%s\" is missing", path, f->key);
		if (f->kind == K_INT)
			*(int64_t *)dst = (int64_t)f->def;
		else if (f->kind == K_REAL)
			*(double *)dst = f->def;
		else
			*(int *)dst = (int)f->def;
		return 0;
	}
	if (f->kind == K_INT && json_is_integer(v) && json_integer_value(v) >= 0)
		*(int64_t *)dst = json_integer_value(v);
	else if (f->kind == K_REAL && json_is_number(v))
		*(double *)dst = json_number_value(v);
	else if (f->kind == K_BOOL && json_is_boolean(v))
		*(int *)dst = json_is_true(v);
	else
		return tier_fail(-EBADMSG, "%s: \"%s\" must be %s", path, f->key,
				 f->kind == K_INT ? "a non-negative integer" : f->kind == K_REAL ? "a number" : "true or false");
	return 0;
}

static int load_dtype(const char *path, json_t *root, tier_hf_config *c)
{
	static const struct { const char *name; tier_dtype dt; } names[] = {
		{ "float32", TIER_DT_F32 }, { "bfloat16", TIER_DT_BF16 }, { "float16", TIER_DT_F16 },
	};
	json_t *v = json_object_get(root, "dtype");          /* transformers >= 4.56 */
	const char *key = "dtype";
	if (!v || json_is_null(v)) {
		v = json_object_get(root, "torch_dtype");
		key = "torch_dtype";
	}
	c->dtype = TIER_DT_F32;                              /* HF's default when absent */
	if (!v || json_is_null(v))
		return 0;
	for (size_t i = 0; json_is_string(v) && i < sizeof names / sizeof names[0]; i++)
		if (strcmp(json_string_value(v), names[i].name) == 0) {
			c->dtype = names[i].dt;
			return 0;
		}
	return tier_fail(json_is_string(v) ? -ENOTSUP : -EBADMSG, "%s: \"%s\" must be \"float32\", "
			 "\"bfloat16\" or \"float16\"", path, key);
}

/* rope_scaling must be null or absent; transformers v5's rope_parameters may carry rope_theta
 * with rope_type "default". */
static int load_rope(const char *path, json_t *root, tier_hf_config *c)
{
	json_t *s = json_object_get(root, "rope_scaling"), *p = json_object_get(root, "rope_parameters");
	if (s && !json_is_null(s))
		return tier_fail(-ENOTSUP, "%s: \"rope_scaling\" is set; tier supports only unscaled RoPE "
				 "(rope_scaling null) for now", path);
	if (!p || json_is_null(p))
		return 0;
	json_t *type = json_object_get(p, "rope_type"), *theta = json_object_get(p, "rope_theta");
	if (!json_is_object(p) || !json_is_string(type))
		return tier_fail(-EBADMSG, "%s: \"rope_parameters\" must be an object with \"rope_type\"", path);
	if (strcmp(json_string_value(type), "default") != 0)
		return tier_fail(-ENOTSUP, "%s: rope_parameters.rope_type \"%s\" is not supported (only "
				 "\"default\")", path, json_string_value(type));
	if (theta && json_is_number(theta))
		c->rope_theta = json_number_value(theta);
	return 0;
}

static int load_mlp_only(const char *path, json_t *root, tier_hf_config *c)
{
	json_t *v = json_object_get(root, "mlp_only_layers"), *x;
	size_t i;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_array(v))
		return tier_fail(-EBADMSG, "%s: \"mlp_only_layers\" must be an array of layer indexes", path);
	json_array_foreach(v, i, x) {
		if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= c->num_hidden_layers)
			return tier_fail(-EBADMSG, "%s: \"mlp_only_layers\"[%zu] must be a layer index below "
					 "num_hidden_layers (%lld)", path, i, (long long)c->num_hidden_layers);
		int64_t L = json_integer_value(x);
		c->mlp_only[L / 64] |= 1ull << (L % 64);
	}
	return 0;
}

/* Sizes above tier's limits (formats.h): their products would overflow the counts made of them. */
static int check_limits(const char *path, const tier_hf_config *c)
{
	const struct { const char *key; int64_t v, max; } lim[] = {
		{ "hidden_size", c->hidden_size, TIER_HF_MAX_WIDTH },
		{ "intermediate_size", c->intermediate_size, TIER_HF_MAX_WIDTH },
		{ "moe_intermediate_size", c->moe_intermediate_size, TIER_HF_MAX_WIDTH },
		{ "head_dim", c->head_dim, TIER_HF_MAX_WIDTH },
		{ "vocab_size", c->vocab_size, TIER_HF_MAX_VOCAB },
		{ "num_experts", c->num_experts, TIER_HF_MAX_EXPERTS },
		{ "num_attention_heads", c->num_attention_heads, TIER_HF_MAX_HEADS },
	};
	for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
		if (lim[i].v > lim[i].max)
			return tier_fail(-EBADMSG, "%s: %s %lld is above the %lld that tier accepts", path, lim[i].key,
					 (long long)lim[i].v, (long long)lim[i].max);
	if (c->head_dim * c->num_attention_heads > TIER_HF_MAX_WIDTH)
		return tier_fail(-EBADMSG, "%s: head_dim x num_attention_heads (%lld) is above the %lld that tier "
				 "accepts", path, (long long)(c->head_dim * c->num_attention_heads),
				 (long long)TIER_HF_MAX_WIDTH);
	return 0;
}

/* Values that would make later arithmetic meaningless. */
static int check_sizes(const char *path, tier_hf_config *c)
{
	if (c->head_dim == 0 && c->num_attention_heads > 0)
		c->head_dim = c->hidden_size / c->num_attention_heads;
	if (c->num_hidden_layers < 1 || c->num_hidden_layers > TIER_HF_MAX_LAYERS)
		return tier_fail(-EBADMSG, "%s: num_hidden_layers %lld is outside 1..%d", path,
				 (long long)c->num_hidden_layers, TIER_HF_MAX_LAYERS);
	if (c->hidden_size < 1 || c->num_attention_heads < 1 || c->num_key_value_heads < 1 ||
	    c->num_attention_heads % c->num_key_value_heads || c->head_dim < 1 || c->vocab_size < 1)
		return tier_fail(-EBADMSG, "%s: hidden_size, heads (a multiple of num_key_value_heads), "
				 "head_dim and vocab_size must be positive", path);
	if (c->num_experts < 1 || c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->num_experts ||
	    c->decoder_sparse_step < 1 || c->moe_intermediate_size < 1)
		return tier_fail(-EBADMSG, "%s: need num_experts >= num_experts_per_tok >= 1, "
				 "decoder_sparse_step >= 1 and a positive expert intermediate size", path);
	if (!(c->rms_norm_eps > 0) || !(c->rope_theta > 0))
		return tier_fail(-EBADMSG, "%s: rms_norm_eps and rope_theta must be positive", path);
	return check_limits(path, c);
}

static int load_root(const char *path, json_t *root, tier_hf_config *c)
{
	json_t *mt = json_object_get(root, "model_type");
	const struct field *fields;
	if (!json_is_object(root))
		return tier_fail(-EBADMSG, "%s: not a JSON object", path);
	if (!json_is_string(mt))
		return tier_fail(-EBADMSG, "%s: required key \"model_type\" is missing or not a string", path);
	const char *type = json_string_value(mt);
	if (strcmp(type, "qwen3_moe") == 0)
		fields = qwen3_moe;
	else if (strcmp(type, "mixtral") == 0)
		fields = mixtral;
	else
		return tier_fail(-ENOTSUP, "%s: model_type \"%s\" is not supported (supported: qwen3_moe, "
				 "mixtral)", path, type);
	memset(c, 0, sizeof *c);
	snprintf(c->model_type, sizeof c->model_type, "%s", type);
	for (const struct field *f = fields; f->key; f++) {
		int rc = load_field(path, root, f, c);
		if (rc < 0)
			return rc;
	}
	if (fields == mixtral) {   /* top-k then softmax over the chosen k: always normalised */
		c->moe_intermediate_size = c->intermediate_size;
		c->norm_topk_prob = 1;
		c->decoder_sparse_step = 1;
	}
	int rc = load_dtype(path, root, c);
	if (rc == 0)
		rc = load_rope(path, root, c);
	if (rc == 0)
		rc = check_sizes(path, c);
	if (rc == 0 && fields == qwen3_moe)
		rc = load_mlp_only(path, root, c);
	return rc;
}

int tier_hf_config_load(const char *path, tier_hf_config *out)
{
	char *text;
	json_error_t err;
	int rc = tier_read_text_file(path, 64u << 20, &text);
	if (rc < 0)
		return rc;
	json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &err);
	free(text);
	if (!root)
		return tier_fail(-EBADMSG, "%s: not valid JSON: %s (line %d, column %d)", path, err.text,
				 err.line, err.column);
	tier_hf_config *c = malloc(sizeof *c);
	rc = c ? load_root(path, root, c) : tier_fail(-ENOMEM, "out of memory");
	if (rc == 0)
		*out = *c;
	free(c);
	json_decref(root);
	return rc;
}

#else

int tier_hf_config_load(const char *path, tier_hf_config *out)
{
	return tier_st_no_jansson(path);
}

#endif
