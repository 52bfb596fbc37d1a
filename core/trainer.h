/* trainer.h - (internal) the trainer's state and what its sources share: train.c (creation, the
 * operations, the step), train_sched.c (the step's schedule for the store), train_optim.c (the
 * gradient norm and AdamW) and train_cache.c (the operator cache's entries). */
#ifndef TIER_CORE_TRAINER_H
#define TIER_CORE_TRAINER_H

#include "core/decoder.h"
#include "core/ops_cuda.h"
#include "tier/cache.h"
#include "tier/loss.h"

/* What follows an operation once its kernels are done (train.c, trainer_post): the checkpoints it
 * wrote start down (spilling steps), the ones spent are dropped, final gradients written down. */
enum { POST_NONE, POST_FWD, POST_LOSS, POST_BWD, POST_OPTIM };

/* An operation as far as its end is concerned (train_pending.c): its post, for micro-batches
 * [mb0, mb1) (last_at: the one whose gradients become final, or -1; POST_OPTIM: the batch's LoRA
 * groups [mb0, mb1)), and the op cache entries it
 * leaves pinned: an asynchronous offer's (finished by tier_cache_offer_done) or a restore's get
 * (released as done). */
#define OP_KEYS 64
typedef struct {
	int post, l, mb0, mb1, last_at;
	int nkeys;
	tier_cache_key key[OP_KEYS];
	unsigned char got[OP_KEYS]; /* 1: a get, 0: an offer */
} trainer_opdesc;

/* An op cache entry of the attention's output on its way to a block of the scratch. */
typedef struct {
	tier_cache_key key;
	int on;                /* a hit, pinned in DDR, whose copy is queued */
} trainer_core_pend;

