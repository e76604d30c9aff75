/* embps kernels: pure compute on arrays, no I/O, no allocation inside the hot loops, nothing
 * from the layers above. Every kernel has a CPU reference (the `_cpu` functions below); a CUDA
 * launcher with the same contract sits beside it when the GPU backend is built.
 *
 * Conventions shared by every kernel:
 * - A table slice is `num_rows x width` elements of `dtype` (f32 or bf16), row-major, with a
 *   row stride of `width` elements. In a shard group each rank holds a column slice of every
 *   table, so `width` here is the slice's width (shard_width) and `full_width` (emb_width) is
 *   the table's.
 * - Gradients handed to the updates are f32 (optimizer math is always f32); storage is
 *   converted to and from bf16 with round-to-nearest-even.
 * - Token ids are int64; the caller has validated them against the table's rows.
 * - Determinism: every result is a function of the inputs alone; sums run in a fixed order. */
#ifndef EMBPS_KERNELS_H
#define EMBPS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/optimizer.h"

/* ---- prefetch (for the kernels' own use) ----------------------------------------------------- */

/* Updates touch rows at random; fetching the row a few iterations ahead hides the miss that
 * otherwise stalls every read-modify-write. Measured on this project's 2-core VM, rowwise
 * Adagrad over 4096 random rows of 128 f32 in a 100 MB table, best of 50: 0.56 ms without
 * prefetch, 0.34-0.39 ms at 4, 8 or 16 rows ahead (within noise of each other). The sgd,
 * adagrad and adam updates prefetch their rows of state too (the same distance): one program
 * with the old and new forms side by side, distinct random rows of a 1M x 128 f32 table on huge
 * pages, caches evicted, interleaved, medians of 21 (65536 rows) and 41 (4096), ns per row old ->
 * new: sgd 235 -> 134 and 127 -> 58, adagrad 510 -> 309 and 280 -> 138, adam 610 -> 381 and
 * 288 -> 171. */
#define EMBPS_PREFETCH_ROWS 8

static inline void embps_prefetch_row(const void *row, size_t bytes, const void *state) {
  for (size_t off = 0; off < bytes; off += 64)
    __builtin_prefetch((const char *)row + off, 1, 0);
  if (state)
    __builtin_prefetch(state, 1, 0);
}

/* The same for a row that is written and then read again soon (a segment sum's accumulator):
 * into every cache level (locality 3) rather than once (locality 0). */
static inline void embps_prefetch_row_kept(const void *row, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64)
    __builtin_prefetch((const char *)row + off, 1, 3);
}

/* ---- dedup -------------------------------------------------------------------------------- */

/** Bytes of scratch that embps_dedup_cpu needs for n tokens. */
size_t embps_dedup_workspace_bytes(size_t n);

/**
 * Deduplicates a batch of tokens.
 * Writes the distinct tokens to `unique` in ascending order and, for every position i, the
 * index of tokens[i] in `unique` to segment_ids[i]. `unique` must hold n entries; `workspace`
 * must hold embps_dedup_workspace_bytes(n) bytes, aligned for uint64_t. n must be below
 * 2^32 (segment ids are uint32). Returns the number of distinct tokens.
 * Token 0 (padding) is deduplicated like any other token: the caller skips it.
 */
size_t embps_dedup_cpu(const int64_t *tokens, size_t n, int64_t *unique, uint32_t *segment_ids,
                       void *workspace);

/**
 * embps_dedup_cpu that also writes, with order and starts not NULL, the positions sorted by
 * token, ascending within a token (order, n entries), and where each distinct token's run
 * begins in order (starts, num_unique + 1 entries: token u's positions are
 * order[starts[u] .. starts[u + 1])). Returns the number of distinct tokens.
 */
size_t embps_dedup_sorted_cpu(const int64_t *tokens, size_t n, int64_t *unique,
                              uint32_t *segment_ids, uint32_t *order, uint32_t *starts,
                              void *workspace);

/* ---- gather ------------------------------------------------------------------------------- */

/**
 * Copies rows `rows[0..n)` of `table` (num_rows x width of dtype) to `out` (n x width of the
 * same dtype), in order.
 */
