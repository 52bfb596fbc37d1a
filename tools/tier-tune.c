/* tier-tune.c - replay a store access trace (tier-run --trace) against policies and capacities:
 * hit rates, bytes per link, predicted stall without and with prefetch overlap, step time, and the
 * gap to Belady's MIN; recommends a policy and an HBM/DDR split. Model and limits: docs/trace.md. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "tune_sim.h"

#define MAXSIZES 32
#define MAXWINDOW 1024

typedef struct {
	uint64_t hbm[MAXSIZES], ddr[MAXSIZES], total;
	int nhbm, nddr, json, pol[SIM_NPOL];
	double op_ms, step_s; /* compute per operation / per step; < 0: not given */
	uint32_t steps;       /* the trace's */
	sim_config sc;
} options;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-tune TRACE --hbm SIZES --ddr SIZES [--policy LIST] [--link-gbps PCIE,NVME]\n"
		"                 [--half-life STEPS] [--op-ms MS | --step-s S] [--window N] [--total SIZE]\n"
		"                 [--json] [--help]\n"
		"Replays the acquires of a trace recorded by `tier-run --trace TRACE` through a model of the\n"
		"store's HBM and DDR caches (NVMe below, unbounded) for each capacity pair and policy, and\n"
		"reports hits, hit rate, bytes per link, predicted stall and the gap to Belady's MIN.\n"
		"  --hbm SIZES, --ddr SIZES  comma-separated capacities (binary units: 8M,12M,16M)\n"
		"  --policy LIST             lru,lfu,cost,schedule (default all; min is always run)\n"
		"  --link-gbps PCIE,NVME     link rates in GB/s (default 55,6)\n"
		"  --half-life STEPS         LFU/cost decay, as the store's (default 4)\n"
		"  --op-ms MS                compute time of one operation, in ms (traces carry no times)\n"
		"  --step-s S                compute time of one step, in s: MS = S x steps / operations\n"
		"  --window N                prefetch window in operations, as tier-run --prefetch-window\n"
		"                            (default 2; 0: demand fetches only; at most %d)\n"
		"  --total SIZE              recommend only splits with HBM + DDR <= SIZE\n"
		"  --json                    one JSON object instead of the tables\n"
		"Operations: the accesses between two tier_store_at_op calls of the trace (a step's start and\n"
		"the trace's start open one too). T(i) = bytes operation i moves / link rate (PCIe and NVMe\n"
		"in series); C = the compute time of an operation.\n"
		"  stall s    no overlap, whole trace: sum of T(i), transfers never overlap compute\n"
		"  overlap s  with prefetch, whole trace (needs --op-ms or --step-s): sum of stall(i).\n"
		"             Operation i's transfer is issued when operation k starts, the earliest k\n"
		"             in i-N..i-1 whose held objects plus the data of k+1..i fit in HBM (else\n"
		"             when i starts); the link moves one transfer at a time, in order:\n"
		"             ready(i) = max(issue(i), ready of the transfer before) + T(i),\n"
		"             stall(i) = max(0, ready(i) - start(i)), start(i+1) = start(i) + stall(i) + C\n"
		"  step ms    predicted step time: (operations x C + overlap stall) / steps\n"
		"The recommendation minimizes the overlap stall when the compute time is given, else the\n"
		"no-overlap stall. Exit status: 0 done, 1 bad arguments or a bad trace. Model and limits:\n"
		"docs/trace.md.\n", MAXWINDOW);
}

