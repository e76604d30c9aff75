/* Row statistics (embps_row_partials_cpu, embps_row_combine_cpu) against a double-precision
 * reference: row sums within f32 rounding, the total within double rounding and added to the
 * caller's value, exact counts of rows that are not finite (NaN, +inf, -inf), no false alarms
 * for large finite values whose squares overflow f32; and the property the column blocks exist
 * for: partials taken over column slices of any width that is a multiple of the block, combined
 * slice by slice, give bitwise the row sums and total of the whole width; and the combine split
 * by owner (embps_row_sums_cpu on each owner's rows, embps_row_finish_cpu on every row's sum)
 * gives the combine's bits. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

/* Row sums and total of an n x width array taken as `slices` column slices (as a group of that
 * many ranks takes them); returns the count of rows that are not finite. */
static size_t stats_sliced(const float *g, size_t n, size_t width, size_t slices, float *rs,
                           double *total) {
  const size_t sw = width / slices, block = embps_row_stats_block(sw), nb = sw / block;
  float *slice = kt_alloc((n * sw + 1) * sizeof(float));
  float *parts = kt_alloc((slices * n * nb + 1) * sizeof(float));
  for (size_t r = 0; r < slices; r++) {
    for (size_t i = 0; i < n; i++)
      memcpy(slice + i * sw, g + i * width + r * sw, sw * sizeof(float));
    embps_row_partials_cpu(slice, n, sw, block, parts + r * n * nb);
  }
  size_t bad = embps_row_combine_cpu(parts, slices, n, nb, rs, total);
  free(parts);
  free(slice);
  return bad;
}

static void check_rows(const float *g, size_t n, size_t width) {
  float *rs = kt_alloc(n * sizeof(float));
  double total = 5.0; /* the combine adds to it */
  assert_int_equal(stats_sliced(g, n, width, 1, rs, &total), 0);
  double ref_total = 0.0;
  for (size_t i = 0; i < n; i++) {
    double s = 0.0;
    for (size_t j = 0; j < width; j++)
      s += (double)g[i * width + j] * g[i * width + j];
    ref_total += s;
    assert_true(fabs(rs[i] - s) <= 2.5e-7 * s);
  }
  assert_true(fabs(total - (5.0 + ref_total)) <= 1e-7 * (5.0 + ref_total));
  /* Both outputs are optional. */
  assert_int_equal(stats_sliced(g, n, width, 1, NULL, NULL), 0);
  free(rs);
}

static void test_block(void **state) {
  (void)state;
  assert_int_equal(embps_row_stats_block(128), EMBPS_ROW_STATS_BLOCK);
  assert_int_equal(embps_row_stats_block(32), 32);
  assert_int_equal(embps_row_stats_block(96), 32);
  assert_int_equal(embps_row_stats_block(16), 16);
  assert_int_equal(embps_row_stats_block(100), 4);
  assert_int_equal(embps_row_stats_block(7), 1);
  assert_int_equal(embps_row_stats_block(0), 0);
}

static void test_random(void **state) {
  (void)state;
  kt_rng_t rng = {31};
  size_t shapes[][2] = {{1, 1}, {7, 3}, {100, 16}, {64, 129}, {3, 1000}, {20, 256}};
  for (size_t s = 0; s < 6; s++) {
    size_t n = shapes[s][0], w = shapes[s][1];
    float *g = kt_alloc(n * w * sizeof(float));
    for (size_t k = 0; k < n * w; k++)
      g[k] = kt_uniform(&rng, -3.0f, 3.0f);
    check_rows(g, n, w);
    free(g);
  }
}

/* The same rows as 1, 2, 4 and 8 slices whose width is a multiple of the block: bitwise the same
 * row sums and total. Slices narrower than the block use smaller blocks: the same sums to
 * rounding, not bitwise. */
