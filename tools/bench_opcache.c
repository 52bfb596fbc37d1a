/* bench_opcache.c - tier-bench opcache: a stack of matrix-product layers trained under an HBM budget
 * too small for every activation, three ways in one process: full recompute (checkpoints at layer
 * boundaries), keep-everything-that-fits (first come, first served, HBM only) and the selective
 * op cache (value density, HBM + DDR).
 *
 * The model: layers alternate up (H -> F) and down (F -> H). Forward: Z_l = X_l W_l, X_{l+1} =
 * gelu(Z_l); the layer inputs X_l are the checkpoints every mode keeps. The weights are frozen (as
 * under LoRA): the backward computes G = dZ_l W_l^T and dZ_{l-1} = G * gelu'(Z_{l-1}), so it needs
 * Z_0 .. Z_{L-2}: cached, or recomputed from the checkpoint X_{l-1}. It starts from dZ_{L-1} = X_L.
 * A down layer's Z costs 4x the FLOPs per byte of an up layer's: the value of keeping it differs. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/tier.h"
#include "tools/bench.h"
#include "tools/bench_opcache.h"

static const char *const cmd = "opcache";

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-bench opcache [--device cpu|cuda] [--layers L] [--tokens T] [--hidden H] [--ffn F]\n"
		"                          [--hbm-frac X | --hbm SIZE] [--ddr SIZE] [--steps N]\n"
		"Step time of a stack of L matrix-product layers (alternating H->F and F->H, frozen weights,\n"
		"GELU), forward and backward, under an op-cache HBM budget too small for every activation that\n"
		"the backward needs, three ways: full recompute (activation checkpointing at layer boundaries),\n"
		"fcfs (offer everything, keep what fits in HBM, first come first served) and selective (value\n"
		"density, HBM then DDR). fp32 OpenBLAS on the CPU, bf16 cuBLASLt on CUDA. Each time is the\n"
		"median of N steps after one warm-up step.\n\n"
		"  --device KIND   cpu or cuda (default: cuda when a GPU is present)\n"
		"  --layers L      layers, even (default 8 cpu, 32 cuda)\n"
		"  --tokens T      rows of every activation (default 512 cpu, 8192 cuda)\n"
		"  --hidden H      model width (default 512 cpu, 4096 cuda)\n"
		"  --ffn F         inner width (default 4H)\n"
		"  --hbm-frac X    op-cache HBM budget as a fraction of the activations the backward needs (0.5)\n"
		"  --hbm SIZE      op-cache HBM budget in bytes (instead of --hbm-frac)\n"
		"  --ddr SIZE      op-cache DDR budget (default: all those activations)\n"
		"  --steps N       timed steps per mode (default 5)\n"
		"  --help          this text\n"
		"Exit status: 0 done, 1 bad arguments, 2 the benchmark failed (message on stderr).\n");
}

static int parse(int argc, char **argv, oc_opts *o)
{
	static const struct option opts[] = {
		{ "device", required_argument, NULL, 'd' }, { "layers", required_argument, NULL, 'L' },
		{ "tokens", required_argument, NULL, 'T' }, { "hidden", required_argument, NULL, 'H' },
		{ "ffn", required_argument, NULL, 'F' },    { "hbm-frac", required_argument, NULL, 'f' },
		{ "hbm", required_argument, NULL, 'b' },    { "ddr", required_argument, NULL, 'D' },
		{ "steps", required_argument, NULL, 's' },  { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	memset(o, 0, sizeof *o);
	o->kind = tier_cuda_available() ? TIER_DEV_CUDA : TIER_DEV_CPU;
	o->hbm_frac = 0.5;
	o->steps = 5;
	optind = 1;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'd':
			if (bench_parse_device("opcache", optarg, &o->kind))
				return 1;
			break;
		case 'L': if (bench_parse_uint(cmd, "--layers", optarg, &o->L)) return 1; break;
		case 'T': if (bench_parse_uint(cmd, "--tokens", optarg, &o->T)) return 1; break;
		case 'H': if (bench_parse_uint(cmd, "--hidden", optarg, &o->H)) return 1; break;
		case 'F': if (bench_parse_uint(cmd, "--ffn", optarg, &o->F)) return 1; break;
		case 'b': if (bench_parse_size(cmd, "--hbm", optarg, &o->hbm)) return 1; break;
		case 'D': if (bench_parse_size(cmd, "--ddr", optarg, &o->ddr)) return 1; o->ddr_set = 1; break;
		case 's': if (bench_parse_uint(cmd, "--steps", optarg, &o->steps)) return 1; break;
		case 'f': {
			char *e;
			o->hbm_frac = strtod(optarg, &e);
			if (*e || !(o->hbm_frac > 0 && o->hbm_frac <= 1)) {
				fprintf(stderr, "tier-bench opcache: --hbm-frac %s: give a fraction in (0, 1]\n", optarg);
				return 1;
			}
			break;
		}
		case 'h': usage(stdout); return -1;
		default: usage(stderr); return 1;
		}
	}
	if (bench_no_extra_args("opcache", argc, argv))
		return 1;
	int cuda = o->kind == TIER_DEV_CUDA;
	if (!o->L) o->L = cuda ? 32 : 8;
	if (!o->T) o->T = cuda ? 8192 : 512;
	if (!o->H) o->H = cuda ? 4096 : 512;
	if (!o->F) o->F = 4 * o->H;
	if (o->L < 2 || o->L % 2 || !o->steps || (cuda && (o->T % 8 || o->H % 8 || o->F % 8))) {
		fprintf(stderr, "tier-bench opcache: --layers must be even and >= 2, --steps >= 1, and on CUDA "
				"--tokens, --hidden and --ffn multiples of 8\n");
		return 1;
	}
	return 0;
}

/* ---- The model ---------------------------------------------------------------------------------- */
static unsigned lk(const oc_model *m, unsigned l) { return l % 2 ? m->o.F : m->o.H; } /* inner dim */
static unsigned ln(const oc_model *m, unsigned l) { return l % 2 ? m->o.H : m->o.F; } /* output dim */
static size_t zbytes(const oc_model *m, unsigned l) { return (size_t)m->o.T * ln(m, l) * m->el; }

