/* hotness.c - per-object decayed access counts, last use, and next use in the step schedule. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "tier/store_internal.h"

/* Counts decay lazily: each object keeps the step of its last update, and the count as of then. */
static double decayed(const tier_store *s, const tier_object *o)
{
	if (s->step == o->count_step || o->count == 0)
		return o->count;
	return o->count * pow(0.5, (double)(s->step - o->count_step) / s->half_life);
}

void hot_access(tier_store *s, tier_object *o)
{
	o->count = decayed(s, o) + 1.0;
	o->count_step = s->step;
	o->last_use = ++s->clock;
}

double hot_count(const tier_store *s, const tier_object *o) { return decayed(s, o); }

static size_t uses_bucket(uint64_t id, size_t n) { return (size_t)((id * 0xff51afd7ed558ccdull) >> 23) & (n - 1); }

static sched_uses *uses_find(const tier_store *s, uint64_t id)
{
	if (!s->uses_size)
		return NULL;
	for (sched_uses *u = s->uses[uses_bucket(id, s->uses_size)]; u; u = u->hnext)
		if (u->id == id)
			return u;
	return NULL;
}

void hot_link(tier_store *s, tier_object *o) { o->uses = uses_find(s, o->id); }

/* Ops until the next use at or after the current op (the op about to run is distance 0). A cyclic
 * schedule wraps around; an object the schedule never names again is UINT64_MAX. Without a
 * schedule every object is UINT64_MAX, and the schedule policy falls back to recency. */
uint64_t hot_next_use(const tier_store *s, const tier_object *o)
{
	const sched_uses *u = o->uses;
	if (!u || !u->n)
		return UINT64_MAX;
	size_t cur = s->have_cur ? s->cur_op : 0;
	size_t lo = 0, hi = u->n; /* first position >= cur */
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (u->pos[mid] < cur)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo < u->n)
		return u->pos[lo] - cur;
	if (s->cyclic)
		return s->n_ops - cur + u->pos[0];
	return UINT64_MAX;
}

void hot_free_schedule(tier_store *s)
{
	for (size_t i = 0; i < s->n_ops; i++)
		free((void *)s->ops[i].objects);
	free(s->ops);
	for (size_t b = 0; b < s->uses_size; b++)
		for (sched_uses *u = s->uses[b], *nx; u; u = nx) {
			nx = u->hnext;
			free(u->pos);
			free(u);
		}
	free(s->uses);
	s->ops = NULL;
	s->uses = NULL;
	s->n_ops = s->uses_size = 0;
	for (tier_object *o = s->objects; o; o = o->next)
		o->uses = NULL;
}

static int uses_add(tier_store *s, uint64_t id, size_t op)
{
	size_t b = uses_bucket(id, s->uses_size);
	sched_uses *u = uses_find(s, id);
	if (!u) {
		if (!(u = calloc(1, sizeof *u)))
			return -ENOMEM;
		u->id = id;
		u->hnext = s->uses[b];
		s->uses[b] = u;
	}
	if (u->n && u->pos[u->n - 1] == op)
		return 0; /* named twice by one op */
	if ((u->n & (u->n - 1)) == 0) { /* grow at powers of two */
		size_t *p = realloc(u->pos, (u->n ? 2 * u->n : 1) * sizeof *p);
		if (!p)
			return -ENOMEM;
		u->pos = p;
	}
	u->pos[u->n++] = op;
	return 0;
}

static int schedule_copy(tier_store *s, const tier_sched_op *ops, size_t n_ops)
{
	size_t total = 0;
	if (!(s->ops = calloc(n_ops ? n_ops : 1, sizeof *s->ops)))
		return -ENOMEM;
	s->n_ops = n_ops;
	for (size_t i = 0; i < n_ops; i++) {
		uint64_t *ids = malloc((ops[i].n_objects ? ops[i].n_objects : 1) * sizeof *ids);
		if (!ids)
			return -ENOMEM;
		memcpy(ids, ops[i].objects, ops[i].n_objects * sizeof *ids);
		s->ops[i] = ops[i];
		s->ops[i].objects = ids;
		total += ops[i].n_objects;
	}
	s->uses_size = 64;
	while (s->uses_size < 2 * total)
		s->uses_size *= 2;
	if (!(s->uses = calloc(s->uses_size, sizeof *s->uses)))
		return -ENOMEM;
	for (size_t i = 0; i < n_ops; i++)
		for (unsigned k = 0; k < ops[i].n_objects; k++)
			if (uses_add(s, ops[i].objects[k], i) < 0)
				return -ENOMEM;
	return 0;
}

int tier_store_set_schedule(tier_store *s, const tier_sched_op *ops, size_t n_ops, int cyclic)
{
	if (!s || (n_ops && !ops))
		return tier_fail(-EINVAL, "tier_store_set_schedule: store and ops must not be NULL");
	for (size_t i = 0; i < n_ops; i++) {
		if (ops[i].n_objects && !ops[i].objects)
			return tier_fail(-EINVAL, "schedule op %zu lists %u objects but no array", i, ops[i].n_objects);
		if (ops[i].tier != TIER_HBM && ops[i].tier != TIER_DDR)
			return tier_fail(-EINVAL, "schedule op %zu needs its objects in tier %d: only hbm and ddr can be acquired",
					 i, (int)ops[i].tier);
	}
	store_lock(s);
	hot_free_schedule(s);
	int rc = schedule_copy(s, ops, n_ops);
	if (rc < 0) {
		hot_free_schedule(s);
		rc = tier_fail(-ENOMEM, "out of memory copying a schedule of %zu ops", n_ops);
	} else {
		s->cyclic = cyclic != 0;
		s->cur_op = 0;
		s->have_cur = 0;
		for (tier_object *o = s->objects; o; o = o->next)
			hot_link(s, o);
	}
	store_unlock(s);
	return rc;
}

void tier_store_step(tier_store *s)
{
	if (!s)
		return;
	store_lock(s);
	s->step++;
	store_trace(s, TIER_TRC_STEP, NULL, TIER_HBM, 0);
	store_reap(s);
	store_maybe_publish(s, 1);
	store_unlock(s);
}
