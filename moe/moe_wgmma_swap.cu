/* moe_wgmma_swap.cu - the forward's plain grouped product (moe_cuda_grouped_mm_sm90 with w_kn 0 and
 * no extra segment) with its operands swapped: C_g^T = W_e X_g^T for each group g of rows, so that
 * the group's rows are the wgmma's N (a multiple of 32, up to 256) and the weights' rows its M
 * (TIER_MOE_WGMMA_TILE=swap; moe_wgmma.h).
 *
 * Why: the other tiles take rows as M, in 64-row blocks, so a group pads to a multiple of 64 (with
 * idle consumers) or 128. seed-896's uniform routing puts 111-184 rows in a group (146 on average):
 * the 128-row tiles multiply 1.70 times the useful rows, with idle consumers 1.29 times (session 30's
 * simulation). Here a group pads to a multiple of 32: about 1.11 times. On an H200 the useful
 * products of seed-896's gate-up take 0.86 ms at the dense GEMM's rate and its HBM floor is 1.14
 * ms, so with the padding below the floor the product is bound by memory alone; issue 4's target
 * (1.25x torch._grouped_mm's time there, 1.27 ms) lies between the two.
 *
 * A tile is 128 weight rows (output columns of C; two consumer warpgroups of 64) by one chunk of a
 * group: a group of n rows is cut into ceil(n / 256) chunks of equal size rounded up to 32 (300 rows:
 * two chunks of 160), and a chunk's nr rows (its size rounded up to 32) are the products' N. The
 * tiles go chunk by chunk, the column tiles of a chunk in turn, so the CTAs that run at once share
 * the chunk's rows of x through L2, and each expert's weights cross from HBM about once. CTA b takes
 * tiles b, b + grid, ...
 *
 * One CTA an SM, 384 threads: thread 0 of warpgroup 0 loads each stage by TMA (W_e's 128 x 64 box
 * from the expert's map, x's rows in 32-row boxes from one map of [rows_bound, K]; rows past
 * rows_bound read as zeros, rows of the next group are multiplied and never stored); warpgroups 1
 * and 2 multiply, each its 64 weight rows against the chunk's rows, and store their part of C: a
 * bf16 C without beta through a staging in shared memory, whole rows in 16-byte stores; an fp32 C
 * or beta 1 (one rounding of the sum) from the registers, each store instruction of a warp writing 8
 * adjacent columns of 4 rows. The staging takes the room of a fourth stage in every kernel. The
 * chunk table (each expert's first chunk, a prefix sum over the offsets) is built by every CTA at
 * its start. The other knobs of moe_wgmma.h (CTA pairs, TMA stores, the schedule, idle consumers)
 * do not apply here; TIER_MOE_WGMMA_CTAS does.
 *
 * The products of each row count are a function of their own (sw_tile_run<NR>), the switch between
 * them outside: a branch around wgmma within one function made ptxas serialise them (moe_wgmma.cu). */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include "moe/moe_wgmma_cfg.cuh"
#include "base/mma_sm80.cuh"
#include "base/sm90.cuh"
#include "base/tmap_cuda.h"
#include "base/pdl.cuh"

#define SW_THREADS 384
#define SW_BN 128                /* weight rows (C's columns) a tile: 64 a consumer */
#define SW_MAXR 256              /* rows a chunk at most: wgmma's largest N */
#define SW_RSTEP 32              /* a chunk's rows round up to this: x's box */
#define SW_W_BYTES (SW_BN * 128) /* a stage's W box: 128 rows of 64 k (128 bytes, the swizzle's row) */
#define SW_X_BYTES (SW_MAXR * 128)
#define SW_STAGE (SW_W_BYTES + SW_X_BYTES)
#define SW_STAGES 3
#define SW_RING (SW_STAGES * SW_STAGE)
/* a consumer's staging of a bf16 tile: its 64 columns of each chunk row, 128 bytes and 16 of padding
 * (the 8 rows of one stmatrix block then fall in distinct 16-byte bank groups) */
#define SW_OUT_ROW 144
#define SW_OUT_BYTES (SW_MAXR * SW_OUT_ROW)
/* the ring, the two stagings, the barriers, the chunk table (TIER_MOE_MAX_EXPERTS + 1 ints), the
 * scan's 12 warp sums, and the alignment's slack */
