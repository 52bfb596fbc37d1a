/* moe_wgrad.cu - the experts' LoRA weight gradients: C_e += alpha A_e^T B_e, a reduction over the
 * rows of each expert e (moe_cuda_grouped_wgrad, and _wgrad2 for two products sharing B: the gate's
 * and the up adapter's dA from one pass over X). Both operands are stored [rows, cols]; the host
 * does not know the offsets, so each CTA finds its group's rows on the device. Tensor cores through
 * the sm_80 instructions of base/mma_sm80.cuh. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/mma_sm80.cuh"
#include "base/pdl.cuh"

#define GW_PAD 8 /* bf16 added to each shared row against ldmatrix bank conflicts */

/* ---- grouped_wgrad: C_e += alpha A_e^T B_e, a reduction over each expert's rows ----
 * One CTA per (expert, M tile, N tile) owns its C tile and walks all of its group's rows, so the sum
 * has one order and one add into C: the result is the same bit for bit from run to run. The rows
 * are the k of the product; both operands are stored [rows, cols], so both fragments come by
 * ldmatrix.trans from shared [k][col]. Each of the 4 warps takes its own 16 rows of every 64-row
 * stage and accumulates the whole tile; the 4 partial tiles are summed through shared memory in
 * warp order at the end. The tile fits the rank-r LoRA shapes: 64 x 16 for dB [out, r], 16 x 64 for
 * dA [r, in] (r <= 16: a square tile would compute 4 times what they need), 64 x 64 otherwise. */
#define GW_BK 64       /* rows per pipeline stage: 16 per warp */
#define GW_STAGES 4    /* the groups are read once: stages in flight hide the memory latency */
#define GW_THREADS 128 /* 4 warps */
#define GW_CHUNKS(W) (GW_BK * (W) / 8 / GW_THREADS) /* 16-byte chunks a thread loads of a W-column stage */

/* NW products sharing B: C_j,e += alpha_j A_j,e^T B_e (two: the gate's and the up adapter's dA from
 * one pass over X). */
template <int NW>
struct gw_args {
	float *c[NW][TIER_MOE_MAX_EXPERTS]; /* NULL: that expert's gradient is not wanted */
	const int32_t *off;
	const bf16 *a[NW], *b;
	const int32_t *bmap; /* not NULL: row r of B is row bmap[r] / bdiv of b (a negative entry, zeros) */
	float alpha[NW];
	int M, N, bdiv, rmw; /* rmw: C read, added to and written (TIER_MOE_WGRAD_ADD=rmw) */
};

/* Shared memory: the ring of NW [GW_BK][BM + PAD] A and one [GW_BK][BN + PAD] B stages, reused
 * after the loop for the warps' partial tiles (one float4 per lane and 16 x 8 tile). */
template <int BM, int BN, int NW = 1, int ST = GW_STAGES>
struct gw_smem {
	static constexpr int LDA = BM + GW_PAD, LDB = BN + GW_PAD, MI = BM / 16, NJ = BN / 8;
	static constexpr int A = GW_BK * LDA, B = GW_BK * LDB;
	static constexpr size_t RING = (size_t)ST * (NW * A + B) * sizeof(bf16);
	static constexpr size_t RED = (size_t)GW_THREADS * MI * NJ * sizeof(float4);
	static constexpr size_t BYTES = RING > RED ? RING : RED;
	static_assert(LDA % 8 == 0 && LDB % 8 == 0 && A % 8 == 0, "16-byte shared rows");
};

/* Rows [row0, row0 + GW_BK) of g (row stride ld), columns [col0, col0 + W), into s [GW_BK][W + PAD];
 * rows past rend and columns past ld are zeros, so that they add nothing to the sums. */
template <int W>
__device__ __forceinline__ void gw_load(bf16 *s, const bf16 *g, int ld, int row0, int rend, int col0)
{
	cp_async_tile<GW_BK, W, W + GW_PAD, GW_THREADS>(s, g, ld, row0, rend, col0, ld);
}

