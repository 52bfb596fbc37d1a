/* model_io.c - the model's weights in and out: HF checkpoints (base weights), PEFT adapters (LoRA). */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/core_internal.h"

/* One expert part (gate, up or down) read and converted to fp32 into dst. */
static int read_part(const tier_expert_part *p, const char *what, uint64_t rows, uint64_t cols, float *dst)
{
	if (p->rows != rows || p->cols != cols)
		return tier_fail(-EBADMSG, "%s: %s is [%llu, %llu] in %s, the config says [%llu, %llu]", what,
				 p->t->name, (unsigned long long)p->rows, (unsigned long long)p->cols,
				 tier_st_path(p->st), (unsigned long long)rows, (unsigned long long)cols);
	if (p->dtype == TIER_DT_F32)
		return tier_st_read_range(p->st, p->t, p->off, dst, p->nbytes);
	void *raw = malloc(p->nbytes);
	if (!raw)
		return tier_fail(-ENOMEM, "out of memory reading %s", p->t->name);
	int rc = tier_st_read_range(p->st, p->t, p->off, raw, p->nbytes);
	if (!rc)
		rc = tier_dtype_convert(dst, TIER_DT_F32, raw, p->dtype, rows * cols);
	free(raw);
	return rc;
}

static int fill_ckpt(tier_model *m, float *p, size_t n, const char *name, void *arg)
{
	const tier_ckpt *ck = arg;
	int l, e;
	if (sscanf(name, "model.layers.%d.mlp.experts.%d", &l, &e) == 2 && !strstr(name, "weight")) {
		tier_expert_weights w;
		uint64_t I = (uint64_t)m->Ie, H = (uint64_t)m->H;
		int rc = tier_ckpt_expert(ck, l, e, &w);
		if (rc || (rc = read_part(&w.gate, name, I, H, p)) || (rc = read_part(&w.up, name, I, H, p + I * H)) ||
		    (rc = read_part(&w.down, name, H, I, p + 2 * I * H)))
			return rc;
		return 0;
	}
	const tier_st *st;
	const tier_st_tensor *t;
	int rc = tier_ckpt_find(ck, name, &st, &t);
	if (rc)
		return tier_fail(rc, "%s: tensor %s is missing from the checkpoint", tier_last_error(), name);
	if (tier_st_numel(t) != n)
		return tier_fail(-EBADMSG, "%s: %s has %llu elements, the config needs %zu", tier_st_path(st), name,
				 (unsigned long long)tier_st_numel(t), n);
	return tier_st_convert(st, name, p, TIER_DT_F32, n);
}

int tier_model_load_hf(tier_model *m, const char *dir)
{
	if (!m || !dir)
		return tier_fail(-EINVAL, "tier_model_load_hf: model and directory are required");
	tier_ckpt *ck;
	int rc = tier_ckpt_open(dir, &ck);
	if (rc)
		return rc;
	rc = model_fill_all(m, fill_ckpt, NULL, ck);
	tier_ckpt_close(ck);
	return rc;
}

int model_settle(tier_model *m)
{
	if (m->settle_err)
		return tier_fail(m->settle_err, "the LoRA weights lack part of a training step's optimizer update, which "
				 "failed; load the last checkpoint (tier_trainer_load) or train again");
	return m->settle ? m->settle(m->settle_arg) : 0;
}

/* Copy every group's parameters (which 0) or gradients (which 1) out, or parameters in (dir 1),
 * the last step's optimizer update first when it is still due (model_settle). */
static int walk_groups(tier_model *m, int which, tier_peft_adapter *a, int in)
{
	size_t k = 0;
	int rs = model_settle(m);
	if (rs)
		return rs;
	if (which && m->grads_spent)
		return tier_fail(-ENODATA, "the LoRA gradients of a training step are dropped once its optimizer has used "
				 "them: compute them with tier_trainer_eval(..., grads = 1) to export them");
	for (size_t i = 0; i < m->n_groups; i++) {
		lora_group *g = &m->groups[i];
		tier_object *o = which ? g->grad : g->param;
		pinset ps = { .s = m->s };
		float *p;
		int rc;
		if (which && !g->touched) { /* never written: zero gradients */
			for (int j = 0; j < g->n_mods; j++, k++) {
				memset(a->modules[k].a, 0, sizeof(float) * (size_t)m->lora.r * g->mods[j].in);
				memset(a->modules[k].b, 0, sizeof(float) * (size_t)m->lora.r * g->mods[j].out);
			}
			continue;
		}
		if ((rc = pin(&ps, o, 0, in, &p)))
			return rc;
		p += g->off; /* the group's place in objects it may share with a layer's other experts */
		for (int j = 0; j < g->n_mods; j++, k++) {
			const lora_mod *md = &g->mods[j];
			tier_peft_module *pm = &a->modules[k];
			size_t na = (size_t)m->lora.r * md->in, nb = (size_t)m->lora.r * md->out;
			if (in && !(rc = core_put(m, p + md->a, pm->a, sizeof(float) * na)))
				rc = core_put(m, p + md->b, pm->b, sizeof(float) * nb);
			else if (!in && !(rc = core_get(m, pm->a, p + md->a, sizeof(float) * na)))
				rc = core_get(m, pm->b, p + md->b, sizeof(float) * nb);
			if (rc)
				break;
		}
		int r2 = pin_release_all(&ps);
		if ((rc = rc ? rc : r2))
			return rc;
	}
	return 0;
}

