/* moe.cu - the forward CUDA kernels of the MoE block: the router (logits by cuBLASLt, then one
 * warp per token for scores, group-limited top-k and weights), the permute (per-segment histograms,
 * a scan over segments, stable placement, then one warp per token scattering its row to its k
 * expert rows) and the weighted combine (the experts are in moe_experts.cu). bf16 storage, fp32
 * accumulation. Same semantics as the CPU reference in router.c, permute.c and combine.c (ties to
 * the lower index, HF's 0.0 fill of dropped groups, drops by token order within an expert). */
#include <math.h>
#include <stdint.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "base/pdl.cuh"

#define FULL_MASK 0xffffffffu

/* ---- router ----
 * The logits product x W_r^T is a GEMM (2 T E H flops: 8.6 GFLOP at T=16384, H=2048, E=128) and
 * goes to cuBLASLt; what is left per token is O(k E) work on E <= 1024 floats, done by one warp
 * with the token's scores in registers: expert e lives in lane e % 32, slot e / 32. NCH (the
 * slots per lane, a power of two >= E / 32) is a template parameter so that the slot loops unroll
 * and the scores stay in registers. */
#define RT_WARPS 4 /* tokens per block of the selection kernel */

struct router_args {
	int kind, E, k, norm, G, tg, T;
	float rsf;
};

/* (va, ia) ranks before (vb, ib): larger value, or the same value and the lower index; an empty
 * candidate (index < 0) ranks after every real one. A strict total order on real candidates (NaN
 * scores are mapped to -inf before), so every lane of a butterfly reduction ends on the same one. */
__device__ static inline bool rt_before(float va, int ia, float vb, int ib)
{
	return ia >= 0 && (ib < 0 || va > vb || (va == vb && ia < ib));
}

/* The warp's best candidate: every lane ends with the same (v, i). */
__device__ static inline void rt_warp_best(float &v, int &i)
{
	for (int d = 16; d; d >>= 1) {
		float ov = __shfl_xor_sync(FULL_MASK, v, d);
		int oi = __shfl_xor_sync(FULL_MASK, i, d);
		if (rt_before(ov, oi, v, i)) {
			v = ov;
			i = oi;
		}
	}
}

/* Takes the best of the lane's candidates still in `avail` (bit s: slot s) over the warp, clears it
 * in its owner's mask and returns its index (warp-uniform). Within a lane the slots go up in index,
 * so the strict comparison keeps the lower index on ties there too. */
template <int NCH>
__device__ static inline int rt_take_best(const float (&v)[NCH], uint32_t &avail, int lane, float *best)
{
	float bv = -INFINITY;
	int bi = -1;
#pragma unroll
	for (int s = 0; s < NCH; s++)
		if ((avail >> s & 1u) && rt_before(v[s], lane + 32 * s, bv, bi)) {
			bv = v[s];
			bi = lane + 32 * s;
		}
	rt_warp_best(bv, bi);
	if (bi >= 0 && (bi & 31) == lane)
		avail &= ~(1u << (bi >> 5));
	if (best)
		*best = bv;
	return bi;
}

__device__ static inline float rt_warp_sum(float v)
{
	for (int d = 16; d; d >>= 1)
		v += __shfl_xor_sync(FULL_MASK, v, d);
	return v;
}

/* DeepSeek's group limit on the selection scores c: a group's score is the sum of its top two
 * (its one score for groups of one); the topk_group best groups stay (ties to the lower group) and
 * every expert of the other groups gets 0.0 (HF's masked_fill, not -inf). cs [E] and kept [G]:
 * this warp's shared memory. */
