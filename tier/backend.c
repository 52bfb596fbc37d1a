/* backend.c - the memory behind each tier: one reservation per tier, carved by a range allocator.
 *
 * HBM:  one device allocation on a CUDA context, 256-byte extents (cudaMalloc's own alignment).
 *       Without one, host memory stands in ("emulated") with 4 KiB extents, so that emulated HBM
 *       can be the host end of an O_DIRECT transfer like DDR.
 * DDR:  one anonymous mapping, given a preferred NUMA node (the GPU's) before anything touches it,
 *       then page-locked with cudaHostRegister when the tier serves a CUDA device. 4 KiB extents:
 *       every DDR extent may be an O_DIRECT buffer.
 * NVMe: see backend_nvme.c.
 * A budget above what the machine has fails with -E2BIG, or is clamped with a warning. */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysinfo.h>
#include "tier/base.h"
#include "tier/backend_nvme.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef TIER_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

#define HOST_ALIGN 4096u
#define CUDA_ALIGN 256u

struct tier_backend {
	tier_id tier;
	uint64_t capacity;   /* after clamping and rounding down to the alignment */
	tier_dev *dev;
	int cuda;            /* dev is a CUDA context */
	int pinned;          /* DDR registered with CUDA */
	int numa_node;       /* DDR: preferred node set on the mapping, -1 when left to the kernel */
	void *base;          /* HBM, DDR: the reservation */
	tier_range *range;   /* HBM, DDR */
	tier_nvme *nvme;     /* NVMe */
};

/* The tier's name as its flag spells it (tier_name lives in the store, a layer above). */
static const char *tname(tier_id t)
{
	static const char *names[TIER_NTIERS] = { "hbm", "ddr", "nvme" };
	return (unsigned)t < TIER_NTIERS ? names[t] : "unknown";
}

static char *fmt(uint64_t bytes, char *buf)
{
	return tier_format_size(bytes, buf, 32);
}

/* A "key: N kB" line of a /proc or cgroup file; 0 when absent. */
static uint64_t meminfo_kb(const char *key)
{
	char line[256];
	size_t klen = strlen(key);
	unsigned long long v = 0;
	FILE *f = fopen("/proc/meminfo", "r");
	if (!f)
		return 0;
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, key, klen) && line[klen] == ':' && sscanf(line + klen + 1, "%llu", &v) == 1)
			break;
	fclose(f);
	return v;
}

static uint64_t read_u64_file(const char *path, uint64_t absent)
{
	unsigned long long v;
	FILE *f = fopen(path, "r");
	int ok = f && fscanf(f, "%llu", &v) == 1;
	if (f)
		fclose(f);
	return ok ? v : absent;
}

/* What a cgroup v2 memory limit leaves this process (UINT64_MAX when there is none). */
static uint64_t cgroup_room(void)
{
	char line[512], path[700];
	uint64_t max, cur;
	FILE *f = fopen("/proc/self/cgroup", "r");
	if (!f)
		return UINT64_MAX;
	path[0] = '\0';
	while (fgets(line, sizeof line, f)) {
		if (!strncmp(line, "0::", 3)) {
			line[strcspn(line, "\n")] = '\0';
			snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", line + 3);
			break;
		}
	}
	fclose(f);
	if (!path[0])
		return UINT64_MAX;
	max = read_u64_file(path, UINT64_MAX);  /* "max" does not parse: no limit */
	strcpy(strrchr(path, '/'), "/memory.current");
	cur = read_u64_file(path, 0);
	return max == UINT64_MAX ? max : max > cur ? max - cur : 0;
}

/* Host memory this process could still take: MemAvailable (sysinfo when /proc is missing),
 * bounded by the cgroup's limit. */
static uint64_t host_available(void)
{
	uint64_t have = meminfo_kb("MemAvailable") * 1024, room = cgroup_room();
	if (have == 0) {
		struct sysinfo si;
		if (sysinfo(&si) == 0)
			have = ((uint64_t)si.freeram + si.bufferram) * si.mem_unit;
	}
	return have < room ? have : room;
}

