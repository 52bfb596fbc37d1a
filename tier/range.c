/* range.c - best-fit range allocator over [0, capacity) with coalescing of free neighbours.
 *
 * Free runs [off, off + len) are nodes of two treaps: one ordered by offset (to find the
 * neighbours of a freed range), one by (len, off) (best fit is the first run with len >= size,
 * lowest offset among equals). Both are O(log n) expected per operation. Runs are never adjacent:
 * a freed range merges with the run that ends where it starts and the one that starts where it ends.
 *
 * range_free cannot fail: each allocation that does not consume a whole run sets aside one spare
 * node in a pool, so the pool always holds enough nodes for every outstanding allocation to come
 * back as a run of its own (pool + runs >= allocations + 1). */
#include <errno.h>
#include <stdlib.h>
#include "tier/base.h"
#include "tier/backend.h"

enum { BY_OFF = 0, BY_LEN = 1 };

typedef struct run {
	uint64_t off, len;
	struct run *kid[2][2]; /* [tree][left, right] */
	uint32_t prio[2];      /* heap priority per tree (max at the root) */
} run;

struct tier_range {
	uint64_t capacity;     /* usable: the capacity asked for, rounded down to align */
	uint64_t align;
	uint64_t used;         /* sum of rounded sizes allocated */
	uint64_t allocs;       /* outstanding allocations */
	size_t runs;           /* free runs */
	run *root[2];
	run *pool;             /* spare nodes, linked through kid[0][0] */
	size_t pooled;
	uint64_t rng;          /* xorshift for treap priorities */
};

static uint32_t next_prio(tier_range *r)
{
	r->rng ^= r->rng << 13;
	r->rng ^= r->rng >> 7;
	r->rng ^= r->rng << 17;
	return (uint32_t)(r->rng >> 32);
}

/* Strict order of the tree: by offset, or by (len, off). */
static int before(int t, const run *a, const run *b)
{
	if (t == BY_OFF)
		return a->off < b->off;
	return a->len < b->len || (a->len == b->len && a->off < b->off);
}

static run *merge(int t, run *a, run *b)
{
	if (!a)
		return b;
	if (!b)
		return a;
	if (a->prio[t] >= b->prio[t]) {
		a->kid[t][1] = merge(t, a->kid[t][1], b);
		return a;
	}
	b->kid[t][0] = merge(t, a, b->kid[t][0]);
	return b;
}

/* Split into nodes before `key` and the rest. */
static void split(int t, run *n, const run *key, run **lo, run **hi)
{
	if (!n) {
		*lo = *hi = NULL;
	} else if (before(t, n, key)) {
		split(t, n->kid[t][1], key, &n->kid[t][1], hi);
		*lo = n;
	} else {
		split(t, n->kid[t][0], key, lo, &n->kid[t][0]);
		*hi = n;
	}
}

static void tree_insert(tier_range *r, int t, run *n)
{
	run *lo, *hi;
	n->kid[t][0] = n->kid[t][1] = NULL;
	n->prio[t] = next_prio(r);
	split(t, r->root[t], n, &lo, &hi);
	r->root[t] = merge(t, merge(t, lo, n), hi);
}

static void tree_remove(tier_range *r, int t, run *n)
{
	run **link = &r->root[t];
	while (*link != n)
		link = &(*link)->kid[t][before(t, *link, n) ? 1 : 0];
	*link = merge(t, n->kid[t][0], n->kid[t][1]);
}

/* The run with the largest offset below `off` (NULL when none). */
static run *pred_by_off(const tier_range *r, uint64_t off)
{
	run *n = r->root[BY_OFF], *best = NULL;
	while (n) {
		if (n->off < off) {
			best = n;
			n = n->kid[BY_OFF][1];
		} else {
			n = n->kid[BY_OFF][0];
		}
	}
	return best;
}

/* The run with the smallest offset at or above `off`. */
static run *succ_by_off(const tier_range *r, uint64_t off)
{
	run *n = r->root[BY_OFF], *best = NULL;
	while (n) {
		if (n->off >= off) {
			best = n;
			n = n->kid[BY_OFF][0];
		} else {
			n = n->kid[BY_OFF][1];
		}
	}
	return best;
}

