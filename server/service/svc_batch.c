/* Lookup, PushGradients and Assign: the batch-shaped calls, which carry one token shard of a
 * batch (Assign is shaped as PushGradients, with rows in place of gradients).
 *
 * Both are validated in one place (validate_batch, and validate_lookup for the reply's size)
 * before anything is queued, so a rejected request has changed nothing; set_batch then makes the
 * op the group runs. A lookup's reply is one buffer: the LookupResponse header
 * (embps__svc_put_lookup_header), then the rows the engine gathers straight behind it, which the
 * network layer writes without another copy, and which may begin to leave while the engine
 * fills the rest (on_lookup_progress). A push on a host backend reads its gradients where they
 * arrived, in the request's bytes (unpack_push). An async push is answered once it is ordered
 * (on_push_ordered), a sync one once it is applied. Both carry the client's digest of the whole
 * batch and the attempt into the group, and a shard whose caller goes away while it waits is
 * withdrawn from its batch (on_call_cancel). */
#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "common/shape.h"
#include "common/wire_fields.h"
#include "server/service/service_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "embps's wire arrays are little-endian and it runs on little-endian hosts only"
#endif

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

  if ((ret = embps__svc_check_group(svc, err)) != EMBPS_OK)
    return ret;
  if (!(t = embps__svc_find_table(svc, table_name, err)))
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
  /* A hash-keyed table takes any 64-bit id (an int64 read as a uint64) as a key. */
  for (size_t i = 0; i < n && !embps_table_config_hashed(embps_table_config(t)); i++) {
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

/* The caller of a lookup or push shard went away before it was answered (its stream was reset,
 * or its connection closed): while its shard is parked, its batch is cancelled on every rank
 * instead of waiting for, or joining, the other shards. The request lives until it is answered,
 * and the network layer never calls this after. */
static void on_call_cancel(void *arg) {
  embps__svc_request_t *r = arg;
  r->caller_gone = 1;
  embps_group_withdraw(r->svc->group, &r->group_call);
}

/* The name of a lookup or push shard's batch, as its request carries it. */
typedef struct batch_name {
  uint64_t client_id, batch_id, digest;
  uint32_t attempt, shard_index;
} batch_name_t;

/* The op of a validated lookup or push shard: this rank's tokens of table t. */
static void set_batch(embps__svc_request_t *r, embps_op_kind_t kind, const batch_name_t *name,
                      embps_table_t *t, const ProtobufCBinaryData *tokens) {
  const size_t n = tokens->len / sizeof(int64_t);
  r->shard_index = name->shard_index;
  r->group_call.client_id = name->client_id;
  r->group_call.batch_id = name->batch_id;
  r->group_call.digest = name->digest;
  r->group_call.attempt = name->attempt;
  r->group_call.tokens_per_batch = (uint32_t)(n * embps_group_size(r->svc->group));
  r->group_call.deadline_ns = embps_net_call_deadline_ns(r->call);
  r->group_call.op.kind = kind;
  r->group_call.op.table = t;
  r->group_call.op.tokens = (const int64_t *)tokens->data;
  r->group_call.op.num_tokens = n;
}

/* ---- Lookup ---- */

/* More of a lookup's rows are final (the CPU engine publishes them chunk by chunk): they leave
 * while the engine gathers the rest, instead of after the whole reply is made. The first chunk
 * begins the reply, which from then on owns the buffer (the net keeps it until the call ends,
 * so the engine never writes into freed memory when the client goes). When the reply cannot
 * begin (client gone, out of memory) nothing changed, and done answers it whole as before. A
 * reply does not begin while its connection carries other calls (embps_net_call_conn_shared). */
static void on_lookup_progress(embps_group_call_t *gc) {
  embps__svc_request_t *r = gc->user;
  size_t rows = atomic_load_explicit(&gc->op.rows_ready, memory_order_acquire);
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

static void lookup_done(embps__svc_request_t *r) {
  uint8_t *buf = r->reply;
  if (embps__svc_answer_failure(r))
    return;
  if (r->streaming) {
    embps_net_call_reply_end(r->call);
    return;
  }
  r->reply = NULL; /* the call owns it now */
  embps_net_call_reply(r->call, buf, r->reply_len, embps__bufpool_put, buf);
}

void embps__svc_lookup(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_LOOKUP_REQUEST_TABLE};
  Embps__V1__LookupRequest *req = embps__v1__lookup_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  embps_table_t *t;
  embps__svc_request_t *r;
  size_t rows_bytes = 0, head;
  uint8_t header[EMBPS__SVC_LOOKUP_HEADER_MAX];
  (void)owned;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "LookupRequest");
    return;
  }
  if (embps__svc_check_names(msg, len, name_path, 1, &err) != EMBPS_OK ||
      validate_lookup(svc, req, &t, &rows_bytes, &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  head = embps__svc_put_lookup_header(header, req->batch_id, req->shard_index,
                                      embps_table_config(t)->emb_width,
                                      embps_table_config(t)->dtype, rows_bytes);
  /* The last check, as it counts the reply against the connection (call_fail uncounts it). */
  if (embps_net_call_hold_reply(call, head + rows_bytes, &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  r = embps__svc_request_new(svc, call, &req->base, lookup_done);
  if (!r || !(r->reply = embps__bufpool_get(svc->buffers, head + rows_bytes))) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte reply",
                    head + rows_bytes);
    embps__svc_fail(call, &err);
    if (r)
      r->msg = NULL;
    embps_free(r);
    embps__v1__lookup_request__free_unpacked(req, &svc->pb);
    return;
  }
  memcpy(r->reply, header, head);
  r->reply_len = head + rows_bytes;
  set_batch(
      r, EMBPS_OP_LOOKUP,
      &(batch_name_t){req->client_id, req->batch_id, req->digest, req->attempt, req->shard_index},
      t, &req->tokens);
  r->group_call.op.rows_out = r->reply + head;
  r->reply_head = head;
  r->row_bytes = embps_table_config(t)->emb_width * embps_dtype_size(embps_table_config(t)->dtype);
  /* decided here too, so that a call that arrives beside others costs the engine no wakeups */
  r->group_call.progress = embps_net_call_conn_shared(call) ? NULL : on_lookup_progress;
  embps_net_call_on_cancel(call, on_call_cancel, r);
  embps__svc_submit(r);
}

/* ---- PushGradients ---- */

/* An async push is answered once the leader has ordered its round: every rank then runs it
 * before any batch ordered later, so every later lookup sees it. Answering any earlier would
 * promise an update that a batch failing before it is ordered (a shard that never arrives, a
 * broken peer) never makes. */
static void on_push_ordered(embps_group_call_t *gc) {
  embps__svc_request_t *r = gc->user;
  Embps__V1__PushGradientsResponse resp = EMBPS__V1__PUSH_GRADIENTS_RESPONSE__INIT;
  if (!r->call)
    return;
  resp.batch_id = gc->batch_id;
  resp.shard_index = r->shard_index;
  resp.ordered = 1;
  embps__svc_reply(r->call, &resp.base);
  r->call = NULL;
}

static void push_done(embps__svc_request_t *r) {
  Embps__V1__PushGradientsResponse resp = EMBPS__V1__PUSH_GRADIENTS_RESPONSE__INIT;
  if (embps__svc_answer_failure(r))
    return;
  resp.batch_id = r->group_call.batch_id;
  resp.shard_index = r->shard_index;
  resp.applied = r->group_call.op.applied;
  resp.skipped = r->group_call.op.skipped;
  resp.grad_norm = r->group_call.op.grad_norm;
  resp.num_unique = r->group_call.op.num_unique;
  resp.replayed = r->group_call.replayed != 0;
  embps__svc_reply(r->call, &resp.base);
}

/* On a backend that computes on host memory: the message msg[0..len) without its one bulk bytes
 * field `field`, in a new allocation (*rest_len bytes; the caller frees it), with *bulk pointing
 * at the field's bytes inside msg. NULL elsewhere, or when the field is not found once (the
 * caller then unpacks the whole message, which rules on it), or out of memory. */
static uint8_t *strip_bulk(embps_service_t *svc, const uint8_t *msg, size_t len, uint32_t field,
                           ProtobufCBinaryData *bulk, size_t *rest_len) {
  size_t at, data, n;
  uint8_t *rest;
  if (embps_group_host_device(svc->group) >= 0 ||
      !embps__svc_find_bytes_field(msg, len, field, &at, &data, &n) ||
      (rest = embps_malloc(len - n - (data - at))) == NULL)
    return NULL;
  memcpy(rest, msg, at);
  memcpy(rest + at, msg + data + n, len - data - n);
  *rest_len = len - n - (data - at);
  bulk->data = (uint8_t *)msg + data;
  bulk->len = n;
  return rest;
}

/* Unpacks msg[0..len) as a message of desc, its one bulk bytes field `field` read in place where
 * the backend computes on host memory (*in_place set, *bulk pointing into msg, which the caller
 * must then keep); elsewhere the whole message is unpacked and the caller reads the field from
 * it. Returns NULL as protobuf-c's unpack does. */
static ProtobufCMessage *unpack_bulk(embps_service_t *svc, const ProtobufCMessageDescriptor *desc,
                                     const uint8_t *msg, size_t len, uint32_t field,
                                     ProtobufCBinaryData *bulk, int *in_place) {
  ProtobufCMessage *m;
  size_t rest_len;
  uint8_t *rest;
  *in_place = 0;
  if ((rest = strip_bulk(svc, msg, len, field, bulk, &rest_len)) != NULL) {
    m = protobuf_c_message_unpack(desc, &svc->pb, rest_len, rest);
    embps_free(rest);
    *in_place = m != NULL;
    return m;
  }
  return protobuf_c_message_unpack(desc, &svc->pb, len, msg);
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
  Embps__V1__PushGradientsRequest *req = (Embps__V1__PushGradientsRequest *)unpack_bulk(
      svc, &embps__v1__push_gradients_request__descriptor, msg, len,
      EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_GRADIENTS, grads, in_place);
  if (req && !*in_place)
    *grads = req->gradients;
  return req;
}

/* msg[0..len) is the request, *owned the allocation that holds it (from the network layer),
 * which the op takes (*owned = NULL) when it reads its gradients from it. Every optimizer of the
 * registry has a fused update on every backend, so an async push needs no check of its own. */
void embps__svc_push(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                     uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_TABLE};
  ProtobufCBinaryData grads = {0, NULL};
  int in_place;
  Embps__V1__PushGradientsRequest *req = unpack_push(svc, msg, len, &grads, &in_place);
  embps_error_t err;
  embps_table_t *t;
  embps__svc_request_t *r;
  size_t n, want;
  int async;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "PushGradientsRequest");
    return;
  }
  if (embps__svc_check_names(msg, len, name_path, 1, &err) != EMBPS_OK ||
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
  if (req->mode != EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC && !async) {
    embps_error_set(&err, EMBPS_INVALID_ARGUMENT, "update mode %d is neither sync nor async",
                    (int)req->mode);
    goto fail;
  }
  r = embps__svc_request_new(svc, call, &req->base, push_done);
  if (!r) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  set_batch(
      r, EMBPS_OP_PUSH,
      &(batch_name_t){req->client_id, req->batch_id, req->digest, req->attempt, req->shard_index},
      t, &req->tokens);
  r->group_call.op.grads = grads.data;
  if (in_place) { /* msg is *owned: in_place found a field, so the message is not empty */
    r->wire = *owned;
    *owned = NULL;
  }
  if (async)
    r->group_call.ordered = on_push_ordered;
  embps_net_call_on_cancel(call, on_call_cancel, r);
  embps__svc_submit(r);
  return;
fail:
  embps__svc_fail(call, &err);
  embps__v1__push_gradients_request__free_unpacked(req, &svc->pb);
}

