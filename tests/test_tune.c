/* test_tune.c - tier-tune's simulator: textbook sequences give the known hit counts (LRU, LFU,
 * OPT), and on random traces MIN equals an exhaustive optimum (dynamic programming over the cached
 * sets) and is never beaten by a policy, at every capacity. The prefetch-overlap timeline matches
 * hand-worked timelines and a naive reference, and on random traces lies between the link-bound
 * floor and the no-overlap stall, equal to it with window 0, never worse with a larger window. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "../tools/tune_sim.h"
#include "test_seed.h"

static uint64_t seed;

/* A unit-size HBM trace of the given references (objects 0..max), no decay. */
static void make(sim_trace *t, const int *ref, size_t n, uint64_t size)
{
	memset(t, 0, sizeof *t);
	for (size_t i = 0; i < n; i++) {
		assert_int_equal(sim_trace_object(t, (uint32_t)ref[i], size), 0);
		assert_int_equal(sim_trace_add(t, (uint32_t)ref[i], 0, 0, SIM_ACCESS), 0);
	}
}

/* An empty trace of objects 0..n-1, each of `size` bytes. */
static void trace_objects(sim_trace *t, uint32_t n, uint64_t size)
{
	memset(t, 0, sizeof *t);
	for (uint32_t i = 0; i < n; i++)
		assert_int_equal(sim_trace_object(t, i, size), 0);
}

/* A request of the hand-made traces: object obj in step 0 at level tier (0 HBM, 1 DDR). */
static void request(sim_trace *t, uint32_t obj, int tier, int kind)
{
	assert_int_equal(sim_trace_add(t, obj, 0, tier, kind), 0);
}

static sim_result run(const sim_trace *t, sim_policy p, uint64_t hbm)
{
	sim_config c = { .cap = { hbm, 1ull << 40 }, .half_life = INFINITY, .gbps = { 55, 6 } };
	sim_result r;
	memset(&r, 0x5a, sizeof r); /* poisoned */
	assert_int_equal(sim_run(t, p, &c, &r), 0);
	return r;
}

/* The classic reference string (Silberschatz) with 3 frames: LRU 12 faults, OPT 9 faults. */
static void test_classic(void **state)
{
	(void)state;
	static const int ref[] = { 7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1 };
	sim_trace t;
	const uint64_t S = 4096;
	make(&t, ref, 20, S);
	sim_result lru = run(&t, SIM_LRU, 3 * S), opt = run(&t, SIM_SCHEDULE, 3 * S), min = run(&t, SIM_MIN, 3 * S);
	assert_int_equal(lru.cold[0], 6); /* six distinct pages */
	assert_int_equal(lru.misses[0] + lru.cold[0], 12);
	assert_int_equal(lru.hits[0], 8);
	assert_int_equal(opt.misses[0] + opt.cold[0], 9);
	assert_int_equal(opt.hits[0], 11);
	assert_true(min.hits[0] >= opt.hits[0]);
	/* bytes: each non-first miss reads the page over PCIe, then over NVMe only if DDR lost it */
	assert_int_equal(lru.bytes[0][0], lru.misses[0] * S);
	assert_int_equal(lru.bytes[1][0], 0);
	double want = (double)(lru.bytes[0][0] + lru.bytes[0][1]) / 55e9 + (double)(lru.bytes[1][0] + lru.bytes[1][1]) / 6e9;
	assert_true(fabs(lru.stall_s - want) <= 1e-12);
	sim_trace_free(&t);
}

/* LFU (counts kept across evictions, as the store's; ties to the least recent), worked by hand:
 * A A A B C D A, 3 frames: D evicts B (count 1, older than C), A hits: 3 hits; LRU evicts A: 2. */
static void test_lfu(void **state)
{
	(void)state;
	static const int a[] = { 0, 0, 0, 1, 2, 3, 0 };
	/* A B C A A B D A C E A B: D evicts C (1); C evicts D (1); E evicts B (2, older than C's 2);
	 * B evicts E: 5 hits, 5 first touches, 2 misses. */
	static const int b[] = { 0, 1, 2, 0, 0, 1, 3, 0, 2, 4, 0, 1 };
	sim_trace t;
	make(&t, a, 7, 1);
	assert_int_equal(run(&t, SIM_LFU, 3).hits[0], 3);
	assert_int_equal(run(&t, SIM_LRU, 3).hits[0], 2);
	sim_trace_free(&t);
	make(&t, b, 12, 1);
	sim_result r = run(&t, SIM_LFU, 3);
	assert_int_equal(r.hits[0], 5);
	assert_int_equal(r.cold[0], 5);
	assert_int_equal(r.misses[0], 2);
	sim_trace_free(&t);
}

