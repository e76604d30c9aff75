/* A feature push's segment sum, fused with the expansion of its bags (docs/design.md, "Feature
 * batches"): what embps_expand_bags_cpu (rounded to the table's dtype) followed by
 * embps_segment_sum_stats_cpu computes, bit for bit, without writing the expanded rows. Those
 * were one row per id: 224 MB a step for 2048 samples of the DLRM feature set at 128 f32, written
 * and then read again at random by the sum.
 *
 * Each position's row is made from its bag's pooled gradient as it is added (embps_bag_source_t
 * says which bag and how): a sum's bag row on an f32 table is the expanded row itself and is added
 * from where it is; anything else is expanded on the stack, STREAM_COLS columns at a time, with
 * exactly embps_expand_bags_cpu's arithmetic and its one rounding to bf16 (then widened back, the
 * value the sum of the expanded rows would read). A position of a feature without pooling reads
 * its own row of grads, in the table's dtype.
 *
 * The walk is by segment, not by position: the dedup's sort (embps_dedup_sorted_cpu) hands over
 * each segment's positions, ascending, so each unique row is summed whole while it sits in L1,
 * its row statistics taken right after, and the rows written in ascending order once. The
 * by-position walk of segment_sum_stats.c scatters its additions over all the sums (10 MB for
 * 20000 unique rows of 128 f32) because its gradient rows are far bigger; here the rows read at
 * random are the bags' (2048 x 512 bytes for one feature at 128 f32), which stay in L2. The
 * sums' additions are the same (0.0f + g for a first position, then += g, in f32, in position
 * order), and the partials are embps_row_partials_cpu of the finished row, as the two-step form
 * takes them, so the bits are the same. Measured with a throwaway program on this project's
 * shared 2-core VM (2048 samples of sum-pooled bags of k ids uniform over 20000 rows, 128 f32,
 * medians of 15, summed over the DLRM feature sizes 100, 27, 12, 10, 9, 8, 7, 6, 6, 5, 3, 3, 3,
 * 2, 2, 1; two runs): expand then segment_sum_stats 99 / 68 ms, a first version of this file
 * walking the positions in order (the sums scattered as in segment_sum_stats.c) 56 / 42 ms, by
 * segment (with a counting sort of its own, before the dedup handed its order over) 45 / 27 ms;
 * for k = 100 alone by position was ahead (11.4 against 13.1 ms). Prefetching the next
 * positions' bag rows changed nothing measurable (48.8 against 49.0 ms). Taking the dedup's
 * order instead of that counting sort (which each engine thread repeated over every position):
 * k = 100 17.0 against 19.1 ms, k = 27 5.0 against 5.4 ms, the sorted dedup itself no slower (4.0
 * against 4.7 ms at k = 100; one run under load). In the server the walk then stalled on each
 * position's source (perf annotate): sources are in position order, 12 bytes each, so the walk
 * reads them at random over 5 MB a DLRM step. So the source is prefetched 2 x AHEAD positions
 * ahead and its bag row AHEAD ahead: the 26 DLRM features 18.0 / 19.4 / 21.1 ms against 24.2 /
 * 26.3 / 29.0 ms without (a throwaway program, the sizes above and ten of 1, medians of 15,
 * three runs under load). The earlier prefetch of bag rows alone had tested a walk whose
 * sources were read in order.
 *
 * The range form sums the segments [seg_lo, seg_hi) alone, for the CPU engine's threads: the
 * segments are disjoint, so the calls write disjoint rows. */
#include <string.h>

#include "kernels/embps_kernels.h"

#define AHEAD 8
#define STREAM_COLS 256 /* columns of an expanded row made on the stack at a time */

static void row_f32(float *restrict acc, const unsigned char *restrict g, size_t width, int first) {
  float v;
  if (first) {
    for (size_t j = 0; j < width; j++) {
      memcpy(&v, g + j * sizeof(float), sizeof(float));
      acc[j] = 0.0f + v;
    }
    return;
  }
  for (size_t j = 0; j < width; j++) {
    memcpy(&v, g + j * sizeof(float), sizeof(float));
    acc[j] += v;
  }
}

