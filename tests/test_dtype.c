/* test_dtype.c - dtype names and sizes; bf16/f16 <-> f32 conversions against exact cases and an fp64 reference. */
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
#include "test_seed.h"

static uint64_t seed;

static float fbits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t bitsf(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void test_names(void **state)
{
	tier_dtype dt = TIER_DT_U8;
	(void)state;
	for (int i = 0; i < TIER_DT_COUNT; i++) {
		assert_int_equal(tier_dtype_parse(tier_dtype_name((tier_dtype)i), &dt), 0);
		assert_int_equal(dt, i);
	}
	assert_int_equal(tier_dtype_size(TIER_DT_BF16), 2);
	assert_int_equal(tier_dtype_size(TIER_DT_F64), 8);
	assert_int_equal(tier_dtype_size(TIER_DT_COUNT), 0);
	dt = TIER_DT_U8;
	assert_int_equal(tier_dtype_parse("f32", &dt), -EINVAL);   /* names are case-sensitive */
	assert_int_equal(dt, TIER_DT_U8);
	assert_non_null(strstr(tier_last_error(), "f32"));
}

static void test_bf16_exact(void **state)
{
	static const struct { uint32_t f; uint16_t h; } cases[] = {
		{ 0x3f800000, 0x3f80 }, { 0xbf800000, 0xbf80 }, { 0x00000000, 0x0000 }, { 0x80000000, 0x8000 },
		{ 0x3f808000, 0x3f80 },   /* tie, even below: stays */
		{ 0x3f818000, 0x3f82 },   /* tie, odd below: rounds up to even */
		{ 0x3f808001, 0x3f81 }, { 0x3f807fff, 0x3f80 },
		{ 0x7f800000, 0x7f80 }, { 0xff800000, 0xff80 },
		{ 0x7f7fffff, 0x7f80 },   /* FLT_MAX rounds to infinity */
		{ 0x7f7f7fff, 0x7f7f },
		{ 0x00010000, 0x0001 }, { 0x00008000, 0x0000 }, { 0x00018000, 0x0002 }, /* subnormals, ties */
		{ 0x007fffff, 0x0080 },   /* largest subnormal rounds up to the smallest normal */
	};
	(void)state;
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		assert_int_equal(tier_f32_to_bf16(fbits(cases[i].f)), cases[i].h);
	}
	assert_true(tier_bf16_to_f32(0x3f80) == 1.0f);
	assert_true(tier_bf16_to_f32(0x0001) == ldexpf(1.0f, -133));
	assert_true(isinf(tier_bf16_to_f32(0xff80)) && tier_bf16_to_f32(0xff80) < 0);
	/* NaNs stay NaN, including signalling ones whose payload is only in the low bits. */
	uint16_t n1 = tier_f32_to_bf16(fbits(0x7f800001)), n2 = tier_f32_to_bf16(fbits(0xffc00000));
	assert_true(isnan(tier_bf16_to_f32(n1)) && isnan(tier_bf16_to_f32(n2)));
	assert_int_equal(n2 & 0x8000, 0x8000);
	/* Every bf16 survives a trip through f32. */
	for (uint32_t h = 0; h < 65536; h++) {
		float f = tier_bf16_to_f32((uint16_t)h);
		if (!isnan(f))
			assert_int_equal(tier_f32_to_bf16(f), h);
	}
}

static void test_f16_exact(void **state)
{
	static const struct { float f; uint16_t h; } cases[] = {
		{ 1.0f, 0x3c00 }, { -2.0f, 0xc000 }, { 0.0f, 0x0000 }, { -0.0f, 0x8000 },
		{ 65504.0f, 0x7bff }, { 65519.99f, 0x7bff }, { 65520.0f, 0x7c00 }, { 1e10f, 0x7c00 },
		{ 0x1p-24f, 0x0001 }, { 0x1p-25f, 0x0000 },        /* tie between 0 and the smallest: even (0) */
		{ 0x1.8p-24f, 0x0002 },                           /* 1.5 units: tie, rounds to even (2) */
		{ 0x1.4p-24f, 0x0001 }, { 0x1p-26f, 0x0000 }, { 0x1.000002p-25f, 0x0001 },
		{ 0x1p-14f, 0x0400 }, { 1023 * 0x1p-24f, 0x03ff }, { 0x1.ffcp-15f, 0x0400 },
		{ 1.0f + 0x1p-11f, 0x3c00 }, { 1.0f + 3 * 0x1p-11f, 0x3c02 }, { 1.0f + 0x1p-10f, 0x3c01 },
		{ INFINITY, 0x7c00 }, { -INFINITY, 0xfc00 },
	};
	(void)state;
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		if (tier_f32_to_f16(cases[i].f) != cases[i].h)
			fail_msg("f16(%a) = 0x%04x, want 0x%04x", (double)cases[i].f, tier_f32_to_f16(cases[i].f), cases[i].h);
	}
	assert_true(tier_f16_to_f32(0x0001) == 0x1p-24f);
	assert_true(tier_f16_to_f32(0x8001) == -0x1p-24f);
	assert_true(tier_f16_to_f32(0x7bff) == 65504.0f);
	assert_true(isinf(tier_f16_to_f32(0xfc00)) && tier_f16_to_f32(0xfc00) < 0);
	assert_true(isnan(tier_f16_to_f32(0x7c01)) && isnan(tier_f16_to_f32(0xfe00)));
	assert_true(isnan(tier_f16_to_f32(tier_f32_to_f16(fbits(0x7f800001)))));
	for (uint32_t h = 0; h < 65536; h++) {
		float f = tier_f16_to_f32((uint16_t)h);
		if (!isnan(f))
			assert_int_equal(tier_f32_to_f16(f), h);
	}
}

