/* Feature batches' bags on the device: the twins of kernels/pool.c, bit for bit.
 *
 * Pooling: a thread group per bag (cuda_common.cuh's row mapping, one "row" per bag), each
 * thread owning V columns at a time and walking the bag's positions in order, so every output
 * element is the CPU's chain of f32 operations: acc = 0, then acc += x * weight (or acc += x)
 * per nonzero id in position order, each product and sum rounded on its own (-fmad=false: no
 * FMA), then acc / (float)count once for a mean with a nonzero count. A position's row is the
 * table's row rows[p] (bf16 widened with the twin of common/dtype.h's conversion) or, where
 * rows[p] is negative (an absent hash key), the key's initial row from init_hash.cuh, rounded to
 * the table's dtype and widened, as embps_init_key_row_cpu then the CPU's widening give it. The
 * loads of UNROLL positions are issued before their additions (in order), so a thread has
 * several row loads in flight; ids, rows and weights are read by every lane of the group (the
 * same address: one broadcast).
 *
 * Expansion: a thread group per bag as well. A thread counts the bag's nonzero ids itself (for a
 * mean), loads its V columns of the bag's gradient once, and writes them to every position of
 * the bag: 0 for id 0, else g * weight, g / count (mean) or g, rounded once to the dtype with the
 * twin of embps_f32_to_bf16.
 *
 * Both use 4-wide accesses when the width is a multiple of 4 and the table / output and the f32
 * arrays are aligned for them (embps__vec4_ok), else one element at a time. Like every row
 * kernel here, they take the table and the output aligned to their elements (as cudaMalloc and
 * any whole-element offset into it give them); the launchers refuse anything else rather than
 * fault on the device. NaN inputs give the device's NaN bits, as in the other kernels. */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/init_hash.cuh"

#define UNROLL 4

/* Column col of the initial row of a nonzero key whose hash is rh, in the storage type T,
 * widened to f32. */
template <typename T>
__device__ __forceinline__ float initial_value(uint64_t rh, uint64_t col, float scale) {
  const float v = embps__init_value(rh, col, scale);
  if constexpr (sizeof(T) == 2)
    return embps__bf16_to_f32(embps__f32_to_bf16(v));
  else
    return v;
}

template <typename T, int V>
__global__ void pool_bags_kernel(const T *__restrict__ table, size_t width,
                                 const int64_t *__restrict__ ids, const int64_t *__restrict__ rows,
                                 const float *__restrict__ weights,
                                 const int64_t *__restrict__ offsets, size_t num_bags, int mean,
                                 float *__restrict__ out, uint64_t col_begin, uint64_t seed,
                                 float scale, unsigned tpr) {
  const size_t k = embps__row_index(tpr);
  if (k >= num_bags)
    return;
  const size_t a = (size_t)offsets[k], b = (size_t)offsets[k + 1];
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float acc[V];
    uint32_t count = 0;
#pragma unroll
    for (int j = 0; j < V; j++)
      acc[j] = 0.0f;
    for (size_t p0 = a; p0 < b; p0 += UNROLL) {
      float x[UNROLL][V] = {}, wgt[UNROLL] = {};
      bool live[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const size_t p = p0 + u;
        const int64_t id = p < b ? ids[p] : 0;
        live[u] = id != 0;
        if (!live[u])
          continue;
        wgt[u] = weights ? weights[p] : 1.0f;
        const int64_t r = rows[p];
        if (r >= 0) {
          embps__load<V>(table + (size_t)r * width + c, x[u]);
        } else { /* an absent key (id != 0 here) */
          const uint64_t rh = embps__init_row_hash(seed, (uint64_t)id);
#pragma unroll
          for (int j = 0; j < V; j++)
            x[u][j] = initial_value<T>(rh, col_begin + c + j, scale);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        if (!live[u])
          continue;
        count++;
        if (weights) {
#pragma unroll
          for (int j = 0; j < V; j++)
            acc[j] = acc[j] + x[u][j] * wgt[u];
        } else {
#pragma unroll
          for (int j = 0; j < V; j++)
            acc[j] = acc[j] + x[u][j];
        }
      }
    }
    if (mean && count > 0) {
      const float n = (float)count;
#pragma unroll
      for (int j = 0; j < V; j++)
        acc[j] = acc[j] / n;
    }
    embps__store<V>(out + k * width + c, acc);
  }
}

