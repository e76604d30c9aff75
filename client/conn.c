/* The client transport: gRPC unary calls on nghttp2 client sessions over non-blocking TCP.
 *
 * Each connection is an nghttp2 client session fed with nghttp2_session_mem_recv() and drained
 * with nghttp2_session_mem_send(); sockets are driven by poll() in whichever thread waits for
 * a call, so the library owns no threads and a client is single-threaded by contract.
 *
 * Throughput choices, for 2 MiB lookup replies on loopback:
 *  - The session advertises SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1 and enlarges the connection
 *    window to match, so flow control never stalls a reply (with the 64 KiB default a 2 MiB
 *    reply needs ~32 WINDOW_UPDATE round trips), and SETTINGS_MAX_FRAME_SIZE = 2^24-1 so the
 *    server may send a reply in few DATA frames.
 *  - Reads go into a 1 MiB buffer; DATA payloads are handed to the stream's sink (the
 *    LookupResponse parser copies rows into the caller's buffer), so a row is copied once
 *    after the kernel's copy.
 *  - Request bodies are sent from the caller's arrays by a data source read callback that
 *    copies into nghttp2's frame buffer (one copy); a read-length callback lets one DATA frame
 *    carry up to 1 MiB when the server's SETTINGS_MAX_FRAME_SIZE allows it.
 *  - Small frames (HEADERS, a lookup's 32 KiB of tokens, WINDOW_UPDATE) are gathered into one
 *    write buffer and sent with one send(); large frames go to the socket directly.
 *  - TCP_NODELAY: a request is a burst of frames that must not wait for Nagle.
 *
 * Order: requests are submitted in call order, so their HEADERS leave in order; a request's
 * body is deferred (NGHTTP2_ERR_DEFERRED) until the bodies of all earlier requests on the
 * connection are sent, so complete requests also arrive in call order, which DESIGN.md's
 * per-connection ordering relies on.
 *
 * Failure: a socket error, EOF or HTTP/2 protocol error breaks the connection; every stream
 * on it finishes with UNAVAILABLE and a message naming the server, and the next call on it
 * reconnects. Streams abandoned by their owner (deadline, cancel) are reset and stay owned by
 * the connection until nghttp2 closes them, because nghttp2 may still call back for them. */
#include "client/conn.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/clock.h"

#define RBUF_SIZE (1u << 20)
#define WBUF_FLUSH (256u << 10)  /* send the gathered small frames once this much is pending */
#define DIRECT_WRITE (64u << 10) /* frames at least this big skip the write buffer */
#define MAX_DATA_FRAME (1u << 20)
#define LOCAL_WINDOW ((int32_t)0x7fffffff)
#define LOCAL_MAX_FRAME (16777215u)

struct embps__conn {
  embps__addr_t addr;
  int fd;
  nghttp2_session *session;
  int broken;
  embps_error_t why; /* why it broke (status and message), set inside callbacks and acted on
                        after them */
  uint8_t *rbuf;
  uint8_t *wbuf;
  size_t wlen, woff, wcap;
  embps__stream_t *streams;   /* attached streams */
  embps__stream_t *send_head; /* bodies not yet fully sent, in submission order */
  embps__stream_t *send_tail;
  int resume_head; /* the new send_head was deferred: resume it */
};

/* ---- streams ---- */

