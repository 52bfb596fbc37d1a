/* loss.h - chunked cut-cross-entropy: the output layer's loss without the N x V logits.
 *
 * For hidden states H [N x D] (row-major), a classifier W [V x D] (row-major, the lm_head) and
 * labels [N] (int32, ignore_index marks tokens without a target), the loss of token i is
 *
 *     z_iv = softcap ? c * tanh(h_i . w_v / c) : h_i . w_v
 *     lse_i = log sum_v exp(z_iv)
 *     l_i = lse_i - (1 - eps) z_iy - eps/V sum_v z_iv + zl * lse_i^2
 *
 * (eps: label smoothing, zl: z-loss coefficient), summed or averaged over the non-ignored tokens.
 * Tokens are taken in chunks and the vocabulary in blocks; only a chunk x block tile of logits
 * exists at a time, in the caller's workspace, so memory is bounded at any N. See docs/loss.md.
 *
 * Devices: on a CPU context H, W, dH, dW are fp32 host arrays; on a CUDA context H and W are bf16
 * (__nv_bfloat16) device arrays, dH and dW fp32 device arrays. labels int32, lse fp32, loss fp32,
 * count int64, all in the context's memory. CUDA calls are asynchronous on the context's stream.
 * The loss allocates nothing: every scratch byte is in the workspace the caller passes.
 *
 * Thread-safety: calls on distinct outputs and workspaces may run concurrently; one workspace
 * serves one call at a time. A failed call returns a negative errno with a message (tier_last_error)
 * and leaves its outputs unspecified; inputs are never written. */
#ifndef TIER_LOSS_H
#define TIER_LOSS_H

#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TIER_LOSS_MEAN = 0, TIER_LOSS_SUM = 1 } tier_loss_reduction;

typedef struct {
	int64_t N, V, D;                 /* tokens, vocabulary, hidden size (all >= 1) */
	int32_t ignore_index;            /* label value of a token without a target (-100) */
	tier_loss_reduction reduction;   /* mean over counted tokens, or sum */
	float z_loss;                    /* coefficient of lse^2 (0: off) */
	float label_smoothing;           /* eps in [0, 1) (0: off) */
	float softcap;                   /* logit soft-capping c > 0 (Gemma 2), 0: off */
	float filter_eps;                /* backward skips tiles whose |dlogits| are all below it (0: off);
					  * CPU only; error bound in docs/loss.md */
	int64_t chunk_tokens;            /* tokens per chunk, 0: chosen from the workspace size */
	int64_t block_vocab;             /* vocabulary entries per block, 0: chosen likewise */
} tier_loss_params;

/* Defaults: ignore_index -100, mean, every option off, chunk and block automatic. */
void tier_loss_params_init(tier_loss_params *p, int64_t N, int64_t V, int64_t D);

/* Choose the chunk and block sizes for a device kind so that the workspace fits memory_bound bytes.
 * A non-zero p->chunk_tokens or p->block_vocab is kept as given. A whole-vocabulary block is
 * preferred (the fused forward+backward then needs two products, not three); the vocabulary is
 * split only when the bound cannot hold the minimum chunk. Returns 0, -EINVAL (bad parameters) or
 * -ENOSPC (the bound is below the smallest workspace; the message gives it); *chunk and *block are
 * written only on success. Thread-safe. */
int tier_loss_plan(const tier_loss_params *p, tier_dev_kind kind, uint64_t memory_bound,
		   int64_t *chunk, int64_t *block);

/* Workspace bytes the calls need for these parameters on a device kind (chunk and block sizes as
 * set, or, when 0, as tier_loss_plan picks for a 256 MiB bound). 0 or -EINVAL. Thread-safe. */
int tier_loss_workspace_bytes(const tier_loss_params *p, tier_dev_kind kind, size_t *bytes);

/* Forward: lse[N] (kept for the backward; tokens with ignored labels get theirs too), *loss (mean
 * or sum as asked; 0 when no token counts) and *count (tokens counted). When p's chunk or block is
 * 0 it is planned against ws_bytes. Returns 0, -EINVAL (bad shapes, pointers, labels, options;
 * message says which), -ENOSPC (workspace too small), -ENOTSUP (option not on this device), -EIO
 * (CUDA error). */
int tier_loss_fwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		  const int32_t *labels, float *lse, float *loss, int64_t *count, void *ws, size_t ws_bytes);

/* Backward from the forward's lse: dH [N x D] (overwritten) and, when dW is not NULL, dW [V x D]
 * (overwritten; pass NULL for a frozen lm_head, as under LoRA). dloss is the gradient of the
 * reduced loss (1 for a loss that ends the graph). Recomputes each tile. Same errors as forward. */
int tier_loss_bwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		  const int32_t *labels, const float *lse, float dloss, float *dH, float *dW,
		  void *ws, size_t ws_bytes);

/* Forward and backward in one pass, for a loss that ends the graph: the gradient of each chunk is
 * produced while its logits are at hand (two products in all with a whole-vocabulary block, three
 * when the vocabulary is split). Outputs as tier_loss_fwd plus tier_loss_bwd with this dloss. */
int tier_loss_fwd_bwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		      const int32_t *labels, float dloss, float *lse, float *loss, int64_t *count,
		      float *dH, float *dW, void *ws, size_t ws_bytes);

#ifdef __cplusplus
}
#endif
#endif
