/* The gRPC/HTTP2 core of one server connection, free of I/O.
 *
 * An nghttp2 server session does the HTTP/2 framing; this module adds gRPC unary semantics on
 * top: it follows each request stream from its headers to its answer and hands complete calls
 * to the request callback. Received bytes go in through embps__h2conn_feed
 * (nghttp2_session_mem_recv); a stream's message is read out of its DATA by grpc_frame.c. A
 * wrong method or content-type is answered at once with a trailers-only response (and a
 * RST_STREAM(NO_ERROR) once it is sent, when the client is still sending), and the connection
 * carries on. Requests whose stream ended with exactly one message are queued and handed to the
 * request callback only after mem_recv returns, so a handler never runs inside an nghttp2
 * callback and may answer synchronously. Output leaves as batches of segments (h2out.c).
 *
 * Calls are separate small objects so that they outlive their stream and their connection: when
 * either goes, the call is marked cancelled and detached, and its answer is dropped (releasing
 * the body) instead of touching freed memory.
 *
 * Windows: we advertise SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1 and raise the connection window to
 * the same, and accept 16 MiB-1 frames, so a client never stalls on our flow control. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/clock.h"
#include "common/alloc.h"
#include "common/log.h"
#include "server/net/h2conn_internal.h"

#define WINDOW_MAX 2147483647
#define FRAME_MAX 16777215
#define MAX_CONCURRENT 1024

/* ---- small helpers ---- */

