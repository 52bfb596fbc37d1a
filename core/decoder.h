/* decoder.h - (internal) one qwen3_moe decoder layer, forward and explicit backward, over buffers
 * carved from the trainer's scratch object. */
#ifndef TIER_CORE_DECODER_H
#define TIER_CORE_DECODER_H

#include "core/core_internal.h"
#include "tier/attn.h"

/* The addresses of one layer's weights and LoRA for one operation (pinned by the trainer). On
 * CUDA the weights and the LoRA a, b are bf16 (LoRA: bf16 copies of the fp32 master values). */
typedef struct {
	const float *w[W_NSLOTS];
	tier_lora_ref lora[4];      /* q, k, v, o */
	tier_lora_ref mlp[3];       /* dense MLP gate, up, down */
	tier_moe_experts ex;        /* expert pointers ([E] arrays; NULL for experts not pinned) */
	tier_moe_loras elora;       /* expert LoRA ([E] arrays), or all NULL */
	int has_elora;
} dec_weights;

/* Per-layer activations the backward reads (recomputed from the layer input) and its scratch.
 * On CUDA a, v, q, k, o, b, act and dO16 are bf16 (they feed products), and qp, kp under
 * dec_shape.qkv16 (the projections' bf16 outputs); the rest fp32. dO16 exists only on CUDA (the
 * bf16 gradient of o), v32 only on CUDA without qkv16 (the fp32 v projection). */
typedef struct {
	float *a, *r1, *qp, *kp, *v, *rq, *rk, *q, *k, *o, *lse, *h1, *b, *r2, *g, *u, *act, *mo, *v32;
	tier_moe_saved ms;
	float *dh1, *dtmp, *db, *dq, *dk, *dv, *dO, *dkp, *dact, *dg, *du, *dO16;
	float *o2, *lse2;       /* dec_shape.core2: a second block for the attention's output */
	void *o_home;           /* where the bind put o (and lse after it): block 0, wherever o is placed */
	void *ws;
	size_t ws_bytes;
	void *save[2];          /* what the backward reads of the forward: [0] attention, [1] MLP / MoE */
	size_t save_bytes[2];
	void *home;             /* the buffer the bind carved (where each half lives unless placed) */
	const int32_t *routed;  /* with dec_shape.routed: the host's counts [E] of the routing in ms,
				 * dec_route's (a forward) or the forward's (a backward), set before the
				 * MLP half runs */
} dec_bufs;

typedef struct {
	int T, batch, seq;
	int mT, mchunks;        /* the MoE half runs in mchunks chunks of mT tokens (T = mT mchunks) */
	tier_moe_cfg moe;
	tier_moe_loras elora;   /* the experts' adapters as the MoE block's sizes read them (ranks only) */
	tier_attn_params ap;
	tier_rope_params rq, rk;
	int core2;              /* the buffers hold a second o, lse block (o2, lse2): the backward reads
				 * one while the op cache's copy fills the other */
	int qk_fused;           /* CUDA: q and k through their norms and RoPE in one kernel each way
				 * (opsc_qk_fwd, opsc_qk_grad); 0: the separate steps */
	int qkv_cat;            /* CUDA with qk_fused and no LoRA dropout: the q, k and v projections'
				 * backward in one product (opsc_linear_bwd_cat), their gradients written
				 * into one buffer; 0: a product each */
	int qkv_fwd_cat;        /* with qkv_cat: their forward's adapters' x A^T in one product
				 * (opsc_linear_fwd_cat); 0: opsc_linear_fwd each */
	int qkv16;              /* CUDA with qk_fused, not qkv_fwd_cat: the q, k and v projections
				 * write bf16 (opsc_linear_fwd16): qp and kp are bf16, v the product's
				 * own output (no v32); 0: fp32, v rounded after */
	int attn_res;           /* the o projection adds the residual x in its epilogue (dop_linear_res);
				 * 0: an add of its own after it */
	int moe_res;            /* routed: the MoE block adds the residual h1 in its combine (its output
				 * straight into the layer's); 0: into b->mo, then a pass of its own */
	int keep_h;             /* CUDA, the MoE half in one chunk: h = silu(g) u kept in the MoE state
				 * (tier_moe_saved.kept_h), so that a state the op cache gives back
				 * needs no recompute of h in the backward (T k I bf16 more a state) */
	int routed;             /* the MoE block in routed halves (one chunk only): dec_route reads the
				 * counts back once, and the block runs on them (dec_bufs.routed) with no
				 * synchronisation of its own; a recompute routes again on the device and
				 * takes its forward's counts. 0: the block routes and reads back itself */
} dec_shape;

