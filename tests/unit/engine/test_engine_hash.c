/* The engine on a hash-keyed table (a group of one, the cpu backend), against a reference model
 * written here: a table of CAP keys with LRU eviction (the least (last push step, key) not in the
 * step), new keys read as their initial rows, SGD on the stored keys, the non-finite gate before
 * any index step. With 1, 2 and 3 engine threads (2 and 3 share the sum and the update), and a
 * skipped push (NaN gradients, every ninth step) checked to leave the index's bytes as they
 * were. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/embps_kernels.h"
#include "server/engine/engine.h"
#include "server/store/hindex.h"

#define WIDTH 8
#define CAP 4
#define NKEYS 10
#define BATCH 6
#define STEPS 60
#define LR 0.5f
#define SEED 11u

/* The reference: CAP entries of (key, last push step, row). */
typedef struct ref {
  uint64_t key[CAP], last[CAP];
  float row[CAP][WIDTH];
  int used[CAP];
  uint64_t clock, evicted, admitted;
} ref_t;

static float scale(void) { return 1.0f / sqrtf((float)WIDTH); }

static int ref_find(const ref_t *r, uint64_t key) {
  for (int i = 0; i < CAP; i++)
    if (r->used[i] && r->key[i] == key)
      return i;
  return -1;
}

