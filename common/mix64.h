/* splitmix64 (Steele, Lea and Flood), declared once: its finalizer, a bijection of 64 bits with
 * full avalanche, and the generator step built on it. The table initializer (kernels/init.c, and
 * its device twin kernels/cuda/init_hash.cuh, which must stay bit for bit the same), the hash
 * index's key hash, the retry window's ring slots and the clients' random draws use it.
 * Header-only. */
#ifndef EMBPS_MIX64_H
#define EMBPS_MIX64_H

#include <stdint.h>

/** splitmix64's finalizer ("Mix13"): a bijection of 64-bit values. */
static inline uint64_t embps_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/** The golden-ratio increment of the splitmix64 generator. */
#define EMBPS_MIX64_GOLDEN UINT64_C(0x9e3779b97f4a7c15)

/** The splitmix64 generator: advances *state and returns its next value. */
static inline uint64_t embps_splitmix64(uint64_t *state) {
  return embps_mix64(*state += EMBPS_MIX64_GOLDEN);
}

#endif
