/* moe_experts_grouped.cu - the SwiGLU experts with LoRA, forward and backward, through the
 * device-side grouped GEMMs of moe_grouped.cu: a fixed number of launches per layer whatever the
 * number of experts (the per-expert cuBLASLt loop of moe_experts.cu makes up to 9 launches per
 * expert and projection pass, which the host cannot issue as fast as the GPU runs them when groups
 * are a few hundred rows). LoRA as in the loop: Z = s X A^T [rows, r] in bf16, then Y += Z B^T;
 * backward dZ = s dY B, dB += s dY^T (X A^T), dA += dZ^T X (per-expert reductions: grouped_wgrad),
 * and dX += dZ A. The rank products (N = r) run on the skinny kernel (moe_skinny.cu). On Hopper the
 * B (forward) and A (backward) products join the base products as extra K segments of the wgmma
 * kernels; elsewhere each of them is its own pass. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_cuda.h"
#include "moe/moe_wgmma.h"
#include "moe/moe_skinny.h"

/* The per-expert pointer arrays one projection needs, NULL where an expert has no rows. */
struct ptrs {
	const void *w[TIER_MOE_MAX_EXPERTS];
};
struct gptrs {
	float *p[TIER_MOE_MAX_EXPERTS];
};

/* Whether one LoRA's arrays suit the grouped kernels: rank a multiple of 8, every pointer of an
 * expert with rows 16-byte aligned. */
static int lora_fits(const tier_moe_lora *l, int E, const int32_t *off)
{
	if (!moe_lora_on(l))
		return 1;
	if (l->rank % 8)
		return 0;
	for (int e = 0; e < E; e++) {
		if (off[e + 1] == off[e])
			continue;
		if (!moe_a16(l->a[e]) || !moe_a16(l->b[e]) || (l->da && !moe_a16(l->da[e])) || (l->db && !moe_a16(l->db[e])))
			return 0;
	}
	return 1;
}

/* TIER_MOE_GROUPED: 1 always (where the shapes fit), 0 never, unset or "auto": when the mean group
 * is small enough that one cuBLASLt product per expert is launch-bound. Read at each call (cheap
 * next to a layer) so that benchmarks and tests can switch it. */
static int grouped_mode(void)
{
	const char *v = getenv("TIER_MOE_GROUPED");
	return !v || !*v || !strcmp(v, "auto") ? 2 : !strcmp(v, "1") ? 1 : 0;
}

/* Auto mode: the per-expert loop (cuBLASLt on lanes) wins only when one expert's product alone
 * fills the GPU: measured on an H200, 8 experts x 2048 rows x I 14336 (~900 tiles of 128 x 256
 * each) ran 617 TFLOP/s in the loop against 440 grouped, while 128 x 1024 rows x I 768 (24 tiles
 * each) ran 331 against 404 and smaller groups favour the grouped kernels more. */
#define AUTO_LOOP_TILES 264 /* two waves of 132 SMs */

static int loop_fills_gpu(int rows, int busy, int I)
{
	long mean = busy ? rows / busy : 0;
	return (mean + 127) / 128 * ((I + 255) / 256) >= AUTO_LOOP_TILES;
}

extern "C" int moe_cuda_experts_grouped_fits(int E, int H, int I, const int32_t *off, const tier_moe_experts *w,
					     const tier_moe_loras *lora, const void *const *io, int n_io)
{
	int mode = grouped_mode(), busy = 0;
	if (mode == 0 || H % 8 || I % 8 || E > TIER_MOE_MAX_EXPERTS)
		return 0;
	for (int i = 0; i < n_io; i++)
		if (io[i] && !moe_a16(io[i]))
			return 0;
	for (int e = 0; e < E; e++) {
		if (off[e + 1] == off[e])
			continue;
		busy++;
		const void *g = w->gate_up ? w->gate_up[e] : w->gate[e], *u = w->gate_up ? NULL : w->up[e];
		if (!moe_a16(g) || (u && !moe_a16(u)) || !moe_a16(w->down[e]) || (w->gate_up && ((size_t)I * H * 2) % 16))
			return 0;
	}
	for (int q = 0; q < 3; q++)
		if (!lora_fits(moe_lora_of(lora, q), E, off))
			return 0;
	/* the mma.sync kernel's grid holds at most 65535 row tiles (the LoRA products may run there); its
	 * own bound, (rows + 127 min(E, rows)) / 128 with 128-row tiles, or with 64 rows when small */
	long long rows = off[E], m = E < rows ? E : rows;
	if ((rows + 127 * m) / 128 > 65535 || (rows + 63 * m) / 64 > 65535)
		return 0;
	return mode == 1 || (busy > 0 && !loop_fills_gpu(off[E], busy, I));
}

