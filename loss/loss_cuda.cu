/* loss_cuda.cu - the chunked loss on CUDA: cuBLASLt tile products (opsc_gemm; bf16 in, fp32 out) into the
 * caller's workspace, fused kernels for the online log-sum-exp and for softmax minus one-hot.
 *
 * Per chunk of tokens and block of vocabulary: logits = H_c W_b^T (one GEMM), a row-statistics
 * kernel folds the tile into each token's running (max, sum, sum of logits, label logit); after the
 * last block a finalise kernel writes lse and adds the chunk's loss. The gradient kernel turns a
 * logits tile into bf16 dlogits in place, and two GEMMs accumulate dH (and dW). With a whole-vocabulary
 * block the fused entry reuses the forward's tile: two products (three with dW) in all. */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <library_types.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include "loss/loss_impl.h"
#include "core/ops_cuda.h"
#include "base/pdl.cuh"

#define THREADS 512

typedef struct {
	double loss_sum;
	unsigned long long count;
	float scale;
} scalars;

typedef struct {
	float softcap, z_loss, eps, inv_v;
	int32_t ignore, V;
} opts;

__device__ static inline int counted(int32_t y, const opts &o)
{
	return y != o.ignore && y >= 0 && y < o.V;
}

__device__ static inline float capped(float x, const opts &o)
{
	return o.softcap > 0 ? o.softcap * tanhf(x / o.softcap) : x;
}

/* (m, s) <- the log-sum-exp state of both halves. */
__device__ static inline void merge(float &m, float &s, float m2, float s2)
{
	float mm = fmaxf(m, m2);
	if (mm == -INFINITY)
		return;                          /* both empty: stays (-inf, 0) */
	s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
	m = mm;
}

/* Count the tokens with a target and set the gradient scale; zero the loss sum. One block. */
__global__ void prep_kernel(const int32_t *labels, int64_t N, opts o, int mean, float dloss, scalars *sc)
{
	pdl_enter();
	__shared__ unsigned long long part[32];
	unsigned long long n = 0;
	for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
		n += counted(labels[i], o);
	for (int d = 16; d; d >>= 1)
		n += __shfl_xor_sync(0xffffffffu, n, d);
	if ((threadIdx.x & 31) == 0)
		part[threadIdx.x >> 5] = n;
	__syncthreads();
	if (threadIdx.x == 0) {
		unsigned long long t = 0;
		for (int w = 0; w < (int)(blockDim.x >> 5); w++)
			t += part[w];
		sc->count = t;
		sc->loss_sum = 0;
		sc->scale = t == 0 ? 0.0f : mean ? dloss / (float)t : dloss;
	}
}

/* One block per token of the chunk: fold logits L[row, 0..b) (vocabulary v0..v0+b) into st[row]. */
__global__ void __launch_bounds__(THREADS) stats_kernel(const float *L, int b, int v0, const int32_t *labels,
							 float4 *st, int first, opts o)
{
	pdl_enter();
	__shared__ float sm[THREADS / 32], ss[THREADS / 32], sz[THREADS / 32];
	const float *row = L + (size_t)blockIdx.x * b;
	float m = -INFINITY, s = 0, zs = 0;
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	for (int j = threadIdx.x; j < b; j += THREADS) {
		float z = capped(row[j], o);
		if (z > m) {
			s = s * __expf(m - z) + 1.0f;
			m = z;
		} else {
			s += __expf(z - m);
		}
		zs += z;
	}
	for (int d = 16; d; d >>= 1) {
		merge(m, s, __shfl_xor_sync(0xffffffffu, m, d), __shfl_xor_sync(0xffffffffu, s, d));
		zs += __shfl_xor_sync(0xffffffffu, zs, d);
	}
	if (lane == 0)
		sm[warp] = m, ss[warp] = s, sz[warp] = zs;
	__syncthreads();
	if (threadIdx.x == 0) {
		float4 r = first ? make_float4(-INFINITY, 0.0f, 0.0f, 0.0f) : st[blockIdx.x];
		int32_t y = labels[blockIdx.x];
		for (int w = 0; w < THREADS / 32; w++) {
			merge(r.x, r.y, sm[w], ss[w]);
			r.z += sz[w];
		}
		if (counted(y, o) && y >= v0 && y < v0 + b)
			r.w = capped(row[y - v0], o);
		st[blockIdx.x] = r;
	}
}

