/* test_opcache.c - the selective operator cache: hits equal recomputes bit for bit, budgets hold,
 * eviction by value density on hand-worked cases, entries lost before the backward, rules. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "store_util.h"

static uint64_t test_seed(const char *what)
{
	uint64_t seed = tier_now_ns();
	printf("# %s: seed %" PRIu64 "\n", what, seed);
	return seed;
}

/* ---- A real layer: Z = X W, Y = gelu(Z); backward dZ = dY * gelu'(Z), dX = dZ W^T, dW = X^T dZ -- */
typedef struct {
	int T, K, N;
	float *X, *W, *dY;
} mm_layer;

static float gelu_grad(float z)
{
	const float c = 0.7978845608f, a = 0.044715f;
	float u = c * (z + a * z * z * z), t = tanhf(u);
	return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * c * (1.0f + 3.0f * a * z * z);
}

static void layer_forward(const mm_layer *l, float *Z) /* the operator whose output is cached */
{
	for (int i = 0; i < l->T; i++)
		for (int j = 0; j < l->N; j++) {
			float acc = 0;
			for (int k = 0; k < l->K; k++)
				acc += l->X[i * l->K + k] * l->W[k * l->N + j];
			Z[i * l->N + j] = acc;
		}
}

static void layer_backward(const mm_layer *l, const float *Z, float *dX, float *dW)
{
	float *dZ = malloc(sizeof(float) * l->T * l->N);
	assert_non_null(dZ);
	for (int i = 0; i < l->T * l->N; i++)
		dZ[i] = l->dY[i] * gelu_grad(Z[i]);
	for (int i = 0; i < l->T; i++)
		for (int k = 0; k < l->K; k++) {
			float acc = 0;
			for (int j = 0; j < l->N; j++)
				acc += dZ[i * l->N + j] * l->W[k * l->N + j];
			dX[i * l->K + k] = acc;
		}
	for (int k = 0; k < l->K; k++)
		for (int j = 0; j < l->N; j++) {
			float acc = 0;
			for (int i = 0; i < l->T; i++)
				acc += l->X[i * l->K + k] * dZ[i * l->N + j];
			dW[k * l->N + j] = acc;
		}
	free(dZ);
}

static void layer_init(mm_layer *l, tier_rng *r, int T, int K, int N)
{
	l->T = T, l->K = K, l->N = N;
	l->X = malloc(sizeof(float) * T * K);
	l->W = malloc(sizeof(float) * K * N);
	l->dY = malloc(sizeof(float) * T * N);
	assert_true(l->X && l->W && l->dY);
	for (int i = 0; i < T * K; i++)
		l->X[i] = tier_rng_normal(r);
	for (int i = 0; i < K * N; i++)
		l->W[i] = tier_rng_normal(r) / sqrtf((float)K);
	for (int i = 0; i < T * N; i++)
		l->dY[i] = tier_rng_normal(r);
}

static void layer_free(mm_layer *l)
{
	free(l->X);
	free(l->W);
	free(l->dY);
}

static tier_op_cost layer_cost(const mm_layer *l)
{
	tier_op_cost c = { TIER_OP_MATMUL, 2.0 * l->T * l->K * l->N, 4.0 * (l->T * l->K + l->K * l->N + l->T * l->N), 0 };
	return c;
}

/* Backward of the layer through the cache: the cached Z on a hit, a recompute on a miss. */
static int backward_via_cache(tier_cache *c, tier_cache_key key, const mm_layer *l, float *dX, float *dW)
{
	void *p;
	int rc = tier_cache_get(c, key, &p);
	assert_true(rc == 0 || rc == 1);
	if (rc == 0) {
		layer_backward(l, p, dX, dW);
		assert_int_equal(tier_cache_release(c, key, 1), 0);
		return 1;
	}
	float *Z = malloc(sizeof(float) * l->T * l->N);
	assert_non_null(Z);
	layer_forward(l, Z);
	layer_backward(l, Z, dX, dW);
	free(Z);
	return 0;
}

static tier_cache_rates fixed_rates(double flops, double mem, double link)
{
	tier_cache_rates r = { flops, mem, link, 0 };
	return r;
}

static void open_cache(test_store *ts, tier_cache **c, uint64_t store_hbm, uint64_t store_ddr, const char *rules,
		       const tier_cache_rates *rates)
{
	tier_cache_config cfg;
	assert_int_equal(test_store_open(ts, TIER_POLICY_COST, store_hbm, store_ddr, 0, 0), 0);
	assert_int_equal(tier_cache_config_parse(rules, &cfg), 0);
	assert_int_equal(tier_cache_create(c, ts->s, NULL, &cfg, rates), 0);
}

static void close_cache(test_store *ts, tier_cache *c)
{
	assert_int_equal(tier_cache_check(c), 0);
	tier_cache_destroy(c);
	test_store_close(ts);
}

/* A hit, from HBM and from DDR, gives the same gradients as a recompute, to the bit; both agree
 * with an fp64 reference. */
