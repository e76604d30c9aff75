/* What one round of a lookup or a push costs a rank, as the engine runs it (engine.c): the
 * scratch it reserves, the collectives it calls and the payload they move to the peers. The
 * engine's cpu backend sizes its scratch by embps_round_scratch, and `embps plan` (the CLI's
 * offline library, which may not see the engine itself) predicts memory, peer bytes and round
 * trips from the same functions, so a change in the round's layout changes the plan; the
 * checked-predictions test (tests/plan) holds both against a running group's counters.
 *
 * Pure arithmetic over a shape: no I/O, no state. */
#ifndef EMBPS_ROUND_COST_H
#define EMBPS_ROUND_COST_H

#include <stddef.h>
#include <stdint.h>

#include "common/op_kind.h"

/** One op's shape on one rank: a batch of T tokens (T / group_size per shard; a feature batch's
 * ids), this rank's slice of w columns out of W, elements of ds bytes, a hash-keyed table or
 * not. */
typedef struct embps_round_shape {
  embps_op_kind_t kind; /* EMBPS_OP_LOOKUP or EMBPS_OP_PUSH */
  uint32_t group_size;
  size_t T, w, W, ds;
  int hashed;
} embps_round_shape_t;

/** The engine's scratch arrays of one op (cpu backend), each grown to the largest op so far. */
typedef enum embps_round_scratch {
  EMBPS_ROUND_UNIQUE = 0,  /* T int64: the unique tokens */
  EMBPS_ROUND_SEGMENT_IDS, /* T uint32: each position's unique index */
  EMBPS_ROUND_DEDUP_WS,    /* the dedup's workspace */
  EMBPS_ROUND_ALL_TOKENS,  /* T int64: the all-gathered tokens (group_size > 1) */
  EMBPS_ROUND_SEND,        /* T x w x ds: the all-to-all's send blocks (group_size > 1) */
  EMBPS_ROUND_RECV,        /* T x w x ds: its receive blocks (group_size > 1) */
  EMBPS_ROUND_ROWS,        /* T x w x ds: a lookup's unique rows (group_size > 1) */
  EMBPS_ROUND_KEYS,        /* T int64: a hash-keyed push's keys in hash order */
  EMBPS_ROUND_SUMMED,      /* T x w f32: a push's summed gradients */
  EMBPS_ROUND_ROW_SUMSQ,   /* T f32: each unique row's sum of squares */
  EMBPS_ROUND_PARTIALS,    /* T x nb f32 ((T + group_size) x nb by owner): this rank's partials */
  EMBPS_ROUND_SEGMENT_COUNTS, /* the fused segment sum's workspace */
  EMBPS_ROUND_GATHERED,       /* group_size x T x nb f32: every rank's partials (group_size > 1);
                               * by owner, group_size x q x nb: its own rows' partials */
  EMBPS_ROUND_SUMS,           /* group_size x q f64: every row's sum (by owner only) */
  EMBPS_ROUND_ORDER,          /* T uint32: the last dedup's positions by segment */
  EMBPS_ROUND_STARTS,         /* T + 1 uint32: where each segment starts in ORDER */
  EMBPS_ROUND_SCRATCH_COUNT
} embps_round_scratch_t;

/** The row-statistics partials per row of a push on a slice w wide (kernels/row_stats.c's
 * column blocks): w / embps_row_stats_block(w), 0 for w == 0. */
size_t embps_round_partials_per_row(size_t w);

/** Whether a push's row statistics are combined by owner (engine.c): in a group of group_size
 * ranks with nb partials per row, each rank adds the partials of its own q = ceil(m /
 * group_size) of the m rows (an all-to-all of q x nb f32 per peer) and the ranks then exchange
 * those sums (an all-gather of q f64), rather than every rank gathering and adding every
 * rank's partials (an all-gather of m x nb f32). Chosen when it at least halves the bytes, so
 * that it pays for its second round trip: group_size x nb x 4 >= 2 x (nb x 4 + 8). Never on a
 * group of one. */
int embps_round_stats_by_owner(uint32_t group_size, size_t nb);

/** The rows each rank owns when m rows are combined by owner: ceil(m / group_size). */
size_t embps_round_stats_owned(uint32_t group_size, size_t m);

/** bytes[i] = what scratch array i needs for an op of shape sh (0 where its path does not use
 * it). bytes is the caller's, EMBPS_ROUND_SCRATCH_COUNT entries. */
void embps_round_scratch_bytes(const embps_round_shape_t *sh,
                               size_t bytes[EMBPS_ROUND_SCRATCH_COUNT]);

/** The sum of embps_round_scratch_bytes over the arrays. */
size_t embps_round_scratch_total(const embps_round_shape_t *sh);

/** The collective payload this rank sends to its peers in one op of shape sh, equal to what it
 * receives (comm.c counts (group_size - 1) x payload per call): the tokens' all-gather, the
 * rows' (lookup) or gradients' (push) all-to-all, and a push's row statistics for its `unique`
 * distinct non-padding tokens (twice when weight_decay is on and the optimizer is rowwise), by
 * owner where embps_round_stats_by_owner says so. 0 on a group of one. */
uint64_t embps_round_peer_bytes(const embps_round_shape_t *sh, uint64_t unique, int second_stats);

/** The collectives one op of shape sh calls, one after the other (each at least one peer round
 * trip; a push's row statistics take two by owner): 0 on a group of one. */
unsigned embps_round_collectives(const embps_round_shape_t *sh, int second_stats);

/** The smallest group whose followers send their control frames through relays when
 * --control-fanout is auto (server/group/relay.h). */
#define EMBPS_ROUND_RELAY_AUTO_MIN 16

/** --control-fanout auto for a group of group_size ranks: 0 (every follower talks to the leader)
 * below EMBPS_ROUND_RELAY_AUTO_MIN, else ceil(sqrt(group_size)), so that the leader and every
 * relay each keep about sqrt(group_size) control connections. */
uint32_t embps_round_control_fanout_auto(uint32_t group_size);

/** The one-way delays between a batch's last shard arriving and its round starting on every
 * rank, on the slowest path: 0 on a group of one; 2 (a notice to the leader, its ROUND back) when
 * every follower talks to the leader; 4 when some rank sends through a control relay (fanout 2 or
 * more and at least 3 ranks), whose notice and ROUND each take two hops. */
unsigned embps_round_order_delays(uint32_t group_size, uint32_t fanout);

#endif
