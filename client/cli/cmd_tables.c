/* `embps create-table`, `drop-table` and `tables`: the group's tables.
 *
 * create-table sends only what the user gave (zero is "the server's default") and prints the
 * specification the server answered, so the printed lr, eps, betas and init_scale are the ones
 * the table has, not a guess of the server's defaults made here. --rows makes a dense table and
 * --capacity a hash-keyed one; the hash-keyed options are refused here beside --rows (the server
 * would refuse them too) and otherwise checked by the server, whose messages name the field and
 * the remedy. `tables` lists what rank 0 holds, as text or JSON, with each table's kind. */
#include <stdio.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "common/dtype.h"
#include "common/eviction.h"
#include "common/optimizer.h"
#include "embps/embps.h"

/* An optimizer's name as the CLI prints it: the default's for EMBPS_OPTIMIZER_DEFAULT. */
static const char *optimizer_name(embps_optimizer_t o) {
  return embps_optimizer_name(o == EMBPS_OPTIMIZER_DEFAULT ? EMBPS_OPTIMIZER_SERVER_DEFAULT : o);
}

/* --optimizer's help: the registry's names, the server's default marked; and the names of
 * those that keep an accumulator, for --initial-accumulator's. String constants, expanded from
 * EMBPS_OPTIMIZERS, each item led by ", " which [2] skips. */
#define OPTIMIZER_HELP_ITEM(kind, name, dflt, ...) ", " name OPTIMIZER_MARK_##dflt
#define OPTIMIZER_MARK_0 ""
#define OPTIMIZER_MARK_1 " (default)"
#define OPTIMIZER_HELP (&(EMBPS_OPTIMIZERS(OPTIMIZER_HELP_ITEM))[2])
#define ACCUMULATOR_ITEM(kind, name, dflt, elem, row, acc, ...) ACCUMULATOR_##acc(name)
#define ACCUMULATOR_0(name)
#define ACCUMULATOR_1(name) ", " name
#define ACCUMULATOR_HELP                                                                           \
  (&(EMBPS_OPTIMIZERS(ACCUMULATOR_ITEM) ": the accumulators' initial value")[2])
/* --eviction's help: the registry's names (common/eviction.h), a string constant. */
#define EVICTION_HELP_ITEM(kind, name, dflt) " " name
#define EVICTION_HELP                                                                              \
  ("hash-keyed: who leaves a full table for a new key (policies:" EMBPS_EVICTIONS(                 \
      EVICTION_HELP_ITEM) "; default lru)")
#define DEFAULT_IS(x) "(0: " EMBPS_OPTIMIZER_STR(x) ")"

embps_cli_flag_t embps_cli_create_table_flags[] = {
    {"--rows", "R", "number of rows of a dense table (this or --capacity is required)", NULL},
    {"--capacity", "C",
     "slots of a hash-keyed table, whose tokens are any 64-bit ids (this or --rows is required)",
     NULL},
    {"--emb-width", "D", "values per row (required)", NULL},
    {"--dtype", "f32|bf16", "storage dtype (default f32)", NULL},
    {"--optimizer", "NAME", OPTIMIZER_HELP, NULL},
    {"--lr", "X", "learning rate " DEFAULT_IS(EMBPS_OPTIMIZER_DEFAULT_LR), NULL},
    {"--eps", "X", "epsilon " DEFAULT_IS(EMBPS_OPTIMIZER_DEFAULT_EPS), NULL},
    {"--half-life", "STEPS", "accumulator half-life in steps (0: no decay)", NULL},
    {"--weight-decay", "X", "L2 weight decay added to the gradient", NULL},
    {"--initial-accumulator", "X", ACCUMULATOR_HELP, NULL},
    {"--beta1", "X", "adam beta1 " DEFAULT_IS(EMBPS_OPTIMIZER_DEFAULT_BETA1), NULL},
    {"--beta2", "X", "adam beta2 " DEFAULT_IS(EMBPS_OPTIMIZER_DEFAULT_BETA2), NULL},
    {"--seed", "S", "seed of the initial rows", NULL},
    {"--init-scale", "X", "rows start uniform in [-X, X) (0: 1/sqrt(emb_width))", NULL},
    {"--admit-after", "K",
     "hash-keyed: store a key at the K-th push step that carries it (default 1: at once; at most "
     "255)",
     NULL},
    {"--eviction", "POLICY", EVICTION_HELP, NULL},
    {"--half-life-steps", "H", "hash-keyed, lfu: push steps over which a push's weight halves",
     NULL},
    {"--ttl-steps", "T", "hash-keyed, ttl: push steps without a push before a key expires", NULL},
    {"--sketch-width", "W",
     "hash-keyed, with --admit-after above 1: admission's counters per sketch row (0: the "
     "server's default)",
     NULL},
    {NULL, NULL, NULL, NULL}};

