/* test_store_errors.c - bad input and failures: each returns its error with a message, and the
 * store stays consistent and usable with no data lost. */
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

#define OBJ (64u << 10)

static tier_object *mk(tier_store *s, uint64_t size, unsigned flags)
{
	tier_object *o = NULL;
	assert_int_equal(tier_obj_create(s, size, TIER_CLASS_OPTIM, flags, &o), 0);
	return o;
}

static void fill(tier_store *s, tier_object *o, tier_id t, uint64_t seed)
{
	void *addr = NULL;
	assert_int_equal(tier_acquire(s, o, t, TIER_ACQ_INIT, &addr, NULL), 0);
	tier_pattern_fill(addr, tier_obj_size(o), seed, 0);
	assert_int_equal(tier_release(s, o, t, 1), 0);
}

static void expect(tier_store *s, tier_object *o, tier_id t, uint64_t seed)
{
	void *addr = NULL;
	assert_int_equal(tier_acquire(s, o, t, 0, &addr, NULL), 0);
	assert_int_equal(tier_pattern_check(addr, tier_obj_size(o), seed, 0), tier_obj_size(o));
	assert_int_equal(tier_release(s, o, t, 0), 0);
}

static void test_bad_config(void **state)
{
	tier_store *s = (tier_store *)&s;
	char dir[256];
	const char *dirs[1] = { dir };
	(void)state;
	assert_int_equal(test_tmpdir(dir, sizeof dir), 0);
	tier_store_config cfg = { .capacity = { 0, 1 << 20, 0 } };
	assert_int_equal(tier_store_create(&s, &cfg), -EINVAL);
	assert_null(s);
	assert_non_null(strstr(tier_last_error(), "hbm"));
	cfg = (tier_store_config){ .capacity = { 1 << 20, 0, 0 } };
	assert_int_equal(tier_store_create(&s, &cfg), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "ddr"));
	cfg = (tier_store_config){ .capacity = { 1 << 20, 1 << 20, 1 << 20 } }; /* nvme without dirs */
	assert_int_equal(tier_store_create(&s, &cfg), -EINVAL);
	cfg = (tier_store_config){ .capacity = { 1 << 20, 1 << 20, 0 }, .policy = (tier_policy_kind)9 };
	assert_int_equal(tier_store_create(&s, &cfg), -EINVAL);
	const char *bad[1] = { "no-such-dir-for-tier-tests/x" };
	cfg = (tier_store_config){ .capacity = { 1 << 20, 1 << 20, 1 << 20 }, .nvme_dirs = bad, .n_nvme_dirs = 1,
				   .offload_config = test_offload_config() };
	assert_int_equal(tier_store_create(&s, &cfg), -ENOENT); /* the backend names the directory */
	assert_null(s);
	assert_non_null(strstr(tier_last_error(), "no-such-dir-for-tier-tests"));
	cfg.nvme_dirs = dirs; /* and a good one works, leaving nothing behind at destroy */
	assert_int_equal(tier_store_create(&s, &cfg), 0);
	tier_store_destroy(s);
	assert_int_equal(tier_store_create(NULL, &cfg), -EINVAL);
	tier_policy_kind k;
	assert_int_equal(tier_policy_parse("schedule", &k), 0);
	assert_int_equal(k, TIER_POLICY_SCHEDULE);
	assert_int_equal(tier_policy_parse("mru", &k), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "lru, lfu, cost or schedule"));
	assert_int_equal(rmdir(dir), 0); /* empty again */
}