void embps_gather_cpu(const void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                      size_t n, void *out);

/**
 * Like embps_gather_cpu, but row i of out is row segment_ids[i] of `src`: expands unique rows
 * back to a batch (out has n rows). `src` holds the unique rows (num_unique x width).
 */
void embps_expand_cpu(const void *src, embps_dtype_t dtype, size_t width,
                      const uint32_t *segment_ids, size_t n, void *out);

/* ---- segment sum ---------------------------------------------------------------------------- */

/**
 * Sums gradient rows that share a segment: out[s] = sum over i with segment_ids[i] == s of
 * grads[i], in ascending i, accumulated in f32. grads is n x width of dtype (f32 or bf16); out
 * is num_unique x width f32 and is overwritten.
 */
void embps_segment_sum_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                           const uint32_t *segment_ids, size_t n, size_t num_unique, float *out);

/** Bytes of scratch that embps_segment_sum_stats_cpu needs for num_unique segments. */
size_t embps_segment_sum_stats_workspace_bytes(size_t num_unique);

/**
 * embps_segment_sum_cpu fused with embps_row_partials_cpu of its output, in one pass: out is
 * bitwise what embps_segment_sum_cpu writes, and partials (num_unique x width / block) what
 * embps_row_partials_cpu(out, num_unique, width, block, partials) then writes (nothing when
 * block is 0). grads may have any alignment (it is read as bytes); out must not overlap it.
 * workspace holds embps_segment_sum_stats_workspace_bytes(num_unique) bytes, aligned for
 * uint32_t. segment_ids must take every value in [0, num_unique) (as embps_dedup_cpu's do).
 */
void embps_segment_sum_stats_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                 const uint32_t *segment_ids, size_t n, size_t num_unique,
                                 size_t block, float *out, float *partials, void *workspace);

/**
 * embps_segment_sum_stats_cpu for the segments [seg_lo, seg_hi) alone: their rows of out and
 * partials, and their entries of the workspace (which holds num_unique counts, as there), are
 * written, nothing else. Calls over disjoint ranges may run at once on other threads with the
 * same out, partials and workspace, and together write exactly what one call over
 * [0, num_unique) writes, bit for bit (each segment's sum keeps its order).
 */
void embps_segment_sum_stats_range_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                       const uint32_t *segment_ids, size_t n, size_t num_unique,
                                       size_t block, float *out, float *partials, void *workspace,
                                       size_t seg_lo, size_t seg_hi);

/**
 * Where position i of a feature push takes its gradient row from, for
 * embps_segment_sum_bags_range_cpu: the push's own row (EMBPS_BAG_OWN: a feature without pooling
 * sent one per id), zeros (EMBPS_BAG_PAD: padding id 0), or bag `bag` of the pooled gradients
 * as it is (EMBPS_BAG_SUM), times `factor` (EMBPS_BAG_WEIGHTED: the id's weight) or divided by
 * it (EMBPS_BAG_MEAN: the bag's nonzero ids): embps_expand_bags_cpu's row for that position.
 */
typedef enum embps_bag_mode {
  EMBPS_BAG_OWN = 0,
  EMBPS_BAG_PAD = 1,
  EMBPS_BAG_SUM = 2,
  EMBPS_BAG_WEIGHTED = 3,
  EMBPS_BAG_MEAN = 4
} embps_bag_mode_t;

typedef struct embps_bag_source {
  uint32_t mode; /* an embps_bag_mode_t */
  uint32_t bag;  /* the bag's row of the pooled gradients */
  float factor;
} embps_bag_source_t;

/**
 * The sources of num_bags bags' positions (bags as embps_expand_bags_cpu's; out[p] for each
 * position p of bag k): bag first_bag + k, with what embps_expand_bags_cpu does to it there
 * (weights not NULL: weighted; mean: over the bag's nonzero ids; id 0: padding). With offsets
 * NULL, the n positions out[0..n) take their own rows (EMBPS_BAG_OWN) instead.
 */
void embps_bag_sources_cpu(const int64_t *ids, const float *weights, const int64_t *offsets,
                           size_t num_bags, int mean, uint32_t first_bag, size_t n,
                           embps_bag_source_t *out);

