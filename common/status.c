/* Status codes and error messages shared by the server and the client.
 *
 * The table lives in status.h as an X-macro so that the enum, its text and its gRPC name can
 * never drift apart. */
#include "status.h"

#include <stdio.h>
#include <string.h>

const char *embps_status_str(embps_status_t status) {
  switch (status) {
#define EMBPS_STATUS_TEXT(name, code, text)                                                        \
  case EMBPS_##name:                                                                               \
    return text;
    EMBPS_STATUS_MAP(EMBPS_STATUS_TEXT)
#undef EMBPS_STATUS_TEXT
  }
  return "unknown status";
}

const char *embps_status_name(embps_status_t status) {
  switch (status) {
#define EMBPS_STATUS_NAME(name, code, text)                                                        \
  case EMBPS_##name:                                                                               \
    return #name;
    EMBPS_STATUS_MAP(EMBPS_STATUS_NAME)
#undef EMBPS_STATUS_NAME
  }
  return "UNKNOWN";
}

int embps_status_grpc_code(embps_status_t status) { return (int)status; }

embps_status_t embps_status_from_grpc(int code) {
  if (code < 0 || code > 16)
    return EMBPS_UNKNOWN;
  return (embps_status_t)code;
}

embps_status_t embps_error_set(embps_error_t *err, embps_status_t status, const char *fmt, ...) {
  if (err) {
    va_list ap;
    err->status = status;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
  }
  return status;
}

void embps_error_clear(embps_error_t *err) {
  if (err) {
    err->status = EMBPS_OK;
    err->message[0] = '\0';
  }
}
