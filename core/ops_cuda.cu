/* ops_cuda.cu - the trainer's small CUDA operations (core/ops_cuda.h): RMSNorm, SwiGLU, embedding,
 * conversions, the linear layer with LoRA on cuBLASLt, the optimizer's kernels, synthetic weights.
 * bf16 storage, fp32 arithmetic; elementwise kernels are grid-stride loops over size_t indices
 * (weights reach 1e9 elements). */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>
#include "core/ops_cuda.h"
#include "base/bf16x4.cuh"
#include "base/cuda_reduce.cuh"
#include "base/pdl.cuh"

#define THREADS 256
/* Grid-stride loops cap the grid: 8192 blocks of 256 threads are several waves on an H200 (132 SMs,
 * 2048 threads each), enough to hide latency without launching millions of blocks for 1e9 elements. */
#define MAX_BLOCKS 8192

typedef __nv_bfloat16 bf16;

static int cuda_dev(tier_dev *d, const char *op)
{
	if (!d || tier_dev_kind_of(d) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", op);
	return 0;
}

static cudaStream_t stream_of(tier_dev *d) { return (cudaStream_t)tier_dev_stream(d); }

static int launched(const char *op, size_t n)
{
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return tier_fail(-EIO, "%s (%zu elements): kernel launch failed: %s", op, n, cudaGetErrorString(e));
	return 0;
}

static unsigned grid_for(size_t n)
{
	size_t b = (n + THREADS - 1) / THREADS;
	return (unsigned)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
}

#define GRID_STRIDE(i, n) \
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* ---- RMSNorm: one block per row ------------------------------------------------------------- */

static int row_threads(int dim)
{
	int t = (dim + 31) / 32 * 32;
	return t < 512 ? t : 512;
}

__global__ void rmsnorm_fwd_kernel(int dim, float eps, const float *x, const bf16 *w, bf16 *y, float *rstd)
{
	pdl_enter();
	__shared__ float red[33];
	size_t row = blockIdx.x;
	const float *xr = x + row * dim;
	bf16 *yr = y + row * dim;
	float s = 0.0f;
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		s += xr[j] * xr[j];
	float r = rsqrtf(block_sum(s, red) / (float)dim + eps);
	for (int j = threadIdx.x; j < dim; j += blockDim.x)  /* HF: (x * rstd) then times the weight */
		yr[j] = __float2bfloat16_rn(xr[j] * r * __bfloat162float(w[j]));
	if (threadIdx.x == 0 && rstd)
		rstd[row] = r;
}

/* res not NULL: dx = the norm's gradient + res (a residual's gradient; res may be dx: each element
 * is read before its thread writes it). */
__global__ void rmsnorm_bwd_kernel(int dim, const float *x, const bf16 *w, const float *rstd, const float *dy,
				   const float *res, float *dx)
{
	pdl_enter();
	__shared__ float red[33];
	size_t row = blockIdx.x;
	const float *xr = x + row * dim, *dyr = dy + row * dim, *rr = res ? res + row * dim : NULL;
	float *dxr = dx + row * dim;
	float s = 0.0f, r = rstd[row];
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		s += __bfloat162float(w[j]) * dyr[j] * xr[j];
	float c = block_sum(s, red) * r * r * r / (float)dim;
	for (int j = threadIdx.x; j < dim; j += blockDim.x) {
		float v = r * __bfloat162float(w[j]) * dyr[j] - xr[j] * c;
		dxr[j] = rr ? v + rr[j] : v;
	}
}

/* The same with one warp per row and 16-byte loads, for dim % 4 == 0 with aligned rows: the
 * block-per-row kernels above spent 2-3x the time of their traffic on Qwen3's per-head q/k norms
 * (dim 128: a 128-thread block and two barriers for 512 bytes). A warp's row is read twice (sum,
 * then scale); the second read hits L1. */
#define NORM_WARPS 8

__global__ void rmsnorm_fwd4_kernel(int rows, int dim, float eps, const float *x, const bf16 *w, bf16 *y, float *rstd)
{
	pdl_enter();
	size_t row = (size_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
	int lane = threadIdx.x & 31;
	if (row >= (size_t)rows)
		return;
	const float4 *xr = (const float4 *)(x + row * dim);
	int n4 = dim / 4;
	float s = 0.0f;
	for (int j = lane; j < n4; j += 32) {
		float4 v = xr[j];
		s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
	}
	float r = rsqrtf(warp_sum(s) / (float)dim + eps);
	bf16 *yr = y + row * dim;
	for (int j = lane; j < n4; j += 32) { /* HF: (x * rstd) then times the weight */
		float4 v = xr[j], g = bf16x4_load(w + 4 * j);
		bf16x4_store(yr + 4 * j, v.x * r * g.x, v.y * r * g.y, v.z * r * g.z, v.w * r * g.w);
	}
	if (lane == 0 && rstd)
		rstd[row] = r;
}

__global__ void rmsnorm_bwd4_kernel(int rows, int dim, const float *x, const bf16 *w, const float *rstd, const float *dy,
				    const float *res, float *dx)
{
	pdl_enter();
	size_t row = (size_t)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
	int lane = threadIdx.x & 31;
	if (row >= (size_t)rows)
		return;
	const float4 *xr = (const float4 *)(x + row * dim), *dyr = (const float4 *)(dy + row * dim);
	float4 *dxr = (float4 *)(dx + row * dim);
	int n4 = dim / 4;
	float s = 0.0f, r = rstd[row];
	for (int j = lane; j < n4; j += 32) {
		float4 a = xr[j], d = dyr[j], g = bf16x4_load(w + 4 * j);
		s += g.x * d.x * a.x + g.y * d.y * a.y + g.z * d.z * a.z + g.w * d.w * a.w;
	}
	float c = warp_sum(s) * r * r * r / (float)dim;
	const float4 *rr = res ? (const float4 *)(res + row * dim) : NULL;
	for (int j = lane; j < n4; j += 32) {
		float4 a = xr[j], d = dyr[j], g = bf16x4_load(w + 4 * j);
		float4 v = make_float4(r * g.x * d.x - a.x * c, r * g.y * d.y - a.y * c, r * g.z * d.z - a.z * c,
				       r * g.w * d.w - a.w * c);
		if (rr) {
			float4 q = rr[j];
			v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
		}
		dxr[j] = v;
	}
}

/* Hidden states' norms (dim % 4 == 0, 4 NORM_RT < dim <= 4 NORM_RT NORM_RV): a block of NORM_RT
 * threads a row, the thread's NV float4 of x (and dy) held in registers from the sum to the scale.
 * The warp-per-row kernels read each row twice, and at dim 2048 the second read missed L1 (8 rows
 * of x and dy are 128 KB a block): rmsnorm_bwd4 ran at about half the copy's rate in (a)'s profile. */
#define NORM_RT 128
#define NORM_RV 8

template <int NV>
__global__ void __launch_bounds__(NORM_RT) rmsnorm_fwd_reg_kernel(int dim, float eps, const float *x, const bf16 *w,
								   bf16 *y, float *rstd)
{
	pdl_enter();
	__shared__ float red[33];
	size_t row = blockIdx.x;
	const float4 *xr = (const float4 *)(x + row * dim);
	int n4 = dim / 4;
	float4 v[NV];
	float s = 0.0f;
#pragma unroll
	for (int i = 0; i < NV; i++) {
		int j = threadIdx.x + i * NORM_RT;
		v[i] = j < n4 ? xr[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		s += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
	}
	float r = rsqrtf(block_sum(s, red) / (float)dim + eps);
	bf16 *yr = y + row * dim;
#pragma unroll
	for (int i = 0; i < NV; i++) { /* HF: (x * rstd) then times the weight */
		int j = threadIdx.x + i * NORM_RT;
		if (j >= n4)
			break;
		float4 g = bf16x4_load(w + 4 * j);
		bf16x4_store(yr + 4 * j, v[i].x * r * g.x, v[i].y * r * g.y, v[i].z * r * g.z, v[i].w * r * g.w);
	}
	if (threadIdx.x == 0 && rstd)
		rstd[row] = r;
}

/* res may be dx: each thread reads its elements of res before writing them. */
template <int NV>
__global__ void __launch_bounds__(NORM_RT) rmsnorm_bwd_reg_kernel(int dim, const float *x, const bf16 *w,
								   const float *rstd, const float *dy, const float *res,
								   float *dx)
{
	pdl_enter();
	__shared__ float red[33];
	size_t row = blockIdx.x;
	const float4 *xr = (const float4 *)(x + row * dim), *dyr = (const float4 *)(dy + row * dim);
	int n4 = dim / 4;
	float4 a[NV], d[NV];
	float s = 0.0f, r = rstd[row];
#pragma unroll
	for (int i = 0; i < NV; i++) {
		int j = threadIdx.x + i * NORM_RT;
		const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		a[i] = j < n4 ? xr[j] : z, d[i] = j < n4 ? dyr[j] : z;
		float4 g = j < n4 ? bf16x4_load(w + 4 * j) : z;
		s += g.x * d[i].x * a[i].x + g.y * d[i].y * a[i].y + g.z * d[i].z * a[i].z + g.w * d[i].w * a[i].w;
	}
	float c = block_sum(s, red) * r * r * r / (float)dim;
	const float4 *rr = res ? (const float4 *)(res + row * dim) : NULL;
	float4 *dxr = (float4 *)(dx + row * dim);
#pragma unroll
	for (int i = 0; i < NV; i++) {
		int j = threadIdx.x + i * NORM_RT;
		if (j >= n4)
			break;
		float4 g = bf16x4_load(w + 4 * j);
		float4 v = make_float4(r * g.x * d[i].x - a[i].x * c, r * g.y * d[i].y - a[i].y * c,
				       r * g.z * d[i].z - a[i].z * c, r * g.w * d[i].w - a[i].w * c);
		if (rr) {
			float4 q = rr[j];
			v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
		}
		dxr[j] = v;
	}
}

/* The register kernels' float4 a thread for dim (0: the dim is not theirs). */
static int norm_reg_nv(int dim)
{
	int n4 = dim / 4, nv = (n4 + NORM_RT - 1) / NORM_RT;
	return dim % 4 || nv < 2 || nv > NORM_RV ? 0 : nv <= 2 ? 2 : nv <= 4 ? 4 : 8;
}

/* launch(std::integral_constant<int, NV>()) for norm_reg_nv's NV (2, 4 or 8). */
template <class L>
static void norm_reg_launch(int nv, L launch)
{
	if (nv == 2)
		launch(std::integral_constant<int, 2>());
	else if (nv == 4)
		launch(std::integral_constant<int, 4>());
	else
		launch(std::integral_constant<int, 8>());
}

/* The warp-per-row kernels need dim % 4 == 0 and x, dy, dx 16-byte aligned, w and y 8-byte aligned
 * (then every row is); so do the register ones. */
static int al(const void *p, uintptr_t n) { return !((uintptr_t)p % n); }

static unsigned norm_blocks(int rows) { return (unsigned)((rows + NORM_WARPS - 1) / NORM_WARPS); }

static int rows_check(const char *op, tier_dev *d, int rows, int dim)
{
	int rc = cuda_dev(d, op);
	if (rc)
		return rc;
	if (rows < 0 || dim <= 0 || rows >= (1 << 30))
		return tier_fail(-EINVAL, "%s: bad size rows=%d dim=%d", op, rows, dim);
	return 0;
}

int opsc_rmsnorm_fwd(tier_dev *d, int rows, int dim, float eps, const float *x, const opsc_bf16 *w,
		     opsc_bf16 *y, float *rstd)
{
	int rc = rows_check("opsc_rmsnorm_fwd", d, rows, dim);
	if (rc || rows == 0)
		return rc;
	int nv = norm_reg_nv(dim), fit = al(x, 16) && al(w, 8) && al(y, 8);
	const bf16 *wb = (const bf16 *)w;
	bf16 *yb = (bf16 *)y;
	if (nv && fit)
		norm_reg_launch(nv, [&](auto v) {
			tier_launch(rmsnorm_fwd_reg_kernel<decltype(v)::value>, rows, NORM_RT, 0, stream_of(d), dim,
					eps, x, wb, yb, rstd);
		});
	else if (dim % 4 == 0 && fit)
		tier_launch(rmsnorm_fwd4_kernel, norm_blocks(rows), 32 * NORM_WARPS, 0, stream_of(d), rows, dim, eps, x,
				(const bf16 *)w, (bf16 *)y, rstd);
	else
		tier_launch(rmsnorm_fwd_kernel, rows, row_threads(dim), 0, stream_of(d), dim, eps, x, (const bf16 *)w,
				(bf16 *)y, rstd);
	return launched("opsc_rmsnorm_fwd", (size_t)rows * dim);
}

static int rmsnorm_bwd(const char *op, tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w,
		       const float *rstd, const float *dy, const float *res, float *dx)
{
	int rc = rows_check(op, d, rows, dim);
	if (rc || rows == 0)
		return rc;
	if (!rstd)
		return tier_fail(-EINVAL, "%s: rows=%d dim=%d needs the forward's rstd", op, rows, dim);
	int nv = norm_reg_nv(dim), fit = al(x, 16) && al(w, 8) && al(dy, 16) && al(dx, 16) && (!res || al(res, 16));
	const bf16 *wb = (const bf16 *)w;
	if (nv && fit)
		norm_reg_launch(nv, [&](auto v) {
			tier_launch(rmsnorm_bwd_reg_kernel<decltype(v)::value>, rows, NORM_RT, 0, stream_of(d), dim, x,
					wb, rstd, dy, res, dx);
		});
	else if (dim % 4 == 0 && fit)
		tier_launch(rmsnorm_bwd4_kernel, norm_blocks(rows), 32 * NORM_WARPS, 0, stream_of(d), rows, dim, x,
				(const bf16 *)w, rstd, dy, res, dx);
	else
		tier_launch(rmsnorm_bwd_kernel, rows, row_threads(dim), 0, stream_of(d), dim, x, (const bf16 *)w, rstd,
				dy, res, dx);
	return launched(op, (size_t)rows * dim);
}

int opsc_rmsnorm_bwd(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
		     const float *dy, float *dx)
{
	return rmsnorm_bwd("opsc_rmsnorm_bwd", d, rows, dim, x, w, rstd, dy, NULL, dx);
}

int opsc_rmsnorm_bwd_add(tier_dev *d, int rows, int dim, const float *x, const opsc_bf16 *w, const float *rstd,
			 const float *dy, const float *res, float *dx)
{
	if (!res)
		return tier_fail(-EINVAL, "opsc_rmsnorm_bwd_add: res is NULL (rows=%d dim=%d)", rows, dim);
	return rmsnorm_bwd("opsc_rmsnorm_bwd_add", d, rows, dim, x, w, rstd, dy, res, dx);
}

/* ---- SwiGLU, embedding, elementwise --------------------------------------------------------- */

/* expf, not __expf: the backward is held to fp32 accuracy. */
__device__ static inline float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__global__ void swiglu_fwd_kernel(size_t n, const float *g, const float *u, bf16 *h)
{
	pdl_enter();
	GRID_STRIDE(i, n) {
		float gi = g[i];
		h[i] = __float2bfloat16_rn(gi * sigmoid(gi) * u[i]);
	}
}

/* d silu(g) / dg = s + g s (1 - s) with s = sigmoid(g). */
__global__ void swiglu_bwd_kernel(size_t n, const float *g, const float *u, const float *dh, float *dg, float *du)
{
	pdl_enter();
	GRID_STRIDE(i, n) {
		float gi = g[i], s = sigmoid(gi), si = gi * s, dhi = dh[i];
		dg[i] = dhi * u[i] * (s + si * (1.0f - s));
		du[i] = dhi * si;
	}
}

__global__ void embed_kernel(int T, int dim, const int32_t *tokens, const bf16 *table, float *out)
{
	pdl_enter();
	for (int t = blockIdx.x; t < T; t += gridDim.x) {
		const bf16 *row = table + (size_t)tokens[t] * dim;
		float *o = out + (size_t)t * dim;
		for (int j = threadIdx.x; j < dim; j += blockDim.x)
			o[j] = __bfloat162float(row[j]);
	}
}

__global__ void add_kernel(size_t n, const float *a, const float *b, float *out)
{
	pdl_enter();
	GRID_STRIDE(i, n)
		out[i] = a[i] + b[i];
}

__global__ void to_bf16_kernel(size_t n, const float *x, bf16 *y)
{
	pdl_enter();
	GRID_STRIDE(i, n)
		y[i] = __float2bfloat16_rn(x[i]);
}

/* The same four elements a thread: 16-byte fp32 and 8-byte bf16 accesses (pointers aligned for
 * them), the last n % 4 elements one at a time. The scalar kernels ran at about 60% of the copy's
 * rate on the trainer's [4096, 2048] activations (a's kernel profile: ~270 conversions and ~120
 * adds a step). In place (out a or b) is fine: a thread reads its elements before writing them. */
__global__ void add4_kernel(size_t n, const float *a, const float *b, float *out)
{
	pdl_enter();
	size_t n4 = n / 4;
	GRID_STRIDE(i, n4) {
		float4 x = ((const float4 *)a)[i], y = ((const float4 *)b)[i];
		((float4 *)out)[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
	}
	GRID_STRIDE(i, n - 4 * n4)
		out[4 * n4 + i] = a[4 * n4 + i] + b[4 * n4 + i];
}

__global__ void to_bf16_4_kernel(size_t n, const float *x, bf16 *y)
{
	pdl_enter();
	size_t n4 = n / 4;
	GRID_STRIDE(i, n4) {
		float4 v = ((const float4 *)x)[i];
		bf16x4_store(y + 4 * i, v.x, v.y, v.z, v.w);
	}
	GRID_STRIDE(i, n - 4 * n4)
		y[4 * n4 + i] = __float2bfloat16_rn(x[4 * n4 + i]);
}

__global__ void from_bf16_4_kernel(size_t n, const bf16 *x, float *y)
{
	pdl_enter();
	size_t n4 = n / 4;
	GRID_STRIDE(i, n4)
		((float4 *)y)[i] = bf16x4_load(x + 4 * i);
	GRID_STRIDE(i, n - 4 * n4)
		y[4 * n4 + i] = __bfloat162float(x[4 * n4 + i]);
}

__global__ void from_bf16_kernel(size_t n, const bf16 *x, float *y)
{
	pdl_enter();
	GRID_STRIDE(i, n)
		y[i] = __bfloat162float(x[i]);
}

/* The segments of one launch travel in the kernel's parameters (12 KiB, __grid_constant__): a
 * table copied to the device first put a copy's latency on the stream before every launch, ~20 us
 * of idle device four times a layer (session 19's H100 timeline of (a): 194 gaps, 4.1 ms a step). */
#define MANY_SEGS 512
struct many_args {
	const float *src[MANY_SEGS];
	bf16 *dst[MANY_SEGS];
	size_t len[MANY_SEGS];
	int n;
};

/* Segment s = blockIdx.y. */
__global__ void to_bf16_many_kernel(const __grid_constant__ many_args a)
{
	pdl_enter();
	for (int s = blockIdx.y; s < a.n; s += gridDim.y) {
		const float *x = a.src[s];
		bf16 *y = a.dst[s];
		size_t n = a.len[s];
		GRID_STRIDE(i, n)
			y[i] = __float2bfloat16_rn(x[i]);
	}
}

int opsc_swiglu_fwd(tier_dev *d, size_t n, const float *g, const float *u, opsc_bf16 *h)
{
	int rc = cuda_dev(d, "opsc_swiglu_fwd");
	if (rc || n == 0)
		return rc;
	tier_launch(swiglu_fwd_kernel, grid_for(n), THREADS, 0, stream_of(d), n, g, u, (bf16 *)h);
	return launched("opsc_swiglu_fwd", n);
}

int opsc_swiglu_bwd(tier_dev *d, size_t n, const float *g, const float *u, const float *dh, float *dg, float *du)
{
	int rc = cuda_dev(d, "opsc_swiglu_bwd");
	if (rc || n == 0)
		return rc;
	tier_launch(swiglu_bwd_kernel, grid_for(n), THREADS, 0, stream_of(d), n, g, u, dh, dg, du);
	return launched("opsc_swiglu_bwd", n);
}

int opsc_embed_fwd(tier_dev *d, int T, int vocab, int dim, const int32_t *tokens, const opsc_bf16 *table,
		   float *out)
{
	int rc = cuda_dev(d, "opsc_embed_fwd");
	if (rc)
		return rc;
	if (T < 0 || vocab <= 0 || dim <= 0)
		return tier_fail(-EINVAL, "opsc_embed_fwd: bad size T=%d vocab=%d dim=%d", T, vocab, dim);
	if (T == 0)
		return 0;
	int blocks = T < MAX_BLOCKS ? T : MAX_BLOCKS;
	tier_launch(embed_kernel, blocks, row_threads(dim), 0, stream_of(d), T, dim, tokens, (const bf16 *)table, out);
	return launched("opsc_embed_fwd", (size_t)T * dim);
}

int opsc_add(tier_dev *d, size_t n, const float *a, const float *b, float *out)
{
	int rc = cuda_dev(d, "opsc_add");
	if (rc || n == 0)
		return rc;
	if (al(a, 16) && al(b, 16) && al(out, 16))
		tier_launch(add4_kernel, grid_for((n + 3) / 4), THREADS, 0, stream_of(d), n, a, b, out);
	else
		tier_launch(add_kernel, grid_for(n), THREADS, 0, stream_of(d), n, a, b, out);
	return launched("opsc_add", n);
}

int opsc_to_bf16(tier_dev *d, size_t n, const float *x, opsc_bf16 *y)
{
	int rc = cuda_dev(d, "opsc_to_bf16");
	if (rc || n == 0)
		return rc;
	if (al(x, 16) && al(y, 8))
		tier_launch(to_bf16_4_kernel, grid_for((n + 3) / 4), THREADS, 0, stream_of(d), n, x, (bf16 *)y);
	else
		tier_launch(to_bf16_kernel, grid_for(n), THREADS, 0, stream_of(d), n, x, (bf16 *)y);
	return launched("opsc_to_bf16", n);
}

int opsc_from_bf16(tier_dev *d, size_t n, const opsc_bf16 *x, float *y)
{
	int rc = cuda_dev(d, "opsc_from_bf16");
	if (rc || n == 0)
		return rc;
	if (al(x, 8) && al(y, 16))
		tier_launch(from_bf16_4_kernel, grid_for((n + 3) / 4), THREADS, 0, stream_of(d), n, (const bf16 *)x, y);
	else
		tier_launch(from_bf16_kernel, grid_for(n), THREADS, 0, stream_of(d), n, (const bf16 *)x, y);
	return launched("opsc_from_bf16", n);
}

static int many_check(int n_seg, const float *const *src, opsc_bf16 *const *dst, const size_t *len)
{
	if (n_seg < 0 || (n_seg > 0 && (!src || !dst || !len)))
		return tier_fail(-EINVAL, "opsc_to_bf16_many: bad arguments (n_seg=%d, or a NULL array)", n_seg);
	for (int i = 0; i < n_seg; i++)
		if (len[i] && (!src[i] || !dst[i]))
			return tier_fail(-EINVAL, "opsc_to_bf16_many: segment %d of %zu elements has a NULL pointer", i,
					 len[i]);
	return 0;
}

int opsc_to_bf16_many(tier_dev *d, int n_seg, const float *const *src, opsc_bf16 *const *dst, const size_t *len)
{
	int rc = cuda_dev(d, "opsc_to_bf16_many");
	if (rc || (rc = many_check(n_seg, src, dst, len)))
		return rc;
	many_args a; /* one launch per MANY_SEGS segments */
	for (int s0 = 0; s0 < n_seg; s0 += MANY_SEGS) {
		size_t max_len = 0;
		a.n = n_seg - s0 < MANY_SEGS ? n_seg - s0 : MANY_SEGS;
		for (int i = 0; i < a.n; i++) {
			a.src[i] = src[s0 + i], a.dst[i] = (bf16 *)dst[s0 + i], a.len[i] = len[s0 + i];
			max_len = a.len[i] > max_len ? a.len[i] : max_len;
		}
		if (max_len == 0)
			continue;
		/* blocks per segment sized for the longest one, the whole grid bounded to ~64k blocks */
		unsigned gy = (unsigned)a.n, gx = grid_for(max_len);
		if ((size_t)gx * gy > 65536)
			gx = 65536 / gy > 0 ? 65536 / gy : 1;
		tier_launch(to_bf16_many_kernel, dim3(gx, gy), THREADS, 0, stream_of(d), a);
		if ((rc = launched("opsc_to_bf16_many", max_len)))
			return rc;
	}
	return 0;
}

/* ---- Optimizer ------------------------------------------------------------------------------- */

/* Squares in fp64 per thread, a warp and block reduction in fp64, one atomicAdd (double) per block. */
__global__ void sumsq_kernel(size_t n, const float *x, double *acc)
{
	pdl_enter();
	__shared__ double red[32];
	double s = 0.0;
	GRID_STRIDE(i, n) {
		double v = x[i];
		s += v * v;
	}
	for (int k = 16; k; k >>= 1)
		s += __shfl_xor_sync(0xffffffffu, s, k);
	if ((threadIdx.x & 31) == 0)
		red[threadIdx.x >> 5] = s;
	__syncthreads();
	if (threadIdx.x == 0) {
		double t = 0.0;
		for (int w = 0; w < (int)(blockDim.x >> 5); w++)
			t += red[w];
		atomicAdd(acc, t);
	}
}

/* One element of AdamW: both kernels below share it, so they give the same bits. */
__device__ __forceinline__ void adamw_one(size_t i, float *p, const float *g, float *m, float *v, float lr, float b1,
					  float b2, float eps, float decay, float bc1, float bc2, float gscale)
{
	float gj = g[i] * gscale;
	float mi = b1 * m[i] + (1.0f - b1) * gj, vi = b2 * v[i] + (1.0f - b2) * gj * gj;
	m[i] = mi, v[i] = vi;
	p[i] = p[i] * decay - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
}

__global__ void adamw_kernel(size_t n, float *p, const float *g, float *m, float *v, float lr, float b1, float b2,
			     float eps, float decay, float bc1, float bc2, float gscale)
{
	pdl_enter();
	GRID_STRIDE(i, n)
		adamw_one(i, p, g, m, v, lr, b1, b2, eps, decay, bc1, bc2, gscale);
}

struct adamw_many_args {
	opsc_adamw_t t[OPSC_ADAMW_MANY];
	float lr, b1, b2, eps, decay, gscale;
};

/* blockIdx.y: the tensor; the x blocks stride over it. */
__global__ void adamw_many_kernel(const __grid_constant__ adamw_many_args a)
{
	pdl_enter();
	const opsc_adamw_t &e = a.t[blockIdx.y];
	GRID_STRIDE(i, e.n)
		adamw_one(i, e.p, e.g, e.m, e.v, a.lr, a.b1, a.b2, a.eps, a.decay, e.bc1, e.bc2, a.gscale);
}

int opsc_sumsq(tier_dev *d, size_t n, const float *x, double *acc)
{
	int rc = cuda_dev(d, "opsc_sumsq");
	if (rc || n == 0)
		return rc;
	tier_launch(sumsq_kernel, grid_for(n), THREADS, 0, stream_of(d), n, x, acc);
	return launched("opsc_sumsq", n);
}

int opsc_adamw_many(tier_dev *d, int count, const opsc_adamw_t *t, float lr, float b1, float b2, float eps,
		    float decay, float gscale)
{
	int rc = cuda_dev(d, "opsc_adamw_many");
	if (rc || count <= 0)
		return count < 0 ? tier_fail(-EINVAL, "opsc_adamw_many: %d tensors", count) : rc;
	if (!t)
		return tier_fail(-EINVAL, "opsc_adamw_many: NULL table");
	/* 18 KiB, off the stack; copied at each launch, so freed once the last is queued */
	adamw_many_args *ap = (adamw_many_args *)malloc(sizeof *ap);
	if (!ap)
		return tier_fail(-ENOMEM, "opsc_adamw_many: out of host memory");
	adamw_many_args &a = *ap;
	a.lr = lr, a.b1 = b1, a.b2 = b2, a.eps = eps, a.decay = decay, a.gscale = gscale;
	for (int at = 0; at < count && !rc; at += OPSC_ADAMW_MANY) {
		int k = count - at < OPSC_ADAMW_MANY ? count - at : OPSC_ADAMW_MANY;
		size_t most = 0;
		for (int i = 0; i < k; i++) {
			if (t[at + i].n && (!t[at + i].p || !t[at + i].g || !t[at + i].m || !t[at + i].v)) {
				free(ap);
				return tier_fail(-EINVAL, "opsc_adamw_many: tensor %d of %zu elements has a NULL array",
						 at + i, t[at + i].n);
			}
			a.t[i] = t[at + i];
			most = t[at + i].n > most ? t[at + i].n : most;
		}
		if (!most)
			continue;
		/* blocks for the longest tensor, at most 64 per tensor: shorter ones leave theirs idle */
		unsigned gx = grid_for(most);
		tier_launch(adamw_many_kernel, dim3(gx < 64 ? gx : 64, (unsigned)k), THREADS, 0, stream_of(d), a);
		rc = launched("opsc_adamw_many", most);
	}
	free(ap);
	return rc;
}

int opsc_adamw(tier_dev *d, size_t n, float *p, const float *g, float *m, float *v, float lr, float b1, float b2,
	       float eps, float decay, float bc1, float bc2, float gscale)
{
	int rc = cuda_dev(d, "opsc_adamw");
	if (rc || n == 0)
		return rc;
	tier_launch(adamw_kernel, grid_for(n), THREADS, 0, stream_of(d), n, p, g, m, v, lr, b1, b2, eps, decay, bc1,
			bc2, gscale);
	return launched("opsc_adamw", n);
}

/* ---- Synthetic weights ----------------------------------------------------------------------- */

/* splitmix64's finaliser: element i of seed s hashes (mix(s) + (i + 1) golden), splitmix64's stream
 * at position i, so a value depends on (seed, index) only, never on the launch shape. */
__host__ __device__ static inline uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Box-Muller on the two 32-bit halves; u1 in (0, 1] so the log is finite (|z| <= 6.7). */
__global__ void fill_normal_kernel(size_t n, uint64_t key, float std, bf16 *out)
{
	pdl_enter();
	const float two32 = 2.3283064365386963e-10f; /* 2^-32 */
	GRID_STRIDE(i, n) {
		uint64_t h = mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
		float u1 = ((float)(uint32_t)(h >> 32) + 0.5f) * two32, u2 = (float)(uint32_t)h * two32;
		float sn, cs;
		sincospif(2.0f * u2, &sn, &cs);
		out[i] = __float2bfloat16_rn(std * sqrtf(-2.0f * logf(u1)) * cs);
	}
}

__global__ void fill_const_kernel(size_t n, float v, bf16 *out)
{
	pdl_enter();
	bf16 b = __float2bfloat16_rn(v);
	GRID_STRIDE(i, n)
		out[i] = b;
}

int opsc_fill_normal(tier_dev *d, size_t n, uint64_t seed, float std, opsc_bf16 *out)
{
	int rc = cuda_dev(d, "opsc_fill_normal");
	if (rc || n == 0)
		return rc;
	tier_launch(fill_normal_kernel, grid_for(n), THREADS, 0, stream_of(d), n, mix64(seed), std, (bf16 *)out);
	return launched("opsc_fill_normal", n);
}

int opsc_fill_const(tier_dev *d, size_t n, float v, opsc_bf16 *out)
{
	int rc = cuda_dev(d, "opsc_fill_const");
	if (rc || n == 0)
		return rc;
	tier_launch(fill_const_kernel, grid_for(n), THREADS, 0, stream_of(d), n, v, (bf16 *)out);
	return launched("opsc_fill_const", n);
}

/* ---- cuBLASLt product: the checks, then base/gemm_cuda.cu ------------------------------------ */

static int operand_ok(const opsc_operand *X, int rows)
{
	return (X->trans == 0 || X->trans == 1) && (X->type == CUDA_R_16BF || X->type == CUDA_R_32F) && X->p &&
	       X->ld >= (rows > 1 ? rows : 1);
}

/* C = beta C for an empty sum (k = 0), which cuBLASLt does not take; beta 0 writes zeros (C unread). */
__global__ void scale_kernel(int m, int n, float beta, float *C, int ldc)
{
	pdl_enter();
	GRID_STRIDE(i, (size_t)m * n) {
		float *c = C + (i / m) * ldc + i % m;
		*c = beta == 0.0f ? 0.0f : beta * *c;
	}
}

static int gemm_empty(tier_dev *d, int m, int n, float beta, float *C, int ldc)
{
	if (beta == 1.0f)
		return 0;
	tier_launch(scale_kernel, grid_for((size_t)m * n), THREADS, 0, stream_of(d), m, n, beta, C, ldc);
	return launched("opsc_gemm (k=0)", (size_t)m * n);
}

int opsc_gemm(tier_dev *d, int m, int n, int k, float alpha, opsc_operand A, opsc_operand B, float beta, float *C,
	      int ldc)
{
	int rc = cuda_dev(d, "opsc_gemm");
	if (rc)
		return rc;
	if (m < 0 || n < 0 || k < 0 || !C || ldc < (m > 1 ? m : 1) || !operand_ok(&A, A.trans ? k : m) ||
	    !operand_ok(&B, B.trans ? n : k))
		return tier_fail(-EINVAL, "opsc_gemm: bad product %d x %d x %d (A trans %d type %d ld %d, B trans %d type %d "
				 "ld %d, ldc %d)", m, n, k, A.trans, A.type, A.ld, B.trans, B.type, B.ld, ldc);
	if (m == 0 || n == 0)
		return 0;
	if (k == 0)
		return gemm_empty(d, m, n, beta, C, ldc);
	return tier_cuda_gemm(d, -1, "opsc_gemm", m, n, k, alpha, A, B, beta, C, CUDA_R_32F, ldc);
}

/* C = alpha op(A) op(B) + res (fp32, C's layout; res NULL: + beta0 C): a residual in the epilogue.
 * k >= 1 (the linear layers' products). */
static int gemm_res(tier_dev *d, int m, int n, int k, float alpha, opsc_operand A, opsc_operand B, const float *res,
		    float beta0, float *C, int ldc)
{
	if (!res)
		return opsc_gemm(d, m, n, k, alpha, A, B, beta0, C, ldc);
	return tier_cuda_gemm_cd(d, -1, "opsc_linear_fwd_res", m, n, k, alpha, A, B, 1.0f, res, C, CUDA_R_32F, ldc);
}

/* ---- Linear layer with LoRA ------------------------------------------------------------------
 * Row-major X [R, C] is column-major X^T [C, R] with ld C, so each row-major product is computed as
 * its transpose: Y = X W^T becomes Y^T [out, T] = W (stored [in, out], transposed) X^T (stored
 * [in, T]). Each call below spells out its mapping. */

static size_t al256(size_t b) { return (b + 255) / 256 * 256; }

/* Workspace pieces, each 256-byte aligned: dy in bf16 [T, out]; x A^T (or dy B) in fp32 [T, r];
 * its bf16 copy [T, r]; the bf16 dy B of the backward [T, r]; with dropout, 4 T in bytes that hold
 * the masked x in bf16 [T, in] and, once the backward's last reader of it (da's product) is queued,
 * the adapter's fp32 dx [T, in] before its mask. Same arithmetic in ops_nocuda.c. */
typedef struct {
	bf16 *dy16;
	float *xa;
	bf16 *xa16, *dxa16;
	void *drop;
} lin_ws;

size_t opsc_linear_ws_bytes(int T, int in, int out, int rank, float dropout)
{
	size_t t = T > 0 ? (size_t)T : 0, i = in > 0 ? (size_t)in : 0, o = out > 0 ? (size_t)out : 0;
	size_t r = rank > 0 ? (size_t)rank : 0, drop = dropout > 0 && r ? al256(t * i * 4) : 0;
	return al256(t * o * 2) + al256(t * r * 4) + 2 * al256(t * r * 2) + drop;
}

static lin_ws ws_split(void *ws, int T, int out, int r)
{
	lin_ws s;
	char *p = (char *)ws;
	s.dy16 = (bf16 *)p, p += al256((size_t)T * out * 2);
	s.xa = (float *)p, p += al256((size_t)T * r * 4);
	s.xa16 = (bf16 *)p, p += al256((size_t)T * r * 2);
	s.dxa16 = (bf16 *)p, p += al256((size_t)T * r * 2);
	s.drop = p;
	return s;
}

static opsc_operand bf(int trans, const void *p, int ld)
{
	opsc_operand o = { trans, p, CUDA_R_16BF, ld };
	return o;
}

static int lora_on(const tier_lora_ref *l) { return l && l->a; }

static int linear_check(const char *op, tier_dev *d, int T, int in, int out, const void *x, const void *w,
			const tier_lora_ref *l, const void *ws, int need_ws)
{
	int rc = cuda_dev(d, op);
	if (rc)
		return rc;
	if (T < 0 || in <= 0 || out <= 0 || (T > 0 && (!x || !w)))
		return tier_fail(-EINVAL, "%s: bad arguments T=%d in=%d out=%d (x %p, w %p)", op, T, in, out, x, w);
	if (lora_on(l) && (!l->b || l->rank <= 0))
		return tier_fail(-EINVAL, "%s: LoRA of rank %d on T=%d in=%d out=%d needs a and b", op, l->rank, T, in, out);
	if (lora_on(l) && !(l->dropout >= 0.0f && l->dropout < 1.0f))
		return tier_fail(-EINVAL, "%s: LoRA dropout %g must be in [0, 1)", op, l->dropout);
	if ((need_ws || lora_on(l)) && !ws && T > 0)
		return tier_fail(-EINVAL, "%s: T=%d in=%d out=%d needs a workspace of %zu bytes", op, T, in, out,
				 opsc_linear_ws_bytes(T, in, out, lora_on(l) ? l->rank : 0, lora_on(l) ? l->dropout : 0));
	return 0;
}

/* tier_lora_keep (core/layers.c) bit for bit: the same 64-bit hash of (key, t, i), its two rounds
 * being mix64 after the golden-ratio step, and the same double comparison, so that the CUDA path
 * drops exactly the elements the CPU reference drops. */
__device__ static inline int lora_keep(uint64_t key, float p, uint64_t t, uint64_t i)
{
	uint64_t z = key ^ (t * 0x9e3779b97f4a7c15ull) ^ (i * 0xc2b2ae3d27d4eb4full);
	z = mix64(z + 0x9e3779b97f4a7c15ull);
	z = mix64(z + 0x9e3779b97f4a7c15ull);
	return (double)(z >> 11) * (1.0 / 9007199254740992.0) >= (double)p; /* 2^-53: a uniform in [0, 1) */
}

/* xd [T, in] (bf16) = x * keep / (1 - p), or 0: the adapter's input under dropout. s = 1 / (1 - p)
 * in fp32, as the CPU computes it. */
__global__ void lora_mask_kernel(size_t n, int in, uint64_t key, float p, float s, const bf16 *x, bf16 *xd)
{
	pdl_enter();
	const bf16 zero = __float2bfloat16_rn(0.0f);
	GRID_STRIDE(k, n)
		xd[k] = lora_keep(key, p, k / in, k % in) ? __float2bfloat16_rn(__bfloat162float(x[k]) * s) : zero;
}

/* dx [T, in] += tmp * keep / (1 - p): the adapter's input gradient back through the same mask.
 * __fmul_rn keeps the product out of an FMA, so the sum rounds as the CPU's (product, then add). */
__global__ void lora_mask_add_kernel(size_t n, int in, uint64_t key, float p, float s, const float *tmp, float *dx)
{
	pdl_enter();
	GRID_STRIDE(k, n)
		if (lora_keep(key, p, k / in, k % in))
			dx[k] += __fmul_rn(tmp[k], s);
}

static float keep_scale(const tier_lora_ref *l) { return 1.0f / (1.0f - l->dropout); }

/* *xl = the adapter's input: x itself, or with dropout x through the mask into ws's drop piece. */
static int lora_input(tier_dev *d, int T, int in, const opsc_bf16 *x, const tier_lora_ref *l, const lin_ws *s,
		      const opsc_bf16 **xl)
{
	size_t n = (size_t)T * in;
	*xl = x;
	if (!(l->dropout > 0))
		return 0;
	tier_launch(lora_mask_kernel, grid_for(n), THREADS, 0, stream_of(d), n, in, l->mask_key, l->dropout,
			keep_scale(l), (const bf16 *)x, (bf16 *)s->drop);
	*xl = (const opsc_bf16 *)s->drop;
	return launched("opsc_linear (LoRA dropout mask)", n);
}

/* The rank-sized products write bf16 straight from cuBLASLt's fp32 accumulators (one rounding, as a
 * separate conversion did, without its launch: 12 of them a layer a step were ~5 us each). */
static int gemm_to_bf16(tier_dev *d, int m, int n, int k, float alpha, opsc_operand A, opsc_operand B, bf16 *C)
{
	return tier_cuda_gemm(d, -1, "opsc_linear (LoRA rank product)", m, n, k, alpha, A, B, 0.0f, C, CUDA_R_16BF, m);
}

/* xa16 [T, r] = bf16(x A^T): column-major xa^T [r, T] = A (stored [in, r], transposed) x^T (stored [in, T]). */
static int lora_xa(tier_dev *d, int T, int in, const opsc_bf16 *x, const tier_lora_ref *l, const lin_ws *s)
{
	return gemm_to_bf16(d, l->rank, T, in, 1.0f, bf(1, l->a, in), bf(0, x, in), s->xa16);
}

/* $TIER_LORA_FIRST: 1, the adapter's part of a linear layer's output (forward y, backward dx) is
 * written first and the main product adds to it through its beta, and the o projection's dx goes
 * to bf16 straight from the products (opsc_linear_bwd_to16); 0, the main product first and the
 * adapter's part added by a pass of its own over the fp32 output, as before session 22. Unset:
 * LORA_FIRST_DEFAULT, 1 since session 23 (first run on an H100: test_ops_cuda and test_golden_cuda
 * passed under it; the trainer's (a) +1.8% alone, bench/RESULTS.md). */
#define LORA_FIRST_DEFAULT 1
static int lora_first(void)
{
	const char *v = getenv("TIER_LORA_FIRST");
	return v && *v ? strcmp(v, "0") != 0 : LORA_FIRST_DEFAULT;
}

/* The forward adapter's first product: ws split into *s, then s->xa16 = x A^T (x masked under
 * dropout). */
static int lora_fwd_xa(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const tier_lora_ref *l, void *ws,
		       lin_ws *s)
{
	const opsc_bf16 *xl;
	*s = ws_split(ws, T, out, l->rank);
	int rc = lora_input(d, T, in, x, l, s, &xl);
	return rc ? rc : lora_xa(d, T, in, xl, l, s);
}

/* The adapter's part of the forward: lora_fwd_xa, then y^T (beta 0: =, 1: +=) scale B (stored
 * [r, out], transposed) xa^T (stored [r, T]). */
static int lora_y(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const tier_lora_ref *l, void *ws, float beta,
		  const float *res, float *y)
{
	int r = l->rank, rc;
	lin_ws s;
	if ((rc = lora_fwd_xa(d, T, in, out, x, l, ws, &s)))
		return rc;
	return gemm_res(d, out, T, r, l->scale, bf(1, l->b, r), bf(0, s.xa16, r), res, beta, y, out);
}

int opsc_linear_fwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, float *y, void *ws)
{
	return opsc_linear_fwd_res(d, T, in, out, x, w, lora, NULL, y, ws);
}

int opsc_linear_fwd_res(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			const tier_lora_ref *lora, const float *res, float *y, void *ws)
{
	int rc = linear_check("opsc_linear_fwd", d, T, in, out, x, w, lora, ws, 0);
	if (rc || T == 0)
		return rc;
	/* TIER_LORA_FIRST: the adapter's part first, then the main product adds to it through its beta,
	 * so that y is read once, in the main product's epilogue (a compute-bound product), not by a
	 * pass of its own after it. Else the main product first and the adapter's part added after. */
	int lo = lora_on(lora), first = lo && lora_first();
	/* res: the first product's epilogue adds it (C read from res, written to y) */
	if (first && (rc = lora_y(d, T, in, out, x, lora, ws, 0.0f, res, y)))
		return rc;
	/* y^T (=|+=) W (stored [in, out], transposed) x^T (stored [in, T]) */
	if ((rc = gemm_res(d, out, T, in, 1.0f, bf(1, w, in), bf(0, x, in), first ? NULL : res, first ? 1.0f : 0.0f, y,
			   out)) ||
	    !lo || first)
		return rc;
	return lora_y(d, T, in, out, x, lora, ws, 1.0f, NULL, y);
}

int opsc_linear_fwd16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		      const tier_lora_ref *lora, opsc_bf16 *y, void *ws)
{
	const char *op = "opsc_linear_fwd16";
	int rc = linear_check(op, d, T, in, out, x, w, lora, ws, 0), lo = lora_on(lora);
	if (rc || T == 0)
		return rc;
	if (!y)
		return tier_fail(-EINVAL, "%s: y is NULL (T=%d in=%d out=%d)", op, T, in, out);
	if (lo) {
		lin_ws s;
		/* y^T [out, T] = scale B (stored [r, out], transposed) xa^T (stored [r, T]), rounded */
		if ((rc = lora_fwd_xa(d, T, in, out, x, lora, ws, &s)) ||
		    (rc = tier_cuda_gemm(d, -1, "opsc_linear_fwd16 (LoRA)", out, T, lora->rank, lora->scale,
					 bf(1, lora->b, lora->rank), bf(0, s.xa16, lora->rank), 0.0f, y, CUDA_R_16BF, out)))
			return rc;
	}
	/* y^T (+)= W (stored [in, out], transposed) x^T (stored [in, T]) */
	return tier_cuda_gemm(d, -1, op, out, T, in, 1.0f, bf(1, w, in), bf(0, x, in), lo ? 1.0f : 0.0f, y, CUDA_R_16BF,
			      out);
}

/* dx (+)= the adapter's part, A^T dxa^T (written when not accumulate). With dropout it goes through
 * the fp32 piece over xd (the da product that last reads xd is queued before on the same stream) and
 * back through the mask, which adds it to dx whatever accumulate says. */
static int lora_dx(tier_dev *d, int T, int in, const tier_lora_ref *l, float *dx, int accumulate, const lin_ws *s)
{
	int r = l->rank, rc;
	size_t n = (size_t)T * in;
	/* dx^T [in, T] (+)= A^T (A stored [in, r]) dxa^T (stored [r, T]) */
	if (!(l->dropout > 0))
		return opsc_gemm(d, in, T, r, 1.0f, bf(0, l->a, in), bf(0, s->dxa16, r), accumulate ? 1.0f : 0.0f, dx, in);
	if ((rc = opsc_gemm(d, in, T, r, 1.0f, bf(0, l->a, in), bf(0, s->dxa16, r), 0.0f, (float *)s->drop, in)))
		return rc;
	tier_launch(lora_mask_add_kernel, grid_for(n), THREADS, 0, stream_of(d), n, in, l->mask_key, l->dropout,
			keep_scale(l), (const float *)s->drop, dx);
	return launched("opsc_linear_bwd (LoRA dropout mask)", n);
}

/* The adapter's part of the backward, after dy16 is in the workspace: db, da, and its part of dx
 * (lora_dx; dx NULL: none). The adapter's input (x, or x masked) is made again here, as the forward
 * made it. */
static int linear_bwd_lora(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const tier_lora_ref *l,
			   float *dx, int accumulate, const lin_ws *s)
{
	int r = l->rank, rc;
	const opsc_bf16 *xl = x;
	if ((l->da || l->db) && (rc = lora_input(d, T, in, x, l, s, &xl)))
		return rc;
	if (l->db) {
		if ((rc = lora_xa(d, T, in, xl, l, s)))
			return rc;
		/* db^T [r, out] += scale xa^T (stored [r, T]) dy (stored [out, T], transposed) */
		if ((rc = opsc_gemm(d, r, out, T, l->scale, bf(0, s->xa16, r), bf(1, s->dy16, out), 1.0f, l->db, r)))
			return rc;
	}
	if (!l->da && !dx)
		return 0;
	/* dxa^T [r, T] = scale B^T (B stored [r, out]) dy^T (stored [out, T]), in bf16 */
	if ((rc = gemm_to_bf16(d, r, T, out, l->scale, bf(0, l->b, r), bf(0, s->dy16, out), s->dxa16)))
		return rc;
	/* da^T [in, r] += xl^T (stored [in, T]) dxa (stored [r, T], transposed) */
	if (l->da && (rc = opsc_gemm(d, in, r, T, 1.0f, bf(0, xl, in), bf(1, s->dxa16, r), 1.0f, l->da, in)))
		return rc;
	return dx ? lora_dx(d, T, in, l, dx, accumulate, s) : 0;
}

/* The backward's products from dy in bf16 (s->dy16: the workspace's piece, or the caller's). */
static int linear_bwd_from16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			     const tier_lora_ref *lora, float *dx, int accumulate, const lin_ws *s)
{
	int rc, lo = lora_on(lora);
	/* Without dropout the adapter's part of dx goes first and the main product adds to it through
	 * its beta, as in the forward; with dropout the mask adds the adapter's part to dx after. */
	int first = lo && !(lora->dropout > 0) && lora_first();
	if (first && (rc = linear_bwd_lora(d, T, in, out, x, lora, dx, accumulate, s)))
		return rc;
	/* dx^T [in, T] (+)= W^T (W stored [in, out]) dy^T (stored [out, T]) */
	if (dx && (rc = opsc_gemm(d, in, T, out, 1.0f, bf(0, w, in), bf(0, s->dy16, out), accumulate || first ? 1.0f : 0.0f,
				  dx, in)))
		return rc;
	return lo && !first ? linear_bwd_lora(d, T, in, out, x, lora, dx, 1, s) : 0;
}

/* Whether a backward has anything to compute: dx, or a LoRA gradient. */
static int linear_bwd_wanted(const tier_lora_ref *lora, const float *dx)
{
	return dx || (lora_on(lora) && (lora->da || lora->db));
}

int opsc_linear_bwd(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
		    const tier_lora_ref *lora, const float *dy, float *dx, int accumulate, void *ws)
{
	int rc = linear_check("opsc_linear_bwd", d, T, in, out, x, w, lora, ws, 1);
	if (rc || T == 0 || !linear_bwd_wanted(lora, dx))
		return rc;
	lin_ws s = ws_split(ws, T, out, lora_on(lora) ? lora->rank : 0);
	if ((rc = opsc_to_bf16(d, (size_t)T * out, dy, (opsc_bf16 *)s.dy16)))
		return rc;
	return linear_bwd_from16(d, T, in, out, x, w, lora, dx, accumulate, &s);
}

/* dx16 = bf16(dy W + A^T dxa): the adapter's part rounded into dx16 (K = r), then the main product
 * added to it by cuBLASLt's beta, so that no fp32 [T, in] is written or read. */
static int linear_dx_to16(tier_dev *d, int T, int in, int out, const opsc_bf16 *w, const tier_lora_ref *l,
			  bf16 *dx16, const lin_ws *s)
{
	int rc, lo = lora_on(l);
	/* dx16^T [in, T] = A^T (A stored [in, r]) dxa^T (stored [r, T]) */
	if (lo && (rc = tier_cuda_gemm(d, -1, "opsc_linear_bwd_to16 (LoRA)", in, T, l->rank, 1.0f, bf(0, l->a, in),
				       bf(0, s->dxa16, l->rank), 0.0f, dx16, CUDA_R_16BF, in)))
		return rc;
	/* dx16^T (+)= W^T (W stored [in, out]) dy^T (stored [out, T]) */
	return tier_cuda_gemm(d, -1, "opsc_linear_bwd_to16", in, T, out, 1.0f, bf(0, w, in), bf(0, s->dy16, out),
			      lo ? 1.0f : 0.0f, dx16, CUDA_R_16BF, in);
}

int opsc_linear_bwd_to16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const float *dy, opsc_bf16 *dx16, float *dx32, void *ws)
{
	int rc = linear_check("opsc_linear_bwd_to16", d, T, in, out, x, w, lora, ws, 1);
	if (rc || T == 0)
		return rc;
	if (!dx16)
		return tier_fail(-EINVAL, "opsc_linear_bwd_to16: dx16 is NULL (T=%d in=%d out=%d)", T, in, out);
	/* with dropout the adapter's dx goes back through the mask in fp32 */
	if ((lora_on(lora) && lora->dropout > 0) || !lora_first()) {
		if (!dx32)
			return tier_fail(-EINVAL, "opsc_linear_bwd_to16: LoRA dropout (or TIER_LORA_FIRST=0) needs the fp32 "
					 "dx32 (T=%d in=%d out=%d)", T, in, out);
		rc = opsc_linear_bwd(d, T, in, out, x, w, lora, dy, dx32, 0, ws);
		return rc ? rc : opsc_to_bf16(d, (size_t)T * in, dx32, dx16);
	}
	lin_ws s = ws_split(ws, T, out, lora_on(lora) ? lora->rank : 0);
	if ((rc = opsc_to_bf16(d, (size_t)T * out, dy, (opsc_bf16 *)s.dy16)))
		return rc;
	/* the adapter's gradients, and dxa16 even where none is wanted (dx needs it) */
	if (lora_on(lora) && ((rc = linear_bwd_lora(d, T, in, out, x, lora, NULL, 0, &s)) ||
			      (!lora->da && (rc = gemm_to_bf16(d, lora->rank, T, out, lora->scale, bf(0, lora->b, lora->rank),
								bf(0, s.dy16, out), s.dxa16)))))
		return rc;
	return linear_dx_to16(d, T, in, out, w, lora, (bf16 *)dx16, &s);
}

