/* The key -> slot index of a hash-keyed table (hindex.h): a replicated state machine whose every
 * decision is integer arithmetic on its own state, so every rank computes the same bits.
 *
 * Data structure, all in one zeroed arena sized by embps_hindex_bytes:
 * - a hash map of 8-byte buckets, open addressing with linear probing at load <= 0.5 (buckets: a
 *   power of two >= 2 x capacity). A bucket holds (tag << 32) | (slot + 1), tag the high half of
 *   the key's seeded hash, whose low bits are also the key's home bucket; a hit confirms the key
 *   in the slot's key array. Deletion shifts the probe run back (no tombstones), so probing
 *   stays correct and never degrades, reading each entry's home from its bucket.
 * - per slot: its key, its score;
 * - the victim order of the stored keys by (score, key), least first. LFU: a binary min-heap of
 *   slots with each slot's place in it: the victim is its root, found in O(1) and removed in
 *   O(log n). Keys are unique, so the least (score, key) is unique and the result of a step never
 *   depends on the heap's layout (a decoded index may lay it out differently). LRU and TTL: a
 *   doubly linked queue in that order, in the same 8 bytes per slot: a step's scores are all its
 *   clock, above every stored score, so appending the step's keys at the tail in ascending key
 *   order keeps the queue sorted, and the victim is its head, removed in O(1) with no comparison;
 * - a LIFO stack of free slots (slot 0 first), so the slot a new key gets is fixed by history;
 * - a count-min sketch, 4 rows of 8-bit saturating counters, with conservative update;
 * - what changed since the last capture (hindex_delta.c): a bit per slot whose key or score a
 *   step wrote, a bit per 64-byte block of the sketch whose counters rose, and the free stack's
 *   least depth since (embps__hix_mark and friends, where a step writes them).
 *
 * A step pins its keys by taking them out of the victim order while it runs (touched keys first,
 * then the keys it inserts), so its own keys are never victims, and puts them back at its end in
 * ascending key order. Lookups of a batch prefetch the buckets and keys of keys a few places
 * ahead, so the cache misses of successive keys overlap; a step does the same for the lines its
 * later keys will write (queue links, scores, the slots they get, the victims' buckets), and
 * walks the LRU queue's victims ahead of their eviction. A batch of 4096-65536 random keys over
 * a large map is bound by these misses: with them, a step at a full table of 1M slots (16M)
 * took 10 (7.3) million keys/s on one core, 4.4 (3.4) before. Keys given in ascending order (the
 * engine's push) skip the sort, and their slots the second lookup.
 *
 * Scores. LRU and TTL: the clock of the last push. LFU with decay: the sum over the key's pushes
 * of 2^(epoch at the push), epoch = clock / half_life, so a push weighs half as much as one a
 * half-life later. Scores are kept in units of 2^base: a push at epoch e adds 2^(e - base). With
 * d = epoch - base <= dmax = 62 - bits(half_life), a score stays below
 * half_life x 2^(d + 1) <= 2^63 (at most half_life pushes per epoch), so an addition never
 * overflows. When a step's d would exceed dmax, every score is shifted right by
 * s = d - dmax / 2 and base += s (renormalisation: exact integer floors, the same on every rank;
 * pushes older than about dmax / 2 half-lives fall to 0 by then) and the heap is rebuilt, since
 * floors can tie scores that keys then order.
 *
 * TTL: at the start of step `clock`, before anything else, every key whose last push t has
 * clock - t > ttl_steps (not pushed in the ttl_steps steps between) expires, least (score, key)
 * first, its slot pushed on the free stack. */
#include "server/store/hindex_internal.h"

#include <string.h>

#include "common/alloc.h"

#define ALIGN 64u
#define GOLDEN UINT64_C(0x9e3779b97f4a7c15)

static uint64_t round_up(uint64_t v) { return (v + ALIGN - 1) / ALIGN * ALIGN; }

static uint64_t map_buckets(uint64_t capacity) {
  uint64_t b = 1;
  while (b < 2 * capacity)
    b <<= 1;
  return b;
}

