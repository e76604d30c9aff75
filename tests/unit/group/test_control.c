/* server/group/control.c without sockets: every message of the group's control protocol
 * encoded and decoded back field for field, the wire bytes of one frame pinned down
 * (little-endian), and malformed input refused: every truncation of every frame kind, bytes
 * left over, out-of-range fields, bad frame headers, and random garbage. Allocation failures
 * leave the buffer as it was. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "server/group/bootstrap.h"
#include "server/group/control.h"
#include "server/group/group.h"
#include "server/group/relay.h"
#include "tests/unit/common/table_fields_fixture.h"

TABLE_FIELDS_FIXTURE(config, embps_table_config_t)

static void assert_contains(const char *msg, const char *part) {
  if (!strstr(msg, part))
    fail_msg("'%s' does not contain '%s'", msg, part);
}

/* The one frame in a buffer, split by embps__frame_next. */
typedef struct frame {
  uint8_t type;
  const uint8_t *p; /* payload */
  size_t len;
} frame_t;

/* Splits the one frame in b, checking that it takes the whole buffer. */
static frame_t split_frame(const embps__buf_t *b) {
  frame_t f;
  size_t frame_len;
  embps_error_t err;
  assert_int_equal(embps__frame_next(b->data, b->len, &f.type, &f.p, &f.len, &frame_len, &err),
                   EMBPS_OK);
  assert_int_equal(frame_len, b->len);
  return f;
}

/* ---- bootstrap messages ---- */

static void test_hello_round_trip(void **state) {
  static const char identity[] = "version=1\nmesh=shard=4\n";
  embps__buf_t b = {0};
  embps__hello_t h;
  embps_error_t err;
  (void)state;
  assert_int_equal(
      embps__hello_encode(&b, EMBPS_GROUP_CONN_DATA, 3, 4, identity, sizeof(identity) - 1),
      EMBPS_OK);
  assert_int_equal(b.len, EMBPS__HELLO_HEADER_LEN + sizeof(identity) - 1);
  for (size_t n = 0; n <= b.len; n++)
    assert_true(embps__hello_magic_ok(b.data, n));
  assert_int_equal(embps__hello_decode(b.data, &h, &err), EMBPS_OK);
  assert_int_equal(h.kind, EMBPS_GROUP_CONN_DATA);
  assert_int_equal(h.rank, 3);
  assert_int_equal(h.size, 4);
  assert_int_equal(h.identity_len, sizeof(identity) - 1);
  assert_memory_equal(b.data + EMBPS__HELLO_HEADER_LEN, identity, sizeof(identity) - 1);
  /* Little-endian on the wire: rank 3 is 03 00 00 00 after the magic and the kind. */
  assert_int_equal(b.data[EMBPS__HELLO_MAGIC_LEN + 1], 3);
  assert_int_equal(b.data[EMBPS__HELLO_MAGIC_LEN + 4], 0);
  embps__buf_free(&b);
  assert_null(b.data);
}