template <int NCH>
__device__ static void rt_group_limit(const router_args &a, float (&c)[NCH], float *cs, unsigned char *kept, int lane)
{
	int gs = a.E / a.G;
#pragma unroll
	for (int s = 0; s < NCH; s++)
		if (lane + 32 * s < a.E)
			cs[lane + 32 * s] = c[s];
	for (int g = lane; g < a.G; g += 32)
		kept[g] = 0;
	__syncwarp();
	float gsc[NCH]; /* group g = lane + 32 s: G <= E, so NCH slots hold the groups too */
	uint32_t gavail = 0;
#pragma unroll
	for (int s = 0; s < NCH; s++) {
		int g = lane + 32 * s;
		float b1 = -INFINITY, b2 = -INFINITY;
		if (g < a.G) {
			for (int e = g * gs; e < (g + 1) * gs; e++) {
				float v = cs[e];
				if (v > b1) {
					b2 = b1;
					b1 = v;
				} else if (v > b2) {
					b2 = v;
				}
			}
			gavail |= 1u << s;
		}
		float sc = b1 + (gs > 1 ? b2 : 0.0f);
		gsc[s] = isnan(sc) ? -INFINITY : sc; /* inf - inf: keep the order total */
	}
	for (int j = 0; j < a.tg; j++) {
		int g = rt_take_best<NCH>(gsc, gavail, lane, NULL);
		if (lane == 0)
			kept[g] = 1; /* g >= 0: tg <= G real groups */
	}
	__syncwarp();
#pragma unroll
	for (int s = 0; s < NCH; s++) {
		int e = lane + 32 * s;
		if (e < a.E && !kept[e / gs])
			c[s] = 0.0f;
	}
}

/* One warp per token: selection scores (logits, or sigmoid + bias), the group limit, k rounds of
 * warp arg-max, then the weights; lane j writes pick j. */
template <int NCH>
__global__ void __launch_bounds__(32 * RT_WARPS) router_select_kernel(router_args a, const float *__restrict__ logits,
								      const float *__restrict__ bias,
								      int32_t *__restrict__ topk_idx,
								      float *__restrict__ topk_w)
{
	pdl_enter();
	extern __shared__ float rt_smem[]; /* group limit only: per warp E floats, then E bytes */
	int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, t = blockIdx.x * RT_WARPS + wib;
	if (t >= a.T)
		return; /* warp-uniform, and no block barrier below */
	const float *l = logits + (size_t)t * a.E;
	int sig = a.kind == TIER_MOE_ROUTER_SIGMOID_GROUP;
	float c[NCH];
	uint32_t avail = 0;
#pragma unroll
	for (int s = 0; s < NCH; s++) {
		int e = lane + 32 * s;
		float v = -INFINITY;
		if (e < a.E) {
			float lv = l[e];
			v = sig ? 1.0f / (1.0f + expf(-lv)) + (bias ? bias[e] : 0.0f) : lv; /* router.c's moe_sigmoid */
			v = isnan(v) ? -INFINITY : v;
			avail |= 1u << s;
		}
		c[s] = v;
	}
	if (sig && a.G > 1) {
		float *cs = rt_smem + (size_t)wib * a.E;
		unsigned char *kept = (unsigned char *)(rt_smem + (size_t)RT_WARPS * a.E) + (size_t)wib * a.E;
		rt_group_limit<NCH>(a, c, cs, kept, lane);
	}
	int pick = -1;
	float top = 0.0f; /* pick 0's score: for the softmax forms the largest logit */
	for (int j = 0; j < a.k; j++) {
		float bv;
		int bi = rt_take_best<NCH>(c, avail, lane, &bv); /* >= 0: k <= E real candidates */
		if (lane == j)
			pick = bi;
		if (j == 0)
			top = bv;
	}
	float lv = lane < a.k ? l[pick] : 0.0f, w, sum;
	if (sig) { /* weights from the un-biased scores */
		w = lane < a.k ? 1.0f / (1.0f + expf(-lv)) : 0.0f;
		sum = rt_warp_sum(w);
		w *= a.rsf / (a.norm ? sum + 1e-20f : 1.0f);
	} else {
		w = lane < a.k ? expf(lv - top) : 0.0f;
		sum = rt_warp_sum(w);
		if (a.kind == TIER_MOE_ROUTER_SOFTMAX_TOPK && !a.norm) { /* softmax over all E */
			float all = 0.0f;
#pragma unroll
			for (int s = 0; s < NCH; s++)
				all += lane + 32 * s < a.E ? expf(c[s] - top) : 0.0f;
			sum = rt_warp_sum(all);
		}
		w /= sum;
	}
	if (lane < a.k) {
		topk_idx[(size_t)t * a.k + lane] = pick;
		topk_w[(size_t)t * a.k + lane] = w;
	}
}

