/* `embps`: the command-line tool of a shard group (admin, lookup/push, load test).
 *
 * It uses only the public libembps API, with common/'s helpers over its types (dtype sizes and
 * bf16 conversions, error set/clear). The global settings are declared once in a table
 * (flag, environment variable, default, help) that both reads them and prints --help; each
 * command declares its flags the same way, so `embps COMMAND --help` is generated from the
 * code that parses it. Numbers are parsed strictly (args.c). Failures print
 * "embps: COMMAND: STATUS: message" with the server's message on stderr and exit 1; usage
 * errors exit 2. */
#include <ctype.h>
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/zipf.h"
#include "common/dtype.h"
#include "common/status.h"
#include "embps/embps.h"

#define EXIT_USAGE 2

/* ---- settings and flags ---- */

typedef struct setting {
  const char *flag;
  const char *env;
  const char *def;
  const char *help;
  const char *value;
} setting_t;

enum {
  S_SERVERS,
  S_DEADLINE,
  S_CONNECT_TIMEOUT,
  S_PAD,
  S_TOKEN_FILE,
  S_TLS_CA,
  S_TLS_CERT,
  S_TLS_KEY,
  S_TLS_SERVER_NAME,
  S_COUNT
};

static setting_t settings[S_COUNT] = {
    [S_SERVERS] = {"--servers", "EMBPS_SERVERS", "127.0.0.1:7070",
                   "HOST:PORT[,HOST:PORT...] of every rank, in rank order", NULL},
    [S_DEADLINE] = {"--deadline-ms", "EMBPS_DEADLINE_MS", "0",
                    "deadline of each call in milliseconds (0: none)", NULL},
    [S_CONNECT_TIMEOUT] = {"--connect-timeout-ms", "EMBPS_CONNECT_TIMEOUT_MS", "10000",
                           "deadline of connecting to each server, in milliseconds", NULL},
    [S_PAD] = {"--pad", "EMBPS_PAD", "0",
               "pad batches with token 0 up to a multiple of the group size (--pad=0|1)", NULL},
    [S_TOKEN_FILE] = {"--token-file", "EMBPS_TOKEN_FILE", "",
                      "file holding the bearer token sent on every call (servers with "
                      "--auth-tokens-file); empty: none",
                      NULL},
    [S_TLS_CA] = {"--tls-ca", "EMBPS_TLS_CA", "",
                  "connect with TLS, trusting the CA certificates in this PEM file (empty: "
                  "cleartext)",
                  NULL},
    /* Not EMBPS_TLS_CERT: that is the server's own certificate, and the CLI often runs in the
     * server's container. */
    [S_TLS_CERT] = {"--tls-cert", "EMBPS_TLS_CLIENT_CERT", "",
                    "mutual TLS: this client's PEM certificate (with --tls-key)", NULL},
    [S_TLS_KEY] = {"--tls-key", "EMBPS_TLS_CLIENT_KEY", "", "the PEM private key of --tls-cert",
                   NULL},
    [S_TLS_SERVER_NAME] = {"--tls-server-name", "EMBPS_TLS_SERVER_NAME", "",
                           "the name the servers' certificates must carry (empty: each "
                           "address's host)",
                           NULL},
};

typedef struct flag {
  const char *name; /* "--rows" */
  const char *arg;  /* "R" for a flag with a value, NULL for a switch */
  const char *help;
  const char *value; /* set by parse_flags; "1" for a switch */
} flag_t;

typedef struct command {
  const char *name;
  const char *positional; /* "NAME" or NULL */
  const char *summary;
  int (*run)(const char *cmd, flag_t *flags, const char *pos);
  flag_t *flags;
} command_t;

static char g_err[640];

static void usage_global(FILE *f);

static void usage_command(FILE *f, const command_t *c) {
  fprintf(f, "usage: embps [GLOBAL OPTIONS] %s%s%s [OPTIONS]\n\n%s\n\noptions:\n", c->name,
          c->positional ? " " : "", c->positional ? c->positional : "", c->summary);
  for (flag_t *fl = c->flags; fl && fl->name; fl++) {
    char left[64];
    snprintf(left, sizeof(left), "%s%s%s", fl->name, fl->arg ? " " : "", fl->arg ? fl->arg : "");
    fprintf(f, "  %-26s %s\n", left, fl->help);
  }
  fprintf(f, "  %-26s %s\n", "--help", "show this help");
}

static const char *flag(const flag_t *flags, const char *name) {
  for (const flag_t *fl = flags; fl->name; fl++)
    if (strcmp(fl->name, name) == 0)
      return fl->value;
  return NULL;
}

/* Parses argv into flags and at most one positional; prints and returns EXIT_USAGE on error,
 * 0 on success, -1 when --help was printed. */