/* gate, up, down pointers per expert (NULL for empty experts). */
static void weights_of(const tier_moe_experts *w, int E, int I, int H, const int32_t *off, ptrs *g, ptrs *u, ptrs *d)
{
	for (int e = 0; e < E; e++) {
		int has = off[e + 1] > off[e];
		const bf16 *gu = has && w->gate_up ? (const bf16 *)w->gate_up[e] : NULL;
		const bf16 *second = gu ? gu + (size_t)I * H : NULL;
		const void *first = gu, *next = second;
		if (gu && w->order == TIER_MOE_UP_FIRST)
			first = second, next = gu;
		g->w[e] = !has ? NULL : gu ? first : (const void *)w->gate[e];
		u->w[e] = !has ? NULL : gu ? next : (const void *)w->up[e];
		d->w[e] = has ? w->down[e] : NULL;
	}
}

/* The adapter's tables of the experts with rows (NULL elsewhere); a table not wanted is NULL. */
static void lora_ptrs(const tier_moe_lora *l, int E, const int32_t *off, ptrs *a, ptrs *b, gptrs *da, gptrs *db)
{
	for (int e = 0; e < E; e++) {
		int has = off[e + 1] > off[e];
		if (a)
			a->w[e] = has ? l->a[e] : NULL;
		if (b)
			b->w[e] = has ? l->b[e] : NULL;
		if (da)
			da->p[e] = has && l->da ? l->da[e] : NULL;
		if (db)
			db->p[e] = has && l->db ? l->db[e] : NULL;
	}
}

/* TIER_MOE_WGMMA: 0 keeps every product on the mma.sync kernels; otherwise the products with at
 * least 64 columns (either weight layout) and the fused gate/up run on the Hopper wgmma kernels
 * where the device has them (compute capability 9.0). */
static int use_wgmma(tier_dev *dev, int N) { return N >= 64 && moe_cuda_wgmma_on(dev); }

/* The LoRA rank products (N = r, bf16 out): the skinny kernel, bound by reading X once, where the
 * rank suits it. */
static int skinny_fits(int r) { return r % 8 == 0 && r <= 64; }

/* C = alpha X op(W_e) + beta C over each expert's rows, on the best kernel for the shape. */
static int gmm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows, const void *const *w, int w_kn,
	       const void *x, void *c, int c_bf16, float alpha, float beta)
{
	if (c_bf16 && beta == 0.0f && skinny_fits(N))
		return moe_cuda_grouped_skinny(dev, E, N, K, d_off, rows, 1, w, NULL, w_kn, x, c, NULL, alpha);
	if (use_wgmma(dev, N))
		return moe_cuda_grouped_mm_sm90(dev, E, N, K, d_off, rows, w, w_kn, x, c, c_bf16, alpha, beta);
	return moe_cuda_grouped_mm(dev, E, N, K, d_off, rows, w, w_kn, x, c, c_bf16, alpha, beta);
}

/* Z = s X A^T for one adapter into Z [rows, r] (nothing without it). */
static int lora_z(tier_dev *dev, const tier_moe_lora *l, int E, const int32_t *d_off, int rows, int in, const ptrs *a,
		  const void *X, bf16 *Z, float s)
{
	return moe_lora_on(l) ? gmm(dev, E, l->rank, in, d_off, rows, a->w, 0, X, Z, 1, s, 0.0f) : 0;
}

/* Y [rows, out] += (s X A^T) B^T for every expert; Z [rows, r] bf16 scratch (s in Z, as in the
 * fused path). */
