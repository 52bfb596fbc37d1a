/* moe_grouped.cu - the device-side grouped GEMM of the experts: C = alpha X op(W_e) + beta C over the
 * rows of each expert e, and the SwiGLU first half (g, u and h = silu(g) u) fused in one launch (the
 * LoRA weight gradients' reductions are in moe_wgrad.cu).
 *
 * The host does not know the offsets (no synchronisation), so the grid is an upper bound on the row
 * tiles and each CTA finds its (expert, row tile) on the device from the device offsets; CTAs past
 * the last tile exit. Column tiles are blockIdx.x (fastest) so that the CTAs of one X row tile run
 * together and share it in L2.
 *
 * Tensor cores through sm_80 instructions only (they run on sm_90 too): mma.sync m16n8k16 bf16 ->
 * fp32, fragments by ldmatrix (.trans for W stored [K, N]), tiles brought in by 16-byte cp.async
 * through a GG_STAGES-deep ring in dynamic shared memory (one barrier per k step). Shared rows are
 * padded by 8 bf16 so that the 8 row addresses of an ldmatrix fall in distinct banks. A CTA of 8
 * warps (2 along M, 4 along N) computes BM x 128 (BM = 128, or 64 when the groups are small: less
 * padding work on a group's last tile); each warp BM/2 x 32. Rows past a group's end, columns past N
 * and k past K are zero-filled (cp.async with source size 0) and never stored.
 *
 * gate_up: the 128 B rows of a CTA are 64 columns of gate and the same 64 of up, interleaved by 16
 * so that each warp's 32 columns are 16 of gate and the same 16 of up: every thread then holds g and
 * u of the same elements in its accumulators and writes g, u and h in the epilogue (no second pass).
 *
 * Opt-in for the experts' forward: TIER_MOE_GROUPED=1 (moe_experts.cu, docs/moe.md). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/mma_sm80.cuh"
#include "base/pdl.cuh"

#define GG_BN 128      /* B rows (output columns) per CTA; with gate_up 64 of gate and 64 of up */
#define GG_BK 32       /* k per pipeline stage */
#define GG_STAGES 4    /* cp.async ring depth: 3 stages in flight while one is consumed */
#define GG_PAD 8       /* bf16 added to each shared row against ldmatrix bank conflicts */
#define GG_THREADS 256 /* 8 warps: 2 along M, 4 along N */

enum { GG_NK = 0, GG_KN = 1, GG_GATE_UP = 2 }; /* W [N, K]; W [K, N]; gate and up, both [N, K] */

/* The kernel's parameters (__grid_constant__: the tables stay in parameter space, 8 KiB each, CUDA
 * 12.1+). w[0]: the weights (gate with gate_up), w[1]: up. c: C, or g (bf16) with gate_up. */
template <int NT>
struct gg_args {
	const bf16 *w[NT][TIER_MOE_MAX_EXPERTS];
	const int32_t *off;
	const bf16 *x;
	void *c;
	bf16 *u; /* gate_up: u */
	bf16 *h;
	float alpha; /* grouped_mm's scale of the product (1 with gate_up) */
	int E, N, K, beta;
};

/* The number of weight tables of a mode. */
template <int MODE>
struct gg_nt {
	static constexpr int value = MODE == GG_GATE_UP ? 2 : 1;
};

/* Shared memory per stage (elements): A [BM][BK + PAD]; B [BN][BK + PAD], or [BK][BN + PAD] when W is
 * stored [K, N]. Every row is a multiple of 16 bytes, as cp.async and ldmatrix need. */
template <int BM, int MODE>
struct gg_smem {
	static constexpr int LDA = GG_BK + GG_PAD;
	static constexpr int LDB = MODE == GG_KN ? GG_BN + GG_PAD : GG_BK + GG_PAD;
	static constexpr int A = BM * LDA;
	static constexpr int B = MODE == GG_KN ? GG_BK * LDB : GG_BN * LDB;
	static constexpr size_t BYTES = (size_t)GG_STAGES * (A + B) * sizeof(bf16);
	static_assert(LDA % 8 == 0 && LDB % 8 == 0 && A % 8 == 0 && B % 8 == 0, "16-byte shared rows");
};

struct gg_tile {
	int e, row0, rend, col0; /* expert, first row, its group's end, first column */
};

