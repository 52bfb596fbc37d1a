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
/* Bounds on ||dH - dH_ref||_2 and ||dW - dW_ref||_2 (either pointer may be NULL) from the one
 * rounding the fp32 lse output undergoes between a forward and the backward that reads it: lse_i
 * off by d_i, |d_i| <= u |lse_i| (u = 2^-24), scales every p_iv of token i by exp(-d_i). Same
 * arguments as loss_ref, with its lse; dloss and the options as the backward gets them. */
void loss_ref_lse_bound(const tier_loss_params *p, const float *H, const float *W, const int32_t *labels,
			double dloss, const double *lse, double *eH, double *eW);
/* ||a - ref||_2 / ||ref||_2, or ||a||_2 when ref is all zeros; inf when a holds a NaN. */
double loss_rel_err(const float *a, const double *ref, size_t n);
#endif
