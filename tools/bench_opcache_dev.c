/* bench_opcache_dev.c - the device half of tier-bench opcache: fp32 OpenBLAS on the CPU, bf16
 * cuBLASLt on CUDA (GELU in the matmul epilogues: GELU_AUX keeps Z in the forward, DGELU applies
 * gelu'(Z) in the backward, so no kernel of our own is needed). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "tools/bench_opcache.h" /* before cblas.h: its <complex.h> defines I, a parameter name in moe.h */
#ifdef TIER_HAVE_OPENBLAS
#include <cblas.h>
#endif
#ifdef TIER_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

static int is_cuda(const oc_model *m) { return m->o.kind == TIER_DEV_CUDA; }

/* ---- CPU ---------------------------------------------------------------------------------------- */
static float gelu(float z)
{
	return 0.5f * z * (1.0f + tanhf(0.7978845608f * (z + 0.044715f * z * z * z)));
}

static float gelu_grad(float z)
{
	const float c = 0.7978845608f, a = 0.044715f;
	float t = tanhf(c * (z + a * z * z * z));
	return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * c * (1.0f + 3.0f * a * z * z);
}

static int cpu_matmul(const float *A, const float *B, int tb, unsigned M, unsigned K, unsigned N, float *C)
{
#ifdef TIER_HAVE_OPENBLAS
	cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)K,
		    B, tb ? (int)K : (int)N, 0.0f, C, (int)N);
	return 0;
#else
	(void)A, (void)B, (void)tb, (void)M, (void)K, (void)N, (void)C;
	return tier_fail(-ENOTSUP, "tier-bench opcache on the CPU needs OpenBLAS: rebuild with it, or use --device cuda");
#endif
}

/* ---- CUDA: cuBLASLt plans, one per (direction, epilogue, shape) ---------------------------------- */
#ifdef TIER_HAVE_CUDA
typedef struct {
	int bwd, epi;
	unsigned T, K, N;
	cublasLtMatmulDesc_t desc;
	cublasLtMatrixLayout_t a, b, d;
	cublasLtMatmulAlgo_t algo;
} lt_plan;
enum { MAX_PLANS = 16 };
typedef struct {
	lt_plan p[MAX_PLANS];
	int n;
} lt_plans;

#define LT_TRY(call)                                                                                        \
	do {                                                                                               \
		cublasStatus_t s_ = (call);                                                                \
		if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
			return tier_fail(-EIO, "opcache bench: %s failed (cuBLASLt status %d)", #call, (int)s_); \
	} while (0)

/* Row-major products seen column-major: forward Z^T (N x T) = W^T (N x K, stored as W) X^T (K x T);
 * backward G^T (K x T) = (W^T)^T (W stored N x K, transposed) dZ^T (N x T). */
static int plan_make(oc_model *m, lt_plan *p)
{
	cublasOperation_t ta = p->bwd ? CUBLAS_OP_T : CUBLAS_OP_N, tn = CUBLAS_OP_N;
	uint64_t rows = p->bwd ? p->K : p->N, inner = p->bwd ? p->N : p->K;
	cublasLtEpilogue_t epi = (cublasLtEpilogue_t)p->epi;
	LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
	LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
	LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tn, sizeof tn));
	LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
	if (p->epi != CUBLASLT_EPILOGUE_DEFAULT) {
		int64_t ld = (int64_t)rows;
		LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
	}
	LT_TRY(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, p->N, p->K, p->N)); /* W as stored */
	LT_TRY(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, inner, p->T, inner));
	LT_TRY(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_16BF, rows, p->T, rows));
	cublasLtMatmulPreference_t pref;
	size_t ws;
	tier_dev_blaslt_workspace(m->dev, &ws);
	LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
	LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
	cublasLtMatmulHeuristicResult_t res;
	int n = 0;
	cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)tier_dev_blaslt(m->dev), p->desc, p->a, p->b,
							  p->d, p->d, pref, 1, &res, &n);
	cublasLtMatmulPreferenceDestroy(pref);
	if (s != CUBLAS_STATUS_SUCCESS || n < 1)
		return tier_fail(-ENOTSUP, "opcache bench: cuBLASLt has no algorithm for a bf16 %s matmul %ux%ux%u with "
				 "epilogue %d (status %d)", p->bwd ? "backward" : "forward", p->T, p->K, p->N, p->epi, (int)s);
	p->algo = res.algo;
	return 0;
}

static int lt_run(oc_model *m, int bwd, int epi, unsigned T, unsigned K, unsigned N, const void *W, const void *B,
		  const void *aux, void *D)
{
	lt_plans *ps = m->plans;
	lt_plan *p = NULL;
	for (int i = 0; i < ps->n && !p; i++)
		if (ps->p[i].bwd == bwd && ps->p[i].epi == epi && ps->p[i].T == T && ps->p[i].K == K && ps->p[i].N == N)
			p = &ps->p[i];
	if (!p) {
		if (ps->n == MAX_PLANS)
			return tier_fail(-ENOSPC, "opcache bench: more than %d matmul shapes", MAX_PLANS);
		p = &ps->p[ps->n];
		memset(p, 0, sizeof *p);
		*p = (lt_plan){ .bwd = bwd, .epi = epi, .T = T, .K = K, .N = N };
		int rc = plan_make(m, p);
		if (rc)
			return rc;
		ps->n++;
	}
	if (aux)
		LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
	float one = 1.0f, zero = 0.0f;
	size_t ws;
	void *wsp = tier_dev_blaslt_workspace(m->dev, &ws);
	LT_TRY(cublasLtMatmul((cublasLtHandle_t)tier_dev_blaslt(m->dev), p->desc, &one, W, p->a, B, p->b, &zero, D, p->d, D,
			      p->d, &p->algo, wsp, ws, (cudaStream_t)tier_dev_stream(m->dev)));
	return 0;
}

