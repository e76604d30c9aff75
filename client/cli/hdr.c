/* The log-linear latency histogram of `embps bench` (see hdr.h).
 *
 * Bucket index of a value v: below 2^(SUB_BITS+1) it is v itself; above, with e the number of
 * bits v has beyond SUB_BITS+1, v >> e lies in [2^SUB_BITS, 2^(SUB_BITS+1)) and the index is
 * (e + 1) * 2^SUB_BITS + (v >> e) - 2^SUB_BITS, which continues the linear part without a gap.
 * Exact latencies per op (a sorted array, as the bench kept before) cost memory that grows with
 * the run; an open-loop run of hours at thousands of calls a second would need gigabytes. */
#include "client/cli/hdr.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SUB ((uint64_t)1 << EMBPS_HDR_SUB_BITS)

static size_t bucket_of(uint64_t v) {
  unsigned bits, e;
  size_t i;
  if (v < 2 * SUB)
    return (size_t)v;
  bits = 64u - (unsigned)__builtin_clzll(v); /* v < 2^bits */
  e = bits - (EMBPS_HDR_SUB_BITS + 1);
  i = ((size_t)(e + 1) << EMBPS_HDR_SUB_BITS) + (size_t)((v >> e) - SUB);
  return i < EMBPS_HDR_BUCKETS ? i : EMBPS_HDR_BUCKETS - 1;
}

/* The highest value bucket i holds. */
static uint64_t bucket_high(size_t i) {
  size_t e1 = i >> EMBPS_HDR_SUB_BITS; /* e + 1, or 0/1 in the linear part */
  if (e1 <= 1)
    return (uint64_t)i;
  {
    unsigned e = (unsigned)e1 - 1;
    uint64_t sub = (uint64_t)(i & (SUB - 1)) + SUB;
    return ((sub + 1) << e) - 1;
  }
}

int embps_hdr_init(embps_hdr_t *h) {
  memset(h, 0, sizeof(*h));
  h->counts = calloc(EMBPS_HDR_BUCKETS, sizeof(*h->counts));
  return h->counts ? 0 : -1;
}

void embps_hdr_free(embps_hdr_t *h) {
  free(h->counts);
  memset(h, 0, sizeof(*h));
}

void embps_hdr_record(embps_hdr_t *h, uint64_t ns) {
  h->counts[bucket_of(ns)]++;
  if (h->count == 0 || ns < h->min)
    h->min = ns;
  if (ns > h->max)
    h->max = ns;
  h->count++;
  h->sum += (double)ns;
}

void embps_hdr_add(embps_hdr_t *dst, const embps_hdr_t *src) {
  if (src->count == 0)
    return;
  for (size_t i = 0; i < EMBPS_HDR_BUCKETS; i++)
    dst->counts[i] += src->counts[i];
  if (dst->count == 0 || src->min < dst->min)
    dst->min = src->min;
  if (src->max > dst->max)
    dst->max = src->max;
  dst->count += src->count;
  dst->sum += src->sum;
}

uint64_t embps_hdr_percentile(const embps_hdr_t *h, double p) {
  uint64_t rank, seen = 0;
  if (h->count == 0)
    return 0;
  rank = (uint64_t)ceil(p / 100.0 * (double)h->count);
  if (rank < 1)
    rank = 1;
  if (rank > h->count)
    rank = h->count;
  for (size_t i = 0; i < EMBPS_HDR_BUCKETS; i++) {
    seen += h->counts[i];
    if (seen >= rank) {
      uint64_t v = i == EMBPS_HDR_BUCKETS - 1 ? h->max : bucket_high(i); /* the last is open */
      if (v > h->max)
        v = h->max;
      return v < h->min ? h->min : v;
    }
  }
  return h->max;
}

double embps_hdr_mean(const embps_hdr_t *h) { return h->count ? h->sum / (double)h->count : 0.0; }

uint64_t embps_hdr_count_at_most(const embps_hdr_t *h, uint64_t ns) {
  size_t last = bucket_of(ns);
  uint64_t n = 0;
  for (size_t i = 0; i <= last; i++)
    n += h->counts[i];
  return n;
}
