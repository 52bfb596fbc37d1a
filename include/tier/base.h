/* base.h - errors, logging, sizes, clocks, random numbers and the device context. */
#ifndef TIER_BASE_H
#define TIER_BASE_H

#include <stddef.h>
#include <stdint.h>
#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Errors ----------------------------------------------------------------------------------
 * Public functions return 0 or a negative errno code (-ENOMEM, -EINVAL, ...). The library keeps a
 * human-readable message for the last error of the calling thread; the tools print it. */

/* Message of the calling thread's last error ("" when none). Thread-safe (thread-local). */
const char *tier_last_error(void);
/* Record a message for the calling thread and return `code` (a negative errno), so that
 * `return tier_fail(-EINVAL, "bad size %zu", n);` reads naturally. */
int tier_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Clear the calling thread's message. */
void tier_clear_error(void);
/* Short name of an error code: "ENOMEM", "EIO" ... (strerror for others). */
const char *tier_strerror(int code);

/* ---- Logging ---------------------------------------------------------------------------------
 * One function with levels; goes to stderr by default (never stdout). Thread-safe. */
typedef enum { TIER_LOG_ERROR = 0, TIER_LOG_WARN, TIER_LOG_INFO, TIER_LOG_DEBUG } tier_log_level;
typedef void (*tier_log_sink)(tier_log_level level, const char *msg, void *arg);
void tier_log(tier_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Messages above `level` are dropped. Default TIER_LOG_WARN, or $TIER_LOG (error|warn|info|debug). */
void tier_log_set_level(tier_log_level level);
tier_log_level tier_log_get_level(void);
/* Replace the sink (NULL restores stderr). Not thread-safe against concurrent tier_log calls. */
void tier_log_set_sink(tier_log_sink sink, void *arg);

/* ---- Sizes -----------------------------------------------------------------------------------
 * "24G", "512M", "4096", "1.5T", "64k", "2GiB". Binary units (K = 1024). Returns 0, or -EINVAL
 * (message names the text) on malformed input or -ERANGE on overflow; *out unchanged on failure. */
int tier_parse_size(const char *text, uint64_t *out);
/* Format bytes as "1.50 GiB" into buf (always NUL-terminated). Returns buf. */
char *tier_format_size(uint64_t bytes, char *buf, size_t len);

/* ---- Checked arithmetic: return 1 on overflow (result unspecified), 0 otherwise. ---------- */
static inline int tier_mul_overflow(uint64_t a, uint64_t b, uint64_t *r) { return __builtin_mul_overflow(a, b, r); }
static inline int tier_add_overflow(uint64_t a, uint64_t b, uint64_t *r) { return __builtin_add_overflow(a, b, r); }
static inline uint64_t tier_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- Clock and random numbers ---------------------------------------------------------------- */
uint64_t tier_now_ns(void);     /* CLOCK_MONOTONIC in nanoseconds */
typedef struct { uint64_t s[4]; } tier_rng;  /* xoshiro256** */
void tier_rng_seed(tier_rng *r, uint64_t seed);
uint64_t tier_rng_next(tier_rng *r);
double tier_rng_uniform(tier_rng *r);        /* [0, 1) */
float tier_rng_normal(tier_rng *r);          /* standard normal */
uint64_t tier_rng_below(tier_rng *r, uint64_t n); /* [0, n), n > 0 */
/* Fill buf with the deterministic byte pattern of (seed, offset): byte i of an object with seed s
 * is tier_pattern_byte(s, i). Used by tests and demos to check content after every move. */
void tier_pattern_fill(void *buf, size_t len, uint64_t seed, uint64_t offset);
/* Returns the index of the first byte that differs from the pattern, or len when all match. */
size_t tier_pattern_check(const void *buf, size_t len, uint64_t seed, uint64_t offset);

/* ---- Device context ---------------------------------------------------------------------------
 * A device context names where compute runs: the CPU (fp32 reference) or one CUDA device (its
 * compute stream and BLAS handles). Compute modules (moe/, attn/, loss/) take one and raw pointers;
 * the CUDA functions launch on its stream. */
typedef enum { TIER_DEV_CPU = 0, TIER_DEV_CUDA = 1 } tier_dev_kind;
typedef struct tier_dev tier_dev;

/* 1 when this build has CUDA and a device is present, else 0. Thread-safe. */
int tier_cuda_available(void);
/* Open a context. CUDA: -ENODEV with a message when the build or the machine has no GPU.
 * On failure *out is NULL and nothing is allocated. */
int tier_dev_open(tier_dev **out, tier_dev_kind kind, int ordinal);
void tier_dev_close(tier_dev *dev);          /* NULL is fine */
tier_dev_kind tier_dev_kind_of(const tier_dev *dev);
int tier_dev_ordinal(const tier_dev *dev);
const char *tier_dev_name(const tier_dev *dev); /* "cpu" or the GPU's name */
/* CUDA: the compute stream (a cudaStream_t) and a cuBLASLt handle (cublasLtHandle_t); NULL on CPU. */
void *tier_dev_stream(const tier_dev *dev);
void *tier_dev_blaslt(const tier_dev *dev);
/* CUDA: a 32 MiB workspace for cuBLASLt on this device; NULL on CPU. */
void *tier_dev_blaslt_workspace(const tier_dev *dev, size_t *bytes);
/* CUDA lanes: side streams for independent work (e.g. one product per expert) that would leave
 * SMs idle one at a time. fork: lanes 0..n-1 (made on first use, each with an 8 MiB cuBLASLt
 * workspace) wait for the work queued so far on the compute stream; join: the compute stream waits
 * for everything queued on them. lane_stream: lane i's stream and workspace, or the compute
 * stream's when i is out of range or the context is a CPU one. n in 1..TIER_DEV_LANES; 0, -EINVAL,
 * -ENOMEM or -EIO. A CPU context does nothing. */
#define TIER_DEV_LANES 4
int tier_dev_lanes_fork(tier_dev *dev, int n);
int tier_dev_lanes_join(tier_dev *dev, int n);
void *tier_dev_lane_stream(const tier_dev *dev, int i, void **ws, size_t *ws_bytes);
/* Copy lanes: copies that overlap the compute stream's work (an operator's output on its way to
 * DDR and back), each lane a stream of its own. copy_async queues n bytes from src to dst on
 * `lane` after the work queued so far on the compute stream; src must not change, nor dst be
 * read, until a join: copy_join makes the compute stream wait for every copy queued so far on the
 * lane (the other lane's go on). tier_dev_sync waits for them too. A CPU context copies at once
 * (join does nothing). 0, -EINVAL (NULL pointer, lane outside 0..TIER_DEV_COPY_LANES-1) or -EIO. */
#define TIER_DEV_COPY_LANES 2
int tier_dev_copy_async(tier_dev *dev, void *dst, const void *src, size_t n, int lane);
int tier_dev_copy_join(tier_dev *dev, int lane);
/* Upload: n bytes of host memory at src to device memory at dst, queued on the compute stream
 * without waiting for it (a synchronous copy drains the stream first, and the host then refills
 * it from empty). src is staged into a pinned buffer of the context during the call, so the caller
 * may change or free it on return; a buffer is reused once its copy is done (4 of them, grown to
 * the largest upload). A CPU context copies at once. 0, -EINVAL (NULL pointer), -ENOMEM or -EIO. */
int tier_dev_put_async(tier_dev *dev, void *dst, const void *src, size_t n);
/* CUDA: wait for the queued work, then start (on 1) or stop (0) the profiler's collection
 * (cudaProfilerStart/Stop: what `ncu --profile-from-start off` or `nsys --capture-range=cudaProfilerApi`
 * record). 0 or -EIO; nothing on a CPU context. */
int tier_dev_profiler(tier_dev *dev, int on);
/* Wait for all work queued on the context. Returns 0 or -EIO (message says what CUDA reported). */
int tier_dev_sync(tier_dev *dev);
/* NUMA node closest to the device (-1 when unknown, 0 on a CPU context without libnuma). */
int tier_dev_numa_node(const tier_dev *dev);

/* Marks: the device's time between tagged points of the compute stream (a CUDA event each; the
 * host clock on a CPU context, whose work is done when queued). begin forgets the marks put so
 * far; put records one with a tag; collect adds the time from each mark to the next to
 * ns_by_tag[tag of the later one] (tags outside 0..ntags-1 are not charged: -1 for an origin),
 * waiting for the marks to complete. A mark's time includes any gap in which the device waited
 * for the host. put and collect return 0, -ENOMEM or -EIO (collect with a message); after a failed
 * put, later puts and collect fail until the next begin. */
typedef struct tier_marks tier_marks;
int tier_marks_open(tier_marks **out, tier_dev *dev);
void tier_marks_close(tier_marks *m); /* NULL is fine */
void tier_marks_begin(tier_marks *m);
int tier_marks_put(tier_marks *m, int tag);
int tier_marks_collect(tier_marks *m, uint64_t *ns_by_tag, int ntags);
int tier_marks_count(const tier_marks *m);

/* Waypoints: a point of the compute stream that the host waits for later, so that it can queue more
 * work meanwhile (a CUDA event; a CPU context's work is done when queued and its waypoints are
 * passed at once). put marks the work queued so far; wait returns once that work is done (at once
 * when nothing was put since the last wait). 0, -ENOMEM or -EIO (with a message). */
typedef struct tier_waypoint tier_waypoint;
int tier_waypoint_open(tier_waypoint **out, tier_dev *dev);
void tier_waypoint_close(tier_waypoint *f); /* NULL is fine */
int tier_waypoint_put(tier_waypoint *f);
int tier_waypoint_wait(tier_waypoint *f);
int tier_waypoint_pending(const tier_waypoint *f); /* 1 between a put and its wait */

/* Raw memory primitives. Only the store (and tests, benchmarks) call these: every byte the engine
 * uses goes through the store's budgets. Device memory on CUDA, host memory on CPU. */
int tier_dev_malloc(tier_dev *dev, size_t bytes, void **out);   /* -ENOMEM with message */
void tier_dev_free(tier_dev *dev, void *p);
/* Host memory, page-locked when CUDA is present (and `pinned` asked), page-aligned otherwise. */
int tier_host_malloc(size_t bytes, int pinned, void **out);
void tier_host_free(void *p, int pinned);
/* Copies between device and host on the compute stream, synchronous. 0 or -EIO. */
int tier_dev_memcpy_h2d(tier_dev *dev, void *dst, const void *src, size_t n);
int tier_dev_memcpy_d2h(tier_dev *dev, void *dst, const void *src, size_t n);
/* Queued on the context's stream, not waited for (host memset / memcpy on a CPU context). */
int tier_dev_memset(tier_dev *d, void *dst, int value, size_t n);
int tier_dev_memcpy_d2d(tier_dev *d, void *dst, const void *src, size_t n);

#ifdef __cplusplus
}
#endif
#endif
