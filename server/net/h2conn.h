/* The I/O-free gRPC-over-HTTP/2 core of one server connection (internal to server/net).
 * It is fed the bytes read from the socket, hands complete unary requests to the request
 * callback, and hands out batches of output segments for the binding to write. It never
 * touches a socket, a timer or a loop, so tests drive it with an in-memory HTTP/2 client. */
#ifndef EMBPS_SERVER_NET_H2CONN_H
#define EMBPS_SERVER_NET_H2CONN_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/net/net.h"

typedef struct embps__h2conn embps__h2conn_t;
typedef struct embps__h2out embps__h2out_t;

/** One piece of output: len bytes at base, valid until its batch is freed. */
typedef struct embps__h2seg {
  const uint8_t *base;
  size_t len;
} embps__h2seg_t;

/** What a connection core reports to its owner. All pointers are borrowed. */
typedef struct embps__h2conn_hooks {
  /** Complete unary requests (same contract as embps_net_request_cb). Never called from
   * inside an nghttp2 callback: requests are delivered at the end of embps__h2conn_feed. */
  embps_net_request_cb on_request;
  void *request_user;
  /** Called when a call answered outside embps__h2conn_feed left output to send: the owner
   * should call embps__h2conn_take_output soon (it may do so from inside this callback). May be
   * NULL. */
  void (*on_output)(void *io_user);
  void *io_user;
  /** Counters to add to (requests, errors); may be NULL. Must outlive the core. */
  embps_net_stats_t *stats;
  /** Metrics to add to (gRPC calls, message bytes); may be NULL. Must outlive the core. */
  embps_net_metrics_t *metrics;
} embps__h2conn_hooks_t;

/** What the binding should do about timers. */
typedef enum embps__h2conn_phase {
  EMBPS__H2_IDLE = 0,      /* preface done, no open streams: the idle timeout applies */
  EMBPS__H2_BUSY = 1,      /* open streams, all fully received: no timeout applies */
  EMBPS__H2_RECEIVING = 2, /* preface or a request half-received: the stall timeout applies */
  EMBPS__H2_SENDING = 3,   /* a reply body not yet all sent (the peer's windows or socket hold it
                              back): the stall timeout applies, restarted by bytes written only */
} embps__h2conn_phase_t;

/**
 * Creates the core of one server connection and queues its SETTINGS (large windows, 16 MiB
 * frames). hooks is copied. On failure *out is untouched.
 * Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps__h2conn_new(embps__h2conn_t **out, size_t max_message_bytes,
                                 const embps__h2conn_hooks_t *hooks);

/** Bounds the bytes of replies the connection may hold at once (embps_net_call_hold_reply);
 * 0 (the default) leaves them unbounded. */
void embps__h2conn_set_reply_limit(embps__h2conn_t *conn, size_t max_reply_bytes);

/** Bytes of replies the connection holds now: reserved by calls not yet answered, and reply
 * bodies of streams not yet closed. */
size_t embps__h2conn_reply_bytes(const embps__h2conn_t *conn);

/** Queues a GOAWAY(NO_ERROR) naming the last stream processed and lets the session end: once
 * the output is written, embps__h2conn_want_close turns true. For closing an idle connection
 * gracefully (a gRPC client retries elsewhere what the server never started). */
void embps__h2conn_goaway(embps__h2conn_t *conn);

/**
 * Frees the core. Calls not yet answered are detached (marked cancelled; their later answers
 * are dropped and their release callbacks run). Output batches already taken stay valid and
 * must still be freed with embps__h2out_free. NULL is a no-op.
 */
void embps__h2conn_free(embps__h2conn_t *conn);

/**
 * Feeds bytes read from the peer (borrowed; copied as needed), then delivers the requests they
 * completed to on_request. Returns EMBPS_OK, or EMBPS_UNAVAILABLE when the connection is broken
 * (bad preface, protocol error): the owner should write what embps__h2conn_take_output still
 * yields (a GOAWAY when possible) and close the connection.
 */
embps_status_t embps__h2conn_feed(embps__h2conn_t *conn, const uint8_t *data, size_t len);

/**
 * Where the next read from the socket should go, for a cleartext connection. When the next
 * bytes are the body of a large request message (at least EMBPS__H2_DIRECT_MIN bytes left, in an
 * unpadded DATA frame), returns the place in that message's buffer they belong at, with *cap the
 * most bytes that belong there: the caller reads into it and feeds exactly what it read to
 * embps__h2conn_feed, which then finds the bytes in place and does not copy them. Otherwise
 * returns NULL and sets *cap to the most bytes a read into the caller's own buffer should take
 * (SIZE_MAX: no bound): while a large message is arriving, reads stop at the next frame's
 * header, so that its payload can be read in place.
 */
uint8_t *embps__h2conn_read_target(embps__h2conn_t *conn, size_t *cap);

/** Bytes embps__h2conn_read_target placed, read in place so far (for tests and profiling). */
uint64_t embps__h2conn_direct_bytes(const embps__h2conn_t *conn);

/** Messages smaller than this are read through the connection's buffer: a read per frame
 * boundary would cost more than the copy. */
#define EMBPS__H2_DIRECT_MIN (64u << 10)

/**
 * Takes the output ready now, or NULL when there is none. The caller owns the batch: write its
 * segments in order, then free it with embps__h2out_free (which releases the reply bodies it
 * references). A batch is bounded in size; call again after writing it for more.
 */
embps__h2out_t *embps__h2conn_take_output(embps__h2conn_t *conn);

/** The segments of a batch (borrowed from it); *nsegs receives their count. */
const embps__h2seg_t *embps__h2out_segs(const embps__h2out_t *out, size_t *nsegs);

/** The total number of bytes in a batch. */
size_t embps__h2out_bytes(const embps__h2out_t *out);

/** Of a batch's bytes, those of reply messages: writing them is progress on the replies, which
 * PING or SETTINGS acknowledgements are not. */
size_t embps__h2out_body_bytes(const embps__h2out_t *out);

/** Frees a batch and releases what it referenced. NULL is a no-op. */
void embps__h2out_free(embps__h2out_t *out);

/** Non-zero when the session has nothing more to read or write (GOAWAY exchanged, or a fatal
 * error) and the connection should close once the last batch is written. */
int embps__h2conn_want_close(const embps__h2conn_t *conn);

/** The timer phase the connection is in now (SENDING before RECEIVING: a peer that keeps
 * sending cannot pin replies it never reads). */
embps__h2conn_phase_t embps__h2conn_phase(const embps__h2conn_t *conn);

/**
 * Percent-encodes a grpc-message value as the gRPC spec asks (bytes outside 0x20..0x7e and
 * '%' become "%XX"). Returns a string the caller frees with embps_free, or NULL when out of
 * memory.
 */
char *embps__h2_percent_encode(const char *message);

#endif