static int parse_flags(const command_t *c, int argc, char **argv, const char **pos) {
  *pos = NULL;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage_command(stdout, c);
      return -1;
    }
    if (strncmp(a, "--", 2) == 0) {
      const char *eq = strchr(a, '=');
      size_t len = eq ? (size_t)(eq - a) : strlen(a);
      flag_t *fl;
      for (fl = c->flags; fl && fl->name; fl++)
        if (strlen(fl->name) == len && strncmp(fl->name, a, len) == 0)
          break;
      if (!fl || !fl->name) {
        fprintf(stderr, "embps: %s: unknown option '%.*s' (see embps %s --help)\n", c->name,
                (int)len, a, c->name);
        return EXIT_USAGE;
      }
      if (!fl->arg) {
        if (eq) {
          fprintf(stderr, "embps: %s: %s takes no value\n", c->name, fl->name);
          return EXIT_USAGE;
        }
        fl->value = "1";
      } else if (eq) {
        fl->value = eq + 1;
      } else if (i + 1 < argc) {
        fl->value = argv[++i];
      } else {
        fprintf(stderr, "embps: %s: %s needs a value %s\n", c->name, fl->name, fl->arg);
        return EXIT_USAGE;
      }
      continue;
    }
    if (c->positional && !*pos) {
      *pos = a;
      continue;
    }
    fprintf(stderr, "embps: %s: unexpected argument '%s' (see embps %s --help)\n", c->name, a,
            c->name);
    return EXIT_USAGE;
  }
  if (c->positional && !*pos) {
    fprintf(stderr, "embps: %s: missing %s (see embps %s --help)\n", c->name, c->positional,
            c->name);
    return EXIT_USAGE;
  }
  return 0;
}

static int usage_error(const char *cmd, const char *msg) {
  fprintf(stderr, "embps: %s: %s\n", cmd, msg);
  return EXIT_USAGE;
}

/* Value helpers: each returns 0, or prints a usage error and returns EXIT_USAGE. */
static int get_u64(const char *cmd, const flag_t *flags, const char *name, uint64_t min,
                   uint64_t max, uint64_t def, uint64_t *out) {
  const char *v = flag(flags, name);
  if (!v) {
    *out = def;
    return 0;
  }
  if (embps_cli_parse_u64(name, v, min, max, out, g_err, sizeof(g_err)) != 0)
    return usage_error(cmd, g_err);
  return 0;
}

static int get_double(const char *cmd, const flag_t *flags, const char *name, double min,
                      double max, double def, double *out) {
  const char *v = flag(flags, name);
  if (!v) {
    *out = def;
    return 0;
  }
  if (embps_cli_parse_double(name, v, min, max, out, g_err, sizeof(g_err)) != 0)
    return usage_error(cmd, g_err);
  return 0;
}

static int get_float(const char *cmd, const flag_t *flags, const char *name, float *out) {
  double d;
  int rc = get_double(cmd, flags, name, 0.0, 3.4e38, 0.0, &d);
  *out = (float)d;
  return rc;
}

/* ---- the client ---- */

static embps_client_t *g_client;
static embps_client_options_t g_opts;
static char g_token[1024];

/* Reads the bearer token from path into g_token: the file's text without the whitespace
 * around it (a trailing newline, as editors and `kubectl create secret` leave). Returns 0, or
 * -1 with the reason in g_err (never the token's text). */
static int read_token_file(const char *path) {
  size_t len, start = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(g_err, sizeof(g_err), "--token-file %.300s: %s", path, strerror(errno));
    return -1;
  }
  len = fread(g_token, 1, sizeof(g_token), f);
  fclose(f);
  if (len == sizeof(g_token)) {
    snprintf(g_err, sizeof(g_err), "--token-file %.300s: longer than %zu bytes", path,
             sizeof(g_token) - 1);
    return -1;
  }
  while (len > 0 && isspace((unsigned char)g_token[len - 1]))
    len--;
  while (start < len && isspace((unsigned char)g_token[start]))
    start++;
  memmove(g_token, g_token + start, len - start);
  len -= start;
  g_token[len] = '\0';
  if (len == 0) {
    snprintf(g_err, sizeof(g_err), "--token-file %.300s is empty: it should hold one token", path);
    return -1;
  }
  for (size_t i = 0; i < len; i++)
    if (isspace((unsigned char)g_token[i])) {
      snprintf(g_err, sizeof(g_err),
               "--token-file %.300s holds more than one word: it should hold one token alone",
               path);
      return -1;
    }
  return 0;
}

static size_t count_addresses(const char *s) {
  size_t n = 1;
  for (; *s; s++)
    n += *s == ',';
  return n;
}

/* Connects; prints the error and returns NULL on failure. */
static embps_client_t *client(const char *cmd, int learn_group) {
  embps_error_t err;
  embps_client_options_t o = g_opts;
  if (!learn_group)
    o.group_size = (uint32_t)count_addresses(settings[S_SERVERS].value);
  embps_error_clear(&err);
  if (embps_client_connect(&g_client, settings[S_SERVERS].value, &o, &err) != EMBPS_OK) {
    fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_string(err.status), err.message);
    return NULL;
  }
  return g_client;
}

static int call_failed(const char *cmd, embps_client_t *c, embps_status_t st) {
  fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_string(st), embps_client_last_error(c));
  return 1;
}

static const char *optimizer_name(embps_optimizer_t o) {
  if (o == EMBPS_OPTIMIZER_DEFAULT)
    return "rowwise_adagrad";
  switch (o) {
  case EMBPS_OPTIMIZER_SGD:
    return "sgd";
  case EMBPS_OPTIMIZER_ADAGRAD:
    return "adagrad";
  case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
    return "rowwise_adagrad";
  case EMBPS_OPTIMIZER_ADAM:
    return "adam";
  }
  return "unknown";
}

