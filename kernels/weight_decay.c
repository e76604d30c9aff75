/* Weight decay folded into the gradient: g += wd * w.
 *
 * It is a separate pass rather than part of each update so that everything computed from the
 * gradient before the update (rowwise Adagrad's row mean square, the norm, the finite check)
 * sees the decayed gradient, the same one the update applies. Table rows are read in their
 * storage dtype and widened to f32; the gradient is f32. */
#include "kernels/embps_kernels.h"

static void decay_row_f32(float *restrict g, const float *restrict w, size_t width, float wd) {
  for (size_t j = 0; j < width; j++)
    g[j] += wd * w[j];
}

static void decay_row_bf16(float *restrict g, const uint16_t *restrict w, size_t width, float wd) {
  for (size_t j = 0; j < width; j++)
    g[j] += wd * embps_bf16_to_f32(w[j]);
}

void embps_apply_weight_decay_cpu(const void *table, embps_dtype_t dtype, size_t width,
                                  const int64_t *rows, size_t n, float *grad, float weight_decay) {
  if (weight_decay == 0.0f)
    return;
  for (size_t i = 0; i < n; i++) {
    size_t off = (size_t)rows[i] * width;
    if (dtype == EMBPS_DTYPE_BF16)
      decay_row_bf16(grad + i * width, (const uint16_t *)table + off, width, weight_decay);
    else
      decay_row_f32(grad + i * width, (const float *)table + off, width, weight_decay);
  }
}
