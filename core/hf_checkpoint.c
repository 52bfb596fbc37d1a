/* hf_checkpoint.c - a Hugging Face model directory: one or many safetensors shards, expert layouts. */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "tier/base.h"
#include "tier/formats.h"
#include "core/safetensors_int.h"

#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#endif

struct ck_entry {
	const char *name;     /* owned by the shard's tier_st */
	size_t shard;
};

struct tier_ckpt {
	size_t n_shards;
	tier_st **shards;
	size_t n;
	struct ck_entry *e;   /* sorted by name */
};

void tier_ckpt_close(tier_ckpt *ck)
{
	if (!ck)
		return;
	for (size_t i = 0; i < ck->n_shards; i++)
		tier_st_close(ck->shards[i]);
	free(ck->shards);
	free(ck->e);
	free(ck);
}

size_t tier_ckpt_shard_count(const tier_ckpt *ck) { return ck->n_shards; }

const tier_st *tier_ckpt_shard(const tier_ckpt *ck, size_t i)
{
	return i < ck->n_shards ? ck->shards[i] : NULL;
}

static int cmp_entry(const void *a, const void *b)
{
	return strcmp(((const struct ck_entry *)a)->name, ((const struct ck_entry *)b)->name);
}

static const struct ck_entry *ck_lookup(const tier_ckpt *ck, const char *name)
{
	struct ck_entry key = { name, 0 };
	return bsearch(&key, ck->e, ck->n, sizeof key, cmp_entry);
}

int tier_ckpt_find(const tier_ckpt *ck, const char *name, const tier_st **st, const tier_st_tensor **t)
{
	const struct ck_entry *e = ck_lookup(ck, name);
	if (!e)
		return tier_fail(-ENOENT, "the checkpoint has no tensor named '%s'", name);
	*st = ck->shards[e->shard];
	*t = tier_st_find(*st, name);
	return 0;
}

static int add_shard(tier_ckpt *ck, const char *dir, const char *file)
{
	char *path;
	tier_st **s = realloc(ck->shards, (ck->n_shards + 1) * sizeof *s);
	if (!s)
		return tier_fail(-ENOMEM, "out of memory");
	ck->shards = s;
	if (asprintf(&path, "%s/%s", dir, file) < 0)
		return tier_fail(-ENOMEM, "out of memory");
	int rc = tier_st_open(path, &ck->shards[ck->n_shards]);
	free(path);
	if (rc == 0)
		ck->n_shards++;
	return rc;
}

static int sort_entries(tier_ckpt *ck, const char *what)
{
	qsort(ck->e, ck->n, sizeof *ck->e, cmp_entry);
	for (size_t i = 1; i < ck->n; i++)
		if (strcmp(ck->e[i - 1].name, ck->e[i].name) == 0)
			return tier_fail(-EBADMSG, "%s: tensor '%s' is in more than one shard", what, ck->e[i].name);
	return 0;
}

static int open_single(tier_ckpt *ck, const char *dir)
{
	int rc = add_shard(ck, dir, "model.safetensors");
	if (rc < 0)
		return rc;
	const tier_st *st = ck->shards[0];
	ck->n = tier_st_count(st);
	ck->e = malloc((ck->n + 1) * sizeof *ck->e);
	if (!ck->e)
		return tier_fail(-ENOMEM, "out of memory");
	for (size_t i = 0; i < ck->n; i++)
		ck->e[i] = (struct ck_entry){ tier_st_at(st, i)->name, 0 };
	return sort_entries(ck, tier_st_path(st));
}

#ifdef TIER_HAVE_JANSSON
static int shard_of(tier_ckpt *ck, const char *dir, const char *index, const char *file, size_t *out)
{
	size_t dl = strlen(dir);
	for (size_t i = 0; i < ck->n_shards; i++) {
		const char *p = tier_st_path(ck->shards[i]);
		if (strcmp(p + dl + 1, file) == 0) {
			*out = i;
			return 0;
		}
	}
	if (!*file || strchr(file, '/') || strcmp(file, ".") == 0 || strcmp(file, "..") == 0)
		return tier_fail(-EBADMSG, "%s: weight_map names file '%s'; shard names must be plain file "
				 "names in the model directory", index, file);
	int rc = add_shard(ck, dir, file);
	if (rc == -ENOENT)
		tier_fail(rc, "%s names shard %s, which is not in %s", index, file, dir);
	*out = ck->n_shards - 1;
	return rc;
}

