/* Feature batches (docs/design.md, "Feature batches"): a batch of B samples of many features,
 * each a jagged list of bags, sent as one LookupFeatures or PushFeatures per rank.
 *
 * Splitting is by samples: rank r of N gets samples [r S, (r+1) S), S = B/N, of every feature,
 * so its ids are the contiguous run of the caller's ids that those samples' bags hold (a prefix
 * sum of the lengths, computed once per call, says where each run starts). When the client pads,
 * B is rounded up to a multiple of N with empty bags at the end: they add no ids, their lengths
 * are zeros and a pooled push's gradient rows for them are zeros (copies of the caller's lengths
 * and gradients, made only then), and their pooled rows are dropped from the reply.
 *
 * Unlike a Lookup, whose token and gradient segments are sent straight from the caller's arrays
 * (batch.c), a feature shard holds many bulk fields (ids, lengths, weights, gradients per
 * feature), so each rank's request is laid out by feat_wire.c: its small fields written to a
 * buffer of its own, its bulk fields sent as segments from the caller's arrays (no copy of the
 * batch), and laid out again for a retry (only the attempt number changes). Replies are
 * gathered and unpacked by protobuf-c, and each feature's rows copied to the caller's buffer at
 * its shard's offset: a pooled reply is small (B rows of emb_width per feature, however long
 * the bags).
 *
 * Identity and retries are a lookup's: the digest of the whole batch (common/digest.h,
 * embps_features_digest), the client id, the batch id and the attempt number, and call.c's
 * attempts under retry.h's rules. */
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "common/clock.h"
#include "common/digest.h"
#include "common/dtype.h"
#include "common/shape.h"
#include "embps/v1/embps.pb-c.h"

struct embps__feat_req {
  int is_push;
  int mode;
  const embps_feature_t *f; /* the caller's n features, borrowed */
  size_t n;
  uint32_t batch_size; /* the caller's B */
  uint32_t padded;     /* B padded to a multiple of the group size */
  uint32_t shard_samples;
  uint32_t group_size;
  uint64_t *row_bytes; /* per feature: bytes of one row of out (lookup) or grads (push) */
  uint64_t *id_at;     /* per feature, group_size + 1 entries: where shard r's ids start */
  uint32_t **lengths;  /* per feature: padded copies of the lengths (NULL: the caller's) */
  uint8_t **grads;     /* per pooled feature of a push: padded copies (NULL: the caller's) */
  const char **tables; /* the distinct tables, in the order of first use */
  size_t ntables;
  uint64_t digest;
  Embps__V1__FeatureShard *shards; /* n, refilled for each rank */
  Embps__V1__FeatureShard **shard_ptrs;
  embps__feat_wire_t *wire; /* per rank: the request's bytes (feat_wire.c) */
  embps_feature_step_t *steps;
  size_t *num_steps;
};

void embps__feat_req_free(embps__feat_req_t *r) {
  if (!r)
    return;
  for (size_t k = 0; k < r->n; k++) {
    if (r->lengths)
      embps_free(r->lengths[k]);
    if (r->grads)
      embps_free(r->grads[k]);
  }
  for (uint32_t i = 0; r->wire && i < r->group_size; i++)
    embps__feat_wire_free(&r->wire[i]);
  embps_free(r->row_bytes);
  embps_free(r->id_at);
  embps_free(r->lengths);
  embps_free(r->grads);
  embps_free((void *)r->tables);
  embps_free(r->shards);
  embps_free(r->shard_ptrs);
  embps_free(r->wire);
  embps_free(r);
}

static int pooled(const embps_feature_t *f) { return f->pooling != EMBPS_POOLING_NONE; }

/* ---- checks, before anything is sent ---- */

static embps_status_t bad(embps_client_t *c, const char *what, const embps_feature_t *f,
                          const char *msg) {
  return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: feature '%s': %s", what, f->name, msg);
}

/* One feature's own checks; *row_bytes receives the bytes of one row of its buffer (0 when it
 * has no rows: a feature of pooling none without ids). */
