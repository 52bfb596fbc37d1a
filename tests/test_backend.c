/* test_backend.c - the memory behind each tier: reservations, exact accounting, budgets against
 * the machine, NVMe directories that are missing, wrong, read-only, full or without O_DIRECT. */
#include "config.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif
#include "tier/tier.h"
#include "tier/backend.h"
#include "tier/backend_nvme.h"
#include "tier/meta_alloc.h"

/* ---- helpers ----------------------------------------------------------------------------------- */

static char logged[4096];   /* the warnings and errors logged since the last log_reset() */

static void log_sink(tier_log_level level, const char *msg, void *arg)
{
	(void)arg;
	if (level <= TIER_LOG_WARN && strlen(logged) + strlen(msg) + 2 < sizeof logged) {
		strcat(logged, msg);
		strcat(logged, "\n");
	}
}

static void log_reset(void) { logged[0] = '\0'; }

static uint64_t test_seed(void)
{
	static uint64_t seed;
	if (!seed) {
		seed = tier_now_ns();
		printf("# seed %llu\n", (unsigned long long)seed);
	}
	return seed++;
}

/* A fresh temporary directory with `n` subdirectories d0, d1, ... (paths written into sub). */
typedef struct {
	char root[256];
	char sub[4][300];
	const char *dirs[4];
} tmpdirs;

static void tmp_make(tmpdirs *t, unsigned n)
{
	snprintf(t->root, sizeof t->root, "%s/tier-test-backend.XXXXXX", P_tmpdir);
	assert_non_null(mkdtemp(t->root));
	for (unsigned i = 0; i < n; i++) {
		snprintf(t->sub[i], sizeof t->sub[i], "%s/d%u", t->root, i);
		assert_int_equal(mkdir(t->sub[i], 0700), 0);
		t->dirs[i] = t->sub[i];
	}
}

static unsigned dir_entries(const char *dir)
{
	unsigned n = 0;
	DIR *d = opendir(dir);
	struct dirent *e;
	assert_non_null(d);
	while ((e = readdir(d)))
		n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
	closedir(d);
	return n;
}

static void tmp_remove(tmpdirs *t, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		chmod(t->sub[i], 0700);
		assert_int_equal(dir_entries(t->sub[i]), 0);  /* no file left behind */
		assert_int_equal(rmdir(t->sub[i]), 0);
	}
	assert_int_equal(rmdir(t->root), 0);
}

static tier_offload *offload_new(void)
{
	tier_offload *off;
	/* valgrind 3.19 does not model io_uring (completions never arrive): worker threads there. */
	tier_offload_config oc = { .no_uring = RUNNING_ON_VALGRIND };
	assert_int_equal(tier_offload_create(&off, &oc), 0);
	return off;
}

/* Random allocations and frees against a running sum of rounded sizes; extents must not overlap
 * (for memory tiers each extent is filled with its own pattern and checked at the end). */
static void exercise(tier_backend *b, uint64_t align, uint64_t max_size)
{
	enum { N = 64 };
	tier_extent ext[N];
	uint64_t sizes[N], seeds[N], used = 0;
	int live[N] = { 0 };
	tier_rng rng;
	tier_rng_seed(&rng, test_seed());
	for (int op = 0; op < 600; op++) {
		int k = (int)tier_rng_below(&rng, N);
		if (live[k]) {
			if (ext[k].loc.kind != TIER_MEM_FILE)
				assert_int_equal(tier_pattern_check(ext[k].loc.ptr, sizes[k], seeds[k], 0), sizes[k]);
			backend_free(b, &ext[k]);
			used -= ext[k].bytes;
			live[k] = 0;
		} else {
			tier_extent e;
			int rc;
			sizes[k] = 1 + tier_rng_below(&rng, max_size);
			memset(&e, 0x5A, sizeof e);
			rc = backend_alloc(b, sizes[k], &e);
			if (rc == -ENOSPC) {
				tier_extent poison;
				memset(&poison, 0x5A, sizeof poison);
				assert_memory_equal(&e, &poison, sizeof e);  /* untouched */
				continue;
			}
			assert_int_equal(rc, 0);
			assert_true(e.bytes == tier_align_up(sizes[k], align));
			assert_true(e.bytes == backend_rounded(b, sizes[k]));
			assert_true(e.offset % align == 0 && e.offset + e.bytes <= backend_capacity(b));
			if (e.loc.kind != TIER_MEM_FILE) {
				assert_true((uintptr_t)e.loc.ptr % align == 0);
				seeds[k] = tier_rng_next(&rng);
				tier_pattern_fill(e.loc.ptr, sizes[k], seeds[k], 0);
			}
			ext[k] = e;
			used += e.bytes;
			live[k] = 1;
		}
		assert_true(backend_used(b) == used);
		assert_int_equal(backend_check(b), 0);
	}
	for (int k = 0; k < N; k++) {
		if (!live[k])
			continue;
		if (ext[k].loc.kind != TIER_MEM_FILE)
			assert_int_equal(tier_pattern_check(ext[k].loc.ptr, sizes[k], seeds[k], 0), sizes[k]);
		backend_free(b, &ext[k]);
	}
	assert_true(backend_used(b) == 0);
	assert_true(backend_largest_free(b) > 0);
	assert_int_equal(backend_check(b), 0);
}

