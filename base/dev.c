/* dev.c - the device context: CPU, or one CUDA device with its stream and cuBLASLt handle. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "config.h"
#include "tier/base.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <cublasLt.h>
#include <cuda_profiler_api.h>
#include "base/fill_cuda.h"
#endif
#ifdef TIER_HAVE_HWLOC
#include <hwloc.h>
#endif

#define BLASLT_WORKSPACE (32u << 20)
#define LANE_WORKSPACE (8u << 20) /* per lane: enough for cuBLASLt's non-split-K Hopper kernels */

#define PUT_SLOTS 4 /* tier_dev_put_async's staging buffers (base.h says 4) */

struct tier_dev {
	tier_dev_kind kind;
	int ordinal;
	int numa_node;
	char name[256];
#ifdef TIER_HAVE_CUDA
	cudaStream_t stream;
	cublasLtHandle_t blaslt;
	void *workspace;
	/* side streams made on first use (tier_dev_lanes_fork), each with its own cuBLASLt workspace:
	 * independent small products run side by side and fill the SMs together */
	int lanes;
	pthread_mutex_t lane_lock; /* the first forks of two threads must not both make the lanes */
	cudaStream_t lane[TIER_DEV_LANES];
	cudaEvent_t lane_done[TIER_DEV_LANES], forked;
	void *lane_ws[TIER_DEV_LANES];
	/* copy lanes (tier_dev_copy_async), each made on first use: an operator's output on its way
	 * to the op cache in DDR and back while the compute stream goes on */
	int copy_on[TIER_DEV_COPY_LANES];
	cudaStream_t copy[TIER_DEV_COPY_LANES];
	cudaEvent_t copy_from[TIER_DEV_COPY_LANES], copy_done[TIER_DEV_COPY_LANES];
	/* staged uploads (tier_dev_put_async): PUT_SLOTS pinned buffers used in turn, each free again
	 * once the copy recorded by its event is done */
	struct {
		void *buf;
		size_t cap;
		cudaEvent_t done;
		int made, used;
	} put[PUT_SLOTS];
	int put_next;
#endif
};

#ifdef TIER_HAVE_CUDA
#define CUDA_TRY(call, code)                                                                      \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return tier_fail(code, "%s:%d: %s: %s", __FILE__, __LINE__, #call,         \
					 cudaGetErrorString(e_));                                  \
	} while (0)
#endif

int tier_cuda_available(void)
{
#ifdef TIER_HAVE_CUDA
	int n = 0;
	return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
	return 0;
#endif
}

