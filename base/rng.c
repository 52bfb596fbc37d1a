/* rng.c - monotonic clock, xoshiro256** random numbers and the seeded byte pattern of test data. */
#include <math.h>
#include <string.h>
#include <time.h>
#include "tier/base.h"

uint64_t tier_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

void tier_rng_seed(tier_rng *r, uint64_t seed)
{
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tier_rng_next(tier_rng *r)
{
	uint64_t *s = r->s;
	uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

double tier_rng_uniform(tier_rng *r) { return (double)(tier_rng_next(r) >> 11) * 0x1.0p-53; }

float tier_rng_normal(tier_rng *r)
{
	/* Box-Muller; u1 kept away from 0 so that log() is finite. */
	double u1 = tier_rng_uniform(r) + 0x1.0p-54, u2 = tier_rng_uniform(r);
	return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t tier_rng_below(tier_rng *r, uint64_t n)
{
	/* Lemire's multiply-shift; the bias is below 2^-64 * n, negligible for tests. */
	return (uint64_t)(((unsigned __int128)tier_rng_next(r) * n) >> 64);
}

/* The pattern is a hash of (seed, 8-byte word index), so any window can be filled or checked
 * without the bytes before it. */
static inline uint64_t pattern_word(uint64_t seed, uint64_t word)
{
	uint64_t x = seed ^ (word * 0x9e3779b97f4a7c15ull);
	return splitmix64(&x);
}

void tier_pattern_fill(void *buf, size_t len, uint64_t seed, uint64_t offset)
{
	unsigned char *p = buf;
	size_t i = 0;
	while (i < len) {
		uint64_t pos = offset + i, w = pattern_word(seed, pos >> 3);
		unsigned char bytes[8];
		memcpy(bytes, &w, 8);
		size_t k = pos & 7, n = 8 - k < len - i ? 8 - k : len - i;
		memcpy(p + i, bytes + k, n);
		i += n;
	}
}

size_t tier_pattern_check(const void *buf, size_t len, uint64_t seed, uint64_t offset)
{
	const unsigned char *p = buf;
	size_t i = 0;
	while (i < len) {
		uint64_t pos = offset + i, w = pattern_word(seed, pos >> 3);
		unsigned char bytes[8];
		memcpy(bytes, &w, 8);
		size_t k = pos & 7, n = 8 - k < len - i ? 8 - k : len - i;
		if (memcmp(p + i, bytes + k, n))
			for (size_t j = 0; j < n; j++)
				if (p[i + j] != bytes[k + j])
					return i + j;
		i += n;
	}
	return len;
}
