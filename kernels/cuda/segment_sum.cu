/* Segment sum on the device: each unique row adds its batch rows in ascending position order.
 *
 * The CPU adds every gradient row into its segment's row in position order, starting from 0;
 * any other order would round differently. Here the grouping from embps_dedup_cuda makes
 * each segment's positions a contiguous, ascending run of sorted_positions, so a group of tpr
 * threads owns one segment and walks that run in order, each thread accumulating V columns in
 * f32 registers: the same additions in the same order as the CPU, hence the same bits, and no
 * atomics. The group loads tpr positions with one coalesced read and passes them around with
 * shuffles. A hot segment (the padding token, a head token of a Zipf batch) is a long serial
 * walk, so the columns are also split across grid.y: each block row handles a slice of
 * tpr * V columns of every segment, which gives a 1024-wide row 8 to 32 independent walkers.
 * The walk itself must stay serial per column (that is the CPU's rounding), but its loads need
 * not: each step takes LOADS_PER_STEP positions from the shuffles, issues all their loads, and
 * only then adds them in order, so a hot segment (a Zipf head token holds some 10% of a batch)
 * waits for one memory latency per LOADS_PER_STEP rows instead of one per row. */
#include "kernels/cuda/cuda_common.cuh"

#define LOADS_PER_STEP 8

template <typename T, int V>
__global__ void segment_sum_kernel(const T *__restrict__ grads, size_t width,
                                   const uint32_t *__restrict__ sorted_positions,
                                   const uint32_t *__restrict__ segment_offsets, size_t num_unique,
                                   unsigned tpr, size_t chunks, float *__restrict__ out) {
  size_t s = embps__row_index(tpr);
  if (s >= num_unique) /* whole groups leave together: the shuffles below use the group mask */
    return;
  unsigned lane = embps__row_lane(tpr);
  unsigned warp_lane = threadIdx.x & 31u;
  unsigned mask = tpr == 32 ? 0xffffffffu : ((1u << tpr) - 1u) << (warp_lane & ~(tpr - 1u));
  size_t begin = segment_offsets[s], end = segment_offsets[s + 1];

  for (size_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    size_t c = (chunk * tpr + lane) * V;
    bool active = c < width;
    float acc[V];
    for (int k = 0; k < V; k++)
      acc[k] = 0.0f;
    for (size_t base = begin; base < end; base += tpr) {
      uint32_t mine = base + lane < end ? sorted_positions[base + lane] : 0u;
      unsigned count = end - base < tpr ? (unsigned)(end - base) : tpr;
      for (unsigned j0 = 0; j0 < count; j0 += LOADS_PER_STEP) {
        /* Every lane of the group takes part in every shuffle (j0 and count are the group's);
         * a source lane past count (or past tpr, which wraps) gives a position never used. */
        float x[LOADS_PER_STEP][V];
#pragma unroll
        for (unsigned u = 0; u < LOADS_PER_STEP; u++) {
          uint32_t p = __shfl_sync(mask, mine, (int)((j0 + u) & (tpr - 1u)), (int)tpr);
          if (active && j0 + u < count)
            embps__load<V>(grads + (size_t)p * width + c, x[u]);
        }
#pragma unroll
        for (unsigned u = 0; u < LOADS_PER_STEP; u++)
          if (active && j0 + u < count)
            for (int k = 0; k < V; k++)
              acc[k] += x[u][k];
      }
    }
    if (active)
      embps__store<V>(out + s * width + c, acc);
  }
}

template <typename T, int V>
static embps_status_t launch(const void *grads, size_t width, const uint32_t *sorted_positions,
                             const uint32_t *segment_offsets, size_t num_unique, float *out,
                             cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  embps__row_launch_t L;
  if (!embps__row_launch(num_unique, width, V, &L)) {
    EMBPS_ERROR("segment sum: %zu segments is beyond the grid limit", num_unique);
    return EMBPS_INVALID_ARGUMENT;
  }
  size_t chunks = (width + (size_t)L.tpr * V - 1) / ((size_t)L.tpr * V);
  L.grid.y = chunks < 65535 ? (unsigned)chunks : 65535u;
  segment_sum_kernel<T, V><<<L.grid, EMBPS_CUDA_BLOCK, 0, stream>>>(
      (const T *)grads, width, sorted_positions, segment_offsets, num_unique, L.tpr, chunks, out);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}

extern "C" embps_status_t embps_segment_sum_cuda(const void *grads, embps_dtype_t dtype,
                                                 size_t width, const uint32_t *sorted_positions,
                                                 const uint32_t *segment_offsets, size_t num_unique,
                                                 float *out, cudaStream_t stream) {
  size_t es = embps_dtype_size(dtype);
  if (es == 0) {
    EMBPS_ERROR("segment sum: invalid dtype %d", (int)dtype);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (num_unique == 0 || width == 0)
    return EMBPS_OK;
  bool vec = width % 4 == 0 && embps__aligned(grads, 4 * es) && embps__aligned(out, 16);
  if (dtype == EMBPS_DTYPE_BF16)
    return vec ? launch<uint16_t, 4>(grads, width, sorted_positions, segment_offsets, num_unique,
                                     out, stream)
               : launch<uint16_t, 1>(grads, width, sorted_positions, segment_offsets, num_unique,
                                     out, stream);
  return vec ? launch<float, 4>(grads, width, sorted_positions, segment_offsets, num_unique, out,
                                stream)
             : launch<float, 1>(grads, width, sorted_positions, segment_offsets, num_unique, out,
                                stream);
}
