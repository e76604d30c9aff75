/* The engine's CUDA entry points in a build without CUDA: there are no devices, and asking for
 * the CUDA backend is refused with UNIMPLEMENTED. */
#include "server/engine/engine_cuda.h"

int embps_cuda_device_count(void) { return 0; }

embps_status_t embps_cuda_open(int device, void **stream, char *bus_id, size_t cap,
                               embps_error_t *err) {
  (void)device;
  (void)stream;
  (void)bus_id;
  (void)cap;
  return embps_error_set(err, EMBPS_UNIMPLEMENTED, "this build of embps has no CUDA backend");
}

void embps_cuda_close(void *stream) { (void)stream; }

embps_status_t embps__engine_cuda_new(embps__engine_cuda_t **out, embps_comm_t *comm,
                                      embps_store_t *store, void *stream) {
  (void)out;
  (void)comm;
  (void)store;
  (void)stream;
  return EMBPS_UNIMPLEMENTED;
}

void embps__engine_cuda_free(embps__engine_cuda_t *c) { (void)c; }

embps_status_t embps__engine_cuda_run(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err) {
  (void)c;
  (void)op;
  return embps_error_set(err, EMBPS_UNIMPLEMENTED, "this build of embps has no CUDA backend");
}

void *embps__cuda_host_alloc(int device, size_t bytes) {
  (void)device;
  (void)bytes;
  return NULL;
}

void embps__cuda_host_free(void *p) { (void)p; }
