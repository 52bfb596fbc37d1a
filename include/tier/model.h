/* model.h - the trainer (core/): layers with explicit backward, the qwen3_moe model graph with its
 * weights in the tiered store, LoRA, AdamW, the training step, and the token data it reads.
 *
 * Architectures: qwen3_moe and mixtral (no q/k norms, top-k-then-softmax router, every layer MoE,
 * block_sparse_moe names). Everything here runs on a CPU device context (the fp32 reference). The layouts are Hugging
 * Face's, row-major: a linear weight W [out, in] (y = x W^T); LoRA A [r, in] and B [out, r] as PEFT
 * stores them, y += scale (x A^T) B^T, never forming B A. docs/trainer.md describes the step.
 *
 * Every function returns 0 or a negative errno with a message (tier_last_error). Thread-safety:
 * the layer functions keep no state (concurrent calls on distinct outputs are fine); a tier_model,
 * a tier_trainer and a tier_data serve one thread at a time. */
#ifndef TIER_MODEL_H
#define TIER_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/store.h"
#include "tier/cache.h"
#include "tier/formats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Layers (CPU, fp32). Failed calls have written nothing (all checks come first). --------- */

/* RMSNorm as HF computes it in fp32: y = x * rsqrt(mean(x^2) + eps) * w over rows of `dim`;
 * rstd [rows] (may be NULL) keeps rsqrt(...) for the backward. */
int tier_rmsnorm_fwd(tier_dev *dev, int rows, int dim, float eps, const float *x, const float *w, float *y,
		     float *rstd);
/* dx [rows, dim] written; dw [dim] accumulated (NULL: frozen weight, the usual case). */
int tier_rmsnorm_bwd(tier_dev *dev, int rows, int dim, const float *x, const float *w, const float *rstd,
		     const float *dy, float *dx, float *dw);

/* LoRA on one linear layer. a, b NULL: no adapter. da, db (accumulated) NULL: frozen adapter.
 * dropout p > 0 (PEFT's lora_dropout, training): the adapter sees x with each element kept with
 * probability 1 - p and scaled by 1 / (1 - p); the mask is a function of (mask_key, token,
 * feature), so a forward, its recompute and its backward with the same key agree. */
typedef struct {
	const float *a; /* [r, in] */
	const float *b; /* [out, r] */
	float *da, *db;
	int rank;
	float scale;    /* lora_alpha / r (or / sqrt(r), rsLoRA) */
	float dropout;  /* in [0, 1); 0: none */
	uint64_t mask_key;
} tier_lora_ref;

/* Floats of scratch that tier_linear_fwd and _bwd need: 2 * T * rank, plus T * in with dropout
 * (0 without LoRA). */
size_t tier_linear_ws_floats(int T, int in, const tier_lora_ref *lora);
/* 1 when element (t, i) of the input is kept by the dropout mask of (key, p). */
int tier_lora_keep(uint64_t key, float p, int64_t t, int64_t i);
/* y [T, out] = x W^T + scale (x A^T) B^T. ws: tier_linear_ws_floats floats (NULL when 0). */
int tier_linear_fwd(tier_dev *dev, int T, int in, int out, const float *x, const float *w,
		    const tier_lora_ref *lora, float *y, float *ws);
/* dx [T, in] written (or added to when accumulate is 1; NULL: not wanted) = dy W + scale (dy B) A;
 * da += scale (dy B)^T x, db += scale dy^T (x A^T). The frozen W gets no gradient. */
int tier_linear_bwd(tier_dev *dev, int T, int in, int out, const float *x, const float *w,
		    const tier_lora_ref *lora, const float *dy, float *dx, int accumulate, float *ws);

/* out [T, dim] = table[tokens[t]]; -EINVAL names the first token outside 0..vocab-1. */
int tier_embed_fwd(tier_dev *dev, int T, int vocab, int dim, const int32_t *tokens, const float *table,
		   float *out);
/* dtable [vocab, dim] accumulated with the rows of dout (scatter-add). The trainer's table is
 * frozen and never calls this: the gradient of the embedding output goes nowhere. */
int tier_embed_bwd(tier_dev *dev, int T, int vocab, int dim, const int32_t *tokens, const float *dout,
		   float *dtable);

