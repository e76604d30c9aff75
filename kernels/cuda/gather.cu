/* Row gather and expand on the device: a group of threads copies each row.
 *
 * Like the CPU's memcpy per row, no element is converted: a row is row_bytes of raw data and
 * is moved in the widest unit (16, 8, 4 or 2 bytes) that divides the row length and both
 * base pointers' alignment, so a 128-wide f32 row is 32 lanes x one 16-byte load/store and a
 * 7-wide bf16 row is 7 threads x 2 bytes. Rows are spread over tpr threads (the smallest
 * power of two covering the row's units, at most a warp), so narrow rows keep the lanes busy
 * on other rows. Each group copies ROWS_PER_GROUP consecutive output rows at once: it reads
 * their indices, then issues one load per row before the first store, so a thread has several
 * row loads in flight instead of one (a gather is a chain of two dependent loads, index then
 * row, and bandwidth needs bytes in flight). Gather indexes by int64 row id, expand by uint32
 * segment id; both come from one template. */
#include "kernels/cuda/cuda_common.cuh"

#define ROWS_PER_GROUP 4

template <typename U, typename I>
__global__ void copy_rows_kernel(const U *__restrict__ src, const I *__restrict__ idx, size_t n,
                                 size_t units, unsigned tpr, U *__restrict__ out) {
  size_t r0 = embps__row_index(tpr) * ROWS_PER_GROUP;
  if (r0 >= n)
    return;
  const unsigned rows = n - r0 < ROWS_PER_GROUP ? (unsigned)(n - r0) : ROWS_PER_GROUP;
  const U *s[ROWS_PER_GROUP];
  U *d[ROWS_PER_GROUP];
#pragma unroll
  for (unsigned k = 0; k < ROWS_PER_GROUP; k++) {
    size_t r = r0 + (k < rows ? k : 0); /* past the end: row r0 again, never accessed */
    s[k] = src + (size_t)idx[r] * units;
    d[k] = out + r * units;
  }
  for (size_t c = embps__row_lane(tpr); c < units; c += tpr) {
    U v[ROWS_PER_GROUP];
#pragma unroll
    for (unsigned k = 0; k < ROWS_PER_GROUP; k++)
      if (k < rows)
        v[k] = s[k][c];
#pragma unroll
    for (unsigned k = 0; k < ROWS_PER_GROUP; k++)
      if (k < rows)
        d[k][c] = v[k];
  }
}

template <typename U, typename I>
static embps_status_t launch(const void *src, const I *idx, size_t n, size_t row_bytes, void *out,
                             cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  size_t units = row_bytes / sizeof(U);
  embps__row_launch_t L;
  if (!embps__row_launch((n + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP, units, 1, &L)) {
    EMBPS_ERROR("copy rows: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  copy_rows_kernel<U, I>
      <<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>((const U *)src, idx, n, units, L.tpr, (U *)out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

template <typename I>
static embps_status_t copy_rows(const char *what, const void *src, embps_dtype_t dtype,
                                size_t width, const I *idx, size_t n, void *out,
                                cudaStream_t stream) {
  size_t es = embps_dtype_size(dtype);
  if (es == 0) {
    EMBPS_ERROR("%s: invalid dtype %d", what, (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || width == 0)
    return EMBPS_OK;
  size_t row_bytes = width * es;
  uintptr_t a = (uintptr_t)src | (uintptr_t)out | (uintptr_t)row_bytes;
  if ((a & 15) == 0)
    return launch<uint4, I>(src, idx, n, row_bytes, out, stream);
  if ((a & 7) == 0)
    return launch<uint2, I>(src, idx, n, row_bytes, out, stream);
  if ((a & 3) == 0)
    return launch<uint32_t, I>(src, idx, n, row_bytes, out, stream);
  return launch<uint16_t, I>(src, idx, n, row_bytes, out, stream);
}

extern "C" embps_status_t embps_gather_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                            const int64_t *rows, size_t n, void *out,
                                            cudaStream_t stream) {
  return copy_rows("gather", table, dtype, width, rows, n, out, stream);
}

extern "C" embps_status_t embps_expand_cuda(const void *src, embps_dtype_t dtype, size_t width,
                                            const uint32_t *segment_ids, size_t n, void *out,
                                            cudaStream_t stream) {
  return copy_rows("expand", src, dtype, width, segment_ids, n, out, stream);
}
