/* test_tune.c - tier-tune's simulator: textbook sequences give the known hit counts (LRU, LFU,
 * OPT), and on random traces MIN equals an exhaustive optimum (dynamic programming over the cached
 * sets) and is never beaten by a policy, at every capacity. */
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
	memset(&t, 0, sizeof t);
	for (uint32_t i = 0; i < 3; i++)
		assert_int_equal(sim_trace_object(&t, i, 1), 0);
	assert_int_equal(sim_trace_add(&t, 0, 0, 0, SIM_ACCESS), 0);
	assert_int_equal(sim_trace_add(&t, 1, 0, 0, SIM_ACCESS), 0);
	assert_int_equal(sim_trace_add(&t, 2, 0, 1, SIM_ACCESS), 0);
	assert_int_equal(sim_trace_add(&t, 0, 0, 0, SIM_ACCESS), 0);
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

int main(void)
{
	const char *env = getenv("TIER_SEED");
	seed = env ? strtoull(env, NULL, 0) : tier_now_ns();
	printf("# seed %llu (TIER_SEED=N repeats a run)\n", (unsigned long long)seed);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_classic), cmocka_unit_test(test_lfu), cmocka_unit_test(test_min_property),
		cmocka_unit_test(test_two_levels),
		cmocka_unit_test(test_edges),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
