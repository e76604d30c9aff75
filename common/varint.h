/* Protobuf varints, the one piece of protobuf encoding that client and server both write by hand
 * (the client frames its requests, the server the head of a LookupResponse, around bulk bytes
 * that neither copies through protobuf-c). Header-only, like dtype.h. */
#ifndef EMBPS_VARINT_H
#define EMBPS_VARINT_H

#include <stddef.h>
#include <stdint.h>

/** Longest varint: 10 bytes. */
#define EMBPS_VARINT_MAX 10

/** Writes v as a varint at p; returns the bytes written (1..10). */
static inline size_t embps_varint_put(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

/** Reads a varint from p[0..len) into *v; returns the bytes it took (1..10), or 0 when p does not
 * hold a whole one of at most 10 bytes. */
static inline size_t embps_varint_get(const uint8_t *p, size_t len, uint64_t *v) {
  uint64_t x = 0;
  for (size_t n = 0; n < len && n < EMBPS_VARINT_MAX; n++) {
    x |= (uint64_t)(p[n] & 0x7f) << (7 * n);
    if (!(p[n] & 0x80)) {
      *v = x;
      return n + 1;
    }
  }
  return 0;
}

#endif
