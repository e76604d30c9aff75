/* The store: the tables a server holds, each a column slice of the group's table with its
 * optimizer state. The registry (names to tables) takes a lock, since the group's thread
 * registers tables that the loop thread looks up; a registered table is never moved or freed
 * before the store. A table's arrays are read and written by the group's thread only, and its
 * counters are atomics that any thread may read. */
#ifndef EMBPS_STORE_H
#define EMBPS_STORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/backend.h"
#include "common/dtype.h"
#include "common/optimizer.h"
#include "common/status.h"
#include "common/table_fields.h"
#include "server/store/hindex.h"

#define EMBPS_TABLE_NAME_MAX 128
/* The most tables a store holds: what tables take is bounded by the memory budget
 * (--max-memory-bytes); this only keeps a runaway client from growing the registry, whose lookups
 * by name walk it, without end. */
#define EMBPS_STORE_MAX_TABLES 65536u
/* Limits beyond which a table is absurd whatever the memory: they keep index arithmetic far
 * from overflow. */
#define EMBPS_MAX_ROWS (UINT64_C(1) << 40)
#define EMBPS_MAX_EMB_WIDTH 65536u

/** What a table is, as CreateTable gives it (defaults resolved by embps_table_config_resolve):
 * its name and the settings of common/table_fields.h (rows, emb_width, dtype, seed, ...). */
typedef struct embps_table_config {
  char name[EMBPS_TABLE_NAME_MAX];
  EMBPS_TABLE_FIELDS(EMBPS_TABLE_FIELD_MEMBER)
} embps_table_config_t;

/** Writes c's settings, the name apart, at p: EMBPS_TABLE_FIELDS_WIRE_BYTES bytes in the order of
 * EMBPS_TABLE_FIELDS, the layout of a checkpoint's table spec and of a control frame's create. */
void embps_table_config_put_settings(uint8_t *p, const embps_table_config_t *c);

/** Reads what embps_table_config_put_settings wrote at p into c's settings (the name untouched). */
void embps_table_config_get_settings(const uint8_t *p, embps_table_config_t *c);

typedef struct embps_table_counters {
  atomic_uint_fast64_t lookups, pushes, rows_looked_up, rows_pushed, steps_applied, steps_skipped;
  /* distinct tokens of the batches deduplicated (all ranks' shards of a batch, padding row
   * included for lookups, excluded for pushes), and how many batches those were */
  atomic_uint_fast64_t unique_tokens, unique_batches;
} embps_table_counters_t;

/** A rank's slice of a table with its optimizer state; opaque outside the store. */
typedef struct embps_table embps_table_t;

/** The arrays of a table's slice, in the memory of the engine that computes on them. */
typedef struct embps_table_arrays {
  void *data;    /* rows x shard_width of dtype */
  float *state0; /* adagrad accumulators, adam m: rows x shard_width; rowwise_adagrad: rows */
  float *state1; /* adam v: rows x shard_width */
} embps_table_arrays_t;

/**
 * Where a table's arrays live when it is not host memory (GPU memory): alloc returns `bytes`
 * of it or NULL, release frees what alloc returned (NULL is a no-op). The store keeps a copy.
 */
typedef struct embps_table_memory {
  void *(*alloc)(size_t bytes);
  void (*release)(void *p);
} embps_table_memory_t;

typedef struct embps_store embps_store_t;

/**
 * Checks a table name of len bytes (as it came off the wire: len counts every byte, a NUL
 * included): 1 to EMBPS_TABLE_NAME_MAX - 1 bytes of letters, digits, '_', '-' and '.'.
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT (err names the first byte refused).
 */
embps_status_t embps_table_name_check(const char *name, size_t len, embps_error_t *err);

/**
 * Fills defaults in cfg (dtype f32; the optimizer and hyper-parameters of common/optimizer.h's
 * EMBPS_OPTIMIZER_SERVER_DEFAULT and EMBPS_OPTIMIZER_DEFAULT_*; init_scale 1/sqrt(emb_width);
 * the kind's, embps_table_kind_resolve) and validates it: name, the kind (rows or capacity and
 * the hash-keyed options), emb_width (and its split over group_size), dtype, optimizer,
 * hyper-parameters, and the bytes (embps_table_config_bytes) against max_bytes (the rank's memory
 * budget, embps_store_budget_max: a table alone beyond it is refused before any rank is asked).
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT / EMBPS_RESOURCE_EXHAUSTED with err set.
 */
embps_status_t embps_table_config_resolve(embps_table_config_t *cfg, uint32_t group_size,
                                          uint64_t max_bytes, embps_error_t *err);

/** Bytes one row (a hash-keyed table's slot) of a table of cfg takes on one rank of a group of
 * group_size: *data_bytes for its values (shard_width elements of its dtype), *state_bytes for
 * its optimizer state (the optimizer registry's floats per element and per row). What
 * embps_table_config_bytes, and so the memory budget (--max-memory-bytes), counts per row, and
 * what `embps plan` multiplies by rows. cfg resolved; both outputs are the caller's. */
void embps_table_config_row_bytes(const embps_table_config_t *cfg, uint32_t group_size,
                                  uint64_t *data_bytes, uint64_t *state_bytes);

/** Bytes a table of cfg holds on one rank of a group of group_size: data and state of its rows
 * (a hash-keyed table's capacity slots), and a hash-keyed table's index (embps_hindex_bytes of
 * embps_table_config_hindex, replicated on every rank). cfg resolved. */
uint64_t embps_table_config_bytes(const embps_table_config_t *cfg, uint32_t group_size);

/* ---- the table's kind (table_kind.c) ---- */

/** 1 for a hash-keyed table (capacity > 0), 0 for a dense one (rows). */
int embps_table_config_hashed(const embps_table_config_t *cfg);

/**
 * The kind's part of embps_table_config_resolve, which calls it before anything else it checks:
 * for a dense table (capacity 0), refuses every hash-keyed option (admit_after above 1,
 * eviction, half_life_steps, ttl_steps, sketch_width) and stores admit_after 1 as 0; for a
 * hash-keyed one, refuses rows, a capacity above EMBPS_HINDEX_MAX_CAPACITY, an eviction policy
 * not in common/eviction.h, admit_after above EMBPS_HINDEX_MAX_ADMIT_AFTER, half_life_steps
 * without lfu (or lfu without it), ttl_steps without ttl (or ttl without it), sketch_width with
 * admit_after 1 or above EMBPS_HINDEX_MAX_SKETCH_WIDTH, and fills the defaults in (admit_after 1,
 * eviction lru, sketch_width embps_table_sketch_width_default when admit_after > 1). Returns
 * EMBPS_OK or EMBPS_INVALID_ARGUMENT with err naming the field and the remedy.
 */
embps_status_t embps_table_kind_resolve(embps_table_config_t *cfg, embps_error_t *err);

/** The default sketch_width of a hash-keyed table with admission: the least power of two >=
 * capacity, at most EMBPS_HINDEX_MAX_SKETCH_WIDTH. */
uint32_t embps_table_sketch_width_default(uint64_t capacity);

/** The configuration of a hash-keyed table's index (cfg resolved). */
void embps_table_config_hindex(const embps_table_config_t *cfg, embps_hindex_config_t *out);

/** The rows a table of cfg stores: rows for a dense table, capacity (its slots) for a hash-keyed
 * one. The store, the engine and the checkpoints size, copy and write a table by this count, so a
 * hash-keyed table's slots are rows like a dense table's. */
uint64_t embps_table_config_rows(const embps_table_config_t *cfg);

/** Creates an empty store (this rank's tables; each table knows its own column slice). On
 * failure *out is untouched. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps_store_new(embps_store_t **out);
/** Frees the store and every table's arrays. NULL is a no-op. */
void embps_store_free(embps_store_t *store);

/**
 * Allocates and initializes rank `rank`'s slice of a table of a group of group_size in host
 * memory, with its optimizer state (cfg already resolved): rows from embps_init_value,
 * accumulators at initial_accumulator, moments at 0. On failure *out is untouched. Returns
 * EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_table_new(embps_table_t **out, const embps_table_config_t *cfg, uint32_t rank,
                               uint32_t group_size);

/**
 * Like embps_table_new, but the arrays come from `mem` (NULL: host memory) and are left
 * uninitialized, for an engine that initializes them where they live (see
 * embps_table_initial_state) or a restore that overwrites them. On failure *out is
 * untouched. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_table_new_in(embps_table_t **out, const embps_table_config_t *cfg,
                                  uint32_t rank, uint32_t group_size,
                                  const embps_table_memory_t *mem);

/** The value state0 starts at (adagrad's initial accumulator; 0 for adam) and the number of
 * elements of state0 and state1 (0 where the optimizer has none). */
