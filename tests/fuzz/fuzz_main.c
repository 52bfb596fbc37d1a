/* fuzz_main.c - standalone driver for the fuzz targets: replays files or directories (default: the
 * committed seed corpus) so that the target builds with any compiler and runs in make check. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

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
	LLVMFuzzerTestOneInput(buf, n);
	free(buf);
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
		snprintf(def, sizeof def, "%s/tests/fuzz/corpus_safetensors", src ? src : ".");
		bad = run_path(def, &count);
	}
	for (int i = 1; i < argc; i++)
		bad |= run_path(argv[i], &count);
	printf("# replayed %d inputs\n", count);
	return bad || count == 0;
}