static void test_hit_equals_recompute(void **state)
{
	tier_rng r;
	tier_rng_seed(&r, test_seed("hit equals recompute"));
	mm_layer l;
	layer_init(&l, &r, 37, 29, 53);
	size_t nx = (size_t)l.T * l.K, nw = (size_t)l.K * l.N, zb = sizeof(float) * l.T * l.N;
	float *dX[2], *dW[2], *Z = malloc(zb);
	for (int i = 0; i < 2; i++) {
		dX[i] = malloc(sizeof(float) * nx);
		dW[i] = malloc(sizeof(float) * nw);
	}
	/* An HBM budget of 8 KiB holds Z (7.7 KiB). In the second run a denser entry takes it first, Z
	 * goes to DDR (a fetch is cheaper than the recompute), and its get pushes the dense one out. */
	const char *rules = "matmul:hbm=8K:ddr=64K";
	for (int where = 0; where < 2; where++) {
		test_store ts;
		tier_cache *c;
		tier_cache_rates rates = fixed_rates(1e9, 1e12, 1e10);
		open_cache(&ts, &c, 1 << 20, 1 << 20, rules, &rates);
		tier_cache_key key = { 3, 1, 0 }, dense = { 3, 0, 0 };
		tier_op_cost cost = layer_cost(&l), dense_cost = { TIER_OP_MATMUL, 1e12, 0, 0 };
		tier_id got;
		if (where) {
			static unsigned char other[6000];
			assert_int_equal(tier_cache_offer(c, dense, other, sizeof other, &dense_cost, NULL, &got), 0);
			assert_int_equal(got, TIER_HBM);
		}
		layer_forward(&l, Z);
		assert_int_equal(tier_cache_offer(c, key, Z, zb, &cost, NULL, &got), 0);
		assert_int_equal(got, where ? TIER_DDR : TIER_HBM);
		memset(Z, 0xff, zb); /* the forward's buffer is reused: the cache holds its own copy */
		for (int i = 0; i < 2; i++) {
			memset(dX[i], 0xa5, sizeof(float) * nx); /* poison */
			memset(dW[i], 0xa5, sizeof(float) * nw);
		}
		assert_int_equal(backward_via_cache(c, key, &l, dX[0], dW[0]), 1);          /* hit */
		assert_int_equal(backward_via_cache(c, key, &l, dX[1], dW[1]), 0);          /* done: a miss */
		assert_memory_equal(dX[0], dX[1], sizeof(float) * nx);
		assert_memory_equal(dW[0], dW[1], sizeof(float) * nw);
		tier_cache_stats st;
		tier_cache_stats_get(c, &st);
		assert_int_equal(st.kind[TIER_OP_MATMUL].hits[where], 1);
		assert_int_equal(st.kind[TIER_OP_MATMUL].misses, 1);
		assert_true(st.kind[TIER_OP_MATMUL].flops_saved == cost.flops);
		assert_int_equal(st.kind[TIER_OP_MATMUL].bytes_fetched, where ? zb : 0);
		close_cache(&ts, c);
	}
	/* fp64 reference of dX */
	for (int i = 0; i < l.T; i++)
		for (int k = 0; k < l.K; k++) {
			double acc = 0;
			for (int j = 0; j < l.N; j++) {
				double z = 0;
				for (int q = 0; q < l.K; q++)
					z += (double)l.X[i * l.K + q] * l.W[q * l.N + j];
				acc += l.dY[i * l.N + j] * (double)gelu_grad((float)z) * l.W[k * l.N + j];
			}
			assert_true(fabs(acc - dX[0][i * l.K + k]) <= 1e-3 * (1 + fabs(acc)));
		}
	for (int i = 0; i < 2; i++) {
		free(dX[i]);
		free(dW[i]);
	}
	free(Z);
	layer_free(&l);
}

/* ---- Hand-worked eviction ---------------------------------------------------------------------
 * Rates: 1 FLOP per ns, 2 bytes per ns over the link (a DDR round trip of 4096 bytes: 4096 ns). Entries of 4096 bytes: A costs 40960 FLOPs
 * (HBM density 10 ns/B), B 8192 (2 ns/B), C 20480 (5 ns/B). The HBM budget holds two. */
enum { E = 4096 };
static void offer_pattern(tier_cache *c, uint32_t op, double flops, tier_id expect)
{
	static unsigned char buf[E];
	tier_cache_key key = { 0, op, 0 };
	tier_op_cost cost = { TIER_OP_MATMUL, flops, 0, 0 };
	tier_id got;
	tier_pattern_fill(buf, E, op, 0);
	assert_int_equal(tier_cache_offer(c, key, buf, E, &cost, NULL, &got), 0);
	assert_int_equal(got, expect);
	assert_int_equal(tier_cache_check(c), 0);
}

/* 0: hit with the right bytes, 1: miss. */
static int get_pattern(tier_cache *c, uint32_t op)
{
	tier_cache_key key = { 0, op, 0 };
	void *p;
	int rc = tier_cache_get(c, key, &p);
	if (rc == 0) {
		assert_int_equal(tier_pattern_check(p, E, op, 0), E);
		assert_int_equal(tier_cache_release(c, key, 0), 0);
	}
	assert_int_equal(tier_cache_check(c), 0);
	return rc;
}

