/* LookupFeatures and PushFeatures (docs/design.md, "Feature batches"): one shard of a batch of
 * samples carrying many features, each a jagged list of bags.
 *
 * Both requests are checked whole before anything is queued (check_features), so a bad feature
 * changes nothing on any rank; the op the group runs then holds one embps_feature_t per feature,
 * pointing into the unpacked request. A lookup's rows are written by the engine into one buffer
 * and packed into the reply when the op is done; a push is answered with one TableStep per table
 * it stepped (sync) or once it is ordered (async). */
#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "common/wire_fields.h"
#include "server/service/service_internal.h"

/** The most features one request may carry. */
#define MAX_FEATURES 4096

/* The fields the two requests share (their numbers are the same). */
typedef struct fview {
  uint64_t batch_id, client_id, digest;
  uint32_t shard_index, shard_count, batch_size, attempt;
  size_t n_features;
  Embps__V1__FeatureShard **features;
  const ProtobufCBinaryData *grads; /* each feature's gradients read in place; NULL: its own */
} fview_t;

/* What a request keeps beside the unpacked message: the op's features, a push's steps, a lookup's
 * reply (the whole LookupFeaturesResponse, each feature's rows in place behind its header: the
 * engine writes them there, and no packing copies them again; until the reply takes it). */
typedef struct fextra {
  embps_feature_t *features;
  embps_table_step_t *steps;
  uint8_t *reply;             /* the service's buffer pool's */
  ProtobufCBinaryData *grads; /* a push's gradients read in place (fview_t's) */
  size_t reply_len;
  size_t *rows_len;
} fextra_t;

static void fextra_free(void *p) {
  fextra_t *x = p;
  if (!x)
    return;
  embps_free(x->features);
  embps_free(x->steps);
  if (x->reply)
    embps__bufpool_put(x->reply);
  embps_free(x->rows_len);
  embps_free(x->grads);
  embps_free(x);
}

/* The reply's bytes of a feature's rows, and (push) of its gradients: pooled, one f32 row of
 * emb_width per sample; none, one row of the table's dtype per id. */
static size_t rows_bytes(const embps_feature_t *f, size_t samples) {
  const embps_table_config_t *c = embps_table_config(f->table);
  return f->pooling == EMBPS_POOLING_NONE ? f->num_ids * c->emb_width * embps_dtype_size(c->dtype)
                                          : samples * c->emb_width * sizeof(float);
}

static embps_status_t bad(embps_error_t *err, const Embps__V1__FeatureShard *f, const char *what) {
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "feature '%s': %s", f->name, what);
}

