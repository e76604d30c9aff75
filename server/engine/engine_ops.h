/* The engine's backends (internal to server/engine): the operations a round is made of, one
 * table per backend, the way embps_comm_ops_t gives the collectives one face.
 *
 * engine.c writes DESIGN.md's lookup and push rounds once, as a sequence of these operations
 * and of collectives; engine_cpu.c implements them with the kernels/ C references on host memory,
 * and engine_cuda.c with kernels/cuda on the engine's streams, tables and scratch in GPU memory.
 *
 * Memory: every pointer an operation takes is in the backend's memory (device memory on cuda)
 * unless its comment says host. The backend owns its scratch (embps__engine_scratch_t) and the
 * state of the last dedup (which each backend keeps in its own form: the CPU's segment ids, the
 * GPU's sorted positions and segment offsets). Operations may be asynchronous: only those that
 * hand a number to the host (unique, row_combine and row_finish with figures, agree_max) and finish
 * wait for the work before them. Each returns EMBPS_OK, or a failure (with err set) that abandons
 * the op: engine.c then calls abort, which waits until nothing enqueued can still touch the request
 * or the reply. */
#ifndef EMBPS_ENGINE_OPS_H
#define EMBPS_ENGINE_OPS_H

#include "kernels/embps_kernels.h"
#include "server/engine/engine.h"

/** Every call of a round goes through this: a failure jumps to the function's `fail` label, with
 * ret and err set (a callee that failed without a message gets one naming it). */
