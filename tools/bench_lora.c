/* bench_lora.c - tier-bench lora: the experts' LoRA kernels of the trainer's backward, one row each, on
 * the trainer's shape (Qwen3-30B-A3B: 4,096 tokens, 128 experts of 8 a token, H 2048, I 768, LoRA
 * rank 16, uniform or Zipf routing), each as the bytes it must move, its time and the rate against a device-
 * to-device copy measured in the same run (the peer: these kernels read each operand once and are
 * bound by memory, so the copy's rate is their ceiling). The weight-gradient reductions
 * (moe_cuda_grouped_wgrad, _wgrad2) run again under each C tile of TIER_MOE_WGRAD_TILE (and "rmw": the
 * default tile with TIER_MOE_WGRAD_ADD=rmw, the epilogue before session 25), and the rank
 * products under each TIER_MOE_SKINNY_ROWS, so that one run says which form each shape wants. CUDA only. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef TIER_HAVE_CUDA
#include "moe/moe_cuda.h"
#include "moe/moe_skinny.h"
#include "tools/bench_dev.h"
#endif
#include "tier/tier.h"
#include "tools/bench.h"

static const char *const cmd = "lora";

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench lora [--tokens T] [--layers L] [--iters N] [--routing uniform|zipf]\n"
		"The experts' LoRA kernels of the trainer's backward (gate, up and down adapters of rank 16\n"
		"on Qwen3-30B-A3B's experts: 128 of 8 a token, H 2048, I 768), one row\n"
		"each: the rank products (Z = X A^T, dZ = dY B) and the weight-gradient reductions (dB, dA),\n"
		"with the bytes each must read and write, the median of N timed runs (default 20, after two\n"
		"warm-ups; CUDA events) and the rate against a device-to-device copy in the same run. The\n"
		"reductions run again under every TIER_MOE_WGRAD_TILE tile, the rank products under\n"
		"TIER_MOE_SKINNY_ROWS=128. The summary adds one layer's\n"
		"backward (the up adapter's dZ and dB as the gate's; Z kept by the forward) and L layers of\n"
		"it (default 48).\n"
		"\n"
		"  --tokens T   tokens of the micro-batch (default 4096)\n"
		"  --layers L   layers in the summary's step figure (default 48)\n"
		"  --iters N    timed runs per figure (default 20)\n"
		"  --routing R  uniform (default: each expert rows / 128) or zipf (expert e's share\n"
		"               1 / (e + 1)^1.2: the hottest holds ~28%% of the rows)\n"
		"  --help       this text\n");
}

#ifdef TIER_HAVE_CUDA
enum { L_COPY, L_ZGU, L_DZG, L_DBG, L_DAGU, L_ZD, L_DZD, L_DBD, L_DAD, L_GATHER, L_DAGX, L_N };
static const char *const names[L_N] = { "copy", "Z g+u", "dZ g", "dB g", "dA g+u", "Z d", "dZ d", "dB d", "dA d",
					"gather", "dA g+u x" };
/* how often a row's kernel runs in one layer's backward (dZ u and dB u: as dZ g and dB g; the Z
 * products none: the forward keeps Z since session 19). The last two are the backward's form since
 * session 25: dA g+u reading the layer's x through the permutation ("x") instead of the xg that the
 * gather made ("gather" + "dA g+u", counted for the form before). */
static const int per_layer[L_N] = { 0, 0, 2, 2, 1, 0, 1, 1, 1, 1, 0 };
static const char *const tiles[] = { "64x16", "128x16", "16x64", "16x128", "64x64", "rmw" };
/* The reductions' rows that are not tiles: the default tile under another knob. "rmw": the epilogue's
 * read-modify-write of C (the form before session 25). */
static const struct {
	const char *name, *knob, *value;
} forms[] = { { "rmw", "TIER_MOE_WGRAD_ADD", "rmw" } };
#define NTILES (sizeof tiles / sizeof tiles[0])
static const char *const sk_rows[] = { "128" }; /* TIER_MOE_SKINNY_ROWS beside the default 64 */
#define NSKROWS (sizeof sk_rows / sizeof sk_rows[0])
#define LZ_E 128