/* SwiGLU of the dense MLP: h = silu(g) * u; backward dg, du written from dh. */
int tier_swiglu_fwd(tier_dev *dev, size_t n, const float *g, const float *u, float *h);
int tier_swiglu_bwd(tier_dev *dev, size_t n, const float *g, const float *u, const float *dh, float *dg,
		    float *du);

/* ---- LoRA settings -------------------------------------------------------------------------- */
enum {
	TIER_LORA_Q = 1u << 0, TIER_LORA_K = 1u << 1, TIER_LORA_V = 1u << 2, TIER_LORA_O = 1u << 3,
	TIER_LORA_MLP = 1u << 4,     /* gate/up/down of the dense MLP layers (mlp_only_layers) */
	TIER_LORA_EXPERTS = 1u << 5, /* gate/up/down of every routed expert */
};
/* "q,k,v,o,mlp,experts" (any subset, comma separated; "attn" = q,k,v,o; "all" = everything).
 * 0 or -EINVAL naming the unknown word; *out unchanged on failure. */
int tier_lora_targets_parse(const char *list, unsigned *out);

typedef struct {
	int r;              /* rank >= 1 */
	float alpha;        /* lora_alpha; scale = alpha / r, or alpha / sqrt(r) with use_rslora */
	int use_rslora;
	unsigned targets;   /* TIER_LORA_* bits */
	float dropout;      /* lora_dropout in [0, 1): attention and dense-MLP targets, CPU and CUDA (-ENOTSUP
	                     * for expert targets, as PEFT's fused experts) */
	uint64_t seed;      /* A: kaiming-uniform(a=sqrt(5)) as PEFT, i.e. U(-1/sqrt(in), 1/sqrt(in)) */
	float init_b_std;   /* 0: B = 0 as PEFT; > 0: B ~ N(0, std) (tests, golden fixtures) */
} tier_lora_cfg;
void tier_lora_cfg_init(tier_lora_cfg *c); /* r 8, alpha 16, q,k,v,o,experts, dropout 0, seed 0 */

/* ---- Model ------------------------------------------------------------------------------------
 * A qwen3_moe (or mixtral) model whose weights are store objects: one DENSE frozen object per (layer, tensor)
 * (norms, q/k/v/o, q/k norms, router, dense MLP), one EXPERT frozen object per (layer, expert)
 * holding gate [I, H], up [I, H], down [H, I] back to back; embed_tokens, model.norm and lm_head
 * (the embedding itself when tied) DENSE frozen. LoRA: one LORA object of parameters, one LORA
 * object of gradients and one OPTIM object of AdamW moments per group (a layer's attention
 * projections or its dense MLP), and one such set per layer for all its experts' groups. */
typedef struct tier_model tier_model;

/* The default job's model: 6 layers, H 128, 4 heads / 2 KV heads of 32, 16 experts of I 128, k 2,
 * norm_topk_prob, vocab 260 (bytes + 4 specials), tied embeddings, layer 3 a dense MLP of 192
 * (mlp_only_layers), rope_theta 1e4, rms_norm_eps 1e-6. About 17 MB of fp32 base weights. */
void tier_model_config_default(tier_hf_config *c);

/* Create the model's objects in `s` (no data yet; LoRA A and B initialised). Returns 0, -EINVAL
 * (bad config or LoRA settings, named), -ENOTSUP (model_type other than qwen3_moe or mixtral, LoRA
 * dropout on expert targets, a CUDA context in a build without CUDA), -ENOMEM or the store's
 * error; *out NULL and no object left on failure. */
int tier_model_create(tier_store *s, tier_dev *dev, const tier_hf_config *cfg, const tier_lora_cfg *lora,
		      tier_model **out);
/* Destroy the model's objects (the store stays). NULL is fine. */
void tier_model_destroy(tier_model *m);
/* Deterministic synthetic base weights written straight into the store (TIER_ACQ_INIT): linears
 * and embeddings N(0, init_range) (HF's initializer_range, 0.02), norms 1. Each object's values
 * depend only on (seed, its name), so a budget or load order never changes them. */
int tier_model_init_random(tier_model *m, uint64_t seed, double init_range);
/* Load the base weights from an HF checkpoint directory (tier_ckpt_open; per-expert or fused
 * experts; F32/BF16/F16 converted to fp32). -ENOENT/-EBADMSG naming the tensor that is missing or
 * has the wrong shape. A failed load leaves the model without data (load again). */
