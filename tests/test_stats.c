/* test_stats.c - the stats segment: publish and read back, versions, missing processes, torn reads,
 * permissions and removal. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>
#include "tier/tier.h"
#include "tier/stats.h"

static uint64_t seed;

/* Every uint64 counter of a snapshot, so that tests can set or check them all at once. */
static size_t counters(tier_stats *s, uint64_t **out)
{
	size_t n = 0;
	out[n++] = &s->start_ns;
	out[n++] = &s->update_ns;
	out[n++] = &s->step;
	out[n++] = &s->objects;
	out[n++] = &s->object_bytes;
	for (int t = 0; t < TIER_STATS_NTIERS; t++) {
		uint64_t *f = &s->tier[t].capacity;
		for (size_t k = 0; k < sizeof s->tier[t] / sizeof *f; k++)
			out[n++] = f + k;
		for (int c = 0; c < TIER_STATS_NCLASSES; c++) {
			uint64_t *g = &s->cls[t][c].hits;
			for (size_t k = 0; k < sizeof s->cls[t][c] / sizeof *g; k++)
				out[n++] = g + k;
		}
	}
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		uint64_t *f = &s->link[l].bytes;
		for (size_t k = 0; k < sizeof s->link[l] / sizeof *f; k++)
			out[n++] = f + k;
	}
	for (size_t k = 0; k < sizeof s->prefetch / sizeof(uint64_t); k++)
		out[n++] = &s->prefetch.issued + k;
	return n;
}

#define MAXCOUNTERS 512

static void fill_all(tier_stats *s, uint64_t v)
{
	uint64_t *f[MAXCOUNTERS];
	size_t n = counters(s, f);
	for (size_t i = 0; i < n; i++)
		*f[i] = v;
	snprintf(s->job, sizeof s->job, "job %llu", (unsigned long long)v);
}

static void test_publish_then_read(void **state)
{
	tier_stats_pub *pub;
	tier_stats in, got;
	uint64_t *f[MAXCOUNTERS], *g[MAXCOUNTERS];
	tier_rng r;
	size_t n;
	(void)state;
	tier_rng_seed(&r, seed);
	memset(&in, 0, sizeof in);
	n = counters(&in, f);
	assert_true(n < MAXCOUNTERS);
	for (size_t i = 0; i < n; i++)
		*f[i] = tier_rng_next(&r);
	in.hbm_emulated = 1;
	strcpy(in.tier_name[0], "hbm (emulated)");
	strcpy(in.class_name[2], "lora");
	strcpy(in.link_name[3], "nvme-write");
	strcpy(in.job, "test_stats");
	in.seq = 12345; /* the snapshot's own counter must not leak into the segment */

	assert_int_equal(tier_stats_publish_open(&pub), 0);
	tier_stats_publish(pub, &in);
	memset(&got, 0xA5, sizeof got);
	assert_int_equal(tier_stats_read(getpid(), &got), 0);
	assert_true(got.magic == TIER_STATS_MAGIC);
	assert_int_equal(got.version, TIER_STATS_VERSION);
	assert_int_equal(got.size, sizeof(tier_stats));
	assert_int_equal(got.pid, getpid());
	assert_true(got.proc_start > 0); /* the writer's start, which a reader matches with the pid's */
	assert_int_equal(got.seq, 2); /* one publish: 0 -> 1 -> 2 */
	assert_int_equal(got.hbm_emulated, 1);
	counters(&got, g);
	for (size_t i = 0; i < n; i++)
		assert_true(*g[i] == *f[i]);
	assert_string_equal(got.tier_name[0], "hbm (emulated)");
	assert_string_equal(got.class_name[2], "lora");
	assert_string_equal(got.link_name[3], "nvme-write");
	assert_string_equal(got.job, "test_stats");
	tier_stats_publish(pub, &in);
	assert_int_equal(tier_stats_read(getpid(), &got), 0);
	assert_int_equal(got.seq, 4);
	tier_stats_publish_close(pub);
}