/* The flags only a hash-keyed table takes. */
static const char *const hash_flags[] = {"--admit-after", "--eviction", "--half-life-steps",
                                         "--ttl-steps", "--sketch-width"};

int embps_cli_table_spec_from_flags(const char *cmd, const embps_cli_flag_t *f,
                                    embps_table_spec_t *spec) {
  uint64_t rows = 0, capacity = 0, width, seed, admit, sketch;
  const char *dtype = embps_cli_flag(f, "--dtype"), *opt = embps_cli_flag(f, "--optimizer");
  const char *eviction = embps_cli_flag(f, "--eviction");
  int hash = embps_cli_flag(f, "--capacity") != NULL;
  char msg[256];
  int rc;

  if (!embps_cli_flag(f, "--rows") == !hash)
    return embps_cli_usage_error(cmd, "exactly one of --rows (a dense table) and --capacity (a "
                                      "hash-keyed table) is required");
  if (!embps_cli_flag(f, "--emb-width"))
    return embps_cli_usage_error(cmd, "--emb-width is required");
  for (size_t i = 0; !hash && i < sizeof(hash_flags) / sizeof(hash_flags[0]); i++)
    if (embps_cli_flag(f, hash_flags[i])) {
      snprintf(msg, sizeof(msg),
               "%s is an option of hash-keyed tables, and --rows makes a dense one: give "
               "--capacity instead of --rows, or leave %s out",
               hash_flags[i], hash_flags[i]);
      return embps_cli_usage_error(cmd, msg);
    }
  if ((rc = embps_cli_flag_u64(cmd, f, "--rows", 1, UINT64_MAX, 0, &rows)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--capacity", 1, UINT64_MAX, 0, &capacity)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--emb-width", 1, UINT32_MAX, 0, &width)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--seed", 0, UINT64_MAX, 0, &seed)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--admit-after", 0, UINT32_MAX, 0, &admit)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--half-life-steps", 0, UINT64_MAX, 0,
                               &spec->half_life_steps)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--ttl-steps", 0, UINT64_MAX, 0, &spec->ttl_steps)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--sketch-width", 0, UINT32_MAX, 0, &sketch)) ||
      (rc = embps_cli_flag_float(cmd, f, "--lr", &spec->lr)) ||
      (rc = embps_cli_flag_float(cmd, f, "--eps", &spec->eps)) ||
      (rc = embps_cli_flag_float(cmd, f, "--half-life", &spec->half_life)) ||
      (rc = embps_cli_flag_float(cmd, f, "--weight-decay", &spec->weight_decay)) ||
      (rc = embps_cli_flag_float(cmd, f, "--initial-accumulator", &spec->initial_accumulator)) ||
      (rc = embps_cli_flag_float(cmd, f, "--beta1", &spec->beta1)) ||
      (rc = embps_cli_flag_float(cmd, f, "--beta2", &spec->beta2)) ||
      (rc = embps_cli_flag_float(cmd, f, "--init-scale", &spec->init_scale)))
    return rc;
  if (spec->beta1 >= 1.0f || spec->beta2 >= 1.0f)
    return embps_cli_usage_error(cmd, "--beta1 and --beta2 must be below 1");
  spec->rows = rows;
  spec->capacity = capacity;
  spec->emb_width = (uint32_t)width;
  spec->seed = seed;
  spec->admit_after = (uint32_t)admit;
  spec->sketch_width = (uint32_t)sketch;
  spec->eviction = EMBPS_EVICTION_DEFAULT;
  if (eviction && embps_eviction_from_name(eviction, &spec->eviction) != EMBPS_OK) {
    snprintf(msg, sizeof(msg), "--eviction: expected one of %s", EMBPS_EVICTION_NAMES);
    return embps_cli_usage_error(cmd, msg);
  }
  if (!dtype || strcmp(dtype, "f32") == 0)
    spec->dtype = EMBPS_DTYPE_F32;
  else if (strcmp(dtype, "bf16") == 0)
    spec->dtype = EMBPS_DTYPE_BF16;
  else
    return embps_cli_usage_error(cmd, "--dtype: expected f32 or bf16");
  spec->optimizer = EMBPS_OPTIMIZER_DEFAULT;
  if (opt && embps_optimizer_from_name(opt, &spec->optimizer) != EMBPS_OK) {
    snprintf(msg, sizeof(msg), "--optimizer: expected one of %s", EMBPS_OPTIMIZER_NAMES);
    return embps_cli_usage_error(cmd, msg);
  }
  return 0;
}

