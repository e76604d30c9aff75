/* gRPC's framing on the server's HTTP/2 streams: a request stream's message is read out of its
 * DATA frames, and a reply goes out as a length-prefixed message followed by status trailers,
 * or as one trailers-only HEADERS carrying an error.
 *
 * A request stream parses its 5-byte message prefix as DATA arrives and then copies the message
 * into one buffer sized from the prefix, so a message costs one allocation and one copy
 * whatever the framing. A message whose declared length is over the limit, a compressed
 * message, a second message: each is answered at once with a trailers-only response (see
 * embps__h2_fail_stream), and the connection carries on.
 *
 * A reply's prefix lives in its body object, so the reply's DATA points at the prefix and at the
 * handler's bytes without copying either (h2out.c). grpc-message values are percent-encoded as
 * the gRPC spec asks and clipped to MESSAGE_MAX bytes before encoding.
 *
 * A request's grpc-timeout header is parsed here too (embps__grpc_parse_timeout), exactly as the
 * gRPC protocol spells it: what a stream does with it is h2conn.c's. */
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/net/h2conn_internal.h"

/* Longest grpc-message we send, before encoding. */
#define MESSAGE_MAX 2048

int embps__grpc_parse_timeout(const uint8_t *value, size_t len, uint64_t *ns) {
  uint64_t n = 0, unit;
  if (len < 2 || len > 9)
    return -1;
  for (size_t i = 0; i + 1 < len; i++) {
    if (value[i] < '0' || value[i] > '9')
      return -1;
    n = n * 10 + (uint64_t)(value[i] - '0');
  }
  switch (value[len - 1]) {
  case 'H':
    unit = UINT64_C(3600000000000);
    break;
  case 'M':
    unit = UINT64_C(60000000000);
    break;
  case 'S':
    unit = UINT64_C(1000000000);
    break;
  case 'm':
    unit = UINT64_C(1000000);
    break;
  case 'u':
    unit = UINT64_C(1000);
    break;
  case 'n':
    unit = 1;
    break;
  default:
    return -1;
  }
  /* 99999999H is about 3.6e20 ns, past 64 bits: such a timeout is as good as none, and stays
   * the largest value rather than wrapping to a small one. */
  *ns = n > UINT64_MAX / unit ? UINT64_MAX : n * unit;
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

/* The RST_STREAM code for a stream that cannot be answered because nghttp2 failed with rv:
 * ENHANCE_YOUR_CALM when it ran out of memory (gRPC clients read it as RESOURCE_EXHAUSTED),
 * INTERNAL_ERROR otherwise. */
uint32_t embps__h2_rst_code_of(int rv) {
  return rv == NGHTTP2_ERR_NOMEM ? NGHTTP2_ENHANCE_YOUR_CALM : NGHTTP2_INTERNAL_ERROR;
}

/* The grpc-status and grpc-message fields of a status: code gets its text, *enc the message
 * clipped and percent-encoded (NULL without memory: the message is then sent empty; the caller
 * frees it). */
static void status_fields(nghttp2_nv nv[2], char code[8], char **enc, embps_status_t status,
                          const char *message) {
  char clipped[MESSAGE_MAX + 1];
  snprintf(code, 8, "%d", embps_status_grpc_code(status));
  snprintf(clipped, sizeof(clipped), "%s", message ? message : "");
  *enc = embps__h2_percent_encode(clipped);
  nv[0] = (nghttp2_nv)EMBPS__H2_NV("grpc-status", code, strlen(code));
  nv[1] = (nghttp2_nv)EMBPS__H2_NV("grpc-message", *enc ? *enc : "", *enc ? strlen(*enc) : 0);
}

/* A trailers-only response is one HEADERS with END_STREAM. */
void embps__grpc_submit_status(embps__h2conn_t *conn, int32_t id, int http_status,
                               embps_status_t status, const char *message, int accept_encoding) {
  char http[8], code[8], *enc;
  snprintf(http, sizeof(http), "%d", http_status);
  nghttp2_nv nva[5] = {
      EMBPS__H2_NV(":status", http, strlen(http)),
      EMBPS__H2_NV("content-type", "application/grpc", 16),
      {0},
      {0},
      EMBPS__H2_NV("grpc-accept-encoding", "identity", 8),
  };
  status_fields(nva + 2, code, &enc, status, message);
  int rv = nghttp2_submit_response(conn->session, id, nva, accept_encoding ? 5 : 4, NULL);
  embps_free(enc);
  if (rv < 0) {
    EMBPS_ERROR("nghttp2_submit_response(stream %d): %s", id, nghttp2_strerror(rv));
    nghttp2_submit_rst_stream(conn->session, NGHTTP2_FLAG_NONE, id, embps__h2_rst_code_of(rv));
  }
}

int embps__grpc_on_data_chunk_recv(nghttp2_session *session, uint8_t flags, int32_t stream_id,
                                   const uint8_t *data, size_t len, void *user) {
  embps__h2conn_t *conn = user;
  embps__h2stream_t *s = nghttp2_session_get_stream_user_data(session, stream_id);
  while (s && s->state == EMBPS__H2S_RECEIVING && len > 0) {
    if (!s->in_msg) {
      if (s->nmsgs > 0) {
        embps__h2_fail_stream(
            conn, s, 200, EMBPS_UNIMPLEMENTED,
            "more than one request message on a unary call (client streaming is not "
            "supported)");
        return 0;
      }
      size_t take =
          EMBPS__GRPC_PREFIX_LEN - s->hdr_got < len ? EMBPS__GRPC_PREFIX_LEN - s->hdr_got : len;
      memcpy(s->hdr + s->hdr_got, data, take);
      s->hdr_got += take;
      data += take;
      len -= take;
      if (s->hdr_got < EMBPS__GRPC_PREFIX_LEN)
        return 0;
      uint64_t mlen = ((uint64_t)s->hdr[1] << 24) | ((uint64_t)s->hdr[2] << 16) |
                      ((uint64_t)s->hdr[3] << 8) | (uint64_t)s->hdr[4];
      char msg[160];
      if (s->hdr[0] == 1) {
        embps__h2_refuse_encoding(conn, s, "compressed messages are not supported");
        return 0;
      }
      if (s->hdr[0] != 0) {
        snprintf(msg, sizeof(msg), "invalid gRPC message flags 0x%02x", s->hdr[0]);
        embps__h2_fail_stream(conn, s, 200, EMBPS_INVALID_ARGUMENT, msg);
        return 0;
      }
      if (mlen > conn->max_message_bytes) {
        snprintf(msg, sizeof(msg), "received message larger than max (%llu vs. %zu)",
                 (unsigned long long)mlen, conn->max_message_bytes);
        embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
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
        embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
        return 0;
      }
      s->msg_len = (size_t)mlen;
      s->msg_got = 0;
      s->hdr_got = 0;
      if (mlen > 0) {
        s->msg = embps_malloc(s->msg_len);
        if (!s->msg) {
          snprintf(msg, sizeof(msg), "out of memory receiving a %zu-byte message", s->msg_len);
          embps__h2_fail_stream(conn, s, 200, EMBPS_RESOURCE_EXHAUSTED, msg);
          return 0;
        }
        conn->receiving_bytes += s->msg_len;
        s->in_msg = 1;
      } else {
        s->nmsgs++;
      }
    } else {
      size_t take = s->msg_len - s->msg_got < len ? s->msg_len - s->msg_got : len;
      if (data == s->msg + s->msg_got) /* read in place (embps__h2conn_read_target) */
        conn->direct_bytes += take;
      else
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

embps__h2body_t *embps__grpc_body_new(const uint8_t *data, size_t len, void (*release)(void *),
                                      void *release_arg) {
  embps__h2body_t *b = embps_malloc(sizeof(*b));
  if (!b)
    return NULL;
  b->refs = 1; /* the stream's */
  b->prefix[0] = 0;
  b->prefix[1] = (uint8_t)(len >> 24);
  b->prefix[2] = (uint8_t)(len >> 16);
  b->prefix[3] = (uint8_t)(len >> 8);
  b->prefix[4] = (uint8_t)len;
  b->data = data;
  b->len = len;
  b->ready = len;
  b->ended = 1;
  b->release = release;
  b->release_arg = release_arg;
  return b;
}

int embps__grpc_submit_trailers(nghttp2_session *session, int32_t id, embps_status_t status,
                                const char *message) {
  char code[8], *enc;
  nghttp2_nv nva[2];
  if (status == EMBPS_OK) {
    nghttp2_nv ok[] = {EMBPS__H2_NV("grpc-status", "0", 1)};
    return nghttp2_submit_trailer(session, id, ok, 1);
  }
  status_fields(nva, code, &enc, status, message);
  int rv = nghttp2_submit_trailer(session, id, nva, 2);
  embps_free(enc);
  return rv;
}

ssize_t embps__grpc_reply_read_cb(nghttp2_session *session, int32_t stream_id, uint8_t *buf,
                                  size_t length, uint32_t *data_flags, nghttp2_data_source *source,
                                  void *user) {
  embps__h2conn_t *conn = user;
  embps__h2stream_t *s = source->ptr;
  const embps__h2body_t *b = s->body;
  size_t made = EMBPS__GRPC_PREFIX_LEN + b->ready;
  *data_flags |= NGHTTP2_DATA_FLAG_NO_COPY;
  if (s->fail_status != EMBPS_OK) {
    /* A streamed reply failed after its HEADERS (and maybe part of its message) went out: the
     * trailers say so, and a client never takes the cut message for a reply. */
    *data_flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    if (embps__grpc_submit_trailers(session, stream_id, s->fail_status, s->fail_message) < 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    return 0;
  }
  if (s->read_off == made && !b->ended) {
    /* The rest is still being made: embps_net_call_reply_ready resumes the stream. */
    if (!s->deferred) {
      s->deferred = 1;
      conn->deferred_bodies++;
    }
    return NGHTTP2_ERR_DEFERRED;
  }
  size_t n = made - s->read_off < length ? made - s->read_off : length;
  s->read_off += n;
  if (b->ended && s->read_off == made) {
    *data_flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
    if (embps__grpc_submit_trailers(session, stream_id, EMBPS_OK, NULL) < 0)
      return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  }
  return (ssize_t)n;
}