/* One feature's checks; fills *out. samples is this shard's. */
static embps_status_t check_feature(embps_service_t *svc, const Embps__V1__FeatureShard *f,
                                    const ProtobufCBinaryData *grads, size_t samples, int push,
                                    embps_feature_t *out, embps_error_t *err) {
  char msg[sizeof(((embps_error_t *)0)->message)];
  const embps_table_config_t *c;
  const uint32_t *lengths;
  const int64_t *ids;
  uint64_t sum = 0;
  size_t n;

  if (!(out->table = embps__svc_find_table(svc, f->table, err))) {
    snprintf(msg, sizeof(msg), "%s", err->message);
    return embps_error_set(err, EMBPS_NOT_FOUND, "feature '%s': %s", f->name, msg);
  }
  c = embps_table_config(out->table);
  if ((unsigned)f->pooling > EMBPS_POOLING_WEIGHTED_SUM) {
    snprintf(msg, sizeof(msg),
             "pooling %d is not one this server knows (none 0, sum 1, mean 2, weighted_sum 3)",
             (int)f->pooling);
    return bad(err, f, msg);
  }
  out->pooling = (embps_pooling_t)f->pooling;
  if (f->ids.len % sizeof(int64_t) != 0)
    return bad(err, f, "ids is not a whole number of int64 ids (8 bytes each, little-endian)");
  n = f->ids.len / sizeof(int64_t);
  if (f->lengths.len != samples * sizeof(uint32_t)) {
    snprintf(msg, sizeof(msg),
             "lengths holds %zu bytes, but this shard's %zu samples need one uint32 each (%zu "
             "bytes)",
             f->lengths.len, samples, samples * sizeof(uint32_t));
    return bad(err, f, msg);
  }
  lengths = (const uint32_t *)f->lengths.data;
  for (size_t b = 0; b < samples; b++)
    sum += lengths[b];
  if (sum != n) {
    snprintf(msg, sizeof(msg), "its lengths add up to %llu ids, but it carries %zu",
             (unsigned long long)sum, n);
    return bad(err, f, msg);
  }
  if (out->pooling == EMBPS_POOLING_WEIGHTED_SUM && f->weights.len != n * sizeof(float)) {
    snprintf(msg, sizeof(msg),
             "weights holds %zu bytes, but weighted_sum needs one f32 per id (%zu bytes)",
             f->weights.len, n * sizeof(float));
    return bad(err, f, msg);
  }
  if (out->pooling != EMBPS_POOLING_WEIGHTED_SUM && f->weights.len != 0)
    return bad(err, f, "weights are taken with pooling weighted_sum only");
  ids = (const int64_t *)f->ids.data;
  for (size_t i = 0; i < n && !embps_table_config_hashed(c); i++)
    if (ids[i] < 0 || (uint64_t)ids[i] >= c->rows) {
      snprintf(msg, sizeof(msg), "id %lld at position %zu is outside [0, %llu) of table '%s'",
               (long long)ids[i], i, (unsigned long long)c->rows, c->name);
      return bad(err, f, msg);
    }
  out->ids = ids;
  out->num_ids = n;
  out->lengths = lengths;
  out->weights = f->weights.len ? (const float *)f->weights.data : NULL;
  if (push && grads->len != rows_bytes(out, samples)) {
    snprintf(msg, sizeof(msg), "gradients hold %zu bytes, but %s need %zu", grads->len,
             out->pooling == EMBPS_POOLING_NONE ? "its ids' rows (emb_width of the table's dtype)"
                                                : "its samples' pooled rows (emb_width f32)",
             rows_bytes(out, samples));
    return bad(err, f, msg);
  }
  if (!push && grads->len != 0)
    return bad(err, f, "gradients are taken by PushFeatures only");
  out->grads = grads->data;
  return EMBPS_OK;
}

/* The whole request's checks: the group, the split by samples, every feature. Fills features
 * (room for v->n_features) and *samples (this shard's). */
static embps_status_t check_features(embps_service_t *svc, const fview_t *v, int push,
                                     embps_feature_t *features, size_t *samples,
                                     embps_error_t *err) {
  const uint32_t N = embps_group_size(svc->group), rank = embps_group_rank(svc->group);
  const uint32_t count = v->shard_count ? v->shard_count : 1;
  uint64_t B;
  embps_status_t ret;

  if ((ret = embps__svc_check_group(svc, err)) != EMBPS_OK)
    return ret;
  if (v->n_features == 0 || v->n_features > MAX_FEATURES)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "a feature batch carries %zu features: send 1 to %d", v->n_features,
                           MAX_FEATURES);
  if (count != N)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "shard_count=%u does not match the %u-rank group: split the batch "
                           "into one sample shard per rank",
                           count, N);
  if (v->shard_index != rank)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "shard_index=%u was sent to rank %u: send sample shard r of a batch "
                           "to rank r",
                           v->shard_index, rank);
  *samples = v->features[0]->lengths.len / sizeof(uint32_t);
  B = v->batch_size ? v->batch_size : (uint64_t)*samples * N;
  if (B % N != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "batch_size=%llu does not shard evenly over the %u-rank communicator: "
                           "pad the batch to %llu samples (a multiple of %u) with empty bags",
                           (unsigned long long)B, N, (unsigned long long)((B + N - 1) / N * N), N);
  *samples = (size_t)(B / N);
  for (size_t i = 0; i < v->n_features; i++) {
    const Embps__V1__FeatureShard *f = v->features[i];
    if (!f->name[0])
      return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                             "feature %zu has no name: name every feature", i);
    for (size_t k = 0; k < i; k++)
      if (strcmp(v->features[k]->name, f->name) == 0)
        return bad(err, f, "its name is used by two features: name each once");
    if ((ret = check_feature(svc, f, v->grads ? &v->grads[i] : &f->gradients, *samples, push,
                             &features[i], err)) != EMBPS_OK)
      return ret;
  }
  return EMBPS_OK;
}

