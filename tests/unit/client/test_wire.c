/* client/wire.c: the streaming LookupResponse parser (fields in any order, split at every
 * byte, wrong sizes rejected), gRPC deframing, request encoding, percent-decoding and
 * grpc-timeout. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "client/wire.h"
#include "embps/v1/embps.pb-c.h"

/* A hand-built protobuf message. */
typedef struct msg {
  uint8_t b[8192];
  size_t n;
} msg_t;

static void put_varint(msg_t *m, uint64_t v) { m->n += embps_varint_put(m->b + m->n, v); }
static void put_key(msg_t *m, unsigned field, unsigned wt) { put_varint(m, field << 3 | wt); }
static void put_vfield(msg_t *m, unsigned field, uint64_t v) {
  put_key(m, field, 0);
  put_varint(m, v);
}
static void put_bytes(msg_t *m, unsigned field, const void *p, size_t len) {
  put_key(m, field, 2);
  put_varint(m, len);
  memcpy(m->b + m->n, p, len);
  m->n += len;
}

#define W 4
#define TOKENS 3
#define ROW_BYTES (W * 4)

static float rows[TOKENS * W];

static void fill_rows(void) {
  for (int i = 0; i < TOKENS * W; i++)
    rows[i] = (float)i * 1.5f + 0.25f;
}

/* The parser run over m fed as [0, cut) then [cut, n); returns the finish status. */
static embps_status_t run_split(const msg_t *m, size_t cut, uint8_t *dst, size_t cap,
                                embps__lookup_parser_t *p, embps_error_t *err) {
  embps__lookup_parser_init(p, dst, cap, TOKENS * ROW_BYTES, ROW_BYTES);
  embps_status_t st = embps__lookup_parser_feed(p, m->b, cut, err);
  if (st != EMBPS_OK)
    return st;
  st = embps__lookup_parser_feed(p, m->b + cut, m->n - cut, err);
  if (st != EMBPS_OK)
    return st;
  return embps__lookup_parser_finish(p, err);
}

static void check_all_splits(const msg_t *m, uint64_t batch_id, uint32_t shard) {
  for (size_t cut = 0; cut <= m->n; cut++) {
    uint8_t dst[TOKENS * ROW_BYTES + 8];
    embps__lookup_parser_t p;
    embps_error_t err;
    memset(dst, 0xab, sizeof(dst));
    embps_error_clear(&err);
    assert_int_equal(run_split(m, cut, dst, TOKENS * ROW_BYTES, &p, &err), EMBPS_OK);
    assert_memory_equal(dst, rows, sizeof(rows));
    for (size_t i = TOKENS * ROW_BYTES; i < sizeof(dst); i++)
      assert_int_equal(dst[i], 0xab); /* nothing written past the buffer */
    assert_int_equal(p.batch_id, batch_id);
    assert_int_equal(p.shard_index, shard);
    assert_int_equal(p.emb_width, W);
    assert_int_equal(p.dtype, 1);
  }
  /* byte by byte */
  {
    uint8_t dst[TOKENS * ROW_BYTES];
    embps__lookup_parser_t p;
    embps_error_t err;
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    for (size_t i = 0; i < m->n; i++)
      assert_int_equal(embps__lookup_parser_feed(&p, m->b + i, 1, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_OK);
    assert_memory_equal(dst, rows, sizeof(rows));
  }
}

static void test_protobuf_c_encoding(void **state) {
  Embps__V1__LookupResponse r = EMBPS__V1__LOOKUP_RESPONSE__INIT;
  msg_t m;
  (void)state;
  fill_rows();
  r.batch_id = 0x123456789abcull;
  r.shard_index = 3;
  r.emb_width = W;
  r.dtype = EMBPS__V1__DTYPE__DTYPE_F32;
  r.rows.data = (uint8_t *)rows;
  r.rows.len = sizeof(rows);
  m.n = embps__v1__lookup_response__pack(&r, m.b);
  check_all_splits(&m, 0x123456789abcull, 3);
}

static void test_any_order_unknown_and_repeated(void **state) {
  msg_t m = {.n = 0};
  float junk[TOKENS * W];
  uint8_t unknown[5] = {1, 2, 3, 4, 5};
  (void)state;
  fill_rows();
  memset(junk, 0x55, sizeof(junk));
  /* rows first (then again: last one wins), scalars after, unknown fields of every wire type
   * in between, and a scalar repeated (last one wins). */
  put_bytes(&m, 5, junk, sizeof(junk));
  put_vfield(&m, 99, 123456789); /* unknown varint */
  put_key(&m, 17, 1);            /* unknown fixed64 */
  memset(m.b + m.n, 0xff, 8);
  m.n += 8;
  put_key(&m, 18, 5); /* unknown fixed32 */
  memset(m.b + m.n, 0xee, 4);
  m.n += 4;
  put_bytes(&m, 1000, unknown, sizeof(unknown)); /* unknown bytes */
  put_vfield(&m, 4, 1);
  put_vfield(&m, 1, 7);
  put_bytes(&m, 5, rows, sizeof(rows));
  put_vfield(&m, 3, W);
  put_vfield(&m, 2, 1);
  put_vfield(&m, 1, 42);
  check_all_splits(&m, 42, 1);
}

static void test_wrong_sizes_rejected(void **state) {
  uint8_t dst[TOKENS * ROW_BYTES];
  embps__lookup_parser_t p;
  embps_error_t err;
  (void)state;
  fill_rows();
  /* one row short: INVALID_ARGUMENT, nothing copied */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 3, W);
    put_vfield(&m, 4, 1);
    put_bytes(&m, 5, rows, sizeof(rows) - ROW_BYTES);
    memset(dst, 0, sizeof(dst));
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_INVALID_ARGUMENT);
    assert_non_null(strstr(err.message, "32 bytes of rows for 3 tokens, expected 48"));
    for (size_t i = 0; i < sizeof(dst); i++)
      assert_int_equal(dst[i], 0);
  }
  /* the table's rows (emb_width 4 f32 = 16 bytes) do not match the caller's 8 bytes per row */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 3, W);
    put_vfield(&m, 4, 1);
    put_bytes(&m, 5, rows, 24);
    embps__lookup_parser_init(&p, dst, 24, 24, 8);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_INVALID_ARGUMENT);
    assert_non_null(strstr(err.message, "emb_width=4"));
  }
  /* bf16 table: emb_width 8 x 2 bytes = 16 bytes per row is accepted */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 3, 8);
    put_vfield(&m, 4, 2);
    put_bytes(&m, 5, rows, sizeof(rows));
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_OK);
  }
  /* rows missing */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 3, W);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_OK);
    assert_int_not_equal(embps__lookup_parser_finish(&p, &err), EMBPS_OK);
  }
  /* zero tokens, no rows field: fine */
  {
    embps__lookup_parser_init(&p, dst, 0, 0, ROW_BYTES);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_OK);
  }
}

