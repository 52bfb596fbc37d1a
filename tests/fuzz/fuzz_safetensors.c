/* fuzz_safetensors.c - libFuzzer target for the safetensors header parser (tier_st_parse_header). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "tier/base.h"
#include "tier/formats.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_safetensors";
int fuzz_accepted;

/* The input is the start of a file; the first byte also picks the claimed file size (the input
 * alone, or larger as if the data region went on), so the bounds checks see both cases. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	tier_st *st = NULL;
	tier_clear_error();
	uint64_t file_size = size + (size > 0 && (data[0] & 1) ? (uint64_t)data[size - 1] * 4096 : 0);
	int rc = tier_st_parse_header(data, size, file_size, "fuzz", &st);
	if (rc == 0) {
		fuzz_accepted = 1;
		/* Everything the parser accepted must be self-consistent. */
		uint64_t pos = 0;
		for (size_t i = 0; i < tier_st_count(st); i++) {
			const tier_st_tensor *t = tier_st_at(st, i);
			if (tier_st_find(st, t->name) != t || t->nbytes != tier_st_numel(t) * tier_dtype_size(t->dtype))
				__builtin_trap();
			if (i == 0)
				pos = t->offset;
			if (t->offset != pos || t->offset + t->nbytes > file_size)
				__builtin_trap();
			pos += t->nbytes;
		}
		if (tier_st_count(st) > 0 && pos != file_size)
			__builtin_trap();
		tier_st_close(st);
	} else if (st != NULL || tier_last_error()[0] == '\0') {
		__builtin_trap();   /* failures leave nothing behind and always say why */
	}
	return 0;
}
