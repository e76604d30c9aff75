/* The group secret's cryptography: the nonces and proofs of the challenge-response with which
 * ranks prove at bootstrap that they belong to the group (control.h has the bytes, bootstrap.c
 * the exchange). Internal to the group layer (embps__ prefix); loading the secret from its file
 * is public (group.h, embps_group_secret_load). */
#ifndef EMBPS_GROUP_SECRET_H
#define EMBPS_GROUP_SECRET_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/control.h"

/** Who computes a proof: the rank that connected (and sent the hello) or the one that
 * accepted. The role is part of what is signed, so one side's proof never passes for the
 * other's. */
typedef enum embps__proof_role {
  EMBPS__PROOF_CONNECTOR = 0,
  EMBPS__PROOF_ACCEPTOR = 1,
} embps__proof_role_t;

/** What a proof signs besides the role: the connector's whole hello as sent (its header, whose
 * kind, rank and size it covers, and its identity), the acceptor's rank and both nonces. All
 * pointers are borrowed. */
typedef struct embps__transcript {
  const uint8_t *hello_header; /* EMBPS__HELLO_HEADER_LEN bytes */
  const char *identity;        /* identity_len bytes */
  size_t identity_len;
  uint32_t acceptor_rank;
  const uint8_t *acceptor_nonce;  /* EMBPS__NONCE_LEN bytes */
  const uint8_t *connector_nonce; /* EMBPS__NONCE_LEN bytes */
} embps__transcript_t;

/** Fills out (EMBPS__NONCE_LEN bytes) from the kernel's random source (getrandom). Returns
 * EMBPS_OK or EMBPS_INTERNAL (err says why). */
embps_status_t embps__secret_nonce(uint8_t *out, embps_error_t *err);

/** Writes to out (EMBPS__PROOF_LEN bytes) HMAC-SHA256 keyed with secret (secret_len bytes,
 * borrowed) over a domain label, the role and the transcript t. Returns EMBPS_OK or
 * EMBPS_INTERNAL when the library fails (err says why). */
embps_status_t embps__secret_proof(const uint8_t *secret, size_t secret_len,
                                   embps__proof_role_t role, const embps__transcript_t *t,
                                   uint8_t *out, embps_error_t *err);

/** 1 when proof (EMBPS__PROOF_LEN bytes, received) is the one that role should have sent for
 * t, else 0 (also when it cannot be computed). Compares in constant time. */
int embps__secret_verify(const uint8_t *secret, size_t secret_len, embps__proof_role_t role,
                         const embps__transcript_t *t, const uint8_t *proof);

#endif
