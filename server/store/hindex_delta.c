/* The index's delta bytes (hindex.h): what its steps changed since the last capture, which an
 * incremental checkpoint writes instead of the whole index. Every integer little-endian, every
 * length checked against the bytes before anything is read, one crc32 (the checkpoint format's)
 * over the whole:
 *
 *   "EMBPSHXD" | format version u32 | policy u32 | capacity u64 | admit_after u32 |
 *   sketch_width u32 | half_life u64 | ttl_steps u64 | seed u64     (the full encoding's fields)
 *   from   clock u64 | base u64 | admitted u64 | evicted u64 | expired u64 | refused u64 |
 *          not_admitted u64 | size u64 | free u64     (the state at the capture it applies on)
 *   to     the same nine fields, as the index stands now
 *   kept u64 | slots u64 | blocks u64                                  (the header: 224 bytes)
 *   free   (to.free - kept) x u32: the free stack from depth `kept` up (the entries below kept
 *          are the capture's: the stack changed only above its least depth since)
 *   slots  slots x (slot u32 | key u64 | score u64), ascending slot: every slot whose key or
 *          score a step wrote and that holds a key now, with its key and score
 *   blocks blocks x (block u32 | its counters), ascending: every 64-byte block of the sketch
 *          whose counters rose (the sketch's last block is shorter when 4 x sketch_width is not a
 *          multiple of 64)
 *   crc32 u32 of every byte before it
 *
 * An evicted key is there as its slot's new key. A slot freed since (its key expired) and free
 * now is in the free stack above `kept` (it was pushed there, and a pop would have given it a
 * key): it is not listed among the slots, so an expiry costs 4 bytes as in the full encoding.
 * Applying a delta onto the index at its capture (hindex.h) gives exactly the index encoded,
 * which encodes to the same full bytes (the test checks it over long random sequences). The apply
 * checks what decode checks (slots partitioned between keys and the free stack, keys distinct and
 * nonzero, scores the policy can have, counters that add up) without reading the whole index:
 * the slots a step could have given out are the capture's free stack above `kept` and the slots
 * it held keys in, so a free slot below `kept` given a key, a slot both given a key and free, or
 * one twice in the free stack, is refused. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex_internal.h"

#define MAGIC "EMBPSHXD"
#define CONFIG_BYTES 56u
#define STATE_BYTES 72u
#define HEADER_BYTES (CONFIG_BYTES + 2 * STATE_BYTES + 24u)
#define ENTRY_BYTES 20u

/* The header state a delta names twice: the counters, LFU's base, the free stack's depth. */
typedef struct hstate {
  embps_hindex_stats_t st;
  uint64_t base, nfree;
} hstate_t;

static uint64_t words(uint64_t bits) { return (bits + 63) / 64; }

static int bit(const uint64_t *w, uint64_t i) { return (int)(w[i >> 6] >> (i & 63) & 1); }

