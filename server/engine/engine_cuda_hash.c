/* The CUDA backend's operations for hash-keyed tables (engine_ops.h).
 *
 * The key index lives in host memory (engine.c): a batch's unique keys come to the host in one
 * copy and its slots go back in one, both through pinned buffers, and the index's steps run on
 * the group's thread between them. Each buffer is written once per op, and finish waits for the
 * copies before the next op can write it again. */
#include <string.h>

#include "common/cuda_check.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "server/engine/engine_cuda_internal.h"

/* A copy of n host values into the pinned buffer h and from it to the device buffer d, on the
 * stream (host memory need not be pinned: it is staged). */
static embps_status_t stage_in(embps__engine_backend_t *c, buf_t *h, buf_t *d, size_t at,
                               const int64_t *host, size_t n, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (n == 0)
    return EMBPS_OK;
  memcpy((int64_t *)h->p + at, host, n * sizeof(int64_t));
  EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync((int64_t *)d->p + at, (int64_t *)h->p + at,
                                        n * sizeof(int64_t), cudaMemcpyHostToDevice, c->stream),
                        err, exit);
exit:
  return ret;
}

embps_status_t embps__cuda_keys_to_host(embps__engine_backend_t *c, const int64_t *keys, size_t n,
                                        const int64_t **host, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (n > 0) {
    EMBPS_CUDA_CHECK_GOTO(
        cudaMemcpyAsync(c->h_keys.p, keys, n * sizeof(int64_t), cudaMemcpyDeviceToHost, c->stream),
        err, exit);
    EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  }
  *host = c->h_keys.p;
exit:
  return ret;
}

embps_status_t embps__cuda_hash_order(embps__engine_backend_t *c, const int64_t *in, size_t n,
                                      int64_t *out, embps_error_t *err) {
  (void)err;
  return embps_hash_order_cuda(in, n, out, c->stream);
}

embps_status_t embps__cuda_hash_slots(embps__engine_backend_t *c, const int64_t *host, size_t n,
                                      const int64_t **slots, embps_error_t *err) {
  *slots = c->slots.p;
  return stage_in(c, &c->h_slots, &c->slots, 0, host, n, err);
}

embps_status_t embps__cuda_hash_gather(embps__engine_backend_t *c, embps_table_t *t,
                                       const int64_t *keys, const int64_t *slots, size_t n,
                                       void *out, int more, embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  (void)err, (void)more; /* a thread per element computes its value: nothing to reuse */
  return embps_hash_gather_cuda(embps_table_arrays(t).data, cfg->dtype, embps_table_shard_width(t),
                                keys, slots, n, out, embps_table_col_begin(t), cfg->seed,
                                cfg->init_scale, c->stream);
}

embps_status_t embps__cuda_hash_reset(embps__engine_backend_t *c, embps_table_t *t,
                                      const int64_t *slots, const int64_t *keys, size_t n,
                                      embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  const embps_table_arrays_t a = embps_table_arrays(t);
  const size_t w = embps_table_shard_width(t);
  const int64_t *d = c->fresh.p;
  size_t s0, s1;
  float v0;
  embps_status_t ret;
  embps_table_initial_state(t, &v0, &s0, &s1);
  /* the slots at [0, n) of the fresh buffers, their keys at [n, 2n) */
  if ((ret = stage_in(c, &c->h_fresh, &c->fresh, 0, slots, n, err)) != EMBPS_OK ||
      (ret = stage_in(c, &c->h_fresh, &c->fresh, n, keys, n, err)) != EMBPS_OK)
    return ret;
  return embps_hash_reset_cuda(
      a.data, cfg->dtype, w, a.state0,
      s0 ? (embps_optimizer_info(cfg->optimizer)->state_per_row ? 1 : w) : 0, s1 ? a.state1 : NULL,
      v0, d, d + n, n, embps_table_col_begin(t), cfg->seed, cfg->init_scale, c->stream);
}

/* The kept rows' slots go to the device; where some rows are dropped, their places too, and the
 * kept gradients and figures are gathered into kept_g and kept_sumsq (an in-place compaction
 * would race on the device). */
embps_status_t embps__cuda_hash_keep(embps__engine_backend_t *c, int64_t *slots, size_t *m,
                                     size_t w, float **g, float **row_sumsq, const int64_t **rows,
                                     embps_error_t *err) {
  int64_t *h = c->h_keep.p;
  const int64_t *d = c->keep.p;
  embps_status_t ret = EMBPS_OK;
  size_t k = 0;
  for (size_t i = 0; i < *m; i++)
    k += slots[i] >= 0;
  *rows = d;
  if (k == *m)
    return stage_in(c, &c->h_keep, &c->keep, 0, slots, k, err);
  /* the kept slots at [0, k) of the keep buffers, their places at [k, 2k) */
  for (size_t i = 0, j = 0; i < *m; i++)
    if (slots[i] >= 0) {
      h[j] = slots[i];
      h[k + j++] = (int64_t)i;
    }
  if (k > 0) {
    EMBPS_CUDA_CHECK_GOTO(
        cudaMemcpyAsync(c->keep.p, h, 2 * k * sizeof(int64_t), cudaMemcpyHostToDevice, c->stream),
        err, exit);
    if ((ret = embps_gather_cuda(*g, EMBPS_DTYPE_F32, w, d + k, k, c->kept_g.p, c->stream)) !=
            EMBPS_OK ||
        (ret = embps_gather_cuda(*row_sumsq, EMBPS_DTYPE_F32, 1, d + k, k, c->kept_sumsq.p,
                                 c->stream)) != EMBPS_OK)
      return embps_error_set(err, ret, "gathering the %zu kept gradient rows failed", k);
  }
  *g = c->kept_g.p;
  *row_sumsq = c->kept_sumsq.p;
  *m = k;
exit:
  return ret;
}
