/* plan.h - cluster sizing: parameter counts, per-GPU bytes per tier and a roofline step time for
 * LoRA fine-tuning of an MoE model under an FSDP x EP layout (the library half of tier-plan).
 * docs/plan.md gives every formula. Pure arithmetic: no I/O except tier_plan_model_load and
 * tier_plan_calibrate, which read one file each. */
#ifndef TIER_PLAN_H
#define TIER_PLAN_H

#include <stdint.h>
#include "tier/formats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Model ------------------------------------------------------------------------------------ */
/* LoRA target bits. GATE is the SwiGLU gate_proj of experts, shared experts and dense MLPs (Mixtral's
 * w1); ROUTER is the MoE router ("mlp.gate" in Qwen3-MoE). */
enum {
	TIER_PLAN_LORA_Q = 1u << 0, TIER_PLAN_LORA_K = 1u << 1, TIER_PLAN_LORA_V = 1u << 2, TIER_PLAN_LORA_O = 1u << 3,
	TIER_PLAN_LORA_GATE = 1u << 4, TIER_PLAN_LORA_UP = 1u << 5, TIER_PLAN_LORA_DOWN = 1u << 6, TIER_PLAN_LORA_ROUTER = 1u << 7,
};
typedef enum { TIER_PLAN_ATTN_FULL = 0, TIER_PLAN_ATTN_LINEAR, TIER_PLAN_ATTN_SPARSE } tier_plan_attn_type;

#define TIER_PLAN_MAX_PROJ 12
typedef struct {
	char name[16];
	int64_t in, out;        /* a bias-free [out, in] matrix */
	unsigned target;        /* the LoRA bit that covers it (0: never a target) */
} tier_plan_proj;

/* One kind of attention layer and how many layers have it. */
typedef struct {
	tier_plan_attn_type type;
	int64_t layers;
	tier_plan_proj proj[TIER_PLAN_MAX_PROJ];
	int nproj;
	int64_t extra_params;   /* per layer: norms, conv kernels, gate vectors (no matmul, no LoRA) */
	int64_t heads, dqk, dv; /* score heads and head dims, for attention FLOPs */
	int64_t topk;           /* SPARSE: keys kept per query */
	int64_t idx_heads, idx_dim; /* SPARSE: the indexer that scores every earlier key (frozen) */
	int64_t chunk;          /* LINEAR: chunk length of the chunked recurrent form */
} tier_plan_attn;

#define TIER_PLAN_MAX_ATTN 3
typedef struct {
	char name[48];
	int64_t layers, hidden, vocab;
	int tie_embeddings;
	tier_plan_attn attn[TIER_PLAN_MAX_ATTN];
	int nattn;                       /* sum of attn[i].layers == layers */
	int64_t dense_layers, dense_inter; /* layers with a dense SwiGLU MLP instead of experts */
	int64_t experts, top_k, expert_inter, shared_experts, shared_inter;
	int lora_r;
	unsigned lora_targets;
	int64_t seq, mbs;                /* default sequence length and micro-batch */
	char note[160];                  /* what is approximate about this description */
} tier_plan_model;

/* Parameters by component (counts, not bytes). */
typedef struct {
	uint64_t embed, lm_head, attn[TIER_PLAN_MAX_ATTN], dense_mlp, experts, shared, router, norms;
	uint64_t total, active;          /* active: per token (k routed experts + shared + the rest) */
	uint64_t matmul_active;          /* active parameters that do a matmul per token (no embedding, norms) */
	uint64_t lora, lora_active;      /* LoRA parameters in all, and touched per token */
	uint64_t dense_total;            /* everything but routed experts (FSDP-sharded part) */
	uint64_t expert_one;             /* one routed expert */
	uint64_t lora_expert_one;        /* LoRA parameters of one routed expert */
	uint64_t lora_layer_max;         /* LoRA parameters of the largest layer */
	uint64_t dense_layer_max;        /* non-expert parameters of the largest layer */
} tier_plan_params;