/* ---- HBM and DDR ------------------------------------------------------------------------------- */

static void test_hbm_emulated(void **state)
{
	tier_dev *dev;
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_HBM, .capacity = (64ull << 20) + 123 };
	tier_extent e;
	(void)state;
	assert_int_equal(tier_dev_open(&dev, TIER_DEV_CPU, 0), 0);
	for (int with_dev = 0; with_dev < 2; with_dev++) {
		cfg.dev = with_dev ? dev : NULL;
		assert_int_equal(backend_create(&b, &cfg), 0);
		assert_int_equal(backend_emulated(b), 1);
		assert_true(backend_capacity(b) == 64ull << 20);  /* rounded down to 4 KiB */
		assert_true(backend_largest_free(b) == 64ull << 20);
		assert_int_equal(backend_alloc(b, 1, &e), 0);
		assert_int_equal(e.loc.kind, TIER_MEM_DEVICE);   /* named as HBM for the movers */
		assert_true(e.bytes == 4096);
		backend_free(b, &e);
		exercise(b, 4096, 1u << 20);
		backend_destroy(b);
	}
	tier_dev_close(dev);
}

static void test_ddr(void **state)
{
	tier_dev *dev;
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_DDR, .capacity = (48ull << 20) + 4095 };
	tier_extent e;
	(void)state;
	assert_int_equal(tier_dev_open(&dev, TIER_DEV_CPU, 0), 0);
	cfg.dev = dev;
	assert_int_equal(backend_create(&b, &cfg), 0);
	assert_int_equal(backend_emulated(b), 0);
	assert_int_equal(backend_pinned(b), 0);             /* no CUDA context: nothing to pin for */
#ifdef TIER_HAVE_NUMA
	assert_int_equal(backend_numa_node(b), tier_dev_numa_node(dev));
#else
	assert_int_equal(backend_numa_node(b), -1);
#endif
	assert_true(backend_capacity(b) == 48ull << 20);
	assert_int_equal(backend_alloc(b, 4097, &e), 0);
	assert_int_equal(e.loc.kind, TIER_MEM_HOST);
	assert_true(e.bytes == 8192 && (uintptr_t)e.loc.ptr % 4096 == 0);
	backend_free(b, &e);
	exercise(b, 4096, 1u << 20);
	backend_destroy(b);
	tier_dev_close(dev);
}

