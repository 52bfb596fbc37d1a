/* test_store_threads.c - threads acquiring, releasing, prefetching and migrating shared and
 * private objects at once: every byte read matches its pattern, and the invariants hold. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "store_util.h"

void offload_hold(tier_offload *off, int on); /* internal: the worker threads start no transfer while on */

#define NTHREADS 4
#define NFROZEN 12
#define NSHARED 6
#define NPRIV 10

typedef struct {
	tier_object *o;
	uint64_t version;
	pthread_mutex_t mu; /* the callers' own rule for writable shared data: one writer at a time */
} shared_obj;

static tier_store *S;
static tier_object *frozen[NFROZEN];
static shared_obj shared[NSHARED];
static uint64_t n_ops;

typedef struct {
	int id;
	uint64_t seed;
	tier_object *priv[NPRIV];
	uint64_t ver[NPRIV];
	int errors;
	char msg[256];
} worker;

static uint64_t fseed(int i) { return 5000 + (uint64_t)i; }
static uint64_t sseed(int i, uint64_t v) { return 6000 + (uint64_t)i * 1000 + v; }
static uint64_t pseed(int w, int i, uint64_t v) { return 100000 + (uint64_t)w * 10000 + (uint64_t)i * 1000 + v; }

static int bad(worker *w, const char *what, int rc)
{
	if (!w->errors++)
		snprintf(w->msg, sizeof w->msg, "thread %d: %s: %d %s", w->id, what, rc, tier_last_error());
	return -1;
}

/* Acquire, check the pattern, maybe rewrite with the next version, release. */
static int use(worker *w, tier_object *o, uint64_t *version, uint64_t (*seed)(uint64_t, void *), void *arg,
	       int may_write, tier_rng *r)
{
	tier_id t = tier_rng_below(r, 2) ? TIER_HBM : TIER_DDR;
	void *addr;
	tier_fence *f = NULL;
	int rc = tier_acquire(S, o, t, 0, &addr, tier_rng_below(r, 2) ? &f : NULL);
	if (rc)
		return bad(w, "acquire", rc);
	if (f) {
		rc = tier_fence_wait(f);
		tier_fence_put(f);
		if (rc)
			return bad(w, "fence", rc);
	}
	size_t n = tier_obj_size(o);
	if (tier_pattern_check(addr, n, seed(*version, arg), 0) != n)
		bad(w, "content differs", 0);
	int dirty = may_write && tier_rng_below(r, 3) == 0;
	if (dirty) {
		++*version;
		tier_pattern_fill(addr, n, seed(*version, arg), 0);
	}
	if ((rc = tier_release(S, o, t, dirty)))
		return bad(w, "release", rc);
	return 0;
}

static uint64_t frozen_seed(uint64_t v, void *arg) { (void)v; return fseed((int)(intptr_t)arg); }
static uint64_t shared_seed(uint64_t v, void *arg) { return sseed((int)(intptr_t)arg, v); }
typedef struct { int w, i; } pkey;
static uint64_t priv_seed(uint64_t v, void *arg) { const pkey *k = arg; return pseed(k->w, k->i, v); }

static void *run(void *arg)
{
	worker *w = arg;
	tier_rng r;
	tier_rng_seed(&r, w->seed);
	for (uint64_t k = 0; k < n_ops && !w->errors; k++) {
		uint64_t p = tier_rng_below(&r, 100);
		if (p < 35) {
			int i = (int)tier_rng_below(&r, NFROZEN);
			uint64_t v = 0;
			use(w, frozen[i], &v, frozen_seed, (void *)(intptr_t)i, 0, &r);
		} else if (p < 55) {
			int i = (int)tier_rng_below(&r, NSHARED);
			pthread_mutex_lock(&shared[i].mu);
			use(w, shared[i].o, &shared[i].version, shared_seed, (void *)(intptr_t)i, 1, &r);
			pthread_mutex_unlock(&shared[i].mu);
		} else if (p < 80) {
			int i = (int)tier_rng_below(&r, NPRIV);
			pkey key = { w->id, i };
			use(w, w->priv[i], &w->ver[i], priv_seed, &key, 1, &r);
		} else if (p < 92) {
			tier_object *o = tier_rng_below(&r, 2) ? frozen[tier_rng_below(&r, NFROZEN)] : w->priv[tier_rng_below(&r, NPRIV)];
			int rc = tier_prefetch(S, o, tier_rng_below(&r, 2) ? TIER_HBM : TIER_DDR);
			if (rc != 0 && rc != 1)
				bad(w, "prefetch", rc);
		} else if (p < 97) {
			int rc = tier_migrate(S, w->priv[tier_rng_below(&r, NPRIV)], (tier_id)tier_rng_below(&r, TIER_NTIERS));
			if (rc != 0 && rc != -ENOSPC)
				bad(w, "migrate", rc);
		} else if (p < 98) {
			tier_store_step(S);
		} else {
			tier_stats st;
			tier_store_stats(S, &st);
			if (st.tier[TIER_HBM].used > st.tier[TIER_HBM].capacity)
				bad(w, "hbm over budget", 0);
		}
	}
	return NULL;
}

