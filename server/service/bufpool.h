/* A pool of large reply buffers, reused from call to call.
 *
 * A lookup reply is one buffer of up to hundreds of MiB that the engine fills and the network
 * layer writes without copying. Allocating it fresh for every call costs a page fault per 4 KiB
 * on first touch (glibc serves such sizes with mmap and returns them with munmap): on this
 * project's VM a 32 MiB reply spent more time faulting its pages in than copying rows into them
 * (perf: pvm_irq_enable and clear_page_erms took 31% of the server's samples at batch 65536,
 * and it delivered 0.21 GB/s). Reusing buffers keeps their pages resident.
 *
 * Loop thread only. */
#ifndef EMBPS_BUFPOOL_H
#define EMBPS_BUFPOOL_H

#include <stddef.h>

typedef struct embps_bufpool embps_bufpool_t;

/** A pool that keeps at most max_buffers idle buffers and max_bytes idle bytes. */
embps_bufpool_t *embps__bufpool_new(size_t max_buffers, size_t max_bytes);

/** Frees the pool and its idle buffers; buffers still out must have been put back. */
void embps__bufpool_free(embps_bufpool_t *pool);

/**
 * A 64-byte aligned buffer of at least size bytes, reused when an idle one fits (at least size
 * and at most twice size), else newly allocated. NULL when out of memory.
 */
void *embps__bufpool_get(embps_bufpool_t *pool, size_t size);

/** Gives a buffer back (keeps it idle or frees it); the signature suits a release callback. */
void embps__bufpool_put(void *buf);

#endif