static void stream_finish(embps__stream_t *s, embps_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void stream_finish(embps__stream_t *s, embps_status_t st, const char *fmt, ...) {
  va_list ap;
  if (s->done)
    return;
  s->done = 1;
  s->result.status = st;
  va_start(ap, fmt);
  vsnprintf(s->result.message, sizeof(s->result.message), fmt, ap);
  va_end(ap);
  if (s->on_done)
    s->on_done(s);
}

static void stream_free(embps__stream_t *s) {
  embps_free(s->buf);
  embps_free(s);
}

/* Removes s from the send queue (it is done sending or gone). */
static void send_queue_remove(embps__conn_t *c, embps__stream_t *s) {
  embps__stream_t **pp = &c->send_head, *prev = NULL;
  while (*pp && *pp != s) {
    prev = *pp;
    pp = &(*pp)->send_next;
  }
  if (!*pp)
    return;
  *pp = s->send_next;
  if (c->send_tail == s)
    c->send_tail = prev;
  s->send_next = NULL;
  if (c->send_head && c->send_head->deferred)
    c->resume_head = 1;
}

/* The HTTP/2 stream no longer refers to s. */
static void stream_detach(embps__conn_t *c, embps__stream_t *s) {
  if (!s->attached)
    return;
  send_queue_remove(c, s);
  if (s->prev)
    s->prev->next = s->next;
  else
    c->streams = s->next;
  if (s->next)
    s->next->prev = s->prev;
  s->next = s->prev = NULL;
  s->attached = 0;
  if (c->session && s->id > 0)
    nghttp2_session_set_stream_user_data(c->session, s->id, NULL);
  if (s->released)
    stream_free(s);
}

static embps__stream_t *stream_of(nghttp2_session *session, int32_t id) {
  return nghttp2_session_get_stream_user_data(session, id);
}

void embps__stream_cancel(embps__stream_t *s, embps_status_t status, const char *message) {
  stream_finish(s, status, "%s", message);
  if (s->attached && s->conn->session && s->id > 0)
    nghttp2_submit_rst_stream(s->conn->session, NGHTTP2_FLAG_NONE, s->id, NGHTTP2_CANCEL);
}

void embps__stream_release(embps__stream_t *s) {
  if (!s)
    return;
  if (!s->attached) {
    stream_free(s);
    return;
  }
  /* Still open: nghttp2 may call back for it; the connection frees it on close. */
  s->released = 1;
  s->on_done = NULL;
  embps__stream_cancel(s, EMBPS_CANCELLED, "call cancelled");
}

/* ---- breaking and closing ---- */

/* An nghttp2 failure as a status: running out of memory is RESOURCE_EXHAUSTED, anything else
 * (a protocol error, a callback that failed) makes the server unavailable over this
 * connection. */
static embps_status_t status_of_nghttp2(int rv) {
  return rv == NGHTTP2_ERR_NOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE;
}

static void conn_close_socket(embps__conn_t *c) {
  if (c->session) {
    nghttp2_session_del(c->session);
    c->session = NULL;
  }
  if (c->fd >= 0) {
    close(c->fd);
    c->fd = -1;
  }
  c->wlen = c->woff = 0;
  c->resume_head = 0;
}

/* Fails every stream with the connection's reason (UNAVAILABLE unless conn_fail said
 * otherwise), then closes the socket. */
static void conn_break(embps__conn_t *c) {
  embps__stream_t *s;
  embps_status_t status = c->why.status != EMBPS_OK ? c->why.status : EMBPS_UNAVAILABLE;
  c->broken = 1;
  if (c->why.message[0] == '\0')
    snprintf(c->why.message, sizeof(c->why.message), "connection lost");
  while ((s = c->streams) != NULL) {
    int released = s->released;
    stream_detach(c, s); /* frees s if it was released: then do not touch it */
    if (!released)
      stream_finish(s, status, "connection to %s lost: %s", c->addr.authority, c->why.message);
  }
  c->send_head = c->send_tail = NULL;
  conn_close_socket(c);
}

/* Records why c breaks (first reason wins): the status its streams fail with and the message;
 * the break happens outside nghttp2 callbacks. */
static void conn_fail(embps__conn_t *c, embps_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void conn_fail(embps__conn_t *c, embps_status_t status, const char *fmt, ...) {
  va_list ap;
  if (c->broken)
    return;
  c->broken = 1;
  c->why.status = status;
  va_start(ap, fmt);
  vsnprintf(c->why.message, sizeof(c->why.message), fmt, ap);
  va_end(ap);
}

void embps__conn_free(embps__conn_t *c) {
  if (!c)
    return;
  snprintf(c->why.message, sizeof(c->why.message), "client closed");
  /* conn_break finishes the owner's streams; owners must not wait on them afterwards. */
  {
    embps__stream_t *s;
    while ((s = c->streams) != NULL) {
      int released = s->released;
      stream_detach(c, s);
      if (!released)
        stream_finish(s, EMBPS_CANCELLED, "client closed");
    }
  }
  conn_close_socket(c);
  embps_free(c->rbuf);
  embps_free(c->wbuf);
  embps_free(c);
}

const embps__addr_t *embps__conn_addr(const embps__conn_t *c) { return &c->addr; }

/* ---- nghttp2 callbacks ---- */

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                     void *user_data) {
  embps__stream_t *s;
  (void)flags;
  (void)user_data;
  if (frame->hd.type != NGHTTP2_HEADERS)
    return 0;
  s = stream_of(session, frame->hd.stream_id);
  if (!s)
    return 0;
  if (namelen == 7 && memcmp(name, ":status", 7) == 0) {
    int v = 0;
    for (size_t i = 0; i < valuelen && i < 4; i++)
      v = v * 10 + (value[i] - '0');
    s->http_status = v;
  } else if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0) {
    int v = 0;
    if (valuelen == 0 || valuelen > 3)
      v = 2; /* UNKNOWN */
    for (size_t i = 0; i < valuelen && i < 3; i++)
      v = (value[i] >= '0' && value[i] <= '9') ? v * 10 + (value[i] - '0') : 2;
    s->grpc_status = v;
  } else if (namelen == 12 && memcmp(name, "grpc-message", 12) == 0) {
    size_t n = valuelen < sizeof(s->grpc_message) - 1 ? valuelen : sizeof(s->grpc_message) - 1;
    embps__percent_decode(s->grpc_message, (const char *)value, n);
  }
  return 0;
}

