/* tier-bench.c - benchmarks of the engine's parts, one subcommand each, with tables that compare
 * against a peer measured in the same run. */
#include "config.h"
#include <stdio.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"

/* The subcommands. Adding one: a line here, its function in bench.h, its file in tools/local.mk. */
static const struct {
	const char *name;
	const char *what;
	int (*run)(int argc, char **argv);
} subcommands[] = {
	{ "store", "acquire+release cost of hits per tier and misses per source->target, vs memcpy", bench_store },
	{ "sched", "the host's cost of announcing a scheduled operation (tier_store_at_op) vs its own pins", bench_sched },
	{ "loss", "chunked cross-entropy: fwd, bwd, fused fwd+bwd time and extra memory (peers: bench/loss_torch.py)", bench_loss },
	{ "attn", "causal flash attention with GQA: fwd, bwd, fwd+bwd time and TFLOP/s (peer: bench/attn_torch.py)", bench_attn },
	{ "h2d", "offload engine DDR->HBM copies vs pinned cudaMemcpyAsync (memcpy without a GPU)", bench_h2d },
	{ "d2h", "offload engine HBM->DDR copies vs pinned cudaMemcpyAsync (memcpy without a GPU)", bench_d2h },
	{ "nvme-read", "offload engine NVMe->DDR reads (O_DIRECT, io_uring) vs fio (or dd)", bench_nvme_read },
	{ "nvme-write", "offload engine DDR->NVMe writes (O_DIRECT, io_uring) vs fio (or dd)", bench_nvme_write },
	{ "nvme-to-hbm", "offload engine NVMe->HBM through the staging ring vs fio reads", bench_nvme_to_hbm },
	{ "opcache", "op cache: step time of full recompute vs keep-what-fits vs the selective cache", bench_opcache },
	{ "prefetch", "layer loop with weights in DDR at 4x the HBM budget: prefetch vs all resident vs demand", bench_prefetch },
	{ "moe", "MoE block: router, permute, experts, combine, fwd and fwd+bwd, uniform and Zipf routing (peer: bench/moe_torch.py)", bench_moe },
	{ "fused", "the trainer's fused CUDA steps (q/k norm + RoPE both ways, norm backward + residual, paired dA) vs the separate steps they replaced", bench_fused },
	{ "lora", "the experts' LoRA backward kernels (rank products, weight-gradient reductions by tile) vs a device-to-device copy", bench_lora },
};

#define NSUB (sizeof subcommands / sizeof subcommands[0])

static void usage(FILE *f)
{
	fprintf(f, "Usage: tier-bench SUBCOMMAND [options]   (tier-bench SUBCOMMAND --help for its options)\n"
		   "Benchmarks of tier's parts. Tables follow nccl-tests: '#' comment lines, a header and a\n"
		   "units row, fixed-width rows, a '#' summary line; each compares against a peer measured in\n"
		   "the same run.\n\nSubcommands:\n");
	for (size_t i = 0; i < NSUB; i++)
		fprintf(f, "  %-12s %s\n", subcommands[i].name, subcommands[i].what);
	fprintf(f, "\nExit status: 0 done, 1 bad arguments, 2 the benchmark failed (message on stderr).\n");
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		return 1;
	}
	if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
		usage(stdout);
		return 0;
	}
	for (size_t i = 0; i < NSUB; i++)
		if (!strcmp(argv[1], subcommands[i].name))
			return subcommands[i].run(argc - 1, argv + 1);
	fprintf(stderr, "tier-bench: no subcommand '%s'; the subcommands are:", argv[1]);
	for (size_t i = 0; i < NSUB; i++)
		fprintf(stderr, " %s", subcommands[i].name);
	fprintf(stderr, " (see tier-bench --help)\n");
	return 1;
}
