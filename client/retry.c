/* The retry rules (retry.h). A retried batch keeps its batch id and digest and re-sends every
 * shard with the next attempt number (batch.c); what this file decides is whether and when.
 *
 * Backoff: 20 ms doubling to 1 s, as gRPC's own retry policy shapes it (initial backoff,
 * multiplier 2, a cap), with "equal jitter": a wait uniform in [d/2, d], never shorter than half
 * the nominal step, so a retry does not hit a server that is restarting at once, and clients
 * that failed together spread out. One deadline bounds the whole call: an attempt never
 * outlives it, the last one's grpc-timeout is what is left, and a retry whose backoff would end
 * at the deadline is not made. */
#include "client/retry.h"

#include "common/mix64.h"

int64_t embps__backoff_ms(uint32_t retry, uint64_t r) {
  int64_t d = EMBPS__BACKOFF_BASE_MS;
  int64_t half;
  for (uint32_t i = 1; i < retry && d < EMBPS__BACKOFF_CAP_MS; i++)
    d *= 2;
  if (d > EMBPS__BACKOFF_CAP_MS)
    d = EMBPS__BACKOFF_CAP_MS;
  half = d / 2;
  d = half + (int64_t)(r % (uint64_t)(d - half + 1));
  return d > 0 ? d : 1;
}

int embps__attempt_bounds(int64_t now, int64_t call_deadline, int64_t attempt_timeout_ms,
                          int64_t *deadline, int64_t *timeout_ms) {
  int64_t end = call_deadline;
  if (call_deadline > 0 && now >= call_deadline)
    return -1;
  if (attempt_timeout_ms > 0 && (end == 0 || now + attempt_timeout_ms < end))
    end = now + attempt_timeout_ms;
  *deadline = end;
  *timeout_ms = end > 0 ? end - now : 0;
  return 0;
}

void embps__verdict_add(embps__verdict_t *v, embps_status_t st) {
  if (st == EMBPS_OK)
    return;
  v->failed = 1;
  if (st == EMBPS_UNAVAILABLE || st == EMBPS_DEADLINE_EXCEEDED)
    v->cause = 1;
  else if (st != EMBPS_CANCELLED)
    v->final = 1;
}

int embps__verdict_retryable(const embps__verdict_t *v) {
  return v->failed && v->cause && !v->final;
}

int64_t embps__retry_at(int64_t now, int64_t call_deadline, uint32_t attempts,
                        uint32_t max_attempts, uint64_t r) {
  int64_t at;
  if (attempts >= max_attempts)
    return 0;
  at = now + embps__backoff_ms(attempts, r);
  if (call_deadline > 0 && at >= call_deadline)
    return 0;
  return at;
}

uint64_t embps__splitmix64(uint64_t *state) { return embps_splitmix64(state); }
