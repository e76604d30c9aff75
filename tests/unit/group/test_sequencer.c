/* The sequencer: rounds in completion order, disagreement, deadlines, late shards, creates. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "server/group/sequencer.h"

static embps_batch_desc_t desc(uint64_t id, embps_op_kind_t kind, uint32_t tpb, const char *table) {
  embps_batch_desc_t d;
  memset(&d, 0, sizeof(d));
  d.batch_id = id;
  d.kind = kind;
  d.tokens_per_batch = tpb;
  strcpy(d.table, table);
  return d;
}

static void test_completion_order(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(1, EMBPS_OP_LOOKUP, 8, "t"), b = desc(2, EMBPS_OP_PUSH, 8, "t");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 3, 1000), EMBPS_OK);
  /* Shards reach the ranks in different orders: batch 2 completes first. */
  embps_sequencer_arrive(s, 0, &a, 0);
  embps_sequencer_arrive(s, 1, &b, 1);
  embps_sequencer_arrive(s, 0, &b, 2);
  assert_int_equal(embps_sequencer_next_round(s, 3, e, 8), 0);
  embps_sequencer_arrive(s, 2, &b, 4);
  embps_sequencer_arrive(s, 2, &a, 5);
  embps_sequencer_arrive(s, 1, &a, 6);
  assert_int_equal(embps_sequencer_next_round(s, 7, e, 8), 2);
  assert_int_equal(e[0].batch_id, 2);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[0].kind, EMBPS_OP_PUSH);
  assert_int_equal(e[1].batch_id, 1);
  assert_int_equal(embps_sequencer_pending(s), 0);
  assert_int_equal(embps_sequencer_next_round(s, 8, e, 8), 0);
  embps_sequencer_free(s);
}

/* A batch is named by its client and its id: two clients' batches of one id are two batches
 * (each complete on its own, whatever order their shards come in), while one client's second
 * shard of an id from one rank is a duplicate, not a new batch. */
