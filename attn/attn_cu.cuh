/* attn_cu.cuh - device helpers shared by the attention kernels (attn_cuda.cu, attn_wgmma.cu): the
 * reductions over the 4 threads that share a row of an mma / wgmma accumulator, and exp2 in one
 * MUFU instruction. Include from .cu files only. */
#ifndef TIER_ATTN_CU_CUH
#define TIER_ATTN_CU_CUH

/* Max and sum over the quad (lanes 4 g .. 4 g + 3) that holds a row's columns. */
static __device__ __forceinline__ float quad_max(float x)
{
	x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
	return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

static __device__ __forceinline__ float quad_sum(float x)
{
	x += __shfl_xor_sync(0xffffffffu, x, 1);
	return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* 2^x by ex2.approx.ftz (exp2f without fast-math adds a denormal fix-up of 3 instructions). */
static __device__ __forceinline__ float ex2(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
	return y;
}

#endif
