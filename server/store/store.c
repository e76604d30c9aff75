/* The store holds tables by name. Tables are never moved once registered (the registry is an
 * array of pointers), so a table pointer stays valid across threads while names are looked up
 * under the lock. Tables are registered only once allocated and initialized on every rank, so
 * a lookup that finds a table always finds it whole.
 *
 * The registry grows as tables are registered (doubling, up to EMBPS_STORE_MAX_TABLES), under
 * the lock every reader of it takes.
 *
 * Dropping a table frees its arrays at once (the group's thread does it, in round order, so no
 * round runs on them again) but keeps the small struct, marked dropped, on a list freed with the
 * store: the loop thread, the metrics thread and the checkpoint writer may hold its pointer
 * (an op validated before the drop, a list being rendered, a snapshot being completed), and a
 * struct that outlives them all needs no reference counts on the hot path. It costs a few
 * hundred bytes per dropped table, plus one byte per snapshot block (1/16384 of the table) if
 * the table was ever checkpointed.
 *
 * Initialization writes every element from embps_init_value, a function of (seed, row, column)
 * alone, so a table's contents do not depend on how many ranks split it. */
#include "store.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/shape.h"
#include "kernels/embps_kernels.h"

struct embps_store {
  pthread_mutex_t mu; /* guards count, tables, dropped and next_id */
  size_t count, cap;
  embps_table_t **tables; /* cap slots, count used */
  embps_table_t *dropped; /* dropped tables' structs, freed with the store */
  uint64_t next_id;       /* the id the next registered table gets, less one */
  atomic_uint_fast64_t budget_max, budget_copies;
};

void embps_table_config_row_bytes(const embps_table_config_t *cfg, uint32_t group_size,
                                  uint64_t *data_bytes, uint64_t *state_bytes) {
  const embps_optimizer_info_t *info = embps_optimizer_info(cfg->optimizer);
  uint64_t shard_width = cfg->emb_width / (group_size ? group_size : 1);
  *data_bytes = shard_width * embps_dtype_size(cfg->dtype);
  *state_bytes =
      info ? (uint64_t)info->state_per_element * shard_width * 4 + info->state_per_row * 4u : 0;
}

uint64_t embps_table_config_bytes(const embps_table_config_t *cfg, uint32_t group_size) {
  uint64_t data, state;
  embps_hindex_config_t hc;
  embps_table_config_row_bytes(cfg, group_size, &data, &state);
  if (!embps_table_config_hashed(cfg))
    return cfg->rows * (data + state);
  embps_table_config_hindex(cfg, &hc);
  return cfg->capacity * (data + state) + (uint64_t)embps_hindex_bytes(&hc);
}

static int finite_nonneg(float x) { return isfinite(x) && x >= 0.0f; }

static int name_byte_ok(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.';
}

embps_status_t embps_table_name_check(const char *name, size_t len, embps_error_t *err) {
  char shown[EMBPS_TABLE_NAME_MAX * 4 + 1];
  size_t k = 0, bad = len;

  if (len == 0 || len >= EMBPS_TABLE_NAME_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "table name must be 1 to %d bytes long",
                           EMBPS_TABLE_NAME_MAX - 1);
  for (size_t i = 0; i < len && bad == len; i++)
    if (!name_byte_ok(name[i]))
      bad = i;
  if (bad == len)
    return EMBPS_OK;
  /* The name as sent, with every byte a name may not hold escaped: a NUL must show, since it is
   * what would otherwise cut the name short. */
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)name[i];
    if (c >= 0x20 && c < 0x7f && c != '\\')
      shown[k++] = (char)c;
    else
      k += (size_t)snprintf(shown + k, sizeof(shown) - k, "\\x%02x", c);
  }
  shown[k] = '\0';
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                         "table name '%s' may hold only letters, digits, '_', '-' and '.' (byte "
                         "0x%02x at position %zu)",
                         shown, (unsigned char)name[bad], bad);
}

