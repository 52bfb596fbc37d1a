/* bench_loss.c - tier-bench loss: time and extra device memory of the chunked loss (forward,
 * backward, fused forward+backward) on the shapes of large-vocabulary models. The peers (PyTorch
 * eager and torch.compile) are measured by bench/loss_torch.py, which reads this JSON line. */
#include "config.h"
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"

static const char *const cmd = "loss";

typedef struct {
	int64_t N, V, D;
} shape;

typedef struct {
	bench_run_opts run;
	uint64_t bound;
	unsigned n_shapes;
	int dw;
	shape shapes[8];
} loss_opts;

enum { OP_FWD, OP_BWD, OP_FWD_BWD, N_OPS };
static const char *const op_name[N_OPS] = { "fwd", "bwd", "fwd+bwd" };

typedef struct {
	tier_dev *dev;
	tier_loss_params p;
	void *H, *W, *ws;
	int32_t *labels;
	float *lse, *loss, *dH, *dW;
	int64_t *count;
	size_t ws_bytes;
	int op;
} loss_case;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench loss [--device cuda|cpu] [--shape N,V,D]... [--mem SIZE] [--iters N] [--dw] [--json]\n"
		"Time of tier's chunked cross-entropy loss, forward, backward (recomputing the logits) and the\n"
		"fused forward+backward, and its extra device memory (workspace + saved lse), per shape.\n"
		"Default shapes: 8192,256000,2304 and 16384,151936,2048 (Qwen3). Inputs are random bf16 on\n"
		"CUDA (fp32 on the CPU), every label counted, lm_head frozen unless --dw. Each time is the\n"
		"median of N timed runs after two warm-up runs, timed with CUDA events on the compute stream.\n"
		"The peers, PyTorch eager (materialised logits + F.cross_entropy) and torch.compile of a\n"
		"chunked loss, run in bench/loss_torch.py, which reads the --json line and prints ratios.\n"
		"\n"
		"  --device KIND   cuda (default) or cpu (use small --shape there)\n"
		"  --shape N,V,D   a shape to run (repeatable, up to 8; replaces the defaults)\n"
		"  --mem SIZE      memory bound for the workspace; chunk and block follow from it (default 400M)\n"
		"  --iters N       timed runs per figure (default 10)\n"
		"  --dw            also compute dW (a trainable lm_head)\n");
	bench_run_usage_end(f, 18);
}

/* loss's own options: --shape, --mem, --dw. */
static int take(void *opts, int val, const char *text)
{
	loss_opts *o = opts;
	long long v[3];
	switch (val) {
	case 's':
		if (o->n_shapes == 8 || bench_parse_dims(text, 3, LLONG_MAX, v)) {
			fprintf(stderr, "tier-bench loss: --shape %s: give N,V,D (positive; at most 8 shapes)\n", text);
			return 1;
		}
		o->shapes[o->n_shapes++] = (shape){ v[0], v[1], v[2] };
		return 0;
	case 'm': return bench_parse_size(cmd, "--mem", text, &o->bound);
	case 'w': o->dw = 1; return 0;
	}
	return 1;
}

static int parse(int argc, char **argv, loss_opts *o)
{
	static const struct option own[] = {
		{ "shape", required_argument, NULL, 's' }, { "mem", required_argument, NULL, 'm' },
		{ "dw", no_argument, NULL, 'w' }, { NULL, 0, NULL, 0 },
	};
	static const bench_cli cli = { "loss", own, take, usage };
	int rc;
	*o = (loss_opts){ .run = { .kind = TIER_DEV_CUDA, .iters = 10 }, .bound = 400ull << 20 };
	if ((rc = bench_parse_run(&cli, argc, argv, &o->run, o)))
		return rc;
	if (!o->n_shapes) {
		o->shapes[0] = (shape){ 8192, 256000, 2304 };
		o->shapes[1] = (shape){ 16384, 151936, 2048 };
		o->n_shapes = 2;
	}
	return 0;
}

/* The case's operation (bench_measure_ms's call). */
static int call_op(void *arg)
{
	loss_case *c = arg;
	const tier_loss_params *p = &c->p;
	if (c->op == OP_FWD)
		return tier_loss_fwd(c->dev, p, c->H, c->W, c->labels, c->lse, c->loss, c->count, c->ws, c->ws_bytes);
	if (c->op == OP_BWD)
		return tier_loss_bwd(c->dev, p, c->H, c->W, c->labels, c->lse, 1.0f, c->dH, c->dW, c->ws, c->ws_bytes);
	return tier_loss_fwd_bwd(c->dev, p, c->H, c->W, c->labels, 1.0f, c->lse, c->loss, c->count, c->dH, c->dW,
				 c->ws, c->ws_bytes);
}

