/* moe_skinny.cu - the grouped GEMM of the LoRA rank products, Z_j = alpha X op(W_j,e) over each
 * expert's rows with N = r <= 64: one pass over X for one or two products (moe_skinny.h).
 *
 * Why a kernel of its own: with N = 16 the general grouped GEMM (moe_grouped.cu, 128-column tiles)
 * spends 7/8 of its products on zero columns, and the work is bound by reading X (rows x K bf16)
 * once anyway: 2 nw r flop per element of X is far below what the tensor cores do per byte of HBM.
 * What counts is keeping enough bytes of X in flight, so the CTAs are small and many.
 *
 * Tiles. A CTA of 4 warps takes BM rows (64, or 128 where nw r <= 64) of one expert's group and
 * every column of both products. Each warp owns BM / 4 rows (MT = 1 or 2 mma tiles of 16) and all
 * NC = nw RP columns, RP = r rounded up to 16 (ldmatrix brings B 16 columns at a time; the columns
 * past r are zero weights, never stored): the B fragments a warp loads serve MT row tiles, which is
 * why 128-row tiles halve W's shared-memory reads per byte of X. The CTA's expert and rows come from
 * the device offsets (sk_find: a block scan of every expert's row tiles); the grid is an upper bound
 * on the tiles and CTAs past the last one exit.
 *
 * Pipeline. 16-byte cp.async through a SK_STAGES-deep ring of 64-k stages (cp_async_ring, base/
 * mma_sm80.cuh: one barrier per stage). A stage holds the X tile [BM][64] and the weights of both
 * products: [NC][64] (w_kn 0: rows of W_j,e [r, K] at rows j RP..) or [64][NC] (w_kn 1: rows of
 * W_j,e [K, r] at columns j RP..). W is tiny and stays in L2. Every shared row is padded by 8 bf16 so
 * that the 8 row addresses of an ldmatrix fall in distinct banks (the row strides are odd multiples
 * of 16 bytes). mma.sync m16n8k16 bf16 -> fp32; fragments by ldmatrix, .trans for w_kn 1. 54 KiB of
 * shared memory per CTA for r = 16, nw = 2 and 64 rows: 4 CTAs per SM. sm_80 instructions only: the
 * build's sm_90a code and compute_90 PTX both have them.
 *
 * Rows past the group, k past K and weight columns past r are zero-filled (cp.async with source size
 * 0: nothing is read) and never stored; a warp whose rows all lie past its group skips the products.
 * Rows outside every group are neither read nor written. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_skinny.h"
#include "base/mma_sm80.cuh"
#include "base/pdl.cuh"

#define SK_BK 64      /* k per stage: one 128-byte line of each X row */
#define SK_STAGES 4   /* ring depth: 3 stages of X in flight per CTA while one is multiplied */
#define SK_PAD 8      /* bf16 added to each shared row against ldmatrix bank conflicts */
#define SK_THREADS 128 /* 4 warps */
#define SK_MAX_R 64    /* the largest rank: 4 column tiles of 16 per product */

/* The kernel's parameters (__grid_constant__: the pointer tables, 8 KiB each, stay in parameter
 * space). w[j][e]: W_j,e; z[j]: Z_j. */
template <int NW>
struct sk_args {
	const bf16 *w[NW][TIER_MOE_MAX_EXPERTS];
	const int32_t *off;
	const bf16 *x;
	bf16 *z[NW];
	float alpha;
	int E, r, K;
};

/* A kernel variant: BM rows per CTA, ranks up to RP (a multiple of 16), NW products, W's layout KN
 * (1: [K, r]). Sizes in bf16 elements unless named BYTES. */