/* The bytes of sketch block b. */
static uint64_t block_len(const embps_hindex_config_t *c, uint64_t b) {
  uint64_t left =
      (uint64_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width - b * EMBPS__HIX_SKETCH_BLOCK;
  return left < EMBPS__HIX_SKETCH_BLOCK ? left : EMBPS__HIX_SKETCH_BLOCK;
}

void embps__hindex_mark_all(embps_hindex_t *ix) {
  uint64_t n = words(ix->cfg.capacity);
  memset(ix->chg, 0xff, n * sizeof(uint64_t));
  if (ix->cfg.capacity % 64)
    ix->chg[n - 1] = (UINT64_C(1) << (ix->cfg.capacity % 64)) - 1;
}

void embps_hindex_mark_captured(embps_hindex_t *ix) {
  memset(ix->chg, 0, words(ix->cfg.capacity) * sizeof(uint64_t));
  memset(ix->schg, 0, words(embps__hix_sketch_blocks(&ix->cfg)) * sizeof(uint64_t));
  ix->low_free = ix->nfree;
  ix->cap_st = ix->st;
  ix->cap_base = ix->base;
}

static uint64_t count_bits(const uint64_t *w, uint64_t n) {
  uint64_t c = 0;
  for (uint64_t i = 0; i < n; i++)
    c += (uint64_t)__builtin_popcountll(w[i]);
  return c;
}

/* The changed slots that hold a key (those a delta lists). */
static uint64_t count_listed(const embps_hindex_t *ix) {
  uint64_t c = 0;
  for (uint64_t w = 0; w < words(ix->cfg.capacity); w++)
    for (uint64_t m = ix->chg[w]; m; m &= m - 1)
      c += ix->key[w * 64 + (uint64_t)__builtin_ctzll(m)] != 0;
  return c;
}

size_t embps_hindex_delta_bytes(const embps_hindex_t *ix) {
  const uint64_t nb = embps__hix_sketch_blocks(&ix->cfg), blocks = count_bits(ix->schg, words(nb));
  uint64_t len = HEADER_BYTES + 4 * (ix->nfree - ix->low_free) + ENTRY_BYTES * count_listed(ix) +
                 (4 + EMBPS__HIX_SKETCH_BLOCK) * blocks + 4;
  if (nb && bit(ix->schg, nb - 1)) /* the last block may be short */
    len -= EMBPS__HIX_SKETCH_BLOCK - block_len(&ix->cfg, nb - 1);
  return (size_t)len;
}

static uint8_t *put_u32(uint8_t *p, uint32_t v) {
  embps_put_le32(p, v);
  return p + 4;
}

static uint8_t *put_u64(uint8_t *p, uint64_t v) {
  embps_put_le64(p, v);
  return p + 8;
}

/* In the order the header lists them. */
static uint8_t *put_state(uint8_t *p, const hstate_t *h) {
  p = put_u64(p, h->st.clock);
  p = put_u64(p, h->base);
  p = put_u64(p, h->st.admitted);
  p = put_u64(p, h->st.evicted);
  p = put_u64(p, h->st.expired);
  p = put_u64(p, h->st.refused);
  p = put_u64(p, h->st.not_admitted);
  p = put_u64(p, h->st.size);
  return put_u64(p, h->nfree);
}

static void get_state(const uint8_t *p, hstate_t *h) {
  memset(h, 0, sizeof(*h));
  h->st.clock = embps_get_le64(p);
  h->base = embps_get_le64(p + 8);
  h->st.admitted = embps_get_le64(p + 16);
  h->st.evicted = embps_get_le64(p + 24);
  h->st.expired = embps_get_le64(p + 32);
  h->st.refused = embps_get_le64(p + 40);
  h->st.not_admitted = embps_get_le64(p + 48);
  h->st.size = embps_get_le64(p + 56);
  h->nfree = embps_get_le64(p + 64);
}

void embps_hindex_delta_encode(const embps_hindex_t *ix, uint8_t *out) {
  const embps_hindex_config_t *c = &ix->cfg;
  const uint64_t nb = embps__hix_sketch_blocks(c);
  const hstate_t from = {ix->cap_st, ix->cap_base, c->capacity - ix->cap_st.size};
  const hstate_t to = {ix->st, ix->base, ix->nfree};
  uint8_t *p = out;
  memcpy(p, MAGIC, 8);
  p = put_u32(p + 8, EMBPS_HINDEX_DELTA_VERSION);
  p = put_u32(p, (uint32_t)c->policy);
  p = put_u64(p, c->capacity);
  p = put_u32(p, c->admit_after);
  p = put_u32(p, c->sketch_width);
  p = put_u64(p, c->half_life);
  p = put_u64(p, c->ttl_steps);
  p = put_u64(p, c->seed);
  p = put_state(p, &from);
  p = put_state(p, &to);
  p = put_u64(p, ix->low_free);
  p = put_u64(p, count_listed(ix));
  p = put_u64(p, count_bits(ix->schg, words(nb)));
  for (uint64_t i = ix->low_free; i < ix->nfree; i++)
    p = put_u32(p, ix->free[i]);
  for (uint64_t w = 0; w < words(c->capacity); w++)
    for (uint64_t m = ix->chg[w]; m; m &= m - 1) {
      uint64_t s = w * 64 + (uint64_t)__builtin_ctzll(m);
      if (!ix->key[s])
        continue; /* free: in the stack above low_free */
      p = put_u32(p, (uint32_t)s);
      p = put_u64(p, ix->key[s]);
      p = put_u64(p, ix->score[s]);
    }
  for (uint64_t w = 0; w < words(nb); w++)
    for (uint64_t m = ix->schg[w]; m; m &= m - 1) {
      uint64_t b = w * 64 + (uint64_t)__builtin_ctzll(m), n = block_len(c, b);
      p = put_u32(p, (uint32_t)b);
      memcpy(p, ix->sketch + b * EMBPS__HIX_SKETCH_BLOCK, (size_t)n);
      p += n;
    }
  put_u32(p, embps_ckpt_crc32(0, out, (size_t)(p - out)));
}

/* ---- apply ----------------------------------------------------------------------------------- */

/* The counters of a state any index can be in (as decode checks them). */
static int counts_ok(const embps_hindex_config_t *c, const hstate_t *h) {
  const embps_hindex_stats_t *st = &h->st;
  return st->size <= c->capacity && h->nfree <= c->capacity && st->size + h->nfree == c->capacity &&
         st->evicted <= st->admitted && st->expired <= st->admitted - st->evicted &&
         st->admitted - st->evicted - st->expired == st->size &&
         (c->policy == EMBPS_HINDEX_LFU || h->base == 0) &&
         (c->policy == EMBPS_HINDEX_TTL || st->expired == 0) &&
         (c->admit_after > 1 || st->not_admitted == 0) && (!st->size || st->clock);
}

/* Whether `to` can follow `from`: nothing a step counts ever goes down. */
static int follows(const hstate_t *from, const hstate_t *to) {
  return to->st.clock >= from->st.clock && to->base >= from->base &&
         to->st.admitted >= from->st.admitted && to->st.evicted >= from->st.evicted &&
         to->st.expired >= from->st.expired && to->st.refused >= from->st.refused &&
         to->st.not_admitted >= from->st.not_admitted;
}

static int same_state(const embps_hindex_t *ix, const hstate_t *h) {
  return h->st.clock == ix->st.clock && h->base == ix->base && h->st.admitted == ix->st.admitted &&
         h->st.evicted == ix->st.evicted && h->st.expired == ix->st.expired &&
         h->st.refused == ix->st.refused && h->st.not_admitted == ix->st.not_admitted &&
         h->st.size == ix->st.size && h->nfree == ix->nfree;
}

/* The layout after the header: the free entries, the slots ascending, the blocks ascending, each
 * in range, ending at the crc32. 0, or -1 malformed. */
static int check_layout(const embps_hindex_config_t *c, const uint8_t *p, size_t len,
                        uint64_t nfree, uint64_t nslots, uint64_t nblocks) {
  const uint64_t nb = embps__hix_sketch_blocks(c);
  uint64_t left = len - HEADER_BYTES - 4, prev = 0;
  const uint8_t *q = p + HEADER_BYTES;
  if (nslots > c->capacity || nblocks > nb || left / 4 < nfree ||
      (left - 4 * nfree) / ENTRY_BYTES < nslots)
    return -1;
  for (uint64_t i = 0; i < nfree; i++, q += 4)
    if (embps_get_le32(q) >= c->capacity)
      return -1;
  for (uint64_t i = 0; i < nslots; i++, q += ENTRY_BYTES, prev = embps_get_le32(q - ENTRY_BYTES))
    if (embps_get_le32(q) >= c->capacity || (i && embps_get_le32(q) <= prev))
      return -1;
  left -= 4 * nfree + ENTRY_BYTES * nslots;
  for (uint64_t i = 0; i < nblocks; i++) {
    uint64_t b, n;
    if (left < 4 || (b = embps_get_le32(q)) >= nb || (i && b <= prev) ||
        left - 4 < (n = block_len(c, b)))
      return -1;
    prev = b;
    q += 4 + n;
    left -= 4 + n;
  }
  return left == 0 ? 0 : -1;
}

typedef struct placed {
  uint64_t score, key;
  uint32_t slot;
} placed_t;

static int cmp_placed(const void *a, const void *b) {
  const placed_t *x = a, *y = b;
  if (x->score != y->score)
    return x->score < y->score ? -1 : 1;
  return x->key < y->key ? -1 : x->key > y->key;
}

/* Frees stored slot s: its key out of the map and the victim order. */
static void free_slot(embps_hindex_t *ix, uint32_t s) {
  embps__hindex_order_remove(ix, s);
  embps__hindex_map_remove(ix, s);
  ix->key[s] = 0;
}

/* Applies the body (laid out as check_layout checked) onto ix; 0, -1 malformed, -2 no memory
 * (ix unchanged then). The change bits, clear at a capture, mark while the body is applied the
 * slots that may hold a new key: the capture's free stack above kept (a step may have given
 * them out) and the listed slots, less those the free stack takes back; the capture that
 * follows clears them again. */
static int apply_body(embps_hindex_t *ix, const uint8_t *p, const hstate_t *from,
                      const hstate_t *to, uint64_t kept, uint64_t nslots, uint64_t nblocks) {
  const embps_hindex_config_t *c = &ix->cfg;
  const int lfu = c->policy == EMBPS_HINDEX_LFU;
  const uint8_t *fr = p + HEADER_BYTES, *sl = fr + 4 * (to->nfree - kept);
  const uint8_t *bl = sl + ENTRY_BYTES * nslots;
  placed_t *order = NULL;
  uint64_t size = ix->st.size, nplaced = 0, epoch;

  if (!lfu && nslots && !(order = embps_malloc(nslots * sizeof(*order))))
    return -2;
  for (uint64_t i = kept; i < ix->nfree; i++) /* the free slots a step may have given out */
    embps__hix_mark(ix, ix->free[i]);
  for (uint64_t i = 0; i < nslots; i++) { /* the keys the listed slots held, out */
    uint32_t s = embps_get_le32(sl + ENTRY_BYTES * i);
    if (ix->key[s]) {
      free_slot(ix, s);
      size--;
      embps__hix_mark(ix, s);
    } else if (!bit(ix->chg, s)) {
      goto malformed; /* a free slot below the stack's least depth cannot have been given out */
    }
  }
  /* The stack above kept, before the new keys go in (a key freed here may be one of them): each
   * slot once, and either one the capture held a key in and the delta does not list (freed:
   * expired), or one marked above (then it must not hold a key below). */
  for (uint64_t i = kept; i < to->nfree; i++) {
    uint32_t s = embps_get_le32(fr + 4 * (i - kept));
    if (ix->key[s]) {
      free_slot(ix, s);
      size--;
    } else if (!bit(ix->chg, s)) {
      goto malformed; /* free below kept, or twice */
    }
    ix->chg[s >> 6] &= ~(UINT64_C(1) << (s & 63));
    ix->free[i] = s;
  }
  ix->nfree = to->nfree;
  for (uint64_t i = 0; i < nslots; i++) { /* the keys the listed slots hold now, in */
    const uint8_t *e = sl + ENTRY_BYTES * i;
    uint32_t s = embps_get_le32(e);
    uint64_t key = embps_get_le64(e + 4), score = embps_get_le64(e + 12);
    if (!bit(ix->chg, s) || !key ||
        (lfu ? score >> 63 != 0 : score <= from->st.clock || score > to->st.clock) ||
        embps__hindex_map_find(ix, key) != EMBPS__HIX_NONE)
      goto malformed; /* free too, key 0, a score no step since the capture gave, a key twice */
    embps__hindex_map_insert(ix, key, s);
    ix->score[s] = score;
    size++;
    if (lfu)
      embps__hindex_order_add(ix, s);
    else
      order[nplaced++] = (placed_t){score, key, s};
  }
  /* LRU and TTL: every score given since the capture exceeds every one kept from it, so the
   * new keys go to the queue's tail in (score, key) order (keys distinct: the order is total). */
  if (nplaced)
    qsort(order, nplaced, sizeof(*order), cmp_placed);
  for (uint64_t i = 0; i < nplaced; i++)
    embps__hindex_order_add(ix, order[i].slot);
  if (size != to->st.size)
    goto malformed;
  for (uint64_t i = 0; i < nblocks; i++) {
    uint64_t b = embps_get_le32(bl), n = block_len(c, b);
    memcpy(ix->sketch + b * EMBPS__HIX_SKETCH_BLOCK, bl + 4, (size_t)n);
    bl += 4 + n;
  }
  ix->st = to->st;
  ix->base = to->base;
  epoch = ix->st.clock / (c->half_life ? c->half_life : 1);
  if (lfu && (ix->base > epoch || epoch - ix->base > ix->dmax))
    goto malformed;
  if (c->policy == EMBPS_HINDEX_TTL && ix->nheap &&
      ix->st.clock - ix->score[ix->head] > c->ttl_steps)
    goto malformed; /* a key a step would have expired */
  embps_free(order);
  embps_hindex_mark_captured(ix);
  return 0;
malformed:
  embps_free(order);
  return -1;
}

embps_status_t embps_hindex_delta_apply(embps_hindex_t *ix, const uint8_t *p, size_t len,
                                        const char *name, embps_error_t *err) {
  const embps_hindex_config_t *c = &ix->cfg;
  embps_hindex_config_t f;
  hstate_t from, to;
  uint64_t kept, nslots, nblocks;
  embps_status_t ret;
  int r;

  if ((ret = embps_ckpt_check_envelope(p, len, HEADER_BYTES, MAGIC, EMBPS_HINDEX_DELTA_VERSION,
                                       "hash index delta", name, err)) != EMBPS_OK)
    return ret;
  memset(&f, 0, sizeof(f));
  f.policy = (embps_hindex_policy_t)embps_get_le32(p + 12);
  f.capacity = embps_get_le64(p + 16);
  f.admit_after = embps_get_le32(p + 24);
  f.sketch_width = embps_get_le32(p + 28);
  f.half_life = embps_get_le64(p + 32);
  f.ttl_steps = embps_get_le64(p + 40);
  f.seed = embps_get_le64(p + 48);
  if ((ret = embps__hindex_check_config(&f, c, name, err)) != EMBPS_OK)
    return ret;
  get_state(p + CONFIG_BYTES, &from);
  get_state(p + CONFIG_BYTES + STATE_BYTES, &to);
  kept = embps_get_le64(p + CONFIG_BYTES + 2 * STATE_BYTES);
  nslots = embps_get_le64(p + CONFIG_BYTES + 2 * STATE_BYTES + 8);
  nblocks = embps_get_le64(p + CONFIG_BYTES + 2 * STATE_BYTES + 16);
  if (ix->st.clock != ix->cap_st.clock || !same_state(ix, &from))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "hash index delta %s applies on the index at clock %" PRIu64
                           " with %" PRIu64 " keys, and the index it was given is at clock %" PRIu64
                           " with %" PRIu64 " keys: the checkpoint chain is broken",
                           name, from.st.clock, from.st.size, ix->st.clock, ix->st.size);
  /* c is valid, so capacity < 2^32: the products below do not overflow once bounded */
  if (!counts_ok(c, &to) || !follows(&from, &to) || kept > from.nfree || kept > to.nfree ||
      check_layout(c, p, len, to.nfree - kept, nslots, nblocks) != 0)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "hash index delta %s is malformed (its counts and length, %zu bytes, "
                           "disagree)",
                           name, len);
  if ((r = apply_body(ix, p, &from, &to, kept, nslots, nblocks)) == -2)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory applying hash index delta %s (%" PRIu64 " slots)", name,
                           nslots);
  if (r != 0)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "hash index delta %s is malformed (a slot, key or score that no index "
                           "following its base holds)",
                           name);
  return EMBPS_OK;
}
