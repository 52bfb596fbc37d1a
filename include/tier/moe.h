/* moe.h - the Mixture-of-Experts block: router, permute, grouped SwiGLU experts, combine, backward.
 *
 * Pure compute: raw pointers, shapes and a device context in; nothing allocated, no I/O. The CPU
 * path is the fp32 reference (OpenBLAS for the products when built with it). A CUDA context runs
 * the CUDA kernels (the .cu files of moe/) on device pointers with bf16 storage: see "CUDA" below for which
 * arguments are bf16 there (the float-typed parameters are then bf16 arrays passed as such).
 * Layouts are Hugging Face's, row-major, so checkpoints load as they are: router weight W_r [E, H]
 * (logits = x W_r^T); per expert gate_proj [I, H], up_proj [I, H], down_proj [H, I] (y = x W^T),
 * or a fused gate_up [2I, H]; LoRA A [r, in], B [out, r] (PEFT), y += scale (x A^T) B^T, never
 * forming B A. docs/moe.md has the formulas.
 *
 * Every function returns 0 or a negative errno (-EINVAL for bad shapes, configs or NULL pointers,
 * -ENOTSUP for a step that has no CUDA version, -EIO for a CUDA error) with a message
 * (tier_last_error). A failed step function has
 * written nothing (all checks come first); a failed layer call may have written parts of saved,
 * ws and dx when an expert that received rows has a NULL weight (known only once routing ran).
 * Thread-safety: the functions keep no state; concurrent calls are fine when their output buffers
 * do not overlap. Gradient outputs named "accumulated" are added to (the caller zeroes them
 * once); the others are written. */
#ifndef TIER_MOE_H
#define TIER_MOE_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TIER_MOE_MAX_EXPERTS 1024
#define TIER_MOE_MAX_TOPK 16

/* ---- Router ---------------------------------------------------------------------------------- */
typedef enum {
	/* softmax over all E (fp32), top-k, optional renormalisation of the k (Qwen3-MoE, Qwen2-MoE) */
	TIER_MOE_ROUTER_SOFTMAX_TOPK = 0,
	/* top-k of the logits, softmax over the k chosen (Mixtral) */
	TIER_MOE_ROUTER_TOPK_SOFTMAX = 1,
	/* sigmoid scores, selection by scores + bias, group-limited top-k, the un-biased scores of the
	 * chosen normalised (norm_topk_prob) and scaled by routed_scaling_factor (DeepSeek-V3) */
	TIER_MOE_ROUTER_SIGMOID_GROUP = 2,
} tier_moe_router_kind;

typedef struct {
	tier_moe_router_kind kind;
	int n_experts;               /* E: 1..1024 */
	int top_k;                   /* k: 1..16, <= E */
	int norm_topk_prob;          /* SOFTMAX_TOPK and SIGMOID_GROUP: renormalise the k weights */
	int n_group;                 /* SIGMOID_GROUP: groups (divides E); 0 or 1: no group limit */
	int topk_group;              /* SIGMOID_GROUP: groups kept, 1..n_group (ignored when n_group <= 1) */
	float routed_scaling_factor; /* SIGMOID_GROUP: weights multiplied by it (0 is read as 1) */
} tier_moe_router_cfg;

/* Check a router config; 0 or -EINVAL naming the bad field. */
int tier_moe_router_check(const tier_moe_router_cfg *cfg);

/* Forward: logits [T, E] = x [T, H] W_r^T in fp32; the k chosen experts per token, topk_idx [T, k]
 * (best first, ties to the lower index), and their weights topk_w [T, k]. bias [E] is DeepSeek's
 * e_score_correction_bias (selection only; NULL = zeros; only SIGMOID_GROUP reads it). */
int tier_moe_router_fwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, int H, const float *x,
			const float *w_r, const float *bias, float *logits, int32_t *topk_idx, float *topk_w);

/* Backward through the weights: d_logits [T, E] (written) from d_topk_w [T, k], with the selection
 * held fixed (top-k is piecewise constant). */
int tier_moe_router_weights_bwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, const float *logits,
				const int32_t *topk_idx, const float *d_topk_w, float *d_logits);

/* Backward through logits = x W_r^T: dx [T, H] and dw_r [E, H] accumulated (either may be NULL). */
int tier_moe_router_linear_bwd(tier_dev *dev, int T, int H, int E, const float *x, const float *w_r,
			       const float *d_logits, float *dx, float *dw_r);

