/* `embps bench --features SPEC`: load on a feature set, one training step at a time.
 *
 * A step is a batch of B samples (--batch) of every feature of the spec ("26x1,1x100:sum":
 * 26 features of one id per sample and one of 100, pooled by sum), feature i on table
 * i % ntables, every bag of its group's size, ids drawn from a pool per feature and thread (uniform
 * or Zipf over [1, rows), or mixed keys over a hash-keyed table's key space, as bench.c draws
 * tokens) at a random offset each step, so the clock measures calls and not the sampler.
 *
 * Two ways to run the same step, for the comparison issue 32 asks for:
 *   - features (the default): one LookupFeatures or PushFeatures per rank, pooled on the servers
 *     (embps_lookup_features / embps_push_features);
 *   - --per-table: what a worker did before feature batches: one Lookup or PushGradients per
 *     table and step, carrying every id of the table's features, all of them in flight at once;
 *     the client pools each bag from the rows that come back (sum, mean over the nonzero ids,
 *     weighted sum) and, for a push, expands each bag's gradient to its ids (times the weight,
 *     over the bag's nonzero ids for mean, in the table's dtype) before sending. Both costs are
 *     inside the step's time, as they are inside a worker's.
 * Pushes carry gradients of 1e-4 (pooled: one f32 row per sample; pooling none: one row per id);
 * weighted sum weighs every id 1.0.
 *
 * Closed loop: --concurrency threads, each with its own client, keep --pipeline steps in flight
 * and finish them oldest first; a step's latency runs from its start to the end of its last
 * call (and, --per-table, the client's pooling), and the steps that end between the warm-up and
 * the deadline count (bench.c says why not only those that also start after it). The clock starts
 * once every thread has drawn its pools and connected (two barriers: ready, then the times set).
 * The report gives steps/s, samples/s, ids/s, latency percentiles per op, errors by status and the
 * client's CPU time after the warm-up. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/hdr.h"
#include "client/cli/zipf.h"
#include "common/clock.h"
#include "common/dtype.h"
#include "common/shape.h"
#include "common/status.h"

#define NSTATUS 17

static const char *const pooling_names[] = {"none", "sum", "mean", "weighted_sum"};

int embps_bench_parse_features(const char *spec, embps_bench_feature_group_t **out, size_t *n,
                               char *err, size_t errlen) {
  embps_bench_feature_group_t *g = NULL;
  size_t count = 1, ng = 0;
  uint64_t total = 0;
  char *copy, *save = NULL;
  if (!spec || !*spec) {
    snprintf(err, errlen, "--features: empty; give COUNTxBAG[:POOLING],... e.g. 26x1,1x100:sum");
    return -1;
  }
  for (const char *p = spec; *p; p++)
    count += *p == ',';
  if (!(copy = strdup(spec)) || !(g = calloc(count, sizeof(*g)))) {
    free(copy);
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    char *x = strchr(item, 'x'), *colon = strchr(item, ':');
    uint64_t c, b;
    int pooling = EMBPS_POOLING_SUM;
    if (colon) {
      *colon = '\0';
      pooling = -1;
      for (int k = 0; k < 4; k++)
        if (strcmp(colon + 1, pooling_names[k]) == 0)
          pooling = k;
    }
    if (x)
      *x = '\0';
    if (!x || pooling < 0 ||
        embps_cli_parse_u64("count", item, 1, EMBPS_BENCH_MAX_FEATURES, &c, err, errlen) != 0 ||
        embps_cli_parse_u64("bag", x + 1, 1, 100000, &b, err, errlen) != 0) {
      snprintf(err, errlen,
               "--features: item %zu is not COUNTxBAG[:POOLING] (COUNT in [1, %d], BAG in [1, "
               "100000], POOLING none, sum, mean or weighted_sum), e.g. 26x1,1x100:sum",
               ng + 1, EMBPS_BENCH_MAX_FEATURES);
      free(copy);
      free(g);
      return -1;
    }
    g[ng++] = (embps_bench_feature_group_t){(uint32_t)c, (uint32_t)b, (embps_pooling_t)pooling};
    total += c;
  }
  free(copy);
  if (ng == 0 || total > EMBPS_BENCH_MAX_FEATURES) {
    snprintf(err, errlen, "--features: %llu features; give 1 to %d", (unsigned long long)total,
             EMBPS_BENCH_MAX_FEATURES);
    free(g);
    return -1;
  }
  *out = g;
  *n = ng;
  return 0;
}

/* ---- the step's shape, shared read-only by the threads ---- */

