/* Rows of hash-keyed tables on the device: the twins of kernels/hash.c, and the key order of a
 * hash-keyed push.
 *
 * Gather by slot: a group of threads per ROWS_PER_GROUP output rows, as gather.cu. A row whose
 * slot is >= 0 is copied as raw bytes in the widest unit (16, 8, 4 or 2 bytes) that divides the
 * row length and both base pointers' alignment, no element converted, so the bits are the
 * table's (a bf16 NaN's payload included); the group first issues the loads of all its stored
 * rows, then the stores, for several loads in flight per thread. A row without a slot gets its
 * key's initial row from init_hash.cuh, the hash that init.cu uses for dense rows: a key's
 * initial row is the dense row numbered by the key bit for bit, 0 for the padding key 0.
 *
 * Reset of fresh slots: a thread group per slot writes the key's initial row, the slot's
 * state0 (1 float per row, or width) and its state1 (width floats, zeroed). Slots are distinct,
 * so every element has one writer. Resets happen only for keys admitted this round, a small
 * part of a batch, so the kernel is not vectorized.
 *
 * Key order: a hash-keyed push sorts its keys as unsigned 64-bit numbers (so that the padding
 * key 0 comes first) with dedup's signed sort, by flipping the top bit before the sort and
 * again after it; one thread per key. */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/init_hash.cuh"

#define ROWS_PER_GROUP 4

/* T: the storage type (float or bf16 bits), for initial rows; U: the copy unit of stored rows.
 * out and table are raw bytes: a row is written either as units or as elements, never both. */
template <typename T, typename U>
__global__ void hash_gather_kernel(const unsigned char *__restrict__ table,
                                   const int64_t *__restrict__ keys,
                                   const int64_t *__restrict__ slots, size_t n, size_t width,
                                   size_t row_bytes, unsigned tpr, uint64_t col_begin,
                                   uint64_t seed, float scale, unsigned char *__restrict__ out) {
  const size_t r0 = embps__row_index(tpr) * ROWS_PER_GROUP;
  if (r0 >= n)
    return;
  const unsigned rows = n - r0 < ROWS_PER_GROUP ? (unsigned)(n - r0) : ROWS_PER_GROUP;
  const unsigned lane = embps__row_lane(tpr);
  const size_t units = row_bytes / sizeof(U);
  int64_t slot[ROWS_PER_GROUP];
  const U *s[ROWS_PER_GROUP];
  U *d[ROWS_PER_GROUP];
#pragma unroll
  for (unsigned k = 0; k < ROWS_PER_GROUP; k++) {
    slot[k] = k < rows ? slots[r0 + k] : -1;
    s[k] = reinterpret_cast<const U *>(table + (slot[k] >= 0 ? (size_t)slot[k] : 0) * row_bytes);
    d[k] = reinterpret_cast<U *>(out + (r0 + k) * row_bytes); /* past n: never accessed */
  }
  for (size_t c = lane; c < units; c += tpr) {
    U v[ROWS_PER_GROUP];
#pragma unroll
    for (unsigned k = 0; k < ROWS_PER_GROUP; k++)
      if (slot[k] >= 0)
        v[k] = s[k][c];
#pragma unroll
    for (unsigned k = 0; k < ROWS_PER_GROUP; k++)
      if (slot[k] >= 0)
        d[k][c] = v[k];
  }
  for (unsigned k = 0; k < rows; k++) {
    if (slot[k] >= 0)
      continue;
    const uint64_t key = (uint64_t)keys[r0 + k];
    const uint64_t rh = embps__init_row_hash(seed, key);
    T *w = reinterpret_cast<T *>(out + (r0 + k) * row_bytes);
    EMBPS_FOR_COLUMNS(c, lane, tpr, 1, width) {
      float x[1] = {key == 0 ? 0.0f : embps__init_value(rh, col_begin + c, scale)};
      embps__store<1>(w + c, x);
    }
  }
}

