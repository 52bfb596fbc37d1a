/* test_store_policy.c - each policy evicts the victim it should on small hand-worked cases; frozen
 * copies are never written back, dirty ones always are (synchronously at eviction, or ahead of it
 * through tier_writeback); discarded data moves nowhere. */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "store_util.h"

#define OBJ (64u << 10) /* three of these fill the HBM budget of these tests */

static uint64_t fill(tier_store *s, tier_object *o, tier_id t, uint64_t seed)
{
	void *addr = NULL;
	assert_int_equal(tier_acquire(s, o, t, TIER_ACQ_INIT, &addr, NULL), 0);
	tier_pattern_fill(addr, tier_obj_size(o), seed, 0);
	assert_int_equal(tier_release(s, o, t, 1), 0);
	return seed;
}

static void touch(tier_store *s, tier_object *o, tier_id t, uint64_t seed)
{
	void *addr = NULL;
	assert_int_equal(tier_acquire(s, o, t, 0, &addr, NULL), 0);
	assert_int_equal(tier_pattern_check(addr, tier_obj_size(o), seed, 0), tier_obj_size(o));
	assert_int_equal(tier_release(s, o, t, 0), 0);
}

static int in_hbm(tier_store *s, tier_object *o)
{
	tier_copy_state st = tier_obj_state(s, o, TIER_HBM);
	return st == TIER_COPY_VALID || st == TIER_COPY_DIRTY;
}

static tier_object *mk(tier_store *s, uint64_t size, unsigned flags)
{
	tier_object *o = NULL;
	assert_int_equal(tier_obj_create(s, size, TIER_CLASS_LORA, flags, &o), 0);
	return o;
}

/* Three objects fill HBM; which one goes when a fourth arrives? Returns the evicted index. */
static int evicted(tier_store *s, tier_object *const *o, int n)
{
	int gone = -1;
	for (int i = 0; i < n; i++)
		if (!in_hbm(s, o[i])) {
			assert_int_equal(gone, -1); /* exactly one victim */
			gone = i;
		}
	assert_int_not_equal(gone, -1);
	assert_int_equal(tier_store_check(s), 0);
	return gone;
}

static void test_lru(void **state)
{
	test_store ts;
	tier_object *o[4];
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 3 * OBJ, 16 * OBJ, 0, 0), 0);
	for (int i = 0; i < 3; i++)
		fill(ts.s, o[i] = mk(ts.s, OBJ, 0), TIER_HBM, 10 + i);
	touch(ts.s, o[2], TIER_HBM, 12);
	touch(ts.s, o[0], TIER_HBM, 10); /* last uses: 1 oldest, then 2, then 0 */
	fill(ts.s, o[3] = mk(ts.s, OBJ, 0), TIER_HBM, 13);
	assert_int_equal(evicted(ts.s, o, 3), 1);
	/* The victim was the only copy: it was written back to DDR, data intact. */
	assert_int_equal(tier_obj_state(ts.s, o[1], TIER_DDR), TIER_COPY_VALID);
	touch(ts.s, o[1], TIER_DDR, 11);
	tier_stats st;
	tier_store_stats(ts.s, &st);
	assert_true(st.cls[TIER_HBM][TIER_CLASS_LORA].writebacks == 1 && st.cls[TIER_HBM][TIER_CLASS_LORA].evictions == 1);
	test_store_close(&ts);
}

/* LFU with a half-life of one step: object 0 was hot long ago (9 accesses at step 0), objects 1
 * and 2 were used a few times at step 6, and object 0 once more, last. Without decay 0 would stay;
 * LRU would evict 1; decayed LFU evicts 0 (9/64 + 1 < 1/64 + 2). */
