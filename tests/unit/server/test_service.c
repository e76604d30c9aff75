/* The service without sockets or threads: the network layer and the engine are replaced by
 * fakes that record answers and run ops on the test's thread, so every call's decode,
 * validation, reply encoding (the hand-laid LookupResponse above all) and every allocation
 * failure path can be checked directly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>

#include "kernels/embps_kernels.h" /* the fake engine runs the kernels */
#include "server/service/service.c"
#include "tests/unit/common/table_fields_fixture.h"

TABLE_FIELDS_FIXTURE(config, embps_table_config_t)

/* ---- fakes ------------------------------------------------------------------------------- */

struct embps_net_call {
  int answered;
  embps_status_t status;
  char message[512];
  uint8_t *body;
  size_t len;
  /* a streamed reply (embps_net_call_reply_begin): the body as the net holds it, and a copy of
   * every byte announced ready, taken when announced, to prove later writes never changed it */
  int begun, readies;
  const uint8_t *stream_body;
  size_t stream_len, stream_ready;
  uint8_t *announced;
  void (*stream_release)(void *);
  void *stream_release_arg;
};

void embps_net_call_reply(embps_net_call_t *call, const uint8_t *body, size_t len,
                          void (*release)(void *), void *release_arg) {
  assert_false(call->answered);
  call->answered = 1;
  call->status = EMBPS_OK;
  call->body = malloc(len ? len : 1);
  memcpy(call->body, body, len);
  call->len = len;
  if (release)
    release(release_arg);
}

static void announce(embps_net_call_t *call, size_t ready) {
  if (ready > call->stream_len)
    ready = call->stream_len;
  assert_true(ready >= call->stream_ready);
  memcpy(call->announced + call->stream_ready, call->stream_body + call->stream_ready,
         ready - call->stream_ready);
  call->stream_ready = ready;
  call->readies++;
}

embps_status_t embps_net_call_reply_begin(embps_net_call_t *call, const uint8_t *body, size_t len,
                                          size_t ready, void (*release)(void *),
                                          void *release_arg) {
  assert_false(call->answered);
  assert_false(call->begun);
  call->begun = 1;
  call->stream_body = body;
  call->stream_len = len;
  call->stream_ready = 0;
  call->announced = malloc(len ? len : 1);
  call->stream_release = release;
  call->stream_release_arg = release_arg;
  announce(call, ready);
  return EMBPS_OK;
}

/* The fake connection's answers to whether it carries other calls, one character per question
 * ('1': it does), then "no" once they run out. */
static const char *conn_shared_script = "";

int embps_net_call_conn_shared(const embps_net_call_t *call) {
  (void)call;
  if (!*conn_shared_script)
    return 0;
  return *conn_shared_script++ == '1';
}

void embps_net_call_reply_ready(embps_net_call_t *call, size_t ready) {
  assert_true(call->begun);
  assert_false(call->answered);
  announce(call, ready);
}

/* The end of a streamed reply: what the client receives is the bytes as they were announced,
 * then the rest. */
static void end_stream(embps_net_call_t *call) {
  if (call->stream_release)
    call->stream_release(call->stream_release_arg);
  call->stream_release = NULL;
}

void embps_net_call_reply_end(embps_net_call_t *call) {
  assert_true(call->begun);
  assert_false(call->answered);
  announce(call, call->stream_len);
  call->answered = 1;
  call->status = EMBPS_OK;
  assert_memory_equal(call->announced, call->stream_body, call->stream_len);
  call->body = call->announced;
  call->announced = NULL;
  call->len = call->stream_len;
  end_stream(call);
}

void embps_net_call_fail(embps_net_call_t *call, embps_status_t status, const char *message) {
  if (call->begun)
    end_stream(call);
  assert_false(call->answered);
  assert_int_not_equal(status, EMBPS_OK);
  call->answered = 1;
  call->status = status;
  snprintf(call->message, sizeof(call->message), "%s", message);
}

/* The fake connection's reply accounting: what lookups asked to hold, and whether to refuse. */
static size_t held_reply_bytes;
static int refuse_hold;

