/* The server's TLS layer: OpenSSL between the libuv binding and the HTTP/2 core, with no I/O of
 * its own (STYLE.md: the protocol core stays free of I/O; this is h2o's swappable socket
 * binding, one level down).
 *
 * Each connection's SSL object reads and writes through one custom BIO instead of a socket:
 * its read side serves the ciphertext slice that embps__tls_feed was given (borrowed, so it is
 * not copied into a memory BIO first; OpenSSL keeps a partial record in its own buffer until
 * the next feed), and its write side appends every record OpenSSL produces to an output batch
 * of the core's kind (h2out.c), which net.c writes exactly like a cleartext batch. Decrypted
 * bytes go to the core through a callback, gathered into one buffer per context so that the
 * core sees few large pieces rather than one per 16 KiB record.
 *
 * Encryption: the core's output is a list of segments, many of them tiny (9-byte frame
 * headers, 5-byte gRPC prefixes) around large reply bodies. Sealing each as its own record
 * would cost a record header, a tag and a cipher call for every few bytes, so small pieces are
 * gathered into a staging buffer and every record but a batch's last is a full 16 KiB one.
 *
 * The handshake needs no timer of its own: until the h2 preface has arrived the core is in its
 * RECEIVING phase, so net.c's stall timer bounds a handshake that stops half-way. ALPN must
 * select "h2"; a client that offers other protocols only gets a no_application_protocol
 * alert, and one that offers none is refused after the handshake. All of it runs on the loop
 * thread. */
#include "server/net/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"
#include "common/tls.h"
#include "server/net/h2conn_internal.h"

#define PLAIN_BUF_BYTES (256u << 10)
#define RECORD_BYTES SSL3_RT_MAX_PLAIN_LENGTH /* 16 KiB, the most one record carries */

struct embps__tls_ctx {
  SSL_CTX *ssl_ctx;
  BIO_METHOD *bio_method;
  int mutual;
  uint8_t *plain;              /* PLAIN_BUF_BYTES of decrypted input (loop thread only) */
  uint8_t stage[RECORD_BYTES]; /* small output segments gathered into one record */
};

struct embps__tls {
  embps__tls_ctx_t *ctx;
  SSL *ssl;
  const uint8_t *in; /* the ciphertext being fed, not yet read by OpenSSL */
  size_t in_len;
  embps__h2out_t *out; /* ciphertext not yet taken */
  int done;            /* handshake complete, ALPN h2 */
  int failed;
};

/* ---- the BIO between OpenSSL and the binding ---- */

static int bio_create(BIO *b) {
  BIO_set_init(b, 1);
  return 1;
}

static int bio_write(BIO *b, const char *data, int len) {
  embps__tls_t *t = BIO_get_data(b);
  BIO_clear_retry_flags(b);
  if (len <= 0)
    return 0;
  if (!t->out)
    t->out = embps__h2out_new();
  if (!t->out || embps__h2out_copy(t->out, (const uint8_t *)data, (size_t)len) < 0) {
    t->failed = 1;
    return -1;
  }
  return len;
}

static int bio_read(BIO *b, char *buf, int len) {
  embps__tls_t *t = BIO_get_data(b);
  BIO_clear_retry_flags(b);
  if (t->in_len == 0) {
    BIO_set_retry_read(b); /* WANT_READ: wait for the next feed */
    return -1;
  }
  size_t n = t->in_len < (size_t)len ? t->in_len : (size_t)len;
  memcpy(buf, t->in, n);
  t->in += n;
  t->in_len -= n;
  return (int)n;
}

static long bio_ctrl(BIO *b, int cmd, long num, void *ptr) {
  return cmd == BIO_CTRL_FLUSH ? 1 : 0; /* writes are never buffered here */
}

/* ---- the context ---- */

static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg) {
  unsigned char *selected;
  if (SSL_select_next_proto(&selected, outlen, embps_tls_alpn, sizeof(embps_tls_alpn), in, inlen) !=
      OPENSSL_NPN_NEGOTIATED)
    return SSL_TLSEXT_ERR_ALERT_FATAL; /* no_application_protocol */
  *out = selected;
  return SSL_TLSEXT_ERR_OK;
}

