/* formats.h - Hugging Face formats: dtypes, safetensors (read, validate, write), sharded checkpoints,
 * expert layouts, config.json, PEFT LoRA adapters, and atomic file writes. */
#ifndef TIER_FORMATS_H
#define TIER_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Element types (safetensors' names) ----------------------------------------------------- */
typedef enum {
	TIER_DT_F32 = 0, TIER_DT_BF16, TIER_DT_F16, TIER_DT_F64, TIER_DT_F8_E4M3, TIER_DT_F8_E5M2,
	TIER_DT_I64, TIER_DT_I32, TIER_DT_I16, TIER_DT_I8, TIER_DT_U64, TIER_DT_U32, TIER_DT_U16,
	TIER_DT_U8, TIER_DT_BOOL, TIER_DT_COUNT
} tier_dtype;

const char *tier_dtype_name(tier_dtype dt);          /* "F32", "BF16", ... ("?" when out of range) */
size_t tier_dtype_size(tier_dtype dt);               /* bytes per element, 0 when out of range */
/* Parse a safetensors dtype name. 0, or -EINVAL (message names the text) with *out unchanged. */
int tier_dtype_parse(const char *name, tier_dtype *out);

/* Scalar conversions; float -> 16-bit rounds to nearest, ties to even; NaN stays NaN (quiet),
 * overflow gives infinity, f16 subnormals are exact. Pure functions, thread-safe. */
float tier_bf16_to_f32(uint16_t h);
uint16_t tier_f32_to_bf16(float f);
float tier_f16_to_f32(uint16_t h);
uint16_t tier_f32_to_f16(float f);
/* Convert n elements between F32, BF16 and F16 (any pair, same type is a copy). dst and src must
 * not overlap. 0, or -ENOTSUP naming the dtype for other types (dst untouched). Thread-safe. */
int tier_dtype_convert(void *dst, tier_dtype dst_dt, const void *src, tier_dtype src_dt, size_t n);

/* ---- Atomic file writes ------------------------------------------------------------------------
 * begin creates a temporary file next to `path`; write appends; commit flushes it (fsync), renames
 * it over `path` and fsyncs the directory, so a crash leaves either the old file or the complete
 * new one; abort removes the temporary. commit and abort free the handle, whatever they return.
 * One handle per thread at a time. */
typedef struct tier_atomic_file tier_atomic_file;
int tier_atomic_write_begin(const char *path, tier_atomic_file **out); /* -errno; *out NULL */
int tier_atomic_write(tier_atomic_file *f, const void *buf, size_t n); /* 0 or -errno (-EIO, -ENOSPC) */
int tier_atomic_write_commit(tier_atomic_file *f); /* on failure the temporary is removed, path unchanged */
void tier_atomic_write_abort(tier_atomic_file *f);  /* NULL is fine */

/* ---- safetensors ------------------------------------------------------------------------------
 * Layout: 8-byte little-endian header length N, N bytes of JSON, then the data region. Every header
 * is validated as the reference implementation does (see docs/formats.md): length within the file
 * and at most TIER_ST_MAX_HEADER, one JSON object, known dtypes, shapes whose byte size equals
 * end - begin without overflow, offsets inside the data region, tensors covering the data region
 * without holes or overlap, unique names, __metadata__ string -> string. */
#define TIER_ST_MAX_HEADER 100000000ull
#define TIER_ST_MAX_DIMS 8

typedef struct tier_st tier_st;
typedef struct {
	const char *name;
	tier_dtype dtype;
	int ndim;
	uint64_t shape[TIER_ST_MAX_DIMS];
	uint64_t offset;  /* absolute byte offset in the file */
	uint64_t nbytes;
} tier_st_tensor;

/* Open and validate a file. 0; -ENOENT/-EACCES/... for the file; -EBADMSG for a malformed header;
 * -EOVERFLOW for sizes that overflow; -ENOTSUP for > TIER_ST_MAX_DIMS dims; -ENOTSUP without
 * jansson. Messages name the file, the tensor and the problem. On failure *out is NULL.
 * A tier_st is immutable: lookups and reads may run from many threads at once. */
int tier_st_open(const char *path, tier_st **out);
/* The validating parser tier_st_open uses: `buf` holds the first `len` bytes of a file whose size
 * is `file_size` (len <= file_size; the header must fit in len). `what` names it in messages.
 * The result has no file behind it: tier_st_read on it returns -EBADF. */
