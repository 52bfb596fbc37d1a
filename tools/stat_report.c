/* stat_report.c - tier-stat report RUN_DIR: a finished run summarised from its stats log
 * (RUN_DIR/stats.jsonl, docs/stats-log.md): tier hit rates and occupancy, link bandwidth and
 * prefetch over time, and the hottest experts of each MoE layer; a table, JSON, or an image. */
#include "config.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "stat_report.h"
#ifdef TIER_HAVE_JANSSON
#include <jansson.h>
#endif

#define SAMPLES 10 /* rows of the tables over time */
#define TOP 5      /* hottest experts shown per layer */

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tier-stat report RUN_DIR [--json] [--plot FILE.png|FILE.svg]\n"
		"Summarise a finished (or running) tier-run job from its stats log RUN_DIR/stats.jsonl\n"
		"(tier-run --out RUN_DIR writes it; format in docs/stats-log.md).\n"
		"  -j, --json         one JSON object with the same figures instead of the tables\n"
		"  -o, --plot FILE    also draw FILE (.png or .svg): the expert hotness heatmap (layer x\n"
		"                     expert, tokens over the run), hit rate per tier and bytes per link\n"
		"                     over the steps (needs a build with cairo)\n"
		"Exit status: 0 done; 1 bad arguments; 2 no such run directory, or no or an empty stats log;\n"
		"3 the log is of another format version; 5 a malformed log line (named) or the image could\n"
		"not be written; 6 --plot in a build without cairo.\n");
}

double report_hit_pct(const report_log *g, int t, int i, int j)
{
	const report_row *a = &g->rows[i], *b = j >= 0 ? &g->rows[j] : NULL;
	uint64_t h = a->hits[t] - (b ? b->hits[t] : 0), m = a->misses[t] - (b ? b->misses[t] : 0);
	return h + m ? 100.0 * (double)h / (double)(h + m) : NAN;
}

#ifdef TIER_HAVE_JANSSON

/* ---- Reading the log --------------------------------------------------------------------------- */

typedef struct {
	const char *path;
	long line;
	int bad;
} ctx;

static int bad(ctx *c, const char *what)
{
	if (!c->bad)
		fprintf(stderr, "tier-stat: %s:%ld: %s (a malformed stats log line; docs/stats-log.md has the format)\n",
			c->path, c->line, what);
	c->bad = 1;
	return REPORT_BADLOG;
}

static json_t *get(ctx *c, json_t *o, const char *key, json_type type)
{
	json_t *v = json_object_get(o, key);
	if (!v || (type == JSON_INTEGER ? !json_is_number(v) : json_typeof(v) != type)) {
		char msg[96];
		snprintf(msg, sizeof msg, "\"%s\" is missing or not %s", key,
			 type == JSON_INTEGER ? "a number" : type == JSON_ARRAY ? "an array" : "an object");
		bad(c, msg);
		return NULL;
	}
	return v;
}

static double num(ctx *c, json_t *o, const char *key)
{
	json_t *v = get(c, o, key, JSON_INTEGER);
	return v ? json_number_value(v) : 0;
}

static uint64_t u64(ctx *c, json_t *o, const char *key)
{
	json_t *v = get(c, o, key, JSON_INTEGER);
	if (!v)
		return 0;
	if (json_is_integer(v))
		return (uint64_t)json_integer_value(v);
	return (uint64_t)json_real_value(v);
}

static void copy_name(char *dst, size_t len, json_t *o)
{
	json_t *n = json_object_get(o, "name");
	snprintf(dst, len, "%s", json_is_string(n) ? json_string_value(n) : "?");
}

