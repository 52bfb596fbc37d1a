/* moe_wgrad.cuh - the LoRA weight-gradient reductions' parameters, shared by their two kernels:
 * moe_grouped.cu's tiles (gw_kernel) and moe_wgrad_walk.cu's column walk for the rank-row gradients
 * (dA [r, in], r <= 16). Include from .cu files only. */
#ifndef TIER_MOE_WGRAD_CUH
#define TIER_MOE_WGRAD_CUH

#include "moe/moe_cu.cuh"

/* NW products sharing B: C_j,e += alpha_j A_j,e^T B_e (two: the gate's and the up adapter's dA from
 * one pass over X). */
template <int NW>
struct gw_args {
	float *c[NW][TIER_MOE_MAX_EXPERTS]; /* NULL: that expert's gradient is not wanted */
	const int32_t *off;
	const bf16 *a[NW], *b;
	float alpha[NW];
	int M, N;
};

/* The column walk (moe_wgrad_walk.cu) for M <= 16 (M % 8 == 0, N % 8 == 0): one launch queued. */
template <int NW>
int gw_walk_launch(tier_dev *dev, const gw_args<NW> &a, int E);

#endif
