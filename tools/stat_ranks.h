/* stat_ranks.h - (tier-stat) the processes a tier-stat watches: one per rank of a job, named by
 * pids (-p PID,PID...) or by the pid files of a run directory (--run DIR), and what a row shows
 * of each. */
#ifndef TIER_TOOLS_STAT_RANKS_H
#define TIER_TOOLS_STAT_RANKS_H

#include <stdint.h>
#include <sys/types.h>
#include "tier/stats.h"

/* Exit codes, documented in --help and the man page. */
enum {
	EXIT_USAGE = 1,    /* bad arguments */
	EXIT_NOPROC = 2,   /* no such process, or it publishes no tier statistics */
	EXIT_VERSION = 3,  /* the segment is of another version (or not a tier segment) */
	EXIT_EXITED = 4,   /* the process exited while being watched */
	EXIT_OTHER = 5,    /* anything else (permission, no stable snapshot) */
};

/* What a row shows beside the snapshot itself: counts over the interval and rates. Rates are NaN
 * when there is no interval to divide by. */
typedef struct {
	uint64_t hits[TIER_STATS_NTIERS], misses[TIER_STATS_NTIERS];
	double evict_ps[TIER_STATS_NTIERS], evict_ps_all; /* evictions per second, per tier and over all */
	double gbps[TIER_STATS_NLINKS];
	uint64_t on_time, needs, stall_ns;                /* prefetch */
} stat_delta;

/* One process of the job. `prev` is the snapshot of the last row printed; `cur` this interval's. */
typedef struct {
	int rank;
	pid_t pid;
	int exited;     /* gone while watched: shown "exited", left out of the all row; never cleared */
	tier_stats prev, cur;
	double dt;      /* seconds that this interval's row covers */
	int new_store;  /* cur is of a store other than prev's: rates since its start */
	stat_delta d;
} stat_rank;

typedef struct {
	stat_rank *r;
	int n, cap;
} rank_list;

/* Ranks from "PID[,PID...]" (rank i is the i-th), or from DIR's pid files (rankN/tier.pid,
 * tier.N.pid, tier.pid as rank 0). 0, or an exit code with a message on stderr. */
int ranks_of_pids(rank_list *l, const char *arg);
int ranks_of_run(rank_list *l, const char *dir);

#endif