static int lora_fwd(tier_dev *dev, const tier_moe_lora *l, int E, const int32_t *off, const int32_t *d_off, int in,
		    int out, const void *X, void *Y, int y_bf16, void *Z)
{
	if (!moe_lora_on(l))
		return 0;
	ptrs a, b;
	lora_ptrs(l, E, off, &a, &b, NULL, NULL);
	int rc = lora_z(dev, l, E, d_off, off[E], in, &a, X, (bf16 *)Z, l->scale);
	return rc ? rc : gmm(dev, E, out, l->rank, d_off, off[E], b.w, 0, Z, Y, y_bf16, 1.0f, 1.0f);
}

/* out [rows, I] bf16 = X W_e^T (+ the adapter l: product and add in the fp32 scratch gs, then one
 * rounding, as the fused products round). */
static int proj_fwd(tier_dev *dev, const tier_moe_lora *l, int E, int I, int H, const int32_t *off,
		    const int32_t *d_off, const ptrs *wp, const void *xg, void *out, float *gs, void *z)
{
	int rows = off[E], rc;
	if (!moe_lora_on(l))
		return gmm(dev, E, I, H, d_off, rows, wp->w, 0, xg, out, 1, 1.0f, 0.0f);
	if (!gs)
		return tier_fail(-EINVAL, "moe_cuda_experts_fwd_grouped: LoRA on gate or up needs the fp32 scratch gs");
	if ((rc = gmm(dev, E, I, H, d_off, rows, wp->w, 0, xg, gs, 0, 1.0f, 0.0f)) ||
	    (rc = lora_fwd(dev, l, E, off, d_off, H, I, xg, gs, 0, z)))
		return rc;
	return moe_cuda_to_bf16(dev, (size_t)rows * I, gs, out);
}

/* One adapter's backward but dX: dZ = s dY B into dZ; dB += s dY^T Z with Z = X A^T (computed into
 * the Z scratch unless have_z: 1, the caller made it; 2, the forward kept s X A^T there, so dB's
 * product takes no s); dA += dZ^T X unless no_da (the caller pairs it with another adapter's). */
static int lora_grads(tier_dev *dev, const tier_moe_lora *l, int E, const int32_t *off, const int32_t *d_off, int in,
		      int out, const void *X, const void *dY, bf16 *Z, int have_z, bf16 *dZ, ptrs *a, int no_da = 0,
		      const moe_xg_src *xs = NULL)
{
	if (!moe_lora_on(l))
		return 0;
	ptrs b;
	gptrs da, db;
	int rows = off[E], r = l->rank, rc;
	lora_ptrs(l, E, off, a, &b, &da, &db);
	/* B_e is stored [out, r]: as the right operand of dY B it is [K, N] */
	if ((rc = gmm(dev, E, r, out, d_off, rows, b.w, 1, dY, dZ, 1, l->scale, 0.0f)))
		return rc;
	if (l->db && ((!have_z && (rc = lora_z(dev, l, E, d_off, rows, in, a, X, Z, 1.0f))) ||
		      (rc = moe_cuda_grouped_wgrad(dev, E, out, r, d_off, rows, dY, Z, have_z == 2 ? 1.0f : l->scale,
						   db.p))))
		return rc;
	if (!l->da || no_da)
		return 0;
	return xs ? moe_cuda_grouped_wgrad_rows(dev, E, r, in, d_off, rows, dZ, xs->x, xs->row_pair, xs->k, 1.0f, da.p)
		  : moe_cuda_grouped_wgrad(dev, E, r, in, d_off, rows, dZ, X, 1.0f, da.p);
}

/* Whether the gate's and the up adapter's dA go in one pass over X (moe_cuda_grouped_wgrad2): both
 * trainable, of one rank; TIER_MOE_DA_PAIR=0 keeps two passes (for comparisons). */
static int da_pair(const tier_moe_lora *lg, const tier_moe_lora *lu)
{
	return moe_lora_on(lg) && moe_lora_on(lu) && lg->da && lu->da && lg->rank == lu->rank &&
	       !moe_env_is("TIER_MOE_DA_PAIR", "0");
}

