/* common/hist.c: an observation lands in the first bucket whose upper bound it does not exceed
 * (Prometheus' "le"), past the last bound in the +Inf bucket; the count and the sum (in 1e-9
 * units, negatives counted as 0) follow every observation; the bound tables are ascending; more
 * bounds than EMBPS_HIST_MAX_BUCKETS are cut to it. Threads observing at once lose nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <string.h>

#include "common/hist.h"

static uint64_t bucket(embps_hist_t *h, size_t b) { return atomic_load(&h->counts[b]); }

static void test_buckets(void **state) {
  static const double bounds[] = {1, 2, 4};
  embps_hist_t h;
  (void)state;
  embps_hist_init(&h, bounds, 3);
  embps_hist_observe(&h, 0.5); /* <= 1 */
  embps_hist_observe(&h, 1);   /* a value on a bound is in that bound's bucket */
  embps_hist_observe(&h, 1.5); /* <= 2 */
  embps_hist_observe(&h, 4);   /* <= 4 */
  embps_hist_observe(&h, 4.01);
  embps_hist_observe(&h, 1e9); /* +Inf */
  assert_int_equal(bucket(&h, 0), 2);
  assert_int_equal(bucket(&h, 1), 1);
  assert_int_equal(bucket(&h, 2), 1);
  assert_int_equal(bucket(&h, 3), 2);
  assert_int_equal(atomic_load(&h.count), 6);
  /* 0.5 + 1 + 1.5 + 4 + 4.01 + 1e9, in 1e-9 units. */
  assert_true(atomic_load(&h.sum_nanos) >= UINT64_C(1000000011000000000) &&
              atomic_load(&h.sum_nanos) <= UINT64_C(1000000011010000000));
}

static void test_negative_and_ns(void **state) {
  static const double bounds[] = {0.001};
  embps_hist_t h;
  (void)state;
  embps_hist_init(&h, bounds, 1);
  embps_hist_observe(&h, -3); /* in the first bucket; adds nothing to the sum */
  assert_int_equal(bucket(&h, 0), 1);
  assert_int_equal(atomic_load(&h.sum_nanos), 0);
  embps_hist_observe_ns(&h, 2000000); /* 2 ms: past the 1 ms bound */
  assert_int_equal(bucket(&h, 1), 1);
  assert_int_equal(atomic_load(&h.count), 2);
  assert_int_equal(atomic_load(&h.sum_nanos), 2000000);
}

static void test_init_clears_and_clips(void **state) {
  double many[EMBPS_HIST_MAX_BUCKETS + 5];
  embps_hist_t h;
  (void)state;
  for (size_t i = 0; i < sizeof(many) / sizeof(many[0]); i++)
    many[i] = (double)i;
  memset(&h, 0xab, sizeof(h));
  embps_hist_init(&h, many, sizeof(many) / sizeof(many[0]));
  assert_int_equal(h.nbounds, EMBPS_HIST_MAX_BUCKETS);
  assert_ptr_equal(h.bounds, many);
  for (size_t b = 0; b <= EMBPS_HIST_MAX_BUCKETS; b++)
    assert_int_equal(bucket(&h, b), 0);
  assert_int_equal(atomic_load(&h.count), 0);
  embps_hist_observe(&h, 1000); /* past every kept bound: the +Inf bucket */
  assert_int_equal(bucket(&h, EMBPS_HIST_MAX_BUCKETS), 1);
}

static void check_table(const double *bounds, size_t n) {
  assert_true(n >= 1 && n <= EMBPS_HIST_MAX_BUCKETS);
  for (size_t i = 1; i < n; i++)
    assert_true(bounds[i - 1] < bounds[i]);
}

static void test_bound_tables(void **state) {
  (void)state;
  check_table(embps_hist_seconds_bounds, embps_hist_seconds_nbounds);
  check_table(embps_hist_long_seconds_bounds, embps_hist_long_seconds_nbounds);
  check_table(embps_hist_count_bounds, embps_hist_count_nbounds);
  assert_true(embps_hist_seconds_bounds[0] == 0.0001);
  assert_true(embps_hist_seconds_bounds[embps_hist_seconds_nbounds - 1] == 10);
  assert_true(embps_hist_long_seconds_bounds[0] == 0.01);
  assert_true(embps_hist_long_seconds_bounds[embps_hist_long_seconds_nbounds - 1] == 1800);
  assert_true(embps_hist_count_bounds[0] == 1);
  assert_true(embps_hist_count_bounds[embps_hist_count_nbounds - 1] == 65536);
}

#define THREADS 4
#define PER_THREAD 100000

static void *observer(void *arg) {
  embps_hist_t *h = arg;
  for (int i = 0; i < PER_THREAD; i++)
    embps_hist_observe(h, (double)(i % 3)); /* 0, 1, 2: buckets 0, 0, 1 */
  return NULL;
}

static void test_threads(void **state) {
  static const double bounds[] = {1, 2};
  pthread_t t[THREADS];
  embps_hist_t h;
  (void)state;
  embps_hist_init(&h, bounds, 2);
  for (int i = 0; i < THREADS; i++)
    assert_int_equal(pthread_create(&t[i], NULL, observer, &h), 0);
  for (int i = 0; i < THREADS; i++)
    pthread_join(t[i], NULL);
  assert_int_equal(atomic_load(&h.count), THREADS * PER_THREAD);
  assert_int_equal(bucket(&h, 0) + bucket(&h, 1), THREADS * PER_THREAD);
  assert_int_equal(bucket(&h, 2), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_buckets),
      cmocka_unit_test(test_negative_and_ns),
      cmocka_unit_test(test_init_clears_and_clips),
      cmocka_unit_test(test_bound_tables),
      cmocka_unit_test(test_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