/* Finds table name; NOT_FOUND is reported like a server error. */
static int find_table(const char *cmd, embps_client_t *c, const char *name,
                      embps_table_spec_t **tables, size_t *n, const embps_table_spec_t **out) {
  embps_status_t st = embps_list_tables(c, tables, n);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  for (size_t i = 0; i < *n; i++)
    if (strcmp((*tables)[i].name, name) == 0) {
      *out = &(*tables)[i];
      return 0;
    }
  fprintf(stderr, "embps: %s: NOT_FOUND: table '%s' does not exist (see embps tables)\n", cmd,
          name);
  return 1;
}

/* ---- commands ---- */

static flag_t create_flags[] = {
    {"--rows", "R", "number of rows (required)", NULL},
    {"--emb-width", "D", "values per row (required)", NULL},
    {"--dtype", "f32|bf16", "storage dtype (default f32)", NULL},
    {"--optimizer", "NAME", "sgd, adagrad, rowwise_adagrad (default) or adam", NULL},
    {"--lr", "X", "learning rate (0: the optimizer's default, 0.01)", NULL},
    {"--eps", "X", "epsilon (0: 1e-8)", NULL},
    {"--half-life", "STEPS", "accumulator half-life in steps (0: no decay)", NULL},
    {"--weight-decay", "X", "L2 weight decay added to the gradient", NULL},
    {"--initial-accumulator", "X", "initial accumulator (adagrad, rowwise_adagrad)", NULL},
    {"--beta1", "X", "adam beta1 (0: 0.9)", NULL},
    {"--beta2", "X", "adam beta2 (0: 0.999)", NULL},
    {"--seed", "S", "seed of the initial rows", NULL},
    {"--init-scale", "X", "rows start uniform in [-X, X) (0: 1/sqrt(emb_width))", NULL},
    {NULL, NULL, NULL, NULL}};

static int cmd_create(const char *cmd, flag_t *f, const char *name) {
  embps_table_spec_t spec;
  uint64_t rows, width, seed;
  const char *dtype = flag(f, "--dtype"), *opt = flag(f, "--optimizer");
  embps_client_t *c;
  embps_status_t st;
  int rc;

  embps_table_spec_init(&spec);
  spec.name = name;
  if (!flag(f, "--rows") || !flag(f, "--emb-width"))
    return usage_error(cmd, "--rows and --emb-width are required");
  if ((rc = get_u64(cmd, f, "--rows", 1, UINT64_MAX, 0, &rows)) ||
      (rc = get_u64(cmd, f, "--emb-width", 1, UINT32_MAX, 0, &width)) ||
      (rc = get_u64(cmd, f, "--seed", 0, UINT64_MAX, 0, &seed)) ||
      (rc = get_float(cmd, f, "--lr", &spec.lr)) || (rc = get_float(cmd, f, "--eps", &spec.eps)) ||
      (rc = get_float(cmd, f, "--half-life", &spec.half_life)) ||
      (rc = get_float(cmd, f, "--weight-decay", &spec.weight_decay)) ||
      (rc = get_float(cmd, f, "--initial-accumulator", &spec.initial_accumulator)) ||
      (rc = get_float(cmd, f, "--beta1", &spec.beta1)) ||
      (rc = get_float(cmd, f, "--beta2", &spec.beta2)) ||
      (rc = get_float(cmd, f, "--init-scale", &spec.init_scale)))
    return rc;
  if (spec.beta1 >= 1.0f || spec.beta2 >= 1.0f)
    return usage_error(cmd, "--beta1 and --beta2 must be below 1");
  spec.rows = rows;
  spec.emb_width = (uint32_t)width;
  spec.seed = seed;
  if (!dtype || strcmp(dtype, "f32") == 0)
    spec.dtype = EMBPS_DTYPE_F32;
  else if (strcmp(dtype, "bf16") == 0)
    spec.dtype = EMBPS_DTYPE_BF16;
  else
    return usage_error(cmd, "--dtype: expected f32 or bf16");
  if (!opt)
    spec.optimizer = EMBPS_OPTIMIZER_DEFAULT;
  else if (strcmp(opt, "sgd") == 0)
    spec.optimizer = EMBPS_OPTIMIZER_SGD;
  else if (strcmp(opt, "adagrad") == 0)
    spec.optimizer = EMBPS_OPTIMIZER_ADAGRAD;
  else if (strcmp(opt, "rowwise_adagrad") == 0 || strcmp(opt, "rowwise-adagrad") == 0)
    spec.optimizer = EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
  else if (strcmp(opt, "adam") == 0)
    spec.optimizer = EMBPS_OPTIMIZER_ADAM;
  else
    return usage_error(cmd, "--optimizer: expected sgd, adagrad, rowwise_adagrad or adam");
  if (!(c = client(cmd, 1)))
    return 1;
  st = embps_create_table(c, &spec);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  printf("created table %s: rows %llu, emb_width %u, dtype %s, optimizer %s\n", name,
         (unsigned long long)rows, spec.emb_width, embps_dtype_name(spec.dtype),
         optimizer_name(spec.optimizer));
  return 0;
}

static flag_t drop_flags[] = {{NULL, NULL, NULL, NULL}};

static int cmd_drop(const char *cmd, flag_t *f, const char *name) {
  embps_client_t *c;
  embps_status_t st;
  (void)f;
  if (!(c = client(cmd, 1)))
    return 1;
  st = embps_drop_table(c, name);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  printf("dropped table %s\n", name);
  return 0;
}

static flag_t tables_flags[] = {{"--json", NULL, "print a JSON array", NULL},
                                {NULL, NULL, NULL, NULL}};

