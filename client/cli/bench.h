/* `embps bench`: a load generator for lookups and pushes, closed loop or open loop. */
#ifndef EMBPS_CLI_BENCH_H
#define EMBPS_CLI_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "embps/embps.h"

typedef enum embps_bench_output {
  EMBPS_BENCH_TEXT,
  EMBPS_BENCH_JSON,
  EMBPS_BENCH_CSV
} embps_bench_output_t;

typedef struct embps_bench_opts {
  const uint64_t *batches; /* tokens per op: one size, or the sizes of a --mix */
  const double *weights;   /* relative frequency of each size (NULL: equal) */
  size_t nbatches;
  double duration_s;           /* measured time */
  double warmup_s;             /* unmeasured time before it */
  uint32_t concurrency;        /* threads, one client each */
  uint32_t pipeline;           /* calls in flight per thread (open loop: at most) */
  double rate;                 /* open loop: batches per second over all threads; 0: closed loop */
  double zipf;                 /* exponent; 0: uniform */
  uint64_t key_space;          /* ids drawn over ranks [1, key_space], hash-keyed tables' mixed
                                  by embps_key_mix; 0: embps_bench_key_space's default */
  double push_ratio;           /* probability that an op is a push */
  int async_push;              /* pushes use EMBPS_PUSH_ASYNC */
  embps_bench_output_t output; /* TEXT prints progress lines on stderr too */
  uint64_t seed;
} embps_bench_opts_t;

/** Runs the benchmark over the tables (their specs from ListTables; ops are spread evenly over
 * them) and prints the report. Batches that do not split over copts->group_size ranks are
 * refused before anything is sent unless copts->pad_batches. Returns 0; 1 after printing an
 * error to stderr (nothing ran) or when any call failed (the report says which, by status). */
int embps_cli_bench(const char *servers, const embps_client_options_t *copts,
                    const embps_table_spec_t *const *tables, size_t ntables,
                    const embps_bench_opts_t *o);

/* ---- feature batches (bench_features.c) ---- */

/** A run of features in a --features spec: count features of bag ids per sample each. */
typedef struct embps_bench_feature_group {
  uint32_t count;
  uint32_t bag;
  embps_pooling_t pooling;
} embps_bench_feature_group_t;

/** The most features one --features spec may describe (the servers' limit per request). */
#define EMBPS_BENCH_MAX_FEATURES 4096

/** Parses a --features spec, "26x1,1x100:sum,3x8:mean" (COUNTxBAG[:POOLING], POOLING one of
 * none, sum, mean and weighted_sum, sum when left out; COUNT >= 1, BAG in [1, 100000], at most
 * EMBPS_BENCH_MAX_FEATURES features in all), into a new array (freed with free()) of *n groups.
 * Returns 0, or -1 with a message naming the bad item in err. */
int embps_bench_parse_features(const char *spec, embps_bench_feature_group_t **out, size_t *n,
                               char *err, size_t errlen);

/** How a feature bench runs. */
typedef struct embps_bench_features {
  const char *spec;                          /* the --features text, for the report */
  const embps_bench_feature_group_t *groups; /* parsed from it */
  size_t ngroups;
  int per_table; /* the baseline: one Lookup or PushGradients per table and step, every feature
                    of the table in it, pooled (and a push's gradients expanded) by the client */
} embps_bench_features_t;

/** Runs the feature bench: each step is a batch of o->batches[0] samples of every feature
 * (feature i on tables[i % ntables], bags of its group's size, ids drawn as embps_cli_bench
 * draws tokens), one LookupFeatures or PushFeatures per rank (o->push_ratio of them pushes), or
 * with fo->per_table the same step as one Lookup or PushGradients per table. Closed loop only:
 * o->concurrency threads keep o->pipeline steps in flight each. Prints the report (samples/s,
 * steps/s, ids/s, latency percentiles, errors, the client's CPU). Returns as embps_cli_bench(). */
int embps_cli_bench_features(const char *servers, const embps_client_options_t *copts,
                             const embps_table_spec_t *const *tables, size_t ntables,
                             const embps_bench_opts_t *o, const embps_bench_features_t *fo);

#endif
