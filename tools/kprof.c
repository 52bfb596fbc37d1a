/* kprof.c - a CUDA kernel profiler for machines without Nsight (the lent GPU machine has none):
 * a library that the CUDA driver loads into any program through its injection hook,
 *
 *     CUDA_INJECTION64_PATH=/path/to/libtier-kprof.so tier-run ...
 *
 * It records every kernel, memcpy and memset with CUPTI's activity API (device timestamps, the
 * program untouched) and when the program exits prints the device time summed by name, longest
 * first: kernels (demangled), then copies by direction and memsets. Knobs: TIER_KPROF_OUT=FILE
 * (appended; default stderr), TIER_KPROF_TOP=N rows of kernels (default 40, 0 all),
 * TIER_KPROF_WIDTH=N characters of a name (default 110). It also prints how busy the device was
 * (the union of all activity from the first start to the last end) and its idle gaps by length,
 * for the whole run and, with TIER_KPROF_LAST_MS=N, for the last N ms. TIER_KPROF_TRACE=FILE
 * writes every record as a line (kind K kernel, C copy, M memset, R runtime API call on the host;
 * start and end in ns of one clock; stream or host thread; CUPTI's correlation id, which ties a
 * device record to the runtime call that launched it; name) for a timeline analysed offline
 * (bench/kprof_trace.py: where the device idled, and whether the host launched late).
 *
 * What it costs: CUPTI serialises nothing, but concurrent kernels' records arrive out of order and
 * the totals are sums of each activity's own span: overlapping kernels on several streams count
 * in full each, so the shares are of summed device time, not of wall time. */
#include <cupti.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tools/kprof_table.h"

/* libstdc++'s demangler has C linkage (cxxabi.h); declared here for C. */
extern char *__cxa_demangle(const char *mangled, char *out, size_t *len, int *status);

#define KPROF_BUF (8u << 20) /* bytes of one activity buffer */

static kprof_table kernels, copies;
static kprof_spans spans; /* device activity, for the busy time */
static FILE *trace;	  /* TIER_KPROF_TRACE */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int ready;

/* One record: its span, and its trace line (name may be mangled; the reader demangles). */
static void record(char kind, uint64_t start, uint64_t end, uint32_t where, uint32_t corr, const char *name)
{
	if (kind != 'R')
		(void)kprof_spans_add(&spans, start, end);
	if (trace)
		fprintf(trace, "%c %" PRIu64 " %" PRIu64 " %u %u %s\n", kind, start, end, where, corr, name ? name : "?");
}

static const char *runtime_name(uint32_t cbid)
{
	const char *name = NULL;
	return cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, cbid, &name) == CUPTI_SUCCESS && name ? name : "?";
}

static void CUPTIAPI buf_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
	*buf = aligned_alloc(8, KPROF_BUF); /* records are 8-byte aligned */
	*size = *buf ? KPROF_BUF : 0;
	*max_records = 0;
}

static const char *copy_name(uint8_t kind)
{
	switch (kind) {
	case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
	case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
	case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
	case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
	case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
	default: return "memcpy (other)";
	}
}

/* A buffer's records into the tables (mangled kernel names: demangled once each, at the end). */
static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid)
{
	CUpti_Activity *rec = NULL;
	(void)ctx, (void)stream, (void)size;
	pthread_mutex_lock(&lock);
	while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
		if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
			const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
			(void)kprof_add(&kernels, k->name, k->end - k->start);
			record('K', k->start, k->end, k->streamId, k->correlationId, k->name);
		} else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
			const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
			(void)kprof_add(&copies, copy_name(m->copyKind), m->end - m->start);
			record('C', m->start, m->end, m->streamId, m->correlationId, copy_name(m->copyKind));
		} else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
			const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
			(void)kprof_add(&copies, "memset", m->end - m->start);
			record('M', m->start, m->end, m->streamId, m->correlationId, "memset");
		} else if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
			const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)rec;
			record('R', a->start, a->end, a->threadId, a->correlationId, runtime_name(a->cbid));
		}
	}
	size_t dropped = 0;
	if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
		kernels.dropped += dropped;
	pthread_mutex_unlock(&lock);
	free(buf);
}

