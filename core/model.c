/* model.c - the qwen3_moe model as store objects: creation, LoRA groups, random init, pinning. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core_internal.h"
#include "core/ops_cuda.h"
#include "tier/formats.h"

static const char *const slot_names[W_NSLOTS] = {
	"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
	"self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate", "mlp.gate_proj",
	"mlp.up_proj", "mlp.down_proj",
};

void model_slot_name(const tier_model *m, int l, int slot, char *buf, size_t len)
{
	const char *n = m->mixtral && slot == W_ROUTER ? "block_sparse_moe.gate" : slot_names[slot];
	snprintf(buf, len, "model.layers.%d.%s.weight", l, n);
}

int model_slot_shape(const tier_model *m, int l, int slot, int *rows, int *cols)
{
	int moe = m->layers ? m->layers[l].moe : tier_hf_layer_is_moe(&m->cfg, l), q = m->nh * m->hd, kv = m->nkv * m->hd;
	int r = 0, c = 0;
	switch (slot) {
	case W_LN1: case W_LN2: r = m->H; break;
	case W_QN: case W_KN: r = m->mixtral ? 0 : m->hd; break;
	case W_Q: r = q; c = m->H; break;
	case W_K: case W_V: r = kv; c = m->H; break;
	case W_O: r = m->H; c = q; break;
	case W_ROUTER: if (moe) { r = m->E; c = m->H; } break;
	case W_GATE: case W_UP: if (!moe) { r = m->I; c = m->H; } break;
	case W_DOWN: if (!moe) { r = m->H; c = m->I; } break;
	}
	*rows = r;
	*cols = c;
	return r > 0;
}

void tier_lora_cfg_init(tier_lora_cfg *c)
{
	memset(c, 0, sizeof *c);
	c->r = 8;
	c->alpha = 16.0f;
	c->targets = TIER_LORA_Q | TIER_LORA_K | TIER_LORA_V | TIER_LORA_O | TIER_LORA_EXPERTS;
}

int tier_lora_targets_parse(const char *list, unsigned *out)
{
	static const struct { const char *name; unsigned bits; } words[] = {
		{ "q", TIER_LORA_Q }, { "k", TIER_LORA_K }, { "v", TIER_LORA_V }, { "o", TIER_LORA_O },
		{ "mlp", TIER_LORA_MLP }, { "experts", TIER_LORA_EXPERTS },
		{ "attn", TIER_LORA_Q | TIER_LORA_K | TIER_LORA_V | TIER_LORA_O }, { "all", 0x3f },
	};
	if (!list || !out)
		return tier_fail(-EINVAL, "tier_lora_targets_parse: NULL argument");
	unsigned bits = 0;
	const char *p = list;
	while (*p) {
		size_t n = strcspn(p, ",");
		size_t i;
		for (i = 0; i < sizeof words / sizeof words[0]; i++)
			if (strlen(words[i].name) == n && !strncmp(p, words[i].name, n))
				break;
		if (i == sizeof words / sizeof words[0])
			return tier_fail(-EINVAL, "LoRA target \"%.*s\" is unknown; use a comma-separated list of q, k, v, "
					 "o, mlp, experts (or attn, all)", (int)n, p);
		bits |= words[i].bits;
		p += n + (p[n] == ',');
	}
	if (!bits)
		return tier_fail(-EINVAL, "LoRA target list \"%s\" is empty; name at least one of q,k,v,o,mlp,experts", list);
	*out = bits;
	return 0;
}

void tier_model_config_default(tier_hf_config *c)
{
	memset(c, 0, sizeof *c);
	strcpy(c->model_type, "qwen3_moe");
	c->hidden_size = 128;
	c->intermediate_size = 192;
	c->moe_intermediate_size = 128;
	c->num_hidden_layers = 6;
	c->num_attention_heads = 4;
	c->num_key_value_heads = 2;
	c->head_dim = 32;
	c->vocab_size = TIER_BYTE_VOCAB;
	c->max_position_embeddings = 4096;
	c->num_experts = 16;
	c->num_experts_per_tok = 2;
	c->decoder_sparse_step = 1;
	c->rms_norm_eps = 1e-6;
	c->rope_theta = 10000.0;
	c->router_aux_loss_coef = 0.001;
	c->norm_topk_prob = 1;
	c->tie_word_embeddings = 1;
	c->dtype = TIER_DT_F32;
	c->mlp_only[0] = 1ull << 3;
}

static int check_config(const tier_hf_config *c)
{
	if (strcmp(c->model_type, "qwen3_moe") && strcmp(c->model_type, "mixtral"))
		return tier_fail(-ENOTSUP, "model_type \"%s\" is not supported by the trainer; it trains qwen3_moe and "
				 "mixtral", c->model_type);
	if (c->hidden_size < 1 || c->num_hidden_layers < 1 || c->num_attention_heads < 1 || c->num_key_value_heads < 1 ||
	    c->head_dim < 2 || c->head_dim % 2 || c->vocab_size < 2 || c->num_attention_heads % c->num_key_value_heads ||
	    c->num_hidden_layers > TIER_HF_MAX_LAYERS || c->hidden_size > (1 << 20) || c->vocab_size > (1 << 24))
		return tier_fail(-EINVAL, "model config: hidden_size, layers, heads (a multiple of the KV heads), an even "
				 "head_dim and vocab_size must be positive and sane");
	for (int l = 0; l < c->num_hidden_layers; l++) {
		int moe = tier_hf_layer_is_moe(c, l);
		if (moe && (c->num_experts > TIER_MOE_MAX_EXPERTS || c->num_experts_per_tok < 1 ||
			    c->num_experts_per_tok > c->num_experts || c->num_experts_per_tok > TIER_MOE_MAX_TOPK ||
			    c->moe_intermediate_size < 1))
			return tier_fail(-EINVAL, "model config: layer %d is MoE but num_experts %lld / top-k %lld / "
					 "moe_intermediate_size %lld are not usable", l, (long long)c->num_experts,
					 (long long)c->num_experts_per_tok, (long long)c->moe_intermediate_size);
		if (!moe && c->intermediate_size < 1)
			return tier_fail(-EINVAL, "model config: layer %d has a dense MLP but intermediate_size is %lld",
					 l, (long long)c->intermediate_size);
	}
	return 0;
}

static int check_lora(const tier_lora_cfg *l)
{
	if (l->r < 1 || l->r > 4096 || !isfinite(l->alpha) || l->alpha <= 0 || !(l->init_b_std >= 0))
		return tier_fail(-EINVAL, "LoRA: r %d must be 1..4096 and lora_alpha %g positive", l->r, l->alpha);
	if (!(l->targets & 0x3f))
		return tier_fail(-EINVAL, "LoRA: no target modules; name some of q,k,v,o,mlp,experts");
	if (!(l->dropout >= 0.0f && l->dropout < 1.0f))
		return tier_fail(-EINVAL, "LoRA dropout %g must be in [0, 1)", l->dropout);
	if (l->dropout > 0 && (l->targets & TIER_LORA_EXPERTS))
		return tier_fail(-ENOTSUP, "LoRA dropout %g on expert projections: not supported (PEFT's LoRA on fused "
				 "experts takes none either); drop experts from --lora-targets or use --lora-dropout 0",
				 l->dropout);
	return 0;
}

static int new_obj(tier_model *m, uint64_t bytes, tier_class cls, unsigned flags, tier_object **o)
{
	int rc = tier_obj_create(m->s, bytes, cls, flags, o);
	if (!rc && (flags & TIER_OBJ_FROZEN))
		m->base_bytes += bytes;
	return rc;
}

static void add_mod(tier_model *m, lora_group *g, int proj, const char *name, int in, int out)
{
	lora_mod *md = &g->mods[g->n_mods];
	snprintf(md->name, sizeof md->name, "%s", name);
	md->proj = proj;
	md->in = in;
	md->out = out;
	md->a = g->n;
	md->b = g->n + (size_t)m->lora.r * in;
	g->n = md->b + (size_t)out * m->lora.r;
	g->idx[proj] = g->n_mods++;
}

/* Lay out every LoRA group (before any object exists, so that they can be counted). */
static int plan_groups(tier_model *m)
{
	static const char *const ap[4] = { "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj" };
	static const char *const mp[3] = { "gate_proj", "up_proj", "down_proj" }, *const mx[3] = { "w1", "w3", "w2" };
	unsigned t = m->lora.targets;
	size_t cap = (size_t)m->L * (2 + (size_t)m->E), n = 0;
	if (!(m->groups = calloc(cap, sizeof *m->groups)))
		return tier_fail(-ENOMEM, "out of memory for %zu LoRA groups", cap);
	int qd = m->nh * m->hd, kvd = m->nkv * m->hd;
	int ins[4] = { m->H, m->H, m->H, qd }, outs[4] = { qd, kvd, kvd, m->H };
	for (int l = 0; l < m->L; l++) {
		int moe = m->layers[l].moe;
		if (t & 0xf) {
			lora_group *g = &m->groups[n++];
			memset(g->idx, -1, sizeof g->idx);
			g->layer = l, g->kind = LG_ATTN;
			for (int p = 0; p < 4; p++)
				if (t & (1u << p))
					add_mod(m, g, p, ap[p], ins[p], outs[p]);
		}
		int I = moe ? m->Ie : m->I;
		int kinds = moe ? (t & TIER_LORA_EXPERTS ? m->E : 0) : (t & TIER_LORA_MLP ? 1 : 0);
		for (int e = 0; e < kinds; e++) {
			lora_group *g = &m->groups[n++];
			memset(g->idx, -1, sizeof g->idx);
			g->layer = l, g->kind = moe ? LG_EXPERT : LG_MLP, g->expert = moe ? e : -1;
			for (int p = 0; p < 3; p++) {
				char name[64];
				if (moe && m->mixtral)
					snprintf(name, sizeof name, "block_sparse_moe.experts.%d.%s", e, mx[p]);
				else if (moe)
					snprintf(name, sizeof name, "mlp.experts.%d.%s", e, mp[p]);
				else
					snprintf(name, sizeof name, "mlp.%s", mp[p]);
				add_mod(m, g, p, name, p == P_DOWN ? I : m->H, p == P_DOWN ? m->H : I);
			}
		}
	}
	m->n_groups = n;
	return 0;
}