/* Map our own segment read-write, as a writer of another build would have written it. */
static tier_stats *own_segment(void)
{
	char name[64];
	int fd;
	void *p;
	tier_stats_segment_name(getpid(), name, sizeof name);
	fd = shm_open(name, O_RDWR, 0);
	assert_true(fd >= 0);
	p = mmap(NULL, sizeof(tier_stats), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	assert_true(p != MAP_FAILED);
	return p;
}

static void test_other_version_refused(void **state)
{
	tier_stats_pub *pub;
	tier_stats snap, got;
	tier_stats *seg;
	(void)state;
	memset(&snap, 0, sizeof snap);
	assert_int_equal(tier_stats_publish_open(&pub), 0);
	tier_stats_publish(pub, &snap);
	seg = own_segment();

	seg->version = TIER_STATS_VERSION + 1;
	assert_int_equal(tier_stats_read(getpid(), &got), -EPROTO);
	printf("# %s\n", tier_last_error());
	char want[64];
	snprintf(want, sizeof want, "version %u, this tier-stat reads version %u", TIER_STATS_VERSION + 1, TIER_STATS_VERSION);
	assert_non_null(strstr(tier_last_error(), want));
	assert_non_null(strstr(tier_last_error(), "same build"));

	seg->version = TIER_STATS_VERSION;
	seg->size = sizeof(tier_stats) + 8;
	assert_int_equal(tier_stats_read(getpid(), &got), -EPROTO);
	assert_non_null(strstr(tier_last_error(), "same build"));

	seg->size = sizeof(tier_stats);
	seg->magic = 0x1234;
	assert_int_equal(tier_stats_read(getpid(), &got), -EPROTO);
	assert_non_null(strstr(tier_last_error(), "not a tier stats segment"));

	/* A writer that died mid-copy leaves the counter odd: the reader gives up, it does not hang. */
	seg->magic = TIER_STATS_MAGIC;
	seg->seq = 7;
	assert_int_equal(tier_stats_read(getpid(), &got), -EAGAIN);
	assert_non_null(strstr(tier_last_error(), "stable"));
	seg->seq = 8;
	assert_int_equal(tier_stats_read(getpid(), &got), 0);
	munmap(seg, sizeof(tier_stats));
	tier_stats_publish_close(pub);
}

static void test_no_process_no_segment(void **state)
{
	tier_stats got;
	pid_t child;
	int status;
	char name[64];
	(void)state;
	/* The highest pids are rarely in use; find one that is not. */
	pid_t dead = 4194000;
	while (kill(dead, 0) == 0 || errno != ESRCH)
		dead++;
	assert_int_equal(tier_stats_read(dead, &got), -ESRCH);
	assert_non_null(strstr(tier_last_error(), "no process"));

	/* Our parent exists and publishes nothing, unless a job that once had its pid left a segment
	 * (a machine that ran many jobs: test_reused_pid covers that case). */
	tier_stats_segment_name(getppid(), name, sizeof name);
	int pfd = shm_open(name, O_RDONLY, 0);
	if (pfd >= 0) {
		close(pfd);
		printf("# a leftover segment /dev/shm%s for our parent's pid: its case not checked\n", name);
	} else {
		assert_int_equal(tier_stats_read(getppid(), &got), -ESRCH);
		assert_non_null(strstr(tier_last_error(), "publishes no tier statistics"));
	}

	/* A process that died without cleaning up leaves a segment: reported as exited. */
	child = fork();
	assert_true(child >= 0);
	if (child == 0) {
		tier_stats_pub *pub;
		tier_stats snap;
		memset(&snap, 0, sizeof snap);
		if (tier_stats_publish_open(&pub) != 0)
			_exit(1);
		tier_stats_publish(pub, &snap);
		_exit(0); /* no close: the segment stays */
	}
	assert_int_equal(waitpid(child, &status, 0), child);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	assert_int_equal(tier_stats_read(child, &got), -ESRCH);
	assert_non_null(strstr(tier_last_error(), "exited"));
	tier_stats_segment_name(child, name, sizeof name);
	assert_int_equal(shm_unlink(name), 0);

	assert_int_equal(tier_stats_read(0, &got), -EINVAL);
	assert_int_equal(tier_stats_read(getpid(), NULL), -EINVAL);
}

/* A segment whose writer's start (proc_start) is not the live pid's is a leftover of an exited
 * process whose pid another process now has: refused with -ESTALE, not read as that process's.
 * With the start unknown (0) it is read. */
static void test_reused_pid(void **state)
{
	(void)state;
	pid_t child = fork();
	assert_true(child >= 0);
	if (child == 0) { /* holds no output open, and ends itself should the test fail */
		close(1), close(2);
		alarm(60);
		pause();
		_exit(0);
	}
	char name[64];
	tier_stats_segment_name(child, name, sizeof name);
	shm_unlink(name); /* a leftover of an earlier process with this pid */
	int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, sizeof(tier_stats)), 0);
	tier_stats *seg = mmap(NULL, sizeof(tier_stats), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(seg != MAP_FAILED);
	close(fd);
	seg->version = TIER_STATS_VERSION, seg->size = sizeof(tier_stats), seg->pid = (int32_t)child;
	seg->proc_start = 1; /* the second clock tick after boot: not the child's */
	seg->magic = TIER_STATS_MAGIC;
	tier_stats got;
	assert_int_equal(tier_stats_read(child, &got), -ESTALE);
	assert_non_null(strstr(tier_last_error(), "another took its pid"));
	seg->proc_start = 0;
	assert_int_equal(tier_stats_read(child, &got), 0);
	assert_int_equal(got.pid, child);
	munmap(seg, sizeof(tier_stats));
	assert_int_equal(shm_unlink(name), 0);
	kill(child, SIGKILL);
	int status;
	assert_int_equal(waitpid(child, &status, 0), child);
}