/* A context going away takes its pending records with it unless they are flushed first. */
static void CUPTIAPI on_resource(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void *data)
{
	(void)user, (void)data;
	if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING)
		(void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

static long env_long(const char *name, long dflt)
{
	const char *v = getenv(name);
	char *end;
	long n = v && *v ? strtol(v, &end, 10) : dflt;
	return v && *v && (*end || n < 0) ? dflt : n;
}

/* The kernels' table under demangled names (template instances of one kernel stay apart). */
static void demangle_into(kprof_table *out)
{
	for (size_t i = 0; i < kernels.cap; i++) {
		const kprof_row *r = &kernels.rows[i];
		if (!r->name)
			continue;
		int status = -1;
		char *d = __cxa_demangle(r->name, NULL, NULL, &status);
		(void)kprof_add_row(out, status == 0 && d ? d : r->name, r->calls, r->ns, r->max_ns);
		free(d);
	}
	out->dropped += kernels.dropped;
}

/* The busy time of the whole run, and of its last TIER_KPROF_LAST_MS ms. */
static void print_idle(FILE *f)
{
	kprof_idle d;
	kprof_idle_of(&spans, 0, UINT64_MAX, &d);
	kprof_idle_print(&d, f, "kprof: device busy, whole run");
	long last = env_long("TIER_KPROF_LAST_MS", 0);
	if (last > 0 && spans.n) {
		uint64_t end = 0;
		for (size_t i = 0; i < spans.n; i++)
			end = spans.v[i].end > end ? spans.v[i].end : end;
		uint64_t from = end > (uint64_t)last * 1000000 ? end - (uint64_t)last * 1000000 : 0;
		char title[64];
		snprintf(title, sizeof title, "kprof: device busy, last %ld ms", last);
		kprof_idle_of(&spans, from, UINT64_MAX, &d);
		kprof_idle_print(&d, f, title);
	}
	if (spans.dropped)
		fprintf(f, "# kprof: %" PRIu64 " spans dropped (no memory): busy time undercounted\n", spans.dropped);
}

static void report(void)
{
	if (!ready)
		return;
	(void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
	const char *path = getenv("TIER_KPROF_OUT");
	FILE *f = path && *path ? fopen(path, "a") : stderr;
	if (!f) {
		fprintf(stderr, "kprof: cannot open TIER_KPROF_OUT=%s; the table goes to stderr\n", path);
		f = stderr;
	}
	pthread_mutex_lock(&lock);
	kprof_table named;
	kprof_init(&named);
	demangle_into(&named);
	kprof_print(&named, f, "kprof: kernels", (size_t)env_long("TIER_KPROF_TOP", 40),
		    (int)env_long("TIER_KPROF_WIDTH", 110));
	kprof_print(&copies, f, "kprof: copies and memsets", 0, 40);
	kprof_free(&named);
	print_idle(f);
	if (trace)
		fclose(trace), trace = NULL;
	pthread_mutex_unlock(&lock);
	if (f != stderr)
		fclose(f);
}

/* Called by the CUDA driver when it loads the library (CUDA_INJECTION64_PATH); 1 is success. A
 * failure leaves the program running unprofiled, with a line on stderr. */
int InitializeInjection(void)
{
	static const CUpti_ActivityKind kinds[] = { CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
						    CUPTI_ACTIVITY_KIND_MEMSET };
	CUpti_SubscriberHandle sub;
	if (ready) /* the driver may call again (another context): one subscriber serves all */
		return 1;
	const char *tpath = getenv("TIER_KPROF_TRACE");
	if (tpath && *tpath && !(trace = fopen(tpath, "w")))
		fprintf(stderr, "kprof: cannot write TIER_KPROF_TRACE=%s: no trace\n", tpath);
	CUptiResult r = cuptiActivityRegisterCallbacks(buf_requested, buf_completed);
	for (size_t i = 0; r == CUPTI_SUCCESS && i < sizeof kinds / sizeof kinds[0]; i++)
		r = cuptiActivityEnable(kinds[i]);
	if (r == CUPTI_SUCCESS && trace) /* host-side calls only for the trace: they cost a record each */
		r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
	if (r == CUPTI_SUCCESS && (r = cuptiSubscribe(&sub, (CUpti_CallbackFunc)on_resource, NULL)) == CUPTI_SUCCESS)
		r = cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING);
	if (r != CUPTI_SUCCESS) {
		const char *msg = NULL;
		cuptiGetResultString(r, &msg);
		fprintf(stderr, "kprof: CUPTI refused (%s): no profile\n", msg ? msg : "unknown error");
		return 1;
	}
	kprof_init(&kernels);
	kprof_init(&copies);
	ready = 1;
	atexit(report);
	return 1;
}
