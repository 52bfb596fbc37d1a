/* moe.cu - the first CUDA kernels of the MoE block: fused router (logits, scores, group-limited
 * top-k, weights) with one block per token, permute (histogram, scan, stable placement by one
 * block per expert, gather) and the weighted combine. bf16 storage, fp32 accumulation. Same
 * semantics as the CPU reference in router.c, permute.c and combine.c (ties to the lower index,
 * HF's 0.0 fill of dropped groups, drops by token order within an expert). */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

#define CUDA_TRY(call)                                                                             \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return tier_fail(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call,         \
					 cudaGetErrorString(e_));                                  \
	} while (0)

#define ROUTER_THREADS 256

static int cuda_dev(tier_dev *dev, const char *fn)
{
	if (!dev || tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "%s: needs a CUDA device context", fn);
	return 0;
}

struct router_args {
	int kind, E, k, norm, G, tg, T, H;
	float rsf;
};

/* Warp argmax over (v, i): larger v first, then the lower index. */
__device__ static inline void warp_best(float &v, int &i)
{
	for (int d = 16; d; d >>= 1) {
		float ov = __shfl_xor_sync(0xffffffffu, v, d);
		int oi = __shfl_xor_sync(0xffffffffu, i, d);
		if (ov > v || (ov == v && oi < i && oi >= 0) || (i < 0 && oi >= 0)) {
			v = ov;
			i = oi;
		}
	}
}

/* Warp 0 picks the n best of val[0..m) (skipping taken), writing out[0..n). */
__device__ static void warp_topn(const float *val, int m, int n, char *taken, int *out)
{
	int lane = threadIdx.x & 31;
	for (int j = 0; j < n; j++) {
		float v = -INFINITY;
		int i = -1;
		for (int e = lane; e < m; e += 32)
			if (!taken[e] && (i < 0 || val[e] > v)) {
				v = val[e];
				i = e;
			}
		warp_best(v, i);
		if (lane == 0) {
			out[j] = i;
			taken[i] = 1;
		}
		__syncwarp();
	}
}

__global__ void router_kernel(router_args a, const __nv_bfloat16 *x, const __nv_bfloat16 *w, const float *bias,
			      float *logits, int32_t *topk_idx, float *topk_w)
{
	extern __shared__ float sm[];
	float *xs = sm, *lg = xs + a.H, *crit = lg + a.E, *gsc = crit + a.E;
	__shared__ char taken[TIER_MOE_MAX_EXPERTS], kept[TIER_MOE_MAX_EXPERTS];
	__shared__ int sel[TIER_MOE_MAX_TOPK], gsel[TIER_MOE_MAX_EXPERTS];
	int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
	for (int h = tid; h < a.H; h += blockDim.x)
		xs[h] = __bfloat162float(x[(size_t)t * a.H + h]);
	__syncthreads();
	for (int e = warp; e < a.E; e += nw) { /* one warp per expert: coalesced rows of W_r */
		const __nv_bfloat16 *row = w + (size_t)e * a.H;
		float s = 0.0f;
		for (int h = lane; h < a.H; h += 32)
			s += xs[h] * __bfloat162float(row[h]);
		for (int d = 16; d; d >>= 1)
			s += __shfl_xor_sync(0xffffffffu, s, d);
		if (lane == 0)
			lg[e] = logits[(size_t)t * a.E + e] = s;
	}
	__syncthreads();
	int sig = a.kind == TIER_MOE_ROUTER_SIGMOID_GROUP;
	for (int e = tid; e < a.E; e += blockDim.x) {
		crit[e] = sig ? 1.0f / (1.0f + __expf(-lg[e])) + (bias ? bias[e] : 0.0f) : lg[e];
		taken[e] = 0;
	}
	__syncthreads();
	if (sig && a.G > 1) { /* group score: sum of the top-2 of each group; keep topk_group groups */
		int gs = a.E / a.G;
		for (int g = tid; g < a.G; g += blockDim.x) {
			float b1 = -INFINITY, b2 = -INFINITY;
			for (int e = g * gs; e < (g + 1) * gs; e++) {
				float c = crit[e];
				if (c > b1) {
					b2 = b1;
					b1 = c;
				} else if (c > b2) {
					b2 = c;
				}
			}
			gsc[g] = b1 + (gs > 1 ? b2 : 0.0f);
			kept[g] = 0;
		}
		__syncthreads();
		if (warp == 0) {
			warp_topn(gsc, a.G, a.tg, kept, gsel); /* marks kept[] as 'taken' */
		}
		__syncthreads();
		for (int e = tid; e < a.E; e += blockDim.x)
			if (!kept[e / gs])
				crit[e] = 0.0f; /* HF: masked_fill(~mask, 0.0) */
		__syncthreads();
	}
	if (warp != 0)
		return;
	warp_topn(crit, a.E, a.k, taken, sel);
	/* weights */
	float m = lg[sel[0]], s = 0.0f;
	if (!sig && a.kind == TIER_MOE_ROUTER_SOFTMAX_TOPK && !a.norm) {
		for (int e = lane; e < a.E; e += 32)
			s += __expf(lg[e] - m);
		for (int d = 16; d; d >>= 1)
			s += __shfl_xor_sync(0xffffffffu, s, d);
	}
	if (lane != 0)
		return;
	float wk[TIER_MOE_MAX_TOPK], sk = 0.0f;
	for (int j = 0; j < a.k; j++) {
		wk[j] = sig ? 1.0f / (1.0f + __expf(-lg[sel[j]])) : __expf(lg[sel[j]] - m);
		sk += wk[j];
	}
	float scale = sig ? a.rsf / (a.norm ? sk + 1e-20f : 1.0f)
			  : 1.0f / ((a.kind == TIER_MOE_ROUTER_SOFTMAX_TOPK && !a.norm) ? s : sk);
	for (int j = 0; j < a.k; j++) {
		topk_idx[(size_t)t * a.k + j] = sel[j];
		topk_w[(size_t)t * a.k + j] = wk[j] * scale;
	}
}

