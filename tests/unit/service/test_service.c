/* The service without sockets or threads: the network layer, the group and the engine are the
 * shared fakes of fake_group.h, which record answers and run ops on the test's thread, so every
 * call's decode, validation, reply encoding (the hand-laid LookupResponse above all) and every
 * allocation failure path can be checked directly, and the method table that dispatch and auth
 * read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "common/optimizer.h"
#include "kernels/embps_kernels.h" /* embps_init_value: the rows a new table starts with */
#include "server/service/service_internal.h"
#include "tests/unit/common/table_fields_fixture.h"
#include "tests/unit/service/fake_group.h"
#include "grpc/health/v1/health.pb-c.h"

TABLE_FIELDS_FIXTURE(config, embps_table_config_t)

/* ---- helpers ----------------------------------------------------------------------------- */
static embps_store_t *store;
static embps_service_t *svc;

static int setup(void **state) {
  embps_service_config_t cfg = {0};
  (void)state;
  assert_int_equal(embps_store_new(&store), EMBPS_OK);
  embps_store_set_budget(store, 1 << 26, 0); /* CreateTable's limit (--max-memory-bytes) */
  assert_int_equal(embps_service_new(&svc, NULL, store, &cfg), EMBPS_OK);
  fake_reset(store);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  embps_service_free(svc);
  embps_store_free(store);
  fake_reset(NULL);
  return 0;
}

/* The last request's bytes (valid while the service holds them). */
static const uint8_t *called_bytes;

/* Calls the service with the bytes of m, followed by those of m2 when not NULL (protobuf merges
 * the two: a field in both takes m2's value), in a fresh embps_malloc'd buffer. */
static void call2(embps_net_call_t *c, const char *method, const ProtobufCMessage *m,
                  const ProtobufCMessage *m2) {
  size_t len = m ? protobuf_c_message_get_packed_size(m) : 0;
  size_t len2 = m2 ? protobuf_c_message_get_packed_size(m2) : 0;
  uint8_t *buf = NULL;
  memset(c, 0, sizeof(*c));
  if (len + len2) {
    buf = malloc(len + len2);
    if (len)
      protobuf_c_message_pack(m, buf);
    if (len2)
      protobuf_c_message_pack(m2, buf + len);
  }
  called_bytes = buf;
  embps_service_on_request(svc, c, method, buf, len + len2);
}

static void call(embps_net_call_t *c, const char *method, const ProtobufCMessage *m) {
  call2(c, method, m, NULL);
}

static void create(embps_net_call_t *c, const char *name, uint64_t rows, uint32_t width) {
  Embps__V1__CreateTableRequest req = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
  Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
  spec.name = (char *)name;
  spec.rows = rows;
  spec.emb_width = width;
  spec.seed = 11;
  req.spec = &spec;
  call(c, "/embps.v1.EmbeddingService/CreateTable", &req.base);
  fake_run_engine();
}

static void lookup(embps_net_call_t *c, const char *table, const int64_t *tokens, size_t n,
                   uint64_t batch_id) {
  Embps__V1__LookupRequest req = EMBPS__V1__LOOKUP_REQUEST__INIT;
  req.table = (char *)table;
  req.batch_id = batch_id;
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = n * sizeof(int64_t);
  call(c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  fake_run_engine();
}

/* ---- tests ------------------------------------------------------------------------------- */

/* A lookup whose engine publishes its rows in odd-sized chunks answers with a streamed reply
 * byte-identical to the whole one, and every byte was final when it was announced (the fake net
 * copies bytes as they are announced and compares at the end). */
static void test_lookup_streamed_in_chunks(void **state) {
  embps_net_call_t c, whole;
  int64_t tokens[37];
  (void)state;
  for (size_t i = 0; i < 37; i++)
    tokens[i] = (int64_t)((i * 7) % 50);
  create(&c, "chunks", 50, 6);
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);
  lookup(&whole, "chunks", tokens, 37, 5);
  assert_int_equal(whole.status, EMBPS_OK);
  assert_false(whole.begun);
  size_t sizes[] = {1, 3, 5, 36, 37, 64};
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
    fake.chunk_rows = sizes[k];
    lookup(&c, "chunks", tokens, 37, 5);
    fake.chunk_rows = 0;
    assert_true(c.begun);
    assert_int_equal(c.readies, (37 + sizes[k] - 1) / sizes[k] + 1); /* chunks, then the end */
    assert_int_equal(c.status, EMBPS_OK);
    assert_int_equal(c.len, whole.len);
    assert_memory_equal(c.body, whole.body, whole.len);
    fake_call_release(&c);
  }
  /* While the connection carries other calls the stream does not begin: shared when the call
   * arrives, the engine publishes nothing and the reply goes whole; shared for the first two
   * chunks only, it begins with the third. Same bytes either way. */
  const char *scripts[] = {"1", "011"};
  for (size_t k = 0; k < 2; k++) {
    fake.chunk_rows = 5;
    fake.conn_shared_script = scripts[k];
    lookup(&c, "chunks", tokens, 37, 5);
    fake.chunk_rows = 0;
    assert_int_equal(*fake.conn_shared_script, 0); /* every answer was asked for */
    assert_int_equal(c.begun, k == 1);
    if (k == 1)
      assert_int_equal(c.readies, 8 - 2 + 1); /* the third chunk begins it, then the end */
    assert_int_equal(c.status, EMBPS_OK);
    assert_int_equal(c.len, whole.len);
    assert_memory_equal(c.body, whole.body, whole.len);
    fake_call_release(&c);
  }
  fake_call_release(&whole);
}