static int idq_push(embps__h2idq_t *q, int32_t id) {
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

static void count_error(embps__h2conn_t *conn) {
  if (conn->hooks.stats)
    conn->hooks.stats->errors++;
}

/* The method's slot for path ("/pkg.Service/Method"), added on first sight (loop thread; the
 * slot is filled before num_methods publishes it). */
static embps_net_method_metrics_t *method_slot(embps_net_metrics_t *m, const char *path) {
  size_t n = atomic_load_explicit(&m->num_methods, memory_order_relaxed);
  const char *slash = path && path[0] == '/' ? strchr(path + 1, '/') : NULL;
  embps_net_method_metrics_t *slot;
  size_t slen;
  if (!slash || slash[1] == '\0' || (slen = (size_t)(slash - path - 1)) >= sizeof(slot->service) ||
      strlen(slash + 1) >= sizeof(slot->method))
    return &m->methods[EMBPS_NET_METRICS_METHODS];
  for (size_t i = 0; i < n; i++)
    if (strncmp(m->methods[i].service, path + 1, slen) == 0 && m->methods[i].service[slen] == 0 &&
        strcmp(m->methods[i].method, slash + 1) == 0)
      return &m->methods[i];
  if (n == EMBPS_NET_METRICS_METHODS)
    return &m->methods[EMBPS_NET_METRICS_METHODS];
  slot = &m->methods[n];
  memcpy(slot->service, path + 1, slen);
  slot->service[slen] = '\0';
  snprintf(slot->method, sizeof(slot->method), "%s", slash + 1);
  embps_hist_init(&slot->seconds, embps_hist_seconds_bounds, embps_hist_seconds_nbounds);
  atomic_store_explicit(&m->num_methods, n + 1, memory_order_release);
  return slot;
}

/* Counts a call's answer once: its code, its time, and (OK) the reply message's bytes. */
static void count_handled(embps_net_call_t *call, embps_status_t status, size_t reply_bytes) {
  embps_net_method_metrics_t *gm = call->gm;
  int code = embps_status_grpc_code(status);
  if (!gm)
    return;
  call->gm = NULL;
  if (code < 0 || code >= EMBPS_NET_GRPC_CODES)
    code = 2; /* UNKNOWN */
  atomic_fetch_add_explicit(&gm->handled[code], 1, memory_order_relaxed);
  embps_hist_observe_ns(&gm->seconds, embps_now_ns() - call->start_ns);
  if (reply_bytes && call->conn && call->conn->hooks.metrics)
    atomic_fetch_add_explicit(&call->conn->hooks.metrics->message_bytes_out, reply_bytes,
                              memory_order_relaxed);
}

static void notify_output(embps__h2conn_t *conn) {
  if (!conn->in_feed && conn->hooks.on_output)
    conn->hooks.on_output(conn->hooks.io_user);
}

static void stop_receiving(embps__h2conn_t *conn, embps__h2stream_t *s) {
  if (s->receiving) {
    s->receiving = 0;
    conn->receiving--;
  }
}

/* Drops a stream's half-received message and its share of the connection's budget. */
static void drop_msg(embps__h2conn_t *conn, embps__h2stream_t *s) {
  if (s->msg)
    conn->receiving_bytes -= s->msg_len;
  embps_free(s->msg);
  s->msg = NULL;
}

/* Answers a stream early with an error, on behalf of the network layer. */
void embps__h2_fail_stream(embps__h2conn_t *conn, embps__h2stream_t *s, int http_status,
                           embps_status_t status, const char *message) {
  int was_receiving = s->state == EMBPS__H2S_RECEIVING;
  stop_receiving(conn, s);
  s->state = EMBPS__H2S_ANSWERED;
  s->in_msg = 0;
  drop_msg(conn, s);
  count_error(conn);
  /* The reset must wait until the HEADERS are out: nghttp2 drops frames queued for a stream
   * after a RST_STREAM. See on_frame_send. */
  s->rst_after_answer = was_receiving;
  embps__grpc_submit_status(conn, s->id, http_status, status, message);
}

static void stream_free(embps__h2stream_t *s) {
  embps_free(s->path);
  if (s->authorization)
    explicit_bzero(s->authorization, strlen(s->authorization));
  embps_free(s->authorization);
  embps_free(s->msg);
  embps_free(s->fail_message);
  embps__h2body_unref(s->body);
  embps_free(s);
}

/* ---- nghttp2 callbacks: receiving ---- */

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  embps__h2conn_t *conn = user;
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  embps__h2stream_t *s = embps_calloc(1, sizeof(*s));
  if (!s) {
    /* No stream to answer on: refuse it as gRPC reads "out of resources". Later callbacks for
     * the stream find no user data and ignore it. */
    if (nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id,
                                  NGHTTP2_ENHANCE_YOUR_CALM) != 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets it with INTERNAL_ERROR */
    return 0;
  }
  s->id = frame->hd.stream_id;
  s->state = EMBPS__H2S_RECEIVING;
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
  embps__h2stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
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
  } else if (namelen == 13 && memcmp(name, "authorization", 13) == 0) {
    /* Kept for the service's check (a bearer token); bounded so that a client cannot make
     * every stream hold a large copy. */
    if (s->authorization_bad)
      return 0;
    if (s->authorization || valuelen > EMBPS_NET_MAX_AUTHORIZATION) {
      s->authorization_bad = s->authorization ? 2 : 1;
      return 0;
    }
    s->authorization = embps_malloc(valuelen + 1);
    if (!s->authorization) {
      s->headers_out_of_memory = 1;
      return 0;
    }
    memcpy(s->authorization, value, valuelen);
    s->authorization[valuelen] = '\0';
  }
  return 0;
}

/* The request headers are complete: refuse what is not a gRPC call (as grpc-go does). */
static void check_request(embps__h2conn_t *conn, embps__h2stream_t *s) {
  char msg[160];
  if (s->headers_out_of_memory) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                          "out of memory reading the request headers");
  } else if (!s->method_post) {
    snprintf(msg, sizeof(msg), "method must be POST for gRPC, got '%s'", s->method);
    embps__h2_fail_stream(conn, s, 405, EMBPS_INTERNAL, msg);
  } else if (!s->ct_ok) {
    snprintf(msg, sizeof(msg), "invalid gRPC request content-type '%s'", s->ct);
    embps__h2_fail_stream(conn, s, 415, EMBPS_INVALID_ARGUMENT, msg);
  } else if (!s->path) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_UNIMPLEMENTED, "missing :path");
  } else if (s->authorization_bad == 1) {
    snprintf(msg, sizeof(msg), "the authorization metadata is longer than %d bytes",
             EMBPS_NET_MAX_AUTHORIZATION);
    embps__h2_fail_stream(conn, s, 200, EMBPS_UNAUTHENTICATED, msg);
  } else if (s->authorization_bad == 2) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_UNAUTHENTICATED,
                          "more than one authorization header: send one 'Bearer TOKEN'");
  }
}

