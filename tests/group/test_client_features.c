/* The C library's feature batches (embps_lookup_features, embps_push_features) against real
 * groups of 1, 2 and 4 ranks (docs/design.md, "Feature batches").
 *
 * The setup starts the three groups (group_proc.c) and creates on each the same seeded tables: a
 * dense f32 table (SGD), a dense bf16 one (Adagrad) and a hash-keyed one (rowwise Adagrad), three
 * times ("" for lookups, "a_" and "b_" for the push twins). A batch of 12 samples has six
 * features: sum, mean, weighted sum and none on them, two features sharing each dense table,
 * empty bags (sample 3 of every feature), padding id 0 inside bags, repeated ids.
 *   - Lookups: pooled rows within 1e-5 of a double-precision reference pooled here from the
 *     tables' rows (read by embps_lookup), rows of pooling none bitwise embps_lookup's, empty
 *     bags zeros; and every answer bitwise the same on 1, 2 and 4 ranks.
 *   - Padding: a 7-sample batch on 2 and 4 ranks is refused before anything is sent (the
 *     servers' request counters move only by the stats calls) with the error table's words, and
 *     with padding answers bitwise what 1 rank answers, the sentinel past the caller's rows kept.
 *   - Pushes: two sync pushes of pooled gradients on the "a_" tables against one embps_push per
 *     table on the "b_" twins whose shard r holds, feature after feature, shard r's ids with their
 *     gradients expanded here (times the weight, over the bag's nonzero ids, rounded to bf16 for
 *     the bf16 table), padded with id 0: the same step figures per table, in the order of first
 *     use (grad_norm bitwise), and bitwise the same tables after; an async push then too.
 *   - A padded push (7 samples on 2 and 4 ranks) equals the push with an 8th, empty bag.
 *   - Several lookups in flight at once (the *_start variants) answer what one at a time does.
 *   - Bad input: refused by the library before sending (each message naming the feature), or by
 *     the servers (an unknown table: NOT_FOUND naming the feature; an id outside a dense table;
 *     an out buffer sized for another width), and a refused push changes no table.
 * The last test stops every rank with SIGTERM and requires exit status 0. Every wait is bounded:
 * a 30 s client deadline, 60 s to start each group, 20 s to stop it. */
#define _DEFAULT_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client/embps.h"
#include "common/dtype.h"
#include "group_proc.h"

#define NGROUPS 3
#define DEADLINE_MS 30000
#define READY_TIMEOUT_MS 60000
#define STOP_TIMEOUT_MS 20000
#define NF 6
#define NT 3
#define MAXB 12
#define MAXBAG 6
#define MAXIDS (MAXB * MAXBAG)
#define MAXW 16

static const int g_sizes[NGROUPS] = {1, 2, 4};
static group_proc_t g_groups[NGROUPS];
static embps_client_t *g_clients[NGROUPS];

typedef struct tab {
  const char *name;
  uint64_t rows, capacity;
  uint32_t width;
  embps_dtype_t dtype;
  embps_optimizer_t opt;
} tab_t;

static const tab_t TABLES[NT] = {
    {"dense", 400, 0, 16, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD},
    {"half", 300, 0, 8, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAGRAD},
    {"keys", 0, 64, 16, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD},
};

static const struct {
  const char *name;
  int table;
  embps_pooling_t pooling;
} FEATS[NF] = {
    {"clicks", 0, EMBPS_POOLING_SUM},        {"views", 0, EMBPS_POOLING_MEAN},
    {"cats", 1, EMBPS_POOLING_WEIGHTED_SUM}, {"raw", 0, EMBPS_POOLING_NONE},
    {"users", 2, EMBPS_POOLING_SUM},         {"halfraw", 1, EMBPS_POOLING_NONE},
};

