/* fill_cuda.cu - memset as a kernel launched with programmatic dependent launch (fill_cuda.h says
 * why). 16-byte stores for the aligned middle, single bytes for the ends. */
#include <cuda_runtime.h>
#include <stdint.h>
#include "base/fill_cuda.h"
#include "base/pdl.cuh"

namespace {

#define FILL_THREADS 256
#define FILL_MAX_BLOCKS 2048 /* enough to fill every SM several times over; the rest loop */

__global__ void __launch_bounds__(FILL_THREADS) fill_kernel(unsigned char *dst, unsigned char v, size_t head, size_t n16,
							    size_t n)
{
	pdl_enter();
	const size_t stride = (size_t)gridDim.x * blockDim.x, i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	const uint32_t w = v * 0x01010101u;
	uint4 *body = reinterpret_cast<uint4 *>(dst + head);
	for (size_t i = i0; i < n16; i += stride)
		body[i] = make_uint4(w, w, w, w);
	const size_t tail = head + 16 * n16;
	for (size_t i = i0; i < head + (n - tail); i += stride) /* the unaligned bytes before and after */
		dst[i < head ? i : tail + (i - head)] = v;
}

} /* namespace */

extern "C" int tier_cuda_fill(void *dst, int value, size_t n, void *stream)
{
	cudaStream_t s = (cudaStream_t)stream;
	if (!n)
		return 0;
	if (!tier_pdl_on())
		return (int)cudaMemsetAsync(dst, value, n, s);
	size_t head = (16 - (uintptr_t)dst % 16) % 16;
	head = head < n ? head : n;
	const size_t n16 = (n - head) / 16, work = n16 > n - 16 * n16 ? n16 : n - 16 * n16;
	size_t blocks = (work + FILL_THREADS - 1) / FILL_THREADS;
	blocks = blocks < FILL_MAX_BLOCKS ? blocks : FILL_MAX_BLOCKS;
	return (int)tier_launch(fill_kernel, (unsigned)blocks, FILL_THREADS, 0, s, (unsigned char *)dst,
				(unsigned char)value, head, n16, n);
}