/* ---- Auxiliary losses and counts ---------------------------------------------------------------
 * aux = aux_coef * E * sum_e f_e P_e, f_e = (token-slots routed to e) / T (so sum_e f_e = k, as in
 * HF's load_balancing_loss_func), P_e = mean_t softmax(logits_t)_e; z = z_coef * mean_t
 * logsumexp(logits_t)^2 (Switch / ST-MoE router z-loss). counts [E] (may be NULL): token-slots
 * routed to each expert before any capacity drop, the demand the store's hotness wants. */
int tier_moe_aux_fwd(tier_dev *dev, int T, int E, int k, float aux_coef, float z_coef, const float *logits,
		     const int32_t *topk_idx, float *aux, float *z, int32_t *counts);
/* d_logits [T, E] accumulated with d_loss * d(aux + z)/d logits (f_e held constant, as in HF). */
int tier_moe_aux_bwd(tier_dev *dev, int T, int E, int k, float aux_coef, float z_coef, const float *logits,
		     const int32_t *topk_idx, float d_loss, float *d_logits);

/* ---- Permute ---------------------------------------------------------------------------------
 * Token-expert pairs p = t*k + j sorted by expert with a histogram and a prefix sum, stable, so
 * that within an expert the pairs keep token order. capacity > 0 keeps only the first `capacity`
 * pairs of each expert (by token order, as Switch does); the rest are dropped. capacity <= 0:
 * dropless. Outputs: offsets [E+1] (rows of expert e are offsets[e] .. offsets[e+1]-1, n_rows =
 * offsets[E]), row_pair [T*k] (pair of each row; entries past n_rows set to -1), pair_row [T*k]
 * (row of each pair, -1 when dropped), counts [E] (may be NULL; routed before drops). When x is
 * not NULL, xg [T*k, H] gets row r = x[row_pair[r] / k] (rows past n_rows untouched). */
int tier_moe_capacity(int T, int k, int E, float capacity_factor); /* ceil(cf*T*k/E); 0 if cf <= 0 */
int tier_moe_permute(tier_dev *dev, int T, int k, int E, int H, int capacity, const int32_t *topk_idx,
		     const float *x, int32_t *offsets, int32_t *row_pair, int32_t *pair_row, int32_t *counts,
		     float *xg);
/* Backward of the gather: dx [T, H] accumulated with dxg rows scattered back to their tokens. */
int tier_moe_permute_bwd(tier_dev *dev, int T, int k, int H, const int32_t *offsets, int E,
			 const int32_t *row_pair, const float *dxg, float *dx);

/* ---- Experts (SwiGLU, grouped over the permuted rows) ------------------------------------------ */
typedef enum { TIER_MOE_GATE_FIRST = 0, TIER_MOE_UP_FIRST = 1 } tier_moe_gate_up_order;

/* Per-expert weight pointers ([E] arrays). Either gate and up, or gate_up ([2I, H]: rows 0..I-1
 * gate then up with TIER_MOE_GATE_FIRST, the HF fused layout; up first with TIER_MOE_UP_FIRST).
 * An expert with no rows may have NULL pointers (a cold expert the store did not bring in). */
typedef struct {
	const float *const *gate;    /* [E] -> [I, H] */
	const float *const *up;      /* [E] -> [I, H] */
	const float *const *gate_up; /* [E] -> [2I, H], or NULL when gate and up are given */
	const float *const *down;    /* [E] -> [H, I] */
	tier_moe_gate_up_order order;
} tier_moe_experts;

/* LoRA on one projection of every expert: y += scale (x A_e^T) B_e^T. a, b NULL: no adapter.
 * da, db (accumulated in backward) may be NULL (frozen adapter). scale = alpha / r (or alpha /
 * sqrt(r), rsLoRA), chosen by the caller. The gradients of different experts must not overlap
 * (one buffer shared by several experts would lose updates: on CUDA the experts' products run at
 * the same time); A and B may be shared. */
typedef struct {
	const float *const *a; /* [E] -> [r, in] */
	const float *const *b; /* [E] -> [out, r] */
	float *const *da;      /* [E] -> [r, in] */
	float *const *db;      /* [E] -> [out, r] */
	int rank;
	float scale;
} tier_moe_lora;
typedef struct { tier_moe_lora gate, up, down; } tier_moe_loras;

