/* store_demo.c - `tier-run --store-demo`: the store demonstration. A synthetic MoE "model" larger
 * than its HBM budget runs a training step's access pattern through the tiered store under each
 * residency policy, verifying every object's contents. (Moved here from tier-run.c, which is now
 * the trainer; the code is unchanged apart from its entry point and usage line.) */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "tier/tier.h"
#include "tier/store.h"
#include "tier/stats.h"

#define DEMO_LINE "tier-run --store-demo: the store demonstration (tier-run without it trains LoRA)"

typedef struct {
	uint64_t hbm, ddr, nvme;
	char nvme_dir[4096];
	int own_dir;           /* 1: we made nvme_dir and remove it */
	unsigned steps, layers, experts, topk;
	int policy;            /* -1: all */
	uint64_t seed;
	int json;
} demo_opts;

typedef struct {
	tier_object **obj;     /* [layer * (experts + 1) + e]; e == experts: the layer's dense weights */
	uint64_t *pseed;       /* pattern seed of each object */
	unsigned n;
	uint64_t obj_size;
	double *zipf_cdf;      /* [layer][rank] cumulative probabilities */
	unsigned *perm;        /* [layer][rank] -> expert: which experts are hot differs per layer */
} demo_model;

static volatile sig_atomic_t stop_sig;
static void on_signal(int sig) { stop_sig = sig; }

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-run --store-demo [options]\n"
		"%s.\n"
		"A synthetic MoE model (layers x experts frozen weights plus a dense object per layer, about\n"
		"4x the HBM budget, part of it spilled to NVMe) runs forward layers 0..L-1 then backward\n"
		"L-1..0 with Zipf-skewed experts per layer, for each residency policy; every acquired\n"
		"object's contents are verified. Prints one row per policy, then the tiers. Publishes its\n"
		"statistics for tier-stat -p PID while it runs.\n"
		"\n"
		"  --hbm SIZE         HBM budget (default 64M; emulated in host memory without a GPU)\n"
		"  --ddr SIZE         DDR budget (default 192M)\n"
		"  --nvme DIR:SIZE    NVMe directory and budget (default a temporary directory under\n"
		"                     $TMPDIR, 1G; removed at the end)\n"
		"  --steps N          training steps per policy (default 6)\n"
		"  --layers N         layers (default 8); --experts N experts per layer (default 16);\n"
		"  --topk K           experts each layer routes to per step (default 4)\n"
		"  --policy P         lru, lfu, cost or schedule (default: all four)\n"
		"  --seed S           seed of the routing and the contents (default: from the clock, printed)\n"
		"  --json             one JSON object per policy instead of the table\n"
		"  --help             this text\n"
		"Sizes take binary units: 64M, 1G, 512k.\n"
		"Exit status: 0 done and every object verified, 1 bad arguments, 2 a store operation or a\n"
		"verification failed (the message says which), 128+N killed by signal N (cleaned up).\n",
		DEMO_LINE);
}

static int parse_nvme(const char *arg, demo_opts *o)
{
	const char *colon = strrchr(arg, ':');
	if (!colon || colon == arg || (size_t)(colon - arg) >= sizeof o->nvme_dir) {
		fprintf(stderr, "tier-run: --nvme needs DIR:SIZE (e.g. --nvme /scratch/tier:8G), not '%s'\n", arg);
		return 1;
	}
	memcpy(o->nvme_dir, arg, (size_t)(colon - arg));
	o->nvme_dir[colon - arg] = 0;
	if (tier_parse_size(colon + 1, &o->nvme) != 0) {
		fprintf(stderr, "tier-run: --nvme: %s\n", tier_last_error());
		return 1;
	}
	return 0;
}

static int parse_count(const char *opt, const char *text, unsigned max, unsigned *out)
{
	char *end;
	unsigned long v = strtoul(text, &end, 10);
	if (*end || end == text || text[0] == '-' || v == 0 || v > max) {
		fprintf(stderr, "tier-run: %s needs a number from 1 to %u, not '%s'\n", opt, max, text);
		return 1;
	}
	*out = (unsigned)v;
	return 0;
}

