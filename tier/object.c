/* object.c - store objects: the id hash, create/destroy, and the bookkeeping of their copies. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/store_internal.h"
#include "tier/meta_alloc.h"

static size_t id_bucket(uint64_t id, size_t n) { return (size_t)((id * 0x9e3779b97f4a7c15ull) >> 17) & (n - 1); }

tier_object *store_obj_find(tier_store *s, uint64_t id)
{
	if (!s->hash_size)
		return NULL;
	for (tier_object *o = s->hash[id_bucket(id, s->hash_size)]; o; o = o->hnext)
		if (o->id == id)
			return o;
	return NULL;
}

static int hash_grow(tier_store *s)
{
	size_t n = s->hash_size ? s->hash_size * 2 : 256;
	tier_object **h = tier_meta_calloc(n, sizeof *h);
	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < s->hash_size; i++)
		for (tier_object *o = s->hash[i], *nx; o; o = nx) {
			nx = o->hnext;
			size_t b = id_bucket(o->id, n);
			o->hnext = h[b];
			h[b] = o;
		}
	tier_meta_free(s->hash);
	s->hash = h;
	s->hash_size = n;
	return 0;
}

static void hash_remove(tier_store *s, tier_object *o)
{
	tier_object **p = &s->hash[id_bucket(o->id, s->hash_size)];
	while (*p != o)
		p = &(*p)->hnext;
	*p = o->hnext;
}

int store_copy_current(const store_copy *c)
{
	return (c->state == TIER_COPY_VALID || c->state == TIER_COPY_DIRTY) && !c->filling &&
	       c->version == c->obj->version;
}

tier_id store_lowest_tier(const tier_store *s)
{
	return s->be[TIER_NVME] ? TIER_NVME : TIER_DDR;
}

/* VALID or DIRTY for each current settled copy: DIRTY when nothing current lies below it. */
void store_refresh(tier_store *s, tier_object *o)
{
	int below = 0;
	for (int t = TIER_NTIERS - 1; t >= 0; t--) {
		store_copy *c = &o->copy[t];
		if (!store_copy_current(c))
			continue;
		c->state = (below || (tier_id)t == store_lowest_tier(s)) ? TIER_COPY_VALID : TIER_COPY_DIRTY;
		below = 1;
	}
}

static void list_add(tier_store *s, store_copy *c)
{
	c->prev = NULL;
	c->next = s->held[c->tier];
	if (c->next)
		c->next->prev = c;
	s->held[c->tier] = c;
}

static void list_del(tier_store *s, store_copy *c)
{
	if (c->prev)
		c->prev->next = c->next;
	else
		s->held[c->tier] = c->next;
	if (c->next)
		c->next->prev = c->prev;
	c->prev = c->next = NULL;
}

/* Allocate the extent of copy c (ABSENT), evicting victims of its tier when it is full. `for_obj`'s
 * copies are never victims (it is the object being served); `filter` narrows the victims further.
 * Returns 0, 1 (no room could be made; nothing changed but evictions done), or a negative errno
 * (a writeback failed). The copy stays ABSENT: the caller sets its state. */
/* Wait for and settle the oldest transfer that reads or fills a copy in t (the list is newest
 * first). 1 when one was settled, 0 when none touches t. Lock held. */
static int settle_one_in(tier_store *s, tier_id t)
{
	store_xfer *old = NULL;
	for (store_xfer *x = s->xfers; x; x = x->next)
		if (x->src->tier == t || x->dst->tier == t)
			old = x;
	if (!old)
		return 0;
	tier_fence_wait(old->fence);
	store_settle(s, old);
	return 1;
}

int store_copy_alloc(tier_store *s, store_copy *c, int noevict, tier_object *for_obj,
		     int (*filter)(tier_store *, store_copy *, void *), void *arg)
{
	tier_backend *b = s->be[c->tier];
	tier_object *o = c->obj;
	if (!b || backend_rounded(b, o->xlen) > backend_capacity(b))
		return 1;
	if (for_obj)
		for_obj->guard++;
	int rc;
	while ((rc = backend_alloc(b, o->xlen, &c->ext)) != 0) {
		rc = noevict ? 1 : store_evict_one(s, c->tier, filter, arg);
		/* a demand allocation waits for a transfer in flight rather than failing: its copies
		 * (an asynchronous writeback's source, a prefetch's destination) become evictable */
		if (rc == 1 && !noevict && !filter && settle_one_in(s, c->tier))
			continue;
		if (rc)
			break;
	}
	if (for_obj)
		for_obj->guard--;
	if (rc)
		return rc;
	list_add(s, c);
	uint64_t used = backend_used(b);
	if (used > s->peak[c->tier])
		s->peak[c->tier] = used;
	s->payload[c->tier] += o->size;
	s->ncopies[c->tier]++;
	c->state = TIER_COPY_LOADING; /* placeholder until the caller decides; never left so */
	if (s->pol->on_insert)
		s->pol->on_insert(s->pol_state, c);
	return 0;
}

