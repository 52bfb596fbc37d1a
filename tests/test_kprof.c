/* test_kprof.c - the kernel profiler's per-name totals (tools/kprof_table.c): sums, growth past
 * the first table, merging rows, and the printed table's order, cuts and limits. The CUPTI side
 * (tools/kprof.c) needs a GPU and is exercised by the GPU session scripts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tools/kprof_table.h"

static const kprof_row *find(const kprof_table *t, const char *name)
{
	for (size_t i = 0; i < t->cap; i++)
		if (t->rows[i].name && !strcmp(t->rows[i].name, name))
			return &t->rows[i];
	return NULL;
}

/* The printed table as a string (caller frees). */
static char *printed(const kprof_table *t, size_t top, int width)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	assert_non_null(f);
	kprof_print(t, f, "test", top, width);
	fclose(f);
	return buf;
}

static int lines_of(const char *s)
{
	int n = 0;
	for (; *s; s++)
		n += *s == '\n';
	return n;
}

static void test_sums(void **state)
{
	(void)state;
	kprof_table t;
	kprof_init(&t);
	assert_int_equal(kprof_add(&t, "gemm", 300), 0);
	assert_int_equal(kprof_add(&t, "gemm", 500), 0);
	assert_int_equal(kprof_add(&t, "norm", 40), 0);
	assert_int_equal(kprof_add(&t, NULL, 7), 0);
	const kprof_row *g = find(&t, "gemm"), *q = find(&t, "?");
	assert_non_null(g);
	assert_int_equal(g->calls, 2);
	assert_int_equal(g->ns, 800);
	assert_int_equal(g->max_ns, 500);
	assert_non_null(q);
	assert_int_equal(q->ns, 7);
	assert_int_equal(t.n, 3);
	assert_int_equal(t.total_ns, 847);
	assert_int_equal(t.dropped, 0);
	kprof_free(&t);
	assert_null(t.rows);
}

/* 1000 names (the table doubles six times), each added i + 1 times: every sum survives. */
static void test_growth(void **state)
{
	(void)state;
	kprof_table t;
	kprof_init(&t);
	char name[32];
	uint64_t total = 0;
	for (int rep = 0; rep < 3; rep++)
		for (int i = 0; i < 1000; i++) {
			snprintf(name, sizeof name, "kernel_%d", i);
			for (int k = 0; k <= (i % 5); k++) {
				assert_int_equal(kprof_add(&t, name, (uint64_t)i), 0);
				total += (uint64_t)i;
			}
		}
	assert_int_equal(t.n, 1000);
	assert_true(t.n * 4 <= t.cap * 3);
	assert_int_equal(t.total_ns, total);
	for (int i = 0; i < 1000; i++) {
		snprintf(name, sizeof name, "kernel_%d", i);
		const kprof_row *r = find(&t, name);
		assert_non_null(r);
		assert_int_equal(r->calls, 3 * (uint64_t)(i % 5 + 1));
		assert_int_equal(r->ns, 3 * (uint64_t)(i % 5 + 1) * (uint64_t)i);
	}
	kprof_free(&t);
}

/* Rows of one table merged into another under new names (the demangling step). */
static void test_merge(void **state)
{
	(void)state;
	kprof_table t;
	kprof_init(&t);
	assert_int_equal(kprof_add_row(&t, "a", 3, 90, 50), 0);
	assert_int_equal(kprof_add_row(&t, "a", 2, 10, 6), 0);
	const kprof_row *r = find(&t, "a");
	assert_int_equal(r->calls, 5);
	assert_int_equal(r->ns, 100);
	assert_int_equal(r->max_ns, 50);
	kprof_free(&t);
}

/* Longest total first, ties by name; top rows only; long names cut to the width with "...". */
static void test_print(void **state)
{
	(void)state;
	kprof_table t;
	kprof_init(&t);
	char longname[300];
	memset(longname, 'x', sizeof longname - 1);
	longname[sizeof longname - 1] = 0;
	kprof_add(&t, "small", 1000);
	kprof_add(&t, "big", 3000000);
	kprof_add(&t, "tie_b", 2000);
	kprof_add(&t, "tie_a", 2000);
	kprof_add(&t, longname, 1500);
	char *s = printed(&t, 0, 40);
	assert_int_equal(lines_of(s), 2 + 5); /* title, header, rows */
	char *big = strstr(s, "  big\n"), *ta = strstr(s, "  tie_a\n"), *tb = strstr(s, "  tie_b\n"),
	     *lo = strstr(s, "xxx...\n"), *sm = strstr(s, "  small\n");
	assert_true(big && ta && tb && lo && sm);
	assert_true(big < ta && ta < tb && tb < lo && lo < sm);
	assert_null(strstr(s, longname)); /* cut */
	assert_non_null(strstr(s, "3.000")); /* big's total in ms */
	free(s);
	s = printed(&t, 2, 40);
	assert_int_equal(lines_of(s), 2 + 2);
	assert_null(strstr(s, "small"));
	free(s);
	kprof_free(&t);
	kprof_init(&t); /* an empty table prints its header */
	s = printed(&t, 0, 40);
	assert_int_equal(lines_of(s), 2);
	free(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_sums),
		cmocka_unit_test(test_growth),
		cmocka_unit_test(test_merge),
		cmocka_unit_test(test_print),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