embps_status_t embps_table_config_resolve(embps_table_config_t *cfg, uint32_t group_size,
                                          uint64_t max_bytes, embps_error_t *err) {
  embps_status_t ret;
  uint64_t bytes;

  if ((ret = embps_table_name_check(cfg->name, strnlen(cfg->name, sizeof(cfg->name)), err)) !=
      EMBPS_OK)
    return ret;
  if ((ret = embps_table_kind_resolve(cfg, err)) != EMBPS_OK)
    return ret;
  if (!embps_table_config_hashed(cfg) && (cfg->rows < 2 || cfg->rows > EMBPS_MAX_ROWS))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "rows=%llu is out of range: a table needs 2 to %llu rows (row 0 is "
                           "the padding row)",
                           (unsigned long long)cfg->rows, (unsigned long long)EMBPS_MAX_ROWS);
  if (cfg->emb_width == 0 || cfg->emb_width > EMBPS_MAX_EMB_WIDTH)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "emb_width=%u is out of range: 1 to %u",
                           cfg->emb_width, EMBPS_MAX_EMB_WIDTH);
  if ((ret = embps_shape_check_emb_width(cfg->emb_width, group_size, err)) != EMBPS_OK)
    return ret;
  if ((int)cfg->dtype == 0)
    cfg->dtype = EMBPS_DTYPE_F32;
  if (embps_dtype_size(cfg->dtype) == 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "dtype %d is not f32 or bf16",
                           (int)cfg->dtype);
  if ((int)cfg->optimizer == 0)
    cfg->optimizer = EMBPS_OPTIMIZER_SERVER_DEFAULT;
  if (!embps_optimizer_info(cfg->optimizer))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "optimizer %d is not one of %s",
                           (int)cfg->optimizer, EMBPS_OPTIMIZER_NAMES);
  if (cfg->lr == 0.0f)
    cfg->lr = (float)EMBPS_OPTIMIZER_DEFAULT_LR;
  if (cfg->eps == 0.0f)
    cfg->eps = (float)EMBPS_OPTIMIZER_DEFAULT_EPS;
  if (cfg->beta1 == 0.0f)
    cfg->beta1 = (float)EMBPS_OPTIMIZER_DEFAULT_BETA1;
  if (cfg->beta2 == 0.0f)
    cfg->beta2 = (float)EMBPS_OPTIMIZER_DEFAULT_BETA2;
  if (cfg->init_scale == 0.0f)
    cfg->init_scale = 1.0f / sqrtf((float)cfg->emb_width);
  if (!finite_nonneg(cfg->lr) || !(cfg->eps > 0.0f && isfinite(cfg->eps)) ||
      !finite_nonneg(cfg->half_life) || !finite_nonneg(cfg->initial_accumulator) ||
      !finite_nonneg(cfg->weight_decay) || !finite_nonneg(cfg->init_scale))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "optimizer settings must be finite and non-negative (lr=%g eps=%g "
                           "half_life=%g initial_accumulator=%g weight_decay=%g init_scale=%g)",
                           cfg->lr, cfg->eps, cfg->half_life, cfg->initial_accumulator,
                           cfg->weight_decay, cfg->init_scale);
  if (!(cfg->beta1 > 0.0f && cfg->beta1 < 1.0f) || !(cfg->beta2 > 0.0f && cfg->beta2 < 1.0f))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "adam betas must lie in (0, 1), got beta1=%g beta2=%g", cfg->beta1,
                           cfg->beta2);
  bytes = embps_table_config_bytes(cfg, group_size);
  if (bytes > max_bytes && embps_table_config_hashed(cfg))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "table '%s' needs %llu bytes per rank (capacity=%llu emb_width=%u %s, "
                           "%s state, and its key index), more than this rank's memory budget of "
                           "%llu (--max-memory-bytes): lower capacity or raise the budget",
                           cfg->name, (unsigned long long)bytes, (unsigned long long)cfg->capacity,
                           cfg->emb_width, embps_dtype_name(cfg->dtype),
                           embps_optimizer_name(cfg->optimizer), (unsigned long long)max_bytes);
  if (bytes > max_bytes)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "table '%s' needs %llu bytes per rank (rows=%llu emb_width=%u %s, "
                           "%s state), more than this rank's memory budget of %llu "
                           "(--max-memory-bytes)",
                           cfg->name, (unsigned long long)bytes, (unsigned long long)cfg->rows,
                           cfg->emb_width, embps_dtype_name(cfg->dtype),
                           embps_optimizer_name(cfg->optimizer), (unsigned long long)max_bytes);
  return EMBPS_OK;
}

embps_status_t embps_store_new(embps_store_t **out) {
  embps_store_t *s = embps_calloc(1, sizeof(*s));
  if (!s)
    return EMBPS_RESOURCE_EXHAUSTED;
  pthread_mutex_init(&s->mu, NULL);
  atomic_init(&s->budget_max, UINT64_MAX);
  atomic_init(&s->budget_copies, 0);
  *out = s;
  return EMBPS_OK;
}

