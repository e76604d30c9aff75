/* The server's TLS layer without sockets: an OpenSSL client SSL on two memory BIOs talks to one
 * embps__tls connection; what the layer produces goes through its output batches as net.c
 * writes them. The certificates are made once by the openssl CLI in a temporary folder (the
 * test skips with 77 without it). Includes tls.c to reach seal_batch. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/net/tls.c"

static char dir[] = "/tmp/embps-test-tls-XXXXXX";
static char ca[256], cert[256], key[256], wrong_key[256];

static const char *path(char *buf, const char *name) {
  snprintf(buf, 256, "%s/%s", dir, name);
  return buf;
}

/* ---- an in-memory client ---- */

typedef struct client {
  SSL_CTX *ctx;
  SSL *ssl;
  BIO *in, *out; /* in: what the server sent, for the client to read; out: what it wrote */
} client_t;

static void client_init(client_t *cl, int alpn, const char *ca_file) {
  cl->ctx = SSL_CTX_new(TLS_client_method());
  assert_non_null(cl->ctx);
  SSL_CTX_set_verify(cl->ctx, SSL_VERIFY_PEER, NULL);
  assert_int_equal(SSL_CTX_load_verify_locations(cl->ctx, ca_file, NULL), 1);
  if (alpn)
    assert_int_equal(SSL_CTX_set_alpn_protos(cl->ctx, embps_tls_alpn, sizeof(embps_tls_alpn)), 0);
  cl->ssl = SSL_new(cl->ctx);
  cl->in = BIO_new(BIO_s_mem());
  cl->out = BIO_new(BIO_s_mem());
  SSL_set_bio(cl->ssl, cl->in, cl->out);
  SSL_set_connect_state(cl->ssl);
  assert_int_equal(SSL_set1_host(cl->ssl, "localhost"), 1);
}

static void client_free(client_t *cl) {
  SSL_free(cl->ssl);
  SSL_CTX_free(cl->ctx);
}

/* What the server's plaintext callback gathered. */
typedef struct sink {
  uint8_t *data;
  size_t len, cap;
  int calls;
} sink_t;

static embps_status_t to_sink(void *user, const uint8_t *data, size_t len) {
  sink_t *s = user;
  if (s->len + len > s->cap) {
    s->cap = (s->len + len) * 2;
    s->data = realloc(s->data, s->cap);
    assert_non_null(s->data);
  }
  memcpy(s->data + s->len, data, len);
  s->len += len;
  s->calls++;
  return EMBPS_OK;
}

/* Moves the server's pending ciphertext to the client; returns its byte count. */
static size_t server_to_client(embps__tls_t *t, client_t *cl) {
  embps__h2out_t *out = embps__tls_take_output(t, NULL);
  size_t nsegs, bytes = 0;
  if (!out)
    return 0;
  const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
  for (size_t i = 0; i < nsegs; i++) {
    assert_int_equal(BIO_write(cl->in, segs[i].base, (int)segs[i].len), (int)segs[i].len);
    bytes += segs[i].len;
  }
  embps__h2out_free(out);
  return bytes;
}

/* Feeds the client's pending output to the server, step bytes at a time (0: all at once). */
static embps_status_t client_to_server(client_t *cl, embps__tls_t *t, sink_t *sink, size_t step,
                                       embps_error_t *err) {
  uint8_t buf[65536];
  int n;
  embps_status_t st = EMBPS_OK;
  while (st == EMBPS_OK && (n = BIO_read(cl->out, buf, sizeof(buf))) > 0) {
    for (size_t off = 0; off < (size_t)n && st == EMBPS_OK;) {
      size_t k = step && step < (size_t)n - off ? step : (size_t)n - off;
      st = embps__tls_feed(t, buf + off, k, to_sink, sink, err);
      off += k;
    }
  }
  return st;
}

/* Runs the handshake to its end (a bounded number of flights). Returns the server's status. */
static embps_status_t handshake_pair(client_t *cl, embps__tls_t *t, sink_t *sink, size_t step,
                                     embps_error_t *err) {
  embps_status_t st = EMBPS_OK;
  for (int round = 0; round < 10 && st == EMBPS_OK; round++) {
    int rc = SSL_do_handshake(cl->ssl);
    st = client_to_server(cl, t, sink, step, err);
    server_to_client(t, cl);
    if (rc == 1 && embps__tls_handshake_done(t))
      break;
  }
  return st;
}