static tier_op_cost layer_cost(const oc_model *m, unsigned l)
{
	double T = m->o.T, K = lk(m, l), N = ln(m, l);
	tier_op_cost c = { TIER_OP_MATMUL, 2 * T * K * N, m->el * (T * K + K * N + T * N), 0 };
	return c;
}

static int model_alloc(oc_model *m)
{
	unsigned L = m->o.L;
	size_t most = 0;
	m->X = calloc(L + 1, sizeof *m->X);
	m->W = calloc(L, sizeof *m->W);
	if (!m->X || !m->W)
		return tier_fail(-ENOMEM, "opcache bench: out of memory");
	int rc = 0;
	for (unsigned l = 0; l <= L && !rc; l++) {
		size_t xb = (size_t)m->o.T * (l < L ? lk(m, l) : m->o.H) * m->el;
		rc = oc_alloc(m, xb, &m->X[l]);
		if (!rc && l < L)
			rc = oc_alloc(m, (size_t)lk(m, l) * ln(m, l) * m->el, &m->W[l]);
		if (!rc && l < L)
			rc = oc_fill(m, m->W[l], (size_t)lk(m, l) * ln(m, l), 1.0f / sqrtf((float)lk(m, l)), 17 + l);
	}
	for (unsigned l = 0; l < L; l++)
		most = zbytes(m, l) > most ? zbytes(m, l) : most;
	for (int i = 0; i < 3 && !rc; i++)
		rc = oc_alloc(m, most, i == 0 ? &m->Z : i == 1 ? &m->dZ : &m->G);
	if (!rc)
		rc = oc_fill(m, m->X[0], (size_t)m->o.T * m->o.H, 1.0f, 5);
	return rc;
}

static void model_free(oc_model *m)
{
	for (unsigned l = 0; m->X && l <= m->o.L; l++)
		oc_free(m, m->X[l]);
	for (unsigned l = 0; m->W && l < m->o.L; l++)
		oc_free(m, m->W[l]);
	oc_free(m, m->Z);
	oc_free(m, m->dZ);
	oc_free(m, m->G);
	free(m->X);
	free(m->W);
}

/* Z_{l} for the backward: a hit, or a recompute into m->Z. *key_held says a release is due. */
static int need_z(oc_model *m, tier_cache *c, unsigned l, const void **z, int *held, double *recompute)
{
	tier_cache_key key = { l, 0, 0 };
	void *p;
	*held = 0;
	if (c) {
		int rc = tier_cache_get(c, key, &p);
		if (rc < 0)
			return rc;
		if (rc == 0) {
			*z = p;
			*held = 1;
			return 0;
		}
	}
	*recompute += layer_cost(m, l).flops;
	*z = m->Z;
	return oc_matmul(m, m->X[l], m->W[l], m->o.T, lk(m, l), ln(m, l), m->Z, NULL);
}

