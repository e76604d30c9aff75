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

#include "common/status.h"
#include "kernels/embps_kernels.h"

#define EMBPS_TABLE_NAME_MAX 128
/* Limits beyond which a table is absurd whatever the memory: they keep index arithmetic far
 * from overflow. */
#define EMBPS_MAX_ROWS (UINT64_C(1) << 40)
#define EMBPS_MAX_EMB_WIDTH 65536u

/** What a table is, as CreateTable gives it (defaults resolved by embps_table_config_resolve). */
typedef struct embps_table_config {
  char name[EMBPS_TABLE_NAME_MAX];
  uint64_t rows;
  uint32_t emb_width;
  embps_dtype_t dtype;
  uint64_t seed;
  float init_scale;
  embps_optimizer_t optimizer;
  float lr, eps, half_life, initial_accumulator, weight_decay, beta1, beta2;
} embps_table_config_t;

typedef struct embps_table_counters {
  atomic_uint_fast64_t lookups, pushes, rows_looked_up, rows_pushed, steps_applied, steps_skipped;
} embps_table_counters_t;

typedef struct embps_table {
  embps_table_config_t config;
  uint32_t col_begin;   /* first column of this rank's slice */
  uint32_t shard_width; /* columns in this rank's slice */
  void *data;           /* rows x shard_width of dtype */
  float *state0;        /* adagrad/adam m: rows x shard_width; rowwise_adagrad: rows */
  float *state1;        /* adam v: rows x shard_width */
  uint64_t step;        /* applied steps (adam's bias correction) */
  uint64_t bytes;       /* data and state bytes */
  int on_device;        /* data and state live in GPU memory (the CUDA engine's tables) */
  /** Frees data and state when they are not host memory from embps_malloc (set by the engine
   * that allocated them); NULL for host tables. */
  void (*release_arrays)(struct embps_table *table);
  embps_table_counters_t counters;
} embps_table_t;

typedef struct embps_store embps_store_t;

/** Optimizer names as the CLI and messages spell them ("rowwise_adagrad"). */
const char *embps_optimizer_name(embps_optimizer_t opt);

/** One entry of the optimizer registry: what each optimizer supports. */
typedef struct embps_optimizer_info {
  embps_optimizer_t kind;
  const char *name;
  int state_per_element; /* float state arrays of rows x shard_width */
  int state_per_row;     /* float state arrays of rows */
  int fused_cpu;         /* a fused table update exists on the CPU backend (async allowed) */
  int fused_cuda;        /* likewise on the CUDA backend */
} embps_optimizer_info_t;

/** Whether optimizer opt has a fused table update on the named backend ("cpu", "cuda"), which
 * async pushes require. */
int embps_optimizer_has_fused_update(embps_optimizer_t opt, const char *backend);

/** The registry entry for an optimizer; NULL for an unknown one. */
const embps_optimizer_info_t *embps_optimizer_info(embps_optimizer_t opt);

/**
 * Fills defaults in cfg (dtype f32, optimizer rowwise_adagrad, lr 0.01, eps 1e-8, betas 0.9 and
 * 0.999, init_scale 1/sqrt(emb_width)) and validates it: name, rows, emb_width (and its split
 * over group_size), dtype, optimizer, hyper-parameters, and the bytes against max_bytes.
 * Returns EMBPS_OK or EMBPS_INVALID_ARGUMENT / EMBPS_RESOURCE_EXHAUSTED with err set.
 */
embps_status_t embps_table_config_resolve(embps_table_config_t *cfg, uint32_t group_size,
                                          uint64_t max_bytes, embps_error_t *err);

/** Bytes a table of cfg holds on one rank of a group of group_size (data and state). */
uint64_t embps_table_config_bytes(const embps_table_config_t *cfg, uint32_t group_size);

/** Creates an empty store for rank `rank` of a group of group_size. */
embps_status_t embps_store_new(embps_store_t **out, uint32_t rank, uint32_t group_size,
                               size_t max_tables);
/** Frees the store and every table's arrays. NULL is a no-op. */
void embps_store_free(embps_store_t *store);

/**
 * Allocates and initializes rank `rank`'s slice of a table of a group of group_size, with its
 * optimizer state (cfg already resolved). On failure *out is untouched. Returns EMBPS_OK or
 * EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_table_new(embps_table_t **out, const embps_table_config_t *cfg, uint32_t rank,
                               uint32_t group_size);

/**
 * A table's descriptor for rank `rank` of a group of group_size without its arrays, for an
 * engine that allocates them itself (GPU memory) and sets release_arrays. On failure *out is
 * untouched. Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED.
 */
embps_status_t embps_table_new_shell(embps_table_t **out, const embps_table_config_t *cfg,
                                     uint32_t rank, uint32_t group_size);

/** Frees a table that was never registered. NULL is a no-op. */
void embps_table_free(embps_table_t *table);

/**
 * Registers a table; the store takes ownership on success. Returns EMBPS_ALREADY_EXISTS for a
 * taken name, EMBPS_RESOURCE_EXHAUSTED beyond max_tables (err says which).
 */
embps_status_t embps_store_add(embps_store_t *store, embps_table_t *table, embps_error_t *err);

/** The table named name; NULL when there is none. */
embps_table_t *embps_store_find(const embps_store_t *store, const char *name);

/** Number of tables and the i-th one (registration order). */
size_t embps_store_count(const embps_store_t *store);
embps_table_t *embps_store_at(const embps_store_t *store, size_t i);

uint32_t embps_store_group_size(const embps_store_t *store);
uint32_t embps_store_rank(const embps_store_t *store);

#endif
