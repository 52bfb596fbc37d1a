/* tier-run.c - the main job: LoRA fine-tuning of a qwen3_moe model whose weights live in the tiered
 * store. With no arguments, the default job: a small model made deterministically, trained on the
 * shipped corpus under an HBM budget smaller than the model. `tier-run --store-demo` runs the
 * store demonstration (tools/store_demo.c). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "tier/tier.h"
#include "run_opts.h"
#include "stats_log.h"

int store_demo_main(int argc, char **argv);

#ifndef TIER_PKGDATADIR
#define TIER_PKGDATADIR "."
#endif


static volatile sig_atomic_t stop_sig;
/* The first SIGINT or SIGTERM stops the run at the next step's end (or the weights' fill at its
 * next object) and says so; the handler is then reset (SA_RESETHAND), so a second one kills. */
static void on_signal(int sig)
{
	static const char msg[] = "\ntier-run: stopping at the end of this step (at once while the weights are "
				  "made); no adapter will be written; send the signal again to stop now\n";
	stop_sig = sig;
	ssize_t w = write(2, msg, sizeof msg - 1);
	(void)w;
}

static void catch_stop_signals(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_signal;
	sa.sa_flags = SA_RESETHAND;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
}


static const char *find_corpus(void)
{
	static const char *const where[] = { "data/corpus.txt", "../data/corpus.txt", TIER_PKGDATADIR "/corpus.txt" };
	for (size_t i = 0; i < sizeof where / sizeof where[0]; i++)
		if (access(where[i], R_OK) == 0)
			return where[i];
	return NULL;
}

static int check_out_dir(const char *dir)
{
	struct stat st;
	if (stat(dir, &st) != 0 && mkdir(dir, 0777) != 0) {
		fprintf(stderr, "tier-run: --out %s: cannot create it: %s\n", dir, strerror(errno));
		return 1;
	}
	if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || access(dir, W_OK | X_OK) != 0) {
		fprintf(stderr, "tier-run: --out %s: not a writable directory; choose another with --out\n", dir);
		return 1;
	}
	return 0;
}

/* Totals of the store's counters that the progress line reports. */
typedef struct { uint64_t hits, misses, bytes; } counters;
static counters read_counters(tier_store *s, tier_stats *st)
{
	counters c = { 0, 0, 0 };
	tier_store_stats(s, st);
	for (int k = 0; k < TIER_STATS_NCLASSES; k++)
		c.hits += st->cls[TIER_HBM][k].hits, c.misses += st->cls[TIER_HBM][k].misses;
	for (int l = 0; l < TIER_STATS_NLINKS; l++)
		c.bytes += st->link[l].bytes;
	return c;
}

typedef struct {
	tier_dev *dev;
	tier_store *s;
	tier_model *m;
	tier_trainer *t;
	tier_data *d;
	int32_t *tok, *lab;
	FILE *log;
	stats_log *slog; /* OUT/stats.jsonl (docs/stats-log.md) */
	int tracing;     /* --trace: closed (and its write errors reported) before the store goes */
	uint64_t hbm;    /* the HBM budget in effect (after clamping to the GPU) */
	double flop_per_token, peak; /* MFU: 4 x active parameters per token; the GPU's peak (0: no MFU) */
	uint64_t parts[TIER_NPARTS], pin_parts[TIER_NPARTS], step_ns; /* time by part of the step (and pinning in it), summed over the steps */
	int host_parts; /* some step's parts are host time (TIER_PROFILE=1, or its device marks failed) */
	int profile_step; /* TIER_PROFILE_STEP=N: step N (from 1) between cudaProfilerStart and Stop */
	int ckpt_at;      /* the step after which this run last wrote OUT/checkpoint.safetensors (0: none) */
} job;

/* The dense bf16 peak of the GPU in FLOP/s for MFU: --peak-tflops, else known parts, else 0. */
static double gpu_peak(const tier_dev *dev, double given)
{
	if (given > 0)
		return given * 1e12;
	if (tier_dev_kind_of(dev) != TIER_DEV_CUDA)
		return 0;
	const char *n = tier_dev_name(dev);
	if (strstr(n, "H200") || strstr(n, "H100") || strstr(n, "H800") || strstr(n, "GH200"))
		return 989e12;
	if (strstr(n, "A100") || strstr(n, "A800"))
		return 312e12;
	return 0;
}

