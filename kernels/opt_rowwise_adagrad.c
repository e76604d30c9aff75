/* Fused row-wise Adagrad: one accumulator per row.
 *
 *   a = a * decay + row_sumsq / full_width;  w -= lr * g / (sqrt(a) + eps)
 *
 * The row's mean square must be over the table's full width, while this rank holds only a
 * column slice, so the caller supplies row_sumsq (its own row_stats, all-reduced over the
 * group) and full_width; every rank then computes the same accumulator and the same step size.
 * The step size lr / (sqrt(a) + eps) is computed once per row, which leaves the inner loop a
 * scaled subtraction over the width that vectorizes. Math is f32; bf16 weights are widened and
 * rounded back to nearest even. */
#include <math.h>

#include "kernels/embps_kernels.h"

static void scale_row_f32(float *restrict w, const float *restrict g, size_t width, float s) {
  for (size_t j = 0; j < width; j++)
    w[j] -= s * g[j];
}

static void scale_row_bf16(uint16_t *restrict w, const float *restrict g, size_t width, float s) {
  for (size_t j = 0; j < width; j++)
    w[j] = embps_f32_to_bf16(embps_bf16_to_f32(w[j]) - s * g[j]);
}

void embps_update_rowwise_adagrad_cpu(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, size_t n, const float *grad,
                                      const float *row_sumsq, size_t full_width, float *accum,
                                      const embps_opt_params_t *p) {
  const float inv_full_width = full_width ? 1.0f / (float)full_width : 0.0f;
  const size_t row_bytes = width * embps_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    size_t r = (size_t)rows[i];
    if (i + EMBPS_PREFETCH_ROWS < n)
      embps_prefetch_row((char *)table + (size_t)rows[i + EMBPS_PREFETCH_ROWS] * row_bytes,
                         row_bytes, &accum[rows[i + EMBPS_PREFETCH_ROWS]]);
    float acc = accum[r] * p->decay + row_sumsq[i] * inv_full_width;
    accum[r] = acc;
    float s = p->lr / (sqrtf(acc) + p->eps);
    const float *g = grad + i * width;
    if (dtype == EMBPS_DTYPE_BF16)
      scale_row_bf16((uint16_t *)table + r * width, g, width, s);
    else
      scale_row_f32((float *)table + r * width, g, width, s);
  }
}
