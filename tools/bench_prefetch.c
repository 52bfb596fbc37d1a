/* bench_prefetch.c - tier-bench prefetch: does the store's prefetcher hide the link behind compute?
 *
 * A synthetic layer loop: L layers, each a frozen weight object of W bytes, run forward 0..L-1 then
 * backward L-1..0 (a cyclic schedule of 2L operations); each operation acquires its layer's weights
 * in HBM and runs a matrix product on them sized to take `ratio` times the measured transfer of one
 * layer. Three modes in one process:
 *   resident: HBM holds every layer, loaded before timing (the speed to match);
 *   prefetch: HBM is 1/4 of the weights, the weights start in DDR, and tier_store_at_op prefetches
 *             the layers of the next `window` operations while the current one computes;
 *   demand:   the same store without the window: every fetch is a miss the compute waits for.
 * The prefetch statistics of the store (on time, late, missed, stall time) say where time went. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <sched.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tools/bench_prefetch.h"
#include "tier/store.h" /* base.h, offload.h, stats.h */
#include "tools/bench.h"

static const char *const cmd = "prefetch";
#define GATE 0.90
#define NSAMPLE 4 /* output values per layer compared across modes */

typedef struct {
	tier_dev_kind kind;
	unsigned L, window, steps;
	uint64_t W;
	double link_gbps, ratio;
	int link_set, json, no_pin;
	uint64_t seed;
} pf_opts;

enum { MODE_RESIDENT, MODE_PREFETCH, MODE_DEMAND, NMODES };
static const char *const mode_name[NMODES] = { "resident", "prefetch", "demand" };

typedef struct {
	uint64_t hbm;
	unsigned window;
	double step_ns, compute_ns, issue_ns; /* medians per step */
	double speed;                         /* median over the steps of resident step / this step */
	double stall_ns;                      /* mean per step: the store's stall counter over the steps */
	uint64_t needs, issued, on_time, late, missed, resident, wasted, h2d_bytes; /* over the timed steps */
	float *sample;                        /* L x NSAMPLE forward outputs of the last step */
} pf_result;

/* One store and its layers; for a timed mode also the counters at the start and the step times. */
typedef struct {
	const pf_opts *o;
	tier_dev *dev;
	pf_compute *comp;
	tier_store *s;
	tier_object **w;
	tier_stats s0;
	tier_link_stats l0;
	double *step, *compute, *issue; /* per timed step */
} pf_run;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench prefetch [--device cpu|cuda] [--layers L] [--layer-bytes SIZE] [--link-gbps G]\n"
		"                           [--compute-ratio R] [--window N] [--steps N] [--seed S] [--no-pin] [--json]\n"
		"A layer loop (forward 0..L-1, backward L-1..0) whose frozen weights total 4x the HBM budget,\n"
		"run three ways: resident (HBM holds every layer), prefetch (weights in DDR, the store\n"
		"prefetches the next N layers while one computes) and demand (no prefetch). Each layer's\n"
		"compute is an fp32 matrix product on its weights sized to R times the measured transfer of\n"
		"one layer. Gate: prefetch runs at >= 90%% of the resident speed when R > 1.\n\n"
		"  --device KIND       cpu or cuda (default: cuda when a GPU is present)\n"
		"  --layers L          layers (default 16)\n"
		"  --layer-bytes SIZE  weights per layer, a multiple of 4 KiB (default 4M cpu, 256M cuda)\n"
		"  --link-gbps G       cap on the DDR->HBM link in GB/s, 0 for none (default 0.5 on the CPU, to\n"
		"                      emulate a link; 0 on CUDA: the real link)\n"
		"  --compute-ratio R   compute per layer / transfer per layer (default 1.5)\n"
		"  --window N          operations the prefetcher looks ahead (default 2)\n"
		"  --steps N           timed steps per mode, after one warm-up step (default 7)\n"
		"  --seed S            seed of the weights and inputs (default 1)\n"
		"  --no-pin            CPU: let the copy workers share the compute core (see docs/prefetch.md)\n"
		"  --json              print one JSON line with every figure after the table\n"
		"  --help              this text\n"
		"Exit status: 0 done (PASS or FAIL is in the summary), 1 bad arguments, 2 the benchmark failed.\n");
}

