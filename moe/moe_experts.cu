/* moe_experts.cu - the SwiGLU experts on CUDA with LoRA, forward and backward: one cuBLASLt product
 * per expert and projection (bf16 in, fp32 accumulate), the SwiGLU epilogue and its backward as
 * elementwise kernels over all rows at once. The per-expert loop needs the offsets on the host
 * (the layer reads them with one synchronisation). LoRA as (X A^T) B^T through a [rows, r] bf16
 * intermediate, never forming B A. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/gemm_cuda.h"
#include "base/pdl.cuh"
#include "moe/moe_swiglu.cuh"

/* ---- the products: row-major views of the library's one cuBLASLt call (base/gemm_cuda.cu) ---- */
extern "C" int moe_cuda_mm(tier_dev *dev, int ta, int tb, int M, int N, int K, float alpha, const void *A, int lda,
			   const void *B, int ldb, float beta, void *C, int ldc, int c_bf16)
{
	return moe_cuda_mm_lane(dev, -1, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, c_bf16);
}

extern "C" int moe_cuda_mm_lane(tier_dev *dev, int lane, int ta, int tb, int M, int N, int K, float alpha,
				const void *A, int lda, const void *B, int ldb, float beta, void *C, int ldc, int c_bf16)
{
	if (M <= 0 || N <= 0 || K <= 0)
		return tier_fail(-EINVAL, "moe_cuda_mm: empty product %dx%dx%d", M, N, K);
	/* row-major C [M, N] = op(A) op(B) is column-major C^T [N, M] = op(B)^T op(A)^T: the stored B is
	 * cuBLAS's first operand, transposed as we transpose B, and A its second */
	tier_gemm_operand a = { tb, B, CUDA_R_16BF, ldb }, b = { ta, A, CUDA_R_16BF, lda };
	return tier_cuda_gemm(dev, lane, "moe_cuda_mm", N, M, K, alpha, a, b, beta, C, c_bf16 ? CUDA_R_16BF : CUDA_R_32F,
			      ldc);
}

/* ---- elementwise SwiGLU over bf16 g and u, in fp32 (moe_swiglu.cuh) ----
 * V = 2: a bf16 pair a thread, 4-byte loads and stores (every bf16 pointer 4-byte aligned; an odd
 * n's last element goes alone); V = 1: one element a thread, for any alignment. */
static int grid_of(size_t n)
{
	size_t b = (n + 255) / 256;
	return (int)(b < 8192 ? (b ? b : 1) : 8192);
}

/* V = 8: eight elements a thread in 16-byte accesses (g, u, h 16-byte aligned; the tail past the
 * last whole eight one at a time): the backward's recompute of h ran at half the copy's rate on
 * pairs. */
template <int V>
__global__ void swiglu_kernel(const bf16 *g, const bf16 *u, size_t n, bf16 *h)
{
	pdl_enter();
	size_t step = V * (size_t)gridDim.x * blockDim.x;
	for (size_t i = V * (blockIdx.x * (size_t)blockDim.x + threadIdx.x); i < n; i += step) {
		if (V == 8 && i + 8 <= n) {
			uint4 gv = *(const uint4 *)(g + i), uv = *(const uint4 *)(u + i), hv;
			const __nv_bfloat162 *g2 = (const __nv_bfloat162 *)&gv, *u2 = (const __nv_bfloat162 *)&uv;
			__nv_bfloat162 *h2 = (__nv_bfloat162 *)&hv;
#pragma unroll
			for (int j = 0; j < 4; j++) {
				float2 x = __bfloat1622float2(g2[j]), y = __bfloat1622float2(u2[j]);
				h2[j] = __floats2bfloat162_rn(silu_mul(x.x, y.x), silu_mul(x.y, y.y));
			}
			*(uint4 *)(h + i) = hv;
		} else if (V == 8) {
			for (size_t t = i; t < n; t++)
				h[t] = __float2bfloat16(silu_mul(__bfloat162float(g[t]), __bfloat162float(u[t])));
		} else if (V == 2 && i + 1 < n) {
			float2 x = moe_get2(g + i), y = moe_get2(u + i);
			moe_set2(h + i, silu_mul(x.x, y.x), silu_mul(x.y, y.y));
		} else {
			h[i] = __float2bfloat16(silu_mul(__bfloat162float(g[i]), __bfloat162float(u[i])));
		}
	}
}

/* dh's element i as fp32: dh fp32, or bf16 where the product that made it rounded it (the fused
 * LoRA backward's, TIER_MOE_DH16). */
