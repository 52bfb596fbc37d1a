/* bench_fused.c - tier-bench fused: each of the trainer's fused CUDA steps against the separate
 * steps it replaced, timed in the same run on the same data (the peer of a fusion is what it
 * fused). Rows:
 *   qk-fwd   opsc_qk_fwd               vs opsc_rmsnorm_fwd + tier_attn_rope_fwd
 *   qk-grad  opsc_qk_grad              vs tier_attn_rope_bwd + opsc_rmsnorm_bwd + opsc_to_bf16
 *   norm+res opsc_rmsnorm_bwd_add      vs opsc_rmsnorm_bwd + opsc_add
 *   dA pair  moe_cuda_grouped_wgrad2   vs moe_cuda_grouped_wgrad twice
 *   qk-fwd16 opsc_qk_fwd16 (bf16 q)    vs opsc_qk_fwd (fp32 q): the projections in bf16 (session 38)
 *   qk-grad16 opsc_qk_grad16_ld        vs opsc_qk_grad
 * and each fused form's bytes over its time (GB/s: what it must read and write once).
 * on the trainer's shapes (Qwen3-30B-A3B by default: 4,096 tokens, 32 / 4 heads of 128, H 2048,
 * 128 experts of 8 a token, LoRA rank 16). CUDA only. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef TIER_HAVE_CUDA
#include "core/ops_cuda.h"
#include "moe/moe_cuda.h"
#endif
#include "tier/tier.h"
#include "tools/bench.h"
#include "tools/bench_dev.h"

static const char *const cmd = "fused";

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench fused [--tokens T] [--iters N]\n"
		"Each fused CUDA step of the trainer against the separate steps it replaced, same run, same\n"
		"data: qk-fwd (q/k RMSNorm + RoPE), qk-grad (inverse RoPE + the norm's backward + bf16),\n"
		"norm+res (the RMSNorm backward with a residual's add), dA pair (the gate and up adapters'\n"
		"dA in one pass over X), and qk-fwd16, qk-grad16 (the q/k kernels from a bf16 projection\n"
		"against the same from fp32). Shapes of Qwen3-30B-A3B at T tokens (default 4096). Each time is\n"
		"the median of N timed runs (default 20) after two warm-ups, timed with CUDA events on the\n"
		"compute stream; the ratio is separate / fused (above 1: the fusion is faster).\n"
		"\n"
		"  --tokens T   tokens of the micro-batch (default 4096)\n"
		"  --iters N    timed runs per figure (default 20)\n"
		"  --help       this text\n");
}

#ifdef TIER_HAVE_CUDA
/* The buffers of every row (device memory). */
typedef struct {
	tier_dev *dev;
	int T, heads, kvh, hd, H, E, k, r;
	tier_rope_params rq;
	float *qp, *rstd, *dq, *tmp, *dy, *res, *dx;
	void *qp16, *w_qn, *q16, *w_ln, *x16, *dz0, *dz1, *da0[128], *da1[128];
	int32_t *off;
	void *scratch;
	int row; /* the row being timed, and whether the fused (1) or the separate (0) form */
	int fused;
} fz;

static int fz_calls(void *arg)
{
	fz *z = arg;
	tier_dev *d = z->dev;
	int rows = z->T * z->heads, rows_h = z->T, rc;
	switch (z->row) {
	case 0:
		if (z->fused)
			return opsc_qk_fwd(d, &z->rq, z->qp, z->w_qn, 1e-6f, z->q16, z->rstd);
		rc = opsc_rmsnorm_fwd(d, rows, z->hd, 1e-6f, z->qp, z->w_qn, z->q16, z->rstd);
		return rc ? rc : tier_attn_rope_fwd(d, &z->rq, NULL, z->q16);
	case 1:
		if (z->fused)
			return opsc_qk_grad(d, &z->rq, z->dq, z->qp, z->w_qn, z->rstd, z->q16);
		/* the separate steps rotate dq in place: on a copy, so that every run sees the same data */
		rc = tier_dev_memcpy_d2d(d, z->tmp, z->dq, sizeof(float) * (size_t)rows * z->hd);
		if (!rc && !(rc = tier_attn_rope_bwd(d, &z->rq, NULL, z->tmp)) &&
		    !(rc = opsc_rmsnorm_bwd(d, rows, z->hd, z->qp, z->w_qn, z->rstd, z->tmp, z->dx)))
			rc = opsc_to_bf16(d, (size_t)rows * z->hd, z->dx, z->q16);
		return rc;
	case 2:
		if (z->fused)
			return opsc_rmsnorm_bwd_add(d, rows_h, z->H, z->res, z->w_ln, z->rstd, z->dy, z->res, z->dx);
		rc = opsc_rmsnorm_bwd(d, rows_h, z->H, z->res, z->w_ln, z->rstd, z->dy, z->tmp);
		return rc ? rc : opsc_add(d, (size_t)rows_h * z->H, z->res, z->tmp, z->dx);
	case 4:
		if (z->fused)
			return opsc_qk_fwd16(d, &z->rq, z->qp16, z->w_qn, 1e-6f, z->q16, z->rstd);
		return opsc_qk_fwd(d, &z->rq, z->qp, z->w_qn, 1e-6f, z->q16, z->rstd);
	case 5:
		if (z->fused)
			return opsc_qk_grad16_ld(d, &z->rq, z->dq, z->qp16, z->w_qn, z->rstd, z->q16, (int64_t)z->heads * z->hd);
		return opsc_qk_grad(d, &z->rq, z->dq, z->qp, z->w_qn, z->rstd, z->q16);
	default: {
		const int rows_e = z->T * z->k;
		if (z->fused)
			return moe_cuda_grouped_wgrad2(d, z->E, z->r, z->H, z->off, rows_e, z->dz0, z->dz1, z->x16, 1.0f,
						       1.0f, (float *const *)z->da0, (float *const *)z->da1);
		rc = moe_cuda_grouped_wgrad(d, z->E, z->r, z->H, z->off, rows_e, z->dz0, z->x16, 1.0f,
					    (float *const *)z->da0);
		return rc ? rc : moe_cuda_grouped_wgrad(d, z->E, z->r, z->H, z->off, rows_e, z->dz1, z->x16, 1.0f,
							 (float *const *)z->da1);
	}
	}
}

