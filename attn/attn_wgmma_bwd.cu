/* attn_wgmma_bwd.cu - the attention backward on wgmma (sm_90a): the "wg" variant of TIER_ATTN_BWD
 * (attn_cuda.cu's table), head_dim 128 only. The math and its rounding points are bwd2_kernel's
 * (attn_cuda.cu): P^T from lse, dS^T = P^T (dP^T - D) with D = rowsum(dO o) (the caller's
 * rowdot_kernel), dV += P^T dO, dK += dS^T Q, dQ += scale dS K added to fp32 dq with atomics.
 *
 * One CTA per (128 keys, query head, sequence): two warpgroups of 64 keys each. Warp 0 also loads:
 * the CTA's K and V once, then each 64-query step's Q and dO by TMA and its lse and D by cp.async
 * into a three-stage ring, two steps ahead (a loading warp of its own would leave each thread 168
 * registers: 9 warps put 3 on one of the SM's four quarters of the register file). Each
 * warpgroup, per step:
 *   S^T = K_w Q^T and dP^T = V_w dO^T (64 keys x 64 queries): 8 + 8 wgmma m64n64k16, K, V, Q and
 *     dO all K-major from shared memory;
 *   P^T and dS^T in registers (the step's lse and D from the stage);
 *   dV += P^T dO and dK += dS^T Q: 4 + 4 wgmma m64n128k16, P^T and dS^T as the register A operand,
 *     dO and Q MN-major from the same stage;
 *   dS^T written transposed into shared memory as dS [64 queries][128 keys] (this warpgroup's 64-key
 *     half, in the 128B swizzle, by stmatrix .trans from the dK product's fragments), a CTA barrier, then
 *   dQ [64 x 64] (this warpgroup's half of head_dim) = dS K_half: 8 wgmma m64n64k16, dS K-major and
 *     K MN-major from shared memory (the K tile serves both ways), added to dq with atomics
 *     (TIER_ATTN_BWD_DQ=tma: staged in shared memory, added by two TMA reductions).
 * One CTA barrier per step orders everything shared: dS is double-buffered (a warpgroup writes step
 * n + 1's buffer after both passed step n's barrier, which each reaches after its step n - 1
 * products), and step n + 2's loads go into step n - 1's stage right after step n's barrier.
 * With the causal mask a warpgroup whose 64 keys all follow the step's queries computes nothing but
 * still writes its (zero) half of dS. TMA reads through 3-D maps, so rows past the sequence's end
 * are zeros (as bwd2_kernel's loads make them), and masked pairs get 0 outright.
 *
 * Shared memory (1024-byte aligned): K, V [d half 2][128 keys][64 d] 32 KiB each; three stages of
 * Q, dO [d half 2][64 queries][64 d] 32 KiB; dS [2][key half 2][64 queries][64 keys] 32 KiB; with
 * TMA dQ its staging [warpgroup 2][d box 2][64 queries][32 fp32] 32 KiB; the stages' lse and D, 512
 * bytes each: 193.5 KiB, 225.5 with the staging, one CTA per SM. Registers: 242 a thread (ptxas,
 * no spills): dK and dV accumulators (64 + 64) and S^T and dP^T (32 + 32). The dK and dV products
 * are waited for before dQ's: with their register A operands still live beside dQ's accumulator,
 * ptxas serialised every wgmma of the kernel for want of registers.
 *
 * Written without a GPU (2026-12-05): opt in until tests/test_attn_cuda (every head-dim-128 case
 * runs it) and tier-bench attn have run on one. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn_cu.cuh"
#include "attn/attn_impl.h"
#include "base/mma_sm80.cuh"
#include "base/sm90.cuh"
#include "base/tmap_cuda.h"
#include "base/pdl.cuh"

typedef __nv_bfloat16 bf16;

#define AB_D 128          /* head_dim */
#define AB_BC 128         /* keys per CTA: two warpgroups of 64 */
#define AB_BR 64          /* queries per step */
#define AB_THREADS 256    /* two warpgroups; warp 0 also loads */
#define AB_STAGES 3
#define AB_KV_BYTES (2 * AB_BC * 128)              /* K or V: 32 KiB */
#define AB_STAGE (2 * 2 * AB_BR * 128)             /* Q then dO: 32 KiB */
#define AB_DS_BYTES (2 * AB_BR * 128)              /* one dS buffer: 16 KiB */
#define AB_STAGE_AT (2 * AB_KV_BYTES)
#define AB_DS_AT (AB_STAGE_AT + AB_STAGES * AB_STAGE)
#define AB_DQ_AT (AB_DS_AT + 2 * AB_DS_BYTES)      /* dQ by TMA: per warpgroup [d box 2][64 queries][32 fp32] */
#define AB_DQ_BYTES (2 * AB_BR * 128)              /* one warpgroup's: 16 KiB */
/* per stage: lse [64], then D [64]; after the staging with TMA dQ, in its place without (ab_args.ld_at) */
#define AB_LD_BYTES (2 * AB_BR * 4)
#define AB_LD_AT_TMA (AB_DQ_AT + 2 * AB_DQ_BYTES)
#define AB_SMEM (AB_LD_AT_TMA + AB_STAGES * AB_LD_BYTES + 1024) /* + the alignment's slack */
#define AB_SMEM_NO_DQ (AB_DQ_AT + AB_STAGES * AB_LD_BYTES + 1024)
static_assert(AB_DQ_AT % 1024 == 0, "the staging in the 128B swizzle's 1024-byte rows");
static_assert(AB_SMEM + 64 <= 227 * 1024, "one CTA an SM: the dynamic and static shared memory fit 227 KiB");
#define AB_LOG2E 1.4426950408889634f
/* The forms where TIER_ATTN_BWD_DS and TIER_ATTN_BWD_DQ are unset: dS by stmatrix and dQ by TMA
 * reductions (session 22, first run in session 23 on an H100: tests/test_attn_cuda and
 * test_golden_cuda passed under both; tier-bench attn's backward 964 -> 847 us, the trainer's (a)
 * +3.8% with TIER_LORA_FIRST; bench/RESULTS.md) */