template <typename T, typename U>
static embps_status_t launch_gather(const void *table, size_t width, const int64_t *keys,
                                    const int64_t *slots, size_t n, void *out, uint64_t col_begin,
                                    uint64_t seed, float scale, cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  const size_t row_bytes = width * sizeof(T);
  embps__row_launch_t L;
  if (!embps__row_launch((n + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP, row_bytes / sizeof(U), 1, &L)) {
    EMBPS_ERROR("hash gather: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  hash_gather_kernel<T, U><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
      (const unsigned char *)table, keys, slots, n, width, row_bytes, L.tpr, col_begin, seed, scale,
      (unsigned char *)out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

template <typename T>
static embps_status_t hash_gather(const void *table, size_t width, const int64_t *keys,
                                  const int64_t *slots, size_t n, void *out, uint64_t col_begin,
                                  uint64_t seed, float scale, cudaStream_t stream) {
  const uintptr_t a = (uintptr_t)table | (uintptr_t)out | (uintptr_t)(width * sizeof(T));
  if ((a & 15) == 0)
    return launch_gather<T, uint4>(table, width, keys, slots, n, out, col_begin, seed, scale,
                                   stream);
  if ((a & 7) == 0)
    return launch_gather<T, uint2>(table, width, keys, slots, n, out, col_begin, seed, scale,
                                   stream);
  if ((a & 3) == 0)
    return launch_gather<T, uint32_t>(table, width, keys, slots, n, out, col_begin, seed, scale,
                                      stream);
  return launch_gather<T, uint16_t>(table, width, keys, slots, n, out, col_begin, seed, scale,
                                    stream);
}

extern "C" embps_status_t embps_hash_gather_cuda(const void *table, embps_dtype_t dtype,
                                                 size_t width, const int64_t *keys,
                                                 const int64_t *slots, size_t n, void *out,
                                                 uint64_t col_begin, uint64_t seed, float scale,
                                                 cudaStream_t stream) {
  const size_t es = embps_dtype_size(dtype);
  if (es == 0) {
    EMBPS_ERROR("hash gather: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0 || width == 0)
    return EMBPS_OK;
  if (!table || !keys || !slots || !out) {
    EMBPS_ERROR("hash gather: NULL %s", !table   ? "table"
                                        : !keys  ? "keys"
                                        : !slots ? "slots"
                                                 : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (!embps__aligned(out, es)) {
    EMBPS_ERROR("hash gather: out is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (dtype == EMBPS_DTYPE_BF16)
    return hash_gather<uint16_t>(table, width, keys, slots, n, out, col_begin, seed, scale, stream);
  return hash_gather<float>(table, width, keys, slots, n, out, col_begin, seed, scale, stream);
}

template <typename T>
__global__ void hash_reset_kernel(T *__restrict__ table, size_t width, float *__restrict__ state0,
                                  size_t state0_width, float *__restrict__ state1,
                                  float state0_value, const int64_t *__restrict__ slots,
                                  const int64_t *__restrict__ keys, size_t n, uint64_t col_begin,
                                  uint64_t seed, float scale, unsigned tpr) {
  const size_t i = embps__row_index(tpr);
  if (i >= n)
    return;
  const unsigned lane = embps__row_lane(tpr);
  const size_t s = (size_t)slots[i];
  const uint64_t key = (uint64_t)keys[i];
  const uint64_t rh = embps__init_row_hash(seed, key);
  T *w = table + s * width;
  float *s1 = state1 ? state1 + s * width : NULL;
  EMBPS_FOR_COLUMNS(c, lane, tpr, 1, width) {
    float x[1] = {key == 0 ? 0.0f : embps__init_value(rh, col_begin + c, scale)};
    embps__store<1>(w + c, x);
    if (s1)
      s1[c] = 0.0f;
  }
  for (size_t j = lane; j < state0_width; j += tpr)
    state0[s * state0_width + j] = state0_value;
}

extern "C" embps_status_t embps_hash_reset_cuda(void *table, embps_dtype_t dtype, size_t width,
                                                float *state0, size_t state0_width, float *state1,
                                                float state0_value, const int64_t *slots,
                                                const int64_t *keys, size_t n, uint64_t col_begin,
                                                uint64_t seed, float scale, cudaStream_t stream) {
  if (embps_dtype_size(dtype) == 0) {
    EMBPS_ERROR("hash reset: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (state0_width != 0 && state0_width != 1 && state0_width != width) {
    EMBPS_ERROR("hash reset: state0 of %zu floats per row (0, 1 or the width %zu)", state0_width,
                width);
    return EMBPS_INVALID_ARGUMENT;
  }
  /* A slice of width 0 still resets a per-row state0, as the CPU does (a width of 1 with no
   * columns to write, as rowwise Adagrad's update). */
  if (n == 0 || (width == 0 && state0_width == 0))
    return EMBPS_OK;
  if ((width && !table) || !slots || !keys || (state0_width && !state0)) {
    EMBPS_ERROR("hash reset: NULL %s", !slots    ? "slots"
                                       : !keys   ? "keys"
                                       : !state0 ? "state0"
                                                 : "table");
    return EMBPS_INVALID_ARGUMENT;
  }
  return embps__launch_rows("hash reset", dtype, n, width ? width : 1, false,
                            [&](auto t, auto v, const embps__row_launch_t &L) {
                              using T = typename decltype(t)::type;
                              (void)v;
                              hash_reset_kernel<T><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  (T *)table, width, state0, state0_width, state1, state0_value,
                                  slots, keys, n, col_begin, seed, scale, L.tpr);
                            });
}

__global__ void hash_order_kernel(const int64_t *in, size_t n, int64_t *out) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    out[i] = (int64_t)((uint64_t)in[i] ^ (UINT64_C(1) << 63));
}

extern "C" embps_status_t embps_hash_order_cuda(const int64_t *in, size_t n, int64_t *out,
                                                cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  const size_t blocks = (n + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK;
  if (n == 0)
    return EMBPS_OK;
  if (!in || !out) {
    EMBPS_ERROR("hash order: NULL %s", !in ? "in" : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (blocks > 0x7fffffffu) {
    EMBPS_ERROR("hash order: %zu keys is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  hash_order_kernel<<<(unsigned)blocks, EMBPS_CUDA_BLOCK, 0, stream>>>(in, n, out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}