int opsc_linear_bwd_bf16(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const opsc_bf16 *w,
			 const tier_lora_ref *lora, const opsc_bf16 *dy16, float *dx, int accumulate, void *ws)
{
	int rc = linear_check("opsc_linear_bwd_bf16", d, T, in, out, x, w, lora, ws, 0);
	if (rc || T == 0 || !linear_bwd_wanted(lora, dx))
		return rc;
	if (!dy16)
		return tier_fail(-EINVAL, "opsc_linear_bwd_bf16: dy16 is NULL (T=%d in=%d out=%d)", T, in, out);
	lin_ws s = ws_split(ws, T, out, lora_on(lora) ? lora->rank : 0); /* its dy piece unused */
	s.dy16 = (bf16 *)dy16;
	return linear_bwd_from16(d, T, in, out, x, w, lora, dx, accumulate, &s);
}

/* ---- Projections of one input in one backward product (opsc_linear_bwd_cat) --------------------- */

/* y rows at stride ldy = bf16(x), four at a time where every row's start is 16-byte (x) and 8-byte
 * (y) aligned. */
__global__ void to_bf16_rows4_kernel(int rows, int cols, const float *x, bf16 *y, int ldy)
{
	pdl_enter();
	const int c4 = cols / 4;
	GRID_STRIDE(k, (size_t)rows * c4) {
		const size_t r = k / c4, c = (k % c4) * 4;
		const float4 v = *(const float4 *)(x + r * cols + c);
		__nv_bfloat162 *o = (__nv_bfloat162 *)(y + r * ldy + c);
		o[0] = __floats2bfloat162_rn(v.x, v.y);
		o[1] = __floats2bfloat162_rn(v.z, v.w);
	}
}

