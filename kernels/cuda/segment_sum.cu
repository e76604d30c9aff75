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
 * waits for one memory latency per LOADS_PER_STEP rows instead of one per row.
 *
 * That was still one warp with 8 rows in flight per hot segment: on an H200, a 1M-token
 * Zipf(1.05) batch, whose head token holds some 80K rows, took 23.4 ms at width 128 (30 GB/s)
 * and 27.6 ms at 1024 (tests/gpu/check.sh, bench_kernels_gpu), nearly all of it the head's
 * walk. So a segment of HOT_MIN rows or more is left to a second kernel, where a whole block
 * walks one 32-column slice of it: seven warps load a stage of HOT_STAGE rows (448) into
 * shared memory while warp 0 adds the previous stage's rows, in position order, from the other
 * buffer. The additions are the same as above, one lane per column, in the same order; only
 * where the loads wait changes. A slice of 32 columns rather than 32 x 4 puts 4 blocks on a
 * 128-wide head instead of 1: the walk waits on how many rows are in flight, not on their
 * bytes. On the H200 the same batch took 4.7 ms (128) and 8.2 ms (1024) with a block per
 * 128-column slice and 112 rows a stage, and 1.33 ms and 5.13 ms as it is now. */
#include "kernels/cuda/cuda_common.cuh"

#define LOADS_PER_STEP 8

/* A segment this long or longer is walked by a whole block (segment_sum_hot_kernel). */
#define HOT_MIN 128
/* Warps of a hot block that load (all but warp 0, which adds), and the rows each loads per
 * stage; a stage's rows are HOT_STAGE. */
#define HOT_LOADERS (EMBPS_CUDA_BLOCK / 32 - 1)
#define HOT_ROWS_PER_LOADER 64
#define HOT_STAGE (HOT_LOADERS * HOT_ROWS_PER_LOADER)
/* Most blocks of the hot kernel. */
#define HOT_MAX_BLOCKS 1024u

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
  if (end - begin >= HOT_MIN) /* the whole group's segment: segment_sum_hot_kernel's */
    return;

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

/* One hot segment [begin, end) of sorted_positions, columns [chunk * 32, +32), one per lane,
 * by the whole block; stage is the block's 2 x HOT_STAGE x 32 floats. Every thread of the
 * block calls it with the same arguments (its __syncthreads count is the block's). */
template <typename T>
__device__ void hot_walk(const T *__restrict__ grads, size_t width,
                         const uint32_t *__restrict__ sorted_positions, size_t begin, size_t end,
                         size_t chunk, float *__restrict__ out_row, float *stage) {
  unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  size_t c = chunk * 32 + lane;
  bool active = c < width;
  size_t rows = end - begin, stages = (rows + HOT_STAGE - 1) / HOT_STAGE;
  /* A loader's rows within a stage are first .. first + HOT_ROWS_PER_LOADER - 1; lane j holds
   * the positions of its rows j + 32 i of the coming stage, read one stage ahead so that the
   * row loads never wait for them. */
  size_t first = warp == 0 ? 0 : (size_t)(warp - 1) * HOT_ROWS_PER_LOADER;
  uint32_t next_pos[HOT_ROWS_PER_LOADER / 32];
#pragma unroll
  for (unsigned i = 0; i < HOT_ROWS_PER_LOADER / 32; i++) {
    size_t row = first + i * 32 + lane;
    next_pos[i] = warp != 0 && row < rows ? sorted_positions[begin + row] : 0u;
  }
  float acc = 0.0f;
  for (size_t st = 0; st <= stages; st++) { /* st == stages: only the last stage's adds */
    if (warp != 0 && st < stages) {
      uint32_t pos[HOT_ROWS_PER_LOADER / 32];
#pragma unroll
      for (unsigned i = 0; i < HOT_ROWS_PER_LOADER / 32; i++) {
        size_t ahead = (st + 1) * HOT_STAGE + first + i * 32 + lane;
        pos[i] = next_pos[i];
        next_pos[i] = ahead < rows ? sorted_positions[begin + ahead] : 0u;
      }
      size_t row0 = st * HOT_STAGE + first;
      float x[HOT_ROWS_PER_LOADER];
#pragma unroll
      for (unsigned j = 0; j < HOT_ROWS_PER_LOADER; j++) {
        uint32_t p = __shfl_sync(0xffffffffu, pos[j / 32], (int)(j % 32));
        float v[1] = {0.0f};
        if (active && row0 + j < rows)
          embps__load<1>(grads + (size_t)p * width + c, v);
        x[j] = v[0];
      }
      float *buf = stage + (st & 1) * HOT_STAGE * 32;
#pragma unroll
      for (unsigned j = 0; j < HOT_ROWS_PER_LOADER; j++)
        if (active && row0 + j < rows)
          buf[(first + j) * 32 + lane] = x[j];
    }
    if (warp == 0 && st > 0 && active) {
      const float *buf = stage + ((st - 1) & 1) * HOT_STAGE * 32;
      size_t done = (st - 1) * HOT_STAGE;
      unsigned n = rows - done < HOT_STAGE ? (unsigned)(rows - done) : HOT_STAGE;
#pragma unroll 16
      for (unsigned r = 0; r < n; r++)
        acc += buf[r * 32 + lane];
    }
    __syncthreads(); /* stage st is written, stage st - 1 is read: the buffers swap */
  }
  if (warp == 0 && active)
    out_row[c] = acc;
}