static embps__tls_ctx_t *new_ctx(const char *client_ca) {
  embps__tls_ctx_t *ctx = NULL;
  embps_error_t err;
  embps_error_clear(&err);
  assert_int_equal(embps__tls_ctx_new(&ctx, cert, key, client_ca, &err), EMBPS_OK);
  return ctx;
}

/* ---- tests ---- */

static void test_handshake_and_both_directions(void **state) {
  embps__tls_ctx_t *ctx = new_ctx(NULL);
  embps__tls_t *t = NULL;
  client_t cl;
  sink_t sink = {0};
  embps_error_t err;
  embps_error_clear(&err);
  client_init(&cl, 1, ca);
  assert_int_equal(embps__tls_new(&t, ctx), EMBPS_OK);
  /* One byte at a time: partial records wait inside OpenSSL between feeds. */
  assert_int_equal(handshake_pair(&cl, t, &sink, 1, &err), EMBPS_OK);
  assert_true(embps__tls_handshake_done(t));
  const unsigned char *proto;
  unsigned int proto_len;
  SSL_get0_alpn_selected(cl.ssl, &proto, &proto_len);
  assert_int_equal(proto_len, 2);
  assert_memory_equal(proto, "h2", 2);
  assert_string_equal(SSL_get_version(cl.ssl), "TLSv1.3");

  /* client -> server: 300 KiB (more than the layer's plaintext buffer) arrives intact */
  size_t n = 300u << 10;
  uint8_t *msg = malloc(n);
  for (size_t i = 0; i < n; i++)
    msg[i] = (uint8_t)(i * 7 + (i >> 11));
  size_t w;
  assert_int_equal(SSL_write_ex(cl.ssl, msg, n, &w), 1);
  assert_int_equal(client_to_server(&cl, t, &sink, 0, &err), EMBPS_OK);
  assert_int_equal(sink.len, n);
  assert_memory_equal(sink.data, msg, n);

  /* server -> client: a batch of tiny and large segments (frame headers around bodies) is
   * sealed in full 16 KiB records except the last one */
  embps__h2out_t *plain = embps__h2out_new();
  size_t sizes[] = {9, 5, 70000, 9, 1, 16384, 9, 5, 3, 40000, 9, 32768};
  size_t total = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    assert_int_equal(embps__h2out_copy(plain, msg + total, sizes[i]), 0);
    total += sizes[i];
  }
  seal_batch(t, plain);
  embps__h2out_free(plain);
  size_t records = (total + RECORD_BYTES - 1) / RECORD_BYTES;
  /* TLS 1.3 AEAD: 5-byte header, 1-byte inner type and 16-byte tag per record */
  assert_int_equal(server_to_client(t, &cl), total + records * 22);
  uint8_t *got = malloc(total);
  size_t have = 0, k;
  while (have < total && SSL_read_ex(cl.ssl, got + have, total - have, &k) == 1)
    have += k;
  assert_int_equal(have, total);
  assert_memory_equal(got, msg, total);

  free(got);
  free(msg);
  free(sink.data);
  embps__tls_free(t);
  client_free(&cl);
  embps__tls_ctx_free(ctx);
}

static void test_no_alpn_is_refused(void **state) {
  embps__tls_ctx_t *ctx = new_ctx(NULL);
  embps__tls_t *t = NULL;
  client_t cl;
  sink_t sink = {0};
  embps_error_t err;
  embps_error_clear(&err);
  client_init(&cl, 0, ca);
  assert_int_equal(embps__tls_new(&t, ctx), EMBPS_OK);
  assert_int_equal(handshake_pair(&cl, t, &sink, 0, &err), EMBPS_UNAVAILABLE);
  assert_non_null(strstr(err.message, "did not offer ALPN h2"));
  assert_false(embps__tls_handshake_done(t));
  assert_true(embps__tls_failed(t));
  embps__tls_free(t);
  client_free(&cl);
  embps__tls_ctx_free(ctx);
}