embps_status_t embps_net_call_hold_reply(embps_net_call_t *call, size_t bytes, embps_error_t *err) {
  (void)call;
  if (refuse_hold)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "fake: connection full");
  held_reply_bytes += bytes;
  return EMBPS_OK;
}

/* The authorization header of the next calls (the fake call has no stream to keep one). */
static const char *fake_authorization;

const char *embps_net_call_authorization(const embps_net_call_t *call) {
  (void)call;
  return fake_authorization;
}

void embps_net_get_stats(const embps_net_t *net, embps_net_stats_t *out) {
  (void)net;
  memset(out, 0, sizeof(*out));
  out->requests = 7;
}

static embps_store_t *store;

/* The fake group (of one, ready) queues ops and runs them when the test says so. */
static embps_op_t *queued[64];
static int num_queued;

void embps_group_submit(embps_group_t *group, embps_op_t *op) {
  (void)group;
  queued[num_queued++] = op;
}

embps_group_state_t embps_group_state(embps_group_t *group, char *message, size_t cap) {
  (void)group;
  if (message)
    snprintf(message, cap, "ready");
  return EMBPS_GROUP_READY;
}

uint32_t embps_group_rank(const embps_group_t *group) {
  (void)group;
  return 0;
}

uint32_t embps_group_size(const embps_group_t *group) {
  (void)group;
  return 1;
}

static embps_backend_t fake_backend = EMBPS_BACKEND_CPU;
/* a value that names no backend: the registry fuses nothing on it */
#define UNKNOWN_BACKEND ((embps_backend_t)7)

embps_backend_t embps_group_backend(const embps_group_t *group) {
  (void)group;
  return fake_backend;
}

const char *embps_group_checkpoint_dir(const embps_group_t *group) {
  (void)group;
  return NULL;
}

/* -1: a host backend (cpu); a device number: cuda, whose requests are unpacked into the pool. */
static int fake_host_device = -1;

int embps_group_host_device(embps_group_t *group) {
  (void)group;
  return fake_host_device;
}

/* The engine's host memory, plain here (the real one pins for the CUDA backend). */
void *embps_host_alloc(int device, size_t bytes, int *pinned) {
  (void)device;
  *pinned = 0;
  return embps_aligned_alloc(bytes);
}

void embps_host_free(void *p, int pinned, size_t bytes) {
  (void)pinned, (void)bytes;
  embps_free(p);
}

void embps_group_comm_stats(embps_group_t *group, embps_comm_stats_t *out) {
  (void)group;
  memset(out, 0, sizeof(*out));
}

/* The leader orders every queued op: the ordered notices, as the group gives them. */
static void order_queued(void) {
  for (int i = 0; i < num_queued; i++)
    if (queued[i]->ordered)
      queued[i]->ordered(queued[i]);
}

/* Fails every queued op before it is ordered (a shard that never arrived). */
static void fail_queued(embps_status_t status, const char *msg) {
  for (int i = 0; i < num_queued; i++) {
    embps_error_set(&queued[i]->error, status, "%s", msg);
    queued[i]->done(queued[i]);
  }
  num_queued = 0;
}

/* The last push the fake engine ran: where its gradients were, and a copy of them. */
static const void *pushed_grads;
static uint8_t *pushed_copy;

/* How the fake engine fills a lookup: whole (0), or in chunks of this many rows, publishing
 * each as the group would; fail_after_chunk: the op fails after its first chunk. */
static size_t chunk_rows;
static int fail_after_chunk;

static void lookup_in_chunks(embps_op_t *op) {
  const embps_table_config_t *c = embps_table_config(op->table);
  const size_t row_bytes = c->emb_width * embps_dtype_size(c->dtype);
  for (size_t a = 0; a < op->num_tokens; a += chunk_rows) {
    size_t m = op->num_tokens - a < chunk_rows ? op->num_tokens - a : chunk_rows;
    embps_gather_cpu(embps_table_arrays(op->table).data, c->dtype,
                     embps_table_shard_width(op->table), op->tokens + a, m,
                     (uint8_t *)op->rows_out + a * row_bytes);
    atomic_store(&op->rows_ready, a + m);
    if (op->progress)
      op->progress(op);
    if (fail_after_chunk) {
      embps_error_set(&op->error, EMBPS_UNAVAILABLE, "fake: the group broke mid-round");
      return;
    }
  }
}

