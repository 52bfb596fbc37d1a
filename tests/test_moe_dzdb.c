/* test_moe_dzdb.c - the LoRA backward's fused dZ + dB pass (moe/moe_lora_dzdb.cu) against an fp64
 * reference on bf16-rounded inputs, and against the separate kernels it replaces: dZ equal to
 * moe_cuda_grouped_skinny's bit for bit, dB to moe_cuda_grouped_wgrad's within fp32 rounding. Ranks
 * 8 and 16; out 8 (one partial stage), 200 (a 16-column remainder), 768 and 2048 (the gate's and the
 * down adapter's), the largest out the device admits; 1 to 896 experts with empty, one-row and
 * 64/65-row groups; large experts split in chunks (their partial dB summed by the last chunk) with
 * room in the scratch, whole without it; dB of some experts not wanted; alpha 0 (no Z read);
 * rows_bound past the groups;
 * dZ poisoned before each call and every byte outside the groups untouched; two runs equal bit for
 * bit; bad arguments refused before any write. Skips (77) without a CUDA GPU. */
#include "config.h"
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>
#include "moe_ref.h"
#ifdef TIER_HAVE_CUDA
#include "moe/moe_cuda.h"
#include "moe/moe_skinny.h"

/* dZ is rounded to bf16 once (2^-9 relative); dB is an fp32 sum of exact products (a few hundred
 * terms: far below 1e-4 of the largest value). */
#define TOL_DZ 1e-2
#define TOL_DB 1e-4

static tier_dev *cpu, *gpu;
static tier_rng rng;

static void *up(const void *h, size_t n)
{
	void *d = ref_dev_copy(gpu, h, n);
	assert_non_null(d);
	return d;
}

static void down(void *h, const void *d, size_t n)
{
	if (n)
		assert_int_equal(tier_dev_memcpy_d2h(gpu, h, d, n), 0);
}

static float *rnd(size_t n, float scale)
{
	float *f = malloc(4 * n + 4);
	for (size_t i = 0; i < n; i++)
		f[i] = ref_rnd_bf16(&rng, scale);
	return f;
}

/* ---- a problem: groups, bf16 dY, Z and B_e, fp32 starting dB_e, the fp64 results ---- */
typedef struct {
	int E, out, r, rows, rb, skip; /* skip: the expert whose dB is not wanted (-1: none) */
	int32_t *off;
	float *dy, *z, **b, **db0; /* db0: dB_e before the call */
	double *ref_dz, **ref_db;  /* dZ / s; dB_e without db0 and alpha */
	void *ddy, *dz_in, *doff, **db_dev, **dbuf, **dgrad; /* dbuf: B_e; dgrad: dB_e */
	void *scratch; /* the split experts' partial dB (NULL: none, every expert whole) */
	size_t scratch_bytes;
} dprob;

/* The scratch prob_make gives the call: room to split every expert (FULL), none (NONE), or the
 * counters and two partial slots (TWO: an expert that needs more stays whole). */
enum { SCR_FULL, SCR_NONE, SCR_TWO };
static int scr_mode;

static void prob_ref(dprob *p)
{
	int out = p->out, r = p->r;
	p->ref_dz = calloc((size_t)p->rows * r + 1, sizeof(double));
	p->ref_db = calloc((size_t)p->E, sizeof(double *));
	for (int e = 0; e < p->E; e++) {
		p->ref_db[e] = calloc((size_t)out * r, sizeof(double));
		for (int i = p->off[e]; i < p->off[e + 1]; i++) {
			const float *y = p->dy + (size_t)i * out, *z = p->z + (size_t)i * r;
			for (int c = 0; c < r; c++) {
				double s = 0;
				for (int m = 0; m < out; m++)
					s += (double)y[m] * p->b[e][(size_t)m * r + c];
				p->ref_dz[(size_t)i * r + c] = s;
			}
			for (int m = 0; m < out; m++)
				for (int c = 0; c < r; c++)
					p->ref_db[e][(size_t)m * r + c] += (double)y[m] * z[c];
		}
	}
}