embps_status_t embps_hindex_config_check(const embps_hindex_config_t *c, embps_error_t *err) {
  if (c->capacity < 1 || c->capacity > EMBPS_HINDEX_MAX_CAPACITY)
    return embps_error_set(
        err, EMBPS_INVALID_ARGUMENT, "capacity %llu is out of range: give 1 to %llu slots",
        (unsigned long long)c->capacity, (unsigned long long)EMBPS_HINDEX_MAX_CAPACITY);
  if (c->policy != EMBPS_HINDEX_LRU && c->policy != EMBPS_HINDEX_LFU &&
      c->policy != EMBPS_HINDEX_TTL)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "eviction policy %d is unknown: use lru, lfu or ttl", (int)c->policy);
  if (c->admit_after < 1 || c->admit_after > EMBPS_HINDEX_MAX_ADMIT_AFTER)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "admit_after %u is out of range: give 1 (admit at once) to %u",
                           c->admit_after, EMBPS_HINDEX_MAX_ADMIT_AFTER);
  if (c->admit_after == 1 && c->sketch_width != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "sketch_width %u is given with admit_after 1, which counts nothing: "
                           "leave it 0 or raise admit_after",
                           c->sketch_width);
  if (c->admit_after > 1 &&
      (c->sketch_width < 1 || c->sketch_width > EMBPS_HINDEX_MAX_SKETCH_WIDTH))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "sketch_width %u is out of range for admit_after %u: give 1 to %u "
                           "counters per row",
                           c->sketch_width, c->admit_after, EMBPS_HINDEX_MAX_SKETCH_WIDTH);
  if (c->policy == EMBPS_HINDEX_LFU
          ? (c->half_life < 1 || c->half_life > EMBPS_HINDEX_MAX_HALF_LIFE)
          : c->half_life != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "half_life %llu is invalid: the lfu policy takes 1 to %llu steps, the "
                           "others none (0)",
                           (unsigned long long)c->half_life,
                           (unsigned long long)EMBPS_HINDEX_MAX_HALF_LIFE);
  if (c->policy == EMBPS_HINDEX_TTL
          ? (c->ttl_steps < 1 || c->ttl_steps > EMBPS_HINDEX_MAX_TTL_STEPS)
          : c->ttl_steps != 0)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "ttl_steps %llu is invalid: the ttl policy takes 1 to %llu steps, the "
                           "others none (0)",
                           (unsigned long long)c->ttl_steps,
                           (unsigned long long)EMBPS_HINDEX_MAX_TTL_STEPS);
  return EMBPS_OK;
}

/* The arena's bytes, and each array's offset in it (offs may be NULL). */
static size_t arena_bytes(const embps_hindex_config_t *c, size_t offs[9]) {
  uint64_t sizes[9] = {8 * map_buckets(c->capacity),
                       8 * c->capacity,
                       8 * c->capacity,
                       4 * c->capacity,
                       4 * c->capacity,
                       4 * c->capacity,
                       (uint64_t)EMBPS_HINDEX_SKETCH_DEPTH * c->sketch_width,
                       8 * ((c->capacity + 63) / 64),                  /* chg */
                       8 * ((embps__hix_sketch_blocks(c) + 63) / 64)}; /* schg */
  uint64_t total = 0;
  for (int i = 0; i < 9; i++) {
    if (offs)
      offs[i] = (size_t)total;
    total += round_up(sizes[i]);
  }
  return (size_t)total;
}

size_t embps_hindex_bytes(const embps_hindex_config_t *c) {
  if (embps_hindex_config_check(c, NULL) != EMBPS_OK)
    return 0;
  return sizeof(struct embps_hindex) + arena_bytes(c, NULL);
}

embps_status_t embps__hindex_alloc(embps_hindex_t **out, const embps_hindex_config_t *c,
                                   embps_error_t *err) {
  embps_hindex_t *ix;
  size_t offs[9];
  uint8_t *a;
  uint32_t bits = 0;
  if (!(ix = embps_calloc(1, sizeof(*ix))))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a hash index");
  ix->cfg = *c;
  ix->arena_bytes = arena_bytes(c, offs);
  if (!(ix->arena = embps_map_alloc(ix->arena_bytes))) {
    size_t bytes = ix->arena_bytes;
    embps_free(ix);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED,
                           "out of memory for a hash index of %llu slots (%zu bytes)",
                           (unsigned long long)c->capacity, bytes);
  }
  a = ix->arena;
  ix->buckets = (uint64_t *)(a + offs[0]);
  ix->key = (uint64_t *)(a + offs[1]);
  ix->score = (uint64_t *)(a + offs[2]);
  ix->pos = (uint32_t *)(a + offs[3]);
  ix->heap = (uint32_t *)(a + offs[4]);
  ix->link = ix->pos; /* 2 x capacity u32 fit: offs[4] >= offs[3] + 4 x capacity */
  ix->free = (uint32_t *)(a + offs[5]);
  ix->sketch = a + offs[6];
  ix->chg = (uint64_t *)(a + offs[7]);
  ix->schg = (uint64_t *)(a + offs[8]);
  ix->mask = map_buckets(c->capacity) - 1;
  ix->hseed = embps__hix_mix(c->seed + GOLDEN);
  for (uint32_t r = 0; r < EMBPS_HINDEX_SKETCH_DEPTH; r++)
    ix->sseed[r] = embps__hix_mix(c->seed + GOLDEN * (r + 2));
  for (uint64_t h = c->half_life; h; h >>= 1)
    bits++;
  ix->dmax = 62 - bits;
  ix->head = ix->tail = EMBPS__HIX_NONE;
  for (uint64_t s = 0; s < c->capacity; s++)
    ix->pos[s] = EMBPS__HIX_NONE;
  *out = ix;
  return EMBPS_OK;
}

