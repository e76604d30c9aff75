/* Client authentication: bearer tokens with roles, read from --auth-tokens-file, and the check
 * of a call's token against the least role its method needs, which the service's method table
 * gives (service.c); the service checks every call in one place before dispatching it. Roles
 * nest: admin > worker > reader. */
#ifndef EMBPS_SERVICE_AUTH_H
#define EMBPS_SERVICE_AUTH_H

#include <stddef.h>

#include "common/status.h"

/** The roles, in increasing power; EMBPS_AUTH_OPEN marks a method that needs no token. Which
 * methods each reaches is the service's method table (service.c). */
typedef enum embps_auth_role {
  EMBPS_AUTH_OPEN = 0,
  EMBPS_AUTH_READER = 1, /* reads: lookups, listings, stats */
  EMBPS_AUTH_WORKER = 2, /* and pushes */
  EMBPS_AUTH_ADMIN = 3,  /* and what creates, drops or checkpoints tables */
} embps_auth_role_t;

/** Tokens are RFC 6750 b64token strings of this many bytes. */
#define EMBPS_AUTH_TOKEN_MIN 16
#define EMBPS_AUTH_TOKEN_MAX 512
/** Most tokens one file may hold. */
#define EMBPS_AUTH_MAX_TOKENS 4096

/** A set of tokens with their roles. Immutable once built; owned by whoever built it. */
typedef struct embps_auth embps_auth_t;

/**
 * Parses a tokens file's text: one "ROLE TOKEN" per line (ROLE admin, worker or reader; TOKEN
 * 16 to 512 characters of A-Z a-z 0-9 - . _ ~ + / followed by any '='), blank lines and lines
 * starting with '#' ignored, and an optional "# comment" after the token. text[0..len) is
 * borrowed; origin names it in messages (the path). No message ever contains a token.
 * On success *out is a new set freed with embps_auth_free; on failure *out is untouched.
 * Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT (err names the line: a bad role, a bad token, the
 * same token twice, no tokens at all) or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_auth_parse(embps_auth_t **out, const char *text, size_t len,
                                const char *origin, embps_error_t *err);

/**
 * Reads and parses the tokens file at path (at most 1 MiB). On failure *out is untouched.
 * Returns what embps_auth_parse does, or EMBPS_INVALID_ARGUMENT when the file cannot be read.
 */
embps_status_t embps_auth_load(embps_auth_t **out, const char *path, embps_error_t *err);

/** Frees a set (its tokens are wiped first). NULL is a no-op. */
void embps_auth_free(embps_auth_t *auth);

/** How many tokens of exactly this role the set holds. */
size_t embps_auth_count(const embps_auth_t *auth, embps_auth_role_t role);

/** "admin", "worker", "reader" or "open". Static string. */
const char *embps_auth_role_name(embps_auth_role_t role);

/**
 * Decides whether a call to the gRPC method at path ("/embps.v1.EmbeddingService/Lookup"), which
 * needs role `need` (EMBPS_AUTH_OPEN: no token), may run with this authorization header value
 * (NULL: none). auth NULL (no --auth-tokens-file) allows everything. path only names the method
 * in messages. The token is compared with every known token in time that does not depend on
 * their contents.
 * Returns EMBPS_OK; EMBPS_UNAUTHENTICATED (no header, not "Bearer TOKEN", an unknown token) or
 * EMBPS_PERMISSION_DENIED (a known token whose role is below the method's), err saying which.
 */
embps_status_t embps_auth_check(const embps_auth_t *auth, embps_auth_role_t need, const char *path,
                                const char *authorization, embps_error_t *err);

#endif