static int cmd_tables(const char *cmd, flag_t *f, const char *pos) {
  embps_table_spec_t *t;
  size_t n;
  embps_client_t *c = client(cmd, 1);
  embps_status_t st;
  (void)pos;
  if (!c)
    return 1;
  st = embps_list_tables(c, &t, &n);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  if (flag(f, "--json")) {
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

static flag_t lookup_flags[] = {{"--tokens", "1,2,3", "token ids (required)", NULL},
                                {NULL, NULL, NULL, NULL}};

static float value_at(const void *rows, int dtype, size_t i) {
  if (dtype == EMBPS_DTYPE_BF16)
    return embps_bf16_to_f32(((const uint16_t *)rows)[i]);
  return ((const float *)rows)[i];
}

static int cmd_lookup(const char *cmd, flag_t *f, const char *name) {
  int64_t *tokens = NULL;
  size_t n, nt = 0;
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t *t;
  embps_client_t *c;
  void *out = NULL;
  size_t row_bytes;
  embps_status_t st;
  int rc = 1;

  if (!flag(f, "--tokens"))
    return usage_error(cmd, "--tokens is required");
  if (embps_cli_parse_i64_list("--tokens", flag(f, "--tokens"), &tokens, &n, g_err,
                               sizeof(g_err)) != 0)
    return usage_error(cmd, g_err);
  if (!(c = client(cmd, 1)) || find_table(cmd, c, name, &tables, &nt, &t) != 0)
    goto exit;
  row_bytes = (size_t)t->emb_width * embps_dtype_size(t->dtype);
  out = malloc(n * row_bytes + 1);
  if (!out) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    goto exit;
  }
  st = embps_lookup(c, name, tokens, n, out, n * row_bytes);
  if (st != EMBPS_OK) {
    call_failed(cmd, c, st);
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    printf("%lld", (long long)tokens[i]);
    for (size_t j = 0; j < t->emb_width; j++)
      printf(" %.9g", value_at(out, t->dtype, i * t->emb_width + j));
    printf("\n");
  }
  rc = 0;
exit:
  free(out);
  free(tokens);
  embps_tables_free(tables, nt);
  return rc;
}

static flag_t push_flags[] = {
    {"--tokens", "1,2", "token ids (required)", NULL},
    {"--grads", "\"g,g,...|g,g,...\"", "one full-width gradient row per token, rows split by |",
     NULL},
    {"--grad-value", "X", "fill every gradient element with X (instead of --grads)", NULL},
    {"--async", NULL, "reply once the update is ordered, not applied", NULL},
    {NULL, NULL, NULL, NULL}};

static int cmd_push(const char *cmd, flag_t *f, const char *name) {
  int64_t *tokens = NULL;
  float *vals = NULL;
  void *grads = NULL;
  size_t n, nv = 0, nrows = 0, nt = 0, width;
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t *t;
  embps_push_result_t res;
  embps_client_t *c;
  double gv = 0;
  embps_status_t st;
  int rc = 1;

  if (!flag(f, "--tokens"))
    return usage_error(cmd, "--tokens is required");
  if (!!flag(f, "--grads") == !!flag(f, "--grad-value"))
    return usage_error(cmd, "give exactly one of --grads and --grad-value");
  if (embps_cli_parse_i64_list("--tokens", flag(f, "--tokens"), &tokens, &n, g_err,
                               sizeof(g_err)) != 0)
    return usage_error(cmd, g_err);
  if (flag(f, "--grads") && embps_cli_parse_f32_rows("--grads", flag(f, "--grads"), &vals, &nv,
                                                     &nrows, g_err, sizeof(g_err)) != 0) {
    free(tokens);
    return usage_error(cmd, g_err);
  }
  if (flag(f, "--grad-value") &&
      embps_cli_parse_double("--grad-value", flag(f, "--grad-value"), -3.4e38, 3.4e38, &gv, g_err,
                             sizeof(g_err)) != 0) {
    free(tokens);
    return usage_error(cmd, g_err);
  }
  if (!(c = client(cmd, 1)) || find_table(cmd, c, name, &tables, &nt, &t) != 0)
    goto exit;
  width = t->emb_width;
  if (vals && (nrows != n || nv != n * width)) {
    fprintf(stderr,
            "embps: %s: --grads has %zu rows of %zu values; table %s needs %zu rows (one per "
            "token) of %zu values (emb_width)\n",
            cmd, nrows, nrows ? nv / nrows : 0, name, n, width);
    rc = EXIT_USAGE;
    goto exit;
  }
  grads = malloc(n * width * embps_dtype_size(t->dtype) + 1);
  if (!grads) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    goto exit;
  }
  for (size_t i = 0; i < n * width; i++) {
    float v = vals ? vals[i] : (float)gv;
    if (t->dtype == EMBPS_DTYPE_BF16)
      ((uint16_t *)grads)[i] = embps_f32_to_bf16(v);
    else
      ((float *)grads)[i] = v;
  }
  st = embps_push(c, name, tokens, n, grads, n * width * embps_dtype_size(t->dtype), t->dtype,
                  flag(f, "--async") ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC, &res);
  if (st != EMBPS_OK) {
    call_failed(cmd, c, st);
    goto exit;
  }
  if (flag(f, "--async"))
    printf("ordered=%d applied=%d skipped=%d\n", res.ordered, res.applied, res.skipped);
  else
    printf("applied=%d skipped=%d grad_norm=%.9g num_unique=%llu\n", res.applied, res.skipped,
           res.grad_norm, (unsigned long long)res.num_unique);
  rc = 0;
exit:
  free(grads);
  free(vals);
  free(tokens);
  embps_tables_free(tables, nt);
  return rc;
}