/* One training step; returns its time in ns (< 0 on failure, m->rc set). */
static double step(oc_model *m, tier_cache *c, double *recompute)
{
	unsigned L = m->o.L, T = m->o.T;
	int rc = oc_sync(m);
	uint64_t t0 = tier_now_ns();
	for (unsigned l = 0; l < L && !rc; l++) { /* forward */
		rc = oc_matmul(m, m->X[l], m->W[l], T, lk(m, l), ln(m, l), m->Z, m->X[l + 1]);
		if (!rc && c && l + 1 < L) {
			tier_cache_key key = { l, 0, 0 };
			tier_op_cost cost = layer_cost(m, l);
			rc = tier_cache_offer(c, key, m->Z, zbytes(m, l), &cost, oc_stream(m), NULL);
		}
	}
	if (!rc)
		rc = oc_copy(m, m->dZ, m->X[L], zbytes(m, L - 1)); /* dZ_{L-1} = X_L */
	for (unsigned l = L - 1; l >= 1 && !rc; l--) { /* backward */
		const void *z;
		int held;
		if (c && l >= 2)
			tier_cache_prefetch_backward(c, l - 2, 0); /* the layer after the next */
		rc = need_z(m, c, l - 1, &z, &held, recompute);
		if (!rc)
			rc = oc_matmul_bwd(m, m->dZ, m->W[l], T, lk(m, l), ln(m, l), z, m->G);
		if (!rc && held) {
			tier_cache_key key = { l - 1, 0, 0 };
			rc = oc_sync(m); /* the hit's data was read by the queued matmul */
			if (!rc)
				rc = tier_cache_release(c, key, 1);
		}
		void *t = m->dZ; /* G becomes dZ_{l-1} */
		m->dZ = m->G;
		m->G = t;
	}
	if (!rc) /* dX_0 = dZ_0 W_0^T */
		rc = oc_matmul_bwd(m, m->dZ, m->W[0], T, lk(m, 0), ln(m, 0), NULL, m->G);
	if (!rc && c)
		rc = tier_cache_end_microbatch(c, 0) < 0 ? -EBUSY : 0;
	if (!rc)
		rc = oc_sync(m);
	m->rc = rc;
	return rc ? -1 : (double)(tier_now_ns() - t0);
}

/* ---- Modes ------------------------------------------------------------------------------------ */
enum { MODE_RECOMPUTE, MODE_FCFS, MODE_SELECTIVE, N_MODES };
static const char *const mode_name[N_MODES] = { "recompute", "fcfs", "selective" };

typedef struct {
	double step_ns, recompute_flops;
	tier_cache_stats st;
	float *dx;  /* dX_0 of the mode's last step, to compare the modes' results */
} mode_result;

static int open_cache(oc_model *m, int mode, const tier_cache_rates *rates, tier_cache **c)
{
	tier_cache_config cfg;
	char text[160];
	*c = NULL;
	if (mode == MODE_RECOMPUTE)
		return 0;
	snprintf(text, sizeof text, "matmul:hbm=%llu:ddr=%llu:policy=%s", (unsigned long long)m->hbm,
		 (unsigned long long)(mode == MODE_FCFS ? 0 : m->ddr), mode == MODE_FCFS ? "fcfs" : "value");
	int rc = tier_cache_config_parse(text, &cfg);
	return rc ? rc : tier_cache_create(c, m->store, m->dev, &cfg, rates);
}

/* The modes take turns step by step (after one warm-up step each), so that a machine whose speed
 * drifts (other work, clocks) slows them alike. Each mode's cache is empty between its steps. */
static int run_modes(oc_model *m, const tier_cache_rates *rates, mode_result *r)
{
	tier_cache *c[N_MODES] = { NULL };
	double *t = calloc((size_t)N_MODES * m->o.steps, sizeof *t);
	int rc = t ? 0 : tier_fail(-ENOMEM, "opcache bench: out of memory");
	for (int k = 0; k < N_MODES && !rc; k++)
		rc = open_cache(m, k, rates, &c[k]);
	for (unsigned i = 0; i <= m->o.steps && !rc; i++)
		for (int k = 0; k < N_MODES && !rc; k++) {
			if (i == 1 && c[k])
				tier_cache_stats_reset(c[k]); /* stats of the timed steps only */
			double rf = 0, ns = step(m, c[k], &rf);
			if (ns < 0)
				rc = m->rc;
			else if (i > 0)
				t[k * m->o.steps + i - 1] = ns;
			r[k].recompute_flops = rf;
			if (!rc && i == m->o.steps) {
				size_t n = (size_t)m->o.T * m->o.H;
				if (!(r[k].dx = malloc(n * sizeof(float))))
					rc = tier_fail(-ENOMEM, "opcache bench: out of memory");
				else
					rc = oc_read(m, m->G, n, r[k].dx); /* dX_0 */
			}
		}
	for (int k = 0; k < N_MODES; k++) {
		if (!rc) {
			r[k].step_ns = bench_median(t + k * m->o.steps, m->o.steps);
			if (c[k])
				tier_cache_stats_get(c[k], &r[k].st);
		}
		tier_cache_destroy(c[k]);
	}
	free(t);
	return rc;
}

