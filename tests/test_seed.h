/* test_seed.h - one variable repeats any randomised test's run: TIER_TEST_SEED (TIER_SEED, the name
 * some tests took before, is still read); without it a fresh seed from the clock, mixed with salt
 * so that tests started in the same nanosecond still differ. The seed is printed first, with the
 * setting that repeats it, so that a failure's log always holds it. */
#ifndef TIER_TESTS_TEST_SEED_H
#define TIER_TESTS_TEST_SEED_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "tier/base.h"

static inline uint64_t test_seed(const char *what, uint64_t salt)
{
	const char *v = getenv("TIER_TEST_SEED");
	if (!v || !*v)
		v = getenv("TIER_SEED");
	uint64_t s = v && *v ? strtoull(v, NULL, 0) : tier_now_ns() ^ salt;
	printf("# %s seed %llu (TIER_TEST_SEED=%llu repeats it)\n", what, (unsigned long long)s, (unsigned long long)s);
	fflush(stdout);
	return s;
}

#endif
