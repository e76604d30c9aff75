/* Histograms for metrics: fixed bucket bounds chosen by the caller, counts kept in relaxed
 * atomics, so that the serving threads observe with a few uncontended atomic adds and a scrape
 * on another thread reads them without a lock. A common tool, so that any layer may keep one;
 * the server's exposition (server/metrics/metrics.h) reads them. A reader may see a sum a
 * moment ahead of or behind a bucket: Prometheus tolerates that, as its own client libraries do
 * the same. */
#ifndef EMBPS_COMMON_HIST_H
#define EMBPS_COMMON_HIST_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/** Most finite bucket bounds a histogram has (the +Inf bucket is implied). */
#define EMBPS_HIST_MAX_BUCKETS 20

typedef struct embps_hist {
  const double *bounds; /* ascending upper bounds, nbounds of them; static storage, borrowed */
  size_t nbounds;
  atomic_uint_fast64_t counts[EMBPS_HIST_MAX_BUCKETS + 1]; /* per bucket (not cumulative) */
  atomic_uint_fast64_t count;
  atomic_uint_fast64_t sum_nanos; /* the sum, in units of 1e-9 (seconds as ns; counts x 1e9) */
} embps_hist_t;

/** Latency bounds in seconds, 100 us to 10 s. */
extern const double embps_hist_seconds_bounds[];
extern const size_t embps_hist_seconds_nbounds;
/** Long durations in seconds (checkpoints), 10 ms to 30 min. */
extern const double embps_hist_long_seconds_bounds[];
extern const size_t embps_hist_long_seconds_nbounds;
/** Counts: 1, 2, 4, ..., 65536. */
extern const double embps_hist_count_bounds[];
extern const size_t embps_hist_count_nbounds;

/** Sets h empty over bounds (borrowed: static storage; at most EMBPS_HIST_MAX_BUCKETS). */
void embps_hist_init(embps_hist_t *h, const double *bounds, size_t nbounds);

/** Counts one observation of v (any thread). */
void embps_hist_observe(embps_hist_t *h, double v);

/** Counts one observation of ns nanoseconds, as seconds (any thread). */
static inline void embps_hist_observe_ns(embps_hist_t *h, uint64_t ns) {
  embps_hist_observe(h, (double)ns * 1e-9);
}

#endif
