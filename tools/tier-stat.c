/* tier-stat.c - watch a running tier job's store: tiers, hit rates, evictions, link bandwidth and
 * prefetch timeliness, one row per interval (vmstat style) or one JSON object per line; a job of
 * several ranks (one process each) as one row per rank and an "all" row. */
#include "config.h"
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "tier/tier.h"
#include "tier/stats.h"
#include "stat_report.h"
#include "stat_ranks.h"

#define HEADER_EVERY 20

/* The links shown as columns; JSON carries all of them. */
static const int shown_links[] = { 0, 1, 2, 3 }; /* h2d d2h nvme-read nvme-write */
static const char *const shown_head[] = { "h2d", "d2h", "nvme-rd", "nvme-wr" };
static const char *const link_fallback[TIER_STATS_NLINKS] = {
	"h2d", "d2h", "nvme-read", "nvme-write", "nvme-to-hbm", "hbm-to-nvme", "d2d", "h2h",
};

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-stat [-p PID[,PID...] | --run DIR] [--ranks] [--json] [INTERVAL [COUNT]]\n"
		"       tier-stat report RUN_DIR [--json] [--plot FILE.png|FILE.svg]\n"
		"Watch the tiered store of a running tier job (tier-run) read-only, one row per INTERVAL;\n"
		"or (report) summarise a run from its stats log RUN_DIR/stats.jsonl (tier-run --out RUN_DIR):\n"
		"hit rates and occupancy per tier, GB/s per link and prefetch over time, the hottest experts\n"
		"and the skew of each MoE layer; --json as one object, --plot draws them (cairo).\n"
		"tier-stat report --help tells more.\n"
		"\n"
		"  -p, --pid PID[,PID...]\n"
		"                   the process to watch (its segment /dev/shm/tier-stats.PID); several,\n"
		"                   comma-separated: the ranks of one job, rank i the i-th PID (from 0)\n"
		"  -r, --run DIR    the job of run directory DIR: rank N's pid from DIR/tier.N.pid or\n"
		"                   DIR/rankN/tier.pid (each rank's own tier-run --out), DIR/tier.pid is rank 0\n"
		"                   when no file names rank 0; for a finished run use tier-stat report DIR\n"
		"      --ranks      the rank columns and the all row even for a single process\n"
		"  -j, --json       one JSON object per line with every counter, instead of the table\n"
		"  -h, --help       this text\n"
		"  INTERVAL         seconds between rows (decimals allowed, e.g. 0.5); without it, one row\n"
		"                   of totals since the store started, then exit\n"
		"  COUNT            number of rows (default: until the process exits or Ctrl-C)\n"
		"\n"
		"Columns: time; per tier used/capacity and hit %% (hits / (hits + misses) of acquires in\n"
		"that tier); evictions/s over all tiers; GB/s (1e9 B/s) over the interval on the links\n"
		"h2d, d2h, nvme-read, nvme-write; prefetch on-time %% (needs whose data was ready) and the\n"
		"time acquire callers stalled (ms). The first row covers the time since the store started.\n"
		"A tier named \"hbm (emulated)\" is host memory standing in for a GPU.\n"
		"Several processes: each interval one row per rank, led by its rank and pid, then an \"all\"\n"
		"row over the ranks still running: sums of bytes, GB/s, evictions/s and stall; hit and\n"
		"on-time %% from the summed counts; step the lowest. A rank that exits is shown \"exited\"\n"
		"and the others go on; tier-stat then exits 4 when done (or when all have exited).\n"
		"\n"
		"Exit status: 0 done; 1 bad arguments; 2 no such process, or it publishes no tier statistics;\n"
		"3 the job's statistics are of another version (use the tier-stat of the same build);\n"
		"4 the process (a rank) exited while watched; 5 other errors (permission, no stable snapshot).\n"
		"With several processes the message names the rank and pid.\n"
		"report: 2 no such run directory, or no or an empty stats log; 3 a log of another format\n"
		"version; 5 a malformed log line (named) or the image could not be written; 6 --plot in a\n"
		"build without cairo.\n");
}

static int exit_code_of(int rc)
{
	switch (rc) {
	case -ESRCH: case -ESTALE: return EXIT_NOPROC;
	case -EPROTO: return EXIT_VERSION;
	default: return EXIT_OTHER;
	}
}

/* ---- Derived figures --------------------------------------------------------------------------- */