static int parse_double(const char *opt, const char *text, double lo, double *out)
{
	char *end;
	double v = strtod(text, &end);
	if (*end || end == text || !(v >= lo) || v > 1e6) {
		fprintf(stderr, "tier-bench prefetch: %s needs a number >= %g, not '%s'\n", opt, lo, text);
		return 1;
	}
	*out = v;
	return 0;
}

static int parse_opts(int argc, char **argv, pf_opts *o)
{
	static const struct option opts[] = {
		{ "device", required_argument, NULL, 'd' },      { "layers", required_argument, NULL, 'L' },
		{ "layer-bytes", required_argument, NULL, 'W' }, { "link-gbps", required_argument, NULL, 'g' },
		{ "compute-ratio", required_argument, NULL, 'r' }, { "window", required_argument, NULL, 'w' },
		{ "steps", required_argument, NULL, 's' },       { "seed", required_argument, NULL, 'S' },
		{ "json", no_argument, NULL, 'j' },              { "help", no_argument, NULL, 'h' },
		{ "no-pin", no_argument, NULL, 'P' },
		{ NULL, 0, NULL, 0 },
	};
	unsigned seed = 1;
	int c;
	memset(o, 0, sizeof *o);
	o->kind = tier_cuda_available() ? TIER_DEV_CUDA : TIER_DEV_CPU;
	o->L = 16;
	o->ratio = 1.5;
	o->window = 2;
	o->steps = 7;
	optind = 1;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'd':
			if (bench_parse_device("prefetch", optarg, &o->kind))
				return 1;
			break;
		case 'L': if (bench_parse_uint(cmd, "--layers", optarg, &o->L)) return 1; break;
		case 'W': if (bench_parse_size(cmd, "--layer-bytes", optarg, &o->W)) return 1; break;
		case 'g': if (parse_double("--link-gbps", optarg, 0, &o->link_gbps)) return 1; o->link_set = 1; break;
		case 'r': if (parse_double("--compute-ratio", optarg, 0.01, &o->ratio)) return 1; break;
		case 'w': if (bench_parse_uint(cmd, "--window", optarg, &o->window)) return 1; break;
		case 's': if (bench_parse_uint(cmd, "--steps", optarg, &o->steps)) return 1; break;
		case 'S': if (bench_parse_uint(cmd, "--seed", optarg, &seed)) return 1; break;
		case 'j': o->json = 1; break;
		case 'P': o->no_pin = 1; break;
		case 'h': usage(stdout); return -1;
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args("prefetch", argc, argv))
		return 1;
	o->seed = seed;
	int cuda = o->kind == TIER_DEV_CUDA;
	if (!o->W)
		o->W = cuda ? 256ull << 20 : 4ull << 20;
	if (!o->link_set)
		o->link_gbps = cuda ? 0 : 0.5; /* low: the CPU's copies slow its compute (docs/prefetch.md) */
	if (o->W % 4096 || o->W > (64ull << 30)) {
		fprintf(stderr, "tier-bench prefetch: --layer-bytes %llu must be a multiple of 4 KiB and at most 64 GiB\n",
			(unsigned long long)o->W);
		return 1;
	}
	if (o->L > 100000) {
		fprintf(stderr, "tier-bench prefetch: --layers %u is too many (at most 100000)\n", o->L);
		return 1;
	}
	/* The tiered budget, 1/4 of the weights, must hold the layer computing and the window ahead. */
	uint64_t fit = (uint64_t)o->L / 4;
	if (fit < o->window + 1ull) {
		fprintf(stderr, "tier-bench prefetch: an HBM budget of 1/4 of %u layers holds %llu layer(s), but the layer "
				"computing and --window %u ahead need %u: use --layers >= %u or a smaller --window\n",
			o->L, (unsigned long long)fit, o->window, o->window + 1, 4 * (o->window + 1));
		return 1;
	}
	return 0;
}

