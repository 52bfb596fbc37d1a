/* pdl.cuh - programmatic dependent launch (sm_90): a kernel launched by tier_launch may be scheduled
 * while the kernel before it on the stream is still finishing, and waits in pdl_enter until that
 * kernel has completed and its writes are visible. What it saves is the gap between two kernels
 * (launch and ramp-up, 1-2 us each; a training step runs some 6,000 kernels). Every kernel that
 * tier_launch starts must call pdl_enter before it touches global memory; pdl_enter then lets the
 * next kernel be scheduled (once every block of this one has called it, that is once the last wave
 * is resident, so the early blocks never crowd this kernel out of its own SMs).
 *
 * Ordering stays transitive: a kernel passes pdl_enter only after its predecessor completed, which
 * completed only after its own predecessor, and so on; memory copies, cudaMemsetAsync, event waits
 * and cuBLAS's kernels keep the stream's full ordering (which is why our memsets are kernels too:
 * base/fill_cuda.cu). TIER_PDL=0 launches every kernel without the
 * attribute (pdl_enter then returns at once). Include from .cu files only. */
#ifndef TIER_BASE_PDL_CUH
#define TIER_BASE_PDL_CUH

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>
#include <utility>

/* First statement of every kernel tier_launch starts. */
__device__ __forceinline__ void pdl_enter(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;\n" ::: "memory");
	asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* Whether launches carry the attribute: compute capability 9 or more (the current device's, asked
 * once a translation unit) and TIER_PDL not 0. */
static inline int tier_pdl_on(void)
{
	static int on = -1;
	if (on < 0) {
		const char *e = getenv("TIER_PDL");
		int dev = 0, major = 0;
		on = !(e && !strcmp(e, "0")) && cudaGetDevice(&dev) == cudaSuccess &&
		     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
	}
	return on;
}

/* kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialisation allowed.
 * The error is cudaGetLastError's too, as after <<< >>>. */
template <typename... K, typename... A>
static inline cudaError_t tier_launch(void (*kernel)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
				      A &&...args)
{
	cudaLaunchAttribute at[1];
	memset(at, 0, sizeof at);
	at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[0].val.programmaticStreamSerializationAllowed = tier_pdl_on();
	cudaLaunchConfig_t cfg;
	memset(&cfg, 0, sizeof cfg);
	cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
	cfg.attrs = at, cfg.numAttrs = 1;
	return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

#endif
