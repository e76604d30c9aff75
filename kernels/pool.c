/* Feature batches' bags (docs/design.md, "Feature batches"): pooling a bag's rows into one f32
 * row, and expanding a bag's gradient to its ids.
 *
 * Each output column is added in the bag's order, in f32, one multiply per weighted id (no FMA:
 * this library is built with -ffp-contract=off), so a rank's columns of a pooled row are the same
 * whichever rank computes them and however many ranks share the width. A mean divides the sum by
 * the bag's nonzero ids, once per element; a bag of no nonzero ids pools to zeros. The
 * expansion is the same arithmetic a worker that expanded its gradients itself would do:
 * the bag's gradient times the id's weight, or over the bag's nonzero ids, rounded once to the
 * table's dtype. A push need not write that expansion out (one row per id: 224 MB a step for
 * 2048 samples of the DLRM feature set at 128 f32): embps_bag_sources_cpu says, per position,
 * which bag row it comes from and how, and the fused segment sum (segment_sum_stats.c) expands
 * each position as it adds it.
 *
 * A pooling reads its rows at random over the table, so each id's row is prefetched
 * EMBPS_PREFETCH_ROWS ids ahead, as the gather does: the 26 DLRM features over 26 tables of
 * 20000 x 128 f32, 2048 samples, took 37.6 / 37.0 ms against 40.5 / 39.0 ms without (a throwaway
 * program, medians of 15, two runs, this project's shared 2-core VM). Later the lookup's server
 * spent 74% of its CPU in this loop, most of it stalled on the prefetch itself (perf annotate):
 * eight rows of eight lines ahead, for writing and non-temporal (embps_prefetch_row's form, made
 * for updates), fill the core's line-fill buffers. Rows are only read here, so they are
 * prefetched for reading into L2 (locality 2), POOL_AHEAD ids ahead: 438k rows at random over
 * 26 x 20000 x 128 f32 into bags of 8, a throwaway program, CPU time, best of 7, three runs:
 * 49.8 / 50.8 / 48.9 ms as before, 41.3 / 41.6 / 39.9 ms so, 69.2 / 67.0 / 65.8 ms with none;
 * 8 ids ahead at locality 3 gave 44.4 / 44.4 / 43.4 ms, 24 at locality 2 about 16's. */
#include <string.h>

#include "kernels/embps_kernels.h"

#define POOL_AHEAD 16 /* ids ahead whose rows a pooling prefetches */

/* The nonzero ids of a bag. */
static uint32_t nonzero(const int64_t *ids, size_t n) {
  uint32_t c = 0;
  for (size_t i = 0; i < n; i++)
    c += ids[i] != 0;
  return c;
}

/* acc[j] += x[j] * wgt (weighted) or x[j], for row r of the table (or the key's initial row when
 * r < 0), through tmp (2 x width floats). */
static void add_row(float *restrict acc, const void *table, embps_dtype_t dtype, size_t width,
                    int64_t r, uint64_t key, const float *weight, float *restrict tmp,
                    uint64_t col_begin, uint64_t seed, float scale) {
  const void *row = tmp + width;
  const float *x;
  if (r >= 0)
    row = (const uint8_t *)table + (size_t)r * width * embps_dtype_size(dtype);
  else /* in the table's dtype, as the key would read alone */
    embps_init_key_row_cpu(tmp + width, dtype, width, key, col_begin, seed, scale);
  if (dtype == EMBPS_DTYPE_BF16) {
    const uint16_t *b = row;
    for (size_t j = 0; j < width; j++)
      tmp[j] = embps_bf16_to_f32(b[j]);
    x = tmp;
  } else {
    x = row;
  }
  if (weight) {
    const float wgt = *weight;
    for (size_t j = 0; j < width; j++)
      acc[j] += x[j] * wgt;
  } else {
    for (size_t j = 0; j < width; j++)
      acc[j] += x[j];
  }
}

void embps_pool_bags_cpu(const void *table, embps_dtype_t dtype, size_t width, const int64_t *ids,
                         const int64_t *rows, const float *weights, const int64_t *offsets,
                         size_t num_bags, int mean, float *out, float *tmp, uint64_t col_begin,
                         uint64_t seed, float scale) {
  const size_t last = num_bags ? (size_t)offsets[num_bags] : 0;
  const size_t row_bytes = width * embps_dtype_size(dtype);
  for (size_t k = 0; k < num_bags; k++) {
    float *restrict acc = out + k * width;
    const size_t a = (size_t)offsets[k], b = (size_t)offsets[k + 1];
    uint32_t c = 0;
    memset(acc, 0, width * sizeof(float));
    for (size_t p = a; p < b; p++) {
      if (p + POOL_AHEAD < last && rows[p + POOL_AHEAD] >= 0) {
        const uint8_t *ahead = (const uint8_t *)table + (size_t)rows[p + POOL_AHEAD] * row_bytes;
        for (size_t off = 0; off < row_bytes; off += 64)
          __builtin_prefetch(ahead + off, 0, 2);
      }
      if (ids[p] == 0)
        continue; /* padding */
      c++;
      add_row(acc, table, dtype, width, rows[p], (uint64_t)ids[p], weights ? &weights[p] : NULL,
              tmp, col_begin, seed, scale);
    }
    for (size_t j = 0; mean && c > 0 && j < width; j++)
      acc[j] = acc[j] / (float)c;
  }
}

void embps_expand_bags_cpu(const float *g, size_t width, const int64_t *ids, const float *weights,
                           const int64_t *offsets, size_t num_bags, int mean, embps_dtype_t dtype,
                           void *out) {
  const size_t es = embps_dtype_size(dtype);
  for (size_t k = 0; k < num_bags; k++) {
    const float *gk = g + k * width;
    const size_t a = (size_t)offsets[k], b = (size_t)offsets[k + 1];
    const float c = mean ? (float)nonzero(ids + a, b - a) : 1.0f;
    for (size_t p = a; p < b; p++) {
      uint8_t *o = (uint8_t *)out + p * width * es;
      for (size_t j = 0; j < width; j++) {
        float v = ids[p] == 0 ? 0.0f : weights ? gk[j] * weights[p] : mean ? gk[j] / c : gk[j];
        if (dtype == EMBPS_DTYPE_BF16) {
          uint16_t h = embps_f32_to_bf16(v);
          memcpy(o + j * 2, &h, 2);
        } else {
          memcpy(o + j * 4, &v, 4);
        }
      }
    }
  }
}

void embps_bag_sources_cpu(const int64_t *ids, const float *weights, const int64_t *offsets,
                           size_t num_bags, int mean, uint32_t first_bag, size_t n,
                           embps_bag_source_t *out) {
  if (!offsets) {
    for (size_t p = 0; p < n; p++)
      out[p] = (embps_bag_source_t){EMBPS_BAG_OWN, 0, 0.0f};
    return;
  }
  for (size_t k = 0; k < num_bags; k++) {
    const size_t a = (size_t)offsets[k], b = (size_t)offsets[k + 1];
    const float c = mean ? (float)nonzero(ids + a, b - a) : 1.0f;
    const uint32_t bag = first_bag + (uint32_t)k;
    for (size_t p = a; p < b; p++)
      out[p] = ids[p] == 0 ? (embps_bag_source_t){EMBPS_BAG_PAD, bag, 0.0f}
               : weights   ? (embps_bag_source_t){EMBPS_BAG_WEIGHTED, bag, weights[p]}
               : mean      ? (embps_bag_source_t){EMBPS_BAG_MEAN, bag, c}
                           : (embps_bag_source_t){EMBPS_BAG_SUM, bag, 1.0f};
  }
}