/* One batch of B samples: every feature's arrays, its out buffer and its gradients. */
typedef struct batch {
  size_t B;
  char tname[NF][16];
  int64_t ids[NF][MAXIDS];
  uint32_t lengths[NF][MAXB];
  float weights[NF][MAXIDS];
  uint8_t out[NF][MAXIDS * MAXW * 4 + 64]; /* + a sentinel's room */
  uint8_t grads[NF][MAXIDS * MAXW * 4];
  embps_feature_t f[NF];
} batch_t;

static uint64_t g_rng = 0x13198a2e03707344ull;

static uint32_t rnd(void) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33);
}

static size_t elem(int table) { return embps_dtype_size(TABLES[table].dtype); }

/* Fills b with B samples drawn from seed, on the tables named prefix + name. */
static void make_batch(batch_t *b, size_t B, uint64_t seed, const char *prefix) {
  static const int64_t keys[8] = {(int64_t)0x9e3779b97f4a7c15ull, 77, -5, 1ll << 40, 123456789,
                                  (int64_t)0xdeadbeefcafef00dull, 3,  -1};
  memset(b, 0, sizeof(*b));
  g_rng = seed;
  b->B = B;
  for (int k = 0; k < NF; k++) {
    const tab_t *t = &TABLES[FEATS[k].table];
    embps_feature_t *f = &b->f[k];
    size_t n = 0, rows;
    snprintf(b->tname[k], sizeof(b->tname[k]), "%s%s", prefix, t->name);
    for (size_t s = 0; s < B; s++) {
      /* sample 3: an empty bag; sample 5: a bag of padding only */
      b->lengths[k][s] = s == 3 ? 0 : s == 5 ? 1 : rnd() % MAXBAG;
      if (FEATS[k].pooling == EMBPS_POOLING_WEIGHTED_SUM && s != 3 && b->lengths[k][s] == 0)
        b->lengths[k][s] = 1; /* no shard without ids: see test_weighted_shard_without_ids */
      for (uint32_t i = 0; i < b->lengths[k][s]; i++, n++) {
        b->ids[k][n] = t->capacity ? keys[rnd() % 8] : (int64_t)(1 + rnd() % 40); /* repeats */
        if (s == 5 || (i == 1 && s % 2 == 0))
          b->ids[k][n] = 0; /* padding inside a bag */
        b->weights[k][n] = (float)((int)(rnd() % 64) - 32) / 16.0f;
      }
    }
    f->name = FEATS[k].name;
    f->table = b->tname[k];
    f->pooling = FEATS[k].pooling;
    f->ids = b->ids[k];
    f->num_ids = n;
    f->lengths = b->lengths[k];
    f->weights = f->pooling == EMBPS_POOLING_WEIGHTED_SUM ? b->weights[k] : NULL;
    rows = f->pooling == EMBPS_POOLING_NONE ? n : B;
    f->out = b->out[k];
    f->out_bytes = rows * t->width * (f->pooling == EMBPS_POOLING_NONE ? elem(FEATS[k].table) : 4);
    for (size_t i = 0; i < rows * t->width; i++) {
      float g = (float)((int)(rnd() % 2048) - 1024) / 1024.0f;
      if (f->pooling == EMBPS_POOLING_NONE && t->dtype == EMBPS_DTYPE_BF16) {
        uint16_t h = embps_f32_to_bf16(g);
        memcpy(b->grads[k] + 2 * i, &h, 2);
      } else {
        memcpy(b->grads[k] + 4 * i, &g, 4);
      }
    }
    f->grads = b->grads[k];
    f->grad_bytes = f->out_bytes;
  }
}

static float value_at(const uint8_t *rows, embps_dtype_t dtype, size_t i) {
  float v;
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h;
    memcpy(&h, rows + 2 * i, 2);
    return embps_bf16_to_f32(h);
  }
  memcpy(&v, rows + 4 * i, 4);
  return v;
}

