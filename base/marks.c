/* marks.c - time on the device's own clock between tagged points of its stream (tier_marks).
 *
 * A trainer's host clock says where the host waited, not where the device spent its time: kernels
 * are queued and the host blocks later, in whatever part first needs a result. A mark is a CUDA
 * event recorded on the compute stream; it completes when the work queued before it has, so the
 * time between two marks is the device time of the work queued between them, plus any gap in
 * which the device waited for the host to queue more (charged to the part the host was busy in).
 * On a CPU context the work is done when it is queued, and a mark is the host clock. */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include "config.h"
#include "tier/base.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

struct tier_marks {
	tier_dev *dev;
	int cuda;
	int n, cap; /* marks put since the last collect; events or stamps made */
	int *tag;
	uint64_t *ns; /* CPU: the host clock at each mark */
#ifdef TIER_HAVE_CUDA
	cudaEvent_t *ev; /* made on first use, reused across collects */
#endif
	int broken; /* a CUDA call failed: collect says so until the next begin */
};

int tier_marks_open(tier_marks **out, tier_dev *dev)
{
	*out = NULL;
	if (!dev)
		return tier_fail(-EINVAL, "tier_marks_open: a device context is required");
	tier_marks *m = calloc(1, sizeof *m);
	if (!m)
		return tier_fail(-ENOMEM, "out of memory for device marks");
	m->dev = dev, m->cuda = tier_dev_kind_of(dev) == TIER_DEV_CUDA;
	*out = m;
	return 0;
}

void tier_marks_close(tier_marks *m)
{
	if (!m)
		return;
#ifdef TIER_HAVE_CUDA
	for (int i = 0; m->ev && i < m->cap; i++)
		cudaEventDestroy(m->ev[i]);
	free(m->ev);
#endif
	free(m->tag);
	free(m->ns);
	free(m);
}

/* Room for one more mark: double the arrays (and make the new events). */
static int marks_grow(tier_marks *m)
{
	if (m->cap > INT_MAX / 2)
		return -ENOMEM;
	int cap = m->cap ? 2 * m->cap : 256;
	int *tag = realloc(m->tag, sizeof *tag * (size_t)cap);
	if (tag)
		m->tag = tag;
	uint64_t *ns = tag ? realloc(m->ns, sizeof *ns * (size_t)cap) : NULL;
	if (ns)
		m->ns = ns;
	if (!tag || !ns)
		return -ENOMEM;
#ifdef TIER_HAVE_CUDA
	if (m->cuda) {
		cudaEvent_t *ev = realloc(m->ev, sizeof *ev * (size_t)cap);
		if (!ev)
			return -ENOMEM;
		m->ev = ev;
		for (int i = m->cap; i < cap; i++)
			if (cudaEventCreate(&ev[i]) != cudaSuccess) {
				cudaGetLastError();
				m->cap = i; /* the ones made so far are destroyed on close */
				return -EIO;
			}
	}
#endif
	m->cap = cap;
	return 0;
}

void tier_marks_begin(tier_marks *m)
{
	m->n = 0, m->broken = 0;
}

int tier_marks_put(tier_marks *m, int tag)
{
	if (m->broken)
		return m->broken;
	if (m->n == m->cap && (m->broken = marks_grow(m)))
		return m->broken;
	m->tag[m->n] = tag;
#ifdef TIER_HAVE_CUDA
	if (m->cuda && cudaEventRecord(m->ev[m->n], (cudaStream_t)tier_dev_stream(m->dev)) != cudaSuccess) {
		cudaGetLastError();
		return m->broken = -EIO;
	}
#endif
	m->ns[m->n++] = tier_now_ns();
	return 0;
}

int tier_marks_collect(tier_marks *m, uint64_t *ns_by_tag, int ntags)
{
	if (m->broken)
		return tier_fail(m->broken, "device marks: %s", m->broken == -ENOMEM ? "out of memory" : "a CUDA event failed");
#ifdef TIER_HAVE_CUDA
	if (m->cuda && m->n > 0 && cudaEventSynchronize(m->ev[m->n - 1]) != cudaSuccess) { /* the stream's order: all */
		cudaGetLastError();
		return tier_fail(-EIO, "device marks: waiting for the last CUDA event failed");
	}
#endif
	for (int i = 1; i < m->n; i++) {
		uint64_t dt = m->ns[i] - m->ns[i - 1];
#ifdef TIER_HAVE_CUDA
		float ms = 0.0f;
		if (m->cuda) {
			if (cudaEventElapsedTime(&ms, m->ev[i - 1], m->ev[i]) != cudaSuccess) {
				cudaGetLastError();
				return tier_fail(-EIO, "device marks: reading CUDA event times failed");
			}
			dt = (uint64_t)((double)ms * 1e6);
		}
#endif
		if (m->tag[i] >= 0 && m->tag[i] < ntags)
			ns_by_tag[m->tag[i]] += dt;
	}
	return 0;
}

int tier_marks_count(const tier_marks *m)
{
	return m->n;
}
