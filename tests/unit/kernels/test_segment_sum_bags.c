/* The fused feature push sum (embps_segment_sum_bags_range_cpu with embps_bag_sources_cpu)
 * promises the bits of expanding every bag to its ids first (embps_expand_bags_cpu, rounded to
 * the table's dtype once) and then summing the expanded rows with their row statistics
 * (embps_segment_sum_stats_cpu), so it is compared with exactly that: a table's positions made of
 * several blocks as features.c lays them out (sum, mean and weighted bags, and a feature without
 * pooling whose own rows sit at their positions), ids repeated within and across blocks, padding
 * id 0 (inside bags, and bags of padding only), empty bags, negative zeros, NaN and infinite bag
 * gradients, f32 and bf16, widths with a row-statistics block of 32, a smaller one and none, a
 * width wider than the kernel's column pieces, few and many distinct ids (most segments of one
 * position), over one range and over three that cover the segments. The sums, the
 * partials and what embps_row_combine_cpu makes of them (the finite gate's count, the norm) are
 * all compared bitwise. */
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define BAGS 40
#define MAX_LEN 8
#define BLOCKS 5 /* sum, mean, weighted, own rows, sum again (a second feature of the table) */

static float grad_value(kt_rng_t *rng, int specials) {
  uint64_t k = kt_next(rng);
  if (k % 19 == 0)
    return -0.0f;
  if (specials && k % 997 == 1)
    return NAN;
  if (specials && k % 997 == 2)
    return -INFINITY;
  float mag = (float)pow(10.0, kt_uniform(rng, -3.0f, 3.0f));
  return k & 2 ? mag : -mag;
}

static void put(uint8_t *p, embps_dtype_t dtype, float v) {
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h = embps_f32_to_bf16(v);
    memcpy(p, &h, 2);
  } else {
    memcpy(p, &v, 4);
  }
}

static void run_case(embps_dtype_t dtype, size_t width, uint64_t vocab, int specials,
                     uint64_t seed) {
  kt_rng_t rng = {seed};
  const size_t es = embps_dtype_size(dtype), block = embps_row_stats_block(width);
  const size_t nb = block ? width / block : 0, cap = BLOCKS * BAGS * MAX_LEN;
  int64_t *tokens = kt_alloc(cap * sizeof(int64_t)), *unique = kt_alloc(cap * sizeof(int64_t));
  int64_t offsets[BAGS + 1];
  float *weights = kt_alloc(cap * sizeof(float));
  float *bags = kt_alloc(BLOCKS * BAGS * width * sizeof(float));
  uint8_t *expanded = kt_alloc(cap * width * es), *own = kt_alloc(cap * width * es);
  embps_bag_source_t *sources = kt_alloc(cap * sizeof(embps_bag_source_t));
  uint32_t *seg = kt_alloc(cap * sizeof(uint32_t));
  size_t T = 0, num_bags = 0;

  for (int b = 0; b < BLOCKS; b++) {
    const int mean = b == 1, weighted = b == 2, pooled = b != 3;
    const size_t first = T;
    offsets[0] = 0;
    for (size_t k = 0; k < BAGS; k++) {
      const size_t len = k % 9 == 4 ? 0 : (size_t)kt_below(&rng, MAX_LEN + 1);
      for (size_t i = 0; i < len; i++, T++) {
        tokens[T] = k % 11 == 6 || kt_below(&rng, 5) == 0 ? 0 : 1 + (int64_t)kt_below(&rng, vocab);
        weights[T] = specials && T % 101 == 7 ? NAN : kt_uniform(&rng, -2.0f, 2.0f);
      }
      offsets[k + 1] = (int64_t)(T - first);
    }
    if (pooled) {
      float *g = bags + num_bags * width;
      for (size_t x = 0; x < BAGS * width; x++)
        g[x] = grad_value(&rng, specials);
      embps_expand_bags_cpu(g, width, tokens + first, weighted ? weights + first : NULL, offsets,
                            BAGS, mean, dtype, expanded + first * width * es);
      embps_bag_sources_cpu(tokens + first, weighted ? weights + first : NULL, offsets, BAGS, mean,
                            (uint32_t)num_bags, T - first, sources + first);
      num_bags += BAGS;
    } else {
      for (size_t x = first * width; x < T * width; x++)
        put(own + x * es, dtype, grad_value(&rng, specials));
      memcpy(expanded + first * width * es, own + first * width * es, (T - first) * width * es);
      embps_bag_sources_cpu(NULL, NULL, NULL, 0, 0, 0, T - first, sources + first);
    }
  }

  void *ws = kt_alloc(embps_dedup_workspace_bytes(T));
  uint32_t *order = kt_alloc(T * sizeof(uint32_t)), *starts = kt_alloc((T + 1) * sizeof(uint32_t));
  const size_t nu = embps_dedup_sorted_cpu(tokens, T, unique, seg, order, starts, ws);
  float *want = kt_alloc(nu * width * sizeof(float)), *got = kt_alloc(nu * width * sizeof(float));
  float *want_p = kt_alloc((nu * nb + 1) * sizeof(float));
  float *got_p = kt_alloc((nu * nb + 1) * sizeof(float));
  float *want_sq = kt_alloc((nu + 1) * sizeof(float)), *got_sq = kt_alloc((nu + 1) * sizeof(float));
  void *cws = kt_alloc(embps_segment_sum_stats_workspace_bytes(nu));
  embps_segment_sum_stats_cpu(expanded, dtype, width, seg, T, nu, block, want, want_p, cws);
  double want_total = 0.0, got_total = 0.0;
  const size_t want_bad = embps_row_combine_cpu(want_p, 1, nu, nb, want_sq, &want_total);

  for (int split = 0; split < 2; split++) {
    const size_t cuts[] = {0, split ? nu / 3 : 0, split ? nu / 2 : 0, nu};
    for (size_t k = 0; k < nu * width; k++)
      got[k] = NAN; /* must be overwritten */
    for (size_t k = 0; k < nu * nb + 1; k++)
      got_p[k] = want_p[k] == 1.0f ? 2.0f : 1.0f;
    got_p[nu * nb] = want_p[nu * nb];
    for (int r = 0; r < 3; r++)
      embps_segment_sum_bags_range_cpu(own, dtype, width, bags, sources, order, starts, block, got,
                                       got_p, cuts[r], cuts[r + 1]);
    if (memcmp(want, got, nu * width * sizeof(float)) != 0)
      fail_msg("dtype %d width %zu vocab %llu split %d: sums differ", (int)dtype, width,
               (unsigned long long)vocab, split);
    if (memcmp(want_p, got_p, (nu * nb + 1) * sizeof(float)) != 0)
      fail_msg("dtype %d width %zu vocab %llu split %d: partials differ", (int)dtype, width,
               (unsigned long long)vocab, split);
    got_total = 0.0;
    assert_int_equal(embps_row_combine_cpu(got_p, 1, nu, nb, got_sq, &got_total), want_bad);
    assert_memory_equal(want_sq, got_sq, nu * sizeof(float));
    assert_memory_equal(&want_total, &got_total, sizeof(double));
  }
  if (specials && nb)
    assert_true(want_bad > 0); /* the gate has something to count */
  free(tokens), free(unique), free(weights), free(bags), free(expanded), free(own), free(sources);
  free(seg), free(ws), free(want), free(got), free(want_p), free(got_p), free(want_sq),
      free(got_sq);
  free(cws), free(order), free(starts);
}

