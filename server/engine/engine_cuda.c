/* The CUDA engine (see engine_cuda.h): DESIGN.md's batch flow with tables in GPU memory.
 *
 * Three streams: `h2d` carries a batch's tokens and gradients to the device, `stream` (the
 * group's, which the NCCL communicator also uses) runs the kernels and collectives, and `d2h`
 * carries the rows back; events order them. So a push's gradients travel while the tokens are
 * all-gathered and deduplicated, and a lookup's rows go back in chunks, each chunk's copy
 * overlapping the gather (or the column-slice copies) of the next. The host synchronizes only
 * where it needs a number to go on: the count of unique tokens (it sizes the launches that
 * follow), the row figures (the gate), and the end of each batch, after which all three streams
 * are idle (the reply must not leave before the update is applied, and the caller may free the
 * request as soon as the run returns).
 *
 * Request and reply buffers come pinned from the service's pool (embps_host_alloc), so they are
 * copied to and from the device directly; a buffer that is not pinned (the pool could not pin,
 * or a caller's own memory) is staged through the engine's pinned buffers. Scratch buffers,
 * device and pinned, only grow, since batch sizes repeat from step to step.
 *
 * Column slices move as 2-D copies (cudaMemcpy2DAsync), with the same layouts as the CPU
 * engine, so both give the same results: the kernels sum duplicates in position order and the
 * communicator reduces in rank order.
 *
 * Not yet run on a GPU (the sessions that wrote it had none): tests/unit/engine_sim runs this
 * file against a simulated runtime whose streams run lazily (so a missing dependency shows as
 * wrong rows), and tests/gpu/check.sh runs it end to end where a GPU is available. */
#include "server/engine/engine_cuda.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"
#include "kernels/cuda/embps_kernels_cuda.h"

/* Every CUDA runtime call and kernel launch goes through these: they log file:line, set err and
 * jump to the label (NCCL's CUDACHECKGOTO). `ret` and `err` must be in scope. */
#define CUDA_CHECK_GOTO(call, label)                                                               \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      EMBPS_ERROR("%s: %s", #call, cudaGetErrorString(e_));                                        \
      ret = embps_error_set(err, EMBPS_INTERNAL, "CUDA: %s: %s", #call, cudaGetErrorString(e_));   \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

#define STATUS_CHECK_GOTO(call, label)                                                             \
  do {                                                                                             \
    embps_status_t s_ = (call);                                                                    \
    if (s_ != EMBPS_OK) {                                                                          \
      if (err && err->status == EMBPS_OK)                                                          \
        embps_error_set(err, s_, "%s failed (%s)", #call, embps_status_str(s_));                   \
      ret = s_;                                                                                    \
      goto label;                                                                                  \
    }                                                                                              \
  } while (0)

typedef struct buf {
  void *p;
  size_t cap;
} buf_t;

/* A lookup's reply goes back in at most this many chunks, each at least CHUNK_MIN_BYTES. */
#define MAX_CHUNKS 8
#define CHUNK_MIN_BYTES ((size_t)4 << 20)

struct embps__engine_cuda {
  embps_comm_t *comm;
  embps_store_t *store;
  cudaStream_t stream;   /* kernels and collectives (the group's stream, borrowed) */
  cudaStream_t h2d, d2h; /* copies in and out (owned) */
  cudaEvent_t tokens_in, grads_in, chunk_ready[MAX_CHUNKS];
  /* device scratch */
  buf_t tokens, all_tokens, unique, seg, sorted_pos, seg_off, num_unique, dedup_ws, rs_ws;
  buf_t row_sumsq, summed, send, recv, rows, grads, out, figures;
  /* pinned host staging: h_small for figures; the rest only for requests and replies that are
   * not pinned themselves */
  buf_t h_tokens, h_grads, h_out, h_small;
};

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
  CUDA_CHECK_GOTO(cudaSetDevice(device), fail);
  CUDA_CHECK_GOTO(cudaDeviceGetPCIBusId(bus_id, (int)cap, device), fail);
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), fail);
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