/* dA_g += dZ_g^T X and dA_u += dZ_u^T X in one pass over X (xs not NULL: X's rows read from the
 * layer's x through the permutation). */
static int da_both(tier_dev *dev, const tier_moe_lora *lg, const tier_moe_lora *lu, int E, const int32_t *off,
		   const int32_t *d_off, int in, const void *X, const bf16 *dzg, const bf16 *dzu, const moe_xg_src *xs)
{
	gptrs dag, dau;
	lora_ptrs(lg, E, off, NULL, NULL, &dag, NULL);
	lora_ptrs(lu, E, off, NULL, NULL, &dau, NULL);
	if (xs)
		return moe_cuda_grouped_wgrad2_rows(dev, E, lg->rank, in, d_off, off[E], dzg, dzu, xs->x, xs->row_pair,
						    xs->k, 1.0f, 1.0f, dag.p, dau.p);
	return moe_cuda_grouped_wgrad2(dev, E, lg->rank, in, d_off, off[E], dzg, dzu, X, 1.0f, 1.0f, dag.p, dau.p);
}

/* From dY [rows, out] bf16: lora_grads, then dX [rows, in] += dZ A. */
static int lora_bwd(tier_dev *dev, const tier_moe_lora *l, int E, const int32_t *off, const int32_t *d_off, int in,
		    int out, const void *X, const void *dY, float *dX, void *Z, void *dZ)
{
	if (!moe_lora_on(l))
		return 0;
	ptrs a;
	int rc = lora_grads(dev, l, E, off, d_off, in, out, X, dY, (bf16 *)Z, 0, (bf16 *)dZ, &a);
	/* A_e is stored [r, in]: [K, N] of dZ A */
	return rc ? rc : gmm(dev, E, in, l->rank, d_off, off[E], a.w, 1, dZ, dX, 0, 1.0f, 1.0f);
}

/* ---- LoRA inside the wgmma products (extra K segments, moe_wgmma.h) ----
 * z holds the segments' weight tables (MOE_LORA_TAB_BYTES), then Z_gate [rows, r_g] and Z_up
 * [rows, r_u] (the down adapter's Z reuses the start); dz holds dZ_gate and dZ_up the same way. The
 * adapters' B (forward) and A (backward) products join the base products, so no LoRA pass reads or
 * writes g, u, y, dh or dX again (read-modify-writes of [rows, I] and [rows, H] per projection), and
 * the bf16 g, u and y are rounded once. */
static int fused_lora(tier_dev *dev, int H, int I)
{
	/* TIER_MOE_LORA_FUSED=0: the separate LoRA passes (comparisons) */
	return use_wgmma(dev, I) && use_wgmma(dev, H) && !moe_env_is("TIER_MOE_LORA_FUSED", "0");
}

static int rank_of(const tier_moe_lora *l) { return moe_lora_on(l) ? l->rank : 0; }

static bf16 *z_at(void *z) { return (bf16 *)((char *)z + MOE_LORA_TAB_BYTES); }

/* Z_gate = s_g X A_g^T and Z_up = s_u X A_u^T, in one pass over X when the adapters agree in rank
 * and scale (sg, su: the scales to use, 1 for the backward's unscaled Z). */
static int lora_z2(tier_dev *dev, const tier_moe_lora *lg, const tier_moe_lora *lu, int E, const int32_t *d_off,
		   int rows, int in, const ptrs *ag, const ptrs *au, const void *X, bf16 *zg, bf16 *zu, float sg, float su)
{
	if (moe_lora_on(lg) && moe_lora_on(lu) && lg->rank == lu->rank && sg == su && skinny_fits(lg->rank))
		return moe_cuda_grouped_skinny(dev, E, lg->rank, in, d_off, rows, 2, ag->w, au->w, 0, X, zg, zu, sg);
	int rc = lora_z(dev, lg, E, d_off, rows, in, ag, X, zg, sg);
	return rc ? rc : lora_z(dev, lu, E, d_off, rows, in, au, X, zu, su);
}