typedef struct {
	uint64_t hits, misses, evictions;
} tier_sum;

static tier_sum sum_tier(const tier_stats *s, int t)
{
	tier_sum r = { 0, 0, 0 };
	for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
		r.hits += s->cls[t][c].hits;
		r.misses += s->cls[t][c].misses;
		r.evictions += s->cls[t][c].evictions;
	}
	return r;
}

static double pct(uint64_t part, uint64_t whole)
{
	return whole ? 100.0 * (double)part / (double)whole : NAN;
}

static const char *link_label(const tier_stats *s, int l)
{
	return s->link_name[l][0] ? s->link_name[l] : link_fallback[l];
}

/* The interval's counts and rates of snapshot s after prev (NULL: since the store started). */
static void delta_of(const tier_stats *s, const tier_stats *prev, double dt, stat_delta *d)
{
	uint64_t ev = 0, ev0 = 0;
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		tier_sum a = sum_tier(s, t), b = prev ? sum_tier(prev, t) : (tier_sum){ 0, 0, 0 };
		d->hits[t] = a.hits - b.hits;
		d->misses[t] = a.misses - b.misses;
		d->evict_ps[t] = dt > 0 ? (double)(a.evictions - b.evictions) / dt : NAN;
		ev += a.evictions;
		ev0 += b.evictions;
	}
	d->evict_ps_all = dt > 0 ? (double)(ev - ev0) / dt : NAN;
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		uint64_t bytes = s->link[l].bytes - (prev ? prev->link[l].bytes : 0);
		d->gbps[l] = dt > 0 ? (double)bytes / dt / 1e9 : NAN;
	}
	const tier_stats_prefetch *p = &s->prefetch, *q = prev ? &prev->prefetch : NULL;
	d->on_time = p->on_time - (q ? q->on_time : 0);
	d->needs = d->on_time + p->late - (q ? q->late : 0) + p->missed - (q ? q->missed : 0);
	d->stall_ns = p->stall_ns - (q ? q->stall_ns : 0);
}

/* A sum of rates where NaN means "no figure": NaN only when both are. */
static double add_rate(double a, double b)
{
	return isnan(a) ? b : isnan(b) ? a : a + b;
}

/* Add the words of b to those of a: the counter structs are all uint64_t (a field of another type
 * added to them must be summed by hand). */
_Static_assert(sizeof(tier_stats_tier) == 6 * 8 && sizeof(tier_stats_class) == 7 * 8 &&
		       sizeof(tier_stats_link) == 4 * 8 && sizeof(tier_stats_prefetch) == 6 * 8,
	       "the counter structs of tier/stats.h are summed as arrays of uint64_t");
static void add_words(void *a, const void *b, size_t bytes)
{
	uint64_t *x = a;
	const uint64_t *y = b;
	for (size_t i = 0; i < bytes / sizeof *x; i++)
		x[i] += y[i];
}

/* The all row: the running ranks' snapshots summed into *sum (names from the first; step the
 * lowest), their interval figures into *d (rates summed; hit and on-time shares follow from the
 * summed counts), *dt the longest interval. Returns the number of running ranks; 0 leaves the
 * outputs unset. */
static int ranks_sum(const stat_rank *r, int n, tier_stats *sum, stat_delta *d, double *dt)
{
	int k = 0;
	for (int i = 0; i < n; i++) {
		const stat_rank *x = &r[i];
		if (x->exited)
			continue;
		if (!k++) {
			*sum = x->cur, *d = x->d, *dt = x->dt;
			continue;
		}
		add_words(sum->tier, x->cur.tier, sizeof sum->tier);
		add_words(sum->cls, x->cur.cls, sizeof sum->cls);
		add_words(sum->link, x->cur.link, sizeof sum->link);
		add_words(&sum->prefetch, &x->cur.prefetch, sizeof sum->prefetch);
		sum->objects += x->cur.objects;
		sum->object_bytes += x->cur.object_bytes;
		sum->step = x->cur.step < sum->step ? x->cur.step : sum->step;
		for (int t = 0; t < TIER_STATS_NTIERS; t++) {
			d->hits[t] += x->d.hits[t];
			d->misses[t] += x->d.misses[t];
			d->evict_ps[t] = add_rate(d->evict_ps[t], x->d.evict_ps[t]);
		}
		d->evict_ps_all = add_rate(d->evict_ps_all, x->d.evict_ps_all);
		for (int l = 0; l < TIER_STATS_NLINKS; l++)
			d->gbps[l] = add_rate(d->gbps[l], x->d.gbps[l]);
		d->on_time += x->d.on_time;
		d->needs += x->d.needs;
		d->stall_ns += x->d.stall_ns;
		*dt = x->dt > *dt ? x->dt : *dt;
	}
	return k;
}

