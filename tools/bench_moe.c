/* bench_moe.c - tier-bench moe: time of each MoE step (router, permute, experts, combine and their
 * backward) and of the whole block forward and forward+backward, on the model shapes with
 * uniform and Zipf(1.2) routing. The peer (torch._grouped_mm and a torchtitan-style block) is
 * measured by bench/moe_torch.py, which reads the --json line and prints the ratios.
 *
 * Routing is imposed through the router rather than faked: x[t, e] (e < E) is 3 + a little for the
 * k experts sampled for token t and small noise elsewhere, and W_r is the identity on its first E
 * columns plus 1e-3 noise, so the router's top-k (a real top-k of real logits) returns the sample. */
#include "config.h"
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "tier/tier.h"
#include "tools/bench.h"
#ifdef TIER_HAVE_CUDA
#include <library_types.h>
#include "base/gemm_cuda.h"
#include "moe/moe_wgmma.h"
#endif

static const char *const cmd = "moe";

typedef struct {
	const char *name;
	int T, H, I, E, k;
} moe_shape;

static const moe_shape models[] = {
	{ "qwen3-30b", 16384, 2048, 768, 128, 8 },
	{ "seed-896", 8192, 2048, 512, 896, 16 },
	{ "mixtral", 8192, 4096, 14336, 8, 2 },
};
#define N_MODELS (int)(sizeof models / sizeof models[0])
#define MAX_SHAPES 8

typedef struct {
	bench_run_opts run;
	unsigned n_shapes, warm_ms;
	int routing; /* bit 0 uniform, bit 1 zipf */
	moe_shape shapes[MAX_SHAPES];
} moe_opts;

enum {
	OP_ROUTER, OP_PERMUTE, OP_COPY, OP_GATE_UP, OP_GATE_UP_MM, OP_DOWN, OP_DENSE_GU, OP_DENSE_DOWN, OP_EXPERTS_FWD,
	OP_COMBINE_FWD, OP_COMBINE_BWD, OP_EXPERTS_BWD, OP_PERMUTE_BWD, OP_ROUTER_BWD, OP_BLOCK_FWD,
	OP_BLOCK_FWD_BWD, OP_EXPERTS_FWD_G, OP_BLOCK_FWD_G, N_OPS
};
static const char *const op_name[] = {
	"router",      "permute",     "d2d-copy",   "gate-up",   "gate-up-mm",    "down",          "dense-gate-up", "dense-down",
	"experts-fwd", "combine",     "combine-bwd", "experts-bwd", "permute-bwd", "router-bwd",   "block-fwd",
	"block-fwd+bwd", "experts-fwd-g", "block-fwd-g"
};
static const char *const op_key[] = {
	"router",      "permute",     "copy",        "gate_up",     "gate_up_mm",  "down",        "dense_gate_up", "dense_down",
	"experts_fwd", "combine",     "combine_bwd", "experts_bwd", "permute_bwd", "router_bwd",    "block_fwd",
	"block_fwd_bwd", "experts_fwd_grouped", "block_fwd_grouped"
};
_Static_assert(sizeof op_name / sizeof op_name[0] == N_OPS, "a name for every op");
_Static_assert(sizeof op_key / sizeof op_key[0] == N_OPS, "a JSON key for every op");

