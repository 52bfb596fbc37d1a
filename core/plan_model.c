/* plan_model.c - model descriptions for tier-plan: presets, HF config.json, parameter counts. */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "tier/plan.h"

static void add_proj(tier_plan_attn *a, const char *name, int64_t in, int64_t out, unsigned target)
{
	tier_plan_proj *p = &a->proj[a->nproj++];
	snprintf(p->name, sizeof p->name, "%s", name);
	p->in = in;
	p->out = out;
	p->target = target;
}

/* Softmax attention with GQA: q, k, v, o; qk_norm adds Qwen3's per-head RMSNorm weights. */
static void gqa(tier_plan_attn *a, int64_t layers, int64_t h, int64_t heads, int64_t kv, int64_t hd, int qk_norm)
{
	memset(a, 0, sizeof *a);
	a->type = TIER_PLAN_ATTN_FULL;
	a->layers = layers;
	add_proj(a, "q_proj", h, heads * hd, TIER_PLAN_LORA_Q);
	add_proj(a, "k_proj", h, kv * hd, TIER_PLAN_LORA_K);
	add_proj(a, "v_proj", h, kv * hd, TIER_PLAN_LORA_V);
	add_proj(a, "o_proj", heads * hd, h, TIER_PLAN_LORA_O);
	a->extra_params = qk_norm ? 2 * hd : 0;
	a->heads = heads;
	a->dqk = a->dv = hd;
}

/* DeepSeek MLA (V3 sizes for H 7168): q low-rank 1536, kv low-rank 512 + rope 64, 128 heads of
 * qk 192 (128 nope + 64 rope) and v 128. LoRA letters: q covers q_a and q_b, k kv_a, v kv_b. */
static void mla(tier_plan_attn *a, int64_t layers, int64_t h)
{
	memset(a, 0, sizeof *a);
	a->type = TIER_PLAN_ATTN_FULL;
	a->layers = layers;
	add_proj(a, "q_a_proj", h, 1536, TIER_PLAN_LORA_Q);
	add_proj(a, "q_b_proj", 1536, 128 * 192, TIER_PLAN_LORA_Q);
	add_proj(a, "kv_a_proj", h, 512 + 64, TIER_PLAN_LORA_K);
	add_proj(a, "kv_b_proj", 512, 128 * (128 + 128), TIER_PLAN_LORA_V);
	add_proj(a, "o_proj", 128 * 128, h, TIER_PLAN_LORA_O);
	a->extra_params = 1536 + 512;   /* q_a_layernorm, kv_a_layernorm */
	a->heads = 128;
	a->dqk = 192;
	a->dv = 128;
}

/* The seeds' linear layers, Gated DeltaNet as in Qwen3-Next scaled to H 7168: 32 q/k heads of 128,
 * 64 v heads of 128, output gate z, per-head beta and decay (b, a), a depth-4 causal conv on q, k, v,
 * A_log and dt_bias per v head, a gated RMSNorm of 128. Chunked form with chunks of 64. */
static void gdn(tier_plan_attn *a, int64_t layers, int64_t h)
{
	memset(a, 0, sizeof *a);
	a->type = TIER_PLAN_ATTN_LINEAR;
	a->layers = layers;
	add_proj(a, "q_proj", h, 32 * 128, TIER_PLAN_LORA_Q);
	add_proj(a, "k_proj", h, 32 * 128, TIER_PLAN_LORA_K);
	add_proj(a, "v_proj", h, 64 * 128, TIER_PLAN_LORA_V);
	add_proj(a, "z_proj", h, 64 * 128, 0);
	add_proj(a, "b_proj", h, 64, 0);
	add_proj(a, "a_proj", h, 64, 0);
	add_proj(a, "o_proj", 64 * 128, h, TIER_PLAN_LORA_O);
	a->extra_params = 4 * (32 * 128 * 2 + 64 * 128) + 2 * 64 + 128;
	a->heads = 64;
	a->dqk = a->dv = 128;
	a->chunk = 64;
}

/* The seeds' sparse layers, DSA as in DeepSeek-V3.2: MLA plus a lightning indexer (64 heads of 128
 * from the q low-rank, one shared key of 128, per-head weights) that picks the top 2048 keys. */
