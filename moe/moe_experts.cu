/* moe_experts.cu - the SwiGLU experts on CUDA with LoRA, forward and backward: one cuBLASLt product
 * per expert and projection (bf16 in, fp32 accumulate), the SwiGLU epilogue and its backward as
 * elementwise kernels over all rows at once. The per-expert loop needs the offsets on the host
 * (the layer reads them with one synchronisation). LoRA as (X A^T) B^T through a [rows, r] bf16
 * intermediate, never forming B A. */
#include <cublasLt.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"

/* ---- the products: cuBLASLt with a cache of the chosen algorithms ----
 * The heuristic query costs tens of microseconds, more than a small expert's product, and the
 * per-expert loop makes hundreds of products per layer; so the chosen algorithm is kept per shape,
 * with the row count (the dimension that varies between experts and steps) rounded up to a power
 * of two. A cached algorithm that cuBLASLt refuses for the exact shape is replaced by a fresh query. */
typedef struct {
	int dev, ta, tb, M, N, K, lda, ldb, ldc, c_bf16;
	uint32_t ala, alb, alc, ws_mib; /* a lane's workspace is smaller than the compute stream's */
} mm_key;
typedef struct {
	mm_key key;
	cublasLtMatmulAlgo_t algo;
	int used;
} mm_entry;
#define MM_CACHE 2048
static mm_entry mm_cache[MM_CACHE];
static pthread_mutex_t mm_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t mm_slot(const mm_key *k)
{
	const unsigned char *b = (const unsigned char *)k;
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < sizeof *k; i++)
		h = (h ^ b[i]) * 1099511628211ull;
	return (size_t)(h % MM_CACHE);
}
static int mm_get(const mm_key *k, cublasLtMatmulAlgo_t *a)
{
	size_t s = mm_slot(k);
	int hit;
	pthread_mutex_lock(&mm_lock);
	hit = mm_cache[s].used && !memcmp(&mm_cache[s].key, k, sizeof *k);
	if (hit)
		*a = mm_cache[s].algo;
	pthread_mutex_unlock(&mm_lock);
	return hit;
}
static void mm_put(const mm_key *k, const cublasLtMatmulAlgo_t *a)
{
	size_t s = mm_slot(k);
	pthread_mutex_lock(&mm_lock);
	mm_cache[s].key = *k, mm_cache[s].algo = *a, mm_cache[s].used = 1;
	pthread_mutex_unlock(&mm_lock);
}

/* The largest power of two (<= 256) dividing the address: what cuBLASLt may assume. */
static uint32_t align_of(const void *p)
{
	uintptr_t a = (uintptr_t)p;
	uint32_t al = 256;
	while (al > 2 && (a & (al - 1)))
		al >>= 1;
	return al;
}

static int pow2_at_least(int v)
{
	int p = 1;
	while (p < v && p < (1 << 30))
		p <<= 1;
	return p;
}

/* Layouts of the row-major product C [M, N] = op(A) op(B) seen column-major: C^T = op(B)^T op(A)^T,
 * so cuBLASLt's "A" is our B and its "B" our A (rows, cols, ld of each stored matrix). */
typedef struct {
	cublasLtMatrixLayout_t la, lb, lc;
} mm_layouts;

static cublasStatus_t mm_layouts_make(mm_layouts *l, int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc,
				      cudaDataType_t ct)
{
	cublasStatus_t st;
	l->la = l->lb = l->lc = NULL;
	st = cublasLtMatrixLayoutCreate(&l->la, CUDA_R_16BF, tb ? K : N, tb ? N : K, ldb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&l->lb, CUDA_R_16BF, ta ? M : K, ta ? K : M, lda);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&l->lc, ct, N, M, ldc);
	return st;
}
static void mm_layouts_free(mm_layouts *l)
{
	if (l->lc)
		cublasLtMatrixLayoutDestroy(l->lc);
	if (l->lb)
		cublasLtMatrixLayoutDestroy(l->lb);
	if (l->la)
		cublasLtMatrixLayoutDestroy(l->la);
}

