/* seeded_cpu.h - the CPU device and random generator of a test that draws its inputs, with the
 * cmocka group setup that opens and seeds them. The seed is $TIER_SEED, else the time, printed so
 * that a failing run can be repeated. Define SEEDED_CPU_TEST as the test's name (for that line)
 * before including this header, then run cmocka_run_group_tests(tests, seeded_cpu_setup,
 * seeded_cpu_teardown). */
#ifndef TIER_TESTS_SEEDED_CPU_H
#define TIER_TESTS_SEEDED_CPU_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "tier/tier.h"
#include "test_seed.h"

static tier_dev *cpu;
static tier_rng rng;
static uint64_t seed;

static int seeded_cpu_setup(void **state)
{
	(void)state;
	seed = test_seed(SEEDED_CPU_TEST, 0);
	tier_rng_seed(&rng, seed);
	if (tier_dev_open(&cpu, TIER_DEV_CPU, 0)) {
		fprintf(stderr, "%s: %s\n", SEEDED_CPU_TEST, tier_last_error());
		return 1;
	}
	return 0;
}

static int seeded_cpu_teardown(void **state)
{
	(void)state;
	tier_dev_close(cpu);
	return 0;
}

#endif
