/* The sequencer: rounds in completion order, disagreement (digests too), deadlines, late shards,
 * attempts, withdrawals, creates. */
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

/* Attempts of one batch are different batches: a retry (attempt + 1) never joins a shard of the
 * attempt before it, and the failure of one attempt is not the next one's. */
static void test_attempts(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a0 = desc(7, EMBPS_OP_PUSH, 8, "t"), a1 = a0;
  (void)state;
  a0.client_id = a1.client_id = 42;
  a1.attempt = 1;
  assert_int_equal(embps_sequencer_new(&s, 2, 100), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a0, 0);
  embps_sequencer_arrive(s, 1, &a1, 1);
  assert_int_equal(embps_sequencer_pending(s), 2); /* not joined */
  assert_int_equal(embps_sequencer_next_round(s, 2, e, 8), 0);
  assert_int_equal(embps_sequencer_next_round(s, 100, e, 8), 1); /* attempt 0 expires */
  assert_int_equal(e[0].attempt, 0);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  embps_sequencer_arrive(s, 0, &a1, 50); /* attempt 1 is whole and runs */
  assert_int_equal(embps_sequencer_next_round(s, 51, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[0].attempt, 1);
  assert_true(e[0].client_id == 42);
  /* A late shard of attempt 0 still fails at once; attempt 2 is new. */
  embps_sequencer_arrive(s, 1, &a0, 60);
  assert_int_equal(embps_sequencer_next_round(s, 61, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_int_equal(e[0].attempt, 0);
  a1.attempt = 2;
  embps_sequencer_arrive(s, 1, &a1, 62);
  assert_int_equal(embps_sequencer_next_round(s, 63, e, 8), 0);
  assert_int_equal(embps_sequencer_pending(s), 1);
  embps_sequencer_free(s);
}

/* Shards whose digests differ (one without a digest too) fail on every rank with
 * INVALID_ARGUMENT, naming the batch, the client and the ranks that sent another digest than the
 * lowest rank's, whatever order they came in; equal digests run. */
static void test_digest_disagreement(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_batch_desc_t a = desc(7, EMBPS_OP_PUSH, 9, "t"), other;
  (void)state;
  a.client_id = 0xabc;
  a.digest = UINT64_C(0x1122334455667788);
  other = a;
  other.digest = 5;
  assert_int_equal(embps_sequencer_new(&s, 3, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 2, &other, 0); /* the odd one first */
  embps_sequencer_arrive(s, 0, &a, 1);
  assert_int_equal(embps_sequencer_next_round(s, 2, e, 8), 0); /* waits for every shard */
  embps_sequencer_arrive(s, 1, &a, 3);
  assert_int_equal(embps_sequencer_next_round(s, 4, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_string_equal(e[0].message,
                      "shards of batch 7 (client 0xabc) disagree on the batch's content: rank 0's "
                      "digest is 0x1122334455667788, rank(s) 2 sent another; send every rank its "
                      "shard of the same batch");
  /* A late report of the failed batch fails at once with the same words. */
  embps_sequencer_arrive(s, 2, &a, 5);
  assert_int_equal(embps_sequencer_next_round(s, 6, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "rank(s) 2 sent another"));

  /* One shard without a digest disagrees with those that have one. */
  a.batch_id = other.batch_id = 8;
  other.digest = 0;
  embps_sequencer_arrive(s, 0, &other, 10);
  embps_sequencer_arrive(s, 1, &a, 11);
  embps_sequencer_arrive(s, 2, &a, 12);
  assert_int_equal(embps_sequencer_next_round(s, 13, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "rank 0's shard carries no digest, rank(s) 1,2 sent one"));

  /* Equal digests, and none at all, run. */
  a.batch_id = 9;
  for (uint32_t r = 0; r < 3; r++)
    embps_sequencer_arrive(s, r, &a, 20);
  other.batch_id = 10;
  for (uint32_t r = 0; r < 3; r++)
    embps_sequencer_arrive(s, r, &other, 21);
  assert_int_equal(embps_sequencer_next_round(s, 22, e, 8), 2);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[1].action, EMBPS_ROUND_RUN);

  /* Disagreeing digests on an incomplete batch: the expiry says so, not "did not arrive". */
  a.batch_id = other.batch_id = 11;
  other.digest = 6;
  embps_sequencer_arrive(s, 0, &a, 30);
  embps_sequencer_arrive(s, 1, &other, 31);
  assert_int_equal(embps_sequencer_next_round(s, 1030, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "rank(s) 1 sent another"));
  embps_sequencer_free(s);
}

/* A withdrawal fails a pending batch with CANCELLED on every rank (and its later shards at once)
 * and leaves alone what is already queued to run, failed, or unknown; the counts follow. */
static void test_withdraw(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_sequencer_counts_t c;
  embps_batch_desc_t a = desc(7, EMBPS_OP_PUSH, 8, "t"), b = desc(8, EMBPS_OP_LOOKUP, 8, "t");
  (void)state;
  a.client_id = b.client_id = 3;
  assert_int_equal(embps_sequencer_new(&s, 2, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 0);
  assert_int_equal(embps_sequencer_withdraw(s, 0, 3, 7, 1, 1), 0); /* another attempt */
  assert_int_equal(embps_sequencer_withdraw(s, 0, 4, 7, 0, 1), 0); /* another client */
  assert_int_equal(embps_sequencer_pending(s), 1);
  assert_int_equal(embps_sequencer_withdraw(s, 0, 3, 7, 0, 2), 1);
  assert_int_equal(embps_sequencer_pending(s), 0);
  assert_int_equal(embps_sequencer_next_round(s, 3, e, 8), 1);
  assert_int_equal(e[0].action, EMBPS_ROUND_FAIL);
  assert_int_equal(e[0].status, EMBPS_CANCELLED);
  assert_true(e[0].client_id == 3);
  assert_string_equal(e[0].message,
                      "batch 7 was cancelled before it was ordered: its caller on rank 0 reset the "
                      "stream (the client cancelled or gave up); it ran on no rank");
  /* The sibling that comes after is failed at once, the same way. */
  embps_sequencer_arrive(s, 1, &a, 4);
  assert_int_equal(embps_sequencer_next_round(s, 5, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_CANCELLED);
  assert_non_null(strstr(e[0].message, "its caller on rank 0 reset the stream"));
  /* Withdrawing it again changes nothing. */
  assert_int_equal(embps_sequencer_withdraw(s, 1, 3, 7, 0, 6), 0);
  assert_int_equal(embps_sequencer_next_round(s, 7, e, 8), 0);
  /* The retry (attempt 1) is a new batch and runs. */
  a.attempt = 1;
  embps_sequencer_arrive(s, 1, &a, 8);
  embps_sequencer_arrive(s, 0, &a, 9);
  /* Once queued to run, a batch runs as ordered. */
  embps_sequencer_arrive(s, 0, &b, 10);
  embps_sequencer_arrive(s, 1, &b, 11);
  assert_int_equal(embps_sequencer_withdraw(s, 1, 3, 8, 0, 12), 0);
  assert_int_equal(embps_sequencer_next_round(s, 13, e, 8), 2);
  assert_int_equal(e[0].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[0].attempt, 1);
  assert_int_equal(e[1].action, EMBPS_ROUND_RUN);
  assert_int_equal(e[1].batch_id, 8);
  b.batch_id = 10; /* one that expires, for the counts */
  embps_sequencer_arrive(s, 0, &b, 22);
  assert_int_equal(embps_sequencer_next_round(s, 1022, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  /* A withdrawal that comes once the batch's expiry has passed (before the leader said so): the
   * deadline it is, not a cancellation. */
  b.batch_id = 11;
  b.has_deadline = 1;
  b.deadline_left_ms = 50;
  embps_sequencer_arrive(s, 0, &b, 2000);
  assert_int_equal(embps_sequencer_withdraw(s, 0, 3, 11, 0, 2050), 0);
  assert_int_equal(embps_sequencer_next_round(s, 2050, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_DEADLINE_EXCEEDED);
  assert_non_null(strstr(e[0].message, "the deadline its caller set (grpc-timeout) passed"));
  embps_sequencer_counts(s, &c);
  assert_int_equal(c.cancelled, 1);
  assert_int_equal(c.expired, 2);
  embps_sequencer_free(s);
}

/* A batch whose shards already disagree keeps its INVALID_ARGUMENT when withdrawn: its callers
 * learn what was wrong, and it is not counted as cancelled. */
/* The failed batches' ring past its 4096 slots: a late shard of each of the most recent 4096 is
 * failed at once (its entry found through the ring's hash index, whose chains the overwrites
 * must keep right), an older one's is pending again, and batches never failed are not found. */
static void test_failed_ring_wraps(void **state) {
  enum { FAILS = 4096 * 2 + 123 };
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  (void)state;
  assert_int_equal(embps_sequencer_new(&s, 2, 1000), EMBPS_OK);
  for (uint64_t i = 0; i < FAILS; i++) {
    embps_batch_desc_t d = desc(i, EMBPS_OP_LOOKUP, 8, "t");
    d.client_id = i % 7; /* a few clients share batch ids' hash buckets */
    embps_sequencer_arrive(s, 0, &d, 0);
    assert_int_equal(embps_sequencer_withdraw(s, 0, d.client_id, i, 0, 0), 1);
    assert_int_equal(embps_sequencer_next_round(s, 0, e, 8), 1);
  }
  for (uint64_t i = FAILS - 4096; i < FAILS; i++) { /* remembered (the reports add nothing) */
    embps_batch_desc_t d = desc(i, EMBPS_OP_LOOKUP, 8, "t");
    d.client_id = i % 7;
    embps_sequencer_arrive(s, 1, &d, 1);
    assert_int_equal(embps_sequencer_next_round(s, 1, e, 8), 1);
    assert_int_equal(e[0].status, EMBPS_CANCELLED);
    assert_true(e[0].batch_id == i && e[0].client_id == i % 7);
  }
  for (uint64_t i = 0; i < FAILS - 4096; i += 97) { /* forgotten: pending, as a first shard */
    embps_batch_desc_t d = desc(i, EMBPS_OP_LOOKUP, 8, "t");
    d.client_id = i % 7;
    embps_sequencer_arrive(s, 1, &d, 1);
    assert_int_equal(embps_sequencer_next_round(s, 1, e, 8), 0);
    assert_int_equal(embps_sequencer_pending(s), 1);
    assert_int_equal(embps_sequencer_withdraw(s, 1, d.client_id, i, 0, 1), 1);
    assert_int_equal(embps_sequencer_next_round(s, 1, e, 8), 1);
  }
  {
    embps_batch_desc_t d = desc(FAILS - 1, EMBPS_OP_LOOKUP, 8, "t");
    d.client_id = 6; /* never failed under this client */
    embps_sequencer_arrive(s, 1, &d, 1);
    assert_int_equal(embps_sequencer_next_round(s, 1, e, 8), 0);
  }
  embps_sequencer_free(s);
}

static void test_withdraw_disagreeing(void **state) {
  embps_sequencer_t *s;
  embps_round_entry_t e[8];
  embps_sequencer_counts_t c;
  embps_batch_desc_t a = desc(9, EMBPS_OP_PUSH, 9, "t"), b = a;
  (void)state;
  a.digest = 2;
  b.digest = 1;
  assert_int_equal(embps_sequencer_new(&s, 3, 1000), EMBPS_OK);
  embps_sequencer_arrive(s, 0, &a, 0);
  embps_sequencer_arrive(s, 1, &b, 1);
  assert_int_equal(embps_sequencer_withdraw(s, 1, 0, 9, 0, 2), 0);
  assert_int_equal(embps_sequencer_pending(s), 0);
  assert_int_equal(embps_sequencer_next_round(s, 3, e, 8), 1);
  assert_int_equal(e[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(e[0].message, "rank(s) 1 sent another"));
  embps_sequencer_counts(s, &c);
  assert_int_equal(c.cancelled, 0);
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
      cmocka_unit_test(test_attempts),
      cmocka_unit_test(test_digest_disagreement),
      cmocka_unit_test(test_withdraw),
      cmocka_unit_test(test_withdraw_disagreeing),
      cmocka_unit_test(test_failed_ring_wraps),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
