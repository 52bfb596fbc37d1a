/* fuzz_main.c - standalone driver for the fuzz targets: replays files or directories (default: the
 * target's committed seed corpus, tests/fuzz/FUZZ_CORPUS) so that each target builds with any
 * compiler and runs in make check. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern const char fuzz_corpus[]; /* the target's seed corpus directory under tests/fuzz */
extern int fuzz_accepted;        /* set by the target when the parser accepted the input */

static int run_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "cannot open %s\n", path);
		return 1;
	}
	size_t cap = 1 << 16, n = 0, r;
	uint8_t *buf = malloc(cap);
	while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
		n += r;
		if (n == cap) {
			uint8_t *b = realloc(buf, cap *= 2);
			if (!b) {
				free(buf);
				buf = NULL;
			}
			buf = b;
		}
	}
	fclose(f);
	if (!buf)
		return 1;
	fuzz_accepted = 0;
	LLVMFuzzerTestOneInput(buf, n);
	free(buf);
	/* seeds named ok_* must be accepted and bad_* refused: the replay checks the parser's verdicts,
	 * not only that it survives */
	const char *base = strrchr(path, '/');
	base = base ? base + 1 : path;
	int want = !strncmp(base, "ok_", 3) ? 1 : !strncmp(base, "bad_", 4) ? 0 : -1;
	if (want >= 0 && want != fuzz_accepted) {
		fprintf(stderr, "%s: %s\n", path, want ? "refused, expected to be accepted" : "accepted, expected a refusal");
		return 1;
	}
	return 0;
}

static int run_path(const char *path, int *count)
{
	struct stat sb;
	if (stat(path, &sb) < 0) {
		fprintf(stderr, "cannot stat %s\n", path);
		return 1;
	}
	if (!S_ISDIR(sb.st_mode)) {
		(*count)++;
		return run_file(path);
	}
	DIR *d = opendir(path);
	struct dirent *e;
	int bad = 0;
	while (d && (e = readdir(d))) {
		char p[4096];
		if (e->d_name[0] == '.')
			continue;
		snprintf(p, sizeof p, "%s/%s", path, e->d_name);
		bad |= run_path(p, count);
	}
	if (d)
		closedir(d);
	return bad;
}

int main(int argc, char **argv)
{
	char def[4096];
	const char *src = getenv("TIER_TEST_SRCDIR");
	int count = 0, bad = 0;
	if (argc < 2) {
		snprintf(def, sizeof def, "%s/tests/fuzz/%s", src ? src : ".", fuzz_corpus);
		bad = run_path(def, &count);
	}
	for (int i = 1; i < argc; i++)
		bad |= run_path(argv[i], &count);
	printf("# replayed %d inputs\n", count);
	return bad || count == 0;
}
