/* The client transport: one HTTP/2 cleartext connection per server, gRPC unary calls as
 * streams on it, I/O driven by poll() in the calling thread. Internal to libembps. */
#ifndef EMBPS_CLIENT_CONN_H
#define EMBPS_CLIENT_CONN_H

#include <openssl/ssl.h>
#include <stddef.h>
#include <stdint.h>

#include "client/group.h"
#include "client/wire.h"
#include "common/status.h"

typedef struct embps__conn embps__conn_t;
typedef struct embps__stream embps__stream_t;

/** A piece of a request body: len bytes at p, or len zero bytes when p is NULL. */
typedef struct embps__seg {
  const uint8_t *p;
  uint64_t len;
} embps__seg_t;

#define EMBPS__MAX_SEGS 8

/** Where the sink would copy its next n bytes, when it copies them to one place (see
 * embps__lookup_parser_direct); NULL otherwise. */
typedef uint8_t *(*embps__sink_direct)(void *arg, size_t *n);

/** Called when the body is complete and grpc-status is OK; returns the final status. */
typedef embps_status_t (*embps__sink_finish)(void *arg, embps_error_t *err);

/** One gRPC call on one connection. The owner (call.c) fills the request part, submits it
 * with embps__conn_submit(), learns of completion through on_done, and gives it up with
 * embps__stream_release(), which frees it now or, while the HTTP/2 stream is still open,
 * resets the stream and lets the connection free it when it closes. */
struct embps__stream {
  /* request, set before submit */
  const char *path;          /* "/embps.v1.EmbeddingService/Lookup"; static string */
  int64_t timeout_ms;        /* grpc-timeout header; 0: none */
  const char *authorization; /* authorization header ("Bearer TOKEN"), borrowed; NULL: none */
  embps__seg_t segs[EMBPS__MAX_SEGS];
  embps__seg_t *segs_more; /* NULL, or (over EMBPS__MAX_SEGS segments) all of them, owned */
  int nsegs;
  /* reply: body bytes go to sink (e.g. the LookupResponse parser) or, with sink NULL, are
   * gathered into buf for protobuf-c */
  embps__body_sink sink;
  embps__sink_finish sink_finish;
  embps__sink_direct sink_direct; /* optional: lets the connection read rows in place */
  void *sink_arg;
  uint8_t *buf;
  size_t buf_len, buf_cap;
  /* completion */
  void (*on_done)(embps__stream_t *s);
  void *user;
  int done; /* the result below is final */
  embps_error_t result;
  /* transport state, owned by conn.c */
  embps__conn_t *conn;
  int32_t id;
  int attached; /* the HTTP/2 stream still refers to this object */
  int released; /* the owner gave it up: free when detached */
  int deferred; /* the body waits for earlier requests' bodies */
  int body_sent;
  int seg_i;
  uint64_t seg_off;
  int frame_seg_i; /* where the DATA frame being sent by reference starts */
  uint64_t frame_seg_off;
  int http_status;
  int grpc_status; /* -1: not received */
  char grpc_message[512];
  embps__deframer_t deframer;
  embps__stream_t *next, *prev; /* the connection's attached streams */
  embps__stream_t *send_next;   /* the connection's queue of bodies to send, in order */
};

/** Connects to addr within timeout_ms (TCP_NODELAY, HTTP/2 preface and SETTINGS with large
 * windows and frames). With tls_ctx (borrowed; it and tls_server_name must outlive the
 * connection) every connection is TLS, its server's certificate checked against
 * tls_server_name, or addr's host when that is NULL. On success *out is a connection freed
 * with embps__conn_free(). UNAVAILABLE with "cannot connect to host:port: reason" or the TLS
 * handshake's failure; DEADLINE_EXCEEDED; RESOURCE_EXHAUSTED. */
embps_status_t embps__conn_open(embps__conn_t **out, const embps__addr_t *addr, SSL_CTX *tls_ctx,
                                const char *tls_server_name, int64_t timeout_ms,
                                embps_error_t *err);

/** Closes the connection; open streams finish with CANCELLED and released ones are freed. */
void embps__conn_free(embps__conn_t *c);

/** The address of the connection. */
const embps__addr_t *embps__conn_addr(const embps__conn_t *c);

/** Submits s (its request fields set) on c, reconnecting first (within timeout_ms) if the
 * connection was lost. On failure s is not attached: UNAVAILABLE; DEADLINE_EXCEEDED (the
 * reconnection); RESOURCE_EXHAUSTED (out of memory). */
embps_status_t embps__conn_submit(embps__conn_t *c, embps__stream_t *s, int64_t timeout_ms,
                                  embps_error_t *err);

/** Sends what can be sent on c now without waiting (call after submitting, so requests leave
 * while the caller works). A broken connection finishes its streams with UNAVAILABLE. */
void embps__conn_kick(embps__conn_t *c);

/** Finishes s with status and message now (if not already finished) and resets its HTTP/2
 * stream. Used for deadlines and cancellation. */
void embps__stream_cancel(embps__stream_t *s, embps_status_t status, const char *message);

/** Gives s up (see embps__stream_t). */
void embps__stream_release(embps__stream_t *s);

/** Moves I/O on conns for at most timeout_ms (0: do not block; -1: until something
 * happens): sends what can be sent, waits with poll(), reads and dispatches replies. Streams
 * finish through their on_done. A broken connection finishes its streams with UNAVAILABLE, or
 * RESOURCE_EXHAUSTED when it broke for want of memory. Returns the number of connections that
 * made progress, or -1 with errno set if poll() failed (ENOMEM also when the poll set could not
 * be allocated). */
int embps__conns_pump(embps__conn_t **conns, size_t n, int timeout_ms);

#endif
