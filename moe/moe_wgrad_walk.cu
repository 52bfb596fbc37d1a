/* moe_wgrad_walk.cu - the LoRA weight gradients with few rows, dA_j,e [r, in] += alpha_j dZ_j^T X
 * (r <= 16), as a column walk: the auto rule's kernel for M <= 16 in moe_cuda_grouped_wgrad and
 * _wgrad2 (moe_grouped.cu; TIER_MOE_WGRAD_TILE=walk names it).
 *
 * Why: the tiled reduction (gw_kernel, 16 x 64 tiles) gives each CTA one 64-column tile of one
 * expert: at 256 rows an expert that is 4 stages, all issued in the prologue, so a CTA is one memory
 * round trip, a reduction of its 4 warps' partial tiles through shared memory and a store, and X is
 * read at 0.43 of the copy's rate (session 17's `tier-bench lora`, dA g+u 125.9 us on an H200).
 * Here a CTA takes WK_CHUNK column tiles of one expert and walks them one after another, each over
 * all the expert's rows, through one cp.async ring that does not drain between tiles; and each warp
 * owns 16 of a tile's 64 columns over every row of a stage (k), so a warp's accumulators are its
 * own part of C and no partial tiles are summed: after a tile's last rows each warp adds alpha times
 * its 16 x 16 to C.
 *
 * A stage: X's 64 rows x 64 columns and the 64 rows of each A_j (dZ_j [rows, M], zero past M). The
 * products: A = A_j^T (m the rank, k the rows; transposed fragments from [row][m]), B = X [row][col]
 * (transposed fragments). One CTA owns each (expert, column range): no atomics, one order, the same
 * bits from run to run; with NW = 2 each product accumulates exactly as alone, so _wgrad2's results
 * are _wgrad's bit for bit. Rows past the group and columns past N are zero-filled. mma.sync
 * m16n8k16 bf16 -> fp32 (sm_80 instructions). */
#include <stdint.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_wgrad.cuh"
#include "base/mma_sm80.cuh"

#define WK_BK 64                /* rows per stage; columns per tile */
#define WK_THREADS 128          /* 4 warps, 16 columns of a tile each */
#define WK_STAGES 4             /* 3 stages in flight; 3 CTAs an SM with two products */
#define WK_CHUNK 4              /* column tiles a CTA walks */
#define WK_LDX (WK_BK + 8)      /* X rows in shared memory, padded against ldmatrix bank conflicts */
#define WK_LDA (16 + 8)         /* A rows (M <= 16 columns), padded */

template <int NW>
struct wk_smem {
	static constexpr int X = WK_BK * WK_LDX, A = WK_BK * WK_LDA, STAGE = X + NW * A; /* bf16 */
	static constexpr size_t BYTES = (size_t)WK_STAGES * STAGE * sizeof(bf16);
};

/* acc[j][nj] += the stage's A_j^T X over its 64 rows, for the warp's columns 16 warp + 8 nj... */
template <int NW>
__device__ __forceinline__ void wk_mma(float (*acc)[2][4], const bf16 *sx, int warp, int lane)
{
	typedef wk_smem<NW> SM;
#pragma unroll
	for (int kk = 0; kk < WK_BK; kk += 16) {
		uint32_t b[4];
		ldsm4t(b, sx + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * WK_LDX + warp * 16 + (lane >> 4) * 8);
#pragma unroll
		for (int j = 0; j < NW; j++) {
			uint32_t a[4];
			ldsm4t(a, sx + SM::X + j * SM::A + (kk + (lane & 7) + (lane >> 4) * 8) * WK_LDA + ((lane >> 3) & 1) * 8);
			mma16816(acc[j][0], a, b);
			mma16816(acc[j][1], a, b + 2);
		}
	}
}

/* C_j,e [M, N] += alpha_j acc for the warp's 16 columns from c0: the accumulator (j, nj) holds rows
 * (m) g and g + 8 (g = lane / 4), columns 8 nj + 2 (lane % 4) and the next; then zeroed. */
