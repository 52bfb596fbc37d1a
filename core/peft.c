/* peft.c - LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors. */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "core/safetensors_int.h"

#define KEY_PREFIX "base_model.model.model.layers."

void tier_peft_free(tier_peft_adapter *a)
{
	if (!a)
		return;
	for (size_t i = 0; i < a->n_modules; i++) {
		free(a->modules[i].a);
		free(a->modules[i].b);
	}
	free(a->modules);
	free(a);
}

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>

static void key_name(char *buf, size_t len, const tier_peft_module *m, char half)
{
	snprintf(buf, len, KEY_PREFIX "%d.%s.lora_%c.weight", m->layer, m->module, half);
}

/* The last component of a module path ("mlp.experts.3.gate_proj" -> "gate_proj"). */
static const char *leaf(const char *module)
{
	const char *d = strrchr(module, '.');
	return d ? d + 1 : module;
}


/* ---- Save ------------------------------------------------------------------------------------ */

static int check_adapter(const char *dir, const tier_peft_adapter *a)
{
	if (a->r < 1)
		return tier_fail(-EINVAL, "%s: LoRA rank r = %d, must be >= 1", dir, a->r);
	if (a->dtype != TIER_DT_F32 && a->dtype != TIER_DT_BF16 && a->dtype != TIER_DT_F16)
		return tier_fail(-EINVAL, "%s: adapter dtype %s (F32, BF16 or F16)", dir, tier_dtype_name(a->dtype));
	for (size_t i = 0; i < a->n_modules; i++) {
		const tier_peft_module *m = &a->modules[i];
		size_t ml = strnlen(m->module, sizeof m->module);
		if (m->layer < 0 || ml == 0 || ml == sizeof m->module || m->module[0] == '.' ||
		    m->module[ml - 1] == '.' || m->in < 1 || m->out < 1 || !m->a || !m->b)
			return tier_fail(-EINVAL, "%s: module %zu (layer %d, '%.*s') needs a layer >= 0, a module "
					 "path, in/out >= 1 and both A and B", dir, i, m->layer,
					 (int)sizeof m->module, m->module);
	}
	return 0;
}

static json_t *targets_json(const tier_peft_adapter *a)
{
	json_t *t = json_array();
	for (int i = 0; i < a->n_targets; i++)
		json_array_append_new(t, json_string(a->target_modules[i]));
	for (size_t i = 0; a->n_targets == 0 && i < a->n_modules; i++) {
		const char *l = leaf(a->modules[i].module);
		size_t j, n = json_array_size(t);
		for (j = 0; j < n && strcmp(json_string_value(json_array_get(t, j)), l) != 0; j++)
			;
		if (j == n)
			json_array_append_new(t, json_string(l));
	}
	return t;
}

/* LoraConfig's fields as PEFT writes them (fields of newer PEFT versions are left out so older
 * versions load the file too; PEFT fills absent fields with their defaults). */
static char *config_json(const tier_peft_adapter *a)
{
	json_t *c = json_object();
	json_t *alpha = a->lora_alpha == (double)(long long)a->lora_alpha ?
			json_integer((json_int_t)a->lora_alpha) : json_real(a->lora_alpha);
	json_object_set_new(c, "alpha_pattern", json_object());
	json_object_set_new(c, "auto_mapping", json_null());
	json_object_set_new(c, "base_model_name_or_path", a->base_model[0] ? json_string(a->base_model) : json_null());
	json_object_set_new(c, "bias", json_string("none"));
	json_object_set_new(c, "fan_in_fan_out", json_false());
	json_object_set_new(c, "inference_mode", json_true());
	json_object_set_new(c, "init_lora_weights", json_true());
	json_object_set_new(c, "layer_replication", json_null());
	json_object_set_new(c, "layers_pattern", json_null());
	json_object_set_new(c, "layers_to_transform", json_null());
	json_object_set_new(c, "loftq_config", json_object());
	json_object_set_new(c, "lora_alpha", alpha);
	json_object_set_new(c, "lora_dropout", json_real(a->lora_dropout));
	json_object_set_new(c, "megatron_config", json_null());
	json_object_set_new(c, "megatron_core", json_string("megatron.core"));
	json_object_set_new(c, "modules_to_save", json_null());
	json_object_set_new(c, "peft_type", json_string("LORA"));
	json_object_set_new(c, "r", json_integer(a->r));
	json_object_set_new(c, "rank_pattern", json_object());
	json_object_set_new(c, "revision", json_null());
	json_object_set_new(c, "target_modules", targets_json(a));
	json_object_set_new(c, "task_type", json_string("CAUSAL_LM"));
	json_object_set_new(c, "use_dora", json_false());
	json_object_set_new(c, "use_rslora", a->use_rslora ? json_true() : json_false());
	char *s = json_dumps(c, JSON_INDENT(2) | JSON_SORT_KEYS);
	json_decref(c);
	return s;
}

