/* Rounds on one rank (see engine.h for the data flow), written once for every backend.
 *
 * Each op is a sequence of collectives (embps_comm_*) and of the backend's operations
 * (engine_ops.h): the CPU backend runs the kernels/ C references on host memory, the CUDA backend
 * kernels/cuda on its streams. Both backends therefore take the same steps in the same order
 * with the same layouts, which is what makes their results equal bit for bit.
 *
 * Layout: a batch of T tokens over N ranks has n = T/N tokens per shard, and the table's W
 * columns split into slices of w = W/N. After the tokens' all-gather, position p of the batch
 * belongs to shard p / n. Every all-to-all block is n x w elements, so every rank pair exchanges
 * the same number of bytes, and each rank moves exactly the bytes the column split requires:
 * (N-1)/N of its shard's rows.
 *
 * Determinism, independent of N: duplicates are summed in position order; the row figures
 * (rowwise Adagrad's mean square, the gradient norm, the finite check) are sums over fixed
 * column blocks added in column order, on every rank or by each row's owner (row_figures;
 * kernels/row_stats.c).
 * So every rank takes bitwise the same decision, and any group whose shard width is a multiple
 * of EMBPS_ROW_STATS_BLOCK leaves bitwise the same table as one rank.
 *
 * A group of one takes a shorter route: a lookup gathers straight into the output (without
 * dedup, which saves nothing without an exchange), and no collective runs. */
#include "server/engine/engine.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "common/alloc.h"
#include "common/log.h"
#include "server/engine/engine_ops.h"
#include "server/engine/round_cost.h"

embps_status_t embps_engine_new(embps_engine_t **out, embps_comm_t *comm, embps_store_t *store,
                                embps_backend_t backend, void *stream) {
  embps_engine_t *e = embps_calloc(1, sizeof(*e));
  embps_status_t ret;
  if (!e)
    return EMBPS_RESOURCE_EXHAUSTED;
  e->comm = comm;
  e->store = store;
  if (backend == EMBPS_BACKEND_CUDA) {
    e->ops = &embps__engine_cuda_ops;
    ret = embps__engine_cuda_new(&e->be, comm, stream);
  } else {
    e->ops = &embps__engine_cpu_ops;
    ret = embps__engine_cpu_new(&e->be, comm);
  }
  if (ret != EMBPS_OK) {
    embps_free(e);
    return ret;
  }
  *out = e;
  return EMBPS_OK;
}

void embps_engine_free(embps_engine_t *e) {
  if (!e)
    return;
  e->ops->destroy(e->be);
  embps_free(e->hslots);
  embps_free(e->hfslot);
  embps_free(e->hfkey);
  embps_free(e->hkeys);
  embps_free(e->hfresh);
  embps_free(e->ascratch);
  embps_free(e->ftokens);
  embps_free(e);
}

unsigned embps_engine_set_threads(embps_engine_t *e, unsigned threads) {
  return e->ops->set_threads ? e->ops->set_threads(e->be, threads) : 1;
}

embps_backend_t embps_engine_backend(const embps_engine_t *e) { return e->ops->backend; }

uint64_t embps_engine_memory_total(embps_engine_t *e) {
  return e->ops->memory_total ? e->ops->memory_total(e->be) : 0;
}

/* What embps_host_alloc holds, for the metrics (relaxed: a figure, not a synchronization). */
static atomic_uint_fast64_t host_pinned_bytes, host_pageable_bytes;

void *embps_host_alloc(int device, size_t bytes, int *pinned) {
  static atomic_int warned;
  void *p;
  if (device >= 0) {
    if ((p = embps__cuda_host_alloc(device, bytes)) != NULL) {
      *pinned = 1;
      atomic_fetch_add_explicit(&host_pinned_bytes, bytes, memory_order_relaxed);
      return p;
    }
    if (!atomic_exchange(&warned, 1))
      EMBPS_WARN("cannot pin %zu bytes of host memory for device %d; using pageable buffers, "
                 "which the engine stages through its own pinned copies",
                 bytes, device);
  }
  *pinned = 0;
  /* A mapping of its own: the server keeps malloc's freed memory (main.c), and a buffer the pool
   * lets go of must give its pages back, or memory held for a burst stays held forever. */
  if ((p = embps_map_alloc(bytes)) != NULL)
    atomic_fetch_add_explicit(&host_pageable_bytes, bytes, memory_order_relaxed);
  return p;
}

