/* test_offload_cuda.c - the offload engine on a GPU: copy streams, event fences, stream waits and
 * the NVMe<->HBM staging ring. Skipped (exit 77) without a CUDA device. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include "tier/tier.h"

#define MAXB (6u << 20)
static tier_rng rng;
static tier_dev *dev;
static tier_offload *off;
static char dir[512];

static void *hbuf(void)
{
	void *p;
	assert_int_equal(tier_host_malloc(MAXB, 1, &p), 0);
	memset(p, 0xA5, MAXB);
	return p;
}

static void *dbuf(void)
{
	void *p;
	assert_int_equal(tier_dev_malloc(dev, MAXB, &p), 0);
	return p;
}

/* h2d, d2d, d2h of random sizes in flight together; the host copy back matches. */
static void test_copy_streams(void **state)
{
	enum { N = 8 };
	char *h = hbuf(), *back[N];
	void *d1 = dbuf(), *d2[N];
	tier_fence *f[N];
	uint64_t seed = tier_rng_next(&rng), len[N];
	(void)state;
	tier_pattern_fill(h, MAXB, seed, 0);
	for (int i = 0; i < N; i++) {
		len[i] = 1 + tier_rng_below(&rng, MAXB);
		back[i] = hbuf();
		d2[i] = dbuf();
	}
	tier_xfer up = { .dst = tier_loc_device(d1), .src = tier_loc_host(h), .len = MAXB };
	assert_int_equal(tier_offload_copy(off, &up), 0);
	for (int i = 0; i < N; i++) {
		tier_xfer dd = { .dst = tier_loc_device(d2[i]), .src = tier_loc_device(d1), .len = len[i] };
		assert_int_equal(tier_offload_copy(off, &dd), 0);
		tier_xfer down = { .dst = tier_loc_host(back[i]), .src = tier_loc_device(d2[i]), .len = len[i] };
		assert_int_equal(tier_offload_submit(off, &down, &f[i]), 0);
	}
	for (int i = 0; i < N; i++) {
		assert_int_equal(tier_fence_wait(f[i]), 0);
		assert_int_equal(tier_fence_done(f[i]), 1);
		assert_true(tier_fence_busy_ns(f[i]) > 0);
		assert_int_equal(tier_pattern_check(back[i], len[i], seed, 0), len[i]);
		assert_true((unsigned char)back[i][len[i] % MAXB] == 0xA5 || len[i] == MAXB);
		tier_fence_put(f[i]);
		tier_host_free(back[i], 1);
		tier_dev_free(dev, d2[i]);
	}
	/* the compute stream waits on an h2d fence, then reads the data on that stream */
	tier_pattern_fill(h, MAXB, seed + 1, 0);
	tier_fence *g;
	assert_int_equal(tier_offload_submit(off, &up, &g), 0);
	assert_int_equal(tier_fence_stream_wait(g, tier_dev_stream(dev)), 0);
	char *chk = hbuf();
	assert_int_equal(tier_dev_memcpy_d2h(dev, chk, d1, MAXB), 0);
	assert_int_equal(tier_pattern_check(chk, MAXB, seed + 1, 0), MAXB);
	tier_fence_put(g);
	tier_xfer bad = up;
	bad.flags = TIER_XFER_CRC_COMPUTE;
	assert_int_equal(tier_offload_submit(off, &bad, &g), -EINVAL);
	tier_host_free(chk, 1);
	tier_host_free(h, 1);
	tier_dev_free(dev, d1);
}

/* Submit n copies of x each (their fences into f); then wait for every one and drop it. */
static void submit_n(const tier_xfer *x, tier_fence **f, int n)
{
	for (int i = 0; i < n; i++)
		assert_int_equal(tier_offload_submit(off, x, &f[i]), 0);
}

static void wait_put_n(tier_fence **f, int n)
{
	for (int i = 0; i < n; i++) {
		assert_int_equal(tier_fence_wait(f[i]), 0);
		tier_fence_put(f[i]);
	}
}

/* An urgent h2d copy goes ahead of the copies queued before it: submitted after 64 copies of 6 MiB
 * (about 7 ms of link time), it is done while the last of them is not; every copy lands whole. The
 * same for d2h. A second stream would not do it: the copy engine runs copies in the order it got
 * them, whatever their stream (this test failed so on the H200), hence the metered queue. */
static void test_urgent_stream(void **state)
{
	enum { N = 64 };
	char *h = hbuf(), *small = hbuf();
	void *d = dbuf(), *ds = dbuf();
	tier_fence *f[N], *u;
	uint64_t seed = tier_rng_next(&rng);
	(void)state;
	tier_pattern_fill(h, MAXB, seed, 0);
	tier_pattern_fill(small, 4096, seed + 1, 0);
	for (int way = 0; way < 2; way++) {
		tier_xfer big = way ? (tier_xfer){ .dst = tier_loc_host(h), .src = tier_loc_device(d), .len = MAXB }
				    : (tier_xfer){ .dst = tier_loc_device(d), .src = tier_loc_host(h), .len = MAXB };
		submit_n(&big, f, N);
		tier_xfer x = way ? (tier_xfer){ .dst = tier_loc_host(small + 4096), .src = tier_loc_device(ds), .len = 4096,
						 .flags = TIER_XFER_URGENT }
				  : (tier_xfer){ .dst = tier_loc_device(ds), .src = tier_loc_host(small), .len = 4096,
						 .flags = TIER_XFER_URGENT };
		assert_int_equal(tier_offload_submit(off, &x, &u), 0);
		assert_int_equal(tier_fence_wait(u), 0);
		int last_done = tier_fence_done(f[N - 1]);
		printf("# urgent %s copy done; the last of %d queued before it %s\n", way ? "d2h" : "h2d", N,
		       last_done ? "too (the link was faster than expected)" : "not yet");
		assert_false(last_done);
		wait_put_n(f, N);
		tier_fence_put(u);
	}
	assert_int_equal(tier_pattern_check(small + 4096, 4096, seed + 1, 0), 4096);
	assert_int_equal(tier_pattern_check(h, MAXB, seed, 0), MAXB);
	tier_host_free(h, 1);
	tier_host_free(small, 1);
	tier_dev_free(dev, d);
	tier_dev_free(dev, ds);
}

