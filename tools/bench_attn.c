/* bench_attn.c - tier-bench attn: time and TFLOP/s of causal attention forward, backward and
 * forward+backward on model shapes (default Qwen3-30B-A3B's). The peer (torch's
 * F.scaled_dot_product_attention) is measured by bench/attn_torch.py, which reads the JSON line. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef TIER_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "tier/tier.h"
#include "tools/bench.h"

static const char *const cmd = "attn";

typedef struct {
	int64_t B, S, H, KH, D;
} attn_shape;

typedef struct {
	tier_dev_kind kind;
	unsigned iters, n_shapes;
	int json;
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
	int op, rc;
#ifdef TIER_HAVE_CUDA
	cudaEvent_t e0, e1;
#endif
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
		"  --iters N            timed runs per figure (default 20)\n"
		"  --json               print one JSON line with every figure after the table\n"
		"  --help               this text\n"
		"Exit status: 0 done, 1 bad arguments, 2 the benchmark failed (message on stderr).\n");
}

static int parse(int argc, char **argv, attn_opts *o)
{
	static const struct option opts[] = {
		{ "device", required_argument, NULL, 'd' }, { "shape", required_argument, NULL, 's' },
		{ "iters", required_argument, NULL, 'i' }, { "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	int c;
	*o = (attn_opts){ .kind = TIER_DEV_CUDA, .iters = 20 };
	optind = 1;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'd':
			if (bench_parse_device("attn", optarg, &o->kind))
				return 1;
			break;
		case 's': {
			long long b, s, h, kh, d;
			char tail;
			if (o->n_shapes == 8 || sscanf(optarg, "%lld,%lld,%lld,%lld,%lld%c", &b, &s, &h, &kh, &d, &tail) != 5 ||
			    b < 1 || s < 1 || h < 1 || kh < 1 || d < 1) {
				fprintf(stderr, "tier-bench attn: --shape %s: give B,S,H,KVH,D (positive; at most 8 shapes)\n", optarg);
				return 1;
			}
			o->shapes[o->n_shapes++] = (attn_shape){ b, s, h, kh, d };
			break;
		}
		case 'i': if (bench_parse_uint(cmd, "--iters", optarg, &o->iters)) return 1; break;
		case 'j': o->json = 1; break;
		case 'h': usage(stdout); return -1;
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args("attn", argc, argv))
		return 1;
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

/* One timed call of the case's operation, in ns. */
static double run_op(void *arg)
{
	attn_case *c = arg;
	uint64_t t0 = tier_now_ns();
	float ms = 0;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(c->dev) == TIER_DEV_CUDA)
		cudaEventRecord(c->e0, (cudaStream_t)tier_dev_stream(c->dev));
#endif
	if ((c->rc = call(c, c->op)))
		return -1;
#ifdef TIER_HAVE_CUDA
	if (tier_dev_kind_of(c->dev) == TIER_DEV_CUDA) {
		cudaEventRecord(c->e1, (cudaStream_t)tier_dev_stream(c->dev));
		if (cudaEventSynchronize(c->e1) != cudaSuccess || cudaEventElapsedTime(&ms, c->e0, c->e1) != cudaSuccess) {
			c->rc = tier_fail(-EIO, "attn bench: CUDA events failed: %s", cudaGetErrorString(cudaGetLastError()));
			return -1;
		}
		return ms * 1e6;
	}
#endif
	(void)ms;
	return (double)(tier_now_ns() - t0);
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
	int rc = 0;
#ifdef TIER_HAVE_CUDA
	if (o->kind == TIER_DEV_CUDA && (cudaEventCreate(&c.e0) != cudaSuccess || cudaEventCreate(&c.e1) != cudaSuccess))
		rc = tier_fail(-EIO, "attn bench: cannot create CUDA events");
#endif
	if (!rc)
		rc = alloc_case(&c, o->kind, s);
	for (int op = 0; op < N_OPS && !rc; op++) {
		char cells[NCOLS][32];
		const char *cp[NCOLS];
		c.op = op;
		for (int w = 0; w < 2 && !rc; w++)
			if (run_op(&c) < 0)
				rc = c.rc;
		ms[op] = rc ? 0 : bench_median_run(run_op, &c, o->iters) / 1e6;
		if (!rc && ms[op] < 0)
			rc = c.rc;
		if (rc)
			break;
		snprintf(cells[0], 32, "%lld", (long long)s.B), snprintf(cells[1], 32, "%lld", (long long)s.S);
		snprintf(cells[2], 32, "%lld", (long long)s.H), snprintf(cells[3], 32, "%lld", (long long)s.KH);
		snprintf(cells[4], 32, "%lld", (long long)s.D), snprintf(cells[5], 32, "%s", op_name[op]);
		bench_fmt_time(ms[op] * 1e6, cells[6], 32);
		bench_fmt_num(op_flop_factor[op] * fwd_flop(s) / (ms[op] * 1e9), 1, cells[7], 32);
		for (size_t k = 0; k < NCOLS; k++)
			cp[k] = cells[k];
		bench_table_row(cols, NCOLS, cp);
	}
#ifdef TIER_HAVE_CUDA
	if (o->kind == TIER_DEV_CUDA) {
		cudaEventDestroy(c.e0);
		cudaEventDestroy(c.e1);
	}
#endif
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
	if ((rc = tier_dev_open(&dev, o.kind, 0))) {
		fprintf(stderr, "tier-bench attn: %s\n", tier_last_error());
		return 2;
	}
	bench_comment("tier-bench attn: causal flash attention with GQA, forward / backward / forward+backward");
	bench_comment("device %s; median of %u runs after 2 warm-up runs", tier_dev_name(dev), o.iters);
	bench_comment("rate counts causal FLOPs: fwd 4*S*S*D*H*B/2, bwd 2.5x that, fwd+bwd 3.5x");
	bench_table_header(cols, NCOLS);
	for (unsigned i = 0; i < o.n_shapes && !rc; i++)
		rc = bench_shape(dev, &o, o.shapes[i], ms[i]);
	if (rc) {
		fprintf(stderr, "tier-bench attn: %s\n", tier_last_error());
		tier_dev_close(dev);
		return 2;
	}
	bench_summary("%u shapes; first: fwd %.3f ms (%.1f TFLOP/s), fwd+bwd %.3f ms (%.1f TFLOP/s)", o.n_shapes,
		      ms[0][OP_FWD], fwd_flop(o.shapes[0]) / (ms[0][OP_FWD] * 1e9), ms[0][OP_FWD_BWD],
		      3.5 * fwd_flop(o.shapes[0]) / (ms[0][OP_FWD_BWD] * 1e9));
	if (o.json) {
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