/* Best fit: the smallest run of at least `len`, lowest offset among equals. */
static run *best_fit(const tier_range *r, uint64_t len)
{
	run *n = r->root[BY_LEN], *best = NULL;
	while (n) {
		if (n->len >= len) {
			best = n;
			n = n->kid[BY_LEN][0];
		} else {
			n = n->kid[BY_LEN][1];
		}
	}
	return best;
}

static void pool_put(tier_range *r, run *n)
{
	n->kid[0][0] = r->pool;
	r->pool = n;
	r->pooled++;
}

static run *pool_get(tier_range *r)
{
	run *n = r->pool;
	r->pool = n->kid[0][0];
	r->pooled--;
	return n;
}

/* Keep the pool at what the free path may need, no more. */
static void pool_trim(tier_range *r)
{
	while (r->pooled && r->pooled + r->runs > r->allocs + 1)
		free(pool_get(r));
}

static void run_add(tier_range *r, run *n, uint64_t off, uint64_t len)
{
	n->off = off;
	n->len = len;
	tree_insert(r, BY_OFF, n);
	tree_insert(r, BY_LEN, n);
	r->runs++;
}

static void run_del(tier_range *r, run *n)
{
	tree_remove(r, BY_OFF, n);
	tree_remove(r, BY_LEN, n);
	r->runs--;
}

int range_create(tier_range **out, uint64_t capacity, uint64_t align)
{
	tier_range *r;
	run *n;
	*out = NULL;
	if (align == 0 || (align & (align - 1)))
		return tier_fail(-EINVAL, "range alignment %llu is not a power of two", (unsigned long long)align);
	if (capacity / align == 0)
		return tier_fail(-EINVAL, "range capacity %llu is smaller than its alignment %llu",
				 (unsigned long long)capacity, (unsigned long long)align);
	r = calloc(1, sizeof *r);
	n = calloc(1, sizeof *n);
	if (!r || !n) {
		free(r);
		free(n);
		return tier_fail(-ENOMEM, "out of host memory for a range allocator");
	}
	r->capacity = capacity / align * align;
	r->align = align;
	r->rng = 0x9E3779B97F4A7C15ull ^ (uintptr_t)r;
	run_add(r, n, 0, r->capacity);
	*out = r;
	return 0;
}

static void free_tree(run *n)
{
	while (n) {
		run *right = n->kid[BY_OFF][1];
		free_tree(n->kid[BY_OFF][0]);
		free(n);
		n = right;
	}
}

void range_destroy(tier_range *r)
{
	if (!r)
		return;
	free_tree(r->root[BY_OFF]);
	while (r->pooled)
		free(pool_get(r));
	free(r);
}

int range_alloc(tier_range *r, uint64_t size, uint64_t *off)
{
	uint64_t len;
	run *n;
	if (size == 0)
		return tier_fail(-EINVAL, "range allocation of 0 bytes");
	if (size > r->capacity)
		return -ENOSPC;
	len = tier_align_up(size, r->align);
	n = best_fit(r, len);
	if (!n)
		return -ENOSPC;
	/* Either way pooled + runs stays as it is, and one more allocation must be covered. */
	if (r->pooled + r->runs < r->allocs + 2) {
		run *spare = malloc(sizeof *spare);
		if (!spare)
			return tier_fail(-ENOMEM, "out of host memory for allocator bookkeeping");
		pool_put(r, spare);
	}
	if (n->len == len) {
		*off = n->off;
		run_del(r, n);
		pool_put(r, n);
	} else {
		*off = n->off;
		/* Shrinking from the front keeps the run's place in the offset tree; its size key changes. */
		tree_remove(r, BY_LEN, n);
		n->off += len;
		n->len -= len;
		tree_insert(r, BY_LEN, n);
	}
	r->used += len;
	r->allocs++;
	pool_trim(r);
	return 0;
}

