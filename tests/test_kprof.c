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

/* The busy time and gaps against a brute force on a grid of 1 us cells: random spans (nested,
 * overlapping, touching, zero-length, out of order) over 30 ms, the whole run and a window. */
#define CELL 1000u
#define CELLS 30000u
static void brute(const kprof_span *v, size_t n, uint64_t from, kprof_idle *out)
{
	static unsigned char busy[CELLS];
	memset(busy, 0, sizeof busy);
	memset(out, 0, sizeof *out);
	int64_t first = -1, last = -1;
	for (size_t i = 0; i < n; i++) {
		if (v[i].start < from || v[i].end == v[i].start)
			continue;
		for (uint64_t c = v[i].start / CELL; c < v[i].end / CELL; c++)
			busy[c] = 1;
		first = first < 0 || (int64_t)(v[i].start / CELL) < first ? (int64_t)(v[i].start / CELL) : first;
		last = (int64_t)(v[i].end / CELL) > last ? (int64_t)(v[i].end / CELL) : last;
	}
	if (first < 0)
		return;
	out->span_ns = (uint64_t)(last - first) * CELL;
	for (int64_t c = first; c < last;) {
		if (busy[c]) {
			out->busy_ns += CELL, c++;
			continue;
		}
		int64_t e = c;
		while (e < last && !busy[e])
			e++;
		uint64_t ns = (uint64_t)(e - c) * CELL;
		int b = ns < 10000 ? 0 : ns < 100000 ? 1 : ns < 1000000 ? 2 : ns < 10000000 ? 3 : 4;
		out->gaps[b]++, out->gap_ns[b] += ns, c = e;
	}
}

static void test_idle(void **state)
{
	(void)state;
	uint64_t x = 88172645463325252ull; /* xorshift */
	for (int round = 0; round < 50; round++) {
		kprof_spans s = { 0 };
		size_t n = 1 + (size_t)round * 7;
		kprof_span *v = malloc(n * sizeof *v);
		assert_non_null(v);
		for (size_t i = 0; i < n; i++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			uint64_t a = x % (CELLS - 2000), len = (x >> 20) % (round & 1 ? 40 : 2000);
			v[i] = (kprof_span){ a * CELL, (a + len) * CELL };
			assert_int_equal(kprof_spans_add(&s, v[i].start, v[i].end), 0);
		}
		uint64_t from = round % 3 ? 0 : (uint64_t)(CELLS / 2) * CELL;
		kprof_idle got, want;
		kprof_idle_of(&s, from, UINT64_MAX, &got);
		brute(v, n, from, &want);
		assert_int_equal(got.span_ns, want.span_ns);
		assert_int_equal(got.busy_ns, want.busy_ns);
		for (int b = 0; b < KPROF_GAP_BINS; b++) {
			assert_int_equal(got.gaps[b], want.gaps[b]);
			assert_int_equal(got.gap_ns[b], want.gap_ns[b]);
		}
		assert_true(got.busy_ns <= got.span_ns);
		free(v);
		kprof_spans_free(&s);
	}
	/* no spans, and a printed line */
	kprof_spans s = { 0 };
	kprof_idle d;
	kprof_idle_of(&s, 0, UINT64_MAX, &d);
	assert_int_equal(d.span_ns, 0);
	assert_int_equal(d.busy_ns, 0);
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	kprof_idle_print(&d, f, "t");
	fclose(f);
	assert_non_null(strstr(buf, "span 0.000 ms"));
	free(buf);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_sums),
		cmocka_unit_test(test_growth),
		cmocka_unit_test(test_merge),
		cmocka_unit_test(test_print),
		cmocka_unit_test(test_idle),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
