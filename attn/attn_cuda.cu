/* attn_cuda.cu - flash-attention-2 style kernels on tensor cores (mma.sync m16n8k16, bf16 in,
 * fp32 accumulation) and RoPE on CUDA.
 *
 * Forward: one CTA of 4 warps per (128-query block, head, sequence); each warp owns 32 query rows
 * (two 16-row tiles, so every K and V fragment it loads feeds two products), keeps the running max
 * and sum and the output accumulator in registers, and walks the 64-key blocks up to the diagonal
 * (online softmax; the probabilities go from the score accumulators straight into the A operand of
 * P V without touching shared memory). K and V blocks are double-buffered with cp.async.
 * Backward: one CTA per (64-key block, query head, sequence); each warp owns 16 keys and keeps
 * their dK and dV accumulators in registers while the CTA walks 32-query blocks from the diagonal
 * on: recompute P^T from lse, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q,
 * and dQ += dS K through shared memory, added to fp32 dq with atomics. With GQA the heads that
 * share a kv head add their dK and dV with atomics too; without it they are stored.
 * Fragments come from shared memory through ldmatrix (padded rows: no bank conflicts).
 *
 * Kernel variants: TIER_ATTN_FWD and TIER_ATTN_BWD, read at every call, pick one by name (the
 * table near the end of this file; unset means the first entry). "v1" is the original pair of
 * kernels described above; the "v2" family (fwd2_kernel, bwd2_kernel) is the same algorithm with
 * the mask, exp2, address and pipeline overheads removed and its tile shape as a template. */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn_impl.h"
#include "attn/attn_cu.cuh"
#include "base/bf16x4.cuh"
#include "base/mma_sm80.cuh"
#include "base/pdl.cuh"
#include "base/fill_cuda.h"

typedef __nv_bfloat16 bf16;

#define MT 2       /* forward: 16-row tiles per warp */
#define WROWS (16 * MT)
#define BQ (4 * WROWS)   /* forward: query rows per CTA (4 warps) */
#define BK 64      /* keys per block (both passes) */
#define BQB 32     /* backward: query rows per step */
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