static void test_hello_refused(void **state) {
  embps__buf_t b = {0};
  embps__hello_t h;
  embps_error_t err;
  uint8_t bytes[EMBPS__HELLO_HEADER_LEN];
  (void)state;
  /* Strangers are told apart after their first bytes. */
  assert_false(embps__hello_magic_ok((const uint8_t *)"PRI * HTTP/2.0", 14));
  assert_false(embps__hello_magic_ok((const uint8_t *)"EMBPS2", 6));
  assert_false(embps__hello_magic_ok((const uint8_t *)"X", 1));
  assert_true(embps__hello_magic_ok((const uint8_t *)"EMB", 3));
  memset(bytes, 0, sizeof(bytes));
  memcpy(bytes, "EMBPS2", 6);
  assert_int_equal(embps__hello_decode(bytes, &h, &err), EMBPS_INVALID_ARGUMENT);
  /* An identity too long is refused when encoding, and named when decoding. */
  assert_int_equal(embps__hello_encode(&b, 0, 1, 2, "", EMBPS__MAX_IDENTITY_LEN),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(b.len, 0);
  assert_int_equal(embps__hello_encode(&b, 0, 1, 2, "x", 1), EMBPS_OK);
  b.data[EMBPS__HELLO_MAGIC_LEN + 9] = 0x00; /* identity_len = 0x00010000 = the limit */
  b.data[EMBPS__HELLO_MAGIC_LEN + 10] = 0x00;
  b.data[EMBPS__HELLO_MAGIC_LEN + 11] = 0x01;
  assert_int_equal(embps__hello_decode(b.data, &h, &err), EMBPS_FAILED_PRECONDITION);
  assert_contains(err.message, "rank 1 sent a 65536-byte configuration, more than the 65536");
  embps__buf_free(&b);
}

static void test_verdict_round_trip(void **state) {
  char long_msg[1000];
  embps__buf_t b = {0};
  embps_error_t err;
  size_t len;
  int accept;
  (void)state;
  assert_int_equal(embps__verdict_encode(&b, 1, ""), EMBPS_OK);
  assert_int_equal(b.len, EMBPS__VERDICT_HEADER_LEN);
  assert_int_equal(b.data[0], 0); /* 0 is accept on the wire */
  assert_int_equal(embps__verdict_decode(b.data, &accept, &len, &err), EMBPS_OK);
  assert_true(accept);
  assert_int_equal(len, 0);
  b.len = 0;
  assert_int_equal(embps__verdict_encode(&b, 0, "mesh differs"), EMBPS_OK);
  assert_int_equal(embps__verdict_decode(b.data, &accept, &len, &err), EMBPS_OK);
  assert_false(accept);
  assert_int_equal(len, 12);
  assert_memory_equal(b.data + EMBPS__VERDICT_HEADER_LEN, "mesh differs", 12);
  /* A message longer than an error holds is clipped. */
  memset(long_msg, 'a', sizeof(long_msg) - 1);
  long_msg[sizeof(long_msg) - 1] = '\0';
  b.len = 0;
  assert_int_equal(embps__verdict_encode(&b, 0, long_msg), EMBPS_OK);
  assert_int_equal(embps__verdict_decode(b.data, &accept, &len, &err), EMBPS_OK);
  assert_int_equal(len, EMBPS__VERDICT_MESSAGE_MAX);
  assert_int_equal(b.len, EMBPS__VERDICT_HEADER_LEN + EMBPS__VERDICT_MESSAGE_MAX);
  b.data[0] = 3;
  assert_int_equal(embps__verdict_decode(b.data, &accept, &len, &err), EMBPS_INVALID_ARGUMENT);
  embps__buf_free(&b);
}

/* The group secret's messages: a challenge carries exactly a nonce, an accept may carry the
 * acceptor's proof, and the connector's answer is its nonce then its proof. */
static void test_challenge_round_trip(void **state) {
  uint8_t nonce[EMBPS__NONCE_LEN], proof[EMBPS__PROOF_LEN], n2[EMBPS__NONCE_LEN],
      p2[EMBPS__PROOF_LEN];
  embps__buf_t b = {0};
  embps_error_t err;
  size_t len;
  int verdict;
  (void)state;
  for (unsigned i = 0; i < EMBPS__NONCE_LEN; i++) {
    nonce[i] = (uint8_t)(i * 7 + 1);
    proof[i] = (uint8_t)(255 - i);
  }
  assert_int_equal(
      embps__verdict_encode_bytes(&b, EMBPS__VERDICT_CHALLENGE, nonce, EMBPS__NONCE_LEN), EMBPS_OK);
  assert_int_equal(b.len, EMBPS__VERDICT_HEADER_LEN + EMBPS__NONCE_LEN);
  assert_int_equal(b.data[0], 2);
  assert_int_equal(embps__verdict_decode(b.data, &verdict, &len, &err), EMBPS_OK);
  assert_int_equal(verdict, EMBPS__VERDICT_CHALLENGE);
  assert_int_equal(len, EMBPS__NONCE_LEN);
  assert_memory_equal(b.data + EMBPS__VERDICT_HEADER_LEN, nonce, EMBPS__NONCE_LEN);
  /* A challenge of any other length is not one. */
  b.data[1] = EMBPS__NONCE_LEN - 1;
  assert_int_equal(embps__verdict_decode(b.data, &verdict, &len, &err), EMBPS_INVALID_ARGUMENT);
  b.len = 0;
  assert_int_equal(
      embps__verdict_encode_bytes(&b, EMBPS__VERDICT_ACCEPTED, proof, EMBPS__PROOF_LEN), EMBPS_OK);
  assert_int_equal(b.data[0], 0);
  assert_int_equal(embps__verdict_decode(b.data, &verdict, &len, &err), EMBPS_OK);
  assert_int_equal(verdict, EMBPS__VERDICT_ACCEPTED);
  assert_int_equal(len, EMBPS__PROOF_LEN);
  /* Refusals carry text only. */
  assert_int_equal(embps__verdict_encode_bytes(&b, EMBPS__VERDICT_REFUSED, proof, 4),
                   EMBPS_INVALID_ARGUMENT);
  b.len = 0;
  assert_int_equal(embps__auth_encode(&b, nonce, proof), EMBPS_OK);
  assert_int_equal(b.len, EMBPS__AUTH_LEN);
  embps__auth_decode(b.data, n2, p2);
  assert_memory_equal(n2, nonce, EMBPS__NONCE_LEN);
  assert_memory_equal(p2, proof, EMBPS__PROOF_LEN);
  embps__buf_free(&b);
}

/* ---- frames ---- */

static embps_batch_desc_t sample_notice(void) {
  embps_batch_desc_t d;
  memset(&d, 0, sizeof(d));
  d.client_id = UINT64_C(0x1112131415161718);
  d.batch_id = UINT64_C(0x0102030405060708);
  d.kind = EMBPS_OP_PUSH;
  d.tokens_per_batch = 4096;
  snprintf(d.table, sizeof(d.table), "emb");
  d.table_id = 0x2a;
  d.has_deadline = 1;
  d.deadline_left_ms = 300;
  d.digest = UINT64_C(0x2122232425262728);
  d.attempt = 3;
  return d;
}

static void test_notice_round_trip_and_bytes(void **state) {
  /* clang-format off */
  static const uint8_t want[] = {
      54, 0, 0, 0, EMBPS__FRAME_NOTICE,            /* length (type + payload), type */
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, /* client_id, little-endian */
      8, 7, 6, 5, 4, 3, 2, 1,                      /* batch_id */
      EMBPS_OP_PUSH, 0, 0, 0, 0x00, 0x10, 0, 0, /* kind, tokens_per_batch 4096 */
      3, 'e', 'm', 'b',                            /* table */
      0x2a, 0, 0, 0, 0, 0, 0, 0,                   /* table_id */
      1, 0x2c, 0x01, 0, 0,                         /* has a deadline, 300 ms left */
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21, /* digest */
      3, 0, 0, 0};                                 /* attempt */
  /* clang-format on */
  embps_batch_desc_t d = sample_notice(), got;
  embps__buf_t b = {0};
  embps_error_t err;
  frame_t f;
  (void)state;
  assert_int_equal(embps__frame_notice(&b, &d, &err), EMBPS_OK);
  assert_int_equal(b.len, sizeof(want));
  assert_memory_equal(b.data, want, sizeof(want));
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_NOTICE);
  assert_int_equal(embps__parse_notice(f.p, f.len, &got, &err), EMBPS_OK);
  assert_memory_equal(&got, &d, sizeof(d));
  /* A deadline flag other than 0 or 1, or time left without the flag, is malformed. */
  b.data[EMBPS__FRAME_HEADER_LEN + f.len - 17] = 2;
  assert_int_equal(embps__parse_notice(f.p, f.len, &got, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "deadline flag 2"));
  b.data[EMBPS__FRAME_HEADER_LEN + f.len - 17] = 0;
  assert_int_equal(embps__parse_notice(f.p, f.len, &got, &err), EMBPS_INVALID_ARGUMENT);
  b.data[EMBPS__FRAME_HEADER_LEN + f.len - 17] = 1;
  /* A name that fills the whole field has no room for its NUL: refused. */
  memset(d.table, 'x', sizeof(d.table));
  assert_int_equal(embps__frame_notice(&b, &d, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(b.len, sizeof(want)); /* unchanged */
  embps__buf_free(&b);
}

/* WITHDRAW: the batch's client id, id and attempt, byte for byte, and back. */
static void test_withdraw_round_trip_and_bytes(void **state) {
  /* clang-format off */
  static const uint8_t want[] = {
      21, 0, 0, 0, EMBPS__FRAME_WITHDRAW,              /* length (type + payload), type */
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, /* client_id, little-endian */
      8, 7, 6, 5, 4, 3, 2, 1,                         /* batch_id */
      2, 0, 0, 0};                                    /* attempt */
  /* clang-format on */
  embps__withdraw_t w = {.client_id = UINT64_C(0x1112131415161718),
                         .batch_id = UINT64_C(0x0102030405060708),
                         .attempt = 2},
                    got;
  embps__buf_t b = {0};
  embps_error_t err;
  frame_t f;
  (void)state;
  assert_int_equal(embps__frame_withdraw(&b, &w, &err), EMBPS_OK);
  assert_int_equal(b.len, sizeof(want));
  assert_memory_equal(b.data, want, sizeof(want));
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_WITHDRAW);
  assert_int_equal(embps__parse_withdraw(f.p, f.len, &got, &err), EMBPS_OK);
  /* field by field: the struct's padding is whatever the stack held */
  assert_true(got.client_id == w.client_id && got.batch_id == w.batch_id);
  assert_int_equal(got.attempt, w.attempt);
  assert_int_equal(embps__parse_withdraw(f.p, f.len - 1, &got, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "malformed WITHDRAW frame");
  embps__buf_free(&b);
}

static embps_table_config_t sample_config(void) {
  embps_table_config_t c;
  memset(&c, 0, sizeof(c));
  snprintf(c.name, sizeof(c.name), "user_embeddings");
  c.rows = UINT64_C(3000000000);
  c.emb_width = 128;
  c.dtype = EMBPS_DTYPE_BF16;
  c.seed = UINT64_C(0xdeadbeefcafef00d);
  c.init_scale = 0.01f;
  c.optimizer = EMBPS_OPTIMIZER_ADAM;
  c.lr = 1e-3f;
  c.eps = 1e-8f;
  c.half_life = -0.0f; /* a sign bit must survive */
  c.initial_accumulator = 0.1f;
  c.weight_decay = 3e-38f;
  c.beta1 = 0.9f;
  c.beta2 = 0.999f;
  return c;
}

/* A round with every kind of entry: runs of a lookup, a push, a create, a checkpoint and a drop,
 * and a failure. */
#define SAMPLE_ROUND_LEN 6
static embps__ckpt_order_t sample_ckpts[SAMPLE_ROUND_LEN];

static size_t sample_round(embps_round_entry_t *e, embps_table_config_t *c) {
  memset(e, 0, SAMPLE_ROUND_LEN * sizeof(*e));
  memset(c, 0, SAMPLE_ROUND_LEN * sizeof(*c));
  memset(sample_ckpts, 0, sizeof(sample_ckpts));
  e[0] = (embps_round_entry_t){.client_id = UINT64_C(0xfedcba9876543210),
                               .batch_id = 7,
                               .attempt = 0x01020304,
                               .action = EMBPS_ROUND_RUN,
                               .kind = EMBPS_OP_LOOKUP};
  e[1] = (embps_round_entry_t){
      .batch_id = UINT64_C(1) << 63 | 2, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_CREATE_TABLE};
  c[1] = sample_config();
  e[2] = (embps_round_entry_t){.batch_id = 9,
                               .action = EMBPS_ROUND_FAIL,
                               .kind = EMBPS_OP_PUSH,
                               .status = EMBPS_DEADLINE_EXCEEDED};
  snprintf(e[2].message, sizeof(e[2].message), "batch 9 missed its deadline");
  e[3] = (embps_round_entry_t){.batch_id = 10, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_PUSH};
  e[4] = (embps_round_entry_t){
      .batch_id = UINT64_C(3) << 62 | 5, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_CHECKPOINT};
  snprintf(sample_ckpts[4].scope, sizeof(sample_ckpts[4].scope), "users.v2");
  sample_ckpts[4].round = UINT64_C(0x0123456789abcdef);
  sample_ckpts[4].base_round = 77;
  e[5] = (embps_round_entry_t){
      .batch_id = UINT64_C(1) << 63 | 3, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_DROP_TABLE};
  snprintf(c[5].name, sizeof(c[5].name), "old.table");
  return SAMPLE_ROUND_LEN;
}

static void test_round_round_trip(void **state) {
  embps_round_entry_t e[SAMPLE_ROUND_LEN], got[EMBPS__ROUND_MAX];
  embps_table_config_t c[SAMPLE_ROUND_LEN], got_c[EMBPS__ROUND_MAX];
  embps__ckpt_order_t got_k[EMBPS__ROUND_MAX];
  embps__buf_t b = {0};
  embps_error_t err;
  frame_t f;
  size_t n = sample_round(e, c), got_n = 0;
  (void)state;
  assert_int_equal(embps__frame_round(&b, e, c, sample_ckpts, n, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_ROUND);
  assert_int_equal(
      embps__parse_round(f.p, f.len, got, got_c, got_k, EMBPS__ROUND_MAX, &got_n, &err), EMBPS_OK);
  assert_int_equal(got_n, n);
  for (size_t i = 0; i < n; i++) {
    assert_true(got[i].client_id == e[i].client_id);
    assert_int_equal(got[i].batch_id, e[i].batch_id);
    assert_int_equal(got[i].attempt, e[i].attempt);
    assert_int_equal(got[i].action, e[i].action);
    assert_int_equal(got[i].kind, e[i].kind);
    assert_int_equal(got[i].status, e[i].status);
    assert_string_equal(got[i].message, e[i].message);
  }
  /* The create's config comes back bit for bit (floats included). */
  assert_memory_equal(&got_c[1], &c[1], sizeof(c[1]));
  /* And the checkpoint's order. */
  assert_string_equal(got_k[4].scope, "users.v2");
  assert_int_equal(got_k[4].round, sample_ckpts[4].round);
  assert_int_equal(got_k[4].base_round, 77);
  /* A drop carries its table's name. */
  assert_string_equal(got_c[5].name, "old.table");
  /* A round of nothing, and a round too long to send. */
  b.len = 0;
  assert_int_equal(embps__frame_round(&b, e, NULL, NULL, 0, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(embps__parse_round(f.p, f.len, got, got_c, got_k, 4, &got_n, &err), EMBPS_OK);
  assert_int_equal(got_n, 0);
  assert_int_equal(embps__frame_round(&b, got, got_c, got_k, EMBPS__ROUND_MAX + 1, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps__frame_round(&b, e, NULL, sample_ckpts, n, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps__frame_round(&b, e, c, NULL, n, &err), EMBPS_INVALID_ARGUMENT);
  /* More entries than the reader has room for is malformed. */
  b.len = 0;
  assert_int_equal(embps__frame_round(&b, e, c, sample_ckpts, n, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(embps__parse_round(f.p, f.len, got, got_c, got_k, n - 1, &got_n, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "entry count 6");
  embps__buf_free(&b);
}

/* A create's table settings in a round frame: each at its offset after the name (the layout of
 * the checkpoint header's), and back; each holds a value no other has, so one forgotten, moved
 * or read into another's place fails by name. */
static void test_round_create_settings(void **state) {
  embps_round_entry_t e = {.batch_id = 4, .action = EMBPS_ROUND_RUN, .kind = EMBPS_OP_CREATE_TABLE};
  embps_round_entry_t got[1];
  embps_table_config_t c, got_c[1];
  embps__ckpt_order_t got_k[1];
  embps__buf_t b = {0};
  embps_error_t err;
  size_t got_n = 0;
  frame_t f;
  (void)state;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "settings");
  config_fill(&c);
  assert_int_equal(embps__frame_round(&b, &e, &c, NULL, 1, &err), EMBPS_OK);
  f = split_frame(&b);
  /* count u32, then the entry: client_id, batch_id, attempt, action, kind, status, message
   * length u16 */
  assert_int_equal(f.len, 4 + 34 + 1 + 8 + TABLE_FIELDS_LAYOUT_BYTES);
  assert_int_equal(f.p[38], 8);
  assert_memory_equal(f.p + 39, "settings", 8);
  assert_table_fields_bytes(f.p + 47, &c);
  memset(got_c, 0xa5, sizeof(got_c));
  assert_int_equal(embps__parse_round(f.p, f.len, got, got_c, got_k, 1, &got_n, &err), EMBPS_OK);
  assert_int_equal(got_n, 1);
  assert_string_equal(got_c[0].name, "settings");
  config_assert_same(&got_c[0], &c);
  embps__buf_free(&b);
}

static void test_broken_device_nccl_round_trip(void **state) {
  char why[EMBPS__BROKEN_MAX + 1], long_why[1000];
  embps__device_claim_t claim = {.host = "gpu-node-7", .bus_id = "0000:18:00.0", .device = 3}, got;
  uint8_t id[EMBPS__NCCL_ID_BYTES], got_id[EMBPS__NCCL_ID_BYTES];
  embps__buf_t b = {0};
  embps_error_t err;
  frame_t f;
  (void)state;
  assert_int_equal(embps__frame_broken(&b, "rank 2 died", &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_BROKEN);
  assert_int_equal(embps__parse_broken(f.p, f.len, why, sizeof(why), &err), EMBPS_OK);
  assert_string_equal(why, "rank 2 died");
  memset(long_why, 'w', sizeof(long_why) - 1);
  long_why[sizeof(long_why) - 1] = '\0';
  b.len = 0;
  assert_int_equal(embps__frame_broken(&b, long_why, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.len, EMBPS__BROKEN_MAX); /* clipped */
  assert_int_equal(embps__parse_broken(f.p, f.len, why, sizeof(why), &err), EMBPS_OK);
  assert_int_equal(strlen(why), EMBPS__BROKEN_MAX);
  assert_int_equal(embps__parse_broken(f.p, f.len + 1, why, sizeof(why), &err),
                   EMBPS_INVALID_ARGUMENT);
  b.len = 0; /* LEAVING carries its sentence as BROKEN does, under its own type */
  assert_int_equal(embps__frame_leaving(&b, "rank 0 left the group (shutting down)", &err),
                   EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_LEAVING);
  assert_int_equal(embps__parse_broken(f.p, f.len, why, sizeof(why), &err), EMBPS_OK);
  assert_string_equal(why, "rank 0 left the group (shutting down)");
  b.len = 0;
  assert_int_equal(embps__frame_leaving(&b, long_why, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.len, EMBPS__BROKEN_MAX); /* clipped */

  b.len = 0;
  assert_int_equal(embps__frame_device(&b, &claim, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_DEVICE);
  memset(&got, 0x5a, sizeof(got));
  assert_int_equal(embps__parse_device(f.p, f.len, &got, &err), EMBPS_OK);
  assert_string_equal(got.host, "gpu-node-7");
  assert_string_equal(got.bus_id, "0000:18:00.0");
  assert_int_equal(got.device, 3);

  for (size_t i = 0; i < sizeof(id); i++)
    id[i] = (uint8_t)(i * 37 + 1);
  b.len = 0;
  assert_int_equal(embps__frame_nccl_id(&b, id, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_NCCL_ID);
  assert_int_equal(embps__parse_nccl_id(f.p, f.len, got_id, &err), EMBPS_OK);
  assert_memory_equal(got_id, id, sizeof(id));
  assert_int_equal(embps__parse_nccl_id(f.p, f.len - 1, got_id, &err), EMBPS_INVALID_ARGUMENT);
  embps__buf_free(&b);
}

static void expect_field_refused_ckpt(const embps__buf_t *b);

static void test_checkpoint_round_trip(void **state) {
  embps__ckpt_msg_t m, got;
  embps__buf_t b = {0};
  embps_error_t err;
  frame_t f;
  (void)state;
  memset(&m, 0, sizeof(m));
  m.what = EMBPS__CKPT_DONE;
  m.seq = UINT64_MAX;
  m.round = 123456789012345ull;
  m.status = EMBPS_RESOURCE_EXHAUSTED;
  m.bytes = UINT64_C(5) << 40;
  m.final = 1;
  snprintf(m.scope, sizeof(m.scope), "items");
  snprintf(m.path, sizeof(m.path), "/data/ckpt/ckpt-00000000123456789012345");
  snprintf(
      m.message, sizeof(m.message),
      "no space left on device writing /data/ckpt/ckpt-00000000123456789012345/r1-items.embps");
  assert_int_equal(embps__frame_checkpoint(&b, &m, &err), EMBPS_OK);
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_CHECKPOINT);
  memset(&got, 0x5a, sizeof(got));
  assert_int_equal(embps__parse_checkpoint(f.p, f.len, &got, &err), EMBPS_OK);
  assert_int_equal(got.what, m.what);
  assert_int_equal(got.seq, m.seq);
  assert_int_equal(got.round, m.round);
  assert_int_equal(got.status, m.status);
  assert_int_equal(got.bytes, m.bytes);
  assert_int_equal(got.final, 1);
  assert_string_equal(got.scope, m.scope);
  assert_string_equal(got.path, m.path);
  assert_string_equal(got.message, m.message);
  /* A kind or status outside the protocol is refused. */
  expect_field_refused_ckpt(&b);
  embps__buf_free(&b);
}

/* ---- malformed input ---- */

/* Parses payload p of a frame of type with the matching decoder. */
static embps_status_t parse_any(uint8_t type, const uint8_t *p, size_t len, embps_error_t *err) {
  static embps_round_entry_t entries[EMBPS__ROUND_MAX];
  static embps_table_config_t configs[EMBPS__ROUND_MAX];
  static embps__ckpt_order_t ckpts[EMBPS__ROUND_MAX];
  embps__ckpt_msg_t m;
  embps_batch_desc_t d;
  embps__withdraw_t w;
  embps__device_claim_t c;
  uint8_t id[EMBPS__NCCL_ID_BYTES];
  char why[EMBPS__BROKEN_MAX + 1];
  size_t n;
  switch (type) {
  case EMBPS__FRAME_NOTICE:
    return embps__parse_notice(p, len, &d, err);
  case EMBPS__FRAME_ROUND:
    return embps__parse_round(p, len, entries, configs, ckpts, EMBPS__ROUND_MAX, &n, err);
  case EMBPS__FRAME_CHECKPOINT:
    return embps__parse_checkpoint(p, len, &m, err);
  case EMBPS__FRAME_BROKEN:
  case EMBPS__FRAME_LEAVING:
    return embps__parse_broken(p, len, why, sizeof(why), err);
  case EMBPS__FRAME_DEVICE:
    return embps__parse_device(p, len, &c, err);
  case EMBPS__FRAME_WITHDRAW:
    return embps__parse_withdraw(p, len, &w, err);
  case EMBPS__FRAME_RELAY: {
    const uint8_t *payload, *frame;
    size_t payload_len, frame_len;
    uint32_t rank;
    uint8_t inner;
    embps_status_t st =
        embps__parse_relay(p, len, &rank, &inner, &payload, &payload_len, &frame, &frame_len, err);
    return st != EMBPS_OK ? st : parse_any(inner, payload, payload_len, err);
  }
  default:
    return embps__parse_nccl_id(p, len, id, err);
  }
}

/* One valid frame of each kind with a fixed-size payload (BROKEN takes any length). */
static void all_frames(embps__buf_t *frames) {
  embps_round_entry_t e[SAMPLE_ROUND_LEN];
  embps_table_config_t c[SAMPLE_ROUND_LEN];
  embps_batch_desc_t d = sample_notice();
  embps__device_claim_t claim = {.host = "h", .bus_id = "b", .device = 0};
  uint8_t id[EMBPS__NCCL_ID_BYTES] = {1};
  embps__ckpt_msg_t m = {.what = EMBPS__CKPT_COMPLETE, .seq = 3, .round = 9, .bytes = 1 << 20};
  embps__withdraw_t w = {.client_id = 1, .batch_id = 2, .attempt = 3};
  size_t n = sample_round(e, c);
  snprintf(m.path, sizeof(m.path), "/ckpt/ckpt-00000000000000000009");
  assert_int_equal(embps__frame_notice(&frames[0], &d, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_round(&frames[1], e, c, sample_ckpts, n, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_device(&frames[2], &claim, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_nccl_id(&frames[3], id, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_checkpoint(&frames[4], &m, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_withdraw(&frames[5], &w, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_relay(&frames[6], 7, frames[5].data, frames[5].len, NULL),
                   EMBPS_OK);
}

static void test_truncated_and_oversized_payloads(void **state) {
  embps__buf_t frames[7] = {{0}};
  uint8_t bigger[4096];
  embps_error_t err;
  (void)state;
  all_frames(frames);
  for (int k = 0; k < 7; k++) {
    frame_t f = split_frame(&frames[k]);
    assert_int_equal(parse_any(f.type, f.p, f.len, &err), EMBPS_OK);
    for (size_t cut = 0; cut < f.len; cut++) {
      embps_error_clear(&err);
      if (parse_any(f.type, f.p, cut, &err) != EMBPS_INVALID_ARGUMENT)
        fail_msg("frame type %u cut to %zu of %zu bytes was accepted", f.type, cut, f.len);
      assert_contains(err.message, "malformed");
    }
    assert_true(f.len + 1 <= sizeof(bigger));
    memcpy(bigger, f.p, f.len);
    bigger[f.len] = 0;
    assert_int_equal(parse_any(f.type, bigger, f.len + 1, &err), EMBPS_INVALID_ARGUMENT);
    embps__buf_free(&frames[k]);
  }
}

/* Overwrites bytes [off, off+n) of b's payload with v (little-endian) and expects refusal. */
static void expect_field_refused(const embps__buf_t *b, size_t off, size_t n, uint64_t v,
                                 const char *part) {
  uint8_t copy[4096];
  embps_error_t err;
  frame_t f = split_frame(b);
  assert_true(f.len <= sizeof(copy) && off + n <= f.len);
  memcpy(copy, f.p, f.len);
  for (size_t i = 0; i < n; i++)
    copy[off + i] = (uint8_t)(v >> (8 * i));
  assert_int_equal(parse_any(f.type, copy, f.len, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, part);
}

static void test_bad_fields(void **state) {
  embps_round_entry_t e[SAMPLE_ROUND_LEN];
  embps_table_config_t c[SAMPLE_ROUND_LEN];
  embps_batch_desc_t d = sample_notice();
  embps__device_claim_t claim = {.host = "h", .bus_id = "b", .device = 0};
  embps__buf_t b = {0};
  (void)state;
  assert_int_equal(embps__frame_notice(&b, &d, NULL), EMBPS_OK);
  expect_field_refused(&b, 24, 1, 200, "table name length 200"); /* beyond the payload */
  expect_field_refused(&b, 24, 1, 2, "bytes after its last field");
  b.len = 0;
  assert_int_equal(embps__frame_round(&b, e, c, sample_ckpts, sample_round(e, c), NULL), EMBPS_OK);
  /* entry 0 starts at 4: client_id 8, batch_id 8, attempt 4, action 4, kind 4, status 4,
   * message length 2 */
  expect_field_refused(&b, 24, 4, 7, "action 7");
  expect_field_refused(&b, 28, 4, 9, "batch kind 9");
  expect_field_refused(&b, 32, 4, 99, "status 99");
  expect_field_refused(&b, 36, 2, 400, "message length 400");
  expect_field_refused(&b, 0, 4, SAMPLE_ROUND_LEN + 1, "cut short"); /* more entries than sent */
  b.len = 0;
  assert_int_equal(embps__frame_device(&b, &claim, NULL), EMBPS_OK);
  expect_field_refused(&b, 0, 1, 2, "malformed DEVICE frame");
  embps__buf_free(&b);
}

static void expect_field_refused_ckpt(const embps__buf_t *b) {
  expect_field_refused(b, 0, 1, 4, "kind 4");
  expect_field_refused(b, 0, 1, 0, "kind 0");
  expect_field_refused(b, 17, 4, 17, "status 17");
  expect_field_refused(b, 29, 1, 2, "final flag 2");
}

static void test_frame_headers(void **state) {
  embps_batch_desc_t d = sample_notice();
  embps__buf_t b = {0};
  embps_error_t err;
  const uint8_t *payload;
  size_t len, frame_len, one;
  uint8_t type, header[EMBPS__FRAME_HEADER_LEN];
  (void)state;
  assert_int_equal(embps__frame_notice(&b, &d, NULL), EMBPS_OK);
  one = b.len;
  assert_int_equal(embps__frame_broken(&b, "x", NULL), EMBPS_OK);
  /* Every prefix of the first frame is "not whole yet", never an error. */
  for (size_t n = 0; n < one; n++) {
    assert_int_equal(embps__frame_next(b.data, n, &type, &payload, &len, &frame_len, &err),
                     EMBPS_OK);
    assert_int_equal(frame_len, 0);
  }
  /* Two frames back to back come out one after the other. */
  assert_int_equal(embps__frame_next(b.data, b.len, &type, &payload, &len, &frame_len, &err),
                   EMBPS_OK);
  assert_int_equal(frame_len, one);
  assert_int_equal(type, EMBPS__FRAME_NOTICE);
  assert_int_equal(
      embps__frame_next(b.data + one, b.len - one, &type, &payload, &len, &frame_len, &err),
      EMBPS_OK);
  assert_int_equal(type, EMBPS__FRAME_BROKEN);
  assert_int_equal(len, 1);
  /* A zero length, a length over the limit and an unknown type are refused. */
  memcpy(header, "\0\0\0\0\1", 5);
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "length 0");
  memcpy(header, "\2\0\100\0\1", 5); /* 4 MiB + 2 */
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps__frame_next(header, sizeof(header), &type, &payload, &len, &frame_len, &err),
      EMBPS_INVALID_ARGUMENT);
  memcpy(header, "\1\0\0\0\0", 5);
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "unknown type 0");
  memcpy(header, "\1\0\0\0\12", 5);
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "unknown type 10");
  memcpy(header, "\x15\0\0\0\10", 5); /* WITHDRAW: 20 bytes of payload */
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_OK);
  assert_int_equal(type, EMBPS__FRAME_WITHDRAW);
  assert_int_equal(len, 20);
  memcpy(header, "\1\0\0\0\7", 5); /* an empty LEAVING frame is fine */
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_OK);
  assert_int_equal(type, EMBPS__FRAME_LEAVING);
  memcpy(header, "\1\0\0\0\3", 5); /* an empty BROKEN frame is fine */
  assert_int_equal(embps__frame_header(header, &type, &len, &err), EMBPS_OK);
  assert_int_equal(len, 0);
  embps__buf_free(&b);
}

/* Random bytes through every decoder: refused or accepted, never a crash or an overread (run
 * under the sanitizers in CI). */
static void test_garbage(void **state) {
  uint8_t junk[600];
  embps_error_t err;
  unsigned seed = 12345;
  (void)state;
  for (int round = 0; round < 20000; round++) {
    size_t len = (size_t)(rand_r(&seed) % sizeof(junk));
    for (size_t i = 0; i < len; i++)
      junk[i] = (uint8_t)rand_r(&seed);
    if (round % 3 == 0 && len >= 4) { /* plausible counts and lengths, to reach deeper */
      junk[0] = (uint8_t)(rand_r(&seed) % 4);
      junk[1] = junk[2] = junk[3] = 0;
    }
    for (uint8_t type = EMBPS__FRAME_NOTICE; type <= EMBPS__FRAME_RELAY; type++) {
      embps_status_t st = parse_any(type, junk, len, &err);
      assert_true(st == EMBPS_OK || st == EMBPS_INVALID_ARGUMENT);
    }
    if (len >= EMBPS__FRAME_HEADER_LEN) {
      const uint8_t *payload;
      size_t plen, frame_len;
      uint8_t type;
      embps_status_t st = embps__frame_next(junk, len, &type, &payload, &plen, &frame_len, &err);
      assert_true(st == EMBPS_OK || st == EMBPS_INVALID_ARGUMENT);
      assert_true(frame_len <= len);
    }
  }
}

/* An allocation that fails leaves the buffer as it was, and says so. */
static void test_allocation_failure(void **state) {
  embps_round_entry_t e[SAMPLE_ROUND_LEN];
  embps_table_config_t c[SAMPLE_ROUND_LEN];
  embps_batch_desc_t d = sample_notice();
  embps__buf_t b = {0};
  embps_error_t err;
  (void)state;
  embps_alloc_fail_after(1);
  assert_int_equal(embps__frame_notice(&b, &d, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_contains(err.message, "out of memory");
  assert_int_equal(embps__hello_encode(&b, 0, 1, 2, "x", 1), EMBPS_RESOURCE_EXHAUSTED);
  assert_int_equal(embps__verdict_encode(&b, 1, ""), EMBPS_RESOURCE_EXHAUSTED);
  assert_int_equal(b.len, 0);
  embps_alloc_fail_after(0);
  assert_int_equal(embps__frame_notice(&b, &d, &err), EMBPS_OK);
  size_t before = b.len, cap = b.cap;
  /* Growing an existing buffer: the first frame stays intact. */
  embps_alloc_fail_after(1);
  memset(e, 0, sizeof(e));
  for (int i = 0; i < 4; i++)
    memset(e[i].message, 'm', sizeof(e[i].message) - 1);
  embps_status_t st = embps__frame_round(&b, e, c, NULL, 4, &err);
  embps_alloc_fail_after(0);
  if (cap - before < 4 * sizeof(e[0].message)) {
    assert_int_equal(st, EMBPS_RESOURCE_EXHAUSTED);
    assert_int_equal(b.len, before);
  }
  embps_batch_desc_t got;
  assert_int_equal(embps__parse_notice(b.data + EMBPS__FRAME_HEADER_LEN,
                                       before - EMBPS__FRAME_HEADER_LEN, &got, &err),
                   EMBPS_OK);
  assert_int_equal(got.batch_id, d.batch_id);
  embps__buf_free(&b);
}

/* RELAY: a whole frame and a rank, pinned to the byte, and what the codec refuses. */
static void test_relay_round_trip_and_bytes(void **state) {
  /* clang-format off */
  static const uint8_t want[] = {
      30, 0, 0, 0, EMBPS__FRAME_RELAY,                /* length (type + payload), type */
      0x02, 0x03, 0x04, 0x05,                         /* rank, little-endian */
      21, 0, 0, 0, EMBPS__FRAME_WITHDRAW,              /* the frame it carries, whole */
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,
      8, 7, 6, 5, 4, 3, 2, 1,
      2, 0, 0, 0};
  /* clang-format on */
  embps__withdraw_t w = {.client_id = UINT64_C(0x1112131415161718),
                         .batch_id = UINT64_C(0x0102030405060708),
                         .attempt = 2},
                    got;
  embps__buf_t inner = {0}, b = {0}, nested = {0};
  embps_error_t err;
  const uint8_t *payload, *frame;
  size_t payload_len, frame_len;
  uint32_t rank;
  uint8_t type, copy[64];
  frame_t f;
  (void)state;
  assert_int_equal(embps__frame_withdraw(&inner, &w, NULL), EMBPS_OK);
  assert_int_equal(embps__frame_relay(&b, 0x05040302u, inner.data, inner.len, &err), EMBPS_OK);
  assert_int_equal(b.len, sizeof(want));
  assert_memory_equal(b.data, want, sizeof(want));
  f = split_frame(&b);
  assert_int_equal(f.type, EMBPS__FRAME_RELAY);
  assert_int_equal(embps__parse_relay(f.p, f.len, &rank, &type, &payload, &payload_len, &frame,
                                      &frame_len, &err),
                   EMBPS_OK);
  assert_int_equal(rank, 0x05040302u);
  assert_int_equal(type, EMBPS__FRAME_WITHDRAW);
  assert_int_equal(frame_len, inner.len);
  assert_memory_equal(frame, inner.data, inner.len); /* what a relay forwards: the frame as sent */
  assert_int_equal(embps__parse_withdraw(payload, payload_len, &got, &err), EMBPS_OK);
  assert_true(got.client_id == w.client_id && got.batch_id == w.batch_id);

  /* The encoder carries exactly one whole frame, never a RELAY frame. */
  assert_int_equal(embps__frame_relay(&nested, 1, b.data, b.len, &err), EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "RELAY frame carries one whole frame");
  assert_int_equal(embps__frame_relay(&nested, 1, inner.data, inner.len - 1, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps__frame_relay(&nested, 1, inner.data, 3, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(nested.len, 0);

  /* The decoder: a carried RELAY, a carried frame of unknown type or of another length. */
  memcpy(copy, f.p, f.len);
  copy[8] = EMBPS__FRAME_RELAY;
  assert_int_equal(embps__parse_relay(copy, f.len, &rank, &type, &payload, &payload_len, &frame,
                                      &frame_len, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "carries another RELAY frame");
  copy[8] = 0;
  assert_int_equal(embps__parse_relay(copy, f.len, &rank, &type, &payload, &payload_len, &frame,
                                      &frame_len, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "unknown type 0");
  memcpy(copy, f.p, f.len);
  copy[4] = 20; /* the carried frame says 19 bytes of payload, 20 follow */
  assert_int_equal(embps__parse_relay(copy, f.len, &rank, &type, &payload, &payload_len, &frame,
                                      &frame_len, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "malformed RELAY frame: carried frame's payload length 19");
  copy[4] = 0; /* a carried length of 0 */
  assert_int_equal(embps__parse_relay(copy, f.len, &rank, &type, &payload, &payload_len, &frame,
                                      &frame_len, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_contains(err.message, "length 0");
  for (size_t cut = 0; cut < 4 + EMBPS__FRAME_HEADER_LEN; cut++) {
    assert_int_equal(embps__parse_relay(f.p, cut, &rank, &type, &payload, &payload_len, &frame,
                                        &frame_len, &err),
                     EMBPS_INVALID_ARGUMENT);
    assert_contains(err.message, "malformed RELAY frame: length");
  }
  embps__buf_free(&inner);
  embps__buf_free(&b);
  embps__buf_free(&nested);
}

/* The relay tree (relay.h): for every group size up to 300 and several fanouts, every follower
 * reaches the leader in at most two hops, every relay's members name it, the connections kept are
 * the tree's edges on both of their ends, and the leader keeps ceil((N-1)/K). */
static void test_relay_topology(void **state) {
  static const uint32_t ks[] = {0, 1, 2, 3, 4, 5, 8, 16, 300};
  (void)state;
  assert_int_equal(embps__relay_fanout_auto(2), 0);
  assert_int_equal(embps__relay_fanout_auto(15), 0);
  assert_int_equal(embps__relay_fanout_auto(16), 4);
  assert_int_equal(embps__relay_fanout_auto(17), 5);
  assert_int_equal(embps__relay_fanout_auto(32), 6);
  assert_int_equal(embps__relay_fanout_auto(64), 8);
  assert_int_equal(embps__relay_fanout_auto(256), 16);
  for (uint32_t n = 1; n <= 300; n++) {
    for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
      uint32_t k = ks[ki], kept0 = 0;
      for (uint32_t r = 0; r < n; r++) {
        uint32_t up = embps__relay_up(n, k, r), first, m = embps__relay_members(n, k, r, &first);
        uint32_t kept = 0;
        if (r == 0 || k < 2)
          assert_int_equal(up, 0);
        if (up) { /* a member: its relay talks to the leader and relays for it */
          assert_true(up < r);
          assert_int_equal(embps__relay_up(n, k, up), 0);
          assert_int_equal(m, 0);
        }
        if (m) {
          assert_true(k >= 2 && m <= k - 1 && first == r + 1 && r + m < n);
          for (uint32_t i = first; i < first + m; i++)
            assert_int_equal(embps__relay_up(n, k, i), r);
        }
        for (uint32_t p = 0; p < n; p++) {
          int keeps = embps__relay_keeps(n, k, r, p);
          assert_int_equal(keeps, embps__relay_keeps(n, k, p, r));
          if (keeps && r == 0)
            kept0++;
          kept += (uint32_t)keeps;
          if (keeps && r != 0)
            assert_true(p == up || embps__relay_up(n, k, p) == r);
        }
        if (r != 0)
          assert_int_equal(kept, 1 + m);
      }
      assert_int_equal(kept0, n < 2 ? 0 : k < 2 ? n - 1 : (n - 1 + k - 1) / k);
    }
  }
}

/* --control-fanout: auto, a count, and what is refused. */
static void test_control_fanout_flag(void **state) {
  uint32_t k = 99;
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_group_control_fanout("auto", 8, &k, &err), EMBPS_OK);
  assert_int_equal(k, 0);
  assert_int_equal(embps_group_control_fanout("auto", 64, &k, &err), EMBPS_OK);
  assert_int_equal(k, 8);
  assert_int_equal(embps_group_control_fanout("", 16, &k, &err), EMBPS_OK);
  assert_int_equal(k, 4);
  assert_int_equal(embps_group_control_fanout("1", 64, &k, &err), EMBPS_OK);
  assert_int_equal(k, 0);
  assert_int_equal(embps_group_control_fanout("3", 7, &k, &err), EMBPS_OK);
  assert_int_equal(k, 3);
  static const char *const bad[] = {"-1", "x", "3x", "70000", "+2", "99999999999999999999"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    k = 5;
    assert_int_equal(embps_group_control_fanout(bad[i], 64, &k, &err), EMBPS_INVALID_ARGUMENT);
    assert_contains(err.message, "--control-fanout");
    assert_int_equal(k, 5);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hello_round_trip),
      cmocka_unit_test(test_hello_refused),
      cmocka_unit_test(test_verdict_round_trip),
      cmocka_unit_test(test_challenge_round_trip),
      cmocka_unit_test(test_notice_round_trip_and_bytes),
      cmocka_unit_test(test_round_round_trip),
      cmocka_unit_test(test_round_create_settings),
      cmocka_unit_test(test_checkpoint_round_trip),
      cmocka_unit_test(test_withdraw_round_trip_and_bytes),
      cmocka_unit_test(test_relay_round_trip_and_bytes),
      cmocka_unit_test(test_relay_topology),
      cmocka_unit_test(test_control_fanout_flag),
      cmocka_unit_test(test_broken_device_nccl_round_trip),
      cmocka_unit_test(test_truncated_and_oversized_payloads),
      cmocka_unit_test(test_bad_fields),
      cmocka_unit_test(test_frame_headers),
      cmocka_unit_test(test_garbage),
      cmocka_unit_test(test_allocation_failure),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
