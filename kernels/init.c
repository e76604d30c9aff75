/* Deterministic table initializer.
 *
 * Element (row, col) of a table is a pure function of (seed, row, col): a splitmix64
 * finalizer (Stafford's "Mix13", a bijection on 64 bits with full avalanche) is applied to the
 * seed, then to that mixed with the row, then to that mixed with the column. Because nothing
 * depends on the slice being filled, a table split by columns over any number of ranks holds
 * exactly the values of the unsplit table, and a table re-initialized after a restart is
 * identical. The top 24 bits of the hash become k in [0, 2^24); k * 2^-23 - 1 is exact in f32
 * and lies in [-1, 1), and multiplying by scale keeps the value inside [-scale, scale)
 * (the product of scale and the largest value, 1 - 2^-23, never rounds up to scale). Row 0 is
 * the padding row and is always 0. The row's hash is computed once per row, so the per-element
 * cost is one mix.
 *
 * That mix (two 64-bit multiplies) is the whole cost of a row, and a hash-keyed table computes
 * one for every absent key it looks up and every slot it assigns. The element loop is compiled
 * three ways and picked by the CPU at run time (gcc on x86-64): with AVX-512 (x86-64-v4, whose
 * vpmullq multiplies 8 lanes of 64 bits), with AVX2 (x86-64-v3, multiplies emulated in 32-bit
 * halves) and plain scalar (vectorised with SSE2 it was slower than scalar: 2.3 against 1.75
 * ns/element). A 128-element f32 row took 1.73 ns/element scalar, 1.29 with AVX2 and 0.55 with
 * AVX-512 (this project's 2-core Xeon VM, medians of 21, alternated in one program). Integer
 * arithmetic, an exact int-to-float conversion (below 2^24) and one rounded multiply per
 * element, with no contraction (-ffp-contract=off): every variant gives the same bits. */
#include "kernels/embps_kernels.h"
#include "common/mix64.h"

#include <string.h>

#define GOLDEN UINT64_C(0x9e3779b97f4a7c15)

static inline uint64_t row_hash(uint64_t seed, uint64_t row) {
  return embps_mix64(embps_mix64(seed + GOLDEN) + row * GOLDEN);
}

/* embps_mix64(z) >> 40: the top 24 bits of the mix, without its last step z ^ (z >> 31), which
 * leaves bits 40-63 as they are (the shifted term's top 31 bits are zero). One shift and one xor
 * less per element (2 of the vector loop's 14 operations): a 128-element f32 row with AVX-512
 * went from 0.60 to 0.54 ns/element (this project's 2-core Xeon VM, best of 15 of 50000 rows,
 * the two builds alternated 4 times). */
static inline uint64_t mix64_top24(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z >> 40;
}

static inline float value_of(uint64_t row_h, uint64_t col, float scale) {
  uint64_t h = mix64_top24(row_h ^ (col * GOLDEN + GOLDEN));
  /* below 2^24: exact as a float; converted as signed, which SSE and AVX2 convert natively */
  float u = (float)(int32_t)h * 0x1p-23f - 1.0f; /* [-1, 1) */
  return scale * u;
}

float embps_init_value(uint64_t seed, uint64_t row, uint64_t col, float scale) {
  if (row == 0)
    return 0.0f;
  return value_of(row_hash(seed, row), col, scale);
}

/* Columns [col, col + n) of the row whose hash is rh into out (unaligned), as f32 or, with
 * bf16, as bf16. Inlined into each variant below, which the compiler vectorizes for its target. */
static inline __attribute__((always_inline)) void
fill_body(uint8_t *restrict out, uint64_t rh, uint64_t col, size_t n, float scale, int bf16) {
  if (bf16) {
    for (size_t j = 0; j < n; j++) {
      const uint16_t b = embps_f32_to_bf16(value_of(rh, col + j, scale));
      memcpy(out + j * sizeof(b), &b, sizeof(b));
    }
  } else {
    for (size_t j = 0; j < n; j++) {
      const float v = value_of(rh, col + j, scale);
      memcpy(out + j * sizeof(v), &v, sizeof(v));
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define INIT_VARIANTS 1
__attribute__((target("arch=x86-64-v4"))) static void
fill_v4(uint8_t *restrict out, uint64_t rh, uint64_t col, size_t n, float scale, int bf16) {
  fill_body(out, rh, col, n, scale, bf16);
}

__attribute__((target("arch=x86-64-v3"))) static void
fill_v3(uint8_t *restrict out, uint64_t rh, uint64_t col, size_t n, float scale, int bf16) {
  fill_body(out, rh, col, n, scale, bf16);
}

__attribute__((optimize("no-tree-vectorize"))) static void
fill_plain(uint8_t *restrict out, uint64_t rh, uint64_t col, size_t n, float scale, int bf16) {
  fill_body(out, rh, col, n, scale, bf16);
}
#endif

/* Row `row` (rh its hash) over columns [col, col + n) into out (unaligned): zeros for row 0. */
static void fill_row(uint8_t *out, embps_dtype_t dtype, uint64_t row, uint64_t rh, uint64_t col,
                     size_t n, float scale) {
  const int bf16 = dtype == EMBPS_DTYPE_BF16;
  if (row == 0) {
    memset(out, 0, n * (bf16 ? sizeof(uint16_t) : sizeof(float)));
    return;
  }
#ifdef INIT_VARIANTS
  if (__builtin_cpu_supports("x86-64-v4"))
    fill_v4(out, rh, col, n, scale, bf16);
  else if (__builtin_cpu_supports("x86-64-v3"))
    fill_v3(out, rh, col, n, scale, bf16);
  else
    fill_plain(out, rh, col, n, scale, bf16);
#else
  fill_body(out, rh, col, n, scale, bf16);
#endif
}

void embps_init_rows_cpu(void *table, embps_dtype_t dtype, size_t width, uint64_t row_begin,
                         uint64_t row_end, uint64_t col_begin, uint64_t seed, float scale) {
  const size_t es = embps_dtype_size(dtype);
  for (uint64_t r = row_begin; r < row_end; r++)
    fill_row((uint8_t *)table + (size_t)r * width * es, dtype, r, row_hash(seed, r), col_begin,
             width, scale);
}

void embps_init_key_row_cpu(void *row, embps_dtype_t dtype, size_t width, uint64_t key,
                            uint64_t col_begin, uint64_t seed, float scale) {
  /* row may sit anywhere in a reply (behind a header of any length): stored byte-wise */
  fill_row(row, dtype, key, row_hash(seed, key), col_begin, width, scale);
}