/* A request for the checked batch: its op's features and name. NULL when out of memory. */
static embps__svc_request_t *make_request(embps_service_t *svc, embps_net_call_t *call,
                                          ProtobufCMessage *msg, embps__svc_done_cb done,
                                          const fview_t *v, embps_op_kind_t kind, fextra_t *x,
                                          size_t samples) {
  embps__svc_request_t *r = embps__svc_request_new(svc, call, msg, done);
  if (!r)
    return NULL;
  r->extra = x;
  r->extra_free = fextra_free;
  r->shard_index = v->shard_index;
  r->group_call.client_id = v->client_id;
  r->group_call.batch_id = v->batch_id;
  r->group_call.digest = v->digest;
  r->group_call.attempt = v->attempt;
  r->group_call.tokens_per_batch = (uint32_t)(samples * embps_group_size(svc->group));
  r->group_call.deadline_ns = embps_net_call_deadline_ns(call);
  r->group_call.op.kind = kind;
  r->group_call.op.table = x->features[0].table;
  r->group_call.op.features = x->features;
  r->group_call.op.num_features = v->n_features;
  r->group_call.op.num_samples = samples;
  r->group_call.op.steps = x->steps;
  return r;
}

static void push_done(embps__svc_request_t *r);
static void on_push_ordered(embps_group_call_t *gc);

static void on_call_cancel(void *arg) {
  embps__svc_request_t *r = arg;
  r->caller_gone = 1;
  embps_group_withdraw(r->svc->group, &r->group_call);
}

/* ---- LookupFeatures ---- */

/* The reply was laid out when the request came (submit_features) and the engine wrote the rows
 * into it: it goes as it is. Packing it with protobuf-c copied every row again, 10% of a server's
 * time on the DLRM feature set (perf, one server, 2048 samples, 128 f32). */
static void lookup_done(embps__svc_request_t *r) {
  fextra_t *x = r->extra;
  uint8_t *buf = x->reply;
  if (embps__svc_answer_failure(r))
    return;
  x->reply = NULL; /* the call owns it now */
  embps_net_call_reply(r->call, buf, x->reply_len, embps__bufpool_put, buf);
}

/* Feature f's header in the reply (at p, or counted with p NULL): pooled rows are f32. */
static size_t feature_header(uint8_t *p, const fview_t *v, const embps_feature_t *ft, size_t f,
                             size_t rows_len) {
  const embps_table_config_t *c = embps_table_config(ft->table);
  return embps__svc_put_feature_rows_header(
      p, v->features[f]->name, c->emb_width,
      ft->pooling == EMBPS_POOLING_NONE ? (int)c->dtype : (int)EMBPS__V1__DTYPE__DTYPE_F32,
      rows_len);
}

/* Checks, makes and submits a feature batch's request (lookup or push). A push whose gradients
 * are read in place (v->grads, which it takes) takes the request's bytes from *owned too. */