/* Waiting for a queued copy moves it to the front: the host wait and the stream wait on the last
 * of 64 copies of 6 MiB return while the 40th is still not done. */
static void test_wait_promotes(void **state)
{
	enum { N = 64 };
	char *h = hbuf();
	void *d = dbuf();
	tier_fence *f[N];
	uint64_t seed = tier_rng_next(&rng);
	(void)state;
	tier_pattern_fill(h, MAXB, seed, 0);
	for (int how = 0; how < 2; how++) {
		submit_n(&(tier_xfer){ .dst = tier_loc_device(d), .src = tier_loc_host(h), .len = MAXB }, f, N);
		if (how)
			assert_int_equal(tier_fence_stream_wait(f[N - 1], tier_dev_stream(dev)), 0);
		assert_int_equal(tier_dev_sync(dev), 0);
		assert_int_equal(tier_fence_wait(f[N - 1]), 0);
		int mid_done = tier_fence_done(f[40]);
		printf("# %s wait on the last of %d queued copies returned; the 40th %s\n", how ? "stream" : "host", N,
		       mid_done ? "too (not promoted?)" : "not yet");
		assert_false(mid_done);
		wait_put_n(f, N);
	}
	tier_host_free(h, 1);
	tier_dev_free(dev, d);
}

/* host -> file -> HBM and HBM -> file -> host through the staging ring, with checksums. */
static void test_staging(void **state)
{
	char path[600];
	snprintf(path, sizeof path, "%s/f", dir);
	int fd = open(path, O_CREAT | O_RDWR | O_DIRECT, 0600), id;
	if (fd < 0)
		fd = open(path, O_CREAT | O_RDWR, 0600);
	assert_true(fd >= 0);
	unlink(path);
	assert_int_equal(ftruncate(fd, 4 * MAXB), 0);
	assert_int_equal(tier_offload_register_file(off, fd, &id), 0);
	uint64_t seed = tier_rng_next(&rng), n = MAXB - 4096 * 5;
	char *h = hbuf(), *back = hbuf();
	void *d = dbuf(), *d2 = dbuf();
	(void)state;
	tier_pattern_fill(h, n, seed, 0);
	uint32_t crc = tier_crc32c(0, h, n);
	tier_xfer w = { .dst = tier_loc_file(id, MAXB), .src = tier_loc_host(h), .len = n };
	assert_int_equal(tier_offload_copy(off, &w), 0);
	tier_xfer r = { .dst = tier_loc_device(d), .src = tier_loc_file(id, MAXB), .len = n,
			.flags = TIER_XFER_CRC_VERIFY, .crc = crc };
	assert_int_equal(tier_offload_copy(off, &r), 0);
	tier_xfer out = { .dst = tier_loc_file(id, 2 * MAXB), .src = tier_loc_device(d), .len = n, .flags = TIER_XFER_CRC_COMPUTE };
	tier_fence *f;
	assert_int_equal(tier_offload_submit(off, &out, &f), 0);
	assert_int_equal(tier_fence_wait(f), 0);
	assert_int_equal(tier_fence_crc(f), crc);
	tier_fence_put(f);
	tier_xfer in = { .dst = tier_loc_host(back), .src = tier_loc_file(id, 2 * MAXB), .len = n };
	assert_int_equal(tier_offload_copy(off, &in), 0);
	assert_int_equal(tier_pattern_check(back, n, seed, 0), n);
	r.crc ^= 1;
	assert_int_equal(tier_offload_copy(off, &r), -EBADMSG);
	tier_offload_set_faults(off, &(tier_offload_faults){ .fail_read_nth = 2, .error = -EIO });
	r.crc ^= 1;
	r.dst = tier_loc_device(d2);
	assert_int_equal(tier_offload_copy(off, &r), -EIO);
	tier_offload_set_faults(off, NULL);
	tier_offload_unregister_file(off, id);
	close(fd);
	tier_host_free(h, 1);
	tier_host_free(back, 1);
	tier_dev_free(dev, d);
	tier_dev_free(dev, d2);
}

int main(void)
{
	tier_offload_config cfg = { .chunk_bytes = 1u << 20, .staging_bytes = 1u << 20, .staging_count = 3 };
	const char *tmp = getenv("TMPDIR");
	uint64_t seed = tier_now_ns();
	if (!tier_cuda_available()) {
		printf("# test_offload_cuda: no CUDA device, skipped\n");
		return 77;
	}
	printf("# test_offload_cuda seed %llu\n", (unsigned long long)seed);
	tier_rng_seed(&rng, seed);
	snprintf(dir, sizeof dir, "%s/tier-offload-cuda-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(dir) || tier_dev_open(&dev, TIER_DEV_CUDA, 0))
		return 1;
	cfg.dev = dev;
	if (tier_offload_create(&off, &cfg)) {
		fprintf(stderr, "%s\n", tier_last_error());
		return 1;
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_copy_streams),
		cmocka_unit_test(test_staging),
		cmocka_unit_test(test_urgent_stream),
		cmocka_unit_test(test_wait_promotes),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	tier_offload_destroy(off);
	tier_dev_close(dev);
	rmdir(dir);
	return rc;
}