template <int BM_, int RP_, int NW_, int KN_>
struct sk_cfg {
	static constexpr int BM = BM_, RP = RP_, NW = NW_, KN = KN_;
	static constexpr int MT = BM / 64;  /* 16-row mma tiles per warp */
	static constexpr int NC = NW * RP;  /* weight columns of a stage */
	static constexpr int NJ = NC / 8;   /* 8-column mma tiles per warp */
	static constexpr int LDX = SK_BK + SK_PAD;
	static constexpr int LDW = KN ? NC + SK_PAD : SK_BK + SK_PAD;
	static constexpr int XS = BM * LDX;                  /* X per stage */
	static constexpr int WS = KN ? SK_BK * LDW : NC * LDW; /* W per stage */
	static constexpr size_t BYTES = (size_t)SK_STAGES * (XS + WS) * sizeof(bf16);
	/* CTAs per SM that shared memory admits (228 KiB per SM on Hopper, 1 KiB of it reserved per
	 * CTA), at most 4: the register budget __launch_bounds__ then leaves each thread */
	static constexpr int CTAS_FIT = (int)(228 * 1024 / (BYTES + 1024));
	static constexpr int CTAS = CTAS_FIT < 1 ? 1 : CTAS_FIT > 4 ? 4 : CTAS_FIT;
	static_assert(BM == 64 || BM == 128, "4 warps of one or two 16-row tiles");
	static_assert(RP % 16 == 0 && RP <= SK_MAX_R && (NW == 1 || NW == 2), "ranks padded to 16");
	static_assert(MT * NJ * 4 <= 64, "accumulators of at most 64 registers");
	static_assert(LDX % 8 == 0 && LDW % 8 == 0 && XS % 8 == 0 && WS % 8 == 0, "16-byte shared rows");
};

struct sk_tile {
	int e, row0, rend; /* expert, first row, its group's end */
};

/* ---- which tile a CTA computes ---- */
/* CTA b's tile: the (b - first)-th BM-row tile of the expert whose tiles, counted in expert order,
 * cover b. Thread i owns the PER experts from i PER: it loads all their offsets before using any
 * (one memory latency, not PER), counts their tiles, learns from the scan where its run of tiles
 * starts, and the one thread whose run holds b names the tile. Returns false past the last tile.
 * All threads; synchronises. */
template <int BM>
__device__ static bool sk_find(const int32_t *off, int E, int b, sk_tile *t)
{
	constexpr int PER = TIER_MOE_MAX_EXPERTS / SK_THREADS;
	static_assert(PER * SK_THREADS == TIER_MOE_MAX_EXPERTS, "every expert has a thread");
	__shared__ int wsum[SK_THREADS / 32];
	__shared__ sk_tile hit;
	int e0 = threadIdx.x * PER, lo = e0 < E ? off[e0] : 0, hi[PER], n[PER], mine = 0;
#pragma unroll
	for (int i = 0; i < PER; i++)
		hi[i] = e0 + i < E ? off[e0 + i + 1] : 0;
#pragma unroll
	for (int i = 0, l = lo; i < PER; i++) {
		n[i] = e0 + i < E ? moe_row_tiles<BM>(l, hi[i]) : 0;
		mine += n[i];
		l = hi[i];
	}
	if (threadIdx.x == 0)
		hit.e = -1;
	int first = block_exclusive_scan(mine, wsum); /* its barrier orders hit.e = -1 before the write below */
#pragma unroll
	for (int i = 0, l = lo; i < PER; i++) {
		if (b >= first && b < first + n[i])
			hit.e = e0 + i, hit.row0 = l + (b - first) * BM, hit.rend = hi[i];
		first += n[i];
		l = hi[i];
	}
	__syncthreads();
	*t = hit;
	return t->e >= 0;
}

/* ---- the stages: global -> shared ---- */
/* X rows [row0, row0 + BM) of the tile (those before rend), k [k0, k0 + 64); X's row stride is K. */
template <class C>
__device__ __forceinline__ void sk_load_x(bf16 *s, const bf16 *X, int K, const sk_tile &t, int k0)
{
	cp_async_tile<C::BM, SK_BK, C::LDX, SK_THREADS>(s, X, K, t.row0, t.rend, k0, K);
}

/* Both products' weights for k [k0, k0 + 64). w_kn 0: shared row j RP + c is row c of W_j,e [r, K]
 * (rows c >= r zero). w_kn 1: shared row k holds row k0 + k of W_j,e [K, r] at columns j RP..
 * (columns past r zero). Either way column n of the product block is shared column or row n. */
