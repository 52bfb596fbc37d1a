/* bench_store.c - tier-bench store: what an acquire+release costs when it hits, per tier, and when
 * it misses, per source->target, against memcpy of the same size measured in the same run. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tier/tier.h"
#include "tier/store.h"
#include "tools/bench.h"

typedef struct {
	uint64_t hbm, ddr, nvme;
	char dir[4096];
	int own_dir;
	unsigned runs;
} store_opts;

typedef struct {
	tier_store *s;
	tier_object *o;
	uint64_t size;
	tier_id src, dst;
	unsigned ops;      /* operations per timed run */
	void *a, *b;       /* memcpy peer buffers */
	int rc;
} store_case;

static const char *const cmd = "store";

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench store [--hbm SIZE] [--ddr SIZE] [--nvme DIR:SIZE] [--iters N]\n"
		"Cost of tier_acquire+tier_release of one object: a hit in HBM and in DDR (ns per op), and a\n"
		"miss per source->target (ddr>hbm, nvme>hbm, nvme>ddr: time per op and GB/s), for objects of\n"
		"4 KiB, 1 MiB and 64 MiB where the budgets allow. Each figure is the median of N timed runs;\n"
		"a run times 10000 hits, or 16 misses (4 for sizes of 1 MiB and more, 1 for 64 MiB). Misses\n"
		"are compared with memcpy of the same size between two host buffers, measured in the same\n"
		"run (the peer: a miss cannot be faster than the copy it does). HBM is emulated in host\n"
		"memory without a GPU (named so in the output).\n"
		"\n"
		"  --hbm SIZE       HBM budget (default 192M)\n"
		"  --ddr SIZE       DDR budget (default 256M)\n"
		"  --nvme DIR:SIZE  NVMe directory and budget (default a temporary directory under $TMPDIR,\n"
		"                   512M; removed at the end)\n"
		"  --iters N        timed runs per figure, of which the median is shown (default 5)\n"
		"  --help           this text\n"
		"Exit status: 0 done, 1 bad arguments, 2 a store operation failed (message on stderr).\n");
}

