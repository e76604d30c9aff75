/* The engine's CUDA backend (engine_ops.h): the operations of a round on the GPU, tables and
 * scratch in GPU memory, kernels/cuda launched on the engine's streams.
 *
 * Three streams: `h2d` carries a batch's tokens and gradients to the device, `stream` (the
 * group's, which the NCCL communicator also uses) runs the kernels and collectives, and `d2h`
 * carries a lookup's rows back; events order them. So a push's gradients travel while its
 * tokens are all-gathered and deduplicated, and a lookup's rows go back in chunks, each chunk's
 * copy overlapping the gather (or the column-slice copies) of the next. The host synchronizes
 * only where it needs a number to go on: the count of unique tokens (it sizes the launches that
 * follow), the row figures (the gate), and the end of each batch (finish), after which all
 * three streams are idle: the reply must not leave before the update is applied, and the caller
 * may free the request as soon as the run returns.
 *
 * Request and reply buffers come pinned from the service's pool (embps_host_alloc), so they are
 * copied to and from the device directly; a buffer that is not pinned (the pool could not pin,
 * or a caller's own memory) is staged through the engine's pinned buffers. Scratch buffers,
 * device and pinned, only grow, since batch sizes repeat from step to step.
 *
 * Not yet run on a GPU (the sessions that wrote it had none): tests/unit/engine_sim runs this
 * file against a simulated runtime whose streams run lazily (so a missing dependency shows as
 * wrong rows), and tests/gpu/check.sh runs it end to end where a GPU is available. */
#include <cuda_runtime_api.h>
#include <string.h>

#include "common/alloc.h"
#include "common/cuda_check.h"
#include "common/log.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "server/engine/engine_cuda_internal.h"
#include "server/engine/round_cost.h"

/* ---- devices -------------------------------------------------------------------------------- */

int embps_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess)
    return 0;
  return n;
}

embps_status_t embps_cuda_open(int device, void **stream, char *bus_id, size_t cap,
                               embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  cudaStream_t s = NULL;
  int n = embps_cuda_device_count();

  if (device < 0 || device >= n)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "CUDA device %d does not exist: this process sees %d device(s)", device,
                           n);
  EMBPS_CUDA_CHECK_GOTO(cudaSetDevice(device), err, fail);
  EMBPS_CUDA_CHECK_GOTO(cudaDeviceGetPCIBusId(bus_id, (int)cap, device), err, fail);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), err, fail);
  *stream = s;
  return EMBPS_OK;
fail:
  return ret;
}

void embps_cuda_close(void *stream) {
  if (stream)
    cudaStreamDestroy((cudaStream_t)stream);
}

void *embps__cuda_host_alloc(int device, size_t bytes) {
  void *p = NULL;
  cudaError_t e;
  /* The calling thread (the network loop's) makes the engine's device current, so that the
   * allocation does not create a context on device 0; portable memory is pinned for every
   * context. */
  if ((e = cudaSetDevice(device)) != cudaSuccess ||
      (e = cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocPortable)) != cudaSuccess) {
    EMBPS_DEBUG("cannot pin %zu bytes on device %d: %s", bytes, device, cudaGetErrorString(e));
    cudaGetLastError();
    return NULL;
  }
  return p;
}

void embps__cuda_host_free(void *p) {
  if (p)
    cudaFreeHost(p);
}

/* Whether the engine may copy straight from or to host memory p: pinned memory only (an async
 * copy from pageable memory would be staged by the driver and block the host). */
static int is_pinned(const void *p) {
  struct cudaPointerAttributes a;
  if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError(); /* clear the error an unknown pointer leaves on older runtimes */
    return 0;
  }
  return a.type == cudaMemoryTypeHost;
}

/* ---- scratch -------------------------------------------------------------------------------- */

static cudaError_t dgrow(buf_t *b, size_t bytes) {
  cudaError_t e;
  if (bytes <= b->cap && b->p)
    return cudaSuccess;
  cudaFree(b->p);
  b->p = NULL;
  b->cap = 0;
  if ((e = cudaMalloc(&b->p, bytes ? bytes : 64)) == cudaSuccess)
    b->cap = bytes;
  return e;
}

