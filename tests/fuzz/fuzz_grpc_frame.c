/* Fuzz target: gRPC's message framing on a request stream (server/net/grpc_frame.c) and the
 * grpc-message encoding, with the HTTP/2 around them always well formed.
 *
 * An in-memory HTTP/2 client (tests/unit/net/h2client.h) opens one call to the server's
 * connection core and sends the input's body (everything after two control bytes) as the
 * request's DATA, cut into frames of a size the first byte picks; the second byte picks
 * whether the call's path is known. The core's verdict is checked against the gRPC spec: the
 * call is delivered exactly when the body is one uncompressed length-prefixed message no longer
 * than the limit, with that message's bytes; the echoed reply comes back byte for byte; and
 * every call ends with a grpc-status. The body also goes, as a string, through the server's
 * percent-encoding and the client library's decoding, which must give it back unchanged. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client/wire.h"
#include "common/alloc.h"
#include "server/net/h2conn.h"
#include "tests/unit/net/h2client.h"

#define MAX_MESSAGE 2048

typedef struct fuzz_server {
  int ncalls;
  uint8_t *msg; /* the delivered message (copy) */
  size_t len;
} fuzz_server_t;

static void on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                       size_t len) {
  fuzz_server_t *sv = user;
  (void)method;
  sv->ncalls++;
  free(sv->msg);
  sv->msg = malloc(len ? len : 1);
  if (len)
    memcpy(sv->msg, msg, len);
  sv->len = len;
  embps_net_call_reply(call, msg, len, embps_free, msg);
}

/* Moves bytes both ways until neither side has more to say (bounded). */
static void pump(h2c_t *c, embps__h2conn_t *conn) {
  for (int round = 0; round < 10000; round++) {
    int moved = 0;
    const uint8_t *p;
    ssize_t n;
    while ((n = nghttp2_session_mem_send(c->session, &p)) > 0) {
      moved = 1;
      if (embps__h2conn_feed(conn, p, (size_t)n) != EMBPS_OK)
        return;
    }
    embps__h2out_t *out;
    while ((out = embps__h2conn_take_output(conn)) != NULL) {
      size_t nsegs;
      const embps__h2seg_t *segs = embps__h2out_segs(out, &nsegs);
      for (size_t i = 0; i < nsegs; i++) {
        moved = 1;
        if (nghttp2_session_mem_recv(c->session, segs[i].base, segs[i].len) < 0) {
          embps__h2out_free(out);
          return;
        }
      }
      embps__h2out_free(out);
    }
    if (!moved)
      return;
  }
  abort(); /* a call that never settles */
}

static void check_percent_round_trip(const uint8_t *data, size_t size) {
  char text[512], back[3 * sizeof(text) + 1];
  size_t n = size < sizeof(text) - 1 ? size : sizeof(text) - 1;
  memcpy(text, data, n);
  text[n] = '\0';
  char *enc = embps__h2_percent_encode(text);
  if (!enc)
    return;
  for (const char *q = enc; *q; q++)
    if (*q < 0x20 || *q > 0x7e)
      abort(); /* grpc-message must be printable ASCII */
  size_t m = embps__percent_decode(back, enc, strlen(enc));
  if (m != strlen(text) || strcmp(back, text) != 0)
    abort();
  embps_free(enc);
}

/* 1 when body is exactly one uncompressed gRPC message of at most MAX_MESSAGE bytes. */
static int one_message(const uint8_t *body, size_t len) {
  if (len < 5 || body[0] != 0)
    return 0;
  uint64_t n =
      ((uint64_t)body[1] << 24) | ((uint64_t)body[2] << 16) | ((uint64_t)body[3] << 8) | body[4];
  return n <= MAX_MESSAGE && n + 5 == len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_server_t sv = {0};
  embps__h2conn_hooks_t hooks = {.on_request = on_request, .request_user = &sv};
  embps__h2conn_t *conn;
  h2c_t c;

  if (size < 2)
    return 0;
  size_t chunk = data[0] == 0 ? 0 : data[0];
  const char *path = (data[1] & 1) ? "/embps.v1.EmbeddingService/Lookup" : "/fuzz.Unknown/Call";
  const uint8_t *body = data + 2;
  size_t len = size - 2;

  check_percent_round_trip(body, len);
  if (embps__h2conn_new(&conn, MAX_MESSAGE, &hooks) != EMBPS_OK)
    return 0;
  h2c_init(&c, data[1] & 2);
  h2c_stream_t *st = h2c_request(&c, path, "application/grpc", len ? body : NULL, len, chunk, len);
  if (!st)
    abort();
  pump(&c, conn);
  if (one_message(body, len)) {
    size_t mlen = 0;
    const uint8_t *echo = h2c_message(st, &mlen);
    if (sv.ncalls != 1 || sv.len != len - 5 || memcmp(sv.msg, body + 5, sv.len) != 0)
      abort(); /* a well-formed message was not delivered as sent */
    if (!st->closed || st->grpc_status != 0 || !echo || mlen != sv.len ||
        memcmp(echo, body + 5, mlen) != 0)
      abort(); /* its reply did not come back as sent */
  } else {
    if (sv.ncalls != 0)
      abort(); /* a malformed body was delivered */
    if (!st->closed || (st->grpc_status <= 0 && st->close_error == 0))
      abort(); /* refused without a status */
  }
  h2c_free(&c);
  embps__h2conn_free(conn);
  free(sv.msg);
  return 0;
}
