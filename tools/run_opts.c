/* run_opts.c - tier-run's options: the usage text, the option table, the value parsers and
 * CONFIG.json job files, whose keys are the long options (docs/trainer.md). */
#include "config.h"
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "run_opts.h"
#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#endif

void run_opts_usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-run [CONFIG.json] [options]\n"
		"LoRA fine-tuning of a Mixture-of-Experts model (qwen3_moe, mixtral) whose weights live in a tiered store\n"
		"(HBM, DDR, NVMe) within the budgets given. With no arguments it runs the default job: a small\n"
		"qwen3_moe model made deterministically (6 layers, H 128, 16 experts of 128, top-2, 17 MB) trained\n"
		"with LoRA on attention and experts on data/corpus.txt for 800 steps, with a 14 MiB HBM budget\n"
		"(emulated in host memory without a GPU) so that the store evicts and prefetches.\n"
		"CONFIG.json: an object whose keys are the long options below without '--' (\"steps\": 100,\n"
		"\"rslora\": true); options on the command line override it. Unknown keys are errors.\n"
		"\n"
		"Model\n"
		"  --model DIR          Hugging Face checkpoint directory (config.json + safetensors)\n"
		"  --init random        synthetic weights instead of a checkpoint (needs --config, or the default model)\n"
		"  --config FILE        config.json of the model to make with --init random\n"
		"  --init-range X       std of the synthetic linear and embedding weights (default 0.1; HF uses 0.02)\n"
		"Data\n"
		"  --data FILE          a TIERTOK1 token file or a text file (byte-level; docs/data.md);\n"
		"                       default data/corpus.txt (searched in ., .. and the installed data directory)\n"
		"LoRA\n"
		"  --lora-r N           rank (default 8)\n"
		"  --lora-alpha X       lora_alpha; scale alpha / r (default 16)\n"
		"  --rslora             scale alpha / sqrt(r)\n"
		"  --lora-dropout P     PEFT's lora_dropout on the adapters' input while training (default 0;\n"
		"                       attention and dense-MLP targets)\n"
		"  --lora-targets LIST  comma-separated q,k,v,o,mlp,experts (or attn, all); default q,k,v,o,experts\n"
		"Training\n"
		"  --steps N            optimizer steps (default 800)\n"
		"  --batch N            sequences per micro-batch (default 4)\n"
		"  --seq N              tokens per sequence (default 64)\n"
		"  --micro-batches N    gradient accumulation (default 1)\n"
		"  --moe-chunks N       run each MoE block over the micro-batch in N token chunks (default 1): a\n"
		"                       smaller scratch for a larger batch under --hbm; batch x seq must divide\n"
		"                       by N; not with the router's aux loss (output_router_logits)\n"
		"  --layer-major        with --micro-batches N: each layer's forward and backward runs all N\n"
		"                       micro-batches, its weights fetched once a step, not N times (the same\n"
		"                       losses; N micro-batches' layer inputs kept, spilled to --ddr)\n"
		"  --optimizer-at WHEN  end: AdamW at each step's end (default); forward: each layer's update\n"
		"                       just before its next forward, its state's transfers overlapping the\n"
		"                       layer before (the same updates; needs HBM for an optimizer set beside\n"
		"                       the step's scratch, else end)\n"
		"  --lr X               peak learning rate (default 1e-2)\n"
		"  --warmup N           linear warmup steps (default 20), then cosine\n"
		"  --min-lr-ratio X     the cosine's floor as a fraction of --lr (default 0.1)\n"
		"  --weight-decay X     AdamW decoupled weight decay (default 0)\n"
		"  --clip X             global gradient-norm clip, 0 for none (default 1)\n"
		"  --seed N             seed of the weights, LoRA init and data order (default 1)\n"
		"Store\n"
		"  --hbm SIZE|max       HBM budget (default 14M on the CPU; on CUDA max: all the GPU's free\n"
		"                       memory but a reserve for the CUDA context and libraries)\n"
		"  --ddr SIZE           DDR budget (default 256M)\n"
		"  --nvme DIR:SIZE      NVMe directory and budget (default: no NVMe tier)\n"
		"  --policy P           lru, lfu, cost or schedule (default schedule)\n"
		"  --prefetch-window N  operations of the step's schedule fetched ahead (default 2; 0: none)\n"
		"  --device D           cpu or cuda (default cpu). cuda: bf16 weights, fp32 LoRA and optimizer\n"
		"  --peak-tflops X      the GPU's dense bf16 peak for MFU (default: known for H100/H200, 989)\n"
		"  --trace FILE         record every store access into FILE (docs/trace.md; replay it with tier-tune)\n"
		"  --op-cache RULES     keep forward results for the backward instead of recomputing them, e.g.\n"
		"                       \"all:hbm=40G\" or \"attention:layers=0-47/2:hbm=8G:ddr=32G\" (docs/opcache.md;\n"
		"                       default none: every layer is recomputed in the backward). Under a tight\n"
		"                       --hbm, \"attention:ddr=16G\" keeps the attention's output in DDR only\n"
		"Output\n"
		"  --out DIR            write the PEFT adapter (adapter_config.json, adapter_model.safetensors)\n"
		"                       and train_log.jsonl there (created if missing; checked before training),\n"
		"                       with stats.jsonl, run.json and tier.pid (docs/stats-log.md; tier-stat report)\n"
		"  --checkpoint-every N write OUT/checkpoint.safetensors every N steps and at the end (needs --out)\n"
		"  --resume FILE        continue from a checkpoint (same model, LoRA and data options; the\n"
		"                       losses then equal an uninterrupted run's)\n"
		"  --quiet              only the summary\n"
		"  --store-demo ...     the store demonstration instead (tier-run --store-demo --help)\n"
		"  --help               this text\n"
		"Sizes take binary units: 12M, 1G, 512k.\n"
		"Each step prints: step, loss, lr, tokens/s, HBM hit rate (acquires that found their data in\n"
		"HBM), bytes moved between tiers in the step, ETA.\n"
		"Exit status: 0 done, 1 bad arguments or input, 2 a failure while training, 128+N stopped by signal N.\n");
}