extern "C" int moe_cuda_router_fwd(tier_dev *dev, const tier_moe_router_cfg *cfg, int T, int H, const void *x,
				   const void *w_r, const float *bias, float *logits, int32_t *topk_idx, float *topk_w)
{
	const char *fn = "moe_cuda_router_fwd";
	int rc = cuda_dev(dev, fn);
	if (rc || (rc = tier_moe_router_check(cfg)) || (rc = moe_check_tk(fn, T, cfg->top_k, cfg->n_experts)) ||
	    (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(x, fn);
	MOE_NONNULL(w_r, fn);
	MOE_NONNULL(logits, fn);
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(topk_w, fn);
	router_args a = { (int)cfg->kind, cfg->n_experts, cfg->top_k, cfg->norm_topk_prob, cfg->n_group,
			  cfg->n_group > 1 ? cfg->topk_group : 1, T, H,
			  cfg->routed_scaling_factor == 0.0f ? 1.0f : cfg->routed_scaling_factor };
	size_t smem = sizeof(float) * ((size_t)H + 3 * (size_t)cfg->n_experts);
	int maxsm = 0, ord = tier_dev_ordinal(dev);
	CUDA_TRY(cudaDeviceGetAttribute(&maxsm, cudaDevAttrMaxSharedMemoryPerBlockOptin, ord));
	if (smem + 8192 > (size_t)maxsm)
		return tier_fail(-EINVAL, "%s: hidden size %d needs %zu bytes of shared memory per block, more than "
				 "the device's %d", fn, H, smem, maxsm);
	CUDA_TRY(cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	cudaStream_t st = (cudaStream_t)tier_dev_stream(dev);
	router_kernel<<<T, ROUTER_THREADS, smem, st>>>(a, (const __nv_bfloat16 *)x, (const __nv_bfloat16 *)w_r, bias,
						     logits, topk_idx, topk_w);
	CUDA_TRY(cudaGetLastError());
	return 0;
}

/* ---- permute ---- */
__global__ void hist_kernel(const int32_t *idx, int n, int E, int32_t *counts, int32_t *pair_row)
{
	int p = blockIdx.x * blockDim.x + threadIdx.x;
	if (p < n) {
		int e = idx[p];
		pair_row[p] = -1;
		if (e >= 0 && e < E)
			atomicAdd(&counts[e], 1);
	}
}

/* offsets = exclusive scan of the kept counts (E <= 1024: one block, a serial scan is enough). */
__global__ void scan_kernel(const int32_t *counts, int E, int cap, int32_t *offsets)
{
	if (threadIdx.x != 0)
		return;
	int s = 0;
	offsets[0] = 0;
	for (int e = 0; e < E; e++) {
		int c = counts[e];
		s += cap > 0 && c > cap ? cap : c;
		offsets[e + 1] = s;
	}
}

/* One block per expert walks the pairs in order: a block-wide prefix sum of "pair is mine" gives
 * each pair its rank within the expert, so placement is stable (token order) without sorting. */
__global__ void place_kernel(const int32_t *idx, int n, const int32_t *offsets, int32_t *row_pair, int32_t *pair_row)
{
	__shared__ int wsum[32];
	__shared__ int run;
	int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
	int off = offsets[e], kept = offsets[e + 1] - off;
	if (tid == 0)
		run = 0;
	__syncthreads();
	for (int base = 0; base < n; base += blockDim.x) {
		int p = base + tid, mine = p < n && idx[p] == e;
		unsigned b = __ballot_sync(0xffffffffu, mine);
		int before = __popc(b & ((1u << lane) - 1));
		if (lane == 0)
			wsum[warp] = __popc(b);
		__syncthreads();
		int wbefore = 0, total = 0;
		for (int i = 0; i < nw; i++) {
			wbefore += i < warp ? wsum[i] : 0;
			total += wsum[i];
		}
		int rank = run + wbefore + before;
		if (mine && rank < kept) {
			pair_row[p] = off + rank;
			row_pair[off + rank] = p;
		}
		__syncthreads();
		if (tid == 0)
			run += total;
		__syncthreads();
	}
}

__global__ void gather_kernel(const int32_t *offsets, int E, const int32_t *row_pair, int k, int H,
			      const __nv_bfloat16 *x, __nv_bfloat16 *xg)
{
	int r = blockIdx.x;
	if (r >= offsets[E])
		return;
	const __nv_bfloat16 *src = x + (size_t)(row_pair[r] / k) * H;
	for (int h = threadIdx.x; h < H; h += blockDim.x)
		xg[(size_t)r * H + h] = src[h];
}

extern "C" int moe_cuda_permute(tier_dev *dev, int T, int k, int E, int H, int capacity, const int32_t *topk_idx,
				const void *x, int32_t *offsets, int32_t *row_pair, int32_t *pair_row, int32_t *counts,
				void *xg)
{
	const char *fn = "moe_cuda_permute";
	int rc = cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)))
		return rc;
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(row_pair, fn);
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(counts, fn);
	if (x && ((rc = moe_check_dim(fn, "H", H)) || !xg))
		return rc ? rc : tier_fail(-EINVAL, "%s: xg is NULL while x is given", fn);
	cudaStream_t st = (cudaStream_t)tier_dev_stream(dev);
	int n = T * k;
	CUDA_TRY(cudaMemsetAsync(counts, 0, sizeof(int32_t) * (size_t)E, st));
	CUDA_TRY(cudaMemsetAsync(row_pair, 0xff, sizeof(int32_t) * (size_t)n, st));
	hist_kernel<<<(n + 255) / 256, 256, 0, st>>>(topk_idx, n, E, counts, pair_row);
	scan_kernel<<<1, 32, 0, st>>>(counts, E, capacity, offsets);
	place_kernel<<<E, 1024, 0, st>>>(topk_idx, n, offsets, row_pair, pair_row);
	if (x)
		gather_kernel<<<n, 128, 0, st>>>(offsets, E, row_pair, k, H, (const __nv_bfloat16 *)x, (__nv_bfloat16 *)xg);
	CUDA_TRY(cudaGetLastError());
	return 0;
}

