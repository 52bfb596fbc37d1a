/* moe_wgmma_store.cuh - the wgmma grouped GEMMs' epilogues (moe_wgmma.cu): the accumulator to C
 * (directly from the registers or through the consumers' shared staging), and to g, u and h
 * (through the staging). */
#ifndef TIER_MOE_WGMMA_STORE_CUH
#define TIER_MOE_WGMMA_STORE_CUH

#include "moe/moe_wgmma_ptx.cuh"
#include "moe/moe_swiglu.cuh"

#ifdef WG_SM90A
/* The m64nNk16 f32 accumulator: thread (warp w, lane l) of the warpgroup holds rows 16 w + l / 4
 * (h = 0) and 8 below (h = 1), columns 8 i + 2 (l % 4) + b (b = 0, 1) in d[4 i + 2 h + b]. With beta
 * every old value of a row is read before the first store: a load after a store to the same type
 * would wait for it. beta 0 never reads C (it may hold anything, NaN included). */
template <class CFG, typename OUT>
__device__ static void wg_store(float (&d)[CFG::WN / 2], const typename CFG::args &a, const wg_tile &tl, int roff,
				int coff, int warp, int lane)
{
	OUT *C = (OUT *)a.c;
	int r = tl.row0 + roff + 16 * warp + (lane >> 2);
	int c0 = tl.col0 + coff + 2 * (lane & 3);
#pragma unroll
	for (int h = 0; h < 2; h++) {
		if (r + 8 * h >= tl.rend)
			continue;
		OUT *row = C + (size_t)(r + 8 * h) * a.N + c0;
		int ncols = a.N - c0; /* column c0 + 8 i is in when 8 i < ncols; even, so its pair is too */
#pragma unroll
		for (int i = 0; i < CFG::WN / 8; i++) {
			float2 o = a.beta && 8 * i < ncols ? moe_get2(row + 8 * i) : make_float2(0.0f, 0.0f);
			d[4 * i + 2 * h] = a.alpha * d[4 * i + 2 * h] + o.x;
			d[4 * i + 2 * h + 1] = a.alpha * d[4 * i + 2 * h + 1] + o.y;
		}
#pragma unroll
		for (int i = 0; i < CFG::WN / 8; i++)
			if (8 * i < ncols)
				moe_set2(row + 8 * i, d[4 * i + 2 * h], d[4 * i + 2 * h + 1]);
	}
}

/* ---- the staged epilogue (bf16 outputs, beta 0) ----
 * Writing a bf16 accumulator straight from its registers stores 4 bytes a thread into 8 rows at
 * once, 16 bytes of each row: half-sector transactions. Instead each consumer puts 128 bytes of every
 * row of its 64-row block into its staging (WG_OUT_ROW = 144 bytes apart, 36 words: a warp's 8 rows
 * of 4-byte pairs land on 32 different banks), then its 128 threads copy the 64 rows out in 16-byte
 * pieces, 8 threads to a row: whole 128-byte lines. On the H200 the direct stores took ~0.3 ms of the
 * 1.13 ms down product on qwen3-30b's shape (TIER_MOE_WGMMA_DEBUG=nomma against the loads alone),
 * and the staged product ran 0.90 ms. */
__device__ __forceinline__ void wg_wg_sync(int g) /* consumer g's 128 threads (0 is the CTA's barrier, 3 the producers') */
{
	if (g) /* immediates: a register id makes ptxas reserve all 16 barriers */
		asm volatile("bar.sync 2, 128;\n" ::: "memory");
	else
		asm volatile("bar.sync 1, 128;\n" ::: "memory");
}


/* A build flag (NVCCFLAGS=-DTIER_WG_SERIAL_COPY=1) copies the staging out one 16-byte piece at a
 * time. Since g and u are staged too, ptxas spills 12-28 bytes in the gate/up kernels (all 128
 * accumulators live beside the copy's four pieces); serial, they do not spill. Which is faster was
 * not yet timed: .device's next session script runs tier-bench moe built both ways. */