embps_status_t embps_hindex_new(embps_hindex_t **out, const embps_hindex_config_t *c,
                                embps_error_t *err) {
  embps_hindex_t *ix;
  embps_status_t ret;
  if ((ret = embps_hindex_config_check(c, err)) != EMBPS_OK ||
      (ret = embps__hindex_alloc(&ix, c, err)) != EMBPS_OK)
    return ret;
  /* the free stack pops slot 0 first */
  for (uint64_t s = 0; s < c->capacity; s++)
    ix->free[s] = (uint32_t)(c->capacity - 1 - s);
  ix->nfree = c->capacity;
  embps_hindex_mark_captured(ix); /* the empty index is the first capture */
  *out = ix;
  return EMBPS_OK;
}

void embps_hindex_free(embps_hindex_t *ix) {
  if (!ix)
    return;
  embps_free(ix->scratch);
  embps_map_free(ix->arena, ix->arena_bytes);
  embps_free(ix);
}

const embps_hindex_config_t *embps_hindex_config(const embps_hindex_t *ix) { return &ix->cfg; }

void embps_hindex_stats(const embps_hindex_t *ix, embps_hindex_stats_t *st) { *st = ix->st; }

const uint64_t *embps_hindex_slot_keys(const embps_hindex_t *ix) { return ix->key; }

/* ---- the hash map ---------------------------------------------------------------------------- */

static uint64_t key_hash(const embps_hindex_t *ix, uint64_t key) {
  return embps__hix_mix(key ^ ix->hseed);
}

/* The home bucket of a key of hash h: the low bits of its tag (h's high half), then, in a map of
 * more than 2^32 buckets, of h's low half. So a stored entry's home is read from its bucket
 * (bucket_home) without loading its key, as deletion must for every entry it shifts: with the
 * home taken from h's low half, each was a cache miss on the key array, and deletion (an
 * eviction) took 23% of a full table's step (hindex_bench, 1M slots, uniform). */
static uint64_t home(const embps_hindex_t *ix, uint64_t h) {
  return (h >> 32 | h << 32) & ix->mask;
}

static uint64_t bucket_home(const embps_hindex_t *ix, uint64_t b) {
  if (ix->mask <= UINT32_MAX)
    return (b >> 32) & ix->mask;
  return home(ix, key_hash(ix, ix->key[(uint32_t)b - 1]));
}

uint32_t embps__hindex_map_find(const embps_hindex_t *ix, uint64_t key) {
  uint64_t h = key_hash(ix, key), i = home(ix, h), tag = h >> 32;
  for (;;) {
    uint64_t b = ix->buckets[i];
    if (!b)
      return EMBPS__HIX_NONE;
    if (b >> 32 == tag && ix->key[(uint32_t)b - 1] == key)
      return (uint32_t)b - 1;
    i = (i + 1) & ix->mask;
  }
}

void embps__hindex_map_insert(embps_hindex_t *ix, uint64_t key, uint32_t slot) {
  uint64_t h = key_hash(ix, key), i = home(ix, h);
  while (ix->buckets[i])
    i = (i + 1) & ix->mask;
  ix->buckets[i] = (h >> 32) << 32 | ((uint64_t)slot + 1);
  ix->key[slot] = key;
}

/* Removes the key stored at slot (still in ix->key) from the map: backward-shift deletion.
 * Every entry after the hole in its probe run that may move into the hole (its home is not
 * cyclically within (hole, its place]) moves, and the hole follows it; the run's end is left
 * empty. The entry is found by its slot, and homes are read from buckets: no key is loaded. */
