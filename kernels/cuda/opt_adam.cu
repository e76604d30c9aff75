/* Fused Adam with bias correction on the device.
 *
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
 *   w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 *
 * The bias corrections are computed on the host exactly as the CPU computes them (in double,
 * then f32 reciprocals), and passed by value with the other constants; the kernel then does
 * the CPU's f32 operations in the CPU's order (no FMA: -fmad=false), so m, v and the weights
 * are the CPU's bit for bit. A thread group per row (see cuda_common.cuh). */
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

typedef struct adam_consts {
  float lr, eps, b1, b2, c1, c2; /* c1 = 1-b1, c2 = 1-b2 */
  float inv_bc1, inv_bc2;        /* 1 / (1 - b^t) */
} adam_consts_t;

template <typename T, int V>
__global__ void adam_kernel(T *__restrict__ table, size_t width, const int64_t *__restrict__ rows,
                            size_t n, const float *__restrict__ grad, float *__restrict__ m,
                            float *__restrict__ v, adam_consts_t k, unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  size_t off = (size_t)rows[i] * width;
  T *w = table + off;
  float *mr = m + off, *vr = v + off;
  const float *g = grad + i * width;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float wx[V], mx[V], vx[V], gx[V];
    embps__load<V>(w + c, wx);
    embps__load<V>(mr + c, mx);
    embps__load<V>(vr + c, vx);
    embps__load<V>(g + c, gx);
    for (int e = 0; e < V; e++) {
      float mj = k.b1 * mx[e] + k.c1 * gx[e];
      float vj = k.b2 * vx[e] + k.c2 * gx[e] * gx[e];
      mx[e] = mj;
      vx[e] = vj;
      wx[e] -= k.lr * (mj * k.inv_bc1) / (sqrtf(vj * k.inv_bc2) + k.eps);
    }
    embps__store<V>(mr + c, mx);
    embps__store<V>(vr + c, vx);
    embps__store<V>(w + c, wx);
  }
}

extern "C" embps_status_t embps_update_adam_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                 const int64_t *rows, size_t n, const float *grad,
                                                 float *m, float *v, const embps_opt_params_t *p,
                                                 cudaStream_t stream) {
  if (!p) {
    EMBPS_ERROR("adam: NULL params");
    return EMBPS_INVALID_ARGUMENT;
  }
  /* As embps_update_adam_cpu: step 0 counts as the first. */
  double t = p->step ? (double)p->step : 1.0;
  adam_consts_t k;
  k.lr = p->lr;
  k.eps = p->eps;
  k.b1 = p->beta1;
  k.b2 = p->beta2;
  k.c1 = 1.0f - p->beta1;
  k.c2 = 1.0f - p->beta2;
  k.inv_bc1 = (float)(1.0 / (1.0 - pow((double)p->beta1, t)));
  k.inv_bc2 = (float)(1.0 / (1.0 - pow((double)p->beta2, t)));
  bool vec = embps__vec4_ok(width, table, embps_dtype_size(dtype), grad, m, v);
  return embps__launch_rows("adam", dtype, n, width, vec,
                            [&](auto tt, auto vv, const embps__row_launch_t &L) {
                              using T = typename decltype(tt)::type;
                              constexpr int V = decltype(vv)::value;
                              adam_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  (T *)table, width, rows, n, grad, m, v, k, L.tpr);
                            });
}
