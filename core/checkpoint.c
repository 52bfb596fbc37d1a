/* checkpoint.c - the training state in one safetensors file, written atomically: every LoRA group's
 * parameters and AdamW moments, the groups' step counts and the trainer's step. Resuming from it
 * continues exactly (the data order depends only on the step; the store never changes numbers). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core_internal.h"

#define CKPT_FORMAT "tier-train-1"

/* The tensor holding group g's parameters (k = 0) or AdamW moments (k = 1). */
static void tensor_name(const lora_group *g, int k, char *buf, size_t len)
{
	const char *half = k ? "adamw" : "lora";
	if (g->kind == LG_ATTN)
		snprintf(buf, len, "layers.%d.attn.%s", g->layer, half);
	else if (g->kind == LG_MLP)
		snprintf(buf, len, "layers.%d.mlp.%s", g->layer, half);
	else
		snprintf(buf, len, "layers.%d.experts.%d.%s", g->layer, g->expert, half);
}

/* Copy a group's part of its parameters (k = 0) or AdamW moments (k = 1) out (in = 0) or in
 * (in = 1) through host buffer buf: n floats (2 n for the moments, m then v) at the group's
 * offset in objects it may share with the layer's other experts. */
static int group_copy(tier_model *m, const lora_group *g, int k, float *buf, int in)
{
	pinset ps = { .s = m->s };
	float *p;
	int rc = pin(&ps, k ? g->optim : g->param, 0, in, &p);
	if (rc)
		return rc;
	size_t n = (k ? 2 : 1) * g->n, bytes = sizeof(float) * n;
	p += (k ? 2 : 1) * g->off;
	rc = in ? core_put(m, p, buf, bytes) : core_get(m, buf, p, bytes);
	int r2 = pin_release_all(&ps);
	return rc ? rc : r2;
}

int tier_trainer_save(tier_trainer *t, const char *path)
{
	if (!t || !path)
		return tier_fail(-EINVAL, "tier_trainer_save: trainer and path are required");
	tier_model *m = trainer_model(t);
	int rs = model_settle(m); /* the state after the last step, its deferred update included */
	if (rs)
		return rs;
	size_t n = m->n_groups, nt = 2 * n + 2;
	tier_st_wtensor *w = calloc(nt, sizeof *w);
	char (*names)[96] = calloc(nt, sizeof *names);
	float **bufs = calloc(2 * n, sizeof *bufs);
	int64_t *steps = calloc(n + 1, sizeof *steps), now = trainer_step_index(t);
	int rc = 0;
	if (!w || !names || !bufs || !steps)
		rc = tier_fail(-ENOMEM, "out of memory for a checkpoint of %zu LoRA groups", n);
	for (size_t i = 0; i < n && !rc; i++) {
		lora_group *g = &m->groups[i];
		for (int k = 0; k < 2 && !rc; k++) {
			tensor_name(g, k, names[2 * i + k], sizeof names[0]);
			if (!(bufs[2 * i + k] = malloc(sizeof(float) * (k ? 2 : 1) * g->n))) {
				rc = tier_fail(-ENOMEM, "out of memory for the checkpoint of %s", names[2 * i + k]);
				break;
			}
			rc = group_copy(m, g, k, bufs[2 * i + k], 0);
			w[2 * i + k] = (tier_st_wtensor){ .name = names[2 * i + k], .dtype = TIER_DT_F32, .ndim = 1,
							  .shape = { (k ? 2 : 1) * g->n }, .data = bufs[2 * i + k] };
		}
		steps[i] = g->t;
	}
	if (!rc) {
		snprintf(names[2 * n], sizeof names[0], "group_steps");
		w[2 * n] = (tier_st_wtensor){ .name = names[2 * n], .dtype = TIER_DT_I64, .ndim = 1,
					      .shape = { n ? n : 1 }, .data = steps };
		snprintf(names[2 * n + 1], sizeof names[0], "step");
		w[2 * n + 1] = (tier_st_wtensor){ .name = names[2 * n + 1], .dtype = TIER_DT_I64, .ndim = 1,
						  .shape = { 1 }, .data = &now };
		const char *meta[] = { "format", CKPT_FORMAT, NULL };
		rc = tier_st_write(path, w, nt, meta);
	}
	for (size_t i = 0; bufs && i < 2 * n; i++)
		free(bufs[i]);
	free(bufs);
	free(w);
	free(names);
	free(steps);
	return rc;
}