/* One heuristic query: the best algorithm for the given layouts, or an error status. */
static cublasStatus_t mm_query(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const mm_layouts *l, size_t wsb,
			       const mm_key *k, cublasLtMatmulAlgo_t *algo)
{
	cublasLtMatmulPreference_t pref = NULL;
	cublasLtMatmulHeuristicResult_t heur;
	int found = 0;
	cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k->ala, sizeof k->ala);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k->alb, sizeof k->alb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k->alc, sizeof k->alc);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k->alc, sizeof k->alc);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulAlgoGetHeuristic(h, desc, l->la, l->lb, l->lc, l->lc, pref, 1, &heur, &found);
	if (st == CUBLAS_STATUS_SUCCESS && found == 0)
		st = CUBLAS_STATUS_NOT_SUPPORTED;
	if (st == CUBLAS_STATUS_SUCCESS)
		*algo = heur.algo;
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	return st;
}

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
	cublasLtHandle_t h = (cublasLtHandle_t)tier_dev_blaslt(dev);
	size_t wsb = 0;
	void *ws = NULL;
	cudaStream_t stream = (cudaStream_t)tier_dev_lane_stream(dev, lane, &ws, &wsb);
	if (!h)
		return tier_fail(-EIO, "moe_cuda_mm: the device context has no cuBLASLt handle");
	cublasLtMatmulDesc_t desc = NULL;
	cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
	cudaDataType_t ct = c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
	/* the varying row count: M where it is a column count of the layouts (ta 0), else K (ta 1, tb 0) */
	int qM = !ta ? pow2_at_least(M) : M, qK = ta && !tb ? pow2_at_least(K) : K;
	mm_key key;
	memset(&key, 0, sizeof key);
	key.dev = tier_dev_ordinal(dev), key.ta = ta, key.tb = tb, key.M = qM, key.N = N, key.K = qK;
	key.lda = lda, key.ldb = ldb, key.ldc = ldc, key.c_bf16 = c_bf16;
	key.ala = align_of(B), key.alb = align_of(A), key.alc = align_of(C);
	key.ws_mib = (uint32_t)(wsb >> 20);
	mm_layouts real = { NULL, NULL, NULL }, q = { NULL, NULL, NULL };
	cublasLtMatmulAlgo_t algo;
	cublasStatus_t st = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = mm_layouts_make(&real, ta, tb, M, N, K, lda, ldb, ldc, ct);
	int done = 0;
	if (st == CUBLAS_STATUS_SUCCESS && mm_get(&key, &algo))
		done = cublasLtMatmul(h, desc, &alpha, B, real.la, A, real.lb, &beta, C, real.lc, C, real.lc, &algo, ws, wsb,
				      stream) == CUBLAS_STATUS_SUCCESS;
	if (st == CUBLAS_STATUS_SUCCESS && !done && (qM != M || qK != K)) { /* the algorithm of the bucket */
		st = mm_layouts_make(&q, ta, tb, qM, N, qK, lda, ldb, ldc, ct);
		if (st == CUBLAS_STATUS_SUCCESS && mm_query(h, desc, &q, wsb, &key, &algo) == CUBLAS_STATUS_SUCCESS)
			done = cublasLtMatmul(h, desc, &alpha, B, real.la, A, real.lb, &beta, C, real.lc, C, real.lc, &algo, ws,
					      wsb, stream) == CUBLAS_STATUS_SUCCESS;
	}
	if (st == CUBLAS_STATUS_SUCCESS && !done) { /* the exact shape */
		st = mm_query(h, desc, &real, wsb, &key, &algo);
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmul(h, desc, &alpha, B, real.la, A, real.lb, &beta, C, real.lc, C, real.lc, &algo, ws, wsb,
					    stream);
		done = st == CUBLAS_STATUS_SUCCESS;
	}
	if (done)
		mm_put(&key, &algo);
	mm_layouts_free(&q);
	mm_layouts_free(&real);
	if (desc)
		cublasLtMatmulDescDestroy(desc);
	if (!done)
		return tier_fail(-EIO, "moe_cuda_mm: cuBLASLt product %dx%dx%d (ta %d, tb %d) failed: %s", M, N, K, ta, tb,
				 cublasLtGetStatusString(st == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : st));
	return 0;
}

/* ---- elementwise SwiGLU ---- */
static int grid_of(size_t n)
{
	size_t b = (n + 255) / 256;
	return (int)(b < 8192 ? (b ? b : 1) : 8192);
}

__global__ void swiglu_kernel(const float *g, const float *u, size_t n, bf16 *h)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
		float x = g[i];
		h[i] = __float2bfloat16(x / (1.0f + expf(-x)) * u[i]);
	}
}

/* dU = dh silu(g), dG = dh u silu'(g), silu'(g) = s (1 + g (1 - s)). */
__global__ void swiglu_bwd_kernel(const float *g, const float *u, const float *dh, size_t n, bf16 *dg, bf16 *du)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
		float x = g[i], s = 1.0f / (1.0f + expf(-x)), d = dh[i];
		du[i] = __float2bfloat16(d * x * s);
		dg[i] = __float2bfloat16(d * u[i] * s * (1.0f + x * (1.0f - s)));
	}
}

extern "C" int moe_cuda_swiglu(tier_dev *dev, size_t n, const float *g, const float *u, void *h)
{
	if (n) {
		swiglu_kernel<<<grid_of(n), 256, 0, moe_stream(dev)>>>(g, u, n, (bf16 *)h);
		CUDA_LAUNCHED();
	}
	return 0;
}