/* The same for B's rows through the map: src[i] is the source row of this thread's i-th chunk
 * (gw_rows, fetched two loads ahead), -1 for a zero row. */
template <int W>
__device__ __forceinline__ void gw_load_mapped(bf16 *s, const bf16 *g, int ld, const int (&src)[GW_CHUNKS(W)], int col0)
{
	constexpr int CPR = W / 8;
#pragma unroll
	for (int i = 0; i < GW_CHUNKS(W); i++) {
		int q = threadIdx.x + i * GW_THREADS, r = q / CPR, c = q % CPR * 8, gc = col0 + c;
		bool ok = src[i] >= 0 && gc < ld;
		cp_async16(s + r * (W + GW_PAD) + c, ok ? g + (size_t)src[i] * ld + gc : g, ok);
	}
}

/* The source rows of this thread's chunks of the stage at row0 (gw_load_mapped): the map's entry
 * over div, -1 past rend or where the map has none. */
template <int W>
__device__ __forceinline__ void gw_rows(int (&src)[GW_CHUNKS(W)], const int32_t *map, int div, int row0, int rend)
{
	constexpr int CPR = W / 8;
#pragma unroll
	for (int i = 0; i < GW_CHUNKS(W); i++) {
		int r = row0 + (threadIdx.x + i * GW_THREADS) / CPR, p = r < rend ? __ldg(map + r) : -1;
		src[i] = p >= 0 ? p / div : -1;
	}
}

/* The warp's 16 rows kk.. of one stage: acc[mi][nj] += A[kk.., m tile mi]^T B[kk.., n tile nj]. The
 * A fragment is A^T's 16 x 16 (m, k) block: matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7,
 * k 8-15), (m 8-15, k 8-15), each transposed from the stored [k][m]. */
template <int BM, int BN>
__device__ __forceinline__ void gw_mma(float (*acc)[BN / 8][4], const bf16 *sa, const bf16 *sb, int kk, int lane)
{
	typedef gw_smem<BM, BN> SM;
	uint32_t a[SM::MI][4], b[BN / 16][4];
#pragma unroll
	for (int mi = 0; mi < SM::MI; mi++)
		ldsm4t(a[mi], sa + (kk + (lane & 7) + (lane >> 4) * 8) * SM::LDA + mi * 16 + ((lane >> 3) & 1) * 8);
	/* b[jp][0..1]: columns jp 16 + 0-7, k 0-7 and 8-15; b[jp][2..3]: columns jp 16 + 8-15 */
#pragma unroll
	for (int jp = 0; jp < BN / 16; jp++)
		ldsm4t(b[jp], sb + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * SM::LDB + jp * 16 + (lane >> 4) * 8);
#pragma unroll
	for (int mi = 0; mi < SM::MI; mi++)
#pragma unroll
		for (int nj = 0; nj < SM::NJ; nj++)
			mma16816(acc[mi][nj], a[mi], &b[nj >> 1][(nj & 1) * 2]);
}

/* C += alpha (x, y) as one atomic add of the pair (sm_90): the epilogue does not wait for a read of
 * C. The CTA owns its tile, so each element gets one add and its bits do not depend on timing.
 * rmw: read, add and write instead (the form before, for comparisons). */
__device__ __forceinline__ void gw_add2(float *p, float x, float y, float alpha, int rmw)
{
	if (rmw)
		put2(p, x, y, alpha, 1);
	else
		atomicAdd(reinterpret_cast<float2 *>(p), make_float2(alpha * x, alpha * y));
}

/* TIER_MOE_WGRAD_ADD=rmw: the epilogue's read-modify-write of C (comparisons); else the atomic add. */
static int gw_rmw(void) { return moe_env_is("TIER_MOE_WGRAD_ADD", "rmw"); }

/* C += alpha s at one entry of a 16 x 8 tile: rows m (s.x, s.y) and m + 8 (s.z, s.w), columns n and
 * n + 1, those inside C. */
