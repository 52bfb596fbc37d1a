/* sm90.cuh - the sm_90a (Hopper) instructions of the wgmma kernels (moe/moe_wgmma.cu,
 * attn/attn_wgmma.cu), one copy: mbarriers, cp.async into an mbarrier, TMA tile loads, proxy
 * fences, wgmma with its fences and shared-memory descriptors. Everything is defined only where
 * TIER_SM90A is (device code for sm_90a); include from .cu files only. */
#ifndef TIER_BASE_SM90_CUH
#define TIER_BASE_SM90_CUH

#include <cuda.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TIER_SM90A 1
#endif

#ifdef TIER_SM90A
__device__ __forceinline__ uint32_t wg_saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* A warpgroup's registers per thread, moved between warpgroups of a CTA (all 128 threads execute
 * it): a loading warpgroup gives its registers up so that the computing ones can grow past the
 * launch's even share (the kernel's count is the share). */
template <int N>
__device__ __forceinline__ void wg_regs_dec(void)
{
	asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void wg_regs_inc(void)
{
	asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void bar_init(uint32_t b, int count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(count) : "memory");
}

/* One test of whether the phase of parity `parity` has completed (parity 1 on a fresh barrier: at
 * once); the waits loop on it. */
__device__ __forceinline__ bool mbar_try(uint32_t b, uint32_t parity)
{
	uint32_t done;
	asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
		     "selp.u32 %0, 1, 0, p;\n}\n"
		     : "=r"(done)
		     : "r"(b), "r"(parity)
		     : "memory");
	return done != 0;
}

/* Returns once that phase has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t b, uint32_t parity)
{
	while (!mbar_try(b, parity)) {
	}
}

/* Four 8 x 8 bf16 blocks stored transposed (stmatrix .trans): register j holds this thread's pair
 * of block j as an mma fragment (row lane / 4, columns 2 (lane % 4) and + 1); lane l names the
 * address of stored row l & 7 of block l >> 3, which receives the block's column l & 7 as 16
 * contiguous bytes. */
__device__ __forceinline__ void stsm4t(uint32_t at, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3)
{
	asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(r0),
		     "r"(r1), "r"(r2), "r"(r3)
		     : "memory");
}

/* The next stage of a ring of barriers: the parity to wait for flips at each wrap. */
__device__ __forceinline__ void ring_next(int &s, uint32_t &ph, int stages)
{
	if (++s == stages)
		s = 0, ph ^= 1;
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

/* A full barrier's current phase also waits for `bytes` from TMA copies (no arrival). */
__device__ __forceinline__ void bar_expect_tx(uint32_t b, uint32_t bytes)
{
	asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(bytes) : "memory");
}

/* n arrivals at once: the TMA thread stands for every producer thread of a stage it loads alone. */
__device__ __forceinline__ void bar_arrive_n(uint32_t b, uint32_t n)
{
	asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(n) : "memory");
}

/* A TMA copy of the box at (column c0, row c1) of map (generic address: parameter or global space)
 * into shared memory at dst (1024-byte aligned for the 128B swizzle), completing bytes on bar. */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar)
{
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
		     ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
		     : "memory");
}

/* The same box into the same offset of the shared memory of each CTA of the cluster in mask (bit r:
 * rank r), each of those CTAs' barrier at offset bar completing the bytes it received. */
__device__ __forceinline__ void tma_load_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar,
					    uint16_t mask)
{
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
		     " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
		     : "memory");
}

/* ---- thread block clusters ---- */
__device__ __forceinline__ uint32_t cluster_rank(void)
{
	uint32_t r;
	asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
	return r;
}
/* the cluster's index in the grid (x) and the grid's clusters (x) */
__device__ __forceinline__ uint32_t cluster_id_x(void)
{
	uint32_t r;
	asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
	return r;
}
__device__ __forceinline__ uint32_t cluster_count_x(void)
{
	uint32_t r;
	asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
	return r;
}
/* Every thread of every CTA of the cluster meets here; what each wrote before is visible to all after
 * (shared memory, mbarrier initialisation included). */
__device__ __forceinline__ void cluster_sync(void)
{
	asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
/* One arrival on the barrier at shared offset b of the cluster's CTA rank. Its release is the CTA's
 * (the default): it orders this thread's work for the barrier's waiters (reads of shared memory
 * done, copies issued), and no data of this CTA's is published by it. A release at cluster scope
 * also waits for the thread's outstanding global stores: with it, the consumer warps' arrivals
 * made the CTA pairs' gate/up on qwen3-30b's shape 2.37 ms against 1.73 without (H100, session 29). */
__device__ __forceinline__ void bar_arrive_cluster(uint32_t b, uint32_t rank)
{
	asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
		     "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(b),
		     "r"(rank)
		     : "memory");
}

/* The same for a 3-D map (base_tmap_bf16_seq): column c0, row c1 of sequence c2. */
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar)
{
	asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
		     ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
		     : "memory");
}

/* Adds the fp32 box at shared src (1024-byte aligned, in the map's 128B swizzle) to global memory at
 * (column c0, row c1, sequence c2) of a 3-D map (base_tmap_f32_seq), element by element in L2;
 * elements past the map's edges are not written. One thread issues it; it reads src asynchronously
 * (tma_reduce_commit, then tma_reduce_wait_read before src is written again). */
__device__ __forceinline__ void tma_reduce_add3(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2)
{
	asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
		     ::"l"((uint64_t)map), "r"(src), "r"(c0), "r"(c1), "r"(c2)
		     : "memory");
}
/* Writes the box at shared src (in the map's swizzle) to global memory at (column c0, row c1) of a
 * 2-D map; elements past the map's edges are not written. One thread issues it, reading src
 * asynchronously: commit it (tma_reduce_commit), then bulk_wait_read before src is written again. */