/* The NUMA node of a PCI device, from hwloc's I/O topology; -1 when it cannot be told. */
static int numa_of_pci(const char *busid)
{
#ifdef TIER_HAVE_HWLOC
	hwloc_topology_t topo;
	int node = -1;
	if (hwloc_topology_init(&topo))
		return -1;
	hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
	if (hwloc_topology_load(topo) == 0) {
		unsigned dom, bus, dev, fn;
		if (sscanf(busid, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
			hwloc_obj_t pci = hwloc_get_pcidev_by_busid(topo, dom, bus, dev, fn);
			hwloc_obj_t anc = pci ? hwloc_get_non_io_ancestor_obj(topo, pci) : NULL;
			if (anc && anc->nodeset && !hwloc_bitmap_iszero(anc->nodeset) &&
			    hwloc_bitmap_weight(anc->nodeset) == 1)
				node = hwloc_bitmap_first(anc->nodeset);
		}
	}
	hwloc_topology_destroy(topo);
	return node;
#else
	(void)busid;
	return -1;
#endif
}

#ifdef TIER_HAVE_CUDA
static int cuda_open(tier_dev *d, int ordinal)
{
	struct cudaDeviceProp prop;
	char busid[32];
	int n = 0;
	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
		return tier_fail(-ENODEV, "no CUDA device is visible; run with --device cpu");
	if (ordinal < 0 || ordinal >= n)
		return tier_fail(-ENODEV, "CUDA device %d does not exist (%d visible)", ordinal, n);
	CUDA_TRY(cudaSetDevice(ordinal), -ENODEV);
	CUDA_TRY(cudaGetDeviceProperties(&prop, ordinal), -ENODEV);
	snprintf(d->name, sizeof d->name, "%s", prop.name);
	if (cudaDeviceGetPCIBusId(busid, sizeof busid, ordinal) == cudaSuccess)
		d->numa_node = numa_of_pci(busid);
	CUDA_TRY(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking), -EIO);
	/* Stream-ordered allocations (the grouped GEMMs' small tables and maps) keep their pool: with
	 * the default threshold of 0 every synchronisation hands it back to the driver, and the next
	 * cudaMallocAsync maps it again (about 140 us of the host's time each, measured in the trainer) */
	cudaMemPool_t pool;
	uint64_t keep = UINT64_MAX;
	if (cudaDeviceGetDefaultMemPool(&pool, ordinal) != cudaSuccess ||
	    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
		cudaGetLastError(); /* only slower without it */
	if (cublasLtCreate(&d->blaslt) != CUBLAS_STATUS_SUCCESS)
		return tier_fail(-EIO, "cublasLtCreate failed on device %d", ordinal);
	CUDA_TRY(cudaMalloc(&d->workspace, BLASLT_WORKSPACE), -ENOMEM);
	return 0;
}
#endif

int tier_dev_open(tier_dev **out, tier_dev_kind kind, int ordinal)
{
	tier_dev *d;
	*out = NULL;
	if (kind != TIER_DEV_CPU && kind != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "unknown device kind %d (cpu or cuda)", (int)kind);
	d = calloc(1, sizeof *d);
	if (!d)
		return tier_fail(-ENOMEM, "out of host memory for a device context");
	d->kind = kind;
	d->ordinal = ordinal;
	d->numa_node = -1;
	snprintf(d->name, sizeof d->name, "cpu");
#ifdef TIER_HAVE_CUDA
	pthread_mutex_init(&d->lane_lock, NULL);
#endif
	if (kind == TIER_DEV_CUDA) {
#ifdef TIER_HAVE_CUDA
		int rc = cuda_open(d, ordinal);
		if (rc) {
			tier_dev_close(d);
			return rc;
		}
#else
		free(d);
		return tier_fail(-ENODEV, "this build of tier has no CUDA support (configure --with-cuda); run with --device cpu");
#endif
	}
	*out = d;
	return 0;
}

void tier_dev_close(tier_dev *d)
{
	if (!d)
		return;
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		for (int i = 0; i < d->lanes; i++) {
			cudaFree(d->lane_ws[i]);
			cudaEventDestroy(d->lane_done[i]);
			cudaStreamDestroy(d->lane[i]);
		}
		if (d->lanes)
			cudaEventDestroy(d->forked);
		for (int i = 0; i < TIER_DEV_COPY_LANES; i++)
			if (d->copy_on[i]) {
				cudaStreamSynchronize(d->copy[i]);
				cudaEventDestroy(d->copy_from[i]);
				cudaEventDestroy(d->copy_done[i]);
				cudaStreamDestroy(d->copy[i]);
			}
		for (int i = 0; i < PUT_SLOTS; i++) {
			if (d->put[i].used)
				cudaEventSynchronize(d->put[i].done);
			if (d->put[i].made)
				cudaEventDestroy(d->put[i].done);
			if (d->put[i].buf)
				cudaFreeHost(d->put[i].buf);
		}
		if (d->workspace)
			cudaFree(d->workspace);
		if (d->blaslt)
			cublasLtDestroy(d->blaslt);
		if (d->stream)
			cudaStreamDestroy(d->stream);
	}
	pthread_mutex_destroy(&d->lane_lock);
#endif
	free(d);
}

tier_dev_kind tier_dev_kind_of(const tier_dev *d) { return d->kind; }
int tier_dev_ordinal(const tier_dev *d) { return d->ordinal; }
const char *tier_dev_name(const tier_dev *d) { return d->name; }
int tier_dev_numa_node(const tier_dev *d) { return d->kind == TIER_DEV_CPU && d->numa_node < 0 ? 0 : d->numa_node; }

void *tier_dev_stream(const tier_dev *d)
{
#ifdef TIER_HAVE_CUDA
	return d->kind == TIER_DEV_CUDA ? (void *)d->stream : NULL;
#else
	(void)d;
	return NULL;
#endif
}

void *tier_dev_blaslt(const tier_dev *d)
{
#ifdef TIER_HAVE_CUDA
	return d->kind == TIER_DEV_CUDA ? (void *)d->blaslt : NULL;
#else
	(void)d;
	return NULL;
#endif
}

