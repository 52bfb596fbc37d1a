/* tune_sim.h - (tier-tune) a trace-driven simulator of the store's HBM and DDR caches, NVMe below
 * as unbounded, under LRU, LFU with decay, cost, schedule and Belady's MIN, and a timeline of the
 * transfers overlapping compute under the store's prefetch window. Model: docs/trace.md. */
#ifndef TIER_TUNE_SIM_H
#define TIER_TUNE_SIM_H

#include <stddef.h>
#include <stdint.h>

typedef enum { SIM_LRU = 0, SIM_LFU, SIM_COST, SIM_SCHEDULE, SIM_MIN, SIM_NPOL } sim_policy;
const char *sim_policy_name(sim_policy p); /* lru, lfu, cost, schedule, min */

enum { SIM_ACCESS = 0, SIM_DIRTY = 1, SIM_WRITEBACK = 2, SIM_DISCARD = 3 };
typedef struct {
	uint32_t obj;   /* dense object index (0..nobj-1) */
	uint32_t step;
	uint32_t op;    /* operation (0..nops-1) the request belongs to */
	uint8_t tier;   /* 0: HBM, 1: DDR */
	uint8_t kind;   /* SIM_ACCESS (an acquire), SIM_DIRTY (a dirty release), SIM_DISCARD (data dropped) */
} sim_req;

typedef struct {
	sim_req *req;
	size_t n, cap;
	uint64_t *size; /* per dense object */
	uint64_t *id;   /* trace object id per dense object */
	size_t nobj;
	uint64_t records;
	uint64_t rec_acquires[2], rec_hits[2]; /* what the recorded store saw, per tier (hbm, ddr) */
	/* Operations: the requests between two at-op records (tier_store_at_op calls). A step record
	 * and the start of the trace open one too, counted only once a request falls in it. States:
	 * op_open 0 --sim_trace_op(keep 0)--> 1 --first request--> 0 (nops++). */
	size_t nops;
	int op_open;               /* an operation is open but not yet counted: its index is nops */
	uint32_t step_lo, step_hi; /* the steps the counted operations fall in */
} sim_trace;

/* Read the acquires and dirty releases in HBM and DDR of a trace file. 0 or a negative errno with
 * the message set (tier_fail). sim_trace_free frees what was read (also after a failure). */
int sim_trace_load(sim_trace *t, const char *path);
/* Append a request to the current operation (objects are dense indices; sizes set with
 * sim_trace_object). 0 or -ENOMEM (nothing appended). */
int sim_trace_add(sim_trace *t, uint32_t obj, uint32_t step, int tier, int kind);
/* Start a new operation in step `step`. keep: count it even if no request falls in it (an at-op:
 * it computes); else it counts only once a request is added. Requests added before the first
 * call belong to operation 0. Cannot fail. */
void sim_trace_op(sim_trace *t, uint32_t step, int keep);
/* The steps the trace's operations span (last - first + 1; 1 with no operation). */
uint32_t sim_trace_steps(const sim_trace *t);
int sim_trace_object(sim_trace *t, uint32_t obj, uint64_t size);
void sim_trace_free(sim_trace *t);

typedef struct {
	uint64_t cap[2];       /* HBM and DDR capacities in bytes */
	double half_life;      /* LFU/cost decay in steps (INFINITY: none) */
	double gbps[2];        /* PCIe (HBM<->DDR) and NVMe (DDR<->NVMe) rates in GB/s */
	double op_s;           /* compute per operation in seconds; < 0: unknown, no overlap timeline */
	unsigned window;       /* prefetch window in operations (the store's: 2); 0: demand fetches only */
} sim_config;

typedef struct {
	uint64_t hits[2], misses[2], cold[2]; /* per level; cold: first touch (no data moved) */
	uint64_t bytes[2][2];                 /* [link: pcie, nvme][0: read up, 1: written down] */
	double stall_s;                       /* bytes / rate per link, no overlap */
	/* The overlap timeline (sim_overlap), when op_s >= 0; else overlap_s is NAN, the rest 0. */
	double overlap_s;                     /* stall with transfers prefetched behind compute */
	double compute_s;                     /* operations x op_s */
	uint64_t xfer_ops;                    /* operations that move data */
	uint64_t demand_ops;                  /* of those, the ones whose transfer could not start
						 before the operation did (window 0, or no HBM room) */
	uint64_t stalled_ops;                 /* operations that waited for data */
} sim_result;

/* Replay the trace through both levels, then (op_s >= 0) the overlap timeline. 0, -EINVAL (bad
 * config), -ENOMEM; *r is zeroed first and partial on failure. */
int sim_run(const sim_trace *t, sim_policy p, const sim_config *c, sim_result *r);

/* One operation in the overlap timeline: what the replay charged to it, and when it ran. */
typedef struct {
	double xfer_s;   /* in: link time of its misses and writebacks (PCIe then NVMe, in series) */
	uint64_t in;     /* in: bytes it reads up into HBM: they need room there while earlier ops run */
	uint64_t ws;     /* in: bytes of the distinct objects it acquires in HBM (held while it runs) */
	int demand;      /* out: its transfer started only when it did */
	double start_s;  /* out: when it started (its tier_store_at_op) */
	double ready_s;  /* out: when its data was in (start_s when it moves none) */
	double stall_s;  /* out: max(0, ready_s - start_s) */
} sim_op;

/* The prefetch-overlap timeline of n operations that compute op_s seconds each (docs/trace.md):
 * operation i's transfer is issued at the start of the earliest operation k in i-window .. i-1
 * such that ws[k] + in[k+1] + ... + in[i] <= hbm_cap (at its own start if none), and the link
 * moves transfers one at a time in operation order. Fills the out fields and returns the total
 * stall in seconds; cannot fail. */
double sim_overlap(sim_op *op, size_t n, double op_s, unsigned window, uint64_t hbm_cap);

#endif