template <int NW>
__device__ __forceinline__ void wk_store(float (*acc)[2][4], const gw_args<NW> &a, int e, int c0, int warp, int lane)
{
	int m = lane >> 2, n = c0 + warp * 16 + 2 * (lane & 3);
#pragma unroll
	for (int j = 0; j < NW; j++) {
		float *C = a.c[j][e];
#pragma unroll
		for (int nj = 0; nj < 2; nj++)
#pragma unroll
			for (int h = 0; h < 2; h++) {
				int mm = m + 8 * h, nn = n + 8 * nj; /* N % 8 == 0: nn + 1 < N too */
				if (C && mm < a.M && nn < a.N) {
					float2 *p = (float2 *)(C + (size_t)mm * a.N + nn), v = *p;
					v.x += a.alpha[j] * acc[j][nj][2 * h], v.y += a.alpha[j] * acc[j][nj][2 * h + 1];
					*p = v;
				}
				acc[j][nj][2 * h] = acc[j][nj][2 * h + 1] = 0.0f;
			}
	}
}

/* CTA b: expert b / nchunk, column tiles from (b % nchunk) WK_CHUNK; stage kt is tile kt / nslice,
 * rows slice kt % nslice (rows inner: a tile's sums are whole after its last slice). */
template <int NW>
__global__ void __launch_bounds__(WK_THREADS) wk_kernel(const __grid_constant__ gw_args<NW> a)
{
	typedef wk_smem<NW> SM;
	extern __shared__ __align__(16) unsigned char wk_raw[];
	int nchunk = (a.N + WK_BK * WK_CHUNK - 1) / (WK_BK * WK_CHUNK);
	int e = blockIdx.x / nchunk, row0 = a.off[e], rend = a.off[e + 1];
	bool want = false;
#pragma unroll
	for (int j = 0; j < NW; j++)
		want |= a.c[j][e] != NULL;
	if (!want || rend <= row0)
		return; /* not wanted, or no rows: C_e stays as it is */
	int n0 = blockIdx.x % nchunk * WK_BK * WK_CHUNK, ntile = min(WK_CHUNK, (a.N - n0 + WK_BK - 1) / WK_BK);
	int nslice = (rend - row0 + WK_BK - 1) / WK_BK, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	bf16 *ring = (bf16 *)wk_raw;
	float acc[NW][2][4];
#pragma unroll
	for (int j = 0; j < NW; j++)
#pragma unroll
		for (int nj = 0; nj < 2; nj++)
#pragma unroll
			for (int i = 0; i < 4; i++)
				acc[j][nj][i] = 0.0f;
	auto load = [&](int kt) {
		bf16 *s = ring + kt % WK_STAGES * SM::STAGE;
		int c0 = n0 + kt / nslice * WK_BK, r0 = row0 + kt % nslice * WK_BK;
		cp_async_tile<WK_BK, WK_BK, WK_LDX, WK_THREADS>(s, a.b, a.N, r0, rend, c0, a.N);
#pragma unroll
		for (int j = 0; j < NW; j++)
			cp_async_tile<WK_BK, 16, WK_LDA, WK_THREADS>(s + SM::X + j * SM::A, a.a[j], a.M, r0, rend, 0, a.M);
	};
	cp_async_ring<WK_STAGES>(ntile * nslice, load, [&](int slot, int kt) {
		wk_mma<NW>(acc, ring + slot * SM::STAGE, warp, lane);
		if (kt % nslice == nslice - 1)
			wk_store<NW>(acc, a, e, n0 + kt / nslice * WK_BK, warp, lane);
	});
	cp_async_wait<0>(); /* only empty groups remain; leave none behind */
}

template <int NW>
int gw_walk_launch(tier_dev *dev, const gw_args<NW> &a, int E)
{
	typedef wk_smem<NW> SM;
	long long nchunk = (a.N + WK_BK * WK_CHUNK - 1) / (WK_BK * WK_CHUNK), grid = nchunk * E;
	if (grid > 0x7fffffffLL)
		return tier_fail(-EINVAL, "moe_cuda_grouped_wgrad: %d experts x %lld column ranges is too many CTAs", E,
				 nchunk);
	CUDA_TRY(cudaFuncSetAttribute(wk_kernel<NW>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SM::BYTES));
	wk_kernel<NW><<<(unsigned)grid, WK_THREADS, SM::BYTES, moe_stream(dev)>>>(a);
	CUDA_LAUNCHED();
	return 0;
}

template int gw_walk_launch<1>(tier_dev *dev, const gw_args<1> &a, int E);
template int gw_walk_launch<2>(tier_dev *dev, const gw_args<2> &a, int E);
