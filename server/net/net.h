/* The network layer: gRPC over HTTP/2, cleartext (h2c) or TLS (embps_net_use_tls), served by
 * libuv and nghttp2 on one event-loop thread. It knows nothing of tables or protobuf messages: it
 * delivers each complete unary request (method path and message bytes) to a handler, and sends back
 * one answer per call. Every function here runs on the loop thread. */
#ifndef EMBPS_NET_H
#define EMBPS_NET_H

#include <stddef.h>
#include <stdint.h>
#include <stdatomic.h>
#include <uv.h>

#include "common/status.h"
#include "common/hist.h"

typedef struct embps_net embps_net_t;
typedef struct embps_net_call embps_net_call_t;

typedef struct embps_net_config {
  /** A gRPC message (request) larger than this is refused with RESOURCE_EXHAUSTED; it also
   * sizes the replies one connection may hold (EMBPS_NET_CONNECTION_REPLY_MESSAGES). */
  size_t max_message_bytes;
  /** A connection that sends no bytes for this long while it has a request half-received,
   * or that never completes its preface, is closed; so is one whose replies wait this long
   * without a byte of them written (its client reads none). 0 disables. */
  uint64_t stall_timeout_ms;
  /** A connection with no open streams that stays silent this long is closed, after a
   * GOAWAY(NO_ERROR). Every frame it sends, a PING too, restarts the wait. 0 disables. */
  uint64_t idle_timeout_ms;
  /** Connections beyond this are accepted and closed at once. 0: no limit. */
  uint32_t max_connections;
  /** Connections from one IP address beyond this are accepted and closed at once. 0: no
   * limit. */
  uint32_t max_connections_per_source;
} embps_net_config_t;

/** The replies one connection may hold at once (embps_net_call_hold_reply), in messages of
 * max_message_bytes: enough for a client to keep a few maximal lookups in flight, while a client
 * that reads none of its replies pins at most this many of them in server memory. With the
 * 256 MiB default of --max-message-bytes that is 1 GiB; --max-message-bytes' help names the
 * factor. */
#define EMBPS_NET_CONNECTION_REPLY_MESSAGES 4

typedef struct embps_net_stats {
  uint64_t requests;    /* complete requests delivered to the handler */
  uint64_t errors;      /* calls answered with a status other than OK (by net or handler) */
  uint64_t bytes_in;    /* bytes read from sockets */
  uint64_t bytes_out;   /* bytes written to sockets */
  uint32_t connections; /* open now */
} embps_net_stats_t;

/** Distinct method paths the gRPC metrics keep apart; calls to others count under "unknown". */
#define EMBPS_NET_METRICS_METHODS 32
/** gRPC status codes 0..16. */
#define EMBPS_NET_GRPC_CODES 17

/** One gRPC method's figures, as grpc_server_started_total, grpc_server_handled_total and
 * grpc_server_handling_seconds expose them. */
typedef struct embps_net_method_metrics {
  char service[128]; /* "embps.v1.EmbeddingService"; "unknown" for the overflow slot */
  char method[64];   /* "Lookup" */
  atomic_uint_fast64_t started;
  atomic_uint_fast64_t handled[EMBPS_NET_GRPC_CODES]; /* by the gRPC code the call ended with */
  embps_hist_t seconds;                               /* from the complete request to the answer */
} embps_net_method_metrics_t;

/**
 * The network layer's metrics: relaxed atomics written by the loop thread and read by any
 * thread (a metrics scrape) without a lock. methods[0..num_methods) are in first-seen order;
 * a slot once published (num_methods stored with release) never changes its names. The last
 * slot, methods[EMBPS_NET_METRICS_METHODS], counts the calls of every method past the limit.
 * A call counts once, with the code it ended with: its answer's once the answer is sent (or
 * when it is DEADLINE_EXCEEDED); CANCELLED when its client reset the stream or closed the
 * connection before it had the answer (counted then), whatever the server answers later.
 */
typedef struct embps_net_metrics {
  atomic_uint_fast64_t bytes_in, bytes_out;  /* socket bytes */
  atomic_uint_fast64_t connections;          /* open now */
  atomic_uint_fast64_t connections_accepted; /* since creation */
  atomic_uint_fast64_t message_bytes_in;     /* gRPC request messages delivered */
  atomic_uint_fast64_t message_bytes_out;    /* gRPC reply messages sent (OK answers) */
  atomic_size_t num_methods;
  embps_net_method_metrics_t methods[EMBPS_NET_METRICS_METHODS + 1];
} embps_net_metrics_t;