static void test_bad_objects(void **state)
{
	test_store ts;
	tier_object *o = (tier_object *)&o;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 4 * OBJ, 8 * OBJ, 16 * OBJ, 0), 0);
	assert_int_equal(tier_obj_create(ts.s, 0, TIER_CLASS_ACT, 0, &o), -EINVAL);
	assert_null(o);
	assert_non_null(strstr(tier_last_error(), "size is 0"));
	assert_int_equal(tier_obj_create(ts.s, 16, (tier_class)77, 0, &o), -EINVAL);
	assert_int_equal(tier_obj_create(ts.s, 16, TIER_CLASS_ACT, 0x80, &o), -EINVAL);
	assert_int_equal(tier_obj_create(ts.s, 17 * OBJ, TIER_CLASS_ACT, 0, &o), -E2BIG);
	assert_non_null(strstr(tier_last_error(), "larger than every tier"));
	/* Larger than HBM but not than NVMe: created, and acquiring it in HBM says why not. */
	o = mk(ts.s, 6 * OBJ, 0);
	assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), -ENOSPC);
	assert_non_null(strstr(tier_last_error(), "does not fit in the hbm budget"));
	assert_int_equal(tier_acquire(ts.s, o, TIER_NVME, 0, &addr, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "nvme"));
	assert_int_equal(tier_acquire(ts.s, o, TIER_DDR, 0, &addr, NULL), -ENODATA);
	assert_non_null(strstr(tier_last_error(), "TIER_ACQ_INIT"));
	assert_int_equal(tier_acquire(ts.s, o, TIER_DDR, 0x40, &addr, NULL), -EINVAL);
	assert_int_equal(tier_release(ts.s, o, TIER_DDR, 0), -EINVAL); /* not pinned */
	assert_non_null(strstr(tier_last_error(), "not pinned"));
	assert_int_equal(tier_acquire(ts.s, o, TIER_DDR, TIER_ACQ_INIT, &addr, NULL), 0);
	assert_int_equal(tier_obj_destroy(ts.s, o), -EBUSY);
	assert_int_equal(tier_acquire(ts.s, o, TIER_DDR, 0, &addr, NULL), -EBUSY); /* being filled */
	assert_int_equal(tier_release(ts.s, o, TIER_DDR, 0), -EINVAL);             /* clean after INIT */
	assert_int_equal(tier_acquire(ts.s, o, TIER_DDR, 0, &addr, NULL), -ENODATA); /* still no data */
	assert_int_equal(tier_store_check(ts.s), 0);
	assert_int_equal(tier_obj_destroy(ts.s, o), 0);
	/* A frozen object: dirty only right after its fill. */
	tier_object *f = mk(ts.s, OBJ, TIER_OBJ_FROZEN);
	fill(ts.s, f, TIER_HBM, 7);
	assert_int_equal(tier_acquire(ts.s, f, TIER_HBM, 0, &addr, NULL), 0);
	assert_int_equal(tier_release(ts.s, f, TIER_HBM, 1), -EPERM);
	assert_non_null(strstr(tier_last_error(), "frozen"));
	assert_int_equal(tier_obj_pins(ts.s, f, TIER_HBM), 1); /* nothing changed */
	assert_int_equal(tier_release(ts.s, f, TIER_HBM, 0), 0);
	expect(ts.s, f, TIER_DDR, 7);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* tier_fill_done: a fill ended with the pin kept. Others may pin the object and read its data;
 * it is never evicted while pinned (room is refused instead); the release may then be clean or
 * dirty; misuse (not pinned, not being filled, bad arguments) is refused with nothing changed. */