#define AB_DS_STM_DEFAULT 1
#define AB_DQ_TMA_DEFAULT 1

namespace {

struct ab_args {
	const float *lse, *Di;
	float *dq, *dk, *dv;
	int S, H, KH, G, causal, atomic_kv;
	float scale, sl2;
	int no_dq;  /* TIER_ATTN_BWD_DEBUG=nodq: dQ's product runs, its atomics do not (measurement only) */
	int dq_tma; /* TIER_ATTN_BWD_DQ=tma: dQ added by TMA reductions from shared memory */
	int ds_stm; /* TIER_ATTN_BWD_DS: dS stored by stmatrix (stm) or one element at a time (scalar) */
	uint32_t ld_at; /* where the lse and D stages start: AB_LD_AT_TMA, or AB_DQ_AT without TMA dQ */
};

#ifdef TIER_SM90A
/* 4 bytes global -> shared by cp.async; !valid writes a zero and reads nothing. */
__device__ __forceinline__ void ab_cp4(uint32_t sm, const float *gm, bool valid)
{
	asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sm), "l"(gm), "r"(valid ? 4 : 0) : "memory");
}

/* Warp 0: K and V of sequence seq (on bars + 8 AB_STAGES; lane 0; keys past its end read as zeros). */
__device__ __forceinline__ void ab_load_kv(const CUtensorMap *km, const CUtensorMap *vm, uint32_t base, uint32_t kvbar,
					   int kvh, int seq, int j0)
{
	bar_expect_tx(kvbar, 2 * AB_KV_BYTES);
	for (int dc = 0; dc < 2; dc++) {
		tma_load3(base + dc * (AB_BC * 128), km, kvh * AB_D + dc * 64, j0, seq, kvbar);
		tma_load3(base + AB_KV_BYTES + dc * (AB_BC * 128), vm, kvh * AB_D + dc * 64, j0, seq, kvbar);
	}
	bar_arrive(kvbar);
}