template <int NCH>
static int router_select_launch(cudaStream_t st, const router_args &a, size_t smem, const float *logits,
				const float *bias, int32_t *topk_idx, float *topk_w)
{
	tier_launch(router_select_kernel<NCH>, (a.T + RT_WARPS - 1) / RT_WARPS, 32 * RT_WARPS, smem, st, a, logits,
			bias, topk_idx, topk_w);
	CUDA_LAUNCHED();
	return 0;
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
	int E = cfg->n_experts, sig = cfg->kind == TIER_MOE_ROUTER_SIGMOID_GROUP;
	router_args a = { (int)cfg->kind, E, cfg->top_k, cfg->norm_topk_prob, cfg->n_group,
			  cfg->n_group > 1 ? cfg->topk_group : 1, T,
			  cfg->routed_scaling_factor == 0.0f ? 1.0f : cfg->routed_scaling_factor };
	/* the group limit's scratch: 5 E bytes per warp, 20 KiB at E = 1024 (under the 48 KiB default) */
	size_t smem = sig && cfg->n_group > 1 ? (size_t)RT_WARPS * 5 * (size_t)E : 0;
	/* logits [T, E] fp32 = x [T, H] W_r^T, bf16 operands, fp32 accumulation */
	if ((rc = moe_cuda_mm(dev, 0, 1, T, E, H, 1.0f, x, H, w_r, H, 0.0f, logits, E, 0)))
		return rc;
	cudaStream_t st = moe_stream(dev);
	int nch = (E + 31) / 32;
	if (nch <= 1)
		return router_select_launch<1>(st, a, smem, logits, bias, topk_idx, topk_w);
	if (nch <= 2)
		return router_select_launch<2>(st, a, smem, logits, bias, topk_idx, topk_w);
	if (nch <= 4)
		return router_select_launch<4>(st, a, smem, logits, bias, topk_idx, topk_w);
	if (nch <= 8)
		return router_select_launch<8>(st, a, smem, logits, bias, topk_idx, topk_w);
	if (nch <= 16)
		return router_select_launch<16>(st, a, smem, logits, bias, topk_idx, topk_w);
	return router_select_launch<32>(st, a, smem, logits, bias, topk_idx, topk_w); /* E <= 1024 */
}

/* ---- permute ----
 * Pairs p = t k + j are cut into nseg segments of seg pairs (seg a multiple of 32), one warp each.
 *   1. count: each warp's histogram of its segment (shared-memory atomics), written as column
 *      `segment` of the matrix cnt [E][nseg];
 *   2. scan: one warp per expert turns its row of cnt into exclusive prefixes over the segments
 *      (the expert's pairs in earlier segments) and writes the total to counts[e];
 *   3. offsets: one block scans the kept counts min(counts, capacity) over the experts;
 *   4. place: each warp walks its segment again in token order, 32 pairs at a time; the lanes of a
 *      step that share an expert find each other with __match_any_sync and rank by lane, so a
 *      pair's row is offsets[e] + (e's pairs in earlier segments) + (earlier in this segment) +
 *      (lower lanes): exactly the CPU's stable placement. Rows at or past offsets[e + 1] are
 *      beyond the capacity: the pair is dropped (pair_row -1);
 *   5. scatter: one warp per token writes row_pair for its k pairs and copies its x row to each of
 *      them (the row is read once and written k times: 16-byte copies when H is a multiple of 8).
 * cnt lives in row_pair, which step 5 overwrites entirely: so nseg E <= T k is kept, and with one
 * segment (few pairs, many experts) step 1 counts straight into counts and step 2 is skipped.
 * Expert indices outside 0..E-1 (the CPU rejects them; the GPU cannot without a sync) are counted
 * nowhere and their pairs dropped. */
