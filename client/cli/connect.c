/* The global settings of `embps` and the connection they describe.
 *
 * The settings are one table (flag, environment variable, default, help) that args.c both
 * parses and prints in --help. Parsing turns them once into the libembps client options every
 * command connects with: numbers strictly, the bearer token read from --token-file here so a
 * bad file is a usage error before anything is sent. A command holds at most one client at a
 * time; it is freed by embps_cli_disconnect() when the command returns (bench frees it earlier,
 * since its threads open their own). */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "client/cli/args.h"
#include "client/cli/cli.h"
#include "common/status.h"
#include "embps/embps.h"

enum {
  S_SERVERS,
  S_DEADLINE,
  S_MAX_ATTEMPTS,
  S_ATTEMPT_TIMEOUT,
  S_CONNECT_TIMEOUT,
  S_PAD,
  S_TOKEN_FILE,
  S_TLS_CA,
  S_TLS_CERT,
  S_TLS_KEY,
  S_TLS_SERVER_NAME,
  S_COUNT
};

static embps_cli_setting_t settings[S_COUNT] = {
    [S_SERVERS] = {"--servers", "EMBPS_SERVERS", "127.0.0.1:7070",
                   "HOST:PORT[,HOST:PORT...] of every rank, in rank order", 0, NULL},
    [S_DEADLINE] = {"--deadline-ms", "EMBPS_DEADLINE_MS", "0",
                    "deadline of each call in milliseconds, its retries included (0: none)", 0,
                    NULL},
    [S_MAX_ATTEMPTS] = {"--max-attempts", "EMBPS_MAX_ATTEMPTS", "4",
                        "most attempts of a lookup or push, retried on UNAVAILABLE or "
                        "DEADLINE_EXCEEDED (1: no retry)",
                        0, NULL},
    [S_ATTEMPT_TIMEOUT] = {"--attempt-timeout-ms", "EMBPS_ATTEMPT_TIMEOUT_MS", "0",
                           "each attempt's own deadline in milliseconds, within --deadline-ms "
                           "(0: none)",
                           0, NULL},
    [S_CONNECT_TIMEOUT] = {"--connect-timeout-ms", "EMBPS_CONNECT_TIMEOUT_MS", "10000",
                           "deadline of connecting to each server, in milliseconds", 0, NULL},
    [S_PAD] = {"--pad", "EMBPS_PAD", "0",
               "pad batches with token 0 up to a multiple of the group size (--pad=0|1)", 1, NULL},
    [S_TOKEN_FILE] = {"--token-file", "EMBPS_TOKEN_FILE", "",
                      "file holding the bearer token sent on every call (servers with "
                      "--auth-tokens-file); empty: none",
                      0, NULL},
    [S_TLS_CA] = {"--tls-ca", "EMBPS_TLS_CA", "",
                  "connect with TLS, trusting the CA certificates in this PEM file (empty: "
                  "cleartext)",
                  0, NULL},
    /* Not EMBPS_TLS_CERT: that is the server's own certificate, and the CLI often runs in the
     * server's container. */
    [S_TLS_CERT] = {"--tls-cert", "EMBPS_TLS_CLIENT_CERT", "",
                    "mutual TLS: this client's PEM certificate (with --tls-key)", 0, NULL},
    [S_TLS_KEY] = {"--tls-key", "EMBPS_TLS_CLIENT_KEY", "", "the PEM private key of --tls-cert", 0,
                   NULL},
    [S_TLS_SERVER_NAME] = {"--tls-server-name", "EMBPS_TLS_SERVER_NAME", "",
                           "the name the servers' certificates must carry (empty: each "
                           "address's host)",
                           0, NULL},
};

static embps_client_t *g_client;
static embps_client_options_t g_opts;
static char g_token[1024];

/* Reads the bearer token from path into g_token: the file's text without the whitespace
 * around it (a trailing newline, as editors and `kubectl create secret` leave). Returns 0, or
 * -1 with the reason in err (never the token's text). */
static int read_token_file(const char *path, char *err, size_t errlen) {
  size_t len, start = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "--token-file %.300s: %s", path, strerror(errno));
    return -1;
  }
  len = fread(g_token, 1, sizeof(g_token), f);
  fclose(f);
  if (len == sizeof(g_token)) {
    snprintf(err, errlen, "--token-file %.300s: longer than %zu bytes", path, sizeof(g_token) - 1);
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
    snprintf(err, errlen, "--token-file %.300s is empty: it should hold one token", path);
    return -1;
  }
  for (size_t i = 0; i < len; i++)
    if (isspace((unsigned char)g_token[i])) {
      snprintf(err, errlen,
               "--token-file %.300s holds more than one word: it should hold one token alone",
               path);
      return -1;
    }
  return 0;
}