__global__ void to_bf16_rows_kernel(int rows, int cols, const float *x, bf16 *y, int ldy)
{
	pdl_enter();
	GRID_STRIDE(k, (size_t)rows * cols)
		y[(k / cols) * ldy + k % cols] = __float2bfloat16_rn(x[k]);
}

int opsc_to_bf16_rows(tier_dev *d, int rows, int cols, const float *x, opsc_bf16 *y, int ldy)
{
	int rc = cuda_dev(d, "opsc_to_bf16_rows");
	if (rc)
		return rc;
	if (rows < 0 || cols < 0 || ldy < cols || (rows > 0 && cols > 0 && (!x || !y)))
		return tier_fail(-EINVAL, "opsc_to_bf16_rows: bad arguments rows=%d cols=%d ldy=%d (x %p, y %p)", rows, cols,
				 ldy, (const void *)x, (void *)y);
	size_t n = (size_t)rows * cols;
	if (n == 0)
		return 0;
	if (cols % 4 == 0 && ldy % 4 == 0 && al(x, 16) && al(y, 8))
		tier_launch(to_bf16_rows4_kernel, grid_for(n / 4), THREADS, 0, stream_of(d), rows, cols, x, (bf16 *)y,
				ldy);
	else
		tier_launch(to_bf16_rows_kernel, grid_for(n), THREADS, 0, stream_of(d), rows, cols, x, (bf16 *)y, ldy);
	return launched("opsc_to_bf16_rows", n);
}