static tier_object *mk_filled(uint64_t size, unsigned flags, uint64_t seed)
{
	tier_object *o;
	void *addr;
	assert_int_equal(tier_obj_create(S, size, TIER_CLASS_EXPERT, flags, &o), 0);
	assert_int_equal(tier_acquire(S, o, TIER_DDR, TIER_ACQ_INIT, &addr, NULL), 0);
	tier_pattern_fill(addr, size, seed, 0);
	assert_int_equal(tier_release(S, o, TIER_DDR, 1), 0);
	return o;
}

static void test_threads(void **state)
{
	static worker w[NTHREADS];
	pthread_t th[NTHREADS];
	test_store ts;
	tier_rng r;
	uint64_t seed = tier_now_ns();
	(void)state;
	n_ops = getenv("TIER_VALGRIND") && atoi(getenv("TIER_VALGRIND")) ? 400 : 4000;
	printf("# seed %" PRIu64 ", %d threads x %" PRIu64 " ops\n", seed, NTHREADS, n_ops);
	tier_rng_seed(&r, seed);
	assert_int_equal(test_store_open(&ts, (tier_policy_kind)(seed % TIER_NPOLICIES), 1u << 20, 2u << 20, 16u << 20, 1), 0);
	S = ts.s;
	for (int i = 0; i < NFROZEN; i++)
		frozen[i] = mk_filled(4096 + tier_rng_below(&r, 60000), TIER_OBJ_FROZEN, fseed(i));
	for (int i = 0; i < NSHARED; i++) {
		shared[i].o = mk_filled(1 + tier_rng_below(&r, 50000), 0, sseed(i, 0));
		shared[i].version = 0;
		pthread_mutex_init(&shared[i].mu, NULL);
	}
	for (int t = 0; t < NTHREADS; t++) {
		memset(&w[t], 0, sizeof w[t]);
		w[t].id = t;
		w[t].seed = seed + 17 * (uint64_t)t;
		for (int i = 0; i < NPRIV; i++)
			w[t].priv[i] = mk_filled(1 + tier_rng_below(&r, 40000), 0, pseed(t, i, 0));
	}
	for (int t = 0; t < NTHREADS; t++)
		assert_int_equal(pthread_create(&th[t], NULL, run, &w[t]), 0);
	for (int t = 0; t < NTHREADS; t++)
		pthread_join(th[t], NULL);
	for (int t = 0; t < NTHREADS; t++)
		if (w[t].errors)
			fail_msg("%s (%d errors)", w[t].msg, w[t].errors);
	assert_int_equal(tier_store_check(S), 0);
	/* Everything still reads back as last written, from HBM. */
	void *addr;
	for (int t = 0; t < NTHREADS; t++)
		for (int i = 0; i < NPRIV; i++) {
			tier_object *o = w[t].priv[i];
			assert_int_equal(tier_acquire(S, o, TIER_HBM, 0, &addr, NULL), 0);
			assert_int_equal(tier_pattern_check(addr, tier_obj_size(o), pseed(t, i, w[t].ver[i]), 0), tier_obj_size(o));
			assert_int_equal(tier_release(S, o, TIER_HBM, 0), 0);
		}
	for (int i = 0; i < NSHARED; i++) {
		assert_int_equal(tier_acquire(S, shared[i].o, TIER_HBM, 0, &addr, NULL), 0);
		assert_int_equal(tier_pattern_check(addr, tier_obj_size(shared[i].o), sseed(i, shared[i].version), 0),
				 tier_obj_size(shared[i].o));
		assert_int_equal(tier_release(S, shared[i].o, TIER_HBM, 0), 0);
		pthread_mutex_destroy(&shared[i].mu);
	}
	tier_stats st;
	tier_store_stats(S, &st);
	uint64_t pins = 0;
	for (int t = 0; t < TIER_NTIERS; t++)
		pins += st.tier[t].pinned;
	assert_int_equal(pins, 0);
	assert_int_equal(tier_store_check(S), 0);
	test_store_close(&ts);
}

