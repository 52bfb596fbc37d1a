/* bench_util.c - shared table printing, statistics, options and timing for tier-bench's subcommands. */
#include "config.h"
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <getopt.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"
#include "tools/bench_dev.h"

void bench_comment(const char *fmt, ...)
{
	va_list ap;
	fputs("# ", stdout);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
}

void bench_summary(const char *fmt, ...)
{
	va_list ap;
	fputs("# summary: ", stdout);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	fflush(stdout);
}

/* Rows start with two spaces so that they line up under "# " comment lines. */
void bench_table_header(const bench_col *cols, int ncols)
{
	printf("#");
	for (int i = 0; i < ncols; i++)
		printf(" %*s", cols[i].width, cols[i].name);
	printf("\n#");
	for (int i = 0; i < ncols; i++)
		printf(" %*s", cols[i].width, cols[i].unit ? cols[i].unit : "");
	putchar('\n');
}

void bench_table_row(const bench_col *cols, int ncols, const char *const *cells)
{
	putchar(' ');
	for (int i = 0; i < ncols; i++)
		printf(" %*s", cols[i].width, cells[i] ? cells[i] : "-");
	putchar('\n');
	fflush(stdout);
}

void bench_table_cells(const bench_col *cols, int ncols, char (*cells)[BENCH_CELL])
{
	const char *cp[16];
	if (ncols > 16)
		ncols = 16;
	for (int i = 0; i < ncols; i++)
		cp[i] = cells[i];
	bench_table_row(cols, ncols, cp);
}

char *bench_fmt_size(uint64_t bytes, char *buf, size_t len)
{
	static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	int u = 0;
	while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
		bytes /= 1024;
		u++;
	}
	snprintf(buf, len, "%llu %s", (unsigned long long)bytes, unit[u]);
	return buf;
}

char *bench_fmt_time(double ns, char *buf, size_t len)
{
	if (!(ns >= 0))
		snprintf(buf, len, "-");
	else if (ns < 1e3)
		snprintf(buf, len, "%.1f ns", ns);
	else if (ns < 1e7)
		snprintf(buf, len, "%.2f us", ns / 1e3);
	else
		snprintf(buf, len, "%.2f ms", ns / 1e6);
	return buf;
}

char *bench_fmt_gbps(double bytes_per_ns, char *buf, size_t len)
{
	if (!(bytes_per_ns >= 0))
		snprintf(buf, len, "-");
	else
		snprintf(buf, len, "%.2f", bytes_per_ns); /* bytes per ns = GB/s */
	return buf;
}

