/* What the simulated launchers (sim_kernels.c, sim_kernels_tables.c) share: their argument
 * checks and the run-time checks of the rows a kernel is given. Each check that fails is a bug
 * of the caller: it aborts through sim_cuda_fail with the launcher's name, except bad_dtype,
 * which logs and reports the real launcher's refusal (EMBPS_INVALID_ARGUMENT). */
#ifndef EMBPS_SIM_KERNELS_H
#define EMBPS_SIM_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/embps_kernels_cuda.h"
#include "sim_cuda.h"

/* a x b x c bytes, aborting on overflow. */
static inline size_t bytes3(size_t a, size_t b, size_t c, const char *what) {
  if ((b && a > SIZE_MAX / b) || (c && a * b > SIZE_MAX / c))
    sim_cuda_fail("%s: %zu x %zu x %zu bytes overflows", what, a, b, c);
  return a * b * c;
}

static inline int bad_dtype(const char *what, embps_dtype_t dtype) {
  if (embps_dtype_size(dtype) != 0)
    return 0;
  EMBPS_ERROR("%s: invalid dtype %d", what, (int)dtype);
  return 1;
}

/* Every rows[i] must address a whole row of row_bytes inside the allocation that base starts. */
static inline void check_rows(const char *what, const int64_t *rows, size_t n, const void *base,
                              size_t row_bytes, const char *array) {
  size_t have;
  if (row_bytes == 0)
    return;
  have = sim_cuda_device_extent(base, what) / row_bytes;
  for (size_t i = 0; i < n; i++)
    if (rows[i] < 0 || (uint64_t)rows[i] >= have)
      sim_cuda_fail("%s: rows[%zu] = %lld is outside %s (%zu rows of %zu bytes)", what, i,
                    (long long)rows[i], array, have, row_bytes);
}

static inline int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* The updates' and the reset's contract: rows distinct (a GPU would race on a duplicate). Row 0
 * may be among them: a dense table's caller leaves its padding row out (the bitwise comparisons
 * with the CPU show a padding row written), and a hash-keyed table's slot 0 is a row like any
 * other. */
static inline void check_distinct_rows(const char *what, const int64_t *rows, size_t n) {
  int64_t *sorted = malloc(n * sizeof(*sorted));
  if (!sorted)
    sim_cuda_fail("out of host memory");
  memcpy(sorted, rows, n * sizeof(*sorted));
  qsort(sorted, n, sizeof(*sorted), cmp_i64);
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && sorted[i] == sorted[i - 1])
      sim_cuda_fail("%s: row %lld appears twice (rows must be distinct)", what,
                    (long long)sorted[i]);
  }
  free(sorted);
}

#endif
