/* The engine's CPU backend (engine_ops.h): the operations of a round as calls of the kernels/ C
 * references on host memory, for groups that run on CPUs and move data over TCP.
 *
 * Everything runs at once on the calling thread (the group's), so input_wait, output, finish and
 * abort have nothing to wait for. The request's arrays are used in place (a group of one reads
 * the gradients straight from the request) and a lookup assembles its rows straight in the
 * reply, publishing them chunk by chunk so the reply leaves while the rest is gathered, so a
 * batch costs no copy beyond the column slices the exchange needs.
 *
 * Scratch arrays only grow, since batch sizes repeat from step to step; an array whose growth
 * failed is released with capacity zero, so the next call tries again from scratch. */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/cpus.h"
#include "server/engine/engine_ops.h"
#include "server/engine/round_cost.h"
#include "server/engine/workers.h"

/* A lookup's rows are published to the reply in chunks, so the loop writes chunk k while chunk
 * k+1 is gathered; a chunk costs one atomic store and at most one uv_async_send. A chunk and the
 * table rows it is gathered from take a third of the gathering core's L2 (a sixth each), so that
 * chunk k is still in that cache when the loop's copy into the socket reads it. With 1 MiB chunks
 * on a core with 2 MiB of L2, each chunk's gather pushed the previous chunk out, and the replies
 * of 1-8 MiB took up to twice as long. Measured on a 2-core VM (Xeon, 2 MiB L2 per core; uniform
 * tokens over 1M x 128 f32, one call in flight), the two builds A/B with a fresh server per 3 s
 * run of embps bench, 6 rounds, medians of p50 (rows/s) with 341 KiB chunks against 1 MiB: 2048
 * tokens 0.48 against 0.60 ms (4.03M against 3.06M), 4096 0.79 against 0.87 ms (4.66M against
 * 4.14M), 8192 1.11 against 1.97 ms (6.00M against 4.13M); 65536 16.7 against 16.5 ms (even: the
 * reply no longer fits any cache). With two calls in flight on one connection at 4096 tokens it
 * was the other way round, 4.36-4.66M against 4.96-5.09M rows/s (two runs of 6 rounds): there
 * the calls already overlap each other, so probably the more frequent wake-ups of the loop are
 * not paid back. One server with the chunk size switched between runs also had 16384 tokens at
 * 2.14 against 3.89 ms, 256 KiB within a few percent of 341 KiB, 683 KiB 5-15% slower than it,
 * and 768 KiB at 4096 tokens as slow as 1 MiB. An earlier machine (1 MiB chunks against 256 KiB and
 * 4 MiB, tests/bench/lookup_ab.sh, 2026-12-03) had shown no difference at 65536 tokens or two in
 * flight. Where the L2 size is not known, 256 KiB. */
#define CHUNK_MIN_BYTES ((size_t)64 << 10)
#define CHUNK_MAX_BYTES ((size_t)1 << 20)
#define CHUNK_UNKNOWN_L2_BYTES ((size_t)256 << 10)

/* The fewest rows (segments, for the segment sum) a share of a per-row kernel gets: below it,
 * waking a helper (tens of microseconds on a VM) costs more than the share's cache misses. At
 * 50-110 ns per row for the rowwise Adagrad update, 512 rows are 25-55 us. */
#define MIN_SHARE_ROWS 512

typedef struct buf {
  void *p;
  size_t cap;
} buf_t;

struct embps__engine_backend {
  embps_comm_t *comm;
  buf_t all_tokens, unique, segment_ids, dedup_ws, row_sumsq, summed, partials, gathered, sums;
  buf_t segment_counts; /* embps_segment_sum_stats_cpu's workspace */
  buf_t order, starts; /* the last dedup's positions by segment (a feature push's sum walks them) */
  buf_t send, recv, rows;
  buf_t keys;                                 /* a hash-keyed push's keys in hash order */
  buf_t feature[EMBPS__ENGINE_FEATURE_SLOTS]; /* a feature batch's scratch */
  size_t num_unique;                          /* the last dedup's */
  size_t chunk_bytes;                         /* a lookup reply's chunk, from the L2 size */
  embps_workers_t *workers;                   /* NULL: every kernel on the engine's thread */
  embps_hash_seen_t *seen;                    /* a lookup's absent keys' rows (hash_gather) */
};

embps_status_t embps__engine_cpu_new(embps__engine_backend_t **out, embps_comm_t *comm) {
  embps__engine_backend_t *be = embps_calloc(1, sizeof(*be));
  if (!be)
    return EMBPS_RESOURCE_EXHAUSTED;
  be->comm = comm;
  be->chunk_bytes = embps__engine_cpu_chunk_bytes(embps_l2_cache_bytes());
  *out = be;
  return EMBPS_OK;
}