namespace {

struct fwd_args {
	const bf16 *q, *k, *v;
	bf16 *o;
	float *lse;
	int S, H, KH, G, causal;
	float sl2;          /* scale * log2(e): scores in base-2 units */
};

struct bwd_args {
	const bf16 *q, *k, *v, *dout;
	const float *lse, *Di;
	float *dq, *dk, *dv;
	int S, H, KH, G, causal, atomic_kv;
	float scale, sl2;
	attn_bwd_switches sw; /* the wgmma kernel's (attn_wgmma_bwd) */
};

/* A operand (16 x 16): rows r0.., columns k0.. of a row-major tile with leading dimension LD. */
template <int LD>
__device__ __forceinline__ void frag_a(uint32_t a[4], const bf16 *s, int r0, int k0, int lane)
{
	ldsm4(a, s + (r0 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
}

/* A operand (16 x 16) with A[m][k] = M[k0 + k][m0 + m]: a transposed tile. */
template <int LD>
__device__ __forceinline__ void frag_at(uint32_t a[4], const bf16 *m, int k0, int m0, int lane)
{
	ldsm4t(a, m + (k0 + (lane & 7) + (lane >> 4) * 8) * LD + m0 + ((lane >> 3) & 1) * 8);
}

/* B operands of two adjacent 8-column tiles (b[0..1] for n0, b[2..3] for n0 + 8), one 16-deep
 * k step, with B[k][n] = M[n0 + n][k0 + k]: M's rows are the columns of B (K in Q K^T). */
template <int LD>
__device__ __forceinline__ void frag_bt2(uint32_t b[4], const bf16 *m, int n0, int k0, int lane)
{
	ldsm4(b, m + (n0 + (lane & 7) + (lane >> 4) * 8) * LD + k0 + ((lane >> 3) & 1) * 8);
}

/* The same with B[k][n] = M[k0 + k][n0 + n]: k down M's rows (V in P V). */
template <int LD>
__device__ __forceinline__ void frag_b2(uint32_t b[4], const bf16 *m, int k0, int n0, int lane)
{
	ldsm4t(b, m + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
}


/* Rows [row0, row0 + rows) of one head into shared memory (leading dimension D + 8 against bank
 * conflicts), asynchronously; rows at or past nvalid are zero. stride: elements between tokens. */
template <int D>
__device__ __forceinline__ void load_tile(bf16 *sm, const bf16 *gm, int64_t row0, int rows, int nvalid,
					  int64_t stride)
{
	constexpr int CH = D / 8;
	for (int idx = threadIdx.x; idx < rows * CH; idx += blockDim.x) {
		int r = idx / CH, c = idx % CH;
		bool ok = r < nvalid;
		cp_async16(sm + r * (D + 8) + c * 8, ok ? gm + (row0 + r) * stride + c * 8 : gm, ok);
	}
}

__device__ __forceinline__ void add2(float *p, float x, float y)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	atomicAdd(reinterpret_cast<float2 *>(p), make_float2(x, y));
#else
	atomicAdd(p, x);
	atomicAdd(p + 1, y);
#endif
}

/* The forward's end, for both kernel families: the warp's TM row tiles divided by their row sums
 * into o (bf16), and lse = (m ms + log2 sum) ln 2, ms taking the running max m to base-2 units. */
template <int D, int TM>
__device__ __forceinline__ void fwd_store(const fwd_args &a, float (&o)[TM][D / 8][4], const float (&m)[TM][2],
					  const float (&l)[TM][2], int64_t t0, int r0, int h, int g, int t, float ms)
{
#pragma unroll
	for (int mi = 0; mi < TM; mi++)
#pragma unroll
		for (int r = 0; r < 2; r++) {
			float sum = quad_sum(l[mi][r]), inv = 1.f / sum;
			int qi = r0 + mi * 16 + g + 8 * r;
			if (qi >= a.S)
				continue;
			bf16 *row = a.o + ((t0 + qi) * a.H + h) * D;
#pragma unroll
			for (int dt = 0; dt < D / 8; dt++)
				*reinterpret_cast<__nv_bfloat162 *>(row + dt * 8 + 2 * t) =
					__floats2bfloat162_rn(o[mi][dt][2 * r] * inv, o[mi][dt][2 * r + 1] * inv);
			if (t == 0)
				a.lse[(t0 + qi) * a.H + h] = (m[mi][r] * ms + log2f(sum)) * LN2;
		}
}

template <int D>
__global__ void __launch_bounds__(128) fwd_kernel(fwd_args a)
{
	pdl_enter();
	constexpr int LD = D + 8, KT = D / 16, DT = D / 8, NT = BK / 8, BUF = 2 * BK * LD;
	extern __shared__ __align__(16) unsigned char smem[];
	/* The Q block, then two (K, V) buffers: the next key block loads while this one is used. */
	bf16 *const Qs = reinterpret_cast<bf16 *>(smem), *const buf = Qs + BQ * LD;
	/* The heaviest query blocks (most keys under the causal mask) start first. */
	const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, kvh = h / a.G;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const int64_t t0 = (int64_t)blockIdx.z * a.S, kstride = (int64_t)a.KH * D;
	const int i0 = qb * BQ, r0 = i0 + warp * WROWS;
	const int nkb_all = (a.S + BK - 1) / BK, nkb = a.causal ? min(nkb_all, (i0 + BQ + BK - 1) / BK) : nkb_all;
	const bf16 *kp = a.k + (int64_t)kvh * D, *vp = a.v + (int64_t)kvh * D;
	/* Each warp owns WROWS = 16 * MT query rows: every K and V fragment it loads feeds MT products. */
	float o[MT][DT][4], m[MT][2], l[MT][2];

	load_tile<D>(Qs, a.q + (int64_t)h * D, t0 + i0, BQ, min(BQ, a.S - i0), (int64_t)a.H * D);
	load_tile<D>(buf, kp, t0, BK, min(BK, a.S), kstride);
	load_tile<D>(buf + BK * LD, vp, t0, BK, min(BK, a.S), kstride);
	cp_async_commit();
#pragma unroll
	for (int mi = 0; mi < MT; mi++) {
		m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.f;
#pragma unroll
		for (int dt = 0; dt < DT; dt++)
			o[mi][dt][0] = o[mi][dt][1] = o[mi][dt][2] = o[mi][dt][3] = 0.f;
	}

	for (int kb = 0; kb < nkb; kb++) {
		const int j0 = kb * BK, cur = kb & 1;
		const bf16 *Ks = buf + cur * BUF, *Vs = Ks + BK * LD;
		if (kb + 1 < nkb) {
			int jn = j0 + BK;
			load_tile<D>(buf + (cur ^ 1) * BUF, kp, t0 + jn, BK, min(BK, a.S - jn), kstride);
			load_tile<D>(buf + (cur ^ 1) * BUF + BK * LD, vp, t0 + jn, BK, min(BK, a.S - jn), kstride);
			cp_async_commit();
			cp_async_wait<1>();
		} else {
			cp_async_wait<0>();
		}
		__syncthreads();
		/* A warp whose rows all precede this key block has nothing to add. */
		if (!a.causal || j0 <= r0 + WROWS - 1) {
			float s[MT][NT][4];
			const bool mask = (a.causal && j0 + BK - 1 > r0) || j0 + BK > a.S;
#pragma unroll
			for (int mi = 0; mi < MT; mi++)
#pragma unroll
				for (int nt = 0; nt < NT; nt++)
					s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0.f;
#pragma unroll
			for (int kt = 0; kt < KT; kt++) {
				uint32_t qa[MT][4];
#pragma unroll
				for (int mi = 0; mi < MT; mi++)
					frag_a<LD>(qa[mi], Qs, warp * WROWS + mi * 16, kt * 16, lane);
#pragma unroll
				for (int nt = 0; nt < NT; nt += 2) {
					uint32_t b[4];
					frag_bt2<LD>(b, Ks, nt * 8, kt * 16, lane);
#pragma unroll
					for (int mi = 0; mi < MT; mi++) {
						mma16816(s[mi][nt], qa[mi], b);
						mma16816(s[mi][nt + 1], qa[mi], b + 2);
					}
				}
			}
#pragma unroll
			for (int mi = 0; mi < MT; mi++) {
				float mx[2] = { m[mi][0], m[mi][1] }, base[2], alpha[2];
#pragma unroll
				for (int nt = 0; nt < NT; nt++)
#pragma unroll
					for (int e = 0; e < 4; e++) {
						int r = e >> 1, key = j0 + nt * 8 + 2 * t + (e & 1);
						int qi = r0 + mi * 16 + g + 8 * r;
						bool ok = !mask || (key < a.S && (!a.causal || key <= qi));
						s[mi][nt][e] = ok ? s[mi][nt][e] * a.sl2 : -INFINITY;
						mx[r] = fmaxf(mx[r], s[mi][nt][e]);
					}
#pragma unroll
				for (int r = 0; r < 2; r++) {
					mx[r] = quad_max(mx[r]);
					base[r] = mx[r] == -INFINITY ? 0.f : mx[r];
					alpha[r] = exp2f(m[mi][r] - base[r]);
					m[mi][r] = mx[r];
					l[mi][r] *= alpha[r];
				}
#pragma unroll
				for (int nt = 0; nt < NT; nt++)
#pragma unroll
					for (int e = 0; e < 4; e++) {
						s[mi][nt][e] = exp2f(s[mi][nt][e] - base[e >> 1]);
						l[mi][e >> 1] += s[mi][nt][e];
					}
#pragma unroll
				for (int dt = 0; dt < DT; dt++) {
					o[mi][dt][0] *= alpha[0], o[mi][dt][1] *= alpha[0];
					o[mi][dt][2] *= alpha[1], o[mi][dt][3] *= alpha[1];
				}
			}
			/* The score accumulators of two adjacent 8-key tiles are the A operand of a 16-key step. */
#pragma unroll
			for (int kt = 0; kt < BK / 16; kt++) {
				uint32_t pa[MT][4];
#pragma unroll
				for (int mi = 0; mi < MT; mi++)
					pack_a(pa[mi], s[mi][2 * kt], s[mi][2 * kt + 1]);
#pragma unroll
				for (int dt = 0; dt < DT; dt += 2) {
					uint32_t b[4];
					frag_b2<LD>(b, Vs, kt * 16, dt * 8, lane);
#pragma unroll
					for (int mi = 0; mi < MT; mi++) {
						mma16816(o[mi][dt], pa[mi], b);
						mma16816(o[mi][dt + 1], pa[mi], b + 2);
					}
				}
			}
		}
		__syncthreads();
	}
	fwd_store<D, MT>(a, o, m, l, t0, r0, h, g, t, 1.0f); /* v1 keeps m in base-2 units */
}

/* D_i = rowsum(dout_i * o_i), one warp per row, fp32 sum: V = 2, bf16 pairs; V = 4, four at a time
 * in 8-byte loads (D % 4 == 0, 8-byte aligned rows: one load of each a lane at head_dim 128; pairs
 * ran at half the copy's rate in (a)'s profile). */
template <int V>
__global__ void rowdot_kernel(const bf16 *o, const bf16 *dout, float *Di, int64_t rows, int D)
{
	pdl_enter();
	int64_t row = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
	int lane = threadIdx.x & 31;
	float s = 0.f;
	if (row >= rows)
		return;
	for (int d = V * lane; d < D; d += 32 * V) {
		if (V == 4) {
			float4 a = bf16x4_load(o + row * D + d), c = bf16x4_load(dout + row * D + d);
			s += a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
			continue;
		}
		float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(o + row * D + d));
		float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(dout + row * D + d));
		s += x.x * y.x + x.y * y.y;
	}
	for (int off = 16; off; off >>= 1)
		s += __shfl_xor_sync(0xffffffffu, s, off);
	if (lane == 0)
		Di[row] = s;
}

/* dQ[BQB x D] += scale * dS[BQB x BK] K[BK x D], dS held transposed in shared memory: warp w takes
 * query rows (w & 1) * 16 and half (w >> 1) of the columns. */
template <int D>
__device__ __forceinline__ void bwd_dq(const bwd_args &a, const bf16 *dSs, const bf16 *Ks, int64_t t0, int i0,
				       int h, int warp, int lane)
{
	constexpr int LD = D + 8, LDS = BQB + 8, NT = D / 16;
	const int qr0 = (warp & 1) * 16, dc0 = (warp >> 1) * (D / 2), g = (lane & 31) >> 2, t = lane & 3;
	float acc[NT][4];
#pragma unroll
	for (int n = 0; n < NT; n++)
		acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
	for (int kt = 0; kt < BK / 16; kt++) {
		uint32_t aa[4];
		frag_at<LDS>(aa, dSs, kt * 16, qr0, lane);
#pragma unroll
		for (int n = 0; n < NT; n += 2) {
			uint32_t b[4];
			frag_b2<LD>(b, Ks, kt * 16, dc0 + n * 8, lane);
			mma16816(acc[n], aa, b);
			mma16816(acc[n + 1], aa, b + 2);
		}
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		int qi = i0 + qr0 + g + 8 * r;
		if (qi >= a.S)
			continue;
		float *row = a.dq + ((t0 + qi) * a.H + h) * D + dc0;
#pragma unroll
		for (int n = 0; n < NT; n++)
			add2(row + n * 8 + 2 * t, acc[n][2 * r] * a.scale, acc[n][2 * r + 1] * a.scale);
	}
}

/* Issue the loads of one query block of the backward: Q and dO rows (asynchronous), lse in base-2
 * units and D (plain stores). */
template <int D>
__device__ __forceinline__ void bwd_stage(const bwd_args &a, bf16 *Qs, bf16 *dOs, float *Ls, float *Ds, int64_t t0,
					  int i0, int h)
{
	load_tile<D>(Qs, a.q + (int64_t)h * D, t0 + i0, BQB, min(BQB, a.S - i0), (int64_t)a.H * D);
	load_tile<D>(dOs, a.dout + (int64_t)h * D, t0 + i0, BQB, min(BQB, a.S - i0), (int64_t)a.H * D);
	if (threadIdx.x < BQB) {
		int i = i0 + threadIdx.x;
		Ls[threadIdx.x] = i < a.S ? a.lse[(t0 + i) * a.H + h] * LOG2E : 0.f;
		Ds[threadIdx.x] = i < a.S ? a.Di[(t0 + i) * a.H + h] : 0.f;
	}
}

template <int D>
__global__ void __launch_bounds__(128) bwd_kernel(bwd_args a)
{
	pdl_enter();
	constexpr int LD = D + 8, KT = D / 16, DT = D / 8, LDS = BQB + 8, QT = BQB / 8;
	extern __shared__ __align__(16) unsigned char smem[];
	/* K and V of this block, then two stages of (Q, dO, lse, D) so the next query block loads
	 * while this one is used, then dS^T for the dQ product. */
	bf16 *Ks = reinterpret_cast<bf16 *>(smem), *Vs = Ks + BK * LD, *Qb = Vs + BK * LD, *dOb = Qb + 2 * BQB * LD;
	bf16 *dSs = dOb + 2 * BQB * LD;
	float *Lb = reinterpret_cast<float *>(dSs + BK * LDS), *Db = Lb + 2 * BQB;
	const int kb = blockIdx.x, h = blockIdx.y, kvh = h / a.G, j0 = kb * BK, ibeg = a.causal ? j0 : 0;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const int64_t t0 = (int64_t)blockIdx.z * a.S;
	const int kr[2] = { j0 + warp * 16 + g, j0 + warp * 16 + g + 8 };
	float dk[DT][4], dv[DT][4];

#pragma unroll
	for (int dt = 0; dt < DT; dt++)
		for (int e = 0; e < 4; e++)
			dk[dt][e] = dv[dt][e] = 0.f;
	load_tile<D>(Ks, a.k + (int64_t)kvh * D, t0 + j0, BK, min(BK, a.S - j0), (int64_t)a.KH * D);
	load_tile<D>(Vs, a.v + (int64_t)kvh * D, t0 + j0, BK, min(BK, a.S - j0), (int64_t)a.KH * D);
	bwd_stage<D>(a, Qb, dOb, Lb, Db, t0, ibeg, h);
	cp_async_commit();

	for (int i0 = ibeg, n = 0; i0 < a.S; i0 += BQB, n ^= 1) {
		float st[QT][4], dpt[QT][4];
		const bf16 *Qs = Qb + n * BQB * LD, *dOs = dOb + n * BQB * LD;
		const float *Ls = Lb + n * BQB, *Ds = Db + n * BQB;
		if (i0 + BQB < a.S) {
			bwd_stage<D>(a, Qb + (n ^ 1) * BQB * LD, dOb + (n ^ 1) * BQB * LD, Lb + (n ^ 1) * BQB,
				     Db + (n ^ 1) * BQB, t0, i0 + BQB, h);
			cp_async_commit();
			cp_async_wait<1>();
		} else {
			cp_async_wait<0>();
		}
		__syncthreads();
#pragma unroll
		for (int nt = 0; nt < QT; nt++)
			for (int e = 0; e < 4; e++)
				st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
		for (int kt = 0; kt < KT; kt++) {
			uint32_t ka[4], va[4];
			frag_a<LD>(ka, Ks, warp * 16, kt * 16, lane);
			frag_a<LD>(va, Vs, warp * 16, kt * 16, lane);
#pragma unroll
			for (int nt = 0; nt < QT; nt += 2) {
				uint32_t b[4];
				frag_bt2<LD>(b, Qs, nt * 8, kt * 16, lane);
				mma16816(st[nt], ka, b);
				mma16816(st[nt + 1], ka, b + 2);
				frag_bt2<LD>(b, dOs, nt * 8, kt * 16, lane);
				mma16816(dpt[nt], va, b);
				mma16816(dpt[nt + 1], va, b + 2);
			}
		}
		/* P^T from the saved lse, then dS^T = P^T (dP^T - D) (the score scale comes at the end). */
#pragma unroll
		for (int nt = 0; nt < QT; nt++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				int qc = nt * 8 + 2 * t + (e & 1), qi = i0 + qc, key = kr[e >> 1];
				bool ok = qi < a.S && key < a.S && (!a.causal || key <= qi);
				float p = ok ? exp2f(st[nt][e] * a.sl2 - Ls[qc]) : 0.f;
				st[nt][e] = p;
				dpt[nt][e] = p * (dpt[nt][e] - Ds[qc]);
			}
#pragma unroll
		for (int kt = 0; kt < BQB / 16; kt++) {
			uint32_t pa[4] = { pack(st[2 * kt][0], st[2 * kt][1]), pack(st[2 * kt][2], st[2 * kt][3]),
					   pack(st[2 * kt + 1][0], st[2 * kt + 1][1]), pack(st[2 * kt + 1][2], st[2 * kt + 1][3]) };
			uint32_t da[4] = { pack(dpt[2 * kt][0], dpt[2 * kt][1]), pack(dpt[2 * kt][2], dpt[2 * kt][3]),
					   pack(dpt[2 * kt + 1][0], dpt[2 * kt + 1][1]), pack(dpt[2 * kt + 1][2], dpt[2 * kt + 1][3]) };
#pragma unroll
			for (int dt = 0; dt < DT; dt += 2) {
				uint32_t b[4];
				frag_b2<LD>(b, dOs, kt * 16, dt * 8, lane);
				mma16816(dv[dt], pa, b);
				mma16816(dv[dt + 1], pa, b + 2);
				frag_b2<LD>(b, Qs, kt * 16, dt * 8, lane);
				mma16816(dk[dt], da, b);
				mma16816(dk[dt + 1], da, b + 2);
			}
		}
#pragma unroll
		for (int nt = 0; nt < QT; nt++) {
			*reinterpret_cast<__nv_bfloat162 *>(dSs + (warp * 16 + g) * LDS + nt * 8 + 2 * t) =
				__floats2bfloat162_rn(dpt[nt][0], dpt[nt][1]);
			*reinterpret_cast<__nv_bfloat162 *>(dSs + (warp * 16 + g + 8) * LDS + nt * 8 + 2 * t) =
				__floats2bfloat162_rn(dpt[nt][2], dpt[nt][3]);
		}
		__syncthreads();
		bwd_dq<D>(a, dSs, Ks, t0, i0, h, warp, lane);
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		if (kr[r] >= a.S)
			continue;
		int64_t at = ((t0 + kr[r]) * a.KH + kvh) * D + 2 * t;
#pragma unroll
		for (int dt = 0; dt < DT; dt++) {
			float kx = dk[dt][2 * r] * a.scale, ky = dk[dt][2 * r + 1] * a.scale;
			if (a.atomic_kv) {
				add2(a.dk + at + dt * 8, kx, ky);
				add2(a.dv + at + dt * 8, dv[dt][2 * r], dv[dt][2 * r + 1]);
			} else {
				*reinterpret_cast<float2 *>(a.dk + at + dt * 8) = make_float2(kx, ky);
				*reinterpret_cast<float2 *>(a.dv + at + dt * 8) = make_float2(dv[dt][2 * r], dv[dt][2 * r + 1]);
			}
		}
	}
}

/* ---- v2 kernels ------------------------------------------------------------------------------
 * The same algorithms as v1, rewritten after reading v1's SASS (fwd_kernel<128>: 1846 instructions
 * per key block of which 256 are HMMA; bwd_kernel<128>: ~900 per query step, 160 HMMA):
 * - The causal mask is a compile-time path (MASK) taken only on the blocks that cross the diagonal
 *   or the sequence end; v1 evaluated it per element at run time, and nvcc turned the 64 per-thread
 *   selects into 64 branches with BSSY/BSYNC (~10 instructions per score).
 * - exp2 is ex2.approx.ftz (one MUFU; exp2f without fast-math adds a denormal fix-up of 3
 *   instructions), and the score scale is folded into one FFMA: p = 2^(s sl2 - m sl2), with the
 *   running max kept in raw score units.
 * - ldmatrix addresses are one per-lane base computed once plus compile-time offsets; v1 recomputed
 *   them per fragment (IMAD/LOP3/LEA chains), and tile loads use compile-time trip counts.
 * - One barrier per key block (forward): wait for block kb, barrier, then issue block kb + 1 into
 *   the buffer everyone has just left. The backward loads lse and D with cp.async too (v1 waited on
 *   plain loads in the middle of each step).
 * - Launch order (CTAs start in x, y, z order): forward grid (head + H * sequence, query block
 *   reversed), so the heaviest causal blocks of every head start first and the lightest end the
 *   grid (v1 was heavy-first within each head, head after head). Backward grid (head within its kv
 *   group, key block, kv head + KH * sequence): heaviest key blocks first within one kv group at a
 *   time, so the Q, dO and fp32 dQ rows in flight are those of G heads (Qwen3-30B: 8 heads, 34 MB at
 *   4096 tokens) and stay in L2 while the group's key blocks walk them.
 * Template parameters pick the shape: warps per CTA and 16-row tiles per warp (forward), warps
 * (16 keys each) and query rows per step (backward). The variants are listed at the end of the file. */

/* Shared-memory address forms of ldmatrix: a per-lane base plus an offset the compiler folds into
 * the instruction's immediate. */
__device__ __forceinline__ void ldsm4a(uint32_t r[4], uint32_t addr)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm4ta(uint32_t r[4], uint32_t addr)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/* Two matrices (lanes 0..15 give the addresses). */
__device__ __forceinline__ void ldsm2ta(uint32_t r[2], uint32_t addr)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
		     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

/* 4 bytes global -> shared, zero when !valid. */
__device__ __forceinline__ void cp_async4(void *sm, const void *gm, bool valid)
{
	asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(sm)), "l"(gm),
		     "r"(valid ? 4 : 0));
}

