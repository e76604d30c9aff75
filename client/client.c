/* The libembps API: calls on a shard group built from per-rank gRPC streams.
 *
 * A call is one request to the group: a lookup or push becomes one stream per rank carrying
 * that rank's contiguous token shard (group.c plans it), every shard with the same batch id;
 * admin calls go to rank 0 (CreateTable, ListTables, Checkpoint) or to every rank (GetStats,
 * Health). A call finishes when all its streams have; its status is the first failing
 * rank's, in rank order, and its message names the rank when the group has more than one.
 *
 * Lookup replies never pass through protobuf-c: each rank's LookupResponse is parsed as it
 * arrives and its rows land directly at that shard's offset in the caller's buffer (rows of
 * padding tokens fall past the caller's n rows and are dropped by the parser's capacity).
 * Requests are sent from the caller's token and gradient arrays; padding is sent as zero
 * segments, so padding a batch allocates nothing.
 *
 * Batch ids: a counter per client, starting at a random 31-bit value shifted left by 32, so
 * ids increase in call order and two clients of the same group do not share ids. */
#include "client/embps.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/conn.h"
#include "client/group.h"
#include "client/wire.h"
#include "common/alloc.h"
#include "common/clock.h"
#include "common/shape.h"
#include "embps/v1/embps.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#define PATH_PREFIX "/embps.v1.EmbeddingService/"

struct embps_client {
  embps__addr_t *addrs;
  embps__conn_t **conns;
  uint32_t group_size; /* == number of addresses */
  int64_t deadline_ms;
  int64_t connect_timeout_ms;
  int pad;
  uint64_t next_batch_id;
  embps_error_t last;
  embps_call_t *calls; /* in flight, for embps_client_free */
};

enum call_kind { CALL_LOOKUP, CALL_PUSH, CALL_UNARY };

typedef struct shard {
  embps_call_t *call;
  uint32_t rank;
  embps__stream_t *stream;
  embps__batch_frame_t frame;
  embps__lookup_parser_t parser;
} shard_t;

struct embps_call {
  embps_client_t *client;
  enum call_kind kind;
  uint64_t batch_id;
  int64_t deadline; /* CLOCK_MONOTONIC ms; 0: none */
  uint32_t nshards;
  uint32_t pending;
  uint8_t *req; /* a unary request, shared by the shards */
  embps_push_result_t *push_result;
  embps_call_t *next, *prev;
  shard_t shards[];
};

/* protobuf-c allocations go through the project's wrapper too. allocator_data, when set, points
 * at a flag that a failed allocation raises (see reply_unpack). */
static void *pb_alloc(void *data, size_t size) {
  void *p = embps_malloc(size);
  if (!p && data)
    *(int *)data = 1;
  return p;
}
static void pb_free(void *data, void *p) {
  (void)data;
  embps_free(p);
}
static ProtobufCAllocator pb_allocator = {pb_alloc, pb_free, NULL};

static embps_status_t fail(embps_client_t *c, embps_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static embps_status_t fail(embps_client_t *c, embps_status_t st, const char *fmt, ...) {
  va_list ap;
  c->last.status = st;
  va_start(ap, fmt);
  vsnprintf(c->last.message, sizeof(c->last.message), fmt, ap);
  va_end(ap);
  return st;
}

static embps_status_t fail_err(embps_client_t *c, const embps_error_t *err) {
  c->last = *err;
  return err->status;
}

/* Unpacks rank's reply, gathered in s's buffer, as a message of type desc; free it with
 * protobuf_c_message_free_unpacked(m, &pb_allocator). protobuf-c answers NULL both for bytes
 * that do not parse and for an allocation that failed, so the allocator tells the two apart: on
 * NULL the failure is recorded as RESOURCE_EXHAUSTED or, for a malformed reply, INTERNAL. */
static ProtobufCMessage *reply_unpack(embps_client_t *c, const ProtobufCMessageDescriptor *desc,
                                      const embps__stream_t *s, uint32_t rank) {
  int out_of_memory = 0;
  ProtobufCAllocator a = {pb_alloc, pb_free, &out_of_memory};
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, &a, s->buf_len, s->buf);
  if (m)
    return m;
  if (out_of_memory)
    fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory decoding the %s of rank %u", desc->short_name,
         rank);
  else
    fail(c, EMBPS_INTERNAL, "malformed %s from rank %u (%s)", desc->short_name, rank,
         embps__conn_addr(s->conn)->authority);
  return NULL;
}

