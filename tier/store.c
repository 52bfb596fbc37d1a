/* store.c - the tiered store: creation and teardown, names, statistics and the invariant check. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tier/store_internal.h"
#include "tier/meta_alloc.h"

const char *tier_name(tier_id t)
{
	static const char *const n[TIER_NTIERS] = { "hbm", "ddr", "nvme" };
	return (unsigned)t < TIER_NTIERS ? n[t] : "unknown";
}

const char *tier_class_name(tier_class c)
{
	static const char *const n[TIER_NCLASSES] = { "expert", "dense", "lora", "optim", "opcache", "act" };
	return (unsigned)c < TIER_NCLASSES ? n[c] : "unknown";
}

/* Link speed for cost estimates (GB/s): the configured cap, else what was measured (once enough
 * moved to mean something), else a typical figure of an H100/H200 host. */
double store_link_gbps(tier_store *s, tier_link l)
{
	static const double typical[TIER_NLINKS] = { 25, 25, 5, 3, 5, 3, 1000, 10 };
	if (s->link_gbps[l] > 0)
		return s->link_gbps[l];
	tier_link_stats st;
	tier_offload_link_stats(s->off, l, &st);
	if (st.bytes >= (64u << 20) && st.busy_ns > 0)
		return (double)st.bytes / (double)st.busy_ns;
	return typical[l];
}

static int config_check(const tier_store_config *cfg)
{
	if (!cfg->capacity[TIER_HBM] || !cfg->capacity[TIER_DDR])
		return tier_fail(-EINVAL, "the %s budget is 0: hbm and ddr both need a budget (nvme may be 0 to disable it)",
				 cfg->capacity[TIER_HBM] ? "ddr" : "hbm");
	if ((unsigned)cfg->policy >= TIER_NPOLICIES)
		return tier_fail(-EINVAL, "policy %d is not one of lru, lfu, cost, schedule", (int)cfg->policy);
	if (!(cfg->half_life_steps >= 0))
		return tier_fail(-EINVAL, "half-life %g steps: must be >= 0 (0 picks 4)", cfg->half_life_steps);
	if (cfg->capacity[TIER_NVME] && (!cfg->nvme_dirs || !cfg->n_nvme_dirs))
		return tier_fail(-EINVAL, "an nvme budget needs at least one nvme directory");
	return 0;
}

static int create_engine(tier_store *s, const tier_store_config *cfg)
{
	if (cfg->offload) {
		s->off = cfg->offload;
	} else {
		tier_offload_config oc = { 0 };
		if (cfg->offload_config)
			oc = *cfg->offload_config;
		if (!oc.dev)
			oc.dev = cfg->dev;
		int rc = tier_offload_create(&s->off, &oc);
		if (rc < 0)
			return rc;
		s->own_off = 1;
	}
	if (cfg->offload_config)
		memcpy(s->link_gbps, cfg->offload_config->link_gbps, sizeof s->link_gbps);
	return 0;
}

int tier_store_create(tier_store **out, const tier_store_config *cfg)
{
	if (!out || !cfg)
		return tier_fail(-EINVAL, "tier_store_create: out and cfg must not be NULL");
	*out = NULL;
	int rc = config_check(cfg);
	if (rc)
		return rc;
	tier_store *s = tier_meta_calloc(1, sizeof *s);
	if (!s)
		return tier_fail(-ENOMEM, "out of memory for a store");
	pthread_mutex_init(&s->lock, NULL);
	s->dev = cfg->dev;
	const char *urgent = getenv("TIER_URGENT");
	s->urgent = !urgent || strcmp(urgent, "0");
	s->checksum = cfg->nvme_checksum != 0;
	s->policy = cfg->policy;
	s->pol = store_policy_get(cfg->policy);
	s->half_life = cfg->half_life_steps > 0 ? cfg->half_life_steps : 4;
	s->window = 2;
	s->start_ns = tier_now_ns();
	snprintf(s->job, sizeof s->job, "store");
	if ((rc = create_engine(s, cfg)) < 0)
		goto fail;
	for (int t = 0; t < TIER_NTIERS; t++) {
		if (!cfg->capacity[t])
			continue;
		tier_backend_config bc = { .tier = (tier_id)t, .capacity = cfg->capacity[t], .dev = cfg->dev,
					   .offload = s->off, .dirs = cfg->nvme_dirs, .n_dirs = cfg->n_nvme_dirs,
					   .clamp = cfg->clamp_budgets };
		if ((rc = backend_create(&s->be[t], &bc)) < 0)
			goto fail;
	}
	if (s->pol->init && (rc = s->pol->init(s, &s->pol_state)) < 0)
		goto fail;
	if (cfg->publish_stats && (rc = tier_stats_publish_open(&s->pub)) < 0)
		goto fail;
	store_maybe_publish(s, 1);
	*out = s;
	return 0;
fail:
	tier_store_destroy(s);
	return rc;
}