#define SW_OUT_AT SW_RING
#define SW_BARS_AT (SW_OUT_AT + 2 * SW_OUT_BYTES)
#define SW_SMEM (SW_BARS_AT + 16 * SW_STAGES + 4 * (TIER_MOE_MAX_EXPERTS + 1) + 4 * 12 + 1024)
static_assert(SW_SMEM <= 227 * 1024, "one CTA an SM: the ring, the stagings and the table fit 227 KiB");
static_assert(TIER_MOE_MAX_EXPERTS <= 3 * SW_THREADS, "the chunk table's scan takes 3 experts a thread");

namespace {

struct sw_args {
	CUtensorMap xmap;         /* x [rows_bound, K], 32-row boxes */
	const CUtensorMap *wmap;  /* device memory: W_e [N, K] in 128-row boxes, one map an expert */
	const int32_t *off;       /* the groups' offsets, device [E + 1] */
	void *c;                  /* C [rows, N], fp32 or bf16 */
	float alpha;
	int E, N, K, beta, rows_bound;
};

/* The map kernel's template and the experts' weights (8 KiB of pointers: parameter space). */
struct sw_map_args {
	CUtensorMap t;
	const void *w[TIER_MOE_MAX_EXPERTS];
	CUtensorMap *dst;
	int E;
};

/* A tile: rows [row0, rend) of expert e (nr: their count rounded up to 32), C's columns from col0. */
struct sw_tile {
	int e, row0, rend, nr, col0;
};

#ifdef TIER_SM90A
/* Group e's rows below rows_bound (rows past it are never computed, as in the other tiles). */
__device__ __forceinline__ int sw_rows(const sw_args &a, int e, int *start)
{
	int b = min(a.off[e], a.rows_bound), end = min(a.off[e + 1], a.rows_bound);
	*start = b;
	return max(end - b, 0);
}

/* cpre[e] = the chunks of the experts before e (cpre[E]: all of them), by every thread: 3 experts a
 * thread, then the block's scan of the thread sums (base/cuda_reduce.cuh). */
__device__ void sw_chunk_table(const sw_args &a, int *cpre, int *wsum)
{
	int t = threadIdx.x, n[3], s = 0, start;
	for (int i = 0; i < 3; i++) {
		int e = 3 * t + i;
		n[i] = e < a.E ? (sw_rows(a, e, &start) + SW_MAXR - 1) / SW_MAXR : 0;
		s += n[i];
	}
	int before = block_exclusive_scan(s, wsum);
	for (int i = 0; i < 3; i++) {
		int e = 3 * t + i;
		if (e < a.E)
			cpre[e] = before;
		before += n[i];
	}
	if (t == SW_THREADS - 1)
		cpre[a.E] = before;
	__syncthreads();
}

/* Tile t: chunk t / ncol (its expert the last e with cpre[e] <= the chunk: an empty expert's cpre
 * equals its successor's), column tile t % ncol. */
__device__ __forceinline__ sw_tile sw_find(const sw_args &a, const int *cpre, long long t, int ncol)
{
	int q = (int)(t / ncol), lo = 0, hi = a.E - 1, start;
	while (lo < hi) {
		int mid = (lo + hi + 1) >> 1;
		if (cpre[mid] <= q)
			lo = mid;
		else
			hi = mid - 1;
	}
	sw_tile tl;
	int n = sw_rows(a, lo, &start), chunks = cpre[lo + 1] - cpre[lo];
	int per = ((n + chunks - 1) / chunks + SW_RSTEP - 1) / SW_RSTEP * SW_RSTEP;
	tl.e = lo;
	tl.row0 = start + (q - cpre[lo]) * per;
	tl.rend = min(tl.row0 + per, start + n);
	tl.nr = (tl.rend - tl.row0 + SW_RSTEP - 1) / SW_RSTEP * SW_RSTEP;
	tl.col0 = (int)(t % ncol) * SW_BN;
	return tl;
}

/* Thread 0: every stage of the CTA's tiles, once the consumers have handed it back; the next tile's
 * map acquired while this one loads. */
__device__ void sw_produce(const sw_args &a, const int *cpre, uint32_t ring, uint32_t full, uint32_t empty,
			   long long total, int ncol)
{
	int s = 0;
	uint32_t ph = 0;
	if ((long long)blockIdx.x >= total)
		return;
	sw_tile tl = sw_find(a, cpre, blockIdx.x, ncol), nt = tl;
	tmap_acquire(a.wmap + tl.e, false); /* the CTA's first tile: no lookahead acquired it */
	for (long long t = blockIdx.x; t < total; t += gridDim.x, tl = nt) {
		if (t + gridDim.x < total) { /* the next tile, its map acquired unless it is this one's */
			nt = sw_find(a, cpre, t + gridDim.x, ncol);
			if (nt.e != tl.e)
				tmap_acquire(a.wmap + nt.e, true);
		}
		const CUtensorMap *wm = a.wmap + tl.e;
		int nb = tl.nr / SW_RSTEP;
		for (int k0 = 0; k0 < a.K; k0 += 64) {
			mbar_wait(empty + 8 * s, ph ^ 1);
			uint32_t st = ring + s * SW_STAGE;
			bar_expect_tx(full + 8 * s, SW_W_BYTES + nb * SW_RSTEP * 128);
			tma_load(st, wm, k0, tl.col0, full + 8 * s);
			for (int b = 0; b < nb; b++)
				tma_load(st + SW_W_BYTES + b * SW_RSTEP * 128, &a.xmap, k0, tl.row0 + b * SW_RSTEP, full + 8 * s);
			bar_arrive(full + 8 * s);
			ring_next(s, ph, SW_STAGES);
		}
	}
}

/* C[row, col] = alpha v (+ C[row, col] with beta), bf16 or fp32. */
template <typename OUT>
__device__ __forceinline__ void sw_put(const sw_args &a, int row, int col, float v)
{
	OUT *p = (OUT *)a.c + (size_t)row * a.N + col;
	v *= a.alpha;
	if (a.beta)
		v += (float)*p;
	*p = (OUT)v;
}

/* Consumer g's named barrier (1 or 2; 0 is the CTA's): its 128 threads. */
__device__ __forceinline__ void sw_consumer_sync(int g)
{
	if (g)
		asm volatile("bar.sync 2, 128;\n" ::: "memory");
	else
		asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

/* A bf16 C without beta: the consumer's 64 columns of the chunk's rows rounded into its staging
 * (stg: [row][64 columns], SW_OUT_ROW bytes a row), then copied out a row's 128 bytes by 8 threads
 * in 16-byte stores, so that each warp store writes whole lines instead of 16 bytes of each of 4
 * rows (the direct stores made the down product, whose output is 4 times its weights' bytes on
 * seed-896, 10% slower than the 128-row tiles on an H100). Into the staging by stmatrix .trans:
 * the accumulator's 8 x 8 block (j, h) (features 16 warp + 8 h.., chunk rows 8 j..) is an mma
 * fragment, stored transposed as 8 chunk rows of 8 features, 16 bytes each; one instruction takes
 * blocks (j, 0), (j, 1), (j + 1, 0), (j + 1, 1), where eight two-byte stores a thread took them
 * before. The 144-byte rows put the 8 rows of a block in 8 different 16-byte bank groups. The first
 * barrier keeps the staging until every thread has copied the last tile out of it. */
template <int NR>
__device__ __forceinline__ void sw_put_staged(const sw_args &a, const sw_tile &tl, const float (&d)[NR / 2],
					      unsigned char *stg, int g)
{
	int t = threadIdx.x & 127, lane = t & 31, warp = t >> 5, rows = tl.rend - tl.row0;
	int q = lane >> 3; /* the block whose row lane & 7 this lane names: (j + q / 2, q % 2) */
	uint32_t at = wg_saddr(stg) + (8 * (q >> 1) + (lane & 7)) * SW_OUT_ROW + 2 * (16 * warp + 8 * (q & 1));
	const float al = a.alpha;
	uint32_t pk[NR / 4]; /* rounded before the barrier: half the registers of d */
#pragma unroll
	for (int i = 0; i < NR / 4; i++)
		pk[i] = pack(al * d[2 * i], al * d[2 * i + 1]);
	sw_consumer_sync(g);
#pragma unroll
	for (int j = 0; j < NR / 8; j += 2)
		stsm4t(at + 8 * j * SW_OUT_ROW, pk[2 * j], pk[2 * j + 1], pk[2 * j + 2], pk[2 * j + 3]);
	sw_consumer_sync(g);
	int col = tl.col0 + 64 * g + 8 * (t & 7); /* N is a multiple of 8: a 16-byte piece is in or out whole */
	if (col >= a.N)
		return;
	bf16 *c = (bf16 *)a.c + (size_t)tl.row0 * a.N + col;
	for (int r = t >> 3; r < rows; r += 16)
		*(uint4 *)(c + (size_t)r * a.N) = *(const uint4 *)(stg + r * SW_OUT_ROW + 16 * (t & 7));
}

/* One tile's products for consumer g (its 64 weight rows at g * 64 rows of each stage's W box) and
 * their store:
 * accumulator element (feature m, chunk row n) is d[4 j + 2 h + i] for m = 16 warp + lane / 4 + 8 h,
 * n = 8 j + 2 (lane % 4) + i (wgmma's D layout). */
template <int NR, typename OUT>
__device__ __forceinline__ void sw_tile_run(const sw_args &a, const sw_tile &tl, uint32_t ring, uint32_t full,
					  uint32_t empty, int &s, uint32_t &ph, int g, unsigned char *stg)
{
	/* defined before the products: an undefined accumulator is read by acc_fence from the kernel's
	 * start, and the eight functions' accumulators together then spill (ptxas serialised the wgmmas) */
	float d[NR / 2];
#pragma unroll
	for (int q = 0; q < NR / 2; q++)
		d[q] = 0.0f;
	int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, first = 1, prev = 0;
	for (int k0 = 0; k0 < a.K; k0 += 64) {
		mbar_wait(full + 8 * s, ph);
		__syncwarp(); /* the .aligned instructions below want the warp converged */
		uint32_t st = ring + s * SW_STAGE;
		uint64_t da = wg_desc(st + g * 64 * 128), db = wg_desc(st + SW_W_BYTES);
		acc_fence(d);
		wgmma_fence();
#pragma unroll
		for (int kk = 0; kk < 4; kk++) /* k + 16: 32 bytes, 2 in the descriptors' start address */
			wgmma_op<0>(d, da + 2 * kk, db + 2 * kk, !(first && kk == 0));
		wgmma_commit();
		if (!first) {
			wgmma_wait<1>();
			if (lane == 0)
				bar_arrive(empty + 8 * prev);
		}
		acc_fence(d);
		first = 0, prev = s;
		ring_next(s, ph, SW_STAGES);
	}
	__syncwarp();
	wgmma_wait<0>();
	acc_fence(d);
	if (lane == 0)
		bar_arrive(empty + 8 * prev);
	if (sizeof(OUT) == 2 && !a.beta) {
		sw_put_staged<NR>(a, tl, d, stg, g);
		return;
	}
	int rows = tl.rend - tl.row0, m0 = tl.col0 + 64 * g + 16 * warp + (lane >> 2);
#pragma unroll
	for (int j = 0; j < NR / 8; j++)
#pragma unroll
		for (int h = 0; h < 2; h++)
#pragma unroll
			for (int i = 0; i < 2; i++) {
				int n = 8 * j + 2 * (lane & 3) + i, m = m0 + 8 * h;
				if (n < rows && m < a.N)
					sw_put<OUT>(a, tl.row0 + n, m, d[4 * j + 2 * h + i]);
			}
}

/* Consumer g (0 or 1): the CTA's tiles, each by the function of its row count. */
template <typename OUT>
__device__ void sw_consume(const sw_args &a, const int *cpre, uint32_t ring, uint32_t full, uint32_t empty,
			   long long total, int ncol, int g, unsigned char *stg)
{
	int s = 0;
	uint32_t ph = 0;
	for (long long t = blockIdx.x; t < total; t += gridDim.x) {
		sw_tile tl = sw_find(a, cpre, t, ncol);
		switch (tl.nr) {
		case 32: sw_tile_run<32, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 64: sw_tile_run<64, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 96: sw_tile_run<96, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 128: sw_tile_run<128, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 160: sw_tile_run<160, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 192: sw_tile_run<192, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		case 224: sw_tile_run<224, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		default: sw_tile_run<256, OUT>(a, tl, ring, full, empty, s, ph, g, stg); break;
		}
	}
}
#endif /* TIER_SM90A */

template <typename OUT>
__global__ void __launch_bounds__(SW_THREADS, 1) sw_kernel(const __grid_constant__ sw_args a)
{
	pdl_enter();
#ifdef TIER_SM90A
	extern __shared__ __align__(16) unsigned char sw_smem[];
	uint32_t base = (wg_saddr(sw_smem) + 1023) & ~1023u; /* the 128B swizzle's 1024-byte rows */
	unsigned char *p = sw_smem + (base - wg_saddr(sw_smem));
	uint32_t ring = base, full = base + SW_BARS_AT, empty = full + 8 * SW_STAGES;
	int *cpre = (int *)(p + SW_BARS_AT + 16 * SW_STAGES), *wsum = cpre + TIER_MOE_MAX_EXPERTS + 1;
	if (threadIdx.x == 0) {
		for (int s = 0; s < SW_STAGES; s++) {
			bar_init(full + 8 * s, 1);  /* the TMA thread's arrival, and the bytes */
			bar_init(empty + 8 * s, 8); /* lane 0 of each consumer warp */
		}
		fence_barrier_init();
	}
	sw_chunk_table(a, cpre, wsum); /* its barriers also publish the initialised mbarriers */
	int ncol = (a.N + SW_BN - 1) / SW_BN, g = threadIdx.x >> 7;
	long long total = (long long)cpre[a.E] * ncol;
	if (g == 0) { /* the even share of registers (168), no spill (ptxas) */
		if (threadIdx.x == 0)
			sw_produce(a, cpre, ring, full, empty, total, ncol);
	} else {
		sw_consume<OUT>(a, cpre, ring, full, empty, total, ncol, g - 1, p + SW_OUT_AT + (g - 1) * SW_OUT_BYTES);
	}
#elif defined(__CUDA_ARCH__)
	__trap(); /* the compute_90 PTX, JIT-compiled for a later GPU: no wgmma there (the host refuses it) */
#endif
}

/* One thread a map: the template copied, its global address replaced where the expert has weights
 * (experts without rows keep the template's, never read). */
__global__ void sw_map_kernel(const __grid_constant__ sw_map_args m)
{
	pdl_enter();
#ifdef TIER_SM90A
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < m.E)
		tmap_put(m.dst + i, &m.t, m.w[i]);
#endif
}

} /* namespace */

