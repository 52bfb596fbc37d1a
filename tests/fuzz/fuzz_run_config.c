/* fuzz_run_config.c - fuzz target for tier-run's CONFIG.json job files (run_opts_file): an
 * accepted file leaves every option within the range its parser allows (the command line's); a
 * refused one frees what it kept. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "tier/base.h"
#include "run_opts.h"
#include "fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_run_config";
int fuzz_accepted;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fz_write("job.json", data, size);
	run_opts o;
	run_opts_defaults(&o);
	if (run_opts_file(&o, fz_path("job.json")) != 0) {
		run_opts_free(&o);
		return 0;
	}
	fuzz_accepted = 1;
	if (o.steps < 1 || o.steps > 100000000 || o.batch < 1 || o.batch > (1 << 20) || o.seq < 1 || o.seq > (1 << 20) ||
	    o.micro < 1 || o.micro > (1 << 20) || o.moe_chunks < 0 || o.moe_chunks > (1 << 20) || o.ckpt_every < 0 ||
	    o.warmup < 0 || o.lora_r < 1 || o.lora_r > 4096 || !(o.lr >= 0) || !isfinite(o.lr) || !(o.dropout >= 0) ||
	    !(o.dropout < 1) || !(o.lora_alpha > 0) || o.pwin < -1 || o.pwin > 64 || o.nkept > 64 ||
	    (strcmp(o.device, "cpu") && strcmp(o.device, "cuda")) || strlen(o.nvme_dir) >= sizeof o.nvme_dir)
		__builtin_trap();
	run_opts_free(&o);
	return 0;
}
