/* train_pending.c - pipelined operations: an operation's end (waiting for its kernels, releasing
 * its pins and op cache entries, its post) is put off until the next operation's kernels are
 * queued. Ending each operation with a wait left the device idle while the host pinned and queued
 * the next layer: 76% busy in a traced step of the trainer's (a) job on the H200 (bench/RESULTS.md).
 *
 * What makes it safe: the current operation's pins are held until a waypoint after its kernels
 * has passed, so the store moves or reuses nothing they touch; fills (TIER_ACQ_INIT) are ended at
 * once (tier_fill_done) so that the next operation may pin what this one wrote, its kernels
 * ordered after these on the one compute stream; a pin refused for room or a fill in progress is
 * retried after finishing the operation before (trainer_pin), so a budget that fits one
 * operation's pins still runs. */
#include "config.h"
#include <errno.h>
#include <string.h>
#include "core/trainer.h"

/* Finish one recorded entry: offer done (dropped unless ok), or the get released as done. */
static int key_finish(tier_trainer *t, tier_cache_key key, int got, int ok)
{
	if (got)
		return tier_cache_release(t->cache, key, 1);
	return ok ? tier_cache_offer_done(t->cache, key) : tier_cache_offer_drop(t->cache, key);
}

int trainer_op_key(tier_trainer *t, tier_cache_key key, int got)
{
	trainer_opdesc *d = &t->opc;
	if (d->nkeys == OP_KEYS)
		return 1;
	d->key[d->nkeys] = key;
	d->got[d->nkeys++] = (unsigned char)got;
	return 0;
}

/* An operation whose kernels are done (or failed): its cache entries and pins go back (its
 * offers dropped unless ok: their data may not have been written); its post runs when ok. The
 * first error. */
static int finish(tier_trainer *t, pinset *ps, trainer_opdesc *d, int ok)
{
	int rc = 0, r;
	for (int i = 0; i < d->nkeys; i++)
		if ((r = key_finish(t, d->key[i], d->got[i], ok)) && !rc)
			rc = r;
	d->nkeys = 0;
	if ((r = pin_release_all(ps)) && !rc)
		rc = r;
	if (ok && !rc && d->post != POST_NONE)
		rc = trainer_post(t, d->post, d->l, d->mb0, d->mb1, d->last_at);
	d->post = POST_NONE;
	return rc;
}

int trainer_finish_prev(tier_trainer *t)
{
	if (!t->prev_on)
		return 0;
	t->prev_on = 0;
	int rc = tier_waypoint_wait(t->wp), r2 = finish(t, &t->ps_prev, &t->opp, !rc);
	return rc ? rc : r2;
}

int trainer_op_end(tier_trainer *t, int rc)
{
	t->op_seq++; /* the sets' cached addresses (pin_group) die with the pins */
	int r1 = tier_dev_sync(t->m->dev), r2 = 0;
	if (t->prev_on) {
		t->prev_on = 0;
		r2 = tier_waypoint_wait(t->wp); /* passed: the device is idle */
		int r = finish(t, &t->ps_prev, &t->opp, !r1 && !r2);
		r2 = r2 ? r2 : r;
	}
	int r3 = finish(t, &t->ps, &t->opc, !rc && !r1 && !r2);
	return rc ? rc : r1 ? r1 : r2 ? r2 : r3;
}

/* The current operation becomes the one before (its pins and end move over). */
static void shift(tier_trainer *t)
{
	pinset *a = &t->ps, *b = &t->ps_prev;
	size_t n = (size_t)a->n;
	memcpy(b->obj, a->obj, n * sizeof *a->obj);
	memcpy(b->dirty, a->dirty, n);
	memcpy(b->init, a->init, n);
	b->n = a->n, a->n = 0;
	t->opp = t->opc;
	t->opc.nkeys = 0, t->opc.post = POST_NONE;
	t->prev_on = 1;
}

int trainer_op_close(tier_trainer *t, int rc, int post, int l, int mb0, int mb1, int last_at)
{
	trainer_opdesc *d = &t->opc;
	d->post = post, d->l = l, d->mb0 = mb0, d->mb1 = mb1, d->last_at = last_at;
	if (rc || !t->pipeline)
		return trainer_op_end(t, rc);
	t->op_seq++;
	/* the operation before is done first (this one's kernels keep the device busy meanwhile); one
	 * waypoint serves both, put again once the earlier one has passed */
	int r = trainer_finish_prev(t);
	if (!r)
		r = pin_fill_done_all(&t->ps);
	if (!r)
		r = tier_waypoint_put(t->wp);
	if (r)
		return trainer_op_end(t, r);
	shift(t);
	t->n_piped++;
	return 0;
}