static uint64_t name_hash(uint64_t seed, const char *s)
{
	uint64_t h = 1469598103934665603ull ^ seed * 0x9e3779b97f4a7c15ull;
	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	return h;
}

static void fill_normal(float *p, size_t n, uint64_t seed, const char *name, double std)
{
	tier_rng r;
	tier_rng_seed(&r, name_hash(seed, name));
	for (size_t i = 0; i < n; i++)
		p[i] = (float)(std * tier_rng_normal(&r));
}

/* PEFT: A kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); B zeros (or N(0, init_b_std)).
 * Made on the host (h: g->n floats), the same values on every device. */
static void lora_values(const tier_model *m, const lora_group *g, float *h)
{
	for (int j = 0; j < g->n_mods; j++) {
		const lora_mod *md = &g->mods[j];
		char key[96];
		snprintf(key, sizeof key, "%d.%s.lora_A", g->layer, md->name);
		tier_rng r;
		tier_rng_seed(&r, name_hash(m->lora.seed, key));
		double bound = 1.0 / sqrt((double)md->in);
		for (size_t q = 0; q < (size_t)m->lora.r * md->in; q++)
			h[md->a + q] = (float)((2.0 * tier_rng_uniform(&r) - 1.0) * bound);
		snprintf(key, sizeof key, "%d.%s.lora_B", g->layer, md->name);
		fill_normal(h + md->b, (size_t)md->out * m->lora.r, m->lora.seed, key, m->lora.init_b_std);
	}
}

