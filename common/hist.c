/* Histograms for metrics (hist.h): a linear search over at most 20 bounds and two relaxed
 * atomic adds per observation; nothing here allocates or locks. */
#include "common/hist.h"

#include <string.h>

const double embps_hist_seconds_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                            0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                            1,      2.5,     5,      10};
const size_t embps_hist_seconds_nbounds =
    sizeof(embps_hist_seconds_bounds) / sizeof(embps_hist_seconds_bounds[0]);
const double embps_hist_long_seconds_bounds[] = {0.01, 0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                                 5,    10,   30,  60,   120, 300, 1800};
const size_t embps_hist_long_seconds_nbounds =
    sizeof(embps_hist_long_seconds_bounds) / sizeof(embps_hist_long_seconds_bounds[0]);
const double embps_hist_count_bounds[] = {1,   2,    4,    8,    16,   32,    64,    128,  256,
                                          512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
const size_t embps_hist_count_nbounds =
    sizeof(embps_hist_count_bounds) / sizeof(embps_hist_count_bounds[0]);

void embps_hist_init(embps_hist_t *h, const double *bounds, size_t nbounds) {
  memset(h, 0, sizeof(*h));
  h->bounds = bounds;
  h->nbounds = nbounds > EMBPS_HIST_MAX_BUCKETS ? EMBPS_HIST_MAX_BUCKETS : nbounds;
}

void embps_hist_observe(embps_hist_t *h, double v) {
  size_t b = 0;
  while (b < h->nbounds && v > h->bounds[b])
    b++;
  atomic_fetch_add_explicit(&h->counts[b], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&h->sum_nanos, (uint_fast64_t)(v > 0 ? v * 1e9 : 0),
                            memory_order_relaxed);
  atomic_fetch_add_explicit(&h->count, 1, memory_order_relaxed);
}