/* Scratch for tier_moe_experts_fwd and _bwd over `rows` permuted rows (offsets[E]). */
size_t tier_moe_experts_ws_bytes(int inter, int rows, const tier_moe_loras *lora);
/* Forward over rows 0..offsets[E]-1 of xg [*, H]: g, u [*, I] (pre-activation, saved for
 * backward), y [*, H] = (silu(g) * u) down^T (+ LoRA). lora may be NULL. ws: scratch above.
 * y NULL: g and u only, no down product (a backward's recompute: the backward does not read y). */
int tier_moe_experts_fwd(tier_dev *dev, int E, int H, int inter, const int32_t *offsets, const tier_moe_experts *w,
			 const tier_moe_loras *lora, const float *xg, float *g, float *u, float *y, void *ws);
/* Backward: dxg [*, H] written from dy [*, H]; LoRA da, db accumulated (skipped where NULL);
 * frozen expert weights get no gradient. ws: scratch above. row_dot: NULL, or [offsets[E]] fp32
 * written with dh[r] . h[r], where h = silu(g) u is the down product's input and dh = dy[r] down
 * (+ LoRA) its gradient: that is dy[r] . y[r], so with dy = w d_out (combine_bwd) it is w times the
 * router weight's gradient, which tier_moe_combine_dw turns into d_topk_w without y. */
int tier_moe_experts_bwd(tier_dev *dev, int E, int H, int inter, const int32_t *offsets, const tier_moe_experts *w,
			 const tier_moe_loras *lora, const float *xg, const float *g, const float *u,
			 const float *dy, float *dxg, float *row_dot, void *ws);

/* ---- Combine -----------------------------------------------------------------------------------
 * out [T, H] (written) = sum_j topk_w[t, j] * y[pair_row[t*k + j]], dropped pairs adding nothing. */
int tier_moe_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const float *y, float *out);
/* dy [rows, H] (written for every kept row) = w * d_out[t]; d_topk_w [T, k] (written) =
 * d_out[t] . y[row], 0 for dropped pairs. y and d_topk_w both NULL: dy only (the layer's backward,
 * which takes d_topk_w from tier_moe_combine_dw instead and so needs no saved y). */
int tier_moe_combine_bwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const float *y, const float *d_out, float *dy, float *d_topk_w);
/* d_topk_w [T, k] (written) = row_dot[row] / w for every kept pair (row_dot from
 * tier_moe_experts_bwd, dy from combine_bwd: row_dot = w d_out[t] . y[row]); 0 for dropped pairs and
 * for weights that are 0 or subnormal, where it cannot be recovered and hardly matters: every
 * router form multiplies a weight's gradient by the weight or its score (softmax p (..), sigmoid
 * s (1 - s)), so the logits lose nothing for w = 0 and less than FLT_MIN |d_topk_w| for a subnormal
 * w. A NaN weight gives NaN. */
int tier_moe_combine_dw(tier_dev *dev, int T, int k, const int32_t *pair_row, const float *topk_w,
			const float *row_dot, float *d_topk_w);

/* ---- CUDA ---------------------------------------------------------------------------------------
 * On a CUDA context (tier_dev_kind_of(dev) == TIER_DEV_CUDA) every pointer is device memory of that
 * context (the arrays of per-expert pointers are host arrays of device pointers), work is queued on
 * the context's stream, and storage is bf16 where the matrices feed tensor-core products:
 *   bf16: x, w_r, the expert weights, LoRA a and b, xg, g and u (saved, and the experts steps'),
 *         the experts' y, and combine_bwd's dy;
 *   fp32: bias, logits, topk_w, out, d_out, dx, dw_r, LoRA da and db, d_topk_w, d_logits, dxg,
 *         row_dot;
 *         int32 as on the CPU.
 * The whole block (tier_moe_layer_fwd / _bwd, with cfg.dtype = TIER_MOE_BF16) and the steps
 * tier_moe_router_fwd, tier_moe_permute (counts required), tier_moe_permute_bwd, tier_moe_combine_fwd,
 * tier_moe_combine_bwd, tier_moe_combine_dw, tier_moe_router_weights_bwd and tier_moe_experts_fwd /
 * _bwd run on CUDA;
 * tier_moe_router_linear_bwd and tier_moe_aux_fwd / _bwd answer -ENOTSUP there (the layer does
 * them). The layer and the experts steps synchronise the stream once per call to read the expert
 * offsets (and the layer's aux statistics) on the host, tier_moe_layer_route once to read the
 * counts and aux statistics, tier_moe_routing_check once; the other steps, the _routed calls
 * among them, do not synchronise. Limits on CUDA: H up to
 * 2^20 (the router's product runs on cuBLASLt, its selection keeps one token's E scores in a warp's registers); any I
 * and LoRA rank (no multiple-of-8 rule: cuBLASLt is told the real alignment). docs/moe.md. */
