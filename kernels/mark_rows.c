/* Row marks: a bitmap of the rows a batch wrote, bit (r % 64) of word r / 64 for row r.
 *
 * Incremental checkpoints write only the rows written since the previous checkpoint; the engine
 * marks the unique rows of every applied update here, and a checkpoint takes the bitmap and
 * clears it. Setting a bit is idempotent, so repeated rows and the order of the rows do not
 * change the result: the CUDA twin (kernels/cuda/mark_rows.cu) sets the bits with atomic ORs in
 * any order and still gives this bitmap bit for bit. */
#include "kernels/embps_kernels.h"

void embps_mark_rows_cpu(uint64_t *bits, const int64_t *rows, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const uint64_t r = (uint64_t)rows[i];
    bits[r >> 6] |= UINT64_C(1) << (r & 63);
  }
}
