/* bench_offload.c - tier-bench h2d, d2h, nvme-read, nvme-write, nvme-to-hbm: the offload engine's
 * throughput per link against a peer measured in the same run (cudaMemcpyAsync or memcpy for the
 * HBM links, fio or dd with direct I/O for the NVMe links). */
#include "config.h"
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "tier/tier.h"
#include "tools/bench.h"
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#endif

typedef struct {
	const char *cmd;
	tier_link link;
	char dir[512];
	uint64_t min_size, max_size;
	unsigned iters, threads;
	double gbps;
	int no_uring;
} bopts;

/* Resources of one run. */
typedef struct {
	bopts *o;
	tier_dev *dev;
	tier_offload *off;
	void *host, *hbm;  /* host: pinned when CUDA; hbm: device memory (or host memory standing in) */
	int fd, fid, direct;
	char path[600];
	const char *peer;
} brun;

static void usage(const bopts *o, FILE *f)
{
	fprintf(f, "Usage: tier-bench %s [--dir DIR] [--size MAX] [--min-size MIN] [--iters N] [--gbps CAP]\n"
		   "                  [--threads N] [--no-uring]\n"
		   "Throughput of the offload engine's %s link over sizes MIN..MAX (x4 steps; default 1M..256M),\n"
		   "best of N runs (default 5), against a peer in the same run. --dir: where the test file goes\n"
		   "(default $TMPDIR or .); --gbps: cap the link (GB/s) as on a slower machine.\n",
		o->cmd, tier_link_name(o->link));
}

static int parse(bopts *o, int argc, char **argv)
{
	static const struct option opts[] = {
		{ "dir", required_argument, 0, 'd' }, { "size", required_argument, 0, 's' },
		{ "min-size", required_argument, 0, 'm' }, { "iters", required_argument, 0, 'i' },
		{ "gbps", required_argument, 0, 'g' }, { "threads", required_argument, 0, 't' },
		{ "no-uring", no_argument, 0, 'U' }, { "help", no_argument, 0, 'h' }, { 0, 0, 0, 0 },
	};
	const char *tmp = getenv("TMPDIR");
	int c;
	snprintf(o->dir, sizeof o->dir, "%s", tmp && *tmp ? tmp : ".");
	o->min_size = 1u << 20;
	o->max_size = 256u << 20;
	o->iters = 5;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'd': snprintf(o->dir, sizeof o->dir, "%s", optarg); break;
		case 's': if (bench_parse_size(o->cmd, "--size", optarg, &o->max_size)) return 1; break;
		case 'm': if (bench_parse_size(o->cmd, "--min-size", optarg, &o->min_size)) return 1; break;
		case 'i': if (bench_parse_uint(o->cmd, "--iters", optarg, &o->iters)) return 1; break;
		case 't': if (bench_parse_uint(o->cmd, "--threads", optarg, &o->threads)) return 1; break;
		case 'g': {
			char *end;
			o->gbps = strtod(optarg, &end);
			if (*end || !(o->gbps > 0)) {
				fprintf(stderr, "tier-bench %s: --gbps needs a positive rate in GB/s, not '%s'\n", o->cmd, optarg);
				return 1;
			}
			break;
		}
		case 'U': o->no_uring = 1; break;
		case 'h': usage(o, stdout); exit(0);
		default: usage(o, stderr); return 1;
		}
	}
	if (bench_no_extra_args(o->cmd, argc, argv))
		return 1;
	if (!o->iters || o->min_size < 4096 || o->min_size > o->max_size || o->max_size % 4096 || o->min_size % 4096) {
		fprintf(stderr, "tier-bench %s: sizes must be multiples of 4 KiB with MIN <= MAX, iters >= 1\n", o->cmd);
		return 1;
	}
	return 0;
}

static int is_file_link(tier_link l)
{
	return l == TIER_LINK_NVME_READ || l == TIER_LINK_NVME_WRITE || l == TIER_LINK_NVME_TO_HBM;
}

static void run_close(brun *r)
{
	tier_offload_destroy(r->off);
	if (r->fd >= 0) {
		close(r->fd);
		unlink(r->path);
	}
	if (r->hbm)
		tier_dev_free(r->dev, r->hbm);
	if (r->host)
		tier_host_free(r->host, 1);
	tier_dev_close(r->dev);
}