/* Reference: the representable neighbours of x, chosen by distance in fp64, ties to even. */
static void check_nearest(float x, uint16_t got, float (*to32)(uint16_t))
{
	double v = x, g = to32(got);
	uint16_t nb[2] = { (uint16_t)(got + 1), (uint16_t)(got - 1) };
	for (int k = 0; k < 2; k++) {
		double o = to32(nb[k]);
		if (isnan(o) || isinf(o) || isinf(g))
			continue;
		double dg = fabs(v - g), doo = fabs(v - o);
		if (doo < dg || (doo == dg && (got & 1)))
			fail_msg("x=%a got 0x%04x (%a), neighbour 0x%04x (%a) is nearer or even", v, got, g, nb[k], o);
	}
}

static void test_random_against_fp64(void **state)
{
	tier_rng r;
	(void)state;
	tier_rng_seed(&r, seed);
	for (int i = 0; i < 200000; i++) {
		uint32_t u = (uint32_t)tier_rng_next(&r);
		float x = fbits(u);
		if (isnan(x) || isinf(x))
			continue;
		check_nearest(x, tier_f32_to_bf16(x), tier_bf16_to_f32);
		float y = fbits((u & 0x83ffffffu) | 0x30000000u);   /* exponents around the f16 range */
		if (fabsf(y) < 65504.0f)
			check_nearest(y, tier_f32_to_f16(y), tier_f16_to_f32);
	}
}

static void test_convert_arrays(void **state)
{
	enum { N = 1001 };
	float src[N], back[N];
	uint16_t h[N], b[N];
	tier_rng r;
	(void)state;
	tier_rng_seed(&r, seed + 1);
	for (int i = 0; i < N; i++)
		src[i] = tier_rng_normal(&r) * 100.0f;
	memset(h, 0xAA, sizeof h);
	memset(b, 0xAA, sizeof b);
	assert_int_equal(tier_dtype_convert(h, TIER_DT_F16, src, TIER_DT_F32, N), 0);
	assert_int_equal(tier_dtype_convert(b, TIER_DT_BF16, h, TIER_DT_F16, N), 0);
	assert_int_equal(tier_dtype_convert(back, TIER_DT_F32, b, TIER_DT_BF16, N), 0);
	for (int i = 0; i < N; i++) {
		assert_int_equal(h[i], tier_f32_to_f16(src[i]));
		assert_int_equal(b[i], tier_f32_to_bf16(tier_f16_to_f32(h[i])));
		assert_int_equal(bitsf(back[i]), bitsf(tier_bf16_to_f32(b[i])));
	}
	memset(back, 0, sizeof back);
	assert_int_equal(tier_dtype_convert(back, TIER_DT_F32, src, TIER_DT_F32, N), 0);
	assert_memory_equal(back, src, sizeof src);
	int32_t ints[4] = { 1, 2, 3, 4 };
	memset(back, 0x55, sizeof back);
	assert_int_equal(tier_dtype_convert(back, TIER_DT_F32, ints, TIER_DT_I32, 4), -ENOTSUP);
	assert_int_equal(bitsf(back[0]), 0x55555555u);
	assert_non_null(strstr(tier_last_error(), "I32"));
}

int main(void)
{
	seed = test_seed("test_dtype", 0);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_names), cmocka_unit_test(test_bf16_exact), cmocka_unit_test(test_f16_exact),
		cmocka_unit_test(test_random_against_fp64), cmocka_unit_test(test_convert_arrays),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