static void read_store(ctx *c, report_log *g, report_row *r, json_t *st, int first)
{
	json_t *tiers = get(c, st, "tiers", JSON_ARRAY), *links = get(c, st, "links", JSON_ARRAY);
	json_t *pf = get(c, st, "prefetch", JSON_OBJECT);
	if (c->bad)
		return;
	if (json_array_size(tiers) != TIER_STATS_NTIERS || json_array_size(links) != TIER_STATS_NLINKS) {
		bad(c, "\"tiers\" must hold 3 tiers and \"links\" 8 links");
		return;
	}
	for (int t = 0; t < TIER_STATS_NTIERS && !c->bad; t++) {
		json_t *x = json_array_get(tiers, (size_t)t), *cls = get(c, x, "classes", JSON_ARRAY);
		if (first)
			copy_name(g->tier[t], sizeof g->tier[t], x);
		g->capacity[t] = u64(c, x, "capacity");
		uint64_t pk = u64(c, x, "peak");
		g->peak[t] = pk > g->peak[t] ? pk : g->peak[t];
		r->used[t] = u64(c, x, "used");
		for (size_t k = 0; cls && k < json_array_size(cls) && !c->bad; k++) {
			json_t *y = json_array_get(cls, k);
			r->hits[t] += u64(c, y, "hits");
			r->misses[t] += u64(c, y, "misses");
		}
	}
	for (int l = 0; l < TIER_STATS_NLINKS && !c->bad; l++) {
		json_t *x = json_array_get(links, (size_t)l);
		if (first)
			copy_name(g->link[l], sizeof g->link[l], x);
		r->bytes[l] = u64(c, x, "bytes");
		r->busy_ns[l] = u64(c, x, "busy_ns");
	}
	r->issued = u64(c, pf, "issued"), r->on_time = u64(c, pf, "on_time"), r->late = u64(c, pf, "late");
	r->missed = u64(c, pf, "missed"), r->stall_ns = u64(c, pf, "stall_ns");
}

static void read_experts(ctx *c, report_log *g, json_t *ex, int first)
{
	size_t n = json_array_size(ex);
	if (first) {
		json_t *t0 = n ? json_object_get(json_array_get(ex, 0), "tokens") : NULL;
		g->nmoe = (int)n, g->experts = json_is_array(t0) ? (int)json_array_size(t0) : 0;
		g->layer = calloc(n ? n : 1, sizeof *g->layer);
		g->tokens = calloc(n * (size_t)g->experts + 1, sizeof *g->tokens);
		if (!g->layer || !g->tokens) {
			bad(c, "out of memory");
			return;
		}
	}
	if ((int)n != g->nmoe) {
		bad(c, "\"experts\" lists another number of MoE layers than the first line");
		return;
	}
	for (size_t i = 0; i < n && !c->bad; i++) {
		json_t *x = json_array_get(ex, i), *tok = get(c, x, "tokens", JSON_ARRAY);
		int ly = (int)num(c, x, "layer");
		if (c->bad)
			return;
		if (first)
			g->layer[i] = ly;
		if (ly != g->layer[i] || (int)json_array_size(tok) != g->experts) {
			bad(c, "an \"experts\" entry differs in layer or expert count from the first line");
			return;
		}
		for (int e = 0; e < g->experts; e++) {
			json_t *v = json_array_get(tok, (size_t)e);
			if (!json_is_integer(v) || json_integer_value(v) < 0) {
				bad(c, "expert token counts must be whole numbers >= 0");
				return;
			}
			g->tokens[i * (size_t)g->experts + e] += json_integer_value(v);
		}
	}
}

