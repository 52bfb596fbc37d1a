/* cuda_reduce.cuh - block-wide reductions and scans shared by the CUDA sources (moe/, core/). */
#ifndef TIER_BASE_CUDA_REDUCE_CUH
#define TIER_BASE_CUDA_REDUCE_CUH

/* Sum of v over the warp; every lane gets it. */
__device__ static inline float warp_sum(float v)
{
	for (int d = 16; d; d >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, d);
	return v;
}

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

/* The exclusive prefix sum of v over the block: a shuffle scan per warp, then the warp totals
 * (wsum: one shared int per warp). All threads; synchronises (once). */
__device__ static inline int block_exclusive_scan(int v, int *wsum)
{
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, incl = v;
#pragma unroll
	for (int d = 1; d < 32; d <<= 1) {
		int u = __shfl_up_sync(0xffffffffu, incl, d);
		if (lane >= d)
			incl += u;
	}
	if (lane == 31)
		wsum[warp] = incl;
	__syncthreads();
	int before = incl - v;
	for (int w = 0; w < warp; w++)
		before += wsum[w];
	return before;
}

#endif