size_t embps__engine_cpu_chunk_bytes(size_t l2_bytes) {
  size_t c = l2_bytes ? l2_bytes / 6 : CHUNK_UNKNOWN_L2_BYTES;
  return c < CHUNK_MIN_BYTES ? CHUNK_MIN_BYTES : c > CHUNK_MAX_BYTES ? CHUNK_MAX_BYTES : c;
}

static void cpu_destroy(embps__engine_backend_t *be) {
  buf_t *bufs[] = {&be->all_tokens, &be->unique, &be->segment_ids, &be->dedup_ws,
                   &be->row_sumsq,  &be->summed, &be->partials,    &be->gathered,
                   &be->send,       &be->recv,   &be->rows,        &be->segment_counts,
                   &be->keys,       &be->sums,   &be->order,       &be->starts};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    embps_free(bufs[i]->p);
  for (size_t i = 0; i < EMBPS__ENGINE_FEATURE_SLOTS; i++)
    embps_free(be->feature[i].p);
  embps_workers_free(be->workers);
  embps_free(be->seen);
  embps_free(be);
}

static unsigned cpu_set_threads(embps__engine_backend_t *be, unsigned threads) {
  unsigned got = 1;
  embps_workers_free(be->workers);
  be->workers = threads > 1 ? embps_workers_new(threads, &got) : NULL;
  return be->workers ? got : 1;
}

/* Makes b hold at least `bytes`; returns 0 when out of memory, 2 when it allocated anew. */
static int grow(buf_t *b, size_t bytes) {
  if (bytes <= b->cap && b->p)
    return 1;
  embps_free(b->p);
  b->p = embps_aligned_alloc(bytes ? bytes : 64);
  b->cap = b->p ? bytes : 0;
  return b->p != NULL ? 2 : 0;
}

static embps_status_t cpu_reserve(embps__engine_backend_t *be, const embps__engine_shape_t *sh,
                                  embps__engine_scratch_t *s, embps_error_t *err) {
  /* The sizes are round_cost.c's, which `embps plan` reads too (round_cost.h). */
  const embps_round_shape_t rs = {.kind = sh->kind,
                                  .group_size = sh->group_size,
                                  .T = sh->T,
                                  .w = sh->w,
                                  .W = sh->W,
                                  .ds = sh->ds,
                                  .hashed = sh->hashed};
  const int push = sh->kind == EMBPS_OP_PUSH;
  const size_t T = sh->T;
  size_t b[EMBPS_ROUND_SCRATCH_COUNT];
  buf_t *arrays[EMBPS_ROUND_SCRATCH_COUNT] = {
      [EMBPS_ROUND_UNIQUE] = &be->unique,     [EMBPS_ROUND_SEGMENT_IDS] = &be->segment_ids,
      [EMBPS_ROUND_DEDUP_WS] = &be->dedup_ws, [EMBPS_ROUND_ALL_TOKENS] = &be->all_tokens,
      [EMBPS_ROUND_SEND] = &be->send,         [EMBPS_ROUND_RECV] = &be->recv,
      [EMBPS_ROUND_ROWS] = &be->rows,         [EMBPS_ROUND_KEYS] = &be->keys,
      [EMBPS_ROUND_SUMMED] = &be->summed,     [EMBPS_ROUND_ROW_SUMSQ] = &be->row_sumsq,
      [EMBPS_ROUND_PARTIALS] = &be->partials, [EMBPS_ROUND_SEGMENT_COUNTS] = &be->segment_counts,
      [EMBPS_ROUND_GATHERED] = &be->gathered, [EMBPS_ROUND_SUMS] = &be->sums,
      [EMBPS_ROUND_ORDER] = &be->order,       [EMBPS_ROUND_STARTS] = &be->starts};
  int ok = 1;

  memset(s, 0, sizeof(*s));
  embps_round_scratch_bytes(&rs, b);
  for (int i = 0; i < EMBPS_ROUND_SCRATCH_COUNT && ok; i++) {
    ok = b[i] == 0 ? 1 : grow(arrays[i], b[i]);
    /* A combine by owner sends the partials past the last row and the sums of rows no rank
     * owns, which nobody reads: zeroed once, they carry no stale heap bytes to the peers. */
    if (ok == 2 && (i == EMBPS_ROUND_PARTIALS || i == EMBPS_ROUND_SUMS))
      memset(arrays[i]->p, 0, arrays[i]->cap);
  }
  if (!ok)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for the scratch of a %zu-token %s", T,
                           push ? "push" : "lookup");
  s->all_tokens = be->all_tokens.p;
  s->rows = be->rows.p;
  s->send = be->send.p;
  s->recv = be->recv.p;
  s->summed = be->summed.p;
  s->partials = be->partials.p;
  s->gathered = be->gathered.p;
  s->sums = be->sums.p;
  s->row_sumsq = be->row_sumsq.p;
  s->keys = be->keys.p;
  return EMBPS_OK;
}

