/* bench_sched.c - tier-bench sched: the host's cost of announcing a scheduled operation
 * (tier_store_at_op) when everything is resident, against the acquire+release hits of the
 * operation's own objects. The trainer announces every operation, and where a step's operations are
 * short (its optimizer: one per layer) the device waits for the host between them: at_op once
 * walked every copy HBM held, 145 us a call here with the 7,200 objects of the (a) job's shape (the
 * ~145 us between two optimizer launches in its H100 timeline), 1.4 us since 07e41aa. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "tier/store.h"
#include "tools/bench.h"

static const char *const cmd = "sched";

typedef struct {
	unsigned layers, per_op, runs;
} sched_opts;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench sched [--layers N] [--per-op N] [--iters N]\n"
		"The host's cost of tier_store_at_op, the announcement of each operation of a step's\n"
		"schedule, with every object resident in HBM (emulated in host memory) and so nothing to\n"
		"prefetch, against its peer: acquire+release hits of the operation's own objects, the\n"
		"least the operation itself costs the host. The schedule is the trainer's shape: per layer\n"
		"a forward and a backward operation naming the layer's objects, plus one optimizer operation\n"
		"a layer; cyclic. Rows for a quarter, half and all of the layers, each layer's objects all\n"
		"resident. Each figure is the median of N timed runs (at_op: every operation of 5 steps;\n"
		"pins: every layer's objects once).\n"
		"\n"
		"  --layers N   layers (default 48)\n"
		"  --per-op N   objects of one layer, named by each of its operations (default 150: the\n"
		"               Qwen3-30B-A3B shape's 128 experts, dense weights and LoRA sets)\n"
		"  --iters N    timed runs per figure, of which the median is shown (default 5)\n"
		"  --help       this text\n"
		"Exit status: 0 done, 1 bad arguments, 2 a store operation failed (message on stderr).\n");
}

static int parse(int argc, char **argv, sched_opts *o)
{
	static const struct option opts[] = {
		{ "layers", required_argument, NULL, 'L' }, { "per-op", required_argument, NULL, 'P' },
		{ "iters", required_argument, NULL, 'i' },  { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'L': if (bench_parse_uint(cmd, "--layers", optarg, &o->layers)) return 1; break;
		case 'P': if (bench_parse_uint(cmd, "--per-op", optarg, &o->per_op)) return 1; break;
		case 'i': if (bench_parse_uint(cmd, "--iters", optarg, &o->runs)) return 1; break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args(cmd, argc, argv))
		return 1;
	if (!o->layers || !o->per_op || !o->runs || (uint64_t)o->layers * o->per_op > 1000000) {
		fprintf(stderr, "tier-bench sched: --layers, --per-op and --iters must be at least 1, and layers x "
			"per-op at most 1000000\n");
		return 1;
	}
	return 0;
}

typedef struct {
	tier_store *s;
	tier_object **obj;
	size_t n_ops, per_op, resident; /* the first `resident` objects are in HBM */
	int rc;
} sched_case;

/* ns per tier_store_at_op over 5 steps of the cyclic schedule */
static double run_at_op(void *arg)
{
	sched_case *c = arg;
	uint64_t t0 = tier_now_ns();
	for (size_t k = 0; k < 5 * c->n_ops; k++)
		tier_store_at_op(c->s, k);
	return (double)(tier_now_ns() - t0) / (double)(5 * c->n_ops);
}

/* ns per operation for acquire+release hits of per_op resident objects */
static double run_pins(void *arg)
{
	sched_case *c = arg;
	void *addr;
	size_t ops = c->resident / c->per_op;
	uint64_t t0 = tier_now_ns();
	for (size_t k = 0; k < ops; k++)
		for (size_t i = 0; i < c->per_op; i++) {
			tier_object *o = c->obj[k * c->per_op + i];
			int rc = tier_acquire(c->s, o, TIER_HBM, 0, &addr, NULL);
			if (rc == 0)
				rc = tier_release(c->s, o, TIER_HBM, 0);
			if (rc)
				return c->rc = rc;
		}
	return (double)(tier_now_ns() - t0) / (double)ops;
}

/* The store of n objects of 4 KiB, the first `resident` of them in HBM, and the trainer-shaped
 * schedule over the layers whose objects are resident. */
