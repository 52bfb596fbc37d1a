/* backend_nvme.c - the NVMe tier: one preallocated, O_DIRECT, unlinked file per directory.
 *
 * The tier's address space is the files laid end to end (file i covers [base_i, base_i + size_i));
 * an extent lives wholly in one file. Allocation goes round-robin over the files, moving on to the
 * next file when one is full, so that objects allocated one after the other (the experts of one
 * layer, the layers of one step) land on different drives and their reads run in parallel.
 *
 * Each file is unlinked as soon as it is open: the space it holds returns to the file system when
 * the process ends, however it ends (a killed job must not leave terabytes behind). */
#include "config.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include "tier/base.h"
#include "tier/offload.h"
#include "tier/backend_nvme.h"

#define NVME_ALIGN 4096u

typedef struct {
	int fd;
	int id;            /* offload file id; -1 until registered */
	int direct;        /* opened O_DIRECT */
	uint64_t base;     /* first byte of this file in the tier's address space */
	uint64_t size;
	tier_range *range;
	char *dir;
} nvme_file;

struct tier_nvme {
	nvme_file *f;
	unsigned n;
	unsigned next;     /* round-robin cursor: the file the next allocation tries first */
	uint64_t capacity;
	tier_offload *offload;
};

static int refuse_direct;
static unsigned file_counter;

void nvme_test_refuse_direct(int on) { refuse_direct = on; }

static char *fmt(uint64_t bytes, char *buf)
{
	return tier_format_size(bytes, buf, 32);
}

/* The directory exists, is a directory, and this process may create files in it. */
static int dir_check(const char *dir, struct stat *st)
{
	int e;
	if (!dir || !*dir)
		return tier_fail(-EINVAL, "an NVMe directory name is empty: pass --nvme DIR:SIZE");
	if (stat(dir, st)) {
		e = errno;
		if (e == ENOENT)
			return tier_fail(-ENOENT, "NVMe directory %s does not exist: create it (mkdir -p %s) "
					 "or choose another with --nvme DIR:SIZE", dir, dir);
		if (e == ENOTDIR)
			return tier_fail(-ENOTDIR, "NVMe directory %s: a component of the path is not a "
					 "directory; choose another with --nvme DIR:SIZE", dir);
		if (e == EACCES)
			return tier_fail(-EACCES, "NVMe directory %s cannot be reached (permission denied on "
					 "the path): chmod its parents or choose another with --nvme DIR:SIZE", dir);
		return tier_fail(-EIO, "NVMe directory %s: stat failed (%s)", dir, strerror(e));
	}
	if (!S_ISDIR(st->st_mode))
		return tier_fail(-ENOTDIR, "NVMe directory %s is not a directory: choose a directory "
				 "with --nvme DIR:SIZE", dir);
	if (access(dir, W_OK | X_OK)) {
		e = errno;
		if (e == EROFS)
			return tier_fail(-EROFS, "NVMe directory %s is on a read-only file system: remount it "
					 "read-write or choose another with --nvme DIR:SIZE", dir);
		return tier_fail(-EACCES, "NVMe directory %s is not writable by this user: chmod u+wx %s "
				 "or choose another with --nvme DIR:SIZE", dir, dir);
	}
	return 0;
}

static uint64_t dir_free(const char *dir)
{
	struct statvfs v;
	if (statvfs(dir, &v))
		return 0;
	return (uint64_t)v.f_bavail * v.f_frsize;
}

static int open_error(const char *dir, const char *path, int e)
{
	if (e == EACCES || e == EPERM)
		return tier_fail(-EACCES, "NVMe directory %s: cannot create %s (permission denied): chmod "
				 "u+wx %s or choose another with --nvme DIR:SIZE", dir, path, dir);
	if (e == EROFS)
		return tier_fail(-EROFS, "NVMe directory %s is on a read-only file system: choose another "
				 "with --nvme DIR:SIZE", dir);
	if (e == ENOSPC || e == EDQUOT)
		return tier_fail(-ENOSPC, "NVMe directory %s: no space (or quota) left to create a file: "
				 "free space or choose another with --nvme DIR:SIZE", dir);
	return tier_fail(-EIO, "NVMe directory %s: cannot create %s (%s)", dir, path, strerror(e));
}