/* Weights as a K x N matrix: N the largest power of two <= sqrt(floats) that divides them. */
static void layer_shape(uint64_t W, unsigned *K, unsigned *N)
{
	uint64_t f = W / 4, n = 1;
	while ((n * 2) * (n * 2) <= f && f % (n * 2) == 0)
		n *= 2;
	*N = (unsigned)n;
	*K = (unsigned)(f / n);
}

/* ---- The store ------------------------------------------------------------------------------------ */
static void run_close(pf_run *r)
{
	if (r->s)
		tier_store_destroy(r->s); /* frees the objects too */
	free(r->w);
	r->s = NULL;
	r->w = NULL;
}

/* Fill a layer's DDR copy with weights uniform in [-1, 1) / sqrt(K), the same in every mode. */
static int fill_layer(pf_run *r, unsigned l, unsigned K)
{
	float *p;
	int rc = tier_acquire(r->s, r->w[l], TIER_DDR, TIER_ACQ_INIT, (void **)&p, NULL);
	if (rc)
		return rc;
	tier_rng g;
	tier_rng_seed(&g, r->o->seed * 1000003u + l);
	float scale = 1.0f / sqrtf((float)K);
	size_t n = r->o->W / 4;
	for (size_t i = 0; i < n; i += 2) { /* two floats per draw: filling is a large part of the setup */
		uint64_t v = tier_rng_next(&g);
		p[i] = scale * ((float)(uint32_t)v * 0x1p-31f - 1.0f);
		p[i + 1] = scale * ((float)(uint32_t)(v >> 32) * 0x1p-31f - 1.0f);
	}
	return tier_release(r->s, r->w[l], TIER_DDR, 1);
}

/* Without a GPU the offload engine's workers copy with the CPU. A GPU copies with its DMA engines
 * and computes on its SMs; to emulate that, the workers (created by tier_store_create, inheriting
 * the creating thread's affinity) get every allowed CPU but the first, and the compute thread the
 * first only. With one CPU, or --no-pin, nothing is pinned. */
typedef struct {
	int on;
	cpu_set_t all, compute, copy;
} pf_pin;

static void pin_init(pf_pin *p, const pf_opts *o, tier_dev *dev)
{
	memset(p, 0, sizeof *p);
	if (o->no_pin || dev || sched_getaffinity(0, sizeof p->all, &p->all) || CPU_COUNT(&p->all) < 2)
		return;
	p->copy = p->all;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &p->all)) {
			CPU_SET(c, &p->compute);
			CPU_CLR(c, &p->copy);
			break;
		}
	p->on = 1;
}

static pf_pin pin; /* tier-bench runs one subcommand once: a file-scope setting is enough */

static void pin_set(const cpu_set_t *set)
{
	if (pin.on && sched_setaffinity(0, sizeof *set, set))
		tier_log(TIER_LOG_WARN, "tier-bench prefetch: could not set the CPU affinity; running unpinned");
}

/* A store with `hbm` bytes of HBM and room for every layer in DDR, the weights in DDR. */
static int run_open(pf_run *r, uint64_t hbm, unsigned K)
{
	const pf_opts *o = r->o;
	tier_offload_config oc = { 0 };
	oc.dev = r->dev;
	oc.link_gbps[TIER_LINK_H2D] = o->link_gbps;
	tier_store_config cfg = { 0 };
	cfg.dev = r->dev;
	cfg.capacity[TIER_HBM] = hbm;
	cfg.capacity[TIER_DDR] = (uint64_t)o->L * o->W + o->W;
	cfg.policy = TIER_POLICY_SCHEDULE;
	cfg.offload_config = &oc;
	pin_set(&pin.copy);
	int rc = tier_store_create(&r->s, &cfg);
	pin_set(&pin.compute);
	if (rc)
		return rc;
	tier_store_set_job(r->s, "tier-bench prefetch");
	if (!(r->w = calloc(o->L, sizeof *r->w))) {
		run_close(r);
		return tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	}
	for (unsigned l = 0; l < o->L && !rc; l++) {
		rc = tier_obj_create(r->s, o->W, TIER_CLASS_DENSE, TIER_OBJ_FROZEN, &r->w[l]);
		if (!rc)
			rc = fill_layer(r, l, K);
	}
	if (rc)
		run_close(r);
	return rc;
}

