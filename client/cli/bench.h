/* `embps bench`: a closed-loop load generator for lookups and pushes. */
#ifndef EMBPS_CLI_BENCH_H
#define EMBPS_CLI_BENCH_H

#include <stdint.h>

#include "embps/embps.h"

typedef struct embps_bench_opts {
  uint64_t batch;       /* tokens per op */
  double duration_s;    /* measured time */
  double warmup_s;      /* unmeasured time before it */
  uint32_t concurrency; /* threads, one client each */
  uint32_t pipeline;    /* calls in flight per thread */
  double zipf;          /* exponent; 0: uniform */
  double push_ratio;    /* probability that an op is a push */
  int async_push;       /* pushes use EMBPS_PUSH_ASYNC */
  int json;             /* one JSON object on stdout, no progress lines */
  uint64_t seed;
} embps_bench_opts_t;

/** Runs the benchmark against table (its spec from ListTables) and prints the report.
 * Returns 0, or 1 after printing an error to stderr. */
int embps_cli_bench(const char *servers, const embps_client_options_t *copts,
                    const embps_table_spec_t *table, const embps_bench_opts_t *o);

#endif
