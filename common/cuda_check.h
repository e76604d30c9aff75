/* The check macro for calls into the CUDA runtime (NCCL's CUDACHECKGOTO), one for the whole
 * project: the kernels, the CUDA engine and the NCCL backend.
 *
 * Header-only and for CUDA-built code only: it includes <cuda_runtime_api.h>, so include it
 * from .cu files and from C files of targets that link CUDA (or the simulated runtime in
 * tests/unit/engine_sim), never from the CPU build's code. Usable from C and from C++ (.cu):
 * the project's C headers it includes keep C linkage. */
#ifndef EMBPS_CUDA_CHECK_H
#define EMBPS_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/log.h"
#include "common/status.h"
#ifdef __cplusplus
}
#endif

/**
 * Calls `call`, a CUDA runtime function returning cudaError_t (or an expression of that type,
 * such as the error of an earlier call). On failure: logs file:line with the call's text and
 * the error's name and description, sets `ret` (an embps_status_t in scope) to EMBPS_INTERNAL,
 * fills `err` (an embps_error_t *, may be NULL) with "CUDA: <call>: <name> (<description>)",
 * and jumps to `label`. The caller decides what a failure does beyond that (the NCCL backend
 * breaks its communicator at the label).
 */
#define EMBPS_CUDA_CHECK_GOTO(call, err, label)                                                    \
  do {                                                                                             \
    cudaError_t embps_cuda_rc_ = (call);                                                           \
    if (embps_cuda_rc_ != cudaSuccess) {                                                           \
      EMBPS_ERROR("%s: %s (%s)", #call, cudaGetErrorName(embps_cuda_rc_),                          \
                  cudaGetErrorString(embps_cuda_rc_));                                             \
      ret = embps_error_set((err), EMBPS_INTERNAL, "CUDA: %s: %s (%s)", #call,                     \
                            cudaGetErrorName(embps_cuda_rc_), cudaGetErrorString(embps_cuda_rc_)); \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#endif
