/* The engine thread and the operations it runs.
 *
 * Threads meet only through two queues: `incoming` (loop -> engine, a mutex and a condition
 * variable) and `completed` (engine -> loop, a mutex and a uv_async_t). The engine drains the
 * whole incoming queue at once and posts each op back as soon as it is done, so a sync push's
 * reply does not wait for the ops queued behind it.
 *
 * A push follows DESIGN.md's route on one rank: dedup the tokens, sum the gradients of
 * duplicate tokens (in position order, so the result is bitwise reproducible), drop the padding
 * row, take the row figures (sum of squares, finite check), gate the whole step on finiteness,
 * add weight decay, and run the optimizer's fused update. A lookup of a single rank gathers
 * rows straight into the reply buffer: there is no exchange to shrink, so dedup would only add
 * a pass over the batch. */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"

struct embps_engine_scratch {
  size_t cap_tokens; /* tokens the arrays below hold */
  size_t cap_elems;  /* floats `summed` holds */
  int64_t *unique;
  uint32_t *segment_ids;
  void *dedup_ws;
  float *row_sumsq;
  float *summed;
};

struct embps_engine {
  uv_loop_t *loop;
  uv_async_t async;
  pthread_t thread;
  int thread_started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  embps_op_t *in_head, *in_tail;     /* guarded by mu */
  embps_op_t *done_head, *done_tail; /* guarded by mu */
  int stopping;                      /* guarded by mu */
  atomic_uint_fast64_t pending;
  embps_engine_scratch_t *scratch; /* engine thread only */
};

/* ---- scratch ------------------------------------------------------------------------------ */

embps_status_t embps_engine_scratch_new(embps_engine_scratch_t **out) {
  embps_engine_scratch_t *s = embps_calloc(1, sizeof(*s));
  if (!s)
    return EMBPS_RESOURCE_EXHAUSTED;
  *out = s;
  return EMBPS_OK;
}

void embps_engine_scratch_free(embps_engine_scratch_t *s) {
  if (!s)
    return;
  embps_free(s->unique);
  embps_free(s->segment_ids);
  embps_free(s->dedup_ws);
  embps_free(s->row_sumsq);
  embps_free(s->summed);
  embps_free(s);
}

/* Grows the scratch arrays to n tokens of width floats; they only grow, since batch sizes
 * repeat from step to step. */
static embps_status_t scratch_reserve(embps_engine_scratch_t *s, size_t n, size_t width) {
  size_t elems = n * width;
  if (n > s->cap_tokens) {
    int64_t *unique = embps_aligned_alloc(n * sizeof(*unique));
    uint32_t *seg = embps_aligned_alloc(n * sizeof(*seg));
    void *ws = embps_aligned_alloc(embps_dedup_workspace_bytes(n));
    float *rs = embps_aligned_alloc(n * sizeof(*rs));
    if (!unique || !seg || !ws || !rs) {
      embps_free(unique);
      embps_free(seg);
      embps_free(ws);
      embps_free(rs);
      return EMBPS_RESOURCE_EXHAUSTED;
    }
    embps_free(s->unique);
    embps_free(s->segment_ids);
    embps_free(s->dedup_ws);
    embps_free(s->row_sumsq);
    s->unique = unique;
    s->segment_ids = seg;
    s->dedup_ws = ws;
    s->row_sumsq = rs;
    s->cap_tokens = n;
  }
  if (elems > s->cap_elems) {
    float *summed = embps_aligned_alloc(elems * sizeof(float));
    if (!summed)
      return EMBPS_RESOURCE_EXHAUSTED;
    embps_free(s->summed);
    s->summed = summed;
    s->cap_elems = elems;
  }
  return EMBPS_OK;
}

/* ---- operations --------------------------------------------------------------------------- */

static void run_lookup(embps_op_t *op) {
  embps_table_t *t = op->table;
  embps_gather_cpu(t->data, t->config.dtype, t->shard_width, op->tokens, op->num_tokens,
                   op->rows_out);
  atomic_fetch_add_explicit(&t->counters.lookups, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_looked_up, op->num_tokens, memory_order_relaxed);
}