/* adapter_config.json written into a temporary (*out, to commit or abort): first, so that a full
 * disk fails before the weights are written, and published after them. */
static int config_begin(const char *dir, const tier_peft_adapter *a, tier_atomic_file **out)
{
	char *path, *s = config_json(a);
	*out = NULL;
	if (!s || asprintf(&path, "%s/adapter_config.json", dir) < 0) {
		free(s);
		return tier_fail(-ENOMEM, "%s: out of memory", dir);
	}
	tier_atomic_file *f;
	int rc = tier_atomic_write_begin(path, &f);
	if (rc == 0)
		rc = tier_atomic_write(f, s, strlen(s));
	if (rc == 0)
		rc = tier_atomic_write(f, "\n", 1);
	if (rc == 0)
		*out = f;
	else
		tier_atomic_write_abort(f);
	free(s);
	free(path);
	return rc;
}

/* One tensor of the file: names and (for 16-bit output) converted copies. */
static int fill_tensor(const tier_peft_adapter *a, const tier_peft_module *m, int is_b, tier_st_wtensor *t,
		       char **name, void **conv)
{
	uint64_t rows = is_b ? (uint64_t)m->out : (uint64_t)a->r, cols = is_b ? (uint64_t)a->r : (uint64_t)m->in;
	const float *src = is_b ? m->b : m->a;
	*name = malloc(sizeof m->module + 64);
	if (!*name)
		return -ENOMEM;
	key_name(*name, sizeof m->module + 64, m, is_b ? 'B' : 'A');
	*t = (tier_st_wtensor){ .name = *name, .dtype = a->dtype, .ndim = 2, .shape = { rows, cols }, .data = src };
	if (a->dtype != TIER_DT_F32) {
		*conv = malloc(rows * cols * 2 + 1);
		if (!*conv)
			return -ENOMEM;
		tier_dtype_convert(*conv, a->dtype, src, TIER_DT_F32, rows * cols);
		t->data = *conv;
	}
	return 0;
}

static int write_weights(const char *dir, const tier_peft_adapter *a)
{
	static const char *const meta[] = { "format", "pt", NULL };
	size_t n = 2 * a->n_modules;
	tier_st_wtensor *t = calloc(n + 1, sizeof *t);
	char **names = calloc(n + 1, sizeof *names), *path = NULL;
	void **conv = calloc(n + 1, sizeof *conv);
	int rc = t && names && conv && asprintf(&path, "%s/adapter_model.safetensors", dir) >= 0 ? 0 : -ENOMEM;
	for (size_t i = 0; i < n && rc == 0; i++)
		rc = fill_tensor(a, &a->modules[i / 2], (int)(i % 2), &t[i], &names[i], &conv[i]);
	if (rc == -ENOMEM)
		tier_fail(rc, "%s: out of memory", dir);
	if (rc == 0)
		rc = tier_st_write(path, t, n, meta);
	for (size_t i = 0; names && conv && i < n; i++) {
		free(names[i]);
		free(conv[i]);
	}
	free(names);
	free(conv);
	free(t);
	free(path);
	return rc;
}

int tier_peft_save(const char *dir, const tier_peft_adapter *a)
{
	/* the config is written first and published last: a failure on the way leaves the old pair (or
	 * nothing); only a failure of the config's own commit (fsync, close, rename) after the weights
	 * are in place leaves new weights beside an old config */
	tier_atomic_file *cf = NULL;
	int rc = check_adapter(dir, a);
	if (rc == 0)
		rc = config_begin(dir, a, &cf);
	if (rc == 0)
		rc = write_weights(dir, a);   /* a duplicate module is caught here as a duplicate name */
	if (rc == 0)
		return tier_atomic_write_commit(cf);
	tier_atomic_write_abort(cf);
	return rc;
}

/* ---- Load ------------------------------------------------------------------------------------ */