/* Unit of a tier's column, chosen once from its capacity so the column does not jump. */
static void tier_unit(uint64_t cap, double *div, const char **name)
{
	if (cap >= (1ull << 30)) {
		*div = (double)(1ull << 30);
		*name = "GiB";
	} else {
		*div = (double)(1ull << 20);
		*name = "MiB";
	}
}

/* ---- Table ------------------------------------------------------------------------------------ */

#define TIER_COLW 22 /* "used/capacity unit" 16 + " hit%" 6 */
#define RANK_FMT "%4s %7s " /* rank, pid: the columns that lead a row of a job of several ranks */

/* The header; `ranks`: with the rank columns. Tiers, names and units are those of `s`. */
static void print_header(const tier_stats *s, int ranks)
{
	char group[64];
	if (ranks)
		printf(RANK_FMT, "", "");
	printf("%-8s %6s", "", "");
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		if (!s->tier[t].capacity)
			continue;
		snprintf(group, sizeof group, "%s", s->tier_name[t][0] ? s->tier_name[t] : "tier");
		int pad = TIER_COLW - (int)strlen(group) - 2;
		printf("  %.*s %s %.*s", pad / 2, "----------------------", group, pad - pad / 2,
		       "----------------------");
	}
	printf(" %8s  %-31s  %s\n", "", "------------- GB/s ------------", "--- prefetch ---");
	if (ranks)
		printf(RANK_FMT, "rank", "pid");
	printf("%-8s %6s", "time", "step");
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		double div;
		const char *unit;
		char h[32];
		if (!s->tier[t].capacity)
			continue;
		tier_unit(s->tier[t].capacity, &div, &unit);
		snprintf(h, sizeof h, "used/cap %s", unit);
		printf("  %16s %5s", h, "hit%");
	}
	printf(" %8s ", "evict/s");
	for (size_t i = 0; i < sizeof shown_links / sizeof *shown_links; i++)
		printf(" %7s", shown_head[i]);
	printf("  %7s %8s\n", "ontime%", "stall ms");
}

static void print_num(double v, int width, int prec)
{
	if (isnan(v))
		printf(" %*s", width, "-");
	else
		printf(" %*.*f", width, prec, v);
}

static void print_time(time_t now)
{
	char tbuf[16];
	strftime(tbuf, sizeof tbuf, "%H:%M:%S", localtime(&now));
	printf("%-8s", tbuf);
}

/* One row of snapshot s and its interval d, in the columns of header `layout` (the tiers shown and
 * their units). */
static void print_row(const tier_stats *layout, const tier_stats *s, const stat_delta *d, time_t now)
{
	char used[32];
	print_time(now);
	printf(" %6llu", (unsigned long long)s->step);
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		double div;
		const char *unit;
		if (!layout->tier[t].capacity)
			continue;
		tier_unit(layout->tier[t].capacity, &div, &unit);
		int prec = div > (1 << 20) ? 2 : 1; /* GiB columns need the hundredths */
		snprintf(used, sizeof used, "%.*f/%.*f", prec, (double)s->tier[t].used / div, prec,
			 (double)s->tier[t].capacity / div);
		printf("  %16s", used);
		print_num(pct(d->hits[t], d->hits[t] + d->misses[t]), 5, 1);
	}
	print_num(d->evict_ps_all, 8, 1);
	printf(" ");
	for (size_t i = 0; i < sizeof shown_links / sizeof *shown_links; i++)
		print_num(d->gbps[shown_links[i]], 7, 3);
	printf(" ");
	print_num(pct(d->on_time, d->needs), 7, 1);
	print_num((double)d->stall_ns / 1e6, 8, 1);
	printf("\n");
}

/* ---- JSON ------------------------------------------------------------------------------------- */

static void json_str(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			printf("\\%c", c);
		else if (c < 0x20)
			printf("\\u%04x", c);
		else
			putchar(c);
	}
	putchar('"');
}

static void json_num(const char *key, double v)
{
	if (isnan(v))
		printf("\"%s\":null", key);
	else
		printf("\"%s\":%.6g", key, v);
}