/* The best hit count of any demand cache with bypass, unit sizes: DP over the cached sets. */
static uint64_t optimum(const int *ref, size_t n, int nobj, int cap)
{
	int ns = 1 << nobj;
	long *best = malloc(sizeof *best * (size_t)ns), *nx = malloc(sizeof *nx * (size_t)ns);
	assert_non_null(best);
	assert_non_null(nx);
	for (int s = 0; s < ns; s++)
		best[s] = s ? -1 : 0;
	for (size_t i = 0; i < n; i++) {
		for (int s = 0; s < ns; s++)
			nx[s] = -1;
		int x = 1 << ref[i];
		for (int s = 0; s < ns; s++) {
			if (best[s] < 0)
				continue;
			if (s & x) {
				nx[s] = best[s] + 1 > nx[s] ? best[s] + 1 : nx[s];
				continue;
			}
			nx[s] = best[s] > nx[s] ? best[s] : nx[s]; /* bypass */
			if (__builtin_popcount((unsigned)s) < cap) {
				nx[s | x] = best[s] > nx[s | x] ? best[s] : nx[s | x];
			} else {
				for (int v = 0; v < nobj; v++)
					if (s & 1 << v) {
						int u = (s & ~(1 << v)) | x;
						nx[u] = best[s] > nx[u] ? best[s] : nx[u];
					}
			}
		}
		long *tmp = best;
		best = nx, nx = tmp;
	}
	long m = 0;
	for (int s = 0; s < ns; s++)
		m = best[s] > m ? best[s] : m;
	free(best);
	free(nx);
	return (uint64_t)m;
}

static void test_min_property(void **state)
{
	(void)state;
	tier_rng rng;
	tier_rng_seed(&rng, seed);
	for (int it = 0; it < 200; it++) {
		int nobj = 2 + (int)(tier_rng_next(&rng) % 7), ref[80];
		size_t n = 10 + tier_rng_next(&rng) % 70;
		int skew = (int)(tier_rng_next(&rng) % 3); /* 0 uniform, 1-2 favouring low ids */
		for (size_t i = 0; i < n; i++) {
			uint64_t v = tier_rng_next(&rng) % (uint64_t)nobj;
			for (int k = 0; k < skew; k++)
				v = v < tier_rng_next(&rng) % (uint64_t)nobj ? v : tier_rng_next(&rng) % (uint64_t)nobj;
			ref[i] = (int)v;
		}
		sim_trace t;
		make(&t, ref, n, 1000);
		/* steps advance now and then so that LFU's and cost's decay matters */
		for (size_t i = 0; i < n; i++)
			t.req[i].step = (uint32_t)(i / 7);
		for (int cap = 1; cap <= nobj; cap++) {
			sim_config c = { .cap = { (uint64_t)cap * 1000, 1ull << 40 }, .half_life = 2, .gbps = { 55, 6 } };
			sim_result r[SIM_NPOL];
			for (int p = 0; p < SIM_NPOL; p++) {
				assert_int_equal(sim_run(&t, (sim_policy)p, &c, &r[p]), 0);
				assert_int_equal(r[p].hits[0] + r[p].misses[0] + r[p].cold[0], n);
			}
			uint64_t opt = optimum(ref, n, nobj, cap);
			if (r[SIM_MIN].hits[0] != opt) {
				print_error("seed %llu it %d cap %d: MIN %llu hits, optimum %llu\n", (unsigned long long)seed, it,
					    cap, (unsigned long long)r[SIM_MIN].hits[0], (unsigned long long)opt);
				fail();
			}
			for (int p = 0; p < SIM_MIN; p++)
				if (r[p].hits[0] > r[SIM_MIN].hits[0]) {
					print_error("seed %llu it %d cap %d: %s %llu hits > MIN %llu\n", (unsigned long long)seed,
						    it, cap, sim_policy_name((sim_policy)p), (unsigned long long)r[p].hits[0],
						    (unsigned long long)r[SIM_MIN].hits[0]);
					fail();
				}
		}
		sim_trace_free(&t);
	}
}

/* Two levels, by hand (unit sizes, HBM 1, DDR 2, LRU): hbm A, hbm B (evicts A: written down),
 * ddr C (first touch in DDR), hbm A (HBM miss, DDR hit; evicts B: written down, and in DDR the
 * write of B evicts C, dirty: written to NVMe). */
