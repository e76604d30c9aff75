/* The gRPC/HTTP2 core of one server connection, free of I/O.
 *
 * An nghttp2 server session does the HTTP/2 framing; this module adds gRPC unary semantics on
 * top. Received bytes go in through embps__h2conn_feed (nghttp2_session_mem_recv). Each request
 * stream parses its 5-byte message prefix as DATA arrives and then copies the message into one
 * buffer sized from the prefix, so a message costs one allocation and one copy whatever the
 * framing. A message whose declared length is over the limit, a compressed message, a second
 * message, a wrong content-type: each is answered at once with a trailers-only response (and a
 * RST_STREAM(NO_ERROR) once it is sent, when the client is still sending), and the connection
 * carries on. Requests whose stream ended with exactly one message are queued and handed to the
 * request callback only after mem_recv returns, so a handler never runs inside an nghttp2 callback
 * and may answer synchronously.
 *
 * Output is a batch of segments rather than a byte buffer, so that reply bodies are never
 * copied: nghttp2_session_send runs with a send_callback that copies the small frames (HEADERS,
 * SETTINGS, frame headers) into owned chunks, and DATA frames use NGHTTP2_DATA_FLAG_NO_COPY so
 * send_data_callback only records pointers to the 5-byte prefix and into the handler's body.
 * A reply body is refcounted: the stream holds one reference and every batch that points into it
 * holds one, so the handler's release runs once the last byte is written (or dropped), even when
 * the stream or the whole connection went away first.
 *
 * Calls are separate small objects so that they outlive their stream and their connection: when
 * either goes, the call is marked cancelled and detached, and its answer is dropped (releasing
 * the body) instead of touching freed memory.
 *
 * Windows: we advertise SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1 and raise the connection window to
 * the same, and accept 16 MiB-1 frames, so a client never stalls on our flow control; DATA we
 * send is as large as the peer's SETTINGS_MAX_FRAME_SIZE and windows allow (nghttp2 alone would
 * cap it at 16 KiB without the read-length callback). */
#include "server/net/h2conn.h"

#include <nghttp2/nghttp2.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/alloc.h"
#include "common/log.h"

#define PREFIX_LEN 5
#define WINDOW_MAX 2147483647
#define FRAME_MAX 16777215
#define MAX_CONCURRENT 1024
/* A batch stops taking DATA beyond these so one write stays bounded (libuv splits iovecs at
 * IOV_MAX itself). A batch always takes at least one frame, so progress is guaranteed. */
#define BATCH_MAX_BYTES (32u << 20)
#define BATCH_MAX_SEGS 4096
#define CHUNK_MIN 16384
/* Longest grpc-message we send, before encoding. */
#define MESSAGE_MAX 2048

typedef struct body {
  int refs;
  uint8_t prefix[PREFIX_LEN];
  const uint8_t *data;
  size_t len;
  void (*release)(void *);
  void *release_arg;
} body_t;

typedef struct chunk {
  struct chunk *next;
  size_t used, cap;
  uint8_t data[];
} chunk_t;

struct embps__h2out {
  embps__h2seg_t *segs;
  size_t nsegs, segs_cap;
  chunk_t *chunks; /* newest first; the head is the one being filled */
  body_t **bodies;
  size_t nbodies, bodies_cap;
  size_t bytes;
};

typedef enum stream_state {
  ST_RECEIVING = 0, /* headers or message still arriving */
  ST_QUEUED,        /* complete, waiting for delivery at the end of feed */
  ST_CALLED,        /* delivered, the handler owes an answer */
  ST_ANSWERED,      /* an answer (or an error) is submitted */
} stream_state_t;

typedef struct stream {
  struct stream *prev, *next;
  embps_net_call_t *call;
  int32_t id;
  stream_state_t state;
  int receiving; /* counted in conn->receiving */
  int method_seen, method_post, ct_ok;
  int headers_out_of_memory; /* a header could not be kept: refused when the headers end */
  char *path;
  char ct[64];
  char method[16];
  uint8_t hdr[PREFIX_LEN];
  size_t hdr_got;
  int in_msg;
  int nmsgs;
  int rst_after_answer; /* answered early while the client may still be sending */
  uint8_t *msg;
  size_t msg_len, msg_got;
  body_t *body;
  size_t read_off, sent_off;
} stream_t;