#define U(x) ((unsigned long long)(x))

/* One object (no newline) with every counter of s and the rates of d over dt seconds. `head` goes
 * first inside the braces; `agg`: the all row of several ranks, without the keys of one process
 * (time, pid, job, version, hbm_emulated, uptime_s). */
static void print_json(const tier_stats *s, const stat_delta *d, double dt, const char *head, int agg)
{
	printf("{%s", head);
	if (!agg) {
		printf("\"time\":%lld,\"pid\":%d,\"job\":", (long long)time(NULL), s->pid);
		json_str(s->job);
		printf(",\"version\":%u,", s->version);
	}
	printf("\"interval_s\":%.6g,\"step\":%llu,\"objects\":%llu,\"object_bytes\":%llu", dt, U(s->step),
	       U(s->objects), U(s->object_bytes));
	if (!agg)
		printf(",\"hbm_emulated\":%s,\"uptime_s\":%.3f", s->hbm_emulated ? "true" : "false",
		       (double)(s->update_ns - s->start_ns) / 1e9);
	printf(",\"tiers\":[");
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		const tier_stats_tier *x = &s->tier[t];
		tier_sum a = sum_tier(s, t);
		printf("%s{\"name\":", t ? "," : "");
		json_str(s->tier_name[t]);
		printf(",\"capacity\":%llu,\"used\":%llu,\"peak\":%llu,\"payload\":%llu,\"copies\":%llu,\"pinned\":%llu,"
		       "\"hits\":%llu,\"misses\":%llu,\"evictions\":%llu,", U(x->capacity), U(x->used), U(x->peak),
		       U(x->payload), U(x->copies), U(x->pinned), U(a.hits), U(a.misses), U(a.evictions));
		json_num("hit_pct", pct(d->hits[t], d->hits[t] + d->misses[t]));
		putchar(',');
		json_num("evictions_per_s", d->evict_ps[t]);
		printf(",\"classes\":[");
		for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
			const tier_stats_class *k = &s->cls[t][c];
			printf("%s{\"name\":", c ? "," : "");
			json_str(s->class_name[c]);
			printf(",\"hits\":%llu,\"misses\":%llu,\"evictions\":%llu,\"writebacks\":%llu,\"drops\":%llu,"
			       "\"bytes_in\":%llu,\"unused_prefetches\":%llu}", U(k->hits), U(k->misses), U(k->evictions),
			       U(k->writebacks), U(k->drops), U(k->bytes_in), U(k->unused));
		}
		printf("]}");
	}
	printf("],\"links\":[");
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		const tier_stats_link *k = &s->link[l];
		printf("%s{\"name\":", l ? "," : "");
		json_str(link_label(s, l));
		printf(",\"bytes\":%llu,\"transfers\":%llu,\"errors\":%llu,\"busy_ns\":%llu,", U(k->bytes),
		       U(k->transfers), U(k->errors), U(k->busy_ns));
		json_num("gbps", d->gbps[l]);
		putchar('}');
	}
	const tier_stats_prefetch *p = &s->prefetch;
	printf("],\"prefetch\":{\"issued\":%llu,\"on_time\":%llu,\"late\":%llu,\"missed\":%llu,\"stall_ns\":%llu,"
	       "\"wasted\":%llu}}", U(p->issued), U(p->on_time), U(p->late), U(p->missed), U(p->stall_ns),
	       U(p->wasted));
}

/* ---- Main loop -------------------------------------------------------------------------------- */

static int process_alive(pid_t pid)
{
	return kill(pid, 0) == 0 || errno != ESRCH;
}

static volatile sig_atomic_t interrupted;
static void on_signal(int sig) { (void)sig; interrupted = 1; }

static void sleep_until(struct timespec *next, double interval)
{
	uint64_t ns = (uint64_t)(interval * 1e9);
	next->tv_sec += (time_t)(ns / 1000000000u);
	next->tv_nsec += (long)(ns % 1000000000u);
	if (next->tv_nsec >= 1000000000L) {
		next->tv_sec++;
		next->tv_nsec -= 1000000000L;
	}
	while (!interrupted && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, next, NULL) == EINTR)
		;
}

/* How the rows are printed. */
typedef struct {
	int json;
	int ranks;         /* the rank layout: several processes, or --ranks */
	int header_every;  /* intervals between headers */
	tier_stats layout; /* rank layout: the all row the header was printed from (tiers, units) */
} stat_view;