static void test_evict_low_density(void **state)
{
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e15, 2e9);
	/* No DDR budget: the low-density entry is dropped. */
	open_cache(&ts, &c, 1 << 20, 1 << 20, "matmul:hbm=8K:ddr=0", &rates);
	offer_pattern(c, 'A', 40960, TIER_HBM);
	offer_pattern(c, 'B', 8192, TIER_HBM);
	offer_pattern(c, 'C', 20480, TIER_HBM); /* 5 > 2: B goes */
	offer_pattern(c, 'D', 4096, TIER_NTIERS); /* 1 ns/B: below everything held, no DDR */
	assert_int_equal(get_pattern(c, 'A'), 0);
	assert_int_equal(get_pattern(c, 'B'), 1);
	assert_int_equal(get_pattern(c, 'C'), 0);
	assert_int_equal(get_pattern(c, 'D'), 1);
	tier_cache_stats st;
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.kind[TIER_OP_MATMUL].evicted[0], 1);
	assert_int_equal(st.kind[TIER_OP_MATMUL].dropped, 1);
	assert_int_equal(st.peak[0], 2 * E);
	close_cache(&ts, c);

	/* With room for one in DDR: B (DDR density (8192 - 4096) / 4096 = 1) spills there; D's round
	 * trip (4096 ns) does not beat its recompute (4096 ns): dropped; F (8 ns/B) pushes C (5) out, and C
	 * (DDR density 4) pushes B (1) out of DDR. Getting C brings it back into HBM, which pushes out
	 * the lower of A (10) and F (8): F, which finds DDR full (C stays there) and is dropped. */
	open_cache(&ts, &c, 1 << 20, 1 << 20, "matmul:hbm=8K:ddr=4K", &rates);
	offer_pattern(c, 'A', 40960, TIER_HBM);
	offer_pattern(c, 'B', 8192, TIER_HBM);
	offer_pattern(c, 'C', 20480, TIER_HBM);
	offer_pattern(c, 'D', 4096, TIER_NTIERS);
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.used[1], E);
	assert_int_equal(st.kind[TIER_OP_MATMUL].bytes_spilled, E);
	offer_pattern(c, 'F', 32768, TIER_HBM);
	assert_int_equal(get_pattern(c, 'B'), 1);
	assert_int_equal(get_pattern(c, 'C'), 0);
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.kind[TIER_OP_MATMUL].hits[1], 1);
	assert_int_equal(st.kind[TIER_OP_MATMUL].bytes_fetched, E);
	assert_int_equal(st.kind[TIER_OP_MATMUL].evicted[0], 3);
	assert_int_equal(st.kind[TIER_OP_MATMUL].evicted[1], 1);
	assert_int_equal(st.used[0], 2 * E); /* A, and C's fetched copy */
	assert_int_equal(st.used[1], E);     /* C's DDR copy */
	assert_int_equal(get_pattern(c, 'A'), 0);
	assert_int_equal(get_pattern(c, 'F'), 1);
	close_cache(&ts, c);

	/* An entry larger than the HBM budget is not kept in DDR either: a get could not bring it in. */
	open_cache(&ts, &c, 1 << 20, 1 << 20, "matmul:hbm=2K:ddr=64K", &rates);
	offer_pattern(c, 'A', 1e9, TIER_NTIERS);
	assert_int_equal(get_pattern(c, 'A'), 1);
	close_cache(&ts, c);

	/* First come, first served: the third is dropped whatever its value. */
	open_cache(&ts, &c, 1 << 20, 1 << 20, "matmul:hbm=8K:ddr=64K:policy=fcfs", &rates);
	offer_pattern(c, 'B', 8192, TIER_HBM);
	offer_pattern(c, 'C', 20480, TIER_HBM);
	offer_pattern(c, 'A', 40960, TIER_NTIERS);
	assert_int_equal(get_pattern(c, 'A'), 1);
	assert_int_equal(get_pattern(c, 'B'), 0);
	close_cache(&ts, c);
}

/* An entry the store drops between forward and backward (other data filling HBM) is a miss, and
 * the recompute gives the same gradients as a hit would have. */
static void test_evicted_before_backward(void **state)
{
	tier_rng r;
	tier_rng_seed(&r, test_seed("evicted before backward"));
	mm_layer l;
	layer_init(&l, &r, 41, 33, 47);
	size_t zb = sizeof(float) * l.T * l.N, nx = (size_t)l.T * l.K, nw = (size_t)l.K * l.N;
	float *Z = malloc(zb), *dX[2], *dW[2];
	for (int i = 0; i < 2; i++) {
		dX[i] = malloc(sizeof(float) * nx);
		dW[i] = malloc(sizeof(float) * nw);
		memset(dX[i], 0x5a, sizeof(float) * nx);
		memset(dW[i], 0x5a, sizeof(float) * nw);
	}
	layer_forward(&l, Z);
	layer_backward(&l, Z, dX[0], dW[0]); /* what a hit would give */

	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e12, 1e10);
	open_cache(&ts, &c, 64 << 10, 1 << 20, "matmul:hbm=32K:ddr=0", &rates);
	tier_cache_key key = { 0, 0, 7 };
	tier_op_cost cost = layer_cost(&l);
	tier_id got;
	assert_int_equal(tier_cache_offer(c, key, Z, zb, &cost, NULL, &got), 0);
	assert_int_equal(got, TIER_HBM);
	/* Fill the store's HBM with pinned activations until the entry has to go. */
	tier_object *act[16];
	int n = 0;
	for (; n < 16; n++) {
		void *p;
		assert_int_equal(tier_obj_create(ts.s, 8 << 10, TIER_CLASS_ACT, 0, &act[n]), 0);
		if (tier_acquire(ts.s, act[n], TIER_HBM, TIER_ACQ_INIT, &p, NULL)) {
			assert_int_equal(tier_obj_destroy(ts.s, act[n]), 0);
			break;
		}
		memset(p, 0, 8 << 10);
	}
	assert_int_equal(tier_cache_check(c), 0);
	assert_int_equal(backward_via_cache(c, key, &l, dX[1], dW[1]), 0); /* a miss: recomputed */
	assert_memory_equal(dX[0], dX[1], sizeof(float) * nx);
	assert_memory_equal(dW[0], dW[1], sizeof(float) * nw);
	tier_cache_stats st;
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.kind[TIER_OP_MATMUL].lost, 1);
	assert_int_equal(st.kind[TIER_OP_MATMUL].misses, 1);
	assert_int_equal(st.used[0], 0);
	for (int i = 0; i < n; i++) {
		assert_int_equal(tier_release(ts.s, act[i], TIER_HBM, 1), 0);
		assert_int_equal(tier_obj_destroy(ts.s, act[i]), 0);
	}
	assert_int_equal(tier_cache_end_microbatch(c, 7), 0);
	close_cache(&ts, c);
	for (int i = 0; i < 2; i++) {
		free(dX[i]);
		free(dW[i]);
	}
	free(Z);
	layer_free(&l);
}

