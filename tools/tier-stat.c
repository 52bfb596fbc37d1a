/* tier-stat.c - watch a running tier job's store: tiers, hit rates, evictions, link bandwidth and
 * prefetch timeliness, one row per interval (vmstat style) or one JSON object per line. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "tier/tier.h"
#include "tier/stats.h"
#include "stat_report.h"

/* Exit codes, documented in --help and the man page. */
enum {
	EXIT_USAGE = 1,    /* bad arguments */
	EXIT_NOPROC = 2,   /* no such process, or it publishes no tier statistics */
	EXIT_VERSION = 3,  /* the segment is of another version (or not a tier segment) */
	EXIT_EXITED = 4,   /* the process exited while being watched */
	EXIT_OTHER = 5,    /* anything else (permission, no stable snapshot) */
};

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
		"Usage: tier-stat [-p PID | --run DIR] [--json] [INTERVAL [COUNT]]\n"
		"       tier-stat report RUN_DIR [--json] [--plot FILE.png|FILE.svg]\n"
		"Watch the tiered store of a running tier job (tier-run) read-only, one row per INTERVAL;\n"
		"or (report) summarise a run from its stats log RUN_DIR/stats.jsonl (tier-run --out RUN_DIR):\n"
		"hit rates and occupancy per tier, GB/s per link and prefetch over time, the hottest experts\n"
		"and the skew of each MoE layer; --json as one object, --plot draws them (cairo).\n"
		"tier-stat report --help tells more.\n"
		"\n"
		"  -p, --pid PID    the process to watch (its segment /dev/shm/tier-stats.PID)\n"
		"  -r, --run DIR    the job of run directory DIR (reads the pid from DIR/tier.pid); for a\n"
		"                   finished run use tier-stat report DIR\n"
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
		"\n"
		"Exit status: 0 done; 1 bad arguments; 2 no such process, or it publishes no tier statistics;\n"
		"3 the job's statistics are of another version (use the tier-stat of the same build);\n"
		"4 the process exited while watched; 5 other errors (permission, no stable snapshot).\n"
		"report: 2 no such run directory, or no or an empty stats log; 3 a log of another format\n"
		"version; 5 a malformed log line (named) or the image could not be written; 6 --plot in a\n"
		"build without cairo.\n");
}

static int exit_code_of(int rc)
{
	switch (rc) {
	case -ESRCH: return EXIT_NOPROC;
	case -EPROTO: return EXIT_VERSION;
	default: return EXIT_OTHER;
	}
}

/* Read the pid of a run directory's job. */
static int pid_of_run(const char *dir, pid_t *pid)
{
	char path[4096];
	long v;
	FILE *f;
	snprintf(path, sizeof path, "%s/tier.pid", dir);
	f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "tier-stat: %s: %s: this run has no live job to watch (for a finished run: "
			"tier-stat report %s)\n", path,
			strerror(errno), dir);
		return EXIT_NOPROC;
	}
	if (fscanf(f, "%ld", &v) != 1 || v <= 0 || v > 0x7fffffff) {
		fclose(f);
		fprintf(stderr, "tier-stat: %s does not hold a process id\n", path);
		return EXIT_USAGE;
	}
	fclose(f);
	*pid = (pid_t)v;
	return 0;
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

