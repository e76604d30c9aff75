/* Fuzz target: a hash-keyed table's index checkpoint (server/store/hindex_codec.c), as a restore
 * reads it (embps_hindex_decode).
 *
 * The first byte picks how: bit 0 whether the target first rewrites the trailing crc32 to match
 * the bytes (so mutations reach the fields behind it) or leaves it (so the check itself is
 * fuzzed); bits 1-2 the table's settings (one of fuzz_hindex_configs in fuzz_side_files.h: each
 * policy, admission on and off). Checked beyond no crash, leak or undefined behaviour: every
 * refusal is one of the documented statuses with a message naming the bytes; an index that decodes
 * re-encodes to the very bytes it came from (the encoding is canonical), and takes steps
 * afterwards, every key of a step then found at the slot the step gave it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/byteorder.h"
#include "server/store/checkpoint.h"
#include "server/store/hindex.h"
#include "tests/fuzz/fuzz_side_files.h"

#define NAME "ckpt/t.hix"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const embps_hindex_config_t *c;
  embps_hindex_t *ix = NULL;
  embps_error_t err;
  uint8_t *p, *enc;
  size_t n, elen;
  embps_status_t st;

  if (size < 1)
    return 0;
  c = &fuzz_hindex_configs[(data[0] >> 1) & 3];
  p = fuzz_side_file_bytes(data, size, &n);
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
