/* fuzz_data.c - fuzz target for training data files (tier_data_open: a TIERTOK1 token file, else
 * byte-level text): an accepted file's sampled sequences hold tokens and labels below its vocab
 * size; a refusal says why. */
#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/model.h"
#include "fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_data";
int fuzz_accepted;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fz_write("tokens", data, size);
	tier_data *d = NULL;
	tier_clear_error();
	if (fz_refused(tier_data_open(fz_path("tokens"), &d), d))
		return 0;
	fuzz_accepted = 1;
	uint32_t vocab = tier_data_vocab(d);
	int32_t tok[8], lab[8];
	for (int seq = 1; seq <= 8; seq++) {
		tier_clear_error();
		if (tier_data_sample(d, 7, (uint64_t)seq, seq, tok, lab) != 0) {
			if (tier_data_count(d) >= (uint64_t)seq + 1 || tier_last_error()[0] == '\0')
				__builtin_trap(); /* refused only when shorter than a sequence, and said so */
			continue;
		}
		for (int i = 0; i < seq; i++)
			if (tok[i] < 0 || (uint32_t)tok[i] >= vocab || lab[i] < 0 || (uint32_t)lab[i] >= vocab)
				__builtin_trap();
	}
	tier_data_close(d);
	return 0;
}
