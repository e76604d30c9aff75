/* The client transport: gRPC unary calls on nghttp2 client sessions over non-blocking TCP.
 *
 * Each connection is an nghttp2 client session (session.c) fed with nghttp2_session_mem_recv()
 * and drained with nghttp2_session_mem_send(); sockets are driven by poll() in whichever thread
 * waits for a call, so the library owns no threads and a client is single-threaded by contract.
 * This file holds the connection around the session: connecting, the socket's reads and write
 * buffer, the poll loop over a client's connections, submitting a call, breaking and closing.
 *
 * Throughput choices, for 2 MiB lookup replies on loopback:
 *  - The connection follows the server's frame headers beside nghttp2, and when the next bytes
 *    are row bytes of a lookup reply it recv()s them straight into the caller's buffer and feeds
 *    them to the session from there (the parser finds them in place): the kernel's copy is the
 *    only one. Other bytes go into a 1 MiB buffer, by reads that stop just past the current
 *    frame so that they take a reply's header fields but not its rows.
 *  - Small frames (HEADERS, a lookup's 32 KiB of tokens, WINDOW_UPDATE) are gathered into one
 *    write buffer and sent with one send(); large frames go to the socket directly.
 *  - On a cleartext connection a request body's DATA payload is queued by reference, pieces of
 *    the caller's memory beside pieces of the write buffer, and written with sendmsg(): a
 *    push's gradients are not copied into nghttp2's frames (push 4096 x 128 f32: 1.42 -> 1.25
 *    ms p50). What still waits when its stream finishes is copied then (embps__conn_out_own),
 *    so the caller's memory is its own again as soon as the call returns.
 *  - TCP_NODELAY: a request is a burst of frames that must not wait for Nagle.
 *
 * Failure: a socket error, EOF or HTTP/2 protocol error breaks the connection; every stream
 * on it finishes with UNAVAILABLE (RESOURCE_EXHAUSTED when memory ran out) and a message naming
 * the server, and the next call on it reconnects. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client/conn_internal.h"
#include "client/tls.h"
#include "common/alloc.h"
#include "common/clock.h"

#define RBUF_SIZE (1u << 20)
#define WBUF_FLUSH (256u << 10)  /* send the gathered small frames once this much is pending */
#define DIRECT_WRITE (64u << 10) /* frames at least this big skip the write buffer */
/* A read into rbuf takes this much past the current frame (see read_target). */
#define PEEK_BYTES 64
/* Inside a frame with at least LOWAT_MIN bytes still to come, poll() waits for min(rest,
 * LOWAT_MAX) of them (SO_RCVLOWAT, see embps__conn_wait_for_frame). */
#define LOWAT_MIN ((size_t)64 << 10)
#define LOWAT_MAX ((size_t)1 << 20)

/* ---- breaking and closing ---- */

/* An nghttp2 failure as a status: running out of memory is RESOURCE_EXHAUSTED, anything else
 * (a protocol error, a callback that failed) makes the server unavailable over this
 * connection. */
static embps_status_t status_of_nghttp2(int rv) {
  return rv == NGHTTP2_ERR_NOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE;
}

/* Empties the output queue (what it held is dropped). */
static void out_reset(embps__conn_t *c) {
  c->wlen = c->nout = c->out_i = c->out_off = c->out_bytes = 0;
}

static void conn_close_socket(embps__conn_t *c) {
  if (c->session) {
    nghttp2_session_del(c->session);
    c->session = NULL;
  }
  if (c->ssl) {
    SSL_free(c->ssl);
    c->ssl = NULL;
  }
  if (c->fd >= 0) {
    close(c->fd);
    c->fd = -1;
  }
  out_reset(c);
  c->resume_head = 0;
  memset(&c->frames, 0, sizeof(c->frames)); /* a new connection starts at a frame */
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
    embps__stream_detach(c, s); /* frees s if it was released: then do not touch it */
    if (!released)
      embps__stream_finish(s, status, "connection to %s lost: %s", c->addr.authority,
                           c->why.message);
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
      embps__stream_detach(c, s);
      if (!released)
        embps__stream_finish(s, EMBPS_CANCELLED, "client closed");
    }
  }
  conn_close_socket(c);
  embps_free(c->rbuf);
  embps_free(c->wbuf);
  embps_free(c->out);
  embps_free(c);
}

const embps__addr_t *embps__conn_addr(const embps__conn_t *c) { return &c->addr; }

/* ---- socket I/O ---- */

/* sendmsg() of the k pieces or, on a TLS connection, SSL_write of the first: the bytes taken,
 * or -1 with errno (EAGAIN when the socket is full); c's reason is recorded when it breaks. */
