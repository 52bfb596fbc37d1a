/* meta_alloc.c - the store's metadata allocator: a private jemalloc arena, or malloc. */
#include "config.h"
#include <pthread.h>
#include <stdlib.h>
#include "tier/base.h"
#include "tier/meta_alloc.h"
#ifdef TIER_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif

static pthread_once_t once = PTHREAD_ONCE_INIT;
static unsigned arena;
static int flags;   /* 0: plain malloc; else MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE */

/* Decided once per process, so a pointer is always freed by the allocator that made it. */
static void arena_init(void)
{
	size_t sz = sizeof arena;
	if (RUNNING_ON_VALGRIND)
		return;
	if (mallctl("arenas.create", &arena, &sz, NULL, 0) != 0) {
		tier_log(TIER_LOG_WARN, "jemalloc: cannot create an arena for metadata; using malloc");
		return;
	}
	flags = MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE;
}

void *tier_meta_alloc(size_t size)
{
	if (size == 0)
		return NULL;
	pthread_once(&once, arena_init);
	return flags ? mallocx(size, flags) : malloc(size);
}

void *tier_meta_calloc(size_t n, size_t size)
{
	size_t total;
	if (__builtin_mul_overflow(n, size, &total) || total == 0)
		return NULL;
	pthread_once(&once, arena_init);
	return flags ? mallocx(total, flags | MALLOCX_ZERO) : calloc(n, size);
}

void tier_meta_free(void *p)
{
	if (!p)
		return;
	if (flags)
		dallocx(p, MALLOCX_TCACHE_NONE);
	else
		free(p);
}

int tier_meta_uses_arena(void)
{
	pthread_once(&once, arena_init);
	return flags != 0;
}

#else /* no jemalloc */

void *tier_meta_alloc(size_t size) { return size ? malloc(size) : NULL; }

void *tier_meta_calloc(size_t n, size_t size)
{
	size_t total;
	if (__builtin_mul_overflow(n, size, &total) || total == 0)
		return NULL;
	return calloc(n, size);
}

void tier_meta_free(void *p) { free(p); }
int tier_meta_uses_arena(void) { return 0; }

#endif
