/* The sequencer: the leader's bookkeeping that turns shard arrivals into rounds.
 *
 * Every rank tells the leader (rank 0) which batch shards it has parked; the sequencer records
 * them, and a batch becomes runnable once every rank holds its shard. The leader then emits
 * rounds: an ordered list of entries (run batch X, fail batch Y with a status) that every rank
 * applies in the same order, so all ranks make the same collective calls in the same order
 * whatever order the shards reached them in. Batches whose shards disagree are failed with
 * INVALID_ARGUMENT; batches not complete within the deadline are failed with
 * DEADLINE_EXCEEDED, and so are batches not complete before the earliest deadline their shards'
 * callers set (each shard's, counted from its arrival here); shards that arrive for a batch
 * already failed are failed the same way. Shards whose digests (the client's hash of the whole
 * batch) differ are failed with INVALID_ARGUMENT like other disagreeing shards, naming the ranks
 * that disagree. A batch still pending whose caller on some rank went away (a WITHDRAW) is failed
 * with CANCELLED on every rank (embps_sequencer_withdraw); once queued to run, it runs.
 * A batch is named by its client's id, its batch id and its attempt together, so two clients
 * that pick the same batch id (each knows only its own) run two batches, and a retry (attempt + 1)
 * never joins a shard of an earlier attempt; a client id of 0 (a client that sends none) is one
 * shared scope, as every batch id was before client ids.
 *
 * Pure logic: no I/O, no clock of its own (callers pass now_ms), so it is tested directly. */
#ifndef EMBPS_SEQUENCER_H
#define EMBPS_SEQUENCER_H

#include <stddef.h>
#include <stdint.h>

#include "common/op_kind.h"
#include "common/status.h"

typedef struct embps_batch_desc {
  uint64_t client_id; /* the client's id (0: none); with batch_id and attempt, what names the
                         batch */
  uint64_t batch_id;
  uint32_t attempt; /* the client's try of this batch (0: the first); a retry sends every shard
                       again with attempt + 1 */
  /* Lookups and pushes: the client's digest of the whole batch (table, T and every shard's
   * tokens), the same in every shard; 0: none. Shards of one batch must agree on it, a shard
   * with none disagreeing with one that has one. */
  uint64_t digest;
  /* What the batch is (common/op_kind.h); shards of one batch must agree on it. A create or a
   * drop arrives at the leader only and is runnable at once; a checkpoint is ordered by the
   * leader itself, never through the sequencer. */
  embps_op_kind_t kind;
  uint32_t tokens_per_batch;
  char table[128];
  /* The table's group-wide id (embps_table_id) for lookups and pushes, else 0: the shards of a
   * batch sent while its table was dropped and created again name the same table but not the
   * same id, and are failed rather than run on two different tables. */
  uint64_t table_id;
  /* Lookups and pushes: the deadline of the shard's caller (grpc-timeout), as the milliseconds
   * it had left when its rank reported the shard, rounded up; 0 once it has passed. A duration,
   * not an instant: one rank's monotonic clock means nothing to another. The batch must be
   * ordered within it (embps_sequencer_arrive). has_deadline 0: the caller set none. */
  uint32_t has_deadline;
  uint32_t deadline_left_ms;
} embps_batch_desc_t;

typedef enum embps_round_action {
  EMBPS_ROUND_RUN = 1,
  EMBPS_ROUND_FAIL = 2,
} embps_round_action_t;

typedef struct embps_round_entry {
  uint64_t client_id; /* with batch_id and attempt, the batch (embps_batch_desc_t) */
  uint64_t batch_id;
  uint32_t attempt;
  uint32_t action;
  embps_op_kind_t kind;
  embps_status_t status; /* FAIL only */
  char message[400];     /* FAIL only */
} embps_round_entry_t;

typedef struct embps_sequencer embps_sequencer_t;

/** A sequencer for group_size ranks failing batches incomplete after deadline_ms. */
embps_status_t embps_sequencer_new(embps_sequencer_t **out, uint32_t group_size,
                                   uint64_t deadline_ms);
void embps_sequencer_free(embps_sequencer_t *s);

/** Records that rank `rank` parked its shard of batch (desc->client_id, desc->batch_id,
 * desc->attempt) at now_ms. A shard with a deadline brings the batch's expiry forward to now_ms +
 * desc->deadline_left_ms when that is earlier than its batch deadline (the first shard's arrival
 * + deadline_ms): a batch whose expiry has come when its last shard arrives fails instead of
 * running. */
void embps_sequencer_arrive(embps_sequencer_t *s, uint32_t rank, const embps_batch_desc_t *desc,
                            uint64_t now_ms);

/**
 * Takes up to max entries of the next round: batches that became complete (in the order they
 * became complete), then failures (disagreeing shards, expired deadlines, late shards of failed
 * batches). Returns the number written; 0 when nothing is ready.
 */
size_t embps_sequencer_next_round(embps_sequencer_t *s, uint64_t now_ms, embps_round_entry_t *out,
                                  size_t max);

/**
 * Rank `rank`'s caller of its shard of batch (client_id, batch_id, attempt) went away (it reset
 * its stream or closed its connection) at now_ms. When the batch is still pending (not every
 * shard is in, or it is not yet queued to run), it fails on every rank with CANCELLED, naming
 * the rank ("batch B was cancelled before it was ordered: ..."), and shards that arrive for it
 * later fail the same way; a batch whose shards already disagree keeps its INVALID_ARGUMENT, and
 * one whose expiry has come by now_ms fails DEADLINE_EXCEEDED as it would have at its expiry.
 * Otherwise (unknown, already queued to run, or already failed) nothing changes: once ordered a
 * batch runs as ordered. Returns 1 when it failed a batch with CANCELLED, else 0.
 */
int embps_sequencer_withdraw(embps_sequencer_t *s, uint32_t rank, uint64_t client_id,
                             uint64_t batch_id, uint32_t attempt, uint64_t now_ms);

/** What the sequencer has done so far, for the group's metrics. */
typedef struct embps_sequencer_counts {
  uint64_t expired;   /* batches failed DEADLINE_EXCEEDED before they were ordered */
  uint64_t cancelled; /* batches failed CANCELLED by a withdrawal */
} embps_sequencer_counts_t;

/** Copies the counts into *out. */
void embps_sequencer_counts(const embps_sequencer_t *s, embps_sequencer_counts_t *out);

/** Milliseconds from now_ms until the earliest pending deadline; UINT64_MAX if none. */
uint64_t embps_sequencer_next_deadline(const embps_sequencer_t *s, uint64_t now_ms);

/** Batches with at least one shard parked and not yet in a round. */
size_t embps_sequencer_pending(const embps_sequencer_t *s);

#endif