static void test_independent_of_slices(void **state) {
  (void)state;
  kt_rng_t rng = {33};
  const size_t n = 37, width = 8 * EMBPS_ROW_STATS_BLOCK;
  float *g = kt_alloc(n * width * sizeof(float));
  float rs1[37], rs[37];
  double total1 = 0.0, total;
  for (size_t k = 0; k < n * width; k++)
    g[k] = kt_uniform(&rng, -2.0f, 2.0f) * (k % 5 == 0 ? 1e3f : 1.0f);
  assert_int_equal(stats_sliced(g, n, width, 1, rs1, &total1), 0);
  for (size_t slices = 2; slices <= 8; slices *= 2) {
    total = 0.0;
    assert_int_equal(stats_sliced(g, n, width, slices, rs, &total), 0);
    assert_memory_equal(rs, rs1, sizeof(rs));
    assert_memory_equal(&total, &total1, sizeof(total));
  }
  /* 16 slices of 16 columns: blocks of 16, within rounding. */
  total = 0.0;
  assert_int_equal(stats_sliced(g, n, width, 16, rs, &total), 0);
  for (size_t i = 0; i < n; i++)
    assert_true(fabsf(rs[i] - rs1[i]) <= 2.5e-7f * rs1[i]);
  assert_true(fabs(total - total1) <= 1e-7 * total1);
  free(g);
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
  free(g);
}

static void test_non_finite(void **state) {
  (void)state;
  kt_rng_t rng = {32};
  size_t n = 50, w = 64;
  float *g = kt_alloc(n * w * sizeof(float));
  for (size_t k = 0; k < n * w; k++)
    g[k] = kt_uniform(&rng, -1.0f, 1.0f);
  float *rs = kt_alloc(n * sizeof(float));
  double total = 0.0;

  g[3] = NAN;
  assert_int_equal(stats_sliced(g, n, w, 1, rs, &total), 1);
  assert_false(isfinite(total));
  g[3] = INFINITY;
  assert_int_equal(stats_sliced(g, n, w, 2, NULL, NULL), 1);
  g[3] = -INFINITY;
  assert_int_equal(stats_sliced(g, n, w, 1, rs, NULL), 1);
  assert_true(isinf(rs[0]) || isnan(rs[0]));

  /* Several in one row count once; other rows, in the second slice, the last element. */
  g[4] = NAN;
  g[5] = INFINITY;
  g[10 * w + 40] = -NAN;
  g[n * w - 1] = INFINITY;
  total = 0.0;
  assert_int_equal(stats_sliced(g, n, w, 2, rs, &total), 3);
  /* A row without bad values keeps a meaningful sum. */
  double s = 0.0;
  for (size_t j = 0; j < w; j++)
    s += (double)g[20 * w + j] * g[20 * w + j];
  assert_true(fabs(rs[20] - s) <= 2.5e-7 * s);
  free(rs);
  free(g);
}

/* Squares beyond FLT_MAX are finite in double: the partials saturate at FLT_MAX instead of
 * becoming infinite, so such rows are not mistaken for non-finite ones. */
static void test_large_finite(void **state) {
  (void)state;
  float g[8] = {FLT_MAX, -FLT_MAX, 3e38f, 1.0f, 2e20f, -2e20f, 0.0f, 1e-30f};
  double total = 0.0;
  float rs[2];
  assert_int_equal(stats_sliced(g, 2, 4, 1, rs, &total), 0);
  assert_true(isfinite(total));
  assert_true(total == (double)FLT_MAX + (double)FLT_MAX);
  assert_true(embps_row_stats_partial(1e300) == FLT_MAX);
  assert_true(isinf(embps_row_stats_partial(INFINITY)));
  assert_true(isnan(embps_row_stats_partial(NAN)));
  assert_true(embps_row_stats_partial(2.5) == 2.5f);
}

/* embps_row_partials_at_cpu reads one row at any byte offset (a request's bytes field): the bits
 * of embps_row_partials_cpu on the aligned rows, for every offset within a vector and widths
 * with one, several and odd-sized blocks, non-finite elements included. */