typedef struct feat {
  char name[24];
  size_t table;      /* index into the tables */
  uint32_t bag;      /* ids per sample */
  int pooling;       /* embps_pooling_t */
  size_t n_ids;      /* B x bag */
  size_t rb;         /* bytes of one row of the table's dtype */
  size_t w;          /* emb_width */
  size_t at;         /* per-table: where its ids start among its table's */
  uint32_t *lengths; /* B entries of bag */
  void *grads;       /* pooled: B rows of w f32; none: n_ids rows of the table's dtype */
} feat_t;

typedef struct plan {
  size_t B, nf, nt;
  const embps_table_spec_t *const *tables;
  feat_t *f;
  size_t *table_ids; /* per table: the ids of its features in one step */
  float *ones;       /* the weights: 1.0 for the most ids of a feature */
  int per_table;
} plan_t;

typedef struct op_stats {
  embps_hdr_t lat;
  uint64_t ok, errors[NSTATUS];
} op_stats_t;

typedef struct gate {
  pthread_barrier_t ready, go;
  double t0, t_measure, t_end;
} gate_t;

/* One step in flight. */
typedef struct slot {
  int busy, is_push;
  double start;
  uint64_t seq;
  embps_call_t *call;   /* features */
  embps_call_t **calls; /* per table: one per table */
  embps_feature_t *fv;  /* features: one per feature */
  embps_feature_step_t *steps;
  void **out;           /* per feature: its rows (pooled on the client, per table) */
  int64_t **tok;        /* per table: the step's ids */
  void **tout, **tgrad; /* per table: the rows, the expanded gradients */
  embps_push_result_t *res;
} slot_t;

typedef struct worker {
  pthread_t thread;
  uint32_t index;
  const char *servers;
  const embps_client_options_t *copts;
  const embps_bench_opts_t *o;
  const plan_t *p;
  gate_t *gate;
  op_stats_t op[2];
  char first_error[NSTATUS][200];
  int failed;
  char error[640];
} worker_t;

static atomic_int g_stop;

static double now_s(void) { return (double)embps_now_ns() * 1e-9; }

static double cpu_s(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0)
    return 0;
  return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static void put_value(void *rows, int dtype, size_t i, float v) {
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h = embps_f32_to_bf16(v);
    memcpy((uint8_t *)rows + 2 * i, &h, 2);
  } else {
    memcpy((uint8_t *)rows + 4 * i, &v, 4);
  }
}

static float get_value(const void *rows, int dtype, size_t i) {
  float v;
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)rows + 2 * i, 2);
    return embps_bf16_to_f32(h);
  }
  memcpy(&v, (const uint8_t *)rows + 4 * i, 4);
  return v;
}

/* ---- per table: what a worker does around one Lookup or PushGradients per table ---- */

/* Pools feature f's bags from its table's rows (rows of its ids, in order) into out. */
static void pool_on_client(const plan_t *p, const feat_t *f, const int64_t *ids, const void *rows,
                           float *out) {
  const int dtype = p->tables[f->table]->dtype;
  for (size_t b = 0; b < p->B; b++) {
    float *o = out + b * f->w;
    uint32_t nz = 0;
    memset(o, 0, f->w * sizeof(float));
    for (uint32_t i = 0; i < f->bag; i++) {
      size_t id = b * f->bag + i;
      if (ids[id] == 0)
        continue;
      nz++;
      for (size_t j = 0; j < f->w; j++)
        o[j] += get_value(rows, dtype, id * f->w + j); /* weights are 1.0 */
    }
    if (f->pooling == EMBPS_POOLING_MEAN && nz)
      for (size_t j = 0; j < f->w; j++)
        o[j] /= (float)nz;
  }
}