static int parse_args(int argc, char **argv, demo_opts *o)
{
	static const struct option opts[] = {
		{ "hbm", required_argument, NULL, 'H' }, { "ddr", required_argument, NULL, 'D' },
		{ "nvme", required_argument, NULL, 'N' }, { "steps", required_argument, NULL, 's' },
		{ "layers", required_argument, NULL, 'L' }, { "experts", required_argument, NULL, 'E' },
		{ "topk", required_argument, NULL, 'k' }, { "policy", required_argument, NULL, 'P' },
		{ "seed", required_argument, NULL, 'S' }, { "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	int c;
	char *end;
	tier_policy_kind p;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		int bad = 0;
		switch (c) {
		case 'H': bad = tier_parse_size(optarg, &o->hbm) != 0; break;
		case 'D': bad = tier_parse_size(optarg, &o->ddr) != 0; break;
		case 'N': if (parse_nvme(optarg, o)) return 1; break;
		case 's': if (parse_count("--steps", optarg, 100000, &o->steps)) return 1; break;
		case 'L': if (parse_count("--layers", optarg, 4096, &o->layers)) return 1; break;
		case 'E': if (parse_count("--experts", optarg, 1024, &o->experts)) return 1; break;
		case 'k': if (parse_count("--topk", optarg, 1024, &o->topk)) return 1; break;
		case 'P': bad = tier_policy_parse(optarg, &p) != 0; o->policy = (int)p; break;
		case 'S':
			o->seed = strtoull(optarg, &end, 0);
			if (*end || end == optarg) {
				fprintf(stderr, "tier-run: --seed needs a number, not '%s'\n", optarg);
				return 1;
			}
			break;
		case 'j': o->json = 1; break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); return 1;
		}
		if (bad) {
			fprintf(stderr, "tier-run: %s\n", tier_last_error());
			return 1;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "tier-run: unexpected argument '%s' (see tier-run --help)\n", argv[optind]);
		return 1;
	}
	if (o->topk > o->experts) {
		fprintf(stderr, "tier-run: --topk %u is more than --experts %u\n", o->topk, o->experts);
		return 1;
	}
	if (o->hbm < 4096 || o->ddr < 4096) {
		fprintf(stderr, "tier-run: --hbm and --ddr must be at least 4k\n");
		return 1;
	}
	return 0;
}

/* ---- The synthetic model ---------------------------------------------------------------------- */

static void model_free(demo_model *m)
{
	free(m->obj);
	free(m->pseed);
	free(m->zipf_cdf);
	free(m->perm);
	memset(m, 0, sizeof *m);
}

/* Zipf(1.2) over each layer's experts, in a per-layer random order. */
static int model_routing(demo_model *m, const demo_opts *o, tier_rng *r)
{
	unsigned L = o->layers, E = o->experts;
	m->zipf_cdf = calloc((size_t)L * E, sizeof *m->zipf_cdf);
	m->perm = calloc((size_t)L * E, sizeof *m->perm);
	if (!m->zipf_cdf || !m->perm)
		return tier_fail(-ENOMEM, "out of memory for the routing tables");
	for (unsigned l = 0; l < L; l++) {
		double sum = 0, *cdf = m->zipf_cdf + (size_t)l * E;
		unsigned *perm = m->perm + (size_t)l * E;
		for (unsigned e = 0; e < E; e++) {
			sum += 1.0 / pow(e + 1, 1.2);
			cdf[e] = sum;
			perm[e] = e;
		}
		for (unsigned e = 0; e < E; e++)
			cdf[e] /= sum;
		for (unsigned e = E; e > 1; e--) {
			unsigned j = (unsigned)tier_rng_below(r, e), t = perm[e - 1];
			perm[e - 1] = perm[j];
			perm[j] = t;
		}
	}
	return 0;
}

/* Create the objects and fill each with its pattern (in DDR; what does not fit spills to NVMe). */
static int model_create(tier_store *s, demo_model *m, const demo_opts *o)
{
	unsigned per = o->experts + 1;
	int rc;
	m->n = o->layers * per;
	/* ~4x the HBM budget in all, in 4 KiB multiples (NVMe extents). */
	m->obj_size = tier_align_up(4 * o->hbm / m->n, 4096);
	m->obj = calloc(m->n, sizeof *m->obj);
	m->pseed = calloc(m->n, sizeof *m->pseed);
	if (!m->obj || !m->pseed)
		return tier_fail(-ENOMEM, "out of memory for %u objects", m->n);
	for (unsigned i = 0; i < m->n && !stop_sig; i++) {
		void *addr;
		tier_class cls = i % per == o->experts ? TIER_CLASS_DENSE : TIER_CLASS_EXPERT;
		if ((rc = tier_obj_create(s, m->obj_size, cls, TIER_OBJ_FROZEN, &m->obj[i])) != 0)
			return rc;
		m->pseed[i] = o->seed * 1000003u + i;
		if ((rc = tier_acquire(s, m->obj[i], TIER_DDR, TIER_ACQ_INIT, &addr, NULL)) != 0)
			return rc;
		tier_pattern_fill(addr, m->obj_size, m->pseed[i], 0);
		if ((rc = tier_release(s, m->obj[i], TIER_DDR, 1)) != 0)
			return rc;
	}
	return 0;
}

