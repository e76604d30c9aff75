/* Feature batches (docs/design.md, "Feature batches"): LookupFeatures and PushFeatures, one op
 * holding many features, pooled on each rank's column slice before the exchange.
 *
 * Every rank first all-gathers what it holds: each feature's id count and bag lengths (one block
 * of int64 per rank, the same size everywhere), then the ids (and the weights, when a feature
 * has them) in blocks padded to the largest rank's. From then on every rank knows every bag.
 *
 * A lookup, feature after feature: a pooled one pools every bag of the batch on this rank's
 * columns, straight from the table (embps_pool_bags_cpu), and the all-to-all sends each rank its
 * own bags' columns (S bags x w per pair); a feature without pooling gathers the rows of every
 * rank's ids and sends each rank its own (padded to the largest rank's count).
 *
 * A push, table after table in the order the features first name them: the gradients of the
 * table's features move to the ranks that own their columns (a pooled feature's one per bag,
 * expanded to the bag's ids there by embps_expand_bags_cpu), and are laid out rank after rank,
 * feature after feature, id after id, with their ids beside them; then the table's step is
 * PushGradients' (embps__engine_push_dedup, embps__engine_push_apply): one dedup, segment sum,
 * gate and update per table.
 *
 * This path computes on host memory: the cpu backend serves feature batches, and the cuda
 * backend answers them with UNIMPLEMENTED (the service refuses them before they are ordered).
 * Its scratch is allocated per op. */
#include <math.h>
#include <string.h>

#include "common/alloc.h"
#include "server/engine/engine_ops.h"

/* What every rank holds once the shards are gathered (host memory). */
typedef struct gathered {
  uint32_t N, me;
  size_t F, S;       /* features, samples per rank */
  int64_t *meta;     /* N blocks of F counts then F x S lengths */
  int64_t *ids;      /* N blocks of M ids: each rank's features one after the other */
  float *weights;    /* the same layout; NULL when no feature is weighted */
  size_t M;          /* ids per rank's block (the largest rank's count) */
  uint32_t *lengths; /* N x F x S: lengths[(r * F + f) * S + b] */
} gathered_t;

static size_t count(const gathered_t *g, uint32_t r, size_t f) {
  return (size_t)g->meta[r * (g->F + g->F * g->S) + f];
}

/* Where feature f's ids start in rank r's block. */
static size_t start(const gathered_t *g, uint32_t r, size_t f) {
  size_t at = 0;
  for (size_t k = 0; k < f; k++)
    at += count(g, r, k);
  return at;
}

static const uint32_t *bag_lengths(const gathered_t *g, uint32_t r, size_t f) {
  return g->lengths + ((size_t)r * g->F + f) * g->S;
}

/* The S + 1 offsets of rank r's bags of feature f, from 0. */
static void bag_offsets(const gathered_t *g, uint32_t r, size_t f, int64_t *offsets) {
  const uint32_t *len = bag_lengths(g, r, f);
  offsets[0] = 0;
  for (size_t b = 0; b < g->S; b++)
    offsets[b + 1] = offsets[b] + len[b];
}

static void gathered_free(gathered_t *g) {
  embps_free(g->meta);
  embps_free(g->ids);
  embps_free(g->weights);
  embps_free(g->lengths);
}

