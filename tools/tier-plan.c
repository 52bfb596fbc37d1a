/* tier-plan.c - does a model fit a cluster for tiered LoRA fine-tuning, and how fast would a step run. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"

typedef struct {
	tier_plan_opts plan;
	int nodes, json, smallest, max_nodes, gpn;
	uint64_t hbm, ddr, nvme;
	double mfu;
	const char *calibrate, *targets;
} options;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-plan MODEL CLUSTER [--nodes N] [--ep N] [--seq N] [--mbs N] [--accum N [--layer-major]]\n"
		"                 [--lora-r N]\n"
		"                 [--lora-targets LIST] [--hbm-reserve SIZE] [--opcache SIZE] [--no-tiering]\n"
		"                 [--gpus-per-node N] [--hbm SIZE] [--ddr SIZE] [--nvme SIZE] [--mfu X]\n"
		"                 [--smallest [--max-nodes N]] [--calibrate FILE] [--json] [--help]\n"
		"Per-GPU bytes per tier (HBM, DDR, NVMe), whether they fit, and a roofline step time for LoRA\n"
		"fine-tuning of MODEL on CLUSTER with experts split over an EP group and the rest sharded (FSDP).\n"
		"  MODEL     an HF config.json (qwen3_moe, mixtral) or a preset: qwen3-30b-a3b, qwen3-235b-a22b,\n"
		"            mixtral-8x7b, deepseek-v3, seed-2.8t\n"
		"  CLUSTER   a node type: h200-8x, h100-8x, a100-8x-80g, or seed-128 (16 x h200-8x)\n"
		"  --nodes N           node count (default: the preset's)\n"
		"  --gpus-per-node N, --hbm SIZE (per GPU), --ddr SIZE, --nvme SIZE (per node), --mfu X\n"
		"                      override the node type (SIZE in binary units: 141G is 141 GiB)\n"
		"  --ep N              expert-parallel group size (default: the largest that divides GPUs and experts)\n"
		"  --seq N, --mbs N    sequence length and micro-batch per GPU (default: the model's)\n"
		"  --accum N           micro-batches per optimizer step (gradient accumulation, default 1)\n"
		"  --layer-major       each layer runs all N micro-batches with its weights fetched once a step\n"
		"                      (tier-run --layer-major); every micro-batch's checkpoints are kept\n"
		"  --lora-r N          LoRA rank; --lora-targets q,k,v,o,gate,up,down,router | all-linear | none\n"
		"  --hbm-reserve SIZE  HBM kept back per GPU for CUDA, NCCL, fragmentation (default 8G)\n"
		"  --opcache SIZE      op-cache budget per GPU (default: what HBM has left)\n"
		"  --no-tiering        HBM only: what fits without DDR and NVMe\n"
		"  --smallest          search the smallest node count that fits (up to --max-nodes, default 1024)\n"
		"  --calibrate FILE    take PCIe, NVMe and achieved TFLOP/s from saved tier-bench output\n"
		"  --json              one JSON object instead of the tables\n"
		"Exit status: 0 fits, 1 does not fit, 2 bad input. Formulas: docs/plan.md.\n");
}

static int parse_num(const char *opt, const char *text, long long lo, long long *out)
{
	char *end;
	errno = 0;
	long long v = strtoll(text, &end, 10);
	if (errno || *end || end == text || v < lo) {
		fprintf(stderr, "tier-plan: %s needs an integer >= %lld, not '%s'\n", opt, lo, text);
		return 1;
	}
	*out = v;
	return 0;
}

static int parse_size(const char *opt, const char *text, uint64_t *out)
{
	if (tier_parse_size(text, out)) {
		fprintf(stderr, "tier-plan: %s: %s (sizes look like 8G, 512M, 1.5T)\n", opt, tier_last_error());
		return 1;
	}
	return 0;
}

static int parse_args(int argc, char **argv, options *o)
{
	static const struct option lo[] = {
		{ "nodes", 1, 0, 'n' }, { "ep", 1, 0, 'e' }, { "seq", 1, 0, 's' }, { "mbs", 1, 0, 'b' },
		{ "accum", 1, 0, 'a' }, { "layer-major", 0, 0, 'L' },
		{ "lora-r", 1, 0, 'r' }, { "lora-targets", 1, 0, 't' }, { "hbm-reserve", 1, 0, 'R' },
		{ "opcache", 1, 0, 'c' }, { "no-tiering", 0, 0, 'T' }, { "smallest", 0, 0, 'S' },
		{ "max-nodes", 1, 0, 'M' }, { "gpus-per-node", 1, 0, 'g' }, { "hbm", 1, 0, 'H' }, { "ddr", 1, 0, 'D' },
		{ "nvme", 1, 0, 'N' }, { "mfu", 1, 0, 'u' }, { "calibrate", 1, 0, 'C' }, { "json", 0, 0, 'j' }, { "help", 0, 0, 'h' },
		{ 0, 0, 0, 0 },
	};
	tier_plan_opts_default(&o->plan);
	o->max_nodes = 1024;
	int ch;
	long long v;
	while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (ch) {
		case 'n': if (parse_num("--nodes", optarg, 1, &v)) return 2; o->nodes = (int)v; break;
		case 'e': if (parse_num("--ep", optarg, 1, &v)) return 2; o->plan.ep = (int)v; break;
		case 's': if (parse_num("--seq", optarg, 1, &v)) return 2; o->plan.seq = v; break;
		case 'b': if (parse_num("--mbs", optarg, 1, &v)) return 2; o->plan.mbs = v; break;
		case 'a': if (parse_num("--accum", optarg, 1, &v)) return 2; o->plan.accum = v; break;
		case 'L': o->plan.layer_major = 1; break;
		case 'r': if (parse_num("--lora-r", optarg, 0, &v)) return 2; o->plan.lora_r = (int)v; break;
		case 'M': if (parse_num("--max-nodes", optarg, 1, &v)) return 2; o->max_nodes = (int)v; break;
		case 'g': if (parse_num("--gpus-per-node", optarg, 1, &v)) return 2; o->gpn = (int)v; break;
		case 'H': if (parse_size("--hbm", optarg, &o->hbm)) return 2; break;
		case 'D': if (parse_size("--ddr", optarg, &o->ddr)) return 2; break;
		case 'N': if (parse_size("--nvme", optarg, &o->nvme)) return 2; break;
		case 'u': {
			char *end;
			o->mfu = strtod(optarg, &end);
			if (*end || end == optarg || !(o->mfu > 0 && o->mfu <= 1)) {
				fprintf(stderr, "tier-plan: --mfu needs a fraction in (0, 1], not '%s'\n", optarg);
				return 2;
			}
			break;
		}
		case 't': o->targets = optarg; break;
		case 'R': if (parse_size("--hbm-reserve", optarg, &o->plan.hbm_reserve)) return 2; break;
		case 'c': if (parse_size("--opcache", optarg, &o->plan.opcache_max)) return 2; break;
		case 'T': o->plan.no_tiering = 1; break;
		case 'S': o->smallest = 1; break;
		case 'C': o->calibrate = optarg; break;
		case 'j': o->json = 1; break;
		case 'h': usage(stdout); exit(0);
		default: usage(stderr); return 2;
		}
	}
	if (argc - optind != 2) {
		fprintf(stderr, "tier-plan: give MODEL and CLUSTER (tier-plan --help)\n");
		return 2;
	}
	if (o->targets && tier_plan_parse_targets(o->targets, &o->plan.lora_targets)) {
		fprintf(stderr, "tier-plan: --lora-targets: %s\n", tier_last_error());
		return 2;
	}
	if (o->targets && !o->plan.lora_targets)
		o->plan.lora_r = 0;   /* "none": no adapter at all */
	return 0;
}