/* Expands feature f's pooled gradients to its ids' rows in the table's dtype, into g. */
static void expand_on_client(const plan_t *p, const feat_t *f, const int64_t *ids, void *g) {
  const int dtype = p->tables[f->table]->dtype;
  const float *pg = f->grads;
  for (size_t b = 0; b < p->B; b++) {
    uint32_t nz = 0;
    for (uint32_t i = 0; i < f->bag; i++)
      nz += ids[b * f->bag + i] != 0;
    for (uint32_t i = 0; i < f->bag; i++) {
      size_t id = b * f->bag + i;
      for (size_t j = 0; j < f->w; j++) {
        float v = ids[id] == 0                       ? 0.0f
                  : f->pooling == EMBPS_POOLING_MEAN ? pg[b * f->w + j] / (float)nz
                                                     : pg[b * f->w + j];
        put_value(g, dtype, id * f->w + j, v);
      }
    }
  }
}

/* ---- the worker ---- */

static void count_error(worker_t *w, int is_push, embps_status_t st, const char *msg) {
  unsigned code = (unsigned)st < NSTATUS ? (unsigned)st : EMBPS_UNKNOWN;
  if (w->op[is_push].errors[code]++ == 0 && !w->first_error[code][0])
    snprintf(w->first_error[code], sizeof(w->first_error[code]), "%s", msg);
}

static void slot_free(const plan_t *p, slot_t *s) {
  for (size_t k = 0; s->out && k < p->nf; k++)
    free(s->out[k]);
  for (size_t t = 0; s->tok && t < p->nt; t++) {
    free(s->tok[t]);
    free(s->tout[t]);
    free(s->tgrad[t]);
  }
  free(s->calls);
  free(s->fv);
  free(s->steps);
  free(s->out);
  free(s->tok);
  free(s->tout);
  free(s->tgrad);
  free(s->res);
}

/* Allocates a slot's buffers; 0 or -1. */
static int slot_init(const plan_t *p, slot_t *s) {
  if (!(s->fv = calloc(p->nf, sizeof(*s->fv))) || !(s->steps = calloc(p->nf, sizeof(*s->steps))) ||
      !(s->out = calloc(p->nf, sizeof(*s->out))) ||
      !(s->calls = calloc(p->nt, sizeof(*s->calls))) ||
      !(s->tok = calloc(p->nt, sizeof(*s->tok))) || !(s->tout = calloc(p->nt, sizeof(*s->tout))) ||
      !(s->tgrad = calloc(p->nt, sizeof(*s->tgrad))) || !(s->res = calloc(p->nt, sizeof(*s->res))))
    return -1;
  for (size_t k = 0; k < p->nf; k++) {
    const feat_t *f = &p->f[k];
    size_t bytes = f->pooling == EMBPS_POOLING_NONE ? f->n_ids * f->rb : p->B * f->w * 4;
    embps_feature_t *v = &s->fv[k];
    if (p->per_table && f->pooling == EMBPS_POOLING_NONE)
      bytes = 0; /* its rows stay in the table's buffer */
    if (bytes && !(s->out[k] = malloc(bytes)))
      return -1;
    v->name = f->name;
    v->table = p->tables[f->table]->name;
    v->pooling = (embps_pooling_t)f->pooling;
    v->num_ids = f->n_ids;
    v->lengths = f->lengths;
    v->weights = f->pooling == EMBPS_POOLING_WEIGHTED_SUM ? p->ones : NULL;
    v->out = s->out[k];
    v->out_bytes = bytes;
    v->grads = f->grads;
    v->grad_bytes = f->pooling == EMBPS_POOLING_NONE ? f->n_ids * f->rb : p->B * f->w * 4;
  }
  for (size_t t = 0; p->per_table && t < p->nt; t++) {
    size_t n = p->table_ids[t],
           rb = p->tables[t]->emb_width * embps_dtype_size(p->tables[t]->dtype);
    if (n == 0)
      continue;
    if (!(s->tok[t] = malloc(n * sizeof(int64_t))) || !(s->tout[t] = malloc(n * rb)) ||
        !(s->tgrad[t] = malloc(n * rb)))
      return -1;
  }
  return 0;
}

