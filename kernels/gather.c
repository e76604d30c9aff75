/* Row gather and expand: one memcpy per row.
 *
 * Rows are contiguous (row stride == width) and a few hundred bytes to a few KB long, so a
 * memcpy per row is what moves them fastest: libc's memcpy already picks the widest loads and
 * stores for the length, and the work is pure bandwidth. The dtype only sets the row's byte
 * length; no element is converted. Gather reads table rows by id; expand reads the unique rows
 * by segment id to rebuild a batch after dedup. */
#include <string.h>

#include "kernels/embps_kernels.h"

void embps_gather_cpu(const void *table, embps_dtype_t dtype, size_t width, const int64_t *rows,
                      size_t n, void *out) {
  size_t row_bytes = width * embps_dtype_size(dtype);
  const unsigned char *src = table;
  unsigned char *dst = out;
  for (size_t i = 0; i < n; i++) {
    if (i + EMBPS_PREFETCH_ROWS < n)
      embps_prefetch_row(src + (size_t)rows[i + EMBPS_PREFETCH_ROWS] * row_bytes, row_bytes, NULL);
    memcpy(dst + i * row_bytes, src + (size_t)rows[i] * row_bytes, row_bytes);
  }
}

void embps_expand_cpu(const void *src, embps_dtype_t dtype, size_t width,
                      const uint32_t *segment_ids, size_t n, void *out) {
  size_t row_bytes = width * embps_dtype_size(dtype);
  const unsigned char *s = src;
  unsigned char *dst = out;
  for (size_t i = 0; i < n; i++)
    memcpy(dst + i * row_bytes, s + (size_t)segment_ids[i] * row_bytes, row_bytes);
}
