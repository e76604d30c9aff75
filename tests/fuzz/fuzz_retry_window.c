/* Fuzz target: the retry window's checkpoint file (server/group/dedup_codec.c), as every rank
 * reads it at a restore (embps_dedup_decode).
 *
 * The first byte picks how: bit 0 whether the target first rewrites the trailing crc32 to match
 * the bytes (so mutations reach the fields behind it) or leaves it (so the check itself is
 * fuzzed); bits 1-2 the reader's window (1, 2, 4 or 1024 pushes per client), bit 3 its clients
 * (2 or EMBPS_DEDUP_MAX_CLIENTS), so decoding into a smaller window than the writer's is fuzzed
 * too. Checked beyond no crash, leak or undefined behaviour: every refusal is one of the
 * documented statuses with a message naming the file; a window that decodes holds at most
 * window x clients entries, re-encodes to bytes that decode and re-encode to the same bytes
 * (the encoding is canonical), and takes more records afterwards (a push it holds keeps its
 * first answer). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "server/group/dedup.h"
#include "server/store/checkpoint.h"
#include "tests/fuzz/fuzz_side_files.h"

#define NAME "ckpt/RETRY_WINDOW"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint32_t windows[4] = {1, 2, 4, 1024};
  embps_dedup_t *d = NULL, *again = NULL;
  embps_error_t err;
  uint8_t *p, *enc = NULL, *enc2 = NULL;
  size_t n, elen, elen2;
  uint64_t round = 0;
  uint32_t window, clients;
  embps_status_t st;

  if (size < 1)
    return 0;
  window = windows[(data[0] >> 1) & 3];
  clients = data[0] & 8 ? EMBPS_DEDUP_MAX_CLIENTS : 2;
  p = fuzz_side_file_bytes(data, size, &n);
  memset(&err, 0, sizeof(err));
  st = embps_dedup_decode(&d, window, clients, p, n, NAME, &round, &err);
  if (st != EMBPS_OK) {
    if ((st != EMBPS_DATA_LOSS && st != EMBPS_FAILED_PRECONDITION &&
         st != EMBPS_RESOURCE_EXHAUSTED) ||
        d || err.status != st || !strstr(err.message, NAME))
      abort();
    free(p);
    return 0;
  }
  if (embps_dedup_size(d) > (size_t)window * clients)
    abort();
  /* Canonical: what decoded re-encodes to bytes that decode and re-encode the same. */
  if (embps_dedup_encode(d, NULL, round, &enc, &elen) != EMBPS_OK ||
      embps_dedup_decode(&again, window, clients, enc, elen, NAME, NULL, &err) != EMBPS_OK ||
      embps_dedup_size(again) != embps_dedup_size(d) ||
      embps_dedup_encode(again, "", round, &enc2, &elen2) != EMBPS_OK || elen2 != elen ||
      memcmp(enc, enc2, elen) != 0)
    abort();
  for (uint64_t b = 1; b <= 3; b++) { /* a push held keeps its first answer; others record */
    embps_dedup_result_t r = {.applied = 1, .num_unique = b};
    embps_dedup_verdict_t before = embps_dedup_check(d, b, b, b, NULL, NULL);
    if (embps_dedup_record(d, b, b, b, "t", UINT64_MAX, &r) != EMBPS_OK ||
        embps_dedup_check(d, b, b, b, NULL, NULL) !=
            (before == EMBPS_DEDUP_CONFLICT ? EMBPS_DEDUP_CONFLICT : EMBPS_DEDUP_REPLAY))
      abort();
  }
  embps_free(enc);
  embps_free(enc2);
  embps_dedup_free(again);
  embps_dedup_free(d);
  free(p);
  return 0;
}
