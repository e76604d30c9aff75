/* `embps bench`: load on one or more tables from C threads, closed loop or open loop.
 *
 * Each thread owns its client (its own connections). An op is a push with probability
 * push_ratio, else a lookup, on a table chosen evenly among the tables, of a batch size drawn
 * from the --mix weights, over tokens drawn from Zipf(a) on [1, rows) (a dense table) or on
 * ranks [1, key space] mapped to 64-bit keys by embps_key_mix (a hash-keyed one, whose default
 * key space, 10 x capacity, makes a full table evict: --key-space sets it). Tokens come from a pool
 * per table drawn before the clock starts (at least 16 of the largest batch or 2^20 tokens per
 * thread; for a hash-keyed table 4 x its capacity, up to 2^24, so that a full table keeps
 * evicting), and each op points into it at a random offset: drawing 4096 Zipf samples per op
 * would cost ~0.2 ms, a large share of a 2 MiB lookup's time on loopback, and would measure
 * the sampler instead of the server.
 *
 * Closed loop (the default): a thread keeps `pipeline` calls in flight and finishes them in
 * the order it started them, so it measures what one pipelined training worker sees; latency
 * runs from a call's start to the return of its wait, and the calls that end between the warmup
 * and the deadline count. (Counting only those that also start after the warmup dropped the
 * `pipeline` calls in flight when the window opened: with 4 in flight and 0.2 s calls, a 4 s
 * window under-counted by some 20%, more for slower calls.)
 *
 * Open loop (--rate R): the threads share a schedule of R batches a second (thread i starts
 * its calls at t0 + (i + n * C) / R, n = 0, 1, ...) whatever the replies do, with at most
 * `pipeline` calls in flight each; latency runs from a call's intended start, so a server that
 * stalls shows in the percentiles instead of being hidden by a client that waited for it before
 * sending more (coordinated omission, as wrk2 corrects it). Every call intended after the warmup
 * counts, including those that finish after the schedule ends: the thread waits for them (at
 * most DRAIN_S; any still in flight then count as DEADLINE_EXCEEDED).
 *
 * The clock starts at a gate (gate_t) once every thread has drawn its pools and connected: under
 * ThreadSanitizer on a loaded 2-core machine that setup alone took 1.5-1.7 s, longer than a
 * 1-second bench, which then measured no calls at all.
 *
 * Latencies go into one log-linear histogram per thread and op (hdr.h: 3 significant digits,
 * fixed memory however long the run); failed calls are counted by status, and the run goes on
 * after them, as ghz and wrk do.
 *
 * The report also gives the CPU time the bench process itself used (user + system, all
 * threads) from the end of the warm-up until the last call returned: a client that uses most
 * of its cores is measuring itself as much as the server, and on one machine the client's
 * CPU per batch is part of what the server's rate can be (tests/bench/run.sh divides both
 * sides' CPU by the batches). */
#include "client/cli/bench.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "client/cli/args.h"
#include "client/cli/hdr.h"
#include "client/cli/zipf.h"
#include "common/clock.h"
#include "common/dtype.h"
#include "common/shape.h"
#include "common/status.h"

#define NSTATUS 17   /* gRPC status codes 0..16 */
#define DRAIN_S 60.0 /* open loop: longest wait for the calls in flight when the schedule ends */

enum { OP_LOOKUP, OP_PUSH, OP_ALL };

typedef struct op_stats {
  embps_hdr_t lat; /* successful calls, nanoseconds */
  uint64_t ok;     /* successful calls */
  uint64_t rows;   /* their tokens */
  double bytes;    /* their rows' bytes */
  uint64_t errors[NSTATUS];
} op_stats_t;

typedef struct table_state {
  const embps_table_spec_t *spec;
  size_t row_bytes;
  int64_t *pool; /* pool_n tokens */
  size_t pool_n;
  void *grads; /* max_batch rows of 1e-4 in the table's dtype */
} table_state_t;

typedef struct slot {
  embps_call_t *call; /* NULL: free */
  uint64_t seq;       /* start order, for the closed loop's in-order waits */
  int is_push;
  size_t batch, row_bytes;
  double start; /* intended start (open loop) or actual start (closed loop), seconds */
  embps_push_result_t result;
  void *out;
} slot_t;