static void run_engine(void) {
  for (int i = 0; i < num_queued; i++) {
    embps_op_t *op = queued[i];
    embps_error_clear(&op->error);
    if (op->kind == EMBPS_OP_LOOKUP && chunk_rows) {
      lookup_in_chunks(op);
      op->done(op);
      continue;
    }
    if (op->kind == EMBPS_OP_CREATE_TABLE) {
      embps_table_t *t;
      if (embps_table_new(&t, &op->create, 0, 1) != EMBPS_OK)
        embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      else if (embps_store_add(store, t, &op->error) != EMBPS_OK)
        embps_table_free(t);
      else
        op->created = t;
    } else if (op->kind == EMBPS_OP_LOOKUP) {
      embps_gather_cpu(embps_table_arrays(op->table).data, embps_table_config(op->table)->dtype,
                       embps_table_shard_width(op->table), op->tokens, op->num_tokens,
                       op->rows_out);
    } else {
      const size_t bytes = op->num_tokens * embps_table_config(op->table)->emb_width * 4;
      pushed_grads = op->grads;
      free(pushed_copy);
      pushed_copy = malloc(bytes ? bytes : 1);
      memcpy(pushed_copy, op->grads, bytes);
      op->applied = 1;
      op->num_unique = op->num_tokens;
    }
    op->done(op);
  }
  num_queued = 0;
}

/* ---- helpers ----------------------------------------------------------------------------- */
static embps_service_t *svc;

static int setup(void **state) {
  embps_service_config_t cfg = {0};
  (void)state;
  assert_int_equal(embps_store_new(&store, 0, 1), EMBPS_OK);
  embps_store_set_budget(store, 1 << 26, 0); /* CreateTable's limit (--max-memory-bytes) */
  assert_int_equal(embps_service_new(&svc, NULL, store, &cfg), EMBPS_OK);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  embps_service_free(svc);
  embps_store_free(store);
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
  run_engine();
}

static void lookup(embps_net_call_t *c, const char *table, const int64_t *tokens, size_t n,
                   uint64_t batch_id) {
  Embps__V1__LookupRequest req = EMBPS__V1__LOOKUP_REQUEST__INIT;
  req.table = (char *)table;
  req.batch_id = batch_id;
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = n * sizeof(int64_t);
  call(c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  run_engine();
}

static void release_call(embps_net_call_t *c) {
  free(c->body);
  free(c->announced);
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
  release_call(&c);
  lookup(&whole, "chunks", tokens, 37, 5);
  assert_int_equal(whole.status, EMBPS_OK);
  assert_false(whole.begun);
  size_t sizes[] = {1, 3, 5, 36, 37, 64};
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
    chunk_rows = sizes[k];
    lookup(&c, "chunks", tokens, 37, 5);
    chunk_rows = 0;
    assert_true(c.begun);
    assert_int_equal(c.readies, (37 + sizes[k] - 1) / sizes[k] + 1); /* chunks, then the end */
    assert_int_equal(c.status, EMBPS_OK);
    assert_int_equal(c.len, whole.len);
    assert_memory_equal(c.body, whole.body, whole.len);
    release_call(&c);
  }
  /* While the connection carries other calls the stream does not begin: shared when the call
   * arrives, the engine publishes nothing and the reply goes whole; shared for the first two
   * chunks only, it begins with the third. Same bytes either way. */
  const char *scripts[] = {"1", "011"};
  for (size_t k = 0; k < 2; k++) {
    chunk_rows = 5;
    conn_shared_script = scripts[k];
    lookup(&c, "chunks", tokens, 37, 5);
    chunk_rows = 0;
    assert_int_equal(*conn_shared_script, 0); /* every answer was asked for */
    assert_int_equal(c.begun, k == 1);
    if (k == 1)
      assert_int_equal(c.readies, 8 - 2 + 1); /* the third chunk begins it, then the end */
    assert_int_equal(c.status, EMBPS_OK);
    assert_int_equal(c.len, whole.len);
    assert_memory_equal(c.body, whole.body, whole.len);
    release_call(&c);
  }
  release_call(&whole);
}

/* A lookup that fails after its first chunk went out ends its streamed reply with the error
 * (the net sends it in trailers), never with OK, and its buffer goes back once. */