static int init_lora(tier_model *m)
{
	size_t most = 0;
	for (size_t i = 0; i < m->n_groups; i += m->groups[i].n_members)
		most = m->groups[i].n_total > most ? m->groups[i].n_total : most;
	float *h = malloc(sizeof(float) * (most ? most : 1));
	if (!h)
		return tier_fail(-ENOMEM, "out of memory for LoRA initial values (%zu floats)", most);
	int rc = 0;
	for (size_t i = 0; i < m->n_groups && !rc; i += m->groups[i].n_members) {
		lora_group *own = &m->groups[i];
		pinset ps = { .s = m->s };
		float *p, *o;
		if (!(rc = pin(&ps, own->param, TIER_ACQ_INIT, 1, &p)) && !(rc = pin(&ps, own->optim, TIER_ACQ_INIT, 1, &o))) {
			for (int j = 0; j < own->n_members; j++) {
				lora_values(m, own + j, h + own[j].off);
				own[j].t = 0;
			}
			if (!(rc = core_put(m, p, h, sizeof(float) * own->n_total)) &&
			    !(rc = tier_dev_memset(m->dev, o, 0, sizeof(float) * 2 * own->n_total)))
				rc = tier_dev_sync(m->dev);
		}
		int r2 = pin_release_all(&ps);
		rc = rc ? rc : r2;
		if (rc == -ENOSPC) {
			char a[32];
			rc = tier_fail(rc, "%s; raise --hbm: a layer's LoRA set (%s of parameters and 2x that of AdamW "
				       "moments) is made in HBM", tier_last_error(),
				       tier_format_size(sizeof(float) * own->n_total, a, sizeof a));
		}
	}
	free(h);
	return rc;
}