/* The client ended its side of the stream: a unary request must hold exactly one message. */
static void end_of_request(embps__h2conn_t *conn, embps__h2stream_t *s) {
  if (s->state != EMBPS__H2S_RECEIVING)
    return;
  stop_receiving(conn, s);
  if (s->in_msg || s->hdr_got > 0) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT,
                          "request stream ended inside a message (truncated gRPC message)");
  } else if (s->nmsgs == 0) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT,
                          "missing request message: a unary call needs exactly one");
  } else if (idq_push(&conn->deliver, s->id) < 0) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                          "out of memory queueing the request");
  } else {
    s->state = EMBPS__H2S_QUEUED;
  }
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
  embps__h2conn_t *conn = user;
  conn->got_preface = 1;
  if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA)
    return 0;
  embps__h2stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
  if (!s)
    return 0;
  if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST &&
      s->state == EMBPS__H2S_RECEIVING)
    check_request(conn, s);
  if (frame->hd.flags & NGHTTP2_FLAG_END_STREAM)
    end_of_request(conn, s);
  return 0;
}

static int on_stream_close(nghttp2_session *session, int32_t stream_id, uint32_t error_code,
                           void *user) {
  embps__h2conn_t *conn = user;
  embps__h2stream_t *s = nghttp2_session_get_stream_user_data(session, stream_id);
  if (!s)
    return 0;
  nghttp2_session_set_stream_user_data(session, stream_id, NULL);
  if (s->call) {
    s->call->stream = NULL;
    s->call->cancelled = 1;
  }
  stop_receiving(conn, s);
  /* Whatever of its reply is unsent is dropped now (a batch already taken keeps its own
   * reference until written), so the connection no longer holds it. */
  conn->reply_bytes -= s->reply_held;
  if (s->body)
    conn->unsent_bodies--;
  if (s->deferred)
    conn->deferred_bodies--;
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
  embps__h2stream_t *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
  /* A complete answer went out before the request did: ask the client to stop sending
   * (RFC 9113 8.1), which also discards the rest of its DATA. */
  if (s && s->rst_after_answer &&
      nghttp2_session_get_stream_remote_close(session, frame->hd.stream_id) == 0)
    nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_NO_ERROR);
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
  conn->preface_left = NGHTTP2_CLIENT_MAGIC_LEN;

  EMBPS_CHECK_GOTO(nghttp2_session_callbacks_new(&cbs) == 0, EMBPS_RESOURCE_EXHAUSTED, fail,
                   "nghttp2_session_callbacks_new failed");
  embps__h2out_set_send_callbacks(cbs);
  nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, embps__grpc_on_data_chunk_recv);
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
    count_handled(c, EMBPS_CANCELLED, 0); /* the metrics may not outlive the connection */
    c->conn = NULL;
    c->stream = NULL;
    c->cancelled = 1;
  }
  /* nghttp2_session_del runs no callbacks, so our streams are freed here. */
  nghttp2_session_del(conn->session);
  while (conn->streams) {
    embps__h2stream_t *s = conn->streams;
    conn->streams = s->next;
    stream_free(s);
  }
  embps_free(conn->deliver.ids);
  embps_free(conn);
}