static void test_cleartext_peer_is_refused(void **state) {
  embps__tls_ctx_t *ctx = new_ctx(NULL);
  embps__tls_t *t = NULL;
  sink_t sink = {0};
  embps_error_t err;
  static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  embps_error_clear(&err);
  assert_int_equal(embps__tls_new(&t, ctx), EMBPS_OK);
  assert_int_equal(
      embps__tls_feed(t, (const uint8_t *)preface, sizeof(preface) - 1, to_sink, &sink, &err),
      EMBPS_UNAVAILABLE);
  assert_non_null(strstr(err.message, "TLS handshake failed"));
  assert_int_equal(sink.len, 0);
  /* an alert may be queued for the peer; later input is refused */
  embps__h2out_free(embps__tls_take_output(t, NULL));
  assert_int_equal(embps__tls_feed(t, (const uint8_t *)"x", 1, to_sink, &sink, &err),
                   EMBPS_UNAVAILABLE);
  embps__tls_free(t);
  embps__tls_ctx_free(ctx);
}

static void test_mutual_tls_needs_a_certificate(void **state) {
  embps__tls_ctx_t *ctx = new_ctx(ca);
  embps__tls_t *t = NULL;
  client_t cl;
  sink_t sink = {0};
  embps_error_t err;
  embps_error_clear(&err);
  assert_true(embps__tls_ctx_mutual(ctx));
  client_init(&cl, 1, ca);
  assert_int_equal(embps__tls_new(&t, ctx), EMBPS_OK);
  assert_int_equal(handshake_pair(&cl, t, &sink, 0, &err), EMBPS_UNAVAILABLE);
  assert_non_null(strstr(err.message, "peer did not return a certificate"));
  embps__tls_free(t);
  client_free(&cl);

  /* the server's own certificate, offered as a client certificate, chains to the CA */
  client_init(&cl, 1, ca);
  assert_int_equal(SSL_use_certificate_chain_file(cl.ssl, cert), 1);
  assert_int_equal(SSL_use_PrivateKey_file(cl.ssl, key, SSL_FILETYPE_PEM), 1);
  assert_int_equal(embps__tls_new(&t, ctx), EMBPS_OK);
  assert_int_equal(handshake_pair(&cl, t, &sink, 0, &err), EMBPS_OK);
  assert_true(embps__tls_handshake_done(t));
  embps__tls_free(t);
  client_free(&cl);
  embps__tls_ctx_free(ctx);
}

static void test_context_refuses_bad_files(void **state) {
  embps__tls_ctx_t *ctx = NULL;
  embps_error_t err;
  char missing[256];
  embps_error_clear(&err);
  assert_int_equal(embps__tls_ctx_new(&ctx, path(missing, "missing.crt"), key, NULL, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "--tls-cert"));
  assert_non_null(strstr(err.message, "No such file or directory"));
  assert_int_equal(embps__tls_ctx_new(&ctx, cert, wrong_key, NULL, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "does not match the certificate"));
  assert_int_equal(embps__tls_ctx_new(&ctx, key, key, NULL, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "not a PEM certificate chain"));
  assert_int_equal(embps__tls_ctx_new(&ctx, cert, key, key, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "--tls-client-ca"));
  assert_null(ctx); /* untouched on failure */
}

int main(void) {
  char cmd[2048];
  if (system("command -v openssl >/dev/null 2>&1") != 0) {
    printf("SKIP: the openssl command-line tool is not installed\n");
    return 77;
  }
  if (!mkdtemp(dir))
    return 1;
  snprintf(cmd, sizeof(cmd),
           "cd %s && EC='-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes' && "
           "openssl req -x509 $EC -keyout ca.key -out ca.crt -days 2 -subj /CN=ca && "
           "openssl req $EC -keyout s.key -out s.csr -subj /CN=localhost && "
           "printf 'subjectAltName=DNS:localhost\\n' > s.ext && "
           "openssl x509 -req -in s.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out s.crt "
           "-days 2 -extfile s.ext && "
           "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out w.key",
           dir);
  if (system(cmd) != 0) {
    printf("could not make the test certificates\n");
    return 1;
  }
  path(ca, "ca.crt");
  path(cert, "s.crt");
  path(key, "s.key");
  path(wrong_key, "w.key");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_handshake_and_both_directions),
      cmocka_unit_test(test_no_alpn_is_refused),
      cmocka_unit_test(test_cleartext_peer_is_refused),
      cmocka_unit_test(test_mutual_tls_needs_a_certificate),
      cmocka_unit_test(test_context_refuses_bad_files),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  if (system(cmd) != 0)
    rc = rc ? rc : 1;
  return rc;
}
