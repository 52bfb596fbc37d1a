/* blas.c - the shared fp32 matrix product of the CPU references (OpenBLAS or plain loops). */
#include "config.h"
#include <stddef.h>
#include "base/blas.h"
#ifdef TIER_HAVE_OPENBLAS
#include <cblas.h>
#endif

void base_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
		int ldb, float beta, float *C, int ldc)
{
	if (M <= 0 || N <= 0)
		return;
#ifdef TIER_HAVE_OPENBLAS
	if (K > 0) {
		cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
			    alpha, A, lda, B, ldb, beta, C, ldc);
		return;
	}
#endif
	/* Plain loops (also K == 0, where BLAS would still need beta applied). */
	for (int i = 0; i < M; i++)
		for (int j = 0; j < N; j++) {
			float s = 0.0f;
			for (int l = 0; l < K; l++)
				s += (ta ? A[(size_t)l * lda + i] : A[(size_t)i * lda + l]) *
				     (tb ? B[(size_t)j * ldb + l] : B[(size_t)l * ldb + j]);
			float *c = &C[(size_t)i * ldc + j];
			*c = alpha * s + (beta == 0.0f ? 0.0f : beta * *c);
		}
}