/* Where the threads wait until all are ready, and learn when to measure: the main thread opens it
 * once `ready` threads have arrived, having set the times. */
typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cond;
  uint32_t ready;
  int open;
  double t0, t_measure, t_end; /* seconds on the monotonic clock; set before open */
} gate_t;

typedef struct worker {
  pthread_t thread;
  gate_t *gate;
  uint32_t index;
  const char *servers;
  const embps_client_options_t *copts;
  const embps_table_spec_t *const *tables;
  size_t ntables;
  const embps_bench_opts_t *o;
  double t0, t_measure, t_end; /* copied from the gate when it opens */
  op_stats_t op[2];
  char first_error[NSTATUS][200]; /* the first message of each failing status */
  int failed;                     /* the thread could not run at all */
  char error[640];
} worker_t;

static atomic_uint_fast64_t g_lookups, g_pushes, g_rows, g_errors;
static atomic_int g_stop;

/* Go's names of the gRPC codes, which ghz's statusCodeDistribution uses as keys. */
static const char *const ghz_code_names[NSTATUS] = {
    "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
    "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
    "DataLoss", "Unauthenticated"};

static double now_s(void) { return (double)embps_now_ns() * 1e-9; }

static void sleep_s(double s) {
  struct timespec ts;
  if (s <= 0)
    return;
  ts.tv_sec = (time_t)s;
  ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
  nanosleep(&ts, NULL);
}

/* User + system CPU seconds of the whole process, every thread, live or ended. */
static double cpu_s(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0)
    return 0;
  return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* The bench process's CPU time from the end of the warm-up (s < 0: the run ended before it)
 * until the last call returned, and that wall time. */
typedef struct cpu_use {
  double s, wall;
} cpu_use_t;

/* The process's CPU time at the end of the warm-up, taken once (*cpu0 < 0 until then). */
static void mark_cpu(double *cpu0, double t_measure) {
  if (*cpu0 < 0 && now_s() >= t_measure)
    *cpu0 = cpu_s();
}

static size_t max_batch(const embps_bench_opts_t *o) {
  size_t m = 0;
  for (size_t i = 0; i < o->nbatches; i++)
    if (o->batches[i] > m)
      m = (size_t)o->batches[i];
  return m;
}

static size_t pick_batch(const embps_bench_opts_t *o, embps_rng_t *rng) {
  double total = 0, x;
  if (o->nbatches == 1 || !o->weights)
    return (size_t)o->batches[o->nbatches == 1 ? 0 : embps_rng_next(rng) % o->nbatches];
  for (size_t i = 0; i < o->nbatches; i++)
    total += o->weights[i];
  x = embps_rng_uniform(rng) * total;
  for (size_t i = 0; i < o->nbatches; i++) {
    if (x < o->weights[i])
      return (size_t)o->batches[i];
    x -= o->weights[i];
  }
  return (size_t)o->batches[o->nbatches - 1];
}

static void count_error(worker_t *w, int is_push, embps_status_t st, const char *msg) {
  unsigned code = (unsigned)st < NSTATUS ? (unsigned)st : EMBPS_UNKNOWN;
  if (w->op[is_push].errors[code]++ == 0)
    snprintf(w->first_error[code], sizeof(w->first_error[code]), "%s", msg);
  atomic_fetch_add_explicit(&g_errors, 1, memory_order_relaxed);
}

/* Books a finished call: its latency when it counts, or its error. */
static void finish(worker_t *w, embps_client_t *c, slot_t *s, embps_status_t st, double end,
                   int open_loop) {
  int counts = open_loop ? s->start >= w->t_measure : end >= w->t_measure && end <= w->t_end;
  s->call = NULL;
  if (!counts)
    return;
  if (st != EMBPS_OK) {
    count_error(w, s->is_push, st, embps_client_last_error(c));
    return;
  }
  {
    op_stats_t *op = &w->op[s->is_push];
    double ns = (end - s->start) * 1e9;
    embps_hdr_record(&op->lat, ns > 0 ? (uint64_t)ns : 0);
    op->ok++;
    op->rows += s->batch;
    op->bytes += (double)s->batch * (double)s->row_bytes;
  }
  atomic_fetch_add_explicit(s->is_push ? &g_pushes : &g_lookups, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&g_rows, s->batch, memory_order_relaxed);
}

