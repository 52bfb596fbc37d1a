/* fuzz_hf_config.c - fuzz target for config.json (tier_hf_config_load): whatever it accepts holds
 * the sizes its checks promise, and feeds the planner's parameter count and a plan (tier-plan MODEL
 * reads the same file) without undefined arithmetic; whatever it refuses comes with a message. */
#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "tier/plan.h"
#include "fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_hf_config";
int fuzz_accepted;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fz_write("config.json", data, size);
	tier_hf_config c;
	tier_clear_error();
	if (fz_refused(tier_hf_config_load(fz_path("config.json"), &c), NULL))
		return 0;
	fuzz_accepted = 1;
	if (c.num_hidden_layers < 1 || c.num_hidden_layers > TIER_HF_MAX_LAYERS || c.hidden_size < 1 ||
	    c.num_key_value_heads < 1 || c.num_attention_heads % c.num_key_value_heads || c.head_dim < 1 ||
	    c.vocab_size < 1 || c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts ||
	    !(c.rms_norm_eps > 0) || !(c.rope_theta > 0))
		__builtin_trap();
	int moe = 0;
	for (int l = 0; l < c.num_hidden_layers; l++)
		moe += tier_hf_layer_is_moe(&c, l);
	(void)moe;
	tier_plan_model pm;
	tier_plan_params pp;
	tier_plan_cluster cl;
	tier_plan_opts po;
	tier_plan_result pr;
	if (tier_plan_model_from_hf(&c, "fuzz", &pm) == 0 && tier_plan_count(&pm, &pp) == 0 &&
	    tier_plan_cluster_preset("h200-8x", &cl) == 0) {
		tier_plan_opts_default(&po);
		po.ep = 1; /* one EP size, not a search over all: a plan per input stays cheap */
		(void)tier_plan_run(&pm, &cl, &po, &pr);
	}
	return 0;
}
