/* What every collective backend shares beyond comm.h's inline checks: the broken state. */
#include "server/comm/comm.h"

#include <stdarg.h>
#include <stdio.h>

#include "common/log.h"

embps_status_t embps__comm_break(embps_comm_t *c, embps_error_t *err, embps_status_t status,
                                 const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->broken_msg, sizeof c->broken_msg, fmt, ap);
  va_end(ap);
  c->broken = status;
  embps_log_write(EMBPS_LOG_ERROR, file, line, "comm %s rank %u/%u: %s", c->ops->name, c->rank,
                  c->size, c->broken_msg);
  return embps_error_set(err, status, "%s", c->broken_msg);
}
