/* loss_impl.h - (internal) what loss.c hands the CPU and CUDA backends: checked parameters with
 * the chunk and block sizes resolved, the call's pointers, and the workspace layout. */
#ifndef TIER_LOSS_IMPL_H
#define TIER_LOSS_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include "tier/loss.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { LOSS_FWD = 1, LOSS_BWD = 2 };   /* a call's mode: FWD, BWD, or both (fused) */

typedef struct {
	int mode;
	const void *H, *W;
	const int32_t *labels;
	float *lse;                  /* written by FWD, read by BWD */
	float *loss;
	int64_t *count;
	float dloss;
	float *dH, *dW;              /* dW may be NULL */
	void *ws;
	size_t ws_bytes;
} loss_args;

/* Byte offsets of the workspace parts (each 256-byte aligned) and the total. CPU: logits fp32
 * [chunk x block], row state 4 doubles per token. CUDA: logits fp32 (the bf16 dlogits are written
 * over them), row state 4 floats per token, and a 256-byte block of scalars (sums, count, scale). */
typedef struct {
	size_t logits, state, scalars, total;
} loss_layout;

int loss_layout_of(const tier_loss_params *p, tier_dev_kind kind, loss_layout *l);

int loss_cpu_run(const tier_loss_params *p, const loss_args *a);
#ifdef TIER_HAVE_CUDA
int loss_cuda_run(tier_dev *dev, const tier_loss_params *p, const loss_args *a);
#endif

#ifdef __cplusplus
}
#endif
#endif