static void test_partials_at_any_alignment(void **state) {
  (void)state;
  kt_rng_t rng = {34};
  const size_t widths[] = {32, 128, 96, 100, 7};
  for (size_t wi = 0; wi < sizeof(widths) / sizeof(widths[0]); wi++) {
    const size_t n = 9, width = widths[wi], block = embps_row_stats_block(width);
    const size_t nb = width / block;
    float *g = kt_alloc(n * width * sizeof(float));
    float *want = kt_alloc(n * nb * sizeof(float)), *got = kt_alloc(nb * sizeof(float));
    unsigned char *bytes = kt_alloc(width * sizeof(float) + 32);
    for (size_t k = 0; k < n * width; k++)
      g[k] = kt_uniform(&rng, -5.0f, 5.0f);
    g[2 * width + width / 2] = NAN;
    g[4 * width] = INFINITY;
    g[5 * width + 1] = FLT_MAX;
    embps_row_partials_cpu(g, n, width, block, want);
    for (size_t i = 0; i < n; i++)
      for (size_t off = 0; off < 32; off++) {
        memcpy(bytes + off, g + i * width, width * sizeof(float));
        memset(got, 0xA5, nb * sizeof(float));
        embps_row_partials_at_cpu(bytes + off, width, block, got);
        assert_memory_equal(got, want + i * nb, nb * sizeof(float));
      }
    free(bytes);
    free(got);
    free(want);
    free(g);
  }
}

/* The partials' bits against the documented formula written out here: a block's squares in
 * double, in 8 lanes (column j into lane j mod 8, in column order), the lanes added in lane order
 * from 0.0, rounded to f32 and saturated at FLT_MAX. Widths of one to nine whole blocks of 32
 * (the four-block AVX2 path and its remainder), and of smaller blocks; values of every scale
 * (sums that round differently in other orders), subnormals, sums past FLT_MAX, infinities and
 * NaN; rows at odd byte offsets. Fails when the four-block path adds its lanes in another order
 * or mixes columns of two blocks. */
static float ref_partial(const float *g, size_t len) {
  double lane[8] = {0}, s = 0.0;
  for (size_t j = 0; j < len; j++)
    lane[j % 8] += (double)g[j] * (double)g[j];
  for (size_t l = 0; l < 8; l++)
    s += lane[l];
  float f = (float)s;
  return isinf(f) && isfinite(s) ? FLT_MAX : f;
}

static void test_partials_formula(void **state) {
  (void)state;
  kt_rng_t rng = {35};
  const size_t widths[] = {32, 64, 96, 128, 160, 192, 224, 256, 288, 16, 8, 24, 40};
  for (size_t wi = 0; wi < sizeof(widths) / sizeof(widths[0]); wi++) {
    const size_t n = 64, width = widths[wi], block = embps_row_stats_block(width);
    const size_t nb = width / block;
    float *g = kt_alloc(n * width * sizeof(float)), *got = kt_alloc(nb * sizeof(float));
    unsigned char *bytes = kt_alloc(width * sizeof(float) + 8);
    for (size_t k = 0; k < n * width; k++) {
      float scale = powf(10.0f, (float)(kt_next(&rng) % 24) - 8.0f);
      g[k] = kt_uniform(&rng, -1.0f, 1.0f) * scale;
    }
    g[1 * width + 3] = 1e-40f; /* subnormal */
    g[2 * width + width - 1] = NAN;
    g[3 * width] = -INFINITY;
    for (size_t j = 0; j < width; j++) /* a row whose blocks sum past FLT_MAX, finite */
      g[4 * width + j] = 2e19f;
    g[5 * width + width / 2] = FLT_MAX;
    g[6 * width + 5] = -0.0f;
    /* Rows 8.. each hold, in one block (each block in turn, lanes 0-3 then 4-7), lanes whose
     * sum in lane order is 2^-53 + 2^-53 + 1 + 2^-24 = 1 + 2^-24 + 2^-52 (f32: 1 + 2^-23), while
     * 1 first would drop each 2^-53 and round to the tie 1 + 2^-24 (f32: 1). */
    for (size_t r = 8; block >= 16 && r < 8 + 2 * nb; r++) {
      const size_t b = (r - 8) % nb, l = (r - 8) / nb * 4;
      float *p = g + r * width + b * block;
      memset(p, 0, block * sizeof(float));
      p[l] = p[l + 8] = p[l + 1] = p[l + 9] = 0x1p-27f;
      p[l + 2] = 1.0f;
      p[l + 3] = 0x1p-12f;
      assert_true(ref_partial(p, block) == 1.0f + 0x1p-23f);
    }
    for (size_t i = 0; i < n; i++) {
      size_t off = i % 5;
      memcpy(bytes + off, g + i * width, width * sizeof(float));
      memset(got, 0xA5, nb * sizeof(float));
      embps_row_partials_at_cpu(bytes + off, width, block, got);
      for (size_t b = 0; b < nb; b++) {
        float want = ref_partial(g + i * width + b * block, block);
        assert_memory_equal(&got[b], &want, sizeof(float));
      }
    }
    free(bytes);
    free(got);
    free(g);
  }
}