static void test_lfu_decay(void **state)
{
	test_store ts;
	tier_object *o[4];
	(void)state;
	tier_store_config cfg;
	assert_int_equal(test_tmpdir(ts.dir, sizeof ts.dir), 0);
	cfg = (tier_store_config){ .capacity = { 3 * OBJ, 16 * OBJ, 0 }, .policy = TIER_POLICY_LFU, .half_life_steps = 1,
				   .offload_config = test_offload_config() };
	assert_int_equal(tier_store_create(&ts.s, &cfg), 0);
	for (int i = 0; i < 3; i++)
		fill(ts.s, o[i] = mk(ts.s, OBJ, 0), TIER_HBM, 20 + i);
	for (int k = 0; k < 8; k++)
		touch(ts.s, o[0], TIER_HBM, 20);
	for (int k = 0; k < 6; k++)
		tier_store_step(ts.s);
	for (int k = 0; k < 2; k++)
		touch(ts.s, o[1], TIER_HBM, 21);
	for (int k = 0; k < 3; k++)
		touch(ts.s, o[2], TIER_HBM, 22);
	touch(ts.s, o[0], TIER_HBM, 20);
	fill(ts.s, o[3] = mk(ts.s, OBJ, 0), TIER_HBM, 23);
	assert_int_equal(evicted(ts.s, o, 3), 0);
	touch(ts.s, o[0], TIER_HBM, 20); /* and it comes back intact */
	test_store_close(&ts);
}

/* Cost: a big object with a copy in DDR is cheap to bring back (one copy over PCIe); a small
 * discardable one costs a second of recompute. The big one goes, though it was used last. */
static void test_cost(void **state)
{
	test_store ts;
	tier_object *o[3];
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_COST, 3 * OBJ, 16 * OBJ, 0, 0), 0);
	tier_object *big = o[0] = mk(ts.s, 2 * OBJ, 0);
	tier_object *small = o[1] = mk(ts.s, OBJ / 4, TIER_OBJ_DISCARDABLE);
	tier_object *pinned = o[2] = mk(ts.s, OBJ / 2, 0);
	tier_obj_set_cost(ts.s, small, 1e9);
	fill(ts.s, big, TIER_DDR, 30);
	touch(ts.s, big, TIER_HBM, 30);
	fill(ts.s, small, TIER_HBM, 31);
	fill(ts.s, pinned, TIER_HBM, 32);
	assert_int_equal(tier_acquire(ts.s, pinned, TIER_HBM, 0, &addr, NULL), 0);
	touch(ts.s, small, TIER_HBM, 31);
	touch(ts.s, big, TIER_HBM, 30); /* most recent */
	tier_object *next = mk(ts.s, OBJ / 2, 0); /* evicting `small` alone would make room too */
	fill(ts.s, next, TIER_HBM, 33);
	assert_int_equal(evicted(ts.s, o, 3), 0);
	assert_true(in_hbm(ts.s, small));
	/* The big one was dropped, not written back: its DDR copy is still the data. */
	tier_stats st;
	tier_store_stats(ts.s, &st);
	assert_true(st.cls[TIER_HBM][TIER_CLASS_LORA].drops == 1 && st.cls[TIER_HBM][TIER_CLASS_LORA].writebacks == 0);
	assert_int_equal(tier_release(ts.s, pinned, TIER_HBM, 0), 0);
	test_store_close(&ts);
}

/* Schedule: Belady's choice, whatever the recency. */
static void sched(tier_store *s, const uint64_t *ids, size_t n)
{
	tier_sched_op ops[16];
	for (size_t i = 0; i < n; i++)
		ops[i] = (tier_sched_op){ &ids[i], ids[i] ? 1 : 0, TIER_HBM };
	assert_int_equal(tier_store_set_schedule(s, ops, n, 0), 0);
}