/* Create a file of our own in `dir`, O_DIRECT where the file system allows it, and unlink it. */
static int file_open(nvme_file *f, const char *dir)
{
	const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
	char path[4096];
	for (int tries = 0; tries < 1000; tries++) {
		unsigned n = __atomic_fetch_add(&file_counter, 1, __ATOMIC_RELAXED);
		int fd;
		snprintf(path, sizeof path, "%s/tier-nvme.%ld.%u", dir, (long)getpid(), n);
		if (refuse_direct) {
			errno = EINVAL;
			fd = -1;
		} else {
			fd = open(path, flags | O_DIRECT, 0600);
		}
		f->direct = fd >= 0;
		if (fd < 0 && errno == EINVAL) {
			/* Some file systems create the file before refusing O_DIRECT: no O_EXCL here (an
			 * existing file would have failed above with EEXIST, so this one is ours). */
			fd = open(path, (flags & ~O_EXCL) | O_TRUNC, 0600);
			if (fd >= 0)
				tier_log(TIER_LOG_WARN, "NVMe directory %s does not support O_DIRECT: using "
					 "buffered I/O there (the page cache will hold copies of NVMe data)", dir);
		}
		if (fd < 0 && errno == EEXIST)
			continue;
		if (fd < 0)
			return open_error(dir, path, errno);
		unlink(path);
		f->fd = fd;
		return 0;
	}
	return tier_fail(-EIO, "NVMe directory %s: could not find an unused file name", dir);
}

/* Reserve the file's blocks now, so that a full disk shows here rather than in a write later. */
static int file_reserve(nvme_file *f)
{
	char a[32], b[32];
	int e = posix_fallocate(f->fd, 0, (off_t)f->size);
	if (e == 0)
		return 0;
	if (e == ENOSPC || e == EDQUOT)
		return tier_fail(-ENOSPC, "NVMe directory %s: could not reserve %s (%s free): lower --nvme, "
				 "free space, or choose another directory with --nvme DIR:SIZE",
				 f->dir, fmt(f->size, a), fmt(dir_free(f->dir), b));
	if (e == EOPNOTSUPP || e == EINVAL) {
		if (ftruncate(f->fd, (off_t)f->size) == 0) {
			tier_log(TIER_LOG_WARN, "NVMe directory %s cannot preallocate: %s not reserved, "
				 "writes may fail later with ENOSPC", f->dir, fmt(f->size, a));
			return 0;
		}
		e = errno;
	}
	return tier_fail(-EIO, "NVMe directory %s: could not size the file to %s (%s)", f->dir,
			 fmt(f->size, a), strerror(e));
}

/* Each file system must have room for the shares of every directory that lives on it. */
static int space_check(tier_nvme *n, const char *const *dirs, const struct stat *st)
{
	char a[32], b[32];
	for (unsigned i = 0; i < n->n; i++) {
		uint64_t need = 0, have = dir_free(dirs[i]);
		unsigned sharing = 0;
		for (unsigned j = 0; j < n->n; j++) {
			if (st[j].st_dev == st[i].st_dev) {
				need += n->f[j].size;
				sharing++;
			}
		}
		if (need > have)
			return tier_fail(-ENOSPC, "NVMe directory %s has %s free but the budget puts %s on its "
					 "file system (%u director%s): lower --nvme, free space, or choose "
					 "another directory with --nvme DIR:SIZE", dirs[i], fmt(have, a),
					 fmt(need, b), sharing, sharing == 1 ? "y" : "ies");
	}
	return 0;
}

static int file_setup(tier_nvme *n, nvme_file *f, const char *dir)
{
	int rc;
	f->dir = strdup(dir);
	if (!f->dir)
		return tier_fail(-ENOMEM, "out of host memory");
	rc = range_create(&f->range, f->size, NVME_ALIGN);
	if (!rc)
		rc = file_open(f, dir);
	if (!rc)
		rc = file_reserve(f);
	if (!rc && (rc = tier_offload_register_file(n->offload, f->fd, &f->id)))
		f->id = -1;
	return rc;
}

int nvme_create(tier_nvme **out, uint64_t capacity, const char *const *dirs, unsigned n_dirs,
		tier_offload *offload)
{
	tier_nvme *n;
	struct stat *st;
	uint64_t share, base = 0;
	char a[32];
	int rc = 0;
	*out = NULL;
	if (!dirs || n_dirs == 0)
		return tier_fail(-EINVAL, "the NVMe tier needs at least one directory: pass --nvme DIR:SIZE");
	if (!offload)
		return tier_fail(-EINVAL, "the NVMe tier needs an offload engine to register its files with");
	share = capacity / n_dirs / NVME_ALIGN * NVME_ALIGN;
	if (share == 0)
		return tier_fail(-EINVAL, "NVMe budget %s is too small to give each of %u directories 4 KiB: "
				 "raise --nvme", fmt(capacity, a), n_dirs);
	n = calloc(1, sizeof *n);
	st = calloc(n_dirs, sizeof *st);
	if (n)
		n->f = calloc(n_dirs, sizeof *n->f);
	if (!n || !st || !n->f) {
		free(st);
		nvme_destroy(n);
		return tier_fail(-ENOMEM, "out of host memory for the NVMe tier");
	}
	n->offload = offload;
	n->n = n_dirs;
	for (unsigned i = 0; i < n_dirs; i++) {
		nvme_file *f = &n->f[i];
		f->fd = f->id = -1;
		f->base = base;
		f->size = i + 1 < n_dirs ? share : (capacity - base) / NVME_ALIGN * NVME_ALIGN;
		base += f->size;
		if (!rc)
			rc = dir_check(dirs[i], &st[i]);
	}
	n->capacity = base;
	if (!rc)
		rc = space_check(n, dirs, st);
	for (unsigned i = 0; i < n_dirs && !rc; i++)
		rc = file_setup(n, &n->f[i], dirs[i]);
	free(st);
	if (rc) {
		nvme_destroy(n);
		return rc;
	}
	for (unsigned i = 0; i < n_dirs; i++)
		tier_log(TIER_LOG_INFO, "nvme tier: %s in %s (%s)", fmt(n->f[i].size, a), dirs[i],
			 n->f[i].direct ? "O_DIRECT" : "buffered");
	*out = n;
	return 0;
}