/* ---- options and small accessors ---- */

void embps_client_options_init(embps_client_options_t *opts) {
  memset(opts, 0, sizeof(*opts));
  opts->connect_timeout_ms = 10000;
}

const char *embps_client_last_error(const embps_client_t *client) { return client->last.message; }

embps_status_t embps_client_last_status(const embps_client_t *client) {
  return client->last.status;
}

uint32_t embps_client_group_size(const embps_client_t *client) { return client->group_size; }

void embps_client_set_deadline(embps_client_t *client, int64_t deadline_ms) {
  client->deadline_ms = deadline_ms > 0 ? deadline_ms : 0;
}

void embps_client_set_padding(embps_client_t *client, int pad_batches) {
  client->pad = pad_batches != 0;
}

const char *embps_status_string(embps_status_t status) { return embps_status_name(status); }

void embps_table_spec_init(embps_table_spec_t *spec) { memset(spec, 0, sizeof(*spec)); }

/* ---- calls ---- */

static void on_stream_done(embps__stream_t *s) {
  shard_t *sh = s->user;
  sh->call->pending--;
}

static embps_call_t *call_new(embps_client_t *c, enum call_kind kind, uint32_t nshards) {
  embps_call_t *call = embps_calloc(1, sizeof(*call) + nshards * sizeof(shard_t));
  if (!call)
    return NULL;
  call->client = c;
  call->kind = kind;
  call->nshards = nshards;
  call->deadline = c->deadline_ms ? (int64_t)embps_now_ms() + c->deadline_ms : 0;
  for (uint32_t i = 0; i < nshards; i++) {
    call->shards[i].call = call;
    call->shards[i].rank = i;
  }
  call->next = c->calls;
  if (c->calls)
    c->calls->prev = call;
  c->calls = call;
  return call;
}

static void call_free(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (uint32_t i = 0; i < call->nshards; i++) {
    if (call->shards[i].stream) {
      call->shards[i].stream->on_done = NULL;
      embps__stream_release(call->shards[i].stream);
    }
  }
  if (call->prev)
    call->prev->next = call->next;
  else
    c->calls = call->next;
  if (call->next)
    call->next->prev = call->prev;
  embps_free(call->req);
  embps_free(call);
}

/* Creates shard sh's stream for path, submits it on the shard's rank, and counts it. */
static embps_status_t shard_submit(embps_call_t *call, shard_t *sh, const char *path,
                                   const embps__seg_t *segs, int nsegs) {
  embps_client_t *c = call->client;
  embps_error_t err;
  embps_status_t st;
  embps__stream_t *s = embps_calloc(1, sizeof(*s));
  if (!s)
    return fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  s->path = path;
  s->timeout_ms = c->deadline_ms;
  memcpy(s->segs, segs, (size_t)nsegs * sizeof(*segs));
  s->nsegs = nsegs;
  s->on_done = on_stream_done;
  s->user = sh;
  embps_error_clear(&err);
  st = embps__conn_submit(c->conns[sh->rank], s, c->connect_timeout_ms, &err);
  if (st != EMBPS_OK) {
    embps__stream_release(s);
    if (c->group_size > 1)
      return fail(c, st, "rank %u (%s): %s", sh->rank, c->addrs[sh->rank].authority, err.message);
    return fail_err(c, &err);
  }
  sh->stream = s;
  call->pending++;
  return EMBPS_OK;
}

static void call_kick(embps_call_t *call) {
  for (uint32_t i = 0; i < call->nshards; i++)
    if (call->shards[i].stream)
      embps__conn_kick(call->shards[i].stream->conn);
}

/* Moves I/O until every stream of call has finished or the deadline passes. Does not free. */
static void call_run(embps_call_t *call) {
  embps_client_t *c = call->client;
  while (call->pending > 0) {
    int timeout = -1;
    if (call->deadline) {
      int64_t left = call->deadline - (int64_t)embps_now_ms();
      if (left <= 0) {
        char msg[128];
        snprintf(msg, sizeof(msg), "deadline of %lld ms exceeded", (long long)c->deadline_ms);
        for (uint32_t i = 0; i < call->nshards; i++)
          if (call->shards[i].stream)
            embps__stream_cancel(call->shards[i].stream, EMBPS_DEADLINE_EXCEEDED, msg);
        break;
      }
      timeout = left > 1000000 ? 1000000 : (int)left;
    }
    if (embps__conns_pump(c->conns, c->group_size, timeout) < 0) {
      char msg[160];
      embps_status_t st = errno == ENOMEM ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_UNAVAILABLE;
      snprintf(msg, sizeof(msg), "poll: %s", strerror(errno));
      for (uint32_t i = 0; i < call->nshards; i++)
        if (call->shards[i].stream)
          embps__stream_cancel(call->shards[i].stream, st, msg);
      break;
    }
  }
}

