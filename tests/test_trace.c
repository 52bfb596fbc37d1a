/* test_trace.c - store access traces: a store's accesses written and read back record by record
 * against what the test did, truncated, corrupt, foreign and other-version files give clear
 * errors, random bytes never crash the reader, and open/close misuse. */
#include <errno.h>
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
#include "test_seed.h"

static uint64_t seed;
static char dir[256];

static void path_of(char *buf, size_t len, const char *name) { snprintf(buf, len, "%s/%s", dir, name); }

/* What the test expects to read back, built while it drives the store. */
typedef struct {
	tier_trace_rec r[4096];
	size_t n;
} expect_log;

static void want(expect_log *e, int kind, const tier_object *o, int tier, int hit, uint32_t op, uint32_t step)
{
	assert_true(e->n < 4096);
	e->r[e->n++] = (tier_trace_rec){ .object = o ? tier_obj_id(o) : 0, .size = o ? tier_obj_size(o) : 0, .op = op,
					  .step = step, .kind = (uint8_t)kind, .tier = (uint8_t)tier,
					  .cls = o ? (uint8_t)tier_obj_class(o) : 0, .hit = (uint8_t)hit };
}

static void write_file(const char *path, const void *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	assert_non_null(f);
	assert_int_equal(fwrite(p, 1, n, f), n);
	fclose(f);
}

static size_t read_file(const char *path, unsigned char *buf, size_t cap)
{
	FILE *f = fopen(path, "rb");
	assert_non_null(f);
	size_t n = fread(buf, 1, cap, f);
	fclose(f);
	return n;
}

/* Random accesses on a store whose HBM holds 3 of 8 objects; the hit flags are what the stats say. */
static void test_round_trip(void **state)
{
	(void)state;
	tier_rng rng;
	tier_rng_seed(&rng, seed);
	test_store ts;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 3 * 4096 + 100, 1 << 20, 0, 0), 0);
	char path[512];
	path_of(path, sizeof path, "rt.trc");
	static expect_log e;
	e.n = 0;
	assert_int_equal(tier_store_trace_open(ts.s, path), 0);
	assert_int_equal(tier_store_trace_open(ts.s, path), -EBUSY);
	tier_object *o[8];
	uint32_t op = 0, step = 0;
	for (int i = 0; i < 8; i++) {
		assert_int_equal(tier_obj_create(ts.s, 4096 - (uint64_t)i * 8, (tier_class)(i % TIER_NCLASSES), 0, &o[i]), 0);
		want(&e, TIER_TRC_CREATE, o[i], 0, 0, op, step);
		void *p;
		assert_int_equal(tier_acquire(ts.s, o[i], TIER_DDR, TIER_ACQ_INIT, &p, NULL), 0);
		want(&e, TIER_TRC_ACQUIRE, o[i], 1, 0, op, step);
		memset(p, i, tier_obj_size(o[i]));
		assert_int_equal(tier_release(ts.s, o[i], TIER_DDR, 1), 0);
		want(&e, TIER_TRC_RELEASE, o[i], 1, 1, op, step);
	}
	for (int k = 0; k < 500; k++) {
		int i = (int)(tier_rng_next(&rng) % 8), r = (int)(tier_rng_next(&rng) % 10);
		if (r == 0) {
			tier_store_step(ts.s);
			want(&e, TIER_TRC_STEP, NULL, 0, 0, op, ++step);
		} else if (r == 1) {
			op = (uint32_t)(tier_rng_next(&rng) % 1000);
			tier_store_at_op(ts.s, op);
			want(&e, TIER_TRC_AT_OP, NULL, 0, 0, op, step);
		} else {
			tier_stats a, b;
			tier_store_stats(ts.s, &a);
			void *p;
			assert_int_equal(tier_acquire(ts.s, o[i], TIER_HBM, 0, &p, NULL), 0);
			tier_store_stats(ts.s, &b);
			int hit = b.cls[TIER_HBM][tier_obj_class(o[i])].hits != a.cls[TIER_HBM][tier_obj_class(o[i])].hits;
			want(&e, TIER_TRC_ACQUIRE, o[i], 0, hit, op, step);
			assert_int_equal(tier_release(ts.s, o[i], TIER_HBM, r == 2), 0);
			want(&e, TIER_TRC_RELEASE, o[i], 0, r == 2, op, step);
		}
	}
	assert_int_equal(tier_obj_discard(ts.s, o[6]), 0); /* dropped, then filled again */
	want(&e, TIER_TRC_DISCARD, o[6], 0, 0, op, step);
	void *p6;
	assert_int_equal(tier_acquire(ts.s, o[6], TIER_HBM, TIER_ACQ_INIT, &p6, NULL), 0);
	want(&e, TIER_TRC_ACQUIRE, o[6], 0, 0, op, step);
	memset(p6, 6, tier_obj_size(o[6]));
	assert_int_equal(tier_release(ts.s, o[6], TIER_HBM, 1), 0);
	want(&e, TIER_TRC_RELEASE, o[6], 0, 1, op, step);
	assert_int_equal(tier_obj_destroy(ts.s, o[5]), 0);
	want(&e, TIER_TRC_DESTROY, o[5] = NULL, 0, 0, op, step);
	assert_int_equal(tier_store_trace_close(ts.s), 0);
	assert_int_equal(tier_store_trace_close(ts.s), -ENOENT);
	test_store_close(&ts);

	tier_trace_reader *rd;
	assert_int_equal(tier_trace_open_read(&rd, path), 0);
	tier_trace_rec r;
	size_t n = 0;
	int rc;
	memset(&r, 0xa5, sizeof r); /* poisoned: the reader must fill every field */
	while ((rc = tier_trace_next(rd, &r)) == 1) {
		assert_true(n < e.n);
		const tier_trace_rec *w = &e.r[n];
		if (w->kind == TIER_TRC_DESTROY) { /* the object is gone: its id and size were checked at create */
			assert_int_equal(r.kind, TIER_TRC_DESTROY);
		} else {
			assert_int_equal(r.object, w->object);
			assert_int_equal(r.size, w->size);
			assert_int_equal(r.cls, w->cls);
			assert_int_equal(r.kind, w->kind);
			assert_int_equal(r.tier, w->tier);
			assert_int_equal(r.hit, w->hit);
		}
		assert_int_equal(r.op, w->op);
		assert_int_equal(r.step, w->step);
		n++;
		memset(&r, 0xa5, sizeof r);
	}
	assert_int_equal(rc, 0);
	assert_int_equal(n, e.n);
	tier_trace_close_read(rd);
	unlink(path);
}