void embps_host_free(void *p, int pinned, size_t bytes) {
  if (!p)
    return;
  if (pinned) {
    atomic_fetch_sub_explicit(&host_pinned_bytes, bytes, memory_order_relaxed);
    embps__cuda_host_free(p);
  } else {
    atomic_fetch_sub_explicit(&host_pageable_bytes, bytes, memory_order_relaxed);
    embps_map_free(p, bytes);
  }
}

void embps_host_memory(uint64_t *pinned, uint64_t *pageable) {
  *pinned = atomic_load_explicit(&host_pinned_bytes, memory_order_relaxed);
  *pageable = atomic_load_explicit(&host_pageable_bytes, memory_order_relaxed);
}

/* ---- create and drop ------------------------------------------------------------------------- */

/* Every rank learned that rank `who` (the highest that refused) cannot fit the table in its
 * budget; it tells the others what it holds and what its budget is, for one message on every
 * rank. */
static embps_status_t refuse_budget(embps_engine_t *e, embps_op_t *op, uint32_t who, uint64_t need,
                                    embps_error_t *err) {
  const int mine = e->comm->rank == who;
  uint64_t used = mine ? embps_store_budget_used(e->store) : 0;
  uint64_t max = mine ? embps_store_budget_max(e->store) : 0;
  embps_status_t ret;
  if ((ret = e->ops->agree_max(e->be, &used, err)) != EMBPS_OK ||
      (ret = e->ops->agree_max(e->be, &max, err)) != EMBPS_OK)
    return ret;
  embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                  "table '%s' needs %llu bytes on each rank%s, and rank %u already holds %llu "
                  "bytes of tables under its budget of %llu (--max-memory-bytes): drop a table "
                  "(DropTable) or raise the budget",
                  op->create.name, (unsigned long long)need,
                  need > embps_table_config_bytes(&op->create, e->comm->size)
                      ? " with its checkpoint snapshot"
                      : "",
                  who, (unsigned long long)used, (unsigned long long)max);
  return EMBPS_OK;
}

static embps_status_t run_create(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  const embps_table_config_t *cfg = &op->create;
  const uint64_t need =
      embps_store_budget_cost(e->store, embps_table_config_bytes(cfg, e->comm->size));
  const uint64_t used = embps_store_budget_used(e->store), max = embps_store_budget_max(e->store);
  embps_table_t *t = NULL;
  embps_status_t ret;
  uint64_t local, over;

  /* Every rank checks its own budget (ranks may have different memory) before any allocates;
   * one refusal refuses the table on all of them. */
  over = need > max || used > max - need ? (uint64_t)e->comm->rank + 1 : 0;
  if ((ret = e->ops->agree_max(e->be, &over, err)) != EMBPS_OK)
    return ret;
  if (over)
    return refuse_budget(e, op, (uint32_t)(over - 1), need, err);
  local = e->ops->table_new(e->be, cfg, e->comm->rank, e->comm->size, op->create_blank, &t);
  if ((ret = e->ops->agree_max(e->be, &local, err)) != EMBPS_OK) {
    embps_table_free(t);
    return ret;
  }
  if (local != EMBPS_OK) { /* some rank could not: none keeps the table */
    embps_table_free(t);
    embps_error_set(
        &op->error, local == EMBPS_RESOURCE_EXHAUSTED ? EMBPS_RESOURCE_EXHAUSTED : EMBPS_INTERNAL,
        "%s %s allocating table '%s' (%llu bytes of %s on each rank)",
        local == EMBPS_RESOURCE_EXHAUSTED ? "out of" : "failed to initialize", e->ops->memory,
        cfg->name, (unsigned long long)embps_table_config_bytes(cfg, e->comm->size),
        e->ops->memory);
    return EMBPS_OK;
  }
  if (embps_store_add(e->store, t, &op->error) != EMBPS_OK) {
    embps_table_free(t);
    t = NULL;
  }
  /* The leader answers the client once every rank has registered the table, so that a lookup
   * sent to any rank right after the answer finds it. */
  if ((ret = embps_comm_barrier(e->comm, err)) != EMBPS_OK)
    return ret;
  op->created = t;
  return EMBPS_OK;
}

/* Unregisters the table and frees its arrays on every rank; the leader answers once every rank
 * has, so the bytes are back in every rank's budget when the client hears of it. Every rank
 * holds the same tables, so all of them find the name, or none does. */
