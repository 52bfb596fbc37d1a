/* plan.c - tier-plan's arithmetic: cluster presets, bytes per tier per GPU, roofline step time. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "tier/base.h"
#include "tier/plan.h"

#define GB 1e9
#define GIB (1024.0 * 1024 * 1024)
#define TIB (GIB * 1024)

/* H200 SXM node: 8 x 141 GB, 2 TiB DDR, 8 x 3.84 TB NVMe (6.5 GB/s read, 3.5 GB/s write each), PCIe
 * gen5 at the 55 GB/s measured host->device, NVLink 900 GB/s both ways (450 one way), one 400 Gb/s
 * NIC per GPU (50 GB/s), 989 TFLOP/s bf16 dense, 50% of it reached by the GEMMs. */
static const tier_plan_cluster h200 = {
	"h200-8x", 1, 8, 141000000000ull, (uint64_t)(2 * TIB), 8 * 3840000000000ull,
	8 * 6.5, 8 * 3.5, 55, 450, 50, 989, 0.5,
};
static const tier_plan_cluster h100 = {
	"h100-8x", 1, 8, 80000000000ull, (uint64_t)(2 * TIB), 8 * 3840000000000ull,
	8 * 6.5, 8 * 3.5, 55, 450, 50, 989, 0.5,
};
/* A100 80 GB: PCIe gen4 (about 25 GB/s), NVLink 600 GB/s (300 one way), 200 Gb/s NICs, 312 TFLOP/s. */
static const tier_plan_cluster a100 = {
	"a100-8x-80g", 1, 8, 80000000000ull, (uint64_t)(1 * TIB), 8 * 3840000000000ull,
	8 * 6.5, 8 * 3.5, 25, 300, 25, 312, 0.5,
};

int tier_plan_cluster_preset(const char *name, tier_plan_cluster *out)
{
	const tier_plan_cluster *all[] = { &h200, &h100, &a100 };
	for (size_t i = 0; name && i < 3; i++)
		if (!strcmp(name, all[i]->name)) {
			*out = *all[i];
			return 0;
		}
	if (name && !strcmp(name, "seed-128")) {   /* our reading of the seeds: 16 H200 nodes */
		*out = h200;
		snprintf(out->name, sizeof out->name, "seed-128");
		out->nodes = 16;
		return 0;
	}
	return tier_fail(-EINVAL, "unknown cluster '%s': use one of h200-8x, h100-8x, a100-8x-80g, seed-128",
			 name ? name : "(null)");
}

int tier_plan_cluster_check(const tier_plan_cluster *c)
{
	if (!c)
		return tier_fail(-EINVAL, "no cluster given");
	if (c->nodes < 1 || c->gpus_per_node < 1 || c->hbm_per_gpu == 0)
		return tier_fail(-EINVAL, "cluster %s: nodes, GPUs per node and HBM per GPU must be positive", c->name);
	if (!(c->nvme_read_gbps > 0) || !(c->nvme_write_gbps > 0) || !(c->pcie_gbps > 0) || !(c->nvlink_gbps > 0) ||
	    !(c->net_gbps > 0) || !(c->tflops > 0) || !(c->mfu > 0) || c->mfu > 1)
		return tier_fail(-EINVAL, "cluster %s: every bandwidth and TFLOP/s must be positive and MFU in (0, 1]",
				 c->name);
	return 0;
}

/* Tokens a step (sequence x micro-batch x micro-batches) at most, so that token counts stay exact in
 * int64 and doubles; byte counts past 64 bits (possible at the model limits) saturate (sat). */
#define TOKENS_MAX (1ll << 32)

void tier_plan_opts_default(tier_plan_opts *o)
{
	memset(o, 0, sizeof *o);
	o->lora_r = -1;
	o->hbm_reserve = 8ull << 30;
	o->ddr_reserve = 64ull << 30;
	o->mlp_chunk = 4096;
	o->loss_chunk = 4096;
	o->vocab_block = 32768;
	o->opcache_max = UINT64_MAX;
}

