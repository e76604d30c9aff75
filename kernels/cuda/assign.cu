/* Rows written as given on the device: the twin of kernels/assign.c (an Assign RPC).
 *
 * A group of `tpr` threads per row copies row src_rows[i] of src to row rows[i] of the table as
 * raw bytes, in the widest unit (16, 8, 4 or 2 bytes) that divides the row length and both base
 * pointers' alignment, no element converted, so the bits are the ones given (a bf16 NaN's payload
 * included); with the optimizer state asked for, the same group writes the row's state0 and
 * state1. rows are distinct, so every element has one writer. */
#include "kernels/cuda/cuda_common.cuh"

template <typename U>
__global__ void assign_rows_kernel(unsigned char *__restrict__ table,
                                   const int64_t *__restrict__ rows,
                                   const int64_t *__restrict__ src_rows, size_t n,
                                   const unsigned char *__restrict__ src, size_t row_bytes,
                                   size_t width, float *__restrict__ state0, size_t state0_width,
                                   float *__restrict__ state1, float state0_value, unsigned tpr) {
  const size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  const unsigned lane = embps__row_lane(tpr);
  const size_t r = (size_t)rows[i];
  const U *s = reinterpret_cast<const U *>(src + (size_t)src_rows[i] * row_bytes);
  U *d = reinterpret_cast<U *>(table + r * row_bytes);
  const size_t units = row_bytes / sizeof(U);
  for (size_t c = lane; c < units; c += tpr)
    d[c] = s[c];
  for (size_t j = lane; j < state0_width; j += tpr)
    state0[r * state0_width + j] = state0_value;
  if (state1)
    for (size_t j = lane; j < width; j += tpr)
      state1[r * width + j] = 0.0f;
}

template <typename U>
static embps_status_t launch_assign(void *table, size_t width, size_t row_bytes,
                                    const int64_t *rows, const int64_t *src_rows, size_t n,
                                    const void *src, float *state0, size_t state0_width,
                                    float *state1, float state0_value, cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  const size_t units = row_bytes / sizeof(U);
  size_t most = units > state0_width ? units : state0_width;
  embps__row_launch_t L;
  if (state1 && width > most)
    most = width;
  if (!embps__row_launch(n, most ? most : 1, 1, &L)) {
    EMBPS_ERROR("assign rows: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  assign_rows_kernel<U><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
      (unsigned char *)table, rows, src_rows, n, (const unsigned char *)src, row_bytes, width,
      state0, state0_width, state1, state0_value, L.tpr);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

extern "C" embps_status_t embps_assign_rows_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                 const int64_t *rows, const int64_t *src_rows,
                                                 size_t n, const void *src, float *state0,
                                                 size_t state0_width, float *state1,
                                                 float state0_value, cudaStream_t stream) {
  const size_t es = embps_dtype_size(dtype), row_bytes = width * es;
  uintptr_t a;
  if (es == 0) {
    EMBPS_ERROR("assign rows: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (state0_width != 0 && state0_width != 1 && state0_width != width) {
    EMBPS_ERROR("assign rows: state0 of %zu floats per row (0, 1 or the width %zu)", state0_width,
                width);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || (width == 0 && state0_width == 0))
    return EMBPS_OK;
  if (!rows || !src_rows || (width && (!table || !src)) || (state0_width && !state0)) {
    EMBPS_ERROR("assign rows: NULL %s", !rows       ? "rows"
                                        : !src_rows ? "src_rows"
                                        : !table    ? "table"
                                        : !src      ? "src"
                                                    : "state0");
    return EMBPS_INVALID_ARGUMENT;
  }
  a = (uintptr_t)table | (uintptr_t)src | (uintptr_t)row_bytes;
  if ((a & 15) == 0)
    return launch_assign<uint4>(table, width, row_bytes, rows, src_rows, n, src, state0,
                                state0_width, state1, state0_value, stream);
  if ((a & 7) == 0)
    return launch_assign<uint2>(table, width, row_bytes, rows, src_rows, n, src, state0,
                                state0_width, state1, state0_value, stream);
  if ((a & 3) == 0)
    return launch_assign<uint32_t>(table, width, row_bytes, rows, src_rows, n, src, state0,
                                   state0_width, state1, state0_value, stream);
  return launch_assign<uint16_t>(table, width, row_bytes, rows, src_rows, n, src, state0,
                                 state0_width, state1, state0_value, stream);
}
