/* fill_cuda.h - (internal) memset as a kernel of ours (base/fill_cuda.cu): cudaMemsetAsync between
 * two kernels breaks their programmatic dependent launch (base/pdl.cuh) and leaves a gap of a few
 * microseconds on either side; a training step sets some 160 buffers (the attention backward's
 * fp32 gradients, the router's sums, the LoRA gradients). Plain C types: includable without CUDA. */
#ifndef TIER_BASE_FILL_CUDA_H
#define TIER_BASE_FILL_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* n bytes at dst (device memory) set to value (its low byte), queued on stream (a cudaStream_t).
 * Returns 0 or the launch's cudaError_t (as int). TIER_PDL=0 queues cudaMemsetAsync instead. */
int tier_cuda_fill(void *dst, int value, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif
