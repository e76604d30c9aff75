/* A table's kind: dense (rows) or hash-keyed (capacity), and the settings of the hash-keyed kind
 * (docs/design.md, "Hash-keyed tables"). embps_table_config_resolve (store.c) calls
 * embps_table_kind_resolve first, so a spec that mixes the kinds or gives a hash-keyed option
 * the index would refuse is refused here, before any rank is asked, with a message naming the
 * field and the remedy. The rules:
 *
 * - capacity 0 is a dense table: rows as before, and no hash-keyed option (admit_after above 1,
 *   eviction, half_life_steps, ttl_steps, sketch_width). admit_after 1 means "at once", which is
 *   what a dense table does, so it is taken and stored as 0.
 * - capacity C > 0 is a hash-keyed table: rows 0, C at most EMBPS_HINDEX_MAX_CAPACITY;
 *   admit_after 0 is 1, at most EMBPS_HINDEX_MAX_ADMIT_AFTER; eviction 0 is lru; half_life_steps
 *   with lfu only and required by it, ttl_steps with ttl only and required by it; sketch_width
 *   only when admit_after > 1, and 0 there is the default: the least power of two >= C, at most
 *   EMBPS_HINDEX_MAX_SKETCH_WIDTH (the sketch's 4 rows of one-byte counters then cost 4 to 8
 *   bytes per slot, against the index's 44 to 60).
 *
 * The values resolved here are the index's configuration (embps_table_config_hindex), which
 * embps_hindex_config_check accepts for every spec that passes. */
#include "server/store/store.h"

#include <inttypes.h>

#include "common/eviction.h"
#include "server/store/hindex.h"

_Static_assert((int)EMBPS_EVICTION_LRU == (int)EMBPS_HINDEX_LRU &&
                   (int)EMBPS_EVICTION_LFU == (int)EMBPS_HINDEX_LFU &&
                   (int)EMBPS_EVICTION_TTL == (int)EMBPS_HINDEX_TTL,
               "embps_eviction_t and embps_hindex_policy_t have the same values");

int embps_table_config_hashed(const embps_table_config_t *cfg) { return cfg->capacity != 0; }

void embps_table_config_hindex(const embps_table_config_t *cfg, embps_hindex_config_t *out) {
  out->capacity = cfg->capacity;
  out->policy = (embps_hindex_policy_t)cfg->eviction;
  out->admit_after = cfg->admit_after;
  out->sketch_width = cfg->sketch_width;
  out->half_life = cfg->half_life_steps;
  out->ttl_steps = cfg->ttl_steps;
  out->seed = cfg->seed;
}

uint32_t embps_table_sketch_width_default(uint64_t capacity) {
  uint64_t w = 1;
  while (w < capacity && w < EMBPS_HINDEX_MAX_SKETCH_WIDTH)
    w <<= 1;
  return (uint32_t)w;
}

/* A dense table: the first hash-keyed option it was given is refused. */
static embps_status_t resolve_dense(embps_table_config_t *cfg, embps_error_t *err) {
  const char *field = NULL;
  uint64_t value = 0;
  if (cfg->admit_after == 1)
    cfg->admit_after = 0; /* "at once": what a dense table does */
  if (cfg->admit_after)
    field = "admit_after", value = cfg->admit_after;
  else if (cfg->eviction)
    field = "eviction", value = (uint64_t)cfg->eviction;
  else if (cfg->half_life_steps)
    field = "half_life_steps", value = cfg->half_life_steps;
  else if (cfg->ttl_steps)
    field = "ttl_steps", value = cfg->ttl_steps;
  else if (cfg->sketch_width)
    field = "sketch_width", value = cfg->sketch_width;
  if (!field)
    return EMBPS_OK;
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                         "%s=%" PRIu64 " is an option of hash-keyed tables, and this table is "
                         "dense (capacity=0): give a capacity (and rows=0) for a hash-keyed "
                         "table, or leave %s 0",
                         field, value, field);
}

