/* `embps bench`: closed-loop load on a table from C threads.
 *
 * Each thread owns its client (its own connections), keeps `pipeline` calls in flight and
 * finishes them in the order it started them, so a thread measures what one pipelined
 * training worker sees. An op is a push with probability push_ratio, else a lookup, over
 * batch tokens drawn from Zipf(a) on [1, rows). Tokens come from a pool drawn before the
 * clock starts (at least 16 batches or 2^20 tokens per thread), and each op points into it at
 * a random offset: drawing 4096 Zipf samples per op would cost ~0.2 ms, a large share of a
 * 2 MiB lookup's time on loopback, and would measure the sampler instead of the server.
 *
 * The clock starts at the gate (gate_t), once every thread has drawn its pool and connected:
 * under ThreadSanitizer on a loaded 2-core machine that setup alone took longer than a
 * 1-second bench, which then measured no calls at all.
 *
 * Latency is measured per op from its start to the return of its wait; only ops that start
 * after the warmup and end before the deadline count. Latencies are kept exactly (one double
 * per op) and sorted at the end; at tens of thousands of ops a second that is a few MB. */
#include "client/cli/bench.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/cli/zipf.h"
#include "common/clock.h"
#include "common/dtype.h"
#include "common/status.h"

typedef struct lat_vec {
  double *v;
  size_t n, cap;
} lat_vec_t;

/* Where the threads wait until all are ready, and learn when to measure: the main thread opens it
 * once `ready` threads have arrived, having set t_measure and t_end. */
typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cond;
  uint32_t ready;
  int open;
  double t_measure, t_end; /* seconds on the monotonic clock; set before open */
} gate_t;

typedef struct worker {
  pthread_t thread;
  gate_t *gate;
  uint32_t index;
  const char *servers;
  const embps_client_options_t *copts;
  const embps_table_spec_t *table;
  const embps_bench_opts_t *o;
  double t_measure, t_end; /* copied from the gate when it opens */
  lat_vec_t lookup_lat, push_lat;
  int failed;
  char error[640];
} worker_t;

static atomic_uint_fast64_t g_lookups, g_pushes, g_rows;
static atomic_int g_stop;

static double now_s(void) { return (double)embps_now_ns() * 1e-9; }

static int lat_push(lat_vec_t *l, double v) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 4096;
    double *p = realloc(l->v, cap * sizeof(*p));
    if (!p)
      return -1;
    l->v = p;
    l->cap = cap;
  }
  l->v[l->n++] = v;
  return 0;
}

/* A worker's arrival at the gate (ready, or failed before it was): waits for it to open, then
 * copies the measuring times. Once per worker. */
static void gate_arrive(worker_t *w) {
  gate_t *g = w->gate;
  pthread_mutex_lock(&g->mu);
  g->ready++;
  pthread_cond_broadcast(&g->cond);
  while (!g->open)
    pthread_cond_wait(&g->cond, &g->mu);
  w->t_measure = g->t_measure;
  w->t_end = g->t_end;
  pthread_mutex_unlock(&g->mu);
}

/* Waits until n workers have arrived, starts the clock and lets them go. */
static void gate_open(gate_t *g, uint32_t n, double warmup_s, double duration_s) {
  pthread_mutex_lock(&g->mu);
  while (g->ready < n)
    pthread_cond_wait(&g->cond, &g->mu);
  g->t_measure = now_s() + warmup_s;
  g->t_end = g->t_measure + duration_s;
  g->open = 1;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->mu);
}

typedef struct slot {
  embps_call_t *call;
  int is_push;
  double start;
  embps_push_result_t result;
  void *out;
} slot_t;

