/* Reply buffer pool (see bufpool.h for why). Each buffer carries a 64-byte header in front of
 * it with its pool and capacity, so that embps__bufpool_put can serve as a plain release
 * callback. Idle buffers sit in a small array; a get takes the smallest idle buffer that fits,
 * and a put beyond the limits frees the largest idle one. */
#include "bufpool.h"

#include <stdint.h>

#include "common/alloc.h"

#define HEADER 64
#define MAX_IDLE 64

typedef struct header {
  embps_bufpool_t *pool;
  size_t cap;
} header_t;

struct embps_bufpool {
  size_t max_buffers, max_bytes;
  size_t idle_bytes;
  size_t num_idle;
  header_t *idle[MAX_IDLE];
};

embps_bufpool_t *embps__bufpool_new(size_t max_buffers, size_t max_bytes) {
  embps_bufpool_t *p = embps_calloc(1, sizeof(*p));
  if (!p)
    return NULL;
  p->max_buffers = max_buffers < MAX_IDLE ? max_buffers : MAX_IDLE;
  p->max_bytes = max_bytes;
  return p;
}

void embps__bufpool_free(embps_bufpool_t *p) {
  if (!p)
    return;
  for (size_t i = 0; i < p->num_idle; i++)
    embps_free(p->idle[i]);
  embps_free(p);
}

void *embps__bufpool_get(embps_bufpool_t *p, size_t size) {
  size_t best = SIZE_MAX;
  header_t *h;

  for (size_t i = 0; i < p->num_idle; i++)
    if (p->idle[i]->cap >= size && p->idle[i]->cap / 2 <= size &&
        (best == SIZE_MAX || p->idle[i]->cap < p->idle[best]->cap))
      best = i;
  if (best != SIZE_MAX) {
    h = p->idle[best];
    p->idle[best] = p->idle[--p->num_idle];
    p->idle_bytes -= h->cap;
    return (char *)h + HEADER;
  }
  /* Round up so that sizes that wobble from call to call share buffers. */
  size = (size + 65535) & ~(size_t)65535;
  h = embps_aligned_alloc(HEADER + size);
  if (!h)
    return NULL;
  h->pool = p;
  h->cap = size;
  return (char *)h + HEADER;
}

void embps__bufpool_put(void *buf) {
  header_t *h = (header_t *)((char *)buf - HEADER);
  embps_bufpool_t *p = h->pool;

  if (h->cap > p->max_bytes) {
    embps_free(h);
    return;
  }
  while (p->num_idle > 0 &&
         (p->num_idle >= p->max_buffers || p->idle_bytes + h->cap > p->max_bytes)) {
    size_t largest = 0;
    for (size_t i = 1; i < p->num_idle; i++)
      if (p->idle[i]->cap > p->idle[largest]->cap)
        largest = i;
    p->idle_bytes -= p->idle[largest]->cap;
    embps_free(p->idle[largest]);
    p->idle[largest] = p->idle[--p->num_idle];
  }
  if (p->num_idle >= p->max_buffers) {
    embps_free(h);
    return;
  }
  p->idle[p->num_idle++] = h;
  p->idle_bytes += h->cap;
}