static flag_t stats_flags[] = {
    {"--json", NULL, "print a JSON array, one object per rank", NULL},
    {"--prometheus", NULL,
     "print the ranks' metrics in the Prometheus text format (what --metrics-listen serves at "
     "/metrics); with several ranks, every sample gets a rank label",
     NULL},
    {NULL, NULL, NULL, NULL}};

/* The end of the line at p (the '\n' or the NUL). */
static const char *line_end(const char *p) {
  const char *e = strchr(p, '\n');
  return e ? e : p + strlen(p);
}

/* The family a "# HELP name ..." line names, into name (cap bytes). */
static void help_name(const char *line, char *name, size_t cap) {
  size_t n = strcspn(line + 7, " \n");
  snprintf(name, cap, "%.*s", (int)(n < cap ? n : cap - 1), line + 7);
}

/* Prints rank r's samples of family `fam` (from its text) with a rank label added. Families
 * are the blocks that start at "# HELP". */
static void print_family_samples(const char *text, const char *fam, size_t r, int label) {
  char name[256];
  int in = 0;
  for (const char *p = text; *p;) {
    const char *e = line_end(p);
    if (strncmp(p, "# HELP ", 7) == 0) {
      help_name(p, name, sizeof(name));
      in = strcmp(name, fam) == 0;
    } else if (in && p[0] != '#' && e > p) {
      size_t nl = strcspn(p, "{ ");
      if (!label)
        printf("%.*s\n", (int)(e - p), p);
      else if (p[nl] == '{')
        printf("%.*s{rank=\"%zu\",%.*s\n", (int)nl, p, r, (int)(e - p - nl - 1), p + nl + 1);
      else
        printf("%.*s{rank=\"%zu\"}%.*s\n", (int)nl, p, r, (int)(e - p - nl), p + nl);
    }
    p = *e ? e + 1 : e;
  }
}

/* Prints every family once (HELP, TYPE), with the samples of every rank under it, so the merged
 * text stays valid exposition (a family's samples must be contiguous). */
static void print_prometheus(char **texts, size_t n) {
  char name[256];
  for (size_t r = 0; r < n; r++)
    for (const char *p = texts[r]; *p;) {
      const char *e = line_end(p);
      if (strncmp(p, "# HELP ", 7) == 0) {
        int seen = 0;
        help_name(p, name, sizeof(name));
        for (size_t q = 0; q < r && !seen; q++) { /* printed with an earlier rank's */
          char needle[300];
          snprintf(needle, sizeof(needle), "# HELP %s ", name);
          seen = strstr(texts[q], needle) != NULL;
        }
        if (!seen) {
          const char *te = *e ? line_end(e + 1) : e;
          printf("%.*s\n", (int)(te - p), p); /* HELP and TYPE */
          for (size_t q = r; q < n; q++)
            print_family_samples(texts[q], name, q, n > 1);
        }
      }
      p = *e ? e + 1 : e;
    }
}

static int cmd_stats(const char *cmd, flag_t *f, const char *pos) {
  embps_rank_stats_t *s;
  size_t n;
  embps_client_t *c = client(cmd, 0);
  embps_status_t st;
  int json = flag(f, "--json") != NULL;
  (void)pos;
  if (!c)
    return 1;
  if (flag(f, "--prometheus")) {
    char **texts;
    if ((st = embps_stats_prometheus(c, &texts, &n)) != EMBPS_OK)
      return call_failed(cmd, c, st);
    print_prometheus(texts, n);
    embps_stats_prometheus_free(texts, n);
    return 0;
  }
  st = embps_stats(c, &s, &n);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  if (json)
    printf("[");
  for (size_t i = 0; i < n; i++) {
    const embps_rank_stats_t *r = &s[i];
    if (json) {
      printf("%s{\"rank\":%u,\"group_size\":%u,\"address\":", i ? "," : "", r->rank, r->group_size);
      embps_cli_json_string(stdout, r->address);
      printf(",\"backend\":");
      embps_cli_json_string(stdout, r->backend);
      printf(",\"version\":");
      embps_cli_json_string(stdout, r->version);
      printf(",\"mesh\":");
      embps_cli_json_string(stdout, r->mesh);
      printf(",\"ready\":%s,\"uptime_s\":%.3f,\"requests\":%llu,\"errors\":%llu,"
             "\"bytes_in\":%llu,\"bytes_out\":%llu,\"connections\":%u,"
             "\"peer_bytes_sent\":%llu,\"peer_bytes_received\":%llu,"
             "\"collective_calls\":%llu,\"tables\":[",
             r->ready ? "true" : "false", r->uptime_s, (unsigned long long)r->requests,
             (unsigned long long)r->errors, (unsigned long long)r->bytes_in,
             (unsigned long long)r->bytes_out, r->connections,
             (unsigned long long)r->peer_bytes_sent, (unsigned long long)r->peer_bytes_received,
             (unsigned long long)r->collective_calls);
      for (size_t j = 0; j < r->num_tables; j++) {
        const embps_table_stats_t *t = &r->tables[j];
        printf("%s{\"name\":", j ? "," : "");
        embps_cli_json_string(stdout, t->name);
        printf(",\"rows\":%llu,\"emb_width\":%u,\"lookups\":%llu,\"pushes\":%llu,"
               "\"rows_looked_up\":%llu,\"rows_pushed\":%llu,\"steps_applied\":%llu,"
               "\"steps_skipped\":%llu,\"bytes\":%llu}",
               (unsigned long long)t->rows, t->emb_width, (unsigned long long)t->lookups,
               (unsigned long long)t->pushes, (unsigned long long)t->rows_looked_up,
               (unsigned long long)t->rows_pushed, (unsigned long long)t->steps_applied,
               (unsigned long long)t->steps_skipped, (unsigned long long)t->bytes);
      }
      printf("]}");
    } else {
      printf("rank %u/%u (%s): %s, mesh %s, backend %s, version %s, uptime %.1f s, requests "
             "%llu, errors %llu, bytes in %llu, bytes out %llu, connections %u, peer bytes "
             "sent %llu, received %llu\n",
             r->rank, r->group_size, r->address, r->ready ? "ready" : "NOT READY", r->mesh,
             r->backend, r->version, r->uptime_s, (unsigned long long)r->requests,
             (unsigned long long)r->errors, (unsigned long long)r->bytes_in,
             (unsigned long long)r->bytes_out, r->connections,
             (unsigned long long)r->peer_bytes_sent, (unsigned long long)r->peer_bytes_received);
      for (size_t j = 0; j < r->num_tables; j++) {
        const embps_table_stats_t *t = &r->tables[j];
        printf("  table %s: rows %llu, emb_width %u, lookups %llu, pushes %llu, rows looked up "
               "%llu, rows pushed %llu, steps applied %llu, steps skipped %llu, bytes %llu\n",
               t->name, (unsigned long long)t->rows, t->emb_width, (unsigned long long)t->lookups,
               (unsigned long long)t->pushes, (unsigned long long)t->rows_looked_up,
               (unsigned long long)t->rows_pushed, (unsigned long long)t->steps_applied,
               (unsigned long long)t->steps_skipped, (unsigned long long)t->bytes);
      }
    }
  }
  if (json)
    printf("]\n");
  embps_stats_free(s, n);
  return 0;
}