static __device__ __forceinline__ float dh_at(const float *dh, size_t i) { return dh[i]; }
static __device__ __forceinline__ float dh_at(const bf16 *dh, size_t i) { return __bfloat162float(dh[i]); }

/* Eight elements of dh from i (16-byte aligned). */
static __device__ __forceinline__ void dh_at8(const float *dh, size_t i, float (&d)[8])
{
	float4 d0 = *(const float4 *)(dh + i), d1 = *(const float4 *)(dh + i + 4);
	d[0] = d0.x, d[1] = d0.y, d[2] = d0.z, d[3] = d0.w, d[4] = d1.x, d[5] = d1.y, d[6] = d1.z, d[7] = d1.w;
}
static __device__ __forceinline__ void dh_at8(const bf16 *dh, size_t i, float (&d)[8])
{
	bf16x8_to_f32(*(const uint4 *)(dh + i), d);
}

/* The backward at element i (V = 1) or the pair i, i + 1 (V = 2): dg, du written; with DOT, the
 * element's (pair's) share of dh . silu(g) u returned. */
template <int V, bool DOT, typename DT>
static __device__ __forceinline__ float swiglu_bwd_at(const bf16 *g, const bf16 *u, const DT *dh, size_t i, bf16 *dg,
						      bf16 *du)
{
	if (V == 2) {
		float2 x = moe_get2(g + i), y = moe_get2(u + i);
		float d0 = dh_at(dh, i), d1 = dh_at(dh, i + 1);
		float2 a = swiglu_d(x.x, y.x, d0), b = swiglu_d(x.y, y.y, d1);
		moe_set2(dg + i, a.x, b.x);
		moe_set2(du + i, a.y, b.y);
		return DOT ? d0 * silu_mul(x.x, y.x) + d1 * silu_mul(x.y, y.y) : 0.0f;
	}
	float x = __bfloat162float(g[i]), y = __bfloat162float(u[i]), d = dh_at(dh, i);
	float2 a = swiglu_d(x, y, d);
	dg[i] = __float2bfloat16(a.x);
	du[i] = __float2bfloat16(a.y);
	return DOT ? d * silu_mul(x, y) : 0.0f;
}

/* The same for the eight elements from i (16-byte aligned in g, u, dg and du, dh too): every load
 * issued before the arithmetic, 16-byte accesses (a pair at a time left the rows kernel at half the
 * copy's rate). */
template <bool DOT, typename DT>
static __device__ __forceinline__ float swiglu_bwd_at8(const bf16 *g, const bf16 *u, const DT *dh, size_t i,
						       bf16 *dg, bf16 *du)
{
	uint4 gv = *(const uint4 *)(g + i), uv = *(const uint4 *)(u + i), og, ou;
	float d[8];
	dh_at8(dh, i, d);
	float dot = swiglu_bwd8<DOT>(gv, uv, d, og, ou);
	*(uint4 *)(dg + i) = og;
	*(uint4 *)(du + i) = ou;
	return dot;
}

template <int V>
__global__ void swiglu_bwd_kernel(const bf16 *g, const bf16 *u, const float *dh, size_t n, bf16 *dg, bf16 *du)
{
	pdl_enter();
	size_t step = V * (size_t)gridDim.x * blockDim.x;
	for (size_t i = V * (blockIdx.x * (size_t)blockDim.x + threadIdx.x); i < n; i += step) {
		if (V == 2 && i + 1 < n)
			swiglu_bwd_at<2, false, float>(g, u, dh, i, dg, du);
		else
			swiglu_bwd_at<1, false, float>(g, u, dh, i, dg, du);
	}
}

/* The same with the dot of each row's dh and silu(g) u into row_dot (the router weight's gradient
 * times the weight, moe.h's row_dot): a warp a row, V as above (V = 2 needs an even I) or 8
 * (swiglu_bwd_at8: I a multiple of 8, the arrays 16-byte aligned). */
template <int V, typename DT>
__global__ void swiglu_bwd_rows_kernel(const bf16 *g, const bf16 *u, const DT *dh, size_t rows, int I, bf16 *dg,
				       bf16 *du, float *row_dot)
{
	pdl_enter();
	int lane = threadIdx.x & 31;
	size_t warps = (size_t)gridDim.x * (blockDim.x >> 5);
	for (size_t r = blockIdx.x * (size_t)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
		float dot = 0.0f;
		for (int i = V * lane; i < I; i += 32 * V)
			dot += V == 8 ? swiglu_bwd_at8<true>(g, u, dh, r * I + i, dg, du)
				      : swiglu_bwd_at<V, true, DT>(g, u, dh, r * I + i, dg, du);
		for (int m = 16; m; m >>= 1)
			dot += __shfl_xor_sync(0xffffffffu, dot, m);
		if (lane == 0)
			row_dot[r] = dot;
	}
}

