/* bench_prefetch_dev.c - the per-layer compute of tier-bench prefetch: fp32 matrix products that
 * read the layer's weights in place (OpenBLAS or naive loops on the CPU, cuBLAS on CUDA). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "tools/bench_prefetch.h" /* before cblas.h: its <complex.h> defines I */
#include "tools/bench.h"
#ifdef TIER_HAVE_OPENBLAS
#include <cblas.h>
#endif
#ifdef TIER_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

struct pf_compute {
	tier_dev *dev;
	int cuda;
	unsigned K, N, M, cap; /* cap: rows the buffers hold */
	float *x, *y, *dx;     /* M x K, M x N, M x K (device memory on CUDA) */
	uint64_t seed;
#ifdef TIER_HAVE_CUDA
	cublasHandle_t blas;
#endif
};

/* ---- CPU ---------------------------------------------------------------------------------------- */
/* C (M x N) = A (M x K) B, with B K x N (tb = 0) or B^T where B is N x K (tb = 1); all row-major. */
static void cpu_matmul(const float *A, const float *B, int tb, unsigned M, unsigned K, unsigned N, float *C)
{
#ifdef TIER_HAVE_OPENBLAS
	cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)K,
		    B, tb ? (int)K : (int)N, 0.0f, C, (int)N);
#else
	for (unsigned i = 0; i < M; i++) {
		float *c = C + (size_t)i * N;
		const float *a = A + (size_t)i * K;
		if (tb) {
			for (unsigned j = 0; j < N; j++) {
				const float *b = B + (size_t)j * K;
				float s = 0;
				for (unsigned k = 0; k < K; k++)
					s += a[k] * b[k];
				c[j] = s;
			}
		} else {
			memset(c, 0, (size_t)N * sizeof *c);
			for (unsigned k = 0; k < K; k++) {
				const float *b = B + (size_t)k * N;
				for (unsigned j = 0; j < N; j++)
					c[j] += a[k] * b[j];
			}
		}
	}
#endif
}

/* ---- Buffers ------------------------------------------------------------------------------------- */
static void bufs_free(pf_compute *c)
{
#ifdef TIER_HAVE_CUDA
	if (c->cuda) {
		tier_dev_free(c->dev, c->x);
		tier_dev_free(c->dev, c->y);
		tier_dev_free(c->dev, c->dx);
		c->x = c->y = c->dx = NULL;
		return;
	}
#endif
	free(c->x);
	free(c->y);
	free(c->dx);
	c->x = c->y = c->dx = NULL;
}

static int buf_alloc(pf_compute *c, size_t floats, float **out)
{
	if (c->cuda)
		return tier_dev_malloc(c->dev, floats * sizeof(float), (void **)out);
	if (!(*out = malloc(floats * sizeof(float))))
		return tier_fail(-ENOMEM, "tier-bench prefetch: out of memory for %zu activation floats: use a smaller --layer-bytes",
				 floats);
	return 0;
}

/* X gets fresh random rows; Y and dX are written before they are read. */
static int bufs_alloc(pf_compute *c, unsigned rows)
{
	size_t nx = (size_t)rows * c->K, ny = (size_t)rows * c->N;
	float *host = malloc(nx * sizeof *host);
	if (!host)
		return tier_fail(-ENOMEM, "tier-bench prefetch: out of memory for %u activation rows", rows);
	tier_rng r;
	tier_rng_seed(&r, c->seed);
	for (size_t i = 0; i < nx; i++)
		host[i] = (float)(2 * tier_rng_uniform(&r) - 1);
	bufs_free(c);
	int rc = buf_alloc(c, nx, &c->x);
	if (!rc)
		rc = buf_alloc(c, ny, &c->y);
	if (!rc)
		rc = buf_alloc(c, nx, &c->dx);
	if (!rc && c->cuda)
		rc = tier_dev_memcpy_h2d(c->dev, c->x, host, nx * sizeof *host);
	else if (!rc)
		memcpy(c->x, host, nx * sizeof *host);
	free(host);
	if (rc) {
		bufs_free(c);
		c->cap = 0;
		return rc;
	}
	c->cap = rows;
	return 0;
}

