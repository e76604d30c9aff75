/* What the files of the server's HTTP/2 core share (internal to server/net; the face is
 * h2conn.h): the connection, stream and call objects, and the functions one file offers the
 * others.
 *
 *   h2conn.c      the nghttp2 core: the session's callbacks, the connection and its streams,
 *                 receiving requests and delivering them as calls
 *   h2call.c      the call API (net.h's embps_net_call_*): answering calls, their metrics
 *   h2read.c      in-place reads: large request messages read from the socket straight into
 *                 their buffers
 *   grpc_frame.c  gRPC's framing on a stream: the length-prefixed request message in, the
 *                 length-prefixed reply and the status trailers out
 *   h2out.c       output batches: the bytes nghttp2 sends, as segments that point into reply
 *                 bodies instead of copying them */
#ifndef EMBPS_SERVER_NET_H2CONN_INTERNAL_H
#define EMBPS_SERVER_NET_H2CONN_INTERNAL_H

#include <nghttp2/nghttp2.h>
#include <stddef.h>
#include <stdint.h>

#include "common/h2frames.h"
#include "server/net/h2conn.h"

/* The gRPC message prefix: a flags byte and a 4-byte big-endian length. */
#define EMBPS__GRPC_PREFIX_LEN 5

/* A header field for nghttp2_submit_*: name a string literal, value vlen bytes at v. */
#define EMBPS__H2_NV(n, v, vlen)                                                                   \
  { (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vlen), NGHTTP2_NV_FLAG_NONE }

/* A reply body, refcounted: the stream holds one reference and every output batch that points
 * into it holds one, so release runs once the last byte is written or dropped. */
typedef struct embps__h2body {
  int refs;
  uint8_t prefix[EMBPS__GRPC_PREFIX_LEN];
  const uint8_t *data;
  size_t len;
  size_t ready; /* of data, the bytes made so far (len unless the reply is streamed) */
  int ended;    /* every byte is made and the answer is OK: the trailers may follow them */
  void (*release)(void *);
  void *release_arg;
} embps__h2body_t;

typedef enum embps__h2stream_state {
  EMBPS__H2S_RECEIVING = 0, /* headers or message still arriving */
  EMBPS__H2S_QUEUED,        /* complete, waiting for delivery at the end of feed */
  EMBPS__H2S_CALLED,        /* delivered, the handler owes an answer */
  EMBPS__H2S_ANSWERED,      /* an answer (or an error) is submitted */
} embps__h2stream_state_t;

typedef struct embps__h2stream {
  struct embps__h2stream *prev, *next;
  embps_net_call_t *call;
  int32_t id;
  embps__h2stream_state_t state;
  int receiving; /* counted in conn->receiving */
  int method_seen, method_post, ct_ok;
  int headers_out_of_memory; /* a header could not be kept: refused when the headers end */
  int authorization_bad;     /* 1: too long, 2: sent twice; refused when the headers end */
  int timeout_bad;           /* 1: grpc-timeout malformed, 2: sent twice; refused likewise */
  char timeout_text[48];     /* a malformed grpc-timeout as sent (clipped), for the refusal */
  uint64_t deadline_ns;      /* from grpc-timeout, on embps_now_ns()'s clock; 0: none */
  char encoding[32];         /* a grpc-encoding other than identity (clipped); refused */
  char *path;
  char *authorization; /* the authorization header's value, or NULL */
  char ct[64];
  char method[16];
  uint8_t hdr[EMBPS__GRPC_PREFIX_LEN];
  size_t hdr_got;
  int in_msg;
  int nmsgs;
  int rst_after_answer; /* answered early while the client may still be sending */
  uint8_t *msg;
  size_t msg_len, msg_got;
  embps__h2body_t *body;
  size_t read_off, sent_off;
  size_t reply_held;          /* bytes counted in conn->reply_bytes until the stream goes */
  int deferred;               /* its reply waits for bytes still being made (counted in conn) */
  embps_status_t fail_status; /* a streamed reply failed: its trailers carry this */
  char *fail_message;
  int end_sent; /* our END_STREAM (the trailers) went out */
  /* The call's answer, counted in the metrics when the stream closes (embps__h2call_count_close):
   * gm NULL when counted or not to be counted. */
  embps_net_method_metrics_t *gm;
  embps_status_t answer;
  uint64_t answer_ns;  /* from the request's delivery to the answer */
  size_t answer_bytes; /* the OK reply message's bytes */
} embps__h2stream_t;

