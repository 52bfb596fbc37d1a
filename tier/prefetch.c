/* prefetch.c - the store's prefetcher: non-binding hints, and the schedule window ahead of the
 * operation about to run. Timeliness (on time, late, missed, wasted) is counted in access.c and
 * evict.c, where the copies are used or dropped. */
#include <errno.h>
#include "tier/store_internal.h"

/* With a schedule, a prefetch may evict only copies needed later than the object it brings. */
static int later_use(tier_store *s, store_copy *c, void *arg)
{
	return hot_next_use(s, c->obj) > *(const uint64_t *)arg;
}

/* 0: started or already there; 1: declined. Lock held. */
int store_prefetch_locked(tier_store *s, tier_object *o, tier_id t)
{
	if ((t != TIER_HBM && t != TIER_DDR) || !s->be[t] || !o->has_data)
		return 1;
	for (int u = 0; u < TIER_NTIERS; u++)
		if (o->copy[u].filling)
			return 1;
	store_copy *c = &o->copy[t];
	store_copy_gc(s, c);
	if (store_copy_current(c))
		return 0;
	if (c->state != TIER_COPY_ABSENT)
		return 1; /* loading already, or a stale copy still pinned */
	uint64_t next = hot_next_use(s, o);
	int have_sched = s->n_ops > 0 && next != UINT64_MAX;
	int rc = store_copy_alloc(s, c, !have_sched, o, have_sched ? later_use : NULL, &next);
	if (rc)
		return 1; /* no room (a failed writeback leaves its victim in place) */
	store_copy *src = store_pick_source(s, o, t);
	if (!src || store_start_fetch(s, c, src, 1) < 0) {
		store_copy_free(s, c);
		return 1;
	}
	s->pf.issued++;
	return 0;
}

int tier_prefetch(tier_store *s, tier_object *o, tier_id t)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return 1;
	store_lock(s);
	store_reap(s);
	int rc = store_prefetch_locked(s, o, t);
	store_trace(s, TIER_TRC_PREFETCH, o, t, rc == 0);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}

/* 0: started, or nothing to write (no dirty copy); 1: declined. Lock held. */
static int writeback_locked(tier_store *s, tier_object *o)
{
	for (int t = 0; t < TIER_NTIERS; t++) {
		store_copy *c = &o->copy[t];
		if (c->state != TIER_COPY_DIRTY || c->version != o->version)
			continue;
		if (c->pins || c->filling || c->xfer)
			return 1; /* still being written by its holder */
		tier_id d = store_tier_below(s, (tier_id)t);
		if (d == TIER_NTIERS)
			return 0; /* the lowest tier: nothing below to write to */
		store_copy *dc = &o->copy[d];
		store_copy_gc(s, dc);
		if (dc->state == TIER_COPY_LOADING && dc->version == o->version && !dc->failed)
			return 0; /* under way already */
		if (dc->state != TIER_COPY_ABSENT || store_copy_alloc(s, dc, 1, o, NULL, NULL))
			return 1; /* a stale copy still pinned below, or no free room there */
		return store_start_fetch(s, dc, c, 0) < 0; /* settles VALID below, c then clean */
	}
	return 0;
}

int tier_writeback(tier_store *s, tier_object *o)
{
	if (!s || !o)
		return 1;
	store_lock(s);
	store_reap(s);
	int rc = writeback_locked(s, o);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}

/* Bytes the window's prefetches may take in t at operation cur: the free room and the copies
 * needed beyond the window (which the current operation would evict first), less the room the
 * current operation's objects that are not in t yet will take when it acquires them. Without this
 * the prefetches fill the tier and the current operation's own acquires (a new output, a missed
 * object) evict the copies just brought for the operations after it, to be fetched twice. */
static uint64_t window_room(tier_store *s, tier_id t, size_t cur)
{
	tier_backend *be = s->be[t];
	uint64_t room = backend_capacity(be) - backend_used(be), need = 0;
	for (store_copy *c = s->held[t]; c; c = c->next) {
		uint64_t next = hot_next_use(s, c->obj);
		if (store_copy_evictable(c) && (next > s->window || c->version != c->obj->version))
			room += c->ext.bytes;
	}
	const tier_sched_op *p = &s->ops[cur];
	for (unsigned k = 0; k < p->n_objects; k++) {
		tier_object *o = p->tier == t ? store_obj_find(s, p->objects[k]) : NULL;
		if (o && !store_copy_current(&o->copy[t]) && o->copy[t].state != TIER_COPY_LOADING)
			need += backend_rounded(be, o->xlen);
	}
	return room > need ? room - need : 0;
}

void tier_store_at_op(tier_store *s, size_t op)
{
	if (!s)
		return;
	store_lock(s);
	store_reap(s);
	if (s->trace)
		store_trace_put(s, TIER_TRC_AT_OP, NULL, TIER_HBM, 0, op);
	if (s->n_ops) {
		s->cur_op = s->cyclic ? op % s->n_ops : op;
		s->have_cur = 1;
		/* the rooms are counted when the window first needs a fetch: counting walks every copy
		 * a tier holds (71 us an operation with the 7,200 objects of the (a) job all in HBM, where
		 * nothing is ever fetched), and nothing has changed before that point */
		uint64_t room[TIER_NTIERS] = { 0 };
		int counted = 0;
		for (unsigned i = 1; i <= s->window; i++) {
			size_t j = s->cur_op + i;
			if (j >= s->n_ops) {
				if (!s->cyclic)
					break;
				j %= s->n_ops;
			}
			const tier_sched_op *p = &s->ops[j];
			for (unsigned k = 0; k < p->n_objects; k++) {
				tier_object *o = store_obj_find(s, p->objects[k]);
				if (!o || p->tier >= TIER_NVME || store_copy_current(&o->copy[p->tier]) ||
				    o->copy[p->tier].state == TIER_COPY_LOADING)
					continue;
				if (!counted) {
					for (int t = 0; t < TIER_NTIERS; t++)
						room[t] = s->be[t] && t != TIER_NVME ? window_room(s, (tier_id)t, s->cur_op) : 0;
					counted = 1;
				}
				uint64_t sz = backend_rounded(s->be[p->tier], o->xlen);
				if (sz > room[p->tier])
					continue; /* left for the current operation */
				if (store_prefetch_locked(s, o, p->tier) == 0)
					room[p->tier] -= sz;
			}
		}
	}
	store_maybe_publish(s, 0);
	store_unlock(s);
}

void tier_store_set_prefetch_window(tier_store *s, unsigned ops)
{
	if (!s)
		return;
	store_lock(s);
	s->window = ops;
	store_unlock(s);
}