/* ---- combine ---- */
__global__ void combine_kernel(int k, int H, const int32_t *pair_row, const float *w, const __nv_bfloat16 *y, float *out)
{
	int t = blockIdx.x;
	for (int h = threadIdx.x; h < H; h += blockDim.x) {
		float acc = 0.0f;
		for (int j = 0; j < k; j++) {
			int r = pair_row[t * k + j];
			if (r >= 0)
				acc += w[t * k + j] * __bfloat162float(y[(size_t)r * H + h]);
		}
		out[(size_t)t * H + h] = acc;
	}
}

extern "C" int moe_cuda_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
				    const void *y, float *out)
{
	const char *fn = "moe_cuda_combine_fwd";
	int rc = cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(topk_w, fn);
	MOE_NONNULL(y, fn);
	MOE_NONNULL(out, fn);
	combine_kernel<<<T, 256, 0, (cudaStream_t)tier_dev_stream(dev)>>>(k, H, pair_row, topk_w,
									 (const __nv_bfloat16 *)y, out);
	CUDA_TRY(cudaGetLastError());
	return 0;
}

/* ---- experts: per-expert cuBLASLt products (a first version of the grouped GEMM) ---- */
#include <cublasLt.h>

/* Column-major D [m, n] = op(A) B with op(A) = A^T (A stored k x m, lda) and B k x n (ldb):
 * for row-major tensors this is Y [n, m] = X [n, k] W^T with W [m, k], the nn.Linear product. */