static void test_client_scope(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(5, EMBPS_OP_LOOKUP, 8, "t"), b = a, none = a;
  (void)state;
  a.client_id = 11;
  b.client_id = 22;
  none.client_id = 0;
  assert_int_equal(embps_sequencer_new(&s, 2, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 0);
  embps_sequencer_arrive(s, 0, &b, 1);
  embps_sequencer_arrive(s, 1, &none, 2);
  assert_int_equal(embps_sequencer_pending(s), 3);
  assert_int_equal(embps_sequencer_next_round(s, 3, e, 8), 0);
  embps_sequencer_arrive(s, 1, &b, 4);
  assert_int_equal(embps_sequencer_next_round(s, 5, e, 8), 1);
  assert_true(e[0].client_id == 22);
  assert_int_equal(e[0].batch_id, 5);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  embps_sequencer_arrive(s, 1, &a, 6);
  assert_int_equal(embps_sequencer_next_round(s, 7, e, 8), 1);
  assert_true(e[0].client_id == 11);
  /* A failure sticks to its own client's batch only. */
  embps_sequencer_arrive(s, 1, &none, 8); /* a duplicate report: still waiting for rank 0 */
  assert_int_equal(embps_sequencer_next_round(s, 2000, e, 8), 1);
  assert_int_equal(e[0].client_id, 0);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  embps_sequencer_arrive(s, 0, &a, 2001); /* client 11 reuses id 5 once it is done: a new batch */
  embps_sequencer_arrive(s, 1, &a, 2002);
  assert_int_equal(embps_sequencer_next_round(s, 2003, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  embps_sequencer_free(s);
}

static void test_disagreement_and_late_shard(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(7, EMBPS_OP_LOOKUP, 8, "t"), b = desc(7, EMBPS_OP_LOOKUP, 12, "t");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 2, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 0);
  embps_sequencer_arrive(s, 1, &b, 1);
  assert_int_equal(embps_sequencer_next_round(s, 2, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "shards of batch 7 disagree"));
  assert_non_null(strstr(e[0].message, "tokens_per_batch=12"));
  /* A third report of the failed batch (e.g. a retry) is failed at once. */
  embps_sequencer_arrive(s, 1, &a, 3);
  assert_int_equal(embps_sequencer_next_round(s, 4, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  embps_sequencer_free(s);
}

static void test_deadline(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(9, EMBPS_OP_PUSH, 4, "t");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 4, 100), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 1000);
  embps_sequencer_arrive(s, 2, &a, 1010);
  assert_int_equal(embps_sequencer_next_deadline(s, 1050), 50);
  assert_int_equal(embps_sequencer_next_round(s, 1099, e, 8), 0);
  assert_int_equal(embps_sequencer_next_round(s, 1100, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(e[0].message, "rank(s) 1,3 did not arrive within 100 ms"));
  assert_int_equal(embps_sequencer_pending(s), 0);
  assert_true(embps_sequencer_next_deadline(s, 1100) == UINT64_MAX);
  /* The missing shard shows up later: it is failed the same way. */
  embps_sequencer_arrive(s, 3, &a, 1200);
  assert_int_equal(embps_sequencer_next_round(s, 1200, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  embps_sequencer_free(s);
}

/* A shard's caller's deadline brings its batch's expiry forward from the batch deadline (counted
 * from that shard's arrival), and the earliest shard's wins; the failure says which deadline
 * passed. A batch whose callers' deadline has passed when its last shard arrives fails instead
 * of running, and a caller with more time than the batch deadline changes nothing. */
static void test_caller_deadline(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(1, EMBPS_OP_PUSH, 4, "t"), late = a,
                     b = desc(2, EMBPS_OP_LOOKUP, 4, "t"), c = desc(3, EMBPS_OP_LOOKUP, 4, "t"),
                     d = desc(4, EMBPS_OP_LOOKUP, 4, "t");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 2, 10000), EMBPS_OK);
  a.has_deadline = 1;
  a.deadline_left_ms = 300;
  late.batch_id = 5;
  late.has_deadline = 1;
  late.deadline_left_ms = 500;
  embps_sequencer_arrive(s, 1, &late, 1000); /* due at 1500 */
  embps_sequencer_arrive(s, 1, &a, 1000);    /* a's own batch 1: due at 1300 */
  assert_int_equal(embps_sequencer_next_deadline(s, 1000), 300);
  assert_int_equal(embps_sequencer_next_round(s, 1299, e, 8), 0);
  assert_int_equal(embps_sequencer_next_round(s, 1300, e, 8), 1);
  assert_int_equal(e[0].batch_id, 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(e[0].message, "batch 1: the deadline its caller set (grpc-timeout) passed "
                                       "before it was ordered: the shards for rank(s) 0 had not "
                                       "arrived"));
  /* The sibling arriving after the deadline fails the same way, for its caller. */
  embps_sequencer_arrive(s, 0, &a, 1400);
  assert_int_equal(embps_sequencer_next_round(s, 1400, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_int_equal(embps_sequencer_next_deadline(s, 1400), 100);
  assert_int_equal(embps_sequencer_next_round(s, 1500, e, 8), 1); /* batch 5, by its caller's */
  assert_int_equal(e[0].batch_id, 5);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);

  /* Batch 2: the second shard's deadline (200 ms from 2100) is earlier than the first's batch
   * deadline; the first shard set none. */
  embps_sequencer_arrive(s, 0, &b, 2000);
  b.has_deadline = 1;
  b.deadline_left_ms = 200;
  embps_sequencer_arrive(s, 1, &b, 2100);
  assert_int_equal(embps_sequencer_next_round(s, 2100, e, 8), 1);
  assert_int_equal(e[0].batch_id, 2);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN); /* complete with its deadline still ahead */

  /* Batch 3: complete when its last shard arrives with no time left: failed, never run. */
  embps_sequencer_arrive(s, 0, &c, 3000);
  c.has_deadline = 1;
  c.deadline_left_ms = 0;
  embps_sequencer_arrive(s, 1, &c, 3001);
  assert_int_equal(embps_sequencer_next_round(s, 3001, e, 8), 1);
  assert_int_equal(e[0].batch_id, 3);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(e[0].message, "passed before it was ordered; it ran on no rank"));

  /* Batch 4: a caller with more time than the batch deadline: the batch deadline still rules. */
  d.has_deadline = 1;
  d.deadline_left_ms = 50000;
  embps_sequencer_arrive(s, 0, &d, 4000);
  assert_int_equal(embps_sequencer_next_deadline(s, 4000), 10000);
  assert_int_equal(embps_sequencer_next_round(s, 14000, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(e[0].message, "rank(s) 1 did not arrive within 10000 ms"));
  embps_sequencer_free(s);
}

/* With the batch deadline off (0), a caller's deadline alone bounds a batch. */
static void test_caller_deadline_without_batch_deadline(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(1, EMBPS_OP_LOOKUP, 4, "t");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 2, 0), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 100);
  assert_true(embps_sequencer_next_deadline(s, 100) == UINT64_MAX);
  a.has_deadline = 1;
  a.deadline_left_ms = 20;
  a.batch_id = 2;
  embps_sequencer_arrive(s, 0, &a, 100);
  assert_int_equal(embps_sequencer_next_deadline(s, 110), 10);
  assert_int_equal(embps_sequencer_next_round(s, 120, e, 8), 1);
  assert_int_equal(e[0].batch_id, 2);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_int_equal(embps_sequencer_pending(s), 1); /* batch 1 waits on */
  embps_sequencer_free(s);
}

/* Shards that name one table but carry different ids were sent across a drop and a create of the
 * same name: failed, never run on two different tables. A drop, like a create, needs the leader
 * alone. */
static void test_table_id_and_drop(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(7, EMBPS_OP_LOOKUP, 8, "t"), b = a,
                     d = desc(8, EMBPS_OP_DROP_TABLE, 0, "t");
  (void)state;
  a.table_id = 1;
  b.table_id = 2;
  assert_int_equal(embps_sequencer_new(&s, 2, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 0);
  embps_sequencer_arrive(s, 1, &b, 1);
  embps_sequencer_arrive(s, 0, &d, 2);
  assert_int_equal(embps_sequencer_next_round(s, 3, e, 8), 2);
  assert_int_equal(e[0].batch_id, 7);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "two different tables called 't'"));
  assert_int_equal(e[1].batch_id, 8);
  assert_int_equal(e[1].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[1].kind, EMBPS_OP_DROP_TABLE);
  embps_sequencer_free(s);
}