static int load_config(const char *path, tier_peft_adapter *a)
{
	char *text;
	json_error_t err;
	int rc = tier_read_text_file(path, 16u << 20, &text);
	if (rc < 0)
		return rc;
	json_t *c = json_loads(text, JSON_REJECT_DUPLICATES, &err);
	free(text);
	if (!c || !json_is_object(c)) {
		json_decref(c);
		return tier_fail(-EBADMSG, "%s: not a JSON object (%s)", path, c ? "other JSON type" : err.text);
	}
	json_t *type = json_object_get(c, "peft_type"), *r = json_object_get(c, "r");
	json_t *alpha = json_object_get(c, "lora_alpha"), *rs = json_object_get(c, "use_rslora");
	json_t *drop = json_object_get(c, "lora_dropout"), *bias = json_object_get(c, "bias");
	json_t *tm = json_object_get(c, "target_modules"), *tp = json_object_get(c, "target_parameters");
	json_t *base = json_object_get(c, "base_model_name_or_path"), *x;
	size_t i;
	if (!json_is_string(type) || strcmp(json_string_value(type), "LORA") != 0)
		rc = tier_fail(json_is_string(type) ? -ENOTSUP : -EBADMSG, "%s: peft_type must be \"LORA\"", path);
	else if (!json_is_integer(r) || json_integer_value(r) < 1 || json_integer_value(r) > 65536)
		rc = tier_fail(-EBADMSG, "%s: \"r\" must be an integer in 1..65536", path);
	else if (!json_is_number(alpha))
		rc = tier_fail(-EBADMSG, "%s: \"lora_alpha\" must be a number", path);
	else if ((rs && !json_is_boolean(rs) && !json_is_null(rs)) || (drop && !json_is_number(drop)))
		rc = tier_fail(-EBADMSG, "%s: \"use_rslora\" must be true/false and \"lora_dropout\" a number", path);
	else if (bias && !(json_is_string(bias) && strcmp(json_string_value(bias), "none") == 0))
		rc = tier_fail(-ENOTSUP, "%s: \"bias\" other than \"none\" is not supported", path);
	else if (tp && !json_is_null(tp) && json_array_size(tp) > 0)
		rc = tier_fail(-ENOTSUP, "%s: \"target_parameters\" (LoRA on fused 3-D expert parameters) is "
			       "not supported; tier reads per-expert module targets", path);
	else if (json_is_array(tm) && json_array_size(tm) > 16)
		rc = tier_fail(-ENOTSUP, "%s: more than 16 target_modules", path);
	else if (!json_is_array(tm) && !json_is_string(tm))
		rc = tier_fail(-EBADMSG, "%s: \"target_modules\" must be a list of names or a string", path);
	json_array_foreach(tm, i, x)
		if (rc == 0 && (!json_is_string(x) || strlen(json_string_value(x)) >= sizeof a->target_modules[0]))
			rc = tier_fail(-EBADMSG, "%s: target_modules[%zu] must be a string of at most %zu bytes",
				       path, i, sizeof a->target_modules[0] - 1);
	if (rc == 0 && json_is_string(tm) && strlen(json_string_value(tm)) >= sizeof a->target_modules[0])
		rc = tier_fail(-ENOTSUP, "%s: target_modules pattern longer than %zu bytes", path,
			       sizeof a->target_modules[0] - 1);
	if (rc == 0) {
		a->r = (int)json_integer_value(r);
		a->lora_alpha = json_number_value(alpha);
		a->use_rslora = json_is_true(rs);
		a->lora_dropout = drop ? json_number_value(drop) : 0;
		a->dtype = TIER_DT_F32;
		snprintf(a->base_model, sizeof a->base_model, "%s", json_is_string(base) ? json_string_value(base) : "");
		if (json_is_string(tm))
			snprintf(a->target_modules[a->n_targets++], sizeof a->target_modules[0], "%s", json_string_value(tm));
		json_array_foreach(tm, i, x)
			snprintf(a->target_modules[a->n_targets++], sizeof a->target_modules[0], "%s",
				 json_string_value(x));
	}
	json_decref(c);
	return rc;
}