/* Warp 0: step n's Q and dO (lane 0, TMA) and lse and D (every lane, cp.async; 0 past the end) into
 * stage n % AB_STAGES, whose full barrier takes lane 0's arrival and the bytes, and each lane's
 * arrival once its copies have landed (33). The caller knows the stage free. */
__device__ __forceinline__ void ab_load_step(const ab_args &a, const CUtensorMap *qm, const CUtensorMap *om,
					     uint32_t base, uint32_t bars, int h, int row0, int ibeg, int n, int lane)
{
	const int s = n % AB_STAGES, i0 = ibeg + n * AB_BR;
	const uint32_t full = bars + 8 * s, st = base + AB_STAGE_AT + s * AB_STAGE, ld = base + a.ld_at + s * AB_LD_BYTES;
	if (lane == 0) {
		bar_expect_tx(full, AB_STAGE);
		for (int dc = 0; dc < 2; dc++) {
			tma_load3(st + dc * 8192, qm, h * AB_D + dc * 64, i0, row0 / a.S, full);
			tma_load3(st + 16384 + dc * 8192, om, h * AB_D + dc * 64, i0, row0 / a.S, full);
		}
		bar_arrive(full);
	}
	for (int j = lane; j < 2 * AB_BR; j += 32) {
		const int q = i0 + (j & (AB_BR - 1));
		const bool ok = q < a.S;
		const int64_t at = ok ? ((int64_t)row0 + q) * a.H + h : 0;
		ab_cp4(ld + 4 * j, (j < AB_BR ? a.lse : a.Di) + at, ok);
	}
	bar_arrive_copies(full);
}

/* P^T and dS^T in place on one step's 64 keys x 64 queries of this thread: st the raw scores, dp
 * dP^T; element e of chunk i: key row e >> 1, query 8 i + 2 t + (e & 1) of the step (its lse in base
 * 2 and D at ld). With MASK the pair is visible iff lo[row] <= c < hi, c = 8 i + (e & 1) (relative
 * to the thread's first query, as in bwd2_probs: query >= key under the causal mask, query and key
 * below S). */
template <bool MASK>
__device__ __forceinline__ void ab_probs(float (&st)[32], float (&dp)[32], uint32_t ld, int t, const int (&lo)[2],
					 int hi, float sl2)
{
#pragma unroll
	for (int i = 0; i < 8; i++) {
		float l2[2], dd[2];
		asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(l2[0]), "=f"(l2[1]) : "r"(ld + 4 * (8 * i + 2 * t)));
		l2[0] *= AB_LOG2E, l2[1] *= AB_LOG2E;
		asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
			     : "=f"(dd[0]), "=f"(dd[1])
			     : "r"(ld + 4 * (AB_BR + 8 * i + 2 * t)));
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int c = i * 8 + (e & 1);
			const bool vis = !MASK || (c >= lo[e >> 1] && c < hi);
			const float p = vis ? ex2(fmaf(st[4 * i + e], sl2, -l2[e & 1])) : 0.f;
			st[4 * i + e] = p;
			/* masked: 0 outright (0 (dp - D) would be NaN for a non-finite dp) */
			dp[4 * i + e] = vis ? p * (dp[4 * i + e] - dd[e & 1]) : 0.f;
		}
	}
}

/* dS^T of this thread (rows: keys 16 wi + g, + 8 of the warpgroup's 64; columns: queries) into
 * dS [query][key] of this warpgroup's key half at ds (64 rows of 128 bytes, 128B swizzle: the
 * 16-byte chunk c of row r sits at chunk c ^ (r & 7)), one 2-byte store at a time: the form before
 * ab_store_ds_stm (the default since session 23), kept as TIER_ATTN_BWD_DS=scalar. */