static void run_push(embps_engine_scratch_t *s, embps_op_t *op) {
  embps_table_t *t = op->table;
  const embps_table_config_t *c = &t->config;
  size_t width = t->shard_width, num_unique, first, m;
  const int64_t *rows;
  float *g;
  double total = 0.0;
  embps_opt_params_t p;

  if (scratch_reserve(s, op->num_tokens, width) != EMBPS_OK) {
    embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                    "out of memory for a push of %zu tokens", op->num_tokens);
    return;
  }
  atomic_fetch_add_explicit(&t->counters.pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&t->counters.rows_pushed, op->num_tokens, memory_order_relaxed);

  num_unique = embps_dedup_cpu(op->tokens, op->num_tokens, s->unique, s->segment_ids,
                               s->dedup_ws);
  embps_segment_sum_cpu(op->grads, c->dtype, width, s->segment_ids, op->num_tokens, num_unique,
                        s->summed);
  /* Unique tokens are ascending, so the padding row, when present, is the first. */
  first = (num_unique > 0 && s->unique[0] == 0) ? 1 : 0;
  rows = s->unique + first;
  m = num_unique - first;
  g = s->summed + first * width;
  op->num_unique = m;

  if (embps_row_stats_cpu(g, m, width, s->row_sumsq, &total) != 0) {
    op->skipped = 1;
    atomic_fetch_add_explicit(&t->counters.steps_skipped, 1, memory_order_relaxed);
    return;
  }
  op->grad_norm = sqrt(total);
  if (c->weight_decay != 0.0f) {
    embps_apply_weight_decay_cpu(t->data, c->dtype, width, rows, m, g, c->weight_decay);
    if (c->optimizer == EMBPS_OPT_ROWWISE_ADAGRAD)
      embps_row_stats_cpu(g, m, width, s->row_sumsq, NULL);
  }

  memset(&p, 0, sizeof(p));
  p.lr = c->lr;
  p.eps = c->eps;
  p.decay = embps_opt_decay_from_half_life(c->half_life);
  p.beta1 = c->beta1;
  p.beta2 = c->beta2;
  p.step = ++t->step;
  switch (c->optimizer) {
  case EMBPS_OPT_SGD:
    embps_update_sgd_cpu(t->data, c->dtype, width, rows, m, g, &p);
    break;
  case EMBPS_OPT_ADAGRAD:
    embps_update_adagrad_cpu(t->data, c->dtype, width, rows, m, g, t->state0, &p);
    break;
  case EMBPS_OPT_ROWWISE_ADAGRAD:
    embps_update_rowwise_adagrad_cpu(t->data, c->dtype, width, rows, m, g, s->row_sumsq,
                                     c->emb_width, t->state0, &p);
    break;
  case EMBPS_OPT_ADAM:
    embps_update_adam_cpu(t->data, c->dtype, width, rows, m, g, t->state0, t->state1, &p);
    break;
  }
  op->applied = 1;
  atomic_fetch_add_explicit(&t->counters.steps_applied, 1, memory_order_relaxed);
}

void embps_engine_run_op(embps_engine_scratch_t *s, embps_op_t *op) {
  embps_error_clear(&op->error);
  op->applied = op->skipped = 0;
  op->grad_norm = 0.0;
  op->num_unique = 0;

  if (op->kind == EMBPS_OP_CREATE_TABLE) {
    if (embps_table_allocate(op->table) != EMBPS_OK)
      embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                      "out of memory allocating table '%s' (%llu bytes)",
                      op->table->config.name, (unsigned long long)op->table->bytes);
    return;
  }
  if (op->table->alloc_status != EMBPS_OK) {
    embps_error_set(&op->error, EMBPS_UNAVAILABLE, "table '%s' could not be allocated",
                    op->table->config.name);
    return;
  }
  if (op->kind == EMBPS_OP_LOOKUP)
    run_lookup(op);
  else
    run_push(s, op);
}

/* ---- the thread and the queues ------------------------------------------------------------ */

