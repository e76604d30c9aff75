/* Fuzz target: a hash-keyed table's index checkpoint (server/store/hindex_codec.c), as a restore
 * reads it (embps_hindex_decode).
 *
 * The first byte picks how: bit 0 whether the target first rewrites the trailing crc32 to match
 * the bytes (so mutations reach the fields behind it) or leaves it (so the check itself is
 * fuzzed); bits 1-2 the table's settings (one of configs[] below: each policy, admission on and
 * off). Checked beyond no crash, leak or undefined behaviour: every refusal is one of the
 * documented statuses with a message naming the bytes; an index that decodes re-encodes to the
 * very bytes it came from (the encoding is canonical), and takes steps afterwards, every key of a
 * step then found at the slot the step gave it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.h"

#define NAME "ckpt/t.hix"

/* The settings gen_corpus.c writes its seeds with (keep the two in step). */
static const embps_hindex_config_t configs[4] = {
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const embps_hindex_config_t *c;
  embps_hindex_t *ix = NULL;
  embps_error_t err;
  uint8_t *p, *enc;
  size_t n, elen;
  embps_status_t st;

  if (size < 1)
    return 0;
  c = &configs[(data[0] >> 1) & 3];
  n = size - 1;
  if (!(p = malloc(n ? n : 1)))
    abort();
  if (n)
    memcpy(p, data + 1, n);
  if ((data[0] & 1) && n >= 4)
    embps_put_le32(p + n - 4, embps_ckpt_crc32(0, p, n - 4));
  memset(&err, 0, sizeof(err));
  st = embps_hindex_decode(&ix, c, p, n, NAME, &err);
  if (st != EMBPS_OK) {
    if ((st != EMBPS_DATA_LOSS && st != EMBPS_FAILED_PRECONDITION &&
         st != EMBPS_RESOURCE_EXHAUSTED) ||
        ix || err.status != st || !strstr(err.message, NAME))
      abort();
    free(p);
    return 0;
  }
  elen = embps_hindex_encoded_bytes(ix);
  if (elen != n || !(enc = malloc(elen)))
    abort();
  embps_hindex_encode(ix, enc);
  if (memcmp(enc, p, n) != 0)
    abort();
  for (uint64_t s = 0; s < 4; s++) { /* steps go on: keys given slots are found there */
    uint64_t keys[6] = {s + 1, 3, 0, 0x7000 + s, s + 1, UINT64_MAX - s};
    int64_t slots[6], found[6];
    embps_hindex_fresh_t fresh[6];
    size_t nfresh;
    embps_hindex_stats_t stats;
    if ((st = embps_hindex_step(ix, keys, 6, slots, fresh, &nfresh)) != EMBPS_OK) {
      embps_hindex_stats(ix, &stats); /* only a clock at its end stops */
      if (st != EMBPS_FAILED_PRECONDITION || stats.clock != UINT64_MAX)
        abort();
      break;
    }
    embps_hindex_find(ix, keys, 6, found);
    if (memcmp(slots, found, sizeof(slots)) != 0 || slots[2] != -1 || nfresh > 4)
      abort();
    for (size_t i = 0; i < nfresh; i++)
      if (fresh[i].slot >= c->capacity)
        abort();
  }
  free(enc);
  embps_hindex_free(ix);
  free(p);
  return 0;
}