/* The call's status: the first failing shard's, in rank order, recorded as the last error. */
static embps_status_t call_status(embps_call_t *call) {
  embps_client_t *c = call->client;
  for (uint32_t i = 0; i < call->nshards; i++) {
    embps__stream_t *s = call->shards[i].stream;
    if (!s || s->result.status == EMBPS_OK)
      continue;
    if (c->group_size > 1)
      return fail(c, s->result.status, "rank %u (%s): %s", call->shards[i].rank,
                  c->addrs[call->shards[i].rank].authority, s->result.message);
    return fail_err(c, &s->result);
  }
  embps_error_clear(&c->last);
  return EMBPS_OK;
}

/* ---- lookup ---- */

static embps_status_t lookup_sink(void *arg, const uint8_t *p, size_t n, embps_error_t *err) {
  shard_t *sh = arg;
  return embps__lookup_parser_feed(&sh->parser, p, n, err);
}

static embps_status_t lookup_finish(void *arg, embps_error_t *err) {
  shard_t *sh = arg;
  embps_status_t st = embps__lookup_parser_finish(&sh->parser, err);
  if (st != EMBPS_OK)
    return st;
  if (sh->parser.batch_id != sh->call->batch_id || sh->parser.shard_index != sh->rank)
    return embps_error_set(err, EMBPS_INTERNAL,
                           "lookup reply is for batch %llu shard %u, the request was batch "
                           "%llu shard %u",
                           (unsigned long long)sh->parser.batch_id, sh->parser.shard_index,
                           (unsigned long long)sh->call->batch_id, sh->rank);
  return EMBPS_OK;
}

/* Checks a batch's common arguments and plans it. */
static embps_status_t batch_check(embps_client_t *c, const char *what, const char *table,
                                  const int64_t *tokens, size_t n, const void *buf, size_t bytes,
                                  embps__batch_plan_t *plan, uint64_t *row_bytes) {
  embps_error_t err;
  if (!table || !table[0])
    return fail(c, EMBPS_INVALID_ARGUMENT, "%s: no table name", what);
  if (n > 0 && (!tokens || !buf))
    return fail(c, EMBPS_INVALID_ARGUMENT, "%s: NULL tokens or buffer", what);
  if (n == 0 ? bytes != 0 : (bytes == 0 || bytes % n != 0))
    return fail(c, EMBPS_INVALID_ARGUMENT,
                "%s: buffer of %zu bytes does not hold %zu whole rows (n x emb_width x dtype "
                "size bytes)",
                what, bytes, n);
  *row_bytes = n ? bytes / n : 0;
  embps_error_clear(&err);
  if (embps__batch_plan(plan, n, c->group_size, c->pad, &err) != EMBPS_OK)
    return fail_err(c, &err);
  return EMBPS_OK;
}