/* This step's experts of layer l: topk distinct draws from the layer's Zipf distribution. */
static void route_layer(const demo_model *m, const demo_opts *o, unsigned l, tier_rng *r, unsigned *out)
{
	const double *cdf = m->zipf_cdf + (size_t)l * o->experts;
	unsigned n = 0;
	while (n < o->topk) {
		double u = tier_rng_uniform(r);
		unsigned rank = 0, e, dup = 0;
		while (rank + 1 < o->experts && cdf[rank] < u)
			rank++;
		e = m->perm[(size_t)l * o->experts + rank];
		for (unsigned i = 0; i < n; i++)
			dup |= out[i] == e;
		if (!dup)
			out[n++] = e;
	}
}

/* One training step: route, hand the store the step's schedule (forward 0..L-1, backward L-1..0,
 * each op needing the layer's dense object and its experts), then run it, verifying every object. */
static int run_step(tier_store *s, demo_model *m, const demo_opts *o, tier_rng *r, uint64_t *ids,
		    tier_sched_op *ops, unsigned *route)
{
	unsigned L = o->layers, per = o->experts + 1, k1 = o->topk + 1;
	int rc;
	for (unsigned l = 0; l < L; l++) {
		route_layer(m, o, l, r, route + (size_t)l * o->topk);
		uint64_t *id = ids + (size_t)l * k1;
		id[0] = tier_obj_id(m->obj[l * per + o->experts]);
		for (unsigned j = 0; j < o->topk; j++)
			id[1 + j] = tier_obj_id(m->obj[l * per + route[(size_t)l * o->topk + j]]);
	}
	for (unsigned i = 0; i < 2 * L; i++) {
		unsigned l = i < L ? i : 2 * L - 1 - i;
		ops[i] = (tier_sched_op){ ids + (size_t)l * k1, k1, TIER_HBM };
	}
	if ((rc = tier_store_set_schedule(s, ops, 2 * L, 0)) != 0)
		return rc;
	for (unsigned i = 0; i < 2 * L && !stop_sig; i++) {
		unsigned l = i < L ? i : 2 * L - 1 - i;
		tier_store_at_op(s, i);
		for (unsigned j = 0; j < k1; j++) {
			unsigned idx = l * per + (j == 0 ? o->experts : route[(size_t)l * o->topk + j - 1]);
			void *addr;
			size_t bad;
			if ((rc = tier_acquire(s, m->obj[idx], TIER_HBM, 0, &addr, NULL)) != 0)
				return rc;
			bad = tier_pattern_check(addr, m->obj_size, m->pseed[idx], 0);
			tier_release(s, m->obj[idx], TIER_HBM, 0);
			if (bad != m->obj_size)
				return tier_fail(-EBADMSG, "layer %u object %u: byte %zu of %llu differs from what was written "
						 "(the store returned wrong contents)", l, idx, bad,
						 (unsigned long long)m->obj_size);
		}
	}
	tier_store_step(s);
	return 0;
}

/* ---- Results ---------------------------------------------------------------------------------- */

typedef struct {
	uint64_t hits, misses, evictions, writebacks, link[TIER_STATS_NLINKS];
	uint64_t pf_on_time, pf_needs;
	double seconds;
} demo_result;

static void result_of(const tier_stats *a, const tier_stats *b, double secs, demo_result *res)
{
	memset(res, 0, sizeof *res);
	for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
		res->hits += b->cls[TIER_HBM][c].hits - a->cls[TIER_HBM][c].hits;
		res->misses += b->cls[TIER_HBM][c].misses - a->cls[TIER_HBM][c].misses;
		for (int t = 0; t < TIER_STATS_NTIERS; t++) {
			res->evictions += b->cls[t][c].evictions - a->cls[t][c].evictions;
			res->writebacks += b->cls[t][c].writebacks - a->cls[t][c].writebacks;
		}
	}
	for (int l = 0; l < TIER_STATS_NLINKS; l++)
		res->link[l] = b->link[l].bytes - a->link[l].bytes;
	res->pf_on_time = b->prefetch.on_time - a->prefetch.on_time;
	res->pf_needs = res->pf_on_time + (b->prefetch.late - a->prefetch.late) +
			(b->prefetch.missed - a->prefetch.missed);
	res->seconds = secs;
}