/* Forward 0..L-1, backward L-1..0: operation i uses layer op_layer(i). */
static unsigned op_layer(unsigned L, unsigned i) { return i < L ? i : 2 * L - 1 - i; }

static int set_schedule(pf_run *r, unsigned window)
{
	unsigned L = r->o->L;
	uint64_t *ids = calloc(L, sizeof *ids);
	tier_sched_op *ops = calloc(2 * (size_t)L, sizeof *ops);
	int rc = -ENOMEM;
	if (ids && ops) {
		for (unsigned l = 0; l < L; l++)
			ids[l] = tier_obj_id(r->w[l]);
		for (unsigned i = 0; i < 2 * L; i++) {
			ops[i].objects = &ids[op_layer(L, i)];
			ops[i].n_objects = 1;
			ops[i].tier = TIER_HBM;
		}
		rc = tier_store_set_schedule(r->s, ops, 2 * (size_t)L, 1);
	} else {
		tier_fail(rc, "tier-bench prefetch: out of memory");
	}
	free(ids);
	free(ops);
	if (!rc)
		tier_store_set_prefetch_window(r->s, window);
	return rc;
}

/* ---- One step --------------------------------------------------------------------------------------- */
/* Runs the 2L operations; returns the step's time. *compute_ns gets the time spent computing,
 * *issue_ns the time in tier_store_at_op (issuing prefetches); sample: keep the outputs. */
static double run_step(pf_run *r, double *compute_ns, double *issue_ns, float *sample)
{
	unsigned L = r->o->L;
	double comp = 0;
	uint64_t issue = 0;
	uint64_t t0 = tier_now_ns();
	for (unsigned i = 0; i < 2 * L; i++) {
		unsigned l = op_layer(L, i);
		const float *w;
		uint64_t t1 = tier_now_ns();
		tier_store_at_op(r->s, i); /* issues the prefetches of the window ahead */
		issue += tier_now_ns() - t1;
		int rc = tier_acquire(r->s, r->w[l], TIER_HBM, 0, (void **)&w, NULL);
		if (rc)
			return rc;
		double t = pf_compute_layer(r->comp, w, i >= L);
		if (t >= 0 && sample && i < L)
			t = pf_compute_sample(r->comp, sample + (size_t)l * NSAMPLE, NSAMPLE) ? -EIO : t;
		rc = tier_release(r->s, r->w[l], TIER_HBM, 0);
		if (t < 0)
			return t;
		if (rc)
			return rc;
		comp += t;
	}
	tier_store_step(r->s);
	*compute_ns = comp;
	*issue_ns = (double)issue;
	return (double)(tier_now_ns() - t0);
}

/* Open a mode's store, load every layer when resident, run the warm-up step, take the counters. */
static int mode_open(pf_run *r, int mode, unsigned K, pf_result *res)
{
	const pf_opts *o = r->o;
	uint64_t total = (uint64_t)o->L * o->W;
	double c, ci;
	res->hbm = mode == MODE_RESIDENT ? total : total / 4 / 4096 * 4096;
	res->window = mode == MODE_DEMAND ? 0 : o->window;
	r->step = calloc(o->steps, sizeof *r->step);
	r->compute = calloc(o->steps, sizeof *r->compute);
	r->issue = calloc(o->steps, sizeof *r->issue);
	if (!r->step || !r->compute || !r->issue)
		return tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	int rc = run_open(r, res->hbm, K);
	if (!rc)
		rc = set_schedule(r, res->window);
	for (unsigned l = 0; l < o->L && !rc && mode == MODE_RESIDENT; l++) {
		void *p;
		if (!(rc = tier_acquire(r->s, r->w[l], TIER_HBM, TIER_ACQ_NOEVICT, &p, NULL)))
			rc = tier_release(r->s, r->w[l], TIER_HBM, 0);
	}
	if (!rc) {
		double t = run_step(r, &c, &ci, NULL);
		rc = t < 0 ? (int)t : 0;
	}
	if (!rc) {
		tier_store_stats(r->s, &r->s0);
		tier_offload_link_stats(tier_store_offload(r->s), TIER_LINK_H2D, &r->l0);
	}
	return rc;
}

