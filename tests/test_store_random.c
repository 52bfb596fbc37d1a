/* test_store_random.c - 100,000 random store operations per policy on thrashing budgets, with the
 * invariants checked and every object's bytes checked against its seeded pattern after each one. */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "store_util.h"
#include "test_seed.h"

void offload_jitter(tier_offload *off, unsigned max_us); /* internal: random sleeps in the movers */

#define MAX_OBJS 160
#define MAX_HELD 3
#define MAX_LIVE_BYTES (40ull << 20)

/* The model of one object: what its bytes must be, and whether it has any. */
typedef struct {
	tier_object *o;
	uint64_t id, size, version;
	unsigned flags;
	int has_data; /* filled at least once and not known to be dropped */
} mobj;

typedef struct {
	int slot;
	tier_id tier;
	int init;
	void *addr;
} held;

typedef struct {
	tier_store *s;
	tier_rng rng;
	mobj obj[MAX_OBJS];
	held h[MAX_HELD];
	int nheld;
	uint64_t live_bytes;
	uint64_t acquires, enospc, enodata, checked_bytes;
} world;

static uint64_t seed_of(const mobj *m) { return m->id * 1000003ull + m->version; }

static uint64_t random_size(tier_rng *r)
{
	uint64_t p = tier_rng_below(r, 1000);
	if (p < 850)
		return 1 + tier_rng_below(r, 16384);
	if (p < 990)
		return 16384 + tier_rng_below(r, 256 << 10);
	return (512 << 10) + tier_rng_below(r, 2560 << 10); /* up to 3 MiB */
}

/* A random live object's slot (or an empty one when few live), so most operations do something. */
static int pick_live(world *w)
{
	int slot = 0;
	for (int k = 0; k < 8; k++)
		if (w->obj[slot = (int)tier_rng_below(&w->rng, MAX_OBJS)].o)
			break;
	return slot;
}

static int is_held(const world *w, int slot)
{
	for (int i = 0; i < w->nheld; i++)
		if (w->h[i].slot == slot)
			return 1;
	return 0;
}

static void op_create(world *w)
{
	int slot = (int)tier_rng_below(&w->rng, MAX_OBJS);
	mobj *m = &w->obj[slot];
	if (m->o)
		return;
	uint64_t size = random_size(&w->rng);
	if (w->live_bytes + size > MAX_LIVE_BYTES)
		return;
	unsigned flags = 0, f = (unsigned)tier_rng_below(&w->rng, 10);
	if (f == 0)
		flags = TIER_OBJ_FROZEN;
	else if (f == 1)
		flags = TIER_OBJ_DISCARDABLE;
	else if (f == 2)
		flags = TIER_OBJ_FROZEN | TIER_OBJ_DISCARDABLE;
	tier_class cls = (tier_class)tier_rng_below(&w->rng, TIER_NCLASSES);
	assert_int_equal(tier_obj_create(w->s, size, cls, flags, &m->o), 0);
	m->id = tier_obj_id(m->o);
	m->size = size;
	m->version = 0;
	m->flags = flags;
	m->has_data = 0;
	w->live_bytes += size;
	assert_true(tier_obj_size(m->o) == size && tier_obj_flags(m->o) == flags && tier_obj_class(m->o) == cls);
}

static void do_release(world *w, int i, int want_dirty)
{
	held hd = w->h[i];
	mobj *m = &w->obj[hd.slot];
	int dirty = hd.init || (want_dirty && !(m->flags & TIER_OBJ_FROZEN));
	if (dirty && !hd.init) {
		m->version++; /* the caller rewrites it */
		tier_pattern_fill(hd.addr, m->size, seed_of(m), 0);
	}
	if (hd.init)
		m->has_data = 1;
	assert_int_equal(tier_release(w->s, m->o, hd.tier, dirty), 0);
	w->h[i] = w->h[--w->nheld];
}

