/* The HTTP/2 client session of a connection and the streams it settles (see conn.c for the
 * connection around it).
 *
 * The session is fed and drained by conn.c (nghttp2_session_mem_recv/mem_send); its callbacks
 * turn what arrives into each stream's result: headers give the HTTP and gRPC status, DATA
 * payloads go through the gRPC deframer to the stream's sink (the LookupResponse parser copies
 * rows into the caller's buffer) or into the stream's buffer for protobuf-c, and the stream's
 * close settles its result.
 *
 *  - The session advertises SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1 and enlarges the connection
 *    window to match, so flow control never stalls a reply (with the 64 KiB default a 2 MiB
 *    reply needs ~32 WINDOW_UPDATE round trips), and SETTINGS_MAX_FRAME_SIZE = 2^24-1 so the
 *    server may send a reply in few DATA frames.
 *  - Request bodies are sent from the caller's arrays by a data source read callback that
 *    copies into nghttp2's frame buffer (one copy); a read-length callback lets one DATA frame
 *    carry up to 1 MiB when the server's SETTINGS_MAX_FRAME_SIZE allows it.
 *
 * Order: requests are submitted in call order, so their HEADERS leave in order; a request's
 * body is deferred (NGHTTP2_ERR_DEFERRED) until the bodies of all earlier requests on the
 * connection are sent, so complete requests also arrive in call order, which DESIGN.md's
 * per-connection ordering relies on.
 *
 * A stream whose owner gave it up (deadline, cancel) is reset and stays owned by the connection
 * until nghttp2 closes it, because nghttp2 may still call back for it. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "client/conn_internal.h"
#include "common/alloc.h"

#define MAX_DATA_FRAME (1u << 20)
#define LOCAL_WINDOW ((int32_t)0x7fffffff)
#define LOCAL_MAX_FRAME (16777215u)

/* ---- streams ---- */

void embps__stream_finish(embps__stream_t *s, embps_status_t st, const char *fmt, ...) {
  va_list ap;
  if (s->done)
    return;
  s->done = 1;
  if (s->attached && s->conn)
    embps__conn_out_own(s->conn, s); /* its caller may reuse the body's memory from now on */
  s->result.status = st;
  va_start(ap, fmt);
  vsnprintf(s->result.message, sizeof(s->result.message), fmt, ap);
  va_end(ap);
  if (s->on_done)
    s->on_done(s);
}

static void stream_free(embps__stream_t *s) {
  embps_free(s->buf);
  embps_free(s->segs_more);
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
void embps__stream_detach(embps__conn_t *c, embps__stream_t *s) {
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
  embps__stream_finish(s, status, "%s", message);
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

uint8_t *embps__stream_direct(nghttp2_session *session, int32_t stream_id, size_t *n, int *later) {
  embps__stream_t *s = stream_of(session, stream_id);
  uint64_t body;
  uint8_t *p;
  /* Once done or released the caller may own (or have freed) the destination again. */
  *later = 0;
  if (!s || s->done || s->released || !s->sink_direct)
    return NULL;
  *later = 1;
  body = embps__deframer_body_left(&s->deframer);
  if (body == 0 || !(p = s->sink_direct(s->sink_arg, n)))
    return NULL;
  if (*n > body)
    *n = (size_t)body;
  return p;
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
      embps__stream_finish(s, st, "%s",
                           s->grpc_message[0] ? s->grpc_message : embps_status_str(st));
      return;
    }
    if (embps__deframer_finish(&s->deframer, &err) != EMBPS_OK ||
        (s->sink_finish && s->sink_finish(s->sink_arg, &err) != EMBPS_OK)) {
      embps__stream_finish(s, err.status, "%s", err.message);
      return;
    }
    embps__stream_finish(s, EMBPS_OK, "%s", "");
    return;
  }
  if (s->http_status != 0 && s->http_status != 200) {
    embps__stream_finish(s, embps__http_to_status(s->http_status),
                         "server %s answered HTTP status %d, not a gRPC reply", c->addr.authority,
                         s->http_status);
    return;
  }
  if (error_code != NGHTTP2_NO_ERROR) {
    embps__stream_finish(s, rst_status(error_code), "stream reset by %s: %s", c->addr.authority,
                         nghttp2_http2_strerror(error_code));
    return;
  }
  embps__stream_finish(s, EMBPS_INTERNAL, "reply from %s ended without grpc-status",
                       c->addr.authority);
}