/* ---- tables ---------------------------------------------------------------------------------- */

static embps_status_t cpu_table_new(embps__engine_backend_t *be, const embps_table_config_t *cfg,
                                    uint32_t rank, uint32_t group_size, int blank,
                                    embps_table_t **out) {
  (void)be;
  return blank ? embps_table_new_in(out, cfg, rank, group_size, NULL)
               : embps_table_new(out, cfg, rank, group_size);
}

static uint64_t cpu_memory_total(embps__engine_backend_t *be) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  (void)be;
  return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
}

static embps_status_t cpu_agree_max(embps__engine_backend_t *be, uint64_t *v, embps_error_t *err) {
  return embps_comm_all_reduce(be->comm, v, 1, EMBPS_COMM_U64, EMBPS_COMM_MAX, err);
}

/* ---- batches --------------------------------------------------------------------------------- */

static embps_status_t cpu_input(embps__engine_backend_t *be, embps__engine_input_t which,
                                const void *host, size_t bytes, const void **dev,
                                embps_error_t *err) {
  (void)be, (void)which, (void)bytes, (void)err;
  *dev = host;
  return EMBPS_OK;
}

static embps_status_t cpu_nothing_to_wait(embps__engine_backend_t *be, embps_error_t *err) {
  (void)be, (void)err;
  return EMBPS_OK;
}

static embps_status_t cpu_input_wait(embps__engine_backend_t *be, embps__engine_input_t which,
                                     embps_error_t *err) {
  (void)which;
  return cpu_nothing_to_wait(be, err);
}

/* A dedup that the workers share: the counting form's parts (kernels/dedup.c), one a thread. */
typedef struct dedup_job {
  const int64_t *tokens;
  size_t T, parts, range;
  uint64_t kmin;
  uint32_t *counts, *seg, *segment_ids, *order;
} dedup_job_t;

static void dedup_count_share(void *arg, size_t lo, size_t hi) {
  const dedup_job_t *j = arg;
  for (size_t p = lo; p < hi; p++)
    embps_dedup_count_cpu(j->tokens, j->T * p / j->parts, j->T * (p + 1) / j->parts, j->kmin,
                          j->range, j->counts + p * j->range);
}

static void dedup_place_share(void *arg, size_t lo, size_t hi) {
  const dedup_job_t *j = arg;
  for (size_t p = lo; p < hi; p++)
    embps_dedup_place_cpu(j->tokens, j->T * p / j->parts, j->T * (p + 1) / j->parts, j->kmin,
                          j->counts + p * j->range, j->seg, j->segment_ids, j->order);
}

/* Below this many tokens a push's dedup stays on one thread: a counting dedup of 4096 takes
 * some tens of microseconds, about what waking the helpers twice costs (a DLRM feature push's
 * big tables have 55296 and 204800 positions a step). test_engine's threads test pushes 4096
 * tokens over 6000 rows, so 2 and 3 threads take this path there and must leave one thread's
 * bits (its segment ids; test_dedup holds the parts' order to the one-thread order). */
#define DEDUP_SPLIT_MIN 4096

static embps_status_t cpu_dedup(embps__engine_backend_t *be, const int64_t *tokens, size_t T,
                                embps_error_t *err) {
  const size_t parts = embps_workers_threads(be->workers);
  dedup_job_t j = {.tokens = tokens, .T = T, .parts = parts};
  (void)err;
  /* The one serial stage between a push's sum and update on a big batch: the counting form
   * splits it by positions, the same bits (kernels/embps_kernels.h). */
  if (parts > 1 && T >= DEDUP_SPLIT_MIN &&
      embps_dedup_counting_cpu(tokens, T, parts, &j.kmin, &j.range)) {
    j.counts = be->dedup_ws.p;
    j.seg = j.counts + parts * j.range;
    j.segment_ids = be->segment_ids.p;
    j.order = be->order.p;
    embps_workers_run(be->workers, parts, 1, dedup_count_share, &j);
    be->num_unique = embps_dedup_buckets_cpu(j.counts, parts, j.range, j.kmin, be->unique.p,
                                             be->starts.p, j.seg);
    embps_workers_run(be->workers, parts, 1, dedup_place_share, &j);
    return EMBPS_OK;
  }
  /* with the positions by segment: a sequential write of T more, for segment_sum_bags */
  be->num_unique = embps_dedup_sorted_cpu(tokens, T, be->unique.p, be->segment_ids.p, be->order.p,
                                          be->starts.p, be->dedup_ws.p);
  return EMBPS_OK;
}

static embps_status_t cpu_unique(embps__engine_backend_t *be, size_t *num_unique, int64_t *first,
                                 const int64_t **unique, embps_error_t *err) {
  (void)err;
  *num_unique = be->num_unique;
  *unique = be->unique.p;
  if (be->num_unique > 0)
    *first = (*unique)[0];
  return EMBPS_OK;
}