static void test_malformed(void **state) {
  uint8_t dst[TOKENS * ROW_BYTES];
  embps__lookup_parser_t p;
  embps_error_t err;
  (void)state;
  fill_rows();
  /* truncated inside rows */
  {
    msg_t m = {.n = 0};
    put_bytes(&m, 5, rows, sizeof(rows));
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n - 1, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_INTERNAL);
  }
  /* truncated inside a varint */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 1, 1u << 20);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n - 1, &err), EMBPS_OK);
    assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_INTERNAL);
  }
  /* rows with a varint wire type */
  {
    msg_t m = {.n = 0};
    put_vfield(&m, 5, 3);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_INTERNAL);
  }
  /* emb_width as bytes */
  {
    msg_t m = {.n = 0};
    put_bytes(&m, 3, "ab", 2);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, m.b, m.n, &err), EMBPS_INTERNAL);
  }
  /* field number 0, group wire type, 11-byte varint */
  {
    uint8_t zero[] = {0x00, 0x01};
    uint8_t group[] = {(9 << 3) | 3};
    uint8_t longv[] = {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, zero, sizeof(zero), &err), EMBPS_INTERNAL);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, group, sizeof(group), &err), EMBPS_INTERNAL);
    embps__lookup_parser_init(&p, dst, sizeof(dst), sizeof(dst), ROW_BYTES);
    assert_int_equal(embps__lookup_parser_feed(&p, longv, sizeof(longv), &err), EMBPS_INTERNAL);
  }
}

/* Padding: the shard's rows extend past the caller's buffer; only dst_cap bytes are kept. */
static void test_capacity_drops_padding_rows(void **state) {
  msg_t m = {.n = 0};
  uint8_t dst[ROW_BYTES + 4];
  embps__lookup_parser_t p;
  embps_error_t err;
  (void)state;
  fill_rows();
  put_bytes(&m, 5, rows, sizeof(rows));
  memset(dst, 0xcd, sizeof(dst));
  embps__lookup_parser_init(&p, dst, ROW_BYTES, sizeof(rows), ROW_BYTES);
  for (size_t i = 0; i < m.n; i++)
    assert_int_equal(embps__lookup_parser_feed(&p, m.b + i, 1, &err), EMBPS_OK);
  assert_int_equal(embps__lookup_parser_finish(&p, &err), EMBPS_OK);
  assert_memory_equal(dst, rows, ROW_BYTES);
  for (size_t i = ROW_BYTES; i < sizeof(dst); i++)
    assert_int_equal(dst[i], 0xcd);
}

/* ---- deframer ---- */