__device__ __forceinline__ void tma_store(const CUtensorMap *map, uint32_t src, int c0, int c1)
{
	asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"((uint64_t)map),
		     "r"(src), "r"(c0), "r"(c1)
		     : "memory");
}
/* At most N of the thread's committed bulk groups still read their shared sources. */
template <int N>
__device__ __forceinline__ void bulk_wait_read()
{
	asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void tma_reduce_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* The committed reductions have read their shared sources (they may still be writing). */
__device__ __forceinline__ void tma_reduce_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* The committed reductions are complete. */
__device__ __forceinline__ void tma_reduce_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

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

/* The same for register A operands (n k-steps of 4 registers): their writes stay before the
 * wgmma.fence that must follow them. */
template <int N>
__device__ __forceinline__ void frag_fence(uint32_t (&f)[N][4])
{
#pragma unroll
	for (int i = 0; i < N; i++)
#pragma unroll
		for (int j = 0; j < 4; j++)
			asm volatile("" : "+r"(f[i][j])::"memory");
}

/* The shared matrix descriptor of a K-major operand in the 128B swizzle: start address >> 4 (bits
 * 0-13), leading byte offset unused by this layout (1, bits 16-29), stride byte offset 1024 >> 4
 * between 8-row groups (bits 32-45), swizzle mode 1 = 128B (bits 62-63). */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr)
{
	return (uint64_t)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

/* The descriptor of an MN-major operand in the 128B swizzle: leading byte offset lbo >> 4 between
 * its 64-column blocks (bits 16-29), stride byte offset 1024 >> 4 between 8-row (k) groups (bits
 * 32-45), swizzle mode 1 = 128B. */
__device__ __forceinline__ uint64_t wg_desc_mn_at(uint32_t saddr, uint32_t lbo)
{
	return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | (64ull << 32) | (1ull << 62);
}

#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_D16(i) WG_D4(i), WG_D4(i + 4), WG_D4(i + 8), WG_D4(i + 12)
#define WG_D64(i) WG_D16(i), WG_D16(i + 16), WG_D16(i + 32), WG_D16(i + 48)

#define WG_D32(i) WG_D16(i), WG_D16(i + 16)

/* D (64 x 64 fp32: 32 registers a thread) += A (64 x 16) B (16 x 64), both from shared memory; acc
 * 0 drops D's old value. TB: B is MN-major. */
template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[32], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
		     "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
		     : WG_D32(0)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

/* D (64 x 128 fp32) += A (64 x 16 bf16 in registers: each warp's 16 rows in the A layout of
 * mma.m16n8k16, which is also the layout of a wgmma accumulator's 16 x 16 piece) B (16 x 128 from
 * shared memory); TB: B is MN-major. */
template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
		     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
		     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
		     "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
		     : WG_D64(0)
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB));
}

/* D (64 x 128 fp32: 64 registers a thread) += A (64 x 16) B (16 x 128), both from shared memory;
 * acc 0 drops D's old value instead (a tile's first product: no zeroing pass). TB: B is MN-major. */
template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[64], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
		     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
		     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
		     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
		     "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
		     : WG_D64(0)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

/* The same with 256 columns (128 registers a thread). */
template <int TB>
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
		     "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
		     : WG_D64(0), WG_D64(64)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
/* The other column counts of the same product, 32 to 224 in steps of 32 but 64 and 128 (N / 2
 * registers a thread; moe/moe_wgmma_swap.cu, whose products take a group's rows as N). */
template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[16], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
		     "}, %16, %17, p, 1, 1, 0, %19;\n}\n"
		     : WG_D16(0)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[48], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
		     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
		     "%40, %41, %42, %43, %44, %45, %46, %47"
		     "}, %48, %49, p, 1, 1, 0, %51;\n}\n"
		     : WG_D32(0), WG_D16(32)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[80], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
		     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
		     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
		     "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
		     "%78, %79"
		     "}, %80, %81, p, 1, 1, 0, %83;\n}\n"
		     : WG_D64(0), WG_D16(64)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[96], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
		     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
		     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
		     "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
		     "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
		     "}, %96, %97, p, 1, 1, 0, %99;\n}\n"
		     : WG_D64(0), WG_D32(64)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wgmma_op(float (&d)[112], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %114, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n224k16.f32.bf16.bf16 {"
		     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
		     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
		     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
		     "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
		     "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
		     "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
		     "}, %112, %113, p, 1, 1, 0, %115;\n}\n"
		     : WG_D64(0), WG_D32(64), WG_D16(96)
		     : "l"(da), "l"(db), "r"(acc), "n"(TB));
}

/* Tensor maps in global memory, written on the device (tensormap.replace): dst gets the template's
 * 128 bytes with base as its global address (base NULL keeps the template's), then a release for
 * the tensor-map proxy; the kernel that loads through the map acquires it first (tmap_acquire), as
 * the map's memory may have held another launch's map, which that proxy could still cache, and
 * may prefetch it (pf) so that its first copy need not wait for it. */
__device__ __forceinline__ void tmap_put(CUtensorMap *dst, const CUtensorMap *tmpl, const void *base)
{
	const uint64_t *src = (const uint64_t *)tmpl;
	uint64_t *d = (uint64_t *)dst;
#pragma unroll
	for (int j = 0; j < 16; j++)
		d[j] = src[j];
	if (base)
		asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"((uint64_t)d),
			     "l"((uint64_t)base)
			     : "memory");
	asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
}

__device__ __forceinline__ void tmap_acquire(const CUtensorMap *m, bool pf)
{
	asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"((uint64_t)m) : "memory");
	if (pf)
		asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)m) : "memory");
}
#endif /* TIER_SM90A */
#endif
