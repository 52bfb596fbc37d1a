/* moe_wgmma.cu - the experts' grouped GEMM on Hopper tensor cores: C = alpha X W_e^T + beta C over
 * each expert's rows, wgmma reading both operands from shared memory (moe_wgmma.h).
 *
 * Shared layout. A CTA tile is BM x BN of C (128 x 256, 128 x 128 or 64 x 256) and a stage is 64 k:
 * 64 bf16 are one 128-byte row, exactly one 128-byte swizzle atom. Both operands are K-major (X rows
 * and W_e rows hold k contiguously), so a stage of either is rows of 128 bytes in which the 16-byte
 * chunk j of row r sits at chunk j ^ (r % 8): the layout that wgmma's 128B-swizzle descriptor reads
 * (8-row groups 1024 bytes apart; k + 16 within the row = start address + 32 bytes) and that 16-byte
 * cp.async can write. No TMA: it would need a tensor map per expert.
 *
 * Roles. Warpgroup 0 is the producer: cp.async global -> shared through a STAGES-deep ring. Warpgroups
 * 1 and 2 are the consumers, each 64 rows x WN columns (the two halves of M when BM = 128, of N when
 * BM = 64). Each stage has two mbarriers: "full" completes when the producer's 128 threads' copies
 * have landed (cp.async.mbarrier.arrive.noinc: the producer never blocks on its own copies), "empty"
 * when the 8 consumer warps are done with it (wgmma.wait_group has seen the products that read it
 * complete). The copies land through the generic proxy and wgmma reads through the async proxy, so a
 * consumer fences the proxies after each full wait.
 *
 * Schedule. The grid is persistent (one CTA per SM): CTA b takes tiles b, b + grid, ... of the list
 * ordered by row tile, then column tile (columns fastest: the CTAs working at once share X row tiles
 * and the weights of few experts in L2). The host does not know the offsets, so each CTA first turns
 * the device offsets into a shared table of each expert's first row tile (one block scan); every
 * warpgroup then finds a tile's expert by binary search without further barriers, and the producer
 * runs on into the next tile while the consumers store the last one.
 *
 * Rows past a group's end, columns past N and k past K are zero-filled (cp.async with source size 0)
 * and never stored. Compiled for sm_90a only (wgmma); the compute_90 PTX of the build traps, and the
 * host refuses any device but compute capability 9.0. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_wgmma.h"

#define WG_BK 64             /* k per stage: 64 bf16, one 128-byte swizzle row */
#define WG_ROW 128           /* bytes per shared row of either operand */
#define WG_THREADS 384       /* warpgroup 0 loads, warpgroups 1 and 2 multiply */
#define WG_CONSUMER_WARPS 8  /* arrivals that empty a stage */
#define WG_RING (200 * 1024) /* shared bytes for the stages; the tables take the rest of 227 KiB */

/* A CTA tile of BM x BN: the bytes of a stage, the ring depth that fits, and the columns WN of each
 * consumer warpgroup (its 64 rows). */
template <int BM_, int BN_>
struct wg_cfg {
	static constexpr int BM = BM_, BN = BN_;
	static constexpr int WN = BM == 128 ? BN : BN / 2;
	static constexpr int A_BYTES = BM * WG_ROW, B_BYTES = BN * WG_ROW, STAGE = A_BYTES + B_BYTES;
	static constexpr int STAGES = WG_RING / STAGE;
	/* ints: tile0 and roff [E + 1] each, one partial sum per warp */
	static constexpr int TABLE = 2 * (TIER_MOE_MAX_EXPERTS + 1) + WG_THREADS / 32;
	/* 1024 of slack to align the ring, the ring, a full and an empty barrier per stage, the table */
	static constexpr size_t BYTES = 1024 + (size_t)STAGES * STAGE + 16 * STAGES + 4 * TABLE;
	static_assert(BM == 64 || BM == 128, "one consumer warpgroup per 64 rows, or both on 64");
	static_assert(WN == 128 || WN == 256, "the wgmma shapes below: m64n128k16, m64n256k16");
	static_assert(STAGES >= 3, "a stage loading while the consumers hold two");
	static_assert(BYTES <= 227 * 1024, "Hopper's shared memory per block");
};

