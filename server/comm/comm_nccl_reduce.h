/* Internal to the NCCL backend: the device reduction behind its all_reduce
 * (comm_nccl_reduce.cu), called from comm_nccl.c. */
#ifndef EMBPS_COMM_NCCL_REDUCE_H
#define EMBPS_COMM_NCCL_REDUCE_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "server/comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = op over r = 0..size-1, in that order, of ((const T *)blocks)[r * count + i], for T
 * the element type: `blocks` holds size consecutive blocks of count elements (device memory,
 * aligned to the element), out holds count elements and may be any of the blocks. Enqueued on
 * stream; never synchronizes. Returns cudaErrorInvalidValue for an unknown type or op, else the
 * launch's error (cudaSuccess when count is 0: nothing is launched). */
cudaError_t embps__comm_nccl_reduce(void *out, const void *blocks, size_t count, uint32_t size,
                                    embps_comm_type_t type, embps_comm_op_t op,
                                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