/* Starts a step in slot s; returns its status (the step counts as failed when it is not OK). */
static embps_status_t step_start(worker_t *w, embps_client_t *c, slot_t *s, int64_t *const *pool,
                                 const size_t *pool_n, embps_rng_t *rng) {
  const plan_t *p = w->p;
  embps_push_mode_t mode = w->o->async_push ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC;
  for (size_t k = 0; k < p->nf; k++) {
    const feat_t *f = &p->f[k];
    size_t off = (size_t)(embps_rng_next(rng) % (pool_n[k] - f->n_ids + 1));
    s->fv[k].ids = pool[k] + off;
    if (p->per_table)
      memcpy(s->tok[f->table] + f->at, pool[k] + off, f->n_ids * sizeof(int64_t));
  }
  if (!p->per_table)
    return s->is_push
               ? embps_push_features_start(c, s->fv, p->nf, p->B, mode, s->steps, NULL, &s->call)
               : embps_lookup_features_start(c, s->fv, p->nf, p->B, &s->call);
  for (size_t t = 0; t < p->nt; t++) {
    const embps_table_spec_t *spec = p->tables[t];
    size_t n = p->table_ids[t], rb = spec->emb_width * embps_dtype_size(spec->dtype);
    embps_status_t st;
    if (n == 0)
      continue;
    if (s->is_push)
      for (size_t k = 0; k < p->nf; k++) {
        const feat_t *f = &p->f[k];
        if (f->table != t)
          continue;
        if (f->pooling == EMBPS_POOLING_NONE)
          memcpy((uint8_t *)s->tgrad[t] + f->at * rb, f->grads, f->n_ids * rb);
        else
          expand_on_client(p, f, s->tok[t] + f->at, (uint8_t *)s->tgrad[t] + f->at * rb);
      }
    st = s->is_push
             ? embps_push_start(c, spec->name, s->tok[t], n, s->tgrad[t], n * rb, spec->dtype, mode,
                                &s->res[t], &s->calls[t])
             : embps_lookup_start(c, spec->name, s->tok[t], n, s->tout[t], n * rb, &s->calls[t]);
    if (st != EMBPS_OK) {
      for (size_t u = 0; u < t; u++)
        if (s->calls[u]) {
          embps_call_cancel(s->calls[u]);
          s->calls[u] = NULL;
        }
      return st;
    }
  }
  return EMBPS_OK;
}

