/* stats_shm.c - the shared-memory segment that publishes the store's statistics to tier-stat.
 *
 * One writer (the store) and any number of read-only readers in other processes. The writer
 * brackets each copy with a sequence counter: odd while writing, even when stable. A reader
 * copies the whole snapshot and keeps it only when the counter was even and unchanged across
 * the copy. Readers never write the segment, so a reader that dies leaves nothing behind. */
#include "config.h"
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "tier/base.h"
#include "tier/stats.h"

/* Tries before a reader gives up on a writer that never leaves the odd state (a writer killed
 * mid-copy, or one publishing faster than a reader can copy, which a real store never does). */
#define STATS_READ_TRIES 10000

struct tier_stats_pub {
	int fd;
	tier_stats *seg;          /* the mapping, read-write */
	char name[64];
};

void tier_stats_segment_name(pid_t pid, char *buf, size_t len)
{
	if (buf && len)
		snprintf(buf, len, "/tier-stats.%ld", (long)pid);
}

/* When process pid started: /proc/PID/stat's field 22, clock ticks since boot; 0 when unknown. The
 * writer stamps its own into the segment and a reader compares it with the live pid's, so no
 * clock is compared with another. */
static uint64_t proc_start_ticks(pid_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
	FILE *f = fopen(path, "r");
	size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
	if (f)
		fclose(f);
	buf[n] = 0;
	char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
	unsigned long long ticks = 0;
	for (int field = 2; p && field < 22; field++) /* p is at the end of field `field` */
		p = strchr(p + 1, ' ');
	return p && sscanf(p + 1, "%llu", &ticks) == 1 ? ticks : 0;
}