#ifndef TIER_WG_SERIAL_COPY
#define TIER_WG_SERIAL_COPY 0
#endif
constexpr int wg_copy_unroll = TIER_WG_SERIAL_COPY ? 1 : 4; /* #pragma unroll expands no macros */

/* Output columns [c, c + 128 / sizeof(T)) of a 64-row block through the staging: VAL(q, h, b) is
 * the thread's value at row 16 warp + lane / 4 + 8 h, column 8 q + 2 (lane % 4) + b of the block
 * (q counted from the block's first column, c / 8 + 0..). Rows from rend and columns from N are not
 * written. out + row0 N + col0 is the block's first element. */
template <typename T, int C0, class VAL>
__device__ __forceinline__ void wg_put_chunk(unsigned char *stage, T *out, int N, int row0, int rend, int col0,
					     int g, int warp, int lane, VAL val)
{
	constexpr int CW = 128 / sizeof(T); /* columns a chunk */
	if (col0 + C0 >= N)
		return; /* the same for the whole warpgroup: no barrier is skipped by some only */
	wg_wg_sync(g); /* the last chunk's copies have read the staging */
#pragma unroll
	for (int qq = 0; qq < CW / 8; qq++)
#pragma unroll
		for (int h = 0; h < 2; h++) {
			int row = 16 * warp + (lane >> 2) + 8 * h, col = 8 * qq + 2 * (lane & 3);
			moe_set2((T *)(stage + row * WG_OUT_ROW + col * (int)sizeof(T)), val(C0 / 8 + qq, h, 0),
				 val(C0 / 8 + qq, h, 1));
		}
	wg_wg_sync(g);
	int tid = 32 * warp + lane; /* 0..127 */
#pragma unroll(wg_copy_unroll)
	for (int j = 0; j < 4; j++) {
		int piece = tid + 128 * j, row = piece >> 3, k = piece & 7, col = col0 + C0 + k * (16 / (int)sizeof(T));
		if (row0 + row < rend && col < N) /* N % 8 == 0: a 16-byte piece is all in or all out */
			*(uint4 *)(out + (size_t)(row0 + row) * N + col) = *(const uint4 *)(stage + row * WG_OUT_ROW + 16 * k);
	}
}

/* The chunks C0, C0 + CW, ... < COLS of one output array. */
template <typename T, int C0, int COLS, class VAL>
__device__ __forceinline__ void wg_put_cols(unsigned char *stage, T *out, int N, int row0, int rend, int col0, int g,
					    int warp, int lane, VAL val)
{
	if constexpr (C0 < COLS) {
		wg_put_chunk<T, C0>(stage, out, N, row0, rend, col0, g, warp, lane, val);
		wg_put_cols<T, C0 + 128 / (int)sizeof(T), COLS>(stage, out, N, row0, rend, col0, g, warp, lane, val);
	}
}
/* fp32 C straight from the registers: a quad's 4 pairs are 32 contiguous bytes, a whole sector, and
 * staging fp32 measured slower (when gate/up stored fp32 g and u, on qwen3-30b's shape: 2.01 ms
 * staged against 1.76-1.84 direct; the bf16 down product 0.90 staged against 1.08-1.13). */
template <int COLS, class VAL>
__device__ __forceinline__ void wg_direct(float *out, int N, int row0, int rend, int col0, int warp, int lane, VAL val)
{
	int r = row0 + 16 * warp + (lane >> 2), c0 = col0 + 2 * (lane & 3);
#pragma unroll
	for (int h = 0; h < 2; h++) {
		if (r + 8 * h >= rend)
			continue;
		float *row = out + (size_t)(r + 8 * h) * N + c0;
#pragma unroll
		for (int q = 0; q < COLS / 8; q++)
			if (c0 + 8 * q < N) /* N and c0 even: the pair is in too */
				moe_set2(row + 8 * q, val(q, h, 0), val(q, h, 1));
	}
}