/* Links shown in the table (MiB moved during the steps); JSON has all of them. */
static const int shown[] = { 0, 1, 2, 3, 4 };
static const char *const shown_head[] = { "h2d", "d2h", "nvme-rd", "nvme-wr", "nvme>hbm" };

static void print_table_header(void)
{
	printf("%-8s %8s %8s %6s %8s %6s", "policy", "hits", "misses", "hit%", "evict", "wback");
	for (size_t i = 0; i < sizeof shown / sizeof *shown; i++)
		printf(" %8s", shown_head[i]);
	printf(" %7s %7s\n", "ontime%", "time");
	printf("%-8s %8s %8s %6s %8s %6s", "", "", "", "%", "", "");
	for (size_t i = 0; i < sizeof shown / sizeof *shown; i++)
		printf(" %8s", "MiB");
	printf(" %7s %7s\n", "%", "s");
}

static double pct(uint64_t a, uint64_t b) { return b ? 100.0 * (double)a / (double)b : 0; }

static void print_result(const char *policy, const demo_result *r, const tier_stats *st, int json)
{
	if (json) {
		printf("{\"policy\":\"%s\",\"hits\":%llu,\"misses\":%llu,\"hit_pct\":%.2f,\"evictions\":%llu,"
		       "\"writebacks\":%llu,\"links\":{", policy, (unsigned long long)r->hits,
		       (unsigned long long)r->misses, pct(r->hits, r->hits + r->misses),
		       (unsigned long long)r->evictions, (unsigned long long)r->writebacks);
		for (int l = 0; l < TIER_STATS_NLINKS; l++)
			printf("%s\"%s\":%llu", l ? "," : "", st->link_name[l][0] ? st->link_name[l] : "?",
			       (unsigned long long)r->link[l]);
		printf("},\"prefetch_on_time_pct\":%.2f,\"seconds\":%.3f}\n", pct(r->pf_on_time, r->pf_needs), r->seconds);
		return;
	}
	printf("%-8s %8llu %8llu %6.1f %8llu %6llu", policy, (unsigned long long)r->hits,
	       (unsigned long long)r->misses, pct(r->hits, r->hits + r->misses), (unsigned long long)r->evictions,
	       (unsigned long long)r->writebacks);
	for (size_t i = 0; i < sizeof shown / sizeof *shown; i++)
		printf(" %8.1f", (double)r->link[shown[i]] / (1 << 20));
	printf(" %7.1f %7.2f\n", pct(r->pf_on_time, r->pf_needs), r->seconds);
	fflush(stdout);
}

static void print_tiers(const tier_stats *st, const demo_opts *o, int json)
{
	char a[32], b[32];
	if (json) {
		printf("{\"tiers\":[");
		for (int t = 0; t < TIER_STATS_NTIERS; t++)
			printf("%s{\"name\":\"%s\",\"capacity\":%llu,\"peak\":%llu}", t ? "," : "", st->tier_name[t],
			       (unsigned long long)st->tier[t].capacity, (unsigned long long)st->tier[t].peak);
		printf("],\"objects\":%llu,\"object_bytes\":%llu,\"seed\":%llu}\n", (unsigned long long)st->objects,
		       (unsigned long long)st->object_bytes, (unsigned long long)o->seed);
		return;
	}
	printf("tiers:");
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		if (!st->tier[t].capacity)
			continue;
		printf("%s %s %s (peak %s)", t ? "," : "", st->tier_name[t],
		       tier_format_size(st->tier[t].capacity, a, sizeof a), tier_format_size(st->tier[t].peak, b, sizeof b));
	}
	printf("; model %llu objects, %s\n", (unsigned long long)st->objects,
	       tier_format_size(st->object_bytes, a, sizeof a));
}

/* ---- One policy ------------------------------------------------------------------------------- */