/* The kernel's parameters (__grid_constant__: the 8 KiB pointer table stays in parameter space). */
struct wg_args {
	const bf16 *w[TIER_MOE_MAX_EXPERTS];
	const int32_t *off;
	const bf16 *x;
	void *c;
	float alpha;
	int E, N, K, beta;
	int rt_bound; /* row tiles at or past it are never computed: rows_bound's bound on them */
};

struct wg_tile {
	int e, row0, rend, col0; /* expert, first row, its group's end, first column */
};

/* A CTA's shared memory: the ring (1024-byte aligned: the swizzle is a function of the address
 * bits 4-9), its barriers and the tile table. */
struct wg_shared {
	uint32_t ring;  /* shared address of stage 0; stage s at ring + s STAGE, B after A */
	uint32_t full;  /* shared address of full[0]; full[s] at full + 8 s */
	uint32_t empty; /* the same for empty */
	int *tile0;     /* [E + 1]: the first row tile of expert e; tile0[E] = all row tiles */
	int *roff;      /* [E + 1]: the offsets */
	int *wsum;      /* [12]: the scan's warp totals */
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_SM90A 1
#endif

#ifdef WG_SM90A
/* ---- sm_90a instructions ---- */
__device__ __forceinline__ uint32_t wg_saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_init(uint32_t b, int count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(count) : "memory");
}

/* Returns once the phase of parity `parity` has completed (parity 1 on a fresh barrier: at once). */
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t parity)
{
	uint32_t done;
	do {
		asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
			     "selp.u32 %0, 1, 0, p;\n}\n"
			     : "=r"(done)
			     : "r"(b), "r"(parity)
			     : "memory");
	} while (!done);
}

__device__ __forceinline__ void bar_arrive(uint32_t b)
{
	asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(b) : "memory");
}

/* This thread's arrival, made when all its cp.async issued so far have landed (noinc: the arrival is
 * one of the count the barrier was initialised with). */
__device__ __forceinline__ void bar_arrive_copies(uint32_t b)
{
	asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(b) : "memory");
}

/* 16 bytes global -> shared; !valid reads nothing (gm need only be a valid address) and writes zeros. */
__device__ __forceinline__ void cp_async16(uint32_t sm, const void *gm, bool valid)
{
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sm), "l"(gm), "r"(valid ? 16 : 0)
		     : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* Generic-proxy writes (the copies) -> async-proxy reads (wgmma) of shared memory. */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void fence_barrier_init()
{
	asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait()
{
	asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across the asynchronous products. */
template <int NR>
__device__ __forceinline__ void acc_fence(float (&d)[NR])
{
#pragma unroll
	for (int i = 0; i < NR; i++)
		asm volatile("" : "+f"(d[i])::"memory");
}

/* The shared matrix descriptor of a K-major operand in the 128B swizzle: start address >> 4 (bits
 * 0-13), leading byte offset unused by this layout (1, bits 16-29), stride byte offset 1024 >> 4
 * between 8-row groups (bits 32-45), swizzle mode 1 = 128B (bits 62-63). */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr)
{
	return (uint64_t)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_D16(i) WG_D4(i), WG_D4(i + 4), WG_D4(i + 8), WG_D4(i + 12)
#define WG_D64(i) WG_D16(i), WG_D16(i + 16), WG_D16(i + 32), WG_D16(i + 48)

/* D (64 x 128 fp32: 64 registers a thread) += A (64 x 16) B (16 x 128), both from shared memory;
 * acc 0 drops D's old value instead (a tile's first product: no zeroing pass). */
__device__ __forceinline__ void wgmma_op(float (&d)[64], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
		     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
		     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
		     "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
		     : WG_D64(0)
		     : "l"(da), "l"(db), "r"(acc));
}

/* The same with 256 columns (128 registers a thread). */
__device__ __forceinline__ void wgmma_op(float (&d)[128], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
		     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
		     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
		     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
		     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
		     "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
		     "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
		     "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
		     : WG_D64(0), WG_D64(64)
		     : "l"(da), "l"(db), "r"(acc));
}