/* Groups i.. (the attention or MLP group alone, or all the expert groups of a layer) get one set
 * of objects, owned by group i, each member at its offset. */
static int share_objects(tier_model *m, size_t i)
{
	lora_group *own = &m->groups[i];
	size_t end = i + 1, total = own->n;
	own->off = 0;
	while (own->kind == LG_EXPERT && end < m->n_groups && m->groups[end].kind == LG_EXPERT &&
	       m->groups[end].layer == own->layer) {
		m->groups[end].off = total;
		total += m->groups[end++].n;
	}
	own->n_members = (int)(end - i), own->n_total = total;
	own->own = own; /* set first: a failure below leaves the owner's objects to tier_model_destroy */
	int rc;
	if ((rc = tier_obj_create(m->s, sizeof(float) * total, TIER_CLASS_LORA, 0, &own->param)) ||
	    (rc = tier_obj_create(m->s, sizeof(float) * total, TIER_CLASS_LORA, 0, &own->grad)) ||
	    (rc = tier_obj_create(m->s, sizeof(float) * 2 * total, TIER_CLASS_OPTIM, 0, &own->optim)))
		return rc;
	for (size_t j = i; j < end; j++) {
		lora_group *g = &m->groups[j];
		g->own = own, g->param = own->param, g->grad = own->grad, g->optim = own->optim;
	}
	return 0;
}

static int create_objects(tier_model *m)
{
	int rc, rows, cols;
	uint64_t esz = m->wsz * 3 * (uint64_t)m->Ie * m->H, w = m->wsz;
	if ((rc = new_obj(m, w * m->V * m->H, TIER_CLASS_DENSE, TIER_OBJ_FROZEN, &m->embed)) ||
	    (rc = new_obj(m, w * m->H, TIER_CLASS_DENSE, TIER_OBJ_FROZEN, &m->norm)))
		return rc;
	if (m->cfg.tie_word_embeddings)
		m->lm_head = m->embed;
	else if ((rc = new_obj(m, w * m->V * m->H, TIER_CLASS_DENSE, TIER_OBJ_FROZEN, &m->lm_head)))
		return rc;
	for (int l = 0; l < m->L; l++) {
		model_layer *ly = &m->layers[l];
		for (int s = 0; s < W_NSLOTS; s++)
			if (model_slot_shape(m, l, s, &rows, &cols) &&
			    (rc = new_obj(m, w * rows * (cols ? cols : 1), TIER_CLASS_DENSE,
					  TIER_OBJ_FROZEN, &ly->w[s])))
				return rc;
		if (!ly->moe)
			continue;
		if (!(ly->experts = calloc((size_t)m->E, sizeof *ly->experts)) ||
		    !(ly->exp = calloc((size_t)m->E, sizeof *ly->exp)))
			return tier_fail(-ENOMEM, "out of memory for the expert table of layer %d", l);
		for (int e = 0; e < m->E; e++)
			if ((rc = new_obj(m, esz, TIER_CLASS_EXPERT, TIER_OBJ_FROZEN, &ly->experts[e])))
				return rc;
	}
	for (size_t i = 0; i < m->n_groups; i++) {
		lora_group *g = &m->groups[i];
		model_layer *ly = &m->layers[g->layer];
		if (g->kind == LG_ATTN)
			ly->attn = g;
		else if (g->kind == LG_MLP)
			ly->mlp = g;
		else
			ly->exp[g->expert] = g;
		m->lora_n += g->n;
	}
	for (size_t i = 0; i < m->n_groups; i += m->groups[i].n_members)
		if ((rc = share_objects(m, i)))
			return rc;
	return init_lora(m);
}