static flag_t health_flags[] = {
    {"--service", "NAME", "service to ask about (default \"\": the whole server)", NULL},
    {NULL, NULL, NULL, NULL}};

static int cmd_health(const char *cmd, flag_t *f, const char *pos) {
  embps_client_t *c = client(cmd, 0);
  int serving = 0;
  embps_status_t st;
  (void)pos;
  if (!c)
    return 1;
  st = embps_health(c, flag(f, "--service") ? flag(f, "--service") : "", &serving);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  if (!serving) {
    printf("NOT_SERVING\n");
    fprintf(stderr, "embps: %s: %s\n", cmd, embps_client_last_error(c));
    return 1;
  }
  printf("SERVING\n");
  return 0;
}

static flag_t checkpoint_flags[] = {
    {"--table", "NAME", "table to checkpoint (default: every table)", NULL},
    {NULL, NULL, NULL, NULL}};

static int cmd_checkpoint(const char *cmd, flag_t *f, const char *pos) {
  embps_checkpoint_info_t info;
  embps_client_t *c;
  embps_status_t st;
  (void)pos;
  if (!(c = client(cmd, 1)))
    return 1;
  st = embps_checkpoint(c, flag(f, "--table"), &info);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  printf("checkpoint complete: round %llu, %llu bytes, %s\n", (unsigned long long)info.round,
         (unsigned long long)info.bytes, info.path);
  return 0;
}

static flag_t checkpoints_flags[] = {{NULL, NULL, NULL, NULL}};

static int cmd_checkpoints(const char *cmd, flag_t *f, const char *pos) {
  embps_checkpoint_info_t *list;
  embps_client_t *c;
  embps_status_t st;
  size_t n;
  (void)f, (void)pos;
  if (!(c = client(cmd, 1)))
    return 1;
  st = embps_list_checkpoints(c, &list, &n);
  if (st != EMBPS_OK)
    return call_failed(cmd, c, st);
  printf("%-12s %-24s %-5s %-14s %-12s %s\n", "round", "time (UTC)", "ranks", "bytes", "kind",
         "tables");
  for (size_t i = 0; i < n; i++) {
    char when[32] = "?", kind[40];
    time_t t = (time_t)(list[i].time_unix_ms / 1000);
    struct tm tm;
    if (gmtime_r(&t, &tm))
      strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    if (list[i].base_round)
      snprintf(kind, sizeof(kind), "incr<-%llu", (unsigned long long)list[i].base_round);
    else
      snprintf(kind, sizeof(kind), "%s", list[i].scope[0] ? "table" : "full");
    printf("%-12llu %-24s %-5u %-14llu %-12s %s\n", (unsigned long long)list[i].round, when,
           list[i].group_size, (unsigned long long)list[i].bytes, kind, list[i].tables);
  }
  embps_checkpoints_free(list);
  return 0;
}

static flag_t bench_flags[] = {
    {"--batch", "T", "tokens per op (this or --mix is required)", NULL},
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
     "token ids over [1, rows): uniform (default; every row alike, so batches reach memory) or "
     "zipf (exponent --zipf, default 1.05)",
     NULL},
    {"--zipf", "A", "Zipf exponent of token ids; alone, the same as --tokens zipf (0: uniform)",
     NULL},
    {"--push-ratio", "P", "probability that an op is a push (default 0)", NULL},
    {"--async", NULL, "pushes are async", NULL},
    {"--seed", "S", "random seed (default 1)", NULL},
    {"--output", "FORMAT",
     "text (default), json (today's keys, ghz's and the client's CPU time) or csv", NULL},
    {"--json", NULL, "the same as --output json", NULL},
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

