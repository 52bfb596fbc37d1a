/* safetensors_int.h - helpers shared by core/'s format readers and writers (internal). */
#ifndef TIER_CORE_SAFETENSORS_INT_H
#define TIER_CORE_SAFETENSORS_INT_H
#include <stddef.h>
#include <stdint.h>

/* -ENOTSUP with the message telling to install libjansson-dev and reconfigure. */
int tier_st_no_jansson(const char *what);
/* Read exactly `bytes` at `off` of fd; -errno or -EIO (short) with a message naming path. */
int tier_st_pread(int fd, const char *path, void *dst, size_t bytes, uint64_t off);
/* Read a whole small file (JSON) into a NUL-terminated buffer the caller frees. -errno naming it. */
int tier_read_text_file(const char *path, size_t max_bytes, char **out);
#endif