static int fz_alloc(fz *z)
{
	tier_dev *d = z->dev;
	size_t nq = (size_t)z->T * z->heads * z->hd, nh = (size_t)z->T * z->H, rows_e = (size_t)z->T * z->k;
	int rc;
	z->rq = (tier_rope_params){ .tokens = z->T, .seq = z->T, .n_heads = z->heads, .head_dim = z->hd, .theta = 1e6f };
	if ((rc = bench_dev_buf(d, (void **)&z->qp, 4 * nq, 4)) || (rc = bench_dev_buf(d, (void **)&z->dq, 4 * nq, 4)) ||
	    (rc = bench_dev_buf(d, (void **)&z->tmp, 4 * (nq > nh ? nq : nh), 4)) || (rc = bench_dev_buf(d, (void **)&z->dx, 4 * (nq > nh ? nq : nh), 4)) ||
	    (rc = bench_dev_buf(d, (void **)&z->rstd, 4 * (size_t)z->T * z->heads, 4)) || (rc = bench_dev_buf(d, &z->q16, 2 * nq, 2)) ||
	    (rc = bench_dev_buf(d, &z->qp16, 2 * nq, 2)) ||
	    (rc = bench_dev_buf(d, &z->w_qn, 2 * (size_t)z->hd, 2)) || (rc = bench_dev_buf(d, &z->w_ln, 2 * (size_t)z->H, 2)) ||
	    (rc = bench_dev_buf(d, (void **)&z->dy, 4 * nh, 4)) || (rc = bench_dev_buf(d, (void **)&z->res, 4 * nh, 4)) ||
	    (rc = bench_dev_buf(d, &z->x16, 2 * rows_e * z->H, 2)) || (rc = bench_dev_buf(d, &z->dz0, 2 * rows_e * z->r, 2)) ||
	    (rc = bench_dev_buf(d, &z->dz1, 2 * rows_e * z->r, 2)))
		return rc;
	for (int e = 0; e < z->E; e++)
		if ((rc = bench_dev_buf(d, &z->da0[e], 4 * (size_t)z->r * z->H, 4)) ||
		    (rc = bench_dev_buf(d, &z->da1[e], 4 * (size_t)z->r * z->H, 4)))
			return rc;
	int32_t off[129];
	for (int e = 0; e <= z->E; e++) /* uniform routing */
		off[e] = (int32_t)(rows_e * (size_t)e / (size_t)z->E);
	if ((rc = tier_dev_malloc(d, sizeof off, (void **)&z->off)) || (rc = tier_dev_memcpy_h2d(d, z->off, off, sizeof off)))
		return rc;
	/* a forward's rstd for the rows the norms read: make it from the data */
	return opsc_rmsnorm_fwd(d, z->T * z->heads, z->hd, 1e-6f, z->qp, z->w_qn, z->q16, z->rstd);
}

static void fz_free(fz *z)
{
	void *p[] = { z->qp, z->qp16, z->dq, z->tmp, z->dx, z->rstd, z->q16, z->w_qn, z->w_ln, z->dy, z->res, z->x16, z->dz0,
		      z->dz1, z->off };
	for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
		if (p[i])
			tier_dev_free(z->dev, p[i]);
	for (int e = 0; e < z->E; e++) {
		if (z->da0[e])
			tier_dev_free(z->dev, z->da0[e]);
		if (z->da1[e])
			tier_dev_free(z->dev, z->da1[e]);
	}
}