static char *gib(uint64_t b, char *buf) { snprintf(buf, 16, "%.2f", b / 1073741824.0); return buf; }

static void print_targets(unsigned t, char *buf, size_t len)
{
	static const char *const w[] = { "q", "k", "v", "o", "gate", "up", "down", "router" };
	buf[0] = 0;
	for (int i = 0; i < 8; i++)
		if (t >> i & 1)
			snprintf(buf + strlen(buf), len - strlen(buf), "%s%s", buf[0] ? "," : "", w[i]);
	if (!buf[0])
		snprintf(buf, len, "none");
}

static void print_params(const tier_plan_model *m, const tier_plan_params *p)
{
	static const char *const kind[] = { "attn full", "attn linear", "attn sparse" };
	printf("# parameters by component\n#%-22s %14s %12s\n#%-22s %14s %12s\n", " component", "params", "bf16",
	       "", "(count)", "(GiB)");
	char b[16];
#define ROW(name, v) printf(" %-22s %14.4e %12s\n", name, (double)(v), gib(2 * (v), b))
	ROW("embed", p->embed);
	ROW("lm_head", p->lm_head);
	for (int i = 0; i < m->nattn; i++) {
		char name[40];
		snprintf(name, sizeof name, "%s x%lld", kind[m->attn[i].type], (long long)m->attn[i].layers);
		ROW(name, p->attn[i]);
	}
	ROW("dense mlp", p->dense_mlp);
	ROW("routed experts", p->experts);
	ROW("shared experts", p->shared);
	ROW("router", p->router);
	ROW("norms", p->norms);
	ROW("total", p->total);
	ROW("active per token", p->active);
	printf(" %-22s %14.4e %12s  (fp32 params)\n", "lora", (double)p->lora, gib(4 * p->lora, b));
#undef ROW
}

