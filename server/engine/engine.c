/* Batch execution on one rank (see engine.h for the data flow).
 *
 * Layout conventions: a batch of T tokens over N ranks has n = T/N tokens per shard and the
 * table's W columns split into slices of w = W/N. After the tokens' all-gather, position p of
 * the batch belongs to shard p / n. Every all-to-all block is n x w elements, so every rank
 * pair exchanges the same number of bytes, and each rank moves exactly the bytes the column
 * split requires: (N-1)/N of its shard's rows.
 *
 * Determinism: duplicates are summed in position order whatever N is, and row figures are
 * combined by all-reduces that reduce in rank order, so every rank applies bitwise the same
 * decision and an N-rank table matches the 1-rank table to rounding of the row sums.
 *
 * A group of one takes a shorter route: a lookup gathers straight into the reply buffer
 * (without dedup, which saves nothing without an exchange) and a push reads the request's
 * gradients in place. */
#include "engine.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/engine/engine_cuda.h"

typedef struct scratch {
  size_t cap_tokens, cap_elems, cap_bytes;
  int64_t *all_tokens, *unique;
  uint32_t *segment_ids;
  void *dedup_ws;
  float *row_sumsq, *summed;
  uint8_t *send, *recv, *rows;
} scratch_t;

struct embps_engine {
  embps_comm_t *comm;
  embps_store_t *store;
  embps_backend_t backend;
  embps__engine_cuda_t *cuda; /* the CUDA backend's state */
  scratch_t s;
};

const char *embps_backend_name(embps_backend_t backend) {
  return backend == EMBPS_BACKEND_CUDA ? "cuda" : "cpu";
}

embps_status_t embps_engine_new(embps_engine_t **out, embps_comm_t *comm, embps_store_t *store,
                                embps_backend_t backend, void *stream) {
  embps_engine_t *e = embps_calloc(1, sizeof(*e));
  embps_status_t ret;
  if (!e)
    return EMBPS_RESOURCE_EXHAUSTED;
  e->comm = comm;
  e->store = store;
  e->backend = backend;
  if (backend == EMBPS_BACKEND_CUDA &&
      (ret = embps__engine_cuda_new(&e->cuda, comm, store, stream)) != EMBPS_OK) {
    embps_free(e);
    return ret;
  }
  *out = e;
  return EMBPS_OK;
}

void embps_engine_free(embps_engine_t *e) {
  if (!e)
    return;
  embps__engine_cuda_free(e->cuda);
  embps_free(e->s.all_tokens);
  embps_free(e->s.unique);
  embps_free(e->s.segment_ids);
  embps_free(e->s.dedup_ws);
  embps_free(e->s.row_sumsq);
  embps_free(e->s.summed);
  embps_free(e->s.send);
  embps_free(e->s.recv);
  embps_free(e->s.rows);
  embps_free(e);
}

embps_backend_t embps_engine_backend(const embps_engine_t *e) { return e->backend; }

void *embps_host_alloc(int device, size_t bytes, int *pinned) {
  static atomic_int warned;
  void *p;
  if (device >= 0) {
    if ((p = embps__cuda_host_alloc(device, bytes)) != NULL) {
      *pinned = 1;
      return p;
    }
    if (!atomic_exchange(&warned, 1))
      EMBPS_WARN("cannot pin %zu bytes of host memory for device %d; using pageable buffers, "
                 "which the engine stages through its own pinned copies",
                 bytes, device);
  }
  *pinned = 0;
  return embps_aligned_alloc(bytes);
}

void embps_host_free(void *p, int pinned) {
  if (pinned)
    embps__cuda_host_free(p);
  else
    embps_free(p);
}

/* Scratch for T tokens, T*width f32 sums and `bytes` of exchange buffers. Arrays only grow,
 * since batch sizes repeat from step to step; after a failed growth every array of that group
 * is released and its capacity is zero, so the next call tries again from scratch. */
static embps_status_t reserve(scratch_t *s, size_t T, size_t width, size_t bytes) {
  if (T > s->cap_tokens) {
    embps_free(s->all_tokens);
    embps_free(s->unique);
    embps_free(s->segment_ids);
    embps_free(s->dedup_ws);
    embps_free(s->row_sumsq);
    s->all_tokens = embps_aligned_alloc(T * sizeof(int64_t));
    s->unique = embps_aligned_alloc(T * sizeof(int64_t));
    s->segment_ids = embps_aligned_alloc(T * sizeof(uint32_t));
    s->dedup_ws = embps_aligned_alloc(embps_dedup_workspace_bytes(T));
    s->row_sumsq = embps_aligned_alloc(T * sizeof(float));
    s->cap_tokens = T;
    if (!s->all_tokens || !s->unique || !s->segment_ids || !s->dedup_ws || !s->row_sumsq) {
      s->cap_tokens = 0;
      return EMBPS_RESOURCE_EXHAUSTED;
    }
  }
  if (T * width > s->cap_elems) {
    embps_free(s->summed);
    s->summed = embps_aligned_alloc(T * width * sizeof(float));
    s->cap_elems = s->summed ? T * width : 0;
    if (!s->summed)
      return EMBPS_RESOURCE_EXHAUSTED;
  }
  if (bytes > s->cap_bytes) {
    embps_free(s->send);
    embps_free(s->recv);
    embps_free(s->rows);
    s->send = embps_aligned_alloc(bytes);
    s->recv = embps_aligned_alloc(bytes);
    s->rows = embps_aligned_alloc(bytes);
    s->cap_bytes = bytes;
    if (!s->send || !s->recv || !s->rows) {
      s->cap_bytes = 0;
      return EMBPS_RESOURCE_EXHAUSTED;
    }
  }
  return EMBPS_OK;
}

