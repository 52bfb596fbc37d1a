/* store_util.h - helpers shared by the store tests: a temporary NVMe directory and a store. */
#ifndef TIER_TESTS_STORE_UTIL_H
#define TIER_TESTS_STORE_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tier/tier.h"

typedef struct {
	char dir[256];
	const char *dirs[1];
	tier_store *s;
} test_store;

/* A fresh directory under $TMPDIR (or the system's temporary directory). */
static inline int test_tmpdir(char *buf, size_t len)
{
	const char *base = getenv("TMPDIR");
	snprintf(buf, len, "%s/tier-store-test.XXXXXX", base && *base ? base : P_tmpdir);
	return mkdtemp(buf) ? 0 : -1;
}

/* Under valgrind the movers use worker threads for file I/O: valgrind does not follow io_uring's
 * shared rings, and the completion thread then spins forever. */
static inline const tier_offload_config *test_offload_config(void)
{
	static tier_offload_config oc;
	const char *vg = getenv("TIER_VALGRIND");
	oc.no_uring = vg && atoi(vg) ? 1 : 0;
	return &oc;
}

/* Create a store over HBM/DDR/NVMe budgets (nvme 0: no NVMe tier). Returns the store's result. */
static inline int test_store_open(test_store *ts, tier_policy_kind pol, uint64_t hbm, uint64_t ddr, uint64_t nvme,
				  int checksum)
{
	memset(ts, 0, sizeof *ts);
	if (test_tmpdir(ts->dir, sizeof ts->dir))
		return -1;
	ts->dirs[0] = ts->dir;
	tier_store_config cfg = { .capacity = { hbm, ddr, nvme }, .nvme_dirs = ts->dirs, .n_nvme_dirs = 1,
				  .policy = pol, .nvme_checksum = checksum, .offload_config = test_offload_config() };
	return tier_store_create(&ts->s, &cfg);
}

static inline void test_store_close(test_store *ts)
{
	tier_store_destroy(ts->s);
	ts->s = NULL;
	if (ts->dir[0])
		rmdir(ts->dir);
}

static inline uint64_t test_link_bytes(tier_store *s, tier_link l)
{
	tier_link_stats st;
	tier_offload_link_stats(tier_store_offload(s), l, &st);
	return st.bytes;
}

#endif