void *tier_dev_blaslt_workspace(const tier_dev *d, size_t *bytes)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		if (bytes)
			*bytes = BLASLT_WORKSPACE;
		return d->workspace;
	}
#endif
	if (bytes)
		*bytes = 0;
	return NULL;
}

#ifdef TIER_HAVE_CUDA
/* Lanes 0..n-1 exist afterwards (made in order, so a failure leaves a consistent prefix). */
static int lanes_make(tier_dev *d, int n)
{
	if (d->lanes == 0)
		CUDA_TRY(cudaEventCreateWithFlags(&d->forked, cudaEventDisableTiming), -EIO);
	while (d->lanes < n) {
		int i = d->lanes;
		CUDA_TRY(cudaStreamCreateWithFlags(&d->lane[i], cudaStreamNonBlocking), -EIO);
		if (cudaEventCreateWithFlags(&d->lane_done[i], cudaEventDisableTiming) != cudaSuccess) {
			cudaStreamDestroy(d->lane[i]);
			return tier_fail(-EIO, "CUDA: no event for lane %d on %s", i, d->name);
		}
		if (cudaMalloc(&d->lane_ws[i], LANE_WORKSPACE) != cudaSuccess) {
			cudaGetLastError();
			cudaEventDestroy(d->lane_done[i]);
			cudaStreamDestroy(d->lane[i]);
			return tier_fail(-ENOMEM, "CUDA: no %u MiB workspace for lane %d on %s", LANE_WORKSPACE >> 20, i,
					 d->name);
		}
		d->lanes++;
	}
	return 0;
}
#endif

int tier_dev_lanes_fork(tier_dev *d, int n)
{
	if (n < 1 || n > TIER_DEV_LANES)
		return tier_fail(-EINVAL, "lanes: %d asked, 1..%d exist", n, TIER_DEV_LANES);
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		pthread_mutex_lock(&d->lane_lock);
		int rc = lanes_make(d, n);
		pthread_mutex_unlock(&d->lane_lock);
		if (rc)
			return rc;
		CUDA_TRY(cudaEventRecord(d->forked, d->stream), -EIO);
		for (int i = 0; i < n; i++)
			CUDA_TRY(cudaStreamWaitEvent(d->lane[i], d->forked, 0), -EIO);
	}
#endif
	return 0;
}

int tier_dev_lanes_join(tier_dev *d, int n)
{
	if (n < 1 || n > TIER_DEV_LANES)
		return tier_fail(-EINVAL, "lanes: %d asked, 1..%d exist", n, TIER_DEV_LANES);
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		if (n > d->lanes)
			return tier_fail(-EINVAL, "lanes: join of %d, only %d forked", n, d->lanes);
		for (int i = 0; i < n; i++) {
			if (cudaEventRecord(d->lane_done[i], d->lane[i]) != cudaSuccess ||
			    cudaStreamWaitEvent(d->stream, d->lane_done[i], 0) != cudaSuccess) {
				/* the compute stream no longer orders the lanes' work: wait for it here, so
				 * that nothing runs on memory released after the caller's next sync */
				for (int j = 0; j < d->lanes; j++)
					cudaStreamSynchronize(d->lane[j]);
				return tier_fail(-EIO, "lanes: join of lane %d failed on %s: %s", i, d->name,
						 cudaGetErrorString(cudaGetLastError()));
			}
		}
	}
#endif
	return 0;
}

void *tier_dev_lane_stream(const tier_dev *d, int i, void **ws, size_t *ws_bytes)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA && i >= 0 && i < d->lanes) {
		*ws = d->lane_ws[i], *ws_bytes = LANE_WORKSPACE;
		return d->lane[i];
	}
#endif
	(void)i;
	*ws = tier_dev_blaslt_workspace(d, ws_bytes);
	return tier_dev_stream(d);
}