static int cmd_bench(const char *cmd, flag_t *f, const char *name) {
  embps_bench_opts_t o;
  uint64_t conc, pipe, one_batch = 0, *mix = NULL;
  double *weights = NULL;
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t **chosen = NULL;
  const char **names = NULL, *out = flag(f, "--output");
  char *names_buf[2] = {NULL, NULL};
  size_t nt = 0, nnames = 0;
  embps_client_t *c;
  int rc;

  memset(&o, 0, sizeof(o));
  if (!flag(f, "--batch") == !flag(f, "--mix"))
    return usage_error(cmd, "exactly one of --batch and --mix is required");
  if ((rc = get_double(cmd, f, "--duration", 0.001, 1e7, 10.0, &o.duration_s)) ||
      (rc = get_double(cmd, f, "--warmup", 0.0, 1e7, 1.0, &o.warmup_s)) ||
      (rc = get_u64(cmd, f, "--concurrency", 1, 4096, 1, &conc)) ||
      (rc = get_double(cmd, f, "--rate", 0.0, 1e7, 0.0, &o.rate)) ||
      (rc = get_u64(cmd, f, "--pipeline", 1, 4096, o.rate > 0 ? 64 : 1, &pipe)) ||
      (rc = get_double(cmd, f, "--zipf", 0.0, 100.0, 0.0, &o.zipf)) ||
      (rc = embps_token_exponent(flag(f, "--tokens"), flag(f, "--zipf"), o.zipf, &o.zipf)
                ? usage_error(cmd, "--tokens takes uniform or zipf, and --tokens uniform no "
                                   "--zipf other than 0")
                : 0) ||
      (rc = get_double(cmd, f, "--push-ratio", 0.0, 1.0, 0.0, &o.push_ratio)) ||
      (rc = get_u64(cmd, f, "--seed", 0, UINT64_MAX, 1, &o.seed)))
    return rc;
  if (flag(f, "--batch")) {
    if ((rc = get_u64(cmd, f, "--batch", 1, 1u << 24, 0, &one_batch)))
      return rc;
    o.batches = &one_batch;
    o.nbatches = 1;
  } else {
    if (embps_cli_parse_mix("--mix", flag(f, "--mix"), 1u << 24, &mix, &weights, &o.nbatches, g_err,
                            sizeof(g_err)) != 0)
      return usage_error(cmd, g_err);
    o.batches = mix;
    o.weights = weights;
  }
  o.concurrency = (uint32_t)conc;
  o.pipeline = (uint32_t)pipe;
  o.async_push = flag(f, "--async") != NULL;
  o.output = EMBPS_BENCH_TEXT;
  if (flag(f, "--json") || (out && strcmp(out, "json") == 0))
    o.output = EMBPS_BENCH_JSON;
  else if (out && strcmp(out, "csv") == 0)
    o.output = EMBPS_BENCH_CSV;
  else if (out && strcmp(out, "text") != 0) {
    free(mix);
    free(weights);
    return usage_error(cmd, "--output must be text, json or csv");
  }
  rc = 1;
  if (split_names(cmd, name, &names_buf[0], &names, &nnames) ||
      (flag(f, "--tables") &&
       split_names(cmd, flag(f, "--tables"), &names_buf[1], &names, &nnames)))
    goto exit;
  if (nnames == 0) {
    rc = usage_error(cmd, "no table named");
    goto exit;
  }
  if (!(chosen = calloc(nnames, sizeof(*chosen))) || !(c = client(cmd, 1)))
    goto exit;
  for (size_t i = 0; i < nnames; i++) {
    const embps_table_spec_t *t;
    embps_tables_free(tables, nt);
    tables = NULL;
    nt = 0;
    if (find_table(cmd, c, names[i], &tables, &nt, &t) != 0)
      goto exit;
    if (t->rows < 2) {
      fprintf(stderr, "embps: %s: table %s has %llu rows; bench draws tokens from [1, rows)\n", cmd,
              names[i], (unsigned long long)t->rows);
      goto exit;
    }
  }
  for (size_t i = 0; i < nnames; i++)
    for (size_t j = 0; j < nt; j++)
      if (strcmp(tables[j].name, names[i]) == 0)
        chosen[i] = &tables[j];
  {
    embps_client_options_t wo = g_opts;
    wo.group_size = embps_client_group_size(c);
    embps_client_free(g_client);
    g_client = NULL;
    rc = embps_cli_bench(settings[S_SERVERS].value, &wo, chosen, nnames, &o);
  }
exit:
  embps_tables_free(tables, nt);
  free(chosen);
  free((void *)names);
  free(names_buf[0]);
  free(names_buf[1]);
  free(mix);
  free(weights);
  return rc;
}