static embps_status_t check_feature(embps_client_t *c, const char *what, int is_push,
                                    const embps_feature_t *f, size_t B, uint64_t *row_bytes) {
  char msg[400];
  uint64_t sum = 0, rows;
  size_t bytes = is_push ? f->grad_bytes : f->out_bytes;
  const void *buf = is_push ? f->grads : f->out;
  const char *buf_name = is_push ? "grad_bytes" : "out_bytes";

  if (!f->table || !f->table[0])
    return bad(c, what, f, "it names no table");
  if ((unsigned)f->pooling > EMBPS_POOLING_WEIGHTED_SUM) {
    snprintf(msg, sizeof(msg),
             "pooling %d is not one of none (0), sum (1), mean (2) and weighted_sum (3)",
             (int)f->pooling);
    return bad(c, what, f, msg);
  }
  if (!f->lengths)
    return bad(c, what, f, "lengths is NULL: give one bag length per sample");
  if (f->num_ids > 0 && !f->ids)
    return bad(c, what, f, "ids is NULL but num_ids is not 0");
  for (size_t b = 0; b < B; b++)
    sum += f->lengths[b];
  if (sum != f->num_ids) {
    snprintf(msg, sizeof(msg),
             "its %zu lengths add up to %llu ids, but num_ids is %zu: give one length per sample, "
             "the ids of its bag",
             B, (unsigned long long)sum, f->num_ids);
    return bad(c, what, f, msg);
  }
  if (f->pooling == EMBPS_POOLING_WEIGHTED_SUM && f->num_ids > 0 && !f->weights)
    return bad(c, what, f, "pooling weighted_sum needs weights, one f32 per id");
  if (f->pooling != EMBPS_POOLING_WEIGHTED_SUM && f->weights)
    return bad(c, what, f, "weights are taken with pooling weighted_sum only: set weights to NULL");
  rows = pooled(f) ? B : f->num_ids;
  if (rows == 0 ? bytes != 0 : (bytes == 0 || bytes % rows != 0 || !buf)) {
    snprintf(msg, sizeof(msg), "%s=%zu%s does not hold %llu whole rows (%s: %s x emb_width x %s)",
             buf_name, bytes, bytes && !buf ? " with a NULL buffer" : "", (unsigned long long)rows,
             pooled(f) ? "pooled" : "pooling none", pooled(f) ? "batch_size" : "num_ids",
             pooled(f) ? "4 (f32)" : "the table's dtype size");
    return bad(c, what, f, msg);
  }
  *row_bytes = rows ? bytes / rows : 0;
  if (pooled(f) && *row_bytes % sizeof(float) != 0) {
    snprintf(msg, sizeof(msg), "%s=%zu gives rows of %llu bytes, not a whole number of f32 values",
             buf_name, bytes, (unsigned long long)*row_bytes);
    return bad(c, what, f, msg);
  }
  return EMBPS_OK;
}

/* The whole batch's checks and plan: the sample split, every feature, the distinct tables, the
 * ids' offsets per shard, padded copies and the digest. Fills r (zeroed, n and f set). */