static void lookup_features_ok(embps_client_t *c, batch_t *b) {
  embps_status_t st = embps_lookup_features(c, b->f, NF, b->B);
  if (st != EMBPS_OK)
    fail_msg("lookup_features (B=%zu): %s: %s", b->B, embps_status_string(st),
             embps_client_last_error(c));
}

/* The rows of n ids of table (any n: the client pads), into out. */
static void lookup_rows(embps_client_t *c, const char *table, const int64_t *ids, size_t n,
                        size_t row_bytes, void *out) {
  embps_client_set_padding(c, 1);
  embps_status_t st = embps_lookup(c, table, ids, n, out, n * row_bytes);
  embps_client_set_padding(c, 0);
  if (st != EMBPS_OK)
    fail_msg("lookup %s: %s: %s", table, embps_status_string(st), embps_client_last_error(c));
}

static void assert_twins_equal(embps_client_t *c, int t, const char *what);

/* ---- setup ------------------------------------------------------------------------------- */

static void create_tables(embps_client_t *c, const char *prefix) {
  for (int t = 0; t < NT; t++) {
    char name[32];
    embps_table_spec_t s;
    embps_table_spec_init(&s);
    snprintf(name, sizeof(name), "%s%s", prefix, TABLES[t].name);
    s.name = name;
    s.rows = TABLES[t].rows;
    s.capacity = TABLES[t].capacity;
    s.emb_width = TABLES[t].width;
    s.dtype = TABLES[t].dtype;
    s.optimizer = TABLES[t].opt;
    s.lr = 0.125f;
    s.seed = 11 + (uint64_t)t;
    embps_status_t st = embps_create_table(c, &s);
    if (st != EMBPS_OK)
      fail_msg("create %s: %s: %s", name, embps_status_string(st), embps_client_last_error(c));
  }
}

static int groups_setup(void **state) {
  (void)state;
  for (int g = 0; g < NGROUPS; g++) {
    embps_client_options_t o;
    embps_error_t err;
    if (group_proc_start(&g_groups[g], g_sizes[g], NULL, 3, READY_TIMEOUT_MS) != 0)
      return -1;
    embps_client_options_init(&o);
    o.deadline_ms = DEADLINE_MS;
    embps_error_clear(&err);
    if (embps_client_connect(&g_clients[g], g_groups[g].servers, &o, &err) != EMBPS_OK) {
      fprintf(stderr, "connect to %s: %s: %s\n", g_groups[g].servers,
              embps_status_string(err.status), err.message);
      return -1;
    }
  }
  return 0;
}

static int groups_teardown(void **state) {
  (void)state;
  for (int g = 0; g < NGROUPS; g++) {
    embps_client_free(g_clients[g]);
    g_clients[g] = NULL;
    group_proc_stop(&g_groups[g], STOP_TIMEOUT_MS, NULL); /* a no-op after test_clean_exit */
  }
  return 0;
}

static void test_create_tables(void **state) {
  (void)state;
  for (int g = 0; g < NGROUPS; g++) {
    create_tables(g_clients[g], "");
    create_tables(g_clients[g], "a_");
    create_tables(g_clients[g], "b_");
  }
}

/* ---- lookups ----------------------------------------------------------------------------- */

/* Checks b's answers (from a 1-rank group) against a double-precision pooling of the tables'
 * rows, and pooling none against embps_lookup. */