struct embps_net_call {
  embps__h2conn_t *conn;     /* NULL once the connection is gone */
  embps__h2stream_t *stream; /* NULL once the stream is gone */
  struct embps_net_call *prev, *next;
  int cancelled;
  embps_net_method_metrics_t *gm; /* counts the call; NULL once counted or moved to its stream */
  uint64_t start_ns;              /* when the request was delivered */
  uint64_t deadline_ns;           /* its stream's, kept past the stream; 0: none */
  size_t reply_held;              /* embps_net_call_hold_reply's bytes, in conn->reply_bytes */
  embps__h2body_t *body;          /* a streamed reply being made: the call's reference */
  void (*on_cancel)(void *arg);   /* embps_net_call_on_cancel's; NULL once run or none */
  void *on_cancel_arg;
};

typedef struct embps__h2idq {
  int32_t *ids;
  size_t n, cap;
} embps__h2idq_t;

struct embps__h2conn {
  nghttp2_session *session;
  embps__h2conn_hooks_t hooks;
  size_t max_message_bytes;
  size_t receiving_bytes; /* buffers of messages being received on this connection */
  size_t max_reply_bytes; /* the bound on reply_bytes (embps__h2conn_set_reply_limit); 0: none */
  size_t reply_bytes;     /* replies held: being made (calls) or not yet sent (streams) */
  size_t unsent_bodies;   /* answered streams whose reply body is not yet all sent */
  size_t deferred_bodies; /* of those, streams waiting for bytes still being made */
  embps__h2stream_t *streams;
  size_t nstreams;
  size_t receiving;
  embps_net_call_t *calls;
  embps__h2idq_t deliver; /* streams complete during this feed */
  embps__h2out_t *out;    /* the batch nghttp2_session_send is filling */
  int in_feed;
  int got_preface;
  int fatal;
  /* Where the bytes fed so far stand in the client's frames (embps__h2conn_read_target): the
   * rest of the connection preface, then each frame's 9-byte header and its payload. */
  size_t preface_left;
  embps_h2_frames_t frames;
  int32_t direct_stream; /* the stream whose message last took bytes in place; 0: none */
  uint64_t direct_bytes; /* bytes read in place so far */
};

/* ---- h2conn.c ---- */

/** Counts an error answered on conn (its stats hook's errors). */
void embps__h2_count_error(embps__h2conn_t *conn);

/** Answers s early with an error (a trailers-only response), on behalf of the network layer;
 * resets it after the answer when the client may still be sending. */
void embps__h2_fail_stream(embps__h2conn_t *conn, embps__h2stream_t *s, int http_status,
                           embps_status_t status, const char *message);

/** Refuses s, whose request is compressed (a grpc-encoding other than identity, or a message
 * with the compressed flag), as embps__h2_fail_stream does with UNIMPLEMENTED and message, and
 * says in grpc-accept-encoding which encoding this server takes (identity), as the gRPC protocol
 * asks of a server that refuses one. */
void embps__h2_refuse_encoding(embps__h2conn_t *conn, embps__h2stream_t *s, const char *message);

/* ---- h2call.c ---- */

/** Starts the call of s, a stream whose request is complete: links it to conn, moves s to
 * EMBPS__H2S_CALLED and counts the request (stats, metrics). NULL when out of memory (s is then
 * unchanged). */
embps_net_call_t *embps__h2call_start(embps__h2conn_t *conn, embps__h2stream_t *s);

/** Detaches every unanswered call of conn, which is going: each is counted CANCELLED and marked
 * cancelled, its cancel hook runs (embps_net_call_on_cancel), and its later answer is dropped. */
void embps__h2call_detach_all(embps__h2conn_t *conn);

