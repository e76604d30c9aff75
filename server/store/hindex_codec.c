/* The index's checkpoint bytes (hindex.h). Every integer little-endian, every length checked
 * against the bytes before anything is read, one crc32 (the checkpoint format's) over the whole:
 *
 *   "EMBPSHIX" | format version u32 | policy u32 | capacity u64 | admit_after u32 |
 *   sketch_width u32 | half_life u64 | ttl_steps u64 | seed u64 | clock u64 | base u64 |
 *   admitted u64 | evicted u64 | expired u64 | refused u64 | not_admitted u64 | size u64 |
 *   free u64                                                      (the header: 128 bytes)
 *   free slots   free x u32, the stack from its bottom (the next slot given is the last)
 *   keys         size x (slot u32 | key u64 | score u64), ascending slot
 *   sketch       4 x sketch_width u8, row by row
 *   crc32 u32 of every byte before it
 *
 * The hash map and the heap are not written: decode rebuilds them from the keys. Their layouts
 * may differ from the writer's, but no result depends on a layout (hindex.c), so the decoded
 * index behaves as the encoded one, and encodes to the same bytes. Decode checks every invariant
 * a step relies on (slots partitioned between keys and free stack, keys distinct and nonzero,
 * scores the policy can have, counters that add up), so no file can make a step misbehave. */
#include <inttypes.h>
#include <string.h>

#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex_internal.h"

#define MAGIC "EMBPSHIX"
#define HEADER_BYTES 128u
#define ENTRY_BYTES 20u

size_t embps_hindex_encoded_bytes(const embps_hindex_t *ix) {
  return HEADER_BYTES + 4 * (size_t)ix->nfree + ENTRY_BYTES * (size_t)ix->st.size +
         (size_t)EMBPS_HINDEX_SKETCH_DEPTH * ix->cfg.sketch_width + 4;
}

static uint8_t *put_u32(uint8_t *p, uint32_t v) {
  embps_put_le32(p, v);
  return p + 4;
}

static uint8_t *put_u64(uint8_t *p, uint64_t v) {
  embps_put_le64(p, v);
  return p + 8;
}

void embps_hindex_encode(const embps_hindex_t *ix, uint8_t *out) {
  const embps_hindex_config_t *c = &ix->cfg;
  size_t sketch = (size_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width;
  uint8_t *p = out;
  memcpy(p, MAGIC, 8);
  p = put_u32(p + 8, EMBPS_HINDEX_FORMAT_VERSION);
  p = put_u32(p, (uint32_t)c->policy);
  p = put_u64(p, c->capacity);
  p = put_u32(p, c->admit_after);
  p = put_u32(p, c->sketch_width);
  p = put_u64(p, c->half_life);
  p = put_u64(p, c->ttl_steps);
  p = put_u64(p, c->seed);
  p = put_u64(p, ix->st.clock);
  p = put_u64(p, ix->base);
  p = put_u64(p, ix->st.admitted);
  p = put_u64(p, ix->st.evicted);
  p = put_u64(p, ix->st.expired);
  p = put_u64(p, ix->st.refused);
  p = put_u64(p, ix->st.not_admitted);
  p = put_u64(p, ix->st.size);
  p = put_u64(p, ix->nfree);
  for (uint64_t i = 0; i < ix->nfree; i++)
    p = put_u32(p, ix->free[i]);
  for (uint64_t s = 0; s < c->capacity; s++)
    if (ix->key[s]) {
      p = put_u32(p, (uint32_t)s);
      p = put_u64(p, ix->key[s]);
      p = put_u64(p, ix->score[s]);
    }
  memcpy(p, ix->sketch, sketch);
  p += sketch;
  put_u32(p, embps_ckpt_crc32(0, out, (size_t)(p - out)));
}

embps_status_t embps__hindex_check_config(const embps_hindex_config_t *f,
                                          const embps_hindex_config_t *c, const char *name,
                                          embps_error_t *err) {
  static const char *policies[4] = {"?", "lru", "lfu", "ttl"};
  if (f->capacity != c->capacity)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "hash index %s was written for a capacity of %" PRIu64
                           " slots, the table has %" PRIu64
                           ": restore it into a table of its capacity (growing is not supported)",
                           name, f->capacity, c->capacity);
  if (f->policy != c->policy)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "hash index %s was written for eviction policy %s, the table has %s",
                           name, (unsigned)f->policy < 4 ? policies[f->policy] : "unknown",
                           policies[c->policy]);
  if (f->admit_after != c->admit_after || f->sketch_width != c->sketch_width ||
      f->half_life != c->half_life || f->ttl_steps != c->ttl_steps || f->seed != c->seed)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "hash index %s was written for other settings (admit_after %" PRIu32
                           ", sketch_width %" PRIu32 ", half_life %" PRIu64 ", ttl_steps %" PRIu64
                           ", seed %" PRIu64 ") than the table's: restore it into its own table",
                           name, f->admit_after, f->sketch_width, f->half_life, f->ttl_steps,
                           f->seed);
  return EMBPS_OK;
}