static int run_open(brun *r, bopts *o)
{
	tier_offload_config cfg = { 0 };
	int rc;
	memset(r, 0, sizeof *r);
	r->o = o;
	r->fd = -1;
	int cuda = tier_cuda_available();
	if ((rc = tier_dev_open(&r->dev, cuda ? TIER_DEV_CUDA : TIER_DEV_CPU, 0)))
		return rc;
	cfg.dev = r->dev;
	cfg.threads = o->threads;
	cfg.no_uring = o->no_uring;
	cfg.link_gbps[o->link] = o->gbps;
	if ((rc = tier_offload_create(&r->off, &cfg)) || (rc = tier_host_malloc(o->max_size, 1, &r->host)) ||
	    (rc = tier_dev_malloc(r->dev, o->max_size, &r->hbm)))
		return rc;
	tier_pattern_fill(r->host, o->max_size, 7, 0);
	if (!is_file_link(o->link))
		return 0;
	snprintf(r->path, sizeof r->path, "%s/tier-bench-offload-%d", o->dir, (int)getpid());
	r->fd = open(r->path, O_CREAT | O_RDWR | O_DIRECT, 0600);
	r->direct = r->fd >= 0;
	if (r->fd < 0)
		r->fd = open(r->path, O_CREAT | O_RDWR, 0600);
	if (r->fd < 0)
		return tier_fail(-errno, "cannot create %s: %s (pick another --dir)", r->path, strerror(errno));
	if (fallocate(r->fd, 0, 0, (off_t)o->max_size) && ftruncate(r->fd, (off_t)o->max_size))
		return tier_fail(-errno, "cannot size %s to %llu bytes: %s", r->path, (unsigned long long)o->max_size, strerror(errno));
	if ((rc = tier_offload_register_file(r->off, r->fd, &r->fid)))
		return rc;
	/* the file holds data before anything reads it */
	tier_xfer w = { .dst = tier_loc_file(r->fid, 0), .src = tier_loc_host(r->host), .len = o->max_size };
	return tier_offload_copy(r->off, &w);
}

/* Best time (ns) of `iters` engine transfers of `size` bytes on the run's link; negative errno. */
static double engine_best(brun *r, uint64_t size)
{
	tier_xfer x = { .len = size };
	double best = -1;
	switch (r->o->link) {
	case TIER_LINK_H2D: x.src = tier_loc_host(r->host); x.dst = tier_loc_device(r->hbm); break;
	case TIER_LINK_D2H: x.src = tier_loc_device(r->hbm); x.dst = tier_loc_host(r->host); break;
	case TIER_LINK_NVME_READ: x.src = tier_loc_file(r->fid, 0); x.dst = tier_loc_host(r->host); break;
	case TIER_LINK_NVME_WRITE: x.src = tier_loc_host(r->host); x.dst = tier_loc_file(r->fid, 0); break;
	default: x.src = tier_loc_file(r->fid, 0); x.dst = tier_loc_device(r->hbm); break;
	}
	for (unsigned i = 0; i < r->o->iters; i++) {
		uint64_t t0 = tier_now_ns();
		int rc = tier_offload_copy(r->off, &x);
		double t = (double)(tier_now_ns() - t0);
		if (rc)
			return rc;
		if (best < 0 || t < best)
			best = t;
	}
	return best;
}

