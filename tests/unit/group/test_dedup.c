/* The retry window: verdicts, a client's window and floor, the clients' eviction order, pushes
 * without a client id or digest, allocation failures, and a random sequence against a plain
 * model that scans arrays. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "server/group/dedup.h"

static embps_dedup_result_t res(uint8_t applied, double norm, uint64_t unique) {
  embps_dedup_result_t r;
  memset(&r, 0, sizeof(r));
  r.applied = applied;
  r.skipped = !applied;
  r.grad_norm = norm;
  r.num_unique = unique;
  return r;
}

static void test_verdicts(void **state) {
  embps_dedup_t *d;
  embps_dedup_result_t r = res(1, 2.5, 17), got;
  uint64_t first = 0;
  (void)state;
  assert_int_equal(embps_dedup_new(&d, 4, 8), EMBPS_OK);
  assert_int_equal(embps_dedup_window(d), 4);
  assert_int_equal(embps_dedup_check(d, 7, 1, 0xabc, &got, &first), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_record(d, 7, 1, 0xabc, "t", 10, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_size(d), 1);
  memset(&got, 0, sizeof(got));
  assert_int_equal(embps_dedup_check(d, 7, 1, 0xabc, &got, &first), EMBPS_DEDUP_REPLAY);
  assert_int_equal(got.applied, 1);
  assert_int_equal(got.skipped, 0);
  assert_true(got.grad_norm == 2.5);
  assert_int_equal(got.num_unique, 17);
  assert_int_equal(first, 0xabc);
  /* Another digest under the same id: a conflict, naming the first digest. */
  memset(&got, 0, sizeof(got));
  assert_int_equal(embps_dedup_check(d, 7, 1, 0xdef, &got, &first), EMBPS_DEDUP_CONFLICT);
  assert_int_equal(first, 0xabc);
  assert_int_equal(got.num_unique, 17);
  assert_int_equal(embps_dedup_check(d, 7, 1, 0xdef, NULL, NULL), EMBPS_DEDUP_CONFLICT);
  /* Other batches, other clients: new. */
  assert_int_equal(embps_dedup_check(d, 7, 2, 0xabc, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 8, 1, 0xabc, NULL, NULL), EMBPS_DEDUP_NEW);
  /* A second record of a held push keeps the first attempt's answer. */
  r = res(0, 9.0, 1);
  assert_int_equal(embps_dedup_record(d, 7, 1, 0x999, "u", 11, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_size(d), 1);
  assert_int_equal(embps_dedup_check(d, 7, 1, 0xabc, &got, &first), EMBPS_DEDUP_REPLAY);
  assert_int_equal(got.num_unique, 17);
  embps_dedup_free(d);
  embps_dedup_free(NULL);
  assert_int_equal(embps_dedup_new(&d, 0, 8), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_dedup_new(&d, 8, 0), EMBPS_INVALID_ARGUMENT);
}

