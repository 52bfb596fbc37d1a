/* loss_ref.c - the naive fp64 reference the loss tests compare with. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "loss_ref.h"

static double logit(const tier_loss_params *p, const float *H, const float *W, int64_t i, int64_t v)
{
	double x = 0;
	for (int64_t k = 0; k < p->D; k++)
		x += (double)H[i * p->D + k] * W[v * p->D + k];
	return p->softcap > 0 ? p->softcap * tanh(x / p->softcap) : x;
}

double loss_ref(const tier_loss_params *p, const float *H, const float *W, const int32_t *labels,
		double dloss, double *lse, int64_t *count, double *dH, double *dW)
{
	int64_t N = p->N, V = p->V, D = p->D, n = 0;
	double *z = malloc((size_t)(N * V) * sizeof *z), total = 0, eps = p->label_smoothing, scale;
	for (int64_t i = 0; i < N; i++) {
		double m = -INFINITY, s = 0, zsum = 0, l;
		for (int64_t v = 0; v < V; v++) {
			z[i * V + v] = logit(p, H, W, i, v);
			m = fmax(m, z[i * V + v]);
		}
		for (int64_t v = 0; v < V; v++)
			s += exp(z[i * V + v] - m), zsum += z[i * V + v];
		l = m + log(s);
		lse[i] = l;
		if (labels[i] == p->ignore_index)
			continue;
		n++;
		total += l - (1 - eps) * z[i * V + labels[i]] - eps / V * zsum + p->z_loss * l * l;
	}
	*count = n;
	scale = n == 0 ? 0 : p->reduction == TIER_LOSS_MEAN ? dloss / n : dloss;
	if (dH)
		memset(dH, 0, (size_t)(N * D) * sizeof *dH);
	if (dW)
		memset(dW, 0, (size_t)(V * D) * sizeof *dW);
	for (int64_t i = 0; i < N && (dH || dW); i++) {
		if (labels[i] == p->ignore_index)
			continue;
		for (int64_t v = 0; v < V; v++) {
			double zz = z[i * V + v], pr = exp(zz - lse[i]);
			double g = pr * (1 + 2 * p->z_loss * lse[i]) - eps / V - (v == labels[i] ? 1 - eps : 0);
			if (p->softcap > 0)
				g *= 1 - (zz / p->softcap) * (zz / p->softcap);
			g *= scale;
			for (int64_t k = 0; k < D; k++) {
				if (dH)
					dH[i * D + k] += g * W[v * D + k];
				if (dW)
					dW[v * D + k] += g * H[i * D + k];
			}
		}
	}
	free(z);
	if (n == 0)
		return 0;
	return p->reduction == TIER_LOSS_MEAN ? total / n : total;
}

/* With lse_i + d_i in place of lse_i, dl/dx_iv moves by (exp(-d_i) - 1) c_iv (exactly without
 * z-loss, to first order in d_i, ~1e-7, with it), where
 *     c_iv = -d(dl/dx_iv)/d(lse_i) = p_iv (1 + 2 zl (lse_i - 1)) (1 - (z_iv / c)^2)
 * (the z-loss factor 1 + 2 zl lse_i moves with lse_i too; smoothing and the one-hot do not).
 * One shift per token, so ||ddH_i|| <= scale expm1(u |lse_i|) ||sum_v c_iv w_v||, and
 * ||ddW_v|| <= scale sum_i expm1(u |lse_i|) |c_iv| ||h_i||, the shifts of distinct tokens having
 * unknown signs. */
void loss_ref_lse_bound(const tier_loss_params *p, const float *H, const float *W, const int32_t *labels,
			double dloss, const double *lse, double *eH, double *eW)
{
	int64_t N = p->N, V = p->V, D = p->D, n = 0;
	double *row = malloc((size_t)D * sizeof *row), *ew = calloc((size_t)V, sizeof *ew), sh = 0, sw = 0, scale;
	for (int64_t i = 0; i < N; i++)
		n += labels[i] != p->ignore_index;
	scale = n == 0 ? 0 : fabs(p->reduction == TIER_LOSS_MEAN ? dloss / n : dloss);
	for (int64_t i = 0; i < N; i++) {
		double d = expm1(0x1p-24 * fabs(lse[i])), hn = 0, r2 = 0;
		if (labels[i] == p->ignore_index)
			continue;
		memset(row, 0, (size_t)D * sizeof *row);
		for (int64_t k = 0; k < D; k++)
			hn += (double)H[i * D + k] * H[i * D + k];
		hn = sqrt(hn);
		for (int64_t v = 0; v < V; v++) {
			double zz = logit(p, H, W, i, v);
			double c = exp(zz - lse[i]) * (1 + 2 * p->z_loss * (lse[i] - 1));
			if (p->softcap > 0)
				c *= 1 - (zz / p->softcap) * (zz / p->softcap);
			for (int64_t k = 0; k < D; k++)
				row[k] += c * W[v * D + k];
			ew[v] += d * fabs(c) * hn;
		}
		for (int64_t k = 0; k < D; k++)
			r2 += row[k] * row[k];
		sh += d * d * r2;
	}
	for (int64_t v = 0; v < V; v++)
		sw += ew[v] * ew[v];
	if (eH)
		*eH = scale * sqrt(sh);
	if (eW)
		*eW = scale * sqrt(sw);
	free(row), free(ew);
}

double loss_rel_err(const float *a, const double *ref, size_t n)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		if (isnan(a[i]) || isinf(a[i]))
			return INFINITY;
		num += (a[i] - ref[i]) * (a[i] - ref[i]);
		den += ref[i] * ref[i];
	}
	return den > 0 ? sqrt(num / den) : sqrt(num);
}
