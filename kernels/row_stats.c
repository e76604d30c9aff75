/* Row statistics: the sums of squares of gradient rows, in column blocks that every group size
 * computes alike.
 *
 * A group splits a table's columns over its ranks, and every rank needs each row's sum of
 * squares over the full width (rowwise Adagrad's mean square, the gradient norm, the finite
 * check). If each rank summed its whole slice and the ranks then added their sums, the order
 * of the additions would change with the group size, and so would the last bit of the table.
 * Instead the sum is taken over fixed blocks of EMBPS_ROW_STATS_BLOCK columns (the partials),
 * which are the same numbers whichever rank holds the block, and the partials of a row are
 * added in column order (the combine). So a group whose shard width is a multiple of the block
 * gives a row sum equal bit for bit to one rank's.
 *
 * A block is squared and summed in double, in EMBPS_LANES interleaved partial sums added in a
 * fixed order at the end: independent lanes let the compiler vectorize a reduction it may not
 * reorder. Double cannot overflow for finite f32 input (FLT_MAX^2 ~ 1e77), so a block's sum is
 * finite if and only if every element of the block is; the partial is that sum rounded to f32
 * (which is what the group exchanges: half the bytes of a double), saturating at FLT_MAX so
 * that a partial, too, is finite exactly when its elements are. The combine adds a row's
 * partials in double, so a row's sum is finite if and only if the row is: the finite check
 * costs nothing more. The total is the sum of the rows' double sums in row order.
 *
 * The combine can run whole on every rank (embps_row_combine_cpu, over every rank's partials) or
 * split by owner: each rank adds the partials of its own range of rows (embps_row_sums_cpu, the
 * same additions in the same order), the ranks exchange those double sums, and every rank
 * finishes in row order (embps_row_finish_cpu). Both give the same bits (engine.c picks one). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels/embps_kernels.h"

#define EMBPS_LANES 8

size_t embps_row_stats_block(size_t width) {
  size_t a = EMBPS_ROW_STATS_BLOCK, b = width;
  if (width == 0)
    return 0;
  while (b) { /* gcd: the block itself whenever it divides the width */
    size_t r = a % b;
    a = b;
    b = r;
  }
  return a;
}

/* Element j of a row at any alignment, squared in double: memcpy loads compile to plain
 * unaligned vector loads, so a row may be read where it arrived (a request's bytes field) and
 * not staged first. Staging cost more than it saved: a row copied to the stack in 16-byte stores
 * and read back in 32-byte loads cannot be forwarded from the store buffer, and the loads wait
 * for the stores to retire (segment_sum_stats.c has the figures). */
static inline double sq(const unsigned char *g, size_t j) {
  float v;
  memcpy(&v, g + j * sizeof(float), sizeof(float));
  return (double)v * (double)v;
}

/* The lanes are explicit, so a wider vector unit runs the same additions in the same order:
 * an AVX2 clone (picked at load time where the CPU has it; gcc on x86-64) gives the same bits.
 * The loop is bound by its convert/multiply/add count, not by memory: partials of 65536 x 128
 * f32 took 3.14 ms plain and 1.39 ms with the clone, 4096 x 128 0.188 and 0.082 ms (this
 * project's 2-core VM, both built in one program and run alternately, medians of 21 and 201,
 * equal bits). Cloning embps_row_partials_cpu instead gained nothing (3.13 ms). */
/* Not under ThreadSanitizer: the clone's ifunc resolver runs while the dynamic loader relocates
 * the binary, before TSan's runtime is up, and the server segfaulted there at startup. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
static double
block_sumsq(const unsigned char *restrict g, size_t len) {
  double lane[EMBPS_LANES] = {0};
  size_t j = 0;
  for (; j + EMBPS_LANES <= len; j += EMBPS_LANES)
    for (size_t l = 0; l < EMBPS_LANES; l++)
      lane[l] += sq(g, j + l);
  for (size_t l = 0; j < len; j++, l++)
    lane[l] += sq(g, j);
  double s = 0.0;
  for (size_t l = 0; l < EMBPS_LANES; l++)
    s += lane[l];
  return s;
}

float embps_row_stats_partial(double sumsq) {
  float f = (float)sumsq;
  return isinf(f) && isfinite(sumsq) ? FLT_MAX : f;
}

/* Four whole blocks of EMBPS_ROW_STATS_BLOCK (32) columns at once, with AVX2, each block's bits
 * those of block_sumsq: block q's lane l (l = 0..7, columns j = l mod 8) is the l % 4 element of
 * lo[q] (l < 4) or hi[q] (l >= 4), added in the same column order, and the lanes are then added
 * in lane order 0..7 for the four blocks at once, after a transpose (lane l of the four blocks
 * in one vector). The product of two f32 values is exact in double, so the multiply and add
 * round as the scalar ones do. block_sumsq's loop, one block per call, is bound by its
 * conversions and by the serial lane sum at its end; four interleaved blocks keep more of them
 * in flight. Measured on this project's shared 2-core VM (a throwaway program, 64 rows of 128 f32
 * in L1 summed 1024 times, CPU time, medians of 7, equal bits): 1.90 against 2.17 ms; on the
 * server's push the row statistics were 16% of its CPU (perf, DLRM feature push). */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define EMBPS_QUAD_BLOCKS 1