/* Random inputs: bf16 on CUDA (made on the host, copied), fp32 on the CPU; labels all counted. */
static int fill_inputs(loss_case *c, tier_dev_kind kind)
{
	size_t el = kind == TIER_DEV_CUDA ? 2 : 4, nh = (size_t)(c->p.N * c->p.D), nw = (size_t)(c->p.V * c->p.D);
	size_t most = nh > nw ? nh : nw;
	void *buf = malloc(most * el > (size_t)c->p.N * 4 ? most * el : (size_t)c->p.N * 4);
	uint64_t x = 0x9e3779b97f4a7c15ull;
	int rc = 0;
	if (!buf)
		return tier_fail(-ENOMEM, "loss bench: no host memory for the inputs");
	for (int which = 0; which < 3 && !rc; which++) {
		size_t n = which == 0 ? nh : which == 1 ? nw : (size_t)c->p.N;
		float scale = which == 0 ? 1.0f : 1.0f / 48.0f;  /* logits of order 1 */
		for (size_t i = 0; i < n; i++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			if (which == 2) {
				((int32_t *)buf)[i] = (int32_t)((x >> 11) % (uint64_t)c->p.V);
			} else {
				float f = scale * ((float)(x >> 40) / (float)(1 << 24) * 2.0f - 1.0f) * 1.7f;
				uint32_t u;
				memcpy(&u, &f, 4);
				if (el == 2)
					((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
				else
					((float *)buf)[i] = f;
			}
		}
		rc = tier_dev_memcpy_h2d(c->dev, which == 0 ? c->H : which == 1 ? c->W : (void *)c->labels, buf,
					 which == 2 ? n * 4 : n * el);
	}
	free(buf);
	return rc;
}

static int alloc_case(loss_case *c, const loss_opts *o, shape s)
{
	size_t el = o->run.kind == TIER_DEV_CUDA ? 2 : 4;
	int rc;
	tier_loss_params_init(&c->p, s.N, s.V, s.D);
	if ((rc = tier_loss_plan(&c->p, o->run.kind, o->bound, &c->p.chunk_tokens, &c->p.block_vocab)) ||
	    (rc = tier_loss_workspace_bytes(&c->p, o->run.kind, &c->ws_bytes)))
		return rc;
	if ((rc = tier_dev_malloc(c->dev, (size_t)(s.N * s.D) * el, &c->H)) ||
	    (rc = tier_dev_malloc(c->dev, (size_t)(s.V * s.D) * el, &c->W)) ||
	    (rc = tier_dev_malloc(c->dev, (size_t)s.N * 4, (void **)&c->labels)) ||
	    (rc = tier_dev_malloc(c->dev, (size_t)s.N * 4, (void **)&c->lse)) ||
	    (rc = tier_dev_malloc(c->dev, 16, (void **)&c->loss)) ||
	    (rc = tier_dev_malloc(c->dev, 16, (void **)&c->count)) ||
	    (rc = tier_dev_malloc(c->dev, (size_t)(s.N * s.D) * 4, (void **)&c->dH)) ||
	    (rc = tier_dev_malloc(c->dev, c->ws_bytes, &c->ws)))
		return rc;
	if (o->dw && (rc = tier_dev_malloc(c->dev, (size_t)(s.V * s.D) * 4, (void **)&c->dW)))
		return rc;
	return fill_inputs(c, o->run.kind);
}

static void free_case(loss_case *c)
{
	void *ptrs[] = { c->H, c->W, c->labels, c->lse, c->loss, c->count, c->dH, c->dW, c->ws };
	for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
		if (ptrs[i])
			tier_dev_free(c->dev, ptrs[i]);
}

static const bench_col cols[] = {
	{ "N", "", 7 }, { "V", "", 8 }, { "D", "", 6 }, { "chunk", "tokens", 7 }, { "block", "vocab", 8 },
	{ "op", "", 8 }, { "time", "median", 10 }, { "rate", "TFLOP/s", 9 }, { "extra_mem", "ws+lse", 11 },
	{ "loss", "mean", 9 },
};
#define NCOLS (sizeof cols / sizeof cols[0])

/* Time the three operations on one shape; ms[] gets their medians in ms. */
static int bench_shape(tier_dev *dev, const loss_opts *o, shape s, double ms[N_OPS], uint64_t *extra, float *loss_out)
{
	loss_case c = { .dev = dev };
	float loss = 0;
	int rc = alloc_case(&c, o, s);
	for (int op = 0; op < N_OPS && !rc; op++) {
		double flop = 2.0 * (double)s.N * (double)s.V * (double)s.D * (op == OP_FWD ? 1 : 2 + (o->dw ? 1 : 0));
		char cells[NCOLS][BENCH_CELL];
		c.op = op;
		ms[op] = bench_measure_ms(dev, call_op, &c, 0, o->run.iters, &rc);
		if (rc)
			break;
		if (op == OP_FWD && (rc = tier_dev_memcpy_d2h(dev, &loss, c.loss, 4)))
			break;
		*extra = c.ws_bytes + (uint64_t)s.N * 4;
		snprintf(cells[0], 32, "%lld", (long long)s.N), snprintf(cells[1], 32, "%lld", (long long)s.V);
		snprintf(cells[2], 32, "%lld", (long long)s.D), snprintf(cells[3], 32, "%lld", (long long)c.p.chunk_tokens);
		snprintf(cells[4], 32, "%lld", (long long)c.p.block_vocab), snprintf(cells[5], 32, "%s", op_name[op]);
		bench_fmt_time(ms[op] * 1e6, cells[6], 32);
		bench_fmt_num(flop / (ms[op] * 1e9), 1, cells[7], 32);
		snprintf(cells[8], 32, "%.1f MiB", (double)*extra / (1 << 20));
		bench_fmt_num(loss, 4, cells[9], 32);
		bench_table_cells(cols, NCOLS, cells);
	}
	*loss_out = loss;
	free_case(&c);
	return rc;
}

int bench_loss(int argc, char **argv)
{
	loss_opts o;
	tier_dev *dev = NULL;
	double ms[8][N_OPS] = { { 0 } };
	uint64_t extra[8] = { 0 };
	float loss[8] = { 0 };
	char a[32];
	int rc = parse(argc, argv, &o);
	if (rc)
		return rc < 0 ? 0 : rc;
	if (tier_dev_open(&dev, o.run.kind, 0))
		return bench_failed(cmd, NULL);
	bench_comment("tier-bench loss: chunked cut-cross-entropy, forward / backward (recompute) / fused forward+backward");
	bench_comment("device %s; workspace bound %s; dW %s; median of %u runs after 2 warm-up runs", tier_dev_name(dev),
		      bench_fmt_size(o.bound, a, sizeof a), o.dw ? "on" : "off (frozen lm_head)", o.run.iters);
	bench_comment("rate counts 2NVD flop per product: fwd 1 product, bwd and fwd+bwd 2 (3 with dW)");
	bench_table_header(cols, NCOLS);
	for (unsigned i = 0; i < o.n_shapes && !rc; i++)
		rc = bench_shape(dev, &o, o.shapes[i], ms[i], &extra[i], &loss[i]);
	if (rc)
		return bench_failed(cmd, dev);
	bench_summary("%u shapes; fused forward+backward %.2f ms on the first (%.1f MiB extra)", o.n_shapes,
		      ms[0][OP_FWD_BWD], (double)extra[0] / (1 << 20));
	if (o.run.json) {
		printf("{\"bench\":\"loss\",\"impl\":\"tier\",\"device\":\"%s\",\"dw\":%d,\"results\":[", tier_dev_name(dev), o.dw);
		for (unsigned i = 0; i < o.n_shapes; i++)
			printf("%s{\"N\":%lld,\"V\":%lld,\"D\":%lld,\"fwd_ms\":%.4f,\"bwd_ms\":%.4f,\"fwd_bwd_ms\":%.4f,"
			       "\"extra_bytes\":%llu,\"loss\":%.6f}", i ? "," : "", (long long)o.shapes[i].N,
			       (long long)o.shapes[i].V, (long long)o.shapes[i].D, ms[i][OP_FWD], ms[i][OP_BWD],
			       ms[i][OP_FWD_BWD], (unsigned long long)extra[i], loss[i]);
		printf("]}\n");
	}
	tier_dev_close(dev);
	return 0;
}