struct embps_net_call {
  embps__h2conn_t *conn; /* NULL once the connection is gone */
  stream_t *stream;      /* NULL once the stream is gone */
  struct embps_net_call *prev, *next;
  int cancelled;
};

typedef struct idq {
  int32_t *ids;
  size_t n, cap;
} idq_t;

struct embps__h2conn {
  nghttp2_session *session;
  embps__h2conn_hooks_t hooks;
  size_t max_message_bytes;
  size_t receiving_bytes; /* buffers of messages being received on this connection */
  stream_t *streams;
  size_t nstreams;
  size_t receiving;
  embps_net_call_t *calls;
  idq_t deliver;       /* streams complete during this feed */
  embps__h2out_t *out; /* the batch nghttp2_session_send is filling */
  int in_feed;
  int got_preface;
  int fatal;
};

/* ---- reply bodies and output batches ---- */

static void body_unref(body_t *b) {
  if (!b || --b->refs > 0)
    return;
  if (b->release)
    b->release(b->release_arg);
  embps_free(b);
}

void embps__h2out_free(embps__h2out_t *out) {
  if (!out)
    return;
  for (size_t i = 0; i < out->nbodies; i++)
    body_unref(out->bodies[i]);
  while (out->chunks) {
    chunk_t *c = out->chunks;
    out->chunks = c->next;
    embps_free(c);
  }
  embps_free(out->bodies);
  embps_free(out->segs);
  embps_free(out);
}

const embps__h2seg_t *embps__h2out_segs(const embps__h2out_t *out, size_t *nsegs) {
  *nsegs = out->nsegs;
  return out->segs;
}

size_t embps__h2out_bytes(const embps__h2out_t *out) { return out->bytes; }

static int out_full(const embps__h2out_t *out) {
  return out->nsegs > 0 && (out->bytes >= BATCH_MAX_BYTES || out->nsegs >= BATCH_MAX_SEGS);
}

static int out_reserve_segs(embps__h2out_t *out, size_t more) {
  if (out->nsegs + more <= out->segs_cap)
    return 0;
  size_t cap = out->segs_cap ? out->segs_cap * 2 : 64;
  while (cap < out->nsegs + more)
    cap *= 2;
  embps__h2seg_t *segs = embps_realloc(out->segs, cap * sizeof(*segs));
  if (!segs)
    return -1;
  out->segs = segs;
  out->segs_cap = cap;
  return 0;
}

/* Copies len bytes into the batch, extending the last segment when it ends where they go. */
static int out_copy(embps__h2out_t *out, const uint8_t *data, size_t len) {
  chunk_t *c = out->chunks;
  if (!c || c->cap - c->used < len) {
    size_t cap = len > CHUNK_MIN ? len : CHUNK_MIN;
    c = embps_malloc(sizeof(*c) + cap);
    if (!c)
      return -1;
    c->used = 0;
    c->cap = cap;
    c->next = out->chunks;
    out->chunks = c;
  }
  uint8_t *dst = c->data + c->used;
  embps__h2seg_t *last = out->nsegs ? &out->segs[out->nsegs - 1] : NULL;
  if (last && last->base + last->len == dst) {
    last->len += len;
  } else {
    if (out_reserve_segs(out, 1) < 0)
      return -1;
    out->segs[out->nsegs++] = (embps__h2seg_t){dst, len};
  }
  memcpy(dst, data, len);
  c->used += len;
  out->bytes += len;
  return 0;
}

/* Points the batch at len bytes of b, taking a reference on b for the batch. */
static int out_ref(embps__h2out_t *out, body_t *b, const uint8_t *data, size_t len) {
  if (out_reserve_segs(out, 1) < 0)
    return -1;
  if (out->nbodies == 0 || out->bodies[out->nbodies - 1] != b) {
    if (out->nbodies == out->bodies_cap) {
      size_t cap = out->bodies_cap ? out->bodies_cap * 2 : 8;
      body_t **bodies = embps_realloc(out->bodies, cap * sizeof(*bodies));
      if (!bodies)
        return -1;
      out->bodies = bodies;
      out->bodies_cap = cap;
    }
    out->bodies[out->nbodies++] = b;
    b->refs++;
  }
  out->segs[out->nsegs++] = (embps__h2seg_t){data, len};
  out->bytes += len;
  return 0;
}