static embps_status_t plan(embps_client_t *c, const char *what, embps__feat_req_t *r) {
  const uint32_t N = c->group_size ? c->group_size : 1;
  embps_digest_feature_t *df = NULL;
  embps_error_t err;
  embps_status_t st = EMBPS_OK;
  size_t B = r->batch_size;

  if (r->n == 0)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                              "%s: the batch has no features: give at least one", what);
  if (r->n > UINT32_MAX || !r->f)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: features is NULL or too many", what);
  if (B == 0)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                              "%s: batch_size is 0: a feature batch needs at least one sample",
                              what);
  r->padded = (uint32_t)embps_shape_padded_tokens(B, N);
  embps_error_clear(&err);
  if (!c->pad && embps_shape_check_batch_size(B, N, &err) != EMBPS_OK)
    return embps__client_fail(c, err.status, "%s: %s (or set pad_batches)", what, err.message);
  r->group_size = N;
  r->shard_samples = r->padded / N;
  for (size_t k = 0; k < r->n; k++) {
    const embps_feature_t *f = &r->f[k];
    if (!f->name || !f->name[0])
      return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                                "%s: feature %zu has no name: name every feature", what, k);
    for (size_t j = 0; j < k; j++)
      if (strcmp(r->f[j].name, f->name) == 0)
        return bad(c, what, f, "its name is used by two features: name each once");
  }
  if (!(r->row_bytes = embps_calloc(r->n, sizeof(*r->row_bytes))) ||
      !(r->id_at = embps_calloc(r->n * (N + 1), sizeof(*r->id_at))) ||
      !(r->lengths = embps_calloc(r->n, sizeof(*r->lengths))) ||
      !(r->grads = embps_calloc(r->n, sizeof(*r->grads))) ||
      !(r->tables = embps_calloc(r->n, sizeof(*r->tables))) ||
      !(r->shards = embps_calloc(r->n, sizeof(*r->shards))) ||
      !(r->shard_ptrs = embps_calloc(r->n, sizeof(*r->shard_ptrs))) ||
      !(r->wire = embps_calloc(N, sizeof(*r->wire))) || !(df = embps_calloc(r->n, sizeof(*df))))
    goto oom;
  for (size_t k = 0; k < r->n; k++) {
    const embps_feature_t *f = &r->f[k];
    uint64_t *at = r->id_at + k * (N + 1);
    size_t t;
    if ((st = check_feature(c, what, r->is_push, f, B, &r->row_bytes[k])) != EMBPS_OK)
      goto exit;
    /* shard s's ids start after the bags of samples [0, s S) */
    for (uint32_t s = 0, b = 0; s <= N; s++) {
      uint64_t end = (uint64_t)s * r->shard_samples < B ? (uint64_t)s * r->shard_samples : B;
      at[s] = s ? at[s - 1] : 0;
      for (; b < end; b++)
        at[s] += f->lengths[b];
    }
    if (r->padded != B) {
      if (!(r->lengths[k] = embps_calloc(r->padded, sizeof(uint32_t))))
        goto oom;
      memcpy(r->lengths[k], f->lengths, B * sizeof(uint32_t));
      if (r->is_push && pooled(f)) {
        if (!(r->grads[k] = embps_calloc(r->padded, r->row_bytes[k])))
          goto oom;
        memcpy(r->grads[k], f->grads, f->grad_bytes);
      }
    }
    for (t = 0; t < r->ntables && strcmp(r->tables[t], f->table) != 0; t++)
      ;
    if (t == r->ntables)
      r->tables[r->ntables++] = f->table;
    df[k] = (embps_digest_feature_t){
        f->name, f->table, (uint32_t)f->pooling, f->ids, f->num_ids, f->lengths, B, f->weights};
  }
  r->digest = embps_features_digest(r->padded, df, (uint32_t)r->n);
exit:
  embps_free(df);
  return st;
oom:
  st = embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "%s: out of memory", what);
  goto exit;
}

/* ---- requests ---- */

/* Fills r->shards with rank's shard of every feature (pointers into the caller's arrays or the
 * padded copies). */
static void fill_shards(embps__feat_req_t *r, uint32_t rank) {
  const uint64_t S = r->shard_samples, first = rank * S;
  for (size_t k = 0; k < r->n; k++) {
    const embps_feature_t *f = &r->f[k];
    const uint64_t *at = r->id_at + k * (r->group_size + 1);
    const uint64_t nids = at[rank + 1] - at[rank];
    Embps__V1__FeatureShard *fs = &r->shards[k];
    const uint32_t *lengths = r->lengths[k] ? r->lengths[k] : f->lengths;
    embps__v1__feature_shard__init(fs);
    fs->name = (char *)f->name;
    fs->table = (char *)f->table;
    fs->pooling = (Embps__V1__Pooling)f->pooling;
    fs->ids.len = nids * sizeof(int64_t);
    fs->ids.data = nids ? (uint8_t *)(f->ids + at[rank]) : NULL;
    fs->lengths.len = S * sizeof(uint32_t);
    fs->lengths.data = (uint8_t *)(lengths + first);
    if (f->pooling == EMBPS_POOLING_WEIGHTED_SUM && nids) {
      fs->weights.len = nids * sizeof(float);
      fs->weights.data = (uint8_t *)(f->weights + at[rank]);
    }
    if (r->is_push) {
      const uint8_t *g = r->grads[k] ? r->grads[k] : f->grads;
      uint64_t row0 = pooled(f) ? first : at[rank], rows = pooled(f) ? S : nids;
      fs->gradients.len = rows * r->row_bytes[k];
      fs->gradients.data = rows ? (uint8_t *)(g + row0 * r->row_bytes[k]) : NULL;
    }
    r->shard_ptrs[k] = fs;
  }
}

/* Lays out rank's request for call->attempt in r->wire[rank] (feat_wire.c: the small fields
 * written, the bulk ones sent from the caller's arrays or the padded copies). */
