/* access.c - acquire, release and migrate, and the transfers that fill copies.
 *
 * When a LOADING copy becomes VALID: every transfer the store starts is listed in s->xfers with
 * its destination copy LOADING and its source copy's `readers` raised (a source is never evicted
 * or freed while read). The list is reaped at the start of every store call that touches copies:
 * a transfer whose fence is done is settled there, under the lock: success with the object's
 * version unchanged makes the copy VALID (or DIRTY, see store_refresh); a failure, or a dirty
 * release of the object meanwhile, drops it (at once, or at the release of its last pin). So the
 * store only ever calls a copy VALID after its fence reported success, whichever thread sees it.
 *
 * acquire with fence == NULL waits for its fetch without the lock (the copy pinned LOADING) and
 * returns the fetch's error, if any, with nothing pinned. acquire with a fence out returns at
 * once with the copy pinned and LOADING; the caller waits on the fence; a fetch that failed
 * makes tier_release return its error and drops the copy. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/store_internal.h"
#include "tier/meta_alloc.h"

int store_start_fetch(tier_store *s, store_copy *c, store_copy *src, int prefetch)
{
	tier_object *o = c->obj;
	tier_xfer x = { .dst = c->ext.loc, .src = src->ext.loc, .len = o->xlen };
	if (prefetch == STORE_FETCH_URGENT) { /* waited for at once: not behind the queued prefetches */
		x.flags |= s->urgent ? TIER_XFER_URGENT : 0;
		prefetch = 0;
	}
	if (s->checksum && c->tier == TIER_NVME)
		x.flags |= TIER_XFER_CRC_COMPUTE;
	if (s->checksum && src->tier == TIER_NVME) {
		x.flags |= TIER_XFER_CRC_VERIFY;
		x.crc = src->crc;
	}
	store_xfer *sx = tier_meta_calloc(1, sizeof *sx);
	if (!sx) {
		store_copy_free(s, c);
		return tier_fail(-ENOMEM, "out of memory for a transfer");
	}
	int rc = tier_offload_submit(s->off, &x, &sx->fence);
	if (rc < 0) {
		tier_meta_free(sx);
		store_copy_free(s, c);
		return rc;
	}
	sx->dst = c;
	sx->src = src;
	sx->version = o->version;
	sx->prefetch = prefetch;
	sx->next = s->xfers;
	if (sx->next)
		sx->next->prev = sx;
	s->xfers = sx;
	src->readers++;
	s->cls[c->tier][o->cls].bytes_in += o->xlen;
	c->state = TIER_COPY_LOADING;
	c->version = o->version;
	c->xfer = sx;
	c->prefetched = prefetch != 0;
	return 0;
}

void store_settle(tier_store *s, store_xfer *x)
{
	int rc = tier_fence_wait(x->fence);
	store_copy *c = x->dst, *src = x->src;
	tier_object *o = c->obj;
	if (x->prev)
		x->prev->next = x->next;
	else
		s->xfers = x->next;
	if (x->next)
		x->next->prev = x->prev;
	src->readers--;
	c->xfer = NULL;
	if (rc == 0 && x->version == o->version) {
		if (s->checksum && c->tier == TIER_NVME)
			c->crc = tier_fence_crc(x->fence);
		c->state = TIER_COPY_VALID;
		store_refresh(s, o);
	} else if (rc == 0) {
		c->state = TIER_COPY_VALID; /* the object was rewritten meanwhile: a stale copy */
		c->version = x->version;
	} else {
		c->failed = rc;
		if (x->prefetch)
			tier_log(TIER_LOG_WARN, "prefetch of object %" PRIu64 " into %s failed: %s", o->id,
				 tier_name(c->tier), tier_strerror(rc));
	}
	tier_fence_put(x->fence);
	tier_meta_free(x);
	store_copy_gc(s, c);
	store_copy_gc(s, src);
}

void store_reap(tier_store *s)
{
	for (store_xfer *x = s->xfers, *nx; x; x = nx) {
		nx = x->next;
		if (tier_fence_done(x->fence))
			store_settle(s, x);
	}
}

/* Wait for the transfer filling c (pinned by the caller) without the lock. Returns its result. */
int store_wait_copy(tier_store *s, store_copy *c)
{
	if (!c->xfer)
		return c->failed;
	tier_fence *f = tier_fence_get(c->xfer->fence);
	uint64_t t0 = tier_now_ns();
	store_unlock(s);
	int rc = tier_fence_wait(f);
	store_lock(s);
	s->pf.stall_ns += tier_now_ns() - t0;
	tier_fence_put(f);
	store_reap(s);
	return rc;
}