/* Scratch for an op of `kind`: a batch of T tokens over a group of N, n of them this rank's,
 * rows of width w (this rank's slice) and W (full) of dtype size ds. Only what the op's path
 * uses is grown (a 1M-token lookup on one rank needs its tokens and its rows, not the
 * exchange and gradient buffers of a push), since scratch never shrinks and GPU memory is the
 * tables'. A create needs only the small buffers. */
static embps_status_t reserve(embps__engine_cuda_t *c, embps_op_kind_t kind, uint32_t N, size_t T,
                              size_t n, size_t w, size_t W, size_t ds, embps_error_t *err) {
  const int push = kind == EMBPS_OP_PUSH, lookup = kind == EMBPS_OP_LOOKUP;
  const int exchange = (push || lookup) && N > 1, dedup = push || exchange;
  embps_status_t ret = EMBPS_OK;
  size_t dedup_ws = dedup ? embps_dedup_cuda_workspace_bytes(T) : 0;

  if (dedup && T > 0 && dedup_ws == 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot size the dedup workspace for %zu tokens",
                           T);
  CUDA_CHECK_GOTO(dgrow(&c->figures, 4 * sizeof(uint64_t)), fail);
  CUDA_CHECK_GOTO(hgrow(&c->h_small, 4 * sizeof(uint64_t)), fail);
  if (!push && !lookup)
    return EMBPS_OK;
  CUDA_CHECK_GOTO(dgrow(&c->tokens, n * sizeof(int64_t)), fail);
  if (exchange) {
    CUDA_CHECK_GOTO(dgrow(&c->all_tokens, T * sizeof(int64_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->send, T * w * ds), fail);
    CUDA_CHECK_GOTO(dgrow(&c->recv, T * w * ds), fail);
  }
  if (dedup) {
    CUDA_CHECK_GOTO(dgrow(&c->unique, T * sizeof(int64_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->seg, T * sizeof(uint32_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->sorted_pos, T * sizeof(uint32_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->seg_off, (T + 1) * sizeof(uint32_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->num_unique, sizeof(uint32_t)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->dedup_ws, dedup_ws), fail);
  }
  if (push) {
    CUDA_CHECK_GOTO(dgrow(&c->grads, n * W * ds), fail);
    CUDA_CHECK_GOTO(dgrow(&c->summed, T * w * sizeof(float)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->row_sumsq, T * sizeof(float)), fail);
    CUDA_CHECK_GOTO(dgrow(&c->rs_ws, embps_row_stats_cuda_workspace_bytes(T)), fail);
  } else {
    CUDA_CHECK_GOTO(dgrow(&c->out, n * W * ds), fail);
    if (exchange)
      CUDA_CHECK_GOTO(dgrow(&c->rows, T * w * ds), fail); /* the unique rows, U <= T */
  }
fail:
  return ret;
}

embps_status_t embps__engine_cuda_new(embps__engine_cuda_t **out, embps_comm_t *comm,
                                      embps_store_t *store, void *stream) {
  embps__engine_cuda_t *c = embps_calloc(1, sizeof(*c));
  embps_status_t ret = EMBPS_OK;
  embps_error_t lerr, *err = &lerr;

  if (!c)
    return EMBPS_RESOURCE_EXHAUSTED;
  c->comm = comm;
  c->store = store;
  c->stream = (cudaStream_t)stream;
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->h2d, cudaStreamNonBlocking), fail);
  CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->d2h, cudaStreamNonBlocking), fail);
  CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->tokens_in, cudaEventDisableTiming), fail);
  CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->grads_in, cudaEventDisableTiming), fail);
  for (int i = 0; i < MAX_CHUNKS; i++)
    CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->chunk_ready[i], cudaEventDisableTiming), fail);
  *out = c;
  return EMBPS_OK;
fail:
  embps__engine_cuda_free(c);
  return ret;
}

