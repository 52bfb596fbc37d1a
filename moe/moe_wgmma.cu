/* moe_wgmma.cu - the experts' grouped GEMMs on Hopper tensor cores: C = alpha X op(W_e) + beta C over
 * each expert's rows, and the fused gate/up product with SwiGLU; wgmma reads both operands from
 * shared memory (moe_wgmma.h).
 *
 * Shared layout. A tile is BM x BN of the product (128 x 256, 128 x 128 or 64 x 256) and a stage
 * is 64 k: 64 bf16 are one 128-byte row, exactly one 128-byte swizzle atom. A stage is rows of 128
 * bytes in which the 16-byte chunk j of row r sits at chunk j ^ (r % 8) (the 128B swizzle, a function
 * of the address bits 4-9, hence a 1024-byte aligned ring), which 16-byte cp.async can write.
 *  - K-major operands (X rows, W_e [N, K] rows, gate_e and up_e rows hold k contiguously): row r of
 *    the stage is row r of the operand (descriptor: 8-row groups 1024 bytes apart; k + 16 within the
 *    row = start address + 32 bytes).
 *  - The MN-major B of W_e [K, N] (w_kn 1: N contiguous; wgmma's transposed B, imm-trans-b 1): blocks
 *    of 64 columns (128 bytes) x 64 k, 8 KiB each, in column order; row r of a block is k0 + r
 *    (descriptor: LBO = 8192 between 64-column blocks, SBO = 1024 between 8-k groups; k + 16 = two
 *    8-k groups = start address + 2048 bytes). PTX ISA, "Shared Memory Matrix Layout": the canonical
 *    MN-major 128B layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in bf16 elements.
 * TMA (one producer thread, a tensor map per expert) writes the same layout through its 128B
 * swizzle: it loads the main part and the one-half segments by default, cp.async the rest
 * (TIER_MOE_WGMMA_TMA, moe_wgmma.h).
 *
 * Gate/up. The 16-row group q of the B tile holds rows col0 + 8 q..+7 of gate_e in its first 8 rows
 * and the same rows of up_e in its last 8, so the accumulator's 8-column block 2 q is g and 2 q + 1
 * is u of the same output columns, in registers of the same thread (the accumulator layout at
 * wg_store): the epilogue writes g, u and bf16(silu(g) u) from them. A tile has BN / 2 output
 * columns, and x is read once for both products.
 *
 * Roles. Warpgroup 0 is the producer: TMA or cp.async global -> shared through a STAGES-deep ring. Warpgroups
 * 1 and 2 are the consumers: cooperative tiles (one a CTA) give each 64 rows x WN columns (the two
 * halves of M when BM = 128, of N when BM = 64); ping-pong tiles (pp, one a consumer) give each
 * consumer whole tiles in turn (wg_cfg). Each stage has two mbarriers: "full" completes when the
 * producer's 128 threads' copies have landed (cp.async.mbarrier.arrive.noinc: the producer never
 * blocks on its own copies; a TMA stage's thread arrives for all 128 and the barrier also waits for
 * the stage's bytes), "empty" when the consumer warps that read it (8, or 4 with ping-pong)
 * are done with it (wgmma.wait_group has seen the products that read it complete). The copies land
 * through the generic proxy and wgmma reads through the async proxy, so a consumer fences the proxies
 * after each full wait. bf16 outputs leave through a per-consumer staging in shared memory (the
 * staged epilogue below).
 *
 * Schedule. The grid is persistent (one CTA per SM): CTA b takes tiles b, b + grid, ... of the list
 * ordered by row tile, then column tile (columns fastest: the CTAs working at once share X row tiles
 * and the weights of few experts in L2). The host does not know the offsets, so each CTA first turns
 * the device offsets into a shared table of each expert's first row tile (one block scan); every
 * warpgroup then finds a tile's expert by binary search without further barriers, and the producer
 * runs on into the next tile while the consumers store the last one (with ping-pong, one consumer
 * multiplies while the other stores).
 *
 * CTA pairs (wg_cfg::CL 2, TIER_MOE_WGMMA_CLUSTER=2): clusters of two CTAs walk the list of 2 BM-row
 * tiles, each CTA computing BM rows of its pair's tile. B is the same for both, so each CTA's
 * producer loads its own A and half of the main segment's B with a multicast copy into both CTAs'
 * stages: per pair the weights cross from L2 once instead of twice (on qwen3-30b's gate/up, 128x256
 * tiles move 1.5 MiB a tile from L2, about 6 TB/s at the measured speed; the pair moves 2 MiB for two).
 * A stage is then refilled only when the consumers of both CTAs have released it.
 *
 * Rows past a group's end, columns past N and k past K are zero-filled (cp.async with source size 0)
 * and never stored. Compiled for sm_90a only (wgmma); the compute_90 PTX of the build traps, and the
 * host refuses any device but compute capability 9.0. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_wgmma_cfg.cuh"
#include "moe/moe_wgmma_ptx.cuh"
#include "moe/moe_wgmma_store.cuh"
#include "base/pdl.cuh"

#ifdef WG_SM90A
/* ---- the tile table ---- */
/* tile0 and roff from the device offsets: each thread sums the tiles of up to ceil(E / 384)
 * consecutive experts; a shuffle scan per warp and the 12 warp totals give each thread its first
 * tile. All threads; synchronises. */
template <int BM, class ARGS>
__device__ static void wg_table(const ARGS &a, const wg_shared &sh)
{
	int tid = threadIdx.x;
	int per = (a.E + WG_THREADS - 1) / WG_THREADS, e0 = min(tid * per, a.E), e1 = min(e0 + per, a.E), mine = 0;
	for (int e = e0; e < e1; e++) {
		int lo = a.off[e];
		sh.roff[e] = lo;
		mine += moe_row_tiles<BM>(lo, a.off[e + 1]);
	}
	if (tid == 0)
		sh.roff[a.E] = a.off[a.E];
	int first = block_exclusive_scan(mine, sh.wsum); /* its barrier publishes roff too */
	for (int e = e0; e < e1; e++) {
		sh.tile0[e] = first;
		first += moe_row_tiles<BM>(sh.roff[e], sh.roff[e + 1]);
	}
	if (tid == WG_THREADS - 1) /* its range is the last one: first is now the total */
		sh.tile0[a.E] = first;
	__syncthreads();
}

/* Tile t: row tile rt = t / ncol, in the expert whose tiles (counted in expert order) cover it - the
 * last e with tile0[e] <= rt, as empty experts share their successor's tile0 - and column tile
 * t % ncol (BN output columns). */
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

/* The CTA's share of the schedule: its first tile and the step to its next (the grid's CTAs, or with
 * CTA pairs the grid's clusters, each pair's CTAs taking the same tiles). */
template <class CFG>
__device__ __forceinline__ long long wg_first_tile(void)
{
	return CFG::CL == 1 ? (long long)blockIdx.x : (long long)cluster_id_x();
}
template <class CFG>
__device__ __forceinline__ long long wg_tile_step(void)
{
	return CFG::CL == 1 ? (long long)gridDim.x : (long long)cluster_count_x();
}

/* Tile t as this CTA computes it: a pair's tile is CL BM rows (the table counts tiles of that
 * height), of which the CTA of rank r takes BM from row r BM. */
template <class CFG>
__device__ __forceinline__ wg_tile wg_find_own(const wg_shared &sh, int E, long long t, int ncol)
{
	wg_tile tl = wg_find<CFG::BM * CFG::CL, CFG::OBN>(sh, E, t, ncol);
	if constexpr (CFG::CL > 1)
		tl.row0 += (int)cluster_rank() * CFG::BM;
	return tl;
}

template <class CFG>
__device__ __forceinline__ wg_shared wg_carve(unsigned char *smem)
{
	uint32_t base = wg_saddr(smem), pad = (1024u - (base & 1023u)) & 1023u;
	wg_shared sh;
	sh.ring = base + pad;
	/* the TMA stores' stagings right after the ring, 1024-byte aligned (their swizzle) */
	uint32_t st = CFG::ST ? 4 * WG_ST_BYTES : 0;
	sh.full = sh.ring + CFG::STAGES * CFG::STAGE + st;
	sh.empty = sh.full + 8 * CFG::STAGES;
	sh.turn = sh.empty + 8 * CFG::STAGES;
	sh.out = CFG::ST ? smem + pad + CFG::STAGES * CFG::STAGE : smem + pad + CFG::STAGES * CFG::STAGE + 16 * CFG::STAGES + 16;
	sh.tile0 = CFG::ST ? (int *)(sh.out + st + 16 * CFG::STAGES + 16)
			   : (int *)(sh.out + (CFG::STG ? 2 * WG_OUT_BYTES : 0));
	sh.roff = sh.tile0 + TIER_MOE_MAX_EXPERTS + 1;
	sh.wsum = sh.roff + TIER_MOE_MAX_EXPERTS + 1;
	uintptr_t q = ((uintptr_t)(sh.wsum + WG_THREADS / 32) + 7) & ~(uintptr_t)7;
	sh.tids = (long long *)q;
	sh.tfull = wg_saddr(sh.tids + WG_SCHED);
	sh.tempty = sh.tfull + 8 * WG_SCHED;
	return sh;
}

/* ---- the CTA's tiles in turn ----
 * Static (args::sched NULL): CTA b takes tiles b, b + step, ... Dynamic (CFG::DYN with a counter;
 * TIER_MOE_WGMMA_SCHED=dynamic): the producer's thread 0 claims each tile from the launch's counter
 * STAGES stages before the last load of the one before (its maps a stage later; wg_produce_tma)
 * and posts it in a ring of WG_SCHED slots, which every reader warp reads in turn; a claim past
 * the last tile, posted too, ends the sequence.
 * Claimed in order, the row tiles of an expert's column tile (t and t + ncol) start close together
 * whatever each costs, so the second finds the expert's weights in L2. With every CTA taking each
 * grid-th tile that holds only while all tiles cost the same: idle consumers broke it in session
 * 31, and seed-896's weights came from HBM twice. */
struct wg_seq {
	long long t; /* the tile */
	int n;       /* dynamic: the ring's slots posted or read so far (slot n % WG_SCHED, lap n / WG_SCHED) */
};
static_assert((WG_SCHED & (WG_SCHED - 1)) == 0, "the ring's slot and parity from one count");

template <class CFG>
__device__ __forceinline__ bool wg_dyn(const typename CFG::args &a)
{
	return CFG::DYN && a.sched;
}

/* Whether the producer warpgroup's other threads load stages (segments by cp.async): then they read
 * the ring too, else they have nothing to do under the dynamic schedule. */
template <class CFG>
__device__ __forceinline__ bool wg_prod_reads(const typename CFG::args &a)
{
	for (int q = 0; q < a.nseg; q++)
		if (CFG::MODE == WG_GU || a.smap[q] < 0)
			return true;
	return false;
}

/* The poster: t into the next slot once every reader warp has read the slot's last tile. */
__device__ __forceinline__ long long wg_seq_post(const wg_shared &sh, wg_seq &q, long long t)
{
	int j = q.n % WG_SCHED;
	bar_wait(sh.tempty + 8 * j, ((q.n / WG_SCHED) & 1) ^ 1);
	sh.tids[j] = t;
	bar_arrive(sh.tfull + 8 * j); /* release: whoever acquires the phase sees the tile */
	q.n++;
	return q.t = t;
}

/* A reader: the slot's tile once posted. Lane 0 (lane 1 in warp 0, whose lane 0 posts) hands the
 * slot back once the warp's readers all have it. */
