/* attn_impl.h - (internal) what attn.c hands the CPU and CUDA backends: checked parameters and
 * the workspace layout. */
#ifndef TIER_ATTN_IMPL_H
#define TIER_ATTN_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include "tier/attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CPU tile sizes: a block of query rows against a block of keys. */
#define ATTN_CPU_BQ 64
#define ATTN_CPU_BK 64

/* Workspace of the CPU path in floats: scores and probabilities [BQ x BK], their gradients
 * [BQ x BK], output accumulator [BQ x D], running max and sum [2 x BQ], dk and dv accumulators
 * [2 x BK x D], and D = rowsum(dout * o) [T x n_heads]. */
size_t attn_cpu_ws_floats(const tier_attn_params *p);

int attn_cpu_fwd(const tier_attn_params *p, const float *q, const float *k, const float *v,
		 float *o, float *lse, float *ws);
int attn_cpu_bwd(const tier_attn_params *p, const float *q, const float *k, const float *v,
		 const float *o, const float *lse, const float *dout, float *dq, float *dk, float *dv,
		 float *ws);
void attn_cpu_rope(const tier_rope_params *r, const int32_t *pos, float *x, int inverse);

#ifdef TIER_HAVE_CUDA
/* CUDA: workspace of the backward (D = rowsum(dout * o), fp32 [T x n_heads]); the forward needs none. */
size_t attn_cuda_ws_bytes(const tier_attn_params *p);
int attn_cuda_fwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, void *o, float *lse);
int attn_cuda_bwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, const void *o, const float *lse, const void *dout, float *dq, float *dk,
		  float *dv, void *ws);
int attn_cuda_rope(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *x, int inverse);
/* Whether the wgmma kernels run here: head_dim 128, the current device of compute capability 9.0
 * (their code is sm_90a), the driver's TMA map encoder. */
int attn_wgmma_usable(int head_dim);
/* The forward on wgmma (attn_wgmma.cu: head_dim 128, compute capability 9.0, TMA): 0 when queued on
 * stream, -ENOTSUP for a shape or device it does not take (the caller runs another kernel), other
 * errors as usual. sl2: scale * log2(e); overlap: the softmax beside the previous block's P V (the
 * "wgo" variant), the same bits. */
int attn_wgmma_fwd(const tier_attn_params *p, const void *q, const void *k, const void *v, void *o, float *lse,
		   float sl2, int overlap, void *stream);
/* The wgmma backward's switches (attn_wgmma_bwd.cu): TIER_ATTN_BWD_DEBUG=nodq, TIER_ATTN_BWD_DQ
 * (atomic, tma), TIER_ATTN_BWD_DS (scalar, stm); -EINVAL naming a bad value. attn_cuda_bwd reads
 * them once, before choosing a kernel, so that a typo fails on any device and variant. */
typedef struct {
	int no_dq, dq_tma, ds_stm;
	int dq_asked; /* TIER_ATTN_BWD_DQ was set: a dq_tma that cannot be met is an error, not atomics */
} attn_bwd_switches;
int attn_bwd_switches_read(attn_bwd_switches *sw);
/* The backward on wgmma (attn_wgmma_bwd.cu), the same terms; Di: rowsum(dout o) [T x n_heads],
 * dq (and with atomic_kv dk, dv) cleared by the caller. */
int attn_wgmma_bwd(const tier_attn_params *p, const void *q, const void *k, const void *v, const void *dout,
		   const float *lse, const float *Di, float *dq, float *dk, float *dv, float scale, float sl2,
		   int atomic_kv, const attn_bwd_switches *sw, void *stream);
#endif

#ifdef __cplusplus
}
#endif
#endif
