/* Internals shared by the CUDA kernels (not part of the public face, embps_kernels_cuda.h).
 *
 * - Every CUDA runtime call and every launch goes through common/cuda_check.h's
 *   EMBPS_CUDA_CHECK_GOTO (a launcher has no embps_error_t, so it passes NULL): a CUDA error is
 *   logged with file:line and becomes EMBPS_INTERNAL.
 * - The row mapping used by the row kernels: `tpr` threads (a power of two, at most a warp)
 *   work on one row, so narrow rows (width 1 or 7) do not leave 31 of 32 lanes idle, and a
 *   warp never straddles a row group. Each thread handles V consecutive elements per step
 *   (V = 4 when the width and every pointer allow 16-byte f32 / 8-byte bf16 vector accesses,
 *   else 1), striding over the row by tpr * V.
 * - bf16 conversions that are bit-for-bit twins of common/dtype.h's (round to nearest even,
 *   NaN kept NaN by setting the quiet bit), written with integer operations only so they do
 *   not depend on the device's own bf16 conversion (whose NaN result differs).
 *
 * Floating-point determinism: every kernel computes each output from its inputs in a fixed
 * order with no atomics. The library is compiled with -fmad=false (kernels/CMakeLists.txt)
 * so no multiply-add is contracted into an FMA: the CPU references are built with
 * -ffp-contract=off, and a contracted a*b+c rounds once instead of twice. Division and
 * sqrtf are IEEE round-to-nearest (nvcc's defaults -prec-div=true -prec-sqrt=true, and no
 * -use_fast_math), denormals are kept (-ftz=false), like the CPU's SSE defaults. */
#ifndef EMBPS_KERNELS_CUDA_COMMON_CUH
#define EMBPS_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/embps_kernels_cuda.h" /* first: opens C linkage for common/status.h */

#include "common/cuda_check.h"

/* Checks the launch just made (configuration errors, and any error left by earlier work). */
#define EMBPS_CUDA_CHECK_LAUNCH_GOTO(label) EMBPS_CUDA_CHECK_GOTO(cudaGetLastError(), NULL, label)

/* Threads per block for every row kernel: 8 warps, enough to hide latency at any width. */
#define EMBPS_CUDA_BLOCK 256

/* bf16 storage is handled as its raw bits. */
typedef uint16_t embps__bf16_bits;

__device__ __forceinline__ float embps__bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t embps__f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Loads V consecutive elements of storage type T (float or bf16 bits) as f32; p must be
 * aligned to V elements (to 4 floats when V = 8). */
template <int V> __device__ __forceinline__ void embps__load(const float *p, float (&x)[V]) {
  if constexpr (V == 8) {
    float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else if constexpr (V == 4) {
    float4 q = *reinterpret_cast<const float4 *>(p);
    x[0] = q.x;
    x[1] = q.y;
    x[2] = q.z;
    x[3] = q.w;
  } else {
    for (int k = 0; k < V; k++)
      x[k] = p[k];
  }
}

template <int V> __device__ __forceinline__ void embps__load(const uint16_t *p, float (&x)[V]) {
  if constexpr (V == 8) {
    uint4 q = *reinterpret_cast<const uint4 *>(p);
    const uint32_t u[4] = {q.x, q.y, q.z, q.w};
    for (int k = 0; k < 4; k++) {
      x[2 * k] = embps__bf16_to_f32((uint16_t)(u[k] & 0xffffu));
      x[2 * k + 1] = embps__bf16_to_f32((uint16_t)(u[k] >> 16));
    }
  } else if constexpr (V == 4) {
    uint2 q = *reinterpret_cast<const uint2 *>(p); /* little-endian: element 0 is the low half */
    x[0] = embps__bf16_to_f32((uint16_t)(q.x & 0xffffu));
    x[1] = embps__bf16_to_f32((uint16_t)(q.x >> 16));
    x[2] = embps__bf16_to_f32((uint16_t)(q.y & 0xffffu));
    x[3] = embps__bf16_to_f32((uint16_t)(q.y >> 16));
  } else {
    for (int k = 0; k < V; k++)
      x[k] = embps__bf16_to_f32(p[k]);
  }
}

/* Stores V f32 values as storage type T (bf16 rounded to nearest even). */
template <int V> __device__ __forceinline__ void embps__store(float *p, const float (&x)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4 *>(p) = make_float4(x[0], x[1], x[2], x[3]);
  } else {
    for (int k = 0; k < V; k++)
      p[k] = x[k];
  }
}