__device__ __forceinline__ long long wg_seq_read(const wg_shared &sh, wg_seq &q)
{
	int j = q.n % WG_SCHED, w0 = threadIdx.x < 32;
	bar_wait(sh.tfull + 8 * j, (q.n / WG_SCHED) & 1);
	long long t = *(volatile long long *)&sh.tids[j];
	__syncwarp(w0 ? ~1u : ~0u);
	if ((threadIdx.x & 31) == (unsigned)w0)
		bar_arrive(sh.tempty + 8 * j);
	q.n++;
	return q.t = t;
}

/* The poster's claim of the tile after its current one, made once (*nxt -1: not yet): asked for
 * STAGES stages before the current tile's last load, again for its maps, and when it is posted. */
template <class CFG>
__device__ __forceinline__ long long wg_seq_claim(const typename CFG::args &a, long long *nxt)
{
	if (*nxt < 0)
		*nxt = atomicAdd(a.sched, 1u);
	return *nxt;
}

/* The tile after the current one: step on, or (dynamic) the poster's next claim (nxt non-NULL: the
 * lookahead's, or one made now) posted, or the next slot read. */
template <class CFG>
__device__ __forceinline__ long long wg_seq_next(const typename CFG::args &a, const wg_shared &sh, wg_seq &q,
						 long long *nxt, long long step)
{
	if (!wg_dyn<CFG>(a))
		return q.t += step;
	if (!nxt)
		return wg_seq_read(sh, q);
	long long t = wg_seq_claim<CFG>(a, nxt);
	*nxt = -1; /* taken: the lookahead's next claim is a new one */
	return wg_seq_post(sh, q, t);
}

/* The first tile: first, or (dynamic) the first claim, posted or read. */
template <class CFG>
__device__ __forceinline__ long long wg_seq_start(const typename CFG::args &a, const wg_shared &sh, wg_seq &q,
						  long long *nxt, long long first)
{
	q.n = 0;
	return wg_dyn<CFG>(a) ? wg_seq_next<CFG>(a, sh, q, nxt, 0) : (q.t = first);
}

/* ---- the producer: warpgroup 0 ---- */
/* The producer thread's chunk: j = p % 8 of the stage rows r0 + 16 i (r0 = p / 8); all its rows share
 * r % 8, hence the swizzled chunk j ^ (r % 8) at byte dst of each 16-row step. */
struct wg_lane {
	int j, r0;
	uint32_t dst;
};

__device__ __forceinline__ wg_lane wg_lane_of(int tid)
{
	wg_lane ln;
	ln.j = tid & 7, ln.r0 = tid >> 3;
	ln.dst = (uint32_t)(ln.r0 * WG_ROW + ((ln.j ^ (ln.r0 & 7)) << 4));
	return ln;
}

/* Waits until stage s is free again (parity ph ^ 1: the first lap passes at once); its A and B. */
template <class CFG>
__device__ __forceinline__ uint32_t wg_stage_free(const wg_shared &sh, int s, uint32_t ph, const wg_lane &ln)
{
	bar_wait(sh.empty + 8 * s, ph ^ 1);
	return sh.ring + s * CFG::STAGE + ln.dst;
}

/* With CTA pairs, one arrival on the other CTA's full barrier of stage s, once this CTA found the
 * stage free: a stage then completes in either CTA only after both have released its last fill, so
 * that no consumer warp can arrive for the next fill on a barrier whose current phase still waits
 * for the other CTA's warps (the multicast halves of B order this alone; a segment's stages, which
 * each CTA loads for itself, need the arrival). */
template <class CFG>
__device__ __forceinline__ void wg_pair_arrive(const wg_shared &sh, int s)
{
	if constexpr (CFG::CL == 2)
		bar_arrive_cluster(sh.full + 8 * s, cluster_rank() ^ 1u);
}

/* The ring stages of K k. */
__device__ __forceinline__ int wg_kstages(int K) { return (K + WG_BK - 1) / WG_BK; }

/* Moves a ring position n stages on without using them (the other consumer's tile, or stages
 * another producer thread loads). */
__device__ __forceinline__ void wg_skip(int &s, uint32_t &ph, int n, int stages)
{
	s += n;
	ph ^= (uint32_t)(s / stages) & 1u;
	s %= stages;
}

__device__ __forceinline__ void wg_stage_next(const wg_shared &sh, int &s, uint32_t &ph, int stages)
{
	bar_arrive_copies(sh.full + 8 * s);
	ring_next(s, ph, stages);
}

/* The main segment of tile tl. Stage row r0 + 16 i of B is
 *  - W_e [N, K]: row col0 + r0 + 16 i of W_e, k chunk j;
 *  - gate/up: row col0 + r0 % 8 + 8 i of gate_e (r0 < 8) or up_e (r0 >= 8), k chunk j;
 *  - W_e [K, N]: row k0 + r0 + 16 (i % 4) of W_e (a k), columns col0 + 64 (i / 4) + 8 j..+7: in
 *    block i / 4 at row r0 + 16 (i % 4), i.e. 2048 i bytes past the thread's first chunk as well. */
template <class CFG>
__device__ static void wg_load_main(const typename CFG::args &a, const wg_shared &sh, const wg_tile &tl,
				    const wg_lane &ln, int &s, uint32_t &ph)
{
	constexpr int MODE = CFG::MODE;
	int j = ln.j, r0 = ln.r0;
	size_t step = (size_t)16 * a.K; /* 16 rows */
	size_t bstep = MODE == WG_KN ? (size_t)16 * a.N : MODE == WG_GU ? (size_t)8 * a.K : step;
	const bf16 *W = a.w[tl.e], *wb;
	/* the base addresses of rows that are out are never read */
	const bf16 *xa = a.x + (size_t)(tl.row0 + r0) * a.K + 8 * j;
	int arows = tl.rend - tl.row0 - r0; /* row r0 + 16 i is in when 16 i < arows */
	int bin; /* W_e [N, K]: B row i is in when 16 i < bin; gate/up: 8 i < bin; W_e [K, N]: 64 (i / 4) < bin */
	if constexpr (MODE == WG_KN) {
		wb = W + (size_t)r0 * a.N + tl.col0 + 8 * j;
		bin = a.N - tl.col0 - 8 * j; /* N % 8 == 0: a chunk is all in or all out */
	} else if constexpr (MODE == WG_GU) {
		wb = (r0 < 8 ? W : a.up[tl.e]) + (size_t)(tl.col0 + (r0 & 7)) * a.K + 8 * j;
		bin = a.N - tl.col0 - (r0 & 7);
	} else {
		wb = W + (size_t)(tl.col0 + r0) * a.K + 8 * j;
		bin = a.N - tl.col0 - r0;
	}
	for (int k0 = 0; k0 < a.K; k0 += WG_BK) {
		uint32_t sa = wg_stage_free<CFG>(sh, s, ph, ln), sb = sa + CFG::A_BYTES;
		bool kin = k0 + 8 * j < a.K; /* K % 8 == 0: a chunk is all in or all out */
#pragma unroll
		for (int i = 0; i < CFG::BM / 16; i++) {
			bool ok = kin && 16 * i < arows;
			if (CFG::DBG != WG_DBG_NOLOAD)
				cp_async16(sa + i * 16 * WG_ROW, ok ? xa + i * step + k0 : a.x, ok);
		}
		if constexpr (CFG::DBG == WG_DBG_NOLOAD) {
		} else if constexpr (MODE == WG_KN) {
			const bf16 *wk = wb + (size_t)k0 * a.N;
			int kleft = a.K - k0 - r0; /* k row r0 + 16 (i % 4) is in when 16 (i % 4) < kleft */
#pragma unroll
			for (int i = 0; i < CFG::BN / 16; i++) {
				bool ok = 16 * (i & 3) < kleft && 64 * (i >> 2) < bin;
				cp_async16(sb + i * 16 * WG_ROW, ok ? wk + (i & 3) * bstep + 64 * (i >> 2) : W, ok);
			}
		} else {
#pragma unroll
			for (int i = 0; i < CFG::BN / 16; i++) {
				bool ok = kin && (MODE == WG_GU ? 8 : 16) * i < bin;
				cp_async16(sb + i * 16 * WG_ROW, ok ? wb + i * bstep + k0 : W, ok);
			}
		}
		wg_stage_next(sh, s, ph, CFG::STAGES);
	}
}

/* An extra segment of tile tl: k < K0 multiplies x0 by W0_e, the next K1 k x1 by W1_e (each with
 * its own row stride, K0 or K1). The stage rows are those of the main segment; a chunk's k picks
 * the half. In gate/up the gate rows take W0_e's k only and the up rows W1_e's (the other half's
 * rows load zeros), so that g gets x0 W0_e^T and u gets x1 W1_e^T: the LoRA B products of both
 * adapters, whose A operands x0 = Z_gate and x1 = Z_up differ. One stage for LoRA ranks up to 32. */
template <class CFG>
__device__ static void wg_load_seg(const typename CFG::args &a, const wg_seg_dev &sg, const wg_shared &sh,
				   const wg_tile &tl, const wg_lane &ln, int &s, uint32_t &ph)
{
	constexpr int MODE = CFG::MODE;
	int j = ln.j, r0 = ln.r0, K = sg.K0 + sg.K1;
	const bf16 *W0 = sg.K0 ? sg.w0[tl.e] : NULL, *W1 = sg.K1 ? sg.w1[tl.e] : NULL;
	int arows = tl.rend - tl.row0 - r0;
	for (int k0 = 0; k0 < K; k0 += WG_BK) {
		uint32_t sa = wg_stage_free<CFG>(sh, s, ph, ln), sb = sa + CFG::A_BYTES;
		if (threadIdx.x == 0)
			wg_pair_arrive<CFG>(sh, s);
		int k = k0 + 8 * j;
		bool kin = k < K, hi = k >= sg.K0;
		int kh = hi ? k - sg.K0 : k, Kh = hi ? sg.K1 : sg.K0;
		const bf16 *xs = hi ? sg.x1 : sg.x0, *Ws = hi ? W1 : W0;
#pragma unroll
		for (int i = 0; i < CFG::BM / 16; i++) {
			bool ok = kin && 16 * i < arows;
			if (CFG::DBG != WG_DBG_NOLOAD)
				cp_async16(sa + i * 16 * WG_ROW, ok ? xs + (size_t)(tl.row0 + r0 + 16 * i) * Kh + kh : a.x, ok);
		}
#pragma unroll
		for (int i = 0; i < CFG::BN / 16; i++) {
			const bf16 *src = NULL;
			bool ok;
			if constexpr (MODE == WG_KN) {
				int kr = k0 + r0 + 16 * (i & 3), col = tl.col0 + 64 * (i >> 2) + 8 * j;
				bool khi = kr >= sg.K0;
				ok = kr < K && col < a.N;
				if (ok)
					src = (khi ? W1 : W0) + (size_t)(khi ? kr - sg.K0 : kr) * a.N + col;
			} else if constexpr (MODE == WG_GU) {
				/* the B rows as the main part has them: gate and up rows 8 at a time, or with TMA
				 * BN / 2 gate rows, then BN / 2 up rows */
				int R = r0 + 16 * i;
				bool upr = CFG::TMA ? R >= CFG::BN / 2 : r0 >= 8;
				int c = tl.col0 + (CFG::TMA ? R - (upr ? CFG::BN / 2 : 0) : (r0 & 7) + 8 * i);
				ok = kin && upr == hi && c < a.N;
				if (ok)
					src = Ws + (size_t)c * Kh + kh;
			} else {
				int c = tl.col0 + r0 + 16 * i;
				ok = kin && c < a.N;
				if (ok)
					src = Ws + (size_t)c * Kh + kh;
			}
			if (CFG::DBG != WG_DBG_NOLOAD)
				cp_async16(sb + i * 16 * WG_ROW, ok ? src : a.x, ok);
		}
		wg_stage_next(sh, s, ph, CFG::STAGES);
	}
}

