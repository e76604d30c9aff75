/* embps status codes: one enum for the whole project, mapped one-to-one onto gRPC codes. */
#ifndef EMBPS_STATUS_H
#define EMBPS_STATUS_H

#include <stdarg.h>
#include <stddef.h>

/* X(name, grpc_code, text): the single declaration of every status. The numeric value of each
 * status is its gRPC code, so the edge mapping is the identity but still goes through
 * embps_status_grpc_code() to keep the two vocabularies distinct in the code. */
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

typedef enum embps_status {
#define EMBPS_STATUS_ENUM(name, code, text) EMBPS_##name = code,
  EMBPS_STATUS_MAP(EMBPS_STATUS_ENUM)
#undef EMBPS_STATUS_ENUM
} embps_status_t;

/** The status's short text ("invalid argument"); "unknown status" for values outside the map. */
const char *embps_status_str(embps_status_t status);

/** The status's name as gRPC spells it ("INVALID_ARGUMENT"). */
const char *embps_status_name(embps_status_t status);

/** The gRPC status code for a status. */
int embps_status_grpc_code(embps_status_t status);

/** The status for a gRPC status code; codes outside 0..16 give EMBPS_UNKNOWN. */
embps_status_t embps_status_from_grpc(int code);

/** A status with its message, as a failing call reports it. */
typedef struct embps_error {
  embps_status_t status;
  char message[512];
} embps_error_t;

/** Sets err (when not NULL) to status and a printf-formatted message; returns status. */
embps_status_t embps_error_set(embps_error_t *err, embps_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** Clears err to EMBPS_OK with an empty message. */
void embps_error_clear(embps_error_t *err);

#endif