/* Lane offsets (bytes) into a row-major bf16 tile with LD elements per row, for ldmatrix x4:
 * lane_a: A operand, 16 rows x 16 columns (lanes 0-15 rows 0-15 at column 0, 16-31 at column 8).
 * lane_bt: B operands of two 8-column tiles taken from the tile's rows (B[k][n] = M[n][k]).
 * lane_b: B operands of two 8-column tiles with k down the rows (.trans; also the transposed A
 * operand of frag_at has this shape with the roles of the two halves swapped: lane_at). */
template <int LD> __device__ __forceinline__ uint32_t lane_a(int lane)
{
	return (uint32_t)(((lane & 15) * LD + (lane >> 4) * 8) * 2);
}
template <int LD> __device__ __forceinline__ uint32_t lane_bt(int lane)
{
	return (uint32_t)((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
}
template <int LD> __device__ __forceinline__ uint32_t lane_b(int lane)
{
	return (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2);
}
template <int LD> __device__ __forceinline__ uint32_t lane_at(int lane)
{
	return lane_bt<LD>(lane);
}

/* ROWS rows of one head from each of NSRC sources (gm[s] points at the first row; all with the
 * same stride) into shared memory with leading dimension D + 8, source s at sm + s * ROWS * (D + 8),
 * by the THREADS threads of the CTA, asynchronously; rows at or past nvalid are zero. When THREADS
 * is a multiple of the 16-byte chunks per row, each thread keeps one column and one row offset for
 * every source and chunk (no per-chunk index math: this runs once per block). */
template <int D, int ROWS, int THREADS, int NSRC>
__device__ __forceinline__ void load_rows(bf16 *sm, const bf16 *const (&gm)[NSRC], int nvalid, int64_t stride)
{
	constexpr int CH = D / 8, N = ROWS * CH, IT = (N + THREADS - 1) / THREADS, TILE = ROWS * (D + 8);
	const int tid = threadIdx.x;
	if constexpr (THREADS % CH == 0) {
		constexpr int RS = THREADS / CH;
		const int r0 = tid / CH;
		const int64_t off = r0 * stride + tid % CH * 8;
		bf16 *d = sm + r0 * (D + 8) + tid % CH * 8;
		if (nvalid >= ROWS) {
#pragma unroll
			for (int i = 0; i < IT; i++)
#pragma unroll
				for (int s = 0; s < NSRC; s++)
					if (N % THREADS == 0 || r0 + i * RS < ROWS)
						cp_async16(d + s * TILE + i * RS * (D + 8), gm[s] + off + i * RS * stride, true);
		} else {
#pragma unroll
			for (int i = 0; i < IT; i++) {
				const bool ok = r0 + i * RS < nvalid;
#pragma unroll
				for (int s = 0; s < NSRC; s++)
					if (N % THREADS == 0 || r0 + i * RS < ROWS)
						cp_async16(d + s * TILE + i * RS * (D + 8), gm[s] + (ok ? off + i * RS * stride : 0), ok);
			}
		}
	} else {
#pragma unroll
		for (int i = 0; i < IT; i++) {
			const int idx = tid + i * THREADS, r = idx / CH, c = idx % CH;
			const bool ok = r < nvalid;
#pragma unroll
			for (int s = 0; s < NSRC; s++)
				if (N % THREADS == 0 || idx < N)
					cp_async16(sm + s * TILE + r * (D + 8) + c * 8, gm[s] + (ok ? r * stride + c * 8 : 0), ok);
		}
	}
}

template <int D, int WARPS, int TM> struct fwd2_cfg {
	static constexpr int LD = D + 8, WR = 16 * TM, BQ2 = WARPS * WR, THREADS = 32 * WARPS;
	/* Q, then two (K, V) stages of BK keys. */
	static constexpr size_t smem = (size_t)(BQ2 + 4 * BK) * LD * sizeof(bf16);
};

/* Online softmax of one key block for one warp: s holds raw scores (TM 16-row tiles x NT 8-key
 * tiles); m (raw units) and l are the running max and sum, o the output accumulator. With MASK,
 * score e of tile nt is visible iff nt * 8 + (e & 1) < lim[mi][row] (the row's bound on keys,
 * relative to the thread's first key j0 + 2t). */
template <int TM, int NT, int DT, bool MASK>
__device__ __forceinline__ void fwd2_softmax(float (&s)[TM][NT][4], float (&o)[TM][DT][4], float (&m)[TM][2],
					     float (&l)[TM][2], const int (&lim)[TM][2], float sl2)
{
#pragma unroll
	for (int mi = 0; mi < TM; mi++) {
		float mx[2] = { m[mi][0], m[mi][1] }, ms[2];
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				if (MASK && nt * 8 + (e & 1) >= lim[mi][e >> 1])
					s[mi][nt][e] = -INFINITY;
				mx[e >> 1] = fmaxf(mx[e >> 1], s[mi][nt][e]);
			}
#pragma unroll
		for (int r = 0; r < 2; r++) {
			mx[r] = quad_max(mx[r]);
			/* A row with no visible key yet keeps max -inf; 0 keeps exp2 away from inf - inf. */
			ms[r] = mx[r] == -INFINITY ? 0.f : mx[r] * sl2;
			float alpha = ex2(m[mi][r] * sl2 - ms[r]);
			m[mi][r] = mx[r];
			l[mi][r] *= alpha;
#pragma unroll
			for (int dt = 0; dt < DT; dt++)
				o[mi][dt][2 * r] *= alpha, o[mi][dt][2 * r + 1] *= alpha;
		}
#pragma unroll
		for (int nt = 0; nt < NT; nt++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				s[mi][nt][e] = ex2(fmaf(s[mi][nt][e], sl2, -ms[e >> 1]));
				l[mi][e >> 1] += s[mi][nt][e];
			}
	}
}

/* Forward: one CTA of WARPS warps per (WARPS * 16 * TM query rows, head, sequence). */
template <int D, int WARPS, int TM, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) fwd2_kernel(fwd_args a)
{
	pdl_enter();
	typedef fwd2_cfg<D, WARPS, TM> C;
	constexpr int LD = C::LD, WR = C::WR, BQ2 = C::BQ2, KT = D / 16, DT = D / 8, NT = BK / 8;
	constexpr uint32_t RB = LD * 2, STAGE = 2 * BK * RB;
	extern __shared__ __align__(16) unsigned char smem[];
	bf16 *const Qs = reinterpret_cast<bf16 *>(smem), *const KV = Qs + BQ2 * LD;
	const int h = blockIdx.x % a.H, kvh = h / a.G, qb = gridDim.y - 1 - blockIdx.y;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const int64_t t0 = (int64_t)(blockIdx.x / a.H) * a.S, kstride = (int64_t)a.KH * D;
	const int i0 = qb * BQ2, r0 = i0 + warp * WR;
	const int nkb_all = (a.S + BK - 1) / BK, nkb = a.causal ? min(nkb_all, (i0 + BQ2 + BK - 1) / BK) : nkb_all;
	const bf16 *kp = a.k + t0 * kstride + (int64_t)kvh * D, *vp = a.v + t0 * kstride + (int64_t)kvh * D;
	const uint32_t sq = smem_addr(Qs) + warp * WR * RB + lane_a<LD>(lane), skv = smem_addr(KV);
	const uint32_t kof = lane_bt<LD>(lane), vof = BK * RB + lane_b<LD>(lane);
	float o[TM][DT][4], m[TM][2], l[TM][2];

	{
		const bf16 *qsrc[1] = { a.q + ((t0 + i0) * a.H + h) * D }, *kvsrc[2] = { kp, vp };
		load_rows<D, BQ2, C::THREADS, 1>(Qs, qsrc, min(BQ2, a.S - i0), (int64_t)a.H * D);
		load_rows<D, BK, C::THREADS, 2>(KV, kvsrc, min(BK, a.S), kstride);
	}
	cp_async_commit();
#pragma unroll
	for (int mi = 0; mi < TM; mi++) {
#pragma unroll
		for (int r = 0; r < 2; r++) {
			m[mi][r] = -INFINITY, l[mi][r] = 0.f;
		}
#pragma unroll
		for (int dt = 0; dt < DT; dt++)
			o[mi][dt][0] = o[mi][dt][1] = o[mi][dt][2] = o[mi][dt][3] = 0.f;
	}

	for (int kb = 0; kb < nkb; kb++) {
		const int j0 = kb * BK;
		const uint32_t kvs = skv + (kb & 1) * STAGE;
		cp_async_wait<0>();
		/* Block kb is in for everyone, and everyone is done with block kb - 1, whose buffer the
		 * next block fills. */
		__syncthreads();
		if (kb + 1 < nkb) {
			bf16 *nx = KV + ((kb + 1) & 1) * 2 * BK * LD;
			const int jn = j0 + BK;
			const bf16 *src[2] = { kp + jn * kstride, vp + jn * kstride };
			load_rows<D, BK, C::THREADS, 2>(nx, src, min(BK, a.S - jn), kstride);
			cp_async_commit();
		}
		/* A warp whose rows all precede this key block has nothing to add. */
		if (a.causal && j0 > r0 + WR - 1)
			continue;
		float s[TM][NT][4];
#pragma unroll
		for (int mi = 0; mi < TM; mi++)
#pragma unroll
			for (int nt = 0; nt < NT; nt++)
				s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0.f;
#pragma unroll
		for (int kt = 0; kt < KT; kt++) {
			uint32_t qa[TM][4];
#pragma unroll
			for (int mi = 0; mi < TM; mi++)
				ldsm4a(qa[mi], sq + mi * 16 * RB + kt * 32);
#pragma unroll
			for (int nt = 0; nt < NT; nt += 2) {
				uint32_t b[4];
				ldsm4a(b, kvs + kof + nt * 8 * RB + kt * 32);
#pragma unroll
				for (int mi = 0; mi < TM; mi++) {
					mma16816(s[mi][nt], qa[mi], b);
					mma16816(s[mi][nt + 1], qa[mi], b + 2);
				}
			}
		}
		/* Only blocks crossing the diagonal (for this warp's rows) or the sequence end mask. */
		if ((a.causal && j0 + BK - 1 > r0) || j0 + BK > a.S) {
			/* Keys below min(row + 1, S) (causal) or S are visible; relative to j0 + 2t. */
			int rel[TM][2];
#pragma unroll
			for (int mi = 0; mi < TM; mi++)
#pragma unroll
				for (int r = 0; r < 2; r++)
					rel[mi][r] = (a.causal ? min(r0 + mi * 16 + g + 8 * r + 1, a.S) : a.S) - j0 - 2 * t;
			fwd2_softmax<TM, NT, DT, true>(s, o, m, l, rel, a.sl2);
		} else {
			const int rel[TM][2] = {};
			fwd2_softmax<TM, NT, DT, false>(s, o, m, l, rel, a.sl2);
		}
		/* The score accumulators of two adjacent 8-key tiles are the A operand of a 16-key step. */
#pragma unroll
		for (int kt = 0; kt < BK / 16; kt++) {
			uint32_t pa[TM][4];
#pragma unroll
			for (int mi = 0; mi < TM; mi++)
				pack_a(pa[mi], s[mi][2 * kt], s[mi][2 * kt + 1]);
#pragma unroll
			for (int dt = 0; dt < DT; dt += 2) {
				uint32_t b[4];
				ldsm4ta(b, kvs + vof + kt * 16 * RB + dt * 16);
#pragma unroll
				for (int mi = 0; mi < TM; mi++) {
					mma16816(o[mi][dt], pa[mi], b);
					mma16816(o[mi][dt + 1], pa[mi], b + 2);
				}
			}
		}
	}
	fwd_store<D, TM>(a, o, m, l, t0, r0, h, g, t, a.sl2);
}