/* Each tile's main segment, then its extra ones, through the STAGES-deep ring. */
template <class CFG>
__device__ static void wg_produce(const typename CFG::args &a, const wg_shared &sh, int ncol, long long total)
{
	wg_lane ln = wg_lane_of(threadIdx.x);
	int s = 0;
	uint32_t ph = 0;
	for (long long t = wg_first_tile<CFG>(); t < total; t += wg_tile_step<CFG>()) {
		wg_tile tl = wg_find_own<CFG>(sh, a.E, t, ncol);
		wg_load_main<CFG>(a, sh, tl, ln, s, ph);
		for (int q = 0; q < a.nseg; q++)
			wg_load_seg<CFG>(a, a.seg[q], sh, tl, ln, s, ph);
	}
	cp_async_wait_all(); /* no copy left in flight behind an exiting thread */
}

/* ---- the TMA producer (CFG::TMA) ---- */
/* B's boxes of one stage from map m: W_e [N, K] (or a segment's [N, K0]) the BN x 64 box at (k0,
 * col0); W_e [K, N] BN / 64 boxes of 64 k x 64 columns, one MN-major block each. With CTA pairs
 * each CTA loads half of them (W_e [N, K]: the map's boxes are BN / 2 rows), multicast to both. */
template <class CFG>
__device__ __forceinline__ void wg_tma_b(uint32_t sb, const CUtensorMap *m, int k0, int col0, uint32_t fb, bool mc)
{
	if (CFG::CL == 2 && !mc) { /* a segment's B: this CTA's own, both halves */
		if constexpr (CFG::MODE == WG_KN) {
#pragma unroll
			for (int b = 0; b < CFG::BN / 64; b++)
				tma_load(sb + b * WG_MN_BLOCK, m, col0 + 64 * b, k0, fb);
		} else {
			tma_load(sb, m, k0, col0, fb);
			tma_load(sb + (CFG::BN / 2) * WG_ROW, m, k0, col0 + CFG::BN / 2, fb);
		}
	} else if constexpr (CFG::CL == 2) {
		int r = (int)cluster_rank();
		if constexpr (CFG::MODE == WG_KN) {
#pragma unroll
			for (int b = r; b < CFG::BN / 64; b += 2)
				tma_load_mc(sb + b * WG_MN_BLOCK, m, col0 + 64 * b, k0, fb, 3);
		} else {
			tma_load_mc(sb + r * (CFG::BN / 2) * WG_ROW, m, k0, col0 + r * (CFG::BN / 2), fb, 3);
		}
	} else if constexpr (CFG::MODE == WG_KN) {
#pragma unroll
		for (int b = 0; b < CFG::BN / 64; b++)
			tma_load(sb + b * WG_MN_BLOCK, m, col0 + 64 * b, k0, fb);
	} else {
		tma_load(sb, m, k0, col0, fb);
	}
}

/* The stages of K k of tile tl, loaded by TMA from the producer thread: x's (or a segment's x0's)
 * BM x 64 box at (k0, row0) and B's; gate/up's main segment gate_e's and up_e's BN / 2 x 64 boxes
 * one after the other. Rows past a group's end are the next group's (multiplied, never stored);
 * past the matrices' edges TMA fills zeros. The full barrier expects all the stage's bytes, zeros
 * included, and takes the arrivals of all the producer threads from this one. mc: the main
 * segment, whose B CTA pairs share by multicast (a segment's B each CTA loads whole). */
template <class CFG, class AT>
__device__ static void wg_tma_stages(const CUtensorMap *am, const CUtensorMap *bm, const CUtensorMap *um, int K,
				     const wg_shared &sh, const wg_tile &tl, int &s, uint32_t &ph, bool mc, AT &&at)
{
	for (int k0 = 0, i = 0; k0 < K; k0 += WG_BK, i++) {
		at(i); /* the caller's work at stage i, before the wait for its slot */
		bar_wait(sh.empty + 8 * s, ph ^ 1);
		uint32_t sa = sh.ring + s * CFG::STAGE, sb = sa + CFG::A_BYTES, fb = sh.full + 8 * s;
		if constexpr (CFG::DBG == WG_DBG_NOLOAD) { /* the stage full at once, its bytes as they were */
		} else if constexpr (CFG::MODE == WG_GU) {
			bar_expect_tx(fb, CFG::STAGE);
			tma_load(sa, am, k0, tl.row0, fb);
			if (CFG::CL == 1) {
				tma_load(sb, bm, k0, tl.col0, fb);
				tma_load(sb + CFG::BN / 2 * WG_ROW, um, k0, tl.col0, fb);
			} else if (cluster_rank() == 0) { /* gate_e's box to both CTAs, up_e's from the other */
				tma_load_mc(sb, bm, k0, tl.col0, fb, 3);
			} else {
				tma_load_mc(sb + CFG::BN / 2 * WG_ROW, um, k0, tl.col0, fb, 3);
			}
		} else {
			bar_expect_tx(fb, CFG::STAGE);
			tma_load(sa, am, k0, tl.row0, fb);
			wg_tma_b<CFG>(sb, bm, k0, tl.col0, fb, mc);
		}
		bar_arrive_n(fb, WG_PRODUCERS);
		wg_pair_arrive<CFG>(sh, s);
		ring_next(s, ph, CFG::STAGES);
	}
}

/* The maps of expert e, written by the map kernel (their memory may have held another launch's
 * maps, which the tensor-map proxy could still cache): acquired, then prefetched (pf) so that their
 * first copies need not wait for them. */
template <class CFG>
__device__ __forceinline__ void wg_maps_acquire(const typename CFG::args &a, int e, bool pf)
{
	constexpr int MAIN = CFG::MODE == WG_GU ? 2 : 1;
	for (int i = 0; i < MAIN + a.nseg; i++) {
		int base = i < MAIN ? i * a.E : a.smap[i - MAIN];
		if (base < 0)
			continue;
		tmap_acquire(a.bmap + base + e, pf);
	}
}

/* The maps of tile tn's expert acquired ahead (next: the expert of the last lookahead). */
template <class CFG>
__device__ __forceinline__ void wg_lookahead(const typename CFG::args &a, const wg_shared &sh, long long tn,
					     long long total, int ncol, int cur, int &next)
{
	if (tn >= total)
		return;
	int e = wg_find_own<CFG>(sh, a.E, tn, ncol).e;
	if (e != cur && e != next)
		wg_maps_acquire<CFG>(a, e, true);
	next = e;
}

/* Thread 0 loads the main segment, and the extra segments with a map (smap), by TMA; the other
 * producer threads pass over those stages. Segments without a map take cp.async from the whole
 * warpgroup, which first meets (producers_sync) so that all its threads wait on the same lap of the
 * ring: one that ran on over many TMA stages could otherwise wait on a stage two laps ahead, whose
 * parity would read as free. */
template <class CFG>
__device__ static void wg_produce_tma(const typename CFG::args &a, const wg_shared &sh, int ncol, long long total)
{
	constexpr int GU = CFG::MODE == WG_GU;
	int tid = threadIdx.x, s = 0, cur = -1, next = -1;
	uint32_t ph = 0;
	wg_lane ln = wg_lane_of(tid);
	if (wg_dyn<CFG>(a) && tid && !wg_prod_reads<CFG>(a))
		return; /* thread 0 loads every stage by TMA */
	wg_seq sq;
	long long claim = -1, *nxt = tid == 0 ? &claim : NULL; /* thread 0 posts the claims */
	for (long long t = wg_seq_start<CFG>(a, sh, sq, nxt, wg_first_tile<CFG>()); t < total;
	     t = wg_seq_next<CFG>(a, sh, sq, nxt, wg_tile_step<CFG>())) {
		wg_tile tl = wg_find_own<CFG>(sh, a.E, t, ncol);
		if (tid == 0) {
			if (tl.e != cur && tl.e != next) /* the CTA's first tile: no lookahead acquired it */
				wg_maps_acquire<CFG>(a, tl.e, false);
			cur = tl.e;
			if (!wg_dyn<CFG>(a)) /* the next tile's maps, while this one loads */
				wg_lookahead<CFG>(a, sh, t + wg_tile_step<CFG>(), total, ncol, cur, next);
			/* dynamic: the next tile claimed STAGES stages before this one's last, so that the
			 * atomic's round trip (long where HBM is busy) passes while the ring is full, and its
			 * maps acquired a stage later; tiles claimed in turn still start nearly in turn.
			 * Claimed after the last stage (session 32's first run), the claim and the maps stood
			 * between two tiles' loads: seed-896's gate-up-mm 4-8% slower on an H100. */
			const int nk = wg_kstages(a.K), kc = max(0, nk - CFG::STAGES);
			wg_tma_stages<CFG>(&a.amap, a.bmap + tl.e, a.bmap + a.E + tl.e, a.K, sh, tl, s, ph, true, [&](int i) {
				if (!wg_dyn<CFG>(a))
					return;
				if (i == kc)
					wg_seq_claim<CFG>(a, nxt);
				else if (i == kc + 1)
					wg_lookahead<CFG>(a, sh, wg_seq_claim<CFG>(a, nxt), total, ncol, cur, next);
			});
			if (wg_dyn<CFG>(a) && nk == 1) /* a tile of one stage: its claim's maps after it */
				wg_lookahead<CFG>(a, sh, wg_seq_claim<CFG>(a, nxt), total, ncol, cur, next);
		} else {
			wg_skip(s, ph, wg_kstages(a.K), CFG::STAGES);
		}
		for (int q = 0; q < a.nseg; q++) {
			int K = a.seg[q].K0 + a.seg[q].K1;
			if (!GU && a.smap[q] >= 0) {
				if (tid == 0)
					wg_tma_stages<CFG>(&a.xmap[q], a.bmap + a.smap[q] + tl.e, NULL, K, sh, tl, s, ph, false,
							   [](int) {});
				else
					wg_skip(s, ph, wg_kstages(K), CFG::STAGES);
			} else {
				__syncwarp();
				producers_sync();
				wg_load_seg<CFG>(a, a.seg[q], sh, tl, ln, s, ph);
			}
		}
	}
	cp_async_wait_all();
}

/* ---- the consumers: warpgroups 1 and 2 ---- */
/* One arrival per consumer warp: wgmma.wait_group is warp-synchronous, so lane 0 past it means the
 * warp's products that read the stage are complete. With CTA pairs on the other CTA's barrier too
 * (its producer's half of B comes into this CTA's stage). */
template <class CFG>
__device__ __forceinline__ void wg_release(const wg_shared &sh, int s, int lane)
{
	if (lane != 0)
		return;
	if constexpr (CFG::CL == 2)
		bar_arrive_cluster(sh.empty + 8 * s, cluster_rank() ^ 1u);
	bar_arrive(sh.empty + 8 * s);
}

/* n stages handed back as each fills, their products skipped. */
template <class CFG>
__device__ __forceinline__ void wg_pass(const wg_shared &sh, int &s, uint32_t &ph, int n, int lane)
{
	for (; n > 0; n--) {
		bar_wait(sh.full + 8 * s, ph);
		__syncwarp();
		wg_release<CFG>(sh, s, lane);
		ring_next(s, ph, CFG::STAGES);
	}
}

/* The ring stages of one tile: its main segment's and each extra segment's. */
__device__ __forceinline__ int wg_tile_stages(int K, int nseg, const wg_seg_dev *seg)
{
	int n = wg_kstages(K);
	for (int q = 0; q < nseg; q++)
		n += wg_kstages(seg[q].K0 + seg[q].K1);
	return n;
}