/* One thread per token of the chunk: lse from the state, and the chunk's loss into the sum. */
__global__ void finalize_kernel(const float4 *st, int c, const int32_t *labels, float *lse, opts o, scalars *sc)
{
	pdl_enter();
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	double l = 0;
	if (i < c) {
		float4 r = st[i];
		float e = r.x + logf(r.y);
		lse[i] = e;
		if (counted(labels[i], o))
			l = (double)e - (1.0 - o.eps) * r.w - (double)o.eps * o.inv_v * r.z + (double)o.z_loss * e * e;
	}
	for (int d = 16; d; d >>= 1)
		l += __shfl_xor_sync(0xffffffffu, l, d);
	if ((threadIdx.x & 31) == 0 && l != 0)
		atomicAdd(&sc->loss_sum, l);
}

__global__ void result_kernel(const scalars *sc, int mean, float *loss, int64_t *count)
{
	pdl_enter();
	unsigned long long n = sc->count;
	*count = (int64_t)n;
	*loss = n == 0 ? 0.0f : (float)(mean ? sc->loss_sum / (double)n : sc->loss_sum);
}

/* One block per token: dlogits = scale * (p (1 + 2 zl lse) - (1 - eps) onehot - eps / V) * cap',
 * written as bf16 over the front half of the token's own fp32 logits row (ld 2b in bf16 units), so
 * that the tile needs no second buffer. Each pass reads a span of the row, syncs, then writes the
 * bf16 values: they land on fp32 elements at half the span's index, which every thread has read. */
#define GRAD_PER_THREAD 4
__global__ void __launch_bounds__(THREADS) grad_kernel(float *L, int b, int v0, const int32_t *labels,
							const float *lse, const scalars *sc, opts o)
{
	pdl_enter();
	float *row = L + (size_t)blockIdx.x * b;
	__nv_bfloat16 *out = (__nv_bfloat16 *)row;
	int32_t y = labels[blockIdx.x];
	float e = lse[blockIdx.x], scale = sc->scale, grow = 1.0f + 2.0f * o.z_loss * e;
	float off = o.eps * o.inv_v, hit = 1.0f - o.eps;
	if (!counted(y, o)) {
		for (int j = threadIdx.x; j < b; j += THREADS)
			out[j] = __float2bfloat16(0.0f);
		return;
	}
	for (int base = 0; base < b; base += THREADS * GRAD_PER_THREAD) {
		float g[GRAD_PER_THREAD];
#pragma unroll
		for (int k = 0; k < GRAD_PER_THREAD; k++) {
			int j = base + k * THREADS + threadIdx.x;
			if (j < b) {
				float z = capped(row[j], o);
				g[k] = __expf(z - e) * grow - off - (v0 + j == y ? hit : 0.0f);
				if (o.softcap > 0) {
					float t = z / o.softcap;
					g[k] *= 1.0f - t * t;
				}
			}
		}
		__syncthreads();
#pragma unroll
		for (int k = 0; k < GRAD_PER_THREAD; k++) {
			int j = base + k * THREADS + threadIdx.x;
			if (j < b)
				out[j] = __float2bfloat16(g[k] * scale);
		}
	}
}

static int cuda_check(const char *what)
{
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return tier_fail(-EIO, "loss: %s failed: %s", what, cudaGetErrorString(e));
	return 0;
}

typedef struct {
	tier_dev *dev;
	const tier_loss_params *p;
	const loss_args *a;
	cudaStream_t s;
	float *L;
	float4 *st;
	scalars *sc;
	opts o;
} ctx;

/* L[c x b] (row-major) = H[r0 .. r0 + c) W[v0 .. v0 + b)^T: column-major L^T = W_b H_c^T. */
static int tile_logits(const ctx *x, int64_t r0, int c, int64_t v0, int b)
{
	const __nv_bfloat16 *H = (const __nv_bfloat16 *)x->a->H, *W = (const __nv_bfloat16 *)x->a->W;
	int D = (int)x->p->D;
	opsc_operand A = { 1, W + v0 * D, CUDA_R_16BF, D }, B = { 0, H + r0 * D, CUDA_R_16BF, D };
	return opsc_gemm(x->dev, b, c, D, 1.0f, A, B, 0.0f, x->L, b);
}