typedef struct collect {
  uint8_t b[256];
  size_t n;
} collect_t;

static embps_status_t collect_sink(void *arg, const uint8_t *p, size_t n, embps_error_t *err) {
  collect_t *c = arg;
  (void)err;
  memcpy(c->b + c->n, p, n);
  c->n += n;
  return EMBPS_OK;
}

static void test_deframer(void **state) {
  uint8_t frame[5 + 10];
  embps_error_t err;
  (void)state;
  embps__grpc_prefix(frame, 10);
  assert_memory_equal(frame, "\x00\x00\x00\x00\x0a", 5);
  for (int i = 0; i < 10; i++)
    frame[5 + i] = (uint8_t)(i + 1);
  for (size_t cut = 0; cut <= sizeof(frame); cut++) {
    embps__deframer_t d;
    collect_t c = {.n = 0};
    embps__deframer_init(&d);
    assert_int_equal(embps__deframer_finish(&d, &err), EMBPS_INTERNAL); /* no message yet */
    assert_int_equal(embps__deframer_feed(&d, frame, cut, collect_sink, &c, &err), EMBPS_OK);
    if (cut < sizeof(frame))
      assert_int_equal(embps__deframer_finish(&d, &err), EMBPS_INTERNAL);
    assert_int_equal(
        embps__deframer_feed(&d, frame + cut, sizeof(frame) - cut, collect_sink, &c, &err),
        EMBPS_OK);
    assert_int_equal(embps__deframer_finish(&d, &err), EMBPS_OK);
    assert_int_equal(c.n, 10);
    assert_memory_equal(c.b, frame + 5, 10);
    /* a second message is refused */
    assert_int_equal(embps__deframer_feed(&d, frame, 1, collect_sink, &c, &err), EMBPS_INTERNAL);
  }
  {
    embps__deframer_t d;
    collect_t c = {.n = 0};
    uint8_t compressed[5] = {1, 0, 0, 0, 0};
    uint8_t empty[5] = {0, 0, 0, 0, 0};
    embps__deframer_init(&d);
    assert_int_equal(embps__deframer_feed(&d, compressed, 5, collect_sink, &c, &err),
                     EMBPS_INTERNAL);
    embps__deframer_init(&d);
    assert_int_equal(embps__deframer_feed(&d, empty, 5, collect_sink, &c, &err), EMBPS_OK);
    assert_int_equal(embps__deframer_finish(&d, &err), EMBPS_OK); /* an all-default message */
    assert_int_equal(c.n, 0);
  }
}

/* ---- request encoding ---- */

static void test_request_encoding(void **state) {
  embps__batch_fields_t f;
  embps__batch_frame_t fr;
  embps_error_t err;
  int64_t tokens[3] = {5, -1, 1ll << 40};
  float grads[6] = {1, 2, 3, 4, 5, 6};
  uint8_t buf[512];
  size_t n = 0;
  (void)state;

  memset(&f, 0, sizeof(f));
  f.table = "emb";
  f.batch_id = (1ull << 40) + 9;
  f.shard_index = 2;
  f.shard_count = 4;
  f.tokens_per_batch = 12;
  f.tokens_bytes = sizeof(tokens);
  f.is_push = 1;
  f.dtype = 1;
  f.grads_bytes = sizeof(grads);
  f.mode = 1;
  f.client_id = UINT64_MAX - 6; /* the longest varint */
  f.digest = UINT64_MAX - 1;    /* fixed64, little-endian */
  f.attempt = UINT32_MAX;       /* the longest attempt: the tail's room is enough */
  assert_int_equal(embps__batch_frame_build(&fr, &f, &err), EMBPS_OK);
#define APPEND(p, len)                                                                             \
  do {                                                                                             \
    memcpy(buf + n, p, len);                                                                       \
    n += len;                                                                                      \
  } while (0)
  APPEND(fr.head, fr.head_len);
  APPEND(tokens, sizeof(tokens));
  APPEND(fr.mid, fr.mid_len);
  APPEND(grads, sizeof(grads));
  APPEND(fr.tail, fr.tail_len);
  assert_int_equal(n, fr.total);
  assert_int_equal(buf[0], 0);
  assert_int_equal(((uint32_t)buf[1] << 24 | buf[2] << 16 | buf[3] << 8 | buf[4]), n - 5);
  {
    Embps__V1__PushGradientsRequest *r =
        embps__v1__push_gradients_request__unpack(NULL, n - 5, buf + 5);
    assert_non_null(r);
    assert_string_equal(r->table, "emb");
    assert_true(r->batch_id == (1ull << 40) + 9);
    assert_int_equal(r->shard_index, 2);
    assert_int_equal(r->shard_count, 4);
    assert_int_equal(r->tokens_per_batch, 12);
    assert_int_equal(r->tokens.len, sizeof(tokens));
    assert_memory_equal(r->tokens.data, tokens, sizeof(tokens));
    assert_int_equal(r->dtype, 1);
    assert_int_equal(r->gradients.len, sizeof(grads));
    assert_memory_equal(r->gradients.data, grads, sizeof(grads));
    assert_int_equal(r->mode, 1);
    assert_true(r->client_id == UINT64_MAX - 6);
    assert_true(r->digest == UINT64_MAX - 1);
    assert_int_equal(r->attempt, UINT32_MAX);
    embps__v1__push_gradients_request__free_unpacked(r, NULL);
  }
  /* a lookup: no gradients or mode, shard 0 */
  memset(&f, 0, sizeof(f));
  f.table = "t";
  f.batch_id = 1;
  f.shard_count = 1;
  f.tokens_bytes = sizeof(tokens);
  f.client_id = 77;
  f.digest = 0x0102030405060708ull;
  f.attempt = 1;
  assert_int_equal(embps__batch_frame_build(&fr, &f, &err), EMBPS_OK);
  n = 0;
  APPEND(fr.head, fr.head_len);
  APPEND(tokens, sizeof(tokens));
  APPEND(fr.mid, fr.mid_len);
  APPEND(fr.tail, fr.tail_len);
  assert_int_equal(n, fr.total);
  {
    Embps__V1__LookupRequest *r = embps__v1__lookup_request__unpack(NULL, n - 5, buf + 5);
    assert_non_null(r);
    assert_string_equal(r->table, "t");
    assert_int_equal(r->batch_id, 1);
    assert_int_equal(r->shard_index, 0);
    assert_int_equal(r->client_id, 77);
    assert_true(r->digest == 0x0102030405060708ull);
    assert_int_equal(r->attempt, 1);
    assert_int_equal(r->tokens.len, sizeof(tokens));
    assert_memory_equal(r->tokens.data, tokens, sizeof(tokens));
    embps__v1__lookup_request__free_unpacked(r, NULL);
  }
#undef APPEND
  /* over 4 GiB */
  f.tokens_bytes = 1ull << 32;
  assert_int_equal(embps__batch_frame_build(&fr, &f, &err), EMBPS_INVALID_ARGUMENT);
}