template <int NW>
__device__ __forceinline__ void gw_add_entry(float *C, const gw_args<NW> &a, float alpha, int m, int n, float4 s)
{
	if (n >= a.N) /* N % 8 == 0: n + 1 < N too */
		return;
	if (m < a.M)
		gw_add2(C + (size_t)m * a.N + n, s.x, s.y, alpha, a.rmw);
	if (m + 8 < a.M) /* M % 16 may be 8 */
		gw_add2(C + (size_t)(m + 8) * a.N + n, s.z, s.w, alpha, a.rmw);
}

/* The 4 partial tiles summed in warp order, then C += alpha sum. Entry q of a warp's part is lane
 * q % 32 of 16 x 8 tile q / 32: rows g, g + 8 (g = lane / 4), columns 2 (lane % 4) and the next.
 * The caller has synchronised after the ring's last read (red overlays it). */
template <int BM, int BN, int NW>
__device__ __forceinline__ void gw_store(float (*acc)[BN / 8][4], float4 *red, const gw_args<NW> &a, float alpha,
					 float *C, int m0, int n0, int warp, int lane)
{
	typedef gw_smem<BM, BN> SM;
	constexpr int PART = SM::MI * SM::NJ * 32; /* float4 per warp */
#pragma unroll
	for (int mi = 0; mi < SM::MI; mi++)
#pragma unroll
		for (int nj = 0; nj < SM::NJ; nj++)
			red[warp * PART + (mi * SM::NJ + nj) * 32 + lane] =
				make_float4(acc[mi][nj][0], acc[mi][nj][1], acc[mi][nj][2], acc[mi][nj][3]);
	__syncthreads();
	for (int q = threadIdx.x; q < PART; q += GW_THREADS) {
		float4 s = red[q];
#pragma unroll
		for (int w = 1; w < GW_THREADS / 32; w++) {
			float4 v = red[w * PART + q];
			s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
		}
		int t = q >> 5, l = q & 31;
		gw_add_entry(C, a, alpha, m0 + t / SM::NJ * 16 + (l >> 2), n0 + t % SM::NJ * 8 + (l & 3) * 2, s);
	}
}

/* The ring as in gg_kernel: before stage kt the groups of stages 0..kt are complete, and the barrier
 * also frees slot (kt - 1) % STAGES for the prefetch of stage kt + STAGES - 1. With NW = 2 each
 * stage of B serves both products; each accumulates exactly as alone (the same tiles, the same
 * order), so each result is the one-product kernel's bit for bit. */