enum {
	O_MODEL = 256, O_INIT, O_CONFIG, O_INITR, O_DATA, O_R, O_ALPHA, O_RSLORA, O_TARGETS, O_STEPS, O_BATCH, O_SEQ,
	O_MICRO, O_LR, O_WARMUP, O_MINLR, O_WD, O_CLIP, O_SEED, O_HBM, O_DDR, O_NVME, O_POLICY, O_DEVICE, O_OUT,
	O_QUIET, O_HELP, O_CKPT, O_RESUME,
	O_TRACE, O_PEAK, O_OPCACHE, O_PWIN, O_DROPOUT, O_MOECHUNKS, O_LMAJOR, O_OPTAT,
};
static const struct option opts[] = {
	{ "model", required_argument, NULL, O_MODEL }, { "init", required_argument, NULL, O_INIT },
	{ "config", required_argument, NULL, O_CONFIG }, { "init-range", required_argument, NULL, O_INITR },
	{ "data", required_argument, NULL, O_DATA }, { "lora-r", required_argument, NULL, O_R },
	{ "lora-alpha", required_argument, NULL, O_ALPHA }, { "rslora", no_argument, NULL, O_RSLORA },
	{ "lora-targets", required_argument, NULL, O_TARGETS }, { "steps", required_argument, NULL, O_STEPS },
	{ "batch", required_argument, NULL, O_BATCH }, { "seq", required_argument, NULL, O_SEQ },
	{ "micro-batches", required_argument, NULL, O_MICRO }, { "lr", required_argument, NULL, O_LR },
	{ "warmup", required_argument, NULL, O_WARMUP }, { "min-lr-ratio", required_argument, NULL, O_MINLR },
	{ "weight-decay", required_argument, NULL, O_WD }, { "clip", required_argument, NULL, O_CLIP },
	{ "seed", required_argument, NULL, O_SEED }, { "hbm", required_argument, NULL, O_HBM },
	{ "ddr", required_argument, NULL, O_DDR }, { "nvme", required_argument, NULL, O_NVME },
	{ "policy", required_argument, NULL, O_POLICY }, { "device", required_argument, NULL, O_DEVICE },
	{ "out", required_argument, NULL, O_OUT }, { "quiet", no_argument, NULL, O_QUIET },
	{ "help", no_argument, NULL, O_HELP }, { "checkpoint-every", required_argument, NULL, O_CKPT },
	{ "resume", required_argument, NULL, O_RESUME },
	{ "trace", required_argument, NULL, O_TRACE }, { "peak-tflops", required_argument, NULL, O_PEAK },
	{ "op-cache", required_argument, NULL, O_OPCACHE }, { "prefetch-window", required_argument, NULL, O_PWIN },
	{ "lora-dropout", required_argument, NULL, O_DROPOUT }, { "moe-chunks", required_argument, NULL, O_MOECHUNKS },
	{ "layer-major", no_argument, NULL, O_LMAJOR }, { "optimizer-at", required_argument, NULL, O_OPTAT },
	{ NULL, 0, NULL, 0 },
};

static int bad_arg(const char *opt, const char *text, const char *want)
{
	fprintf(stderr, "tier-run: --%s needs %s, not '%s'\n", opt, want, text);
	return 1;
}