#define EMBPS__STEP(call)                                                                          \
  do {                                                                                             \
    if ((ret = (call)) != EMBPS_OK) {                                                              \
      if (err->status == EMBPS_OK)                                                                 \
        embps_error_set(err, ret, "%s failed (%s)", #call, embps_status_str(ret));                 \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)

/** The scratch slots of a feature batch (the ops' scratch). */
#define EMBPS__ENGINE_FEATURE_SLOTS 16

/** What one op needs, for reserve: a batch of T = n * group_size tokens, this rank's slice of
 * w columns out of W, elements of ds bytes, row-statistics partials of nb per row. */
typedef struct embps__engine_shape {
  embps_op_kind_t kind;
  uint32_t group_size;
  size_t n, T, w, W, ds, nb;
  int hashed; /* the table is hash-keyed: the hash_* operations' scratch too */
} embps__engine_shape_t;

/** The scratch of one op, in the backend's memory, filled by reserve (NULL where the op's
 * path does not use an array). */
typedef struct embps__engine_scratch {
  int64_t *all_tokens; /* T: the batch's tokens after the all-gather (group_size > 1) */
  void *rows;          /* T x w x ds: the unique rows of a lookup (group_size > 1) */
  void *send, *recv;   /* T x w x ds each: the all-to-all's blocks (group_size > 1) */
  float *summed;       /* T x w: a push's gradients summed per unique token */
  float *partials;     /* T x nb: this rank's row-statistics partials ((T + group_size) x nb
                        * when combined by owner: the all-to-all reads group_size x q rows) */
  float *gathered;     /* group_size x T x nb: every rank's partials (group_size > 1); by owner
                        * group_size x q x nb, every rank's partials of this rank's q rows */
  double *sums;        /* group_size x q: every row's double sum (by owner only), q =
                        * embps_round_stats_owned(group_size, T) */
  float *row_sumsq;    /* T: each unique row's sum of squares over the full width */
  int64_t *keys;       /* T: a hash-keyed push's keys in hash order (hash_order) */
} embps__engine_scratch_t;

/** Which request array input() copies in. */
typedef enum embps__engine_input {
  EMBPS__IN_TOKENS = 0,
  EMBPS__IN_GRADS = 1
} embps__engine_input_t;

typedef struct embps__engine_backend embps__engine_backend_t; /* each backend's own state */

typedef struct embps__engine_ops {
  embps_backend_t backend;
  const char *memory; /* where tables live, for messages: "memory", "GPU memory" */

  void (*destroy)(embps__engine_backend_t *be);
  /** Optional (NULL: the backend's kernels take no host threads): runs the per-row kernels on
   * `threads` host threads from now on; returns how many it has (fewer when some could not
   * start). */
  unsigned (*set_threads)(embps__engine_backend_t *be, unsigned threads);
  /** Grows the scratch for an op of this shape (only what its path uses) and fills s. */
  embps_status_t (*reserve)(embps__engine_backend_t *be, const embps__engine_shape_t *shape,
                            embps__engine_scratch_t *s, embps_error_t *err);
  /** Allocates and initializes this rank's slice of a table (*out untouched on failure); with
   * blank set, leaves the arrays as allocated (a restore writes every byte). Returns EMBPS_OK,
   * EMBPS_RESOURCE_EXHAUSTED (out of the backend's memory), EMBPS_INTERNAL; err is not set: every
   * rank agrees on the outcome first. */
  embps_status_t (*table_new)(embps__engine_backend_t *be, const embps_table_config_t *cfg,
                              uint32_t rank, uint32_t group_size, int blank, embps_table_t **out);
  /** Bytes of the memory tables live in (host RAM, or the device's memory); 0 if unknown. */
  uint64_t (*memory_total)(embps__engine_backend_t *be);
  /** *v (host) becomes the largest *v of any rank (an all-reduce; waits for it). */
  embps_status_t (*agree_max)(embps__engine_backend_t *be, uint64_t *v, embps_error_t *err);

  /** Starts copying `bytes` of a request array (host) in and sets *dev to where it will be
   * (the host array itself where the backend computes on host memory). */
  embps_status_t (*input)(embps__engine_backend_t *be, embps__engine_input_t which,
                          const void *host, size_t bytes, const void **dev, embps_error_t *err);
  /** Orders the work enqueued from now on after that copy. */
  embps_status_t (*input_wait)(embps__engine_backend_t *be, embps__engine_input_t which,
                               embps_error_t *err);

  /** Deduplicates T tokens (kept by the backend for expand and segment_sum). */
  embps_status_t (*dedup)(embps__engine_backend_t *be, const int64_t *tokens, size_t T,
                          embps_error_t *err);
  /** The last dedup's result: the number of unique tokens and, when there is one, the first
   * (smallest) on the host; *unique points at them in the backend's memory. Waits for it. */
  embps_status_t (*unique)(embps__engine_backend_t *be, size_t *num_unique, int64_t *first,
                           const int64_t **unique, embps_error_t *err);
  /** out[i] = row rows[i] of the table's slice, n rows. */
  embps_status_t (*gather)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                           size_t n, void *out, embps_error_t *err);
  /** out[i] = unique_rows[segment of position i] for the last dedup's T positions. */
  embps_status_t (*expand)(embps__engine_backend_t *be, embps_table_t *t, const void *unique_rows,
                           size_t T, void *out, embps_error_t *err);
  /** A strided copy: `height` rows of `width` bytes, `spitch`/`dpitch` bytes apart. */
  embps_status_t (*copy2d)(embps__engine_backend_t *be, void *dst, size_t dpitch, const void *src,
                           size_t spitch, size_t width, size_t height, embps_error_t *err);
  /** out[s] = the sum of grads' rows at the positions of unique token s (last dedup), in
   * position order, f32. */
  embps_status_t (*segment_sum)(embps__engine_backend_t *be, embps_table_t *t, const void *grads,
                                size_t T, size_t num_unique, float *out, embps_error_t *err);
  /** segment_sum and then row_partials of its output (block columns per partial) in one pass:
   * the same bits in out and partials (num_unique x nb). grads may have any alignment. NULL
   * where the backend has no fused form (engine.c then calls the two). */
  embps_status_t (*segment_sum_stats)(embps__engine_backend_t *be, embps_table_t *t,
                                      const void *grads, size_t T, size_t num_unique, size_t block,
                                      float *out, float *partials, embps_error_t *err);

  /** embps_row_partials_cpu's contract. */
  embps_status_t (*row_partials)(embps__engine_backend_t *be, const float *g, size_t m, size_t w,
                                 size_t block, float *partials, embps_error_t *err);
  /** embps_row_combine_cpu's contract into row_sumsq; with `bad` and `total` (host; both or
   * neither), also the number of rows that are not finite and the total (waits for them). */
  embps_status_t (*row_combine)(embps__engine_backend_t *be, const float *partials, size_t slices,
                                size_t m, size_t nb, float *row_sumsq, uint64_t *bad, double *total,
                                embps_error_t *err);
  /** embps_row_sums_cpu's contract: sums[i] (n <= stride of them) = row i's double sum of the
   * partials of `slices` slices, slice r's row i at (r * stride + i) * nb; the additions of
   * row_combine, in its order. The first half of a combine by owner (engine.c). */
  embps_status_t (*row_sums)(embps__engine_backend_t *be, const float *partials, size_t slices,
                             size_t stride, size_t n, size_t nb, double *sums, embps_error_t *err);
  /** embps_row_finish_cpu's contract into row_sumsq, from the m rows' double sums in row order;
   * with `bad` and `total` (host; both or neither), also the number of rows that are not finite
   * and the total (waits for them). Every output is bitwise what row_combine gives on the
   * partials the sums came from, this backend's total included. */
  embps_status_t (*row_finish)(embps__engine_backend_t *be, const double *sums, size_t m,
                               float *row_sumsq, uint64_t *bad, double *total, embps_error_t *err);
  /** g[i] += weight_decay * w[rows[i]]. */
  embps_status_t (*weight_decay)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                                 size_t m, float *g, embps_error_t *err);
  /** The table's optimizer step p on rows (row_sumsq for rowwise Adagrad). */
  embps_status_t (*update)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                           size_t m, const float *g, const float *row_sumsq,
                           const embps_opt_params_t *p, embps_error_t *err);

  /* Hash-keyed tables (each NULL on a backend that serves none). Their key index lives in host
   * memory (server/store/hindex.h): the engine finds and steps keys there, and these operations
   * carry keys to it and slots from it. Host arrays passed in may be reused once the op returns. */
  /** *host = n keys (backend memory) readable on the host: the keys themselves where the backend
   * computes on host memory, else a copy in the backend's host buffer, valid until the next
   * keys_to_host. Waits for the keys. */
  embps_status_t (*keys_to_host)(embps__engine_backend_t *be, const int64_t *keys, size_t n,
                                 const int64_t **host, embps_error_t *err);
  /** out[i] = in[i] with its top bit flipped (n keys; in == out allowed): the order in which a
   * push's dedup sorts keys as unsigned numbers with the padding key 0 first (engine.c's
   * HASH_ORDER). */
  embps_status_t (*hash_order)(embps__engine_backend_t *be, const int64_t *in, size_t n,
                               int64_t *out, embps_error_t *err);
  /** *slots = the n slots `host` (host memory) in the backend's memory (the host array itself
   * where the backend computes on host memory), for hash_gather; one call per op. */
  embps_status_t (*hash_slots)(embps__engine_backend_t *be, const int64_t *host, size_t n,
                               const int64_t **slots, embps_error_t *err);
  /** out[i] = the row at slot slots[i] of the table's slice or, where slots[i] is -1, the initial
   * row of keys[i] over the slice's columns (zeros for key 0): embps_hash_gather_cpu. With `more`
   * the call continues the previous one of the same op and table (a lookup's next chunk), whose
   * rows stay in place unchanged: the backend may copy a repeated key's initial row from them. */
  embps_status_t (*hash_gather)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *keys,
                                const int64_t *slots, size_t n, void *out, int more,
                                embps_error_t *err);
  /** Sets each slot slots[i] (host; distinct) to the initial row of keys[i] (host) and its
   * optimizer state to the initial state, as a new table's row (an open snapshot copies the old
   * first); n of them, one call per op. */
  embps_status_t (*hash_reset)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *slots,
                               const int64_t *keys, size_t n, embps_error_t *err);
  /** Keeps the rows i of a push whose slot slots[i] (host, which the op may rewrite; *m of them)
   * is >= 0: their gradient
   * rows (*g, *m x w) and row figures (*row_sumsq) come first, in their order, in place or in
   * the backend's scratch (*g and *row_sumsq then point there); *rows = their slots in the
   * backend's memory, *m = their number. One call per op. */
  embps_status_t (*hash_keep)(embps__engine_backend_t *be, int64_t *slots, size_t *m, size_t w,
                              float **g, float **row_sumsq, const int64_t **rows,
                              embps_error_t *err);

  /* Feature batches (features.c; each NULL on a backend that serves none). */
  /** *p = `bytes` of the backend's memory in scratch slot `slot` (< EMBPS__ENGINE_FEATURE_SLOTS),
   * grown as needed; what it held is kept only while it does not grow. */
  embps_status_t (*scratch)(embps__engine_backend_t *be, unsigned slot, size_t bytes, void **p,
                            embps_error_t *err);
  /** Copies `bytes` of host memory into the backend's memory at dst, in order with the work
   * enqueued before it; host may be reused once it returns. */
  embps_status_t (*copy_in)(embps__engine_backend_t *be, void *dst, const void *host, size_t bytes,
                            embps_error_t *err);
  /** Copies `bytes` of the backend's memory at src to host, once the work enqueued before it is
   * done; waits for the copy. */
  embps_status_t (*copy_out)(embps__engine_backend_t *be, void *host, const void *src, size_t bytes,
                             embps_error_t *err);
  /** embps_pool_bags_cpu over the table's slice (every pointer the backend's memory). */
  embps_status_t (*pool_bags)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *ids,
                              const int64_t *rows, const float *weights, const int64_t *offsets,
                              size_t num_bags, int mean, float *out, embps_error_t *err);
  /** embps_expand_bags_cpu into rows of the table's dtype and slice width. */
  embps_status_t (*expand_bags)(embps__engine_backend_t *be, embps_table_t *t, const float *g,
                                const int64_t *ids, const float *weights, const int64_t *offsets,
                                size_t num_bags, int mean, void *out, embps_error_t *err);
  /** embps_bag_sources_cpu into out (n entries; offsets NULL: n positions of their own rows).
   * NULL, with segment_sum_bags, where the backend has no fused push: features.c then expands
   * the bags with expand_bags and sums the expanded rows. */
  embps_status_t (*bag_sources)(embps__engine_backend_t *be, const int64_t *ids,
                                const float *weights, const int64_t *offsets, size_t num_bags,
                                int mean, uint32_t first_bag, size_t n, embps_bag_source_t *out,
                                embps_error_t *err);
  /** segment_sum_stats of the gradients the last dedup's T positions take from sources
   * (embps_segment_sum_bags_range_cpu: bags' rows, or grads' own rows), never written out. */
  embps_status_t (*segment_sum_bags)(embps__engine_backend_t *be, embps_table_t *t,
                                     const void *grads, const float *bags,
                                     const embps_bag_source_t *sources, size_t T, size_t num_unique,
                                     size_t block, float *out, float *partials, embps_error_t *err);

  /** embps_assign_rows_cpu on the table's slice: the n rows `rows` (distinct) become the rows
   * src_rows of src (rows of the slice's width and the table's dtype), and with reset set their
   * optimizer state becomes the initial state (embps_table_initial_state); an open snapshot
   * copies the rows first. */
  embps_status_t (*assign_rows)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                                const int64_t *src_rows, size_t n, const void *src, int reset,
                                embps_error_t *err);

  /** Marks rows[0..m) dirty, for incremental checkpoints; called only for tables that track
   * them. In the host bitmap (embps_table_mark_dirty), or in one where the table lives
   * (embps_table_device_dirty), without waiting: table_copy to the host then folds those marks
   * into the host bitmap. */
  embps_status_t (*mark_dirty)(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                               size_t m, embps_error_t *err);
  /** Copies every array the table has, whole, to the host arrays of `host` (to_host) or from
   * them; waits for the copy. To the host, also ORs the marks that mark_dirty left where the
   * table lives into the host bitmap and clears them there. */
  embps_status_t (*table_copy)(embps__engine_backend_t *be, embps_table_t *t,
                               const embps_table_arrays_t *host, int to_host, embps_error_t *err);

  /** Where a lookup's n rows of row_bytes are assembled before they reach `host` (the reply),
   * and how many rows go back per chunk (output() takes chunks in order). */
  embps_status_t (*output_begin)(embps__engine_backend_t *be, void *host, size_t n,
                                 size_t row_bytes, void **out, size_t *chunk_rows,
                                 embps_error_t *err);
  /** Non-zero when output() leaves the chunk's rows final in the host buffer when it returns
   * (no copy in flight), so the engine may publish them to the reply at once. */
  int output_in_place;
  /** Non-zero when the backend computes on host memory (its memory is the host's). */
  int host_memory;
  /** Starts sending rows [first, first + count) of the assembled output to the host. */
  embps_status_t (*output)(embps__engine_backend_t *be, size_t chunk, size_t first, size_t count,
                           embps_error_t *err);
  /** Waits until the op's work is done: a lookup's rows are in the reply, a push's update is
   * applied. */
  embps_status_t (*finish)(embps__engine_backend_t *be, embps_error_t *err);
  /** After a failure: waits until nothing enqueued for the op can still touch its buffers. */
  void (*abort)(embps__engine_backend_t *be);
} embps__engine_ops_t;