#define CHECK_ALLOC(p)                                                                             \
  do {                                                                                             \
    if (!(p)) {                                                                                    \
      ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a feature batch");   \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)

#define TRY(call)                                                                                  \
  do {                                                                                             \
    if ((ret = (call)) != EMBPS_OK)                                                                \
      goto fail;                                                                                   \
  } while (0)

/* All-gathers the shards' counts, lengths, ids and weights into *g. An allocation that fails
 * fails the op on this rank only after the collectives, which every rank must make alike: a
 * failure here breaks the group (RESOURCE_EXHAUSTED returned). */
static embps_status_t gather_shards(embps_engine_t *e, const embps_op_t *op, gathered_t *g,
                                    embps_error_t *err) {
  const size_t F = op->num_features, S = op->num_samples, per = F + F * S;
  int64_t *mine = NULL, *ids = NULL;
  float *w = NULL;
  int weighted = 0;
  uint64_t most = 0;
  embps_status_t ret = EMBPS_OK;

  memset(g, 0, sizeof(*g));
  g->N = e->comm->size;
  g->me = e->comm->rank;
  g->F = F;
  g->S = S;
  mine = embps_malloc(per * sizeof(int64_t));
  g->meta = embps_malloc(g->N * per * sizeof(int64_t));
  g->lengths = embps_malloc(g->N * F * S * sizeof(uint32_t) + 1);
  CHECK_ALLOC(mine && g->meta && g->lengths);
  for (size_t f = 0; f < F; f++) {
    mine[f] = (int64_t)op->features[f].num_ids;
    for (size_t b = 0; b < S; b++)
      mine[F + f * S + b] = op->features[f].lengths[b];
    /* by the pooling, the same on every rank: a shard without ids carries no weights */
    weighted |= op->features[f].pooling == EMBPS_POOLING_WEIGHTED_SUM;
  }
  TRY(embps_comm_all_gather(e->comm, mine, per * sizeof(int64_t), g->meta, err));
  for (uint32_t r = 0; r < g->N; r++) {
    uint64_t c = 0;
    for (size_t f = 0; f < F; f++) {
      c += count(g, r, f);
      for (size_t b = 0; b < S; b++)
        g->lengths[((size_t)r * F + f) * S + b] = (uint32_t)g->meta[r * per + F + f * S + b];
    }
    most = c > most ? c : most;
  }
  /* Every rank sees the same counts, so the same M, and whether any rank's feature is weighted
   * follows from the request, which every shard carries alike (the digest binds it). */
  g->M = (size_t)most;
  ids = embps_calloc(g->M + 1, sizeof(int64_t));
  g->ids = embps_malloc(g->N * g->M * sizeof(int64_t) + 1);
  CHECK_ALLOC(ids && g->ids);
  for (size_t f = 0, at = 0; f < F; at += op->features[f].num_ids, f++)
    if (op->features[f].num_ids)
      memcpy(ids + at, op->features[f].ids, op->features[f].num_ids * sizeof(int64_t));
  TRY(embps_comm_all_gather(e->comm, ids, g->M * sizeof(int64_t), g->ids, err));
  if (weighted) {
    w = embps_calloc(g->M + 1, sizeof(float));
    g->weights = embps_malloc(g->N * g->M * sizeof(float) + 1);
    CHECK_ALLOC(w && g->weights);
    for (size_t f = 0, at = 0; f < F; at += op->features[f].num_ids, f++)
      if (op->features[f].weights && op->features[f].num_ids)
        memcpy(w + at, op->features[f].weights, op->features[f].num_ids * sizeof(float));
    TRY(embps_comm_all_gather(e->comm, w, g->M * sizeof(float), g->weights, err));
  }
fail:
  embps_free(mine);
  embps_free(ids);
  embps_free(w);
  return ret;
}

/* The rows (slots for a hash-keyed table, the ids themselves for a dense one) of n ids. */
static void rows_of(const embps_table_t *t, const int64_t *ids, size_t n, int64_t *rows) {
  if (embps_table_hindex(t))
    embps_hindex_find(embps_table_hindex(t), (const uint64_t *)ids, n, rows);
  else
    memcpy(rows, ids, n * sizeof(int64_t));
}

/* ---- lookup ---------------------------------------------------------------------------------- */

/* A pooled feature: every bag of the batch on this rank's columns, then each rank's own. */
static embps_status_t lookup_pooled(embps_engine_t *e, const gathered_t *g,
                                    const embps_feature_t *ft, size_t f, embps_error_t *err) {
  const embps_table_t *t = ft->table;
  const embps_table_config_t *c = embps_table_config(t);
  const size_t w = embps_table_shard_width(t), W = c->emb_width, S = g->S, N = g->N;
  float *pooled = NULL, *recv = NULL, *tmp = NULL;
  int64_t *rows = NULL, *offsets = NULL;
  embps_status_t ret = EMBPS_OK;

  pooled = embps_malloc(N * S * w * sizeof(float) + 1);
  rows = embps_malloc(g->M * sizeof(int64_t) + 1);
  tmp = embps_malloc(2 * w * sizeof(float) + 1);
  offsets = embps_malloc((S + 1) * sizeof(int64_t));
  CHECK_ALLOC(pooled && rows && tmp && offsets);
  for (uint32_t r = 0; r < N; r++) {
    const int64_t *ids = g->ids + r * g->M + start(g, r, f);
    rows_of(t, ids, count(g, r, f), rows);
    bag_offsets(g, r, f, offsets);
    embps_pool_bags_cpu(
        embps_table_arrays(t).data, c->dtype, w, ids, rows,
        ft->pooling == EMBPS_POOLING_WEIGHTED_SUM ? g->weights + r * g->M + start(g, r, f) : NULL,
        offsets, S, ft->pooling == EMBPS_POOLING_MEAN, pooled + r * S * w, tmp,
        embps_table_col_begin(t), c->seed, c->init_scale);
  }
  if (N == 1) {
    memcpy(ft->rows_out, pooled, S * w * sizeof(float));
  } else {
    recv = embps_malloc(N * S * w * sizeof(float));
    CHECK_ALLOC(recv);
    TRY(embps_comm_all_to_all(e->comm, pooled, S * w * sizeof(float), recv, err));
    for (uint32_t r = 0; r < N; r++) /* rank r's columns of this rank's bags */
      for (size_t b = 0; b < S; b++)
        memcpy((float *)ft->rows_out + b * W + r * w, recv + (r * S + b) * w, w * sizeof(float));
  }
fail:
  embps_free(pooled);
  embps_free(recv);
  embps_free(rows);
  embps_free(tmp);
  embps_free(offsets);
  return ret;
}

/* A feature without pooling: the rows of every rank's ids on this rank's columns, then each rank
 * its own ids' rows. */
static embps_status_t lookup_rows(embps_engine_t *e, const gathered_t *g, const embps_feature_t *ft,
                                  size_t f, embps_error_t *err) {
  embps_table_t *t = ft->table;
  const embps_table_config_t *c = embps_table_config(t);
  const size_t w = embps_table_shard_width(t), ds = embps_dtype_size(c->dtype), N = g->N;
  const size_t rb = w * ds, row_bytes = c->emb_width * ds;
  size_t most = 0;
  uint8_t *send = NULL, *recv = NULL;
  int64_t *rows = NULL;
  embps_status_t ret = EMBPS_OK;

  for (uint32_t r = 0; r < N; r++)
    most = count(g, r, f) > most ? count(g, r, f) : most;
  send = embps_calloc(N * most * rb + 1, 1);
  recv = embps_malloc(N * most * rb + 1);
  rows = embps_malloc(most * sizeof(int64_t) + 1);
  CHECK_ALLOC(send && recv && rows);
  for (uint32_t r = 0; r < N; r++) {
    const int64_t *ids = g->ids + r * g->M + start(g, r, f);
    rows_of(t, ids, count(g, r, f), rows);
    if (embps_table_hindex(t))
      TRY(e->ops->hash_gather(e->be, t, ids, rows, count(g, r, f), send + r * most * rb, err));
    else
      embps_gather_cpu(embps_table_arrays(t).data, c->dtype, w, ids, count(g, r, f),
                       send + r * most * rb);
  }
  if (N > 1)
    TRY(embps_comm_all_to_all(e->comm, send, most * rb, recv, err));
  for (uint32_t r = 0; r < N; r++) /* rank r's columns of this rank's ids */
    for (size_t i = 0; i < ft->num_ids; i++)
      memcpy((uint8_t *)ft->rows_out + i * row_bytes + r * rb,
             (N > 1 ? recv : send) + (r * most + i) * rb, rb);
fail:
  embps_free(send);
  embps_free(recv);
  embps_free(rows);
  return ret;
}

static embps_status_t run_lookup(embps_engine_t *e, embps_op_t *op, const gathered_t *g,
                                 embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  for (size_t f = 0; f < op->num_features; f++) {
    const embps_feature_t *ft = &op->features[f];
    embps_table_counters_t *counters = embps_table_counters(ft->table);
    atomic_fetch_add_explicit(&counters->lookups, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&counters->rows_looked_up, ft->num_ids, memory_order_relaxed);
    if (ft->pooling == EMBPS_POOLING_NONE)
      TRY(lookup_rows(e, g, ft, f, err));
    else
      TRY(lookup_pooled(e, g, ft, f, err));
  }
fail:
  return ret;
}

/* ---- push ------------------------------------------------------------------------------------ */

/* Feature f's gradients, moved to the ranks that own their columns, into this rank's tokens and
 * grads (rank r's at at[r]: its place in the table's layout, advanced past it). */
static embps_status_t push_feature(embps_engine_t *e, const gathered_t *g,
                                   const embps_feature_t *ft, size_t f, int64_t *tokens,
                                   uint8_t *grads, size_t *at, embps_error_t *err) {
  const embps_table_config_t *c = embps_table_config(ft->table);
  const size_t w = embps_table_shard_width(ft->table), W = c->emb_width, N = g->N, S = g->S;
  const size_t ds = embps_dtype_size(c->dtype);
  const int pooled = ft->pooling != EMBPS_POOLING_NONE;
  /* what one rank sends another: pooled, S bag gradients of w f32; else its ids' gradients */
  size_t most = 0, rb = pooled ? w * sizeof(float) : w * ds, src_row, block;
  uint8_t *send = NULL, *recv = NULL;
  int64_t *offsets = NULL;
  embps_status_t ret = EMBPS_OK;

  for (uint32_t r = 0; r < N; r++)
    most = count(g, r, f) > most ? count(g, r, f) : most;
  block = (pooled ? S : most) * rb;
  offsets = embps_malloc((S + 1) * sizeof(int64_t));
  CHECK_ALLOC(offsets);
  src_row = pooled ? W * sizeof(float) : W * ds;
  send = embps_calloc(N * block + 1, 1);
  recv = embps_malloc(N * block + 1);
  CHECK_ALLOC(send && recv);
  for (uint32_t r = 0; r < N; r++) /* block r: rank r's columns of this rank's rows */
    for (size_t i = 0; i < (pooled ? S : ft->num_ids); i++)
      memcpy(send + r * block + i * rb, (const uint8_t *)ft->grads + i * src_row + r * rb, rb);
  if (N > 1)
    TRY(embps_comm_all_to_all(e->comm, send, block, recv, err));
  for (uint32_t r = 0; r < N; r++) {
    const size_t n = count(g, r, f);
    const int64_t *ids = g->ids + r * g->M + start(g, r, f);
    const uint8_t *from = (N > 1 ? recv : send) + r * block;
    memcpy(tokens + at[r], ids, n * sizeof(int64_t));
    bag_offsets(g, r, f, offsets);
    if (pooled)
      embps_expand_bags_cpu(
          (const float *)from, w, ids,
          ft->pooling == EMBPS_POOLING_WEIGHTED_SUM ? g->weights + r * g->M + start(g, r, f) : NULL,
          offsets, S, ft->pooling == EMBPS_POOLING_MEAN, c->dtype, grads + at[r] * w * ds);
    else
      memcpy(grads + at[r] * w * ds, from, n * w * ds);
    at[r] += n;
  }
fail:
  embps_free(send);
  embps_free(recv);
  embps_free(offsets);
  return ret;
}

/* Table t's step: the gradients of every feature of t, laid out rank, feature, id. */
static embps_status_t push_table(embps_engine_t *e, embps_op_t *op, const gathered_t *g,
                                 embps_table_t *t, embps_table_step_t *step, embps_error_t *err) {
  const embps_table_config_t *c = embps_table_config(t);
  embps_table_counters_t *counters = embps_table_counters(t);
  embps__engine_shape_t sh;
  embps__engine_scratch_t s;
  embps__engine_step_t res;
  size_t T = 0, mine = 0, *at = NULL;
  int64_t *tokens = NULL;
  uint8_t *grads = NULL;
  embps_status_t ret = EMBPS_OK;

  memset(&sh, 0, sizeof(sh));
  at = embps_calloc(g->N, sizeof(size_t));
  CHECK_ALLOC(at);
  for (uint32_t r = 0; r < g->N; r++) {
    at[r] = T;
    for (size_t f = 0; f < g->F; f++)
      if (op->features[f].table == t)
        T += count(g, r, f);
  }
  for (size_t f = 0; f < g->F; f++)
    if (op->features[f].table == t)
      mine += op->features[f].num_ids;
  sh.kind = EMBPS_OP_PUSH;
  sh.group_size = g->N;
  sh.T = T;
  sh.w = embps_table_shard_width(t);
  sh.W = c->emb_width;
  sh.ds = embps_dtype_size(c->dtype);
  sh.nb = embps_row_stats_block(sh.w) ? sh.w / embps_row_stats_block(sh.w) : 0;
  sh.hashed = embps_table_hindex(t) != NULL;
  tokens = embps_malloc(T * sizeof(int64_t) + 1);
  grads = embps_malloc(T * sh.w * sh.ds + 1);
  CHECK_ALLOC(tokens && grads);
  for (size_t f = 0; f < g->F; f++)
    if (op->features[f].table == t)
      TRY(push_feature(e, g, &op->features[f], f, tokens, grads, at, err));
  TRY(embps__engine_reserve(e, &sh, op, &s, err));
  if (op->error.status != EMBPS_OK)
    goto fail;
  atomic_fetch_add_explicit(&counters->pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->rows_pushed, mine, memory_order_relaxed);
  TRY(embps__engine_push_dedup(e, &sh, t, &s, tokens, err));
  TRY(embps__engine_push_apply(e, &sh, t, &s, grads, &res, err));
  step->table = t;
  step->applied = res.applied;
  step->skipped = res.skipped;
  step->grad_norm = res.grad_norm;
  step->num_unique = res.num_unique;
fail:
  embps_free(at);
  embps_free(tokens);
  embps_free(grads);
  return ret;
}

static embps_status_t run_push(embps_engine_t *e, embps_op_t *op, const gathered_t *g,
                               embps_error_t *err) {
  double sumsq = 0.0;
  embps_status_t ret = EMBPS_OK;
  op->num_steps = 0;
  op->applied = 1;
  for (size_t f = 0; f < op->num_features && op->error.status == EMBPS_OK; f++) {
    embps_table_t *t = op->features[f].table;
    int seen = 0;
    for (size_t k = 0; k < f && !seen; k++)
      seen = op->features[k].table == t;
    if (seen)
      continue;
    embps_table_step_t *step = &op->steps[op->num_steps++];
    TRY(push_table(e, op, g, t, step, err));
    /* the op's own figures, which the retry window keeps: all applied, any skipped */
    op->applied &= step->applied;
    op->skipped |= step->skipped;
    op->num_unique += step->num_unique;
    sumsq += step->grad_norm * step->grad_norm;
  }
  op->grad_norm = sqrt(sumsq);
fail:
  return ret;
}

embps_status_t embps__engine_run_features(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  gathered_t g;
  embps_status_t ret;
  if (e->ops->backend != EMBPS_BACKEND_CPU) { /* the service refuses them first */
    embps_error_set(&op->error, EMBPS_UNIMPLEMENTED,
                    "feature batches are served by the cpu backend in this build");
    return EMBPS_OK;
  }
  if ((ret = gather_shards(e, op, &g, err)) == EMBPS_OK)
    ret = op->kind == EMBPS_OP_LOOKUP ? run_lookup(e, op, &g, err) : run_push(e, op, &g, err);
  gathered_free(&g);
  if (ret == EMBPS_OK && op->kind == EMBPS_OP_PUSH && op->error.status == EMBPS_OK)
    ret = e->ops->finish(e->be, err);
  if (ret == EMBPS_OK && op->kind == EMBPS_OP_PUSH && op->error.status != EMBPS_OK)
    op->applied = 0;
  return ret;
}