void tier_store_destroy(tier_store *s)
{
	if (!s)
		return;
	store_lock(s);
	store_free_all_objects(s);
	store_trace_destroy(s);
	store_unlock(s);
	tier_stats_publish_close(s->pub);
	if (s->pol_state && s->pol->fini)
		s->pol->fini(s->pol_state);
	for (int t = TIER_NTIERS - 1; t >= 0; t--)
		backend_destroy(s->be[t]);
	if (s->own_off)
		tier_offload_destroy(s->off);
	hot_free_schedule(s);
	tier_meta_free(s->hash);
	for (int t = 0; t < TIER_NTIERS; t++)
		free(s->cands[t]);
	pthread_mutex_destroy(&s->lock);
	tier_meta_free(s);
}

static void stats_fill(tier_store *s, tier_stats *out)
{
	memset(out, 0, sizeof *out);
	out->magic = TIER_STATS_MAGIC;
	out->version = TIER_STATS_VERSION;
	out->size = sizeof *out;
	out->pid = (int32_t)getpid();
	out->hbm_emulated = backend_emulated(s->be[TIER_HBM]) ? 1 : 0;
	out->start_ns = s->start_ns;
	out->update_ns = tier_now_ns();
	out->step = s->step;
	out->objects = s->nobjects;
	out->object_bytes = s->object_bytes;
	for (int t = 0; t < TIER_NTIERS; t++) {
		snprintf(out->tier_name[t], sizeof out->tier_name[t], "%s%s", tier_name((tier_id)t),
			 t == TIER_HBM && out->hbm_emulated ? " (emulated)" : "");
		tier_stats_tier *st = &out->tier[t];
		if (s->be[t]) {
			st->capacity = backend_capacity(s->be[t]);
			st->used = backend_used(s->be[t]);
		}
		st->peak = s->peak[t];
		st->payload = s->payload[t];
		st->copies = s->ncopies[t];
		st->pinned = s->npinned[t];
		for (int c = 0; c < TIER_NCLASSES; c++) {
			const store_cls_stats *cs = &s->cls[t][c];
			out->cls[t][c] = (tier_stats_class){ cs->hits, cs->misses, cs->evictions, cs->writebacks, cs->drops,
								     cs->bytes_in, cs->unused };
		}
	}
	for (int c = 0; c < TIER_NCLASSES; c++)
		snprintf(out->class_name[c], sizeof out->class_name[c], "%s", tier_class_name((tier_class)c));
	for (int l = 0; l < TIER_NLINKS; l++) {
		tier_link_stats ls;
		tier_offload_link_stats(s->off, (tier_link)l, &ls);
		out->link[l] = (tier_stats_link){ ls.bytes, ls.transfers, ls.errors, ls.busy_ns };
		snprintf(out->link_name[l], sizeof out->link_name[l], "%s", tier_link_name((tier_link)l));
	}
	out->prefetch = s->pf;
	snprintf(out->job, sizeof out->job, "%s", s->job);
}

/* Publish at most every 10 ms (always when forced). Lock held. */
void store_maybe_publish(tier_store *s, int force)
{
	if (!s->pub)
		return;
	uint64_t now = tier_now_ns();
	if (!force && now - s->last_pub_ns < 10000000ull)
		return;
	s->last_pub_ns = now;
	tier_stats snap;
	stats_fill(s, &snap);
	tier_stats_publish(s->pub, &snap);
}

void tier_store_stats(tier_store *s, tier_stats *out)
{
	if (!s || !out)
		return;
	store_lock(s);
	store_reap(s);
	stats_fill(s, out);
	store_unlock(s);
}

void tier_store_set_job(tier_store *s, const char *job)
{
	if (!s)
		return;
	store_lock(s);
	snprintf(s->job, sizeof s->job, "%s", job ? job : "");
	store_maybe_publish(s, 1);
	store_unlock(s);
}

tier_offload *tier_store_offload(tier_store *s) { return s ? s->off : NULL; }

/* ---- tier_store_check ------------------------------------------------------------------------ */

#define BROKEN(...) return tier_fail(-EPROTO, __VA_ARGS__)

static int check_copy(tier_store *s, const store_copy *c, uint64_t *bytes, uint64_t *pins)
{
	const tier_object *o = c->obj;
	if (c->state == TIER_COPY_ABSENT) {
		if (c->pins || c->readers || c->xfer || c->filling)
			BROKEN("object %" PRIu64 ": absent copy in %s is pinned, read or filling", o->id, tier_name(c->tier));
		return 0;
	}
	if (!s->be[c->tier])
		BROKEN("object %" PRIu64 " has a copy in the disabled %s tier", o->id, tier_name(c->tier));
	if (c->ext.bytes != backend_rounded(s->be[c->tier], o->xlen))
		BROKEN("object %" PRIu64 ": extent in %s has %" PRIu64 " bytes, not the rounded size", o->id,
		       tier_name(c->tier), c->ext.bytes);
	if ((c->state == TIER_COPY_LOADING) != (c->xfer != NULL || c->failed != 0))
		BROKEN("object %" PRIu64 ": copy in %s is LOADING without a transfer, or has one without LOADING", o->id,
		       tier_name(c->tier));
	if (c->version > o->version)
		BROKEN("object %" PRIu64 ": copy in %s is newer than the object", o->id, tier_name(c->tier));
	int stale = c->state != TIER_COPY_LOADING && !c->filling && c->version != o->version;
	if ((stale || c->failed) && !c->pins && !c->readers)
		BROKEN("object %" PRIu64 ": a stale or failed copy in %s is kept though nothing uses it", o->id,
		       tier_name(c->tier));
	*bytes += c->ext.bytes;
	*pins += c->pins;
	return 0;
}