template <int D, int WARPS, int QB> struct bwd2_cfg {
	static constexpr int LD = D + 8, BKC = 16 * WARPS, LDS = QB + 8, THREADS = 32 * WARPS;
	/* K and V of the CTA's keys, two stages of (Q, dO), dS^T, two stages of (lse, D). */
	static constexpr size_t smem = (size_t)(2 * BKC + 4 * QB) * LD * sizeof(bf16) +
				       (size_t)BKC * LDS * sizeof(bf16) + 4 * QB * sizeof(float);
};

/* One query step's Q and dO rows (dO right after Q), lse and D, all asynchronous (rows past the
 * end read as zero). */
template <int D, int WARPS, int QB>
__device__ __forceinline__ void bwd2_stage(const bwd_args &a, bf16 *QdO, float *Ls, float *Ds, int64_t t0, int i0,
					   int h)
{
	constexpr int THREADS = 32 * WARPS;
	static_assert(THREADS >= 2 * QB, "lse and D take one thread per row each");
	const int64_t at = ((t0 + i0) * a.H + h) * D;
	const int tid = threadIdx.x;
	const bf16 *src[2] = { a.q + at, a.dout + at };
	load_rows<D, QB, THREADS, 2>(QdO, src, min(QB, a.S - i0), (int64_t)a.H * D);
	if (tid < 2 * QB) {
		const int r = tid % QB;
		const bool ok = i0 + r < a.S;
		const float *src = (tid < QB ? a.lse : a.Di) + (ok ? (t0 + i0 + r) * a.H + h : 0);
		cp_async4((tid < QB ? Ls : Ds) + r, src, ok);
	}
}

