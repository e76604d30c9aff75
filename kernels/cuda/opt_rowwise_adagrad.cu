/* Fused row-wise Adagrad on the device: one accumulator per row.
 *
 *   a = a * decay + row_sumsq / full_width;  w -= lr * g / (sqrt(a) + eps)
 *
 * A thread group per row (see cuda_common.cuh). The group's lane 0 alone reads, updates and
 * writes the row's accumulator and computes the step size s = lr / (sqrt(a) + eps) exactly as
 * the CPU does (1 / full_width is computed on the host the same way); a shuffle hands s to
 * the other lanes, which then apply w -= s * g over the width. Each lane loads its first
 * vector of w and g before the step size is computed: those loads do not depend on it, and
 * issuing them first overlaps them with the accumulator's load and the sqrt and division,
 * instead of waiting for the accumulator and then for the row. One writer per accumulator and
 * distinct rows mean no races; with -fmad=false every result is the CPU's bit for bit.
 *
 * bf16 rows take 8 columns a lane (16-byte loads and stores of the row, two of the gradient):
 * with 4, a 128-wide bf16 row was one warp moving 256 bytes of table per row, and on an H200 the
 * update of 330K distinct rows of a 1M-token Zipf batch ran at 2.79 TB/s, 65% of the device's
 * copy bandwidth, against 80% for f32 (tests/gpu/check.sh, bench_kernels_gpu). With 8, a warp
 * holds two rows and twice the bytes are in flight: 0.1238 -> 0.1121 ms, 72% of copy. */
#include "kernels/cuda/cuda_common.cuh"

template <typename T, int V>
__global__ void
rowwise_adagrad_kernel(T *__restrict__ table, size_t width, const int64_t *__restrict__ rows,
                       size_t n, const float *__restrict__ grad,
                       const float *__restrict__ row_sumsq, float inv_full_width,
                       float *__restrict__ accum, float lr, float eps, float decay, unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= n) /* whole groups leave together: the shuffle below uses the group mask */
    return;
  unsigned lane = embps__row_lane(tpr);
  unsigned warp_lane = threadIdx.x & 31u;
  unsigned mask = tpr == 32 ? 0xffffffffu : ((1u << tpr) - 1u) << (warp_lane & ~(tpr - 1u));
  size_t r = (size_t)rows[i];
  T *w = table + r * width;
  const float *g = grad + i * width;
  const size_t step = (size_t)tpr * V;
  size_t c = (size_t)lane * V;
  float wx[V], gx[V];
  if (c < width) {
    embps__load<V>(w + c, wx);
    embps__load<V>(g + c, gx);
  }
  float s = 0.0f;
  if (lane == 0) {
    float acc = accum[r] * decay + row_sumsq[i] * inv_full_width;
    accum[r] = acc;
    s = lr / (sqrtf(acc) + eps);
  }
  s = __shfl_sync(mask, s, 0, (int)tpr);
  while (c < width) {
    for (int k = 0; k < V; k++)
      wx[k] -= s * gx[k];
    embps__store<V>(w + c, wx);
    c += step;
    if (c < width) {
      embps__load<V>(w + c, wx);
      embps__load<V>(g + c, gx);
    }
  }
}

extern "C" embps_status_t
embps_update_rowwise_adagrad_cuda(void *table, embps_dtype_t dtype, size_t width,
                                  const int64_t *rows, size_t n, const float *grad,
                                  const float *row_sumsq, size_t full_width, float *accum,
                                  const embps_opt_params_t *p, cudaStream_t stream) {
  if (!p) {
    EMBPS_ERROR("rowwise adagrad: NULL params");
    return EMBPS_INVALID_ARGUMENT;
  }
  const float inv_full_width = full_width ? 1.0f / (float)full_width : 0.0f;
  const float lr = p->lr, eps = p->eps, decay = p->decay;
  /* width == 0 still updates the accumulators on the CPU; a width of 1 with no columns to
   * write does the same here (the column loop is empty). */
  size_t launch_width = width ? width : 1;
  auto launch = [&](auto t, auto v, const embps__row_launch_t &L) {
    using T = typename decltype(t)::type;
    constexpr int V = decltype(v)::value;
    rowwise_adagrad_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
        (T *)table, width, rows, n, grad, row_sumsq, inv_full_width, accum, lr, eps, decay, L.tpr);
  };
  if (dtype == EMBPS_DTYPE_BF16 && launch_width % 8 == 0 && embps__aligned(table, 16) &&
      embps__aligned(grad, 16))
    return embps__launch_rows<8>("rowwise adagrad", dtype, n, launch_width, true, launch);
  bool vec = embps__vec4_ok(width, table, embps_dtype_size(dtype), grad, NULL, NULL);
  return embps__launch_rows("rowwise adagrad", dtype, n, launch_width, vec, launch);
}
