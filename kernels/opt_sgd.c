/* Fused SGD: w -= lr * g on the touched rows.
 *
 * Math is f32. The storage dtype is dispatched once per call, not per element, so each inner
 * loop is a plain stream over the row's width that the compiler vectorizes; bf16 rows are
 * widened, updated and rounded back to nearest even. Rows are distinct (the caller summed the
 * duplicates), so no row is read after being written in the same call. */
#include "kernels/embps_kernels.h"

static void sgd_row_f32(float *restrict w, const float *restrict g, size_t width, float lr) {
  for (size_t j = 0; j < width; j++)
    w[j] -= lr * g[j];
}

static void sgd_row_bf16(uint16_t *restrict w, const float *restrict g, size_t width, float lr) {
  for (size_t j = 0; j < width; j++)
    w[j] = embps_f32_to_bf16(embps_bf16_to_f32(w[j]) - lr * g[j]);
}

void embps_update_sgd_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                          size_t n, const float *grad, const embps_opt_params_t *p) {
  const float lr = p->lr;
  const size_t row_bytes = width * embps_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    size_t off = (size_t)rows[i] * width;
    if (i + EMBPS_PREFETCH_ROWS < n)
      embps_prefetch_row((char *)table + (size_t)rows[i + EMBPS_PREFETCH_ROWS] * row_bytes,
                         row_bytes, NULL);
    const float *g = grad + i * width;
    if (dtype == EMBPS_DTYPE_BF16)
      sgd_row_bf16((uint16_t *)table + off, g, width, lr);
    else
      sgd_row_f32((float *)table + off, g, width, lr);
  }
}