static embps_status_t cpu_gather(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                                 size_t n, void *out, embps_error_t *err) {
  (void)be, (void)err;
  embps_gather_cpu(embps_table_arrays(t).data, embps_table_config(t)->dtype,
                   embps_table_shard_width(t), rows, n, out);
  return EMBPS_OK;
}

static embps_status_t cpu_expand(embps__engine_backend_t *be, embps_table_t *t,
                                 const void *unique_rows, size_t T, void *out, embps_error_t *err) {
  (void)err;
  embps_expand_cpu(unique_rows, embps_table_config(t)->dtype, embps_table_shard_width(t),
                   be->segment_ids.p, T, out);
  return EMBPS_OK;
}

static embps_status_t cpu_copy2d(embps__engine_backend_t *be, void *dst, size_t dpitch,
                                 const void *src, size_t spitch, size_t width, size_t height,
                                 embps_error_t *err) {
  (void)be, (void)err;
  if (dpitch == width && spitch == width) { /* rows back to back: one copy */
    memcpy(dst, src, width * height);
    return EMBPS_OK;
  }
  for (size_t i = 0; i < height; i++)
    memcpy((uint8_t *)dst + i * dpitch, (const uint8_t *)src + i * spitch, width);
  return EMBPS_OK;
}

static embps_status_t cpu_segment_sum(embps__engine_backend_t *be, embps_table_t *t,
                                      const void *grads, size_t T, size_t num_unique, float *out,
                                      embps_error_t *err) {
  (void)err;
  embps_segment_sum_cpu(grads, embps_table_config(t)->dtype, embps_table_shard_width(t),
                        be->segment_ids.p, T, num_unique, out);
  return EMBPS_OK;
}

typedef struct sum_job {
  embps__engine_backend_t *be;
  const void *grads;
  const float *bags;                 /* a fused feature push's pooled gradients */
  const embps_bag_source_t *sources; /* and its positions' sources; else NULL */
  embps_dtype_t dtype;
  size_t width, T, num_unique, block;
  float *out, *partials;
} sum_job_t;

static void sum_share(void *arg, size_t lo, size_t hi) {
  const sum_job_t *j = arg;
  if (j->sources)
    embps_segment_sum_bags_range_cpu(j->grads, j->dtype, j->width, j->bags, j->sources,
                                     j->be->order.p, j->be->starts.p, j->block, j->out, j->partials,
                                     lo, hi);
  else
    embps_segment_sum_stats_range_cpu(j->grads, j->dtype, j->width, j->be->segment_ids.p, j->T,
                                      j->num_unique, j->block, j->out, j->partials,
                                      j->be->segment_counts.p, lo, hi);
}

/* Split by segments: each thread reads every segment id but sums only its own segments' rows;
 * with sources (a feature push's sum fused with the bags' expansion), each thread expands the
 * positions of its own segments as it adds them. */
static void run_sum(embps__engine_backend_t *be, embps_table_t *t, const void *grads,
                    const float *bags, const embps_bag_source_t *sources, size_t T,
                    size_t num_unique, size_t block, float *out, float *partials) {
  sum_job_t j = {.be = be,
                 .grads = grads,
                 .bags = bags,
                 .sources = sources,
                 .dtype = embps_table_config(t)->dtype,
                 .width = embps_table_shard_width(t),
                 .T = T,
                 .num_unique = num_unique,
                 .block = block,
                 .out = out,
                 .partials = partials};
  embps_workers_run(be->workers, num_unique, MIN_SHARE_ROWS, sum_share, &j);
}

static embps_status_t cpu_segment_sum_stats(embps__engine_backend_t *be, embps_table_t *t,
                                            const void *grads, size_t T, size_t num_unique,
                                            size_t block, float *out, float *partials,
                                            embps_error_t *err) {
  (void)err;
  run_sum(be, t, grads, NULL, NULL, T, num_unique, block, out, partials);
  return EMBPS_OK;
}

static embps_status_t cpu_segment_sum_bags(embps__engine_backend_t *be, embps_table_t *t,
                                           const void *grads, const float *bags,
                                           const embps_bag_source_t *sources, size_t T,
                                           size_t num_unique, size_t block, float *out,
                                           float *partials, embps_error_t *err) {
  (void)err;
  run_sum(be, t, grads, bags, sources, T, num_unique, block, out, partials);
  return EMBPS_OK;
}

static embps_status_t cpu_row_partials(embps__engine_backend_t *be, const float *g, size_t m,
                                       size_t w, size_t block, float *partials,
                                       embps_error_t *err) {
  (void)be, (void)err;
  embps_row_partials_cpu(g, m, w, block, partials);
  return EMBPS_OK;
}

