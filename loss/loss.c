/* loss.c - chunked cut-cross-entropy: parameter checks, chunk and block planning, dispatch. */
#include "config.h"
#include <errno.h>
#include <math.h>
#include <string.h>
#include "tier/loss.h"
#include "loss/loss_impl.h"

#define ALIGN 256u
#define DEFAULT_BOUND (256ull << 20)

void tier_loss_params_init(tier_loss_params *p, int64_t N, int64_t V, int64_t D)
{
	memset(p, 0, sizeof *p);
	p->N = N, p->V = V, p->D = D;
	p->ignore_index = -100;
	p->reduction = TIER_LOSS_MEAN;
}

static int check_params(const tier_loss_params *p)
{
	if (!p)
		return tier_fail(-EINVAL, "loss: params is NULL; fill one with tier_loss_params_init");
	if (p->N < 1 || p->V < 1 || p->D < 1)
		return tier_fail(-EINVAL, "loss: shapes N=%lld V=%lld D=%lld must all be >= 1",
				 (long long)p->N, (long long)p->V, (long long)p->D);
	if (p->V > INT32_MAX || p->D > INT32_MAX || p->N > INT32_MAX)
		return tier_fail(-EINVAL, "loss: N, V and D must each be below 2^31");
	if (p->reduction != TIER_LOSS_MEAN && p->reduction != TIER_LOSS_SUM)
		return tier_fail(-EINVAL, "loss: reduction %d is neither TIER_LOSS_MEAN nor TIER_LOSS_SUM", (int)p->reduction);
	if (!(p->z_loss >= 0 && isfinite(p->z_loss)))
		return tier_fail(-EINVAL, "loss: z_loss %g must be finite and >= 0", p->z_loss);
	if (!(p->label_smoothing >= 0 && p->label_smoothing < 1))
		return tier_fail(-EINVAL, "loss: label_smoothing %g must be in [0, 1)", p->label_smoothing);
	if (!(p->softcap >= 0 && isfinite(p->softcap)))
		return tier_fail(-EINVAL, "loss: softcap %g must be finite and >= 0 (0: off)", p->softcap);
	if (!(p->filter_eps >= 0 && p->filter_eps < 1))
		return tier_fail(-EINVAL, "loss: filter_eps %g must be in [0, 1) (0: off)", p->filter_eps);
	if (p->chunk_tokens < 0 || p->block_vocab < 0)
		return tier_fail(-EINVAL, "loss: chunk_tokens %lld and block_vocab %lld must be >= 0 (0: automatic)",
				 (long long)p->chunk_tokens, (long long)p->block_vocab);
	return 0;
}

int loss_layout_of(const tier_loss_params *p, tier_dev_kind kind, loss_layout *l)
{
	uint64_t c = (uint64_t)p->chunk_tokens, b = (uint64_t)p->block_vocab, tile, at = 0;
	if (tier_mul_overflow(c, b, &tile) || tile > (1ull << 40))
		return tier_fail(-EINVAL, "loss: a tile of %llu x %llu is too large; lower chunk_tokens or block_vocab",
				 (unsigned long long)c, (unsigned long long)b);
	memset(l, 0, sizeof *l);
	l->logits = at, at = tier_align_up(at + 4 * tile, ALIGN);
	if (kind == TIER_DEV_CUDA) {
		l->state = at, at = tier_align_up(at + 16 * c, ALIGN);
		l->scalars = at, at += ALIGN;
	} else {
		l->state = at, at = tier_align_up(at + 32 * c, ALIGN);
	}
	l->total = at;
	return 0;
}

/* Smallest chunk worth a whole-vocabulary block: a GEMM of fewer rows wastes the tensor cores. */
static int64_t min_chunk(tier_dev_kind kind, int64_t N)
{
	int64_t m = kind == TIER_DEV_CUDA ? 64 : 8;
	return N < m ? N : m;
}

static int fits(const tier_loss_params *p, tier_dev_kind kind, int64_t c, int64_t b, uint64_t bound)
{
	tier_loss_params q = *p;
	loss_layout l;
	q.chunk_tokens = c, q.block_vocab = b;
	return loss_layout_of(&q, kind, &l) == 0 && l.total <= bound;
}