static void ref_row(const ref_t *r, uint64_t key, float *out) {
  int i = ref_find(r, key);
  for (int c = 0; c < WIDTH; c++)
    out[c] = i >= 0 ? r->row[i][c] : embps_init_value(SEED, key, (uint64_t)c, scale());
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* One push (the gate passed): the index step, then SGD on the stored keys. */
static void ref_push(ref_t *r, const uint64_t *tokens, const float *g, size_t n) {
  uint64_t keys[BATCH];
  size_t m = 0;
  r->clock++;
  for (size_t i = 0; i < n; i++)
    if (tokens[i])
      keys[m++] = tokens[i];
  qsort(keys, m, sizeof(keys[0]), cmp_u64);
  {
    size_t u = 0;
    for (size_t i = 0; i < m; i++)
      if (u == 0 || keys[u - 1] != keys[i])
        keys[u++] = keys[i];
    m = u;
  }
  for (size_t i = 0; i < m; i++) { /* touch the stored keys */
    int s = ref_find(r, keys[i]);
    if (s >= 0)
      r->last[s] = r->clock;
  }
  for (size_t i = 0; i < m; i++) { /* the absent ones, in key order */
    int s = ref_find(r, keys[i]), victim = -1;
    if (s >= 0)
      continue;
    for (int j = 0; j < CAP && victim < 0; j++)
      if (!r->used[j])
        victim = j;
    if (victim < 0) {
      for (int j = 0; j < CAP; j++) {
        if (r->last[j] == r->clock)
          continue; /* a key of this step */
        if (victim < 0 || r->last[j] < r->last[victim] ||
            (r->last[j] == r->last[victim] && r->key[j] < r->key[victim]))
          victim = j;
      }
      if (victim < 0)
        continue; /* refused */
      r->evicted++;
    }
    r->used[victim] = 1;
    r->key[victim] = keys[i];
    r->last[victim] = r->clock;
    r->admitted++;
    for (int c = 0; c < WIDTH; c++)
      r->row[victim][c] = embps_init_value(SEED, keys[i], (uint64_t)c, scale());
  }
  for (size_t i = 0; i < m; i++) {
    int s = ref_find(r, keys[i]);
    float sum[WIDTH] = {0};
    if (s < 0)
      continue;
    for (size_t p = 0; p < n; p++)
      if (tokens[p] == keys[i])
        for (int c = 0; c < WIDTH; c++)
          sum[c] += g[p * WIDTH + c];
    for (int c = 0; c < WIDTH; c++)
      r->row[s][c] -= LR * sum[c];
  }
}

static uint64_t rng_next(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static uint8_t *index_bytes(embps_table_t *t, size_t *len) {
  const embps_hindex_t *ix = embps_table_hindex(t);
  uint8_t *p;
  *len = embps_hindex_encoded_bytes(ix);
  assert_non_null(p = malloc(*len));
  embps_hindex_encode(ix, p);
  return p;
}

static void run_against_the_reference(unsigned threads) {
  embps_comm_t *comm;
  embps_store_t *store;
  embps_engine_t *engine;
  embps_table_config_t c;
  embps_table_t *t;
  embps_error_t err;
  embps_op_t op;
  embps_hindex_stats_t st;
  ref_t ref;
  int fds[1] = {-1};
  uint64_t keys[NKEYS], seed = 42, skipped = 0;

  for (int i = 0; i < NKEYS; i++) /* large ids, half of them negative as int64 */
    keys[i] = (rng_next(&seed) << 33) ^ (rng_next(&seed) << 2) ^ (uint64_t)(i + 1) ^
              (i % 2 ? UINT64_C(1) << 63 : 0);
  memset(&ref, 0, sizeof(ref));
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "h");
  c.capacity = CAP;
  c.emb_width = WIDTH;
  c.optimizer = EMBPS_OPTIMIZER_SGD;
  c.lr = LR;
  c.seed = SEED;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(embps_comm_tcp_new(&comm, 0, 1, fds, 10000), EMBPS_OK);
  assert_int_equal(embps_store_new(&store), EMBPS_OK);
  assert_int_equal(embps_engine_new(&engine, comm, store, EMBPS_BACKEND_CPU, NULL), EMBPS_OK);
  if (threads > 1)
    assert_int_equal(embps_engine_set_threads(engine, threads), threads);
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = c;
  assert_int_equal(embps_engine_run(engine, &op, &err), EMBPS_OK);
  assert_int_equal(op.error.status, EMBPS_OK);
  t = op.created;
  assert_non_null(embps_table_hindex(t));

  for (int step = 0; step < STEPS; step++) {
    int64_t tokens[BATCH];
    float g[BATCH * WIDTH], out[BATCH * WIDTH], want[WIDTH];
    const int nan_step = step == 7 || step % 9 == 5;
    uint8_t *before = NULL, *after;
    size_t lb = 0, la;
    for (int i = 0; i < BATCH; i++)
      tokens[i] = (int64_t)(i == step % BATCH ? 0 : keys[rng_next(&seed) % NKEYS]);
    for (int i = 0; i < BATCH * WIDTH; i++)
      g[i] = (float)((int)(rng_next(&seed) % 17) - 8) / 8.0f;
    if (nan_step)
      g[((step + 1) % BATCH) * WIDTH + 2] = NAN; /* never the padding's position */
    if (step == 8)
      g[(step % BATCH) * WIDTH] = NAN; /* on the padding: ignored as a dense table does */

    memset(&op, 0, sizeof(op));
    op.kind = EMBPS_OP_LOOKUP;
    op.table = t;
    op.tokens = tokens;
    op.num_tokens = BATCH;
    op.rows_out = out;
    assert_int_equal(embps_engine_run(engine, &op, &err), EMBPS_OK);
    for (int i = 0; i < BATCH; i++) {
      ref_row(&ref, (uint64_t)tokens[i], want);
      for (int col = 0; col < WIDTH; col++)
        assert_true(fabsf(out[i * WIDTH + col] - want[col]) <= 1e-5f);
    }

    if (nan_step)
      before = index_bytes(t, &lb);
    memset(&op, 0, sizeof(op));
    op.kind = EMBPS_OP_PUSH;
    op.table = t;
    op.tokens = tokens;
    op.num_tokens = BATCH;
    op.grads = g;
    assert_int_equal(embps_engine_run(engine, &op, &err), EMBPS_OK);
    assert_int_equal(op.error.status, EMBPS_OK);
    if (nan_step) {
      assert_true(op.skipped);
      skipped++;
      after = index_bytes(t, &la); /* nothing changed: no index step either */
      assert_int_equal(la, lb);
      assert_memory_equal(after, before, la);
      free(before);
      free(after);
      continue;
    }
    assert_true(op.applied);
    ref_push(&ref, (const uint64_t *)tokens, g, BATCH);
    embps_table_hindex_stats(t, &st);
    assert_int_equal(st.clock, ref.clock);
    assert_int_equal(st.evicted, ref.evicted);
    assert_int_equal(st.admitted, ref.admitted);
  }
  embps_table_hindex_stats(t, &st);
  assert_int_equal(st.size, CAP);
  assert_true(ref.evicted > 10);
  assert_int_equal(embps_table_counters(t)->steps_skipped, skipped);
  embps_engine_free(engine);
  embps_store_free(store);
  embps_comm_free(comm);
}

static void test_lookup_and_push_match_the_reference(void **state) {
  (void)state;
  run_against_the_reference(1);
  run_against_the_reference(2);
  run_against_the_reference(3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lookup_and_push_match_the_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