static embps_status_t buffer_sink(embps__stream_t *s, const uint8_t *p, size_t n,
                                  embps_error_t *err) {
  if (s->buf_len + n > s->buf_cap) {
    size_t cap = s->buf_cap ? s->buf_cap : 256;
    uint8_t *b;
    while (cap < s->buf_len + n)
      cap *= 2;
    b = embps_realloc(s->buf, cap);
    if (!b)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a reply");
    s->buf = b;
    s->buf_cap = cap;
  }
  memcpy(s->buf + s->buf_len, p, n);
  s->buf_len += n;
  return EMBPS_OK;
}

static embps_status_t stream_body_sink(void *arg, const uint8_t *p, size_t n, embps_error_t *err) {
  embps__stream_t *s = arg;
  if (s->sink)
    return s->sink(s->sink_arg, p, n, err);
  return buffer_sink(s, p, n, err);
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                         const uint8_t *data, size_t len, void *user_data) {
  embps__stream_t *s = stream_of(session, stream_id);
  embps_error_t err;
  (void)flags;
  (void)user_data;
  if (!s || s->done)
    return 0;
  embps_error_clear(&err);
  if (embps__deframer_feed(&s->deframer, data, len, stream_body_sink, s, &err) != EMBPS_OK)
    embps__stream_cancel(s, err.status, err.message);
  return 0;
}

static embps_status_t rst_status(uint32_t code) {
  switch (code) {
  case NGHTTP2_REFUSED_STREAM:
    return EMBPS_UNAVAILABLE;
  case NGHTTP2_CANCEL:
    return EMBPS_CANCELLED;
  case NGHTTP2_ENHANCE_YOUR_CALM:
    return EMBPS_RESOURCE_EXHAUSTED;
  case NGHTTP2_INADEQUATE_SECURITY:
    return EMBPS_PERMISSION_DENIED;
  default:
    return EMBPS_INTERNAL;
  }
}

