/* `embps bench`: the load test's command line.
 *
 * Reads the flags into embps_bench_opts_t, checks that every named table exists and has rows to
 * draw from (a dense table's rows hold --key-space; a hash-keyed table takes any), and hands the
 * tables' specs to the load generator (bench.c, or bench_features.c with --features), whose threads
 * open their own connections (this one is closed first). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/cli.h"
#include "client/cli/zipf.h"
#include "embps/embps.h"

embps_cli_flag_t embps_cli_bench_flags[] = {
    {"--batch", "T", "tokens per op (this or --mix is required); with --features, samples per step",
     NULL},
    {"--mix", "T:W,...", "batch sizes with weights, e.g. 1024:3,4096:1 (a size alone weighs 1)",
     NULL},
    {"--tables", "NAME,...", "more tables to spread the ops over, evenly", NULL},
    {"--duration", "S", "measured seconds (default 10)", NULL},
    {"--warmup", "S", "unmeasured seconds first, excluded from the figures (default 1)", NULL},
    {"--concurrency", "C", "threads, each with its own connections (default 1)", NULL},
    {"--pipeline", "K",
     "calls in flight per thread (default 1; with --rate, the most in flight, default 64)", NULL},
    {"--rate", "R",
     "open loop: R batches per second over all threads on a fixed schedule, latency from each "
     "call's intended start (default: closed loop)",
     NULL},
    {"--tokens", "DIST",
     "token ids over [1, rows) or --key-space: uniform (default; every row alike, so batches reach "
     "memory) or "
     "zipf (exponent --zipf, default 1.05)",
     NULL},
    {"--key-space", "N",
     "ids drawn over N ranks: a dense table's are [1, N] (N below rows; default rows - 1), a "
     "hash-keyed table's are mapped by a fixed 64-bit mixing over the whole 64-bit range "
     "(default 10 x capacity, so a full table evicts)",
     NULL},
    {"--zipf", "A", "Zipf exponent of token ids; alone, the same as --tokens zipf (0: uniform)",
     NULL},
    {"--push-ratio", "P", "probability that an op is a push (default 0)", NULL},
    {"--async", NULL, "pushes are async", NULL},
    {"--seed", "S", "random seed (default 1)", NULL},
    {"--output", "FORMAT",
     "text (default), json (today's keys, ghz's and the client's CPU time) or csv", NULL},
    {"--json", NULL, "the same as --output json", NULL},
    {"--features", "SPEC",
     "load a feature set instead: each step one batch of --batch samples of COUNTxBAG[:POOLING] "
     "features (e.g. 26x1,1x100:sum,3x8:mean; pooling none, sum (default), mean or "
     "weighted_sum), feature i on table i mod the tables named, in one call per rank",
     NULL},
    {"--per-table", NULL,
     "with --features: the same steps as one lookup or push per table, pooled (and gradients "
     "expanded) by the client, the baseline feature batches replace",
     NULL},
    {NULL, NULL, NULL, NULL}};

/* Adds the comma-separated names in list to names (no copies: the pointers point into list's
 * copy *buf, which the caller frees). */
static int split_names(const char *cmd, const char *list, char **buf, const char ***names,
                       size_t *n) {
  char *copy = strdup(list), *save = NULL;
  const char **more;
  size_t count = 1;
  for (const char *p = list; *p; p++)
    count += *p == ',';
  more = realloc((void *)*names, (*n + count) * sizeof(**names));
  if (!copy || !more) {
    free(copy);
    if (more)
      *names = more;
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    return 1;
  }
  *names = more;
  *buf = copy;
  for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save))
    more[(*n)++] = t;
  return 0;
}