__device__ __forceinline__ void ab_store_ds_scalar(uint32_t ds, const float (&v)[32], int wi, int g, int t)
{
#pragma unroll
	for (int i = 0; i < 8; i++)
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int q = 8 * i + 2 * t + (e & 1), key = 16 * wi + g + 8 * (e >> 1);
			const uint32_t at = ds + q * 128 + ((((key >> 3) ^ (q & 7)) << 4) | ((key & 7) << 1));
			const bf16 x = __float2bfloat16_rn(v[4 * i + e]);
			asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(at), "h"(*reinterpret_cast<const unsigned short *>(&x))
				     : "memory");
		}
}

/* dS^T of this thread as the dK product's packed fragments (ab_frags) into dS [query][key] of this
 * warpgroup's key half at ds (64 rows of 128 bytes, 128B swizzle: the 16-byte chunk c of row r sits
 * at chunk c ^ (r & 7)), by stmatrix .trans: fragment kt's register j is this thread's pair of the
 * 8 x 8 block (keys 16 wi + 8 (j & 1).. as rows, queries 16 kt + 8 (j >> 1).. as columns), stored
 * transposed, so that each query row gets the block's 8 keys as one 16-byte chunk; lane l names
 * the address of row l & 7 of block l >> 3. The rounding is ab_frags': bf16 of each value. */
__device__ __forceinline__ void ab_store_ds_stm(uint32_t ds, const uint32_t (&f)[4][4], int wi, int lane)
{
	const int j = lane >> 3, rr = lane & 7;
#pragma unroll
	for (int kt = 0; kt < 4; kt++) {
		const int q = 16 * kt + 8 * (j >> 1) + rr;
		const uint32_t at = ds + q * 128 + (((2 * wi + (j & 1)) ^ rr) << 4);
		stsm4t(at, f[kt][0], f[kt][1], f[kt][2], f[kt][3]);
	}
}

/* The four k-steps (16 queries each) of a 64 x 64 accumulator as register A fragments. */
__device__ __forceinline__ void ab_frags(uint32_t (&f)[4][4], const float (&v)[32])
{
#pragma unroll
	for (int kt = 0; kt < 4; kt++) {
		f[kt][0] = pack(v[8 * kt + 0], v[8 * kt + 1]);
		f[kt][1] = pack(v[8 * kt + 2], v[8 * kt + 3]);
		f[kt][2] = pack(v[8 * kt + 4], v[8 * kt + 5]);
		f[kt][3] = pack(v[8 * kt + 6], v[8 * kt + 7]);
	}
}

/* One step of one warpgroup (its keys kw0.., the step's queries i0..): S^T, dP^T, the
 * probabilities, dV and dK, and dS^T into ds_half. */
template <bool MASK>
__device__ __forceinline__ void ab_step(float (&dk)[64], float (&dv)[64], const ab_args &a, uint32_t kw, uint32_t vw,
					uint32_t st, uint32_t ld, uint32_t ds_half, int kr0, int i0, int wi, int g, int t)
{
	float s[32], dp[32];
	wgmma_fence();
#pragma unroll
	for (int kk = 0; kk < AB_D / 16; kk++) /* k + 16 within a 64-d half: 2 in the start address */
		wgmma_op<0>(s, wg_desc(kw + (kk >> 2) * (AB_BC * 128)) + 2 * (kk & 3),
			    wg_desc(st + (kk >> 2) * 8192) + 2 * (kk & 3), kk > 0);
#pragma unroll
	for (int kk = 0; kk < AB_D / 16; kk++)
		wgmma_op<0>(dp, wg_desc(vw + (kk >> 2) * (AB_BC * 128)) + 2 * (kk & 3),
			    wg_desc(st + 16384 + (kk >> 2) * 8192) + 2 * (kk & 3), kk > 0);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(s);
	acc_fence(dp);
	if (MASK) {
		const int big = 1 << 30, k0 = kr0 + g, k1 = k0 + 8;
		const int lo[2] = { k0 < a.S ? (a.causal ? k0 - i0 - 2 * t : -big) : big,
				    k1 < a.S ? (a.causal ? k1 - i0 - 2 * t : -big) : big };
		ab_probs<true>(s, dp, ld, t, lo, a.S - i0 - 2 * t, a.sl2);
	} else {
		const int lo[2] = { 0, 0 };
		ab_probs<false>(s, dp, ld, t, lo, 0, a.sl2);
	}
	uint32_t pf[4][4], df[4][4];
	if (!a.ds_stm)
		ab_store_ds_scalar(ds_half, dp, wi, g, t);
	ab_frags(df, dp);
	if (a.ds_stm)
		ab_store_ds_stm(ds_half, df, wi, 4 * g + t);
	ab_frags(pf, s);
	acc_fence(dv);
	acc_fence(dk);
	frag_fence(pf); /* the packed P^T and dS^T written before the fence, as PTX requires */
	frag_fence(df);
	wgmma_fence();
#pragma unroll
	for (int kt = 0; kt < AB_BR / 16; kt++) /* queries + 16: 16 rows = 2048 bytes = 128 */
		wgmma_rs<1>(dv, pf[kt], wg_desc_mn_at(st + 16384, 8192) + 128 * kt);
#pragma unroll
	for (int kt = 0; kt < AB_BR / 16; kt++)
		wgmma_rs<1>(dk, df[kt], wg_desc_mn_at(st, 8192) + 128 * kt);
	wgmma_commit();
	/* done before dQ: its accumulator beside the fragments still read would not fit the registers */
	wgmma_wait<0>();
	acc_fence(dk);
	acc_fence(dv);
}

