/* The monotonic clock every deadline, timeout and duration in embps is measured on. Header-only,
 * like dtype.h: client and server both use it. */
#ifndef EMBPS_CLOCK_H
#define EMBPS_CLOCK_H

#include <stdint.h>
#include <time.h>

/** Nanoseconds on CLOCK_MONOTONIC (an arbitrary origin; only differences mean anything). */
static inline uint64_t embps_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/** Milliseconds on CLOCK_MONOTONIC. */
static inline uint64_t embps_now_ms(void) { return embps_now_ns() / 1000000u; }

#endif