int tier_model_load_hf(tier_model *m, const char *dir);
/* Progress of tier_model_load_hf and tier_model_init_random: fn(done, total, arg) after each
 * object, with the bytes of base weights written so far and in all (done == total at the end of
 * a successful fill). fn returns 0 to go on; anything else stops the fill, which then fails with
 * -ECANCELED and leaves the model without data, as any failed load (a caller's Ctrl-C need not
 * wait for minutes of weights). NULL fn: none. */
typedef int (*tier_progress_fn)(uint64_t done, uint64_t total, void *arg);
void tier_model_set_progress(tier_model *m, tier_progress_fn fn, void *arg);
const tier_hf_config *tier_model_config(const tier_model *m);
uint64_t tier_model_base_bytes(const tier_model *m);  /* bytes of all frozen weights */
uint64_t tier_model_lora_params(const tier_model *m); /* trainable parameters */

/* LoRA weights (which = 0) or their gradients (which = 1) of the last tier_trainer_eval with
 * grads = 1, as a PEFT adapter (modules named as PEFT names them; r, lora_alpha, use_rslora,
 * target_modules filled). Free with tier_peft_free. -ENOMEM, the store's error, or -ENODATA for
 * gradients after a training step (its optimizer dropped them). */
int tier_model_lora_export(tier_model *m, int which, tier_peft_adapter **out);
/* Set the LoRA weights from an adapter (tier_peft_load): every module of the model must be in it
 * with matching shapes and r (-EINVAL naming the first that is not); its scale is the model's. */
int tier_model_lora_import(tier_model *m, const tier_peft_adapter *a);

/* ---- Training ----------------------------------------------------------------------------------- */
typedef struct {
	int batch, seq;         /* a micro-batch is batch sequences of seq tokens */
	int micro_batches;      /* gradient accumulation (>= 1) */
	int steps;              /* total steps (for the cosine schedule) */
	int warmup;             /* linear warmup steps: lr (s + 1) / warmup for s < warmup */
	float lr, min_lr_ratio; /* cosine from lr down to lr * min_lr_ratio */
	float beta1, beta2, eps, weight_decay; /* AdamW (PyTorch's form: decoupled decay) */
	float clip;             /* global gradient-norm clip (0: none) */
	/* Operator cache (cache/): rules in tier_cache_config_parse's syntax, e.g. "all:hbm=40G". Each
	 * layer offers its forward's results (attention half, MLP half) and the backward uses what was
	 * kept instead of recomputing it. NULL or "": none (full recompute, the default). */
	const char *opcache;
	/* The MoE half of each layer runs over the micro-batch in this many token chunks (0 or 1: in
	 * one), forward and backward (the backward recomputes a chunk's forward just before its
	 * backward): the MoE block's saved state and workspace, the largest parts of the scratch, shrink
	 * by that factor, for a larger batch under an HBM budget; the experts' products get smaller
	 * groups. batch x seq must divide by it. The router must have no aux loss, z-loss or capacity
	 * limit (they depend on every token of the micro-batch); the op cache keeps no MoE half. */
	int moe_chunks;
	/* With micro_batches > 1: each operation runs every micro-batch (layer 0's forward for all of
	 * them, then layer 1's, ...; the backward likewise), so that a layer's weights are fetched
	 * once a step instead of once per micro-batch. Each micro-batch keeps its own layer inputs
	 * (store objects, spilled to DDR under a small budget) and running gradient (in the scratch).
	 * The same sums in the same order: the losses equal the micro-batch-major step's bit for bit. */
	int layer_major;
	/* Each layer's AdamW update runs just before that layer's first forward in the next step, not
	 * in a phase at the step's end: the same updates in the same values (the global norm's clip
	 * is known by then), but the optimizer state's transfers overlap the forward of the layer
	 * before. What is still due runs before anything reads or writes the LoRA state from outside
	 * the steps (tier_model_lora_export and _import, tier_trainer_save, tier_trainer_eval, and
	 * tier_trainer_destroy). Only where the HBM budget holds an optimizer set beside the step's
	 * scratch (else at the step's end: tier_trainer_optim_in_forward says which). */
	int optim_in_forward;
} tier_train_cfg;
/* batch 4, seq 64, 1 micro-batch, 100 steps, warmup 5, lr 2e-3, min_lr_ratio 0.1, betas 0.9/0.999,
 * eps 1e-8, weight decay 0, clip 1. */
