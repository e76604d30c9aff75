/* A latency histogram with three significant digits (HdrHistogram's log-linear layout).
 *
 * Values are nanoseconds. Values below 2048 have a bucket each; above, every power of two
 * [2^k, 2^(k+1)) is split into 1024 equal buckets, so a bucket is at most 1/1024 of its values
 * wide and a percentile read from it is within 0.1% of the exact one. Buckets run up to 2^44 ns
 * (about 4.9 hours); larger values are counted in the last one. The counts take 290 KB; a
 * histogram is filled by one thread and merged into another with embps_hdr_add(). */
#ifndef EMBPS_CLI_HDR_H
#define EMBPS_CLI_HDR_H

#include <stddef.h>
#include <stdint.h>

#define EMBPS_HDR_SUB_BITS 10
#define EMBPS_HDR_MAX_EXP 44
#define EMBPS_HDR_BUCKETS                                                                          \
  ((size_t)(EMBPS_HDR_MAX_EXP - EMBPS_HDR_SUB_BITS + 1) << EMBPS_HDR_SUB_BITS)

typedef struct embps_hdr {
  uint64_t count, min, max;
  double sum;
  uint64_t *counts; /* EMBPS_HDR_BUCKETS entries */
} embps_hdr_t;

/** Makes an empty histogram. Returns 0, or -1 when out of memory (h is then empty and
 * embps_hdr_free() may still be called on it). */
int embps_hdr_init(embps_hdr_t *h);

/** Frees the counts; h may be zeroed or failed to init. */
void embps_hdr_free(embps_hdr_t *h);

/** Counts one value (nanoseconds). */
void embps_hdr_record(embps_hdr_t *h, uint64_t ns);

/** Adds every count of src to dst. */
void embps_hdr_add(embps_hdr_t *dst, const embps_hdr_t *src);

/** The value at percentile p (0 < p <= 100) by nearest rank: the highest value its bucket
 * holds, never above the largest value recorded. 0 when the histogram is empty. */
uint64_t embps_hdr_percentile(const embps_hdr_t *h, double p);

/** Mean of the recorded values in nanoseconds (0 when empty). */
double embps_hdr_mean(const embps_hdr_t *h);

/** Number of values recorded at most `ns` (at bucket resolution: a bucket counts whole when
 * `ns` falls inside it). */
uint64_t embps_hdr_count_at_most(const embps_hdr_t *h, uint64_t ns);

#endif
