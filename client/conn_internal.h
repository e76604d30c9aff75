/* What conn.c (the socket, its buffers and the poll loop) and session.c (the HTTP/2 session
 * over it and the streams it settles) share: the connection struct and the functions one offers
 * the other. Internal to libembps. */
#ifndef EMBPS_CLIENT_CONN_INTERNAL_H
#define EMBPS_CLIENT_CONN_INTERNAL_H

#include <nghttp2/nghttp2.h>
#include <openssl/ssl.h>
#include <sys/types.h>

#include "client/conn.h"
#include "common/h2frames.h"

/* A piece of the output: wbuf[off, off + len) when p is NULL, else p[0, len) in the memory of
 * stream s's caller, which stays valid until s finishes (embps__conn_out_own copies it then). */
typedef struct embps__out_piece {
  const uint8_t *p;
  size_t off, len;
  embps__stream_t *s;
} embps__out_piece_t;

struct embps__conn {
  embps__addr_t addr;
  int fd;
  SSL_CTX *tls_ctx;            /* borrowed from the client; NULL: cleartext h2c */
  const char *tls_server_name; /* borrowed; the name the server's certificate must carry */
  SSL *ssl;                    /* the TLS session on fd, when tls_ctx is set */
  nghttp2_session *session;
  int broken;
  embps_error_t why; /* why it broke (status and message), set inside callbacks and acted on
                        after them */
  uint8_t *rbuf;
  /* What waits to be written, in order: pieces of wbuf (bytes copied there) and, on a
   * cleartext connection, pieces of request bodies in the callers' memory (DATA payload sent
   * without a copy, NGHTTP2_DATA_FLAG_NO_COPY). out_i is the first piece not fully written,
   * out_off how much of it is. */
  uint8_t *wbuf;
  size_t wlen, wcap;
  embps__out_piece_t *out;
  size_t nout, out_cap, out_i, out_off;
  size_t out_bytes;           /* not yet written */
  embps__stream_t *streams;   /* attached streams */
  embps__stream_t *send_head; /* bodies not yet fully sent, in submission order */
  embps__stream_t *send_tail;
  int resume_head; /* the new send_head was deferred: resume it */
  /* The frame the next byte from the server belongs to (walked beside nghttp2 so that row bytes
   * can be read in place). */
  embps_h2_frames_t frames;
  uint64_t direct_bytes;   /* bytes read straight into a caller's buffer (tests, tuning) */
  uint64_t ref_bytes;      /* request body bytes queued by reference, not copied (likewise) */
  size_t rcvlowat;         /* the socket's SO_RCVLOWAT as last set (0: never set, the default) */
  uint64_t streams_closed; /* counts on_stream_close: a read stops when a reply completes */
};

/* ---- conn.c, for session.c ---- */

/** Queues n bytes from p, copied; -1 (the connection then fails) when memory runs out. */
int embps__conn_out_copy(embps__conn_t *c, const uint8_t *p, size_t n);

/** Queues n bytes of stream s's request body at p, not copied: p must stay valid until s
 * finishes, when embps__stream_finish copies what is still unwritten (embps__conn_out_own). */
int embps__conn_out_ref(embps__conn_t *c, const uint8_t *p, size_t n, embps__stream_t *s);

/** Copies the unwritten bytes of s's queued pieces into the connection's own buffer: after
 * this s's caller may reuse its memory. */
void embps__conn_out_own(embps__conn_t *c, embps__stream_t *s);

/** Whether request bodies may be queued by reference (cleartext: TLS copies into records). */
int embps__conn_out_by_ref(const embps__conn_t *c);

/** Sets the socket's SO_RCVLOWAT for the wait ahead: the rest of the current frame, at most
 * 1 MiB, when 64 KiB or more of it is still to come, else the default (cleartext only). */
void embps__conn_wait_for_frame(embps__conn_t *c);

/* ---- session.c ---- */

/** Creates c->session with the client callbacks, and queues SETTINGS (large windows, push
 * off) and the connection window. On failure the session may exist (the caller closes it with
 * the socket): RESOURCE_EXHAUSTED or INTERNAL. */
embps_status_t embps__session_start(embps__conn_t *c, embps_error_t *err);

/** Finishes s with st and the formatted message (first result wins) and tells its owner. */
void embps__stream_finish(embps__stream_t *s, embps_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** The HTTP/2 stream no longer refers to s: takes it off c's lists, and frees it when its owner
 * has released it. */
void embps__stream_detach(embps__conn_t *c, embps__stream_t *s);

/** Where the next n (set) bytes of DATA payload on stream_id go when they are row bytes that
 * the stream's sink copies to one place (the caller's lookup buffer): the connection may read
 * them there. NULL when they are anything else, or the stream is done or released; then *later
 * says whether later bytes of the stream may still be read in place. */
uint8_t *embps__stream_direct(nghttp2_session *session, int32_t stream_id, size_t *n, int *later);

/** The data source read callback of a request body (source->ptr is the stream): sends the
 * body's segments, deferring it until the bodies submitted before it are sent. */
ssize_t embps__stream_read_body(nghttp2_session *session, int32_t stream_id, uint8_t *buf,
                                size_t length, uint32_t *data_flags, nghttp2_data_source *source,
                                void *user_data);

#endif
