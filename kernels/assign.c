/* Rows written as given (an Assign RPC: warm starts, imports, rows fixed by hand): each row is a
 * copy of the bytes given, so f32 and bf16 rows keep every bit (a NaN's payload included), and
 * its optimizer state, when asked, goes back to the optimizer's initial state as a new table's
 * row starts from it (embps_hash_reset_cpu's values). Rows are distinct, so the order of the
 * writes does not matter; the source rows are prefetched ahead as the gather prefetches table
 * rows. */
#include <string.h>

#include "kernels/embps_kernels.h"

void embps_assign_rows_cpu(void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                           const int64_t *src_rows, size_t n, const void *src, float *state0,
                           size_t state0_width, float *state1, float state0_value) {
  const size_t row_bytes = width * embps_dtype_size(dtype);
  const unsigned char *from = src;
  unsigned char *to = table;
  for (size_t i = 0; i < n; i++) {
    const size_t r = (size_t)rows[i];
    if (i + EMBPS_PREFETCH_ROWS < n)
      embps_prefetch_row(from + (size_t)src_rows[i + EMBPS_PREFETCH_ROWS] * row_bytes, row_bytes,
                         NULL);
    if (row_bytes)
      memcpy(to + r * row_bytes, from + (size_t)src_rows[i] * row_bytes, row_bytes);
    for (size_t j = 0; j < state0_width; j++)
      state0[r * state0_width + j] = state0_value;
    if (state1)
      for (size_t j = 0; j < width; j++)
        state1[r * width + j] = 0.0f;
  }
}