typedef struct {
	tier_dev *dev;
	int cuda, T, H, I, E, k, n, op;
	size_t el, ws_bytes, ews_bytes;
	tier_moe_cfg cfg;
	tier_moe_saved s;
	void *x, *wr, *out, *dout, *dx, *saved, *ws, *ews, *xg, *dy, *dxg, *dtw, *dl, *copy, *h, *y, *dot;
	int wgmma; /* the Hopper grouped GEMMs run here: the gate-up and down rows, and their dense peers */
	void *dw, *dout2; /* the dense peers' [2I, H] weight and [rows, 2I] output */
	void **wg, **wu, **wd;
	tier_moe_experts w;
	int rows;       /* kept rows (dropless: n) */
	int used;       /* experts with at least one row: the weights a grouped product must read */
	double tiled;   /* rows the 128-row tiles multiply: every group rounded up to 128 */
	double idle;    /* the same with idle consumers (TIER_MOE_WGMMA_IDLE=1): a last tile of 64 rows or
			 * fewer multiplies 64 */
	int32_t *sel;   /* the sampled routing [T, k] */
	long missed;    /* picks of the router outside the sample (should be 0) */
} moe_case;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench moe [--device cuda|cpu] [--model NAME]... [--shape T,H,I,E,k]... [--routing R]\n"
		"                      [--iters N] [--warmup-ms N] [--json]\n"
		"Time of tier's MoE block on CUDA (bf16 storage, fp32 accumulation): each step through the public\n"
		"API (router, permute with gather, experts forward, combine, and the backward of combine, experts,\n"
		"permute and router) and the whole block forward and forward+backward (input gradient; frozen\n"
		"router and experts, no LoRA). Shapes: qwen3-30b (T=16384 H=2048 I=768 E=128 k=8), seed-896\n"
		"(T=8192 H=2048 I=512 E=896 k=16), mixtral (T=8192 H=4096 I=14336 E=8 k=2); default all three.\n"
		"Routing: uniform (k distinct experts per token) or zipf (Zipf s=1.2 over experts, without\n"
		"replacement), imposed through the router's input. Each time is the median of N runs after two\n"
		"warm-ups, timed with CUDA events on the compute stream. d2d-copy is a device-to-device copy of\n"
		"the gathered bytes: the bandwidth the permute is held to. experts-fwd-g and block-fwd-g repeat\n"
		"the forward with the device-side grouped GEMMs (TIER_MOE_GROUPED=1, no host copy of\n"
		"the offsets in the experts); the other rows follow TIER_MOE_GROUPED (docs/moe.md). gate-up and\n"
		"down time the experts' two Hopper grouped GEMMs alone (gate and up with SwiGLU, bf16 g, u and h\n"
		"out; down, bf16 y out; TIER_MOE_WGMMA_TILE applies), where they run (a Hopper GPU, H and I\n"
		"multiples of 8, TIER_MOE_WGMMA not 0). gate-up-mm is the gate and up product alone with one bf16\n"
		"[rows, 2I] out, the work torch._grouped_mm does in the peer's gate_up. dense-gate-up and dense-down run one cuBLASLt GEMM of\n"
		"the same FLOPs (all rows times one expert's weights: no groups, no padding). After each shape a\n"
		"floor for each product: the longer of its unavoidable HBM bytes (each used expert's weights, its\n"
		"input and outputs once) at the d2d copy's rate and the dense GEMM's time. The rows run in the\n"
		"order shown: on an H200 the same product timed after the block rows came out ~10%% slower than\n"
		"before them. The peer runs in bench/moe_torch.py.\n"
		"\n"
		"  --device KIND      cuda (default) or cpu (the fp32 reference; use a small --shape there)\n"
		"  --model NAME       qwen3-30b, seed-896 or mixtral (repeatable)\n"
		"  --shape T,H,I,E,k  another shape (repeatable; up to %d shapes in all)\n"
		"  --routing R        uniform, zipf or both (default both)\n"
		"  --iters N          timed runs per figure (default 10)\n"
		"  --warmup-ms N      untimed runs first until they add up to N ms, at least 2 (default 200):\n"
		"                     the GPU's clocks settle to what a long job sees (bench/moe_torch.py\n"
		"                     takes the same option)\n",
		MAX_SHAPES);
	bench_run_usage_end(f, 21);
}

/* --model NAME */
static int take_model(moe_opts *o, const char *text)
{
	int i;
	for (i = 0; i < N_MODELS && strcmp(text, models[i].name); i++)
		;
	if (i == N_MODELS || o->n_shapes == MAX_SHAPES) {
		fprintf(stderr, "tier-bench moe: --model %s: use qwen3-30b, seed-896 or mixtral (at most %d shapes)\n", text,
			MAX_SHAPES);
		return 1;
	}
	o->shapes[o->n_shapes++] = models[i];
	return 0;
}

/* --shape T,H,I,E,k */
static int take_shape(moe_opts *o, const char *text)
{
	long long v[5];
	if (o->n_shapes == MAX_SHAPES || bench_parse_dims(text, 5, INT_MAX, v) || v[3] > TIER_MOE_MAX_EXPERTS ||
	    v[4] > TIER_MOE_MAX_TOPK || v[4] > v[3] || v[1] < v[3]) {
		fprintf(stderr, "tier-bench moe: --shape %s: give T,H,I,E,k (positive, E <= %d, k <= %d, k <= E, "
			"E <= H: the routing is imposed on x's first E columns; at most %d shapes)\n", text,
			TIER_MOE_MAX_EXPERTS, TIER_MOE_MAX_TOPK, MAX_SHAPES);
		return 1;
	}
	o->shapes[o->n_shapes++] = (moe_shape){ "custom", (int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4] };
	return 0;
}

/* moe's own options: --model, --shape, --routing, --warmup-ms. */
static int take(void *opts, int val, const char *text)
{
	moe_opts *o = opts;
	static const char *const routing[] = { "uniform", "zipf", "both" };
	switch (val) {
	case 'm': return take_model(o, text);
	case 's': return take_shape(o, text);
	case 'w': return bench_parse_uint(cmd, "--warmup-ms", text, &o->warm_ms);
	case 'r':
		for (int i = 0; i < 3; i++)
			if (!strcmp(text, routing[i])) {
				o->routing = i + 1;
				return 0;
			}
		fprintf(stderr, "tier-bench moe: --routing %s: use uniform, zipf or both\n", text);
		return 1;
	}
	return 1;
}

