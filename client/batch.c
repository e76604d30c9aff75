/* Lookups, pushes and assigns: a batch of tokens split into one contiguous token shard per rank
 * (group.c plans it, padding it when the client pads), every shard sent with the same batch id
 * on its rank's connection as one stream of the call.
 *
 * Identity and retries: every shard carries the digest of the whole batch (common/digest.h:
 * the table, T and every shard's tokens, padding included) and the attempt number. When an
 * attempt fails in a way retry.h calls retryable, call.c has batch_send() send every shard
 * again with the next attempt number and the same batch id and digest, so the servers never
 * join shards of different attempts, and a push whose first attempt was applied is answered
 * with that attempt's result (replayed) instead of being applied twice.
 *
 * Lookup replies never pass through protobuf-c: each rank's LookupResponse is parsed as it
 * arrives and its rows land directly at that shard's offset in the caller's buffer (rows of
 * padding tokens fall past the caller's n rows and are dropped by the parser's capacity).
 * Requests are sent from the caller's token and gradient arrays; padding is sent as zero
 * segments, so padding a batch allocates nothing. A push's replies are joined into one result
 * when the call is waited for. */
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "common/clock.h"
#include "common/digest.h"
#include "common/wire_fields.h"
#include "embps/v1/embps.pb-c.h"

enum batch_kind { LOOKUP, PUSH, ASSIGN };

/* An AssignRequest numbers its fields as a PushGradientsRequest does, rows in place of gradients
 * and reset_state (a varint) in place of mode, so an assign is sent as a push's frame. */
_Static_assert(EMBPS_WIRE_ASSIGN_REQUEST_TABLE == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_TABLE &&
                   EMBPS_WIRE_ASSIGN_REQUEST_TOKENS == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_TOKENS &&
                   EMBPS_WIRE_ASSIGN_REQUEST_DTYPE == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_DTYPE &&
                   EMBPS_WIRE_ASSIGN_REQUEST_ROWS == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_GRADIENTS &&
                   EMBPS_WIRE_ASSIGN_REQUEST_RESET_STATE ==
                       EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_MODE &&
                   EMBPS_WIRE_ASSIGN_REQUEST_CLIENT_ID ==
                       EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_CLIENT_ID &&
                   EMBPS_WIRE_ASSIGN_REQUEST_DIGEST == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_DIGEST &&
                   EMBPS_WIRE_ASSIGN_REQUEST_ATTEMPT == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_ATTEMPT,
               "AssignRequest's fields must be numbered as PushGradientsRequest's");

/* ---- lookup ---- */

static embps_status_t lookup_sink(void *arg, const uint8_t *p, size_t n, embps_error_t *err) {
  embps__shard_t *sh = arg;
  return embps__lookup_parser_feed(&sh->parser, p, n, err);
}

static uint8_t *lookup_direct(void *arg, size_t *n) {
  embps__shard_t *sh = arg;
  return embps__lookup_parser_direct(&sh->parser, n);
}