/* One segment's adapter: db += scale xa^T dy (xa: its columns of the adapters' x A^T, stride
 * lx), dxa = scale dy B into dy's adapter columns (at dxa, stride ld), da += dxa^T x. */
static int cat_lora(tier_dev *d, int T, int in, int out, const opsc_bf16 *x, const tier_lora_ref *l,
		    const bf16 *dyj, bf16 *dxa, int ld, const bf16 *xa, int lx)
{
	int r = l->rank, rc;
	/* db^T [r, out] += scale xa^T (stored [r, T] at stride lx) dy (stored [out, T] at stride ld,
	 * transposed) */
	if (l->db && (rc = opsc_gemm(d, r, out, T, l->scale, bf(0, xa, lx), bf(1, dyj, ld), 1.0f, l->db, r)))
		return rc;
	/* dxa^T [r, T] (stride ld) = scale B^T (B stored [r, out]) dy^T (stored [out, T] at stride ld) */
	if ((rc = tier_cuda_gemm(d, -1, "opsc_linear_bwd_cat (LoRA rank product)", r, T, out, l->scale, bf(0, l->b, r),
				 bf(0, dyj, ld), 0.0f, dxa, CUDA_R_16BF, ld)))
		return rc;
	/* da^T [in, r] += x^T (stored [in, T]) dxa (stored [r, T] at stride ld, transposed) */
	return l->da ? opsc_gemm(d, in, r, T, 1.0f, bf(0, x, in), bf(1, dxa, ld), 1.0f, l->da, in) : 0;
}

