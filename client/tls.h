/* TLS for the client's connections (internal to libembps): the context built from the
 * options' CA, certificate and key, the handshake on a connected socket, and send/recv over the
 * TLS session for conn.c's non-blocking socket loop. */
#ifndef EMBPS_CLIENT_TLS_H
#define EMBPS_CLIENT_TLS_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/status.h"

/**
 * A client TLS context that verifies servers against the PEM CAs in ca_file and offers ALPN
 * h2; with cert_file and key_file (both or neither), it presents that certificate when a server
 * asks (mutual TLS). The caller owns *out (SSL_CTX_free); on failure it is untouched.
 * Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (err names the option and the file);
 * EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__tls_client_ctx_new(SSL_CTX **out, const char *ca_file, const char *cert_file,
                                         const char *key_file, embps_error_t *err);

/**
 * Runs the TLS handshake on fd (connected, non-blocking) until deadline_ms (CLOCK_MONOTONIC
 * ms), checking that the server's certificate chains to the context's CAs and names
 * server_name (a DNS name or an IP address, also sent as SNI when it is a name) and that ALPN
 * chose h2. authority names the server in messages. On success *out is the session, owned by
 * the caller (SSL_free before closing fd). Returns EMBPS_OK; UNAVAILABLE (the reason in err:
 * a certificate refused, a server that does not speak TLS, ...); DEADLINE_EXCEEDED;
 * RESOURCE_EXHAUSTED.
 */
embps_status_t embps__tls_client_handshake(SSL_CTX *ctx, int fd, const char *server_name,
                                           const char *authority, int64_t deadline_ms, SSL **out,
                                           embps_error_t *err);

/** Encrypts and sends up to n bytes. Returns the bytes taken (> 0); -1 with errno EAGAIN when
 * the socket is full; -1 with errno EPROTO (why in why[0..cap)) when the session broke.
 * A retry after EAGAIN must pass the same bytes again (possibly more, possibly moved). */
ssize_t embps__tls_client_send(SSL *ssl, const uint8_t *p, size_t n, char *why, size_t cap);

/** Receives and decrypts into buf, reading records until buf is full or the socket has no
 * more. Returns the bytes (> 0); 0 at the server's close_notify or EOF; -1 with errno EAGAIN
 * when nothing is ready; -1 with errno EPROTO (why in why[0..cap)) when the session broke. */
ssize_t embps__tls_client_recv(SSL *ssl, uint8_t *buf, size_t n, char *why, size_t cap);

#endif
