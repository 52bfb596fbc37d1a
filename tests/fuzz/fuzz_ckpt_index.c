/* fuzz_ckpt_index.c - fuzz target for a sharded checkpoint's model.safetensors.index.json
 * (tier_ckpt_open): the input is the index; beside it lie two valid shards made once per process
 * (per-expert and fused 3-D experts, an F32 and a BF16 tensor). An accepted index finds every
 * tensor it maps in the shard it names, and the expert lookups on it either succeed with slices
 * inside their tensors or fail with a message. */
#include <stddef.h>
#include <stdint.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "fuzz_files.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char fuzz_corpus[] = "corpus_ckpt_index";
int fuzz_accepted;

static void make_shards(void)
{
	static float z[2 * 16 * 8];
	const tier_st_wtensor a[] = {
		{ "model.layers.0.mlp.experts.0.gate_proj.weight", TIER_DT_F32, 2, { 4, 8 }, z },
		{ "model.layers.0.mlp.experts.0.up_proj.weight", TIER_DT_F32, 2, { 4, 8 }, z },
		{ "model.layers.0.mlp.experts.0.down_proj.weight", TIER_DT_F32, 2, { 8, 4 }, z },
		{ "model.embed_tokens.weight", TIER_DT_BF16, 2, { 16, 8 }, z },
	};
	const tier_st_wtensor b[] = {
		{ "model.layers.1.mlp.experts.gate_up_proj", TIER_DT_F32, 3, { 2, 8, 8 }, z },
		{ "model.layers.1.mlp.experts.down_proj", TIER_DT_F32, 3, { 2, 8, 4 }, z },
	};
	if (tier_st_write(fz_path("a.safetensors"), a, 4, NULL) || tier_st_write(fz_path("b.safetensors"), b, 2, NULL)) {
		fprintf(stderr, "fuzz: writing the shards: %s\n", tier_last_error());
		exit(2);
	}
}

/* A slice the lookup returned lies inside its tensor. */
static void check_part(const tier_expert_part *p)
{
	if (!p->t || p->off + p->nbytes > p->t->nbytes || p->rows * p->cols * tier_dtype_size(p->dtype) != p->nbytes)
		__builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int made;
	if (!made++)
		make_shards();
	fz_write("model.safetensors.index.json", data, size);
	tier_ckpt *ck = NULL;
	tier_clear_error();
	if (fz_refused(tier_ckpt_open(fz_dirname(), &ck), ck))
		return 0;
	fuzz_accepted = 1;
	for (size_t s = 0; s < tier_ckpt_shard_count(ck); s++) {
		const tier_st *st = tier_ckpt_shard(ck, s);
		for (size_t i = 0; i < tier_st_count(st); i++) {
			const tier_st *where = NULL;
			const tier_st_tensor *t = NULL;
			const char *name = tier_st_at(st, i)->name;
			if (tier_ckpt_find(ck, name, &where, &t) == 0 && (!where || !t || strcmp(t->name, name)))
				__builtin_trap();
		}
	}
	for (int l = 0; l < 3; l++)
		for (int e = 0; e < 3; e++) {
			tier_expert_weights w;
			tier_clear_error();
			int rc = tier_ckpt_expert(ck, l, e, &w);
			if (rc == 0)
				check_part(&w.gate), check_part(&w.up), check_part(&w.down);
			else if (tier_last_error()[0] == '\0')
				__builtin_trap();
		}
	tier_ckpt_close(ck);
	return 0;
}
