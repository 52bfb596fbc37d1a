/* bench_attn.c - tier-bench attn: time and TFLOP/s of causal attention forward, backward and
 * forward+backward on model shapes (default Qwen3-30B-A3B's). The peer (torch's
 * F.scaled_dot_product_attention) is measured by bench/attn_torch.py, which reads the JSON line. */
#include "config.h"
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"

static const char *const cmd = "attn";

typedef struct {
	int64_t B, S, H, KH, D;
} attn_shape;

typedef struct {
	bench_run_opts run;
	unsigned n_shapes;
	attn_shape shapes[8];
} attn_opts;

enum { OP_FWD, OP_BWD, OP_FWD_BWD, N_OPS };
static const char *const op_name[N_OPS] = { "fwd", "bwd", "fwd+bwd" };
static const double op_flop_factor[N_OPS] = { 1.0, 2.5, 3.5 };   /* relative to the forward */

typedef struct {
	tier_dev *dev;
	tier_attn_params p;
	void *q, *k, *v, *o, *dout, *ws;
	float *lse, *dq, *dk, *dv;
	size_t ws_bytes;
	int op;
} attn_case;

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench attn [--device cuda|cpu] [--shape B,S,H,KVH,D]... [--iters N] [--json]\n"
		"Time of tier's causal flash attention (GQA), forward, backward (recomputing the probabilities\n"
		"from the saved log-sum-exp) and forward+backward. Default shape 1,4096,32,4,128 (Qwen3-30B-A3B:\n"
		"one sequence of 4096 tokens, 32 query heads, 4 kv heads, head_dim 128). Inputs are random bf16\n"
		"on CUDA (fp32 on the CPU). Each time is the median of N timed runs after two warm-up runs,\n"
		"timed with CUDA events on the compute stream. The peer, torch's scaled_dot_product_attention\n"
		"(is_causal, enable_gqa, bf16), runs in bench/attn_torch.py, which reads the --json line.\n"
		"\n"
		"  --device KIND        cuda (default) or cpu (use a small --shape there)\n"
		"  --shape B,S,H,KVH,D  a shape to run (repeatable, up to 8; replaces the default)\n"
		"  --iters N            timed runs per figure (default 20)\n");
	bench_run_usage_end(f, 23);
}

/* --shape B,S,H,KVH,D, attn's one option of its own. */
static int take_shape(void *opts, int val, const char *text)
{
	attn_opts *o = opts;
	long long v[5];
	(void)val;
	if (o->n_shapes == 8 || bench_parse_dims(text, 5, LLONG_MAX, v)) {
		fprintf(stderr, "tier-bench attn: --shape %s: give B,S,H,KVH,D (positive; at most 8 shapes)\n", text);
		return 1;
	}
	o->shapes[o->n_shapes++] = (attn_shape){ v[0], v[1], v[2], v[3], v[4] };
	return 0;
}

static int parse(int argc, char **argv, attn_opts *o)
{
	static const struct option own[] = { { "shape", required_argument, NULL, 's' }, { NULL, 0, NULL, 0 } };
	static const bench_cli cli = { "attn", own, take_shape, usage };
	int rc;
	*o = (attn_opts){ .run = { .kind = TIER_DEV_CUDA, .iters = 20 } };
	if ((rc = bench_parse_run(&cli, argc, argv, &o->run, o)))
		return rc;
	if (!o->n_shapes)
		o->shapes[o->n_shapes++] = (attn_shape){ 1, 4096, 32, 4, 128 };
	return 0;
}

static int call(attn_case *c, int op)
{
	int rc = 0;
	if (op != OP_BWD)
		rc = tier_attn_fwd(c->dev, &c->p, c->q, c->k, c->v, c->o, c->lse, c->ws, c->ws_bytes);
	if (!rc && op != OP_FWD)
		rc = tier_attn_bwd(c->dev, &c->p, c->q, c->k, c->v, c->o, c->lse, c->dout, c->dq, c->dk, c->dv,
				   c->ws, c->ws_bytes);
	return rc;
}

/* The case's operation (bench_measure_ms's call). */
static int call_op(void *arg)
{
	attn_case *c = arg;
	return call(c, c->op);
}

