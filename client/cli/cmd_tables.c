/* `embps create-table`, `drop-table` and `tables`: the group's tables.
 *
 * create-table sends only what the user gave (zero is "the server's default") and prints the
 * specification the server answered, so the printed lr, eps, betas and init_scale are the ones
 * the table has, not a guess of the server's defaults made here. `tables` lists what rank 0
 * holds, as text or JSON. */
#include <stdio.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "common/dtype.h"
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
#define DEFAULT_IS(x) "(0: " EMBPS_OPTIMIZER_STR(x) ")"

embps_cli_flag_t embps_cli_create_table_flags[] = {
    {"--rows", "R", "number of rows (required)", NULL},
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
    {NULL, NULL, NULL, NULL}};

/* Reads the flags into spec (name excluded). Returns 0 or EMBPS_CLI_EXIT_USAGE (printed). */
static int spec_from_flags(const char *cmd, const embps_cli_flag_t *f, embps_table_spec_t *spec) {
  uint64_t rows, width, seed;
  const char *dtype = embps_cli_flag(f, "--dtype"), *opt = embps_cli_flag(f, "--optimizer");
  char msg[128];
  int rc;

  if (!embps_cli_flag(f, "--rows") || !embps_cli_flag(f, "--emb-width"))
    return embps_cli_usage_error(cmd, "--rows and --emb-width are required");
  if ((rc = embps_cli_flag_u64(cmd, f, "--rows", 1, UINT64_MAX, 0, &rows)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--emb-width", 1, UINT32_MAX, 0, &width)) ||
      (rc = embps_cli_flag_u64(cmd, f, "--seed", 0, UINT64_MAX, 0, &seed)) ||
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
  spec->emb_width = (uint32_t)width;
  spec->seed = seed;
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

int embps_cli_cmd_create_table(const char *cmd, embps_cli_flag_t *f, const char *name) {
  embps_table_spec_t spec, *t;
  embps_client_t *c;
  embps_status_t st;
  int rc;

  embps_table_spec_init(&spec);
  spec.name = name;
  if ((rc = spec_from_flags(cmd, f, &spec)) != 0)
    return rc;
  if (!(c = embps_cli_connect(cmd, 1)))
    return 1;
  st = embps_create_table_answered(c, &spec, &t);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  printf("created table %s: rows %llu, emb_width %u, dtype %s, optimizer %s, lr %g, eps %g, "
         "half_life %g, initial_accumulator %g, weight_decay %g, beta1 %g, beta2 %g, seed %llu, "
         "init_scale %g\n",
         t->name, (unsigned long long)t->rows, t->emb_width, embps_dtype_name(t->dtype),
         optimizer_name(t->optimizer), t->lr, t->eps, t->half_life, t->initial_accumulator,
         t->weight_decay, t->beta1, t->beta2, (unsigned long long)t->seed, t->init_scale);
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
  if (embps_cli_flag(f, "--json")) {
    printf("[");
    for (size_t i = 0; i < n; i++) {
      printf("%s{\"name\":", i ? "," : "");
      embps_cli_json_string(stdout, t[i].name);
      printf(",\"rows\":%llu,\"emb_width\":%u,\"dtype\":\"%s\",\"optimizer\":\"%s\","
             "\"lr\":%g,\"seed\":%llu}",
             (unsigned long long)t[i].rows, t[i].emb_width, embps_dtype_name(t[i].dtype),
             optimizer_name(t[i].optimizer), t[i].lr, (unsigned long long)t[i].seed);
    }
    printf("]\n");
  } else {
    printf("%-24s %14s %10s %6s %s\n", "name", "rows", "emb_width", "dtype", "optimizer");
    for (size_t i = 0; i < n; i++)
      printf("%-24s %14llu %10u %6s %s\n", t[i].name, (unsigned long long)t[i].rows, t[i].emb_width,
             embps_dtype_name(t[i].dtype), optimizer_name(t[i].optimizer));
  }
  embps_tables_free(t, n);
  return 0;
}