/* Check the budget against what the machine has: fail with -E2BIG, or clamp to `have - keep`
 * (leaving room for the rest of the process) with a warning. */
static int fit_budget(tier_id t, uint64_t *cap, uint64_t have, uint64_t keep, uint64_t align,
		      const char *what, int clamp)
{
	char a[32], b[32], c[32];
	uint64_t to;
	if (*cap <= have)
		return 0;
	if (!clamp)
		return tier_fail(-E2BIG, "the %s budget %s is more than this machine has (%s of %s): lower "
				 "--%s, or allow clamping to the machine (clamp_budgets)", tname(t),
				 fmt(*cap, a), fmt(have, b), what, tname(t));
	to = (have > 2 * keep ? have - keep : have / 2) / align * align;
	if (to == 0)
		return tier_fail(-E2BIG, "the %s budget %s cannot be clamped: this machine has too little "
				 "(%s of %s); lower --%s", tname(t), fmt(*cap, a), fmt(have, b), what, tname(t));
	if (*cap >= TIER_BUDGET_MAX) /* asked for whatever there is, so no warning */
		tier_log(TIER_LOG_INFO, "the %s budget: %s (all %s of %s but what the process needs)", tname(t),
			 fmt(to, c), fmt(have, b), what);
	else
		tier_log(TIER_LOG_WARN, "the %s budget %s is more than this machine has (%s of %s): clamped to %s",
			 tname(t), fmt(*cap, a), fmt(have, b), what, fmt(to, c));
	*cap = to;
	return 0;
}

static int hbm_create(tier_backend *b, uint64_t cap, int clamp)
{
	uint64_t align = b->cuda ? CUDA_ALIGN : HOST_ALIGN, have, keep;
	char a[32];
	int rc;
	const char *what = "available host memory, HBM being emulated";
#ifdef TIER_HAVE_CUDA
	if (b->cuda) {
		size_t free_b = 0, total_b = 0;
		if (cudaSetDevice(tier_dev_ordinal(b->dev)) != cudaSuccess ||
		    cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
			cudaGetLastError();
			return tier_fail(-ENODEV, "cannot query the memory of %s", tier_dev_name(b->dev));
		}
		have = free_b;
		keep = have / 32 > (256u << 20) ? have / 32 : (256u << 20); /* context, kernels, NCCL */
		what = "free device memory";
	} else
#endif
	{
		have = host_available();
		keep = have / 8;
	}
	if ((rc = fit_budget(TIER_HBM, &cap, have, keep, align, what, clamp)))
		return rc;
	if (cap < align)
		return tier_fail(-EINVAL, "the hbm budget %s is below the %llu-byte extent alignment: raise --hbm",
				 fmt(cap, a), (unsigned long long)align);
	b->capacity = cap / align * align;
	if (b->dev)
		rc = tier_dev_malloc(b->dev, b->capacity, &b->base);
	else
		rc = tier_host_malloc(b->capacity, 0, &b->base);
	if (rc)
		return rc;
	if (b->cuda)
		tier_log(TIER_LOG_INFO, "hbm tier: %s on %s", fmt(b->capacity, a), tier_dev_name(b->dev));
	else
		tier_log(TIER_LOG_INFO, "hbm tier: %s of host memory (emulated, no CUDA device)", fmt(b->capacity, a));
	return range_create(&b->range, b->capacity, align);
}

/* Prefer the GPU's NUMA node for the mapping's pages; nothing is touched yet, so they all land
 * there (or spill to other nodes when it is full: MPOL_PREFERRED, not BIND, never fails). */