static int parse_int(const char *opt, const char *t, int lo, int hi, int *out)
{
	char *end;
	long v = strtol(t, &end, 10);
	if (*end || end == t || v < lo || v > hi) {
		char want[64];
		snprintf(want, sizeof want, "a whole number from %d to %d", lo, hi);
		return bad_arg(opt, t, want);
	}
	*out = (int)v;
	return 0;
}

static int parse_real(const char *opt, const char *t, double lo, double *out)
{
	char *end;
	double v = strtod(t, &end);
	if (*end || end == t || !isfinite(v) || v < lo)
		return bad_arg(opt, t, lo > 0 ? "a positive number" : "a number >= 0");
	*out = v;
	return 0;
}

static int parse_one(run_opts *o, int c, const char *a)
{
	const char *name = "";
	for (const struct option *p = opts; p->name; p++)
		if (p->val == c)
			name = p->name;
	switch (c) {
	case O_MODEL: o->model = a; return 0;
	case O_INIT:
		if (strcmp(a, "random"))
			return bad_arg(name, a, "'random'");
		o->init = a;
		return 0;
	case O_CONFIG: o->config = a; return 0;
	case O_INITR: return parse_real(name, a, 1e-30, &o->init_range);
	case O_DATA: o->data = a; return 0;
	case O_R: return parse_int(name, a, 1, 4096, &o->lora_r);
	case O_ALPHA: return parse_real(name, a, 1e-30, &o->lora_alpha);
	case O_RSLORA: o->rslora = 1; return 0;
	case O_DROPOUT:
		if (parse_real(name, a, 0, &o->dropout))
			return 1;
		return o->dropout < 1 ? 0 : bad_arg(name, a, "a probability in [0, 1)");
	case O_TARGETS: o->targets = a; return 0;
	case O_STEPS: return parse_int(name, a, 1, 100000000, &o->steps);
	case O_BATCH: return parse_int(name, a, 1, 1 << 20, &o->batch);
	case O_SEQ: return parse_int(name, a, 1, 1 << 20, &o->seq);
	case O_MICRO: return parse_int(name, a, 1, 1 << 20, &o->micro);
	case O_LR: return parse_real(name, a, 0, &o->lr);
	case O_WARMUP: return parse_int(name, a, 0, 100000000, &o->warmup);
	case O_MINLR: return parse_real(name, a, 0, &o->min_lr_ratio);
	case O_WD: return parse_real(name, a, 0, &o->wd);
	case O_PEAK: return parse_real(name, a, 0, &o->peak_tflops);
	case O_CLIP: return parse_real(name, a, 0, &o->clip);
	case O_SEED: {
		char *end;
		o->seed = strtoull(a, &end, 0);
		return *end || end == a || a[0] == '-' ? bad_arg(name, a, "a number") : 0;
	}
	case O_HBM: case O_DDR:
		o->hbm_max = c == O_HBM ? !strcmp(a, "max") : o->hbm_max;
		o->hbm_set |= c == O_HBM;
		if (c == O_HBM && o->hbm_max) {
			o->hbm = 0;
			return 0;
		}
		if (tier_parse_size(a, c == O_HBM ? &o->hbm : &o->ddr)) {
			fprintf(stderr, "tier-run: --%s: %s\n", name, tier_last_error());
			return 1;
		}
		return 0;
	case O_NVME: {
		const char *colon = strrchr(a, ':');
		if (!colon || colon == a || (size_t)(colon - a) >= sizeof o->nvme_dir)
			return bad_arg(name, a, "DIR:SIZE (e.g. /scratch/tier:8G)");
		memcpy(o->nvme_dir, a, (size_t)(colon - a));
		o->nvme_dir[colon - a] = 0;
		if (tier_parse_size(colon + 1, &o->nvme)) {
			fprintf(stderr, "tier-run: --nvme: %s\n", tier_last_error());
			return 1;
		}
		return 0;
	}
	case O_POLICY: o->policy = a; return 0;
	case O_DEVICE:
		if (strcmp(a, "cpu") && strcmp(a, "cuda"))
			return bad_arg(name, a, "cpu or cuda");
		o->device = a;
		return 0;
	case O_OUT: o->out = a; return 0;
	case O_QUIET: o->quiet = 1; return 0;
	case O_CKPT: return parse_int(name, a, 1, 100000000, &o->ckpt_every);
	case O_RESUME: o->resume = a; return 0;
	case O_TRACE: o->trace = a; return 0;
	case O_PWIN: return parse_int(name, a, 0, 64, &o->pwin);
	case O_MOECHUNKS: return parse_int(name, a, 1, 1 << 20, &o->moe_chunks);
	case O_LMAJOR: o->layer_major = 1; return 0;
	case O_OPTAT:
		if (strcmp(a, "end") && strcmp(a, "forward"))
			return bad_arg(name, a, "end or forward");
		o->optim_fwd = !strcmp(a, "forward");
		return 0;
	case O_OPCACHE: {
		tier_cache_config cc;
		if (tier_cache_config_parse(a, &cc)) {
			fprintf(stderr, "tier-run: --op-cache %s: %s\n", a, tier_last_error());
			return 1;
		}
		o->opcache = a;
		return 0;
	}
	}
	return 1;
}