static int model_check_dev(tier_dev *dev)
{
	if (!dev)
		return tier_fail(-EINVAL, "tier_model_create: device context is NULL; open one with tier_dev_open");
#ifndef TIER_HAVE_CUDA
	if (tier_dev_kind_of(dev) != TIER_DEV_CPU)
		return tier_fail(-ENOTSUP, "tier_model_create: this build has no CUDA; rebuild with --with-cuda or use a "
				 "CPU context (--device cpu)");
#endif
	return 0;
}

int tier_model_create(tier_store *s, tier_dev *dev, const tier_hf_config *cfg, const tier_lora_cfg *lora,
		      tier_model **out)
{
	if (!out)
		return tier_fail(-EINVAL, "tier_model_create: out is NULL");
	*out = NULL;
	if (!s || !cfg || !lora)
		return tier_fail(-EINVAL, "tier_model_create: store, config and LoRA settings are required");
	int rc = model_check_dev(dev);
	if (rc || (rc = check_config(cfg)) || (rc = check_lora(lora)))
		return rc;
	tier_model *m = calloc(1, sizeof *m);
	if (!m)
		return tier_fail(-ENOMEM, "out of memory for the model");
	m->s = s, m->dev = dev, m->cfg = *cfg, m->lora = *lora;
	m->cuda = tier_dev_kind_of(dev) == TIER_DEV_CUDA;
	m->wsz = m->cuda ? 2 : sizeof(float);
	m->scale = lora->use_rslora ? lora->alpha / sqrtf((float)lora->r) : lora->alpha / (float)lora->r;
	m->L = (int)cfg->num_hidden_layers, m->H = (int)cfg->hidden_size, m->nh = (int)cfg->num_attention_heads;
	m->nkv = (int)cfg->num_key_value_heads, m->hd = (int)cfg->head_dim, m->I = (int)cfg->intermediate_size;
	m->Ie = (int)cfg->moe_intermediate_size, m->E = (int)cfg->num_experts, m->k = (int)cfg->num_experts_per_tok;
	m->mixtral = !strcmp(cfg->model_type, "mixtral");
	m->V = (int)cfg->vocab_size, m->eps = (float)cfg->rms_norm_eps, m->theta = (float)cfg->rope_theta;
	if (!(m->layers = calloc((size_t)m->L, sizeof *m->layers))) {
		free(m);
		return tier_fail(-ENOMEM, "out of memory for the model's layers");
	}
	for (int l = 0; l < m->L; l++)
		m->layers[l].moe = tier_hf_layer_is_moe(cfg, l);
	if ((rc = plan_groups(m)) || (rc = create_objects(m))) {
		tier_model_destroy(m);
		return rc;
	}
	*out = m;
	return 0;
}

static void obj_free(tier_store *s, tier_object *o)
{
	if (o)
		tier_obj_destroy(s, o);
}

