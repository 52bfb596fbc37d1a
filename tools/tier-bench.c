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
	{ "loss", "chunked cross-entropy: fwd, bwd, fused fwd+bwd time and extra memory (peers: bench/loss_torch.py)", bench_loss },
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