typedef enum {
	TIER_MOE_F32 = 0,  /* fp32 storage: the CPU reference */
	TIER_MOE_BF16 = 1, /* bf16 storage, fp32 accumulation: CUDA (see above) */
} tier_moe_dtype;

/* ---- The whole block ---------------------------------------------------------------------------- */
typedef struct {
	tier_moe_router_cfg router;
	int hidden;            /* H */
	int inter;             /* I: the experts' intermediate size (moe_intermediate_size) */
	float capacity_factor; /* <= 0: dropless */
	float aux_coef;        /* router_aux_loss_coef; 0: no aux loss */
	float z_coef;          /* router z-loss coefficient; 0: none */
	tier_moe_dtype dtype;  /* TIER_MOE_F32 on a CPU context, TIER_MOE_BF16 on CUDA (else -EINVAL) */
} tier_moe_cfg;

/* What backward needs from forward, carved by tier_moe_saved_bind from one caller buffer of
 * tier_moe_saved_bytes bytes (T tokens). Read-only for the caller after forward, except counts,
 * aux and z, which are the results core/ and the store read. */
typedef struct {
	int T;
	float *logits;     /* [T, E] */
	int32_t *topk_idx; /* [T, k] */
	float *topk_w;     /* [T, k] */
	int32_t *counts;   /* [E] routed token-slots per expert (before drops) */
	int32_t *offsets;  /* [E + 1] */
	int32_t *row_pair; /* [T*k] */
	int32_t *pair_row; /* [T*k] */
	float *g, *u;      /* [T*k, I] (bf16 with TIER_MOE_BF16) */
	float aux, z;      /* the losses of this forward (already times their coefficients) */
	int permuted;      /* CUDA, TIER_MOE_EARLY_PERMUTE: the route with counts permuted x into the
			    * workspace; the next tier_moe_layer_fwd_routed uses that (same x, same ws) */
	/* What the LoRA backward would otherwise compute again (CUDA, the grouped wgmma products):
	 * kept_z, bound by tier_moe_saved_bind_lora (NULL otherwise): the adapters' Z = scale X A^T
	 * bf16, gate's [rows, r_g], then up's, then down's (rows: the routed rows), kept_cols their
	 * rank sum at most. h_in_ws (the caller's, 0 after binding): 1 lets the backward take h =
	 * silu(g) u from the workspace where the forward left it, for a caller that runs nothing else
	 * on that workspace between the two. kept: the TIER_MOE_KEPT_* bits of what the last forward
	 * left (0 after binding); the backward reads only those. A caller that moves the buffer and
	 * binds it again sets kept back to the forward's value or leaves it 0 (then the backward
	 * computes Z again), and clears TIER_MOE_KEPT_H when the workspace served anything since. */
	void *kept_z;
	int kept_cols;
	int h_in_ws;
	int kept;
	/* kept_h, bound by tier_moe_saved_bind_keep with keep_h (NULL otherwise; bf16 storage only):
	 * h = silu(g) u [T*k, I] in the saved state itself, where the forward writes it; then
	 * TIER_MOE_KEPT_H means h is there, and it survives whatever ran on the workspace since (the
	 * operator cache's entries, read a whole step later, need no recompute). */
	void *kept_h;
} tier_moe_saved;
enum { TIER_MOE_KEPT_H = 1, TIER_MOE_KEPT_Z = 2 };

/* Bytes of the saved buffer and of the workspace for T tokens (device memory with TIER_MOE_BF16);
 * 0 when the config is bad. tier_moe_saved_bytes_lora: with room for kept_z (above) for adapters
 * of these ranks (only rank and whether a, b are set are read; lora NULL: none). */
size_t tier_moe_saved_bytes(const tier_moe_cfg *cfg, int T);
size_t tier_moe_saved_bytes_lora(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora);
size_t tier_moe_workspace_bytes(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora);
/* Point s's arrays into buf (tier_moe_saved_bytes long, 64-byte aligned pieces); _lora: a buffer of
 * tier_moe_saved_bytes_lora with the same lora, kept_z bound too. */