static ssize_t conn_sendv(embps__conn_t *c, const struct iovec *iov, int k) {
  char why[300];
  ssize_t n;
  if (!c->ssl) {
    struct msghdr m = {.msg_iov = (struct iovec *)iov, .msg_iovlen = (size_t)k};
    n = sendmsg(c->fd, &m, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      conn_fail(c, EMBPS_UNAVAILABLE, "send: %s", strerror(errno));
    return n;
  }
  n = embps__tls_client_send(c->ssl, iov[0].iov_base, iov[0].iov_len, why, sizeof(why));
  if (n < 0 && errno != EAGAIN)
    conn_fail(c, EMBPS_UNAVAILABLE, "%s", why);
  return n;
}

static ssize_t conn_send(embps__conn_t *c, const uint8_t *p, size_t n) {
  struct iovec v = {(void *)p, n};
  return conn_sendv(c, &v, 1);
}

/* recv() or, on a TLS connection, SSL_read: as recv, with c's reason recorded when broken. */
static ssize_t conn_recv(embps__conn_t *c, uint8_t *buf, size_t n) {
  char why[300];
  ssize_t k;
  if (!c->ssl) {
    k = recv(c->fd, buf, n, 0);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      conn_fail(c, EMBPS_UNAVAILABLE, "recv: %s", strerror(errno));
    return k;
  }
  k = embps__tls_client_recv(c->ssl, buf, n, why, sizeof(why));
  if (k < 0 && errno != EAGAIN)
    conn_fail(c, EMBPS_UNAVAILABLE, "%s", why);
  return k;
}

/* ---- the output queue ---- */

static const uint8_t *piece_bytes(const embps__conn_t *c, const embps__out_piece_t *q) {
  return q->p ? q->p : c->wbuf + q->off;
}

static int out_push(embps__conn_t *c, embps__out_piece_t q) {
  if (c->nout == c->out_cap) {
    size_t cap = c->out_cap ? 2 * c->out_cap : 16;
    embps__out_piece_t *o = embps_realloc(c->out, cap * sizeof(*o));
    if (!o) {
      conn_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      return -1;
    }
    c->out = o;
    c->out_cap = cap;
  }
  c->out[c->nout++] = q;
  c->out_bytes += q.len;
  return 0;
}

/* Appends n bytes to wbuf; their offset in *off. */
static int wbuf_put(embps__conn_t *c, const uint8_t *p, size_t n, size_t *off) {
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
  *off = c->wlen;
  c->wlen += n;
  return 0;
}

int embps__conn_out_copy(embps__conn_t *c, const uint8_t *p, size_t n) {
  size_t off;
  if (n == 0)
    return 0;
  if (wbuf_put(c, p, n, &off) != 0)
    return -1;
  embps__out_piece_t *last = c->nout > c->out_i ? &c->out[c->nout - 1] : NULL;
  if (last && !last->p && last->off + last->len == off) { /* extends the last copied piece */
    last->len += n;
    c->out_bytes += n;
    return 0;
  }
  return out_push(c, (embps__out_piece_t){.off = off, .len = n});
}

int embps__conn_out_ref(embps__conn_t *c, const uint8_t *p, size_t n, embps__stream_t *s) {
  if (n == 0)
    return 0;
  c->ref_bytes += n;
  return out_push(c, (embps__out_piece_t){.p = p, .len = n, .s = s});
}

void embps__conn_out_own(embps__conn_t *c, embps__stream_t *s) {
  for (size_t i = c->out_i; i < c->nout; i++) {
    embps__out_piece_t *q = &c->out[i];
    if (!q->p || q->s != s)
      continue;
    size_t off;
    if (i == c->out_i) { /* only its unwritten bytes are kept */
      q->p += c->out_off;
      q->len -= c->out_off;
      c->out_off = 0;
    }
    if (wbuf_put(c, q->p, q->len, &off) != 0) {
      /* Out of memory: the stream's bytes cannot be kept, so the connection must not write
       * them; it breaks before it writes again (conn_flush checks broken first). */
      out_reset(c);
      return;
    }
    q->p = NULL;
    q->s = NULL;
    q->off = off;
  }
}

int embps__conn_out_by_ref(const embps__conn_t *c) { return c->ssl == NULL; }

/* Writes the queue; returns 0 when all is written, 1 when the socket is full, -1 broken. */
static int write_pending(embps__conn_t *c) {
  while (c->out_i < c->nout) {
    struct iovec iov[64];
    int k = 0;
    for (size_t i = c->out_i; i < c->nout && k < 64; i++, k++) {
      size_t skip = i == c->out_i ? c->out_off : 0;
      iov[k].iov_base = (void *)(piece_bytes(c, &c->out[i]) + skip);
      iov[k].iov_len = c->out[i].len - skip;
    }
    ssize_t n = conn_sendv(c, iov, k);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 1;
      return -1;
    }
    c->out_bytes -= (size_t)n;
    while (n > 0) {
      size_t left = c->out[c->out_i].len - c->out_off;
      if ((size_t)n < left) {
        c->out_off += (size_t)n;
        break;
      }
      n -= (ssize_t)left;
      c->out_i++;
      c->out_off = 0;
    }
  }
  out_reset(c);
  return 0;
}

