/* gemm_cuda.cu - one cuBLASLt product with a cache of the chosen algorithms (see gemm_cuda.h).
 * The heuristic query costs tens of microseconds, more than a small expert's or LoRA's product, and
 * a training step makes thousands of products of a few dozen shapes; so the chosen algorithm is
 * kept per shape (the varying row count rounded up to a power of two), per workspace size (a lane's
 * is smaller than the compute stream's) and per pointer alignment. */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include "base/gemm_cuda.h"

typedef struct {
	int dev, ta, tb, m, n, k, lda, ldb, ldc, type_a, type_b, type_c;
	uint32_t ala, alb, alc, ws_mib;
} gemm_key;
typedef struct {
	gemm_key key;
	cublasLtMatmulAlgo_t algo;
	int used;
} gemm_entry;
#define GEMM_CACHE 2048
static gemm_entry gemm_cache[GEMM_CACHE];
static pthread_mutex_t gemm_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t gemm_slot(const gemm_key *k)
{
	const unsigned char *b = (const unsigned char *)k;
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < sizeof *k; i++)
		h = (h ^ b[i]) * 1099511628211ull;
	return (size_t)(h % GEMM_CACHE);
}

static int gemm_get(const gemm_key *k, cublasLtMatmulAlgo_t *a)
{
	size_t s = gemm_slot(k);
	int hit;
	pthread_mutex_lock(&gemm_lock);
	hit = gemm_cache[s].used && !memcmp(&gemm_cache[s].key, k, sizeof *k);
	if (hit)
		*a = gemm_cache[s].algo;
	pthread_mutex_unlock(&gemm_lock);
	return hit;
}

static void gemm_put(const gemm_key *k, const cublasLtMatmulAlgo_t *a)
{
	size_t s = gemm_slot(k);
	pthread_mutex_lock(&gemm_lock);
	gemm_cache[s].key = *k, gemm_cache[s].algo = *a, gemm_cache[s].used = 1;
	pthread_mutex_unlock(&gemm_lock);
}

/* The largest power of two (<= 256) dividing the address: what cuBLASLt may assume. */
static uint32_t align_of(const void *p)
{
	uintptr_t a = (uintptr_t)p;
	uint32_t al = 256;
	while (al > 1 && (a & (al - 1)))
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

/* Layouts as stored: A m x k (k x m transposed), B k x n (n x k), C m x n. */
typedef struct {
	cublasLtMatrixLayout_t la, lb, lc;
} gemm_layouts;

static cublasStatus_t layouts_make(gemm_layouts *l, int m, int n, int k, const tier_gemm_operand *A,
				   const tier_gemm_operand *B, int c_type, int ldc)
{
	cublasStatus_t st;
	l->la = l->lb = l->lc = NULL;
	st = cublasLtMatrixLayoutCreate(&l->la, (cudaDataType_t)A->type, A->trans ? k : m, A->trans ? m : k, A->ld);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&l->lb, (cudaDataType_t)B->type, B->trans ? n : k, B->trans ? k : n, B->ld);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&l->lc, (cudaDataType_t)c_type, m, n, ldc);
	return st;
}

static void layouts_free(gemm_layouts *l)
{
	if (l->lc)
		cublasLtMatrixLayoutDestroy(l->lc);
	if (l->lb)
		cublasLtMatrixLayoutDestroy(l->lb);
	if (l->la)
		cublasLtMatrixLayoutDestroy(l->la);
}

/* One heuristic query: the best algorithm for the given layouts, or an error status. */
static cublasStatus_t query(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const gemm_layouts *l, size_t wsb,
			    const gemm_key *k, cublasLtMatmulAlgo_t *algo)
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