/* One tile's products into d: per stage one group of 4 k-steps (k past a segment's end are zeros)
 * on each of the MT 64-row blocks is issued while the previous stage's group may still run; that
 * stage goes back to the producer once its group is complete. The main segment's stages, then each
 * extra segment's, all summed into one accumulator.
 * idle: the consumer's rows all lie past the group's end (the second 64 rows of a group's last
 * 128-row tile, or a pair's second CTA on an odd last tile; TIER_MOE_WGMMA_IDLE=1): it multiplies nothing and hands every stage
 * back as it fills, so the other consumer's products have the tensor cores alone (on seed-896's
 * groups of ~146 rows, half of each group's second tile). The products are skipped by running their
 * loops zero times, not by a branch around them: with such a branch ptxas serialised the wgmmas
 * (C7515) of 64 of the 104 kernels, and of 95 when d was also zeroed on the idle path. */
template <class CFG>
__device__ __forceinline__ void wg_mainloop(float (&d)[CFG::MT][CFG::WN / 2], const typename CFG::args &a,
					    const wg_shared &sh, int &s, uint32_t &ph, uint32_t aoff, uint32_t boff,
					    uint32_t turn, int lane, bool idle)
{
	constexpr int TB = CFG::MODE == WG_KN;        /* B is MN-major */
	constexpr int BSTEP = TB ? 2048 >> 4 : 32 >> 4; /* k + 16 in B's start address: 2 8-k groups, or 32 bytes */
	int first = 1, prev = 0;
	for (int q = -1; q < a.nseg; q++) {
		int K = idle ? 0 : q < 0 ? a.K : a.seg[q].K0 + a.seg[q].K1;
		for (int k0 = 0; k0 < K; k0 += WG_BK) {
			bar_wait(sh.full + 8 * s, ph);
			__syncwarp(); /* the .aligned instructions below want the warp converged */
			fence_proxy_async();
			uint32_t st = sh.ring + s * CFG::STAGE;
			uint64_t db = TB ? wg_desc_mn(st + boff) : wg_desc(st + boff);
#pragma unroll
			for (int m = 0; m < CFG::MT; m++)
				acc_fence(d[m]);
			wgmma_fence();
			/* all products even in a segment's last, partial stage (its k past the end are zeros): a
			 * branch around wgmma makes ptxas serialise every wgmma of the kernel */
#pragma unroll
			for (int kk = 0; kk < WG_BK / 16; kk++) /* A: k + 16 = 32 bytes = 2 in the start address */
#pragma unroll
				for (int m = 0; m < CFG::MT; m++)
					wgmma_op<TB>(d[m], wg_desc(st + aoff + m * 64 * WG_ROW) + 2 * kk, db + BSTEP * kk,
						     !(first && kk == 0));
			wgmma_commit();
			if (!first) {
				wgmma_wait<1>();
				wg_release<CFG>(sh, prev, lane);
			}
#pragma unroll
			for (int m = 0; m < CFG::MT; m++)
				acc_fence(d[m]);
			first = 0, prev = s;
			ring_next(s, ph, CFG::STAGES);
		}
	}
	if (CFG::PP && lane == 0) /* every product of the tile issued: the other consumer's turn */
		bar_arrive(turn);
	__syncwarp(); /* converged for the .aligned wait */
	wgmma_wait<0>();
#pragma unroll
	for (int m = 0; m < CFG::MT; m++)
		acc_fence(d[m]);
	if (!idle)
		wg_release<CFG>(sh, prev, lane);
	else /* the count again from the parameters: holding the consumer's nk across the products
	      * cost the 128x256 kernels 4 bytes of spill */
		wg_pass<CFG>(sh, s, ph, wg_tile_stages(a.K, a.nseg, a.seg), lane);
}

/* WG_DBG_NOMMA's mainloop: every stage of the tile handed back as soon as it is full. */
template <class CFG>
__device__ __forceinline__ void wg_drain(const typename CFG::args &a, const wg_shared &sh, int &s, uint32_t &ph,
					 uint32_t turn, int lane)
{
	wg_pass<CFG>(sh, s, ph, wg_tile_stages(a.K, a.nseg, a.seg), lane);
	if (CFG::PP && lane == 0)
		bar_arrive(turn);
}

/* Consumer g (0 or 1). Cooperative: every tile of the CTA, its half of each (rows, or columns when
 * BM is 64). Ping-pong: the CTA's tiles g, g + 2, ... whole, passing over the other's stages; a tile's
 * products start once the other consumer has issued those of the CTA's tile before (turn). The turns
 * keep the two from multiplying at once, and they make the ring's parities safe: when a consumer
 * waits on a stage, every earlier fill of the ring has landed, so the stage is at most one fill
 * ahead of the parity it waits for (without them it could be two behind, and read as full). */
template <class CFG, typename OUT>
__device__ static void wg_consume(const typename CFG::args &a, const wg_shared &sh, int ncol, long long total, int g)
{
	float d[CFG::MT][CFG::WN / 2];
	int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, s = 0;
	int nk = wg_tile_stages(a.K, a.nseg, a.seg);
	uint32_t ph = 0, aoff = !CFG::PP && CFG::BM == 128 ? 64 * WG_ROW * g : 0;
	uint32_t boff = CFG::A_BYTES + (!CFG::PP && CFG::BM == 64 ? CFG::WN * WG_ROW * g : 0);
	int roff = !CFG::PP && CFG::BM == 128 ? 64 * g : 0;
	int coff = !CFG::PP && CFG::BM == 64 ? (CFG::MODE == WG_GU ? CFG::WN / 2 : CFG::WN) * g : 0;
	/* a consumer can find no rows of its group in its tile only where it takes the second 64 of 128 */
	constexpr bool CAN_IDLE = !CFG::PP && (CFG::BM == 128 || CFG::CL > 1);
	uint32_t tph = 0; /* the parity of the other's next turn */
	int nst = 0;      /* the TMA-store epilogue's subtiles so far (wg_st_sub) */
	if (CFG::PP && g)
		wg_skip(s, ph, nk, CFG::STAGES);
	/* ping-pong: the CTA's tiles g, g + 2, ... */
	long long first = wg_first_tile<CFG>() + (CFG::PP ? (long long)g * gridDim.x : 0);
	wg_seq q;
	int i = 0;
	for (long long t = wg_seq_start<CFG>(a, sh, q, NULL, first); t < total;
	     t = wg_seq_next<CFG>(a, sh, q, NULL, wg_tile_step<CFG>() * (CFG::PP ? 2 : 1)), i++) {
		if (CFG::PP && (g || i)) { /* the CTA's tile before this one has all its products issued */
			bar_wait(sh.turn + 8 * (1 - g), tph);
			tph ^= 1;
		}
		if constexpr (CFG::DBG == WG_DBG_NOMMA) {
			wg_drain<CFG>(a, sh, s, ph, sh.turn + 8 * g, lane);
#pragma unroll
			for (int m = 0; m < CFG::MT; m++)
				for (int j = 0; j < CFG::WN / 2; j++)
					d[m][j] = 0.0f;
		}
		wg_tile tl = wg_find_own<CFG>(sh, a.E, t, ncol);
		if constexpr (wg_is_swb<OUT>::v) /* g and u on their way to L2 while the products run */
			wg_swb_prefetch<CFG>(a, tl, roff, coff, tid);
		if constexpr (CFG::DBG != WG_DBG_NOMMA)
			wg_mainloop<CFG>(d, a, sh, s, ph, aoff, boff, sh.turn + 8 * g, lane,
					 CAN_IDLE && a.idle && tl.row0 + roff >= tl.rend);
		/* WG_DBG_NOSTORE stores only under a NaN alpha, which no caller passes: the products stay
		 * in the code (ptxas drops products whose results are never stored) and the time is theirs
		 * and the loads' */
		bool put = CFG::DBG != WG_DBG_NOSTORE || a.alpha != a.alpha;
#pragma unroll
		for (int m = 0; m < CFG::MT && put; m++) {
			int row0 = tl.row0 + roff + 64 * m;
			if (row0 >= tl.rend)
				break; /* the whole warpgroup alike: no staging barrier is left half-passed */
			if constexpr (CFG::MODE == WG_GU && CFG::ST)
				wg_put_gu_st<CFG>(d[m], a, sh, row0, tl.rend, tl.col0 + coff, g, warp, lane, nst);
			else if constexpr (CFG::MODE == WG_GU)
				wg_put_gu<CFG>(d[m], a, sh, row0, tl.rend, tl.col0 + coff, g, warp, lane);
			else if constexpr (wg_is_swb<OUT>::v)
				wg_put_swb<CFG>(d[m], a, sh, row0, tl.rend, tl.col0 + coff, g, warp, lane);
			else if constexpr (CFG::ST && sizeof(OUT) == 2) {
				if (!a.beta)
					wg_put_st<CFG>(d[m], a, sh, row0, tl.rend, tl.col0 + coff, g, warp, lane, nst);
				else
					wg_store<CFG, OUT>(d[m], a, tl, roff + 64 * m, coff, warp, lane);
			} else if (!a.beta)
				wg_put<CFG, OUT>(d[m], a, sh, row0, tl.rend, tl.col0 + coff, g, warp, lane);
			else
				wg_store<CFG, OUT>(d[m], a, tl, roff + 64 * m, coff, warp, lane);
		}
		if (CFG::PP)
			wg_skip(s, ph, nk, CFG::STAGES);
	}
	if constexpr (CFG::ST) /* the stores done before the CTA's shared memory goes */
		if (tid == 0)
			tma_reduce_wait();
}
#endif /* WG_SM90A */

/* ---- the kernel ---- */
/* Whether a kernel's consumers stage outputs: gate/up's g, u and h, or a bf16 C. */
template <int MODE, typename OUT>
struct wg_stg {
	static constexpr int v = MODE == WG_GU || sizeof(OUT) == 2 || wg_is_swb<OUT>::v;
};

template <int BM, int BN, int MODE, int PP, typename OUT, int DBG, int TMA, int CL, int ST>
__global__ void __launch_bounds__(WG_THREADS, 1) wg_kernel(const __grid_constant__ wg_args<MODE> a)
{
	pdl_enter();
#ifdef WG_SM90A
	typedef wg_cfg<BM, BN, MODE, PP, DBG, wg_stg<MODE, OUT>::v, TMA, CL, ST> CFG;
	extern __shared__ __align__(16) unsigned char wg_smem[];
	wg_shared sh = wg_carve<CFG>(wg_smem);
#ifdef TIER_WG_WATCHDOG
	if (blockIdx.x == 0 && threadIdx.x == 0) /* the same carving in every block */
		wg_watchdog.full = sh.full, wg_watchdog.empty = sh.empty, wg_watchdog.turn = sh.turn,
		wg_watchdog.tfull = sh.tfull, wg_watchdog.tempty = sh.tempty;
#endif
	if (threadIdx.x == 0) {
		for (int s = 0; s < CFG::STAGES; s++) {
			/* each producer thread, or the TMA thread for all; with CTA pairs the other's producer too */
			bar_init(sh.full + 8 * s, WG_PRODUCERS + CL - 1);
			bar_init(sh.empty + 8 * s, CFG::EMPTY_ARRIVALS);
		}
		bar_init(sh.turn, 4); /* one arrival per warp of the consumer */
		bar_init(sh.turn + 8, 4);
		if (wg_dyn<CFG>(a)) /* the claimed tiles' ring: the poster, then each reader warp */
			for (int j = 0; j < WG_SCHED; j++) {
				bar_init(sh.tfull + 8 * j, 1);
				bar_init(sh.tempty + 8 * j, 8 + (wg_prod_reads<CFG>(a) ? 4 : 0));
			}
		fence_barrier_init();
	}
	wg_table<BM * CL>(a, sh); /* its barriers also publish the initialised mbarriers */
	if constexpr (CL > 1) /* and to the other CTA, before its first copy lands here */
		cluster_sync();
	int ncol = (a.N + CFG::OBN - 1) / CFG::OBN;
	long long total = (long long)min(sh.tile0[a.E], a.rt_bound) * ncol;
	int g = threadIdx.x >> 7;
	/* SwiGLU's backward in the epilogue holds its arithmetic beside the accumulators: at the even
	 * share (168) a consumer of 256 columns spills ~1 KiB. The producers give registers up (72: at 56
	 * the TMA producer spills; the cp.async form spills ~100 bytes at 72, and is not the default)
	 * and the consumers take 216: 128 x 72 + 256 x 216 <= 64 Ki. (Gate/up's 128x256 TMA-store kernel
	 * spills 136 bytes at the even share, and 152 with this split, so it keeps the even share.) */
	constexpr bool regs = wg_is_swb<OUT>::v;
	if (g == 0) {
		if constexpr (regs)
			wg_regs_dec<72>();
		if constexpr (CFG::TMA)
			wg_produce_tma<CFG>(a, sh, ncol, total);
		else
			wg_produce<CFG>(a, sh, ncol, total);
	} else {
		if constexpr (regs)
			wg_regs_inc<216>();
		wg_consume<CFG, OUT>(a, sh, ncol, total, g - 1);
	}
	if constexpr (CL > 1) /* no CTA leaves while the other may still arrive on its barriers */
		cluster_sync();
#elif defined(__CUDA_ARCH__)
	__trap(); /* the compute_90 PTX, JIT-compiled for a later GPU: no wgmma there (the host refuses it) */
#endif
}