/* Serializes and sends what nghttp2 has, until done or the socket is full. Frames nghttp2
 * serializes are copied into the queue, except a large one met with the queue empty, which
 * goes to the socket directly; DATA frames of request bodies come through send_data
 * (session.c), by reference on a cleartext connection. */
static void conn_flush(embps__conn_t *c) {
  for (;;) {
    int sent_any = 0;
    if (c->broken || !c->session)
      return;
    if (c->out_bytes > 0 && write_pending(c) != 0)
      return; /* full (POLLOUT resumes) or broken */
    if (c->resume_head && c->send_head && c->send_head->deferred && c->send_head->id > 0)
      nghttp2_session_resume_data(c->session, c->send_head->id);
    c->resume_head = 0;
    for (;;) {
      const uint8_t *data;
      size_t queued = c->out_bytes;
      ssize_t n = nghttp2_session_mem_send(c->session, &data);
      if (n < 0) {
        conn_fail(c, status_of_nghttp2((int)n), "HTTP/2: %s", nghttp2_strerror((int)n));
        return;
      }
      if (c->broken)
        return;
      if (c->out_bytes != queued)
        sent_any = 1; /* send_data queued DATA frames */
      if (n == 0)
        break;
      sent_any = 1;
      if ((size_t)n >= DIRECT_WRITE && c->out_bytes == 0) {
        ssize_t k = conn_send(c, data, (size_t)n);
        if (k < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return;
          k = 0;
        }
        if (k < n) {
          embps__conn_out_copy(c, data + k, (size_t)(n - k)); /* the socket is full: rest waits */
          return;
        }
        continue;
      }
      if (embps__conn_out_copy(c, data, (size_t)n) != 0)
        return;
      if (c->out_bytes >= WBUF_FLUSH)
        break;
    }
    if (c->out_bytes > 0 && write_pending(c) != 0)
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

/* Where the next read goes, and at most how many bytes: row bytes of a lookup reply go
 * straight into the caller's buffer (an unpadded DATA frame whose stream can take them in
 * place); anything else goes into rbuf. A read into rbuf stops PEEK_BYTES into a DATA frame
 * whose stream may take rows in place, and otherwise PEEK_BYTES past the end of the current
 * frame, so that it takes the fields before a reply's rows but no more than a few rows. */
static uint8_t *read_target(embps__conn_t *c, size_t *cap, int *direct) {
  size_t want;
  int later = 0;
  *direct = 0;
  const embps_h2_frames_t *f = &c->frames;
  const int32_t id = embps_h2_frames_data_stream(f);
  if (id) {
    size_t n = 0;
    uint8_t *p = embps__stream_direct(c->session, id, &n, &later);
    if (p) {
      *cap = n < f->left ? n : f->left;
      *direct = 1;
      return p;
    }
  }
  if (f->have < EMBPS_H2_FRAME_HEADER)
    want = EMBPS_H2_FRAME_HEADER - f->have + PEEK_BYTES;
  else if (later)
    want = f->left < PEEK_BYTES ? f->left : PEEK_BYTES;
  else
    want = f->left + EMBPS_H2_FRAME_HEADER + PEEK_BYTES;
  *cap = want < RBUF_SIZE ? want : RBUF_SIZE;
  return c->rbuf;
}

/* Reads what the socket has and hands it to nghttp2, row bytes read in place. Returns once a
 * stream closes, so that its caller may send its next request while the replies behind it are
 * still arriving: reading on through a pipelined reply held the next request back until both
 * replies were in, and the server then idled while the client read (issue 13: two lookups in
 * flight ran at 1.8-2.2 GB/s against 2.1-3.7 GB/s for one, strace showing requests arriving in
 * pairs). */
static void conn_read(embps__conn_t *c) {
  const uint64_t closed = c->streams_closed;
  for (int rounds = 0; rounds < 64 && !c->broken; rounds++) {
    size_t cap;
    int direct;
    uint8_t *buf = read_target(c, &cap, &direct);
    ssize_t n = conn_recv(c, buf, cap);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return;
    }
    if (n == 0) {
      conn_fail(c, EMBPS_UNAVAILABLE, "server closed the connection");
      return;
    }
    embps_h2_frames_walk(&c->frames, buf, (size_t)n);
    if (direct)
      c->direct_bytes += (uint64_t)n;
    ssize_t k = nghttp2_session_mem_recv(c->session, buf, (size_t)n);
    if (k < 0) {
      conn_fail(c, status_of_nghttp2((int)k), "HTTP/2: %s", nghttp2_strerror((int)k));
      return;
    }
    if ((size_t)n < cap || c->streams_closed != closed)
      return; /* drained, most likely (do not pay for a recv that says EAGAIN), or a reply is
                 complete */
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

static embps_status_t conn_connect(embps__conn_t *c, int64_t timeout_ms, embps_error_t *err) {
  embps_status_t ret;
  int64_t deadline;
  conn_close_socket(c);
  c->broken = 0;
  embps_error_clear(&c->why);
  timeout_ms = timeout_ms > 0 ? timeout_ms : 10000;
  deadline = (int64_t)embps_now_ms() + timeout_ms;
  ret = tcp_connect(c, timeout_ms, err);
  if (ret != EMBPS_OK)
    return ret;
  if (c->tls_ctx) {
    ret = embps__tls_client_handshake(c->tls_ctx, c->fd,
                                      c->tls_server_name ? c->tls_server_name : c->addr.host,
                                      c->addr.authority, deadline, &c->ssl, err);
    if (ret != EMBPS_OK) {
      conn_close_socket(c);
      return ret;
    }
  }
  ret = embps__session_start(c, err);
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

embps_status_t embps__conn_open(embps__conn_t **out, const embps__addr_t *addr, SSL_CTX *tls_ctx,
                                const char *tls_server_name, int64_t timeout_ms,
                                embps_error_t *err) {
  embps_status_t ret;
  embps__conn_t *c = embps_calloc(1, sizeof(*c));
  if (!c)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  c->fd = -1;
  c->addr = *addr;
  c->tls_ctx = tls_ctx;
  c->tls_server_name = tls_server_name;
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
  embps_free(c->wbuf); /* the preface may have been queued before a later step failed */
  embps_free(c->out);
  embps_free(c);
  return ret;
}

/* ---- submit and pump ---- */

/* Inside a frame the rest of it is certain to come (or the connection to end, which poll()
 * reports whatever the mark), so poll() need not wake the thread before min(rest, LOWAT_MAX)
 * bytes are in. Loopback delivered a lookup reply in 64 KiB segments, and each one woke the
 * client, a wake-up the server's loop thread paid for: that thread ran at 100% of a core during
 * a one-in-flight lookup bench, a third of it in the scheduler and interrupt return paths. The
 * same server, clients alternating, 4-6 rounds of 3 s, medians (2-core VM): lookup 4096
 * 4.89M -> 5.24M rows/s (p50 0.758 -> 0.651 ms), two in flight 4.85M -> 6.55M, 65536 4.15M ->
 * 5.48M; a 4 MiB mark was slower than 1 MiB, 512 KiB and 2 MiB within noise of it. Frames of
 * less than LOWAT_MIN keep the default: a peer that trickles small segments then never leaves
 * the client waiting on the kernel's memory pressure. Cleartext only: on TLS the bytes poll()
 * counts are records, which OpenSSL may hold back. */
void embps__conn_wait_for_frame(embps__conn_t *c) {
  size_t want = 1;
  if (c->ssl || c->fd < 0)
    return;
  if (c->frames.have == EMBPS_H2_FRAME_HEADER && c->frames.left >= LOWAT_MIN)
    want = c->frames.left < LOWAT_MAX ? c->frames.left : LOWAT_MAX;
  if (want == c->rcvlowat || (want == 1 && c->rcvlowat == 0))
    return;
  int v = (int)want;
  if (setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0)
    c->rcvlowat = want;
}

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
  nghttp2_nv nva[9] = {
      NV(":method", "POST", 4),
      NV(":scheme", c->ssl ? "https" : "http", c->ssl ? 5 : 4),
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
  if (s->authorization) {
    /* Never indexed (RFC 7541 7.1.3): a secret must not sit in a compression table where a
     * compression side channel could guess at it. */
    nghttp2_nv auth = {(uint8_t *)"authorization", (uint8_t *)s->authorization, 13,
                       strlen(s->authorization),
                       NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_INDEX};
    nva[nnv++] = auth;
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
  prd.read_callback = embps__stream_read_body;
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
    if (!c->streams && c->out_bytes == 0)
      continue; /* idle: nothing to wait for (server frames are read with the next call) */
    if (c->ssl && SSL_has_pending(c->ssl)) {
      /* Decrypted bytes (or a whole record) wait inside OpenSSL, where poll() cannot see
       * them: a read stopped at the buffer's end. Read them now. */
      conn_read(c);
      if (!c->broken)
        conn_flush(c);
      if (c->broken)
        conn_break(c);
      progress++;
      continue;
    }
    embps__conn_wait_for_frame(c);
    pfd[np].fd = c->fd;
    pfd[np].events = POLLIN;
    if (c->out_bytes > 0 || nghttp2_session_want_write(c->session))
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
