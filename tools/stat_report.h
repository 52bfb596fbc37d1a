/* stat_report.h - tier-stat report: a finished run's stats log (docs/stats-log.md) read into
 * memory, summarised as a table or JSON (stat_report.c), and drawn with cairo (stat_plot.c). */
#ifndef TIER_TOOLS_STAT_REPORT_H
#define TIER_TOOLS_STAT_REPORT_H

#include <stdint.h>
#include "tier/stats.h"

/* Exit codes of report mode (beside tier-stat's: 1 bad arguments), in --help and the man page. */
enum {
	REPORT_NORUN = 2,   /* no such run directory, or no or an empty stats.jsonl */
	REPORT_VERSION = 3, /* the log is of another format version */
	REPORT_BADLOG = 5,  /* a malformed line (named), or the image could not be written */
	REPORT_NOPLOT = 6,  /* --plot in a build without cairo */
};

typedef struct {
	int step;
	double time_s, loss, tokens_per_s;
	int64_t tokens;
	uint64_t used[TIER_STATS_NTIERS], hits[TIER_STATS_NTIERS], misses[TIER_STATS_NTIERS];
	uint64_t bytes[TIER_STATS_NLINKS], busy_ns[TIER_STATS_NLINKS];
	uint64_t on_time, late, missed, stall_ns, issued;
} report_row;

typedef struct {
	int n, cap;                     /* rows */
	report_row *rows;
	char tier[TIER_STATS_NTIERS][32];
	uint64_t capacity[TIER_STATS_NTIERS], peak[TIER_STATS_NTIERS];
	char link[TIER_STATS_NLINKS][32];
	int nmoe, experts;              /* MoE layers in the log, experts per layer */
	int *layer;                     /* [nmoe]: their layer numbers */
	int64_t *tokens;                /* [nmoe * experts]: tokens over the run */
} report_log;

/* Counters at row i minus those at row j (j < 0: from zero). */
double report_hit_pct(const report_log *g, int t, int i, int j);

/* Draw the image (.png or .svg by its name). 0, or an exit code above with a message printed. */
int report_plot(const report_log *g, const char *dir, const char *file);

int report_main(int argc, char **argv);

#endif
