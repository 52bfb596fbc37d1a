/* kprof_table.c - per-name totals of device activity (kprof_table.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include "tools/kprof_table.h"

void kprof_init(kprof_table *t) { memset(t, 0, sizeof *t); }

void kprof_free(kprof_table *t)
{
	for (size_t i = 0; i < t->cap; i++)
		free(t->rows[i].name);
	free(t->rows);
	memset(t, 0, sizeof *t);
}

static uint64_t hash_of(const char *s) /* FNV-1a */
{
	uint64_t h = 1469598103934665603ull;
	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	return h;
}

/* The slot of name in rows [cap] (cap a power of two): its row, or the empty slot where it goes. */
static kprof_row *slot_of(kprof_row *rows, size_t cap, const char *name)
{
	size_t i = (size_t)hash_of(name) & (cap - 1);
	while (rows[i].name && strcmp(rows[i].name, name))
		i = (i + 1) & (cap - 1);
	return &rows[i];
}

/* Doubles the table (16 slots at first); -ENOMEM leaves it as it was. */
static int grow(kprof_table *t)
{
	size_t cap = t->cap ? 2 * t->cap : 16;
	kprof_row *rows = calloc(cap, sizeof *rows);
	if (!rows)
		return -ENOMEM;
	for (size_t i = 0; i < t->cap; i++)
		if (t->rows[i].name)
			*slot_of(rows, cap, t->rows[i].name) = t->rows[i];
	free(t->rows);
	t->rows = rows, t->cap = cap;
	return 0;
}

int kprof_add_row(kprof_table *t, const char *name, uint64_t calls, uint64_t ns, uint64_t max_ns)
{
	if (!name)
		name = "?";
	t->total_ns += ns;
	kprof_row *r = t->cap ? slot_of(t->rows, t->cap, name) : NULL;
	if (!r || !r->name) { /* a new name: the table stays at most 3/4 full */
		char *copy = strdup(name);
		if (!copy || ((t->n + 1) * 4 > t->cap * 3 && grow(t))) {
			free(copy);
			t->dropped += calls;
			return -ENOMEM;
		}
		r = slot_of(t->rows, t->cap, name);
		r->name = copy;
		t->n++;
	}
	r->calls += calls;
	r->ns += ns;
	if (max_ns > r->max_ns)
		r->max_ns = max_ns;
	return 0;
}

int kprof_add(kprof_table *t, const char *name, uint64_t ns) { return kprof_add_row(t, name, 1, ns, ns); }

static int by_time(const void *a, const void *b)
{
	const kprof_row *x = *(const kprof_row *const *)a, *y = *(const kprof_row *const *)b;
	if (x->ns != y->ns)
		return x->ns > y->ns ? -1 : 1;
	return strcmp(x->name, y->name);
}

void kprof_print(const kprof_table *t, FILE *f, const char *title, size_t top, int width)
{
	const kprof_row **v = t->n ? malloc(t->n * sizeof *v) : NULL;
	size_t n = 0;
	if (width < 16)
		width = 16;
	fprintf(f, "# %s: %.3f ms in %zu names%s", title, (double)t->total_ns / 1e6, t->n,
		t->dropped ? "" : "\n");
	if (t->dropped)
		fprintf(f, " (%llu records not kept: no memory)\n", (unsigned long long)t->dropped);
	if (t->n && !v) {
		fprintf(f, "# (no memory to sort the table)\n");
		return;
	}
	for (size_t i = 0; i < t->cap; i++)
		if (t->rows[i].name)
			v[n++] = &t->rows[i];
	if (n) /* qsort's array may not be NULL, even empty */
		qsort(v, n, sizeof *v, by_time);
	if (top && top < n)
		n = top;
	fprintf(f, "%6s %10s %8s %10s %10s  %s\n", "share", "total ms", "calls", "mean us", "max us", "name");
	for (size_t i = 0; i < n; i++) {
		const kprof_row *r = v[i];
		int len = (int)strlen(r->name), cut = len > width;
		fprintf(f, "%5.1f%% %10.3f %8llu %10.2f %10.2f  %.*s%s\n",
			t->total_ns ? 100.0 * (double)r->ns / (double)t->total_ns : 0.0, (double)r->ns / 1e6,
			(unsigned long long)r->calls, (double)r->ns / 1e3 / (double)r->calls, (double)r->max_ns / 1e3,
			cut ? width - 3 : len, r->name, cut ? "..." : "");
	}
	free(v);
}

int kprof_spans_add(kprof_spans *s, uint64_t start, uint64_t end)
{
	if (s->n == s->cap) {
		size_t cap = s->cap ? 2 * s->cap : 4096;
		kprof_span *v = realloc(s->v, cap * sizeof *v);
		if (!v) {
			s->dropped++;
			return -ENOMEM;
		}
		s->v = v, s->cap = cap;
	}
	s->v[s->n++] = (kprof_span){ start, end < start ? start : end };
	return 0;
}

void kprof_spans_free(kprof_spans *s)
{
	free(s->v);
	memset(s, 0, sizeof *s);
}

static int by_start(const void *a, const void *b)
{
	const kprof_span *x = a, *y = b;
	return (x->start > y->start) - (x->start < y->start);
}

static int gap_bin(uint64_t ns)
{
	int b = 0;
	for (uint64_t lim = 10000; b < KPROF_GAP_BINS - 1 && ns >= lim; lim *= 10)
		b++;
	return b;
}

void kprof_idle_of(kprof_spans *s, uint64_t from, uint64_t to, kprof_idle *out)
{
	memset(out, 0, sizeof *out);
	if (s->n) /* qsort wants an array even for none */
		qsort(s->v, s->n, sizeof *s->v, by_start);
	uint64_t first = 0, cur_end = 0; /* the union so far ends at cur_end */
	int any = 0;
	for (size_t i = 0; i < s->n; i++) {
		const kprof_span *p = &s->v[i];
		if (p->start < from || p->start >= to || p->end == p->start) /* an empty span is no activity */
			continue;
		if (!any) {
			first = p->start, cur_end = p->end, any = 1;
			out->busy_ns = p->end - p->start;
			continue;
		}
		if (p->start > cur_end) { /* a gap, then a new busy stretch */
			int b = gap_bin(p->start - cur_end);
			out->gaps[b]++, out->gap_ns[b] += p->start - cur_end;
			out->busy_ns += p->end - p->start;
			cur_end = p->end;
		} else if (p->end > cur_end) { /* overlaps the stretch and goes past it */
			out->busy_ns += p->end - cur_end;
			cur_end = p->end;
		}
	}
	out->span_ns = any ? cur_end - first : 0;
}

void kprof_idle_print(const kprof_idle *d, FILE *f, const char *title)
{
	static const char *bins[KPROF_GAP_BINS] = { "<10us", "<100us", "<1ms", "<10ms", ">=10ms" };
	double span = d->span_ns ? (double)d->span_ns : 1;
	fprintf(f, "# %s: span %.3f ms, busy %.3f ms (%.1f%%), idle %.3f ms\n", title, d->span_ns / 1e6,
		d->busy_ns / 1e6, 100.0 * d->busy_ns / span, (d->span_ns - d->busy_ns) / 1e6);
	fprintf(f, "# %s: idle gaps", title);
	for (int b = 0; b < KPROF_GAP_BINS; b++)
		fprintf(f, " %s %" PRIu64 " (%.3f ms)%s", bins[b], d->gaps[b], d->gap_ns[b] / 1e6,
			b + 1 < KPROF_GAP_BINS ? "," : "\n");
}