static void test_two_levels(void **state)
{
	(void)state;
	sim_trace t;
	trace_objects(&t, 3, 1);
	request(&t, 0, 0, SIM_ACCESS);
	request(&t, 1, 0, SIM_ACCESS);
	request(&t, 2, 1, SIM_ACCESS);
	request(&t, 0, 0, SIM_ACCESS);
	sim_config c = { .cap = { 1, 2 }, .half_life = 4, .gbps = { 1, 1 } };
	sim_result r;
	memset(&r, 0x5a, sizeof r);
	assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), 0);
	assert_int_equal(r.hits[0], 0);
	assert_int_equal(r.misses[0], 1);
	assert_int_equal(r.cold[0], 2);
	assert_int_equal(r.hits[1], 1);
	assert_int_equal(r.misses[1], 0);
	assert_int_equal(r.cold[1], 1);
	assert_int_equal(r.bytes[0][0], 1);
	assert_int_equal(r.bytes[0][1], 2);
	assert_int_equal(r.bytes[1][0], 0);
	assert_int_equal(r.bytes[1][1], 1);
	assert_true(fabs(r.stall_s - 4e-9) < 1e-18);
	sim_trace_free(&t);
}

/* A discard drops the object at both levels without a writeback, and its next access is a fill
 * (cold), not a read: HBM of 1, object 0 written, discarded, object 1 read, object 0 again. */
static void test_discard(void **state)
{
	(void)state;
	for (int discard = 0; discard < 2; discard++) {
		sim_trace t;
		trace_objects(&t, 2, 1);
		request(&t, 0, 0, SIM_ACCESS);
		request(&t, 0, 0, SIM_DIRTY);
		if (discard)
			request(&t, 0, 0, SIM_DISCARD);
		request(&t, 1, 1, SIM_ACCESS);
		request(&t, 1, 0, SIM_ACCESS);
		request(&t, 0, 0, SIM_ACCESS);
		sim_config c = { .cap = { 1, 4 }, .half_life = 4, .gbps = { 1, 1 } };
		sim_result r;
		assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), 0);
		/* with the discard: 0 and 1 cold in HBM, 0 comes back cold and only 1 (a fill: dirty) is
		 * written down; without: 0 is written down when 1 arrives, read back at the end, and 1
		 * written down then */
		assert_int_equal(r.cold[0], discard ? 3 : 2);
		assert_int_equal(r.misses[0], discard ? 0 : 1);
		assert_int_equal(r.bytes[0][0], discard ? 0 : 1);
		assert_int_equal(r.bytes[0][1], discard ? 1 : 2);
		sim_trace_free(&t);
	}
}

/* Objects larger than HBM are never cached (every reuse misses); a bad config is refused. */
static void test_edges(void **state)
{
	(void)state;
	static const int ref[] = { 0, 1, 0, 1, 0 };
	sim_trace t;
	make(&t, ref, 5, 100);
	for (int p = 0; p < SIM_NPOL; p++) {
		sim_result r = run(&t, (sim_policy)p, 50);
		assert_int_equal(r.hits[0], 0);
		assert_int_equal(r.misses[0], 3);
		assert_int_equal(r.bytes[0][1], 200); /* first touches are new data: written down at once */
	}
	sim_config c = { .cap = { 0, 1 }, .half_life = 4, .gbps = { 55, 6 } };
	sim_result r;
	assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), -EINVAL);
	c.cap[0] = 1, c.gbps[1] = 0;
	assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), -EINVAL);
	c.gbps[1] = 6;
	assert_int_equal(sim_run(&t, SIM_NPOL, &c, &r), -EINVAL);
	sim_trace_free(&t);
	assert_int_equal(sim_trace_load(&t, "no-such-trace-file.trc"), -ENOENT);
	sim_trace_free(&t);
}


/* ---- the overlap timeline ---------------------------------------------------------------------- */

static void overlap_ops(sim_op *op, const double *xfer, const uint64_t *in, const uint64_t *ws, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		memset(&op[i], 0x5a, sizeof op[i]); /* poisoned outputs */
		op[i].xfer_s = xfer[i], op[i].in = in[i], op[i].ws = ws[i];
	}
}

static void near(double got, double want, const char *what)
{
	if (fabs(got - want) > 1e-9 * (1 + fabs(want))) {
		print_error("%s: %.12g, want %.12g\n", what, got, want);
		fail();
	}
}

