/* The engine: runs one batch of a round on this rank, DESIGN.md's data flow. A lookup
 * all-gathers the batch's tokens, dedups them, gathers this rank's column slice of the unique
 * rows and hands every rank its tokens' slices with one all-to-all; a push moves gradient
 * column slices the other way, sums duplicates, combines the row figures (finite check, norm,
 * rowwise mean square) from every rank's column-block partials in column order, so that every
 * rank takes the same decision whatever the group's size, and runs the optimizer's fused update
 * on its slice. CreateTable allocates this rank's slices and agrees with the group that every
 * rank could. The steps are written once (engine.c) over each backend's operations.
 *
 * The engine has no thread of its own: the group's thread (server/group) calls it, in round
 * order, and owns the communicator; each backend keeps its own scratch. */
#ifndef EMBPS_ENGINE_H
#define EMBPS_ENGINE_H

#include <stdatomic.h>
#include <stdint.h>

#include "common/backend.h"
#include "embps/pooling.h"
#include "common/op_kind.h"
#include "common/status.h"
#include "server/comm/comm.h"
#include "server/store/store.h"

typedef struct embps_op embps_op_t;

/* How a feature's bags become rows: embps_pooling_t, declared once for the client library and
 * the server in <embps/pooling.h> (the wire's Pooling values). */

/** One feature of a feature batch, as this rank's shard holds it (validated by the service:
 * lengths add up to num_ids, weights only for weighted sum, the sizes of grads and rows_out).
 * A bag is one sample's ids; id 0 contributes nothing to a pooled row. */
typedef struct embps_feature {
  embps_table_t *table;
  embps_pooling_t pooling;
  const int64_t *ids; /* num_ids: the shard's bags, bag after bag */
  size_t num_ids;
  const uint32_t *lengths; /* op->num_samples: each bag's ids */
  const float *weights;    /* num_ids, weighted sum only; else NULL */
  const void *grads;       /* push: pooled, num_samples x emb_width f32; none, num_ids x emb_width
                              of the table's dtype */
  void *rows_out;          /* lookup: the same shapes as grads */
} embps_feature_t;

/** One table's optimizer step in a feature batch's push. */
typedef struct embps_table_step {
  embps_table_t *table;
  int applied, skipped;
  double grad_norm;
  uint64_t num_unique;
} embps_table_step_t;

/**
 * What one round entry computes on this rank: one rank's shard of a batch, or a table to create
 * or drop; its inputs and, once embps_engine_run returns, its results. Nothing here is about how
 * the op travels: the group wraps it in its envelope (server/group/group.h), which names the
 * batch, queues it and answers it. The caller owns the op and everything it points to.
 */
struct embps_op {
  embps_op_kind_t kind;        /* LOOKUP, PUSH, ASSIGN, CREATE_TABLE or DROP_TABLE
                                  (common/op_kind.h) */
  embps_table_t *table;        /* lookup, push, assign: validated, registered table (a batch whose
                                  table is dropped before it runs fails with NOT_FOUND);
                                  drop: set to the table dropped */
  embps_table_config_t create; /* create: the resolved config; drop: name alone */
  int create_blank;            /* create: skip the initializer; the caller (a restore) writes
                                  every byte of the arrays before the table is used */
  const int64_t *tokens;       /* this rank's shard, validated: every token in [0, rows) */
  size_t num_tokens;           /* the batch's tokens_per_batch / group_size */
  const void *grads;           /* push: num_tokens x emb_width of the table's dtype */
  void *rows_out;              /* lookup: num_tokens x emb_width of the table's dtype */
  const void *rows_in;         /* assign: num_tokens x emb_width of the table's dtype, the rows
                                  the tokens' rows become (the last one for a repeated token) */
  int reset_state;             /* assign: the rows' optimizer state goes back to its initial
                                  value too (else it stays; a key given a new slot starts from
                                  the initial state whatever this says) */
  /* A feature batch (LookupFeatures, PushFeatures) when num_features > 0: then table is its
   * first feature's, and tokens, num_tokens, grads and rows_out are unused. */
  const embps_feature_t *features;
  size_t num_features;
  size_t num_samples;        /* this rank's samples (the batch's over group_size) */
  embps_table_step_t *steps; /* push: room for num_features; filled with num_steps, one per
                                table in the order the features first name it */
  size_t num_steps;

