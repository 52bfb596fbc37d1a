/* tune_sim.h - (tier-tune) a trace-driven simulator of the store's HBM and DDR caches, NVMe below
 * as unbounded, under LRU, LFU with decay, cost, schedule and Belady's MIN. Model: docs/trace.md. */
#ifndef TIER_TUNE_SIM_H
#define TIER_TUNE_SIM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { SIM_LRU = 0, SIM_LFU, SIM_COST, SIM_SCHEDULE, SIM_MIN, SIM_NPOL } sim_policy;
const char *sim_policy_name(sim_policy p); /* lru, lfu, cost, schedule, min */

enum { SIM_ACCESS = 0, SIM_DIRTY = 1, SIM_WRITEBACK = 2 };
typedef struct {
	uint32_t obj;   /* dense object index (0..nobj-1) */
	uint32_t step;
	uint8_t tier;   /* 0: HBM, 1: DDR */
	uint8_t kind;   /* SIM_ACCESS (an acquire) or SIM_DIRTY (a dirty release) */
} sim_req;

typedef struct {
	sim_req *req;
	size_t n, cap;
	uint64_t *size; /* per dense object */
	uint64_t *id;   /* trace object id per dense object */
	size_t nobj;
	uint64_t records;
	uint64_t rec_acquires[2], rec_hits[2]; /* what the recorded store saw, per tier (hbm, ddr) */
} sim_trace;

/* Read the acquires and dirty releases in HBM and DDR of a trace file. 0 or a negative errno with
 * the message set (tier_fail). sim_trace_free frees what was read (also after a failure). */
int sim_trace_load(sim_trace *t, const char *path);
/* Append a request (objects are dense indices; sizes set with sim_trace_object). 0 or -ENOMEM. */
int sim_trace_add(sim_trace *t, uint32_t obj, uint32_t step, int tier, int kind);
int sim_trace_object(sim_trace *t, uint32_t obj, uint64_t size);
void sim_trace_free(sim_trace *t);

typedef struct {
	uint64_t cap[2];       /* HBM and DDR capacities in bytes */
	double half_life;      /* LFU/cost decay in steps (INFINITY: none) */
	double gbps[2];        /* PCIe (HBM<->DDR) and NVMe (DDR<->NVMe) rates in GB/s */
} sim_config;

typedef struct {
	uint64_t hits[2], misses[2], cold[2]; /* per level; cold: first touch (no data moved) */
	uint64_t bytes[2][2];                 /* [link: pcie, nvme][0: read up, 1: written down] */
	double stall_s;                       /* bytes / rate per link, no overlap */
} sim_result;

/* Replay the trace through both levels. 0, -EINVAL (bad config), -ENOMEM. */
int sim_run(const sim_trace *t, sim_policy p, const sim_config *c, sim_result *r);

#endif
