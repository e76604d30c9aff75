/* The service layer.
 *
 * Every call is decoded with protobuf-c and validated by one function per call shape
 * (validate_batch for Lookup and PushGradients, embps_table_config_resolve for CreateTable)
 * before anything is queued, so a rejected request has changed nothing. Table names are
 * checked first on the request's own bytes (check_names): protobuf-c hands a `string` over as a
 * NUL-terminated char*, so "t1\0x" would otherwise read as "t1".
 *
 * Lookup replies are the bulk of the bytes a server sends, so they are not packed by
 * protobuf-c: the service lays out the LookupResponse's small fields and the rows field's
 * header at the front of one buffer and the engine gathers the rows straight behind them; the
 * network layer then writes that buffer to the socket without another copy.
 *
 * Order: the loop thread submits ops in arrival order and the group runs the batches of one
 * connection in that order on every rank, so a lookup that arrives after a push (async or
 * sync) sees it. */
#include "service.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/backend.h"
#include "common/clock.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/shape.h"
#include "common/table_fields.h"
#include "common/varint.h"
#include "server/service/auth.h"
#include "server/service/bufpool.h"
#include "server/store/checkpoint.h"
#include "embps/v1/embps.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "embps's wire arrays are little-endian and it runs on little-endian hosts only"
#endif

#define SERVICE_PREFIX "/embps.v1.EmbeddingService/"
#define HEALTH_CHECK "/grpc.health.v1.Health/Check"

#define MAX_PENDING_CREATES 64

struct embps_service {
  embps_group_t *group;
  embps_store_t *store;
  embps_net_t *net;
  embps_service_config_t cfg;
  /* Request and reply buffers, reused; pinned with the CUDA backend. Requests are unpacked
   * through `pb`, so their tokens and gradients land in the pool's memory. */
  embps_bufpool_t *buffers;
  ProtobufCAllocator pb;
  int unpack_out_of_memory; /* an allocation of the last failed unpack failed */
  uint64_t inflight;
  int draining;        /* embps_service_drain: new calls are refused */
  uint64_t started_ns; /* embps_now_ns() at creation */
  /* Names of tables being created (leader only), so a second create of a name fails at once. */
  char pending_creates[MAX_PENDING_CREATES][EMBPS_TABLE_NAME_MAX];
  size_t num_pending_creates;
  char *(*render_metrics)(void *arg, size_t *len); /* GetStats' prometheus_text; may be NULL */
  void *render_metrics_arg;
  const embps_auth_t *auth; /* the tokens every call is checked against; NULL: auth off */
};

typedef enum { REQ_CREATE, REQ_LOOKUP, REQ_PUSH, REQ_CHECKPOINT, REQ_DROP } request_kind_t;

/* One call handed to the engine. Owns the unpacked request (tokens and gradients point into
 * it) and, for a lookup, the reply buffer the engine fills. */
typedef struct request {
  embps_service_t *svc;
  embps_net_call_t *call; /* NULL once answered (an async push is answered before it runs) */
  request_kind_t kind;
  ProtobufCMessage *msg;
  uint8_t *wire; /* a push read in place: the request's bytes, which op.grads points into */
  embps_op_t op;
  uint32_t shard_index;
  uint8_t *reply; /* lookup: from svc->buffers; NULL once the net streams it */
  size_t reply_len;
  size_t reply_head; /* lookup: the reply's bytes before the rows */
  size_t row_bytes;  /* lookup: bytes of one row */
  int streaming;     /* lookup: the reply began leaving as the engine fills it */
} request_t;

/* ---- small helpers ------------------------------------------------------------------------ */

static void release_buffer(void *p) { embps_free(p); }

/* Packs a protobuf-c message and answers the call with it. */
static void reply_message(embps_net_call_t *call, const ProtobufCMessage *m) {
  size_t len = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = embps_malloc(len);
  if (!buf) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory packing the reply");
    return;
  }
  protobuf_c_message_pack(m, buf);
  embps_net_call_reply(call, buf, len, release_buffer, buf);
}

static void fail_call(embps_net_call_t *call, const embps_error_t *err) {
  embps_net_call_fail(call, err->status, err->message);
}

/* Writes LookupResponse's fields 1-4 and the key and length of field 5 (rows); returns the
 * bytes written (at most 48). The rows themselves follow. */
static size_t put_lookup_header(uint8_t *p, uint64_t batch_id, uint32_t shard_index,
                                uint32_t emb_width, int dtype, size_t rows_bytes) {
  size_t n = 0;
  if (batch_id) {
    p[n++] = 0x08;
    n += embps_varint_put(p + n, batch_id);
  }
  if (shard_index) {
    p[n++] = 0x10;
    n += embps_varint_put(p + n, shard_index);
  }
  p[n++] = 0x18;
  n += embps_varint_put(p + n, emb_width);
  p[n++] = 0x20;
  n += embps_varint_put(p + n, (uint64_t)dtype);
  p[n++] = 0x2a;
  n += embps_varint_put(p + n, rows_bytes);
  return n;
}

/* UNAVAILABLE unless the group is ready (err says why). */
static embps_status_t check_group(embps_service_t *svc, embps_error_t *err) {
  char msg[400];
  if (embps_group_state(svc->group, msg, sizeof(msg)) == EMBPS_GROUP_READY)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_UNAVAILABLE, "%s", msg);
}

static embps_table_t *find_ready_table(embps_service_t *svc, const char *name, embps_error_t *err) {
  embps_table_t *t = embps_store_find(svc->store, name ? name : "");
  if (!t)
    embps_error_set(err, EMBPS_NOT_FOUND, "table '%s' not found", name ? name : "");
  return t;
}

/* ---- validation ---------------------------------------------------------------------------- */

/* Reads the field whose key starts at msg[i] (of msg[0..len)): its key and, for a length-
 * delimited field, its length into *v (whose bytes then follow). Returns the bytes of the key and
 * of the value, but for a length-delimited field only of its length; 0 when they do not parse. */
