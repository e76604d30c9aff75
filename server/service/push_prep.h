/* A push's dedup and segment sum, made while its request is still arriving (cpu backend, a group
 * of one).
 *
 * A PushGradientsRequest carries its tokens (field 6) before its gradients (field 8), and the
 * gradients are nearly all of its bytes. Once the tokens are in, the prep deduplicates them;
 * then, each time more gradient rows land in the message buffer, it sums them into their unique
 * rows with the kernels the engine would run (embps_dedup_cpu, then
 * embps_segment_sum_stats_count_cpu and embps_segment_sum_stats_positions_cpu over the rows
 * here so far). When the last byte arrives only the gate and the optimizer update are left.
 * For a table of f32 without weight decay a token of one position (nearly every token of a
 * batch over a large table) is not copied to the sums at all: its gradient row is read in place
 * by the update (embps_push_prepared_t.grad_at).
 *
 * It is speculative: the fields after the gradients (dtype, mode, client_id) and any repeated
 * field could still change what the request means, so the prep writes only its own arrays, and
 * embps_push_prep_result hands them out only when the complete, validated request is exactly
 * what they were made from (the same token bytes, the gradients at the same place, the same
 * table shape). Anything the prep does not expect (a field out of order, a table it cannot
 * resolve, a size that does not add up, its memory budget spent) makes it decline for good, and
 * the push then runs the engine's whole round as before.
 *
 * Loop thread only (the network layer calls its progress hook there). */
#ifndef EMBPS_PUSH_PREP_H
#define EMBPS_PUSH_PREP_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "server/engine/engine.h"

/** Batches of more tokens are not prepared: their dedup alone would hold the loop thread (and so
 * every other connection's reads) for milliseconds. */
#define EMBPS_PUSH_PREP_MAX_TOKENS (256u << 10)

typedef struct embps_push_prep embps_push_prep_t;

/** What the prep needs of a table, and checks again of the table the validated request names. */
typedef struct embps_push_prep_shape {
  uint32_t width; /* emb_width */
  embps_dtype_t dtype;
  int in_place; /* its update may read gradient rows in place: no weight decay (which writes
                   the sums); used for f32 alone */
} embps_push_prep_shape_t;

/** What the prep asks of its owner (the service). */
typedef struct embps_push_prep_env {
  /** The shape of the table named name[0..len), when a push to it may be prepared: returns 1;
   * 0 when not (no such table, not ready, ...). */
  int (*shape)(void *arg, const char *name, size_t len, embps_push_prep_shape_t *shape);
  /** A 64-byte aligned buffer of bytes, counted against the owner's budget for prepared
   * pushes; NULL when they would pass it (or out of memory). */
  void *(*alloc)(void *arg, size_t bytes);
  /** Gives back a buffer alloc returned, with its size. */
  void (*release)(void *arg, void *buf, size_t bytes);
  void *arg;
} embps_push_prep_env_t;

/** A prep that has seen nothing yet (env is copied), or NULL when out of memory. */
embps_push_prep_t *embps_push_prep_new(const embps_push_prep_env_t *env);

/** More of the request message has arrived: msg[0..got) of its len bytes is final (msg stays
 * where it is until the prep is freed or its result taken). Does what those bytes allow. */
void embps_push_prep_feed(embps_push_prep_t *p, const uint8_t *msg, size_t got, size_t len);

/** Non-zero once the prep has given up on this request. */
int embps_push_prep_declined(const embps_push_prep_t *p);

/** The prepared dedup and sums, when every gradient row is summed and the request as validated
 * is what they were made from: its n tokens equal (bytewise) those the prep deduplicated, its
 * gradients are the bytes at grads in the same message buffer, and the table's shape is the one
 * summed with. NULL otherwise. Valid until embps_push_prep_free, and while the message buffer
 * is (grad_at points into it). */
const embps_push_prepared_t *embps_push_prep_result(embps_push_prep_t *p, const int64_t *tokens,
                                                    size_t n, const void *grads,
                                                    const embps_push_prep_shape_t *shape);

/** Frees the prep and gives its budget back. NULL is a no-op. */
void embps_push_prep_free(embps_push_prep_t *p);

#endif