static void test_fused_matches_expand_then_sum(void **state) {
  const size_t widths[] = {128, 64, 12, 6, 300};
  (void)state;
  for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++)
    for (int dt = 0; dt < 2; dt++)
      for (int specials = 0; specials < 2; specials++) {
        const embps_dtype_t dtype = dt ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
        run_case(dtype, widths[w], 30, specials, 1 + w * 8 + (size_t)dt * 2 + (size_t)specials);
        run_case(dtype, widths[w], 1000000, specials, 101 + w * 8 + (size_t)dt * 2 + specials);
      }
}

/* The sources themselves: each position names its bag and what the expansion does there. */
static void test_sources_name_bag_and_mode(void **state) {
  const int64_t ids[] = {5, 0, 7, 0, 0, 9};
  const int64_t offsets[] = {0, 3, 3, 5, 6}; /* bags: {5,0,7}, {}, {0,0}, {9} */
  const float weights[] = {0.5f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  embps_bag_source_t s[6];
  (void)state;
  embps_bag_sources_cpu(ids, NULL, offsets, 4, 1, 10, 6, s);
  assert_int_equal(s[0].mode, EMBPS_BAG_MEAN);
  assert_int_equal(s[0].bag, 10);
  assert_true(s[0].factor == 2.0f); /* two nonzero ids */
  assert_int_equal(s[1].mode, EMBPS_BAG_PAD);
  assert_int_equal(s[3].mode, EMBPS_BAG_PAD);
  assert_int_equal(s[3].bag, 12);
  assert_int_equal(s[5].bag, 13);
  assert_true(s[5].factor == 1.0f);
  embps_bag_sources_cpu(ids, weights, offsets, 4, 0, 0, 6, s);
  assert_int_equal(s[2].mode, EMBPS_BAG_WEIGHTED);
  assert_true(s[2].factor == 3.0f);
  embps_bag_sources_cpu(ids, NULL, offsets, 4, 0, 0, 6, s);
  assert_int_equal(s[0].mode, EMBPS_BAG_SUM);
  embps_bag_sources_cpu(NULL, NULL, NULL, 0, 0, 0, 6, s);
  for (int i = 0; i < 6; i++)
    assert_int_equal(s[i].mode, EMBPS_BAG_OWN);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fused_matches_expand_then_sum),
      cmocka_unit_test(test_sources_name_bag_and_mode),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