#define PM_WARPS 4       /* warps (segments) per block of steps 1 and 4 */
#define PM_SEG_MIN 256   /* pairs per segment at least (when the matrix fits) */
#define PM_MAX_SEGS 1024 /* step 2 holds a row of cnt in 32 registers per lane */
#define PM_BATCH 8       /* step 4 loads 8 steps of expert indices before working on them */
#define SC_WARPS 8       /* tokens per block of step 5 */

static void pm_plan(int n, int E, int *seg, int *nseg)
{
	long long want = (n + PM_SEG_MIN - 1) / PM_SEG_MIN, fit = n / E, ns = want < fit ? want : fit;
	if (ns > PM_MAX_SEGS)
		ns = PM_MAX_SEGS;
	if (ns < 1)
		ns = 1;
	long long sg = (n + ns - 1) / ns;
	sg = (sg + 31) / 32 * 32;
	*seg = (int)sg;
	*nseg = (int)((n + sg - 1) / sg); /* <= ns: the rounding up of seg only lowers it */
}

__global__ void __launch_bounds__(32 * PM_WARPS) pm_count_kernel(const int32_t *__restrict__ idx, int n, int E, int seg,
								  int nseg, int32_t *__restrict__ cnt)
{
	pdl_enter();
	__shared__ int32_t hist[PM_WARPS][TIER_MOE_MAX_EXPERTS];
	int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, s = blockIdx.x * PM_WARPS + wib;
	if (s >= nseg)
		return; /* no block barrier below: each warp owns hist[wib] */
	int32_t *h = hist[wib];
	for (int e = lane; e < E; e += 32)
		h[e] = 0;
	__syncwarp();
	int p1 = s * seg + seg < n ? s * seg + seg : n;
	for (int p = s * seg + lane; p < p1; p += 32) {
		int e = idx[p];
		if ((unsigned)e < (unsigned)E)
			atomicAdd(&h[e], 1);
	}
	__syncwarp();
	for (int e = lane; e < E; e += 32)
		cnt[(size_t)e * nseg + s] = h[e];
}

__global__ void __launch_bounds__(32 * PM_WARPS) pm_scan_kernel(int E, int nseg, int32_t *__restrict__ cnt,
								 int32_t *__restrict__ counts)
{
	pdl_enter();
	int lane = threadIdx.x & 31, e = blockIdx.x * PM_WARPS + (threadIdx.x >> 5);
	if (e >= E)
		return;
	int32_t *row = cnt + (size_t)e * nseg;
	int v[PM_MAX_SEGS / 32], carry = 0;
#pragma unroll
	for (int i = 0; i < PM_MAX_SEGS / 32; i++) /* all loads first: one round trip, not nseg / 32 */
		v[i] = 32 * i + lane < nseg ? row[32 * i + lane] : 0;
#pragma unroll
	for (int i = 0; i < PM_MAX_SEGS / 32; i++) {
		if (32 * i >= nseg)
			break; /* warp-uniform */
		int inc = v[i];
		for (int d = 1; d < 32; d <<= 1) {
			int o = __shfl_up_sync(FULL_MASK, inc, d);
			inc += lane >= d ? o : 0;
		}
		if (32 * i + lane < nseg)
			row[32 * i + lane] = carry + inc - v[i];
		carry += __shfl_sync(FULL_MASK, inc, 31);
	}
	if (lane == 0)
		counts[e] = carry;
}