/* One line into a new row; 0 or an exit code. */
static int read_line(ctx *c, report_log *g, const char *text)
{
	json_error_t err;
	json_t *o = json_loads(text, 0, &err);
	if (!o || !json_is_object(o)) {
		char msg[300];
		snprintf(msg, sizeof msg, "not a JSON object%s%s", o ? "" : ": ", o ? "" : err.text);
		json_decref(o);
		return bad(c, msg);
	}
	json_t *v = json_object_get(o, "v");
	if (!json_is_integer(v)) {
		json_decref(o);
		return bad(c, "no format version \"v\"");
	}
	if (json_integer_value(v) != 1) {
		fprintf(stderr, "tier-stat: %s:%ld: the stats log is of format version %lld; this tier-stat reads "
			"version 1 (use the tier-stat of the tier-run that wrote it)\n", c->path, c->line,
			(long long)json_integer_value(v));
		json_decref(o);
		return REPORT_VERSION;
	}
	if (g->n == g->cap) {
		int cap = g->cap ? 2 * g->cap : 256;
		report_row *r = realloc(g->rows, sizeof *r * (size_t)cap);
		if (!r) {
			json_decref(o);
			return bad(c, "out of memory");
		}
		g->rows = r, g->cap = cap;
	}
	report_row *r = &g->rows[g->n];
	memset(r, 0, sizeof *r);
	int first = g->n == 0;
	r->step = (int)num(c, o, "step");
	r->time_s = num(c, o, "time_s");
	r->loss = num(c, o, "loss");
	r->tokens = (int64_t)num(c, o, "tokens");
	r->tokens_per_s = num(c, o, "tokens_per_s");
	json_t *st = get(c, o, "store", JSON_OBJECT), *ex = get(c, o, "experts", JSON_ARRAY);
	if (!c->bad)
		read_store(c, g, r, st, first);
	if (!c->bad)
		read_experts(c, g, ex, first);
	if (!c->bad && !first && r->step <= g->rows[g->n - 1].step)
		bad(c, "steps must increase from line to line");
	json_decref(o);
	if (c->bad)
		return REPORT_BADLOG;
	g->n++;
	return 0;
}

static void log_free(report_log *g)
{
	free(g->rows);
	free(g->layer);
	free(g->tokens);
}

static int log_load(const char *dir, report_log *g, char *path, size_t plen)
{
	struct stat sb;
	memset(g, 0, sizeof *g);
	if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
		fprintf(stderr, "tier-stat: %s: %s; give the --out directory of a tier-run\n", dir,
			stat(dir, &sb) ? strerror(errno) : "not a directory");
		return REPORT_NORUN;
	}
	snprintf(path, plen, "%s/stats.jsonl", dir);
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "tier-stat: %s: %s; tier-run writes it with --out DIR (a run of an older tier-run "
			"has only train_log.jsonl)\n", path, strerror(errno));
		return REPORT_NORUN;
	}
	ctx c = { .path = path };
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	int rc = 0;
	while (!rc && (len = getline(&line, &cap, f)) > 0) {
		c.line++;
		if (strspn(line, " \t\r\n") == (size_t)len)
			continue; /* blank lines (a trailing newline) are no steps */
		rc = read_line(&c, g, line);
	}
	free(line);
	fclose(f);
	if (!rc && g->n == 0) {
		fprintf(stderr, "tier-stat: %s is empty: the run logged no step yet\n", path);
		rc = REPORT_NORUN;
	}
	return rc;
}

/* ---- Figures ----------------------------------------------------------------------------------- */

/* Indices of the sampled rows: about SAMPLES, evenly over the run, the last one included. */
static int samples(const report_log *g, int *idx)
{
	int k = g->n < SAMPLES ? g->n : SAMPLES;
	for (int i = 0; i < k; i++)
		idx[i] = (int)(((int64_t)(i + 1) * g->n + k - 1) / k) - 1;
	return k;
}

static double gbps(const report_log *g, int l, int i, int j)
{
	double dt = g->rows[i].time_s - (j >= 0 ? g->rows[j].time_s : 0);
	uint64_t b = g->rows[i].bytes[l] - (j >= 0 ? g->rows[j].bytes[l] : 0);
	return dt > 0 ? (double)b / dt / 1e9 : NAN;
}

static int link_used(const report_log *g, int l) { return g->rows[g->n - 1].bytes[l] > 0; }

static double ontime_pct(const report_row *r)
{
	uint64_t needs = r->on_time + r->late + r->missed;
	return needs ? 100.0 * (double)r->on_time / (double)needs : NAN;
}