/* Warpgroup w's 128 threads meet (named barriers 1 and 2; __syncthreads is 0). The ids are
 * immediates: from a register ptxas reserves all 16 barriers. */
__device__ __forceinline__ void ab_wg_bar(int w)
{
	if (w)
		asm volatile("bar.sync 2, 128;\n" ::: "memory");
	else
		asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

/* This warpgroup's dQ (times the scale) into its staging at dqs, [d box 2][64 queries][32 fp32] in
 * the 128B swizzle (16-byte chunk c of row r at c ^ (r & 7)), and one thread adds it to dq by two TMA
 * reductions. The staging is free again once the previous step's reductions have read it (their
 * thread waits, then the warpgroup's named barrier). */
__device__ __forceinline__ void ab_dq_tma(const CUtensorMap *dqm, const float (&acc)[32], float scale, uint32_t dqs,
					  int seq, int h, int i0, int w, int wi, int g, int t)
{
	const bool issuer = wi == 0 && (threadIdx.x & 31) == 0;
	if (issuer)
		tma_reduce_wait_read();
	ab_wg_bar(w);
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const int row = 16 * wi + g + 8 * r;
#pragma unroll
		for (int i = 0; i < 8; i++) {
			const int c = 2 * (i & 3) + (t >> 1);
			const uint32_t at = dqs + (i >> 2) * 8192 + row * 128 + ((c ^ (row & 7)) << 4) + (t & 1) * 8;
			asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[4 * i + 2 * r] * scale),
				     "f"(acc[4 * i + 2 * r + 1] * scale)
				     : "memory");
		}
	}
	fence_proxy_async(); /* the plain stores, then the reductions' reads */
	ab_wg_bar(w);
	if (issuer) {
		tma_reduce_add3(dqm, dqs, h * AB_D + 64 * w, i0, seq);
		tma_reduce_add3(dqm, dqs + 8192, h * AB_D + 64 * w + 32, i0, seq);
		tma_reduce_commit();
	}
}

