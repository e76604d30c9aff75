/* The initializer: deterministic, row 0 zero, values in [-scale, scale) and spread over it,
 * different seeds give different tables, and a table split by columns over 1, 2, 3 or 4 ranks
 * (and at row offsets) equals the unsplit one bit for bit, in f32 and bf16; a key's row
 * (embps_init_key_row_cpu, vectorised for the CPU it runs on) is embps_init_value bit for bit at
 * every width, column offset and output alignment; and every value is the formula init.c
 * documents (the full splitmix64 finalizer, written out here), so that a faster form of the
 * kernel's arithmetic cannot change a table's bits. */
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static void test_value_properties(void **state) {
  (void)state;
  const float scale = 0.05f;
  double sum = 0.0, sumsq = 0.0;
  float lo = 1.0f, hi = -1.0f;
  size_t count = 0, equal_neighbors = 0, bins[10] = {0};
  for (uint64_t r = 0; r < 400; r++) {
    for (uint64_t c = 0; c < 64; c++) {
      float v = embps_init_value(7, r, c, scale);
      assert_true(v == embps_init_value(7, r, c, scale));
      if (r == 0) {
        assert_true(v == 0.0f);
        continue;
      }
      assert_true(v >= -scale && v < scale);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      sum += v;
      sumsq += (double)v * v;
      size_t b = (size_t)(((double)v + scale) / (2.0 * scale) * 10.0);
      bins[b > 9 ? 9 : b]++;
      count++;
      equal_neighbors += c > 0 && v == embps_init_value(7, r, c - 1, scale);
    }
  }
  /* Uniform on [-s, s): mean 0, variance s^2/3, every tenth of the range used evenly. */
  double mean = sum / (double)count, var = sumsq / (double)count - mean * mean;
  assert_true(fabs(mean) < 0.01 * scale);
  assert_true(fabs(var / (scale * scale / 3.0) - 1.0) < 0.03);
  for (int b = 0; b < 10; b++)
    assert_true(bins[b] > count / 10 * 0.9 && bins[b] < count / 10 * 1.1);
  assert_true(lo < -0.99f * scale && hi > 0.99f * scale);
  assert_true(equal_neighbors < 5);

  /* The seed, the row and the column each change the value. */
  assert_true(embps_init_value(1, 5, 3, 1.0f) != embps_init_value(2, 5, 3, 1.0f));
  assert_true(embps_init_value(1, 5, 3, 1.0f) != embps_init_value(1, 6, 3, 1.0f));
  assert_true(embps_init_value(1, 5, 3, 1.0f) != embps_init_value(1, 5, 4, 1.0f));
  /* Transposing row and column does not give the same value. */
  assert_true(embps_init_value(1, 5, 3, 1.0f) != embps_init_value(1, 3, 5, 1.0f));
  /* Scale multiplies. */
  assert_true(embps_init_value(9, 11, 2, 2.0f) == 2.0f * embps_init_value(9, 11, 2, 1.0f));
  /* Row 0 is zero for every seed and column; huge row ids are fine. */
  assert_true(embps_init_value(123, 0, 99, 1.0f) == 0.0f);
  float big = embps_init_value(3, UINT64_C(1) << 40, 7, 1.0f);
  assert_true(big >= -1.0f && big < 1.0f);
}

static void check_split(embps_dtype_t dtype, size_t full_width, size_t ranks) {
  const uint64_t seed = 99, rows = 37;
  const float scale = 0.1f;
  size_t es = embps_dtype_size(dtype);
  unsigned char *full = kt_alloc(rows * full_width * es);
  embps_init_rows_cpu(full, dtype, full_width, 0, rows, 0, seed, scale);
  for (uint64_t r = 0; r < rows; r++)
    for (size_t c = 0; c < full_width; c++) {
      float want = embps_init_value(seed, r, c, scale);
      float got = dtype == EMBPS_DTYPE_BF16
                      ? embps_bf16_to_f32(((uint16_t *)full)[r * full_width + c])
                      : ((float *)full)[r * full_width + c];
      assert_true(got == (dtype == EMBPS_DTYPE_BF16 ? kt_bf16_round(want) : want));
    }

  size_t sw = full_width / ranks;
  unsigned char *slice = kt_alloc(rows * sw * es);
  for (size_t rank = 0; rank < ranks; rank++) {
    /* Fill in two row ranges, as a loader would in chunks; rows outside stay untouched. */
    memset(slice, 0xee, rows * sw * es);
    embps_init_rows_cpu(slice, dtype, sw, 0, 20, rank * sw, seed, scale);
    embps_init_rows_cpu(slice, dtype, sw, 20, rows, rank * sw, seed, scale);
    for (uint64_t r = 0; r < rows; r++)
      assert_memory_equal(slice + r * sw * es, full + (r * full_width + rank * sw) * es, sw * es);
  }
  /* A partial fill writes exactly its rows. */
  memset(slice, 0xee, rows * sw * es);
  embps_init_rows_cpu(slice, dtype, sw, 5, 9, 0, seed, scale);
  for (size_t k = 0; k < rows * sw * es; k++) {
    size_t r = k / (sw * es);
    if (r < 5 || r >= 9)
      assert_int_equal(slice[k], 0xee);
  }
  free(slice);
  free(full);
}