static void map_remove(embps_hindex_t *ix, uint32_t slot) {
  uint64_t i = home(ix, key_hash(ix, ix->key[slot])), j;
  while ((uint32_t)ix->buckets[i] - 1 != slot)
    i = (i + 1) & ix->mask;
  for (j = (i + 1) & ix->mask; ix->buckets[j]; j = (j + 1) & ix->mask) {
    uint64_t hj = bucket_home(ix, ix->buckets[j]);
    if (((j - hj) & ix->mask) >= ((j - i) & ix->mask)) {
      ix->buckets[i] = ix->buckets[j];
      i = j;
    }
  }
  ix->buckets[i] = 0;
}

/* How far ahead a batch lookup prefetches a key's bucket (a power of two); its key array entry
 * is prefetched half as far ahead, once the bucket has arrived. 32 found 10-25% more keys/s than
 * 16 with Zipf keys at 1M and 16M slots (hindex_bench, 2-core VM), uniform keys alike. */
#define AHEAD 32u

/* The slot of keys[i] (EMBPS__HIX_NONE for an absent key or 0) into out[i] for i < n, as
 * embps__hindex_map_find, with the buckets and keys of later keys prefetched (hashes is
 * the ring of their hashes). */
static void map_find_batch(const embps_hindex_t *ix, const uint64_t *keys, size_t n,
                           uint32_t *out) {
  uint64_t hashes[2 * AHEAD]; /* keys i - AHEAD to i */
  for (size_t i = 0; i < n + AHEAD; i++) {
    if (i < n) { /* the bucket of keys[i], wanted AHEAD keys later */
      uint64_t h = key_hash(ix, keys[i]);
      hashes[i % (2 * AHEAD)] = h;
      __builtin_prefetch(&ix->buckets[home(ix, h)]);
    }
    if (i >= AHEAD / 2 && i - AHEAD / 2 < n) { /* the key its bucket names, if the tag matches */
      uint64_t h = hashes[(i - AHEAD / 2) % (2 * AHEAD)], b = ix->buckets[home(ix, h)];
      if (b >> 32 == h >> 32)
        __builtin_prefetch(&ix->key[(uint32_t)b - 1]);
    }
    if (i >= AHEAD) { /* the lookup itself */
      size_t j = i - AHEAD;
      uint64_t h = hashes[j % (2 * AHEAD)], key = keys[j], tag = h >> 32, k;
      uint32_t s = EMBPS__HIX_NONE;
      for (k = home(ix, h); key; k = (k + 1) & ix->mask) {
        uint64_t b = ix->buckets[k];
        if (!b)
          break;
        if (b >> 32 == tag && ix->key[(uint32_t)b - 1] == key) {
          s = (uint32_t)b - 1;
          break;
        }
      }
      out[j] = s;
    }
  }
}

void embps_hindex_find(const embps_hindex_t *ix, const uint64_t *keys, size_t n, int64_t *slots) {
  uint32_t s[256];
  for (size_t i = 0; i < n; i += 256) {
    size_t c = n - i < 256 ? n - i : 256;
    map_find_batch(ix, keys + i, c, s);
    for (size_t j = 0; j < c; j++)
      slots[i + j] = s[j] == EMBPS__HIX_NONE ? -1 : (int64_t)s[j];
  }
}

/* ---- the heap -------------------------------------------------------------------------------- */

static int less(const embps_hindex_t *ix, uint32_t a, uint32_t b) {
  return ix->score[a] < ix->score[b] || (ix->score[a] == ix->score[b] && ix->key[a] < ix->key[b]);
}

static void heap_set(embps_hindex_t *ix, uint64_t i, uint32_t slot) {
  ix->heap[i] = slot;
  ix->pos[slot] = (uint32_t)i;
}

static void sift_up(embps_hindex_t *ix, uint64_t i) {
  uint32_t s = ix->heap[i];
  while (i > 0) {
    uint64_t p = (i - 1) / 2;
    if (!less(ix, s, ix->heap[p]))
      break;
    heap_set(ix, i, ix->heap[p]);
    i = p;
  }
  heap_set(ix, i, s);
}

static void sift_down(embps_hindex_t *ix, uint64_t i) {
  uint32_t s = ix->heap[i];
  for (;;) {
    uint64_t c = 2 * i + 1;
    if (c >= ix->nheap)
      break;
    if (c + 1 < ix->nheap && less(ix, ix->heap[c + 1], ix->heap[c]))
      c++;
    if (!less(ix, ix->heap[c], s))
      break;
    heap_set(ix, i, ix->heap[c]);
    i = c;
  }
  heap_set(ix, i, s);
}