/* ---- Randomized: budgets never exceeded, every hit holds the bytes offered -------------------- */
static uint64_t key_seed(tier_cache_key k) { return (uint64_t)k.layer << 40 ^ (uint64_t)k.op << 20 ^ k.microbatch; }

/* A hit on key holds the pattern of key_seed(key) over its bytes, and is released as done: 1 on
 * a hit, 0 on a miss. */
static int hit_holds_pattern(tier_cache *c, tier_cache_key key, uint64_t bytes)
{
	void *p;
	int rc = tier_cache_get(c, key, &p);
	assert_true(rc == 0 || rc == 1);
	if (rc)
		return 0;
	assert_int_equal(tier_pattern_check(p, bytes, key_seed(key), 0), bytes);
	assert_int_equal(tier_cache_release(c, key, 1), 0);
	return 1;
}

static void test_random_budgets(void **state)
{
	tier_rng r;
	tier_rng_seed(&r, test_seed("random budgets"));
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e10, 2e9);
	open_cache(&ts, &c, 512 << 10, 2 << 20, "matmul,grouped_gemm:layers=0-15:hbm=160K:ddr=640K;attention:layers=0-15/2",
		   &rates);
	static unsigned char buf[40000];
	static uint64_t size[16][3];
	tier_object *pressure = NULL;
	for (int step = 0; step < 6; step++) {
		uint32_t mb = step % 2;
		for (uint32_t layer = 0; layer < 16; layer++) /* forward */
			for (uint32_t op = 0; op < 3; op++) {
				tier_cache_key key = { layer, op, mb };
				uint64_t bytes = size[layer][op] = 1 + tier_rng_below(&r, sizeof buf);
				tier_op_cost cost = { (tier_op_kind)tier_rng_below(&r, TIER_NOPKINDS),
						      tier_rng_uniform(&r) * 1e6, tier_rng_uniform(&r) * 1e5, 0 };
				tier_pattern_fill(buf, bytes, key_seed(key), 0);
				assert_int_equal(tier_cache_offer(c, key, buf, bytes, &cost, NULL, NULL), 0);
				assert_int_equal(tier_cache_check(c), 0);
				if (tier_rng_below(&r, 8) == 0 && !pressure) { /* other data claims HBM */
					void *p;
					assert_int_equal(tier_obj_create(ts.s, 300 << 10, TIER_CLASS_ACT, 0, &pressure), 0);
					assert_int_equal(tier_acquire(ts.s, pressure, TIER_HBM, TIER_ACQ_INIT, &p, NULL), 0);
					assert_int_equal(tier_release(ts.s, pressure, TIER_HBM, 1), 0);
				} else if (pressure && tier_rng_below(&r, 4) == 0) {
					assert_int_equal(tier_obj_destroy(ts.s, pressure), 0);
					pressure = NULL;
				}
				assert_int_equal(tier_cache_check(c), 0);
			}
		for (int layer = 15; layer >= 0; layer--) { /* backward */
			tier_cache_prefetch_backward(c, (uint32_t)layer, mb);
			assert_int_equal(tier_cache_check(c), 0);
			for (uint32_t op = 0; op < 3; op++) {
				tier_cache_key key = { (uint32_t)layer, op, mb };
				void *p;
				int rc = tier_cache_get(c, key, &p);
				assert_true(rc == 0 || rc == 1);
				if (rc == 0) {
					uint64_t n = size[layer][op];
					assert_int_equal(tier_pattern_check(p, n, key_seed(key), 0), n);
					assert_int_equal(tier_cache_release(c, key, 1), 0);
					rc = tier_cache_get(c, key, &p);
					assert_int_equal(rc, 1); /* done: freed */
				}
				assert_int_equal(tier_cache_check(c), 0);
			}
		}
		assert_true(tier_cache_end_microbatch(c, mb) >= 0);
		assert_int_equal(tier_cache_check(c), 0);
	}
	tier_cache_stats st;
	tier_cache_stats_get(c, &st);
	assert_true(st.peak[0] <= st.budget[0] && st.peak[1] <= st.budget[1]);
	assert_true(st.total.hits[0] + st.total.hits[1] > 0);
	assert_int_equal(st.total.offers, 6 * 16 * 3);
	printf("# random: %" PRIu64 " offers, %" PRIu64 "/%" PRIu64 " admitted hbm/ddr, %" PRIu64 "/%" PRIu64
	       " hits, %" PRIu64 " misses, %" PRIu64 " lost, peak %" PRIu64 "/%" PRIu64 " bytes\n",
	       st.total.offers, st.total.admitted[0], st.total.admitted[1], st.total.hits[0], st.total.hits[1],
	       st.total.misses, st.total.lost, st.peak[0], st.peak[1]);
	if (pressure)
		assert_int_equal(tier_obj_destroy(ts.s, pressure), 0);
	close_cache(&ts, c);
}

