/* What the fuzz targets of the checkpoint's side files (fuzz_retry_window.c, fuzz_hindex.c,
 * fuzz_hindex_delta.c) share, and, for the index, the settings and steps gen_corpus.c writes its
 * seeds with: both must agree on them, since an index file is only read for the settings it was
 * written with, and a delta only applies on the index it was taken from. */
#ifndef EMBPS_TESTS_FUZZ_SIDE_FILES_H
#define EMBPS_TESTS_FUZZ_SIDE_FILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.h"

/* A copy of the input after its first byte (*n bytes, malloc'd; never NULL). When bit 0 of the
 * first byte is set, its trailing crc32 is first rewritten to match the bytes before it, so that
 * mutations reach the fields behind the check; else the check itself is fuzzed. size >= 1. */
static inline uint8_t *fuzz_side_file_bytes(const uint8_t *data, size_t size, size_t *n) {
  uint8_t *p;
  *n = size - 1;
  if (!(p = malloc(*n ? *n : 1)))
    abort();
  if (*n)
    memcpy(p, data + 1, *n);
  if ((data[0] & 1) && *n >= 4)
    embps_put_le32(p + *n - 4, embps_ckpt_crc32(0, p, *n - 4));
  return p;
}

/* The index settings fuzz_hindex.c decodes with (bits 1-2 of the first byte pick one) and
 * gen_corpus.c writes a seed for each of. */
static const embps_hindex_config_t fuzz_hindex_configs[4] = {
    {.capacity = 16, .policy = EMBPS_HINDEX_LRU, .admit_after = 1, .seed = 1},
    {.capacity = 16,
     .policy = EMBPS_HINDEX_LFU,
     .admit_after = 2,
     .sketch_width = 8,
     .half_life = 1,
     .seed = 2},
    {.capacity = 16,
     .policy = EMBPS_HINDEX_TTL,
     .admit_after = 3,
     .sketch_width = 4,
     .ttl_steps = 2,
     .seed = 3},
    {.capacity = 5, .policy = EMBPS_HINDEX_LFU, .admit_after = 1, .half_life = 7, .seed = 4},
};

/* Steps [from, to) of the fixed sequence the index seeds are written with (keys 1..40, a few
 * hot; some padding). Aborts on a step's failure. */
static inline void fuzz_hindex_steps(embps_hindex_t *ix, uint64_t from, uint64_t to) {
  uint64_t keys[12];
  int64_t slots[12];
  embps_hindex_fresh_t fresh[12];
  size_t nfresh;
  for (uint64_t step = from; step < to; step++) {
    for (uint64_t k = 0; k < 12; k++)
      keys[k] = (step * 7 + k * k * 3) % (k < 4 ? 5 : 41);
    if (embps_hindex_step(ix, keys, step % 13 == 0 ? 1 : 12, slots, fresh, &nfresh) != EMBPS_OK)
      abort();
  }
}

/* The steps before the capture that fuzz_hindex_delta.c's deltas apply on. */
#define FUZZ_HINDEX_DELTA_BASE 60u

/* A new index of settings i after the steps before the delta seeds' capture, captured there.
 * Aborts when it cannot be made. */
static inline embps_hindex_t *fuzz_hindex_delta_base(unsigned i) {
  embps_hindex_t *ix;
  if (embps_hindex_new(&ix, &fuzz_hindex_configs[i], NULL) != EMBPS_OK)
    abort();
  fuzz_hindex_steps(ix, 0, FUZZ_HINDEX_DELTA_BASE);
  embps_hindex_mark_captured(ix);
  return ix;
}

#endif