static void dsa(tier_plan_attn *a, int64_t layers, int64_t h)
{
	mla(a, layers, h);
	a->type = TIER_PLAN_ATTN_SPARSE;
	add_proj(a, "idx_wq_b", 1536, 64 * 128, 0);
	add_proj(a, "idx_wk", h, 128, 0);
	add_proj(a, "idx_weights", h, 64, 0);
	a->extra_params += 2 * 128;     /* the indexer's key norm */
	a->topk = 2048;
	a->idx_heads = 64;
	a->idx_dim = 128;
}

static void base(tier_plan_model *m, const char *name, int64_t layers, int64_t h, int64_t vocab)
{
	memset(m, 0, sizeof *m);
	snprintf(m->name, sizeof m->name, "%s", name);
	m->layers = layers;
	m->hidden = h;
	m->vocab = vocab;
	m->lora_r = 32;
	m->lora_targets = TIER_PLAN_LORA_Q | TIER_PLAN_LORA_K | TIER_PLAN_LORA_V | TIER_PLAN_LORA_O;
	m->seq = 4096;
	m->mbs = 1;
}

static void moe(tier_plan_model *m, int64_t e, int64_t k, int64_t inter)
{
	m->experts = e;
	m->top_k = k;
	m->expert_inter = inter;
}

static void preset_qwen3_30b(tier_plan_model *m)
{
	base(m, "qwen3-30b-a3b", 48, 2048, 151936);
	gqa(&m->attn[0], 48, 2048, 32, 4, 128, 1);
	m->nattn = 1;
	moe(m, 128, 8, 768);
}

static void preset_qwen3_235b(tier_plan_model *m)
{
	base(m, "qwen3-235b-a22b", 94, 4096, 151936);
	gqa(&m->attn[0], 94, 4096, 64, 4, 128, 1);
	m->nattn = 1;
	moe(m, 128, 8, 1536);
}

static void preset_mixtral(tier_plan_model *m)
{
	base(m, "mixtral-8x7b", 32, 4096, 32000);
	gqa(&m->attn[0], 32, 4096, 32, 8, 128, 0);
	m->nattn = 1;
	moe(m, 8, 2, 14336);
}

static void preset_deepseek_v3(tier_plan_model *m)
{
	base(m, "deepseek-v3", 61, 7168, 129280);
	mla(&m->attn[0], 61, 7168);
	m->nattn = 1;
	m->dense_layers = 3;
	m->dense_inter = 18432;
	moe(m, 256, 8, 2048);
	m->shared_experts = 1;
	m->shared_inter = 2048;
	snprintf(m->note, sizeof m->note, "MLA counted as plain projections (no MTP module); attention "
		 "FLOPs as full causal softmax with qk 192, v 128");
}

/* The seeds' case: 64 layers (48 Gated DeltaNet, 16 DSA top-2048: 3:1), H 7168, 896 routed experts
 * of I 2240, 16 active, vocab 163840 untied: 2.78e12 parameters. Our choice of shape; see plan.md. */
static void preset_seed(tier_plan_model *m)
{
	base(m, "seed-2.8t", 64, 7168, 163840);
	gdn(&m->attn[0], 48, 7168);
	dsa(&m->attn[1], 16, 7168);
	m->nattn = 2;
	moe(m, 896, 16, 2240);
	m->lora_targets |= TIER_PLAN_LORA_GATE;
	m->seq = 131072;
	snprintf(m->note, sizeof m->note, "shape chosen for tier-plan (layers, H, expert I, attention): "
		 "about 2.8e12 parameters as the seeds say; see docs/plan.md");
}

static const struct {
	const char *name;
	void (*fill)(tier_plan_model *m);
} presets[] = {
	{ "qwen3-30b-a3b", preset_qwen3_30b }, { "qwen3-235b-a22b", preset_qwen3_235b },
	{ "mixtral-8x7b", preset_mixtral }, { "deepseek-v3", preset_deepseek_v3 }, { "seed-2.8t", preset_seed },
};

int tier_plan_model_preset(const char *name, tier_plan_model *out)
{
	for (size_t i = 0; name && i < sizeof presets / sizeof presets[0]; i++)
		if (!strcmp(name, presets[i].name)) {
			presets[i].fill(out);
			return 0;
		}
	return tier_fail(-EINVAL, "unknown model '%s': give an HF config.json or one of qwen3-30b-a3b, "
			 "qwen3-235b-a22b, mixtral-8x7b, deepseek-v3, seed-2.8t", name ? name : "(null)");
}

