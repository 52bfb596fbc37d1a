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

#endif
