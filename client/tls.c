/* TLS for the client's connections: OpenSSL directly on conn.c's non-blocking socket.
 *
 * The client drives its sockets with poll() in the caller's thread, so the TLS session can own
 * the file descriptor (a socket BIO) and no memory BIOs are needed: SSL_read and SSL_write take
 * the place of recv and send, and their WANT_READ/WANT_WRITE become EAGAIN. The handshake runs
 * to completion inside connecting, bounded by the connect deadline, so the HTTP/2 session above
 * only ever sees an established channel.
 *
 * Verification is always on: the server's certificate must chain to the given CAs and name the
 * host the caller dialed (or tls_server_name), which SSL_set1_host checks as a DNS name or, for
 * an address like 127.0.0.1, as an IP SAN. There is deliberately no switch to skip it.
 *
 * Writes use SSL_MODE_ENABLE_PARTIAL_WRITE, so a large frame is taken record by record as the
 * socket drains, and SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER, because conn.c retries a write from
 * its write buffer, which may have been reallocated (and grown) since. */
#include "client/tls.h"

#include <errno.h>
#include <openssl/err.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "common/tls.h"

#define READ_AHEAD_BYTES (256u << 10)

embps_status_t embps__tls_client_ctx_new(SSL_CTX **out, const char *ca_file, const char *cert_file,
                                         const char *key_file, embps_error_t *err) {
  embps_status_t ret;
  SSL_CTX *ctx = NULL;
  int has_cert = cert_file && cert_file[0], has_key = key_file && key_file[0];
  if (has_cert != has_key)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "tls_cert and tls_key go together: give both (a client certificate "
                           "for mutual TLS) or neither");
  if ((ret = embps_tls_ctx_new(&ctx, TLS_client_method(), err)) != EMBPS_OK)
    return ret;
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  /* Replies are megabytes: read them from the socket in large pieces, not a 5-byte record
   * header and then its body for every 16 KiB record. */
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, READ_AHEAD_BYTES);
  if ((ret = embps_tls_load_ca(ctx, ca_file, "tls_ca", err)) != EMBPS_OK)
    goto fail;
  if (has_cert && (ret = embps_tls_load_identity(ctx, cert_file, "tls_cert", key_file, "tls_key",
                                                 err)) != EMBPS_OK)
    goto fail;
  /* SSL_CTX_set_alpn_protos returns 0 on success. */
  if (SSL_CTX_set_alpn_protos(ctx, embps_tls_alpn, sizeof(embps_tls_alpn)) != 0) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  *out = ctx;
  return EMBPS_OK;
fail:
  SSL_CTX_free(ctx);
  return ret;
}

/* OpenSSL's socket BIO writes with write(), which raises SIGPIPE when the server has closed
 * (a mutual-TLS server refuses a client after a TLS 1.3 handshake the client thinks is done): a
 * library must not kill its caller for that. This BIO is the socket BIO with its write done by
 * send(MSG_NOSIGNAL), as conn.c does for cleartext. */
static BIO_METHOD *nosigpipe_method;
static pthread_once_t nosigpipe_once = PTHREAD_ONCE_INIT;

static int nosigpipe_write(BIO *b, const char *data, int len) {
  ssize_t n = send(BIO_get_fd(b, NULL), data, (size_t)len, MSG_NOSIGNAL);
  BIO_clear_retry_flags(b);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
    BIO_set_retry_write(b);
  return (int)n;
}

static void nosigpipe_init(void) {
  const BIO_METHOD *sock = BIO_s_socket();
  BIO_METHOD *m = BIO_meth_new(BIO_TYPE_SOCKET, "embps-socket");
  if (m && BIO_meth_set_write(m, nosigpipe_write) &&
      BIO_meth_set_read(m, BIO_meth_get_read(sock)) &&
      BIO_meth_set_puts(m, BIO_meth_get_puts(sock)) &&
      BIO_meth_set_ctrl(m, BIO_meth_get_ctrl(sock)) &&
      BIO_meth_set_create(m, BIO_meth_get_create(sock)) &&
      BIO_meth_set_destroy(m, BIO_meth_get_destroy(sock)))
    nosigpipe_method = m;
  else
    BIO_meth_free(m);
}

/* A BIO on fd (not closing it) that never raises SIGPIPE; NULL when out of memory. */
static BIO *socket_bio(int fd) {
  BIO *b;
  pthread_once(&nosigpipe_once, nosigpipe_init);
  if (!nosigpipe_method || !(b = BIO_new(nosigpipe_method)))
    return NULL;
  BIO_set_fd(b, fd, BIO_NOCLOSE);
  return b;
}