static embps_status_t resolve_hashed(embps_table_config_t *cfg, embps_error_t *err) {
  const char *policy;
  if (cfg->rows)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "rows=%" PRIu64 " and capacity=%" PRIu64 " are both given: a table is "
                           "dense (rows) or hash-keyed (capacity); set rows=0 for a hash-keyed "
                           "table, or capacity=0 for a dense one",
                           cfg->rows, cfg->capacity);
  if (cfg->capacity > EMBPS_HINDEX_MAX_CAPACITY)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "capacity=%" PRIu64 " is out of range: a hash-keyed table holds 1 to "
                           "%" PRIu64 " keys; lower capacity",
                           cfg->capacity, (uint64_t)EMBPS_HINDEX_MAX_CAPACITY);
  if (cfg->eviction == EMBPS_EVICTION_DEFAULT)
    cfg->eviction = EMBPS_EVICTION_SERVER_DEFAULT;
  if (!embps_eviction_known(cfg->eviction))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "eviction=%d is not a policy this server knows: use one of %s (0: %s)",
                           (int)cfg->eviction, EMBPS_EVICTION_NAMES,
                           embps_eviction_name(EMBPS_EVICTION_SERVER_DEFAULT));
  policy = embps_eviction_name(cfg->eviction);
  if (cfg->admit_after == 0)
    cfg->admit_after = 1;
  if (cfg->admit_after > EMBPS_HINDEX_MAX_ADMIT_AFTER)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "admit_after=%" PRIu32 " is out of range: give 1 (store a key at its "
                           "first push) to %u",
                           cfg->admit_after, EMBPS_HINDEX_MAX_ADMIT_AFTER);
  if (cfg->eviction != EMBPS_EVICTION_LFU && cfg->half_life_steps)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "half_life_steps=%" PRIu64 " is an option of lfu eviction, and this "
                           "table's eviction is %s: set eviction=lfu, or leave half_life_steps 0",
                           cfg->half_life_steps, policy);
  if (cfg->eviction == EMBPS_EVICTION_LFU &&
      (cfg->half_life_steps < 1 || cfg->half_life_steps > EMBPS_HINDEX_MAX_HALF_LIFE))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "half_life_steps=%" PRIu64 " is out of range: lfu eviction needs 1 to "
                           "%" PRIu64 " push steps over which a push's weight halves",
                           cfg->half_life_steps, (uint64_t)EMBPS_HINDEX_MAX_HALF_LIFE);
  if (cfg->eviction != EMBPS_EVICTION_TTL && cfg->ttl_steps)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "ttl_steps=%" PRIu64 " is an option of ttl eviction, and this table's "
                           "eviction is %s: set eviction=ttl, or leave ttl_steps 0",
                           cfg->ttl_steps, policy);
  if (cfg->eviction == EMBPS_EVICTION_TTL &&
      (cfg->ttl_steps < 1 || cfg->ttl_steps > EMBPS_HINDEX_MAX_TTL_STEPS))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "ttl_steps=%" PRIu64 " is out of range: ttl eviction needs 1 to "
                           "%" PRIu64 " push steps without a push before a key expires",
                           cfg->ttl_steps, (uint64_t)EMBPS_HINDEX_MAX_TTL_STEPS);
  if (cfg->admit_after == 1 && cfg->sketch_width)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "sketch_width=%" PRIu32 " is given with admit_after=1, which counts "
                           "nothing: leave sketch_width 0, or raise admit_after",
                           cfg->sketch_width);
  if (cfg->admit_after > 1 && cfg->sketch_width == 0)
    cfg->sketch_width = embps_table_sketch_width_default(cfg->capacity);
  if (cfg->sketch_width > EMBPS_HINDEX_MAX_SKETCH_WIDTH)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "sketch_width=%" PRIu32 " is out of range: give 1 to %" PRIu32
                           " counters per sketch row, or 0 for the server's default",
                           cfg->sketch_width, (uint32_t)EMBPS_HINDEX_MAX_SKETCH_WIDTH);
  return EMBPS_OK;
}

embps_status_t embps_table_kind_resolve(embps_table_config_t *cfg, embps_error_t *err) {
  embps_hindex_config_t hc;
  embps_status_t ret;
  if (!embps_table_config_hashed(cfg))
    return resolve_dense(cfg, err);
  if ((ret = resolve_hashed(cfg, err)) != EMBPS_OK)
    return ret;
  embps_table_config_hindex(cfg, &hc);
  return embps_hindex_config_check(&hc, err); /* the index's own word, should a rule drift */
}

uint64_t embps_table_config_rows(const embps_table_config_t *cfg) {
  return embps_table_config_hashed(cfg) ? cfg->capacity : cfg->rows;
}