/* ---- sm_80 instructions (the style of attn/attn_cuda.cu) ---- */

/* ---- which tile a CTA computes ---- */
/* Row tile b of the grid is the (b - first)-th BM-row tile of the expert whose tiles, counted in
 * expert order, cover b. Each thread sums the tiles of up to ceil(E / 256) consecutive experts, a
 * shuffle scan per warp and the 8 warp totals give each thread its first tile, and the one whose
 * range holds b walks its experts. Returns false past the last tile (the grid is an upper bound).
 * Uniform over the block (it synchronises). */
template <int BM>
__device__ static bool find_tile(const int32_t *off, int E, int b, gg_tile *t)
{
	__shared__ int wsum[GG_THREADS / 32], hit[3];
	int tid = threadIdx.x;
	int per = (E + GG_THREADS - 1) / GG_THREADS, e0 = tid * per, e1 = min(e0 + per, E), mine = 0;
	for (int e = e0; e < e1; e++)
		mine += moe_row_tiles<BM>(off[e], off[e + 1]);
	if (tid == 0)
		hit[0] = -1;
	int first = block_exclusive_scan(mine, wsum); /* its barrier orders hit[0] = -1 before the hit */
	if (b >= first && b < first + mine)
		for (int e = e0; e < e1; e++) {
			int nt = moe_row_tiles<BM>(off[e], off[e + 1]);
			if (b < first + nt) {
				hit[0] = e, hit[1] = off[e] + (b - first) * BM, hit[2] = off[e + 1];
				break;
			}
			first += nt;
		}
	__syncthreads();
	t->e = hit[0], t->row0 = hit[1], t->rend = hit[2];
	return t->e >= 0;
}

/* ---- the stages: global -> shared ---- */
/* X rows [row0, row0 + BM) (those before rend), k [k0, k0 + BK); X's row stride is K. */
template <int BM>
__device__ __forceinline__ void load_a(bf16 *sa, const bf16 *X, int K, const gg_tile &t, int k0)
{
	cp_async_tile<BM, GG_BK, GG_BK + GG_PAD, GG_THREADS>(sa, X, K, t.row0, t.rend, k0, K);
}

/* W [N, K] (B row r = column col0 + r), or gate and up interleaved by 16 for gate_up: row r is
 * column col0 + (r / 32) 16 + r % 16 of gate (r & 16 clear) or of up. */
template <int MODE>
__device__ __forceinline__ void load_b_nk(bf16 *sb, const bf16 *W0, const bf16 *W1, int N, int K, int col0, int k0)
{
	constexpr int CPR = GG_BK / 8, LDB = GG_BK + GG_PAD;
#pragma unroll
	for (int i = 0; i < GG_BN * CPR / GG_THREADS; i++) {
		int q = threadIdx.x + i * GG_THREADS, r = q / CPR, c = q % CPR * 8, gk = k0 + c;
		int n = MODE == GG_GATE_UP ? col0 + (r >> 5) * 16 + (r & 15) : col0 + r;
		const bf16 *W = MODE == GG_GATE_UP && (r & 16) ? W1 : W0;
		bool ok = n < N && gk < K;
		cp_async16(sb + r * LDB + c, ok ? W + (size_t)n * K + gk : W, ok);
	}
}

/* W [K, N]: shared row r is W's row k0 + r, columns [col0, col0 + BN). */
__device__ __forceinline__ void load_b_kn(bf16 *sb, const bf16 *W, int N, int K, int col0, int k0)
{
	cp_async_tile<GG_BK, GG_BN, GG_BN + GG_PAD, GG_THREADS>(sb, W, N, k0, K, col0, N);
}