static void heap_push(embps_hindex_t *ix, uint32_t slot) {
  ix->heap[ix->nheap++] = slot;
  sift_up(ix, ix->nheap - 1);
}

static void heap_remove(embps_hindex_t *ix, uint32_t slot) {
  uint64_t i = ix->pos[slot];
  uint32_t last = ix->heap[--ix->nheap];
  ix->pos[slot] = EMBPS__HIX_NONE;
  if (i == ix->nheap)
    return;
  heap_set(ix, i, last);
  if (i > 0 && less(ix, last, ix->heap[(i - 1) / 2]))
    sift_up(ix, i);
  else
    sift_down(ix, i);
}

void embps__hindex_heap_build(embps_hindex_t *ix) {
  ix->nheap = 0;
  for (uint64_t s = 0; s < ix->cfg.capacity; s++)
    if (ix->key[s])
      heap_set(ix, ix->nheap++, (uint32_t)s);
  for (uint64_t i = ix->nheap / 2; i-- > 0;)
    sift_down(ix, i);
}

/* ---- the queue (LRU, TTL) -------------------------------------------------------------------- */

static void queue_remove(embps_hindex_t *ix, uint32_t s) {
  uint32_t p = ix->link[2 * (uint64_t)s], q = ix->link[2 * (uint64_t)s + 1];
  if (p == EMBPS__HIX_NONE)
    ix->head = q;
  else
    ix->link[2 * (uint64_t)p + 1] = q;
  if (q == EMBPS__HIX_NONE)
    ix->tail = p;
  else
    ix->link[2 * (uint64_t)q] = p;
  ix->nheap--;
}

/* Appends s at the tail: its (score, key) must exceed every one in the queue. */
static void queue_append(embps_hindex_t *ix, uint32_t s) {
  ix->link[2 * (uint64_t)s] = ix->tail;
  ix->link[2 * (uint64_t)s + 1] = EMBPS__HIX_NONE;
  if (ix->tail == EMBPS__HIX_NONE)
    ix->head = s;
  else
    ix->link[2 * (uint64_t)ix->tail + 1] = s;
  ix->tail = s;
  ix->nheap++;
}

/* Sorts slots a[0..n) ascending by (score, key) in place (heapsort: no scratch, and the order
 * is total since keys are unique). */
static void sort_slots(const embps_hindex_t *ix, uint32_t *a, uint64_t n) {
  for (uint64_t m = n, i = n / 2;;) { /* a max-heap, then its maxima to the end */
    uint64_t r, c;
    uint32_t v;
    if (i > 0) {
      v = a[--i];
    } else {
      if (m <= 1)
        return;
      v = a[--m];
      a[m] = a[0];
    }
    for (r = i; (c = 2 * r + 1) < m; r = c) {
      if (c + 1 < m && less(ix, a[c], a[c + 1]))
        c++;
      if (!less(ix, v, a[c]))
        break;
      a[r] = a[c];
    }
    a[r] = v;
  }
}

embps_status_t embps__hindex_order_build(embps_hindex_t *ix) {
  uint32_t *a;
  uint64_t n = 0;
  if (ix->cfg.policy == EMBPS_HINDEX_LFU) {
    embps__hindex_heap_build(ix);
    return EMBPS_OK;
  }
  if (!(a = embps_malloc((ix->st.size + 1) * sizeof(*a))))
    return EMBPS_RESOURCE_EXHAUSTED;
  for (uint64_t s = 0; s < ix->cfg.capacity; s++)
    if (ix->key[s])
      a[n++] = (uint32_t)s;
  sort_slots(ix, a, n);
  ix->nheap = 0;
  ix->head = ix->tail = EMBPS__HIX_NONE;
  for (uint64_t i = 0; i < n; i++)
    queue_append(ix, a[i]);
  embps_free(a);
  return EMBPS_OK;
}

/* ---- a step ---------------------------------------------------------------------------------- */

/* Sorts n keys ascending (LSD radix sort, bytes that every key shares skipped); tmp has room for
 * n. Returns where the sorted keys are (a or tmp). */