typedef struct {
	tier_dev *dev;
	int E, H, I, r, rows;
	void *x, *dy, *h, *dg, *zg, *zu, *dzg, *dzu, *zd, *dzd, *cp; /* bf16 activations; cp: the copy's target */
	void *xt;                /* the layer's x [tokens, H], whose rows x holds permuted */
	int32_t *row_pair, *pair_row; /* the permutation: a shuffle of the tokens' pairs over the rows */
	void *wa, *wb;                                              /* the adapters' A and B, bf16 */
	float *ga;                                                  /* their gradients, fp32 */
	const void *ag[LZ_E], *au[LZ_E], *bg[LZ_E], *ad[LZ_E], *bd[LZ_E];
	float *dag[LZ_E], *dau[LZ_E], *dbg[LZ_E], *dad[LZ_E], *dbd[LZ_E];
	int32_t *off, hoff[LZ_E + 1]; /* the routing's offsets on the device and on the host */
	int row, zipf;
} lz;

static int lz_calls(void *arg)
{
	lz *z = arg;
	tier_dev *d = z->dev;
	int E = z->E, H = z->H, I = z->I, r = z->r, n = z->rows;
	switch (z->row) {
	case L_COPY: return tier_dev_memcpy_d2d(d, z->cp, z->x, (size_t)n * H * 2);
	case L_ZGU: return moe_cuda_grouped_skinny(d, E, r, H, z->off, n, 2, z->ag, z->au, 0, z->x, z->zg, z->zu, 1.0f);
	case L_DZG: return moe_cuda_grouped_skinny(d, E, r, I, z->off, n, 1, z->bg, NULL, 1, z->dg, z->dzg, NULL, 0.5f);
	case L_DBG: return moe_cuda_grouped_wgrad(d, E, I, r, z->off, n, z->dg, z->zg, 0.5f, z->dbg);
	case L_DAGU:
		return moe_cuda_grouped_wgrad2(d, E, r, H, z->off, n, z->dzg, z->dzu, z->x, 1.0f, 1.0f, z->dag, z->dau);
	case L_ZD: return moe_cuda_grouped_skinny(d, E, r, I, z->off, n, 1, z->ad, NULL, 0, z->h, z->zd, NULL, 1.0f);
	case L_DZD: return moe_cuda_grouped_skinny(d, E, r, H, z->off, n, 1, z->bd, NULL, 1, z->dy, z->dzd, NULL, 0.5f);
	case L_DBD: return moe_cuda_grouped_wgrad(d, E, H, r, z->off, n, z->dy, z->zd, 0.5f, z->dbd);
	case L_DAD: return moe_cuda_grouped_wgrad(d, E, r, I, z->off, n, z->dzd, z->h, 1.0f, z->dad);
	case L_GATHER: return moe_cuda_gather(d, n / 8, 8, H, z->pair_row, z->xt, z->x);
	default:
		return moe_cuda_grouped_wgrad2_rows(d, E, r, H, z->off, n, z->dzg, z->dzu, z->xt, z->row_pair, 8, 1.0f, 1.0f,
						    z->dag, z->dau);
	}
}

/* What a row's kernel must read and write at the least: its operands once, Z written, a gradient
 * read and written (C += ...). */
static double lz_bytes(const lz *z, int row)
{
	double n = z->rows, E = z->E, H = z->H, I = z->I, r = z->r;
	switch (row) {
	case L_COPY: return 2 * n * H * 2;
	case L_ZGU: return n * H * 2 + 2 * E * r * H * 2 + 2 * n * r * 2;
	case L_DZG: case L_ZD: return n * I * 2 + E * I * r * 2 + n * r * 2;
	case L_DBG: case L_DAD: return n * I * 2 + n * r * 2 + 2 * E * I * r * 4;
	case L_DAGU: case L_DAGX: return n * H * 2 + 2 * n * r * 2 + 2 * 2 * E * r * H * 4;
	case L_GATHER: return n / 8 * H * 2 + n * H * 2 + n * 4;
	case L_DZD: return n * H * 2 + E * H * r * 2 + n * r * 2;
	default: return n * H * 2 + n * r * 2 + 2 * E * H * r * 4; /* L_DBD */
	}
}

