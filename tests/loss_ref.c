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