static embps_status_t cpu_row_combine(embps__engine_backend_t *be, const float *partials,
                                      size_t slices, size_t m, size_t nb, float *row_sumsq,
                                      uint64_t *bad, double *total, embps_error_t *err) {
  size_t n_bad;
  (void)be, (void)err;
  if (total)
    *total = 0.0;
  n_bad = embps_row_combine_cpu(partials, slices, m, nb, row_sumsq, total);
  if (bad)
    *bad = n_bad;
  return EMBPS_OK;
}

static embps_status_t cpu_row_sums(embps__engine_backend_t *be, const float *partials,
                                   size_t slices, size_t stride, size_t n, size_t nb, double *sums,
                                   embps_error_t *err) {
  (void)be, (void)err;
  embps_row_sums_cpu(partials, slices, stride, n, nb, sums);
  return EMBPS_OK;
}

static embps_status_t cpu_row_finish(embps__engine_backend_t *be, const double *sums, size_t m,
                                     float *row_sumsq, uint64_t *bad, double *total,
                                     embps_error_t *err) {
  size_t n_bad;
  (void)be, (void)err;
  if (total)
    *total = 0.0;
  n_bad = embps_row_finish_cpu(sums, m, row_sumsq, total);
  if (bad)
    *bad = n_bad;
  return EMBPS_OK;
}

static embps_status_t cpu_weight_decay(embps__engine_backend_t *be, embps_table_t *t,
                                       const int64_t *rows, size_t m, float *g,
                                       embps_error_t *err) {
  const embps_table_config_t *c = embps_table_config(t);
  (void)be, (void)err;
  embps_apply_weight_decay_cpu(embps_table_arrays(t).data, c->dtype, embps_table_shard_width(t),
                               rows, m, g, c->weight_decay);
  return EMBPS_OK;
}

typedef struct update_job {
  const embps_table_config_t *c;
  embps_table_arrays_t a;
  size_t w;
  const int64_t *rows;
  const float *g, *row_sumsq;
  const embps_opt_params_t *p;
} update_job_t;

/* The unique rows [lo, hi): rows are distinct, so shares touch disjoint table rows and state. */
static void update_share(void *arg, size_t lo, size_t hi) {
  const update_job_t *j = arg;
  const embps_table_config_t *c = j->c;
  const int64_t *rows = j->rows + lo;
  const float *g = j->g + lo * j->w;
  const size_t m = hi - lo;
  switch (c->optimizer) {
  case EMBPS_OPTIMIZER_SGD:
    embps_update_sgd_cpu(j->a.data, c->dtype, j->w, rows, m, g, j->p);
    return;
  case EMBPS_OPTIMIZER_ADAGRAD:
    embps_update_adagrad_cpu(j->a.data, c->dtype, j->w, rows, m, g, j->a.state0, j->p);
    return;
  case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
    embps_update_rowwise_adagrad_cpu(j->a.data, c->dtype, j->w, rows, m, g, j->row_sumsq + lo,
                                     c->emb_width, j->a.state0, j->p);
    return;
  case EMBPS_OPTIMIZER_ADAM:
    embps_update_adam_cpu(j->a.data, c->dtype, j->w, rows, m, g, j->a.state0, j->a.state1, j->p);
    return;
  }
}

static embps_status_t cpu_update(embps__engine_backend_t *be, embps_table_t *t, const int64_t *rows,
                                 size_t m, const float *g, const float *row_sumsq,
                                 const embps_opt_params_t *p, embps_error_t *err) {
  const update_job_t j = {.c = embps_table_config(t),
                          .a = embps_table_arrays(t),
                          .w = embps_table_shard_width(t),
                          .rows = rows,
                          .g = g,
                          .row_sumsq = row_sumsq,
                          .p = p};
  switch (j.c->optimizer) {
  case EMBPS_OPTIMIZER_SGD:
  case EMBPS_OPTIMIZER_ADAGRAD:
  case EMBPS_OPTIMIZER_ROWWISE_ADAGRAD:
  case EMBPS_OPTIMIZER_ADAM:
    break;
  default:
    return embps_error_set(err, EMBPS_INTERNAL, "unknown optimizer %d", (int)j.c->optimizer);
  }
  embps_table_before_write(t, rows, m); /* an open checkpoint snapshot copies them first */
  embps_workers_run(be->workers, m, MIN_SHARE_ROWS, update_share, (void *)&j);
  return EMBPS_OK;
}

/* Hash-keyed tables: keys and slots are host memory already, so keys_to_host and hash_slots
 * hand the arrays back as they are. */
static embps_status_t cpu_keys_to_host(embps__engine_backend_t *be, const int64_t *keys, size_t n,
                                       const int64_t **host, embps_error_t *err) {
  (void)be, (void)n, (void)err;
  *host = keys;
  return EMBPS_OK;
}

static embps_status_t cpu_hash_order(embps__engine_backend_t *be, const int64_t *in, size_t n,
                                     int64_t *out, embps_error_t *err) {
  (void)be, (void)err;
  for (size_t i = 0; i < n; i++)
    out[i] = (int64_t)((uint64_t)in[i] ^ (UINT64_C(1) << 63));
  return EMBPS_OK;
}