static void *engine_main(void *arg) {
  embps_engine_t *e = arg;
  for (;;) {
    embps_op_t *batch;
    pthread_mutex_lock(&e->mu);
    while (!e->in_head && !e->stopping)
      pthread_cond_wait(&e->cv, &e->mu);
    batch = e->in_head;
    e->in_head = e->in_tail = NULL;
    if (!batch && e->stopping) {
      pthread_mutex_unlock(&e->mu);
      return NULL;
    }
    pthread_mutex_unlock(&e->mu);

    while (batch) {
      embps_op_t *op = batch;
      batch = op->next;
      op->next = NULL;
      embps_engine_run_op(e->scratch, op);
      pthread_mutex_lock(&e->mu);
      if (e->done_tail)
        e->done_tail->next = op;
      else
        e->done_head = op;
      e->done_tail = op;
      pthread_mutex_unlock(&e->mu);
      uv_async_send(&e->async);
    }
  }
}

static void on_completed(uv_async_t *handle) {
  embps_engine_t *e = handle->data;
  embps_op_t *op;
  pthread_mutex_lock(&e->mu);
  op = e->done_head;
  e->done_head = e->done_tail = NULL;
  pthread_mutex_unlock(&e->mu);
  while (op) {
    embps_op_t *next = op->next;
    op->next = NULL;
    atomic_fetch_sub_explicit(&e->pending, 1, memory_order_relaxed);
    op->done(op);
    op = next;
  }
}

embps_status_t embps_engine_new(embps_engine_t **out, uv_loop_t *loop) {
  embps_status_t ret = EMBPS_OK;
  embps_engine_t *e = embps_calloc(1, sizeof(*e));

  EMBPS_CHECK_GOTO(e != NULL, EMBPS_RESOURCE_EXHAUSTED, fail, "out of memory");
  e->loop = loop;
  EMBPS_CHECK_GOTO(embps_engine_scratch_new(&e->scratch) == EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED,
                   fail_scratch, "out of memory");
  EMBPS_CHECK_GOTO(pthread_mutex_init(&e->mu, NULL) == 0, EMBPS_INTERNAL, fail_mutex,
                   "pthread_mutex_init failed");
  EMBPS_CHECK_GOTO(pthread_cond_init(&e->cv, NULL) == 0, EMBPS_INTERNAL, fail_cond,
                   "pthread_cond_init failed");
  EMBPS_UV_CHECK_GOTO(uv_async_init(loop, &e->async, on_completed), fail_async);
  e->async.data = e;
  EMBPS_CHECK_GOTO(pthread_create(&e->thread, NULL, engine_main, e) == 0, EMBPS_INTERNAL,
                   fail_thread, "pthread_create failed");
  e->thread_started = 1;
  *out = e;
  return EMBPS_OK;

fail_thread:
  /* The async handle is registered with the loop; closing it needs a loop turn, and this
   * failure ends the process, so it is left to the process exit. */
  ret = EMBPS_INTERNAL;
  return ret;
fail_async:
  pthread_cond_destroy(&e->cv);
fail_cond:
  pthread_mutex_destroy(&e->mu);
fail_mutex:
  embps_engine_scratch_free(e->scratch);
fail_scratch:
  embps_free(e);
fail:
  return ret == EMBPS_OK ? EMBPS_INTERNAL : ret;
}

void embps_engine_submit(embps_engine_t *e, embps_op_t *op) {
  op->next = NULL;
  atomic_fetch_add_explicit(&e->pending, 1, memory_order_relaxed);
  pthread_mutex_lock(&e->mu);
  if (e->in_tail)
    e->in_tail->next = op;
  else
    e->in_head = op;
  e->in_tail = op;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

uint64_t embps_engine_pending(const embps_engine_t *e) {
  return atomic_load_explicit(&((embps_engine_t *)e)->pending, memory_order_relaxed);
}

const char *embps_engine_backend(const embps_engine_t *e) {
  (void)e;
  return "cpu";
}

void embps_engine_close(embps_engine_t *e) {
  if (!e || !e->thread_started)
    return;
  pthread_mutex_lock(&e->mu);
  e->stopping = 1;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  pthread_join(e->thread, NULL);
  e->thread_started = 0;
  on_completed(&e->async); /* deliver what finished before the join */
  uv_close((uv_handle_t *)&e->async, NULL);
}

void embps_engine_free(embps_engine_t *e) {
  if (!e)
    return;
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
  embps_engine_scratch_free(e->scratch);
  embps_free(e);
}