/* A failed handshake's reason, with the likely cause for the common ones. */
static embps_status_t handshake_failed(SSL *ssl, int rc, const char *authority,
                                       const char *server_name, embps_error_t *err) {
  char why[256];
  long verify = SSL_get_verify_result(ssl);
  int e = SSL_get_error(ssl, rc);
  if (verify != X509_V_OK) {
    ERR_clear_error();
    return embps_error_set(err, EMBPS_UNAVAILABLE,
                           "TLS handshake with %s failed: server certificate refused: %s "
                           "(it must be signed by a CA in tls_ca and name %s)",
                           authority, X509_verify_cert_error_string(verify), server_name);
  }
  if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)
    snprintf(why, sizeof(why), "%s", errno ? strerror(errno) : "the server closed the connection");
  else
    embps_tls_error(why, sizeof(why));
  return embps_error_set(err, EMBPS_UNAVAILABLE,
                         "TLS handshake with %s failed: %s (does the server serve TLS, with "
                         "--tls-cert?)",
                         authority, why);
}

embps_status_t embps__tls_client_handshake(SSL_CTX *ctx, int fd, const char *server_name,
                                           const char *authority, int64_t deadline_ms, SSL **out,
                                           embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  const unsigned char *proto = NULL;
  unsigned int proto_len = 0;
  unsigned char ip[16];
  int is_ip = inet_pton(AF_INET, server_name, ip) == 1 || inet_pton(AF_INET6, server_name, ip) == 1;
  SSL *ssl = SSL_new(ctx);
  BIO *bio = ssl ? socket_bio(fd) : NULL;
  ERR_clear_error();
  if (bio)
    SSL_set_bio(ssl, bio, bio); /* the SSL owns the BIO */
  if (!bio || SSL_set1_host(ssl, server_name) != 1 ||
      (!is_ip && SSL_set_tlsext_host_name(ssl, server_name) != 1)) {
    ERR_clear_error();
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  /* Each round waits for what OpenSSL asked for; the deadline bounds the rounds. */
  for (;;) {
    int rc, e, prc;
    int64_t left;
    struct pollfd p = {.fd = fd};
    errno = 0;
    rc = SSL_connect(ssl);
    if (rc == 1)
      break;
    e = SSL_get_error(ssl, rc);
    if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
      ret = handshake_failed(ssl, rc, authority, server_name, err);
      goto fail;
    }
    p.events = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
    left = deadline_ms - (int64_t)embps_now_ms();
    if (left <= 0 || (prc = poll(&p, 1, left > 1000000 ? 1000000 : (int)left)) == 0) {
      ret = embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                            "TLS handshake with %s: no answer in time (does the server serve "
                            "TLS?)",
                            authority);
      goto fail;
    }
    if (prc < 0 && errno != EINTR) {
      ret = embps_error_set(err, EMBPS_UNAVAILABLE, "TLS handshake with %s: poll: %s", authority,
                            strerror(errno));
      goto fail;
    }
  }
  SSL_get0_alpn_selected(ssl, &proto, &proto_len);
  if (proto_len != 2 || memcmp(proto, "h2", 2) != 0) {
    ret = embps_error_set(err, EMBPS_UNAVAILABLE,
                          "TLS handshake with %s: the server did not choose ALPN h2 (it is not "
                          "a gRPC server)",
                          authority);
    goto fail;
  }
  *out = ssl;
  return EMBPS_OK;
fail:
  SSL_free(ssl);
  return ret;
}

/* The result of a failed SSL_read/SSL_write as send/recv would give it. */
static ssize_t io_error(SSL *ssl, int rc, char *why, size_t cap) {
  int e = SSL_get_error(ssl, rc);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
    errno = EAGAIN;
    return -1;
  }
  if (e == SSL_ERROR_ZERO_RETURN)
    return 0;
  if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)
    snprintf(why, cap, "TLS: %s", errno ? strerror(errno) : "the server closed the connection");
  else {
    char reason[256];
    snprintf(why, cap, "TLS: %s", embps_tls_error(reason, sizeof(reason)));
  }
  ERR_clear_error();
  errno = EPROTO;
  return -1;
}

ssize_t embps__tls_client_send(SSL *ssl, const uint8_t *p, size_t n, char *why, size_t cap) {
  size_t done = 0;
  int rc;
  ERR_clear_error();
  rc = SSL_write_ex(ssl, p, n, &done);
  if (rc == 1)
    return (ssize_t)done;
  return io_error(ssl, rc, why, cap);
}

ssize_t embps__tls_client_recv(SSL *ssl, uint8_t *buf, size_t n, char *why, size_t cap) {
  size_t got = 0, k;
  int rc = 1;
  ERR_clear_error();
  /* One record is at most 16 KiB: read records until buf is full or none is left. */
  while (got < n && (rc = SSL_read_ex(ssl, buf + got, n - got, &k)) == 1)
    got += k;
  if (got > 0) {
    ERR_clear_error(); /* the error, if any, shows again at the next read */
    return (ssize_t)got;
  }
  return io_error(ssl, rc, why, cap);
}