__global__ void moe_to_bf16_kernel(size_t n, const float *x, bf16 *y)
{
	pdl_enter();
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
		y[i] = __float2bfloat16(x[i]);
}

extern "C" int moe_cuda_to_bf16(tier_dev *dev, size_t n, const float *x, void *y)
{
	if (n) {
		tier_launch(moe_to_bf16_kernel, grid_of(n), 256, 0, moe_stream(dev), n, x, (bf16 *)y);
		CUDA_LAUNCHED();
	}
	return 0;
}

static int pairs_aligned(const void *a, const void *b, const void *c, const void *d)
{
	return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) & 3) == 0;
}

extern "C" int moe_cuda_swiglu(tier_dev *dev, size_t n, const void *g, const void *u, void *h)
{
	const bf16 *gb = (const bf16 *)g, *ub = (const bf16 *)u;
	if (!n)
		return 0;
	if (moe_a16(g) && moe_a16(u) && moe_a16(h))
		tier_launch(swiglu_kernel<8>, grid_of((n + 7) / 8), 256, 0, moe_stream(dev), gb, ub, n, (bf16 *)h);
	else if (pairs_aligned(g, u, h, h))
		tier_launch(swiglu_kernel<2>, grid_of((n + 1) / 2), 256, 0, moe_stream(dev), gb, ub, n, (bf16 *)h);
	else
		tier_launch(swiglu_kernel<1>, grid_of(n), 256, 0, moe_stream(dev), gb, ub, n, (bf16 *)h);
	CUDA_LAUNCHED();
	return 0;
}