static uint64_t hbm_hits(const tier_stats *st)
{
	uint64_t h = 0;
	for (int c = 0; c < TIER_STATS_NCLASSES; c++)
		h += st->cls[TIER_HBM][c].hits;
	return h;
}

/* The counters are differences over the timed steps; then check the store and close it. */
static int mode_finish(pf_run *r, pf_result *res)
{
	unsigned N = r->o->steps;
	tier_stats s1;
	tier_link_stats l1;
	tier_store_stats(r->s, &s1);
	tier_offload_link_stats(tier_store_offload(r->s), TIER_LINK_H2D, &l1);
	res->step_ns = bench_median(r->step, N);
	res->compute_ns = bench_median(r->compute, N);
	res->issue_ns = bench_median(r->issue, N);
	res->needs = 2ull * r->o->L * N;
	res->issued = s1.prefetch.issued - r->s0.prefetch.issued;
	res->on_time = s1.prefetch.on_time - r->s0.prefetch.on_time;
	res->late = s1.prefetch.late - r->s0.prefetch.late;
	res->missed = s1.prefetch.missed - r->s0.prefetch.missed;
	res->wasted = s1.prefetch.wasted - r->s0.prefetch.wasted;
	/* HBM hits count the on-time and late needs too; the rest found a copy left by an earlier op. */
	res->resident = hbm_hits(&s1) - hbm_hits(&r->s0) - res->on_time - res->late;
	res->stall_ns = (double)(s1.prefetch.stall_ns - r->s0.prefetch.stall_ns) / N;
	res->h2d_bytes = l1.bytes - r->l0.bytes;
	return tier_store_check(r->s);
}

static void mode_close(pf_run *r)
{
	run_close(r);
	free(r->step);
	free(r->compute);
	free(r->issue);
	r->step = r->compute = r->issue = NULL;
}

/* All modes side by side, their steps interleaved, so that a change in the machine's load (other
 * processes, clock speed) falls on every mode alike. */
static int run_modes(pf_run *runs, unsigned K, pf_result *res)
{
	const pf_opts *o = runs[0].o;
	int rc = 0;
	for (int m = 0; m < NMODES && !rc; m++)
		rc = mode_open(&runs[m], m, K, &res[m]);
	for (unsigned i = 0; i < o->steps && !rc; i++)
		for (int m = 0; m < NMODES && !rc; m++) {
			pf_run *r = &runs[m];
			double t = r->step[i] = run_step(r, &r->compute[i], &r->issue[i], i + 1 == o->steps ? res[m].sample : NULL);
			rc = t < 0 ? (int)t : 0;
		}
	double *pair = calloc(o->steps, sizeof *pair);
	if (!rc && !pair)
		rc = tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	/* Speed against resident from the steps of the same round: slow drifts of the load cancel. */
	for (int m = 0; m < NMODES && !rc; m++) {
		for (unsigned i = 0; i < o->steps; i++)
			pair[i] = runs[MODE_RESIDENT].step[i] / runs[m].step[i];
		res[m].speed = bench_median(pair, o->steps);
	}
	free(pair);
	for (int m = 0; m < NMODES && !rc; m++)
		rc = mode_finish(&runs[m], &res[m]);
	for (int m = 0; m < NMODES; m++)
		mode_close(&runs[m]);
	return rc;
}

/* The transfer of one layer as the store does it: demand fetches from DDR, every layer twice over
 * (the first pass faults the pages in; HBM holds 1/4 of the layers, so the second pass fetches
 * again), median of the second pass. Then the compute sized to `ratio` times that. */
