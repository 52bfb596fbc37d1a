/* moe_cu.cuh - helpers shared by the moe/ CUDA sources: error checks and block reductions. */
#ifndef TIER_MOE_CU_CUH
#define TIER_MOE_CU_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include "moe/moe_internal.h"
#include "base/cuda_reduce.cuh"

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

#endif