/* The rows kernel (a warp a row, each row's dot) in the widest form the alignment allows. */
template <typename DT>
static int swiglu_bwd_rows(tier_dev *dev, size_t rows, int I, const bf16 *gb, const bf16 *ub, const DT *dh, void *dg,
			   void *du, float *row_dot)
{
	size_t b = (rows + 7) / 8;
	int grid = (int)(b < 8192 ? b : 8192);
	cudaStream_t st = moe_stream(dev);
	if (I % 8 == 0 && moe_a16(gb) && moe_a16(ub) && moe_a16(dg) && moe_a16(du) && moe_a16(dh))
		tier_launch(swiglu_bwd_rows_kernel<8, DT>, grid, 256, 0, st, gb, ub, dh, rows, I, (bf16 *)dg,
				(bf16 *)du, row_dot);
	else if (I % 2 == 0 && pairs_aligned(gb, ub, dg, du)) /* dh read an element at a time */
		tier_launch(swiglu_bwd_rows_kernel<2, DT>, grid, 256, 0, st, gb, ub, dh, rows, I, (bf16 *)dg,
				(bf16 *)du, row_dot);
	else
		tier_launch(swiglu_bwd_rows_kernel<1, DT>, grid, 256, 0, st, gb, ub, dh, rows, I, (bf16 *)dg,
				(bf16 *)du, row_dot);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_swiglu_bwd16(tier_dev *dev, size_t rows, int I, const void *g, const void *u, const void *dh,
				     void *dg, void *du, float *row_dot)
{
	if (!row_dot)
		return tier_fail(-EINVAL, "moe_cuda_swiglu_bwd16: the rows' dot is required");
	if (!rows || !I)
		return 0;
	return swiglu_bwd_rows(dev, rows, I, (const bf16 *)g, (const bf16 *)u, (const bf16 *)dh, dg, du, row_dot);
}

extern "C" int moe_cuda_swiglu_bwd(tier_dev *dev, size_t rows, int I, const void *g, const void *u, const float *dh,
				   void *dg, void *du, float *row_dot)
{
	const bf16 *gb = (const bf16 *)g, *ub = (const bf16 *)u;
	size_t n = rows * (size_t)I;
	if (!n)
		return 0;
	if (row_dot)
		return swiglu_bwd_rows(dev, rows, I, gb, ub, dh, dg, du, row_dot);
	if (pairs_aligned(g, u, dg, du))
		tier_launch(swiglu_bwd_kernel<2>, grid_of((n + 1) / 2), 256, 0, moe_stream(dev), gb, ub, dh, n,
				(bf16 *)dg, (bf16 *)du);
	else
		tier_launch(swiglu_bwd_kernel<1>, grid_of(n), 256, 0, moe_stream(dev), gb, ub, dh, n, (bf16 *)dg,
				(bf16 *)du);
	CUDA_LAUNCHED();
	return 0;
}

/* ---- per-expert pointers ---- */
struct ex_w {
	const bf16 *gate, *up, *down;
};

static ex_w ex_of(const tier_moe_experts *w, int e, int I, int H)
{
	ex_w r;
	if (w->gate_up) {
		const bf16 *b = (const bf16 *)w->gate_up[e], *second = b ? b + (size_t)I * H : NULL;
		r.gate = w->order == TIER_MOE_UP_FIRST ? second : b;
		r.up = w->order == TIER_MOE_UP_FIRST ? b : second;
	} else {
		r.gate = (const bf16 *)w->gate[e];
		r.up = (const bf16 *)w->up[e];
	}
	r.down = (const bf16 *)w->down[e];
	return r;
}

extern "C" int moe_cuda_experts_check(const char *fn, int E, const int32_t *off, const tier_moe_experts *w,
				      const tier_moe_loras *lora)
{
	MOE_NONNULL(w, fn);
	MOE_NONNULL(w->down, fn);
	if (!w->gate_up && (!w->gate || !w->up))
		return tier_fail(-EINVAL, "%s: expert weights need gate and up, or gate_up", fn);
	if (off[0] != 0)
		return tier_fail(-EINVAL, "%s: offsets[0] = %d; it must be 0", fn, off[0]);
	for (int e = 0; e < E; e++) {
		if (off[e + 1] < off[e])
			return tier_fail(-EINVAL, "%s: offsets decrease at expert %d", fn, e);
		if (off[e + 1] == off[e])
			continue;
		const void *g = w->gate_up ? w->gate_up[e] : w->gate[e], *u = w->gate_up ? w->gate_up[e] : w->up[e];
		if (!g || !u || !w->down[e])
			return tier_fail(-EINVAL, "%s: expert %d has %d rows but a NULL weight; acquire it from the store first",
					 fn, e, off[e + 1] - off[e]);
	}
	for (int q = 0; q < 3 && lora; q++) {
		const tier_moe_lora *l = moe_lora_of(lora, q);
		const char *name = q == 0 ? "gate" : q == 1 ? "up" : "down";
		if (!l->a && !l->b)
			continue;
		if (!l->a || !l->b)
			return tier_fail(-EINVAL, "%s: LoRA on %s has only one of A and B; give both or neither", fn, name);
		if (l->rank < 1 || l->rank > 4096 || !isfinite(l->scale))
			return tier_fail(-EINVAL, "%s: LoRA on %s: rank %d must be 1..4096 and scale finite", fn, name, l->rank);
		for (int e = 0; e < E; e++)
			if (off[e + 1] > off[e] && (!l->a[e] || !l->b[e]))
				return tier_fail(-EINVAL, "%s: LoRA on %s of expert %d (which has rows) is NULL", fn, name, e);
	}
	return 0;
}

/* Y [n, out] += (s X A^T) B^T through Z [n, r] bf16 (s in Z, as the wgmma path's segments need it);
 * Y fp32 or bf16. */
static int lora_fwd(tier_dev *dev, int ln, const tier_moe_lora *l, int e, int n, int in, int out, const bf16 *X,
		    void *Y, int y_bf16, bf16 *Z)
{
	if (!moe_lora_on(l))
		return 0;
	int r = l->rank, rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, r, in, l->scale, X, in, l->a[e], in, 0.0f, Z, r, 1);
	return rc ? rc : moe_cuda_mm_lane(dev, ln, 0, 1, n, out, r, 1.0f, Z, r, l->b[e], r, 1.0f, Y, out, y_bf16);
}

/* From dY [n, out] bf16: dZ = s dY B; dB += s dY^T (X A^T); dA += dZ^T X; dX [n, in] fp32 += dZ A. */
static int lora_bwd(tier_dev *dev, int ln, const tier_moe_lora *l, int e, int n, int in, int out, const bf16 *X,
		    const bf16 *dY, float *dX, bf16 *Z, bf16 *dZ)
{
	if (!moe_lora_on(l))
		return 0;
	int r = l->rank, rc = moe_cuda_mm_lane(dev, ln, 0, 0, n, r, out, l->scale, dY, out, l->b[e], r, 0.0f, dZ, r, 1);
	if (!rc && l->db && l->db[e] &&
	    !(rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, r, in, 1.0f, X, in, l->a[e], in, 0.0f, Z, r, 1)))
		rc = moe_cuda_mm_lane(dev, ln, 1, 0, out, r, n, l->scale, dY, out, Z, r, 1.0f, l->db[e], r, 0);
	if (!rc && l->da && l->da[e])
		rc = moe_cuda_mm_lane(dev, ln, 1, 0, r, in, n, 1.0f, dZ, r, X, in, 1.0f, l->da[e], in, 0);
	return rc ? rc : moe_cuda_mm_lane(dev, ln, 0, 0, n, in, r, 1.0f, dZ, r, l->a[e], in, 1.0f, dX, in, 0);
}