/* The cache's key: the exact shape but for the varying dimension (gemm_cuda.h), rounded up. */
static gemm_key key_of(tier_dev *d, int m, int n, int k, const tier_gemm_operand *A, const tier_gemm_operand *B,
		       const void *C, int c_type, int ldc, size_t wsb)
{
	gemm_key key;
	memset(&key, 0, sizeof key); /* padding too: the key is hashed and compared as bytes */
	key.dev = tier_dev_ordinal(d), key.ta = A->trans, key.tb = B->trans;
	key.m = m, key.n = !B->trans ? pow2_at_least(n) : n, key.k = B->trans && !A->trans ? pow2_at_least(k) : k;
	key.lda = A->ld, key.ldb = B->ld, key.ldc = ldc;
	key.type_a = A->type, key.type_b = B->type, key.type_c = c_type;
	key.ala = align_of(A->p), key.alb = align_of(B->p), key.alc = align_of(C);
	key.ws_mib = (uint32_t)(wsb >> 20);
	return key;
}

extern "C" int tier_cuda_gemm(tier_dev *d, int lane, const char *fn, int m, int n, int k, float alpha,
			      tier_gemm_operand A, tier_gemm_operand B, float beta, void *C, int c_type, int ldc)
{
	return tier_cuda_gemm_cd(d, lane, fn, m, n, k, alpha, A, B, beta, C, C, c_type, ldc);
}

extern "C" int tier_cuda_gemm_cd(tier_dev *d, int lane, const char *fn, int m, int n, int k, float alpha,
				 tier_gemm_operand A, tier_gemm_operand B, float beta, const void *Cin, void *C,
				 int c_type, int ldc)
{
	cublasLtHandle_t h = (cublasLtHandle_t)tier_dev_blaslt(d);
	size_t wsb = 0;
	void *ws = NULL;
	cudaStream_t stream = (cudaStream_t)tier_dev_lane_stream(d, lane, &ws, &wsb);
	if (!h)
		return tier_fail(-EIO, "%s: the device context has no cuBLASLt handle", fn);
	cublasOperation_t opa = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N, opb = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
	/* the alignment both C operands share: the algorithm must suit the one it reads and the one it writes */
	gemm_key key = key_of(d, m, n, k, &A, &B, (const void *)((uintptr_t)Cin | (uintptr_t)C), c_type, ldc, wsb);
	gemm_layouts real = { NULL, NULL, NULL }, q = { NULL, NULL, NULL };
	cublasLtMatmulDesc_t desc = NULL;
	cublasLtMatmulAlgo_t algo;
	cublasStatus_t st = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = layouts_make(&real, m, n, k, &A, &B, c_type, ldc);
	int done = 0;
	if (st == CUBLAS_STATUS_SUCCESS && gemm_get(&key, &algo))
		done = cublasLtMatmul(h, desc, &alpha, A.p, real.la, B.p, real.lb, &beta, Cin, real.lc, C, real.lc, &algo, ws,
				      wsb, stream) == CUBLAS_STATUS_SUCCESS;
	if (st == CUBLAS_STATUS_SUCCESS && !done && (key.n != n || key.k != k)) { /* the algorithm of the bucket */
		st = layouts_make(&q, m, key.n, key.k, &A, &B, c_type, ldc);
		if (st == CUBLAS_STATUS_SUCCESS && query(h, desc, &q, wsb, &key, &algo) == CUBLAS_STATUS_SUCCESS)
			done = cublasLtMatmul(h, desc, &alpha, A.p, real.la, B.p, real.lb, &beta, Cin, real.lc, C, real.lc, &algo,
					      ws, wsb, stream) == CUBLAS_STATUS_SUCCESS;
	}
	if (st == CUBLAS_STATUS_SUCCESS && !done) { /* the exact shape */
		st = query(h, desc, &real, wsb, &key, &algo);
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmul(h, desc, &alpha, A.p, real.la, B.p, real.lb, &beta, Cin, real.lc, C, real.lc, &algo, ws,
					    wsb, stream);
		done = st == CUBLAS_STATUS_SUCCESS;
	}
	if (done)
		gemm_put(&key, &algo);
	layouts_free(&q);
	layouts_free(&real);
	if (desc)
		cublasLtMatmulDescDestroy(desc);
	if (!done)
		return tier_fail(-EIO, "%s: cuBLASLt product %d x %d x %d (A trans %d type %d ld %d, B trans %d type %d ld %d) "
				 "failed: %s", fn, m, n, k, A.trans, A.type, A.ld, B.trans, B.type, B.ld,
				 cublasLtGetStatusString(st == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : st));
	return 0;
}
