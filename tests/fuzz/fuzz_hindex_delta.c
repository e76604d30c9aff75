/* Fuzz target: a hash-keyed table's index delta (server/store/hindex_delta.c), as a restore
 * applies it onto the index of the checkpoint before (embps_hindex_delta_apply).
 *
 * The first byte picks how: bit 0 whether the target first rewrites the trailing crc32 to match
 * the bytes (so mutations reach the fields behind it) or leaves it (so the check itself is
 * fuzzed); bits 1-2 the table's settings (one of fuzz_hindex_configs in fuzz_side_files.h). The
 * rest is applied onto the index of those settings after the fixed steps before the seeds'
 * capture (fuzz_hindex_delta_base), which gen_corpus.c's seeds were taken from. Checked beyond no
 * crash, leak or undefined behaviour: every refusal is one of the documented statuses with a
 * message naming the bytes; an index the delta applied to is sound: it is captured (its next
 * delta is empty), its full encoding decodes (decode checks every invariant) and re-encodes to
 * the same bytes, and it takes steps as that decoded copy does. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/store/hindex.h"
#include "tests/fuzz/fuzz_side_files.h"

#define NAME "ckpt/INDEX-t"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const embps_hindex_config_t *c;
  embps_hindex_t *ix, *copy = NULL;
  embps_error_t err;
  uint8_t *p, *enc, *enc2;
  size_t n, elen, empty;
  embps_status_t st;

  if (size < 1)
    return 0;
  c = &fuzz_hindex_configs[(data[0] >> 1) & 3];
  ix = fuzz_hindex_delta_base((data[0] >> 1) & 3);
  empty = embps_hindex_delta_bytes(ix); /* a delta of nothing: what a captured index gives */
  p = fuzz_side_file_bytes(data, size, &n);
  memset(&err, 0, sizeof(err));
  st = embps_hindex_delta_apply(ix, p, n, NAME, &err);
  if (st != EMBPS_OK) {
    if ((st != EMBPS_DATA_LOSS && st != EMBPS_FAILED_PRECONDITION &&
         st != EMBPS_RESOURCE_EXHAUSTED) ||
        err.status != st || !strstr(err.message, NAME))
      abort();
    embps_hindex_free(ix);
    free(p);
    return 0;
  }
  if (embps_hindex_delta_bytes(ix) != empty)
    abort();
  elen = embps_hindex_encoded_bytes(ix);
  if (!(enc = malloc(elen)) || !(enc2 = malloc(elen)))
    abort();
  embps_hindex_encode(ix, enc);
  if (embps_hindex_decode(&copy, c, enc, elen, NAME, &err) != EMBPS_OK ||
      embps_hindex_encoded_bytes(copy) != elen)
    abort();
  embps_hindex_encode(copy, enc2);
  if (memcmp(enc, enc2, elen) != 0)
    abort();
  for (uint64_t s = 0; s < 4; s++) { /* steps go on, as on the decoded copy */
    uint64_t keys[6] = {s + 1, 3, 0, 0x7000 + s, s + 1, UINT64_MAX - s};
    int64_t slots[6], slots2[6];
    embps_hindex_fresh_t fresh[6], fresh2[6];
    size_t nfresh, nfresh2;
    embps_status_t a = embps_hindex_step(ix, keys, 6, slots, fresh, &nfresh);
    embps_status_t b = embps_hindex_step(copy, keys, 6, slots2, fresh2, &nfresh2);
    if (a != b)
      abort();
    if (a != EMBPS_OK)
      break;
    if (memcmp(slots, slots2, sizeof(slots)) != 0 || nfresh != nfresh2)
      abort();
    for (size_t i = 0; i < nfresh; i++)
      if (fresh[i].slot != fresh2[i].slot || fresh[i].key != fresh2[i].key ||
          fresh[i].evicted != fresh2[i].evicted || fresh[i].slot >= c->capacity)
        abort();
  }
  free(enc);
  free(enc2);
  embps_hindex_free(copy);
  embps_hindex_free(ix);
  free(p);
  return 0;
}
