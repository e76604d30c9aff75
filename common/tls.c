/* OpenSSL helpers shared by the server's TLS binding and the client's connections (tls.h).
 *
 * Files are checked with access() before OpenSSL sees them, so a missing or unreadable file is
 * reported with errno's reason ("No such file or directory", "Permission denied"), which is
 * what an operator needs; OpenSSL's own text for the same case ("system lib") is not. */
#include "common/tls.h"

#include <errno.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

const unsigned char embps_tls_alpn[3] = {2, 'h', '2'};

const char *embps_tls_error(char *buf, size_t cap) {
  unsigned long e = ERR_get_error();
  const char *reason = e ? ERR_reason_error_string(e) : NULL;
  if (!e)
    snprintf(buf, cap, "no further detail");
  else if (reason)
    snprintf(buf, cap, "%s", reason);
  else
    ERR_error_string_n(e, buf, cap);
  ERR_clear_error();
  return buf;
}

embps_status_t embps_tls_ctx_new(SSL_CTX **out, const SSL_METHOD *method, embps_error_t *err) {
  char why[256];
  SSL_CTX *ctx = SSL_CTX_new(method);
  if (!ctx)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "cannot create a TLS context: %s",
                           embps_tls_error(why, sizeof(why)));
  /* HTTP/2 forbids TLS below 1.2 (RFC 9113 section 9.2) and renegotiation. */
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
  *out = ctx;
  return EMBPS_OK;
}

/* EMBPS_OK when path can be read; else INVALID_ARGUMENT naming the flag, the path and why. */
static embps_status_t check_readable(const char *path, const char *flag, embps_error_t *err) {
  if (!path || !path[0])
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s: no file given", flag);
  if (access(path, R_OK) != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s %s: cannot read it: %s", flag, path,
                           strerror(errno));
  return EMBPS_OK;
}

embps_status_t embps_tls_load_identity(SSL_CTX *ctx, const char *cert_file, const char *cert_flag,
                                       const char *key_file, const char *key_flag,
                                       embps_error_t *err) {
  embps_status_t ret;
  char why[256];
  if ((ret = check_readable(cert_file, cert_flag, err)) != EMBPS_OK ||
      (ret = check_readable(key_file, key_flag, err)) != EMBPS_OK)
    return ret;
  ERR_clear_error();
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_file) != 1)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s %s: not a PEM certificate chain: %s",
                           cert_flag, cert_file, embps_tls_error(why, sizeof(why)));
  /* Parsed apart from installing it, so that a key that does not parse and a key that does not
   * match the certificate (which SSL_CTX_use_PrivateKey refuses) get their own messages. */
  BIO *bio = BIO_new_file(key_file, "r");
  EVP_PKEY *key = bio ? PEM_read_bio_PrivateKey(bio, NULL, NULL, NULL) : NULL;
  BIO_free(bio);
  if (!key)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%s %s: not a PEM private key (an encrypted key is not supported): %s",
                           key_flag, key_file, embps_tls_error(why, sizeof(why)));
  ret = SSL_CTX_use_PrivateKey(ctx, key) == 1 && SSL_CTX_check_private_key(ctx) == 1
            ? EMBPS_OK
            : embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                              "%s %s does not match the certificate in %s %s: %s", key_flag,
                              key_file, cert_flag, cert_file, embps_tls_error(why, sizeof(why)));
  EVP_PKEY_free(key); /* the context holds its own reference */
  return ret;
}

embps_status_t embps_tls_load_ca(SSL_CTX *ctx, const char *ca_file, const char *ca_flag,
                                 embps_error_t *err) {
  embps_status_t ret;
  char why[256];
  if ((ret = check_readable(ca_file, ca_flag, err)) != EMBPS_OK)
    return ret;
  ERR_clear_error();
  if (SSL_CTX_load_verify_locations(ctx, ca_file, NULL) != 1)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s %s: no PEM CA certificate in it: %s",
                           ca_flag, ca_file, embps_tls_error(why, sizeof(why)));
  return EMBPS_OK;
}