/* Peer of the HBM links: pinned cudaMemcpyAsync on a stream of its own, or memcpy without a GPU. */
static double peer_copy_best(brun *r, uint64_t size)
{
	double best = -1;
	int d2h = r->o->link == TIER_LINK_D2H;
	void *dst = d2h ? r->host : r->hbm, *src = d2h ? r->hbm : r->host;
#ifdef TIER_HAVE_CUDA
	cudaStream_t s = NULL;
	int cuda = tier_dev_kind_of(r->dev) == TIER_DEV_CUDA;
	if (cuda && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
		return tier_fail(-EIO, "cannot create a CUDA stream for the peer");
#endif
	for (unsigned i = 0; i < r->o->iters; i++) {
		uint64_t t0 = tier_now_ns();
#ifdef TIER_HAVE_CUDA
		if (cuda) {
			if (cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, s) != cudaSuccess ||
			    cudaStreamSynchronize(s) != cudaSuccess) {
				cudaStreamDestroy(s);
				return tier_fail(-EIO, "peer cudaMemcpyAsync failed");
			}
		} else
#endif
			memcpy(dst, src, size);
		__asm__ volatile("" : : "r"(dst) : "memory");
		double t = (double)(tier_now_ns() - t0);
		if (best < 0 || t < best)
			best = t;
	}
#ifdef TIER_HAVE_CUDA
	if (s)
		cudaStreamDestroy(s);
#endif
	return best;
}

