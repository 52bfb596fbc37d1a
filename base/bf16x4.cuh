/* bf16x4.cuh - four bf16 in one 8-byte access, and their fp32 form: the vector loads and stores of
 * the memory-bound kernels in core/, moe/ and attn/. The bits move as a uint2: a struct of two
 * __nv_bfloat162 is copied member by member, and its loads and stores split into 2- and 4-byte
 * accesses. Include from .cu files only. */
#ifndef TIER_BASE_BF16X4_CUH
#define TIER_BASE_BF16X4_CUH

#include <cuda_bf16.h>

/* The four bf16 held in v (in memory order) in fp32, exact. */
__device__ static inline float4 bf16x4_float4(uint2 v)
{
	float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&v.x), b = __bfloat1622float2(*(const __nv_bfloat162 *)&v.y);
	return make_float4(a.x, a.y, b.x, b.y);
}

/* The four bf16 at p (8-byte aligned) in fp32. */
__device__ static inline float4 bf16x4_load(const __nv_bfloat16 *p) { return bf16x4_float4(*(const uint2 *)p); }

/* x, y, z, w rounded to bf16 (to nearest even) and stored at p (8-byte aligned), in order. */
__device__ static inline void bf16x4_store(__nv_bfloat16 *p, float x, float y, float z, float w)
{
	__nv_bfloat162 a = __floats2bfloat162_rn(x, y), b = __floats2bfloat162_rn(z, w);
	*(uint2 *)p = make_uint2(*(const unsigned *)&a, *(const unsigned *)&b);
}

#endif