static size_t next_field(const uint8_t *msg, size_t len, size_t i, uint64_t *key, uint64_t *v) {
  size_t k = embps_varint_get(msg + i, len - i, key), n;
  if (!k)
    return 0;
  i += k;
  switch (*key & 7) {
  case 0:
    n = embps_varint_get(msg + i, len - i, v);
    break;
  case 1:
    n = len - i >= 8 ? 8 : 0;
    break;
  case 5:
    n = len - i >= 4 ? 4 : 0;
    break;
  case 2:
    if ((n = embps_varint_get(msg + i, len - i, v)) == 0 || *v > len - i - n)
      n = 0;
    break;
  default:
    n = 0;
  }
  return n ? k + n : 0;
}

/* Finds the one occurrence of the length-delimited field `field` at the top of the message
 * msg[0..len): *at is where its key starts, *data where its bytes start, *n their count. Returns
 * 0 when the message does not parse, lacks the field or repeats it (the caller then unpacks the
 * whole message, which rules on all of that as before). */
static int find_bytes_field(const uint8_t *msg, size_t len, uint32_t field, size_t *at,
                            size_t *data, size_t *n) {
  size_t i = 0, seen = 0;
  while (i < len) {
    uint64_t key, v = 0;
    size_t k = next_field(msg, len, i, &key, &v);
    if (!k)
      return 0;
    if ((key >> 3) == field) {
      if ((key & 7) != 2 || seen++)
        return 0;
      *at = i;
      *data = i + k;
      *n = (size_t)v;
    }
    i += k + ((key & 7) == 2 ? (size_t)v : 0);
  }
  return seen == 1;
}

/* Checks every table name in the protobuf message msg[0..len) (which protobuf-c has unpacked
 * already) on its full length with embps_table_name_check: path[0..depth) are the field numbers
 * down to the name (CreateTableRequest.spec.name is {1, 1}), and every occurrence of each is
 * checked, since protobuf merges repeated ones. An empty name is left to the call's own checks. */
static embps_status_t check_names(const uint8_t *msg, size_t len, const uint32_t *path,
                                  size_t depth, embps_error_t *err) {
  size_t i = 0;
  embps_status_t ret;
  while (i < len) {
    uint64_t key, v = 0;
    size_t n = next_field(msg, len, i, &key, &v);
    if (!n)
      break;
    i += n;
    if ((key & 7) != 2)
      continue;
    if ((key >> 3) == path[0]) {
      if (depth > 1)
        ret = check_names(msg + i, (size_t)v, path + 1, depth - 1, err);
      else
        ret = v ? embps_table_name_check((const char *)msg + i, (size_t)v, err) : EMBPS_OK;
      if (ret != EMBPS_OK)
        return ret;
    }
    i += (size_t)v; /* past the field's bytes */
  }
  if (i != len)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "malformed request message");
  return EMBPS_OK;
}

static const uint32_t NAME_FIELD[] = {1};         /* LookupRequest.table and the like */
static const uint32_t SPEC_NAME_FIELD[] = {1, 1}; /* CreateTableRequest.spec.name */
#define PUSH_GRADIENTS_FIELD 8                    /* PushGradientsRequest.gradients */

/* The common checks of Lookup and PushGradients. On success *table is the table and the
 * tokens are known to lie in [0, rows). */
static embps_status_t validate_batch(embps_service_t *svc, const char *table_name,
                                     uint32_t shard_index, uint32_t shard_count,
                                     uint32_t tokens_per_batch, const ProtobufCBinaryData *tokens,
                                     int dtype, embps_table_t **table, embps_error_t *err) {
  uint32_t group_size = embps_group_size(svc->group), rank = embps_group_rank(svc->group);
  embps_table_t *t;
  size_t n;
  const int64_t *tok;
  embps_status_t ret;

  if ((ret = check_group(svc, err)) != EMBPS_OK)
    return ret;
  if (!(t = find_ready_table(svc, table_name, err)))
    return err->status;
  if (tokens->len % sizeof(int64_t) != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "tokens holds %zu bytes, not a whole number of int64 tokens (8 bytes "
                           "each, little-endian)",
                           tokens->len);
  n = tokens->len / sizeof(int64_t);
  if (shard_count == 0)
    shard_count = 1;
  if (tokens_per_batch == 0)
    tokens_per_batch = (uint32_t)(n * shard_count);
  if ((ret = embps_shape_check_tokens_per_batch(tokens_per_batch, group_size, err)) != EMBPS_OK)
    return ret;
  if (shard_count != group_size)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "shard_count=%u does not match the %u-rank group: split the batch "
                           "into one token shard per rank",
                           shard_count, group_size);
  if (shard_index != rank)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "shard_index=%u was sent to rank %u: send token shard r of a batch to "
                           "rank r",
                           shard_index, rank);
  if ((uint64_t)n * shard_count != tokens_per_batch)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "shard %u holds %zu tokens, but tokens_per_batch=%u over %u shards "
                           "needs %u",
                           shard_index, n, tokens_per_batch, shard_count,
                           tokens_per_batch / shard_count);
  if (dtype != 0 && dtype != (int)embps_table_config(t)->dtype)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "dtype mismatch: table '%s' stores %s, the request carries %s",
                           embps_table_config(t)->name,
                           embps_dtype_name(embps_table_config(t)->dtype), embps_dtype_name(dtype));
  tok = (const int64_t *)tokens->data;
  for (size_t i = 0; i < n; i++) {
    if (tok[i] < 0 || (uint64_t)tok[i] >= embps_table_config(t)->rows)
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "token %lld at position %zu is outside [0, %llu) of table '%s'",
                             (long long)tok[i], i, (unsigned long long)embps_table_config(t)->rows,
                             embps_table_config(t)->name);
  }
  *table = t;
  return EMBPS_OK;
}

/* Lookup's checks: validate_batch's, then the reply's size, which a few bytes of tokens can make
 * thousands of times larger than the request (2 rows of emb_width 65536 make 1000 tokens a
 * 256 MiB reply). On success *rows_bytes is the size of the rows the reply carries. */