char *bench_fmt_num(double v, int prec, char *buf, size_t len)
{
	snprintf(buf, len, "%.*f", prec, v);
	return buf;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

double bench_median(double *v, size_t n)
{
	qsort(v, n, sizeof *v, cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double bench_median_run(double (*fn)(void *arg), void *arg, unsigned reps)
{
	double *t = calloc(reps ? reps : 1, sizeof *t), m;
	if (!t)
		return -ENOMEM;
	for (unsigned i = 0; i < reps; i++) {
		t[i] = fn(arg);
		if (t[i] < 0) {
			m = t[i];
			free(t);
			return m;
		}
	}
	m = bench_median(t, reps ? reps : 1);
	free(t);
	return m;
}

int bench_parse_size(const char *cmd, const char *opt, const char *text, uint64_t *out)
{
	if (tier_parse_size(text, out) == 0)
		return 0;
	fprintf(stderr, "tier-bench %s: %s: %s\n", cmd, opt, tier_last_error());
	return 1;
}

int bench_parse_uint(const char *cmd, const char *opt, const char *text, unsigned *out)
{
	char *end;
	unsigned long v = strtoul(text, &end, 10);
	if (*end || end == text || text[0] == '-' || v == 0 || v > 1000000000ul) {
		fprintf(stderr, "tier-bench %s: %s needs a positive count, not '%s'\n", cmd, opt, text);
		return 1;
	}
	*out = (unsigned)v;
	return 0;
}

int bench_parse_device(const char *cmd, const char *text, tier_dev_kind *out)
{
	if (strcmp(text, "cuda") && strcmp(text, "cpu")) {
		fprintf(stderr, "tier-bench %s: --device %s: use cuda or cpu\n", cmd, text);
		return 1;
	}
	*out = strcmp(text, "cpu") ? TIER_DEV_CUDA : TIER_DEV_CPU;
	return 0;
}

int bench_no_extra_args(const char *cmd, int argc, char **argv)
{
	if (optind < argc) {
		fprintf(stderr, "tier-bench %s: unexpected argument '%s' (see tier-bench %s --help)\n", cmd, argv[optind], cmd);
		return 1;
	}
	return 0;
}

int bench_parse_dims(const char *text, int n, long long max, long long *v)
{
	const char *p = text;
	for (int i = 0; i < n; i++) {
		char *end;
		v[i] = strtoll(p, &end, 10);
		if (end == p || v[i] < 1 || v[i] > max || *end != (i + 1 < n ? ',' : '\0'))
			return 1;
		p = end + 1;
	}
	return 0;
}

int bench_parse_run(const bench_cli *cli, int argc, char **argv, bench_run_opts *run, void *opts)
{
	/* --device first, the subcommand's own options, then the rest: the order they had in each
	 * subcommand's table, which getopt_long's message on an ambiguous abbreviation follows */
	static const struct option first = { "device", required_argument, NULL, 'd' };
	static const struct option last[] = {
		{ "iters", required_argument, NULL, 'i' }, { "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	struct option all[16] = { first };
	int n = 1, c;
	for (const struct option *o = cli->own; o->name && n < 16 - 4; o++)
		all[n++] = *o;
	memcpy(all + n, last, sizeof last);
	optind = 1;
	while ((c = getopt_long(argc, argv, "", all, NULL)) != -1) {
		int bad = 0;
		switch (c) {
		case 'd': bad = bench_parse_device(cli->cmd, optarg, &run->kind); break;
		case 'i': bad = bench_parse_uint(cli->cmd, "--iters", optarg, &run->iters); break;
		case 'j': run->json = 1; break;
		case 'h': cli->usage(stdout); return -1;
		case '?': cli->usage(stderr); return 1;
		default: bad = cli->take(opts, c, optarg); break;
		}
		if (bad)
			return 1;
	}
	return bench_no_extra_args(cli->cmd, argc, argv);
}

void bench_run_usage_end(FILE *f, int col)
{
	fprintf(f, "  %-*sprint one JSON line with every figure after the table\n", col - 2, "--json");
	fprintf(f, "  %-*sthis text\n", col - 2, "--help");
	fputs("Exit status: 0 done, 1 bad arguments, 2 the benchmark failed (message on stderr).\n", f);
}

/* What bench_measure_ms times, and the events it times it by on CUDA. */
typedef struct {
	tier_dev *dev;
	int (*call)(void *arg);
	void *arg;
	int rc;
#ifdef TIER_HAVE_CUDA
	bench_timer ev; /* on a CUDA device */
#endif
} timed;

/* One timed call in ns, or -1 with t->rc set (bench_median_run's fn). */
static double timed_call(void *p)
{
	timed *t = p;
	uint64_t t0;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(t->dev) == TIER_DEV_CUDA)
		return bench_timer_run(&t->ev, t->call, t->arg, &t->rc);
#endif
	t0 = tier_now_ns();
	if ((t->rc = t->call(t->arg)))
		return -1;
	return (double)(tier_now_ns() - t0);
}

double bench_measure_ms(tier_dev *dev, int (*call)(void *arg), void *arg, unsigned warm_ms, unsigned iters, int *rc)
{
	timed t = { .dev = dev, .call = call, .arg = arg };
	double ns = 0, spent = 0;
#ifdef TIER_HAVE_CUDA
	int cuda = tier_dev_kind_of(dev) == TIER_DEV_CUDA;
	if (cuda && (*rc = bench_timer_open(&t.ev, dev)))
		return -1;
#endif
	/* warm-up: the clocks and caches settle to what a long job sees */
	for (int w = 0; w < 10000 && (w < 2 || spent < warm_ms * 1e6) && ns >= 0; w++)
		spent += ns = timed_call(&t);
	if (ns >= 0)
		ns = bench_median_run(timed_call, &t, iters);
#ifdef TIER_HAVE_CUDA
	if (cuda)
		bench_timer_close(&t.ev);
#endif
	*rc = ns >= 0 ? 0 : t.rc ? t.rc : tier_fail(-ENOMEM, "bench: no memory for the times");
	return ns >= 0 ? ns / 1e6 : ns;
}

int bench_failed(const char *cmd, tier_dev *dev)
{
	fprintf(stderr, "tier-bench %s: %s\n", cmd, tier_last_error());
	tier_dev_close(dev);
	return 2;
}
