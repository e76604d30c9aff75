/* client/cli/hdr.c: the bench's log-linear latency histogram. Its percentiles are checked
 * against exact nearest-rank percentiles of the same samples, sorted here: never below the
 * exact value and within 0.1% above it (three significant digits); exact below 2048 ns. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/hdr.h"

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static uint64_t exact(const uint64_t *sorted, size_t n, double p) {
  size_t r = (size_t)ceil(p / 100.0 * (double)n);
  return sorted[r > 0 ? r - 1 : 0];
}

static uint64_t next_rand(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static const double pcts[] = {0.001, 1, 10, 25, 50, 75, 90, 99, 99.9, 99.99, 99.999, 100};

static void check_against_exact(uint64_t *v, size_t n) {
  embps_hdr_t h;
  assert_int_equal(embps_hdr_init(&h), 0);
  for (size_t i = 0; i < n; i++)
    embps_hdr_record(&h, v[i]);
  qsort(v, n, sizeof(*v), cmp_u64);
  assert_int_equal(h.count, n);
  assert_true(h.min == v[0] && h.max == v[n - 1]);
  for (size_t i = 0; i < sizeof(pcts) / sizeof(pcts[0]); i++) {
    uint64_t want = exact(v, n, pcts[i]), got = embps_hdr_percentile(&h, pcts[i]);
    assert_true(got >= want);
    if (want < 2048)
      assert_true(got == want);
    else
      assert_true((double)(got - want) <= (double)want / 1000.0);
  }
  embps_hdr_free(&h);
}

static void test_log_uniform(void **state) {
  /* 200 000 latencies spread log-uniformly from 100 ns to 100 s. */
  size_t n = 200000;
  uint64_t seed = 42, *v = malloc(n * sizeof(*v));
  (void)state;
  assert_non_null(v);
  for (size_t i = 0; i < n; i++) {
    double u = (double)(next_rand(&seed) >> 11) / 9007199254740992.0;
    v[i] = (uint64_t)(100.0 * pow(1e9, u));
  }
  check_against_exact(v, n);
  free(v);
}

static void test_small_and_tail(void **state) {
  /* Mostly small exact values with a long tail, and few samples (every rank matters). */
  uint64_t seed = 7, v[1000];
  (void)state;
  for (size_t i = 0; i < 1000; i++)
    v[i] = i % 100 == 99 ? 500000000 + next_rand(&seed) % 1000000000 : next_rand(&seed) % 3000;
  check_against_exact(v, 1000);
  v[0] = 5;
  check_against_exact(v, 1);
}

static void test_add_and_edges(void **state) {
  embps_hdr_t a, b, all;
  uint64_t seed = 3;
  (void)state;
  assert_int_equal(embps_hdr_init(&a), 0);
  assert_int_equal(embps_hdr_init(&b), 0);
  assert_int_equal(embps_hdr_init(&all), 0);
  assert_int_equal(embps_hdr_percentile(&a, 50), 0); /* empty */
  assert_true(embps_hdr_mean(&a) == 0.0);
  for (int i = 0; i < 5000; i++) {
    uint64_t x = next_rand(&seed) % 50000000;
    embps_hdr_record(i % 3 ? &a : &b, x);
    embps_hdr_record(&all, x);
  }
  embps_hdr_add(&a, &b);
  assert_int_equal(a.count, all.count);
  assert_true(a.min == all.min && a.max == all.max);
  assert_memory_equal(a.counts, all.counts, EMBPS_HDR_BUCKETS * sizeof(uint64_t));
  assert_true(fabs(embps_hdr_mean(&a) - embps_hdr_mean(&all)) < 1e-6 * embps_hdr_mean(&all));
  assert_int_equal(embps_hdr_count_at_most(&a, UINT64_MAX), a.count);
  /* Beyond the last bucket (2^44 ns) values still count, and the max stays exact. */
  embps_hdr_record(&b, UINT64_MAX);
  assert_true(embps_hdr_percentile(&b, 100) == UINT64_MAX);
  embps_hdr_free(&a);
  embps_hdr_free(&b);
  embps_hdr_free(&all);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_log_uniform),
      cmocka_unit_test(test_small_and_tail),
      cmocka_unit_test(test_add_and_edges),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
