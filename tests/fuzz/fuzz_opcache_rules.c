/* fuzz_opcache_rules.c - fuzz target for --op-cache rules (tier_cache_config_parse): the input is
 * the rule text (cut at its first NUL, as a command line argument would be). An accepted text
 * answers tier_cache_rules_match for every kind over a span of layers; a refused one says why and
 * leaves the output as it was. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_opcache_rules";
int fuzz_accepted;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *text = malloc(size + 1);
	if (!text)
		return 0;
	memcpy(text, data, size);
	text[size] = '\0';
	tier_cache_config cfg, before;
	memset(&cfg, 0x5a, sizeof cfg);
	before = cfg;
	tier_clear_error();
	if (tier_cache_config_parse(text, &cfg) != 0) {
		if (memcmp(&cfg, &before, sizeof cfg) || tier_last_error()[0] == '\0')
			__builtin_trap();
	} else {
		fuzz_accepted = 1;
		for (int k = 0; k < TIER_NOPKINDS; k++)
			for (uint32_t l = 0; l < 300; l += 7)
				(void)tier_cache_rules_match(&cfg, (tier_op_kind)k, l);
		(void)tier_cache_rules_match(&cfg, TIER_OP_MATMUL, UINT32_MAX);
	}
	free(text);
	return 0;
}
