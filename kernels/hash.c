/* Rows of hash-keyed tables: the gather by slot and the reset of slots given to new keys.
 *
 * A hash-keyed table stores a key's row at the slot its index assigned (the index lives above
 * the kernels; here a slot is just a row number of the slice). A key without a slot (never
 * seen, not yet admitted, or the padding key 0) reads its initial row, which is the dense
 * initializer's row numbered by the key (embps_init_key_row_cpu: the same hash of the seed, the
 * key and the column, so every rank computes the same row for its column slice and a restore
 * gets it back without storing it). A slot handed to a new key, fresh or evicted, starts from
 * that key's initial row and the optimizer's initial state, so the table after any sequence of
 * admissions and evictions is a function of that sequence and the seed.
 *
 * The gather's rows may land anywhere in a reply buffer: stored rows are copied with memcpy and
 * initial rows are written byte-wise, so out needs no alignment. Stored rows are prefetched
 * ahead as embps_gather_cpu does; an initial row costs one hash mix per element instead, and a
 * key that repeats within a call copies the row computed for it before. */
#include <string.h>

#include "kernels/embps_kernels.h"

/* The absent keys a gather computed, for its repeats: a direct-mapped table (the key and where
 * its row was written; a colliding key replaces the entry). A lookup's keys repeat (a group of
 * one gathers every token, not the distinct ones), and an absent key's row costs a hash per
 * element (0.54 ns each: 70 ns for 128 f32) where a copy of the row already written costs a
 * few: Zipf lookups of 4096 tokens on a full table that held few of their keys spent 37% of the
 * server's CPU on initial rows, 28% with a table per call. A call alone (embps_hash_gather_cpu)
 * keeps a table of up to 2^SEEN_BITS entries on its stack, sized to twice its rows; a run of
 * calls (embps_hash_gather_seen_cpu: a lookup's chunks) shares the caller's. */
#define SEEN_BITS 10

static void gather(const void *table, embps_dtype_t dtype, size_t width, const int64_t *keys,
                   const int64_t *slots, size_t n, void *out, uint64_t col_begin, uint64_t seed,
                   float scale, embps_hash_seen_entry_t *seen, unsigned bits, uint32_t gen) {
  const size_t row_bytes = width * embps_dtype_size(dtype);
  const unsigned char *src = table;
  unsigned char *dst = out;
  for (size_t i = 0; i < n; i++) {
    if (i + EMBPS_PREFETCH_ROWS < n && slots[i + EMBPS_PREFETCH_ROWS] >= 0)
      embps_prefetch_row(src + (size_t)slots[i + EMBPS_PREFETCH_ROWS] * row_bytes, row_bytes, NULL);
    if (slots[i] >= 0) {
      memcpy(dst + i * row_bytes, src + (size_t)slots[i] * row_bytes, row_bytes);
    } else {
      const uint64_t key = (uint64_t)keys[i];
      embps_hash_seen_entry_t *e = &seen[(key * UINT64_C(0x9e3779b97f4a7c15)) >> (64 - bits)];
      if (key != 0 && e->gen == gen && e->key == key) { /* the row computed for it before */
        memcpy(dst + i * row_bytes, e->row, row_bytes);
        continue;
      }
      embps_init_key_row_cpu(dst + i * row_bytes, dtype, width, key, col_begin, seed, scale);
      if (key != 0)
        e->key = key, e->row = dst + i * row_bytes, e->gen = gen;
    }
  }
}

void embps_hash_gather_cpu(const void *table, embps_dtype_t dtype, size_t width,
                           const int64_t *keys, const int64_t *slots, size_t n, void *out,
                           uint64_t col_begin, uint64_t seed, float scale) {
  embps_hash_seen_entry_t seen[1u << SEEN_BITS];
  unsigned bits = 1;
  while (bits < SEEN_BITS && ((size_t)1 << bits) < 2 * n)
    bits++;
  memset(seen, 0, sizeof(seen[0]) << bits);
  gather(table, dtype, width, keys, slots, n, out, col_begin, seed, scale, seen, bits, 1);
}

void embps_hash_seen_restart(embps_hash_seen_t *seen) {
  if (++seen->gen == 0) {
    memset(seen->e, 0, sizeof(seen->e));
    seen->gen = 1;
  }
}

void embps_hash_gather_seen_cpu(const void *table, embps_dtype_t dtype, size_t width,
                                const int64_t *keys, const int64_t *slots, size_t n, void *out,
                                uint64_t col_begin, uint64_t seed, float scale,
                                embps_hash_seen_t *seen) {
  gather(table, dtype, width, keys, slots, n, out, col_begin, seed, scale, seen->e,
         EMBPS_HASH_SEEN_BITS, seen->gen);
}

void embps_hash_reset_cpu(void *table, embps_dtype_t dtype, size_t width, float *state0,
                          size_t state0_width, float *state1, float state0_value,
                          const int64_t *slots, const int64_t *keys, size_t n, uint64_t col_begin,
                          uint64_t seed, float scale) {
  const size_t row_bytes = width * embps_dtype_size(dtype);
  unsigned char *rows = table;
  for (size_t i = 0; i < n; i++) {
    const size_t s = (size_t)slots[i];
    if (row_bytes) /* a slice of width 0 may have no table, and still a per-row state0 */
      embps_init_key_row_cpu(rows + s * row_bytes, dtype, width, (uint64_t)keys[i], col_begin, seed,
                             scale);
    for (size_t j = 0; j < state0_width; j++)
      state0[s * state0_width + j] = state0_value;
    if (state1)
      for (size_t j = 0; j < width; j++)
        state1[s * width + j] = 0.0f;
  }
}