static void test_create_needs_leader_only(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t c = desc(3, EMBPS_OP_CREATE_TABLE, 0, "new");
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 4, 100), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &c, 0);
  assert_int_equal(embps_sequencer_next_round(s, 0, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[0].kind, EMBPS_OP_CREATE_TABLE);
  embps_sequencer_free(s);
}

static void test_many_batches_bounded_round(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[16];
  size_t total = 0, n;
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 2, 0), EMBPS_OK);
  for (uint64_t id = 1; id <= 100; id++) {
    embps_batch_desc_t d = desc(id, EMBPS_OP_LOOKUP, 2, "t");
    embps_sequencer_arrive(s, 1, &d, 0);
  }
  for (uint64_t id = 1; id <= 100; id++) {
    embps_batch_desc_t d = desc(id, EMBPS_OP_LOOKUP, 2, "t");
    embps_sequencer_arrive(s, 0, &d, 0);
  }
  while ((n = embps_sequencer_next_round(s, 1u << 30, e, 16)) > 0) {
    for (size_t i = 0; i < n; i++)
      assert_int_equal(e[i].batch_id, total + i + 1);
    total += n;
  }
  assert_int_equal(total, 100); /* deadline 0: nothing expires */
  embps_sequencer_free(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_completion_order),
      cmocka_unit_test(test_client_scope),
      cmocka_unit_test(test_disagreement_and_late_shard),
      cmocka_unit_test(test_deadline),
      cmocka_unit_test(test_caller_deadline),
      cmocka_unit_test(test_caller_deadline_without_batch_deadline),
      cmocka_unit_test(test_create_needs_leader_only),
      cmocka_unit_test(test_table_id_and_drop),
      cmocka_unit_test(test_many_batches_bounded_round),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