/* The library's last message, naming the rank when there are several. */
static void report_error(const stat_rank *x, const stat_view *v)
{
	if (v->ranks)
		fprintf(stderr, "tier-stat: rank %d (pid %ld): %s\n", x->rank, (long)x->pid, tier_last_error());
	else
		fprintf(stderr, "tier-stat: %s\n", tier_last_error());
}

/* The rows of one interval: the process's, or each rank's and the all row. */
static void emit(stat_view *v, const stat_rank *r, int n, int header)
{
	time_t now = time(NULL);
	tier_stats sum;
	stat_delta d;
	double dt = 0;
	char rk[16], pd[24], head[64];
	int running = ranks_sum(r, n, &sum, &d, &dt);

	if (!v->ranks) {
		if (v->json) {
			print_json(&r->cur, &r->d, r->dt, "", 0);
			putchar('\n');
		} else {
			if (header)
				print_header(&r->cur, 0);
			print_row(&r->cur, &r->cur, &r->d, now);
		}
		fflush(stdout);
		return;
	}
	if (v->json)
		printf("{\"time\":%lld,\"ranks\":[", (long long)now);
	else if (header) {
		v->layout = sum;
		print_header(&v->layout, 1);
	}
	for (int i = 0; i < n; i++) {
		const stat_rank *x = &r[i];
		if (v->json) {
			if (x->exited) {
				printf("%s{\"rank\":%d,\"pid\":%ld,\"status\":\"exited\"}", i ? "," : "", x->rank,
				       (long)x->pid);
				continue;
			}
			snprintf(head, sizeof head, "\"rank\":%d,\"status\":\"running\",", x->rank);
			if (i)
				putchar(',');
			print_json(&x->cur, &x->d, x->dt, head, 0);
			continue;
		}
		snprintf(rk, sizeof rk, "%d", x->rank);
		snprintf(pd, sizeof pd, "%ld", (long)x->pid);
		printf(RANK_FMT, rk, pd);
		if (x->exited) {
			print_time(now);
			printf(" %6s  exited\n", "-");
		} else {
			print_row(&v->layout, &x->cur, &x->d, now);
		}
	}
	if (v->json) {
		snprintf(head, sizeof head, "\"ranks_running\":%d,", running);
		printf("],\"all\":");
		print_json(&sum, &d, dt, head, 1);
		printf("}\n");
	} else {
		printf(RANK_FMT, "all", "-");
		print_row(&v->layout, &sum, &d, now);
	}
	fflush(stdout);
}

/* The first snapshot of every rank; its row covers the time since the store started. Returns 0,
 * or the exit code of the first rank that failed (each failure is reported). */
static int read_first(stat_rank *r, int n, const stat_view *v)
{
	int code = 0;
	for (int i = 0; i < n; i++) {
		stat_rank *x = &r[i];
		int rc = tier_stats_read(x->pid, &x->prev);
		if (rc) {
			report_error(x, v);
			code = code ? code : exit_code_of(rc);
			continue;
		}
		x->cur = x->prev;
		x->dt = (double)(x->cur.update_ns - x->cur.start_ns) / 1e9;
		x->new_store = 1;
		delta_of(&x->cur, NULL, x->dt, &x->d);
	}
	return code;
}

/* Read this interval's snapshots of the running ranks. A rank whose process is gone is marked
 * exited. Returns 0 (all read), 1 (some rank had no new snapshot: skip the interval), or an exit
 * code: EXIT_EXITED when no rank runs any more, another on an error (reported). */
static int read_interval(stat_rank *r, int n, const stat_view *v)
{
	int running = 0, skip = 0;
	for (int i = 0; i < n; i++) {
		stat_rank *x = &r[i];
		if (x->exited)
			continue;
		int rc = tier_stats_read(x->pid, &x->cur);
		if ((rc == -ESRCH && !process_alive(x->pid)) || rc == -ESTALE) { /* ESTALE: its pid reused */
			x->exited = 1;
			if (v->ranks)
				fprintf(stderr, "tier-stat: rank %d (pid %ld) exited\n", x->rank, (long)x->pid);
			else
				fprintf(stderr, "tier-stat: process %ld exited\n", (long)x->pid);
			continue;
		}
		running++;
		/* A writer busy for a whole read, or a job between two stores (its segment is
		 * replaced): the next interval will do, its row covering both. */
		if (rc == -EAGAIN || rc == -ESRCH) {
			skip = 1;
			continue;
		}
		if (rc) {
			report_error(x, v);
			return exit_code_of(rc);
		}
	}
	return !running ? EXIT_EXITED : skip;
}

