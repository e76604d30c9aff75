/* The engine: batches run against real tables through a real communicator. A group of one
 * checks the arithmetic (lookup, duplicates summed, padding, the non-finite gate); groups of
 * 2, 3 and 4 ranks, one thread each over loopback sockets, check that a table fed the same
 * lookups and pushes holds the same values whatever the group's size. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "server/engine/engine.h"

#define WIDTH 12
#define ROWS 40

static embps_table_config_t table_config(embps_optimizer_t opt) {
  embps_table_config_t c;
  embps_error_t err;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "t");
  c.rows = ROWS;
  c.emb_width = WIDTH;
  c.optimizer = opt;
  c.lr = 0.5f;
  c.seed = 3;
  c.half_life = 7.0f;
  c.weight_decay = 0.01f;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  return c;
}

typedef struct rank_ctx {
  embps_comm_t *comm;
  embps_store_t *store;
  embps_engine_t *engine;
} rank_ctx_t;

static void rank_init(rank_ctx_t *r, uint32_t rank, uint32_t size, const int *fds) {
  assert_int_equal(embps_comm_tcp_new(&r->comm, rank, size, fds, 10000), EMBPS_OK);
  assert_int_equal(embps_store_new(&r->store, rank, size, 4), EMBPS_OK);
  assert_int_equal(embps_engine_new(&r->engine, r->comm, r->store, EMBPS_BACKEND_CPU, NULL),
                   EMBPS_OK);
}

static void rank_fini(rank_ctx_t *r) {
  embps_engine_free(r->engine);
  embps_store_free(r->store);
  embps_comm_free(r->comm);
}

static void create(rank_ctx_t *r, const embps_table_config_t *c) {
  embps_op_t op;
  embps_error_t err;
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = *c;
  assert_int_equal(embps_engine_run(r->engine, &op, &err), EMBPS_OK);
  assert_int_equal(op.error.status, EMBPS_OK);
  assert_non_null(op.created);
}

static embps_op_t batch_op(embps_op_kind_t kind, embps_table_t *t, const int64_t *tokens, size_t n,
                           uint32_t size) {
  embps_op_t op;
  memset(&op, 0, sizeof(op));
  op.kind = kind;
  op.table = t;
  op.tokens = tokens;
  op.num_tokens = n;
  op.tokens_per_batch = (uint32_t)(n * size);
  return op;
}

/* ---- a group of one ------------------------------------------------------------------------ */

static void test_single_rank(void **state) {
  rank_ctx_t r;
  int fds[1] = {-1};
  embps_table_config_t c = table_config(EMBPS_OPTIMIZER_SGD);
  embps_table_t *t;
  int64_t tokens[] = {5, 0, 7, 5};
  float g[4 * WIDTH], before[ROWS * WIDTH], out[4 * WIDTH];
  double norm2 = 0.0;
  embps_op_t op;
  embps_error_t err;
  (void)state;
  c.weight_decay = 0.0f;
  rank_init(&r, 0, 1, fds);
  create(&r, &c);
  t = embps_store_find(r.store, "t");
  memcpy(before, t->data, sizeof(before));

  op = batch_op(EMBPS_OP_LOOKUP, t, tokens, 4, 1);
  op.rows_out = out;
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  for (int i = 0; i < 4; i++)
    for (int col = 0; col < WIDTH; col++)
      assert_true(out[i * WIDTH + col] ==
                  embps_init_value(3, (uint64_t)tokens[i], (uint64_t)col, c.init_scale));

  for (int i = 0; i < 4 * WIDTH; i++)
    g[i] = (float)(i % 7) - 3.0f;
  op = batch_op(EMBPS_OP_PUSH, t, tokens, 4, 1);
  op.grads = g;
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  assert_true(op.applied);
  assert_int_equal(op.num_unique, 2);
  for (int col = 0; col < WIDTH; col++) {
    float g5 = g[col] + g[3 * WIDTH + col], g7 = g[2 * WIDTH + col];
    const float *w = t->data;
    norm2 += (double)g5 * g5 + (double)g7 * g7;
    assert_true(fabsf(w[5 * WIDTH + col] - (before[5 * WIDTH + col] - 0.5f * g5)) < 1e-6f);
    assert_true(fabsf(w[7 * WIDTH + col] - (before[7 * WIDTH + col] - 0.5f * g7)) < 1e-6f);
    assert_true(w[col] == 0.0f);
  }
  assert_true(fabs(op.grad_norm - sqrt(norm2)) < 1e-5);
  assert_memory_equal((float *)t->data + 8 * WIDTH, before + 8 * WIDTH, 32 * WIDTH * 4);

  /* The gate: one infinite gradient and nothing changes. */
  memcpy(before, t->data, sizeof(before));
  g[WIDTH + 3] = INFINITY;
  op = batch_op(EMBPS_OP_PUSH, t, tokens, 4, 1);
  op.grads = g;
  tokens[1] = 9; /* not padding any more, so its gradient counts */
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  assert_false(op.applied);
  assert_true(op.skipped);
  assert_memory_equal(t->data, before, sizeof(before));
  assert_int_equal(t->counters.steps_skipped, 1);
  rank_fini(&r);
}

/* ---- groups of N: results do not depend on N --------------------------------------------- */

#define STEPS 12
#define BATCH 24 /* divisible by 1, 2, 3 and 4 */

typedef struct run_args {
  uint32_t rank, size;
  int fds[4];
  embps_optimizer_t opt;
  float *final; /* ROWS x WIDTH, filled by every rank's lookup of all rows */
  double norms[STEPS];
  int status;
} run_args_t;

