/* Feature batches (docs/design.md, "Feature batches"): LookupFeatures and PushFeatures, one op
 * holding many features, pooled on each rank's column slice before the exchange.
 *
 * Every rank first all-gathers what it holds: each feature's id count and bag lengths (one block
 * of int64 per rank, the same size everywhere), then the ids (and the weights, when a feature
 * has them) in blocks padded to the largest rank's. From then on every rank knows every bag;
 * the counts and the bags' offsets are worked out on the host.
 *
 * A lookup, feature after feature: a pooled one pools every rank's bags on this rank's columns
 * straight from the table (pool_bags), and the all-to-all sends each rank its own bags' columns
 * (S bags x w per pair); a feature without pooling gathers the rows of every rank's ids and sends
 * each rank its own (padded to the largest rank's count).
 *
 * A push, table after table in the order the features first name them: the gradients of the
 * table's features move to the ranks that own their columns (a pooled feature's one per bag),
 * laid out rank after rank, feature after feature, id after id, with their ids beside them; then
 * the table's step is PushGradients' (embps__engine_push_dedup, embps__engine_push_apply): one
 * dedup, segment sum, gate and update per table. A pooled feature's positions are not written
 * out one gradient row per id where the backend has a fused sum (segment_sum_bags): each says
 * which bag's gradient it takes and how (bag_sources), and the sum expands it as it adds it;
 * elsewhere expand_bags writes the rows first.
 *
 * Everything runs through the backend's operations, on its memory and its stream, so both
 * backends serve feature batches. A hash-keyed table's keys come to the host for the index
 * (copy_out) and their slots go back (copy_in). An allocation that fails on one rank after the
 * first collective breaks the group (the others would wait in a collective), as elsewhere in a
 * round. */
#include <math.h>
#include <string.h>

#include "common/alloc.h"
#include "server/engine/engine_ops.h"

/* The scratch slots (the backend's memory). */
enum {
  FS_MINE,    /* this rank's counts and lengths, then ids, then weights, to all-gather */
  FS_META,    /* N blocks of F counts and F x S lengths */
  FS_IDS,     /* N blocks of M ids */
  FS_WEIGHTS, /* the same layout, f32 */
  FS_ROWS,    /* N x M rows (a dense table's ids, a hash-keyed one's slots) */
  FS_OFFSETS, /* N x F blocks of S + 1 bag offsets, each from its block's first id */
  FS_POOLED,  /* N x S pooled bags of a feature on this rank's columns */
  FS_SEND,
  FS_RECV,
  FS_OUT,      /* a lookup's rows before they go to the reply (a backend whose memory is not the
                  host's) */
  FS_GRADS_IN, /* a push's gradients from the request */
  FS_TOKENS,   /* a table's ids, laid out for its step */
  FS_GRADS,    /* their gradients on this rank's columns */
  FS_BAGS,     /* a fused push's pooled gradients of a table on this rank's columns */
  FS_SOURCES,  /* and where each of the table's positions takes its gradient from */
};

/* What every rank holds once the shards are gathered. */
typedef struct gathered {
  uint32_t N, me;
  size_t F, S;                  /* features, samples per rank */
  int64_t *meta;                /* host: N blocks of F counts then F x S lengths */
  int64_t *offs;                /* host: N x F blocks of S + 1 offsets */
  int64_t *hids;                /* host: the ids, when a feature's table is hash-keyed; else NULL */
  const int64_t *ids, *offsets; /* the backend's: N x M ids, N x F x (S + 1) offsets */
  const float *weights;         /* the backend's, N x M; NULL when no feature is weighted */
  size_t M;                     /* ids per rank's block (the largest rank's count) */
} gathered_t;

static size_t count(const gathered_t *g, uint32_t r, size_t f) {
  return (size_t)g->meta[r * (g->F + g->F * g->S) + f];
}

/* Where feature f's ids start in rank r's block. */
static size_t start(const gathered_t *g, uint32_t r, size_t f) {
  size_t at = 0;
  for (size_t k = 0; k < f; k++)
    at += count(g, r, k);
  return r * g->M + at;
}

/* The S + 1 offsets of rank r's bags of feature f (the backend's). */
static const int64_t *offsets_of(const gathered_t *g, uint32_t r, size_t f) {
  return g->offsets + ((size_t)r * g->F + f) * (g->S + 1);
}