void tier_model_destroy(tier_model *m)
{
	if (!m)
		return;
	obj_free(m->s, m->embed);
	obj_free(m->s, m->norm);
	if (m->lm_head != m->embed)
		obj_free(m->s, m->lm_head);
	for (int l = 0; m->layers && l < m->L; l++) {
		model_layer *ly = &m->layers[l];
		for (int s = 0; s < W_NSLOTS; s++)
			obj_free(m->s, ly->w[s]);
		for (int e = 0; ly->experts && e < m->E; e++)
			obj_free(m->s, ly->experts[e]);
		free(ly->experts);
		free(ly->exp);
	}
	for (size_t i = 0; m->groups && i < m->n_groups; i++) {
		if (m->groups[i].own != &m->groups[i])
			continue; /* a member: the owner frees the shared objects */
		obj_free(m->s, m->groups[i].param);
		obj_free(m->s, m->groups[i].grad);
		obj_free(m->s, m->groups[i].optim);
	}
	free(m->groups);
	free(m->layers);
	free(m);
}

const tier_hf_config *tier_model_config(const tier_model *m) { return &m->cfg; }
uint64_t tier_model_base_bytes(const tier_model *m) { return m->base_bytes; }
uint64_t tier_model_lora_params(const tier_model *m) { return m->lora_n; }

/* On CUDA the host values of one object are staged here, rounded to bf16 and copied over. */
static int put_bf16(tier_model *m, void *dst, const float *h, size_t n)
{
	uint16_t *b = malloc(2 * (n ? n : 1));
	if (!b)
		return tier_fail(-ENOMEM, "out of host memory to convert %zu values to bf16", n);
	int rc = tier_dtype_convert(b, TIER_DT_BF16, h, TIER_DT_F32, n);
	if (!rc)
		rc = core_put(m, dst, b, 2 * n);
	free(b);
	return rc;
}

static int fill_obj(tier_model *m, tier_object *o, const char *name, fill_fn fn, fill_dev_fn dfn, void *arg)
{
	pinset ps = { .s = m->s };
	float *p, *h = NULL;
	size_t n = tier_obj_size(o) / m->wsz;
	int rc = pin(&ps, o, TIER_ACQ_INIT, 1, &p);
	if (rc)
		return rc;
	if (m->cuda && dfn) {
		if (!(rc = dfn(m, p, n, name, arg)))
			rc = tier_dev_sync(m->dev);
	} else if (m->cuda) {
		if (!(h = malloc(sizeof(float) * (n ? n : 1))))
			rc = tier_fail(-ENOMEM, "out of host memory to stage %s (%zu values)", name, n);
		else if (!(rc = fn(m, h, n, name, arg)))
			rc = put_bf16(m, p, h, n);
		free(h);
	} else {
		rc = fn(m, p, n, name, arg);
	}
	if (rc) {
		ps.dirty[0] = 1; /* the store wants INIT copies released dirty; the model stays unusable */
		pin_release_all(&ps);
		return rc;
	}
	return pin_release_all(&ps);
}

void tier_model_set_progress(tier_model *m, tier_progress_fn fn, void *arg)
{
	if (m)
		m->progress = fn, m->progress_arg = arg;
}

/* fill_obj, then the progress callback with the bytes filled so far; the callback may stop the fill. */
static int fill_next(tier_model *m, tier_object *o, const char *name, fill_fn fn, fill_dev_fn dfn, void *arg,
		     uint64_t *done)
{
	int rc = fill_obj(m, o, name, fn, dfn, arg);
	if (!rc && m->progress) {
		*done += tier_obj_size(o);
		if (m->progress(*done, m->base_bytes, m->progress_arg))
			return tier_fail(-ECANCELED, "filling the base weights: stopped by the caller after %s",
					 name);
	}
	return rc;
}

/* Walk every frozen object with its HF name (experts: "model.layers.L.mlp.experts.E"). */
int model_fill_all(tier_model *m, fill_fn fn, fill_dev_fn dfn, void *arg)
{
	char name[128];
	uint64_t done = 0;
	int rc;
	m->have_data = 0;
	if ((rc = fill_next(m, m->embed, "model.embed_tokens.weight", fn, dfn, arg, &done)) ||
	    (rc = fill_next(m, m->norm, "model.norm.weight", fn, dfn, arg, &done)) ||
	    (m->lm_head != m->embed && (rc = fill_next(m, m->lm_head, "lm_head.weight", fn, dfn, arg, &done))))
		return rc;
	for (int l = 0; l < m->L; l++) {
		model_layer *ly = &m->layers[l];
		for (int s = 0; s < W_NSLOTS; s++) {
			if (!ly->w[s])
				continue;
			model_slot_name(m, l, s, name, sizeof name);
			if ((rc = fill_next(m, ly->w[s], name, fn, dfn, arg, &done)))
				return rc;
		}
		for (int e = 0; ly->moe && e < m->E; e++) {
			snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d", l, e);
			if ((rc = fill_next(m, ly->experts[e], name, fn, dfn, arg, &done)))
				return rc;
		}
	}
	m->have_data = 1;
	return 0;
}

