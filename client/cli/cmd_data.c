/* `embps lookup` and `embps push`: one batch of a table's rows, read or updated.
 *
 * Both look the table up first (its emb_width and dtype size the buffers), parse the tokens and
 * gradients strictly (args.c), and print in a form scripts can read back: lookup one line per
 * token with %.9g values, which round-trip an f32 exactly; push the reply's fields as key=value.
 * Gradients are converted to the table's dtype here, so --grads is always written in decimal. */
#include <stdio.h>
#include <stdlib.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "common/dtype.h"
#include "embps/embps.h"

embps_cli_flag_t embps_cli_lookup_flags[] = {{"--tokens", "1,2,3", "token ids (required)", NULL},
                                             {NULL, NULL, NULL, NULL}};

static float value_at(const void *rows, int dtype, size_t i) {
  if (dtype == EMBPS_DTYPE_BF16)
    return embps_bf16_to_f32(((const uint16_t *)rows)[i]);
  return ((const float *)rows)[i];
}

int embps_cli_cmd_lookup(const char *cmd, embps_cli_flag_t *f, const char *name) {
  int64_t *tokens = NULL;
  size_t n, nt = 0;
  char err[640];
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t *t;
  embps_client_t *c;
  void *out = NULL;
  size_t row_bytes;
  embps_status_t st;
  int rc = 1;

  if (!embps_cli_flag(f, "--tokens"))
    return embps_cli_usage_error(cmd, "--tokens is required");
  if (embps_cli_parse_i64_list("--tokens", embps_cli_flag(f, "--tokens"), &tokens, &n, err,
                               sizeof(err)) != 0)
    return embps_cli_usage_error(cmd, err);
  if (!(c = embps_cli_connect(cmd, 1)) || embps_cli_find_table(cmd, c, name, &tables, &nt, &t) != 0)
    goto exit;
  row_bytes = (size_t)t->emb_width * embps_dtype_size(t->dtype);
  out = malloc(n * row_bytes + 1);
  if (!out) {
    fprintf(stderr, "embps: %s: out of memory\n", cmd);
    goto exit;
  }
  st = embps_lookup(c, name, tokens, n, out, n * row_bytes);
  if (st != EMBPS_OK) {
    embps_cli_call_failed(cmd, c, st);
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

embps_cli_flag_t embps_cli_push_flags[] = {
    {"--tokens", "1,2", "token ids (required)", NULL},
    {"--grads", "\"g,g,...|g,g,...\"", "one full-width gradient row per token, rows split by |",
     NULL},
    {"--grad-value", "X", "fill every gradient element with X (instead of --grads)", NULL},
    {"--async", NULL, "reply once the update is ordered, not applied", NULL},
    {NULL, NULL, NULL, NULL}};

int embps_cli_cmd_push(const char *cmd, embps_cli_flag_t *f, const char *name) {
  int64_t *tokens = NULL;
  float *vals = NULL;
  void *grads = NULL;
  size_t n, nv = 0, nrows = 0, nt = 0, width;
  char err[640];
  embps_table_spec_t *tables = NULL;
  const embps_table_spec_t *t;
  embps_push_result_t res;
  embps_client_t *c;
  double gv = 0;
  embps_status_t st;
  int rc = 1;

  if (!embps_cli_flag(f, "--tokens"))
    return embps_cli_usage_error(cmd, "--tokens is required");
  if (!!embps_cli_flag(f, "--grads") == !!embps_cli_flag(f, "--grad-value"))
    return embps_cli_usage_error(cmd, "give exactly one of --grads and --grad-value");
  if (embps_cli_parse_i64_list("--tokens", embps_cli_flag(f, "--tokens"), &tokens, &n, err,
                               sizeof(err)) != 0)
    return embps_cli_usage_error(cmd, err);
  if (embps_cli_flag(f, "--grads") &&
      embps_cli_parse_f32_rows("--grads", embps_cli_flag(f, "--grads"), &vals, &nv, &nrows, err,
                               sizeof(err)) != 0) {
    free(tokens);
    return embps_cli_usage_error(cmd, err);
  }
  if (embps_cli_flag(f, "--grad-value") &&
      embps_cli_parse_double("--grad-value", embps_cli_flag(f, "--grad-value"), -3.4e38, 3.4e38,
                             &gv, err, sizeof(err)) != 0) {
    free(tokens);
    return embps_cli_usage_error(cmd, err);
  }
  if (!(c = embps_cli_connect(cmd, 1)) || embps_cli_find_table(cmd, c, name, &tables, &nt, &t) != 0)
    goto exit;
  width = t->emb_width;
  if (vals && (nrows != n || nv != n * width)) {
    fprintf(stderr,
            "embps: %s: --grads has %zu rows of %zu values; table %s needs %zu rows (one per "
            "token) of %zu values (emb_width)\n",
            cmd, nrows, nrows ? nv / nrows : 0, name, n, width);
    rc = EMBPS_CLI_EXIT_USAGE;
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
                  embps_cli_flag(f, "--async") ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC, &res);
  if (st != EMBPS_OK) {
    embps_cli_call_failed(cmd, c, st);
    goto exit;
  }
  /* replayed=1 only when a retry found the push applied already, so the usual line stays. */
  if (embps_cli_flag(f, "--async"))
    printf("ordered=%d applied=%d skipped=%d%s\n", res.ordered, res.applied, res.skipped,
           res.replayed ? " replayed=1" : "");
  else
    printf("applied=%d skipped=%d grad_norm=%.9g num_unique=%llu%s\n", res.applied, res.skipped,
           res.grad_norm, (unsigned long long)res.num_unique, res.replayed ? " replayed=1" : "");
  rc = 0;
exit:
  free(grads);
  free(vals);
  free(tokens);
  embps_tables_free(tables, nt);
  return rc;
}