static void *worker_main(void *arg) {
  worker_t *w = arg;
  const embps_bench_opts_t *o = w->o;
  size_t row_bytes = (size_t)w->table->emb_width * embps_dtype_size(w->table->dtype);
  size_t batch = (size_t)o->batch;
  size_t pool_n = batch * 16 > (1u << 20) ? batch * 16 : (1u << 20);
  embps_client_t *c = NULL;
  embps_error_t err;
  embps_zipf_t z;
  embps_rng_t rng;
  int64_t *pool = NULL;
  void *grads = NULL;
  slot_t *slots = NULL;
  uint32_t k = o->pipeline, head = 0, inflight = 0;
  int arrived = 0;

  embps_rng_seed(&rng, o->seed * 1000003u + w->index);
  embps_zipf_init(&z, w->table->rows - 1, o->zipf);
  pool = malloc(pool_n * sizeof(*pool));
  grads = malloc(batch * row_bytes);
  slots = calloc(k, sizeof(*slots));
  if (!pool || !grads || !slots) {
    snprintf(w->error, sizeof(w->error), "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < pool_n; i++)
    pool[i] = (int64_t)embps_zipf_sample(&z, &rng);
  for (size_t i = 0; i < batch * w->table->emb_width; i++) {
    if (w->table->dtype == EMBPS_DTYPE_BF16)
      ((uint16_t *)grads)[i] = embps_f32_to_bf16(1e-4f);
    else
      ((float *)grads)[i] = 1e-4f;
  }
  for (uint32_t i = 0; i < k; i++) {
    slots[i].out = malloc(batch * row_bytes);
    if (!slots[i].out) {
      snprintf(w->error, sizeof(w->error), "out of memory");
      goto fail;
    }
  }
  embps_error_clear(&err);
  if (embps_client_connect(&c, w->servers, w->copts, &err) != EMBPS_OK) {
    snprintf(w->error, sizeof(w->error), "connect: %s: %s", embps_status_string(err.status),
             err.message);
    goto fail;
  }
  embps_client_set_padding(c, 1);
  gate_arrive(w);
  arrived = 1;

  for (;;) {
    double t = now_s();
    /* Fill the pipeline while time remains. */
    while (inflight < k && t < w->t_end && !atomic_load_explicit(&g_stop, memory_order_relaxed)) {
      slot_t *s = &slots[(head + inflight) % k];
      size_t off = (size_t)(embps_rng_next(&rng) % (pool_n - batch + 1));
      embps_status_t st;
      s->is_push = o->push_ratio > 0 && embps_rng_uniform(&rng) < o->push_ratio;
      s->start = now_s();
      if (s->is_push)
        st = embps_push_start(c, w->table->name, pool + off, batch, grads, batch * row_bytes,
                              w->table->dtype, o->async_push ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC,
                              &s->result, &s->call);
      else
        st = embps_lookup_start(c, w->table->name, pool + off, batch, s->out, batch * row_bytes,
                                &s->call);
      if (st != EMBPS_OK) {
        snprintf(w->error, sizeof(w->error), "%s: %s: %s", s->is_push ? "push" : "lookup",
                 embps_status_string(st), embps_client_last_error(c));
        goto fail;
      }
      inflight++;
    }
    if (inflight == 0)
      break;
    {
      slot_t *s = &slots[head];
      embps_status_t st = embps_call_wait(s->call);
      double end = now_s();
      s->call = NULL;
      head = (head + 1) % k;
      inflight--;
      if (st != EMBPS_OK) {
        snprintf(w->error, sizeof(w->error), "%s: %s: %s", s->is_push ? "push" : "lookup",
                 embps_status_string(st), embps_client_last_error(c));
        goto fail;
      }
      if (s->start >= w->t_measure && end <= w->t_end) {
        if (lat_push(s->is_push ? &w->push_lat : &w->lookup_lat, (end - s->start) * 1e3) != 0) {
          snprintf(w->error, sizeof(w->error), "out of memory");
          goto fail;
        }
        atomic_fetch_add_explicit(s->is_push ? &g_pushes : &g_lookups, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&g_rows, batch, memory_order_relaxed);
      }
    }
  }
  goto exit;
fail:
  w->failed = 1;
  atomic_store(&g_stop, 1);
  if (!arrived)
    gate_arrive(w);
exit:
  for (uint32_t i = 0; slots && i < k; i++) {
    if (slots[i].call)
      embps_call_cancel(slots[i].call);
    free(slots[i].out);
  }
  embps_client_free(c);
  free(slots);
  free(grads);
  free(pool);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v. */
static double pct(const double *v, size_t n, double p) {
  size_t i;
  if (n == 0)
    return 0.0;
  i = (size_t)ceil(p / 100.0 * (double)n);
  return v[i > 0 ? i - 1 : 0];
}

static double *merge(worker_t *w, uint32_t nw, int push, size_t *n) {
  size_t total = 0, k = 0;
  double *v;
  for (uint32_t i = 0; i < nw; i++)
    total += push ? w[i].push_lat.n : w[i].lookup_lat.n;
  v = malloc((total ? total : 1) * sizeof(*v));
  if (!v)
    return NULL;
  for (uint32_t i = 0; i < nw; i++) {
    lat_vec_t *l = push ? &w[i].push_lat : &w[i].lookup_lat;
    if (l->n) /* l->v is NULL when no call of this kind ran: memcpy(.., NULL, 0) is UB */
      memcpy(v + k, l->v, l->n * sizeof(*v));
    k += l->n;
  }
  qsort(v, total, sizeof(*v), cmp_double);
  *n = total;
  return v;
}

int embps_cli_bench(const char *servers, const embps_client_options_t *copts,
                    const embps_table_spec_t *table, const embps_bench_opts_t *o) {
  uint32_t nw = o->concurrency;
  worker_t *w = calloc(nw, sizeof(*w));
  gate_t gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  double t0, t_measure, t_end, elapsed;
  double row_bytes = (double)table->emb_width * (double)embps_dtype_size(table->dtype);
  size_t nl = 0, np = 0, na = 0;
  double *ll = NULL, *pl = NULL, *al = NULL;
  int rc = 0;
  uint32_t started = 0;

  if (!w) {
    fprintf(stderr, "embps: bench: out of memory\n");
    return 1;
  }
  atomic_store(&g_lookups, 0);
  atomic_store(&g_pushes, 0);
  atomic_store(&g_rows, 0);
  atomic_store(&g_stop, 0);
  for (uint32_t i = 0; i < nw; i++) {
    w[i].index = i;
    w[i].gate = &gate;
    w[i].servers = servers;
    w[i].copts = copts;
    w[i].table = table;
    w[i].o = o;
    if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) {
      fprintf(stderr, "embps: bench: cannot start thread %u\n", i);
      atomic_store(&g_stop, 1);
      rc = 1;
      break;
    }
    started++;
  }
  gate_open(&gate, started, o->warmup_s, o->duration_s);
  t_measure = gate.t_measure;
  t_end = gate.t_end;
  t0 = t_measure - o->warmup_s;
  if (!o->json) {
    uint64_t last_rows = 0;
    double last_t = now_s();
    while (!atomic_load(&g_stop) && now_s() < t_end) {
      struct timespec ts = {0, 100 * 1000 * 1000};
      double t;
      nanosleep(&ts, NULL);
      t = now_s();
      if (t - last_t >= 1.0) {
        uint64_t rows = atomic_load(&g_rows);
        fprintf(stderr, "bench %5.1fs%s  lookups %llu  pushes %llu  %.3g rows/s\n", t - t0,
                t < t_measure ? " (warmup)" : "", (unsigned long long)atomic_load(&g_lookups),
                (unsigned long long)atomic_load(&g_pushes),
                (double)(rows - last_rows) / (t - last_t));
        last_rows = rows;
        last_t = t;
      }
    }
  }
  for (uint32_t i = 0; i < started; i++)
    pthread_join(w[i].thread, NULL);
  pthread_cond_destroy(&gate.cond);
  pthread_mutex_destroy(&gate.mu);
  elapsed = (now_s() < t_end ? now_s() : t_end) - t_measure;
  for (uint32_t i = 0; i < started; i++)
    if (w[i].failed) {
      fprintf(stderr, "embps: bench: %s\n", w[i].error);
      rc = 1;
      break;
    }
  if (rc == 0) {
    ll = merge(w, started, 0, &nl);
    pl = merge(w, started, 1, &np);
    al = malloc((nl + np + 1) * sizeof(*al));
    if (!ll || !pl || !al) {
      fprintf(stderr, "embps: bench: out of memory\n");
      rc = 1;
    }
  }
  if (rc == 0) {
    double lps, pps, lrows, prows;
    memcpy(al, ll, nl * sizeof(*al));
    memcpy(al + nl, pl, np * sizeof(*al));
    na = nl + np;
    qsort(al, na, sizeof(*al), cmp_double);
    if (elapsed <= 0)
      elapsed = 1e-9;
    lps = (double)nl / elapsed;
    pps = (double)np / elapsed;
    lrows = lps * (double)o->batch;
    prows = pps * (double)o->batch;
    if (o->json) {
      printf("{\"table\":\"%s\",\"batch\":%llu,\"concurrency\":%u,\"pipeline\":%u,"
             "\"zipf\":%g,\"push_ratio\":%g,\"duration_s\":%.3f,"
             "\"lookups\":%zu,\"pushes\":%zu,"
             "\"lookup_batches_per_s\":%.3f,\"push_batches_per_s\":%.3f,"
             "\"lookup_rows_per_s\":%.1f,\"push_rows_per_s\":%.1f,"
             "\"lookup_gbytes_per_s\":%.6f,\"push_gbytes_per_s\":%.6f,"
             "\"p50_ms\":%.4f,\"p99_ms\":%.4f,\"p999_ms\":%.4f,"
             "\"lookup_p50_ms\":%.4f,\"lookup_p99_ms\":%.4f,\"lookup_p999_ms\":%.4f,"
             "\"push_p50_ms\":%.4f,\"push_p99_ms\":%.4f,\"push_p999_ms\":%.4f}\n",
             table->name, (unsigned long long)o->batch, o->concurrency, o->pipeline, o->zipf,
             o->push_ratio, elapsed, nl, np, lps, pps, lrows, prows, lrows * row_bytes / 1e9,
             prows * row_bytes / 1e9, pct(al, na, 50), pct(al, na, 99), pct(al, na, 99.9),
             pct(ll, nl, 50), pct(ll, nl, 99), pct(ll, nl, 99.9), pct(pl, np, 50), pct(pl, np, 99),
             pct(pl, np, 99.9));
    } else {
      printf("table %s: batch %llu, %u threads x %u in flight, zipf %g, push ratio %g, %.2f s\n",
             table->name, (unsigned long long)o->batch, o->concurrency, o->pipeline, o->zipf,
             o->push_ratio, elapsed);
      printf("%-8s %10s %12s %14s %10s %10s %10s %10s\n", "op", "count", "batches/s", "rows/s",
             "GB/s", "p50 ms", "p99 ms", "p999 ms");
      printf("%-8s %10zu %12.1f %14.1f %10.3f %10.3f %10.3f %10.3f\n", "lookup", nl, lps, lrows,
             lrows * row_bytes / 1e9, pct(ll, nl, 50), pct(ll, nl, 99), pct(ll, nl, 99.9));
      printf("%-8s %10zu %12.1f %14.1f %10.3f %10.3f %10.3f %10.3f\n", "push", np, pps, prows,
             prows * row_bytes / 1e9, pct(pl, np, 50), pct(pl, np, 99), pct(pl, np, 99.9));
      printf("%-8s %10zu %12.1f %14.1f %10.3f %10.3f %10.3f %10.3f\n", "all", na, lps + pps,
             lrows + prows, (lrows + prows) * row_bytes / 1e9, pct(al, na, 50), pct(al, na, 99),
             pct(al, na, 99.9));
    }
  }
  for (uint32_t i = 0; i < nw; i++) {
    free(w[i].lookup_lat.v);
    free(w[i].push_lat.v);
  }
  free(ll);
  free(pl);
  free(al);
  free(w);
  return rc;
}
