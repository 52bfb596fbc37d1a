/* attn_cpu.c - the fp32 reference of attention (flash-style blocked loops with an online softmax,
 * so memory stays O(seq * head_dim)) and of RoPE. */
#include "config.h"
#include <math.h>
#include <string.h>
#include "base/blas.h"
#include "attn/attn_impl.h"

#define BQ ATTN_CPU_BQ
#define BK ATTN_CPU_BK

/* Strides here fit in int: blocks of at most BQ x BK rows of head_dim. */
static void gemm(int ta, int tb, int m, int n, int k, float alpha, const float *A, int64_t lda,
		 const float *B, int64_t ldb, float beta, float *C, int64_t ldc)
{
	base_sgemm(ta, tb, m, n, k, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

size_t attn_cpu_ws_floats(const tier_attn_params *p)
{
	size_t d = (size_t)p->head_dim;
	return 2 * (size_t)BQ * BK + (size_t)BQ * d + 2 * (size_t)BQ + 2 * (size_t)BK * d +
	       (size_t)(p->batch * p->seq * p->n_heads);
}

typedef struct {
	float *s, *ds, *acc, *m, *l, *dk, *dv, *rowd;
} cpu_ws;

static cpu_ws ws_split(const tier_attn_params *p, float *w)
{
	cpu_ws x;
	size_t d = (size_t)p->head_dim;
	x.s = w, w += BQ * BK;
	x.ds = w, w += BQ * BK;
	x.acc = w, w += BQ * d;
	x.m = w, w += BQ;
	x.l = w, w += BQ;
	x.dk = w, w += BK * d;
	x.dv = w, w += BK * d;
	x.rowd = w;
	return x;
}

/* Keys visible to query row i of a block of keys starting at j0 with nk keys. */
static int visible(const tier_attn_params *p, int64_t i, int64_t j0, int nk)
{
	if (!p->causal)
		return nk;
	int64_t n = i - j0 + 1;
	return n < 0 ? 0 : n > nk ? nk : (int)n;
}

/* One block of query rows [i0, i0+nq) of head h in sequence b, over its visible keys. */
static void fwd_block(const tier_attn_params *p, const cpu_ws *w, int64_t b, int64_t h, int64_t i0, int nq,
		      const float *q, const float *k, const float *v, float *o, float *lse)
{
	const int64_t S = p->seq, H = p->n_heads, KH = p->n_kv_heads, D = p->head_dim;
	const int64_t kvh = h / (H / KH), t0 = b * S;
	const float *Q = q + ((t0 + i0) * H + h) * D;
	int64_t jend = p->causal ? i0 + nq : S;
	memset(w->acc, 0, sizeof(float) * (size_t)(nq * D));
	for (int r = 0; r < nq; r++)
		w->m[r] = -INFINITY, w->l[r] = 0;
	for (int64_t j0 = 0; j0 < jend; j0 += BK) {
		int nk = (int)(jend - j0 < BK ? jend - j0 : BK);
		const float *K = k + ((t0 + j0) * KH + kvh) * D, *V = v + ((t0 + j0) * KH + kvh) * D;
		gemm(0, 1, nq, nk, (int)D, p->scale, Q, H * D, K, KH * D, 0, w->s, BK);
		for (int r = 0; r < nq; r++) {
			float *s = w->s + r * BK, mx = w->m[r], sum = 0, alpha;
			int n = visible(p, i0 + r, j0, nk);
			for (int c = 0; c < n; c++)
				mx = s[c] > mx ? s[c] : mx;
			for (int c = 0; c < nk; c++) {
				s[c] = c < n ? expf(s[c] - mx) : 0.0f;
				sum += s[c];
			}
			alpha = w->m[r] == -INFINITY ? 0.0f : expf(w->m[r] - mx);
			w->l[r] = w->l[r] * alpha + sum, w->m[r] = mx;
			for (int64_t d = 0; d < D; d++)
				w->acc[r * D + d] *= alpha;
		}
		gemm(0, 0, nq, (int)D, nk, 1.0f, w->s, BK, V, KH * D, 1.0f, w->acc, D);
	}
	for (int r = 0; r < nq; r++) {
		float inv = 1.0f / w->l[r], *O = o + ((t0 + i0 + r) * H + h) * D;
		for (int64_t d = 0; d < D; d++)
			O[d] = w->acc[r * D + d] * inv;
		lse[(t0 + i0 + r) * H + h] = w->m[r] + logf(w->l[r]);
	}
}

int attn_cpu_fwd(const tier_attn_params *p, const float *q, const float *k, const float *v,
		 float *o, float *lse, float *ws)
{
	cpu_ws w = ws_split(p, ws);
	for (int64_t b = 0; b < p->batch; b++)
		for (int64_t h = 0; h < p->n_heads; h++)
			for (int64_t i0 = 0; i0 < p->seq; i0 += BQ)
				fwd_block(p, &w, b, h, i0, (int)(p->seq - i0 < BQ ? p->seq - i0 : BQ), q, k, v, o, lse);
	return 0;
}

/* One block of keys [j0, j0+nk) of kv head kvh against the query rows [i0, i0+nq) of head h:
 * adds to dq of those rows and to the dk, dv accumulators of the block. */
static void bwd_tile(const tier_attn_params *p, const cpu_ws *w, int64_t b, int64_t h, int64_t kvh,
		     int64_t j0, int nk, int64_t i0, int nq, const float *q, const float *k, const float *v,
		     const float *lse, const float *dout, float *dq)
{
	const int64_t S = p->seq, H = p->n_heads, KH = p->n_kv_heads, D = p->head_dim, t0 = b * S;
	const float *Q = q + ((t0 + i0) * H + h) * D, *dO = dout + ((t0 + i0) * H + h) * D;
	const float *K = k + ((t0 + j0) * KH + kvh) * D, *V = v + ((t0 + j0) * KH + kvh) * D;
	gemm(0, 1, nq, nk, (int)D, p->scale, Q, H * D, K, KH * D, 0, w->s, BK);
	gemm(0, 1, nq, nk, (int)D, 1.0f, dO, H * D, V, KH * D, 0, w->ds, BK);
	for (int r = 0; r < nq; r++) {
		int64_t row = (t0 + i0 + r) * H + h;
		float L = lse[row], Di = w->rowd[row], *s = w->s + r * BK, *ds = w->ds + r * BK;
		int n = visible(p, i0 + r, j0, nk);
		for (int c = 0; c < nk; c++) {
			s[c] = c < n ? expf(s[c] - L) : 0.0f;           /* P */
			ds[c] = s[c] * (ds[c] - Di) * p->scale;          /* dS, with the score scale folded in */
		}
	}
	gemm(1, 0, nk, (int)D, nq, 1.0f, w->s, BK, dO, H * D, 1.0f, w->dv, D);
	gemm(0, 0, nq, (int)D, nk, 1.0f, w->ds, BK, K, KH * D, 1.0f, dq + ((t0 + i0) * H + h) * D, H * D);
	gemm(1, 0, nk, (int)D, nq, 1.0f, w->ds, BK, Q, H * D, 1.0f, w->dk, D);
}

int attn_cpu_bwd(const tier_attn_params *p, const float *q, const float *k, const float *v,
		 const float *o, const float *lse, const float *dout, float *dq, float *dk, float *dv,
		 float *ws)
{
	const int64_t S = p->seq, H = p->n_heads, KH = p->n_kv_heads, D = p->head_dim, G = H / KH;
	const int64_t rows = p->batch * S * H;
	cpu_ws w = ws_split(p, ws);
	for (int64_t r = 0; r < rows; r++) {
		double s = 0;
		for (int64_t d = 0; d < D; d++)
			s += (double)dout[r * D + d] * o[r * D + d];
		w.rowd[r] = (float)s;
	}
	memset(dq, 0, sizeof(float) * (size_t)(rows * D));
	for (int64_t b = 0; b < p->batch; b++)
		for (int64_t kvh = 0; kvh < KH; kvh++)
			for (int64_t j0 = 0; j0 < S; j0 += BK) {
				int nk = (int)(S - j0 < BK ? S - j0 : BK);
				memset(w.dk, 0, sizeof(float) * (size_t)(nk * D));
				memset(w.dv, 0, sizeof(float) * (size_t)(nk * D));
				for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
					for (int64_t i0 = p->causal ? j0 : 0; i0 < S; i0 += BQ)
						bwd_tile(p, &w, b, h, kvh, j0, nk, i0, (int)(S - i0 < BQ ? S - i0 : BQ),
							 q, k, v, lse, dout, dq);
				for (int c = 0; c < nk; c++) {
					size_t at = (size_t)(((b * S + j0 + c) * KH + kvh) * D);
					memcpy(dk + at, w.dk + c * D, sizeof(float) * (size_t)D);
					memcpy(dv + at, w.dv + c * D, sizeof(float) * (size_t)D);
				}
			}
	return 0;
}

/* HF's default rotary embedding: inv_freq and the angle in fp32, then cos and sin in fp32. */
void attn_cpu_rope(const tier_rope_params *r, const int32_t *pos, float *x, int inverse)
{
	const int64_t D = r->head_dim, half = D / 2;
	for (int64_t t = 0; t < r->tokens; t++) {
		float pt = (float)(pos ? pos[t] : t % r->seq);
		for (int64_t i = 0; i < half; i++) {
			float inv = 1.0f / powf(r->theta, (float)(2 * i) / (float)D), ang = pt * inv;
			float c = cosf(ang), s = inverse ? -sinf(ang) : sinf(ang);
			for (int64_t h = 0; h < r->n_heads; h++) {
				float *e = x + (t * r->n_heads + h) * D, a = e[i], bb = e[i + half];
				e[i] = a * c - bb * s;
				e[i + half] = bb * c + a * s;
			}
		}
	}
}