static void prob_make(dprob *p, int E, int out, int r, const int *nrows, int extra, int skip)
{
	p->E = E, p->out = out, p->r = r, p->skip = skip;
	p->off = malloc(4 * (size_t)(E + 1));
	p->off[0] = 0;
	for (int e = 0; e < E; e++)
		p->off[e + 1] = p->off[e] + nrows[e];
	p->rows = p->off[E], p->rb = p->rows + extra;
	p->dy = rnd((size_t)p->rows * out, 1.0f);
	p->z = rnd((size_t)p->rows * r, 1.0f);
	p->b = calloc((size_t)E, sizeof *p->b), p->db0 = calloc((size_t)E, sizeof *p->db0);
	p->dbuf = calloc((size_t)E, sizeof(void *)), p->dgrad = calloc((size_t)E, sizeof(void *));
	p->db_dev = calloc((size_t)E, sizeof(void *));
	for (int e = 0; e < E; e++) {
		p->b[e] = rnd((size_t)out * r, 0.1f);
		p->db0[e] = rnd((size_t)out * r, 1.0f);
		/* experts without rows get no B, as the callers pass them */
		p->dbuf[e] = nrows[e] ? ref_dev_bf16(gpu, p->b[e], (size_t)out * r) : NULL;
		p->dgrad[e] = up(p->db0[e], 4 * (size_t)out * r);
		p->db_dev[e] = e == skip ? NULL : p->dgrad[e];
	}
	p->ddy = ref_dev_bf16(gpu, p->dy, (size_t)p->rows * out);
	p->dz_in = ref_dev_bf16(gpu, p->z, (size_t)p->rows * r);
	p->doff = up(p->off, 4 * (size_t)(E + 1));
	p->scratch_bytes = scr_mode == SCR_NONE ? 0
		: scr_mode == SCR_TWO ? 4 * (size_t)TIER_MOE_MAX_EXPERTS + 2 * 4 * (size_t)out * r
		: moe_cuda_dzdb_scratch_bytes(E, out, r, p->rows);
	p->scratch = p->scratch_bytes ? up(NULL, p->scratch_bytes) : NULL;
	assert_non_null(p->ddy);
	assert_non_null(p->dz_in);
	prob_ref(p);
}

static void prob_free(dprob *p)
{
	for (int e = 0; e < p->E; e++) {
		free(p->b[e]), free(p->db0[e]), free(p->ref_db[e]);
		tier_dev_free(gpu, p->dbuf[e]), tier_dev_free(gpu, p->dgrad[e]);
	}
	free(p->b), free(p->db0), free(p->ref_db), free(p->dbuf), free(p->dgrad), free(p->db_dev);
	tier_dev_free(gpu, p->ddy), tier_dev_free(gpu, p->dz_in), tier_dev_free(gpu, p->doff);
	if (p->scratch)
		tier_dev_free(gpu, p->scratch);
	free(p->off), free(p->dy), free(p->z), free(p->ref_dz);
}

/* Every dB_e back to what it held before the call. */
static void db_reset(const dprob *p)
{
	for (int e = 0; e < p->E; e++)
		assert_int_equal(tier_dev_memcpy_h2d(gpu, p->dgrad[e], p->db0[e], 4 * (size_t)p->out * p->r), 0);
}

/* ---- the checks ---- */
static void untouched(const unsigned char *got, size_t from, size_t to, const char *what)
{
	for (size_t i = from; i < to; i++) {
		if (got[i] != 0xff)
			fprintf(stderr, "# %s: byte %zu of dz, outside the groups, changed\n", what, i);
		assert_int_equal(got[i], 0xff);
	}
}

/* dZ (bf16 [rb + 1, r], the groups' rows) against s ref_dz; the bytes past the groups untouched. */
static void check_dz(const dprob *p, const unsigned char *got, float s, const char *what)
{
	size_t n = (size_t)p->rows * p->r, bytes = 2 * (size_t)(p->rb + 1) * p->r;
	float *g = malloc(4 * n + 4);
	double *want = malloc(8 * n + 8);
	for (size_t i = 0; i < n; i++) {
		uint16_t b;
		memcpy(&b, got + 2 * i, 2);
		g[i] = tier_bf16_to_f32(b);
		want[i] = s * p->ref_dz[i];
	}
	double err = ref_relerr(g, want, n);
	if (!(err <= TOL_DZ))
		fprintf(stderr, "# %s: dz relative error %g > %g\n", what, err, TOL_DZ);
	assert_true(err <= TOL_DZ);
	untouched(got, 2 * n, bytes, what);
	free(g), free(want);
}

