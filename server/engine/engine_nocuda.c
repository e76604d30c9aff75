/* The engine's CUDA entry points in a build without CUDA: there are no devices, and asking for
 * the CUDA backend is refused with UNIMPLEMENTED (its ops table is never reached). */
#include "server/engine/engine_ops.h"

int embps_cuda_device_count(void) { return 0; }

embps_status_t embps_cuda_open(int device, void **stream, char *bus_id, size_t cap,
                               embps_error_t *err) {
  (void)device, (void)stream, (void)bus_id, (void)cap;
  return embps_error_set(err, EMBPS_UNIMPLEMENTED, "this build of embps has no CUDA backend");
}

void embps_cuda_close(void *stream) { (void)stream; }

embps_status_t embps__engine_cuda_new(embps__engine_backend_t **out, embps_comm_t *comm,
                                      void *stream) {
  (void)out, (void)comm, (void)stream;
  return EMBPS_UNIMPLEMENTED;
}

const embps__engine_ops_t embps__engine_cuda_ops = {.backend = EMBPS_BACKEND_CUDA,
                                                    .memory = "GPU memory"};

void *embps__cuda_host_alloc(int device, size_t bytes) {
  (void)device, (void)bytes;
  return NULL;
}

void embps__cuda_host_free(void *p) { (void)p; }
