/* embps_segment_sum_cpu: the contract fixes the order of every sum (ascending position, in
 * f32), so the result must equal, bit for bit, a naive per-segment f32 loop in that order; it
 * must also be close to a double-precision sum. Inputs span many magnitudes so that a
 * different summation order would give different bits (checked: the reverse order differs). */
#include <math.h>

#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static float grad_value(kt_rng_t *rng) {
  /* Signs and magnitudes from 1e-3 to 1e3, so f32 rounding depends on order. */
  float mag = (float)pow(10.0, kt_uniform(rng, -3.0f, 3.0f));
  return kt_next(rng) & 1 ? mag : -mag;
}

static void run_case(embps_dtype_t dtype, size_t n, size_t width, size_t vocab, kt_rng_t *rng) {
  size_t es = embps_dtype_size(dtype);
  int64_t *tokens = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++) {
    double u = kt_unit(rng);
    tokens[i] = (int64_t)((double)vocab * u * u * u); /* skewed: a few hot tokens */
  }
  int64_t *unique = kt_alloc(n * sizeof(int64_t));
  uint32_t *seg = kt_alloc(n * sizeof(uint32_t));
  void *ws = kt_alloc(embps_dedup_workspace_bytes(n));
  size_t nu = embps_dedup_cpu(tokens, n, unique, seg, ws);

  void *grads = kt_alloc(n * width * es);
  float *gval = kt_alloc(n * width * sizeof(float)); /* the values as f32 */
  for (size_t k = 0; k < n * width; k++) {
    float v = grad_value(rng);
    if (dtype == EMBPS_DTYPE_BF16) {
      ((uint16_t *)grads)[k] = embps_f32_to_bf16(v);
      gval[k] = kt_bf16_round(v);
    } else {
      ((float *)grads)[k] = v;
      gval[k] = v;
    }
  }

  float *out = kt_alloc(nu * width * sizeof(float));
  for (size_t k = 0; k < nu * width; k++)
    out[k] = NAN; /* must be overwritten, not accumulated into */
  embps_segment_sum_cpu(grads, dtype, width, seg, n, nu, out);

  size_t order_matters = 0;
  for (size_t s = 0; s < nu; s++) {
    for (size_t j = 0; j < width; j++) {
      float fwd = 0.0f, rev = 0.0f;
      double dsum = 0.0, dabs = 0.0;
      for (size_t i = 0; i < n; i++) {
        if (seg[i] != s)
          continue;
        fwd += gval[i * width + j];
        dsum += gval[i * width + j];
        dabs += fabs(gval[i * width + j]);
      }
      for (size_t i = n; i-- > 0;)
        if (seg[i] == s)
          rev += gval[i * width + j];
      float got = out[s * width + j];
      assert_true(memcmp(&got, &fwd, sizeof(float)) == 0);
      assert_true(fabs(got - dsum) <= 1e-5 * dabs + 1e-30);
      order_matters += rev != fwd;
    }
  }
  /* The inputs are sensitive to order, so the bitwise check above means something. */
  if (n > 1000)
    assert_true(order_matters > 0);

  free(out);
  free(gval);
  free(grads);
  free(ws);
  free(seg);
  free(unique);
  free(tokens);
}

static void test_f32(void **state) {
  (void)state;
  kt_rng_t rng = {21};
  run_case(EMBPS_DTYPE_F32, 4096, 16, 300, &rng);
  run_case(EMBPS_DTYPE_F32, 2000, 5, 7, &rng);
  run_case(EMBPS_DTYPE_F32, 1, 8, 10, &rng);
}

static void test_bf16(void **state) {
  (void)state;
  kt_rng_t rng = {22};
  run_case(EMBPS_DTYPE_BF16, 4096, 16, 300, &rng);
  run_case(EMBPS_DTYPE_BF16, 2000, 3, 7, &rng);
}

static void test_explicit(void **state) {
  (void)state;
  /* Three positions, segments {0: pos 0, 2}, {1: pos 1}; bf16 values exactly representable. */
  uint16_t g[6] = {embps_f32_to_bf16(1.5f), embps_f32_to_bf16(-2.0f), embps_f32_to_bf16(0.25f),
                   embps_f32_to_bf16(8.0f), embps_f32_to_bf16(0.5f),  embps_f32_to_bf16(-0.125f)};
  uint32_t seg[3] = {0, 1, 0};
  float out[4] = {9, 9, 9, 9};
  embps_segment_sum_cpu(g, EMBPS_DTYPE_BF16, 2, seg, 3, 2, out);
  assert_true(out[0] == 2.0f && out[1] == -2.125f && out[2] == 0.25f && out[3] == 8.0f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_f32),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_explicit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