static uint64_t *sort_keys(uint64_t *a, uint64_t *tmp, size_t n) {
  uint64_t all_or = 0, all_and = ~UINT64_C(0);
  if (n < 64) { /* insertion sort */
    for (size_t i = 1; i < n; i++) {
      uint64_t v = a[i];
      size_t j = i;
      for (; j > 0 && a[j - 1] > v; j--)
        a[j] = a[j - 1];
      a[j] = v;
    }
    return a;
  }
  for (size_t i = 0; i < n; i++) {
    all_or |= a[i];
    all_and &= a[i];
  }
  for (uint32_t shift = 0; shift < 64; shift += 8) {
    size_t count[256] = {0}, sum = 0;
    uint64_t *t;
    if ((((all_or ^ all_and) >> shift) & 0xff) == 0)
      continue; /* every key has the same byte here */
    for (size_t i = 0; i < n; i++)
      count[(a[i] >> shift) & 0xff]++;
    for (int b = 0; b < 256; b++) {
      size_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; i++)
      tmp[count[(a[i] >> shift) & 0xff]++] = a[i];
    t = a;
    a = tmp;
    tmp = t;
  }
  return a;
}

/* Counts key once in the sketch (conservative update: only the counters at the least estimate
 * rise, to estimate + 1, saturating); returns the new estimate. */
static uint32_t sketch_count(embps_hindex_t *ix, uint64_t key) {
  uint8_t *c[EMBPS_HINDEX_SKETCH_DEPTH];
  uint32_t est = 255, next;
  for (uint32_t r = 0; r < EMBPS_HINDEX_SKETCH_DEPTH; r++) {
    c[r] = ix->sketch + (uint64_t)r * ix->cfg.sketch_width + embps__hix_sketch_col(ix, r, key);
    if (*c[r] < est)
      est = *c[r];
  }
  next = est < 255 ? est + 1 : 255;
  for (uint32_t r = 0; r < EMBPS_HINDEX_SKETCH_DEPTH; r++)
    if (*c[r] < next) {
      *c[r] = (uint8_t)next;
      embps__hix_mark_sketch(ix, (uint64_t)(c[r] - ix->sketch));
    }
  return next;
}

/* LFU: the weight of a push at this step, renormalising first when it would be too large. */
static uint64_t lfu_weight(embps_hindex_t *ix) {
  uint64_t epoch = ix->st.clock / ix->cfg.half_life, d = epoch - ix->base;
  if (d > ix->dmax) {
    uint64_t s = d - ix->dmax / 2;
    for (uint64_t i = 0; i < ix->nheap; i++)
      ix->score[ix->heap[i]] >>= s;
    ix->base += s;
    d -= s;
    embps__hindex_heap_build(ix);
    embps__hindex_mark_all(ix);
  }
  return UINT64_C(1) << d;
}

/* The victim: the stored key with the least (score, key) not in this step; ix->nheap > 0. */
static uint32_t victim(const embps_hindex_t *ix) {
  return ix->cfg.policy == EMBPS_HINDEX_LFU ? ix->heap[0] : ix->head;
}

static void order_remove(embps_hindex_t *ix, uint32_t s) {
  if (ix->cfg.policy == EMBPS_HINDEX_LFU)
    heap_remove(ix, s);
  else
    queue_remove(ix, s);
}

static void expire(embps_hindex_t *ix) {
  while (ix->nheap && ix->st.clock - ix->score[victim(ix)] > ix->cfg.ttl_steps) {
    uint32_t s = victim(ix);
    order_remove(ix, s);
    map_remove(ix, s);
    ix->key[s] = 0;
    embps__hix_mark(ix, s);
    ix->free[ix->nfree++] = s;
    ix->st.size--;
    ix->st.expired++;
  }
}

/* Grows ix's scratch to at least `bytes`; EMBPS_RESOURCE_EXHAUSTED (ix unchanged) if it cannot. */
static embps_status_t scratch_reserve(embps_hindex_t *ix, size_t bytes) {
  void *p;
  if (bytes <= ix->scratch_bytes)
    return EMBPS_OK;
  if (!(p = embps_malloc(bytes)))
    return EMBPS_RESOURCE_EXHAUSTED;
  embps_free(ix->scratch);
  ix->scratch = p;
  ix->scratch_bytes = bytes;
  return EMBPS_OK;
}

/* Whether keys[0..n) ascend strictly (so are distinct; a 0 can only come first). */
static int strictly_ascending(const uint64_t *keys, size_t n) {
  int bad = 0;
  for (size_t i = 1; i < n; i++)
    bad |= keys[i - 1] >= keys[i];
  return !bad;
}

