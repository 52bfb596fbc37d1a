/* fileio.c - blocking file reads and writes (worker threads), and fault injection for all file I/O. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "offload_impl.h"

int fault_io(tier_offload *off, int is_write, uint64_t *len, int direct, int *corrupt)
{
	int rc = 0;
	*corrupt = 0;
	pthread_mutex_lock(&off->faultmu);
	const tier_offload_faults *f = &off->faults;
	uint64_t nth = is_write ? atomic_fetch_add(&off->nwrites, 1) + 1 : atomic_fetch_add(&off->nreads, 1) + 1;
	if (nth == (is_write ? f->fail_write_nth : f->fail_read_nth)) {
		rc = f->error < 0 ? f->error : -EIO;
	} else if (nth == (is_write ? f->short_write_nth : f->short_read_nth) && *len > 1) {
		uint64_t n = *len / 2;
		if (direct)
			n &= ~(uint64_t)(OFF_ALIGN - 1);
		if (n)
			*len = n;
	} else if (!is_write && nth == f->corrupt_read_nth) {
		*corrupt = 1;
	}
	pthread_mutex_unlock(&off->faultmu);
	return rc;
}

void fault_corrupt(void *buf, uint64_t len)
{
	if (len)
		((unsigned char *)buf)[len / 2] ^= 0x5a;
}

void tier_offload_set_faults(tier_offload *off, const tier_offload_faults *faults)
{
	if (!off)
		return;
	pthread_mutex_lock(&off->faultmu);
	if (faults)
		off->faults = *faults;
	else
		memset(&off->faults, 0, sizeof off->faults);
	atomic_store(&off->nreads, 0);
	atomic_store(&off->nwrites, 0);
	pthread_mutex_unlock(&off->faultmu);
}

int file_rw(tier_offload *off, int fd, int direct, int is_read, char *mem, uint64_t len, uint64_t foff,
	    char *msg, size_t msglen)
{
	uint64_t done = 0;
	while (done < len) {
		uint64_t n = len - done;
		int corrupt;
		int rc = fault_io(off, !is_read, &n, direct, &corrupt);
		if (rc) {
			snprintf(msg, msglen, "injected fault: file %s of %llu bytes at offset %llu fails with %s",
				 is_read ? "read" : "write", (unsigned long long)n,
				 (unsigned long long)(foff + done), tier_strerror(rc));
			return rc;
		}
		ssize_t r = is_read ? pread(fd, mem + done, n, (off_t)(foff + done))
				    : pwrite(fd, mem + done, n, (off_t)(foff + done));
		if (r < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (r < 0) {
			int e = -errno;
			snprintf(msg, msglen, "file %s of %llu bytes at offset %llu (fd %d) failed: %s",
				 is_read ? "read" : "write", (unsigned long long)n,
				 (unsigned long long)(foff + done), fd, strerror(-e));
			return e;
		}
		if (r == 0) {
			snprintf(msg, msglen, "file %s at offset %llu (fd %d) moved 0 bytes: %s",
				 is_read ? "read" : "write", (unsigned long long)(foff + done), fd,
				 is_read ? "the file ends before the extent; was it truncated?" : "device full?");
			return is_read ? -EIO : -ENOSPC;
		}
		if (corrupt)
			fault_corrupt(mem + done, (uint64_t)r);
		done += (uint64_t)r;
		if (done < len)
			atomic_fetch_add(&off->resubmits, 1);
	}
	return 0;
}

void chunk_ends(const chunk *c, int *fd, uint64_t *foff, char **mem, int *is_read)
{
	const job *j = c->job;
	if (j->x.src.kind == TIER_MEM_FILE) {
		*is_read = 1;
		*fd = j->fd_src;
		*foff = j->x.src.offset + c->off;
		*mem = (char *)j->x.dst.ptr + c->off;
	} else {
		*is_read = 0;
		*fd = j->fd_dst;
		*foff = j->x.dst.offset + c->off;
		*mem = (char *)j->x.src.ptr + c->off;
	}
}

int file_io_chunk(tier_offload *off, chunk *c, char *msg, size_t msglen)
{
	int fd, is_read;
	uint64_t foff;
	char *mem;
	chunk_ends(c, &fd, &foff, &mem, &is_read);
	return file_rw(off, fd, c->job->direct, is_read, mem, c->len, foff, msg, msglen);
}
