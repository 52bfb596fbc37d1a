/* moe_swiglu.cuh - SwiGLU's elementwise arithmetic in fp32, shared by the elementwise kernels
 * (moe_experts.cu) and the fused backward epilogue of the wgmma products (moe_wgmma_store.cuh), so
 * that both give the same bits for each element. expf, not __expf: the backward is held to fp32
 * accuracy on the values it reads. */
#ifndef TIER_MOE_SWIGLU_CUH
#define TIER_MOE_SWIGLU_CUH

#include "moe/moe_cu.cuh"

static __device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* dU = dh silu(g), dG = dh u silu'(g), silu'(g) = s (1 + g (1 - s)). */
static __device__ __forceinline__ float2 swiglu_d(float x, float u, float d)
{
	float s = 1.0f / (1.0f + expf(-x));
	return make_float2(d * u * s * (1.0f + x * (1.0f - s)), d * x * s); /* dG, dU */
}

/* Eight elements at once: dg and du (bf16, og and ou) from g, u (bf16 in gv, uv) and dh (d); with
 * DOT the eight's share of dh . silu(g) u returned, summed in element order. */
template <bool DOT>
static __device__ __forceinline__ float swiglu_bwd8(uint4 gv, uint4 uv, const float (&d)[8], uint4 &og, uint4 &ou)
{
	const __nv_bfloat162 *g2 = (const __nv_bfloat162 *)&gv, *u2 = (const __nv_bfloat162 *)&uv;
	__nv_bfloat162 *og2 = (__nv_bfloat162 *)&og, *ou2 = (__nv_bfloat162 *)&ou;
	float dot = 0.0f;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		float2 x = __bfloat1622float2(g2[j]), y = __bfloat1622float2(u2[j]);
		float2 a = swiglu_d(x.x, y.x, d[2 * j]), b = swiglu_d(x.y, y.y, d[2 * j + 1]);
		og2[j] = __floats2bfloat162_rn(a.x, b.x);
		ou2[j] = __floats2bfloat162_rn(a.y, b.y);
		if (DOT)
			dot += d[2 * j] * silu_mul(x.x, y.x) + d[2 * j + 1] * silu_mul(x.y, y.y);
	}
	return dot;
}

/* Eight bf16 (16 bytes) as fp32. */
static __device__ __forceinline__ void bf16x8_to_f32(uint4 v, float (&d)[8])
{
	const __nv_bfloat162 *p = (const __nv_bfloat162 *)&v;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		float2 f = __bfloat1622float2(p[j]);
		d[2 * j] = f.x, d[2 * j + 1] = f.y;
	}
}
#endif
