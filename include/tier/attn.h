/* attn.h - causal softmax attention with GQA (flash-style, forward and backward) and RoPE.
 *
 * Layout: per call a batch of `batch` sequences of equal length `seq`; T = batch * seq tokens,
 * token-major. q and o are [T, n_heads, head_dim], k and v [T, n_kv_heads, head_dim] (row-major:
 * element (t, h, d) at (t * heads + h) * head_dim + d); lse is [T, n_heads] fp32. Sequences never
 * see each other. Query head h reads kv head h / (n_heads / n_kv_heads) (grouped-query attention,
 * as repeat_kv in Hugging Face transformers). With causal set, query i sees keys 0..i of its own
 * sequence. o = softmax(scale * q k^T + mask) v, with the softmax in fp32; lse is the natural
 * log-sum-exp of each row of scaled, masked scores (the forward saves it instead of the seq x seq
 * probabilities; the backward recomputes them from q, k and lse). See docs/attention.md.
 *
 * Devices: on a CPU context every array is fp32 host memory. On a CUDA context q, k, v, o and
 * dout are bf16 (__nv_bfloat16) device arrays, lse and dq, dk, dv fp32 device arrays; calls are
 * asynchronous on the context's stream. Nothing is allocated: scratch lives in the caller's
 * workspace (tier_attn_workspace_bytes says how much).
 *
 * Thread-safety: calls on distinct outputs and workspaces may run concurrently; one workspace
 * serves one call at a time. A failed call returns a negative errno with a message
 * (tier_last_error) and leaves its outputs unspecified; inputs are never written (except x of the
 * in-place RoPE calls). */
#ifndef TIER_ATTN_H
#define TIER_ATTN_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
	int64_t batch;       /* sequences per call (>= 1) */
	int64_t seq;         /* tokens per sequence (>= 1) */
	int64_t n_heads;     /* query heads (a multiple of n_kv_heads) */
	int64_t n_kv_heads;  /* key/value heads (>= 1) */
	int64_t head_dim;    /* CPU: any >= 1; CUDA: 32, 64, 96 or 128 */
	float scale;         /* score scale, finite and > 0 (HF: head_dim ** -0.5) */
	int causal;          /* 1: causal mask (the default), 0: every query sees its whole sequence */
} tier_attn_params;

/* Fill p for these shapes with scale = 1/sqrt(head_dim) and causal = 1. */
void tier_attn_params_init(tier_attn_params *p, int64_t batch, int64_t seq, int64_t n_heads,
			   int64_t n_kv_heads, int64_t head_dim);

/* Workspace bytes that tier_attn_fwd and tier_attn_bwd need for p on dev's kind (one workspace of
 * this size serves both). Returns 0 with *bytes set, or -EINVAL (bad parameters, message says
 * which; *bytes unchanged). Thread-safe. */
int tier_attn_workspace_bytes(const tier_dev *dev, const tier_attn_params *p, size_t *bytes);

/* Forward: o [T, n_heads, head_dim] and lse [T, n_heads] (both overwritten). ws holds at least
 * tier_attn_workspace_bytes (ws may be NULL when that is 0). Returns 0, -EINVAL (bad parameters or
 * pointers; message says which), -ENOSPC (workspace too small), -EIO (CUDA error). */
int tier_attn_fwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, void *o, float *lse, void *ws, size_t ws_bytes);

/* Backward from the forward's o and lse and the gradient dout of o: dq [T, n_heads, head_dim],
 * dk and dv [T, n_kv_heads, head_dim] (all overwritten, fp32; dk and dv sum the heads sharing a
 * kv head). Same errors as the forward. On CUDA dq (and, with GQA, dk and dv) are summed with fp32
 * atomics, so they may differ in the last bits from run to run; the CPU path is deterministic. */
int tier_attn_bwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, const void *o, const float *lse, const void *dout, float *dq, float *dk,
		  float *dv, void *ws, size_t ws_bytes);

/* ---- RoPE (Hugging Face's default rotary embedding, rotate_half convention) ----------------
 * For x [T, n_heads, head_dim] (head_dim even) and token t at position p_t: with half = head_dim/2,
 * inv_freq_i = 1 / theta^(2i / head_dim) and angle_i = p_t * inv_freq_i, both rounded to fp32 as
 * HF computes them, and for i < half:
 *     x'[i]        = x[i] cos(angle_i) - x[i + half] sin(angle_i)
 *     x'[i + half] = x[i + half] cos(angle_i) + x[i] sin(angle_i)
 * Positions: pos[t] (int32, device memory of the context) when pos is not NULL, else t % seq
 * (0..seq-1 within each sequence). The backward applies the inverse rotation (RoPE is
 * orthogonal), so dx = rope_bwd(dx') in place. */
typedef struct {
	int64_t tokens;      /* T (>= 1) */
	int64_t seq;         /* sequence length for default positions (>= 1; ignored with pos) */
	int64_t n_heads;     /* heads of x (>= 1) */
	int64_t head_dim;    /* even, >= 2 */
	float theta;         /* rope_theta (> 0, finite; Qwen3-MoE 1e6, Mixtral 1e6) */
} tier_rope_params;

/* In place. CPU: x fp32. CUDA: x bf16 for the forward (computed in fp32, rounded once), fp32 for
 * the backward (the gradients the attention backward produces). Returns 0 or -EINVAL (message
 * says which; x untouched), -EIO (CUDA error). Positions must be >= 0 (CPU checks them; CUDA
 * trusts them). Thread-safe on distinct x. */
int tier_attn_rope_fwd(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *x);
int tier_attn_rope_bwd(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *dx);

#ifdef __cplusplus
}
#endif
#endif