static int from_hf(const tier_hf_config *c, const char *path, tier_plan_model *m)
{
	int64_t moe_layers = 0;
	for (int l = 0; l < (int)c->num_hidden_layers; l++)
		moe_layers += tier_hf_layer_is_moe(c, l) ? 1 : 0;
	base(m, path, c->num_hidden_layers, c->hidden_size, c->vocab_size);
	int64_t hd = c->head_dim > 0 ? c->head_dim : c->hidden_size / c->num_attention_heads;
	gqa(&m->attn[0], c->num_hidden_layers, c->hidden_size, c->num_attention_heads, c->num_key_value_heads,
	    hd, !strcmp(c->model_type, "qwen3_moe"));
	m->nattn = 1;
	m->tie_embeddings = c->tie_word_embeddings;
	moe(m, c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size);
	m->dense_layers = c->num_hidden_layers - moe_layers;
	m->dense_inter = c->intermediate_size;
	return tier_plan_model_check(m);
}

int tier_plan_model_from_hf(const tier_hf_config *c, const char *name, tier_plan_model *out)
{
	if (!c || !out)
		return tier_fail(-EINVAL, "tier_plan_model_from_hf: config and output are required");
	tier_plan_model m;
	int rc = from_hf(c, name ? name : "config", &m);
	if (!rc)
		*out = m;
	return rc;
}

int tier_plan_model_load(const char *name_or_path, tier_plan_model *out)
{
	if (!name_or_path)
		return tier_fail(-EINVAL, "no model: give a preset name or an HF config.json");
	if (!strchr(name_or_path, '/') && !strstr(name_or_path, ".json"))
		return tier_plan_model_preset(name_or_path, out);
	tier_hf_config *c = calloc(1, sizeof *c);
	if (!c)
		return tier_fail(-ENOMEM, "out of memory reading %s", name_or_path);
	int rc = tier_hf_config_load(name_or_path, c);
	tier_plan_model m;
	if (!rc)
		rc = from_hf(c, name_or_path, &m);
	free(c);
	if (!rc)
		*out = m;
	return rc;
}

#define BAD(field, ...) tier_fail(-EINVAL, "model %s: " field, m->name, ##__VA_ARGS__)

/* Sizes above these (far above any model's) would take the counts made of their products out of
 * 64 bits (tier_plan_count, the planner's bytes): the same limits as a config.json's. */
static int over(const tier_plan_model *m, const char *what, int64_t v, int64_t max)
{
	return v > max ? BAD("%s %lld is above the %lld that tier accepts", what, (long long)v, (long long)max) : 0;
}

static int check_limits(const tier_plan_model *m)
{
	const int64_t W = TIER_HF_MAX_WIDTH, H = TIER_HF_MAX_HEADS, BIG = 1ll << 32;
	const struct { const char *what; int64_t v, max; } lim[] = {
		{ "layers", m->layers, TIER_HF_MAX_LAYERS }, { "hidden size", m->hidden, W },
		{ "vocabulary", m->vocab, TIER_HF_MAX_VOCAB }, { "dense intermediate size", m->dense_inter, W },
		{ "experts", m->experts, TIER_HF_MAX_EXPERTS }, { "expert intermediate size", m->expert_inter, W },
		{ "shared experts", m->shared_experts, 256 }, { "shared expert intermediate size", m->shared_inter, W },
		{ "LoRA rank", m->lora_r, 1 << 14 }, { "sequence", m->seq, BIG }, { "micro-batch", m->mbs, BIG },
	};
	int rc = 0;
	for (size_t i = 0; i < sizeof lim / sizeof lim[0] && !rc; i++)
		rc = over(m, lim[i].what, lim[i].v, lim[i].max);
	for (int i = 0; i < m->nattn && !rc; i++) {
		const tier_plan_attn *a = &m->attn[i];
		rc = over(m, "attention heads", a->heads > a->idx_heads ? a->heads : a->idx_heads, H);
		rc = rc ? rc : over(m, "attention head dims", a->dqk > a->dv ? a->dqk : a->dv, W);
		rc = rc ? rc : over(m, "indexer head dim", a->idx_dim, W);
		rc = rc ? rc : over(m, "sparse attention top-k", a->topk, BIG);
		rc = rc ? rc : over(m, "linear attention chunk", a->chunk, BIG);
		rc = rc ? rc : over(m, "extra parameters a layer", a->extra_params, 1ll << 36);
		for (int p = 0; p < a->nproj && !rc; p++)
			rc = over(m, a->proj[p].name, a->proj[p].in > a->proj[p].out ? a->proj[p].in : a->proj[p].out, W);
	}
	return rc;
}