/* Presets: "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3", "seed-2.8t".
 * 0; -EINVAL listing the presets for an unknown name. *out untouched on failure. Thread-safe. */
int tier_plan_model_preset(const char *name, tier_plan_model *out);
/* A preset name, or the path of an HF config.json (qwen3_moe, mixtral) read with tier_hf_config_load.
 * 0 or that function's error (with the file named). *out untouched on failure. Thread-safe. */
int tier_plan_model_load(const char *name_or_path, tier_plan_model *out);
/* The same from a config already read (name: what messages call it). 0 or -EINVAL. Thread-safe. */
int tier_plan_model_from_hf(const tier_hf_config *c, const char *name, tier_plan_model *out);
/* Check the shape (positive sizes, layer kinds adding up, top_k <= experts ...). 0 or -EINVAL naming
 * the field. Thread-safe. */
int tier_plan_model_check(const tier_plan_model *m);
/* Count parameters. 0 or -EINVAL (model_check). *out untouched on failure. Thread-safe. */
int tier_plan_count(const tier_plan_model *m, tier_plan_params *out);
/* Parse "q,k,v,o,gate" (also "all-linear", "none") into LoRA bits. 0 or -EINVAL naming the word. */
int tier_plan_parse_targets(const char *text, unsigned *out);

/* ---- Cluster ---------------------------------------------------------------------------------- */
typedef struct {
	char name[32];
	int nodes, gpus_per_node;
	uint64_t hbm_per_gpu, ddr_per_node, nvme_per_node;   /* bytes */
	double nvme_read_gbps, nvme_write_gbps;               /* per node, all drives together (1e9 B/s) */
	double pcie_gbps;                                     /* per GPU, host->device as measured */
	double nvlink_gbps;                                   /* per GPU, one direction */
	double net_gbps;                                      /* per GPU, inter-node, one direction */
	double tflops;                                        /* bf16 dense peak per GPU */
	double mfu;                                           /* share of peak that matmuls reach */
} tier_plan_cluster;
/* Presets: "h200-8x", "h100-8x", "a100-8x-80g", "seed-128" (16 x h200-8x). 0; -EINVAL listing them. */
int tier_plan_cluster_preset(const char *name, tier_plan_cluster *out);
/* 0 or -EINVAL naming the bad field. Thread-safe. */
int tier_plan_cluster_check(const tier_plan_cluster *c);

/* Replace pcie_gbps, nvme_read_gbps (per GPU measured: times gpus_per_node) and the achieved
 * TFLOP/s (tflops * mfu) with what a file of tier-bench output shows: the tables of h2d and
 * nvme-read (best algbw) and the --json lines of attn and loss (best forward+backward rate).
 * *found gets a bit per figure used (1 pcie, 2 nvme, 4 compute). 0; -ENOENT/-errno for the file;
 * -EBADMSG when nothing in it is tier-bench output. *c changes only on success. Thread-safe. */
int tier_plan_calibrate(const char *path, tier_plan_cluster *c, unsigned *found);

/* ---- Plan ------------------------------------------------------------------------------------- */
typedef struct {
	int ep;                  /* expert-parallel group size; 0: of the sizes that divide both the GPU
				    count and the expert count, the one that fits and steps fastest */
	int64_t seq, mbs;        /* 0: the model's */
	int lora_r;              /* -1: the model's */
	unsigned lora_targets;   /* 0: the model's */
	uint64_t hbm_reserve;    /* per GPU, for the CUDA context, fragmentation, NCCL (default 8 GiB) */
	uint64_t ddr_reserve;    /* per node, for the OS and the processes (default 64 GiB) */
	int64_t mlp_chunk;       /* tokens per MoE chunk (bounds the live expert activations) */
	int64_t loss_chunk, vocab_block; /* chunked cross-entropy tile */
	uint64_t opcache_max;    /* op-cache budget per GPU; UINT64_MAX: what HBM has left */
	int no_tiering;          /* 1: HBM only (what fits without DDR and NVMe) */
	int64_t accum;           /* micro-batches per optimizer step (gradient accumulation); 0: 1 */
	int layer_major;         /* 1: each layer runs all micro-batches with its weights fetched once
				    (tier-run --layer-major): weights and gathers cross once a step, every
				    micro-batch's checkpoints are kept */
} tier_plan_opts;
void tier_plan_opts_default(tier_plan_opts *o);