/* Fill the shape of a micro-batch (moe_chunks: tier_train_cfg's); the byte count of the buffers
 * (carve with dec_bufs_bind). */
int dec_shape_init(const tier_model *m, int batch, int seq, int moe_chunks, dec_shape *sh);
/* The bytes of the buffers, and (save not NULL) of the two save halves (save_bytes once bound). */
size_t dec_bufs_save_bytes(const tier_model *m, const dec_shape *sh, size_t save[2]);
void dec_bufs_bind(const tier_model *m, const dec_shape *sh, void *buf, dec_bufs *b);
/* Place save half h (its buffers, and for the MLP half the MoE state) at `at`, save_bytes[h]
 * bytes laid out as in the bound buffer (the operator cache's entry: the forward writes it there,
 * the backward reads it there); NULL puts it back in the bound buffer. The rest stays. */
void dec_bufs_place(const tier_model *m, const dec_shape *sh, dec_bufs *b, int h, void *at);

/* Attention half: x -> h1 = x + attn(norm1(x)), b = norm2(h1). In three parts: in (norm, q, k, v,
 * q/k norms, RoPE), core (the attention: o and lse), out (the o projection, residual, norm). */
int dec_attn_fwd(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b);
int dec_attn_fwd_in(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b);
int dec_attn_fwd_core(const tier_model *m, const dec_shape *sh, dec_bufs *b);
int dec_attn_fwd_out(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b);
/* The attention's output as one block: o, then lse at *lse_at (the layout's order, so that the
 * bound buffers' o..lse are such a block too); its bytes. core_place points b->o and b->lse into
 * a block at `at` (the operator cache's entry); dec_bufs_place(.., 0, NULL) puts them back. */
size_t dec_attn_core_bytes(const tier_model *m, const dec_shape *sh, size_t *lse_at);
/* Block i of the attention's output in the bound buffer: 0 the o, lse of the attention half, 1
 * the second (o2; NULL without dec_shape.core2). */
void *dec_attn_core_home(const dec_bufs *b, int i);
void dec_attn_core_place(const tier_model *m, const dec_shape *sh, dec_bufs *b, void *at);
/* The router into b->ms: counts [E] on the host; hidx: host scratch of T * k int32 (CUDA copies
 * the choices there; not with dec_shape.routed, which reads back the counts alone). */
int dec_route(const tier_model *m, const dec_shape *sh, const dec_weights *w, dec_bufs *b, int32_t *counts,
	      int32_t *hidx);
/* MLP half (moe: the router must have run into b->ms by dec_route): out = h1 + mlp(b); out NULL:
 * the saved state only (a backward's recompute: no down projection of a dense MLP, no MoE combine). */
int dec_mlp_fwd(const tier_model *m, const dec_shape *sh, int moe, const dec_weights *w, dec_bufs *b, float *out);
/* Backward after the forward ran into b: dx [T, H] written from dout; LoRA grads accumulated;
 * d_aux as in tier_moe_layer_bwd. */
int dec_bwd(const tier_model *m, const dec_shape *sh, int moe, const float *x, const dec_weights *w, dec_bufs *b,
	    const float *dout, float d_aux, float *dx);
/* dec_bwd in its two halves: the MLP's (b->db from dout), then the attention's (dx). With MoE
 * chunks the MLP half's backward first runs each chunk's forward again (the caller skips the
 * MLP forward of its recompute: dec_mlp_recompute says whether it is needed). */
int dec_mlp_recompute(const dec_shape *sh, int moe);
int dec_mlp_bwd(const tier_model *m, const dec_shape *sh, int moe, const dec_weights *w, dec_bufs *b,
		const float *dout, float d_aux);
int dec_attn_bwd(const tier_model *m, const dec_shape *sh, const float *x, const dec_weights *w, dec_bufs *b,
		 const float *dout, float *dx);

#endif
