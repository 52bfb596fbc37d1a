/* bench_dev.c - device buffers and CUDA-event timing for the CUDA-only benchmarks (bench_dev.h). */
#include "tools/bench_dev.h"
#ifdef TIER_HAVE_CUDA
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>

int bench_dev_buf(tier_dev *d, void **p, size_t n, int el)
{
	int rc = tier_dev_malloc(d, n ? n : 4, p);
	if (rc)
		return rc;
	uint8_t *h = malloc(n ? n : 4);
	if (!h)
		return tier_fail(-ENOMEM, "bench: no host memory for a %zu-byte buffer", n);
	uint64_t x = (uintptr_t)*p | 1; /* xorshift from the address: each buffer its own values */
	for (size_t i = 0; i + (size_t)el <= n; i += (size_t)el) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		float f = ((float)(x >> 40) / (float)(1 << 24) - 0.5f) * 0.5f + (el == 4 ? 0.0f : 0.25f);
		uint32_t u;
		memcpy(&u, &f, 4);
		if (el == 2)
			memcpy(h + i, (uint16_t[]){ (uint16_t)(u >> 16) }, 2);
		else
			memcpy(h + i, &f, 4);
	}
	rc = tier_dev_memcpy_h2d(d, *p, h, n);
	free(h);
	return rc;
}

int bench_timer_open(bench_timer *t, tier_dev *d)
{
	cudaEvent_t a = NULL, b = NULL;
	memset(t, 0, sizeof *t);
	t->dev = d;
	if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) {
		if (a)
			cudaEventDestroy(a);
		return tier_fail(-EIO, "bench: cudaEventCreate failed: %s", cudaGetErrorString(cudaGetLastError()));
	}
	t->e0 = a, t->e1 = b;
	return 0;
}

void bench_timer_close(bench_timer *t)
{
	if (t->e0)
		cudaEventDestroy((cudaEvent_t)t->e0);
	if (t->e1)
		cudaEventDestroy((cudaEvent_t)t->e1);
	t->e0 = t->e1 = NULL;
}

double bench_timer_run(bench_timer *t, int (*call)(void *arg), void *arg, int *rc)
{
	float ms = 0;
	cudaStream_t s = (cudaStream_t)tier_dev_stream(t->dev);
	cudaEventRecord((cudaEvent_t)t->e0, s);
	if ((*rc = call(arg)))
		return -1;
	cudaEventRecord((cudaEvent_t)t->e1, s);
	if (cudaEventSynchronize((cudaEvent_t)t->e1) != cudaSuccess ||
	    cudaEventElapsedTime(&ms, (cudaEvent_t)t->e0, (cudaEvent_t)t->e1) != cudaSuccess) {
		*rc = tier_fail(-EIO, "bench: CUDA events failed: %s", cudaGetErrorString(cudaGetLastError()));
		return -1;
	}
	return ms * 1e6;
}
#endif