/* ---- Assign ---- */

static void assign_done(embps__svc_request_t *r) {
  Embps__V1__AssignResponse resp = EMBPS__V1__ASSIGN_RESPONSE__INIT;
  if (embps__svc_answer_failure(r))
    return;
  resp.batch_id = r->group_call.batch_id;
  resp.shard_index = r->shard_index;
  resp.num_assigned = r->group_call.op.num_unique;
  resp.num_refused = r->group_call.op.num_refused;
  resp.replayed = r->group_call.replayed != 0;
  embps__svc_reply(r->call, &resp.base);
}

/* Unpacks an AssignRequest, its rows read in place where the backend computes on host memory, as
 * unpack_push reads a push's gradients. */
static Embps__V1__AssignRequest *unpack_assign(embps_service_t *svc, const uint8_t *msg, size_t len,
                                               ProtobufCBinaryData *rows, int *in_place) {
  Embps__V1__AssignRequest *req =
      (Embps__V1__AssignRequest *)unpack_bulk(svc, &embps__v1__assign_request__descriptor, msg, len,
                                              EMBPS_WIRE_ASSIGN_REQUEST_ROWS, rows, in_place);
  if (req && !*in_place)
    *rows = req->rows;
  return req;
}

/* Assign: PushGradients' shape and checks (the token range of a dense table, the dtype, the
 * rows' size), answered once the rows are written on every rank; ordered, deduplicated and
 * retried as a push (server/group/rounds.c). */