static int open_index(tier_ckpt *ck, const char *dir, const char *index)
{
	char *text;
	json_error_t err;
	int rc = tier_read_text_file(index, 256u << 20, &text);
	if (rc < 0)
		return rc;
	json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &err), *map;
	free(text);
	if (!root)
		return tier_fail(-EBADMSG, "%s: not valid JSON: %s (line %d)", index, err.text, err.line);
	map = json_object_get(root, "weight_map");
	if (!json_is_object(map))
		rc = tier_fail(-EBADMSG, "%s: no \"weight_map\" object", index);
	ck->e = rc == 0 ? malloc((json_object_size(map) + 1) * sizeof *ck->e) : NULL;
	if (rc == 0 && !ck->e)
		rc = tier_fail(-ENOMEM, "out of memory");
	const char *name;
	json_t *v;
	if (rc == 0)
		json_object_foreach(map, name, v) {
			size_t s = 0;
			if (!json_is_string(v))
				rc = tier_fail(-EBADMSG, "%s: weight_map entry '%s' is not a file name string", index, name);
			if (rc == 0)
				rc = shard_of(ck, dir, index, json_string_value(v), &s);
			const tier_st_tensor *t = rc == 0 ? tier_st_find(ck->shards[s], name) : NULL;
			if (rc == 0 && !t)
				rc = tier_fail(-EBADMSG, "%s: tensor '%s' is mapped to %s, which does not contain it",
					       index, name, json_string_value(v));
			if (rc < 0)
				break;
			ck->e[ck->n++] = (struct ck_entry){ t->name, s };
		}
	json_decref(root);
	return rc < 0 ? rc : sort_entries(ck, index);
}
#endif

int tier_ckpt_open(const char *model_dir, tier_ckpt **out)
{
	char *index;
	struct stat sb;
	*out = NULL;
	tier_ckpt *ck = calloc(1, sizeof *ck);
	if (!ck || asprintf(&index, "%s/model.safetensors.index.json", model_dir) < 0) {
		free(ck);
		return tier_fail(-ENOMEM, "out of memory");
	}
	int rc;
	if (stat(index, &sb) == 0) {
#ifdef TIER_HAVE_JANSSON
		rc = open_index(ck, model_dir, index);
#else
		rc = tier_st_no_jansson(index);
#endif
	} else {
		rc = open_single(ck, model_dir);
		if (rc == -ENOENT)
			tier_fail(rc, "%s has neither model.safetensors.index.json nor model.safetensors", model_dir);
	}
	free(index);
	if (rc < 0) {
		tier_ckpt_close(ck);
		return rc;
	}
	*out = ck;
	return 0;
}

/* ---- Expert layouts --------------------------------------------------------------------------- */

static int part_2d(const tier_ckpt *ck, const char *name, tier_expert_part *p)
{
	if (tier_ckpt_find(ck, name, &p->st, &p->t) < 0)
		return -ENOENT;
	if (p->t->ndim != 2)
		return tier_fail(-EBADMSG, "%s: tensor '%s' has %d dimensions, an expert projection needs 2",
				 tier_st_path(p->st), name, p->t->ndim);
	*p = (tier_expert_part){ p->st, p->t, 0, p->t->nbytes, p->t->shape[0], p->t->shape[1], p->t->dtype };
	return 0;
}

static int per_expert(const tier_ckpt *ck, const char *fmt, const char *const names[3], int layer,
		      int expert, tier_expert_weights *w)
{
	tier_expert_part *parts[3] = { &w->gate, &w->up, &w->down };
	char name[256];
	for (int i = 0; i < 3; i++) {
		snprintf(name, sizeof name, fmt, layer, expert, names[i]);
		int rc = part_2d(ck, name, parts[i]);
		if (rc == -ENOENT && i > 0)
			return tier_fail(-EBADMSG, "layer %d expert %d: '%s' is missing while the other "
					 "projections are present", layer, expert, name);
		if (rc < 0)
			return rc;
	}
	return 0;
}

