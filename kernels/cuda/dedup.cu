/* Token dedup on the device: CUB radix sort of (token, position), then flag + scan.
 *
 * The positions 0..n-1 are sorted by token with cub::DeviceRadixSort::SortPairs. LSD radix
 * sort is stable and the positions start ascending, so the result is the (token, position)
 * order: a pure function of the tokens, the same on every run and every GPU, and within a
 * token the positions come out ascending, which is what segment sum needs to add each
 * segment's rows in the CPU's order. A flag marks each sorted index whose token differs from
 * its predecessor; an in-place inclusive sum of the flags (integers, so exact) turns them into
 * segment numbers + 1. One last pass scatters: segment_ids[position] = segment, and each
 * flagged index writes its token to unique[] and its index to segment_offsets[]. The keys
 * are full 64-bit: narrowing the bit range as the CPU does would need the batch's min and max
 * on the host (a synchronization); an H100-class GPU sorts a 1M-token batch at full width in
 * well under a millisecond.
 *
 * Workspace (one caller-owned block, carved in 256-byte aligned pieces): the sorted tokens
 * (n int64), the positions before sorting, reused for the flags/scan once the sort has
 * consumed them (n uint32), and CUB's scratch (the larger of the sort's and the scan's). */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "kernels/cuda/cuda_common.cuh"

#define ALIGN 256

static size_t align_up(size_t x) { return (x + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* CUB's scratch for n items: the larger of the sort's and the scan's (the two never overlap in
 * time). Returns a CUDA error from the query (it reads the device's properties). */
static cudaError_t cub_bytes(uint32_t n, size_t *bytes) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const int64_t *)nullptr,
                                                  (int64_t *)nullptr, (const uint32_t *)nullptr,
                                                  (uint32_t *)nullptr, n, 0, 64, (cudaStream_t)0);
  if (e != cudaSuccess)
    return e;
  e = cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, (uint32_t *)nullptr, n, (cudaStream_t)0);
  if (e != cudaSuccess)
    return e;
  *bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
  return cudaSuccess;
}

/* Byte offsets of the pieces within the workspace; returns the total. */
typedef struct layout {
  size_t sorted_tokens, positions, cub, total;
} layout_t;

static size_t make_layout(size_t n, size_t cub_scratch, layout_t *l) {
  l->sorted_tokens = 0;
  l->positions = align_up(n * sizeof(int64_t));
  l->cub = l->positions + align_up(n * sizeof(uint32_t));
  l->total = l->cub + align_up(cub_scratch);
  return l->total;
}

extern "C" size_t embps_dedup_cuda_workspace_bytes(size_t n) {
  if (n == 0 || n > UINT32_MAX)
    return 0;
  size_t scratch = 0;
  cudaError_t e = cub_bytes((uint32_t)n, &scratch);
  if (e != cudaSuccess) {
    EMBPS_ERROR("CUB workspace query for %zu tokens: %s (%s)", n, cudaGetErrorName(e),
                cudaGetErrorString(e));
    return 0;
  }
  layout_t l;
  return make_layout(n, scratch, &l);
}

static unsigned blocks_for(size_t n) {
  return (unsigned)((n + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK);
}

__global__ void iota_kernel(uint32_t *pos, uint32_t n) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    pos[i] = i;
}

/* flags[i] = 1 where sorted index i starts a new token. */
__global__ void flag_kernel(const int64_t *sorted, uint32_t n, uint32_t *flags) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    flags[i] = (i == 0 || sorted[i] != sorted[i - 1]) ? 1u : 0u;
}

/* scan[i] = segment of sorted index i, plus one. */
__global__ void scatter_kernel(const int64_t *sorted, const uint32_t *sorted_pos,
                               const uint32_t *scan, uint32_t n, int64_t *unique,
                               uint32_t *segment_ids, uint32_t *segment_offsets,
                               uint32_t *num_unique) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  uint32_t s = scan[i] - 1;
  segment_ids[sorted_pos[i]] = s;
  if (i == 0 || sorted[i] != sorted[i - 1]) {
    unique[s] = sorted[i];
    segment_offsets[s] = i;
  }
  if (i == n - 1) {
    segment_offsets[s + 1] = n;
    *num_unique = s + 1;
  }
}

extern "C" embps_status_t embps_dedup_cuda(const int64_t *tokens, size_t n, int64_t *unique,
                                           uint32_t *segment_ids, uint32_t *sorted_positions,
                                           uint32_t *segment_offsets, uint32_t *num_unique,
                                           void *workspace, size_t workspace_bytes,
                                           cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  size_t scratch = 0, sort_bytes = 0, scan_bytes = 0;
  layout_t l;
  char *ws = (char *)workspace;
  int64_t *sorted;
  uint32_t *positions, nn;

  if (!num_unique || !segment_offsets) {
    EMBPS_ERROR("dedup: num_unique and segment_offsets are required");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (n == 0) {
    EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(num_unique, 0, sizeof(uint32_t), stream), NULL, fail);
    EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(segment_offsets, 0, sizeof(uint32_t), stream), NULL,
                          fail);
    return EMBPS_OK;
  }
  if (n > UINT32_MAX || !tokens || !unique || !segment_ids || !sorted_positions || !workspace ||
      !embps__aligned(workspace, ALIGN)) {
    EMBPS_ERROR("dedup: %zu tokens (at most 2^32 - 1), a NULL array or a workspace not aligned "
                "to %d bytes",
                n, ALIGN);
    return EMBPS_INVALID_ARGUMENT;
  }
  nn = (uint32_t)n;
  EMBPS_CUDA_CHECK_GOTO(cub_bytes(nn, &scratch), NULL, fail);
  if (make_layout(n, scratch, &l) > workspace_bytes) {
    EMBPS_ERROR("dedup: workspace of %zu bytes, %zu needed", workspace_bytes, l.total);
    return EMBPS_INVALID_ARGUMENT;
  }
  sorted = (int64_t *)(ws + l.sorted_tokens);
  positions = (uint32_t *)(ws + l.positions);

  iota_kernel<<<blocks_for(n), EMBPS_CUDA_BLOCK, 0, stream>>>(positions, nn);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  sort_bytes = scratch;
  EMBPS_CUDA_CHECK_GOTO(cub::DeviceRadixSort::SortPairs(ws + l.cub, sort_bytes, tokens, sorted,
                                                        (const uint32_t *)positions,
                                                        sorted_positions, nn, 0, 64, stream),
                        NULL, fail);
  /* positions is free again: it holds the flags, then their inclusive sum. */
  flag_kernel<<<blocks_for(n), EMBPS_CUDA_BLOCK, 0, stream>>>(sorted, nn, positions);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
  scan_bytes = scratch;
  EMBPS_CUDA_CHECK_GOTO(
      cub::DeviceScan::InclusiveSum(ws + l.cub, scan_bytes, positions, nn, stream), NULL, fail);
  scatter_kernel<<<blocks_for(n), EMBPS_CUDA_BLOCK, 0, stream>>>(
      sorted, sorted_positions, positions, nn, unique, segment_ids, segment_offsets, num_unique);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}