void embps__svc_assign(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg, size_t len,
                       uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_ASSIGN_REQUEST_TABLE};
  ProtobufCBinaryData rows = {0, NULL};
  int in_place;
  Embps__V1__AssignRequest *req = unpack_assign(svc, msg, len, &rows, &in_place);
  embps_error_t err;
  embps_table_t *t;
  embps__svc_request_t *r;
  size_t n, want;

  if (!req) {
    embps__svc_fail_unpack(svc, call, "AssignRequest");
    return;
  }
  if (embps__svc_check_names(msg, len, name_path, 1, &err) != EMBPS_OK ||
      validate_batch(svc, req->table, req->shard_index, req->shard_count, req->tokens_per_batch,
                     &req->tokens, req->dtype, &t, &err) != EMBPS_OK)
    goto fail;
  n = req->tokens.len / sizeof(int64_t);
  want = n * embps_table_config(t)->emb_width * embps_dtype_size(embps_table_config(t)->dtype);
  if (rows.len != want) {
    embps_error_set(&err, EMBPS_INVALID_ARGUMENT,
                    "rows hold %zu bytes, but %zu tokens of emb_width=%u %s need %zu", rows.len, n,
                    embps_table_config(t)->emb_width,
                    embps_dtype_name(embps_table_config(t)->dtype), want);
    goto fail;
  }
  r = embps__svc_request_new(svc, call, &req->base, assign_done);
  if (!r) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  set_batch(
      r, EMBPS_OP_ASSIGN,
      &(batch_name_t){req->client_id, req->batch_id, req->digest, req->attempt, req->shard_index},
      t, &req->tokens);
  r->group_call.op.rows_in = rows.data;
  r->group_call.op.reset_state = req->reset_state != 0;
  if (in_place) { /* msg is *owned: in_place found a field, so the message is not empty */
    r->wire = *owned;
    *owned = NULL;
  }
  embps_net_call_on_cancel(call, on_call_cancel, r);
  embps__svc_submit(r);
  return;
fail:
  embps__svc_fail(call, &err);
  embps__v1__assign_request__free_unpacked(req, &svc->pb);
}