template <int V> __device__ __forceinline__ void embps__store(uint16_t *p, const float (&x)[V]) {
  if constexpr (V == 8) {
    uint32_t u[4];
    for (int k = 0; k < 4; k++)
      u[k] = (uint32_t)embps__f32_to_bf16(x[2 * k]) |
             ((uint32_t)embps__f32_to_bf16(x[2 * k + 1]) << 16);
    *reinterpret_cast<uint4 *>(p) = make_uint4(u[0], u[1], u[2], u[3]);
  } else if constexpr (V == 4) {
    uint2 q;
    q.x = (uint32_t)embps__f32_to_bf16(x[0]) | ((uint32_t)embps__f32_to_bf16(x[1]) << 16);
    q.y = (uint32_t)embps__f32_to_bf16(x[2]) | ((uint32_t)embps__f32_to_bf16(x[3]) << 16);
    *reinterpret_cast<uint2 *>(p) = q;
  } else {
    for (int k = 0; k < V; k++)
      p[k] = embps__f32_to_bf16(x[k]);
  }
}

/* Launch shape of a row kernel over n rows of `width` elements handled V at a time. */
typedef struct embps__row_shape {
  unsigned tpr; /* threads per row: power of two, 1..32 */
  dim3 grid;    /* grid.x covers n * tpr threads in EMBPS_CUDA_BLOCK blocks */
} embps__row_launch_t;

/* Smallest power of two >= the number of V-vectors in a row, capped at a warp. */
static inline unsigned embps__threads_per_row(size_t width, unsigned v) {
  size_t vecs = (width + v - 1) / v;
  unsigned tpr = 1;
  while (tpr < 32 && tpr < vecs)
    tpr <<= 1;
  return tpr;
}

/* Fills *out for n rows; returns 0 when the grid would exceed CUDA's limit (2^31 - 1 blocks,
 * that is more than 2^36 rows) so the launcher can reject the call. */
static inline int embps__row_launch(size_t n, size_t width, unsigned v, embps__row_launch_t *out) {
  unsigned tpr = embps__threads_per_row(width, v);
  size_t rows_per_block = EMBPS_CUDA_BLOCK / tpr;
  size_t blocks = (n + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffffu)
    return 0;
  out->tpr = tpr;
  out->grid = dim3((unsigned)blocks, 1, 1);
  return 1;
}

/* Inside a row kernel: this thread's row (may be >= n: the thread then only takes part in
 * warp-wide operations) and lane within the row group. */
__device__ __forceinline__ size_t embps__row_index(unsigned tpr) {
  return ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / tpr;
}

__device__ __forceinline__ unsigned embps__row_lane(unsigned tpr) {
  return threadIdx.x & (tpr - 1);
}

/* True when p is aligned to `bytes` (a power of two). NULL counts as aligned. */
static inline int embps__aligned(const void *p, size_t bytes) {
  return ((uintptr_t)p & (bytes - 1)) == 0;
}

/* Type and vector-width tags, so that one generic lambda can launch every instantiation. */
template <typename T> struct embps__tag { using type = T; };
template <int V> struct embps__vec { static constexpr int value = V; };

/* Shared launcher of the row kernels over n rows: rejects a bad dtype, enqueues nothing for
 * n == 0 or width == 0, picks the shape, calls launch(embps__tag<T>, embps__vec<V>, shape)
 * for the storage type (float or bf16 bits) and vector width (when `vec`, 4 for f32 and
 * BF16_V for bf16, which the caller's `vec` must then allow; else 1), and checks the launch. */
template <int BF16_V = 4, typename F>
static inline embps_status_t embps__launch_rows(const char *what, embps_dtype_t dtype, size_t n,
                                                size_t width, bool vec, F &&launch) {
  embps_status_t ret = EMBPS_OK;
  embps__row_launch_t L;
  if (embps_dtype_size(dtype) == 0) {
    EMBPS_ERROR("%s: invalid dtype %d", what, (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || width == 0)
    return EMBPS_OK;
  if (!embps__row_launch(n, width, !vec ? 1 : dtype == EMBPS_DTYPE_BF16 ? BF16_V : 4, &L)) {
    EMBPS_ERROR("%s: %zu rows is beyond the grid limit", what, n);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (dtype == EMBPS_DTYPE_BF16) {
    if (vec)
      launch(embps__tag<uint16_t>{}, embps__vec<BF16_V>{}, L);
    else
      launch(embps__tag<uint16_t>{}, embps__vec<1>{}, L);
  } else {
    if (vec)
      launch(embps__tag<float>{}, embps__vec<4>{}, L);
    else
      launch(embps__tag<float>{}, embps__vec<1>{}, L);
  }
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

/* True when a row kernel may use 4-wide accesses: width is a multiple of 4 and the table (of
 * element size es) and every f32 array are 4-element aligned. NULL arrays count as aligned. */
static inline bool embps__vec4_ok(size_t width, const void *table, size_t es, const void *f0,
                                  const void *f1, const void *f2) {
  return width % 4 == 0 && es != 0 && embps__aligned(table, 4 * es) && embps__aligned(f0, 16) &&
         embps__aligned(f1, 16) && embps__aligned(f2, 16);
}

/* Loop over this thread's V-vectors of a row. */
#define EMBPS_FOR_COLUMNS(c, lane, tpr, V, width)                                                  \
  for (size_t c = (size_t)(lane) * (V); c < (width); c += (size_t)(tpr) * (V))

#endif
