/* gemm.c - argument checks shared by moe/ (its matrix product is base_sgemm, base/blas.c). */
#include "config.h"
#include <errno.h>
#include <stdint.h>
#include "moe/moe_internal.h"

int moe_check_dev(tier_dev *dev, const char *fn)
{
	if (!dev)
		return tier_fail(-EINVAL, "%s: device context is NULL; open one with tier_dev_open", fn);
	if (tier_dev_kind_of(dev) != TIER_DEV_CPU)
		return tier_fail(-ENOTSUP, "%s: this step has no CUDA version; on CUDA call tier_moe_layer_fwd / "
				 "_bwd, or use a CPU context (tier_dev_open(..., TIER_DEV_CPU, 0))", fn);
	return 0;
}

int moe_check_tk(const char *fn, int T, int k, int E)
{
	if (E < 1 || E > TIER_MOE_MAX_EXPERTS)
		return tier_fail(-EINVAL, "%s: %d experts; E must be 1..%d", fn, E, TIER_MOE_MAX_EXPERTS);
	if (k < 1 || k > TIER_MOE_MAX_TOPK)
		return tier_fail(-EINVAL, "%s: top_k %d; k must be 1..%d", fn, k, TIER_MOE_MAX_TOPK);
	if (k > E)
		return tier_fail(-EINVAL, "%s: top_k %d exceeds the %d experts; use k <= E", fn, k, E);
	if (T < 1 || (long long)T * k > INT32_MAX / 2)
		return tier_fail(-EINVAL, "%s: %d tokens; T must be 1..%d / k", fn, T, INT32_MAX / 2);
	return 0;
}

int moe_check_dim(const char *fn, const char *name, int v)
{
	if (v < 1 || v > (1 << 20))
		return tier_fail(-EINVAL, "%s: %s = %d; it must be 1..%d", fn, name, v, 1 << 20);
	return 0;
}

int moe_check_buf16(const char *fn, const char *name, const void *p)
{
	if (!p)
		return tier_fail(-EINVAL, "%s: %s is NULL; pass a buffer of the documented size", fn, name);
	if ((uintptr_t)p % 16)
		return tier_fail(-EINVAL, "%s: %s is not 16-byte aligned; pass an aligned buffer", fn, name);
	return 0;
}

int moe_check_table16(const char *fn, const char *name, int E, const void *const *w)
{
	if (!w)
		return tier_fail(-EINVAL, "%s: %s is NULL; pass a host array of E device pointers", fn, name);
	for (int e = 0; e < E; e++)
		if ((uintptr_t)w[e] % 16)
			return tier_fail(-EINVAL, "%s: %s[%d] is not 16-byte aligned; pass aligned weights", fn, name, e);
	return 0;
}