/* A lookup that fails after its first chunk went out ends its streamed reply with the error
 * (the net sends it in trailers), never with OK, and its buffer goes back once. */
static void test_lookup_fails_after_first_chunk(void **state) {
  embps_net_call_t c;
  int64_t tokens[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  (void)state;
  create(&c, "midfail", 10, 4);
  fake_call_release(&c);
  fake.chunk_rows = 3;
  fake.fail_after_chunk = 1;
  lookup(&c, "midfail", tokens, 8, 1);
  fake.chunk_rows = 0;
  fake.fail_after_chunk = 0;
  assert_true(c.begun);
  assert_int_equal(c.answers, 1);
  assert_int_equal(c.status, EMBPS_UNAVAILABLE);
  assert_string_equal(c.message, "fake: the group broke mid-round");
  assert_null(c.stream_release); /* released */
  fake_call_release(&c);
}

static void test_create_and_lookup_reply_encoding(void **state) {
  embps_net_call_t c;
  int64_t tokens[] = {3, 0, 9, 3};
  Embps__V1__LookupResponse *resp;
  Embps__V1__CreateTableResponse *cr;
  (void)state;
  create(&c, "enc", 10, 6);
  assert_int_equal(c.answers, 1);
  assert_int_equal(c.status, EMBPS_OK);
  cr = embps__v1__create_table_response__unpack(NULL, c.len, c.body);
  assert_non_null(cr);
  assert_int_equal(cr->spec->dtype, EMBPS__V1__DTYPE__DTYPE_F32);
  assert_int_equal(cr->spec->optimizer->kind, EMBPS__V1__OPTIMIZER_KIND__OPTIMIZER_ROWWISE_ADAGRAD);
  assert_int_equal(cr->group_size, 1);
  embps__v1__create_table_response__free_unpacked(cr, NULL);
  fake_call_release(&c);

  /* batch ids across the varint boundaries */
  uint64_t ids[] = {0, 1, 127, 128, 300, UINT64_MAX};
  for (size_t k = 0; k < sizeof(ids) / sizeof(ids[0]); k++) {
    lookup(&c, "enc", tokens, 4, ids[k]);
    assert_int_equal(c.status, EMBPS_OK);
    resp = embps__v1__lookup_response__unpack(NULL, c.len, c.body);
    assert_non_null(resp);
    assert_true(resp->batch_id == ids[k]);
    assert_int_equal(resp->emb_width, 6);
    assert_int_equal(resp->dtype, EMBPS__V1__DTYPE__DTYPE_F32);
    assert_int_equal(resp->rows.len, 4 * 6 * sizeof(float));
    const float *rows = (const float *)resp->rows.data;
    embps_table_t *t = embps_store_find(store, "enc");
    for (int i = 0; i < 4; i++)
      for (int col = 0; col < 6; col++)
        assert_true(rows[i * 6 + col] == embps_init_value(11, (uint64_t)tokens[i], (uint64_t)col,
                                                          embps_table_config(t)->init_scale));
    embps__v1__lookup_response__free_unpacked(resp, NULL);
    fake_call_release(&c);
  }
}

/* A table's settings through the service's TableSpec encoder (CreateTable's and ListTables'
 * replies), protobuf's bytes and its decoder (CreateTable's request), each setting a value no
 * other has: one forgotten or crossed fails by name. Without an OptimizerConfig, its settings
 * are zero (the optimizer's defaults, once resolved). */
static void test_table_settings_through_protobuf(void **state) {
  Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT, *back;
  Embps__V1__OptimizerConfig opt = EMBPS__V1__OPTIMIZER_CONFIG__INIT, *unpacked_opt;
  embps_table_config_t c, got;
  uint8_t buf[512];
  size_t len;
  (void)state;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "settings");
  config_fill(&c);
  embps__svc_spec_from_config(&c, &spec, &opt);
  assert_true(spec.optimizer == &opt);
  len = protobuf_c_message_get_packed_size(&spec.base);
  assert_true(len <= sizeof(buf));
  protobuf_c_message_pack(&spec.base, buf);
  back = embps__v1__table_spec__unpack(NULL, len, buf);
  assert_non_null(back);
  memset(&got, 0xa5, sizeof(got));
  embps__svc_config_from_spec(back, &got);
  assert_string_equal(got.name, "settings");
  config_assert_same(&got, &c);
  unpacked_opt = back->optimizer;
  back->optimizer = NULL;
  embps__svc_config_from_spec(back, &got);
  assert_true(got.rows == c.rows && got.seed == c.seed && got.init_scale == c.init_scale);
  assert_int_equal(got.optimizer, 0);
  assert_true(got.lr == 0.0f && got.beta2 == 0.0f);
  back->optimizer = unpacked_opt;
  embps__v1__table_spec__free_unpacked(back, NULL);
}