/* ---- one stage of products: acc[mi][nj] is the warp's 16 x 8 tile (mi, nj) ---- */
template <int BM, int MODE>
__device__ __forceinline__ void mma_stage(float (*acc)[4][4], const bf16 *sa, const bf16 *sb, int wm, int wn,
					  int lane)
{
	typedef gg_smem<BM, MODE> SM;
	constexpr int MI = BM / 32;
#pragma unroll
	for (int kk = 0; kk < GG_BK; kk += 16) {
		uint32_t a[MI][4], b[2][4];
#pragma unroll
		for (int mi = 0; mi < MI; mi++)
			ldsm4(a[mi], sa + (wm * (BM / 2) + mi * 16 + (lane & 15)) * SM::LDA + kk + (lane >> 4) * 8);
		/* b[jp][0..1]: the 8 columns n0 = wn 32 + jp 16, k 0-7 and 8-15; b[jp][2..3]: n0 + 8 */
#pragma unroll
		for (int jp = 0; jp < 2; jp++) {
			int n0 = wn * 32 + jp * 16;
			if (MODE == GG_KN)
				ldsm4t(b[jp], sb + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * SM::LDB + n0 + (lane >> 4) * 8);
			else
				ldsm4(b[jp], sb + (n0 + (lane & 7) + (lane >> 4) * 8) * SM::LDB + kk + ((lane >> 3) & 1) * 8);
		}
#pragma unroll
		for (int mi = 0; mi < MI; mi++)
#pragma unroll
			for (int nj = 0; nj < 4; nj++)
				mma16816(acc[mi][nj], a[mi], &b[nj >> 1][(nj & 1) * 2]);
	}
}

/* ---- epilogues: the accumulator (mi, nj) holds rows g, g + 8 (g = lane / 4), columns 2 (lane % 4)
 * and the next, of its 16 x 8 tile ---- */