static embps_status_t validate_lookup(embps_service_t *svc, const Embps__V1__LookupRequest *req,
                                      embps_table_t **table, size_t *rows_bytes,
                                      embps_error_t *err) {
  const embps_table_config_t *c;
  size_t n, bytes;
  embps_status_t ret = validate_batch(svc, req->table, req->shard_index, req->shard_count,
                                      req->tokens_per_batch, &req->tokens, req->dtype, table, err);
  if (ret != EMBPS_OK)
    return ret;
  c = embps_table_config(*table);
  n = req->tokens.len / sizeof(int64_t);
  /* No overflow: n < 2^61 / 8 tokens and emb_width * the dtype's size < 2^35. */
  bytes = n * c->emb_width * embps_dtype_size(c->dtype);
  if (svc->cfg.max_reply_bytes && bytes > svc->cfg.max_reply_bytes)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "the reply would hold %zu bytes of rows (%zu tokens of emb_width=%u "
                           "%s), more than --max-message-bytes=%llu: split the batch into smaller "
                           "lookups, or raise --max-message-bytes",
                           bytes, n, c->emb_width, embps_dtype_name(c->dtype),
                           (unsigned long long)svc->cfg.max_reply_bytes);
  *rows_bytes = bytes;
  return EMBPS_OK;
}

static void spec_from_config(const embps_table_config_t *c, Embps__V1__TableSpec *spec,
                             Embps__V1__OptimizerConfig *o);

static int name_reserved(const embps_service_t *svc, const char *name) {
  for (size_t i = 0; i < svc->num_pending_creates; i++)
    if (strcmp(svc->pending_creates[i], name) == 0)
      return 1;
  return 0;
}

static void unreserve_name(embps_service_t *svc, const char *name) {
  for (size_t i = 0; i < svc->num_pending_creates; i++)
    if (strcmp(svc->pending_creates[i], name) == 0) {
      memmove(svc->pending_creates[i], svc->pending_creates[--svc->num_pending_creates],
              EMBPS_TABLE_NAME_MAX);
      return;
    }
}

/* ---- completion ---------------------------------------------------------------------------- */

static void request_free(request_t *r) {
  if (r->msg)
    protobuf_c_message_free_unpacked(r->msg, &r->svc->pb);
  if (r->reply)
    embps__bufpool_put(r->reply);
  embps_free(r->wire);
  embps_free(r);
}

/* An async push is answered once the leader has ordered its round: every rank then runs it
 * before any batch ordered later, so every later lookup sees it. Answering any earlier would
 * promise an update that a batch failing before it is ordered (a shard that never arrives, a
 * broken peer) never makes. */
static void on_push_ordered(embps_op_t *op) {
  request_t *r = op->user;
  Embps__V1__PushGradientsResponse resp = EMBPS__V1__PUSH_GRADIENTS_RESPONSE__INIT;
  if (!r->call)
    return;
  resp.batch_id = op->batch_id;
  resp.shard_index = r->shard_index;
  resp.ordered = 1;
  reply_message(r->call, &resp.base);
  r->call = NULL;
}

/* More of a lookup's rows are final (the CPU engine publishes them chunk by chunk): they leave
 * while the engine gathers the rest, instead of after the whole reply is made. The first chunk
 * begins the reply, which from then on owns the buffer (the net keeps it until the call ends,
 * so the engine never writes into freed memory when the client goes). When the reply cannot
 * begin (client gone, out of memory) nothing changed, and done answers it whole as before. A
 * reply does not begin while its connection carries other calls (embps_net_call_conn_shared). */
static void on_lookup_progress(embps_op_t *op) {
  request_t *r = op->user;
  size_t rows = atomic_load_explicit(&op->rows_ready, memory_order_acquire);
  size_t ready = r->reply_head + rows * r->row_bytes;
  if (!r->call)
    return;
  if (r->streaming) {
    embps_net_call_reply_ready(r->call, ready);
  } else if (!embps_net_call_conn_shared(r->call) &&
             embps_net_call_reply_begin(r->call, r->reply, r->reply_len, ready, embps__bufpool_put,
                                        r->reply) == EMBPS_OK) {
    r->reply = NULL;
    r->streaming = 1;
  }
}

static void on_op_done(embps_op_t *op) {
  request_t *r = op->user;
  embps_service_t *svc = r->svc;

  svc->inflight--;
  if (!r->call) { /* async push, answered when it was ordered (on_push_ordered) */
    if (op->error.status != EMBPS_OK)
      EMBPS_WARN("async push to '%s' failed: %s", embps_table_config(op->table)->name,
                 op->error.message);
    request_free(r);
    return;
  }
  if (r->kind == REQ_CREATE)
    unreserve_name(svc, op->create.name);
  if (r->kind == REQ_DROP && op->error.status == EMBPS_OK)
    EMBPS_INFO("dropped table '%s': %llu bytes on this rank freed", op->create.name,
               (unsigned long long)embps_table_bytes(op->table));
  if (op->error.status != EMBPS_OK) {
    fail_call(r->call, &op->error);
    request_free(r);
    return;
  }
  switch (r->kind) {
  case REQ_CREATE: {
    Embps__V1__CreateTableResponse resp = EMBPS__V1__CREATE_TABLE_RESPONSE__INIT;
    Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
    Embps__V1__OptimizerConfig opt = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
    const embps_table_config_t *c = embps_table_config(op->created);
    spec_from_config(c, &spec, &opt);
    resp.spec = &spec;
    resp.group_size = embps_group_size(svc->group);
    EMBPS_INFO("created table '%s': rows=%llu emb_width=%u %s %s, %llu bytes on this rank", c->name,
               (unsigned long long)c->rows, c->emb_width, embps_dtype_name(c->dtype),
               embps_optimizer_name(c->optimizer),
               (unsigned long long)embps_table_bytes(op->created));
    reply_message(r->call, &resp.base);
    break;
  }
  case REQ_LOOKUP: {
    uint8_t *buf = r->reply;
    if (r->streaming) {
      embps_net_call_reply_end(r->call);
      break;
    }
    r->reply = NULL; /* the call owns it now */
    embps_net_call_reply(r->call, buf, r->reply_len, embps__bufpool_put, buf);
    break;
  }
  case REQ_DROP: {
    Embps__V1__DropTableResponse resp = EMBPS__V1__DROP_TABLE_RESPONSE__INIT;
    resp.bytes = embps_table_bytes(op->table);
    reply_message(r->call, &resp.base);
    break;
  }
  case REQ_CHECKPOINT: {
    Embps__V1__CheckpointResponse resp = EMBPS__V1__CHECKPOINT_RESPONSE__INIT;
    resp.bytes = op->ckpt_bytes;
    resp.round = op->ckpt_round;
    resp.path = op->ckpt_path;
    reply_message(r->call, &resp.base);
    break;
  }
  case REQ_PUSH: {
    Embps__V1__PushGradientsResponse resp = EMBPS__V1__PUSH_GRADIENTS_RESPONSE__INIT;
    resp.batch_id = r->op.batch_id;
    resp.shard_index = r->shard_index;
    resp.applied = op->applied;
    resp.skipped = op->skipped;
    resp.grad_norm = op->grad_norm;
    resp.num_unique = op->num_unique;
    reply_message(r->call, &resp.base);
    break;
  }
  }
  request_free(r);
}