static void test_column_split(void **state) {
  (void)state;
  for (size_t ranks = 1; ranks <= 4; ranks++) {
    check_split(EMBPS_DTYPE_F32, 12 * 5, ranks); /* 60 divides by 1..4 */
    check_split(EMBPS_DTYPE_BF16, 12 * 5, ranks);
  }
  check_split(EMBPS_DTYPE_F32, 12, 3);
}

static void test_row_zero_in_table(void **state) {
  (void)state;
  float t[3 * 4];
  memset(t, 0x7f, sizeof(t));
  embps_init_rows_cpu(t, EMBPS_DTYPE_F32, 4, 0, 3, 8, 5, 1.0f);
  for (int j = 0; j < 4; j++) {
    assert_true(t[j] == 0.0f);
    assert_true(t[4 + j] != 0.0f);
  }
}

/* embps_init_key_row_cpu against embps_init_value, element by element: widths across the vector
 * lengths and their tails, column offsets, keys 0 (zeros), small and above 2^63, outputs at every
 * byte alignment, and not a byte written outside the row. */
static void test_key_row(void **state) {
  (void)state;
  const uint64_t keys[] = {0, 1, 2, 977, UINT64_C(0x8000000000000001), UINT64_MAX};
  const size_t widths[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 128, 130, 257};
  const uint64_t cols[] = {0, 5, 1000};
  unsigned char buf[8 + 257 * 4 + 8];
  for (int dt = 0; dt < 2; dt++) {
    const embps_dtype_t dtype = dt ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
    const size_t es = embps_dtype_size(dtype);
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
      for (size_t wi = 0; wi < sizeof(widths) / sizeof(widths[0]); wi++)
        for (size_t ci = 0; ci < sizeof(cols) / sizeof(cols[0]); ci++)
          for (size_t off = 0; off < 4; off++) {
            const size_t w = widths[wi];
            memset(buf, 0xa5, sizeof(buf));
            embps_init_key_row_cpu(buf + off, dtype, w, keys[k], cols[ci], 42, 0.25f);
            for (size_t j = 0; j < w; j++) {
              const float want = embps_init_value(42, keys[k], cols[ci] + j, 0.25f);
              float got;
              if (dt) {
                uint16_t b;
                memcpy(&b, buf + off + j * es, es);
                got = embps_bf16_to_f32(b);
                assert_true(got == kt_bf16_round(want));
              } else {
                memcpy(&got, buf + off + j * es, es);
                assert_memory_equal(&got, &want, sizeof(got)); /* the bits, -0 and all */
              }
            }
            for (size_t b = 0; b < sizeof(buf); b++)
              if (b < off || b >= off + w * es)
                assert_int_equal(buf[b], 0xa5);
          }
  }
}

/* init.c's formula as documented, with the whole mix64 (its last xor-shift included). */
static uint64_t ref_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

static float ref_value(uint64_t seed, uint64_t row, uint64_t col, float scale) {
  const uint64_t golden = UINT64_C(0x9e3779b97f4a7c15);
  if (row == 0)
    return 0.0f;
  const uint64_t rh = ref_mix(ref_mix(seed + golden) + row * golden);
  const uint64_t h = ref_mix(rh ^ (col * golden + golden));
  return scale * ((float)(int32_t)(h >> 40) * 0x1p-23f - 1.0f);
}

static void test_formula(void **state) {
  (void)state;
  kt_rng_t rng = {11};
  float row[64];
  for (int i = 0; i < 20000; i++) {
    const uint64_t seed = kt_next(&rng), key = kt_next(&rng) | 1, col = kt_next(&rng) % 100000;
    const float scale = i % 2 ? 0.25f : 1.0f / 3.0f;
    const float want = ref_value(seed, key, col, scale),
                got = embps_init_value(seed, key, col, scale);
    assert_memory_equal(&got, &want, sizeof(got));
    if (i % 100 == 0) { /* and the vectorised row */
      embps_init_key_row_cpu(row, EMBPS_DTYPE_F32, 64, key, col, seed, scale);
      for (size_t j = 0; j < 64; j++) {
        const float w = ref_value(seed, key, col + j, scale);
        assert_memory_equal(&row[j], &w, sizeof(w));
      }
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_value_properties),  cmocka_unit_test(test_column_split),
      cmocka_unit_test(test_row_zero_in_table), cmocka_unit_test(test_key_row),
      cmocka_unit_test(test_formula),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