void embps__engine_cuda_free(embps__engine_cuda_t *c) {
  if (!c)
    return;
  {
    buf_t *dev[] = {&c->tokens,  &c->all_tokens, &c->unique,   &c->seg,   &c->sorted_pos,
                    &c->seg_off, &c->num_unique, &c->dedup_ws, &c->rs_ws, &c->row_sumsq,
                    &c->summed,  &c->send,       &c->recv,     &c->rows,  &c->grads,
                    &c->out,     &c->figures};
    buf_t *host[] = {&c->h_tokens, &c->h_grads, &c->h_out, &c->h_small};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
      cudaFree(dev[i]->p);
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++)
      cudaFreeHost(host[i]->p);
  }
  for (int i = 0; i < MAX_CHUNKS; i++)
    if (c->chunk_ready[i])
      cudaEventDestroy(c->chunk_ready[i]);
  if (c->tokens_in)
    cudaEventDestroy(c->tokens_in);
  if (c->grads_in)
    cudaEventDestroy(c->grads_in);
  if (c->h2d)
    cudaStreamDestroy(c->h2d);
  if (c->d2h)
    cudaStreamDestroy(c->d2h);
  embps_free(c);
}

/* ---- tables ------------------------------------------------------------------------------- */

static void release_device_arrays(embps_table_t *t) {
  cudaFree(t->data);
  cudaFree(t->state0);
  cudaFree(t->state1);
  t->data = t->state0 = t->state1 = NULL;
}

/* Fills n floats of device memory with v (there is no fill kernel: adagrad accumulators are
 * the only non-zero state, and they are written once per table). */
static embps_status_t fill_floats(embps__engine_cuda_t *c, float *dst, size_t n, float v,
                                  embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const size_t chunk = (size_t)1 << 20;
  float *h = NULL;
  if (v == 0.0f) {
    CUDA_CHECK_GOTO(cudaMemsetAsync(dst, 0, n * sizeof(float), c->stream), exit);
    return EMBPS_OK;
  }
  CUDA_CHECK_GOTO(cudaMallocHost((void **)&h, chunk * sizeof(float)), exit);
  for (size_t i = 0; i < chunk; i++)
    h[i] = v;
  for (size_t off = 0; off < n; off += chunk) {
    size_t k = n - off < chunk ? n - off : chunk;
    CUDA_CHECK_GOTO(
        cudaMemcpyAsync(dst + off, h, k * sizeof(float), cudaMemcpyHostToDevice, c->stream), exit);
  }
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit);
exit:
  cudaFreeHost(h);
  return ret;
}

/* Every rank learns the largest status any rank had (device buffers for the communicator). */
static embps_status_t agree(embps__engine_cuda_t *c, embps_status_t *local, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  uint64_t *h = c->h_small.p;
  h[0] = (uint64_t)*local;
  CUDA_CHECK_GOTO(
      cudaMemcpyAsync(c->figures.p, h, sizeof(uint64_t), cudaMemcpyHostToDevice, c->stream), exit);
  if ((ret = embps_comm_all_reduce(c->comm, c->figures.p, 1, EMBPS_COMM_U64, EMBPS_COMM_MAX,
                                   err)) != EMBPS_OK)
    goto exit;
  CUDA_CHECK_GOTO(
      cudaMemcpyAsync(h, c->figures.p, sizeof(uint64_t), cudaMemcpyDeviceToHost, c->stream), exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit);
  *local = (embps_status_t)h[0];
exit:
  return ret;
}

