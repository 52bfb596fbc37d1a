/* run_opts.h - tier-run's options: their values, the command line and CONFIG.json job files (one
 * parser for both, so a key means what its option means). */
#ifndef TIER_RUN_OPTS_H
#define TIER_RUN_OPTS_H
#include <stdint.h>
#include <stdio.h>

typedef struct {
	const char *model, *init, *config, *data, *out, *policy, *device, *targets, *resume;
	const char *trace; /* --trace FILE: record the store's accesses (docs/trace.md) */
	const char *opcache; /* --op-cache RULES (tier_cache_config_parse) */
	uint64_t hbm, ddr, nvme;
	char nvme_dir[4096];
	int lora_r, rslora, steps, batch, seq, micro, warmup, quiet, ckpt_every, hbm_max, hbm_set, pwin, moe_chunks, layer_major;
	int optim_fwd; /* --optimizer-at forward */
	double lora_alpha, lr, min_lr_ratio, wd, clip, init_range, peak_tflops, dropout;
	uint64_t seed;
	char *kept[64];      /* values read from CONFIG.json, which the fields above point into */
	int nkept;
} run_opts;

/* The default job's values (tier-run with no arguments). */
void run_opts_defaults(run_opts *o);
/* Print the usage (every option, documented). */
void run_opts_usage(FILE *f);
/* Parse argv (after an optional CONFIG.json first): 0, 1 on bad input (said on stderr), 2 when
 * --help was printed. Strings the options point into are kept in o until run_opts_free. */
int run_opts_parse(run_opts *o, int argc, char **argv);
/* A CONFIG.json job file alone: 0 or 1 (said on stderr). */
int run_opts_file(run_opts *o, const char *path);
void run_opts_free(run_opts *o);
#endif