template <class C>
__device__ __forceinline__ void sk_load_w(bf16 *s, const bf16 *W0, const bf16 *W1, int r, int K, int k0)
{
	constexpr int CPR = C::KN ? C::NC / 8 : SK_BK / 8;        /* 16-byte chunks per shared row */
	constexpr int N = (C::KN ? SK_BK : C::NC) * CPR, ITERS = (N + SK_THREADS - 1) / SK_THREADS;
#pragma unroll
	for (int i = 0; i < ITERS; i++) {
		int q = threadIdx.x + i * SK_THREADS;
		if (N % SK_THREADS && q >= N)
			break;
		int row = q / CPR, c = q % CPR * 8;
		int n = C::KN ? c : row, gk = k0 + (C::KN ? row : c); /* product column block n, depth gk */
		int j = n / C::RP, col = n % C::RP;
		const bf16 *W = C::NW == 2 && j ? W1 : W0;
		bool ok = col < r && gk < K; /* r, K multiples of 8: a chunk is all in or all out */
		size_t at = C::KN ? (size_t)gk * r + col : (size_t)col * K + gk;
		cp_async16(s + row * C::LDW + c, ok ? W + at : W, ok);
	}
}

/* ---- one stage of products: acc[mt][nj] += the warp's rows m0 + 16 mt.. times columns 8 nj.. ----
 * A (16 x 16): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
 * k 8-15), the register order of mma's a[0..3]. B: b[0..1] the columns 16 jp + 0-7 at k 0-7 and
 * 8-15, b[2..3] the columns 16 jp + 8-15; from [n][k] rows plain, from [k][n] rows transposed. */
template <class C>
__device__ __forceinline__ void sk_mma(float (*acc)[C::NJ][4], const bf16 *sx, const bf16 *sw, int m0, int lane)
{
	/* B: lane i gives row i % 8 of matrix i / 8, which covers k + k8 and the columns + n8 */
	int l8 = lane & 7, k8 = ((lane >> 3) & 1) * 8, n8 = (lane >> 4) * 8;
#pragma unroll
	for (int kk = 0; kk < SK_BK; kk += 16) {
		uint32_t a[C::MT][4];
#pragma unroll
		for (int mt = 0; mt < C::MT; mt++)
			ldsm4(a[mt], sx + (m0 + mt * 16 + (lane & 15)) * C::LDX + kk + (lane >> 4) * 8);
#pragma unroll
		for (int jp = 0; jp < C::NC / 16; jp++) {
			uint32_t b[4];
			if (C::KN)
				ldsm4t(b, sw + (kk + l8 + k8) * C::LDW + jp * 16 + n8);
			else
				ldsm4(b, sw + (jp * 16 + l8 + n8) * C::LDW + kk + k8);
#pragma unroll
			for (int mt = 0; mt < C::MT; mt++) {
				mma16816(acc[mt][2 * jp], a[mt], b);
				mma16816(acc[mt][2 * jp + 1], a[mt], b + 2);
			}
		}
	}
}

/* ---- the epilogue: accumulator (mt, nj) holds rows g and g + 8 (g = lane / 4) of its 16 x 8 tile,
 * columns 2 (lane % 4) and the next; column block n = 8 nj + .. is product n / RP, column n % RP ---- */
template <class C>
__device__ __forceinline__ void sk_store(float (*acc)[C::NJ][4], const sk_args<C::NW> &a, const sk_tile &t, int m0,
					 int lane)
{
#pragma unroll
	for (int mt = 0; mt < C::MT; mt++)
#pragma unroll
		for (int h = 0; h < 2; h++) {
			int row = t.row0 + m0 + mt * 16 + (lane >> 2) + 8 * h;
			if (row >= t.rend)
				continue;
#pragma unroll
			for (int nj = 0; nj < C::NJ; nj++) {
				/* col is even and r % 8 == 0: col + 1 < r too */
				int j = nj * 8 / C::RP, col = nj * 8 % C::RP + 2 * (lane & 3);
				const float *v = acc[mt][nj] + 2 * h;
				if (col < a.r)
					*(__nv_bfloat162 *)(a.z[j] + (size_t)row * a.r + col) =
						__floats2bfloat162_rn(a.alpha * v[0], a.alpha * v[1]);
			}
		}
}

/* ---- the kernel ---- */
/* __launch_bounds__: registers for as many CTAs per SM as shared memory admits (4: 128 a thread,
 * the accumulators at most 64 of them), not more: more would only spill. */
