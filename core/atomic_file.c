/* atomic_file.c - write a file so that a crash leaves either the old one or the complete new one. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "tier/base.h"
#include "tier/formats.h"

struct tier_atomic_file {
	int fd;
	int failed;      /* a write failed: commit must not publish the file */
	char *path;      /* final name */
	char *tmp;       /* temporary name in the same directory (rename is atomic only there) */
};

int tier_atomic_write_begin(const char *path, tier_atomic_file **out)
{
	*out = NULL;
	if (!path || !*path)
		return tier_fail(-EINVAL, "atomic write: empty path");
	tier_atomic_file *f = calloc(1, sizeof *f);
	if (!f || asprintf(&f->tmp, "%s.tmp.XXXXXX", path) < 0) {
		free(f);
		return tier_fail(-ENOMEM, "atomic write of %s: out of memory", path);
	}
	f->path = strdup(path);
	f->fd = f->path ? mkostemp(f->tmp, O_CLOEXEC) : -1;
	if (f->fd < 0) {
		int e = f->path ? errno : ENOMEM;
		free(f->tmp); free(f->path); free(f);
		return tier_fail(-e, "cannot create a temporary file next to %s: %s; check that the "
				 "directory exists and is writable", path, strerror(e));
	}
	fchmod(f->fd, 0644);   /* mkostemp makes 0600; checkpoints and adapters are meant to be shared */
	*out = f;
	return 0;
}

int tier_atomic_write(tier_atomic_file *f, const void *buf, size_t n)
{
	const char *p = buf;
	while (n > 0) {
		ssize_t w = write(f->fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			int e = w < 0 ? errno : EIO;
			f->failed = 1;
			int full = e == ENOSPC || e == EDQUOT || e == EFBIG;
			return tier_fail(-e, "writing %s (as %s until it is complete): %s%s", f->path, f->tmp, strerror(e),
					 full ? "; the disk is full or a file size limit is set: free space or write "
						"elsewhere (the old file, if any, is untouched)" : "");
		}
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

static void atomic_free(tier_atomic_file *f)
{
	if (f->fd >= 0)
		close(f->fd);
	free(f->path);
	free(f->tmp);
	free(f);
}

void tier_atomic_write_abort(tier_atomic_file *f)
{
	if (!f)
		return;
	unlink(f->tmp);
	atomic_free(f);
}

/* fsync the directory so that the rename itself survives a crash. */
static int sync_dir(const char *path)
{
	char *copy = strdup(path);
	if (!copy)
		return -ENOMEM;
	int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	free(copy);
	if (fd < 0)
		return -errno;
	int rc = fsync(fd) < 0 && errno != EINVAL ? -errno : 0;   /* some file systems refuse: fine */
	close(fd);
	return rc;
}

int tier_atomic_write_commit(tier_atomic_file *f)
{
	int rc = 0;
	if (f->failed)
		rc = tier_fail(-EIO, "not publishing %s: an earlier write to it failed", f->path);
	else if (fsync(f->fd) < 0)
		rc = tier_fail(-errno, "fsync of %s failed: %s", f->tmp, strerror(errno));
	else {
		int c = close(f->fd);
		f->fd = -1;                 /* closed either way: never close it twice */
		if (c < 0)
			rc = tier_fail(-errno, "close of %s failed: %s", f->tmp, strerror(errno));
	}
	if (rc == 0 && rename(f->tmp, f->path) < 0)
		rc = tier_fail(-errno, "cannot rename %s to %s: %s", f->tmp, f->path, strerror(errno));
	if (rc < 0) {
		tier_atomic_write_abort(f);
		return rc;
	}
	/* the file is in place: a directory that cannot be synced only weakens its crash safety, so it
	 * is said, not returned (a caller would take the written file for a failed one) */
	int d = sync_dir(f->path);
	if (d < 0)
		tier_log(TIER_LOG_WARN, "%s was written, but fsync of its directory failed (%s): a crash now may "
			 "lose the rename", f->path, strerror(-d));
	atomic_free(f);
	return rc;
}