/* dQ [64 queries x this warpgroup's 64 d] = dS K_half, added to dq with the softmax scale. */
__device__ __forceinline__ void ab_dq(const ab_args &a, const CUtensorMap *dqm, uint32_t ds, uint32_t khalf,
				      uint32_t dqs, int64_t qrow0, int h, int i0, int w, int wi, int g, int t)
{
	float acc[32];
	wgmma_fence();
#pragma unroll
	for (int kk = 0; kk < AB_BC / 16; kk++) /* keys + 16: in dS 32 bytes (2), in K 16 rows (128) */
		wgmma_op<1>(acc, wg_desc(ds + (kk >> 2) * 8192) + 2 * (kk & 3), wg_desc_mn_at(khalf, 8192) + 128 * kk,
			    kk > 0);
	wgmma_commit();
	wgmma_wait<0>();
	acc_fence(acc);
	if (a.no_dq) { /* one store that never happens keeps the product (ptxas drops unused ones) */
		float sum = 0.f;
#pragma unroll
		for (int i = 0; i < 32; i++)
			sum += acc[i];
		if (sum == 1.2345e-30f)
			a.dq[0] = sum;
		return;
	}
	if (a.dq_tma) {
		ab_dq_tma(dqm, acc, a.scale, dqs, (int)(qrow0 / a.S), h, i0, w, wi, g, t);
		return;
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const int qi = i0 + 16 * wi + g + 8 * r;
		if (qi >= a.S)
			continue;
		float *row = a.dq + ((qrow0 + qi) * a.H + h) * AB_D + 64 * w + 2 * t;
#pragma unroll
		for (int i = 0; i < 8; i++)
			atomicAdd(reinterpret_cast<float2 *>(row + 8 * i),
				  make_float2(acc[4 * i + 2 * r] * a.scale, acc[4 * i + 2 * r + 1] * a.scale));
	}
}

/* dK (times the scale) and dV of this thread's two keys into the fp32 outputs; added with atomics
 * when the query heads of a kv head share them (GQA). */
__device__ __forceinline__ void ab_store_kv(const ab_args &a, const float (&dk)[64], const float (&dv)[64],
					    int64_t krow0, int kvh, int key, int t)
{
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const int kr = key + 8 * r;
		if (kr >= a.S)
			continue;
		const int64_t at = ((krow0 + kr) * a.KH + kvh) * AB_D + 2 * t;
#pragma unroll
		for (int i = 0; i < 16; i++) {
			const float2 k2 = make_float2(dk[4 * i + 2 * r] * a.scale, dk[4 * i + 2 * r + 1] * a.scale);
			const float2 v2 = make_float2(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
			if (a.atomic_kv) {
				atomicAdd(reinterpret_cast<float2 *>(a.dk + at + 8 * i), k2);
				atomicAdd(reinterpret_cast<float2 *>(a.dv + at + 8 * i), v2);
			} else {
				*reinterpret_cast<float2 *>(a.dk + at + 8 * i) = k2;
				*reinterpret_cast<float2 *>(a.dv + at + 8 * i) = v2;
			}
		}
	}
}
#endif /* TIER_SM90A */