__attribute__((target("avx2"))) static void quad_blocks_avx2(const unsigned char *restrict g,
                                                             double out[4]) {
  /* named, not an array indexed in a loop: gcc kept such an array on the stack */
  __m256d lo0 = _mm256_setzero_pd(), lo1 = lo0, lo2 = lo0, lo3 = lo0;
  __m256d hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0;
#define EMBPS_QUAD_STEP(q, lo, hi)                                                                 \
  do {                                                                                             \
    __m256 x;                                                                                      \
    memcpy(&x, g + ((size_t)(q)*32 + j) * sizeof(float), sizeof(x));                               \
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));                                        \
    __m256d c = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));                                      \
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));                                                   \
    hi = _mm256_add_pd(hi, _mm256_mul_pd(c, c));                                                   \
  } while (0)
  for (size_t j = 0; j < 32; j += EMBPS_LANES) {
    EMBPS_QUAD_STEP(0, lo0, hi0);
    EMBPS_QUAD_STEP(1, lo1, hi1);
    EMBPS_QUAD_STEP(2, lo2, hi2);
    EMBPS_QUAD_STEP(3, lo3, hi3);
  }
#undef EMBPS_QUAD_STEP
  const __m256d lo[4] = {lo0, lo1, lo2, lo3}, hi[4] = {hi0, hi1, hi2, hi3};
  __m256d s = _mm256_setzero_pd();
  for (int h = 0; h < 2; h++) {
    const __m256d *v = h ? hi : lo;
    __m256d t0 = _mm256_unpacklo_pd(v[0], v[1]); /* v0[0] v1[0] v0[2] v1[2] */
    __m256d t1 = _mm256_unpackhi_pd(v[0], v[1]); /* v0[1] v1[1] v0[3] v1[3] */
    __m256d t2 = _mm256_unpacklo_pd(v[2], v[3]);
    __m256d t3 = _mm256_unpackhi_pd(v[2], v[3]);
    s = _mm256_add_pd(s, _mm256_permute2f128_pd(t0, t2, 0x20)); /* lane 0 (or 4) */
    s = _mm256_add_pd(s, _mm256_permute2f128_pd(t1, t3, 0x20)); /* lane 1 */
    s = _mm256_add_pd(s, _mm256_permute2f128_pd(t0, t2, 0x31)); /* lane 2 */
    s = _mm256_add_pd(s, _mm256_permute2f128_pd(t1, t3, 0x31)); /* lane 3 */
  }
  _mm256_storeu_pd(out, s);
}

static int have_avx2(void) {
  static int known = -1; /* the same answer on every thread */
  int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (k < 0) {
    k = __builtin_cpu_supports("avx2") ? 1 : 0;
    __atomic_store_n(&known, k, __ATOMIC_RELAXED);
  }
  return k;
}
#endif

void embps_row_partials_at_cpu(const void *row, size_t width, size_t block, float *partials) {
  const unsigned char *g = row;
  const size_t nb = block ? width / block : 0;
  size_t b = 0;
#if defined(EMBPS_QUAD_BLOCKS)
  _Static_assert(EMBPS_LANES == 8 && EMBPS_ROW_STATS_BLOCK == 32, "quad_blocks_avx2's shape");
  if (block == 32 && nb >= 4 && have_avx2())
    for (; b + 4 <= nb; b += 4) {
      double s[4];
      quad_blocks_avx2(g + b * block * sizeof(float), s);
      for (int q = 0; q < 4; q++)
        partials[b + q] = embps_row_stats_partial(s[q]);
    }
#endif
  for (; b < nb; b++)
    partials[b] = embps_row_stats_partial(block_sumsq(g + b * block * sizeof(float), block));
}

void embps_row_partials_cpu(const float *g, size_t n, size_t width, size_t block, float *partials) {
  const size_t nb = block ? width / block : 0;
  for (size_t i = 0; i < n; i++)
    embps_row_partials_at_cpu(g + i * width, width, block, partials + i * nb);
}

/* Row i's sum: its partials in double, slice by slice (row i of slice r at (r * stride + i) * nb)
 * and block by block. The combine and the owner's sums both add through this, so their orders
 * are one. */
static inline double row_sum(const float *partials, size_t slices, size_t stride, size_t i,
                             size_t nb) {
  double s = 0.0;
  for (size_t r = 0; r < slices; r++) {
    const float *p = partials + (r * stride + i) * nb;
    for (size_t b = 0; b < nb; b++)
      s += (double)p[b];
  }
  return s;
}

size_t embps_row_combine_cpu(const float *partials, size_t slices, size_t n, size_t nb,
                             float *row_sumsq, double *total_sumsq) {
  size_t bad = 0;
  double total = 0.0;
  for (size_t i = 0; i < n; i++) {
    double s = row_sum(partials, slices, n, i, nb);
    bad += !isfinite(s);
    if (row_sumsq)
      row_sumsq[i] = (float)s;
    total += s;
  }
  if (total_sumsq)
    *total_sumsq += total;
  return bad;
}

void embps_row_sums_cpu(const float *partials, size_t slices, size_t stride, size_t n, size_t nb,
                        double *sums) {
  for (size_t i = 0; i < n; i++)
    sums[i] = row_sum(partials, slices, stride, i, nb);
}

size_t embps_row_finish_cpu(const double *sums, size_t n, float *row_sumsq, double *total_sumsq) {
  size_t bad = 0;
  double total = 0.0;
  for (size_t i = 0; i < n; i++) {
    double s = sums[i];
    bad += !isfinite(s);
    if (row_sumsq)
      row_sumsq[i] = (float)s;
    total += s;
  }
  if (total_sumsq)
    *total_sumsq += total;
  return bad;
}