/* Many entries of random sizes and values, gets in reverse order: every hit has the bytes offered. */
static void test_hit_content(void **state)
{
	tier_rng r;
	tier_rng_seed(&r, test_seed("hit content"));
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e10, 2e9);
	open_cache(&ts, &c, 256 << 10, 1 << 20, "all:hbm=64K:ddr=256K", &rates);
	static unsigned char buf[20000];
	uint64_t size[40];
	for (uint32_t op = 0; op < 40; op++) {
		tier_cache_key key = { op % 5, op, 0 };
		uint64_t bytes = size[op] = 1 + tier_rng_below(&r, sizeof buf);
		tier_op_cost cost = { TIER_OP_GROUPED_GEMM, tier_rng_uniform(&r) * 1e6, 0, 0 };
		tier_pattern_fill(buf, bytes, key_seed(key), 0);
		assert_int_equal(tier_cache_offer(c, key, buf, bytes, &cost, NULL, NULL), 0);
	}
	for (int op = 39; op >= 0; op--) {
		tier_cache_key key = { (uint32_t)op % 5, (uint32_t)op, 0 };
		(void)hit_holds_pattern(c, key, size[op]);
		assert_int_equal(tier_cache_check(c), 0);
	}
	close_cache(&ts, c);
}

/* Asynchronous offers (the pipelined trainer's): an admitted entry stays pinned until
 * tier_cache_offer_done: get says -EBUSY and how to go on, it is never a victim (later offers that
 * need its room are dropped or spill), ending the micro-batch says -EBUSY; once done it is
 * gettable with the offered bytes. Not admitted: done is a no-op; never offered: -EINVAL. */
static void test_offer_async(void **state)
{
	(void)state;
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e10, 2e9);
	open_cache(&ts, &c, 256 << 10, 1 << 20, "all:hbm=64K:ddr=64K", &rates);
	static unsigned char buf[48 << 10];
	tier_op_cost cost = { TIER_OP_GROUPED_GEMM, 1e9, 0, 0 };
	tier_cache_key k0 = { 0, 0, 0 }, k1 = { 0, 1, 0 }, k2 = { 1, 0, 0 }, kx = { 9, 9, 9 };
	tier_id where;
	tier_pattern_fill(buf, sizeof buf, key_seed(k0), 0);
	assert_int_equal(tier_cache_offer_async(c, k0, buf, sizeof buf, &cost, NULL, &where), 0);
	assert_int_equal(where, TIER_HBM);
	assert_int_equal(tier_cache_check(c), 0);
	void *p;
	assert_int_equal(tier_cache_get(c, k0, &p), -EBUSY);
	assert_non_null(strstr(tier_last_error(), "tier_cache_offer_done"));
	/* a more valuable offer cannot take the held entry's HBM room */
	tier_op_cost dear = { TIER_OP_GROUPED_GEMM, 1e12, 0, 0 };
	tier_pattern_fill(buf, sizeof buf, key_seed(k1), 0);
	assert_int_equal(tier_cache_offer_async(c, k1, buf, sizeof buf, &dear, NULL, &where), 0);
	assert_true(where != TIER_HBM);
	assert_int_equal(tier_cache_check(c), 0);
	assert_int_equal(tier_cache_end_microbatch(c, 0), -EBUSY);
	/* not admitted by the rules' budgets: nothing is held */
	tier_pattern_fill(buf, sizeof buf, key_seed(k2), 0);
	assert_int_equal(tier_cache_offer_async(c, k2, buf, sizeof buf, &cost, NULL, &where), 0);
	assert_int_equal(tier_cache_offer_done(c, k0), 0);
	assert_int_equal(tier_cache_offer_done(c, k1), 0);
	assert_int_equal(tier_cache_offer_done(c, k2), 0);
	assert_int_equal(tier_cache_offer_done(c, kx), -EINVAL);
	assert_int_equal(tier_cache_check(c), 0);
	tier_cache_key ks[3] = { k0, k1, k2 };
	for (int i = 0; i < 3; i++)
		if (!hit_holds_pattern(c, ks[i], sizeof buf))
			assert_int_equal(i, 2); /* only the last may have been dropped */
	assert_int_equal(tier_cache_check(c), 0);
	close_cache(&ts, c);
}

/* Reservations (the pipelined trainer's forward writes its output into the entry): in HBM a
 * pointer to write, read back by get after done; in DDR no pointer, the bytes handed over by fill
 * (once: a second fill is refused); not admitted: no pointer, fill and done do nothing; unknown
 * keys and a NULL source are refused; a key reserved twice says -EEXIST; a reservation dropped
 * (its operator failed) misses. */