static void test_schedule(void **state)
{
	test_store ts;
	tier_object *o[3];
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_SCHEDULE, 3 * OBJ, 16 * OBJ, 0, 0), 0);
	tier_store_set_prefetch_window(ts.s, 0);
	for (int i = 0; i < 3; i++)
		o[i] = mk(ts.s, OBJ, 0);
	uint64_t a = tier_obj_id(o[0]), b = tier_obj_id(o[1]), c = tier_obj_id(o[2]);
	/* Case 1: at op 6, a is next needed at 9, b at 8, c never again: c goes (LRU would take a). */
	uint64_t ids1[10] = { a, b, c, a, b, c, 0, 0, b, a };
	sched(ts.s, ids1, 10);
	for (int i = 0; i < 3; i++)
		fill(ts.s, o[i], TIER_HBM, 40 + i);
	touch(ts.s, o[0], TIER_HBM, 40);
	touch(ts.s, o[1], TIER_HBM, 41);
	touch(ts.s, o[2], TIER_HBM, 42);
	tier_store_at_op(ts.s, 6);
	tier_object *d = mk(ts.s, OBJ, 0);
	fill(ts.s, d, TIER_HBM, 43);
	assert_int_equal(evicted(ts.s, o, 3), 2);
	assert_int_equal(tier_obj_destroy(ts.s, d), 0);
	/* Case 2: all named. At op 2: c is needed now, b at 4, a at 5 (furthest): a goes, though it
	 * is the most recently used. */
	touch(ts.s, o[2], TIER_HBM, 42);
	uint64_t ids2[6] = { a, b, c, c, b, a };
	sched(ts.s, ids2, 6);
	touch(ts.s, o[2], TIER_HBM, 42);
	touch(ts.s, o[1], TIER_HBM, 41);
	touch(ts.s, o[0], TIER_HBM, 40);
	tier_store_at_op(ts.s, 2);
	d = mk(ts.s, OBJ, 0);
	fill(ts.s, d, TIER_HBM, 44);
	assert_int_equal(evicted(ts.s, o, 3), 0);
	/* Case 3: a cyclic schedule wraps: at op 4 of a b c c b a (cyclic), a is needed at 5, b at
	 * 4, c at 6+2=8: c goes. */
	assert_int_equal(tier_obj_destroy(ts.s, d), 0);
	touch(ts.s, o[0], TIER_HBM, 40);
	tier_sched_op ops[6];
	for (int i = 0; i < 6; i++)
		ops[i] = (tier_sched_op){ &ids2[i], 1, TIER_HBM };
	assert_int_equal(tier_store_set_schedule(ts.s, ops, 6, 1), 0);
	tier_store_at_op(ts.s, 6 + 4);
	d = mk(ts.s, OBJ, 0);
	fill(ts.s, d, TIER_HBM, 45);
	assert_int_equal(evicted(ts.s, o, 3), 2);
	test_store_close(&ts);
}

/* Frozen objects are written back once (their first fill has nowhere else to be), then never:
 * evicting a frozen copy with a valid copy below is a drop, and no bytes move down. */
static void test_frozen_never_written_back(void **state)
{
	test_store ts;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 16 * OBJ, 64 * OBJ, 0), 0);
	tier_object *f = mk(ts.s, OBJ, TIER_OBJ_FROZEN), *x = mk(ts.s, OBJ, 0), *y = mk(ts.s, OBJ, 0);
	fill(ts.s, f, TIER_HBM, 50);
	fill(ts.s, x, TIER_HBM, 51);
	fill(ts.s, y, TIER_HBM, 52); /* evicts f: its only copy goes down to DDR (one writeback) */
	assert_int_equal(tier_obj_state(ts.s, f, TIER_HBM), TIER_COPY_ABSENT);
	uint64_t d2h = test_link_bytes(ts.s, TIER_LINK_D2H), h2d0 = test_link_bytes(ts.s, TIER_LINK_H2D);
	assert_true(d2h >= OBJ);
	for (int k = 0; k < 10; k++) { /* f and x take turns in HBM */
		touch(ts.s, f, TIER_HBM, 50);
		touch(ts.s, y, TIER_HBM, 52);
		touch(ts.s, x, TIER_HBM, 51);
	}
	tier_stats st;
	tier_store_stats(ts.s, &st);
	/* f came back over H2D many times but never went down again. x and y: written back once each
	 * at most, because they were never rewritten either. */
	assert_true(test_link_bytes(ts.s, TIER_LINK_H2D) >= h2d0 + 10 * OBJ);
	assert_true(test_link_bytes(ts.s, TIER_LINK_D2H) <= d2h + 2 * OBJ);
	assert_true(st.cls[TIER_HBM][TIER_CLASS_LORA].writebacks <= 3);
	assert_true(st.cls[TIER_HBM][TIER_CLASS_LORA].drops >= 20);
	/* A dirty release of a frozen object after its fill is refused. */
	void *addr;
	assert_int_equal(tier_acquire(ts.s, f, TIER_HBM, 0, &addr, NULL), 0);
	assert_int_equal(tier_release(ts.s, f, TIER_HBM, 1), -EPERM);
	assert_int_equal(tier_release(ts.s, f, TIER_HBM, 0), 0);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* Dirty copies are always written back before they are dropped, and the bytes that come back
 * are the rewritten ones. */
