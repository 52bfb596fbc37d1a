/* loss_cpu.c - the fp32 CPU reference of the chunked loss: tile products by base_sgemm (OpenBLAS or loops),
 * an online log-sum-exp per token in double, gradients recomputed tile by tile. */
#include "config.h"
#include <math.h>
#include <string.h>
#include "base/blas.h"
#include "loss/loss_impl.h"

typedef struct { double m, s, zsum, zy; } row_state;

/* L[c x b] = H[c x D] W[b x D]^T, then soft-capped in place. */
static void tile_logits(const tier_loss_params *p, const float *H, const float *W, int64_t c, int64_t b, float *L)
{
	int64_t D = p->D;
	base_sgemm(0, 1, (int)c, (int)b, (int)D, 1.0f, H, (int)D, W, (int)D, 0.0f, L, (int)b);
	if (p->softcap > 0)
		for (int64_t i = 0; i < c * b; i++)
			L[i] = p->softcap * tanhf(L[i] / p->softcap);
}

/* dH[c x D] += G[c x b] W[b x D]; dW[b x D] += G^T H[c x D] when dW is wanted. */
static void tile_grads(const tier_loss_params *p, const float *G, const float *H, const float *W,
		       int64_t c, int64_t b, float *dH, float *dW)
{
	int64_t D = p->D;
	base_sgemm(0, 0, (int)c, (int)D, (int)b, 1.0f, G, (int)b, W, (int)D, 1.0f, dH, (int)D);
	if (dW)
		base_sgemm(1, 0, (int)b, (int)D, (int)c, 1.0f, G, (int)b, H, (int)D, 1.0f, dW, (int)D);
}

/* Fold block [v0, v0 + b) of row i's capped logits z into its running state. */
static void row_update(row_state *st, const float *z, int64_t v0, int64_t b, int32_t label)
{
	double m = st->m, s = 0, zsum = 0;
	for (int64_t j = 0; j < b; j++)
		if (z[j] > m)
			m = z[j];
	for (int64_t j = 0; j < b; j++) {
		s += exp((double)z[j] - m);
		zsum += z[j];
	}
	st->s = st->s * exp(st->m - m) + s;     /* exp(-inf) = 0 on the first block */
	st->m = m;
	st->zsum += zsum;
	if (label >= v0 && label < v0 + b)
		st->zy = z[label - v0];
}

/* Turn row i's capped logits into dloss/dlogits (scaled), in place; returns max |unscaled grad|. */
static float row_grad(const tier_loss_params *p, float *z, int64_t v0, int64_t b, int32_t label,
		      float lse, float scale)
{
	double eps = p->label_smoothing, zl2 = 2.0 * p->z_loss * lse, big = 0;
	for (int64_t j = 0; j < b; j++) {
		double pr = exp((double)z[j] - lse), g = pr * (1 + zl2) - eps / (double)p->V;
		if (v0 + j == label)
			g -= 1 - eps;
		if (p->softcap > 0) {
			double t = z[j] / p->softcap;
			g *= 1 - t * t;
		}
		if (fabs(g) > big)
			big = fabs(g);
		z[j] = (float)(g * scale);
	}
	return (float)big;
}

static int counted(const tier_loss_params *p, int32_t label)
{
	return label != p->ignore_index;
}

/* The forward over one chunk: statistics over all blocks, then lse and loss per token. */
static double chunk_fwd(const tier_loss_params *p, const loss_args *a, int64_t r0, int64_t c,
			float *L, row_state *st)
{
	const float *H = (const float *)a->H + r0 * p->D, *W = a->W;
	double total = 0;
	for (int64_t i = 0; i < c; i++)
		st[i] = (row_state){ -INFINITY, 0, 0, 0 };
	for (int64_t v0 = 0; v0 < p->V; v0 += p->block_vocab) {
		int64_t b = p->V - v0 < p->block_vocab ? p->V - v0 : p->block_vocab;
		tile_logits(p, H, W + v0 * p->D, c, b, L);
		for (int64_t i = 0; i < c; i++)
			row_update(&st[i], L + i * b, v0, b, a->labels[r0 + i]);
	}
	for (int64_t i = 0; i < c; i++) {
		double lse = st[i].m + log(st[i].s), eps = p->label_smoothing;
		a->lse[r0 + i] = (float)lse;
		if (counted(p, a->labels[r0 + i]))
			total += lse - (1 - eps) * st[i].zy - eps / (double)p->V * st[i].zsum +
				 p->z_loss * lse * lse;
	}
	return total;
}

/* The backward over one chunk; the tile in L is reused when the forward just left it there. */
static void chunk_bwd(const tier_loss_params *p, const loss_args *a, int64_t r0, int64_t c,
		      float *L, int tile_ready, float scale)
{
	const float *H = (const float *)a->H + r0 * p->D, *W = a->W;
	float *dH = a->dH + r0 * p->D;
	for (int64_t v0 = 0; v0 < p->V; v0 += p->block_vocab) {
		int64_t b = p->V - v0 < p->block_vocab ? p->V - v0 : p->block_vocab;
		float big = 0;
		if (!tile_ready)
			tile_logits(p, H, W + v0 * p->D, c, b, L);
		for (int64_t i = 0; i < c; i++) {
			int32_t y = a->labels[r0 + i];
			float m;
			if (!counted(p, y)) {
				memset(L + i * b, 0, (size_t)b * sizeof *L);
				continue;
			}
			m = row_grad(p, L + i * b, v0, b, y, a->lse[r0 + i], scale);
			big = m > big ? m : big;
		}
		if (p->filter_eps > 0 && big < p->filter_eps)
			continue;               /* every |dlogit| in the tile is below the threshold */
		tile_grads(p, L, H, W + v0 * p->D, c, b, dH, a->dW ? a->dW + v0 * p->D : NULL);
	}
}

int loss_cpu_run(const tier_loss_params *p, const loss_args *a)
{
	loss_layout l;
	float *L;
	row_state *st;
	int64_t count = 0;
	double total = 0;
	float scale = 0;
	int rc = loss_layout_of(p, TIER_DEV_CPU, &l);
	if (rc)
		return rc;
	L = (float *)((char *)a->ws + l.logits);
	st = (row_state *)((char *)a->ws + l.state);
	for (int64_t i = 0; i < p->N; i++)
		count += counted(p, a->labels[i]);
	if (a->mode & LOSS_BWD) {
		memset(a->dH, 0, (size_t)(p->N * p->D) * sizeof *a->dH);
		if (a->dW)
			memset(a->dW, 0, (size_t)(p->V * p->D) * sizeof *a->dW);
		if (count)
			scale = p->reduction == TIER_LOSS_MEAN ? a->dloss / (float)count : a->dloss;
	}
	for (int64_t r0 = 0; r0 < p->N; r0 += p->chunk_tokens) {
		int64_t c = p->N - r0 < p->chunk_tokens ? p->N - r0 : p->chunk_tokens;
		int one_block = p->block_vocab >= p->V;
		if (a->mode & LOSS_FWD)
			total += chunk_fwd(p, a, r0, c, L, st);
		if (a->mode & LOSS_BWD)
			chunk_bwd(p, a, r0, c, L, (a->mode & LOSS_FWD) && one_block, scale);
	}
	if (a->mode & LOSS_FWD) {
		*a->count = count;
		*a->loss = count == 0 ? 0.0f : (float)(p->reduction == TIER_LOSS_MEAN ? total / (double)count : total);
	}
	return 0;
}