typedef struct {
	tier_store *s;
	tier_object *o;
} unhold_arg;

/* Lift the hold once the main thread's acquire has pinned the DDR copy: then the acquire either
 * returned (sharing the transfer) or waits for it without the lock, whatever the scheduling. */
static void *unhold_when_pinned(void *p)
{
	unhold_arg *a = p;
	while (tier_obj_pins(a->s, a->o, TIER_DDR) == 0)
		sched_yield();
	offload_hold(tier_store_offload(a->s), 0);
	return NULL;
}

/* A prefetch still in flight when the object is rewritten carries the old version: an acquire with
 * a fence must not share it (CI once read a stale DDR copy this way, lfu, "differs at byte 0 in
 * ddr"). The workers are held so that the prefetch is in flight at the rewrite and the acquire. */
static void test_stale_prefetch_not_shared(void **state)
{
	enum { SIZE = 5114 };
	char dir[256];
	const char *dirs[1] = { dir };
	tier_offload_config oc = { .no_uring = 1 }; /* file reads on the workers, which can be held */
	tier_store_config cfg = { .capacity = { 1u << 20, 1u << 20, 8u << 20 }, .nvme_dirs = dirs, .n_nvme_dirs = 1,
				  .policy = TIER_POLICY_LFU, .offload_config = &oc };
	tier_store *s;
	tier_object *o;
	void *addr, *hbm;
	tier_fence *f = NULL;
	(void)state;
	assert_int_equal(test_tmpdir(dir, sizeof dir), 0);
	assert_int_equal(tier_store_create(&s, &cfg), 0);
	assert_int_equal(tier_obj_create(s, SIZE, TIER_CLASS_EXPERT, 0, &o), 0);
	assert_int_equal(tier_acquire(s, o, TIER_HBM, TIER_ACQ_INIT, &addr, NULL), 0);
	tier_pattern_fill(addr, SIZE, 1, 0);
	assert_int_equal(tier_release(s, o, TIER_HBM, 1), 0);
	assert_int_equal(tier_migrate(s, o, TIER_NVME), 0); /* version 1 in NVMe only */
	assert_int_equal(tier_acquire(s, o, TIER_HBM, 0, &hbm, NULL), 0); /* held for writing */
	offload_hold(tier_store_offload(s), 1);
	assert_int_equal(tier_prefetch(s, o, TIER_DDR), 0); /* reads version 1 from NVMe, held */
	tier_pattern_fill(hbm, SIZE, 2, 0);
	assert_int_equal(tier_release(s, o, TIER_HBM, 1), 0); /* version 2: the prefetch is stale */
	pthread_t th;
	unhold_arg a = { s, o };
	assert_int_equal(pthread_create(&th, NULL, unhold_when_pinned, &a), 0);
	int rc = tier_acquire(s, o, TIER_DDR, 0, &addr, &f);
	pthread_join(th, NULL);
	assert_int_equal(rc, 0);
	if (f) {
		assert_int_equal(tier_fence_wait(f), 0);
		tier_fence_put(f);
	}
	size_t good = tier_pattern_check(addr, SIZE, 2, 0);
	if (good != SIZE)
		fail_msg("the DDR copy differs from version 2 at byte %zu (%s)", good,
			 tier_pattern_check(addr, SIZE, 1, 0) == SIZE ? "it is version 1: the stale prefetch was shared" : "garbage");
	assert_int_equal(tier_release(s, o, TIER_DDR, 0), 0);
	assert_int_equal(tier_store_check(s), 0);
	tier_store_destroy(s);
	assert_int_equal(rmdir(dir), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_threads),
		cmocka_unit_test(test_stale_prefetch_not_shared),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