static void test_dirty_written_back(void **state)
{
	test_store ts;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 16 * OBJ, 64 * OBJ, 0), 0);
	tier_object *g = mk(ts.s, OBJ, 0), *x = mk(ts.s, OBJ, 0), *y = mk(ts.s, OBJ, 0);
	fill(ts.s, g, TIER_DDR, 60);
	for (uint64_t v = 61; v < 71; v++) {
		assert_int_equal(tier_acquire(ts.s, g, TIER_HBM, 0, &addr, NULL), 0);
		assert_int_equal(tier_pattern_check(addr, OBJ, v - 1, 0), OBJ);
		tier_pattern_fill(addr, OBJ, v, 0); /* rewrite: the DDR copy is now stale */
		assert_int_equal(tier_release(ts.s, g, TIER_HBM, 1), 0);
		assert_int_equal(tier_obj_state(ts.s, g, TIER_DDR), TIER_COPY_ABSENT);
		assert_int_equal(tier_obj_state(ts.s, g, TIER_HBM), TIER_COPY_DIRTY);
		uint64_t d2h = test_link_bytes(ts.s, TIER_LINK_D2H);
		fill(ts.s, x, TIER_HBM, 1000 + v);
		fill(ts.s, y, TIER_HBM, 2000 + v); /* g goes: written back first */
		assert_int_equal(tier_obj_state(ts.s, g, TIER_HBM), TIER_COPY_ABSENT);
		assert_true(test_link_bytes(ts.s, TIER_LINK_D2H) >= d2h + OBJ);
		touch(ts.s, g, TIER_DDR, v);
		assert_int_equal(tier_store_check(ts.s), 0);
	}
	test_store_close(&ts);
}

/* The statistics agree with a hand-counted sequence, and the published segment carries them. */
static void test_stats(void **state)
{
	test_store ts;
	tier_store_config cfg = { .capacity = { 2 * OBJ, 16 * OBJ, 0 }, .policy = TIER_POLICY_LRU, .publish_stats = 1,
				  .offload_config = test_offload_config() };
	tier_stats st, pub;
	(void)state;
	ts.dir[0] = 0;
	assert_int_equal(tier_store_create(&ts.s, &cfg), 0);
	tier_store_set_job(ts.s, "policy test");
	tier_object *a = mk(ts.s, OBJ, 0), *b = mk(ts.s, OBJ - 1000, 0), *c = mk(ts.s, 3000, 0);
	fill(ts.s, a, TIER_DDR, 1);          /* DDR miss (INIT) */
	fill(ts.s, b, TIER_DDR, 2);          /* DDR miss (INIT) */
	touch(ts.s, a, TIER_HBM, 1);         /* HBM miss, demand */
	touch(ts.s, a, TIER_HBM, 1);         /* HBM hit */
	assert_int_equal(tier_prefetch(ts.s, b, TIER_HBM), 0);
	int again = tier_prefetch(ts.s, b, TIER_HBM); /* there already (0) or still loading (1) */
	assert_true(again == 0 || again == 1);
	touch(ts.s, b, TIER_HBM, 2);         /* on time or late: a hit either way */
	fill(ts.s, c, TIER_HBM, 3);          /* HBM miss (INIT), evicts a (VALID: a drop) */
	assert_int_equal(tier_prefetch(ts.s, a, TIER_NVME), 1);
	tier_store_step(ts.s);
	tier_store_stats(ts.s, &st);
	const tier_stats_class *h = &st.cls[TIER_HBM][TIER_CLASS_LORA], *d = &st.cls[TIER_DDR][TIER_CLASS_LORA];
	assert_int_equal(h->hits, 2);
	assert_int_equal(h->misses, 2);
	assert_int_equal(d->misses, 2);
	assert_int_equal(h->evictions, 1);
	assert_int_equal(h->drops, 1);
	assert_int_equal(st.prefetch.issued, 1);
	assert_int_equal(st.prefetch.on_time + st.prefetch.late, 1);
	assert_int_equal(st.prefetch.missed, 1);
	assert_int_equal(st.tier[TIER_HBM].copies, 2);
	assert_int_equal(st.tier[TIER_HBM].payload, OBJ - 1000 + 3000);
	assert_int_equal(st.tier[TIER_HBM].used, OBJ + 4096);
	assert_int_equal(st.tier[TIER_HBM].peak, 2 * OBJ);
	assert_int_equal(st.tier[TIER_DDR].copies, 2);
	assert_int_equal(st.objects, 3);
	assert_int_equal(st.step, 1);
	assert_true(st.link[TIER_LINK_H2D].bytes >= 2 * OBJ - 1000);
	assert_string_equal(st.tier_name[TIER_HBM], "hbm (emulated)");
	assert_string_equal(st.class_name[TIER_CLASS_LORA], "lora");
	assert_int_equal(tier_stats_read(getpid(), &pub), 0); /* published at the step */
	assert_string_equal(pub.job, "policy test");
	assert_int_equal(pub.step, 1);
	assert_memory_equal(&pub.cls, &st.cls, sizeof st.cls);
	assert_memory_equal(&pub.tier, &st.tier, sizeof st.tier);
	tier_store_destroy(ts.s);
	assert_int_equal(tier_stats_read(getpid(), &pub), -ESRCH); /* removed at destroy */
}

