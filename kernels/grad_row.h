/* The gradient rows of the fused updates (embps_kernels.h: grad and grad_at), for kernels/ alone:
 * where row i is, and its element j, read at any alignment as 0.0f + g. The loads are memcpys,
 * which compile to plain (unaligned) vector loads. */
#ifndef EMBPS_KERNELS_GRAD_ROW_H
#define EMBPS_KERNELS_GRAD_ROW_H

#include <stddef.h>
#include <string.h>

static inline const unsigned char *embps__grad_row(const float *grad, const void *const *grad_at,
                                                   size_t i, size_t width) {
  return grad_at ? (const unsigned char *)grad_at[i] : (const unsigned char *)(grad + i * width);
}

static inline float embps__grad_load(const unsigned char *g, size_t j) {
  float v;
  memcpy(&v, g + j * sizeof(float), sizeof(float));
  return 0.0f + v;
}

#endif