int tier_model_lora_export(tier_model *m, int which, tier_peft_adapter **out)
{
	if (!m || !out)
		return tier_fail(-EINVAL, "tier_model_lora_export: model and out are required");
	*out = NULL;
	size_t n = 0;
	for (size_t i = 0; i < m->n_groups; i++)
		n += (size_t)m->groups[i].n_mods;
	tier_peft_adapter *a = calloc(1, sizeof *a);
	if (!a || !(a->modules = calloc(n ? n : 1, sizeof *a->modules))) {
		free(a);
		return tier_fail(-ENOMEM, "out of memory for an adapter of %zu modules", n);
	}
	a->r = m->lora.r, a->lora_alpha = m->lora.alpha, a->use_rslora = m->lora.use_rslora, a->dtype = TIER_DT_F32;
	a->lora_dropout = m->lora.dropout;
	size_t k = 0;
	for (size_t i = 0; i < m->n_groups; i++)
		for (int j = 0; j < m->groups[i].n_mods; j++, k++) {
			const lora_mod *md = &m->groups[i].mods[j];
			tier_peft_module *pm = &a->modules[k];
			pm->layer = m->groups[i].layer;
			snprintf(pm->module, sizeof pm->module, "%s", md->name);
			pm->in = md->in, pm->out = md->out;
			a->n_modules = k + 1;
			if (!(pm->a = malloc(sizeof(float) * (size_t)m->lora.r * md->in)) ||
			    !(pm->b = malloc(sizeof(float) * (size_t)m->lora.r * md->out))) {
				tier_peft_free(a);
				return tier_fail(-ENOMEM, "out of memory for the adapter's tensors");
			}
		}
	int rc = walk_groups(m, which, a, 0);
	if (rc) {
		tier_peft_free(a);
		return rc;
	}
	*out = a;
	return 0;
}

int tier_model_lora_import(tier_model *m, const tier_peft_adapter *a)
{
	if (!m || !a)
		return tier_fail(-EINVAL, "tier_model_lora_import: model and adapter are required");
	if (a->r != m->lora.r)
		return tier_fail(-EINVAL, "adapter has r = %d, the model's LoRA r = %d; create the model with the "
				 "adapter's r", a->r, m->lora.r);
	size_t n = 0;
	for (size_t i = 0; i < m->n_groups; i++)
		n += (size_t)m->groups[i].n_mods;
	/* Reorder the adapter's modules into the model's order, checking each. */
	tier_peft_adapter view = *a;
	if (!(view.modules = calloc(n ? n : 1, sizeof *view.modules)))
		return tier_fail(-ENOMEM, "out of memory");
	size_t k = 0;
	int rc = 0;
	for (size_t i = 0; i < m->n_groups && !rc; i++)
		for (int j = 0; j < m->groups[i].n_mods && !rc; j++, k++) {
			const lora_mod *md = &m->groups[i].mods[j];
			size_t q;
			for (q = 0; q < a->n_modules; q++)
				if (a->modules[q].layer == m->groups[i].layer && !strcmp(a->modules[q].module, md->name))
					break;
			if (q == a->n_modules)
				rc = tier_fail(-EINVAL, "adapter has no module layers.%d.%s, which the model trains; "
					       "choose LoRA targets that match the adapter", m->groups[i].layer, md->name);
			else if (a->modules[q].in != md->in || a->modules[q].out != md->out)
				rc = tier_fail(-EINVAL, "adapter module layers.%d.%s is %lld -> %lld, the model's is %d -> %d",
					       m->groups[i].layer, md->name, (long long)a->modules[q].in,
					       (long long)a->modules[q].out, md->in, md->out);
			else
				view.modules[k] = a->modules[q];
		}
	if (!rc) {
		view.n_modules = n;
		rc = walk_groups(m, 0, &view, 1);
	}
	free(view.modules);
	return rc;
}