/* Layer i's experts sorted by tokens, hottest first (ties: lower index first). */
static void top_experts(const report_log *g, int i, int *order)
{
	const int64_t *t = g->tokens + (size_t)i * g->experts;
	for (int e = 0; e < g->experts; e++)
		order[e] = e;
	for (int a = 1; a < g->experts; a++) /* insertion sort: expert counts are small */
		for (int b = a; b > 0 && t[order[b]] > t[order[b - 1]]; b--) {
			int x = order[b];
			order[b] = order[b - 1], order[b - 1] = x;
		}
}

static double skew(const report_log *g, int i)
{
	const int64_t *t = g->tokens + (size_t)i * g->experts;
	int64_t sum = 0, mx = 0;
	for (int e = 0; e < g->experts; e++)
		sum += t[e], mx = t[e] > mx ? t[e] : mx;
	return sum ? (double)mx / ((double)sum / g->experts) : NAN;
}

typedef struct {
	double time_s, tokens_per_s, loss_first, loss_last, ontime, stall_ms;
	int64_t tokens;
} summary;

static summary summarise(const report_log *g)
{
	summary s = { 0 };
	const report_row *a = &g->rows[0], *z = &g->rows[g->n - 1];
	for (int i = 0; i < g->n; i++)
		s.tokens += g->rows[i].tokens;
	s.time_s = z->time_s;
	s.tokens_per_s = s.time_s > 0 ? (double)s.tokens / s.time_s : NAN;
	s.loss_first = a->loss, s.loss_last = z->loss;
	s.ontime = ontime_pct(z), s.stall_ms = (double)z->stall_ns / 1e6;
	return s;
}

/* ---- Text -------------------------------------------------------------------------------------- */

static void pnum(double v, int w, int prec)
{
	if (isnan(v))
		printf(" %*s", w, "-");
	else
		printf(" %*.*f", w, prec, v);
}

static void print_text(const report_log *g, const char *dir)
{
	summary s = summarise(g);
	int idx[SAMPLES], k = samples(g, idx);
	const report_row *z = &g->rows[g->n - 1];
	printf("run %s: %d steps (%d..%d) in %.2f s, %lld tokens, %.0f tokens/s; loss %.4f (first) -> %.4f (last)\n",
	       dir, g->n, g->rows[0].step, z->step, s.time_s, (long long)s.tokens, s.tokens_per_s, s.loss_first,
	       s.loss_last);
	printf("\nTiers: hit %% since the previous row, used MiB at the row\n%6s %9s", "step", "time s");
	for (int t = 0; t < TIER_STATS_NTIERS; t++)
		if (g->capacity[t])
			printf("  %-16.16s %6s", g->tier[t], "hit%");
	printf("\n");
	for (int i = 0; i < k; i++) {
		printf("%6d %9.2f", g->rows[idx[i]].step, g->rows[idx[i]].time_s);
		for (int t = 0; t < TIER_STATS_NTIERS; t++)
			if (g->capacity[t]) {
				char u[40];
				snprintf(u, sizeof u, "%.1f/%.1f", (double)g->rows[idx[i]].used[t] / 1048576.0,
					 (double)g->capacity[t] / 1048576.0);
				printf("  %16s", u);
				pnum(report_hit_pct(g, t, idx[i], i ? idx[i - 1] : -1), 6, 1);
			}
		printf("\n");
	}
	printf("%6s %9s", "all", "");
	for (int t = 0; t < TIER_STATS_NTIERS; t++)
		if (g->capacity[t]) {
			char u[40];
			snprintf(u, sizeof u, "peak %.1f", (double)g->peak[t] / 1048576.0);
			printf("  %16s", u);
			pnum(report_hit_pct(g, t, g->n - 1, -1), 6, 1);
		}
	printf("\n\nLinks: GB/s (1e9 B/s) since the previous row\n%6s %9s", "step", "time s");
	for (int l = 0; l < TIER_STATS_NLINKS; l++)
		if (link_used(g, l))
			printf(" %11.11s", g->link[l]);
	printf("\n");
	for (int i = 0; i <= k; i++) {
		int r = i < k ? idx[i] : g->n - 1, p = i < k ? (i ? idx[i - 1] : -1) : -1;
		if (i < k)
			printf("%6d %9.2f", g->rows[r].step, g->rows[r].time_s);
		else
			printf("%6s %9s", "all", "");
		for (int l = 0; l < TIER_STATS_NLINKS; l++)
			if (link_used(g, l))
				pnum(gbps(g, l, r, p), 11, 3);
		printf("\n");
	}
	printf("\nPrefetch: %llu issued; needs on time %llu, late %llu, missed %llu: ", (unsigned long long)z->issued,
	       (unsigned long long)z->on_time, (unsigned long long)z->late, (unsigned long long)z->missed);
	if (isnan(s.ontime))
		printf("on time -");
	else
		printf("on time %.1f%%", s.ontime);
	printf("; callers stalled %.1f ms\n", s.stall_ms);
	printf("\nExperts: tokens over the run per MoE layer (skew: the hottest expert's tokens / the mean)\n");
	if (!g->nmoe)
		printf("  (no MoE layer in the log)\n");
	int *order = malloc(sizeof *order * (size_t)(g->experts ? g->experts : 1));
	for (int i = 0; i < g->nmoe && order; i++) {
		top_experts(g, i, order);
		printf("  layer %3d  skew", g->layer[i]);
		pnum(skew(g, i), 5, 2);
		printf("  top:");
		for (int e = 0; e < TOP && e < g->experts; e++)
			printf(" %d:%lld", order[e], (long long)g->tokens[(size_t)i * g->experts + order[e]]);
		printf("\n");
	}
	free(order);
}