static const char *const item_names[] = { "weights live", "act live", "loss bufs", "lora+adam", "act ckpt",
					  "weights", "op cache" };
static const char *const term_names[] = { "compute", "pcie", "nvme", "network" };
static const char *const tier_names[] = { "hbm", "ddr", "nvme" };
const char *tier_plan_item_name(int i) { return i >= 0 && i < TIER_PLAN_NITEMS ? item_names[i] : "?"; }
const char *tier_plan_term_name(int i) { return i >= 0 && i < TIER_PLAN_NTERMS ? term_names[i] : "?"; }
const char *tier_plan_tier_name(int i) { return i >= 0 && i < TIER_PLAN_NTIERS ? tier_names[i] : "?"; }

static int ep_valid(const tier_plan_model *m, int gpus, int ep)
{
	int64_t e = m->dense_layers < m->layers ? m->experts : 1;
	return gpus % ep == 0 && e % ep == 0;
}

/* Largest per-token width of the outputs of one attention kind's projections. */
static int64_t attn_width(const tier_plan_model *m)
{
	int64_t w = 0;
	for (int i = 0; i < m->nattn; i++) {
		int64_t s = 0;
		for (int p = 0; p < m->attn[i].nproj; p++)
			s += m->attn[i].proj[p].out;
		w = s > w ? s : w;
	}
	return w;
}

/* x as a byte count: rounded down, saturating at UINT64_MAX (a double past 2^64 would not convert:
 * sizes at the model limits times 2^32 tokens reach ~2^72, which then reads "does not fit"). */
static uint64_t sat(double x)
{
	return x >= 18446744073709551615.0 ? UINT64_MAX : x > 0 ? (uint64_t)x : 0;
}

/* Bytes of each item per GPU (docs/plan.md, "Memory"). */
static void plan_items(const tier_plan_model *m, const tier_plan_opts *o, tier_plan_result *r)
{
	const tier_plan_params *p = &r->params;
	const double g = r->gpus, h = (double)m->hidden, T = (double)(r->seq * r->mbs);
	const int64_t moe_layers = m->layers - m->dense_layers;
	const double k = moe_layers ? (double)m->top_k : 0, inter = (double)m->expert_inter;
	double local_experts = moe_layers ? (double)r->experts_per_gpu : 0;
	r->item[TIER_PLAN_WEIGHTS] = sat(2.0 * p->total / g + 0.999);
	r->item[TIER_PLAN_WEIGHTS_LIVE] = sat(2 * 2.0 * (p->dense_layer_max + local_experts * p->expert_one));
	double lora_layer = p->lora_layer_max - (moe_layers ? (double)p->lora_expert_one * (m->experts - local_experts) : 0);
	r->item[TIER_PLAN_LORA] = sat(16.0 * p->lora / g + 6.0 * lora_layer + 0.999);
	/* layer-major keeps every micro-batch's checkpoints and running gradient (fp32) */
	const double mbk = r->layer_major ? (double)r->accum : 1;
	r->item[TIER_PLAN_ACT_CKPT] = sat(mbk * m->layers * T * h * 2);
	double chunk = (double)(o->mlp_chunk < r->seq * r->mbs ? o->mlp_chunk : r->seq * r->mbs);
	r->item[TIER_PLAN_ACT_LIVE] = sat(4 * T * h * 2 + 2 * T * attn_width(m) * 2 +
						 2 * chunk * k * (2 * h + 3 * inter) * 2 + T * (moe_layers ? m->experts : 0) * 4 +
						 (r->layer_major ? mbk * T * h * 4 : 0));
	double lc = (double)(o->loss_chunk < r->seq * r->mbs ? o->loss_chunk : r->seq * r->mbs);
	double vb = (double)(o->vocab_block < m->vocab ? o->vocab_block : m->vocab);
	r->item[TIER_PLAN_LOSS] = sat(2 * lc * vb * 4 + 2 * T * 4 + lc * h * 4);
	/* Forward results worth keeping for backward: projection outputs and the experts' gate and up. */
	r->opcache_want = sat(mbk * (m->layers * T * attn_width(m) * 2 + moe_layers * T * k * 2 * inter * 2));
}