int embps_cli_cmd_bench(const char *cmd, embps_cli_flag_t *f, const char *name) {
  embps_bench_opts_t o;
  embps_bench_features_t fo;
  embps_bench_feature_group_t *groups = NULL;
  uint64_t conc, pipe, one_batch = 0, *mix = NULL;
  double *weights = NULL;
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t **chosen = NULL;
  const char **names = NULL, *out = embps_cli_flag(f, "--output");
  char *names_buf[2] = {NULL, NULL};
  size_t nt = 0, nnames = 0;
  char err[640];
  embps_client_t *c;
  int rc;

  memset(&o, 0, sizeof(o));
  memset(&fo, 0, sizeof(fo));
  if (!embps_cli_flag(f, "--batch") == !embps_cli_flag(f, "--mix"))
    return embps_cli_usage_error(cmd, "exactly one of --batch and --mix is required");
  if (embps_cli_flag(f, "--per-table") && !embps_cli_flag(f, "--features"))
    return embps_cli_usage_error(cmd, "--per-table runs a --features bench: give --features too");
  if (embps_cli_flag(f, "--features") &&
      (embps_cli_flag(f, "--mix") || embps_cli_flag(f, "--rate") ||
       (out && strcmp(out, "csv") == 0)))
    return embps_cli_usage_error(cmd, "--features takes --batch (samples per step) and runs "
                                      "closed loop only (no --mix, no --rate), text or json");
  if ((rc = embps_cli_flag_double(cmd, f, "--duration", 0.001, 1e7, 10.0, &o.duration_s)) ||
      (rc = embps_cli_flag_double(cmd, f, "--warmup", 0.0, 1e7, 1.0, &o.warmup_s)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--concurrency", 1, 4096, 1, &conc)) ||
      (rc = embps_cli_flag_double(cmd, f, "--rate", 0.0, 1e7, 0.0, &o.rate)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--pipeline", 1, 4096, o.rate > 0 ? 64 : 1, &pipe)) ||
      (rc = embps_cli_flag_double(cmd, f, "--zipf", 0.0, 100.0, 0.0, &o.zipf)) ||
      (rc = embps_token_exponent(embps_cli_flag(f, "--tokens"), embps_cli_flag(f, "--zipf"), o.zipf,
                                 &o.zipf)
                ? embps_cli_usage_error(cmd,
                                        "--tokens takes uniform or zipf, and --tokens uniform no "
                                        "--zipf other than 0")
                : 0) ||
      (rc = embps_cli_flag_double(cmd, f, "--push-ratio", 0.0, 1.0, 0.0, &o.push_ratio)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--key-space", 1, EMBPS_KEY_SPACE_MAX, 0, &o.key_space)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--seed", 0, UINT64_MAX, 1, &o.seed)))
    return rc;
  if (embps_cli_flag(f, "--batch")) {
    if ((rc = embps_cli_flag_u64(cmd, f, "--batch", 1, 1u << 24, 0, &one_batch)))
      return rc;
    o.batches = &one_batch;
    o.nbatches = 1;
  } else {
    if (embps_cli_parse_mix("--mix", embps_cli_flag(f, "--mix"), 1u << 24, &mix, &weights,
                            &o.nbatches, err, sizeof(err)) != 0)
      return embps_cli_usage_error(cmd, err);
    o.batches = mix;
    o.weights = weights;
  }
  if (embps_cli_flag(f, "--features")) { /* --mix was refused: nothing to free yet */
    if (embps_bench_parse_features(embps_cli_flag(f, "--features"), &groups, &fo.ngroups, err,
                                   sizeof(err)) != 0)
      return embps_cli_usage_error(cmd, err);
    fo.spec = embps_cli_flag(f, "--features");
    fo.groups = groups;
    fo.per_table = embps_cli_flag(f, "--per-table") != NULL;
  }
  o.concurrency = (uint32_t)conc;
  o.pipeline = (uint32_t)pipe;
  o.async_push = embps_cli_flag(f, "--async") != NULL;
  o.output = EMBPS_BENCH_TEXT;
  if (embps_cli_flag(f, "--json") || (out && strcmp(out, "json") == 0))
    o.output = EMBPS_BENCH_JSON;
  else if (out && strcmp(out, "csv") == 0)
    o.output = EMBPS_BENCH_CSV;
  else if (out && strcmp(out, "text") != 0) {
    free(mix);
    free(weights);
    free(groups);
    return embps_cli_usage_error(cmd, "--output must be text, json or csv");
  }
  rc = 1;
  if (split_names(cmd, name, &names_buf[0], &names, &nnames) ||
      (embps_cli_flag(f, "--tables") &&
       split_names(cmd, embps_cli_flag(f, "--tables"), &names_buf[1], &names, &nnames)))
    goto exit;
  if (nnames == 0) {
    rc = embps_cli_usage_error(cmd, "no table named");
    goto exit;
  }
  if (!(chosen = calloc(nnames, sizeof(*chosen))) || !(c = embps_cli_connect(cmd, 1)))
    goto exit;
  for (size_t i = 0; i < nnames; i++) {
    const embps_table_spec_t *t;
    embps_tables_free(tables, nt);
    tables = NULL;
    nt = 0;
    if (embps_cli_find_table(cmd, c, names[i], &tables, &nt, &t) != 0)
      goto exit;
    if (!t->capacity && t->rows < 2) {
      fprintf(stderr, "embps: %s: table %s has %llu rows; bench draws tokens from [1, rows)\n", cmd,
              names[i], (unsigned long long)t->rows);
      goto exit;
    }
    if (!t->capacity && o.key_space >= t->rows) {
      fprintf(stderr,
              "embps: %s: --key-space %llu does not fit table %s, a dense table of %llu rows "
              "whose ids lie in [1, rows): lower --key-space below %llu, or bench a hash-keyed "
              "table\n",
              cmd, (unsigned long long)o.key_space, names[i], (unsigned long long)t->rows,
              (unsigned long long)t->rows);
      goto exit;
    }
  }
  for (size_t i = 0; i < nnames; i++)
    for (size_t j = 0; j < nt; j++)
      if (strcmp(tables[j].name, names[i]) == 0)
        chosen[i] = &tables[j];
  {
    embps_client_options_t wo = embps_cli_options();
    wo.group_size = embps_client_group_size(c);
    embps_cli_disconnect();
    rc = fo.groups ? embps_cli_bench_features(embps_cli_servers(), &wo, chosen, nnames, &o, &fo)
                   : embps_cli_bench(embps_cli_servers(), &wo, chosen, nnames, &o);
  }
exit:
  embps_tables_free(tables, nt);
  free(chosen);
  free((void *)names);
  free(names_buf[0]);
  free(names_buf[1]);
  free(mix);
  free(weights);
  free(groups);
  return rc;
}