struct tier_trainer {
	tier_model *m;
	tier_train_cfg c;
	dec_shape sh;
	dec_bufs b;
	tier_object *scratch;  /* ACT, discardable: the buffers above, the loss's lse and workspace */
	void *scratch_p;       /* its address while pinned (from a step's start; across steps if kept) */
	int scratch_keep;      /* keep it pinned between steps (scratch_end) */
	tier_object **ckpt;    /* [nck][L + 1] ACT: the input of each layer (ckpt[L]: the last output) */
	tier_object **ck;      /* the current micro-batch's row of ckpt (use_mb) */
	int nck;               /* rows: micro_batches in a layer-major step, else 1 */
	size_t dec_bytes, loss_ws;
	tier_loss_params lp;
	float *gcur, *gnext, *lse, *hn;  /* in scratch: gradient ping-pong [T, H], loss lse [T], final norm [T, H] */
	float *g0, *g1;        /* the ping-pong's two buffers as carved */
	size_t th;             /* bytes of one fp32 [T, H] scratch buffer (64-aligned) */
	float *gmb;            /* layer-major: each micro-batch's running gradient [nck][T, H] (in scratch) */
	void *lws;
	pinset ps;             /* the current operation's pins */
	trainer_opdesc opc;    /* the current operation's end */
	/* Pipelined operations (train_pending.c): an operation ends by putting a waypoint; its pins,
	 * cache entries and post wait until the next operation's kernels are queued, so that the device
	 * is not idle while the host pins and queues. */
	int pipeline;          /* on unless $TIER_PIPELINE=0, $TIER_PROFILE, or the HBM budget cannot
				* hold two operations' pins (unless $TIER_PIPELINE=force) */
	int pipe_force;
	int prev_on;           /* the operation before still holds ps_prev and opp */
	pinset ps_prev;
	trainer_opdesc opp;
	tier_waypoint *wp;
	int n_piped, n_early;  /* the step's pipelined operations; finished early (tier_step_result) */
	int n_routes;          /* the step's routings for the experts to fetch (tier_step_result.routes) */
	size_t op;             /* index into the schedule */
	int64_t step;
	int32_t *counts;       /* [E] */
	int32_t *fcounts;      /* [nck (L + 1) E]: each layer's forward counts by micro-batch slot (as ck), */
	uint8_t *fvalid;       /* [nck (L + 1)] set by that forward, taken by the backward's recompute: it pins
				* the same experts without routing again (the router's choices read back to
				* the host: a wait for the device between the attention and the MLP) */
	uint8_t *mkept;        /* [nck (L + 1)] by slot as fvalid: the TIER_MOE_KEPT_* bits of that forward's
				* MoE state, set again (but h's) on the state the operator cache gives back */
	int64_t *lcounts;      /* [L E]: tokens routed to each expert by the last step's (or eval's) forwards */
	int64_t *mbcounts;     /* [L E]: the same for the latest micro-batch forward alone, and for the */
	int64_t *prevcounts;   /* forward before it: the step schedule lists the experts the latest routed
				* to for the backward, and those either routed to for the next forwards */
	int sched_routed;      /* $TIER_SCHED_ROUTED: 0 none, 1 backward (default), 2 all operations */
	int moe_routed;        /* $TIER_MOE_ROUTED (default 1; 0 off): dec_shape.routed where one chunk */
	int qk_fused;          /* $TIER_QK_FUSED (default 1; 0 off): dec_shape.qk_fused */
	int qkv_cat;           /* $TIER_QKV_CAT (default 1; 0 off): dec_shape.qkv_cat where it applies */
	int qkv_fwd_cat;       /* $TIER_QKV_FWD_CAT (default 0; 1 on): dec_shape.qkv_fwd_cat */
	int qkv16;             /* $TIER_QKV16 (default 1; 0 off): dec_shape.qkv16 where it applies */
	int attn_res;          /* $TIER_ATTN_RES (default 1; 0 off): dec_shape.attn_res */
	int moe_res;           /* $TIER_MOE_RES (default 1; 0 off): dec_shape.moe_res */
	int keep_h;            /* $TIER_MOE_KEEP_H (default 1; 0 off): dec_shape.keep_h where the op
				* cache may keep the MoE half */
	int have_mbcounts;     /* 0 before the first forward (and with $TIER_SCHED_ROUTED=0): all experts */
	uint8_t *sched_skip;   /* [L E]: the experts the store's schedule left out of their operations, */
	int sched_built;       /* once built: a schedule leaving out the same ones is not built again */
	const float **ptr;     /* [15 E]: expert weight and LoRA pointer arrays */
	uint64_t min_hbm, hbm_cap;
	/* CUDA: bf16 copies of one layer's LoRA (l16, in scratch) made by one batched conversion
	 * (host segment lists cv_*); tokens, labels and the loss's scalars in device memory; hidx: the
	 * router's choices copied back to count tokens per expert. */
	uint16_t *l16;
	size_t l16_off;
	const float **cv_src;
	uint16_t **cv_dst;
	size_t *cv_len;
	int cv_n;
	int32_t *tok_d, *lab_d, *hidx;
	float *loss_d;
	int64_t *count_d;
	double *acc_d;
	uint64_t part[TIER_NPARTS], mark; /* time by part of the step; the current part's start */
	uint64_t pin_part[TIER_NPARTS], pin_since; /* of it acquiring objects; since the last charge */
	tier_marks *marks;                /* the same charges on the device's clock (NULL: host only) */
	int marking;                      /* inside a step: each charge puts a mark */
	tier_cache *cache;                /* the operator cache (NULL: full recompute) */
	int offer;                        /* a training forward: offer its results to the cache */
	int reserved[2], placed[2];       /* the current forward's halves reserved in the cache; the
					   * halves whose buffers are in a cache entry now */
	int kept[2];                      /* reserved and admitted */
	int core_copy;                    /* the attention's output is on the copy stream to its entry */
	int core_placed;                  /* b.o and b.lse are not the attention half's own */
	int bslot;                        /* the backward's slot (layer, micro-batch) in order */
	trainer_core_pend core_pend[2];   /* the attention's output coming for the slot of each parity */
	uint8_t *core_kept;               /* [micro_batches L]: this pass's forward had the cache keep it */
	int training;                     /* a training step (LoRA dropout on), not an evaluation */
	uint64_t op_seq;                  /* operations ended (pin_group's cache key); starts at 1 */
	uint32_t mb;                      /* the current micro-batch (the cache's key) */
	int last_mb;                      /* it is the step's last: the LoRA gradients become final */
	int profile;                      /* $TIER_PROFILE: wait for the device at the end of each part */
	int spill;                        /* the step's objects exceed the HBM budget: what is written
					   * and read again later is written down ahead of its eviction */
	double gss;                       /* CPU: the sum of squares of the step's LoRA gradients */
	/* The optimizer (train_optim.c): each layer's groups [glo[l], glo[l + 1]); a step's update is
	 * marked at its end with its lr and clip scale and runs then, or with defer before each layer's
	 * next forward (tier_train_cfg.optim_in_forward; only where the HBM budget keeps the scratch
	 * pinned beside an optimizer set); opt_due[l]: layer l's update is still to run; in_fwd: one
	 * runs inside a step (the scratch, in use, may not be dropped for room); n_deferred: the
	 * step's deferred updates (tier_step_result.updates_in_forward). */
	size_t *glo;
	uint8_t *opt_due;
	uint8_t *sched_due;    /* [L] the layers due as the schedule lists them (deferred: a layer with
				* none due lists no objects for its update, prefetching none) */
	int defer, in_fwd, n_deferred;
	float opt_lr, opt_gs;
	opsc_adamw_t *aw;                 /* CUDA: the optimizer batch's updates, one launch (train_optim.c) */
	struct lora_group **aw_grp;       /* their groups (a batch not launched takes their steps back) */
	int aw_n, aw_cap;
};

/* train.c: charge the time since the last mark to a part of the step; pin an object for the
 * current operation (timed). */
void trainer_charge(tier_trainer *t, int part);
int trainer_pin(tier_trainer *t, tier_object *o, unsigned flags, int dirty, float **p);
/* The post of an operation (the objects it names must be unpinned): POST_*, layer l, micro-batches
 * [mb0, mb1), last_at as in trainer_opdesc. 0 or the first error. */