static void check_reference(embps_client_t *c, batch_t *b) {
  static uint8_t rows[MAXIDS * MAXW * 4 + 64];
  for (int k = 0; k < NF; k++) {
    const tab_t *t = &TABLES[FEATS[k].table];
    const embps_feature_t *f = &b->f[k];
    size_t at = 0, nz = 0;
    lookup_rows(c, f->table, f->ids, f->num_ids, t->width * elem(FEATS[k].table), rows);
    if (f->pooling == EMBPS_POOLING_NONE) {
      assert_memory_equal(f->out, rows, f->out_bytes);
      continue;
    }
    for (size_t s = 0; s < b->B; s++) {
      for (uint32_t j = 0; j < t->width; j++) {
        double want = 0;
        float got;
        nz = 0;
        for (uint32_t i = 0; i < f->lengths[s]; i++) {
          if (f->ids[at + i] == 0)
            continue;
          nz++;
          want += (double)value_at(rows, t->dtype, (at + i) * t->width + j) *
                  (f->weights ? f->weights[at + i] : 1.0);
        }
        if (f->pooling == EMBPS_POOLING_MEAN && nz)
          want /= (double)nz;
        memcpy(&got, (const uint8_t *)f->out + 4 * (s * t->width + j), 4);
        if (fabs((double)got - want) > 1e-5 * fabs(want) + 1e-6)
          fail_msg("feature %s sample %zu column %u: %.9g, the reference says %.9g", f->name, s, j,
                   (double)got, want);
        if (nz == 0 && got != 0.0f)
          fail_msg("feature %s sample %zu: a bag without ids pools to %g, not 0", f->name, s,
                   (double)got);
      }
      at += f->lengths[s];
    }
  }
}

static void test_lookup_against_reference_and_group_sizes(void **state) {
  static batch_t one, other;
  (void)state;
  make_batch(&one, MAXB, 3, "");
  lookup_features_ok(g_clients[0], &one);
  check_reference(g_clients[0], &one);
  for (int g = 1; g < NGROUPS; g++) {
    make_batch(&other, MAXB, 3, "");
    lookup_features_ok(g_clients[g], &other);
    for (int k = 0; k < NF; k++)
      if (memcmp(one.out[k], other.out[k], one.f[k].out_bytes) != 0)
        fail_msg("feature %s: %d ranks answer other bytes than 1 rank", one.f[k].name, g_sizes[g]);
  }
}

static uint64_t requests_of(embps_client_t *c, int rank) {
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  uint64_t v;
  assert_int_equal(embps_stats(c, &s, &n), EMBPS_OK);
  v = s[rank].requests;
  embps_stats_free(s, n);
  return v;
}

static void test_padding(void **state) {
  static batch_t one, padded;
  (void)state;
  make_batch(&one, 7, 5, "");
  lookup_features_ok(g_clients[0], &one);
  for (int g = 1; g < NGROUPS; g++) {
    embps_client_t *c = g_clients[g];
    char want[128];
    uint64_t r0 = requests_of(c, 0), r1 = requests_of(c, 0);
    make_batch(&padded, 7, 5, "");
    embps_status_t st = embps_lookup_features(c, padded.f, NF, 7);
    snprintf(want, sizeof(want),
             "batch_size=7 does not shard evenly over the %d-rank communicator: pad the batch "
             "to 8 samples",
             g_sizes[g]);
    if (st != EMBPS_INVALID_ARGUMENT || !strstr(embps_client_last_error(c), want))
      fail_msg("7 samples on %d ranks: %s: %s", g_sizes[g], embps_status_string(st),
               embps_client_last_error(c));
    assert_true(requests_of(c, 0) - r1 == r1 - r0); /* only the stats calls reached rank 0 */
    for (int k = 0; k < NF; k++)
      memset(padded.out[k], 0xA5, sizeof(padded.out[k]));
    embps_client_set_padding(c, 1);
    lookup_features_ok(c, &padded);
    embps_client_set_padding(c, 0);
    for (int k = 0; k < NF; k++) {
      assert_memory_equal(padded.out[k], one.out[k], one.f[k].out_bytes);
      assert_int_equal(padded.out[k][one.f[k].out_bytes], 0xA5); /* past the caller's rows */
    }
  }
}

/* Empties b's last sample (the padded batch's equivalent: an empty bag), and with shrink gives b
 * the sizes of a batch without it (B - 1 samples). */