/* A worker's arrival at the gate (ready, or failed before it was): waits for it to open, then
 * copies the times. Once per worker. */
static void gate_arrive(worker_t *w) {
  gate_t *g = w->gate;
  pthread_mutex_lock(&g->mu);
  g->ready++;
  pthread_cond_broadcast(&g->cond);
  while (!g->open)
    pthread_cond_wait(&g->cond, &g->mu);
  w->t0 = g->t0;
  w->t_measure = g->t_measure;
  w->t_end = g->t_end;
  pthread_mutex_unlock(&g->mu);
}

/* Waits until n workers have arrived, starts the clock and lets them go. */
static void gate_open(gate_t *g, uint32_t n, double warmup_s, double duration_s) {
  pthread_mutex_lock(&g->mu);
  while (g->ready < n)
    pthread_cond_wait(&g->cond, &g->mu);
  g->t0 = now_s();
  g->t_measure = g->t0 + warmup_s;
  g->t_end = g->t_measure + duration_s;
  g->open = 1;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->mu);
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  const embps_bench_opts_t *o = w->o;
  size_t batch_max = max_batch(o), out_bytes = 0;
  const size_t pool_min = batch_max * 16 > (1u << 20) ? batch_max * 16 : (1u << 20);
  int open_loop = o->rate > 0;
  double interval = open_loop ? (double)o->concurrency / o->rate : 0;
  double next_due;
  embps_client_t *c = NULL;
  embps_error_t err;
  embps_rng_t rng;
  table_state_t *ts = NULL;
  slot_t *slots = NULL;
  uint32_t k = o->pipeline, inflight = 0;
  uint64_t seq = 0;
  int arrived = 0;

  embps_rng_seed(&rng, o->seed * 1000003u + w->index);
  ts = calloc(w->ntables, sizeof(*ts));
  slots = calloc(k, sizeof(*slots));
  if (!ts || !slots)
    goto oom;
  for (size_t t = 0; t < w->ntables; t++) {
    const embps_table_spec_t *spec = w->tables[t];
    embps_zipf_t z;
    ts[t].spec = spec;
    ts[t].row_bytes = (size_t)spec->emb_width * embps_dtype_size(spec->dtype);
    if (ts[t].row_bytes * batch_max > out_bytes)
      out_bytes = ts[t].row_bytes * batch_max;
    /* A hash-keyed table's pool holds 4 x capacity draws (up to 2^24): a pool of fewer distinct
     * keys than the capacity would fill the table once and never evict again. */
    ts[t].pool_n = pool_min;
    if (spec->capacity && spec->capacity * 4 > ts[t].pool_n)
      ts[t].pool_n = spec->capacity * 4 < (1u << 24) ? (size_t)spec->capacity * 4 : (1u << 24);
    ts[t].pool = malloc(ts[t].pool_n * sizeof(*ts[t].pool));
    ts[t].grads = malloc(batch_max * ts[t].row_bytes);
    if (!ts[t].pool || !ts[t].grads)
      goto oom;
    embps_zipf_init(&z, embps_bench_key_space(spec->rows, spec->capacity, o->key_space), o->zipf);
    for (size_t i = 0; i < ts[t].pool_n; i++) {
      uint64_t rank = embps_zipf_sample(&z, &rng);
      ts[t].pool[i] = (int64_t)(spec->capacity ? embps_key_mix(rank) : rank);
    }
    for (size_t i = 0; i < batch_max * spec->emb_width; i++) {
      if (spec->dtype == EMBPS_DTYPE_BF16)
        ((uint16_t *)ts[t].grads)[i] = embps_f32_to_bf16(1e-4f);
      else
        ((float *)ts[t].grads)[i] = 1e-4f;
    }
  }
  for (uint32_t i = 0; i < k; i++)
    if (!(slots[i].out = malloc(out_bytes)))
      goto oom;
  embps_error_clear(&err);
  if (embps_client_connect(&c, w->servers, w->copts, &err) != EMBPS_OK) {
    snprintf(w->error, sizeof(w->error), "connect: %s: %s", embps_status_string(err.status),
             err.message);
    goto fail;
  }
  gate_arrive(w);
  arrived = 1;
  next_due = w->t0 + (open_loop ? (double)w->index / o->rate : 0);

  for (;;) {
    double t;
    /* Start what is due: the next scheduled call (open loop) or at once (closed loop). */
    while (inflight < k && !atomic_load_explicit(&g_stop, memory_order_relaxed)) {
      table_state_t *tab = &ts[w->ntables == 1 ? 0 : embps_rng_next(&rng) % w->ntables];
      slot_t *s = slots;
      size_t batch, off;
      embps_status_t st;
      t = now_s(); /* a call refused at once loops back here without waiting */
      if (open_loop ? next_due >= w->t_end || next_due > t : t >= w->t_end)
        break;
      while (s->call)
        s++;
      batch = pick_batch(o, &rng);
      off = (size_t)(embps_rng_next(&rng) % (tab->pool_n - batch + 1));
      s->is_push = o->push_ratio > 0 && embps_rng_uniform(&rng) < o->push_ratio;
      s->batch = batch;
      s->row_bytes = tab->row_bytes;
      s->seq = seq++;
      if (open_loop) {
        s->start = next_due;
        next_due += interval;
      } else {
        s->start = now_s();
      }
      if (s->is_push)
        st = embps_push_start(c, tab->spec->name, tab->pool + off, batch, tab->grads,
                              batch * tab->row_bytes, tab->spec->dtype,
                              o->async_push ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC, &s->result,
                              &s->call);
      else
        st = embps_lookup_start(c, tab->spec->name, tab->pool + off, batch, s->out,
                                batch * tab->row_bytes, &s->call);
      if (st != EMBPS_OK) { /* refused before sending: a failed call like any other */
        s->call = NULL;
        if (s->start >= w->t_measure)
          count_error(w, s->is_push, st, embps_client_last_error(c));
        continue;
      }
      inflight++;
    }
    if (inflight == 0) {
      if (open_loop && next_due < w->t_end && !atomic_load(&g_stop)) {
        sleep_s(next_due - now_s());
        continue;
      }
      break;
    }
    if (!open_loop) { /* wait for the oldest call */
      slot_t *oldest = NULL;
      embps_status_t st;
      for (uint32_t i = 0; i < k; i++)
        if (slots[i].call && (!oldest || slots[i].seq < oldest->seq))
          oldest = &slots[i];
      st = embps_call_wait(oldest->call);
      finish(w, c, oldest, st, now_s(), 0);
      inflight--;
      continue;
    }
    {
      int done = 0;
      double wait;
      slot_t *any = NULL;
      for (uint32_t i = 0; i < k; i++) {
        if (!slots[i].call)
          continue;
        if (embps_call_test(slots[i].call)) {
          embps_status_t st = embps_call_wait(slots[i].call);
          finish(w, c, &slots[i], st, now_s(), 1);
          inflight--;
          done++;
        } else {
          any = &slots[i];
        }
      }
      if (done || !any)
        continue;
      if (now_s() > w->t_end + DRAIN_S) {
        for (uint32_t i = 0; i < k; i++)
          if (slots[i].call) {
            embps_call_cancel(slots[i].call);
            slots[i].call = NULL;
            if (slots[i].start >= w->t_measure)
              count_error(w, slots[i].is_push, EMBPS_DEADLINE_EXCEEDED,
                          "no reply within 60 s after the schedule ended");
          }
        inflight = 0;
        continue;
      }
      /* Move I/O until the next call is due (or a reply arrives). Below a millisecond poll()
       * cannot wait, so the last stretch sleeps in steps of 20 us between tests. */
      wait = inflight < k && next_due < w->t_end ? next_due - now_s() : 0.1;
      if (wait >= 0.001)
        embps_call_wait_for(any->call, (int)(wait * 1000));
      else if (wait > 0)
        sleep_s(wait < 20e-6 ? wait : 20e-6);
    }
  }
  goto exit;