void tier_train_cfg_init(tier_train_cfg *c);

typedef struct {
	float loss;        /* mean cross-entropy over the step's micro-batches */
	float aux;         /* router aux losses added to it (0 unless output_router_logits) */
	float grad_norm;   /* global LoRA gradient norm before clipping */
	float lr;          /* the learning rate applied */
	int64_t tokens;    /* tokens with a target in the step */
	uint64_t ns;       /* wall time of the step */
	/* Time by part (ns, summed over micro-batches). With parts_on_device, on the device's clock:
	 * the time between the compute stream's marks at the parts' ends (tier_marks), which includes
	 * the gaps where the device waited for the host. Else host time (with $TIER_PROFILE=1 every
	 * part waiting for the device at its end). PIN is always host time: acquiring objects, which
	 * overlaps the others. */
	uint64_t ns_part[9];
	/* The host time spent acquiring objects (waiting for a fetch, for room, for a writeback) by
	 * the part the host was in: ns_pin_part[TIER_PART_PIN] is 0, the sum being
	 * ns_part[TIER_PART_PIN]. Host time: on a GPU it may exceed the part's device time (the host
	 * waits for a fetch while the device still runs the part before). */
	uint64_t ns_pin_part[9];
	int parts_on_device; /* 1: ns_part is the device's time (tier_marks), 0: the host's */
	/* Operations whose end (waiting for their kernels, releasing what they pinned) was put off
	 * until the next one's kernels were queued ($TIER_PIPELINE=0: none); of them, those finished
	 * early because the next one's pin needed their room or an object they were filling. */
	int ops_pipelined, ops_finished_early;
	/* Routings to learn which experts to fetch (the router's choices read back to the host, a wait
	 * for the device): one per MoE layer and micro-batch forward. A backward's recompute pins its
	 * forward's experts instead (the MoE chunks' too), routing only where that forward's counts
	 * are missing. */
	int routes;
	/* Layers whose update from the step before ran inside this step's forward
	 * (tier_train_cfg.optim_in_forward); their time is in ns_part[TIER_PART_OPTIM]. */
	int updates_in_forward;
} tier_step_result;
enum { TIER_PART_EMBED, TIER_PART_ATTN_FWD, TIER_PART_ROUTE, TIER_PART_MLP_FWD, TIER_PART_LOSS,
       TIER_PART_MLP_BWD, TIER_PART_ATTN_BWD, TIER_PART_OPTIM, TIER_PART_PIN, TIER_NPARTS };
/* "embed", "attn_fwd", "route" (router and fetching the experts), "mlp_fwd", "loss", "mlp_bwd",
 * "attn_bwd", "optim", "pin"; NULL out of range. */
const char *tier_step_part_name(int part);

typedef struct tier_trainer tier_trainer;
/* Create a trainer for m: hands the step schedule to the store and creates the activation objects
 * (layer-boundary checkpoints, the scratch workspace). -EINVAL (bad config, named), -ENOSPC when
 * the HBM budget cannot hold one layer's weights with the workspace (message: bytes needed),
 * -ENOMEM. *out NULL on failure. */
int tier_trainer_create(tier_model *m, const tier_train_cfg *c, tier_trainer **out);
/* NULL is fine. An optimizer update still due (tier_train_cfg.optim_in_forward) runs first; should
 * it fail, the model's LoRA export and import refuse with the reason until a checkpoint is loaded. */
void tier_trainer_destroy(tier_trainer *t);
/* Bytes of HBM one step needs at least (largest layer's weights and LoRA state, two checkpoints,
 * the workspace). */
uint64_t tier_trainer_min_hbm(const tier_trainer *t);
/* Of it, the step's scratch: one layer's activations and gradients, the MoE and loss workspaces
 * (grows with batch x seq; what decides the largest batch under an HBM budget). */
uint64_t tier_trainer_scratch_bytes(const tier_trainer *t);
/* 1 when the optimizer runs in the next step's forward (tier_train_cfg.optim_in_forward, and the
 * budget allows it), 0 when at each step's end. */