static request_t *request_new(embps_service_t *svc, embps_net_call_t *call, request_kind_t kind,
                              ProtobufCMessage *msg) {
  request_t *r = embps_calloc(1, sizeof(*r));
  if (!r)
    return NULL;
  r->svc = svc;
  r->call = call;
  r->kind = kind;
  r->msg = msg;
  r->op.done = on_op_done;
  r->op.user = r;
  return r;
}

static void submit(request_t *r) {
  r->svc->inflight++;
  embps_group_submit(r->svc->group, &r->op);
}

/* ---- the calls ----------------------------------------------------------------------------- */

/* A table's settings to and from its TableSpec, as common/table_fields.h declares them; zeros
 * stay zeros here and take their defaults in embps_table_config_resolve. */
EMBPS_TABLE_FIELDS_FROM_PB(settings_from_pb, embps_table_config_t)
EMBPS_TABLE_FIELDS_TO_PB(settings_to_pb, embps_table_config_t)

static void config_from_spec(const Embps__V1__TableSpec *spec, embps_table_config_t *c) {
  memset(c, 0, sizeof(*c));
  if (spec->name && strlen(spec->name) < sizeof(c->name))
    strcpy(c->name, spec->name);
  else if (spec->name) /* too long: keep it unterminated-length so resolve refuses it */
    memset(c->name, 'x', sizeof(c->name));
  settings_from_pb(spec, c);
}

/* protobuf-c answers NULL both for bytes that do not parse and for an allocation that failed;
 * the allocator tells the two apart. */
static void fail_unpack(embps_service_t *svc, embps_net_call_t *call, const char *type) {
  if (svc->unpack_out_of_memory) {
    svc->unpack_out_of_memory = 0;
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory unpacking the request");
    return;
  }
  char msg[80];
  snprintf(msg, sizeof(msg), "malformed %s message", type);
  embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, msg);
}

static void handle_create_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                                size_t len) {
  Embps__V1__CreateTableRequest *req = embps__v1__create_table_request__unpack(&svc->pb, len, msg);
  embps_table_config_t cfg;
  embps_error_t err;
  request_t *r;

  if (!req) {
    fail_unpack(svc, call, "CreateTableRequest");
    return;
  }
  if (!req->spec) {
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT, "CreateTableRequest has no spec");
    goto exit;
  }
  if (check_names(msg, len, SPEC_NAME_FIELD, 2, &err) != EMBPS_OK) {
    fail_call(call, &err);
    goto exit;
  }
  config_from_spec(req->spec, &cfg);
  if (embps_group_rank(svc->group) != 0) {
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "CreateTable goes to the group's leader, rank 0; this is rank %u",
                    embps_group_rank(svc->group));
    fail_call(call, &err);
    goto exit;
  }
  if (check_group(svc, &err) != EMBPS_OK ||
      embps_table_config_resolve(&cfg, embps_group_size(svc->group),
                                 embps_store_budget_max(svc->store), &err) != EMBPS_OK) {
    fail_call(call, &err);
    goto exit;
  }
  if (embps_store_find(svc->store, cfg.name) || name_reserved(svc, cfg.name)) {
    embps_error_set(&err, EMBPS_ALREADY_EXISTS, "table '%s' already exists", cfg.name);
    fail_call(call, &err);
    goto exit;
  }
  if (svc->num_pending_creates == MAX_PENDING_CREATES) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED,
                        "too many tables are being created at once; retry");
    goto exit;
  }
  r = request_new(svc, call, REQ_CREATE, &req->base);
  if (!r) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  strcpy(svc->pending_creates[svc->num_pending_creates++], cfg.name);
  r->op.kind = EMBPS_OP_CREATE_TABLE;
  r->op.create = cfg;
  submit(r);
  return;
exit:
  embps__v1__create_table_request__free_unpacked(req, &svc->pb);
}

/* The TableSpec of c, in spec and o (initialized by the caller), which point into c. */
static void spec_from_config(const embps_table_config_t *c, Embps__V1__TableSpec *spec,
                             Embps__V1__OptimizerConfig *o) {
  spec->name = (char *)c->name;
  settings_to_pb(c, spec, o);
}