/* The stream closed: settle its result from what arrived. */
static void settle(embps__conn_t *c, embps__stream_t *s, uint32_t error_code) {
  embps_error_t err;
  if (s->done)
    return;
  embps_error_clear(&err);
  if (s->grpc_status >= 0) {
    embps_status_t st = embps_status_from_grpc(s->grpc_status);
    if (st != EMBPS_OK) {
      stream_finish(s, st, "%s", s->grpc_message[0] ? s->grpc_message : embps_status_str(st));
      return;
    }
    if (embps__deframer_finish(&s->deframer, &err) != EMBPS_OK ||
        (s->sink_finish && s->sink_finish(s->sink_arg, &err) != EMBPS_OK)) {
      stream_finish(s, err.status, "%s", err.message);
      return;
    }
    stream_finish(s, EMBPS_OK, "%s", "");
    return;
  }
  if (s->http_status != 0 && s->http_status != 200) {
    stream_finish(s, embps__http_to_status(s->http_status),
                  "server %s answered HTTP status %d, not a gRPC reply", c->addr.authority,
                  s->http_status);
    return;
  }
  if (error_code != NGHTTP2_NO_ERROR) {
    stream_finish(s, rst_status(error_code), "stream reset by %s: %s", c->addr.authority,
                  nghttp2_http2_strerror(error_code));
    return;
  }
  stream_finish(s, EMBPS_INTERNAL, "reply from %s ended without grpc-status", c->addr.authority);
}

static int on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code,
                           void *user_data) {
  embps__conn_t *c = user_data;
  embps__stream_t *s = stream_of(session, stream_id);
  if (!s)
    return 0;
  settle(c, s, error_code);
  stream_detach(c, s);
  return 0;
}

static int on_frame_not_send(nghttp2_session *session, const nghttp2_frame *frame,
                             int lib_error_code, void *user_data) {
  embps__stream_t *s;
  (void)user_data;
  if (frame->hd.type != NGHTTP2_HEADERS)
    return 0;
  s = stream_of(session, frame->hd.stream_id);
  if (s)
    stream_finish(s, EMBPS_UNAVAILABLE, "request to %s not sent: %s", s->conn->addr.authority,
                  nghttp2_strerror(lib_error_code));
  return 0;
}

static ssize_t read_length(nghttp2_session *session, uint8_t frame_type, int32_t stream_id,
                           int32_t session_window, int32_t stream_window, uint32_t max_frame,
                           void *user_data) {
  ssize_t n = MAX_DATA_FRAME;
  (void)session;
  (void)frame_type;
  (void)stream_id;
  (void)user_data;
  if (session_window < n)
    n = session_window;
  if (stream_window < n)
    n = stream_window;
  if ((ssize_t)max_frame < n)
    n = (ssize_t)max_frame;
  return n > 0 ? n : 1;
}

static ssize_t read_body(nghttp2_session *session, int32_t stream_id, uint8_t *buf, size_t length,
                         uint32_t *data_flags, nghttp2_data_source *source, void *user_data) {
  embps__conn_t *c = user_data;
  embps__stream_t *s = source->ptr;
  size_t out = 0;
  (void)session;
  (void)stream_id;
  if (s->released || s->done)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets the stream */
  if (c->send_head != s) {
    s->deferred = 1;
    return NGHTTP2_ERR_DEFERRED;
  }
  s->deferred = 0;
  while (out < length && s->seg_i < s->nsegs) {
    const embps__seg_t *g = &s->segs[s->seg_i];
    uint64_t left = g->len - s->seg_off;
    size_t k = left < length - out ? (size_t)left : length - out;
    if (g->p)
      memcpy(buf + out, g->p + s->seg_off, k);
    else
      memset(buf + out, 0, k);
    out += k;
    s->seg_off += k;
    if (s->seg_off == g->len) {
      s->seg_i++;
      s->seg_off = 0;
    }
  }
  if (s->seg_i == s->nsegs) {
    *data_flags |= NGHTTP2_DATA_FLAG_EOF;
    s->body_sent = 1;
    send_queue_remove(c, s);
  }
  return (ssize_t)out;
}

/* ---- socket I/O ---- */

/* Sends the write buffer; returns 0 when all is sent, 1 when the socket is full, -1 broken. */
static int write_pending(embps__conn_t *c) {
  while (c->woff < c->wlen) {
    ssize_t n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 1;
      conn_fail(c, EMBPS_UNAVAILABLE, "send: %s", strerror(errno));
      return -1;
    }
    c->woff += (size_t)n;
  }
  c->woff = c->wlen = 0;
  return 0;
}