/* dH_c += G W_b (column-major dH^T = W_b^T G^T); dW_b (+)= G^T H_c (column-major dW^T = H_c^T G). */
static int tile_grads(const ctx *x, int64_t r0, int c, int64_t v0, int b)
{
	const __nv_bfloat16 *H = (const __nv_bfloat16 *)x->a->H, *W = (const __nv_bfloat16 *)x->a->W;
	int D = (int)x->p->D, rc;
	const __nv_bfloat16 *G = (const __nv_bfloat16 *)x->L;  /* dlogits over the logits, ld 2b */
	opsc_operand Wn = { 0, W + v0 * D, CUDA_R_16BF, D }, Gn = { 0, G, CUDA_R_16BF, 2 * b };
	opsc_operand Hn = { 0, H + r0 * D, CUDA_R_16BF, D }, Gt = { 1, G, CUDA_R_16BF, 2 * b };
	tier_launch(grad_kernel, c, THREADS, 0, x->s, x->L, b, (int)v0, x->a->labels + r0, x->a->lse + r0, x->sc, x->o);
	if ((rc = cuda_check("gradient kernel")))
		return rc;
	if ((rc = opsc_gemm(x->dev, D, c, b, 1.0f, Wn, Gn, v0 == 0 ? 0.0f : 1.0f, x->a->dH + r0 * D, D)))
		return rc;
	if (x->a->dW)
		rc = opsc_gemm(x->dev, D, b, c, 1.0f, Hn, Gt, r0 == 0 ? 0.0f : 1.0f, x->a->dW + v0 * D, D);
	return rc;
}

/* The forward over one chunk: every block's tile folded into the row states, then lse and loss. */
static int chunk_fwd(const ctx *x, int64_t r0, int c)
{
	int64_t V = x->p->V, B = x->p->block_vocab;
	int rc;
	for (int64_t v0 = 0; v0 < V; v0 += B) {
		int b = (int)(V - v0 < B ? V - v0 : B);
		if ((rc = tile_logits(x, r0, c, v0, b)))
			return rc;
		tier_launch(stats_kernel, c, THREADS, 0, x->s, x->L, b, (int)v0, x->a->labels + r0, x->st, v0 == 0,
				x->o);
		if ((rc = cuda_check("statistics kernel")))
			return rc;
	}
	tier_launch(finalize_kernel, (c + 255) / 256, 256, 0, x->s, x->st, c, x->a->labels + r0, x->a->lse + r0, x->o,
			x->sc);
	return cuda_check("finalise kernel");
}

static int chunk_bwd(const ctx *x, int64_t r0, int c, int tile_ready)
{
	int64_t V = x->p->V, B = x->p->block_vocab;
	int rc;
	for (int64_t v0 = 0; v0 < V; v0 += B) {
		int b = (int)(V - v0 < B ? V - v0 : B);
		if (!tile_ready && (rc = tile_logits(x, r0, c, v0, b)))
			return rc;
		if ((rc = tile_grads(x, r0, c, v0, b)))
			return rc;
	}
	return 0;
}

extern "C" int loss_cuda_run(tier_dev *dev, const tier_loss_params *p, const loss_args *a)
{
	loss_layout l;
	ctx x;
	int rc = loss_layout_of(p, TIER_DEV_CUDA, &l);
	int mean = p->reduction == TIER_LOSS_MEAN;
	if (rc)
		return rc;
	if (p->V >= (1ll << 30))
		return tier_fail(-EINVAL, "loss: on CUDA the vocabulary V=%lld must be below 2^30", (long long)p->V);
	if (p->D % 8)
		return tier_fail(-EINVAL, "loss: on CUDA the hidden size D=%lld must be a multiple of 8 (16-byte rows for "
				 "the tensor cores)", (long long)p->D);
	x.dev = dev, x.p = p, x.a = a;
	x.s = (cudaStream_t)tier_dev_stream(dev);
	x.L = (float *)((char *)a->ws + l.logits);
	x.st = (float4 *)((char *)a->ws + l.state);
	x.sc = (scalars *)((char *)a->ws + l.scalars);
	x.o.softcap = p->softcap, x.o.z_loss = p->z_loss, x.o.eps = p->label_smoothing;
	x.o.inv_v = 1.0f / (float)p->V, x.o.ignore = p->ignore_index, x.o.V = (int32_t)p->V;
	tier_launch(prep_kernel, 1, 1024, 0, x.s, a->labels, p->N, x.o, mean, a->dloss, x.sc);
	if ((rc = cuda_check("count kernel")))
		return rc;
	for (int64_t r0 = 0; r0 < p->N; r0 += p->chunk_tokens) {
		int c = (int)(p->N - r0 < p->chunk_tokens ? p->N - r0 : p->chunk_tokens);
		if ((a->mode & LOSS_FWD) && (rc = chunk_fwd(&x, r0, c)))
			return rc;
		if ((a->mode & LOSS_BWD) && (rc = chunk_bwd(&x, r0, c, (a->mode & LOSS_FWD) && p->block_vocab >= p->V)))
			return rc;
	}
	if (a->mode & LOSS_FWD) {
		tier_launch(result_kernel, 1, 1, 0, x.s, x.sc, mean, a->loss, a->count);
		return cuda_check("result kernel");
	}
	return 0;
}