static const bench_col cols[] = {
	{ "step", "", 9 }, { "separate", "median", 11 }, { "fused", "median", 11 }, { "ratio", "sep/fused", 10 },
	{ "fused", "GB/s", 9 },
};

/* The bytes a row's fused form must read and write once (its GB/s). */
static double fz_bytes(const fz *z, int row)
{
	double nq = (double)z->T * z->heads * z->hd, rows = (double)z->T * z->heads, nh = (double)z->T * z->H;
	double rows_e = (double)z->T * z->k;
	switch (row) {
	case 0: return 4 * nq + 2 * nq + 4 * rows;         /* qp fp32 in, q bf16 and rstd out */
	case 1: return 4 * nq + 4 * nq + 4 * rows + 2 * nq; /* dq, qp, rstd in; the bf16 gradient out */
	case 2: return 4 * nh * 4 + 4 * (double)z->T;       /* x, dy, res in; dx out; rstd */
	case 4: return 2 * nq + 2 * nq + 4 * rows;
	case 5: return 4 * nq + 2 * nq + 4 * rows + 2 * nq;
	default: return 2 * rows_e * z->H + 2 * 2 * rows_e * z->r + 2 * 4.0 * z->E * z->r * z->H; /* X, dZ; dA += */
	}
}

#define NCOLS (sizeof cols / sizeof cols[0])

static int fz_rows(fz *z, unsigned iters)
{
	static const char *const names[] = { "qk-fwd", "qk-grad", "norm+res", "dA pair", "qk-fwd16", "qk-grad16" };
	double geo = 1.0;
	bench_table_header(cols, NCOLS);
	for (int row = 0; row < 6; row++) {
		double t[2];
		for (int f = 0; f < 2; f++) {
			int rc;
			z->row = row, z->fused = f;
			if ((t[f] = bench_measure_ms(z->dev, fz_calls, z, 0, iters, &rc) * 1e6) < 0)
				return rc;
		}
		char a[32], b[32], c[32], g[32];
		const char *cells[] = { names[row], bench_fmt_time(t[0], a, sizeof a), bench_fmt_time(t[1], b, sizeof b),
					bench_fmt_num(t[0] / t[1], 2, c, sizeof c),
					bench_fmt_num(fz_bytes(z, row) / t[1], 0, g, sizeof g) };
		bench_table_row(cols, NCOLS, cells);
		geo *= t[0] / t[1];
	}
	bench_summary("the six rows' time ratios multiply to %.2f (above 1: the fused or bf16 forms are faster)", geo);
	return 0;
}
#endif

int bench_fused(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "tokens", required_argument, NULL, 't' }, { "iters", required_argument, NULL, 'i' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	unsigned T = 4096, iters = 20;
	int ch;
	optind = 1;
	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (ch) {
		case 't': if (bench_parse_uint(cmd, "--tokens", optarg, &T)) return 1; break;
		case 'i': if (bench_parse_uint(cmd, "--iters", optarg, &iters)) return 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args(cmd, argc, argv))
		return 1;
	if (T < 1 || T > (1u << 20) || iters < 1) {
		fprintf(stderr, "tier-bench fused: --tokens must be 1..1048576 and --iters at least 1\n");
		return 1;
	}
#ifndef TIER_HAVE_CUDA
	fprintf(stderr, "tier-bench fused: the fused steps are CUDA kernels and this build has no CUDA (configure "
			"--with-cuda)\n");
	return 2;
#else
	fz z;
	memset(&z, 0, sizeof z);
	z.T = (int)T, z.heads = 32, z.kvh = 4, z.hd = 128, z.H = 2048, z.E = 128, z.k = 8, z.r = 16;
	if (!tier_cuda_available()) {
		fprintf(stderr, "tier-bench fused: no CUDA device; the fused steps run on CUDA only\n");
		return 2;
	}
	int rc = tier_dev_open(&z.dev, TIER_DEV_CUDA, 0);
	bench_comment("tier-bench fused: fused CUDA steps against the separate steps they replaced");
	bench_comment("%u tokens, 32 q heads of 128, H 2048, 128 experts x 8, LoRA rank 16; median of %u", T, iters);
	if (!rc && !(rc = fz_alloc(&z)))
		rc = fz_rows(&z, iters);
	if (rc)
		fprintf(stderr, "tier-bench fused: %s\n", tier_last_error());
	if (z.dev) {
		fz_free(&z);
		tier_dev_close(z.dev);
	}
	return rc ? 2 : 0;
#endif
}