/* dB_e against db0 + alpha ref_db for the wanted experts with rows, db0 exactly elsewhere. */
static void check_db(const dprob *p, float alpha, const char *what)
{
	size_t n = (size_t)p->out * p->r;
	float *g = malloc(4 * n);
	double *want = malloc(8 * n);
	for (int e = 0; e < p->E; e++) {
		down(g, p->dgrad[e], 4 * n);
		int changed = e != p->skip && alpha != 0.0f && p->off[e + 1] > p->off[e];
		if (!changed) {
			if (memcmp(g, p->db0[e], 4 * n))
				fprintf(stderr, "# %s: dB of expert %d, which must stay as it was, changed\n", what, e);
			assert_memory_equal(g, p->db0[e], 4 * n);
			continue;
		}
		for (size_t i = 0; i < n; i++)
			want[i] = p->db0[e][i] + alpha * p->ref_db[e][i];
		double err = ref_relerr(g, want, n);
		if (!(err <= TOL_DB))
			fprintf(stderr, "# %s: dB of expert %d (%d rows): relative error %g > %g\n", what, e,
				p->off[e + 1] - p->off[e], err, TOL_DB);
		assert_true(err <= TOL_DB);
	}
	free(g), free(want);
}

/* One fused call into a poisoned dZ; returns dZ's bytes (the caller frees them). */
static unsigned char *run_fused(const dprob *p, float s, float alpha, int with_z)
{
	size_t bytes = 2 * (size_t)(p->rb + 1) * p->r;
	unsigned char *got = malloc(bytes);
	memset(got, 0xff, bytes);
	void *dz = up(got, bytes);
	assert_int_equal(moe_cuda_grouped_dzdb(gpu, p->E, p->out, p->r, p->off, p->doff, (const void *const *)p->dbuf,
					       p->ddy, with_z ? p->dz_in : NULL, s, alpha, dz, (float *const *)p->db_dev,
					       p->scratch, p->scratch_bytes),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, dz, bytes);
	tier_dev_free(gpu, dz);
	return got;
}

/* The separate kernels on the same inputs: dZ by the skinny product (bit for bit), dB by the
 * reduction (within fp32 rounding: another order). Leaves the reduction's dB in dgrad. */
