/* The index's internals, shared by hindex.c (the state machine), hindex_codec.c (its
 * checkpoint bytes) and hindex_delta.c (the changes since a capture), and reached by
 * tests/unit/store/test_hindex.c. */
#ifndef EMBPS_HINDEX_INTERNAL_H
#define EMBPS_HINDEX_INTERNAL_H

#include <stdint.h>

#include "common/mix64.h"
#include "server/store/hindex.h"

#define EMBPS__HIX_NONE UINT32_MAX
/** The sketch's change tracking marks blocks of this many bytes (counters). */
#define EMBPS__HIX_SKETCH_BLOCK 64u

struct embps_hindex {
  embps_hindex_config_t cfg;
  uint64_t mask;  /* hash map buckets - 1 (a power of two >= 2 x capacity) */
  uint64_t hseed; /* the key hash's seed */
  uint64_t sseed[EMBPS_HINDEX_SKETCH_DEPTH]; /* the sketch rows' seeds */
  /* the arena (one zeroed mapping of arena_bytes), carved into: */
  uint64_t *buckets; /* mask + 1: (tag << 32) | (slot + 1), 0 empty; tag = hash >> 32, whose
                        low bits are the home bucket (hindex.c: home) */
  uint64_t *key;     /* capacity: the key at a slot, 0 for a free slot */
  uint64_t *score;   /* capacity: the key's score (policy's; least goes first) */
  /* The victim order of the stored keys, ascending (score, key). LFU: a binary min-heap of
   * slots (heap, capacity) and each slot's place in it (pos, capacity; EMBPS__HIX_NONE when not
   * in it). LRU and TTL: a doubly linked queue (link, 2 x capacity, over the memory of pos and
   * heap: slot s's predecessor link[2s] and successor link[2s + 1], EMBPS__HIX_NONE at the ends;
   * meaningless for a slot not in it) from head to tail: every score a step gives is its clock,
   * above every score stored, so a step appends its keys at the tail in ascending key order and
   * the queue stays sorted without comparisons. pos also serves decode as a mark (codec). */
  uint32_t *pos;
  uint32_t *heap;
  uint32_t *link;
  uint32_t *free;  /* capacity: a stack of free slots; the top is free[nfree - 1] */
  uint8_t *sketch; /* DEPTH x sketch_width saturating counters */
  /* What changed since the last capture (hindex_delta.c; embps_hindex_mark_captured clears it):
   * bit s % 64 of chg[s / 64] for each slot s whose key or score a step wrote (capacity bits);
   * bit b % 64 of schg[b / 64] for each EMBPS__HIX_SKETCH_BLOCK-byte block b of the sketch whose
   * counters rose; low_free, the least depth of the free stack since (it changes at its top
   * alone, so the entries below low_free are the captured ones); cap_st, cap_base: the header
   * state at the capture, which a delta names as the state it applies on. */
  uint64_t *chg;
  uint64_t *schg;
  uint64_t low_free;
  embps_hindex_stats_t cap_st;
  uint64_t cap_base;
  void *arena;
  size_t arena_bytes;
  /* A step's scratch, grown to the largest step's need and freed with the index. Not state:
   * neither encoded nor counted in embps_hindex_bytes (hindex.h). */
  void *scratch;
  size_t scratch_bytes;
  uint64_t nheap, nfree; /* keys in the victim order (heap or queue); free slots */
  uint32_t head, tail;   /* LRU, TTL: the queue's ends (least first), EMBPS__HIX_NONE if empty */
  uint64_t base;         /* LFU: scores are in units of 2^(base - epoch) of a push at epoch */
  uint32_t dmax;         /* LFU: the largest epoch - base kept before renormalising */
  embps_hindex_stats_t st;
  int admit_all; /* set by embps_hindex_assign for its step: every absent key is admitted */
};

/** The key hash: a seeded bijection of 64-bit keys. */
static inline uint64_t embps__hix_mix(uint64_t x) { return embps_mix64(x); }

/** The counter of key in sketch row r: its index within the row. */
static inline uint64_t embps__hix_sketch_col(const struct embps_hindex *ix, uint32_t r,
                                             uint64_t key) {
  return ((embps__hix_mix(key ^ ix->sseed[r]) >> 32) * ix->cfg.sketch_width) >> 32;
}

/** Marks slot s changed since the last capture. */
static inline void embps__hix_mark(struct embps_hindex *ix, uint64_t s) {
  ix->chg[s >> 6] |= UINT64_C(1) << (s & 63);
}

/** Marks the sketch's counter at byte offset off changed since the last capture. */
static inline void embps__hix_mark_sketch(struct embps_hindex *ix, uint64_t off) {
  uint64_t b = off / EMBPS__HIX_SKETCH_BLOCK;
  ix->schg[b >> 6] |= UINT64_C(1) << (b & 63);
}

/** The sketch's blocks (EMBPS__HIX_SKETCH_BLOCK bytes, the last one maybe shorter) for c. */
static inline uint64_t embps__hix_sketch_blocks(const embps_hindex_config_t *c) {
  return ((uint64_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width + EMBPS__HIX_SKETCH_BLOCK - 1) /
         EMBPS__HIX_SKETCH_BLOCK;
}

/** Marks every slot changed (an LFU renormalisation rewrites every score). */
void embps__hindex_mark_all(struct embps_hindex *ix);

/** Makes an empty index (no validation of c beyond what embps_hindex_new does). */
embps_status_t embps__hindex_alloc(struct embps_hindex **out, const embps_hindex_config_t *c,
                                   embps_error_t *err);
/** Stores key at the free slot (map and key array; not the heap, not the free stack). */
void embps__hindex_map_insert(struct embps_hindex *ix, uint64_t key, uint32_t slot);
/** The slot of key, or EMBPS__HIX_NONE. */
uint32_t embps__hindex_map_find(const struct embps_hindex *ix, uint64_t key);
/** Rebuilds the heap from every stored slot (in slot order); LFU only. */
void embps__hindex_heap_build(struct embps_hindex *ix);
/** Builds the victim order (heap or queue) of every stored slot after decode. Errors:
 * EMBPS_RESOURCE_EXHAUSTED (the queue's sort scratch, 4 bytes per key, cannot be had). */
embps_status_t embps__hindex_order_build(struct embps_hindex *ix);
/** Removes the key stored at slot (still in ix->key) from the map; the key array entry is left
 * to the caller. */
void embps__hindex_map_remove(struct embps_hindex *ix, uint32_t slot);
/** Takes stored slot s out of the victim order (heap or queue). */
void embps__hindex_order_remove(struct embps_hindex *ix, uint32_t s);
/** Puts stored slot s into the victim order: LFU's heap anywhere; LRU's and TTL's queue at the
 * tail, so s's (score, key) must exceed every one in it. */
void embps__hindex_order_add(struct embps_hindex *ix, uint32_t s);
/** Checks an encoding's configuration f against the table's c: EMBPS_OK, or
 * EMBPS_FAILED_PRECONDITION naming the first field that differs and `name`, the bytes. */
embps_status_t embps__hindex_check_config(const embps_hindex_config_t *f,
                                          const embps_hindex_config_t *c, const char *name,
                                          embps_error_t *err);

#endif
