/* test_base.c - sizes, error messages, the byte pattern, random numbers, the CPU device context and
 * its marks. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>
#include "tier/tier.h"

static void test_parse_size_units(void **state)
{
	static const struct { const char *text; uint64_t want; } ok[] = {
		{ "0", 0 }, { "4096", 4096 }, { "1k", 1024 }, { "64K", 65536 }, { "512M", 512ull << 20 },
		{ "24G", 24ull << 30 }, { "2GiB", 2ull << 30 }, { "1.5T", 3ull << 39 }, { "1b", 1 },
		{ "3MB", 3ull << 20 }, { "1P", 1ull << 50 },
	};
	(void)state;
	for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
		uint64_t v = 12345;
		assert_int_equal(tier_parse_size(ok[i].text, &v), 0);
		assert_true(v == ok[i].want);
	}
}

static void test_parse_size_bad(void **state)
{
	static const char *bad[] = { "", "G", "-1G", "+3", " 4", "12Q", "1.3", "0x", "1e30G", "24 G", "nanG", "infG" };
	(void)state;
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		uint64_t v = 777;
		int rc = tier_parse_size(bad[i], &v);
		assert_true(rc == -EINVAL || rc == -ERANGE);
		assert_true(v == 777);                      /* unchanged on failure */
		assert_non_null(strstr(tier_last_error(), "size"));
	}
	assert_int_equal(tier_parse_size(NULL, &(uint64_t){ 0 }), -EINVAL);
}

static void test_format_size(void **state)
{
	char buf[32];
	(void)state;
	assert_string_equal(tier_format_size(512, buf, sizeof buf), "512 B");
	assert_string_equal(tier_format_size(3ull << 29, buf, sizeof buf), "1.50 GiB");
}

static void test_error_message_is_per_thread(void **state)
{
	(void)state;
	tier_clear_error();
	assert_string_equal(tier_last_error(), "");
	assert_int_equal(tier_fail(-ENOSPC, "disk %s full", "x"), -ENOSPC);
	assert_string_equal(tier_last_error(), "disk x full");
	assert_string_equal(tier_strerror(-ENOSPC), "ENOSPC");
	/* a caller may extend the last message with itself (the buffers must not overlap inside) */
	tier_fail(-EINVAL, "%s; use --device cpu", tier_last_error());
	assert_string_equal(tier_last_error(), "disk x full; use --device cpu");
	tier_fail(-EINVAL, "context: %s", tier_last_error());
	assert_string_equal(tier_last_error(), "context: disk x full; use --device cpu");
}

static void test_pattern_windows_agree(void **state)
{
	tier_rng r;
	unsigned char whole[1000], part[1000];
	(void)state;
	tier_rng_seed(&r, 42);
	tier_pattern_fill(whole, sizeof whole, 99, 0);
	for (int t = 0; t < 200; t++) {
		size_t off = tier_rng_below(&r, 999), len = 1 + tier_rng_below(&r, 1000 - off);
		memset(part, 0xAA, sizeof part);
		tier_pattern_fill(part, len, 99, off);
		assert_memory_equal(part, whole + off, len);
		assert_int_equal(tier_pattern_check(part, len, 99, off), len);
	}
	whole[517] ^= 1;
	assert_int_equal(tier_pattern_check(whole, sizeof whole, 99, 0), 517);
	assert_int_equal(tier_pattern_check(whole, 100, 98, 0) < 100, 1); /* another seed differs */
}

static void test_rng_moments(void **state)
{
	tier_rng r;
	double s = 0, s2 = 0, u = 0;
	const int n = 200000;
	(void)state;
	tier_rng_seed(&r, 7);
	for (int i = 0; i < n; i++) {
		double x = tier_rng_normal(&r);
		s += x;
		s2 += x * x;
		u += tier_rng_uniform(&r);
		assert_true(tier_rng_below(&r, 13) < 13);
	}
	assert_true(s / n > -0.02 && s / n < 0.02);
	assert_true(s2 / n > 0.97 && s2 / n < 1.03);
	assert_true(u / n > 0.49 && u / n < 0.51);
}

static void test_cpu_device(void **state)
{
	tier_dev *d;
	void *p;
	(void)state;
	assert_int_equal(tier_dev_open(&d, TIER_DEV_CPU, 0), 0);
	assert_int_equal(tier_dev_kind_of(d), TIER_DEV_CPU);
	assert_null(tier_dev_stream(d));
	assert_int_equal(tier_dev_malloc(d, 0, &p), -EINVAL);
	assert_int_equal(tier_dev_malloc(d, 4096, &p), 0);
	tier_dev_free(d, p);
	assert_int_equal(tier_dev_sync(d), 0);
	tier_dev_close(d);
	assert_int_equal(tier_dev_open(&d, (tier_dev_kind)7, 0), -EINVAL);
	assert_null(d);
	if (!tier_cuda_available()) {
		assert_int_equal(tier_dev_open(&d, TIER_DEV_CUDA, 0), -ENODEV);
		assert_null(d);
	}
}

static void sleep_ms(int ms)
{
	struct timespec ts = { 0, ms * 1000000L };
	while (nanosleep(&ts, &ts))
		;
}

/* Waypoints on a CPU context: the work is done when queued, so a put is passed at once; pending
 * says whether a put awaits its wait; a wait without a put returns at once; bad arguments. */
