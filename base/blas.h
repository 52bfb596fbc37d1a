/* blas.h - (internal) the fp32 matrix product every CPU reference uses: OpenBLAS when the build
 * has it, plain loops otherwise. Row-major; C = alpha op(A) op(B) + beta C, op = transpose when
 * ta / tb; beta == 0 overwrites C (NaN in C does not leak). M, N <= 0 do nothing; K == 0 scales. */
#ifndef TIER_BASE_BLAS_H
#define TIER_BASE_BLAS_H

#ifdef __cplusplus
extern "C" {
#endif

void base_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
		int ldb, float beta, float *C, int ldc);

#ifdef __cplusplus
}
#endif
#endif