  /* Results. */
  embps_error_t error;    /* status EMBPS_OK on success */
  int applied;            /* push: the update was applied */
  int skipped;            /* push: a non-finite gradient gated the step */
  double grad_norm;       /* push: L2 norm of the summed gradients of non-padding rows */
  uint64_t num_unique;    /* push: distinct non-padding tokens in the batch; assign: those
                             whose rows were written */
  uint64_t num_refused;   /* assign, hash-keyed: distinct keys given no slot (every slot was
                             held by a key of the batch) */
  embps_table_t *created; /* create: the registered table */

  /** Lookup: the rows of rows_out [0, rows_ready) are final; the engine stores it (release)
   * after each chunk, a reader loads it (acquire). */
  atomic_size_t rows_ready;
  /** Lookup, when not NULL: called on the engine's thread each time rows_ready grew, with
   * publish_arg, so that whoever runs the op can let the rows leave while the engine fills the
   * rest. A backend that copies its rows out asynchronously (CUDA) publishes none. */
  void (*publish)(embps_op_t *op, void *publish_arg);
  void *publish_arg;
};

typedef struct embps_engine embps_engine_t;

/**
 * An engine for this rank. comm is borrowed (its rank and size are the group's; for the CUDA
 * backend it must take device buffers); store is borrowed and must outlive the engine. For
 * EMBPS_BACKEND_CUDA, `stream` is the cudaStream_t every kernel and copy is issued on, and the
 * calling thread's current device is the engine's. Returns EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED,
 * or EMBPS_UNIMPLEMENTED for CUDA in a build without it.
 */
embps_status_t embps_engine_new(embps_engine_t **out, embps_comm_t *comm, embps_store_t *store,
                                embps_backend_t backend, void *stream);
void embps_engine_free(embps_engine_t *engine);

/**
 * The host threads that run a push's per-row kernels (the segment sum with the row statistics,
 * the optimizer update) on the cpu backend, the engine's own thread included: the rows are
 * split into contiguous shares and every row's arithmetic stays on one thread, so the tables
 * get the same bits with any number. The cuda backend runs its kernels on the GPU and ignores
 * this. Call between ops (not during embps_engine_run). Returns the threads the engine now
 * uses (1 on cuda, or when no helper thread could start).
 */
unsigned embps_engine_set_threads(embps_engine_t *engine, unsigned threads);

/** The most bytes of rows (this rank's shards' tokens x emb_width x the dtype's size) that fused
 * lookups return together; it bounds the scratch that fusing adds. */
#define EMBPS_ENGINE_FUSE_MAX_BYTES ((size_t)8 << 20)

/**
 * Whether lookup b may run fused with a run of lookups that starts with a and holds
 * tokens_so_far of this rank's tokens (b NULL: whether a may start such a run at all): both are
 * plain lookups (no feature batch) of one dense, undropped table in a group of more than one,
 * and the run stays under EMBPS_ENGINE_FUSE_MAX_BYTES. Every rank answers alike for the same
 * round entries. Reads the ops only.
 */
int embps_engine_lookups_fuse(const embps_engine_t *engine, const embps_op_t *a,
                              const embps_op_t *b, size_t tokens_so_far);

/**
 * Runs ops[0..k) (k >= 1), consecutive lookups of one round that embps_engine_lookups_fuse
 * accepted one after the other, as one batch: one all-gather and one all-to-all for all of them
 * (lookups.c). Every rank must call it with the same k for the same entries. Each op gets the
 * rows embps_engine_run would give it, bit for bit. Returns as embps_engine_run does; a failure
 * of the communicator fails them all.
 */
embps_status_t embps_engine_run_lookups(embps_engine_t *engine, embps_op_t *const *ops, size_t k,
                                        embps_error_t *err);