/* ---- lanes: the per-expert products of one projection spread over side streams ----
 * One expert's product rarely fills the GPU (qwen3-30b: ~1000 rows x 768 columns is under one wave
 * of 128x128 tiles on 132 SMs), so consecutive experts run on different lanes at once. Each lane
 * owns its experts' rows of every scratch (Z, dZ at the expert's row offset), so nothing is shared
 * between lanes but the read-only inputs. TIER_MOE_LANES=1 keeps everything on the compute stream. */
static int lanes_wanted(const int32_t *off, int E)
{
	static int env = -1;
	if (env < 0) {
		const char *v = getenv("TIER_MOE_LANES");
		int n = v && *v ? atoi(v) : 4;
		env = n < 1 ? 1 : n > TIER_DEV_LANES ? TIER_DEV_LANES : n;
	}
	int busy = 0;
	for (int e = 0; e < E && busy < env; e++)
		busy += off[e + 1] > off[e];
	return busy;
}

/* Lane of the i-th non-empty expert (-1: the compute stream, when there is one lane). */
static int lane_of(int nl, int i) { return nl > 1 ? i % nl : -1; }

/* Lanes that cannot be made (their streams or 8 MiB workspaces) are no reason to fail a step: the
 * products then run on the compute stream (*nl = 1), with a warning once. */
static int lanes_fork(tier_dev *dev, int *nl)
{
	static int warned;
	if (*nl <= 1 || tier_dev_lanes_fork(dev, *nl) == 0)
		return 0;
	if (!warned) {
		warned = 1;
		tier_log(TIER_LOG_WARN, "MoE experts: no CUDA lanes (%s); the per-expert products run one at a time",
			 tier_last_error());
	}
	*nl = 1;
	return 0;
}
static int lanes_join(tier_dev *dev, int nl, int rc)
{
	int jr = nl > 1 ? tier_dev_lanes_join(dev, nl) : 0; /* joined even after an error: nothing left dangling */
	return rc ? rc : jr;
}

static int experts_args(const char *fn, tier_dev *dev, int E, int H, int I, const int32_t *off,
			const tier_moe_experts *w, const tier_moe_loras *lora, const void *z)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "H", H)) || (rc = moe_check_dim(fn, "I", I)))
		return rc;
	MOE_NONNULL(off, fn);
	if ((rc = moe_cuda_experts_check(fn, E, off, w, lora)))
		return rc;
	if (moe_lora_max_rank(lora) > 0 && !z)
		return tier_fail(-EINVAL, "%s: LoRA needs the z scratch", fn);
	return 0;
}

/* One projection's [rows, I] = X W_e^T (+ LoRA), expert by expert over nl lanes: bf16 straight from
 * the product without an adapter; with one, the product and the adapter's add meet in the fp32
 * scratch gs ([rows, I], each expert at its rows) and the caller rounds once, as the fused grouped
 * products do (rounding the product and again after the add put a LoRA dB 1.4% off in
 * test_moe_cuda's layer case, over its 1% bound). which: 0 gate, 1 up. */
static int experts_fwd_proj(tier_dev *dev, int nl, int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
			    const tier_moe_loras *lora, int which, const void *xg, void *out, float *gs, void *z)
{
	int rc = 0, i = 0, zr = moe_lora_max_rank(lora);
	const tier_moe_lora *l = moe_lora_of(lora, which);
	for (int e = 0; e < E && !rc; e++) {
		int o = off[e], n = off[e + 1] - o, ln = lane_of(nl, i);
		if (n == 0)
			continue;
		i++;
		ex_w ew = ex_of(w, e, I, H);
		const bf16 *X = (const bf16 *)xg + (size_t)o * H, *W = which ? ew.up : ew.gate;
		bf16 *Z = zr ? (bf16 *)z + (size_t)o * zr : NULL;
		if (!moe_lora_on(l)) {
			rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, I, H, 1.0f, X, H, W, H, 0.0f, (bf16 *)out + (size_t)o * I, I, 1);
			continue;
		}
		float *G = gs + (size_t)o * I;
		if (!(rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, I, H, 1.0f, X, H, W, H, 0.0f, G, I, 0)))
			rc = lora_fwd(dev, ln, l, e, n, H, I, X, G, 0, Z);
	}
	return rc;
}

