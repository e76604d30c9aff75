/* embps status codes: one enum for the whole project, mapped one-to-one onto gRPC codes. The
 * enum (the EMBPS_STATUS_MAP X-macro) and embps_error_t are public API, declared once in
 * include/embps/status.h, which the installed <embps/embps.h> includes; this header adds the
 * project's internal functions over them. The edge mapping is the identity but still goes
 * through embps_status_grpc_code() to keep the two vocabularies distinct in the code. */
#ifndef EMBPS_STATUS_H
#define EMBPS_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#include "embps/status.h"

/** The status's short text ("invalid argument"); "unknown status" for values outside the map. */
const char *embps_status_str(embps_status_t status);

/** The status's name as gRPC spells it ("INVALID_ARGUMENT"). */
const char *embps_status_name(embps_status_t status);

/** The gRPC status code for a status. */
int embps_status_grpc_code(embps_status_t status);

/** The status for a gRPC status code; codes outside 0..16 give EMBPS_UNKNOWN. */
embps_status_t embps_status_from_grpc(int code);

/** Sets err (when not NULL) to status and a printf-formatted message; returns status. */
embps_status_t embps_error_set(embps_error_t *err, embps_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** Clears err to EMBPS_OK with an empty message. */
void embps_error_clear(embps_error_t *err);

#endif