/* Checkpoint: any rank takes it to the leader, which orders it; answered once it is complete. */
static void handle_checkpoint(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                              size_t len) {
  Embps__V1__CheckpointRequest *req = embps__v1__checkpoint_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  request_t *r;

  if (!req) {
    fail_unpack(svc, call, "CheckpointRequest");
    return;
  }
  if (check_group(svc, &err) != EMBPS_OK ||
      check_names(msg, len, NAME_FIELD, 1, &err) != EMBPS_OK) {
    fail_call(call, &err);
  } else if (!embps_group_checkpoint_dir(svc->group)) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION,
                        "checkpoints are off: start every rank with --checkpoint-dir "
                        "(EMBPS_CHECKPOINT_DIR)");
  } else if (req->path && req->path[0]) {
    embps_net_call_fail(call, EMBPS_INVALID_ARGUMENT,
                        "checkpoints go to the servers' --checkpoint-dir; leave path empty");
  } else if (req->table && req->table[0] && !find_ready_table(svc, req->table, &err)) {
    fail_call(call, &err);
  } else if (embps_store_count(svc->store) == 0) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION,
                        "there are no tables to checkpoint: create one first");
  } else if (!(r = request_new(svc, call, REQ_CHECKPOINT, &req->base))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    r->op.kind = EMBPS_OP_CHECKPOINT;
    snprintf(r->op.ckpt_table, sizeof(r->op.ckpt_table), "%s", req->table ? req->table : "");
    submit(r);
    return;
  }
  embps__v1__checkpoint_request__free_unpacked(req, &svc->pb);
}

/* DropTable: like CreateTable, the leader orders it as a round that every rank runs; the table
 * named is checked here (to answer at once) and again when the round runs. */
static void handle_drop_table(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                              size_t len) {
  Embps__V1__DropTableRequest *req = embps__v1__drop_table_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  request_t *r;

  if (!req) {
    fail_unpack(svc, call, "DropTableRequest");
    return;
  }
  if (embps_group_rank(svc->group) != 0) {
    embps_error_set(&err, EMBPS_FAILED_PRECONDITION,
                    "DropTable goes to the group's leader, rank 0; this is rank %u",
                    embps_group_rank(svc->group));
    fail_call(call, &err);
  } else if (check_group(svc, &err) != EMBPS_OK ||
             check_names(msg, len, NAME_FIELD, 1, &err) != EMBPS_OK ||
             embps_table_name_check(req->name, strlen(req->name), &err) != EMBPS_OK ||
             !find_ready_table(svc, req->name, &err)) {
    fail_call(call, &err);
  } else if (!(r = request_new(svc, call, REQ_DROP, &req->base))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  } else {
    r->op.kind = EMBPS_OP_DROP_TABLE;
    snprintf(r->op.create.name, sizeof(r->op.create.name), "%s", req->name);
    submit(r);
    return;
  }
  embps__v1__drop_table_request__free_unpacked(req, &svc->pb);
}

/* ListCheckpoints reads the manifests in the directory on libuv's thread pool (a disk, or a
 * network filesystem, may be slow), then answers on the loop thread. */
