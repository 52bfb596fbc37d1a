/* attn_wgmma.cu - the attention forward on Hopper's warpgroup products (wgmma, sm_90a): the "wg"
 * variant of TIER_ATTN_FWD (attn_cuda.cu's table), head_dim 128 only.
 *
 * Why: the mma.sync forward (fwd2_kernel) brings every K and V fragment through ldmatrix into each
 * warp's registers, so shared memory's bandwidth bounds it at about a third of the H200's dense
 * peak. wgmma reads both operands of S = Q K^T and the V of O = P V straight from shared memory,
 * once per 64-row warpgroup, and TMA fills that memory without the threads.
 *
 * One CTA per (128 query rows, head, sequence): two consumer warpgroups of 64 rows each and one
 * producer warp. The producer loads the CTA's Q once, then walks the key blocks of 128 up to the
 * diagonal through a two-stage ring of (K, V) (mbarriers full[s] and empty[s]). Each consumer
 * warpgroup, per key block: S (64 x 128 fp32) = Q K^T by 8 wgmma m64n128k16 from shared memory;
 * the online softmax on S in registers (ex2; masked only on the diagonal block and the sequence's
 * end); P rounded to bf16 into the A fragments of O += P V, 8 wgmma m64n128k16 with A from
 * registers (the accumulator's layout is the A operand's, as in fwd2_kernel's mma.sync); then the
 * stage goes back to the producer. The end divides by the row sums and stores o (bf16) and lse as
 * fwd2_kernel does. Scores, probabilities and sums round as there; only the order of the
 * products' internal sums differs.
 *
 * TMA reads through 3-D maps (columns, row in the sequence, sequence): rows past a sequence's end
 * arrive as zeros, as fwd2_kernel's loads make them, never the next sequence's.
 *
 * Shared memory (1024-byte aligned for the 128B swizzle that TMA writes and wgmma reads):
 *   Q    [warpgroup 2][d half 2][64 rows][64 d]       32 KiB, K-major A
 *   K_s  [d half 2][128 keys][64 d]                   32 KiB, K-major B of S = Q K^T
 *   V_s  [key half 2][d half 2][64 keys][64 d]        32 KiB, MN-major B of O = P V
 * per stage s of 2: 160 KiB in all, one CTA (9 warps) per SM.
 *
 * The overlapped form (aw_consume_overlapped, TIER_ATTN_FWD=wgo, the default since session 27) also
 * overlaps each warpgroup's softmax with its own products: a loading warpgroup instead of a warp
 * (its registers go to the consumers), three stages (225 KiB), the same bits.
 *
 * Not yet: head_dim other than 128. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "attn/attn_cu.cuh"
#include "attn/attn_impl.h"
#include "base/mma_sm80.cuh"
#include "base/sm90.cuh"
#include "base/tmap_cuda.h"
#include "base/pdl.cuh"

typedef __nv_bfloat16 bf16;

#define AW_D 128          /* head_dim */
#define AW_BQ 128         /* query rows per CTA: two warpgroups of 64 */
#define AW_BK 128         /* keys per block */
#define AW_THREADS 288    /* warps 0-7 consume (warpgroups 0 and 1), warp 8 loads */
/* the overlapped form: a third warpgroup loads (one thread of it), so that setmaxnreg can move its
 * registers to the consumers: 168 a thread at launch (three warps on one of the register file's
 * four quarters), the loaders down to 24, the consumers up to 240 */
#define AW_THREADS_OV 384
#define AW_NS_OV 3 /* its stages */
#define AW_REGS_LOAD 24
#define AW_REGS_CONSUME 240
#define AW_Q_BYTES (2 * 2 * 64 * 128)
#define AW_K_BYTES (2 * AW_BK * 128)
#define AW_V_BYTES (2 * 2 * 64 * 128)
#define AW_STAGE (AW_K_BYTES + AW_V_BYTES)
/* stages: 2, or 3 for the overlapped form (a stage's V is read until the next block's softmax is done) */
#define AW_SMEM_N(ns) (AW_Q_BYTES + (ns) * AW_STAGE + 1024) /* + the alignment's slack */
#define AW_SMEM AW_SMEM_N(2)
static_assert(AW_SMEM_N(AW_NS_OV) + 64 <= 227 * 1024, "the overlapped form's stages and the barriers fit 227 KiB");
#define AW_LN2 0.6931471805599453f