/* Copy states of one object: data reachable, at most one DIRTY and it is the newest. */
static int check_object(tier_store *s, const tier_object *o)
{
	int current = 0, dirty = 0, filling = 0;
	for (int t = 0; t < TIER_NTIERS; t++) {
		const store_copy *c = &o->copy[t];
		filling += c->filling;
		if (!store_copy_current(c))
			continue;
		current++;
		if (c->state == TIER_COPY_DIRTY) {
			dirty++;
			for (int u = t + 1; u < TIER_NTIERS; u++)
				if (store_copy_current(&o->copy[u]))
					BROKEN("object %" PRIu64 ": DIRTY copy in %s has a current copy below it in %s", o->id,
					       tier_name((tier_id)t), tier_name((tier_id)u));
		}
	}
	if (o->has_data && !current && !filling)
		BROKEN("object %" PRIu64 " has data but no VALID or DIRTY copy", o->id);
	if (!o->has_data && current)
		BROKEN("object %" PRIu64 " has a current copy but is marked as having no data", o->id);
	if (dirty > 1)
		BROKEN("object %" PRIu64 " has %d DIRTY copies", o->id, dirty);
	if (filling > 1 || o->guard)
		BROKEN("object %" PRIu64 ": %d copies filling, guard %u", o->id, filling, o->guard);
	return 0;
}

static int check_xfers(tier_store *s)
{
	size_t n = 0;
	for (const store_xfer *x = s->xfers; x; x = x->next, n++)
		if (x->dst->xfer != x || x->dst->state != TIER_COPY_LOADING || !x->src->readers)
			BROKEN("a transfer in flight does not match its copies (object %" PRIu64 ")", x->dst->obj->id);
	size_t readers = 0;
	for (const tier_object *o = s->objects; o; o = o->next)
		for (int t = 0; t < TIER_NTIERS; t++)
			readers += o->copy[t].readers;
	if (readers != n)
		BROKEN("%zu readers counted on copies but %zu transfers in flight", readers, n);
	return 0;
}

static int check_locked(tier_store *s)
{
	uint64_t bytes[TIER_NTIERS] = { 0 }, pins = 0, obj_bytes = 0;
	size_t nobj = 0;
	int rc;
	for (const tier_object *o = s->objects; o; o = o->next, nobj++) {
		if (store_obj_find(s, o->id) != o)
			BROKEN("object %" PRIu64 " is not found by its id", o->id);
		obj_bytes += o->size;
		for (int t = 0; t < TIER_NTIERS; t++)
			if ((rc = check_copy(s, &o->copy[t], &bytes[t], &pins)))
				return rc;
		if ((rc = check_object(s, o)))
			return rc;
	}
	if (nobj != s->nobjects || obj_bytes != s->object_bytes)
		BROKEN("%zu objects listed, %zu counted", nobj, s->nobjects);
	if (pins != s->outstanding + s->holds)
		BROKEN("pin counts add up to %" PRIu64 " but %" PRIu64 " acquires are outstanding (%" PRIu64 " held by waits)",
		       pins, s->outstanding, s->holds);
	for (int t = 0; t < TIER_NTIERS; t++) {
		if (!s->be[t])
			continue;
		uint64_t used = backend_used(s->be[t]), listed = 0, np = 0, pb = 0;
		for (const store_copy *c = s->held[t]; c; c = c->next) {
			listed += c->ext.bytes;
			np += c->pins > 0;
			pb += c->pins ? c->ext.bytes : 0;
		}
		if (used != bytes[t] || listed != bytes[t])
			BROKEN("%s: backend uses %" PRIu64 " bytes, extents add up to %" PRIu64 " (listed %" PRIu64 ")",
			       tier_name((tier_id)t), used, bytes[t], listed);
		if (used > backend_capacity(s->be[t]))
			BROKEN("%s: %" PRIu64 " bytes used, over the %" PRIu64 "-byte budget", tier_name((tier_id)t), used,
			       backend_capacity(s->be[t]));
		if (np != s->npinned[t] || pb != s->pinned_bytes[t])
			BROKEN("%s: pinned counters disagree with the copies", tier_name((tier_id)t));
		if ((rc = backend_check(s->be[t])))
			return rc;
	}
	return check_xfers(s);
}

int tier_store_check(tier_store *s)
{
	if (!s)
		return tier_fail(-EINVAL, "tier_store_check: store is NULL");
	store_lock(s);
	int rc = check_locked(s);
	store_unlock(s);
	return rc;
}