/* Where the adapters' Z go: the keep's z (gate's, up's, down's [rows, r] one after another) when
 * it has room for them, else the scratch after the tables (the down adapter's at its start). */
static int z_places(const tier_moe_loras *lora, int rows, void *z, const moe_keep *keep, bf16 **zg, bf16 **zu,
		    bf16 **zd)
{
	int rg = rank_of(moe_lora_of(lora, 0)), ru = rank_of(moe_lora_of(lora, 1)), rd = rank_of(moe_lora_of(lora, 2));
	int kept = keep && keep->z && rg + ru + rd <= keep->z_cols;
	*zg = kept ? (bf16 *)keep->z : z_at(z);
	*zu = *zg + (size_t)rows * rg;
	*zd = kept ? *zu + (size_t)rows * ru : *zg;
	return kept;
}

/* The forward; with keep, each adapter's Z (scaled) where the backward finds it. */
static int fwd_fused(tier_dev *dev, int E, int H, int I, const int32_t *off, const int32_t *d_off, const ptrs *gp,
		     const ptrs *upp, const ptrs *dp, const tier_moe_loras *lora, const void *xg, void *g, void *u,
		     void *h, void *y, void *z, moe_keep *keep)
{
	const tier_moe_lora *lg = moe_lora_of(lora, 0), *lu = moe_lora_of(lora, 1), *ld = moe_lora_of(lora, 2);
	int rows = off[E], rg = rank_of(lg), ru = rank_of(lu), rd = rank_of(ld), rc;
	ptrs ag, bg, au, bu, ad, bd;
	moe_wg_seg sg = {}, sd = {};
	bf16 *zg, *zu, *zd;
	int kz = z_places(lora, rows, z, keep, &zg, &zu, &zd);
	if (rg)
		lora_ptrs(lg, E, off, &ag, &bg, NULL, NULL);
	if (ru)
		lora_ptrs(lu, E, off, &au, &bu, NULL, NULL);
	sg.x0 = zg, sg.w0 = bg.w, sg.K0 = rg, sg.x1 = zu, sg.w1 = bu.w, sg.K1 = ru;
	if ((rc = lora_z2(dev, lg, lu, E, d_off, rows, H, &ag, &au, xg, zg, zu, rg ? lg->scale : 0, ru ? lu->scale : 0)) ||
	    (rc = moe_cuda_grouped_gate_up_sm90_lora(dev, E, H, I, d_off, rows, gp->w, upp->w, xg, rg || ru ? &sg : NULL,
						     z, g, u, h)))
		return rc;
	/* a recompute (no y) makes the down adapter's Z only to keep it */
	if (rd && (y || kz)) {
		lora_ptrs(ld, E, off, &ad, &bd, NULL, NULL);
		sd.x0 = zd, sd.w0 = bd.w, sd.K0 = rd;
		if ((rc = lora_z(dev, ld, E, d_off, rows, I, &ad, h, zd, ld->scale)))
			return rc;
	}
	if (keep) /* the gate/up product writes h in every call */
		keep->kept = (kz ? TIER_MOE_KEPT_Z : 0) | (keep->h_ws ? TIER_MOE_KEPT_H : 0);
	if (!y)
		return 0;
	return moe_cuda_grouped_mm_sm90_segs(dev, E, H, I, d_off, rows, dp->w, 0, h, rd ? 1 : 0, &sd, z, y, 1, 1.0f, 0.0f);
}

/* TIER_MOE_X_ROWS=0: the backward gathers xg whole even where only the dA reductions read it (the
 * form before session 25, for comparisons). */
static int x_rows_on(void) { return !moe_env_is("TIER_MOE_X_ROWS", "0"); }

/* TIER_MOE_DH16=0: the fused backward's dh in fp32, as before session 26. Else the down product
 * rounds dh to bf16 (its staged epilogue's whole-line stores, half the bytes) and the SwiGLU
 * backward reads that: dg and du are bf16 from it either way. */
static int dh16_on(void) { return !moe_env_is("TIER_MOE_DH16", "0"); }

