/* bench.h - tier-bench's subcommands and the helpers that make their tables look alike.
 *
 * A subcommand is `int bench_x(int argc, char **argv)` (argv[0] is its name; returns the exit
 * status) listed in the table of tier-bench.c. Output follows nccl-tests: comment lines start with
 * '#', then a header row and a units row, fixed-width data rows, and a '#' summary line. */
#ifndef TIER_TOOLS_BENCH_H
#define TIER_TOOLS_BENCH_H

#include <getopt.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "tier/base.h"

/* ---- Subcommands (one line each; add the function to the table in tier-bench.c) ---- */
int bench_store(int argc, char **argv);
int bench_sched(int argc, char **argv);       /* tools/bench_sched.c: tier_store_at_op's host cost */
int bench_loss(int argc, char **argv);
int bench_attn(int argc, char **argv);
int bench_h2d(int argc, char **argv);         /* tools/bench_offload.c: offload engine links */
int bench_d2h(int argc, char **argv);
int bench_nvme_read(int argc, char **argv);
int bench_nvme_write(int argc, char **argv);
int bench_nvme_to_hbm(int argc, char **argv);
int bench_opcache(int argc, char **argv);     /* tools/bench_opcache.c: the selective op cache */
int bench_prefetch(int argc, char **argv);    /* tools/bench_prefetch.c: prefetch hides the link behind compute */
int bench_moe(int argc, char **argv);         /* tools/bench_moe.c: MoE steps and block (peer: bench/moe_torch.py) */
int bench_fused(int argc, char **argv);       /* tools/bench_fused.c: fused CUDA steps vs the separate ones */
int bench_lora(int argc, char **argv);        /* tools/bench_lora.c: the experts' LoRA kernels vs a device copy */

/* ---- Table helpers ---- */
typedef struct {
	const char *name;  /* header text */
	const char *unit;  /* units row text ("" for none) */
	int width;         /* column width; data right-aligned */
} bench_col;

/* "# tier-bench NAME: what" plus the machine and the options, each on a '#' line. */
void bench_comment(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Header and units rows of a table. */
void bench_table_header(const bench_col *cols, int ncols);
/* One data row: cells already formatted as text (use bench_fmt_* below), one per column. */
void bench_table_row(const bench_col *cols, int ncols, const char *const *cells);
/* Summary line: "# summary: ..." */
void bench_summary(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Cell formatting into buf (returns buf): a size with binary unit ("4 KiB", "64 MiB"), a time per
 * operation with an auto unit (ns, us, ms), a rate in GB/s (1e9 B/s), a plain number. */
char *bench_fmt_size(uint64_t bytes, char *buf, size_t len);
char *bench_fmt_time(double ns, char *buf, size_t len);
char *bench_fmt_gbps(double bytes_per_ns, char *buf, size_t len);
char *bench_fmt_num(double v, int prec, char *buf, size_t len);

/* Median of n values (n > 0); sorts the array in place. */
double bench_median(double *v, size_t n);
/* Run fn(arg) `reps` times, return the median of the times in ns each took (fn returns the ns it
 * measured, or a negative value on failure, which is returned as is). */
double bench_median_run(double (*fn)(void *arg), void *arg, unsigned reps);

/* Common option helpers: parse a size or count option, printing "tier-bench NAME: ..." on error.
 * Return 0 or 1 (error printed). */
int bench_parse_size(const char *cmd, const char *opt, const char *text, uint64_t *out);
int bench_parse_uint(const char *cmd, const char *opt, const char *text, unsigned *out);
/* After getopt_long: 1 (with a message) when arguments are left over, else 0. */
int bench_no_extra_args(const char *cmd, int argc, char **argv);
/* "cpu" or "cuda" -> kind; 0, or 1 after printing what is wrong. */
int bench_parse_device(const char *cmd, const char *text, tier_dev_kind *out);
/* n comma-separated whole numbers, each in [1, max], into v (a --shape); 0, or 1 (nothing printed:
 * the caller says what its shape should be). */
int bench_parse_dims(const char *text, int n, long long max, long long *v);

/* ---- The model benchmarks (attn, loss, moe): their common options, timing and exit ---- */
typedef struct {
	tier_dev_kind kind; /* --device cuda|cpu */
	unsigned iters;     /* --iters N: timed runs per figure */
	int json;           /* --json: one JSON line with every figure after the table */
} bench_run_opts;

/* A subcommand's command line: own holds its own options (getopt_long entries whose val is none of
 * 'd', 'i', 'j', 'h', at most 11, ended by a zero entry), which take reads: 0, or 1 after printing
 * why the value is wrong. */
typedef struct {
	const char *cmd; /* the subcommand, for messages */
	const struct option *own;
	int (*take)(void *opts, int val, const char *text);
	void (*usage)(FILE *f);
} bench_cli;

/* Parses argv (argv[0] the subcommand): --device, --iters and --json into *run, whose defaults the
 * caller sets first, and cli->own through cli->take(opts, ...); --help prints the usage on stdout,
 * an unknown option prints it on stderr. Returns 0, -1 after --help, or 1 on bad arguments
 * (message printed). */
int bench_parse_run(const bench_cli *cli, int argc, char **argv, bench_run_opts *run, void *opts);
/* The end of their usage text: --json and --help, described from column col, and the exit status. */
void bench_run_usage_end(FILE *f, int col);

/* Times call(arg) on dev: untimed runs until they add up to warm_ms (at least 2, at most 10000),
 * then the median of iters timed ones, by CUDA events on a CUDA device's compute stream
 * (bench_dev.h's timer) or by the host clock on the CPU. Returns the median in ms, or a negative
 * value with *rc the failed call's status (or -EIO from the events, -ENOMEM). */
double bench_measure_ms(tier_dev *dev, int (*call)(void *arg), void *arg, unsigned warm_ms, unsigned iters,
			int *rc);

/* bench_table_row of cells formatted in place, char cells[ncols][BENCH_CELL] (ncols <= 16). */
#define BENCH_CELL 32
void bench_table_cells(const bench_col *cols, int ncols, char (*cells)[BENCH_CELL]);

/* Prints "tier-bench CMD: " and tier_last_error() on stderr and closes dev (NULL: none open);
 * returns 2, the exit status of a benchmark that failed. */
int bench_failed(const char *cmd, tier_dev *dev);

#endif