static int on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code,
                           void *user_data) {
  embps__conn_t *c = user_data;
  embps__stream_t *s = stream_of(session, stream_id);
  c->streams_closed++;
  if (!s)
    return 0;
  settle(c, s, error_code);
  embps__stream_detach(c, s);
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
    embps__stream_finish(s, EMBPS_UNAVAILABLE, "request to %s not sent: %s",
                         s->conn->addr.authority, nghttp2_strerror(lib_error_code));
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

ssize_t embps__stream_read_body(nghttp2_session *session, int32_t stream_id, uint8_t *buf,
                                size_t length, uint32_t *data_flags, nghttp2_data_source *source,
                                void *user_data) {
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
  /* On a cleartext connection the frame's payload is queued by reference in send_data, from
   * where the body stands now; otherwise it is copied into nghttp2's frame here. */
  const int by_ref = embps__conn_out_by_ref(c);
  if (by_ref) {
    *data_flags |= NGHTTP2_DATA_FLAG_NO_COPY;
    s->frame_seg_i = s->seg_i;
    s->frame_seg_off = s->seg_off;
  }
  while (out < length && s->seg_i < s->nsegs) {
    const embps__seg_t *g = &(s->segs_more ? s->segs_more : s->segs)[s->seg_i];
    uint64_t left = g->len - s->seg_off;
    size_t k = left < length - out ? (size_t)left : length - out;
    if (by_ref)
      ; /* the cursor only: send_data queues the bytes */
    else if (g->p)
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

/* A DATA frame of a request body read with NGHTTP2_DATA_FLAG_NO_COPY: its header, then its
 * payload from the segments where embps__stream_read_body left off, queued by reference
 * (zeros, and a stream already finished, are copied: a finished stream's caller may reuse its
 * memory as soon as it runs again). Client requests are never padded, but padding would be
 * queued as the frame asks. Push gradients (2 MiB at 4096 x 128 f32) are then written from
 * the caller's array, with no copy into nghttp2's frame (issue 13). */
static int send_data(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd,
                     size_t length, nghttp2_data_source *source, void *user_data) {
  static const uint8_t zeros[256];
  embps__conn_t *c = user_data;
  embps__stream_t *s = source->ptr;
  size_t padlen = frame->data.padlen;
  int i = s->frame_seg_i;
  uint64_t off = s->frame_seg_off;
  (void)session;
  if (embps__conn_out_copy(c, framehd, 9) != 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  if (padlen > 0) {
    uint8_t pad = (uint8_t)(padlen - 1);
    if (embps__conn_out_copy(c, &pad, 1) != 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
  }
  while (length > 0 && i < s->nsegs) {
    const embps__seg_t *g = &(s->segs_more ? s->segs_more : s->segs)[i];
    uint64_t left = g->len - off;
    size_t k = left < length ? (size_t)left : length;
    int rc;
    if (!g->p) {
      k = k < sizeof(zeros) ? k : sizeof(zeros);
      rc = embps__conn_out_copy(c, zeros, k);
    } else if (s->done)
      rc = embps__conn_out_copy(c, g->p + off, k);
    else
      rc = embps__conn_out_ref(c, g->p + off, k, s);
    if (rc != 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
    length -= k;
    off += k;
    if (off == g->len) {
      i++;
      off = 0;
    }
  }
  for (size_t left = padlen > 1 ? padlen - 1 : 0, k; left > 0; left -= k) {
    k = left < sizeof(zeros) ? left : sizeof(zeros);
    if (embps__conn_out_copy(c, zeros, k) != 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
  }
  return length == 0 ? 0 : NGHTTP2_ERR_CALLBACK_FAILURE;
}

/* ---- the session ---- */

embps_status_t embps__session_start(embps__conn_t *c, embps_error_t *err) {
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
  nghttp2_session_callbacks_set_send_data_callback(cbs, send_data);
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