/* A 64-row block of C = alpha acc (beta 0), its WN columns from col0: bf16 through the staging,
 * fp32 direct. */
template <class CFG, typename OUT>
__device__ __forceinline__ void wg_put(float (&d)[CFG::WN / 2], const typename CFG::args &a, const wg_shared &sh,
				       int row0, int rend, int col0, int g, int warp, int lane)
{
	float alpha = a.alpha;
	auto val = [&](int q, int h, int b) { return alpha * d[4 * q + 2 * h + b]; };
	if constexpr (sizeof(OUT) == 4)
		wg_direct<CFG::WN>((float *)a.c, a.N, row0, rend, col0, warp, lane, val);
	else
		wg_put_cols<OUT, 0, CFG::WN>(sh.out + g * WG_OUT_BYTES, (OUT *)a.c, a.N, row0, rend, col0, g, warp, lane,
					     val);
}

/* Gate/up's accumulator index of g and u at output block q: interleaved 8 and 8 (cp.async), or g in
 * the first WN / 2 columns and u after them (TMA). */
template <class CFG>
__device__ __forceinline__ int wg_gi(int q, int h, int b)
{
	return CFG::TMA ? 4 * q + 2 * h + b : 8 * q + 2 * h + b;
}
template <class CFG>
__device__ __forceinline__ int wg_ui(int q, int h, int b)
{
	return CFG::TMA ? 4 * (q + CFG::WN / 16) + 2 * h + b : 8 * q + 4 + 2 * h + b;
}

/* The same for gate/up: g, u and h (all bf16, h from the fp32 g and u) of the block's WN / 2 output
 * columns, one array after the other through the staging (each chunk waits on the warpgroup's
 * barrier before it overwrites the staging: the last chunk's copies, of this array or the one
 * before, have read it). */
template <class CFG>
__device__ __forceinline__ void wg_put_gu(float (&d)[CFG::WN / 2], const typename CFG::args &a, const wg_shared &sh,
					  int row0, int rend, int col0, int g, int warp, int lane)
{
	unsigned char *st = sh.out + g * WG_OUT_BYTES;
	auto gv = [&](int q, int h, int b) { return d[wg_gi<CFG>(q, h, b)]; };
	auto uv = [&](int q, int h, int b) { return d[wg_ui<CFG>(q, h, b)]; };
	auto hv = [&](int q, int h, int b) { return silu_mul(gv(q, h, b), uv(q, h, b)); };
	wg_put_cols<bf16, 0, CFG::WN / 2>(st, (bf16 *)a.c, a.N, row0, rend, col0, g, warp, lane, gv);
	wg_put_cols<bf16, 0, CFG::WN / 2>(st, a.u, a.N, row0, rend, col0, g, warp, lane, uv);
	wg_put_cols<bf16, 0, CFG::WN / 2>(st, a.h, a.N, row0, rend, col0, g, warp, lane, hv);
}

/* ---- the TMA-store epilogue (wg_cfg::ST: bf16 outputs, beta 0) ----
 * A consumer's 64-row block leaves in subtiles of 64 rows x 32 columns (64 bytes a row), each put
 * into one of the consumer's two stagings in the 64B swizzle (16-byte chunk j of row r at chunk
 * j ^ ((r / 2) % 4): a warp's 8 rows x 4 pairs land on 32 different banks), then written by one TMA
 * store that thread 0 of the consumer issues and commits; the consumer goes on at once. Before a
 * staging is written again, the store that last read it must be done reading (bulk_wait_read: the
 * stores alternate between the stagings, so at most the other one's may still read). A block that
 * the group's end cuts is copied out by the threads themselves (a TMA store writes every row of its
 * box inside the matrix, and the rows past the group's end are another group's); before those
 * copies every earlier store must be done reading, since none is committed for them. n counts the
 * consumer's subtiles (its staging n % 2). */