static void test_validation_messages(void **state) {
  embps_net_call_t c;
  int64_t ok[] = {1, 2}, out_of_range[] = {1, 10};
  (void)state;
  create(&c, "val", 10, 4);
  fake_call_release(&c);
  lookup(&c, "missing", ok, 2, 1);
  assert_int_equal(c.status, EMBPS_NOT_FOUND);
  assert_string_equal(c.message, "table 'missing' not found");
  lookup(&c, "val", out_of_range, 2, 1);
  assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(c.message, "token 10 at position 1 is outside [0, 10)"));
  assert_int_equal(fake.num_queued, 0); /* nothing reached the engine */
  create(&c, "val", 10, 4);
  assert_int_equal(c.status, EMBPS_ALREADY_EXISTS);
  create(&c, "huge", 1 << 20, 64); /* 256 MiB of rows: beyond the 64 MiB budget alone */
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(c.message, "more than this rank's memory budget of 67108864 "
                                    "(--max-memory-bytes)"));
  assert_int_equal(fake.num_queued, 0);
  call(&c, "/embps.v1.EmbeddingService/Nope", NULL);
  assert_int_equal(c.status, EMBPS_UNIMPLEMENTED);
  assert_non_null(strstr(c.message, "/embps.v1.EmbeddingService/Nope"));
  {
    uint8_t *junk = malloc(3);
    memcpy(junk, "\xff\xff\xff", 3);
    memset(&c, 0, sizeof(c));
    embps_service_on_request(svc, &c, "/embps.v1.EmbeddingService/Lookup", junk, 3);
    assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
    assert_non_null(strstr(c.message, "malformed LookupRequest"));
  }
}

/* A lookup whose reply would pass --max-message-bytes, or that its connection cannot hold, is
 * refused before anything is allocated or queued. */
static void test_reply_limits(void **state) {
  embps_net_call_t c;
  Embps__V1__LookupRequest req = EMBPS__V1__LOOKUP_REQUEST__INIT;
  int64_t tokens[8] = {0, 1, 0, 1, 0, 1, 0, 1};
  (void)state;
  create(&c, "wide", 2, 1024); /* a row is 4 KiB: 8 tokens make a 32 KiB reply */
  fake_call_release(&c);
  req.table = "wide";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  svc->cfg.max_reply_bytes = 8 * 4096 - 1;
  fake.held_reply_bytes = 0;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(c.message, "32768 bytes of rows (8 tokens of emb_width=1024 f32)"));
  assert_non_null(strstr(c.message, "more than --max-message-bytes=32767"));
  assert_int_equal(fake.num_queued, 0);
  assert_int_equal(embps_service_inflight(svc), 0);
  assert_int_equal(fake.held_reply_bytes, 0);

  svc->cfg.max_reply_bytes = 8 * 4096; /* exactly the rows: allowed */
  fake.refuse_hold = 1;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_string_equal(c.message, "fake: connection full");
  assert_int_equal(fake.num_queued, 0);

  fake.refuse_hold = 0;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(fake.num_queued, 1);
  assert_true(fake.held_reply_bytes > 8 * 4096 &&
              fake.held_reply_bytes < 8 * 4096 + 64); /* + header */
  fake_run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);
  svc->cfg.max_reply_bytes = 0;
}