static cudaError_t hgrow(buf_t *b, size_t bytes) {
  cudaError_t e;
  if (bytes <= b->cap && b->p)
    return cudaSuccess;
  cudaFreeHost(b->p);
  b->p = NULL;
  b->cap = 0;
  if ((e = cudaMallocHost(&b->p, bytes ? bytes : 64)) == cudaSuccess)
    b->cap = bytes;
  return e;
}

/* Only what the op's path uses is grown (a 1M-token lookup on one rank needs its tokens and its
 * rows, not the exchange and gradient buffers of a push), since scratch never shrinks and GPU
 * memory is the tables'. */
static embps_status_t cuda_reserve(embps__engine_backend_t *c, const embps__engine_shape_t *sh,
                                   embps__engine_scratch_t *s, embps_error_t *err) {
  const int push = sh->kind == EMBPS_OP_PUSH, exchange = sh->group_size > 1;
  const int dedup = push || exchange,
            owner = push && embps_round_stats_by_owner(sh->group_size, sh->nb);
  const size_t T = sh->T, n = sh->n, w = sh->w, ds = sh->ds;
  size_t dedup_ws = dedup ? embps_dedup_cuda_workspace_bytes(T) : 0;
  embps_status_t ret = EMBPS_OK;

  memset(s, 0, sizeof(*s));
  if (dedup && T > 0 && dedup_ws == 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot size the dedup workspace for %zu tokens",
                           T);
  EMBPS_CUDA_CHECK_GOTO(dgrow(&c->figures, 4 * sizeof(uint64_t)), err, fail);
  EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_small, 4 * sizeof(uint64_t)), err, fail);
  EMBPS_CUDA_CHECK_GOTO(dgrow(&c->in[EMBPS__IN_TOKENS], n * sizeof(int64_t)), err, fail);
  if (exchange) {
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->all_tokens, T * sizeof(int64_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->send, T * w * ds), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->recv, T * w * ds), err, fail);
  }
  if (dedup) {
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->unique, T * sizeof(int64_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->seg, T * sizeof(uint32_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->sorted_pos, T * sizeof(uint32_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->seg_off, (T + 1) * sizeof(uint32_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->num_unique, sizeof(uint32_t)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->dedup_ws, dedup_ws), err, fail);
  }
  if (push) {
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->in[EMBPS__IN_GRADS], n * sh->W * ds), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->summed, T * w * sizeof(float)), err, fail);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->row_sumsq, T * sizeof(float)), err, fail);
    /* round_cost.c's sizes. By owner, q rows of every rank (engine.c's row_figures); the
     * partials past row m that the all-to-all carries are never added, so unlike the cpu
     * backend's they are left as allocated (a memset would need ordering on the stream). */
    if (owner) {
      const size_t rows = sh->group_size * embps_round_stats_owned(sh->group_size, T);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->partials, (T + sh->group_size) * sh->nb * sizeof(float)), err,
                            fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->gathered, rows * sh->nb * sizeof(float)), err, fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->sums, rows * sizeof(double)), err, fail);
    } else {
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->partials, T * sh->nb * sizeof(float)), err, fail);
      if (exchange)
        EMBPS_CUDA_CHECK_GOTO(dgrow(&c->gathered, sh->group_size * T * sh->nb * sizeof(float)), err,
                              fail);
    }
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->comb_ws, embps_row_combine_cuda_workspace_bytes(T)), err, fail);
  } else {
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->out, n * sh->W * ds), err, fail);
    if (exchange)
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->rows, T * w * ds), err, fail); /* the unique rows, U <= T */
  }
  if (sh->hashed) {
    const size_t i64 = sizeof(int64_t);
    EMBPS_CUDA_CHECK_GOTO(dgrow(&c->slots, T * i64), err, fail);
    EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_slots, T * i64), err, fail);
    EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_keys, T * i64), err, fail);
    if (push) {
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->keys, T * i64), err, fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->fresh, 2 * T * i64), err, fail);
      EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_fresh, 2 * T * i64), err, fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->keep, 2 * T * i64), err, fail);
      EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_keep, 2 * T * i64), err, fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->kept_g, T * w * sizeof(float)), err, fail);
      EMBPS_CUDA_CHECK_GOTO(dgrow(&c->kept_sumsq, T * sizeof(float)), err, fail);
    }
  }
  s->keys = c->keys.p;
  s->all_tokens = c->all_tokens.p;
  s->rows = c->rows.p;
  s->send = c->send.p;
  s->recv = c->recv.p;
  s->summed = c->summed.p;
  s->partials = c->partials.p;
  s->gathered = c->gathered.p;
  s->sums = c->sums.p;
  s->row_sumsq = c->row_sumsq.p;