static int parse(int argc, char **argv, moe_opts *o)
{
	static const struct option own[] = {
		{ "model", required_argument, NULL, 'm' }, { "shape", required_argument, NULL, 's' },
		{ "routing", required_argument, NULL, 'r' }, { "warmup-ms", required_argument, NULL, 'w' },
		{ NULL, 0, NULL, 0 },
	};
	static const bench_cli cli = { "moe", own, take, usage };
	int rc;
	*o = (moe_opts){ .run = { .kind = TIER_DEV_CUDA, .iters = 10 }, .routing = 3, .warm_ms = 200 };
	if ((rc = bench_parse_run(&cli, argc, argv, &o->run, o)))
		return rc;
	if (!o->n_shapes)
		for (int i = 0; i < N_MODELS; i++)
			o->shapes[o->n_shapes++] = models[i];
	return 0;
}

/* ---- inputs ---- */
static void put(const moe_case *c, void *buf, size_t i, float f)
{
	if (c->el == 4) {
		((float *)buf)[i] = f;
		return;
	}
	((uint16_t *)buf)[i] = tier_f32_to_bf16(f);
}

/* n values uniform in (-a, a) in the case's storage, copied to the device. */
static int fill(moe_case *c, void *dst, size_t n, float a, tier_rng *r)
{
	void *buf = malloc(n * c->el);
	int rc;
	if (!buf)
		return tier_fail(-ENOMEM, "moe bench: no host memory for the inputs");
	for (size_t i = 0; i < n; i++)
		put(c, buf, i, (float)(tier_rng_uniform(r) * 2.0 - 1.0) * a);
	rc = tier_dev_memcpy_h2d(c->dev, dst, buf, n * c->el);
	free(buf);
	return rc;
}

/* k distinct experts per token: uniform, or Zipf(1.2) over the experts (by rejection of repeats). */
static void sample_routing(int T, int E, int k, int zipf, tier_rng *r, int32_t *sel)
{
	double *cdf = malloc(sizeof(double) * (size_t)E), s = 0.0;
	for (int e = 0; e < E; e++)
		cdf[e] = (s += zipf ? pow(e + 1.0, -1.2) : 1.0);
	for (int t = 0; t < T; t++)
		for (int j = 0; j < k; j++) {
			int e, dup;
			do {
				double u = tier_rng_uniform(r) * s;
				int lo = 0, hi = E - 1;
				while (lo < hi) {
					int mid = (lo + hi) / 2;
					if (cdf[mid] > u)
						hi = mid;
					else
						lo = mid + 1;
				}
				e = lo;
				dup = 0;
				for (int i = 0; i < j; i++)
					dup |= sel[t * k + i] == e;
			} while (dup);
			sel[t * k + j] = e;
		}
	free(cdf);
}

/* x [T, H] with the routing written into its first E columns; W_r [E, H] ~ identity there. */
static int fill_router(moe_case *c, int zipf, tier_rng *r)
{
	int T = c->T, H = c->H, E = c->E, k = c->k, rc;
	int32_t *sel = c->sel = malloc(sizeof(int32_t) * (size_t)T * k);
	void *xb = malloc((size_t)T * H * c->el), *wb = malloc((size_t)E * H * c->el);
	if (!sel || !xb || !wb) {
		free(sel), free(xb), free(wb);
		return tier_fail(-ENOMEM, "moe bench: no host memory for the inputs");
	}
	sample_routing(T, E, k, zipf, r, sel);
	for (size_t t = 0; t < (size_t)T; t++) {
		for (int h = 0; h < H; h++)
			put(c, xb, t * H + h, (float)(tier_rng_uniform(r) * 2.0 - 1.0) * (h < E ? 0.3f : 1.0f));
		for (int j = 0; j < k; j++)
			put(c, xb, t * H + sel[t * k + j], 3.0f + 0.1f * (float)(k - j));
	}
	for (size_t e = 0; e < (size_t)E; e++)
		for (int h = 0; h < H; h++)
			put(c, wb, e * H + h, (size_t)h == e ? 1.0f : (float)(tier_rng_uniform(r) * 2.0 - 1.0) * 1e-3f);
	rc = tier_dev_memcpy_h2d(c->dev, c->x, xb, (size_t)T * H * c->el);
	if (!rc)
		rc = tier_dev_memcpy_h2d(c->dev, c->wr, wb, (size_t)E * H * c->el);
	free(xb), free(wb);
	return rc;
}

/* Counts the router's picks that are not in the sampled set of their token. */
static int check_routing(moe_case *c)
{
	size_t n = (size_t)c->n;
	int32_t *got = malloc(sizeof(int32_t) * n);
	int rc;
	if (!got)
		return tier_fail(-ENOMEM, "moe bench: no host memory");
	if ((rc = tier_dev_memcpy_d2h(c->dev, got, c->s.topk_idx, sizeof(int32_t) * n))) {
		free(got);
		return rc;
	}
	c->missed = 0;
	for (size_t t = 0; t < (size_t)c->T; t++)
		for (int j = 0; j < c->k; j++) {
			int in = 0;
			for (int i = 0; i < c->k; i++)
				in |= got[t * c->k + j] == c->sel[t * c->k + i];
			c->missed += !in;
		}
	free(got);
	return 0;
}

static int dalloc(moe_case *c, size_t bytes, void **p) { return tier_dev_malloc(c->dev, bytes ? bytes : 4, p); }