static void print_tiers(const tier_plan_result *r)
{
	char b[4][16];
	printf("# bytes per GPU by tier (GiB)\n#%-14s %10s %10s %10s %10s\n", " item", "total", "hbm", "ddr", "nvme");
	for (int i = 0; i < TIER_PLAN_NITEMS; i++)
		printf(" %-14s %10s %10s %10s %10s\n", tier_plan_item_name(i), gib(r->item[i], b[0]),
		       gib(r->place[i][0], b[1]), gib(r->place[i][1], b[2]), gib(r->place[i][2], b[3]));
	uint64_t tot = 0, cap = 0;
	for (int t = 0; t < TIER_PLAN_NTIERS; t++) {
		tot += r->used[t];
		cap += r->cap[t];
	}
	printf(" %-14s %10s %10s %10s %10s\n", "used", gib(tot, b[0]), gib(r->used[0], b[1]), gib(r->used[1], b[2]),
	       gib(r->used[2], b[3]));
	printf(" %-14s %10s %10s %10s %10s\n", "capacity", gib(cap, b[0]), gib(r->cap[0], b[1]), gib(r->cap[1], b[2]),
	       gib(r->cap[2], b[3]));
	if (r->fits)
		printf("# fits: yes, %s GiB to spare per GPU (hbm %s, ddr %s, nvme %s); the op cache takes HBM's spare and holds %.1f%% of "
		       "the forward results backward would recompute\n", gib(r->spare, b[0]), gib(r->cap[0] - r->used[0] + r->item[TIER_PLAN_OPCACHE], b[1]),
		       gib(r->cap[1] - r->used[1], b[2]), gib(r->cap[2] - r->used[2], b[3]), 100 * r->opcache_hit);
	else
		printf("# fits: NO, %s GiB short per GPU\n", gib(r->shortfall, b[0]));
}

static void print_time(const tier_plan_cluster *c, const tier_plan_result *r)
{
	printf("# step time (%lld micro-batch%s%s; every GPU its own), terms overlap: the step is the largest\n",
	       (long long)r->accum, r->accum == 1 ? "" : "es", r->layer_major ? ", layer-major" : "");
	printf("#%-9s %14s %-8s %12s %-8s %10s\n", " term", "amount", "", "rate", "", "time (s)");
	/* The network row shows the link that takes longer: NVLink inside nodes or the NICs between. */
	int ib = r->net_inter_bytes / c->net_gbps >= r->net_intra_bytes / c->nvlink_gbps;
	double rate[4] = { c->tflops * c->mfu, c->pcie_gbps, c->nvme_read_gbps / c->gpus_per_node,
			   ib ? c->net_gbps : c->nvlink_gbps };
	double amount[4] = { r->flops_total / 1e12, r->pcie_bytes / 1e9, r->nvme_bytes / 1e9,
			     (ib ? r->net_inter_bytes : r->net_intra_bytes) / 1e9 };
	const char *au[4] = { "TFLOP", "GB", "GB r+w", ib ? "GB ib" : "GB nvl" };
	const char *ru[4] = { "TFLOP/s", "GB/s", "GB/s rd", "GB/s" };
	for (int i = 0; i < TIER_PLAN_NTERMS; i++)
		printf(" %-9s %14.3f %-8s %12.2f %-8s %10.3f%s\n", tier_plan_term_name(i), amount[i], au[i], rate[i], ru[i],
		       r->t[i], i == r->bottleneck ? "  <- bottleneck" : "");
	printf("# flops: forward %.1f, recompute %.1f (op cache saves %.1f%%), backward %.1f TFLOP; network: "
	       "%.2f GB over NVLink, %.2f GB between nodes\n", r->flops[0] / 1e12, r->flops[1] / 1e12,
	       100 * r->opcache_hit, r->flops[2] / 1e12, r->net_intra_bytes / 1e9, r->net_inter_bytes / 1e9);
	printf("# summary: step %.3f s (bottleneck %s; %.3f s without overlap), %.0f tokens/s on %d GPUs\n",
	       r->step_s, tier_plan_term_name(r->bottleneck), r->serial_s, r->tokens_per_s, r->gpus);
}