/* g, u [rows, I] bf16 = X gate^T, X up^T (+ LoRA, through gs: experts_fwd_proj). */
static int experts_fwd_gate_up(tier_dev *dev, int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
			       const tier_moe_loras *lora, const void *xg, void *g, void *u, float *gs, void *z)
{
	size_t total = (size_t)off[E] * I;
	void *out[2] = { g, u };
	int lo[2] = { moe_lora_on(moe_lora_of(lora, 0)), moe_lora_on(moe_lora_of(lora, 1)) };
	/* both projections on one fork of the lanes, unless both go through gs: then gate's sums are
	 * rounded out of it before up's reuse it */
	for (int first = 0, last; first < 2; first = last + 1) {
		last = lo[0] && lo[1] ? first : 1;
		int nl = lanes_wanted(off, E), rc = lanes_fork(dev, &nl);
		if (rc)
			return rc;
		for (int p = first; !rc && p <= last; p++)
			rc = experts_fwd_proj(dev, nl, E, H, I, off, w, lora, p, xg, out[p], gs, z);
		if ((rc = lanes_join(dev, nl, rc)))
			return rc;
		for (int p = first; p <= last; p++)
			if (lo[p] && (rc = moe_cuda_to_bf16(dev, total, gs, out[p])))
				return rc;
	}
	return 0;
}

/* y [rows, H] bf16 = h down^T (+ LoRA), expert by expert over nl lanes. */
static int experts_fwd_down(tier_dev *dev, int nl, int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
			    const tier_moe_loras *lora, const void *h, void *y, void *z)
{
	int rc = 0, i = 0, zr = moe_lora_max_rank(lora);
	for (int e = 0; e < E && !rc; e++) {
		int o = off[e], n = off[e + 1] - o, ln = lane_of(nl, i);
		if (n == 0)
			continue;
		i++;
		ex_w ew = ex_of(w, e, I, H);
		const bf16 *Hh = (const bf16 *)h + (size_t)o * I;
		bf16 *Y = (bf16 *)y + (size_t)o * H, *Z = zr ? (bf16 *)z + (size_t)o * zr : NULL;
		if (!(rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, H, I, 1.0f, Hh, I, ew.down, I, 0.0f, Y, H, 1)))
			rc = lora_fwd(dev, ln, moe_lora_of(lora, 2), e, n, I, H, Hh, Y, 1, Z);
	}
	return rc;
}

extern "C" int moe_cuda_experts_fwd_lora(tier_dev *dev, int E, int H, int I, const int32_t *off,
					 const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora,
					 const void *xg, void *g, void *u, void *h, void *y, void *z, float *gs,
					 moe_keep *keep)
{
	const char *fn = "moe_cuda_experts_fwd";
	if (keep)
		keep->kept = 0; /* the per-expert loop keeps nothing */
	int rc = experts_args(fn, dev, E, H, I, off, w, lora, z);
	if (!rc && !gs && (moe_lora_on(moe_lora_of(lora, 0)) || moe_lora_on(moe_lora_of(lora, 1))))
		rc = tier_fail(-EINVAL, "%s: LoRA on gate or up needs the fp32 scratch gs", fn);
	if (rc)
		return rc;
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(h, fn);
	const void *io[] = { xg, g, u, h, y, z };
	if (d_off && moe_cuda_experts_grouped_fits(E, H, I, off, w, lora, io, 6))
		return moe_cuda_experts_fwd_grouped(dev, E, H, I, off, d_off, w, lora, xg, g, u, h, y, z, gs, keep);
	size_t total = (size_t)off[E] * I;
	int nl = lanes_wanted(off, E);
	if (total == 0)
		return 0;
	if ((rc = experts_fwd_gate_up(dev, E, H, I, off, w, lora, xg, g, u, gs, z)) || !y ||
	    (rc = moe_cuda_swiglu(dev, total, g, u, h)))
		return rc;
	if ((rc = lanes_fork(dev, &nl)))
		return rc;
	return lanes_join(dev, nl, experts_fwd_down(dev, nl, E, H, I, off, w, lora, h, y, z));
}