/* Waits for slot s's step; returns its status (the first failing call's). */
static embps_status_t step_wait(worker_t *w, embps_client_t *c, slot_t *s, char *msg,
                                size_t msglen) {
  const plan_t *p = w->p;
  embps_status_t st = EMBPS_OK;
  if (!p->per_table) {
    st = embps_call_wait(s->call);
    s->call = NULL;
    if (st != EMBPS_OK)
      snprintf(msg, msglen, "%s", embps_client_last_error(c));
    return st;
  }
  for (size_t t = 0; t < p->nt; t++) {
    embps_status_t one;
    if (!s->calls[t])
      continue;
    one = embps_call_wait(s->calls[t]);
    s->calls[t] = NULL;
    if (one != EMBPS_OK && st == EMBPS_OK) {
      st = one;
      snprintf(msg, msglen, "%s", embps_client_last_error(c));
    }
  }
  if (st == EMBPS_OK && !s->is_push)
    for (size_t k = 0; k < p->nf; k++) {
      const feat_t *f = &p->f[k];
      size_t rb = f->rb;
      if (f->pooling != EMBPS_POOLING_NONE)
        pool_on_client(p, f, s->tok[f->table] + f->at, (uint8_t *)s->tout[f->table] + f->at * rb,
                       s->out[k]);
    }
  return st;
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  const plan_t *p = w->p;
  const embps_bench_opts_t *o = w->o;
  int64_t **pool = calloc(p->nf, sizeof(*pool));
  size_t *pool_n = calloc(p->nf, sizeof(*pool_n));
  slot_t *slots = calloc(o->pipeline, sizeof(*slots));
  embps_client_t *c = NULL;
  embps_error_t err;
  embps_rng_t rng;
  uint32_t inflight = 0;
  uint64_t seq = 0;
  double t_measure, t_end;

  embps_rng_seed(&rng, o->seed * 1000003u + w->index);
  if (!pool || !pool_n || !slots)
    goto oom;
  for (size_t k = 0; k < p->nf; k++) {
    const feat_t *f = &p->f[k];
    const embps_table_spec_t *spec = p->tables[f->table];
    embps_zipf_t z;
    pool_n[k] = f->n_ids * 4 > 65536 ? f->n_ids * 4 : 65536;
    if (!(pool[k] = malloc(pool_n[k] * sizeof(int64_t))))
      goto oom;
    embps_zipf_init(&z, embps_bench_key_space(spec->rows, spec->capacity, o->key_space), o->zipf);
    for (size_t i = 0; i < pool_n[k]; i++) {
      uint64_t rank = embps_zipf_sample(&z, &rng);
      pool[k][i] = (int64_t)(spec->capacity ? embps_key_mix(rank) : rank);
    }
  }
  for (uint32_t i = 0; i < o->pipeline; i++)
    if (slot_init(p, &slots[i]) != 0)
      goto oom;
  embps_error_clear(&err);
  if (embps_client_connect(&c, w->servers, w->copts, &err) != EMBPS_OK) {
    snprintf(w->error, sizeof(w->error), "connect: %s: %s", embps_status_string(err.status),
             err.message);
    goto fail;
  }
  goto run;
oom:
  snprintf(w->error, sizeof(w->error), "out of memory");
fail:
  w->failed = 1;
  atomic_store(&g_stop, 1);
run:
  pthread_barrier_wait(&w->gate->ready);
  pthread_barrier_wait(&w->gate->go);
  t_measure = w->gate->t_measure;
  t_end = w->gate->t_end;
  while (!w->failed) {
    slot_t *oldest = NULL;
    char msg[200] = "";
    while (inflight < o->pipeline && !atomic_load(&g_stop) && now_s() < t_end) {
      slot_t *s = slots;
      embps_status_t st;
      while (s->busy)
        s++;
      s->is_push = o->push_ratio > 0 && embps_rng_uniform(&rng) < o->push_ratio;
      s->seq = seq++;
      s->start = now_s();
      st = step_start(w, c, s, pool, pool_n, &rng);
      if (st != EMBPS_OK) {
        if (s->start >= t_measure)
          count_error(w, s->is_push, st, embps_client_last_error(c));
        continue;
      }
      s->busy = 1;
      inflight++;
    }
    if (inflight == 0)
      break;
    for (uint32_t i = 0; i < o->pipeline; i++)
      if (slots[i].busy && (!oldest || slots[i].seq < oldest->seq))
        oldest = &slots[i];
    {
      embps_status_t st = step_wait(w, c, oldest, msg, sizeof(msg));
      double end = now_s();
      oldest->busy = 0;
      inflight--;
      if (end < t_measure || end > t_end) /* the calls that end in the window (bench.c) */
        continue;
      if (st != EMBPS_OK) {
        count_error(w, oldest->is_push, st, msg);
        continue;
      }
      embps_hdr_record(&w->op[oldest->is_push].lat, (uint64_t)((end - oldest->start) * 1e9));
      w->op[oldest->is_push].ok++;
    }
  }
  for (uint32_t i = 0; slots && i < o->pipeline; i++) {
    if (slots[i].call)
      embps_call_cancel(slots[i].call);
    for (size_t t = 0; slots[i].calls && t < p->nt; t++)
      if (slots[i].calls[t])
        embps_call_cancel(slots[i].calls[t]);
    slot_free(p, &slots[i]);
  }
  embps_client_free(c);
  for (size_t k = 0; pool && k < p->nf; k++)
    free(pool[k]);
  free(pool);
  free(pool_n);
  free(slots);
  return NULL;
}

/* ---- the plan and the report ---- */

static void plan_free(plan_t *p) {
  for (size_t k = 0; p->f && k < p->nf; k++) {
    free(p->f[k].lengths);
    free(p->f[k].grads);
  }
  free(p->f);
  free(p->table_ids);
  free(p->ones);
}

