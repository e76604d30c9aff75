/* An assign (the Assign RPC, docs/design.md "Writing rows directly"): rows written as given,
 * ordered as a round like a push, through the backend's operations so that both backends serve
 * it.
 *
 * The round: every rank all-gathers the batch's tokens, and the rows' column slices travel by one
 * all-to-all to the ranks that hold those columns, exactly as a push's gradients do (blocks of
 * n x w per rank pair). Then each rank decides on the host which position wins for each distinct
 * nonzero token: the last one in the batch's order (the tokens come to the host: no copy on the
 * cpu backend, one of 8 bytes a token on cuda). The decision is a function of the tokens alone,
 * so every rank takes the same one. A dense table writes each token's row; a hash-keyed table
 * first takes one index step that inserts the keys without admission (embps_hindex_assign: the
 * same step on every rank, evicting by the table's rule when full; keys left without a slot are
 * refused and counted), then writes the slots. The winning rows move from the exchange's buffer
 * to the table in one kernel (assign_rows), which also puts the optimizer state back to its
 * initial value for the rows asked to (reset_state) and for every key given a new slot (whose
 * old state belonged to the key evicted). The rows written are marked dirty for incremental
 * checkpoints, and on the cpu backend an open checkpoint snapshot copies them first.
 *
 * Nothing is summed and no figure is computed: an assign moves bytes, so a bf16 row keeps its
 * bits (a NaN's payload too) and the table is bitwise the rows given, on any group size. */
#include <string.h>

#include "common/alloc.h"
#include "server/engine/engine_ops.h"

/* The scratch slots (the backend's memory; the feature batches' slots, free during an assign). */
enum {
  AS_TOKENS, /* this rank's tokens, where the backend's memory is not the host's */
  AS_ROWS,   /* this rank's rows, likewise */
  AS_ALL,    /* the batch's T tokens (group_size > 1) */
  AS_SEND,   /* N blocks of n x w: this rank's rows, by the ranks that hold their columns */
  AS_RECV,   /* T x w: every position's row on this rank's columns */
  AS_DST,    /* the rows (or slots) written, then the positions they come from */
};

/* The host scratch of a T-token assign, carved from one allocation. */
typedef struct host {
  int64_t *tokens; /* T: the batch's tokens (a backend whose memory is not the host's) */
  int64_t *unique; /* T: the distinct tokens, ascending */
  uint32_t *seg;   /* T: each position's index in unique */
  int64_t *last;   /* T: each distinct token's last position */
  int64_t *dst;    /* 2T: the rows written, then the positions they come from */
  uint64_t *keys;  /* T: a hash-keyed table's keys, for the index */
  int64_t *before; /* T: their slots before the step (-1: absent) */
  int64_t *slots;  /* T: and after it */
  embps_hindex_fresh_t *fresh; /* T: the slots the step (re)assigned */
  void *ws;                    /* the dedup's workspace */
} host_t;

static size_t align64(size_t v) { return (v + 63) / 64 * 64; }

/* Carves *h out of e's host scratch, grown to the T-token batch's need. A failure that only this
 * rank's op suffers (a group of one) goes to op->error with EMBPS_OK; in a group it is returned,
 * which breaks the group (the others would wait in a collective), as embps__engine_reserve does. */
static embps_status_t host_reserve(embps_engine_t *e, size_t T, int hashed, embps_op_t *op,
                                   host_t *h, embps_error_t *err) {
  const size_t i64 = align64(T * sizeof(int64_t)), u32 = align64(T * sizeof(uint32_t));
  const size_t fresh = hashed ? align64(T * sizeof(embps_hindex_fresh_t)) : 0;
  /* tokens, unique, last, dst (2 arrays); hash-keyed: keys, before, slots */
  const size_t need =
      i64 * (5 + (hashed ? 3 : 0)) + u32 + fresh + align64(embps_dedup_workspace_bytes(T)) + 64;
  uint8_t *p;
  if (need > e->ascratch_cap) {
    embps_free(e->ascratch);
    if (!(e->ascratch = embps_aligned_alloc(need))) {
      e->ascratch_cap = 0;
      embps_error_set(&op->error, EMBPS_RESOURCE_EXHAUSTED,
                      "out of memory for the host scratch of a %zu-token assign of table '%s'", T,
                      embps_table_config(op->table)->name);
      if (e->comm->size == 1)
        return EMBPS_OK;
      *err = op->error;
      return err->status;
    }
    e->ascratch_cap = need;
  }
  p = e->ascratch;
  memset(h, 0, sizeof(*h));
  h->tokens = (int64_t *)p, p += i64;
  h->unique = (int64_t *)p, p += i64;
  h->last = (int64_t *)p, p += i64;
  h->dst = (int64_t *)p, p += 2 * i64; /* dst and its positions, i64 apart */
  h->seg = (uint32_t *)p, p += u32;
  if (hashed) {
    h->keys = (uint64_t *)p, p += i64;
    h->before = (int64_t *)p, p += i64;
    h->slots = (int64_t *)p, p += i64;
    h->fresh = (embps_hindex_fresh_t *)p, p += fresh;
  }
  h->ws = p;
  return EMBPS_OK;
}

