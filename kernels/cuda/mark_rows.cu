/* Row marks on the device: bit (r % 64) of bits[r / 64] for every row r of a batch, the CUDA
 * twin of kernels/mark_rows.c.
 *
 * One thread per row, each setting its bit with a 64-bit atomicOr: rows of one word are set by
 * different threads, and a repeated row sets its bit twice. OR is commutative and idempotent,
 * so the bitmap is the CPU's bit for bit whatever order the threads run in (the atomics here
 * are on integers: cuda_common.cuh's "no atomics" is about floating-point sums). The engine
 * launches it after each applied push on its stream, so a push's marks cost one small launch
 * and no copy to the host; a checkpoint copies the whole bitmap once. */
#include "kernels/cuda/cuda_common.cuh"

__global__ void mark_rows_kernel(unsigned long long *__restrict__ bits,
                                 const int64_t *__restrict__ rows, size_t n) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n)
    return;
  const unsigned long long r = (unsigned long long)rows[i];
  atomicOr(&bits[r >> 6], 1ull << (r & 63));
}

extern "C" embps_status_t embps_mark_rows_cuda(uint64_t *bits, const int64_t *rows, size_t n,
                                               cudaStream_t stream) {
  embps_status_t ret = EMBPS_OK;
  size_t blocks = (n + EMBPS_CUDA_BLOCK - 1) / EMBPS_CUDA_BLOCK;
  if (n == 0)
    return EMBPS_OK;
  if (!bits || !rows) {
    EMBPS_ERROR("mark rows: NULL %s", !bits ? "bitmap" : "rows");
    return EMBPS_INVALID_ARGUMENT;
  }
  if (blocks > 0x7fffffffu) {
    EMBPS_ERROR("mark rows: %zu rows is beyond the grid limit", n);
    return EMBPS_INVALID_ARGUMENT;
  }
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "atomicOr on 64-bit words");
  mark_rows_kernel<<<(unsigned)blocks, EMBPS_CUDA_BLOCK, 0, stream>>>(
      reinterpret_cast<unsigned long long *>(bits), rows, n);
  EMBPS_CUDA_CHECK_LAUNCH_GOTO(fail);
exit:
  return ret;
fail:
  goto exit;
}