/* Put each item in HBM, then DDR, then NVMe (live items, loss buffers and the op cache: HBM only). */
static void plan_place(const tier_plan_cluster *c, const tier_plan_opts *o, tier_plan_result *r)
{
	uint64_t hbm = c->hbm_per_gpu > o->hbm_reserve ? c->hbm_per_gpu - o->hbm_reserve : 0;
	uint64_t ddr = c->ddr_per_node > o->ddr_reserve ? (c->ddr_per_node - o->ddr_reserve) / c->gpus_per_node : 0;
	r->cap[TIER_PLAN_HBM] = hbm;
	r->cap[TIER_PLAN_DDR] = o->no_tiering ? 0 : ddr;
	r->cap[TIER_PLAN_NVME] = o->no_tiering ? 0 : c->nvme_per_node / c->gpus_per_node;
	uint64_t free_[TIER_PLAN_NTIERS], missing = 0;
	memcpy(free_, r->cap, sizeof free_);
	memset(r->place, 0, sizeof r->place);
	for (int i = 0; i < TIER_PLAN_OPCACHE; i++) {
		uint64_t left = r->item[i];
		int last = i <= TIER_PLAN_LOSS ? TIER_PLAN_HBM : TIER_PLAN_NVME;
		for (int t = 0; t <= last && left; t++) {
			uint64_t n = left < free_[t] ? left : free_[t];
			r->place[i][t] = n;
			free_[t] -= n;
			left -= n;
		}
		missing = missing + left < missing ? UINT64_MAX : missing + left; /* items may be saturated */
	}
	uint64_t oc = r->opcache_want < o->opcache_max ? r->opcache_want : o->opcache_max;
	oc = oc < free_[TIER_PLAN_HBM] ? oc : free_[TIER_PLAN_HBM];
	r->item[TIER_PLAN_OPCACHE] = r->place[TIER_PLAN_OPCACHE][TIER_PLAN_HBM] = oc;
	free_[TIER_PLAN_HBM] -= oc;
	r->opcache_hit = r->opcache_want ? (double)oc / r->opcache_want : 1.0;
	for (int t = 0; t < TIER_PLAN_NTIERS; t++)
		r->used[t] = r->cap[t] - free_[t];
	r->fits = missing == 0;
	r->shortfall = missing;
	/* Spare counts the op cache as free: it only takes what is left. */
	r->spare = missing ? 0 : free_[TIER_PLAN_HBM] + oc + free_[TIER_PLAN_DDR] + free_[TIER_PLAN_NVME];
}

/* Attention FLOPs of one forward over one sequence: main (differentiated) and indexer (not). */
static void attn_flops(const tier_plan_model *m, double s, double *main_, double *index)
{
	*main_ = *index = 0;
	for (int i = 0; i < m->nattn; i++) {
		const tier_plan_attn *a = &m->attn[i];
		double hd = (double)a->heads, d = (double)(a->dqk + a->dv), n = (double)a->layers;
		if (a->type == TIER_PLAN_ATTN_FULL) {
			*main_ += n * s * s * hd * d;        /* 2 products of 2*S*S*d, causal half */
		} else if (a->type == TIER_PLAN_ATTN_SPARSE) {
			double kk = (double)a->topk < s ? (double)a->topk : s;
			*main_ += n * 2 * s * kk * hd * d;
			*index += n * s * s * a->idx_heads * a->idx_dim; /* 2*S*S*dim per head, causal half */
		} else {
			*main_ += n * s * hd * (2.0 * a->chunk * d + 6.0 * a->dqk * a->dv);
		}
	}
}

