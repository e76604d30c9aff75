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

#endif