/* Copy src into dst (allocated, ABSENT) and wait under the lock: for writebacks during eviction,
 * which must not let other threads see a half-demoted copy. 0, or the error (dst freed). */
int store_xfer_sync(tier_store *s, store_copy *dst, store_copy *src)
{
	int rc = store_start_fetch(s, dst, src, STORE_FETCH_URGENT);
	if (rc < 0)
		return rc;
	store_xfer *x = dst->xfer;
	rc = tier_fence_wait(x->fence);
	store_settle(s, x);
	return rc;
}

static int acq_args(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr)
{
	if (!s || !o || !addr)
		return tier_fail(-EINVAL, "tier_acquire: store, object and addr must not be NULL");
	if ((unsigned)t >= TIER_NTIERS)
		return tier_fail(-EINVAL, "tier %d does not exist (hbm, ddr, nvme)", (int)t);
	if (t == TIER_NVME)
		return tier_fail(-EINVAL, "object %" PRIu64 ": nvme copies cannot be acquired: acquire in hbm or ddr", o->id);
	if (flags & ~(unsigned)(TIER_ACQ_INIT | TIER_ACQ_NOEVICT))
		return tier_fail(-EINVAL, "acquire flags 0x%x: only TIER_ACQ_INIT and TIER_ACQ_NOEVICT exist", flags);
	return 0;
}

static int obj_pinned(const tier_object *o)
{
	for (int t = 0; t < TIER_NTIERS; t++)
		if (o->copy[t].pins)
			return 1;
	return 0;
}

static int alloc_err(tier_store *s, tier_object *o, tier_id t, int rc)
{
	char why[64];
	if (rc < 0)
		return rc;
	snprintf(why, sizeof why, "object %" PRIu64, o->id);
	return store_no_room(s, t, o->xlen, why);
}

static int pin_out(tier_store *s, store_copy *c, void **addr)
{
	store_pin(s, c);
	s->outstanding++;
	hot_access(s, c->obj);
	if (s->pol->on_access)
		s->pol->on_access(s->pol_state, c->obj, c->tier);
	*addr = c->ext.loc.ptr;
	return 0;
}

/* TIER_ACQ_INIT: a copy the caller fills; the object must not be pinned anywhere. */
static int acquire_init(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr)
{
	store_copy *c = &o->copy[t];
	if (obj_pinned(o))
		return tier_fail(-EBUSY, "object %" PRIu64 " is pinned: TIER_ACQ_INIT needs it unpinned everywhere", o->id);
	store_obj_quiesce(s, o); /* no transfer may read the copy the caller is about to overwrite */
	store_copy_gc(s, c);
	if (c->state == TIER_COPY_ABSENT) {
		int rc = store_copy_alloc(s, c, flags & TIER_ACQ_NOEVICT, o, NULL, NULL);
		if (rc)
			return alloc_err(s, o, t, rc);
	}
	/* The caller writes `size` bytes; transfers move the 4 KiB-rounded length, so the tail must be
	 * defined (host memory only: a real device copy's tail is moved as it is, never read). */
	if (o->xlen > o->size && (t == TIER_DDR || backend_emulated(s->be[t])))
		memset((char *)c->ext.loc.ptr + o->size, 0, o->xlen - o->size);
	c->state = TIER_COPY_DIRTY;
	c->filling = 1;
	c->prefetched = 0;
	s->cls[t][o->cls].misses++;
	return pin_out(s, c, addr);
}

/* Demand miss: make room, fetch from the nearest current copy. */
static int acquire_miss(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr, tier_fence **fence)
{
	store_copy *c = &o->copy[t];
	int rc = store_copy_alloc(s, c, flags & TIER_ACQ_NOEVICT, o, NULL, NULL);
	if (rc)
		return alloc_err(s, o, t, rc);
	store_copy *src = store_pick_source(s, o, t);
	if (!src) {
		store_copy_free(s, c);
		return tier_fail(-EPROTO, "object %" PRIu64 " has data but no current copy (store bug)", o->id);
	}
	tier_id from = src->tier;
	if ((rc = store_start_fetch(s, c, src, STORE_FETCH_URGENT)) < 0)
		return rc;
	s->cls[t][o->cls].misses++;
	s->pf.missed++;
	pin_out(s, c, addr);
	if (fence) {
		*fence = tier_fence_get(c->xfer->fence);
		return 0;
	}
	rc = store_wait_copy(s, c);
	if (store_copy_current(c))
		return 0;
	char msg[512];
	snprintf(msg, sizeof msg, "%s", tier_last_error());
	s->outstanding--;
	store_unpin(s, c);
	store_copy_gc(s, c);
	if (rc == 0)
		return -EAGAIN; /* rewritten while fetching: the caller retries */
	return tier_fail(rc, "fetching object %" PRIu64 " into %s from %s failed: %s", o->id, tier_name(t),
			 tier_name(from), msg);
}