int tier_plan_model_check(const tier_plan_model *m)
{
	if (!m)
		return tier_fail(-EINVAL, "no model given");
	if (m->layers < 1 || m->hidden < 1 || m->vocab < 1)
		return BAD("layers, hidden size and vocabulary must be positive (%lld, %lld, %lld)",
			   (long long)m->layers, (long long)m->hidden, (long long)m->vocab);
	if (m->nattn < 1 || m->nattn > TIER_PLAN_MAX_ATTN)
		return BAD("needs 1 to %d attention kinds, not %d", TIER_PLAN_MAX_ATTN, m->nattn);
	int64_t n = 0;
	for (int i = 0; i < m->nattn; i++) {
		const tier_plan_attn *a = &m->attn[i];
		if (a->layers < 0 || a->nproj < 0 || a->nproj > TIER_PLAN_MAX_PROJ || a->heads < 1 || a->dqk < 1 ||
		    a->dv < 1 || a->extra_params < 0)
			return BAD("attention kind %d has a bad shape (layers, projections, heads, head dims)", i);
		if (a->type == TIER_PLAN_ATTN_SPARSE && (a->topk < 1 || a->idx_heads < 0 || a->idx_dim < 0))
			return BAD("sparse attention needs top-k >= 1");
		if (a->type == TIER_PLAN_ATTN_LINEAR && a->chunk < 1)
			return BAD("linear attention needs a chunk length >= 1");
		for (int p = 0; p < a->nproj; p++)
			if (a->proj[p].in < 1 || a->proj[p].out < 1)
				return BAD("projection %s has a non-positive size", a->proj[p].name);
		n += a->layers;
	}
	if (n != m->layers)
		return BAD("attention kinds cover %lld layers, the model has %lld", (long long)n, (long long)m->layers);
	if (m->dense_layers < 0 || m->dense_layers > m->layers || (m->dense_layers && m->dense_inter < 1))
		return BAD("dense layers must be 0..layers with a positive intermediate size");
	if (m->dense_layers < m->layers &&
	    (m->experts < 1 || m->top_k < 1 || m->top_k > m->experts || m->expert_inter < 1))
		return BAD("MoE layers need experts >= 1, 1 <= top-k <= experts and an intermediate size >= 1 "
			   "(%lld, %lld, %lld)", (long long)m->experts, (long long)m->top_k, (long long)m->expert_inter);
	if (m->shared_experts < 0 || (m->shared_experts && m->shared_inter < 1))
		return BAD("shared experts need a positive intermediate size");
	if (m->lora_r < 0 || m->seq < 1 || m->mbs < 1)
		return BAD("LoRA rank >= 0, sequence and micro-batch >= 1 (%d, %lld, %lld)", m->lora_r,
			   (long long)m->seq, (long long)m->mbs);
	return check_limits(m);
}

/* A SwiGLU MLP of intermediate size I: gate and up [I, H], down [H, I]; its LoRA at rank r. */
static uint64_t swiglu(int64_t h, int64_t i) { return 3 * (uint64_t)h * (uint64_t)i; }
static uint64_t swiglu_lora(int64_t h, int64_t i, int r, unsigned t)
{
	uint64_t per = (uint64_t)r * (uint64_t)(h + i);
	return per * (!!(t & TIER_PLAN_LORA_GATE) + !!(t & TIER_PLAN_LORA_UP) + !!(t & TIER_PLAN_LORA_DOWN));
}

