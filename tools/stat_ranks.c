/* stat_ranks.c - (tier-stat) the processes watched: the rank list from -p or from a run
 * directory's pid files (conventions: docs/stats-log.md). */
#include "config.h"
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "stat_ranks.h"

/* Append rank `rank` of process `pid`. Returns 0, or EXIT_USAGE (a pid or rank twice) or
 * EXIT_OTHER (no memory) with a message; the list is unchanged then. */
static int ranks_add(rank_list *l, int rank, pid_t pid, const char *from)
{
	for (int i = 0; i < l->n; i++) {
		int same_rank = l->r[i].rank == rank;
		if (same_rank || l->r[i].pid == pid) {
			fprintf(stderr, "tier-stat: %s: %s %ld given twice\n", from, same_rank ? "rank" : "pid",
				same_rank ? (long)rank : (long)pid);
			return EXIT_USAGE;
		}
	}
	if (l->n == l->cap) {
		int cap = l->cap ? 2 * l->cap : 8;
		stat_rank *r = realloc(l->r, (size_t)cap * sizeof *r);
		if (!r)
			return fprintf(stderr, "tier-stat: out of memory\n"), EXIT_OTHER;
		l->r = r, l->cap = cap;
	}
	memset(&l->r[l->n], 0, sizeof *l->r);
	l->r[l->n].rank = rank;
	l->r[l->n++].pid = pid;
	return 0;
}

static int rank_cmp(const void *a, const void *b)
{
	const stat_rank *x = a, *y = b;
	return (x->rank > y->rank) - (x->rank < y->rank);
}

/* Parse a decimal number in [lo, hi] that is all of s. Returns 0 or -EINVAL. */
static int parse_long(const char *s, long lo, long hi, long *v)
{
	char *end;
	if (*s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	*v = strtol(s, &end, 10);
	return *end || errno || *v < lo || *v > hi ? -EINVAL : 0;
}

/* -p PID[,PID...]: rank i is the i-th pid over all -p options. */
int ranks_of_pids(rank_list *l, const char *arg)
{
	size_t k = strlen(arg);
	char *buf, *tok, *save = NULL;
	long v;
	int rc = 0;
	if (!k || arg[0] == ',' || arg[k - 1] == ',' || strstr(arg, ",,")) {
		fprintf(stderr, "tier-stat: -p needs process ids separated by commas, not '%s'\n", arg);
		return EXIT_USAGE;
	}
	if (!(buf = strdup(arg)))
		return fprintf(stderr, "tier-stat: out of memory\n"), EXIT_OTHER;
	for (tok = strtok_r(buf, ",", &save); tok && !rc; tok = strtok_r(NULL, ",", &save)) {
		if (parse_long(tok, 1, 0x7fffffff, &v)) {
			fprintf(stderr, "tier-stat: -p needs a process id, not '%s'\n", tok);
			rc = EXIT_USAGE;
		} else {
			rc = ranks_add(l, l->n, (pid_t)v, "-p");
		}
	}
	free(buf);
	return rc;
}

/* Read the pid in file `path`. Returns 0, or an exit code with a message. */
static int read_pid_file(const char *path, pid_t *pid)
{
	long v;
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "tier-stat: %s: %s\n", path, strerror(errno));
		return EXIT_NOPROC;
	}
	int ok = fscanf(f, "%ld", &v) == 1 && v > 0 && v <= 0x7fffffff;
	fclose(f);
	if (!ok) {
		fprintf(stderr, "tier-stat: %s does not hold a process id\n", path);
		return EXIT_USAGE;
	}
	*pid = (pid_t)v;
	return 0;
}

/* The rank a directory entry of a run directory names, or -1: "tier.N.pid", or "rankN" holding a
 * tier.pid. N is decimal without a sign or leading zeros. */
static int rank_of_entry(const char *dir, const char *name, char *path, size_t len)
{
	char num[16];
	size_t k = strlen(name);
	long v;
	struct stat st;
	if (k > 9 && !strncmp(name, "tier.", 5) && !strcmp(name + k - 4, ".pid") && k - 9 < sizeof num) {
		memcpy(num, name + 5, k - 9);
		num[k - 9] = 0;
		snprintf(path, len, "%s/%s", dir, name);
	} else if (k > 4 && !strncmp(name, "rank", 4) && k - 4 < sizeof num) {
		snprintf(num, sizeof num, "%s", name + 4);
		snprintf(path, len, "%s/%s/tier.pid", dir, name);
		if (stat(path, &st) != 0)
			return -1;
	} else {
		return -1;
	}
	if ((num[0] == '0' && num[1]) || parse_long(num, 0, 1 << 20, &v))
		return -1;
	return (int)v;
}

/* --run DIR: the ranks of a run directory (the convention is in --help, the man page and
 * docs/stats-log.md). Returns 0, or an exit code with a message. */
int ranks_of_run(rank_list *l, const char *dir)
{
	char path[4352], p0[4352];
	struct dirent *e;
	pid_t pid;
	int rc = 0, rank0 = 0;
	DIR *d = opendir(dir);
	if (!d) {
		fprintf(stderr, "tier-stat: --run %s: %s\n", dir, strerror(errno));
		return EXIT_NOPROC;
	}
	while (!rc && (e = readdir(d)) != NULL) {
		int rank = rank_of_entry(dir, e->d_name, path, sizeof path);
		if (rank < 0)
			continue;
		if (!(rc = read_pid_file(path, &pid)))
			rc = ranks_add(l, rank, pid, path);
		rank0 |= rank == 0;
	}
	closedir(d);
	snprintf(p0, sizeof p0, "%s/tier.pid", dir);
	if (!rc && !rank0 && access(p0, F_OK) == 0 && !(rc = read_pid_file(p0, &pid)))
		rc = ranks_add(l, 0, pid, p0);
	if (!rc && !l->n) {
		fprintf(stderr, "tier-stat: %s: no tier.pid, tier.N.pid or rankN/tier.pid: this run has no live job "
			"to watch (for a finished run: tier-stat report %s)\n", dir, dir);
		rc = EXIT_NOPROC;
	}
	if (!rc)
		qsort(l->r, (size_t)l->n, sizeof *l->r, rank_cmp);
	return rc;
}