extern "C" int moe_cuda_swiglu_bwd(tier_dev *dev, size_t n, const float *g, const float *u, const float *dh, void *dg,
				   void *du)
{
	if (n) {
		swiglu_bwd_kernel<<<grid_of(n), 256, 0, moe_stream(dev)>>>(g, u, dh, n, (bf16 *)dg, (bf16 *)du);
		CUDA_LAUNCHED();
	}
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

static int lora_on(const tier_moe_lora *l) { return l && l->a && l->b; }

static const tier_moe_lora *lora_of(const tier_moe_loras *lo, int which)
{
	return !lo ? NULL : which == 0 ? &lo->gate : which == 1 ? &lo->up : &lo->down;
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
		const tier_moe_lora *l = lora_of(lora, q);
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

/* Y [n, out] += s (X A^T) B^T through Z [n, r] bf16; Y fp32 or bf16. */
static int lora_fwd(tier_dev *dev, int ln, const tier_moe_lora *l, int e, int n, int in, int out, const bf16 *X,
		    void *Y, int y_bf16, bf16 *Z)
{
	if (!lora_on(l))
		return 0;
	int r = l->rank, rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, r, in, 1.0f, X, in, l->a[e], in, 0.0f, Z, r, 1);
	return rc ? rc : moe_cuda_mm_lane(dev, ln, 0, 1, n, out, r, l->scale, Z, r, l->b[e], r, 1.0f, Y, out, y_bf16);
}

/* From dY [n, out] bf16: dZ = s dY B; dB += s dY^T (X A^T); dA += dZ^T X; dX [n, in] fp32 += dZ A. */
static int lora_bwd(tier_dev *dev, int ln, const tier_moe_lora *l, int e, int n, int in, int out, const bf16 *X,
		    const bf16 *dY, float *dX, bf16 *Z, bf16 *dZ)
{
	if (!lora_on(l))
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

/* g, u [rows, I] fp32 = X gate^T, X up^T (+ LoRA), expert by expert over nl lanes. */
static int experts_fwd_gate_up(tier_dev *dev, int nl, int E, int H, int I, const int32_t *off,
			       const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, float *g, float *u,
			       void *z)
{
	int rc = 0, i = 0, zr = moe_lora_max_rank(lora);
	for (int e = 0; e < E && !rc; e++) {
		int o = off[e], n = off[e + 1] - o, ln = lane_of(nl, i);
		if (n == 0)
			continue;
		i++;
		ex_w ew = ex_of(w, e, I, H);
		const bf16 *X = (const bf16 *)xg + (size_t)o * H;
		float *G = g + (size_t)o * I, *U = u + (size_t)o * I;
		bf16 *Z = zr ? (bf16 *)z + (size_t)o * zr : NULL;
		if (!(rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, I, H, 1.0f, X, H, ew.gate, H, 0.0f, G, I, 0)) &&
		    !(rc = moe_cuda_mm_lane(dev, ln, 0, 1, n, I, H, 1.0f, X, H, ew.up, H, 0.0f, U, I, 0)) &&
		    !(rc = lora_fwd(dev, ln, lora_of(lora, 0), e, n, H, I, X, G, 0, Z)))
			rc = lora_fwd(dev, ln, lora_of(lora, 1), e, n, H, I, X, U, 0, Z);
	}
	return rc;
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
			rc = lora_fwd(dev, ln, lora_of(lora, 2), e, n, I, H, Hh, Y, 1, Z);
	}
	return rc;
}

extern "C" int moe_cuda_experts_fwd_lora(tier_dev *dev, int E, int H, int I, const int32_t *off,
					 const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora,
					 const void *xg, float *g, float *u, void *h, void *y, void *z)
{
	const char *fn = "moe_cuda_experts_fwd";
	int rc = experts_args(fn, dev, E, H, I, off, w, lora, z);
	if (rc)
		return rc;
	MOE_NONNULL(xg, fn);
	MOE_NONNULL(g, fn);
	MOE_NONNULL(u, fn);
	MOE_NONNULL(h, fn);
	MOE_NONNULL(y, fn);
	const void *io[] = { xg, g, u, h, y, z };
	if (d_off && moe_cuda_experts_grouped_fits(E, H, I, off, w, lora, io, 6))
		return moe_cuda_experts_fwd_grouped(dev, E, H, I, off, d_off, w, lora, xg, g, u, h, y, z);
	size_t total = (size_t)off[E] * I;
	int nl = lanes_wanted(off, E);
	if (total == 0)
		return 0;
	if ((rc = lanes_fork(dev, &nl)) || (rc = lanes_join(dev, nl, experts_fwd_gate_up(dev, nl, E, H, I, off, w, lora, xg,
											  g, u, z))))
		return rc;
	swiglu_kernel<<<grid_of(total), 256, 0, moe_stream(dev)>>>(g, u, total, (bf16 *)h);
	CUDA_LAUNCHED();
	if ((rc = lanes_fork(dev, &nl)))
		return rc;
	return lanes_join(dev, nl, experts_fwd_down(dev, nl, E, H, I, off, w, lora, h, y, z));
}