/* The largest x in [1, hi] with fits(x) (the layout grows with x), or 0 when none. */
static int64_t largest(const tier_loss_params *p, tier_dev_kind kind, int64_t c, int64_t b, int vary_c,
		       int64_t hi, uint64_t bound)
{
	int64_t lo = 0;
	while (lo < hi) {
		int64_t mid = lo + (hi - lo + 1) / 2;
		if (fits(p, kind, vary_c ? mid : c, vary_c ? b : mid, bound))
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

int tier_loss_plan(const tier_loss_params *p, tier_dev_kind kind, uint64_t memory_bound,
		   int64_t *chunk, int64_t *block)
{
	int rc = check_params(p);
	int64_t c, b;
	if (rc)
		return rc;
	if (!chunk || !block)
		return tier_fail(-EINVAL, "loss: plan needs chunk and block output pointers");
	c = p->chunk_tokens > p->N ? p->N : p->chunk_tokens;
	b = p->block_vocab > p->V ? p->V : p->block_vocab;
	if (!c) {
		c = largest(p, kind, 0, b ? b : p->V, 1, p->N, memory_bound);
		if (!b && c < min_chunk(kind, p->N))
			c = min_chunk(kind, p->N);      /* split the vocabulary instead */
		if (c < p->N && kind == TIER_DEV_CUDA)  /* whole GEMM tiles: 128 rows, else 16 */
			c -= c >= 128 ? c % 128 : c > 16 ? c % 16 : 0;
		if (!c)
			goto nospace;
	}
	if (!b) {
		b = largest(p, kind, c, 0, 0, p->V, memory_bound);
		if (b < p->V && kind == TIER_DEV_CUDA && b > 128)
			b -= b % 128;
		if (!b)
			goto nospace;
	}
	if (!fits(p, kind, c, b, memory_bound))
		goto nospace;
	*chunk = c, *block = b;
	return 0;
nospace:
	return tier_fail(-ENOSPC, "loss: a memory bound of %llu bytes cannot hold a chunk of %lld tokens x a block "
			 "of %lld; give a larger bound (workspace) or smaller chunk_tokens/block_vocab",
			 (unsigned long long)memory_bound, (long long)(c ? c : 1), (long long)(b ? b : 1));
}

/* p with its chunk and block resolved against a bound. */
static int resolve(const tier_loss_params *p, tier_dev_kind kind, uint64_t bound, tier_loss_params *q)
{
	int rc = tier_loss_plan(p, kind, bound, &q->chunk_tokens, &q->block_vocab);
	if (rc)
		return rc;
	q->N = p->N, q->V = p->V, q->D = p->D, q->ignore_index = p->ignore_index;
	q->reduction = p->reduction, q->z_loss = p->z_loss, q->label_smoothing = p->label_smoothing;
	q->softcap = p->softcap, q->filter_eps = p->filter_eps;
	return 0;
}

int tier_loss_workspace_bytes(const tier_loss_params *p, tier_dev_kind kind, size_t *bytes)
{
	tier_loss_params q;
	loss_layout l;
	int rc;
	if (!bytes)
		return tier_fail(-EINVAL, "loss: workspace_bytes needs an output pointer");
	if (kind != TIER_DEV_CPU && kind != TIER_DEV_CUDA)
		return tier_fail(-EINVAL, "loss: unknown device kind %d", (int)kind);
	if ((rc = check_params(p)))
		return rc;
	if (p->chunk_tokens && p->block_vocab) {
		q = *p;
		if (q.chunk_tokens > q.N)
			q.chunk_tokens = q.N;
		if (q.block_vocab > q.V)
			q.block_vocab = q.V;
	} else if ((rc = resolve(p, kind, DEFAULT_BOUND, &q))) {
		return rc;
	}
	if ((rc = loss_layout_of(&q, kind, &l)))
		return rc;
	*bytes = l.total;
	return 0;
}

/* Labels live in host memory only on the CPU; there they are checked here. On CUDA the kernels
 * treat a label outside [0, V) other than ignore_index as ignored (documented). */
static int check_labels(const tier_loss_params *p, const int32_t *labels)
{
	for (int64_t i = 0; i < p->N; i++)
		if (labels[i] != p->ignore_index && (labels[i] < 0 || labels[i] >= p->V))
			return tier_fail(-EINVAL, "loss: label %d of token %lld is outside [0, %lld) and is not "
					 "the ignore index %d", labels[i], (long long)i, (long long)p->V, p->ignore_index);
	return 0;
}

static int run(tier_dev *dev, const tier_loss_params *p, loss_args *a)
{
	tier_loss_params q;
	tier_dev_kind kind;
	loss_layout l;
	int rc;
	if (!dev)
		return tier_fail(-EINVAL, "loss: device context is NULL; open one with tier_dev_open");
	if ((rc = check_params(p)))
		return rc;
	if (!a->H || !a->W || !a->labels || !a->lse || !a->ws)
		return tier_fail(-EINVAL, "loss: H, W, labels, lse and workspace must not be NULL");
	if ((a->mode & LOSS_FWD) && (!a->loss || !a->count))
		return tier_fail(-EINVAL, "loss: the forward needs loss and count output pointers");
	if ((a->mode & LOSS_BWD) && !a->dH)
		return tier_fail(-EINVAL, "loss: the backward needs a dH output pointer");
	if ((a->mode & LOSS_BWD) && !isfinite(a->dloss))
		return tier_fail(-EINVAL, "loss: dloss %g is not finite", a->dloss);
	kind = tier_dev_kind_of(dev);
	if ((rc = resolve(p, kind, a->ws_bytes, &q)))
		return rc;
	if ((rc = loss_layout_of(&q, kind, &l)))
		return rc;
	if (l.total > a->ws_bytes)
		return tier_fail(-ENOSPC, "loss: workspace of %zu bytes is below the %zu that chunk %lld x block %lld "
				 "need; size it with tier_loss_workspace_bytes", a->ws_bytes, l.total,
				 (long long)q.chunk_tokens, (long long)q.block_vocab);
	if (kind == TIER_DEV_CPU) {
		if ((rc = check_labels(&q, a->labels)))
			return rc;
		return loss_cpu_run(&q, a);
	}
#ifdef TIER_HAVE_CUDA
	if (q.filter_eps > 0)
		return tier_fail(-ENOTSUP, "loss: gradient filtering (filter_eps) runs on the CPU only; set it to 0 on CUDA");
	return loss_cuda_run(dev, &q, a);
#else
	return tier_fail(-ENODEV, "loss: this build has no CUDA support; use a CPU context");
#endif
}

int tier_loss_fwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		  const int32_t *labels, float *lse, float *loss, int64_t *count, void *ws, size_t ws_bytes)
{
	loss_args a = { .mode = LOSS_FWD, .H = H, .W = W, .labels = labels, .lse = lse, .loss = loss,
			.count = count, .ws = ws, .ws_bytes = ws_bytes };
	return run(dev, p, &a);
}

int tier_loss_bwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		  const int32_t *labels, const float *lse, float dloss, float *dH, float *dW,
		  void *ws, size_t ws_bytes)
{
	loss_args a = { .mode = LOSS_BWD, .H = H, .W = W, .labels = labels, .lse = (float *)lse,
			.dloss = dloss, .dH = dH, .dW = dW, .ws = ws, .ws_bytes = ws_bytes };
	return run(dev, p, &a);
}

int tier_loss_fwd_bwd(tier_dev *dev, const tier_loss_params *p, const void *H, const void *W,
		      const int32_t *labels, float dloss, float *lse, float *loss, int64_t *count,
		      float *dH, float *dW, void *ws, size_t ws_bytes)
{
	loss_args a = { .mode = LOSS_FWD | LOSS_BWD, .H = H, .W = W, .labels = labels, .lse = lse,
			.loss = loss, .count = count, .dloss = dloss, .dH = dH, .dW = dW, .ws = ws,
			.ws_bytes = ws_bytes };
	return run(dev, p, &a);
}