__device__ __forceinline__ uint32_t wg_st_swz(int row, int j) { return (uint32_t)(row * 64 + ((j ^ ((row >> 1) & 3)) << 4)); }

/* Columns [C0, C0 + 32) of the block from col0 (VAL as wg_put_chunk's: q counted from the block's
 * first column), to out (N columns) through map. */
template <int C0, class VAL>
__device__ __forceinline__ void wg_st_sub(unsigned char *st2, const CUtensorMap *map, bf16 *out, int N, int row0,
					  int rend, int col0, int g, int warp, int lane, int &n, VAL val)
{
	if (col0 + C0 >= N)
		return; /* the same for the whole warpgroup */
	int tid = 32 * warp + lane;
	bool whole = row0 + 64 <= rend;
	unsigned char *buf = st2 + (n & 1) * WG_ST_BYTES;
	if (tid == 0) {
		if (whole)
			bulk_wait_read<1>();
		else
			bulk_wait_read<0>();
	}
	wg_wg_sync(g); /* and the copies of the last use of buf are done */
#pragma unroll
	for (int qq = 0; qq < 4; qq++)
#pragma unroll
		for (int h = 0; h < 2; h++) {
			int row = 16 * warp + (lane >> 2) + 8 * h;
			moe_set2((bf16 *)(buf + wg_st_swz(row, qq) + 4 * (lane & 3)), val(C0 / 8 + qq, h, 0),
				 val(C0 / 8 + qq, h, 1));
		}
	if (whole) {
		fence_proxy_async(); /* this thread's writes, before the async proxy's reads */
		wg_wg_sync(g);
		if (tid == 0) {
			tma_store(map, wg_saddr(buf), col0 + C0, row0);
			tma_reduce_commit();
		}
	} else {
		wg_wg_sync(g);
#pragma unroll
		for (int p = 0; p < 2; p++) {
			int piece = tid + 128 * p, row = piece >> 2, k = piece & 3, col = col0 + C0 + 8 * k;
			if (row0 + row < rend && col < N) /* N % 8 == 0: a 16-byte piece is all in or all out */
				*(uint4 *)(out + (size_t)(row0 + row) * N + col) = *(const uint4 *)(buf + wg_st_swz(row, k));
		}
	}
	n++;
}

template <int C0, int COLS, class VAL>
__device__ __forceinline__ void wg_st_cols(unsigned char *st2, const CUtensorMap *map, bf16 *out, int N, int row0,
					   int rend, int col0, int g, int warp, int lane, int &n, VAL val)
{
	if constexpr (C0 < COLS) {
		wg_st_sub<C0>(st2, map, out, N, row0, rend, col0, g, warp, lane, n, val);
		wg_st_cols<C0 + 32, COLS>(st2, map, out, N, row0, rend, col0, g, warp, lane, n, val);
	}
}

/* wg_put and wg_put_gu by TMA stores. */
template <class CFG>
__device__ __forceinline__ void wg_put_st(float (&d)[CFG::WN / 2], const typename CFG::args &a, const wg_shared &sh,
					  int row0, int rend, int col0, int g, int warp, int lane, int &n)
{
	float alpha = a.alpha;
	auto val = [&](int q, int h, int b) { return alpha * d[4 * q + 2 * h + b]; };
	wg_st_cols<0, CFG::WN>(sh.out + g * 2 * WG_ST_BYTES, &a.omap[0], (bf16 *)a.c, a.N, row0, rend, col0, g, warp,
			       lane, n, val);
}

