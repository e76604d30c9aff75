/* The simulated NCCL backend's face beyond comm.h (sim_nccl.c): the wrapper that makes a TCP
 * communicator take device buffers as the NCCL backend does, for tests that connect their ranks
 * themselves (socketpairs between threads) instead of through a unique id. */
#ifndef EMBPS_SIM_NCCL_H
#define EMBPS_SIM_NCCL_H

#include <cuda_runtime_api.h>

#include "server/comm/comm.h"

/**
 * A communicator over device buffers of `device` that, like the NCCL backend, waits for
 * `stream` (borrowed) before each collective, then moves the bytes with `tcp`, which it takes
 * over (freed with it). NULL when out of memory (tcp is then freed).
 */
embps_comm_t *sim_nccl_wrap(embps_comm_t *tcp, cudaStream_t stream, int device);

#endif