/* Each distinct nonzero token of tokens[0..T) with its last position, in ascending token order:
 * dst[k] the token, dst[cap + k] the position; returns k. */
static size_t last_wins(const int64_t *tokens, size_t T, host_t *h, size_t cap) {
  size_t U = embps_dedup_cpu(tokens, T, h->unique, h->seg, h->ws), m = 0;
  for (size_t p = 0; p < T; p++) /* ascending positions: each segment ends at its last */
    h->last[h->seg[p]] = (int64_t)p;
  for (size_t s = 0; s < U; s++)
    if (h->unique[s] != 0) {
      h->dst[m] = h->unique[s];
      h->dst[cap + m] = h->last[s];
      m++;
    }
  return m;
}

/* A hash-keyed table's keys dst[0..m) become their slots, in place, with their positions at
 * dst[cap..]: the index inserts the absent ones (no admission; eviction when full). The keys given
 * no slot are dropped (*refused of them); the ones whose state must go back to the initial state
 * come first (*nreset: every key given a new slot, or every key with reset_state). Returns the
 * number of rows to write, or sets *ret to the index's failure (EMBPS_FAILED_PRECONDITION,
 * EMBPS_RESOURCE_EXHAUSTED; the index is unchanged then on this rank: the group cannot go on). */
static size_t to_slots(embps_table_t *t, host_t *h, size_t m, size_t cap, int reset_state,
                       size_t *nreset, uint64_t *refused, embps_status_t *ret) {
  embps_hindex_t *ix = embps_table_hindex(t);
  int64_t *pos = h->dst + cap;
  size_t nfresh = 0, k = 0;
  for (size_t i = 0; i < m; i++)
    h->keys[i] = (uint64_t)h->dst[i];
  embps_hindex_find(ix, h->keys, m, h->before);
  if ((*ret = embps_hindex_assign(ix, h->keys, m, h->slots, h->fresh, &nfresh)) != EMBPS_OK)
    return 0;
  embps_table_hindex_publish(t);
  /* Each key's fate in keys (no longer needed): 0 refused, 1 written with its state reset (a new
   * slot, or reset_state), 2 written alone. Then the slots go to before and the positions to
   * dst, reset ones first, and both back to their places. */
  for (size_t i = 0; i < m; i++)
    h->keys[i] = h->slots[i] < 0 ? 0 : (reset_state || h->before[i] < 0) ? 1 : 2;
  for (uint64_t fate = 1; fate <= 2; fate++) {
    if (fate == 2)
      *nreset = k;
    for (size_t i = 0; i < m; i++)
      if (h->keys[i] == fate) {
        h->before[k] = h->slots[i];
        h->dst[k++] = pos[i];
      }
  }
  memcpy(pos, h->dst, k * sizeof(int64_t));
  memcpy(h->dst, h->before, k * sizeof(int64_t));
  *refused = m - k;
  return k;
}