static embps_status_t cpu_hash_slots(embps__engine_backend_t *be, const int64_t *host, size_t n,
                                     const int64_t **slots, embps_error_t *err) {
  (void)be, (void)n, (void)err;
  *slots = host;
  return EMBPS_OK;
}

/* A lookup's chunks share one memory of the absent keys' rows written (be->seen, made at the
 * first gather; without it, each call remembers its own). */
static embps_status_t cpu_hash_gather(embps__engine_backend_t *be, embps_table_t *t,
                                      const int64_t *keys, const int64_t *slots, size_t n,
                                      void *out, int more, embps_error_t *err) {
  const embps_table_config_t *c = embps_table_config(t);
  (void)err;
  if (!be->seen)
    be->seen = embps_calloc(1, sizeof(*be->seen));
  if (!be->seen) {
    embps_hash_gather_cpu(embps_table_arrays(t).data, c->dtype, embps_table_shard_width(t), keys,
                          slots, n, out, embps_table_col_begin(t), c->seed, c->init_scale);
    return EMBPS_OK;
  }
  if (!more)
    embps_hash_seen_restart(be->seen);
  embps_hash_gather_seen_cpu(embps_table_arrays(t).data, c->dtype, embps_table_shard_width(t), keys,
                             slots, n, out, embps_table_col_begin(t), c->seed, c->init_scale,
                             be->seen);
  return EMBPS_OK;
}

/* The fresh slots [lo, hi) of a hash reset: slots are distinct, so shares write disjoint rows. */
typedef struct reset_job {
  embps_table_t *t;
  const int64_t *slots, *keys;
} reset_job_t;

static void reset_share(void *arg, size_t lo, size_t hi) {
  const reset_job_t *j = arg;
  const embps_table_config_t *c = embps_table_config(j->t);
  const embps_table_arrays_t a = embps_table_arrays(j->t);
  const size_t w = embps_table_shard_width(j->t);
  size_t s0, s1;
  float v0;
  embps_table_initial_state(j->t, &v0, &s0, &s1);
  embps_hash_reset_cpu(a.data, c->dtype, w, a.state0,
                       s0 ? (embps_optimizer_info(c->optimizer)->state_per_row ? 1 : w) : 0,
                       s1 ? a.state1 : NULL, v0, j->slots + lo, j->keys + lo, hi - lo,
                       embps_table_col_begin(j->t), c->seed, c->init_scale);
}

/* Each fresh slot's initial row is a hash per element (kernels/init.c) written to a random row:
 * the push's engine thread waited on it alone (13-17% of an evicting push's CPU, perf), so the
 * workers share it as they share the update. */
static embps_status_t cpu_hash_reset(embps__engine_backend_t *be, embps_table_t *t,
                                     const int64_t *slots, const int64_t *keys, size_t n,
                                     embps_error_t *err) {
  reset_job_t j = {t, slots, keys};
  (void)err;
  embps_table_before_write(t, slots, n); /* an open checkpoint snapshot copies them first */
  embps_workers_run(be->workers, n, MIN_SHARE_ROWS, reset_share, &j);
  return EMBPS_OK;
}

/* Feature batches: scratch is host memory, and copies in and out are plain copies. */
static embps_status_t cpu_scratch(embps__engine_backend_t *be, unsigned slot, size_t bytes,
                                  void **p, embps_error_t *err) {
  if (!grow(&be->feature[slot], bytes))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for %zu bytes of a feature batch's scratch", bytes);
  *p = be->feature[slot].p;
  return EMBPS_OK;
}

static embps_status_t cpu_copy(embps__engine_backend_t *be, void *dst, const void *src,
                               size_t bytes, embps_error_t *err) {
  (void)be, (void)err;
  if (bytes && dst != src)
    memmove(dst, src, bytes);
  return EMBPS_OK;
}

/* The bags [lo, hi) of a pooling: each bag writes its own output row; each share has its own
 * scratch row. The output may sit at any alignment (a feature lookup's rows go straight into the
 * reply's bytes, behind the fields before them): then the share pools POOL_CHUNK bags at a time
 * into an aligned scratch and copies them out. */
#define POOL_CHUNK 16

typedef struct pool_job {
  embps_table_t *t;
  const int64_t *ids, *rows, *offsets;
  const float *weights;
  int mean;
  atomic_int failed; /* a share could not have its scratch row */
  float *out;
} pool_job_t;

