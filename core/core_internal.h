/* core_internal.h - (internal) what the trainer's sources share: the model's objects and LoRA
 * groups, the gemm wrapper, and the pinning helper around the store. */
#ifndef TIER_CORE_INTERNAL_H
#define TIER_CORE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include "tier/model.h"
#include "tier/moe.h"

/* The matrix product: base_sgemm (row-major, strides as stored; OpenBLAS or loops). */
#include "base/blas.h"
#define core_gemm base_sgemm
/* The public layer functions of tier/model.h are the CPU reference: -ENOTSUP on other contexts. */
int core_check_dev(tier_dev *dev, const char *fn);

/* The dense tensors of a decoder layer, one store object each (NULL where the layer has none). */
enum { W_LN1, W_Q, W_K, W_V, W_O, W_QN, W_KN, W_LN2, W_ROUTER, W_GATE, W_UP, W_DOWN, W_NSLOTS };
/* Projections a LoRA group may hold: attention q, k, v, o; MLP or expert gate, up, down. */
enum { P_Q = 0, P_K, P_V, P_O, P_GATE = 0, P_UP, P_DOWN };
enum { LG_ATTN, LG_MLP, LG_EXPERT };

typedef struct {
	char name[64];  /* PEFT module path under the layer: "self_attn.q_proj", "mlp.experts.3.up_proj" */
	int proj;       /* P_* */
	int in, out;
	size_t a, b;    /* float offsets of A [r, in] and B [out, r] in the group */
} lora_mod;

/* One group of LoRA modules and where it lives: three objects, parameters, gradients and AdamW
 * moments. The attention and dense-MLP groups own theirs. The expert groups of a layer share one
 * set, owned by expert 0's group, each at its own offset: a layer's expert LoRA moves as three
 * large objects, not 3 E small ones (small objects cost the store a write-back each). */
typedef struct lora_group {
	int layer, kind, expert;
	lora_mod mods[4];
	int n_mods;
	int idx[4];           /* proj -> index in mods, -1 when not a target */
	size_t n;             /* floats of parameters */
	tier_object *param, *grad, *optim; /* the owner's objects (shared by the members) */
	size_t off;           /* this group's float offset in param and grad; 2 off in optim (m then v) */
	struct lora_group *own; /* the owner of the objects (the group itself unless an expert's) */
	int n_members;        /* owner: groups sharing its objects, consecutive in m->groups from it */
	size_t n_total;       /* owner: floats in its param object */
	int zeroed;           /* owner: its gradient object was zeroed in this step */
	float *pin_param, *pin_grad; /* owner: its objects' addresses while pinned by operation pin_seq */
	uint64_t pin_seq;
	int64_t t;            /* AdamW steps this group took (bias correction) */
	int touched;          /* gradients written since they were last zeroed */
	/* The last step's update (train_optim.c), marked at its end from zeroed and touched, which the
	 * next step clears: set_due (owner) its set gets one, due this group's parameters do. */
	int set_due, due;
} lora_group;

typedef struct {
	int moe;
	tier_object *w[W_NSLOTS];
	tier_object **experts;  /* [E], gate [I, H], up [I, H], down [H, I] back to back */
	lora_group *attn, *mlp; /* NULL when no target */
	lora_group **exp;       /* [E] or NULL */
} model_layer;

