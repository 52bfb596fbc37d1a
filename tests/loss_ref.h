/* loss_ref.h - a naive fp64 cross-entropy for the loss tests: whole logits in double. */
#ifndef TIER_TESTS_LOSS_REF_H
#define TIER_TESTS_LOSS_REF_H

#include <stddef.h>
#include <stdint.h>
#include "tier/tier.h"

/* Loss (reduced as p asks), counted tokens, lse[N], dH[N x D] and dW[V x D] (either may be NULL)
 * for fp32 inputs, in double, from the materialised N x V logits. Returns the loss. */
double loss_ref(const tier_loss_params *p, const float *H, const float *W, const int32_t *labels,
		double dloss, double *lse, int64_t *count, double *dH, double *dW);
/* ||a - ref||_2 / ||ref||_2, or ||a||_2 when ref is all zeros; inf when a holds a NaN. */
double loss_rel_err(const float *a, const double *ref, size_t n);
#endif
