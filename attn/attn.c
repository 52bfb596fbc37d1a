/* attn.c - attention and RoPE: parameter and pointer checks, workspace sizing, dispatch. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "tier/attn.h"
#include "attn/attn_impl.h"

#define MAX_ELEMS (1ll << 40)   /* far above any real activation; keeps index products in int64 */

void tier_attn_params_init(tier_attn_params *p, int64_t batch, int64_t seq, int64_t n_heads,
			   int64_t n_kv_heads, int64_t head_dim)
{
	memset(p, 0, sizeof *p);
	p->batch = batch, p->seq = seq, p->n_heads = n_heads, p->n_kv_heads = n_kv_heads;
	p->head_dim = head_dim;
	p->scale = head_dim > 0 ? (float)(1.0 / sqrt((double)head_dim)) : 0.0f;
	p->causal = 1;
}

static int check_dev(const tier_dev *dev)
{
	if (!dev)
		return tier_fail(-EINVAL, "attn: device context is NULL; open one with tier_dev_open");
	return 0;
}

static int check_params(const tier_dev *dev, const tier_attn_params *p)
{
	int rc = check_dev(dev);
	if (rc)
		return rc;
	if (!p)
		return tier_fail(-EINVAL, "attn: params is NULL; fill one with tier_attn_params_init");
	if (p->batch < 1 || p->seq < 1 || p->n_heads < 1 || p->n_kv_heads < 1 || p->head_dim < 1)
		return tier_fail(-EINVAL, "attn: batch=%lld seq=%lld n_heads=%lld n_kv_heads=%lld head_dim=%lld must all be >= 1",
				 (long long)p->batch, (long long)p->seq, (long long)p->n_heads,
				 (long long)p->n_kv_heads, (long long)p->head_dim);
	if (p->n_heads % p->n_kv_heads)
		return tier_fail(-EINVAL, "attn: n_heads=%lld is not a multiple of n_kv_heads=%lld (grouped-query attention "
				 "shares each kv head among n_heads/n_kv_heads query heads)",
				 (long long)p->n_heads, (long long)p->n_kv_heads);
	if (p->batch > MAX_ELEMS / p->seq || p->batch * p->seq > MAX_ELEMS / p->n_heads ||
	    p->batch * p->seq * p->n_heads > MAX_ELEMS / p->head_dim)
		return tier_fail(-EINVAL, "attn: batch*seq*n_heads*head_dim is above 2^40 elements; split the call");
	if (!(p->scale > 0 && isfinite(p->scale)))
		return tier_fail(-EINVAL, "attn: scale %g must be finite and > 0 (HF: head_dim ** -0.5)", p->scale);
	if (p->causal != 0 && p->causal != 1)
		return tier_fail(-EINVAL, "attn: causal=%d must be 0 or 1", p->causal);
	if (tier_dev_kind_of(dev) == TIER_DEV_CUDA) {
		int64_t d = p->head_dim;
		if (d != 32 && d != 64 && d != 96 && d != 128)
			return tier_fail(-EINVAL, "attn: on CUDA head_dim=%lld must be 32, 64, 96 or 128 (the CPU path takes any)",
					 (long long)d);
	}
	return 0;
}

int tier_attn_workspace_bytes(const tier_dev *dev, const tier_attn_params *p, size_t *bytes)
{
	int rc = check_params(dev, p);
	if (rc)
		return rc;
	if (!bytes)
		return tier_fail(-EINVAL, "attn: bytes is NULL");
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(dev) == TIER_DEV_CUDA) {
		*bytes = attn_cuda_ws_bytes(p);
		return 0;
	}
#endif
	*bytes = attn_cpu_ws_floats(p) * sizeof(float);
	return 0;
}

static int check_ws(const tier_dev *dev, const tier_attn_params *p, const void *ws, size_t ws_bytes)
{
	size_t need;
	int rc = tier_attn_workspace_bytes(dev, p, &need);
	if (rc)
		return rc;
	if (ws_bytes < need)
		return tier_fail(-ENOSPC, "attn: workspace of %zu bytes is below the %zu bytes these shapes need "
				 "(tier_attn_workspace_bytes)", ws_bytes, need);
	if (need && !ws)
		return tier_fail(-EINVAL, "attn: workspace is NULL but %zu bytes are needed", need);
	return 0;
}

