/* Workers: a fixed set of threads that split one loop over [0, n) with the thread that asks.
 *
 * The CPU engine's per-row kernels of a push (the segment sum with its row statistics, the
 * optimizer update) touch rows at random across a table far larger than the caches, so one
 * thread is bound by how many cache misses it can keep in flight, not by arithmetic; a second
 * thread on another core doubles that. The ranges are contiguous and disjoint, and each kernel
 * keeps every row's arithmetic on one thread in its usual order, so the results are the same
 * bits whatever the number of threads.
 *
 * One caller at a time (the engine's thread); the helpers sleep on a condition variable between
 * loops, so an idle pool costs nothing. */
#ifndef EMBPS_ENGINE_WORKERS_H
#define EMBPS_ENGINE_WORKERS_H

#include <stddef.h>

/** One share of a loop: the indices [lo, hi). */
typedef void (*embps_workers_fn)(void *arg, size_t lo, size_t hi);

typedef struct embps_workers embps_workers_t;

/** A pool of `threads` threads in all, the caller's included (threads - 1 helpers are started;
 * 0 or 1: none). Returns NULL when out of memory or threads; *started says how many threads
 * the pool has (1 when no helper could start: the pool then runs everything on the caller). */
embps_workers_t *embps_workers_new(unsigned threads, unsigned *started);

/** Joins the helpers and frees the pool; NULL is a no-op. */
void embps_workers_free(embps_workers_t *w);

/** Threads in the pool, the caller's included (1 for NULL). */
unsigned embps_workers_threads(const embps_workers_t *w);

/**
 * Runs fn over [0, n) split into k = min(threads, n, n / min_share) contiguous shares (at least
 * one), share i being [n*i/k, n*(i+1)/k), none empty; the caller runs share 0 and returns when
 * all are done.
 * With w NULL, or k 1, fn(arg, 0, n) runs on the caller alone. n 0 calls nothing.
 */
void embps_workers_run(embps_workers_t *w, size_t n, size_t min_share, embps_workers_fn fn,
                       void *arg);

#endif