static void empty_last_sample(batch_t *b, int shrink) {
  for (int k = 0; k < NF; k++) {
    embps_feature_t *f = &b->f[k];
    const size_t w = TABLES[FEATS[k].table].width, es = elem(FEATS[k].table);
    f->num_ids -= b->lengths[k][b->B - 1];
    b->lengths[k][b->B - 1] = 0;
    f->out_bytes =
        f->pooling == EMBPS_POOLING_NONE ? f->num_ids * w * es : (b->B - (size_t)shrink) * w * 4;
    f->grad_bytes = f->out_bytes;
  }
  b->B -= (size_t)shrink;
}

/* A padded push (7 samples on 2 and 4 ranks) equals the push of the batch with an 8th, empty bag:
 * the padded samples' gradients are zeros and expand to no ids. */
static void test_padded_push(void **state) {
  static batch_t b7, b8;
  (void)state;
  for (int g = 1; g < NGROUPS; g++) {
    embps_client_t *c = g_clients[g];
    embps_feature_step_t s7[NF], s8[NF];
    make_batch(&b7, 8, 21, "a_");
    empty_last_sample(&b7, 1);
    make_batch(&b8, 8, 21, "b_");
    empty_last_sample(&b8, 0);
    assert_int_equal(b7.B, 7);
    embps_client_set_padding(c, 1);
    embps_status_t st = embps_push_features(c, b7.f, NF, 7, EMBPS_PUSH_SYNC, s7, NULL);
    if (st != EMBPS_OK)
      fail_msg("padded push on %d ranks: %s: %s", g_sizes[g], embps_status_string(st),
               embps_client_last_error(c));
    embps_client_set_padding(c, 0);
    assert_int_equal(embps_push_features(c, b8.f, NF, 8, EMBPS_PUSH_SYNC, s8, NULL), EMBPS_OK);
    for (int t = 0; t < NT; t++) {
      assert_memory_equal(&s7[t].result.grad_norm, &s8[t].result.grad_norm, sizeof(double));
      assert_true(s7[t].result.num_unique == s8[t].result.num_unique);
      assert_twins_equal(c, t, "after a padded push");
    }
  }
}

static void test_pipelined_lookups(void **state) {
  static batch_t b[4], ref;
  embps_call_t *calls[4];
  embps_client_t *c = g_clients[1];
  (void)state;
  for (int i = 0; i < 4; i++) {
    make_batch(&b[i], MAXB, 100 + (uint64_t)i, "");
    assert_int_equal(embps_lookup_features_start(c, b[i].f, NF, MAXB, &calls[i]), EMBPS_OK);
  }
  for (int i = 3; i >= 0; i--) /* waited for out of order */
    assert_int_equal(embps_call_wait(calls[i]), EMBPS_OK);
  for (int i = 0; i < 4; i++) {
    make_batch(&ref, MAXB, 100 + (uint64_t)i, "");
    lookup_features_ok(c, &ref);
    for (int k = 0; k < NF; k++)
      assert_memory_equal(b[i].out[k], ref.out[k], ref.f[k].out_bytes);
  }
}

/* ---- pushes ------------------------------------------------------------------------------ */

/* The expanded push of table t (an index into TABLES) that b's push on it equals: shard r holds,
 * feature after feature, shard r's ids and their gradients expanded here, padded with id 0 to
 * the longest shard. Pushes it to prefix + the table's name on c; *res its reply. */