__global__ void __launch_bounds__(AB_THREADS, 1)
	ab_bwd_kernel(const __grid_constant__ CUtensorMap qm, const __grid_constant__ CUtensorMap km,
		      const __grid_constant__ CUtensorMap vm, const __grid_constant__ CUtensorMap om,
		      const __grid_constant__ CUtensorMap dqm, const ab_args a)
{
	pdl_enter();
#ifdef TIER_SM90A
	extern __shared__ __align__(16) unsigned char smem[]; /* 1024 made below, as in attn_wgmma.cu */
	__shared__ __align__(8) uint64_t bars[AB_STAGES + 1]; /* full[], K and V */
	const uint32_t raw = wg_saddr(smem), base = raw + ((1024u - (raw & 1023u)) & 1023u), b = wg_saddr(bars);
	const int kvh = blockIdx.z % a.KH, h = kvh * a.G + blockIdx.x, j0 = blockIdx.y * AB_BC;
	const int row0 = (blockIdx.z / a.KH) * a.S, ibeg = a.causal ? j0 : 0;
	const int nsteps = (a.S - ibeg + AB_BR - 1) / AB_BR;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	if (threadIdx.x == 0) {
		for (int s = 0; s < AB_STAGES; s++)
			bar_init(b + 8 * s, 33); /* lane 0's arrival with the bytes, each lane's copies */
		bar_init(b + 8 * AB_STAGES, 1);
		fence_barrier_init();
	}
	__syncthreads();
	if (warp == 0) {
		if (lane == 0)
			ab_load_kv(&km, &vm, base, b + 8 * AB_STAGES, kvh, (int)(blockIdx.z / a.KH), j0);
		for (int n = 0; n < AB_STAGES - 1 && n < nsteps; n++)
			ab_load_step(a, &qm, &om, base, b, h, row0, ibeg, n, lane);
	}
	const int w = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
	const int kw0 = j0 + 64 * w; /* this warpgroup's first key */
	const uint32_t kw = base + 64 * w * 128, vw = base + AB_KV_BYTES + 64 * w * 128;
	float dk[64], dv[64];
#pragma unroll
	for (int i = 0; i < 64; i++)
		dk[i] = dv[i] = 0.f;
	mbar_wait(b + 8 * AB_STAGES, 0);
	for (int n = 0; n < nsteps; n++) {
		const int s = n % AB_STAGES, i0 = ibeg + n * AB_BR;
		const uint32_t st = base + AB_STAGE_AT + s * AB_STAGE, ds = base + AB_DS_AT + (n & 1) * AB_DS_BYTES;
		const uint32_t ld = base + a.ld_at + s * AB_LD_BYTES;
		mbar_wait(b + 8 * s, (n / AB_STAGES) & 1);
		__syncwarp();
		if (a.causal && kw0 > i0 + AB_BR - 1) {
			/* every key of this warpgroup follows every query of the step: its dS half is zero */
			const uint32_t zero[4][4] = {};
			const float zf[32] = {};
			if (a.ds_stm)
				ab_store_ds_stm(ds + w * 8192, zero, wi, lane);
			else
				ab_store_ds_scalar(ds + w * 8192, zf, wi, g, t);
		} else if ((a.causal && kw0 + 63 > i0) || i0 + AB_BR > a.S || kw0 + 64 > a.S) {
			ab_step<true>(dk, dv, a, kw, vw, st, ld, ds + w * 8192, kw0 + 16 * wi, i0, wi, g, t);
		} else {
			ab_step<false>(dk, dv, a, kw, vw, st, ld, ds + w * 8192, kw0 + 16 * wi, i0, wi, g, t);
		}
		fence_proxy_async(); /* dS's plain stores, then the products' reads */
		__syncthreads();
		/* step n - 1's stage is free: both warpgroups waited for its products before this barrier */
		if (warp == 0 && n + AB_STAGES - 1 < nsteps)
			ab_load_step(a, &qm, &om, base, b, h, row0, ibeg, n + AB_STAGES - 1, lane);
		__syncwarp(); /* warp 0 converged again (lane 0's copies) for the .aligned products */
		ab_dq(a, &dqm, ds, base + w * (AB_BC * 128), base + AB_DQ_AT + w * AB_DQ_BYTES, row0, h, i0, w, wi, g, t);
	}
	if (a.dq_tma && wi == 0 && lane == 0)
		tma_reduce_wait(); /* the staging stays until the last reductions have read it */
	acc_fence(dk);
	acc_fence(dv);
	ab_store_kv(a, dk, dv, row0, kvh, kw0 + 16 * wi + g, t);
#endif
}

} /* namespace */

extern "C" int attn_bwd_switches_read(attn_bwd_switches *sw)
{
	const char *dbg = getenv("TIER_ATTN_BWD_DEBUG"), *dqv = getenv("TIER_ATTN_BWD_DQ"), *dsv = getenv("TIER_ATTN_BWD_DS");
	if (dsv && *dsv && strcmp(dsv, "stm") && strcmp(dsv, "scalar"))
		return tier_fail(-EINVAL, "attention backward: TIER_ATTN_BWD_DS=%s; use stm or scalar, or unset it", dsv);
	if (dbg && *dbg && strcmp(dbg, "nodq"))
		return tier_fail(-EINVAL, "attention backward: TIER_ATTN_BWD_DEBUG=%s; use nodq (measurements only: dq is "
				 "left wrong) or unset it", dbg);
	if (dqv && *dqv && strcmp(dqv, "tma") && strcmp(dqv, "atomic"))
		return tier_fail(-EINVAL, "attention backward: TIER_ATTN_BWD_DQ=%s; use atomic or tma, or unset it", dqv);
	sw->ds_stm = dsv && *dsv ? !strcmp(dsv, "stm") : AB_DS_STM_DEFAULT;
	sw->no_dq = dbg && *dbg;
	sw->dq_asked = dqv && *dqv;
	sw->dq_tma = sw->dq_asked ? !strcmp(dqv, "tma") : AB_DQ_TMA_DEFAULT;
	return 0;
}