static embps_status_t pack(embps_call_t *call, uint32_t rank) {
  embps_client_t *c = call->client;
  embps__feat_req_t *r = call->feat;
  Embps__V1__LookupFeaturesRequest lr = EMBPS__V1__LOOKUP_FEATURES_REQUEST__INIT;
  Embps__V1__PushFeaturesRequest pr = EMBPS__V1__PUSH_FEATURES_REQUEST__INIT;
  ProtobufCMessage *m = r->is_push ? &pr.base : &lr.base;
  embps_status_t st;
  uint64_t size;

  fill_shards(r, rank);
  if (r->is_push) {
    pr.batch_id = call->batch_id;
    pr.shard_index = rank;
    pr.shard_count = r->group_size;
    pr.batch_size = r->padded;
    pr.n_features = r->n;
    pr.features = r->shard_ptrs;
    pr.client_id = c->client_id;
    pr.digest = r->digest;
    pr.attempt = call->attempt;
    pr.mode = (Embps__V1__UpdateMode)r->mode;
  } else {
    lr.batch_id = call->batch_id;
    lr.shard_index = rank;
    lr.shard_count = r->group_size;
    lr.batch_size = r->padded;
    lr.n_features = r->n;
    lr.features = r->shard_ptrs;
    lr.client_id = c->client_id;
    lr.digest = r->digest;
    lr.attempt = call->attempt;
  }
  st = embps__feat_encode(m, r->is_push ? &pr.n_features : &lr.n_features, r->shard_ptrs,
                          &r->wire[rank], &size);
  if (st == EMBPS_INVALID_ARGUMENT)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                              "%s: rank %u's shard of the batch is %llu bytes, over gRPC's 4 GiB "
                              "message: split the batch",
                              r->is_push ? "push_features" : "lookup_features", rank,
                              (unsigned long long)size - 5);
  if (st != EMBPS_OK)
    return embps__client_fail(c, st, "out of memory");
  return EMBPS_OK;
}

/* Sends every rank's shard for call->attempt; on failure the shards sent are withdrawn. */
static embps_status_t feat_send(embps_call_t *call) {
  embps_client_t *c = call->client;
  const char *path =
      call->feat->is_push ? EMBPS__PATH_PREFIX "PushFeatures" : EMBPS__PATH_PREFIX "LookupFeatures";
  for (uint32_t r = 0; r < c->group_size; r++) {
    embps__shard_t *sh = &call->shards[r];
    const embps__feat_wire_t *w = &call->feat->wire[r];
    if (pack(call, r) != EMBPS_OK)
      return embps__call_attempt_failed(call, &c->last);
    if (embps__shard_submit(call, sh, path, w->segs, w->nsegs) != EMBPS_OK)
      return embps__call_attempt_failed(call, &c->last);
  }
  embps__call_kick(call);
  return EMBPS_OK;
}

/* ---- replies ---- */

/* Copies rank's LookupFeaturesResponse rows (read in place: feat_wire.c) into the features'
 * buffers: the reply's only copy. */
static embps_status_t lookup_join_rank(embps_call_t *call, uint32_t rank,
                                       const embps__feat_rows_t *frs, size_t n_features) {
  embps_client_t *c = call->client;
  embps__feat_req_t *r = call->feat;
  const uint64_t S = r->shard_samples, first = rank * S;
  if (n_features != r->n)
    return embps__client_fail(c, EMBPS_INTERNAL,
                              "lookup_features reply from rank %u has %zu features, the request "
                              "had %zu",
                              rank, n_features, r->n);
  for (size_t k = 0; k < r->n; k++) {
    const embps_feature_t *f = &r->f[k];
    const embps__feat_rows_t *fr = &frs[k];
    const uint64_t *at = r->id_at + k * (r->group_size + 1);
    int dtype = pooled(f) ? EMBPS_DTYPE_F32 : (int)fr->dtype;
    uint64_t rb = (uint64_t)fr->emb_width * embps_dtype_size(dtype);
    uint64_t rows = pooled(f) ? S : at[rank + 1] - at[rank];
    uint64_t real = pooled(f) ? (first >= r->batch_size      ? 0
                                 : r->batch_size - first < S ? r->batch_size - first
                                                             : S)
                              : rows;
    uint64_t to = pooled(f) ? first : at[rank];
    if (fr->name_len != strlen(f->name) || memcmp(fr->name, f->name, fr->name_len) != 0)
      return embps__client_fail(c, EMBPS_INTERNAL,
                                "lookup_features reply from rank %u names feature '%.*s' where "
                                "the request had '%s'",
                                rank, (int)(fr->name_len < 200 ? fr->name_len : 200), fr->name,
                                f->name);
    if (r->row_bytes[k] && rb != r->row_bytes[k])
      return embps__client_fail(
          c, EMBPS_INVALID_ARGUMENT,
          "lookup_features: feature '%s': out_bytes=%zu gives rows of %llu bytes, but table "
          "'%s' answers rows of emb_width %u x %s (%llu bytes): size out as %s x emb_width x %s",
          f->name, f->out_bytes, (unsigned long long)r->row_bytes[k], f->table, fr->emb_width,
          embps_dtype_name(dtype), (unsigned long long)rb, pooled(f) ? "batch_size" : "num_ids",
          pooled(f) ? "4 (pooled rows are f32)" : "the dtype size");
    if (fr->rows_len != rows * rb)
      return embps__client_fail(c, EMBPS_INTERNAL,
                                "lookup_features reply from rank %u carries %llu bytes of feature "
                                "'%s', %llu rows of %llu bytes were due",
                                rank, (unsigned long long)fr->rows_len, f->name,
                                (unsigned long long)rows, (unsigned long long)rb);
    if (real)
      memcpy((uint8_t *)f->out + to * rb, fr->rows, real * rb);
  }
  return EMBPS_OK;
}

