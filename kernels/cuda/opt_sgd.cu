/* Fused SGD on the device: w -= lr * g on the touched rows.
 *
 * A thread group per row (see cuda_common.cuh), V elements per step; math in f32, bf16 rows
 * widened and rounded back to nearest even with the twin of common/dtype.h's conversion. The
 * product and the difference round separately, as on the CPU (-fmad=false). Rows are
 * distinct, so groups never touch the same row. */
#include "kernels/cuda/cuda_common.cuh"

template <typename T, int V>
__global__ void sgd_kernel(T *__restrict__ table, size_t width, const int64_t *__restrict__ rows,
                           size_t n, const float *__restrict__ grad, float lr, unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  T *w = table + (size_t)rows[i] * width;
  const float *g = grad + i * width;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float x[V], y[V];
    embps__load<V>(w + c, x);
    embps__load<V>(g + c, y);
    for (int k = 0; k < V; k++)
      x[k] -= lr * y[k];
    embps__store<V>(w + c, x);
  }
}

extern "C" embps_status_t embps_update_sgd_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                const int64_t *rows, size_t n, const float *grad,
                                                const embps_opt_params_t *p, cudaStream_t stream) {
  if (!p) {
    EMBPS_ERROR("sgd: NULL params");
    return EMBPS_INVALID_ARGUMENT;
  }
  const float lr = p->lr;
  bool vec = embps__vec4_ok(width, table, embps_dtype_size(dtype), grad, NULL, NULL);
  return embps__launch_rows(
      "sgd", dtype, n, width, vec, [&](auto t, auto v, const embps__row_launch_t &L) {
        using T = typename decltype(t)::type;
        constexpr int V = decltype(v)::value;
        sgd_kernel<T, V>
            <<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>((T *)table, width, rows, n, grad, lr, L.tpr);
      });
}