/* Uniform values in (-1.7, 1.7): bf16 on CUDA (made on the host, copied), fp32 on the CPU. */
static int fill(tier_dev *dev, void *dst, size_t n, size_t el, uint64_t seed)
{
	void *buf = malloc(n * el);
	uint64_t x = seed | 1;
	int rc;
	if (!buf)
		return tier_fail(-ENOMEM, "attn bench: no host memory for the inputs");
	for (size_t i = 0; i < n; i++) {
		float f;
		uint32_t u;
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		f = ((float)(x >> 40) / (float)(1 << 24) * 2.0f - 1.0f) * 1.7f;
		memcpy(&u, &f, 4);
		if (el == 2)
			((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
		else
			((float *)buf)[i] = f;
	}
	rc = tier_dev_memcpy_h2d(dev, dst, buf, n * el);
	free(buf);
	return rc;
}

static int alloc_case(attn_case *c, tier_dev_kind kind, attn_shape s)
{
	size_t el = kind == TIER_DEV_CUDA ? 2 : 4, nq = (size_t)(s.B * s.S * s.H * s.D);
	size_t nk = (size_t)(s.B * s.S * s.KH * s.D), nl = (size_t)(s.B * s.S * s.H);
	int rc;
	tier_attn_params_init(&c->p, s.B, s.S, s.H, s.KH, s.D);
	if ((rc = tier_attn_workspace_bytes(c->dev, &c->p, &c->ws_bytes)))
		return rc;
	if ((rc = tier_dev_malloc(c->dev, nq * el, &c->q)) || (rc = tier_dev_malloc(c->dev, nk * el, &c->k)) ||
	    (rc = tier_dev_malloc(c->dev, nk * el, &c->v)) || (rc = tier_dev_malloc(c->dev, nq * el, &c->o)) ||
	    (rc = tier_dev_malloc(c->dev, nq * el, &c->dout)) ||
	    (rc = tier_dev_malloc(c->dev, nl * 4, (void **)&c->lse)) ||
	    (rc = tier_dev_malloc(c->dev, nq * 4, (void **)&c->dq)) ||
	    (rc = tier_dev_malloc(c->dev, nk * 4, (void **)&c->dk)) ||
	    (rc = tier_dev_malloc(c->dev, nk * 4, (void **)&c->dv)) ||
	    (rc = tier_dev_malloc(c->dev, c->ws_bytes ? c->ws_bytes : 1, &c->ws)))
		return rc;
	if ((rc = fill(c->dev, c->q, nq, el, 1)) || (rc = fill(c->dev, c->k, nk, el, 2)) ||
	    (rc = fill(c->dev, c->v, nk, el, 3)) || (rc = fill(c->dev, c->dout, nq, el, 4)))
		return rc;
	return call(c, OP_FWD);                                  /* o and lse for a lone backward */
}

static void free_case(attn_case *c)
{
	void *ptrs[] = { c->q, c->k, c->v, c->o, c->dout, c->lse, c->dq, c->dk, c->dv, c->ws };
	for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
		if (ptrs[i])
			tier_dev_free(c->dev, ptrs[i]);
}

static const bench_col cols[] = {
	{ "B", "", 4 }, { "S", "", 7 }, { "H", "", 4 }, { "KVH", "", 4 }, { "D", "", 4 },
	{ "op", "", 8 }, { "time", "median", 10 }, { "rate", "TFLOP/s", 9 },
};
#define NCOLS (sizeof cols / sizeof cols[0])

/* Causal forward FLOPs: two products (QK^T, PV) of 2*S*S*D each per head, half under the mask. */
static double fwd_flop(attn_shape s)
{
	return 4.0 * (double)s.S * (double)s.S * (double)s.D * (double)s.H * (double)s.B / 2.0;
}

static int bench_shape(tier_dev *dev, const attn_opts *o, attn_shape s, double ms[N_OPS])
{
	attn_case c = { .dev = dev };
	int rc = alloc_case(&c, o->run.kind, s);
	for (int op = 0; op < N_OPS && !rc; op++) {
		char cells[NCOLS][BENCH_CELL];
		c.op = op;
		ms[op] = bench_measure_ms(dev, call_op, &c, 0, o->run.iters, &rc);
		if (rc)
			break;
		snprintf(cells[0], 32, "%lld", (long long)s.B), snprintf(cells[1], 32, "%lld", (long long)s.S);
		snprintf(cells[2], 32, "%lld", (long long)s.H), snprintf(cells[3], 32, "%lld", (long long)s.KH);
		snprintf(cells[4], 32, "%lld", (long long)s.D), snprintf(cells[5], 32, "%s", op_name[op]);
		bench_fmt_time(ms[op] * 1e6, cells[6], 32);
		bench_fmt_num(op_flop_factor[op] * fwd_flop(s) / (ms[op] * 1e9), 1, cells[7], 32);
		bench_table_cells(cols, NCOLS, cells);
	}
	free_case(&c);
	return rc;
}

int bench_attn(int argc, char **argv)
{
	attn_opts o;
	tier_dev *dev = NULL;
	double ms[8][N_OPS] = { { 0 } };
	int rc = parse(argc, argv, &o);
	if (rc)
		return rc < 0 ? 0 : rc;
	if (tier_dev_open(&dev, o.run.kind, 0))
		return bench_failed(cmd, NULL);
	bench_comment("tier-bench attn: causal flash attention with GQA, forward / backward / forward+backward");
	bench_comment("device %s; median of %u runs after 2 warm-up runs", tier_dev_name(dev), o.run.iters);
	bench_comment("rate counts causal FLOPs: fwd 4*S*S*D*H*B/2, bwd 2.5x that, fwd+bwd 3.5x");
	bench_table_header(cols, NCOLS);
	for (unsigned i = 0; i < o.n_shapes && !rc; i++)
		rc = bench_shape(dev, &o, o.shapes[i], ms[i]);
	if (rc)
		return bench_failed(cmd, dev);
	bench_summary("%u shapes; first: fwd %.3f ms (%.1f TFLOP/s), fwd+bwd %.3f ms (%.1f TFLOP/s)", o.n_shapes,
		      ms[0][OP_FWD], fwd_flop(o.shapes[0]) / (ms[0][OP_FWD] * 1e9), ms[0][OP_FWD_BWD],
		      3.5 * fwd_flop(o.shapes[0]) / (ms[0][OP_FWD_BWD] * 1e9));
	if (o.run.json) {
		printf("{\"bench\":\"attn\",\"impl\":\"tier\",\"device\":\"%s\",\"results\":[", tier_dev_name(dev));
		for (unsigned i = 0; i < o.n_shapes; i++)
			printf("%s{\"B\":%lld,\"S\":%lld,\"H\":%lld,\"KVH\":%lld,\"D\":%lld,\"fwd_ms\":%.4f,\"bwd_ms\":%.4f,"
			       "\"fwd_bwd_ms\":%.4f}", i ? "," : "", (long long)o.shapes[i].B, (long long)o.shapes[i].S,
			       (long long)o.shapes[i].H, (long long)o.shapes[i].KH, (long long)o.shapes[i].D,
			       ms[i][OP_FWD], ms[i][OP_BWD], ms[i][OP_FWD_BWD]);
		printf("]}\n");
	}
	tier_dev_close(dev);
	return 0;
}