/* On a CUDA device: HBM is device memory with 256-byte extents, DDR is pinned. Skipped without. */
static void test_cuda_tiers(void **state)
{
	tier_dev *dev;
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_HBM, .capacity = (32ull << 20) + 1000 };
	tier_extent e[3];
	unsigned char *host, *back;
	(void)state;
	if (!tier_cuda_available()) {
		printf("# no CUDA device: device tiers not tested\n");
		skip();
	}
	assert_int_equal(tier_dev_open(&dev, TIER_DEV_CUDA, 0), 0);
	cfg.dev = dev;
	assert_int_equal(backend_create(&b, &cfg), 0);
	assert_int_equal(backend_emulated(b), 0);
	assert_true(backend_capacity(b) == (32ull << 20) + 768);  /* rounded down to 256 */
	host = malloc(1 << 20);
	back = malloc(1 << 20);
	for (int i = 0; i < 3; i++) {
		assert_int_equal(backend_alloc(b, 1000 + i, &e[i]), 0);
		assert_int_equal(e[i].loc.kind, TIER_MEM_DEVICE);
		assert_true(e[i].bytes == 1024 && (uintptr_t)e[i].loc.ptr % 256 == 0);
		tier_pattern_fill(host, e[i].bytes, 50 + i, 0);
		assert_int_equal(tier_dev_memcpy_h2d(dev, e[i].loc.ptr, host, e[i].bytes), 0);
	}
	for (int i = 0; i < 3; i++) {
		memset(back, 0xEE, e[i].bytes);
		assert_int_equal(tier_dev_memcpy_d2h(dev, back, e[i].loc.ptr, e[i].bytes), 0);
		assert_int_equal(tier_pattern_check(back, e[i].bytes, 50 + i, 0), e[i].bytes);
		backend_free(b, &e[i]);
	}
	backend_destroy(b);
	cfg.capacity = 1ull << 50;
	assert_int_equal(backend_create(&b, &cfg), -E2BIG);
	assert_non_null(strstr(tier_last_error(), "free device memory"));
	/* DDR serving the device: page-locked, on the device's NUMA node when it is known. */
	cfg = (tier_backend_config){ .tier = TIER_DDR, .capacity = 16ull << 20, .dev = dev };
	assert_int_equal(backend_create(&b, &cfg), 0);
	assert_int_equal(backend_pinned(b), 1);
	printf("# ddr on NUMA node %d (device's: %d)\n", backend_numa_node(b), tier_dev_numa_node(dev));
	assert_int_equal(backend_alloc(b, 1 << 20, &e[0]), 0);
	tier_pattern_fill(e[0].loc.ptr, 1 << 20, 7, 0);
	{
		void *d;
		assert_int_equal(tier_dev_malloc(dev, 1 << 20, &d), 0);
		assert_int_equal(tier_dev_memcpy_h2d(dev, d, e[0].loc.ptr, 1 << 20), 0);
		memset(back, 0xEE, 1 << 20);
		assert_int_equal(tier_dev_memcpy_d2h(dev, back, d, 1 << 20), 0);
		assert_int_equal(tier_pattern_check(back, 1 << 20, 7, 0), 1 << 20);
		tier_dev_free(dev, d);
	}
	backend_free(b, &e[0]);
	backend_destroy(b);
	free(host);
	free(back);
	tier_dev_close(dev);
}

static void test_exhaustion_and_bad_alloc(void **state)
{
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_DDR, .capacity = 10 * 4096 };
	tier_extent e[10], keep;
	(void)state;
	assert_int_equal(backend_create(&b, &cfg), 0);
	for (int i = 0; i < 10; i++)
		assert_int_equal(backend_alloc(b, 4000, &e[i]), 0);
	assert_true(backend_used(b) == backend_capacity(b));
	assert_true(backend_largest_free(b) == 0);
	memset(&keep, 0x77, sizeof keep);
	assert_int_equal(backend_alloc(b, 1, &keep), -ENOSPC);
	assert_int_equal(backend_alloc(b, 0, &keep), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "0 bytes"));
	assert_true(keep.bytes == 0x7777777777777777ull);
	/* An extent from elsewhere is refused, leaving the accounting intact. */
	log_reset();
	keep = e[3];
	keep.loc.ptr = (char *)keep.loc.ptr + 4096;
	backend_free(b, &keep);
	assert_non_null(strstr(logged, "does not belong"));
	assert_true(backend_used(b) == backend_capacity(b));
	for (int i = 0; i < 10; i++)
		backend_free(b, &e[i]);
	assert_true(backend_used(b) == 0 && backend_largest_free(b) == 10 * 4096);
	assert_int_equal(backend_check(b), 0);
	backend_destroy(b);
}