/** The unanswered call of a stream that is closing (its client reset it) is cancelled: it is
 * detached from the stream, marked cancelled and its cancel hook runs. */
void embps__h2call_cancel(embps_net_call_t *call);

/** Counts the call of s, whose stream is closing (or whose connection is going), in the
 * metrics, once: CANCELLED when it is not answered yet (the client reset the stream, or left);
 * when it is answered, with the answer's code if the answer's END_STREAM went out or the answer
 * is DEADLINE_EXCEEDED, else CANCELLED (the client never had the answer). */
void embps__h2call_count_close(embps__h2conn_t *conn, embps__h2stream_t *s);

/* ---- h2read.c ---- */

/** Walks n bytes about to be fed, keeping conn's place in the client's preface and frames (what
 * embps__h2conn_read_target decides from). */
void embps__h2read_track(embps__h2conn_t *conn, const uint8_t *p, size_t n);

/* ---- grpc_frame.c ---- */

/** The on_data_chunk_recv callback: reads a request stream's one length-prefixed message out
 * of its DATA, refusing compressed, oversized and second messages. */
int embps__grpc_on_data_chunk_recv(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                                   const uint8_t *data, size_t len, void *user);

/** A reply body of len bytes at data (borrowed until release(release_arg) runs) with its
 * message prefix, holding the stream's reference. NULL when out of memory. */
embps__h2body_t *embps__grpc_body_new(const uint8_t *data, size_t len, void (*release)(void *),
                                      void *release_arg);

/** The data source read callback of a reply (source->ptr is the stream): its prefix and body,
 * without copying them, then the trailers with grpc-status 0. A streamed reply defers
 * (NGHTTP2_ERR_DEFERRED) at the end of the bytes made so far, and ends with the failure's
 * status when it failed. */
ssize_t embps__grpc_reply_read_cb(nghttp2_session *session, int32_t stream_id, uint8_t *buf,
                                  size_t length, uint32_t *data_flags, nghttp2_data_source *source,
                                  void *user);

/** Submits a trailers-only response carrying status and message (percent-encoded), and with
 * accept_encoding a grpc-accept-encoding of identity; when nghttp2 cannot take it, resets the
 * stream instead. */
void embps__grpc_submit_status(embps__h2conn_t *conn, int32_t id, int http_status,
                               embps_status_t status, const char *message, int accept_encoding);

/** Submits the trailers of a reply whose HEADERS went out: grpc-status for status and, when it
 * is not OK, grpc-message (percent-encoded). Returns nghttp2_submit_trailer's result. */
int embps__grpc_submit_trailers(nghttp2_session *session, int32_t id, embps_status_t status,
                                const char *message);

/** Parses a grpc-timeout header value (value[0..len), not NUL-terminated) as the gRPC protocol
 * defines it: 1 to 8 ASCII digits and one unit, H (hours), M (minutes), S (seconds),
 * m (milliseconds), u (microseconds) or n (nanoseconds), nothing else. Returns 0 with *ns set
 * (saturated at UINT64_MAX), or -1 for anything else (*ns untouched). */
int embps__grpc_parse_timeout(const uint8_t *value, size_t len, uint64_t *ns);

/** The RST_STREAM code for a stream that cannot be answered because nghttp2 failed with rv. */
uint32_t embps__h2_rst_code_of(int rv);

/* ---- h2out.c ---- */

/** An empty output batch, or NULL when out of memory. */
embps__h2out_t *embps__h2out_new(void);

/** Copies len bytes into the batch as its next segment (the TLS layer's ciphertext). Returns 0,
 * or -1 when out of memory. */
int embps__h2out_copy(embps__h2out_t *out, const uint8_t *data, size_t len);

/** Drops a reference to b, releasing the body and freeing b with the last one. NULL is a
 * no-op. */
void embps__h2body_unref(embps__h2body_t *b);

/** Registers the callbacks that fill conn->out when nghttp2_session_send runs. */
void embps__h2out_set_send_callbacks(nghttp2_session_callbacks *cbs);

#endif
