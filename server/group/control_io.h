/* The control protocol on sockets: whole messages sent and received with a deadline, and a
 * reader that collects frames from a connection the group thread polls. The bytes themselves
 * are control.h's. Internal to the group layer (embps__ prefix). Deadlines are absolute times
 * on embps_now_ms()'s clock; UINT64_MAX waits for ever. */
#ifndef EMBPS_GROUP_CONTROL_IO_H
#define EMBPS_GROUP_CONTROL_IO_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/control.h"

/** How a socket transfer ended (errno tells more after EMBPS__IO_ERROR). */
typedef enum embps__io {
  EMBPS__IO_OK = 0,
  EMBPS__IO_ERROR,
  EMBPS__IO_EOF,
  EMBPS__IO_TIMEOUT,
} embps__io_t;

/** Milliseconds left until deadline, clipped to what poll() takes; 0 once it has passed. */
int embps__remaining_ms(uint64_t deadline);

/** Sends all n bytes at buf on fd (blocking or not) before the deadline. */
embps__io_t embps__send_all(int fd, const void *buf, size_t n, uint64_t deadline);

/** Receives exactly n bytes into buf from fd (blocking or not) before the deadline. */
embps__io_t embps__recv_all(int fd, void *buf, size_t n, uint64_t deadline);

/**
 * Receives one control frame from fd before the deadline: *type, and its payload as the whole
 * of *payload (the buffer is reused; the caller frees it). Returns EMBPS_OK,
 * EMBPS_UNAVAILABLE (the connection closed or failed, or the deadline passed: err says which),
 * EMBPS_INVALID_ARGUMENT (a malformed header) or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__frame_recv(int fd, uint64_t deadline, uint8_t *type, embps__buf_t *payload,
                                 embps_error_t *err);

/** Tells the other side of a control connection that the group broke, and why: best effort,
 * one non-blocking send (the peer may be the one that died). */
void embps__send_broken(int fd, const char *why);

/** Tells the other side of a control connection that this rank leaves the group cleanly (it
 * is shutting down), with why naming it: best effort, one non-blocking send. */
void embps__send_leaving(int fd, const char *why);

/** Frames arriving on one non-blocking control connection. Zero-initialised is empty. */
typedef struct embps__frame_reader {
  embps__buf_t in; /* bytes received and not yet consumed start at off */
  size_t off;
} embps__frame_reader_t;

/**
 * Reads what fd has now without blocking, until a read comes back short (so the caller must poll
 * fd, level-triggered, before it waits for more). Sets *closed when the peer closed the
 * connection or it failed (frames received before that are still returned by
 * embps__frame_reader_next). Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__frame_reader_fill(embps__frame_reader_t *r, int fd, int *closed);

/**
 * Takes the next whole frame: returns EMBPS_OK with *have 1 and its type and payload (valid
 * until the next fill), or *have 0 when no whole frame is left; EMBPS_INVALID_ARGUMENT for a
 * malformed header (the connection cannot be read further).
 */
embps_status_t embps__frame_reader_next(embps__frame_reader_t *r, int *have, uint8_t *type,
                                        const uint8_t **payload, size_t *len, embps_error_t *err);

/** Frees the reader's buffer. */
void embps__frame_reader_free(embps__frame_reader_t *r);

#endif