/* offsets [E+1]: exclusive scan of the kept counts; one block of E rounded up to 32 threads. */
__global__ void pm_offsets_kernel(const int32_t *__restrict__ counts, int E, int cap, int32_t *__restrict__ offsets)
{
	pdl_enter();
	__shared__ int wsum[32];
	int e = threadIdx.x, lane = e & 31, warp = e >> 5, nw = blockDim.x >> 5;
	int c = e < E ? counts[e] : 0;
	c = cap > 0 && c > cap ? cap : c;
	int inc = c;
	for (int d = 1; d < 32; d <<= 1) {
		int o = __shfl_up_sync(FULL_MASK, inc, d);
		inc += lane >= d ? o : 0;
	}
	if (lane == 31)
		wsum[warp] = inc;
	__syncthreads();
	if (warp == 0) {
		int w = lane < nw ? wsum[lane] : 0, wi = w;
		for (int d = 1; d < 32; d <<= 1) {
			int o = __shfl_up_sync(FULL_MASK, wi, d);
			wi += lane >= d ? o : 0;
		}
		if (lane < nw)
			wsum[lane] = wi - w; /* the warps before */
	}
	__syncthreads();
	if (e < E)
		offsets[e + 1] = wsum[warp] + inc;
	if (e == 0)
		offsets[0] = 0;
}

__global__ void __launch_bounds__(32 * PM_WARPS) pm_place_kernel(const int32_t *__restrict__ idx, int n, int E, int seg,
								  int nseg, const int32_t *__restrict__ cnt,
								  const int32_t *__restrict__ offsets,
								  int32_t *__restrict__ pair_row)
{
	pdl_enter();
	__shared__ int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	__shared__ int32_t next[PM_WARPS][TIER_MOE_MAX_EXPERTS]; /* per warp: the row of e's next pair */
	int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, s = blockIdx.x * PM_WARPS + wib;
	for (int e = threadIdx.x; e <= E; e += blockDim.x)
		off[e] = offsets[e];
	__syncthreads(); /* the only block barrier: every thread reaches it */
	if (s >= nseg)
		return;
	int32_t *nx = next[wib];
	for (int e = lane; e < E; e += 32)
		nx[e] = off[e] + (nseg > 1 ? cnt[(size_t)e * nseg + s] : 0);
	__syncwarp();
	unsigned lower = (1u << lane) - 1u;
	int p0 = s * seg, p1 = p0 + seg < n ? p0 + seg : n;
	for (int base = p0; base < p1; base += 32 * PM_BATCH) { /* base and bounds are warp-uniform */
		int eb[PM_BATCH];
#pragma unroll
		for (int b = 0; b < PM_BATCH; b++) {
			int p = base + 32 * b + lane;
			eb[b] = p < p1 ? idx[p] : -1;
		}
#pragma unroll
		for (int b = 0; b < PM_BATCH; b++) {
			int p = base + 32 * b + lane, e = eb[b];
			int ok = (unsigned)e < (unsigned)E; /* implies p < p1 */
			unsigned peers = __match_any_sync(FULL_MASK, ok ? e : -1);
			int rank = __popc(peers & lower), row = ok ? nx[e] + rank : -1;
			__syncwarp(); /* every lane has read nx[e] before the group's first lane moves it */
			if (ok && rank == 0)
				nx[e] += __popc(peers);
			__syncwarp();
			if (p < p1)
				pair_row[p] = ok && row < off[e + 1] ? row : -1;
		}
	}
}

/* One warp per token: row_pair of its kept pairs (when row_pair is given), rows past the kept ones
 * set to -1, and with x its row copied to each kept row of xg in units of U: uint4 (16 bytes, H8 =
 * H / 8 units per row) or unsigned short (one bf16, H8 = H). pair_row entries outside 0..n-1 are
 * skipped, so that a wrong saved buffer cannot make the backward's gather write out of bounds. */