int tier_stats_publish_open(tier_stats_pub **out)
{
	tier_stats_pub *p;
	int rc;

	if (!out)
		return tier_fail(-EINVAL, "tier_stats_publish_open: out is NULL");
	*out = NULL;
	p = calloc(1, sizeof *p);
	if (!p)
		return tier_fail(-ENOMEM, "out of memory allocating the stats publisher");
	tier_stats_segment_name(getpid(), p->name, sizeof p->name);
	/* A segment of our name can only be a leftover of an earlier process with the same pid that
	 * died without cleaning up: remove it so that O_EXCL below gives us a fresh one. */
	shm_unlink(p->name);
	p->fd = shm_open(p->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
	if (p->fd < 0) {
		rc = tier_fail(-errno, "cannot create the stats segment /dev/shm%s: %s (check that /dev/shm is "
			       "mounted and writable, or run without published stats)", p->name, strerror(errno));
		free(p);
		return rc;
	}
	/* The umask may only remove bits; make sure nobody else can read our statistics. */
	if (fchmod(p->fd, 0600) != 0 || ftruncate(p->fd, sizeof(tier_stats)) != 0) {
		rc = -errno;
		goto err;
	}
	p->seg = mmap(NULL, sizeof(tier_stats), PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
	if (p->seg == MAP_FAILED) {
		rc = -errno;
		p->seg = NULL;
		goto err;
	}
	p->seg->version = TIER_STATS_VERSION;
	p->seg->size = sizeof(tier_stats);
	p->seg->pid = (int32_t)getpid();
	p->seg->proc_start = proc_start_ticks(getpid());
	/* Magic last: a reader that sees it sees the rest of the header too. */
	__atomic_store_n(&p->seg->magic, TIER_STATS_MAGIC, __ATOMIC_RELEASE);
	*out = p;
	return 0;
err:
	close(p->fd);
	shm_unlink(p->name);
	rc = tier_fail(rc, "cannot set up the stats segment /dev/shm%s: %s", p->name, strerror(-rc));
	free(p);
	return rc;
}

void tier_stats_publish(tier_stats_pub *pub, const tier_stats *snap)
{
	tier_stats *seg;
	uint64_t seq;
	size_t head = offsetof(tier_stats, pid);

	if (!pub || !snap)
		return;
	seg = pub->seg;
	seq = __atomic_load_n(&seg->seq, __ATOMIC_RELAXED);
	__atomic_store_n(&seg->seq, seq | 1, __ATOMIC_RELAXED);
	/* The odd counter must be visible before any byte of the new data. */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	/* magic, version, size and seq belong to the segment, not to the snapshot. */
	memcpy((char *)seg + head, (const char *)snap + head, sizeof(tier_stats) - head);
	seg->pid = (int32_t)getpid();
	__atomic_store_n(&seg->seq, (seq | 1) + 1, __ATOMIC_RELEASE);
}

void tier_stats_publish_close(tier_stats_pub *pub)
{
	if (!pub)
		return;
	if (pub->seg)
		munmap(pub->seg, sizeof(tier_stats));
	close(pub->fd);
	shm_unlink(pub->name);
	free(pub);
}

/* No segment: tell a process that is gone from one that never published. */
static int stats_no_segment(pid_t pid)
{
	if (kill(pid, 0) != 0 && errno == ESRCH)
		return tier_fail(-ESRCH, "no process %ld (check the pid with ps, or use --run DIR)", (long)pid);
	return tier_fail(-ESRCH, "process %ld publishes no tier statistics (not a tier job, or it has exited)",
			 (long)pid);
}

/* A segment whose process is gone is a leftover: -ESRCH naming it. */
static int stats_dead(pid_t pid, const char *name)
{
	if (kill(pid, 0) != 0 && errno == ESRCH)
		return tier_fail(-ESRCH, "process %ld has exited (its stats segment /dev/shm%s was left behind; "
				 "remove it with rm)", (long)pid, name);
	return 0;
}

/* Copy until the counter says the copy is whole. The header is re-checked on every copy: a
 * segment never changes its header after creation, but a stale one may be replaced. */
static int stats_copy_stable(const tier_stats *seg, tier_stats *out)
{
	for (int i = 0; i < STATS_READ_TRIES; i++) {
		uint64_t s1 = __atomic_load_n(&seg->seq, __ATOMIC_ACQUIRE);
		if (s1 & 1) {
			if (i > 100)
				nanosleep(&(struct timespec){ 0, 10000 }, NULL);
			continue;
		}
		memcpy(out, (const void *)seg, sizeof *out);
		/* The copy's loads must complete before the counter is read again. */
		__atomic_thread_fence(__ATOMIC_ACQUIRE);
		if (__atomic_load_n(&seg->seq, __ATOMIC_RELAXED) == s1) {
			out->seq = s1;
			return 0;
		}
	}
	return -EAGAIN;
}

/* Validate the header of a mapped segment of `len` bytes. */
static int stats_check_header(const tier_stats *seg, size_t len, const char *name)
{
	uint64_t magic = __atomic_load_n(&seg->magic, __ATOMIC_ACQUIRE);

	if (magic != TIER_STATS_MAGIC)
		return tier_fail(-EPROTO, "/dev/shm%s is not a tier stats segment (bad magic 0x%016llx)", name,
				 (unsigned long long)magic);
	if (seg->version != TIER_STATS_VERSION)
		return tier_fail(-EPROTO, "segment of tier stats version %u, this tier-stat reads version %u: "
				 "use the tier-stat of the same build (or, if that job has ended, remove the leftover "
				 "/dev/shm%s)", seg->version, TIER_STATS_VERSION, name);
	if (seg->size != sizeof(tier_stats) || len < sizeof(tier_stats))
		return tier_fail(-EPROTO, "tier stats segment /dev/shm%s has %u-byte snapshots in %zu bytes, this "
				 "tier-stat expects %zu: use the tier-stat of the same build", name, seg->size, len,
				 sizeof(tier_stats));
	return 0;
}

int tier_stats_read(pid_t pid, tier_stats *out)
{
	char name[64];
	struct stat st;
	tier_stats *seg;
	int fd, rc;

	if (!out || pid <= 0)
		return tier_fail(-EINVAL, "tier_stats_read: %s", out ? "pid must be positive" : "out is NULL");
	tier_stats_segment_name(pid, name, sizeof name);
	fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0) {
		rc = -errno;
		if (rc == -ENOENT)
			return stats_no_segment(pid);
		return tier_fail(rc, "cannot open the stats segment /dev/shm%s of process %ld: %s (segments are "
				 "readable only by their owner: run tier-stat as the same user)", name, (long)pid,
				 strerror(-rc));
	}
	if (fstat(fd, &st) != 0) {
		rc = tier_fail(-errno, "cannot stat /dev/shm%s: %s", name, strerror(errno));
		close(fd);
		return rc;
	}
	if ((rc = stats_dead(pid, name))) {
		close(fd);
		return rc;
	}
	/* A segment being created has size 0 until ftruncate: the writer's open is not finished. */
	if ((size_t)st.st_size < offsetof(tier_stats, seq)) {
		close(fd);
		return tier_fail(-EAGAIN, "stats segment /dev/shm%s of process %ld is still being set up (try again)",
				 name, (long)pid);
	}
	seg = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (seg == MAP_FAILED)
		return tier_fail(-errno, "cannot map /dev/shm%s: %s", name, strerror(errno));
	if (__atomic_load_n(&seg->magic, __ATOMIC_ACQUIRE) == 0)
		rc = tier_fail(-EAGAIN, "stats segment /dev/shm%s of process %ld is still being set up (try again)",
			       name, (long)pid);
	else
		rc = stats_check_header(seg, (size_t)st.st_size, name);
	uint64_t start = rc == 0 ? proc_start_ticks(pid) : 0;
	if (rc == 0 && seg->proc_start && start && seg->proc_start != start)
		rc = tier_fail(-ESTALE, "process %ld is not the one that wrote /dev/shm%s: that process exited and "
			       "another took its pid (remove the segment with rm)", (long)pid, name);
	if (rc == 0 && stats_copy_stable(seg, out) != 0)
		rc = tier_fail(-EAGAIN, "no stable snapshot of process %ld after %d tries (its writer may have died "
			       "while publishing)", (long)pid, STATS_READ_TRIES);
	munmap(seg, (size_t)st.st_size);
	/* A writer that died while we read leaves its segment behind: not a live job. */
	if (rc == 0 && kill(pid, 0) != 0 && errno == ESRCH)
		rc = tier_fail(-ESRCH, "process %ld has exited (its stats segment /dev/shm%s was left behind; "
			       "remove it with rm)", (long)pid, name);
	return rc;
}