static embps_status_t run_drop(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps_table_t *t = embps_store_find(e->store, op->create.name);
  if (!t) {
    embps_error_set(&op->error, EMBPS_NOT_FOUND, "table '%s' not found", op->create.name);
    return EMBPS_OK;
  }
  embps_store_drop(e->store, t);
  op->table = t;
  return embps_comm_barrier(e->comm, err);
}

/* ---- batches --------------------------------------------------------------------------------- */

/* Scratch for a batch. Every rank of a group needs the same memory, so a rank that cannot have
 * it breaks the group rather than leave the ranks out of step (scratch only grows, so this
 * happens once, at the largest batch); a group of one only fails the op. */
static embps_status_t reserve(embps_engine_t *e, const embps__engine_shape_t *sh, embps_op_t *op,
                              embps__engine_scratch_t *s, embps_error_t *err) {
  embps_status_t ret = e->ops->reserve(e->be, sh, s, err);
  if (ret == EMBPS_OK || sh->group_size > 1)
    return ret;
  op->error = *err;
  embps_error_clear(err);
  return EMBPS_OK;
}

static embps_status_t hash_reserve(embps_engine_t *e, const embps__engine_shape_t *sh,
                                   embps_op_t *op, embps_error_t *err);

embps_status_t embps__engine_reserve(embps_engine_t *e, const embps__engine_shape_t *sh,
                                     embps_op_t *op, embps__engine_scratch_t *s,
                                     embps_error_t *err) {
  embps_status_t ret = reserve(e, sh, op, s, err);
  if (ret != EMBPS_OK || op->error.status != EMBPS_OK || !sh->hashed)
    return ret;
  return hash_reserve(e, sh, op, err);
}

/* ---- hash-keyed tables ----------------------------------------------------------------------- */

/* A hash-keyed table's keys are translated to slots where a dense table uses the token as the
 * row: a lookup finds them in the index (read-only) and reads a key without a slot as its
 * initial row; a push, once the gate has passed, steps the index on the batch's unique keys,
 * resets every (re)assigned slot to its new key's initial state, and drops the gradients of the
 * keys left without a slot. The index is the same on every rank (its step sees the same unique
 * keys everywhere), so every rank updates the same slots. The index lives in host memory on
 * every backend: the keys come to the host (keys_to_host: no copy on the cpu backend, one of
 * 8 bytes a unique key on cuda) and the slots go back (hash_slots, hash_keep, hash_reset). */

/* The key order of a push's dedup: a key k is sorted as k ^ 2^63, so that the padding key 0
 * comes first (as it does for a dense table) and the keys ascend as unsigned numbers. The map is
 * its own inverse. */
#define HASH_ORDER(k) ((int64_t)((uint64_t)(k) ^ (UINT64_C(1) << 63)))

/* Grows the host scratch to T entries (a group's ranks all need the same: see reserve). */
static embps_status_t hash_reserve(embps_engine_t *e, const embps__engine_shape_t *sh,
                                   embps_op_t *op, embps_error_t *err) {
  const embps__engine_ops_t *ops = e->ops;
  embps_error_t mine;
  if (!ops->keys_to_host || !ops->hash_order || !ops->hash_slots || !ops->hash_gather ||
      !ops->hash_reset || !ops->hash_keep)
    return embps_error_set(err, EMBPS_INTERNAL,
                           "table '%s' is hash-keyed, and the %s backend serves none",
                           embps_table_config(op->table)->name, embps_backend_name(ops->backend));
  if (sh->T <= e->hcap)
    return EMBPS_OK;
  embps_free(e->hslots), embps_free(e->hfslot), embps_free(e->hfkey);
  embps_free(e->hkeys), embps_free(e->hfresh);
  e->hslots = embps_malloc(sh->T * sizeof(*e->hslots));
  e->hfslot = embps_malloc(sh->T * sizeof(*e->hfslot));
  e->hfkey = embps_malloc(sh->T * sizeof(*e->hfkey));
  e->hkeys = embps_malloc(sh->T * sizeof(*e->hkeys));
  e->hfresh = embps_malloc(sh->T * sizeof(*e->hfresh));
  if (e->hslots && e->hfslot && e->hfkey && e->hkeys && e->hfresh) {
    e->hcap = sh->T;
    return EMBPS_OK;
  }
  e->hcap = 0;
  embps_error_set(&mine, EMBPS_RESOURCE_EXHAUSTED,
                  "out of memory for the key scratch of a %zu-token batch of table '%s'", sh->T,
                  embps_table_config(op->table)->name);
  if (sh->group_size > 1) {
    *err = mine;
    return mine.status;
  }
  op->error = mine;
  return EMBPS_OK;
}