/* ---- small helpers ---- */

static int idq_push(idq_t *q, int32_t id) {
  if (q->n == q->cap) {
    size_t cap = q->cap ? q->cap * 2 : 16;
    int32_t *ids = embps_realloc(q->ids, cap * sizeof(*ids));
    if (!ids)
      return -1;
    q->ids = ids;
    q->cap = cap;
  }
  q->ids[q->n++] = id;
  return 0;
}

char *embps__h2_percent_encode(const char *message) {
  static const char hex[] = "0123456789ABCDEF";
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)message; *p; p++)
    n += (*p < 0x20 || *p > 0x7e || *p == '%') ? 3 : 1;
  char *enc = embps_malloc(n + 1);
  if (!enc)
    return NULL;
  char *d = enc;
  for (const unsigned char *p = (const unsigned char *)message; *p; p++) {
    if (*p < 0x20 || *p > 0x7e || *p == '%') {
      *d++ = '%';
      *d++ = hex[*p >> 4];
      *d++ = hex[*p & 15];
    } else {
      *d++ = (char)*p;
    }
  }
  *d = '\0';
  return enc;
}

static void count_error(embps__h2conn_t *conn) {
  if (conn->hooks.stats)
    conn->hooks.stats->errors++;
}

static void notify_output(embps__h2conn_t *conn) {
  if (!conn->in_feed && conn->hooks.on_output)
    conn->hooks.on_output(conn->hooks.io_user);
}

static void stop_receiving(embps__h2conn_t *conn, stream_t *s) {
  if (s->receiving) {
    s->receiving = 0;
    conn->receiving--;
  }
}

#define NV(n, v, vlen)                                                                             \
  { (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vlen), NGHTTP2_NV_FLAG_NONE }

/* The RST_STREAM code for a stream that cannot be answered because nghttp2 failed with rv:
 * ENHANCE_YOUR_CALM when it ran out of memory (gRPC clients read it as RESOURCE_EXHAUSTED),
 * INTERNAL_ERROR otherwise. */
static uint32_t rst_code_of(int rv) {
  return rv == NGHTTP2_ERR_NOMEM ? NGHTTP2_ENHANCE_YOUR_CALM : NGHTTP2_INTERNAL_ERROR;
}

/* Submits a trailers-only response (one HEADERS with END_STREAM) carrying status and message;
 * when nghttp2 cannot take it, resets the stream instead. */
static void submit_status(embps__h2conn_t *conn, int32_t id, int http_status, embps_status_t status,
                          const char *message) {
  char http[8], code[8], clipped[MESSAGE_MAX + 1];
  snprintf(http, sizeof(http), "%d", http_status);
  snprintf(code, sizeof(code), "%d", embps_status_grpc_code(status));
  snprintf(clipped, sizeof(clipped), "%s", message ? message : "");
  char *enc = embps__h2_percent_encode(clipped);
  nghttp2_nv nva[] = {
      NV(":status", http, strlen(http)),
      NV("content-type", "application/grpc", 16),
      NV("grpc-status", code, strlen(code)),
      NV("grpc-message", enc ? enc : "", enc ? strlen(enc) : 0),
  };
  int rv = nghttp2_submit_response(conn->session, id, nva, sizeof(nva) / sizeof(nva[0]), NULL);
  embps_free(enc);
  if (rv < 0) {
    EMBPS_ERROR("nghttp2_submit_response(stream %d): %s", id, nghttp2_strerror(rv));
    nghttp2_submit_rst_stream(conn->session, NGHTTP2_FLAG_NONE, id, rst_code_of(rv));
  }
}

/* Drops a stream's half-received message and its share of the connection's budget. */
static void drop_msg(embps__h2conn_t *conn, stream_t *s) {
  if (s->msg)
    conn->receiving_bytes -= s->msg_len;
  embps_free(s->msg);
  s->msg = NULL;
}