/* ---- metadata ---- */

static void test_percent_decode(void **state) {
  char out[64];
  (void)state;
  assert_int_equal(embps__percent_decode(out, "a%20b", 5), 3);
  assert_string_equal(out, "a b");
  embps__percent_decode(out, "token 99 outside [0, 10)", 24);
  assert_string_equal(out, "token 99 outside [0, 10)");
  embps__percent_decode(out, "%E2%82%ac!", 10);
  assert_string_equal(out, "\xe2\x82\xac!");
  embps__percent_decode(out, "100%", 4);
  assert_string_equal(out, "100%");
  embps__percent_decode(out, "%4", 2);
  assert_string_equal(out, "%4");
  embps__percent_decode(out, "%zz%41", 6);
  assert_string_equal(out, "%zzA");
  embps__percent_decode(out, "%25%0A", 6);
  assert_string_equal(out, "%\n");
  /* only len bytes are read */
  embps__percent_decode(out, "ab%41", 3);
  assert_string_equal(out, "ab%");
}

static void test_grpc_timeout(void **state) {
  char out[16];
  (void)state;
  embps__grpc_timeout(out, 5000);
  assert_string_equal(out, "5000m");
  embps__grpc_timeout(out, 0);
  assert_string_equal(out, "1m");
  embps__grpc_timeout(out, 99999999);
  assert_string_equal(out, "99999999m");
  embps__grpc_timeout(out, 100000000);
  assert_string_equal(out, "100000S");
  embps__grpc_timeout(out, 100000001);
  assert_string_equal(out, "100001S"); /* rounded up, never shorter */
}

static void test_http_status(void **state) {
  (void)state;
  assert_int_equal(embps__http_to_status(404), EMBPS_UNIMPLEMENTED);
  assert_int_equal(embps__http_to_status(503), EMBPS_UNAVAILABLE);
  assert_int_equal(embps__http_to_status(401), EMBPS_UNAUTHENTICATED);
  assert_int_equal(embps__http_to_status(500), EMBPS_UNKNOWN);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_protobuf_c_encoding),
      cmocka_unit_test(test_any_order_unknown_and_repeated),
      cmocka_unit_test(test_wrong_sizes_rejected),
      cmocka_unit_test(test_malformed),
      cmocka_unit_test(test_capacity_drops_padding_rows),
      cmocka_unit_test(test_deframer),
      cmocka_unit_test(test_request_encoding),
      cmocka_unit_test(test_percent_decode),
      cmocka_unit_test(test_grpc_timeout),
      cmocka_unit_test(test_http_status),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