/* A name as a JSON string body: a model named by its config.json path may hold any byte. */
static const char *json_str(const char *in, char *out, size_t len)
{
	size_t o = 0;
	for (; *in && o + 7 < len; in++) {
		unsigned char ch = (unsigned char)*in;
		if (ch == '"' || ch == '\\')
			o += (size_t)snprintf(out + o, len - o, "\\%c", ch);
		else if (ch < 0x20)
			o += (size_t)snprintf(out + o, len - o, "\\u%04x", ch);
		else
			out[o++] = (char)ch;
	}
	out[o] = 0;
	return out;
}

static void print_json(const tier_plan_model *m, const tier_plan_cluster *c, const tier_plan_result *r)
{
	const tier_plan_params *p = &r->params;
	char name[8 * sizeof m->name];
	printf("{\"model\":\"%s\",\"cluster\":\"%s\",\"nodes\":%d,\"gpus\":%d,\"ep\":%d,\"dp\":%d,\"seq\":%lld,"
	       "\"mbs\":%lld,\"accum\":%lld,\"layer_major\":%s,\"params\":{\"embed\":%llu,\"lm_head\":%llu,\"attn\":%llu,\"dense_mlp\":%llu,"
	       "\"experts\":%llu,\"shared\":%llu,\"router\":%llu,\"norms\":%llu,\"total\":%llu,\"active\":%llu,"
	       "\"lora\":%llu},\"bytes_per_gpu\":{", json_str(m->name, name, sizeof name), c->name, c->nodes, r->gpus, r->ep, r->dp,
	       (long long)r->seq, (long long)r->mbs, (long long)r->accum, r->layer_major ? "true" : "false",
	       (unsigned long long)p->embed, (unsigned long long)p->lm_head,
	       (unsigned long long)(p->attn[0] + p->attn[1] + p->attn[2]), (unsigned long long)p->dense_mlp,
	       (unsigned long long)p->experts, (unsigned long long)p->shared, (unsigned long long)p->router,
	       (unsigned long long)p->norms, (unsigned long long)p->total, (unsigned long long)p->active,
	       (unsigned long long)p->lora);
	for (int i = 0; i < TIER_PLAN_NITEMS; i++)
		printf("%s\"%s\":{\"total\":%llu,\"hbm\":%llu,\"ddr\":%llu,\"nvme\":%llu}", i ? "," : "",
		       tier_plan_item_name(i), (unsigned long long)r->item[i], (unsigned long long)r->place[i][0],
		       (unsigned long long)r->place[i][1], (unsigned long long)r->place[i][2]);
	printf("},\"capacity\":{\"hbm\":%llu,\"ddr\":%llu,\"nvme\":%llu},\"fits\":%s,\"spare\":%llu,\"shortfall\":%llu,"
	       "\"opcache_hit\":%.4f,\"flops\":%.6e,\"pcie_bytes\":%.6e,\"nvme_bytes\":%.6e,\"net_intra_bytes\":%.6e,"
	       "\"net_inter_bytes\":%.6e,\"time_s\":{", (unsigned long long)r->cap[0], (unsigned long long)r->cap[1],
	       (unsigned long long)r->cap[2], r->fits ? "true" : "false", (unsigned long long)r->spare,
	       (unsigned long long)r->shortfall, r->opcache_hit, r->flops_total, r->pcie_bytes, r->nvme_bytes,
	       r->net_intra_bytes, r->net_inter_bytes);
	for (int i = 0; i < TIER_PLAN_NTERMS; i++)
		printf("%s\"%s\":%.6f", i ? "," : "", tier_plan_term_name(i), r->t[i]);
	printf("},\"step_s\":%.6f,\"serial_s\":%.6f,\"bottleneck\":\"%s\",\"tokens_per_s\":%.1f}\n", r->step_s,
	       r->serial_s, tier_plan_term_name(r->bottleneck), r->tokens_per_s);
}

