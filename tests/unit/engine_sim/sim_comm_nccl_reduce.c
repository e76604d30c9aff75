/* The NCCL backend's rank-order reduction (server/comm/comm_nccl_reduce.cu) on the CUDA
 * simulator: the same contract (comm_nccl_reduce.h), enqueued on the stream as a CPU closure.
 * out = block 0, then out = out (op) block r for r = 1..size-1, f32 accumulated in f32 and f64 in
 * f64, max as `b > a ? b : a`, element by element, so `out` may be any of the blocks. The launch
 * checks what a GPU would fault on or the .cu would refuse: both ranges in live device memory
 * of the stream's device, element alignment, a known type and op. It also refuses a launch on a
 * stream that a simulated NCCL operation still holds (ncclInProgress): comm_nccl.c must wait
 * for the all-gather to be taken before it enqueues the reduction behind it. */
#include <stdint.h>
#include <string.h>

#include "server/comm/comm_nccl_reduce.h"
#include "sim_cuda.h"
#include "sim_nccl_lib.h"

typedef struct reduce_args {
  void *out;
  const void *blocks;
  size_t count;
  uint32_t size;
  embps_comm_type_t type;
  embps_comm_op_t op;
} reduce_args_t;

#define DEFINE_REDUCE(name, T)                                                                     \
  static void name(T *out, const T *blocks, size_t count, uint32_t size, int sum) {                \
    for (size_t i = 0; i < count; i++) {                                                           \
      T acc = blocks[i];                                                                           \
      for (uint32_t r = 1; r < size; r++) {                                                        \
        T b = blocks[(size_t)r * count + i];                                                       \
        acc = sum ? acc + b : (b > acc ? b : acc);                                                 \
      }                                                                                            \
      out[i] = acc;                                                                                \
    }                                                                                              \
  }
DEFINE_REDUCE(reduce_f32, float)
DEFINE_REDUCE(reduce_f64, double)
DEFINE_REDUCE(reduce_u64, uint64_t)

static void run_reduce(void *p) {
  const reduce_args_t *a = p;
  int sum = a->op == EMBPS_COMM_SUM;
  if (a->type == EMBPS_COMM_F32)
    reduce_f32(a->out, a->blocks, a->count, a->size, sum);
  else if (a->type == EMBPS_COMM_F64)
    reduce_f64(a->out, a->blocks, a->count, a->size, sum);
  else
    reduce_u64(a->out, a->blocks, a->count, a->size, sum);
}

cudaError_t embps__comm_nccl_reduce(void *out, const void *blocks, size_t count, uint32_t size,
                                    embps_comm_type_t type, embps_comm_op_t op,
                                    cudaStream_t stream) {
  size_t elem;
  if (size == 0 || (op != EMBPS_COMM_SUM && op != EMBPS_COMM_MAX))
    return cudaErrorInvalidValue;
  if (count == 0)
    return cudaSuccess;
  switch (type) {
  case EMBPS_COMM_F32:
    elem = 4;
    break;
  case EMBPS_COMM_F64:
  case EMBPS_COMM_U64:
    elem = 8;
    break;
  default:
    return cudaErrorInvalidValue;
  }
  if ((uintptr_t)out % elem || (uintptr_t)blocks % elem)
    sim_cuda_fail("embps__comm_nccl_reduce: out %p or blocks %p not aligned to %zu-byte elements",
                  out, blocks, elem);
  sim_cuda_check_device(stream, out, count * elem, "embps__comm_nccl_reduce (out)");
  sim_cuda_check_device(stream, blocks, (size_t)size * count * elem,
                        "embps__comm_nccl_reduce (blocks)");
  if (sim_nccl_lib_stream_busy(stream))
    sim_cuda_fail("embps__comm_nccl_reduce: launched on stream %p while a simulated NCCL "
                  "operation on it is still in progress (ncclCommGetAsyncError says "
                  "ncclInProgress): nothing may be enqueued behind it yet",
                  (void *)stream);
  reduce_args_t a = {out, blocks, count, size, type, op};
  sim_cuda_enqueue(stream, run_reduce, &a, sizeof a, "embps__comm_nccl_reduce");
  return cudaSuccess;
}
