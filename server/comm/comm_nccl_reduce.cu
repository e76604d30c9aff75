/* The reduction of the NCCL backend's all_reduce: size gathered blocks combined in rank order.
 *
 * NCCL's own ncclAllReduce does not promise an order: ring, tree and NVLS algorithms add the
 * ranks' contributions in an order that depends on the algorithm, the channel and the rank,
 * and NCCL picks the algorithm by message size and topology. Floating-point addition is not
 * associative, so ranks could end with results that differ in the last bit, and the TCP
 * backend's results would differ again. The shard group needs every rank to hold bitwise the
 * same value (each rank applies it to its own columns, and a replayed round must reproduce it),
 * so the NCCL backend gathers every rank's buffer and each rank reduces the blocks here, in
 * the TCP backend's order: out = block 0, then out = out (op) block r for r = 1..size-1, f32
 * accumulated in f32 and f64 in f64, max as `b > a ? b : a`. Each thread owns elements and
 * walks the ranks in order, so there are no atomics and no order to lose.
 *
 * Built with -fmad=false like kernels/cuda (only additions here, so nothing could be fused
 * anyway), default IEEE rounding and denormals kept, as on the CPU. */
#include <cuda_runtime.h>

#include "server/comm/comm_nccl_reduce.h"

#define REDUCE_THREADS 256
/* Grid cap: enough blocks to fill any current GPU several times; larger counts grid-stride. */
#define REDUCE_MAX_BLOCKS 4096u

struct sum_op {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct max_op {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

template <typename T, typename Op>
__global__ void reduce_kernel(T *out, const T *blocks, size_t count, uint32_t size) {
  Op op;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += (size_t)gridDim.x * blockDim.x) {
    T acc = blocks[i];
    for (uint32_t r = 1; r < size; r++)
      acc = op(acc, blocks[(size_t)r * count + i]);
    out[i] = acc;
  }
}

template <typename T, typename Op>
static cudaError_t launch(void *out, const void *blocks, size_t count, uint32_t size,
                          cudaStream_t stream) {
  size_t want = (count + REDUCE_THREADS - 1) / REDUCE_THREADS;
  unsigned grid = want < REDUCE_MAX_BLOCKS ? (unsigned)want : REDUCE_MAX_BLOCKS;
  reduce_kernel<T, Op>
      <<<grid, REDUCE_THREADS, 0, stream>>>((T *)out, (const T *)blocks, count, size);
  return cudaGetLastError();
}

extern "C" cudaError_t embps__comm_nccl_reduce(void *out, const void *blocks, size_t count,
                                               uint32_t size, embps_comm_type_t type,
                                               embps_comm_op_t op, cudaStream_t stream) {
  if (size == 0 || (op != EMBPS_COMM_SUM && op != EMBPS_COMM_MAX))
    return cudaErrorInvalidValue;
  if (count == 0)
    return cudaSuccess;
  bool sum = op == EMBPS_COMM_SUM;
  switch (type) {
  case EMBPS_COMM_F32:
    return sum ? launch<float, sum_op>(out, blocks, count, size, stream)
               : launch<float, max_op>(out, blocks, count, size, stream);
  case EMBPS_COMM_F64:
    return sum ? launch<double, sum_op>(out, blocks, count, size, stream)
               : launch<double, max_op>(out, blocks, count, size, stream);
  case EMBPS_COMM_U64:
    return sum ? launch<uint64_t, sum_op>(out, blocks, count, size, stream)
               : launch<uint64_t, max_op>(out, blocks, count, size, stream);
  }
  return cudaErrorInvalidValue;
}