static int plan_make(plan_t *p, const embps_table_spec_t *const *tables, size_t ntables,
                     const embps_bench_opts_t *o, const embps_bench_features_t *fo) {
  size_t most = 0, k = 0;
  memset(p, 0, sizeof(*p));
  p->B = (size_t)o->batches[0];
  p->nt = ntables;
  p->tables = tables;
  p->per_table = fo->per_table;
  for (size_t g = 0; g < fo->ngroups; g++)
    p->nf += fo->groups[g].count;
  if (!(p->f = calloc(p->nf, sizeof(*p->f))) || !(p->table_ids = calloc(ntables, sizeof(size_t))))
    return -1;
  for (size_t g = 0; g < fo->ngroups; g++)
    for (uint32_t i = 0; i < fo->groups[g].count; i++, k++) {
      feat_t *f = &p->f[k];
      const embps_table_spec_t *spec = tables[k % ntables];
      size_t rows;
      snprintf(f->name, sizeof(f->name), "f%zu", k);
      f->table = k % ntables;
      f->bag = fo->groups[g].bag;
      f->pooling = fo->groups[g].pooling;
      f->n_ids = p->B * f->bag;
      f->w = spec->emb_width;
      f->rb = f->w * embps_dtype_size(spec->dtype);
      f->at = p->table_ids[f->table];
      p->table_ids[f->table] += f->n_ids;
      most = f->n_ids > most ? f->n_ids : most;
      if (!(f->lengths = malloc(p->B * sizeof(uint32_t))))
        return -1;
      for (size_t b = 0; b < p->B; b++)
        f->lengths[b] = f->bag;
      rows = f->pooling == EMBPS_POOLING_NONE ? f->n_ids : p->B;
      if (!(f->grads = malloc(rows * f->w * 4)))
        return -1;
      for (size_t j = 0; j < rows * f->w; j++)
        put_value(f->grads, f->pooling == EMBPS_POOLING_NONE ? (int)spec->dtype : EMBPS_DTYPE_F32,
                  j, 1e-4f);
    }
  if (!(p->ones = malloc(most * sizeof(float) + 1)))
    return -1;
  for (size_t i = 0; i < most; i++)
    p->ones[i] = 1.0f;
  return 0;
}

static double ms(uint64_t ns) { return (double)ns / 1e6; }

static uint64_t errors_of(const op_stats_t *op) {
  uint64_t n = 0;
  for (int i = 0; i < NSTATUS; i++)
    n += op->errors[i];
  return n;
}