/* *slots (backend memory) = the slots of n keys: `host` on the host, `keys` where the backend
 * has them (they may be the same). */
static embps_status_t hash_find(embps_engine_t *e, embps_table_t *t, const int64_t *host, size_t n,
                                const int64_t **slots, embps_error_t *err) {
  embps_hindex_find(embps_table_hindex(t), (const uint64_t *)host, n, e->hslots);
  return e->ops->hash_slots(e->be, e->hslots, n, slots, err);
}

/* The push's index step on its m unique nonzero keys `ordered` (backend memory, in HASH_ORDER)
 * with their summed gradients *g (m x w) and row figures *row_sumsq (m): resets the slots the
 * step (re)assigned, then keeps the rows of the keys that keep a slot (hash_keep: *g and
 * *row_sumsq may move), and sets *rows to their slots and *m to their number. */
static embps_status_t hash_step(embps_engine_t *e, const embps__engine_shape_t *sh,
                                embps_table_t *t, const int64_t *ordered, size_t *m, float **g,
                                float **row_sumsq, const int64_t **rows, embps_error_t *err) {
  const int64_t *host;
  size_t nfresh = 0;
  embps_status_t ret;
  if ((ret = e->ops->keys_to_host(e->be, ordered, *m, &host, err)) != EMBPS_OK)
    return ret;
  for (size_t i = 0; i < *m; i++)
    e->hkeys[i] = (uint64_t)HASH_ORDER(host[i]);
  ret = embps_hindex_step(embps_table_hindex(t), e->hkeys, *m, e->hslots, e->hfresh, &nfresh);
  if (ret != EMBPS_OK) /* the index is unchanged on this rank; the group cannot go on */
    return embps_error_set(err, ret, "the key index of table '%s' could not take a step (%s)",
                           embps_table_config(t)->name, embps_status_str(ret));
  embps_table_hindex_publish(t);
  for (size_t i = 0; i < nfresh; i++) {
    e->hfslot[i] = e->hfresh[i].slot;
    e->hfkey[i] = (int64_t)e->hfresh[i].key;
  }
  if (nfresh && (ret = e->ops->hash_reset(e->be, t, e->hfslot, e->hfkey, nfresh, err)) != EMBPS_OK)
    return ret;
  return e->ops->hash_keep(e->be, e->hslots, m, sh->w, g, row_sumsq, rows, err);
}

/* ---- lookup ---------------------------------------------------------------------------------- */