/* Reads the free stack and the keys into ix (allocated for the config); 0, or -1 malformed. */
static int read_body(embps_hindex_t *ix, const uint8_t *p, uint64_t nfree, uint64_t size) {
  const embps_hindex_config_t *c = &ix->cfg;
  uint64_t prev = 0, epoch = ix->st.clock / (c->half_life ? c->half_life : 1);
  for (uint64_t i = 0; i < nfree; i++, p += 4) {
    uint32_t s = embps_get_le32(p);
    if (s >= c->capacity || ix->pos[s] != EMBPS__HIX_NONE)
      return -1; /* out of range, or twice */
    ix->pos[s] = 0;
    ix->free[i] = s;
  }
  ix->nfree = nfree;
  for (uint64_t i = 0; i < size; i++, p += ENTRY_BYTES) {
    uint32_t s = embps_get_le32(p);
    uint64_t key = embps_get_le64(p + 4), score = embps_get_le64(p + 12);
    if (s >= c->capacity || (i && s <= prev) || ix->pos[s] != EMBPS__HIX_NONE || !key ||
        embps__hindex_map_find(ix, key) != EMBPS__HIX_NONE)
      return -1; /* out of range or order, a free slot, key 0 or a key twice */
    if (c->policy == EMBPS_HINDEX_LFU
            ? score >> 63 != 0
            : score > ix->st.clock ||
                  (c->policy == EMBPS_HINDEX_TTL && ix->st.clock - score > c->ttl_steps))
      return -1; /* a score the policy cannot give */
    prev = s;
    embps__hindex_map_insert(ix, key, s);
    ix->score[s] = score;
  }
  if (c->policy == EMBPS_HINDEX_LFU && (ix->base > epoch || epoch - ix->base > ix->dmax))
    return -1;
  for (uint64_t i = 0; i < nfree; i++)
    ix->pos[ix->free[i]] = EMBPS__HIX_NONE;
  return 0;
}

embps_status_t embps_hindex_decode(embps_hindex_t **out, const embps_hindex_config_t *c,
                                   const uint8_t *p, size_t len, const char *name,
                                   embps_error_t *err) {
  embps_hindex_config_t f;
  embps_hindex_stats_t st;
  embps_hindex_t *ix;
  embps_status_t ret;
  uint64_t base, nfree, want_len;
  const uint8_t *q;

  if ((ret = embps_hindex_config_check(c, err)) != EMBPS_OK)
    return ret;
  if ((ret = embps_ckpt_check_envelope(p, len, HEADER_BYTES, MAGIC, EMBPS_HINDEX_FORMAT_VERSION,
                                       "hash index", name, err)) != EMBPS_OK)
    return ret;
  memset(&f, 0, sizeof(f));
  memset(&st, 0, sizeof(st));
  f.policy = (embps_hindex_policy_t)embps_get_le32(p + 12);
  f.capacity = embps_get_le64(p + 16);
  f.admit_after = embps_get_le32(p + 24);
  f.sketch_width = embps_get_le32(p + 28);
  f.half_life = embps_get_le64(p + 32);
  f.ttl_steps = embps_get_le64(p + 40);
  f.seed = embps_get_le64(p + 48);
  st.clock = embps_get_le64(p + 56);
  base = embps_get_le64(p + 64);
  st.admitted = embps_get_le64(p + 72);
  st.evicted = embps_get_le64(p + 80);
  st.expired = embps_get_le64(p + 88);
  st.refused = embps_get_le64(p + 96);
  st.not_admitted = embps_get_le64(p + 104);
  st.size = embps_get_le64(p + 112);
  nfree = embps_get_le64(p + 120);
  if ((ret = embps__hindex_check_config(&f, c, name, err)) != EMBPS_OK)
    return ret;
  /* c is valid, so capacity < 2^32 and nothing below overflows once size and nfree are bounded */
  want_len = HEADER_BYTES + 4 * nfree + ENTRY_BYTES * st.size +
             (uint64_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width + 4;
  if (st.size > c->capacity || nfree > c->capacity || st.size + nfree != c->capacity ||
      want_len != len || st.evicted > st.admitted || st.expired > st.admitted - st.evicted ||
      st.admitted - st.evicted - st.expired != st.size ||
      (c->policy != EMBPS_HINDEX_LFU && base != 0) ||
      (c->policy != EMBPS_HINDEX_TTL && st.expired != 0) ||
      (c->admit_after == 1 && st.not_admitted != 0) || (st.size && !st.clock))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "hash index %s is malformed (its counts and length, %zu bytes, "
                           "disagree)",
                           name, len);
  if ((ret = embps__hindex_alloc(&ix, c, err)) != EMBPS_OK)
    return ret;
  ix->st = st;
  ix->base = base;
  q = p + HEADER_BYTES;
  if (read_body(ix, q, nfree, st.size) != 0) {
    embps_hindex_free(ix);
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "hash index %s is malformed (a slot, key or score that no index "
                           "holds)",
                           name);
  }
  if ((ret = embps__hindex_order_build(ix)) != EMBPS_OK) {
    embps_hindex_free(ix);
    return embps_error_set(err, ret, "out of memory for decoding hash index %s (%" PRIu64 " keys)",
                           name, st.size);
  }
  q += 4 * nfree + ENTRY_BYTES * st.size;
  memcpy(ix->sketch, q, (size_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width);
  embps_hindex_mark_captured(ix); /* a delta taken from the encoded index applies on this one */
  *out = ix;
  return EMBPS_OK;
}
