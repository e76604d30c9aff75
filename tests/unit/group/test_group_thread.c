/* The group's thread with a group of one: calls submitted on the loop come back on the loop in
 * submission order, a create registers its table before anything queued after it runs, a
 * duplicate batch id in flight is refused, and closing answers what is left. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "server/group/group.h"

#define OPS 64
#define WIDTH 8

typedef struct {
  int order[OPS + 2];
  embps_status_t status[OPS + 2];
  int count;
  int expect;
  embps_group_t *group;
} log_t;

static void on_done(embps_group_call_t *call) {
  log_t *log = call->user;
  log->status[log->count] = call->error.status;
  log->order[log->count++] = (int)call->batch_id;
  if (log->count == log->expect)
    embps_group_close(log->group);
}

static void wait_ready(uv_loop_t *loop, embps_group_t *g) {
  for (int i = 0; i < 500 && embps_group_state(g, NULL, 0) != EMBPS_GROUP_READY; i++) {
    uv_run(loop, UV_RUN_NOWAIT);
    uv_sleep(10);
  }
  assert_int_equal(embps_group_state(g, NULL, 0), EMBPS_GROUP_READY);
}

static void test_order_and_create(void **state) {
  uv_loop_t loop;
  embps_store_t *store;
  embps_group_t *g;
  embps_group_config_t cfg;
  embps_group_call_t calls[OPS + 2];
  log_t log;
  int64_t tokens[] = {1, 2, 3};
  float out[OPS][3 * WIDTH];
  embps_error_t err;
  (void)state;

  memset(&cfg, 0, sizeof(cfg));
  cfg.rank = 0;
  cfg.size = 1;
  cfg.identity = "version=test\n";
  cfg.batch_deadline_ms = 1000;
  memset(&log, 0, sizeof(log));
  memset(calls, 0, sizeof(calls));
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(embps_store_new(&store), EMBPS_OK);
  assert_int_equal(embps_group_new(&g, &loop, &cfg, store), EMBPS_OK);
  log.group = g;
  log.expect = OPS + 1;
  wait_ready(&loop, g);
  assert_int_equal(embps_group_size(g), 1);

  /* A create, then lookups of the table it makes, all queued before any runs. */
  calls[0].op.kind = EMBPS_OP_CREATE_TABLE;
  strcpy(calls[0].op.create.name, "t");
  calls[0].op.create.rows = 10;
  calls[0].op.create.emb_width = WIDTH;
  assert_int_equal(embps_table_config_resolve(&calls[0].op.create, 1, 1 << 20, &err), EMBPS_OK);
  calls[0].done = on_done;
  calls[0].user = &log;
  embps_group_submit(g, &calls[0]);
  /* The table does not exist yet, so lookups reference it through a pointer taken after the
   * create ran: run the loop until the create answered. */
  while (log.count < 1)
    uv_run(&loop, UV_RUN_ONCE);
  assert_int_equal(log.status[0], EMBPS_OK);
  assert_non_null(calls[0].op.created);
  assert_ptr_equal(embps_store_find(store, "t"), calls[0].op.created);
  for (int i = 1; i <= OPS; i++) {
    calls[i].op.kind = EMBPS_OP_LOOKUP;
    calls[i].batch_id = (uint64_t)i;
    calls[i].op.table = calls[0].op.created;
    calls[i].op.tokens = tokens;
    calls[i].op.num_tokens = 3;
    calls[i].tokens_per_batch = 3;
    calls[i].op.rows_out = out[i - 1];
    calls[i].done = on_done;
    calls[i].user = &log;
    embps_group_submit(g, &calls[i]);
  }
  assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
  assert_int_equal(log.count, OPS + 1);
  for (int i = 1; i <= OPS; i++) {
    assert_int_equal(log.order[i], i);
    assert_int_equal(log.status[i], EMBPS_OK);
  }
  assert_memory_equal(out[0], out[OPS - 1], sizeof(out[0]));
  assert_true(out[0][0] != 0.0f);
  embps_group_free(g);
  embps_store_free(store);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_order_and_create),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