/* Three operations of 1 s compute, the last moving 2 s of data. Window 0: it waits 2 s. Window 1:
 * issued at op 1's start (1 s), ready at 3 s, op 2 starts at 2 s: 1 s. Window 2: issued at 0 s,
 * ready at 2 s when op 2 starts: 0. With HBM room for op 0's 600 B or op 1's 100 B plus op 2's
 * 500 B but not both: window 2 acts as window 1; with op 1 holding 600 B too: a demand fetch, 2 s.
 * Link-bound: three 1 s transfers, 0.5 s compute: op 0 waits 1 s, then each waits 0.5 s (the link
 * is busy, the window does not matter): 2 s = sum of transfers + one compute - all compute. */
static void test_overlap_by_hand(void **state)
{
	(void)state;
	static const struct {
		double xfer[3], op_s;
		uint64_t in[3], ws[3], cap;
		unsigned w;
		double stall, stall_op[3], ready2;
		int demand2;
	} c[] = {
		{ { 0, 0, 2 }, 1, { 0, 0, 500 }, { 600, 100, 100 }, 1000000, 0, 2, { 0, 0, 2 }, 4, 1 },
		{ { 0, 0, 2 }, 1, { 0, 0, 500 }, { 600, 100, 100 }, 1000000, 1, 1, { 0, 0, 1 }, 3, 0 },
		{ { 0, 0, 2 }, 1, { 0, 0, 500 }, { 600, 100, 100 }, 1000000, 2, 0, { 0, 0, 0 }, 2, 0 },
		{ { 0, 0, 2 }, 1, { 0, 0, 500 }, { 600, 100, 100 }, 1000, 2, 1, { 0, 0, 1 }, 3, 0 },
		{ { 0, 0, 2 }, 1, { 0, 0, 500 }, { 600, 600, 100 }, 1000, 2, 2, { 0, 0, 2 }, 4, 1 },
		{ { 1, 1, 1 }, 0.5, { 1, 1, 1 }, { 1, 1, 1 }, 100, 0, 3, { 1, 1, 1 }, 4, 1 },
		{ { 1, 1, 1 }, 0.5, { 1, 1, 1 }, { 1, 1, 1 }, 100, 1, 2, { 1, 0.5, 0.5 }, 3, 0 },
		{ { 1, 1, 1 }, 0.5, { 1, 1, 1 }, { 1, 1, 1 }, 100, 2, 2, { 1, 0.5, 0.5 }, 3, 0 },
	};
	for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
		sim_op op[3];
		overlap_ops(op, c[k].xfer, c[k].in, c[k].ws, 3);
		double got = sim_overlap(op, 3, c[k].op_s, c[k].w, c[k].cap);
		print_message("case %zu: window %u, stall %.3f s (ops %.3f %.3f %.3f)\n", k, c[k].w, got, op[0].stall_s,
			      op[1].stall_s, op[2].stall_s);
		near(got, c[k].stall, "total stall");
		for (int i = 0; i < 3; i++)
			near(op[i].stall_s, c[k].stall_op[i], "stall of an op");
		near(op[2].ready_s, c[k].ready2, "ready of op 2");
		assert_int_equal(op[2].demand, c[k].demand2);
	}
}

/* The same through the replay, by hand: objects A, B, C of 1000 B, links at 1000 B/s, HBM 2000 B,
 * LRU, compute 1.5 s per operation. op 0: A, B first touches (no data). op 1: C first touch,
 * evicts A dirty: 1 s to write it down. op 2: A misses (1 s up), evicts B dirty (1 s down): 2 s.
 * An empty step opening is not an operation. op 3 (step 1): B misses, evicts C dirty: 2 s.
 * No overlap: 5 s. Window 1: op 1's write is issued at 0 s, done at 1 s, before op 1 starts at
 * 1.5 s; op 2's transfer is issued at 1.5 s, ready 3.5 s, op 2 starts at 3 s: 0.5 s; op 3's at 3 s,
 * behind op 2's until 3.5 s, ready 5.5 s, op 3 starts at 5 s: 0.5 s. Total 1 s. Window 2 cannot
 * start earlier: op 0 holds A and B, so op 2's data does not fit in 2000 B until op 1 runs (the
 * same operations with unbounded HBM: op 2 at 0 s, ready 3 s, no wait; op 3 waits 0.5 s). */
