/* bench_util.c - shared table printing and statistics for tier-bench's subcommands. */
#include "config.h"
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <getopt.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"

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