/* Read tensor `name` of exactly `bytes` into dst; -EBADMSG naming it when absent or sized otherwise. */
static int read_exact(const tier_st *st, const char *path, const char *name, void *dst, size_t bytes)
{
	const tier_st_tensor *x = tier_st_find(st, name);
	if (!x || x->nbytes != bytes)
		return tier_fail(-EBADMSG, "%s: %s is %s; this model's LoRA needs %zu bytes there (a checkpoint of "
				 "another model or LoRA setting?)", path, name, x ? "of another size" : "missing", bytes);
	return tier_st_read(st, name, dst, bytes);
}

/* A tensor's values as read: finite, and the second moments (the upper half of an adamw tensor)
 * not negative; -EBADMSG naming the first bad one (a damaged or foreign file would otherwise
 * train on, its NaN spreading through every later step). */
static int check_values(const char *path, const char *name, const float *v, size_t count, int moments)
{
	for (size_t i = 0; i < count; i++)
		if (!isfinite(v[i]) || (moments && i >= count / 2 && v[i] < 0))
			return tier_fail(-EBADMSG, "%s: %s[%zu] is %g, %s; the file is damaged: resume from an "
					 "earlier checkpoint", path, name, i, (double)v[i],
					 isfinite(v[i]) ? "a negative second moment" : "not finite");
	return 0;
}

/* The steps as read: none negative. (A group's count may pass the trainer's step: the counts live
 * with the model, which an earlier trainer or a failed step may have advanced.) */
static int check_steps(const char *path, int64_t now, const int64_t *steps, size_t n)
{
	if (now < 0)
		return tier_fail(-EBADMSG, "%s: step is %lld; the file is damaged", path, (long long)now);
	for (size_t i = 0; i < n; i++)
		if (steps[i] < 0)
			return tier_fail(-EBADMSG, "%s: group_steps[%zu] is %lld, negative; the file is damaged", path, i,
					 (long long)steps[i]);
	return 0;
}

int tier_trainer_load(tier_trainer *t, const char *path)
{
	if (!t || !path)
		return tier_fail(-EINVAL, "tier_trainer_load: trainer and path are required");
	tier_model *m = trainer_model(t);
	tier_st *st;
	int rc = tier_st_open(path, &st);
	if (rc)
		return rc;
	const char *fmt = tier_st_metadata(st, "format");
	size_t n = m->n_groups, most = 0;
	for (size_t i = 0; i < n; i++)
		most = m->groups[i].n > most ? m->groups[i].n : most;
	int64_t *steps = calloc(n + 1, sizeof *steps), now = 0;
	float *buf = malloc(sizeof(float) * 2 * (most ? most : 1));
	if (!fmt || strcmp(fmt, CKPT_FORMAT))
		rc = tier_fail(-EBADMSG, "%s: not a tier training checkpoint (format \"%s\", expected \"%s\")", path,
			       fmt ? fmt : "none", CKPT_FORMAT);
	else if (!steps || !buf)
		rc = tier_fail(-ENOMEM, "out of memory reading %s", path);
	/* check everything before changing anything */
	if (!rc && !(rc = read_exact(st, path, "step", &now, sizeof now)) &&
	    !(rc = read_exact(st, path, "group_steps", steps, sizeof(int64_t) * (n ? n : 1))))
		rc = check_steps(path, now, steps, n);
	for (size_t i = 0; i < n && !rc; i++) { /* every value is read twice: checked, then copied */
		for (int k = 0; k < 2 && !rc; k++) {
			char name[96];
			size_t count = (k ? 2 : 1) * m->groups[i].n;
			tensor_name(&m->groups[i], k, name, sizeof name);
			if (!(rc = read_exact(st, path, name, buf, sizeof(float) * count)))
				rc = check_values(path, name, buf, count, k);
		}
	}
	int checked = !rc;
	if (checked) /* the file's state replaces the last step's: its deferred update (if any) is void */
		trainer_optim_drop(t);
	for (size_t i = 0; i < n && !rc; i++) {
		lora_group *g = &m->groups[i];
		for (int k = 0; k < 2 && !rc; k++) {
			char name[96];
			tensor_name(g, k, name, sizeof name);
			if (!(rc = read_exact(st, path, name, buf, sizeof(float) * (k ? 2 : 1) * g->n)))
				rc = group_copy(m, g, k, buf, 1);
		}
		if (!rc)
			g->t = steps[i];
	}
	if (!rc)
		trainer_set_step(t, now);
	if (checked) /* loaded: whole again; failed part-way: no export of the mix */
		m->settle_err = rc;
	free(buf);
	free(steps);
	tier_st_close(st);
	return rc;
}