/* The most ids of feature f on any rank. */
static size_t most_of(const gathered_t *g, size_t f) {
  size_t most = 0;
  for (uint32_t r = 0; r < g->N; r++)
    most = count(g, r, f) > most ? count(g, r, f) : most;
  return most;
}

static void gathered_free(gathered_t *g) {
  embps_free(g->meta);
  embps_free(g->offs);
  embps_free(g->hids);
}

#define TRY(call)                                                                                  \
  do {                                                                                             \
    if ((ret = (call)) != EMBPS_OK)                                                                \
      goto fail;                                                                                   \
  } while (0)

#define CHECK_ALLOC(p)                                                                             \
  do {                                                                                             \
    if (!(p)) {                                                                                    \
      ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a feature batch");   \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)

static embps_status_t scratch(embps_engine_t *e, unsigned slot, size_t bytes, void *p,
                              embps_error_t *err) {
  return e->ops->scratch(e->be, slot, bytes + 8, (void **)p, err);
}

/* All-gathers `bytes` of host memory from every rank into slot `into` (the backend's). */
static embps_status_t all_gather_host(embps_engine_t *e, const void *host, size_t bytes,
                                      unsigned into, void **out, embps_error_t *err) {
  void *mine;
  embps_status_t ret;
  if (e->comm->size == 1) { /* a group of one gathers its own: one copy, not two */
    TRY(scratch(e, into, bytes, out, err));
    return e->ops->copy_in(e->be, *out, host, bytes, err);
  }
  TRY(scratch(e, FS_MINE, bytes, &mine, err));
  TRY(scratch(e, into, e->comm->size * bytes, out, err));
  TRY(e->ops->copy_in(e->be, mine, host, bytes, err));
  TRY(embps_comm_all_gather(e->comm, mine, bytes, *out, err));
fail:
  return ret;
}

/* All-gathers the shards' counts, lengths, ids and weights into *g. */
static embps_status_t gather_shards(embps_engine_t *e, const embps_op_t *op, gathered_t *g,
                                    embps_error_t *err) {
  const size_t F = op->num_features, S = op->num_samples, per = F + F * S;
  int64_t *mine = NULL, *ids = NULL, *offs;
  float *w = NULL;
  void *dev;
  int weighted = 0, hashed = 0;
  size_t most = 0;
  embps_status_t ret = EMBPS_OK;

  memset(g, 0, sizeof(*g));
  g->N = e->comm->size;
  g->me = e->comm->rank;
  g->F = F;
  g->S = S;
  mine = embps_malloc(per * sizeof(int64_t));
  g->meta = embps_malloc(g->N * per * sizeof(int64_t));
  g->offs = embps_malloc(g->N * F * (S + 1) * sizeof(int64_t));
  CHECK_ALLOC(mine && g->meta && g->offs);
  for (size_t f = 0; f < F; f++) {
    mine[f] = (int64_t)op->features[f].num_ids;
    for (size_t b = 0; b < S; b++)
      mine[F + f * S + b] = op->features[f].lengths[b];
    weighted |= op->features[f].pooling == EMBPS_POOLING_WEIGHTED_SUM;
    hashed |= embps_table_hindex(op->features[f].table) != NULL;
  }
  TRY(all_gather_host(e, mine, per * sizeof(int64_t), FS_META, &dev, err));
  TRY(e->ops->copy_out(e->be, g->meta, dev, g->N * per * sizeof(int64_t), err));
  for (uint32_t r = 0; r < g->N; r++) {
    size_t c = 0;
    for (size_t f = 0; f < F; f++) {
      offs = g->offs + ((size_t)r * F + f) * (S + 1);
      offs[0] = 0;
      for (size_t b = 0; b < S; b++)
        offs[b + 1] = offs[b] + g->meta[r * per + F + f * S + b];
      c += count(g, r, f);
    }
    most = c > most ? c : most;
  }
  TRY(scratch(e, FS_OFFSETS, g->N * F * (S + 1) * sizeof(int64_t), &dev, err));
  TRY(e->ops->copy_in(e->be, dev, g->offs, g->N * F * (S + 1) * sizeof(int64_t), err));
  g->offsets = dev;
  /* Every rank sees the same counts, so the same M; and whether any feature is weighted or
   * hash-keyed is the request's, which every shard carries alike (the digest binds it). */
  g->M = most;
  ids = embps_calloc(g->M + 1, sizeof(int64_t));
  CHECK_ALLOC(ids);
  for (size_t f = 0, at = 0; f < F; at += op->features[f].num_ids, f++)
    if (op->features[f].num_ids)
      memcpy(ids + at, op->features[f].ids, op->features[f].num_ids * sizeof(int64_t));
  TRY(all_gather_host(e, ids, g->M * sizeof(int64_t), FS_IDS, &dev, err));
  g->ids = dev;
  if (hashed) {
    CHECK_ALLOC(g->hids = embps_malloc(g->N * g->M * sizeof(int64_t) + 1));
    TRY(e->ops->copy_out(e->be, g->hids, g->ids, g->N * g->M * sizeof(int64_t), err));
  }
  if (weighted) {
    CHECK_ALLOC(w = embps_calloc(g->M + 1, sizeof(float)));
    for (size_t f = 0, at = 0; f < F; at += op->features[f].num_ids, f++)
      if (op->features[f].weights && op->features[f].num_ids)
        memcpy(w + at, op->features[f].weights, op->features[f].num_ids * sizeof(float));
    TRY(all_gather_host(e, w, g->M * sizeof(float), FS_WEIGHTS, &dev, err));
    g->weights = dev;
  }
fail:
  embps_free(mine);
  embps_free(ids);
  embps_free(w);
  return ret;
}

/* The rows of every rank's ids of feature f at their places in FS_ROWS: a dense table's ids
 * themselves, a hash-keyed table's slots (from the index on the host). */
static embps_status_t rows_of(embps_engine_t *e, const gathered_t *g, const embps_table_t *t,
                              size_t f, const int64_t **rows, embps_error_t *err) {
  int64_t *host = NULL, *dev;
  embps_status_t ret = EMBPS_OK;
  if (!embps_table_hindex(t)) {
    *rows = g->ids;
    return EMBPS_OK;
  }
  TRY(scratch(e, FS_ROWS, g->N * g->M * sizeof(int64_t), &dev, err));
  CHECK_ALLOC(host = embps_malloc(g->N * g->M * sizeof(int64_t) + 1));
  for (uint32_t r = 0; r < g->N; r++)
    embps_hindex_find(embps_table_hindex(t), (const uint64_t *)g->hids + start(g, r, f),
                      count(g, r, f), host + start(g, r, f));
  for (uint32_t r = 0; r < g->N; r++)
    if (count(g, r, f))
      TRY(e->ops->copy_in(e->be, dev + start(g, r, f), host + start(g, r, f),
                          count(g, r, f) * sizeof(int64_t), err));
  *rows = dev;
fail:
  embps_free(host);
  return ret;
}

/* ---- lookup ---------------------------------------------------------------------------------- */

/* Where a feature's rows are assembled: the reply itself on a backend whose memory is the host's,
 * else FS_OUT, copied to the reply by lookup_done. */
static embps_status_t out_of(embps_engine_t *e, const embps_feature_t *ft, size_t bytes, void **out,
                             embps_error_t *err) {
  if (e->ops->host_memory) {
    *out = ft->rows_out;
    return EMBPS_OK;
  }
  return scratch(e, FS_OUT, bytes, out, err);
}

static embps_status_t lookup_done(embps_engine_t *e, const embps_feature_t *ft, const void *out,
                                  size_t bytes, embps_error_t *err) {
  return e->ops->host_memory ? EMBPS_OK : e->ops->copy_out(e->be, ft->rows_out, out, bytes, err);
}

/* A pooled feature: every bag of the batch on this rank's columns, then each rank its own. */
static embps_status_t lookup_pooled(embps_engine_t *e, const gathered_t *g,
                                    const embps_feature_t *ft, size_t f, embps_error_t *err) {
  embps_table_t *t = ft->table;
  const size_t w = embps_table_shard_width(t), W = embps_table_config(t)->emb_width;
  const size_t S = g->S, N = g->N, bytes = S * W * sizeof(float);
  const int weighted = ft->pooling == EMBPS_POOLING_WEIGHTED_SUM;
  const int64_t *rows;
  float *pooled, *recv;
  void *out;
  embps_status_t ret;

  TRY(rows_of(e, g, t, f, &rows, err));
  TRY(out_of(e, ft, bytes, &out, err));
  pooled = out; /* a group of one pools straight into its rows */
  if (N > 1)
    TRY(scratch(e, FS_POOLED, N * S * w * sizeof(float), &pooled, err));
  for (uint32_t r = 0; r < N; r++) {
    const size_t at = start(g, r, f);
    TRY(e->ops->pool_bags(e->be, t, g->ids + at, rows + at, weighted ? g->weights + at : NULL,
                          offsets_of(g, r, f), S, ft->pooling == EMBPS_POOLING_MEAN,
                          pooled + r * S * w, err));
  }
  if (N > 1) {
    TRY(scratch(e, FS_RECV, N * S * w * sizeof(float), &recv, err));
    TRY(embps_comm_all_to_all(e->comm, pooled, S * w * sizeof(float), recv, err));
    for (uint32_t r = 0; r < N && S > 0; r++) /* rank r's columns of this rank's bags */
      TRY(e->ops->copy2d(e->be, (float *)out + r * w, W * sizeof(float), recv + r * S * w,
                         w * sizeof(float), w * sizeof(float), S, err));
  }
  TRY(lookup_done(e, ft, out, bytes, err));
fail:
  return ret;
}

/* A feature without pooling: the rows of every rank's ids on this rank's columns, then each rank
 * its own ids' rows. */
static embps_status_t lookup_rows(embps_engine_t *e, const gathered_t *g, const embps_feature_t *ft,
                                  size_t f, embps_error_t *err) {
  embps_table_t *t = ft->table;
  const embps_table_config_t *c = embps_table_config(t);
  const size_t w = embps_table_shard_width(t), ds = embps_dtype_size(c->dtype), N = g->N;
  const size_t rb = w * ds, row_bytes = c->emb_width * ds, most = most_of(g, f);
  const size_t bytes = ft->num_ids * row_bytes;
  const int64_t *rows;
  uint8_t *send, *recv;
  void *out;
  embps_status_t ret;

  TRY(rows_of(e, g, t, f, &rows, err));
  TRY(out_of(e, ft, bytes, &out, err));
  TRY(scratch(e, FS_SEND, N * most * rb, &send, err));
  for (uint32_t r = 0; r < N; r++) {
    const size_t at = start(g, r, f);
    if (embps_table_hindex(t))
      TRY(e->ops->hash_gather(e->be, t, g->ids + at, rows + at, count(g, r, f),
                              send + r * most * rb, 0, err));
    else
      TRY(e->ops->gather(e->be, t, g->ids + at, count(g, r, f), send + r * most * rb, err));
  }
  recv = send;
  if (N > 1) {
    TRY(scratch(e, FS_RECV, N * most * rb, &recv, err));
    TRY(embps_comm_all_to_all(e->comm, send, most * rb, recv, err));
  }
  for (uint32_t r = 0; r < N && ft->num_ids > 0; r++) /* rank r's columns of this rank's ids */
    TRY(e->ops->copy2d(e->be, (uint8_t *)out + r * rb, row_bytes, recv + r * most * rb, rb, rb,
                       ft->num_ids, err));
  TRY(lookup_done(e, ft, out, bytes, err));
fail:
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

/* Where a table's gradients are laid out for its step: tokens and grads (rank r's at at[r]: its
 * place in the table's layout), and on a fused push the pooled features' bags (each feature's N
 * blocks of S bag gradients on this rank's columns, one feature after another: next_bag is the
 * next feature's first) with every position's source. */
typedef struct layout {
  int64_t *tokens;
  uint8_t *grads;
  float *bags;
  const float *sum_bags; /* what the sum reads: bags, or the one pooled feature's request bytes */
  embps_bag_source_t *sources; /* NULL: the bags are expanded into grads */
  size_t next_bag, *at;
} layout_t;

/* Feature f's gradients, moved to the ranks that own their columns, into this rank's layout l
 * (each rank's place in it advanced past the feature). */
static embps_status_t push_feature(embps_engine_t *e, const gathered_t *g,
                                   const embps_feature_t *ft, size_t f, layout_t *l,
                                   embps_error_t *err) {
  embps_table_t *t = ft->table;
  const embps_table_config_t *c = embps_table_config(t);
  const size_t w = embps_table_shard_width(t), W = c->emb_width, N = g->N, S = g->S;
  const size_t ds = embps_dtype_size(c->dtype);
  const int pooled = ft->pooling != EMBPS_POOLING_NONE;
  const int mean = ft->pooling == EMBPS_POOLING_MEAN;
  /* what one rank sends another: pooled, S bag gradients of w f32; else its ids' gradients */
  const size_t es = pooled ? sizeof(float) : ds, rows = pooled ? S : ft->num_ids;
  const size_t block = (pooled ? S : most_of(g, f)) * w * es;
  /* a group of one may sum this feature's bags where the request holds them (push_table) */
  const int in_place = pooled && l->sources && (const void *)l->sum_bags == ft->grads;
  /* else a fused push receives the bags where its sum reads them */
  uint8_t *bags = pooled && l->sources && !in_place ? (uint8_t *)(l->bags + l->next_bag * w) : NULL;
  const uint8_t *in;
  uint8_t *send = NULL, *recv = NULL;
  embps_status_t ret = EMBPS_OK;

  if (in_place) {
    goto positions;
  } else if (e->ops->host_memory) { /* read where the request holds them */
    in = ft->grads;
  } else {
    TRY(scratch(e, FS_GRADS_IN, rows * W * es, &send, err));
    TRY(e->ops->copy_in(e->be, send, ft->grads, rows * W * es, err));
    in = send;
  }
  if (bags && N == 1)
    send = bags;
  else
    TRY(scratch(e, FS_SEND, N * block, &send, err));
  for (uint32_t r = 0; r < N && rows > 0; r++) /* block r: rank r's columns of this rank's rows */
    TRY(e->ops->copy2d(e->be, send + r * block, w * es, in + r * w * es, W * es, w * es, rows,
                       err));
  recv = send;
  if (N > 1) {
    if (bags)
      recv = bags;
    else
      TRY(scratch(e, FS_RECV, N * block, &recv, err));
    TRY(embps_comm_all_to_all(e->comm, send, block, recv, err));
  }
positions:
  for (uint32_t r = 0; r < N; r++) {
    const size_t n = count(g, r, f), from = start(g, r, f), at = l->at[r];
    const float *weights = ft->pooling == EMBPS_POOLING_WEIGHTED_SUM ? g->weights + from : NULL;
    if (n == 0)
      continue;
    TRY(e->ops->copy2d(e->be, l->tokens + at, sizeof(int64_t), g->ids + from, sizeof(int64_t),
                       sizeof(int64_t), n, err));
    if (pooled && l->sources)
      TRY(e->ops->bag_sources(e->be, g->ids + from, weights, offsets_of(g, r, f), S, mean,
                              (uint32_t)(l->next_bag + r * S), n, l->sources + at, err));
    else if (pooled)
      TRY(e->ops->expand_bags(e->be, t, (const float *)(recv + r * block), g->ids + from, weights,
                              offsets_of(g, r, f), S, mean, l->grads + at * w * ds, err));
    else
      TRY(e->ops->copy2d(e->be, l->grads + at * w * ds, w * ds, recv + r * block, w * ds, w * ds, n,
                         err));
    if (!pooled && l->sources)
      TRY(e->ops->bag_sources(e->be, NULL, NULL, NULL, 0, 0, 0, n, l->sources + at, err));
    l->at[r] += n;
  }
  if (pooled && l->sources)
    l->next_bag += N * S;
fail:
  return ret;
}

/* Table t's step: the gradients of every feature of t, laid out rank, feature, id. Where the
 * backend can (segment_sum_bags), a pooled feature's positions are not expanded into rows of
 * their own: the sum reads each from its bag's gradient (kernels/segment_sum_stats.c). */
static embps_status_t push_table(embps_engine_t *e, embps_op_t *op, const gathered_t *g,
                                 embps_table_t *t, embps_table_step_t *step, embps_error_t *err) {
  const embps_table_config_t *c = embps_table_config(t);
  embps_table_counters_t *counters = embps_table_counters(t);
  const int fused = e->ops->bag_sources && e->ops->segment_sum_bags;
  embps__engine_shape_t sh;
  embps__engine_scratch_t s;
  embps__engine_step_t res;
  size_t T = 0, mine = 0, own = 0, bags = 0, npooled = 0;
  const embps_feature_t *pooled = NULL;
  layout_t l = {0};
  embps_status_t ret = EMBPS_OK;

  memset(&sh, 0, sizeof(sh));
  CHECK_ALLOC(l.at = embps_calloc(g->N, sizeof(size_t)));
  for (uint32_t r = 0; r < g->N; r++) {
    l.at[r] = T;
    for (size_t f = 0; f < g->F; f++)
      if (op->features[f].table == t)
        T += count(g, r, f);
  }
  for (size_t f = 0; f < g->F; f++) {
    if (op->features[f].table != t)
      continue;
    mine += op->features[f].num_ids;
    if (op->features[f].pooling != EMBPS_POOLING_NONE) {
      bags += g->N * g->S;
      pooled = &op->features[f];
      npooled++;
    } else
      for (uint32_t r = 0; r < g->N; r++)
        own += count(g, r, f);
  }
  sh.kind = EMBPS_OP_PUSH;
  sh.group_size = g->N;
  sh.T = T;
  sh.w = embps_table_shard_width(t);
  sh.W = c->emb_width;
  sh.ds = embps_dtype_size(c->dtype);
  sh.nb = embps_row_stats_block(sh.w) ? sh.w / embps_row_stats_block(sh.w) : 0;
  sh.hashed = embps_table_hindex(t) != NULL;
  TRY(scratch(e, FS_TOKENS, T * sizeof(int64_t), &l.tokens, err));
  /* the rows a fused push writes are the features' own without pooling (at their positions) */
  TRY(scratch(e, FS_GRADS, (fused && !own ? 0 : T) * sh.w * sh.ds, &l.grads, err));
  if (fused) {
    /* A group of one on host memory whose table has one pooled feature: the request's bags are
     * the layout's (bag k of the feature is bag k), so the sum reads them where they arrived
     * instead of a copy of them (26 MB a DLRM step of 2048 samples at 128 f32). They lie at any
     * byte of the request: the fused sum reads bags by memcpy loads alone (as the row
     * statistics read a request's rows), and only a backend with segment_sum_bags gets here. */
    if (g->N == 1 && npooled == 1 && e->ops->host_memory)
      l.sum_bags = pooled->grads;
    else
      TRY(scratch(e, FS_BAGS, bags * sh.w * sizeof(float), &l.bags, err));
    if (!l.sum_bags)
      l.sum_bags = l.bags;
    TRY(scratch(e, FS_SOURCES, T * sizeof(embps_bag_source_t), &l.sources, err));
  }
  for (size_t f = 0; f < g->F; f++)
    if (op->features[f].table == t)
      TRY(push_feature(e, g, &op->features[f], f, &l, err));
  TRY(embps__engine_reserve(e, &sh, op, &s, err));
  if (op->error.status != EMBPS_OK)
    goto fail;
  atomic_fetch_add_explicit(&counters->pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->rows_pushed, mine, memory_order_relaxed);
  TRY(embps__engine_push_dedup(e, &sh, t, &s, l.tokens, err));
  TRY(embps__engine_push_apply(e, &sh, t, &s, fused && !own ? NULL : l.grads, l.sum_bags, l.sources,
                               &res, err));
  step->table = t;
  step->applied = res.applied;
  step->skipped = res.skipped;
  step->grad_norm = res.grad_norm;
  step->num_unique = res.num_unique;
fail:
  embps_free(l.at);
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
  if (!e->ops->scratch || !e->ops->pool_bags || !e->ops->expand_bags)
    return embps_error_set(err, EMBPS_INTERNAL, "the %s backend serves no feature batches",
                           embps_backend_name(e->ops->backend));
  if ((ret = gather_shards(e, op, &g, err)) == EMBPS_OK)
    ret = op->kind == EMBPS_OP_LOOKUP ? run_lookup(e, op, &g, err) : run_push(e, op, &g, err);
  gathered_free(&g);
  if (ret == EMBPS_OK)
    ret = e->ops->finish(e->be, err);
  else
    e->ops->abort(e->be);
  if (op->kind == EMBPS_OP_PUSH && (ret != EMBPS_OK || op->error.status != EMBPS_OK))
    op->applied = 0;
  return ret;
}