struct embps_table {
  embps_table_config_t config;
  uint32_t col_begin;   /* first column of this rank's slice */
  uint32_t shard_width; /* columns in this rank's slice */
  embps_table_arrays_t a;
  uint64_t step;            /* applied steps (adam's bias correction) */
  uint64_t bytes;           /* data and state bytes */
  embps_table_memory_t mem; /* where the arrays live (alloc NULL: host memory) */
  embps_table_counters_t counters;
  uint64_t id;                 /* embps_table_id; set when registered */
  atomic_int dropped;          /* embps_store_drop: the arrays are gone */
  embps_table_t *next_dropped; /* the store's list of dropped tables */
  embps_hindex_t *hindex;      /* a hash-keyed table's index (NULL: dense, or dropped) */
  /* its counters as last published (embps_table_hindex_publish), for any thread */
  atomic_uint_fast64_t hx_size, hx_admitted, hx_evicted, hx_expired, hx_refused, hx_not_admitted,
      hx_clock;
  uint64_t *dirty;        /* rows written since the last capture (tracking on), else NULL */
  uint64_t *device_dirty; /* the same marks not yet taken, in t->mem (embps_table_device_dirty) */
  /* The snapshot in progress (embps_table_snapshot_begin): blocks of block_rows rows, each
   * PENDING, BUSY (one thread is copying it) or DONE. `active` is 1 from begin until every
   * block is DONE; the group's thread reads it before every write. */
  struct {
    atomic_int active;
    embps_table_arrays_t into;
    uint64_t block_rows, blocks;
    atomic_uchar *state;
  } snap;
};

enum { SNAP_PENDING = 0, SNAP_BUSY = 1, SNAP_DONE = 2 };

static void release(const embps_table_memory_t *mem, void *p) {
  if (mem->release)
    mem->release(p);
  else
    embps_free(p);
}

void embps_table_free(embps_table_t *t) {
  if (!t)
    return;
  release(&t->mem, t->a.data);
  release(&t->mem, t->a.state0);
  release(&t->mem, t->a.state1);
  release(&t->mem, t->device_dirty);
  embps_free(t->dirty);
  embps_free((void *)t->snap.state);
  embps_hindex_free(t->hindex);
  embps_free(t);
}

void embps_table_initial_state(const embps_table_t *t, float *state0_value, size_t *state0_elems,
                               size_t *state1_elems) {
  const embps_optimizer_info_t *info = embps_optimizer_info(t->config.optimizer);
  const size_t rows = (size_t)embps_table_config_rows(&t->config);
  const size_t elems = rows * t->shard_width;
  /* Adagrad accumulators start at initial_accumulator; adam moments at 0. */
  *state0_value = info->accumulator ? t->config.initial_accumulator : 0.0f;
  *state0_elems = info->state_per_row ? rows : (info->state_per_element >= 1 ? elems : 0);
  *state1_elems = info->state_per_element >= 2 ? elems : 0;
}

void embps_table_array_bytes(const embps_table_t *t, size_t bytes[3]) {
  size_t s0, s1;
  float v0;
  embps_table_initial_state(t, &v0, &s0, &s1);
  bytes[0] = (size_t)embps_table_config_rows(&t->config) * t->shard_width *
             embps_dtype_size(t->config.dtype);
  bytes[1] = s0 * sizeof(float);
  bytes[2] = s1 * sizeof(float);
}

