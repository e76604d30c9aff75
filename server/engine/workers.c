/* Workers (workers.h): helpers that wait for a loop's generation number to change, run their
 * share, and count down; the caller runs share 0 and waits for the count to reach zero. */
#include "server/engine/workers.h"

#include <pthread.h>

#include "common/alloc.h"

typedef struct helper {
  embps_workers_t *pool;
  unsigned index; /* 1 .. threads - 1: the share it runs */
  pthread_t thread;
} helper_t;

struct embps_workers {
  pthread_mutex_t mu;
  pthread_cond_t wake; /* a new loop, or stop */
  pthread_cond_t done; /* pending reached zero */
  unsigned long generation;
  int stop;
  /* the loop being run */
  embps_workers_fn fn;
  void *arg;
  size_t n;
  unsigned shares;
  unsigned pending; /* helpers' shares not yet finished */
  unsigned threads; /* the caller's and the helpers' */
  helper_t *helpers;
};

static size_t share_edge(size_t n, unsigned i, unsigned k) {
  /* n * i / k without overflow for any n below 2^64 / k */
  return (n / k) * i + (n % k) * i / k;
}

static void *helper_main(void *p) {
  helper_t *h = p;
  embps_workers_t *w = h->pool;
  unsigned long seen = 0;

  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (w->generation == seen && !w->stop)
      pthread_cond_wait(&w->wake, &w->mu);
    if (w->stop)
      break;
    seen = w->generation;
    if (h->index >= w->shares)
      continue; /* a loop with fewer shares than threads */
    embps_workers_fn fn = w->fn;
    void *arg = w->arg;
    size_t lo = share_edge(w->n, h->index, w->shares),
           hi = share_edge(w->n, h->index + 1, w->shares);
    pthread_mutex_unlock(&w->mu);
    fn(arg, lo, hi);
    pthread_mutex_lock(&w->mu);
    if (--w->pending == 0)
      pthread_cond_signal(&w->done);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

embps_workers_t *embps_workers_new(unsigned threads, unsigned *started) {
  embps_workers_t *w = embps_calloc(1, sizeof(*w));
  if (!w)
    return NULL;
  if (threads == 0)
    threads = 1;
  w->helpers = threads > 1 ? embps_calloc(threads - 1, sizeof(helper_t)) : NULL;
  if (threads > 1 && !w->helpers) {
    embps_free(w);
    return NULL;
  }
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->wake, NULL);
  pthread_cond_init(&w->done, NULL);
  w->threads = 1;
  for (unsigned i = 1; i < threads; i++) {
    helper_t *h = &w->helpers[i - 1];
    h->pool = w;
    h->index = i;
    if (pthread_create(&h->thread, NULL, helper_main, h) != 0)
      break; /* fewer helpers: the pool still works, with what started */
    w->threads++;
  }
  if (started)
    *started = w->threads;
  return w;
}

void embps_workers_free(embps_workers_t *w) {
  if (!w)
    return;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_broadcast(&w->wake);
  pthread_mutex_unlock(&w->mu);
  for (unsigned i = 1; i < w->threads; i++)
    pthread_join(w->helpers[i - 1].thread, NULL);
  pthread_cond_destroy(&w->done);
  pthread_cond_destroy(&w->wake);
  pthread_mutex_destroy(&w->mu);
  embps_free(w->helpers);
  embps_free(w);
}

unsigned embps_workers_threads(const embps_workers_t *w) { return w ? w->threads : 1; }

void embps_workers_run(embps_workers_t *w, size_t n, size_t min_share, embps_workers_fn fn,
                       void *arg) {
  size_t k = embps_workers_threads(w);
  if (n == 0)
    return;
  if (min_share > 1 && n / min_share < k)
    k = n / min_share;
  if (n < k)
    k = n; /* no empty shares */
  if (k <= 1) {
    fn(arg, 0, n);
    return;
  }
  pthread_mutex_lock(&w->mu);
  w->fn = fn;
  w->arg = arg;
  w->n = n;
  w->shares = (unsigned)k;
  w->pending = (unsigned)k - 1;
  w->generation++;
  pthread_cond_broadcast(&w->wake);
  pthread_mutex_unlock(&w->mu);

  fn(arg, 0, share_edge(n, 1, (unsigned)k));

  pthread_mutex_lock(&w->mu);
  while (w->pending > 0)
    pthread_cond_wait(&w->done, &w->mu);
  pthread_mutex_unlock(&w->mu);
}
