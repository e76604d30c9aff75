/* The simulated NCCL library's own face (beyond the fake <nccl.h>): what the simulated kernels
 * of the NCCL backend ask it. See sim_nccl_lib.c for the semantics. */
#ifndef EMBPS_SIM_NCCL_LIB_H
#define EMBPS_SIM_NCCL_LIB_H

#include <cuda_runtime_api.h>

/** Whether a simulated NCCL operation enqueued on `stream` has not been taken yet (its
 * communicator's state is still ncclInProgress because of it): nothing may be enqueued on the
 * stream behind it until ncclCommGetAsyncError leaves ncclInProgress. */
int sim_nccl_lib_stream_busy(cudaStream_t stream);

#endif