embps_status_t embps_table_new_in(embps_table_t **out, const embps_table_config_t *cfg,
                                  uint32_t rank, uint32_t group_size,
                                  const embps_table_memory_t *mem) {
  embps_table_t *t = embps_calloc(1, sizeof(*t));
  size_t s0, s1;
  float v0;
  if (!t)
    return EMBPS_RESOURCE_EXHAUSTED;
  t->config = *cfg;
  t->shard_width = cfg->emb_width / group_size;
  t->col_begin = rank * t->shard_width;
  t->bytes = embps_table_config_bytes(cfg, group_size);
  if (mem)
    t->mem = *mem;
  if (embps_table_config_hashed(cfg)) { /* the index, empty, the same on every rank */
    embps_hindex_config_t hc;
    embps_table_config_hindex(cfg, &hc);
    if (embps_hindex_new(&t->hindex, &hc, NULL) != EMBPS_OK) {
      embps_free(t);
      return EMBPS_RESOURCE_EXHAUSTED;
    }
  }
  embps_table_initial_state(t, &v0, &s0, &s1);
  {
    const size_t bytes[3] = {(size_t)embps_table_config_rows(cfg) * t->shard_width *
                                 embps_dtype_size(cfg->dtype),
                             s0 * sizeof(float), s1 * sizeof(float)};
    void **arrays[3] = {&t->a.data, (void **)&t->a.state0, (void **)&t->a.state1};
    for (int i = 0; i < 3; i++) {
      if (bytes[i] == 0 && i > 0)
        continue;
      *arrays[i] = t->mem.alloc ? t->mem.alloc(bytes[i]) : embps_aligned_alloc(bytes[i]);
      if (!*arrays[i]) {
        embps_table_free(t);
        return EMBPS_RESOURCE_EXHAUSTED;
      }
    }
  }
  *out = t;
  return EMBPS_OK;
}

const embps_table_config_t *embps_table_config(const embps_table_t *t) { return &t->config; }
uint32_t embps_table_col_begin(const embps_table_t *t) { return t->col_begin; }
uint32_t embps_table_shard_width(const embps_table_t *t) { return t->shard_width; }
uint64_t embps_table_bytes(const embps_table_t *t) { return t->bytes; }
embps_table_counters_t *embps_table_counters(embps_table_t *t) { return &t->counters; }
embps_table_arrays_t embps_table_arrays(const embps_table_t *t) { return t->a; }
uint64_t embps_table_next_step(embps_table_t *t) { return ++t->step; }
uint64_t embps_table_step(const embps_table_t *t) { return t->step; }
void embps_table_set_step(embps_table_t *t, uint64_t step) { t->step = step; }

embps_hindex_t *embps_table_hindex(const embps_table_t *t) { return t->hindex; }

void embps_table_set_hindex(embps_table_t *t, embps_hindex_t *ix) {
  embps_hindex_free(t->hindex);
  t->hindex = ix;
  embps_table_hindex_publish(t);
}

void embps_table_hindex_publish(embps_table_t *t) {
  embps_hindex_stats_t st;
  if (!t->hindex)
    return;
  embps_hindex_stats(t->hindex, &st);
  atomic_store_explicit(&t->hx_size, st.size, memory_order_relaxed);
  atomic_store_explicit(&t->hx_clock, st.clock, memory_order_relaxed);
  atomic_store_explicit(&t->hx_admitted, st.admitted, memory_order_relaxed);
  atomic_store_explicit(&t->hx_evicted, st.evicted, memory_order_relaxed);
  atomic_store_explicit(&t->hx_expired, st.expired, memory_order_relaxed);
  atomic_store_explicit(&t->hx_refused, st.refused, memory_order_relaxed);
  atomic_store_explicit(&t->hx_not_admitted, st.not_admitted, memory_order_relaxed);
}

void embps_table_hindex_stats(const embps_table_t *t, embps_hindex_stats_t *st) {
  embps_table_t *m = (embps_table_t *)t; /* atomics: loads only */
  st->size = atomic_load_explicit(&m->hx_size, memory_order_relaxed);
  st->clock = atomic_load_explicit(&m->hx_clock, memory_order_relaxed);
  st->admitted = atomic_load_explicit(&m->hx_admitted, memory_order_relaxed);
  st->evicted = atomic_load_explicit(&m->hx_evicted, memory_order_relaxed);
  st->expired = atomic_load_explicit(&m->hx_expired, memory_order_relaxed);
  st->refused = atomic_load_explicit(&m->hx_refused, memory_order_relaxed);
  st->not_admitted = atomic_load_explicit(&m->hx_not_admitted, memory_order_relaxed);
}

size_t embps_dirty_words(uint64_t rows) { return (size_t)((rows + 63) / 64); }

embps_status_t embps_table_track_dirty(embps_table_t *t) {
  if (t->dirty)
    return EMBPS_OK;
  t->dirty = embps_calloc(embps_dirty_words(embps_table_config_rows(&t->config)), sizeof(uint64_t));
  return t->dirty ? EMBPS_OK : EMBPS_RESOURCE_EXHAUSTED;
}

uint64_t *embps_table_dirty(embps_table_t *t) { return t->dirty; }

