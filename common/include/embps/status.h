/* embps status codes and the error struct: the one status enum of the whole project, and part of
 * the client library's public API (installed as <embps/status.h>, included by <embps/embps.h>).
 * Self-contained: an installed user compiles it without the source tree. The project's internal
 * helpers over these types (embps_status_name, embps_error_set, ...) are in common/status.h. */
#ifndef EMBPS_PUBLIC_STATUS_H
#define EMBPS_PUBLIC_STATUS_H

/** X(name, grpc_code, text): the single declaration of every status. The numeric value of each
 * status is its gRPC code (the edge mapping is the identity); text is a short lower-case
 * description. A user may expand it to build its own tables. */
#define EMBPS_STATUS_MAP(X)                                                                        \
  X(OK, 0, "ok")                                                                                   \
  X(CANCELLED, 1, "cancelled")                                                                     \
  X(UNKNOWN, 2, "unknown error")                                                                   \
  X(INVALID_ARGUMENT, 3, "invalid argument")                                                       \
  X(DEADLINE_EXCEEDED, 4, "deadline exceeded")                                                     \
  X(NOT_FOUND, 5, "not found")                                                                     \
  X(ALREADY_EXISTS, 6, "already exists")                                                           \
  X(PERMISSION_DENIED, 7, "permission denied")                                                     \
  X(RESOURCE_EXHAUSTED, 8, "resource exhausted")                                                   \
  X(FAILED_PRECONDITION, 9, "failed precondition")                                                 \
  X(ABORTED, 10, "aborted")                                                                        \
  X(OUT_OF_RANGE, 11, "out of range")                                                              \
  X(UNIMPLEMENTED, 12, "unimplemented")                                                            \
  X(INTERNAL, 13, "internal error")                                                                \
  X(UNAVAILABLE, 14, "unavailable")                                                                \
  X(DATA_LOSS, 15, "data loss")                                                                    \
  X(UNAUTHENTICATED, 16, "unauthenticated")

/** A status: EMBPS_OK, EMBPS_INVALID_ARGUMENT, ... with the values of the gRPC status codes. */
typedef enum embps_status {
#define EMBPS_STATUS_ENUM(name, code, text) EMBPS_##name = code,
  EMBPS_STATUS_MAP(EMBPS_STATUS_ENUM)
#undef EMBPS_STATUS_ENUM
} embps_status_t;

/** A status with its message, as a failing call reports it (embps_client_connect's err). The
 * caller owns it; message is always NUL-terminated. */
typedef struct embps_error {
  embps_status_t status;
  char message[512];
} embps_error_t;

#endif