/* Device rates: the matmul rate timed here, the link timed by the store's own DDR -> HBM fetch. */
static int measure_rates(oc_model *m, tier_cache_rates *r)
{
	tier_cache_rates_default(r, m->o.kind);
	double best = 0;
	for (int i = 0; i < 3; i++) {
		int rc = oc_sync(m);
		uint64_t t0 = tier_now_ns();
		if (!rc)
			rc = oc_matmul(m, m->X[0], m->W[0], m->o.T, lk(m, 0), ln(m, 0), m->Z, NULL);
		if (!rc)
			rc = oc_sync(m);
		if (rc)
			return rc;
		double f = layer_cost(m, 0).flops / ((double)(tier_now_ns() - t0) * 1e-9);
		best = f > best ? f : best;
	}
	r->flops_per_s = best;
	tier_object *o;
	void *p;
	size_t n = zbytes(m, 0);
	int rc = tier_obj_create(m->store, n, TIER_CLASS_ACT, 0, &o);
	if (rc)
		return rc;
	best = 0;
	for (int i = 0; i < 3 && !rc; i++) { /* best of three: DDR -> HBM through the store's movers */
		if (!(rc = tier_acquire(m->store, o, TIER_DDR, i ? 0 : TIER_ACQ_INIT, &p, NULL))) {
			if (!i)
				memset(p, 0, n);
			rc = tier_release(m->store, o, TIER_DDR, 1); /* dirty: the HBM copy goes */
		}
		uint64_t t0 = tier_now_ns();
		if (!rc && !(rc = tier_acquire(m->store, o, TIER_HBM, 0, &p, NULL)))
			rc = tier_release(m->store, o, TIER_HBM, 0);
		double bw = (double)n / ((double)(tier_now_ns() - t0) * 1e-9);
		best = bw > best ? bw : best;
	}
	if (!rc)
		r->link_bytes_per_s = best;
	tier_obj_destroy(m->store, o);
	return rc;
}

static void print_results(const oc_model *m, const mode_result *res)
{
	static const bench_col cols[] = {
		{ "mode", "", 10 },       { "step", "time", 10 },      { "recompute", "GFLOP", 10 },
		{ "hits_hbm", "/step", 9 }, { "hits_ddr", "/step", 9 }, { "misses", "/step", 7 },
		{ "moved", "MiB/step", 9 },    { "stall", "/step", 10 },     { "peak_hbm", "MiB", 9 },
		{ "speedup", "x", 8 },
	};
	enum { NC = sizeof cols / sizeof cols[0] };
	bench_table_header(cols, NC);
	for (int i = 0; i < N_MODES; i++) {
		const tier_cache_kind_stats *s = &res[i].st.total;
		char c[NC][32];
		const char *cells[NC];
		snprintf(c[0], 32, "%s", mode_name[i]);
		bench_fmt_time(res[i].step_ns, c[1], 32);
		bench_fmt_num(res[i].recompute_flops / 1e9, 2, c[2], 32);
		double per = 1.0 / m->o.steps;
		bench_fmt_num((double)s->hits[0] * per, 1, c[3], 32);
		bench_fmt_num((double)s->hits[1] * per, 1, c[4], 32);
		bench_fmt_num(i ? (double)s->misses * per : (double)(m->o.L - 1), 1, c[5], 32);
		bench_fmt_num((double)(s->bytes_in + s->bytes_fetched + s->bytes_spilled) / m->o.steps / 1048576.0, 1,
			      c[6], 32);
		bench_fmt_time((double)s->stall_ns / m->o.steps, c[7], 32);
		bench_fmt_num((double)res[i].st.peak[0] / 1048576.0, 1, c[8], 32);
		bench_fmt_num(res[0].step_ns / res[i].step_ns, 3, c[9], 32);
		for (int k = 0; k < NC; k++)
			cells[k] = c[k];
		bench_table_row(cols, NC, cells);
	}
}