static void submit_features(embps_service_t *svc, embps_net_call_t *call, ProtobufCMessage *msg,
                            const fview_t *v, int push, int async, uint8_t **owned) {
  fextra_t *x = embps_calloc(1, sizeof(*x));
  embps__svc_request_t *r = NULL;
  size_t samples = 0, total = 0, at;
  embps_error_t err;

  if (x)
    x->grads = (ProtobufCBinaryData *)v->grads;
  else
    embps_free((void *)v->grads);
  if (!x || !(x->features = embps_calloc(v->n_features + 1, sizeof(*x->features))) ||
      !(x->steps = embps_calloc(v->n_features + 1, sizeof(*x->steps))) ||
      !(x->rows_len = embps_calloc(v->n_features + 1, sizeof(size_t)))) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  if (check_features(svc, v, push, x->features, &samples, &err) != EMBPS_OK)
    goto fail;
  if (!push) {
    x->reply_len = embps__svc_put_features_head(NULL, v->batch_id, v->shard_index);
    for (size_t f = 0; f < v->n_features; f++) {
      x->rows_len[f] = rows_bytes(&x->features[f], samples);
      total += x->rows_len[f];
      x->reply_len += feature_header(NULL, v, &x->features[f], f, x->rows_len[f]) + x->rows_len[f];
    }
    if (svc->cfg.max_reply_bytes && total > svc->cfg.max_reply_bytes) {
      embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED,
                      "the reply would hold %zu bytes of rows, more than --max-message-bytes=%llu: "
                      "split the batch into smaller ones, or raise --max-message-bytes",
                      total, (unsigned long long)svc->cfg.max_reply_bytes);
      goto fail;
    }
    if (embps_net_call_hold_reply(call, x->reply_len, &err) != EMBPS_OK)
      goto fail;
    if (!(x->reply = embps__bufpool_get(svc->buffers, x->reply_len + 1))) {
      embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte reply",
                      x->reply_len);
      goto fail;
    }
    at = embps__svc_put_features_head(x->reply, v->batch_id, v->shard_index);
    for (size_t f = 0; f < v->n_features; f++) {
      at += feature_header(x->reply + at, v, &x->features[f], f, x->rows_len[f]);
      x->features[f].rows_out = x->reply + at;
      at += x->rows_len[f];
    }
  }
  r = make_request(svc, call, msg, push ? push_done : lookup_done, v,
                   push ? EMBPS_OP_PUSH : EMBPS_OP_LOOKUP, x, samples);
  if (!r) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
    goto fail;
  }
  if (v->grads) { /* *owned holds msg: strip_nested found the features, so it is not empty */
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
  fextra_free(x);
  protobuf_c_message_free_unpacked(msg, &svc->pb);
}

void embps__svc_lookup_features(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                                size_t len, uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_LOOKUP_FEATURES_REQUEST_FEATURES,
                                       EMBPS_WIRE_FEATURE_SHARD_TABLE};
  Embps__V1__LookupFeaturesRequest *req =
      embps__v1__lookup_features_request__unpack(&svc->pb, len, msg);
  embps_error_t err;
  fview_t v;
  (void)owned;
  if (!req) {
    embps__svc_fail_unpack(svc, call, "LookupFeaturesRequest");
    return;
  }
  if (embps__svc_check_names(msg, len, name_path, 2, &err) != EMBPS_OK) {
    embps__svc_fail(call, &err);
    embps__v1__lookup_features_request__free_unpacked(req, &svc->pb);
    return;
  }
  v = (fview_t){
      req->batch_id,   req->client_id, req->digest,     req->shard_index, req->shard_count,
      req->batch_size, req->attempt,   req->n_features, req->features,    NULL};
  submit_features(svc, call, &req->base, &v, 0, 0, NULL);
}

/* ---- PushFeatures ---- */

static void on_push_ordered(embps_group_call_t *gc) {
  embps__svc_request_t *r = gc->user;
  Embps__V1__PushFeaturesResponse resp = EMBPS__V1__PUSH_FEATURES_RESPONSE__INIT;
  if (!r->call)
    return;
  resp.batch_id = gc->batch_id;
  resp.shard_index = r->shard_index;
  resp.ordered = 1;
  embps__svc_reply(r->call, &resp.base);
  r->call = NULL;
}