/* ---- the tile table ---- */
/* Row tiles of a group [lo, hi) (no overflow near INT_MAX). */
template <int BM>
__device__ __forceinline__ int wg_ntiles(int lo, int hi)
{
	return hi > lo ? (hi - lo - 1) / BM + 1 : 0;
}

/* tile0 and roff from the device offsets: each thread sums the tiles of up to ceil(E / 384)
 * consecutive experts; a shuffle scan per warp and the 12 warp totals give each thread its first
 * tile. All threads; synchronises. */
template <int BM>
__device__ static void wg_table(const wg_args &a, const wg_shared &sh)
{
	int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
	int per = (a.E + WG_THREADS - 1) / WG_THREADS, e0 = min(tid * per, a.E), e1 = min(e0 + per, a.E), mine = 0;
	for (int e = e0; e < e1; e++) {
		int lo = a.off[e];
		sh.roff[e] = lo;
		mine += wg_ntiles<BM>(lo, a.off[e + 1]);
	}
	if (tid == 0)
		sh.roff[a.E] = a.off[a.E];
	int incl = mine;
#pragma unroll
	for (int d = 1; d < 32; d <<= 1) {
		int v = __shfl_up_sync(0xffffffffu, incl, d);
		if (lane >= d)
			incl += v;
	}
	if (lane == 31)
		sh.wsum[warp] = incl;
	__syncthreads();
	int first = incl - mine;
	for (int w = 0; w < warp; w++)
		first += sh.wsum[w];
	for (int e = e0; e < e1; e++) {
		sh.tile0[e] = first;
		first += wg_ntiles<BM>(sh.roff[e], sh.roff[e + 1]);
	}
	if (tid == WG_THREADS - 1) /* its range is the last one: first is now the total */
		sh.tile0[a.E] = first;
	__syncthreads();
}

/* Tile t: row tile rt = t / ncol, in the expert whose tiles (counted in expert order) cover it - the
 * last e with tile0[e] <= rt, as empty experts share their successor's tile0 - and column tile
 * t % ncol. */
template <int BM, int BN>
__device__ __forceinline__ wg_tile wg_find(const wg_shared &sh, int E, long long t, int ncol)
{
	int rt = (int)(t / ncol), lo = 0, hi = E - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) >> 1;
		if (sh.tile0[mid] <= rt)
			lo = mid;
		else
			hi = mid - 1;
	}
	wg_tile tl;
	tl.e = lo;
	tl.row0 = sh.roff[lo] + (rt - sh.tile0[lo]) * BM;
	tl.rend = sh.roff[lo + 1];
	tl.col0 = (int)(t % ncol) * BN;
	return tl;
}

template <class CFG>
__device__ __forceinline__ wg_shared wg_carve(unsigned char *smem)
{
	uint32_t base = wg_saddr(smem), pad = (1024u - (base & 1023u)) & 1023u;
	wg_shared sh;
	sh.ring = base + pad;
	sh.full = sh.ring + CFG::STAGES * CFG::STAGE;
	sh.empty = sh.full + 8 * CFG::STAGES;
	sh.tile0 = (int *)(smem + pad + CFG::STAGES * CFG::STAGE + 16 * CFG::STAGES);
	sh.roff = sh.tile0 + TIER_MOE_MAX_EXPERTS + 1;
	sh.wsum = sh.roff + TIER_MOE_MAX_EXPERTS + 1;
	return sh;
}

/* ---- the producer: warpgroup 0 ---- */
/* Thread p copies the 16-byte chunk j = p % 8 of rows p / 8 + 16 i of both operands; all its rows
 * share r % 8, hence the swizzled chunk j ^ (r % 8). A stage is reused once the consumers emptied it
 * (parity ph ^ 1: the first lap passes at once). */