namespace {

struct aw_args {
	bf16 *o;
	float *lse;
	int S, H, KH, G, causal;
	float sl2; /* scale * log2(e) */
};

#ifdef TIER_SM90A
/* The producer (one thread): the CTA's Q, then each key block's K and V into stage kb % 2 once
 * the consumers have released that stage's previous block; seq: the sequence (rows past its end
 * read as zeros). */
template <int NS>
__device__ __forceinline__ void aw_produce(const CUtensorMap *qm, const CUtensorMap *km, const CUtensorMap *vm,
					   uint32_t base, uint32_t bars, int h, int kvh, int seq, int i0, int nkb)
{
	const uint32_t qbar = bars + 16 * NS;
	bar_expect_tx(qbar, AW_Q_BYTES);
	for (int w = 0; w < 2; w++)
		for (int dc = 0; dc < 2; dc++)
			tma_load3(base + (w * 2 + dc) * 8192, qm, h * AW_D + dc * 64, i0 + 64 * w, seq, qbar);
	bar_arrive(qbar);
	for (int kb = 0; kb < nkb; kb++) {
		const int s = kb % NS;
		const uint32_t full = bars + 8 * s, empty = bars + 8 * NS + 8 * s, st = base + AW_Q_BYTES + s * AW_STAGE;
		if (kb >= NS)
			mbar_wait(empty, (kb / NS - 1) & 1);
		bar_expect_tx(full, AW_STAGE);
		const int j0 = kb * AW_BK;
		for (int dc = 0; dc < 2; dc++)
			tma_load3(st + dc * (AW_BK * 128), km, kvh * AW_D + dc * 64, j0, seq, full);
		for (int kh = 0; kh < 2; kh++)
			for (int dc = 0; dc < 2; dc++)
				tma_load3(st + AW_K_BYTES + (kh * 2 + dc) * 8192, vm, kvh * AW_D + dc * 64, j0 + 64 * kh, seq,
					  full);
		bar_arrive(full);
	}
}

/* The online softmax of one key block on this thread's two rows (g and g + 8 of its warp): s holds
 * the raw scores, 16 chunks of 8 keys (element e: row e >> 1, key 8 i + 2 t + (e & 1)), and gets
 * the probabilities; m (raw units) and l the running max and sum; alpha the factor the output
 * takes for the new max (aw_rescale). With MASK key c of the block (c relative to the thread's
 * first key 2 t) is visible iff c < lim[row]. */
template <bool MASK>
__device__ __forceinline__ void aw_probs(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
					 const int (&lim)[2], float sl2)
{
	float mx[2] = { m[0], m[1] }, ms[2];
#pragma unroll
	for (int i = 0; i < 16; i++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			if (MASK && i * 8 + (e & 1) >= lim[e >> 1])
				s[4 * i + e] = -INFINITY;
			mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * i + e]);
		}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		mx[r] = quad_max(mx[r]);
		/* a row with no visible key yet keeps max -inf; 0 keeps exp2 away from inf - inf */
		ms[r] = mx[r] == -INFINITY ? 0.f : mx[r] * sl2;
		alpha[r] = ex2(m[r] * sl2 - ms[r]);
		m[r] = mx[r];
		l[r] *= alpha[r];
	}
#pragma unroll
	for (int i = 0; i < 16; i++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			s[4 * i + e] = ex2(fmaf(s[4 * i + e], sl2, -ms[e >> 1]));
			l[e >> 1] += s[4 * i + e];
		}
}

__device__ __forceinline__ void aw_rescale(float (&o)[64], const float (&alpha)[2])
{
#pragma unroll
	for (int r = 0; r < 2; r++)
#pragma unroll
		for (int i = 0; i < 16; i++)
			o[4 * i + 2 * r] *= alpha[r], o[4 * i + 2 * r + 1] *= alpha[r];
}

/* P rounded to bf16 as the A fragments of O += P V (the accumulator's layout is the A operand's). */
__device__ __forceinline__ void aw_pack(uint32_t (&pa)[AW_BK / 16][4], const float (&s)[64])
{
#pragma unroll
	for (int kt = 0; kt < AW_BK / 16; kt++) {
		pa[kt][0] = pack(s[8 * kt + 0], s[8 * kt + 1]);
		pa[kt][1] = pack(s[8 * kt + 2], s[8 * kt + 3]);
		pa[kt][2] = pack(s[8 * kt + 4], s[8 * kt + 5]);
		pa[kt][3] = pack(s[8 * kt + 6], s[8 * kt + 7]);
	}
}