fail:
  return ret;
}

static void cuda_destroy(embps__engine_backend_t *c) {
  buf_t *dev[] = {&c->in[0],      &c->in[1],   &c->all_tokens, &c->unique,   &c->seg,
                  &c->sorted_pos, &c->seg_off, &c->num_unique, &c->dedup_ws, &c->comb_ws,
                  &c->row_sumsq,  &c->summed,  &c->partials,   &c->gathered, &c->send,
                  &c->recv,       &c->rows,    &c->out,        &c->figures,  &c->keys,
                  &c->slots,      &c->fresh,   &c->keep,       &c->kept_g,   &c->kept_sumsq,
                  &c->sums};
  buf_t *host[] = {&c->h_in[0], &c->h_in[1], &c->h_out,   &c->h_small, &c->h_dirty,
                   &c->h_keys,  &c->h_slots, &c->h_fresh, &c->h_keep};
  for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
    cudaFree(dev[i]->p);
  for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++)
    cudaFreeHost(host[i]->p);
  for (int i = 0; i < EMBPS__ENGINE_FEATURE_SLOTS; i++)
    cudaFree(c->feature[i].p);
  for (int i = 0; i < MAX_CHUNKS; i++)
    if (c->chunk_ready[i])
      cudaEventDestroy(c->chunk_ready[i]);
  for (int i = 0; i < 2; i++)
    if (c->in_done[i])
      cudaEventDestroy(c->in_done[i]);
  if (c->h2d)
    cudaStreamDestroy(c->h2d);
  if (c->d2h)
    cudaStreamDestroy(c->d2h);
  embps_free(c);
}

embps_status_t embps__engine_cuda_new(embps__engine_backend_t **out, embps_comm_t *comm,
                                      void *stream) {
  embps__engine_backend_t *c = embps_calloc(1, sizeof(*c));
  embps_status_t ret = EMBPS_OK;
  embps_error_t lerr, *err = &lerr;

  if (!c)
    return EMBPS_RESOURCE_EXHAUSTED;
  c->comm = comm;
  c->stream = (cudaStream_t)stream;
  EMBPS_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->h2d, cudaStreamNonBlocking), err, fail);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->d2h, cudaStreamNonBlocking), err, fail);
  for (int i = 0; i < 2; i++)
    EMBPS_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->in_done[i], cudaEventDisableTiming), err,
                          fail);
  for (int i = 0; i < MAX_CHUNKS; i++)
    EMBPS_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->chunk_ready[i], cudaEventDisableTiming), err,
                          fail);
  *out = c;
  return EMBPS_OK;
fail:
  cuda_destroy(c);
  return ret;
}

/* ---- tables ------------------------------------------------------------------------------- */

static void *device_alloc(size_t bytes) {
  void *p = NULL;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return p;
}

static void device_release(void *p) {
  if (p)
    cudaFree(p);
}

static const embps_table_memory_t device_memory = {device_alloc, device_release};

/* Fills n floats of device memory with v (there is no fill kernel: adagrad accumulators are
 * the only non-zero state, and they are written once per table). */
static embps_status_t fill_floats(embps__engine_backend_t *c, float *dst, size_t n, float v,
                                  embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const size_t chunk = (size_t)1 << 20;
  float *h = NULL;
  if (v == 0.0f) {
    EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(dst, 0, n * sizeof(float), c->stream), err, exit);
    return EMBPS_OK;
  }
  EMBPS_CUDA_CHECK_GOTO(cudaMallocHost((void **)&h, chunk * sizeof(float)), err, exit);
  for (size_t i = 0; i < chunk; i++)
    h[i] = v;
  for (size_t off = 0; off < n; off += chunk) {
    size_t k = n - off < chunk ? n - off : chunk;
    EMBPS_CUDA_CHECK_GOTO(
        cudaMemcpyAsync(dst + off, h, k * sizeof(float), cudaMemcpyHostToDevice, c->stream), err,
        exit);
  }
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
exit:
  cudaFreeHost(h);
  return ret;
}