/* Starts a lookup or push: one stream per rank with that rank's token shard. */
static embps_status_t batch_start(embps_client_t *c, enum call_kind kind, const char *table,
                                  const int64_t *tokens, size_t n, void *out, const void *grads,
                                  size_t bytes, int dtype, int mode, embps_push_result_t *result,
                                  embps_call_t **out_call) {
  const char *what = kind == CALL_LOOKUP ? "lookup" : "push";
  embps__batch_plan_t plan;
  uint64_t row_bytes = 0;
  embps_status_t st;
  embps_call_t *call;
  embps_error_t err;

  st = batch_check(c, what, table, tokens, n, kind == CALL_LOOKUP ? out : grads, bytes, &plan,
                   &row_bytes);
  if (st != EMBPS_OK)
    return st;
  if (kind == CALL_PUSH && embps_dtype_size(dtype) == 0)
    return fail(c, EMBPS_INVALID_ARGUMENT, "push: dtype %d is neither f32 nor bf16", dtype);
  if (kind == CALL_PUSH && row_bytes % embps_dtype_size(dtype) != 0)
    return fail(c, EMBPS_INVALID_ARGUMENT,
                "push: %llu gradient bytes per token is not a whole number of %s values",
                (unsigned long long)row_bytes, embps_dtype_name(dtype));
  call = call_new(c, kind, c->group_size);
  if (!call)
    return fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  call->batch_id = c->next_batch_id++;
  call->push_result = result;
  for (uint32_t r = 0; r < c->group_size; r++) {
    shard_t *sh = &call->shards[r];
    embps__batch_fields_t f;
    embps__seg_t segs[EMBPS__MAX_SEGS];
    uint64_t first, real, pad;
    int ns = 0;

    embps__shard_range(&plan, r, &first, &real, &pad);
    memset(&f, 0, sizeof(f));
    f.table = table;
    f.batch_id = call->batch_id;
    f.shard_index = r;
    f.shard_count = c->group_size;
    f.tokens_per_batch = (uint32_t)plan.tokens_per_batch;
    f.tokens_bytes = plan.shard_tokens * sizeof(int64_t);
    f.is_push = kind == CALL_PUSH;
    f.dtype = kind == CALL_PUSH ? dtype : 0;
    f.grads_bytes = plan.shard_tokens * row_bytes;
    f.mode = mode;
    embps_error_clear(&err);
    st = embps__batch_frame_build(&sh->frame, &f, &err);
    if (st != EMBPS_OK) {
      fail_err(c, &err);
      goto fail;
    }
    segs[ns++] = (embps__seg_t){sh->frame.head, sh->frame.head_len};
    if (real)
      segs[ns++] = (embps__seg_t){(const uint8_t *)(tokens + first), real * sizeof(int64_t)};
    if (pad)
      segs[ns++] = (embps__seg_t){NULL, pad * sizeof(int64_t)};
    if (sh->frame.mid_len)
      segs[ns++] = (embps__seg_t){sh->frame.mid, sh->frame.mid_len};
    if (kind == CALL_PUSH) {
      if (real)
        segs[ns++] = (embps__seg_t){(const uint8_t *)grads + first * row_bytes, real * row_bytes};
      if (pad)
        segs[ns++] = (embps__seg_t){NULL, pad * row_bytes};
      if (sh->frame.tail_len)
        segs[ns++] = (embps__seg_t){sh->frame.tail, sh->frame.tail_len};
    } else {
      embps__lookup_parser_init(&sh->parser, (uint8_t *)out + first * row_bytes,
                                (size_t)(real * row_bytes), plan.shard_tokens * row_bytes,
                                row_bytes);
    }
    st = shard_submit(call, sh,
                      kind == CALL_LOOKUP ? PATH_PREFIX "Lookup" : PATH_PREFIX "PushGradients",
                      segs, ns);
    if (st != EMBPS_OK)
      goto fail;
    if (kind == CALL_LOOKUP) {
      sh->stream->sink = lookup_sink;
      sh->stream->sink_arg = sh;
      sh->stream->sink_finish = lookup_finish;
    }
  }
  call_kick(call);
  *out_call = call;
  return EMBPS_OK;
fail:
  call_free(call); /* resets the shards already sent */
  return st;
}

embps_status_t embps_lookup_start(embps_client_t *client, const char *table, const int64_t *tokens,
                                  size_t n, void *out, size_t out_bytes, embps_call_t **call) {
  return batch_start(client, CALL_LOOKUP, table, tokens, n, out, NULL, out_bytes, 0, 0, NULL, call);
}

embps_status_t embps_push_start(embps_client_t *client, const char *table, const int64_t *tokens,
                                size_t n, const void *grads, size_t grad_bytes, embps_dtype_t dtype,
                                embps_push_mode_t mode, embps_push_result_t *result,
                                embps_call_t **call) {
  if (mode != EMBPS_PUSH_SYNC && mode != EMBPS_PUSH_ASYNC)
    return fail(client, EMBPS_INVALID_ARGUMENT, "push: mode %d is neither sync nor async",
                (int)mode);
  return batch_start(client, CALL_PUSH, table, tokens, n, NULL, grads, grad_bytes, (int)dtype,
                     (int)mode, result, call);
}

