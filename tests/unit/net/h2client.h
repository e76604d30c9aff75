/* A small gRPC client on an nghttp2 client session, shared by the net tests. It has no I/O of
 * its own: tests move its bytes in memory (test_h2conn) or over a blocking socket (test_net).
 * Requests are built byte for byte (prefix included) so tests can send malformed ones, and a
 * request's body can be cut into DATA frames of a chosen size or held back part way. */
#ifndef EMBPS_TEST_H2CLIENT_H
#define EMBPS_TEST_H2CLIENT_H

#include <nghttp2/nghttp2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define H2C_MAX_STREAMS 64

typedef struct h2c_stream {
  int32_t id;
  /* request */
  const uint8_t *payload; /* borrowed: prefix and message bytes as sent */
  size_t payload_len, sent, limit, chunk;
  /* response */
  int closed;
  uint32_t close_error;
  int http_status;
  char content_type[64];
  int grpc_status; /* -1 until seen */
  char grpc_message[4096];
  char grpc_accept_encoding[64]; /* "" until seen */
  int header_blocks;
  int trailers_only;
  uint8_t *data;
  size_t data_len, data_cap;
} h2c_stream_t;

typedef struct h2c {
  nghttp2_session *session;
  h2c_stream_t streams[H2C_MAX_STREAMS];
  int nstreams;
  int goaway;
  uint32_t goaway_error;
  int pad; /* pad every DATA frame as far as the frame size allows (at most 255 bytes) */
} h2c_t;

static inline h2c_stream_t *h2c_find(h2c_t *c, int32_t id) {
  for (int i = 0; i < c->nstreams; i++)
    if (c->streams[i].id == id)
      return &c->streams[i];
  return NULL;
}

static int h2c_on_header(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name,
                         size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                         void *user) {
  h2c_stream_t *st = h2c_find(user, f->hd.stream_id);
  if (!st)
    return 0;
  char v[4096];
  snprintf(v, sizeof(v), "%.*s", (int)valuelen, (const char *)value);
  if (namelen == 7 && memcmp(name, ":status", 7) == 0)
    st->http_status = atoi(v);
  else if (namelen == 12 && memcmp(name, "content-type", 12) == 0)
    snprintf(st->content_type, sizeof(st->content_type), "%.63s", v);
  else if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0)
    st->grpc_status = atoi(v);
  else if (namelen == 12 && memcmp(name, "grpc-message", 12) == 0)
    snprintf(st->grpc_message, sizeof(st->grpc_message), "%s", v);
  else if (namelen == 20 && memcmp(name, "grpc-accept-encoding", 20) == 0)
    snprintf(st->grpc_accept_encoding, sizeof(st->grpc_accept_encoding), "%.63s", v);
  return 0;
}

static int h2c_on_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *user) {
  h2c_t *c = user;
  if (f->hd.type == NGHTTP2_GOAWAY) {
    c->goaway = 1;
    c->goaway_error = f->goaway.error_code;
  }
  if (f->hd.type != NGHTTP2_HEADERS)
    return 0;
  h2c_stream_t *st = h2c_find(c, f->hd.stream_id);
  if (!st)
    return 0;
  st->header_blocks++;
  if ((f->hd.flags & NGHTTP2_FLAG_END_STREAM) && st->header_blocks == 1)
    st->trailers_only = 1;
  return 0;
}

static int h2c_on_data(nghttp2_session *s, uint8_t flags, int32_t id, const uint8_t *data,
                       size_t len, void *user) {
  h2c_stream_t *st = h2c_find(user, id);
  if (!st)
    return 0;
  if (st->data_len + len > st->data_cap) {
    size_t cap = st->data_cap ? st->data_cap : 4096;
    while (cap < st->data_len + len)
      cap *= 2;
    st->data = realloc(st->data, cap);
    st->data_cap = cap;
  }
  memcpy(st->data + st->data_len, data, len);
  st->data_len += len;
  return 0;
}

static int h2c_on_close(nghttp2_session *s, int32_t id, uint32_t error_code, void *user) {
  h2c_stream_t *st = h2c_find(user, id);
  if (st) {
    st->closed = 1;
    st->close_error = error_code;
  }
  return 0;
}

static ssize_t h2c_read(nghttp2_session *s, int32_t id, uint8_t *buf, size_t length,
                        uint32_t *flags, nghttp2_data_source *src, void *user) {
  h2c_stream_t *st = src->ptr;
  size_t avail = (st->limit < st->payload_len ? st->limit : st->payload_len) - st->sent;
  if (avail == 0 && st->sent < st->payload_len)
    return NGHTTP2_ERR_DEFERRED;
  size_t n = avail < length ? avail : length;
  if (st->chunk && n > st->chunk)
    n = st->chunk;
  memcpy(buf, st->payload + st->sent, n);
  st->sent += n;
  if (st->sent == st->payload_len)
    *flags |= NGHTTP2_DATA_FLAG_EOF;
  return (ssize_t)n;
}

/* big_windows: advertise 1 GiB windows and 1 MiB frames; otherwise nghttp2's defaults (64 KiB
 * windows, 16 KiB frames). */
