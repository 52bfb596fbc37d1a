/* permute.c - sort token-expert pairs by expert (histogram + prefix sum, stable), apply the
 * capacity, gather rows per expert, and the gather's backward (scatter-add). */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "moe/moe_internal.h"
#include "moe/moe_cuda.h"

int tier_moe_capacity(int T, int k, int E, float cf)
{
	if (!(cf > 0.0f) || T < 1 || k < 1 || E < 1)
		return 0;
	double c = ceil((double)cf * T * k / E);
	return c > (double)T * k ? T * k : (int)c;
}

int moe_offsets_of(const char *fn, const int32_t *counts, int E, int n, int cap, int32_t *off)
{
	long long sum = 0;
	off[0] = 0;
	for (int e = 0; e < E; e++) {
		if (counts[e] < 0)
			return tier_fail(-EINVAL, "%s: counts[%d] = %d; pass the counts tier_moe_layer_route gave", fn, e,
					 counts[e]);
		sum += counts[e];
		off[e + 1] = off[e] + (cap > 0 && counts[e] > cap ? cap : counts[e]);
	}
	if (sum > n)
		return tier_fail(-EINVAL, "%s: the counts add up to %lld pairs, more than T*k = %d; pass the counts "
				 "tier_moe_layer_route gave for these tokens", fn, sum, n);
	return 0;
}

int tier_moe_permute(tier_dev *dev, int T, int k, int E, int H, int capacity, const int32_t *topk_idx,
		     const float *x, int32_t *offsets, int32_t *row_pair, int32_t *pair_row, int32_t *counts,
		     float *xg)
{
	const char *fn = "tier_moe_permute";
	MOE_CUDA_DISPATCH(dev, moe_cuda_permute(dev, T, k, E, H, capacity, topk_idx, x, offsets, row_pair, pair_row, counts, xg));
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)))
		return rc;
	MOE_NONNULL(topk_idx, fn);
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(row_pair, fn);
	MOE_NONNULL(pair_row, fn);
	if (x && (rc = moe_check_dim(fn, "H", H)))
		return rc;
	if (x)
		MOE_NONNULL(xg, fn);
	int n = T * k;
	int32_t hist[TIER_MOE_MAX_EXPERTS] = { 0 }, next[TIER_MOE_MAX_EXPERTS];
	for (int p = 0; p < n; p++) {
		if (topk_idx[p] < 0 || topk_idx[p] >= E)
			return tier_fail(-EINVAL, "%s: topk_idx[%d] = %d is not an expert of 0..%d", fn, p, topk_idx[p], E - 1);
		hist[topk_idx[p]]++;
	}
	if (counts)
		memcpy(counts, hist, sizeof(int32_t) * (size_t)E);
	offsets[0] = 0; /* prefix sum of the kept counts */
	for (int e = 0; e < E; e++) {
		int kept = capacity > 0 && hist[e] > capacity ? capacity : hist[e];
		next[e] = offsets[e];
		offsets[e + 1] = offsets[e] + kept;
	}
	for (int p = 0; p < n; p++) { /* pairs in token order: the first `capacity` of an expert stay */
		int e = topk_idx[p];
		if (next[e] < offsets[e + 1]) {
			pair_row[p] = next[e];
			row_pair[next[e]++] = p;
		} else {
			pair_row[p] = -1;
		}
	}
	for (int r = offsets[E]; r < n; r++)
		row_pair[r] = -1;
	if (x)
		for (int r = 0; r < offsets[E]; r++)
			memcpy(xg + (size_t)r * H, x + (size_t)(row_pair[r] / k) * H, sizeof(float) * (size_t)H);
	return 0;
}

int tier_moe_permute_bwd(tier_dev *dev, int T, int k, int H, const int32_t *offsets, int E,
			 const int32_t *row_pair, const float *dxg, float *dx)
{
	const char *fn = "tier_moe_permute_bwd";
	MOE_CUDA_DISPATCH(dev, moe_cuda_permute_bwd(dev, T, k, H, offsets, E, row_pair, dxg, dx));
	int rc = moe_check_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, T, k, E)) || (rc = moe_check_dim(fn, "H", H)))
		return rc;
	MOE_NONNULL(offsets, fn);
	MOE_NONNULL(row_pair, fn);
	MOE_NONNULL(dxg, fn);
	MOE_NONNULL(dx, fn);
	int rows = offsets[E];
	if (rows < 0 || rows > T * k)
		return tier_fail(-EINVAL, "%s: offsets[E] = %d is outside 0..T*k", fn, rows);
	for (int r = 0; r < rows; r++) {
		if (row_pair[r] < 0 || row_pair[r] >= T * k)
			return tier_fail(-EINVAL, "%s: row_pair[%d] = %d is not a pair of 0..T*k-1", fn, r, row_pair[r]);
	}
	for (int r = 0; r < rows; r++) {
		float *d = dx + (size_t)(row_pair[r] / k) * H;
		const float *s = dxg + (size_t)r * H;
		for (int h = 0; h < H; h++)
			d[h] += s[h];
	}
	return 0;
}
