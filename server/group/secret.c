/* The group secret: loading it, and the proofs of the bootstrap's challenge-response.
 *
 * A peer port reachable by anyone would let any process that copies the public configuration
 * (version and mesh are in GetStats) join the group as a rank and receive shards and gradients.
 * With a secret every connection is authenticated both ways: the acceptor sends a fresh nonce,
 * the connector answers with its own nonce and HMAC-SHA256(secret, label, role, its hello,
 * the acceptor's rank, both nonces), and the acceptor, once satisfied, answers with the same MAC
 * for its own role. Fresh nonces on both sides make every proof good for one connection only,
 * the role keeps one side's proof from passing for the other's, and the hello in the transcript
 * binds the proof to the rank, kind and configuration the connector claimed. Proofs are
 * compared in constant time (CRYPTO_memcmp).
 *
 * The MAC comes from OpenSSL's libcrypto (EVP_MAC, the OpenSSL 3 interface; HMAC_CTX is
 * deprecated there), the nonces from getrandom(), which blocks only until the kernel's pool is
 * first seeded. The connection itself is not encrypted or protected after the check: an
 * attacker on the path could still take it over, which TLS between ranks addresses. */
#include "server/group/secret.h"
#include "server/group/group.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include "common/byteorder.h"

/* Signed before everything else, so these MACs can never be mistaken for another protocol's. */
static const char LABEL[] = "embps group bootstrap v1";

embps_status_t embps_group_secret_load(const char *path, uint8_t *out, size_t cap, size_t *len,
                                       unsigned *loose_mode, embps_error_t *err) {
  uint8_t buf[EMBPS_GROUP_SECRET_MAX + 1];
  embps_status_t ret = EMBPS_OK;
  struct stat st;
  size_t n = 0;
  int fd = -1;

  if (!path || !out || !len || !loose_mode || cap < EMBPS_GROUP_SECRET_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "no group secret file or no room for it");
  if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY)) < 0 || fstat(fd, &st) != 0) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "cannot read the group secret file %s: %s",
                          path, strerror(errno));
    goto fail;
  }
  if (!S_ISREG(st.st_mode)) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                          "the group secret file %s is not a regular file", path);
    goto fail;
  }
  /* One byte more than allowed, to tell "exactly the maximum" from "too long". */
  while (n < sizeof(buf)) {
    ssize_t k = read(fd, buf + n, sizeof(buf) - n);
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0) {
      ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT, "cannot read the group secret file %s: %s",
                            path, strerror(errno));
      goto fail;
    }
    if (k == 0)
      break;
    n += (size_t)k;
  }
  if (n > 0 && buf[n - 1] == '\n')
    n -= n > 1 && buf[n - 2] == '\r' ? 2 : 1;
  if (n == 0 || n < EMBPS_GROUP_SECRET_MIN || n > EMBPS_GROUP_SECRET_MAX) {
    ret = embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                          "the group secret file %s holds %s%zu bytes; a group secret needs %u to "
                          "%u (e.g. head -c 32 /dev/urandom | base64 > %s)",
                          path, n > EMBPS_GROUP_SECRET_MAX ? "more than " : "",
                          n > EMBPS_GROUP_SECRET_MAX ? (size_t)EMBPS_GROUP_SECRET_MAX : n,
                          EMBPS_GROUP_SECRET_MIN, EMBPS_GROUP_SECRET_MAX, path);
    goto fail;
  }
  memcpy(out, buf, n);
  *len = n;
  *loose_mode = (st.st_mode & S_IRWXO) ? (unsigned)(st.st_mode & 07777) : 0;
exit:
  OPENSSL_cleanse(buf, sizeof(buf));
  if (fd >= 0)
    close(fd);
  return ret;
fail:
  goto exit;
}

embps_status_t embps__secret_nonce(uint8_t *out, embps_error_t *err) {
  size_t n = 0;
  while (n < EMBPS__NONCE_LEN) {
    ssize_t k = getrandom(out + n, EMBPS__NONCE_LEN - n, 0);
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0)
      return embps_error_set(err, EMBPS_INTERNAL, "getrandom: %s", strerror(errno));
    n += (size_t)k;
  }
  return EMBPS_OK;
}

embps_status_t embps__secret_proof(const uint8_t *secret, size_t secret_len,
                                   embps__proof_role_t role, const embps__transcript_t *t,
                                   uint8_t *out, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  EVP_MAC *mac = NULL;
  EVP_MAC_CTX *ctx = NULL;
  uint8_t fixed[1 + 4];
  size_t out_len = 0;
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};

  fixed[0] = (uint8_t)role;
  embps_put_le32(fixed + 1, t->acceptor_rank);
  if (!(mac = EVP_MAC_fetch(NULL, "HMAC", NULL)) || !(ctx = EVP_MAC_CTX_new(mac)) ||
      !EVP_MAC_init(ctx, secret, secret_len, params) ||
      !EVP_MAC_update(ctx, (const uint8_t *)LABEL, sizeof(LABEL)) ||
      !EVP_MAC_update(ctx, fixed, sizeof(fixed)) ||
      !EVP_MAC_update(ctx, t->hello_header, EMBPS__HELLO_HEADER_LEN) ||
      !EVP_MAC_update(ctx, (const uint8_t *)t->identity, t->identity_len) ||
      !EVP_MAC_update(ctx, t->acceptor_nonce, EMBPS__NONCE_LEN) ||
      !EVP_MAC_update(ctx, t->connector_nonce, EMBPS__NONCE_LEN) ||
      !EVP_MAC_final(ctx, out, &out_len, EMBPS__PROOF_LEN) || out_len != EMBPS__PROOF_LEN) {
    char why[128];
    ERR_error_string_n(ERR_get_error(), why, sizeof(why));
    ret = embps_error_set(err, EMBPS_INTERNAL, "HMAC-SHA256 failed: %s", why);
  }
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  return ret;
}

int embps__secret_verify(const uint8_t *secret, size_t secret_len, embps__proof_role_t role,
                         const embps__transcript_t *t, const uint8_t *proof) {
  uint8_t want[EMBPS__PROOF_LEN];
  int ok = embps__secret_proof(secret, secret_len, role, t, want, NULL) == EMBPS_OK &&
           CRYPTO_memcmp(want, proof, EMBPS__PROOF_LEN) == 0;
  OPENSSL_cleanse(want, sizeof(want));
  return ok;
}