static embps_status_t lookup_finish(void *arg, embps_error_t *err) {
  embps__shard_t *sh = arg;
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

/* Joins the ranks' PushGradientsResponses into call->push_result. */
static embps_status_t push_join(embps_call_t *call) {
  embps_client_t *c = call->client;
  embps_push_result_t res;
  memset(&res, 0, sizeof(res));
  res.applied = res.ordered = 1;
  for (uint32_t i = 0; i < call->nshards; i++) {
    embps__stream_t *s = call->shards[i].stream;
    Embps__V1__PushGradientsResponse *m = (Embps__V1__PushGradientsResponse *)embps__reply_unpack(
        c, &embps__v1__push_gradients_response__descriptor, s, i);
    if (!m)
      return c->last.status;
    if (embps__reply_check(call, "push", i, m->batch_id, m->shard_index) != EMBPS_OK) {
      embps__reply_free(&m->base);
      return c->last.status;
    }
    res.applied &= m->applied != 0;
    res.ordered &= m->ordered != 0;
    res.skipped |= m->skipped != 0;
    res.replayed |= m->replayed != 0;
    if (i == 0) {
      res.grad_norm = m->grad_norm;
      res.num_unique = m->num_unique;
    }
    embps__reply_free(&m->base);
  }
  if (call->push_result)
    *call->push_result = res;
  return EMBPS_OK;
}

/* Joins the ranks' AssignResponses into call->assign_result. */
static embps_status_t assign_join(embps_call_t *call) {
  embps_client_t *c = call->client;
  embps_assign_result_t res;
  memset(&res, 0, sizeof(res));
  for (uint32_t i = 0; i < call->nshards; i++) {
    embps__stream_t *s = call->shards[i].stream;
    Embps__V1__AssignResponse *m = (Embps__V1__AssignResponse *)embps__reply_unpack(
        c, &embps__v1__assign_response__descriptor, s, i);
    if (!m)
      return c->last.status;
    if (embps__reply_check(call, "assign", i, m->batch_id, m->shard_index) != EMBPS_OK) {
      embps__reply_free(&m->base);
      return c->last.status;
    }
    res.replayed |= m->replayed != 0;
    if (i == 0) {
      res.num_assigned = m->num_assigned;
      res.num_refused = m->num_refused;
    }
    embps__reply_free(&m->base);
  }
  if (call->assign_result)
    *call->assign_result = res;
  return EMBPS_OK;
}

/* Checks a batch's common arguments and plans it. */
static embps_status_t batch_check(embps_client_t *c, const char *what, const char *table,
                                  const int64_t *tokens, size_t n, const void *buf, size_t bytes,
                                  embps__batch_plan_t *plan, uint64_t *row_bytes) {
  embps_error_t err;
  if (!table || !table[0])
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: no table name", what);
  if (n > 0 && (!tokens || !buf))
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: NULL tokens or buffer", what);
  if (n == 0 ? bytes != 0 : (bytes == 0 || bytes % n != 0))
    return embps__client_fail(
        c, EMBPS_INVALID_ARGUMENT,
        "%s: buffer of %zu bytes does not hold %zu whole rows (n x emb_width x dtype "
        "size bytes)",
        what, bytes, n);
  *row_bytes = n ? bytes / n : 0;
  embps_error_clear(&err);
  if (embps__batch_plan(plan, n, c->group_size, c->pad, &err) != EMBPS_OK)
    return embps__client_fail_err(c, &err);
  return EMBPS_OK;
}

/* Sends every shard of the call's batch for call->attempt: one stream per rank with that rank's
 * token shard (call.c's send). On failure the shards sent are withdrawn (call->failed). */
static embps_status_t batch_send(embps_call_t *call) {
  embps_client_t *c = call->client;
  const embps__batch_req_t *b = &call->batch;
  const char *path = b->is_assign ? EMBPS__PATH_PREFIX "Assign"
                     : b->is_push ? EMBPS__PATH_PREFIX "PushGradients"
                                  : EMBPS__PATH_PREFIX "Lookup";
  embps_error_t err;
  embps_status_t st;

  for (uint32_t r = 0; r < c->group_size; r++) {
    embps__shard_t *sh = &call->shards[r];
    embps__batch_fields_t f;
    embps__seg_t segs[EMBPS__MAX_SEGS];
    uint64_t first, real, pad;
    int ns = 0;

    embps__shard_range(&b->plan, r, &first, &real, &pad);
    memset(&f, 0, sizeof(f));
    f.table = b->table;
    f.client_id = c->client_id;
    f.batch_id = call->batch_id;
    f.shard_index = r;
    f.shard_count = c->group_size;
    f.tokens_per_batch = (uint32_t)b->plan.tokens_per_batch;
    f.tokens_bytes = b->plan.shard_tokens * sizeof(int64_t);
    f.is_push = b->is_push;
    f.dtype = b->is_push ? b->dtype : 0;
    f.grads_bytes = b->plan.shard_tokens * b->row_bytes;
    f.mode = b->mode;
    f.digest = b->digest;
    f.attempt = call->attempt;
    embps_error_clear(&err);
    st = embps__batch_frame_build(&sh->frame, &f, &err);
    if (st != EMBPS_OK) {
      embps__client_fail_err(c, &err);
      return embps__call_attempt_failed(call, &c->last);
    }
    segs[ns++] = (embps__seg_t){sh->frame.head, sh->frame.head_len};
    if (real)
      segs[ns++] = (embps__seg_t){(const uint8_t *)(b->tokens + first), real * sizeof(int64_t)};
    if (pad)
      segs[ns++] = (embps__seg_t){NULL, pad * sizeof(int64_t)};
    if (sh->frame.mid_len)
      segs[ns++] = (embps__seg_t){sh->frame.mid, sh->frame.mid_len};
    if (b->is_push) {
      if (real)
        segs[ns++] =
            (embps__seg_t){(const uint8_t *)b->grads + first * b->row_bytes, real * b->row_bytes};
      if (pad)
        segs[ns++] = (embps__seg_t){NULL, pad * b->row_bytes};
    } else {
      /* A new parser each attempt: rows of an earlier one are written again. */
      embps__lookup_parser_init(&sh->parser, (uint8_t *)b->out + first * b->row_bytes,
                                (size_t)(real * b->row_bytes), b->plan.shard_tokens * b->row_bytes,
                                b->row_bytes);
    }
    if (sh->frame.tail_len) /* a push's mode; the client id, digest and attempt of either */
      segs[ns++] = (embps__seg_t){sh->frame.tail, sh->frame.tail_len};
    st = embps__shard_submit(call, sh, path, segs, ns);
    if (st != EMBPS_OK)
      return embps__call_attempt_failed(call, &c->last);
    if (!b->is_push) {
      sh->stream->sink = lookup_sink;
      sh->stream->sink_arg = sh;
      sh->stream->sink_finish = lookup_finish;
      sh->stream->sink_direct = lookup_direct;
    }
  }
  embps__call_kick(call);
  return EMBPS_OK;
}

/* Starts a lookup or push: checks it, plans it, computes its digest and sends its first attempt.
 * A first attempt that could not be sent for a retryable reason (a rank that cannot be reached)
 * is the call's to retry when retries are on; any other failure fails the start. */
static embps_status_t batch_start(embps_client_t *c, enum batch_kind kind, const char *table,
                                  const int64_t *tokens, size_t n, void *out, const void *grads,
                                  size_t bytes, int dtype, int mode, embps_push_result_t *result,
                                  embps_assign_result_t *assigned, embps_call_t **out_call) {
  const char *what = kind == LOOKUP ? "lookup" : kind == PUSH ? "push" : "assign";
  embps__batch_plan_t plan;
  uint64_t row_bytes = 0;
  embps_status_t st;
  embps_call_t *call;
  embps__verdict_t v = {0, 0, 0};

  st = batch_check(c, what, table, tokens, n, kind == LOOKUP ? out : grads, bytes, &plan,
                   &row_bytes);
  if (st != EMBPS_OK)
    return st;
  if (kind != LOOKUP && embps_dtype_size(dtype) == 0)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: dtype %d is neither f32 nor bf16",
                              what, dtype);
  if (kind != LOOKUP && row_bytes % embps_dtype_size(dtype) != 0)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                              "%s: %llu %s bytes per token is not a whole number of %s values",
                              what, (unsigned long long)row_bytes,
                              kind == PUSH ? "gradient" : "row", embps_dtype_name(dtype));
  call = embps__call_new(c, c->group_size);
  if (!call || !(call->batch.table = embps_strdup(table))) {
    if (call)
      embps__call_free(call);
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  call->batch_id = c->next_batch_id++;
  call->push_result = result;
  call->assign_result = assigned;
  if (kind == PUSH)
    call->join = push_join;
  else if (kind == ASSIGN)
    call->join = assign_join;
  call->send = batch_send;
  call->max_attempts = c->max_attempts;
  call->attempt_timeout_ms = c->attempt_timeout_ms;
  /* The first attempt's bounds; a deadline of 1 ms may pass right here, and then the first
   * advance of the call ends it. */
  embps__attempt_bounds((int64_t)embps_now_ms(), call->deadline, call->attempt_timeout_ms,
                        &call->attempt_deadline, &call->attempt_timeout);
  call->batch.is_push = kind != LOOKUP;
  call->batch.is_assign = kind == ASSIGN;
  call->batch.tokens = tokens;
  call->batch.out = out;
  call->batch.grads = grads;
  call->batch.row_bytes = row_bytes;
  call->batch.plan = plan;
  call->batch.dtype = kind != LOOKUP ? dtype : 0;
  call->batch.mode = kind != LOOKUP ? mode : 0; /* an assign's reset_state */
  call->batch.digest = embps_batch_digest_padded(table, (uint32_t)plan.tokens_per_batch, tokens, n);
  st = batch_send(call);
  embps__verdict_add(&v, st);
  if (st != EMBPS_OK && (call->max_attempts < 2 || !embps__verdict_retryable(&v))) {
    embps__call_free(call); /* the failure stays the client's last error */
    return st;
  }
  *out_call = call;
  return EMBPS_OK;
}