static void test_async_push_answered_when_ordered(void **state) {
  embps_net_call_t c;
  Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  Embps__V1__PushGradientsResponse *resp;
  int64_t tokens[] = {1, 2};
  float g[8] = {0};
  (void)state;
  create(&c, "async", 10, 4);
  fake_call_release(&c);
  req.table = "async";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(c.answers, 0); /* not before the leader ordered it */
  assert_int_equal(fake.num_queued, 1);
  fake_order_queued();
  assert_int_equal(c.answers, 1); /* once ordered, before the engine ran it */
  resp = embps__v1__push_gradients_response__unpack(NULL, c.len, c.body);
  assert_true(resp->ordered);
  assert_false(resp->applied);
  embps__v1__push_gradients_response__free_unpacked(resp, NULL);
  fake_call_release(&c);
  fake_run_engine(); /* frees the request */
  assert_int_equal(embps_service_inflight(svc), 0);

  /* A batch that fails before it is ordered was never promised: the client gets the error. */
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(c.answers, 0);
  fake_fail_queued(EMBPS_DEADLINE_EXCEEDED, "batch 7: shard 1 did not arrive");
  assert_int_equal(c.answers, 1);
  assert_int_equal(c.status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(c.message, "did not arrive"));
  fake_call_release(&c);
  assert_int_equal(embps_service_inflight(svc), 0);
}

/* A lookup's and a push's shard carry their call's deadline into the group, which bounds the batch
 * with it; a call without one carries none. */
static void test_deadline_reaches_the_group(void **state) {
  embps_net_call_t c;
  Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  Embps__V1__LookupRequest lreq = EMBPS__V1__LOOKUP_REQUEST__INIT;
  int64_t tokens[] = {1, 2};
  float g[8] = {0};
  (void)state;
  create(&c, "dl", 10, 4);
  fake_call_release(&c);
  req.table = "dl";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  fake.deadline_ns = UINT64_C(123456789);
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(fake.num_queued, 1);
  assert_true(fake.queued[0]->deadline_ns == UINT64_C(123456789));
  fake_fail_queued(EMBPS_DEADLINE_EXCEEDED, "batch 0: the deadline its caller set passed");
  assert_int_equal(c.status, EMBPS_DEADLINE_EXCEEDED);
  fake_call_release(&c);
  fake.deadline_ns = UINT64_C(987654321);
  lreq.table = "dl";
  lreq.tokens = req.tokens;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &lreq.base);
  assert_int_equal(fake.num_queued, 1);
  assert_true(fake.queued[0]->deadline_ns == UINT64_C(987654321));
  fake_fail_queued(EMBPS_DEADLINE_EXCEEDED, "late");
  fake_call_release(&c);
  fake.deadline_ns = 0;
  lookup(&c, "dl", tokens, 2, 9);
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);
  assert_int_equal(embps_service_inflight(svc), 0);
}

/* A lookup's and a push's shard carry their batch's digest and attempt into the group; a shard
 * whose caller goes away before it is answered is withdrawn (once, and never after its answer);
 * a push the group answers from its retry window says `replayed`. */