template <class CFG>
__device__ static void wg_produce(const wg_args &a, const wg_shared &sh, int ncol, long long total)
{
	int p = threadIdx.x, j = p & 7, r0 = p >> 3, s = 0;
	uint32_t ph = 0, dst = (uint32_t)(r0 * WG_ROW + ((j ^ (r0 & 7)) << 4));
	size_t step = (size_t)16 * a.K; /* 16 rows */
	for (long long t = blockIdx.x; t < total; t += gridDim.x) {
		wg_tile tl = wg_find<CFG::BM, CFG::BN>(sh, a.E, t, ncol);
		const bf16 *W = a.w[tl.e];
		/* the base addresses of rows that are out are never read */
		const bf16 *xa = a.x + (size_t)(tl.row0 + r0) * a.K + 8 * j, *wb = W + (size_t)(tl.col0 + r0) * a.K + 8 * j;
		int arows = tl.rend - tl.row0 - r0, brows = a.N - tl.col0 - r0; /* row r0 + 16 i is in when 16 i < */
		for (int k0 = 0; k0 < a.K; k0 += WG_BK) {
			bar_wait(sh.empty + 8 * s, ph ^ 1);
			bool kin = k0 + 8 * j < a.K; /* K % 8 == 0: a chunk is all in or all out */
			uint32_t sa = sh.ring + s * CFG::STAGE + dst, sb = sa + CFG::A_BYTES;
#pragma unroll
			for (int i = 0; i < CFG::BM / 16; i++) {
				bool ok = kin && 16 * i < arows;
				cp_async16(sa + i * 16 * WG_ROW, ok ? xa + i * step + k0 : a.x, ok);
			}
#pragma unroll
			for (int i = 0; i < CFG::BN / 16; i++) {
				bool ok = kin && 16 * i < brows;
				cp_async16(sb + i * 16 * WG_ROW, ok ? wb + i * step + k0 : W, ok);
			}
			bar_arrive_copies(sh.full + 8 * s);
			if (++s == CFG::STAGES)
				s = 0, ph ^= 1;
		}
	}
	cp_async_wait_all(); /* no copy left in flight behind an exiting thread */
}

/* ---- the consumers: warpgroups 1 and 2 ---- */
__device__ __forceinline__ float2 wg_get2(const float *p) { return *(const float2 *)p; }
__device__ __forceinline__ float2 wg_get2(const bf16 *p) { return __bfloat1622float2(*(const __nv_bfloat162 *)p); }
__device__ __forceinline__ void wg_put2(float *p, float v0, float v1) { *(float2 *)p = make_float2(v0, v1); }
__device__ __forceinline__ void wg_put2(bf16 *p, float v0, float v1)
{
	*(__nv_bfloat162 *)p = __floats2bfloat162_rn(v0, v1); /* the fp32 sum rounded once */
}

/* The m64nNk16 f32 accumulator: thread (warp w, lane l) of the warpgroup holds rows 16 w + l / 4
 * (h = 0) and 8 below (h = 1), columns 8 i + 2 (l % 4) + b (b = 0, 1) in d[4 i + 2 h + b]. With beta
 * every old value of a row is read before the first store: a load after a store to the same type
 * would wait for it. beta 0 never reads C (it may hold anything, NaN included). */
template <class CFG, typename OUT>
__device__ static void wg_store(float (&d)[CFG::WN / 2], const wg_args &a, const wg_tile &tl, int g, int warp, int lane)
{
	OUT *C = (OUT *)a.c;
	int r = tl.row0 + (CFG::BM == 128 ? 64 * g : 0) + 16 * warp + (lane >> 2);
	int c0 = tl.col0 + (CFG::BM == 128 ? 0 : CFG::WN * g) + 2 * (lane & 3);
#pragma unroll
	for (int h = 0; h < 2; h++) {
		if (r + 8 * h >= tl.rend)
			continue;
		OUT *row = C + (size_t)(r + 8 * h) * a.N + c0;
		int ncols = a.N - c0; /* column c0 + 8 i is in when 8 i < ncols; even, so its pair is too */
#pragma unroll
		for (int i = 0; i < CFG::WN / 8; i++) {
			float2 o = a.beta && 8 * i < ncols ? wg_get2(row + 8 * i) : make_float2(0.0f, 0.0f);
			d[4 * i + 2 * h] = a.alpha * d[4 * i + 2 * h] + o.x;
			d[4 * i + 2 * h + 1] = a.alpha * d[4 * i + 2 * h + 1] + o.y;
		}
#pragma unroll
		for (int i = 0; i < CFG::WN / 8; i++)
			if (8 * i < ncols)
				wg_put2(row + 8 * i, d[4 * i + 2 * h], d[4 * i + 2 * h + 1]);
	}
}