int bench_opcache(int argc, char **argv)
{
	oc_model m;
	memset(&m, 0, sizeof m);
	int prc = parse(argc, argv, &m.o);
	if (prc)
		return prc < 0 ? 0 : prc;
	m.el = m.o.kind == TIER_DEV_CUDA ? 2 : 4;
	uint64_t need = 0, most = 0;
	for (unsigned l = 0; l + 1 < m.o.L; l++) {
		need += zbytes(&m, l);
		most = zbytes(&m, l) > most ? zbytes(&m, l) : most;
	}
	m.hbm = m.o.hbm ? m.o.hbm : (uint64_t)(m.o.hbm_frac * (double)need);
	m.ddr = m.o.ddr_set ? m.o.ddr : need;
	int rc = oc_open(&m);
	tier_store_config sc = { .dev = m.dev, .capacity = { m.hbm + 2 * most + (16u << 20), m.ddr + 2 * most + (16u << 20), 0 },
				 .policy = TIER_POLICY_COST };
	if (!rc)
		rc = tier_store_create(&m.store, &sc);
	if (!rc)
		rc = model_alloc(&m);
	tier_cache_rates rates;
	if (!rc)
		rc = measure_rates(&m, &rates);
	mode_result res[N_MODES];
	memset(res, 0, sizeof res);
	char a[32], b[32], d[32];
	if (!rc) {
		bench_comment("tier-bench opcache: full recompute vs keep-what-fits (fcfs) vs the selective op cache");
		bench_comment("device %s%s, %s; %u layers (H %u <-> F %u), %u tokens, frozen weights, %u timed steps per mode",
			      tier_dev_name(m.dev), m.o.kind == TIER_DEV_CPU ? " (emulated HBM)" : "",
			      m.o.kind == TIER_DEV_CUDA ? "bf16 cuBLASLt" : "fp32 OpenBLAS", m.o.L, m.o.H, m.o.F, m.o.T,
			      m.o.steps);
		bench_comment("activations the backward needs: %s; op-cache budgets: hbm %s, ddr %s (fcfs: hbm only)",
			      tier_format_size(need, a, sizeof a), tier_format_size(m.hbm, b, sizeof b),
			      tier_format_size(m.ddr, d, sizeof d));
		bench_comment("measured: matmul %.3f TFLOP/s, DDR->HBM %.2f GB/s (the cache refines the link rate as it goes)",
			      rates.flops_per_s / 1e12, rates.link_bytes_per_s / 1e9);
	}
	if (!rc)
		rc = run_modes(&m, &rates, res);
	double diff[N_MODES] = { 0 };
	if (!rc) {
		/* Hits and recomputes must give the same result: bit for bit on the CPU; on CUDA the
		 * recompute (a plain matmul) and the forward (GELU_AUX epilogue) may take other kernels. */
		for (int k = 1; k < N_MODES; k++)
			for (size_t i = 0; i < (size_t)m.o.T * m.o.H; i++) {
				double rel = fabs((double)res[k].dx[i] - res[0].dx[i]) / (1e-30 + fabs((double)res[0].dx[i]));
				diff[k] = rel > diff[k] || rel != rel ? rel : diff[k];
			}
		bench_comment("dX_0 vs full recompute, largest relative difference: fcfs %.3g, selective %.3g%s", diff[1],
			      diff[2], m.o.kind == TIER_DEV_CPU ? " (must be 0 on the CPU)" : "");
		if (m.o.kind == TIER_DEV_CPU && (diff[1] != 0 || diff[2] != 0))
			rc = tier_fail(-EPROTO, "a cache hit gave another result than the recompute on the CPU");
	}
	if (!rc) {
		print_results(&m, res);
		bench_summary("selective %.3fx, fcfs %.3fx the speed of full recompute per step (%s)",
			      res[0].step_ns / res[2].step_ns, res[0].step_ns / res[1].step_ns,
			      res[0].step_ns / res[2].step_ns >= 1.2 ? "selective >= 1.2x: pass" : "selective < 1.2x");
	}
	if (rc)
		fprintf(stderr, "tier-bench opcache: %s\n", tier_last_error());
	for (int k = 0; k < N_MODES; k++)
		free(res[k].dx);
	model_free(&m);
	tier_store_destroy(m.store);
	oc_close(&m);
	return rc ? 2 : 0;
}