#ifdef TIER_HAVE_CUDA
static int copy_make(tier_dev *d, int i)
{
	if (d->copy_on[i])
		return 0;
	CUDA_TRY(cudaStreamCreateWithFlags(&d->copy[i], cudaStreamNonBlocking), -EIO);
	if (cudaEventCreateWithFlags(&d->copy_from[i], cudaEventDisableTiming) != cudaSuccess) {
		cudaStreamDestroy(d->copy[i]);
		return tier_fail(-EIO, "CUDA: no events for copy lane %d on %s", i, d->name);
	}
	if (cudaEventCreateWithFlags(&d->copy_done[i], cudaEventDisableTiming) != cudaSuccess) {
		cudaEventDestroy(d->copy_from[i]);
		cudaStreamDestroy(d->copy[i]);
		return tier_fail(-EIO, "CUDA: no events for copy lane %d on %s", i, d->name);
	}
	d->copy_on[i] = 1;
	return 0;
}
#endif

static int copy_lane_ok(int lane)
{
	if (lane < 0 || lane >= TIER_DEV_COPY_LANES)
		return tier_fail(-EINVAL, "copy lanes: lane %d asked, 0..%d exist", lane, TIER_DEV_COPY_LANES - 1);
	return 0;
}

int tier_dev_copy_async(tier_dev *d, void *dst, const void *src, size_t n, int lane)
{
	if (!dst || !src)
		return tier_fail(-EINVAL, "tier_dev_copy_async: NULL destination or source");
	int rc = copy_lane_ok(lane);
	if (rc)
		return rc;
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		pthread_mutex_lock(&d->lane_lock);
		rc = copy_make(d, lane);
		pthread_mutex_unlock(&d->lane_lock);
		if (rc)
			return rc;
		CUDA_TRY(cudaEventRecord(d->copy_from[lane], d->stream), -EIO);
		CUDA_TRY(cudaStreamWaitEvent(d->copy[lane], d->copy_from[lane], 0), -EIO);
		CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, d->copy[lane]), -EIO);
		return 0;
	}
#endif
	memcpy(dst, src, n);
	return 0;
}

#ifdef TIER_HAVE_CUDA
/* The next staging buffer: waited for if its last copy may still read it, grown to n bytes. */
static int put_stage(tier_dev *d, void *dst, const void *src, size_t n)
{
	int i = d->put_next;
	d->put_next = (i + 1) % PUT_SLOTS;
	if (d->put[i].used)
		CUDA_TRY(cudaEventSynchronize(d->put[i].done), -EIO);
	d->put[i].used = 0;
	if (!d->put[i].made) {
		CUDA_TRY(cudaEventCreateWithFlags(&d->put[i].done, cudaEventDisableTiming), -EIO);
		d->put[i].made = 1;
	}
	if (d->put[i].cap < n) {
		if (d->put[i].buf)
			cudaFreeHost(d->put[i].buf);
		d->put[i].buf = NULL, d->put[i].cap = 0;
		if (cudaMallocHost(&d->put[i].buf, n) != cudaSuccess) {
			d->put[i].buf = NULL;
			return tier_fail(-ENOMEM, "tier_dev_put_async: no pinned host memory for %zu bytes on %s", n,
					 d->name);
		}
		d->put[i].cap = n;
	}
	memcpy(d->put[i].buf, src, n);
	CUDA_TRY(cudaMemcpyAsync(dst, d->put[i].buf, n, cudaMemcpyHostToDevice, d->stream), -EIO);
	CUDA_TRY(cudaEventRecord(d->put[i].done, d->stream), -EIO);
	d->put[i].used = 1;
	return 0;
}
#endif

int tier_dev_put_async(tier_dev *d, void *dst, const void *src, size_t n)
{
	if (!dst || !src)
		return tier_fail(-EINVAL, "tier_dev_put_async: NULL destination or source");
	if (n == 0)
		return 0;
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		pthread_mutex_lock(&d->lane_lock);
		int rc = put_stage(d, dst, src, n);
		pthread_mutex_unlock(&d->lane_lock);
		return rc;
	}
#endif
	memcpy(dst, src, n);
	return 0;
}

int tier_dev_copy_join(tier_dev *d, int lane)
{
	int rc = copy_lane_ok(lane);
	if (rc)
		return rc;
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA && d->copy_on[lane] &&
	    (cudaEventRecord(d->copy_done[lane], d->copy[lane]) != cudaSuccess ||
	     cudaStreamWaitEvent(d->stream, d->copy_done[lane], 0) != cudaSuccess)) {
		cudaStreamSynchronize(d->copy[lane]); /* unordered now: done before the caller reuses anything */
		return tier_fail(-EIO, "copy lane %d: join failed on %s: %s", lane, d->name,
				 cudaGetErrorString(cudaGetLastError()));
	}