/* A valid trace of k records, made by a store. Returns its length. */
static size_t make_trace(const char *path, int accesses)
{
	test_store ts;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LFU, 1 << 16, 1 << 20, 0, 0), 0);
	assert_int_equal(tier_store_trace_open(ts.s, path), 0);
	tier_object *o;
	assert_int_equal(tier_obj_create(ts.s, 1000, TIER_CLASS_LORA, 0, &o), 0);
	void *p;
	for (int i = 0; i < accesses; i++) {
		assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, i ? 0 : TIER_ACQ_INIT, &p, NULL), 0);
		assert_int_equal(tier_release(ts.s, o, TIER_HBM, 1), 0);
	}
	assert_int_equal(tier_store_trace_close(ts.s), 0);
	test_store_close(&ts);
	unsigned char buf[1 << 16];
	return read_file(path, buf, sizeof buf);
}

static int read_all(const char *path)
{
	tier_trace_reader *rd;
	int rc = tier_trace_open_read(&rd, path);
	if (rc)
		return rc;
	tier_trace_rec r;
	while ((rc = tier_trace_next(rd, &r)) == 1)
		;
	tier_trace_close_read(rd);
	return rc;
}

static void test_bad_files(void **state)
{
	(void)state;
	char path[512], bad[512];
	path_of(path, sizeof path, "good.trc");
	path_of(bad, sizeof bad, "bad.trc");
	size_t n = make_trace(path, 5);
	assert_int_equal(n, 32 + 11 * 32); /* header, create, 5 x (acquire, release) */
	unsigned char buf[1024], mod[1024];
	assert_int_equal(read_file(path, buf, sizeof buf), n);
	assert_int_equal(read_all(path), 0);

	char missing[512];
	path_of(missing, sizeof missing, "missing.trc");
	assert_int_equal(read_all(missing), -ENOENT);

	struct {
		size_t len;
		int off, val;
		const char *msg;
	} cases[] = {
		{ 0, -1, 0, "not a tier trace" },           /* empty file */
		{ 20, -1, 0, "truncated header" },          /* cut in the header */
		{ 32 + 40, -1, 0, "truncated record at offset 64" },
		{ n, 0, 'X', "not a tier trace" },          /* magic */
		{ n, 8, 3, "trace version 3" },             /* other version */
		{ n, 8, 0, "trace version 0" },
		{ n, 12, 40, "record size 40" },
		{ n, 16, 1, "unknown flags" },
		{ n, 32 + 24, 99, "kind 99" },              /* first record's kind */
		{ n, 64 + 25, 7, "offset 64 is corrupt" },  /* second record's tier */
	};
	for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
		memcpy(mod, buf, n);
		if (cases[k].off >= 0)
			mod[cases[k].off] = (unsigned char)cases[k].val;
		write_file(bad, mod, cases[k].len);
		assert_int_equal(read_all(bad), -EBADMSG);
		const char *m = tier_last_error();
		if (!strstr(m, cases[k].msg) || !strstr(m, bad)) {
			print_error("case %zu: message '%s' lacks '%s' or the file name\n", k, m, cases[k].msg);
			fail();
		}
	}
	/* version 1 (no discard record) is read; a discard record in it is refused */
	memcpy(mod, buf, n);
	mod[8] = 1;
	write_file(bad, mod, n);
	assert_int_equal(read_all(bad), 0);
	mod[32 + 24] = TIER_TRC_DISCARD;
	write_file(bad, mod, n);
	assert_int_equal(read_all(bad), -EBADMSG);
	assert_non_null(strstr(tier_last_error(), "kind 8 (1..7 exist in version 1)"));
	unlink(bad);
	unlink(path);
}

