/* Segment sum fused with the row statistics: what embps_segment_sum_cpu followed by
 * embps_row_partials_cpu on its output computes, bit for bit, in one pass over the gradients.
 *
 * The two-step version writes the num_unique x width sums three times over (the zeroing, the
 * scattered adds, the partials' read): at 65536 x 128 f32 uniform over 1M rows those are 32 MiB
 * each, far beyond the caches. Here a count of each segment's positions (one pass over the
 * segment ids, num_unique uint32s that stay in cache) lets the single forward pass over the
 * positions know a segment's first position, which stores 0.0f + g (exactly what the zeroed
 * accumulator's first add gives, -0.0 included) instead of adding to a zeroed row, and its last,
 * after which the row is complete and still in L1, so its partials are taken right there with
 * embps_row_partials_cpu itself. The order of every sum is unchanged (ascending position within
 * a segment), so the results are the two-step version's bits.
 * Measured on this project's shared 2-core VM, both forms in one program run alternately on
 * the same batches (uniform tokens over 1M rows, width 128 f32, equal bits, medians of 21 and
 * 201): 65536 tokens 6.74 ms against 9.52 ms for segment sum then partials, 4096 tokens
 * 0.160 ms against 0.175 ms. Walking the segments in sorted order instead (a counting sort of
 * the positions, then sequential stores) was slower in a prototype: its gradient reads jump.
 *
 * The gradients are read with memcpy loads, so they may sit at any alignment: the CPU engine
 * reads them in place from the received request, where the bytes field starts wherever the
 * fields before it end. The loads still vectorize (unaligned vector loads; -fopt-info-vec).
 * The next rows' accumulators are prefetched for writing a few positions ahead, as the
 * scattered stores otherwise stall on each miss.
 *
 * The range form sums the segments [seg_lo, seg_hi) alone, so that the CPU engine's threads can
 * share a batch: each walks every position but sums only its own segments, and every segment
 * still has one thread and its order.
 *
 * The count and the positions are separate calls too, so that a caller whose gradients are still
 * arriving (server/service/push_prep.c sums a push while its request is read) can sum the
 * positions already here and come back for the rest: the counts carry what is left of each
 * segment from one call to the next. Measured in the server with timers around the round's
 * steps (a 1M x 128 f32 rowwise Adagrad table, 65536 uniform tokens a push, one and two threads
 * alternating, 4 rounds on the 2-core VM): the update went from 4.4-5.7 ms to 2.6-3.4 ms, this
 * sum only from 5.7-6.3 ms to 5.0-6.2 ms (it reads the gradients just received on the loop's
 * core, and its stores were already prefetched). */
#include <string.h>

#include "kernels/embps_kernels.h"

#define SEEN 0x80000000u /* a segment's count, once its first position has been summed */

size_t embps_segment_sum_stats_workspace_bytes(size_t num_unique) {
  return num_unique * sizeof(uint32_t);
}

static void first_row_f32(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    float v;
    memcpy(&v, g + j * sizeof(float), sizeof(float));
    acc[j] = 0.0f + v;
  }
}

static void add_row_f32(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    float v;
    memcpy(&v, g + j * sizeof(float), sizeof(float));
    acc[j] += v;
  }
}

static void first_row_bf16(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    uint16_t h;
    memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
    acc[j] = 0.0f + embps_bf16_to_f32(h);
  }
}

static void add_row_bf16(float *restrict acc, const unsigned char *restrict g, size_t width) {
  for (size_t j = 0; j < width; j++) {
    uint16_t h;
    memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
    acc[j] += embps_bf16_to_f32(h);
  }
}

void embps_segment_sum_stats_count_cpu(const uint32_t *segment_ids, size_t n, void *workspace,
                                       size_t seg_lo, size_t seg_hi) {
  uint32_t *count = workspace;
  const uint32_t lo = (uint32_t)seg_lo, span = (uint32_t)(seg_hi - seg_lo);
  if (span == 0)
    return;
  memset(count + lo, 0, span * sizeof(uint32_t));
  /* segment_ids[i] - lo < span (unsigned) is the range test: one compare per position. */
  for (size_t i = 0; i < n; i++)
    if (segment_ids[i] - lo < span)
      count[segment_ids[i]]++;
}

void embps_segment_sum_stats_positions_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                           const uint32_t *segment_ids, size_t pos_lo,
                                           size_t pos_hi, size_t block, float *out, float *partials,
                                           void *workspace, size_t seg_lo, size_t seg_hi) {
  const int bf16 = dtype == EMBPS_DTYPE_BF16;
  const size_t in_row = width * embps_dtype_size(dtype), out_row = width * sizeof(float);
  const size_t nb = block ? width / block : 0;
  const unsigned char *g = grads;
  uint32_t *count = workspace;
  const uint32_t lo = (uint32_t)seg_lo, span = (uint32_t)(seg_hi - seg_lo);
  size_t ahead = pos_lo; /* positions before it are prefetched, or not this range's */

  if (span == 0)
    return;
  /* The accumulators are prefetched EMBPS_PREFETCH_ROWS of this range's positions ahead (another
   * range's rows are another thread's to touch): the first ones here, then one more with each
   * position summed. */
  for (size_t k = 0; ahead < pos_hi && k < EMBPS_PREFETCH_ROWS; ahead++)
    if (segment_ids[ahead] - lo < span) {
      embps_prefetch_row(out + (size_t)segment_ids[ahead] * width, out_row, NULL);
      k++;
    }
  for (size_t i = pos_lo; i < pos_hi; i++) {
    const uint32_t s = segment_ids[i];
    if (s - lo >= span)
      continue;
    float *acc = out + (size_t)s * width;
    uint32_t c = count[s];
    while (ahead < pos_hi && segment_ids[ahead] - lo >= span)
      ahead++;
    if (ahead < pos_hi)
      embps_prefetch_row(out + (size_t)segment_ids[ahead++] * width, out_row, NULL);
    if (bf16 && !(c & SEEN))
      first_row_bf16(acc, g + i * in_row, width);
    else if (bf16)
      add_row_bf16(acc, g + i * in_row, width);
    else if (!(c & SEEN))
      first_row_f32(acc, g + i * in_row, width);
    else
      add_row_f32(acc, g + i * in_row, width);
    c = (c | SEEN) - 1;
    count[s] = c;
    if (c == SEEN && nb) /* the segment's last position: its row is complete */
      embps_row_partials_cpu(acc, 1, width, block, partials + (size_t)s * nb);
  }
}

void embps_segment_sum_stats_range_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                       const uint32_t *segment_ids, size_t n, size_t num_unique,
                                       size_t block, float *out, float *partials, void *workspace,
                                       size_t seg_lo, size_t seg_hi) {
  (void)num_unique;
  embps_segment_sum_stats_count_cpu(segment_ids, n, workspace, seg_lo, seg_hi);
  embps_segment_sum_stats_positions_cpu(grads, dtype, width, segment_ids, 0, n, block, out,
                                        partials, workspace, seg_lo, seg_hi);
}

void embps_segment_sum_stats_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                 const uint32_t *segment_ids, size_t n, size_t num_unique,
                                 size_t block, float *out, float *partials, void *workspace) {
  embps_segment_sum_stats_range_cpu(grads, dtype, width, segment_ids, n, num_unique, block, out,
                                    partials, workspace, 0, num_unique);
}
