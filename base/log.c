/* log.c - the one logging function: levels, a replaceable sink, stderr by default. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"

static tier_log_level log_level = TIER_LOG_WARN;
static int level_from_env_done;
static tier_log_sink log_sink;
static void *log_sink_arg;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static void level_from_env(void)
{
	static const char *names[] = { "error", "warn", "info", "debug" };
	const char *e = getenv("TIER_LOG");
	if (!level_from_env_done && e)
		for (int i = 0; i < 4; i++)
			if (!strcmp(e, names[i]))
				log_level = (tier_log_level)i;
	level_from_env_done = 1;
}

void tier_log_set_level(tier_log_level level)
{
	pthread_once(&env_once, level_from_env);
	log_level = level;
}

tier_log_level tier_log_get_level(void)
{
	pthread_once(&env_once, level_from_env);
	return log_level;
}

void tier_log_set_sink(tier_log_sink sink, void *arg)
{
	log_sink = sink;
	log_sink_arg = arg;
}

void tier_log(tier_log_level level, const char *fmt, ...)
{
	static const char *tags[] = { "error", "warning", "info", "debug" };
	char msg[1024];
	va_list ap;
	if (level > tier_log_get_level())
		return;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	pthread_mutex_lock(&log_lock);
	if (log_sink)
		log_sink(level, msg, log_sink_arg);
	else
		fprintf(stderr, "tier: %s: %s\n", tags[level], msg);
	pthread_mutex_unlock(&log_lock);
}