static int watch(stat_rank *r, int n, double interval, long count, stat_view *v)
{
	struct timespec next;
	long rows = 0;
	int rc, exited = 0;

	if ((rc = read_first(r, n, v)) != 0)
		return rc;
	emit(v, r, n, 1);
	rows = 1;
	clock_gettime(CLOCK_MONOTONIC, &next);
	while (interval > 0 && (count <= 0 || rows < count) && !interrupted) {
		sleep_until(&next, interval);
		if (interrupted)
			break;
		rc = read_interval(r, n, v);
		for (int i = 0; i < n; i++)
			exited |= r[i].exited;
		if (rc == 1)
			continue;
		if (rc)
			return rc;
		int new_store = 0;
		for (int i = 0; i < n; i++) {
			stat_rank *x = &r[i];
			if (x->exited)
				continue;
			/* A new store in the same job starts its counters from zero: rates since its start. */
			x->new_store = x->cur.start_ns != x->prev.start_ns;
			x->dt = (double)(x->cur.update_ns - (x->new_store ? x->cur.start_ns : x->prev.update_ns)) / 1e9;
			if (x->dt <= 0)
				x->dt = interval; /* no new snapshot: rates are zero over the wall interval */
			delta_of(&x->cur, x->new_store ? NULL : &x->prev, x->dt, &x->d);
			new_store |= x->new_store;
		}
		emit(v, r, n, rows % v->header_every == 0 || new_store);
		for (int i = 0; i < n; i++)
			r[i].prev = r[i].cur;
		rows++;
	}
	return exited ? EXIT_EXITED : 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "pid", required_argument, NULL, 'p' }, { "run", required_argument, NULL, 'r' },
		{ "ranks", no_argument, NULL, 'R' }, { "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	rank_list l = { NULL, 0, 0 };
	stat_view v = { 0 };
	const char *run = NULL;
	int c, rc, force_ranks = 0;
	double interval = 0;
	long count = 0;
	char *end;

	if (argc > 1 && !strcmp(argv[1], "report"))
		return report_main(argc - 1, argv + 1);
	while ((c = getopt_long(argc, argv, "p:r:jh", opts, NULL)) != -1) {
		switch (c) {
		case 'p':
			if ((rc = ranks_of_pids(&l, optarg)) != 0)
				return rc;
			break;
		case 'r': run = optarg; break;
		case 'R': force_ranks = 1; break;
		case 'j': v.json = 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return EXIT_USAGE;
		}
	}
	if (!l.n == !run) {
		fprintf(stderr, "tier-stat: give exactly one of -p PID or --run DIR (see tier-stat --help)\n");
		return EXIT_USAGE;
	}
	if (optind < argc) {
		interval = strtod(argv[optind], &end);
		if (*end || end == argv[optind] || !(interval > 0) || interval > 86400) {
			fprintf(stderr, "tier-stat: INTERVAL must be seconds > 0, not '%s'\n", argv[optind]);
			return EXIT_USAGE;
		}
		optind++;
	}
	if (optind < argc) {
		count = strtol(argv[optind], &end, 10);
		if (*end || end == argv[optind] || count <= 0) {
			fprintf(stderr, "tier-stat: COUNT must be a positive number of rows, not '%s'\n", argv[optind]);
			return EXIT_USAGE;
		}
		optind++;
	}
	if (optind < argc) {
		fprintf(stderr, "tier-stat: unexpected argument '%s' (see tier-stat --help)\n", argv[optind]);
		return EXIT_USAGE;
	}
	if (run && (rc = ranks_of_run(&l, run)) != 0)
		return free(l.r), rc;
	v.ranks = force_ranks || l.n > 1;
	/* About HEADER_EVERY lines between headers: an interval prints a line per rank and the all row. */
	v.header_every = v.ranks ? (HEADER_EVERY / (l.n + 1) > 1 ? HEADER_EVERY / (l.n + 1) : 1) : HEADER_EVERY;
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGPIPE, SIG_DFL);
	rc = watch(l.r, l.n, interval, count, &v);
	free(l.r);
	return rc;
}