int main(int argc, char **argv)
{
	options o = { 0 };
	int rc = parse_args(argc, argv, &o);
	if (rc)
		return rc;
	tier_plan_model m;
	tier_plan_cluster c;
	if (tier_plan_model_load(argv[optind], &m) || tier_plan_cluster_preset(argv[optind + 1], &c)) {
		fprintf(stderr, "tier-plan: %s\n", tier_last_error());
		return 2;
	}
	unsigned found = 0;
	if (o.calibrate && tier_plan_calibrate(o.calibrate, &c, &found)) {
		fprintf(stderr, "tier-plan: --calibrate: %s\n", tier_last_error());
		return 2;
	}
	if (o.nodes)
		c.nodes = o.nodes;
	if (o.gpn)
		c.gpus_per_node = o.gpn;
	if (o.hbm)
		c.hbm_per_gpu = o.hbm;
	if (o.ddr)
		c.ddr_per_node = o.ddr;
	if (o.nvme)
		c.nvme_per_node = o.nvme;
	if (o.mfu > 0)
		c.mfu = o.mfu;
	tier_plan_result r;
	if (o.smallest) {
		int n;
		if ((rc = tier_plan_smallest(&m, &c, &o.plan, o.max_nodes, &n, &r))) {
			fprintf(stderr, "tier-plan: %s\n", tier_last_error());
			return rc == -ENOSPC ? 1 : 2;
		}
		c.nodes = n;
	} else if (tier_plan_run(&m, &c, &o.plan, &r)) {
		fprintf(stderr, "tier-plan: %s\n", tier_last_error());
		return 2;
	}
	if (o.json) {
		print_json(&m, &c, &r);
		return r.fits ? 0 : 1;
	}
	char tg[64];
	int rank = o.plan.lora_r >= 0 ? o.plan.lora_r : m.lora_r;
	print_targets(rank == 0 ? 0 : o.plan.lora_targets ? o.plan.lora_targets : m.lora_targets, tg, sizeof tg);
	printf("# tier-plan: %s on %s: %d node%s x %d GPUs = %d GPUs%s\n", m.name, c.name, c.nodes,
	       c.nodes == 1 ? "" : "s", c.gpus_per_node, r.gpus, o.smallest ? " (the smallest that fits)" : "");
	printf("# layout: EP %d x FSDP %d (%lld experts per GPU per layer); seq %lld, micro-batch %lld x %lld a step%s; "
	       "LoRA r=%d on %s\n", r.ep, r.dp, (long long)r.experts_per_gpu, (long long)r.seq, (long long)r.mbs,
	       (long long)r.accum, r.layer_major ? " (layer-major)" : "", rank, tg);
	printf("# rates: %.0f TFLOP/s x MFU %.3g, PCIe %.1f GB/s, NVMe %.1f GB/s read per node, NVLink %.0f GB/s, "
	       "network %.1f GB/s per GPU%s%s\n", c.tflops, c.mfu, c.pcie_gbps, c.nvme_read_gbps, c.nvlink_gbps,
	       c.net_gbps, found ? " (calibrated: " : "", found ? (found == 7 ? "all)" : "some)") : "");
	if (o.plan.no_tiering)
		printf("# tiering off: HBM only\n");
	if (m.note[0])
		printf("# note: %s\n", m.note);
	print_params(&m, &r.params);
	print_tiers(&r);
	print_time(&c, &r);
	return r.fits ? 0 : 1;
}
