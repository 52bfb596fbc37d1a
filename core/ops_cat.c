/* ops_cat.c - the sizes and checks of opsc_linear_bwd_cat and opsc_linear_fwd_cat (core/ops_cuda.h),
 * in every build: the decoder sizes its workspace by them with or without CUDA, and the checks are
 * tested on the CPU. */
#include "config.h"
#include <errno.h>
#include "core/ops_cuda.h"

static size_t al256(size_t b) { return (b + 255) / 256 * 256; }

/* A segment's adapter rank: 0 without an adapter (or with a rank the checks refuse). */
static int seg_rank(const opsc_lin_seg *s) { return s->lora && s->lora->a && s->lora->rank > 0 ? s->lora->rank : 0; }

int opsc_linear_cat_ranks(int n, const opsc_lin_seg *s)
{
	int r = 0;
	for (int j = 0; s && j < n; j++)
		r += seg_rank(&s[j]);
	return r;
}

int opsc_linear_cat_cols(int n, const opsc_lin_seg *s)
{
	int64_t k = opsc_linear_cat_ranks(n, s);
	for (int j = 0; s && j < n; j++)
		k += s[j].out > 0 ? s[j].out : 0;
	return k > INT32_MAX ? -1 : (int)k;
}

/* The stacked weights bf16 [cols, in], then every adapter's x A^T side by side, bf16 [T, sum r]. */
size_t opsc_linear_cat_ws_bytes(int T, int in, int n, const opsc_lin_seg *s)
{
	int k = opsc_linear_cat_cols(n, s);
	size_t t = T > 0 ? (size_t)T : 0, i = in > 0 ? (size_t)in : 0, r = (size_t)opsc_linear_cat_ranks(n, s);
	return al256((size_t)(k > 0 ? k : 0) * i * 2) + al256(t * r * 2);
}

/* The adapters' A rows stacked, bf16 [sum r, in], then x A^T, bf16 [T, sum r]. */
size_t opsc_linear_cat_fwd_ws_bytes(int T, int in, int n, const opsc_lin_seg *s)
{
	size_t t = T > 0 ? (size_t)T : 0, i = in > 0 ? (size_t)in : 0, r = (size_t)opsc_linear_cat_ranks(n, s);
	return al256(r * i * 2) + al256(t * r * 2);
}

int opsc_linear_cat_check(const char *op, int T, int in, const void *x, int n, const opsc_lin_seg *s, const void *dy,
			  int ld, const float *dx, const void *ws)
{
	if (T < 0 || in <= 0 || n < 1 || n > OPSC_CAT_MAX || !s)
		return tier_fail(-EINVAL, "%s: bad arguments T=%d in=%d, %d segments (1..%d)", op, T, in, n, OPSC_CAT_MAX);
	for (int j = 0; j < n; j++) {
		const tier_lora_ref *l = s[j].lora;
		if (s[j].out <= 0 || !s[j].w)
			return tier_fail(-EINVAL, "%s: segment %d has out=%d and weights %p", op, j, s[j].out,
					 (const void *)s[j].w);
		if (l && l->a && (!l->b || l->rank <= 0))
			return tier_fail(-EINVAL, "%s: segment %d's adapter of rank %d needs a and b", op, j, l->rank);
		if (l && l->a && l->dropout != 0.0f)
			return tier_fail(-EINVAL, "%s: segment %d's adapter has dropout %g; its dx goes back through the "
					 "mask in fp32 (use opsc_linear_bwd_bf16 for each projection)", op, j, l->dropout);
	}
	int k = opsc_linear_cat_cols(n, s);
	if (k < 0 || ld < k)
		return tier_fail(-EINVAL, "%s: dy's row stride %d is below the %d columns of the segments and their "
				 "adapters", op, ld, k);
	if (T > 0 && (!x || !dy || !dx || !ws))
		return tier_fail(-EINVAL, "%s: T=%d needs its inputs, outputs and a workspace (x %p dy %p dx %p ws %p; "
				 "opsc_linear_cat_ws_bytes and opsc_linear_cat_fwd_ws_bytes size it)", op, T, x, dy,
				 (const void *)dx, ws);
	return 0;
}