static embps_status_t run_lookup(embps_engine_t *e, const embps__engine_shape_t *sh, embps_op_t *op,
                                 embps_error_t *err) {
  const embps__engine_ops_t *ops = e->ops;
  embps__engine_backend_t *be = e->be;
  embps_table_t *t = op->table;
  embps_table_counters_t *counters = embps_table_counters(t);
  const int hashed = embps_table_hindex(t) != NULL;
  const uint32_t N = sh->group_size;
  const size_t n = sh->n, T = sh->T, w = sh->w, ds = sh->ds, row_bytes = sh->W * ds;
  const size_t block = n * w * ds;
  embps__engine_scratch_t s;
  const void *tokens;
  const int64_t *unique, *hslots = NULL;
  size_t U, chunk_rows, k = 0;
  int64_t first;
  uint8_t *out;
  embps_status_t ret;

  if ((ret = embps__engine_reserve(e, sh, op, &s, err)) != EMBPS_OK || op->error.status != EMBPS_OK)
    return ret;
  EMBPS__STEP(ops->input(be, EMBPS__IN_TOKENS, op->tokens, n * sizeof(int64_t), &tokens, err));
  EMBPS__STEP(ops->input_wait(be, EMBPS__IN_TOKENS, err));
  atomic_fetch_add_explicit(&counters->lookups, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->rows_looked_up, n, memory_order_relaxed);
  if (N > 1) {
    EMBPS__STEP(embps_comm_all_gather(e->comm, tokens, n * sizeof(int64_t), s.all_tokens, err));
    EMBPS__STEP(ops->dedup(be, s.all_tokens, T, err));
    EMBPS__STEP(ops->unique(be, &U, &first, &unique, err));
    atomic_fetch_add_explicit(&counters->unique_tokens, U, memory_order_relaxed);
    atomic_fetch_add_explicit(&counters->unique_batches, 1, memory_order_relaxed);
    if (hashed) {
      const int64_t *host, *slots;
      EMBPS__STEP(ops->keys_to_host(be, unique, U, &host, err));
      EMBPS__STEP(hash_find(e, t, host, U, &slots, err));
      EMBPS__STEP(ops->hash_gather(be, t, unique, slots, U, s.rows, 0, err));
    } else
      EMBPS__STEP(ops->gather(be, t, unique, U, s.rows, err));
    EMBPS__STEP(ops->expand(be, t, s.rows, T, s.send, err));
    EMBPS__STEP(embps_comm_all_to_all(e->comm, s.send, block, s.recv, err));
  }
  if (N == 1 && hashed) /* every key's slot, once (hash_slots is one call per op) */
    EMBPS__STEP(hash_find(e, t, op->tokens, n, &hslots, err));
  /* The rows go back in chunks, so that the copy of chunk k to the host (on a backend that
   * copies) overlaps the work of chunk k+1; on a backend that fills the reply in place, chunk k
   * is published to the loop, which sends it while chunk k+1 is gathered. */
  EMBPS__STEP(ops->output_begin(be, op->rows_out, n, row_bytes, (void **)&out, &chunk_rows, err));
  for (size_t a = 0; a < n; a += chunk_rows, k++) {
    const size_t m = n - a < chunk_rows ? n - a : chunk_rows;
    if (N == 1 && hashed) {
      EMBPS__STEP(ops->hash_gather(be, t, (const int64_t *)tokens + a, hslots + a, m,
                                   out + a * row_bytes, a > 0, err));
    } else if (N == 1) {
      EMBPS__STEP(ops->gather(be, t, (const int64_t *)tokens + a, m, out + a * row_bytes, err));
    } else {
      /* recv block r holds columns [r*w, (r+1)*w) of this shard's n rows. */
      for (uint32_t r = 0; r < N; r++)
        EMBPS__STEP(ops->copy2d(be, out + a * row_bytes + r * w * ds, row_bytes,
                                (const uint8_t *)s.recv + r * block + a * w * ds, w * ds, w * ds, m,
                                err));
    }
    EMBPS__STEP(ops->output(be, k, a, m, err));
    if (ops->output_in_place && op->publish) {
      atomic_store_explicit(&op->rows_ready, a + m, memory_order_release);
      op->publish(op, op->publish_arg);
    }
  }
  EMBPS__STEP(ops->finish(be, err));
  return EMBPS_OK;
fail:
  ops->abort(be);
  return ret;
}

/* ---- push ------------------------------------------------------------------------------------ */

/* Each unique row's sum of squares over the full width, into s->row_sumsq, from the column-block
 * partials of every rank added in column order; with bad and total, also the number of rows
 * that are not finite and the total sum of squares (host). This rank's partials are those of g,
 * taken here, or `ready` when the segment sum took them already.
 *
 * In a group the partials are combined one of two ways (embps_round_stats_by_owner picks, from
 * the group size and nb alone, so every rank and `embps plan` pick alike), with the same bits:
 * - whole: every rank all-gathers every rank's m x nb partials and adds them all
 *   (group_size x m x nb floats received a rank);
 * - by owner: rank j owns rows [j*q, min(m, (j+1)*q)), q = ceil(m / group_size). An
 *   all-to-all of blocks of q rows brings each owner its rows' partials from every rank (the
 *   blocks past row m are read but never added: the scratch is group_size rows longer), the
 *   owner adds them in rank and column order in double (row_sums: the combine's own additions),
 *   an all-gather in place of q doubles a rank gives every rank every row's sum in row order,
 *   and row_finish rounds, counts and totals them exactly as the combine does. About m x (4 nb
 *   + 8) bytes a rank, whatever the group size. */