/* S = Q K^T of the stage st, queued (8 wgmma m64n128k16; the caller fences and commits). */
__device__ __forceinline__ void aw_scores(float (&s)[64], uint32_t q, uint32_t st)
{
#pragma unroll
	for (int kk = 0; kk < AW_D / 16; kk++) /* k + 16 within a 64-d half: 32 bytes = 2 in the start address */
		wgmma_op<0>(s, wg_desc(q + (kk >> 2) * 8192) + 2 * (kk & 3),
			    wg_desc(st + (kk >> 2) * (AW_BK * 128)) + 2 * (kk & 3), kk > 0);
}

/* O += P V of the stage st, queued (8 wgmma m64n128k16, A from registers). */
__device__ __forceinline__ void aw_pv(float (&o)[64], const uint32_t (&pa)[AW_BK / 16][4], uint32_t st)
{
	const uint32_t v = st + AW_K_BYTES;
#pragma unroll
	for (int kt = 0; kt < AW_BK / 16; kt++) /* keys + 16 within a 64-key half: 16 rows = 2048 bytes */
		wgmma_rs<1>(o, pa[kt], wg_desc_mn_at(v + (kt >> 2) * 16384, 8192) + 128 * (kt & 3));
}

/* One key block for one consumer warpgroup: S = Q K^T, softmax, O += P V. q: the warpgroup's Q;
 * st: the stage. */
template <bool MASK>
__device__ __forceinline__ void aw_block(float (&o)[64], float (&m)[2], float (&l)[2], uint32_t q, uint32_t st,
					 const int (&lim)[2], float sl2)
{
	float s[64], alpha[2];
	acc_fence(o);
	wgmma_fence();
	aw_scores(s, q, st);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(s);
	aw_probs<MASK>(s, m, l, alpha, lim, sl2);
	aw_rescale(o, alpha);
	uint32_t pa[AW_BK / 16][4];
	aw_pack(pa, s);
	acc_fence(o); /* the rescaled o and the packed P written before the fence, as PTX requires */
	frag_fence(pa);
	wgmma_fence();
	aw_pv(o, pa, st);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(o);
}

/* Whether key block j0 needs the mask for the warpgroup of rows r0..: it crosses the diagonal or
 * the sequence's end. Then lim: this thread's visible keys of the block (aw_probs). */
__device__ __forceinline__ bool aw_masked(const aw_args &a, int j0, int r0, int row, int t, int (&lim)[2])
{
#pragma unroll
	for (int r = 0; r < 2; r++)
		lim[r] = (a.causal ? min(row + 8 * r + 1, a.S) : a.S) - j0 - 2 * t;
	return (a.causal && j0 + AW_BK - 1 > r0) || j0 + AW_BK > a.S;
}

/* aw_masked's limits, or limits past the block where no mask applies: the softmax of the overlapped
 * form always takes the mask (no branch while a product is in flight). */
__device__ __forceinline__ void aw_limits(const aw_args &a, int j0, int r0, int row, int t, int (&lim)[2])
{
	if (!aw_masked(a, j0, r0, row, t, lim))
		lim[0] = lim[1] = AW_BK;
}

/* The overlapped form (TIER_ATTN_FWD=wgo): block kb's S = Q K^T and block kb - 1's O += P V are
 * queued together, and the softmax of kb runs while the tensor cores finish P V; o takes kb's
 * factor once P V is done. The same operations in the same order as aw_block's, so the same bits.
 * No branch while a product is in flight (ptxas would serialise every wgmma): the first block is
 * peeled, and the softmax always takes the mask, with limits past the block where none applies.
 * A stage is released after its P V, a block later than aw_block releases it: three stages. */