/* Answers a stream early with an error, on behalf of the network layer. */
static void fail_stream(embps__h2conn_t *conn, stream_t *s, int http_status, embps_status_t status,
                        const char *message) {
  int was_receiving = s->state == ST_RECEIVING;
  stop_receiving(conn, s);
  s->state = ST_ANSWERED;
  s->in_msg = 0;
  drop_msg(conn, s);
  count_error(conn);
  /* The reset must wait until the HEADERS are out: nghttp2 drops frames queued for a stream
   * after a RST_STREAM. See on_frame_send. */
  s->rst_after_answer = was_receiving;
  submit_status(conn, s->id, http_status, status, message);
}

static void stream_free(stream_t *s) {
  embps_free(s->path);
  embps_free(s->msg);
  body_unref(s->body);
  embps_free(s);
}

/* ---- nghttp2 callbacks: receiving ---- */

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  embps__h2conn_t *conn = user;
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  stream_t *s = embps_calloc(1, sizeof(*s));
  if (!s) {
    /* No stream to answer on: refuse it as gRPC reads "out of resources". Later callbacks for
     * the stream find no user data and ignore it. */
    if (nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id,
                                  NGHTTP2_ENHANCE_YOUR_CALM) != 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets it with INTERNAL_ERROR */
    return 0;
  }
  s->id = frame->hd.stream_id;
  s->state = ST_RECEIVING;
  s->receiving = 1;
  conn->receiving++;
  s->next = conn->streams;
  if (conn->streams)
    conn->streams->prev = s;
  conn->streams = s;
  conn->nstreams++;
  nghttp2_session_set_stream_user_data(session, s->id, s);
  return 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                     void *user) {
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
  if (!s)
    return 0;
  if (namelen == 7 && memcmp(name, ":method", 7) == 0) {
    s->method_seen = 1;
    s->method_post = valuelen == 4 && memcmp(value, "POST", 4) == 0;
    snprintf(s->method, sizeof(s->method), "%.*s", (int)valuelen, (const char *)value);
  } else if (namelen == 5 && memcmp(name, ":path", 5) == 0) {
    embps_free(s->path);
    s->path = embps_malloc(valuelen + 1);
    if (!s->path) {
      s->headers_out_of_memory = 1;
      return 0;
    }
    memcpy(s->path, value, valuelen);
    s->path[valuelen] = '\0';
  } else if (namelen == 12 && memcmp(name, "content-type", 12) == 0) {
    /* gRPC: "application/grpc" optionally followed by "+proto" (any subtype) or parameters. */
    s->ct_ok = valuelen >= 16 && strncasecmp((const char *)value, "application/grpc", 16) == 0 &&
               (valuelen == 16 || value[16] == '+' || value[16] == ';');
    snprintf(s->ct, sizeof(s->ct), "%.*s", (int)valuelen, (const char *)value);
  }
  return 0;
}

/* The request headers are complete: refuse what is not a gRPC call (as grpc-go does). */
static void check_request(embps__h2conn_t *conn, stream_t *s) {
  char msg[160];
  if (s->headers_out_of_memory) {
    fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                "out of memory reading the request headers");
  } else if (!s->method_post) {
    snprintf(msg, sizeof(msg), "method must be POST for gRPC, got '%s'", s->method);
    fail_stream(conn, s, 405, EMBPS_INTERNAL, msg);
  } else if (!s->ct_ok) {
    snprintf(msg, sizeof(msg), "invalid gRPC request content-type '%s'", s->ct);
    fail_stream(conn, s, 415, EMBPS_INVALID_ARGUMENT, msg);
  } else if (!s->path) {
    fail_stream(conn, s, 200, EMBPS_UNIMPLEMENTED, "missing :path");
  }
}

/* The client ended its side of the stream: a unary request must hold exactly one message. */
static void end_of_request(embps__h2conn_t *conn, stream_t *s) {
  if (s->state != ST_RECEIVING)
    return;
  stop_receiving(conn, s);
  if (s->in_msg || s->hdr_got > 0) {
    fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT,
                "request stream ended inside a message (truncated gRPC message)");
  } else if (s->nmsgs == 0) {
    fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT,
                "missing request message: a unary call needs exactly one");
  } else if (idq_push(&conn->deliver, s->id) < 0) {
    fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, "out of memory queueing the request");
  } else {
    s->state = ST_QUEUED;
  }
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  embps__h2conn_t *conn = user;
  conn->got_preface = 1;
  if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA)
    return 0;
  stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
  if (!s)
    return 0;
  if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST &&
      s->state == ST_RECEIVING)
    check_request(conn, s);
  if (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)
    end_of_request(conn, s);
  return 0;
}

