/* fuzz_peft.c - fuzz target for PEFT adapters (tier_peft_load): the input's first two bytes give
 * the length of adapter_config.json, the rest after it is adapter_model.safetensors; the third
 * byte's low bit picks whether shapes are checked against the default job's model. An accepted
 * adapter's modules have the rank and shapes it declares (and the model's, when checked). */
#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "tier/model.h"
#include "fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_peft";
int fuzz_accepted;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 3)
		return 0;
	size_t n = (size_t)data[0] << 8 | data[1];
	int with_cfg = data[2] & 1;
	data += 3, size -= 3;
	n = n < size ? n : size;
	fz_write("adapter_config.json", data, n);
	fz_write("adapter_model.safetensors", data + n, size - n);
	tier_hf_config cfg;
	tier_model_config_default(&cfg);
	tier_peft_adapter *a = NULL;
	tier_clear_error();
	if (fz_refused(tier_peft_load(fz_dirname(), with_cfg ? &cfg : NULL, &a), a))
		return 0;
	fuzz_accepted = 1;
	if (a->r < 1)
		__builtin_trap();
	for (size_t i = 0; i < a->n_modules; i++) {
		const tier_peft_module *m = &a->modules[i];
		if (m->in < 1 || m->out < 1 || !m->a || !m->b || (with_cfg && (m->layer < 0 || m->layer >= cfg.num_hidden_layers)))
			__builtin_trap();
		volatile float s = 0.0f; /* every value is there to read */
		for (int64_t j = 0; j < (int64_t)a->r * m->in; j++)
			s += m->a[j];
		for (int64_t j = 0; j < (int64_t)a->r * m->out; j++)
			s += m->b[j];
	}
	tier_peft_free(a);
	return 0;
}
