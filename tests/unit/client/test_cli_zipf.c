/* client/cli/zipf.c: the token generator follows Zipf(a) (uniform at a = 0) and stays in
 * range. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/zipf.h"

#define SAMPLES 2000000

/* Draws SAMPLES ranks over 1..n and compares the first ranks' frequencies with k^-a / H. */
static void check_distribution(uint64_t n, double a) {
  embps_zipf_t z;
  embps_rng_t r;
  uint64_t *count = calloc(n + 1, sizeof(*count));
  double hsum = 0;
  assert_non_null(count);
  assert_int_equal(embps_zipf_init(&z, n, a), 0);
  embps_rng_seed(&r, 12345);
  for (int i = 0; i < SAMPLES; i++) {
    uint64_t k = embps_zipf_sample(&z, &r);
    assert_true(k >= 1 && k <= n);
    count[k]++;
  }
  for (uint64_t k = 1; k <= n; k++)
    hsum += pow((double)k, -a);
  for (uint64_t k = 1; k <= (n < 20 ? n : 20); k++) {
    double expect = pow((double)k, -a) / hsum * SAMPLES;
    double sd = sqrt(expect);
    if (fabs((double)count[k] - expect) > 6 * sd + 0.01 * expect)
      fail_msg("n=%llu a=%g: rank %llu drawn %llu times, expected %.0f", (unsigned long long)n, a,
               (unsigned long long)k, (unsigned long long)count[k], expect);
  }
  /* and the tail as a whole */
  {
    uint64_t tail = 0;
    double expect = 0;
    for (uint64_t k = n / 2 + 1; k <= n; k++) {
      tail += count[k];
      expect += pow((double)k, -a) / hsum * SAMPLES;
    }
    if (fabs((double)tail - expect) > 6 * sqrt(expect) + 0.01 * expect)
      fail_msg("n=%llu a=%g: tail drawn %llu times, expected %.0f", (unsigned long long)n, a,
               (unsigned long long)tail, expect);
  }
  free(count);
}

static void test_zipf_follows_distribution(void **state) {
  (void)state;
  check_distribution(1000, 1.1);
  check_distribution(1000, 1.0);
  check_distribution(100, 0.5);
  check_distribution(50, 2.0);
  check_distribution(1000, 0.0); /* uniform */
}

static void test_range_and_edges(void **state) {
  embps_zipf_t z;
  embps_rng_t r;
  (void)state;
  embps_rng_seed(&r, 1);
  assert_int_equal(embps_zipf_init(&z, 1, 1.2), 0);
  for (int i = 0; i < 1000; i++)
    assert_int_equal(embps_zipf_sample(&z, &r), 1);
  assert_int_equal(embps_zipf_init(&z, 1000000000000ull, 1.05), 0);
  for (int i = 0; i < 100000; i++) {
    uint64_t k = embps_zipf_sample(&z, &r);
    assert_true(k >= 1 && k <= 1000000000000ull);
  }
  assert_int_equal(embps_zipf_init(&z, 3, 0.0), 0);
  for (int i = 0; i < 10000; i++) {
    uint64_t k = embps_zipf_sample(&z, &r);
    assert_true(k >= 1 && k <= 3);
  }
  assert_int_equal(embps_zipf_init(&z, 0, 1.0), -1);
  assert_int_equal(embps_zipf_init(&z, 10, -1.0), -1);
  assert_int_equal(embps_zipf_init(&z, 10, NAN), -1);
}

static void test_uniform_double(void **state) {
  embps_rng_t r;
  double sum = 0;
  (void)state;
  embps_rng_seed(&r, 7);
  for (int i = 0; i < 100000; i++) {
    double u = embps_rng_uniform(&r);
    assert_true(u >= 0.0 && u < 1.0);
    sum += u;
  }
  assert_true(fabs(sum / 100000 - 0.5) < 0.01);
}

/* --tokens: uniform by default and whatever --zipf says only when zipf is asked for (or --zipf
 * alone); nonsense and contradictions are refused. The sampler at the chosen exponent is
 * tested above. */
static void test_token_distribution_option(void **state) {
  double e = -1;
  (void)state;
  assert_int_equal(embps_token_exponent(NULL, NULL, 0.0, &e), 0);
  assert_true(e == 0.0);
  assert_int_equal(embps_token_exponent("uniform", NULL, 0.0, &e), 0);
  assert_true(e == 0.0);
  assert_int_equal(embps_token_exponent("zipf", NULL, 0.0, &e), 0);
  assert_true(e == EMBPS_ZIPF_DEFAULT_EXPONENT && e == 1.05);
  assert_int_equal(embps_token_exponent("zipf", "1.3", 1.3, &e), 0);
  assert_true(e == 1.3);
  assert_int_equal(embps_token_exponent(NULL, "0.9", 0.9, &e), 0);
  assert_true(e == 0.9);
  assert_int_equal(embps_token_exponent("uniform", "0", 0.0, &e), 0);
  assert_true(e == 0.0);
  e = 7;
  assert_int_equal(embps_token_exponent("uniform", "1.1", 1.1, &e), -1);
  assert_int_equal(embps_token_exponent("gauss", NULL, 0.0, &e), -1);
  assert_true(e == 7); /* untouched on refusal */
}

/* The bench's keys for hash-keyed tables: MurmurHash3's fmix64 (its published values), a
 * bijection (distinct ranks give distinct keys: checked on a run of ranks and inverted by its
 * inverse), never 0 for a rank >= 1, and spread over the whole 64-bit range, negative halves
 * included. */
static uint64_t unmix(uint64_t k) { /* fmix64's inverse: each step undone in reverse */
  k ^= k >> 33;
  k *= UINT64_C(0x9cb4b2f8129337db); /* inverse of 0xc4ceb9fe1a85ec53 mod 2^64 */
  k ^= k >> 33;
  k *= UINT64_C(0x4f74430c22a54005); /* inverse of 0xff51afd7ed558ccd mod 2^64 */
  k ^= k >> 33;
  return k;
}

static void test_key_mix(void **state) {
  int high = 0, negative = 0;
  (void)state;
  assert_true(embps_key_mix(0) == 0);
  for (uint64_t r = 1; r <= 100000; r++) {
    uint64_t k = embps_key_mix(r);
    assert_true(k != 0);
    assert_true(unmix(k) == r);
    high += (k >> 62) == 3;
    negative += (int64_t)k < 0;
  }
  /* a quarter in the top quarter of the range, half negative as int64: +-1% */
  assert_in_range(high, 24000, 26000);
  assert_in_range(negative, 49000, 51000);
  assert_true(embps_key_mix(1) == UINT64_C(0xb456bcfc34c2cb2c));
}

static void test_key_space(void **state) {
  (void)state;
  assert_true(embps_bench_key_space(1000, 0, 0) == 999); /* dense: [1, rows) */
  assert_true(embps_bench_key_space(1000, 0, 10) == 10);
  assert_true(embps_bench_key_space(0, 4096, 0) == 40960); /* hash-keyed: 10 x capacity */
  assert_true(embps_bench_key_space(0, 4096, 7) == 7);
  assert_true(embps_bench_key_space(0, UINT64_C(1) << 61, 0) == EMBPS_KEY_SPACE_MAX);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zipf_follows_distribution),
      cmocka_unit_test(test_range_and_edges),
      cmocka_unit_test(test_token_distribution_option),
      cmocka_unit_test(test_uniform_double),
      cmocka_unit_test(test_key_mix),
      cmocka_unit_test(test_key_space),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