static embps_status_t run_create(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err) {
  const embps_table_config_t *cfg = &op->create;
  const embps_optimizer_info_t *info = embps_optimizer_info(cfg->optimizer);
  embps_table_t *t = NULL;
  embps_status_t local = EMBPS_OK, ret = EMBPS_OK;
  embps_error_t lerr;
  size_t elems;

  embps_error_clear(&lerr);
  if ((ret = reserve(c, EMBPS_OP_CREATE_TABLE, 1, 0, 0, 0, 0, 0, err)) != EMBPS_OK)
    return ret;
  if (embps_table_new_shell(&t, cfg, c->comm->rank, c->comm->size) != EMBPS_OK) {
    local = EMBPS_RESOURCE_EXHAUSTED;
  } else {
    t->on_device = 1;
    t->release_arrays = release_device_arrays;
    elems = (size_t)cfg->rows * t->shard_width;
    if (cudaMalloc(&t->data, elems * embps_dtype_size(cfg->dtype)) != cudaSuccess ||
        ((info->state_per_element >= 1 || info->state_per_row) &&
         cudaMalloc((void **)&t->state0, (info->state_per_row ? (size_t)cfg->rows : elems) *
                                             sizeof(float)) != cudaSuccess) ||
        (info->state_per_element >= 2 &&
         cudaMalloc((void **)&t->state1, elems * sizeof(float)) != cudaSuccess))
      local = EMBPS_RESOURCE_EXHAUSTED;
    else if (embps_init_rows_cuda(t->data, cfg->dtype, t->shard_width, 0, cfg->rows, t->col_begin,
                                  cfg->seed, cfg->init_scale, c->stream) != EMBPS_OK ||
             (t->state0 &&
              fill_floats(c, t->state0, info->state_per_row ? (size_t)cfg->rows : elems,
                          cfg->optimizer == EMBPS_OPT_ADAM ? 0.0f : cfg->initial_accumulator,
                          &lerr) != EMBPS_OK) ||
             (t->state1 &&
              cudaMemsetAsync(t->state1, 0, elems * sizeof(float), c->stream) != cudaSuccess) ||
             cudaStreamSynchronize(c->stream) != cudaSuccess)
      local = EMBPS_INTERNAL;
  }
  if ((ret = agree(c, &local, err)) != EMBPS_OK) {
    embps_table_free(t);
    return ret;
  }
  if (local != EMBPS_OK) {
    embps_table_free(t);
    embps_error_set(&op->error, local == EMBPS_RESOURCE_EXHAUSTED ? local : EMBPS_INTERNAL,
                    "%s allocating table '%s' (%llu bytes of GPU memory on each rank)",
                    local == EMBPS_RESOURCE_EXHAUSTED ? "out of GPU memory" : "CUDA failed",
                    cfg->name, (unsigned long long)embps_table_config_bytes(cfg, c->comm->size));
    return EMBPS_OK;
  }
  if (embps_store_add(c->store, t, &op->error) != EMBPS_OK) {
    embps_table_free(t);
    t = NULL;
  }
  /* The leader answers once every rank has registered the table (see engine.c). */
  if ((ret = embps_comm_barrier(c->comm, err)) != EMBPS_OK)
    return ret;
  op->created = t;
  return EMBPS_OK;
}

/* ---- batches -------------------------------------------------------------------------------- */

/* Enqueues the copy of `bytes` of a request (host memory) to the device on the h2d stream and
 * records `done` after it; memory that is not pinned is staged through `stage` first. */
static embps_status_t copy_in(embps__engine_cuda_t *c, void *dst, const void *src, size_t bytes,
                              buf_t *stage, cudaEvent_t done, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  if (bytes > 0) {
    if (!is_pinned(src)) {
      CUDA_CHECK_GOTO(hgrow(stage, bytes), exit);
      memcpy(stage->p, src, bytes);
      src = stage->p;
    }
    CUDA_CHECK_GOTO(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->h2d), exit);
  }
  CUDA_CHECK_GOTO(cudaEventRecord(done, c->h2d), exit);
exit:
  return ret;
}

/* After a failure part-way through a batch: waits until nothing enqueued for it can still
 * touch the request or reply, which the caller frees once the run returns. */
static void quiesce(embps__engine_cuda_t *c) {
  cudaStreamSynchronize(c->h2d);
  cudaStreamSynchronize(c->stream);
  cudaStreamSynchronize(c->d2h);
  cudaGetLastError();
}

