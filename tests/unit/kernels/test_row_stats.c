/* embps_row_stats_cpu against a double-precision reference: row sums within f32 rounding,
 * the total within double rounding and added to the caller's value, exact non-finite counts
 * (NaN, +inf, -inf), and no false alarms for large finite values whose squares overflow f32. */
#include <float.h>
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static void check_rows(const float *g, size_t n, size_t width) {
  float *rs = kt_alloc(n * sizeof(float));
  double total = 5.0; /* the kernel adds to it */
  assert_int_equal(embps_row_stats_cpu(g, n, width, rs, &total), 0);
  double ref_total = 0.0;
  for (size_t i = 0; i < n; i++) {
    double s = 0.0;
    for (size_t j = 0; j < width; j++)
      s += (double)g[i * width + j] * g[i * width + j];
    ref_total += s;
    assert_true(fabs(rs[i] - s) <= 1e-6 * s);
  }
  assert_true(fabs(total - (5.0 + ref_total)) <= 1e-12 * (5.0 + ref_total));
  /* Both outputs are optional. */
  assert_int_equal(embps_row_stats_cpu(g, n, width, NULL, NULL), 0);
  free(rs);
}

static void test_random(void **state) {
  (void)state;
  kt_rng_t rng = {31};
  size_t shapes[][2] = {{1, 1}, {7, 3}, {100, 16}, {64, 129}, {3, 1000}};
  for (size_t s = 0; s < 5; s++) {
    size_t n = shapes[s][0], w = shapes[s][1];
    float *g = kt_alloc(n * w * sizeof(float));
    for (size_t k = 0; k < n * w; k++)
      g[k] = kt_uniform(&rng, -3.0f, 3.0f);
    check_rows(g, n, w);
    free(g);
  }
}

/* One large element followed by many small ones: a naive f32 running sum drops the small
 * squares entirely (1e8 + 1 == 1e8 in f32) and misses by 4e-5 relative. */
static void test_accuracy(void **state) {
  (void)state;
  size_t w = 4096;
  float *g = kt_alloc(w * sizeof(float));
  g[0] = 1e4f;
  for (size_t j = 1; j < w; j++)
    g[j] = 1.0f;
  check_rows(g, 1, w);
  float rs;
  embps_row_stats_cpu(g, 1, w, &rs, NULL);
  assert_true(rs == (float)(1e8 + 4095.0));
  free(g);
}

static void test_non_finite(void **state) {
  (void)state;
  kt_rng_t rng = {32};
  size_t n = 50, w = 24;
  float *g = kt_alloc(n * w * sizeof(float));
  for (size_t k = 0; k < n * w; k++)
    g[k] = kt_uniform(&rng, -1.0f, 1.0f);
  float *rs = kt_alloc(n * sizeof(float));
  double total = 0.0;

  g[3] = NAN;
  assert_int_equal(embps_row_stats_cpu(g, n, w, rs, &total), 1);
  g[3] = INFINITY;
  assert_int_equal(embps_row_stats_cpu(g, n, w, NULL, NULL), 1);
  g[3] = -INFINITY;
  assert_int_equal(embps_row_stats_cpu(g, n, w, NULL, NULL), 1);
  assert_true(isinf(rs[0]) || isnan(rs[0]));

  /* Several in one row (including a NaN and inf together) and in other rows, last element. */
  g[3] = NAN;
  g[4] = INFINITY;
  g[5] = -INFINITY;
  g[10 * w + 7] = -NAN;
  g[n * w - 1] = INFINITY;
  total = 0.0;
  assert_int_equal(embps_row_stats_cpu(g, n, w, rs, &total), 5);
  assert_false(isfinite(total));
  /* A row without bad values keeps a meaningful sum. */
  double s = 0.0;
  for (size_t j = 0; j < w; j++)
    s += (double)g[20 * w + j] * g[20 * w + j];
  assert_true(fabs(rs[20] - s) <= 1e-6 * s);

  /* Count every element of a row being non-finite. */
  for (size_t j = 0; j < w; j++)
    g[30 * w + j] = j % 2 ? NAN : -INFINITY;
  assert_int_equal(embps_row_stats_cpu(g, n, w, NULL, NULL), 5 + w);
  free(rs);
  free(g);
}

static void test_large_finite(void **state) {
  (void)state;
  float g[8] = {FLT_MAX, -FLT_MAX, 3e38f, 1.0f, 2e20f, -2e20f, 0.0f, 1e-30f};
  double total = 0.0;
  float rs[2];
  assert_int_equal(embps_row_stats_cpu(g, 2, 4, rs, &total), 0);
  assert_true(isfinite(total));
  double ref = 2.0 * (double)FLT_MAX * FLT_MAX + 9e76 + 1.0 + 8e40 + 1e-60;
  assert_true(fabs(total - ref) <= 1e-6 * ref);
  assert_true(rs[1] == (float)8e40 || isinf(rs[1]));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random),
      cmocka_unit_test(test_accuracy),
      cmocka_unit_test(test_non_finite),
      cmocka_unit_test(test_large_finite),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