static void test_digest_attempt_and_withdrawal(void **state) {
  embps_net_call_t c;
  Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  Embps__V1__PushGradientsResponse *resp;
  Embps__V1__LookupRequest lreq = EMBPS__V1__LOOKUP_REQUEST__INIT;
  int64_t tokens[] = {1, 2};
  float g[8] = {0};
  (void)state;
  create(&c, "wd", 10, 4);
  fake_call_release(&c);
  req.table = lreq.table = "wd";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.client_id = lreq.client_id = 99;
  req.batch_id = lreq.batch_id = 5;
  req.digest = lreq.digest = UINT64_C(0xfeedfacecafebeef);
  req.attempt = lreq.attempt = 2;
  lreq.tokens = req.tokens;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &lreq.base);
  assert_int_equal(fake.num_queued, 1);
  assert_true(fake.queued[0]->digest == UINT64_C(0xfeedfacecafebeef));
  assert_int_equal(fake.queued[0]->attempt, 2);
  fake_cancel(&c);
  assert_int_equal(fake.withdrawn, 1);
  assert_ptr_equal(fake.last_withdrawn, fake.queued[0]);
  fake_cancel(&c); /* the net runs the hook once */
  assert_int_equal(fake.withdrawn, 1);
  fake_fail_queued(EMBPS_CANCELLED, "batch 5 was cancelled before it was ordered");
  assert_int_equal(c.status, EMBPS_CANCELLED);
  fake_call_release(&c);

  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(fake.num_queued, 1);
  assert_true(fake.queued[0]->client_id == 99 && fake.queued[0]->batch_id == 5);
  assert_true(fake.queued[0]->digest == UINT64_C(0xfeedfacecafebeef));
  assert_int_equal(fake.queued[0]->attempt, 2);
  fake.queued[0]->replayed = 1; /* as the group sets it for a push it answers from its window */
  fake_run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  resp = embps__v1__push_gradients_response__unpack(NULL, c.len, c.body);
  assert_non_null(resp);
  assert_true(resp->replayed);
  assert_true(resp->applied);
  embps__v1__push_gradients_response__free_unpacked(resp, NULL);
  fake_cancel(&c); /* answered: nothing is withdrawn */
  assert_int_equal(fake.withdrawn, 1);
  fake_call_release(&c);
  assert_int_equal(embps_service_inflight(svc), 0);
}

/* On a host backend a push's gradients are read where they arrived, inside the request's bytes
 * (which the request then keeps until it is done); with the CUDA backend they are unpacked into
 * the pool. Either way the op sees the same gradients and the fields after them (mode). A
 * message that repeats the gradients takes the last, as protobuf does; a wrong length is
 * refused. */
static void test_push_gradients_in_place(void **state) {
  embps_net_call_t c;
  Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  Embps__V1__PushGradientsRequest again = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  int64_t tokens[] = {3, 1, 3};
  float g[12], junk[3] = {7, 7, 7};
  (void)state;
  for (int i = 0; i < 12; i++)
    g[i] = (float)i - 5.5f;
  create(&c, "inplace", 10, 4);
  fake_call_release(&c);
  req.table = "inplace";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC; /* packed after the gradients */

  for (int device = -1; device <= 0; device++) {
    const uint8_t *bytes;
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    fake.host_device = device;
    call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
    bytes = called_bytes;
    assert_int_equal(fake.num_queued, 1);
    fake_order_queued();
    assert_int_equal(c.answers, 1); /* async: the mode after the gradients was read */
    assert_int_equal(c.status, EMBPS_OK);
    fake_call_release(&c);
    fake_run_engine();
    assert_memory_equal(fake.pushed_copy, g, sizeof(g));
    if (device < 0) /* in place: inside the request's bytes */
      assert_true((const uint8_t *)fake.pushed_grads > bytes &&
                  (const uint8_t *)fake.pushed_grads + sizeof(g) <= bytes + len);
    assert_int_equal(embps_service_inflight(svc), 0);
  }
  fake.host_device = -1;

  /* The gradients twice: the last wins. */
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC;
  req.gradients.data = (uint8_t *)junk;
  req.gradients.len = sizeof(junk);
  again.gradients.data = (uint8_t *)g;
  again.gradients.len = sizeof(g);
  call2(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base, &again.base);
  assert_int_equal(fake.num_queued, 1);
  fake_run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  assert_memory_equal(fake.pushed_copy, g, sizeof(g));
  fake_call_release(&c);

  /* And once, of the wrong length: refused, nothing queued. */
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(fake.num_queued, 0);
  assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(c.message, "gradients hold 12 bytes, but 3 tokens"));
  fake_call_release(&c);
  free(fake.pushed_copy);
  fake.pushed_copy = NULL;
}

/* Every optimizer has a fused table update on every backend, so the service refuses no async push
 * for its optimizer: an async push of each optimizer's table, on each backend, is ordered and
 * applied. */
/* Assign: PushGradients' checks and in-place read, its rows and reset_state reach the engine,
 * and the answer carries the engine's counts; rows of the wrong size, a token out of range and
 * a dtype other than the table's are refused with nothing queued. */