static void op_acquire(world *w)
{
	int slot = pick_live(w);
	mobj *m = &w->obj[slot];
	if (!m->o || is_held(w, slot))
		return;
	if (w->nheld == MAX_HELD) /* make a pin free first */
		do_release(w, (int)tier_rng_below(&w->rng, MAX_HELD), (int)tier_rng_below(&w->rng, 2));
	tier_id t = tier_rng_below(&w->rng, 2) ? TIER_DDR : TIER_HBM;
	int use_fence = (int)tier_rng_below(&w->rng, 2);
	void *addr = NULL;
	tier_fence *f = NULL;
	int rc = tier_acquire(w->s, m->o, t, 0, &addr, use_fence ? &f : NULL);
	w->acquires++;
	int init = 0;
	if (rc == -ENODATA) {
		/* Only a never-filled object or a discardable one that was dropped has no data. */
		assert_true(!m->has_data || (m->flags & TIER_OBJ_DISCARDABLE));
		w->enodata++;
		rc = tier_acquire(w->s, m->o, t, TIER_ACQ_INIT, &addr, NULL);
		init = 1;
	}
	if (rc == -ENOSPC) { /* legitimate only with pins or a full bottom tier */
		assert_non_null(strstr(tier_last_error(), "pinned"));
		w->enospc++;
		return;
	}
	assert_int_equal(rc, 0);
	assert_non_null(addr);
	if (f) {
		assert_int_equal(tier_fence_wait(f), 0);
		tier_fence_put(f);
	}
	if (init) {
		tier_pattern_fill(addr, m->size, seed_of(m), 0); /* a recompute gives the same bytes */
	} else {
		assert_true(m->has_data);
		size_t bad = tier_pattern_check(addr, m->size, seed_of(m), 0);
		if (bad != m->size)
			fail_msg("object %" PRIu64 " (%" PRIu64 " bytes, version %" PRIu64 ") differs at byte %zu in %s",
				 m->id, m->size, m->version, bad, tier_name(t));
		w->checked_bytes += m->size;
	}
	assert_true(tier_obj_pins(w->s, m->o, t) == 1);
	w->h[w->nheld++] = (held){ slot, t, init, addr };
	if (tier_rng_below(&w->rng, 3)) /* most acquires are released at once */
		do_release(w, w->nheld - 1, tier_rng_below(&w->rng, 3) == 0);
}

static void op_destroy(world *w)
{
	int slot = pick_live(w);
	mobj *m = &w->obj[slot];
	if (!m->o)
		return;
	if (is_held(w, slot)) {
		assert_int_equal(tier_obj_destroy(w->s, m->o), -EBUSY);
		return;
	}
	assert_int_equal(tier_obj_destroy(w->s, m->o), 0);
	w->live_bytes -= m->size;
	memset(m, 0, sizeof *m);
}

static void op_migrate(world *w)
{
	int slot = pick_live(w);
	mobj *m = &w->obj[slot];
	if (!m->o)
		return;
	tier_id t = (tier_id)tier_rng_below(&w->rng, TIER_NTIERS);
	int rc = tier_migrate(w->s, m->o, t);
	if (rc == 0) {
		tier_copy_state st = tier_obj_state(w->s, m->o, t);
		assert_true(st == TIER_COPY_VALID || st == TIER_COPY_DIRTY);
		for (int u = 0; u < TIER_NTIERS; u++)
			if ((tier_id)u != t)
				assert_int_equal(tier_obj_state(w->s, m->o, (tier_id)u), TIER_COPY_ABSENT);
	} else if (rc == -EBUSY) {
		assert_true(is_held(w, slot));
	} else if (rc == -ENODATA) {
		assert_true(!m->has_data || (m->flags & TIER_OBJ_DISCARDABLE));
	} else {
		assert_int_equal(rc, -ENOSPC);
	}
}

static void one_op(world *w, uint64_t i)
{
	uint64_t p = tier_rng_below(&w->rng, 100);
	if (p < 10)
		op_create(w);
	else if (p < 60)
		op_acquire(w);
	else if (p < 68 && w->nheld)
		do_release(w, (int)tier_rng_below(&w->rng, (uint64_t)w->nheld), (int)tier_rng_below(&w->rng, 2));
	else if (p < 78) {
		int slot = pick_live(w);
		if (w->obj[slot].o) {
			int rc = tier_prefetch(w->s, w->obj[slot].o, tier_rng_below(&w->rng, 2) ? TIER_DDR : TIER_HBM);
			assert_true(rc == 0 || rc == 1);
		}
	} else if (p < 83)
		op_migrate(w);
	else if (p < 88)
		op_destroy(w);
	else if (p < 90)
		tier_store_step(w->s);
	else
		tier_store_at_op(w->s, (size_t)i);
	if (tier_store_check(w->s) != 0)
		fail_msg("after operation %" PRIu64 ": %s", i, tier_last_error());
}

/* A cyclic schedule over the ids the workload will create, so that the schedule policy and the
 * prefetcher have something to read. */
static void set_schedule(world *w)
{
	enum { NOPS = 64, PER = 4 };
	static uint64_t ids[NOPS][PER];
	tier_sched_op ops[NOPS];
	for (int i = 0; i < NOPS; i++) {
		for (int k = 0; k < PER; k++)
			ids[i][k] = 1 + tier_rng_below(&w->rng, 400);
		ops[i] = (tier_sched_op){ ids[i], PER, (i & 1) ? TIER_DDR : TIER_HBM };
	}
	assert_int_equal(tier_store_set_schedule(w->s, ops, NOPS, 1), 0);
}