static int calibrate(pf_run *r, unsigned K, double *xfer_ns, double *comp_ns)
{
	const pf_opts *o = r->o;
	uint64_t total = (uint64_t)o->L * o->W;
	int rc = run_open(r, total / 4 / 4096 * 4096, K);
	if (rc)
		return rc;
	double *t = calloc(o->L, sizeof *t);
	const float *w;
	if (!t)
		rc = tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	for (unsigned i = 0; i < 2 * o->L && !rc; i++) {
		uint64_t t0 = tier_now_ns();
		if (!(rc = tier_acquire(r->s, r->w[i % o->L], TIER_HBM, 0, (void **)&w, NULL)))
			rc = tier_release(r->s, r->w[i % o->L], TIER_HBM, 0);
		if (i >= o->L)
			t[i - o->L] = (double)(tier_now_ns() - t0);
	}
	if (!rc)
		rc = tier_acquire(r->s, r->w[o->L - 1], TIER_HBM, 0, (void **)&w, NULL);
	if (!rc) {
		*xfer_ns = bench_median(t, o->L);
		*comp_ns = pf_compute_calibrate(r->comp, w, o->ratio * *xfer_ns);
		if (*comp_ns < 0)
			rc = (int)*comp_ns;
		int rc2 = tier_release(r->s, r->w[o->L - 1], TIER_HBM, 0);
		rc = rc ? rc : rc2;
	}
	free(t);
	run_close(r);
	return rc;
}

/* ---- Output ------------------------------------------------------------------------------------------ */
enum { C_MODE, C_HBM, C_WIN, C_STEP, C_VS, C_COMP, C_STALL, C_ISSUE, C_NEEDS, C_ISSUED, C_ONTIME, C_LATE, C_MISSED, C_RES,
       C_WASTED, C_H2D, NCOLS };
static const bench_col cols[NCOLS] = {
	{ "mode", "", 9 },        { "hbm", "", 9 },         { "window", "ops", 6 },   { "step", "", 10 },
	{ "speed", "vs res", 7 }, { "compute", "/step", 10 }, { "stall", "/step", 10 }, { "issue", "/step", 10 },
	{ "needs", "", 6 },
	{ "issued", "", 6 },      { "on-time", "%", 7 },    { "late", "", 5 },        { "missed", "", 6 },
	{ "resident", "", 8 },    { "wasted", "", 6 },      { "h2d", "MiB/step", 9 },
};

static void print_row(int mode, const pf_result *res, unsigned N)
{
	char b[NCOLS][32];
	const char *cell[NCOLS];
	uint64_t moved = res->on_time + res->late + res->missed;
	snprintf(b[C_MODE], 32, "%s", mode_name[mode]);
	bench_fmt_size(res->hbm, b[C_HBM], 32);
	snprintf(b[C_WIN], 32, "%u", res->window);
	bench_fmt_time(res->step_ns, b[C_STEP], 32);
	bench_fmt_num(res->speed, 3, b[C_VS], 32);
	bench_fmt_time(res->compute_ns, b[C_COMP], 32);
	bench_fmt_time(res->stall_ns, b[C_STALL], 32);
	bench_fmt_time(res->issue_ns, b[C_ISSUE], 32);
	snprintf(b[C_NEEDS], 32, "%llu", (unsigned long long)res->needs);
	snprintf(b[C_ISSUED], 32, "%llu", (unsigned long long)res->issued);
	if (moved)
		bench_fmt_num(100.0 * res->on_time / moved, 1, b[C_ONTIME], 32);
	else
		snprintf(b[C_ONTIME], 32, "-");
	snprintf(b[C_LATE], 32, "%llu", (unsigned long long)res->late);
	snprintf(b[C_MISSED], 32, "%llu", (unsigned long long)res->missed);
	snprintf(b[C_RES], 32, "%llu", (unsigned long long)res->resident);
	snprintf(b[C_WASTED], 32, "%llu", (unsigned long long)res->wasted);
	bench_fmt_num((double)res->h2d_bytes / N / (1 << 20), 1, b[C_H2D], 32);
	for (int i = 0; i < NCOLS; i++)
		cell[i] = b[i];
	bench_table_row(cols, NCOLS, cell);
}