static embps_status_t run_lookup(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = op->table;
  const uint32_t N = c->comm->size;
  const size_t n = op->num_tokens, T = n * N, w = t->shard_width, W = t->config.emb_width;
  const size_t ds = embps_dtype_size(t->config.dtype), block = n * w * ds, row_bytes = W * ds;
  const int direct = is_pinned(op->rows_out);
  size_t chunk_rows, k = 0;
  uint8_t *dst, *out;
  embps_status_t ret;
  uint32_t U;

  if ((ret = reserve(c, op->kind, N, T, n, w, W, ds, err)) != EMBPS_OK)
    return ret;
  if (!direct)
    CUDA_CHECK_GOTO(hgrow(&c->h_out, n * row_bytes), exit);
  dst = direct ? op->rows_out : c->h_out.p;
  out = c->out.p;
  STATUS_CHECK_GOTO(
      copy_in(c, c->tokens.p, op->tokens, n * sizeof(int64_t), &c->h_tokens, c->tokens_in, err),
      exit);
  CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->stream, c->tokens_in, 0), exit);
  atomic_fetch_add_explicit(&t->counters.lookups, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_looked_up, n, memory_order_relaxed);
  if (N > 1) {
    STATUS_CHECK_GOTO(
        embps_comm_all_gather(c->comm, c->tokens.p, n * sizeof(int64_t), c->all_tokens.p, err),
        exit);
    STATUS_CHECK_GOTO(embps_dedup_cuda(c->all_tokens.p, T, c->unique.p, c->seg.p, c->sorted_pos.p,
                                       c->seg_off.p, c->num_unique.p, c->dedup_ws.p,
                                       c->dedup_ws.cap, c->stream),
                      exit);
    CUDA_CHECK_GOTO(cudaMemcpyAsync(c->h_small.p, c->num_unique.p, sizeof(U),
                                    cudaMemcpyDeviceToHost, c->stream),
                    exit);
    CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit);
    memcpy(&U, c->h_small.p, sizeof(U));
    STATUS_CHECK_GOTO(
        embps_gather_cuda(t->data, t->config.dtype, w, c->unique.p, U, c->rows.p, c->stream), exit);
    STATUS_CHECK_GOTO(
        embps_expand_cuda(c->rows.p, t->config.dtype, w, c->seg.p, T, c->send.p, c->stream), exit);
    STATUS_CHECK_GOTO(embps_comm_all_to_all(c->comm, c->send.p, block, c->recv.p, err), exit);
  }
  /* The rows go back in chunks: chunk k's copy to the host overlaps the work of chunk k+1. */
  chunk_rows = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
  if (chunk_rows * row_bytes < CHUNK_MIN_BYTES)
    chunk_rows = (CHUNK_MIN_BYTES + row_bytes - 1) / row_bytes;
  for (size_t a = 0; a < n; a += chunk_rows, k++) {
    const size_t m = n - a < chunk_rows ? n - a : chunk_rows;
    if (N == 1) {
      STATUS_CHECK_GOTO(embps_gather_cuda(t->data, t->config.dtype, w, (int64_t *)c->tokens.p + a,
                                          m, out + a * row_bytes, c->stream),
                        exit);
    } else {
      /* recv block r holds columns [r*w, (r+1)*w) of this shard's n rows. */
      for (uint32_t r = 0; r < N; r++)
        CUDA_CHECK_GOTO(cudaMemcpy2DAsync(out + a * row_bytes + r * w * ds, row_bytes,
                                          (uint8_t *)c->recv.p + r * block + a * w * ds, w * ds,
                                          w * ds, m, cudaMemcpyDeviceToDevice, c->stream),
                        exit);
    }
    CUDA_CHECK_GOTO(cudaEventRecord(c->chunk_ready[k], c->stream), exit);
    CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->d2h, c->chunk_ready[k], 0), exit);
    CUDA_CHECK_GOTO(cudaMemcpyAsync(dst + a * row_bytes, out + a * row_bytes, m * row_bytes,
                                    cudaMemcpyDeviceToHost, c->d2h),
                    exit);
  }
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->d2h), exit);
  if (!direct)
    memcpy(op->rows_out, c->h_out.p, n * row_bytes);
exit:
  if (ret != EMBPS_OK)
    quiesce(c);
  return ret;
}