/**
 * The counting form of embps_dedup_sorted_cpu, in steps that threads can share (the CPU
 * engine's, on a big push; kernels/dedup.c says when it pays). embps_dedup_counting_cpu says
 * whether tokens[0..n) take it with `parts` parts: their keys span fewer than 2n values and
 * (parts + 1) uint32 arrays of that span (*range, from key *kmin) fit the dedup workspace of n;
 * returns 0 when not (then embps_dedup_sorted_cpu). The workspace then holds parts count arrays
 * of range entries, then one of range segments. Part p of P covers the positions
 * [n p / P, n (p + 1) / P): embps_dedup_count_cpu counts its keys into its array (any part on any
 * thread); embps_dedup_buckets_cpu, on one thread once every part is counted, writes unique and
 * starts (NULL: not written), the segments of the keys present, and turns each count into its
 * part's first place (returns the number of distinct tokens); embps_dedup_place_cpu then writes
 * each part's segment ids and order (NULL: not written), parts on any threads. The results are
 * embps_dedup_sorted_cpu's, bit for bit, for any number of parts.
 */
int embps_dedup_counting_cpu(const int64_t *tokens, size_t n, size_t parts, uint64_t *kmin,
                             size_t *range);
void embps_dedup_count_cpu(const int64_t *tokens, size_t lo, size_t hi, uint64_t kmin, size_t range,
                           uint32_t *counts);
size_t embps_dedup_buckets_cpu(uint32_t *counts, size_t parts, size_t range, uint64_t kmin,
                               int64_t *unique, uint32_t *starts, uint32_t *seg);
void embps_dedup_place_cpu(const int64_t *tokens, size_t lo, size_t hi, uint64_t kmin,
                           uint32_t *next, const uint32_t *seg, uint32_t *segment_ids,
                           uint32_t *order);

/**
 * embps_segment_sum_stats_range_cpu over the gradients that embps_expand_bags_cpu (rounded to
 * dtype) would give position i from sources[i], without writing them: a position whose source
 * is EMBPS_BAG_OWN reads row i of grads (one row of width elements of dtype per position, any
 * alignment; NULL when no position does), any other one its bag's row of bags (f32, width per
 * row, at any alignment too: a request's bytes field). Segment s is the positions order[starts[s]
 * .. starts[s + 1]), ascending (embps_dedup_sorted_cpu's). out and partials are bitwise those of
 * expanding every position first and summing the expanded rows with embps_segment_sum_stats_cpu.
 * Calls over disjoint ranges may run at once on other threads with the same out and partials.
 */
void embps_segment_sum_bags_range_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                      const float *bags, const embps_bag_source_t *sources,
                                      const uint32_t *order, const uint32_t *starts, size_t block,
                                      float *out, float *partials, size_t seg_lo, size_t seg_hi);

/* ---- row statistics: finite check, norm, rowwise mean square -------------------------------- */

/** Columns per row-statistics block: partial sums of squares are taken over blocks of this many
 * columns, the same blocks whichever rank holds them (see row_stats.c). */
#define EMBPS_ROW_STATS_BLOCK 32

/**
 * The block a slice of `width` columns uses: EMBPS_ROW_STATS_BLOCK when it divides width,
 * otherwise their greatest common divisor (so blocks never straddle two ranks' slices). A group
 * whose shard width is a multiple of EMBPS_ROW_STATS_BLOCK gets row sums bitwise equal to one
 * rank's; other groups get the same sums to rounding. 0 for width 0.
 */
size_t embps_row_stats_block(size_t width);

/** A block's double sum of squares as the partial that is exchanged: rounded to f32, and
 * FLT_MAX instead of infinity when the sum is finite. */
float embps_row_stats_partial(double sumsq);

/**
 * Per-block sums of squares of an n x width f32 array g: partials[i * nb + b], nb = width /
 * block, is the sum of squares of row i's columns [b * block, (b + 1) * block), in double,
 * through embps_row_stats_partial. block must divide width (embps_row_stats_block does).
 */
void embps_row_partials_cpu(const float *g, size_t n, size_t width, size_t block, float *partials);

