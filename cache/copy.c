/* copy.c - copying an operator's output into a cache entry, on the CPU or on the caller's stream. */
#include "config.h"
#include <errno.h>
#include <string.h>
#include "cache/opcache_internal.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime.h>
#endif

int cache_copy_in(tier_dev *dev, void *dst, const void *src, uint64_t bytes, void *stream, int wait)
{
	if (!dev || tier_dev_kind_of(dev) == TIER_DEV_CPU) {
		memcpy(dst, src, bytes);
		return 0;
	}
#ifdef TIER_HAVE_CUDA
	/* cudaMemcpyDefault: the source is device memory, the entry device (HBM) or pinned host (DDR)
	 * memory. Waited for here unless the entry stays pinned until the caller's stream has passed
	 * the copy (tier_cache_offer_async): the store may move or drop it once it is released. */
	cudaStream_t st = (cudaStream_t)stream;
	cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st);
	if (e == cudaSuccess && wait)
		e = cudaStreamSynchronize(st);
	if (e != cudaSuccess)
		return tier_fail(-EIO, "op cache: copying %llu bytes into an entry failed: %s",
				 (unsigned long long)bytes, cudaGetErrorString(e));
	return 0;
#else
	return tier_fail(-ENODEV, "op cache: a CUDA device context in a build without CUDA");
#endif
}