template <int BM, int BN, int NW>
__global__ void __launch_bounds__(GW_THREADS) gw_kernel(const __grid_constant__ gw_args<NW> a)
{
	pdl_enter();
	constexpr int ST = GW_STAGES;
	typedef gw_smem<BM, BN, NW, ST> SM;
	constexpr int AMI = SM::MI, ANJ = SM::NJ;
	extern __shared__ __align__(16) unsigned char smem[];
	int e = blockIdx.z, row0 = a.off[e], rend = a.off[e + 1];
	bool want = false;
#pragma unroll
	for (int j = 0; j < NW; j++)
		want |= a.c[j][e] != NULL;
	if (!want || rend <= row0)
		return; /* not wanted, or no rows: C_e stays as it is */
	int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	bf16 *sa = (bf16 *)smem, *sb = sa + ST * NW * SM::A; /* stage s of product j: sa + (s NW + j) A */
	float acc[NW][AMI][ANJ][4];
#pragma unroll
	for (int j = 0; j < NW; j++)
#pragma unroll
		for (int mi = 0; mi < AMI; mi++)
#pragma unroll
			for (int nj = 0; nj < ANJ; nj++)
#pragma unroll
				for (int i = 0; i < 4; i++)
					acc[j][mi][nj][i] = 0.0f;
	int nk = (rend - row0 + GW_BK - 1) / GW_BK;
	/* with a map, the source rows of a stage are fetched two loads before it is loaded (src: the
	 * next load's, src2: the one after), so that the map's latency stays out of the ring's issue */
	int src[GW_CHUNKS(BN)], src2[GW_CHUNKS(BN)];
	if (a.bmap) {
		gw_rows<BN>(src, a.bmap, a.bdiv, row0, rend);
		gw_rows<BN>(src2, a.bmap, a.bdiv, row0 + GW_BK, rend);
	}
	auto load = [&](int kt) {
		int s = kt % ST, r = row0 + kt * GW_BK;
#pragma unroll
		for (int j = 0; j < NW; j++)
			gw_load<BM>(sa + (s * NW + j) * SM::A, a.a[j], a.M, r, rend, m0);
		if (!a.bmap) {
			gw_load<BN>(sb + s * SM::B, a.b, a.N, r, rend, n0);
			return;
		}
		gw_load_mapped<BN>(sb + s * SM::B, a.b, a.N, src, n0);
#pragma unroll
		for (int i = 0; i < GW_CHUNKS(BN); i++)
			src[i] = src2[i];
		gw_rows<BN>(src2, a.bmap, a.bdiv, r + 2 * GW_BK, rend);
	};
	cp_async_ring<ST>(nk, load, [&](int s, int kt) {
		if (row0 + kt * GW_BK + warp * 16 < rend) { /* a slice wholly past the group is zeros */
#pragma unroll
			for (int j = 0; j < NW; j++)
				gw_mma<BM, BN>(acc[j], sa + (s * NW + j) * SM::A, sb + s * SM::B, warp * 16, lane);
		}
	});
	cp_async_wait<0>();
#pragma unroll
	for (int j = 0; j < NW; j++) {
		__syncthreads(); /* every warp is done with the ring (or the last product's sums) that red overlays */
		if (a.c[j][e])
			gw_store<BM, BN, NW>(acc[j], (float4 *)smem, a, a.alpha[j], a.c[j][e], m0, n0, warp, lane);
	}
}

template <int BM, int BN, int NW>
static int gw_launch(tier_dev *dev, const gw_args<NW> &a, int E)
{
	typedef gw_smem<BM, BN, NW> SM;
	dim3 grid((unsigned)((a.N + BN - 1) / BN), (unsigned)((a.M + BM - 1) / BM), (unsigned)E);
	CUDA_TRY(cudaFuncSetAttribute(gw_kernel<BM, BN, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)SM::BYTES));
	tier_launch(gw_kernel<BM, BN, NW>, grid, GW_THREADS, SM::BYTES, moe_stream(dev), a);
	CUDA_LAUNCHED();
	return 0;
}

/* c[e] for e < E into the table (each 16-byte aligned or NULL); how many are not NULL in *n. */
static int gw_table(const char *fn, int E, float *const *c, float **tab, int *n)
{
	MOE_NONNULL(c, fn);
	*n = 0;
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++) {
		tab[e] = e < E ? c[e] : NULL;
		if ((uintptr_t)tab[e] % 16)
			return tier_fail(-EINVAL, "%s: c[%d] is not 16-byte aligned; pass aligned gradients", fn, e);
		*n += tab[e] != NULL;
	}
	return 0;
}

static int gw_check(const char *fn, tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
		    const void *a, const void *b, float alpha)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "M", M)) || (rc = moe_check_dim(fn, "N", N)))
		return rc;
	MOE_NONNULL(d_off, fn);
	MOE_NONNULL(a, fn);
	MOE_NONNULL(b, fn);
	if (M % 8 || N % 8)
		return tier_fail(-EINVAL, "%s: M = %d and N = %d must be multiples of 8 (16-byte loads); use the "
				 "per-expert cuBLASLt products (moe_cuda_mm) for other shapes", fn, M, N);
	if ((uintptr_t)a % 16 || (uintptr_t)b % 16)
		return tier_fail(-EINVAL, "%s: %s is not 16-byte aligned; pass an aligned buffer", fn,
				 (uintptr_t)a % 16 ? "a" : "b");
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	if (!isfinite(alpha))
		return tier_fail(-EINVAL, "%s: alpha = %g; pass a finite scale", fn, (double)alpha);
	return 0;
}