int embps_cli_settings_parse(int argc, char **argv, int *next) {
  return embps_cli_parse_settings(settings, S_COUNT, argc, argv, next);
}

int embps_cli_settings_apply(void) {
  char err[640];
  uint64_t v;
  embps_client_options_init(&g_opts);
  if (embps_cli_parse_u64("--deadline-ms", settings[S_DEADLINE].value, 0, INT64_MAX, &v, err,
                          sizeof(err)) != 0)
    return embps_cli_usage_error("options", err);
  g_opts.deadline_ms = (int64_t)v;
  if (embps_cli_parse_u64("--max-attempts", settings[S_MAX_ATTEMPTS].value, 1, EMBPS_MAX_ATTEMPTS,
                          &v, err, sizeof(err)) != 0)
    return embps_cli_usage_error("options", err);
  g_opts.max_attempts = (uint32_t)v;
  if (embps_cli_parse_u64("--attempt-timeout-ms", settings[S_ATTEMPT_TIMEOUT].value, 0, INT64_MAX,
                          &v, err, sizeof(err)) != 0)
    return embps_cli_usage_error("options", err);
  g_opts.attempt_timeout_ms = (int64_t)v;
  if (embps_cli_parse_u64("--connect-timeout-ms", settings[S_CONNECT_TIMEOUT].value, 1, INT64_MAX,
                          &v, err, sizeof(err)) != 0)
    return embps_cli_usage_error("options", err);
  g_opts.connect_timeout_ms = (int64_t)v;
  if (embps_cli_parse_u64("--pad", settings[S_PAD].value, 0, 1, &v, err, sizeof(err)) != 0)
    return embps_cli_usage_error("options", err);
  g_opts.pad_batches = (int)v;
  if (settings[S_TOKEN_FILE].value[0]) {
    if (read_token_file(settings[S_TOKEN_FILE].value, err, sizeof(err)) != 0)
      return embps_cli_usage_error("options", err);
    g_opts.token = g_token;
  }
  g_opts.tls_ca = settings[S_TLS_CA].value;
  g_opts.tls_cert = settings[S_TLS_CERT].value;
  g_opts.tls_key = settings[S_TLS_KEY].value;
  g_opts.tls_server_name =
      settings[S_TLS_SERVER_NAME].value[0] ? settings[S_TLS_SERVER_NAME].value : NULL;
  return 0;
}

void embps_cli_settings_usage(FILE *f) { embps_cli_usage_settings(f, settings, S_COUNT); }

const char *embps_cli_servers(void) { return settings[S_SERVERS].value; }

embps_client_options_t embps_cli_options(void) { return g_opts; }

static size_t count_addresses(const char *s) {
  size_t n = 1;
  for (; *s; s++)
    n += *s == ',';
  return n;
}

embps_client_t *embps_cli_connect(const char *cmd, int learn_group) {
  embps_error_t err;
  embps_client_options_t o = g_opts;
  if (!learn_group)
    o.group_size = (uint32_t)count_addresses(settings[S_SERVERS].value);
  embps_error_clear(&err);
  embps_cli_disconnect();
  if (embps_client_connect(&g_client, settings[S_SERVERS].value, &o, &err) != EMBPS_OK) {
    fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_string(err.status), err.message);
    return NULL;
  }
  return g_client;
}

void embps_cli_disconnect(void) {
  embps_client_free(g_client);
  g_client = NULL;
}

int embps_cli_call_failed(const char *cmd, embps_client_t *c, embps_status_t st) {
  fprintf(stderr, "embps: %s: %s: %s\n", cmd, embps_status_string(st), embps_client_last_error(c));
  return 1;
}

int embps_cli_find_table(const char *cmd, embps_client_t *c, const char *name,
                         embps_table_spec_t **tables, size_t *n, const embps_table_spec_t **out) {
  embps_status_t st = embps_list_tables(c, tables, n);
  if (st != EMBPS_OK)
    return embps_cli_call_failed(cmd, c, st);
  for (size_t i = 0; i < *n; i++)
    if (strcmp((*tables)[i].name, name) == 0) {
      *out = &(*tables)[i];
      return 0;
    }
  fprintf(stderr, "embps: %s: NOT_FOUND: table '%s' does not exist (see embps tables)\n", cmd,
          name);
  return 1;
}