/* TIER_MOE_SWIGLU_EPI=1: with dh in bf16 (dh16_on), SwiGLU's backward runs in the dh product's
 * epilogue (moe_cuda_grouped_dh_swiglu_sm90): dh is never written, and the elementwise pass over
 * g, u and dh is gone. Off: on an H100 the step ran 1.9% slower (session 28), the epilogue, which
 * no product overlaps, taking g's and u's loads. */
static int swiglu_epi_on(void) { return moe_env_is("TIER_MOE_SWIGLU_EPI", "1"); }

static int bwd_fused(tier_dev *dev, int E, int H, int I, const int32_t *off, const int32_t *d_off, const ptrs *gp,
		     const ptrs *upp, const ptrs *dp, const tier_moe_loras *lora, const void *xg, const void *g,
		     const void *u, const void *dy, float *dxg, float *row_dot, void *h, void *dg, void *du, float *dh,
		     void *z, void *dz, const moe_keep *keep, int *dx16)
{
	const tier_moe_lora *lg = moe_lora_of(lora, 0), *lu = moe_lora_of(lora, 1), *ld = moe_lora_of(lora, 2);
	int rows = off[E], rg = rank_of(lg), ru = rank_of(lu), rd = rank_of(ld), rc;
	size_t n = (size_t)rows * I;
	ptrs ag, au, ad;
	moe_wg_seg sd = {}, s2[2] = {};
	bf16 *zb = z_at(z), *dzg = (bf16 *)dz, *dzu = dzg + (size_t)rows * rg, *kg, *ku, *kd;
	/* what the forward kept: h (in the h scratch), and Z (scaled) for dB */
	int kh = keep && (keep->kept & TIER_MOE_KEPT_H);
	int kz = keep && (keep->kept & TIER_MOE_KEPT_Z) && z_places(lora, rows, z, keep, &kg, &ku, &kd);
	/* h is the input of the down adapter: recompute it unless kept */
	if (rd && ((!kh && (rc = moe_cuda_swiglu(dev, n, g, u, h))) ||
		   (rc = lora_grads(dev, ld, E, off, d_off, I, H, h, dy, kz ? kd : zb, kz ? 2 : 0, dzg, &ad))))
		return rc;
	sd.x0 = dzg, sd.w0 = ad.w, sd.K0 = rd;
	/* dh = dY down + dZ_d A_d: down_e [H, I] and A_d [r, I] are [K, N]; in bf16 where the rows'
	 * dot is wanted (dh16_on) */
	int h16 = row_dot && dh16_on();
	if (h16 && swiglu_epi_on()) { /* dh's fp32 space holds the dot slots (rows x ceil(I / 128) floats) */
		if ((rc = moe_cuda_grouped_dh_swiglu_sm90(dev, E, I, H, d_off, rows, dp->w, dy, rd ? 1 : 0, &sd, z, g, u, dg,
							  du, row_dot, dh)))
			return rc;
	} else if ((rc = moe_cuda_grouped_mm_sm90_segs(dev, E, I, H, d_off, rows, dp->w, 1, dy, rd ? 1 : 0, &sd, z, dh,
						       h16, 1.0f, 0.0f)) ||
		   (rc = h16 ? moe_cuda_swiglu_bwd16(dev, (size_t)rows, I, g, u, dh, dg, du, row_dot)
			     : moe_cuda_swiglu_bwd(dev, (size_t)rows, I, g, u, dh, dg, du, row_dot))) {
		return rc;
	}
	/* X is read only by the dA reductions where Z is kept or no dB wants it: then they read the
	 * layer's x through the permutation and xg is never gathered (keep's source); else gather it */
	const moe_xg_src *xs = keep ? keep->xg_src : NULL;
	int xmap = xs && x_rows_on() && (kz || (!(rg && lg->db) && !(ru && lu->db)));
	if (xs && !xmap && (rc = moe_cuda_xg_fill(dev, keep, H)))
		return rc;
	if (!xmap)
		xs = NULL;
	/* the adapters' Z for dB: kept, else both in one pass over X where they can */
	int zs = (!rg || lg->db) && (!ru || lu->db) && (rg || ru);
	bf16 *zg = kz ? kg : zb, *zu = kz ? ku : zb + (size_t)rows * rg;
	if (zs && !kz) {
		if (rg)
			lora_ptrs(lg, E, off, &ag, NULL, NULL, NULL);
		if (ru)
			lora_ptrs(lu, E, off, &au, NULL, NULL, NULL);
		if ((rc = lora_z2(dev, lg, lu, E, d_off, rows, H, &ag, &au, xg, zg, zu, 1.0f, 1.0f)))
			return rc;
	}
	const int pair = da_pair(lg, lu);
	int hz = kz ? 2 : zs; /* lora_grads' have_z for gate and up */
	if ((rc = lora_grads(dev, lg, E, off, d_off, H, I, xg, dg, zg, hz, dzg, &ag, pair, xs)) ||
	    (rc = lora_grads(dev, lu, E, off, d_off, H, I, xg, du, hz ? zu : zb, hz, dzu, &au, pair, xs)) ||
	    (pair && (rc = da_both(dev, lg, lu, E, off, d_off, H, xg, dzg, dzu, xs))))
		return rc;
	/* dX = dG gate + dU up + dZ_g A_g + dZ_u A_u in one product (gate_e, up_e [I, H], A [r, H]: [K, N]),
	 * in bf16 where the caller takes it */
	s2[0].x0 = du, s2[0].w0 = upp->w, s2[0].K0 = I;
	s2[1].x0 = dzg, s2[1].w0 = ag.w, s2[1].K0 = rg, s2[1].x1 = dzu, s2[1].w1 = au.w, s2[1].K1 = ru;
	rc = moe_cuda_grouped_mm_sm90_segs(dev, E, H, I, d_off, rows, gp->w, 1, dg, rg || ru ? 2 : 1, s2, z, dxg, !!dx16,
					   1.0f, 0.0f);
	if (!rc && dx16)
		*dx16 = 1;
	return rc;
}