template <class CFG>
__device__ __forceinline__ void wg_put_gu_st(float (&d)[CFG::WN / 2], const typename CFG::args &a,
					     const wg_shared &sh, int row0, int rend, int col0, int g, int warp, int lane,
					     int &n)
{
	unsigned char *st2 = sh.out + g * 2 * WG_ST_BYTES;
	auto gv = [&](int q, int h, int b) { return d[wg_gi<CFG>(q, h, b)]; };
	auto uv = [&](int q, int h, int b) { return d[wg_ui<CFG>(q, h, b)]; };
	auto hv = [&](int q, int h, int b) { return silu_mul(gv(q, h, b), uv(q, h, b)); };
	wg_st_cols<0, CFG::WN / 2>(st2, &a.omap[0], (bf16 *)a.c, a.N, row0, rend, col0, g, warp, lane, n, gv);
	wg_st_cols<0, CFG::WN / 2>(st2, &a.omap[1], a.u, a.N, row0, rend, col0, g, warp, lane, n, uv);
	wg_st_cols<0, CFG::WN / 2>(st2, &a.omap[2], a.h, a.N, row0, rend, col0, g, warp, lane, n, hv);
}

/* ---- SwiGLU's backward in the epilogue (OUT wg_swb: the experts' dh = dY down_e, moe_wgmma.h's
 * moe_cuda_grouped_dh_swiglu_sm90) ----
 * dh goes through the staging as a bf16 C would (the same rounding), and each 16-byte piece of it
 * is met there by the same piece of g and u: dg, du written, and the piece's share of the row's dot
 * of dh and silu(g) u summed per thread over the chunks of a 128-column slot, then over the slot's
 * 8 threads of the row (a fixed order: the sums do not depend on the tile shape), one float per row
 * and slot. dh itself is never written: the elementwise kernel after the product read it back. */

/* g and u of the consumer's rows and columns toward L2 at the tile's start: the epilogue's loads
 * then wait on L2, not on HBM. */
template <class CFG>
__device__ __forceinline__ void wg_swb_prefetch(const typename CFG::args &a, const wg_tile &tl, int roff, int coff,
						int tid)
{
	constexpr int LPR = CFG::WN / 64, ROWS = 64 * CFG::MT; /* 128-byte lines of a row of one array */
	for (int L = tid; L < 2 * ROWS * LPR; L += 128) {
		int rest = L % (ROWS * LPR), r = tl.row0 + roff + rest / LPR, c = tl.col0 + coff + 64 * (rest % LPR);
		if (r < tl.rend && c < a.N) {
			const bf16 *p = (L < ROWS * LPR ? a.sg : a.su) + (size_t)r * a.N + c;
			asm volatile("prefetch.L2 [%0];\n" ::"l"(p)); /* generic address */
		}
	}
}

/* The slot's dot of the thread's four rows (16 warp + lane / 8 + 16 j... as the copies' pieces):
 * summed over the row's 8 threads, written by the first, reset. */
template <class ARGS>
__device__ __forceinline__ void wg_swb_flush(const ARGS &a, int row0, int rend, int slot, int warp, int lane,
					     float (&dot)[4])
{
#pragma unroll
	for (int j = 0; j < 4; j++) {
		float v = dot[j];
		v += __shfl_xor_sync(0xffffffffu, v, 1);
		v += __shfl_xor_sync(0xffffffffu, v, 2);
		v += __shfl_xor_sync(0xffffffffu, v, 4);
		int row = (32 * warp + lane) / 8 + 16 * j;
		if ((lane & 7) == 0 && row0 + row < rend)
			a.sdot[(size_t)(row0 + row) * a.parts + slot] = v;
		dot[j] = 0.0f;
	}
}

/* pieces whose g and u are loaded together: 2 leaves no spill in the TMA kernels (at setmaxnreg's
 * 216), 4 spills in the ping-pong ones */
#define SWB_PAIR 2
/* One 64-column chunk from C0: dh staged (as wg_put_chunk), then each thread's four pieces, SWB_PAIR
 * at a time: g and u of those loaded first, dg and du out (all four at once spill beside the
 * accumulators a thread still holds for the later chunks). */