static void push_expanded(embps_client_t *c, int N, const batch_t *b, int t, const char *prefix,
                          embps_push_result_t *res) {
  static int64_t tok[8][MAXIDS * NF];
  static uint8_t gr[8][MAXIDS * NF * MAXW * 4];
  static int64_t all_tok[8 * MAXIDS * NF];
  static uint8_t all_gr[8 * MAXIDS * NF * MAXW * 4];
  const tab_t *tb = &TABLES[t];
  const size_t es = elem(t), rb = tb->width * es, S = b->B / (size_t)N;
  size_t len[8] = {0}, L = 0;
  char name[32];
  for (int k = 0; k < NF; k++) {
    const embps_feature_t *f = &b->f[k];
    size_t at = 0;
    if (FEATS[k].table != t)
      continue;
    for (size_t s = 0; s < b->B; s++) {
      int r = (int)(s / S);
      uint32_t nz = 0;
      for (uint32_t i = 0; i < f->lengths[s]; i++)
        nz += f->ids[at + i] != 0;
      for (uint32_t i = 0; i < f->lengths[s]; i++) {
        size_t p = at + i, q = len[r]++;
        tok[r][q] = f->ids[p];
        if (f->pooling == EMBPS_POOLING_NONE) {
          memcpy(gr[r] + q * rb, (const uint8_t *)f->grads + p * rb, rb);
          continue;
        }
        for (uint32_t j = 0; j < tb->width; j++) {
          float g, v;
          memcpy(&g, (const uint8_t *)f->grads + 4 * (s * tb->width + j), 4);
          v = f->ids[p] == 0                             ? 0.0f
              : f->pooling == EMBPS_POOLING_WEIGHTED_SUM ? g * f->weights[p]
              : f->pooling == EMBPS_POOLING_MEAN         ? g / (float)nz
                                                         : g;
          if (tb->dtype == EMBPS_DTYPE_BF16) {
            uint16_t h = embps_f32_to_bf16(v);
            memcpy(gr[r] + q * rb + 2 * j, &h, 2);
          } else {
            memcpy(gr[r] + q * rb + 4 * j, &v, 4);
          }
        }
      }
      at += f->lengths[s];
    }
  }
  for (int r = 0; r < N; r++)
    L = len[r] > L ? len[r] : L;
  memset(all_tok, 0, sizeof(all_tok));
  memset(all_gr, 0, sizeof(all_gr));
  for (int r = 0; r < N; r++) {
    memcpy(all_tok + r * L, tok[r], len[r] * sizeof(int64_t));
    memcpy(all_gr + r * L * rb, gr[r], len[r] * rb);
  }
  snprintf(name, sizeof(name), "%s%s", prefix, tb->name);
  embps_status_t st =
      embps_push(c, name, all_tok, N * L, all_gr, N * L * rb, tb->dtype, EMBPS_PUSH_SYNC, res);
  if (st != EMBPS_OK)
    fail_msg("expanded push to %s: %s: %s", name, embps_status_string(st),
             embps_client_last_error(c));
}

/* Every row of table t under prefixes a_ and b_ are bitwise equal (a dense table's rows 0..rows-1,
 * a hash-keyed table's keys of make_batch and a few others). */
static void assert_twins_equal(embps_client_t *c, int t, const char *what) {
  static int64_t ids[400];
  static uint8_t ra[400 * MAXW * 4], rb[400 * MAXW * 4];
  const tab_t *tb = &TABLES[t];
  const size_t n = tb->capacity ? 12 : tb->rows, row = tb->width * elem(t);
  char a[32], b[32];
  for (size_t i = 0; i < n; i++)
    ids[i] = tb->capacity ? (int64_t)(i < 8 ? 0 : i) : (int64_t)i;
  if (tb->capacity) {
    static const int64_t keys[8] = {(int64_t)0x9e3779b97f4a7c15ull, 77, -5, 1ll << 40, 123456789,
                                    (int64_t)0xdeadbeefcafef00dull, 3,  -1};
    memcpy(ids, keys, sizeof(keys));
  }
  snprintf(a, sizeof(a), "a_%s", tb->name);
  snprintf(b, sizeof(b), "b_%s", tb->name);
  lookup_rows(c, a, ids, n, row, ra);
  lookup_rows(c, b, ids, n, row, rb);
  if (memcmp(ra, rb, n * row) != 0)
    fail_msg("%s: tables %s and %s differ", what, a, b);
}