/* The base projection's (in, out) features from the model config; -ENOTSUP for an unknown module. */
static int expected_shape(const tier_hf_config *c, int layer, const char *module, int64_t *in, int64_t *out)
{
	int64_t H = c->hidden_size, Q = c->num_attention_heads * c->head_dim, KV = c->num_key_value_heads * c->head_dim;
	int64_t I = tier_hf_layer_is_moe(c, layer) ? c->moe_intermediate_size : c->intermediate_size;
	const char *l = leaf(module);
	int expert = -1, moe = strncmp(module, "mlp.experts.", 12) == 0 ||
			      strncmp(module, "block_sparse_moe.experts.", 25) == 0;
	if (moe) {
		const char *e = strstr(module, "experts.") + 8;
		char *end;
		long v = strtol(e, &end, 10);
		if (end == e || *end != '.' || v < 0 || v >= c->num_experts || !tier_hf_layer_is_moe(c, layer))
			return -EINVAL;
		expert = (int)v;
	}
	(void)expert;
	/* A dense MLP ("mlp.gate_proj") only on layers without experts (mlp_only_layers). */
	int dense = !moe && l == module + 4 && !strncmp(module, "mlp.", 4) && !tier_hf_layer_is_moe(c, layer);
	if (!strcmp(module, "self_attn.q_proj")) { *in = H; *out = Q; }
	else if (!strcmp(module, "self_attn.k_proj") || !strcmp(module, "self_attn.v_proj")) { *in = H; *out = KV; }
	else if (!strcmp(module, "self_attn.o_proj")) { *in = Q; *out = H; }
	else if (!strcmp(module, "mlp.gate") || !strcmp(module, "block_sparse_moe.gate")) { *in = H; *out = c->num_experts; }
	else if ((moe || dense) && (!strcmp(l, "gate_proj") || !strcmp(l, "up_proj") ||
		 !strcmp(l, "w1") || !strcmp(l, "w3"))) { *in = H; *out = I; }
	else if ((moe || dense) && (!strcmp(l, "down_proj") || !strcmp(l, "w2"))) { *in = I; *out = H; }
	else
		return -ENOTSUP;
	return 0;
}

/* Split "base_model.model.model.layers.L.MODULE.lora_X.weight" into L, MODULE and X. */
static int parse_key(const char *key, int *layer, char *module, size_t mlen, char *half)
{
	size_t pl = strlen(KEY_PREFIX), kl = strlen(key), sl = strlen(".lora_A.weight");
	char *end;
	if (strncmp(key, KEY_PREFIX, pl) != 0 || kl < pl + sl + 3)
		return -1;
	long L = strtol(key + pl, &end, 10);
	if (end == key + pl || *end != '.' || L < 0 || L > TIER_HF_MAX_LAYERS || key[pl] == '-' || key[pl] == '+')
		return -1;
	const char *suffix = key + kl - sl;
	if (strncmp(suffix, ".lora_", 6) != 0 || (suffix[6] != 'A' && suffix[6] != 'B') || strcmp(suffix + 7, ".weight"))
		return -1;
	size_t n = (size_t)(suffix - (end + 1));
	if (n == 0 || n >= mlen || end + 1 > suffix)
		return -1;
	memcpy(module, end + 1, n);
	module[n] = '\0';
	*layer = (int)L;
	*half = suffix[6];
	return 0;
}

static int load_half(const tier_st *st, const tier_st_tensor *t, float **dst)
{
	uint64_t n = tier_st_numel(t);
	*dst = malloc(n * sizeof(float) + 1);
	if (!*dst)
		return tier_fail(-ENOMEM, "%s: out of memory", tier_st_path(st));
	return tier_st_convert(st, t->name, *dst, TIER_DT_F32, (size_t)n);
}