extern "C" int moe_cuda_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
				    const void *const *gate, const void *const *up, const void *const *down,
				    const void *xg, void *g, void *u, void *h, void *y)
{
	tier_moe_experts w = { (const float *const *)gate, (const float *const *)up, NULL, (const float *const *)down,
			       TIER_MOE_GATE_FIRST };
	if (!gate || !up || !down)
		return tier_fail(-EINVAL, "moe_cuda_experts_fwd: gate, up and down pointer arrays are required");
	return moe_cuda_experts_fwd_lora(dev, E, H, I, offsets_host, NULL, &w, NULL, xg, g, u, h, y, NULL, NULL, NULL);
}

/* dh [rows, I] fp32 = dY down (+ LoRA on down, its gradients), expert by expert over nl lanes. */
static int experts_bwd_down(tier_dev *dev, int nl, int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
			    const tier_moe_loras *lora, const bf16 *hb, const bf16 *dyb, float *dh, bf16 *Z, bf16 *dZ)
{
	int rc = 0, i = 0, zr = moe_lora_max_rank(lora);
	for (int e = 0; e < E && !rc; e++) {
		int o = off[e], n = off[e + 1] - o, ln = lane_of(nl, i);
		if (n == 0)
			continue;
		i++;
		ex_w ew = ex_of(w, e, I, H);
		const bf16 *dY = dyb + (size_t)o * H;
		float *dH = dh + (size_t)o * I;
		size_t zo = (size_t)o * zr;
		if (!(rc = moe_cuda_mm_lane(dev, ln, 0, 0, n, I, H, 1.0f, dY, H, ew.down, I, 0.0f, dH, I, 0)))
			rc = lora_bwd(dev, ln, moe_lora_of(lora, 2), e, n, I, H, hb + (size_t)o * I, dY, dH, Z + zo, dZ + zo);
	}
	return rc;
}

/* dX [rows, H] fp32 = dG gate + dU up (+ LoRA on gate and up), expert by expert over nl lanes. */
static int experts_bwd_gate_up(tier_dev *dev, int nl, int E, int H, int I, const int32_t *off,
			       const tier_moe_experts *w, const tier_moe_loras *lora, const bf16 *x, const bf16 *dgb,
			       const bf16 *dub, float *dxg, bf16 *Z, bf16 *dZ)
{
	int rc = 0, i = 0, zr = moe_lora_max_rank(lora);
	for (int e = 0; e < E && !rc; e++) {
		int o = off[e], n = off[e + 1] - o, ln = lane_of(nl, i);
		if (n == 0)
			continue;
		i++;
		ex_w ew = ex_of(w, e, I, H);
		const bf16 *X = x + (size_t)o * H, *dG = dgb + (size_t)o * I, *dU = dub + (size_t)o * I;
		float *dX = dxg + (size_t)o * H;
		size_t zo = (size_t)o * zr;
		if (!(rc = moe_cuda_mm_lane(dev, ln, 0, 0, n, H, I, 1.0f, dG, I, ew.gate, H, 0.0f, dX, H, 0)) &&
		    !(rc = moe_cuda_mm_lane(dev, ln, 0, 0, n, H, I, 1.0f, dU, I, ew.up, H, 1.0f, dX, H, 0)) &&
		    !(rc = lora_bwd(dev, ln, moe_lora_of(lora, 0), e, n, H, I, X, dG, dX, Z + zo, dZ + zo)))
			rc = lora_bwd(dev, ln, moe_lora_of(lora, 1), e, n, H, I, X, dU, dX, Z + zo, dZ + zo);
	}
	return rc;
}

extern "C" int moe_cuda_xg_fill(tier_dev *dev, const moe_keep *keep, int H)
{
	const moe_xg_src *xs = keep ? keep->xg_src : NULL;
	return xs ? moe_cuda_gather(dev, xs->T, xs->k, H, xs->pair_row, xs->x, xs->xg) : 0;
}