/* tier_writeback: the dirty copy is written down without waiting, so that evicting it later is a
 * drop, not a writeback; a rewrite meanwhile wins; a pinned copy is declined. */
static void test_async_writeback(void **state)
{
	test_store ts;
	tier_stats st;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 16 * OBJ, 0, 0), 0);
	tier_object *g = mk(ts.s, OBJ, 0), *x = mk(ts.s, OBJ, 0), *y = mk(ts.s, OBJ, 0);
	fill(ts.s, g, TIER_HBM, 70);
	assert_int_equal(tier_acquire(ts.s, g, TIER_HBM, 0, &addr, NULL), 0);
	assert_int_equal(tier_writeback(ts.s, g), 1); /* pinned: declined */
	assert_int_equal(tier_release(ts.s, g, TIER_HBM, 0), 0);
	uint64_t d2h = test_link_bytes(ts.s, TIER_LINK_D2H);
	assert_int_equal(tier_writeback(ts.s, g), 0);
	touch(ts.s, g, TIER_HBM, 70); /* still usable in HBM while (or after) it is written */
	while (tier_obj_state(ts.s, g, TIER_DDR) == TIER_COPY_LOADING)
		usleep(100); /* settled: only then is g evictable (a copy being read is not) */
	assert_int_equal(tier_obj_state(ts.s, g, TIER_DDR), TIER_COPY_VALID);
	assert_int_equal(tier_obj_state(ts.s, g, TIER_HBM), TIER_COPY_VALID);
	tier_store_stats(ts.s, &st);
	uint64_t wb = st.cls[TIER_HBM][TIER_CLASS_LORA].writebacks, drops = st.cls[TIER_HBM][TIER_CLASS_LORA].drops;
	fill(ts.s, x, TIER_HBM, 71);
	fill(ts.s, y, TIER_HBM, 72); /* g goes, clean now: dropped */
	assert_int_equal(tier_obj_state(ts.s, g, TIER_HBM), TIER_COPY_ABSENT);
	tier_store_stats(ts.s, &st);
	assert_int_equal(st.cls[TIER_HBM][TIER_CLASS_LORA].writebacks, wb);
	assert_int_equal(st.cls[TIER_HBM][TIER_CLASS_LORA].drops, drops + 1);
	assert_true(test_link_bytes(ts.s, TIER_LINK_D2H) >= d2h + OBJ);
	touch(ts.s, g, TIER_DDR, 70);
	/* a rewrite after the writeback started: the newest data survives the next eviction */
	assert_int_equal(tier_writeback(ts.s, y), 0);
	assert_int_equal(tier_acquire(ts.s, y, TIER_HBM, 0, &addr, NULL), 0);
	tier_pattern_fill(addr, OBJ, 73, 0);
	assert_int_equal(tier_release(ts.s, y, TIER_HBM, 1), 0);
	assert_int_equal(tier_writeback(ts.s, x), 0);
	assert_int_equal(tier_writeback(ts.s, x), 0); /* clean or under way: nothing more to start */
	touch(ts.s, g, TIER_HBM, 70);
	fill(ts.s, g, TIER_HBM, 74); /* x or y goes */
	touch(ts.s, y, TIER_DDR, 73);
	touch(ts.s, x, TIER_DDR, 71);
	assert_int_equal(tier_writeback(ts.s, x), 0); /* nothing dirty anywhere but the lowest tier */
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* tier_obj_discard: the data is gone everywhere, nothing is written or fetched for it; the next
 * acquire fills it again; a pinned object is refused. */
