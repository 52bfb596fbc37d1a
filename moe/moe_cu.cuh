/* moe_cu.cuh - helpers shared by the moe/ CUDA sources: error checks and block reductions. */
#ifndef TIER_MOE_CU_CUH
#define TIER_MOE_CU_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include "moe/moe_internal.h"

#define CUDA_TRY(call)                                                                             \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return tier_fail(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call,         \
					 cudaGetErrorString(e_));                                  \
	} while (0)

/* After a launch: the launch error, if any. */
#define CUDA_LAUNCHED() CUDA_TRY(cudaGetLastError())

typedef __nv_bfloat16 bf16;

static inline int moe_cuda_dev(tier_dev *dev, const char *fn)
{
	if (!dev || tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", fn);
	return 0;
}

static inline cudaStream_t moe_stream(tier_dev *dev) { return (cudaStream_t)tier_dev_stream(dev); }

/* Sum of v over the block (blockDim.x a multiple of 32, <= 1024); red: 33 floats of shared memory.
 * Every thread gets the sum; red may be reused after the call. */
__device__ static inline float block_sum(float v, float *red)
{
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
	for (int d = 16; d; d >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, d);
	if (lane == 0)
		red[warp] = v;
	__syncthreads();
	if (threadIdx.x == 0) {
		float s = 0.0f;
		for (int i = 0; i < nw; i++)
			s += red[i];
		red[32] = s;
	}
	__syncthreads();
	v = red[32];
	__syncthreads();
	return v;
}

__device__ static inline float block_max(float v, float *red)
{
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
	for (int d = 16; d; d >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
	if (lane == 0)
		red[warp] = v;
	__syncthreads();
	if (threadIdx.x == 0) {
		float s = red[0];
		for (int i = 1; i < nw; i++)
			s = fmaxf(s, red[i]);
		red[32] = s;
	}
	__syncthreads();
	v = red[32];
	__syncthreads();
	return v;
}

#endif
