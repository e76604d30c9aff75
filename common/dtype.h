/* Storage dtypes and the bf16 <-> f32 conversions. Header-only so that kernels, server and
 * client share one definition without linking anything. The enum is public API, declared in
 * include/embps/dtype.h (installed as <embps/dtype.h>); the helpers here are internal. */
#ifndef EMBPS_DTYPE_H
#define EMBPS_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "embps/dtype.h"

/** Bytes per element: 4 for f32, 2 for bf16, 0 for anything else. */
static inline size_t embps_dtype_size(int dtype) {
  return dtype == EMBPS_DTYPE_F32 ? 4 : dtype == EMBPS_DTYPE_BF16 ? 2 : 0;
}

/** "f32", "bf16" or "invalid". */
static inline const char *embps_dtype_name(int dtype) {
  return dtype == EMBPS_DTYPE_F32 ? "f32" : dtype == EMBPS_DTYPE_BF16 ? "bf16" : "invalid";
}

/** bf16 bits to f32: the high half of the f32 bits. */
static inline float embps_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

/** f32 to bf16 bits, rounding to nearest even; NaN stays NaN (quiet). */
static inline uint16_t embps_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#endif