void store_copy_free(tier_store *s, store_copy *c)
{
	if (c->state == TIER_COPY_ABSENT)
		return;
	if (s->pol->on_remove)
		s->pol->on_remove(s->pol_state, c);
	backend_free(s->be[c->tier], &c->ext);
	list_del(s, c);
	s->payload[c->tier] -= c->obj->size;
	s->ncopies[c->tier]--;
	memset(&c->ext, 0, sizeof c->ext);
	c->state = TIER_COPY_ABSENT;
	c->filling = c->prefetched = 0;
	c->failed = 0;
	c->xfer = NULL;
	c->crc = 0;
}

/* Free a copy that holds nothing anyone may use (stale or failed) once no one pins or reads it. */
void store_copy_gc(tier_store *s, store_copy *c)
{
	if (c->state == TIER_COPY_ABSENT || c->pins || c->readers || c->xfer)
		return;
	if (c->failed || c->version != c->obj->version)
		store_copy_free(s, c);
}

void store_pin(tier_store *s, store_copy *c)
{
	if (c->pins++ == 0) {
		s->npinned[c->tier]++;
		s->pinned_bytes[c->tier] += c->ext.bytes;
	}
}

void store_unpin(tier_store *s, store_copy *c)
{
	if (--c->pins == 0) {
		s->npinned[c->tier]--;
		s->pinned_bytes[c->tier] -= c->ext.bytes;
	}
}

/* The nearest current copy to read from: the tiers below first (nearest first), then above. */
store_copy *store_pick_source(tier_store *s, tier_object *o, tier_id t)
{
	for (int u = (int)t + 1; u < TIER_NTIERS; u++)
		if (store_copy_current(&o->copy[u]))
			return &o->copy[u];
	for (int u = (int)t - 1; u >= 0; u--)
		if (store_copy_current(&o->copy[u]))
			return &o->copy[u];
	return NULL;
}

tier_link store_link(tier_id from, tier_id to)
{
	static const tier_link l[TIER_NTIERS][TIER_NTIERS] = {
		[TIER_HBM] = { TIER_LINK_D2D, TIER_LINK_D2H, TIER_LINK_HBM_TO_NVME },
		[TIER_DDR] = { TIER_LINK_H2D, TIER_LINK_H2H, TIER_LINK_NVME_WRITE },
		[TIER_NVME] = { TIER_LINK_NVME_TO_HBM, TIER_LINK_NVME_READ, TIER_LINK_NVME_READ },
	};
	return l[from][to];
}

int tier_obj_create(tier_store *s, uint64_t size, tier_class cls, unsigned flags, tier_object **out)
{
	if (!s || !out)
		return tier_fail(-EINVAL, "tier_obj_create: store and out must not be NULL");
	*out = NULL;
	if (size == 0)
		return tier_fail(-EINVAL, "object size is 0: objects hold at least one byte");
	if ((unsigned)cls >= TIER_NCLASSES)
		return tier_fail(-EINVAL, "object class %d is not a tier_class (0..%d)", (int)cls, TIER_NCLASSES - 1);
	if (flags & ~(unsigned)(TIER_OBJ_FROZEN | TIER_OBJ_DISCARDABLE))
		return tier_fail(-EINVAL, "object flags 0x%x: only TIER_OBJ_FROZEN and TIER_OBJ_DISCARDABLE exist", flags);
	uint64_t xlen = s->be[TIER_NVME] ? tier_align_up(size, 4096) : size;
	if (xlen < size)
		return tier_fail(-E2BIG, "object size %" PRIu64 " overflows", size);
	int fits = 0;
	for (int t = 0; t < TIER_NTIERS; t++)
		if (s->be[t] && backend_rounded(s->be[t], xlen) <= backend_capacity(s->be[t]))
			fits = 1;
	if (!fits) {
		char a[32], m[160] = "";
		size_t n = 0;
		for (int t = 0; t < TIER_NTIERS; t++)
			if (s->be[t] && n < sizeof m)
				n += (size_t)snprintf(m + n, sizeof m - n, "%s%s %s", n ? ", " : "", tier_name((tier_id)t),
						      tier_format_size(backend_capacity(s->be[t]), a, sizeof a));
		return tier_fail(-E2BIG, "object of %" PRIu64 " bytes is larger than every tier (%s): raise a budget or split the object",
				 size, m);
	}
	tier_object *o = tier_meta_calloc(1, sizeof *o);
	if (!o)
		return tier_fail(-ENOMEM, "out of memory for an object");
	store_lock(s);
	if ((s->nobjects + 1) * 2 > s->hash_size && hash_grow(s) < 0) {
		store_unlock(s);
		tier_meta_free(o);
		return tier_fail(-ENOMEM, "out of memory growing the object table");
	}
	o->id = ++s->next_id;
	o->size = size;
	o->xlen = xlen;
	o->cls = cls;
	o->flags = flags;
	o->count_step = s->step;
	for (int t = 0; t < TIER_NTIERS; t++) {
		o->copy[t].obj = o;
		o->copy[t].tier = (tier_id)t;
	}
	size_t b = id_bucket(o->id, s->hash_size);
	o->hnext = s->hash[b];
	s->hash[b] = o;
	o->next = s->objects;
	if (o->next)
		o->next->prev = o;
	s->objects = o;
	s->nobjects++;
	s->object_bytes += size;
	hot_link(s, o);
	store_trace(s, TIER_TRC_CREATE, o, TIER_HBM, 0);
	store_unlock(s);
	*out = o;
	return 0;
}