/* Random bytes (with a valid header half the time) never crash the reader: 1, 0 or -EBADMSG. */
static void test_random_bytes(void **state)
{
	(void)state;
	tier_rng rng;
	tier_rng_seed(&rng, seed + 1);
	char path[512];
	path_of(path, sizeof path, "fuzz.trc");
	unsigned char b[32 * 40];
	for (int it = 0; it < 300; it++) {
		size_t len = tier_rng_next(&rng) % sizeof b;
		for (size_t i = 0; i < len; i++)
			b[i] = (unsigned char)tier_rng_next(&rng);
		if (it & 1 && len >= 32) {
			memset(b, 0, 32);
			memcpy(b, "TIERTRC1\1\0\0\0\x20\0\0\0", 16);
			for (size_t i = 32; i + 32 <= len; i += 32) { /* plausible fields, random ids */
				b[i + 24] = (unsigned char)(1 + tier_rng_next(&rng) % 8);
				b[i + 25] = (unsigned char)(tier_rng_next(&rng) % 4);
				b[i + 26] = (unsigned char)(tier_rng_next(&rng) % 7);
				b[i + 27] = (unsigned char)(tier_rng_next(&rng) % 3);
				memset(b + i + 28, 0, 4);
			}
		}
		write_file(path, b, len);
		int rc = read_all(path);
		assert_true(rc == 0 || rc == -EBADMSG);
	}
	unlink(path);
}

/* A write error (the disk is full) stops recording without breaking the store; close reports it. */
static void test_write_error(void **state)
{
	(void)state;
	if (access("/dev/full", W_OK))
		skip();
	test_store ts;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 1 << 16, 1 << 20, 0, 0), 0);
	assert_int_equal(tier_store_trace_open(ts.s, "/dev/full"), 0);
	tier_object *o;
	assert_int_equal(tier_obj_create(ts.s, 1000, TIER_CLASS_LORA, 0, &o), 0);
	void *p;
	for (int i = 0; i < 200000; i++) { /* more than the buffer holds: a flush fails on the way */
		assert_int_equal(tier_acquire(ts.s, o, TIER_HBM, i ? 0 : TIER_ACQ_INIT, &p, NULL), 0);
		assert_int_equal(tier_release(ts.s, o, TIER_HBM, i == 0), 0);
	}
	assert_int_equal(tier_store_check(ts.s), 0);
	assert_int_equal(tier_store_trace_close(ts.s), -ENOSPC);
	assert_non_null(strstr(tier_last_error(), "/dev/full"));
	test_store_close(&ts);
}

static void test_bad_args(void **state)
{
	(void)state;
	test_store ts;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 1 << 16, 1 << 20, 0, 0), 0);
	assert_int_equal(tier_store_trace_open(ts.s, NULL), -EINVAL);
	assert_int_equal(tier_store_trace_open(ts.s, ""), -EINVAL);
	char path[512];
	path_of(path, sizeof path, "no/such/dir/x.trc");
	assert_int_equal(tier_store_trace_open(ts.s, path), -ENOENT);
	assert_non_null(strstr(tier_last_error(), path));
	assert_int_equal(tier_store_trace_close(ts.s), -ENOENT);
	/* destroy closes an open trace */
	path_of(path, sizeof path, "open-at-destroy.trc");
	assert_int_equal(tier_store_trace_open(ts.s, path), 0);
	test_store_close(&ts);
	assert_int_equal(read_all(path), 0);
	unlink(path);
	tier_trace_reader *rd = (tier_trace_reader *)1;
	assert_int_equal(tier_trace_open_read(&rd, NULL), -EINVAL);
	assert_int_equal(tier_trace_next(NULL, NULL), -EINVAL);
	tier_trace_close_read(NULL);
}

int main(void)
{
	seed = test_seed("test_trace", 0);
	if (test_tmpdir(dir, sizeof dir))
		return 99;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip), cmocka_unit_test(test_bad_files), cmocka_unit_test(test_random_bytes),
		cmocka_unit_test(test_write_error), cmocka_unit_test(test_bad_args),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	rmdir(dir);
	return rc;
}