/* MFU's accounting: 4 x active parameters per token (forward, backward for the activations, and
 * the recompute of checkpointed layers), as the trainer issue defines it. */
static double flop_per_token(const tier_hf_config *cfg)
{
	tier_plan_model pm;
	tier_plan_params pp;
	if (tier_plan_model_from_hf(cfg, "model", &pm) || tier_plan_count(&pm, &pp))
		return 0;
	return 4.0 * (double)pp.active;
}

static void job_close(job *j)
{
	tier_trainer_destroy(j->t);
	tier_model_destroy(j->m);
	if (j->tracing && tier_store_trace_close(j->s))
		fprintf(stderr, "tier-run: --trace: %s\n", tier_last_error());
	tier_store_destroy(j->s);
	tier_data_close(j->d);
	tier_dev_close(j->dev);
	free(j->tok);
	free(j->lab);
	if (j->log)
		fclose(j->log);
	stats_log_close(j->slog);
}

static int fail_lib(const char *what)
{
	fprintf(stderr, "tier-run: %s: %s\n", what, tier_last_error());
	return 1;
}

static void fmt_eta(double s, char *buf, size_t len)
{
	if (s >= 3600)
		snprintf(buf, len, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
	else
		snprintf(buf, len, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
}

/* An HBM budget with room for the free space to split among pinned copies: the step's need counts
 * bytes, not their places. On the default model and the layer-major and MoE-chunk configs of
 * tests/test_run.sh, budgets from 1.05x to 1.13x the need were the first to run 6-8 steps (bisected
 * by MiB): 1.15x, in whole MiB. */
static uint64_t roomy_hbm(uint64_t base)
{
	return tier_align_up(base + base / 100 * 15, 1ull << 20);
}

/* Loading or making the base weights: a line every 2 s (rewritten in place on a terminal, 4 times
 * a second), with bytes, rate and ETA; nothing for a fill shorter than that. */
typedef struct {
	const char *what;
	uint64_t t0, last;
	int tty, printed, quiet;
} load_progress;

static int on_load_progress(uint64_t done, uint64_t total, void *arg)
{
	load_progress *p = arg;
	uint64_t now = tier_now_ns();
	if (stop_sig)
		return 1;
	if (p->quiet || (done < total ? now - p->last < (p->tty ? 250000000ull : 2000000000ull) : !p->printed))
		return 0;
	p->last = now, p->printed = 1;
	double el = (double)(now - p->t0) / 1e9, rate = el > 0 ? (double)done / el : 0;
	char a[32], b[32], eta[32];
	fmt_eta(rate > 0 ? (double)(total - done) / rate : 0, eta, sizeof eta);
	printf("%s# %s the base weights: %s of %s, %.2f GB/s, ETA %s%s", p->tty ? "\r" : "", p->what,
	       tier_format_size(done, a, sizeof a), tier_format_size(total, b, sizeof b), rate / 1e9, eta,
	       p->tty && done < total ? "   " : "\n");
	fflush(stdout);
	return 0;
}

/* The model's config: from --model's config.json, --config, or the default job's. */
static int job_config(const run_opts *o, tier_hf_config *cfg)
{
	char path[4200];
	if (o->model && o->init)
		return fprintf(stderr, "tier-run: give --model DIR or --init random, not both\n"), 1;
	if (o->config && !o->init)
		return fprintf(stderr, "tier-run: --config describes a model to make: add --init random (a checkpoint "
			       "directory brings its own config.json)\n"), 1;
	if (o->model) {
		snprintf(path, sizeof path, "%s/config.json", o->model);
		if (tier_hf_config_load(path, cfg))
			return fail_lib("--model");
	} else if (o->config) {
		if (tier_hf_config_load(o->config, cfg))
			return fail_lib("--config");
	} else {
		tier_model_config_default(cfg);
	}
	return 0;
}

/* The device, the data (*data: its path) and the store with its budgets, trace and prefetch window. */
static int job_store(job *j, const run_opts *o, const tier_hf_config *cfg, const char **data)
{
	int cuda = !strcmp(o->device, "cuda");
	if (tier_dev_open(&j->dev, cuda ? TIER_DEV_CUDA : TIER_DEV_CPU, 0))
		return fail_lib("--device");
	uint64_t hbm = cuda && (o->hbm_max || !o->hbm_set) ? TIER_BUDGET_MAX : o->hbm; /* clamped by the store */
	*data = o->data ? o->data : find_corpus();
	if (!*data)
		return fprintf(stderr, "tier-run: the default corpus data/corpus.txt was not found; give --data FILE\n"), 1;
	if (tier_data_open(*data, &j->d))
		return fail_lib("--data");
	if (tier_data_vocab(j->d) > cfg->vocab_size)
		return fprintf(stderr, "tier-run: --data %s has a vocabulary of %u tokens, more than the model's %lld\n",
			       *data, tier_data_vocab(j->d), (long long)cfg->vocab_size), 1;
	tier_policy_kind pol;
	if (tier_policy_parse(o->policy, &pol))
		return fail_lib("--policy");
	const char *dirs[1] = { o->nvme_dir };
	tier_store_config sc = { .dev = j->dev, .capacity = { hbm, o->ddr, o->nvme }, .nvme_dirs = dirs,
				 .n_nvme_dirs = o->nvme ? 1 : 0, .policy = pol, .publish_stats = 1,
				 .clamp_budgets = hbm == TIER_BUDGET_MAX };
	/* page-locking the DDR tier for the copy engines ran at about 1.2-1.8 GB/s on the H200 machine
	 * (60-80 s for 110 GiB): say so rather than sit silent */
	int say_pin = cuda && !o->quiet && o->ddr >= (16ull << 30);
	char dd[32];
	if (say_pin)
		printf("# pinning %s of host memory for the ddr tier (up to a minute per 100 GiB)\n",
		       tier_format_size(o->ddr, dd, sizeof dd));
	uint64_t t0 = tier_now_ns();
	if (tier_store_create(&j->s, &sc))
		return fail_lib("store");
	if (say_pin)
		printf("# pinned in %.1f s\n", (double)(tier_now_ns() - t0) / 1e9);
	tier_stats st0;
	tier_store_stats(j->s, &st0);
	j->hbm = st0.tier[TIER_HBM].capacity;
	j->peak = gpu_peak(j->dev, o->peak_tflops);
	j->flop_per_token = flop_per_token(cfg);
	tier_store_set_job(j->s, "tier-run");
	if (o->pwin >= 0)
		tier_store_set_prefetch_window(j->s, (unsigned)o->pwin);
	if (o->trace && tier_store_trace_open(j->s, o->trace))
		return fail_lib("--trace");
	j->tracing = o->trace != NULL;
	return 0;
}

/* The model's objects with their LoRA, and the trainer's settings in *tc; a trial trainer checks
 * budgets and shapes before minutes of loading or making the weights (dropped again, so that the
 * weights are placed as without it). */
static int job_model(job *j, const run_opts *o, const tier_hf_config *cfg, tier_train_cfg *tc)
{
	tier_lora_cfg lc;
	tier_lora_cfg_init(&lc);
	lc.r = o->lora_r, lc.alpha = (float)o->lora_alpha, lc.use_rslora = o->rslora, lc.seed = o->seed;
	lc.dropout = (float)o->dropout;
	if (tier_lora_targets_parse(o->targets, &lc.targets))
		return fail_lib("--lora-targets");
	if (tier_model_create(j->s, j->dev, cfg, &lc, &j->m))
		return fail_lib("model");
	tier_train_cfg_init(tc);
	tc->batch = o->batch, tc->seq = o->seq, tc->micro_batches = o->micro, tc->steps = o->steps;
	tc->warmup = o->warmup, tc->lr = (float)o->lr, tc->min_lr_ratio = (float)o->min_lr_ratio;
	tc->weight_decay = (float)o->wd, tc->clip = (float)o->clip, tc->opcache = o->opcache;
	tc->moe_chunks = o->moe_chunks, tc->layer_major = o->layer_major, tc->optim_in_forward = o->optim_fwd;
	if (o->layer_major && o->micro < 2)
		fprintf(stderr, "tier-run: --layer-major has no effect with one micro-batch (add --micro-batches N)\n");
	if (tier_trainer_create(j->m, tc, &j->t))
		return fail_lib("trainer");
	tier_trainer_destroy(j->t);
	j->t = NULL;
	return 0;
}

/* The base weights loaded (--model) or made, with progress, then the trainer, resumed when asked,
 * and the batch buffers; *bytes: the base weights' size. */
static int job_weights(job *j, const run_opts *o, const tier_train_cfg *tc, uint64_t *bytes)
{
	char a[32];
	uint64_t t0 = tier_now_ns();
	load_progress lp = { .what = o->model ? "loading" : "making", .t0 = t0, .last = t0, .tty = isatty(1),
			     .quiet = o->quiet };
	tier_model_set_progress(j->m, on_load_progress, &lp); /* quiet: only for a stop signal */
	if (o->model ? tier_model_load_hf(j->m, o->model) : tier_model_init_random(j->m, o->seed, o->init_range))
		return stop_sig ? 1 : fail_lib(o->model ? "loading the checkpoint" : "making the weights");
	double secs = (double)(tier_now_ns() - t0) / 1e9;
	*bytes = tier_model_base_bytes(j->m);
	if (!o->quiet)
		printf("# %s %s of base weights in %.2f s (%.2f GB/s)\n", o->model ? "loaded" : "made",
		       tier_format_size(*bytes, a, sizeof a), secs, secs > 0 ? (double)*bytes / secs / 1e9 : 0.0);
	if (tier_trainer_create(j->m, tc, &j->t))
		return fail_lib("trainer");
	if (o->resume && tier_trainer_load(j->t, o->resume))
		return fail_lib("--resume");
	if (o->resume && !o->quiet)
		printf("# resumed from %s after step %lld\n", o->resume, (long long)tier_trainer_steps_done(j->t));
	size_t n = (size_t)o->batch * o->seq * o->micro;
	if (!(j->tok = malloc(sizeof(int32_t) * n)) || !(j->lab = malloc(sizeof(int32_t) * n)))
		return fprintf(stderr, "tier-run: out of memory for the batch\n"), 1;
	if (tier_data_sample(j->d, o->seed, 0, o->seq, j->tok, j->lab)) /* data shorter than a sequence */
		return fail_lib("--data");
	return 0;
}

/* What the job is (model, budgets, batch), the warnings and hints before its first step. */
static void job_report(const job *j, const run_opts *o, const tier_hf_config *cfg, const char *data, uint64_t bytes)
{
	char a[32], b[32], c[32], d[32], e[32];
	if (!o->quiet)
		printf("# model %s: %lld layers, H %lld, %lld experts (top-%lld) of %lld, %lld heads / %lld KV; base %s, "
		       "LoRA r %d on %s (%llu parameters); data %s (%llu tokens)\n# budgets: hbm %s%s (the step needs "
		       "%s, %s of it scratch), ddr %s; policy %s; batch %d x %d tokens x %d micro-batches\n",
		       o->model ? o->model : "synthetic", (long long)cfg->num_hidden_layers, (long long)cfg->hidden_size,
		       (long long)cfg->num_experts, (long long)cfg->num_experts_per_tok,
		       (long long)cfg->moe_intermediate_size, (long long)cfg->num_attention_heads,
		       (long long)cfg->num_key_value_heads, tier_format_size(bytes, a, sizeof a), o->lora_r, o->targets,
		       (unsigned long long)tier_model_lora_params(j->m), data,
		       (unsigned long long)tier_data_count(j->d), tier_format_size(j->hbm, b, sizeof b),
		       tier_dev_kind_of(j->dev) == TIER_DEV_CPU ? " (emulated)" : "",
		       tier_format_size(tier_trainer_min_hbm(j->t), c, sizeof c),
		       tier_format_size(tier_trainer_scratch_bytes(j->t), e, sizeof e), tier_format_size(o->ddr, d, sizeof d),
		       o->policy, o->batch, o->seq, o->micro);
	uint64_t need = tier_trainer_min_hbm(j->t);
	if (j->hbm < roomy_hbm(need)) { /* before minutes of steps, not after a failed one */
		char h[32], nd[32], w[32];
		fprintf(stderr, "tier-run: warning: the HBM budget %s is within 15%% of what the step needs (%s): pinned "
			"copies can split the free space so that a step fails; --hbm %s or more is safer\n",
			tier_format_size(j->hbm, h, sizeof h), tier_format_size(need, nd, sizeof nd),
			tier_format_size(roomy_hbm(need), w, sizeof w));
	}
	if (o->optim_fwd && !tier_trainer_optim_in_forward(j->t))
		fprintf(stderr, "tier-run: --optimizer-at forward: the HBM budget cannot hold an optimizer set beside the "
			"step's scratch, so AdamW runs at each step's end\n");
	if (!o->quiet && o->micro > 1 && !o->layer_major && bytes > j->hbm) /* the order that streams less */
		printf("# hint: the base weights exceed --hbm, so each micro-batch fetches every layer again; "
		       "--layer-major fetches them once a step for all %d (the same losses and adapter; measured "
		       "gains in docs/trainer.md)\n", o->micro);
}

/* The output directory's step log (train_log.jsonl) and stats log. */
static int job_logs(job *j, const run_opts *o, const tier_hf_config *cfg, const char *data, uint64_t bytes)
{
	char path[4200];
	if (!o->out)
		return 0;
	snprintf(path, sizeof path, "%s/train_log.jsonl", o->out);
	if (!(j->log = fopen(path, "w")))
		return fprintf(stderr, "tier-run: %s: %s\n", path, strerror(errno)), 1;
	stats_log_info si = { .model = o->model ? o->model : "synthetic", .data = data, .policy = o->policy,
			      .lora_targets = o->targets, .layers = cfg->num_hidden_layers, .hidden = cfg->hidden_size,
			      .experts = cfg->num_experts, .top_k = cfg->num_experts_per_tok, .base_bytes = bytes,
			      .hbm = o->hbm, .ddr = o->ddr, .nvme = o->nvme, .steps = o->steps, .batch = o->batch,
			      .seq = o->seq, .micro = o->micro, .lora_r = o->lora_r, .seed = o->seed };
	return stats_log_open(&j->slog, o->out, &si) ? 1 : 0;
}

/* Model, store, data, trainer; 0, or 1 with a message printed. */
static int job_open(job *j, const run_opts *o, tier_hf_config *cfg)
{
	const char *data = NULL;
	tier_train_cfg tc;
	uint64_t bytes = 0;
	int rc = job_config(o, cfg);
	if (rc || (rc = job_store(j, o, cfg, &data)) || (rc = job_model(j, o, cfg, &tc)) ||
	    (rc = job_weights(j, o, &tc, &bytes)))
		return rc;
	job_report(j, o, cfg, data, bytes);
	return job_logs(j, o, cfg, data, bytes);
}

/* ,"name":{"embed":ns,...} of the first n parts. */
static void log_parts(FILE *f, const char *name, const uint64_t *ns, int n)
{
	fprintf(f, ",\"%s\":{", name);
	for (int p = 0; p < n; p++)
		fprintf(f, "%s\"%s\":%llu", p ? "," : "", tier_step_part_name(p), (unsigned long long)ns[p]);
	fprintf(f, "}");
}

/* One line of OUT/train_log.jsonl: the step's figures, MFU (null without a known GPU peak) and
 * its time by part (tier_step_result.ns_part). */
static void log_step(job *j, int s, const tier_step_result *r, const counters *now, const counters *prev,
		     double tps)
{
	fprintf(j->log, "{\"step\":%d,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"tokens\":%lld,\"ns\":%llu,"
		"\"hbm_hits\":%llu,\"hbm_misses\":%llu,\"bytes_moved\":%llu,\"tokens_per_s\":%.1f,\"mfu\":", s + 1,
		r->loss, r->lr, r->grad_norm, (long long)r->tokens, (unsigned long long)r->ns,
		(unsigned long long)(now->hits - prev->hits), (unsigned long long)(now->misses - prev->misses),
		(unsigned long long)(now->bytes - prev->bytes), tps);
	if (j->peak > 0 && j->flop_per_token > 0)
		fprintf(j->log, "%.4f", tps * j->flop_per_token / j->peak);
	else
		fprintf(j->log, "null");
	log_parts(j->log, "ns_part", r->ns_part, TIER_NPARTS);
	log_parts(j->log, "ns_pin_part", r->ns_pin_part, TIER_PART_PIN);
	fprintf(j->log, ",\"ops_pipelined\":%d,\"ops_finished_early\":%d,\"routes\":%d,\"updates_in_forward\":%d}\n",
		r->ops_pipelined, r->ops_finished_early, r->routes, r->updates_in_forward);
}

/* After a step refused for room in HBM whose free bytes sufficed but were split among pinned
 * copies: the budget to try, roomy_hbm of the larger of need and budget. */
static void split_hint(const job *j)
{
	if (!strstr(tier_last_error(), "split by pinned copies"))
		return;
	uint64_t need = tier_trainer_min_hbm(j->t), want = roomy_hbm(need > j->hbm ? need : j->hbm);
	char a[32], b[32];
	fprintf(stderr, "tier-run: hint: the step needs %s of HBM as bytes, but pinned copies split the free space; "
		"budgets a few percent above the need can fail this way: try --hbm %s\n",
		tier_format_size(need, a, sizeof a), tier_format_size(want, b, sizeof b));
}

static int train(job *j, const run_opts *o, double *first, double *last, double *elapsed, int64_t *tokens)
{
	int nm = o->micro;
	uint64_t t0 = tier_now_ns();
	tier_stats st;
	counters prev = read_counters(j->s, &st);
	double head = 0, tail = 0;
	int nh = 0, nt = 0, win = o->steps < 20 ? 1 : o->steps / 10;
	if (!o->quiet)
		printf("%6s %9s %9s %10s %6s %8s %10s %8s\n", "step", "loss", "lr", "tokens/s", "mfu", "hbm hit", "moved",
		       "eta");
	int s0 = (int)tier_trainer_steps_done(j->t);
	for (int s = s0; s < o->steps && !stop_sig; s++) {
		for (int mb = 0; mb < nm; mb++)
			for (int b = 0; b < o->batch; b++) {
				uint64_t idx = ((uint64_t)s * nm + mb) * o->batch + b; /* docs/data.md */
				size_t off = ((size_t)mb * o->batch + b) * o->seq;
				if (tier_data_sample(j->d, o->seed, idx, o->seq, j->tok + off, j->lab + off))
					return fail_lib("data");
			}
		tier_step_result r;
		int prof = s + 1 == j->profile_step; /* TIER_PROFILE_STEP: this step alone to the profiler */
		if ((prof && tier_dev_profiler(j->dev, 1)) || tier_trainer_step(j->t, j->tok, j->lab, &r) ||
		    (prof && tier_dev_profiler(j->dev, 0))) {
			fprintf(stderr, "tier-run: step %d: %s\n", s, tier_last_error());
			split_hint(j);
			return 2;
		}
		counters now = read_counters(j->s, &st);
		uint64_t acc = (now.hits - prev.hits) + (now.misses - prev.misses);
		double hit = acc ? 100.0 * (double)(now.hits - prev.hits) / (double)acc : 100.0;
		double el = (double)(tier_now_ns() - t0) / 1e9, tps = (double)r.tokens / ((double)r.ns / 1e9);
		char mv[32], eta[32];
		fmt_eta(el / (s - s0 + 1) * (o->steps - s - 1), eta, sizeof eta);
		if (!o->quiet)
		{
			char mfu[16] = "-";
			if (j->peak > 0 && j->flop_per_token > 0)
				snprintf(mfu, sizeof mfu, "%.1f%%", 100.0 * tps * j->flop_per_token / j->peak);
			printf("%6d %9.4f %9.2e %10.0f %6s %7.1f%% %10s %8s\n", s + 1, r.loss, r.lr, tps, mfu, hit,
			       tier_format_size(now.bytes - prev.bytes, mv, sizeof mv), eta);
		}
		if (j->log)
			log_step(j, s, &r, &now, &prev, tps);
		if (j->slog && stats_log_step(j->slog, s + 1, &r, &st, j->t))
			return 2;
		fflush(stdout);
		prev = now;
		*tokens += r.tokens;
		for (int p = 0; p < TIER_NPARTS; p++)
			j->parts[p] += r.ns_part[p], j->pin_parts[p] += r.ns_pin_part[p];
		j->host_parts |= !r.parts_on_device;
		j->step_ns += r.ns;
		if (o->ckpt_every && ((s + 1) % o->ckpt_every == 0 || s + 1 == o->steps)) {
			char path[4200];
			snprintf(path, sizeof path, "%s/checkpoint.safetensors", o->out);
			if (tier_trainer_save(j->t, path)) {
				fprintf(stderr, "tier-run: checkpoint after step %d: %s\n", s + 1, tier_last_error());
				return 2;
			}
			j->ckpt_at = s + 1;
		}
		if (s - s0 < win)
			head += r.loss, nh++;
		if (s >= o->steps - win)
			tail += r.loss, nt++;
	}
	*first = nh ? head / nh : NAN, *last = nt ? tail / nt : NAN;
	*elapsed = (double)(tier_now_ns() - t0) / 1e9;
	return 0;
}

/* " embed 2.6%, attn_fwd 4.9%, ..." for the first n parts, as shares of total. */
static void print_parts(const uint64_t *ns, int n, uint64_t total)
{
	for (int p = 0; p < n; p++)
		printf(" %s %.1f%%%s", tier_step_part_name(p), 100.0 * (double)ns[p] / (double)total, p + 1 < n ? "," : "");
}

/* What crossed into tier t, by class (for HBM with the prefetches that went unused). */
static void print_into(const tier_stats *st, int t)
{
	char c[32];
	printf("# into %s by class:", t == TIER_HBM ? "hbm" : "ddr");
	for (int k = 0, n = 0; k < TIER_STATS_NCLASSES; k++) {
		if (!st->cls[t][k].bytes_in)
			continue;
		printf("%s %s %s", n++ ? "," : "", st->class_name[k], tier_format_size(st->cls[t][k].bytes_in, c, sizeof c));
		if (t == TIER_HBM)
			printf(" (%llu prefetched unused)", (unsigned long long)st->cls[t][k].unused);
	}
	printf("\n");
}

static void summary(job *j, const run_opts *o, double first, double last, double el, int64_t tokens)
{
	tier_stats st;
	char a[32], b[32], c[32];
	tier_store_stats(j->s, &st);
	double tps = el > 0 ? (double)tokens / el : 0.0;
	printf("# done: %d steps in %.1f s, %.0f tokens/s; loss %.4f (first %d steps) -> %.4f (last)\n", o->steps, el,
	       tps, first, o->steps < 20 ? 1 : o->steps / 10, last);
	if (j->peak > 0 && j->flop_per_token > 0)
		printf("# MFU %.1f%% (4 x %.3g active parameters x %.0f tokens/s over a %.0f TFLOP/s peak, all steps "
		       "including the first)\n", 100.0 * tps * j->flop_per_token / j->peak, j->flop_per_token / 4, tps,
		       j->peak / 1e12);
	if (j->step_ns) {
		printf("# time by part of the step:");
		print_parts(j->parts, TIER_NPARTS, j->step_ns);
		printf(" (%s; pin is the host's waiting and overlaps the others)\n",
		       j->host_parts ? "host time" : "the device's time between the parts' ends");
		printf("# pinning (waiting for data, room or writebacks) by the part the host was in:");
		print_parts(j->pin_parts, TIER_PART_PIN, j->step_ns);
		printf("\n");
	}
	for (int t = 0; t < TIER_NTIERS; t++) {
		if (!st.tier[t].capacity)
			continue;
		uint64_t h = 0, m = 0, e = 0;
		for (int k = 0; k < TIER_STATS_NCLASSES; k++)
			h += st.cls[t][k].hits, m += st.cls[t][k].misses, e += st.cls[t][k].evictions;
		printf("# %-16s budget %10s  peak %10s  hits %8llu  misses %8llu  evictions %8llu\n", st.tier_name[t],
		       tier_format_size(st.tier[t].capacity, a, sizeof a), tier_format_size(st.tier[t].peak, b, sizeof b),
		       (unsigned long long)h, (unsigned long long)m, (unsigned long long)e);
	}
	if (st.tier[TIER_HBM].capacity && st.link[TIER_LINK_H2D].bytes) /* what crossed into HBM, by class */
		print_into(&st, TIER_HBM);
	if (st.tier[TIER_DDR].capacity && st.link[TIER_LINK_D2H].bytes) /* written down: what is dirty, by class */
		print_into(&st, TIER_DDR);
	for (int l = 0; l < TIER_STATS_NLINKS; l++)
		if (st.link[l].bytes)
			printf("# link %-10s %10s in %llu transfers\n", st.link_name[l],
			       tier_format_size(st.link[l].bytes, c, sizeof c), (unsigned long long)st.link[l].transfers);
	tier_cache_stats cs;
	if (!tier_trainer_cache_stats(j->t, &cs))
		printf("# op cache: %llu offers, %llu kept in hbm, %llu in ddr, %llu dropped; %llu hits, %llu misses "
		       "(%.3g recompute FLOP saved); peak %s in hbm\n", (unsigned long long)cs.total.offers,
		       (unsigned long long)cs.total.admitted[0], (unsigned long long)cs.total.admitted[1],
		       (unsigned long long)(cs.total.dropped + cs.total.rejected),
		       (unsigned long long)(cs.total.hits[0] + cs.total.hits[1]), (unsigned long long)cs.total.misses,
		       cs.total.flops_saved, tier_format_size(cs.peak[0], a, sizeof a));
	printf("# prefetch: %llu issued, %llu on time, %llu late, %llu missed, %llu evicted unused; %.2f s waited for "
	       "data\n", (unsigned long long)st.prefetch.issued, (unsigned long long)st.prefetch.on_time,
	       (unsigned long long)st.prefetch.late, (unsigned long long)st.prefetch.missed,
	       (unsigned long long)st.prefetch.wasted, (double)st.prefetch.stall_ns / 1e9);
}

static int save_adapter(job *j, const run_opts *o)
{
	tier_peft_adapter *a;
	if (tier_model_lora_export(j->m, 0, &a))
		return fail_lib("exporting the adapter");
	snprintf(a->base_model, sizeof a->base_model, "%s", o->model ? o->model : "");
	int rc = tier_peft_save(o->out, a);
	tier_peft_free(a);
	if (rc) {
		fail_lib("--out");
		if (j->ckpt_at == o->steps) /* the checkpoint holds the final LoRA state: how to get the adapter */
			fprintf(stderr, "tier-run: the adapter was not written; %s/checkpoint.safetensors holds the state "
				"after the last step: once the cause above is fixed, run the same command with --resume "
				"%s/checkpoint.safetensors and another --out (the same one would have this run's logs "
				"rewritten) to write it there\n", o->out, o->out);
		else
			fprintf(stderr, "tier-run: the adapter was not written and this run kept no checkpoint of its last "
				"step (--checkpoint-every N keeps one)\n");
		return 1;
	}
	printf("# adapter written to %s (adapter_config.json, adapter_model.safetensors)\n", o->out);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "--store-demo"))
		return store_demo_main(argc - 1, argv + 1);
	/* a line at a time into a log file or pipe as on a terminal: a job's log shows where it is */
	setvbuf(stdout, NULL, _IOLBF, 0);
	run_opts o;
	run_opts_defaults(&o);
	int rc = run_opts_parse(&o, argc, argv);
	if (rc) {
		run_opts_free(&o);
		return rc == 2 ? 0 : 1;
	}
	if (o.out && check_out_dir(o.out)) {
		run_opts_free(&o);
		return 1;
	}
	catch_stop_signals();
	job j;
	memset(&j, 0, sizeof j);
	const char *ps = getenv("TIER_PROFILE_STEP");
	j.profile_step = ps ? atoi(ps) : 0;
	tier_hf_config cfg;
	if (!o.quiet)
		printf("tier-run: LoRA fine-tuning with tiered weights (pid %ld, seed %llu)\n", (long)getpid(),
		       (unsigned long long)o.seed);
	rc = job_open(&j, &o, &cfg);
	double first = NAN, last = NAN, el = 0;
	int64_t tokens = 0;
	if (!rc)
		rc = train(&j, &o, &first, &last, &el, &tokens);
	if (!rc && !stop_sig) {
		summary(&j, &o, first, last, el, tokens);
		if (o.out)
			rc = save_adapter(&j, &o);
	}
	job_close(&j);
	run_opts_free(&o);
	if (stop_sig) {
		fprintf(stderr, "tier-run: stopped by signal %d before the end; no adapter written\n", (int)stop_sig);
		return 128 + stop_sig;
	}
	return rc;
}