static void test_fill_done(void **state)
{
	test_store ts;
	void *addr, *again;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 8 * OBJ, 0, 0), 0);
	tier_object *o = mk(ts.s, OBJ, 0), *p = mk(ts.s, OBJ, 0), *q = mk(ts.s, OBJ, 0);
	assert_int_equal(tier_fill_done(ts.s, o, TIER_HBM), -EINVAL); /* not pinned */
	assert_non_null(strstr(tier_last_error(), "TIER_ACQ_INIT"));
	assert_int_equal(tier_fill_done(NULL, o, TIER_HBM), -EINVAL);
	assert_int_equal(tier_fill_done(ts.s, o, TIER_NTIERS), -EINVAL);
	assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), 0);
	tier_pattern_fill(addr, OBJ, 11, 0);
	assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, 0, &again, NULL), -EBUSY); /* being filled */
	assert_int_equal(tier_fill_done(ts.s, o, TIER_HBM), 0);
	assert_int_equal(tier_fill_done(ts.s, o, TIER_HBM), -EINVAL); /* no longer being filled */
	assert_int_equal(tier_obj_pins(ts.s, o, TIER_HBM), 1);
	assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, 0, &again, NULL), 0); /* a second pin, same copy */
	assert_ptr_equal(again, addr);
	assert_int_equal(tier_pattern_check(again, OBJ, 11, 0), OBJ);
	assert_int_equal(tier_release(ts.s, o, TIER_HBM, 0), 0);
	/* still pinned once: the other slot of HBM is all there is for p and q */
	fill(ts.s, p, TIER_HBM, 12);
	void *pa;
	assert_int_equal(tier_acquire(ts.s, p, TIER_HBM, 0, &pa, NULL), 0);
	assert_int_equal(tier_acquire(ts.s, q, TIER_HBM, TIER_ACQ_INIT, &again, NULL), -ENOSPC);
	assert_int_equal(tier_release(ts.s, p, TIER_HBM, 0), 0);
	assert_int_equal(tier_store_check(ts.s), 0);
	assert_int_equal(tier_release(ts.s, o, TIER_HBM, 0), 0); /* clean: the filled data stands */
	fill(ts.s, q, TIER_HBM, 13);
	fill(ts.s, p, TIER_HBM, 14); /* o goes down to DDR to make room, with its data */
	expect(ts.s, o, TIER_HBM, 11);
	expect(ts.s, q, TIER_DDR, 13);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* Everything pinned: -ENOSPC naming the pinned bytes and the budget; fine again after release. */
static void test_all_pinned(void **state)
{
	test_store ts;
	tier_object *o[4];
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LFU, 3 * OBJ, 8 * OBJ, 0, 0), 0);
	for (int i = 0; i < 4; i++)
		fill(ts.s, o[i] = mk(ts.s, OBJ, 0), TIER_DDR, 100 + i);
	for (int i = 0; i < 3; i++)
		assert_int_equal(tier_acquire(ts.s, o[i], TIER_HBM, 0, &addr, NULL), 0);
	assert_int_equal(tier_acquire(ts.s, o[3], TIER_HBM, 0, &addr, NULL), -ENOSPC);
	assert_non_null(strstr(tier_last_error(), "192.00 KiB pinned"));
	assert_non_null(strstr(tier_last_error(), "budget"));
	assert_int_equal(tier_obj_state(ts.s, o[3], TIER_HBM), TIER_COPY_ABSENT);
	assert_int_equal(tier_store_check(ts.s), 0);
	assert_int_equal(tier_release(ts.s, o[1], TIER_HBM, 0), 0);
	assert_int_equal(tier_acquire(ts.s, o[3], TIER_HBM, TIER_ACQ_NOEVICT, &addr, NULL), -ENOSPC);
	expect(ts.s, o[3], TIER_HBM, 103);
	assert_int_equal(tier_release(ts.s, o[0], TIER_HBM, 0), 0);
	assert_int_equal(tier_release(ts.s, o[2], TIER_HBM, 0), 0);
	for (int i = 0; i < 4; i++)
		expect(ts.s, o[i], TIER_HBM, 100 + i);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* Enough bytes free in HBM but in runs too short: the message names what splits them. Pinned
 * copies first; then copies that nothing pins but the full DDR below cannot take. */