static void test_assign(void **state) {
  embps_net_call_t c;
  Embps__V1__AssignRequest req = EMBPS__V1__ASSIGN_REQUEST__INIT;
  Embps__V1__AssignResponse *resp;
  int64_t tokens[] = {3, 1, 3}, far[] = {3, 10, 1};
  float rows[12];
  (void)state;
  for (int i = 0; i < 12; i++)
    rows[i] = (float)i * 0.5f;
  create(&c, "assigned", 10, 4);
  fake_call_release(&c);
  req.table = "assigned";
  req.batch_id = 77;
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.rows.data = (uint8_t *)rows;
  req.rows.len = sizeof(rows);
  req.reset_state = 1;
  for (int device = -1; device <= 0; device++) {
    const uint8_t *bytes;
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    fake.host_device = device;
    call(&c, "/embps.v1.EmbeddingService/Assign", &req.base);
    bytes = called_bytes;
    assert_int_equal(fake.num_queued, 1);
    assert_int_equal(fake.queued[0]->op.kind, EMBPS_OP_ASSIGN);
    assert_int_equal(fake.queued[0]->op.reset_state, 1);
    assert_int_equal(fake.queued[0]->batch_id, 77);
    fake_run_engine();
    assert_int_equal(c.status, EMBPS_OK);
    assert_memory_equal(fake.pushed_copy, rows, sizeof(rows));
    if (device < 0) /* in place: inside the request's bytes */
      assert_true((const uint8_t *)fake.pushed_grads > bytes &&
                  (const uint8_t *)fake.pushed_grads + sizeof(rows) <= bytes + len);
    resp = embps__v1__assign_response__unpack(NULL, c.len, c.body);
    assert_non_null(resp);
    assert_int_equal(resp->batch_id, 77);
    assert_int_equal(resp->num_assigned, 3); /* the fake's count: every token */
    embps__v1__assign_response__free_unpacked(resp, NULL);
    fake_call_release(&c);
    assert_int_equal(embps_service_inflight(svc), 0);
  }
  fake.host_device = -1;

  req.rows.len = sizeof(rows) - 4;
  call(&c, "/embps.v1.EmbeddingService/Assign", &req.base);
  assert_int_equal(fake.num_queued, 0);
  assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
  assert_string_equal(c.message, "rows hold 44 bytes, but 3 tokens of emb_width=4 f32 need 48");
  fake_call_release(&c);
  req.rows.len = sizeof(rows);
  req.tokens.data = (uint8_t *)far;
  call(&c, "/embps.v1.EmbeddingService/Assign", &req.base);
  assert_int_equal(fake.num_queued, 0);
  assert_non_null(strstr(c.message, "token 10 at position 1 is outside [0, 10)"));
  fake_call_release(&c);
  req.tokens.data = (uint8_t *)tokens;
  req.dtype = EMBPS__V1__DTYPE__DTYPE_BF16;
  call(&c, "/embps.v1.EmbeddingService/Assign", &req.base);
  assert_int_equal(fake.num_queued, 0);
  assert_non_null(strstr(c.message, "dtype mismatch"));
  fake_call_release(&c);
  free(fake.pushed_copy);
  fake.pushed_copy = NULL;
}

static void test_async_push_every_optimizer(void **state) {
#define OPTIMIZER_KIND(kind, ...) EMBPS_OPTIMIZER_##kind,
  static const embps_optimizer_t kinds[] = {EMBPS_OPTIMIZERS(OPTIMIZER_KIND)};
#undef OPTIMIZER_KIND
  static const embps_backend_t backends[] = {EMBPS_BACKEND_CPU, EMBPS_BACKEND_CUDA};
  embps_net_call_t c;
  int64_t tokens[] = {1, 2};
  float g[8] = {0};
  (void)state;
  for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
    Embps__V1__CreateTableRequest creq = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
    Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
    Embps__V1__OptimizerConfig opt = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
    Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
    char name[32];
    snprintf(name, sizeof(name), "fused-%s", embps_optimizer_name(kinds[k]));
    spec.name = name;
    spec.rows = 10;
    spec.emb_width = 4;
    opt.kind = (Embps__V1__OptimizerKind)kinds[k];
    spec.optimizer = &opt;
    creq.spec = &spec;
    call(&c, "/embps.v1.EmbeddingService/CreateTable", &creq.base);
    fake_run_engine();
    assert_int_equal(c.status, EMBPS_OK);
    fake_call_release(&c);
    req.table = name;
    req.tokens.data = (uint8_t *)tokens;
    req.tokens.len = sizeof(tokens);
    req.gradients.data = (uint8_t *)g;
    req.gradients.len = sizeof(g);
    req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
    for (size_t b = 0; b < 2; b++) {
      Embps__V1__PushGradientsResponse *resp;
      fake.backend = backends[b];
      call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
      fake.backend = EMBPS_BACKEND_CPU;
      assert_int_equal(fake.num_queued, 1);
      fake_run_engine();
      assert_int_equal(c.status, EMBPS_OK);
      resp = embps__v1__push_gradients_response__unpack(NULL, c.len, c.body);
      assert_non_null(resp);
      assert_true(resp->ordered);
      embps__v1__push_gradients_response__free_unpacked(resp, NULL);
      fake_call_release(&c);
    }
  }
  assert_int_equal(embps_service_inflight(svc), 0);
}