/* ---- host side ---- */
enum { WG_128x256, WG_128x128, WG_64x256, WG_PP64x256, WG_PP128x128, WG_SWAP, WG_NSHAPES };

/* A call's plan, each knob read once (wg_plan): tile shape, CTAs, the measurement kernel
 * (TIER_MOE_WGMMA_DEBUG, WG_DBG_*) and the TMA knob (wg_tma_wanted's values). */
struct wg_plan_t {
	int shape, ctas, dbg, tma, cl, st, idle, dyn;
	int alt; /* the default pick (wg_default_shape): the tile where shape is WG_SWAP and the product
		  * not one it runs */
};
static const char *const wg_shape_names[WG_NSHAPES] = { "128x256", "128x128", "64x256", "pp64x256", "pp128x128",
							 "swap" };

/* TIER_MOE_WGMMA_TILE, else 64 rows when a group of the mean size fits one 64-row tile, else 128 x
 * 256 (128 x 128 when N fits it). Above 64 rows the 128-row tiles win even with more padding: every
 * tile loads its 256 weight rows whatever its rows, so 64-row tiles move more weight bytes per
 * product. Measured on an H200 (tier-bench moe, seed-896: 146 rows a group on average, where the
 * padding rule this replaces took 64 rows): experts forward 3.02 ms with 128 x 256 against 3.14
 * with 64 x 256 (uniform), 2.99 against 3.42 (Zipf 1.2).
 * Except for the forward's products (W_e [N, K], gate/up; fwd 1) with N > 128 and K >= 256 (not the
 * LoRA rank products, where it was not measured) when the mean group is at most 192 rows: there
 * ping-pong 64 x 256 tiles, which pad a 146-row group to 192 rows instead of 256 and
 * store one tile while multiplying the next. seed-896 on an H200, experts forward: 2.49 and 2.61 ms
 * against 2.73 and 2.87 with 128 x 256 (uniform, two calls); Zipf 1.2 2.84 against 2.72 and 2.80
 * (the large groups of the hot experts favour 128 rows). On qwen3-30b's 1024-row groups ping-pong
 * lost (2.78-2.82 against 2.51-2.53); for the backward's W_e [K, N] products neither ping-pong
 * tile gained (experts backward on qwen3-30b 3.90-4.98 ms against 3.59-3.68, on seed-896 pp64x256
 * 3.86-3.89 against 3.77-4.13). With the TMA loads (the default) ping-pong stays for depths K >=
 * 1024 only: on seed-896 (session 9, call 2, uniform / Zipf 1.2, us) gate/up (K = H = 2048) took
 * 1,751 / 1,851 on pp64x256 against 2,008 / 1,845 on 128x256, but down (K = I = 512) 1,076 /
 * 1,069 against 1,051 / 982. Since gate/up's own TMA loads (session 24) that reversed: on an H100
 * (session 29, two calls, uniform / Zipf 1.2, us) gate/up 2,021-2,053 / 2,107-2,125 on 128x256
 * against 2,269 / 2,728 on pp64x256, gate/up alone 1,774-1,776 / 1,949-1,970 against 2,012 / 2,386
 * (session 28: 1,742 against 1,933), the experts' forward 3,108-3,117 / 3,301-3,316 against 3,217
 * / 3,916. So with TMA loads the forward takes 128x256 too; ping-pong stays for cp.async. */
static int wg_pick_shape(const char *fn, int dflt, int *shape)
{
	const char *v = getenv("TIER_MOE_WGMMA_TILE");
	if (v && *v) {
		for (int i = 0; i < WG_NSHAPES; i++)
			if (!strcmp(v, wg_shape_names[i])) {
				*shape = i;
				return 0;
			}
		return tier_fail(-EINVAL, "%s: TIER_MOE_WGMMA_TILE=%s; use 128x256, 128x128, 64x256, pp64x256, "
				 "pp128x128 or swap, or unset it", fn, v);
	}
	*shape = dflt;
	return 0;
}

/* The default tile, dflt of wg_pick_shape: the rule above. */
static int wg_default_shape(int E, int N, int K, int rows_bound, int fwd, int tma)
{
	double m = (double)rows_bound / E;
	if (m <= 64)
		return WG_64x256;
	if (fwd && !tma && m <= 192 && N > 128 && K >= 256)
		return WG_PP64x256;
	return N <= 128 ? WG_128x128 : WG_128x256;
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

/* The kinds of B maps a launch has: W_e (gate/up: gate_e, then up_e), then each extra segment TMA
 * loads. Kind k's maps are the k-th E of the launch's maps: its template t[k], pointed at each
 * expert's matrix, which the map kernel finds in a.w, a.up or the segment's device table tab[k]. */
#define WG_MAP_KINDS (2 + WG_SEGS)
struct wg_map_tmpl {
	CUtensorMap t[WG_MAP_KINDS];
	const bf16 *const *tab[WG_MAP_KINDS];
	int kinds;
};

/* One thread a map: the template copied, then its global address replaced where the expert has
 * weights (experts without rows keep the template's, never read). */
template <int MODE>
__global__ void wg_map_kernel(const __grid_constant__ wg_args<MODE> a, const __grid_constant__ wg_map_tmpl m)
{
	pdl_enter();
#ifdef WG_SM90A
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= m.kinds * a.E)
		return;
	if (i == 0 && a.sched) /* the dynamic schedule's counter, read by the kernel after this one */
		*a.sched = 0u;
	int k = i / a.E, e = i % a.E;
	const bf16 *w = k == 0 ? a.w[e] : m.tab[k] ? m.tab[k][e] : a.up[MODE == WG_GU ? e : 0];
	tmap_put((CUtensorMap *)(a.bmap + i), &m.t[k], w);
#endif
}

/* B's map template for a K x N product in the launch's layout: W_e [N, K] in BN-row boxes (gate/up
 * BN / 2: gate and up rows come in a box each), W_e [K, N] in 64 x 64 boxes. */
template <class CFG>
static int wg_b_tmpl(CUtensorMap *m, const void *w, int N, int K)
{
	if (CFG::MODE == WG_KN)
		return base_tmap_bf16(m, w, (uint64_t)K, (uint64_t)N, 64);
	/* CTA pairs load half of W_e [N, K]'s tile each */
	return base_tmap_bf16(m, w, (uint64_t)N, (uint64_t)K, CFG::MODE == WG_GU ? CFG::BN / 2 : CFG::BN / CFG::CL);
}

/* The TMA maps of a launch: x's into a.amap; an extra segment with one half (K0 or K1 0; not in
 * gate/up, whose halves go to g and u) gets its x's map in a.xmap[q] and a kind of B maps (a.smap[q]),
 * the others take cp.async (a.smap[q] = -1). B's maps go to device memory from the stream's pool
 * (*maps; the caller frees it after the launch, in stream order), written by the map kernel on the
 * stream: no host synchronisation. hseg: the segments' host tables. */
template <class CFG>
static int wg_tma_maps(tier_dev *dev, typename CFG::args &a, int rows_bound, const moe_wg_seg *hseg, void **maps)
{
	constexpr int GU = CFG::MODE == WG_GU;
	wg_map_tmpl m;
	memset(&m, 0, sizeof m);
	int rc = base_tmap_bf16(&a.amap, a.x, (uint64_t)rows_bound, (uint64_t)a.K, CFG::BM);
	if (rc || (rc = wg_b_tmpl<CFG>(&m.t[0], wg_first((const void *const *)a.w, a.E, a.x), a.N, a.K)))
		return rc;
	m.kinds = 1;
	if (GU)
		m.t[m.kinds++] = m.t[0]; /* up_e: the same shape */
	for (int q = 0; q < a.nseg; q++) {
		const moe_wg_seg *sg = &hseg[q];
		int h = sg->K0 == 0, Kq = h ? sg->K1 : sg->K0;
		a.smap[q] = -1;
		if (GU || (sg->K0 && sg->K1))
			continue;
		const void *const *hw = h ? sg->w1 : sg->w0;
		if ((rc = base_tmap_bf16(&a.xmap[q], h ? sg->x1 : sg->x0, (uint64_t)rows_bound, (uint64_t)Kq, CFG::BM)) ||
		    (rc = wg_b_tmpl<CFG>(&m.t[m.kinds], wg_first(hw, a.E, a.x), a.N, Kq)))
			return rc;
		m.tab[m.kinds] = h ? a.seg[q].w1 : a.seg[q].w0;
		a.smap[q] = m.kinds++ * a.E;
	}
	cudaStream_t st = moe_stream(dev);
	int n = m.kinds * a.E;
	/* and 16 bytes after them for the dynamic schedule's counter, which the map kernel zeroes */
	CUDA_TRY(cudaMallocAsync(maps, sizeof(CUtensorMap) * (size_t)n + 16, st));
	a.bmap = (const CUtensorMap *)*maps;
	a.sched = CFG::DYN && a.dyn ? (unsigned int *)(a.bmap + n) : NULL;
	tier_launch(wg_map_kernel<CFG::MODE>, (n + 127) / 128, 128, 0, st, a, m);
	cudaError_t e = cudaGetLastError();
	return e == cudaSuccess ? 0 : tier_fail(-EIO, "TMA maps: the map kernel did not launch: %s", cudaGetErrorString(e));
}

#ifdef TIER_WG_WATCHDOG
/* After each launch of a watchdog build: waits for the kernel, and names the wait that timed out
 * (then -EIO; the outputs are garbage). */
static int wg_watch_report(tier_dev *dev, int stages)
{
	wg_watch w;
	CUDA_TRY(cudaStreamSynchronize(moe_stream(dev)));
	CUDA_TRY(cudaMemcpyFromSymbol(&w, wg_watchdog, sizeof w));
	if (!w.hit)
		return 0;
	wg_watch zero;
	memset(&zero, 0, sizeof zero);
	CUDA_TRY(cudaMemcpyToSymbol(wg_watchdog, &zero, sizeof zero));
	/* the barrier arrays by address, highest first: the claimed tiles' ring lies past the table */
	const struct {
		const char *kind;
		uint32_t base;
	} arr[] = { { "tile-read", w.tempty }, { "tile-posted", w.tfull }, { "turn", w.turn }, { "empty", w.empty },
		    { "full", w.full } };
	size_t i = 0;
	while (i + 1 < sizeof arr / sizeof arr[0] && w.bar < arr[i].base)
		i++;
	const char *kind = arr[i].kind;
	uint32_t base = arr[i].base;
	return tier_fail(-EIO, "wgmma watchdog: block %u thread %u waited over 2 s on %s[%u] (of %d stages) for "
			 "parity %u; barrier state 0x%016llx", w.block, w.thread, kind, (w.bar - base) / 8, stages,
			 w.parity, w.state);
}
#endif

