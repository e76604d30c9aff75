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
 * cost is one mix. */
#include "kernels/embps_kernels.h"

#include <string.h>

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

#define GOLDEN UINT64_C(0x9e3779b97f4a7c15)

static inline uint64_t row_hash(uint64_t seed, uint64_t row) {
  return mix64(mix64(seed + GOLDEN) + row * GOLDEN);
}

static inline float value_of(uint64_t row_h, uint64_t col, float scale) {
  uint64_t h = mix64(row_h ^ (col * GOLDEN + GOLDEN));
  float u = (float)(uint32_t)(h >> 40) * 0x1p-23f - 1.0f; /* [-1, 1) */
  return scale * u;
}

float embps_init_value(uint64_t seed, uint64_t row, uint64_t col, float scale) {
  if (row == 0)
    return 0.0f;
  return value_of(row_hash(seed, row), col, scale);
}

void embps_init_rows_cpu(void *table, embps_dtype_t dtype, size_t width, uint64_t row_begin,
                         uint64_t row_end, uint64_t col_begin, uint64_t seed, float scale) {
  for (uint64_t r = row_begin; r < row_end; r++) {
    uint64_t rh = row_hash(seed, r);
    size_t off = (size_t)r * width;
    if (dtype == EMBPS_DTYPE_BF16) {
      uint16_t *restrict w = (uint16_t *)table + off;
      for (size_t j = 0; j < width; j++)
        w[j] = r == 0 ? 0 : embps_f32_to_bf16(value_of(rh, col_begin + j, scale));
    } else {
      float *restrict w = (float *)table + off;
      for (size_t j = 0; j < width; j++)
        w[j] = r == 0 ? 0.0f : value_of(rh, col_begin + j, scale);
    }
  }
}

void embps_init_key_row_cpu(void *row, embps_dtype_t dtype, size_t width, uint64_t key,
                            uint64_t col_begin, uint64_t seed, float scale) {
  /* row may sit anywhere in a reply (behind a header of any length): stored byte-wise */
  const uint64_t rh = row_hash(seed, key);
  uint8_t *out = row;
  if (dtype == EMBPS_DTYPE_BF16) {
    for (size_t j = 0; j < width; j++) {
      uint16_t v = key == 0 ? 0 : embps_f32_to_bf16(value_of(rh, col_begin + j, scale));
      memcpy(out + j * sizeof(v), &v, sizeof(v));
    }
  } else {
    for (size_t j = 0; j < width; j++) {
      float v = key == 0 ? 0.0f : value_of(rh, col_begin + j, scale);
      memcpy(out + j * sizeof(v), &v, sizeof(v));
    }
  }
}