int tier_moe_saved_bind(const tier_moe_cfg *cfg, int T, void *buf, size_t bytes, tier_moe_saved *s);
int tier_moe_saved_bind_lora(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora, void *buf, size_t bytes,
			     tier_moe_saved *s);
/* The same with room for kept_h when keep_h (bf16 storage only; 0: as the _lora forms). */
size_t tier_moe_saved_bytes_keep(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora, int keep_h);
int tier_moe_saved_bind_keep(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora, int keep_h, void *buf,
			     size_t bytes, tier_moe_saved *s);

/* Forward: out [T, H] from x [T, H]; router weight w_r [E, H]; bias [E] or NULL (DeepSeek);
 * experts and optional LoRA; fills *saved. ws: tier_moe_workspace_bytes. out NULL: *saved only
 * (a backward's recompute: the combine, which the backward does not read, is skipped). */
int tier_moe_layer_fwd(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x, const float *w_r,
		       const float *bias, const tier_moe_experts *w, const tier_moe_loras *lora, float *out,
		       tier_moe_saved *saved, void *ws, size_t ws_bytes);
/* Backward: dx [T, H] written; dw_r [E, H] accumulated (NULL: frozen router); LoRA grads
 * accumulated; d_aux = d(total loss)/d(aux + z) (1 when the losses are added to the total, 0 to
 * leave them out). x, weights and saved as given to the forward. */
int tier_moe_layer_bwd(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x, const float *w_r,
		       const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *saved,
		       const float *d_out, float d_aux, float *dx, float *dw_r, void *ws, size_t ws_bytes);

/* The forward in two halves, for a caller that needs the routing on the host between them (a
 * trainer pinning the routed experts): tier_moe_layer_route then tier_moe_layer_fwd_routed do what
 * tier_moe_layer_fwd does, with one synchronisation on CUDA (the route's) instead of the layer's.
 *
 * tier_moe_layer_route: the router into saved (logits, topk_idx, topk_w) and, with counts (host
 * [E]), the pairs routed to each expert before the capacity's drops, and saved->aux and ->z.
 * counts NULL: the router alone, with no synchronisation (a backward's recompute, whose counts are
 * its forward's; saved->aux and ->z are left as they are). On CUDA with TIER_MOE_EARLY_PERMUTE=1 a
 * route with counts also permutes x into ws (saved->permuted), which the next
 * tier_moe_layer_fwd_routed then uses: give it the same x and ws. */
int tier_moe_layer_route(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x, const float *w_r,
			 const float *bias, tier_moe_saved *saved, void *ws, size_t ws_bytes, int32_t *counts);
/* The rest of the forward after tier_moe_layer_route on the same saved, given that routing's counts
 * (host [E]; the expert offsets follow from them and the capacity, so none are read back). If the
 * routing in saved does not give these counts (a recompute that routed differently) the CPU answers
 * -EIO; CUDA finishes the call on the host's offsets (written over the device's), within the
 * buffers but with wrong results, and records the mismatch for tier_moe_routing_check. */
int tier_moe_layer_fwd_routed(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x,
			      const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts, float *out,
			      tier_moe_saved *saved, void *ws, size_t ws_bytes);
/* The same with the residual added: out [T, H] = res + the block's output (res fp32 [T, H]; out
 * may be res; res NULL: as tier_moe_layer_fwd_routed). CUDA adds it in the combine, sparing a
 * decoder's h1 + MoE(h1) a pass of its own. res without out: -EINVAL. */
int tier_moe_layer_fwd_routed_res(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x,
				  const tier_moe_experts *w, const tier_moe_loras *lora, const int32_t *counts,
				  const float *res, float *out, tier_moe_saved *saved, void *ws, size_t ws_bytes);
/* tier_moe_layer_bwd given the forward's counts (as tier_moe_layer_fwd_routed): no synchronisation. */
int tier_moe_layer_bwd_routed(tier_dev *dev, const tier_moe_cfg *cfg, int T, const float *x, const float *w_r,
			      const tier_moe_experts *w, const tier_moe_loras *lora, const tier_moe_saved *saved,
			      const int32_t *counts, const float *d_out, float d_aux, float *dx, float *dw_r, void *ws,
			      size_t ws_bytes);
/* Whether every _routed call on dev since the last check found the offsets its counts give: 0, or
 * -EIO naming the first mismatch (then cleared). On CUDA a synchronisation; on the CPU always 0
 * (the calls answer -EIO themselves). */
int tier_moe_routing_check(tier_dev *dev);

#ifdef __cplusplus
}
#endif
#endif