/* ---- the engine's own (engine.c, features.c) ---- */

struct embps_engine {
  embps_comm_t *comm;
  embps_store_t *store;
  const embps__engine_ops_t *ops;
  embps__engine_backend_t *be;
  /* Hash-keyed tables' host scratch, T entries each (grown as the batches grow): the unique keys
   * of a push as the index takes them (hkeys), their slots (hslots), the slots a step
   * (re)assigned (hfresh) and the same as two arrays for hash_reset (hfslot, hfkey). */
  int64_t *hslots, *hfslot, *hfkey;
  uint64_t *hkeys;
  embps_hindex_fresh_t *hfresh;
  size_t hcap;
  /* An assign's host scratch (assign.c), grown as the batches grow. */
  void *ascratch;
  size_t ascratch_cap;
  /* Fused lookups' tokens, concatenated on the host (lookups.c), grown as the runs grow. */
  int64_t *ftokens;
  size_t fcap;
};

/** One push step's results on one table. */
typedef struct embps__engine_step {
  int applied, skipped;
  double grad_norm;
  uint64_t num_unique;
} embps__engine_step_t;

/** Grows the scratch for sh (the backend's, and a hash-keyed table's host arrays when
 * sh->hashed). A failure that only this rank's op suffers (a group of one) goes to op->error with
 * EMBPS_OK returned; in a group it is returned (every rank must agree first). */
