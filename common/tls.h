/* What both ends of an embps TLS connection share over OpenSSL: a context with the project's
 * floor (TLS 1.2, ALPN "h2"), loading a certificate chain with its key and a CA bundle with
 * errors that name the flag and the file, and OpenSSL's last error as text. Used by server/net
 * (the server's TLS binding) and client/ (the C client's connections). */
#ifndef EMBPS_COMMON_TLS_H
#define EMBPS_COMMON_TLS_H

#include <openssl/ssl.h>

#include "common/status.h"

/** The ALPN protocol list both ends send and accept: HTTP/2 only ("\x02h2"). */
extern const unsigned char embps_tls_alpn[3];

/**
 * A new TLS context for method (TLS_server_method() or TLS_client_method()) with TLS 1.2 as
 * the lowest version (1.3 preferred, as OpenSSL negotiates the highest both support) and
 * renegotiation off. The caller owns *out (SSL_CTX_free). On failure *out is untouched:
 * RESOURCE_EXHAUSTED.
 */
embps_status_t embps_tls_ctx_new(SSL_CTX **out, const SSL_METHOD *method, embps_error_t *err);

/**
 * Loads a PEM certificate chain and its PEM private key into ctx and checks that they match.
 * cert_flag and key_flag name where the paths came from ("--tls-cert") for the messages.
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT: a file that cannot be read (with errno's
 * reason), holds no certificate or key, or a key that does not match the certificate.
 */
embps_status_t embps_tls_load_identity(SSL_CTX *ctx, const char *cert_file, const char *cert_flag,
                                       const char *key_file, const char *key_flag,
                                       embps_error_t *err);

/**
 * Loads the PEM CA certificates in ca_file as the trust anchors ctx verifies peers against.
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT (unreadable, or no certificate in it).
 */
embps_status_t embps_tls_load_ca(SSL_CTX *ctx, const char *ca_file, const char *ca_flag,
                                 embps_error_t *err);

/**
 * Writes OpenSSL's earliest queued error of this thread as text ("wrong version number") into
 * buf and clears the queue; "no further detail" when the queue is empty. Returns buf.
 */
const char *embps_tls_error(char *buf, size_t cap);

#endif