static void test_overlap_replay(void **state)
{
	(void)state;
	static const uint32_t ops[][2] = { { 0, 1 }, { 2, 2 }, { 0, 0 }, { 1, 1 } }; /* objects per op */
	sim_trace t;
	trace_objects(&t, 3, 1000);
	for (uint32_t k = 0; k < 4; k++) {
		if (k == 3)
			sim_trace_op(&t, 1, 0); /* a step opens an operation that stays empty */
		sim_trace_op(&t, k == 3, 1);
		for (int j = 0; j < (ops[k][0] == ops[k][1] ? 1 : 2); j++)
			assert_int_equal(sim_trace_add(&t, ops[k][j], k == 3, 0, SIM_ACCESS), 0);
	}
	assert_int_equal(t.nops, 4);
	assert_int_equal(sim_trace_steps(&t), 2);
	static const struct {
		unsigned w;
		double overlap;
		uint64_t demand, stalled;
	} want[] = { { 0, 5, 3, 3 }, { 1, 1, 0, 2 }, { 2, 1, 0, 2 } };
	for (size_t k = 0; k < 3; k++) {
		sim_config c = { .cap = { 2000, 1ull << 40 }, .half_life = 4, .gbps = { 1e-6, 1e-6 }, .op_s = 1.5,
				 .window = want[k].w };
		sim_result r;
		memset(&r, 0x5a, sizeof r);
		assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), 0);
		near(r.stall_s, 5, "no-overlap stall");
		near(r.overlap_s, want[k].overlap, "overlap stall");
		near(r.compute_s, 6, "compute");
		assert_int_equal(r.xfer_ops, 3);
		assert_int_equal(r.demand_ops, want[k].demand);
		assert_int_equal(r.stalled_ops, want[k].stalled);
	}
	static const double xfer[] = { 0, 1, 2, 2 };
	static const uint64_t in[] = { 0, 0, 1000, 1000 }, ws[] = { 2000, 1000, 1000, 1000 };
	sim_op op[4];
	overlap_ops(op, xfer, in, ws, 4);
	near(sim_overlap(op, 4, 1.5, 2, UINT64_MAX), 0.5, "window 2, unbounded HBM");
	sim_config c = { .cap = { 2000, 1ull << 40 }, .half_life = 4, .gbps = { 1e-6, 1e-6 }, .op_s = -1 };
	sim_result r;
	assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), 0);
	assert_true(isnan(r.overlap_s)); /* no compute time: no timeline */
	c.op_s = INFINITY;
	assert_int_equal(sim_run(&t, SIM_LRU, &c, &r), -EINVAL);
	sim_trace_free(&t);
}

/* The timeline the obvious way: for each operation try every window position from the earliest,
 * summing what must fit from scratch. Random operation lists are checked against it, and for
 * never waiting longer with more HBM room or a larger window. */
static double ref_overlap(const sim_op *op, size_t n, double op_s, unsigned w, uint64_t cap, double *stall)
{
	double now = 0, link = 0, total = 0, start[64];
	for (size_t i = 0; i < n; i++) {
		start[i] = now;
		stall[i] = 0;
		if (op[i].xfer_s > 0) {
			double issue = now;
			for (size_t k = i >= w ? i - w : 0; k < i; k++) {
				uint64_t need = op[k].ws;
				for (size_t j = k + 1; j <= i; j++)
					need += op[j].in;
				if (need <= cap) {
					issue = start[k];
					break;
				}
			}
			double ready = (issue > link ? issue : link) + op[i].xfer_s;
			link = ready;
			stall[i] = ready > now ? ready - now : 0;
		}
		total += stall[i];
		now += stall[i] + op_s;
	}
	return total;
}

static void test_overlap_reference(void **state)
{
	(void)state;
	tier_rng rng;
	tier_rng_seed(&rng, seed + 1);
	for (int it = 0; it < 2000; it++) {
		size_t n = 1 + tier_rng_next(&rng) % 64;
		sim_op op[64];
		double stall[64];
		for (size_t i = 0; i < n; i++) {
			memset(&op[i], 0x5a, sizeof op[i]);
			op[i].xfer_s = tier_rng_next(&rng) % 3 ? (double)(tier_rng_next(&rng) % 1000) / 250 : 0;
			op[i].in = tier_rng_next(&rng) % 100, op[i].ws = tier_rng_next(&rng) % 100;
		}
		double op_s = (double)(tier_rng_next(&rng) % 1000) / 300;
		unsigned w = (unsigned)(tier_rng_next(&rng) % 6);
		uint64_t cap = tier_rng_next(&rng) % 400;
		double got = sim_overlap(op, n, op_s, w, cap), want = ref_overlap(op, n, op_s, w, cap, stall);
		if (fabs(got - want) > 1e-9 * (1 + want)) {
			print_error("seed %llu it %d: overlap %.12g, reference %.12g\n", (unsigned long long)seed, it, got, want);
			fail();
		}
		for (size_t i = 0; i < n; i++)
			near(op[i].stall_s, stall[i], "stall of an op against the reference");
		/* more room or a larger window never waits longer */
		double more_room = sim_overlap(op, n, op_s, w, 2 * cap + 1), wider = sim_overlap(op, n, op_s, w + 1, cap);
		if (more_room > got + 1e-9 * (1 + got) || wider > got + 1e-9 * (1 + got)) {
			print_error("seed %llu it %d: %.12g s, with more room %.12g s, window %u %.12g s\n",
				    (unsigned long long)seed, it, got, more_room, w + 1, wider);
			fail();
		}
	}
}