static void pool_share(void *arg, size_t lo, size_t hi) {
  pool_job_t *j = arg;
  const embps_table_config_t *c = embps_table_config(j->t);
  const size_t w = embps_table_shard_width(j->t);
  const int aligned = ((uintptr_t)j->out & (sizeof(float) - 1)) == 0;
  float *tmp = embps_malloc((2 + (aligned ? 0 : POOL_CHUNK)) * w * sizeof(float) + 1);
  float *chunk = tmp + 2 * w;
  if (!tmp) {
    atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
    return;
  }
  for (size_t k = lo; k < hi; k += aligned ? hi - lo : POOL_CHUNK) {
    const size_t n = aligned ? hi - lo : hi - k < POOL_CHUNK ? hi - k : POOL_CHUNK;
    embps_pool_bags_cpu(embps_table_arrays(j->t).data, c->dtype, w, j->ids, j->rows, j->weights,
                        j->offsets + k, n, j->mean, aligned ? j->out + k * w : chunk, tmp,
                        embps_table_col_begin(j->t), c->seed, c->init_scale);
    if (!aligned)
      memcpy((uint8_t *)j->out + k * w * sizeof(float), chunk, n * w * sizeof(float));
  }
  embps_free(tmp);
}

/* A lookup's bags read their rows at random across the tables, so the workers share them as they
 * share a push's update. */
static embps_status_t cpu_pool_bags(embps__engine_backend_t *be, embps_table_t *t,
                                    const int64_t *ids, const int64_t *rows, const float *weights,
                                    const int64_t *offsets, size_t num_bags, int mean, float *out,
                                    embps_error_t *err) {
  pool_job_t j = {t, ids, rows, offsets, weights, mean, 0, out};
  embps_workers_run(be->workers, num_bags, 64, pool_share, &j);
  if (atomic_load_explicit(&j.failed, memory_order_relaxed))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for a pooling's scratch row of table '%s'",
                           embps_table_config(t)->name);
  return EMBPS_OK;
}

/* The bags [lo, hi) of an expansion: each bag writes its own ids' rows, so shares are disjoint. */
typedef struct expand_job {
  embps_table_t *t;
  const float *g, *weights;
  const int64_t *ids, *offsets;
  int mean;
  void *out;
} expand_job_t;

static void expand_share(void *arg, size_t lo, size_t hi) {
  const expand_job_t *j = arg;
  const size_t w = embps_table_shard_width(j->t);
  embps_expand_bags_cpu(j->g + lo * w, w, j->ids, j->weights, j->offsets + lo, hi - lo, j->mean,
                        embps_table_config(j->t)->dtype, j->out);
}

/* A feature push writes one gradient row per id (a batch of 2048 samples of 214 ids at 128 f32:
 * 224 MB), shared by the workers as the update is. */
static embps_status_t cpu_expand_bags(embps__engine_backend_t *be, embps_table_t *t, const float *g,
                                      const int64_t *ids, const float *weights,
                                      const int64_t *offsets, size_t num_bags, int mean, void *out,
                                      embps_error_t *err) {
  expand_job_t j = {t, g, weights, ids, offsets, mean, out};
  (void)err;
  embps_workers_run(be->workers, num_bags, 64, expand_share, &j);
  return EMBPS_OK;
}

static embps_status_t cpu_bag_sources(embps__engine_backend_t *be, const int64_t *ids,
                                      const float *weights, const int64_t *offsets, size_t num_bags,
                                      int mean, uint32_t first_bag, size_t n,
                                      embps_bag_source_t *out, embps_error_t *err) {
  (void)be, (void)err;
  embps_bag_sources_cpu(ids, weights, offsets, num_bags, mean, first_bag, n, out);
  return EMBPS_OK;
}

/* The rows of the keys that keep a slot move to the front of g and row_sumsq, in place. */
static embps_status_t cpu_hash_keep(embps__engine_backend_t *be, int64_t *slots, size_t *m,
                                    size_t w, float **g, float **row_sumsq, const int64_t **rows,
                                    embps_error_t *err) {
  float *gr = *g, *sq = *row_sumsq;
  size_t k = 0;
  (void)be, (void)err;
  for (size_t i = 0; i < *m; i++) {
    if (slots[i] < 0)
      continue; /* not admitted, or refused: its gradient is dropped */
    if (k != i) {
      memcpy(gr + k * w, gr + i * w, w * sizeof(float));
      sq[k] = sq[i];
      slots[k] = slots[i];
    }
    k++;
  }
  *m = k;
  *rows = slots;
  return EMBPS_OK;
}

typedef struct assign_job {
  const embps_table_config_t *c;
  embps_table_arrays_t a;
  size_t w, s0w;
  const int64_t *rows, *src_rows;
  const void *src;
  float v0;
  int reset;
} assign_job_t;

/* The rows [lo, hi): rows are distinct, so shares write disjoint table rows and state. */
static void assign_share(void *arg, size_t lo, size_t hi) {
  const assign_job_t *j = arg;
  embps_assign_rows_cpu(j->a.data, j->c->dtype, j->w, j->rows + lo, j->src_rows + lo, hi - lo,
                        j->src, j->reset ? j->a.state0 : NULL, j->reset ? j->s0w : 0,
                        j->reset ? j->a.state1 : NULL, j->v0);
}