static int wbuf_append(embps__conn_t *c, const uint8_t *p, size_t n) {
  if (c->wlen + n > c->wcap) {
    size_t cap = c->wcap ? c->wcap : 64u << 10;
    uint8_t *b;
    while (cap < c->wlen + n)
      cap *= 2;
    b = embps_realloc(c->wbuf, cap);
    if (!b) {
      conn_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      return -1;
    }
    c->wbuf = b;
    c->wcap = cap;
  }
  memcpy(c->wbuf + c->wlen, p, n);
  c->wlen += n;
  return 0;
}

/* Serializes and sends what nghttp2 has, until done or the socket is full. */
static void conn_flush(embps__conn_t *c) {
  for (;;) {
    int sent_any = 0;
    if (c->broken || !c->session)
      return;
    if (c->wlen > 0 && write_pending(c) != 0)
      return; /* full (POLLOUT resumes) or broken */
    if (c->resume_head && c->send_head && c->send_head->deferred && c->send_head->id > 0)
      nghttp2_session_resume_data(c->session, c->send_head->id);
    c->resume_head = 0;
    for (;;) {
      const uint8_t *data;
      ssize_t n = nghttp2_session_mem_send(c->session, &data);
      if (n < 0) {
        conn_fail(c, status_of_nghttp2((int)n), "HTTP/2: %s", nghttp2_strerror((int)n));
        return;
      }
      if (n == 0)
        break;
      sent_any = 1;
      if ((size_t)n >= DIRECT_WRITE && c->wlen == 0) {
        ssize_t k = send(c->fd, data, (size_t)n, MSG_NOSIGNAL);
        if (k < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            conn_fail(c, EMBPS_UNAVAILABLE, "send: %s", strerror(errno));
            return;
          }
          k = 0;
        }
        if (k < n) {
          wbuf_append(c, data + k, (size_t)(n - k)); /* the socket is full: rest waits */
          return;
        }
        continue;
      }
      if (wbuf_append(c, data, (size_t)n) != 0)
        return;
      if (c->wlen >= WBUF_FLUSH)
        break;
    }
    if (c->wlen > 0 && write_pending(c) != 0)
      return;
    if (!sent_any && !(c->resume_head && c->send_head))
      return;
  }
}

void embps__conn_kick(embps__conn_t *c) {
  conn_flush(c);
  if (c->broken && c->session)
    conn_break(c);
}

/* Reads what the socket has and hands it to nghttp2. */
static void conn_read(embps__conn_t *c) {
  for (int rounds = 0; rounds < 16 && !c->broken; rounds++) {
    ssize_t n = recv(c->fd, c->rbuf, RBUF_SIZE, 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        conn_fail(c, EMBPS_UNAVAILABLE, "recv: %s", strerror(errno));
      return;
    }
    if (n == 0) {
      conn_fail(c, EMBPS_UNAVAILABLE, "server closed the connection");
      return;
    }
    ssize_t k = nghttp2_session_mem_recv(c->session, c->rbuf, (size_t)n);
    if (k < 0) {
      conn_fail(c, status_of_nghttp2((int)k), "HTTP/2: %s", nghttp2_strerror((int)k));
      return;
    }
    if ((size_t)n < RBUF_SIZE)
      return; /* drained, most likely: do not pay for a recv that says EAGAIN */
  }
}

/* ---- connect ---- */

static embps_status_t tcp_connect(embps__conn_t *c, int64_t timeout_ms, embps_error_t *err) {
  struct addrinfo hints, *res = NULL, *ai;
  int64_t deadline = (int64_t)embps_now_ms() + timeout_ms;
  int rc, last_errno = 0, timed_out = 0;

  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  rc = getaddrinfo(c->addr.host, c->addr.port, &hints, &res);
  if (rc != 0)
    return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot resolve %s: %s", c->addr.authority,
                           gai_strerror(rc));
  for (ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    int one = 1;
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_errno = errno;
      close(fd);
      continue;
    }
    for (;;) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      int64_t left = deadline - (int64_t)embps_now_ms();
      int so_err = 0;
      socklen_t len = sizeof(so_err);
      if (left <= 0) {
        timed_out = 1;
        break;
      }
      rc = poll(&p, 1, left > 1000000 ? 1000000 : (int)left);
      if (rc < 0 && errno == EINTR)
        continue;
      if (rc == 0)
        continue;
      if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_err, &len) != 0) {
        last_errno = errno;
        break;
      }
      if (so_err != 0) {
        last_errno = so_err;
        break;
      }
      c->fd = fd;
      freeaddrinfo(res);
      return EMBPS_OK;
    }
    close(fd);
    if (timed_out)
      break;
  }
  freeaddrinfo(res);
  if (timed_out)
    return embps_error_set(err, EMBPS_DEADLINE_EXCEEDED,
                           "cannot connect to %s: no answer within %lld ms", c->addr.authority,
                           (long long)timeout_ms);
  return embps_error_set(err, EMBPS_UNAVAILABLE, "cannot connect to %s: %s", c->addr.authority,
                         strerror(last_errno ? last_errno : ECONNREFUSED));
}