/* Every rank learns whether every rank succeeded: the max of the ranks' statuses. A failure
 * of the exchange itself is returned (the group is then broken). */
static embps_status_t agree(embps_engine_t *e, embps_status_t *local, embps_error_t *err) {
  uint64_t v = (uint64_t)*local;
  embps_status_t ret = embps_comm_all_reduce(e->comm, &v, 1, EMBPS_COMM_U64, EMBPS_COMM_MAX, err);
  if (ret == EMBPS_OK)
    *local = (embps_status_t)v;
  return ret;
}

static embps_status_t run_create(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = NULL;
  embps_status_t local, ret;

  local = embps_table_new(&t, &op->create, e->comm->rank, e->comm->size);
  if ((ret = agree(e, &local, err)) != EMBPS_OK) {
    embps_table_free(t);
    return ret;
  }
  if (local != EMBPS_OK) {
    embps_table_free(t);
    embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                    "out of memory allocating table '%s' (%llu bytes on each rank)",
                    op->create.name,
                    (unsigned long long)embps_table_config_bytes(&op->create, e->comm->size));
    return EMBPS_OK;
  }
  if (embps_store_add(e->store, t, &op->error) != EMBPS_OK) {
    embps_table_free(t);
    t = NULL;
  }
  /* The leader answers the client once every rank has registered the table, so that a lookup
   * sent to any rank right after the answer finds it. */
  if ((ret = embps_comm_barrier(e->comm, err)) != EMBPS_OK)
    return ret;
  op->created = t;
  return EMBPS_OK;
}

static embps_status_t run_lookup(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = op->table;
  const uint32_t N = e->comm->size;
  const size_t n = op->num_tokens, T = n * N, w = t->shard_width, W = t->config.emb_width;
  const size_t ds = embps_dtype_size(t->config.dtype), block = n * w * ds;
  size_t U;
  embps_status_t ret;

  atomic_fetch_add_explicit(&t->counters.lookups, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_looked_up, n, memory_order_relaxed);
  if (N == 1) {
    embps_gather_cpu(t->data, t->config.dtype, w, op->tokens, n, op->rows_out);
    return EMBPS_OK;
  }
  if (reserve(&e->s, T, 0, T * w * ds) != EMBPS_OK) {
    /* Every rank needs the same memory; the first failure breaks the group rather than leave
     * ranks out of step. Scratch only grows, so this happens once, at the largest batch. */
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for the scratch of a %zu-token lookup", T);
  }
  if ((ret = embps_comm_all_gather(e->comm, op->tokens, n * sizeof(int64_t), e->s.all_tokens,
                                   err)) != EMBPS_OK)
    return ret;
  U = embps_dedup_cpu(e->s.all_tokens, T, e->s.unique, e->s.segment_ids, e->s.dedup_ws);
  embps_gather_cpu(t->data, t->config.dtype, w, e->s.unique, U, e->s.rows);
  embps_expand_cpu(e->s.rows, t->config.dtype, w, e->s.segment_ids, T, e->s.send);
  if ((ret = embps_comm_all_to_all(e->comm, e->s.send, block, e->s.recv, err)) != EMBPS_OK)
    return ret;
  /* recv block r holds columns [r*w, (r+1)*w) of this shard's n rows. */
  for (uint32_t r = 0; r < N; r++)
    for (size_t i = 0; i < n; i++)
      memcpy((uint8_t *)op->rows_out + (i * W + r * w) * ds, e->s.recv + r * block + i * w * ds,
             w * ds);
  return EMBPS_OK;
}

embps_opt_params_t embps__engine_next_step(embps_table_t *t) {
  const embps_table_config_t *c = &t->config;
  embps_opt_params_t p;
  memset(&p, 0, sizeof(p));
  p.lr = c->lr;
  p.eps = c->eps;
  p.decay = embps_opt_decay_from_half_life(c->half_life);
  p.beta1 = c->beta1;
  p.beta2 = c->beta2;
  p.step = ++t->step;
  return p;
}