static void deliver(embps__h2conn_t *conn) {
  for (size_t i = 0; i < conn->deliver.n; i++) {
    embps__h2stream_t *s =
        nghttp2_session_get_stream_user_data(conn->session, conn->deliver.ids[i]);
    if (!s || s->state != EMBPS__H2S_QUEUED)
      continue; /* reset by the client in the same read */
    embps_net_call_t *call = embps_calloc(1, sizeof(*call));
    if (!call) {
      embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                            "out of memory starting the call");
      continue;
    }
    call->conn = conn;
    call->stream = s;
    call->next = conn->calls;
    if (conn->calls)
      conn->calls->prev = call;
    conn->calls = call;
    s->call = call;
    s->state = EMBPS__H2S_CALLED;
    if (conn->hooks.stats)
      conn->hooks.stats->requests++;
    if (conn->hooks.metrics) {
      call->gm = method_slot(conn->hooks.metrics, s->path);
      call->start_ns = embps_now_ns();
      atomic_fetch_add_explicit(&call->gm->started, 1, memory_order_relaxed);
      atomic_fetch_add_explicit(&conn->hooks.metrics->message_bytes_in, s->msg_len,
                                memory_order_relaxed);
    }
    uint8_t *msg = s->msg;
    if (msg)
      conn->receiving_bytes -= s->msg_len;
    s->msg = NULL;
    conn->hooks.on_request(conn->hooks.request_user, call, s->path, msg, s->msg_len);
  }
  conn->deliver.n = 0;
}

/* Walks n bytes about to be fed, keeping conn's place in the client's preface and frames. */
static void frames_track(embps__h2conn_t *conn, const uint8_t *p, size_t n) {
  size_t k = conn->preface_left < n ? conn->preface_left : n;
  conn->preface_left -= k;
  embps_h2_frames_walk(&conn->frames, p + k, n - k);
}

/* The stream id's message buffer, when it is receiving a message with at least
 * EMBPS__H2_DIRECT_MIN bytes still to come. */
static embps__h2stream_t *large_message(embps__h2conn_t *conn, int32_t id) {
  embps__h2stream_t *s = id ? nghttp2_session_get_stream_user_data(conn->session, id) : NULL;
  return s && s->state == EMBPS__H2S_RECEIVING && s->in_msg &&
                 s->msg_len - s->msg_got >= EMBPS__H2_DIRECT_MIN
             ? s
             : NULL;
}

uint8_t *embps__h2conn_read_target(embps__h2conn_t *conn, size_t *cap) {
  *cap = SIZE_MAX;
  if (conn->fatal || conn->preface_left > 0)
    return NULL;
  const embps_h2_frames_t *f = &conn->frames;
  const int32_t id = embps_h2_frames_data_stream(f);
  embps__h2stream_t *s = large_message(conn, id);
  if (s) {
    size_t left = s->msg_len - s->msg_got;
    conn->direct_stream = id;
    *cap = left < f->left ? left : f->left;
    return s->msg + s->msg_got;
  }
  if (!large_message(conn, conn->direct_stream)) {
    conn->direct_stream = 0;
    return NULL;
  }
  /* A large message is arriving: stop at the end of the next frame header. */
  *cap = f->have < EMBPS_H2_FRAME_HEADER ? EMBPS_H2_FRAME_HEADER - f->have
                                         : f->left + EMBPS_H2_FRAME_HEADER;
  return NULL;
}

uint64_t embps__h2conn_direct_bytes(const embps__h2conn_t *conn) { return conn->direct_bytes; }