oom:
  snprintf(w->error, sizeof(w->error), "out of memory");
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
  for (size_t t = 0; ts && t < w->ntables; t++) {
    free(ts[t].pool);
    free(ts[t].grads);
  }
  free(ts);
  free(slots);
  return NULL;
}

/* ---- the report ---- */

static const double report_pcts[] = {50, 90, 99, 99.9, 99.99};

static double ms(uint64_t ns) { return (double)ns / 1e6; }

static uint64_t errors_of(const op_stats_t *op) {
  uint64_t n = 0;
  for (int i = 0; i < NSTATUS; i++)
    n += op->errors[i];
  return n;
}

static void add_stats(op_stats_t *dst, const op_stats_t *src) {
  embps_hdr_add(&dst->lat, &src->lat);
  dst->ok += src->ok;
  dst->rows += src->rows;
  dst->bytes += src->bytes;
  for (int i = 0; i < NSTATUS; i++)
    dst->errors[i] += src->errors[i];
}

static void batch_text(const embps_bench_opts_t *o, char *out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  for (size_t i = 0; i < o->nbatches && len < cap; i++) {
    int n = o->weights && o->nbatches > 1
                ? snprintf(out + len, cap - len, "%s%llu:%g", i ? "," : "",
                           (unsigned long long)o->batches[i], o->weights[i])
                : snprintf(out + len, cap - len, "%s%llu", i ? "," : "",
                           (unsigned long long)o->batches[i]);
    if (n < 0)
      break;
    len += (size_t)n;
  }
}

