/* bench.h - tier-bench's subcommands and the helpers that make their tables look alike.
 *
 * A subcommand is `int bench_x(int argc, char **argv)` (argv[0] is its name; returns the exit
 * status) listed in the table of tier-bench.c. Output follows nccl-tests: comment lines start with
 * '#', then a header row and a units row, fixed-width data rows, and a '#' summary line. */
#ifndef TIER_TOOLS_BENCH_H
#define TIER_TOOLS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "tier/base.h"

/* ---- Subcommands (one line each; add the function to the table in tier-bench.c) ---- */
int bench_store(int argc, char **argv);
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

#endif
