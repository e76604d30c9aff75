/* The call API of the server's HTTP/2 core: what the layer above (the service) uses to answer
 * the requests the core delivers (net.h's embps_net_call_*), and the calls' metrics.
 *
 * A call is a small object of its own, separate from its stream, so that it outlives its stream
 * and its connection: when either goes (the client resets the stream, the connection closes),
 * the call is marked cancelled and detached, and its answer is dropped (releasing the body)
 * instead of touching freed memory. An answer is submitted to the stream's nghttp2 session as
 * response HEADERS with a data source over the reply body (grpc_frame.c reads it out, h2out.c
 * sends it without copying), or as a trailers-only status. A streamed reply
 * (embps_net_call_reply_begin) leaves while its bytes are still being made: its data source
 * defers at the end of the bytes made so far and is resumed as more are announced.
 *
 * Replies held by a connection are counted (reply_bytes: reserved by calls, then held by their
 * streams until they close) so that embps_net_call_hold_reply can bound them. Each call is
 * counted once in the gRPC metrics (code, time, reply bytes), with the code it really ended
 * with: its answer's when the answer went out, CANCELLED when the client reset the stream or
 * closed the connection first (the answer, made or not, never reached it). The count of an
 * answered call therefore waits for its stream to close, when its trailers are sent. */
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/net/h2conn_internal.h"

/* ---- metrics ---- */

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

/* Counts one call's end: its final code, its time and (OK) the reply message's bytes. */
static void count(embps_net_metrics_t *metrics, embps_net_method_metrics_t *gm,
                  embps_status_t status, uint64_t ns, size_t reply_bytes) {
  int code = embps_status_grpc_code(status);
  if (code < 0 || code >= EMBPS_NET_GRPC_CODES)
    code = 2; /* UNKNOWN */
  atomic_fetch_add_explicit(&gm->handled[code], 1, memory_order_relaxed);
  embps_hist_observe_ns(&gm->seconds, ns);
  if (code == 0 && reply_bytes && metrics)
    atomic_fetch_add_explicit(&metrics->message_bytes_out, reply_bytes, memory_order_relaxed);
}

/* The call is answered with status (reply_bytes: its OK message's). The count moves to its
 * stream, which makes it when it closes (embps__h2call_count_close): only then is it known
 * whether the client had the answer or reset the stream first. A call whose client already left
 * was counted CANCELLED then. */
static void count_answer(embps_net_call_t *call, embps_status_t status, size_t reply_bytes) {
  embps_net_method_metrics_t *gm = call->gm;
  embps__h2stream_t *s = call->stream;
  if (!gm || !s)
    return;
  call->gm = NULL;
  s->gm = gm;
  s->answer = status;
  s->answer_ns = embps_now_ns() - call->start_ns;
  s->answer_bytes = reply_bytes;
}

void embps__h2call_count_close(embps__h2conn_t *conn, embps__h2stream_t *s) {
  embps_net_call_t *call = s->call;
  embps_net_method_metrics_t *gm = s->gm;
  if (call && call->gm) {
    /* Reset before the server answered: gRPC servers count a call their client abandoned
     * (cancelled, or gave up at its deadline) as CANCELLED, whatever they answer later. */
    count(NULL, call->gm, EMBPS_CANCELLED, embps_now_ns() - call->start_ns, 0);
    call->gm = NULL;
  }
  if (!gm)
    return;
  s->gm = NULL;
  if (s->end_sent || s->answer == EMBPS_DEADLINE_EXCEEDED)
    count(conn->hooks.metrics, gm, s->answer, s->answer_ns, s->answer_bytes);
  else
    count(NULL, gm, EMBPS_CANCELLED, s->answer_ns, 0);
}

static void notify_output(embps__h2conn_t *conn) {
  if (!conn->in_feed && conn->hooks.on_output)
    conn->hooks.on_output(conn->hooks.io_user);
}

/* ---- calls starting and ending with their connection ---- */