static void test_budget_above_machine(void **state)
{
	static const tier_id tiers[2] = { TIER_HBM, TIER_DDR };
	(void)state;
	for (int i = 0; i < 2; i++) {
		const char *flag = tiers[i] == TIER_HBM ? "--hbm" : "--ddr";
		tier_backend_config cfg = { .tier = tiers[i], .capacity = 1ull << 50 };  /* 1 PiB */
		tier_backend *b = (tier_backend *)&cfg;
		tier_extent e;
		assert_int_equal(backend_create(&b, &cfg), -E2BIG);
		assert_null(b);
		printf("# %s\n", tier_last_error());
		assert_non_null(strstr(tier_last_error(), "1.00 PiB"));  /* names the budget */
		assert_non_null(strstr(tier_last_error(), "machine has ("));  /* and what there is */
		assert_non_null(strstr(tier_last_error(), flag));            /* and the way out */
		cfg.clamp = 1;
		log_reset();
		assert_int_equal(backend_create(&b, &cfg), 0);
		assert_non_null(strstr(logged, "clamped to"));
		assert_true(backend_capacity(b) < 1ull << 50 && backend_capacity(b) > 0);
		assert_true(backend_capacity(b) % 4096 == 0);
		assert_int_equal(backend_alloc(b, 12345, &e), 0);
		memset(e.loc.ptr, 1, 12345);
		backend_free(b, &e);
		assert_int_equal(backend_check(b), 0);
		backend_destroy(b);
		/* "max" (tier-run --hbm max): clamped to the machine without a warning */
		cfg.capacity = TIER_BUDGET_MAX;
		log_reset();
		assert_int_equal(backend_create(&b, &cfg), 0);
		assert_null(strstr(logged, "clamped to"));
		assert_true(backend_capacity(b) > 0 && backend_capacity(b) % 4096 == 0);
		backend_destroy(b);
	}
}

static void test_bad_config(void **state)
{
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_DDR, .capacity = 0 };
	(void)state;
	assert_int_equal(backend_create(&b, &cfg), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "--ddr"));
	cfg.capacity = 100;
	assert_int_equal(backend_create(&b, &cfg), -EINVAL);   /* below one page */
	assert_non_null(strstr(tier_last_error(), "4 KiB"));
	cfg.tier = (tier_id)7;
	assert_int_equal(backend_create(&b, &cfg), -EINVAL);
	assert_int_equal(backend_create(&b, NULL), -EINVAL);
	assert_null(b);
	backend_destroy(NULL);
}

/* ---- NVMe -------------------------------------------------------------------------------------- */

/* Write a pattern through the offload engine into the extent and read it back. */
static void nvme_roundtrip(tier_offload *off, const tier_extent *e, uint64_t seed)
{
	void *src, *dst;
	tier_xfer x = { 0 };
	assert_int_equal(posix_memalign(&src, 4096, e->bytes), 0);
	assert_int_equal(posix_memalign(&dst, 4096, e->bytes), 0);
	tier_pattern_fill(src, e->bytes, seed, 0);
	memset(dst, 0xEE, e->bytes);
	x.dst = e->loc;
	x.src = tier_loc_host(src);
	x.len = e->bytes;
	assert_int_equal(tier_offload_copy(off, &x), 0);
	x.dst = tier_loc_host(dst);
	x.src = e->loc;
	assert_int_equal(tier_offload_copy(off, &x), 0);
	assert_int_equal(tier_pattern_check(dst, e->bytes, seed, 0), e->bytes);
	free(src);
	free(dst);
}