static embps_status_t cuda_table_new(embps__engine_backend_t *c, const embps_table_config_t *cfg,
                                     uint32_t rank, uint32_t group_size, int blank,
                                     embps_table_t **out) {
  embps_table_t *t = NULL;
  embps_table_arrays_t a;
  embps_error_t lerr;
  size_t s0, s1;
  float v0;

  if (embps_table_new_in(&t, cfg, rank, group_size, &device_memory) != EMBPS_OK)
    return EMBPS_RESOURCE_EXHAUSTED;
  if (blank) {
    *out = t;
    return EMBPS_OK;
  }
  a = embps_table_arrays(t);
  embps_table_initial_state(t, &v0, &s0, &s1);
  if (embps_init_rows_cuda(a.data, cfg->dtype, embps_table_shard_width(t), 0,
                           embps_table_config_rows(cfg), embps_table_col_begin(t), cfg->seed,
                           cfg->init_scale, c->stream) != EMBPS_OK ||
      (s0 && fill_floats(c, a.state0, s0, v0, &lerr) != EMBPS_OK) ||
      (s1 && cudaMemsetAsync(a.state1, 0, s1 * sizeof(float), c->stream) != cudaSuccess) ||
      cudaStreamSynchronize(c->stream) != cudaSuccess) {
    cudaGetLastError();
    embps_table_free(t);
    return EMBPS_INTERNAL;
  }
  *out = t;
  return EMBPS_OK;
}

static uint64_t cuda_memory_total(embps__engine_backend_t *c) {
  size_t free_b = 0, total_b = 0;
  (void)c;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return total_b;
}

/* Every rank learns the largest value any rank had (device buffers for the communicator). */
static embps_status_t cuda_agree_max(embps__engine_backend_t *c, uint64_t *v, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint64_t *h;
  EMBPS_CUDA_CHECK_GOTO(dgrow(&c->figures, 4 * sizeof(uint64_t)), err, exit);
  EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_small, 4 * sizeof(uint64_t)), err, exit);
  h = c->h_small.p;
  h[0] = *v;
  EMBPS_CUDA_CHECK_GOTO(
      cudaMemcpyAsync(c->figures.p, h, sizeof(uint64_t), cudaMemcpyHostToDevice, c->stream), err,
      exit);
  if ((ret = embps_comm_all_reduce(c->comm, c->figures.p, 1, EMBPS_COMM_U64, EMBPS_COMM_MAX,
                                   err)) != EMBPS_OK)
    goto exit;
  EMBPS_CUDA_CHECK_GOTO(
      cudaMemcpyAsync(h, c->figures.p, sizeof(uint64_t), cudaMemcpyDeviceToHost, c->stream), err,
      exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  *v = h[0];
exit:
  return ret;
}

/* ---- batches -------------------------------------------------------------------------------- */

/* Enqueues the copy of a request array to the device on the h2d stream and records its event;
 * memory that is not pinned is staged through a pinned buffer first. */
static embps_status_t cuda_input(embps__engine_backend_t *c, embps__engine_input_t which,
                                 const void *host, size_t bytes, const void **dev,
                                 embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (bytes > 0) {
    if (!is_pinned(host)) {
      EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_in[which], bytes), err, exit);
      memcpy(c->h_in[which].p, host, bytes);
      host = c->h_in[which].p;
    }
    EMBPS_CUDA_CHECK_GOTO(
        cudaMemcpyAsync(c->in[which].p, host, bytes, cudaMemcpyHostToDevice, c->h2d), err, exit);
  }
  EMBPS_CUDA_CHECK_GOTO(cudaEventRecord(c->in_done[which], c->h2d), err, exit);
  *dev = c->in[which].p;