/* Names the first NULL pointer among n, so the message says which argument is missing. */
static int check_ptrs(const char *call, const char *const *names, const void *const *ptrs, int n)
{
	for (int i = 0; i < n; i++)
		if (!ptrs[i])
			return tier_fail(-EINVAL, "attn: %s: %s is NULL", call, names[i]);
	return 0;
}

int tier_attn_fwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, void *o, float *lse, void *ws, size_t ws_bytes)
{
	static const char *const names[] = { "q", "k", "v", "o", "lse" };
	const void *ptrs[] = { q, k, v, o, lse };
	int rc = check_ws(dev, p, ws, ws_bytes);
	if (rc || (rc = check_ptrs("tier_attn_fwd", names, ptrs, 5)))
		return rc;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(dev) == TIER_DEV_CUDA)
		return attn_cuda_fwd(dev, p, q, k, v, o, lse);
#endif
	return attn_cpu_fwd(p, q, k, v, o, lse, ws);
}

int tier_attn_bwd(tier_dev *dev, const tier_attn_params *p, const void *q, const void *k,
		  const void *v, const void *o, const float *lse, const void *dout, float *dq, float *dk,
		  float *dv, void *ws, size_t ws_bytes)
{
	static const char *const names[] = { "q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv" };
	const void *ptrs[] = { q, k, v, o, lse, dout, dq, dk, dv };
	int rc = check_ws(dev, p, ws, ws_bytes);
	if (rc || (rc = check_ptrs("tier_attn_bwd", names, ptrs, 9)))
		return rc;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(dev) == TIER_DEV_CUDA)
		return attn_cuda_bwd(dev, p, q, k, v, o, lse, dout, dq, dk, dv, ws);
#endif
	return attn_cpu_bwd(p, q, k, v, o, lse, dout, dq, dk, dv, ws);
}

static int check_rope(const tier_dev *dev, const tier_rope_params *r, const int32_t *pos, const void *x)
{
	int rc = check_dev(dev);
	if (rc)
		return rc;
	if (!r)
		return tier_fail(-EINVAL, "attn: rope params is NULL");
	if (!x)
		return tier_fail(-EINVAL, "attn: rope: x is NULL");
	if (r->tokens < 1 || r->seq < 1 || r->n_heads < 1 || r->head_dim < 2)
		return tier_fail(-EINVAL, "attn: rope: tokens=%lld seq=%lld n_heads=%lld must be >= 1 and head_dim=%lld >= 2",
				 (long long)r->tokens, (long long)r->seq, (long long)r->n_heads, (long long)r->head_dim);
	if (r->head_dim % 2)
		return tier_fail(-EINVAL, "attn: rope: head_dim=%lld must be even (rotate_half pairs the two halves)",
				 (long long)r->head_dim);
	if (r->tokens > MAX_ELEMS / r->n_heads || r->tokens * r->n_heads > MAX_ELEMS / r->head_dim)
		return tier_fail(-EINVAL, "attn: rope: tokens*n_heads*head_dim is above 2^40 elements; split the call");
	if (!(r->theta > 0 && isfinite(r->theta)))
		return tier_fail(-EINVAL, "attn: rope: theta %g must be finite and > 0 (config.json rope_theta)", r->theta);
	if (pos && tier_dev_kind_of(dev) == TIER_DEV_CPU)
		for (int64_t t = 0; t < r->tokens; t++)
			if (pos[t] < 0)
				return tier_fail(-EINVAL, "attn: rope: position %d of token %lld is negative",
						 pos[t], (long long)t);
	return 0;
}

static int rope(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *x, int inverse)
{
	int rc = check_rope(dev, r, pos, x);
	if (rc)
		return rc;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(dev) == TIER_DEV_CUDA)
		return attn_cuda_rope(dev, r, pos, x, inverse);
#endif
	attn_cpu_rope(r, pos, x, inverse);
	return 0;
}

int tier_attn_rope_fwd(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *x)
{
	return rope(dev, r, pos, x, 0);
}

int tier_attn_rope_bwd(tier_dev *dev, const tier_rope_params *r, const int32_t *pos, void *dx)
{
	return rope(dev, r, pos, dx, 1);
}