extern "C" int moe_cuda_experts_bwd(tier_dev *dev, int E, int H, int I, const int32_t *off,
				    const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, const void *g,
				    const void *u, const void *dy, float *dxg, float *row_dot, void *h, void *dg, void *du,
				    float *dh, void *z, void *dz, const moe_keep *keep, int *dx16)
{
	const char *fn = "moe_cuda_experts_bwd";
	if (dx16)
		*dx16 = 0; /* the per-expert loop writes fp32 */
	int rc = experts_args(fn, dev, E, H, I, off, w, lora, z);
	if (rc)
		return rc;
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(dy, fn);
	MOE_NONNULL(dxg, fn);
	MOE_NONNULL(h, fn);
	MOE_NONNULL(dg, fn);
	MOE_NONNULL(du, fn);
	MOE_NONNULL(dh, fn);
	if (moe_lora_max_rank(lora) > 0 && !dz)
		return tier_fail(-EINVAL, "%s: LoRA needs the dz scratch", fn);
	const bf16 *x = (const bf16 *)xg, *dyb = (const bf16 *)dy;
	bf16 *hb = (bf16 *)h, *dgb = (bf16 *)dg, *dub = (bf16 *)du, *Z = (bf16 *)z, *dZ = (bf16 *)dz;
	size_t total = (size_t)off[E] * I;
	if (total == 0)
		return 0;
	const void *io[] = { xg, g, u, dy, dxg, h, dg, du, dh, z, dz };
	if (d_off && moe_cuda_experts_grouped_fits(E, H, I, off, w, lora, io, 11))
		return moe_cuda_experts_bwd_grouped(dev, E, H, I, off, d_off, w, lora, xg, g, u, dy, dxg, row_dot, h, dg, du,
						    dh, z, dz, keep, dx16);
	/* h is the input of the down adapter: recompute it */
	if ((rc = moe_cuda_xg_fill(dev, keep, H)) ||
	    (moe_lora_on(moe_lora_of(lora, 2)) && (rc = moe_cuda_swiglu(dev, total, g, u, h))))
		return rc;
	int nl = lanes_wanted(off, E);
	if ((rc = lanes_fork(dev, &nl)) ||
	    (rc = lanes_join(dev, nl, experts_bwd_down(dev, nl, E, H, I, off, w, lora, hb, dyb, dh, Z, dZ))) ||
	    (rc = moe_cuda_swiglu_bwd(dev, (size_t)off[E], I, g, u, dh, dg, du, row_dot)))
		return rc;
	if ((rc = lanes_fork(dev, &nl)))
		return rc;
	return lanes_join(dev, nl, experts_bwd_gate_up(dev, nl, E, H, I, off, w, lora, x, dgb, dub, dxg, Z, dZ));
}

/* ---- the public steps tier_moe_experts_fwd / _bwd on CUDA: device offsets read once (a sync) ---- */
static int offsets_to_host(tier_dev *dev, const char *fn, int E, const int32_t *d_off, int32_t *off)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)))
		return rc;
	MOE_NONNULL(d_off, fn);
	cudaStream_t st = moe_stream(dev);
	CUDA_TRY(cudaMemcpyAsync(off, d_off, sizeof(int32_t) * (size_t)(E + 1), cudaMemcpyDeviceToHost, st));
	CUDA_TRY(cudaStreamSynchronize(st));
	return 0;
}

/* The CPU's scratch size covers these pieces: dh fp32 first (4-byte aligned), then bf16 ones. */
extern "C" int moe_cuda_experts_fwd_step(tier_dev *dev, int E, int H, int I, const int32_t *offsets,
					 const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, void *g,
					 void *u, void *y, void *ws)
{
	const char *fn = "tier_moe_experts_fwd";
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int rc = offsets_to_host(dev, fn, E, offsets, off);
	if (rc)
		return rc;
	MOE_NONNULL(ws, fn);
	size_t rows = off[E] > 0 ? (size_t)off[E] : 0;
	char *b = (char *)ws, *h = b + 4 * rows * I; /* the backward's dh piece first: fp32 [rows, I] */
	return moe_cuda_experts_fwd_lora(dev, E, H, I, off, offsets, w, lora, xg, g, u, h, y, h + 2 * rows * I, (float *)b,
					 NULL);
}

extern "C" int moe_cuda_experts_bwd_step(tier_dev *dev, int E, int H, int I, const int32_t *offsets,
					 const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, const void *g,
					 const void *u, const void *dy, float *dxg, float *row_dot, void *ws)
{
	const char *fn = "tier_moe_experts_bwd";
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int rc = offsets_to_host(dev, fn, E, offsets, off);
	if (rc)
		return rc;
	MOE_NONNULL(ws, fn);
	size_t rows = off[E] > 0 ? (size_t)off[E] : 0, r = (size_t)moe_lora_max_rank(lora), hi = 2 * rows * I;
	char *b = (char *)ws, *h = b + 4 * rows * I;
	return moe_cuda_experts_bwd(dev, E, H, I, off, offsets, w, lora, xg, g, u, dy, dxg, row_dot, h, h + hi, h + 2 * hi,
				    (float *)b, h + 3 * hi, h + 3 * hi + moe_lora_z_bytes(rows, (int)r), NULL, NULL);
}