static embps_status_t lookup_join(embps_call_t *call) {
  embps_client_t *c = call->client;
  embps__feat_rows_t *frs = embps_calloc(call->feat->n, sizeof(*frs));
  embps_status_t st = EMBPS_OK;
  if (!frs)
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  for (uint32_t i = 0; i < call->nshards && st == EMBPS_OK; i++) {
    const embps__stream_t *s = call->shards[i].stream;
    uint64_t batch_id;
    uint32_t shard_index;
    size_t n;
    if (!embps__feat_lookup_reply(s->buf, s->buf_len, &batch_id, &shard_index, frs, call->feat->n,
                                  &n)) {
      st = embps__client_fail(c, EMBPS_INTERNAL,
                              "malformed LookupFeaturesResponse from rank %u (%s)", i,
                              embps__conn_addr(s->conn)->authority);
      break;
    }
    st = embps__reply_check(call, "lookup_features", i, batch_id, shard_index);
    if (st == EMBPS_OK)
      st = lookup_join_rank(call, i, frs, n);
  }
  embps_free(frs);
  return st;
}

/* Joins the ranks' PushFeaturesResponses into one result per table (applied and ordered on every
 * rank, skipped or replayed on any; grad_norm and num_unique rank 0's, which every rank agrees
 * on). */
static embps_status_t push_join(embps_call_t *call) {
  embps_client_t *c = call->client;
  embps__feat_req_t *r = call->feat;
  embps_push_result_t *res = embps_calloc(r->ntables, sizeof(*res));
  int replayed = 0, ordered = 1;
  embps_status_t st = EMBPS_OK;

  if (!res)
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t t = 0; t < r->ntables; t++)
    res[t].applied = 1;
  for (uint32_t i = 0; i < call->nshards && st == EMBPS_OK; i++) {
    Embps__V1__PushFeaturesResponse *m = (Embps__V1__PushFeaturesResponse *)embps__reply_unpack(
        c, &embps__v1__push_features_response__descriptor, call->shards[i].stream, i);
    if (!m) {
      st = c->last.status;
      break;
    }
    replayed |= m->replayed != 0;
    ordered &= m->ordered != 0;
    st = embps__reply_check(call, "push_features", i, m->batch_id, m->shard_index);
    if (st == EMBPS_OK && r->mode == EMBPS_PUSH_SYNC && !m->replayed && m->n_steps != r->ntables)
      st = embps__client_fail(c, EMBPS_INTERNAL,
                              "push_features reply from rank %u has %zu table steps, the batch "
                              "names %zu tables",
                              i, m->n_steps, r->ntables);
    for (size_t t = 0; st == EMBPS_OK && t < m->n_steps && t < r->ntables; t++) {
      const Embps__V1__TableStep *s = m->steps[t];
      if (strcmp(s->table, r->tables[t]) != 0) {
        st = embps__client_fail(c, EMBPS_INTERNAL,
                                "push_features reply from rank %u names table '%s' in step %zu, "
                                "where the batch first names '%s'",
                                i, s->table, t, r->tables[t]);
        break;
      }
      res[t].applied &= s->applied != 0;
      res[t].skipped |= s->skipped != 0;
      if (i == 0) {
        res[t].grad_norm = s->grad_norm;
        res[t].num_unique = s->num_unique;
      }
    }
    embps__reply_free(&m->base);
  }
  if (st == EMBPS_OK) {
    for (size_t t = 0; t < r->ntables; t++) {
      if (replayed || r->mode == EMBPS_PUSH_ASYNC)
        memset(&res[t], 0, sizeof(res[t]));
      res[t].replayed = replayed;
      res[t].ordered = r->mode == EMBPS_PUSH_ASYNC && ordered && !replayed;
      if (r->steps) {
        r->steps[t].table = r->tables[t];
        r->steps[t].result = res[t];
      }
    }
    if (r->num_steps)
      *r->num_steps = r->ntables;
  }
  embps_free(res);
  return st;
}