static void print_json(const pf_opts *o, const char *dev, double xfer, double comp, unsigned M, const pf_result *res,
		       double ratio)
{
	printf("{\"bench\":\"prefetch\",\"device\":\"%s\",\"layers\":%u,\"layer_bytes\":%llu,\"link_gbps\":%.3f,"
	       "\"compute_ratio\":%.3f,\"window\":%u,\"steps\":%u,\"rows\":%u,\"xfer_ns\":%.0f,\"compute_ns\":%.0f,"
	       "\"modes\":[", dev, o->L, (unsigned long long)o->W, o->link_gbps, o->ratio, o->window, o->steps, M,
	       xfer, comp);
	for (int m = 0; m < NMODES; m++) {
		const pf_result *p = &res[m];
		printf("%s{\"mode\":\"%s\",\"hbm_bytes\":%llu,\"window\":%u,\"step_ns\":%.0f,\"speed_vs_resident\":%.4f,"
		       "\"compute_ns\":%.0f,\"stall_ns\":%.0f,\"issue_ns\":%.0f,\"needs\":%llu,\"issued\":%llu,\"on_time\":%llu,\"late\":%llu,"
		       "\"missed\":%llu,\"resident\":%llu,\"wasted\":%llu,\"h2d_bytes\":%llu}",
		       m ? "," : "", mode_name[m], (unsigned long long)p->hbm, p->window, p->step_ns,
		       p->speed, p->compute_ns, p->stall_ns, p->issue_ns, (unsigned long long)p->needs,
		       (unsigned long long)p->issued, (unsigned long long)p->on_time, (unsigned long long)p->late,
		       (unsigned long long)p->missed, (unsigned long long)p->resident, (unsigned long long)p->wasted,
		       (unsigned long long)p->h2d_bytes);
	}
	printf("],\"gate\":%.2f,\"prefetch_vs_resident\":%.4f,\"pass\":%s}\n", GATE, ratio, ratio >= GATE ? "true" : "false");
}

/* The weights must reach the compute intact: every mode's outputs equal the resident ones. */
static int check_samples(const pf_opts *o, const pf_result *res)
{
	size_t n = (size_t)o->L * NSAMPLE;
	for (int m = 1; m < NMODES; m++)
		if (memcmp(res[m].sample, res[MODE_RESIDENT].sample, n * sizeof(float)))
			return tier_fail(-EBADMSG, "the %s mode computed other outputs than the resident one: weights arrived "
						   "damaged (a store or offload bug)", mode_name[m]);
	return 0;
}

