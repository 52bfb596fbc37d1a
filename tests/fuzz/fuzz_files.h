/* fuzz_files.h - scratch files for the fuzz targets whose loaders take paths (config.json, a
 * checkpoint's index, a PEFT adapter directory): one directory per process, made on first use and
 * removed with what was written into it at exit. Header-only: each target is one program. */
#ifndef TIER_FUZZ_FILES_H
#define TIER_FUZZ_FILES_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tier/base.h"

#define FZ_MAX_FILES 8
static char fz_dir[256];
static char fz_names[FZ_MAX_FILES][64];
static int fz_n;

static const char *fz_path(const char *name);

static void fz_cleanup(void)
{
	for (int i = 0; i < fz_n; i++)
		unlink(fz_path(fz_names[i]));
	rmdir(fz_dir);
}

/* The scratch directory (made on first call; exits on failure: no target can run without it). */
static const char *fz_dirname(void)
{
	if (!fz_dir[0]) {
		const char *tmp = getenv("TMPDIR");
		if (!tmp || !*tmp || strlen(tmp) > 200)
			tmp = "/tmp";
		snprintf(fz_dir, sizeof fz_dir, "%s/tier-fuzz-XXXXXX", tmp);
		if (!mkdtemp(fz_dir)) {
			perror("fuzz: mkdtemp");
			exit(2);
		}
		atexit(fz_cleanup);
	}
	return fz_dir;
}

/* Path of `name` in the scratch directory (a static buffer per slot: name's slot). */
static const char *fz_path(const char *name)
{
	static char paths[FZ_MAX_FILES][sizeof fz_dir + sizeof fz_names[0] + 1];
	int i = 0;
	while (i < fz_n && strcmp(fz_names[i], name))
		i++;
	if (i == fz_n) {
		if (fz_n == FZ_MAX_FILES || strlen(name) >= sizeof fz_names[0]) {
			fprintf(stderr, "fuzz: more than %d scratch files, or a name over 63 bytes\n", FZ_MAX_FILES);
			exit(2);
		}
		snprintf(fz_names[fz_n++], sizeof fz_names[0], "%s", name);
	}
	snprintf(paths[i], sizeof paths[i], "%s/%s", fz_dirname(), name);
	return paths[i];
}

/* A loader's verdict: 1 when it refused (trapping unless it left nothing behind, out NULL, and said
 * why in tier_last_error), 0 when it accepted. */
static inline int fz_refused(int rc, const void *out)
{
	if (rc == 0)
		return 0;
	if (out || tier_last_error()[0] == '\0')
		__builtin_trap();
	return 1;
}

/* Replace file `name` with n bytes of data (exits when the disk refuses: not the input's fault). */
static void fz_write(const char *name, const void *data, size_t n)
{
	const char *p = fz_path(name);
	FILE *f = fopen(p, "wb");
	if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f)) {
		perror(p);
		exit(2);
	}
}
#endif