embps_status_t embps__engine_run_assign(embps_engine_t *e, const embps__engine_shape_t *sh,
                                        embps_op_t *op, embps_error_t *err) {
  const embps__engine_ops_t *ops = e->ops;
  embps__engine_backend_t *be = e->be;
  embps_table_t *t = op->table;
  const uint32_t N = sh->group_size;
  const size_t n = sh->n, T = sh->T, w = sh->w, W = sh->W, ds = sh->ds, block = n * w * ds;
  const int hashed = sh->hashed;
  const int64_t *htokens, *dst;
  const void *tokens = op->tokens, *rows = op->rows_in, *src;
  uint64_t refused = 0;
  size_t m, nreset;
  host_t h;
  embps_status_t ret;

  if (!ops->assign_rows || !ops->scratch || !ops->copy_in || !ops->copy_out)
    return embps_error_set(err, EMBPS_INTERNAL, "the %s backend serves no assign",
                           embps_backend_name(ops->backend));
  if ((ret = host_reserve(e, T, hashed, op, &h, err)) != EMBPS_OK || op->error.status != EMBPS_OK)
    return ret;
  if (!ops->host_memory) { /* the request's arrays into the backend's memory */
    void *d;
    EMBPS__STEP(ops->scratch(be, AS_TOKENS, n * sizeof(int64_t) + 8, &d, err));
    EMBPS__STEP(ops->copy_in(be, d, op->tokens, n * sizeof(int64_t), err));
    tokens = d;
    EMBPS__STEP(ops->scratch(be, AS_ROWS, n * W * ds + 8, &d, err));
    EMBPS__STEP(ops->copy_in(be, d, op->rows_in, n * W * ds, err));
    rows = d;
  }
  src = rows; /* a group of one: n x W, this rank's columns are all of them */
  if (N > 1) {
    void *all, *send, *recv;
    EMBPS__STEP(ops->scratch(be, AS_ALL, T * sizeof(int64_t) + 8, &all, err));
    EMBPS__STEP(embps_comm_all_gather(e->comm, tokens, n * sizeof(int64_t), all, err));
    tokens = all;
    EMBPS__STEP(ops->scratch(be, AS_SEND, N * block + 8, &send, err));
    EMBPS__STEP(ops->scratch(be, AS_RECV, N * block + 8, &recv, err));
    /* Block r of the send buffer: columns [r*w, (r+1)*w) of this shard's n rows. */
    for (uint32_t r = 0; r < N && n > 0; r++)
      EMBPS__STEP(ops->copy2d(be, (uint8_t *)send + r * block, w * ds,
                              (const uint8_t *)rows + r * w * ds, W * ds, w * ds, n, err));
    EMBPS__STEP(embps_comm_all_to_all(e->comm, send, block, recv, err));
    src = recv; /* T x w: every position's row on this rank's columns */
  }
  htokens = N == 1 ? op->tokens : tokens; /* a group of one has the batch's tokens on the host */
  if (!ops->host_memory && N > 1) {
    EMBPS__STEP(ops->copy_out(be, h.tokens, tokens, T * sizeof(int64_t), err));
    htokens = h.tokens;
  }
  m = last_wins(htokens, T, &h, T);
  nreset = op->reset_state ? m : 0;
  if (hashed) {
    m = to_slots(t, &h, m, T, op->reset_state, &nreset, &refused, &ret);
    if (ret != EMBPS_OK) {
      embps_error_set(err, ret, "the key index of table '%s' could not take an assign's step (%s)",
                      embps_table_config(t)->name, embps_status_str(ret));
      goto fail;
    }
  }
  /* The rows written at [0, m) and their positions at [T, T + m) of h.dst, in the backend's
   * memory: rows [0, nreset) with their state reset, the others without. */
  dst = h.dst;
  if (!ops->host_memory && m > 0) {
    void *d;
    EMBPS__STEP(ops->scratch(be, AS_DST, 2 * m * sizeof(int64_t) + 8, &d, err));
    EMBPS__STEP(ops->copy_in(be, d, h.dst, m * sizeof(int64_t), err));
    EMBPS__STEP(ops->copy_in(be, (int64_t *)d + m, h.dst + T, m * sizeof(int64_t), err));
    dst = d;
  }
  {
    const int64_t *pos = ops->host_memory ? h.dst + T : dst + m;
    if (nreset)
      EMBPS__STEP(ops->assign_rows(be, t, dst, pos, nreset, src, 1, err));
    if (m > nreset)
      EMBPS__STEP(ops->assign_rows(be, t, dst + nreset, pos + nreset, m - nreset, src, 0, err));
  }
  if (m > 0 && embps_table_dirty(t))
    EMBPS__STEP(ops->mark_dirty(be, t, dst, m, err));
  EMBPS__STEP(ops->finish(be, err));
  op->num_unique = m;
  op->num_refused = refused;
  op->applied = 1;
  return EMBPS_OK;
fail:
  ops->abort(be);
  return ret;
}