extern "C" int moe_cuda_experts_fwd(tier_dev *dev, int E, int H, int I, const int32_t *offsets_host,
				    const void *const *gate, const void *const *up, const void *const *down,
				    const void *xg, float *g, float *u, void *h, void *y)
{
	tier_moe_experts w = { (const float *const *)gate, (const float *const *)up, NULL, (const float *const *)down,
			       TIER_MOE_GATE_FIRST };
	if (!gate || !up || !down)
		return tier_fail(-EINVAL, "moe_cuda_experts_fwd: gate, up and down pointer arrays are required");
	return moe_cuda_experts_fwd_lora(dev, E, H, I, offsets_host, NULL, &w, NULL, xg, g, u, h, y, NULL);
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
			rc = lora_bwd(dev, ln, lora_of(lora, 2), e, n, I, H, hb + (size_t)o * I, dY, dH, Z + zo, dZ + zo);
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
		    !(rc = lora_bwd(dev, ln, lora_of(lora, 0), e, n, H, I, X, dG, dX, Z + zo, dZ + zo)))
			rc = lora_bwd(dev, ln, lora_of(lora, 1), e, n, H, I, X, dU, dX, Z + zo, dZ + zo);
	}
	return rc;
}

extern "C" int moe_cuda_experts_bwd(tier_dev *dev, int E, int H, int I, const int32_t *off,
				    const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, const float *g,
				    const float *u, const void *dy, float *dxg, void *h, void *dg, void *du, float *dh,
				    void *z, void *dz)
{
	const char *fn = "moe_cuda_experts_bwd";
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
	cudaStream_t st = moe_stream(dev);
	if (total == 0)
		return 0;
	const void *io[] = { xg, g, u, dy, dxg, h, dg, du, dh, z, dz };
	if (d_off && moe_cuda_experts_grouped_fits(E, H, I, off, w, lora, io, 11))
		return moe_cuda_experts_bwd_grouped(dev, E, H, I, off, d_off, w, lora, xg, g, u, dy, dxg, h, dg, du, dh, z,
						    dz);
	if (lora_on(lora_of(lora, 2))) { /* h is the input of the down adapter: recompute it */
		swiglu_kernel<<<grid_of(total), 256, 0, st>>>(g, u, total, hb);
		CUDA_LAUNCHED();
	}
	int nl = lanes_wanted(off, E);
	if ((rc = lanes_fork(dev, &nl)) ||
	    (rc = lanes_join(dev, nl, experts_bwd_down(dev, nl, E, H, I, off, w, lora, hb, dyb, dh, Z, dZ))))
		return rc;
	swiglu_bwd_kernel<<<grid_of(total), 256, 0, st>>>(g, u, dh, total, dgb, dub);
	CUDA_LAUNCHED();
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
					 const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, float *g,
					 float *u, void *y, void *ws)
{
	const char *fn = "tier_moe_experts_fwd";
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int rc = offsets_to_host(dev, fn, E, offsets, off);
	if (rc)
		return rc;
	MOE_NONNULL(ws, fn);
	size_t rows = off[E] > 0 ? (size_t)off[E] : 0;
	char *b = (char *)ws;
	return moe_cuda_experts_fwd_lora(dev, E, H, I, off, offsets, w, lora, xg, g, u, b, y, b + 2 * rows * I);
}

extern "C" int moe_cuda_experts_bwd_step(tier_dev *dev, int E, int H, int I, const int32_t *offsets,
					 const tier_moe_experts *w, const tier_moe_loras *lora, const void *xg, const float *g,
					 const float *u, const void *dy, float *dxg, void *ws)
{
	const char *fn = "tier_moe_experts_bwd";
	int32_t off[TIER_MOE_MAX_EXPERTS + 1];
	int rc = offsets_to_host(dev, fn, E, offsets, off);
	if (rc)
		return rc;
	MOE_NONNULL(ws, fn);
	size_t rows = off[E] > 0 ? (size_t)off[E] : 0, r = (size_t)moe_lora_max_rank(lora), hi = 2 * rows * I;
	char *b = (char *)ws, *h = b + 4 * rows * I;
	return moe_cuda_experts_bwd(dev, E, H, I, off, offsets, w, lora, xg, g, u, dy, dxg, h, h + hi, h + 2 * hi, (float *)b,
				    h + 3 * hi, h + 3 * hi + 2 * rows * r);
}
