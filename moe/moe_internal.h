/* moe_internal.h - helpers shared by the moe/ sources: the gemm wrapper and argument checks. */
#ifndef TIER_MOE_INTERNAL_H
#define TIER_MOE_INTERNAL_H

#include <errno.h>
#include <math.h>
#include "tier/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Row-major C [M, N] = alpha * op(A) op(B) + beta * C, op = transpose when ta / tb; lda, ldb, ldc are
 * the row strides of A, B, C as stored. cblas_sgemm with OpenBLAS, else plain loops. */
void moe_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
	      int ldb, float beta, float *C, int ldc);

/* Device dispatch: CPU is fine, a CUDA context gets -ENOTSUP until moe.cu exists; NULL is -EINVAL. */
int moe_check_dev(tier_dev *dev, const char *fn);

#define MOE_NONNULL(p, fn)                                                                         \
	do {                                                                                       \
		if (!(p))                                                                          \
			return tier_fail(-EINVAL, "%s: %s is NULL; pass a buffer of the documented size", \
					 fn, #p);                                                  \
	} while (0)

/* T, H, E, k ranges (H or I may be passed as 'dim'). */
int moe_check_tk(const char *fn, int T, int k, int E);
int moe_check_dim(const char *fn, const char *name, int v);

#ifdef __cplusplus
}
#endif

static inline float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

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