static embps_status_t row_figures(embps_engine_t *e, const embps__engine_shape_t *sh,
                                  const embps__engine_scratch_t *s, const float *g, size_t m,
                                  const float *ready, uint64_t *bad, double *total,
                                  embps_error_t *err) {
  const uint32_t N = sh->group_size;
  const size_t block = sh->nb ? sh->w / sh->nb : 0;
  const float *parts = ready ? ready : s->partials;
  embps_status_t ret;

  if (!ready)
    EMBPS__STEP(e->ops->row_partials(e->be, g, m, sh->w, block, s->partials, err));
  if (N > 1 && embps_round_stats_by_owner(N, sh->nb)) {
    const size_t q = embps_round_stats_owned(N, m), first = (size_t)e->comm->rank * q;
    const size_t owned = m > first ? (m - first < q ? m - first : q) : 0;
    double *mine = q ? s->sums + first : s->sums; /* no offset on an empty (maybe NULL) array */
    EMBPS__STEP(
        embps_comm_all_to_all(e->comm, parts, q * sh->nb * sizeof(float), s->gathered, err));
    EMBPS__STEP(e->ops->row_sums(e->be, s->gathered, N, q, owned, sh->nb, mine, err));
    EMBPS__STEP(embps_comm_all_gather(e->comm, mine, q * sizeof(double), s->sums, err));
    EMBPS__STEP(e->ops->row_finish(e->be, s->sums, m, s->row_sumsq, bad, total, err));
    return EMBPS_OK;
  }
  if (N > 1) {
    EMBPS__STEP(
        embps_comm_all_gather(e->comm, parts, m * sh->nb * sizeof(float), s->gathered, err));
    parts = s->gathered;
  }
  EMBPS__STEP(e->ops->row_combine(e->be, parts, N, m, sh->nb, s->row_sumsq, bad, total, err));
  return EMBPS_OK;
fail:
  return ret;
}

/* A push's step on one table, in two halves around the exchange of the gradients: push_dedup
 * deduplicates the batch's T tokens (backend memory; a hash-keyed table's in HASH_ORDER), and
 * push_apply then sums the gradients (T x w of the table's dtype, this rank's columns, in the
 * tokens' positions), gates, steps the index of a hash-keyed table, and updates. The results go
 * to *res. run_push runs them for PushGradients, and the feature batches (features.c) for each
 * table they push to. */
embps_status_t embps__engine_push_dedup(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_table_t *t, const embps__engine_scratch_t *s,
                                        const void *tokens, embps_error_t *err) {
  embps_status_t ret;
  if (embps_table_hindex(t)) { /* keys in HASH_ORDER */
    EMBPS__STEP(e->ops->hash_order(e->be, tokens, sh->T, s->keys, err));
    tokens = s->keys;
  }
  EMBPS__STEP(e->ops->dedup(e->be, tokens, sh->T, err));
  return EMBPS_OK;
fail:
  return ret;
}

