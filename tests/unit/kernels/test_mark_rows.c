/* embps_mark_rows_cpu: exactly the listed rows' bits are set (bit r % 64 of word r / 64), at
 * the edges of words too; repeats and order do not matter; bits already set stay set; n == 0
 * changes nothing. */
#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define WORDS 5 /* 320 rows: the last word is only partly used below */

static int bit(const uint64_t *bits, uint64_t r) { return (int)((bits[r / 64] >> (r % 64)) & 1u); }

static void test_edges_of_words(void **state) {
  const int64_t rows[] = {0, 63, 64, 127, 128, 191, 255, 256, 300};
  uint64_t bits[WORDS] = {0};
  (void)state;
  embps_mark_rows_cpu(bits, rows, sizeof(rows) / sizeof(rows[0]));
  assert_true(bits[0] == (UINT64_C(1) | UINT64_C(1) << 63));
  assert_true(bits[1] == (UINT64_C(1) | UINT64_C(1) << 63));
  assert_true(bits[2] == (UINT64_C(1) | UINT64_C(1) << 63));
  assert_true(bits[3] == UINT64_C(1) << 63);
  assert_true(bits[4] == (UINT64_C(1) | UINT64_C(1) << 44));
}

/* Random rows with many repeats, marked over a bitmap with bits already set: the result is the
 * old bits OR the rows', whatever the order they come in. */
static void test_random_rows_keep_old_bits(void **state) {
  kt_rng_t rng = {7};
  const size_t n = 1000, rows_max = WORDS * 64;
  int64_t *rows = kt_alloc(n * sizeof(int64_t));
  uint64_t old[WORDS], bits[WORDS], reversed[WORDS];
  int want[WORDS * 64];
  (void)state;
  for (size_t w = 0; w < WORDS; w++)
    old[w] = kt_next(&rng) & kt_next(&rng); /* about a quarter of the bits */
  for (size_t r = 0; r < rows_max; r++)
    want[r] = bit(old, r);
  for (size_t i = 0; i < n; i++) {
    rows[i] = (int64_t)kt_below(&rng, i % 3 ? 40 : rows_max); /* rows below 40 repeat often */
    want[rows[i]] = 1;
  }
  memcpy(bits, old, sizeof(bits));
  embps_mark_rows_cpu(bits, rows, n);
  for (size_t r = 0; r < rows_max; r++)
    if (bit(bits, r) != want[r])
      fail_msg("row %zu: bit %d, want %d", r, bit(bits, r), want[r]);

  for (size_t i = 0; i < n / 2; i++) {
    int64_t x = rows[i];
    rows[i] = rows[n - 1 - i];
    rows[n - 1 - i] = x;
  }
  memcpy(reversed, old, sizeof(reversed));
  embps_mark_rows_cpu(reversed, rows, n);
  assert_memory_equal(reversed, bits, sizeof(bits));

  /* Marking again changes nothing; nothing marked changes nothing. */
  embps_mark_rows_cpu(reversed, rows, n);
  embps_mark_rows_cpu(reversed, NULL, 0);
  assert_memory_equal(reversed, bits, sizeof(bits));
  free(rows);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_edges_of_words),
      cmocka_unit_test(test_random_rows_keep_old_bits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