static void test_reserve(void **state)
{
	(void)state;
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e10, 2e9);
	open_cache(&ts, &c, 256 << 10, 1 << 20, "all:hbm=64K:ddr=64K", &rates);
	static unsigned char buf[40 << 10];
	tier_op_cost cost = { TIER_OP_GROUPED_GEMM, 1e9, 0, 0 };
	tier_cache_key k0 = { 0, 0, 0 }, k1 = { 0, 1, 0 }, k2 = { 1, 0, 0 }, kx = { 9, 9, 9 };
	tier_id where;
	void *at, *p;
	assert_int_equal(tier_cache_reserve(c, k0, sizeof buf, &cost, &at, &where), 0);
	assert_int_equal(where, TIER_HBM);
	assert_non_null(at);
	tier_pattern_fill(at, sizeof buf, key_seed(k0), 0); /* the operator writes in place */
	assert_int_equal(tier_cache_reserve(c, k0, sizeof buf, &cost, &at, &where), -EEXIST);
	assert_int_equal(tier_cache_reserve(c, k1, sizeof buf, &cost, &at, &where), 0);
	assert_int_equal(where, TIER_DDR); /* k0 is held: no room in HBM */
	assert_null(at);
	tier_pattern_fill(buf, sizeof buf, key_seed(k1), 0);
	assert_int_equal(tier_cache_offer_fill(c, k1, NULL, NULL), -EINVAL);
	assert_int_equal(tier_cache_offer_fill(c, k1, buf, NULL), 0);
	assert_int_equal(tier_cache_offer_fill(c, k1, buf, NULL), -EINVAL); /* filled already */
	assert_non_null(strstr(tier_last_error(), "filled already"));
	assert_int_equal(tier_cache_reserve(c, k2, sizeof buf, &cost, &at, &where), 0);
	assert_int_equal(where, TIER_NTIERS); /* both budgets taken */
	assert_null(at);
	assert_int_equal(tier_cache_offer_fill(c, k2, buf, NULL), 0);
	assert_int_equal(tier_cache_offer_fill(c, kx, buf, NULL), -EINVAL);
	assert_int_equal(tier_cache_check(c), 0);
	assert_int_equal(tier_cache_get(c, k0, &p), -EBUSY);
	tier_cache_key ks[3] = { k0, k1, k2 };
	for (int i = 0; i < 3; i++)
		assert_int_equal(tier_cache_offer_done(c, ks[i]), 0);
	assert_int_equal(tier_cache_check(c), 0);
	for (int i = 0; i < 2; i++)
		assert_int_equal(hit_holds_pattern(c, ks[i], sizeof buf), 1);
	assert_int_equal(tier_cache_get(c, k2, &p), 1); /* not admitted: recompute */
	assert_int_equal(tier_cache_check(c), 0);
	/* a reservation whose operator failed is dropped: a get misses */
	tier_cache_key k3 = { 2, 0, 0 };
	assert_int_equal(tier_cache_reserve(c, k3, sizeof buf, &cost, &at, &where), 0);
	assert_int_equal(where, TIER_HBM);
	assert_int_equal(tier_cache_offer_drop(c, k3), 0);
	assert_int_equal(tier_cache_offer_drop(c, k3), 0); /* nothing held any more */
	assert_int_equal(tier_cache_offer_drop(c, kx), -EINVAL);
	assert_int_equal(tier_cache_check(c), 0);
	assert_int_equal(tier_cache_get(c, k3, &p), 1);
	assert_int_equal(tier_cache_check(c), 0);
	close_cache(&ts, c);
}

/* An overlapped offer (its copies beside the caller's compute) goes to DDR first, though HBM has
 * room and its round trip (41 us) costs more than its recompute (10 us), which drops the same
 * offer unmarked once HBM is full; tier_cache_offer_target hands the caller the entry's memory
 * once; tier_cache_get_home pins it in DDR, and a get brings it back. */
