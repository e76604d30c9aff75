/* The engine: ops run against a real table (lookup, push with duplicates and padding, the
 * non-finite gate), and the thread delivers completions on the loop in submission order. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "common/alloc.h"
#include "server/engine/engine.h"

#define WIDTH 8
#define ROWS 20

static embps_table_t *make_table(embps_store_t **store, embps_optimizer_t opt) {
  embps_table_config_t c;
  embps_table_t *t;
  embps_error_t err;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "t");
  c.rows = ROWS;
  c.emb_width = WIDTH;
  c.optimizer = opt;
  c.lr = 0.5f;
  c.seed = 3;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(embps_store_new(store, 0, 1, 4), EMBPS_OK);
  assert_int_equal(embps_store_add(*store, &c, &t, &err), EMBPS_OK);
  return t;
}

static void run_create(embps_engine_scratch_t *s, embps_table_t *t) {
  embps_op_t op;
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.table = t;
  embps_engine_run_op(s, &op);
  assert_int_equal(op.error.status, EMBPS_OK);
}

static void test_lookup_reads_initial_rows(void **state) {
  embps_store_t *store;
  embps_table_t *t = make_table(&store, EMBPS_OPT_SGD);
  embps_engine_scratch_t *s;
  int64_t tokens[] = {0, 4, 19, 4};
  float out[4 * WIDTH];
  embps_op_t op;
  (void)state;
  assert_int_equal(embps_engine_scratch_new(&s), EMBPS_OK);
  run_create(s, t);
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_LOOKUP;
  op.table = t;
  op.tokens = tokens;
  op.num_tokens = 4;
  op.rows_out = out;
  embps_engine_run_op(s, &op);
  assert_int_equal(op.error.status, EMBPS_OK);
  for (int i = 0; i < 4; i++)
    for (int c = 0; c < WIDTH; c++)
      assert_true(out[i * WIDTH + c] ==
                  embps_init_value(3, (uint64_t)tokens[i], (uint64_t)c, t->config.init_scale));
  for (int c = 0; c < WIDTH; c++)
    assert_true(out[c] == 0.0f);
  assert_int_equal(t->counters.rows_looked_up, 4);
  embps_engine_scratch_free(s);
  embps_store_free(store);
}

static void test_push_sums_duplicates_and_skips_padding(void **state) {
  embps_store_t *store;
  embps_table_t *t = make_table(&store, EMBPS_OPT_SGD);
  embps_engine_scratch_t *s;
  int64_t tokens[] = {5, 0, 7, 5};
  float g[4 * WIDTH], before[ROWS * WIDTH];
  double norm2 = 0.0;
  embps_op_t op;
  (void)state;
  assert_int_equal(embps_engine_scratch_new(&s), EMBPS_OK);
  run_create(s, t);
  memcpy(before, t->data, sizeof(before));
  for (int i = 0; i < 4 * WIDTH; i++)
    g[i] = (float)(i % 7) - 3.0f;
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_PUSH;
  op.table = t;
  op.tokens = tokens;
  op.num_tokens = 4;
  op.grads = g;
  embps_engine_run_op(s, &op);
  assert_int_equal(op.error.status, EMBPS_OK);
  assert_true(op.applied);
  assert_false(op.skipped);
  assert_int_equal(op.num_unique, 2);
  for (int c = 0; c < WIDTH; c++) {
    float g5 = g[0 * WIDTH + c] + g[3 * WIDTH + c], g7 = g[2 * WIDTH + c];
    const float *w = t->data;
    norm2 += (double)g5 * g5 + (double)g7 * g7;
    assert_true(fabsf(w[5 * WIDTH + c] - (before[5 * WIDTH + c] - 0.5f * g5)) < 1e-6f);
    assert_true(fabsf(w[7 * WIDTH + c] - (before[7 * WIDTH + c] - 0.5f * g7)) < 1e-6f);
    assert_true(w[c] == 0.0f); /* padding row untouched */
  }
  assert_true(fabs(op.grad_norm - sqrt(norm2)) < 1e-5);
  /* Rows not in the batch did not move. */
  assert_memory_equal((float *)t->data + 8 * WIDTH, before + 8 * WIDTH, 12 * WIDTH * 4);
  embps_engine_scratch_free(s);
  embps_store_free(store);
}