/* A policy's name as the CLI prints it: the default's for EMBPS_EVICTION_DEFAULT. */
static const char *eviction_name(embps_eviction_t e) {
  return embps_eviction_name(e == EMBPS_EVICTION_DEFAULT ? EMBPS_EVICTION_SERVER_DEFAULT : e);
}

void embps_cli_print_created(FILE *out, const embps_table_spec_t *t) {
  fprintf(out, "created table %s: ", t->name);
  if (t->capacity)
    fprintf(out, "capacity %llu, ", (unsigned long long)t->capacity);
  else
    fprintf(out, "rows %llu, ", (unsigned long long)t->rows);
  fprintf(out,
          "emb_width %u, dtype %s, optimizer %s, lr %g, eps %g, half_life %g, "
          "initial_accumulator %g, weight_decay %g, beta1 %g, beta2 %g, seed %llu, init_scale %g",
          t->emb_width, embps_dtype_name(t->dtype), optimizer_name(t->optimizer), t->lr, t->eps,
          t->half_life, t->initial_accumulator, t->weight_decay, t->beta1, t->beta2,
          (unsigned long long)t->seed, t->init_scale);
  if (t->capacity)
    fprintf(out,
            ", admit_after %u, eviction %s, half_life_steps %llu, ttl_steps %llu, "
            "sketch_width %u",
            t->admit_after ? t->admit_after : 1, eviction_name(t->eviction),
            (unsigned long long)t->half_life_steps, (unsigned long long)t->ttl_steps,
            t->sketch_width);
  fprintf(out, "\n");
}

int embps_cli_cmd_create_table(const char *cmd, embps_cli_flag_t *f, const char *name) {
  embps_table_spec_t spec, *t;
  embps_client_t *c;
  embps_status_t st;
  int rc;

  embps_table_spec_init(&spec);
  spec.name = name;
  if ((rc = embps_cli_table_spec_from_flags(cmd, f, &spec)) != 0)
    return rc;
  if (!(c = embps_cli_connect(cmd, 1)))
    return 1;
  st = embps_create_table_answered(c, &spec, &t);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  embps_cli_print_created(stdout, t);
  embps_tables_free(t, 1);
  return 0;
}

embps_cli_flag_t embps_cli_drop_table_flags[] = {{NULL, NULL, NULL, NULL}};