/* Kernels launched on CTA pairs (TIER_MOE_WGMMA_CLUSTER=2), with the TMA-store epilogue
 * (TIER_MOE_WGMMA_EPI=tma) and with the dynamic schedule, for the tests to see that the forms ran
 * (atomic: ranks' threads may launch at once). */
static unsigned long long wg_pair_launches, wg_st_launches, wg_dyn_launches, wg_fixed_launches;

extern "C" unsigned long long moe_cuda_wgmma_pair_launches(void)
{
	return __atomic_load_n(&wg_pair_launches, __ATOMIC_RELAXED);
}

extern "C" unsigned long long moe_cuda_wgmma_tma_store_launches(void)
{
	return __atomic_load_n(&wg_st_launches, __ATOMIC_RELAXED);
}

/* ... and those that claimed their tiles from a counter (TIER_MOE_WGMMA_SCHED=dynamic) */
extern "C" unsigned long long moe_cuda_wgmma_dynamic_launches(void)
{
	return __atomic_load_n(&wg_dyn_launches, __ATOMIC_RELAXED);
}

/* ... and those of the dynamic schedule's kernels that took the fixed order (SCHED=static, or the
 * unset default's pick for groups of more than 192 rows on average) */
extern "C" unsigned long long moe_cuda_wgmma_fixed_launches(void)
{
	return __atomic_load_n(&wg_fixed_launches, __ATOMIC_RELAXED);
}

/* The TMA stores' maps (CFG::ST): gate/up's g, u and h, or the bf16 C, rows_bound x N each. */
template <class CFG>
static int wg_store_maps(typename CFG::args &a, int rows_bound)
{
	memset(a.omap, 0, sizeof a.omap);
	if constexpr (CFG::ST) {
		void *out[3] = { a.c, a.u, a.h };
		for (int i = 0; i < (CFG::MODE == WG_GU ? 3 : 1); i++) {
			int rc = base_tmap_bf16_store(&a.omap[i], out[i], (uint64_t)rows_bound, (uint64_t)a.N);
			if (rc)
				return rc;
		}
	}
	return 0;
}

/* The launch attribute of clusters of cl CTAs along x. */
static cudaLaunchAttribute wg_cluster_attr(int cl)
{
	cudaLaunchAttribute at;
	memset(&at, 0, sizeof at);
	at.id = cudaLaunchAttributeClusterDimension;
	at.val.clusterDim.x = (unsigned)cl, at.val.clusterDim.y = 1, at.val.clusterDim.z = 1;
	return at;
}

/* The kernel on grid CTAs, in clusters of cl (1: none), with tier_launch's dependent launch. */
template <typename KERN, typename ARGS>
static cudaError_t wg_start(KERN kernel, int grid, int cl, size_t smem, cudaStream_t st, const ARGS &a)
{
	if (cl == 1)
		return tier_launch(kernel, grid, WG_THREADS, smem, st, a);
	cudaLaunchAttribute at[2];
	memset(at, 0, sizeof at);
	at[0] = wg_cluster_attr(cl);
	at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[1].val.programmaticStreamSerializationAllowed = tier_pdl_on();
	cudaLaunchConfig_t cfg;
	memset(&cfg, 0, sizeof cfg);
	cfg.gridDim = dim3((unsigned)grid), cfg.blockDim = dim3(WG_THREADS), cfg.dynamicSmemBytes = smem, cfg.stream = st;
	cfg.attrs = at, cfg.numAttrs = 2;
	return cudaLaunchKernelEx(&cfg, kernel, a);
}

/* The clusters of cl CTAs that fit device ord at once with the kernel's shared memory (asked once a
 * kernel and device): a persistent grid of more would run its last clusters after the others. */
#define WG_MAX_DEVICES 64
template <typename KERN>
static int wg_max_clusters(KERN kernel, int ord, int cl, size_t smem, int *n)
{
	static int fits[WG_MAX_DEVICES];
	int unknown = 0, *known = ord >= 0 && ord < WG_MAX_DEVICES ? &fits[ord] : &unknown;
	if (!*known) {
		cudaLaunchAttribute at = wg_cluster_attr(cl);
		cudaLaunchConfig_t cfg;
		memset(&cfg, 0, sizeof cfg);
		cfg.gridDim = dim3((unsigned)cl), cfg.blockDim = dim3(WG_THREADS), cfg.dynamicSmemBytes = smem;
		cfg.attrs = &at, cfg.numAttrs = 1;
		int c = 0;
		CUDA_TRY(cudaOccupancyMaxActiveClusters(&c, kernel, &cfg));
		if (c < 1)
			return tier_fail(-EIO, "wgmma grouped GEMM: no cluster of %d CTAs with %zu bytes of shared memory fits "
					 "this GPU; unset TIER_MOE_WGMMA_CLUSTER", cl, smem);
		*known = c;
	}
	*n = *known;
	return 0;
}

template <int BM, int BN, int MODE, int PP, typename OUT, int DBG = WG_DBG_NONE, int TMA = 0, int CL = 1, int ST = 0>
static int wg_launch(tier_dev *dev, wg_args<MODE> &a, int rows_bound, int ctas, const moe_wg_seg *hseg)
{
	typedef wg_cfg<BM, BN, MODE, PP, DBG, wg_stg<MODE, OUT>::v, TMA, CL, ST> CFG;
	auto kernel = wg_kernel<BM, BN, MODE, PP, OUT, DBG, TMA, CL, ST>;
	int rc0 = wg_store_maps<CFG>(a, rows_bound);
	if (rc0)
		return rc0;
	/* sum_e ceil(n_e / TM) <= (rows + (TM - 1) (non-empty experts)) / TM for the tiles' TM = CL BM
	 * rows, and at most min(E, rows_bound) experts have rows */
	constexpr int TM = BM * CL;
	long long busy = a.E < rows_bound ? a.E : rows_bound;
	long long ny = ((long long)rows_bound + (long long)(TM - 1) * busy) / TM;
	long long tiles = ny * ((a.N + CFG::OBN - 1) / CFG::OBN);
	a.rt_bound = ny < INT_MAX ? (int)ny : INT_MAX;
	cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)CFG::BYTES);
	if (e != cudaSuccess)
		return tier_fail(-EIO, "wgmma grouped GEMM: %s", cudaGetErrorString(e));
	int units = ctas / CL; /* CTAs, or pairs of them */
	if (CL > 1) {
		int fit, rc = wg_max_clusters(kernel, tier_dev_ordinal(dev), CL, CFG::BYTES, &fit);
		if (rc)
			return rc;
		units = units < 1 ? 1 : units < fit ? units : fit;
	}
	int grid = CL * (tiles < units ? (int)tiles : units);
	void *maps = NULL;
	if constexpr (TMA) {
		int rc = wg_tma_maps<CFG>(dev, a, rows_bound, hseg, &maps);
		if (rc) {
			if (maps)
				(void)cudaFreeAsync(maps, moe_stream(dev));
			return rc;
		}
	}
	/* idle consumers by default only where the tiles are claimed in turn: in the fixed order an idling
	 * tile lets its CTA run ahead of the others that read its expert's weights (session 31). Resolved
	 * in place, as sched is: wg_dispatch sets both from the plan before every launch. */
	if (a.idle == WG_IDLE_DYN)
		a.idle = a.sched != NULL;
	wg_start(kernel, grid, CL, CFG::BYTES, moe_stream(dev), a);
	e = cudaGetLastError();
	if (e == cudaSuccess && CL > 1)
		__atomic_fetch_add(&wg_pair_launches, 1ull, __ATOMIC_RELAXED);
	if (e == cudaSuccess && ST)
		__atomic_fetch_add(&wg_st_launches, 1ull, __ATOMIC_RELAXED);
	if (e == cudaSuccess && a.sched)
		__atomic_fetch_add(&wg_dyn_launches, 1ull, __ATOMIC_RELAXED);
	if (e == cudaSuccess && CFG::DYN && !a.sched)
		__atomic_fetch_add(&wg_fixed_launches, 1ull, __ATOMIC_RELAXED);
	if (maps) /* in stream order: after the kernel, or at once when it did not launch */
		(void)cudaFreeAsync(maps, moe_stream(dev));
	if (e != cudaSuccess)
		return tier_fail(-EIO, "wgmma grouped GEMM: %s", cudaGetErrorString(e));
#ifdef TIER_WG_WATCHDOG
	return wg_watch_report(dev, CFG::STAGES);
#else
	return 0;
#endif
}

/* TIER_MOE_WGMMA_DEBUG=nostore|nomma|noload, else WG_DBG_NONE; -1 for a malformed value. It takes the
 * forward's products (W_e [N, K] and gate/up) to the 128x256 tiles, or pp128x128 where that tile is
 * asked for; W_e [K, N] runs as usual. */
static int wg_debug(void)
{
	static const char *const names[WG_NDBG] = { "", "nostore", "nomma", "noload" };
	const char *v = getenv("TIER_MOE_WGMMA_DEBUG");
	if (!v || !*v)
		return WG_DBG_NONE;
	for (int i = 1; i < WG_NDBG; i++)
		if (!strcmp(v, names[i]))
			return i;
	return -1;
}

/* TIER_MOE_WGMMA_TMA: unset, empty or all (3, the default since session 24) the TMA loads wherever
 * they apply, gate/up with a segment included; 1 the same but gate/up with a segment on cp.async
 * (the default before: that form hung in session 9, before its fix of the producers' named
 * barrier, and has passed every test since); require as 1, and -EINVAL where it takes cp.async
 * (for tests: no silent fallback); 0 cp.async everywhere; -1 for anything else. */
static int wg_tma_wanted(void)
{
	const char *v = getenv("TIER_MOE_WGMMA_TMA");
	return !v || !*v ? 3
	       : !strcmp(v, "1")	    ? 1
	       : !strcmp(v, "0")	    ? 0
	       : !strcmp(v, "require")      ? 2
	       : !strcmp(v, "all")	    ? 3
					    : -1;
}

/* The kernel of each tile shape, with cp.async (TMA 0) or TMA loads (gate/up's cooperative 64x256
 * never takes TMA: its two consumers would split g from u; the caller does not ask for it). */
