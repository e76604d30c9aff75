/* Segment sum: reduces the gradient rows of duplicate tokens.
 *
 * The output is zeroed, then the input rows are added to their segment's row in ascending
 * position order. That single forward pass fixes the order of every sum (position order within
 * each segment), so the result is deterministic and equals a naive per-segment loop bit for
 * bit, while reading the gradients exactly once, sequentially. The inner loop runs over the
 * width with restrict pointers so it vectorizes; bf16 input is widened to f32 inside it (a bf16
 * is the high half of an f32, so the widening is a shift). Accumulation is in f32 as the
 * contract says; the gradients are themselves f32 or coarser. */
#include <string.h>

#include "kernels/embps_kernels.h"

static void add_row_f32(float *restrict acc, const float *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++)
    acc[j] += g[j];
}

static void add_row_bf16(float *restrict acc, const uint16_t *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++)
    acc[j] += embps_bf16_to_f32(g[j]);
}

void embps_segment_sum_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                           const uint32_t *segment_ids, size_t n, size_t num_unique, float *out) {
  memset(out, 0, num_unique * width * sizeof(float));
  if (dtype == EMBPS_DTYPE_BF16) {
    const uint16_t *g = grads;
    for (size_t i = 0; i < n; i++)
      add_row_bf16(out + (size_t)segment_ids[i] * width, g + i * width, width);
  } else {
    const float *g = grads;
    for (size_t i = 0; i < n; i++)
      add_row_f32(out + (size_t)segment_ids[i] * width, g + i * width, width);
  }
}