extern "C" int moe_cuda_experts_fwd_grouped(tier_dev *dev, int E, int H, int I, const int32_t *off,
					    const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora,
					    const void *xg, void *g, void *u, void *h, void *y, void *z, float *gs,
					    moe_keep *keep)
{
	ptrs gp, upp, dp;
	int rows = off[E], rc;
	if (keep)
		keep->kept = 0;
	if (rows == 0)
		return 0;
	weights_of(w, E, I, H, off, &gp, &upp, &dp);
	if (moe_lora_max_rank(lora) > 0 && fused_lora(dev, H, I))
		return fwd_fused(dev, E, H, I, off, d_off, &gp, &upp, &dp, lora, xg, g, u, h, y, z, keep);
	const tier_moe_lora *lg = moe_lora_of(lora, 0), *lu = moe_lora_of(lora, 1);
	/* without an adapter on gate or up, SwiGLU fused into the gate/up product; with one, the
	 * product and the adapter's add meet in the fp32 scratch gs and are rounded once */
	if (!moe_lora_on(lg) && !moe_lora_on(lu)) {
		rc = use_wgmma(dev, I) ? moe_cuda_grouped_gate_up_sm90(dev, E, H, I, d_off, rows, gp.w, upp.w, xg, g, u, h)
				       : moe_cuda_grouped_gate_up(dev, E, H, I, d_off, rows, gp.w, upp.w, xg, g, u, h);
	} else if (!(rc = proj_fwd(dev, lg, E, I, H, off, d_off, &gp, xg, g, gs, z)) &&
		   !(rc = proj_fwd(dev, lu, E, I, H, off, d_off, &upp, xg, u, gs, z))) {
		rc = moe_cuda_swiglu(dev, (size_t)rows * I, g, u, h);
	}
	if (rc || !y || (rc = gmm(dev, E, H, I, d_off, rows, dp.w, 0, h, y, 1, 1.0f, 0.0f)))
		return rc;
	return lora_fwd(dev, moe_lora_of(lora, 2), E, off, d_off, I, H, h, y, 1, z);
}

/* dX = dG gate + dU up (gate_e, up_e stored [I, H]: the [K, N] of dG gate). On the wgmma kernels in
 * one product, dU up as an extra segment, its weight table in stream-ordered scratch: a second
 * product would read and write dX's fp32 [rows, H] again. */
