/* moe_grouped.cu - an experimental device-side grouped GEMM for the experts' forward products:
 * Y [rows, N] = X [rows, K] W_e^T over the rows of each expert e, the work items (expert, 64-row
 * tile, 64-column tile) found on the device from the device offsets, so no host copy of the
 * offsets and one launch per projection instead of one per expert. WMMA bf16 16x16x16 tiles, fp32
 * accumulation, no software pipelining yet (a first version to measure against the per-expert
 * cuBLASLt loop on small groups). Opt-in: TIER_MOE_GROUPED=1 in the environment makes the experts'
 * forward use it when there is no LoRA and K and N are multiples of 8 (docs/moe.md). */
#include <mma.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"

using namespace nvcuda;

#define GB_M 64
#define GB_N 64
#define GB_K 32
#define GB_PAD 8
#define GB_THREADS 128

struct gemm_table {
	const bf16 *w[TIER_MOE_MAX_EXPERTS];
};

/* The (expert, row tile) of tile index b: each thread sums the row tiles of its experts, a scan over
 * the threads gives their first tile, and the owner of b walks its experts. Sets *e = -1 past the
 * last tile. */
__device__ static void find_tile(const int32_t *off, int E, int b, int *e_out, int *rt_out)
{
	__shared__ int part[GB_THREADS];
	__shared__ int se, srt;
	int tid = threadIdx.x, per = (E + GB_THREADS - 1) / GB_THREADS, e0 = tid * per;
	int e1 = e0 + per < E ? e0 + per : E, mine = 0;
	for (int e = e0; e < e1; e++)
		mine += (off[e + 1] - off[e] + GB_M - 1) / GB_M;
	part[tid] = mine;
	if (tid == 0)
		se = -1, srt = 0;
	__syncthreads();
	if (tid == 0) { /* exclusive scan of 128 values */
		int s = 0;
		for (int i = 0; i < GB_THREADS; i++) {
			int v = part[i];
			part[i] = s;
			s += v;
		}
	}
	__syncthreads();
	int first = part[tid];
	if (b >= first && b < first + mine) {
		int t = first;
		for (int e = e0; e < e1; e++) {
			int nt = (off[e + 1] - off[e] + GB_M - 1) / GB_M;
			if (b < t + nt) {
				se = e, srt = b - t;
				break;
			}
			t += nt;
		}
	}
	__syncthreads();
	*e_out = se, *rt_out = srt;
}

template <typename OUT>
__device__ static inline void put_out(OUT *p, float v);
template <>
__device__ inline void put_out<float>(float *p, float v) { *p = v; }
template <>
__device__ inline void put_out<bf16>(bf16 *p, float v) { *p = __float2bfloat16(v); }

template <typename OUT>
__global__ void __launch_bounds__(GB_THREADS) grouped_kernel(const __grid_constant__ gemm_table tab, int E, int N,
							     int K, const int32_t *off, const bf16 *X, OUT *Y)
{
	__shared__ __align__(128) bf16 As[GB_M][GB_K + GB_PAD];
	__shared__ __align__(128) bf16 Bs[GB_N][GB_K + GB_PAD];
	__shared__ __align__(128) float Cs[GB_M][GB_N + 4];
	int e, rt;
	find_tile(off, E, blockIdx.x, &e, &rt);
	if (e < 0)
		return; /* past the last tile: the grid is an upper bound */
	int row0 = off[e] + rt * GB_M, rend = off[e + 1], col0 = blockIdx.y * GB_N;
	const bf16 *W = tab.w[e];
	int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
	wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < 2; j++)
			wmma::fill_fragment(acc[i][j], 0.0f);
	const uint4 zero = make_uint4(0, 0, 0, 0);
	for (int k0 = 0; k0 < K; k0 += GB_K) {
		/* 64 x 32 of X and of W: 256 16-byte pieces each, two per thread */
		for (int q = tid; q < GB_M * GB_K / 8; q += GB_THREADS) {
			int r = q / (GB_K / 8), c = (q % (GB_K / 8)) * 8, gk = k0 + c;
			int gr = row0 + r, gn = col0 + r;
			uint4 a = gr < rend && gk < K ? *(const uint4 *)(X + (size_t)gr * K + gk) : zero;
			uint4 b = gn < N && gk < K ? *(const uint4 *)(W + (size_t)gn * K + gk) : zero;
			*(uint4 *)&As[r][c] = a;
			*(uint4 *)&Bs[r][c] = b;
		}
		__syncthreads();
		for (int kk = 0; kk < GB_K; kk += 16) {
			wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
			wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
			for (int i = 0; i < 2; i++)
				wmma::load_matrix_sync(fa[i], &As[wm * 32 + i * 16][kk], GB_K + GB_PAD);
			for (int j = 0; j < 2; j++) /* B (k, n) = W (n, k): Bs row n is column n of B */
				wmma::load_matrix_sync(fb[j], &Bs[wn * 32 + j * 16][kk], GB_K + GB_PAD);
			for (int i = 0; i < 2; i++)
				for (int j = 0; j < 2; j++)
					wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
		}
		__syncthreads();
	}
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < 2; j++)
			wmma::store_matrix_sync(&Cs[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], GB_N + 4,
						wmma::mem_row_major);
	__syncthreads();
	for (int q = tid; q < GB_M * GB_N; q += GB_THREADS) {
		int r = q / GB_N, c = q % GB_N, gr = row0 + r, gc = col0 + c;
		if (gr < rend && gc < N)
			put_out<OUT>(Y + (size_t)gr * N + gc, Cs[r][c]);
	}
}

extern "C" int moe_cuda_grouped_enabled(void)
{
	const char *v = getenv("TIER_MOE_GROUPED");
	return v && !strcmp(v, "1");
}

extern "C" int moe_cuda_grouped_linear(tier_dev *dev, int E, int N, int K, const int32_t *offsets, int rows_bound,
				       const void *const *w, const void *x, void *y, int y_bf16)
{
	const char *fn = "moe_cuda_grouped_linear";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "N", N)) || (rc = moe_check_dim(fn, "K", K)))
		return rc;
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(w, fn);
	MOE_NONNULL(x, fn);
	MOE_NONNULL(y, fn);
	if (K % 8 || (uintptr_t)x % 16)
		return tier_fail(-EINVAL, "%s: K = %d must be a multiple of 8 and x 16-byte aligned", fn, K);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0", fn, rows_bound);
	gemm_table tab;
	for (int e = 0; e < E; e++) {
		tab.w[e] = (const bf16 *)w[e];
		if (w[e] && (uintptr_t)w[e] % 16)
			return tier_fail(-EINVAL, "%s: the weight of expert %d is not 16-byte aligned", fn, e);
	}
	for (int e = E; e < TIER_MOE_MAX_EXPERTS; e++)
		tab.w[e] = NULL;
	/* sum_e ceil(n_e / 64) <= ceil(rows / 64) + E tiles */
	dim3 grid((unsigned)((rows_bound + GB_M - 1) / GB_M + E), (unsigned)((N + GB_N - 1) / GB_N));
	if (rows_bound == 0)
		return 0;
	if (y_bf16)
		grouped_kernel<bf16><<<grid, GB_THREADS, 0, moe_stream(dev)>>>(tab, E, N, K, offsets, (const bf16 *)x,
									       (bf16 *)y);
	else
		grouped_kernel<float><<<grid, GB_THREADS, 0, moe_stream(dev)>>>(tab, E, N, K, offsets, (const bf16 *)x,
										(float *)y);
	CUDA_LAUNCHED();
	return 0;
}