template <typename U>
__global__ void __launch_bounds__(32 * SC_WARPS) pm_scatter_kernel(int T, int k, int n, int H8,
								    const int32_t *__restrict__ pair_row,
								    const int32_t *__restrict__ n_rows,
								    int32_t *__restrict__ row_pair, const void *__restrict__ x,
								    void *__restrict__ xg)
{
	pdl_enter();
	int lane = threadIdx.x & 31, t = blockIdx.x * SC_WARPS + (threadIdx.x >> 5);
	if (row_pair) /* rows n_rows .. n-1: no pair (disjoint from the rows written below) */
		for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x + (size_t)*n_rows; i < (size_t)n;
		     i += (size_t)gridDim.x * blockDim.x)
			row_pair[i] = -1;
	if (t >= T)
		return;
	int r = lane < k ? pair_row[(size_t)t * k + lane] : -1;
	r = r >= 0 && r < n ? r : -1;
	if (row_pair && r >= 0)
		row_pair[r] = t * k + lane;
	if (!x)
		return;
	const U *src = (const U *)x + (size_t)t * H8;
	U *dst = (U *)xg;
	/* hb is warp-uniform (the whole warp runs each __shfl_sync); four loads in flight per lane, then
	 * k stores of each */
	for (int hb = 0; hb < H8; hb += 32 * 4) {
		U v[4];
#pragma unroll
		for (int u = 0; u < 4; u++)
			if (hb + 32 * u + lane < H8)
				v[u] = src[hb + 32 * u + lane];
		for (int j = 0; j < k; j++) {
			int rj = __shfl_sync(FULL_MASK, r, j); /* the same for all lanes: no divergence below */
			if (rj < 0)
				continue;
#pragma unroll
			for (int u = 0; u < 4; u++)
				if (hb + 32 * u + lane < H8)
					dst[(size_t)rj * H8 + hb + 32 * u + lane] = v[u];
		}
	}
}

/* Step 5 on the stream: row_pair may be NULL (the backward's gather), x NULL (no gather; then
 * row_pair must be given). n_rows: device pointer to offsets[E]. */
static int launch_scatter(cudaStream_t st, int T, int k, int H, const int32_t *pair_row, const int32_t *n_rows,
			  int32_t *row_pair, const void *x, void *xg)
{
	int blocks = (T + SC_WARPS - 1) / SC_WARPS, vec = x && H % 8 == 0 && (uintptr_t)x % 16 == 0 &&
							       (uintptr_t)xg % 16 == 0;
	if (vec)
		tier_launch(pm_scatter_kernel<uint4>, blocks, 32 * SC_WARPS, 0, st, T, k, T * k, H / 8, pair_row,
				n_rows, row_pair, x, xg);
	else
		tier_launch(pm_scatter_kernel<unsigned short>, blocks, 32 * SC_WARPS, 0, st, T, k, T * k, H, pair_row,
				n_rows, row_pair, x, xg);
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
	cudaStream_t st = moe_stream(dev);
	int n = T * k, seg, nseg;
	pm_plan(n, E, &seg, &nseg);
	int32_t *cnt = nseg > 1 ? row_pair : counts; /* [E][nseg] (scanned); with one segment: the counts */
	int sblocks = (nseg + PM_WARPS - 1) / PM_WARPS;
	if ((rc = moe_cuda_expert_counts(dev, T, k, E, topk_idx, counts, row_pair)))
		return rc;
	tier_launch(pm_offsets_kernel, 1, (E + 31) / 32 * 32, 0, st, counts, E, capacity, offsets);
	CUDA_LAUNCHED();
	tier_launch(pm_place_kernel, sblocks, 32 * PM_WARPS, 0, st, topk_idx, n, E, seg, nseg, cnt, offsets, pair_row);
	CUDA_LAUNCHED();
	return launch_scatter(st, T, k, H, pair_row, offsets + E, row_pair, x, xg);
}