/* P^T and dS^T = P^T (dP^T - D) in place for one warp's 16 keys x QB queries: st holds raw scores,
 * dpt dP^T. With MASK the query of column c = nt * 8 + (e & 1) (relative to the thread's first
 * query i0 + 2t) is visible to key row r iff lo[r] <= c < hi (lo already -inf-like without causal). */
template <int QT, bool MASK>
__device__ __forceinline__ void bwd2_probs(float (&st)[QT][4], float (&dpt)[QT][4], const float *Ls, const float *Ds,
					   int t, const int (&lo)[2], int hi, float sl2)
{
#pragma unroll
	for (int nt = 0; nt < QT; nt++) {
		const float2 lv = *reinterpret_cast<const float2 *>(Ls + nt * 8 + 2 * t);
		const float2 dv = *reinterpret_cast<const float2 *>(Ds + nt * 8 + 2 * t);
		const float l2[2] = { lv.x * LOG2E, lv.y * LOG2E }, dd[2] = { dv.x, dv.y };
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int c = nt * 8 + (e & 1);
			float p = ex2(fmaf(st[nt][e], sl2, -l2[e & 1]));
			if (MASK && !(c >= lo[e >> 1] && c < hi))
				p = 0.f;
			st[nt][e] = p;
			dpt[nt][e] = p * (dpt[nt][e] - dd[e & 1]);
		}
	}
}

/* Backward: one CTA of WARPS warps per (16 * WARPS keys, query head, sequence); each warp owns 16
 * keys, the CTA walks QB-row query blocks from the diagonal on. */
