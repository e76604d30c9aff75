/* embps_segment_sum_stats_cpu promises the bits of embps_segment_sum_cpu followed by
 * embps_row_partials_cpu on its output, so it is compared with exactly that on random batches:
 * skewed tokens (many duplicates, most segments split over distant positions), singletons
 * only, one token repeated, f32 and bf16, widths whose row-statistics block is 32, a smaller
 * divisor or none, gradients at every byte alignment (the engine reads them in place from the
 * request), and negative zeros (a first position stores 0.0f + g, as the zeroed sum does).
 * embps_segment_sum_stats_range_cpu over ranges that cover the segments gives the same bits. */
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
