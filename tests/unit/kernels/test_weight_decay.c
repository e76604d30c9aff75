/* embps_apply_weight_decay_cpu: g[i] += wd * w[rows[i]] for both dtypes, read from the right
 * table row, and an exact no-op when wd == 0. */
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static void run(embps_dtype_t dtype, kt_rng_t *rng) {
  size_t num_rows = 30, width = 13, n = 11;
  size_t es = embps_dtype_size(dtype);
  void *table = kt_alloc(num_rows * width * es);
  float *wv = kt_alloc(num_rows * width * sizeof(float));
  for (size_t k = 0; k < num_rows * width; k++) {
    float v = kt_uniform(rng, -2.0f, 2.0f);
    if (dtype == EMBPS_DTYPE_BF16) {
      ((uint16_t *)table)[k] = embps_f32_to_bf16(v);
      wv[k] = kt_bf16_round(v);
    } else {
      ((float *)table)[k] = v;
      wv[k] = v;
    }
  }
  int64_t rows[11];
  for (size_t i = 0; i < n; i++)
    rows[i] = (int64_t)(num_rows - 1 - 2 * i); /* distinct, descending */
  float *g = kt_alloc(n * width * sizeof(float));
  float *g0 = kt_alloc(n * width * sizeof(float));
  for (size_t k = 0; k < n * width; k++)
    g0[k] = g[k] = kt_uniform(rng, -1.0f, 1.0f);

  const float wd = 0.03f;
  embps_apply_weight_decay_cpu(table, dtype, width, rows, n, g, wd);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < width; j++) {
      double want = (double)g0[i * width + j] + (double)wd * wv[(size_t)rows[i] * width + j];
      assert_true(fabs(g[i * width + j] - want) <= 1e-6 * (fabs(want) + 1e-3));
    }

  /* wd == 0 leaves g untouched, even where the table holds NaN. */
  if (dtype == EMBPS_DTYPE_F32)
    ((float *)table)[(size_t)rows[0] * width] = NAN;
  memcpy(g, g0, n * width * sizeof(float));
  embps_apply_weight_decay_cpu(table, dtype, width, rows, n, g, 0.0f);
  assert_memory_equal(g, g0, n * width * sizeof(float));

  free(g0);
  free(g);
  free(wv);
  free(table);
}

static void test_f32(void **state) {
  (void)state;
  kt_rng_t rng = {41};
  run(EMBPS_DTYPE_F32, &rng);
}

static void test_bf16(void **state) {
  (void)state;
  kt_rng_t rng = {42};
  run(EMBPS_DTYPE_BF16, &rng);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_f32),
      cmocka_unit_test(test_bf16),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