/* Copy lanes on a CPU context: the copy is made at once, joins do nothing; bad lanes and NULL
 * pointers are refused. */
static void test_cpu_copy_lanes(void **state)
{
	(void)state;
	tier_dev *d;
	char src[100], dst[100];
	assert_int_equal(tier_dev_open(&d, TIER_DEV_CPU, 0), 0);
	memset(src, 7, sizeof src), memset(dst, 0, sizeof dst);
	assert_int_equal(tier_dev_copy_async(d, dst, src, sizeof src, 1), 0);
	assert_memory_equal(dst, src, sizeof src);
	assert_int_equal(tier_dev_copy_join(d, 0), 0);
	assert_int_equal(tier_dev_copy_join(d, 1), 0);
	assert_int_equal(tier_dev_copy_async(d, dst, src, sizeof src, TIER_DEV_COPY_LANES), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "lane"));
	assert_int_equal(tier_dev_copy_async(d, dst, NULL, sizeof src, 0), -EINVAL);
	assert_int_equal(tier_dev_copy_join(d, -1), -EINVAL);
	/* uploads: at once on the CPU; src may change right after */
	memset(dst, 0, sizeof dst);
	assert_int_equal(tier_dev_put_async(d, dst, src, sizeof src), 0);
	memset(src, 9, sizeof src);
	for (size_t i = 0; i < sizeof dst; i++)
		assert_int_equal(dst[i], 7);
	assert_int_equal(tier_dev_put_async(d, dst, src, 0), 0);
	assert_int_equal(tier_dev_put_async(d, NULL, src, 1), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "tier_dev_put_async"));
	assert_int_equal(tier_dev_put_async(d, dst, NULL, 1), -EINVAL);
	tier_dev_close(d);
}

static void test_cpu_waypoint(void **state)
{
	(void)state;
	tier_dev *d;
	tier_waypoint *w;
	assert_int_equal(tier_dev_open(&d, TIER_DEV_CPU, 0), 0);
	assert_int_equal(tier_waypoint_open(&w, NULL), -EINVAL);
	assert_null(w);
	assert_int_equal(tier_waypoint_open(&w, d), 0);
	assert_int_equal(tier_waypoint_pending(w), 0);
	assert_int_equal(tier_waypoint_wait(w), 0);
	assert_int_equal(tier_waypoint_put(w), 0);
	assert_int_equal(tier_waypoint_pending(w), 1);
	assert_int_equal(tier_waypoint_put(w), 0); /* put again before the wait: still one pending */
	assert_int_equal(tier_waypoint_wait(w), 0);
	assert_int_equal(tier_waypoint_pending(w), 0);
	tier_waypoint_close(w);
	tier_waypoint_close(NULL);
	tier_dev_close(d);
}

/* Marks on a CPU context are the host clock: the time between two marks goes to the later one's
 * tag (the origin's -1 and a tag out of range to none); past the first 256 marks the arrays grow;
 * begin starts over. */
static void test_cpu_marks(void **state)
{
	(void)state;
	tier_dev *d;
	tier_marks *m;
	assert_int_equal(tier_dev_open(&d, TIER_DEV_CPU, 0), 0);
	assert_int_equal(tier_marks_open(&m, NULL), -EINVAL);
	assert_int_equal(tier_marks_open(&m, d), 0);
	uint64_t ns[2] = { 0, 0 }, t0 = tier_now_ns();
	tier_marks_begin(m);
	assert_int_equal(tier_marks_put(m, -1), 0);
	sleep_ms(3);
	assert_int_equal(tier_marks_put(m, 0), 0);
	sleep_ms(6);
	assert_int_equal(tier_marks_put(m, 1), 0);
	sleep_ms(3);
	assert_int_equal(tier_marks_put(m, 7), 0); /* out of range: not charged */
	for (int i = 0; i < 600; i++)
		assert_int_equal(tier_marks_put(m, i & 1), 0);
	assert_int_equal(tier_marks_count(m), 604);
	assert_int_equal(tier_marks_collect(m, ns, 2), 0);
	uint64_t wall = tier_now_ns() - t0;
	printf("# marks: %.3f ms to tag 0, %.3f ms to tag 1, %.3f ms wall\n", ns[0] / 1e6, ns[1] / 1e6, wall / 1e6);
	assert_true(ns[0] >= 3000000 && ns[1] >= 6000000 && ns[0] + ns[1] + 3000000 <= wall);
	tier_marks_begin(m);
	memset(ns, 0, sizeof ns);
	assert_int_equal(tier_marks_count(m), 0);
	assert_int_equal(tier_marks_collect(m, ns, 2), 0);
	assert_true(ns[0] == 0 && ns[1] == 0);
	tier_marks_close(m);
	tier_marks_close(NULL);
	tier_dev_close(d);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_parse_size_units), cmocka_unit_test(test_parse_size_bad),
		cmocka_unit_test(test_format_size), cmocka_unit_test(test_error_message_is_per_thread),
		cmocka_unit_test(test_pattern_windows_agree), cmocka_unit_test(test_rng_moments),
		cmocka_unit_test(test_cpu_device), cmocka_unit_test(test_cpu_marks), cmocka_unit_test(test_cpu_waypoint),
		cmocka_unit_test(test_cpu_copy_lanes),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
