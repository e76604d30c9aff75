/* Workers (server/engine/workers.h): every index of a loop runs exactly once, in the shares the
 * header promises, share 0 on the caller, over many loops in a row. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "server/engine/workers.h"

#define MAX_N 100003
#define MAX_SHARES 8

typedef struct record {
  atomic_uchar hits[MAX_N];
  atomic_uint calls;
  size_t lo[MAX_SHARES], hi[MAX_SHARES]; /* by share, found from lo */
  atomic_int caller_ran_zero;
  atomic_int bad; /* calls with an empty or out-of-range share (checked on the caller) */
  pthread_t caller;
  size_t n;
  unsigned k;
} record_t;

static void visit(void *arg, size_t lo, size_t hi) {
  record_t *r = arg;
  unsigned call = atomic_fetch_add(&r->calls, 1);
  if (!(lo < hi && hi <= r->n) || call >= MAX_SHARES) {
    atomic_fetch_add(&r->bad, 1);
    return;
  }
  for (size_t i = lo; i < hi; i++)
    atomic_fetch_add(&r->hits[i], 1);
  if (lo == 0 && pthread_equal(pthread_self(), r->caller))
    atomic_store(&r->caller_ran_zero, 1);
  /* Which share this is: the one whose edge n*i/k is lo. */
  for (unsigned i = 0; i < r->k; i++)
    if ((size_t)((unsigned __int128)r->n * i / r->k) == lo) {
      r->lo[i] = lo;
      r->hi[i] = hi;
    }
}

/* Runs one loop and checks it: k shares as the header says, each index once. */
static void check_loop(embps_workers_t *w, record_t *r, size_t n, size_t min_share) {
  size_t k = embps_workers_threads(w);
  if (min_share > 1 && n / min_share < k)
    k = n / min_share;
  if (n < k)
    k = n;
  if (k < 1)
    k = 1;
  memset(r, 0, sizeof(*r));
  r->caller = pthread_self();
  r->n = n;
  r->k = (unsigned)k;
  embps_workers_run(w, n, min_share, visit, r);
  assert_int_equal(atomic_load(&r->bad), 0);
  if (n == 0) {
    assert_int_equal(atomic_load(&r->calls), 0);
    return;
  }
  assert_int_equal(atomic_load(&r->calls), k);
  assert_true(atomic_load(&r->caller_ran_zero));
  for (size_t i = 0; i < n; i++)
    if (atomic_load(&r->hits[i]) != 1)
      fail_msg("n %zu, %zu shares: index %zu ran %u times", n, k, i,
               (unsigned)atomic_load(&r->hits[i]));
  for (unsigned i = 0; i < k; i++) {
    assert_int_equal(r->lo[i], (size_t)((unsigned __int128)n * i / k));
    assert_int_equal(r->hi[i], (size_t)((unsigned __int128)n * (i + 1) / k));
  }
}

static void test_shares(void **state) {
  static record_t r;
  const unsigned threads[] = {0, 1, 2, 3, 5, 8};
  const size_t sizes[] = {0, 1, 2, 7, 511, 512, 1023, 1024, 1536, 4096, MAX_N};
  const size_t mins[] = {0, 1, 512};
  (void)state;
  for (size_t t = 0; t < sizeof(threads) / sizeof(threads[0]); t++) {
    unsigned got = 0;
    embps_workers_t *w = embps_workers_new(threads[t], &got);
    assert_non_null(w);
    assert_int_equal(got, threads[t] ? threads[t] : 1);
    assert_int_equal(embps_workers_threads(w), got);
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++)
      for (size_t m = 0; m < sizeof(mins) / sizeof(mins[0]); m++)
        check_loop(w, &r, sizes[s], mins[m]);
    embps_workers_free(w);
  }
  check_loop(NULL, &r, 1000, 0); /* no pool: all on the caller */
  embps_workers_free(NULL);
}

/* Many short loops back to back: a helper that missed a wake-up, ran a share twice or let the
 * caller return early would show as a wrong count here (and to ThreadSanitizer). */
static void test_many_loops(void **state) {
  static record_t r;
  embps_workers_t *w = embps_workers_new(4, NULL);
  (void)state;
  assert_non_null(w);
  for (int i = 0; i < 2000; i++)
    check_loop(w, &r, (size_t)(i % 37) * 3 + 4, 1);
  embps_workers_free(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shares),
      cmocka_unit_test(test_many_loops),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