/**
 * Runs op (lookup, push, assign, create or drop) collectively: every rank must call this for the
 * same batches in the same order. Results go into op; a failure of the op itself (e.g. out of
 * memory on some rank, agreed on by every rank) is op->error. A create first checks the table
 * against every rank's budget (embps_store_set_budget) and is refused with
 * EMBPS_RESOURCE_EXHAUSTED, before any rank allocates, if one rank's would be exceeded. A drop
 * answers EMBPS_NOT_FOUND for a name no table has. Returns EMBPS_OK, or
 * EMBPS_UNAVAILABLE / EMBPS_INTERNAL when the communicator failed (err says why): the group
 * is then broken.
 */
embps_status_t embps_engine_run(embps_engine_t *engine, embps_op_t *op, embps_error_t *err);

/** Collectively (every rank calls it in step): *v becomes the largest *v of any rank. Returns
 * EMBPS_OK, or EMBPS_UNAVAILABLE / EMBPS_INTERNAL when the communicator failed. */
embps_status_t embps_engine_agree_max(embps_engine_t *engine, uint64_t *v, embps_error_t *err);

/**
 * Copies the whole of a table's arrays (data and optimizer state, as embps_table_arrays_t says)
 * to host memory (export: a checkpoint's capture) or from it (import: a restore), on the group's
 * thread between rounds; host's arrays are sized as embps_table_initial_state and the slice
 * say. An export also brings the rows the engine marked written since the last export into the
 * table's dirty-row bitmap (embps_table_dirty), where the engine keeps them elsewhere (the CUDA
 * backend marks them in GPU memory). Waits for the copy. Returns EMBPS_OK or EMBPS_INTERNAL (a
 * device error, in err).
 */
embps_status_t embps_engine_table_export(embps_engine_t *engine, embps_table_t *table,
                                         const embps_table_arrays_t *host, embps_error_t *err);
embps_status_t embps_engine_table_import(embps_engine_t *engine, embps_table_t *table,
                                         const embps_table_arrays_t *host, embps_error_t *err);

/** The engine's backend. */
embps_backend_t embps_engine_backend(const embps_engine_t *engine);

/** Bytes of the memory the engine's tables live in: physical memory on the CPU backend, the
 * device's memory on the CUDA backend; 0 when unknown. */
uint64_t embps_engine_memory_total(embps_engine_t *engine);

/* ---- devices (the CUDA backend's, answered without CUDA too) --------------------------------- */

/** CUDA devices this process sees; 0 in a build without CUDA or without a usable driver. */
int embps_cuda_device_count(void);

/**
 * Makes `device` the calling thread's current device, creates the engine's stream and writes
 * the device's PCI bus id (unique per host) to bus_id. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT
 * for a device that does not exist, EMBPS_UNIMPLEMENTED without CUDA, EMBPS_INTERNAL.
 */
embps_status_t embps_cuda_open(int device, void **stream, char *bus_id, size_t cap,
                               embps_error_t *err);

/** Destroys a stream from embps_cuda_open. NULL is a no-op. */
void embps_cuda_close(void *stream);

/**
 * Host memory for request and reply buffers. With device >= 0 (the CUDA backend's device) it
 * is pinned (page-locked, usable from every device), so the CUDA engine copies it to and from
 * the device directly, without a staging copy; with device < 0, or when pinning fails (logged
 * once), it is pageable memory in a mapping of its own (embps_map_alloc), which embps_host_free
 * returns to the system. *pinned says which, for embps_host_free. Any thread may call these;
 * pinning is slow (milliseconds for large sizes), so callers pool the buffers. Returns NULL when
 * out of memory.
 */
void *embps_host_alloc(int device, size_t bytes, int *pinned);

/** Frees memory from embps_host_alloc (bytes as asked); NULL is a no-op. */
void embps_host_free(void *p, int pinned, size_t bytes);

/** Bytes from embps_host_alloc not yet freed, pinned and pageable; any thread (metrics). */
void embps_host_memory(uint64_t *pinned, uint64_t *pageable);

#endif
