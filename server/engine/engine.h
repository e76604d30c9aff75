/* The engine: one thread that owns the tables' arrays (and, with a GPU, the device, its
 * streams and the communicator) and runs every operation that touches them, in the order the
 * loop thread submitted them. The loop thread never runs kernels: it submits ops through a
 * queue and gets them back, completed, through a uv_async_t (h2o's multithread queue). */
#ifndef EMBPS_ENGINE_H
#define EMBPS_ENGINE_H

#include <stdint.h>
#include <uv.h>

#include "common/status.h"
#include "server/store/store.h"

typedef enum embps_op_kind {
  EMBPS_OP_CREATE_TABLE, /* allocate and initialize op->table */
  EMBPS_OP_LOOKUP,       /* gather op->tokens' rows into op->rows_out */
  EMBPS_OP_PUSH,         /* apply op->grads for op->tokens with the table's optimizer */
} embps_op_kind_t;

typedef struct embps_op embps_op_t;

/**
 * One unit of work. The submitter owns the op and everything it points to; the engine reads the
 * inputs and writes the results between embps_engine_submit and the done callback, and the
 * submitter must not touch the op in between.
 */
struct embps_op {
  embps_op_kind_t kind;
  embps_table_t *table;
  const int64_t *tokens; /* validated: every token in [0, rows) */
  size_t num_tokens;
  const void *grads; /* push: num_tokens x emb_width of the table's dtype */
  void *rows_out;    /* lookup: num_tokens x emb_width of the table's dtype */

  /* Results, written by the engine. */
  embps_error_t error; /* status EMBPS_OK on success */
  int applied;         /* push: the update was applied */
  int skipped;         /* push: a non-finite gradient gated the step */
  double grad_norm;    /* push: L2 norm of the summed gradients of non-padding rows */
  uint64_t num_unique; /* push: distinct non-padding tokens */

  /** Called on the loop thread once the op is complete. */
  void (*done)(embps_op_t *op);
  void *user;
  uint64_t batch_tag; /* the submitter's own tag (logs and tests); the engine ignores it */
  embps_op_t *next;   /* the engine's queue link */
};

typedef struct embps_engine embps_engine_t;

/**
 * Starts the engine thread; completions are delivered on loop. On failure *out is untouched.
 * Returns EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED or EMBPS_INTERNAL (thread creation failed).
 */
embps_status_t embps_engine_new(embps_engine_t **out, uv_loop_t *loop);

/** Queues op (loop thread). Ops run one after another in submission order. */
void embps_engine_submit(embps_engine_t *engine, embps_op_t *op);

/** Ops submitted and not yet completed. */
uint64_t embps_engine_pending(const embps_engine_t *engine);

/** The backend's name ("cpu"). */
const char *embps_engine_backend(const embps_engine_t *engine);

/**
 * Finishes queued ops (their done callbacks still run on the loop), stops the thread and
 * closes the async handle; call embps_engine_free after the loop has run once more.
 */
void embps_engine_close(embps_engine_t *engine);

/** Frees the engine after embps_engine_close and a turn of the loop. NULL is a no-op. */
void embps_engine_free(embps_engine_t *engine);

/**
 * Runs one op on the calling thread (the engine thread's body, exposed for unit tests).
 * scratch must come from embps_engine_scratch_new and be used by one thread at a time.
 */
typedef struct embps_engine_scratch embps_engine_scratch_t;
embps_status_t embps_engine_scratch_new(embps_engine_scratch_t **out);
void embps_engine_scratch_free(embps_engine_scratch_t *scratch);
void embps_engine_run_op(embps_engine_scratch_t *scratch, embps_op_t *op);

#endif
