/* The allocation wrapper. Failure injection costs one branch on a global that is zero in
 * production; the allocators themselves are the C library's. */
#include "alloc.h"

#include <stdlib.h>
#include <string.h>

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
  if (posix_memalign(&p, 64, size ? size : 64) != 0)
    return NULL;
  return p;
}

void embps_free(void *p) { free(p); }

char *embps_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = embps_malloc(n);
  if (d)
    memcpy(d, s, n);
  return d;
}