static embps_status_t run_push(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = op->table;
  const embps_table_config_t *c = &t->config;
  const uint32_t N = e->comm->size;
  const size_t n = op->num_tokens, T = n * N, w = t->shard_width, W = c->emb_width;
  const size_t ds = embps_dtype_size(c->dtype), block = n * w * ds;
  const int64_t *tokens = op->tokens;
  const void *grads = op->grads;
  size_t U, first, m;
  const int64_t *rows;
  float *g;
  double figures[2] = {0.0, 0.0}; /* total sum of squares, non-finite count */
  embps_opt_params_t p;
  embps_status_t ret;

  if (reserve(&e->s, T, w, N > 1 ? T * w * ds : 0) != EMBPS_OK) {
    if (N == 1) {
      embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                      "out of memory for a push of %zu tokens", T);
      return EMBPS_OK;
    }
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for the scratch of a %zu-token push", T);
  }
  atomic_fetch_add_explicit(&t->counters.pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_pushed, n, memory_order_relaxed);
  if (N > 1) {
    if ((ret = embps_comm_all_gather(e->comm, op->tokens, n * sizeof(int64_t), e->s.all_tokens,
                                     err)) != EMBPS_OK)
      return ret;
    /* Block s of the send buffer: columns [s*w, (s+1)*w) of this shard's n gradient rows. */
    for (uint32_t s = 0; s < N; s++)
      for (size_t i = 0; i < n; i++)
        memcpy(e->s.send + s * block + i * w * ds,
               (const uint8_t *)op->grads + (i * W + s * w) * ds, w * ds);
    if ((ret = embps_comm_all_to_all(e->comm, e->s.send, block, e->s.recv, err)) != EMBPS_OK)
      return ret;
    tokens = e->s.all_tokens;
    grads = e->s.recv; /* T x w: every position's gradient for this rank's columns */
  }

  U = embps_dedup_cpu(tokens, T, e->s.unique, e->s.segment_ids, e->s.dedup_ws);
  embps_segment_sum_cpu(grads, c->dtype, w, e->s.segment_ids, T, U, e->s.summed);
  /* Unique tokens are ascending, so the padding row, when present, is the first. */
  first = (U > 0 && e->s.unique[0] == 0) ? 1 : 0;
  rows = e->s.unique + first;
  m = U - first;
  g = e->s.summed + first * w;
  op->num_unique = m;

  figures[1] = (double)embps_row_stats_cpu(g, m, w, e->s.row_sumsq, &figures[0]);
  if ((ret = embps_comm_all_reduce(e->comm, figures, 2, EMBPS_COMM_F64, EMBPS_COMM_SUM, err)) !=
      EMBPS_OK)
    return ret;
  if (figures[1] != 0.0) { /* the gate: one non-finite gradient anywhere skips the step */
    op->skipped = 1;
    atomic_fetch_add_explicit(&t->counters.steps_skipped, 1, memory_order_relaxed);
    return EMBPS_OK;
  }
  op->grad_norm = sqrt(figures[0]);
  if (c->weight_decay != 0.0f) {
    embps_apply_weight_decay_cpu(t->data, c->dtype, w, rows, m, g, c->weight_decay);
    if (c->optimizer == EMBPS_OPT_ROWWISE_ADAGRAD)
      embps_row_stats_cpu(g, m, w, e->s.row_sumsq, NULL);
  }
  if (c->optimizer == EMBPS_OPT_ROWWISE_ADAGRAD && N > 1 &&
      (ret = embps_comm_all_reduce(e->comm, e->s.row_sumsq, m, EMBPS_COMM_F32, EMBPS_COMM_SUM,
                                   err)) != EMBPS_OK)
    return ret;

  p = embps__engine_next_step(t);
  switch (c->optimizer) {
  case EMBPS_OPT_SGD:
    embps_update_sgd_cpu(t->data, c->dtype, w, rows, m, g, &p);
    break;
  case EMBPS_OPT_ADAGRAD:
    embps_update_adagrad_cpu(t->data, c->dtype, w, rows, m, g, t->state0, &p);
    break;
  case EMBPS_OPT_ROWWISE_ADAGRAD:
    embps_update_rowwise_adagrad_cpu(t->data, c->dtype, w, rows, m, g, e->s.row_sumsq, W, t->state0,
                                     &p);
    break;
  case EMBPS_OPT_ADAM:
    embps_update_adam_cpu(t->data, c->dtype, w, rows, m, g, t->state0, t->state1, &p);
    break;
  }
  op->applied = 1;
  atomic_fetch_add_explicit(&t->counters.steps_applied, 1, memory_order_relaxed);
  return EMBPS_OK;
}

embps_status_t embps_engine_run(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps_error_clear(&op->error);
  op->applied = op->skipped = 0;
  op->grad_norm = 0.0;
  op->num_unique = 0;
  if (e->backend == EMBPS_BACKEND_CUDA)
    return embps__engine_cuda_run(e->cuda, op, err);
  switch (op->kind) {
  case EMBPS_OP_CREATE_TABLE:
    return run_create(e, op, err);
  case EMBPS_OP_LOOKUP:
    return run_lookup(e, op, err);
  case EMBPS_OP_PUSH:
    return run_push(e, op, err);
  }
  return embps_error_set(err, EMBPS_INTERNAL, "unknown op kind %d", (int)op->kind);
}