/* Run a shell command, capturing up to cap bytes of stdout; returns its exit status or -1. */
static int run_child(const char *cmdline, char *out, size_t cap)
{
	FILE *p = popen(cmdline, "r");
	size_t n = 0;
	if (!p)
		return -1;
	while (out && n + 1 < cap) {
		size_t k = fread(out + n, 1, cap - 1 - n, p);
		if (!k)
			break;
		n += k;
	}
	if (out)
		out[n] = 0;
	int st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#ifdef TIER_HAVE_JANSSON
/* fio's measured bandwidth in bytes/ns of its first job, from --output-format=json. */
static double fio_rate(const char *json, int write)
{
	json_error_t err;
	const char *start = strchr(json, '{'); /* fio may print notes before the JSON */
	json_t *root = start ? json_loads(start, 0, &err) : NULL;
	double rate = -1;
	if (root) {
		json_t *job = json_array_get(json_object_get(root, "jobs"), 0);
		json_t *bw = json_object_get(json_object_get(job, write ? "write" : "read"), "bw_bytes");
		if (json_is_number(bw) && json_number_value(bw) > 0)
			rate = json_number_value(bw) * 1e-9;
		json_decref(root);
	}
	return rate;
}
#endif

/* Peer of the NVMe links: fio (direct I/O, io_uring, the engine's chunk size and queue depth) on the
 * same file, or dd with direct flags timed from here (includes its start-up). Returns the time (ns)
 * one transfer of `size` takes at the measured rate, or a negative value when neither ran. */
static double peer_file_best(brun *r, uint64_t size)
{
	int write = r->o->link == TIER_LINK_NVME_WRITE;
	uint64_t bs = size < (8u << 20) ? size : (8u << 20);
	char cmd[1400];
#ifdef TIER_HAVE_JANSSON
	static char out[1 << 16];
	snprintf(cmd, sizeof cmd,
		 "fio --name=peer --filename='%s' --rw=%s --bs=%llu --size=%llu --loops=%u --iodepth=32 "
		 "--ioengine=io_uring --direct=%d --output-format=json 2>/dev/null",
		 r->path, write ? "write" : "read", (unsigned long long)bs, (unsigned long long)size, r->o->iters,
		 r->direct);
	if (run_child(cmd, out, sizeof out) == 0) {
		double rate = fio_rate(out, write);
		if (rate > 0) {
			r->peer = "fio";
			return (double)size / rate;
		}
	}
#endif
	snprintf(cmd, sizeof cmd, "dd if='%s' of='%s' bs=%llu count=%llu %s status=none 2>/dev/null",
		 write ? "/dev/zero" : r->path, write ? r->path : "/dev/null", (unsigned long long)bs,
		 (unsigned long long)(size / bs), r->direct ? (write ? "oflag=direct conv=notrunc" : "iflag=direct")
							: (write ? "conv=notrunc" : ""));
	double best = -1;
	for (unsigned i = 0; i < r->o->iters; i++) {
		uint64_t t0 = tier_now_ns();
		if (run_child(cmd, NULL, 0) != 0)
			return -1;
		double t = (double)(tier_now_ns() - t0);
		if (best < 0 || t < best)
			best = t;
	}
	r->peer = "dd";
	return best;
}

static const bench_col cols[] = {
	{ "size", "", 9 }, { "count", "", 6 }, { "time", "(us)", 11 }, { "algbw", "(GB/s)", 9 },
	{ "peer_time", "(us)", 11 }, { "peer_bw", "(GB/s)", 9 }, { "ratio", "engine/peer", 12 },
};
#define NCOLS (int)(sizeof cols / sizeof cols[0])

static int bench_link(const char *cmd, tier_link link, int argc, char **argv)
{
	bopts o = { .cmd = cmd, .link = link };
	brun r;
	int rc;
	if ((rc = parse(&o, argc, argv)))
		return rc;
	if ((rc = run_open(&r, &o))) {
		fprintf(stderr, "tier-bench %s: %s\n", cmd, tier_last_error());
		run_close(&r);
		return 2;
	}
	int cuda = tier_dev_kind_of(r.dev) == TIER_DEV_CUDA;
	bench_comment("tier-bench %s: offload engine, link %s, best of %u runs per size", cmd, tier_link_name(link), o.iters);
	bench_comment("device: %s%s; file I/O: %s%s", tier_dev_name(r.dev), cuda ? "" : " (HBM emulated in host memory)",
		      o.no_uring ? "worker threads" : "io_uring when available",
		      is_file_link(link) ? (r.direct ? ", O_DIRECT" : ", buffered (no O_DIRECT here)") : "");
	if (o.gbps > 0)
		bench_comment("link capped at %.3f GB/s (token bucket)", o.gbps);
	bench_comment("algbw = size / time (1 GB = 1e9 B); ratio = engine GB/s / peer GB/s");
	bench_table_header(cols, NCOLS);
	double sum_ratio = 0, best_bw = 0;
	unsigned rows = 0;
	for (uint64_t size = o.min_size; size <= o.max_size; size *= 4) {
		double te = engine_best(&r, size);
		if (te < 0) {
			fprintf(stderr, "tier-bench %s: %s\n", cmd, tier_last_error());
			run_close(&r);
			return 2;
		}
		double tp = is_file_link(link) ? peer_file_best(&r, size) : peer_copy_best(&r, size);
		char c[NCOLS][32];
		const char *cells[NCOLS] = { c[0], c[1], c[2], c[3], c[4], c[5], c[6] };
		bench_fmt_size(size, c[0], sizeof c[0]);
		snprintf(c[1], sizeof c[1], "%u", o.iters);
		bench_fmt_num(te / 1e3, 1, c[2], sizeof c[2]);
		bench_fmt_num(size / te, 2, c[3], sizeof c[3]);
		if (tp > 0) {
			bench_fmt_num(tp / 1e3, 1, c[4], sizeof c[4]);
			bench_fmt_num(size / tp, 2, c[5], sizeof c[5]);
			bench_fmt_num(tp / te, 2, c[6], sizeof c[6]);
			sum_ratio += tp / te;
		} else {
			snprintf(c[4], sizeof c[4], "n/a");
			snprintf(c[5], sizeof c[5], "n/a");
			snprintf(c[6], sizeof c[6], "n/a");
		}
		bench_table_row(cols, NCOLS, cells);
		if (size / te > best_bw)
			best_bw = size / te;
		rows++;
		if (size > o.max_size / 4)
			break;
	}
	const char *peer = is_file_link(link) ? (r.peer ? r.peer : "none (fio and dd failed)")
				      : cuda ? "cudaMemcpyAsync (pinned)" : "memcpy";
	bench_summary("%u sizes; best %.2f GB/s; mean ratio to %s %.2f", rows, best_bw, peer, rows ? sum_ratio / rows : 0);
	run_close(&r);
	return 0;
}

int bench_h2d(int argc, char **argv) { return bench_link("h2d", TIER_LINK_H2D, argc, argv); }
int bench_d2h(int argc, char **argv) { return bench_link("d2h", TIER_LINK_D2H, argc, argv); }
int bench_nvme_read(int argc, char **argv) { return bench_link("nvme-read", TIER_LINK_NVME_READ, argc, argv); }
int bench_nvme_write(int argc, char **argv) { return bench_link("nvme-write", TIER_LINK_NVME_WRITE, argc, argv); }
int bench_nvme_to_hbm(int argc, char **argv) { return bench_link("nvme-to-hbm", TIER_LINK_NVME_TO_HBM, argc, argv); }