exit:
  return ret;
}

static embps_status_t cuda_input_wait(embps__engine_backend_t *c, embps__engine_input_t which,
                                      embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  EMBPS_CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->stream, c->in_done[which], 0), err, exit);
exit:
  return ret;
}

static embps_status_t cuda_dedup(embps__engine_backend_t *c, const int64_t *tokens, size_t T,
                                 embps_error_t *err) {
  (void)err;
  return embps_dedup_cuda(tokens, T, c->unique.p, c->seg.p, c->sorted_pos.p, c->seg_off.p,
                          c->num_unique.p, c->dedup_ws.p, c->dedup_ws.cap, c->stream);
}

static embps_status_t cuda_unique(embps__engine_backend_t *c, size_t *num_unique, int64_t *first,
                                  const int64_t **unique, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint64_t *small = c->h_small.p;
  uint32_t U;
  EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(&small[0], c->num_unique.p, sizeof(uint32_t),
                                        cudaMemcpyDeviceToHost, c->stream),
                        err, exit);
  EMBPS_CUDA_CHECK_GOTO(
      cudaMemcpyAsync(&small[1], c->unique.p, sizeof(int64_t), cudaMemcpyDeviceToHost, c->stream),
      err, exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  memcpy(&U, &small[0], sizeof(U));
  *num_unique = U;
  if (U > 0)
    memcpy(first, &small[1], sizeof(*first));
  *unique = c->unique.p;
exit:
  return ret;
}

static embps_status_t cuda_gather(embps__engine_backend_t *c, embps_table_t *t, const int64_t *rows,
                                  size_t n, void *out, embps_error_t *err) {
  (void)err;
  return embps_gather_cuda(embps_table_arrays(t).data, embps_table_config(t)->dtype,
                           embps_table_shard_width(t), rows, n, out, c->stream);
}

static embps_status_t cuda_expand(embps__engine_backend_t *c, embps_table_t *t,
                                  const void *unique_rows, size_t T, void *out,
                                  embps_error_t *err) {
  (void)err;
  return embps_expand_cuda(unique_rows, embps_table_config(t)->dtype, embps_table_shard_width(t),
                           c->seg.p, T, out, c->stream);
}

static embps_status_t cuda_copy2d(embps__engine_backend_t *c, void *dst, size_t dpitch,
                                  const void *src, size_t spitch, size_t width, size_t height,
                                  embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (height > 0)
    EMBPS_CUDA_CHECK_GOTO(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                            cudaMemcpyDeviceToDevice, c->stream),
                          err, exit);
exit:
  return ret;
}

static embps_status_t cuda_segment_sum(embps__engine_backend_t *c, embps_table_t *t,
                                       const void *grads, size_t T, size_t num_unique, float *out,
                                       embps_error_t *err) {
  (void)T, (void)err;
  return embps_segment_sum_cuda(grads, embps_table_config(t)->dtype, embps_table_shard_width(t),
                                c->sorted_pos.p, c->seg_off.p, num_unique, out, c->stream);
}

static embps_status_t cuda_row_partials(embps__engine_backend_t *c, const float *g, size_t m,
                                        size_t w, size_t block, float *partials,
                                        embps_error_t *err) {
  (void)err;
  return embps_row_partials_cuda(g, m, w, block, partials, c->stream);
}

/* The gate's figures on the device: figures[0] (f64) the total sum of squares, figures[1] (u64)
 * the rows that are not finite. figures_zero clears them before a combine or a finish adds to
 * them; figures_read brings them to the host once it has (waits). */
static embps_status_t figures_zero(embps__engine_backend_t *c, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(c->figures.p, 0, 2 * sizeof(uint64_t), c->stream), err,
                        exit);
exit:
  return ret;
}