struct rand_arg { uint64_t seed; double std; };
static int fill_random(tier_model *m, float *p, size_t n, const char *name, void *arg)
{
	const struct rand_arg *ra = arg;
	if (strstr(name, "norm")) {
		for (size_t i = 0; i < n; i++)
			p[i] = 1.0f;
		return 0;
	}
	fill_normal(p, n, ra->seed, name, ra->std);
	return 0;
}

/* On CUDA the weights are generated on the device (a 30B model would take minutes on the host):
 * a counter-based generator keyed by the tensor's name, so the values differ from the CPU's but
 * are as deterministic. */
static int fill_random_dev(tier_model *m, void *p, size_t n, const char *name, void *arg)
{
	const struct rand_arg *ra = arg;
	if (strstr(name, "norm"))
		return opsc_fill_const(m->dev, n, 1.0f, p);
	return opsc_fill_normal(m->dev, n, name_hash(ra->seed, name), (float)ra->std, p);
}

int tier_model_init_random(tier_model *m, uint64_t seed, double init_range)
{
	if (!m || !(init_range > 0) || !isfinite(init_range))
		return tier_fail(-EINVAL, "tier_model_init_random: a model and a positive init range are required");
	struct rand_arg ra = { seed, init_range };
	return model_fill_all(m, fill_random, fill_random_dev, &ra);
}

int core_put(const tier_model *m, void *dst, const void *src, size_t bytes)
{
	return tier_dev_memcpy_h2d(m->dev, dst, src, bytes);
}

int core_get(const tier_model *m, void *dst, const void *src, size_t bytes)
{
	return tier_dev_memcpy_d2h(m->dev, dst, src, bytes);
}

int pin(pinset *ps, tier_object *o, unsigned flags, int dirty, float **p)
{
	if (ps->n >= PIN_MAX)
		return tier_fail(-E2BIG, "one operation pins more than %d objects", PIN_MAX);
	void *addr;
	int rc = tier_acquire(ps->s, o, TIER_HBM, flags, &addr, NULL);
	if (rc)
		return rc;
	ps->obj[ps->n] = o;
	ps->init[ps->n] = (unsigned char)((flags & TIER_ACQ_INIT) != 0);
	ps->dirty[ps->n++] = (unsigned char)(dirty || (flags & TIER_ACQ_INIT));
	*p = addr;
	return 0;
}

int pin_release_all(pinset *ps)
{
	int first = 0;
	for (int i = ps->n - 1; i >= 0; i--) {
		int rc = tier_release(ps->s, ps->obj[i], TIER_HBM, ps->dirty[i]);
		if (rc && !first)
			first = rc;
	}
	ps->n = 0;
	return first;
}

int pin_fill_done_all(pinset *ps)
{
	int first = 0;
	for (int i = 0; i < ps->n; i++) {
		if (!ps->init[i])
			continue;
		int rc = tier_fill_done(ps->s, ps->obj[i], TIER_HBM);
		ps->init[i] = 0;
		if (rc && !first)
			first = rc;
	}
	return first;
}

void model_lora_ref(const tier_model *m, const lora_group *g, int proj, const float *param, float *grad,
		    tier_lora_ref *out)
{
	memset(out, 0, sizeof *out);
	if (!g || g->idx[proj] < 0 || !param)
		return;
	const lora_mod *md = &g->mods[g->idx[proj]];
	out->a = param + md->a;
	out->b = param + md->b;
	out->da = grad ? grad + md->a : NULL;
	out->db = grad ? grad + md->b : NULL;
	out->rank = m->lora.r;
	out->scale = m->scale;
}