embps_status_t embps__engine_push_apply(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_table_t *t, const embps__engine_scratch_t *sp,
                                        const void *grads, const float *bags,
                                        const embps_bag_source_t *sources,
                                        embps__engine_step_t *res, embps_error_t *err) {
  const embps__engine_ops_t *ops = e->ops;
  embps__engine_backend_t *be = e->be;
  const embps_table_config_t *c = embps_table_config(t);
  embps_table_counters_t *counters = embps_table_counters(t);
  const size_t T = sh->T, w = sh->w;
  const int rowwise = c->optimizer == EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
  const int hashed = embps_table_hindex(t) != NULL;
  embps__engine_scratch_t s = *sp;
  const int64_t *unique, *rows;
  const float *ready;
  int64_t first_unique = -1;
  size_t U, first, m;
  uint64_t bad = 0;
  double total = 0.0;
  float *g, *row_sumsq;
  embps_opt_params_t p;
  embps_status_t ret;

  memset(res, 0, sizeof(*res));
  EMBPS__STEP(ops->unique(be, &U, &first_unique, &unique, err));
  /* Where the backend can, the row statistics are taken while each summed row is still in cache
   * (kernels/segment_sum_stats.c says what that saves). */
  if (sources)
    EMBPS__STEP(ops->segment_sum_bags(be, t, grads, bags, sources, T, U, sh->nb ? w / sh->nb : 0,
                                      s.summed, s.partials, err));
  else if (ops->segment_sum_stats)
    EMBPS__STEP(ops->segment_sum_stats(be, t, grads, T, U, sh->nb ? w / sh->nb : 0, s.summed,
                                       s.partials, err));
  else
    EMBPS__STEP(ops->segment_sum(be, t, grads, T, U, s.summed, err));
  /* Unique tokens are ascending, so the padding row, when present, is the first. */
  first = (U > 0 && first_unique == (hashed ? HASH_ORDER(0) : 0)) ? 1 : 0;
  rows = unique + first;
  m = U - first;
  g = s.summed + first * w;
  ready = sources || ops->segment_sum_stats ? s.partials + first * sh->nb : NULL;
  res->num_unique = m;
  atomic_fetch_add_explicit(&counters->unique_tokens, m, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->unique_batches, 1, memory_order_relaxed);

  EMBPS__STEP(row_figures(e, sh, &s, g, m, ready, &bad, &total, err));
  row_sumsq = s.row_sumsq;
  if (bad != 0) { /* the gate: one non-finite gradient anywhere skips the step */
    res->skipped = 1;
    atomic_fetch_add_explicit(&counters->steps_skipped, 1, memory_order_relaxed);
    return EMBPS_OK;
  }
  res->grad_norm = sqrt(total);
  if (hashed) /* from here on, rows are the slots of the keys that keep a gradient */
    EMBPS__STEP(hash_step(e, sh, t, rows, &m, &g, &row_sumsq, &rows, err));
  if (c->weight_decay != 0.0f) {
    EMBPS__STEP(ops->weight_decay(be, t, rows, m, g, err));
    if (rowwise) { /* the mean square of the gradient the update sees */
      EMBPS__STEP(row_figures(e, sh, &s, g, m, NULL, NULL, NULL, err));
      row_sumsq = s.row_sumsq;
    }
  }
  p = embps__engine_next_step(t);
  EMBPS__STEP(ops->update(be, t, rows, m, g, row_sumsq, &p, err));
  if (embps_table_dirty(t))
    EMBPS__STEP(ops->mark_dirty(be, t, rows, m, err));
  res->applied = 1;
  atomic_fetch_add_explicit(&counters->steps_applied, 1, memory_order_relaxed);
  return EMBPS_OK;
fail:
  return ret;
}

static embps_status_t run_push(embps_engine_t *e, const embps__engine_shape_t *sh, embps_op_t *op,
                               embps_error_t *err) {
  const embps__engine_ops_t *ops = e->ops;
  embps__engine_backend_t *be = e->be;
  embps_table_t *t = op->table;
  embps_table_counters_t *counters = embps_table_counters(t);
  const uint32_t N = sh->group_size;
  const size_t n = sh->n, w = sh->w, W = sh->W, ds = sh->ds, block = n * w * ds;
  embps__engine_scratch_t s;
  embps__engine_step_t res;
  const void *tokens, *grads;
  embps_status_t ret;

  if ((ret = embps__engine_reserve(e, sh, op, &s, err)) != EMBPS_OK || op->error.status != EMBPS_OK)
    return ret;
  atomic_fetch_add_explicit(&counters->pushes, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&counters->rows_pushed, n, memory_order_relaxed);
  /* The gradients (the bulk of the request) travel while the tokens are all-gathered and
   * deduplicated, which need only the tokens. */
  EMBPS__STEP(ops->input(be, EMBPS__IN_TOKENS, op->tokens, n * sizeof(int64_t), &tokens, err));
  EMBPS__STEP(ops->input(be, EMBPS__IN_GRADS, op->grads, n * W * ds, &grads, err));
  EMBPS__STEP(ops->input_wait(be, EMBPS__IN_TOKENS, err));
  if (N > 1) {
    EMBPS__STEP(embps_comm_all_gather(e->comm, tokens, n * sizeof(int64_t), s.all_tokens, err));
    tokens = s.all_tokens;
  }
  EMBPS__STEP(embps__engine_push_dedup(e, sh, t, &s, tokens, err));
  EMBPS__STEP(ops->input_wait(be, EMBPS__IN_GRADS, err));
  if (N > 1) {
    /* Block r of the send buffer: columns [r*w, (r+1)*w) of this shard's n gradient rows. */
    for (uint32_t r = 0; r < N && n > 0; r++)
      EMBPS__STEP(ops->copy2d(be, (uint8_t *)s.send + r * block, w * ds,
                              (const uint8_t *)grads + r * w * ds, W * ds, w * ds, n, err));
    EMBPS__STEP(embps_comm_all_to_all(e->comm, s.send, block, s.recv, err));
    grads = s.recv; /* T x w: every position's gradient for this rank's columns */
  }
  EMBPS__STEP(embps__engine_push_apply(e, sh, t, &s, grads, NULL, NULL, &res, err));
  op->num_unique = res.num_unique;
  op->skipped = res.skipped;
  op->grad_norm = res.grad_norm;
  /* A sync push answers after the update is applied. */
  EMBPS__STEP(ops->finish(be, err));
  op->applied = res.applied;
  return EMBPS_OK;
fail:
  ops->abort(be);
  return ret;
}