static int parse_sizes(const char *opt, const char *text, uint64_t *out, int *n)
{
	char buf[1024], *save = NULL;
	if (strlen(text) >= sizeof buf)
		return fprintf(stderr, "tier-tune: --%s: list too long\n", opt), 1;
	strcpy(buf, text);
	*n = 0;
	for (char *p = strtok_r(buf, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
		if (*n == MAXSIZES)
			return fprintf(stderr, "tier-tune: --%s: at most %d sizes\n", opt, MAXSIZES), 1;
		if (tier_parse_size(p, &out[*n]) || !out[*n])
			return fprintf(stderr, "tier-tune: --%s: '%s' is not a size > 0 (%s)\n", opt, p, tier_last_error()), 1;
		(*n)++;
	}
	return *n ? 0 : (fprintf(stderr, "tier-tune: --%s needs sizes such as 8M,16M\n", opt), 1);
}

static int parse_policies(const char *text, int *pol)
{
	char buf[256], *save = NULL;
	if (strlen(text) >= sizeof buf)
		return fprintf(stderr, "tier-tune: --policy: list too long\n"), 1;
	strcpy(buf, text);
	memset(pol, 0, SIM_NPOL * sizeof *pol);
	for (char *p = strtok_r(buf, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
		int k = 0;
		while (k < SIM_SCHEDULE + 1 && strcmp(p, sim_policy_name((sim_policy)k)))
			k++;
		if (k > SIM_SCHEDULE)
			return fprintf(stderr, "tier-tune: --policy: '%s' is not lru, lfu, cost or schedule\n", p), 1;
		pol[k] = 1;
	}
	pol[SIM_MIN] = 1;
	return 0;
}

static int parse_args(options *o, int argc, char **argv)
{
	static const struct option lo[] = {
		{ "hbm", 1, 0, 'H' }, { "ddr", 1, 0, 'D' }, { "policy", 1, 0, 'p' }, { "link-gbps", 1, 0, 'l' },
		{ "half-life", 1, 0, 'L' }, { "total", 1, 0, 't' }, { "json", 0, 0, 'j' }, { "help", 0, 0, 'h' },
		{ "op-ms", 1, 0, 'o' }, { "step-s", 1, 0, 's' }, { "window", 1, 0, 'w' }, { 0, 0, 0, 0 },
	};
	int c;
	char *end;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (c) {
		case 'H': if (parse_sizes("hbm", optarg, o->hbm, &o->nhbm)) return 1; break;
		case 'D': if (parse_sizes("ddr", optarg, o->ddr, &o->nddr)) return 1; break;
		case 'p': if (parse_policies(optarg, o->pol)) return 1; break;
		case 'l':
			if (sscanf(optarg, "%lf,%lf", &o->sc.gbps[0], &o->sc.gbps[1]) != 2 || !(o->sc.gbps[0] > 0) ||
			    !(o->sc.gbps[1] > 0) || !isfinite(o->sc.gbps[0]) || !isfinite(o->sc.gbps[1]))
				return fprintf(stderr, "tier-tune: --link-gbps needs two positive rates PCIE,NVME, not '%s'\n", optarg), 1;
			break;
		case 'L':
			o->sc.half_life = strtod(optarg, &end);
			if (*end || end == optarg || !(o->sc.half_life > 0))
				return fprintf(stderr, "tier-tune: --half-life needs a positive number of steps, not '%s'\n", optarg), 1;
			break;
		case 't':
			if (tier_parse_size(optarg, &o->total))
				return fprintf(stderr, "tier-tune: --total: %s\n", tier_last_error()), 1;
			break;
		case 'o':
		case 's': {
			double v = strtod(optarg, &end);
			if (*end || end == optarg || !(v >= 0) || !isfinite(v))
				return fprintf(stderr, "tier-tune: --%s needs a time >= 0, not '%s'\n",
					       c == 'o' ? "op-ms" : "step-s", optarg), 1;
			*(c == 'o' ? &o->op_ms : &o->step_s) = v;
			break;
		}
		case 'w': {
			unsigned long v = strtoul(optarg, &end, 10);
			if (*end || end == optarg || *optarg == '-' || v > MAXWINDOW)
				return fprintf(stderr, "tier-tune: --window needs 0 .. %d operations, not '%s'\n", MAXWINDOW,
					       optarg), 1;
			o->sc.window = (unsigned)v;
			break;
		}
		case 'j': o->json = 1; break;
		case 'h': usage(stdout); exit(0);
		default: return 1;
		}
	}
	if (optind + 1 != argc)
		return fprintf(stderr, "tier-tune: give exactly one TRACE file\n"), 1;
	if (!o->nhbm || !o->nddr)
		return fprintf(stderr, "tier-tune: --hbm SIZES and --ddr SIZES are required\n"), 1;
	if (o->op_ms >= 0 && o->step_s >= 0)
		return fprintf(stderr, "tier-tune: give --op-ms or --step-s, not both\n"), 1;
	return 0;
}

typedef struct {
	sim_policy p;
	uint64_t hbm, ddr;
	sim_result r;
} row;

static double hit_rate(const sim_result *r)
{
	uint64_t n = r->hits[0] + r->misses[0] + r->cold[0];
	return n ? (double)r->hits[0] / (double)n : 0;
}

/* What the recommendation minimizes: the overlap stall when the compute time is known. */
static double row_stall(const row *w)
{
	return isnan(w->r.overlap_s) ? w->r.stall_s : w->r.overlap_s;
}

/* Mean step time in seconds with (overlap 1) or without prefetch overlap; NAN without a compute time. */
static double step_time(const row *w, uint32_t steps, int overlap)
{
	if (isnan(w->r.overlap_s))
		return NAN;
	return (w->r.compute_s + (overlap ? w->r.overlap_s : w->r.stall_s)) / steps;
}

/* v with fmt, or "-" (table) / "null" (JSON) when unknown (NAN). */
static const char *num(double v, const char *fmt, const char *none, char *buf, size_t len)
{
	if (isnan(v))
		return none;
	snprintf(buf, len, fmt, v);
	return buf;
}

static void print_table(const row *rows, int n, const row *min, uint32_t steps)
{
	char a[32], b[32], x[32], y[32], z[32], w[32], ov[32], st[32];
	printf("\nhbm %s, ddr %s\n", tier_format_size(rows[0].hbm, a, sizeof a), tier_format_size(rows[0].ddr, b, sizeof b));
	printf("%-9s %10s %8s %10s %11s %11s %11s %11s %10s %10s %10s %10s\n", "policy", "hbm hits", "hit rate",
	       "ddr hits", "pcie up", "pcie down", "nvme up", "nvme down", "stall s", "overlap s", "step ms", "gap hits");
	for (int i = 0; i < n; i++) {
		const sim_result *r = &rows[i].r;
		printf("%-9s %10llu %7.2f%% %10llu %11s %11s %11s %11s %10.4f %10s %10s %10lld\n", sim_policy_name(rows[i].p),
		       (unsigned long long)r->hits[0], 100 * hit_rate(r), (unsigned long long)r->hits[1],
		       tier_format_size(r->bytes[0][0], x, sizeof x), tier_format_size(r->bytes[0][1], y, sizeof y),
		       tier_format_size(r->bytes[1][0], z, sizeof z), tier_format_size(r->bytes[1][1], w, sizeof w),
		       r->stall_s, num(r->overlap_s, "%.4f", "-", ov, sizeof ov),
		       num(1e3 * step_time(&rows[i], steps, 1), "%.3f", "-", st, sizeof st),
		       (long long)min->r.hits[0] - (long long)r->hits[0]);
	}
}

static void print_json_row(const row *w, const row *min, int first, uint32_t steps)
{
	const sim_result *r = &w->r;
	char ov[32], cs[32], st[32], sn[32], ops[96] = "null,\"demand_ops\":null,\"stalled_ops\":null";
	if (!isnan(r->overlap_s))
		snprintf(ops, sizeof ops, "%llu,\"demand_ops\":%llu,\"stalled_ops\":%llu", (unsigned long long)r->xfer_ops,
			 (unsigned long long)r->demand_ops, (unsigned long long)r->stalled_ops);
	printf("%s{\"policy\":\"%s\",\"hbm\":%llu,\"ddr\":%llu,\"hbm_hits\":%llu,\"hbm_misses\":%llu,\"hbm_cold\":%llu,"
	       "\"hbm_hit_rate\":%.6f,\"ddr_hits\":%llu,\"ddr_misses\":%llu,\"pcie_up\":%llu,\"pcie_down\":%llu,"
	       "\"nvme_up\":%llu,\"nvme_down\":%llu,\"stall_s\":%.6f,\"overlap_stall_s\":%s,\"compute_s\":%s,"
	       "\"step_s\":%s,\"step_no_overlap_s\":%s,\"xfer_ops\":%s,\"gap_to_min_hits\":%lld}",
	       first ? "" : ",", sim_policy_name(w->p), (unsigned long long)w->hbm, (unsigned long long)w->ddr,
	       (unsigned long long)r->hits[0], (unsigned long long)r->misses[0], (unsigned long long)r->cold[0],
	       hit_rate(r), (unsigned long long)r->hits[1], (unsigned long long)r->misses[1],
	       (unsigned long long)r->bytes[0][0], (unsigned long long)r->bytes[0][1], (unsigned long long)r->bytes[1][0],
	       (unsigned long long)r->bytes[1][1], r->stall_s, num(r->overlap_s, "%.6f", "null", ov, sizeof ov),
	       num(isnan(r->overlap_s) ? NAN : r->compute_s, "%.6f", "null", cs, sizeof cs),
	       num(step_time(w, steps, 1), "%.9f", "null", st, sizeof st),
	       num(step_time(w, steps, 0), "%.9f", "null", sn, sizeof sn), ops,
	       (long long)min->r.hits[0] - (long long)r->hits[0]);
}

/* Less stall (with overlap when known); on a tie (within a nanosecond) the smaller budget, then
 * more HBM hits. */
static int better(const row *a, const row *b)
{
	if (b->p == SIM_NPOL)
		return 1;
	if (fabs(row_stall(a) - row_stall(b)) > 1e-9)
		return row_stall(a) < row_stall(b);
	if (a->hbm + a->ddr != b->hbm + b->ddr)
		return a->hbm + a->ddr < b->hbm + b->ddr;
	return a->r.hits[0] > b->r.hits[0];
}

/* A size as tier-run takes it: whole KiB/MiB/GiB when exact, else bytes. */
static const char *opt_size(uint64_t v, char *buf, size_t len)
{
	static const char u[] = "GMk";
	for (int i = 0; i < 3; i++) {
		uint64_t m = 1ull << (10 * (3 - i));
		if (v % m == 0) {
			snprintf(buf, len, "%llu%c", (unsigned long long)(v / m), u[i]);
			return buf;
		}
	}
	snprintf(buf, len, "%llu", (unsigned long long)v);
	return buf;
}

static void print_header(const options *o, const sim_trace *t, const char *path)
{
	char c[64];
	if (o->json) {
		printf("{\"trace\":{\"records\":%llu,\"requests\":%zu,\"objects\":%zu,\"operations\":%zu,\"steps\":%u,"
		       "\"recorded_hbm_acquires\":%llu,\"recorded_hbm_hits\":%llu},\"pcie_gbps\":%g,\"nvme_gbps\":%g,"
		       "\"op_s\":%s,\"window\":%u,\"results\":[",
		       (unsigned long long)t->records, t->n, t->nobj, t->nops, o->steps, (unsigned long long)t->rec_acquires[0],
		       (unsigned long long)t->rec_hits[0], o->sc.gbps[0], o->sc.gbps[1],
		       num(o->sc.op_s < 0 ? NAN : o->sc.op_s, "%.12g", "null", c, sizeof c), o->sc.window);
		return;
	}
	printf("# trace %s: %llu records, %zu requests (hbm/ddr acquires and dirty releases), %zu objects\n"
	       "# the recorded run: %llu of %llu hbm acquires hit\n"
	       "# links: pcie %.1f GB/s, nvme %.1f GB/s; %zu operations in %u steps\n", path,
	       (unsigned long long)t->records, t->n, t->nobj, (unsigned long long)t->rec_hits[0],
	       (unsigned long long)t->rec_acquires[0], o->sc.gbps[0], o->sc.gbps[1], t->nops, o->steps);
	if (o->sc.op_s < 0)
		printf("# no compute time (--op-ms or --step-s): stall assumes no overlap with compute\n");
	else
		printf("# compute %.3f ms per operation (%.4f s per step); overlap: prefetch window %u, bounded by HBM room\n",
		       1e3 * o->sc.op_s, o->sc.op_s * (double)t->nops / o->steps, o->sc.window);
}

static void print_recommend(const options *o, const sim_trace *t, const row *best, double secs)
{
	char a[32], b[32], c[32], e[32];
	if (o->json) {
		printf("]");
		if (best->p != SIM_NPOL)
			printf(",\"recommend\":{\"policy\":\"%s\",\"hbm\":%llu,\"ddr\":%llu,\"stall_s\":%.6f,"
			       "\"overlap_stall_s\":%s,\"step_s\":%s,\"basis\":\"%s\"}",
			       sim_policy_name(best->p), (unsigned long long)best->hbm, (unsigned long long)best->ddr,
			       best->r.stall_s, num(best->r.overlap_s, "%.6f", "null", a, sizeof a),
			       num(step_time(best, o->steps, 1), "%.9f", "null", b, sizeof b),
			       isnan(best->r.overlap_s) ? "no_overlap" : "overlap");
		printf(",\"seconds\":%.3f}\n", secs);
		return;
	}
	if (best->p == SIM_NPOL) {
		printf("\n# no policy and split within --total %s: raise it or add smaller sizes\n",
		       tier_format_size(o->total, a, sizeof a));
		return;
	}
	printf("\n# recommended: policy %s, hbm %s, ddr %s (predicted stall %.4f s", sim_policy_name(best->p),
	       tier_format_size(best->hbm, a, sizeof a), tier_format_size(best->ddr, b, sizeof b), row_stall(best));
	if (!isnan(best->r.overlap_s))
		printf(" with prefetch, %.4f s without; step %.3f ms", best->r.stall_s, 1e3 * step_time(best, o->steps, 1));
	printf(", hbm hit rate %.2f%%)\n", 100 * hit_rate(&best->r));
	uint64_t objs = 0;
	for (size_t i = 0; i < t->nobj; i++)
		objs += t->size[i];
	if (objs > best->ddr) /* the store keeps every object somewhere: the rest needs NVMe */
		printf("# ddr holds less than the trace's %s of objects: give tier-run an NVMe directory\n"
		       "tier-run --policy %s --hbm %s --ddr %s --nvme DIR:%s\n", tier_format_size(objs, a, sizeof a),
		       sim_policy_name(best->p), opt_size(best->hbm, b, sizeof b), opt_size(best->ddr, c, sizeof c),
		       opt_size(tier_align_up(objs, 1 << 20), e, sizeof e));
	else
		printf("tier-run --policy %s --hbm %s --ddr %s\n", sim_policy_name(best->p), opt_size(best->hbm, b, sizeof b),
		       opt_size(best->ddr, c, sizeof c));
	printf("# replayed in %.2f s\n", secs);
}

int main(int argc, char **argv)
{
	options o = { .op_ms = -1, .step_s = -1, .sc = { .half_life = 4, .gbps = { 55, 6 }, .op_s = -1, .window = 2 } };
	for (int k = 0; k < SIM_NPOL; k++)
		o.pol[k] = 1;
	if (parse_args(&o, argc, argv))
		return fprintf(stderr, "tier-tune: see tier-tune --help\n"), 1;
	sim_trace t;
	uint64_t t0 = tier_now_ns();
	if (sim_trace_load(&t, argv[optind]) < 0) {
		fprintf(stderr, "tier-tune: %s\n", tier_last_error());
		sim_trace_free(&t);
		return 1;
	}
	o.steps = sim_trace_steps(&t);
	if (o.op_ms >= 0)
		o.sc.op_s = o.op_ms / 1e3;
	else if (o.step_s >= 0) /* the trace's operations spread evenly over its steps */
		o.sc.op_s = t.nops ? o.step_s * o.steps / (double)t.nops : 0;
	print_header(&o, &t, argv[optind]);
	row best = { .p = SIM_NPOL };
	int rc = 0, first = 1;
	for (int i = 0; i < o.nhbm && !rc; i++)
		for (int j = 0; j < o.nddr && !rc; j++) {
			row rows[SIM_NPOL];
			int n = 0;
			for (int k = 0; k < SIM_NPOL && !rc; k++) {
				if (!o.pol[k])
					continue;
				o.sc.cap[0] = o.hbm[i], o.sc.cap[1] = o.ddr[j];
				rows[n] = (row){ .p = (sim_policy)k, .hbm = o.hbm[i], .ddr = o.ddr[j] };
				rc = sim_run(&t, (sim_policy)k, &o.sc, &rows[n].r);
				/* MIN is offline (it knows the future): a bound, never a recommendation */
				if (!rc && k != SIM_MIN && (!o.total || o.hbm[i] + o.ddr[j] <= o.total) &&
				    better(&rows[n], &best))
					best = rows[n];
				n++;
			}
			if (rc)
				break;
			for (int k = 0; k < n; k++)
				if (o.json)
					print_json_row(&rows[k], &rows[n - 1], first, o.steps), first = 0;
			if (!o.json)
				print_table(rows, n, &rows[n - 1], o.steps);
		}
	if (rc) {
		fprintf(stderr, "tier-tune: %s\n", tier_last_error());
		sim_trace_free(&t);
		return 1;
	}
	print_recommend(&o, &t, &best, (double)(tier_now_ns() - t0) / 1e9);
	sim_trace_free(&t);
	return 0;
}