/* Joins the ranks' PushGradientsResponses into call->push_result. */
static embps_status_t push_join(embps_call_t *call) {
  embps_client_t *c = call->client;
  embps_push_result_t res;
  memset(&res, 0, sizeof(res));
  res.applied = res.ordered = 1;
  for (uint32_t i = 0; i < call->nshards; i++) {
    embps__stream_t *s = call->shards[i].stream;
    Embps__V1__PushGradientsResponse *m = (Embps__V1__PushGradientsResponse *)reply_unpack(
        c, &embps__v1__push_gradients_response__descriptor, s, i);
    if (!m)
      return c->last.status;
    if (m->batch_id != call->batch_id || m->shard_index != i) {
      embps__v1__push_gradients_response__free_unpacked(m, &pb_allocator);
      return fail(c, EMBPS_INTERNAL,
                  "push reply from rank %u is for batch %llu shard %u, the request was batch "
                  "%llu shard %u",
                  i, (unsigned long long)m->batch_id, m->shard_index,
                  (unsigned long long)call->batch_id, i);
    }
    res.applied &= m->applied != 0;
    res.ordered &= m->ordered != 0;
    res.skipped |= m->skipped != 0;
    if (i == 0) {
      res.grad_norm = m->grad_norm;
      res.num_unique = m->num_unique;
    }
    embps__v1__push_gradients_response__free_unpacked(m, &pb_allocator);
  }
  if (call->push_result)
    *call->push_result = res;
  return EMBPS_OK;
}

embps_status_t embps_call_wait(embps_call_t *call) {
  embps_status_t st;
  call_run(call);
  st = call_status(call);
  if (st == EMBPS_OK && call->kind == CALL_PUSH)
    st = push_join(call);
  call_free(call);
  return st;
}

int embps_call_test(embps_call_t *call) {
  if (call->pending > 0)
    embps__conns_pump(call->client->conns, call->client->group_size, 0);
  return call->pending == 0;
}

void embps_call_cancel(embps_call_t *call) {
  if (call)
    call_free(call);
}

embps_status_t embps_lookup(embps_client_t *client, const char *table, const int64_t *tokens,
                            size_t n, void *out, size_t out_bytes) {
  embps_call_t *call;
  embps_status_t st = embps_lookup_start(client, table, tokens, n, out, out_bytes, &call);
  return st != EMBPS_OK ? st : embps_call_wait(call);
}

embps_status_t embps_push(embps_client_t *client, const char *table, const int64_t *tokens,
                          size_t n, const void *grads, size_t grad_bytes, embps_dtype_t dtype,
                          embps_push_mode_t mode, embps_push_result_t *result) {
  embps_call_t *call;
  embps_status_t st =
      embps_push_start(client, table, tokens, n, grads, grad_bytes, dtype, mode, result, &call);
  return st != EMBPS_OK ? st : embps_call_wait(call);
}

/* ---- unary admin calls ---- */

/* Runs the request msg on ranks [first, first + count) and waits; on EMBPS_OK *out is the
 * finished call (replies in each shard's stream buffer), to be freed with call_free(). */
static embps_status_t unary(embps_client_t *c, const char *path, const ProtobufCMessage *msg,
                            uint32_t first, uint32_t count, embps_call_t **out) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  embps_status_t st;
  embps_call_t *call = call_new(c, CALL_UNARY, count);
  if (!call)
    return fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  call->req = embps_malloc(len + 5);
  if (!call->req) {
    call_free(call);
    return fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  embps__grpc_prefix(call->req, (uint32_t)len);
  protobuf_c_message_pack(msg, call->req + 5);
  for (uint32_t i = 0; i < count; i++) {
    embps__seg_t seg = {call->req, len + 5};
    call->shards[i].rank = first + i;
    st = shard_submit(call, &call->shards[i], path, &seg, 1);
    if (st != EMBPS_OK) {
      call_free(call);
      return st;
    }
  }
  call_kick(call);
  call_run(call);
  st = call_status(call);
  if (st != EMBPS_OK) {
    call_free(call);
    return st;
  }
  *out = call;
  return EMBPS_OK;
}

static int optimizer_to_pb(embps_optimizer_t o) { return (int)o; }