int tier_st_parse_header(const void *buf, size_t len, uint64_t file_size, const char *what, tier_st **out);
void tier_st_close(tier_st *st);                 /* NULL is fine */
const char *tier_st_path(const tier_st *st);
size_t tier_st_count(const tier_st *st);
/* Tensors in data-offset order; NULL when i >= count. */
const tier_st_tensor *tier_st_at(const tier_st *st, size_t i);
/* NULL when absent (no error message is set). */
const tier_st_tensor *tier_st_find(const tier_st *st, const char *name);
/* __metadata__ value for key, or NULL. */
const char *tier_st_metadata(const tier_st *st, const char *key);
uint64_t tier_st_numel(const tier_st_tensor *t);
/* Read tensor `name` whole into dst; bytes must equal its size. 0, -ENOENT (no such tensor),
 * -EINVAL (size), -EIO (short read). dst is caller memory (a store object, a pinned buffer). */
int tier_st_read(const tier_st *st, const char *name, void *dst, size_t bytes);
/* Read bytes [off, off + bytes) of tensor t. 0, -EINVAL when out of the tensor, -EIO. */
int tier_st_read_range(const tier_st *st, const tier_st_tensor *t, uint64_t off, void *dst, size_t bytes);
/* Read tensor `name` and convert it to dst_dt (F32, BF16 or F16); `count` must equal its element
 * count. -ENOTSUP for other dtypes, -ENOMEM, or what tier_st_read returns. */
int tier_st_convert(const tier_st *st, const char *name, void *dst, tier_dtype dst_dt, size_t count);

/* A tensor to write: data holds numel * dtype size bytes, row-major. */
typedef struct {
	const char *name;
	tier_dtype dtype;
	int ndim;
	uint64_t shape[TIER_ST_MAX_DIMS];
	const void *data;
} tier_st_wtensor;
/* Write a safetensors file atomically (see tier_atomic_write_begin). metadata: NULL or a
 * NULL-terminated list of key, value, key, value, ... strings. 0, -EINVAL (bad or duplicate name,
 * bad shape), -EOVERFLOW, -errno from the file system; on failure `path` is unchanged. */
int tier_st_write(const char *path, const tier_st_wtensor *t, size_t n, const char *const *metadata);

/* ---- Checkpoints: one model.safetensors or shards named by model.safetensors.index.json ----- */
typedef struct tier_ckpt tier_ckpt;
/* Open a model directory. Validates the index (weight_map name -> file), opens every shard (each
 * fully validated) and checks that each mapped tensor is in its file. 0, or the error of the first
 * problem found (message names the file and tensor); *out NULL on failure. Immutable after open:
 * thread-safe for lookups and reads. */
int tier_ckpt_open(const char *model_dir, tier_ckpt **out);
void tier_ckpt_close(tier_ckpt *ck);             /* NULL is fine */
size_t tier_ckpt_shard_count(const tier_ckpt *ck);
const tier_st *tier_ckpt_shard(const tier_ckpt *ck, size_t i);
/* Find a tensor across shards. 0, or -ENOENT naming the tensor; outputs untouched on failure. */
int tier_ckpt_find(const tier_ckpt *ck, const char *name, const tier_st **st, const tier_st_tensor **t);

/* Expert weights: where gate, up and down of (layer, expert) live, in any of three layouts:
 * per expert  model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight (Qwen3-MoE),
 * Mixtral     model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight (w1 gate, w3 up, w2 down),
 * fused 3-D   model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] and .down_proj [E, H, I]
 *             (gate is the first I rows of an expert's [2I, H] slice). */
typedef enum { TIER_EXPERTS_PER_EXPERT = 0, TIER_EXPERTS_MIXTRAL, TIER_EXPERTS_FUSED } tier_expert_layout;
typedef struct {
	const tier_st *st;         /* the shard */
	const tier_st_tensor *t;   /* the tensor that holds the slice */
	uint64_t off;              /* byte offset of the slice inside t: read with tier_st_read_range */
	uint64_t nbytes;
	uint64_t rows, cols;       /* the slice is a row-major [rows = out, cols = in] matrix */
	tier_dtype dtype;
} tier_expert_part;
typedef struct {
	tier_expert_layout layout;
	tier_expert_part gate, up, down;
} tier_expert_weights;
/* 0; -ENOENT when the layer has no experts in any layout; -EBADMSG when shapes disagree (gate vs up
 * vs down, a fused tensor not 3-D, expert index >= E). *out untouched on failure. Thread-safe. */
