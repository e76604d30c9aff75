/* The dispatcher of the collectives and what every backend shares: the broken state.
 *
 * embps_comm_all_gather and the other collectives are the only way in: each refuses a call that
 * every backend would refuse (the communicator broken by an earlier failure, missing buffers,
 * sizes that overflow over the group, overlapping buffers, an unknown element type or reduction,
 * a misaligned reduction buffer) with the same words whatever the backend, counts the call and
 * its payload in c->stats, and hands the rest to the backend's ops, which only move bytes. Usable
 * is checked before the arguments, so a call after a failure reports that failure, not an
 * argument it would have refused anyway. A refused call moves nothing, counts nothing and leaves
 * the communicator usable: peers making the same call refuse it too, since the checks depend only
 * on what every rank passes alike (sizes, type, reduction) or on its own buffers. */
#include "server/comm/comm.h"

#include <stdarg.h>
#include <stdio.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/hist.h"

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

/* ---- the checks ---- */

/* EMBPS_OK, or the failure that broke c. */
static embps_status_t check_usable(const embps_comm_t *c, const char *what, embps_error_t *err) {
  if (!c)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "%s: no communicator", what);
  if (c->broken == EMBPS_OK)
    return EMBPS_OK;
  return embps_error_set(err, c->broken, "communicator unusable after an earlier failure: %s",
                         c->broken_msg);
}

/* Whether [a, a+alen) and [b, b+blen) share a byte. */
static int overlaps(const void *a, size_t alen, const void *b, size_t blen) {
  uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
  return alen && blen && pa < pb + blen && pb < pa + alen;
}

/* A receive size that does not overflow, buffers for bytes > 0, and send either apart from recv
 * or exactly in place at recv + rank*bytes. */
static embps_status_t check_all_gather(const embps_comm_t *c, const void *send, size_t bytes,
                                       const void *recv, embps_error_t *err) {
  const uint8_t *own;
  if (bytes > SIZE_MAX / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather of %zu bytes per rank overflows the receive size", bytes);
  if (bytes > 0 && (!send || !recv))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather of %zu bytes needs send and recv buffers", bytes);
  own = bytes ? (const uint8_t *)recv + (size_t)c->rank * bytes : NULL;
  if ((const uint8_t *)send != own && overlaps(send, bytes, recv, bytes * c->size))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_gather send buffer overlaps recv other than in place at "
                           "recv + rank*bytes");
  return EMBPS_OK;
}

/* A buffer size that does not overflow, buffers for bytes > 0, and send apart from recv. */
static embps_status_t check_all_to_all(const embps_comm_t *c, const void *send, size_t bytes,
                                       const void *recv, embps_error_t *err) {
  if (bytes > SIZE_MAX / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all of %zu bytes per rank pair overflows the buffer size",
                           bytes);
  if (bytes > 0 && (!send || !recv))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all of %zu bytes needs send and recv buffers", bytes);
  if (overlaps(send, bytes * c->size, recv, bytes * c->size))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_to_all send and recv buffers overlap (in place is not supported)");
  return EMBPS_OK;
}

/* A known type and reduction, a size that does not overflow over the group, a buffer for
 * count > 0, aligned to its elements: every backend's reduction loads whole elements (the NCCL
 * backend's on the device; the TCP backend's through typed pointers, which C requires to be
 * aligned). */
static embps_status_t check_all_reduce(const embps_comm_t *c, const void *buf, size_t count,
                                       embps_comm_type_t type, embps_comm_op_t op,
                                       embps_error_t *err) {
  size_t elem = embps_comm_type_size(type);
  if (elem == 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce: unknown element type %d",
                           (int)type);
  if (op != EMBPS_COMM_SUM && op != EMBPS_COMM_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce: unknown reduction %d",
                           (int)op);
  if (count > SIZE_MAX / elem / c->size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_reduce of %zu elements overflows the buffer size", count);
  if (count > 0 && !buf)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "all_reduce of %zu elements needs a buffer",
                           count);
  if ((uintptr_t)buf % elem != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "all_reduce buffer %p is not aligned to its %zu-byte elements", buf,
                           elem);
  return EMBPS_OK;
}

/* ---- dispatch ---- */

/* Counts a call that passed the checks and that the backend finished with ret (backends never
 * read the stats, so counting it after the call is counting it as it starts), and the payload
 * that crossed each way per peer when it succeeded. */
/* Counts a call that started at start_ns (embps_now_ns) and returned ret. */
static embps_status_t counted(embps_comm_t *c, uint64_t start_ns, embps_status_t ret,
                              size_t payload) {
  uint64_t ns = embps_now_ns() - start_ns;
  c->stats.calls++;
  c->stats.ns += ns;
  if (c->call_seconds)
    embps_hist_observe_ns(c->call_seconds, ns);
  if (ret == EMBPS_OK) {
    uint64_t moved = (uint64_t)(c->size - 1) * payload;
    c->stats.bytes_sent += moved;
    c->stats.bytes_received += moved;
  }
  return ret;
}

embps_status_t embps_comm_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  embps_status_t ret = check_usable(c, "all_gather", err);
  uint64_t t0 = embps_now_ns();
  if (ret == EMBPS_OK && (ret = check_all_gather(c, send, bytes, recv, err)) == EMBPS_OK)
    ret = counted(c, t0, c->ops->all_gather(c, send, bytes, recv, err), bytes);
  return ret;
}

embps_status_t embps_comm_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                     embps_error_t *err) {
  embps_status_t ret = check_usable(c, "all_to_all", err);
  uint64_t t0 = embps_now_ns();
  if (ret == EMBPS_OK && (ret = check_all_to_all(c, send, bytes, recv, err)) == EMBPS_OK)
    ret = counted(c, t0, c->ops->all_to_all(c, send, bytes, recv, err), bytes);
  return ret;
}

embps_status_t embps_comm_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                     embps_comm_type_t type, embps_comm_op_t op,
                                     embps_error_t *err) {
  embps_status_t ret = check_usable(c, "all_reduce", err);
  uint64_t t0 = embps_now_ns();
  if (ret == EMBPS_OK && (ret = check_all_reduce(c, buf, count, type, op, err)) == EMBPS_OK)
    ret = counted(c, t0, c->ops->all_reduce(c, buf, count, type, op, err),
                  count * embps_comm_type_size(type));
  return ret;
}

embps_status_t embps_comm_barrier(embps_comm_t *c, embps_error_t *err) {
  embps_status_t ret = check_usable(c, "barrier", err);
  uint64_t t0 = embps_now_ns();
  if (ret == EMBPS_OK)
    ret = counted(c, t0, c->ops->barrier(c, err), 0);
  return ret;
}

void embps_comm_free(embps_comm_t *c) {
  if (c)
    c->ops->destroy(c);
}

void embps_comm_set_call_histogram(embps_comm_t *c, embps_hist_t *h) { c->call_seconds = h; }