embps_status_t embps_create_table(embps_client_t *client, const embps_table_spec_t *spec) {
  Embps__V1__CreateTableRequest req = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
  Embps__V1__TableSpec ts = EMBPS__V1__TABLE_SPEC__INIT;
  Embps__V1__OptimizerConfig oc = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
  embps_call_t *call;
  embps_error_t err;
  embps_status_t st;

  if (!spec || !spec->name || !spec->name[0])
    return fail(client, EMBPS_INVALID_ARGUMENT, "create table: no table name");
  if (spec->dtype != 0 && embps_dtype_size(spec->dtype) == 0)
    return fail(client, EMBPS_INVALID_ARGUMENT, "create table: dtype %d is neither f32 nor bf16",
                (int)spec->dtype);
  if ((int)spec->optimizer < 0 || (int)spec->optimizer > (int)EMBPS_OPTIMIZER_ADAM)
    return fail(client, EMBPS_INVALID_ARGUMENT, "create table: unknown optimizer %d",
                (int)spec->optimizer);
  embps_error_clear(&err);
  if (embps_shape_check_emb_width(spec->emb_width, client->group_size, &err) != EMBPS_OK)
    return fail_err(client, &err);
  ts.name = (char *)spec->name;
  ts.rows = spec->rows;
  ts.emb_width = spec->emb_width;
  ts.dtype = (Embps__V1__DType)spec->dtype;
  ts.seed = spec->seed;
  ts.init_scale = spec->init_scale;
  oc.kind = (Embps__V1__OptimizerKind)optimizer_to_pb(spec->optimizer);
  oc.lr = spec->lr;
  oc.eps = spec->eps;
  oc.half_life = spec->half_life;
  oc.initial_accumulator = spec->initial_accumulator;
  oc.weight_decay = spec->weight_decay;
  oc.beta1 = spec->beta1;
  oc.beta2 = spec->beta2;
  ts.optimizer = &oc;
  req.spec = &ts;
  st = unary(client, PATH_PREFIX "CreateTable", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  call_free(call);
  return EMBPS_OK;
}

void embps_tables_free(embps_table_spec_t *tables, size_t n) {
  if (!tables)
    return;
  for (size_t i = 0; i < n; i++)
    embps_free((char *)tables[i].name);
  embps_free(tables);
}

/* Decodes a ListTablesResponse; sets *group_size if not NULL. */
static embps_status_t tables_decode(embps_client_t *c, const embps__stream_t *s, uint32_t rank,
                                    embps_table_spec_t **out, size_t *n, uint32_t *group_size) {
  Embps__V1__ListTablesResponse *m = (Embps__V1__ListTablesResponse *)reply_unpack(
      c, &embps__v1__list_tables_response__descriptor, s, rank);
  embps_table_spec_t *t = NULL;
  if (!m)
    return c->last.status;
  if (group_size)
    *group_size = m->group_size;
  if (out) {
    t = embps_calloc(m->n_tables ? m->n_tables : 1, sizeof(*t));
    if (!t)
      goto oom;
    for (size_t i = 0; i < m->n_tables; i++) {
      const Embps__V1__TableSpec *ts = m->tables[i];
      const Embps__V1__OptimizerConfig *oc = ts->optimizer;
      t[i].name = embps_strdup(ts->name ? ts->name : "");
      if (!t[i].name) {
        embps_tables_free(t, i);
        goto oom;
      }
      t[i].rows = ts->rows;
      t[i].emb_width = ts->emb_width;
      t[i].dtype = ts->dtype == 0 ? EMBPS_DTYPE_F32 : (embps_dtype_t)ts->dtype;
      t[i].seed = ts->seed;
      t[i].init_scale = ts->init_scale;
      if (oc) {
        t[i].optimizer = (embps_optimizer_t)oc->kind;
        t[i].lr = oc->lr;
        t[i].eps = oc->eps;
        t[i].half_life = oc->half_life;
        t[i].initial_accumulator = oc->initial_accumulator;
        t[i].weight_decay = oc->weight_decay;
        t[i].beta1 = oc->beta1;
        t[i].beta2 = oc->beta2;
      }
    }
    *out = t;
    *n = m->n_tables;
  }
  embps__v1__list_tables_response__free_unpacked(m, &pb_allocator);
  return EMBPS_OK;
oom:
  embps__v1__list_tables_response__free_unpacked(m, &pb_allocator);
  return fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
}

embps_status_t embps_list_tables(embps_client_t *client, embps_table_spec_t **tables, size_t *n) {
  Embps__V1__ListTablesRequest req = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
  embps_call_t *call;
  embps_status_t st = unary(client, PATH_PREFIX "ListTables", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  st = tables_decode(client, call->shards[0].stream, 0, tables, n, NULL);
  call_free(call);
  return st;
}

static char *dup_or_empty(const char *s) { return embps_strdup(s ? s : ""); }

void embps_stats_free(embps_rank_stats_t *stats, size_t n) {
  if (!stats)
    return;
  for (size_t i = 0; i < n; i++) {
    embps_free(stats[i].backend);
    embps_free(stats[i].version);
    embps_free(stats[i].address);
    embps_free(stats[i].mesh);
    for (size_t j = 0; j < stats[i].num_tables && stats[i].tables; j++)
      embps_free(stats[i].tables[j].name);
    embps_free(stats[i].tables);
  }
  embps_free(stats);
}

embps_status_t embps_stats(embps_client_t *client, embps_rank_stats_t **stats, size_t *n) {
  Embps__V1__GetStatsRequest req = EMBPS__V1__GET_STATS_REQUEST__INIT;
  embps_rank_stats_t *out;
  embps_call_t *call;
  embps_status_t st =
      unary(client, PATH_PREFIX "GetStats", &req.base, 0, client->group_size, &call);
  if (st != EMBPS_OK)
    return st;
  out = embps_calloc(call->nshards, sizeof(*out));
  if (!out) {
    call_free(call);
    return fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    embps_rank_stats_t *r = &out[i];
    Embps__V1__GetStatsResponse *m = (Embps__V1__GetStatsResponse *)reply_unpack(
        client, &embps__v1__get_stats_response__descriptor, s, i);
    if (!m) {
      st = client->last.status;
      goto fail;
    }
    r->rank = m->rank;
    r->group_size = m->group_size;
    r->uptime_s = m->uptime_s;
    r->requests = m->requests;
    r->errors = m->errors;
    r->bytes_in = m->bytes_in;
    r->bytes_out = m->bytes_out;
    r->connections = m->connections;
    r->ready = m->ready;
    r->peer_bytes_sent = m->peer_bytes_sent;
    r->peer_bytes_received = m->peer_bytes_received;
    r->collective_calls = m->collective_calls;
    r->mesh = dup_or_empty(m->mesh);
    r->backend = dup_or_empty(m->backend);
    r->version = dup_or_empty(m->version);
    r->address = dup_or_empty(client->addrs[i].authority);
    r->tables = embps_calloc(m->n_tables ? m->n_tables : 1, sizeof(*r->tables));
    if (r->tables)
      r->num_tables = m->n_tables;
    for (size_t j = 0; r->tables && j < m->n_tables; j++) {
      const Embps__V1__TableStats *t = m->tables[j];
      embps_table_stats_t *o = &r->tables[j];
      o->name = dup_or_empty(t->name);
      o->rows = t->rows;
      o->emb_width = t->emb_width;
      o->lookups = t->lookups;
      o->pushes = t->pushes;
      o->rows_looked_up = t->rows_looked_up;
      o->rows_pushed = t->rows_pushed;
      o->steps_applied = t->steps_applied;
      o->steps_skipped = t->steps_skipped;
      o->bytes = t->bytes;
    }
    embps__v1__get_stats_response__free_unpacked(m, &pb_allocator);
    if (!r->backend || !r->version || !r->address || !r->mesh || !r->tables) {
      st = fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
      goto fail;
    }
    for (size_t j = 0; j < r->num_tables; j++)
      if (!r->tables[j].name) {
        st = fail(client, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
      }
  }
  *stats = out;
  *n = call->nshards;
  call_free(call);
  return EMBPS_OK;
fail:
  embps_stats_free(out, call->nshards);
  call_free(call);
  return st;
}

embps_status_t embps_health(embps_client_t *client, const char *service, int *serving) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  embps_call_t *call;
  embps_status_t st;
  req.service = (char *)(service ? service : "");
  st = unary(client, "/grpc.health.v1.Health/Check", &req.base, 0, client->group_size, &call);
  if (st != EMBPS_OK)
    return st;
  *serving = 1;
  for (uint32_t i = 0; i < call->nshards; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    Grpc__Health__V1__HealthCheckResponse *m =
        (Grpc__Health__V1__HealthCheckResponse *)reply_unpack(
            client, &grpc__health__v1__health_check_response__descriptor, s, i);
    int status;
    if (!m) {
      call_free(call);
      return client->last.status;
    }
    status = m->status;
    grpc__health__v1__health_check_response__free_unpacked(m, &pb_allocator);
    if (status != GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING && *serving) {
      static const char *names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
      *serving = 0;
      fail(client, EMBPS_OK, "rank %u (%s) is %s", i, client->addrs[i].authority,
           status >= 0 && status <= 3 ? names[status] : "UNKNOWN");
    }
  }
  call_free(call);
  return EMBPS_OK;
}

embps_status_t embps_checkpoint(embps_client_t *client, const char *table, const char *path,
                                uint64_t *bytes) {
  Embps__V1__CheckpointRequest req = EMBPS__V1__CHECKPOINT_REQUEST__INIT;
  Embps__V1__CheckpointResponse *m;
  embps_call_t *call;
  embps_status_t st;
  req.table = (char *)(table ? table : "");
  req.path = (char *)(path ? path : "");
  st = unary(client, PATH_PREFIX "Checkpoint", &req.base, 0, 1, &call);
  if (st != EMBPS_OK)
    return st;
  m = (Embps__V1__CheckpointResponse *)reply_unpack(
      client, &embps__v1__checkpoint_response__descriptor, call->shards[0].stream, 0);
  if (!m) {
    call_free(call);
    return client->last.status;
  }
  if (bytes)
    *bytes = m->bytes;
  embps__v1__checkpoint_response__free_unpacked(m, &pb_allocator);
  call_free(call);
  return EMBPS_OK;
}

/* ---- connect and free ---- */

static uint64_t random_base(void) {
  uint64_t r = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, &r, sizeof(r)) != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() << 20;
  }
  if (fd >= 0)
    close(fd);
  return ((r & 0x7fffffffull) << 32) + 1;
}