static void test_lookup_fails_after_first_chunk(void **state) {
  embps_net_call_t c;
  int64_t tokens[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  (void)state;
  create(&c, "midfail", 10, 4);
  release_call(&c);
  chunk_rows = 3;
  fail_after_chunk = 1;
  lookup(&c, "midfail", tokens, 8, 1);
  chunk_rows = 0;
  fail_after_chunk = 0;
  assert_true(c.begun);
  assert_true(c.answered);
  assert_int_equal(c.status, EMBPS_UNAVAILABLE);
  assert_string_equal(c.message, "fake: the group broke mid-round");
  assert_null(c.stream_release); /* released */
  release_call(&c);
}

static void test_create_and_lookup_reply_encoding(void **state) {
  embps_net_call_t c;
  int64_t tokens[] = {3, 0, 9, 3};
  Embps__V1__LookupResponse *resp;
  Embps__V1__CreateTableResponse *cr;
  (void)state;
  create(&c, "enc", 10, 6);
  assert_true(c.answered);
  assert_int_equal(c.status, EMBPS_OK);
  cr = embps__v1__create_table_response__unpack(NULL, c.len, c.body);
  assert_non_null(cr);
  assert_int_equal(cr->spec->dtype, EMBPS__V1__DTYPE__DTYPE_F32);
  assert_int_equal(cr->spec->optimizer->kind, EMBPS__V1__OPTIMIZER_KIND__OPTIMIZER_ROWWISE_ADAGRAD);
  assert_int_equal(cr->group_size, 1);
  embps__v1__create_table_response__free_unpacked(cr, NULL);
  release_call(&c);

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
    release_call(&c);
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
  spec_from_config(&c, &spec, &opt);
  assert_true(spec.optimizer == &opt);
  len = protobuf_c_message_get_packed_size(&spec.base);
  assert_true(len <= sizeof(buf));
  protobuf_c_message_pack(&spec.base, buf);
  back = embps__v1__table_spec__unpack(NULL, len, buf);
  assert_non_null(back);
  memset(&got, 0xa5, sizeof(got));
  config_from_spec(back, &got);
  assert_string_equal(got.name, "settings");
  config_assert_same(&got, &c);
  unpacked_opt = back->optimizer;
  back->optimizer = NULL;
  config_from_spec(back, &got);
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
  release_call(&c);
  lookup(&c, "missing", ok, 2, 1);
  assert_int_equal(c.status, EMBPS_NOT_FOUND);
  assert_string_equal(c.message, "table 'missing' not found");
  lookup(&c, "val", out_of_range, 2, 1);
  assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(c.message, "token 10 at position 1 is outside [0, 10)"));
  assert_int_equal(num_queued, 0); /* nothing reached the engine */
  create(&c, "val", 10, 4);
  assert_int_equal(c.status, EMBPS_ALREADY_EXISTS);
  create(&c, "huge", 1 << 20, 64); /* 256 MiB of rows: beyond the 64 MiB budget alone */
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(c.message, "more than this rank's memory budget of 67108864 "
                                    "(--max-memory-bytes)"));
  assert_int_equal(num_queued, 0);
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
  release_call(&c);
  req.table = "wide";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  svc->cfg.max_reply_bytes = 8 * 4096 - 1;
  held_reply_bytes = 0;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(c.message, "32768 bytes of rows (8 tokens of emb_width=1024 f32)"));
  assert_non_null(strstr(c.message, "more than --max-message-bytes=32767"));
  assert_int_equal(num_queued, 0);
  assert_int_equal(embps_service_inflight(svc), 0);
  assert_int_equal(held_reply_bytes, 0);

  svc->cfg.max_reply_bytes = 8 * 4096; /* exactly the rows: allowed */
  refuse_hold = 1;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_string_equal(c.message, "fake: connection full");
  assert_int_equal(num_queued, 0);

  refuse_hold = 0;
  call(&c, "/embps.v1.EmbeddingService/Lookup", &req.base);
  assert_int_equal(num_queued, 1);
  assert_true(held_reply_bytes > 8 * 4096 && held_reply_bytes < 8 * 4096 + 64); /* + header */
  run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  release_call(&c);
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
  release_call(&c);
  req.table = "async";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_false(c.answered); /* not before the leader ordered it */
  assert_int_equal(num_queued, 1);
  order_queued();
  assert_true(c.answered); /* once ordered, before the engine ran it */
  resp = embps__v1__push_gradients_response__unpack(NULL, c.len, c.body);
  assert_true(resp->ordered);
  assert_false(resp->applied);
  embps__v1__push_gradients_response__free_unpacked(resp, NULL);
  release_call(&c);
  run_engine(); /* frees the request */
  assert_int_equal(embps_service_inflight(svc), 0);

  /* A batch that fails before it is ordered was never promised: the client gets the error. */
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_false(c.answered);
  fail_queued(EMBPS_DEADLINE_EXCEEDED, "batch 7: shard 1 did not arrive");
  assert_true(c.answered);
  assert_int_equal(c.status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(c.message, "did not arrive"));
  release_call(&c);
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
  release_call(&c);
  req.table = "inplace";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC; /* packed after the gradients */

  for (int device = -1; device <= 0; device++) {
    const uint8_t *bytes;
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    fake_host_device = device;
    call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
    bytes = called_bytes;
    assert_int_equal(num_queued, 1);
    order_queued();
    assert_true(c.answered); /* async: the mode after the gradients was read */
    assert_int_equal(c.status, EMBPS_OK);
    release_call(&c);
    run_engine();
    assert_memory_equal(pushed_copy, g, sizeof(g));
    if (device < 0) /* in place: inside the request's bytes */
      assert_true((const uint8_t *)pushed_grads > bytes &&
                  (const uint8_t *)pushed_grads + sizeof(g) <= bytes + len);
    assert_int_equal(embps_service_inflight(svc), 0);
  }
  fake_host_device = -1;

  /* The gradients twice: the last wins. */
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC;
  req.gradients.data = (uint8_t *)junk;
  req.gradients.len = sizeof(junk);
  again.gradients.data = (uint8_t *)g;
  again.gradients.len = sizeof(g);
  call2(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base, &again.base);
  assert_int_equal(num_queued, 1);
  run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  assert_memory_equal(pushed_copy, g, sizeof(g));
  release_call(&c);

  /* And once, of the wrong length: refused, nothing queued. */
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  assert_int_equal(num_queued, 0);
  assert_int_equal(c.status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(c.message, "gradients hold 12 bytes, but 3 tokens"));
  release_call(&c);
  free(pushed_copy);
  pushed_copy = NULL;
}

