/* Row statistics on the device: per-row sums of squares, their total, the non-finite count.
 *
 * Each row's sum reproduces the CPU's exactly: the CPU squares in double into 8 interleaved
 * lanes (lane l takes the elements j = l mod 8, in ascending j) and then adds lane 0..7 in
 * order to 0.0. Here 8 threads own a row, thread l being lane l, and lane 0 adds the 8 lane
 * sums in the same order, so row_sumsq is the CPU's bit for bit. Each thread also counts its
 * non-finite elements (the CPU counts the same elements, only in rows whose sum is not
 * finite, which are exactly the rows holding one).
 *
 * The total cannot follow the CPU's order (a serial sum over rows) without serializing the
 * GPU, so it is a two-pass reduction with a fixed shape: pass 1 reduces each block's 32 row
 * sums by a fixed tree into one partial per block; pass 2, one block, sums the partials in a
 * fixed strided order and a fixed tree. The shape depends on n alone (32 rows per block, 256
 * threads), not on the device, so the total is identical run after run and on every GPU; it
 * differs from the CPU's only in rounding (the sums are in double). No atomics anywhere. */
#include "kernels/cuda/cuda_common.cuh"

#define LANES 8 /* the CPU's EMBPS_LANES */
#define ROWS_PER_BLOCK (EMBPS_CUDA_BLOCK / LANES)

static size_t num_blocks(size_t n) { return (n + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK; }

extern "C" size_t embps_row_stats_cuda_workspace_bytes(size_t n) {
  return num_blocks(n) * (sizeof(double) + sizeof(unsigned long long));
}

__device__ __forceinline__ unsigned nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

__global__ void row_pass_kernel(const float *__restrict__ g, size_t n, size_t width,
                                float *__restrict__ row_sumsq, double *__restrict__ part_sum,
                                unsigned long long *__restrict__ part_bad) {
  __shared__ double sums[ROWS_PER_BLOCK];
  __shared__ unsigned long long bads[ROWS_PER_BLOCK];
  unsigned l = threadIdx.x % LANES, local = threadIdx.x / LANES;
  size_t r = (size_t)blockIdx.x * ROWS_PER_BLOCK + local;
  double lane = 0.0;
  unsigned long long bad = 0;
  if (r < n) {
    const float *row = g + r * width;
    for (size_t j = l; j < width; j += LANES) {
      float x = row[j];
      lane += (double)x * (double)x;
      bad += nonfinite(x);
    }
  }
  /* The 8 lanes of a row are 8 consecutive threads of one warp; every thread takes part. */
  double s = 0.0;
  for (int k = 0; k < LANES; k++)
    s += __shfl_sync(0xffffffffu, lane, k, LANES);
  for (int off = LANES / 2; off > 0; off /= 2)
    bad += __shfl_down_sync(0xffffffffu, bad, off, LANES);
  if (l == 0) {
    if (r < n && row_sumsq)
      row_sumsq[r] = (float)s;
    sums[local] = r < n ? s : 0.0;
    bads[local] = bad;
  }
  if (!part_sum)
    return; /* uniform over the grid: no __syncthreads skipped by part of a block */
  __syncthreads();
  for (unsigned stride = ROWS_PER_BLOCK / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] += sums[threadIdx.x + stride];
      bads[threadIdx.x] += bads[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    part_sum[blockIdx.x] = sums[0];
    part_bad[blockIdx.x] = bads[0];
  }
}

__global__ void total_pass_kernel(const double *__restrict__ part_sum,
                                  const unsigned long long *__restrict__ part_bad, size_t parts,
                                  double *total_sumsq, uint64_t *num_nonfinite) {
  __shared__ double sums[EMBPS_CUDA_BLOCK];
  __shared__ unsigned long long bads[EMBPS_CUDA_BLOCK];
  double s = 0.0;
  unsigned long long bad = 0;
  for (size_t i = threadIdx.x; i < parts; i += EMBPS_CUDA_BLOCK) {
    s += part_sum[i];
    bad += part_bad[i];
  }
  sums[threadIdx.x] = s;
  bads[threadIdx.x] = bad;
  __syncthreads();
  for (unsigned stride = EMBPS_CUDA_BLOCK / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] += sums[threadIdx.x + stride];
      bads[threadIdx.x] += bads[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (total_sumsq)
      *total_sumsq += sums[0];
    if (num_nonfinite)
      *num_nonfinite = (uint64_t)bads[0];
  }
}

extern "C" embps_status_t embps_row_stats_cuda(const float *g, size_t n, size_t width,
                                               float *row_sumsq, double *total_sumsq,
                                               uint64_t *num_nonfinite, void *workspace,
                                               cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  bool reduce = total_sumsq || num_nonfinite;
  size_t blocks = num_blocks(n);
  double *part_sum = NULL;
  unsigned long long *part_bad = NULL;

  if (reduce && n > 0 && (!workspace || !embps__aligned(workspace, sizeof(double)))) {
    EMBPS_ERROR("row stats: the total or the count needs an 8-byte aligned workspace");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (blocks > 0x7fffffffu) {
    EMBPS_ERROR("row stats: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (reduce) {
    part_sum = (double *)workspace;
    part_bad = (unsigned long long *)(part_sum + blocks);
  }
  if (n > 0 && (row_sumsq || reduce)) {
    row_pass_kernel<<<(unsigned)blocks, EMBPS_CUDA_BLOCK, 0, stream>>>(g, n, width, row_sumsq,
                                                                       part_sum, part_bad);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
  if (reduce) {
    /* n == 0 still adds 0.0 to the total and writes a count of 0, as the CPU does. */
    total_pass_kernel<<<1, EMBPS_CUDA_BLOCK, 0, stream>>>(part_sum, part_bad, n ? blocks : 0,
                                                          total_sumsq, num_nonfinite);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
exit:
  return ret;
fail:
  goto exit;
}