static void test_segment_being_created(void **state)
{
	char name[64];
	tier_stats got;
	int fd;
	(void)state;
	/* Between shm_open and ftruncate the segment is empty: "try again", not "not a segment". */
	tier_stats_segment_name(getpid(), name, sizeof name);
	fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
	assert_true(fd >= 0);
	assert_int_equal(tier_stats_read(getpid(), &got), -EAGAIN);
	/* Sized but the header not written yet. */
	assert_int_equal(ftruncate(fd, sizeof(tier_stats)), 0);
	assert_int_equal(tier_stats_read(getpid(), &got), -EAGAIN);
	close(fd);
	/* publish_open replaces the stale segment of the same name. */
	tier_stats_pub *pub;
	assert_int_equal(tier_stats_publish_open(&pub), 0);
	assert_int_equal(tier_stats_read(getpid(), &got), 0);
	tier_stats_publish_close(pub);
}

struct race {
	tier_stats_pub *pub;
	volatile int stop;
	uint64_t published;
};

static void *writer(void *arg)
{
	struct race *r = arg;
	tier_stats *snap = calloc(1, sizeof *snap);
	assert_non_null(snap);
	for (uint64_t v = 1; !__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE); v++) {
		fill_all(snap, v);
		tier_stats_publish(r->pub, snap);
		__atomic_store_n(&r->published, v, __ATOMIC_RELEASE);
	}
	free(snap);
	return NULL;
}

static void test_reader_never_sees_torn_snapshot(void **state)
{
	struct race r = { 0 };
	pthread_t w;
	tier_stats got;
	uint64_t *g[MAXCOUNTERS], last = 0;
	unsigned reads = 0, distinct = 0, eagain = 0;
	size_t n = counters(&got, g);
	uint64_t t_end;
	char job[64];
	(void)state;
	assert_int_equal(tier_stats_publish_open(&r.pub), 0);
	assert_int_equal(pthread_create(&w, NULL, writer, &r), 0);
	t_end = tier_now_ns() + 400000000ull;
	while (tier_now_ns() < t_end || reads < 200) {
		int rc = tier_stats_read(getpid(), &got);
		if (rc == -EAGAIN) { /* a reader can be starved by a writer that never pauses */
			eagain++;
			continue;
		}
		assert_int_equal(rc, 0);
		reads++;
		for (size_t i = 1; i < n; i++)
			if (*g[i] != *g[0])
				fail_msg("torn snapshot: counter %zu is %llu, counter 0 is %llu", i,
					 (unsigned long long)*g[i], (unsigned long long)*g[0]);
		snprintf(job, sizeof job, "job %llu", (unsigned long long)*g[0]);
		if (*g[0] != 0)
			assert_string_equal(got.job, job);
		assert_true(*g[0] >= last); /* snapshots never go back in time */
		distinct += *g[0] != last;
		last = *g[0];
	}
	__atomic_store_n(&r.stop, 1, __ATOMIC_RELEASE);
	pthread_join(w, NULL);
	printf("# %u reads, %u distinct snapshots, %u retries exhausted, %llu published\n", reads, distinct,
	       eagain, (unsigned long long)r.published);
	assert_true(distinct > 1); /* the reader really raced the writer */
	tier_stats_publish_close(r.pub);
}

static void test_mode_and_removal(void **state)
{
	tier_stats_pub *pub;
	tier_stats got;
	struct stat st;
	char name[64];
	int fd;
	(void)state;
	umask(0); /* the segment must still be private */
	assert_int_equal(tier_stats_publish_open(&pub), 0);
	umask(022);
	tier_stats_segment_name(getpid(), name, sizeof name);
	fd = shm_open(name, O_RDONLY, 0);
	assert_true(fd >= 0);
	assert_int_equal(fstat(fd, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0600);
	assert_true((size_t)st.st_size >= sizeof(tier_stats));
	close(fd);
	tier_stats_publish_close(pub);
	assert_true(shm_open(name, O_RDONLY, 0) < 0 && errno == ENOENT);
	assert_int_equal(tier_stats_read(getpid(), &got), -ESRCH);
	assert_non_null(strstr(tier_last_error(), "publishes no tier statistics"));
	tier_stats_publish_close(NULL);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_publish_then_read), cmocka_unit_test(test_other_version_refused),
		cmocka_unit_test(test_reused_pid), cmocka_unit_test(test_no_process_no_segment), cmocka_unit_test(test_segment_being_created),
		cmocka_unit_test(test_reader_never_sees_torn_snapshot), cmocka_unit_test(test_mode_and_removal),
	};
	seed = tier_now_ns();
	printf("# seed %llu\n", (unsigned long long)seed);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