static void plans_free(lt_plans *ps)
{
	for (int i = 0; ps && i < ps->n; i++) {
		cublasLtMatmulDescDestroy(ps->p[i].desc);
		cublasLtMatrixLayoutDestroy(ps->p[i].a);
		cublasLtMatrixLayoutDestroy(ps->p[i].b);
		cublasLtMatrixLayoutDestroy(ps->p[i].d);
	}
	free(ps);
}
#endif

/* ---- The interface ------------------------------------------------------------------------------ */
int oc_open(oc_model *m)
{
	int rc = tier_dev_open(&m->dev, m->o.kind, 0);
	if (rc || !is_cuda(m))
		return rc;
#ifdef TIER_HAVE_CUDA
	if (!(m->plans = calloc(1, sizeof(lt_plans))))
		return tier_fail(-ENOMEM, "opcache bench: out of memory");
#endif
	return 0;
}

void oc_close(oc_model *m)
{
#ifdef TIER_HAVE_CUDA
	plans_free(m->plans);
#endif
	m->plans = NULL;
	tier_dev_close(m->dev);
	m->dev = NULL;
}

int oc_alloc(oc_model *m, size_t bytes, void **out)
{
	if (is_cuda(m))
		return tier_dev_malloc(m->dev, bytes, out);
	*out = aligned_alloc(64, (bytes + 63) / 64 * 64);
	return *out ? 0 : tier_fail(-ENOMEM, "opcache bench: no memory for %zu bytes", bytes);
}

void oc_free(oc_model *m, void *p)
{
	if (!p)
		return;
	if (is_cuda(m))
		tier_dev_free(m->dev, p);
	else
		free(p);
}

int oc_fill(oc_model *m, void *dst, size_t n, float scale, uint64_t seed)
{
	tier_rng r;
	tier_rng_seed(&r, seed);
	if (!is_cuda(m)) {
		for (size_t i = 0; i < n; i++)
			((float *)dst)[i] = scale * (float)(2 * tier_rng_uniform(&r) - 1);
		return 0;
	}
	uint16_t *h = malloc(n * 2);
	if (!h)
		return tier_fail(-ENOMEM, "opcache bench: no host memory for %zu values", n);
	for (size_t i = 0; i < n; i++) {
		float f = scale * (float)(2 * tier_rng_uniform(&r) - 1);
		uint32_t u;
		memcpy(&u, &f, 4);
		h[i] = (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16); /* round to nearest even bf16 */
	}
	int rc = tier_dev_memcpy_h2d(m->dev, dst, h, n * 2);
	free(h);
	return rc;
}

int oc_copy(oc_model *m, void *dst, const void *src, size_t bytes)
{
	if (!is_cuda(m)) {
		memcpy(dst, src, bytes);
		return 0;
	}
#ifdef TIER_HAVE_CUDA
	cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)tier_dev_stream(m->dev));
	if (e != cudaSuccess)
		return tier_fail(-EIO, "opcache bench: device copy failed: %s", cudaGetErrorString(e));
#endif
	return 0;
}

int oc_read(oc_model *m, const void *src, size_t n, float *out)
{
	if (!is_cuda(m)) {
		memcpy(out, src, n * 4);
		return 0;
	}
	uint16_t *h = malloc(n * 2);
	if (!h)
		return tier_fail(-ENOMEM, "opcache bench: no host memory for %zu values", n);
	int rc = tier_dev_memcpy_d2h(m->dev, h, src, n * 2);
	if (!rc)
		rc = tier_dtype_convert(out, TIER_DT_F32, h, TIER_DT_BF16, n);
	free(h);
	return rc;
}

int oc_sync(oc_model *m)
{
	return is_cuda(m) ? tier_dev_sync(m->dev) : 0;
}

void *oc_stream(oc_model *m)
{
	return tier_dev_stream(m->dev);
}

int oc_matmul(oc_model *m, const void *X, const void *W, unsigned T, unsigned K, unsigned N, void *Z, void *Y)
{
	if (is_cuda(m)) {
#ifdef TIER_HAVE_CUDA
		if (Y) /* Y = gelu(Z), Z kept as the epilogue's aux output */
			return lt_run(m, 0, CUBLASLT_EPILOGUE_GELU_AUX, T, K, N, W, X, Z, Y);
		return lt_run(m, 0, CUBLASLT_EPILOGUE_DEFAULT, T, K, N, W, X, NULL, Z);
#endif
	}
	int rc = cpu_matmul(X, W, 0, T, K, N, Z);
	if (!rc && Y)
		for (size_t i = 0; i < (size_t)T * N; i++)
			((float *)Y)[i] = gelu(((const float *)Z)[i]);
	return rc;
}

int oc_matmul_bwd(oc_model *m, const void *dZ, const void *W, unsigned T, unsigned K, unsigned N, const void *Zp,
		  void *G)
{
	if (is_cuda(m)) {
#ifdef TIER_HAVE_CUDA
		return lt_run(m, 1, Zp ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT, T, K, N, W, dZ, Zp, G);
#endif
	}
	int rc = cpu_matmul(dZ, W, 1, T, N, K, G);
	if (!rc && Zp)
		for (size_t i = 0; i < (size_t)T * K; i++)
			((float *)G)[i] *= gelu_grad(((const float *)Zp)[i]);
	return rc;
}
