/* stats_log.c - tier-run's stats log: the store snapshot, loss, throughput and the router's
 * per-expert token counts of every step, as JSON lines (format: docs/stats-log.md). Written with
 * stdio so that it needs no JSON library. */
#include "config.h"
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "stats_log.h"

struct stats_log {
	FILE *f;
	char path[4200];
	uint64_t t0;       /* tier_now_ns at open: "time_s" counts from here */
	int64_t *counts;   /* [experts] */
	int64_t layers, experts;
};

static void put_str(FILE *f, const char *s)
{
	fputc('"', f);
	for (; s && *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20)
			fprintf(f, "\\u%04x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

#define U(x) ((unsigned long long)(x))

static int write_run_json(const char *dir, const stats_log_info *in)
{
	char path[4200], when[64];
	time_t now = time(NULL);
	struct tm tm;
	strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
	snprintf(path, sizeof path, "%s/run.json", dir);
	FILE *f = fopen(path, "w");
	if (!f)
		return fprintf(stderr, "tier-run: %s: %s\n", path, strerror(errno)), 1;
	fprintf(f, "{\"v\":%d,\"pid\":%ld,\"start_time\":%lld,\"start_utc\":\"%s\",\"model\":{\"name\":", STATS_LOG_VERSION,
		(long)getpid(), (long long)now, when);
	put_str(f, in->model);
	fprintf(f, ",\"layers\":%lld,\"hidden\":%lld,\"experts\":%lld,\"top_k\":%lld,\"base_bytes\":%llu},"
		"\"budgets\":{\"hbm\":%llu,\"ddr\":%llu,\"nvme\":%llu},\"policy\":", (long long)in->layers,
		(long long)in->hidden, (long long)in->experts, (long long)in->top_k, U(in->base_bytes), U(in->hbm),
		U(in->ddr), U(in->nvme));
	put_str(f, in->policy);
	fprintf(f, ",\"data\":");
	put_str(f, in->data);
	fprintf(f, ",\"lora\":{\"r\":%d,\"targets\":", in->lora_r);
	put_str(f, in->lora_targets);
	fprintf(f, "},\"steps\":%d,\"batch\":%d,\"seq\":%d,\"micro_batches\":%d,\"seed\":%llu}\n", in->steps, in->batch,
		in->seq, in->micro, U(in->seed));
	if (fclose(f))
		return fprintf(stderr, "tier-run: %s: %s\n", path, strerror(errno)), 1;
	return 0;
}

int stats_log_open(stats_log **out, const char *dir, const stats_log_info *info)
{
	char path[4200];
	*out = NULL;
	stats_log *l = calloc(1, sizeof *l);
	if (!l || !(l->counts = calloc((size_t)(info->experts > 0 ? info->experts : 1), sizeof *l->counts))) {
		free(l);
		return fprintf(stderr, "tier-run: out of memory for the stats log\n"), 1;
	}
	l->layers = info->layers, l->experts = info->experts, l->t0 = tier_now_ns();
	snprintf(path, sizeof path, "%s/tier.pid", dir);
	FILE *f = fopen(path, "w");
	if (!f || fprintf(f, "%ld\n", (long)getpid()) < 0 || fclose(f)) {
		fprintf(stderr, "tier-run: %s: %s\n", path, strerror(errno));
		return stats_log_close(l), 1;
	}
	if (write_run_json(dir, info))
		return stats_log_close(l), 1;
	snprintf(l->path, sizeof l->path, "%s/stats.jsonl", dir);
	if (!(l->f = fopen(l->path, "w"))) {
		fprintf(stderr, "tier-run: %s: %s\n", l->path, strerror(errno));
		return stats_log_close(l), 1;
	}
	*out = l;
	return 0;
}

static void put_store(FILE *f, const tier_stats *s)
{
	fprintf(f, "\"store\":{\"step\":%llu,\"uptime_s\":%.6f,\"hbm_emulated\":%s,\"tiers\":[", U(s->step),
		(double)(s->update_ns - s->start_ns) / 1e9, s->hbm_emulated ? "true" : "false");
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		const tier_stats_tier *x = &s->tier[t];
		fprintf(f, "%s{\"name\":", t ? "," : "");
		put_str(f, s->tier_name[t]);
		fprintf(f, ",\"capacity\":%llu,\"used\":%llu,\"peak\":%llu,\"classes\":[", U(x->capacity), U(x->used),
			U(x->peak));
		for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
			const tier_stats_class *k = &s->cls[t][c];
			fprintf(f, "%s{\"name\":", c ? "," : "");
			put_str(f, s->class_name[c]);
			fprintf(f, ",\"hits\":%llu,\"misses\":%llu,\"evictions\":%llu,\"bytes_in\":%llu,\"unused_prefetches\":%llu}",
				U(k->hits), U(k->misses), U(k->evictions), U(k->bytes_in), U(k->unused));
		}
		fputs("]}", f);
	}
	fputs("],\"links\":[", f);
	for (int i = 0; i < TIER_STATS_NLINKS; i++) {
		const tier_stats_link *k = &s->link[i];
		fprintf(f, "%s{\"name\":", i ? "," : "");
		put_str(f, s->link_name[i]);
		fprintf(f, ",\"bytes\":%llu,\"transfers\":%llu,\"busy_ns\":%llu}", U(k->bytes), U(k->transfers),
			U(k->busy_ns));
	}
	const tier_stats_prefetch *p = &s->prefetch;
	fprintf(f, "],\"prefetch\":{\"issued\":%llu,\"on_time\":%llu,\"late\":%llu,\"missed\":%llu,\"stall_ns\":%llu,"
		"\"wasted\":%llu}}", U(p->issued), U(p->on_time), U(p->late), U(p->missed), U(p->stall_ns), U(p->wasted));
}

int stats_log_step(stats_log *l, int step, const tier_step_result *r, const tier_stats *st, const tier_trainer *t)
{
	FILE *f = l->f;
	double secs = (double)r->ns / 1e9;
	fprintf(f, "{\"v\":%d,\"step\":%d,\"time_s\":%.6f,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"tokens\":%lld,"
		"\"step_ns\":%llu,\"tokens_per_s\":%.3f,", STATS_LOG_VERSION, step, (double)(tier_now_ns() - l->t0) / 1e9,
		r->loss, r->lr, r->grad_norm, (long long)r->tokens, U(r->ns), secs > 0 ? (double)r->tokens / secs : 0.0);
	put_store(f, st);
	fputs(",\"experts\":[", f);
	int first = 1;
	for (int64_t ly = 0; ly < l->layers; ly++) {
		if (tier_trainer_expert_counts(t, (int)ly, l->counts)) /* a dense layer: no experts */
			continue;
		fprintf(f, "%s{\"layer\":%lld,\"tokens\":[", first ? "" : ",", (long long)ly);
		for (int64_t e = 0; e < l->experts; e++)
			fprintf(f, "%s%lld", e ? "," : "", (long long)l->counts[e]);
		fputs("]}", f);
		first = 0;
	}
	fputs("]}\n", f);
	if (fflush(f) || ferror(f))
		return fprintf(stderr, "tier-run: %s: %s\n", l->path, strerror(errno)), 1;
	return 0;
}

void stats_log_close(stats_log *l)
{
	if (!l)
		return;
	if (l->f)
		fclose(l->f);
	free(l->counts);
	free(l);
}