static void test_fragmented(void **state)
{
	(void)state;
	for (int pinned = 1; pinned >= 0; pinned--) {
		test_store ts;
		tier_object *o[4], *big;
		void *addr;
		assert_int_equal(test_store_open(&ts, TIER_POLICY_LFU, 4 * OBJ, 2 * OBJ, 0, 0), 0);
		for (int i = 0; i < 4; i++)
			fill(ts.s, o[i] = mk(ts.s, OBJ, 0), TIER_HBM, 200 + i);
		/* HBM holds o0..o3 in a row; moving o1 and o3 down leaves two holes of one object each */
		assert_int_equal(tier_migrate(ts.s, o[1], TIER_DDR), 0);
		assert_int_equal(tier_migrate(ts.s, o[3], TIER_DDR), 0);
		if (pinned) /* pinned, o0 and o2 stay; unpinned, they could go down if DDR had room */
			for (int i = 0; i < 4; i += 2)
				assert_int_equal(tier_acquire(ts.s, o[i], TIER_HBM, 0, &addr, NULL), 0);
		big = mk(ts.s, 2 * OBJ, 0);
		assert_int_equal(tier_acquire(ts.s, big, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), -ENOSPC);
		const char *e = tier_last_error();
		assert_non_null(strstr(e, "largest free run is 64.00 KiB"));
		assert_non_null(strstr(e, pinned ? "split by pinned copies" : "the tiers below have no room"));
		assert_int_equal(tier_store_check(ts.s), 0);
		for (int i = 0; pinned && i < 4; i += 2)
			assert_int_equal(tier_release(ts.s, o[i], TIER_HBM, 0), 0);
		for (int i = 0; i < 4; i++) /* nothing lost */
			expect(ts.s, o[i], i % 2 ? TIER_DDR : TIER_HBM, 200 + i);
		test_store_close(&ts);
	}
}

/* An object whose only copy lives on NVMe. */
static tier_object *on_nvme(tier_store *s, uint64_t seed)
{
	tier_object *o = mk(s, OBJ + 100, 0);
	fill(s, o, TIER_HBM, seed);
	assert_int_equal(tier_migrate(s, o, TIER_NVME), 0);
	assert_int_equal(tier_obj_state(s, o, TIER_HBM), TIER_COPY_ABSENT);
	assert_int_equal(tier_obj_state(s, o, TIER_NVME), TIER_COPY_VALID);
	return o;
}

static void fetch_fails(tier_store *s, tier_object *o, tier_id t, int want, int with_fence)
{
	void *addr = NULL;
	tier_fence *f = NULL;
	if (!with_fence) {
		assert_int_equal(tier_acquire(s, o, t, 0, &addr, NULL), want);
		assert_non_null(strstr(tier_last_error(), "failed"));
	} else {
		assert_int_equal(tier_acquire(s, o, t, 0, &addr, &f), 0);
		assert_int_equal(tier_fence_wait(f), want);
		tier_fence_put(f);
		assert_int_equal(tier_release(s, o, t, 0), want);
	}
	assert_int_equal(tier_obj_pins(s, o, t), 0);
	assert_int_equal(tier_obj_state(s, o, t), TIER_COPY_ABSENT);
	assert_int_equal(tier_store_check(s), 0);
}

static void test_fetch_faults(void **state)
{
	test_store ts;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 4 * OBJ, 8 * OBJ, 32 * OBJ, 1), 0);
	tier_offload *off = tier_store_offload(ts.s);
	tier_object *o = on_nvme(ts.s, 200);
	for (int fence = 0; fence < 2; fence++) {
		for (int t = TIER_HBM; t <= TIER_DDR; t++) {
			tier_offload_set_faults(off, &(tier_offload_faults){ .fail_read_nth = 1, .error = -EIO });
			fetch_fails(ts.s, o, (tier_id)t, -EIO, fence);
			tier_offload_set_faults(off, &(tier_offload_faults){ .corrupt_read_nth = 1 });
			fetch_fails(ts.s, o, (tier_id)t, -EBADMSG, fence);
		}
	}
	tier_offload_set_faults(off, NULL);
	expect(ts.s, o, TIER_HBM, 200); /* the data was never lost */
	expect(ts.s, o, TIER_DDR, 200);
	/* A failed prefetch is dropped silently, and the demand fetch after it works. */
	assert_int_equal(tier_migrate(ts.s, o, TIER_NVME), 0);
	tier_offload_set_faults(off, &(tier_offload_faults){ .fail_read_nth = 1, .error = -EIO });
	assert_int_equal(tier_prefetch(ts.s, o, TIER_HBM), 0);
	expect(ts.s, o, TIER_HBM, 200);
	tier_offload_set_faults(off, NULL);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* A writeback that fails while demoting (the disk is full): the acquire that needed the room
 * fails with the error, the victim keeps its data, and the store goes on once the disk has room. */
