/* One allocation wrapper for the whole project, so that tests can fail the N-th allocation and
 * prove that every error path frees what it took (nghttp2's failmalloc tests). */
#ifndef EMBPS_ALLOC_H
#define EMBPS_ALLOC_H

#include <stddef.h>

/** malloc; NULL on failure (or on an injected failure). */
void *embps_malloc(size_t size);
/** calloc; NULL on failure (or on an injected failure). */
void *embps_calloc(size_t n, size_t size);
/** realloc; NULL on failure, leaving p untouched. */
void *embps_realloc(void *p, size_t size);
/** 64-byte aligned allocation (large ones 2 MiB aligned, asking for huge pages), freed with
 * embps_free; NULL on failure. */
void *embps_aligned_alloc(size_t size);
/**
 * size bytes of zeroed memory in a mapping of their own (2 MiB aligned and asking for huge pages
 * from 8 MiB on), which embps_map_free(p, size) hands back to the operating system at once,
 * whatever malloc's settings keep. For large buffers whose release must lower the process's
 * footprint. NULL on failure.
 */
void *embps_map_alloc(size_t size);
/** Unmaps memory from embps_map_alloc; size as asked. NULL is a no-op. */
void embps_map_free(void *p, size_t size);

/** free; NULL is a no-op. */
void embps_free(void *p);
/** strdup through the wrapper. */
char *embps_strdup(const char *s);

/** Tests only: the n-th allocation from now (1-based) and every later one fail; 0 disables.
 * The counter is process-wide and not thread-safe: use it in single-threaded tests. */
void embps_alloc_fail_after(long n);

#endif