/** embps_row_partials_cpu of one f32 row at any alignment (read as bytes): its width / block
 * partials, the same bits. */
void embps_row_partials_at_cpu(const void *row, size_t width, size_t block, float *partials);

/**
 * Combines the partials of `slices` column slices in column order. partials holds slice r's
 * n x nb partials at partials + r * n * nb (what an all-gather of every rank's partials gives).
 * Row i's sum is the double sum of its partials, slice by slice and block by block; its f32
 * rounding goes to row_sumsq[i] (when not NULL), and the sum of the rows' sums in row order is
 * ADDED to *total_sumsq (when not NULL). Returns the number of rows whose sum is not finite:
 * the rows holding a NaN or an infinity.
 */
size_t embps_row_combine_cpu(const float *partials, size_t slices, size_t n, size_t nb,
                             float *row_sumsq, double *total_sumsq);

/**
 * The combine's first half, for n rows of a group's owner: sums[i] (n entries) is row i's double
 * sum of the partials of `slices` column slices, slice r's row i at partials + (r * stride + i) *
 * nb (what an all-to-all of blocks of stride rows gives; n <= stride), added slice by slice and
 * block by block: the sum embps_row_combine_cpu takes, bit for bit.
 */
void embps_row_sums_cpu(const float *partials, size_t slices, size_t stride, size_t n, size_t nb,
                        double *sums);

/**
 * The combine's second half, on the rows' double sums (n, in row order): row_sumsq[i] (when not
 * NULL) is sums[i] rounded to f32, the sum of sums in row order is ADDED to *total_sumsq (when
 * not NULL), and the return value is the number of sums that are not finite. With the sums of
 * embps_row_sums_cpu, every output is embps_row_combine_cpu's bit for bit.
 */
size_t embps_row_finish_cpu(const double *sums, size_t n, float *row_sumsq, double *total_sumsq);

/* ---- fused optimizer updates ---------------------------------------------------------------- */

/* The optimizer kinds are common/optimizer.h's embps_optimizer_t. */

/** Hyper-parameters, resolved (no zero-means-default here). */
typedef struct embps_opt_params {
  float lr;
  float eps;
  float decay;   /* accumulator decay per step: exp(-ln2 / half_life), 1 without half-life */
  float beta1;   /* adam */
  float beta2;   /* adam */
  uint64_t step; /* adam: 1-based count of applied steps, this one included (0 acts as 1) */
} embps_opt_params_t;

/** decay for a half-life in steps; 1 when half_life <= 0. */
float embps_opt_decay_from_half_life(float half_life);

/**
 * Every update below works on the rows `rows[0..n)` of a table slice (num_rows x width of
 * dtype) with gradient rows `grad` (n x width f32, already summed over duplicates, one per
 * distinct row: rows holds no duplicates; a dense table's caller leaves its padding row 0 out, a
 * hash-keyed table's slot 0 is a row like any other). State arrays are indexed by the
 * table row (the same row numbers as the table). Weight decay is not part of the updates: the
 * caller adds it to the gradient first with embps_apply_weight_decay_cpu, so that row figures
 * (rowwise Adagrad's mean square) see the same gradient as the update.
 */

/** w -= lr * g. */
void embps_update_sgd_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                          size_t n, const float *grad, const embps_opt_params_t *p);

/** Element-wise Adagrad. accum: num_rows x width f32.
 * a = a*decay + g^2; w -= lr * g / (sqrt(a) + eps). */
void embps_update_adagrad_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                              size_t n, const float *grad, float *accum,
                              const embps_opt_params_t *p);

/**
 * Row-wise Adagrad. accum: num_rows f32 (one per row).
 * row_sumsq[i] is the sum over the row's full width (all column slices) of g^2; full_width is
 * the table's emb_width. a = a*decay + row_sumsq[i] / full_width; w -= lr * g / (sqrt(a) + eps).
 * The caller computes row_sumsq with embps_row_partials_cpu and embps_row_combine_cpu (in a
 * group, over every rank's partials).
 */