static void push_done(embps__svc_request_t *r) {
  const embps_op_t *op = &r->group_call.op;
  Embps__V1__PushFeaturesResponse resp = EMBPS__V1__PUSH_FEATURES_RESPONSE__INIT;
  Embps__V1__TableStep *steps = NULL, **ptrs = NULL;
  embps_error_t err;
  /* a replay answers from the retry window, which keeps no steps */
  const size_t n = r->group_call.replayed ? 0 : op->num_steps;
  if (embps__svc_answer_failure(r))
    return;
  steps = embps_calloc(n + 1, sizeof(*steps));
  ptrs = embps_calloc(n + 1, sizeof(*ptrs));
  if (!steps || !ptrs) {
    embps_error_set(&err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for the reply");
    embps__svc_fail(r->call, &err);
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    embps__v1__table_step__init(&steps[i]);
    steps[i].table = (char *)embps_table_config(op->steps[i].table)->name;
    steps[i].applied = op->steps[i].applied != 0;
    steps[i].skipped = op->steps[i].skipped != 0;
    steps[i].grad_norm = op->steps[i].grad_norm;
    steps[i].num_unique = op->steps[i].num_unique;
    ptrs[i] = &steps[i];
  }
  resp.batch_id = r->group_call.batch_id;
  resp.shard_index = r->shard_index;
  resp.n_steps = n;
  resp.steps = ptrs;
  resp.replayed = r->group_call.replayed != 0;
  embps__svc_reply(r->call, &resp.base);
exit:
  embps_free(steps);
  embps_free(ptrs);
}

void embps__svc_push_features(embps_service_t *svc, embps_net_call_t *call, const uint8_t *msg,
                              size_t len, uint8_t **owned) {
  static const uint32_t name_path[] = {EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
                                       EMBPS_WIRE_FEATURE_SHARD_TABLE};
  Embps__V1__PushFeaturesRequest *req;
  ProtobufCBinaryData *grads = NULL;
  size_t n_grads = 0, rest_len = 0;
  uint8_t *rest = NULL;
  embps_error_t err;
  fview_t v;
  int async;

  /* On a backend that computes on host memory, the gradients (nearly all of the request) are
   * read where they arrived, not copied out by the unpack: the message is unpacked without them
   * and each feature's points into msg, which the request then keeps. The unpack's copy and
   * its fresh pages were 8% of a server's time pushing the DLRM feature set (perf, one server,
   * 2048 samples, 128 f32). */
  if (owned && *owned && embps_group_host_device(svc->group) < 0)
    rest = embps__svc_strip_nested_bytes(msg, len, EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
                                         EMBPS_WIRE_FEATURE_SHARD_GRADIENTS, &grads, &n_grads,
                                         &rest_len);
  req =
      embps__v1__push_features_request__unpack(&svc->pb, rest ? rest_len : len, rest ? rest : msg);
  embps_free(rest);
  if (req && rest && req->n_features != n_grads) { /* cannot be: one element per occurrence */
    embps__v1__push_features_request__free_unpacked(req, &svc->pb);
    req = NULL;
  }
  if (!req) {
    embps_free(grads);
    embps__svc_fail_unpack(svc, call, "PushFeaturesRequest");
    return;
  }
  async = req->mode == EMBPS__V1__UPDATE_MODE__UPDATE_MODE_ASYNC;
  if (embps__svc_check_names(msg, len, name_path, 2, &err) != EMBPS_OK ||
      (req->mode != EMBPS__V1__UPDATE_MODE__UPDATE_MODE_SYNC && !async &&
       embps_error_set(&err, EMBPS_INVALID_ARGUMENT, "update mode %d is neither sync nor async",
                       (int)req->mode) != EMBPS_OK)) {
    embps__svc_fail(call, &err);
    embps__v1__push_features_request__free_unpacked(req, &svc->pb);
    embps_free(grads);
    return;
  }
  v = (fview_t){
      req->batch_id,   req->client_id, req->digest,     req->shard_index, req->shard_count,
      req->batch_size, req->attempt,   req->n_features, req->features,    grads};
  submit_features(svc, call, &req->base, &v, 1, async, owned);
}
