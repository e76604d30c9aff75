/* The libembps client object: options, connecting to a shard group, the last error, freeing.
 *
 * A client holds one connection per rank (conn.c), opened at connect time in rank order; when
 * the caller does not give the group size, it is learned from every rank's ListTables and
 * checked against the number of addresses, so a mistyped address list fails at connect time
 * rather than at the first batch. Calls (call.c, batch.c, admin.c) record their failures as the
 * client's last error, read with embps_client_last_error().
 *
 * Batch ids: a counter per client, starting at a random 31-bit value shifted left by 32, so
 * ids increase in call order and two clients of the same group do not share ids. */
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/client_internal.h"
#include "client/tls.h"
#include "common/alloc.h"

embps_status_t embps__client_fail(embps_client_t *c, embps_status_t st, const char *fmt, ...) {
  va_list ap;
  c->last.status = st;
  va_start(ap, fmt);
  vsnprintf(c->last.message, sizeof(c->last.message), fmt, ap);
  va_end(ap);
  return st;
}

embps_status_t embps__client_fail_err(embps_client_t *c, const embps_error_t *err) {
  c->last = *err;
  return err->status;
}

/* ---- options and small accessors ---- */

void embps_client_options_init(embps_client_options_t *opts) {
  memset(opts, 0, sizeof(*opts));
  opts->connect_timeout_ms = 10000;
  opts->max_attempts = EMBPS__DEFAULT_MAX_ATTEMPTS;
}

const char *embps_client_last_error(const embps_client_t *client) { return client->last.message; }

embps_status_t embps_client_last_status(const embps_client_t *client) {
  return client->last.status;
}

uint32_t embps_client_group_size(const embps_client_t *client) { return client->group_size; }

void embps_client_set_deadline(embps_client_t *client, int64_t deadline_ms) {
  client->deadline_ms = deadline_ms > 0 ? deadline_ms : 0;
}

void embps_client_set_padding(embps_client_t *client, int pad_batches) {
  client->pad = pad_batches != 0;
}

const char *embps_status_string(embps_status_t status) { return embps_status_name(status); }

void embps_table_spec_init(embps_table_spec_t *spec) { memset(spec, 0, sizeof(*spec)); }

/* ---- connect and free ---- */

static uint64_t random_u64(void) {
  uint64_t r = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, &r, sizeof(r)) != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 20;
  }
  if (fd >= 0)
    close(fd);
  return r;
}

static uint64_t random_base(void) { return ((random_u64() & 0x7fffffffull) << 32) + 1; }

/* "Bearer TOKEN" for the authorization header, in a new string (*out). The token must be
 * visible ASCII, so that it cannot end the header or start another. */
static embps_status_t authorization_new(const char *token, char **out, embps_error_t *err) {
  size_t len = strlen(token);
  char *a;
  if (len > 1000)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "the token is %zu bytes: tokens are at most 1000", len);
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)token[i] <= 0x20 || (unsigned char)token[i] >= 0x7f)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "the token has a byte that is not visible ASCII (0x%02x at offset "
                             "%zu): is it the whole token file, with a line break inside?",
                             (unsigned char)token[i], i);
  a = embps_malloc(len + 8);
  if (!a)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  memcpy(a, "Bearer ", 7);
  memcpy(a + 7, token, len + 1);
  *out = a;
  return EMBPS_OK;
}

void embps_client_free(embps_client_t *client) {
  if (!client)
    return;
  while (client->calls)
    embps__call_free(client->calls);
  for (uint32_t i = 0; client->conns && i < client->group_size; i++)
    embps__conn_free(client->conns[i]);
  embps_free(client->conns);
  embps_free(client->addrs);
  if (client->authorization)
    explicit_bzero(client->authorization, strlen(client->authorization));
  embps_free(client->authorization);
  SSL_CTX_free(client->tls_ctx);
  embps_free(client);
}

embps_status_t embps_client_connect(embps_client_t **out, const char *servers,
                                    const embps_client_options_t *opts, embps_error_t *err) {
  embps_client_options_t defaults;
  embps_client_t *c;
  embps_status_t ret;
  size_t n = 0;

  if (!opts) {
    embps_client_options_init(&defaults);
    opts = &defaults;
  }
  c = embps_calloc(1, sizeof(*c));
  if (!c)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  ret = embps__parse_servers(servers, &c->addrs, &n, err);
  if (ret != EMBPS_OK)
    goto fail;
  if (opts->group_size != 0 && opts->group_size != n) {
    ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                          "the group has %u ranks but %zu addresses were given: list every "
                          "rank's host:port in rank order",
                          opts->group_size, n);
    goto fail;
  }
  if (opts->max_attempts > EMBPS__MAX_ATTEMPTS) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                          "max_attempts=%u is over %u: give a number of attempts from 1 (no "
                          "retry) to %u",
                          opts->max_attempts, EMBPS__MAX_ATTEMPTS, EMBPS__MAX_ATTEMPTS);
    goto fail;
  }
  if (opts->token && opts->token[0]) {
    ret = authorization_new(opts->token, &c->authorization, err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  c->group_size = (uint32_t)n;
  c->deadline_ms = opts->deadline_ms > 0 ? opts->deadline_ms : 0;
  c->connect_timeout_ms = opts->connect_timeout_ms > 0 ? opts->connect_timeout_ms : 10000;
  c->pad = opts->pad_batches != 0;
  c->max_attempts = opts->max_attempts ? opts->max_attempts : EMBPS__DEFAULT_MAX_ATTEMPTS;
  c->attempt_timeout_ms = opts->attempt_timeout_ms > 0 ? opts->attempt_timeout_ms : 0;
  c->jitter = random_u64();
  c->next_batch_id = random_base();
  /* Batch ids are scoped by the client id on the server, so this client's never collide with
   * another's; never 0, which means "no client id". */
  while (!(c->client_id = random_u64()))
    ;
  if (opts->tls_ca && opts->tls_ca[0]) {
    ret = embps__tls_client_ctx_new(&c->tls_ctx, opts->tls_ca, opts->tls_cert, opts->tls_key, err);
    if (ret != EMBPS_OK)
      goto fail;
    if (opts->tls_server_name &&
        snprintf(c->tls_server_name, sizeof(c->tls_server_name), "%s", opts->tls_server_name) >=
            (int)sizeof(c->tls_server_name)) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "tls_server_name is too long");
      goto fail;
    }
  } else if ((opts->tls_cert && opts->tls_cert[0]) || (opts->tls_key && opts->tls_key[0])) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                          "a client certificate (tls_cert, tls_key) needs tls_ca: TLS verifies "
                          "the server too");
    goto fail;
  }
  c->conns = embps_calloc(n, sizeof(*c->conns));
  if (!c->conns) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    ret = embps__conn_open(&c->conns[i], &c->addrs[i], c->tls_ctx,
                           c->tls_server_name[0] ? c->tls_server_name : NULL, c->connect_timeout_ms,
                           err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  if (opts->group_size == 0) {
    int64_t saved = c->deadline_ms;
    c->deadline_ms = c->connect_timeout_ms;
    ret = embps__learn_group_size(c);
    c->deadline_ms = saved;
    if (ret != EMBPS_OK) {
      if (err)
        *err = c->last;
      goto fail;
    }
  }
  embps_error_clear(&c->last);
  *out = c;
  return EMBPS_OK;
fail:
  embps_client_free(c);
  return ret;
}