template <class C>
__global__ void __launch_bounds__(SK_THREADS, C::CTAS) sk_kernel(const __grid_constant__ sk_args<C::NW> a)
{
	pdl_enter();
	extern __shared__ __align__(16) unsigned char sk_smem[];
	sk_tile t;
	if (!sk_find<C::BM>(a.off, a.E, (int)blockIdx.x, &t))
		return; /* past the last tile */
	const bf16 *W0 = a.w[0][t.e], *W1 = a.w[C::NW - 1][t.e];
	bf16 *sx = (bf16 *)sk_smem, *sw = sx + SK_STAGES * C::XS;
	int lane = threadIdx.x & 31, m0 = (threadIdx.x >> 5) * 16 * C::MT;
	bool live = t.row0 + m0 < t.rend; /* the warp has rows in the group */
	float acc[C::MT][C::NJ][4];
#pragma unroll
	for (int mt = 0; mt < C::MT; mt++)
#pragma unroll
		for (int nj = 0; nj < C::NJ; nj++)
#pragma unroll
			for (int i = 0; i < 4; i++)
				acc[mt][nj][i] = 0.0f;
	auto load = [&](int kt) {
		int s = kt % SK_STAGES;
		sk_load_x<C>(sx + s * C::XS, a.x, a.K, t, kt * SK_BK);
		sk_load_w<C>(sw + s * C::WS, W0, W1, a.r, a.K, kt * SK_BK);
	};
	cp_async_ring<SK_STAGES>((a.K + SK_BK - 1) / SK_BK, load, [&](int s, int) {
		if (live) /* the barriers of the ring are outside: every warp still takes them */
			sk_mma<C>(acc, sx + s * C::XS, sw + s * C::WS, m0, lane);
	});
	cp_async_wait<0>(); /* only empty groups remain; leave none behind */
	if (live)
		sk_store<C>(acc, a, t, m0, lane);
}

/* ---- host side ---- */
template <class C>
static int sk_launch(tier_dev *dev, const sk_args<C::NW> &a, int rows_bound)
{
	/* sum_e ceil(n_e / BM) <= (rows + (BM - 1) (experts with rows)) / BM, and at most
	 * min(E, rows_bound) experts have rows: below 2^26 CTAs */
	long long busy = a.E < rows_bound ? a.E : rows_bound;
	long long grid = ((long long)rows_bound + (C::BM - 1) * busy) / C::BM;
	CUDA_TRY(cudaFuncSetAttribute(sk_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::BYTES));
	/* all of L1 as shared memory: cp.async.cg bypasses L1, and more CTAs per SM keep more of X in flight */
	CUDA_TRY(cudaFuncSetAttribute(sk_kernel<C>, cudaFuncAttributePreferredSharedMemoryCarveout,
				      cudaSharedmemCarveoutMaxShared));
	tier_launch(sk_kernel<C>, (unsigned)grid, SK_THREADS, C::BYTES, moe_stream(dev), a);
	CUDA_LAUNCHED();
	return 0;
}

/* BM-row tiles, except where the accumulators of two row tiles per warp would not fit (nw RP > 64). */
template <int BM, int RP, int NW, int KN>
static int sk_go(tier_dev *dev, const sk_args<NW> &a, int rows_bound)
{
	if constexpr (BM == 128 && NW * RP > 64)
		return sk_launch<sk_cfg<64, RP, NW, KN>>(dev, a, rows_bound);
	else
		return sk_launch<sk_cfg<BM, RP, NW, KN>>(dev, a, rows_bound);
}

template <int BM, int NW, int KN>
static int sk_by_rank(tier_dev *dev, const sk_args<NW> &a, int rows_bound)
{
	switch ((a.r + 15) / 16) {
	case 1:
		return sk_go<BM, 16, NW, KN>(dev, a, rows_bound);
	case 2:
		return sk_go<BM, 32, NW, KN>(dev, a, rows_bound);
	case 3:
		return sk_go<BM, 48, NW, KN>(dev, a, rows_bound);
	default:
		return sk_go<BM, 64, NW, KN>(dev, a, rows_bound);
	}
}

/* The parameters of NW products and the launch; the arguments have been checked. */
template <int NW>
static int sk_run(tier_dev *dev, int E, int r, int K, const int32_t *d_off, int rows_bound,
		  const void *const *const w[2], int w_kn, const void *x, void *const z[2], float alpha, int bm)
{
	sk_args<NW> a; /* 8 KiB per product */
	for (int j = 0; j < NW; j++) {
		for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++)
			a.w[j][e] = e < E ? (const bf16 *)w[j][e] : NULL;
		a.z[j] = (bf16 *)z[j];
	}
	a.off = d_off, a.x = (const bf16 *)x, a.alpha = alpha, a.E = E, a.r = r, a.K = K;
	if (bm == 128)
		return w_kn ? sk_by_rank<128, NW, 1>(dev, a, rows_bound) : sk_by_rank<128, NW, 0>(dev, a, rows_bound);
	return w_kn ? sk_by_rank<64, NW, 1>(dev, a, rows_bound) : sk_by_rank<64, NW, 0>(dev, a, rows_bound);
}