/* The combine by owner, as engine.c runs it over `slices` ranks, against embps_row_combine_cpu
 * on the all-gathered partials: row_sumsq, the count and the total (added to 5.0) bitwise. The
 * ranks' partials are m x nb each; each rank's send buffer is slices x q rows, the rows past m
 * poisoned, so that an owner reading a row it does not own shows. */
static void check_by_owner(kt_rng_t *rng, size_t slices, size_t m, size_t nb) {
  const size_t q = (m + slices - 1) / slices;
  float *parts = kt_alloc((slices * m * nb + 1) * sizeof(float));
  float *send = kt_alloc((slices * slices * q * nb + 1) * sizeof(float));
  float *recv = kt_alloc((slices * q * nb + 1) * sizeof(float));
  double *sums = kt_alloc((slices * q + 1) * sizeof(double));
  float *want = kt_alloc((m + 1) * sizeof(float)), *got = kt_alloc((m + 1) * sizeof(float));
  const float special[] = {NAN, INFINITY, -INFINITY, FLT_MAX, 0.0f, -0.0f, 3e38f, 1e-40f};
  double want_total = 5.0, got_total = 5.0;
  size_t want_bad, got_bad;

  for (size_t k = 0; k < slices * m * nb; k++) /* magnitudes 1e-3 to 1e3, a few specials */
    parts[k] = kt_below(rng, 40) == 0
                   ? special[kt_below(rng, 8)]
                   : kt_uniform(rng, 0.0f, 1.0f) * (float)pow(10.0, (double)kt_below(rng, 7) - 3.0);
  for (size_t r = 0; r < slices; r++) {
    float *mine = send + r * slices * q * nb;
    for (size_t k = 0; k < slices * q * nb; k++)
      mine[k] = NAN; /* past row m: never added */
    memcpy(mine, parts + r * m * nb, m * nb * sizeof(float));
  }
  for (size_t j = 0; j < slices * q; j++)
    sums[j] = -1.0;
  for (size_t j = 0; j < slices; j++) { /* owner j: the all-to-all, then its rows' sums */
    const size_t first = j * q, owned = m > first ? (m - first < q ? m - first : q) : 0;
    for (size_t r = 0; r < slices; r++)
      memcpy(recv + r * q * nb, send + r * slices * q * nb + j * q * nb, q * nb * sizeof(float));
    embps_row_sums_cpu(recv, slices, q, owned, nb, sums + first);
  }
  want_bad = embps_row_combine_cpu(parts, slices, m, nb, want, &want_total);
  got_bad = embps_row_finish_cpu(sums, m, got, &got_total);
  assert_int_equal(got_bad, want_bad);
  assert_memory_equal(got, want, m * sizeof(float));
  assert_memory_equal(&got_total, &want_total, sizeof(double));
  /* Optional outputs, as the combine's. */
  assert_int_equal(embps_row_finish_cpu(sums, m, NULL, NULL), want_bad);
  free(parts), free(send), free(recv), free(sums), free(want), free(got);
}

static void test_by_owner(void **state) {
  const size_t slices[] = {1, 2, 3, 4, 7, 8, 64};
  const size_t rows[] = {0, 1, 2, 5, 7, 37, 64, 300};
  const size_t nbs[] = {1, 2, 4};
  kt_rng_t rng = {77};
  (void)state;
  for (size_t a = 0; a < sizeof(slices) / sizeof(slices[0]); a++)
    for (size_t b = 0; b < sizeof(rows) / sizeof(rows[0]); b++)
      for (size_t c = 0; c < sizeof(nbs) / sizeof(nbs[0]); c++)
        check_by_owner(&rng, slices[a], rows[b], nbs[c]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_block),
      cmocka_unit_test(test_random),
      cmocka_unit_test(test_independent_of_slices),
      cmocka_unit_test(test_accuracy),
      cmocka_unit_test(test_non_finite),
      cmocka_unit_test(test_large_finite),
      cmocka_unit_test(test_partials_at_any_alignment),
      cmocka_unit_test(test_partials_formula),
      cmocka_unit_test(test_by_owner),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