static void ddr_bind(tier_backend *b)
{
	int node = b->dev ? tier_dev_numa_node(b->dev) : -1;
	b->numa_node = -1;
#ifdef TIER_HAVE_NUMA
	char a[32], c[32];
	long long node_free = 0;
	struct bitmask *mask;
	if (node < 0 || numa_available() < 0 || node > numa_max_node()) {
		tier_log(TIER_LOG_INFO, "ddr tier: NUMA node of the device unknown; placement left to the kernel");
		return;
	}
	mask = numa_allocate_nodemask();
	numa_bitmask_setbit(mask, (unsigned)node);
	if (mbind(b->base, b->capacity, MPOL_PREFERRED, mask->maskp, mask->size + 1, 0) == 0)
		b->numa_node = node;
	else
		tier_log(TIER_LOG_WARN, "ddr tier: binding to NUMA node %d failed (%s); placement left to "
			 "the kernel", node, strerror(errno));
	numa_free_nodemask(mask);
	if (b->numa_node >= 0 && numa_node_size64(node, &node_free) > 0 && (uint64_t)node_free < b->capacity)
		tier_log(TIER_LOG_WARN, "ddr tier: %s budget, NUMA node %d has %s free: the rest will come "
			 "from other nodes", fmt(b->capacity, a), node, fmt((uint64_t)node_free, c));
#else
	(void)node;
	tier_log(TIER_LOG_INFO, "ddr tier: built without libnuma; NUMA placement left to the kernel");
#endif
}