static void run_policy(tier_policy_kind pol)
{
	static world w;
	test_store ts;
	const char *env = getenv("TIER_STORE_OPS");
	uint64_t nops = env ? strtoull(env, NULL, 10) : getenv("TIER_VALGRIND") && atoi(getenv("TIER_VALGRIND")) ? 3000 : 100000;
	const char *only = getenv("TIER_TEST_POLICY");
	if (only && *only && strcmp(only, tier_policy_name(pol)))
		skip();
	/* printed first, so that a failure can be replayed (TIER_TEST_SEED, TIER_TEST_POLICY) */
	uint64_t seed = test_seed(tier_policy_name(pol), (uint64_t)pol);
	memset(&w, 0, sizeof w);
	tier_rng_seed(&w.rng, seed);
	assert_int_equal(test_store_open(&ts, pol, 4u << 20, 8u << 20, 64u << 20, (int)(seed & 1)), 0);
	w.s = ts.s;
	/* TIER_TEST_JITTER_US: the movers sleep up to this long around each transfer, so that transfers
	 * stay in flight across many store calls (the races a busy machine shows once in hundreds of runs) */
	const char *jit = getenv("TIER_TEST_JITTER_US");
	if (jit && *jit)
		offload_jitter(tier_store_offload(w.s), (unsigned)strtoul(jit, NULL, 10));
	set_schedule(&w);
	uint64_t t0 = tier_now_ns();
	for (uint64_t i = 0; i < nops; i++)
		one_op(&w, i);
	while (w.nheld)
		do_release(&w, 0, 0);
	assert_int_equal(tier_store_check(w.s), 0);
	/* Every object still holds its bytes, wherever it went (HBM -> DDR -> NVMe -> HBM). */
	for (int i = 0; i < MAX_OBJS; i++) {
		mobj *m = &w.obj[i];
		void *addr;
		if (!m->o || !m->has_data)
			continue;
		int rc = tier_acquire(w.s, m->o, TIER_HBM, 0, &addr, NULL);
		if (rc == -ENODATA && (m->flags & TIER_OBJ_DISCARDABLE))
			continue;
		assert_int_equal(rc, 0);
		assert_int_equal(tier_pattern_check(addr, m->size, seed_of(m), 0), m->size);
		assert_int_equal(tier_release(w.s, m->o, TIER_HBM, 0), 0);
	}
	tier_stats st;
	tier_store_stats(w.s, &st);
	printf("# policy %-8s seed %" PRIu64 ": %" PRIu64 " ops in %.2f s, %" PRIu64 " acquires (%" PRIu64
	       " ENOSPC, %" PRIu64 " ENODATA), %.1f MiB checked, nvme write %.1f MiB read %.1f MiB to-hbm %.1f MiB\n",
	       tier_policy_name(pol), seed, nops, (tier_now_ns() - t0) / 1e9, w.acquires, w.enospc, w.enodata,
	       w.checked_bytes / 1048576.0, st.link[TIER_LINK_NVME_WRITE].bytes / 1048576.0,
	       st.link[TIER_LINK_NVME_READ].bytes / 1048576.0, st.link[TIER_LINK_NVME_TO_HBM].bytes / 1048576.0);
	if (nops >= 20000) { /* the budgets are small enough that data went all the way down and back */
		assert_true(st.link[TIER_LINK_NVME_WRITE].bytes > 0 || st.link[TIER_LINK_HBM_TO_NVME].bytes > 0);
		assert_true(st.link[TIER_LINK_NVME_READ].bytes > 0 || st.link[TIER_LINK_NVME_TO_HBM].bytes > 0);
		assert_true(st.prefetch.issued > 0);
	}
	for (int t = 0; t < TIER_NTIERS; t++)
		assert_true(st.tier[t].peak <= st.tier[t].capacity);
	test_store_close(&ts);
}

static void test_random_lru(void **state) { (void)state; run_policy(TIER_POLICY_LRU); }
static void test_random_lfu(void **state) { (void)state; run_policy(TIER_POLICY_LFU); }
static void test_random_cost(void **state) { (void)state; run_policy(TIER_POLICY_COST); }
static void test_random_schedule(void **state) { (void)state; run_policy(TIER_POLICY_SCHEDULE); }

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_random_lru),
		cmocka_unit_test(test_random_lfu),
		cmocka_unit_test(test_random_cost),
		cmocka_unit_test(test_random_schedule),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