static int parse(int argc, char **argv, store_opts *o)
{
	static const struct option opts[] = {
		{ "hbm", required_argument, NULL, 'H' }, { "ddr", required_argument, NULL, 'D' },
		{ "nvme", required_argument, NULL, 'N' }, { "iters", required_argument, NULL, 'i' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'H': if (bench_parse_size(cmd, "--hbm", optarg, &o->hbm)) return 1; break;
		case 'D': if (bench_parse_size(cmd, "--ddr", optarg, &o->ddr)) return 1; break;
		case 'N': {
			const char *colon = strrchr(optarg, ':');
			if (!colon || colon == optarg || (size_t)(colon - optarg) >= sizeof o->dir) {
				fprintf(stderr, "tier-bench store: --nvme needs DIR:SIZE, not '%s'\n", optarg);
				return 1;
			}
			memcpy(o->dir, optarg, (size_t)(colon - optarg));
			o->dir[colon - optarg] = 0;
			if (bench_parse_size(cmd, "--nvme", colon + 1, &o->nvme))
				return 1;
			break;
		}
		case 'i': if (bench_parse_uint(cmd, "--iters", optarg, &o->runs)) return 1; break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args("store", argc, argv))
		return 1;
	return 0;
}

/* ---- Timed runs (each returns ns per op, or a negative errno) ---- */

static double run_hits(void *arg)
{
	store_case *c = arg;
	void *addr;
	uint64_t t0 = tier_now_ns();
	for (unsigned i = 0; i < c->ops; i++) {
		int rc = tier_acquire(c->s, c->o, c->dst, 0, &addr, NULL);
		if (rc == 0)
			rc = tier_release(c->s, c->o, c->dst, 0);
		if (rc)
			return c->rc = rc;
	}
	return (double)(tier_now_ns() - t0) / c->ops;
}

/* Each miss: move the object so its only copy is in the source (untimed), then time the acquire. */
static double run_misses(void *arg)
{
	store_case *c = arg;
	uint64_t total = 0;
	void *addr;
	int rc;
	for (unsigned i = 0; i < c->ops; i++) {
		if ((rc = tier_migrate(c->s, c->o, c->src)) != 0)
			return c->rc = rc;
		uint64_t t0 = tier_now_ns();
		if ((rc = tier_acquire(c->s, c->o, c->dst, 0, &addr, NULL)) != 0)
			return c->rc = rc;
		total += tier_now_ns() - t0;
		if ((rc = tier_release(c->s, c->o, c->dst, 0)) != 0)
			return c->rc = rc;
	}
	return (double)total / c->ops;
}

static double run_memcpy(void *arg)
{
	store_case *c = arg;
	uint64_t t0 = tier_now_ns();
	for (unsigned i = 0; i < c->ops; i++) {
		memcpy(c->b, c->a, c->size);
		__asm__ volatile("" : : "r"(c->b) : "memory"); /* keep the copy */
	}
	return (double)(tier_now_ns() - t0) / c->ops;
}

static const bench_col cols[] = {
	{ "op", "", 5 }, { "path", "", 14 }, { "size", "", 8 }, { "runs", "", 5 }, { "time", "per op", 10 },
	{ "rate", "GB/s", 8 }, { "memcpy", "GB/s", 8 }, { "vs", "memcpy", 7 },
};
#define NCOLS ((int)(sizeof cols / sizeof cols[0]))

typedef struct {
	double worst_hit_ns;
	double worst_ratio;
	unsigned rows;
} store_summary;

/* One row: a hit (src == dst) or a miss src->dst for an object of `size`. */
static int bench_case(tier_store *s, const store_opts *o, uint64_t size, tier_id src, tier_id dst,
		      const char *hbm_name, store_summary *sum)
{
	store_case c = { .s = s, .size = size, .src = src, .dst = dst };
	char cells[NCOLS][32], path[32];
	const char *cp[NCOLS];
	double t, peer = -1;
	void *addr;
	int rc, hit = src == dst;

	if ((rc = tier_obj_create(s, size, TIER_CLASS_LORA, 0, &c.o)) != 0)
		return rc;
	if ((rc = tier_acquire(s, c.o, dst, TIER_ACQ_INIT, &addr, NULL)) != 0)
		goto out;
	tier_pattern_fill(addr, size, size, 0);
	if ((rc = tier_release(s, c.o, dst, 1)) != 0)
		goto out;
	c.ops = hit ? 10000 : size >= (64u << 20) ? 1 : size >= (1u << 20) ? 4 : 16;
	t = bench_median_run(hit ? run_hits : run_misses, &c, o->runs);
	if (t < 0) {
		rc = c.rc ? c.rc : (int)t;
		goto out;
	}
	if (!hit) {
		if ((rc = tier_host_malloc(size, 0, &c.a)) != 0 || (rc = tier_host_malloc(size, 0, &c.b)) != 0)
			goto out;
		memset(c.a, 1, size);
		memset(c.b, 2, size);
		peer = bench_median_run(run_memcpy, &c, o->runs);
	}
	if (hit)
		snprintf(path, sizeof path, "%s", dst == TIER_HBM ? hbm_name : tier_name(dst));
	else
		snprintf(path, sizeof path, "%s>%s", tier_name(src), tier_name(dst));
	bench_fmt_size(size, cells[2], sizeof cells[2]);
	snprintf(cells[0], 32, "%s", hit ? "hit" : "miss");
	snprintf(cells[1], 32, "%s", path);
	snprintf(cells[3], 32, "%u", o->runs);
	bench_fmt_time(t, cells[4], 32);
	bench_fmt_gbps(hit ? -1 : (double)size / t, cells[5], 32);
	bench_fmt_gbps(hit ? -1 : (double)size / peer, cells[6], 32);
	if (hit)
		snprintf(cells[7], 32, "-");
	else
		snprintf(cells[7], 32, "%.2fx", peer / t);
	for (int i = 0; i < NCOLS; i++)
		cp[i] = cells[i];
	bench_table_row(cols, NCOLS, cp);
	if (hit && t > sum->worst_hit_ns)
		sum->worst_hit_ns = t;
	if (!hit && peer / t > sum->worst_ratio)
		sum->worst_ratio = peer / t;
	sum->rows++;
out:
	tier_host_free(c.a, 0);
	tier_host_free(c.b, 0);
	tier_obj_destroy(s, c.o);
	return rc;
}

static int bench_all(tier_store *s, const store_opts *o, const char *hbm_name)
{
	static const uint64_t sizes[] = { 4096, 1u << 20, 64u << 20 };
	static const struct { tier_id src, dst; } paths[] = {
		{ TIER_HBM, TIER_HBM }, { TIER_DDR, TIER_DDR },
		{ TIER_DDR, TIER_HBM }, { TIER_NVME, TIER_HBM }, { TIER_NVME, TIER_DDR },
	};
	store_summary sum = { 0, 0, 0 };
	char a[32];
	int rc;
	bench_table_header(cols, NCOLS);
	for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
		/* An object must fit its tiers with room for the allocator's alignment. */
		if (sizes[z] > o->hbm / 2 || sizes[z] > o->ddr / 2 || sizes[z] > o->nvme / 2) {
			bench_comment("%s skipped: larger than half of a budget", bench_fmt_size(sizes[z], a, sizeof a));
			continue;
		}
		for (size_t p = 0; p < sizeof paths / sizeof *paths; p++)
			if ((rc = bench_case(s, o, sizes[z], paths[p].src, paths[p].dst, hbm_name, &sum)) != 0)
				return rc;
	}
	bench_summary("%u rows; slowest hit %.1f ns per acquire+release (%s 1 us); misses reach at best "
		      "%.2fx of memcpy", sum.rows, sum.worst_hit_ns, sum.worst_hit_ns < 1000 ? "under" : "OVER",
		      sum.worst_ratio);
	return 0;
}