static void plan_time(const tier_plan_model *m, const tier_plan_cluster *c, tier_plan_result *r)
{
	const tier_plan_params *p = &r->params;
	const double T = (double)(r->seq * r->mbs), g = r->gpus, h = (double)m->hidden;
	double am, ai;
	attn_flops(m, (double)r->seq, &am, &ai);
	am *= r->mbs;
	ai *= r->mbs;
	/* N micro-batches: N times the compute and the activations' traffic; the weights (and their
	 * gathers, and the LoRA gradients' reduce-scatter) cross once per micro-batch, or once a step
	 * when layer-major (each layer's gradient is complete after its operation) */
	const double N = (double)r->accum, passes = r->layer_major ? 1 : N;
	double mm = 2.0 * p->matmul_active * T, lora = 2.0 * p->lora_active * T;
	r->flops[0] = N * (mm + am + ai + lora);
	/* the recompute runs the layers again, not the output head, and makes only the state the
	 * backward reads: not the MLPs' down products (a third of each SwiGLU's weights) */
	const int64_t moe_layers = m->layers - m->dense_layers;
	double head = (double)(m->tie_embeddings ? p->embed : p->lm_head);
	double downs = ((double)p->dense_mlp + (double)p->shared + (double)p->expert_one * m->top_k * moe_layers) / 3;
	r->flops[1] = N * (mm - 2.0 * T * (head + downs) + am + ai + lora) * (1 - r->opcache_hit);
	r->flops[2] = N * (mm + 2.5 * am + 2 * lora);
	r->flops[3] = 12.0 * p->lora / g;
	r->flops_total = r->flops[0] + r->flops[1] + r->flops[2] + r->flops[3];
	r->t[TIER_PLAN_T_COMPUTE] = r->flops_total / (c->tflops * c->mfu * 1e12);

	uint64_t(*pl)[TIER_PLAN_NTIERS] = r->place;
	double w_off = (double)(pl[TIER_PLAN_WEIGHTS][TIER_PLAN_DDR] + pl[TIER_PLAN_WEIGHTS][TIER_PLAN_NVME]);
	double ck_off = (double)(pl[TIER_PLAN_ACT_CKPT][TIER_PLAN_DDR] + pl[TIER_PLAN_ACT_CKPT][TIER_PLAN_NVME]);
	double lo_off = (double)(pl[TIER_PLAN_LORA][TIER_PLAN_DDR] + pl[TIER_PLAN_LORA][TIER_PLAN_NVME]);
	ck_off *= r->layer_major ? 1 : N; /* layer-major: the item holds every micro-batch's */
	double h2d = 2 * w_off * passes + ck_off + lo_off, d2h = ck_off + lo_off;
	r->pcie_bytes = h2d > d2h ? h2d : d2h;
	r->t[TIER_PLAN_T_PCIE] = r->pcie_bytes / (c->pcie_gbps * GB);

	double nv_w = (double)(pl[TIER_PLAN_ACT_CKPT][TIER_PLAN_NVME] + pl[TIER_PLAN_LORA][TIER_PLAN_NVME]);
	if (!r->layer_major)
		nv_w += (N - 1) * pl[TIER_PLAN_ACT_CKPT][TIER_PLAN_NVME];
	double nv_r = 2.0 * passes * pl[TIER_PLAN_WEIGHTS][TIER_PLAN_NVME] + nv_w;
	r->nvme_bytes = nv_r + nv_w;
	double per_gpu = 1.0 / c->gpus_per_node;
	r->t[TIER_PLAN_T_NVME] = nv_r / (c->nvme_read_gbps * per_gpu * GB) + nv_w / (c->nvme_write_gbps * per_gpu * GB);

	/* EP all-to-all: dispatch and combine in forward, recompute and backward. Every copy of a token
	 * for an expert on another GPU crosses NVLink (directly, or fanned out inside the destination
	 * node); between nodes a token travels once per node that holds one of its experts (DeepEP's
	 * dedup), e_nodes (1 - (1 - 1/e_nodes)^k) nodes in expectation under uniform routing, less
	 * its own. */
	const double vol = N * 3.0 * 2 * moe_layers * T * h * 2;
	double a2a_intra = r->ep > 1 ? vol * m->top_k * (r->ep - 1) / r->ep : 0, a2a_inter = 0;
	if (r->ep > c->gpus_per_node) {
		double en = (double)r->ep / c->gpus_per_node;
		a2a_inter = vol * (en * (1 - pow(1 - 1 / en, (double)m->top_k)) - (1 - pow(1 - 1 / en, (double)m->top_k)));
	}
	/* FSDP: dense weights gathered in forward and backward, experts over the dp replicas, LoRA
	 * params gathered (bf16, twice) and their fp32 grads reduce-scattered. */
	double fsdp = g > 1 ? passes * (2.0 * 2 * p->dense_total + 8.0 * p->lora) * (g - 1) / g : 0;
	if (r->dp > 1)
		fsdp += passes * 2.0 * 2 * ((double)p->experts / r->ep) * (r->dp - 1) / r->dp;
	int multi = r->gpus > c->gpus_per_node;
	r->net_intra_bytes = a2a_intra + (multi ? 0 : fsdp);
	r->net_inter_bytes = a2a_inter + (multi ? fsdp : 0);
	double ti = r->net_intra_bytes / (c->nvlink_gbps * GB), tx = r->net_inter_bytes / (c->net_gbps * GB);
	r->t[TIER_PLAN_T_NET] = ti > tx ? ti : tx;

	r->step_s = r->serial_s = 0;
	r->bottleneck = 0;
	for (int i = 0; i < TIER_PLAN_NTERMS; i++) {
		r->serial_s += r->t[i];
		if (r->t[i] > r->step_s) {
			r->step_s = r->t[i];
			r->bottleneck = i;
		}
	}
	r->tokens_per_s = r->step_s > 0 ? g * T * N / r->step_s : 0;
}