void embps_table_mark_dirty(embps_table_t *t, const int64_t *rows, size_t n) {
  if (t->dirty)
    embps_mark_rows_cpu(t->dirty, rows, n);
}

uint64_t *embps_table_device_dirty(const embps_table_t *t) { return t->device_dirty; }

embps_status_t embps_table_device_dirty_new(embps_table_t *t, uint64_t **out) {
  if (!t->dirty || !t->mem.alloc)
    return EMBPS_FAILED_PRECONDITION;
  if (!t->device_dirty &&
      !(t->device_dirty = t->mem.alloc(embps_dirty_words(embps_table_config_rows(&t->config)) *
                                       sizeof(uint64_t))))
    return EMBPS_RESOURCE_EXHAUSTED;
  *out = t->device_dirty;
  return EMBPS_OK;
}

void embps_store_free(embps_store_t *store) {
  if (!store)
    return;
  for (size_t i = 0; i < store->count; i++)
    embps_table_free(store->tables[i]);
  while (store->dropped) {
    embps_table_t *t = store->dropped;
    store->dropped = t->next_dropped;
    embps_table_free(t);
  }
  embps_free(store->tables);
  pthread_mutex_destroy(&store->mu);
  embps_free(store);
}

static embps_table_t *find_locked(const embps_store_t *store, const char *name) {
  for (size_t i = 0; i < store->count; i++)
    if (strcmp(store->tables[i]->config.name, name) == 0)
      return store->tables[i];
  return NULL;
}

/* Doubles the registry's slots (16 at first), up to EMBPS_STORE_MAX_TABLES. */
static embps_status_t grow_locked(embps_store_t *store) {
  size_t cap = store->cap ? store->cap * 2 : 16;
  embps_table_t **tables;
  if (cap > EMBPS_STORE_MAX_TABLES)
    cap = EMBPS_STORE_MAX_TABLES;
  if (!(tables = embps_realloc(store->tables, cap * sizeof(*tables))))
    return EMBPS_RESOURCE_EXHAUSTED;
  store->tables = tables;
  store->cap = cap;
  return EMBPS_OK;
}

embps_status_t embps_store_add(embps_store_t *store, embps_table_t *t, embps_error_t *err) {
  embps_status_t ret = EMBPS_OK;
  pthread_mutex_lock(&store->mu);
  if (find_locked(store, t->config.name))
    ret = embps_error_set(err, EMBPS_ALREADY_EXISTS, "table '%s' already exists", t->config.name);
  else if (store->count >= EMBPS_STORE_MAX_TABLES)
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                          "this server already holds %zu tables, the most a server holds",
                          store->count);
  else if (store->count == store->cap && grow_locked(store) != EMBPS_OK)
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory registering table '%s'",
                          t->config.name);
  else
    store->tables[store->count++] = t;
  /* Every attempt takes a number, so ranks stay in step even where one of them refused. */
  ++store->next_id;
  if (ret == EMBPS_OK)
    t->id = store->next_id;
  pthread_mutex_unlock(&store->mu);
  return ret;
}

size_t embps_store_list(const embps_store_t *store, embps_table_t **out, size_t cap) {
  size_t n;
  pthread_mutex_lock((pthread_mutex_t *)&store->mu);
  n = store->count < cap ? store->count : cap;
  if (n) /* tables is NULL until the first table is registered */
    memcpy(out, store->tables, n * sizeof(*out));
  pthread_mutex_unlock((pthread_mutex_t *)&store->mu);
  return n;
}

embps_status_t embps_store_drop(embps_store_t *store, embps_table_t *t) {
  size_t i;
  pthread_mutex_lock(&store->mu);
  for (i = 0; i < store->count && store->tables[i] != t; i++) {
  }
  if (i == store->count) {
    pthread_mutex_unlock(&store->mu);
    return EMBPS_NOT_FOUND;
  }
  /* Registration order is kept: ListTables and checkpoints list tables in it. */
  memmove(&store->tables[i], &store->tables[i + 1],
          (store->count - i - 1) * sizeof(*store->tables));
  store->count--;
  t->next_dropped = store->dropped;
  store->dropped = t;
  atomic_store_explicit(&t->dropped, 1, memory_order_release);
  pthread_mutex_unlock(&store->mu);
  /* A checkpoint writer may be completing a snapshot of t: settle every block here (waiting for
   * one it is copying), after which it reads no array of t again. */
  embps_table_snapshot_complete(t);
  release(&t->mem, t->a.data);
  release(&t->mem, t->a.state0);
  release(&t->mem, t->a.state1);
  memset(&t->a, 0, sizeof(t->a));
  release(&t->mem, t->device_dirty);
  t->device_dirty = NULL;
  embps_free(t->dirty);
  t->dirty = NULL;
  embps_hindex_free(t->hindex); /* its counters stay published */
  t->hindex = NULL;
  return EMBPS_OK;
}

