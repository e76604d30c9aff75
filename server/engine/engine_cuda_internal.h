/* The CUDA backend's state (internal to server/engine): shared by engine_cuda.c (the round's
 * operations) and engine_cuda_hash.c (those of hash-keyed tables). */
#ifndef EMBPS_ENGINE_CUDA_INTERNAL_H
#define EMBPS_ENGINE_CUDA_INTERNAL_H

#include <cuda_runtime_api.h>

#include "server/engine/engine_ops.h"

typedef struct buf {
  void *p;
  size_t cap;
} buf_t;

/* A lookup's reply goes back in at most this many chunks, each at least CHUNK_MIN_BYTES. */
#define MAX_CHUNKS 8
#define CHUNK_MIN_BYTES ((size_t)4 << 20)

struct embps__engine_backend {
  embps_comm_t *comm;
  cudaStream_t stream;   /* kernels and collectives (the group's stream, borrowed) */
  cudaStream_t h2d, d2h; /* copies in and out (owned) */
  cudaEvent_t in_done[2], chunk_ready[MAX_CHUNKS];
  /* device scratch */
  buf_t in[2], all_tokens, unique, seg, sorted_pos, seg_off, num_unique, dedup_ws, comb_ws;
  buf_t row_sumsq, summed, partials, gathered, sums, send, recv, rows, out, figures;
  /* hash-keyed tables: a push's keys in hash order, the slots of a lookup, a step's fresh slots
   * and their keys (2 x T), the kept rows' slots and places (2 x T), their gradients and figures */
  buf_t keys, slots, fresh, keep, kept_g, kept_sumsq;
  /* pinned host staging: h_small for figures; the rest only for requests and replies that are
   * not pinned themselves */
  buf_t h_in[2], h_out, h_small, h_dirty; /* h_dirty: a capture's dirty rows (cuda_table_copy) */
  buf_t h_keys, h_slots, h_fresh, h_keep; /* hash-keyed tables: the key index's side, pinned */
  buf_t feature[EMBPS__ENGINE_FEATURE_SLOTS]; /* a feature batch's scratch (device) */
  int warned_dirty; /* a dirty-row bitmap did not fit in GPU memory (logged once) */
  /* the lookup in flight: its reply (host), where the rows are copied to, their size */
  void *reply;
  uint8_t *out_host;
  size_t out_row_bytes, out_rows;
};

/* The hash-keyed tables' operations (engine_ops.h), in engine_cuda_hash.c. */
embps_status_t embps__cuda_keys_to_host(embps__engine_backend_t *c, const int64_t *keys, size_t n,
                                        const int64_t **host, embps_error_t *err);
embps_status_t embps__cuda_hash_order(embps__engine_backend_t *c, const int64_t *in, size_t n,
                                      int64_t *out, embps_error_t *err);
embps_status_t embps__cuda_hash_slots(embps__engine_backend_t *c, const int64_t *host, size_t n,
                                      const int64_t **slots, embps_error_t *err);
embps_status_t embps__cuda_hash_gather(embps__engine_backend_t *c, embps_table_t *t,
                                       const int64_t *keys, const int64_t *slots, size_t n,
                                       void *out, int more, embps_error_t *err);
embps_status_t embps__cuda_hash_reset(embps__engine_backend_t *c, embps_table_t *t,
                                      const int64_t *slots, const int64_t *keys, size_t n,
                                      embps_error_t *err);
embps_status_t embps__cuda_hash_keep(embps__engine_backend_t *c, int64_t *slots, size_t *m,
                                     size_t w, float **g, float **row_sumsq, const int64_t **rows,
                                     embps_error_t *err);

/* The feature batches' operations (engine_ops.h), in engine_cuda_features.c. */
embps_status_t embps__cuda_scratch(embps__engine_backend_t *c, unsigned slot, size_t bytes,
                                   void **p, embps_error_t *err);
embps_status_t embps__cuda_copy_in(embps__engine_backend_t *c, void *dst, const void *host,
                                   size_t bytes, embps_error_t *err);
embps_status_t embps__cuda_copy_out(embps__engine_backend_t *c, void *host, const void *src,
                                    size_t bytes, embps_error_t *err);
embps_status_t embps__cuda_pool_bags(embps__engine_backend_t *c, embps_table_t *t,
                                     const int64_t *ids, const int64_t *rows, const float *weights,
                                     const int64_t *offsets, size_t num_bags, int mean, float *out,
                                     embps_error_t *err);
embps_status_t embps__cuda_expand_bags(embps__engine_backend_t *c, embps_table_t *t, const float *g,
                                       const int64_t *ids, const float *weights,
                                       const int64_t *offsets, size_t num_bags, int mean, void *out,
                                       embps_error_t *err);

#endif