/* Random traces of mixed sizes over both levels, random operation boundaries (empty step openings
 * among them): 0 <= overlap <= no overlap, equal with window 0, never worse with a larger window,
 * never below the link-bound floor (every transfer in series, then the last operation's compute). */
static void test_overlap_property(void **state)
{
	(void)state;
	tier_rng rng;
	tier_rng_seed(&rng, seed + 2);
	for (int it = 0; it < 300; it++) {
		sim_trace t;
		memset(&t, 0, sizeof t);
		uint32_t nobj = 2 + (uint32_t)(tier_rng_next(&rng) % 12);
		for (uint32_t i = 0; i < nobj; i++)
			assert_int_equal(sim_trace_object(&t, i, 1 + tier_rng_next(&rng) % 4000), 0);
		size_t n = 5 + tier_rng_next(&rng) % 200;
		for (size_t i = 0; i < n; i++) {
			uint32_t step = (uint32_t)(i / 40);
			if (tier_rng_next(&rng) % 4 == 0)
				sim_trace_op(&t, step, (int)(tier_rng_next(&rng) % 2));
			int tier = tier_rng_next(&rng) % 6 == 0, dirty = tier_rng_next(&rng) % 5 == 0;
			assert_int_equal(sim_trace_add(&t, (uint32_t)(tier_rng_next(&rng) % nobj), step, tier,
						       dirty ? SIM_DIRTY : SIM_ACCESS), 0);
		}
		sim_config c = { .cap = { 1 + tier_rng_next(&rng) % 12000, 1 + tier_rng_next(&rng) % 30000 },
				 .half_life = 2, .gbps = { 1e-6 * (1 + (double)(tier_rng_next(&rng) % 8)), 1e-6 },
				 .op_s = (double)(tier_rng_next(&rng) % 100) / 20 };
		sim_policy p = (sim_policy)(tier_rng_next(&rng) % SIM_NPOL);
		double prev = INFINITY;
		for (unsigned w = 0; w <= 4; w++) {
			c.window = w;
			sim_result r;
			memset(&r, 0x5a, sizeof r);
			assert_int_equal(sim_run(&t, p, &c, &r), 0);
			double eps = 1e-9 * (1 + r.stall_s), floor = r.stall_s + c.op_s - (double)t.nops * c.op_s;
			if (!(r.overlap_s >= 0) || r.overlap_s > r.stall_s + eps || (w == 0 && fabs(r.overlap_s - r.stall_s) > eps) ||
			    r.overlap_s > prev + eps || r.overlap_s < floor - eps) {
				print_error("seed %llu it %d %s window %u: overlap %.9g s, no overlap %.9g s, window %u %.9g s, "
					    "floor %.9g s\n", (unsigned long long)seed, it, sim_policy_name(p), w, r.overlap_s,
					    r.stall_s, w - 1, prev, floor);
				fail();
			}
			assert_true(r.demand_ops <= r.xfer_ops && r.stalled_ops <= r.xfer_ops && r.xfer_ops <= t.nops);
			near(r.compute_s, (double)t.nops * c.op_s, "compute");
			prev = r.overlap_s;
		}
		sim_trace_free(&t);
	}
}

int main(void)
{
	seed = test_seed("test_tune", 0);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_classic), cmocka_unit_test(test_lfu), cmocka_unit_test(test_min_property),
		cmocka_unit_test(test_two_levels),
		cmocka_unit_test(test_discard), cmocka_unit_test(test_edges), cmocka_unit_test(test_overlap_by_hand),
		cmocka_unit_test(test_overlap_replay), cmocka_unit_test(test_overlap_reference),
		cmocka_unit_test(test_overlap_property),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
