/* bench_opcache.h - tier-bench opcache: the model's state and its device half (CPU or CUDA). */
#ifndef TIER_TOOLS_BENCH_OPCACHE_H
#define TIER_TOOLS_BENCH_OPCACHE_H

#include <stddef.h>
#include <stdint.h>
#include "tier/tier.h"

typedef struct {
	tier_dev_kind kind;
	unsigned L, T, H, F, steps;
	double hbm_frac;
	uint64_t hbm, ddr;
	int ddr_set;
} oc_opts;

typedef struct {
	oc_opts o;
	size_t el;            /* bytes per element: 4 (fp32 CPU), 2 (bf16 CUDA) */
	uint64_t hbm, ddr;    /* op-cache budgets */
	tier_dev *dev;
	tier_store *store;
	void **X, **W;        /* checkpoints X_0..X_L, weights W_0..W_{L-1} (outside the store) */
	void *Z, *dZ, *G;     /* scratch: the forward's Z, the running gradient and its successor */
	void *plans;          /* CUDA: cuBLASLt plans by shape */
	int rc;
} oc_model;

/* Device half (bench_opcache_dev.c). Each returns 0 or a negative errno with a message. */
int oc_open(oc_model *m);
void oc_close(oc_model *m);
int oc_alloc(oc_model *m, size_t bytes, void **out);
void oc_free(oc_model *m, void *p);
int oc_fill(oc_model *m, void *dst, size_t n, float scale, uint64_t seed); /* uniform(-scale, scale) */
int oc_copy(oc_model *m, void *dst, const void *src, size_t bytes);
int oc_sync(oc_model *m);
/* Read n values of a device buffer as floats (bf16 widened on CUDA). */
int oc_read(oc_model *m, const void *src, size_t n, float *out);
void *oc_stream(oc_model *m);
/* Z[T x N] = X[T x K] W[K x N]; Y = gelu(Z) when Y is not NULL (row-major). */
int oc_matmul(oc_model *m, const void *X, const void *W, unsigned T, unsigned K, unsigned N, void *Z, void *Y);
/* G[T x K] = dZ[T x N] W^T, times gelu'(Zp) elementwise when Zp (T x K) is not NULL. */
int oc_matmul_bwd(oc_model *m, const void *dZ, const void *W, unsigned T, unsigned K, unsigned N, const void *Zp,
		  void *G);

#endif
