/* Deterministic table initializer on the device: the same values as kernels/init.c, bit for
 * bit.
 *
 * The hash (init_hash.cuh, shared with hash.cu's initial rows of keys) is integer arithmetic
 * (splitmix64's finalizer, mixed with the seed, the row and the column exactly as init.c does),
 * so it is the same everywhere; the value is then k * 2^-23 - 1 (exact in f32) times scale (one
 * rounding, identical to the CPU's), and bf16 storage goes through the twin of common/dtype.h's
 * conversion. Row 0 (padding) is 0. A thread group per row (see cuda_common.cuh), each thread
 * hashing the row once and then one mix per element. */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/init_hash.cuh"

template <typename T>
__global__ void init_kernel(T *__restrict__ table, size_t width, uint64_t row_begin,
                            size_t num_rows, uint64_t col_begin, uint64_t seed, float scale,
                            unsigned tpr) {
  size_t i = embps__row_index(tpr);
  if (i >= num_rows)
    return;
  uint64_t r = row_begin + i;
  uint64_t rh = embps__init_row_hash(seed, r);
  T *w = table + (size_t)r * width;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, 1, width) {
    float x[1] = {r == 0 ? 0.0f : embps__init_value(rh, col_begin + c, scale)};
    embps__store<1>(w + c, x);
  }
}

extern "C" embps_status_t embps_init_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                               uint64_t row_begin, uint64_t row_end,
                                               uint64_t col_begin, uint64_t seed, float scale,
                                               cudaStream_t stream) {
  size_t num_rows = row_end > row_begin ? (size_t)(row_end - row_begin) : 0;
  return embps__launch_rows(
      "init", dtype, num_rows, width, false, [&](auto t, auto v, const embps__row_launch_t &L) {
        using T = typename decltype(t)::type;
        (void)v;
        init_kernel<T><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
            (T *)table, width, row_begin, num_rows, col_begin, seed, scale, L.tpr);
      });
}