static embps_status_t session_start(embps__conn_t *c, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  nghttp2_session_callbacks *cbs = NULL;
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, (uint32_t)LOCAL_WINDOW},
      {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, LOCAL_MAX_FRAME},
  };
  int rc;

  if (nghttp2_session_callbacks_new(&cbs) != 0)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_session_callbacks_set_on_frame_not_send_callback(cbs, on_frame_not_send);
  nghttp2_session_callbacks_set_data_source_read_length_callback(cbs, read_length);
  rc = nghttp2_session_client_new(&c->session, cbs, c);
  nghttp2_session_callbacks_del(cbs);
  if (rc != 0)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "nghttp2: %s", nghttp2_strerror(rc));
  rc = nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, iv, sizeof(iv) / sizeof(iv[0]));
  if (rc == 0)
    rc = nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, LOCAL_WINDOW);
  if (rc != 0)
    ret = embps_error_set(err, rc == NGHTTP2_ERR_NOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_INTERNAL,
                          "nghttp2: %s", nghttp2_strerror(rc));
  return ret;
}

static embps_status_t conn_connect(embps__conn_t *c, int64_t timeout_ms, embps_error_t *err) {
  embps_status_t ret;
  conn_close_socket(c);
  c->broken = 0;
  embps_error_clear(&c->why);
  ret = tcp_connect(c, timeout_ms > 0 ? timeout_ms : 10000, err);
  if (ret != EMBPS_OK)
    return ret;
  ret = session_start(c, err);
  if (ret != EMBPS_OK) {
    conn_close_socket(c); /* the socket, and the session when it was made */
    return ret;
  }
  conn_flush(c); /* the preface and SETTINGS leave now */
  if (c->broken) {
    ret = embps_error_set(err, c->why.status != EMBPS_OK ? c->why.status : EMBPS_UNAVAILABLE,
                          "connection to %s: %s", c->addr.authority, c->why.message);
    conn_close_socket(c);
  }
  return ret;
}

embps_status_t embps__conn_open(embps__conn_t **out, const embps__addr_t *addr, int64_t timeout_ms,
                                embps_error_t *err) {
  embps_status_t ret;
  embps__conn_t *c = embps_calloc(1, sizeof(*c));
  if (!c)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  c->fd = -1;
  c->addr = *addr;
  c->rbuf = embps_malloc(RBUF_SIZE);
  if (!c->rbuf) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  ret = conn_connect(c, timeout_ms, err);
  if (ret != EMBPS_OK)
    goto fail;
  *out = c;
  return EMBPS_OK;
fail:
  embps_free(c->rbuf);
  embps_free(c);
  return ret;
}

/* ---- submit and pump ---- */

static int session_over(embps__conn_t *c) {
  return !c->session ||
         (!nghttp2_session_want_read(c->session) && !nghttp2_session_want_write(c->session));
}

embps_status_t embps__conn_submit(embps__conn_t *c, embps__stream_t *s, int64_t timeout_ms,
                                  embps_error_t *err) {
  char timeout[16];
  nghttp2_data_provider prd;
  int32_t id;
  size_t nnv = 6;
#define NV(n, v, vl)                                                                               \
  {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl), NGHTTP2_NV_FLAG_NO_COPY_NAME}
  nghttp2_nv nva[8] = {
      NV(":method", "POST", 4),
      NV(":scheme", "http", 4),
      NV(":path", s->path, strlen(s->path)),
      NV(":authority", c->addr.authority, strlen(c->addr.authority)),
      NV("content-type", "application/grpc", 16),
      NV("te", "trailers", 8),
      NV("user-agent", "embps-c/" EMBPS_VERSION, strlen("embps-c/" EMBPS_VERSION)),
      NV("grpc-timeout", timeout, 0),
  };