template <int D, int WARPS, int QB, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) bwd2_kernel(bwd_args a)
{
	pdl_enter();
	typedef bwd2_cfg<D, WARPS, QB> C;
	constexpr int LD = C::LD, LDS = C::LDS, BKC = C::BKC, KT = D / 16, DT = D / 8, QT = QB / 8;
	constexpr uint32_t RB = LD * 2, SB = QB * RB;
	/* dQ = dS K split over the warps: RT row tiles of 16 queries x CG column groups of CW. */
	constexpr int RT = QB / 16, CG = WARPS / RT, CW = D / CG, NTW = CW / 8;
	static_assert(WARPS % RT == 0 && D % CG == 0 && CW % 8 == 0, "dQ tiling");
	extern __shared__ __align__(16) unsigned char smem[];
	/* Stage n: Q at Qb + 2n QB rows, dO right after it. */
	bf16 *Ks = reinterpret_cast<bf16 *>(smem), *Vs = Ks + BKC * LD, *Qb = Vs + BKC * LD, *dOb = Qb + QB * LD;
	bf16 *dSs = Qb + 4 * QB * LD;
	float *Lb = reinterpret_cast<float *>(dSs + BKC * LDS), *Db = Lb + 2 * QB;
	const int kvh = blockIdx.z % a.KH, h = kvh * a.G + blockIdx.x, j0 = blockIdx.y * BKC, ibeg = a.causal ? j0 : 0;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const int kw0 = j0 + warp * 16, kr[2] = { kw0 + g, kw0 + g + 8 };
	const int64_t t0 = (int64_t)(blockIdx.z / a.KH) * a.S, kvat = ((t0 + j0) * a.KH + kvh) * D;
	const uint32_t ska = smem_addr(Ks) + warp * 16 * RB + lane_a<LD>(lane), sva = ska + BKC * RB;
	const uint32_t sqb = smem_addr(Qb) + lane_bt<LD>(lane), sdob = smem_addr(dOb) + lane_bt<LD>(lane);
	const uint32_t sqt = smem_addr(Qb) + lane_b<LD>(lane), sdot = smem_addr(dOb) + lane_b<LD>(lane);
	const int qr0 = (warp % RT) * 16, dc0 = (warp / RT) * CW;
	const uint32_t sds = smem_addr(dSs) + qr0 * 2 + lane_at<LDS>(lane);
	const uint32_t skt = smem_addr(Ks) + dc0 * 2 + lane_b<LD>(lane);
	float dk[DT][4], dv[DT][4];

#pragma unroll
	for (int dt = 0; dt < DT; dt++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			dk[dt][e] = dv[dt][e] = 0.f;
	{
		const bf16 *src[2] = { a.k + kvat, a.v + kvat };
		load_rows<D, BKC, C::THREADS, 2>(Ks, src, min(BKC, a.S - j0), (int64_t)a.KH * D);
	}
	bwd2_stage<D, WARPS, QB>(a, Qb, Lb, Db, t0, ibeg, h);
	cp_async_commit();

	for (int i0 = ibeg, n = 0; i0 < a.S; i0 += QB, n ^= 1) {
		cp_async_wait<0>();
		/* Step n is in for everyone, and everyone is done with the other stage and with dS^T. */
		__syncthreads();
		if (i0 + QB < a.S) {
			bwd2_stage<D, WARPS, QB>(a, Qb + (n ^ 1) * 2 * QB * LD, Lb + (n ^ 1) * QB, Db + (n ^ 1) * QB, t0,
						  i0 + QB, h);
			cp_async_commit();
		}
		if (!a.causal || kw0 <= i0 + QB - 1) {
			float st[QT][4], dpt[QT][4];
#pragma unroll
			for (int nt = 0; nt < QT; nt++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
			for (int kt = 0; kt < KT; kt++) {
				uint32_t ka[4], va[4];
				ldsm4a(ka, ska + kt * 32);
				ldsm4a(va, sva + kt * 32);
#pragma unroll
				for (int nt = 0; nt < QT; nt += 2) {
					uint32_t b[4];
					ldsm4a(b, sqb + n * 2 * SB + nt * 8 * RB + kt * 32);
					mma16816(st[nt], ka, b);
					mma16816(st[nt + 1], ka, b + 2);
					ldsm4a(b, sdob + n * 2 * SB + nt * 8 * RB + kt * 32);
					mma16816(dpt[nt], va, b);
					mma16816(dpt[nt + 1], va, b + 2);
				}
			}
			/* Masks only where the keys cross the diagonal or a block runs past the end. */
			const float *Ls = Lb + n * QB, *Ds = Db + n * QB;
			if ((a.causal && kw0 + 15 > i0) || i0 + QB > a.S || kw0 + 16 > a.S) {
				const int hi = a.S - i0 - 2 * t, big = 1 << 30;
				const int lo[2] = { kr[0] < a.S ? (a.causal ? kr[0] - i0 - 2 * t : -big) : big,
						    kr[1] < a.S ? (a.causal ? kr[1] - i0 - 2 * t : -big) : big };
				bwd2_probs<QT, true>(st, dpt, Ls, Ds, t, lo, hi, a.sl2);
			} else {
				const int lo[2] = { 0, 0 };
				bwd2_probs<QT, false>(st, dpt, Ls, Ds, t, lo, 0, a.sl2);
			}
#pragma unroll
			for (int kt = 0; kt < QB / 16; kt++) {
				uint32_t pa[4] = { pack(st[2 * kt][0], st[2 * kt][1]), pack(st[2 * kt][2], st[2 * kt][3]),
						   pack(st[2 * kt + 1][0], st[2 * kt + 1][1]),
						   pack(st[2 * kt + 1][2], st[2 * kt + 1][3]) };
				uint32_t da[4] = { pack(dpt[2 * kt][0], dpt[2 * kt][1]), pack(dpt[2 * kt][2], dpt[2 * kt][3]),
						   pack(dpt[2 * kt + 1][0], dpt[2 * kt + 1][1]),
						   pack(dpt[2 * kt + 1][2], dpt[2 * kt + 1][3]) };
#pragma unroll
				for (int dt = 0; dt < DT; dt += 2) {
					uint32_t b[4];
					ldsm4ta(b, sdot + n * 2 * SB + kt * 16 * RB + dt * 16);
					mma16816(dv[dt], pa, b);
					mma16816(dv[dt + 1], pa, b + 2);
					ldsm4ta(b, sqt + n * 2 * SB + kt * 16 * RB + dt * 16);
					mma16816(dk[dt], da, b);
					mma16816(dk[dt + 1], da, b + 2);
				}
			}
#pragma unroll
			for (int nt = 0; nt < QT; nt++) {
				*reinterpret_cast<__nv_bfloat162 *>(dSs + (warp * 16 + g) * LDS + nt * 8 + 2 * t) =
					__floats2bfloat162_rn(dpt[nt][0], dpt[nt][1]);
				*reinterpret_cast<__nv_bfloat162 *>(dSs + (warp * 16 + g + 8) * LDS + nt * 8 + 2 * t) =
					__floats2bfloat162_rn(dpt[nt][2], dpt[nt][3]);
			}
		} else {
			/* All 16 keys follow every query of the step: dS^T is zero. */
#pragma unroll
			for (int nt = 0; nt < QT; nt++) {
				*reinterpret_cast<uint32_t *>(dSs + (warp * 16 + g) * LDS + nt * 8 + 2 * t) = 0u;
				*reinterpret_cast<uint32_t *>(dSs + (warp * 16 + g + 8) * LDS + nt * 8 + 2 * t) = 0u;
			}
		}
		__syncthreads();
		/* dQ[QB x D] += scale dS K: this warp's 16 query rows x CW columns, all BKC keys. */
		float acc[NTW][4];
#pragma unroll
		for (int nn = 0; nn < NTW; nn++)
			acc[nn][0] = acc[nn][1] = acc[nn][2] = acc[nn][3] = 0.f;
#pragma unroll
		for (int kt = 0; kt < BKC / 16; kt++) {
			uint32_t aa[4];
			ldsm4ta(aa, sds + kt * 16 * LDS * 2);
#pragma unroll
			for (int nn = 0; nn + 1 < NTW; nn += 2) {
				uint32_t b[4];
				ldsm4ta(b, skt + kt * 16 * RB + nn * 16);
				mma16816(acc[nn], aa, b);
				mma16816(acc[nn + 1], aa, b + 2);
			}
			if (NTW % 2) {
				uint32_t b[2];
				ldsm2ta(b, skt + kt * 16 * RB + (NTW - 1) * 16);
				mma16816(acc[NTW - 1], aa, b);
			}
		}
#pragma unroll
		for (int r = 0; r < 2; r++) {
			const int qi = i0 + qr0 + g + 8 * r;
			if (qi >= a.S)
				continue;
			float *row = a.dq + ((t0 + qi) * a.H + h) * D + dc0 + 2 * t;
#pragma unroll
			for (int nn = 0; nn < NTW; nn++)
				add2(row + nn * 8, acc[nn][2 * r] * a.scale, acc[nn][2 * r + 1] * a.scale);
		}
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		if (kr[r] >= a.S)
			continue;
		const int64_t at = ((t0 + kr[r]) * a.KH + kvh) * D + 2 * t;
#pragma unroll
		for (int dt = 0; dt < DT; dt++) {
			float kx = dk[dt][2 * r] * a.scale, ky = dk[dt][2 * r + 1] * a.scale;
			if (a.atomic_kv) {
				add2(a.dk + at + dt * 8, kx, ky);
				add2(a.dv + at + dt * 8, dv[dt][2 * r], dv[dt][2 * r + 1]);
			} else {
				*reinterpret_cast<float2 *>(a.dk + at + dt * 8) = make_float2(kx, ky);
				*reinterpret_cast<float2 *>(a.dv + at + dt * 8) = make_float2(dv[dt][2 * r], dv[dt][2 * r + 1]);
			}
		}
	}
}

/* RoPE: inv_freq comes from the host (computed there in fp32, as HF computes its buffer). */
#define ROPE_MAX_HALF 256
struct rope_args {
	float inv[ROPE_MAX_HALF];
	const int32_t *pos;
	int64_t pairs;       /* tokens * heads * half */
	int S, H, half;
	float sign;          /* +1 forward, -1 backward (the inverse rotation) */
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float *p, float x) { *p = x; }
__device__ __forceinline__ void from_f(bf16 *p, float x) { *p = __float2bfloat16(x); }

template <typename X>
__global__ void rope_kernel(rope_args a, X *x)
{
	pdl_enter();
	for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < a.pairs;
	     idx += (int64_t)gridDim.x * blockDim.x) {
		int i = (int)(idx % a.half);
		int64_t th = idx / a.half, tok = th / a.H;
		float pos = (float)(a.pos ? a.pos[tok] : (int)(tok % a.S)), s, c;
		sincosf(pos * a.inv[i], &s, &c);
		s *= a.sign;
		X *e = x + th * 2 * a.half;
		float x0 = to_f(e[i]), x1 = to_f(e[i + a.half]);
		from_f(e + i, x0 * c - x1 * s);
		from_f(e + i + a.half, x1 * c + x0 * s);
	}
}

/* Eight consecutive elements as fp32, and back (16-byte aligned: one uint4 of bf16, two float4). */
__device__ __forceinline__ void load8(const bf16 *p, float *v)
{
	uint4 u = *(const uint4 *)p;
	const __nv_bfloat162 *b = (const __nv_bfloat162 *)&u;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		float2 f = __bfloat1622float2(b[j]);
		v[2 * j] = f.x, v[2 * j + 1] = f.y;
	}
}
__device__ __forceinline__ void load8(const float *p, float *v)
{
	float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
	v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16 *p, const float *v)
{
	uint4 u;
	__nv_bfloat162 *b = (__nv_bfloat162 *)&u;
#pragma unroll
	for (int j = 0; j < 4; j++)
		b[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
	*(uint4 *)p = u;
}
__device__ __forceinline__ void store8(float *p, const float *v)
{
	((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
	((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

/* The same rotation a token at a time: its angles once in shared memory (not once per head, as
 * rope_kernel recomputes them), then 8 pairs per thread with 16-byte accesses. half % 8 == 0 and x
 * 16-byte aligned. The angles are computed exactly as rope_kernel does, so the results are the same. */
template <typename X>
__global__ void rope_tok_kernel(rope_args a, X *x, int64_t tokens)
{
	pdl_enter();
	__shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
	int per = a.half / 8, n = a.H * per;
	for (int64_t tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
		__syncthreads(); /* the last token's angles are no longer read */
		for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
			float pos = (float)(a.pos ? a.pos[tok] : (int)(tok % a.S)), s, c;
			sincosf(pos * a.inv[i], &s, &c);
			cs[i] = c, sn[i] = s * a.sign;
		}
		__syncthreads();
		X *row = x + tok * a.H * 2 * a.half;
		for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
			int i0 = (idx % per) * 8;
			X *e = row + (int64_t)(idx / per) * 2 * a.half + i0;
			float x0[8], x1[8], y0[8], y1[8];
			load8(e, x0), load8(e + a.half, x1);
#pragma unroll
			for (int j = 0; j < 8; j++) {
				float c = cs[i0 + j], sv = sn[i0 + j];
				y0[j] = x0[j] * c - x1[j] * sv;
				y1[j] = x1[j] * c + x0[j] * sv;
			}
			store8(e, y0), store8(e + a.half, y1);
		}
	}
}

int cuda_check(const char *what)
{
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return tier_fail(-EIO, "attn: %s failed: %s", what, cudaGetErrorString(e));
	return 0;
}

int check_align(const char *what, const void *p, uintptr_t al)
{
	if ((uintptr_t)p % al)
		return tier_fail(-EINVAL, "attn: on CUDA %s must be %u-byte aligned (device allocations are)", what,
				 (unsigned)al);
	return 0;
}

int check_grid(const tier_attn_params *p)
{
	if (p->seq > (1 << 30) || p->n_heads > 65535 || p->batch > 65535)
		return tier_fail(-EINVAL, "attn: on CUDA seq=%lld must be <= 2^30 and n_heads=%lld, batch=%lld <= 65535; "
				 "split the call", (long long)p->seq, (long long)p->n_heads, (long long)p->batch);
	return 0;
}

size_t fwd_smem(int D) { return (size_t)(BQ + 4 * BK) * (D + 8) * sizeof(bf16); }
size_t bwd_smem(int D)
{
	return (size_t)(2 * BK + 4 * BQB) * (D + 8) * sizeof(bf16) + (size_t)BK * (BQB + 8) * sizeof(bf16) +
	       4 * BQB * sizeof(float);
}

template <int D>
int launch_fwd(const fwd_args &a, dim3 grid, cudaStream_t s)
{
	size_t sm = fwd_smem(D);
	cudaFuncSetAttribute(fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
	tier_launch(fwd_kernel<D>, grid, 128, sm, s, a);
	return cuda_check("attention forward kernel");
}

template <int D>
int launch_bwd(const bwd_args &a, dim3 grid, cudaStream_t s)
{
	size_t sm = bwd_smem(D);
	cudaFuncSetAttribute(bwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
	tier_launch(bwd_kernel<D>, grid, 128, sm, s, a);
	return cuda_check("attention backward kernel");
}

int fwd_v1(const fwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	dim3 grid((unsigned)((p->seq + BQ - 1) / BQ), (unsigned)p->n_heads, (unsigned)p->batch);
	switch (p->head_dim) {
	case 32: return launch_fwd<32>(a, grid, s);
	case 64: return launch_fwd<64>(a, grid, s);
	case 96: return launch_fwd<96>(a, grid, s);
	default: return launch_fwd<128>(a, grid, s);
	}
}

int bwd_v1(const bwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	dim3 grid((unsigned)((p->seq + BK - 1) / BK), (unsigned)p->n_heads, (unsigned)p->batch);
	switch (p->head_dim) {
	case 32: return launch_bwd<32>(a, grid, s);
	case 64: return launch_bwd<64>(a, grid, s);
	case 96: return launch_bwd<96>(a, grid, s);
	default: return launch_bwd<128>(a, grid, s);
	}
}

/* The v2 grids: forward (head + n_heads * sequence, query block), backward (head within its kv
 * group, key block, kv head + n_kv_heads * sequence); y and z take at most 65535. */
bool v2_grid_fits(const tier_attn_params *p, int rows_per_block)
{
	return p->n_heads * p->batch <= INT32_MAX && p->n_kv_heads * p->batch <= 65535 &&
	       (p->seq + rows_per_block - 1) / rows_per_block <= 65535;
}

template <int D, int W, int TM, int MINB>
int launch_fwd2(const fwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	typedef fwd2_cfg<D, W, TM> C;
	dim3 grid((unsigned)(p->n_heads * p->batch), (unsigned)((p->seq + C::BQ2 - 1) / C::BQ2));
	cudaFuncSetAttribute(fwd2_kernel<D, W, TM, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::smem);
	tier_launch(fwd2_kernel<D, W, TM, MINB>, grid, C::THREADS, C::smem, s, a);
	return cuda_check("attention forward kernel");
}

template <int W, int TM, int MINB>
int fwd_v2(const fwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	if (!v2_grid_fits(p, 16 * W * TM))
		return fwd_v1(a, p, s);
	switch (p->head_dim) {
	case 32: return launch_fwd2<32, W, TM, MINB>(a, p, s);
	case 64: return launch_fwd2<64, W, TM, MINB>(a, p, s);
	case 96: return launch_fwd2<96, W, TM, MINB>(a, p, s);
	default: return launch_fwd2<128, W, TM, MINB>(a, p, s);
	}
}

template <int D, int W, int BQB_, int MINB>
int launch_bwd2(const bwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	typedef bwd2_cfg<D, W, BQB_> C;
	dim3 grid((unsigned)(p->n_heads / p->n_kv_heads), (unsigned)((p->seq + C::BKC - 1) / C::BKC),
		  (unsigned)(p->n_kv_heads * p->batch));
	cudaFuncSetAttribute(bwd2_kernel<D, W, BQB_, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::smem);
	tier_launch(bwd2_kernel<D, W, BQB_, MINB>, grid, C::THREADS, C::smem, s, a);
	return cuda_check("attention backward kernel");
}

template <int W, int BQB_, int MINB>
int bwd_v2(const bwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	if (!v2_grid_fits(p, 16 * W))
		return bwd_v1(a, p, s);
	switch (p->head_dim) {
	case 32: return launch_bwd2<32, W, BQB_, MINB>(a, p, s);
	case 64: return launch_bwd2<64, W, BQB_, MINB>(a, p, s);
	case 96: return launch_bwd2<96, W, BQB_, MINB>(a, p, s);
	default: return launch_bwd2<128, W, BQB_, MINB>(a, p, s);
	}
}

/* The variants, chosen at each call by TIER_ATTN_FWD and TIER_ATTN_BWD (unset or empty: the first
 * entry). Registers and shared memory per CTA at head_dim 128 on sm_90a (ptxas -v); per key block
 * counts are per warp.
 * fwd  v2: 4 warps x 32 query rows (128 per CTA), 255 regs, 104448 B: 2 CTAs (8 warps) per SM.
 *          Each K and V fragment feeds two 16-row products: 80 ldmatrix per 256 mma a 64-key
 *          block, the fewest of these layouts (flash-attention 2's tile at head_dim 128 on sm_90).
 *          ptxas keeps 16 bytes of loop-invariant loader offsets on the stack (4 loads a block,
 *          outside the products); v1 spilled 120 bytes.
 *      w8: 8 warps x 16 rows (128 per CTA), 128 regs (capped for 2 CTAs), 104448 B: 16 warps
 *          per SM, twice v2's, to hide latency; costs 72 ldmatrix per 128 mma, so it only wins
 *          if v2 is latency-bound rather than shared-memory-bound. 20 bytes of loop-invariant
 *          stack as in v2.
 *      v1: the original kernel (255 regs, 120 bytes of spills, runtime masks on every block).
 *      wg: attn_wgmma.cu's kernel on wgmma and TMA (head_dim 128 on compute capability 9.0; v2
 *          elsewhere): 2 consumer warpgroups x 64 rows and a loading warp, 128-key blocks, 168
 *          regs (8 bytes of spill), 164864 B: 1 CTA per SM. The default from its first GPU run
 *          (2026-12-05, session 17: test_attn_cuda passed; 0.269 ms against v2's 0.432) to wgo's.
 *     wgo: wg with the softmax of each key block beside the previous block's P V products, a
 *          loading warpgroup whose registers go to the consumers (setmaxnreg: 240 a consumer
 *          thread), three stages, 225 KiB; the same bits as wg. The default since its first GPU
 *          run (2026-12-06, session 27, H100: test_attn_cuda passed, o and lse equal to wg's;
 *          0.258 ms against wg's 0.286, the trainer's (a) +0.4%).
 * bwd  wg: attn_wgmma_bwd.cu's kernel (the same conditions, else q64): 2 warpgroups x 64 keys,
 *          warp 0 also loading, 64-query steps in a 3-stage TMA ring, dS through shared memory for
 *          dQ; 236 regs, 199168 B. The default since the same run (0.916 ms against q64's 1.484).
 * bwd  k128: 8 warps x 16 keys (128 keys per CTA), 32-query steps, 240 regs, 115200 B: 1 CTA
 *          (8 warps) per SM. Half the fp32 dQ atomics per FLOP of 64-key CTAs (each step adds
 *          a 32 x D tile per CTA) and half the Q and dO traffic; flash-attention 2 also uses 128
 *          keys and 8 warps at head_dim 128.
 *      q64: k128 with 64-query steps: the K and V fragments of a warp serve twice the queries and
 *          there are half the barriers; 254 regs (64 score and 64 dP accumulators next to dK
 *          and dV), 158720 B.
 *      v2: 4 warps x 16 keys (64 keys per CTA, v1's tile), 32-query steps, 240 regs, 75264 B:
 *          2 CTAs per SM, v1's atomics.
 *      v1: the original kernel (244 regs).
 * Measured on an H200 (tier-bench attn, 1 x 4096 tokens, 32 / 4 heads, head_dim 128, causal;
 * bench/RESULTS.md): forward v2 0.428 ms, w8 0.487, v1 0.892; forward+backward with v2 forward:
 * q64 1.910 ms, k128 2.017, v2 2.154, v1 (with v1 forward) 3.038, hence v2 and q64 as the defaults
 * until session 17's run of the wgmma pair: forward+backward 1.179 ms (408 TFLOP/s; torch's SDPA
 * 1.194 in the same call) against v2 + q64's 1.913, and the trainer's (a) +13.9%.
 * No v2 variant spills inside its loops. A grid past the v2 limits (over 65535 blocks of one head,
 * n_heads * batch over 2^31, n_kv_heads * batch over 65535) runs v1.
 * Not done: a separate dQ pass without atomics (one CTA per query block recomputing P and dP):
 * 7 products instead of 5, and with 16-row warps it loads K twice and V once per product step,
 * ~1 ldmatrix per mma against ~0.6 here, so shared memory bounds it below k128 unless the dQ
 * atomics are the bottleneck (ncu: lts__t_sectors_op_red against the L2 peak would tell). */
/* wg: the wgmma forward (attn_wgmma.cu) where it applies, else v2. */
int fwd_wg(const fwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	int rc = attn_wgmma_fwd(p, a.q, a.k, a.v, a.o, a.lse, a.sl2, 0, s);
	return rc == -ENOTSUP ? fwd_v2<4, 2, 2>(a, p, s) : rc;
}

/* wgo: wg with each block's softmax beside the previous block's P V (the same bits), else v2. */
int fwd_wgo(const fwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	int rc = attn_wgmma_fwd(p, a.q, a.k, a.v, a.o, a.lse, a.sl2, 1, s);
	return rc == -ENOTSUP ? fwd_v2<4, 2, 2>(a, p, s) : rc;
}

/* wg: the wgmma backward (attn_wgmma_bwd.cu) where it applies, else q64. */
int bwd_wg(const bwd_args &a, const tier_attn_params *p, cudaStream_t s)
{
	int rc = attn_wgmma_bwd(p, a.q, a.k, a.v, a.dout, a.lse, a.Di, a.dq, a.dk, a.dv, a.scale, a.sl2, a.atomic_kv,
				&a.sw, s);
	return rc == -ENOTSUP ? bwd_v2<8, 64, 1>(a, p, s) : rc;
}

typedef int (*fwd_fn)(const fwd_args &, const tier_attn_params *, cudaStream_t);
typedef int (*bwd_fn)(const bwd_args &, const tier_attn_params *, cudaStream_t);
struct fwd_variant {
	const char *name;
	fwd_fn fn;
};
struct bwd_variant {
	const char *name;
	bwd_fn fn;
};
const fwd_variant fwd_variants[] = {
	{ "wgo", fwd_wgo },
	{ "wg", fwd_wg },
	{ "v2", fwd_v2<4, 2, 2> },
	{ "w8", fwd_v2<8, 1, 2> },
	{ "v1", fwd_v1 },
};
const bwd_variant bwd_variants[] = {
	{ "wg", bwd_wg },
	{ "q64", bwd_v2<8, 64, 1> },
	{ "k128", bwd_v2<8, 32, 1> },
	{ "v2", bwd_v2<4, 32, 2> },
	{ "v1", bwd_v1 },
};

/* Index of the variant named by env in table (n entries): 0 when unset or empty; -EINVAL with the
 * list of names when unknown. */
template <typename V>
int pick_variant(const char *env, const V *table, int n)
{
	const char *want = getenv(env);
	char names[128] = "";
	if (!want || !*want)
		return 0;
	for (int i = 0; i < n; i++) {
		if (!strcmp(want, table[i].name))
			return i;
		strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
		strncat(names, table[i].name, sizeof names - strlen(names) - 1);
	}
	return tier_fail(-EINVAL, "attn: %s=%s is not a kernel variant; use one of %s (or unset it for %s)", env, want,
			 names, table[0].name);
}

} /* namespace */

extern "C" size_t attn_cuda_ws_bytes(const tier_attn_params *p)
{
	return (size_t)(p->batch * p->seq * p->n_heads) * sizeof(float);
}

extern "C" int attn_cuda_fwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
			     const void *v, void *o, float *lse)
{
	const char *names[] = { "q", "k", "v", "o" };
	const void *ptrs[] = { q, k, v, o };
	int rc = check_grid(p), var;
	for (int i = 0; i < 4 && !rc; i++)
		rc = check_align(names[i], ptrs[i], 16);
	if (rc)
		return rc;
	if ((var = pick_variant("TIER_ATTN_FWD", fwd_variants, (int)(sizeof fwd_variants / sizeof fwd_variants[0]))) < 0)
		return var;
	fwd_args a = { (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (bf16 *)o, lse, (int)p->seq,
		       (int)p->n_heads, (int)p->n_kv_heads, (int)(p->n_heads / p->n_kv_heads), p->causal,
		       p->scale * LOG2E };
	return fwd_variants[var].fn(a, p, (cudaStream_t)tier_dev_stream(dev));
}

extern "C" int attn_cuda_bwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
			     const void *v, const void *o, const float *lse, const void *dout, float *dq, float *dk,
			     float *dv, void *ws)
{
	const char *names[] = { "q", "k", "v", "o", "dout", "dq", "dk", "dv" };
	const void *ptrs[] = { q, k, v, o, dout, dq, dk, dv };
	int rc = check_grid(p), var;
	for (int i = 0; i < 8 && !rc; i++)
		rc = check_align(names[i], ptrs[i], i < 5 ? 16 : 8);
	if (rc)
		return rc;
	if ((var = pick_variant("TIER_ATTN_BWD", bwd_variants, (int)(sizeof bwd_variants / sizeof bwd_variants[0]))) < 0)
		return var;
	attn_bwd_switches sw; /* the wgmma kernel's, read (and checked) whichever kernel runs */
	if ((rc = attn_bwd_switches_read(&sw)))
		return rc;
	const int64_t rows = p->batch * p->seq * p->n_heads, G = p->n_heads / p->n_kv_heads;
	const size_t kv_bytes = (size_t)(p->batch * p->seq * p->n_kv_heads * p->head_dim) * sizeof(float);
	cudaStream_t s = (cudaStream_t)tier_dev_stream(dev);
	bwd_args a = { (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (const bf16 *)dout, lse, (float *)ws,
		       dq, dk, dv, (int)p->seq, (int)p->n_heads, (int)p->n_kv_heads, (int)G, p->causal, G > 1,
		       p->scale, p->scale * LOG2E, sw };
	unsigned rb = (unsigned)((rows + 3) / 4);
	if (p->head_dim % 4 == 0 && (uintptr_t)o % 8 == 0 && (uintptr_t)dout % 8 == 0)
		tier_launch(rowdot_kernel<4>, rb, 128, 0, s, (const bf16 *)o, (const bf16 *)dout, (float *)ws, rows,
				(int)p->head_dim);
	else
		tier_launch(rowdot_kernel<2>, rb, 128, 0, s, (const bf16 *)o, (const bf16 *)dout, (float *)ws, rows,
				(int)p->head_dim);
	if ((rc = cuda_check("attention backward row sums")))
		return rc;
	if (tier_cuda_fill(dq, 0, (size_t)(rows * p->head_dim) * sizeof(float), s) != cudaSuccess ||
	    (G > 1 && (tier_cuda_fill(dk, 0, kv_bytes, s) != cudaSuccess || tier_cuda_fill(dv, 0, kv_bytes, s) != cudaSuccess)))
		return cuda_check("clearing the attention gradients");
	return bwd_variants[var].fn(a, p, s);
}

extern "C" int attn_cuda_rope(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *x, int inverse)
{
	rope_args a;
	const int64_t half = r->head_dim / 2;
	cudaStream_t s = (cudaStream_t)tier_dev_stream(dev);
	if (half > ROPE_MAX_HALF || r->seq > INT32_MAX || r->n_heads > INT32_MAX)
		return tier_fail(-EINVAL, "attn: rope on CUDA takes head_dim <= %d (got %lld)", 2 * ROPE_MAX_HALF,
				 (long long)r->head_dim);
	if ((uintptr_t)x % (inverse ? 4 : 2))
		return tier_fail(-EINVAL, "attn: rope: x is misaligned for its element type");
	for (int64_t i = 0; i < half; i++)
		a.inv[i] = 1.0f / powf(r->theta, (float)(2 * i) / (float)r->head_dim);
	a.pos = pos, a.pairs = r->tokens * r->n_heads * half;
	a.S = (int)r->seq, a.H = (int)r->n_heads, a.half = (int)half, a.sign = inverse ? -1.f : 1.f;
	if (half % 8 == 0 && (uintptr_t)x % 16 == 0) {
		unsigned tb = (unsigned)(r->tokens < 65536 ? r->tokens : 65536);
		if (tb == 0)
			return 0;
		if (inverse)
			tier_launch(rope_tok_kernel<float>, tb, 128, 0, s, a, (float *)x, r->tokens);
		else
			tier_launch(rope_tok_kernel<bf16>, tb, 128, 0, s, a, (bf16 *)x, r->tokens);
		return cuda_check("rope kernel");
	}
	unsigned blocks = (unsigned)((a.pairs + 255) / 256 < 65536 ? (a.pairs + 255) / 256 : 65536);
	if (inverse)
		tier_launch(rope_kernel<float>, blocks, 256, 0, s, a, (float *)x);
	else
		tier_launch(rope_kernel<bf16>, blocks, 256, 0, s, a, (bf16 *)x);
	return cuda_check("rope kernel");
}