/* Fail the k-th allocation for every k along each call: every call is still answered exactly
 * once, with OK or RESOURCE_EXHAUSTED, and (under the sanitizer build) nothing leaks. */
static void test_allocation_failures(void **state) {
  (void)state;
  for (long k = 1; k <= 12; k++) {
    embps_net_call_t c;
    char name[32];
    int64_t tokens[] = {1, 2, 3};
    snprintf(name, sizeof(name), "fail%ld", k);

    embps_alloc_fail_after(k);
    create(&c, name, 8, 4);
    embps_alloc_fail_after(0);
    assert_int_equal(c.answers, 1);
    if (c.status != EMBPS_OK) {
      assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
      /* A failed create leaves nothing behind, unless only the reply's packing failed after the
       * table was made: then the table is whole. */
      embps_table_t *t = embps_store_find(store, name);
      assert_true(t == NULL || embps_table_arrays(t).data != NULL);
    }
    fake_call_release(&c);
    if (!embps_store_find(store, name))
      create(&c, name, 8, 4), fake_call_release(&c);

    embps_alloc_fail_after(k);
    lookup(&c, name, tokens, 3, 5);
    embps_alloc_fail_after(0);
    assert_int_equal(c.answers, 1);
    assert_true(c.status == EMBPS_OK || c.status == EMBPS_RESOURCE_EXHAUSTED);
    fake_call_release(&c);

    Embps__V1__GetStatsRequest sreq = EMBPS__V1__GET_STATS_REQUEST__INIT;
    embps_alloc_fail_after(k);
    call(&c, "/embps.v1.EmbeddingService/GetStats", &sreq.base);
    embps_alloc_fail_after(0);
    assert_int_equal(c.answers, 1);
    fake_call_release(&c);

    Embps__V1__ListTablesRequest lreq = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
    embps_alloc_fail_after(k);
    call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
    embps_alloc_fail_after(0);
    assert_int_equal(c.answers, 1);
    fake_call_release(&c);
  }
  assert_int_equal(embps_service_inflight(svc), 0);
}

/* The method table is the .protos' services: every method they declare has a row with a
 * handler, every row names a declared method (but Health/Watch, which the standard health
 * service has and the project's copy of its .proto leaves out: open and UNIMPLEMENTED here), and
 * no path has two rows. A path not in the table is UNIMPLEMENTED. */
static void test_method_table(void **state) {
  const ProtobufCServiceDescriptor *services[] = {&embps__v1__embedding_service__descriptor,
                                                  &grpc__health__v1__health__descriptor};
  char path[256];
  embps_net_call_t c;
  (void)state;
  for (size_t s = 0; s < 2; s++)
    for (unsigned i = 0; i < services[s]->n_methods; i++) {
      const embps__svc_method_t *m;
      snprintf(path, sizeof(path), "/%s/%s", services[s]->name, services[s]->methods[i].name);
      m = embps__svc_method(path);
      if (!m)
        fail_msg("%s has no row in the method table", path);
      if (!m->handler)
        fail_msg("%s has no handler", path);
    }
  for (size_t k = 0; k < embps__svc_num_methods; k++) {
    const char *p = embps__svc_methods[k].path;
    int declared = strcmp(p, "/grpc.health.v1.Health/Watch") == 0;
    assert_ptr_equal(embps__svc_method(p), &embps__svc_methods[k]); /* the first row of its path */
    for (size_t s = 0; s < 2; s++)
      for (unsigned i = 0; i < services[s]->n_methods; i++) {
        snprintf(path, sizeof(path), "/%s/%s", services[s]->name, services[s]->methods[i].name);
        declared |= strcmp(path, p) == 0;
      }
    if (!declared)
      fail_msg("%s is not a method of the .proto", p);
  }
  assert_null(embps__svc_method("/embps.v1.EmbeddingService/Nope"));
  call(&c, "/grpc.health.v1.Health/Watch", NULL);
  assert_int_equal(c.status, EMBPS_UNIMPLEMENTED);
  assert_string_equal(c.message, "unknown method /grpc.health.v1.Health/Watch");
  call(&c, "/fuzz.Other/Call", NULL);
  assert_int_equal(c.status, EMBPS_UNIMPLEMENTED);
}

