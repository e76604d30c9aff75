/* Fused lookups: consecutive lookups of one dense table in a round run as one batch.
 *
 * A lookup's cost on a group is mostly fixed: one all-gather of its tokens and one all-to-all of
 * its rows, each a frame to and from every peer, whatever the batch's size. On 2 shared cores
 * with the TCP backend that was some 7 us of CPU per peer per lookup (issue 34: 0.258 ms a lookup
 * on the leader of 16 ranks, 0.464 ms at 32, for 64 tokens). Rounds already hold the batches that
 * became complete while the previous round ran, and their number grows with the load; running a
 * round's lookups of one table as one batch makes the collectives' cost per round, not per
 * lookup, so the fixed cost per lookup falls as the load rises instead of rising with N.
 *
 * The k lookups' shards are concatenated on every rank in round order (every rank sees the same
 * entries, so the same k and sizes): the all-gather carries this rank's n_1 + ... + n_k tokens,
 * the dedup runs over the union, the gather reads each distinct row once, and the all-to-all's
 * block to rank r holds r's rows of every lookup, one after the other. Each lookup's reply is then
 * cut from its own rows of the received blocks. A lookup reads rows and changes nothing, so its
 * rows are the same bits whatever it is fused with; pushes, assigns, feature batches and
 * hash-keyed tables (whose lookups read the replicated index) are never fused. */
#include <stdatomic.h>
#include <string.h>

#include "common/alloc.h"
#include "server/engine/engine_ops.h"

int embps_engine_lookups_fuse(const embps_engine_t *e, const embps_op_t *a, const embps_op_t *b,
                              size_t tokens_so_far) {
  if (e->comm->size < 2 || a->kind != EMBPS_OP_LOOKUP || a->num_features || !a->table ||
      embps_table_hindex(a->table) || embps_table_dropped(a->table))
    return 0;
  if (!b)
    return 1; /* a may start a run */
  const embps_table_config_t *c = embps_table_config(a->table);
  return b->kind == EMBPS_OP_LOOKUP && !b->num_features && b->table &&
         embps_table_id(b->table) == embps_table_id(a->table) &&
         (tokens_so_far + b->num_tokens) * c->emb_width * embps_dtype_size(c->dtype) <=
             EMBPS_ENGINE_FUSE_MAX_BYTES;
}

/* The k shards' tokens, one after the other, in the engine's host buffer. */
static const int64_t *concat_tokens(embps_engine_t *e, embps_op_t *const *ops, size_t k, size_t n,
                                    embps_error_t *err) {
  if (n > e->fcap) {
    int64_t *grown = embps_realloc(e->ftokens, n * sizeof(int64_t));
    if (!grown) {
      embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                      "out of memory for %zu tokens of fused lookups", n);
      return NULL;
    }
    e->ftokens = grown;
    e->fcap = n;
  }
  for (size_t i = 0, a = 0; i < k; a += ops[i]->num_tokens, i++)
    memcpy(e->ftokens + a, ops[i]->tokens, ops[i]->num_tokens * sizeof(int64_t));
  return e->ftokens;
}

embps_status_t embps_engine_run_lookups(embps_engine_t *e, embps_op_t *const *ops, size_t k,
                                        embps_error_t *err) {
  const embps__engine_ops_t *bops = e->ops;
  embps__engine_backend_t *be = e->be;
  embps_table_t *t = ops[0]->table;
  embps_table_counters_t *counters = embps_table_counters(t);
  embps__engine_shape_t sh;
  embps__engine_scratch_t s;
  const int64_t *host, *unique;
  const void *tokens;
  size_t U;
  int64_t first;
  embps_status_t ret;

  if (k == 1 || e->comm->size < 2)
    goto one_by_one;
  for (size_t i = 0; i < k; i++) {
    embps_error_clear(&ops[i]->error);
    ops[i]->applied = ops[i]->skipped = 0;
    ops[i]->grad_norm = 0.0;
    ops[i]->num_unique = ops[i]->num_refused = 0;
  }
  embps_error_clear(err);
  memset(&sh, 0, sizeof(sh));
  sh.kind = EMBPS_OP_LOOKUP;
  sh.group_size = e->comm->size;
  for (size_t i = 0; i < k; i++)
    sh.n += ops[i]->num_tokens;
  sh.T = sh.n * sh.group_size;
  sh.w = embps_table_shard_width(t);
  sh.W = embps_table_config(t)->emb_width;
  sh.ds = embps_dtype_size(embps_table_config(t)->dtype);
  const size_t w = sh.w, ds = sh.ds, row_bytes = sh.W * ds, block = sh.n * w * ds;

  /* In a group the scratch is every rank's alike or the group breaks (engine.c's reserve). */
  EMBPS__STEP(bops->reserve(be, &sh, &s, err));
  if (!(host = concat_tokens(e, ops, k, sh.n, err))) {
    ret = err->status;
    goto fail;
  }
  EMBPS__STEP(bops->input(be, EMBPS__IN_TOKENS, host, sh.n * sizeof(int64_t), &tokens, err));
  EMBPS__STEP(bops->input_wait(be, EMBPS__IN_TOKENS, err));
  atomic_fetch_add_explicit(&counters->lookups, k, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->rows_looked_up, sh.n, memory_order_relaxed);
  EMBPS__STEP(embps_comm_all_gather(e->comm, tokens, sh.n * sizeof(int64_t), s.all_tokens, err));
  EMBPS__STEP(bops->dedup(be, s.all_tokens, sh.T, err));
  EMBPS__STEP(bops->unique(be, &U, &first, &unique, err));
  atomic_fetch_add_explicit(&counters->unique_tokens, U, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->unique_batches, 1, memory_order_relaxed);
  EMBPS__STEP(bops->gather(be, t, unique, U, s.rows, err));
  EMBPS__STEP(bops->expand(be, t, s.rows, sh.T, s.send, err));
  EMBPS__STEP(embps_comm_all_to_all(e->comm, s.send, block, s.recv, err));
  /* Each lookup's rows: recv block r holds columns [r*w, (r+1)*w) of every fused shard's rows,
   * lookup i's from row base on. */
  for (size_t i = 0, base = 0; i < k; base += ops[i]->num_tokens, i++) {
    embps_op_t *op = ops[i];
    const size_t n = op->num_tokens;
    size_t chunk_rows, c = 0;
    uint8_t *out;
    EMBPS__STEP(
        bops->output_begin(be, op->rows_out, n, row_bytes, (void **)&out, &chunk_rows, err));
    for (size_t a = 0; a < n; a += chunk_rows, c++) {
      const size_t m = n - a < chunk_rows ? n - a : chunk_rows;
      for (uint32_t r = 0; r < sh.group_size; r++)
        EMBPS__STEP(bops->copy2d(be, out + a * row_bytes + r * w * ds, row_bytes,
                                 (const uint8_t *)s.recv + r * block + (base + a) * w * ds, w * ds,
                                 w * ds, m, err));
      EMBPS__STEP(bops->output(be, c, a, m, err));
      if (bops->output_in_place && op->publish) {
        atomic_store_explicit(&op->rows_ready, a + m, memory_order_release);
        op->publish(op, op->publish_arg);
      }
    }
    EMBPS__STEP(bops->finish(be, err));
  }
  return EMBPS_OK;
fail:
  bops->abort(be);
  return ret;

one_by_one:
  for (size_t i = 0; i < k; i++)
    if ((ret = embps_engine_run(e, ops[i], err)) != EMBPS_OK)
      return ret;
  return EMBPS_OK;
}
