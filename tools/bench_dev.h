/* bench_dev.h - device helpers of the benchmarks: buffers of small finite values (tier-bench fused,
 * lora), and the time of one call on the context's compute stream by CUDA events (under
 * bench_measure_ms, through which every benchmark times). Declared in CUDA builds only
 * (TIER_HAVE_CUDA). */
#ifndef TIER_TOOLS_BENCH_DEV_H
#define TIER_TOOLS_BENCH_DEV_H

#include "config.h"
#ifdef TIER_HAVE_CUDA
#include <stddef.h>
#include "tier/base.h"

/* n bytes of device memory at *p filled with small finite values: fp32 (el 4) or bf16 (el 2), of
 * either sign around 0 (fp32) or around 0.25 (bf16). */
int bench_dev_buf(tier_dev *d, void **p, size_t n, int el);

typedef struct {
	tier_dev *dev;
	void *e0, *e1; /* cudaEvent_t */
} bench_timer;

int bench_timer_open(bench_timer *t, tier_dev *d);
void bench_timer_close(bench_timer *t);
/* The nanoseconds call(arg) takes on the compute stream; -1 with *rc set when the call or the events
 * failed (*rc: the call's status, or -EIO). */
double bench_timer_run(bench_timer *t, int (*call)(void *arg), void *arg, int *rc);

#endif
#endif
