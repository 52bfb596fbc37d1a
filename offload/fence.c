/* fence.c - fences: the refcounted result of one transfer, waited on by host or stream. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "offload_impl.h"

tier_fence *fence_new(void)
{
	tier_fence *f = calloc(1, sizeof *f);
	if (!f)
		return NULL;
	pthread_mutex_init(&f->mu, NULL);
	pthread_cond_init(&f->cv, NULL);
	atomic_init(&f->refs, 1);
	atomic_init(&f->done, 0);
	return f;
}

void fence_complete(tier_fence *f, int result, const char *msg, uint32_t crc, uint64_t busy_ns)
{
	pthread_mutex_lock(&f->mu);
	f->result = result;
	f->crc = crc;
	f->busy_ns = busy_ns;
	snprintf(f->msg, sizeof f->msg, "%s", msg ? msg : "");
	atomic_store(&f->done, 1);
	pthread_cond_broadcast(&f->cv);
	pthread_mutex_unlock(&f->mu);
}

int tier_fence_wait(tier_fence *f)
{
	int rc;
	if (!f)
		return tier_fail(-EINVAL, "tier_fence_wait: NULL fence (pass the fence tier_offload_submit returned)");
#ifdef TIER_HAVE_CUDA
	if (f->cuda)
		return cuda_fence_wait(f);
#endif
	pthread_mutex_lock(&f->mu);
	while (!atomic_load(&f->done))
		pthread_cond_wait(&f->cv, &f->mu);
	rc = f->result;
	pthread_mutex_unlock(&f->mu);
	if (rc)
		return tier_fail(rc, "%s", f->msg);
	return 0;
}

int tier_fence_done(const tier_fence *f)
{
	if (!f)
		return 1;
#ifdef TIER_HAVE_CUDA
	if (f->cuda)
		return cuda_fence_query(f);
#endif
	return atomic_load(&f->done);
}

int tier_fence_stream_wait(tier_fence *f, void *stream)
{
#ifdef TIER_HAVE_CUDA
	if (f && f->cuda && stream)
		return cuda_fence_stream_wait(f, stream);
#endif
	return tier_fence_wait(f);
}

uint32_t tier_fence_crc(const tier_fence *f)
{
	uint32_t c;
	if (!f)
		return 0;
	pthread_mutex_lock((pthread_mutex_t *)&f->mu);
	c = f->crc;
	pthread_mutex_unlock((pthread_mutex_t *)&f->mu);
	return c;
}

uint64_t tier_fence_busy_ns(const tier_fence *f)
{
	uint64_t t;
	if (!f)
		return 0;
	pthread_mutex_lock((pthread_mutex_t *)&f->mu);
	t = f->busy_ns;
	pthread_mutex_unlock((pthread_mutex_t *)&f->mu);
	return t;
}

tier_fence *tier_fence_get(tier_fence *f)
{
	if (f)
		atomic_fetch_add(&f->refs, 1);
	return f;
}

void tier_fence_put(tier_fence *f)
{
	if (!f || atomic_fetch_sub(&f->refs, 1) != 1)
		return;
#ifdef TIER_HAVE_CUDA
	if (f->cuda)
		cuda_fence_release(f);
#endif
	pthread_mutex_destroy(&f->mu);
	pthread_cond_destroy(&f->cv);
	free(f);
}