static void against_separate(const dprob *p, const unsigned char *fused_dz, float s, float alpha, const char *what)
{
	size_t bytes = 2 * (size_t)(p->rb + 1) * p->r, n = (size_t)p->out * p->r;
	unsigned char *got = malloc(bytes);
	float **fused_db = calloc((size_t)p->E, sizeof(float *)), *g = malloc(4 * n);
	for (int e = 0; e < p->E; e++) {
		fused_db[e] = malloc(4 * n);
		down(fused_db[e], p->dgrad[e], 4 * n);
	}
	memset(got, 0xff, bytes);
	void *dz = up(got, bytes);
	db_reset(p);
	assert_int_equal(moe_cuda_grouped_skinny(gpu, p->E, p->r, p->out, p->doff, p->rb, 1,
						 (const void *const *)p->dbuf, NULL, 1, p->ddy, dz, NULL, s),
			 0);
	assert_int_equal(moe_cuda_grouped_wgrad(gpu, p->E, p->out, p->r, p->doff, p->rb, p->ddy, p->dz_in, alpha,
						(float *const *)p->db_dev),
			 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	down(got, dz, bytes);
	if (memcmp(got, fused_dz, 2 * (size_t)p->rows * p->r))
		fprintf(stderr, "# %s: dz differs from the skinny product's\n", what);
	assert_memory_equal(got, fused_dz, 2 * (size_t)p->rows * p->r);
	for (int e = 0; e < p->E; e++) {
		down(g, p->dgrad[e], 4 * n);
		double *w = ref_dup(g, n), err = ref_relerr(fused_db[e], w, n);
		if (!(err <= 1e-5))
			fprintf(stderr, "# %s: dB of expert %d differs from the reduction's by %g\n", what, e, err);
		assert_true(err <= 1e-5);
		free(w), free(fused_db[e]);
	}
	tier_dev_free(gpu, dz);
	free(got), free(fused_db), free(g);
}

/* The fused call twice (equal bits), against fp64, against the separate kernels; then alpha 0 (no Z
 * read: z NULL) leaves every dB as it was and still writes dZ. */
static void run_case(int E, int out, int r, const int *nrows, int extra, int skip)
{
	dprob p;
	char what[160];
	const float s = 0.625f, alpha = 1.75f;
	prob_make(&p, E, out, r, nrows, extra, skip);
	snprintf(what, sizeof what, "E %d out %d r %d rows %d rows_bound %d skip %d scratch %s", E, out, r, p.rows, p.rb,
		 skip, scr_mode == SCR_FULL ? "full" : scr_mode == SCR_NONE ? "none" : "two slots");
	unsigned char *a = run_fused(&p, s, alpha, 1);
	check_dz(&p, a, s, what);
	check_db(&p, alpha, what);
	size_t n = (size_t)out * r;
	float **first = calloc((size_t)E, sizeof(float *));
	for (int e = 0; e < E; e++) {
		first[e] = malloc(4 * n);
		down(first[e], p.dgrad[e], 4 * n);
	}
	db_reset(&p);
	unsigned char *b = run_fused(&p, s, alpha, 1);
	assert_memory_equal(a, b, 2 * (size_t)(p.rb + 1) * r);
	float *g = malloc(4 * n);
	for (int e = 0; e < E; e++) {
		down(g, p.dgrad[e], 4 * n);
		assert_memory_equal(g, first[e], 4 * n); /* one order: the same bits */
		free(first[e]);
	}
	against_separate(&p, a, s, alpha, what);
	db_reset(&p);
	unsigned char *c = run_fused(&p, s, 0.0f, 0);
	check_dz(&p, c, s, what);
	check_db(&p, 0.0f, what);
	print_message("dzdb %s: dz, dB against fp64 and the separate kernels\n", what);
	free(a), free(b), free(c), free(g), free(first);
	prob_free(&p);
}

/* ---- the cases ---- */
/* Uneven groups (empty first and inner, one row, 64, 65, 130), each out class, both ranks; one
 * expert's dB not wanted. */
static void test_shapes(void **state)
{
	(void)state;
	static const int n[] = { 0, 1, 130, 64, 0, 65, 200, 7 }, outs[] = { 8, 200, 768, 2048 }, ranks[] = { 8, 16 };
	for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
		for (size_t j = 0; j < sizeof ranks / sizeof ranks[0]; j++)
			run_case(8, outs[i], ranks[j], n, 5, (int)(i + j) % 3 + 1);
}

/* The trainer's uniform case in small: 128 experts of 20-80 rows, gate's out; and one expert of 1000
 * rows (a CTA's long walk). */
static void test_many_rows(void **state)
{
	(void)state;
	int n[128];
	for (int e = 0; e < 128; e++)
		n[e] = 20 + (int)tier_rng_below(&rng, 61);
	n[5] = 0;
	run_case(128, 768, 16, n, 3, -1);
	static const int one[] = { 1000 };
	run_case(1, 2048, 16, one, 0, -1);
}

/* 896 experts (more than the SMs: the two-CTA stages), 0-5 rows each. */
static void test_many_experts(void **state)
{
	(void)state;
	int *n = malloc(sizeof(int) * 896);
	for (int e = 0; e < 896; e++)
		n[e] = (int)tier_rng_below(&rng, 6);
	n[895] = 0;
	run_case(896, 512, 16, n, 9, 17);
	free(n);
}

/* One expert with most of the rows, under each scratch: split in chunks whose partials the last one
 * sums (full), whole (none), and whole while a 150-row expert splits in two (two slots). */
static void test_skewed(void **state)
{
	(void)state;
	int n[40];
	for (int e = 0; e < 40; e++)
		n[e] = (int)tier_rng_below(&rng, 40);
	n[0] = 3001, n[1] = 150, n[7] = 0;
	for (int m = SCR_FULL; m <= SCR_TWO; m++) {
		scr_mode = m;
		run_case(40, 768, 16, n, 7, 9);
		run_case(40, 200, 8, n, 0, 0); /* the split expert's dB not wanted */
	}
	scr_mode = SCR_FULL;
}

/* The largest out the device admits (the fewest stages), and one past it refused. */
static void test_largest_out(void **state)
{
	(void)state;
	int most = moe_cuda_dzdb_max_out(gpu);
	assert_true(most >= 2048);
	static const int n[] = { 70, 0, 3 };
	run_case(3, most, 8, n, 0, -1);
	static const int32_t zero[16];
	void *p = up(zero, sizeof zero);
	const void *b[1] = { p };
	float *db[1] = { p };
	static const int32_t one[2] = { 0, 1 };
	assert_int_equal(moe_cuda_grouped_dzdb(gpu, 1, most + 8, 8, one, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	tier_dev_free(gpu, p);
}

/* What the host refuses before any launch; the buffers stay as they were. */
static void test_bad_input(void **state)
{
	(void)state;
	static const int32_t zero[1024]; /* as offsets: every group empty */
	static const int32_t down_off[3] = { 0, 5, 4 }, late[3] = { 1, 5, 6 };
	void *p = up(zero, sizeof zero);
	const void *b[2] = { p, p };
	float *db[2] = { p, p }, *odd[2] = { (float *)((char *)p + 4), p };
	const void *bodd[2] = { (char *)p + 2, p };
	const int32_t *o = zero;
#define DZ(...) moe_cuda_grouped_dzdb(__VA_ARGS__)
	assert_int_equal(DZ(cpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 0, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, TIER_MOE_MAX_EXPERTS + 1, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 12, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* r */
	assert_int_equal(DZ(gpu, 2, 16, 32, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 20, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* out % 8 */
	assert_int_equal(DZ(gpu, 2, 0, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, NAN, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, INFINITY, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, NULL, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* off */
	assert_int_equal(DZ(gpu, 2, 16, 16, late, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* off[0] */
	assert_int_equal(DZ(gpu, 2, 16, 16, down_off, p, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "nondecreasing"));
	assert_int_equal(DZ(gpu, 2, 16, 16, o, NULL, b, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* d_off */
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, NULL, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, NULL, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, bodd, p, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, odd, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, (char *)p + 8, p, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, NULL, db, NULL, 0), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, NULL, 1.0f, 1.0f, p, db, NULL, 0), -EINVAL); /* z */
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, (char *)p + 4, 4096), -EINVAL);
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, NULL, 1.0f, 0.0f, p, db, NULL, 0), 0); /* alpha 0 */
	assert_int_equal(DZ(gpu, 2, 16, 16, o, p, b, p, p, 1.0f, 1.0f, p, db, p, 4096), 0);   /* no rows */
#undef DZ
	assert_int_equal(moe_cuda_dzdb_max_out(cpu), 0);
	assert_int_equal(tier_dev_sync(gpu), 0);
	tier_dev_free(gpu, p);
}

static int setup(void **state)
{
	(void)state;
	tier_rng_seed(&rng, ref_seed("test_moe_dzdb"));
	return tier_dev_open(&cpu, TIER_DEV_CPU, 0);
}

static int teardown(void **state)
{
	(void)state;
	tier_dev_close(cpu);
	return 0;
}
#endif

int main(void)
{
#ifdef TIER_HAVE_CUDA
	int rc = ref_gpu_open("test_moe_dzdb", &gpu);
	if (rc)
		return rc;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes),
		cmocka_unit_test(test_many_rows),
		cmocka_unit_test(test_many_experts),
		cmocka_unit_test(test_skewed),
		cmocka_unit_test(test_largest_out),
		cmocka_unit_test(test_bad_input),
	};
	rc = cmocka_run_group_tests(tests, setup, teardown);
	tier_dev_close(gpu);
	return rc;
#else
	fprintf(stderr, "# test_moe_dzdb: built without CUDA, skipped\n");
	return 77;
#endif
}