int embps_table_dropped(const embps_table_t *t) {
  return atomic_load_explicit(&((embps_table_t *)t)->dropped, memory_order_acquire);
}

uint64_t embps_table_id(const embps_table_t *t) { return t->id; }

void embps_store_set_budget(embps_store_t *store, uint64_t max_bytes, uint32_t snapshot_copies) {
  atomic_store_explicit(&store->budget_max, max_bytes, memory_order_relaxed);
  atomic_store_explicit(&store->budget_copies, snapshot_copies, memory_order_relaxed);
}

uint64_t embps_store_budget_cost(const embps_store_t *store, uint64_t bytes) {
  uint64_t copies =
      atomic_load_explicit(&((embps_store_t *)store)->budget_copies, memory_order_relaxed);
  return bytes > UINT64_MAX / (1 + copies) ? UINT64_MAX : bytes * (1 + copies);
}

uint64_t embps_store_budget_used(const embps_store_t *store) {
  uint64_t sum = 0;
  pthread_mutex_lock((pthread_mutex_t *)&store->mu);
  for (size_t i = 0; i < store->count; i++)
    sum += embps_store_budget_cost(store, store->tables[i]->bytes);
  pthread_mutex_unlock((pthread_mutex_t *)&store->mu);
  return sum;
}

uint64_t embps_store_budget_max(const embps_store_t *store) {
  return atomic_load_explicit(&((embps_store_t *)store)->budget_max, memory_order_relaxed);
}

embps_table_t *embps_store_find(const embps_store_t *store, const char *name) {
  embps_table_t *t;
  pthread_mutex_lock((pthread_mutex_t *)&store->mu);
  t = find_locked(store, name);
  pthread_mutex_unlock((pthread_mutex_t *)&store->mu);
  return t;
}

size_t embps_store_count(const embps_store_t *store) {
  size_t n;
  pthread_mutex_lock((pthread_mutex_t *)&store->mu);
  n = store->count;
  pthread_mutex_unlock((pthread_mutex_t *)&store->mu);
  return n;
}

embps_table_t *embps_store_at(const embps_store_t *store, size_t i) {
  embps_table_t *t;
  pthread_mutex_lock((pthread_mutex_t *)&store->mu);
  t = i < store->count ? store->tables[i] : NULL;
  pthread_mutex_unlock((pthread_mutex_t *)&store->mu);
  return t;
}

embps_status_t embps_table_new(embps_table_t **out, const embps_table_config_t *cfg, uint32_t rank,
                               uint32_t group_size) {
  embps_table_t *t;
  size_t s0, s1;
  float v0;

  if (embps_table_new_in(&t, cfg, rank, group_size, NULL) != EMBPS_OK)
    return EMBPS_RESOURCE_EXHAUSTED;
  embps_table_initial_state(t, &v0, &s0, &s1);
  for (size_t i = 0; i < s0; i++)
    t->a.state0[i] = v0;
  if (s1)
    memset(t->a.state1, 0, s1 * sizeof(float));
  /* A hash-keyed table's slot s starts as row s would (a slot's row is set again from its key
   * when a key takes the slot): every byte is a function of (seed, row, column) either way. */
  embps_init_rows_cpu(t->a.data, cfg->dtype, t->shard_width, 0, embps_table_config_rows(cfg),
                      t->col_begin, cfg->seed, cfg->init_scale);
  *out = t;
  return EMBPS_OK;
}

/* ---- copy-on-write snapshots ----------------------------------------------------------------- */

/* Rows of ~16 KiB per block: a batch that writes U rows copies at most U blocks first, so the
 * pause it sees is bounded by the batch and not the table. */
#define SNAP_BLOCK_BYTES 16384u

static void row_sizes(const embps_table_t *t, size_t out[3]) {
  size_t bytes[3];
  embps_table_array_bytes(t, bytes);
  for (int i = 0; i < 3; i++)
    out[i] = bytes[i] / embps_table_config_rows(&t->config);
}