/* One arrival per consumer warp: wgmma.wait_group is warp-synchronous, so lane 0 past it means the
 * warp's products that read the stage are complete. */
__device__ __forceinline__ void wg_release(const wg_shared &sh, int s, int lane)
{
	if (lane == 0)
		bar_arrive(sh.empty + 8 * s);
}

/* Consumer g (0 or 1): per stage one group of 4 products (k 16 each) is issued while the previous
 * stage's group may still run; that stage goes back to the producer once its group is complete. */
template <class CFG, typename OUT>
__device__ static void wg_consume(const wg_args &a, const wg_shared &sh, int ncol, long long total, int g)
{
	float d[CFG::WN / 2];
	int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, s = 0, prev = 0;
	uint32_t ph = 0, aoff = CFG::BM == 128 ? 64 * WG_ROW * g : 0;
	uint32_t boff = CFG::A_BYTES + (CFG::BM == 128 ? 0 : CFG::WN * WG_ROW * g);
#pragma unroll
	for (int i = 0; i < CFG::WN / 2; i++)
		d[i] = 0.0f;
	for (long long t = blockIdx.x; t < total; t += gridDim.x) {
		for (int k0 = 0; k0 < a.K; k0 += WG_BK) {
			bar_wait(sh.full + 8 * s, ph);
			__syncwarp(); /* the .aligned instructions below want the warp converged */
			fence_proxy_async();
			uint32_t st = sh.ring + s * CFG::STAGE;
			uint64_t da = wg_desc(st + aoff), db = wg_desc(st + boff);
			acc_fence(d);
			wgmma_fence();
#pragma unroll
			for (int kk = 0; kk < WG_BK / 16; kk++) /* k + 16 = 32 bytes = 2 in the start address */
				wgmma_op(d, da + 2 * kk, db + 2 * kk, (k0 | kk) != 0);
			wgmma_commit();
			if (k0 > 0) {
				wgmma_wait<1>();
				wg_release(sh, prev, lane);
			}
			acc_fence(d);
			prev = s;
			if (++s == CFG::STAGES)
				s = 0, ph ^= 1;
		}
		wgmma_wait<0>();
		acc_fence(d);
		wg_release(sh, prev, lane);
		wg_store<CFG, OUT>(d, a, wg_find<CFG::BM, CFG::BN>(sh, a.E, t, ncol), g, warp, lane);
	}
}
#endif /* WG_SM90A */

/* ---- the kernel ---- */
template <int BM, int BN, typename OUT>
__global__ void __launch_bounds__(WG_THREADS, 1) wg_kernel(const __grid_constant__ wg_args a)
{
#ifdef WG_SM90A
	typedef wg_cfg<BM, BN> CFG;
	extern __shared__ __align__(16) unsigned char wg_smem[];
	wg_shared sh = wg_carve<CFG>(wg_smem);
	if (threadIdx.x == 0) {
		for (int s = 0; s < CFG::STAGES; s++) {
			bar_init(sh.full + 8 * s, 128); /* each producer thread, once its copies landed */
			bar_init(sh.empty + 8 * s, WG_CONSUMER_WARPS);
		}
		fence_barrier_init();
	}
	wg_table<BM>(a, sh); /* its barriers also publish the initialised mbarriers */
	int ncol = (a.N + BN - 1) / BN;
	long long total = (long long)min(sh.tile0[a.E], a.rt_bound) * ncol;
	int g = threadIdx.x >> 7;
	if (g == 0)
		wg_produce<CFG>(a, sh, ncol, total);
	else
		wg_consume<CFG, OUT>(a, sh, ncol, total, g - 1);
#elif defined(__CUDA_ARCH__)
	__trap(); /* the compute_90 PTX, JIT-compiled for a later GPU: no wgmma there (the host refuses it) */
#endif
}