static void plan_one(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_opts *o, int ep,
		     tier_plan_result *r)
{
	r->ep = ep;
	r->dp = r->gpus / ep;
	r->experts_per_gpu = m->dense_layers < m->layers ? m->experts / ep : 0;
	plan_items(m, o, r);
	plan_place(c, o, r);
	plan_time(m, c, r);
}

/* Of two plans that both fit (or both do not): the faster step, then the less traffic (sum of the
 * terms), then the larger EP group (fewer experts live per GPU); or the smaller shortfall. */
static int better(const tier_plan_result *a, const tier_plan_result *b)
{
	if (!a->fits)
		return a->shortfall < b->shortfall;
	if (fabs(a->step_s - b->step_s) > 1e-9 * b->step_s)
		return a->step_s < b->step_s;
	if (fabs(a->serial_s - b->serial_s) > 1e-9 * b->serial_s)
		return a->serial_s < b->serial_s;
	return a->ep > b->ep;
}

int tier_plan_run(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_opts *o,
		  tier_plan_result *out)
{
	tier_plan_opts def;
	if (!o) {
		tier_plan_opts_default(&def);
		o = &def;
	}
	int rc = tier_plan_cluster_check(c);
	if (rc)
		return rc;
	tier_plan_model mm;
	if (!m)
		return tier_plan_model_check(m);
	mm = *m;
	if (o->accum < 0 || o->accum > TOKENS_MAX)
		return tier_fail(-EINVAL, "plan options: micro-batches per step (accum) must be in 1..%lld, not %lld",
				 (long long)TOKENS_MAX, (long long)o->accum);
	if (o->seq < 0 || o->mbs < 0 || o->lora_r < -1 || o->mlp_chunk < 1 || o->loss_chunk < 1 || o->vocab_block < 1)
		return tier_fail(-EINVAL, "plan options: sequence, micro-batch, LoRA rank and chunk sizes must be "
				 "positive (seq %lld, mbs %lld, r %d, chunks %lld/%lld/%lld)", (long long)o->seq,
				 (long long)o->mbs, o->lora_r, (long long)o->mlp_chunk, (long long)o->loss_chunk,
				 (long long)o->vocab_block);
	if (o->seq)
		mm.seq = o->seq;
	if (o->mbs)
		mm.mbs = o->mbs;
	if (o->lora_r >= 0)
		mm.lora_r = o->lora_r;
	if (o->lora_targets)
		mm.lora_targets = o->lora_targets;
	tier_plan_result r;
	memset(&r, 0, sizeof r);
	if ((rc = tier_plan_count(&mm, &r.params)))
		return rc;
	r.gpus = c->nodes * c->gpus_per_node;
	r.seq = mm.seq;
	r.mbs = mm.mbs;
	r.accum = o->accum ? o->accum : 1;
	r.layer_major = o->layer_major && r.accum > 1;
	if (mm.seq > TOKENS_MAX || mm.mbs > TOKENS_MAX || mm.mbs > TOKENS_MAX / r.accum / mm.seq)
		return tier_fail(-EINVAL, "plan options: sequence %lld x micro-batch %lld x %lld micro-batches is over "
				 "the %lld tokens a step the planner's byte counts hold", (long long)mm.seq,
				 (long long)mm.mbs, (long long)r.accum, (long long)TOKENS_MAX);
	if (o->ep > 0 && !ep_valid(&mm, r.gpus, o->ep))
		return tier_fail(-EINVAL, "EP size %d must divide both the GPU count %d and the expert count %lld",
				 o->ep, r.gpus, (long long)mm.experts);
	/* Without a given EP size try every valid one: the best fits and steps fastest, or else is
	 * the least short. */
	tier_plan_result best;
	int have = 0;
	for (int ep = 1; ep <= r.gpus; ep++) {
		if ((o->ep > 0 && ep != o->ep) || !ep_valid(&mm, r.gpus, ep))
			continue;
		tier_plan_result t = r;
		plan_one(&mm, c, o, ep, &t);
		if (!have || (t.fits && !best.fits) || (t.fits == best.fits && better(&t, &best)))
			best = t;
		have = 1;
	}
	*out = best;
	return 0;
}