/* ---- JSON -------------------------------------------------------------------------------------- */

static json_t *jnum(double v) { return isnan(v) || isinf(v) ? json_null() : json_real(v); }

static json_t *build_json(const report_log *g, const char *dir)
{
	summary s = summarise(g);
	int idx[SAMPLES], k = samples(g, idx);
	const report_row *z = &g->rows[g->n - 1];
	json_t *o = json_object(), *tiers = json_array(), *links = json_array(), *layers = json_array();
	json_object_set_new(o, "v", json_integer(1));
	json_object_set_new(o, "run", json_string(dir));
	json_object_set_new(o, "summary", json_pack("{s:i,s:i,s:i,s:o,s:I,s:o,s:o,s:o}", "steps", g->n, "first_step",
						    g->rows[0].step, "last_step", z->step, "time_s", jnum(s.time_s),
						    "tokens", (json_int_t)s.tokens, "tokens_per_s",
						    jnum(s.tokens_per_s), "loss_first", jnum(s.loss_first),
						    "loss_last", jnum(s.loss_last)));
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		if (!g->capacity[t])
			continue;
		json_t *sm = json_array();
		for (int i = 0; i < k; i++)
			json_array_append_new(sm, json_pack("{s:i,s:o,s:I,s:o}", "step", g->rows[idx[i]].step, "time_s",
							    jnum(g->rows[idx[i]].time_s), "used",
							    (json_int_t)g->rows[idx[i]].used[t], "hit_pct",
							    jnum(report_hit_pct(g, t, idx[i], i ? idx[i - 1] : -1))));
		json_array_append_new(tiers, json_pack("{s:s,s:I,s:I,s:I,s:I,s:o,s:o}", "name", g->tier[t], "capacity",
						       (json_int_t)g->capacity[t], "peak", (json_int_t)g->peak[t], "hits",
						       (json_int_t)z->hits[t], "misses", (json_int_t)z->misses[t],
						       "hit_pct", jnum(report_hit_pct(g, t, g->n - 1, -1)), "samples", sm));
	}
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		json_t *sm = json_array();
		for (int i = 0; i < k; i++)
			json_array_append_new(sm, json_pack("{s:i,s:o}", "step", g->rows[idx[i]].step, "gbps",
							    jnum(gbps(g, l, idx[i], i ? idx[i - 1] : -1))));
		json_array_append_new(links, json_pack("{s:s,s:I,s:I,s:o,s:o}", "name", g->link[l], "bytes",
						       (json_int_t)z->bytes[l], "busy_ns", (json_int_t)z->busy_ns[l],
						       "gbps", jnum(gbps(g, l, g->n - 1, -1)), "samples", sm));
	}
	json_object_set_new(o, "tiers", tiers);
	json_object_set_new(o, "links", links);
	json_object_set_new(o, "prefetch", json_pack("{s:I,s:I,s:I,s:I,s:o,s:o}", "issued", (json_int_t)z->issued,
						     "on_time", (json_int_t)z->on_time, "late", (json_int_t)z->late,
						     "missed", (json_int_t)z->missed, "on_time_pct", jnum(s.ontime),
						     "stall_ms", jnum(s.stall_ms)));
	int *order = malloc(sizeof *order * (size_t)(g->experts ? g->experts : 1));
	for (int i = 0; i < g->nmoe && order; i++) {
		json_t *top = json_array(), *all = json_array();
		top_experts(g, i, order);
		for (int e = 0; e < g->experts; e++)
			json_array_append_new(all, json_integer(g->tokens[(size_t)i * g->experts + e]));
		for (int e = 0; e < TOP && e < g->experts; e++)
			json_array_append_new(top, json_pack("{s:i,s:I}", "expert", order[e], "tokens",
							     (json_int_t)g->tokens[(size_t)i * g->experts + order[e]]));
		json_array_append_new(layers, json_pack("{s:i,s:o,s:o,s:o}", "layer", g->layer[i], "skew",
							jnum(skew(g, i)), "top", top, "tokens", all));
	}
	free(order);
	json_object_set_new(o, "layers", layers);
	return o;
}

