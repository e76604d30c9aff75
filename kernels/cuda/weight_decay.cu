/* Weight decay folded into the gradient on the device: g += wd * w.
 *
 * A thread group per row (see cuda_common.cuh); the table row is read in its storage dtype and
 * widened to f32, and g is updated as (wd * w) then g + that, two roundings like the CPU's
 * (no FMA: the library is built with -fmad=false). Nothing is enqueued when wd == 0, as the
 * CPU returns at once. */
#include "kernels/cuda/cuda_common.cuh"

template <typename T, int V>
__global__ void weight_decay_kernel(const T *__restrict__ table, size_t width,
                                    const int64_t *__restrict__ rows, size_t n,
                                    float *__restrict__ grad, float wd, unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  const T *w = table + (size_t)rows[i] * width;
  float *g = grad + i * width;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float x[V], y[V];
    embps__load<V>(w + c, x);
    embps__load<V>(g + c, y);
    for (int k = 0; k < V; k++)
      y[k] += wd * x[k];
    embps__store<V>(g + c, y);
  }
}

extern "C" embps_status_t embps_apply_weight_decay_cuda(const void *table, embps_dtype_t dtype,
                                                        size_t width, const int64_t *rows, size_t n,
                                                        float *grad, float weight_decay,
                                                        cudaStream_t stream) {
  if (weight_decay == 0.0f && embps_dtype_size(dtype) != 0)
    return EMBPS_OK;
  bool vec = embps__vec4_ok(width, table, embps_dtype_size(dtype), grad, NULL, NULL);
  return embps__launch_rows("weight decay", dtype, n, width, vec,
                            [&](auto t, auto v, const embps__row_launch_t &L) {
                              using T = typename decltype(t)::type;
                              constexpr int V = decltype(v)::value;
                              weight_decay_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  (const T *)table, width, rows, n, grad, weight_decay, L.tpr);
                            });
}