static int is_wgrad(int row) { return row == L_DBG || row == L_DAGU || row == L_DBD || row == L_DAD || row == L_DAGX; }

/* E contiguous slices of `each` elements at base, as a table of E pointers: bf16 weights, fp32
 * gradients. */
static void lz_table(const uint16_t *base, size_t each, int E, const void **t)
{
	for (int e = 0; e < E; e++)
		t[e] = base + (size_t)e * each;
}

static void lz_gtable(float *base, size_t each, int E, float **t)
{
	for (int e = 0; e < E; e++)
		t[e] = base + (size_t)e * each;
}

/* The routing: uniform (each expert rows / E, exactly), or zipf: expert e's share 1 / (e + 1)^1.2
 * of the rows (the hottest ~28% at 128 experts), the rounding's remainder to expert 0. */
static void lz_offsets(lz *z)
{
	double w[LZ_E], sum = 0;
	int got = 0;
	for (int e = 0; e < z->E; e++)
		sum += w[e] = z->zipf ? pow(e + 1, -1.2) : 1.0;
	for (int e = 0; e < z->E; e++) {
		int n = (int)(z->rows * w[e] / sum);
		z->hoff[e + 1] = n; /* counts first */
		got += n;
	}
	z->hoff[1] += z->rows - got;
	z->hoff[0] = 0;
	for (int e = 0; e < z->E; e++)
		z->hoff[e + 1] += z->hoff[e];
}

/* The permutation: pair p (token p / 8) at row pair_row[p], a shuffle (fixed seed), as routing
 * scatters a token's pairs over the experts' rows. */
static int lz_perm(lz *z)
{
	size_t n = (size_t)z->rows;
	int32_t *rp = malloc(4 * n), *pr = malloc(4 * n);
	int rc = rp && pr ? 0 : tier_fail(-ENOMEM, "tier-bench lora: no host memory for the permutation");
	uint64_t s = 0x9e3779b97f4a7c15ull;
	for (size_t i = 0; !rc && i < n; i++)
		rp[i] = (int32_t)i;
	for (size_t i = n - 1; !rc && i > 0; i--) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		size_t j = (size_t)((s >> 33) % (i + 1));
		int32_t t = rp[i];
		rp[i] = rp[j], rp[j] = t;
	}
	for (size_t r = 0; !rc && r < n; r++)
		pr[rp[r]] = (int32_t)r;
	if (!rc && !(rc = tier_dev_malloc(z->dev, 4 * n, (void **)&z->row_pair)) &&
	    !(rc = tier_dev_malloc(z->dev, 4 * n, (void **)&z->pair_row)) &&
	    !(rc = tier_dev_memcpy_h2d(z->dev, z->row_pair, rp, 4 * n)))
		rc = tier_dev_memcpy_h2d(z->dev, z->pair_row, pr, 4 * n);
	free(rp), free(pr);
	return rc;
}