/* Tensors come sorted by name through their A/B pair: collect them into modules. */
static int load_module(const tier_st *st, const tier_st_tensor *t, tier_peft_adapter *a,
		       const tier_hf_config *cfg)
{
	tier_peft_module m = { 0 };
	char half, mod2[sizeof m.module], half2;
	int layer2;
	const char *path = tier_st_path(st);
	if (parse_key(t->name, &m.layer, m.module, sizeof m.module, &half) < 0)
		return tier_fail(-EBADMSG, "%s: tensor '%s' is not a PEFT LoRA key (" KEY_PREFIX
				 "{L}.{module}.lora_A.weight / lora_B.weight)", path, t->name);
	if (half != 'A')
		return tier_fail(-EBADMSG, "%s: tensor '%s' (lora_B) has no lora_A", path, t->name);
	char bname[sizeof m.module + 64];
	key_name(bname, sizeof bname, &m, 'B');
	const tier_st_tensor *b = tier_st_find(st, bname);
	if (!b || parse_key(b->name, &layer2, mod2, sizeof mod2, &half2) < 0)
		return tier_fail(-EBADMSG, "%s: tensor '%s' has no matching '%s'", path, t->name, bname);
	if (t->ndim != 2 || b->ndim != 2 || t->shape[0] != (uint64_t)a->r || b->shape[1] != (uint64_t)a->r ||
	    t->shape[1] < 1 || b->shape[0] < 1 || t->shape[1] > INT32_MAX || b->shape[0] > INT32_MAX)
		return tier_fail(-EBADMSG, "%s: layer %d %s: lora_A must be [r=%d, in] and lora_B [out, r=%d]",
				 path, m.layer, m.module, a->r, a->r);
	if (t->dtype != TIER_DT_F32 && t->dtype != TIER_DT_BF16 && t->dtype != TIER_DT_F16)
		return tier_fail(-EBADMSG, "%s: tensor '%s' has dtype %s (F32, BF16 or F16)", path, t->name,
				 tier_dtype_name(t->dtype));
	m.in = (int64_t)t->shape[1];
	m.out = (int64_t)b->shape[0];
	if (cfg) {
		int64_t in, out;
		int rc = m.layer >= cfg->num_hidden_layers ? -EINVAL : expected_shape(cfg, m.layer, m.module, &in, &out);
		if (rc < 0)
			return tier_fail(rc == -ENOTSUP ? -ENOTSUP : -EBADMSG, "%s: layer %d %s: %s", path, m.layer,
					 m.module, rc == -ENOTSUP ? "a module tier does not know for this model" :
					 "no such layer or expert in the model config");
		if (in != m.in || out != m.out)
			return tier_fail(-EBADMSG, "%s: layer %d %s: A/B give in %lld, out %lld; the model "
					 "config says in %lld, out %lld", path, m.layer, m.module, (long long)m.in,
					 (long long)m.out, (long long)in, (long long)out);
	}
	a->dtype = t->dtype;
	tier_peft_module *slot = &a->modules[a->n_modules++];
	*slot = m;
	int rc = load_half(st, t, &slot->a);
	if (rc == 0)
		rc = load_half(st, b, &slot->b);
	return rc;
}

static int load_weights(const char *path, tier_peft_adapter *a, const tier_hf_config *cfg)
{
	tier_st *st;
	int rc = tier_st_open(path, &st);
	if (rc < 0)
		return rc;
	size_t n = tier_st_count(st), n_b = 0;
	a->modules = calloc(n / 2 + 1, sizeof *a->modules);
	if (!a->modules)
		rc = tier_fail(-ENOMEM, "%s: out of memory", path);
	for (size_t i = 0; i < n && rc == 0; i++) {
		const tier_st_tensor *t = tier_st_at(st, i);
		size_t l = strlen(t->name);
		if (l > 9 && strcmp(t->name + l - 9, "_B.weight") == 0 && strstr(t->name, ".lora_B.weight")) {
			n_b++;   /* checked as part of its A */
			continue;
		}
		if (a->n_modules >= n / 2 + 1)
			rc = tier_fail(-EBADMSG, "%s: more lora_A tensors than lora_B", path);
		else
			rc = load_module(st, t, a, cfg);
	}
	if (rc == 0 && n_b != a->n_modules)
		rc = tier_fail(-EBADMSG, "%s: %zu lora_B tensors for %zu lora_A tensors", path, n_b, a->n_modules);
	tier_st_close(st);
	return rc;
}

int tier_peft_load(const char *dir, const tier_hf_config *cfg, tier_peft_adapter **out)
{
	char *cpath = NULL, *wpath = NULL;
	*out = NULL;
	tier_peft_adapter *a = calloc(1, sizeof *a);
	if (!a || asprintf(&cpath, "%s/adapter_config.json", dir) < 0 ||
	    asprintf(&wpath, "%s/adapter_model.safetensors", dir) < 0) {
		free(cpath);
		free(a);
		return tier_fail(-ENOMEM, "%s: out of memory", dir);
	}
	int rc = load_config(cpath, a);
	if (rc == 0)
		rc = load_weights(wpath, a, cfg);
	free(cpath);
	free(wpath);
	if (rc < 0) {
		tier_peft_free(a);
		return rc;
	}
	*out = a;
	return 0;
}

#else

int tier_peft_save(const char *dir, const tier_peft_adapter *a)
{
	return tier_st_no_jansson(dir);
}

int tier_peft_load(const char *dir, const tier_hf_config *cfg, tier_peft_adapter **out)
{
	*out = NULL;
	return tier_st_no_jansson(dir);
}

#endif
