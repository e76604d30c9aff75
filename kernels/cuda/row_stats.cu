/* Row statistics on the device: the column-block partials and their combine (row_stats.c says
 * why the sums are taken in blocks).
 *
 * Partials: 8 consecutive threads of a warp own one (row, block) pair, thread l being the
 * CPU's lane l (the elements j = l mod 8 of the block, ascending), and every thread adds the 8
 * lane sums in lane order to 0.0 by shuffles, so each partial is the CPU's bit for bit. A
 * block narrower than 8 columns leaves some lanes at 0.0, as on the CPU.
 *
 * Combine: one thread per row adds the row's partials in column order in double, exactly the
 * CPU's loop, so row_sumsq is the CPU's bit for bit. Split by owner, sums_kernel is that
 * thread's loop over the owner's rows and the finish is the combine reading those sums instead
 * (one kernel, templated over where a row's sum comes from), so both give the same bits. The total
 * and the count of rows that are not finite cannot follow the CPU's serial order over rows without
 * serializing the GPU, so they are a two-pass reduction of fixed shape: pass 1 reduces each thread
 * block's row sums by a fixed tree into one partial per block; pass 2, one block, sums those in a
 * fixed strided order and a fixed tree. The shape depends on n alone, not on the device, so the
 * total is the same run after run and on every GPU; it differs from the CPU's only in rounding (in
 * double). The count is exact. No atomics anywhere. */
#include <float.h>

#include "kernels/cuda/cuda_common.cuh"

#define LANES 8 /* the CPU's EMBPS_LANES */
#define PAIRS_PER_BLOCK (EMBPS_CUDA_BLOCK / LANES)

static size_t combine_blocks(size_t n) { return (n + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK; }

extern "C" size_t embps_row_combine_cuda_workspace_bytes(size_t n) {
  return combine_blocks(n) * (sizeof(double) + sizeof(unsigned long long));
}

__global__ void partials_kernel(const float *__restrict__ g, size_t n, size_t width, size_t block,
                                size_t nb, float *__restrict__ partials) {
  unsigned l = threadIdx.x % LANES;
  size_t pair = (size_t)blockIdx.x * PAIRS_PER_BLOCK + threadIdx.x / LANES;
  double lane = 0.0;
  if (pair < n * nb) {
    size_t i = pair / nb, b = pair % nb;
    const float *p = g + i * width + b * block;
    for (size_t j = l; j < block; j += LANES) {
      double x = (double)p[j];
      lane += x * x;
    }
  }
  /* The 8 lanes of a pair are 8 consecutive threads of one warp; every thread takes part. */
  double s = 0.0;
  for (int k = 0; k < LANES; k++)
    s += __shfl_sync(0xffffffffu, lane, k, LANES);
  if (l == 0 && pair < n * nb) {
    float f = __double2float_rn(s);
    partials[pair] = isinf(f) && isfinite(s) ? FLT_MAX : f;
  }
}

/* Sums the block's EMBPS_CUDA_BLOCK entries of sums and bads into entry 0 by a fixed tree.
 * Every thread of the block calls it, after writing its own entries. */
static __device__ void block_tree(double *sums, unsigned long long *bads) {
  __syncthreads();
  for (unsigned stride = EMBPS_CUDA_BLOCK / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] += sums[threadIdx.x + stride];
      bads[threadIdx.x] += bads[threadIdx.x + stride];
    }
    __syncthreads();
  }
}

/* Row i's sum, as the CPU's row_sum: slice r's row i at (r * stride + i) * nb, slice by slice and
 * block by block, in double. */
static __device__ double row_sum(const float *__restrict__ partials, size_t slices, size_t stride,
                                 size_t i, size_t nb) {
  double s = 0.0;
  for (size_t r = 0; r < slices; r++) {
    const float *p = partials + (r * stride + i) * nb;
    for (size_t b = 0; b < nb; b++)
      s += (double)p[b];
  }
  return s;
}

/* Where a row's double sum comes from: the whole combine adds the row's partials of every
 * slice; the finish of a combine by owner reads the sum its owner took. Either way the same
 * double, so the rows, the count and the fixed-shape total below are the same bits. */
struct from_partials {
  const float *partials;
  size_t slices, n, nb;
  __device__ double operator()(size_t i) const { return row_sum(partials, slices, n, i, nb); }
};

struct from_sums {
  const double *sums;
  __device__ double operator()(size_t i) const { return sums[i]; }
};

template <typename Sum>
__global__ void combine_kernel(Sum sum, size_t n, float *__restrict__ row_sumsq,
                               double *__restrict__ part_sum,
                               unsigned long long *__restrict__ part_bad) {
  __shared__ double sums[EMBPS_CUDA_BLOCK];
  __shared__ unsigned long long bads[EMBPS_CUDA_BLOCK];
  size_t i = (size_t)blockIdx.x * EMBPS_CUDA_BLOCK + threadIdx.x;
  double s = 0.0;
  if (i < n) {
    s = sum(i);
    if (row_sumsq)
      row_sumsq[i] = __double2float_rn(s);
  }
  if (!part_sum)
    return; /* uniform over the grid: no __syncthreads skipped by part of a block */
  sums[threadIdx.x] = i < n ? s : 0.0;
  bads[threadIdx.x] = i < n && !isfinite(s);
  block_tree(sums, bads);
  if (threadIdx.x == 0) {
    part_sum[blockIdx.x] = sums[0];
    part_bad[blockIdx.x] = bads[0];
  }
}