static int cat_copy(tier_dev *d, void *dst, const void *src, size_t bytes)
{
	cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(d));
	if (e != cudaSuccess)
		return tier_fail(-EIO, "opsc_linear_cat: stacking the weights (%zu bytes): %s", bytes, cudaGetErrorString(e));
	return 0;
}

/* The adapters' A rows in segment order into astk [sum r, in]: the forward's stack, and the tail of
 * the backward's. */
static int cat_stack_a(tier_dev *d, int in, int n, const opsc_lin_seg *s, bf16 *astk)
{
	int rc;
	for (int j = 0, r0 = 0; j < n; j++) {
		const tier_lora_ref *l = s[j].lora;
		if (!lora_on(l))
			continue;
		if ((rc = cat_copy(d, astk + (size_t)r0 * in, l->a, (size_t)l->rank * in * 2)))
			return rc;
		r0 += l->rank;
	}
	return 0;
}

/* wcat [K, in]: the weights' rows in segment order, then the adapters' A rows (from row aoff, the
 * segments' outputs summed), as dy's columns. */
static int cat_stack(tier_dev *d, int in, int n, const opsc_lin_seg *s, int aoff, bf16 *wcat)
{
	int rc;
	for (int j = 0, off = 0; j < n; off += s[j].out, j++)
		if ((rc = cat_copy(d, wcat + (size_t)off * in, s[j].w, (size_t)s[j].out * in * 2)))
			return rc;
	return cat_stack_a(d, in, n, s, wcat + (size_t)aoff * in);
}

