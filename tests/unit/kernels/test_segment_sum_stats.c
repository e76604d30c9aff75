/* embps_segment_sum_stats_cpu promises the bits of embps_segment_sum_cpu followed by
 * embps_row_partials_cpu on its output, so it is compared with exactly that on random batches:
 * skewed tokens (many duplicates, most segments split over distant positions), singletons
 * only, one token repeated, f32 and bf16, widths whose row-statistics block is 32, a smaller
 * divisor or none, gradients at every byte alignment (the engine reads them in place from the
 * request), and negative zeros (a first position stores 0.0f + g, as the zeroed sum does).
 * embps_segment_sum_stats_range_cpu over ranges that cover the segments gives the same bits, and
 * so do the positions in pieces with grad_at (rows of one position left in the gradients). */
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static float grad_value(kt_rng_t *rng) {
  /* Magnitudes from 1e-3 to 1e3, signs, and a few -0.0: order and first-touch both show. */
  uint64_t k = kt_next(rng);
  if (k % 17 == 0)
    return -0.0f;
  float mag = (float)pow(10.0, kt_uniform(rng, -3.0f, 3.0f));
  return k & 1 ? mag : -mag;
}

/* The positions in pieces with grad_at: a segment of one position is not written to out and
 * grad_at points at its gradient row, whose 0.0f + g are the sum's bits; every other segment's
 * grad_at is its row of out, with the sum's bits; the partials are the same either way. */
static void check_left_in_place(const uint8_t *grads, size_t n, size_t width, const uint32_t *seg,
                                size_t nu, size_t block, const float *want, const float *want_p,
                                float *got, float *got_p, void *cws) {
  const size_t nb = block ? width / block : 0, in_row = width * sizeof(float);
  const void **at = kt_alloc(nu * sizeof(void *));
  uint32_t *positions = kt_alloc(nu * sizeof(uint32_t));
  memset(positions, 0, nu * sizeof(uint32_t));
  for (size_t i = 0; i < n; i++)
    positions[seg[i]]++;
  for (size_t k = 0; k < nu * width; k++)
    got[k] = NAN;
  for (size_t k = 0; k < nu * nb + 1; k++)
    got_p[k] = NAN;
  for (size_t k = 0; k < nu; k++)
    at[k] = NULL;
  embps_segment_sum_stats_count_cpu(seg, n, cws, 0, nu);
  for (size_t lo = 0, step = 1; lo < n; step = step * 2 + 1) {
    size_t hi = lo + step < n ? lo + step : n;
    embps_segment_sum_stats_positions_cpu(grads, EMBPS_DTYPE_F32, width, seg, lo, hi, block, got,
                                          got_p, cws, 0, nu, at);
    lo = hi;
  }
  for (size_t s = 0; s < nu; s++) {
    const uint8_t *row = at[s];
    float v[1024];
    assert_non_null(row);
    assert_true(width <= 1024);
    if (positions[s] == 1) {
      assert_true(row >= grads && row < grads + n * in_row && (size_t)(row - grads) % in_row == 0);
      assert_int_equal(seg[(size_t)(row - grads) / in_row], s); /* its own position's row */
      for (size_t j = 0; j < width; j++) {
        memcpy(&v[j], row + j * sizeof(float), sizeof(float));
        v[j] = 0.0f + v[j];
        assert_true(isnan(got[s * width + j])); /* out's row is never written */
      }
    } else {
      assert_ptr_equal(row, (const uint8_t *)(got + s * width));
      memcpy(v, row, in_row);
    }
    assert_memory_equal(v, want + s * width, in_row);
  }
  assert_memory_equal(got_p, want_p, nu * nb * sizeof(float));
  assert_true(isnan(got_p[nu * nb]));
  free(positions);
  free(at);
}

