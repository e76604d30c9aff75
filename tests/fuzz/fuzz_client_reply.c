/* Fuzz target: the client library's reply parsing (client/session.c's HTTP/2 callbacks,
 * client/wire.c's deframer, LookupResponse parser and percent-decoding, and protobuf-c's
 * unpack of the other replies), i.e. all that libembps reads from a server.
 *
 * The first byte picks what the rest is:
 *   0  a Lookup reply's DATA as the deframer and the streaming LookupResponse parser get it,
 *      for a shard of a size and width the second byte picks, fed in pieces the third picks;
 *   1+ a server's whole byte stream, fed to a client connection (a real libembps session with
 *      no socket under it) that has sent one call; the byte picks the method, and so the
 *      reply's parser: the Lookup rows parser or the protobuf-c message of that method.
 * Checked: rows land only inside the caller's buffer (it is exactly as large as asked, so
 * AddressSanitizer sees a byte past it), a call that settles OK has its reply parsed, a failed
 * call carries a terminated message, and nothing leaks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/conn_internal.h"
#include "client/wire.h"
#include "common/alloc.h"
#include "embps/v1/embps.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

static const struct {
  const char *path;
  const ProtobufCMessageDescriptor *reply; /* NULL: the Lookup rows parser */
} methods[] = {
    {"/embps.v1.EmbeddingService/Lookup", NULL},
    {"/embps.v1.EmbeddingService/PushGradients", &embps__v1__push_gradients_response__descriptor},
    {"/embps.v1.EmbeddingService/CreateTable", &embps__v1__create_table_response__descriptor},
    {"/embps.v1.EmbeddingService/ListTables", &embps__v1__list_tables_response__descriptor},
    {"/embps.v1.EmbeddingService/GetStats", &embps__v1__get_stats_response__descriptor},
    {"/embps.v1.EmbeddingService/Checkpoint", &embps__v1__checkpoint_response__descriptor},
    {"/embps.v1.EmbeddingService/ListCheckpoints",
     &embps__v1__list_checkpoints_response__descriptor},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_response__descriptor},
};
#define NUM_METHODS (sizeof(methods) / sizeof(methods[0]))

/* The shard the Lookup parser expects: 3 tokens of 4 f32 columns, of which the caller keeps 2
 * (the third is padding), or as the selector byte varies. */
static void parser_params(uint8_t sel, size_t *dst_cap, uint64_t *rows_bytes, uint64_t *row_bytes) {
  uint64_t width = 1 + (sel & 7), tokens = (sel >> 3) & 7, kept = tokens - ((sel >> 6) & 1);
  if (tokens == 0)
    kept = 0;
  *row_bytes = width * 4;
  *rows_bytes = tokens * *row_bytes;
  *dst_cap = (size_t)(kept * *row_bytes);
}

static void fuzz_lookup_body(const uint8_t *data, size_t size) {
  embps__deframer_t d;
  embps__lookup_parser_t p;
  embps_error_t err;
  size_t dst_cap, piece;
  uint64_t rows_bytes, row_bytes;
  embps_status_t st = EMBPS_OK;

  if (size < 2)
    return;
  parser_params(data[0], &dst_cap, &rows_bytes, &row_bytes);
  piece = (size_t)data[1] + 1;
  data += 2;
  size -= 2;
  uint8_t *dst = malloc(dst_cap ? dst_cap : 1);
  embps__deframer_init(&d);
  embps__lookup_parser_init(&p, dst, dst_cap, rows_bytes, row_bytes);
  for (size_t off = 0; off < size && st == EMBPS_OK; off += piece) {
    size_t n = size - off < piece ? size - off : piece;
    st = embps__deframer_feed(&d, data + off, n, embps__lookup_parser_sink, &p, &err);
  }
  if (st == EMBPS_OK && embps__deframer_finish(&d, &err) == EMBPS_OK &&
      embps__lookup_parser_finish(&p, &err) == EMBPS_OK) {
    if (p.seen_rows ? p.rows_have != rows_bytes : rows_bytes != 0)
      abort(); /* accepted a reply without the rows the caller asked for */
  }
  free(dst);
}

static embps_status_t lookup_finish(void *arg, embps_error_t *err) {
  return embps__lookup_parser_finish(arg, err);
}

static void fuzz_session(uint8_t method, const uint8_t *data, size_t size) {
  embps__conn_t *c = embps_calloc(1, sizeof(*c));
  embps__stream_t *s = embps_calloc(1, sizeof(*s));
  embps__lookup_parser_t parser;
  uint8_t *rows = NULL;
  size_t dst_cap = 0;
  uint64_t rows_bytes, row_bytes;
  embps_error_t err;
  const uint8_t *out;
  const ProtobufCMessageDescriptor *desc = methods[method % NUM_METHODS].reply;

  if (!c || !s)
    goto exit;
  c->fd = -1;
  snprintf(c->addr.host, sizeof(c->addr.host), "fuzz");
  snprintf(c->addr.port, sizeof(c->addr.port), "1");
  snprintf(c->addr.authority, sizeof(c->addr.authority), "fuzz:1");
  if (embps__session_start(c, &err) != EMBPS_OK)
    goto exit;
  s->path = methods[method % NUM_METHODS].path;
  s->timeout_ms = 1000;
  s->segs[0] = (embps__seg_t){NULL, 12}; /* the request: 12 zero bytes */
  s->nsegs = 1;
  if (!desc) {
    parser_params((uint8_t)(method / NUM_METHODS), &dst_cap, &rows_bytes, &row_bytes);
    rows = malloc(dst_cap ? dst_cap : 1);
    embps__lookup_parser_init(&parser, rows, dst_cap, rows_bytes, row_bytes);
    s->sink = embps__lookup_parser_sink;
    s->sink_finish = lookup_finish; /* as client/batch.c's lookup_finish */
    s->sink_arg = &parser;
  }
  if (embps__conn_submit(c, s, 1000, &err) != EMBPS_OK)
    goto exit;
  while (nghttp2_session_mem_send(c->session, &out) > 0) /* the request leaves */
    ;
  if (nghttp2_session_mem_recv(c->session, data, size) >= 0) {
    while (nghttp2_session_mem_send(c->session, &out) > 0) /* acks, window updates */
      ;
  }
  if (s->done) {
    if (strnlen(s->result.message, sizeof(s->result.message)) == sizeof(s->result.message))
      abort();
    if (s->result.status == EMBPS_OK) {
      if (desc) {
        ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, s->buf_len, s->buf);
        if (m)
          protobuf_c_message_free_unpacked(m, NULL);
      } else if (parser.seen_rows ? parser.rows_have != rows_bytes : rows_bytes != 0) {
        abort(); /* settled OK without the rows the caller asked for */
      }
    }
  }
  embps__stream_release(s); /* frees it, or leaves it to the connection while attached */
  s = NULL;
exit:
  if (s && !s->attached)
    embps_free(s);
  if (c)
    embps__conn_free(c);
  free(rows);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  if (data[0] == 0)
    fuzz_lookup_body(data + 1, size - 1);
  else
    fuzz_session((uint8_t)(data[0] - 1), data + 1, size - 1);
  return 0;
}
