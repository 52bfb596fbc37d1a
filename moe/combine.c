/* combine.c - unpermute and combine: scatter expert rows back to token order weighted by the router
 * weights (one fused pass), and its backward. Dropped pairs (pair_row -1) add nothing. */
#include "config.h"
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

/* y NULL is checked by the callers that need it. */
static int combine_check(const char *fn, tier_dev *dev, int T, int k, int H, const int32_t *pair_row,
			 const float *topk_w)
{
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, k)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(pair_row, fn);
	MOE_NONNULL(topk_w, fn);
	for (int p = 0; p < T * k; p++)
		if (pair_row[p] < -1 || pair_row[p] >= T * k)
			return tier_fail(-EINVAL, "%s: pair_row[%d] = %d is outside -1..T*k-1", fn, p, pair_row[p]);
	return 0;
}

int tier_moe_combine_fwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const float *y, float *out)
{
	return moe_combine_fwd_res(dev, T, k, H, pair_row, topk_w, y, NULL, out);
}

int moe_combine_fwd_res(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			const float *y, const float *res, float *out)
{
	const char *fn = "tier_moe_combine_fwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_combine_fwd_res(dev, T, k, H, pair_row, topk_w, y, res, out));
	int rc = combine_check(fn, dev, T, k, H, pair_row, topk_w);
	if (rc)
		return rc;
	MOE_NONNULL(y, fn);
	MOE_NONNULL(out, fn);
	/* with res each row's sum first (in row: out may be res), then res added: the bits of the
	 * combine followed by an add of its own */
	float *row = res ? malloc(sizeof(float) * (size_t)H) : NULL;
	if (res && !row)
		return tier_fail(-ENOMEM, "%s: out of memory for a row of %d", fn, H);
	for (int t = 0; t < T; t++) {
		float *o = row ? row : out + (size_t)t * H;
		memset(o, 0, sizeof(float) * (size_t)H);
		for (int j = 0; j < k; j++) {
			int r = pair_row[t * k + j];
			float w = topk_w[t * k + j];
			if (r < 0)
				continue;
			const float *s = y + (size_t)r * H;
			for (int h = 0; h < H; h++)
				o[h] += w * s[h];
		}
		for (int h = 0; row && h < H; h++)
			out[(size_t)t * H + h] = row[h] + res[(size_t)t * H + h];
	}
	free(row);
	return 0;
}

int tier_moe_combine_bwd(tier_dev *dev, int T, int k, int H, const int32_t *pair_row, const float *topk_w,
			 const float *y, const float *d_out, float *dy, float *d_topk_w)
{
	const char *fn = "tier_moe_combine_bwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_combine_bwd(dev, T, k, H, pair_row, topk_w, y, d_out, dy, d_topk_w));
	int rc = combine_check(fn, dev, T, k, H, pair_row, topk_w);
	if (rc)
		return rc;
	MOE_NONNULL(d_out, fn);
	MOE_NONNULL(dy, fn);
	if (!y != !d_topk_w)
		return tier_fail(-EINVAL, "%s: give y and d_topk_w both, or neither (dy only)", fn);
	for (int t = 0; t < T; t++) {
		const float *g = d_out + (size_t)t * H;
		for (int j = 0; j < k; j++) {
			int p = t * k + j, r = pair_row[p];
			double dot = 0.0;
			for (int h = 0; r >= 0 && h < H; h++)
				dy[(size_t)r * H + h] = topk_w[p] * g[h];
			for (int h = 0; r >= 0 && y && h < H; h++)
				dot += (double)g[h] * y[(size_t)r * H + h];
			if (d_topk_w)
				d_topk_w[p] = (float)dot;
		}
	}
	return 0;
}

int tier_moe_combine_dw(tier_dev *dev, int T, int k, const int32_t *pair_row, const float *topk_w,
			const float *row_dot, float *d_topk_w)
{
	const char *fn = "tier_moe_combine_dw";
	MOE_CUDA_DISPATCH(dev, moe_cuda_combine_dw(dev, T, k, pair_row, topk_w, row_dot, d_topk_w));
	int rc = combine_check(fn, dev, T, k, 1, pair_row, topk_w);
	if (rc)
		return rc;
	MOE_NONNULL(row_dot, fn);
	MOE_NONNULL(d_topk_w, fn);
	for (int p = 0; p < T * k; p++) {
		float w = topk_w[p];
		d_topk_w[p] = pair_row[p] >= 0 && !(fabsf(w) < FLT_MIN) ? row_dot[pair_row[p]] / w : 0.0f; /* NaN stays */
	}
	return 0;
}