extern "C" int attn_wgmma_bwd(const tier_attn_params *p, const void *q, const void *k, const void *v,
			      const void *dout, const float *lse, const float *Di, float *dq, float *dk, float *dv,
			      float scale, float sl2, int atomic_kv, const attn_bwd_switches *sw,
			      void *stream)
{
	if (!attn_wgmma_usable((int)p->head_dim)) /* head_dim 128 = AB_D */
		return -ENOTSUP;
	const uint64_t rows = (uint64_t)(p->batch * p->seq);
	if (rows >= (1ull << 31) || p->n_kv_heads * p->batch > 65535 || (p->seq + AB_BC - 1) / AB_BC > 65535)
		return -ENOTSUP;
	CUtensorMap qm, km, vm, om;
	int rc;
	const uint64_t B = (uint64_t)p->batch, S = (uint64_t)p->seq;
	if ((rc = base_tmap_bf16_seq(&qm, q, B, S, (uint64_t)(p->n_heads * AB_D), AB_BR)) ||
	    (rc = base_tmap_bf16_seq(&om, dout, B, S, (uint64_t)(p->n_heads * AB_D), AB_BR)) ||
	    (rc = base_tmap_bf16_seq(&km, k, B, S, (uint64_t)(p->n_kv_heads * AB_D), AB_BC)) ||
	    (rc = base_tmap_bf16_seq(&vm, v, B, S, (uint64_t)(p->n_kv_heads * AB_D), AB_BC)))
		return rc;
	/* dQ by TMA reductions: dq must be 16-byte aligned for the map; the default takes the atomics
	 * where it is not, an explicit TIER_ATTN_BWD_DQ=tma is an error there (not atomics in silence) */
	const int dq_aligned = (uintptr_t)dq % 16 == 0, dq_tma = sw->dq_tma && dq_aligned;
	CUtensorMap dqm;
	memset(&dqm, 0, sizeof dqm);
	if (sw->dq_tma && sw->dq_asked && !dq_aligned)
		return tier_fail(-EINVAL, "attention backward (wgmma): TIER_ATTN_BWD_DQ=tma needs dq 16-byte aligned (%p); "
				 "unset it or set atomic", (void *)dq);
	if (dq_tma && (rc = base_tmap_f32_seq(&dqm, dq, B, S, (uint64_t)(p->n_heads * AB_D), AB_BR)))
		return rc;
	ab_args a = { lse, Di, dq, dk, dv, (int)p->seq, (int)p->n_heads, (int)p->n_kv_heads,
		      (int)(p->n_heads / p->n_kv_heads), p->causal, atomic_kv, scale, sl2, sw->no_dq, dq_tma, sw->ds_stm,
		      dq_tma ? (uint32_t)AB_LD_AT_TMA : (uint32_t)AB_DQ_AT };
	dim3 grid((unsigned)(p->n_heads / p->n_kv_heads), (unsigned)((p->seq + AB_BC - 1) / AB_BC),
		  (unsigned)(p->n_kv_heads * p->batch));
	const int smem = dq_tma ? AB_SMEM : AB_SMEM_NO_DQ;
	if (cudaFuncSetAttribute(ab_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
		return tier_fail(-EIO, "attention backward (wgmma): %s", cudaGetErrorString(cudaGetLastError()));
	tier_launch(ab_bwd_kernel, grid, AB_THREADS, smem, (cudaStream_t)stream, qm, km, vm, om, dqm, a);
	cudaError_t e = cudaGetLastError();
	return e == cudaSuccess ? 0 : tier_fail(-EIO, "attention backward (wgmma): %s", cudaGetErrorString(e));
}
