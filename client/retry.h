/* When a failed batch is tried again, and how long each try may take: the retry rules of
 * libembps as pure functions of the clock's reading, the call's deadline and the statuses its
 * shards ended with (no I/O, no clock of their own), so that the schedule and the deadline
 * arithmetic are tested without servers. call.c applies them. Internal (embps__ prefix). */
#ifndef EMBPS_CLIENT_RETRY_H
#define EMBPS_CLIENT_RETRY_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "embps/embps.h"

/** The default of embps_client_options_t.max_attempts (a first try and three retries). */
#define EMBPS__DEFAULT_MAX_ATTEMPTS 4u
/** Most attempts a client may be configured for (the public header's limit). */
#define EMBPS__MAX_ATTEMPTS EMBPS_MAX_ATTEMPTS
/** The backoff before the first retry, doubling for each later one up to the cap. */
#define EMBPS__BACKOFF_BASE_MS 20
#define EMBPS__BACKOFF_CAP_MS 1000

/** The wait before retry number retry (1: the first retry, after attempt 0 failed): the base
 * doubled retry - 1 times, capped, then jittered into [half of it, all of it] by the random word
 * r, so that clients that failed together do not come back together. Always >= 1 ms; retry 0
 * counts as 1. */
int64_t embps__backoff_ms(uint32_t retry, uint64_t r);

/** The bounds of an attempt that starts at now (ms on CLOCK_MONOTONIC): *deadline, when it ends
 * (0: never), the earlier of the call's deadline (0: none) and now + attempt_timeout_ms (0: the
 * attempt may use all the call has left); *timeout_ms, what it sends as grpc-timeout (0: none),
 * the time from now to *deadline. Returns 0, or -1 when the call's deadline has already passed
 * (no attempt may start; the outputs are then untouched). */
int embps__attempt_bounds(int64_t now, int64_t call_deadline, int64_t attempt_timeout_ms,
                          int64_t *deadline, int64_t *timeout_ms);

/** What the shards of an ended attempt say about trying again, gathered one status at a time
 * (zero-initialize it, then embps__verdict_add each shard's status, and a failure that belongs
 * to no shard, such as a request that could not be sent). */
typedef struct embps__verdict {
  int failed; /* some status was not EMBPS_OK */
  int cause;  /* some status was UNAVAILABLE or DEADLINE_EXCEEDED */
  int final;  /* some status was neither those, nor CANCELLED, nor EMBPS_OK */
} embps__verdict_t;

/** Adds one status to the verdict. */
void embps__verdict_add(embps__verdict_t *v, embps_status_t st);

/** Whether the attempt may be retried: it failed, at least one shard failed with UNAVAILABLE or
 * DEADLINE_EXCEEDED (a lost connection, a shutting-down or broken group, a deadline passed
 * before the batch was ordered, or the attempt's own timeout), and every other failure is one of
 * those or CANCELLED (the servers fail the other shards of a batch with CANCELLED when one of its
 * shards is withdrawn, as a lost connection withdraws it). Any other failure (INVALID_ARGUMENT,
 * NOT_FOUND, ...) is final: trying again would fail the same way. */
int embps__verdict_retryable(const embps__verdict_t *v);

/** When the next attempt of a call starts, after attempts (>= 1) attempts of which the last one
 * failed in a retryable way at now: now + the backoff (r jitters it), or 0 when it does not
 * start: attempts has reached max_attempts, or the backoff would end at or past the call's
 * deadline (0: none), which leaves no time for another attempt. */
int64_t embps__retry_at(int64_t now, int64_t call_deadline, uint32_t attempts,
                        uint32_t max_attempts, uint64_t r);

/** The next word of a splitmix64 sequence kept in *state (the jitter's random words). */
uint64_t embps__splitmix64(uint64_t *state);

#endif