typedef struct list_job {
  uv_work_t work;
  embps_net_call_t *call;
  char dir[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t *list;
  size_t n;
  embps_error_t err;
} list_job_t;

static void list_read(uv_work_t *w) {
  list_job_t *j = w->data;
  embps_error_clear(&j->err);
  /* The newest 64 are plenty for an operator; older ones are listed on disk. */
  if (embps_ckpt_list_newest(j->dir, 64, &j->list, &j->n, &j->err) != EMBPS_OK) {
    j->list = NULL;
    j->n = 0;
  }
}

static void list_answer(list_job_t *j) {
  Embps__V1__ListCheckpointsResponse resp = EMBPS__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
  Embps__V1__CheckpointInfo *infos = NULL, **ptrs = NULL;
  char paths[64][EMBPS_CKPT_PATH_MAX];
  char **names = NULL;
  size_t total_tables = 0, k = 0, n = j->n;

  if (j->err.status != EMBPS_OK) {
    fail_call(j->call, &j->err);
    goto exit;
  }
  for (size_t i = 0; i < n; i++)
    total_tables += j->list[i].num_tables;
  infos = embps_calloc(n ? n : 1, sizeof(*infos));
  ptrs = embps_calloc(n ? n : 1, sizeof(*ptrs));
  names = embps_calloc(total_tables ? total_tables : 1, sizeof(*names));
  if (!infos || !ptrs || !names) {
    embps_net_call_fail(j->call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    embps_ckpt_manifest_t *m = &j->list[i];
    embps__v1__checkpoint_info__init(&infos[i]);
    infos[i].round = m->round;
    infos[i].time_unix_ms = m->time_ms;
    infos[i].group_size = m->group_size;
    infos[i].bytes = m->bytes;
    infos[i].base_round = m->base_round;
    infos[i].scope = m->scope;
    embps_ckpt_path(paths[i], sizeof(paths[i]), j->dir, m->round);
    infos[i].path = paths[i];
    infos[i].tables = names + k;
    infos[i].n_tables = m->num_tables;
    for (size_t t = 0; t < m->num_tables; t++)
      names[k++] = m->tables[t].name;
    ptrs[i] = &infos[i];
  }
  resp.dir = j->dir;
  resp.n_checkpoints = n;
  resp.checkpoints = ptrs;
  reply_message(j->call, &resp.base);
exit:
  embps_free(infos);
  embps_free(ptrs);
  embps_free(names);
  embps_ckpt_list_free(j->list, j->n);
  embps_free(j);
}

static void list_done(uv_work_t *w, int status) {
  (void)status;
  list_answer(w->data);
}

static void handle_list_checkpoints(embps_service_t *svc, embps_net_call_t *call,
                                    const uint8_t *msg, size_t len) {
  Embps__V1__ListCheckpointsRequest *req =
      embps__v1__list_checkpoints_request__unpack(&svc->pb, len, msg);
  const char *dir = embps_group_checkpoint_dir(svc->group);
  list_job_t *j;
  if (!req) {
    fail_unpack(svc, call, "ListCheckpointsRequest");
    return;
  }
  embps__v1__list_checkpoints_request__free_unpacked(req, &svc->pb);
  if (!dir) {
    embps_net_call_fail(call, EMBPS_FAILED_PRECONDITION,
                        "checkpoints are off: start every rank with --checkpoint-dir "
                        "(EMBPS_CHECKPOINT_DIR)");
    return;
  }
  if (!(j = embps_calloc(1, sizeof(*j)))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  j->call = call;
  snprintf(j->dir, sizeof(j->dir), "%s", dir);
  j->work.data = j;
  if (!svc->cfg.loop || uv_queue_work(svc->cfg.loop, &j->work, list_read, list_done) != 0) {
    list_read(&j->work);
    list_answer(j);
  }
}

static void handle_list_tables(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                               size_t len) {
  Embps__V1__ListTablesRequest *req = embps__v1__list_tables_request__unpack(&svc->pb, len, msg);
  Embps__V1__ListTablesResponse resp = EMBPS__V1__LIST_TABLES_RESPONSE__INIT;
  size_t n = embps_store_count(svc->store) + 1, k = 0;
  Embps__V1__TableSpec *specs = NULL, **ptrs = NULL;
  Embps__V1__OptimizerConfig *opts = NULL;
  embps_table_t **tables = NULL;

  if (!req) {
    fail_unpack(svc, call, "ListTablesRequest");
    return;
  }
  specs = embps_calloc(n, sizeof(*specs));
  ptrs = embps_calloc(n, sizeof(*ptrs));
  opts = embps_calloc(n, sizeof(*opts));
  tables = embps_calloc(n, sizeof(*tables));
  if (!specs || !ptrs || !opts || !tables) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  n = embps_store_list(svc->store, tables, n);
  for (size_t i = 0; i < n; i++) {
    const embps_table_t *t = tables[i];
    embps__v1__table_spec__init(&specs[k]);
    embps__v1__optimizer_config__init(&opts[k]);
    spec_from_config(embps_table_config(t), &specs[k], &opts[k]);
    ptrs[k] = &specs[k];
    k++;
  }
  resp.n_tables = k;
  resp.tables = ptrs;
  resp.group_size = embps_group_size(svc->group);
  reply_message(call, &resp.base);
exit:
  embps_free(specs);
  embps_free(ptrs);
  embps_free(opts);
  embps_free(tables);
  embps__v1__list_tables_request__free_unpacked(req, &svc->pb);
}

/* The op of a validated lookup or push shard: this rank's tokens of table t. */
static void set_batch(request_t *r, embps_op_kind_t kind, uint64_t client_id, uint64_t batch_id,
                      uint32_t shard_index, embps_table_t *t, const ProtobufCBinaryData *tokens) {
  const size_t n = tokens->len / sizeof(int64_t);
  r->shard_index = shard_index;
  r->op.kind = kind;
  r->op.client_id = client_id;
  r->op.batch_id = batch_id;
  r->op.tokens_per_batch = (uint32_t)(n * embps_group_size(r->svc->group));
  r->op.table = t;
  r->op.tokens = (const int64_t *)tokens->data;
  r->op.num_tokens = n;
}

static void handle_lookup(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                          size_t len) {
  Embps__V1__LookupRequest *req = embps__v1__lookup_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  embps_table_t *t;
  request_t *r;
  size_t rows_bytes = 0, head;
  uint8_t header[64];

  if (!req) {
    fail_unpack(svc, call, "LookupRequest");
    return;
  }
  if (check_names(msg, len, NAME_FIELD, 1, &err) != EMBPS_OK ||
      validate_lookup(svc, req, &t, &rows_bytes, &err) != EMBPS_OK) {
    fail_call(call, &err);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  head =
      put_lookup_header(header, req->batch_id, req->shard_index, embps_table_config(t)->emb_width,
                        embps_table_config(t)->dtype, rows_bytes);
  /* The last check, as it counts the reply against the connection (call_fail uncounts it). */
  if (embps_net_call_hold_reply(call, head + rows_bytes, &err) != EMBPS_OK) {
    fail_call(call, &err);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  r = request_new(svc, call, REQ_LOOKUP, &req->base);
  if (!r || !(r->reply = embps__bufpool_get(svc->buffers, head + rows_bytes))) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte reply",
                    head + rows_bytes);
    fail_call(call, &err);
    if (r)
      r->msg = NULL;
    embps_free(r);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  memcpy(r->reply, header, head);
  r->reply_len = head + rows_bytes;
  set_batch(r, EMBPS_OP_LOOKUP, req->client_id, req->batch_id, req->shard_index, t, &req->tokens);
  r->op.rows_out = r->reply + head;
  r->reply_head = head;
  r->row_bytes = embps_table_config(t)->emb_width * embps_dtype_size(embps_table_config(t)->dtype);
  /* decided here too, so that a call that arrives beside others costs the engine no wakeups */
  r->op.progress = embps_net_call_conn_shared(call) ? NULL : on_lookup_progress;
  submit(r);
}

/* Unpacks a PushGradientsRequest. On a backend that computes on host memory the gradients are
 * not copied out of the request: the message is unpacked without them (the bytes before and
 * after the field, a few hundred KiB of tokens at most) and *grads points into msg, which the
 * caller must then keep. Elsewhere they are unpacked into the pool's (pinned) memory, which the
 * device copies from. The copy it saves is half of the memmove that was 16% of the server's
 * time pushing 65536 x 128 f32 (perf, 1M-row table, uniform tokens, one client stream; the
 * other half is the network layer gathering the message) and 10-12% after. Returns NULL as
 * protobuf-c's unpack does. */
static Embps__V1__PushGradientsRequest *unpack_push(embps_service_t *svc, const uint8_t *msg,
                                                    size_t len, ProtobufCBinaryData *grads,
                                                    int *in_place) {
  Embps__V1__PushGradientsRequest *req;
  size_t at, data, n;
  uint8_t *rest;

  *in_place = 0;
  if (embps_group_host_device(svc->group) < 0 &&
      find_bytes_field(msg, len, PUSH_GRADIENTS_FIELD, &at, &data, &n) &&
      (rest = embps_malloc(len - n - (data - at))) != NULL) {
    memcpy(rest, msg, at);
    memcpy(rest + at, msg + data + n, len - data - n);
    req = embps__v1__push_gradients_request__unpack(&svc->pb, len - n - (data - at), rest);
    embps_free(rest);
    if (req) {
      grads->data = (uint8_t *)msg + data;
      grads->len = n;
      *in_place = 1;
    }
    return req;
  }
  req = embps__v1__push_gradients_request__unpack(&svc->pb, len, msg);
  if (req)
    *grads = req->gradients;
  return req;
}

/* msg[0..len) is the request, *owned the allocation that holds it (from the network layer),
 * which the op takes (*owned = NULL) when it reads its gradients from it. */
static void handle_push(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                        size_t len, uint8_t **owned) {
  ProtobufCBinaryData grads = {0, NULL};
  int in_place;
  Embps__V1__PushGradientsRequest *req = unpack_push(svc, msg, len, &grads, &in_place);
  embps_error_t err;
  embps_table_t *t;
  request_t *r;
  size_t n, want;
  int async;

  if (!req) {
    fail_unpack(svc, call, "PushGradientsRequest");
    return;
  }
  if (check_names(msg, len, NAME_FIELD, 1, &err) != EMBPS_OK ||
      validate_batch(svc, req->table, req->shard_index, req->shard_count, req->tokens_per_batch,
                     &req->tokens, req->dtype, &t, &err) != EMBPS_OK)
    goto fail;
  n = req->tokens.len / sizeof(int64_t);
  want = n * embps_table_config(t)->emb_width * embps_dtype_size(embps_table_config(t)->dtype);
  if (grads.len != want) {
    embps_error_set(&err, EMBPS_INVALID_ARGUMENT,
                    "gradients hold %zu bytes, but %zu tokens of emb_width=%u %s need %zu",
                    grads.len, n, embps_table_config(t)->emb_width,
                    embps_dtype_name(embps_table_config(t)->dtype), want);
    goto fail;
  }
  async = req->mode == EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
  if (async && !embps_optimizer_has_fused_update(embps_table_config(t)->optimizer,
                                                 embps_group_backend(svc->group))) {
    embps_shape_async_unsupported(embps_optimizer_name(embps_table_config(t)->optimizer), &err);
    goto fail;
  }
  if (req->mode != EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC && !async) {
    embps_error_set(&err, EMBPS_INVALID_ARGUMENT, "update mode %d is neither sync nor async",
                    (int)req->mode);
    goto fail;
  }
  r = request_new(svc, call, REQ_PUSH, &req->base);
  if (!r) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  set_batch(r, EMBPS_OP_PUSH, req->client_id, req->batch_id, req->shard_index, t, &req->tokens);
  r->op.grads = grads.data;
  if (in_place) { /* msg is *owned: in_place found a field, so the message is not empty */
    r->wire = *owned;
    *owned = NULL;
  }
  if (async)
    r->op.ordered = on_push_ordered;
  submit(r);
  return;
fail:
  fail_call(call, &err);
  embps__v1__push_gradients_request__free_unpacked(req, &svc->pb);
}

static double uptime_s(const embps_service_t *svc) {
  return (double)(embps_now_ns() - svc->started_ns) * 1e-9;
}

static uint64_t load(atomic_uint_fast64_t *v) {
  return atomic_load_explicit(v, memory_order_relaxed);
}

static void handle_stats(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                         size_t len) {
  Embps__V1__GetStatsRequest *req = embps__v1__get_stats_request__unpack(&svc->pb, len, msg);
  Embps__V1__GetStatsResponse resp = EMBPS__V1__GET_STATS_RESPONSE__INIT;
  size_t n = embps_store_count(svc->store) + 1;
  Embps__V1__TableStats *ts = NULL, **ptrs = NULL;
  embps_table_t **tables = NULL;
  embps_net_stats_t ns;
  char *prom = NULL;
  size_t prom_len = 0;

  if (!req) {
    fail_unpack(svc, call, "GetStatsRequest");
    return;
  }
  if (req->prometheus && svc->render_metrics &&
      !(prom = svc->render_metrics(svc->render_metrics_arg, &prom_len))) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory rendering the metrics");
    goto exit;
  }
  if (prom)
    resp.prometheus_text = prom;
  ts = embps_calloc(n, sizeof(*ts));
  ptrs = embps_calloc(n, sizeof(*ptrs));
  tables = embps_calloc(n, sizeof(*tables));
  if (!ts || !ptrs || !tables) {
    embps_net_call_fail(call, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto exit;
  }
  n = embps_store_list(svc->store, tables, n);
  memset(&ns, 0, sizeof(ns));
  if (svc->net)
    embps_net_get_stats(svc->net, &ns);
  resp.rank = embps_group_rank(svc->group);
  resp.group_size = embps_group_size(svc->group);
  resp.backend = (char *)embps_backend_name(embps_group_backend(svc->group));
  {
    embps_comm_stats_t cs;
    embps_group_comm_stats(svc->group, &cs);
    resp.peer_bytes_sent = cs.bytes_sent;
    resp.peer_bytes_received = cs.bytes_received;
    resp.collective_calls = cs.calls;
    resp.ready = embps_group_state(svc->group, NULL, 0) == EMBPS_GROUP_READY;
  }
  resp.uptime_s = uptime_s(svc);
  resp.requests = ns.requests;
  resp.errors = ns.errors;
  resp.bytes_in = ns.bytes_in;
  resp.bytes_out = ns.bytes_out;
  resp.connections = ns.connections;
  resp.version = (char *)EMBPS_VERSION;
  resp.mesh = svc->cfg.mesh;
  resp.memory_bytes = embps_store_budget_used(svc->store);
  resp.max_memory_bytes = embps_store_budget_max(svc->store);
  for (size_t i = 0; i < n; i++) {
    embps_table_t *t = tables[i];
    embps__v1__table_stats__init(&ts[i]);
    ts[i].name = (char *)embps_table_config(t)->name;
    ts[i].rows = embps_table_config(t)->rows;
    ts[i].emb_width = embps_table_config(t)->emb_width;
    ts[i].lookups = load(&embps_table_counters(t)->lookups);
    ts[i].pushes = load(&embps_table_counters(t)->pushes);
    ts[i].rows_looked_up = load(&embps_table_counters(t)->rows_looked_up);
    ts[i].rows_pushed = load(&embps_table_counters(t)->rows_pushed);
    ts[i].steps_applied = load(&embps_table_counters(t)->steps_applied);
    ts[i].steps_skipped = load(&embps_table_counters(t)->steps_skipped);
    ts[i].bytes = embps_table_bytes(t);
    ptrs[i] = &ts[i];
  }
  resp.n_tables = n;
  resp.tables = ptrs;
  reply_message(call, &resp.base);
exit:
  embps_free(prom);
  embps_free(ts);
  embps_free(ptrs);
  embps_free(tables);
  embps__v1__get_stats_request__free_unpacked(req, &svc->pb);
}

static void handle_health(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                          size_t len) {
  Grpc__Health__V1__HealthCheckRequest *req =
      grpc__health__v1__health_check_request__unpack(&svc->pb, len, msg);
  Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

  if (!req) {
    fail_unpack(svc, call, "HealthCheckRequest");
    return;
  }
  if (req->service && req->service[0] && strcmp(req->service, "embps.v1.EmbeddingService") != 0) {
    embps_net_call_fail(call, EMBPS_NOT_FOUND, "unknown service");
  } else {
    resp.status = !svc->draining && embps_group_state(svc->group, NULL, 0) == EMBPS_GROUP_READY
                      ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    reply_message(call, &resp.base);
  }
  grpc__health__v1__health_check_request__free_unpacked(req, &svc->pb);
}

static void unknown_method(embps_net_call_t *call, const char *method) {
  char text[320];
  snprintf(text, sizeof(text), "unknown method %.256s", method);
  embps_net_call_fail(call, EMBPS_UNIMPLEMENTED, text);
}

void embps_service_on_request(void *user, embps_net_call_t *call, const char *method, uint8_t *msg,
                              size_t len) {
  embps_service_t *svc = user;
  static const uint8_t empty[1];
  const uint8_t *m = msg ? msg : empty;
  embps_error_t err;

  /* Who may call what is decided here, once, before any method runs (or a drain is
   * revealed): auth.c's table gives each method's least role. */
  if (embps_auth_check(svc->auth, method, embps_net_call_authorization(call), &err) != EMBPS_OK) {
    EMBPS_DEBUG("refused a call to %.200s: %s", method, err.message);
    fail_call(call, &err);
  } else if (svc->draining && strncmp(method, SERVICE_PREFIX, strlen(SERVICE_PREFIX)) == 0) {
    embps_net_call_fail(call, EMBPS_UNAVAILABLE,
                        "this server is shutting down (it finishes the calls it has taken): "
                        "retry once it is back");
  } else if (strncmp(method, SERVICE_PREFIX, strlen(SERVICE_PREFIX)) == 0) {
    const char *name = method + strlen(SERVICE_PREFIX);
    if (strcmp(name, "Lookup") == 0)
      handle_lookup(svc, call, m, len);
    else if (strcmp(name, "PushGradients") == 0)
      handle_push(svc, call, m, len, &msg);
    else if (strcmp(name, "CreateTable") == 0)
      handle_create_table(svc, call, m, len);
    else if (strcmp(name, "DropTable") == 0)
      handle_drop_table(svc, call, m, len);
    else if (strcmp(name, "ListTables") == 0)
      handle_list_tables(svc, call, m, len);
    else if (strcmp(name, "GetStats") == 0)
      handle_stats(svc, call, m, len);
    else if (strcmp(name, "Checkpoint") == 0)
      handle_checkpoint(svc, call, m, len);
    else if (strcmp(name, "ListCheckpoints") == 0)
      handle_list_checkpoints(svc, call, m, len);
    else
      unknown_method(call, method);
  } else if (strcmp(method, HEALTH_CHECK) == 0) {
    handle_health(svc, call, m, len);
  } else {
    unknown_method(call, method);
  }
  embps_free(msg);
}

/* The pool's memory: pinned for the CUDA backend's device once the group has formed. */
static void *host_alloc(void *group, size_t bytes, int *pinned) {
  return embps_host_alloc(embps_group_host_device(group), bytes, pinned);
}

static void host_free(void *group, void *p, size_t bytes, int pinned) {
  (void)group;
  embps_host_free(p, pinned, bytes);
}

static void *pb_alloc(void *data, size_t size) {
  embps_service_t *svc = data;
  void *p = embps__bufpool_get(svc->buffers, size);
  if (!p)
    svc->unpack_out_of_memory = 1;
  return p;
}

static void pb_free(void *data, void *p) {
  (void)data;
  if (p)
    embps__bufpool_put(p);
}

embps_status_t embps_service_new(embps_service_t **out, embps_group_t *group, embps_store_t *store,
                                 const embps_service_config_t *cfg) {
  embps_service_t *svc = embps_calloc(1, sizeof(*svc));
  embps_bufpool_backing_t backing;
  if (!svc)
    return EMBPS_RESOURCE_EXHAUSTED;
  backing.alloc = host_alloc;
  backing.free = host_free;
  backing.ctx = group;
  svc->group = group;
  svc->store = store;
  svc->cfg = *cfg;
  /* Enough idle buffers for a deep pipeline of large requests and replies, and no more than
   * 1 GiB idle. */
  svc->buffers = embps__bufpool_new(64, (size_t)1 << 30, &backing);
  if (!svc->buffers) {
    embps_free(svc);
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  svc->pb.alloc = pb_alloc;
  svc->pb.free = pb_free;
  svc->pb.allocator_data = svc;
  svc->started_ns = embps_now_ns();
  *out = svc;
  return EMBPS_OK;
}

void embps_service_set_net(embps_service_t *svc, embps_net_t *net) { svc->net = net; }

void embps_service_set_metrics(embps_service_t *svc, char *(*render)(void *arg, size_t *len),
                               void *arg) {
  svc->render_metrics = render;
  svc->render_metrics_arg = arg;
}

void embps_service_set_auth(embps_service_t *svc, const embps_auth_t *auth) { svc->auth = auth; }

uint64_t embps_service_inflight(const embps_service_t *svc) { return svc->inflight; }

void embps_service_drain(embps_service_t *svc) { svc->draining = 1; }

void embps_service_free(embps_service_t *svc) {
  if (!svc)
    return;
  embps__bufpool_free(svc->buffers);
  embps_free(svc);
}
