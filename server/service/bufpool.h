/* A pool of large message buffers, reused from call to call.
 *
 * A lookup reply is one buffer of up to hundreds of MiB that the engine fills and the network
 * layer writes without copying, and a request's tokens and gradients are unpacked into buffers
 * as large. Allocating them fresh for every call costs a page fault per 4 KiB on first touch
 * (glibc serves such sizes with mmap and returns them with munmap): on this project's VM a
 * 32 MiB reply spent more time faulting its pages in than copying rows into them (perf:
 * pvm_irq_enable and clear_page_erms took 31% of the server's samples at batch 65536, and it
 * delivered 0.21 GB/s). Reusing buffers keeps their pages resident. With the CUDA backend the
 * pool's memory is pinned (see embps_host_alloc), so the engine copies requests to the device and
 * rows back straight from and into these buffers; pinning is slow, which is one more reason to
 * reuse them.
 *
 * Buffers below EMBPS_BUFPOOL_MIN_BYTES are plain allocations that are never kept, so the pool
 * can also serve as protobuf-c's allocator for a whole unpacked message.
 *
 * Loop thread only. */
#ifndef EMBPS_BUFPOOL_H
#define EMBPS_BUFPOOL_H

#include <stddef.h>

typedef struct embps_bufpool embps_bufpool_t;

/** Buffers at least this large come from the backing allocator and are kept for reuse. */
#define EMBPS_BUFPOOL_MIN_BYTES 4096

/**
 * Where pooled buffers come from. alloc returns NULL when out of memory and sets *kind to a
 * value that free is later given with the same buffer and size (e.g. whether it is pinned).
 */
typedef struct embps_bufpool_backing {
  void *(*alloc)(void *ctx, size_t bytes, int *kind);
  void (*free)(void *ctx, void *p, size_t bytes, int kind);
  void *ctx;
} embps_bufpool_backing_t;

/**
 * A pool that keeps at most max_buffers idle buffers and max_bytes idle bytes. backing may be
 * NULL (plain aligned memory); it is copied.
 */
embps_bufpool_t *embps__bufpool_new(size_t max_buffers, size_t max_bytes,
                                    const embps_bufpool_backing_t *backing);

/** Frees the pool and its idle buffers; buffers still out must have been put back. */
void embps__bufpool_free(embps_bufpool_t *pool);

/**
 * A 64-byte aligned buffer of at least size bytes. From EMBPS_BUFPOOL_MIN_BYTES on, an idle one
 * is reused when it fits (sizes are rounded up to 64 KiB; a fit holds at least the rounded size
 * and at most twice it), else one is newly allocated. NULL when out of memory.
 */
void *embps__bufpool_get(embps_bufpool_t *pool, size_t size);

/** Gives a buffer back (keeps it idle or frees it); the signature suits a release callback. */
void embps__bufpool_put(void *buf);

#endif