void embps_client_free(embps_client_t *client) {
  if (!client)
    return;
  while (client->calls)
    call_free(client->calls);
  for (uint32_t i = 0; client->conns && i < client->group_size; i++)
    embps__conn_free(client->conns[i]);
  embps_free(client->conns);
  embps_free(client->addrs);
  embps_free(client);
}

/* Learns the group size from every rank's ListTables and checks it against the addresses. */
static embps_status_t learn_group(embps_client_t *c) {
  Embps__V1__ListTablesRequest req = EMBPS__V1__LIST_TABLES_REQUEST__INIT;
  uint32_t n = c->group_size;
  embps_call_t *call;
  embps_status_t st = unary(c, PATH_PREFIX "ListTables", &req.base, 0, n, &call);
  if (st != EMBPS_OK)
    return st;
  for (uint32_t i = 0; i < n && st == EMBPS_OK; i++) {
    uint32_t g = 0;
    st = tables_decode(c, call->shards[i].stream, i, NULL, NULL, &g);
    if (st == EMBPS_OK && g != 0 && g != n)
      st = fail(c, EMBPS_FAILED_PRECONDITION,
                "%s belongs to a group of %u ranks but %u address%s given: list every rank's "
                "host:port in rank order",
                c->addrs[i].authority, g, n, n == 1 ? " was" : "es were");
  }
  call_free(call);
  return st;
}