static int bench_all(pf_run *runs, unsigned K, unsigned N, pf_result *res)
{
	pf_run *r = &runs[0];
	const pf_opts *o = r->o;
	double xfer = 0, comp = 0;
	char a[32], b[32], c[32];
	int rc = calibrate(r, K, &xfer, &comp);
	if (rc)
		return rc;
	bench_comment("tier-bench prefetch: a layer loop with its weights in DDR at 4x the HBM budget, vs all resident");
	bench_comment("device %s; %u layers x %s (fp32 %u x %u), %s in all; forward then backward: %u ops per step",
		      r->dev ? tier_dev_name(r->dev) : "cpu (emulated hbm)", o->L, bench_fmt_size(o->W, a, 32), K, N,
		      tier_format_size((uint64_t)o->L * o->W, b, 32), 2 * o->L);
	if (pin.on)
		bench_comment("copy workers on %d CPU(s), compute on 1 other (--no-pin: share them)", CPU_COUNT(&pin.copy));
	else if (!r->dev)
		bench_comment("copy workers and compute share the CPUs (not pinned)");
	if (o->link_gbps > 0)
		bench_comment("ddr->hbm link capped at %.2f GB/s by the offload engine", o->link_gbps);
	else
		bench_comment("ddr->hbm link uncapped (%s)", r->dev ? "the real link" : "memcpy speed");
	bench_comment("per layer: transfer %s (a demand fetch through the store, %.2f GB/s), compute %s (%.2fx; %u rows)",
		      bench_fmt_time(xfer, a, 32), o->W / xfer, bench_fmt_time(comp, c, 32), comp / xfer,
		      pf_compute_rows(r->comp));
	bench_comment("times: median of %u steps (modes interleaved) after 1 warm-up step; speed: median of the", o->steps);
	bench_comment("ratios resident step / mode step of the same round; counts: totals over the timed steps");
	bench_comment("step = compute + stall (waiting for data) + issue (in tier_store_at_op) + the rest");
	bench_comment("needs = on-time + late + missed + resident (a copy still in HBM from an earlier op)");
	if ((rc = run_modes(runs, K, res)) || (rc = check_samples(o, res)))
		return rc;
	bench_table_header(cols, NCOLS);
	for (int m = 0; m < NMODES; m++)
		print_row(m, &res[m], o->steps);
	double ratio = res[MODE_PREFETCH].speed;
	const pf_result *p = &res[MODE_PREFETCH], *d = &res[MODE_DEMAND];
	bench_comment("prefetch: %llu of %llu fetched needs on time, %llu late; stalls %s per step, %s moved per step;",
		      (unsigned long long)p->on_time, (unsigned long long)(p->on_time + p->late + p->missed),
		      (unsigned long long)p->late, bench_fmt_time(p->stall_ns, a, 32),
		      tier_format_size(p->h2d_bytes / o->steps, b, 32));
	bench_comment("          its compute took %.2fx the resident compute (the copies running meanwhile share %s)",
		      p->compute_ns / res[MODE_RESIDENT].compute_ns, r->dev ? "HBM bandwidth" : "the machine");
	bench_comment("demand: every fetch is a miss the compute waits for: stalls %s per step (%.0f%% of the step; %s "
		      "per fetch)", bench_fmt_time(d->stall_ns, c, 32), 100 * d->stall_ns / d->step_ns,
		      bench_fmt_time(d->missed ? d->stall_ns * o->steps / d->missed : 0, a, 32));
	double loop = res[MODE_RESIDENT].compute_ns / (2.0 * o->L) / xfer; /* compute/transfer as it ran */
	bench_summary("prefetch/resident = %.2fx (gate %.2f: %s); demand/resident = %.2fx; compute/transfer = %.2f "
		      "(calibrated %.2f)", ratio, GATE, ratio >= GATE ? "PASS" : "FAIL", d->speed,
		      loop, comp / xfer);
	if (o->json)
		print_json(o, r->dev ? tier_dev_name(r->dev) : "cpu", xfer, comp, pf_compute_rows(r->comp), res, ratio);
	return 0;
}

int bench_prefetch(int argc, char **argv)
{
	pf_opts o;
	int rc = parse_opts(argc, argv, &o);
	if (rc)
		return rc < 0 ? 0 : rc;
	pf_run runs[NMODES];
	pf_result res[NMODES];
	tier_dev *dev = NULL;
	pf_compute *comp = NULL;
	unsigned K, N;
	memset(runs, 0, sizeof runs);
	memset(res, 0, sizeof res);
	layer_shape(o.W, &K, &N);
	if (o.kind == TIER_DEV_CUDA && (rc = tier_dev_open(&dev, TIER_DEV_CUDA, 0)))
		goto out;
	pin_init(&pin, &o, dev);
	for (int m = 0; m < NMODES && !rc; m++)
		if (!(res[m].sample = calloc((size_t)o.L * NSAMPLE, sizeof(float))))
			rc = tier_fail(-ENOMEM, "tier-bench prefetch: out of memory");
	if (!rc && !(rc = pf_compute_create(&comp, dev, K, N, o.seed))) {
		for (int m = 0; m < NMODES; m++) {
			runs[m].o = &o;
			runs[m].dev = dev;
			runs[m].comp = comp;
		}
		rc = bench_all(runs, K, N, res);
	}
out:
	if (rc)
		fprintf(stderr, "tier-bench prefetch: %s\n", tier_last_error());
	pf_compute_destroy(comp);
	tier_dev_close(dev);
	pin_set(&pin.all);
	for (int m = 0; m < NMODES; m++)
		free(res[m].sample);
	return rc ? 2 : 0;
}