static void print_text(const op_stats_t *op, const embps_bench_opts_t *o, const char *names,
                       double elapsed, cpu_use_t cpu, char first_error[NSTATUS][200]) {
  static const char *const opname[3] = {"lookup", "push", "all"};
  char batches[256];
  batch_text(o, batches, sizeof(batches));
  printf("table %s: batch %s, %u threads x %u in flight, ", names, batches, o->concurrency,
         o->pipeline);
  if (o->rate > 0)
    printf("open loop at %g batches/s", o->rate);
  else
    printf("closed loop");
  printf(", zipf %g", o->zipf);
  if (o->key_space)
    printf(", key space %llu", (unsigned long long)o->key_space);
  printf(", push ratio %g, %.2f s\n", o->push_ratio, elapsed);
  printf("%-7s %9s %11s %13s %8s %9s %9s %9s %9s %9s %9s %8s\n", "op", "count", "batches/s",
         "rows/s", "GB/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "p99.99ms", "max ms",
         "errors");
  for (int i = 0; i < 3; i++) {
    printf("%-7s %9llu %11.1f %13.1f %8.3f", opname[i], (unsigned long long)op[i].ok,
           (double)op[i].ok / elapsed, (double)op[i].rows / elapsed, op[i].bytes / elapsed / 1e9);
    for (size_t p = 0; p < sizeof(report_pcts) / sizeof(report_pcts[0]); p++)
      printf(" %9.3f", ms(embps_hdr_percentile(&op[i].lat, report_pcts[p])));
    printf(" %9.3f %8llu\n", ms(op[i].lat.max), (unsigned long long)errors_of(&op[i]));
  }
  for (int s = 1; s < NSTATUS; s++)
    if (op[OP_ALL].errors[s])
      printf("errors %s: %llu (first: %s)\n", embps_status_name((embps_status_t)s),
             (unsigned long long)op[OP_ALL].errors[s], first_error[s]);
  if (cpu.s >= 0) {
    uint64_t calls = op[OP_ALL].ok + errors_of(&op[OP_ALL]);
    printf("client CPU %.2f s (user + system, all threads) in %.2f s: %.0f%% of one core", cpu.s,
           cpu.wall, 100 * cpu.s / (cpu.wall > 0 ? cpu.wall : 1e-9));
    if (calls)
      printf(", %.3f ms a batch", 1e3 * cpu.s / (double)calls);
    printf("\n");
  }
}