static void test_push_equals_expanded_push(void **state) {
  static batch_t b;
  (void)state;
  for (int g = 0; g < NGROUPS; g++) {
    embps_client_t *c = g_clients[g];
    for (int step = 0; step < 2; step++) {
      embps_feature_step_t steps[NF];
      size_t nsteps = 99;
      make_batch(&b, MAXB, 40 + (uint64_t)step, "a_");
      memset(steps, 0xff, sizeof(steps));
      embps_status_t st = embps_push_features(c, b.f, NF, MAXB, EMBPS_PUSH_SYNC, steps, &nsteps);
      if (st != EMBPS_OK)
        fail_msg("push_features on %d ranks: %s: %s", g_sizes[g], embps_status_string(st),
                 embps_client_last_error(c));
      assert_int_equal(nsteps, NT); /* dense (clicks), half (cats), keys (users) */
      for (int t = 0; t < NT; t++) {
        embps_push_result_t want;
        push_expanded(c, g_sizes[g], &b, t, "b_", &want);
        assert_string_equal(steps[t].table + 2, TABLES[t].name);
        assert_int_equal(steps[t].result.applied, 1);
        assert_int_equal(steps[t].result.skipped, 0);
        assert_int_equal(steps[t].result.replayed, 0);
        assert_true(steps[t].result.num_unique == want.num_unique);
        assert_true(steps[t].result.num_unique > 0);
        assert_memory_equal(&steps[t].result.grad_norm, &want.grad_norm, sizeof(double));
        assert_twins_equal(c, t, "after a sync push");
      }
    }
    { /* async: ordered, then visible to the next lookup, and the same as a sync step */
      embps_feature_step_t steps[NF];
      size_t nsteps = 0;
      make_batch(&b, MAXB, 77, "a_");
      assert_int_equal(embps_push_features(c, b.f, NF, MAXB, EMBPS_PUSH_ASYNC, steps, &nsteps),
                       EMBPS_OK);
      assert_int_equal(nsteps, NT);
      for (int t = 0; t < NT; t++) {
        embps_push_result_t want;
        assert_int_equal(steps[t].result.ordered, 1);
        assert_int_equal(steps[t].result.applied, 0);
        push_expanded(c, g_sizes[g], &b, t, "b_", &want);
        assert_twins_equal(c, t, "after an async push");
      }
    }
  }
}

/* ---- bad input --------------------------------------------------------------------------- */

static void expect(embps_client_t *c, embps_status_t got, embps_status_t want, const char *needle,
                   const char *what) {
  if (got != want || !strstr(embps_client_last_error(c), needle))
    fail_msg("%s: expected %s with \"%s\", got %s: \"%s\"", what, embps_status_string(want), needle,
             embps_status_string(got), embps_client_last_error(c));
}