/* TIER_MOE_SKINNY_ROWS: 64 (the default) or 128. */
static int sk_pick_rows(const char *fn, int *bm)
{
	const char *v = getenv("TIER_MOE_SKINNY_ROWS");
	*bm = 64;
	if (!v || !*v || !strcmp(v, "64"))
		return 0;
	if (!strcmp(v, "128")) {
		*bm = 128;
		return 0;
	}
	return tier_fail(-EINVAL, "%s: TIER_MOE_SKINNY_ROWS=%s; use 64 or 128, or unset it", fn, v);
}

/* The context and the scalar arguments. */
static int sk_check(const char *fn, tier_dev *dev, int E, int r, int K, int rows_bound, int nw, int w_kn, float alpha)
{
	int rc;
	if (dev && tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return tier_fail(-ENOTSUP, "%s: runs on CUDA devices only and the context is %s; open one with "
				 "tier_dev_open(TIER_DEV_CUDA)", fn, tier_dev_name(dev));
	if ((rc = moe_cuda_dev(dev, fn)) || (rc = moe_check_tk(fn, 1, 1, E)))
		return rc;
	if (r < 8 || r > SK_MAX_R || r % 8)
		return tier_fail(-EINVAL, "%s: rank r = %d; it must be a multiple of 8 from 8 to %d; use "
				 "moe_cuda_grouped_mm for other ranks", fn, r, SK_MAX_R);
	if (K < 8 || K % 8)
		return tier_fail(-EINVAL, "%s: K = %d; it must be a positive multiple of 8 (16-byte copies); use the "
				 "per-expert cuBLASLt products (moe_cuda_mm) for other shapes", fn, K);
	if (nw != 1 && nw != 2)
		return tier_fail(-EINVAL, "%s: nw = %d; it must be 1 (Z0 only) or 2 (Z0 and Z1 from one pass)", fn, nw);
	if (w_kn != 0 && w_kn != 1)
		return tier_fail(-EINVAL, "%s: w_kn = %d; it must be 0 (W [r, K]) or 1 (W [K, r])", fn, w_kn);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	if (!isfinite(alpha))
		return tier_fail(-EINVAL, "%s: alpha = %g; pass a finite scale", fn, (double)alpha);
	return 0;
}

extern "C" int moe_cuda_grouped_skinny(tier_dev *dev, int E, int r, int K, const int32_t *d_off, int rows_bound,
				       int nw, const void *const *w0, const void *const *w1, int w_kn, const void *x,
				       void *z0, void *z1, float alpha)
{
	const char *fn = "moe_cuda_grouped_skinny";
	int bm, rc = sk_check(fn, dev, E, r, K, rows_bound, nw, w_kn, alpha);
	if (rc || (rc = moe_check_buf16(fn, "x", x)) || (rc = moe_check_buf16(fn, "z0", z0)) ||
	    (rc = moe_check_table16(fn, "w0", E, w0)))
		return rc;
	if (nw == 2 && ((rc = moe_check_buf16(fn, "z1", z1)) || (rc = moe_check_table16(fn, "w1", E, w1))))
		return rc;
	if (nw == 2 && z0 == z1)
		return tier_fail(-EINVAL, "%s: z0 and z1 are the same buffer; pass one per product", fn);
	MOE_NONNULL(d_off, fn);
	if ((rc = sk_pick_rows(fn, &bm)))
		return rc;
	if (rows_bound == 0)
		return 0; /* no rows: nothing to launch */
	const void *const *const w[2] = { w0, nw == 2 ? w1 : w0 };
	void *const z[2] = { z0, nw == 2 ? z1 : z0 };
	if (nw == 2)
		return sk_run<2>(dev, E, r, K, d_off, rows_bound, w, w_kn, x, z, alpha, bm);
	return sk_run<1>(dev, E, r, K, d_off, rows_bound, w, w_kn, x, z, alpha, bm);
}