/* Free an object's copies and the object; transfers touching it must be settled. Lock held. */
static void obj_free(tier_store *s, tier_object *o)
{
	for (int t = 0; t < TIER_NTIERS; t++) {
		if (o->copy[t].pins)
			s->outstanding -= o->copy[t].pins;
		while (o->copy[t].pins)
			store_unpin(s, &o->copy[t]);
		store_copy_free(s, &o->copy[t]);
	}
	hash_remove(s, o);
	if (o->prev)
		o->prev->next = o->next;
	else
		s->objects = o->next;
	if (o->next)
		o->next->prev = o->prev;
	s->nobjects--;
	s->object_bytes -= o->size;
	tier_meta_free(o);
}

/* Wait for (and settle) every transfer in flight that reads or fills o. Lock held: the transfers
 * need no store lock to finish. */
void store_obj_quiesce(tier_store *s, tier_object *o)
{
	for (store_xfer *x = s->xfers, *nx; x; x = nx) {
		nx = x->next;
		if (x->dst->obj == o || x->src->obj == o) {
			tier_fence_wait(x->fence);
			store_settle(s, x);
			nx = s->xfers; /* settling may free others' stale copies: restart */
		}
	}
}

/* Lock the store for an operation (destroying, discarding) on an object that no one may pin;
 * 0 with the lock held and o's transfers settled, or -EINVAL / -EBUSY (lock released). */
static int lock_unpinned(tier_store *s, tier_object *o, const char *fn, const char *doing)
{
	if (!s || !o)
		return tier_fail(-EINVAL, "%s: store and object must not be NULL", fn);
	store_lock(s);
	store_reap(s);
	for (int t = 0; t < TIER_NTIERS; t++)
		if (o->copy[t].pins) {
			store_unlock(s);
			return tier_fail(-EBUSY, "object %" PRIu64 " is pinned in %s (%u pins): release it before %s", o->id,
					 tier_name((tier_id)t), o->copy[t].pins, doing);
		}
	store_obj_quiesce(s, o);
	return 0;
}

int tier_obj_destroy(tier_store *s, tier_object *o)
{
	int rc = lock_unpinned(s, o, "tier_obj_destroy", "destroying it");
	if (rc)
		return rc;
	store_trace(s, TIER_TRC_DESTROY, o, TIER_HBM, 0);
	obj_free(s, o);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return 0;
}

int tier_obj_discard(tier_store *s, tier_object *o)
{
	int rc = lock_unpinned(s, o, "tier_obj_discard", "discarding its data");
	if (rc)
		return rc;
	for (int t = 0; t < TIER_NTIERS; t++)
		store_copy_free(s, &o->copy[t]);
	o->has_data = 0;
	store_trace(s, TIER_TRC_DISCARD, o, TIER_HBM, 0);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return 0;
}

/* Destroy-time teardown of every object (pins ignored). Lock held. */
void store_free_all_objects(tier_store *s)
{
	while (s->xfers) {
		tier_fence_wait(s->xfers->fence);
		store_settle(s, s->xfers);
	}
	while (s->objects)
		obj_free(s, s->objects);
}

uint64_t tier_obj_size(const tier_object *o) { return o ? o->size : 0; }
tier_class tier_obj_class(const tier_object *o) { return o ? o->cls : TIER_CLASS_EXPERT; }
unsigned tier_obj_flags(const tier_object *o) { return o ? o->flags : 0; }
uint64_t tier_obj_id(const tier_object *o) { return o ? o->id : 0; }

tier_copy_state tier_obj_state(tier_store *s, const tier_object *o, tier_id t)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return TIER_COPY_ABSENT;
	store_lock(s);
	store_reap(s);
	const store_copy *c = &o->copy[t];
	tier_copy_state st = c->state;
	if ((st == TIER_COPY_VALID || st == TIER_COPY_DIRTY) && c->version != o->version)
		st = TIER_COPY_ABSENT; /* stale, pinned by a reader: not a copy of the data any more */
	store_unlock(s);
	return st;
}

unsigned tier_obj_pins(tier_store *s, const tier_object *o, tier_id t)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return 0;
	store_lock(s);
	unsigned p = o->copy[t].pins;
	store_unlock(s);
	return p;
}

void tier_obj_set_cost(tier_store *s, tier_object *o, double recompute_ns)
{
	if (!s || !o)
		return;
	store_lock(s);
	o->recompute_ns = recompute_ns > 0 ? recompute_ns : 0;
	store_unlock(s);
}
