/* Fixed-width integers in the byte order of every embps wire format that is not protobuf (the
 * group's control frames, the TCP collectives' headers): little-endian, byte by byte, so that
 * the code is the same on any host and needs no alignment. Header-only. */
#ifndef EMBPS_BYTEORDER_H
#define EMBPS_BYTEORDER_H

#include <stdint.h>

/** Writes v at p, least significant byte first. */
static inline void embps_put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline void embps_put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/** Reads what embps_put_le32/64 wrote. */
static inline uint32_t embps_get_le32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++)
    v |= (uint32_t)p[i] << (8 * i);
  return v;
}

static inline uint64_t embps_get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

#endif