static int on_data_chunk_recv(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                              const uint8_t *data, size_t len, void *user) {
  embps__h2conn_t *conn = user;
  stream_t *s = nghttp2_session_get_stream_user_data(session, stream_id);
  while (s && s->state == ST_RECEIVING && len > 0) {
    if (!s->in_msg) {
      if (s->nmsgs > 0) {
        fail_stream(conn, s, 200, EMBPS_UNIMPLEMENTED,
                    "more than one request message on a unary call (client streaming is not "
                    "supported)");
        return 0;
      }
      size_t take = PREFIX_LEN - s->hdr_got < len ? PREFIX_LEN - s->hdr_got : len;
      memcpy(s->hdr + s->hdr_got, data, take);
      s->hdr_got += take;
      data += take;
      len -= take;
      if (s->hdr_got < PREFIX_LEN)
        return 0;
      uint64_t mlen = ((uint64_t)s->hdr[1] << 24) | ((uint64_t)s->hdr[2] << 16) |
                      ((uint64_t)s->hdr[3] << 8) | (uint64_t)s->hdr[4];
      char msg[160];
      if (s->hdr[0] == 1) {
        fail_stream(conn, s, 200, EMBPS_UNIMPLEMENTED, "compressed messages are not supported");
        return 0;
      }
      if (s->hdr[0] != 0) {
        snprintf(msg, sizeof(msg), "invalid gRPC message flags 0x%02x", s->hdr[0]);
        fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT, msg);
        return 0;
      }
      if (mlen > conn->max_message_bytes) {
        snprintf(msg, sizeof(msg), "received message larger than max (%llu vs. %zu)",
                 (unsigned long long)mlen, conn->max_message_bytes);
        fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
        return 0;
      }
      /* Buffers are taken when a message's prefix arrives, so many streams each announcing a
       * large message could reserve max_message_bytes apiece; a connection may have at most
       * two limits' worth being received at once. A client sends request bodies one after
       * another, so this refuses nothing it would send. */
      if (mlen > 0 && conn->receiving_bytes + (size_t)mlen > 2 * conn->max_message_bytes) {
        snprintf(msg, sizeof(msg),
                 "this connection is already receiving %zu bytes of messages; another %llu "
                 "would pass twice the limit of %zu",
                 conn->receiving_bytes, (unsigned long long)mlen, conn->max_message_bytes);
        fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
        return 0;
      }
      s->msg_len = (size_t)mlen;
      s->msg_got = 0;
      s->hdr_got = 0;
      if (mlen > 0) {
        s->msg = embps_malloc(s->msg_len);
        if (!s->msg) {
          snprintf(msg, sizeof(msg), "out of memory receiving a %zu-byte message", s->msg_len);
          fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
          return 0;
        }
        conn->receiving_bytes += s->msg_len;
        s->in_msg = 1;
      } else {
        s->nmsgs++;
      }
    } else {
      size_t take = s->msg_len - s->msg_got < len ? s->msg_len - s->msg_got : len;
      memcpy(s->msg + s->msg_got, data, take);
      s->msg_got += take;
      data += take;
      len -= take;
      if (s->msg_got == s->msg_len) {
        s->in_msg = 0;
        s->nmsgs++;
      }
    }
  }
  return 0;
}

static int on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code,
                           void *user) {
  embps__h2conn_t *conn = user;
  stream_t *s = nghttp2_session_get_stream_user_data(session, stream_id);
  if (!s)
    return 0;
  nghttp2_session_set_stream_user_data(session, stream_id, NULL);
  if (s->call) {
    s->call->stream = NULL;
    s->call->cancelled = 1;
  }
  stop_receiving(conn, s);
  if (s->prev)
    s->prev->next = s->next;
  else
    conn->streams = s->next;
  if (s->next)
    s->next->prev = s->prev;
  conn->nstreams--;
  drop_msg(conn, s);
  stream_free(s);
  return 0;
}

/* ---- nghttp2 callbacks: sending ---- */