#undef NV

  if (c->broken || session_over(c)) {
    /* Lost earlier (its streams already failed): reconnect once for this call. */
    if (c->broken && c->session)
      conn_break(c);
    embps_status_t st = conn_connect(c, timeout_ms, err);
    if (st != EMBPS_OK)
      return st == EMBPS_DEADLINE_EXCEEDED || st == EMBPS_RESOURCE_EXHAUSTED ? st
                                                                             : EMBPS_UNAVAILABLE;
  }
  nnv = 7;
  if (s->timeout_ms > 0) {
    nva[7].valuelen = embps__grpc_timeout(timeout, s->timeout_ms);
    nnv = 8;
  }
  s->conn = c;
  s->grpc_status = -1;
  s->http_status = 0;
  s->seg_i = 0;
  s->seg_off = 0;
  s->done = 0;
  embps_error_clear(&s->result);
  embps__deframer_init(&s->deframer);
  prd.source.ptr = s;
  prd.read_callback = read_body;
  id = nghttp2_submit_request(c->session, NULL, nva, nnv, &prd, s);
  if (id < 0)
    return embps_error_set(
        err, id == NGHTTP2_ERR_NOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE,
        "cannot start a call on %s: %s", c->addr.authority, nghttp2_strerror(id));
  s->id = id;
  s->attached = 1;
  s->prev = NULL;
  s->next = c->streams;
  if (c->streams)
    c->streams->prev = s;
  c->streams = s;
  s->send_next = NULL;
  if (c->send_tail)
    c->send_tail->send_next = s;
  else
    c->send_head = s;
  c->send_tail = s;
  return EMBPS_OK;
}

int embps__conns_pump(embps__conn_t **conns, size_t n, int timeout_ms) {
  struct pollfd pfd_small[16], *pfd = pfd_small;
  embps__conn_t *pc_small[16], **pc = pc_small;
  size_t np = 0;
  int progress = 0, rc;

  if (n > 16) {
    pfd = embps_malloc(n * sizeof(*pfd));
    pc = embps_malloc(n * sizeof(*pc));
    if (!pfd || !pc) {
      if (pfd != pfd_small)
        embps_free(pfd);
      if (pc != pc_small)
        embps_free(pc);
      errno = ENOMEM;
      return -1;
    }
  }

  for (size_t i = 0; i < n; i++) {
    embps__conn_t *c = conns[i];
    if (!c->session || c->fd < 0)
      continue;
    conn_flush(c);
    if (c->broken) {
      conn_break(c);
      progress++;
      continue;
    }
    if (!c->streams && c->wlen == 0)
      continue; /* idle: nothing to wait for (server frames are read with the next call) */
    pfd[np].fd = c->fd;
    pfd[np].events = POLLIN;
    if (c->wlen > 0 || nghttp2_session_want_write(c->session))
      pfd[np].events |= POLLOUT;
    pfd[np].revents = 0;
    pc[np++] = c;
  }
  if (np == 0)
    goto exit;
  if (progress)
    timeout_ms = 0;
  rc = poll(pfd, np, timeout_ms);
  if (rc < 0) {
    if (errno != EINTR)
      progress = -1;
    goto exit;
  }
  for (size_t i = 0; i < np; i++) {
    embps__conn_t *c = pc[i];
    if (pfd[i].revents == 0)
      continue;
    progress++;
    if (pfd[i].revents & (POLLIN | POLLERR | POLLHUP))
      conn_read(c);
    if (!c->broken)
      conn_flush(c);
    if (c->broken)
      conn_break(c);
  }
exit:
  if (pfd != pfd_small)
    embps_free(pfd);
  if (pc != pc_small)
    embps_free(pc);
  return progress;
}