int embps_cli_cmd_drop_table(const char *cmd, embps_cli_flag_t *f, const char *name) {
  embps_client_t *c;
  embps_status_t st;
  (void)f;
  if (!(c = embps_cli_connect(cmd, 1)))
    return 1;
  st = embps_drop_table(c, name);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  printf("dropped table %s\n", name);
  return 0;
}

embps_cli_flag_t embps_cli_tables_flags[] = {{"--json", NULL, "print a JSON array", NULL},
                                             {NULL, NULL, NULL, NULL}};

/* A hash-keyed table's settings as one word of the tables listing: "lfu,half_life_steps=100,
 * admit_after=2" (only what differs from the defaults besides the policy); "-" for a dense one. */
static void hash_settings(FILE *out, const embps_table_spec_t *t) {
  if (!t->capacity) {
    fputc('-', out);
    return;
  }
  fputs(eviction_name(t->eviction), out);
  if (t->half_life_steps)
    fprintf(out, ",half_life_steps=%llu", (unsigned long long)t->half_life_steps);
  if (t->ttl_steps)
    fprintf(out, ",ttl_steps=%llu", (unsigned long long)t->ttl_steps);
  if (t->admit_after > 1)
    fprintf(out, ",admit_after=%u", t->admit_after);
  if (t->sketch_width)
    fprintf(out, ",sketch_width=%u", t->sketch_width);
}

void embps_cli_print_tables(FILE *out, const embps_table_spec_t *t, size_t n, int json) {
  if (json) {
    fprintf(out, "[");
    for (size_t i = 0; i < n; i++) {
      fprintf(out, "%s{\"name\":", i ? "," : "");
      embps_cli_json_string(out, t[i].name);
      fprintf(out,
              ",\"kind\":\"%s\",\"rows\":%llu,\"capacity\":%llu,\"emb_width\":%u,\"dtype\":\"%s\","
              "\"optimizer\":\"%s\",\"lr\":%g,\"seed\":%llu",
              t[i].capacity ? "hash" : "dense", (unsigned long long)t[i].rows,
              (unsigned long long)t[i].capacity, t[i].emb_width, embps_dtype_name(t[i].dtype),
              optimizer_name(t[i].optimizer), t[i].lr, (unsigned long long)t[i].seed);
      if (t[i].capacity)
        fprintf(out,
                ",\"admit_after\":%u,\"eviction\":\"%s\",\"half_life_steps\":%llu,"
                "\"ttl_steps\":%llu,\"sketch_width\":%u",
                t[i].admit_after ? t[i].admit_after : 1, eviction_name(t[i].eviction),
                (unsigned long long)t[i].half_life_steps, (unsigned long long)t[i].ttl_steps,
                t[i].sketch_width);
      fprintf(out, "}");
    }
    fprintf(out, "]\n");
    return;
  }
  fprintf(out, "%-24s %5s %14s %10s %6s %-16s %s\n", "name", "kind", "rows/capacity", "emb_width",
          "dtype", "optimizer", "hash-keyed");
  for (size_t i = 0; i < n; i++) {
    fprintf(out, "%-24s %5s %14llu %10u %6s %-16s ", t[i].name, t[i].capacity ? "hash" : "dense",
            (unsigned long long)(t[i].capacity ? t[i].capacity : t[i].rows), t[i].emb_width,
            embps_dtype_name(t[i].dtype), optimizer_name(t[i].optimizer));
    hash_settings(out, &t[i]);
    fputc('\n', out);
  }
}

int embps_cli_cmd_tables(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  embps_table_spec_t *t;
  size_t n;
  embps_client_t *c = embps_cli_connect(cmd, 1);
  embps_status_t st;
  (void)pos;
  if (!c)
    return 1;
  st = embps_list_tables(c, &t, &n);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  embps_cli_print_tables(stdout, t, n, embps_cli_flag(f, "--json") != NULL);
  embps_tables_free(t, n);
  return 0;
}