static void report(const plan_t *p, const embps_bench_opts_t *o, const embps_bench_features_t *fo,
                   const char *names, op_stats_t *op, double elapsed, double cpu, double cpu_wall,
                   char first_error[NSTATUS][200]) {
  static const char *const opname[3] = {"lookup", "push", "all"};
  size_t ids = 0, calls = p->per_table ? 0 : 1;
  for (size_t k = 0; k < p->nf; k++)
    ids += p->f[k].bag;
  for (size_t t = 0; p->per_table && t < p->nt; t++)
    calls += p->table_ids[t] > 0;
  if (o->output == EMBPS_BENCH_JSON) {
    printf("{\"mode\":\"%s\",\"features\":", p->per_table ? "per_table" : "features");
    embps_cli_json_string(stdout, fo->spec);
    printf(",\"table\":");
    embps_cli_json_string(stdout, names);
    printf(",\"batch\":%zu,\"feature_count\":%zu,\"ids_per_sample\":%zu,\"calls_per_step\":%zu,"
           "\"concurrency\":%u,\"pipeline\":%u,\"push_ratio\":%g,\"zipf\":%g,\"duration_s\":%.3f,"
           "\"batches\":%llu,\"lookups\":%llu,\"pushes\":%llu,\"errors\":%llu",
           p->B, p->nf, ids, calls, o->concurrency, o->pipeline, o->push_ratio, o->zipf, elapsed,
           (unsigned long long)op[2].ok, (unsigned long long)op[0].ok, (unsigned long long)op[1].ok,
           (unsigned long long)errors_of(&op[2]));
    if (cpu >= 0)
      printf(",\"client_cpu_s\":%.4f,\"client_cpu_wall_s\":%.4f", cpu, cpu_wall);
    else
      printf(",\"client_cpu_s\":null,\"client_cpu_wall_s\":null");
    for (int i = 0; i < 3; i++) {
      const char *pre = i == 2 ? "" : i ? "push_" : "lookup_";
      printf(",\"%sbatches_per_s\":%.3f,\"%ssamples_per_s\":%.1f,\"%sids_per_s\":%.1f,"
             "\"%sp50_ms\":%.4f,\"%sp90_ms\":%.4f,\"%sp99_ms\":%.4f,\"%smax_ms\":%.4f",
             pre, (double)op[i].ok / elapsed, pre, (double)(op[i].ok * p->B) / elapsed, pre,
             (double)(op[i].ok * p->B * ids) / elapsed, pre,
             ms(embps_hdr_percentile(&op[i].lat, 50)), pre,
             ms(embps_hdr_percentile(&op[i].lat, 90)), pre,
             ms(embps_hdr_percentile(&op[i].lat, 99)), pre, ms(op[i].lat.max));
    }
    printf(",\"errorDistribution\":{");
    for (int s = 1, first = 1; s < NSTATUS; s++)
      if (op[2].errors[s]) {
        char key[260];
        snprintf(key, sizeof(key), "%s: %s", embps_status_name((embps_status_t)s), first_error[s]);
        printf("%s", first ? "" : ",");
        embps_cli_json_string(stdout, key);
        printf(":%llu", (unsigned long long)op[2].errors[s]);
        first = 0;
      }
    printf("}}\n");
    return;
  }
  printf("features %s (%zu features, %zu ids per sample) over table %s: batch %zu samples, %s "
         "(%zu calls per step), %u threads x %u in flight, push ratio %g, %.2f s\n",
         fo->spec, p->nf, ids, names, p->B,
         p->per_table ? "per table, pooled on the client"
                      : "one call per rank, pooled on the "
                        "servers",
         calls, o->concurrency, o->pipeline, o->push_ratio, elapsed);
  printf("%-7s %9s %9s %12s %13s %9s %9s %9s %9s %8s\n", "op", "steps", "steps/s", "samples/s",
         "ids/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors");
  for (int i = 0; i < 3; i++)
    printf("%-7s %9llu %9.2f %12.1f %13.1f %9.3f %9.3f %9.3f %9.3f %8llu\n", opname[i],
           (unsigned long long)op[i].ok, (double)op[i].ok / elapsed,
           (double)(op[i].ok * p->B) / elapsed, (double)(op[i].ok * p->B * ids) / elapsed,
           ms(embps_hdr_percentile(&op[i].lat, 50)), ms(embps_hdr_percentile(&op[i].lat, 90)),
           ms(embps_hdr_percentile(&op[i].lat, 99)), ms(op[i].lat.max),
           (unsigned long long)errors_of(&op[i]));
  for (int s = 1; s < NSTATUS; s++)
    if (op[2].errors[s])
      printf("errors %s: %llu (first: %s)\n", embps_status_name((embps_status_t)s),
             (unsigned long long)op[2].errors[s], first_error[s]);
  if (cpu >= 0)
    printf("client CPU %.2f s (user + system, all threads) in %.2f s: %.0f%% of one core\n", cpu,
           cpu_wall, 100 * cpu / (cpu_wall > 0 ? cpu_wall : 1e-9));
}