embps_status_t embps__engine_reserve(embps_engine_t *e, const embps__engine_shape_t *sh,
                                     embps_op_t *op, embps__engine_scratch_t *s,
                                     embps_error_t *err);
/** A push step's first half: deduplicates the sh->T tokens (backend memory) of table t. */
embps_status_t embps__engine_push_dedup(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_table_t *t, const embps__engine_scratch_t *s,
                                        const void *tokens, embps_error_t *err);
/** Its second half: the gradients (sh->T x sh->w of t's dtype, backend memory, this rank's
 * columns, in the deduplicated tokens' positions) summed, gated, and applied to t; *res says how
 * it went. With sources (a feature push on a backend with segment_sum_bags; else NULL), the
 * positions take their gradients from bags' rows or grads' as sources say. Enqueues; the caller
 * finishes (or aborts) the op. */
embps_status_t embps__engine_push_apply(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_table_t *t, const embps__engine_scratch_t *s,
                                        const void *grads, const float *bags,
                                        const embps_bag_source_t *sources,
                                        embps__engine_step_t *res, embps_error_t *err);

/** Runs an assign (op->kind == EMBPS_OP_ASSIGN; assign.c) of the shape sh. */
embps_status_t embps__engine_run_assign(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_op_t *op, embps_error_t *err);

