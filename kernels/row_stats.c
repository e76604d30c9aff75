/* Row statistics: per-row and total sums of squares, and the non-finite count.
 *
 * Each row is squared and summed in double, in EMBPS_LANES interleaved partial sums that are
 * combined in a fixed order at the end: independent lanes let the compiler vectorize a
 * reduction it may not reorder, and the order (hence the result) never changes. In double the
 * error of the sum stays far below the final f32 rounding for any realistic width (a naive
 * f32 running sum loses small squares next to a large one), and double
 * cannot overflow for finite f32 input (FLT_MAX^2 ~ 1e77), so a row's double sum is finite if
 * and only if every element of the row is. That gives the non-finite check for free: only a
 * row whose sum is not finite is scanned again to count its NaNs and infinities. The total is
 * the sum of the rows' double sums in row order. */
#include <math.h>

#include "kernels/embps_kernels.h"

#define EMBPS_LANES 8

static double row_sumsq_f64(const float *restrict g, size_t width) {
  double lane[EMBPS_LANES] = {0};
  size_t j = 0;
  for (; j + EMBPS_LANES <= width; j += EMBPS_LANES)
    for (size_t l = 0; l < EMBPS_LANES; l++)
      lane[l] += (double)g[j + l] * (double)g[j + l];
  for (size_t l = 0; j < width; j++, l++)
    lane[l] += (double)g[j] * (double)g[j];
  double s = 0.0;
  for (size_t l = 0; l < EMBPS_LANES; l++)
    s += lane[l];
  return s;
}

size_t embps_row_stats_cpu(const float *g, size_t n, size_t width, float *row_sumsq,
                           double *total_sumsq) {
  size_t bad = 0;
  double total = 0.0;
  for (size_t i = 0; i < n; i++) {
    const float *row = g + i * width;
    double s = row_sumsq_f64(row, width);
    if (!isfinite(s)) {
      for (size_t j = 0; j < width; j++)
        bad += !isfinite(row[j]);
    }
    if (row_sumsq)
      row_sumsq[i] = (float)s;
    total += s;
  }
  if (total_sumsq)
    *total_sumsq += total;
  return bad;
}