__device__ __forceinline__ void aw_consume_overlapped(const aw_args &a, float (&o)[64], float (&m)[2], float (&l)[2],
						      uint32_t q, uint32_t base, uint32_t bars, int nkb, int r0,
						      int row, int t, int lane)
{
	float s[64], alpha[2];
	uint32_t pa[AW_BK / 16][4];
	int lim[2];
	mbar_wait(bars, 0);
	__syncwarp(); /* converged for the .aligned instructions */
	wgmma_fence();
	aw_scores(s, q, base + AW_Q_BYTES);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(s);
	aw_limits(a, 0, r0, row, t, lim);
	aw_probs<true>(s, m, l, alpha, lim, a.sl2);
	aw_rescale(o, alpha);
	aw_pack(pa, s);
	for (int kb = 1; kb < nkb; kb++) {
		const int st_i = kb % AW_NS_OV, pv_i = (kb + AW_NS_OV - 1) % AW_NS_OV;
		const uint32_t st = base + AW_Q_BYTES + st_i * AW_STAGE;
		aw_limits(a, kb * AW_BK, r0, row, t, lim);
		mbar_wait(bars + 8 * st_i, (kb / AW_NS_OV) & 1);
		__syncwarp();
		acc_fence(o);
		frag_fence(pa);
		wgmma_fence();
		aw_scores(s, q, st);
		wgmma_commit();
		aw_pv(o, pa, base + AW_Q_BYTES + pv_i * AW_STAGE);
		wgmma_commit();
		wgmma_wait<1>(); /* S done; P V may still run */
		acc_fence(s);
		aw_probs<true>(s, m, l, alpha, lim, a.sl2);
		wgmma_wait<0>();
		acc_fence(o);
		aw_rescale(o, alpha);
		aw_pack(pa, s);
		__syncwarp();
		if (lane == 0)
			bar_arrive(bars + 8 * AW_NS_OV + 8 * pv_i); /* block kb - 1's stage is free */
	}
	const int last = (nkb + AW_NS_OV - 1) % AW_NS_OV;
	acc_fence(o);
	frag_fence(pa);
	wgmma_fence();
	aw_pv(o, pa, base + AW_Q_BYTES + last * AW_STAGE);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(o);
	__syncwarp();
	if (lane == 0)
		bar_arrive(bars + 8 * AW_NS_OV + 8 * last);
}

/* The end: o / l in bf16 and lse = (m sl2 + log2 l) ln 2, rows below S. */
__device__ __forceinline__ void aw_store(const aw_args &a, const float (&o)[64], const float (&m)[2],
					 const float (&l)[2], int64_t t0, int row, int h, int t)
{
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const float sum = quad_sum(l[r]), inv = 1.f / sum;
		const int qi = row + 8 * r;
		if (qi >= a.S)
			continue;
		bf16 *dst = a.o + ((t0 + qi) * a.H + h) * AW_D;
#pragma unroll
		for (int i = 0; i < 16; i++)
			*reinterpret_cast<__nv_bfloat162 *>(dst + 8 * i + 2 * t) =
				__floats2bfloat162_rn(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
		if (t == 0)
			a.lse[(t0 + qi) * a.H + h] = (m[r] * a.sl2 + log2f(sum)) * AW_LN2;
	}
}
#endif /* TIER_SM90A */

template <bool OV>
__global__ void __launch_bounds__(OV ? AW_THREADS_OV : AW_THREADS, 1)
	aw_fwd_kernel(const __grid_constant__ CUtensorMap qm, const __grid_constant__ CUtensorMap km,
		      const __grid_constant__ CUtensorMap vm, const aw_args a)
{
	pdl_enter();
#ifdef TIER_SM90A
	constexpr int NS = OV ? AW_NS_OV : 2;
	/* 16-byte alignment declared, 1024 made here (the slack is in AW_SMEM): declared 1024, the
	 * compiler folds the pad away and the alignment rests on the linker's placement */
	extern __shared__ __align__(16) unsigned char smem[];
	__shared__ __align__(8) uint64_t bars[2 * NS + 1]; /* full[NS], empty[NS], Q */
	const uint32_t raw = wg_saddr(smem), base = raw + ((1024u - (raw & 1023u)) & 1023u), b = wg_saddr(bars);
	const int h = blockIdx.x % a.H, kvh = h / a.G, qb = gridDim.y - 1 - blockIdx.y, i0 = qb * AW_BQ;
	const int row0 = (blockIdx.x / a.H) * a.S; /* the sequence's first token */
	const int nkb_all = (a.S + AW_BK - 1) / AW_BK, nkb = a.causal ? min(nkb_all, qb + 1) : nkb_all;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	if (threadIdx.x == 0) {
		for (int s = 0; s < NS; s++) {
			bar_init(b + 8 * s, 1);           /* full: the producer's arrival and the bytes */
			bar_init(b + 8 * NS + 8 * s, 8); /* empty: one arrival per consumer warp */
		}
		bar_init(b + 16 * NS, 1);
		fence_barrier_init();
	}
	__syncthreads();
	if (warp >= 8) {
		if (OV)
			wg_regs_dec<AW_REGS_LOAD>();
		if (warp == 8 && lane == 0)
			aw_produce<NS>(&qm, &km, &vm, base, b, h, kvh, (int)(blockIdx.x / a.H), i0, nkb);
		return;
	}
	if (OV)
		wg_regs_inc<AW_REGS_CONSUME>();
	const int wg = warp >> 2, g = lane >> 2, t = lane & 3;
	const int r0 = i0 + 64 * wg, row = r0 + 16 * (warp & 3) + g; /* this thread's rows: row, row + 8 */
	const uint32_t q = base + wg * 16384;
	float o[64], m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.f, 0.f };