#endif
	(void)d;
	return 0;
}

int tier_dev_profiler(tier_dev *d, int on)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		CUDA_TRY(cudaStreamSynchronize(d->stream), -EIO); /* the range holds this step's work only */
		CUDA_TRY(on ? cudaProfilerStart() : cudaProfilerStop(), -EIO);
	}
#endif
	(void)d, (void)on;
	return 0;
}

int tier_dev_sync(tier_dev *d)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) { /* lanes are joined into the stream (a failed join waits itself) */
		CUDA_TRY(cudaStreamSynchronize(d->stream), -EIO);
		for (int i = 0; i < TIER_DEV_COPY_LANES; i++) /* copies not joined yet are done too */
			if (d->copy_on[i])
				CUDA_TRY(cudaStreamSynchronize(d->copy[i]), -EIO);
	}
#endif
	(void)d;
	return 0;
}

int tier_dev_malloc(tier_dev *d, size_t bytes, void **out)
{
	*out = NULL;
	if (bytes == 0)
		return tier_fail(-EINVAL, "device allocation of 0 bytes");
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		if (cudaMalloc(out, bytes) != cudaSuccess) {
			cudaGetLastError();
			*out = NULL;
			return tier_fail(-ENOMEM, "cudaMalloc of %zu bytes failed on %s: lower the HBM budget", bytes, d->name);
		}
		return 0;
	}
#endif
	if (posix_memalign(out, 4096, bytes)) {
		*out = NULL;
		return tier_fail(-ENOMEM, "out of host memory for %zu bytes of emulated HBM: lower --hbm", bytes);
	}
	return 0;
}

void tier_dev_free(tier_dev *d, void *p)
{
	if (!p)
		return;
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		cudaFree(p);
		return;
	}
#endif
	free(p);
}

int tier_host_malloc(size_t bytes, int pinned, void **out)
{
	*out = NULL;
	if (bytes == 0)
		return tier_fail(-EINVAL, "host allocation of 0 bytes");
#ifdef TIER_HAVE_CUDA
	if (pinned && tier_cuda_available()) {
		if (cudaHostAlloc(out, bytes, cudaHostAllocPortable) != cudaSuccess) {
			cudaGetLastError();
			*out = NULL;
			return tier_fail(-ENOMEM, "cudaHostAlloc of %zu pinned bytes failed: lower --ddr or raise the memlock limit", bytes);
		}
		return 0;
	}
#endif
	(void)pinned;
	if (posix_memalign(out, 4096, bytes)) {
		*out = NULL;
		return tier_fail(-ENOMEM, "out of host memory for %zu bytes: lower --ddr", bytes);
	}
	return 0;
}

void tier_host_free(void *p, int pinned)
{
	if (!p)
		return;
#ifdef TIER_HAVE_CUDA
	if (pinned && tier_cuda_available()) {
		cudaFreeHost(p);
		return;
	}
#endif
	(void)pinned;
	free(p);
}

int tier_dev_memcpy_h2d(tier_dev *d, void *dst, const void *src, size_t n)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, d->stream), -EIO);
		CUDA_TRY(cudaStreamSynchronize(d->stream), -EIO);
		return 0;
	}
#endif
	memcpy(dst, src, n);
	return 0;
}

int tier_dev_memcpy_d2h(tier_dev *d, void *dst, const void *src, size_t n)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, d->stream), -EIO);
		CUDA_TRY(cudaStreamSynchronize(d->stream), -EIO);
		return 0;
	}
#endif
	memcpy(dst, src, n);
	return 0;
}

int tier_dev_memset(tier_dev *d, void *dst, int value, size_t n)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		CUDA_TRY((cudaError_t)tier_cuda_fill(dst, value, n, d->stream), -EIO);
		return 0;
	}
#endif
	memset(dst, value, n);
	return 0;
}

int tier_dev_memcpy_d2d(tier_dev *d, void *dst, const void *src, size_t n)
{
#ifdef TIER_HAVE_CUDA
	if (d->kind == TIER_DEV_CUDA) {
		CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, d->stream), -EIO);
		return 0;
	}
#endif
	memmove(dst, src, n);
	return 0;
}