void embps_update_rowwise_adagrad_cpu(void *table, embps_dtype_t dtype, size_t width,
                                      const int64_t *rows, size_t n, const float *grad,
                                      const float *row_sumsq, size_t full_width, float *accum,
                                      const embps_opt_params_t *p);

/**
 * Adam with bias correction by the table's step count p->step. m, v: num_rows x width f32.
 * m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
 * w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps).
 */
void embps_update_adam_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                           size_t n, const float *grad, float *m, float *v,
                           const embps_opt_params_t *p);

/**
 * g[i] += weight_decay * w[rows[i]] for every row (no-op when weight_decay == 0), so that the
 * caller can take row statistics of the decayed gradient before the update.
 */
void embps_apply_weight_decay_cpu(const void *table, embps_dtype_t dtype, size_t width,
                                  const int64_t *rows, size_t n, float *grad, float weight_decay);

/* ---- row marks ---------------------------------------------------------------------------- */

/**
 * Sets bit (r % 64) of bits[r / 64] for every row r in rows[0..n): a bitmap of the rows a batch
 * wrote (incremental checkpoints' dirty rows). Other bits are left as they are; rows may repeat
 * and come in any order. Every rows[i] is >= 0 and within the bitmap's words.
 */
void embps_mark_rows_cpu(uint64_t *bits, const int64_t *rows, size_t n);

/* ---- initializer -------------------------------------------------------------------------- */

/**
 * The deterministic initial value of element (row, col) of a table: uniform in
 * [-scale, scale), a function of (seed, row, col) alone, so every shard count gives the same
 * table. Row 0 (padding) is 0.
 */
float embps_init_value(uint64_t seed, uint64_t row, uint64_t col, float scale);

/**
 * Fills rows [row_begin, row_end) of a table slice holding columns [col_begin,
 * col_begin + width) with embps_init_value (converted to dtype). Row r is at element r * width
 * of `table` (table points at the slice's row 0, as everywhere else here).
 */
void embps_init_rows_cpu(void *table, embps_dtype_t dtype, size_t width, uint64_t row_begin,
                         uint64_t row_end, uint64_t col_begin, uint64_t seed, float scale);

/**
 * Writes at `row` (width elements of dtype) the initial row that row number `key` of a table
 * slice holding columns [col_begin, col_begin + width) has: embps_init_value(seed, key, col,
 * scale) for each column (zeros for key 0). A hash-keyed table's key reads and starts from it,
 * so a key reads what a dense table's row of that number would. `row` need not be aligned
 * (a lookup writes it straight into its reply, behind a header of any length).
 */
void embps_init_key_row_cpu(void *row, embps_dtype_t dtype, size_t width, uint64_t key,
                            uint64_t col_begin, uint64_t seed, float scale);

/* ---- feature batches' bags ---------------------------------------------------------------- */

/**
 * Pools num_bags bags of a table slice (width columns of dtype) into f32 rows: bag k is the ids
 * at positions [offsets[k], offsets[k + 1]) of ids (offsets ascending, num_bags + 1 of them), and
 * out[k] is the sum, over its ids that are not 0, of the id's row times weights[p] (NULL: no
 * weights), in position order, in f32; with mean set, divided by the bag's nonzero ids (a bag with
 * none: zeros). Position p's row is the slice's row rows[p] (a dense table passes its ids; a
 * hash-keyed one its slots), or where rows[p] is -1 the initial row of key ids[p]
 * (embps_init_key_row_cpu over columns [col_begin, col_begin + width), in dtype). tmp holds
 * 2 x width floats of scratch.
 */
void embps_pool_bags_cpu(const void *table, embps_dtype_t dtype, size_t width, const int64_t *ids,
                         const int64_t *rows, const float *weights, const int64_t *offsets,
                         size_t num_bags, int mean, float *out, float *tmp, uint64_t col_begin,
                         uint64_t seed, float scale);

/**
 * Expands num_bags bag gradients g (num_bags x width f32) to their ids (bags as
 * embps_pool_bags_cpu's): for each position p of bag k, out's row p (width elements of dtype) is
 * bag k's gradient times weights[p] (weights not NULL), or divided by the bag's nonzero ids
 * (mean), or itself, rounded once to dtype; an id 0's row is zeros. Rows of positions in no bag
 * are not written.
 */