static ssize_t h2c_padding(nghttp2_session *s, const nghttp2_frame *f, size_t max_payload,
                           void *user) {
  const h2c_t *c = user;
  size_t want = f->hd.length + 256;
  (void)s;
  if (!c->pad || f->hd.type != NGHTTP2_DATA)
    return (ssize_t)f->hd.length;
  return (ssize_t)(want < max_payload ? want : max_payload);
}

static void h2c_init(h2c_t *c, int big_windows) {
  memset(c, 0, sizeof(*c));
  nghttp2_session_callbacks *cbs;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_on_header_callback(cbs, h2c_on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, h2c_on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, h2c_on_data);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, h2c_on_close);
  nghttp2_session_callbacks_set_select_padding_callback(cbs, h2c_padding);
  nghttp2_session_client_new(&c->session, cbs, c);
  nghttp2_session_callbacks_del(cbs);
  if (big_windows) {
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 30},
                                   {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, 1 << 20}};
    nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, iv, 2);
    nghttp2_session_set_local_window_size(c->session, NGHTTP2_FLAG_NONE, 0, 1 << 30);
  } else {
    nghttp2_submit_settings(c->session, NGHTTP2_FLAG_NONE, NULL, 0);
  }
}

static void h2c_free(h2c_t *c) {
  nghttp2_session_del(c->session);
  for (int i = 0; i < c->nstreams; i++)
    free(c->streams[i].data);
}

/* Builds prefix + message into a malloc'd buffer. */
static inline uint8_t *h2c_frame(uint8_t flags, const void *msg, size_t len, size_t *out_len) {
  uint8_t *p = malloc(len + 5);
  p[0] = flags;
  p[1] = (uint8_t)(len >> 24);
  p[2] = (uint8_t)(len >> 16);
  p[3] = (uint8_t)(len >> 8);
  p[4] = (uint8_t)len;
  if (len)
    memcpy(p + 5, msg, len);
  *out_len = len + 5;
  return p;
}

/* Starts a POST to path with payload (borrowed until the stream closes) and up to 4 extra
 * headers. chunk: max bytes per DATA frame (0: no limit). limit: bytes available before the body
 * is held back (payload_len: all). payload NULL: no DATA at all (HEADERS with END_STREAM).
 * Returns the stream. */
static inline h2c_stream_t *h2c_request_with(h2c_t *c, const char *path, const char *content_type,
                                             const uint8_t *payload, size_t payload_len,
                                             size_t chunk, size_t limit, const nghttp2_nv *extra,
                                             size_t nextra) {
  h2c_stream_t *st = &c->streams[c->nstreams];
  memset(st, 0, sizeof(*st));
  st->payload = payload;
  st->payload_len = payload_len;
  st->chunk = chunk;
  st->limit = limit;
  st->grpc_status = -1;
  nghttp2_nv nva[] = {
      {(uint8_t *)":method", (uint8_t *)"POST", 7, 4, 0},
      {(uint8_t *)":scheme", (uint8_t *)"http", 7, 4, 0},
      {(uint8_t *)":path", (uint8_t *)path, 5, strlen(path), 0},
      {(uint8_t *)":authority", (uint8_t *)"localhost", 10, 9, 0},
      {(uint8_t *)"content-type", (uint8_t *)content_type, 12, strlen(content_type), 0},
      {(uint8_t *)"te", (uint8_t *)"trailers", 2, 8, 0},
      {0},
      {0},
      {0},
      {0},
  };
  size_t n = 6;
  for (size_t i = 0; i < nextra && n < sizeof(nva) / sizeof(nva[0]); i++)
    nva[n++] = extra[i];
  nghttp2_data_provider prd = {.source.ptr = st, .read_callback = h2c_read};
  st->id = nghttp2_submit_request(c->session, NULL, nva, n, payload ? &prd : NULL, st);
  if (st->id < 0)
    return NULL;
  c->nstreams++;
  return st;
}

/* A request as h2c_request_with, with no headers beyond gRPC's own. */
static inline h2c_stream_t *h2c_request(h2c_t *c, const char *path, const char *content_type,
                                        const uint8_t *payload, size_t payload_len, size_t chunk,
                                        size_t limit) {
  return h2c_request_with(c, path, content_type, payload, payload_len, chunk, limit, NULL, 0);
}

/* Makes more of a held-back body available. */
static inline void h2c_release_more(h2c_t *c, h2c_stream_t *st, size_t limit) {
  st->limit = limit;
  nghttp2_session_resume_data(c->session, st->id);
}

/* The response message (after the 5-byte prefix) or NULL when malformed; *len its length. */
static inline const uint8_t *h2c_message(const h2c_stream_t *st, size_t *len) {
  if (st->data_len < 5 || st->data[0] != 0)
    return NULL;
  size_t n = ((size_t)st->data[1] << 24) | ((size_t)st->data[2] << 16) |
             ((size_t)st->data[3] << 8) | st->data[4];
  if (n + 5 != st->data_len)
    return NULL;
  *len = n;
  return st->data + 5;
}

#endif