static void test_nonfinite_gate(void **state) {
  embps_store_t *store;
  embps_table_t *t = make_table(&store, EMBPS_OPT_ROWWISE_ADAGRAD);
  embps_engine_scratch_t *s;
  int64_t tokens[] = {1, 2};
  float g[2 * WIDTH], before[ROWS * WIDTH];
  float acc_before[ROWS];
  embps_op_t op;
  (void)state;
  assert_int_equal(embps_engine_scratch_new(&s), EMBPS_OK);
  run_create(s, t);
  memcpy(before, t->data, sizeof(before));
  memcpy(acc_before, t->state0, sizeof(acc_before));
  for (int i = 0; i < 2 * WIDTH; i++)
    g[i] = 1.0f;
  g[WIDTH + 3] = INFINITY;
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_PUSH;
  op.table = t;
  op.tokens = tokens;
  op.num_tokens = 2;
  op.grads = g;
  embps_engine_run_op(s, &op);
  assert_int_equal(op.error.status, EMBPS_OK);
  assert_false(op.applied);
  assert_true(op.skipped);
  assert_memory_equal(t->data, before, sizeof(before));
  assert_memory_equal(t->state0, acc_before, sizeof(acc_before));
  assert_int_equal(t->step, 0);
  assert_int_equal(t->counters.steps_skipped, 1);
  embps_engine_scratch_free(s);
  embps_store_free(store);
}

/* ---- the thread ------------------------------------------------------------------------------ */

typedef struct {
  int order[64];
  int count;
  embps_engine_t *engine;
} completion_log_t;

static void on_done(embps_op_t *op) {
  completion_log_t *log = op->user;
  log->order[log->count++] = (int)op->batch_tag;
  if (log->count == 64)
    embps_engine_close(log->engine);
}

static void test_thread_completes_in_order(void **state) {
  uv_loop_t loop;
  embps_store_t *store;
  embps_table_t *t = make_table(&store, EMBPS_OPT_SGD);
  embps_engine_t *e;
  embps_op_t ops[64];
  completion_log_t log;
  int64_t tokens[] = {1, 2, 3};
  float out[64][3 * WIDTH];
  (void)state;
  memset(&log, 0, sizeof(log));
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(embps_engine_new(&e, &loop), EMBPS_OK);
  log.engine = e;
  memset(ops, 0, sizeof(ops));
  ops[0].kind = EMBPS_OP_CREATE_TABLE;
  ops[0].table = t;
  for (int i = 0; i < 64; i++) {
    if (i > 0) {
      ops[i].kind = EMBPS_OP_LOOKUP;
      ops[i].table = t;
      ops[i].tokens = tokens;
      ops[i].num_tokens = 3;
      ops[i].rows_out = out[i];
    }
    ops[i].batch_tag = (uint64_t)i;
    ops[i].done = on_done;
    ops[i].user = &log;
    embps_engine_submit(e, &ops[i]);
  }
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(log.count, 64);
  for (int i = 0; i < 64; i++) {
    assert_int_equal(log.order[i], i);
    assert_int_equal(ops[i].error.status, EMBPS_OK);
  }
  assert_memory_equal(out[1], out[63], sizeof(out[1]));
  embps_engine_free(e);
  assert_int_equal(uv_loop_close(&loop), 0);
  embps_store_free(store);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lookup_reads_initial_rows),
      cmocka_unit_test(test_push_sums_duplicates_and_skips_padding),
      cmocka_unit_test(test_nonfinite_gate),
      cmocka_unit_test(test_thread_completes_in_order),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