/* The C tile: TIER_MOE_WGRAD_TILE=MxN (one of gw_tiles) for measurements, else the rule: 64 x 16
 * for dB [out, r], 16 x 64 for dA [r, in] (and for every pair, whose two accumulators must fit the
 * registers), 64 x 64 otherwise. *bm = 0 asks for the rule; a malformed value is -EINVAL. */
static const int gw_tiles[][2] = { { 64, 16 }, { 128, 16 }, { 16, 64 }, { 16, 128 }, { 64, 64 } };

static int gw_tile(const char *fn, int *bm, int *bn)
{
	const char *v = getenv("TIER_MOE_WGRAD_TILE");
	*bm = *bn = 0;
	if (!v || !*v || !strcmp(v, "auto"))
		return 0;
	for (size_t i = 0; i < sizeof gw_tiles / sizeof gw_tiles[0]; i++) {
		char name[16];
		snprintf(name, sizeof name, "%dx%d", gw_tiles[i][0], gw_tiles[i][1]);
		if (!strcmp(v, name)) {
			*bm = gw_tiles[i][0], *bn = gw_tiles[i][1];
			return 0;
		}
	}
	return tier_fail(-EINVAL, "%s: TIER_MOE_WGRAD_TILE=%s; use auto, 64x16, 128x16, 16x64, 16x128 or 64x64, or "
			 "unset it", fn, v);
}

template <int NW>
static int gw_run(tier_dev *dev, gw_args<NW> &g, int E, int bm, int bn)
{
	if (!bm)
		bm = g.N <= 16 ? 64 : NW > 1 || g.M <= 16 ? 16 : 64, bn = g.N <= 16 ? 16 : 64;
	if (bm == 64 && bn == 16)
		return gw_launch<64, 16, NW>(dev, g, E);
	if (bm == 128)
		return gw_launch<128, 16, NW>(dev, g, E);
	if (bm == 16)
		return bn == 64 ? gw_launch<16, 64, NW>(dev, g, E) : gw_launch<16, 128, NW>(dev, g, E);
	if constexpr (NW == 1) /* moe_cuda_grouped_wgrad2 sends 64 x 64 one product at a time */
		return gw_launch<64, 64, NW>(dev, g, E);
	return tier_fail(-EINVAL, "gw_run: a %d x %d tile for %d products", bm, bn, NW);
}

/* The checks of a gathered B: the map and its divisor. */
static int gw_map_check(const char *fn, const int32_t *b_rows, int b_div)
{
	if (b_rows && b_div < 1)
		return tier_fail(-EINVAL, "%s: b_div = %d; pass the top-k (>= 1) that row_pair's entries divide by", fn, b_div);
	return 0;
}

static int wgrad1(const char *fn, tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
		  const void *a, const void *b, const int32_t *b_rows, int b_div, float alpha, float *const *c)
{
	gw_args<1> g; /* 8 KiB */
	int wanted, bm, bn, rc = gw_check(fn, dev, E, M, N, d_off, rows_bound, a, b, alpha);
	if (rc || (rc = gw_map_check(fn, b_rows, b_div)) || (rc = gw_tile(fn, &bm, &bn)) ||
	    (rc = gw_table(fn, E, c, g.c[0], &wanted)))
		return rc;
	if (rows_bound == 0 || wanted == 0 || alpha == 0.0f)
		return 0; /* nothing to add */
	g.off = d_off, g.a[0] = (const bf16 *)a, g.b = (const bf16 *)b, g.alpha[0] = alpha, g.M = M, g.N = N;
	g.bmap = b_rows, g.bdiv = b_div, g.rmw = gw_rmw();
	return gw_run<1>(dev, g, E, bm, bn);
}