__global__ void sums_kernel(const float *__restrict__ partials, size_t slices, size_t stride,
                            size_t n, size_t nb, double *__restrict__ sums) {
  size_t i = (size_t)blockIdx.x * EMBPS_CUDA_BLOCK + threadIdx.x;
  if (i < n)
    sums[i] = row_sum(partials, slices, stride, i, nb);
}

__global__ void total_kernel(const double *__restrict__ part_sum,
                             const unsigned long long *__restrict__ part_bad, size_t parts,
                             double *total_sumsq, uint64_t *num_bad) {
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
  block_tree(sums, bads);
  if (threadIdx.x == 0) {
    if (total_sumsq)
      *total_sumsq += sums[0];
    if (num_bad)
      *num_bad = (uint64_t)bads[0];
  }
}

extern "C" embps_status_t embps_row_partials_cuda(const float *g, size_t n, size_t width,
                                                  size_t block, float *partials,
                                                  cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  size_t nb = block ? width / block : 0, grid = (n * nb + PAIRS_PER_BLOCK - 1) / PAIRS_PER_BLOCK;

  if (block == 0 || width % block != 0) {
    EMBPS_ERROR("row partials: block %zu does not divide width %zu", block, width);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (grid > 0x7fffffffu) {
    EMBPS_ERROR("row partials: %zu rows of %zu blocks is beyond the grid limit", n, nb);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (grid > 0) {
    partials_kernel<<<(unsigned)grid, EMBPS_CUDA_BLOCK, 0, stream>>>(g, n, width, block, nb,
                                                                     partials);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
exit:
  return ret;
fail:
  goto exit;
}

/* The combine's rows, count and total for n rows whose sums come from `sum`. */
template <typename Sum>
static embps_status_t combine(const char *what, Sum sum, size_t n, float *row_sumsq,
                              double *total_sumsq, uint64_t *num_bad, void *workspace,
                              cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  bool reduce = total_sumsq || num_bad;
  size_t blocks = combine_blocks(n);
  double *part_sum = NULL;
  unsigned long long *part_bad = NULL;

  if (reduce && n > 0 && (!workspace || !embps__aligned(workspace, sizeof(double)))) {
    EMBPS_ERROR("%s: the total or the count needs an 8-byte aligned workspace", what);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (blocks > 0x7fffffffu) {
    EMBPS_ERROR("%s: %zu rows is beyond the grid limit", what, n);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (reduce) {
    part_sum = (double *)workspace;
    part_bad = (unsigned long long *)(part_sum + blocks);
  }
  if (n > 0 && (row_sumsq || reduce)) {
    combine_kernel<<<(unsigned)blocks, EMBPS_CUDA_BLOCK, 0, stream>>>(sum, n, row_sumsq, part_sum,
                                                                      part_bad);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
  if (reduce) {
    /* n == 0 still adds 0.0 to the total and writes a count of 0, as the CPU does. */
    total_kernel<<<1, EMBPS_CUDA_BLOCK, 0, stream>>>(part_sum, part_bad, n ? blocks : 0,
                                                     total_sumsq, num_bad);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
exit:
  return ret;
fail:
  goto exit;
}

extern "C" embps_status_t embps_row_combine_cuda(const float *partials, size_t slices, size_t n,
                                                 size_t nb, float *row_sumsq, double *total_sumsq,
                                                 uint64_t *num_bad, void *workspace,
                                                 cudaStream_t stream) {
  from_partials sum = {partials, slices, n, nb};
  return combine("row combine", sum, n, row_sumsq, total_sumsq, num_bad, workspace, stream);
}

extern "C" embps_status_t embps_row_sums_cuda(const float *partials, size_t slices, size_t stride,
                                              size_t n, size_t nb, double *sums,
                                              cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  size_t blocks = combine_blocks(n);

  if (n > stride) {
    EMBPS_ERROR("row sums: %zu rows do not fit a stride of %zu", n, stride);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (blocks > 0x7fffffffu) {
    EMBPS_ERROR("row sums: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n > 0) {
    sums_kernel<<<(unsigned)blocks, EMBPS_CUDA_BLOCK, 0, stream>>>(partials, slices, stride, n, nb,
                                                                   sums);
    EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  }
exit:
  return ret;
fail:
  goto exit;
}

extern "C" embps_status_t embps_row_finish_cuda(const double *sums, size_t n, float *row_sumsq,
                                                double *total_sumsq, uint64_t *num_bad,
                                                void *workspace, cudaStream_t stream) {
  from_sums sum = {sums};
  return combine("row finish", sum, n, row_sumsq, total_sumsq, num_bad, workspace, stream);
}