void embps_table_initial_state(const embps_table_t *table, float *state0_value,
                               size_t *state0_elems, size_t *state1_elems);

/** Bytes of each of the slice's arrays: data, state0, state1 (0 where it has none). */
void embps_table_array_bytes(const embps_table_t *table, size_t bytes[3]);

/** The table's configuration (resolved). */
const embps_table_config_t *embps_table_config(const embps_table_t *table);
/** This rank's slice: its first column and its width. */
uint32_t embps_table_col_begin(const embps_table_t *table);
uint32_t embps_table_shard_width(const embps_table_t *table);
/** Bytes of data and state this rank holds. */
uint64_t embps_table_bytes(const embps_table_t *table);
/** The table's counters: atomics that any thread may update and read. */
embps_table_counters_t *embps_table_counters(embps_table_t *table);
/** The slice's arrays, for the engine (the group's thread only). */
embps_table_arrays_t embps_table_arrays(const embps_table_t *table);
/** Counts one more applied optimizer step and returns the count (adam's bias correction). */
uint64_t embps_table_next_step(embps_table_t *table);
/** The steps applied so far, and setting them (a restored table continues its count). */
uint64_t embps_table_step(const embps_table_t *table);
void embps_table_set_step(embps_table_t *table, uint64_t step);

/* Dirty rows, for incremental checkpoints: once tracking is on, the engine marks every row it
 * writes, and a checkpoint takes the marks (and clears them) when it captures the table. The
 * bitmap is host memory of ceil(rows / 64) words, bit (r % 64) of word r / 64 for row r; the
 * group's thread alone touches it. */

/** Turns tracking on with every row clean. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps_table_track_dirty(embps_table_t *table);
/** The bitmap; NULL while tracking is off. */
uint64_t *embps_table_dirty(embps_table_t *table);
/** Marks rows[0..n) (host memory) dirty; a no-op while tracking is off. */
void embps_table_mark_dirty(embps_table_t *table, const int64_t *rows, size_t n);
/**
 * The marks' second bitmap, in the memory the table's arrays live in (GPU memory), of as many
 * words: an engine that writes rows there marks them there, without a copy to the host per
 * write, and ORs these marks into the host bitmap (clearing them) when it copies the table out
 * for a checkpoint's capture. NULL until embps_table_device_dirty_new, and once tracking stops.
 */
uint64_t *embps_table_device_dirty(const embps_table_t *table);
/**
 * Allocates that bitmap from the table's memory; its contents are undefined until the engine
 * clears it. Sets *out (also when it exists already). Returns EMBPS_OK, EMBPS_FAILED_PRECONDITION
 * (tracking is off, or the table is in host memory), EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_table_device_dirty_new(embps_table_t *table, uint64_t **out);
/** Words in the bitmap of a table of `rows` rows. */
size_t embps_dirty_words(uint64_t rows);

/* Copy-on-write snapshots, for checkpoints of tables in host memory: the snapshot is the table
 * as it is at begin, but the copying happens later, block by block, on whichever thread gets to
 * a block first: the checkpoint writer (embps_table_snapshot_complete) or the engine just before
 * it writes a row (embps_table_before_write). The group's thread thus pauses for no copy of the
 * whole table, only for the blocks of the rows a batch writes while a snapshot is open. */

/**
 * Group thread: opens a snapshot of t into `into` (host arrays sized as the table's). Blocks
 * without a row set in `only` (a dirty-row bitmap; NULL: every row) are not copied. Returns
 * EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED, or EMBPS_FAILED_PRECONDITION while one is open.
 */
embps_status_t embps_table_snapshot_begin(embps_table_t *table, const embps_table_arrays_t *into,
                                          const uint64_t *only);
/** Engine, on the group's thread, before it writes rows[0..n) (host memory): copies their blocks
 * into the open snapshot first. Costs one atomic load when none is open. */
void embps_table_before_write(embps_table_t *table, const int64_t *rows, size_t n);
/** Any thread (the checkpoint writer): copies every block not yet copied and closes the
 * snapshot; `into` then holds the table as it was at begin. A no-op when none is open. */