static int ddr_create(tier_backend *b, uint64_t cap, int clamp)
{
	uint64_t have = host_available();
	char a[32];
	int rc = fit_budget(TIER_DDR, &cap, have, have / 8, HOST_ALIGN, "available host memory", clamp);
	if (rc)
		return rc;
	if (cap < HOST_ALIGN)
		return tier_fail(-EINVAL, "the ddr budget %s is below one 4 KiB page: raise --ddr", fmt(cap, a));
	b->capacity = cap / HOST_ALIGN * HOST_ALIGN;
	b->base = mmap(NULL, b->capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (b->base == MAP_FAILED) {
		b->base = NULL;
		return tier_fail(-ENOMEM, "cannot map %s of host memory for the ddr tier (%s): lower --ddr",
				 fmt(b->capacity, a), strerror(errno));
	}
	ddr_bind(b);
#ifdef MADV_HUGEPAGE
	/* transparent huge pages where the kernel offers them on request: 512x fewer pages for
	 * cudaHostRegister to pin (which ran at 1.2-1.8 GB/s on 4 KiB pages) and for copies to miss
	 * in the TLB; refused, the tier works on 4 KiB pages as before */
	if (madvise(b->base, b->capacity, MADV_HUGEPAGE) != 0)
		tier_log(TIER_LOG_DEBUG, "ddr tier: no transparent huge pages (%s)", strerror(errno));
#endif
#ifdef TIER_HAVE_CUDA
	if (b->cuda) {
		cudaError_t e = cudaHostRegister(b->base, b->capacity, cudaHostRegisterPortable);
		if (e != cudaSuccess) {
			cudaGetLastError();
			return tier_fail(-ENOMEM, "cannot pin %s of host memory for the ddr tier (%s): lower --ddr",
					 fmt(b->capacity, a), cudaGetErrorString(e));
		}
		b->pinned = 1;
	}
#endif
	tier_log(TIER_LOG_INFO, "ddr tier: %s of host memory, %s, NUMA node %d%s", fmt(b->capacity, a),
		 b->pinned ? "pinned" : "pageable", b->numa_node, b->numa_node < 0 ? " (kernel's choice)" : "");
	return range_create(&b->range, b->capacity, HOST_ALIGN);
}

int backend_create(tier_backend **out, const tier_backend_config *cfg)
{
	tier_backend *b;
	int rc;
	*out = NULL;
	if (!cfg || (unsigned)cfg->tier >= TIER_NTIERS)
		return tier_fail(-EINVAL, "backend_create: no configuration or an unknown tier");
	if (cfg->capacity == 0)
		return tier_fail(-EINVAL, "the %s budget is 0: give it a size (--%s)", tname(cfg->tier),
				 tname(cfg->tier));
	b = calloc(1, sizeof *b);
	if (!b)
		return tier_fail(-ENOMEM, "out of host memory for a tier backend");
	b->tier = cfg->tier;
	b->dev = cfg->dev;
	b->cuda = cfg->dev && tier_dev_kind_of(cfg->dev) == TIER_DEV_CUDA;
	b->numa_node = -1;
	if (cfg->tier == TIER_HBM) {
		rc = hbm_create(b, cfg->capacity, cfg->clamp);
	} else if (cfg->tier == TIER_DDR) {
		rc = ddr_create(b, cfg->capacity, cfg->clamp);
	} else {
		rc = nvme_create(&b->nvme, cfg->capacity, cfg->dirs, cfg->n_dirs, cfg->offload);
		if (!rc)
			b->capacity = nvme_capacity(b->nvme);
	}
	if (rc) {
		backend_destroy(b);
		return rc;
	}
	*out = b;
	return 0;
}

void backend_destroy(tier_backend *b)
{
	if (!b)
		return;
	range_destroy(b->range);
	nvme_destroy(b->nvme);
	if (b->base && b->tier == TIER_HBM) {
		if (b->dev)
			tier_dev_free(b->dev, b->base);
		else
			tier_host_free(b->base, 0);
	} else if (b->base) {
#ifdef TIER_HAVE_CUDA
		if (b->pinned)
			cudaHostUnregister(b->base);
#endif
		munmap(b->base, b->capacity);
	}
	free(b);
}

int backend_alloc(tier_backend *b, uint64_t size, tier_extent *ext)
{
	uint64_t off;
	int rc;
	if (size == 0)
		return tier_fail(-EINVAL, "%s: allocation of 0 bytes", tname(b->tier));
	if (b->nvme)
		return nvme_alloc(b->nvme, size, ext);
	if ((rc = range_alloc(b->range, size, &off)))
		return rc;
	ext->offset = off;
	ext->bytes = range_rounded(b->range, size);
	/* Emulated HBM is host memory, but stays a DEVICE location so that links are named right. */
	ext->loc = b->tier == TIER_HBM ? tier_loc_device((char *)b->base + off)
				       : tier_loc_host((char *)b->base + off);
	return 0;
}

void backend_free(tier_backend *b, const tier_extent *ext)
{
	if (b->nvme) {
		nvme_free(b->nvme, ext);
		return;
	}
	if (ext->loc.ptr != (char *)b->base + ext->offset) {
		tier_log(TIER_LOG_ERROR, "%s: extent at %llu does not belong to this tier (ignored)",
			 tname(b->tier), (unsigned long long)ext->offset);
		return;
	}
	range_free(b->range, ext->offset, ext->bytes);
}

uint64_t backend_capacity(const tier_backend *b) { return b->capacity; }
uint64_t backend_used(const tier_backend *b) { return b->nvme ? nvme_used(b->nvme) : range_used(b->range); }
int backend_emulated(const tier_backend *b) { return b->tier == TIER_HBM && !b->cuda; }
int backend_numa_node(const tier_backend *b) { return b->numa_node; }
int backend_pinned(const tier_backend *b) { return b->pinned; }
const tier_nvme *backend_nvme(const tier_backend *b) { return b->nvme; }

uint64_t backend_largest_free(const tier_backend *b)
{
	return b->nvme ? nvme_largest_free(b->nvme) : range_largest_free(b->range);
}

uint64_t backend_rounded(const tier_backend *b, uint64_t size)
{
	uint64_t align = b->nvme ? 4096 : range_align(b->range);
	return tier_align_up(size, align);
}

int backend_check(const tier_backend *b)
{
	char why[512];
	int rc;
	if (b->nvme) {
		rc = nvme_check(b->nvme);
		if (!rc && nvme_capacity(b->nvme) != b->capacity)
			rc = tier_fail(-EPROTO, "nvme: capacity changed");
		return rc;
	}
	if ((rc = range_check(b->range))) {
		snprintf(why, sizeof why, "%s", tier_last_error());
		return tier_fail(rc, "%s tier: %s", tname(b->tier), why);
	}
	if (range_capacity(b->range) != b->capacity || range_used(b->range) > b->capacity)
		return tier_fail(-EPROTO, "%s tier: allocator capacity %llu or use %llu disagrees with the budget %llu",
				 tname(b->tier), (unsigned long long)range_capacity(b->range),
				 (unsigned long long)range_used(b->range), (unsigned long long)b->capacity);
	if (!b->base || (uintptr_t)b->base % range_align(b->range))
		return tier_fail(-EPROTO, "%s tier: reservation missing or misaligned", tname(b->tier));
	return 0;
}
