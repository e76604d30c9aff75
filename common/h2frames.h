/* Where a byte stream stands in HTTP/2 frames: both ends follow the peer's frame headers beside
 * nghttp2, so that a read can land the payload of a large DATA frame straight in the buffer it
 * belongs to (the client: a lookup's rows in the caller's array; the server: a request message
 * in its buffer). Header only; it knows the frame layout (RFC 9113 section 4.1), not nghttp2. */
#ifndef EMBPS_COMMON_H2FRAMES_H
#define EMBPS_COMMON_H2FRAMES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EMBPS_H2_FRAME_HEADER 9
#define EMBPS_H2_TYPE_DATA 0x0
#define EMBPS_H2_FLAG_PADDED 0x8

typedef struct embps_h2_frames {
  uint8_t hd[EMBPS_H2_FRAME_HEADER]; /* the current frame's header, `have` bytes of it so far */
  size_t have;                       /* EMBPS_H2_FRAME_HEADER: in the payload */
  size_t left;                       /* payload bytes of the current frame not yet walked */
} embps_h2_frames_t;

/* Walks n bytes of frames (zero-initialized f: at the start of a frame). */
static inline void embps_h2_frames_walk(embps_h2_frames_t *f, const uint8_t *p, size_t n) {
  while (n > 0) {
    size_t k;
    if (f->have < EMBPS_H2_FRAME_HEADER) {
      k = EMBPS_H2_FRAME_HEADER - f->have < n ? EMBPS_H2_FRAME_HEADER - f->have : n;
      memcpy(f->hd + f->have, p, k);
      f->have += k;
      if (f->have == EMBPS_H2_FRAME_HEADER) {
        f->left = (size_t)f->hd[0] << 16 | (size_t)f->hd[1] << 8 | f->hd[2];
        if (f->left == 0)
          f->have = 0;
      }
    } else {
      k = f->left < n ? f->left : n;
      f->left -= k;
      if (f->left == 0)
        f->have = 0;
    }
    p += k;
    n -= k;
  }
}

/* The stream whose payload comes next when it is an unpadded DATA frame's (whose payload bytes
 * are all data), else 0. */
static inline int32_t embps_h2_frames_data_stream(const embps_h2_frames_t *f) {
  if (f->have < EMBPS_H2_FRAME_HEADER || f->hd[3] != EMBPS_H2_TYPE_DATA ||
      (f->hd[4] & EMBPS_H2_FLAG_PADDED))
    return 0;
  return (int32_t)((uint32_t)(f->hd[5] & 0x7f) << 24 | (uint32_t)f->hd[6] << 16 |
                   (uint32_t)f->hd[7] << 8 | f->hd[8]);
}

#endif
