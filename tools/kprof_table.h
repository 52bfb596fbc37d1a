/* kprof_table.h - the per-name totals of tools/kprof.c, the CUDA kernel profiler: activity records
 * (a name and a device duration) summed by name, then printed as a table, longest total first.
 * Host code only; no CUDA. The profiler's glue feeds it from CUPTI, the tests feed it directly. */
#ifndef TIER_KPROF_TABLE_H
#define TIER_KPROF_TABLE_H

#include <stdint.h>
#include <stdio.h>

typedef struct {
	char *name;      /* owned */
	uint64_t calls;
	uint64_t ns;     /* summed device time */
	uint64_t max_ns;
} kprof_row;

/* Open addressing on the name; grows by doubling. */
typedef struct {
	kprof_row *rows;
	size_t cap, n;
	uint64_t total_ns; /* all records, dropped ones included */
	uint64_t dropped;  /* records that could not be kept (no memory) */
} kprof_table;

void kprof_init(kprof_table *t);
void kprof_free(kprof_table *t);

/* One record of name (copied; NULL reads as "?") lasting ns. 0, or -ENOMEM (the record is then
 * counted in dropped and total_ns only). */
int kprof_add(kprof_table *t, const char *name, uint64_t ns);

/* calls records of name at once, ns in all, the longest max_ns (a row of another table, merged
 * under another name). The same returns. */
int kprof_add_row(kprof_table *t, const char *name, uint64_t calls, uint64_t ns, uint64_t max_ns);

/* The table to f: a header line with the totals, then up to top rows (0: all) by total time,
 * ties by name: share of the total, total ms, calls, mean and max us, and the name cut to width
 * characters (at least 16; a longer name ends in "..."). */
void kprof_print(const kprof_table *t, FILE *f, const char *title, size_t top, int width);

/* The device's busy and idle time: the spans of every kernel, copy and memset, on any stream. */
typedef struct {
	uint64_t start, end; /* ns, CUPTI's clock */
} kprof_span;

typedef struct {
	kprof_span *v;
	size_t n, cap;
	uint64_t dropped; /* spans that could not be kept (no memory) */
} kprof_spans;

/* One span (end < start reads as start). 0, or -ENOMEM (counted in dropped). */
int kprof_spans_add(kprof_spans *s, uint64_t start, uint64_t end);
void kprof_spans_free(kprof_spans *s);

/* Gaps binned by length: < 10 us, < 100 us, < 1 ms, < 10 ms, longer. */
#define KPROF_GAP_BINS 5
typedef struct {
	uint64_t span_ns;		 /* first start to last end */
	uint64_t busy_ns;		 /* the union of the spans (overlaps counted once) */
	uint64_t gaps[KPROF_GAP_BINS];	 /* idle stretches between spans, by length */
	uint64_t gap_ns[KPROF_GAP_BINS]; /* their summed length */
} kprof_idle;

/* The busy time and gaps of the spans that start in [from, to), empty ones left out (sorts s by
 * start). */
void kprof_idle_of(kprof_spans *s, uint64_t from, uint64_t to, kprof_idle *out);

/* One line of totals and one of gaps to f, under title. */
void kprof_idle_print(const kprof_idle *d, FILE *f, const char *title);

#endif