int tier_ckpt_expert(const tier_ckpt *ck, int layer, int expert, tier_expert_weights *out);

/* ---- config.json (qwen3_moe, mixtral) -------------------------------------------------------- */
#define TIER_HF_MAX_LAYERS 4096
/* Largest sizes a config may give (far above any model's, low enough that parameter and byte
 * counts of layers x experts x width x width stay inside 64 bits): widths (hidden, intermediate,
 * head_dim x heads), vocabulary, experts and heads. */
#define TIER_HF_MAX_WIDTH (1ll << 18)
#define TIER_HF_MAX_VOCAB (1ll << 22)
#define TIER_HF_MAX_EXPERTS (1ll << 14)
#define TIER_HF_MAX_HEADS (1ll << 14)
typedef struct {
	char model_type[16];            /* "qwen3_moe" or "mixtral" */
	int64_t hidden_size, intermediate_size, moe_intermediate_size; /* mixtral: moe = intermediate */
	int64_t num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim;
	int64_t vocab_size, max_position_embeddings;
	int64_t num_experts;            /* num_experts (qwen3_moe) or num_local_experts (mixtral) */
	int64_t num_experts_per_tok, decoder_sparse_step;
	double rms_norm_eps, rope_theta, router_aux_loss_coef;
	int norm_topk_prob;             /* mixtral: 1 (softmax over the top k) */
	int tie_word_embeddings, output_router_logits;
	tier_dtype dtype;               /* torch_dtype / dtype: F32, BF16 or F16 */
	uint64_t mlp_only[TIER_HF_MAX_LAYERS / 64]; /* bit L set: layer L has a dense MLP */
} tier_hf_config;
/* Load config.json. 0; -ENOTSUP for an unsupported model_type or rope_scaling (named) and without
 * jansson; -EBADMSG for a missing key or wrong JSON type (named, with the file); -ENOENT/... for the
 * file. *out is fully written on success and untouched on failure. Thread-safe. */
int tier_hf_config_load(const char *path, tier_hf_config *out);
/* 1 when layer L uses the sparse MoE block (mlp_only_layers and decoder_sparse_step applied). */
int tier_hf_layer_is_moe(const tier_hf_config *c, int layer);

/* ---- PEFT LoRA adapters ----------------------------------------------------------------------
 * Keys: base_model.model.model.layers.{L}.{module}.lora_A.weight [r, in] and .lora_B.weight
 * [out, r], where module is the path under the decoder layer ("self_attn.q_proj",
 * "mlp.experts.3.gate_proj", "block_sparse_moe.experts.3.w1", "mlp.down_proj"). */
typedef struct {
	int layer;
	char module[96];
	int64_t in, out;   /* the base projection's in and out features */
	float *a;          /* [r, in] row-major */
	float *b;          /* [out, r] row-major */
} tier_peft_module;
typedef struct {
	int r;
	double lora_alpha, lora_dropout;
	int use_rslora;
	char base_model[256];            /* base_model_name_or_path ("" for null) */
	char target_modules[16][32];     /* module names; when n_targets is 0 on save, derived */
	int n_targets;
	tier_dtype dtype;                /* of adapter_model.safetensors: F32 (default), BF16 or F16 */
	tier_peft_module *modules;
	size_t n_modules;
} tier_peft_adapter;
/* Write dir/adapter_config.json and dir/adapter_model.safetensors (each atomically; dir must
 * exist). 0, -EINVAL naming the bad module, -errno from the file system. Thread-safe. */
int tier_peft_save(const char *dir, const tier_peft_adapter *a);
/* Read an adapter back. When cfg is not NULL each module's shapes are checked against the model
 * (layer index, in/out features of the projection). 0, -EBADMSG naming the key and problem,
 * -ENOTSUP (peft_type other than LORA, fused 3-D target_parameters, non-"none" bias); *out NULL
 * on failure. Free with tier_peft_free. Thread-safe. */
int tier_peft_load(const char *dir, const tier_hf_config *cfg, tier_peft_adapter **out);
void tier_peft_free(tier_peft_adapter *a);       /* frees modules, their a/b, and a; NULL is fine */

#ifdef __cplusplus
}
#endif
#endif