static int run_policy(const demo_opts *o, tier_policy_kind pol, tier_stats *final)
{
	const char *dirs[1] = { o->nvme_dir };
	tier_store_config cfg = {
		.capacity = { o->hbm, o->ddr, o->nvme }, .nvme_dirs = dirs, .n_nvme_dirs = 1, .policy = pol,
		.clamp_budgets = 1, .publish_stats = 1,
	};
	tier_store *s = NULL;
	demo_model m = { 0 };
	tier_stats before, after;
	tier_rng r;
	uint64_t *ids = NULL, t0;
	tier_sched_op *ops = NULL;
	unsigned *route = NULL;
	demo_result res;
	int rc;

	tier_rng_seed(&r, o->seed);
	if ((rc = tier_store_create(&s, &cfg)) != 0)
		return rc;
	tier_store_set_job(s, "store demo");
	ids = calloc((size_t)o->layers * (o->topk + 1), sizeof *ids);
	ops = calloc(2 * (size_t)o->layers, sizeof *ops);
	route = calloc((size_t)o->layers * o->topk, sizeof *route);
	if (!ids || !ops || !route) {
		rc = tier_fail(-ENOMEM, "out of memory for the schedule");
		goto out;
	}
	if ((rc = model_routing(&m, o, &r)) != 0 || (rc = model_create(s, &m, o)) != 0)
		goto out;
	tier_store_stats(s, &before);
	t0 = tier_now_ns();
	for (unsigned step = 0; step < o->steps && !stop_sig && rc == 0; step++)
		rc = run_step(s, &m, o, &r, ids, ops, route);
	if (rc == 0 && !stop_sig)
		rc = tier_store_check(s);
	if (rc == 0 && !stop_sig) {
		tier_store_stats(s, &after);
		result_of(&before, &after, (double)(tier_now_ns() - t0) / 1e9, &res);
		print_result(tier_policy_name(pol), &res, &after, o->json);
		*final = after;
	}
out:
	free(ids);
	free(ops);
	free(route);
	model_free(&m);
	tier_store_destroy(s);
	return rc;
}

static int make_temp_dir(demo_opts *o)
{
	const char *base = getenv("TMPDIR");
	snprintf(o->nvme_dir, sizeof o->nvme_dir, "%s/tier-run.XXXXXX", base && *base ? base : P_tmpdir);
	if (!mkdtemp(o->nvme_dir)) {
		fprintf(stderr, "tier-run: cannot make a directory for the NVMe tier under %s: %s (set TMPDIR or "
			"use --nvme DIR:SIZE)\n", base && *base ? base : P_tmpdir, strerror(errno));
		return 1;
	}
	o->own_dir = 1;
	return 0;
}

int store_demo_main(int argc, char **argv);
int store_demo_main(int argc, char **argv)
{
	demo_opts o = { .hbm = 64ull << 20, .ddr = 192ull << 20, .nvme = 1ull << 30, .steps = 6, .layers = 8,
			.experts = 16, .topk = 4, .policy = -1, .seed = tier_now_ns() % 1000000 };
	tier_stats final;
	int rc = 0;

	if (parse_args(argc, argv, &o))
		return 1;
	if (!o.nvme_dir[0] && make_temp_dir(&o))
		return 2;
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	if (!o.json) {
		char a[32], b[32], c[32];
		printf("%s\n", DEMO_LINE);
		printf("# pid %ld, seed %llu, %u layers x %u experts (top-%u) + 1 dense object per layer, %u steps per "
		       "policy; budgets hbm %s, ddr %s, nvme %s\n", (long)getpid(), (unsigned long long)o.seed, o.layers,
		       o.experts, o.topk, o.steps, tier_format_size(o.hbm, a, sizeof a),
		       tier_format_size(o.ddr, b, sizeof b), tier_format_size(o.nvme, c, sizeof c));
		print_table_header();
	} else {
		fprintf(stderr, "%s\n", DEMO_LINE); /* stdout stays pure JSON */
	}
	fflush(stdout);
	for (int p = 0; p < TIER_NPOLICIES && rc == 0 && !stop_sig; p++)
		if (o.policy < 0 || o.policy == p)
			rc = run_policy(&o, (tier_policy_kind)p, &final);
	if (rc == 0 && !stop_sig)
		print_tiers(&final, &o, o.json);
	if (o.own_dir)
		rmdir(o.nvme_dir);
	if (stop_sig) {
		fprintf(stderr, "tier-run: stopped by signal %d (store and files removed)\n", (int)stop_sig);
		return 128 + stop_sig;
	}
	if (rc) {
		fprintf(stderr, "tier-run: %s (%s)\n", tier_last_error(), tier_strerror(rc));
		return 2;
	}
	return 0;
}