embps_status_t embps__tls_ctx_new(embps__tls_ctx_t **out, const char *cert_file,
                                  const char *key_file, const char *client_ca_file,
                                  embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  embps__tls_ctx_t *ctx = embps_calloc(1, sizeof(*ctx));
  if (!ctx)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for TLS");
  ctx->plain = embps_malloc(PLAIN_BUF_BYTES);
  ctx->bio_method = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "embps-net");
  if (!ctx->plain || !ctx->bio_method || !BIO_meth_set_create(ctx->bio_method, bio_create) ||
      !BIO_meth_set_write(ctx->bio_method, bio_write) ||
      !BIO_meth_set_read(ctx->bio_method, bio_read) ||
      !BIO_meth_set_ctrl(ctx->bio_method, bio_ctrl)) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for TLS");
    goto fail;
  }
  if ((ret = embps_tls_ctx_new(&ctx->ssl_ctx, TLS_server_method(), err)) != EMBPS_OK)
    goto fail;
  /* Idle connections give their 2 x 17 KiB of record buffers back (up to 4096 connections). */
  SSL_CTX_set_mode(ctx->ssl_ctx, SSL_MODE_RELEASE_BUFFERS);
  SSL_CTX_set_alpn_select_cb(ctx->ssl_ctx, alpn_select, NULL);
  if ((ret = embps_tls_load_identity(ctx->ssl_ctx, cert_file, "--tls-cert", key_file, "--tls-key",
                                     err)) != EMBPS_OK)
    goto fail;
  if (client_ca_file && client_ca_file[0]) {
    STACK_OF(X509_NAME) * names;
    if ((ret = embps_tls_load_ca(ctx->ssl_ctx, client_ca_file, "--tls-client-ca", err)) != EMBPS_OK)
      goto fail;
    /* The CertificateRequest names the acceptable CAs, so a client holding several
     * certificates can pick the right one. */
    names = SSL_load_client_CA_file(client_ca_file);
    if (names)
      SSL_CTX_set_client_CA_list(ctx->ssl_ctx, names);
    ERR_clear_error();
    SSL_CTX_set_verify(ctx->ssl_ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    ctx->mutual = 1;
  }
  *out = ctx;
exit:
  return ret;
fail:
  embps__tls_ctx_free(ctx);
  goto exit;
}

void embps__tls_ctx_free(embps__tls_ctx_t *ctx) {
  if (!ctx)
    return;
  SSL_CTX_free(ctx->ssl_ctx);
  BIO_meth_free(ctx->bio_method);
  embps_free(ctx->plain);
  embps_free(ctx);
}

int embps__tls_ctx_mutual(const embps__tls_ctx_t *ctx) { return ctx->mutual; }

/* ---- one connection ---- */

embps_status_t embps__tls_new(embps__tls_t **out, embps__tls_ctx_t *ctx) {
  embps__tls_t *t = embps_calloc(1, sizeof(*t));
  BIO *bio = NULL;
  if (!t)
    return EMBPS_RESOURCE_EXHAUSTED;
  t->ctx = ctx;
  t->ssl = SSL_new(ctx->ssl_ctx);
  bio = t->ssl ? BIO_new(ctx->bio_method) : NULL;
  if (!bio) {
    SSL_free(t->ssl);
    embps_free(t);
    ERR_clear_error();
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  BIO_set_data(bio, t);
  SSL_set_bio(t->ssl, bio, bio); /* the SSL owns the BIO */
  SSL_set_accept_state(t->ssl);
  *out = t;
  return EMBPS_OK;
}

void embps__tls_free(embps__tls_t *t) {
  if (!t)
    return;
  SSL_free(t->ssl);
  embps__h2out_free(t->out);
  embps_free(t);
}

int embps__tls_handshake_done(const embps__tls_t *t) { return t->done; }

int embps__tls_failed(const embps__tls_t *t) { return t->failed; }

/* Ends the session: records why, drops the input left. */
static embps_status_t tls_fail(embps__tls_t *t, embps_error_t *err, const char *what, int rc) {
  char why[256];
  int e = SSL_get_error(t->ssl, rc);
  long verify = SSL_get_verify_result(t->ssl);
  t->failed = 1;
  t->in_len = 0;
  if (e == SSL_ERROR_ZERO_RETURN)
    snprintf(why, sizeof(why), "the peer closed the TLS session");
  else if (verify != X509_V_OK)
    snprintf(why, sizeof(why), "client certificate refused: %s",
             X509_verify_cert_error_string(verify));
  else if (e == SSL_ERROR_SSL)
    embps_tls_error(why, sizeof(why));
  else
    snprintf(why, sizeof(why), "SSL error %d", e);
  ERR_clear_error();
  return embps_error_set(err, EMBPS_UNAVAILABLE, "%s: %s", what, why);
}

static embps_status_t handshake(embps__tls_t *t, embps_error_t *err) {
  const unsigned char *proto = NULL;
  unsigned int proto_len = 0;
  int rc = SSL_do_handshake(t->ssl);
  if (rc != 1) {
    if (SSL_get_error(t->ssl, rc) == SSL_ERROR_WANT_READ && !t->failed)
      return EMBPS_OK; /* more of the client's flight to come */
    return tls_fail(t, err, "TLS handshake failed", rc);
  }
  SSL_get0_alpn_selected(t->ssl, &proto, &proto_len);
  if (proto_len != 2 || memcmp(proto, "h2", 2) != 0) {
    t->failed = 1;
    t->in_len = 0;
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "TLS handshake refused: the client did not offer ALPN h2 (embps "
                           "serves gRPC over HTTP/2 only)");
  }
  t->done = 1;
  EMBPS_DEBUG("TLS handshake done: %s, %s%s", SSL_get_version(t->ssl), SSL_get_cipher_name(t->ssl),
              t->ctx->mutual ? ", client certificate verified" : "");
  return EMBPS_OK;
}

