/* The retry window: which pushes the group has applied, so that a push retried with the same
 * (client_id, batch_id, digest) after an ambiguous failure (a reset connection, a timeout after
 * sending) is applied at most once and answered with the first attempt's result.
 *
 * Every rank keeps one and changes it only while it applies a round, in the round's order, so
 * the windows of all ranks hold the same keys at every round: the decision to run a push or
 * answer it from the window (embps_dedup_check) is the same on every rank without a message, and
 * no rank enters a collective the others skip. What a push's answer holds (applied, skipped,
 * grad_norm, num_unique) is the same on every rank, so one window's entries serve any rank and
 * any group size after a restore.
 *
 * Bounds: each client (a nonzero client id) keeps its `window` most recent applied pushes, oldest
 * forgotten first; at most `max_clients` clients are remembered, and a new one forgets the client
 * whose last push is oldest (ties: the smaller id). A client's *floor* is the highest batch id it
 * has forgotten: the client libraries number their batches upwards, so a retry at or below the
 * floor that the window no longer holds is one whose first attempt cannot be known.
 *
 * Pure bookkeeping: no I/O, no clock, no lock (the group's thread owns it). */
#ifndef EMBPS_GROUP_DEDUP_H
#define EMBPS_GROUP_DEDUP_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct embps_dedup embps_dedup_t;

/** Clients a window remembers. */
#define EMBPS_DEDUP_MAX_CLIENTS 1024

/** A push's answer as its first attempt got it. */
typedef struct embps_dedup_result {
  uint8_t applied, skipped;
  double grad_norm;
  uint64_t num_unique;
} embps_dedup_result_t;

typedef enum embps_dedup_verdict {
  EMBPS_DEDUP_NEW = 0,       /* not seen: run it (then embps_dedup_record) */
  EMBPS_DEDUP_REPLAY = 1,    /* applied already with this digest: answer with *result */
  EMBPS_DEDUP_CONFLICT = 2,  /* applied already with another digest (*first_digest) */
  EMBPS_DEDUP_FORGOTTEN = 3, /* at or below the client's floor and not held: unknown */
} embps_dedup_verdict_t;

/** A window of `window` pushes per client (at least 1) and `max_clients` clients. Returns
 * EMBPS_OK, EMBPS_INVALID_ARGUMENT (window or max_clients 0) or EMBPS_RESOURCE_EXHAUSTED; *out is
 * untouched on failure. Memory is taken per client as it records, not up front. */
embps_status_t embps_dedup_new(embps_dedup_t **out, uint32_t window, uint32_t max_clients);

/** Frees d (NULL: no-op). */
void embps_dedup_free(embps_dedup_t *d);

/** What the window says about push (client_id, batch_id) with digest. client_id or digest 0:
 * always NEW (a request without them keeps the rules of one without retries). result and
 * first_digest (either may be NULL) are set for REPLAY and CONFLICT. */
embps_dedup_verdict_t embps_dedup_check(const embps_dedup_t *d, uint64_t client_id,
                                        uint64_t batch_id, uint64_t digest,
                                        embps_dedup_result_t *result, uint64_t *first_digest);

/**
 * Records that push (client_id, batch_id) of table `table` (its name, borrowed) with digest was
 * applied at round `round` with *result. client_id or digest 0: nothing is recorded; a
 * (client_id, batch_id) the window holds already keeps its first entry. May forget the client's
 * oldest entry, or the least recent client. Returns EMBPS_OK, or
 * EMBPS_RESOURCE_EXHAUSTED (nothing recorded: the caller must not let the ranks' windows differ,
 * and breaks the group).
 */
embps_status_t embps_dedup_record(embps_dedup_t *d, uint64_t client_id, uint64_t batch_id,
                                  uint64_t digest, const char *table, uint64_t round,
                                  const embps_dedup_result_t *result);

/** Entries held, over every client (for tests and metrics). */
size_t embps_dedup_size(const embps_dedup_t *d);

/** The pushes remembered per client (the `window` it was made with). */
uint32_t embps_dedup_window(const embps_dedup_t *d);

#endif