#pragma unroll
	for (int i = 0; i < 64; i++)
		o[i] = 0.f;
	mbar_wait(b + 16 * NS, 0);
	if (OV) {
		aw_consume_overlapped(a, o, m, l, q, base, b, nkb, r0, row, t, lane);
	} else {
		for (int kb = 0; kb < nkb; kb++) {
			const int s = kb & 1, j0 = kb * AW_BK;
			const uint32_t st = base + AW_Q_BYTES + s * AW_STAGE;
			mbar_wait(b + 8 * s, (kb >> 1) & 1);
			__syncwarp(); /* converged for the .aligned instructions */
			/* only the block crossing this warpgroup's diagonal, or the sequence's end, masks */
			int lim[2];
			if (aw_masked(a, j0, r0, row, t, lim))
				aw_block<true>(o, m, l, q, st, lim, a.sl2);
			else
				aw_block<false>(o, m, l, q, st, lim, a.sl2);
			__syncwarp();
			if (lane == 0)
				bar_arrive(b + 16 + 8 * s);
		}
	}
	aw_store(a, o, m, l, (int64_t)row0, row, h, t);
#endif
}

} /* namespace */

extern "C" int attn_wgmma_usable(int head_dim)
{
	int dev = 0, major = 0, minor = 0;
	if (head_dim != AW_D || !base_tmap_ok())
		return 0;
	if (cudaGetDevice(&dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
	    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
		(void)cudaGetLastError();
		return 0;
	}
	return major == 9 && minor == 0; /* the sm_90a code runs on compute capability 9.0 only */
}

extern "C" int attn_wgmma_fwd(const tier_attn_params *p, const void *q, const void *k, const void *v, void *o,
			      float *lse, float sl2, int overlap, void *stream)
{
	if (!attn_wgmma_usable((int)p->head_dim))
		return -ENOTSUP;
	const uint64_t rows = (uint64_t)(p->batch * p->seq);
	if (rows >= (1ull << 31) || p->n_heads * p->batch > INT32_MAX || (p->seq + AW_BQ - 1) / AW_BQ > 65535)
		return -ENOTSUP;
	CUtensorMap qm, km, vm;
	int rc;
	const uint64_t B = (uint64_t)p->batch, S = (uint64_t)p->seq;
	if ((rc = base_tmap_bf16_seq(&qm, q, B, S, (uint64_t)(p->n_heads * AW_D), 64)) ||
	    (rc = base_tmap_bf16_seq(&km, k, B, S, (uint64_t)(p->n_kv_heads * AW_D), AW_BK)) ||
	    (rc = base_tmap_bf16_seq(&vm, v, B, S, (uint64_t)(p->n_kv_heads * AW_D), 64)))
		return rc;
	aw_args a = { (bf16 *)o, lse, (int)p->seq, (int)p->n_heads, (int)p->n_kv_heads,
		      (int)(p->n_heads / p->n_kv_heads), p->causal, sl2 };
	dim3 grid((unsigned)(p->n_heads * p->batch), (unsigned)((p->seq + AW_BQ - 1) / AW_BQ));
	cudaStream_t s = (cudaStream_t)stream;
	void (*kern)(CUtensorMap, CUtensorMap, CUtensorMap, aw_args) = overlap ? aw_fwd_kernel<true> : aw_fwd_kernel<false>;
	const int smem = overlap ? AW_SMEM_N(AW_NS_OV) : AW_SMEM;
	if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
		return tier_fail(-EIO, "attention forward (wgmma): %s", cudaGetErrorString(cudaGetLastError()));
	tier_launch(kern, grid, overlap ? AW_THREADS_OV : AW_THREADS, smem, s, qm, km, vm, a);
	cudaError_t e = cudaGetLastError();
	return e == cudaSuccess ? 0 : tier_fail(-EIO, "attention forward (wgmma): %s", cudaGetErrorString(e));
}