static int lz_alloc(lz *z)
{
	tier_dev *d = z->dev;
	size_t n = (size_t)z->rows, H = (size_t)z->H, I = (size_t)z->I, r = (size_t)z->r, E = (size_t)z->E;
	size_t rh = r * H, ri = r * I; /* A_g, A_u [r, H], B_g [I, r], A_d [r, I], B_d [H, r] per expert */
	size_t w_el = E * (3 * rh + 2 * ri);
	void **act[] = { &z->x, &z->dy, &z->cp, &z->h, &z->dg };
	size_t act_n[] = { n * H, n * H, n * H, n * I, n * I };
	void **zs[] = { &z->zg, &z->zu, &z->dzg, &z->dzu, &z->zd, &z->dzd };
	int rc;
	for (size_t i = 0; i < sizeof act / sizeof act[0]; i++)
		if ((rc = bench_dev_buf(d, act[i], 2 * act_n[i], 2)))
			return rc;
	for (size_t i = 0; i < sizeof zs / sizeof zs[0]; i++)
		if ((rc = bench_dev_buf(d, zs[i], 2 * n * r, 2)))
			return rc;
	if ((rc = bench_dev_buf(d, &z->wa, 2 * w_el, 2)) || (rc = bench_dev_buf(d, (void **)&z->ga, 4 * w_el, 4)))
		return rc;
	/* A_g, A_u, B_g, A_d, B_d back to back, the gradients in the same order */
	const uint16_t *w = z->wa;
	lz_table(w, rh, z->E, z->ag), lz_table(w + E * rh, rh, z->E, z->au), lz_table(w + 2 * E * rh, ri, z->E, z->bg);
	lz_table(w + 2 * E * rh + E * ri, ri, z->E, z->ad), lz_table(w + 2 * E * rh + 2 * E * ri, rh, z->E, z->bd);
	float *g = z->ga;
	lz_gtable(g, rh, z->E, z->dag), lz_gtable(g + E * rh, rh, z->E, z->dau), lz_gtable(g + 2 * E * rh, ri, z->E, z->dbg);
	lz_gtable(g + 2 * E * rh + E * ri, ri, z->E, z->dad), lz_gtable(g + 2 * E * rh + 2 * E * ri, rh, z->E, z->dbd);
	lz_offsets(z);
	if ((rc = tier_dev_malloc(d, sizeof z->hoff, (void **)&z->off)) ||
	    (rc = tier_dev_memcpy_h2d(d, z->off, z->hoff, sizeof z->hoff)) ||
	    (rc = bench_dev_buf(d, &z->xt, 2 * n / 8 * H, 2)))
		return rc;
	return lz_perm(z);
}

static void lz_free(lz *z)
{
	void *p[] = { z->x, z->dy, z->cp, z->h, z->dg, z->zg, z->zu, z->dzg, z->dzu,
		      z->zd, z->dzd, z->wa, z->ga, z->off, z->xt, z->row_pair, z->pair_row };
	for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
		if (p[i])
			tier_dev_free(z->dev, p[i]);
}

static const bench_col cols[] = {
	{ "kernel", "", 8 }, { "tile", "", 7 }, { "bytes", "", 11 }, { "time", "median", 10 },
	{ "rate", "GB/s", 9 }, { "of copy", "", 8 },
};
#define NCOLS (sizeof cols / sizeof cols[0])

/* Time row under the tile named (NULL: the rule; a reduction's TIER_MOE_WGRAD_TILE, a rank
 * product's TIER_MOE_SKINNY_ROWS), print it; its time in *t. */
static int lz_row(lz *z, int row, const char *tile, unsigned iters, double copy_rate, double *t)
{
	/* a tile's name is its knob's value, but for the reductions' other forms (forms[]) */
	const char *knob = is_wgrad(row) ? "TIER_MOE_WGRAD_TILE" : "TIER_MOE_SKINNY_ROWS", *val = tile;
	for (size_t i = 0; tile && is_wgrad(row) && i < sizeof forms / sizeof forms[0]; i++)
		if (!strcmp(tile, forms[i].name))
			knob = forms[i].knob, val = forms[i].value;
	if (tile)
		setenv(knob, val, 1);
	z->row = row;
	int rc;
	*t = bench_measure_ms(z->dev, lz_calls, z, 0, iters, &rc) * 1e6;
	if (tile)
		unsetenv(knob);
	if (*t < 0)
		return rc;
	double b = lz_bytes(z, row), rate = b / *t;
	char c[4][32];
	const char *cells[] = { names[row], tile ? tile : is_wgrad(row) ? "auto" : "-",
				bench_fmt_size((uint64_t)b, c[0], sizeof c[0]), bench_fmt_time(*t, c[1], sizeof c[1]),
				bench_fmt_gbps(rate, c[2], sizeof c[2]),
				row == L_COPY ? "1.00" : bench_fmt_num(rate / copy_rate, 2, c[3], sizeof c[3]) };
	bench_table_row(cols, NCOLS, cells);
	return 0;
}