static void test_nvme_striped(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = (8ull << 20) + 5000, .n_dirs = 2 };
	tier_extent e[4];
	(void)state;
	tmp_make(&t, 2);
	cfg.dirs = t.dirs;
	cfg.offload = off;
	assert_int_equal(backend_create(&b, &cfg), 0);
	/* Shares: floor(capacity / 2) and the rest, each rounded down to 4 KiB. */
	assert_true(backend_capacity(b) == (4ull << 20) + ((4ull << 20) + 5000) / 4096 * 4096);
	assert_int_equal(nvme_files(backend_nvme(b)), 2);
	assert_int_equal(dir_entries(t.sub[0]) + dir_entries(t.sub[1]), 0);  /* unlinked at once */
	/* Round-robin: consecutive extents alternate between the files. */
	for (int i = 0; i < 4; i++) {
		assert_int_equal(backend_alloc(b, 10000 + i, &e[i]), 0);
		assert_int_equal(e[i].loc.kind, TIER_MEM_FILE);
		assert_true(e[i].bytes == 12288 && e[i].loc.offset % 4096 == 0);
		nvme_roundtrip(off, &e[i], test_seed());
	}
	assert_true(e[0].loc.file != e[1].loc.file && e[0].loc.file == e[2].loc.file);
	assert_true(e[1].offset >= 4ull << 20);  /* the second file's part of the address space */
	for (int i = 0; i < 4; i++)
		backend_free(b, &e[i]);
	exercise(b, 4096, 1u << 20);
	backend_destroy(b);
	tier_offload_destroy(off);
	tmp_remove(&t, 2);
}

static void test_nvme_fills_every_file(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = 3 * 5 * 4096, .n_dirs = 3 };
	tier_extent e[16], poison;
	int n = 0;
	(void)state;
	tmp_make(&t, 3);
	cfg.dirs = t.dirs;
	cfg.offload = off;
	assert_int_equal(backend_create(&b, &cfg), 0);
	/* Mixed sizes: the allocator moves on to the next file when one is full. */
	for (;;) {
		int rc = backend_alloc(b, n % 2 ? 8192 : 4096, &e[n]);
		if (rc == -ENOSPC)
			break;
		assert_int_equal(rc, 0);
		n++;
	}
	while (backend_alloc(b, 4096, &e[n]) == 0)
		n++;
	assert_true(backend_used(b) == backend_capacity(b));
	memset(&poison, 0x33, sizeof poison);
	e[n] = poison;
	assert_int_equal(backend_alloc(b, 1, &e[n]), -ENOSPC);
	assert_memory_equal(&e[n], &poison, sizeof poison);
	for (int i = 0; i < n; i++)
		backend_free(b, &e[i]);
	assert_true(backend_used(b) == 0 && backend_largest_free(b) == 5 * 4096);
	assert_int_equal(backend_check(b), 0);
	backend_destroy(b);
	tier_offload_destroy(off);
	tmp_remove(&t, 3);
}

/* Create must fail with `code` and a message holding `what` and the directory; nothing is left
 * behind, and a good create works right after. */
static void expect_nvme_failure(tier_offload *off, const char *dir, uint64_t capacity, unsigned n_dirs,
				int code, const char *what)
{
	const char *dirs[2] = { dir, dir };
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = capacity, .dirs = dirs, .n_dirs = n_dirs,
				    .offload = off };
	tier_backend *b = (tier_backend *)&cfg;
	tmpdirs good;
	assert_int_equal(backend_create(&b, &cfg), code);
	assert_null(b);
	printf("# %s\n", tier_last_error());
	assert_non_null(strstr(tier_last_error(), what));
	if (code != -EINVAL)
		assert_non_null(strstr(tier_last_error(), dir));
	tmp_make(&good, 1);
	cfg.dirs = good.dirs;
	cfg.n_dirs = 1;
	cfg.capacity = 1 << 20;
	assert_int_equal(backend_create(&b, &cfg), 0);
	backend_destroy(b);
	tmp_remove(&good, 1);
}

static void test_nvme_bad_directories(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	char missing[400], file[400], under_file[450];
	int fd;
	(void)state;
	tmp_make(&t, 1);
	snprintf(missing, sizeof missing, "%s/no-such-dir", t.root);
	snprintf(file, sizeof file, "%s/plain-file", t.root);
	snprintf(under_file, sizeof under_file, "%s/sub", file);
	fd = open(file, O_CREAT | O_WRONLY, 0600);
	assert_true(fd >= 0);
	close(fd);
	expect_nvme_failure(off, missing, 1 << 20, 1, -ENOENT, "mkdir -p");
	expect_nvme_failure(off, file, 1 << 20, 1, -ENOTDIR, "is not a directory");
	expect_nvme_failure(off, under_file, 1 << 20, 1, -ENOTDIR, "not a directory");
	expect_nvme_failure(off, "", 1 << 20, 1, -EINVAL, "empty");
	expect_nvme_failure(off, t.sub[0], 4096, 2, -EINVAL, "too small");
	assert_int_equal(dir_entries(t.sub[0]), 0);
	unlink(file);
	tier_offload_destroy(off);
	tmp_remove(&t, 1);
}