embps_status_t embps_lookup_start(embps_client_t *client, const char *table, const int64_t *tokens,
                                  size_t n, void *out, size_t out_bytes, embps_call_t **call) {
  return batch_start(client, LOOKUP, table, tokens, n, out, NULL, out_bytes, 0, 0, NULL, NULL,
                     call);
}

embps_status_t embps_push_start(embps_client_t *client, const char *table, const int64_t *tokens,
                                size_t n, const void *grads, size_t grad_bytes, embps_dtype_t dtype,
                                embps_push_mode_t mode, embps_push_result_t *result,
                                embps_call_t **call) {
  if (mode != EMBPS_PUSH_SYNC && mode != EMBPS_PUSH_ASYNC)
    return embps__client_fail(client, EMBPS_INVALID_ARGUMENT,
                              "push: mode %d is neither sync nor async", (int)mode);
  return batch_start(client, PUSH, table, tokens, n, NULL, grads, grad_bytes, (int)dtype, (int)mode,
                     result, NULL, call);
}

embps_status_t embps_assign_start(embps_client_t *client, const char *table, const int64_t *tokens,
                                  size_t n, const void *rows, size_t rows_bytes,
                                  embps_dtype_t dtype, int reset_state,
                                  embps_assign_result_t *result, embps_call_t **call) {
  return batch_start(client, ASSIGN, table, tokens, n, NULL, rows, rows_bytes, (int)dtype,
                     reset_state != 0, NULL, result, call);
}

embps_status_t embps_assign(embps_client_t *client, const char *table, const int64_t *tokens,
                            size_t n, const void *rows, size_t rows_bytes, embps_dtype_t dtype,
                            int reset_state, embps_assign_result_t *result) {
  embps_call_t *call;
  embps_status_t st = embps_assign_start(client, table, tokens, n, rows, rows_bytes, dtype,
                                         reset_state, result, &call);
  return st != EMBPS_OK ? st : embps_call_wait(call);
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
