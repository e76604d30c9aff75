/* The gRPC/HTTP2 core of one server connection, free of I/O: the nghttp2 session, its streams
 * and the connection's life.
 *
 * An nghttp2 server session does the HTTP/2 framing; this module adds gRPC unary semantics on
 * top: it follows each request stream from its headers to its answer and hands complete calls
 * to the request callback. Received bytes go in through embps__h2conn_feed
 * (nghttp2_session_mem_recv); a stream's message is read out of its DATA by grpc_frame.c, in
 * place when it is large (h2read.c). A wrong method or content-type, a grpc-encoding other than
 * identity (with grpc-accept-encoding: identity, as the gRPC protocol asks), or a malformed
 * grpc-timeout, is answered at once with a trailers-only response (and a RST_STREAM(NO_ERROR)
 * once it is sent, when the client is still sending), and the connection carries on. Requests
 * whose stream ended with exactly one message are queued and handed to the request callback only
 * after mem_recv returns, so a handler never runs inside an nghttp2 callback and may answer
 * synchronously; one whose grpc-timeout has run out by then is answered DEADLINE_EXCEEDED
 * instead. The calls it hands over, and their answers, are h2call.c's; output leaves as batches
 * of segments (h2out.c).
 *
 * Windows: we advertise SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1 and raise the connection window to
 * the same, and accept 16 MiB-1 frames, so a client never stalls on our flow control. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/alloc.h"
#include "common/clock.h"
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

void embps__h2_count_error(embps__h2conn_t *conn) {
  if (conn->hooks.stats)
    conn->hooks.stats->errors++;
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
static void fail_stream(embps__h2conn_t *conn, embps__h2stream_t *s, int http_status,
                        embps_status_t status, const char *message, int accept_encoding) {
  int was_receiving = s->state == EMBPS__H2S_RECEIVING;
  stop_receiving(conn, s);
  s->state = EMBPS__H2S_ANSWERED;
  s->in_msg = 0;
  drop_msg(conn, s);
  embps__h2_count_error(conn);
  /* The reset must wait until the HEADERS are out: nghttp2 drops frames queued for a stream
   * after a RST_STREAM. See on_frame_send. */
  s->rst_after_answer = was_receiving;
  embps__grpc_submit_status(conn, s->id, http_status, status, message, accept_encoding);
}

void embps__h2_fail_stream(embps__h2conn_t *conn, embps__h2stream_t *s, int http_status,
                           embps_status_t status, const char *message) {
  fail_stream(conn, s, http_status, status, message, 0);
}

void embps__h2_refuse_encoding(embps__h2conn_t *conn, embps__h2stream_t *s, const char *message) {
  fail_stream(conn, s, 200, EMBPS_UNIMPLEMENTED, message, 1);
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

/* The grpc-timeout header: the call's deadline counts from now, when its headers arrive (as
 * gRPC's servers count it). A malformed or repeated one is remembered and refused once the
 * headers end, before anything else happens to the call. */
static void read_timeout(embps__h2stream_t *s, const uint8_t *value, size_t valuelen) {
  uint64_t ns, now;
  if (s->timeout_bad)
    return;
  if (s->deadline_ns) {
    s->timeout_bad = 2;
    return;
  }
  if (embps__grpc_parse_timeout(value, valuelen, &ns) != 0) {
    s->timeout_bad = 1;
    snprintf(s->timeout_text, sizeof(s->timeout_text), "%.*s%s",
             (int)(valuelen < 40 ? valuelen : 40), (const char *)value, valuelen > 40 ? "..." : "");
    return;
  }
  now = embps_now_ns();
  s->deadline_ns = ns > UINT64_MAX - now ? UINT64_MAX : now + ns;
  if (s->deadline_ns == 0) /* 0 means none; a clock at 0 is not one to worry about */
    s->deadline_ns = 1;
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
  } else if (namelen == 13 && memcmp(name, "grpc-encoding", 13) == 0) {
    /* Only identity is decoded; any other encoding is refused when the headers end. */
    if (valuelen > 0 && !(valuelen == 8 && memcmp(value, "identity", 8) == 0))
      snprintf(s->encoding, sizeof(s->encoding), "%.*s", (int)valuelen, (const char *)value);
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
  } else if (namelen == 12 && memcmp(name, "grpc-timeout", 12) == 0) {
    read_timeout(s, value, valuelen);
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
  } else if (s->timeout_bad == 1) {
    snprintf(msg, sizeof(msg),
             "malformed grpc-timeout header '%s': expected 1 to 8 digits and a unit H, M, S, m, "
             "u or n",
             s->timeout_text);
    embps__h2_fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT, msg);
  } else if (s->timeout_bad == 2) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT,
                          "more than one grpc-timeout header: send one");
  } else if (s->authorization_bad == 1) {
    snprintf(msg, sizeof(msg), "the authorization metadata is longer than %d bytes",
             EMBPS_NET_MAX_AUTHORIZATION);
    embps__h2_fail_stream(conn, s, 200, EMBPS_UNAUTHENTICATED, msg);
  } else if (s->authorization_bad == 2) {
    embps__h2_fail_stream(conn, s, 200, EMBPS_UNAUTHENTICATED,
                          "more than one authorization header: send one 'Bearer TOKEN'");
  } else if (s->encoding[0]) {
    snprintf(msg, sizeof(msg),
             "grpc-encoding '%s' is not supported: this server takes identity (uncompressed) "
             "messages only",
             s->encoding);
    embps__h2_refuse_encoding(conn, s, msg);
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
  embps__h2call_count_close(conn, s);
  if (s->call) /* unanswered: its client reset the stream */
    embps__h2call_cancel(s->call);
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
  if (s)
    s->end_sent = 1;
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
  embps__h2call_detach_all(conn);
  /* nghttp2_session_del runs no callbacks, so our streams are freed here. */
  nghttp2_session_del(conn->session);
  while (conn->streams) {
    embps__h2stream_t *s = conn->streams;
    conn->streams = s->next;
    embps__h2call_count_close(conn, s);
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
    embps_net_call_t *call = embps__h2call_start(conn, s);
    if (!call) {
      embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED,
                            "out of memory starting the call");
      continue;
    }
    uint8_t *msg = s->msg;
    if (msg)
      conn->receiving_bytes -= s->msg_len;
    s->msg = NULL;
    if (call->deadline_ns && embps_now_ns() >= call->deadline_ns) {
      /* Its caller has given up already: nothing of it is worth starting. */
      embps_free(msg);
      embps_net_call_fail(call, EMBPS_DEADLINE_EXCEEDED,
                          "the call's deadline (grpc-timeout) passed before it reached the server");
      continue;
    }
    conn->hooks.on_request(conn->hooks.request_user, call, s->path, msg, s->msg_len);
  }
  conn->deliver.n = 0;
}

embps_status_t embps__h2conn_feed(embps__h2conn_t *conn, const uint8_t *data, size_t len) {
  if (conn->fatal)
    return EMBPS_UNAVAILABLE;
  embps__h2read_track(conn, data, len);
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