static int make_case(const sched_opts *o, size_t resident, sched_case *c, uint64_t **ids_out, tier_sched_op **ops_out)
{
	size_t L = resident / o->per_op, n = resident;
	tier_store_config cfg = { .capacity = { (uint64_t)n * 8192 + (64u << 20), 64u << 20, 0 },
				  .policy = TIER_POLICY_SCHEDULE };
	int rc = tier_store_create(&c->s, &cfg);
	uint64_t *ids = calloc(n, sizeof *ids);
	tier_sched_op *ops = calloc(3 * L, sizeof *ops);
	c->obj = calloc(n, sizeof *c->obj);
	*ids_out = ids, *ops_out = ops;
	if (rc || !ids || !ops || !c->obj)
		return rc ? rc : tier_fail(-ENOMEM, "out of memory for %zu objects", n);
	for (size_t i = 0; i < n; i++) {
		void *p;
		if ((rc = tier_obj_create(c->s, 4096, TIER_CLASS_EXPERT, 0, &c->obj[i])) ||
		    (rc = tier_acquire(c->s, c->obj[i], TIER_HBM, TIER_ACQ_INIT, &p, NULL)) ||
		    (rc = tier_release(c->s, c->obj[i], TIER_HBM, 1)))
			return rc;
		ids[i] = tier_obj_id(c->obj[i]);
	}
	for (size_t k = 0; k < 3 * L; k++) { /* forwards 0..L-1, backwards L-1..0, optimizer L-1..0 */
		size_t l = k < L ? k : k < 2 * L ? 2 * L - 1 - k : 3 * L - 1 - k;
		ops[k] = (tier_sched_op){ .objects = ids + l * o->per_op, .n_objects = (unsigned)o->per_op,
					  .tier = TIER_HBM };
	}
	c->n_ops = 3 * L, c->per_op = o->per_op, c->resident = n;
	return tier_store_set_schedule(c->s, ops, c->n_ops, 1);
}

static const bench_col cols[] = {
	{ "resident", "objects", 9 }, { "ops", "a step", 6 }, { "runs", "", 5 }, { "at_op", "per call", 10 },
	{ "pins", "per op", 10 },     { "at_op/pins", "", 10 },
};
#define NCOLS ((int)(sizeof cols / sizeof cols[0]))

static int bench_row(const sched_opts *o, size_t resident, double *worst)
{
	sched_case c = { 0 };
	uint64_t *ids = NULL;
	tier_sched_op *ops = NULL;
	int rc = make_case(o, resident, &c, &ids, &ops);
	double t = rc ? -1 : bench_median_run(run_at_op, &c, o->runs);
	double p = rc ? -1 : bench_median_run(run_pins, &c, o->runs);
	if (!rc && (t < 0 || p < 0))
		rc = c.rc ? c.rc : -EIO;
	if (!rc) {
		char cells[NCOLS][BENCH_CELL];
		snprintf(cells[0], BENCH_CELL, "%zu", resident);
		snprintf(cells[1], BENCH_CELL, "%zu", c.n_ops);
		snprintf(cells[2], BENCH_CELL, "%u", o->runs);
		bench_fmt_time(t, cells[3], BENCH_CELL);
		bench_fmt_time(p, cells[4], BENCH_CELL);
		snprintf(cells[5], BENCH_CELL, "%.2fx", t / p);
		bench_table_cells(cols, NCOLS, cells);
		*worst = t / p > *worst ? t / p : *worst;
	}
	tier_store_destroy(c.s);
	free(c.obj);
	free(ids);
	free(ops);
	return rc;
}

int bench_sched(int argc, char **argv)
{
	sched_opts o = { .layers = 48, .per_op = 150, .runs = 5 };
	if (parse(argc, argv, &o))
		return 1;
	bench_comment("tier-bench sched: tier_store_at_op with everything resident (nothing to prefetch) vs "
		      "acquire+release hits of an operation's %u objects", o.per_op);
	bench_comment("schedule: %u layers x (forward, backward, optimizer), cyclic, window 2; hbm emulated in "
		      "host memory; median of %u runs", o.layers, o.runs);
	bench_table_header(cols, NCOLS);
	double worst = 0;
	unsigned parts[3] = { 4, 2, 1 };
	for (int i = 0; i < 3; i++) {
		size_t layers = o.layers / parts[i] ? o.layers / parts[i] : 1;
		int rc = bench_row(&o, layers * o.per_op, &worst);
		if (rc) {
			fprintf(stderr, "tier-bench sched: %s (%s)\n", tier_last_error(), tier_strerror(rc));
			return 2;
		}
	}
	bench_summary("announcing an operation costs at most %.2fx the operation's own pins", worst);
	return 0;
}
