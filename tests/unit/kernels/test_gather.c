/* embps_gather_cpu and embps_expand_cpu against element-by-element copies, for both dtypes,
 * odd widths and repeated rows; a guard region after the output must stay untouched. */
#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define GUARD 64

static void fill_table(void *table, embps_dtype_t dtype, size_t count, kt_rng_t *rng) {
  for (size_t k = 0; k < count; k++) {
    float v = kt_uniform(rng, -10.0f, 10.0f);
    if (dtype == EMBPS_DTYPE_BF16)
      ((uint16_t *)table)[k] = embps_f32_to_bf16(v);
    else
      ((float *)table)[k] = v;
  }
}

static float elem(const void *a, embps_dtype_t dtype, size_t k) {
  return dtype == EMBPS_DTYPE_BF16 ? embps_bf16_to_f32(((const uint16_t *)a)[k])
                                   : ((const float *)a)[k];
}

static void run_gather(embps_dtype_t dtype, size_t width, size_t num_rows, size_t n,
                       kt_rng_t *rng) {
  size_t es = embps_dtype_size(dtype);
  void *table = kt_alloc(num_rows * width * es);
  fill_table(table, dtype, num_rows * width, rng);
  int64_t *rows = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    rows[i] = (int64_t)kt_below(rng, num_rows);
  if (n > 0)
    rows[0] = (int64_t)num_rows - 1; /* the last row, to catch stride errors at the end */
  unsigned char *out = kt_alloc(n * width * es + GUARD);
  memset(out, 0xcd, n * width * es + GUARD);

  embps_gather_cpu(table, dtype, width, rows, n, out);
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < width; j++)
      assert_true(elem(out, dtype, i * width + j) ==
                  elem(table, dtype, (size_t)rows[i] * width + j));
  for (size_t k = 0; k < GUARD; k++)
    assert_int_equal(out[n * width * es + k], 0xcd);

  /* Expand: treat the gathered rows as the unique rows and index them with segment ids. */
  size_t m = 3 * n + 1;
  uint32_t *seg = kt_alloc(m * sizeof(uint32_t));
  for (size_t i = 0; i < m; i++)
    seg[i] = n ? (uint32_t)kt_below(rng, n) : 0;
  if (n > 0) {
    unsigned char *out2 = kt_alloc(m * width * es + GUARD);
    memset(out2, 0xcd, m * width * es + GUARD);
    embps_expand_cpu(out, dtype, width, seg, m, out2);
    for (size_t i = 0; i < m; i++)
      for (size_t j = 0; j < width; j++)
        assert_true(elem(out2, dtype, i * width + j) ==
                    elem(table, dtype, (size_t)rows[seg[i]] * width + j));
    for (size_t k = 0; k < GUARD; k++)
      assert_int_equal(out2[m * width * es + k], 0xcd);
    free(out2);
  }
  free(seg);
  free(out);
  free(rows);
  free(table);
}

static void test_gather_f32(void **state) {
  (void)state;
  kt_rng_t rng = {11};
  size_t widths[] = {1, 3, 16, 33, 128};
  for (size_t w = 0; w < 5; w++) {
    run_gather(EMBPS_DTYPE_F32, widths[w], 97, 500, &rng);
    run_gather(EMBPS_DTYPE_F32, widths[w], 5, 1, &rng);
  }
}

static void test_gather_bf16(void **state) {
  (void)state;
  kt_rng_t rng = {12};
  size_t widths[] = {1, 3, 16, 33, 128};
  for (size_t w = 0; w < 5; w++) {
    run_gather(EMBPS_DTYPE_BF16, widths[w], 97, 500, &rng);
    run_gather(EMBPS_DTYPE_BF16, widths[w], 5, 1, &rng);
  }
}

static void test_gather_empty(void **state) {
  (void)state;
  float table[4] = {1, 2, 3, 4};
  float out[1] = {-1};
  embps_gather_cpu(table, EMBPS_DTYPE_F32, 2, NULL, 0, out);
  embps_expand_cpu(table, EMBPS_DTYPE_F32, 2, NULL, 0, out);
  assert_true(out[0] == -1.0f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gather_f32),
      cmocka_unit_test(test_gather_bf16),
      cmocka_unit_test(test_gather_empty),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