static int wgrad2(const char *fn, tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
		  const void *a0, const void *a1, const void *b, const int32_t *b_rows, int b_div, float alpha0,
		  float alpha1, float *const *c0, float *const *c1)
{
	gw_args<2> g; /* 16 KiB */
	int w0, w1, bm, bn, rc = gw_check(fn, dev, E, M, N, d_off, rows_bound, a0, b, alpha0);
	if (rc || (rc = gw_check(fn, dev, E, M, N, d_off, rows_bound, a1, b, alpha1)) ||
	    (rc = gw_map_check(fn, b_rows, b_div)) || (rc = gw_tile(fn, &bm, &bn)) ||
	    (rc = gw_table(fn, E, c0, g.c[0], &w0)) || (rc = gw_table(fn, E, c1, g.c[1], &w1)))
		return rc;
	if (alpha0 == 0.0f) /* nothing to add to that one: its table emptied */
		w0 = 0, memset(g.c[0], 0, sizeof g.c[0]);
	if (alpha1 == 0.0f)
		w1 = 0, memset(g.c[1], 0, sizeof g.c[1]);
	if (rows_bound == 0 || w0 + w1 == 0)
		return 0;
	/* two 64 x 64 accumulators would not fit the registers: one at a time */
	if ((M > 16 && N > 16) || (bm == 64 && bn == 64)) {
		rc = wgrad1(fn, dev, E, M, N, d_off, rows_bound, a0, b, b_rows, b_div, alpha0, c0);
		return rc ? rc : wgrad1(fn, dev, E, M, N, d_off, rows_bound, a1, b, b_rows, b_div, alpha1, c1);
	}
	g.off = d_off, g.a[0] = (const bf16 *)a0, g.a[1] = (const bf16 *)a1, g.b = (const bf16 *)b;
	g.bmap = b_rows, g.bdiv = b_div, g.rmw = gw_rmw();
	g.alpha[0] = alpha0, g.alpha[1] = alpha1, g.M = M, g.N = N;
	return gw_run<2>(dev, g, E, bm, bn);
}

extern "C" int moe_cuda_grouped_wgrad(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
				      const void *a, const void *b, float alpha, float *const *c)
{
	return wgrad1("moe_cuda_grouped_wgrad", dev, E, M, N, d_off, rows_bound, a, b, NULL, 0, alpha, c);
}

extern "C" int moe_cuda_grouped_wgrad_rows(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
					   const void *a, const void *b, const int32_t *b_rows, int b_div, float alpha,
					   float *const *c)
{
	const char *fn = "moe_cuda_grouped_wgrad_rows";
	MOE_NONNULL(b_rows, fn);
	return wgrad1(fn, dev, E, M, N, d_off, rows_bound, a, b, b_rows, b_div, alpha, c);
}

extern "C" int moe_cuda_grouped_wgrad2(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
				       const void *a0, const void *a1, const void *b, float alpha0, float alpha1,
				       float *const *c0, float *const *c1)
{
	return wgrad2("moe_cuda_grouped_wgrad2", dev, E, M, N, d_off, rows_bound, a0, a1, b, NULL, 0, alpha0, alpha1, c0,
		      c1);
}

extern "C" int moe_cuda_grouped_wgrad2_rows(tier_dev *dev, int E, int M, int N, const int32_t *d_off, int rows_bound,
					    const void *a0, const void *a1, const void *b, const int32_t *b_rows,
					    int b_div, float alpha0, float alpha1, float *const *c0, float *const *c1)
{
	const char *fn = "moe_cuda_grouped_wgrad2_rows";
	MOE_NONNULL(b_rows, fn);
	return wgrad2(fn, dev, E, M, N, d_off, rows_bound, a0, a1, b, b_rows, b_div, alpha0, alpha1, c0, c1);
}