template <int C0, class ARGS, class VAL>
__device__ __forceinline__ void wg_swb_chunk(unsigned char *stage, const ARGS &a, int row0, int rend, int col0, int g,
					     int warp, int lane, VAL val, float (&dot)[4])
{
	wg_wg_sync(g); /* the last chunk's reads of the staging are done */
#pragma unroll
	for (int qq = 0; qq < 8; qq++)
#pragma unroll
		for (int h = 0; h < 2; h++) {
			int row = 16 * warp + (lane >> 2) + 8 * h, col = 8 * qq + 2 * (lane & 3);
			moe_set2((bf16 *)(stage + row * WG_OUT_ROW + col * 2), val(C0 / 8 + qq, h, 0), val(C0 / 8 + qq, h, 1));
		}
	wg_wg_sync(g);
	int tid = 32 * warp + lane, k = tid & 7, col = col0 + C0 + 8 * k;
#pragma unroll
	for (int j0 = 0; j0 < 4; j0 += SWB_PAIR) {
		uint4 gv[SWB_PAIR], uv[SWB_PAIR];
#pragma unroll
		for (int i = 0; i < SWB_PAIR; i++) {
			int row = (tid >> 3) + 16 * (j0 + i);
			if (row0 + row < rend && col < a.N) { /* N % 8 == 0: a piece is all in or all out */
				size_t o = (size_t)(row0 + row) * a.N + col;
				gv[i] = *(const uint4 *)(a.sg + o), uv[i] = *(const uint4 *)(a.su + o);
			}
		}
#pragma unroll
		for (int i = 0; i < SWB_PAIR; i++) {
			int row = (tid >> 3) + 16 * (j0 + i);
			if (!(row0 + row < rend && col < a.N))
				continue;
			size_t o = (size_t)(row0 + row) * a.N + col;
			float dv[8];
			uint4 og, ou;
			bf16x8_to_f32(*(const uint4 *)(stage + row * WG_OUT_ROW + 16 * k), dv);
			dot[j0 + i] += swiglu_bwd8<true>(gv[i], uv[i], dv, og, ou);
			*(uint4 *)(a.sdg + o) = og;
			*(uint4 *)(a.sdu + o) = ou;
		}
	}
}

/* The chunks C0, C0 + 64, ... < COLS; a slot's dot flushed after its last chunk, or where the
 * columns end. col0 is a multiple of the slot (tiles and consumers split columns by 128 or 256). */
template <int C0, int COLS, class ARGS, class VAL>
__device__ __forceinline__ void wg_swb_cols(unsigned char *stage, const ARGS &a, int row0, int rend, int col0, int g,
					    int warp, int lane, VAL val, float (&dot)[4])
{
	if constexpr (C0 < COLS) {
		if (col0 + C0 >= a.N)
			return; /* the same for the whole warpgroup */
		wg_swb_chunk<C0>(stage, a, row0, rend, col0, g, warp, lane, val, dot);
		if ((C0 + 64) % WG_SWB_SLOT == 0 || col0 + C0 + 64 >= a.N)
			wg_swb_flush(a, row0, rend, (col0 + C0) / WG_SWB_SLOT, warp, lane, dot);
		wg_swb_cols<C0 + 64, COLS>(stage, a, row0, rend, col0, g, warp, lane, val, dot);
	}
}

template <class CFG>
__device__ __forceinline__ void wg_put_swb(float (&d)[CFG::WN / 2], const typename CFG::args &a, const wg_shared &sh,
					   int row0, int rend, int col0, int g, int warp, int lane)
{
	static_assert(CFG::WN % WG_SWB_SLOT == 0, "a consumer's columns are whole slots");
	float alpha = a.alpha, dot[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
	auto val = [&](int q, int h, int b) { return alpha * d[4 * q + 2 * h + b]; };
	wg_swb_cols<0, CFG::WN>(sh.out + g * WG_OUT_BYTES, a, row0, rend, col0, g, warp, lane, val, dot);
}
#endif /* WG_SM90A */
#endif
