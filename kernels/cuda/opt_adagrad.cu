/* Fused element-wise Adagrad on the device.
 *
 *   a = a * decay + g^2;  w -= lr * g / (sqrt(a) + eps)
 *
 * A thread group per row (see cuda_common.cuh), V elements per step. Every operation is the
 * CPU's, in its order, with IEEE sqrtf and division and no FMA (-fmad=false), so weights and
 * accumulators equal the CPU's bit for bit; bf16 weights are widened and rounded back to
 * nearest even, the f32 accumulator never is. */
#include "kernels/cuda/cuda_common.cuh"

template <typename T, int V>
__global__ void adagrad_kernel(T *__restrict__ table, size_t width,
                               const int64_t *__restrict__ rows, size_t n,
                               const float *__restrict__ grad, float *__restrict__ accum, float lr,
                               float eps, float decay, unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  size_t off = (size_t)rows[i] * width;
  T *w = table + off;
  float *a = accum + off;
  const float *g = grad + i * width;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float wx[V], ax[V], gx[V];
    embps__load<V>(w + c, wx);
    embps__load<V>(a + c, ax);
    embps__load<V>(g + c, gx);
    for (int k = 0; k < V; k++) {
      float acc = ax[k] * decay + gx[k] * gx[k];
      ax[k] = acc;
      wx[k] -= lr * gx[k] / (sqrtf(acc) + eps);
    }
    embps__store<V>(a + c, ax);
    embps__store<V>(w + c, wx);
  }
}

extern "C" embps_status_t embps_update_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                    const int64_t *rows, size_t n,
                                                    const float *grad, float *accum,
                                                    const embps_opt_params_t *p,
                                                    cudaStream_t stream) {
  if (!p) {
    EMBPS_ERROR("adagrad: NULL params");
    return EMBPS_INVALID_ARGUMENT;
  }
  const float lr = p->lr, eps = p->eps, decay = p->decay;
  bool vec = embps__vec4_ok(width, table, embps_dtype_size(dtype), grad, accum, NULL);
  return embps__launch_rows("adagrad", dtype, n, width, vec,
                            [&](auto t, auto v, const embps__row_launch_t &L) {
                              using T = typename decltype(t)::type;
                              constexpr int V = decltype(v)::value;
                              adagrad_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  (T *)table, width, rows, n, grad, accum, lr, eps, decay, L.tpr);
                            });
}