embps_status_t embps__tls_feed(embps__tls_t *t, const uint8_t *data, size_t len,
                               embps__tls_plain_cb plain, void *user, embps_error_t *err) {
  embps_status_t ret;
  uint8_t *buf = t->ctx->plain;
  if (t->failed)
    return embps_error_set(err, EMBPS_UNAVAILABLE, "the TLS session has failed");
  t->in = data;
  t->in_len = len;
  ERR_clear_error();
  if (!t->done && ((ret = handshake(t, err)) != EMBPS_OK || !t->done))
    return ret;
  /* Every round reads until the input is used up (WANT_READ) or the buffer is full, so the
   * loop ends once the fed bytes are consumed. */
  for (;;) {
    size_t got = 0, n;
    int rc = 1;
    while (got < PLAIN_BUF_BYTES &&
           (rc = SSL_read_ex(t->ssl, buf + got, PLAIN_BUF_BYTES - got, &n)) == 1)
      got += n;
    if (got > 0 && (ret = plain(user, buf, got)) != EMBPS_OK) {
      t->in_len = 0;
      return ret;
    }
    if (rc == 1)
      continue; /* the buffer filled: read on */
    if (SSL_get_error(t->ssl, rc) == SSL_ERROR_WANT_READ && !t->failed)
      return EMBPS_OK;
    return tls_fail(t, err, "TLS session ended", rc);
  }
}

/* Encrypts len bytes (len > 0) as records into t->out. Returns 0, or -1 (failed). */
static int seal(embps__tls_t *t, const uint8_t *p, size_t len) {
  size_t n;
  if (SSL_write_ex(t->ssl, p, len, &n) != 1 || n != len) {
    char why[256];
    EMBPS_WARN("closing TLS connection: cannot encrypt: %s", embps_tls_error(why, sizeof(why)));
    t->failed = 1;
    return -1;
  }
  return 0;
}

/* Encrypts a batch of the core's output, in full records except the last. */
static void seal_batch(embps__tls_t *t, const embps__h2out_t *plain) {
  size_t nsegs, staged = 0;
  const embps__h2seg_t *segs = embps__h2out_segs(plain, &nsegs);
  uint8_t *stage = t->ctx->stage;
  for (size_t i = 0; i < nsegs && !t->failed; i++) {
    const uint8_t *p = segs[i].base;
    size_t len = segs[i].len;
    while (len > 0 && !t->failed) {
      if (staged == 0 && len >= RECORD_BYTES) {
        size_t whole = len - len % RECORD_BYTES;
        seal(t, p, whole);
        p += whole;
        len -= whole;
        continue;
      }
      size_t k = RECORD_BYTES - staged < len ? RECORD_BYTES - staged : len;
      memcpy(stage + staged, p, k);
      staged += k;
      p += k;
      len -= k;
      if (staged == RECORD_BYTES) {
        seal(t, stage, staged);
        staged = 0;
      }
    }
  }
  if (staged > 0 && !t->failed)
    seal(t, stage, staged);
}

embps__h2out_t *embps__tls_take_output(embps__tls_t *t, embps__h2conn_t *h2) {
  embps__h2out_t *out;
  if (t->done && !t->failed && h2) {
    embps__h2out_t *plain = embps__h2conn_take_output(h2);
    if (plain) {
      ERR_clear_error();
      seal_batch(t, plain);
      embps__h2out_free(plain); /* the bodies are released once encrypted */
    }
  }
  out = t->out;
  t->out = NULL;
  return out;
}
