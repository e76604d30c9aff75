/* Fused Adam with bias correction.
 *
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
 *   w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 *
 * t is the table's step count (p->step), shared by all rows: this is the usual sparse Adam
 * where a row's moments decay only on the steps that touch it but the bias correction follows
 * the table. The two corrections are scalars per call, computed in double (1 - b2^t loses
 * most of its f32 digits to cancellation when t is small) and turned into f32 reciprocals, so
 * the inner loop is multiplications, one sqrt and one division over the width and vectorizes.
 * m and v are f32 state indexed like the table; bf16 weights are widened and rounded back to
 * nearest even. */
#include <math.h>

#include "kernels/embps_kernels.h"

typedef struct adam_consts {
  float lr, eps, b1, b2, c1, c2; /* c1 = 1-b1, c2 = 1-b2 */
  float inv_bc1, inv_bc2;        /* 1 / (1 - b^t) */
} adam_consts_t;

static void adam_row_f32(float *restrict w, float *restrict m, float *restrict v,
                         const float *restrict g, size_t width, adam_consts_t k) {
  for (size_t j = 0; j < width; j++) {
    float mj = k.b1 * m[j] + k.c1 * g[j];
    float vj = k.b2 * v[j] + k.c2 * g[j] * g[j];
    m[j] = mj;
    v[j] = vj;
    w[j] -= k.lr * (mj * k.inv_bc1) / (sqrtf(vj * k.inv_bc2) + k.eps);
  }
}

static void adam_row_bf16(uint16_t *restrict w, float *restrict m, float *restrict v,
                          const float *restrict g, size_t width, adam_consts_t k) {
  for (size_t j = 0; j < width; j++) {
    float mj = k.b1 * m[j] + k.c1 * g[j];
    float vj = k.b2 * v[j] + k.c2 * g[j] * g[j];
    m[j] = mj;
    v[j] = vj;
    float wj = embps_bf16_to_f32(w[j]);
    w[j] = embps_f32_to_bf16(wj - k.lr * (mj * k.inv_bc1) / (sqrtf(vj * k.inv_bc2) + k.eps));
  }
}

void embps_update_adam_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                           size_t n, const float *grad, float *m, float *v,
                           const embps_opt_params_t *p) {
  /* step is 1-based; 0 would divide by zero in the correction, so it counts as the first. */
  double t = p->step ? (double)p->step : 1.0;
  adam_consts_t k = {
      .lr = p->lr,
      .eps = p->eps,
      .b1 = p->beta1,
      .b2 = p->beta2,
      .c1 = 1.0f - p->beta1,
      .c2 = 1.0f - p->beta2,
      .inv_bc1 = (float)(1.0 / (1.0 - pow((double)p->beta1, t))),
      .inv_bc2 = (float)(1.0 / (1.0 - pow((double)p->beta2, t))),
  };
  const size_t row_bytes = width * embps_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    size_t off = (size_t)rows[i] * width;
    if (i + EMBPS_PREFETCH_ROWS < n) {
      const size_t next = (size_t)rows[i + EMBPS_PREFETCH_ROWS];
      embps_prefetch_row((char *)table + next * row_bytes, row_bytes, NULL);
      embps_prefetch_row(m + next * width, width * sizeof(float), NULL);
      embps_prefetch_row(v + next * width, width * sizeof(float), NULL);
    }
    const float *g = grad + i * width;
    if (dtype == EMBPS_DTYPE_BF16)
      adam_row_bf16((uint16_t *)table + off, m + off, v + off, g, width, k);
    else
      adam_row_f32((float *)table + off, m + off, v + off, g, width, k);
  }
}