/* Copies block b of the table into the snapshot. */
static void snap_copy_block(embps_table_t *t, uint64_t b) {
  const uint64_t first = b * t->snap.block_rows;
  const uint64_t rows = embps_table_config_rows(&t->config);
  const uint64_t n = first + t->snap.block_rows > rows ? rows - first : t->snap.block_rows;
  const void *from[3] = {t->a.data, t->a.state0, t->a.state1};
  void *to[3] = {t->snap.into.data, t->snap.into.state0, t->snap.into.state1};
  size_t rb[3];
  row_sizes(t, rb);
  for (int i = 0; i < 3; i++)
    if (rb[i] && from[i])
      memcpy((uint8_t *)to[i] + first * rb[i], (const uint8_t *)from[i] + first * rb[i], n * rb[i]);
}

/* Makes block b DONE: copies it if it is PENDING, waits if another thread is copying it. */
static void snap_settle(embps_table_t *t, uint64_t b) {
  unsigned char expect = SNAP_PENDING;
  if (atomic_load_explicit(&t->snap.state[b], memory_order_acquire) == SNAP_DONE)
    return;
  if (atomic_compare_exchange_strong_explicit(&t->snap.state[b], &expect, SNAP_BUSY,
                                              memory_order_acq_rel, memory_order_acquire)) {
    snap_copy_block(t, b);
    atomic_store_explicit(&t->snap.state[b], SNAP_DONE, memory_order_release);
    return;
  }
  while (atomic_load_explicit(&t->snap.state[b], memory_order_acquire) != SNAP_DONE)
    sched_yield(); /* the other thread is in the middle of one block's memcpy */
}

embps_status_t embps_table_snapshot_begin(embps_table_t *t, const embps_table_arrays_t *into,
                                          const uint64_t *only) {
  size_t rb[3];
  if (atomic_load_explicit(&t->snap.active, memory_order_acquire))
    return EMBPS_FAILED_PRECONDITION;
  row_sizes(t, rb);
  if (!t->snap.state) {
    const size_t per_row = rb[0] + rb[1] + rb[2];
    t->snap.block_rows = per_row >= SNAP_BLOCK_BYTES ? 1 : SNAP_BLOCK_BYTES / per_row;
    t->snap.blocks =
        (embps_table_config_rows(&t->config) + t->snap.block_rows - 1) / t->snap.block_rows;
    if (!(t->snap.state = embps_malloc(t->snap.blocks * sizeof(*t->snap.state))))
      return EMBPS_RESOURCE_EXHAUSTED;
  }
  t->snap.into = *into;
  for (uint64_t b = 0; b < t->snap.blocks; b++) {
    unsigned char st = SNAP_PENDING;
    if (only) { /* a block none of whose rows the snapshot needs is done already */
      const uint64_t first = b * t->snap.block_rows;
      const uint64_t rows = embps_table_config_rows(&t->config);
      const uint64_t end = first + t->snap.block_rows < rows ? first + t->snap.block_rows : rows;
      st = SNAP_DONE;
      for (uint64_t r = first; r < end; r++) {
        if ((r & 63) == 0 && end - r >= 64 && only[r >> 6] == 0) {
          r += 63;
          continue;
        }
        if ((only[r >> 6] >> (r & 63)) & 1u) {
          st = SNAP_PENDING;
          break;
        }
      }
    }
    atomic_store_explicit(&t->snap.state[b], st, memory_order_relaxed);
  }
  atomic_store_explicit(&t->snap.active, 1, memory_order_release);
  return EMBPS_OK;
}

void embps_table_before_write(embps_table_t *t, const int64_t *rows, size_t n) {
  if (!atomic_load_explicit(&t->snap.active, memory_order_acquire))
    return;
  for (size_t i = 0; i < n; i++)
    snap_settle(t, (uint64_t)rows[i] / t->snap.block_rows);
}

void embps_table_snapshot_complete(embps_table_t *t) {
  if (!atomic_load_explicit(&t->snap.active, memory_order_acquire))
    return;
  for (uint64_t b = 0; b < t->snap.blocks; b++)
    snap_settle(t, b);
  atomic_store_explicit(&t->snap.active, 0, memory_order_release);
}

void embps_table_snapshot_cancel(embps_table_t *t) {
  atomic_store_explicit(&t->snap.active, 0, memory_order_release);
}