static int acquire_locked(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr, tier_fence **fence)
{
	store_copy *c = &o->copy[t];
	for (int tries = 0;; tries++) {
		store_reap(s);
		for (int u = 0; u < TIER_NTIERS; u++)
			if (o->copy[u].filling)
				return tier_fail(-EBUSY, "object %" PRIu64 " is being filled (TIER_ACQ_INIT in %s not yet released)",
						 o->id, tier_name((tier_id)u));
		/* A transfer started before the object's last dirty release carries the old version
		 * (c->version < o->version): it will settle stale, so it is waited for (its extent cannot be
		 * reused before) and never shared through the fence below. Sharing it returned the old
		 * bytes as current whenever the transfer outlived the rewrite (seen once in CI). */
		int stale = c->version != o->version;
		if (c->state == TIER_COPY_LOADING && !c->failed && (!fence || flags & TIER_ACQ_INIT || stale)) {
			if (tries >= 3)
				return tier_fail(-EBUSY, "object %" PRIu64 " keeps being reloaded into %s by other threads: retry",
						 o->id, tier_name(t));
			int late = c->prefetched;
			store_pin(s, c); /* held so that nothing frees it while the lock is dropped */
			s->holds++;
			store_wait_copy(s, c); /* a failure is seen below: the copy is dropped */
			s->holds--;
			store_unpin(s, c);
			store_copy_gc(s, c);
			if (late && store_copy_current(c)) {
				s->pf.late++;
				c->prefetched = 0;
			}
			continue;
		}
		if (flags & TIER_ACQ_INIT)
			return acquire_init(s, o, t, flags, addr);
		if (!o->has_data)
			return tier_fail(-ENODATA, "object %" PRIu64 " has no data: acquire with TIER_ACQ_INIT to fill it", o->id);
		if (store_copy_current(c)) {
			if (c->prefetched)
				s->pf.on_time++;
			c->prefetched = 0;
			s->cls[t][o->cls].hits++;
			return pin_out(s, c, addr);
		}
		if (c->state == TIER_COPY_LOADING && !c->failed) { /* fence out: share the (current) transfer */
			if (c->prefetched)
				s->pf.late++;
			c->prefetched = 0;
			s->cls[t][o->cls].hits++;
			*fence = tier_fence_get(c->xfer->fence);
			return pin_out(s, c, addr);
		}
		store_copy_gc(s, c);
		if (c->state != TIER_COPY_ABSENT)
			return tier_fail(-EBUSY, "object %" PRIu64 ": its old copy in %s is still pinned by another acquire", o->id,
					 tier_name(t));
		int rc = acquire_miss(s, o, t, flags, addr, fence);
		if (rc != -EAGAIN || tries >= 3)
			return rc;
	}
}

int tier_acquire(tier_store *s, tier_object *o, tier_id t, unsigned flags, void **addr, tier_fence **fence)
{
	if (fence)
		*fence = NULL;
	int rc = acq_args(s, o, t, flags, addr);
	if (rc)
		return rc;
	if (!s->be[t])
		return tier_fail(-EINVAL, "the %s tier is disabled", tier_name(t));
	store_lock(s);
	uint64_t hits0 = s->cls[t][o->cls].hits;
	rc = acquire_locked(s, o, t, flags, addr, fence);
	if (rc == 0)
		store_trace(s, TIER_TRC_ACQUIRE, o, t, s->cls[t][o->cls].hits != hits0);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}

