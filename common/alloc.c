/* The allocation wrapper. Failure injection costs one branch on a global that is zero in
 * production; the allocators themselves are the C library's. */
#include "alloc.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Large arrays (tables, snapshot buffers, scratch) start on a 2 MiB boundary and ask for
 * transparent huge pages: a 0.5 GiB table then takes 256 page faults to fill instead of 131072,
 * and a lookup's scattered row reads miss the TLB far less. Below this size it is not worth the
 * alignment's slack. */
#define HUGE_ALIGN (2u << 20)
#define HUGE_MIN (8u << 20)

static long fail_countdown;

static int injected_failure(void) {
  if (fail_countdown <= 0)
    return 0;
  if (fail_countdown == 1)
    return 1; /* stays at 1: every later allocation fails too */
  fail_countdown--;
  return 0;
}

void embps_alloc_fail_after(long n) { fail_countdown = n; }

void *embps_malloc(size_t size) { return injected_failure() ? NULL : malloc(size ? size : 1); }

void *embps_calloc(size_t n, size_t size) {
  return injected_failure() ? NULL : calloc(n ? n : 1, size ? size : 1);
}

void *embps_realloc(void *p, size_t size) {
  return injected_failure() ? NULL : realloc(p, size ? size : 1);
}

void *embps_aligned_alloc(size_t size) {
  void *p = NULL;
  if (injected_failure())
    return NULL;
  if (size >= HUGE_MIN) {
    if (posix_memalign(&p, HUGE_ALIGN, size) != 0)
      return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, size & ~(size_t)(HUGE_ALIGN - 1), MADV_HUGEPAGE); /* advice only */
#endif
    return p;
  }
  if (posix_memalign(&p, 64, size ? size : 64) != 0)
    return NULL;
  return p;
}

void *embps_map_alloc(size_t size) {
  size_t len = size ? size : 1, extra = len >= HUGE_MIN ? HUGE_ALIGN : 0;
  uint8_t *p, *aligned;
  if (injected_failure() || len > SIZE_MAX - 2 * HUGE_ALIGN)
    return NULL;
  p = mmap(NULL, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  if (!extra)
    return p;
  /* Map a huge page more than asked and unmap the slack on both sides of the aligned part. */
  aligned = (uint8_t *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
  if (aligned > p)
    munmap(p, (size_t)(aligned - p));
  if ((size_t)(aligned - p) < extra)
    munmap(aligned + len, extra - (size_t)(aligned - p));
#ifdef MADV_HUGEPAGE
  (void)madvise(aligned, len & ~(size_t)(HUGE_ALIGN - 1), MADV_HUGEPAGE); /* advice only */
#endif
  return aligned;
}

void embps_map_free(void *p, size_t size) {
  if (p)
    munmap(p, size ? size : 1);
}

void embps_free(void *p) { free(p); }

char *embps_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = embps_malloc(n);
  if (d)
    memcpy(d, s, n);
  return d;
}