extern "C" int moe_cuda_expert_counts(tier_dev *dev, int T, int k, int E, const int32_t *topk_idx, int32_t *counts,
				      int32_t *scratch)
{
	const char *fn = "moe_cuda_expert_counts";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)))
		return rc;
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(counts, fn);
	MOE_NONNULL(scratch, fn);
	cudaStream_t st = moe_stream(dev);
	int n = T * k, seg, nseg;
	pm_plan(n, E, &seg, &nseg);
	int32_t *cnt = nseg > 1 ? scratch : counts;
	tier_launch(pm_count_kernel, (nseg + PM_WARPS - 1) / PM_WARPS, 32 * PM_WARPS, 0, st, topk_idx, n, E, seg, nseg,
			cnt);
	CUDA_LAUNCHED();
	if (nseg > 1) {
		tier_launch(pm_scan_kernel, (E + PM_WARPS - 1) / PM_WARPS, 32 * PM_WARPS, 0, st, E, nseg, cnt, counts);
		CUDA_LAUNCHED();
	}
	return 0;
}

/* ---- combine ---- */
/* res (NULL: none) is a residual added to the sum: out = the weighted rows + res (a decoder's
 * h1 + MoE(h1) without a pass of its own over three [T, H] fp32 arrays, and its bits: the sum
 * first, then res); out may be res. */
__global__ void combine_kernel(int k, int H, const int32_t *pair_row, const float *w, const __nv_bfloat16 *y,
			       const float *res, float *out)
{
	pdl_enter();
	int t = blockIdx.x;
	for (int h = threadIdx.x; h < H; h += blockDim.x) {
		float acc = 0.0f;
		for (int j = 0; j < k; j++) {
			int r = pair_row[t * k + j];
			if (r >= 0)
				acc += w[t * k + j] * __bfloat162float(y[(size_t)r * H + h]);
		}
		out[(size_t)t * H + h] = res ? acc + res[(size_t)t * H + h] : acc;
	}
}

/* Eight columns per thread: one 16-byte load per row, two float4 stores (H a multiple of 8, aligned
 * bases). The same order of the k terms as combine_kernel and the CPU. */
__global__ void combine8_kernel(int k, int H8, const int32_t *pair_row, const float *w, const uint4 *y,
				const float4 *res, float4 *out)
{
	pdl_enter();
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
		if (res) {
			const float4 *rr = res + (size_t)t * H8 * 2 + 2 * (size_t)h;
			float4 r0 = rr[0], r1 = rr[1];
			acc[0] += r0.x, acc[1] += r0.y, acc[2] += r0.z, acc[3] += r0.w;
			acc[4] += r1.x, acc[5] += r1.y, acc[6] += r1.z, acc[7] += r1.w;
		}
		float4 *o = out + (size_t)t * H8 * 2 + 2 * (size_t)h;
		o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
		o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
	}
}

extern "C" int moe_cuda_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
				    const void *y, float *out)
{
	return moe_cuda_combine_fwd_res(dev, T, k, H, pair_row, topk_w, y, NULL, out);
}

extern "C" int moe_cuda_combine_fwd_res(tier_dev *dev, int T, int k, int H, const int32_t *pair_row,
					const float *topk_w, const void *y, const float *res, float *out)
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
	if (H % 8 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)res % 16 == 0)
		tier_launch(combine8_kernel, T, 128, 0, st, k, H / 8, pair_row, topk_w, (const uint4 *)y,
				(const float4 *)res, (float4 *)out);
	else
		tier_launch(combine_kernel, T, 256, 0, st, k, H, pair_row, topk_w, (const bf16 *)y, res, out);
	CUDA_LAUNCHED();
	return 0;
}

extern "C" int moe_cuda_gather(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const void *x, void *xg)
{
	const char *fn = "moe_cuda_gather";
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(x, fn);
	MOE_NONNULL(xg, fn);
	return launch_scatter(moe_stream(dev), T, k, H, pair_row, NULL, NULL, x, xg);
}