void embps_table_snapshot_complete(embps_table_t *table);
/** Closes the snapshot without finishing it (its checkpoint was dropped); only while no other
 * thread may be completing it. */
void embps_table_snapshot_cancel(embps_table_t *table);

/* ---- a hash-keyed table's index ---- */

/** The key -> slot index of a hash-keyed table (made empty with the table from its config, on
 * every rank), owned by the table; NULL for a dense table and once the table was dropped. The
 * group's thread alone steps it and reads it (embps_hindex_find included); other threads read
 * its counters through embps_table_hindex_stats. */
embps_hindex_t *embps_table_hindex(const embps_table_t *table);

/** Replaces a hash-keyed table's index with ix (a restore's, decoded from a checkpoint), which
 * the table owns from now on; frees the one it had, and publishes ix's counters. Group thread. */
void embps_table_set_hindex(embps_table_t *table, embps_hindex_t *ix);

/** Group thread, after each step of the index: copies its counters where any thread reads them
 * (embps_table_hindex_stats). */
void embps_table_hindex_publish(embps_table_t *table);

/** Any thread: the index's counters as last published (all 0 for a dense table). */
void embps_table_hindex_stats(const embps_table_t *table, embps_hindex_stats_t *st);

/** Frees a table that was never registered. NULL is a no-op. */
void embps_table_free(embps_table_t *table);

/**
 * Registers a table; the store takes ownership on success. Returns EMBPS_ALREADY_EXISTS for a
 * taken name, EMBPS_RESOURCE_EXHAUSTED beyond EMBPS_STORE_MAX_TABLES or out of memory (err says
 * which).
 */
embps_status_t embps_store_add(embps_store_t *store, embps_table_t *table, embps_error_t *err);

/** The table named name; NULL when there is none. */
embps_table_t *embps_store_find(const embps_store_t *store, const char *name);

/** Number of tables and the i-th one (registration order). The group's thread alone may rely on
 * an index staying put (it is the thread that drops tables); other threads use
 * embps_store_list. */
size_t embps_store_count(const embps_store_t *store);
embps_table_t *embps_store_at(const embps_store_t *store, size_t i);

/** Any thread: copies up to cap of the registered tables (registration order) to out and returns
 * how many it copied. The pointers stay valid until embps_store_free, even if a table is
 * dropped meanwhile (see embps_store_drop). */
size_t embps_store_list(const embps_store_t *store, embps_table_t **out, size_t cap);

/**
 * Group thread: unregisters table t and frees its arrays (completing first a copy-on-write
 * snapshot a checkpoint writer may still be reading). What other threads may still point to
 * stays: the table keeps its config and counters, answers embps_table_dropped with 1, and is
 * freed with the store, so an op validated before the drop sees that it was dropped instead of
 * freed memory. The budget gets the table's bytes back. Returns EMBPS_OK, or EMBPS_NOT_FOUND
 * when t is not registered.
 */
embps_status_t embps_store_drop(embps_store_t *store, embps_table_t *t);

/** Any thread: 1 once t was dropped (embps_store_drop), else 0. */
int embps_table_dropped(const embps_table_t *t);

/** The group-wide identity of a registered table: every rank numbers its tables in the order it
 * registers them, which is the group's round order, so a table has the same id on every rank and
 * a table created again under a dropped one's name has another id. 0 for an unregistered one. */
uint64_t embps_table_id(const embps_table_t *t);

/* ---- the memory budget ---------------------------------------------------------------------- */

/**
 * Sets the budget of table memory on this rank (--max-memory-bytes): CreateTable keeps the sum
 * over tables of embps_table_bytes times (1 + snapshot_copies) within max_bytes.
 * snapshot_copies is 1 when every table has a checkpoint snapshot buffer of its size in the same
 * memory (the CPU backend with checkpoints on), else 0.
 */
void embps_store_set_budget(embps_store_t *store, uint64_t max_bytes, uint32_t snapshot_copies);

/** What the budget counts for a table of `bytes` (embps_table_bytes), its in use sum and its
 * limit. Any thread. */
uint64_t embps_store_budget_cost(const embps_store_t *store, uint64_t bytes);
uint64_t embps_store_budget_used(const embps_store_t *store);
uint64_t embps_store_budget_max(const embps_store_t *store);

#endif