static embps_status_t cpu_assign_rows(embps__engine_backend_t *be, embps_table_t *t,
                                      const int64_t *rows, const int64_t *src_rows, size_t n,
                                      const void *src, int reset, embps_error_t *err) {
  assign_job_t j = {.c = embps_table_config(t),
                    .a = embps_table_arrays(t),
                    .w = embps_table_shard_width(t),
                    .rows = rows,
                    .src_rows = src_rows,
                    .src = src,
                    .reset = reset};
  size_t s0, s1;
  (void)err;
  embps_table_initial_state(t, &j.v0, &s0, &s1);
  j.s0w = s0 ? (embps_optimizer_info(j.c->optimizer)->state_per_row ? 1 : j.w) : 0;
  if (!s1)
    j.a.state1 = NULL;
  embps_table_before_write(t, rows, n); /* an open checkpoint snapshot copies them first */
  embps_workers_run(be->workers, n, MIN_SHARE_ROWS, assign_share, &j);
  return EMBPS_OK;
}

static embps_status_t cpu_mark_dirty(embps__engine_backend_t *be, embps_table_t *t,
                                     const int64_t *rows, size_t m, embps_error_t *err) {
  (void)be, (void)err;
  embps_table_mark_dirty(t, rows, m);
  return EMBPS_OK;
}

static embps_status_t cpu_table_copy(embps__engine_backend_t *be, embps_table_t *t,
                                     const embps_table_arrays_t *host, int to_host,
                                     embps_error_t *err) {
  const embps_table_arrays_t a = embps_table_arrays(t);
  void *const mine[3] = {a.data, a.state0, a.state1};
  void *const theirs[3] = {host->data, host->state0, host->state1};
  size_t bytes[3];
  (void)be, (void)err;
  embps_table_array_bytes(t, bytes);
  for (int i = 0; i < 3; i++)
    if (bytes[i])
      memcpy(to_host ? theirs[i] : mine[i], to_host ? mine[i] : theirs[i], bytes[i]);
  return EMBPS_OK;
}

static embps_status_t cpu_output_begin(embps__engine_backend_t *be, void *host, size_t n,
                                       size_t row_bytes, void **out, size_t *chunk_rows,
                                       embps_error_t *err) {
  (void)err;
  *out = host; /* the rows are assembled in the reply itself, published chunk by chunk */
  *chunk_rows = row_bytes < be->chunk_bytes ? be->chunk_bytes / row_bytes : 1;
  return EMBPS_OK;
}

static embps_status_t cpu_output(embps__engine_backend_t *be, size_t chunk, size_t first,
                                 size_t count, embps_error_t *err) {
  (void)chunk, (void)first, (void)count;
  return cpu_nothing_to_wait(be, err);
}

static void cpu_abort(embps__engine_backend_t *be) { (void)be; }

const embps__engine_ops_t embps__engine_cpu_ops = {
    .backend = EMBPS_BACKEND_CPU,
    .memory = "memory",
    .destroy = cpu_destroy,
    .set_threads = cpu_set_threads,
    .reserve = cpu_reserve,
    .table_new = cpu_table_new,
    .memory_total = cpu_memory_total,
    .agree_max = cpu_agree_max,
    .input = cpu_input,
    .input_wait = cpu_input_wait,
    .dedup = cpu_dedup,
    .unique = cpu_unique,
    .gather = cpu_gather,
    .expand = cpu_expand,
    .copy2d = cpu_copy2d,
    .segment_sum = cpu_segment_sum,
    .segment_sum_stats = cpu_segment_sum_stats,
    .row_partials = cpu_row_partials,
    .row_combine = cpu_row_combine,
    .row_sums = cpu_row_sums,
    .row_finish = cpu_row_finish,
    .weight_decay = cpu_weight_decay,
    .update = cpu_update,
    .keys_to_host = cpu_keys_to_host,
    .hash_order = cpu_hash_order,
    .hash_slots = cpu_hash_slots,
    .hash_gather = cpu_hash_gather,
    .hash_reset = cpu_hash_reset,
    .hash_keep = cpu_hash_keep,
    .scratch = cpu_scratch,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .pool_bags = cpu_pool_bags,
    .expand_bags = cpu_expand_bags,
    .bag_sources = cpu_bag_sources,
    .segment_sum_bags = cpu_segment_sum_bags,
    .host_memory = 1,
    .assign_rows = cpu_assign_rows,
    .mark_dirty = cpu_mark_dirty,
    .table_copy = cpu_table_copy,
    .output_begin = cpu_output_begin,
    .output_in_place = 1,
    .output = cpu_output,
    .finish = cpu_nothing_to_wait,
    .abort = cpu_abort,
};
