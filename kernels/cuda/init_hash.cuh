/* The deterministic initializer's hash on the device, shared by the dense initializer
 * (init.cu) and the hash-keyed tables' kernels (hash.cu), which must give a key the row that
 * init gives the row numbered by the key, bit for bit.
 *
 * These are kernels/init.c's functions unchanged: splitmix64's finalizer applied to the seed,
 * then to that mixed with the row (or key), then to that mixed with the column; the top 24 bits
 * of the last hash become k * 2^-23 - 1 (exact in f32), times scale (one rounding, as on the
 * CPU). Integer arithmetic and one f32 multiply, so the bits are the CPU's on any device. The
 * padding row or key 0 is not handled here: callers write 0 for it, as init.c does. */
#ifndef EMBPS_KERNELS_CUDA_INIT_HASH_CUH
#define EMBPS_KERNELS_CUDA_INIT_HASH_CUH

#include <stdint.h>

#define EMBPS__INIT_GOLDEN 0x9e3779b97f4a7c15ull

__device__ __forceinline__ uint64_t embps__init_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The row's (or key's) hash, computed once per row. */
__device__ __forceinline__ uint64_t embps__init_row_hash(uint64_t seed, uint64_t row) {
  return embps__init_mix64(embps__init_mix64(seed + EMBPS__INIT_GOLDEN) + row * EMBPS__INIT_GOLDEN);
}

/* The value of column col of the row whose hash is row_h, in [-scale, scale). */
__device__ __forceinline__ float embps__init_value(uint64_t row_h, uint64_t col, float scale) {
  uint64_t h = embps__init_mix64(row_h ^ (col * EMBPS__INIT_GOLDEN + EMBPS__INIT_GOLDEN));
  float u = (float)(uint32_t)(h >> 40) * 0x1p-23f - 1.0f; /* [-1, 1) */
  return scale * u;
}

#endif