int opsc_linear_bwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, opsc_bf16 *dy,
			int ld, float *dx, int accumulate, void *ws)
{
	int rc = cuda_dev(d, "opsc_linear_bwd_cat");
	if (rc || (rc = opsc_linear_cat_check("opsc_linear_bwd_cat", T, in, x, n, s, dy, ld, dx, ws)) || T == 0)
		return rc;
	const int K = opsc_linear_cat_cols(n, s), xr = opsc_linear_cat_ranks(n, s), aoff = K - xr;
	bf16 *wcat = (bf16 *)ws, *xa = (bf16 *)((char *)ws + al256((size_t)K * in * 2)), *dy16 = (bf16 *)dy;
	int dbs = 0, off = 0;
	for (int j = 0; j < n; j++)
		dbs |= lora_on(s[j].lora) && s[j].lora->db != NULL;
	if ((rc = cat_stack(d, in, n, s, aoff, wcat)))
		return rc;
	/* every adapter's x A^T in one product, from the stacked A rows: xa^T [xr, T] = A_all (stored
	 * [in, xr], transposed) x^T (stored [in, T]) */
	if (dbs && (rc = gemm_to_bf16(d, xr, T, in, 1.0f, bf(1, wcat + (size_t)aoff * in, in), bf(0, x, in), xa)))
		return rc;
	for (int j = 0, xo = 0; j < n; j++) {
		const tier_lora_ref *l = s[j].lora;
		if (lora_on(l) && (rc = cat_lora(d, T, in, s[j].out, x, l, dy16 + off, dy16 + aoff + xo, ld, xa + xo, xr)))
			return rc;
		off += s[j].out;
		xo += lora_on(l) ? l->rank : 0;
	}
	/* dx^T [in, T] (=|+=) wcat^T (stored [in, K]) dy^T (stored [K, T] at stride ld) */
	return opsc_gemm(d, in, T, K, 1.0f, bf(0, wcat, in), bf(0, dy16, ld), accumulate ? 1.0f : 0.0f, dx, in);
}