struct tier_model {
	tier_store *s;
	tier_dev *dev;
	tier_hf_config cfg;
	tier_lora_cfg lora;
	float scale, eps, theta;
	int L, H, nh, nkv, hd, I, Ie, E, k, V;
	int mixtral;  /* model_type mixtral: no q/k norms, top-k-then-softmax router, block_sparse_moe names */
	int cuda;     /* a CUDA context: frozen weights bf16 in device memory, core/ops_cuda.h computes */
	size_t wsz;   /* bytes per element of the frozen weights: 4 (fp32, CPU) or 2 (bf16, CUDA) */
	tier_object *embed, *norm, *lm_head; /* lm_head == embed when tied */
	model_layer *layers;
	lora_group *groups;
	size_t n_groups;
	uint64_t base_bytes, lora_n;
	int have_data;
	int grads_spent; /* the last step's optimizer consumed (dropped) the LoRA gradients */
	/* A trainer whose last step's optimizer update waits for each layer's next forward
	 * (tier_train_cfg.optim_in_forward) runs what is still due through settle(settle_arg) before
	 * anything reads or writes the LoRA state from outside (model_settle); settle_err: the rc of an
	 * update that failed part-way (the weights lack part of it: no export until a checkpoint is
	 * loaded). */
	int (*settle)(void *arg);
	void *settle_arg;
	int settle_err;
	tier_progress_fn progress; /* tier_model_set_progress */
	void *progress_arg;
};

/* Shape of a dense slot of layer l: rows x cols (cols 0 for a vector); 0 when the layer has none. */
int model_slot_shape(const tier_model *m, int l, int slot, int *rows, int *cols);
/* HF tensor name of a slot ("model.layers.3.self_attn.q_proj.weight"). */
void model_slot_name(const tier_model *m, int l, int slot, char *buf, size_t len);
/* LoRA reference of projection `proj` of a group, pointers into its parameter and gradient
 * copies (grad NULL: no gradients). rank 0 / NULL pointers when the projection is no target. */
void model_lora_ref(const tier_model *m, const lora_group *g, int proj, const float *param, float *grad,
		    tier_lora_ref *out);

/* Fill every frozen object through fn (name: its HF tensor name; an expert object is named
 * "model.layers.L.mlp.experts.E" and holds gate, up, down). fn writes n fp32 values into host
 * memory; on CUDA they are rounded to bf16 and copied to the object. dfn (may be NULL) fills a
 * bf16 device object directly instead, on CUDA. Sets have_data on success. */
typedef int (*fill_fn)(tier_model *m, float *dst, size_t n, const char *name, void *arg);
typedef int (*fill_dev_fn)(tier_model *m, void *dst, size_t n, const char *name, void *arg);
int model_fill_all(tier_model *m, fill_fn fn, fill_dev_fn dfn, void *arg);

/* Run a trainer's deferred optimizer update before the LoRA state is read or written from outside
 * its steps (tier_model.settle); 0, or the error that left the update undone. */
int model_settle(tier_model *m);

/* Object memory from and to the host: plain copies on the CPU, synchronous cudaMemcpy on CUDA. */
int core_put(const tier_model *m, void *dst, const void *src, size_t bytes);
int core_get(const tier_model *m, void *dst, const void *src, size_t bytes);

/* Objects pinned during one operation, released together (dirty as recorded). */
#define PIN_MAX 4096
typedef struct {
	tier_store *s;
	int n;
	tier_object *obj[PIN_MAX];
	unsigned char dirty[PIN_MAX];
	unsigned char init[PIN_MAX]; /* acquired with TIER_ACQ_INIT, fill not yet ended */
} pinset;
/* Pin o in HBM (flags: TIER_ACQ_INIT for a fresh fill); *p its address. dirty: release dirty. */
int pin(pinset *ps, tier_object *o, unsigned flags, int dirty, float **p);
/* Release everything; returns the first error. On CUDA the caller waits for the stream first
 * (the store may move or reuse a released copy at once). */
int pin_release_all(pinset *ps);
/* End the fills of the set's TIER_ACQ_INIT pins (tier_fill_done), keeping every pin: later
 * operations may pin those objects while this set's kernels still run. The first error. */
int pin_fill_done_all(pinset *ps);

/* The trainer's model and step counter (for checkpoint.c). */
tier_model *trainer_model(tier_trainer *t);
int64_t trainer_step_index(const tier_trainer *t);
void trainer_set_step(tier_trainer *t, int64_t step);
/* Forget the optimizer update still due (train_optim.c): a checkpoint's state replaced it. */
void trainer_optim_drop(tier_trainer *t);

#endif
