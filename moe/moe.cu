/* moe.cu - the forward CUDA kernels of the MoE block: fused router (logits, scores, group-limited
 * top-k, weights) with one block per token, permute (histogram, scan, stable placement by one
 * block per expert, gather) and the weighted combine (the experts are in moe_experts.cu). bf16 storage, fp32 accumulation. Same
 * semantics as the CPU reference in router.c, permute.c and combine.c (ties to the lower index,
 * HF's 0.0 fill of dropped groups, drops by token order within an expert). */
#include <math.h>
#include <stdint.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"

#define ROUTER_THREADS 256

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
	int rc = moe_cuda_dev(dev, fn);
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

/* 16-byte copies: every row starts 16-byte aligned when H is a multiple of 8 and the bases are. */
__global__ void gather16_kernel(const int32_t *offsets, int E, const int32_t *row_pair, int k, int H8, const uint4 *x,
				uint4 *xg)
{
	int r = blockIdx.x;
	if (r >= offsets[E])
		return;
	const uint4 *src = x + (size_t)(row_pair[r] / k) * H8;
	for (int h = threadIdx.x; h < H8; h += blockDim.x)
		xg[(size_t)r * H8 + h] = src[h];
}

static int launch_gather(cudaStream_t st, int n, const int32_t *offsets, int E, const int32_t *row_pair, int k, int H,
			 const void *x, void *xg)
{
	if (H % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)xg % 16 == 0)
		gather16_kernel<<<n, 128, 0, st>>>(offsets, E, row_pair, k, H / 8, (const uint4 *)x, (uint4 *)xg);
	else
		gather_kernel<<<n, 128, 0, st>>>(offsets, E, row_pair, k, H, (const bf16 *)x, (bf16 *)xg);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_permute(tier_dev *dev, int T, int k, int E, int H, int capacity, const int32_t *topk_idx,
				const void *x, int32_t *offsets, int32_t *row_pair, int32_t *pair_row, int32_t *counts,
				void *xg)
{
	const char *fn = "moe_cuda_permute";
	int rc = moe_cuda_dev(dev, fn);
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
	CUDA_LAUNCHED();
	scan_kernel<<<1, 32, 0, st>>>(counts, E, capacity, offsets);
	CUDA_LAUNCHED();
	place_kernel<<<E, 1024, 0, st>>>(topk_idx, n, offsets, row_pair, pair_row);
	CUDA_LAUNCHED();
	return x ? launch_gather(st, n, offsets, E, row_pair, k, H, x, xg) : 0;
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

/* Eight columns per thread: one 16-byte load per row, two float4 stores (H a multiple of 8, aligned
 * bases). The same order of the k terms as combine_kernel and the CPU. */
__global__ void combine8_kernel(int k, int H8, const int32_t *pair_row, const float *w, const uint4 *y, float4 *out)
{
	int t = blockIdx.x;
	for (int h = threadIdx.x; h < H8; h += blockDim.x) {
		float acc[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
		for (int j = 0; j < k; j++) {
			int r = pair_row[t * k + j];
			if (r < 0)
				continue;
			float wj = w[t * k + j];
			uint4 v = y[(size_t)r * H8 + h];
			const __nv_bfloat162 *b = (const __nv_bfloat162 *)&v;
			for (int q = 0; q < 4; q++) {
				float2 f = __bfloat1622float2(b[q]);
				acc[2 * q] += wj * f.x;
				acc[2 * q + 1] += wj * f.y;
			}
		}
		float4 *o = out + (size_t)t * H8 * 2 + 2 * (size_t)h;
		o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
		o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
	}
}

extern "C" int moe_cuda_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
				    const void *y, float *out)
{
	const char *fn = "moe_cuda_combine_fwd";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(topk_w, fn);
	MOE_NONNULL(y, fn);
	MOE_NONNULL(out, fn);
	cudaStream_t st = moe_stream(dev);
	if (H % 8 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)out % 16 == 0)
		combine8_kernel<<<T, 128, 0, st>>>(k, H / 8, pair_row, topk_w, (const uint4 *)y, (float4 *)out);
	else
		combine_kernel<<<T, 256, 0, st>>>(k, H, pair_row, topk_w, (const bf16 *)y, out);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_gather(tier_dev *dev, int T, int k, int E, int H, const int32_t *offsets,
			       const int32_t *row_pair, const void *x, void *xg)
{
	const char *fn = "moe_cuda_gather";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(row_pair, fn);
	MOE_NONNULL(x, fn);
	MOE_NONNULL(xg, fn);
	return launch_gather(moe_stream(dev), T * k, offsets, E, row_pair, k, H, x, xg);
}