int tier_plan_smallest(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_opts *o,
		       int max_nodes, int *nodes, tier_plan_result *r)
{
	if (max_nodes < 1)
		return tier_fail(-EINVAL, "the largest node count to try must be >= 1, not %d", max_nodes);
	if (!c || !nodes || !r)
		return tier_fail(-EINVAL, "tier_plan_smallest needs a cluster and somewhere to put the answer");
	tier_plan_cluster cc = *c;
	uint64_t best_short = UINT64_MAX;
	for (int n = 1; n <= max_nodes; n++) {
		cc.nodes = n;
		tier_plan_result t;
		int rc = tier_plan_run(m, &cc, o, &t);
		if (rc == -EINVAL && o && o->ep > 0 && (n * c->gpus_per_node) % o->ep)
			continue;   /* this node count cannot hold the asked EP size */
		if (rc)
			return rc;
		if (t.fits) {
			*nodes = n;
			*r = t;
			tier_clear_error();
			return 0;
		}
		best_short = t.shortfall < best_short ? t.shortfall : best_short;
	}
	char buf[32];
	return tier_fail(-ENOSPC, "no cluster of up to %d %s nodes fits (still %s short per GPU at best): raise "
			 "--max-nodes, shorten the sequence or add tiers", max_nodes, c->name,
			 tier_format_size(best_short == UINT64_MAX ? 0 : best_short, buf, sizeof buf));
}
