/* moe_internal.h - helpers shared by the moe/ sources: the matrix product and argument checks. */
#ifndef TIER_MOE_INTERNAL_H
#define TIER_MOE_INTERNAL_H

#include <errno.h>
#include <math.h>
#include "tier/moe.h"

#include "base/blas.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The matrix product: base_sgemm (row-major, strides as stored; OpenBLAS or loops). */
#define moe_gemm base_sgemm

/* Device check of the CPU code: CPU is fine, a CUDA context gets -ENOTSUP (a step without a CUDA
 * version: the caller should use the layer); NULL is -EINVAL. */
int moe_check_dev(tier_dev *dev, const char *fn);

/* Steps with a CUDA version hand a CUDA context to it (moe_cuda.h) before their CPU checks. Files
 * that use it include "config.h" first. */
#ifdef TIER_HAVE_CUDA
#define MOE_CUDA_DISPATCH(dev, call)                                                               \
	do {                                                                                       \
		if ((dev) && tier_dev_kind_of(dev) == TIER_DEV_CUDA)                               \
			return (call);                                                             \
	} while (0)
#else
#define MOE_CUDA_DISPATCH(dev, call) ((void)0)
#endif

/* Byte offsets into the CUDA layer's workspace (layer.c computes it, moe_layer.cu uses it). n = T k
 * rows, r the largest LoRA rank. Forward uses xg, h, z, dy (for y, when it combines), dh (the fp32
 * scratch of products not fused with their adapter), p, zs; backward all. */
typedef struct {
	size_t xg;  /* bf16 [n, H] gathered rows */
	size_t h;   /* bf16 [n, I] silu(g) u */
	size_t z;   /* moe_lora_z_bytes: tables, X A^T of two adapters */
	size_t dz;  /* moe_lora_dz_bytes: s dY B of two adapters */
	size_t dy;  /* bf16 [n, H] */
	size_t dg;  /* bf16 [n, I] */
	size_t du;  /* bf16 [n, I] */
	size_t dh;  /* fp32 [n, I] */
	size_t dxg; /* fp32 [n, H] */
	size_t dtw; /* fp32 [n] */
	size_t dot; /* fp32 [n] the experts' row_dot */
	size_t dl;  /* fp32 [T, E] */
	size_t dlb; /* bf16 [T, E] */
	size_t p;   /* fp32 [E] sum_t softmax(logits_t) */
	size_t zs;  /* fp32 [1] sum_t lse_t^2 */
	size_t total;
} moe_cuda_ws;
/* The layer's argument checks (layer.c), shared with moe_layer.cu. */
/* tier_moe_combine_fwd from the residual res [T, H] (NULL: from 0): out = res + the combine; out may
 * be res (tier_moe_layer_fwd_routed_res). */
int moe_combine_fwd_res(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			const float *y, const float *res, float *out);
int moe_cfg_check(const char *fn, const tier_moe_cfg *c, int T);
int moe_ws_check(const char *fn, const tier_moe_cfg *c, int T, const tier_moe_loras *lora, void *ws, size_t bytes);
int moe_saved_check(const char *fn, const tier_moe_saved *s, int T);
/* The LoRA scratch of the CUDA experts: z holds MOE_LORA_TAB_BYTES of weight tables for the wgmma
 * products' extra segments (moe_wgmma.h: MOE_WG_TAB_BYTES), then Z of two adapters [rows, r] each;
 * dz two dZ. Nothing without LoRA (r = 0). */
#define MOE_LORA_TAB_BYTES ((size_t)4 * TIER_MOE_MAX_EXPERTS * sizeof(void *))
static inline size_t moe_lora_z_bytes(size_t rows, int r) { return r > 0 ? MOE_LORA_TAB_BYTES + 4 * rows * r : 0; }
static inline size_t moe_lora_dz_bytes(size_t rows, int r) { return r > 0 ? 4 * rows * r : 0; }
void moe_cuda_ws_layout(const tier_moe_cfg *cfg, int T, const tier_moe_loras *lora, moe_cuda_ws *l);
int moe_lora_max_rank(const tier_moe_loras *lora);
/* Whether a projection has an adapter; the adapter of projection `which` (0 gate, 1 up, 2 down),
 * NULL without LoRA. */
static inline int moe_lora_on(const tier_moe_lora *l) { return l && l->a && l->b; }
static inline const tier_moe_lora *moe_lora_of(const tier_moe_loras *lo, int which)
{
	return !lo ? NULL : which == 0 ? &lo->gate : which == 1 ? &lo->up : &lo->down;
}

#define MOE_NONNULL(p, fn)                                                                         \
	do {                                                                                       \
		if (!(p))                                                                          \
			return tier_fail(-EINVAL, "%s: %s is NULL; pass a buffer of the documented size", \
					 fn, #p);                                                  \
	} while (0)

/* off[0..E] as tier_moe_permute makes them from the routed counts (host [E], before the drops) and
 * the capacity (0: dropless); -EINVAL naming the expert if a count is negative or the sum passes n. */
int moe_offsets_of(const char *fn, const int32_t *counts, int E, int n, int cap, int32_t *off);

/* T, H, E, k ranges (H or I may be passed as 'dim'). */
int moe_check_tk(const char *fn, int T, int k, int E);
int moe_check_dim(const char *fn, const char *name, int v);
/* The CUDA kernels' operands: a device buffer not NULL and 16-byte aligned; a host array of E device
 * pointers, each 16-byte aligned (NULL allowed: only experts without rows may have none). */
int moe_check_buf16(const char *fn, const char *name, const void *p);
int moe_check_table16(const char *fn, const char *name, int E, const void *const *w);

#ifdef __cplusplus
}
#endif

static inline float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Whether p is 16-byte aligned (the kernels' vector accesses). */
static inline int moe_a16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* Insert (v, i) into the descending list vals/idx of length n < cap... keeps the best `cap`.
 * Strict comparison: on ties the earlier (lower) index stays ahead. */
static inline void moe_topk_push(float *vals, int32_t *idx, int *n, int cap, float v, int32_t i)
{
	int p = *n < cap ? (*n)++ : cap;
	if (p == cap && !(v > vals[cap - 1]))
		return;
	if (p == cap)
		p = cap - 1;
	while (p > 0 && v > vals[p - 1]) {
		vals[p] = vals[p - 1];
		idx[p] = idx[p - 1];
		p--;
	}
	vals[p] = v;
	idx[p] = i;
}

#endif