/* Device-to-device copy on the compute stream (memcpy on the CPU). */
static int dcopy(moe_case *c, void *dst, const void *src, size_t bytes)
{
#ifdef TIER_HAVE_CUDA
	if (c->cuda) {
		cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)tier_dev_stream(c->dev));
		return e == cudaSuccess ? 0 : tier_fail(-EIO, "moe bench: weight copy: %s", cudaGetErrorString(e));
	}
#endif
	memcpy(dst, src, bytes);
	return 0;
}

static int alloc_case(moe_case *c, const moe_shape *s, int zipf)
{
	int rc;
	tier_rng r;
	tier_rng_seed(&r, 0x6d6f65u + (uint64_t)zipf);
	c->T = s->T, c->H = s->H, c->I = s->I, c->E = s->E, c->k = s->k, c->n = s->T * s->k;
	c->el = c->cuda ? 2 : 4;
	c->cfg = (tier_moe_cfg){ .router = { TIER_MOE_ROUTER_SOFTMAX_TOPK, s->E, s->k, 1, 0, 0, 0 }, .hidden = s->H,
				 .inter = s->I, .aux_coef = 0.001f, .dtype = c->cuda ? TIER_MOE_BF16 : TIER_MOE_F32 };
	size_t sb = tier_moe_saved_bytes(&c->cfg, c->T), n = (size_t)c->n, H = (size_t)c->H, I = (size_t)c->I;
	c->ws_bytes = tier_moe_workspace_bytes(&c->cfg, c->T, NULL);
	c->ews_bytes = tier_moe_experts_ws_bytes(c->I, c->n, NULL);
	if (!sb || !c->ws_bytes || !c->ews_bytes)
		return tier_fail(-EINVAL, "moe bench: bad shape T=%d H=%d I=%d E=%d k=%d", c->T, c->H, c->I, c->E, c->k);
	c->wg = calloc((size_t)c->E, sizeof(void *)), c->wu = calloc((size_t)c->E, sizeof(void *));
	c->wd = calloc((size_t)c->E, sizeof(void *));
	if (!c->wg || !c->wu || !c->wd)
		return tier_fail(-ENOMEM, "moe bench: no host memory");
	if ((rc = dalloc(c, (size_t)c->T * H * c->el, &c->x)) || (rc = dalloc(c, (size_t)c->E * H * c->el, &c->wr)) ||
	    (rc = dalloc(c, (size_t)c->T * H * 4, &c->out)) || (rc = dalloc(c, (size_t)c->T * H * 4, &c->dout)) ||
	    (rc = dalloc(c, (size_t)c->T * H * 4, &c->dx)) || (rc = dalloc(c, sb, &c->saved)) ||
	    (rc = dalloc(c, c->ws_bytes, &c->ws)) || (rc = dalloc(c, c->ews_bytes, &c->ews)) ||
	    (rc = dalloc(c, n * H * c->el, &c->xg)) || (rc = dalloc(c, n * H * c->el, &c->dy)) ||
	    (rc = dalloc(c, n * H * 4, &c->dxg)) || (rc = dalloc(c, n * 4, &c->dtw)) ||
	    (rc = dalloc(c, (size_t)c->T * c->E * 4, &c->dl)) || (rc = dalloc(c, n * H * c->el, &c->copy)) ||
	    (rc = dalloc(c, n * I * c->el, &c->h)) || (rc = dalloc(c, n * H * c->el, &c->y)) ||
	    (rc = dalloc(c, n * 4, &c->dot)) || (rc = tier_dev_memset(c->dev, c->dot, 0, n * 4)))
		return rc;
#ifdef TIER_HAVE_CUDA
	/* where the experts take the Hopper products (TIER_MOE_WGMMA), in shapes they accept (moe_wgmma.h) */
	c->wgmma = c->cuda && moe_cuda_wgmma_on(c->dev) && c->H % 8 == 0 && c->I % 8 == 0;
#endif
	/* every expert gets the same values (the speed does not depend on them): one random matrix of
	 * each shape made on the host, copied E times, instead of E * 3 * I * H random draws. An
	 * expert's gate and up are one [2I, H] allocation (gate rows first, HF's fused layout), so that
	 * the gate-up-mm row can run them as one plain product, as torch._grouped_mm does; wu[e] points
	 * into wg[e]'s block and is not freed on its own */
	if ((rc = dalloc(c, 2 * I * H * c->el, &c->wg[0])) || (rc = dalloc(c, H * I * c->el, &c->wd[0])) ||
	    (rc = fill(c, c->wg[0], I * H, 1.0f / sqrtf((float)H), &r)) ||
	    (rc = dcopy(c, (char *)c->wg[0] + I * H * c->el, c->wg[0], I * H * c->el)) ||
	    (rc = fill(c, c->wd[0], H * I, 1.0f / sqrtf((float)I), &r)))
		return rc;
	for (int e = 0; e < c->E; e++) {
		if ((e && (rc = dalloc(c, 2 * I * H * c->el, &c->wg[e]))) || (e && (rc = dalloc(c, H * I * c->el, &c->wd[e]))))
			return rc;
		c->wu[e] = (char *)c->wg[e] + I * H * c->el;
		if ((e && (rc = dcopy(c, c->wg[e], c->wg[0], 2 * I * H * c->el))) ||
		    (e && (rc = dcopy(c, c->wd[e], c->wd[0], H * I * c->el))))
			return rc;
	}
	/* the dense peers: gate and up of expert 0 stacked into one [2I, H] matrix */
	if (c->wgmma && ((rc = dalloc(c, 2 * I * H * c->el, &c->dw)) || (rc = dcopy(c, c->dw, c->wg[0], I * H * c->el)) ||
			 (rc = dcopy(c, (char *)c->dw + I * H * c->el, c->wg[0], I * H * c->el)) ||
			 (rc = dalloc(c, n * 2 * I * c->el, &c->dout2))))
		return rc;
	c->w = (tier_moe_experts){ .gate = (const float *const *)c->wg, .up = (const float *const *)c->wu,
				   .down = (const float *const *)c->wd };
	float *ones = malloc(4 * (size_t)c->T * H);
	if (!ones)
		return tier_fail(-ENOMEM, "moe bench: no host memory");
	for (size_t i = 0; i < (size_t)c->T * H; i++)
		ones[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
	rc = tier_dev_memcpy_h2d(c->dev, c->dout, ones, 4 * (size_t)c->T * H);
	free(ones);
	if (rc || (rc = fill_router(c, zipf, &r)) || (rc = tier_moe_saved_bind(&c->cfg, c->T, c->saved, sb, &c->s)))
		return rc;
	/* one forward: the saved state every step below reads */
	if ((rc = tier_moe_layer_fwd(c->dev, &c->cfg, c->T, c->x, c->wr, NULL, &c->w, NULL, c->out, &c->s, c->ws,
				     c->ws_bytes)) ||
	    (rc = tier_dev_sync(c->dev)))
		return rc;
	int32_t rows;
	if ((rc = tier_dev_memcpy_d2h(c->dev, &rows, c->s.offsets + c->E, sizeof rows)) || (rc = check_routing(c)))
		return rc;
	c->rows = rows;
	return 0;
}

static void free_case(moe_case *c)
{
	void *p[] = { c->x,  c->wr,  c->out, c->dout, c->dx,  c->saved, c->ws, c->ews, c->xg,
		      c->dy, c->dxg, c->dtw, c->dl,   c->y,   c->dot,   c->copy, c->h, c->dw, c->dout2 };
	for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
		if (p[i])
			tier_dev_free(c->dev, p[i]);
	for (int e = 0; e < c->E; e++) {
		if (c->wg && c->wg[e])
			tier_dev_free(c->dev, c->wg[e]);
		if (c->wd && c->wd[e])
			tier_dev_free(c->dev, c->wd[e]);
	}
	free(c->wg), free(c->wu), free(c->wd), free(c->sel);
}

static int call(moe_case *c, int op);

/* op with the experts forced through the grouped GEMMs (TIER_MOE_GROUPED=1), the caller's setting
 * (TIER_MOE_GROUPED=0 or auto) restored after. */
static int call_grouped(moe_case *c, int op)
{
	const char *was = getenv("TIER_MOE_GROUPED");
	char keep[16] = "";
	if (was)
		snprintf(keep, sizeof keep, "%s", was);
	setenv("TIER_MOE_GROUPED", "1", 1);
	int rc = call(c, op);
	if (was)
		setenv("TIER_MOE_GROUPED", keep, 1);
	else
		unsetenv("TIER_MOE_GROUPED");
	return rc;
}

static int call(moe_case *c, int op)
{
	tier_moe_saved *s = &c->s;
	int T = c->T, H = c->H, E = c->E, k = c->k, rc;
	switch (op) {
	case OP_ROUTER:
		return tier_moe_router_fwd(c->dev, &c->cfg.router, T, H, c->x, c->wr, NULL, s->logits, s->topk_idx, s->topk_w);
	case OP_PERMUTE:
		return tier_moe_permute(c->dev, T, k, E, H, 0, s->topk_idx, c->x, s->offsets, s->row_pair, s->pair_row,
					s->counts, c->xg);
	case OP_COPY:
#ifdef TIER_HAVE_CUDA
		if (c->cuda) {
			cudaError_t e = cudaMemcpyAsync(c->copy, c->xg, (size_t)c->rows * H * c->el, cudaMemcpyDeviceToDevice,
							(cudaStream_t)tier_dev_stream(c->dev));
			return e == cudaSuccess ? 0 : tier_fail(-EIO, "moe bench: copy: %s", cudaGetErrorString(e));
		}
#endif
		memcpy(c->copy, c->xg, (size_t)c->rows * H * c->el);
		return 0;
	case OP_EXPERTS_FWD:
		return tier_moe_experts_fwd(c->dev, E, H, c->I, s->offsets, &c->w, NULL, c->xg, s->g, s->u, c->y, c->ews);
	case OP_COMBINE_FWD:
		return tier_moe_combine_fwd(c->dev, T, k, H, s->pair_row, s->topk_w, c->y, c->out);
	case OP_COMBINE_BWD:
		/* as the layer does it: dy, then d_topk_w from the experts' row dots */
		rc = tier_moe_combine_bwd(c->dev, T, k, H, s->pair_row, s->topk_w, NULL, c->dout, c->dy, NULL);
		return rc ? rc : tier_moe_combine_dw(c->dev, T, k, s->pair_row, s->topk_w, c->dot, c->dtw);
	case OP_EXPERTS_BWD:
		return tier_moe_experts_bwd(c->dev, E, H, c->I, s->offsets, &c->w, NULL, c->xg, s->g, s->u, c->dy, c->dxg,
					    c->dot, c->ews);
	case OP_PERMUTE_BWD:
		return tier_moe_permute_bwd(c->dev, T, k, H, s->offsets, E, s->row_pair, c->dxg, c->dx);
	case OP_ROUTER_BWD:
		return tier_moe_router_weights_bwd(c->dev, &c->cfg.router, T, s->logits, s->topk_idx, c->dtw, c->dl);
	case OP_EXPERTS_FWD_G: /* the experimental device-side grouped GEMM (moe/moe_grouped.cu) */
	case OP_BLOCK_FWD_G:
		rc = call_grouped(c, op == OP_EXPERTS_FWD_G ? OP_EXPERTS_FWD : OP_BLOCK_FWD);
		return rc;
#ifdef TIER_HAVE_CUDA
	case OP_GATE_UP:
		return moe_cuda_grouped_gate_up_sm90(c->dev, E, H, c->I, s->offsets, c->rows, (const void *const *)c->wg,
						     (const void *const *)c->wu, c->xg, s->g, s->u, c->h);
	case OP_GATE_UP_MM: /* [rows, 2I] = xg [rows, H] [gate_e; up_e]^T, bf16: torch's grouped product */
		return moe_cuda_grouped_mm_sm90(c->dev, E, 2 * c->I, H, s->offsets, c->rows, (const void *const *)c->wg, 0,
						c->xg, c->dout2, 1, 1.0f, 0.0f);
	case OP_DOWN:
		return moe_cuda_grouped_mm_sm90(c->dev, E, H, c->I, s->offsets, c->rows, (const void *const *)c->wd, 0, c->h,
						c->y, 1, 1.0f, 0.0f);
	case OP_DENSE_GU: /* [rows, 2I] = xg [rows, H] W^T, W [2I, H]; cuBLASLt sees its transpose [2I, rows] */
		return tier_cuda_gemm(c->dev, -1, "moe bench", 2 * c->I, c->rows, H, 1.0f,
				      (tier_gemm_operand){ 1, c->dw, CUDA_R_16BF, H }, (tier_gemm_operand){ 0, c->xg, CUDA_R_16BF, H },
				      0.0f, c->dout2, CUDA_R_16BF, 2 * c->I);
	case OP_DENSE_DOWN: /* y [rows, H] = h [rows, I] down_0^T */
		return tier_cuda_gemm(c->dev, -1, "moe bench", H, c->rows, c->I, 1.0f,
				      (tier_gemm_operand){ 1, c->wd[0], CUDA_R_16BF, c->I },
				      (tier_gemm_operand){ 0, c->h, CUDA_R_16BF, c->I }, 0.0f, c->y, CUDA_R_16BF, H);
#endif
	case OP_BLOCK_FWD:
	case OP_BLOCK_FWD_BWD:
		rc = tier_moe_layer_fwd(c->dev, &c->cfg, T, c->x, c->wr, NULL, &c->w, NULL, c->out, s, c->ws, c->ws_bytes);
		if (!rc && op == OP_BLOCK_FWD_BWD)
			rc = tier_moe_layer_bwd(c->dev, &c->cfg, T, c->x, c->wr, &c->w, NULL, s, c->dout, 1.0f, c->dx, NULL,
						c->ws, c->ws_bytes);
		return rc;
	}
	return tier_fail(-EINVAL, "moe bench: unknown op %d", op);
}

/* The case's operation (bench_measure_ms's call). */
static int call_op(void *arg)
{
	moe_case *c = arg;
	return call(c, c->op);
}

/* Work of an op: FLOPs (is_flop 1) or bytes moved. Expert products: gate and up 2*2*rows*H*I,
 * down 2*rows*I*H; backward (input gradient only, frozen weights) the same 6*rows*H*I. */
static double work(const moe_case *c, int op, int *is_flop)
{
	double T = c->T, H = c->H, I = c->I, E = c->E, k = c->k, n = c->n, rows = c->rows, el = (double)c->el;
	double ex = 6.0 * rows * H * I, rt = 2.0 * T * E * H;
	*is_flop = 1;
	switch (op) {
	case OP_ROUTER: return rt;
	case OP_EXPERTS_FWD: case OP_EXPERTS_BWD: case OP_EXPERTS_FWD_G: return ex;
	case OP_GATE_UP: case OP_GATE_UP_MM: case OP_DENSE_GU: return ex * 2.0 / 3.0;
	case OP_DOWN: case OP_DENSE_DOWN: return ex / 3.0;
	case OP_BLOCK_FWD: case OP_BLOCK_FWD_G: return rt + ex;
	case OP_BLOCK_FWD_BWD: return rt + ex + ex + rt; /* bwd: experts' input gradient, router's dx */
	default: break;
	}
	*is_flop = 0;
	switch (op) {
	case OP_PERMUTE: case OP_COPY: return 2.0 * rows * H * el;        /* read + write of the rows */
	case OP_COMBINE_FWD: return rows * H * el + T * H * 4.0;          /* rows in, fp32 tokens out */
	case OP_COMBINE_BWD: return rows * H * el * 2.0 + T * H * 4.0;    /* y and dy, d_out */
	case OP_PERMUTE_BWD: return rows * H * 4.0 + 2.0 * T * H * 4.0;  /* dxg in, dx read + written */
	case OP_ROUTER_BWD: return T * E * 8.0 + n * 8.0;
	}
	(void)k;
	return 0;
}

static const bench_col cols[] = {
	{ "model", "", 10 }, { "routing", "", 8 }, { "op", "", 14 }, { "time", "median", 10 },
	{ "rate", "", 9 }, { "unit", "", 8 }, { "max/mean", "load", 9 },
};
#define NCOLS (sizeof cols / sizeof cols[0])

/* The routing's loads from its per-expert counts: the largest over the mean (returned: how skewed
 * the routing came out), the experts with rows (c->used) and the rows that 128-row tiles multiply
 * with and without idle consumers (c->tiled, c->idle). */
static double routing_loads(moe_case *c)
{
	int32_t *cnt = malloc(sizeof(int32_t) * (size_t)c->E);
	double mx = 0, sum = 0;
	c->used = c->E;
	if (!cnt || tier_dev_memcpy_d2h(c->dev, cnt, c->s.counts, sizeof(int32_t) * (size_t)c->E)) {
		free(cnt);
		return 0;
	}
	c->used = 0, c->tiled = c->idle = 0;
	for (int e = 0; e < c->E; e++) {
		int tail = cnt[e] % 128;
		double t = 128.0 * ((cnt[e] + 127) / 128);
		mx = cnt[e] > mx ? cnt[e] : mx, sum += cnt[e], c->used += cnt[e] > 0;
		c->tiled += t, c->idle += t - (tail > 0 && tail <= 64 ? 64 : 0);
	}
	free(cnt);
	return sum > 0 ? mx / (sum / c->E) : 0;
}

/* The bytes a grouped product cannot avoid moving through HBM: the weights of every expert with
 * rows once, its input rows once and its outputs once (gate-up: g, u and h; down: y). */
static double product_bytes(const moe_case *c, int op)
{
	double rows = c->rows, H = c->H, I = c->I, used = c->used, el = (double)c->el;
	if (op == OP_GATE_UP)
		return el * (used * 2.0 * I * H + rows * H + 3.0 * rows * I);
	return el * (used * H * I + rows * I + rows * H);
}

/* Each grouped product's floor: its bytes at the rate of the device copy measured in the same run,
 * or the time of one dense cuBLASLt GEMM of the same FLOPs (no groups, no padding), whichever is
 * longer. No kernel beats it by much; the targets against torch are only reachable when
 * torch's time over the target stays above it (bench/moe_torch.py prints that ratio). */
static void put_floors(const moe_case *c, const char *name, int zipf, const double ms[N_OPS], double floor_ms[2])
{
	int is_flop;
	double rate = ms[OP_COPY] > 0 ? work(c, OP_COPY, &is_flop) / (ms[OP_COPY] * 1e6) : 0; /* GB/s */
	for (int i = 0; i < 2; i++) {
		int op = i ? OP_DOWN : OP_GATE_UP, dense = i ? OP_DENSE_DOWN : OP_DENSE_GU;
		double gb = product_bytes(c, op) / 1e9, hbm = rate > 0 ? gb / rate * 1e3 : 0;
		floor_ms[i] = hbm > ms[dense] ? hbm : ms[dense];
		if (floor_ms[i] > 0 && ms[op] > 0)
			bench_comment("%s %s %s floor %.3f ms: %.3f GB at the d2d copy's %.0f GB/s %.3f ms, the dense "
				      "GEMM of its FLOPs %.3f ms; it runs at %.0f%% of the floor's speed",
				      name, zipf ? "zipf1.2" : "uniform", op_name[op], floor_ms[i], gb, rate, hbm, ms[dense],
				      100.0 * floor_ms[i] / ms[op]);
	}
}

static int bench_shape(tier_dev *dev, const moe_opts *o, const moe_shape *s, int zipf, double ms[N_OPS], double *skew,
		       double floor_ms[2])
{
	moe_case c = { .dev = dev, .cuda = o->run.kind == TIER_DEV_CUDA };
	int rc = alloc_case(&c, s, zipf);
	*skew = rc ? 0 : routing_loads(&c);
	if (!rc && c.missed)
		bench_comment("%s %s: the router picked %ld of %d experts outside the sampled routing", s->name,
			      zipf ? "zipf" : "uniform", c.missed, c.n);
	if (!rc && c.rows > 0) /* the padding that bounds the products when groups are small */
		bench_comment("%s %s: 128-row tiles multiply %.2fx the %d rows of the groups (%.2fx with idle "
			      "consumers, TIER_MOE_WGMMA_IDLE=1)",
			      s->name, zipf ? "zipf1.2" : "uniform", c.tiled / c.rows, c.rows, c.idle / c.rows);
	for (int op = 0; op < N_OPS && !rc; op++) {
		char cells[NCOLS][BENCH_CELL];
		int is_flop;
		c.op = op;
		ms[op] = 0;
		if ((op == OP_GATE_UP || op == OP_GATE_UP_MM || op == OP_DOWN || op == OP_DENSE_GU || op == OP_DENSE_DOWN) &&
		    !c.wgmma)
			continue; /* no Hopper kernels here: the JSON's 0 means not run */
		ms[op] = bench_measure_ms(dev, call_op, &c, o->warm_ms, o->run.iters, &rc);
		if (rc)
			break;
		double wk = work(&c, op, &is_flop);
		snprintf(cells[0], 32, "%s", s->name), snprintf(cells[1], 32, "%s", zipf ? "zipf1.2" : "uniform");
		snprintf(cells[2], 32, "%s", op_name[op]);
		bench_fmt_time(ms[op] * 1e6, cells[3], 32);
		double rate = is_flop ? wk / (ms[op] * 1e9) : wk / (ms[op] * 1e6);
		bench_fmt_num(rate, rate < 10 ? 3 : 1, cells[4], 32);
		snprintf(cells[5], 32, "%s", is_flop ? "TFLOP/s" : "GB/s");
		bench_fmt_num(*skew, 2, cells[6], 32);
		bench_table_cells(cols, NCOLS, cells);
	}
	floor_ms[0] = floor_ms[1] = 0;
	if (!rc && c.wgmma)
		put_floors(&c, s->name, zipf, ms, floor_ms);
	free_case(&c);
	return rc;
}

int bench_moe(int argc, char **argv)
{
	moe_opts o;
	tier_dev *dev = NULL;
	static double ms[MAX_SHAPES][2][N_OPS], skew[MAX_SHAPES][2], fl[MAX_SHAPES][2][2];
	int rc = parse(argc, argv, &o);
	if (rc)
		return rc < 0 ? 0 : rc;
	if (tier_dev_open(&dev, o.run.kind, 0))
		return bench_failed(cmd, NULL);
	bench_comment("tier-bench moe: MoE block steps, forward and forward+backward (softmax top-k router, SwiGLU experts)");
	bench_comment("device %s; median of %u runs after %u ms of warm-up runs (at least 2); %s storage",
		      tier_dev_name(dev), o.run.iters, o.warm_ms,
		      o.run.kind == TIER_DEV_CUDA ? "bf16" : "fp32");
	bench_comment("experts: 6*rows*H*I FLOPs each way (input gradient only: frozen experts); block adds the router");
	bench_table_header(cols, NCOLS);
	for (unsigned i = 0; i < o.n_shapes && !rc; i++)
		for (int z = 0; z < 2 && !rc; z++)
			if (o.routing & (1 << z))
				rc = bench_shape(dev, &o, &o.shapes[i], z, ms[i][z], &skew[i][z], fl[i][z]);
	if (rc)
		return bench_failed(cmd, dev);
	int z0 = o.routing & 1 ? 0 : 1;
	bench_summary("%u shapes; first (%s): block fwd %.3f ms, fwd+bwd %.3f ms, experts fwd %.3f ms", o.n_shapes,
		      z0 ? "zipf" : "uniform", ms[0][z0][OP_BLOCK_FWD], ms[0][z0][OP_BLOCK_FWD_BWD], ms[0][z0][OP_EXPERTS_FWD]);
	if (o.run.json) {
		printf("{\"bench\":\"moe\",\"impl\":\"tier\",\"device\":\"%s\",\"results\":[", tier_dev_name(dev));
		int first = 1;
		for (unsigned i = 0; i < o.n_shapes; i++)
			for (int z = 0; z < 2; z++) {
				if (!(o.routing & (1 << z)))
					continue;
				const moe_shape *s = &o.shapes[i];
				printf("%s{\"model\":\"%s\",\"routing\":\"%s\",\"T\":%d,\"H\":%d,\"I\":%d,\"E\":%d,\"k\":%d,"
				       "\"max_over_mean\":%.3f", first ? "" : ",", s->name, z ? "zipf" : "uniform", s->T, s->H,
				       s->I, s->E, s->k, skew[i][z]);
				for (int op = 0; op < N_OPS; op++)
					printf(",\"%s_ms\":%.4f", op_key[op], ms[i][z][op]);
				printf(",\"gate_up_floor_ms\":%.4f,\"down_floor_ms\":%.4f", fl[i][z][0], fl[i][z][1]);
				printf("}");
				first = 0;
			}
		printf("]}\n");
	}
	tier_dev_close(dev);
	return 0;
}