/* Dirty release: this copy holds the newest data; every other copy is stale from now on. */
static void release_dirty(tier_store *s, tier_object *o, store_copy *c)
{
	o->version++;
	c->version = o->version;
	c->filling = 0;
	c->state = TIER_COPY_DIRTY;
	o->has_data = 1;
	for (int u = 0; u < TIER_NTIERS; u++)
		if (&o->copy[u] != c)
			store_copy_gc(s, &o->copy[u]);
	store_refresh(s, o);
}

int tier_release(tier_store *s, tier_object *o, tier_id t, int dirty)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return tier_fail(-EINVAL, "tier_release: bad store, object or tier");
	store_lock(s);
	store_reap(s);
	store_copy *c = &o->copy[t];
	int rc = 0;
	if (!c->pins) {
		rc = tier_fail(-EINVAL, "object %" PRIu64 " is not pinned in %s: release only what you acquired", o->id, tier_name(t));
		goto out;
	}
	if (c->state == TIER_COPY_LOADING && !c->failed)
		store_wait_copy(s, c); /* the caller should have waited on its fence already */
	if (dirty && (o->flags & TIER_OBJ_FROZEN) && !c->filling) {
		rc = tier_fail(-EPERM, "object %" PRIu64 " is frozen: only a release after TIER_ACQ_INIT may be dirty", o->id);
		goto out;
	}
	if (c->state == TIER_COPY_LOADING) {
		rc = tier_fail(c->failed ? c->failed : -EIO, "object %" PRIu64 ": fetching it into %s failed (%s); the copy is dropped",
			       o->id, tier_name(t), tier_strerror(c->failed));
	} else if (dirty) {
		release_dirty(s, o, c);
	} else if (c->filling) {
		/* Released clean after TIER_ACQ_INIT: the contents are unknown, so the copy goes. */
		c->filling = 0;
		c->version = o->version - 1; /* stale: freed below */
		int other = 0;
		for (int u = 0; u < TIER_NTIERS; u++)
			other |= store_copy_current(&o->copy[u]);
		if (!other)
			o->has_data = 0;
		rc = tier_fail(-EINVAL, "object %" PRIu64 " was released clean after TIER_ACQ_INIT: release it dirty once filled; the copy is dropped",
			       o->id);
	}
	s->outstanding--;
	store_trace(s, TIER_TRC_RELEASE, o, t, dirty != 0);
	store_unpin(s, c);
	store_copy_gc(s, c);
out:
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}

int tier_fill_done(tier_store *s, tier_object *o, tier_id t)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return tier_fail(-EINVAL, "tier_fill_done: bad store, object or tier");
	store_lock(s);
	store_copy *c = &o->copy[t];
	int rc = 0;
	if (!c->pins || !c->filling)
		rc = tier_fail(-EINVAL, "object %" PRIu64 " is not being filled in %s: tier_fill_done follows an "
			       "acquire with TIER_ACQ_INIT", o->id, tier_name(t));
	else
		release_dirty(s, o, c);
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}

int tier_migrate(tier_store *s, tier_object *o, tier_id t)
{
	if (!s || !o || (unsigned)t >= TIER_NTIERS)
		return tier_fail(-EINVAL, "tier_migrate: bad store, object or tier");
	if (!s->be[t])
		return tier_fail(-EINVAL, "the %s tier is disabled (budget 0)", tier_name(t));
	store_lock(s);
	int rc = 0;
	store_reap(s);
	store_copy *c = &o->copy[t];
	if (obj_pinned(o)) {
		rc = tier_fail(-EBUSY, "object %" PRIu64 " is pinned: release it before migrating it", o->id);
		goto out;
	}
	if (!o->has_data) {
		rc = tier_fail(-ENODATA, "object %" PRIu64 " has no data: acquire with TIER_ACQ_INIT to fill it", o->id);
		goto out;
	}
	store_obj_quiesce(s, o); /* let transfers touching o finish */
	store_copy_gc(s, c);
	if (!store_copy_current(c)) {
		rc = store_copy_alloc(s, c, 0, o, NULL, NULL);
		if (rc) {
			rc = alloc_err(s, o, t, rc);
			goto out;
		}
		store_copy *src = store_pick_source(s, o, t);
		o->guard++;
		rc = store_xfer_sync(s, c, src);
		o->guard--;
		if (rc < 0)
			goto out;
	}
	for (int u = 0; u < TIER_NTIERS; u++)
		if ((tier_id)u != t)
			store_copy_free(s, &o->copy[u]);
	store_refresh(s, o);
out:
	store_maybe_publish(s, 0);
	store_unlock(s);
	return rc;
}