int opsc_linear_fwd_cat(tier_dev *d, int T, int in, const opsc_bf16 *x, int n, const opsc_lin_seg *s, float *const *y,
			void *ws)
{
	int rc = cuda_dev(d, "opsc_linear_fwd_cat");
	/* the segments' checks are the backward's (x standing in for dy, y[0] for dx) */
	if (rc || (rc = opsc_linear_cat_check("opsc_linear_fwd_cat", T, in, x, n, s, x, opsc_linear_cat_cols(n, s),
						  y ? y[0] : NULL, ws)))
		return rc;
	for (int j = 0; j < n && T > 0; j++)
		if (!y[j])
			return tier_fail(-EINVAL, "opsc_linear_fwd_cat: segment %d's output is NULL", j);
	if (T == 0)
		return 0;
	const int xr = opsc_linear_cat_ranks(n, s);
	bf16 *astk = (bf16 *)ws, *xa = (bf16 *)((char *)ws + al256((size_t)xr * in * 2));
	if ((rc = cat_stack_a(d, in, n, s, astk)))
		return rc;
	/* xa^T [xr, T] = A_all (stored [in, xr], transposed) x^T (stored [in, T]) */
	if (xr && (rc = gemm_to_bf16(d, xr, T, in, 1.0f, bf(1, astk, in), bf(0, x, in), xa)))
		return rc;
	for (int j = 0, xo = 0; j < n; j++) {
		const tier_lora_ref *l = s[j].lora;
		int lo = lora_on(l), first = lo && lora_first(), out = s[j].out;
		/* y^T (=|+=) scale B (stored [r, out], transposed) xa^T (its rows of [xr, T]) */
		if (first && (rc = opsc_gemm(d, out, T, l->rank, l->scale, bf(1, l->b, l->rank), bf(0, xa + xo, xr), 0.0f,
					     y[j], out)))
			return rc;
		/* y^T (=|+=) W (stored [in, out], transposed) x^T (stored [in, T]) */
		if ((rc = opsc_gemm(d, out, T, in, 1.0f, bf(1, s[j].w, in), bf(0, x, in), first ? 1.0f : 0.0f, y[j], out)))
			return rc;
		if (lo && !first && (rc = opsc_gemm(d, out, T, l->rank, l->scale, bf(1, l->b, l->rank), bf(0, xa + xo, xr),
						    1.0f, y[j], out)))
			return rc;
		xo += lo ? l->rank : 0;
	}
	return 0;
}
