/* moe_cu.cuh - helpers shared by the moe/ CUDA sources: error checks and block reductions. */
#ifndef TIER_MOE_CU_CUH
#define TIER_MOE_CU_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "base/cuda_reduce.cuh"

/* A failed call returns -EIO naming it, and leaves no error behind in the runtime (a launch's
 * error would stay there until a later launch check reported it as that launch's). */
#define CUDA_TRY(call)                                                                             \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess) {                                                           \
			(void)cudaGetLastError();                                                  \
			return tier_fail(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call,         \
					 cudaGetErrorString(e_));                                  \
		}                                                                                  \
	} while (0)

/* After a launch: the launch error, if any. */
#define CUDA_LAUNCHED() CUDA_TRY(cudaGetLastError())

typedef __nv_bfloat16 bf16;

/* Whether the environment sets name to value (the kernels' measurement and comparison knobs). */
static inline int moe_env_is(const char *name, const char *value)
{
	const char *v = getenv(name);
	return v && !strcmp(v, value);
}

static inline int moe_cuda_dev(tier_dev *dev, const char *fn)
{
	if (!dev || tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", fn);
	return 0;
}

static inline cudaStream_t moe_stream(tier_dev *dev) { return (cudaStream_t)tier_dev_stream(dev); }

/* Two adjacent outputs of an epilogue, fp32 or bf16 (the fp32 values rounded once). */
__device__ __forceinline__ float2 moe_get2(const float *p) { return *(const float2 *)p; }
__device__ __forceinline__ float2 moe_get2(const bf16 *p) { return __bfloat1622float2(*(const __nv_bfloat162 *)p); }
__device__ __forceinline__ void moe_set2(float *p, float v0, float v1) { *(float2 *)p = make_float2(v0, v1); }
__device__ __forceinline__ void moe_set2(bf16 *p, float v0, float v1)
{
	*(__nv_bfloat162 *)p = __floats2bfloat162_rn(v0, v1);
}

/* alpha (v0, v1) + beta C in fp32, stored once: a bf16 C is rounded once, not per term. */
template <typename OUT>
__device__ __forceinline__ void put2(OUT *p, float v0, float v1, float alpha, int beta)
{
	float2 v = make_float2(alpha * v0, alpha * v1);
	if (beta) { /* beta 0 never reads C: it may hold anything, NaN included */
		float2 o = moe_get2(p);
		v.x += o.x, v.y += o.y;
	}
	moe_set2(p, v.x, v.y);
}

/* BM-row tiles of the expert group [lo, hi) (no overflow near INT_MAX): how the grouped kernels
 * (moe_grouped.cu, moe_wgmma.cu, moe_skinny.cu) number their work from the device offsets. */
template <int BM>
__device__ __forceinline__ int moe_row_tiles(int lo, int hi)
{
	return hi > lo ? (hi - lo - 1) / BM + 1 : 0;
}

#endif