#endif /* TIER_HAVE_JANSSON */

int report_main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "json", no_argument, NULL, 'j' }, { "plot", required_argument, NULL, 'o' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	const char *plot = NULL;
	int json = 0, c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "jo:h", opts, NULL)) != -1) {
		switch (c) {
		case 'j': json = 1; break;
		case 'o': plot = optarg; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 1;
		}
	}
	if (optind + 1 != argc) {
		fprintf(stderr, "tier-stat report: give one run directory (see tier-stat report --help)\n");
		return 1;
	}
	const char *dir = argv[optind];
	if (plot) {
		size_t n = strlen(plot);
		if (n < 5 || (strcmp(plot + n - 4, ".png") && strcmp(plot + n - 4, ".svg"))) {
			fprintf(stderr, "tier-stat report: --plot %s: the file name must end in .png or .svg\n", plot);
			return 1;
		}
#ifndef TIER_HAVE_CAIRO
		fprintf(stderr, "tier-stat report: --plot: this tier-stat was built without cairo; install libcairo2-dev "
			"(Debian/Ubuntu) or cairo-devel, then rerun configure and make\n");
		return REPORT_NOPLOT;
#endif
	}
#ifdef TIER_HAVE_JANSSON
	char path[4200];
	report_log g;
	int rc = log_load(dir, &g, path, sizeof path);
	if (!rc) {
		if (json) {
			json_t *o = build_json(&g, dir);
			json_dumpf(o, stdout, JSON_COMPACT | JSON_REAL_PRECISION(6));
			printf("\n");
			json_decref(o);
		} else {
			print_text(&g, dir);
		}
		fflush(stdout);
		if (plot)
			rc = report_plot(&g, dir, plot);
	}
	log_free(&g);
	return rc;
#else
	(void)json, (void)dir;
	fprintf(stderr, "tier-stat report: this tier-stat was built without jansson, which reading the stats log "
		"needs; install libjansson-dev, then rerun configure and make\n");
	return REPORT_BADLOG;
#endif
}