/* The segments of HOT_MIN rows or more. Block x owns the segments x, x + gridDim.x, ...
 * (interleaved, so that hot segments next to one another, as a vocabulary numbered by
 * frequency gives, go to different blocks), finds the hot ones EMBPS_CUDA_BLOCK at a time,
 * and walks each one's 32-column slices y, y + gridDim.y, ... */
template <typename T>
__global__ void __launch_bounds__(EMBPS_CUDA_BLOCK)
    segment_sum_hot_kernel(const T *__restrict__ grads, size_t width,
                           const uint32_t *__restrict__ sorted_positions,
                           const uint32_t *__restrict__ segment_offsets, size_t num_unique,
                           size_t chunks, float *__restrict__ out) {
  extern __shared__ float stage[];
  __shared__ uint32_t hot[EMBPS_CUDA_BLOCK];
  __shared__ unsigned num_hot;
  size_t stride = (size_t)gridDim.x * EMBPS_CUDA_BLOCK;
  for (size_t k = blockIdx.x; k < num_unique; k += stride) {
    if (threadIdx.x == 0)
      num_hot = 0;
    __syncthreads();
    size_t s = k + (size_t)threadIdx.x * gridDim.x;
    if (s < num_unique && segment_offsets[s + 1] - segment_offsets[s] >= HOT_MIN)
      hot[atomicAdd(&num_hot, 1u)] = (uint32_t)s;
    __syncthreads();
    unsigned n = num_hot;
    for (unsigned i = 0; i < n; i++) {
      size_t h = hot[i];
      for (size_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y)
        hot_walk<T>(grads, width, sorted_positions, segment_offsets[h], segment_offsets[h + 1],
                    chunk, out + h * width, stage);
    }
    __syncthreads(); /* every thread has read num_hot and hot[] before the next round's */
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
  {
    size_t tiles = (num_unique + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK;
    size_t hot_chunks = (width + 31) / 32;
    dim3 grid(tiles < HOT_MAX_BLOCKS ? (unsigned)tiles : HOT_MAX_BLOCKS,
              hot_chunks < 65535 ? (unsigned)hot_chunks : 65535u, 1);
    size_t smem = 2 * (size_t)HOT_STAGE * 32 * sizeof(float); /* 112 KiB */
    EMBPS_CUDA_CHECK_GOTO(cudaFuncSetAttribute(segment_sum_hot_kernel<T>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem),
                          NULL, fail);
    segment_sum_hot_kernel<T><<<grid, EMBPS_CUDA_BLOCK, smem, stream>>>(
        (const T *)grads, width, sorted_positions, segment_offsets, num_unique, hot_chunks, out);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
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
