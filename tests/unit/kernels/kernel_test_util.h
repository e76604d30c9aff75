/* Helpers shared by the kernel tests: a seeded PRNG (splitmix64, so every run sees the same
 * inputs), a checked allocator and bf16 helpers. Header-only, static functions. */
#ifndef EMBPS_KERNEL_TEST_UTIL_H
#define EMBPS_KERNEL_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"

typedef struct kt_rng {
  uint64_t s;
} kt_rng_t;

static inline uint64_t kt_next(kt_rng_t *r) {
  uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static inline double kt_unit(kt_rng_t *r) { return (double)(kt_next(r) >> 11) * 0x1p-53; }

/* Uniform in [lo, hi). */
static inline float kt_uniform(kt_rng_t *r, float lo, float hi) {
  return (float)(lo + (hi - lo) * kt_unit(r));
}

/* Uniform integer in [0, n). */
static inline uint64_t kt_below(kt_rng_t *r, uint64_t n) { return kt_next(r) % n; }

static inline void *kt_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  assert_non_null(p);
  return p;
}

/* A float rounded to bf16 and back: the value a bf16 store holds. */
static inline float kt_bf16_round(float f) { return embps_bf16_to_f32(embps_f32_to_bf16(f)); }

#endif