/* ---- host side ---- */
enum { WG_128x256, WG_128x128, WG_64x256, WG_NSHAPES };
static const char *const wg_shape_names[WG_NSHAPES] = { "128x256", "128x128", "64x256" };

/* The share of a BM-row tile's rows that hold data when every group has the mean size m. */
static double wg_fill(double m, int bm) { return m > 0 ? m / (ceil(m / bm) * bm) : 1.0; }

/* TIER_MOE_WGMMA_TILE, else 64 rows when 128-row tiles would hold 20% more padding than 64-row ones
 * (which move twice the bytes per product), else 128 x 256 (128 x 128 when N fits it). */
static int wg_pick_shape(const char *fn, int E, int N, int rows_bound, int *shape)
{
	const char *v = getenv("TIER_MOE_WGMMA_TILE");
	if (v && *v) {
		for (int i = 0; i < WG_NSHAPES; i++)
			if (!strcmp(v, wg_shape_names[i])) {
				*shape = i;
				return 0;
			}
		return tier_fail(-EINVAL, "%s: TIER_MOE_WGMMA_TILE=%s; use 128x256, 128x128 or 64x256, or unset it", fn, v);
	}
	double m = (double)rows_bound / E;
	if (wg_fill(m, 64) > 1.2 * wg_fill(m, 128))
		*shape = WG_64x256;
	else
		*shape = N <= 128 ? WG_128x128 : WG_128x256;
	return 0;
}

/* One CTA per SM, or TIER_MOE_WGMMA_CTAS when smaller. */
static int wg_pick_ctas(const char *fn, int sms, int *ctas)
{
	const char *v = getenv("TIER_MOE_WGMMA_CTAS");
	*ctas = sms;
	if (!v || !*v)
		return 0;
	char *end;
	long n = strtol(v, &end, 10);
	if (*end || n < 1 || n > INT_MAX)
		return tier_fail(-EINVAL, "%s: TIER_MOE_WGMMA_CTAS=%s; use a positive CTA count, or unset it", fn, v);
	if (n < sms)
		*ctas = (int)n;
	return 0;
}

/* The SM count of dev's GPU when its compute capability is 9.0 (the only one the sm_90a code runs
 * on), else -ENOTSUP. */
static int wg_device(tier_dev *dev, const char *fn, int *sms)
{
	int ord = tier_dev_ordinal(dev), major = 0, minor = 0;
	CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ord));
	CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ord));
	if (major != 9 || minor != 0)
		return tier_fail(-ENOTSUP, "%s: wgmma needs a Hopper GPU (compute capability 9.0) and device %d is %d.%d; "
				 "use moe_cuda_grouped_mm there", fn, ord, major, minor);
	CUDA_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, ord));
	return 0;
}

template <int BM, int BN, typename OUT>
static int wg_launch(tier_dev *dev, wg_args &a, int rows_bound, int ctas)
{
	typedef wg_cfg<BM, BN> CFG;
	/* sum_e ceil(n_e / BM) <= (rows + (BM - 1) (non-empty experts)) / BM, and at most
	 * min(E, rows_bound) experts have rows */
	long long busy = a.E < rows_bound ? a.E : rows_bound;
	long long ny = ((long long)rows_bound + (long long)(BM - 1) * busy) / BM;
	long long tiles = ny * ((a.N + BN - 1) / BN);
	a.rt_bound = ny < INT_MAX ? (int)ny : INT_MAX;
	int grid = tiles < ctas ? (int)tiles : ctas;
	CUDA_TRY(cudaFuncSetAttribute(wg_kernel<BM, BN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)CFG::BYTES));
	wg_kernel<BM, BN, OUT><<<grid, WG_THREADS, CFG::BYTES, moe_stream(dev)>>>(a);
	CUDA_LAUNCHED();
	return 0;
}