int tier_trainer_optim_in_forward(const tier_trainer *t);
/* One optimizer step over micro_batches micro-batches: tokens and labels [micro_batches, batch,
 * seq] (labels: the target of each position, -100 for none). Returns 0 with *r filled, -EINVAL
 * (token or label out of range), or the store's error (the step is then lost: LoRA weights are
 * as before unless the failure hit the optimizer update itself; with optim_in_forward the updates
 * of the step before that its forward had made stay made, and those not yet made stay due). */
int tier_trainer_step(tier_trainer *t, const int32_t *tokens, const int32_t *labels, tier_step_result *r);
/* The operator cache's counters since the trainer was made: 0, or -ENOENT without a cache. */
int tier_trainer_cache_stats(tier_trainer *t, tier_cache_stats *out);

/* Optimizer steps taken (the next step's index: its learning rate and, in tier-run, its data). */
int64_t tier_trainer_steps_done(const tier_trainer *t);
/* Tokens the router sent to each expert of MoE layer `layer` in the last tier_trainer_step (all
 * its micro-batches) or tier_trainer_eval: out[num_experts]; each token counts once per expert of
 * its top-k. Returns 0, -EINVAL (layer out of range, NULL argument; out untouched), -ENOENT (a
 * dense layer; out untouched). Same thread as the steps. */
int tier_trainer_expert_counts(const tier_trainer *t, int layer, int64_t *out);
/* Training checkpoints: every LoRA group's weights and AdamW moments, the groups' step counts and
 * the step, in one safetensors file written atomically (a crash leaves the old file or the new
 * one). Resuming continues exactly: on the CPU the losses after a load equal an uninterrupted
 * run's. save: 0, -ENOMEM, -errno of the file system (the old file stays). load: 0, -EBADMSG
 * naming the tensor that is missing, sized for another model or LoRA setting, or damaged (a
 * negative step, a non-finite value, a negative second moment), all checked before anything
 * changes; or the store's error while the values go in, which can leave part of them loaded. */
int tier_trainer_save(tier_trainer *t, const char *path);
int tier_trainer_load(tier_trainer *t, const char *path);

/* For golden tests against HF transformers: one micro-batch [batch, seq] through the model.
 * hidden (may be NULL): [(L + 2), batch * seq, H]: 0 the embeddings, l + 1 the output of layer l,
 * L + 1 after the final norm. *loss: mean cross-entropy over labels (labels as above; the caller
 * shifts them as HF does). grads = 1 also computes the LoRA gradients of that loss (zeroed
 * first; read them with tier_model_lora_export(m, 1, ...)); no weights change. */
int tier_trainer_eval(tier_trainer *t, const int32_t *tokens, const int32_t *labels, int grads, float *loss,
		      float *hidden);

/* ---- Data ----------------------------------------------------------------------------------------
 * Token files (docs/data.md): "TIERTOK1", uint32 vocab size, uint32 separator token id, uint64
 * count, count uint32 tokens, all little-endian. Text: byte-level tokens (0..255) with documents
 * (paragraphs separated by an empty line) separated by TIER_TOK_SEP; vocab TIER_BYTE_VOCAB. */
#define TIER_BYTE_VOCAB 260
#define TIER_TOK_SEP 256
typedef struct tier_data tier_data;
/* Open a token file or a text file (by its first bytes). -ENOENT/-EACCES, -EBADMSG (bad header,
 * token >= vocab, truncated: named with the file), -ENOMEM. *out NULL on failure. */
int tier_data_open(const char *path, tier_data **out);
/* Tokens from memory (copied). */
int tier_data_from_tokens(const uint32_t *tokens, uint64_t count, uint32_t vocab, uint32_t sep, tier_data **out);
void tier_data_close(tier_data *d);
uint64_t tier_data_count(const tier_data *d);
uint32_t tier_data_vocab(const tier_data *d);
/* Write a token file atomically. 0, -EINVAL (a token >= vocab), -errno of the file system. */
int tier_data_write(const char *path, const uint32_t *tokens, uint64_t count, uint32_t vocab, uint32_t sep);
/* Sequence number `index` of the stream drawn by `seed`: tokens [seq] from a window of seq + 1
 * tokens at a start drawn from (seed, index) alone, labels [seq] the next token of each. -EINVAL
 * with a message when the data is shorter than seq + 1 tokens. */
int tier_data_sample(const tier_data *d, uint64_t seed, uint64_t index, int seq, int32_t *tokens, int32_t *labels);

#ifdef __cplusplus
}
#endif
#endif
