/* The CUDA backend's operations for feature batches (engine_ops.h, features.c): scratch in GPU
 * memory, copies between it and the host on the group's stream, and the bag kernels
 * (kernels/cuda/pool.cu).
 *
 * copy_in takes host memory that may not be pinned (the engine's own small arrays: counts,
 * offsets, a hash-keyed table's slots; the request's gradients). CUDA does not promise when a
 * copy from pageable memory reads it, and the caller reuses or frees its array once copy_in
 * returns, so copy_in waits for the copy (a few synchronizations per feature batch, against the
 * batch's all-gathers and all-to-alls). */
#include <string.h>

#include "common/cuda_check.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "server/engine/engine_cuda_internal.h"

embps_status_t embps__cuda_scratch(embps__engine_backend_t *c, unsigned slot, size_t bytes,
                                   void **p, embps_error_t *err) {
  buf_t *b = &c->feature[slot];
  embps_status_t ret = EMBPS_OK;
  if (bytes > b->cap || !b->p) {
    /* a slot may hold what the stream has not used yet: wait before freeing it */
    EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
    cudaFree(b->p);
    b->p = NULL;
    b->cap = 0;
    EMBPS_CUDA_CHECK_GOTO(cudaMalloc(&b->p, bytes ? bytes : 64), err, exit);
    b->cap = bytes;
  }
  *p = b->p;
exit:
  return ret;
}

embps_status_t embps__cuda_copy_in(embps__engine_backend_t *c, void *dst, const void *host,
                                   size_t bytes, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (bytes > 0) {
    EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c->stream), err,
                          exit);
    EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  }
exit:
  return ret;
}

embps_status_t embps__cuda_copy_out(embps__engine_backend_t *c, void *host, const void *src,
                                    size_t bytes, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (bytes > 0)
    EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, c->stream), err,
                          exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
exit:
  return ret;
}

embps_status_t embps__cuda_pool_bags(embps__engine_backend_t *c, embps_table_t *t,
                                     const int64_t *ids, const int64_t *rows, const float *weights,
                                     const int64_t *offsets, size_t num_bags, int mean, float *out,
                                     embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  (void)err;
  return embps_pool_bags_cuda(embps_table_arrays(t).data, cfg->dtype, embps_table_shard_width(t),
                              ids, rows, weights, offsets, num_bags, mean, out,
                              embps_table_col_begin(t), cfg->seed, cfg->init_scale, c->stream);
}

embps_status_t embps__cuda_expand_bags(embps__engine_backend_t *c, embps_table_t *t, const float *g,
                                       const int64_t *ids, const float *weights,
                                       const int64_t *offsets, size_t num_bags, int mean, void *out,
                                       embps_error_t *err) {
  (void)err;
  return embps_expand_bags_cuda(g, embps_table_shard_width(t), ids, weights, offsets, num_bags,
                                mean, embps_table_config(t)->dtype, out, c->stream);
}