/** The layer's metrics (owned by net, valid until embps_net_free); any thread may read them. */
const embps_net_metrics_t *embps_net_metrics(const embps_net_t *net);

/**
 * Called on the loop thread for every complete unary request.
 * method: the :path, e.g. "/embps.v1.EmbeddingService/Lookup"; valid during the call only.
 * msg, len: the request message without the gRPC 5-byte prefix. The handler takes ownership of
 * msg (free it with embps_free; msg is NULL when len == 0).
 * The handler must answer the call exactly once, now or later, with embps_net_call_reply or
 * embps_net_call_fail, on the loop thread. The call stays valid until answered, even if its
 * connection goes away (the answer is then dropped).
 */
typedef void (*embps_net_request_cb)(void *user, embps_net_call_t *call, const char *method,
                                     uint8_t *msg, size_t len);

/**
 * Creates the network layer on loop. cfg is copied. On failure *out is untouched.
 * Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_net_new(embps_net_t **out, uv_loop_t *loop, const embps_net_config_t *cfg,
                             embps_net_request_cb on_request, void *user);

/**
 * Binds and listens on host:port ("127.0.0.1:7070", "[::1]:7070", "0.0.0.0:0"). Port 0 picks a
 * free port; embps_net_port tells which. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT for an
 * address that does not parse, EMBPS_UNAVAILABLE when bind/listen fails (err says why).
 */
embps_status_t embps_net_listen(embps_net_t *net, const char *host_port, embps_error_t *err);

/**
 * Serves TLS instead of cleartext HTTP/2 on the connections accepted from now on: the PEM
 * certificate chain in cert_file with the private key in key_file, TLS 1.2 or 1.3, ALPN "h2"
 * required. When client_ca_file is not NULL or empty, every client must present a certificate
 * that chains to one of its CAs (mutual TLS). The files are read now (the strings are not kept).
 * Call before embps_net_listen. Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (err names the flag
 * and the file: unreadable, not PEM, or a key that does not match the certificate);
 * EMBPS_FAILED_PRECONDITION (already listening, or TLS already set); RESOURCE_EXHAUSTED.
 */
embps_status_t embps_net_use_tls(embps_net_t *net, const char *cert_file, const char *key_file,
                                 const char *client_ca_file, embps_error_t *err);

/** The port the listener is bound to; 0 before listen. */
int embps_net_port(const embps_net_t *net);

/** Counters since creation (loop thread). */
void embps_net_get_stats(const embps_net_t *net, embps_net_stats_t *out);

/**
 * Stops listening and closes every connection. Calls not yet answered stay valid and must still
 * be answered (their answers are dropped). After the loop has run the close callbacks,
 * embps_net_free releases the rest.
 */
void embps_net_close(embps_net_t *net);

/** Stops accepting connections (closes the listener); the connections already open keep being
 * served until embps_net_close. */
void embps_net_stop_listening(embps_net_t *net);

/** Frees the network layer after embps_net_close and a turn of the loop. NULL is a no-op. */
void embps_net_free(embps_net_t *net);

/**
 * Answers a call with one message (OK status). body[0..len) is the serialized response message
 * without the gRPC prefix; the call sends it without copying and calls release(release_arg)
 * once the bytes are written or dropped (release may be NULL when body is static).
 * After this the call handle is gone.
 */
void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg);

/**
 * Starts answering a call with one message whose bytes are still being made: body[0..len) is the
 * serialized response message without the gRPC prefix, of which only the first `ready` bytes are
 * final. The response headers, the message prefix and those bytes leave at once (without
 * copying); embps_net_call_reply_ready announces more as they are made, and the call ends with
 * embps_net_call_reply_end (grpc-status 0 once every byte is out) or embps_net_call_fail (the
 * status in trailers after the bytes already sent; a client never takes the cut message for a
 * reply). Until the call ends the body stays allocated even if the client goes, so a producer on
 * another thread may keep writing into it; release(release_arg) runs once the call has ended and
 * its bytes are written or dropped. The call's reply hold (embps_net_call_hold_reply) bounds the
 * memory as for embps_net_call_reply. Returns EMBPS_OK, or (having changed nothing, so that the
 * caller still owns body and answers the call another way) EMBPS_CANCELLED when the client has
 * gone, EMBPS_INVALID_ARGUMENT when len passes 4 GiB, EMBPS_RESOURCE_EXHAUSTED when out of
 * memory, EMBPS_FAILED_PRECONDITION when the reply has already begun.
 */