int tier_plan_count(const tier_plan_model *m, tier_plan_params *out)
{
	int rc = tier_plan_model_check(m);
	if (rc)
		return rc;
	tier_plan_params p = { 0 };
	const int64_t h = m->hidden, moe_layers = m->layers - m->dense_layers;
	const unsigned t = m->lora_targets;
	const int r = m->lora_r;
	p.embed = (uint64_t)m->vocab * h;
	p.lm_head = m->tie_embeddings ? 0 : p.embed;
	uint64_t attn_mm = 0, lora_attn_max = 0, attn_max = 0;
	for (int i = 0; i < m->nattn; i++) {
		const tier_plan_attn *a = &m->attn[i];
		uint64_t per = 0, lora = 0;
		for (int k = 0; k < a->nproj; k++) {
			per += (uint64_t)a->proj[k].in * a->proj[k].out;
			if (a->proj[k].target & t)
				lora += (uint64_t)r * (a->proj[k].in + a->proj[k].out);
		}
		p.attn[i] = (per + a->extra_params) * a->layers;
		attn_mm += per * a->layers;
		p.lora += lora * a->layers;
		if (a->layers) {
			lora_attn_max = lora > lora_attn_max ? lora : lora_attn_max;
			attn_max = per + a->extra_params > attn_max ? per + a->extra_params : attn_max;
		}
	}
	p.dense_mlp = swiglu(h, m->dense_inter) * m->dense_layers;
	p.expert_one = swiglu(h, m->expert_inter);
	p.experts = p.expert_one * m->experts * moe_layers;
	p.shared = swiglu(h, m->shared_inter) * m->shared_experts * moe_layers;
	p.router = (uint64_t)h * m->experts * moe_layers;
	p.norms = (2 * (uint64_t)h) * m->layers + h;
	uint64_t attn = 0;
	for (int i = 0; i < m->nattn; i++)
		attn += p.attn[i];
	p.total = p.embed + p.lm_head + attn + p.dense_mlp + p.experts + p.shared + p.router + p.norms;
	p.dense_total = p.total - p.experts;
	p.active = p.total - p.experts + p.expert_one * m->top_k * moe_layers;
	p.matmul_active = (m->tie_embeddings ? p.embed : p.lm_head) + attn_mm + p.dense_mlp + p.shared + p.router +
			  p.expert_one * m->top_k * moe_layers;

	uint64_t l_dense = swiglu_lora(h, m->dense_inter, r, t), l_exp = swiglu_lora(h, m->expert_inter, r, t);
	uint64_t l_shared = swiglu_lora(h, m->shared_inter, r, t) * m->shared_experts;
	uint64_t l_router = t & TIER_PLAN_LORA_ROUTER ? (uint64_t)r * (h + m->experts) : 0;
	uint64_t lora_attn = p.lora;
	p.lora_expert_one = l_exp;
	p.lora += l_dense * m->dense_layers + (l_exp * m->experts + l_shared + l_router) * moe_layers;
	p.lora_active = lora_attn + l_dense * m->dense_layers + (l_exp * m->top_k + l_shared + l_router) * moe_layers;
	uint64_t moe_lora = moe_layers ? l_exp * m->experts + l_shared + l_router : 0;
	uint64_t dense_lora = m->dense_layers ? l_dense : 0;
	p.lora_layer_max = lora_attn_max + (moe_lora > dense_lora ? moe_lora : dense_lora);
	uint64_t moe_dense = moe_layers ? swiglu(h, m->shared_inter) * m->shared_experts + (uint64_t)h * m->experts : 0;
	uint64_t dense_dense = m->dense_layers ? swiglu(h, m->dense_inter) : 0;
	p.dense_layer_max = attn_max + 2 * (uint64_t)h + (moe_dense > dense_dense ? moe_dense : dense_dense);
	*out = p;
	return 0;
}

static const struct {
	const char *word;
	unsigned bits;
} target_words[] = {
	{ "q", TIER_PLAN_LORA_Q }, { "k", TIER_PLAN_LORA_K }, { "v", TIER_PLAN_LORA_V }, { "o", TIER_PLAN_LORA_O },
	{ "gate", TIER_PLAN_LORA_GATE }, { "up", TIER_PLAN_LORA_UP }, { "down", TIER_PLAN_LORA_DOWN },
	{ "router", TIER_PLAN_LORA_ROUTER }, { "none", 0 },
	{ "all-linear", TIER_PLAN_LORA_Q | TIER_PLAN_LORA_K | TIER_PLAN_LORA_V | TIER_PLAN_LORA_O | TIER_PLAN_LORA_GATE | TIER_PLAN_LORA_UP |
			TIER_PLAN_LORA_DOWN },
};

int tier_plan_parse_targets(const char *text, unsigned *out)
{
	unsigned bits = 0;
	const char *s = text;
	if (!s || !*s)
		return tier_fail(-EINVAL, "empty LoRA target list: give words from q,k,v,o,gate,up,down,router "
				 "(or all-linear, none) separated by commas");
	while (*s) {
		size_t n = strcspn(s, ",");
		size_t i = 0, nw = sizeof target_words / sizeof target_words[0];
		while (i < nw && !(strlen(target_words[i].word) == n && !strncmp(s, target_words[i].word, n)))
			i++;
		if (i == nw)
			return tier_fail(-EINVAL, "unknown LoRA target '%.*s': use q,k,v,o,gate,up,down,router, "
					 "all-linear or none", (int)n, s);
		bits |= target_words[i].bits;
		s += n + (s[n] == ',');
	}
	*out = bits;
	return 0;
}