template <typename OUT>
static int wg_dispatch(tier_dev *dev, wg_args &a, int shape, int rows_bound, int ctas)
{
	switch (shape) {
	case WG_128x128:
		return wg_launch<128, 128, OUT>(dev, a, rows_bound, ctas);
	case WG_64x256:
		return wg_launch<64, 256, OUT>(dev, a, rows_bound, ctas);
	default:
		return wg_launch<128, 256, OUT>(dev, a, rows_bound, ctas);
	}
}

/* x, c and every w[e] (NULL allowed: only empty experts may have no weights) 16-byte aligned. */
static int wg_check_ptrs(const char *fn, int E, const int32_t *d_off, const void *const *w, const void *x, const void *c)
{
	MOE_NONNULL(d_off, fn);
	MOE_NONNULL(w, fn);
	MOE_NONNULL(x, fn);
	MOE_NONNULL(c, fn);
	if ((uintptr_t)x % 16 || (uintptr_t)c % 16)
		return tier_fail(-EINVAL, "%s: x or c is not 16-byte aligned; pass aligned buffers", fn);
	for (int e = 0; e < E; e++)
		if ((uintptr_t)w[e] % 16)
			return tier_fail(-EINVAL, "%s: the weight of expert %d is not 16-byte aligned; pass aligned weights",
					 fn, e);
	return 0;
}

static int wg_check(const char *fn, tier_dev *dev, int E, int N, int K, int rows_bound, int c_bf16, float beta)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "N", N)) || (rc = moe_check_dim(fn, "K", K)))
		return rc;
	if (N % 8 || K % 8)
		return tier_fail(-EINVAL, "%s: N = %d and K = %d must be multiples of 8 (16-byte copies); use the "
				 "per-expert cuBLASLt products (moe_cuda_mm) for other shapes", fn, N, K);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	if (c_bf16 != 0 && c_bf16 != 1)
		return tier_fail(-EINVAL, "%s: c_bf16 = %d; it must be 0 (fp32 C) or 1 (bf16 C)", fn, c_bf16);
	if (beta != 0.0f && beta != 1.0f)
		return tier_fail(-EINVAL, "%s: beta = %g; it must be 0 (write C) or 1 (add to C)", fn, (double)beta);
	return 0;
}

extern "C" int moe_cuda_wgmma_supported(tier_dev *dev)
{
	int major = 0, minor = 0, ord;
	if (!dev || tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return 0;
	ord = tier_dev_ordinal(dev);
	if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ord) != cudaSuccess ||
	    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ord) != cudaSuccess) {
		(void)cudaGetLastError(); /* leave no error behind for a later launch check to report */
		return 0;
	}
	return major == 9 && minor == 0;
}

extern "C" int moe_cuda_grouped_mm_sm90(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
					const void *const *w, const void *x, void *c, int c_bf16, float alpha, float beta)
{
	const char *fn = "moe_cuda_grouped_mm_sm90";
	int shape, sms, ctas, rc = wg_check(fn, dev, E, N, K, rows_bound, c_bf16, beta);
	if (rc || (rc = wg_check_ptrs(fn, E, d_off, w, x, c)) || (rc = wg_pick_shape(fn, E, N, rows_bound, &shape)) ||
	    (rc = wg_device(dev, fn, &sms)) || (rc = wg_pick_ctas(fn, sms, &ctas)))
		return rc;
	if (rows_bound == 0)
		return 0;
	wg_args a; /* 8 KiB */
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++)
		a.w[e] = e < E ? (const bf16 *)w[e] : NULL;
	a.off = d_off, a.x = (const bf16 *)x, a.c = c, a.alpha = alpha;
	a.E = E, a.N = N, a.K = K, a.beta = beta != 0.0f, a.rt_bound = 0;
	if (c_bf16)
		return wg_dispatch<bf16>(dev, a, shape, rows_bound, ctas);
	return wg_dispatch<float>(dev, a, shape, rows_bound, ctas);
}
