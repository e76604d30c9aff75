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

#endif