template <int BM, typename OUT>
__device__ __forceinline__ void store_c(float (*acc)[4][4], const gg_args<1> &a, const gg_tile &t, int wm, int wn,
					int lane)
{
	OUT *C = (OUT *)a.c;
#pragma unroll
	for (int mi = 0; mi < BM / 32; mi++)
#pragma unroll
		for (int hf = 0; hf < 2; hf++) {
			int gr = t.row0 + wm * (BM / 2) + mi * 16 + (lane >> 2) + hf * 8;
			if (gr >= t.rend)
				continue;
#pragma unroll
			for (int nj = 0; nj < 4; nj++) {
				int col = t.col0 + wn * 32 + nj * 8 + (lane & 3) * 2; /* even; N % 8 == 0: col + 1 < N too */
				if (col < a.N)
					put2(C + (size_t)gr * a.N + col, acc[mi][nj][hf * 2], acc[mi][nj][hf * 2 + 1], a.alpha,
					     a.beta);
			}
		}
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

/* gate_up: acc[.][0..1] are gate, acc[.][2..3] up, of the same columns col0 + wn 16 + nj 8 + ..;
 * g, u and h stored in bf16, h from the fp32 sums. */
template <int BM>
__device__ __forceinline__ void store_gate_up(float (*acc)[4][4], const gg_args<2> &a, const gg_tile &t, int wm,
					      int wn, int lane)
{
	bf16 *G = (bf16 *)a.c;
#pragma unroll
	for (int mi = 0; mi < BM / 32; mi++)
#pragma unroll
		for (int hf = 0; hf < 2; hf++) {
			int gr = t.row0 + wm * (BM / 2) + mi * 16 + (lane >> 2) + hf * 8;
			if (gr >= t.rend)
				continue;
#pragma unroll
			for (int nj = 0; nj < 2; nj++) {
				int col = t.col0 + wn * 16 + nj * 8 + (lane & 3) * 2;
				if (col >= a.N)
					continue;
				size_t o = (size_t)gr * a.N + col;
				float g0 = acc[mi][nj][hf * 2], g1 = acc[mi][nj][hf * 2 + 1];
				float u0 = acc[mi][nj + 2][hf * 2], u1 = acc[mi][nj + 2][hf * 2 + 1];
				moe_set2(G + o, g0, g1);
				moe_set2(a.u + o, u0, u1);
				moe_set2(a.h + o, silu(g0) * u0, silu(g1) * u1);
			}
		}
}

/* ---- the kernel ---- */
/* The ring: before step kt the groups of tiles 0..kt are complete (wait_group STAGES - 2: every
 * step commits one group, empty past the last tile, so the count is exact); the barrier then also
 * tells that every warp is done with slot (kt - 1) % STAGES, which the prefetch of tile
 * kt + STAGES - 1 overwrites. */
template <int BM, int MODE, typename OUT>
__global__ void __launch_bounds__(GG_THREADS, 2) gg_kernel(const __grid_constant__ gg_args<gg_nt<MODE>::value> a)
{
	pdl_enter();
	typedef gg_smem<BM, MODE> SM;
	constexpr int NT = gg_nt<MODE>::value;
	extern __shared__ __align__(16) unsigned char smem[];
	gg_tile t;
	if (!find_tile<BM>(a.off, a.E, blockIdx.y, &t))
		return; /* past the last tile */
	t.col0 = blockIdx.x * (MODE == GG_GATE_UP ? GG_BN / 2 : GG_BN);
	const bf16 *W0 = a.w[0][t.e], *W1 = a.w[NT - 1][t.e];
	bf16 *sa = (bf16 *)smem, *sb = sa + GG_STAGES * SM::A;
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
	float acc[BM / 32][4][4];
#pragma unroll
	for (int mi = 0; mi < BM / 32; mi++)
#pragma unroll
		for (int nj = 0; nj < 4; nj++)
#pragma unroll
			for (int i = 0; i < 4; i++)
				acc[mi][nj][i] = 0.0f;
	int nk = (a.K + GG_BK - 1) / GG_BK;
	auto load = [&](int kt) {
		int s = kt % GG_STAGES;
		load_a<BM>(sa + s * SM::A, a.x, a.K, t, kt * GG_BK);
		if (MODE == GG_KN)
			load_b_kn(sb + s * SM::B, W0, a.N, a.K, t.col0, kt * GG_BK);
		else
			load_b_nk<MODE>(sb + s * SM::B, W0, W1, a.N, a.K, t.col0, kt * GG_BK);
	};
	cp_async_ring<GG_STAGES>(nk, load, [&](int s, int) {
		mma_stage<BM, MODE>(acc, sa + s * SM::A, sb + s * SM::B, wm, wn, lane);
	});
	cp_async_wait<0>(); /* only empty groups remain; leave none behind */
	if constexpr (MODE == GG_GATE_UP)
		store_gate_up<BM>(acc, a, t, wm, wn, lane);
	else
		store_c<BM, OUT>(acc, a, t, wm, wn, lane);
}

/* ---- host side ---- */
/* Small groups waste less of their last tile with 64 rows; the mean rows per expert decides. */
static int gg_bm(int rows_bound, int E) { return rows_bound / E < 96 ? 64 : 128; }

template <int BM, int MODE, typename OUT>
static int gg_launch(tier_dev *dev, const char *fn, const gg_args<gg_nt<MODE>::value> &a, int rows_bound)
{
	typedef gg_smem<BM, MODE> SM;
	/* sum_e ceil(n_e / BM) <= (rows + (BM - 1) (non-empty experts)) / BM, and at most
	 * min(E, rows_bound) experts have rows */
	long long ny = ((long long)rows_bound + (long long)(BM - 1) * (a.E < rows_bound ? a.E : rows_bound)) / BM;
	int cols = MODE == GG_GATE_UP ? GG_BN / 2 : GG_BN;
	if (ny > 65535)
		return tier_fail(-EINVAL, "%s: rows_bound %d needs %lld row tiles of %d, more than a grid's 65535; "
				 "split the rows over several calls", fn, rows_bound, ny, BM);
	dim3 grid((unsigned)((a.N + cols - 1) / cols), (unsigned)ny);
	CUDA_TRY(cudaFuncSetAttribute(gg_kernel<BM, MODE, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)SM::BYTES));
	tier_launch(gg_kernel<BM, MODE, OUT>, grid, GG_THREADS, SM::BYTES, moe_stream(dev), a);
	CUDA_LAUNCHED();
	return 0;
}

template <int MODE, typename OUT>
static int gg_dispatch(tier_dev *dev, const char *fn, const gg_args<gg_nt<MODE>::value> &a, int rows_bound)
{
	if (rows_bound == 0)
		return 0;
	if (gg_bm(rows_bound, a.E) == 64)
		return gg_launch<64, MODE, OUT>(dev, fn, a, rows_bound);
	return gg_launch<128, MODE, OUT>(dev, fn, a, rows_bound);
}