embps_status_t embps_net_call_reply_begin(embps_net_call_t *call, const uint8_t *body, size_t len,
                                          size_t ready, void (*release)(void *), void *release_arg);

/** Of a reply begun with embps_net_call_reply_begin, body[0..ready) is now final (a smaller value
 * than before changes nothing; one past len counts as len). A no-op for a call whose reply has
 * not begun. */
void embps_net_call_reply_ready(embps_net_call_t *call, size_t ready);

/** Ends a reply begun with embps_net_call_reply_begin with OK: every byte of the body is final.
 * After this the call handle is gone. */
void embps_net_call_reply_end(embps_net_call_t *call);

/**
 * Answers a call with an error status and message (sent as grpc-status / grpc-message
 * trailers, the message percent-encoded). status must not be EMBPS_OK. Ends a reply begun with
 * embps_net_call_reply_begin too, after the bytes already sent. After this the call handle is
 * gone.
 */
void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message);

/**
 * Counts bytes of reply memory against the call's connection before the handler makes a reply
 * that large, so that one connection cannot make the server hold more than
 * EMBPS_NET_CONNECTION_REPLY_MESSAGES x max_message_bytes: the bytes stay counted until the reply
 * is written, its stream is reset or the connection goes (or the call is failed). A connection
 * holding nothing else always takes one reply, whatever its size. Returns EMBPS_OK;
 * EMBPS_RESOURCE_EXHAUSTED when the connection already holds replies and these bytes would pass the
 * limit (err says so, naming the flag), nothing counted; EMBPS_CANCELLED when the client has gone.
 */
embps_status_t embps_net_call_hold_reply(embps_net_call_t *call, size_t bytes, embps_error_t *err);

/** Longest authorization header a request may carry; a longer one, or a second one, is refused
 * with UNAUTHENTICATED before the handler sees the call. */
#define EMBPS_NET_MAX_AUTHORIZATION 1024

/**
 * The value of the call's `authorization` request header (NUL-terminated, at most
 * EMBPS_NET_MAX_AUTHORIZATION bytes), or NULL when it sent none. Borrowed from the call's
 * stream: read it inside the request callback, before answering.
 */
const char *embps_net_call_authorization(const embps_net_call_t *call);

/**
 * The call's deadline: when its grpc-timeout header, counted from the arrival of its headers,
 * runs out, in nanoseconds on embps_now_ns()'s clock (common/clock.h); 0 when it sent none (a
 * timeout too large for the clock reads UINT64_MAX). A call whose deadline has passed by the time
 * it is complete is answered DEADLINE_EXCEEDED without reaching the handler, and a malformed
 * grpc-timeout (not 1 to 8 digits and one of the units H, M, S, m, u, n) or a second one is
 * refused with INVALID_ARGUMENT when the headers end. Valid until the call is answered.
 */
uint64_t embps_net_call_deadline_ns(const embps_net_call_t *call);

/** Non-zero when the call's peer has gone (connection closed or stream reset). */
int embps_net_call_cancelled(const embps_net_call_t *call);

/**
 * Asks to hear when the call's client goes before the call is answered: fn(arg) then runs once,
 * on the loop thread, when the client resets the call's stream (it cancelled, or gave up at its
 * deadline) or its connection closes, while the call is still unanswered. It never runs once the
 * call is answered (answering forgets it), so arg need live only until the caller answers. fn
 * runs inside the network layer's own work on the connection: it must not answer any call (this
 * one stays valid and owed its answer, which is then dropped, as for any call whose client has
 * gone). A second call replaces fn and arg; fn NULL forgets them. Returns 0, or 1 when the call
 * is cancelled already (nothing is kept and fn never runs).
 */
int embps_net_call_on_cancel(embps_net_call_t *call, void (*fn)(void *arg), void *arg);

/** Whether the call's connection carries other calls too: another stream is open, or another
 * reply's bytes wait to be written (0 when the client has gone). A reply that could leave in
 * pieces goes whole then: the calls already overlap each other's work, and pieces would only add
 * wakeups and interleave frames (tests/bench/lookup_ab.sh, 2026-12-03: streaming with two lookups
 * of 4096 in flight on one connection ran 15-25% slower than whole replies, with one in flight
 * 30-50% faster). */
int embps_net_call_conn_shared(const embps_net_call_t *call);

#endif