void embps_expand_bags_cpu(const float *g, size_t width, const int64_t *ids, const float *weights,
                           const int64_t *offsets, size_t num_bags, int mean, embps_dtype_t dtype,
                           void *out);

/* ---- hash-keyed tables ------------------------------------------------------------------- */

/**
 * A hash-keyed table's rows by slot: out[i] (width elements of dtype) = row slots[i] of the
 * slice `table` where slots[i] >= 0, else the initial row of key keys[i] (keys are 64-bit bit
 * patterns; embps_init_key_row_cpu over columns [col_begin, col_begin + width): zeros for key
 * 0). n rows; out need not be aligned.
 */
void embps_hash_gather_cpu(const void *table, embps_dtype_t dtype, size_t width,
                           const int64_t *keys, const int64_t *slots, size_t n, void *out,
                           uint64_t col_begin, uint64_t seed, float scale);

/** Entries of embps_hash_seen_t (a power of two). */
#define EMBPS_HASH_SEEN_BITS 12

/** One absent key whose initial row a gather wrote, and where (embps_hash_gather_seen_cpu). */
typedef struct embps_hash_seen_entry {
  uint64_t key;
  const void *row;
  uint32_t gen; /* the run it belongs to: the entry is empty unless it equals the table's gen */
} embps_hash_seen_entry_t;

/** What a run of gathers remembers of the absent keys it computed: the caller's, zeroed before
 * its first use; embps_hash_seen_restart starts each run. */
typedef struct embps_hash_seen {
  uint32_t gen;
  embps_hash_seen_entry_t e[1u << EMBPS_HASH_SEEN_BITS];
} embps_hash_seen_t;

/** Starts a new run of seen: every entry is forgotten (O(1), but for a clear every 2^32 runs). */
void embps_hash_seen_restart(embps_hash_seen_t *seen);

/**
 * embps_hash_gather_cpu as one call of a run (embps_hash_seen_restart starts one): a key without
 * a slot whose row this call or an earlier call of the run wrote gets a copy of that row (the
 * rows of the run's earlier calls must still be where they were written, unchanged), and every
 * other such key's row is remembered in seen (a direct-mapped table: a colliding key replaces an
 * entry). The same bits as embps_hash_gather_cpu.
 */
void embps_hash_gather_seen_cpu(const void *table, embps_dtype_t dtype, size_t width,
                                const int64_t *keys, const int64_t *slots, size_t n, void *out,
                                uint64_t col_begin, uint64_t seed, float scale,
                                embps_hash_seen_t *seen);

/**
 * Resets slots[0..n) (distinct, each >= 0) of a hash-keyed table's slice to the initial state of
 * their new keys keys[0..n): row slots[i] of `table` becomes keys[i]'s initial row (as
 * embps_init_key_row_cpu), its state0_width floats of state0 (0: no state0; 1: one per row, as
 * rowwise Adagrad; width: one per element) become state0_value, and its width floats of state1
 * (NULL: none) become 0.
 */
void embps_hash_reset_cpu(void *table, embps_dtype_t dtype, size_t width, float *state0,
                          size_t state0_width, float *state1, float state0_value,
                          const int64_t *slots, const int64_t *keys, size_t n, uint64_t col_begin,
                          uint64_t seed, float scale);

/* ---- rows written as given (kernels/assign.c) --------------------------------------------- */

/**
 * Writes rows as given (an Assign): for i in [0, n), row rows[i] of `table` (width elements of
 * dtype) becomes row src_rows[i] of src (rows of width elements of dtype, back to back), bit for
 * bit. rows are distinct and >= 0 (every element has one writer); src_rows may repeat. With
 * state0_width (0: no state0; 1: one per row; width: one per element) the rows' state0 become
 * state0_value, and with state1 (NULL: none) their width floats of state1 become 0: the
 * optimizer's initial state, as embps_hash_reset_cpu leaves it. src needs no alignment.
 */
void embps_assign_rows_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                           const int64_t *src_rows, size_t n, const void *src, float *state0,
                           size_t state0_width, float *state1, float state0_value);

#endif