embps_net_call_t *embps__h2call_start(embps__h2conn_t *conn, embps__h2stream_t *s) {
  embps_net_call_t *call = embps_calloc(1, sizeof(*call));
  if (!call)
    return NULL;
  call->conn = conn;
  call->stream = s;
  call->next = conn->calls;
  if (conn->calls)
    conn->calls->prev = call;
  conn->calls = call;
  call->deadline_ns = s->deadline_ns;
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
  return call;
}

/* Runs call's cancel hook, once: its client went before it was answered. */
static void run_cancel_hook(embps_net_call_t *call) {
  void (*fn)(void *) = call->on_cancel;
  call->on_cancel = NULL;
  if (fn)
    fn(call->on_cancel_arg);
}

void embps__h2call_cancel(embps_net_call_t *call) {
  call->stream = NULL;
  call->cancelled = 1;
  run_cancel_hook(call);
}

void embps__h2call_detach_all(embps__h2conn_t *conn) {
  embps_net_call_t *next;
  for (embps_net_call_t *c = conn->calls; c; c = next) {
    next = c->next; /* the hook answers nothing, but the list is not ours to trust after it */
    if (c->gm)      /* the metrics may not outlive the connection */
      count(NULL, c->gm, EMBPS_CANCELLED, embps_now_ns() - c->start_ns, 0);
    c->gm = NULL;
    c->conn = NULL;
    c->stream = NULL;
    c->cancelled = 1;
    run_cancel_hook(c);
  }
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
                           "not yet read by the client); another %zu would pass its limit of %zu "
                           "(%d x --max-message-bytes): read the replies before asking for more, "
                           "or spread the calls over more connections",
                           conn->reply_bytes, bytes, conn->max_reply_bytes,
                           EMBPS_NET_CONNECTION_REPLY_MESSAGES);
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
  count_answer(call, EMBPS_OK, b->len);
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
  count_answer(call, len > UINT32_MAX ? EMBPS_INTERNAL : EMBPS_OK, len);
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
    s->answer = EMBPS_RESOURCE_EXHAUSTED; /* what the stream's count will say */
    s->answer_bytes = 0;
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
  count_answer(call, status == EMBPS_OK ? EMBPS_UNKNOWN : status, 0);
  int streamed = call->body != NULL;
  s = call_finish(call, &conn);
  if (!s)
    return;
  if (status == EMBPS_OK)
    status = EMBPS_UNKNOWN; /* the contract forbids OK here; never send a bodiless success */
  s->state = EMBPS__H2S_ANSWERED;
  embps__h2_count_error(conn);
  if (streamed) {
    /* The HEADERS are out: the status goes in trailers after what was sent (read_cb). Without
     * memory for the message, the status alone still says it failed. */
    s->fail_status = status;
    s->fail_message = embps_strdup(message ? message : "");
    resume(conn, s);
  } else {
    embps__grpc_submit_status(conn, s->id, 200, status, message, 0);
  }
  notify_output(conn);
}

const char *embps_net_call_authorization(const embps_net_call_t *call) {
  return call->stream ? call->stream->authorization : NULL;
}

uint64_t embps_net_call_deadline_ns(const embps_net_call_t *call) { return call->deadline_ns; }

int embps_net_call_cancelled(const embps_net_call_t *call) {
  return call->cancelled || !call->conn || !call->stream;
}

int embps_net_call_on_cancel(embps_net_call_t *call, void (*fn)(void *arg), void *arg) {
  if (embps_net_call_cancelled(call)) {
    call->on_cancel = NULL;
    return 1;
  }
  call->on_cancel = fn;
  call->on_cancel_arg = arg;
  return 0;
}

int embps_net_call_conn_shared(const embps_net_call_t *call) {
  const embps__h2conn_t *conn = call->conn;
  return conn && (conn->nstreams > 1 || conn->unsent_bodies > conn->deferred_bodies);
}