static command_t commands[] = {
    {"create-table", "NAME", "Create a table on the group.", cmd_create, create_flags},
    {"drop-table", "NAME",
     "Drop a table on the group: its memory is freed and the name may be created again.", cmd_drop,
     drop_flags},
    {"tables", NULL, "List the tables: name, rows, emb_width, dtype, optimizer.", cmd_tables,
     tables_flags},
    {"lookup", "NAME", "Look up rows; prints one line per token: the token, then its values.",
     cmd_lookup, lookup_flags},
    {"push", "NAME", "Push gradients; prints applied, skipped, grad_norm, num_unique.", cmd_push,
     push_flags},
    {"stats", NULL, "Print every rank's statistics and per-table counters.", cmd_stats,
     stats_flags},
    {"health", NULL,
     "Ask every rank's grpc.health.v1 service; prints SERVING and exits 0 when "
     "all serve.",
     cmd_health, health_flags},
    {"checkpoint", NULL,
     "Take a checkpoint now into the servers' --checkpoint-dir; prints its round, bytes, path.",
     cmd_checkpoint, checkpoint_flags},
    {"checkpoints", NULL, "List the complete checkpoints: round, time, ranks, bytes, tables.",
     cmd_checkpoints, checkpoints_flags},
    {"bench", "NAME[,NAME...]",
     "Load test: C threads keep K lookups/pushes of T random tokens (uniform or Zipf) in flight "
     "(closed "
     "loop) or send R batches/s on a schedule (--rate), and report batches/s, rows/s, GB/s, "
     "latency percentiles and errors by status.",
     cmd_bench, bench_flags},
};

static void usage_global(FILE *f) {
  fprintf(f, "usage: embps [GLOBAL OPTIONS] COMMAND [OPTIONS]\n\nglobal options (flag, "
             "environment variable, default):\n");
  for (int i = 0; i < S_COUNT; i++) {
    char left[64];
    snprintf(left, sizeof(left), "%s%s", settings[i].flag, i == S_PAD ? "" : " VALUE");
    fprintf(f, "  %-28s %s\n  %-28s   (env %s, default %s)\n", left, settings[i].help, "",
            settings[i].env, settings[i].def[0] ? settings[i].def : "none");
  }
  fprintf(f, "  %-28s %s\n\ncommands:\n", "--help", "show this help");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\n`embps COMMAND --help` shows a command's options.\n");
}

int main(int argc, char **argv) {
  int i = 1, rc;
  const char *pos;
  uint64_t v;

  /* As in the server (server/main.c): keep large blocks in the heap so that buffers of tens of
   * MiB that bench allocates and frees step after step do not fault their pages in anew. */
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);

  for (int s = 0; s < S_COUNT; s++) {
    const char *e = getenv(settings[s].env);
    settings[s].value = e && *e ? e : settings[s].def;
  }
  while (i < argc && strncmp(argv[i], "-", 1) == 0) {
    const char *a = argv[i];
    int matched = 0;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage_global(stdout);
      return 0;
    }
    if (strcmp(a, "--version") == 0) {
      printf("embps %s\n", EMBPS_VERSION);
      return 0;
    }
    for (int s = 0; s < S_COUNT && !matched; s++) {
      size_t len = strlen(settings[s].flag);
      if (strncmp(a, settings[s].flag, len) != 0 || (a[len] != '\0' && a[len] != '='))
        continue;
      matched = 1;
      if (s == S_PAD && a[len] == '\0') {
        settings[s].value = "1";
      } else if (a[len] == '=') {
        settings[s].value = a + len + 1;
      } else if (i + 1 < argc) {
        settings[s].value = argv[++i];
      } else {
        fprintf(stderr, "embps: %s needs a value\n", a);
        return EXIT_USAGE;
      }
    }
    if (!matched) {
      fprintf(stderr, "embps: unknown option '%s' (see embps --help)\n", a);
      return EXIT_USAGE;
    }
    i++;
  }
  embps_client_options_init(&g_opts);
  if (embps_cli_parse_u64("--deadline-ms", settings[S_DEADLINE].value, 0, INT64_MAX, &v, g_err,
                          sizeof(g_err)) != 0)
    return usage_error("options", g_err);
  g_opts.deadline_ms = (int64_t)v;
  if (embps_cli_parse_u64("--connect-timeout-ms", settings[S_CONNECT_TIMEOUT].value, 1, INT64_MAX,
                          &v, g_err, sizeof(g_err)) != 0)
    return usage_error("options", g_err);
  g_opts.connect_timeout_ms = (int64_t)v;
  if (embps_cli_parse_u64("--pad", settings[S_PAD].value, 0, 1, &v, g_err, sizeof(g_err)) != 0)
    return usage_error("options", g_err);
  g_opts.pad_batches = (int)v;
  if (settings[S_TOKEN_FILE].value[0]) {
    if (read_token_file(settings[S_TOKEN_FILE].value) != 0)
      return usage_error("options", g_err);
    g_opts.token = g_token;
  }
  g_opts.tls_ca = settings[S_TLS_CA].value;
  g_opts.tls_cert = settings[S_TLS_CERT].value;
  g_opts.tls_key = settings[S_TLS_KEY].value;
  g_opts.tls_server_name =
      settings[S_TLS_SERVER_NAME].value[0] ? settings[S_TLS_SERVER_NAME].value : NULL;
  if (i >= argc) {
    usage_global(stderr);
    return EXIT_USAGE;
  }
  for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++) {
    if (strcmp(argv[i], commands[k].name) != 0)
      continue;
    rc = parse_flags(&commands[k], argc - i - 1, argv + i + 1, &pos);
    if (rc != 0)
      return rc < 0 ? 0 : rc;
    rc = commands[k].run(commands[k].name, commands[k].flags, pos);
    embps_client_free(g_client);
    return rc;
  }
  fprintf(stderr, "embps: unknown command '%s' (see embps --help)\n", argv[i]);
  return EXIT_USAGE;
}