template <int MODE, typename OUT, int TMA>
static int wg_by_shape(tier_dev *dev, wg_args<MODE> &a, int shape, int rows_bound, int ctas, int cl, int st,
		       const moe_wg_seg *hseg)
{
	/* the TMA-store epilogue (TIER_MOE_WGMMA_EPI=tma) where it applies: bf16 outputs but dh's
	 * SwiGLU backward, one CTA a tile */
	constexpr bool st_fits = TMA && (MODE == WG_GU || (sizeof(OUT) == 2 && !wg_is_swb<OUT>::v));
	if constexpr (st_fits) {
		if (st && cl == 1 && shape == WG_128x128)
			return wg_launch<128, 128, MODE, 0, OUT, WG_DBG_NONE, 1, 1, 1>(dev, a, rows_bound, ctas, hseg);
		if (st && cl == 1 && shape == WG_128x256)
			return wg_launch<128, 256, MODE, 0, OUT, WG_DBG_NONE, 1, 1, 1>(dev, a, rows_bound, ctas, hseg);
	}
	if constexpr (TMA) { /* CTA pairs (TIER_MOE_WGMMA_CLUSTER=2) where they apply */
		if (cl == 2 && shape == WG_128x128)
			return wg_launch<128, 128, MODE, 0, OUT, WG_DBG_NONE, 1, 2>(dev, a, rows_bound, ctas, hseg);
		if (cl == 2 && shape == WG_128x256)
			return wg_launch<128, 256, MODE, 0, OUT, WG_DBG_NONE, 1, 2>(dev, a, rows_bound, ctas, hseg);
	}
	switch (shape) {
	case WG_128x128:
		return wg_launch<128, 128, MODE, 0, OUT, WG_DBG_NONE, TMA>(dev, a, rows_bound, ctas, hseg);
	case WG_64x256:
		return wg_launch<64, 256, MODE, 0, OUT, WG_DBG_NONE, MODE == WG_GU ? 0 : TMA>(dev, a, rows_bound, ctas, hseg);
	case WG_PP64x256:
		return wg_launch<64, 256, MODE, 1, OUT, WG_DBG_NONE, TMA>(dev, a, rows_bound, ctas, hseg);
	case WG_PP128x128:
		return wg_launch<128, 128, MODE, 1, OUT, WG_DBG_NONE, TMA>(dev, a, rows_bound, ctas, hseg);
	default:
		return wg_launch<128, 256, MODE, 0, OUT, WG_DBG_NONE, TMA>(dev, a, rows_bound, ctas, hseg);
	}
}

/* The measurement kernel dbg (not WG_DBG_NONE) of one tile, with cp.async (TMA 0) or TMA loads. */
template <int BM, int BN, int MODE, int PP, typename OUT, int TMA = 0>
static int wg_launch_dbg(tier_dev *dev, wg_args<MODE> &a, int rows_bound, int ctas, int dbg)
{
	if (dbg == WG_DBG_NOSTORE)
		return wg_launch<BM, BN, MODE, PP, OUT, WG_DBG_NOSTORE, TMA>(dev, a, rows_bound, ctas, NULL);
	if (dbg == WG_DBG_NOMMA)
		return wg_launch<BM, BN, MODE, PP, OUT, WG_DBG_NOMMA, TMA>(dev, a, rows_bound, ctas, NULL);
	return wg_launch<BM, BN, MODE, PP, OUT, WG_DBG_NOLOAD, TMA>(dev, a, rows_bound, ctas, NULL);
}

/* hseg: the extra segments' host tables (a.nseg of them). */
template <int MODE, typename OUT>
static int wg_dispatch(tier_dev *dev, wg_args<MODE> &a, const wg_plan_t &pl, int rows_bound, const moe_wg_seg *hseg)
{
	/* the swapped operands run only the plain forward product (moe_cuda_grouped_mm_sm90_segs) */
	int shape = pl.shape == WG_SWAP ? pl.alt : pl.shape, ctas = pl.ctas, dbg = pl.dbg, tma = pl.tma;
	a.idle = pl.idle;
	a.dyn = pl.dyn, a.sched = NULL; /* the counter where the kernel takes it (wg_tma_maps) */
	/* gate/up with a segment takes TMA only under tma 3 (all, the default): its TMA form hung in
	 * session 9 before the producers' named barrier moved off the consumers' staging barrier, and
	 * passed test_moe_wgmma, test_moe_cuda and the trainer in sessions 10 and 24 (bench/RESULTS.md);
	 * test_moe_wgmma runs both forms */
	int tma_fits = !dbg && !(MODE == WG_GU && (shape == WG_64x256 || (a.nseg && tma != 3))) && base_tmap_ok();
	if (tma == 2 && !tma_fits)
		return tier_fail(-EINVAL, "TIER_MOE_WGMMA_TMA=require: this product takes cp.async "
				 "(TIER_MOE_WGMMA_DEBUG, gate/up's 64x256 tiles or segments, or a driver without "
				 "cuTensorMapEncodeTiled); use 1");
	if constexpr (MODE != WG_KN) {
		/* the 128x256 measurement kernels load as the products do (TMA unless TIER_MOE_WGMMA_TMA=0) */
		if (dbg && shape == WG_PP128x128)
			return wg_launch_dbg<128, 128, MODE, 1, OUT>(dev, a, rows_bound, ctas, dbg);
		if (dbg && tma && !a.nseg && base_tmap_ok())
			return wg_launch_dbg<128, 256, MODE, 0, OUT, 1>(dev, a, rows_bound, ctas, dbg);
		if (dbg)
			return wg_launch_dbg<128, 256, MODE, 0, OUT>(dev, a, rows_bound, ctas, dbg);
	}
	if (tma && tma_fits)
		return wg_by_shape<MODE, OUT, 1>(dev, a, shape, rows_bound, ctas, pl.cl, pl.st, hseg);
	return wg_by_shape<MODE, OUT, 0>(dev, a, shape, rows_bound, ctas, 1, 0, hseg);
}

/* The checks both entry points share: the device, E, the output columns N and the depth K (named
 * nn and kn in the messages), rows_bound and the offsets. */
static int wg_check_dims(const char *fn, tier_dev *dev, int E, const char *nn, int N, const char *kn, int K,
			 int rows_bound, const int32_t *d_off)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, nn, N)) || (rc = moe_check_dim(fn, kn, K)))
		return rc;
	if (N % 8 || K % 8)
		return tier_fail(-EINVAL, "%s: %s = %d and %s = %d must be multiples of 8 (16-byte copies); use the "
				 "per-expert cuBLASLt products (moe_cuda_mm) for other shapes", fn, nn, N, kn, K);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	MOE_NONNULL(d_off, fn);
	return 0;
}

/* A form's knob: off 0, on 1 (*v), unset or empty dflt (whose meaning dwhat gives); else -EINVAL
 * naming both values and the default. */
static int wg_switch(const char *fn, const char *knob, const char *off, const char *on, const char *what, int dflt,
		     const char *dwhat, int *v)
{
	const char *s = getenv(knob);
	*v = !s || !*s ? dflt : !strcmp(s, off) ? 0 : !strcmp(s, on) ? 1 : -1;
	if (*v < 0)
		return tier_fail(-EINVAL, "%s: %s=%s; use %s %s or %s, or unset it for the default (%s)", fn, knob, s, on,
				 what, off, dwhat);
	return 0;
}

/* The tile shape and the CTA count, after the device check; the debug knob checked. */
static int wg_plan(const char *fn, tier_dev *dev, int E, int bn_cols, int K, int rows_bound, int fwd, wg_plan_t *pl)
{
	if ((pl->dbg = wg_debug()) < 0)
		return tier_fail(-EINVAL, "%s: TIER_MOE_WGMMA_DEBUG=%s; use nostore, nomma or noload, or unset it", fn,
				 getenv("TIER_MOE_WGMMA_DEBUG"));
	if ((pl->tma = wg_tma_wanted()) < 0)
		return tier_fail(-EINVAL, "%s: TIER_MOE_WGMMA_TMA=%s; use all (the default), 1, 0 or require, or unset it", fn,
				 getenv("TIER_MOE_WGMMA_TMA"));
	int rc;
	if ((rc = wg_switch(fn, "TIER_MOE_WGMMA_CLUSTER", "1", "2", "(CTA pairs)", 0, "1", &pl->cl)) ||
	    (rc = wg_switch(fn, "TIER_MOE_WGMMA_EPI", "copy", "tma", "(TMA stores)", 0, "copy", &pl->st)) ||
	    (rc = wg_switch(fn, "TIER_MOE_WGMMA_IDLE", "0", "1", "(consumers without rows skip their products)",
			    WG_IDLE_DYN, "1 where the tiles are claimed from a counter, else 0", &pl->idle)) ||
	    (rc = wg_switch(fn, "TIER_MOE_WGMMA_SCHED", "static", "dynamic", "(tiles claimed from a counter)",
			    WG_SCHED_AUTO, "dynamic where the mean group is at most 192 rows, else static", &pl->dyn)))
		return rc;
	/* The dynamic schedule pays where 128-row tiles pad the groups most: on seed-896 (146 rows a
	 * group) the block's forward+backward took 0.87x (uniform) and 0.94x (Zipf 1.2) the fixed
	 * order's time; on qwen3-30b's 1024-row groups 1.00 and 0.98; the trainer's (a) (qwen3-30b
	 * at batch 3: 768 rows a group) ran 0.99x as many tokens/s (session 34, H100). */
	if (pl->dyn == WG_SCHED_AUTO)
		pl->dyn = (double)rows_bound / E <= 192;
	pl->cl += 1; /* CTAs a cluster */
	int sms;
	pl->alt = wg_default_shape(E, bn_cols, K, rows_bound, fwd, pl->tma > 0);
	rc = wg_pick_shape(fn, pl->alt, &pl->shape);
	if (rc || (rc = wg_device(dev, fn, &sms)) || (rc = wg_pick_ctas(fn, sms, &pl->ctas)))
		return rc;
	return 0;
}

extern "C" int moe_cuda_wgmma_on(tier_dev *dev)
{
	const char *v = getenv("TIER_MOE_WGMMA");
	return !(v && !strcmp(v, "0")) && moe_cuda_wgmma_supported(dev);
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

/* The extra segments: at most WG_SEGS, K0 and K1 multiples of 8 (one of them may be 0), their
 * operands aligned, and the table space when there are any. */
static int wg_check_segs(const char *fn, int E, int nseg, const moe_wg_seg *seg, void *tab)
{
	if (nseg < 0 || nseg > WG_SEGS || (nseg && !seg))
		return tier_fail(-EINVAL, "%s: %d extra segments; pass 0..%d of them", fn, nseg, WG_SEGS);
	if (nseg && (!tab || (uintptr_t)tab % 16))
		return tier_fail(-EINVAL, "%s: the table space is NULL or not 16-byte aligned; pass MOE_WG_TAB_BYTES of "
				 "device memory", fn);
	for (int q = 0; q < nseg; q++) {
		const moe_wg_seg *sg = &seg[q];
		int rc;
		if (sg->K0 < 0 || sg->K1 < 0 || sg->K0 % 8 || sg->K1 % 8 || sg->K0 + sg->K1 == 0 ||
		    sg->K0 > INT_MAX / 2 || sg->K1 > INT_MAX / 2)
			return tier_fail(-EINVAL, "%s: segment %d has K0 = %d, K1 = %d; they must be multiples of 8, not "
					 "both 0", fn, q, sg->K0, sg->K1);
		if (sg->K0 && ((rc = moe_check_buf16(fn, "x0", sg->x0)) || (rc = moe_check_table16(fn, "w0", E, sg->w0))))
			return rc;
		if (sg->K1 && ((rc = moe_check_buf16(fn, "x1", sg->x1)) || (rc = moe_check_table16(fn, "w1", E, sg->w1))))
			return rc;
	}
	return 0;
}

/* Up to three tables of E pointers to device memory in one launch. */
#define WG_TAB_PER_LAUNCH 3
struct wg_tab_args {
	const void *p[WG_TAB_PER_LAUNCH][TIER_MOE_MAX_EXPERTS];
	const void **dst[WG_TAB_PER_LAUNCH];
	int n, E;
};

__global__ void wg_tab_kernel(const __grid_constant__ wg_tab_args a)
{
	pdl_enter();
	for (int i = threadIdx.x; i < a.n * a.E; i += blockDim.x)
		a.dst[i / a.E][i % a.E] = a.p[i / a.E][i % a.E];
}

/* The segments' weight tables copied into tab (table i at tab + i E, in stream order: a later call
 * reusing tab writes after this launch's kernel read it) and their device form in sd. */
static int wg_put_tables(tier_dev *dev, int E, int nseg, const moe_wg_seg *seg, void *tab, wg_seg_dev *sd)
{
	const void **dt = (const void **)tab;
	wg_tab_args ta;
	memset(&ta, 0, sizeof ta);
	ta.E = E;
	int used = 0;
	for (int q = 0; q < nseg; q++) {
		const moe_wg_seg *sg = &seg[q];
		sd[q].x0 = (const bf16 *)sg->x0, sd[q].x1 = (const bf16 *)sg->x1, sd[q].K0 = sg->K0, sd[q].K1 = sg->K1;
		sd[q].w0 = sd[q].w1 = NULL;
		for (int h = 0; h < 2; h++) {
			const void *const *w = h ? sg->w1 : sg->w0;
			if (!(h ? sg->K1 : sg->K0))
				continue;
			const void **d = dt + (size_t)used++ * E;
			*(h ? &sd[q].w1 : &sd[q].w0) = (const bf16 *const *)d;
			for (int e = 0; e < E; e++)
				ta.p[ta.n][e] = w[e];
			ta.dst[ta.n++] = d;
			if (ta.n == WG_TAB_PER_LAUNCH) {
				tier_launch(wg_tab_kernel, 1, 256, 0, moe_stream(dev), ta);
				CUDA_LAUNCHED();
				ta.n = 0;
			}
		}
	}
	if (ta.n) {
		tier_launch(wg_tab_kernel, 1, 256, 0, moe_stream(dev), ta);
		CUDA_LAUNCHED();
	}
	return 0;
}

/* The TMA maps' fields before wg_tma_maps writes them (the cp.async kernels never read them). */
template <int MODE>
static void wg_no_maps(wg_args<MODE> &a)
{
	memset(&a.amap, 0, sizeof a.amap);
	memset(a.xmap, 0, sizeof a.xmap);
	for (int q = 0; q < WG_SEGS; q++)
		a.smap[q] = -1;
}

/* The fields every product sets alike: W_e (gate/up: gate_e; up_e is the caller's), the operands,
 * the extra segments' device form, no maps yet (wg_tma_maps writes them) and no SwiGLU epilogue. */
template <int MODE>
static void wg_args_base(wg_args<MODE> &a, int E, int N, int K, const void *const *w, const int32_t *d_off,
			 const void *x, void *c, float alpha, int beta, int nseg, const wg_seg_dev *seg)
{
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++)
		a.w[e] = e < E ? (const bf16 *)w[e] : NULL;
	a.up[0] = NULL;
	wg_no_maps(a);
	a.off = d_off, a.x = (const bf16 *)x, a.c = c, a.u = NULL, a.h = NULL, a.alpha = alpha, a.bmap = NULL;
	a.E = E, a.N = N, a.K = K, a.beta = beta, a.rt_bound = 0, a.nseg = nseg;
	for (int q = 0; q < nseg; q++)
		a.seg[q] = seg[q];
	a.sg = a.su = NULL, a.sdg = a.sdu = NULL, a.sdot = NULL, a.parts = 0;
}