static int on_frame_send(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  if (frame->hd.type != NGHTTP2_HEADERS || !(frame->hd.flags & NGHTTP2_FLAG_END_STREAM))
    return 0;
  stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
  /* A complete answer went out before the request did: ask the client to stop sending
   * (RFC 9113 8.1), which also discards the rest of its DATA. */
  if (s && s->rst_after_answer &&
      nghttp2_session_get_stream_remote_close(session, frame->hd.stream_id) == 0)
    nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_NO_ERROR);
  return 0;
}

static ssize_t send_cb(nghttp2_session *session, const uint8_t *data, size_t length, int flags,
                       void *user) {
  embps__h2conn_t *conn = user;
  if (!conn->out || out_full(conn->out))
    return NGHTTP2_ERR_WOULDBLOCK;
  if (out_copy(conn->out, data, length) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  return (ssize_t)length;
}

static ssize_t read_length_cb(nghttp2_session *session, uint8_t frame_type, int32_t stream_id,
                              int32_t session_window, int32_t stream_window,
                              uint32_t remote_max_frame_size, void *user) {
  /* nghttp2 clamps this to the windows; without the callback it would stop at 16 KiB. */
  return (ssize_t)remote_max_frame_size;
}

static ssize_t reply_read_cb(nghttp2_session *session, int32_t stream_id, uint8_t *buf,
                             size_t length, uint32_t *data_flags, nghttp2_data_source *source,
                             void *user) {
  stream_t *s = source->ptr;
  size_t total = PREFIX_LEN + s->body->len;
  size_t n = total - s->read_off < length ? total - s->read_off : length;
  s->read_off += n;
  *data_flags |= NGHTTP2_DATA_FLAG_NO_COPY;
  if (s->read_off == total) {
    nghttp2_nv trailers[] = {NV("grpc-status", "0", 1)};
    *data_flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    if (nghttp2_submit_trailer(session, stream_id, trailers, 1) < 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  return (ssize_t)n;
}

static int send_data_cb(nghttp2_session *session, nghttp2_frame *frame, const uint8_t *framehd,
                        size_t length, nghttp2_data_source *source, void *user) {
  embps__h2conn_t *conn = user;
  embps__h2out_t *out = conn->out;
  if (!out || out_full(out))
    return NGHTTP2_ERR_WOULDBLOCK;
  stream_t *s = source->ptr;
  body_t *b = s->body;
  static const uint8_t zeros[256];
  size_t padlen = frame->data.padlen;
  if (out_copy(out, framehd, 9) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  if (padlen > 0) {
    uint8_t pad = (uint8_t)(padlen - 1);
    if (out_copy(out, &pad, 1) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
  }
  size_t off = s->sent_off;
  if (off < PREFIX_LEN && length > 0) {
    size_t k = PREFIX_LEN - off < length ? PREFIX_LEN - off : length;
    if (out_ref(out, b, b->prefix + off, k) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
    off += k;
    length -= k;
  }
  if (length > 0) {
    if (out_ref(out, b, b->data + (off - PREFIX_LEN), length) < 0)
      return NGHTTP2_ERR_CALLBACK_FAILURE;
    off += length;
  }
  s->sent_off = off;
  if (padlen > 1 && out_copy(out, zeros, padlen - 1) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  return 0;
}

/* ---- the connection ---- */

embps_status_t embps__h2conn_new(embps__h2conn_t **out, size_t max_message_bytes,
                                 const embps__h2conn_hooks_t *hooks) {
  embps_status_t ret = EMBPS_OK;
  nghttp2_session_callbacks *cbs = NULL;
  nghttp2_option *opt = NULL;
  embps__h2conn_t *conn = embps_calloc(1, sizeof(*conn));
  EMBPS_CHECK_GOTO(conn, EMBPS_RESOURCE_EXHAUSTED, fail, "out of memory for a connection");
  conn->hooks = *hooks;
  conn->max_message_bytes = max_message_bytes;

  EMBPS_CHECK_GOTO(nghttp2_session_callbacks_new(&cbs) == 0, EMBPS_RESOURCE_EXHAUSTED, fail,
                   "nghttp2_session_callbacks_new failed");
  nghttp2_session_callbacks_set_send_callback(cbs, send_cb);
  nghttp2_session_callbacks_set_send_data_callback(cbs, send_data_cb);
  nghttp2_session_callbacks_set_data_source_read_length_callback(cbs, read_length_cb);
  nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk_recv);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_session_callbacks_set_on_frame_send_callback(cbs, on_frame_send);
  EMBPS_CHECK_GOTO(nghttp2_option_new(&opt) == 0, EMBPS_RESOURCE_EXHAUSTED, fail,
                   "nghttp2_option_new failed");
  /* We never push, so the client's SETTINGS_MAX_CONCURRENT_STREAMS does not matter to us. */
  EMBPS_CHECK_GOTO(nghttp2_session_server_new2(&conn->session, cbs, conn, opt) == 0,
                   EMBPS_RESOURCE_EXHAUSTED, fail, "nghttp2_session_server_new2 failed");

  nghttp2_settings_entry settings[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, WINDOW_MAX},
      {NGHTTP2_SETTINGS_MAX_FRAME_SIZE, FRAME_MAX},
  };
  EMBPS_CHECK_GOTO(nghttp2_submit_settings(conn->session, NGHTTP2_FLAG_NONE, settings,
                                           sizeof(settings) / sizeof(settings[0])) == 0,
                   EMBPS_RESOURCE_EXHAUSTED, fail, "nghttp2_submit_settings failed");
  EMBPS_CHECK_GOTO(
      nghttp2_session_set_local_window_size(conn->session, NGHTTP2_FLAG_NONE, 0, WINDOW_MAX) == 0,
      EMBPS_RESOURCE_EXHAUSTED, fail, "nghttp2_session_set_local_window_size failed");
  *out = conn;
exit:
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cbs);
  return ret;
fail:
  if (conn)
    nghttp2_session_del(conn->session);
  embps_free(conn);
  goto exit;
}

void embps__h2conn_free(embps__h2conn_t *conn) {
  if (!conn)
    return;
  for (embps_net_call_t *c = conn->calls; c; c = c->next) {
    c->conn = NULL;
    c->stream = NULL;
    c->cancelled = 1;
  }
  /* nghttp2_session_del runs no callbacks, so our streams are freed here. */
  nghttp2_session_del(conn->session);
  while (conn->streams) {
    stream_t *s = conn->streams;
    conn->streams = s->next;
    stream_free(s);
  }
  embps_free(conn->deliver.ids);
  embps_free(conn);
}

static void deliver(embps__h2conn_t *conn) {
  for (size_t i = 0; i < conn->deliver.n; i++) {
    stream_t *s = nghttp2_session_get_stream_user_data(conn->session, conn->deliver.ids[i]);
    if (!s || s->state != ST_QUEUED)
      continue; /* reset by the client in the same read */
    embps_net_call_t *call = embps_calloc(1, sizeof(*call));
    if (!call) {
      fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, "out of memory starting the call");
      continue;
    }
    call->conn = conn;
    call->stream = s;
    call->next = conn->calls;
    if (conn->calls)
      conn->calls->prev = call;
    conn->calls = call;
    s->call = call;
    s->state = ST_CALLED;
    if (conn->hooks.stats)
      conn->hooks.stats->requests++;
    uint8_t *msg = s->msg;
    if (msg)
      conn->receiving_bytes -= s->msg_len;
    s->msg = NULL;
    conn->hooks.on_request(conn->hooks.request_user, call, s->path, msg, s->msg_len);
  }
  conn->deliver.n = 0;
}

embps_status_t embps__h2conn_feed(embps__h2conn_t *conn, const uint8_t *data, size_t len) {
  if (conn->fatal)
    return EMBPS_UNAVAILABLE;
  conn->in_feed = 1;
  ssize_t rv = nghttp2_session_mem_recv(conn->session, data, len);
  if (rv < 0) {
    EMBPS_WARN("closing HTTP/2 connection: %s", nghttp2_strerror((int)rv));
    conn->fatal = 1;
    /* Queues a GOAWAY(PROTOCOL_ERROR) after our SETTINGS when the session can still send. */
    nghttp2_session_terminate_session(conn->session, NGHTTP2_PROTOCOL_ERROR);
    conn->deliver.n = 0;
    conn->in_feed = 0;
    return EMBPS_UNAVAILABLE;
  }
  deliver(conn);
  conn->in_feed = 0;
  return EMBPS_OK;
}

embps__h2out_t *embps__h2conn_take_output(embps__h2conn_t *conn) {
  embps__h2out_t *out = embps_calloc(1, sizeof(*out));
  if (!out) {
    EMBPS_ERROR("out of memory for an output batch");
    return NULL;
  }
  conn->out = out;
  int rv = nghttp2_session_send(conn->session);
  conn->out = NULL;
  if (rv < 0) {
    EMBPS_WARN("HTTP/2 send failed, closing the connection: %s", nghttp2_strerror(rv));
    conn->fatal = 1;
  }
  if (out->nsegs == 0) {
    embps__h2out_free(out);
    return NULL;
  }
  return out;
}

int embps__h2conn_want_close(const embps__h2conn_t *conn) {
  return conn->fatal ||
         (!nghttp2_session_want_read(conn->session) && !nghttp2_session_want_write(conn->session));
}

embps__h2conn_phase_t embps__h2conn_phase(const embps__h2conn_t *conn) {
  if (!conn->got_preface || conn->receiving > 0)
    return EMBPS__H2_RECEIVING;
  return conn->nstreams == 0 ? EMBPS__H2_IDLE : EMBPS__H2_BUSY;
}

/* ---- answering calls ---- */

/* Takes the call off its connection's list and frees it; returns its live stream or NULL. */
static stream_t *call_finish(embps_net_call_t *call, embps__h2conn_t **conn_out) {
  embps__h2conn_t *conn = call->conn;
  stream_t *s = call->stream;
  if (conn) {
    if (call->prev)
      call->prev->next = call->next;
    else
      conn->calls = call->next;
    if (call->next)
      call->next->prev = call->prev;
  }
  if (s)
    s->call = NULL;
  embps_free(call);
  *conn_out = conn;
  return conn ? s : NULL;
}

void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg) {
  embps__h2conn_t *conn;
  stream_t *s = call_finish(call, &conn);
  if (!s || len > UINT32_MAX) {
    if (s) {
      fail_stream(conn, s, 200, EMBPS_INTERNAL, "response message larger than 4 GiB");
      notify_output(conn);
    }
    if (release)
      release(release_arg);
    return;
  }
  body_t *b = embps_malloc(sizeof(*b));
  if (!b) {
    fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, "out of memory sending the response");
    notify_output(conn);
    if (release)
      release(release_arg);
    return;
  }
  b->refs = 1; /* the stream's */
  b->prefix[0] = 0;
  b->prefix[1] = (uint8_t)(len >> 24);
  b->prefix[2] = (uint8_t)(len >> 16);
  b->prefix[3] = (uint8_t)(len >> 8);
  b->prefix[4] = (uint8_t)len;
  b->data = body;
  b->len = len;
  b->release = release;
  b->release_arg = release_arg;
  s->body = b; /* freed with the stream, whatever happens below */
  s->read_off = s->sent_off = 0;
  s->state = ST_ANSWERED;
  nghttp2_nv nva[] = {NV(":status", "200", 3), NV("content-type", "application/grpc", 16)};
  nghttp2_data_provider prd = {.source.ptr = s, .read_callback = reply_read_cb};
  int rv = nghttp2_submit_response(conn->session, s->id, nva, 2, &prd);
  if (rv < 0) {
    EMBPS_ERROR("nghttp2_submit_response(stream %d): %s", s->id, nghttp2_strerror(rv));
    nghttp2_submit_rst_stream(conn->session, NGHTTP2_FLAG_NONE, s->id, rst_code_of(rv));
  }
  notify_output(conn);
}

void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message) {
  embps__h2conn_t *conn;
  stream_t *s = call_finish(call, &conn);
  if (!s)
    return;
  if (status == EMBPS_OK)
    status = EMBPS_UNKNOWN; /* the contract forbids OK here; never send a bodiless success */
  s->state = ST_ANSWERED;
  count_error(conn);
  submit_status(conn, s->id, 200, status, message);
  notify_output(conn);
}

int embps_net_call_cancelled(const embps_net_call_t *call) {
  return call->cancelled || !call->conn || !call->stream;
}