static int fused(const tier_ckpt *ck, const char *prefix, int layer, int expert, tier_expert_weights *w)
{
	char gu[256], dn[256];
	const tier_st *s1, *s2;
	const tier_st_tensor *a, *b;
	snprintf(gu, sizeof gu, "model.layers.%d.%s.experts.gate_up_proj", layer, prefix);
	snprintf(dn, sizeof dn, "model.layers.%d.%s.experts.down_proj", layer, prefix);
	if (tier_ckpt_find(ck, gu, &s1, &a) < 0)
		return -ENOENT;
	if (tier_ckpt_find(ck, dn, &s2, &b) < 0)
		return tier_fail(-EBADMSG, "layer %d: '%s' is present but '%s' is missing", layer, gu, dn);
	/* gate_up [E, 2I, H], down [E, H, I] */
	if (a->ndim != 3 || b->ndim != 3 || a->shape[1] % 2 || a->shape[0] != b->shape[0] ||
	    a->shape[1] / 2 != b->shape[2] || a->shape[2] != b->shape[1] || a->dtype != b->dtype)
		return tier_fail(-EBADMSG, "layer %d: fused experts need gate_up_proj [E, 2I, H] and down_proj "
				 "[E, H, I] of one dtype; found %s and %s with %d and %d dims", layer,
				 tier_dtype_name(a->dtype), tier_dtype_name(b->dtype), a->ndim, b->ndim);
	if ((uint64_t)expert >= a->shape[0])
		return tier_fail(-EBADMSG, "layer %d: expert %d is out of range (the checkpoint has %llu)",
				 layer, expert, (unsigned long long)a->shape[0]);
	uint64_t I = b->shape[2], H = b->shape[1], es = tier_dtype_size(a->dtype);
	uint64_t half = I * H * es, e = (uint64_t)expert;   /* products are within validated sizes */
	w->gate = (tier_expert_part){ s1, a, e * 2 * half, half, I, H, a->dtype };
	w->up = (tier_expert_part){ s1, a, e * 2 * half + half, half, I, H, a->dtype };
	w->down = (tier_expert_part){ s2, b, e * half, half, H, I, b->dtype };
	return 0;
}

int tier_ckpt_expert(const tier_ckpt *ck, int layer, int expert, tier_expert_weights *out)
{
	static const char *const qwen[3] = { "gate_proj", "up_proj", "down_proj" };
	static const char *const mixtral[3] = { "w1", "w3", "w2" };
	tier_expert_weights w;
	int rc;
	if (layer < 0 || expert < 0)
		return tier_fail(-EINVAL, "layer %d expert %d: negative index", layer, expert);
	w.layout = TIER_EXPERTS_PER_EXPERT;
	rc = per_expert(ck, "model.layers.%d.mlp.experts.%d.%s.weight", qwen, layer, expert, &w);
	if (rc == -ENOENT) {
		w.layout = TIER_EXPERTS_MIXTRAL;
		rc = per_expert(ck, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", mixtral, layer, expert, &w);
	}
	w.layout = rc == -ENOENT ? TIER_EXPERTS_FUSED : w.layout;
	if (rc == -ENOENT)
		rc = fused(ck, "mlp", layer, expert, &w);
	if (rc == -ENOENT)
		rc = fused(ck, "block_sparse_moe", layer, expert, &w);
	if (rc == -ENOENT)
		return tier_fail(-ENOENT, "layer %d expert %d: no expert weights in any known layout "
				 "(mlp.experts.%d.gate_proj, block_sparse_moe.experts.%d.w1, mlp.experts.gate_up_proj)",
				 layer, expert, expert, expert);
	if (rc < 0)
		return rc;
	if (w.gate.rows != w.up.rows || w.gate.cols != w.up.cols || w.down.rows != w.gate.cols ||
	    w.down.cols != w.gate.rows)
		return tier_fail(-EBADMSG, "layer %d expert %d: gate [%llu, %llu], up [%llu, %llu] and down "
				 "[%llu, %llu] do not agree ([I, H], [I, H], [H, I])", layer, expert,
				 (unsigned long long)w.gate.rows, (unsigned long long)w.gate.cols,
				 (unsigned long long)w.up.rows, (unsigned long long)w.up.cols,
				 (unsigned long long)w.down.rows, (unsigned long long)w.down.cols);
	*out = w;
	return 0;
}