static unsigned long long sw_launches;

extern "C" unsigned long long moe_cuda_wgmma_swap_launches(void)
{
	return __atomic_load_n(&sw_launches, __ATOMIC_RELAXED);
}

/* The experts' W maps into device memory from the stream's pool (*maps; the caller frees it after
 * the launch, in stream order), written on the stream by the map kernel. */
static int sw_maps(tier_dev *dev, int E, int N, int K, const void *const *w, const void *x, CUtensorMap **maps)
{
	sw_map_args m; /* 8 KiB */
	cudaStream_t st = moe_stream(dev);
	int rc = base_tmap_bf16(&m.t, wg_first(w, E, x), (uint64_t)N, (uint64_t)K, SW_BN);
	if (rc)
		return rc;
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++)
		m.w[e] = e < E ? w[e] : NULL;
	m.E = E;
	CUDA_TRY(cudaMallocAsync((void **)maps, sizeof(CUtensorMap) * (size_t)E, st));
	m.dst = *maps;
	CUDA_TRY(tier_launch(sw_map_kernel, (E + 127) / 128, 128, 0, st, m));
	return 0;
}

template <typename OUT>
static int sw_launch(tier_dev *dev, const sw_args &a, int ctas)
{
	CUDA_TRY(cudaFuncSetAttribute(sw_kernel<OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, SW_SMEM));
	CUDA_TRY(tier_launch(sw_kernel<OUT>, ctas, SW_THREADS, SW_SMEM, moe_stream(dev), a));
	return 0;
}