void range_free(tier_range *r, uint64_t off, uint64_t size)
{
	uint64_t len = size > r->capacity ? 0 : tier_align_up(size, r->align), end = off + len;
	run *prev, *next;
	if (len == 0 || off % r->align || end < off || end > r->capacity || len > r->used || !r->allocs) {
		tier_log(TIER_LOG_ERROR, "range_free: [%llu, +%llu) was never allocated here (ignored)",
			 (unsigned long long)off, (unsigned long long)size);
		return;
	}
	prev = pred_by_off(r, off);
	next = succ_by_off(r, off);
	if ((prev && prev->off + prev->len > off) || (next && next->off < end)) {
		tier_log(TIER_LOG_ERROR, "range_free: [%llu, +%llu) overlaps free space: double free (ignored)",
			 (unsigned long long)off, (unsigned long long)size);
		return;
	}
	if (prev && prev->off + prev->len == off && next && next->off == end) {
		run_del(r, next);
		pool_put(r, next);
		tree_remove(r, BY_LEN, prev);
		prev->len += len + next->len;
		tree_insert(r, BY_LEN, prev);
	} else if (prev && prev->off + prev->len == off) {
		tree_remove(r, BY_LEN, prev);
		prev->len += len;
		tree_insert(r, BY_LEN, prev);
	} else if (next && next->off == end) {
		/* Growing backwards keeps the order by offset: no run lies between prev and off. */
		tree_remove(r, BY_LEN, next);
		next->off = off;
		next->len += len;
		tree_insert(r, BY_LEN, next);
	} else {
		run_add(r, pool_get(r), off, len);
	}
	r->used -= len;
	r->allocs--;
	pool_trim(r);
}

uint64_t range_used(const tier_range *r) { return r->used; }
uint64_t range_align(const tier_range *r) { return r->align; }
uint64_t range_capacity(const tier_range *r) { return r->capacity; }
size_t range_runs(const tier_range *r) { return r->runs; }
uint64_t range_rounded(const tier_range *r, uint64_t size) { return tier_align_up(size, r->align); }

uint64_t range_largest_free(const tier_range *r)
{
	const run *n = r->root[BY_LEN];
	while (n && n->kid[BY_LEN][1])
		n = n->kid[BY_LEN][1];
	return n ? n->len : 0;
}

/* In-order walk of one tree checking order and heap priority; counts nodes and sums lengths. */
typedef struct {
	const tier_range *r;
	const run *last;
	size_t count;
	uint64_t free;
	const char *bad;
} walk;

static void check_tree(walk *w, int t, const run *n, uint32_t parent_prio)
{
	if (!n || w->bad)
		return;
	if (n->prio[t] > parent_prio) {
		w->bad = "heap order of a treap broken";
		return;
	}
	check_tree(w, t, n->kid[t][0], n->prio[t]);
	if (w->bad)
		return;
	if (w->last && !before(t, w->last, n))
		w->bad = t == BY_OFF ? "free runs not sorted by offset" : "free runs not sorted by size";
	else if (t == BY_OFF && w->last && w->last->off + w->last->len >= n->off)
		w->bad = "free runs overlap or touch (not coalesced)";
	else if (n->len == 0 || n->off % w->r->align || n->len % w->r->align)
		w->bad = "free run empty or not aligned";
	else if (n->off > w->r->capacity || n->len > w->r->capacity - n->off)
		w->bad = "free run outside the capacity";
	w->last = n;
	w->count++;
	w->free += n->len;
	check_tree(w, t, n->kid[t][1], n->prio[t]);
}

int range_check(const tier_range *r)
{
	walk w[2];
	for (int t = 0; t < 2; t++) {
		w[t] = (walk){ .r = r };
		check_tree(&w[t], t, r->root[t], UINT32_MAX);
		if (w[t].bad)
			return tier_fail(-EPROTO, "range allocator: %s", w[t].bad);
	}
	if (w[0].count != r->runs || w[1].count != r->runs)
		return tier_fail(-EPROTO, "range allocator: %zu runs counted by offset, %zu by size, %zu recorded",
				 w[0].count, w[1].count, r->runs);
	if (w[0].free + r->used != r->capacity)
		return tier_fail(-EPROTO, "range allocator: free %llu + used %llu != capacity %llu",
				 (unsigned long long)w[0].free, (unsigned long long)r->used,
				 (unsigned long long)r->capacity);
	if (r->pooled + r->runs < r->allocs + 1)
		return tier_fail(-EPROTO, "range allocator: %zu spare nodes cannot cover %llu allocations",
				 r->pooled, (unsigned long long)r->allocs);
	if ((r->used == 0) != (r->allocs == 0))
		return tier_fail(-EPROTO, "range allocator: used %llu bytes but %llu allocations",
				 (unsigned long long)r->used, (unsigned long long)r->allocs);
	return 0;
}