embps_status_t embps__h2conn_feed(embps__h2conn_t *conn, const uint8_t *data, size_t len) {
  if (conn->fatal)
    return EMBPS_UNAVAILABLE;
  frames_track(conn, data, len);
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
  embps__h2out_t *out = embps__h2out_new();
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
  size_t nsegs;
  (void)embps__h2out_segs(out, &nsegs);
  if (nsegs == 0) {
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
  /* A reply waiting only for bytes still being made waits on us, not on the peer. */
  if (conn->unsent_bodies > conn->deferred_bodies)
    return EMBPS__H2_SENDING;
  if (!conn->got_preface || conn->receiving > 0)
    return EMBPS__H2_RECEIVING;
  return conn->nstreams == 0 ? EMBPS__H2_IDLE : EMBPS__H2_BUSY;
}

void embps__h2conn_set_reply_limit(embps__h2conn_t *conn, size_t max_reply_bytes) {
  conn->max_reply_bytes = max_reply_bytes;
}

size_t embps__h2conn_reply_bytes(const embps__h2conn_t *conn) { return conn->reply_bytes; }

void embps__h2conn_goaway(embps__h2conn_t *conn) {
  /* terminate_session names the last stream processed; the session neither reads nor writes
   * once the GOAWAY is out. When it cannot even queue that, close without it. */
  if (nghttp2_session_terminate_session(conn->session, NGHTTP2_NO_ERROR) != 0)
    conn->fatal = 1;
}

/* ---- answering calls ---- */

embps_status_t embps_net_call_hold_reply(embps_net_call_t *call, size_t bytes, embps_error_t *err) {
  embps__h2conn_t *conn = call->conn;
  if (embps_net_call_cancelled(call))
    return embps_error_set(err, EMBPS_CANCELLED, "the client has gone");
  /* One reply alone always fits, so a limit below the largest reply refuses nothing that a
   * connection doing one call at a time would send. */
  if (conn->max_reply_bytes && conn->reply_bytes > 0 &&
      conn->reply_bytes + bytes > conn->max_reply_bytes)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "this connection already holds %zu bytes of replies (being made, or "
                           "not yet read by the client); another %zu would pass "
                           "--max-connection-reply-bytes=%zu: read the replies before asking for "
                           "more, or spread the calls over more connections",
                           conn->reply_bytes, bytes, conn->max_reply_bytes);
  call->reply_held += bytes;
  conn->reply_bytes += bytes;
  return EMBPS_OK;
}

/* Takes the call off its connection's list and frees it; returns its live stream or NULL. */
static embps__h2stream_t *call_finish(embps_net_call_t *call, embps__h2conn_t **conn_out) {
  embps__h2conn_t *conn = call->conn;
  embps__h2stream_t *s = call->stream;
  if (conn) {
    conn->reply_bytes -= call->reply_held;
    if (call->prev)
      call->prev->next = call->next;
    else
      conn->calls = call->next;
    if (call->next)
      call->next->prev = call->prev;
  }
  if (s)
    s->call = NULL;
  embps__h2body_unref(call->body);
  embps_free(call);
  *conn_out = conn;
  return conn ? s : NULL;
}

/* Submits the response HEADERS of s with b as its body (the stream takes over the reference the
 * caller made for it), and passes the call's reply hold to the stream. */
static void submit_body(embps__h2conn_t *conn, embps__h2stream_t *s, embps__h2body_t *b,
                        size_t held) {
  s->body = b; /* freed with the stream, whatever happens below */
  conn->unsent_bodies++;
  s->reply_held = held; /* the call's hold passes to the stream until it closes */
  conn->reply_bytes += held;
  s->read_off = s->sent_off = 0;
  s->state = EMBPS__H2S_ANSWERED;
  nghttp2_nv nva[] = {EMBPS__H2_NV(":status", "200", 3),
                      EMBPS__H2_NV("content-type", "application/grpc", 16)};
  nghttp2_data_provider prd = {.source.ptr = s, .read_callback = embps__grpc_reply_read_cb};
  int rv = nghttp2_submit_response(conn->session, s->id, nva, 2, &prd);
  if (rv < 0) {
    EMBPS_ERROR("nghttp2_submit_response(stream %d): %s", s->id, nghttp2_strerror(rv));
    nghttp2_submit_rst_stream(conn->session, NGHTTP2_FLAG_NONE, s->id, embps__h2_rst_code_of(rv));
  }
}

/* A streamed reply has more to send (bytes, its end or its failure): wakes its data source. */
static void resume(embps__h2conn_t *conn, embps__h2stream_t *s) {
  if (!s->deferred)
    return;
  s->deferred = 0;
  conn->deferred_bodies--;
  int rv = nghttp2_session_resume_data(conn->session, s->id);
  if (rv < 0) {
    EMBPS_ERROR("nghttp2_session_resume_data(stream %d): %s", s->id, nghttp2_strerror(rv));
    nghttp2_submit_rst_stream(conn->session, NGHTTP2_FLAG_NONE, s->id, embps__h2_rst_code_of(rv));
  }
}