enum { TIER_PLAN_HBM = 0, TIER_PLAN_DDR, TIER_PLAN_NVME, TIER_PLAN_NTIERS };
/* What a GPU holds. The *_LIVE items must sit in HBM; the others go to HBM in this order, and what
 * does not fit goes to DDR, then NVMe (the op cache and loss buffers never leave HBM). */
enum {
	TIER_PLAN_WEIGHTS_LIVE = 0, /* gathered dense layer + local experts of a layer, double-buffered */
	TIER_PLAN_ACT_LIVE,         /* the live layer's activations and their gradients */
	TIER_PLAN_LOSS,             /* chunked cross-entropy tile and per-token statistics */
	TIER_PLAN_LORA,             /* LoRA shard: fp32 params + grads + AdamW m, v; live layer's grads */
	TIER_PLAN_ACT_CKPT,         /* per-layer checkpoints of the hidden states */
	TIER_PLAN_WEIGHTS,          /* the base-weight shard (bf16) */
	TIER_PLAN_OPCACHE,          /* cached forward results (saves recompute) */
	TIER_PLAN_NITEMS
};
enum { TIER_PLAN_T_COMPUTE = 0, TIER_PLAN_T_PCIE, TIER_PLAN_T_NVME, TIER_PLAN_T_NET, TIER_PLAN_NTERMS };

typedef struct {
	tier_plan_params params;
	int gpus, ep, dp;
	int64_t seq, mbs, experts_per_gpu;
	int64_t accum;               /* micro-batches per step */
	int layer_major;
	uint64_t item[TIER_PLAN_NITEMS];                       /* bytes per GPU */
	uint64_t place[TIER_PLAN_NITEMS][TIER_PLAN_NTIERS];   /* where each item sits */
	uint64_t cap[TIER_PLAN_NTIERS], used[TIER_PLAN_NTIERS]; /* per GPU */
	int fits;
	uint64_t spare, shortfall;   /* bytes left in the last tier used, or missing from all tiers */
	uint64_t opcache_want;       /* forward results worth caching per GPU (the whole step) */
	double opcache_hit;          /* share of recompute the cache saves */
	double flops[4];             /* per GPU per step: forward, recompute, backward, LoRA update */
	double flops_total;
	double pcie_bytes, nvme_bytes, net_intra_bytes, net_inter_bytes; /* per GPU per step */
	double t[TIER_PLAN_NTERMS];  /* seconds per step */
	double step_s, serial_s;     /* overlapped (max of terms) and not (sum) */
	int bottleneck;              /* TIER_PLAN_T_* */
	double tokens_per_s;         /* whole cluster, overlapped */
} tier_plan_result;

/* Plan one optimizer step of accum micro-batches per GPU. 0; -EINVAL naming the problem (model, cluster, an EP size
 * that does not divide the GPUs or the experts, sizes); *r untouched on failure. Thread-safe. */
int tier_plan_run(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_opts *o,
		  tier_plan_result *r);
/* The smallest node count in [1, max_nodes] at which the plan fits (c->nodes ignored). 0 with
 * *nodes set and *r its plan; -ENOSPC when none fits (message says how short max_nodes falls);
 * -EINVAL as tier_plan_run. Thread-safe. */
int tier_plan_smallest(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_opts *o,
		       int max_nodes, int *nodes, tier_plan_result *r);
const char *tier_plan_item_name(int item);   /* "weights", "lora+adam", ... */
const char *tier_plan_term_name(int term);   /* "compute", "pcie", "nvme", "network" */
const char *tier_plan_tier_name(int tier);   /* "hbm", "ddr", "nvme" */

#ifdef __cplusplus
}
#endif
#endif