static embps_status_t figures_read(embps__engine_backend_t *c, uint64_t *bad, double *total,
                                   embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint64_t *small = c->h_small.p;
  EMBPS_CUDA_CHECK_GOTO(
      cudaMemcpyAsync(small, c->figures.p, 2 * sizeof(uint64_t), cudaMemcpyDeviceToHost, c->stream),
      err, exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  memcpy(total, &small[0], sizeof(*total));
  *bad = small[1];
exit:
  return ret;
}

static embps_status_t cuda_row_combine(embps__engine_backend_t *c, const float *partials,
                                       size_t slices, size_t m, size_t nb, float *row_sumsq,
                                       uint64_t *bad, double *total, embps_error_t *err) {
  uint64_t *figures = c->figures.p;
  embps_status_t ret;
  if (!bad || !total)
    return embps_row_combine_cuda(partials, slices, m, nb, row_sumsq, NULL, NULL, NULL, c->stream);
  if ((ret = figures_zero(c, err)) != EMBPS_OK ||
      (ret = embps_row_combine_cuda(partials, slices, m, nb, row_sumsq, (double *)figures,
                                    figures + 1, c->comb_ws.p, c->stream)) != EMBPS_OK)
    return ret;
  return figures_read(c, bad, total, err);
}

static embps_status_t cuda_row_sums(embps__engine_backend_t *c, const float *partials,
                                    size_t slices, size_t stride, size_t n, size_t nb, double *sums,
                                    embps_error_t *err) {
  (void)err;
  return embps_row_sums_cuda(partials, slices, stride, n, nb, sums, c->stream);
}

static embps_status_t cuda_row_finish(embps__engine_backend_t *c, const double *sums, size_t m,
                                      float *row_sumsq, uint64_t *bad, double *total,
                                      embps_error_t *err) {
  uint64_t *figures = c->figures.p;
  embps_status_t ret;
  if (!bad || !total)
    return embps_row_finish_cuda(sums, m, row_sumsq, NULL, NULL, NULL, c->stream);
  if ((ret = figures_zero(c, err)) != EMBPS_OK ||
      (ret = embps_row_finish_cuda(sums, m, row_sumsq, (double *)figures, figures + 1, c->comb_ws.p,
                                   c->stream)) != EMBPS_OK)
    return ret;
  return figures_read(c, bad, total, err);
}

static embps_status_t cuda_weight_decay(embps__engine_backend_t *c, embps_table_t *t,
                                        const int64_t *rows, size_t m, float *g,
                                        embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  (void)err;
  return embps_apply_weight_decay_cuda(embps_table_arrays(t).data, cfg->dtype,
                                       embps_table_shard_width(t), rows, m, g, cfg->weight_decay,
                                       c->stream);
}

static embps_status_t cuda_update(embps__engine_backend_t *c, embps_table_t *t, const int64_t *rows,
                                  size_t m, const float *g, const float *row_sumsq,
                                  const embps_opt_params_t *p, embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  const embps_table_arrays_t a = embps_table_arrays(t);
  const size_t w = embps_table_shard_width(t);
  switch (cfg->optimizer) {
  case EMBPS_OPTIMIZER_SGD:
    return embps_update_sgd_cuda(a.data, cfg->dtype, w, rows, m, g, p, c->stream);
  case EMBPS_OPTIMIZER_ADAGRAD:
    return embps_update_adagrad_cuda(a.data, cfg->dtype, w, rows, m, g, a.state0, p, c->stream);
  case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
    return embps_update_rowwise_adagrad_cuda(a.data, cfg->dtype, w, rows, m, g, row_sumsq,
                                             cfg->emb_width, a.state0, p, c->stream);
  case EMBPS_OPTIMIZER_ADAM:
    return embps_update_adam_cuda(a.data, cfg->dtype, w, rows, m, g, a.state0, a.state1, p,
                                  c->stream);
  }
  return embps_error_set(err, EMBPS_INTERNAL, "unknown optimizer %d", (int)cfg->optimizer);
}

/* The rows a push wrote are marked in the table's bitmap in GPU memory, on the stream after the
 * update: no copy and no wait per push (the host copy of the rows and the sync it needed cost a
 * round trip per push). The bitmap is allocated and cleared at the first mark; where GPU memory
 * cannot hold it, every row of the table counts as written, so its next checkpoint is whole
 * rather than missing a row. */
static embps_status_t cuda_mark_dirty(embps__engine_backend_t *c, embps_table_t *t,
                                      const int64_t *rows, size_t m, embps_error_t *err) {
  const size_t bytes =
      embps_dirty_words(embps_table_config_rows(embps_table_config(t))) * sizeof(uint64_t);
  embps_status_t ret = EMBPS_OK;
  uint64_t *bits = embps_table_device_dirty(t);
  if (!bits) {
    if (embps_table_device_dirty_new(t, &bits) != EMBPS_OK) {
      if (!c->warned_dirty)
        EMBPS_WARN("no GPU memory for the dirty-row bitmap of table '%s' (%zu bytes): its next "
                   "checkpoints write every row",
                   embps_table_config(t)->name, bytes);
      c->warned_dirty = 1;
      memset(embps_table_dirty(t), 0xff, bytes);
      return EMBPS_OK;
    }
    EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(bits, 0, bytes, c->stream), err, exit);
  }
  if ((ret = embps_mark_rows_cuda(bits, rows, m, c->stream)) != EMBPS_OK)
    embps_error_set(err, ret, "marking the %zu rows a push wrote failed", m);
exit:
  return ret;
}