/* client_id 0 or digest 0: the rules of a request without retries, never recorded. */
static void test_unnamed_never_recorded(void **state) {
  embps_dedup_t *d;
  embps_dedup_result_t r = res(1, 1.0, 1);
  (void)state;
  assert_int_equal(embps_dedup_new(&d, 2, 2), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 0, 1, 0xabc, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 5, 1, 0, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_size(d), 0);
  assert_int_equal(embps_dedup_check(d, 0, 1, 0xabc, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 5, 1, 0, NULL, NULL), EMBPS_DEDUP_NEW);
  /* Not even a client is made: filling the window with them evicts nobody. */
  assert_int_equal(embps_dedup_record(d, 1, 1, 1, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 2, 1, 1, "t", 1, &r), EMBPS_OK);
  for (uint64_t c = 3; c < 100; c++)
    assert_int_equal(embps_dedup_record(d, c, 1, 0, "t", 2, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 1, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(d, 2, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  /* A held push checked without its digest is a request without retries too. */
  assert_int_equal(embps_dedup_check(d, 1, 1, 0, NULL, NULL), EMBPS_DEDUP_NEW);
  embps_dedup_free(d);
}

static void test_window_and_floor(void **state) {
  embps_dedup_t *d;
  embps_dedup_result_t r = res(1, 1.0, 1);
  (void)state;
  assert_int_equal(embps_dedup_new(&d, 3, 4), EMBPS_OK);
  /* Nothing forgotten yet: batch 0 and any id below the held ones are new. */
  assert_int_equal(embps_dedup_record(d, 9, 5, 50, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 9, 0, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 9, 4, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  for (uint64_t b = 6; b <= 9; b++)
    assert_int_equal(embps_dedup_record(d, 9, b, b * 10, "t", b, &r), EMBPS_OK);
  /* Held: 7, 8, 9; forgotten 5 and 6: the floor is 6. */
  assert_int_equal(embps_dedup_size(d), 3);
  for (uint64_t b = 7; b <= 9; b++)
    assert_int_equal(embps_dedup_check(d, 9, b, b * 10, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(d, 9, 6, 60, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(d, 9, 5, 50, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(d, 9, 0, 1, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(d, 9, 10, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  /* Another client's floor is its own. */
  assert_int_equal(embps_dedup_check(d, 8, 5, 50, NULL, NULL), EMBPS_DEDUP_NEW);
  /* Ids out of order: forgetting 100 raises the floor to 100, and a smaller one it forgets
   * later does not lower it. Held ids below the floor still replay. */
  embps_dedup_free(d);
  embps_dedup_t *e;
  assert_int_equal(embps_dedup_new(&e, 2, 4), EMBPS_OK);
  assert_int_equal(embps_dedup_record(e, 1, 100, 1, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(e, 1, 3, 1, "t", 2, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(e, 1, 4, 1, "t", 3, &r), EMBPS_OK); /* forgets 100 */
  assert_int_equal(embps_dedup_check(e, 1, 100, 1, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(e, 1, 50, 1, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(e, 1, 3, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(e, 1, 101, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_record(e, 1, 5, 1, "t", 4, &r), EMBPS_OK); /* forgets 3 */
  assert_int_equal(embps_dedup_check(e, 1, 99, 1, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_check(e, 1, 3, 1, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_size(e), 2);
  embps_dedup_free(e);
  /* A window of one. */
  assert_int_equal(embps_dedup_new(&d, 1, 1), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 1, 1, 11, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 1, 2, 22, "t", 2, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 1, 2, 22, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(d, 1, 1, 11, NULL, NULL), EMBPS_DEDUP_FORGOTTEN);
  assert_int_equal(embps_dedup_size(d), 1);
  embps_dedup_free(d);
}

/* A new client beyond max_clients forgets the one whose last push is oldest; ties go to the
 * smaller id. */
static void test_client_eviction(void **state) {
  embps_dedup_t *d;
  embps_dedup_result_t r = res(1, 1.0, 1);
  (void)state;
  assert_int_equal(embps_dedup_new(&d, 4, 3), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 6, 1, 1, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 5, 1, 1, "t", 1, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 7, 1, 1, "t", 2, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 7, 2, 1, "t", 2, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_size(d), 4);
  /* 5 and 6 both last pushed at round 1: 5 (the smaller id) goes. */
  assert_int_equal(embps_dedup_record(d, 8, 1, 1, "t", 3, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 5, 1, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 6, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_size(d), 4);
  /* A push of 6 makes it recent: 7 (round 2) goes next, though its id is larger. */
  assert_int_equal(embps_dedup_record(d, 6, 2, 1, "t", 4, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_record(d, 4, 1, 1, "t", 5, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 7, 1, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 7, 2, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_size(d), 4); /* 6: 2, 8: 1, 4: 1 */
  /* Held: 8 (round 3), 6 (round 4), 4 (round 5). Then 3 and 9 at round 5: 8, then 6 go. */
  assert_int_equal(embps_dedup_record(d, 3, 1, 1, "t", 5, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 8, 1, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_record(d, 9, 1, 1, "t", 5, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 6, 1, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 6, 2, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  /* 3, 4 and 9 all at round 5: the smallest, 3, goes. A forgotten client forgets its floor. */
  assert_int_equal(embps_dedup_record(d, 10, 1, 1, "t", 5, &r), EMBPS_OK);
  assert_int_equal(embps_dedup_check(d, 3, 1, 1, NULL, NULL), EMBPS_DEDUP_NEW);
  assert_int_equal(embps_dedup_check(d, 4, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(d, 9, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_check(d, 10, 1, 1, NULL, NULL), EMBPS_DEDUP_REPLAY);
  assert_int_equal(embps_dedup_size(d), 3);
  embps_dedup_free(d);
}

/* A plain model of the window: arrays scanned linearly, for a random sequence to agree with. */
#define M_WINDOW 5
#define M_CLIENTS 4
typedef struct m_client {
  uint64_t id, floor, last;
  int has_floor, count;
  uint64_t batch[M_WINDOW], digest[M_WINDOW], unique[M_WINDOW]; /* oldest first */
} m_client_t;
typedef struct model {
  m_client_t c[M_CLIENTS];
  int n;
} model_t;

static m_client_t *m_find(model_t *m, uint64_t id) {
  for (int i = 0; i < m->n; i++)
    if (m->c[i].id == id)
      return &m->c[i];
  return NULL;
}

static int m_check(model_t *m, uint64_t id, uint64_t b, uint64_t dg, uint64_t *unique) {
  m_client_t *c = id && dg ? m_find(m, id) : NULL;
  if (!c)
    return EMBPS_DEDUP_NEW;
  for (int k = 0; k < c->count; k++)
    if (c->batch[k] == b) {
      *unique = c->unique[k];
      return c->digest[k] == dg ? EMBPS_DEDUP_REPLAY : EMBPS_DEDUP_CONFLICT;
    }
  return c->has_floor && b <= c->floor ? EMBPS_DEDUP_FORGOTTEN : EMBPS_DEDUP_NEW;
}

static void m_record(model_t *m, uint64_t id, uint64_t b, uint64_t dg, uint64_t round,
                     uint64_t unique) {
  m_client_t *c;
  if (!id || !dg)
    return;
  if ((c = m_find(m, id))) {
    for (int k = 0; k < c->count; k++)
      if (c->batch[k] == b)
        return;
  } else {
    if (m->n < M_CLIENTS) {
      c = &m->c[m->n++];
    } else {
      c = &m->c[0];
      for (int i = 1; i < m->n; i++)
        if (m->c[i].last < c->last || (m->c[i].last == c->last && m->c[i].id < c->id))
          c = &m->c[i];
    }
    memset(c, 0, sizeof(*c));
    c->id = id;
  }
  if (c->count == M_WINDOW) {
    if (!c->has_floor || c->batch[0] > c->floor)
      c->floor = c->batch[0];
    c->has_floor = 1;
    memmove(c->batch, c->batch + 1, (M_WINDOW - 1) * sizeof(uint64_t));
    memmove(c->digest, c->digest + 1, (M_WINDOW - 1) * sizeof(uint64_t));
    memmove(c->unique, c->unique + 1, (M_WINDOW - 1) * sizeof(uint64_t));
    c->count--;
  }
  c->batch[c->count] = b;
  c->digest[c->count] = dg;
  c->unique[c->count] = unique;
  c->count++;
  c->last = round;
}

static uint64_t rng_next(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static void test_against_model(void **state) {
  embps_dedup_t *d;
  model_t m;
  uint64_t s = 12345, round = 1;
  (void)state;
  memset(&m, 0, sizeof(m));
  assert_int_equal(embps_dedup_new(&d, M_WINDOW, M_CLIENTS), EMBPS_OK);
  for (int step = 0; step < 200000; step++) {
    uint64_t id = rng_next(&s) % 7, b = rng_next(&s) % 40, dg = rng_next(&s) % 3;
    uint64_t mu = 0;
    embps_dedup_result_t got;
    memset(&got, 0, sizeof(got));
    int want = m_check(&m, id, b, dg, &mu);
    int have = (int)embps_dedup_check(d, id, b, dg, &got, NULL);
    if (want != have)
      fail_msg("step %d: client %llu batch %llu digest %llu: %d, the model says %d", step,
               (unsigned long long)id, (unsigned long long)b, (unsigned long long)dg, have, want);
    if (want == EMBPS_DEDUP_REPLAY || want == EMBPS_DEDUP_CONFLICT)
      assert_int_equal(got.num_unique, mu);
    if (rng_next(&s) % 4 == 0)
      round++;
    if (have == EMBPS_DEDUP_NEW) {
      embps_dedup_result_t r = res(1, 0.5, (uint64_t)step);
      m_record(&m, id, b, dg, round, (uint64_t)step);
      assert_int_equal(embps_dedup_record(d, id, b, dg, step % 3 ? "a" : "b", round, &r), EMBPS_OK);
    }
  }
  embps_dedup_free(d);
}

/* Many batches per client, far above the window, ids in any order: lookups stay right (the
 * index's deletions keep every probe run whole). */
static void test_large(void **state) {
  embps_dedup_t *d;
  embps_dedup_result_t r = res(1, 1.0, 1);
  enum { W = 1024, C = 16, N = 20000 };
  (void)state;
  assert_int_equal(embps_dedup_new(&d, W, EMBPS_DEDUP_MAX_CLIENTS), EMBPS_OK);
  for (uint64_t i = 0; i < N; i++)
    for (uint64_t c = 1; c <= C; c++) {
      /* Each client numbers its batches with a stride that wraps the index many times. */
      uint64_t b = i * (c * 4099 + 1);
      assert_int_equal(embps_dedup_record(d, c, b, b + 1, "t", i + 1, &r), EMBPS_OK);
    }
  assert_int_equal(embps_dedup_size(d), (size_t)W * C);
  for (uint64_t c = 1; c <= C; c++)
    for (uint64_t i = 0; i < N; i++) {
      uint64_t b = i * (c * 4099 + 1);
      embps_dedup_verdict_t want = i >= N - W ? EMBPS_DEDUP_REPLAY : EMBPS_DEDUP_FORGOTTEN;
      assert_int_equal(embps_dedup_check(d, c, b, b + 1, NULL, NULL), want);
    }
  embps_dedup_free(d);
}

/* Every allocation a record makes may fail: the record then changes nothing, and works once
 * memory is back. */
static void test_allocation_failure(void **state) {
  embps_dedup_result_t r = res(1, 1.0, 1);
  (void)state;
  for (long n = 1; n < 40; n++) {
    embps_dedup_t *d;
    int failures = 0;
    assert_int_equal(embps_dedup_new(&d, 16, 2), EMBPS_OK);
    embps_alloc_fail_after(n);
    for (uint64_t b = 1; b <= 40; b++) {
      uint64_t client = b % 3 + 1;
      size_t before = embps_dedup_size(d);
      const char *table = b % 5 == 0 ? "other" : "t";
      embps_status_t st = embps_dedup_record(d, client, b, b, table, b, &r);
      if (st != EMBPS_OK) {
        assert_int_equal(st, EMBPS_RESOURCE_EXHAUSTED);
        assert_int_equal(embps_dedup_size(d), before);
        assert_int_equal(embps_dedup_check(d, client, b, b, NULL, NULL), EMBPS_DEDUP_NEW);
        failures++;
        embps_alloc_fail_after(0);
        assert_int_equal(embps_dedup_record(d, client, b, b, table, b, &r), EMBPS_OK);
        embps_alloc_fail_after(n);
      }
      assert_int_equal(embps_dedup_check(d, client, b, b, NULL, NULL), EMBPS_DEDUP_REPLAY);
    }
    embps_alloc_fail_after(0);
    if (n <= 8) /* the first records make more allocations than that */
      assert_true(failures > 0);
    embps_dedup_free(d);
  }
  embps_dedup_t *d = NULL;
  embps_alloc_fail_after(1);
  assert_int_equal(embps_dedup_new(&d, 16, 2), EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
  assert_null(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_verdicts),           cmocka_unit_test(test_unnamed_never_recorded),
      cmocka_unit_test(test_window_and_floor),   cmocka_unit_test(test_client_eviction),
      cmocka_unit_test(test_against_model),      cmocka_unit_test(test_large),
      cmocka_unit_test(test_allocation_failure),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
