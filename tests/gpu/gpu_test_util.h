/* What every GPU test and benchmark program shares: the one-line skip where no CUDA device is
 * visible (exit 77, which ctest reports as skipped) and the checks that stop a program at the
 * first CUDA or launcher failure (those are not comparisons, so nothing after them counts). */
#ifndef EMBPS_GPU_TEST_UTIL_H
#define EMBPS_GPU_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

#define GPU_SKIP_CODE 77

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "FATAL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

#define STATUS_OK(call)                                                                            \
  do {                                                                                             \
    embps_status_t s_ = (call);                                                                    \
    if (s_ != EMBPS_OK) {                                                                          \
      fprintf(stderr, "FATAL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, embps_status_str(s_));   \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

/** The number of visible CUDA devices; 0 after printing the "SKIP: ..." line when there are
 * none (the caller then returns GPU_SKIP_CODE). */
static inline int gpu_devices_or_skip(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    printf("SKIP: no CUDA device visible (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(e),
           cudaGetErrorString(e));
  else if (count == 0)
    printf("SKIP: no CUDA device visible (cudaGetDeviceCount: 0 devices)\n");
  return e == cudaSuccess ? count : 0;
}

#endif
