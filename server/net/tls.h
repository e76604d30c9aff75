/* The server's TLS layer (internal to server/net): OpenSSL between the socket and the HTTP/2
 * core, free of I/O like the core itself. The binding (net.c) feeds it the ciphertext it reads
 * and takes from it the ciphertext to write; in between, the plaintext goes to and comes from
 * the h2conn core. Tests drive it with a client SSL object in memory. */
#ifndef EMBPS_SERVER_NET_TLS_H
#define EMBPS_SERVER_NET_TLS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/net/h2conn.h"

typedef struct embps__tls_ctx embps__tls_ctx_t;
typedef struct embps__tls embps__tls_t;

/**
 * The server's TLS context: its certificate chain and key and, when client_ca_file is not NULL
 * or empty, the CAs a client certificate must chain to (mutual TLS: a client without one is
 * refused). ALPN must select "h2". The files are read now. On failure *out is untouched.
 * Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (err names the flag and file: unreadable, not PEM,
 * a key that does not match); EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__tls_ctx_new(embps__tls_ctx_t **out, const char *cert_file,
                                  const char *key_file, const char *client_ca_file,
                                  embps_error_t *err);

/** Frees a context once no connection uses it. NULL is a no-op. */
void embps__tls_ctx_free(embps__tls_ctx_t *ctx);

/** Non-zero when the context asks for client certificates. */
int embps__tls_ctx_mutual(const embps__tls_ctx_t *ctx);

/** Where the plaintext of embps__tls_feed goes (the h2conn core's feed, in net.c). */
typedef embps_status_t (*embps__tls_plain_cb)(void *user, const uint8_t *data, size_t len);

/**
 * The TLS state of one accepted connection (ctx is borrowed and must outlive it). On failure
 * *out is untouched. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__tls_new(embps__tls_t **out, embps__tls_ctx_t *ctx);

/** Frees the connection's TLS state and the ciphertext not yet taken. NULL is a no-op. */
void embps__tls_free(embps__tls_t *t);

/**
 * Feeds ciphertext read from the peer (borrowed), advances the handshake, and hands the
 * plaintext it decrypts to plain(user, ...) in order. Returns EMBPS_OK; what plain returned when
 * it failed; EMBPS_UNAVAILABLE when the TLS session is over (a failed handshake, a refused
 * client certificate, no ALPN "h2", a bad record, or the peer's close_notify), with the reason
 * in err. After a failure the owner should write what embps__tls_take_output still yields (an
 * alert) and close.
 */
embps_status_t embps__tls_feed(embps__tls_t *t, const uint8_t *data, size_t len,
                               embps__tls_plain_cb plain, void *user, embps_error_t *err);

/** Non-zero once the handshake has completed (the core's output may then be encrypted). */
int embps__tls_handshake_done(const embps__tls_t *t);

/**
 * Takes the ciphertext ready to be written as one output batch (the caller writes and frees it
 * like a core's batch), or NULL when there is none. Once the handshake is done it first
 * encrypts the core's next output batch (h2 may be NULL: handshake output only). A failure to
 * encrypt (out of memory) marks the connection failed: embps__tls_failed then says so.
 */
embps__h2out_t *embps__tls_take_output(embps__tls_t *t, embps__h2conn_t *h2);

/** Non-zero when the TLS session failed (feed or encryption) and the connection must close. */
int embps__tls_failed(const embps__tls_t *t);

#endif