int embps_cli_bench_features(const char *servers, const embps_client_options_t *copts,
                             const embps_table_spec_t *const *tables, size_t ntables,
                             const embps_bench_opts_t *o, const embps_bench_features_t *fo) {
  plan_t p;
  worker_t *w = NULL;
  gate_t gate;
  op_stats_t op[3];
  char first_error[NSTATUS][200], names[512];
  embps_client_options_t wo = *copts;
  size_t len = 0;
  double cpu0, elapsed, cpu_wall, cpu;
  int rc = 1, barriers = 0;

  memset(op, 0, sizeof(op));
  memset(first_error, 0, sizeof(first_error));
  names[0] = '\0';
  for (size_t t = 0; t < ntables && len < sizeof(names); t++) {
    int n = snprintf(names + len, sizeof(names) - len, "%s%s", t ? "," : "", tables[t]->name);
    if (n < 0)
      break;
    len += (size_t)n;
  }
  if (!copts->pad_batches) { /* refused before anything is sent, as bench.c refuses a batch */
    embps_error_t err;
    embps_error_clear(&err);
    if (embps_shape_check_batch_size(o->batches[0], copts->group_size, &err) != EMBPS_OK) {
      fprintf(stderr, "embps: bench: %s: %s (or run with --pad)\n", embps_status_string(err.status),
              err.message);
      return 1;
    }
  }
  if (plan_make(&p, tables, ntables, o, fo) != 0) {
    fprintf(stderr, "embps: bench: out of memory\n");
    goto exit;
  }
  if (p.per_table)
    wo.pad_batches = 1; /* a table's ids need not split evenly; the features' samples do */
  for (int i = 0; i < 3; i++)
    if (embps_hdr_init(&op[i].lat) != 0)
      goto oom;
  if (!(w = calloc(o->concurrency, sizeof(*w))))
    goto oom;
  for (uint32_t i = 0; i < o->concurrency; i++)
    for (int j = 0; j < 2; j++)
      if (embps_hdr_init(&w[i].op[j].lat) != 0)
        goto oom;
  pthread_barrier_init(&gate.ready, NULL, o->concurrency + 1);
  pthread_barrier_init(&gate.go, NULL, o->concurrency + 1);
  barriers = 1;
  atomic_store(&g_stop, 0);
  for (uint32_t i = 0; i < o->concurrency; i++) {
    w[i].index = i;
    w[i].servers = servers;
    w[i].copts = &wo;
    w[i].o = o;
    w[i].p = &p;
    w[i].gate = &gate;
    if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) {
      /* the barriers count every thread, so the ones started could never pass them */
      fprintf(stderr, "embps: bench: cannot start thread %u\n", i);
      exit(1);
    }
  }
  pthread_barrier_wait(&gate.ready);
  gate.t0 = now_s();
  gate.t_measure = gate.t0 + o->warmup_s;
  gate.t_end = gate.t_measure + o->duration_s;
  pthread_barrier_wait(&gate.go);
  {
    struct timespec ts;
    double d = o->warmup_s;
    ts.tv_sec = (time_t)d;
    ts.tv_nsec = (long)((d - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
  }
  cpu0 = cpu_s();
  for (uint32_t i = 0; i < o->concurrency; i++)
    pthread_join(w[i].thread, NULL);
  cpu = now_s() >= gate.t_measure ? cpu_s() - cpu0 : -1;
  cpu_wall = now_s() - gate.t_measure;
  elapsed = (now_s() < gate.t_end ? now_s() : gate.t_end) - gate.t_measure;
  if (elapsed <= 0)
    elapsed = 1e-9;
  for (uint32_t i = 0; i < o->concurrency; i++)
    if (w[i].failed) {
      fprintf(stderr, "embps: bench: %s\n", w[i].error);
      goto exit;
    }
  for (uint32_t i = 0; i < o->concurrency; i++)
    for (int j = 0; j < 2; j++)
      for (int k = 0; k < 2; k++) {
        op_stats_t *dst = &op[k ? 2 : j];
        embps_hdr_add(&dst->lat, &w[i].op[j].lat);
        dst->ok += w[i].op[j].ok;
        for (int s = 0; s < NSTATUS; s++) {
          dst->errors[s] += w[i].op[j].errors[s];
          if (w[i].op[j].errors[s] && !first_error[s][0])
            memcpy(first_error[s], w[i].first_error[s], sizeof(first_error[s]));
        }
      }
  report(&p, o, fo, names, op, elapsed, cpu, cpu_wall, first_error);
  rc = 0;
  if (errors_of(&op[2])) {
    fprintf(stderr, "embps: bench: %llu step(s) failed (see the report)\n",
            (unsigned long long)errors_of(&op[2]));
    rc = 1;
  }
  goto exit;
oom:
  fprintf(stderr, "embps: bench: out of memory\n");
exit:
  if (barriers) {
    pthread_barrier_destroy(&gate.ready);
    pthread_barrier_destroy(&gate.go);
  }
  for (uint32_t i = 0; w && i < o->concurrency; i++)
    for (int j = 0; j < 2; j++)
      embps_hdr_free(&w[i].op[j].lat);
  for (int i = 0; i < 3; i++)
    embps_hdr_free(&op[i].lat);
  free(w);
  plan_free(&p);
  return rc;
}