static int lt_linear(tier_dev *dev, int m, int n, int k, const void *W, const void *X, void *D, cudaDataType_t dt)
{
	cublasLtHandle_t h = (cublasLtHandle_t)tier_dev_blaslt(dev);
	size_t wsb = 0;
	void *ws = tier_dev_blaslt_workspace(dev, &wsb);
	cublasLtMatmulDesc_t desc = NULL;
	cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
	cublasLtMatmulPreference_t pref = NULL;
	cublasLtMatmulHeuristicResult_t heur;
	cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
	float alpha = 1.0f, beta = 0.0f;
	int found = 0;
	cublasStatus_t st = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&ld, dt, m, n, m);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceCreate(&pref);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &heur, &found);
	if (st == CUBLAS_STATUS_SUCCESS && found == 0)
		st = CUBLAS_STATUS_NOT_SUPPORTED;
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmul(h, desc, &alpha, W, la, X, lb, &beta, D, ld, D, ld, &heur.algo, ws, wsb,
				    (cudaStream_t)tier_dev_stream(dev));
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	if (ld)
		cublasLtMatrixLayoutDestroy(ld);
	if (lb)
		cublasLtMatrixLayoutDestroy(lb);
	if (la)
		cublasLtMatrixLayoutDestroy(la);
	if (desc)
		cublasLtMatmulDescDestroy(desc);
	if (st != CUBLAS_STATUS_SUCCESS)
		return tier_fail(-EIO, "moe_cuda_experts_fwd: cuBLASLt product %dx%dx%d failed: status %d", m, n, k, (int)st);
	return 0;
}

/* The SwiGLU epilogue: h = silu(g) u, stored bf16. */
__global__ void swiglu_kernel(const float *g, const float *u, size_t n, __nv_bfloat16 *h)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
		float x = g[i];
		h[i] = __float2bfloat16(x / (1.0f + __expf(-x)) * u[i]);
	}
}

extern "C" int moe_cuda_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
				    const void *const *gate, const void *const *up, const void *const *down,
				    const void *xg, float *g, float *u, void *h, void *y)
{
	const char *fn = "moe_cuda_experts_fwd";
	int rc = cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "H", H)) || (rc = moe_check_dim(fn, "I", I)))
		return rc;
	MOE_NONNULL(offsets_host, fn);
	MOE_NONNULL(gate, fn);
	MOE_NONNULL(up, fn);
	MOE_NONNULL(down, fn);
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(h, fn);
	MOE_NONNULL(y, fn);
	if (offsets_host[0] != 0)
		return tier_fail(-EINVAL, "%s: offsets[0] = %d; it must be 0", fn, offsets_host[0]);
	for (int e = 0; e < E; e++) {
		if (offsets_host[e + 1] < offsets_host[e])
			return tier_fail(-EINVAL, "%s: offsets decrease at expert %d", fn, e);
		if (offsets_host[e + 1] > offsets_host[e] && (!gate[e] || !up[e] || !down[e]))
			return tier_fail(-EINVAL, "%s: expert %d has rows but a NULL weight", fn, e);
	}
	const __nv_bfloat16 *x = (const __nv_bfloat16 *)xg;
	__nv_bfloat16 *hb = (__nv_bfloat16 *)h, *yb = (__nv_bfloat16 *)y;
	for (int e = 0; e < E; e++) {
		int o = offsets_host[e], n = offsets_host[e + 1] - o;
		if (n == 0)
			continue;
		if ((rc = lt_linear(dev, I, n, H, gate[e], x + (size_t)o * H, g + (size_t)o * I, CUDA_R_32F)) ||
		    (rc = lt_linear(dev, I, n, H, up[e], x + (size_t)o * H, u + (size_t)o * I, CUDA_R_32F)))
			return rc;
	}
	size_t rows = (size_t)offsets_host[E], total = rows * I;
	if (total) {
		int blocks = (int)((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
		swiglu_kernel<<<blocks, 256, 0, (cudaStream_t)tier_dev_stream(dev)>>>(g, u, total, hb);
		CUDA_TRY(cudaGetLastError());
	}
	for (int e = 0; e < E; e++) {
		int o = offsets_host[e], n = offsets_host[e + 1] - o;
		if (n && (rc = lt_linear(dev, H, n, I, down[e], hb + (size_t)o * I, yb + (size_t)o * H, CUDA_R_16BF)))
			return rc;
	}
	return 0;
}