/* The same deterministic workload for every N: STEPS pushes of BATCH tokens (duplicates and
 * padding included), then a lookup of every row. Rank r takes positions [r*n, (r+1)*n). */
static void workload(int step, int64_t *tokens, float *grads) {
  uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(step + 1);
  for (int i = 0; i < BATCH; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tokens[i] = (int64_t)(x % 16); /* heavy duplication, token 0 is padding */
    for (int col = 0; col < WIDTH; col++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      grads[i * WIDTH + col] = (float)((double)(x % 2001) / 1000.0 - 1.0);
    }
  }
}

static void *run_rank(void *p) {
  run_args_t *a = p;
  rank_ctx_t r;
  embps_table_config_t c = table_config(a->opt);
  embps_table_t *t;
  size_t n = BATCH / a->size;
  int64_t tokens[BATCH], all[ROWS];
  float grads[BATCH * WIDTH];
  embps_error_t err;

  rank_init(&r, a->rank, a->size, a->fds);
  create(&r, &c);
  t = embps_store_find(r.store, "t");
  for (int step = 0; step < STEPS; step++) {
    embps_op_t op;
    workload(step, tokens, grads);
    op = batch_op(EMBPS_OP_PUSH, t, tokens + a->rank * n, n, a->size);
    op.grads = grads + a->rank * n * WIDTH;
    if (embps_engine_run(r.engine, &op, &err) != EMBPS_OK || !op.applied)
      a->status = 1;
    a->norms[step] = op.grad_norm;
  }
  for (int i = 0; i < ROWS; i++)
    all[i] = i;
  {
    /* ROWS must split over the group: 40 over 1, 2, 4; for 3 ranks, look up 39 rows. */
    size_t rows = ROWS - ROWS % a->size, per = rows / a->size;
    float *out = calloc(per * WIDTH, sizeof(float));
    embps_op_t op = batch_op(EMBPS_OP_LOOKUP, t, all + a->rank * per, per, a->size);
    op.rows_out = out;
    if (embps_engine_run(r.engine, &op, &err) != EMBPS_OK)
      a->status = 1;
    memcpy(a->final + a->rank * per * WIDTH, out, per * WIDTH * sizeof(float));
    free(out);
  }
  rank_fini(&r);
  return NULL;
}

/* Connected sockets for a full mesh of n ranks: fds[i][j] talks to rank j. */
static void mesh_sockets(uint32_t n, int fds[4][4]) {
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < n; j++)
      fds[i][j] = -1;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i + 1; j < n; j++) {
      int sv[2];
      assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
      fds[i][j] = sv[0];
      fds[j][i] = sv[1];
    }
}

static void run_group(uint32_t size, embps_optimizer_t opt, float *final, double *norms) {
  run_args_t args[4];
  pthread_t threads[4];
  int fds[4][4];
  mesh_sockets(size, fds);
  for (uint32_t r = 0; r < size; r++) {
    memset(&args[r], 0, sizeof(args[r]));
    args[r].rank = r;
    args[r].size = size;
    memcpy(args[r].fds, fds[r], sizeof(args[r].fds));
    args[r].opt = opt;
    args[r].final = final;
    assert_int_equal(pthread_create(&threads[r], NULL, run_rank, &args[r]), 0);
  }
  for (uint32_t r = 0; r < size; r++) {
    pthread_join(threads[r], NULL);
    assert_int_equal(args[r].status, 0);
    for (int s = 0; s < STEPS; s++)
      assert_true(args[r].norms[s] == args[0].norms[s]); /* every rank agrees bitwise */
  }
  memcpy(norms, args[0].norms, sizeof(args[0].norms));
}

static void test_results_do_not_depend_on_n(void **state) {
  embps_optimizer_t opts[] = {EMBPS_OPTIMIZER_SGD, EMBPS_OPTIMIZER_ADAGRAD,
                              EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_OPTIMIZER_ADAM};
  (void)state;
  for (size_t o = 0; o < 4; o++) {
    float ref[ROWS * WIDTH], got[ROWS * WIDTH], initial;
    double ref_norms[STEPS], norms[STEPS];
    int moved = 0;
    run_group(1, opts[o], ref, ref_norms);
    for (uint32_t n = 2; n <= 4; n++) {
      size_t rows = ROWS - ROWS % n;
      memset(got, 0, sizeof(got));
      run_group(n, opts[o], got, norms);
      for (int s = 0; s < STEPS; s++)
        assert_true(fabs(norms[s] - ref_norms[s]) <= 1e-9 * fabs(ref_norms[s]));
      for (size_t i = 0; i < rows * WIDTH; i++) {
        float tol = 1e-6f * fabsf(ref[i]) + 1e-7f;
        if (fabsf(got[i] - ref[i]) > tol)
          fail_msg("optimizer %zu, %u ranks: element %zu is %.9g, 1 rank says %.9g", o, n, i,
                   (double)got[i], (double)ref[i]);
      }
    }
    /* The workload did move the pushed rows (so the comparison means something). */
    initial = embps_init_value(3, 1, 0, 1.0f / sqrtf((float)WIDTH));
    moved = ref[1 * WIDTH] != initial;
    assert_true(moved);
    for (int col = 0; col < WIDTH; col++)
      assert_true(ref[col] == 0.0f);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_rank),
      cmocka_unit_test(test_results_do_not_depend_on_n),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
