/* Message buffer pool (see bufpool.h for why). Each buffer carries a 64-byte header in front of
 * it with its pool, capacity and kind, so that embps__bufpool_put can serve as a plain release
 * callback. Idle buffers sit in a small array; a get takes the smallest idle buffer that fits,
 * and a put beyond the limits frees the largest idle one. */
#include "bufpool.h"

#include <stdint.h>

#include "common/alloc.h"

#define HEADER 64
#define MAX_IDLE 64
#define ROUND ((size_t)65536)

typedef struct header {
  embps_bufpool_t *pool;
  size_t cap; /* bytes after the header */
  int pooled; /* from the backing allocator, may be kept idle */
  int kind;   /* the backing allocator's kind */
} header_t;

struct embps_bufpool {
  embps_bufpool_backing_t backing;
  size_t max_buffers, max_bytes;
  size_t idle_bytes;
  size_t num_idle;
  header_t *idle[MAX_IDLE];
};

static void *plain_alloc(void *ctx, size_t bytes, int *kind) {
  (void)ctx;
  *kind = 0;
  return embps_aligned_alloc(bytes);
}

static void plain_free(void *ctx, void *p, size_t bytes, int kind) {
  (void)bytes;
  (void)ctx;
  (void)kind;
  embps_free(p);
}

embps_bufpool_t *embps__bufpool_new(size_t max_buffers, size_t max_bytes,
                                    const embps_bufpool_backing_t *backing) {
  embps_bufpool_t *p = embps_calloc(1, sizeof(*p));
  if (!p)
    return NULL;
  if (backing) {
    p->backing = *backing;
  } else {
    p->backing.alloc = plain_alloc;
    p->backing.free = plain_free;
  }
  p->max_buffers = max_buffers < MAX_IDLE ? max_buffers : MAX_IDLE;
  p->max_bytes = max_bytes;
  return p;
}

static void release(header_t *h) {
  if (h->pooled)
    h->pool->backing.free(h->pool->backing.ctx, h, HEADER + h->cap, h->kind);
  else
    embps_free(h);
}

void embps__bufpool_free(embps_bufpool_t *p) {
  if (!p)
    return;
  for (size_t i = 0; i < p->num_idle; i++)
    release(p->idle[i]);
  embps_free(p);
}

void *embps__bufpool_get(embps_bufpool_t *p, size_t size) {
  size_t best = SIZE_MAX, rounded;
  header_t *h;
  int kind = 0;

  if (size < EMBPS_BUFPOOL_MIN_BYTES) {
    if (!(h = embps_aligned_alloc(HEADER + size)))
      return NULL;
    h->pool = p;
    h->cap = size;
    h->pooled = 0;
    h->kind = 0;
    return (char *)h + HEADER;
  }
  if (size > SIZE_MAX - ROUND - HEADER)
    return NULL;
  /* Round up so that sizes that wobble from call to call share buffers. */
  rounded = (size + ROUND - 1) & ~(ROUND - 1);
  for (size_t i = 0; i < p->num_idle; i++)
    if (p->idle[i]->cap >= rounded && p->idle[i]->cap / 2 <= rounded &&
        (best == SIZE_MAX || p->idle[i]->cap < p->idle[best]->cap))
      best = i;
  if (best != SIZE_MAX) {
    h = p->idle[best];
    p->idle[best] = p->idle[--p->num_idle];
    p->idle_bytes -= h->cap;
    return (char *)h + HEADER;
  }
  if (!(h = p->backing.alloc(p->backing.ctx, HEADER + rounded, &kind)))
    return NULL;
  h->pool = p;
  h->cap = rounded;
  h->pooled = 1;
  h->kind = kind;
  return (char *)h + HEADER;
}

void embps__bufpool_put(void *buf) {
  header_t *h = (header_t *)((char *)buf - HEADER);
  embps_bufpool_t *p = h->pool;

  if (!h->pooled || h->cap > p->max_bytes) {
    release(h);
    return;
  }
  while (p->num_idle > 0 &&
         (p->num_idle >= p->max_buffers || p->idle_bytes + h->cap > p->max_bytes)) {
    size_t largest = 0;
    for (size_t i = 1; i < p->num_idle; i++)
      if (p->idle[i]->cap > p->idle[largest]->cap)
        largest = i;
    p->idle_bytes -= p->idle[largest]->cap;
    release(p->idle[largest]);
    p->idle[largest] = p->idle[--p->num_idle];
  }
  if (p->num_idle >= p->max_buffers) {
    release(h);
    return;
  }
  p->idle[p->num_idle++] = h;
  p->idle_bytes += h->cap;
}
