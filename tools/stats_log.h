/* stats_log.h - tier-run's stats log (docs/stats-log.md): RUN_DIR/stats.jsonl, one line per step,
 * with RUN_DIR/tier.pid and RUN_DIR/run.json. tier-stat report reads it. */
#ifndef TIER_TOOLS_STATS_LOG_H
#define TIER_TOOLS_STATS_LOG_H

#include <stdint.h>
#include <stdio.h>
#include "tier/tier.h"

#define STATS_LOG_VERSION 1

/* What run.json says about the job. */
typedef struct {
	const char *model, *data, *policy, *lora_targets;
	int64_t layers, hidden, experts, top_k;
	uint64_t base_bytes, hbm, ddr, nvme;
	int steps, batch, seq, micro, lora_r;
	uint64_t seed;
} stats_log_info;

typedef struct stats_log stats_log;

/* Write DIR/tier.pid and DIR/run.json, create DIR/stats.jsonl. 0, or 1 with a message printed. */
int stats_log_open(stats_log **out, const char *dir, const stats_log_info *info);
/* Append step `step` (1-based): the result, the store's snapshot (totals since it started) and the
 * trainer's per-expert counts of that step. 0, or 1 with a message printed (disk full). */
int stats_log_step(stats_log *l, int step, const tier_step_result *r, const tier_stats *st, const tier_trainer *t);
/* Close the log (tier.pid and run.json stay). NULL is fine. */
void stats_log_close(stats_log *l);

#endif
