/* waypoint.c - a point of the device's compute stream that the host waits for later (tier_waypoint).
 *
 * The trainer ends an operation by putting a waypoint and waits for it only when the next operation
 * has been queued: the device then never waits for the host's pinning between layers, and what
 * the operation pinned is released once the waypoint has passed. */
#include <errno.h>
#include <stdlib.h>
#include "config.h"
#include "tier/base.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

struct tier_waypoint {
	tier_dev *dev;
	int cuda, pending;
#ifdef TIER_HAVE_CUDA
	cudaEvent_t ev;
#endif
};

int tier_waypoint_open(tier_waypoint **out, tier_dev *dev)
{
	*out = NULL;
	if (!dev)
		return tier_fail(-EINVAL, "tier_waypoint_open: a device context is required");
	tier_waypoint *f = calloc(1, sizeof *f);
	if (!f)
		return tier_fail(-ENOMEM, "out of memory for a device waypoint");
	f->dev = dev, f->cuda = tier_dev_kind_of(dev) == TIER_DEV_CUDA;
#ifdef TIER_HAVE_CUDA
	if (f->cuda && cudaEventCreateWithFlags(&f->ev, cudaEventDisableTiming) != cudaSuccess) {
		cudaGetLastError();
		free(f);
		return tier_fail(-EIO, "device waypoint: cudaEventCreate failed");
	}
#endif
	*out = f;
	return 0;
}

void tier_waypoint_close(tier_waypoint *f)
{
	if (!f)
		return;
#ifdef TIER_HAVE_CUDA
	if (f->cuda)
		cudaEventDestroy(f->ev);
#endif
	free(f);
}

int tier_waypoint_put(tier_waypoint *f)
{
#ifdef TIER_HAVE_CUDA
	if (f->cuda && cudaEventRecord(f->ev, (cudaStream_t)tier_dev_stream(f->dev)) != cudaSuccess) {
		cudaError_t e = cudaGetLastError();
		return tier_fail(-EIO, "device waypoint: recording a CUDA event failed: %s", cudaGetErrorString(e));
	}
#endif
	f->pending = 1;
	return 0;
}

int tier_waypoint_wait(tier_waypoint *f)
{
	if (!f->pending)
		return 0;
	f->pending = 0;
#ifdef TIER_HAVE_CUDA
	if (f->cuda && cudaEventSynchronize(f->ev) != cudaSuccess) {
		cudaError_t e = cudaGetLastError();
		return tier_fail(-EIO, "device waypoint: the work before it failed: %s", cudaGetErrorString(e));
	}
#endif
	return 0;
}

int tier_waypoint_pending(const tier_waypoint *f) { return f->pending; }