/* The product in W_e's layout MODE (WG_NK or WG_KN), its arguments checked. */
template <int MODE>
static int wg_mm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound, const void *const *w,
		 const void *x, int nseg, const wg_seg_dev *seg, const moe_wg_seg *hseg, void *c, int c_bf16, float alpha,
		 float beta, const wg_plan_t &pl)
{
	wg_args<MODE> a; /* 8 KiB */
	wg_args_base(a, E, N, K, w, d_off, x, c, alpha, beta != 0.0f, nseg, seg);
	if (c_bf16)
		return wg_dispatch<MODE, bf16>(dev, a, pl, rows_bound, hseg);
	return wg_dispatch<MODE, float>(dev, a, pl, rows_bound, hseg);
}

extern "C" int moe_cuda_grouped_mm_sm90(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
					const void *const *w, int w_kn, const void *x, void *c, int c_bf16, float alpha,
					float beta)
{
	return moe_cuda_grouped_mm_sm90_segs(dev, E, N, K, d_off, rows_bound, w, w_kn, x, 0, NULL, NULL, c, c_bf16, alpha,
					     beta);
}

extern "C" int moe_cuda_grouped_mm_sm90_segs(tier_dev *dev, int E, int N, int K, const int32_t *d_off,
					     int rows_bound, const void *const *w, int w_kn, const void *x, int nseg,
					     const moe_wg_seg *seg, void *tab, void *c, int c_bf16, float alpha, float beta)
{
	const char *fn = nseg ? "moe_cuda_grouped_mm_sm90_segs" : "moe_cuda_grouped_mm_sm90";
	wg_seg_dev sd[WG_SEGS];
	wg_plan_t pl;
	int rc = wg_check_dims(fn, dev, E, "N", N, "K", K, rows_bound, d_off);
	if (rc)
		return rc;
	if (w_kn != 0 && w_kn != 1)
		return tier_fail(-EINVAL, "%s: w_kn = %d; it must be 0 (W_e [N, K]) or 1 (W_e [K, N])", fn, w_kn);
	if (c_bf16 != 0 && c_bf16 != 1)
		return tier_fail(-EINVAL, "%s: c_bf16 = %d; it must be 0 (fp32 C) or 1 (bf16 C)", fn, c_bf16);
	if (beta != 0.0f && beta != 1.0f)
		return tier_fail(-EINVAL, "%s: beta = %g; it must be 0 (write C) or 1 (add to C)", fn, (double)beta);
	if ((rc = moe_check_table16(fn, "w", E, w)) || (rc = moe_check_buf16(fn, "x", x)) ||
	    (rc = moe_check_buf16(fn, "c", c)) || (rc = wg_check_segs(fn, E, nseg, seg, tab)) || (rc = wg_plan(fn, dev, E, N, K, rows_bound, !w_kn, &pl)))
		return rc;
	if (rows_bound == 0)
		return 0;
	/* TIER_MOE_WGMMA_TILE=swap: the plain forward product with the operands swapped, on TMA loads */
	if (pl.shape == WG_SWAP && !w_kn && !nseg && !pl.dbg && pl.tma && base_tmap_ok())
		return moe_wg_swap_mm(dev, E, N, K, d_off, rows_bound, w, x, c, c_bf16, alpha, beta, pl.ctas);
	if ((rc = wg_put_tables(dev, E, nseg, seg, tab, sd)))
		return rc;
	if (w_kn)
		return wg_mm<WG_KN>(dev, E, N, K, d_off, rows_bound, w, x, nseg, sd, seg, c, c_bf16, alpha, beta, pl);
	return wg_mm<WG_NK>(dev, E, N, K, d_off, rows_bound, w, x, nseg, sd, seg, c, c_bf16, alpha, beta, pl);
}

/* row_dot[r] = the sum of row r's dot slots in slot order (moe_cuda_grouped_dh_swiglu_sm90), for
 * the rows of the groups: below *end (offsets[E]) and rows_bound; the rest untouched. */
__global__ void wg_dot_sum_kernel(int rows_bound, const int32_t *end, int parts, const float *part, float *row_dot)
{
	pdl_enter();
	int rows = min(rows_bound, *end);
	for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
		float v = 0.0f;
		for (int j = 0; j < parts; j++)
			v += part[(size_t)r * parts + j];
		row_dot[r] = v;
	}
}

extern "C" int moe_cuda_grouped_dh_swiglu_sm90(tier_dev *dev, int E, int I, int H, const int32_t *d_off,
					       int rows_bound, const void *const *down, const void *dy, int nseg,
					       const moe_wg_seg *seg, void *tab, const void *g, const void *u, void *dg,
					       void *du, float *row_dot, float *dot_scratch)
{
	const char *fn = "moe_cuda_grouped_dh_swiglu_sm90";
	wg_seg_dev sd[WG_SEGS];
	wg_plan_t pl;
	int rc = wg_check_dims(fn, dev, E, "I", I, "H", H, rows_bound, d_off);
	if (rc || (rc = moe_check_table16(fn, "down", E, down)) || (rc = moe_check_buf16(fn, "dy", dy)) ||
	    (rc = moe_check_buf16(fn, "g", g)) || (rc = moe_check_buf16(fn, "u", u)) || (rc = moe_check_buf16(fn, "dg", dg)) ||
	    (rc = moe_check_buf16(fn, "du", du)) || (rc = wg_check_segs(fn, E, nseg, seg, tab)))
		return rc;
	MOE_NONNULL(row_dot, fn);
	MOE_NONNULL(dot_scratch, fn);
	if ((rc = wg_plan(fn, dev, E, I, H, rows_bound, 0, &pl)))
		return rc;
	if (rows_bound == 0)
		return 0;
	if ((rc = wg_put_tables(dev, E, nseg, seg, tab, sd)))
		return rc;
	wg_args<WG_KN> a; /* 8 KiB */
	wg_args_base(a, E, I, H, down, d_off, dy, NULL, 1.0f, 0, nseg, sd);
	a.sg = (const bf16 *)g, a.su = (const bf16 *)u, a.sdg = (bf16 *)dg, a.sdu = (bf16 *)du, a.sdot = dot_scratch;
	a.parts = (I + WG_SWB_SLOT - 1) / WG_SWB_SLOT;
	if ((rc = wg_dispatch<WG_KN, wg_swb>(dev, a, pl, rows_bound, seg)))
		return rc;
	int blocks = (rows_bound + 255) / 256;
	tier_launch(wg_dot_sum_kernel, blocks < 1024 ? blocks : 1024, 256, 0, moe_stream(dev), rows_bound, d_off + E,
		    a.parts, (const float *)dot_scratch, row_dot);
	cudaError_t e = cudaGetLastError();
	return e == cudaSuccess ? 0 : tier_fail(-EIO, "%s: the dot sum: %s", fn, cudaGetErrorString(e));
}

extern "C" int moe_cuda_grouped_gate_up_sm90(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
					     const void *const *gate, const void *const *up, const void *x, void *g,
					     void *u, void *h)
{
	return moe_cuda_grouped_gate_up_sm90_lora(dev, E, H, I, d_off, rows_bound, gate, up, x, NULL, NULL, g, u, h);
}

extern "C" int moe_cuda_grouped_gate_up_sm90_lora(tier_dev *dev, int E, int H, int I, const int32_t *d_off,
						  int rows_bound, const void *const *gate, const void *const *up,
						  const void *x, const moe_wg_seg *lora, void *tab, void *g, void *u,
						  void *h)
{
	const char *fn = lora ? "moe_cuda_grouped_gate_up_sm90_lora" : "moe_cuda_grouped_gate_up_sm90";
	wg_seg_dev sd[WG_SEGS];
	int nseg = lora != NULL;
	wg_plan_t pl;
	int rc = wg_check_dims(fn, dev, E, "I", I, "H", H, rows_bound, d_off);
	if (rc || (rc = moe_check_table16(fn, "gate", E, gate)) || (rc = moe_check_table16(fn, "up", E, up)) ||
	    (rc = moe_check_buf16(fn, "x", x)) || (rc = moe_check_buf16(fn, "g", g)) || (rc = moe_check_buf16(fn, "u", u)) ||
	    (rc = moe_check_buf16(fn, "h", h)) || (rc = wg_check_segs(fn, E, nseg, lora, tab)))
		return rc;
	/* the tile reads 2 I rows of B: pick its shape as for N = 2 I */
	if ((rc = wg_plan(fn, dev, E, 2 * I, H, rows_bound, 1, &pl)))
		return rc;
	if (rows_bound == 0)
		return 0;
	if (nseg && (rc = wg_put_tables(dev, E, nseg, lora, tab, sd)))
		return rc;
	wg_args<WG_GU> a; /* 16 KiB */
	wg_args_base(a, E, I, H, gate, d_off, x, g, 1.0f, 0, nseg, sd);
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++)
		a.up[e] = e < E ? (const bf16 *)up[e] : NULL;
	a.u = (bf16 *)u, a.h = (bf16 *)h;
	return wg_dispatch<WG_GU, bf16>(dev, a, pl, rows_bound, lora);
}
