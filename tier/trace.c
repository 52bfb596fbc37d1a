/* trace.c - recording store access traces: fixed-size little-endian records behind a header,
 * written through a large buffer so that tracing costs a memcpy per access (docs/trace.md). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "store_internal.h"
#include "trace_format.h"

#define TRACE_BUF (4u << 20)

struct store_trace {
	int fd;
	int err;          /* first write error (negative errno); recording stops there */
	char *path;
	size_t used;
	uint64_t op;       /* the last tier_store_at_op index: stamped on every record */
	unsigned char buf[TRACE_BUF];
};

/* Write everything buffered; the first failure is logged and kept for close. */
static void trace_flush(struct store_trace *tr)
{
	size_t off = 0;
	while (!tr->err && off < tr->used) {
		ssize_t n = write(tr->fd, tr->buf + off, tr->used - off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			tr->err = n < 0 ? -errno : -EIO;
			tier_log(TIER_LOG_WARN, "trace %s: write failed (%s): recording stops, the trace is incomplete",
				 tr->path, strerror(-tr->err));
		}
		else
			off += (size_t)n;
	}
	tr->used = 0;
}

void store_trace_put(tier_store *s, tier_trace_kind kind, const tier_object *o, tier_id t, int hit, uint64_t op)
{
	struct store_trace *tr = s->trace;
	if (tr->err)
		return;
	if (tr->used + TRACE_REC_SIZE > TRACE_BUF)
		trace_flush(tr);
	if (kind == TIER_TRC_AT_OP)
		tr->op = op;
	tier_trace_rec r = {
		.object = o ? o->id : 0,
		.size = o ? o->size : 0,
		.op = (uint32_t)tr->op,
		.step = (uint32_t)s->step,
		.kind = (uint8_t)kind,
		.tier = (uint8_t)t,
		.cls = o ? (uint8_t)o->cls : 0,
		.hit = (uint8_t)hit,
	};
	trace_encode(tr->buf + tr->used, &r);
	tr->used += TRACE_REC_SIZE;
}

int tier_store_trace_open(tier_store *s, const char *path)
{
	if (!s || !path || !*path)
		return tier_fail(-EINVAL, "tier_store_trace_open: store and path must not be NULL or empty");
	struct store_trace *tr = malloc(sizeof *tr);
	char *p = strdup(path);
	if (!tr || !p) {
		free(tr);
		free(p);
		return tier_fail(-ENOMEM, "out of memory for the trace buffer (%u bytes)", TRACE_BUF);
	}
	store_lock(s);
	int busy = s->trace != NULL;
	store_unlock(s);
	if (busy) {
		free(tr);
		free(p);
		return tier_fail(-EBUSY, "a trace is already being recorded: close it first");
	}
	tr->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (tr->fd < 0) {
		int e = -errno;
		free(tr);
		free(p);
		return tier_fail(e, "cannot create trace file %s: %s", path, strerror(-e));
	}
	tr->err = 0;
	tr->op = 0;
	tr->path = p;
	trace_encode_header(tr->buf);
	tr->used = TRACE_HDR_SIZE;
	store_lock(s);
	if (s->trace) { /* lost a race with another open */
		store_unlock(s);
		close(tr->fd);
		free(tr);
		free(p);
		return tier_fail(-EBUSY, "a trace is already being recorded: close it first");
	}
	s->trace = tr;
	store_unlock(s);
	return 0;
}

static int trace_finish(struct store_trace *tr)
{
	trace_flush(tr);
	int rc = tr->err;
	if (close(tr->fd) < 0 && !rc)
		rc = tier_fail(-errno, "closing trace %s failed: %s", tr->path, strerror(errno));
	else if (rc)
		rc = tier_fail(rc, "writing trace %s failed (%s): the file is incomplete", tr->path, strerror(-rc));
	free(tr->path);
	free(tr);
	return rc;
}

int tier_store_trace_close(tier_store *s)
{
	if (!s)
		return tier_fail(-EINVAL, "tier_store_trace_close: store is NULL");
	store_lock(s);
	struct store_trace *tr = s->trace;
	s->trace = NULL;
	store_unlock(s);
	if (!tr)
		return tier_fail(-ENOENT, "no trace is being recorded");
	return trace_finish(tr);
}

void store_trace_destroy(tier_store *s)
{
	if (s->trace && trace_finish(s->trace) < 0)
		tier_log(TIER_LOG_ERROR, "%s", tier_last_error());
	s->trace = NULL;
}