int bench_store(int argc, char **argv)
{
	store_opts o = { .hbm = 192ull << 20, .ddr = 256ull << 20, .nvme = 512ull << 20, .runs = 5 };
	tier_store *s = NULL;
	tier_stats st;
	const char *dirs[1];
	char a[32], b[32], c[32];
	int rc;

	if (parse(argc, argv, &o))
		return 1;
	if (!o.dir[0]) {
		const char *base = getenv("TMPDIR");
		snprintf(o.dir, sizeof o.dir, "%s/tier-bench.XXXXXX", base && *base ? base : P_tmpdir);
		if (!mkdtemp(o.dir)) {
			fprintf(stderr, "tier-bench store: cannot make a directory under %s: %s (set TMPDIR or use "
				"--nvme DIR:SIZE)\n", base && *base ? base : P_tmpdir, strerror(errno));
			return 2;
		}
		o.own_dir = 1;
	}
	dirs[0] = o.dir;
	tier_store_config cfg = { .capacity = { o.hbm, o.ddr, o.nvme }, .nvme_dirs = dirs, .n_nvme_dirs = 1,
				  .policy = TIER_POLICY_LRU, .clamp_budgets = 1 };
	rc = tier_store_create(&s, &cfg);
	if (rc == 0) {
		tier_store_stats(s, &st);
		bench_comment("tier-bench store: acquire+release of one object, hits per tier and misses per path");
		bench_comment("tiers: %s %s, ddr %s, nvme %s; median of %u runs per row", st.tier_name[TIER_HBM],
			      tier_format_size(o.hbm, a, sizeof a), tier_format_size(o.ddr, b, sizeof b),
			      tier_format_size(o.nvme, c, sizeof c), o.runs);
		rc = bench_all(s, &o, st.tier_name[TIER_HBM]);
	}
	tier_store_destroy(s);
	if (o.own_dir)
		rmdir(o.dir);
	if (rc) {
		fprintf(stderr, "tier-bench store: %s (%s)\n", tier_last_error(), tier_strerror(rc));
		return 2;
	}
	return 0;
}