embps_status_t embps_client_connect(embps_client_t **out, const char *servers,
                                    const embps_client_options_t *opts, embps_error_t *err) {
  embps_client_options_t defaults;
  embps_client_t *c;
  embps_status_t ret;
  size_t n = 0;

  if (!opts) {
    embps_client_options_init(&defaults);
    opts = &defaults;
  }
  c = embps_calloc(1, sizeof(*c));
  if (!c)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  ret = embps__parse_servers(servers, &c->addrs, &n, err);
  if (ret != EMBPS_OK)
    goto fail;
  if (opts->group_size != 0 && opts->group_size != n) {
    ret = embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                          "the group has %u ranks but %zu addresses were given: list every "
                          "rank's host:port in rank order",
                          opts->group_size, n);
    goto fail;
  }
  c->group_size = (uint32_t)n;
  c->deadline_ms = opts->deadline_ms > 0 ? opts->deadline_ms : 0;
  c->connect_timeout_ms = opts->connect_timeout_ms > 0 ? opts->connect_timeout_ms : 10000;
  c->pad = opts->pad_batches != 0;
  c->next_batch_id = random_base();
  c->conns = embps_calloc(n, sizeof(*c->conns));
  if (!c->conns) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    ret = embps__conn_open(&c->conns[i], &c->addrs[i], c->connect_timeout_ms, err);
    if (ret != EMBPS_OK)
      goto fail;
  }
  if (opts->group_size == 0) {
    int64_t saved = c->deadline_ms;
    c->deadline_ms = c->connect_timeout_ms;
    ret = learn_group(c);
    c->deadline_ms = saved;
    if (ret != EMBPS_OK) {
      if (err)
        *err = c->last;
      goto fail;
    }
  }
  embps_error_clear(&c->last);
  *out = c;
  return EMBPS_OK;
fail:
  embps_client_free(c);
  return ret;
}