static void run_case(embps_dtype_t dtype, size_t n, size_t width, size_t vocab, size_t align,
                     kt_rng_t *rng) {
  const size_t es = embps_dtype_size(dtype), block = embps_row_stats_block(width);
  const size_t nb = block ? width / block : 0;
  int64_t *tokens = kt_alloc(n * sizeof(int64_t)), *unique = kt_alloc(n * sizeof(int64_t));
  uint32_t *seg = kt_alloc(n * sizeof(uint32_t));
  void *ws = kt_alloc(embps_dedup_workspace_bytes(n));
  for (size_t i = 0; i < n; i++) {
    double u = kt_unit(rng);
    tokens[i] = (int64_t)((double)vocab * u * u * u); /* skewed: a few hot tokens */
  }
  size_t nu = embps_dedup_cpu(tokens, n, unique, seg, ws);

  /* The gradients `align` bytes past an aligned allocation. */
  uint8_t *raw = kt_alloc(n * width * es + align);
  uint8_t *grads = raw + align;
  for (size_t k = 0; k < n * width; k++) {
    float v = grad_value(rng);
    if (dtype == EMBPS_DTYPE_BF16) {
      uint16_t h = embps_f32_to_bf16(v);
      memcpy(grads + k * es, &h, es);
    } else {
      memcpy(grads + k * es, &v, es);
    }
  }
  /* The reference reads an aligned copy, as its contract asks. */
  void *aligned = kt_alloc(n * width * es);
  memcpy(aligned, grads, n * width * es);
  float *want = kt_alloc(nu * width * sizeof(float)), *got = kt_alloc(nu * width * sizeof(float));
  float *want_p = kt_alloc((nu * nb + 1) * sizeof(float));
  float *got_p = kt_alloc((nu * nb + 1) * sizeof(float));
  void *cws = kt_alloc(embps_segment_sum_stats_workspace_bytes(nu));
  embps_segment_sum_cpu(aligned, dtype, width, seg, n, nu, want);
  for (size_t k = 0; k < nu * width; k++)
    got[k] = NAN; /* must be overwritten */
  for (size_t k = 0; k < nu * nb + 1; k++)
    got_p[k] = want_p[k] = NAN;
  if (nb)
    embps_row_partials_cpu(want, nu, width, block, want_p);
  embps_segment_sum_stats_cpu(grads, dtype, width, seg, n, nu, block, got, got_p, cws);

  assert_memory_equal(got, want, nu * width * sizeof(float));
  assert_memory_equal(got_p, want_p, nu * nb * sizeof(float));
  assert_true(isnan(got_p[nu * nb])); /* nothing written past the partials */

  /* The same in three segment ranges, last range first (as threads may finish), and a range
   * writes its own segments' rows and nothing else. */
  const size_t edges[4] = {0, nu / 3, nu - nu / 4, nu};
  for (size_t k = 0; k < nu * width; k++)
    got[k] = NAN;
  for (size_t k = 0; k < nu * nb + 1; k++)
    got_p[k] = NAN;
  for (size_t r = 3; r-- > 0;) {
    embps_segment_sum_stats_range_cpu(grads, dtype, width, seg, n, nu, block, got, got_p, cws,
                                      edges[r], edges[r + 1]);
    for (size_t k = 0; k < edges[r] * width; k++)
      assert_true(isnan(got[k])); /* the ranges before it are not written yet */
  }
  assert_memory_equal(got, want, nu * width * sizeof(float));
  assert_memory_equal(got_p, want_p, nu * nb * sizeof(float));
  assert_true(isnan(got_p[nu * nb]));

  /* Position by position in uneven pieces after one count, as a push summed while it arrives
   * is: the same bits, and a row's partials appear only once its last position is in. */
  for (size_t k = 0; k < nu * width; k++)
    got[k] = NAN;
  for (size_t k = 0; k < nu * nb + 1; k++)
    got_p[k] = NAN;
  embps_segment_sum_stats_count_cpu(seg, n, cws, 0, nu);
  for (size_t lo = 0, step = 1; lo < n; step = step * 3 + 1) {
    size_t hi = lo + step < n ? lo + step : n;
    embps_segment_sum_stats_positions_cpu(grads, dtype, width, seg, lo, hi, block, got, got_p, cws,
                                          0, nu, NULL);
    if (nb && hi < n) /* position n - 1 is its segment's last: that row is not complete yet */
      assert_true(isnan(got_p[(size_t)seg[n - 1] * nb]));
    lo = hi;
  }
  assert_memory_equal(got, want, nu * width * sizeof(float));
  assert_memory_equal(got_p, want_p, nu * nb * sizeof(float));
  assert_true(isnan(got_p[nu * nb]));

  if (dtype == EMBPS_DTYPE_F32)
    check_left_in_place(grads, n, width, seg, nu, block, want, want_p, got, got_p, cws);

  free(cws);
  free(got_p);
  free(want_p);
  free(got);
  free(want);
  free(aligned);
  free(raw);
  free(ws);
  free(seg);
  free(unique);
  free(tokens);
}

static void test_matches_two_steps(void **state) {
  (void)state;
  kt_rng_t rng = {31};
  for (size_t align = 0; align < 4; align++) {
    run_case(EMBPS_DTYPE_F32, 4096, 128, 300, align, &rng);   /* duplicates, block 32 */
    run_case(EMBPS_DTYPE_F32, 2000, 48, 100000, align, &rng); /* mostly singletons, block 16 */
    run_case(EMBPS_DTYPE_F32, 500, 5, 7, align, &rng);        /* block 1 */
    run_case(EMBPS_DTYPE_BF16, 3000, 64, 200, align, &rng);   /* bf16 */
    run_case(EMBPS_DTYPE_BF16, 100, 3, 1, align, &rng);       /* one token repeated */
    /* Singletons go to memory with streaming stores, in pieces of 256 columns: bf16, a row of
     * several pieces (1000 = 3 x 256 + 232, block 8), and a width of no 16-byte rows (6), which
     * keeps the plain stores. */
    run_case(EMBPS_DTYPE_BF16, 2000, 64, 100000, align, &rng);
    run_case(EMBPS_DTYPE_F32, 300, 1000, 100000, align, &rng);
    run_case(EMBPS_DTYPE_BF16, 300, 1000, 100000, align, &rng);
    run_case(EMBPS_DTYPE_F32, 500, 6, 100000, align, &rng);
  }
  run_case(EMBPS_DTYPE_F32, 1, 32, 10, 1, &rng);
}

/* A lone -0.0 gradient sums to +0.0 (0.0f + -0.0f), as the zeroed two-step sum gives. */
static void test_negative_zero(void **state) {
  (void)state;
  float g[2] = {-0.0f, 2.0f}, out[2], partials[2] = {NAN, NAN};
  uint32_t seg[1] = {0}, count[1];
  embps_segment_sum_stats_cpu(g, EMBPS_DTYPE_F32, 2, seg, 1, 1, 1, out, partials, count);
  assert_false(signbit(out[0]));
  assert_true(out[1] == 2.0f && partials[0] == 0.0f && partials[1] == 4.0f);
}

/* Block 0 (a zero-width slice): sums only, no partials written. */
static void test_no_block(void **state) {
  (void)state;
  float g[1] = {1.0f}, out[1] = {NAN}, partials[1] = {NAN};
  uint32_t seg[1] = {0}, count[1];
  embps_segment_sum_stats_cpu(g, EMBPS_DTYPE_F32, 1, seg, 1, 1, 0, out, partials, count);
  assert_true(out[0] == 1.0f && isnan(partials[0]));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_two_steps),
      cmocka_unit_test(test_negative_zero),
      cmocka_unit_test(test_no_block),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