static void test_nvme_bad_config(void **state)
{
	tier_backend *b;
	tier_offload *off = offload_new();
	const char *dirs[1] = { P_tmpdir };
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = 1 << 20, .dirs = dirs, .n_dirs = 0,
				    .offload = off };
	(void)state;
	assert_int_equal(backend_create(&b, &cfg), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "--nvme DIR:SIZE"));
	cfg.n_dirs = 1;
	cfg.offload = NULL;
	assert_int_equal(backend_create(&b, &cfg), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "offload"));
	assert_null(b);
	tier_offload_destroy(off);
}

/* A directory this user may not write. Root ignores permission bits, so as root the check runs in
 * a child that has given up root (to "nobody"); the child reports through its exit status. */
static void test_nvme_not_writable(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	(void)state;
	tmp_make(&t, 1);
	assert_int_equal(chmod(t.sub[0], 0555), 0);
	if (geteuid() != 0) {
		expect_nvme_failure(off, t.sub[0], 1 << 20, 1, -EACCES, "chmod u+wx");
	} else {
		struct passwd *nobody = getpwnam("nobody");
		pid_t pid;
		int status = 0;
		if (!nobody) {
			printf("# running as root without a 'nobody' user: permission case not tested\n");
		} else {
			assert_int_equal(chmod(t.root, 0755), 0);
			pid = fork();
			assert_true(pid >= 0);
			if (pid == 0) {
				const char *dirs[1] = { t.sub[0] };
				tier_backend_config cfg = { .tier = TIER_NVME, .capacity = 1 << 20, .dirs = dirs,
							    .n_dirs = 1, .offload = off };
				tier_backend *b;
				int rc;
				if (setgid(nobody->pw_gid) || setuid(nobody->pw_uid))
					_exit(2);
				rc = backend_create(&b, &cfg);  /* fails before it touches the engine */
				_exit(rc == -EACCES && strstr(tier_last_error(), "chmod u+wx") &&
				      strstr(tier_last_error(), t.sub[0]) ? 0 : 1);
			}
			assert_int_equal(waitpid(pid, &status, 0), pid);
			assert_true(WIFEXITED(status));
			assert_int_equal(WEXITSTATUS(status), 0);
		}
	}
	tier_offload_destroy(off);
	tmp_remove(&t, 1);
}

/* More than the file system has: refused before any file is made, naming the free space. */
static void test_nvme_no_space(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	struct statvfs v;
	uint64_t have;
	(void)state;
	tmp_make(&t, 1);
	assert_int_equal(statvfs(t.sub[0], &v), 0);
	have = (uint64_t)v.f_bavail * v.f_frsize;
	expect_nvme_failure(off, t.sub[0], have + (1ull << 30), 1, -ENOSPC, "free");
	/* Two directories on one file system: each share fits, their sum does not. */
	expect_nvme_failure(off, t.sub[0], have / 2 * 3, 2, -ENOSPC, "2 directories");
	tier_offload_destroy(off);
	tmp_remove(&t, 1);
}

/* A file system that refuses O_DIRECT (simulated: kernels since 6.6 give tmpfs O_DIRECT) falls back
 * to buffered I/O with a warning naming the directory, and still works. */