static int dx_gate_up(tier_dev *dev, int E, int H, int I, const int32_t *d_off, int rows, const ptrs *gp,
		      const ptrs *upp, const void *dg, const void *du, float *dxg)
{
	if (!use_wgmma(dev, H)) {
		int rc = gmm(dev, E, H, I, d_off, rows, gp->w, 1, dg, dxg, 0, 1.0f, 0.0f);
		return rc ? rc : gmm(dev, E, H, I, d_off, rows, upp->w, 1, du, dxg, 0, 1.0f, 1.0f);
	}
	moe_wg_seg sg = {};
	sg.x0 = du, sg.w0 = upp->w, sg.K0 = I;
	void *tab = NULL;
	cudaStream_t st = moe_stream(dev);
	CUDA_TRY(cudaMallocAsync(&tab, MOE_WG_TAB_BYTES, st));
	int rc = moe_cuda_grouped_mm_sm90_segs(dev, E, H, I, d_off, rows, gp->w, 1, dg, 1, &sg, tab, dxg, 0, 1.0f, 0.0f);
	cudaError_t e = cudaFreeAsync(tab, st); /* in stream order: after the product */
	if (!rc && e != cudaSuccess)
		rc = tier_fail(-EIO, "experts backward: freeing the segment table: %s", cudaGetErrorString(e));
	return rc;
}

extern "C" int moe_cuda_experts_dh16(tier_dev *dev, int E, int H, int I, const int32_t *off,
				     const tier_moe_experts *w, const tier_moe_loras *lora)
{
	return moe_cuda_experts_grouped_fits(E, H, I, off, w, lora, NULL, 0) && moe_lora_max_rank(lora) > 0 &&
	       fused_lora(dev, H, I) && dh16_on();
}

extern "C" int moe_cuda_experts_bwd_grouped(tier_dev *dev, int E, int H, int I, const int32_t *off,
					    const int32_t *d_off, const tier_moe_experts *w, const tier_moe_loras *lora,
					    const void *xg, const void *g, const void *u, const void *dy, float *dxg,
					    float *row_dot, void *h, void *dg, void *du, float *dh, void *z, void *dz,
					    const moe_keep *keep, int *dx16)
{
	ptrs gp, upp, dp;
	int rows = off[E], rc;
	size_t n = (size_t)rows * I;
	if (rows == 0)
		return 0;
	weights_of(w, E, I, H, off, &gp, &upp, &dp);
	if (moe_lora_max_rank(lora) > 0 && fused_lora(dev, H, I))
		return bwd_fused(dev, E, H, I, off, d_off, &gp, &upp, &dp, lora, xg, g, u, dy, dxg, row_dot, h, dg, du, dh,
				 z, dz, keep, dx16);
	const tier_moe_lora *ld = moe_lora_of(lora, 2);
	/* h is the input of the down adapter: recompute it */
	if ((rc = moe_cuda_xg_fill(dev, keep, H)) || (moe_lora_on(ld) && (rc = moe_cuda_swiglu(dev, n, g, u, h))))
		return rc;
	/* dh = dY down: down_e is stored [H, I], the [K, N] of dY down */
	if ((rc = gmm(dev, E, I, H, d_off, rows, dp.w, 1, dy, dh, 0, 1.0f, 0.0f)) ||
	    (rc = lora_bwd(dev, ld, E, off, d_off, I, H, h, dy, dh, z, dz)) ||
	    (rc = moe_cuda_swiglu_bwd(dev, (size_t)rows, I, g, u, dh, dg, du, row_dot)))
		return rc;
	if ((rc = dx_gate_up(dev, E, H, I, d_off, rows, &gp, &upp, dg, du, dxg)) ||
	    (rc = lora_bwd(dev, moe_lora_of(lora, 0), E, off, d_off, H, I, xg, dg, dxg, z, dz)))
		return rc;
	return lora_bwd(dev, moe_lora_of(lora, 1), E, off, d_off, H, I, xg, du, dxg, z, dz);
}