int pf_compute_create(pf_compute **out, tier_dev *dev, unsigned K, unsigned N, uint64_t seed)
{
	*out = NULL;
	pf_compute *c = calloc(1, sizeof *c);
	if (!c)
		return tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	c->dev = dev;
	c->cuda = dev && tier_dev_kind_of(dev) == TIER_DEV_CUDA;
	c->K = K;
	c->N = N;
	c->seed = seed;
#ifdef TIER_HAVE_OPENBLAS
	openblas_set_num_threads(1); /* one core computes; the copy workers get the other */
#endif
#ifdef TIER_HAVE_CUDA
	if (c->cuda) {
		if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS) {
			free(c);
			return tier_fail(-EIO, "tier-bench prefetch: cublasCreate failed");
		}
		cublasSetStream(c->blas, (cudaStream_t)tier_dev_stream(dev));
	}
#endif
	int rc = pf_compute_set_rows(c, 64);
	if (rc) {
		pf_compute_destroy(c);
		return rc;
	}
	*out = c;
	return 0;
}

void pf_compute_destroy(pf_compute *c)
{
	if (!c)
		return;
	bufs_free(c);
#ifdef TIER_HAVE_CUDA
	if (c->cuda)
		cublasDestroy(c->blas);
#endif
	free(c);
}

int pf_compute_set_rows(pf_compute *c, unsigned M)
{
	if (M > c->cap) {
		int rc = bufs_alloc(c, M);
		if (rc)
			return rc;
	}
	c->M = M;
	return 0;
}

unsigned pf_compute_rows(const pf_compute *c) { return c->M; }

/* ---- One layer ------------------------------------------------------------------------------------ */
#ifdef TIER_HAVE_CUDA
static int cuda_layer(pf_compute *c, const float *w, int backward)
{
	const float one = 1, zero = 0;
	cublasStatus_t st;
	/* Column-major view: row-major Y (M x N) = X W is Y^T = W^T X^T, where W^T is W's storage read
	 * as an N x K column-major matrix; dX^T = W Y^T is that matrix transposed. */
	if (!backward)
		st = cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)c->N, (int)c->M, (int)c->K, &one, w, (int)c->N,
				 c->x, (int)c->K, &zero, c->y, (int)c->N);
	else
		st = cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)c->K, (int)c->M, (int)c->N, &one, w, (int)c->N,
				 c->y, (int)c->N, &zero, c->dx, (int)c->K);
	if (st != CUBLAS_STATUS_SUCCESS)
		return tier_fail(-EIO, "tier-bench prefetch: cublasSgemm failed (status %d)", (int)st);
	return tier_dev_sync(c->dev);
}
#endif

double pf_compute_layer(pf_compute *c, const float *w, int backward)
{
	uint64_t t0 = tier_now_ns();
#ifdef TIER_HAVE_CUDA
	if (c->cuda) {
		int rc = cuda_layer(c, w, backward);
		if (rc)
			return rc;
		return (double)(tier_now_ns() - t0);
	}
#endif
	if (!backward)
		cpu_matmul(c->x, w, 0, c->M, c->K, c->N, c->y);
	else
		cpu_matmul(c->y, w, 1, c->M, c->N, c->K, c->dx);
	return (double)(tier_now_ns() - t0);
}

/* The fastest of `reps` runs: other processes only ever slow a run down, so the minimum is the
 * stable figure of the work itself (the loop's own compute time is reported separately). */
static double best_layer(pf_compute *c, const float *w, unsigned reps)
{
	double best = 0;
	for (unsigned i = 0; i < reps; i++) {
		double t = pf_compute_layer(c, w, i & 1);
		if (t < 0)
			return t;
		if (!i || t < best)
			best = t;
	}
	return best;
}

double pf_compute_calibrate(pf_compute *c, const float *w, double target_ns)
{
	double t = best_layer(c, w, 3); /* the first run also warms the caches and BLAS */
	for (int round = 0; round < 12; round++) {
		if (t < 0)
			return t;
		if (fabs(t / target_ns - 1) < 0.04 && round > 0)
			break;
		double m = (double)c->M * target_ns / (t > 1 ? t : 1);
		/* Small products do not scale linearly: move at most 8x per round. */
		if (m > 8.0 * c->M)
			m = 8.0 * c->M;
		unsigned M = m < 1 ? 1 : m > 1e6 ? 1000000u : (unsigned)lround(m);
		int rc = pf_compute_set_rows(c, M);
		if (rc)
			return rc;
		t = best_layer(c, w, 6);
	}
	return t;
}

int pf_compute_sample(pf_compute *c, float *out, unsigned n)
{
	if (n > c->M * c->N)
		n = c->M * c->N;
	if (c->cuda)
		return tier_dev_memcpy_d2h(c->dev, out, c->y, n * sizeof *out);
	memcpy(out, c->y, n * sizeof *out);
	return 0;
}