static void test_bad_input(void **state) {
  static batch_t b;
  embps_client_t *c = g_clients[1];
  embps_feature_step_t steps[NF];
  embps_status_t st;
  uint64_t r0, r1;
  (void)state;

  /* refused by the library, before anything is sent */
  r0 = requests_of(c, 1);
  r1 = requests_of(c, 1);
  make_batch(&b, MAXB, 9, "a_");
  b.lengths[1][0]++;
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'views': its 12 lengths add up to", "lengths");
  make_batch(&b, MAXB, 9, "a_");
  b.f[0].weights = b.weights[0];
  st = embps_push_features(c, b.f, NF, MAXB, EMBPS_PUSH_SYNC, steps, NULL);
  expect(c, st, EMBPS_INVALID_ARGUMENT,
         "feature 'clicks': weights are taken with pooling "
         "weighted_sum only",
         "weights with sum");
  make_batch(&b, MAXB, 9, "a_");
  b.f[2].weights = NULL;
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'cats': pooling weighted_sum needs weights",
         "no weights");
  make_batch(&b, MAXB, 9, "a_");
  b.f[4].name = "clicks";
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'clicks': its name is used by two features",
         "a name twice");
  make_batch(&b, MAXB, 9, "a_");
  b.f[0].out_bytes -= 4;
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'clicks': out_bytes=", "out_bytes");
  make_batch(&b, MAXB, 9, "a_");
  b.f[3].pooling = (embps_pooling_t)7;
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'raw': pooling 7", "pooling 7");
  st = embps_lookup_features(c, b.f, 0, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "the batch has no features", "no features");
  assert_true(requests_of(c, 1) - r1 == r1 - r0);

  /* refused by the servers; the push changes no table */
  make_batch(&b, MAXB, 9, "a_");
  snprintf(b.tname[4], sizeof(b.tname[4]), "ghost");
  st = embps_push_features(c, b.f, NF, MAXB, EMBPS_PUSH_SYNC, steps, NULL);
  expect(c, st, EMBPS_NOT_FOUND, "feature 'users'", "unknown table");
  make_batch(&b, MAXB, 9, "a_");
  b.ids[0][1] = 400;
  st = embps_push_features(c, b.f, NF, MAXB, EMBPS_PUSH_SYNC, steps, NULL);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "feature 'clicks': id 400", "id out of range");
  for (int t = 0; t < NT; t++)
    assert_twins_equal(c, t, "after refused pushes");
  make_batch(&b, MAXB, 9, "a_");
  b.f[0].out_bytes = MAXB * 8 * 4; /* rows of 8 columns; the table has 16 */
  st = embps_lookup_features(c, b.f, NF, MAXB);
  expect(c, st, EMBPS_INVALID_ARGUMENT, "size out as batch_size x emb_width x 4", "width");
}

/* A weighted-sum feature whose shard on one rank holds no ids (a valid batch) is served like any
 * other. Servers that decided from each rank's own shard whether to all-gather weights broke the
 * group on it (the rank without ids skipped a collective the others made); every rank decides by
 * the pooling mode now. */
static void test_weighted_shard_without_ids(void **state) {
  static const int64_t ids[3] = {4, 9, 4};
  static const uint32_t lengths[4] = {2, 1, 0, 0}; /* rank 1 of 2: samples 2 and 3, no ids */
  static const float weights[3] = {0.5f, 2.0f, -1.0f};
  static float out[4 * 16];
  embps_client_t *c = g_clients[1];
  embps_feature_t f;
  (void)state;
  memset(&f, 0, sizeof(f));
  f.name = "w";
  f.table = "dense";
  f.pooling = EMBPS_POOLING_WEIGHTED_SUM;
  f.ids = ids;
  f.num_ids = 3;
  f.lengths = lengths;
  f.weights = weights;
  f.out = out;
  f.out_bytes = sizeof(out);
  embps_status_t st = embps_lookup_features(c, &f, 1, 4);
  if (st != EMBPS_OK)
    fail_msg("weighted feature without ids on rank 1: %s: %s", embps_status_string(st),
             embps_client_last_error(c));
}

static void test_clean_exit(void **state) {
  (void)state;
  for (int g = 0; g < NGROUPS; g++) {
    int codes[GROUP_PROC_MAX_RANKS];
    embps_client_free(g_clients[g]);
    g_clients[g] = NULL;
    assert_int_equal(group_proc_stop(&g_groups[g], STOP_TIMEOUT_MS, codes), 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_create_tables),
      cmocka_unit_test(test_lookup_against_reference_and_group_sizes),
      cmocka_unit_test(test_padding),
      cmocka_unit_test(test_pipelined_lookups),
      cmocka_unit_test(test_push_equals_expanded_push),
      cmocka_unit_test(test_padded_push),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_weighted_shard_without_ids),
      cmocka_unit_test(test_clean_exit),
  };
  return cmocka_run_group_tests(tests, groups_setup, groups_teardown);
}
