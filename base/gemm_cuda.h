/* gemm_cuda.h - (internal) one cuBLASLt product, the one place the library calls cuBLASLt's matmul
 * (core/ops_cuda.cu's opsc_gemm, loss/, moe/'s moe_cuda_mm). Plain C types: includable without CUDA.
 *
 * Column-major, as cuBLAS: C [m, n] = alpha op(A) op(B) + beta C, op(X) = X or X^T per operand;
 * A stored m x k (k x m when transposed), B k x n (n x k), each with its leading dimension; fp32
 * accumulation. Operand types: CUDA_R_16BF or CUDA_R_32F (the cudaDataType_t values, as int); C
 * CUDA_R_32F or CUDA_R_16BF. m, n, k >= 1. Queued on `lane` of the context (< 0: its compute
 * stream; tier_dev_lane_stream) with that stream's workspace. The heuristic's choice is cached per
 * shape, with the dimension that varies between calls (the rows of a row-major operand: n when B is
 * not transposed, else k when A is not) rounded up to a power of two; a cached algorithm that
 * cuBLASLt refuses for the exact shape is replaced by a fresh query. fn names the caller in error
 * messages. Returns 0 or -EIO (cuBLASLt's status in the message). */
#ifndef TIER_BASE_GEMM_CUDA_H
#define TIER_BASE_GEMM_CUDA_H

#include "tier/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
	int trans;       /* 0: as stored, 1: transposed */
	const void *p;
	int type;        /* cudaDataType_t */
	int ld;
} tier_gemm_operand;

int tier_cuda_gemm(tier_dev *d, int lane, const char *fn, int m, int n, int k, float alpha, tier_gemm_operand A,
		   tier_gemm_operand B, float beta, void *C, int c_type, int ldc);
/* The same with the C that beta scales read from Cin (of C's type and layout; Cin may be C):
 * C = alpha op(A) op(B) + beta Cin, a residual added in the product's epilogue. */
int tier_cuda_gemm_cd(tier_dev *d, int lane, const char *fn, int m, int n, int k, float alpha, tier_gemm_operand A,
		      tier_gemm_operand B, float beta, const void *Cin, void *C, int c_type, int ldc);

#ifdef __cplusplus
}
#endif
#endif