/* ---- whole tables (checkpoints) -------------------------------------------------------------- */

embps_status_t embps_engine_agree_max(embps_engine_t *e, uint64_t *v, embps_error_t *err) {
  return e->ops->agree_max(e->be, v, err);
}

embps_status_t embps_engine_table_export(embps_engine_t *e, embps_table_t *t,
                                         const embps_table_arrays_t *host, embps_error_t *err) {
  return e->ops->table_copy(e->be, t, host, 1, err);
}

embps_status_t embps_engine_table_import(embps_engine_t *e, embps_table_t *t,
                                         const embps_table_arrays_t *host, embps_error_t *err) {
  return e->ops->table_copy(e->be, t, host, 0, err);
}

embps_opt_params_t embps__engine_next_step(embps_table_t *t) {
  const embps_table_config_t *c = embps_table_config(t);
  embps_opt_params_t p;
  memset(&p, 0, sizeof(p));
  p.lr = c->lr;
  p.eps = c->eps;
  p.decay = embps_opt_decay_from_half_life(c->half_life);
  p.beta1 = c->beta1;
  p.beta2 = c->beta2;
  p.step = embps_table_next_step(t);
  return p;
}

embps_status_t embps_engine_run(embps_engine_t *e, embps_op_t *op, embps_error_t *err) {
  embps__engine_shape_t sh;
  embps_error_clear(&op->error);
  embps_error_clear(err);
  op->applied = op->skipped = 0;
  op->grad_norm = 0.0;
  op->num_unique = op->num_refused = 0;
  if (op->kind == EMBPS_OP_CREATE_TABLE)
    return run_create(e, op, err);
  if (op->kind == EMBPS_OP_DROP_TABLE)
    return run_drop(e, op, err);
  if (op->kind != EMBPS_OP_LOOKUP && op->kind != EMBPS_OP_PUSH && op->kind != EMBPS_OP_ASSIGN)
    return embps_error_set(err, EMBPS_INTERNAL, "unknown op kind %d", (int)op->kind);
  for (size_t f = 0; f < op->num_features; f++) /* a feature batch: each of its tables */
    if (embps_table_dropped(op->features[f].table)) {
      embps_error_set(&op->error, EMBPS_NOT_FOUND,
                      "table '%s' was dropped before this batch ran (DropTable)",
                      embps_table_config(op->features[f].table)->name);
      return EMBPS_OK;
    }
  if (op->num_features > 0)
    return embps__engine_run_features(e, op, err);
  /* Every rank's shard names the same table (the leader's sequencer compared their ids), and
   * every rank applied the drop at the same place in the round order: all fail it, or none. */
  if (embps_table_dropped(op->table)) {
    embps_error_set(&op->error, EMBPS_NOT_FOUND,
                    "table '%s' was dropped before this batch ran (DropTable)",
                    embps_table_config(op->table)->name);
    return EMBPS_OK;
  }

  memset(&sh, 0, sizeof(sh));
  sh.kind = op->kind;
  sh.group_size = e->comm->size;
  sh.n = op->num_tokens;
  sh.T = sh.n * sh.group_size;
  sh.w = embps_table_shard_width(op->table);
  sh.W = embps_table_config(op->table)->emb_width;
  sh.ds = embps_dtype_size(embps_table_config(op->table)->dtype);
  sh.hashed = embps_table_hindex(op->table) != NULL;
  if (sh.kind == EMBPS_OP_ASSIGN)
    return embps__engine_run_assign(e, &sh, op, err);
  if (sh.kind == EMBPS_OP_PUSH) {
    size_t block = embps_row_stats_block(sh.w);
    sh.nb = block ? sh.w / block : 0;
    return run_push(e, &sh, op, err);
  }
  return run_lookup(e, &sh, op, err);
}
