/* The CUDA backend of the engine (internal to server/engine): the same batch flow as the CPU
 * engine, with tables in GPU memory, the kernels of kernels/cuda on the engine's stream and a
 * communicator over device buffers (NCCL). Built only with the CUDA backend; without it,
 * engine_nocuda.c answers UNIMPLEMENTED. No CUDA types cross this header. */
#ifndef EMBPS_ENGINE_CUDA_H
#define EMBPS_ENGINE_CUDA_H

#include "server/engine/engine.h"

typedef struct embps__engine_cuda embps__engine_cuda_t;

/** The optimizer parameters of the table's next step (advances table->step), shared by both
 * engines so that they step the same way. */
embps_opt_params_t embps__engine_next_step(embps_table_t *table);

/** State for the CUDA engine on the calling thread's current device. */
embps_status_t embps__engine_cuda_new(embps__engine_cuda_t **out, embps_comm_t *comm,
                                      embps_store_t *store, void *stream);
/** NULL is a no-op. */
void embps__engine_cuda_free(embps__engine_cuda_t *c);
/** Pinned host memory usable from every device, allocated with `device` current; NULL when
 * it cannot be had (no CUDA, or pinning failed). */
void *embps__cuda_host_alloc(int device, size_t bytes);
/** Frees memory from embps__cuda_host_alloc. */
void embps__cuda_host_free(void *p);

/** embps_engine_run for the CUDA backend. */
embps_status_t embps__engine_cuda_run(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err);

#endif