static void print_csv(const op_stats_t *op, double elapsed) {
  static const char *const opname[3] = {"lookup", "push", "all"};
  printf("op,count,errors,batches_per_s,rows_per_s,gbytes_per_s,p50_ms,p90_ms,p99_ms,p999_ms,"
         "p9999_ms,max_ms\n");
  for (int i = 0; i < 3; i++) {
    printf("%s,%llu,%llu,%.3f,%.1f,%.6f", opname[i], (unsigned long long)op[i].ok,
           (unsigned long long)errors_of(&op[i]), (double)op[i].ok / elapsed,
           (double)op[i].rows / elapsed, op[i].bytes / elapsed / 1e9);
    for (size_t p = 0; p < sizeof(report_pcts) / sizeof(report_pcts[0]); p++)
      printf(",%.4f", ms(embps_hdr_percentile(&op[i].lat, report_pcts[p])));
    printf(",%.4f\n", ms(op[i].lat.max));
  }
}

/* Today's keys first (scripts read them), then ghz's report keys over all ops: durations in
 * nanoseconds, histogram marks in seconds, status names as Go spells them. Every count is a
 * JSON number: "batches" the batches answered (lookups + pushes), the --batch or --mix sizes
 * and weights arrays of numbers. */
static void print_json(const op_stats_t *op, const embps_bench_opts_t *o, const char *names,
                       double elapsed, cpu_use_t cpu, char first_error[NSTATUS][200]) {
  static const char *const pre[3] = {"lookup_", "push_", ""};
  static const double ghz_pcts[] = {10, 25, 50, 75, 90, 95, 99, 99.9, 99.99};
  const op_stats_t *all = &op[OP_ALL];
  uint64_t count = all->ok + errors_of(all);
  int first;

  printf("{\"table\":");
  embps_cli_json_string(stdout, names);
  printf(",\"batch\":%llu,\"batch_sizes\":[", (unsigned long long)o->batches[0]);
  for (size_t i = 0; i < o->nbatches; i++)
    printf("%s%llu", i ? "," : "", (unsigned long long)o->batches[i]);
  printf("],\"batch_weights\":[");
  for (size_t i = 0; i < o->nbatches; i++)
    printf("%s%g", i ? "," : "", o->weights ? o->weights[i] : 1.0);
  printf(
      "],\"concurrency\":%u,\"pipeline\":%u,\"mode\":\"%s\",\"rate\":%g,\"zipf\":%g,"
      "\"key_space\":%llu,\"push_ratio\":%g,\"duration_s\":%.3f,\"batches\":%llu,\"lookups\":%llu,"
      "\"pushes\":%llu,\"errors\":%llu",
      o->concurrency, o->pipeline, o->rate > 0 ? "open" : "closed", o->rate, o->zipf,
      (unsigned long long)o->key_space, o->push_ratio, elapsed, (unsigned long long)all->ok,
      (unsigned long long)op[OP_LOOKUP].ok, (unsigned long long)op[OP_PUSH].ok,
      (unsigned long long)errors_of(all));
  if (cpu.s >= 0)
    printf(",\"client_cpu_s\":%.4f,\"client_cpu_wall_s\":%.4f", cpu.s, cpu.wall);
  else
    printf(",\"client_cpu_s\":null,\"client_cpu_wall_s\":null");
  for (int i = 0; i < 2; i++)
    printf(",\"%sbatches_per_s\":%.3f,\"%srows_per_s\":%.1f,\"%sgbytes_per_s\":%.6f", pre[i],
           (double)op[i].ok / elapsed, pre[i], (double)op[i].rows / elapsed, pre[i],
           op[i].bytes / elapsed / 1e9);
  for (int i = 2; i >= 0; i--)
    printf(",\"%sp50_ms\":%.4f,\"%sp90_ms\":%.4f,\"%sp99_ms\":%.4f,\"%sp999_ms\":%.4f,"
           "\"%sp9999_ms\":%.4f,\"%smax_ms\":%.4f",
           pre[i], ms(embps_hdr_percentile(&op[i].lat, 50)), pre[i],
           ms(embps_hdr_percentile(&op[i].lat, 90)), pre[i],
           ms(embps_hdr_percentile(&op[i].lat, 99)), pre[i],
           ms(embps_hdr_percentile(&op[i].lat, 99.9)), pre[i],
           ms(embps_hdr_percentile(&op[i].lat, 99.99)), pre[i], ms(op[i].lat.max));
  printf(",\"count\":%llu,\"total\":%.0f,\"average\":%.0f,\"fastest\":%llu,\"slowest\":%llu,"
         "\"rps\":%.3f",
         (unsigned long long)count, elapsed * 1e9, embps_hdr_mean(&all->lat),
         (unsigned long long)all->lat.min, (unsigned long long)all->lat.max,
         (double)count / elapsed);
  printf(",\"latencyDistribution\":[");
  for (size_t p = 0; all->ok && p < sizeof(ghz_pcts) / sizeof(ghz_pcts[0]); p++)
    printf("%s{\"percentage\":%g,\"latency\":%llu}", p ? "," : "", ghz_pcts[p],
           (unsigned long long)embps_hdr_percentile(&all->lat, ghz_pcts[p]));
  printf("],\"histogram\":[");
  if (all->ok) { /* ghz's 11 marks from fastest to slowest; each counts the calls above the
                    previous mark up to its own */
    uint64_t below = 0;
    double step = (double)(all->lat.max - all->lat.min) / 10.0;
    for (int b = 0; b <= 10; b++) {
      uint64_t mark = b == 10 ? all->lat.max : all->lat.min + (uint64_t)(step * b);
      uint64_t upto = embps_hdr_count_at_most(&all->lat, mark);
      if (b == 10)
        upto = all->ok;
      printf("%s{\"mark\":%.9f,\"count\":%llu,\"frequency\":%.6f}", b ? "," : "",
             (double)mark / 1e9, (unsigned long long)(upto - below),
             (double)(upto - below) / (double)all->ok);
      below = upto;
    }
  }
  printf("],\"statusCodeDistribution\":{");
  first = 1;
  for (int s = 0; s < NSTATUS; s++) {
    uint64_t n = s == 0 ? all->ok : all->errors[s];
    if (n) {
      printf("%s\"%s\":%llu", first ? "" : ",", ghz_code_names[s], (unsigned long long)n);
      first = 0;
    }
  }
  printf("},\"errorDistribution\":{");
  first = 1;
  for (int s = 1; s < NSTATUS; s++)
    if (all->errors[s]) {
      char key[260];
      snprintf(key, sizeof(key), "%s: %s", embps_status_name((embps_status_t)s), first_error[s]);
      printf("%s", first ? "" : ",");
      embps_cli_json_string(stdout, key);
      printf(":%llu", (unsigned long long)all->errors[s]);
      first = 0;
    }
  printf("}}\n");
}