/* The checks common to both entry points; nn, kn: the names of N and K in the caller's terms. */
static int gg_check(const char *fn, tier_dev *dev, int E, int N, int K, const char *nn, const char *kn,
		    const int32_t *d_off, int rows_bound, const void *x)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, nn, N)) || (rc = moe_check_dim(fn, kn, K)))
		return rc;
	MOE_NONNULL(d_off, fn);
	MOE_NONNULL(x, fn);
	if (N % 8 || K % 8)
		return tier_fail(-EINVAL, "%s: %s = %d and %s = %d must be multiples of 8 (16-byte loads); use the "
				 "per-expert cuBLASLt products (moe_cuda_mm) for other shapes", fn, nn, N, kn, K);
	if ((uintptr_t)x % 16)
		return tier_fail(-EINVAL, "%s: x is not 16-byte aligned; pass an aligned buffer", fn);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	return 0;
}

/* tab[e] = w[e] for e < E (each 16-byte aligned or NULL), NULL past E. */
static int gg_table(const char *fn, const char *what, int E, const void *const *w, const bf16 **tab)
{
	MOE_NONNULL(w, fn);
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++) {
		tab[e] = e < E ? (const bf16 *)w[e] : NULL;
		if ((uintptr_t)tab[e] % 16)
			return tier_fail(-EINVAL, "%s: %s of expert %d is not 16-byte aligned; pass aligned weights", fn,
					 what, e);
	}
	return 0;
}

static int gg_out_aligned(const char *fn, const char *what, const void *p)
{
	MOE_NONNULL(p, fn);
	if ((uintptr_t)p % 16)
		return tier_fail(-EINVAL, "%s: %s is not 16-byte aligned; pass an aligned buffer", fn, what);
	return 0;
}

extern "C" int moe_cuda_grouped_mm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
				   const void *const *w, int w_kn, const void *x, void *c, int c_bf16, float alpha,
				   float beta)
{
	const char *fn = "moe_cuda_grouped_mm";
	gg_args<1> a; /* 8 KiB */
	int rc = gg_check(fn, dev, E, N, K, "N", "K", d_off, rows_bound, x);
	if (rc || (rc = gg_out_aligned(fn, "c", c)) || (rc = gg_table(fn, "the weight", E, w, a.w[0])))
		return rc;
	if (w_kn != 0 && w_kn != 1)
		return tier_fail(-EINVAL, "%s: w_kn = %d; it must be 0 (W [N, K]) or 1 (W [K, N])", fn, w_kn);
	if (beta != 0.0f && beta != 1.0f)
		return tier_fail(-EINVAL, "%s: beta = %g; it must be 0 (write C) or 1 (add to C)", fn, (double)beta);
	if (!isfinite(alpha))
		return tier_fail(-EINVAL, "%s: alpha = %g; pass a finite scale", fn, (double)alpha);
	a.off = d_off, a.x = (const bf16 *)x, a.c = c, a.u = NULL, a.h = NULL;
	a.alpha = alpha, a.E = E, a.N = N, a.K = K, a.beta = beta != 0.0f;
	if (w_kn)
		return c_bf16 ? gg_dispatch<GG_KN, bf16>(dev, fn, a, rows_bound)
			      : gg_dispatch<GG_KN, float>(dev, fn, a, rows_bound);
	return c_bf16 ? gg_dispatch<GG_NK, bf16>(dev, fn, a, rows_bound) : gg_dispatch<GG_NK, float>(dev, fn, a, rows_bound);
}

extern "C" int moe_cuda_grouped_gate_up(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows_bound,
					const void *const *gate, const void *const *up, const void *x, void *g, void *u,
					void *h)
{
	const char *fn = "moe_cuda_grouped_gate_up";
	gg_args<2> a; /* 16 KiB */
	int rc = gg_check(fn, dev, E, I, H, "I", "H", d_off, rows_bound, x);
	if (rc || (rc = gg_out_aligned(fn, "g", g)) || (rc = gg_out_aligned(fn, "u", u)) ||
	    (rc = gg_out_aligned(fn, "h", h)) || (rc = gg_table(fn, "gate", E, gate, a.w[0])) ||
	    (rc = gg_table(fn, "up", E, up, a.w[1])))
		return rc;
	a.off = d_off, a.x = (const bf16 *)x, a.c = g, a.u = (bf16 *)u, a.h = (bf16 *)h;
	a.alpha = 1.0f, a.E = E, a.N = I, a.K = H, a.beta = 0;
	return gg_dispatch<GG_GATE_UP, bf16>(dev, fn, a, rows_bound);
}