/* An assign's rows, written as given (kernels/cuda/assign.cu); with reset, their optimizer state
 * goes back to its initial value too. */
static embps_status_t cuda_assign_rows(embps__engine_backend_t *c, embps_table_t *t,
                                       const int64_t *rows, const int64_t *src_rows, size_t n,
                                       const void *src, int reset, embps_error_t *err) {
  const embps_table_config_t *cfg = embps_table_config(t);
  const embps_table_arrays_t a = embps_table_arrays(t);
  const size_t w = embps_table_shard_width(t);
  size_t s0, s1;
  float v0;
  embps_status_t ret;
  embps_table_initial_state(t, &v0, &s0, &s1);
  if (!reset)
    s0 = s1 = 0;
  ret =
      embps_assign_rows_cuda(a.data, cfg->dtype, w, rows, src_rows, n, src, s0 ? a.state0 : NULL,
                             s0 ? (embps_optimizer_info(cfg->optimizer)->state_per_row ? 1 : w) : 0,
                             s1 ? a.state1 : NULL, v0, c->stream);
  if (ret != EMBPS_OK)
    embps_error_set(err, ret, "writing the %zu rows of an assign failed", n);
  return ret;
}

/* A checkpoint's capture and a restore: whole arrays between GPU and host memory. A capture also
 * takes the rows marked on the device since the last one (after every push before it: the same
 * stream) and ORs them into the host bitmap that the checkpointer reads. */
static embps_status_t cuda_table_copy(embps__engine_backend_t *c, embps_table_t *t,
                                      const embps_table_arrays_t *host, int to_host,
                                      embps_error_t *err) {
  const embps_table_arrays_t a = embps_table_arrays(t);
  void *const mine[3] = {a.data, a.state0, a.state1};
  void *const theirs[3] = {host->data, host->state0, host->state1};
  uint64_t *marks = to_host && embps_table_dirty(t) ? embps_table_device_dirty(t) : NULL;
  const size_t words = embps_dirty_words(embps_table_config_rows(embps_table_config(t)));
  embps_status_t ret = EMBPS_OK;
  size_t bytes[3];
  embps_table_array_bytes(t, bytes);
  for (int i = 0; i < 3; i++)
    if (bytes[i])
      EMBPS_CUDA_CHECK_GOTO(
          cudaMemcpyAsync(to_host ? theirs[i] : mine[i], to_host ? mine[i] : theirs[i], bytes[i],
                          to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, c->stream),
          err, exit);
  if (marks) {
    EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_dirty, words * sizeof(uint64_t)), err, exit);
    EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(c->h_dirty.p, marks, words * sizeof(uint64_t),
                                          cudaMemcpyDeviceToHost, c->stream),
                          err, exit);
    EMBPS_CUDA_CHECK_GOTO(cudaMemsetAsync(marks, 0, words * sizeof(uint64_t), c->stream), err,
                          exit);
  }
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  if (marks) {
    uint64_t *dst = embps_table_dirty(t);
    const uint64_t *src = c->h_dirty.p;
    for (size_t i = 0; i < words; i++)
      dst[i] |= src[i];
  }
exit:
  return ret;
}