static void print_header(const tier_stats *s)
{
	char group[64];
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

static void print_row(const tier_stats *s, const tier_stats *prev, double dt)
{
	char tbuf[16], used[32];
	time_t now = time(NULL);
	uint64_t ev = 0, ev0 = 0;
	strftime(tbuf, sizeof tbuf, "%H:%M:%S", localtime(&now));
	printf("%-8s %6llu", tbuf, (unsigned long long)s->step);
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		tier_sum a = sum_tier(s, t), b = prev ? sum_tier(prev, t) : (tier_sum){ 0, 0, 0 };
		double div;
		const char *unit;
		ev += a.evictions;
		ev0 += b.evictions;
		if (!s->tier[t].capacity)
			continue;
		tier_unit(s->tier[t].capacity, &div, &unit);
		int prec = div > (1 << 20) ? 2 : 1; /* GiB columns need the hundredths */
		snprintf(used, sizeof used, "%.*f/%.*f", prec, (double)s->tier[t].used / div, prec,
			 (double)s->tier[t].capacity / div);
		printf("  %16s", used);
		print_num(pct(a.hits - b.hits, a.hits - b.hits + a.misses - b.misses), 5, 1);
	}
	print_num(dt > 0 ? (double)(ev - ev0) / dt : NAN, 8, 1);
	printf(" ");
	for (size_t i = 0; i < sizeof shown_links / sizeof *shown_links; i++) {
		int l = shown_links[i];
		uint64_t bytes = s->link[l].bytes - (prev ? prev->link[l].bytes : 0);
		print_num(dt > 0 ? (double)bytes / dt / 1e9 : NAN, 7, 3);
	}
	const tier_stats_prefetch *p = &s->prefetch, *q = prev ? &prev->prefetch : NULL;
	uint64_t on = p->on_time - (q ? q->on_time : 0);
	uint64_t needs = on + p->late - (q ? q->late : 0) + p->missed - (q ? q->missed : 0);
	printf(" ");
	print_num(pct(on, needs), 7, 1);
	print_num((double)(p->stall_ns - (q ? q->stall_ns : 0)) / 1e6, 8, 1);
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

static void print_json(const tier_stats *s, const tier_stats *prev, double dt)
{
	printf("{\"time\":%lld,\"pid\":%d,\"job\":", (long long)time(NULL), s->pid);
	json_str(s->job);
	printf(",\"version\":%u,\"interval_s\":%.6g,\"step\":%llu,\"objects\":%llu,\"object_bytes\":%llu,"
	       "\"hbm_emulated\":%s,\"uptime_s\":%.3f,\"tiers\":[", s->version, dt, U(s->step), U(s->objects),
	       U(s->object_bytes), s->hbm_emulated ? "true" : "false", (double)(s->update_ns - s->start_ns) / 1e9);
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		const tier_stats_tier *x = &s->tier[t];
		tier_sum a = sum_tier(s, t), b = prev ? sum_tier(prev, t) : (tier_sum){ 0, 0, 0 };
		printf("%s{\"name\":", t ? "," : "");
		json_str(s->tier_name[t]);
		printf(",\"capacity\":%llu,\"used\":%llu,\"peak\":%llu,\"payload\":%llu,\"copies\":%llu,\"pinned\":%llu,"
		       "\"hits\":%llu,\"misses\":%llu,\"evictions\":%llu,", U(x->capacity), U(x->used), U(x->peak),
		       U(x->payload), U(x->copies), U(x->pinned), U(a.hits), U(a.misses), U(a.evictions));
		json_num("hit_pct", pct(a.hits - b.hits, a.hits - b.hits + a.misses - b.misses));
		putchar(',');
		json_num("evictions_per_s", dt > 0 ? (double)(a.evictions - b.evictions) / dt : NAN);
		printf(",\"classes\":[");
		for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
			const tier_stats_class *k = &s->cls[t][c];
			printf("%s{\"name\":", c ? "," : "");
			json_str(s->class_name[c]);
			printf(",\"hits\":%llu,\"misses\":%llu,\"evictions\":%llu,\"writebacks\":%llu,\"drops\":%llu}",
			       U(k->hits), U(k->misses), U(k->evictions), U(k->writebacks), U(k->drops));
		}
		printf("]}");
	}
	printf("],\"links\":[");
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		const tier_stats_link *k = &s->link[l];
		uint64_t db = k->bytes - (prev ? prev->link[l].bytes : 0);
		printf("%s{\"name\":", l ? "," : "");
		json_str(link_label(s, l));
		printf(",\"bytes\":%llu,\"transfers\":%llu,\"errors\":%llu,\"busy_ns\":%llu,", U(k->bytes),
		       U(k->transfers), U(k->errors), U(k->busy_ns));
		json_num("gbps", dt > 0 ? (double)db / dt / 1e9 : NAN);
		putchar('}');
	}
	const tier_stats_prefetch *p = &s->prefetch;
	printf("],\"prefetch\":{\"issued\":%llu,\"on_time\":%llu,\"late\":%llu,\"missed\":%llu,\"stall_ns\":%llu,"
	       "\"wasted\":%llu}}\n", U(p->issued), U(p->on_time), U(p->late), U(p->missed), U(p->stall_ns),
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

static int watch(pid_t pid, double interval, long count, int json)
{
	tier_stats cur, prev;
	struct timespec next;
	long rows = 0;
	int rc = tier_stats_read(pid, &prev);
	if (rc) {
		fprintf(stderr, "tier-stat: %s\n", tier_last_error());
		return exit_code_of(rc);
	}
	/* The first row covers the time since the store started. */
	double dt = (double)(prev.update_ns - prev.start_ns) / 1e9;
	if (json)
		print_json(&prev, NULL, dt);
	else {
		print_header(&prev);
		print_row(&prev, NULL, dt);
	}
	fflush(stdout);
	rows = 1;
	clock_gettime(CLOCK_MONOTONIC, &next);
	while (interval > 0 && (count <= 0 || rows < count) && !interrupted) {
		sleep_until(&next, interval);
		if (interrupted)
			break;
		rc = tier_stats_read(pid, &cur);
		if (rc == -ESRCH && !process_alive(pid)) {
			fprintf(stderr, "tier-stat: process %ld exited\n", (long)pid);
			return EXIT_EXITED;
		}
		/* A writer busy for a whole read, or a job between two stores (its segment is
		 * replaced): the next interval will do. */
		if (rc == -EAGAIN || rc == -ESRCH)
			continue;
		if (rc) {
			fprintf(stderr, "tier-stat: %s\n", tier_last_error());
			return exit_code_of(rc);
		}
		/* A new store in the same job starts its counters from zero: rates since its start. */
		const tier_stats *base = cur.start_ns == prev.start_ns ? &prev : NULL;
		dt = (double)(cur.update_ns - (base ? prev.update_ns : cur.start_ns)) / 1e9;
		if (dt <= 0)
			dt = interval; /* no new snapshot: rates are zero over the wall interval */
		if (json)
			print_json(&cur, base, dt);
		else {
			if (rows % HEADER_EVERY == 0 || !base)
				print_header(&cur);
			print_row(&cur, base, dt);
		}
		fflush(stdout);
		prev = cur;
		rows++;
	}
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "pid", required_argument, NULL, 'p' }, { "run", required_argument, NULL, 'r' },
		{ "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	pid_t pid = 0;
	const char *run = NULL;
	int json = 0, c, rc;
	double interval = 0;
	long count = 0;
	char *end;

	if (argc > 1 && !strcmp(argv[1], "report"))
		return report_main(argc - 1, argv + 1);
	while ((c = getopt_long(argc, argv, "p:r:jh", opts, NULL)) != -1) {
		switch (c) {
		case 'p': {
			long v = strtol(optarg, &end, 10);
			if (*end || end == optarg || v <= 0 || v > 0x7fffffff) {
				fprintf(stderr, "tier-stat: -p needs a process id, not '%s'\n", optarg);
				return EXIT_USAGE;
			}
			pid = (pid_t)v;
			break;
		}
		case 'r': run = optarg; break;
		case 'j': json = 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return EXIT_USAGE;
		}
	}
	if (!pid == !run) {
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
	if (run && (rc = pid_of_run(run, &pid)) != 0)
		return rc;
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGPIPE, SIG_DFL);
	return watch(pid, interval, count, json);
}