static void test_overlapped(void **state)
{
	(void)state;
	test_store ts;
	tier_cache *c;
	tier_cache_rates rates = fixed_rates(1e9, 1e10, 2e9);
	open_cache(&ts, &c, 256 << 10, 1 << 20, "all:hbm=64K:ddr=128K", &rates);
	const uint64_t n = 40 << 10;
	tier_op_cost cheap = { TIER_OP_ATTENTION, 1e4, 0, 0 }, ov = cheap;
	ov.overlapped = 1;
	tier_cache_key k0 = { 0, 2, 0 }, k1 = { 1, 2, 0 }, k2 = { 2, 2, 0 }, kx = { 9, 9, 9 };
	tier_id where;
	void *at, *dst;
	assert_int_equal(tier_cache_reserve(c, k0, n, &ov, &at, &where), 0);
	assert_int_equal(where, TIER_DDR);
	assert_null(at);
	assert_int_equal(tier_cache_offer_target(c, k0, &dst), 0);
	assert_non_null(dst);
	tier_pattern_fill(dst, n, key_seed(k0), 0); /* the caller's own copy */
	assert_int_equal(tier_cache_offer_target(c, k0, &dst), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "filled already"));
	assert_int_equal(tier_cache_reserve(c, k1, n, &cheap, &at, &where), 0);
	assert_int_equal(where, TIER_HBM);
	tier_pattern_fill(at, n, key_seed(k1), 0);
	assert_int_equal(tier_cache_reserve(c, k2, n, &cheap, &at, &where), 0);
	assert_int_equal(where, TIER_NTIERS); /* HBM held, DDR not worth it unmarked */
	assert_int_equal(tier_cache_offer_target(c, k2, &dst), 0);
	assert_null(dst);
	assert_int_equal(tier_cache_offer_target(c, kx, &dst), -EINVAL);
	assert_int_equal(tier_cache_offer_target(c, k0, NULL), -EINVAL);
	tier_cache_key ks[3] = { k0, k1, k2 };
	for (int i = 0; i < 3; i++)
		assert_int_equal(tier_cache_offer_done(c, ks[i]), 0);
	assert_int_equal(tier_cache_check(c), 0);
	/* get_home: pinned in DDR where it lives, nothing fetched (HBM stays as it was) */
	void *p;
	tier_id at_tier;
	assert_int_equal(tier_cache_get_home(c, k0, &p, &at_tier), 0);
	assert_int_equal(at_tier, TIER_DDR);
	assert_int_equal(tier_pattern_check(p, n, key_seed(k0), 0), n);
	assert_int_equal(tier_cache_get_home(c, k0, &p, &at_tier), -EBUSY);
	assert_int_equal(tier_cache_get(c, k0, &p), -EBUSY);
	assert_int_equal(tier_cache_check(c), 0);
	assert_int_equal(tier_cache_release(c, k0, 0), 0); /* kept: a get can still bring it in */
	assert_int_equal(hit_holds_pattern(c, k1, n), 1); /* freed: room for k0's fetch */
	assert_int_equal(hit_holds_pattern(c, k0, n), 1);
	assert_int_equal(tier_cache_get(c, k2, &p), 1);
	assert_int_equal(tier_cache_get_home(c, k2, &p, &at_tier), 1);
	assert_int_equal(tier_cache_get_home(c, kx, &p, &at_tier), 1);
	assert_int_equal(tier_cache_get_home(c, kx, NULL, &at_tier), -EINVAL);
	tier_cache_stats st;
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.kind[TIER_OP_ATTENTION].hits[1], 2);
	assert_int_equal(tier_cache_check(c), 0);
	close_cache(&ts, c);
}

/* ---- Rules ------------------------------------------------------------------------------------ */
static void test_rules_good(void **state)
{
	tier_cache_config cfg;
	assert_int_equal(tier_cache_config_parse("matmul,grouped_gemm:layers=0-47:hbm=2G:ddr=8G", &cfg), 0);
	assert_int_equal(cfg.n_rules, 1);
	assert_int_equal(cfg.rules[0].kinds, 1u << TIER_OP_MATMUL | 1u << TIER_OP_GROUPED_GEMM);
	assert_int_equal(cfg.budget[0], 2ull << 30);
	assert_int_equal(cfg.budget[1], 8ull << 30);
	assert_int_equal(cfg.policy, TIER_CACHE_VALUE);
	assert_true(tier_cache_rules_match(&cfg, TIER_OP_MATMUL, 47));
	assert_false(tier_cache_rules_match(&cfg, TIER_OP_MATMUL, 48));
	assert_false(tier_cache_rules_match(&cfg, TIER_OP_ATTENTION, 3));

	assert_int_equal(tier_cache_config_parse("attention:layers=3-11/4,20;matmul policy=fcfs", &cfg), 0);
	assert_int_equal(cfg.n_rules, 2);
	assert_int_equal(cfg.policy, TIER_CACHE_FCFS);
	assert_int_equal(cfg.budget[0], 0);
	assert_true(tier_cache_rules_match(&cfg, TIER_OP_ATTENTION, 7));
	assert_false(tier_cache_rules_match(&cfg, TIER_OP_ATTENTION, 8));
	assert_true(tier_cache_rules_match(&cfg, TIER_OP_ATTENTION, 20));
	assert_true(tier_cache_rules_match(&cfg, TIER_OP_MATMUL, 1000));
	assert_false(tier_cache_rules_match(&cfg, TIER_OP_NORM, 1));

	assert_int_equal(tier_cache_config_parse("all:layers=all:hbm=1M;policy=off", &cfg), 0);
	for (int k = 0; k < TIER_NOPKINDS; k++)
		assert_true(tier_cache_rules_match(&cfg, (tier_op_kind)k, 12345));
	assert_int_equal(cfg.policy, TIER_CACHE_OFF);
	assert_int_equal(tier_cache_config_parse("", &cfg), 0);
	assert_int_equal(cfg.n_rules, 0);
	assert_false(tier_cache_rules_match(&cfg, TIER_OP_MATMUL, 0));
}

static void test_rules_bad(void **state)
{
	static const char *const bad[] = {
		"foo",                     /* unknown kind */
		"matmul:layers=5-3",       /* reversed range */
		"matmul:layers=1-4/0",     /* zero stride */
		"matmul:layers=x",         /* not a number */
		"matmul:layers=",          /* empty */
		"matmul:layers=1-2-3",     /* trailing text */
		"layers=1-2",              /* layers without kinds */
		"matmul:hbm=12Q",          /* bad size */
		"matmul:policy=lru",       /* unknown policy */
		"matmul:bogus=1",          /* unknown field */
		"matmul:attention",        /* kinds twice in one rule */
		"matmul,,foo",             /* unknown kind in a list */
		"matmul:layers=0,1,2,3,4,5,6,7,8", /* too many ranges */
	};
	for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
		tier_cache_config cfg, before;
		memset(&cfg, 0x3c, sizeof cfg);
		before = cfg;
		tier_clear_error();
		assert_int_equal(tier_cache_config_parse(bad[i], &cfg), -EINVAL);
		assert_true(strstr(tier_last_error(), "op-cache rules") != NULL);
		assert_memory_equal(&cfg, &before, sizeof cfg); /* unchanged */
	}
	char many[512] = "";
	for (int i = 0; i <= TIER_CACHE_MAX_RULES; i++)
		strcat(many, "matmul;");
	tier_cache_config cfg;
	assert_int_equal(tier_cache_config_parse(many, &cfg), -EINVAL);
	assert_int_equal(tier_cache_config_parse(NULL, &cfg), -EINVAL);
	tier_op_kind k;
	assert_int_equal(tier_op_kind_parse("grouped_gemm", &k), 0);
	assert_int_equal(k, TIER_OP_GROUPED_GEMM);
	assert_int_equal(tier_op_kind_parse("gemm", &k), -EINVAL);
}