embps_status_t embps_net_call_reply_begin(embps_net_call_t *call, const uint8_t *body, size_t len,
                                          size_t ready, void (*release)(void *),
                                          void *release_arg) {
  embps__h2conn_t *conn = call->conn;
  if (call->body)
    return EMBPS_FAILED_PRECONDITION;
  if (embps_net_call_cancelled(call))
    return EMBPS_CANCELLED;
  if (len > UINT32_MAX)
    return EMBPS_INVALID_ARGUMENT;
  embps__h2body_t *b = embps__grpc_body_new(body, len, release, release_arg);
  if (!b)
    return EMBPS_RESOURCE_EXHAUSTED;
  b->ready = ready < len ? ready : len;
  b->ended = 0;
  b->refs++; /* the call's, until it ends: its bytes are still being written */
  call->body = b;
  /* The hold moves to the stream now, so call_finish finds none left to give back. */
  size_t held = call->reply_held;
  conn->reply_bytes -= held;
  call->reply_held = 0;
  submit_body(conn, call->stream, b, held);
  notify_output(conn);
  return EMBPS_OK;
}

void embps_net_call_reply_ready(embps_net_call_t *call, size_t ready) {
  embps__h2body_t *b = call->body;
  if (!b || ready <= b->ready)
    return;
  b->ready = ready < b->len ? ready : b->len;
  if (call->conn && call->stream) {
    resume(call->conn, call->stream);
    notify_output(call->conn);
  }
}

void embps_net_call_reply_end(embps_net_call_t *call) {
  embps__h2conn_t *conn;
  embps__h2stream_t *s;
  embps__h2body_t *b = call->body;
  b->ready = b->len;
  b->ended = 1;
  count_handled(call, EMBPS_OK, b->len);
  s = call_finish(call, &conn);
  if (s) {
    resume(conn, s);
    notify_output(conn);
  }
}

void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg) {
  embps__h2conn_t *conn;
  embps__h2stream_t *s;
  size_t held = call->reply_held;
  count_handled(call, len > UINT32_MAX ? EMBPS_INTERNAL : EMBPS_OK, len);
  s = call_finish(call, &conn);
  if (!s || len > UINT32_MAX) {
    if (s) {
      embps__h2_fail_stream(conn, s, 200, EMBPS_INTERNAL, "response message larger than 4 GiB");
      notify_output(conn);
    }
    if (release)
      release(release_arg);
    return;
  }
  embps__h2body_t *b = embps__grpc_body_new(body, len, release, release_arg);
  if (!b) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                          "out of memory sending the response");
    notify_output(conn);
    if (release)
      release(release_arg);
    return;
  }
  submit_body(conn, s, b, held);
  notify_output(conn);
}

void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message) {
  embps__h2conn_t *conn;
  embps__h2stream_t *s;
  count_handled(call, status == EMBPS_OK ? EMBPS_UNKNOWN : status, 0);
  int streamed = call->body != NULL;
  s = call_finish(call, &conn);
  if (!s)
    return;
  if (status == EMBPS_OK)
    status = EMBPS_UNKNOWN; /* the contract forbids OK here; never send a bodiless success */
  s->state = EMBPS__H2S_ANSWERED;
  count_error(conn);
  if (streamed) {
    /* The HEADERS are out: the status goes in trailers after what was sent (read_cb). Without
     * memory for the message, the status alone still says it failed. */
    s->fail_status = status;
    s->fail_message = embps_strdup(message ? message : "");
    resume(conn, s);
  } else {
    embps__grpc_submit_status(conn, s->id, 200, status, message);
  }
  notify_output(conn);
}

const char *embps_net_call_authorization(const embps_net_call_t *call) {
  return call->stream ? call->stream->authorization : NULL;
}

int embps_net_call_cancelled(const embps_net_call_t *call) {
  return call->cancelled || !call->conn || !call->stream;
}

int embps_net_call_conn_shared(const embps_net_call_t *call) {
  const embps__h2conn_t *conn = call->conn;
  return conn && (conn->nstreams > 1 || conn->unsent_bodies > conn->deferred_bodies);
}