template <typename T, int V>
__global__ void
expand_bags_kernel(const float *__restrict__ g, size_t width, const int64_t *__restrict__ ids,
                   const float *__restrict__ weights, const int64_t *__restrict__ offsets,
                   size_t num_bags, int mean, T *__restrict__ out, unsigned tpr) {
  const size_t k = embps__row_index(tpr);
  if (k >= num_bags)
    return;
  const size_t a = (size_t)offsets[k], b = (size_t)offsets[k + 1];
  uint32_t nonzero = 0;
  if (mean && !weights)
    for (size_t p = a; p < b; p++)
      nonzero += ids[p] != 0;
  const float n = (float)nonzero;
  EMBPS_FOR_COLUMNS(c, embps__row_lane(tpr), tpr, V, width) {
    float gk[V];
    embps__load<V>(g + k * width + c, gk);
    for (size_t p = a; p < b; p++) {
      const bool pad = ids[p] == 0;
      const float wgt = weights ? weights[p] : 1.0f;
      float v[V];
#pragma unroll
      for (int j = 0; j < V; j++)
        v[j] = pad ? 0.0f : weights ? gk[j] * wgt : mean ? gk[j] / n : gk[j];
      embps__store<V>(out + p * width + c, v);
    }
  }
}

extern "C" embps_status_t embps_pool_bags_cuda(const void *table, embps_dtype_t dtype, size_t width,
                                               const int64_t *ids, const int64_t *rows,
                                               const float *weights, const int64_t *offsets,
                                               size_t num_bags, int mean, float *out,
                                               uint64_t col_begin, uint64_t seed, float scale,
                                               cudaStream_t stream) {
  const size_t es = embps_dtype_size(dtype);
  if (es == 0) {
    EMBPS_ERROR("pool bags: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (num_bags == 0 || width == 0)
    return EMBPS_OK;
  if (!table || !ids || !rows || !offsets || !out) {
    EMBPS_ERROR("pool bags: NULL %s", !table     ? "table"
                                      : !ids     ? "ids"
                                      : !rows    ? "rows"
                                      : !offsets ? "offsets"
                                                 : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (!embps__aligned(table, es)) {
    EMBPS_ERROR("pool bags: the table is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  const bool vec = embps__vec4_ok(width, table, es, out, NULL, NULL);
  return embps__launch_rows("pool bags", dtype, num_bags, width, vec,
                            [&](auto t, auto v, const embps__row_launch_t &L) {
                              using T = typename decltype(t)::type;
                              constexpr int V = decltype(v)::value;
                              pool_bags_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  (const T *)table, width, ids, rows, weights, offsets, num_bags,
                                  mean, out, col_begin, seed, scale, L.tpr);
                            });
}

extern "C" embps_status_t embps_expand_bags_cuda(const float *g, size_t width, const int64_t *ids,
                                                 const float *weights, const int64_t *offsets,
                                                 size_t num_bags, int mean, embps_dtype_t dtype,
                                                 void *out, cudaStream_t stream) {
  const size_t es = embps_dtype_size(dtype);
  if (es == 0) {
    EMBPS_ERROR("expand bags: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (num_bags == 0 || width == 0)
    return EMBPS_OK;
  if (!g || !ids || !offsets || !out) {
    EMBPS_ERROR("expand bags: NULL %s", !g ? "g" : !ids ? "ids" : !offsets ? "offsets" : "out");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (!embps__aligned(out, es)) {
    EMBPS_ERROR("expand bags: out is not aligned to its %zu-byte elements", es);
    return EMBPS_INVALID_ARGUMENT;
  }
  const bool vec = embps__vec4_ok(width, out, es, g, NULL, NULL);
  return embps__launch_rows("expand bags", dtype, num_bags, width, vec,
                            [&](auto t, auto v, const embps__row_launch_t &L) {
                              using T = typename decltype(t)::type;
                              constexpr int V = decltype(v)::value;
                              expand_bags_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
                                  g, width, ids, weights, offsets, num_bags, mean, (T *)out, L.tpr);
                            });
}