static void test_nvme_buffered_fallback(void **state)
{
	tmpdirs t;
	tier_offload *off = offload_new();
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = 1 << 20, .n_dirs = 1 };
	tier_extent e;
	(void)state;
	tmp_make(&t, 1);
	cfg.dirs = t.dirs;
	cfg.offload = off;
	log_reset();
	nvme_test_refuse_direct(1);
	assert_int_equal(backend_create(&b, &cfg), 0);
	nvme_test_refuse_direct(0);
	assert_non_null(strstr(logged, "does not support O_DIRECT"));
	assert_non_null(strstr(logged, t.sub[0]));
	assert_int_equal(nvme_file_direct(backend_nvme(b), 0), 0);
	assert_int_equal(backend_alloc(b, 70000, &e), 0);
	nvme_roundtrip(off, &e, test_seed());
	backend_free(b, &e);
	backend_destroy(b);
	/* Without the simulation the same directory gets O_DIRECT (where the file system has it). */
	log_reset();
	assert_int_equal(backend_create(&b, &cfg), 0);
	assert_int_equal(nvme_file_direct(backend_nvme(b), 0), strstr(logged, "O_DIRECT") == NULL);
	backend_destroy(b);
	tier_offload_destroy(off);
	tmp_remove(&t, 1);
}

/* /dev/shm (tmpfs): works, with O_DIRECT or with the fallback, whichever the kernel offers. */
static void test_nvme_on_tmpfs(void **state)
{
	const char *dirs[1] = { "/dev/shm" };
	tier_offload *off;
	tier_backend *b;
	tier_backend_config cfg = { .tier = TIER_NVME, .capacity = 256 << 10, .dirs = dirs, .n_dirs = 1 };
	tier_extent e;
	(void)state;
	if (access(dirs[0], W_OK | X_OK)) {
		printf("# no writable /dev/shm: tmpfs case not tested\n");
		return;
	}
	off = offload_new();
	cfg.offload = off;
	assert_int_equal(backend_create(&b, &cfg), 0);
	printf("# /dev/shm: %s\n", nvme_file_direct(backend_nvme(b), 0) ? "O_DIRECT" : "buffered");
	assert_int_equal(backend_alloc(b, 5000, &e), 0);
	nvme_roundtrip(off, &e, test_seed());
	backend_free(b, &e);
	backend_destroy(b);
	tier_offload_destroy(off);
}

/* ---- metadata allocator ------------------------------------------------------------------------ */

static void test_meta_alloc(void **state)
{
	unsigned char *p[100];
	(void)state;
	printf("# metadata allocator: %s\n", tier_meta_uses_arena() ? "private jemalloc arena" : "malloc");
	for (int i = 0; i < 100; i++) {
		p[i] = tier_meta_calloc(i + 1, 24);
		assert_non_null(p[i]);
		for (int j = 0; j < (i + 1) * 24; j++)
			assert_int_equal(p[i][j], 0);
		memset(p[i], i, (size_t)(i + 1) * 24);
	}
	for (int i = 0; i < 100; i++) {
		assert_int_equal(p[i][(i + 1) * 24 - 1], i);
		tier_meta_free(p[i]);
	}
	p[0] = tier_meta_alloc(1000);
	assert_non_null(p[0]);
	tier_meta_free(p[0]);
	tier_meta_free(NULL);
	assert_null(tier_meta_calloc(SIZE_MAX / 2, 3));  /* overflow */
	assert_null(tier_meta_alloc(0));
}

static int setup(void **state)
{
	(void)state;
	tier_log_set_sink(log_sink, NULL);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hbm_emulated), cmocka_unit_test(test_ddr), cmocka_unit_test(test_cuda_tiers),
		cmocka_unit_test(test_exhaustion_and_bad_alloc), cmocka_unit_test(test_budget_above_machine),
		cmocka_unit_test(test_bad_config), cmocka_unit_test(test_nvme_striped),
		cmocka_unit_test(test_nvme_fills_every_file), cmocka_unit_test(test_nvme_bad_directories),
		cmocka_unit_test(test_nvme_bad_config), cmocka_unit_test(test_nvme_not_writable),
		cmocka_unit_test(test_nvme_no_space), cmocka_unit_test(test_nvme_buffered_fallback),
		cmocka_unit_test(test_nvme_on_tmpfs), cmocka_unit_test(test_meta_alloc),
	};
	return cmocka_run_group_tests(tests, setup, NULL);
}
