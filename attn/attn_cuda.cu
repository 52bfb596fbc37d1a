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
 * Fragments come from shared memory through ldmatrix (padded rows: no bank conflicts). */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "attn/attn_impl.h"

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
};

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2])
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

/* Four 8x8 bf16 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8.
 * With .trans each matrix arrives transposed. */
__device__ __forceinline__ void ldsm4(uint32_t r[4], const bf16 *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm4t(uint32_t r[4], const bf16 *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

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

/* 16 bytes global -> shared without passing through registers; zero-filled when !valid. */
__device__ __forceinline__ void cp_async16(void *sm, const void *gm, bool valid)
{
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(sm)), "l"(gm),
		     "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit()
{
	asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
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

__device__ __forceinline__ float quad_max(float x)
{
	x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
	return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x)
{
	x += __shfl_xor_sync(0xffffffffu, x, 1);
	return x + __shfl_xor_sync(0xffffffffu, x, 2);
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

template <int D>
__global__ void __launch_bounds__(128) fwd_kernel(fwd_args a)
{
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
				for (int mi = 0; mi < MT; mi++) {
					pa[mi][0] = pack(s[mi][2 * kt][0], s[mi][2 * kt][1]);
					pa[mi][1] = pack(s[mi][2 * kt][2], s[mi][2 * kt][3]);
					pa[mi][2] = pack(s[mi][2 * kt + 1][0], s[mi][2 * kt + 1][1]);
					pa[mi][3] = pack(s[mi][2 * kt + 1][2], s[mi][2 * kt + 1][3]);
				}
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
#pragma unroll
	for (int mi = 0; mi < MT; mi++)
#pragma unroll
		for (int r = 0; r < 2; r++) {
			float sum = quad_sum(l[mi][r]), inv = 1.f / sum;
			int qi = r0 + mi * 16 + g + 8 * r;
			if (qi >= a.S)
				continue;
			bf16 *row = a.o + ((t0 + qi) * a.H + h) * D;
#pragma unroll
			for (int dt = 0; dt < DT; dt++)
				*reinterpret_cast<__nv_bfloat162 *>(row + dt * 8 + 2 * t) =
					__floats2bfloat162_rn(o[mi][dt][2 * r] * inv, o[mi][dt][2 * r + 1] * inv);
			if (t == 0)
				a.lse[(t0 + qi) * a.H + h] = (m[mi][r] + log2f(sum)) * LN2;
		}
}

/* D_i = rowsum(dout_i * o_i), one warp per row (bf16 pairs, fp32 sum). */
__global__ void rowdot_kernel(const bf16 *o, const bf16 *dout, float *Di, int64_t rows, int D)
{
	int64_t row = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
	int lane = threadIdx.x & 31;
	float s = 0.f;
	if (row >= rows)
		return;
	for (int d = 2 * lane; d < D; d += 64) {
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
	fwd_kernel<D><<<grid, 128, sm, s>>>(a);
	return cuda_check("attention forward kernel");
}

template <int D>
int launch_bwd(const bwd_args &a, dim3 grid, cudaStream_t s)
{
	size_t sm = bwd_smem(D);
	cudaFuncSetAttribute(bwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
	bwd_kernel<D><<<grid, 128, sm, s>>>(a);
	return cuda_check("attention backward kernel");
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
	int rc = check_grid(p);
	for (int i = 0; i < 4 && !rc; i++)
		rc = check_align(names[i], ptrs[i], 16);
	if (rc)
		return rc;
	fwd_args a = { (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (bf16 *)o, lse, (int)p->seq,
		       (int)p->n_heads, (int)p->n_kv_heads, (int)(p->n_heads / p->n_kv_heads), p->causal,
		       p->scale * LOG2E };
	dim3 grid((unsigned)((p->seq + BQ - 1) / BQ), (unsigned)p->n_heads, (unsigned)p->batch);
	cudaStream_t s = (cudaStream_t)tier_dev_stream(dev);
	switch (p->head_dim) {
	case 32: return launch_fwd<32>(a, grid, s);
	case 64: return launch_fwd<64>(a, grid, s);
	case 96: return launch_fwd<96>(a, grid, s);
	default: return launch_fwd<128>(a, grid, s);
	}
}

extern "C" int attn_cuda_bwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
			     const void *v, const void *o, const float *lse, const void *dout, float *dq, float *dk,
			     float *dv, void *ws)
{
	const char *names[] = { "q", "k", "v", "o", "dout", "dq", "dk", "dv" };
	const void *ptrs[] = { q, k, v, o, dout, dq, dk, dv };
	int rc = check_grid(p);
	for (int i = 0; i < 8 && !rc; i++)
		rc = check_align(names[i], ptrs[i], i < 5 ? 16 : 8);
	if (rc)
		return rc;
	const int64_t rows = p->batch * p->seq * p->n_heads, G = p->n_heads / p->n_kv_heads;
	const size_t kv_bytes = (size_t)(p->batch * p->seq * p->n_kv_heads * p->head_dim) * sizeof(float);
	cudaStream_t s = (cudaStream_t)tier_dev_stream(dev);
	bwd_args a = { (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, (const bf16 *)dout, lse, (float *)ws,
		       dq, dk, dv, (int)p->seq, (int)p->n_heads, (int)p->n_kv_heads, (int)G, p->causal, G > 1,
		       p->scale, p->scale * LOG2E };
	rowdot_kernel<<<(unsigned)((rows + 3) / 4), 128, 0, s>>>((const bf16 *)o, (const bf16 *)dout, (float *)ws, rows,
								  (int)p->head_dim);
	if ((rc = cuda_check("attention backward row sums")))
		return rc;
	if (cudaMemsetAsync(dq, 0, (size_t)(rows * p->head_dim) * sizeof(float), s) != cudaSuccess ||
	    (G > 1 && (cudaMemsetAsync(dk, 0, kv_bytes, s) != cudaSuccess ||
		       cudaMemsetAsync(dv, 0, kv_bytes, s) != cudaSuccess)))
		return cuda_check("clearing the attention gradients");
	dim3 grid((unsigned)((p->seq + BK - 1) / BK), (unsigned)p->n_heads, (unsigned)p->batch);
	switch (p->head_dim) {
	case 32: return launch_bwd<32>(a, grid, s);
	case 64: return launch_bwd<64>(a, grid, s);
	case 96: return launch_bwd<96>(a, grid, s);
	default: return launch_bwd<128>(a, grid, s);
	}
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
	unsigned blocks = (unsigned)((a.pairs + 255) / 256 < 65536 ? (a.pairs + 255) / 256 : 65536);
	if (inverse)
		rope_kernel<float><<<blocks, 256, 0, s>>>(a, (float *)x);
	else
		rope_kernel<bf16><<<blocks, 256, 0, s>>>(a, (bf16 *)x);
	return cuda_check("rope kernel");
}