/* Async pushes need a fused update on the group's backend, as the optimizer registry says.
 * Every real combination has one, so the check is driven through a backend the registry does
 * not know. */
static void test_async_needs_fused_update(void **state) {
  embps_net_call_t c;
  Embps__V1__PushGradientsRequest req = EMBPS__V1__PUSH_GRADIENTS_REQUEST__INIT;
  int64_t tokens[] = {1, 2};
  float g[8] = {0};
  (void)state;
  assert_true(embps_optimizer_has_fused_update(EMBPS_OPTIMIZER_ADAM, EMBPS_BACKEND_CPU));
  assert_true(
      embps_optimizer_has_fused_update(EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_BACKEND_CUDA));
  assert_false(embps_optimizer_has_fused_update(EMBPS_OPTIMIZER_ADAM, UNKNOWN_BACKEND));
  create(&c, "fused", 10, 4);
  release_call(&c);
  req.table = "fused";
  req.tokens.data = (uint8_t *)tokens;
  req.tokens.len = sizeof(tokens);
  req.gradients.data = (uint8_t *)g;
  req.gradients.len = sizeof(g);
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
  fake_backend = UNKNOWN_BACKEND;
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  fake_backend = EMBPS_BACKEND_CPU;
  assert_int_equal(c.status, EMBPS_FAILED_PRECONDITION);
  assert_non_null(strstr(c.message, "async updates require an optimizer with a fused table "
                                    "update, and rowwise_adagrad has none"));
  assert_int_equal(num_queued, 0);
  /* Sync pushes are fine on such a backend. */
  req.mode = EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC;
  fake_backend = UNKNOWN_BACKEND;
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &req.base);
  fake_backend = EMBPS_BACKEND_CPU;
  assert_int_equal(num_queued, 1);
  run_engine();
  assert_int_equal(c.status, EMBPS_OK);
  release_call(&c);
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
    assert_true(c.answered);
    if (c.status != EMBPS_OK) {
      assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
      /* A failed create leaves nothing behind, unless only the reply's packing failed after the
       * table was made: then the table is whole. */
      embps_table_t *t = embps_store_find(store, name);
      assert_true(t == NULL || embps_table_arrays(t).data != NULL);
    }
    release_call(&c);
    if (!embps_store_find(store, name))
      create(&c, name, 8, 4), release_call(&c);

    embps_alloc_fail_after(k);
    lookup(&c, name, tokens, 3, 5);
    embps_alloc_fail_after(0);
    assert_true(c.answered);
    assert_true(c.status == EMBPS_OK || c.status == EMBPS_RESOURCE_EXHAUSTED);
    release_call(&c);

    Embps__V1__GetStatsRequest sreq = EMBPS__V1__GET_STATS_REQUEST__INIT;
    embps_alloc_fail_after(k);
    call(&c, "/embps.v1.EmbeddingService/GetStats", &sreq.base);
    embps_alloc_fail_after(0);
    assert_true(c.answered);
    release_call(&c);

    Embps__V1__ListTablesRequest lreq = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
    embps_alloc_fail_after(k);
    call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
    embps_alloc_fail_after(0);
    assert_true(c.answered);
    release_call(&c);
  }
  assert_int_equal(embps_service_inflight(svc), 0);
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

  fake_authorization = NULL;
  call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
  assert_int_equal(c.status, EMBPS_UNAUTHENTICATED);
  assert_string_equal(c.message, "missing authorization metadata: this server requires "
                                 "'authorization: Bearer TOKEN'");
  call(&c, "/grpc.health.v1.Health/Check", &hreq.base);
  assert_int_equal(c.status, EMBPS_OK); /* probes need no token */
  release_call(&c);

  fake_authorization = "Bearer not-a-known-token-0000";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_UNAUTHENTICATED);
  assert_string_equal(c.message, "the bearer token is not known to this server");

  fake_authorization = "Bearer worker-token-0123456789";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_PERMISSION_DENIED);
  assert_string_equal(c.message, "role 'worker' may not call CreateTable (needs 'admin')");
  assert_null(embps_store_find(store, "authed")); /* refused: nothing changed */
  assert_int_equal(num_queued, 0);

  fake_authorization = "Bearer admin-token-0123456789";
  create(&c, "authed", 10, 4);
  assert_int_equal(c.status, EMBPS_OK);
  release_call(&c);

  fake_authorization = "bearer reader-token-0123456789"; /* the scheme is case-insensitive */
  lookup(&c, "authed", tok, 2, 1);
  assert_int_equal(c.status, EMBPS_OK);
  release_call(&c);
  preq.table = "authed";
  preq.tokens.data = (uint8_t *)tok;
  preq.tokens.len = sizeof(tok);
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &preq.base);
  assert_int_equal(c.status, EMBPS_PERMISSION_DENIED);
  assert_string_equal(c.message, "role 'reader' may not call PushGradients (needs 'worker')");
  assert_int_equal(num_queued, 0);

  fake_authorization = "Bearer worker-token-0123456789";
  call(&c, "/embps.v1.EmbeddingService/PushGradients", &preq.base);
  assert_int_not_equal(c.status, EMBPS_PERMISSION_DENIED); /* let through to validation */
  assert_int_not_equal(c.status, EMBPS_UNAUTHENTICATED);
  run_engine();
  release_call(&c);

  embps_service_set_auth(svc, NULL);
  embps_auth_free(auth);
  fake_authorization = NULL;
  call(&c, "/embps.v1.EmbeddingService/ListTables", &lreq.base);
  assert_int_equal(c.status, EMBPS_OK); /* auth off: open as before */
  release_call(&c);
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
      cmocka_unit_test(test_push_gradients_in_place),
      cmocka_unit_test(test_async_needs_fused_update),
      cmocka_unit_test(test_allocation_failures),
      cmocka_unit_test(test_auth_checked_before_dispatch),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
