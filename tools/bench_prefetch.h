/* bench_prefetch.h - the per-layer compute of tier-bench prefetch: a matrix product that reads the
 * layer's weights where the store put them (fp32 OpenBLAS on the CPU, naive loops without it; fp32
 * cuBLAS on CUDA), with a row count calibrated so that one layer takes a chosen time. */
#ifndef TIER_TOOLS_BENCH_PREFETCH_H
#define TIER_TOOLS_BENCH_PREFETCH_H

#include <stdint.h>
#include "tier/base.h"

/* The weights of a layer are a K x N fp32 matrix W (row-major). Forward: Y = X W (X is M x K);
 * backward: dX = Y W^T (M x K), as a frozen layer's input gradient. */
typedef struct pf_compute pf_compute;

/* Buffers for the activations live outside the store (device memory on CUDA). Returns 0 or
 * -ENOMEM / -EIO with a message; *out NULL on failure. Single-threaded use. */
int pf_compute_create(pf_compute **out, tier_dev *dev, unsigned K, unsigned N, uint64_t seed);
void pf_compute_destroy(pf_compute *c);
/* Rows of X: the knob that sets the time of one layer. 0 or -ENOMEM (rows unchanged). */
int pf_compute_set_rows(pf_compute *c, unsigned M);
unsigned pf_compute_rows(const pf_compute *c);
/* Run one layer on weights `w` (device memory on CUDA) and wait for it. Returns the ns it took,
 * or a negative errno with a message. */
double pf_compute_layer(pf_compute *c, const float *w, int backward);
/* Choose the rows so that one layer on `w` takes about target_ns (the fastest of several runs).
 * Returns the achieved time per layer in ns, or a negative errno with a message. */
double pf_compute_calibrate(pf_compute *c, const float *w, double target_ns);
/* The first n values of the last forward output (copied to the host): a fingerprint that must
 * match across modes when the weights arrived intact. 0 or -EIO. */
int pf_compute_sample(pf_compute *c, float *out, unsigned n);

#endif