static void test_discard(void **state)
{
	test_store ts;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 16 * OBJ, 0, 0), 0);
	tier_object *g = mk(ts.s, OBJ, 0), *x = mk(ts.s, OBJ, 0), *y = mk(ts.s, OBJ, 0);
	fill(ts.s, g, TIER_DDR, 80);
	touch(ts.s, g, TIER_HBM, 80);
	assert_int_equal(tier_acquire(ts.s, g, TIER_HBM, 0, &addr, NULL), 0);
	assert_int_equal(tier_obj_discard(ts.s, g), -EBUSY);
	assert_int_equal(tier_release(ts.s, g, TIER_HBM, 0), 0);
	touch(ts.s, g, TIER_HBM, 80); /* the refused discard changed nothing */
	uint64_t d2h = test_link_bytes(ts.s, TIER_LINK_D2H), h2d = test_link_bytes(ts.s, TIER_LINK_H2D);
	fill(ts.s, x, TIER_HBM, 81); /* dirty, then discarded: never written down */
	assert_int_equal(tier_obj_discard(ts.s, x), 0);
	assert_int_equal(tier_obj_discard(ts.s, g), 0);
	for (int t = 0; t < 2; t++) {
		assert_int_equal(tier_obj_state(ts.s, g, (tier_id)t), TIER_COPY_ABSENT);
		assert_int_equal(tier_obj_state(ts.s, x, (tier_id)t), TIER_COPY_ABSENT);
	}
	assert_int_equal(tier_acquire(ts.s, g, TIER_HBM, 0, &addr, NULL), -ENODATA);
	assert_int_equal(tier_prefetch(ts.s, g, TIER_HBM), 1);
	fill(ts.s, y, TIER_HBM, 82);
	fill(ts.s, g, TIER_HBM, 83);
	fill(ts.s, x, TIER_HBM, 84); /* y goes down: the only writeback */
	assert_int_equal(test_link_bytes(ts.s, TIER_LINK_D2H), d2h + OBJ);
	assert_int_equal(test_link_bytes(ts.s, TIER_LINK_H2D), h2d);
	touch(ts.s, y, TIER_DDR, 82);
	touch(ts.s, g, TIER_HBM, 83);
	assert_int_equal(tier_obj_discard(ts.s, NULL), -EINVAL);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* A demand acquire that finds every unpinned copy busy in a transfer waits for it instead of
 * failing for room. */
static void test_alloc_waits_for_transfers(void **state)
{
	test_store ts;
	void *addr;
	(void)state;
	for (int round = 0; round < 20; round++) {
		assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 16 * OBJ, 0, 0), 0);
		tier_object *a = mk(ts.s, OBJ, 0), *b = mk(ts.s, OBJ, 0), *c = mk(ts.s, OBJ, 0);
		fill(ts.s, a, TIER_HBM, 90);
		fill(ts.s, b, TIER_HBM, 91);
		assert_int_equal(tier_acquire(ts.s, a, TIER_HBM, 0, &addr, NULL), 0);
		assert_int_equal(tier_writeback(ts.s, b), 0); /* b is read by the transfer */
		assert_int_equal(tier_acquire(ts.s, c, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), 0);
		assert_int_equal(tier_release(ts.s, c, TIER_HBM, 1), 0);
		assert_int_equal(tier_release(ts.s, a, TIER_HBM, 0), 0);
		touch(ts.s, b, TIER_DDR, 91);
		assert_int_equal(tier_store_check(ts.s), 0);
		test_store_close(&ts);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_lru),
		cmocka_unit_test(test_lfu_decay),
		cmocka_unit_test(test_cost),
		cmocka_unit_test(test_schedule),
		cmocka_unit_test(test_frozen_never_written_back),
		cmocka_unit_test(test_dirty_written_back),
		cmocka_unit_test(test_stats),
		cmocka_unit_test(test_async_writeback),
		cmocka_unit_test(test_discard),
		cmocka_unit_test(test_alloc_waits_for_transfers),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
