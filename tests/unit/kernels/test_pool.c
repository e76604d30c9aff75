/* The feature batches' bag kernels (kernels/pool.c) against loops written here: pooling sums a
 * bag's rows in the bag's order in f32 (times each id's weight; over the bag's nonzero ids for a
 * mean), skips id 0, gives zeros for an empty bag or one of padding only, reads a hash-keyed
 * table's absent keys (row -1) as their initial rows, and a bf16 table's rows widened; the
 * expansion writes each id the bag's gradient (times the weight, over the nonzero ids, rounded to
 * bf16), zeros for id 0. Random bags, f32 and bf16, bitwise. */
#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define ROWS 40
#define BAGS 30
#define SEED UINT64_C(77)
#define SCALE 0.1f

static float elem(const void *table, embps_dtype_t dtype, size_t width, size_t r, size_t j) {
  if (dtype == EMBPS_DTYPE_BF16)
    return embps_bf16_to_f32(((const uint16_t *)table)[r * width + j]);
  return ((const float *)table)[r * width + j];
}

/* Random bags of ids in [0, ROWS) (0 is padding), some empty, one of padding only; rows[i] -1
 * for every third id (an absent hash key, read as its initial row). */
static size_t make_bags(kt_rng_t *rng, uint32_t *lengths, int64_t *ids, int64_t *rows,
                        float *weights) {
  size_t n = 0;
  for (size_t k = 0; k < BAGS; k++) {
    lengths[k] = k % 7 == 3 ? 0 : (uint32_t)kt_below(rng, 6);
    for (uint32_t i = 0; i < lengths[k]; i++, n++) {
      ids[n] = k == 5 ? 0 : (int64_t)kt_below(rng, ROWS);
      rows[n] = n % 3 == 2 ? -1 : ids[n];
      weights[n] = kt_uniform(rng, -2.0f, 2.0f);
    }
  }
  return n;
}

static void check_pool(embps_dtype_t dtype, size_t width, int mean, int weighted) {
  kt_rng_t rng = {SEED + width};
  const size_t es = embps_dtype_size(dtype);
  uint8_t *table = kt_alloc(ROWS * width * es);
  uint32_t lengths[BAGS];
  int64_t ids[BAGS * 6], rows[BAGS * 6];
  float weights[BAGS * 6], *got = kt_alloc(BAGS * width * sizeof(float));
  float *tmp = kt_alloc(2 * width * sizeof(float)), *key_row = kt_alloc(width * sizeof(float));
  uint16_t *key_half = kt_alloc(width * sizeof(uint16_t));
  const uint64_t col_begin = 3;
  size_t at = 0;

  embps_init_rows_cpu(table, dtype, width, 0, ROWS, col_begin, 9, 0.5f);
  make_bags(&rng, lengths, ids, rows, weights);
  embps_pool_bags_cpu(table, dtype, width, ids, rows, weighted ? weights : NULL, lengths, BAGS,
                      mean, got, tmp, col_begin, SEED, SCALE);
  for (size_t k = 0; k < BAGS; k++) {
    uint32_t nz = 0;
    for (size_t j = 0; j < width; j++) {
      float want = 0.0f;
      nz = 0;
      for (uint32_t i = 0; i < lengths[k]; i++) {
        const size_t p = at + i;
        float x;
        if (ids[p] == 0)
          continue;
        nz++;
        if (rows[p] >= 0) {
          x = elem(table, dtype, width, (size_t)rows[p], j);
        } else if (dtype == EMBPS_DTYPE_BF16) {
          embps_init_key_row_cpu(key_half, dtype, width, (uint64_t)ids[p], col_begin, SEED, SCALE);
          x = embps_bf16_to_f32(key_half[j]);
        } else {
          embps_init_key_row_cpu(key_row, dtype, width, (uint64_t)ids[p], col_begin, SEED, SCALE);
          x = key_row[j];
        }
        want += weighted ? x * weights[p] : x;
      }
      if (mean && nz)
        want = want / (float)nz;
      if (memcmp(&want, &got[k * width + j], sizeof(float)) != 0)
        fail_msg("dtype %d width %zu mean %d weighted %d: bag %zu column %zu: %a, want %a",
                 (int)dtype, width, mean, weighted, k, j, (double)got[k * width + j], (double)want);
    }
    if (nz == 0)
      for (size_t j = 0; j < width; j++)
        assert_true(got[k * width + j] == 0.0f);
    at += lengths[k];
  }
  free(table), free(got), free(tmp), free(key_row), free(key_half);
}

static void test_pool_matches_the_loops(void **state) {
  const size_t widths[] = {1, 7, 64};
  (void)state;
  for (size_t w = 0; w < 3; w++)
    for (int dt = 0; dt < 2; dt++)
      for (int mode = 0; mode < 3; mode++)
        check_pool(dt ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32, widths[w], mode == 1, mode == 2);
}

static void check_expand(embps_dtype_t dtype, size_t width, int mean, int weighted) {
  kt_rng_t rng = {SEED * 3 + width};
  const size_t es = embps_dtype_size(dtype);
  uint32_t lengths[BAGS];
  int64_t ids[BAGS * 6], rows[BAGS * 6];
  float weights[BAGS * 6], *g = kt_alloc(BAGS * width * sizeof(float));
  size_t n = make_bags(&rng, lengths, ids, rows, weights), at = 0;
  uint8_t *got = kt_alloc(n * width * es + 1);

  for (size_t i = 0; i < BAGS * width; i++)
    g[i] = kt_uniform(&rng, -1.0f, 1.0f);
  memset(got, 0xA5, n * width * es + 1);
  embps_expand_bags_cpu(g, width, ids, weighted ? weights : NULL, lengths, BAGS, mean, dtype, got);
  assert_int_equal(got[n * width * es], 0xA5); /* nothing past the last id's row */
  for (size_t k = 0; k < BAGS; k++) {
    uint32_t nz = 0;
    for (uint32_t i = 0; i < lengths[k]; i++)
      nz += ids[at + i] != 0;
    for (uint32_t i = 0; i < lengths[k]; i++) {
      const size_t p = at + i;
      for (size_t j = 0; j < width; j++) {
        float v = ids[p] == 0 ? 0.0f
                  : weighted  ? g[k * width + j] * weights[p]
                  : mean      ? g[k * width + j] / (float)nz
                              : g[k * width + j];
        uint8_t want[4];
        if (dtype == EMBPS_DTYPE_BF16) {
          uint16_t h = embps_f32_to_bf16(v);
          memcpy(want, &h, 2);
        } else {
          memcpy(want, &v, 4);
        }
        if (memcmp(want, got + (p * width + j) * es, es) != 0)
          fail_msg("expand dtype %d width %zu: id %zu column %zu differs", (int)dtype, width, p, j);
      }
    }
    at += lengths[k];
  }
  free(g), free(got);
}

static void test_expand_matches_the_loops(void **state) {
  const size_t widths[] = {1, 7, 64};
  (void)state;
  for (size_t w = 0; w < 3; w++)
    for (int dt = 0; dt < 2; dt++)
      for (int mode = 0; mode < 3; mode++)
        check_expand(dt ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32, widths[w], mode == 1, mode == 2);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pool_matches_the_loops),
      cmocka_unit_test(test_expand_matches_the_loops),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
