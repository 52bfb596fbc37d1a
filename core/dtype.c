/* dtype.c - safetensors element types and bf16/f16/f32 conversions (round to nearest, ties to even). */
#include <errno.h>
#include <string.h>
#include "tier/base.h"
#include "tier/formats.h"

static const struct { const char *name; size_t size; } dtypes[TIER_DT_COUNT] = {
	[TIER_DT_F32] = { "F32", 4 },   [TIER_DT_BF16] = { "BF16", 2 }, [TIER_DT_F16] = { "F16", 2 },
	[TIER_DT_F64] = { "F64", 8 },   [TIER_DT_F8_E4M3] = { "F8_E4M3", 1 },
	[TIER_DT_F8_E5M2] = { "F8_E5M2", 1 }, [TIER_DT_I64] = { "I64", 8 }, [TIER_DT_I32] = { "I32", 4 },
	[TIER_DT_I16] = { "I16", 2 },   [TIER_DT_I8] = { "I8", 1 },     [TIER_DT_U64] = { "U64", 8 },
	[TIER_DT_U32] = { "U32", 4 },   [TIER_DT_U16] = { "U16", 2 },   [TIER_DT_U8] = { "U8", 1 },
	[TIER_DT_BOOL] = { "BOOL", 1 },
};

const char *tier_dtype_name(tier_dtype dt)
{
	return (unsigned)dt < TIER_DT_COUNT ? dtypes[dt].name : "?";
}

size_t tier_dtype_size(tier_dtype dt)
{
	return (unsigned)dt < TIER_DT_COUNT ? dtypes[dt].size : 0;
}

int tier_dtype_parse(const char *name, tier_dtype *out)
{
	for (int i = 0; name && i < TIER_DT_COUNT; i++)
		if (strcmp(name, dtypes[i].name) == 0) {
			*out = (tier_dtype)i;
			return 0;
		}
	return tier_fail(-EINVAL, "unknown dtype '%s' (expected one of F32, BF16, F16, F64, F8_E4M3, "
			 "F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL)", name ? name : "(null)");
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float tier_bf16_to_f32(uint16_t h)
{
	return bits_f32((uint32_t)h << 16);
}

uint16_t tier_f32_to_bf16(float f)
{
	uint32_t u = f32_bits(f);
	if ((u & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep sign and top payload, force quiet */
		return (uint16_t)((u >> 16) | 0x0040u);
	/* Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into the exponent is
	 * the correct result (rounding up to the next binade or to infinity). */
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

float tier_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
	if (exp == 0x1f)                               /* inf or NaN: payload moves to the top */
		return bits_f32(sign | 0x7f800000u | (man << 13));
	if (exp == 0) {                                /* zero or subnormal: man * 2^-24, exact */
		float v = (float)man * 0x1p-24f;
		return sign ? -v : v;
	}
	return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t tier_f32_to_f16(float f)
{
	uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
	if (a > 0x7f800000u)                           /* NaN: quiet, keep the top payload bits */
		return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
	if (a >= 0x477ff000u)                          /* >= 65520 rounds to infinity */
		return (uint16_t)(sign | 0x7c00u);
	if (a < 0x38800000u) {                         /* below 2^-14: f16 subnormal or zero */
		/* Scale to units of 2^-24 and round to nearest even in the FPU: exact because the
		 * value times 2^24 is below 2^10 and float addition of 0x1p23 rounds half to even. */
		float m = bits_f32(a) * 0x1p24f;
		float r = (m + 0x1p23f) - 0x1p23f;
		return (uint16_t)(sign | (uint16_t)r);
	}
	uint32_t h = ((a - 0x38000000u) >> 13);        /* rebias exponent 127 -> 15 */
	uint32_t rest = a & 0x1fffu;
	if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
		h++;                                       /* a carry into the exponent is correct */
	return (uint16_t)(sign | h);
}

static float load_f32(const void *src, tier_dtype dt, size_t i)
{
	uint16_t h;
	float f;
	if (dt == TIER_DT_F32) {
		memcpy(&f, (const char *)src + 4 * i, 4);
		return f;
	}
	memcpy(&h, (const char *)src + 2 * i, 2);
	return dt == TIER_DT_BF16 ? tier_bf16_to_f32(h) : tier_f16_to_f32(h);
}

static int is_float16_32(tier_dtype dt)
{
	return dt == TIER_DT_F32 || dt == TIER_DT_BF16 || dt == TIER_DT_F16;
}

int tier_dtype_convert(void *dst, tier_dtype dst_dt, const void *src, tier_dtype src_dt, size_t n)
{
	if (!is_float16_32(dst_dt) || !is_float16_32(src_dt))
		return tier_fail(-ENOTSUP, "conversion from %s to %s is not supported (F32, BF16 and F16 only)",
				 tier_dtype_name(src_dt), tier_dtype_name(dst_dt));
	if (dst_dt == src_dt) {
		memcpy(dst, src, n * tier_dtype_size(dst_dt));
		return 0;
	}
	/* f16 -> bf16 through f32 is exact into f32, then one rounding: correct. */
	for (size_t i = 0; i < n; i++) {
		float f = load_f32(src, src_dt, i);
		if (dst_dt == TIER_DT_F32) {
			memcpy((char *)dst + 4 * i, &f, 4);
		} else {
			uint16_t h = dst_dt == TIER_DT_BF16 ? tier_f32_to_bf16(f) : tier_f32_to_f16(f);
			memcpy((char *)dst + 2 * i, &h, 2);
		}
	}
	return 0;
}