void nvme_destroy(tier_nvme *n)
{
	if (!n)
		return;
	for (unsigned i = 0; n->f && i < n->n; i++) {
		nvme_file *f = &n->f[i];
		if (f->id >= 0)
			tier_offload_unregister_file(n->offload, f->id);
		if (f->fd >= 0)
			close(f->fd);
		range_destroy(f->range);
		free(f->dir);
	}
	free(n->f);
	free(n);
}

int nvme_alloc(tier_nvme *n, uint64_t size, tier_extent *ext)
{
	for (unsigned k = 0; k < n->n; k++) {
		unsigned i = (n->next + k) % n->n;
		nvme_file *f = &n->f[i];
		uint64_t off;
		int rc = range_alloc(f->range, size, &off);
		if (rc == -ENOSPC)
			continue;
		if (rc)
			return rc;
		n->next = (i + 1) % n->n;
		ext->offset = f->base + off;
		ext->bytes = range_rounded(f->range, size);
		ext->loc = tier_loc_file(f->id, off);
		return 0;
	}
	return -ENOSPC;
}

void nvme_free(tier_nvme *n, const tier_extent *ext)
{
	for (unsigned i = 0; i < n->n; i++) {
		nvme_file *f = &n->f[i];
		if (ext->offset >= f->base && ext->offset < f->base + f->size) {
			if (ext->loc.kind != TIER_MEM_FILE || ext->loc.file != f->id ||
			    ext->loc.offset != ext->offset - f->base)
				break;
			range_free(f->range, ext->offset - f->base, ext->bytes);
			return;
		}
	}
	tier_log(TIER_LOG_ERROR, "nvme: extent at %llu (+%llu) is not from this tier (ignored)",
		 (unsigned long long)ext->offset, (unsigned long long)ext->bytes);
}

uint64_t nvme_capacity(const tier_nvme *n) { return n->capacity; }
unsigned nvme_files(const tier_nvme *n) { return n->n; }
int nvme_file_direct(const tier_nvme *n, unsigned i) { return i < n->n && n->f[i].direct; }

uint64_t nvme_used(const tier_nvme *n)
{
	uint64_t used = 0;
	for (unsigned i = 0; i < n->n; i++)
		used += range_used(n->f[i].range);
	return used;
}

uint64_t nvme_largest_free(const tier_nvme *n)
{
	uint64_t best = 0;
	for (unsigned i = 0; i < n->n; i++) {
		uint64_t l = range_largest_free(n->f[i].range);
		best = l > best ? l : best;
	}
	return best;
}

int nvme_check(const tier_nvme *n)
{
	uint64_t base = 0;
	for (unsigned i = 0; i < n->n; i++) {
		const nvme_file *f = &n->f[i];
		struct stat st;
		char why[512];
		int rc = range_check(f->range);
		if (rc) {
			snprintf(why, sizeof why, "%s", tier_last_error());
			return tier_fail(rc, "NVMe file in %s: %s", f->dir, why);
		}
		if (f->base != base || range_capacity(f->range) != f->size || f->size % NVME_ALIGN)
			return tier_fail(-EPROTO, "NVMe file %u in %s: base %llu or size %llu out of place", i,
					 f->dir, (unsigned long long)f->base, (unsigned long long)f->size);
		if (fstat(f->fd, &st) || (uint64_t)st.st_size < f->size)
			return tier_fail(-EPROTO, "NVMe file in %s is shorter than its share %llu", f->dir,
					 (unsigned long long)f->size);
		base += f->size;
	}
	if (base != n->capacity || n->next >= n->n)
		return tier_fail(-EPROTO, "NVMe tier: files sum to %llu bytes, capacity %llu",
				 (unsigned long long)base, (unsigned long long)n->capacity);
	return 0;
}