embps_status_t embps_hindex_step(embps_hindex_t *ix, const uint64_t *keys, size_t n, int64_t *slots,
                                 embps_hindex_fresh_t *fresh, size_t *nfresh) {
  const uint64_t *u;
  uint64_t *scratch, *cand, weight = 0;
  uint32_t *us;                           /* per distinct key: its slot, or EMBPS__HIX_NONE */
  uint32_t *vict, walk = EMBPS__HIX_NONE; /* LRU, TTL: the victims, in order; the next one */
  size_t m = 0, nc = 0, nf = 0, k = 0, z = 0, nfree0, nv = 0, walked = 0, e = 0;
  int lfu = ix->cfg.policy == EMBPS_HINDEX_LFU, sorted;

  if (ix->st.clock == UINT64_MAX)
    return EMBPS_FAILED_PRECONDITION;
  /* The scratch: two halves of n keys (the sort's and its buffer's; the admitted keys' places),
   * a slot per key and a victim per key. */
  if (n > SIZE_MAX / 32 || scratch_reserve(ix, (2 * n + 1) * sizeof(uint64_t) +
                                                   2 * (n + 1) * sizeof(uint32_t)) != EMBPS_OK)
    return EMBPS_RESOURCE_EXHAUSTED;
  scratch = ix->scratch;
  us = (uint32_t *)(scratch + 2 * n + 1);
  vict = us + n + 1;
  /* The distinct nonzero keys, ascending: the caller's own when they are so already (the
   * engine's push passes its dedup's output), else sorted and deduplicated here. */
  if ((sorted = strictly_ascending(keys, n))) {
    z = n > 0 && keys[0] == 0;
    u = keys + z;
    m = n - z;
    cand = scratch;
  } else {
    uint64_t *v;
    for (size_t i = 0; i < n; i++)
      if (keys[i])
        scratch[k++] = keys[i];
    v = sort_keys(scratch, scratch + n, k);
    for (size_t i = 0; i < k; i++)
      if (i == 0 || v[i] != v[i - 1])
        v[m++] = v[i];
    u = v;
    cand = v == scratch ? scratch + n : scratch; /* the other half: the admitted keys' places */
  }

  ix->st.clock++;
  if (lfu)
    weight = lfu_weight(ix);
  else if (ix->cfg.policy == EMBPS_HINDEX_TTL)
    expire(ix);
  /* Touch and pin the stored keys; count the others. The map does not change until every
   * key's slot is known, so one batch lookup finds them all. */
  map_find_batch(ix, u, m, us);
  for (size_t i = 0; i < m; i++) {
    uint32_t s = us[i];
    if (i + AHEAD < m && us[i + AHEAD] != EMBPS__HIX_NONE) { /* a later key's lines */
      __builtin_prefetch(&ix->score[us[i + AHEAD]], 1);
      if (!lfu)
        __builtin_prefetch(&ix->link[2 * (uint64_t)us[i + AHEAD]], 1);
    }
    if (i + AHEAD / 2 < m && !lfu && us[i + AHEAD / 2] != EMBPS__HIX_NONE) {
      /* and, its links arrived, its queue neighbours' (which it rewrites) */
      uint64_t t = us[i + AHEAD / 2];
      uint32_t p = ix->link[2 * t], q = ix->link[2 * t + 1];
      if (p != EMBPS__HIX_NONE)
        __builtin_prefetch(&ix->link[2 * (uint64_t)p], 1);
      if (q != EMBPS__HIX_NONE)
        __builtin_prefetch(&ix->link[2 * (uint64_t)q], 1);
    }
    if (s != EMBPS__HIX_NONE) {
      order_remove(ix, s);
      ix->score[s] = weight ? ix->score[s] + weight : ix->st.clock;
      embps__hix_mark(ix, s);
    } else if (ix->admit_all || ix->cfg.admit_after == 1 ||
               sketch_count(ix, u[i]) >= ix->cfg.admit_after) {
      cand[nc++] = i;
    } else {
      ix->st.not_admitted++;
    }
  }
  /* Give the admitted keys slots, in ascending key order: the free stack's top first, then
   * victims. LRU and TTL: the victims are the queue's first nv keys, in order (no key of this
   * step is in it now), so the queue is cut after them in one piece once they are taken; a
   * walk along it runs ahead of the victims taken (one link per key, a cache miss each, that
   * overlaps the work on earlier keys), so that each victim's key and bucket are prefetched. */
  nfree0 = ix->nfree;
  if (!lfu && nc > nfree0) {
    nv = nc - nfree0 < ix->nheap ? nc - nfree0 : ix->nheap;
    walk = ix->head;
  }
  for (size_t c = 0; c < nc; c++) {
    uint64_t evicted = 0, i = cand[c];
    uint32_t s;
    for (size_t stop = c + 2 * AHEAD; walked < nv && walked + nfree0 < stop; walked++) {
      vict[walked] = walk;
      __builtin_prefetch(&ix->key[walk]);
      walk = ix->link[2 * (uint64_t)walk + 1];
    }
    if (c + AHEAD < nc) { /* a later key's home bucket; its slot's lines and victim's bucket */
      size_t d = c + AHEAD;
      __builtin_prefetch(&ix->buckets[home(ix, key_hash(ix, u[cand[d]]))]);
      if (d < nfree0) {
        __builtin_prefetch(&ix->key[ix->free[nfree0 - 1 - d]], 1);
        __builtin_prefetch(&ix->score[ix->free[nfree0 - 1 - d]], 1);
      } else if (d - nfree0 < nv) {
        uint32_t t = vict[d - nfree0];
        __builtin_prefetch(&ix->buckets[home(ix, key_hash(ix, ix->key[t]))]);
        __builtin_prefetch(&ix->score[t], 1);
      }
    }
    if (ix->nfree) {
      s = ix->free[--ix->nfree];
      if (ix->nfree < ix->low_free)
        ix->low_free = ix->nfree;
    } else if (lfu ? ix->nheap > 0 : e < nv) {
      if (lfu) {
        s = ix->heap[0];
        heap_remove(ix, s);
      } else {
        s = vict[e++];
      }
      evicted = ix->key[s];
      map_remove(ix, s);
      ix->st.evicted++;
      ix->st.size--;
    } else {                    /* every slot holds a key of this step */
      ix->st.refused += nc - c; /* they keep EMBPS__HIX_NONE */
      break;
    }
    embps__hindex_map_insert(ix, u[i], s);
    ix->score[s] = weight ? weight : ix->st.clock;
    embps__hix_mark(ix, s);
    us[i] = s;
    ix->st.size++;
    ix->st.admitted++;
    fresh[nf].key = u[i];
    fresh[nf].evicted = evicted;
    fresh[nf].slot = s;
    nf++;
  }
  if (nv) { /* the victims off the queue: walk is the first key left, if any */
    ix->head = walk;
    if (walk == EMBPS__HIX_NONE)
      ix->tail = EMBPS__HIX_NONE;
    else
      ix->link[2 * (uint64_t)walk] = EMBPS__HIX_NONE;
    ix->nheap -= nv;
  }
  /* Unpin: back into the victim order, in ascending key order (the queue stays sorted). */
  for (size_t i = 0; i < m; i++) {
    if (!lfu && i + AHEAD < m && us[i + AHEAD] != EMBPS__HIX_NONE)
      __builtin_prefetch(&ix->link[2 * (uint64_t)us[i + AHEAD]], 1);
    if (us[i] != EMBPS__HIX_NONE) {
      if (lfu)
        heap_push(ix, us[i]);
      else
        queue_append(ix, us[i]);
    }
  }
  if (sorted) { /* every key's slot is known: no second lookup */
    if (z)
      slots[0] = -1;
    for (size_t i = 0; i < m; i++)
      slots[z + i] = us[i] == EMBPS__HIX_NONE ? -1 : (int64_t)us[i];
  } else {
    embps_hindex_find(ix, keys, n, slots);
  }
  if (nfresh)
    *nfresh = nf;
  return EMBPS_OK;
}

/* ---- for hindex_delta.c ---------------------------------------------------------------------- */

void embps__hindex_map_remove(embps_hindex_t *ix, uint32_t slot) { map_remove(ix, slot); }

void embps__hindex_order_remove(embps_hindex_t *ix, uint32_t s) { order_remove(ix, s); }

void embps__hindex_order_add(embps_hindex_t *ix, uint32_t s) {
  if (ix->cfg.policy == EMBPS_HINDEX_LFU)
    heap_push(ix, s);
  else
    queue_append(ix, s);
}

/* ---- an assign ------------------------------------------------------------------------------- */

embps_status_t embps_hindex_assign(embps_hindex_t *ix, const uint64_t *keys, size_t n,
                                   int64_t *slots, embps_hindex_fresh_t *fresh, size_t *nfresh) {
  embps_status_t ret;
  ix->admit_all = 1;
  ret = embps_hindex_step(ix, keys, n, slots, fresh, nfresh);
  ix->admit_all = 0;
  return ret;
}