/* CONFIG.json: {"key": value} for each long option; values are strings, numbers or booleans. */
int run_opts_file(run_opts *o, const char *path)
{
#ifdef TIER_HAVE_JANSSON
	json_error_t err;
	json_t *root = json_load_file(path, 0, &err);
	if (!root) {
		fprintf(stderr, "tier-run: %s:%d: %s\n", path, err.line, err.text);
		return 1;
	}
	if (!json_is_object(root)) {
		fprintf(stderr, "tier-run: %s: the job file must hold one JSON object of options\n", path);
		json_decref(root);
		return 1;
	}
	const char *key;
	json_t *v;
	json_object_foreach(root, key, v) {
		const struct option *p;
		for (p = opts; p->name && strcmp(p->name, key); p++)
			;
		if (!p->name || p->val == O_HELP) {
			fprintf(stderr, "tier-run: %s: \"%s\" is not an option of tier-run (see tier-run --help)\n", path, key);
			json_decref(root);
			return 1;
		}
		char buf[64], *s;
		if (p->has_arg == no_argument) {
			if (!json_is_boolean(v)) {
				fprintf(stderr, "tier-run: %s: \"%s\" must be true or false\n", path, key);
				json_decref(root);
				return 1;
			}
			if (json_is_true(v) && parse_one(o, p->val, ""))
				return json_decref(root), 1;
			continue;
		}
		if (json_is_string(v))
			s = strdup(json_string_value(v));
		else if (json_is_integer(v))
			snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v)), s = strdup(buf);
		else if (json_is_real(v))
			snprintf(buf, sizeof buf, "%.17g", json_real_value(v)), s = strdup(buf);
		else {
			fprintf(stderr, "tier-run: %s: \"%s\" must be a string or a number\n", path, key);
			json_decref(root);
			return 1;
		}
		if (!s || o->nkept == (int)(sizeof o->kept / sizeof o->kept[0])) {
			free(s);
			fprintf(stderr, "tier-run: %s: out of memory\n", path);
			json_decref(root);
			return 1;
		}
		o->kept[o->nkept++] = s; /* the options keep pointers into these strings */
		if (parse_one(o, p->val, s)) {
			fprintf(stderr, "tier-run: (in %s)\n", path);
			json_decref(root);
			return 1;
		}
	}
	json_decref(root);
	return 0;
#else
	(void)o;
	fprintf(stderr, "tier-run: %s: this build has no JSON library (jansson); give the options on the command "
		"line\n", path);
	return 1;
#endif
}

void run_opts_defaults(run_opts *o)
{
	*o = (run_opts){ .policy = "schedule", .device = "cpu", .targets = "q,k,v,o,experts", .hbm = 14ull << 20,
			 .ddr = 256ull << 20, .lora_r = 8, .steps = 800, .batch = 4, .seq = 64, .micro = 1, .warmup = 20,
			 .lora_alpha = 16, .pwin = -1, .lr = 1e-2, .min_lr_ratio = 0.1, .clip = 1, .init_range = 0.1,
			 .seed = 1 };
}

int run_opts_parse(run_opts *o, int argc, char **argv)
{
	int c;
	if (argc > 1 && argv[1][0] != '-') {
		if (run_opts_file(o, argv[1]))
			return 1;
		argv[1] = argv[0];
		argv++, argc--;
	}
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		if (c == O_HELP || c == 'h') {
			run_opts_usage(stdout);
			return 2;
		}
		if (c == '?' || parse_one(o, c, optarg)) {
			fprintf(stderr, "tier-run: see tier-run --help\n");
			return 1;
		}
	}
	if (optind < argc)
		return fprintf(stderr, "tier-run: unexpected argument '%s' (a job file comes first; see --help)\n",
			       argv[optind]), 1;
	if (o->ckpt_every && !o->out)
		return fprintf(stderr, "tier-run: --checkpoint-every writes into --out DIR: give one\n"), 1;
	return 0;
}

void run_opts_free(run_opts *o)
{
	for (int i = 0; i < o->nkept; i++)
		free(o->kept[i]);
	o->nkept = 0;
}