static void row_bf16(float *restrict acc, const unsigned char *restrict g, size_t width,
                     int first) {
  uint16_t h;
  if (first) {
    for (size_t j = 0; j < width; j++) {
      memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
      acc[j] = 0.0f + embps_bf16_to_f32(h);
    }
    return;
  }
  for (size_t j = 0; j < width; j++) {
    memcpy(&h, g + j * sizeof(uint16_t), sizeof(uint16_t));
    acc[j] += embps_bf16_to_f32(h);
  }
}

/* Element j of a bag row, by a memcpy load: the bags may be read where a request's bytes
 * field holds them, at any byte (a group of one: features.c), as row_f32 reads them. */
static inline float bag_at(const unsigned char *b, size_t j) {
  float v;
  memcpy(&v, b + j * sizeof(float), sizeof(float));
  return v;
}

/* Columns [off, off + len) of the row embps_expand_bags_cpu writes for a position with source
 * src, as f32 (on a bf16 table rounded to bf16 and widened back). */
static void expand_cols(float *restrict tmp, const float *restrict bags,
                        const embps_bag_source_t *src, size_t width, size_t off, size_t len,
                        int bf16) {
  const unsigned char *restrict b = (const unsigned char *)(bags + (size_t)src->bag * width + off);
  const float f = src->factor;
  switch (src->mode) {
  case EMBPS_BAG_SUM:
    memcpy(tmp, b, len * sizeof(float));
    break;
  case EMBPS_BAG_WEIGHTED:
    for (size_t j = 0; j < len; j++)
      tmp[j] = bag_at(b, j) * f;
    break;
  case EMBPS_BAG_MEAN:
    for (size_t j = 0; j < len; j++)
      tmp[j] = bag_at(b, j) / f;
    break;
  default: /* padding */
    memset(tmp, 0, len * sizeof(float));
    break;
  }
  for (size_t j = 0; bf16 && j < len; j++)
    tmp[j] = embps_bf16_to_f32(embps_f32_to_bf16(tmp[j]));
}

/* Position i's row added to acc (first: stored as 0.0f + g). */
static void add_position(float *restrict acc, const unsigned char *grads, size_t in_row, int bf16,
                         const float *bags, const embps_bag_source_t *src, size_t i, size_t width,
                         int first) {
  float tmp[STREAM_COLS];
  if (src->mode == EMBPS_BAG_OWN) {
    if (bf16)
      row_bf16(acc, grads + i * in_row, width, first);
    else
      row_f32(acc, grads + i * in_row, width, first);
    return;
  }
  if (src->mode == EMBPS_BAG_SUM && !bf16) {
    row_f32(acc, (const unsigned char *)(bags + (size_t)src->bag * width), width, first);
    return;
  }
  for (size_t off = 0; off < width; off += STREAM_COLS) {
    const size_t len = width - off < STREAM_COLS ? width - off : STREAM_COLS;
    expand_cols(tmp, bags, src, width, off, len, bf16);
    row_f32(acc + off, (const unsigned char *)tmp, len, first);
  }
}

void embps_segment_sum_bags_range_cpu(const void *grads, embps_dtype_t dtype, size_t width,
                                      const float *bags, const embps_bag_source_t *sources,
                                      const uint32_t *order, const uint32_t *starts, size_t block,
                                      float *out, float *partials, size_t seg_lo, size_t seg_hi) {
  const int bf16 = dtype == EMBPS_DTYPE_BF16;
  const size_t in_row = width * embps_dtype_size(dtype);
  const size_t nb = block ? width / block : 0;
  const uint32_t last = starts[seg_hi];
  for (size_t s = seg_lo; s < seg_hi; s++) {
    float *restrict acc = out + s * width;
    for (uint32_t k = starts[s]; k < starts[s + 1]; k++) {
      if (k + 2 * AHEAD < last) /* the source two steps ahead, its bag row one step ahead */
        __builtin_prefetch(&sources[order[k + 2 * AHEAD]], 0, 3);
      if (k + AHEAD < last) {
        const embps_bag_source_t *next = &sources[order[k + AHEAD]];
        if (next->mode != EMBPS_BAG_OWN)
          for (size_t j = 0; j < width; j += 16)
            __builtin_prefetch(bags + (size_t)next->bag * width + j, 0, 3);
      }
      add_position(acc, grads, in_row, bf16, bags, &sources[order[k]], order[k], width,
                   k == starts[s]);
    }
    if (nb)
      embps_row_partials_cpu(acc, 1, width, block, partials + s * nb);
  }
}