static void test_writeback_fault(void **state)
{
	test_store ts;
	tier_object *h[2], *d[2], *n;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 2 * OBJ, 32 * OBJ, 0), 0);
	tier_offload *off = tier_store_offload(ts.s);
	for (int i = 0; i < 2; i++) /* DDR full of dirty data, then HBM full of dirty data */
		fill(ts.s, d[i] = mk(ts.s, OBJ, 0), TIER_DDR, 300 + i);
	for (int i = 0; i < 2; i++)
		fill(ts.s, h[i] = mk(ts.s, OBJ, 0), TIER_HBM, 310 + i);
	n = mk(ts.s, OBJ, 0);
	tier_offload_set_faults(off, &(tier_offload_faults){ .fail_write_nth = 1, .error = -ENOSPC });
	assert_int_equal(tier_acquire(ts.s, n, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), -ENOSPC);
	assert_int_equal(tier_obj_state(ts.s, n, TIER_HBM), TIER_COPY_ABSENT);
	assert_int_equal(tier_store_check(ts.s), 0);
	tier_offload_set_faults(off, NULL);
	for (int i = 0; i < 2; i++) {
		expect(ts.s, d[i], TIER_DDR, 300 + i);
		expect(ts.s, h[i], TIER_HBM, 310 + i);
	}
	fill(ts.s, n, TIER_HBM, 320); /* now the demotions go through */
	for (int i = 0; i < 2; i++) {
		expect(ts.s, d[i], TIER_HBM, 300 + i);
		expect(ts.s, h[i], TIER_HBM, 310 + i);
	}
	expect(ts.s, n, TIER_DDR, 320);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

/* Discardable objects dropped everywhere report -ENODATA; the caller recomputes with INIT. */
static void test_discardable(void **state)
{
	test_store ts;
	void *addr;
	(void)state;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 2 * OBJ, 2 * OBJ, 0, 0), 0);
	tier_object *c = mk(ts.s, OBJ, TIER_OBJ_DISCARDABLE), *a = mk(ts.s, OBJ, 0), *b = mk(ts.s, OBJ, 0);
	fill(ts.s, c, TIER_HBM, 400);
	fill(ts.s, a, TIER_HBM, 401);
	fill(ts.s, b, TIER_HBM, 402); /* c is the least recent: dropped, not written back */
	for (int t = 0; t < TIER_NTIERS; t++)
		assert_int_equal(tier_obj_state(ts.s, c, (tier_id)t), TIER_COPY_ABSENT);
	assert_int_equal(tier_acquire(ts.s, c, TIER_DDR, 0, &addr, NULL), -ENODATA);
	assert_non_null(strstr(tier_last_error(), "TIER_ACQ_INIT"));
	assert_int_equal(tier_migrate(ts.s, c, TIER_DDR), -ENODATA);
	fill(ts.s, c, TIER_DDR, 400); /* recomputed */
	expect(ts.s, c, TIER_HBM, 400);
	tier_stats st;
	tier_store_stats(ts.s, &st);
	assert_true(st.cls[TIER_HBM][TIER_CLASS_OPTIM].drops >= 1);
	assert_int_equal(st.tier[TIER_DDR].copies, 2);
	assert_int_equal(tier_store_check(ts.s), 0);
	test_store_close(&ts);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_bad_config),
		cmocka_unit_test(test_bad_objects),
		cmocka_unit_test(test_fill_done),
		cmocka_unit_test(test_all_pinned),
		cmocka_unit_test(test_fragmented),
		cmocka_unit_test(test_fetch_faults),
		cmocka_unit_test(test_writeback_fault),
		cmocka_unit_test(test_discardable),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