int embps_cli_bench(const char *servers, const embps_client_options_t *copts,
                    const embps_table_spec_t *const *tables, size_t ntables,
                    const embps_bench_opts_t *o) {
  uint32_t nw = o->concurrency, started = 0;
  worker_t *w = NULL;
  op_stats_t op[3];
  char first_error[NSTATUS][200];
  char names[512];
  size_t len = 0;
  double t0, t_measure, t_end, elapsed, cpu0 = -1;
  cpu_use_t cpu = {-1, 0};
  gate_t gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  int rc = 0;

  memset(op, 0, sizeof(op));
  memset(first_error, 0, sizeof(first_error));
  /* A batch that does not split over the group is refused before anything is sent, in the
   * words of DESIGN.md's table; --pad makes the client pad it instead. */
  for (size_t i = 0; i < o->nbatches && !copts->pad_batches; i++) {
    embps_error_t err;
    embps_error_clear(&err);
    if (embps_shape_check_tokens_per_batch(o->batches[i], copts->group_size, &err) != EMBPS_OK) {
      fprintf(stderr, "embps: bench: %s: %s (or run with --pad)\n", embps_status_string(err.status),
              err.message);
      return 1;
    }
  }
  names[0] = '\0';
  for (size_t t = 0; t < ntables && len < sizeof(names); t++) {
    int n = snprintf(names + len, sizeof(names) - len, "%s%s", t ? "," : "", tables[t]->name);
    if (n < 0)
      break;
    len += (size_t)n;
  }
  w = calloc(nw, sizeof(*w));
  rc = !w;
  for (int i = 0; i < 3; i++)
    rc |= embps_hdr_init(&op[i].lat) != 0;
  for (uint32_t i = 0; w && i < nw; i++)
    for (int j = 0; j < 2; j++)
      rc |= embps_hdr_init(&w[i].op[j].lat) != 0;
  if (rc) {
    fprintf(stderr, "embps: bench: out of memory\n");
    rc = 1;
    goto exit;
  }
  atomic_store(&g_lookups, 0);
  atomic_store(&g_pushes, 0);
  atomic_store(&g_rows, 0);
  atomic_store(&g_errors, 0);
  atomic_store(&g_stop, 0);
  for (uint32_t i = 0; i < nw; i++) {
    w[i].index = i;
    w[i].servers = servers;
    w[i].copts = copts;
    w[i].tables = tables;
    w[i].ntables = ntables;
    w[i].o = o;
    w[i].gate = &gate;
    if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) {
      fprintf(stderr, "embps: bench: cannot start thread %u\n", i);
      atomic_store(&g_stop, 1);
      rc = 1;
      break;
    }
    started++;
  }
  gate_open(&gate, started, o->warmup_s, o->duration_s);
  t0 = gate.t0;
  t_measure = gate.t_measure;
  t_end = gate.t_end;
  if (o->output == EMBPS_BENCH_TEXT) {
    uint64_t last_rows = 0;
    double last_t = now_s();
    mark_cpu(&cpu0, t_measure);
    while (!atomic_load(&g_stop) && now_s() < t_end) {
      double t;
      /* wakes at the end of the warm-up too, to take the CPU time there */
      sleep_s(cpu0 < 0 && t_measure - now_s() < 0.1 ? t_measure - now_s() : 0.1);
      mark_cpu(&cpu0, t_measure);
      t = now_s();
      if (t - last_t >= 1.0) {
        uint64_t rows = atomic_load(&g_rows);
        fprintf(
            stderr, "bench %5.1fs%s  lookups %llu  pushes %llu  errors %llu  %.3g rows/s\n", t - t0,
            t < t_measure ? " (warmup)" : "", (unsigned long long)atomic_load(&g_lookups),
            (unsigned long long)atomic_load(&g_pushes), (unsigned long long)atomic_load(&g_errors),
            (double)(rows - last_rows) / (t - last_t));
        last_rows = rows;
        last_t = t;
      }
    }
  } else {
    sleep_s(t_measure - now_s());
    mark_cpu(&cpu0, t_measure);
  }
  for (uint32_t i = 0; i < started; i++)
    pthread_join(w[i].thread, NULL);
  if (cpu0 >= 0) {
    cpu.s = cpu_s() - cpu0;
    cpu.wall = now_s() - t_measure;
  }
  elapsed = o->rate > 0 ? t_end - t_measure : (now_s() < t_end ? now_s() : t_end) - t_measure;
  if (elapsed <= 0)
    elapsed = 1e-9;
  for (uint32_t i = 0; i < started; i++)
    if (w[i].failed) {
      fprintf(stderr, "embps: bench: %s\n", w[i].error);
      rc = 1;
      goto exit;
    }
  if (rc)
    goto exit;
  for (uint32_t i = 0; i < started; i++)
    for (int j = 0; j < 2; j++) {
      add_stats(&op[j], &w[i].op[j]);
      add_stats(&op[OP_ALL], &w[i].op[j]);
      for (int st = 0; st < NSTATUS; st++)
        if (w[i].op[j].errors[st] && !first_error[st][0])
          memcpy(first_error[st], w[i].first_error[st], sizeof(first_error[st]));
    }
  if (o->output == EMBPS_BENCH_JSON)
    print_json(op, o, names, elapsed, cpu, first_error);
  else if (o->output == EMBPS_BENCH_CSV)
    print_csv(op, elapsed);
  else
    print_text(op, o, names, elapsed, cpu, first_error);
  if (errors_of(&op[OP_ALL])) {
    fprintf(stderr, "embps: bench: %llu call(s) failed (see the report)\n",
            (unsigned long long)errors_of(&op[OP_ALL]));
    rc = 1;
  }
exit:
  for (uint32_t i = 0; w && i < nw; i++)
    for (int j = 0; j < 2; j++)
      embps_hdr_free(&w[i].op[j].lat);
  for (int i = 0; i < 3; i++)
    embps_hdr_free(&op[i].lat);
  free(w);
  return rc;
}
