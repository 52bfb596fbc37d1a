/* moe_wgmma_ptx.cuh - what the wgmma grouped GEMMs (moe_wgmma.cu) add to base/sm90.cuh's sm_90a
 * instructions: the barrier wait with the debugging build's watchdog, the producers' named
 * barrier, and the MN-major B descriptor of their stage layout. */
#ifndef TIER_MOE_WGMMA_PTX_CUH
#define TIER_MOE_WGMMA_PTX_CUH

#include "moe/moe_wgmma_cfg.cuh"
#include "base/sm90.cuh"

#ifdef TIER_WG_WATCHDOG
/* A debugging build's watchdog (-DTIER_WG_WATCHDOG=1 in NVCCFLAGS): the first wait that lasts over
 * 2 s records itself here and returns, and every later wait returns at once, so that a hung kernel
 * ends (its outputs garbage) and the host can say which barrier never completed (wg_watch_report in
 * moe_wgmma.cu). */
struct wg_watch {
	unsigned int hit;         /* 1 once a wait timed out */
	unsigned int block, thread;
	uint32_t bar, parity;     /* the barrier's shared address and the parity waited for */
	uint32_t full, empty, turn; /* block 0's barrier arrays, to name it */
	uint32_t tfull, tempty;     /* and its claimed tiles' ring (the dynamic schedule) */
	unsigned long long state; /* the mbarrier's 64 bits when it timed out */
};
__device__ wg_watch wg_watchdog;
#endif

#ifdef WG_SM90A
#ifdef TIER_WG_WATCHDOG
__device__ __forceinline__ uint64_t wg_now_ns()
{
	uint64_t t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

__device__ __noinline__ void wg_watch_fire(uint32_t b, uint32_t parity)
{
	if (atomicCAS(&wg_watchdog.hit, 0u, 1u) == 0u) {
		unsigned long long st;
		asm volatile("ld.shared.b64 %0, [%1];" : "=l"(st) : "r"(b));
		wg_watchdog.block = blockIdx.x, wg_watchdog.thread = threadIdx.x;
		wg_watchdog.bar = b, wg_watchdog.parity = parity, wg_watchdog.state = st;
		__threadfence();
	}
}
#endif

/* Returns once the phase of parity `parity` has completed (parity 1 on a fresh barrier: at once). */
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t parity)
{
#ifdef TIER_WG_WATCHDOG
	uint64_t t0 = 0;
	unsigned n = 0;
#endif
	bool done;
	do {
		done = mbar_try(b, parity);
#ifdef TIER_WG_WATCHDOG
		if (!done && (++n & 63) == 0) {
			if (*(volatile unsigned int *)&wg_watchdog.hit)
				return;
			if (!t0)
				t0 = wg_now_ns();
			else if (wg_now_ns() - t0 > 2000000000ull) {
				wg_watch_fire(b, parity);
				return;
			}
		}
#endif
	} while (!done);
}

/* The producer warpgroup's own named barrier: 3 (0 is the CTA's, 1 and 2 the consumers' staging
 * barriers, wg_wg_sync). */
__device__ __forceinline__ void producers_sync() { asm volatile("bar.sync 3, 128;\n" ::: "memory"); }

/* The MN-major B (w_kn 1) of a stage: its 64-column blocks WG_MN_BLOCK bytes apart. */
__device__ __forceinline__ uint64_t wg_desc_mn(uint32_t saddr) { return wg_desc_mn_at(saddr, WG_MN_BLOCK); }

#endif /* WG_SM90A */
#endif