/* The caller (moe_cuda_grouped_mm_sm90_segs) checked the arguments, the device and the driver's TMA
 * encoder, and that rows_bound > 0. */
extern "C" int moe_wg_swap_mm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
			      const void *const *w, const void *x, void *c, int c_bf16, float alpha, float beta, int ctas)
{
	sw_args a;
	memset(&a, 0, sizeof a);
	int rc = base_tmap_bf16(&a.xmap, x, (uint64_t)rows_bound, (uint64_t)K, SW_RSTEP);
	if (rc)
		return rc;
	CUtensorMap *maps = NULL;
	if ((rc = sw_maps(dev, E, N, K, w, x, &maps))) {
		if (maps)
			(void)cudaFreeAsync(maps, moe_stream(dev));
		return rc;
	}
	a.wmap = maps, a.off = d_off, a.c = c, a.alpha = alpha;
	a.E = E, a.N = N, a.K = K, a.beta = beta != 0.0f, a.rows_bound = rows_bound;
	/* no more CTAs than tiles can be: a chunk is a nonempty group's, or 256 more of its rows */
	long long chunks = (long long)(E < rows_bound ? E : rows_bound) + rows_bound / SW_MAXR;
	long long tiles = chunks * ((N + SW_BN - 1) / SW_BN);
	if (tiles < ctas)
		ctas = (int)tiles;
	rc = c_bf16 ? sw_launch<bf16>(dev, a, ctas) : sw_launch<float>(dev, a, ctas);
	(void)cudaFreeAsync(maps, moe_stream(dev)); /* in stream order: after the kernel */
	if (!rc)
		__atomic_fetch_add(&sw_launches, 1ull, __ATOMIC_RELAXED);
	return rc;
}