/* A lookup's rows are assembled in device memory and go back in up to MAX_CHUNKS chunks of at
 * least CHUNK_MIN_BYTES, straight into a pinned reply or through h_out. */
static embps_status_t cuda_output_begin(embps__engine_backend_t *c, void *host, size_t n,
                                        size_t row_bytes, void **out, size_t *chunk_rows,
                                        embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  size_t rows = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
  if (is_pinned(host)) {
    c->out_host = host;
  } else {
    EMBPS_CUDA_CHECK_GOTO(hgrow(&c->h_out, n * row_bytes), err, exit);
    c->out_host = c->h_out.p;
  }
  c->reply = host;
  c->out_rows = n;
  c->out_row_bytes = row_bytes;
  if (rows * row_bytes < CHUNK_MIN_BYTES)
    rows = (CHUNK_MIN_BYTES + row_bytes - 1) / row_bytes;
  *chunk_rows = rows ? rows : 1;
  *out = c->out.p;
exit:
  return ret;
}

static embps_status_t cuda_output(embps__engine_backend_t *c, size_t chunk, size_t first,
                                  size_t count, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const size_t off = first * c->out_row_bytes;
  EMBPS_CUDA_CHECK_GOTO(cudaEventRecord(c->chunk_ready[chunk], c->stream), err, exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->d2h, c->chunk_ready[chunk], 0), err, exit);
  EMBPS_CUDA_CHECK_GOTO(cudaMemcpyAsync(c->out_host + off, (uint8_t *)c->out.p + off,
                                        count * c->out_row_bytes, cudaMemcpyDeviceToHost, c->d2h),
                        err, exit);
exit:
  return ret;
}

static embps_status_t cuda_finish(embps__engine_backend_t *c, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), err, exit);
  EMBPS_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->d2h), err, exit);
  if (c->reply && c->out_host != c->reply)
    memcpy(c->reply, c->out_host, c->out_rows * c->out_row_bytes);
exit:
  c->reply = NULL;
  return ret;
}

/* Waits until nothing enqueued for the op can still touch the request or reply, which the
 * caller frees once the run returns. */
static void cuda_abort(embps__engine_backend_t *c) {
  cudaStreamSynchronize(c->h2d);
  cudaStreamSynchronize(c->stream);
  cudaStreamSynchronize(c->d2h);
  cudaGetLastError();
  c->reply = NULL;
}

const embps__engine_ops_t embps__engine_cuda_ops = {
    .backend = EMBPS_BACKEND_CUDA,
    .memory = "GPU memory",
    .destroy = cuda_destroy,
    .reserve = cuda_reserve,
    .table_new = cuda_table_new,
    .memory_total = cuda_memory_total,
    .agree_max = cuda_agree_max,
    .input = cuda_input,
    .input_wait = cuda_input_wait,
    .dedup = cuda_dedup,
    .unique = cuda_unique,
    .gather = cuda_gather,
    .expand = cuda_expand,
    .copy2d = cuda_copy2d,
    .segment_sum = cuda_segment_sum,
    .row_partials = cuda_row_partials,
    .row_combine = cuda_row_combine,
    .row_sums = cuda_row_sums,
    .row_finish = cuda_row_finish,
    .weight_decay = cuda_weight_decay,
    .update = cuda_update,
    .keys_to_host = embps__cuda_keys_to_host,
    .hash_order = embps__cuda_hash_order,
    .hash_slots = embps__cuda_hash_slots,
    .hash_gather = embps__cuda_hash_gather,
    .hash_reset = embps__cuda_hash_reset,
    .hash_keep = embps__cuda_hash_keep,
    .scratch = embps__cuda_scratch,
    .copy_in = embps__cuda_copy_in,
    .copy_out = embps__cuda_copy_out,
    .pool_bags = embps__cuda_pool_bags,
    .expand_bags = embps__cuda_expand_bags,
    .assign_rows = cuda_assign_rows,
    .mark_dirty = cuda_mark_dirty,
    .table_copy = cuda_table_copy,
    .output_begin = cuda_output_begin,
    .output = cuda_output,
    .finish = cuda_finish,
    .abort = cuda_abort,
};
