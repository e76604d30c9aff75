/* Control messages on sockets (control_io.h).
 *
 * Bootstrap works on non-blocking sockets and the group thread on blocking ones, so every
 * transfer here asks the kernel not to block (MSG_DONTWAIT) and waits in poll() with what is
 * left of its deadline instead: one implementation serves both, and no wait outlives its
 * deadline whatever mode the socket is in. The reader keeps what a connection delivered in one
 * buffer and hands out frames in place; it compacts before reading more. */
#include "server/group/control_io.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"

/* The reader's buffer grows in steps that leave at least this much room for one recv. */
#define READ_CHUNK 65536

int embps__remaining_ms(uint64_t deadline) {
  uint64_t now = embps_now_ms();
  if (now >= deadline)
    return 0;
  uint64_t left = deadline - now;
  return left > 1000000000u ? 1000000000 : (int)left;
}

/* Waits until fd is ready for `events` or the deadline passes (EINTR counts as ready: the
 * caller retries its call). */
static embps__io_t wait_ready(int fd, short events, uint64_t deadline) {
  struct pollfd pfd = {.fd = fd, .events = events};
  int left = embps__remaining_ms(deadline);
  if (left == 0)
    return EMBPS__IO_TIMEOUT;
  if (poll(&pfd, 1, left) < 0 && errno != EINTR)
    return EMBPS__IO_ERROR;
  return EMBPS__IO_OK;
}

/* Moves n bytes in the direction `out` says, before the deadline. */
static embps__io_t transfer(int fd, uint8_t *p, size_t n, int out, uint64_t deadline) {
  while (n > 0) {
    ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0 && !out)
      return EMBPS__IO_EOF;
    if (k < 0 && errno == EINTR)
      continue;
    if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
      return EMBPS__IO_ERROR;
    embps__io_t w = wait_ready(fd, out ? POLLOUT : POLLIN, deadline);
    if (w != EMBPS__IO_OK)
      return w;
  }
  return EMBPS__IO_OK;
}

embps__io_t embps__send_all(int fd, const void *buf, size_t n, uint64_t deadline) {
  return transfer(fd, (uint8_t *)(uintptr_t)buf, n, 1, deadline);
}

embps__io_t embps__recv_all(int fd, void *buf, size_t n, uint64_t deadline) {
  return transfer(fd, buf, n, 0, deadline);
}

static embps_status_t io_failed(embps__io_t io, embps_error_t *err) {
  return embps_error_set(err, EMBPS_UNAVAILABLE, "%s",
                         io == EMBPS__IO_TIMEOUT ? "no frame before the deadline"
                         : io == EMBPS__IO_EOF   ? "the connection closed"
                                                 : strerror(errno));
}

embps_status_t embps__frame_recv(int fd, uint64_t deadline, uint8_t *type, embps__buf_t *payload,
                                 embps_error_t *err) {
  uint8_t head[EMBPS__FRAME_HEADER_LEN];
  size_t len;
  embps_status_t ret;
  embps__io_t io = embps__recv_all(fd, head, sizeof(head), deadline);
  if (io != EMBPS__IO_OK)
    return io_failed(io, err);
  if ((ret = embps__frame_header(head, type, &len, err)) != EMBPS_OK)
    return ret;
  payload->len = 0;
  if (payload->cap < len) {
    embps__buf_free(payload);
    if (!(payload->data = embps_malloc(len)))
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte frame",
                             len);
    payload->cap = len;
  }
  if ((io = embps__recv_all(fd, payload->data, len, deadline)) != EMBPS__IO_OK)
    return io_failed(io, err);
  payload->len = len;
  return EMBPS_OK;
}

/* Sends a BROKEN (leaving 0) or LEAVING frame carrying why, in one non-blocking send. */
static void send_sentence(int fd, int leaving, const char *why) {
  uint8_t frame[EMBPS__FRAME_HEADER_LEN + EMBPS__BROKEN_MAX];
  embps__buf_t b = {frame, 0, sizeof(frame)}; /* fits: no allocation happens */
  if ((leaving ? embps__frame_leaving(&b, why, NULL) : embps__frame_broken(&b, why, NULL)) !=
      EMBPS_OK)
    return;
  if (send(fd, b.data, b.len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
    EMBPS_DEBUG("could not tell the peer on fd %d that %s: %s", fd,
                leaving ? "this rank leaves the group" : "the group broke", strerror(errno));
}

void embps__send_broken(int fd, const char *why) { send_sentence(fd, 0, why); }

void embps__send_leaving(int fd, const char *why) { send_sentence(fd, 1, why); }

embps_status_t embps__frame_reader_fill(embps__frame_reader_t *r, int fd, int *closed) {
  embps__buf_t *b = &r->in;
  *closed = 0;
  if (r->off > 0) { /* drop what was consumed */
    memmove(b->data, b->data + r->off, b->len - r->off);
    b->len -= r->off;
    r->off = 0;
  }
  for (;;) {
    if (b->cap - b->len < READ_CHUNK) {
      size_t cap = b->cap ? b->cap * 2 : 2 * READ_CHUNK;
      uint8_t *d = embps_realloc(b->data, cap);
      if (!d)
        return EMBPS_RESOURCE_EXHAUSTED;
      b->data = d;
      b->cap = cap;
    }
    size_t room = b->cap - b->len;
    ssize_t k = recv(fd, b->data + b->len, room, MSG_DONTWAIT);
    if (k > 0) {
      b->len += (size_t)k;
      /* A short read emptied the socket: asking again would only fetch EAGAIN (half the
       * leader's receives at 16 ranks, issue 34); the caller's poll is level-triggered and
       * wakes it for anything that comes later, an end of stream included. */
      if ((size_t)k < room)
        return EMBPS_OK;
      continue;
    }
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return EMBPS_OK;
    *closed = 1;
    return EMBPS_OK;
  }
}

embps_status_t embps__frame_reader_next(embps__frame_reader_t *r, int *have, uint8_t *type,
                                        const uint8_t **payload, size_t *len, embps_error_t *err) {
  size_t frame_len;
  embps_status_t ret;
  *have = 0;
  if (r->off == r->in.len)
    return EMBPS_OK; /* nothing buffered (and maybe no buffer yet) */
  ret = embps__frame_next(r->in.data + r->off, r->in.len - r->off, type, payload, len, &frame_len,
                          err);
  *have = ret == EMBPS_OK && frame_len > 0;
  r->off += *have ? frame_len : 0;
  return ret;
}

void embps__frame_reader_free(embps__frame_reader_t *r) {
  embps__buf_free(&r->in);
  r->off = 0;
}