/* ---- Bad input -------------------------------------------------------------------------------- */
static void test_bad_input(void **state)
{
	test_store ts;
	tier_cache *c;
	tier_cache_config cfg;
	assert_int_equal(test_store_open(&ts, TIER_POLICY_LRU, 1 << 20, 1 << 20, 0, 0), 0);
	assert_int_equal(tier_cache_config_parse("matmul:hbm=2M", &cfg), 0);
	assert_int_equal(tier_cache_create(&c, ts.s, NULL, &cfg, NULL), -EINVAL); /* budget above the tier */
	assert_null(c);
	assert_int_equal(tier_cache_config_parse("matmul:hbm=64K:ddr=64K", &cfg), 0);
	tier_cache_rates bad_rates = fixed_rates(0, 1, 1);
	assert_int_equal(tier_cache_create(&c, ts.s, NULL, &cfg, &bad_rates), -EINVAL);
	cfg.policy = (tier_cache_policy)7;
	assert_int_equal(tier_cache_create(&c, ts.s, NULL, &cfg, NULL), -EINVAL);
	cfg.policy = TIER_CACHE_VALUE;
	assert_int_equal(tier_cache_create(&c, ts.s, NULL, &cfg, NULL), 0);

	char buf[256] = { 0 };
	tier_cache_key key = { 1, 2, 3 };
	tier_op_cost cost = { TIER_OP_MATMUL, 1e6, 0, 0 };
	tier_op_cost bad_kind = { (tier_op_kind)99, 1e6, 0, 0 }, nan_cost = { TIER_OP_MATMUL, NAN, 0, 0 };
	assert_int_equal(tier_cache_offer(c, key, NULL, sizeof buf, &cost, NULL, NULL), -EINVAL);
	assert_int_equal(tier_cache_offer(c, key, buf, 0, &cost, NULL, NULL), -EINVAL);
	assert_int_equal(tier_cache_offer(c, key, buf, sizeof buf, &bad_kind, NULL, NULL), -EINVAL);
	assert_int_equal(tier_cache_offer(c, key, buf, sizeof buf, &nan_cost, NULL, NULL), -EINVAL);
	assert_int_equal(tier_cache_offer(c, key, buf, sizeof buf, NULL, NULL, NULL), -EINVAL);
	tier_id got;
	assert_int_equal(tier_cache_offer(c, key, buf, sizeof buf, &cost, NULL, &got), 0);
	assert_int_equal(got, TIER_HBM);
	assert_int_equal(tier_cache_offer(c, key, buf, sizeof buf, &cost, NULL, NULL), -EEXIST);
	assert_int_equal(tier_cache_release(c, key, 0), -EINVAL); /* not held */
	void *p;
	assert_int_equal(tier_cache_get(c, key, &p), 0);
	assert_int_equal(tier_cache_get(c, key, &p), -EBUSY);
	assert_int_equal(tier_cache_end_microbatch(c, 3), -EBUSY);
	assert_int_equal(tier_cache_release(c, key, 0), 0);
	assert_int_equal(tier_cache_get(c, key, NULL), -EINVAL);
	tier_cache_key other = { 9, 9, 9 };
	assert_int_equal(tier_cache_get(c, other, &p), 1); /* never offered */
	assert_null(p);
	tier_op_cost attn = { TIER_OP_ATTENTION, 1e9, 0, 0 };
	assert_int_equal(tier_cache_offer(c, other, buf, sizeof buf, &attn, NULL, &got), 0);
	assert_int_equal(got, TIER_NTIERS); /* no rule for attention */
	tier_cache_stats st;
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.kind[TIER_OP_ATTENTION].rejected, 1);
	assert_int_equal(tier_cache_end_microbatch(c, 3), 1);
	assert_int_equal(tier_cache_end_microbatch(c, UINT32_MAX), 0);
	tier_cache_stats_get(c, &st);
	assert_int_equal(st.entries, 0);
	assert_int_equal(st.used[0], 0);
	close_cache(&ts, c);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hit_equals_recompute),
		cmocka_unit_test(test_evict_low_density),
		cmocka_unit_test(test_evicted_before_backward),
		cmocka_unit_test(test_random_budgets),
		cmocka_unit_test(test_hit_content),
		cmocka_unit_test(test_offer_async),
		cmocka_unit_test(test_reserve),
		cmocka_unit_test(test_overlapped),
		cmocka_unit_test(test_rules_good),
		cmocka_unit_test(test_rules_bad),
		cmocka_unit_test(test_bad_input),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
