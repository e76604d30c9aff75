/* Fused element-wise Adagrad with an optional accumulator half-life.
 *
 *   a = a * decay + g^2;  w -= lr * g / (sqrt(a) + eps)
 *
 * The accumulator is f32 and indexed like the table (num_rows x width), so the state row and
 * the weight row are both contiguous and the inner loop streams over the width; decay == 1 is
 * the classic Adagrad. Math is f32; bf16 weights are widened and rounded back to nearest even,
 * the accumulator never is (it only grows or decays smoothly, and rounding it to bf16 would
 * stall it). The dtype is dispatched once per row so each loop vectorizes. */
#include <math.h>

#include "kernels/embps_kernels.h"

static void adagrad_row_f32(float *restrict w, float *restrict a, const float *restrict g,
                            size_t width, float lr, float eps, float decay) {
  for (size_t j = 0; j < width; j++) {
    float acc = a[j] * decay + g[j] * g[j];
    a[j] = acc;
    w[j] -= lr * g[j] / (sqrtf(acc) + eps);
  }
}

static void adagrad_row_bf16(uint16_t *restrict w, float *restrict a, const float *restrict g,
                             size_t width, float lr, float eps, float decay) {
  for (size_t j = 0; j < width; j++) {
    float acc = a[j] * decay + g[j] * g[j];
    a[j] = acc;
    w[j] = embps_f32_to_bf16(embps_bf16_to_f32(w[j]) - lr * g[j] / (sqrtf(acc) + eps));
  }
}

void embps_update_adagrad_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                              size_t n, const float *grad, float *accum,
                              const embps_opt_params_t *p) {
  const size_t row_bytes = width * embps_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    size_t off = (size_t)rows[i] * width;
    if (i + EMBPS_PREFETCH_ROWS < n) {
      const size_t next = (size_t)rows[i + EMBPS_PREFETCH_ROWS];
      embps_prefetch_row((char *)table + next * row_bytes, row_bytes, NULL);
      embps_prefetch_row(accum + next * width, width * sizeof(float), NULL);
    }
    const float *g = grad + i * width;
    if (dtype == EMBPS_DTYPE_BF16)
      adagrad_row_bf16((uint16_t *)table + off, accum + off, g, width, p->lr, p->eps, p->decay);
    else
      adagrad_row_f32((float *)table + off, accum + off, g, width, p->lr, p->eps, p->decay);
  }
}

/* The decay helper lives here, with the first optimizer that uses it. exp(-ln 2 / h) halves
 * an accumulator's old contribution every h steps. Computed in double, rounded once. */
float embps_opt_decay_from_half_life(float half_life) {
  if (!(half_life > 0.0f))
    return 1.0f;
  return (float)exp(-0.69314718055994530942 / (double)half_life);
}