static embps_status_t run_push(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = op->table;
  const embps_table_config_t *cfg = &t->config;
  const uint32_t N = c->comm->size;
  const size_t n = op->num_tokens, T = n * N, w = t->shard_width, W = cfg->emb_width;
  const size_t ds = embps_dtype_size(cfg->dtype), block = n * w * ds;
  const void *tokens, *grads;
  uint64_t *small;
  uint32_t U;
  size_t first, m;
  int64_t *rows, unique0 = -1;
  float *g;
  double total;
  uint64_t nonfinite;
  embps_opt_params_t p;
  embps_status_t ret;

  if ((ret = reserve(c, op->kind, N, T, n, w, W, ds, err)) != EMBPS_OK)
    return ret;
  small = c->h_small.p;
  atomic_fetch_add_explicit(&t->counters.pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_pushed, n, memory_order_relaxed);
  /* The gradients (the bulk of the request) travel while the tokens are all-gathered and
   * deduplicated, which need only the tokens. */
  STATUS_CHECK_GOTO(
      copy_in(c, c->tokens.p, op->tokens, n * sizeof(int64_t), &c->h_tokens, c->tokens_in, err),
      exit);
  STATUS_CHECK_GOTO(copy_in(c, c->grads.p, op->grads, n * W * ds, &c->h_grads, c->grads_in, err),
                    exit);
  CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->stream, c->tokens_in, 0), exit);
  tokens = c->tokens.p;
  grads = c->grads.p;
  if (N > 1) {
    STATUS_CHECK_GOTO(
        embps_comm_all_gather(c->comm, c->tokens.p, n * sizeof(int64_t), c->all_tokens.p, err),
        exit);
    tokens = c->all_tokens.p;
  }
  STATUS_CHECK_GOTO(embps_dedup_cuda(tokens, T, c->unique.p, c->seg.p, c->sorted_pos.p,
                                     c->seg_off.p, c->num_unique.p, c->dedup_ws.p, c->dedup_ws.cap,
                                     c->stream),
                    exit);
  CUDA_CHECK_GOTO(cudaMemcpyAsync(&small[0], c->num_unique.p, sizeof(uint32_t),
                                  cudaMemcpyDeviceToHost, c->stream),
                  exit);
  if (T > 0)
    CUDA_CHECK_GOTO(
        cudaMemcpyAsync(&small[1], c->unique.p, sizeof(int64_t), cudaMemcpyDeviceToHost, c->stream),
        exit);
  CUDA_CHECK_GOTO(cudaStreamWaitEvent(c->stream, c->grads_in, 0), exit);
  if (N > 1) {
    /* Block s of the send buffer: columns [s*w, (s+1)*w) of this shard's n gradient rows. */
    for (uint32_t s = 0; s < N && n > 0; s++)
      CUDA_CHECK_GOTO(cudaMemcpy2DAsync((char *)c->send.p + s * block, w * ds,
                                        (const char *)c->grads.p + s * w * ds, W * ds, w * ds, n,
                                        cudaMemcpyDeviceToDevice, c->stream),
                      exit);
    STATUS_CHECK_GOTO(embps_comm_all_to_all(c->comm, c->send.p, block, c->recv.p, err), exit);
    grads = c->recv.p; /* T x w: every position's gradient for this rank's columns */
  }
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit); /* the count of unique tokens */
  memcpy(&U, &small[0], sizeof(U));
  if (U > 0)
    memcpy(&unique0, &small[1], sizeof(unique0));
  STATUS_CHECK_GOTO(embps_segment_sum_cuda(grads, cfg->dtype, w, c->sorted_pos.p, c->seg_off.p, U,
                                           c->summed.p, c->stream),
                    exit);
  /* Unique tokens are ascending, so the padding row, when present, is the first. */
  first = (U > 0 && unique0 == 0) ? 1 : 0;
  rows = (int64_t *)c->unique.p + first;
  m = U - first;
  g = (float *)c->summed.p + first * w;
  op->num_unique = m;

  /* figures[0] (f64): total sum of squares; figures[1] (u64): non-finite count. */
  CUDA_CHECK_GOTO(cudaMemsetAsync(c->figures.p, 0, 2 * sizeof(uint64_t), c->stream), exit);
  STATUS_CHECK_GOTO(embps_row_stats_cuda(g, m, w, c->row_sumsq.p, (double *)c->figures.p,
                                         (uint64_t *)c->figures.p + 1, c->rs_ws.p, c->stream),
                    exit);
  STATUS_CHECK_GOTO(
      embps_comm_all_reduce(c->comm, c->figures.p, 1, EMBPS_COMM_F64, EMBPS_COMM_SUM, err), exit);
  STATUS_CHECK_GOTO(embps_comm_all_reduce(c->comm, (uint64_t *)c->figures.p + 1, 1, EMBPS_COMM_U64,
                                          EMBPS_COMM_SUM, err),
                    exit);
  CUDA_CHECK_GOTO(
      cudaMemcpyAsync(small, c->figures.p, 2 * sizeof(uint64_t), cudaMemcpyDeviceToHost, c->stream),
      exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit);
  memcpy(&total, &small[0], sizeof(total));
  nonfinite = small[1];
  if (nonfinite != 0) { /* the gate: one non-finite gradient anywhere skips the step */
    op->skipped = 1;
    atomic_fetch_add_explicit(&t->counters.steps_skipped, 1, memory_order_relaxed);
    goto exit;
  }
  op->grad_norm = sqrt(total);
  if (cfg->weight_decay != 0.0f) {
    STATUS_CHECK_GOTO(embps_apply_weight_decay_cuda(t->data, cfg->dtype, w, rows, m, g,
                                                    cfg->weight_decay, c->stream),
                      exit);
    if (cfg->optimizer == EMBPS_OPT_ROWWISE_ADAGRAD)
      STATUS_CHECK_GOTO(embps_row_stats_cuda(g, m, w, c->row_sumsq.p, NULL, NULL, NULL, c->stream),
                        exit);
  }
  if (cfg->optimizer == EMBPS_OPT_ROWWISE_ADAGRAD && N > 1)
    STATUS_CHECK_GOTO(
        embps_comm_all_reduce(c->comm, c->row_sumsq.p, m, EMBPS_COMM_F32, EMBPS_COMM_SUM, err),
        exit);
  p = embps__engine_next_step(t);
  switch (cfg->optimizer) {
  case EMBPS_OPT_SGD:
    STATUS_CHECK_GOTO(embps_update_sgd_cuda(t->data, cfg->dtype, w, rows, m, g, &p, c->stream),
                      exit);
    break;
  case EMBPS_OPT_ADAGRAD:
    STATUS_CHECK_GOTO(
        embps_update_adagrad_cuda(t->data, cfg->dtype, w, rows, m, g, t->state0, &p, c->stream),
        exit);
    break;
  case EMBPS_OPT_ROWWISE_ADAGRAD:
    STATUS_CHECK_GOTO(embps_update_rowwise_adagrad_cuda(t->data, cfg->dtype, w, rows, m, g,
                                                        c->row_sumsq.p, W, t->state0, &p,
                                                        c->stream),
                      exit);
    break;
  case EMBPS_OPT_ADAM:
    STATUS_CHECK_GOTO(embps_update_adam_cuda(t->data, cfg->dtype, w, rows, m, g, t->state0,
                                             t->state1, &p, c->stream),
                      exit);
    break;
  }
  /* A sync push answers after the update is applied. */
  CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), exit);
  op->applied = 1;
  atomic_fetch_add_explicit(&t->counters.steps_applied, 1, memory_order_relaxed);
exit:
  if (ret != EMBPS_OK)
    quiesce(c);
  return ret;
}

embps_status_t embps__engine_cuda_run(embps__engine_cuda_t *c, embps_op_t *op, embps_error_t *err) {
  switch (op->kind) {
  case EMBPS_OP_CREATE_TABLE:
    return run_create(c, op, err);
  case EMBPS_OP_LOOKUP:
    return run_lookup(c, op, err);
  case EMBPS_OP_PUSH:
    return run_push(c, op, err);
  }
  return embps_error_set(err, EMBPS_INTERNAL, "unknown op kind %d", (int)op->kind);
}