int trainer_post(tier_trainer *t, int post, int l, int mb0, int mb1, int last_at);

/* train_pending.c: end the current operation with its post (trainer_opdesc's fields): pipelined,
 * it is queued and the operation before it is finished (waited for, released, posted); else, or
 * after an error (rc), as trainer_op_end followed by the post. finish_prev: wait for and finish
 * the operation before (0 when there is none). op_end: wait for the device, finish both (the
 * current one's post only when it has one: operations ended this way post themselves). The first
 * error wins. */
int trainer_op_close(tier_trainer *t, int rc, int post, int l, int mb0, int mb1, int last_at);
int trainer_finish_prev(tier_trainer *t);
int trainer_op_end(tier_trainer *t, int rc);
/* Record an op cache entry the current operation leaves pinned (got: a get, else an async offer);
 * 0 when recorded, 1 when the list is full (the caller waits and finishes it now). */
int trainer_op_key(tier_trainer *t, tier_cache_key key, int got);
/* Announce the next operation of the step's schedule to the store (prefetches what follows). */
void trainer_at_op(tier_trainer *t);
/* Unpin and drop the scratch kept between steps (the optimizer, short of room); 0 or the error. */
int trainer_scratch_drop(tier_trainer *t);

/* train_sched.c: hand the step's operations (objects, forward then backward, then the optimizer, or
 * deferred each layer's update before its forward)
 * to the store's prefetcher and schedule-aware policy; a backward lists only the experts its
 * micro-batch's forward routed tokens to, so that the store does not bring experts that no token
 * uses (forwards too with $TIER_SCHED_ROUTED=all, from the latest routing). */
int trainer_set_schedule(tier_trainer *t);
/* The schedule's index of layer l's optimizer operation; sched_due: the schedule rebuilt when the
 * deferred updates due (t->opt_due) differ from those it lists. */
size_t trainer_sched_optim_at(const tier_trainer *t, int l);
int trainer_sched_due(tier_trainer *t);

/* train_optim.c: the learning rate of step s; the global LoRA gradient norm (its sum of squares
 * reset at the start of a step and accumulated by trainer_grads_done as each layer's gradients are
 * final, while they are in HBM); AdamW on every group that received gradients. */
float trainer_lr_at(const tier_train_cfg *c, int64_t s);
int trainer_grad_norm_reset(tier_trainer *t);
int trainer_grads_done(tier_trainer *t, int l);
int trainer_grad_norm(tier_trainer *t, double *out);
/* The step's end: mark the update of every group that received gradients (lr, clip scale gscale)
 * and run it now, layer by layer from the last (each an operation of the schedule), or with
 * t->defer leave it due. optim_due: before layer l's first forward in a step (its schedule slot
 * announced), layer l's update when due. settle: every update still due, now (before anything
 * outside the steps reads or writes the LoRA state); trainer_optim_drop (core_internal.h) forgets
 * them. */
int trainer_optim_step(tier_trainer *t, float lr, float gscale);
int trainer_optim_due(tier_trainer *t, int l);
int trainer_optim_settle(tier_trainer *t);
/* An optimizer batch's post (groups [from, to)): their gradients dropped, state written down. */
int trainer_optim_post(tier_trainer *t, size_t from, size_t to);

/* train_cache.c: the operator cache from the config's rules (none when empty); offer layer l's
 * forward results; restore half h of them in the backward (1 restored, 0 recompute; *rc on error). */
int trainer_cache_open(tier_trainer *t);
int trainer_cache_offer(tier_trainer *t, int l);
/* Before layer l's forward: reserve its halves' entries (pipelined), placing those in HBM so that
 * the forward writes them in place. place: half h's buffers at `at` (NULL: back home); unplace:
 * every placed half back home (after the operation's forward or backward queued its kernels). */
int trainer_cache_reserve(tier_trainer *t, int l);
void trainer_cache_place(tier_trainer *t, int h, void *at);
void trainer_cache_unplace(tier_trainer *t);
int trainer_cache_restore(tier_trainer *t, int l, int h, int *rc);
/* The attention's output alone, kept when the attention half is not (train_cache.c's OP_CORE):
 * offer_core after a forward's attention queues its copy to the entry (joined by
 * trainer_cache_offer). In the backward: bwd_begin before a slot's recompute (its block of the
 * scratch placed, its copy started unless one came ahead), restore_core in place of the
 * attention (1: the copy joined, o and lse there), bwd_end after the slot's kernels (the copy for
 * the slot after next started); core_drop at a backward's end or failure (pending entries go). */
int trainer_cache_offer_core(tier_trainer *t, int l);
int trainer_cache_bwd_begin(tier_trainer *t, int l);
int trainer_cache_restore_core(tier_trainer *t, int l, int *rc);
int trainer_cache_bwd_end(tier_trainer *t, int l);
int trainer_cache_core_drop(tier_trainer *t);

#endif