static int lz_rows(lz *z, unsigned iters, unsigned layers)
{
	double t[L_N], best[L_N], copy_rate = 0, layer = 0, layer_best = 0;
	int rc;
	bench_table_header(cols, NCOLS);
	for (int row = 0; row < L_N; row++) {
		if ((rc = lz_row(z, row, NULL, iters, copy_rate, &t[row])))
			return rc;
		if (row == L_COPY)
			copy_rate = lz_bytes(z, row) / t[row];
		best[row] = t[row];
	}
	for (int row = 1; row < L_N; row++) { /* every row but the copy under each of its forms */
		size_t n = is_wgrad(row) ? NTILES : NSKROWS;
		for (size_t i = 0; i < n; i++) {
			double ti;
			if ((rc = lz_row(z, row, is_wgrad(row) ? tiles[i] : sk_rows[i], iters, copy_rate, &ti)))
				return rc;
			best[row] = ti < best[row] ? ti : best[row];
		}
	}
	for (int row = 0; row < L_N; row++)
		layer += per_layer[row] * t[row], layer_best += per_layer[row] * best[row];
	bench_summary("one layer's experts' LoRA backward %.1f us by the default tiles, %.1f us by each reduction's "
		      "fastest; x %u layers: %.2f ms, %.2f ms", layer / 1e3, layer_best / 1e3, layers,
		      layer * layers / 1e6, layer_best * layers / 1e6);
	bench_summary("dA g+u from x through the permutation %.1f us against the gather and dA g+u from xg %.1f us "
		      "(%.2fx)", t[L_DAGX] / 1e3, (t[L_GATHER] + t[L_DAGU]) / 1e3, (t[L_GATHER] + t[L_DAGU]) / t[L_DAGX]);
	return 0;
}
#endif

int bench_lora(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "tokens", required_argument, NULL, 't' }, { "layers", required_argument, NULL, 'l' },
		{ "iters", required_argument, NULL, 'i' },  { "routing", required_argument, NULL, 'r' },
		{ "help", no_argument, NULL, 'h' },	    { NULL, 0, NULL, 0 },
	};
	unsigned T = 4096, layers = 48, iters = 20;
	int ch, zipf = 0;
	optind = 1;
	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (ch) {
		case 't': if (bench_parse_uint(cmd, "--tokens", optarg, &T)) return 1; break;
		case 'l': if (bench_parse_uint(cmd, "--layers", optarg, &layers)) return 1; break;
		case 'i': if (bench_parse_uint(cmd, "--iters", optarg, &iters)) return 1; break;
		case 'r':
			if (strcmp(optarg, "uniform") && strcmp(optarg, "zipf")) {
				fprintf(stderr, "tier-bench lora: --routing %s; use uniform or zipf\n", optarg);
				return 1;
			}
			zipf = !strcmp(optarg, "zipf");
			break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args(cmd, argc, argv))
		return 1;
	if (T < 1 || T > (1u << 16) || iters < 1 || layers < 1) {
		fprintf(stderr, "tier-bench lora: --tokens must be 1..65536, --iters and --layers at least 1\n");
		return 1;
	}
#ifndef TIER_HAVE_CUDA
	fprintf(stderr, "tier-bench lora: the experts' LoRA kernels are CUDA kernels and this build has no CUDA "
			"(configure --with-cuda)\n");
	return 2;
#else
	if (!tier_cuda_available()) {
		fprintf(stderr, "tier-bench lora: no CUDA device; the experts' LoRA kernels run on CUDA only\n");
		return 2;
	}
	lz z;
	memset(&z, 0, sizeof z);
	z.E = LZ_E, z.H = 2048, z.I = 768, z.r = 16, z.rows = (int)T * 8, z.zipf = zipf;
	int rc = tier_dev_open(&z.dev, TIER_DEV_CUDA, 0);
	bench_comment("tier-bench lora: the experts' LoRA backward kernels against a device-to-device copy");
	bench_comment("%u tokens x 8 of 128 experts, H 2048, I 768, rank 16, %s routing; median of %u", T,
		      zipf ? "zipf 1.2" : "uniform", iters);
	if (!rc && !(rc = lz_alloc(&z)))
		rc = lz_rows(&z, iters, layers);
	if (rc)
		fprintf(stderr, "tier-bench lora: %s\n", tier_last_error());
	if (z.dev) {
		lz_free(&z);
		tier_dev_close(z.dev);
	}
	return rc ? 2 : 0;
#endif
}