/* With tokens set, every call is checked before its method runs: refused calls change nothing
 * and never reach the engine, health stays open, and each role reaches what it may. */
static void test_auth_checked_before_dispatch(void **state) {
  static const char tokens[] = "admin  admin-token-0123456789\n"
                               "worker worker-token-0123456789\n"
                               "reader reader-token-0123456789\n";
  embps_auth_t *auth;
  embps_error_t err;
  embps_net_call_t c;
  int64_t tok[] = {1, 2};
  Embps__V1__ListTablesRequest lreq = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
  Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  Embps__V1__PushGradientsRequest preq = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  (void)state;
  assert_int_equal(embps_auth_parse(&auth, tokens, sizeof(tokens) - 1, "tokens", &err), EMBPS_OK);
  embps_service_set_auth(svc, auth);

  fake.authorization = NULL;
  call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
  assert_int_equal(c.status, EMBPS_UNAUTHENTICATED);
  assert_string_equal(c.message, "missing authorization metadata: this server requires "
                                 "'authorization: Bearer TOKEN'");
  call(&c, "/grpc.health.v1.Health/Check", &hreq.base);
  assert_int_equal(c.status, EMBPS_OK); /* probes need no token */
  fake_call_release(&c);

  fake.authorization = "Bearer not-a-known-token-0000";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_UNAUTHENTICATED);
  assert_string_equal(c.message, "the bearer token is not known to this server");

  fake.authorization = "Bearer worker-token-0123456789";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_PERMISSION_DENIED);
  assert_string_equal(c.message, "role 'worker' may not call CreateTable (needs 'admin')");
  assert_null(embps_store_find(store, "authed")); /* refused: nothing changed */
  assert_int_equal(fake.num_queued, 0);

  fake.authorization = "Bearer admin-token-0123456789";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);

  fake.authorization = "bearer reader-token-0123456789"; /* the scheme is case-insensitive */
  lookup(&c, "authed", tok, 2, 1);
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);
  preq.table = "authed";
  preq.tokens.data = (uint8_t *)tok;
  preq.tokens.len = sizeof(tok);
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &preq.base);
  assert_int_equal(c.status, EMBPS_PERMISSION_DENIED);
  assert_string_equal(c.message, "role 'reader' may not call PushGradients (needs 'worker')");
  assert_int_equal(fake.num_queued, 0);

  fake.authorization = "Bearer worker-token-0123456789";
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &preq.base);
  assert_int_not_equal(c.status, EMBPS_PERMISSION_DENIED); /* let through to validation */
  assert_int_not_equal(c.status, EMBPS_UNAUTHENTICATED);
  fake_run_engine();
  fake_call_release(&c);

  embps_service_set_auth(svc, NULL);
  embps_auth_free(auth);
  fake.authorization = NULL;
  call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
  assert_int_equal(c.status, EMBPS_OK); /* auth off: open as before */
  fake_call_release(&c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lookup_streamed_in_chunks),
      cmocka_unit_test(test_lookup_fails_after_first_chunk),
      cmocka_unit_test(test_create_and_lookup_reply_encoding),
      cmocka_unit_test(test_table_settings_through_protobuf),
      cmocka_unit_test(test_validation_messages),
      cmocka_unit_test(test_reply_limits),
      cmocka_unit_test(test_async_push_answered_when_ordered),
      cmocka_unit_test(test_deadline_reaches_the_group),
      cmocka_unit_test(test_digest_attempt_and_withdrawal),
      cmocka_unit_test(test_push_gradients_in_place),
      cmocka_unit_test(test_assign),
      cmocka_unit_test(test_async_push_every_optimizer),
      cmocka_unit_test(test_allocation_failures),
      cmocka_unit_test(test_method_table),
      cmocka_unit_test(test_auth_checked_before_dispatch),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