/** Runs a feature batch (op->num_features > 0; features.c). */
embps_status_t embps__engine_run_features(embps_engine_t *e, embps_op_t *op, embps_error_t *err);

/** Bytes of each of the table's arrays (data, state0, state1; 0 where it has none). */
void embps__engine_table_sizes(const embps_table_t *t, size_t bytes[3]);

/** The optimizer parameters of the table's next step (advances its step count). */
embps_opt_params_t embps__engine_next_step(embps_table_t *table);

/** The CPU backend (engine_cpu.c). */
embps_status_t embps__engine_cpu_new(embps__engine_backend_t **out, embps_comm_t *comm);
/** The bytes of a lookup reply's chunk on the CPU backend, for a core with l2_bytes of L2 cache
 * (0: not known). */
size_t embps__engine_cpu_chunk_bytes(size_t l2_bytes);
extern const embps__engine_ops_t embps__engine_cpu_ops;

/** The CUDA backend (engine_cuda.c; engine_nocuda.c answers EMBPS_UNIMPLEMENTED). `stream` is
 * the group's cudaStream_t, on the calling thread's current device. */
embps_status_t embps__engine_cuda_new(embps__engine_backend_t **out, embps_comm_t *comm,
                                      void *stream);
extern const embps__engine_ops_t embps__engine_cuda_ops;

/** Pinned host memory usable from every device, allocated with `device` current; NULL when it
 * cannot be had (no CUDA, or pinning failed). */
void *embps__cuda_host_alloc(int device, size_t bytes);
/** Frees memory from embps__cuda_host_alloc. */
void embps__cuda_host_free(void *p);

#endif