/* ---- starting a call ---- */

static embps_status_t feat_start(embps_client_t *c, int is_push, const embps_feature_t *features,
                                 size_t n, size_t batch_size, int mode, embps_feature_step_t *steps,
                                 size_t *num_steps, embps_call_t **out_call) {
  const char *what = is_push ? "push_features" : "lookup_features";
  embps__feat_req_t *r;
  embps_call_t *call;
  embps__verdict_t v = {0, 0, 0};
  embps_status_t st;

  if (batch_size > UINT32_MAX)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT,
                              "%s: batch_size=%zu is over 4294967295: split the batch", what,
                              batch_size);
  if (is_push && mode != EMBPS_PUSH_SYNC && mode != EMBPS_PUSH_ASYNC)
    return embps__client_fail(c, EMBPS_INVALID_ARGUMENT, "%s: mode %d is neither sync nor async",
                              what, mode);
  if (!(r = embps_calloc(1, sizeof(*r))))
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  r->is_push = is_push;
  r->mode = mode;
  r->f = features;
  r->n = n;
  r->batch_size = (uint32_t)batch_size;
  r->steps = steps;
  r->num_steps = num_steps;
  if ((st = plan(c, what, r)) != EMBPS_OK) {
    embps__feat_req_free(r);
    return st;
  }
  if (!(call = embps__call_new(c, c->group_size))) {
    embps__feat_req_free(r);
    return embps__client_fail(c, EMBPS_RESOURCE_EXHAUSTED, "out of memory");
  }
  call->feat = r; /* the call owns it from here */
  call->batch_id = c->next_batch_id++;
  call->join = is_push ? push_join : lookup_join;
  call->send = feat_send;
  call->max_attempts = c->max_attempts;
  call->attempt_timeout_ms = c->attempt_timeout_ms;
  embps__attempt_bounds((int64_t)embps_now_ms(), call->deadline, call->attempt_timeout_ms,
                        &call->attempt_deadline, &call->attempt_timeout);
  st = feat_send(call);
  embps__verdict_add(&v, st);
  if (st != EMBPS_OK && (call->max_attempts < 2 || !embps__verdict_retryable(&v))) {
    embps__call_free(call); /* the failure stays the client's last error */
    return st;
  }
  *out_call = call;
  return EMBPS_OK;
}

embps_status_t embps_lookup_features_start(embps_client_t *client, const embps_feature_t *features,
                                           size_t n, size_t batch_size, embps_call_t **call) {
  return feat_start(client, 0, features, n, batch_size, 0, NULL, NULL, call);
}

embps_status_t embps_push_features_start(embps_client_t *client, const embps_feature_t *features,
                                         size_t n, size_t batch_size, embps_push_mode_t mode,
                                         embps_feature_step_t *steps, size_t *num_steps,
                                         embps_call_t **call) {
  return feat_start(client, 1, features, n, batch_size, (int)mode, steps, num_steps, call);
}

embps_status_t embps_lookup_features(embps_client_t *client, const embps_feature_t *features,
                                     size_t n, size_t batch_size) {
  embps_call_t *call;
  embps_status_t st = embps_lookup_features_start(client, features, n, batch_size, &call);
  return st != EMBPS_OK ? st : embps_call_wait(call);
}

embps_status_t embps_push_features(embps_client_t *client, const embps_feature_t *features,
                                   size_t n, size_t batch_size, embps_push_mode_t mode,
                                   embps_feature_step_t *steps, size_t *num_steps) {
  embps_call_t *call;
  embps_status_t st =
      embps_push_features_start(client, features, n, batch_size, mode, steps, num_steps, &call);
  return st != EMBPS_OK ? st : embps_call_wait(call);
}
