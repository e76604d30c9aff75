/* The retry rules of libembps (client/retry.c), as pure functions of the clock's reading: the
 * backoff schedule (20 ms doubling to 1 s, equal jitter within [d/2, d]), an attempt's bounds
 * under the call's one deadline and its own timeout, which attempts may be retried, and when
 * the next one starts (never at or past the deadline, never past max_attempts). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "client/retry.h"

static void test_backoff_schedule(void **state) {
  /* nominal steps: 20, 40, 80, 160, 320, 640, then the 1000 ms cap */
  static const int64_t nominal[] = {20, 40, 80, 160, 320, 640, 1000, 1000, 1000};
  uint64_t rng = 42;
  (void)state;
  for (uint32_t retry = 1; retry <= 9; retry++) {
    int64_t d = nominal[retry - 1], lo = d, hi = 0;
    for (int i = 0; i < 2000; i++) {
      int64_t b = embps__backoff_ms(retry, embps__splitmix64(&rng));
      assert_true(b >= d / 2 && b <= d);
      lo = b < lo ? b : lo;
      hi = b > hi ? b : hi;
    }
    /* the jitter spreads over the whole range (2000 draws from d/2 + 1 values) */
    assert_int_equal(lo, d / 2);
    assert_int_equal(hi, d);
  }
  /* the extremes of the random word, and retries far past the cap (no overflow) */
  assert_int_equal(embps__backoff_ms(1, 0), 10);
  assert_int_equal(embps__backoff_ms(1, 10), 20);
  assert_int_equal(embps__backoff_ms(0, 0), 10); /* 0 counts as the first retry */
  assert_true(embps__backoff_ms(UINT32_MAX, UINT64_MAX) <= 1000);
  assert_true(embps__backoff_ms(UINT32_MAX, UINT64_MAX) >= 500);
}

static void test_attempt_bounds(void **state) {
  int64_t d = -7, t = -7;
  (void)state;
  /* no deadline, no attempt timeout: unbounded, no grpc-timeout */
  assert_int_equal(embps__attempt_bounds(1000, 0, 0, &d, &t), 0);
  assert_int_equal(d, 0);
  assert_int_equal(t, 0);
  /* only the call's deadline: the attempt may use all that is left */
  assert_int_equal(embps__attempt_bounds(1000, 1750, 0, &d, &t), 0);
  assert_int_equal(d, 1750);
  assert_int_equal(t, 750);
  /* only an attempt timeout */
  assert_int_equal(embps__attempt_bounds(1000, 0, 300, &d, &t), 0);
  assert_int_equal(d, 1300);
  assert_int_equal(t, 300);
  /* both: the earlier wins; the last attempt gets what is left */
  assert_int_equal(embps__attempt_bounds(1000, 1750, 300, &d, &t), 0);
  assert_int_equal(d, 1300);
  assert_int_equal(t, 300);
  assert_int_equal(embps__attempt_bounds(1600, 1750, 300, &d, &t), 0);
  assert_int_equal(d, 1750);
  assert_int_equal(t, 150);
  assert_int_equal(embps__attempt_bounds(1749, 1750, 300, &d, &t), 0);
  assert_int_equal(t, 1);
  /* a negative attempt timeout counts as none */
  assert_int_equal(embps__attempt_bounds(1000, 1750, -5, &d, &t), 0);
  assert_int_equal(d, 1750);
  /* at or past the deadline no attempt starts, and the outputs are untouched */
  d = t = -7;
  assert_int_equal(embps__attempt_bounds(1750, 1750, 300, &d, &t), -1);
  assert_int_equal(embps__attempt_bounds(1900, 1750, 0, &d, &t), -1);
  assert_int_equal(d, -7);
  assert_int_equal(t, -7);
}

static int retryable(const embps_status_t *st, size_t n) {
  embps__verdict_t v = {0, 0, 0};
  for (size_t i = 0; i < n; i++)
    embps__verdict_add(&v, st[i]);
  return embps__verdict_retryable(&v);
}

static void test_which_attempts_retry(void **state) {
  (void)state;
  {
    embps_status_t st[] = {EMBPS_OK, EMBPS_OK};
    assert_false(retryable(st, 2)); /* nothing failed */
  }
  {
    embps_status_t st[] = {EMBPS_UNAVAILABLE, EMBPS_OK};
    assert_true(retryable(st, 2)); /* a lost connection, the other shard answered */
  }
  {
    embps_status_t st[] = {EMBPS_OK, EMBPS_DEADLINE_EXCEEDED};
    assert_true(retryable(st, 2));
  }
  {
    embps_status_t st[] = {EMBPS_CANCELLED, EMBPS_UNAVAILABLE};
    assert_true(retryable(st, 2)); /* a sibling withdrawn because its connection was lost */
  }
  {
    embps_status_t st[] = {EMBPS_CANCELLED, EMBPS_CANCELLED};
    assert_false(retryable(st, 2)); /* no cause this client can outwait */
  }
  {
    embps_status_t st[] = {EMBPS_UNAVAILABLE, EMBPS_INVALID_ARGUMENT};
    assert_false(retryable(st, 2)); /* a refusal is final, whatever else happened */
  }
  {
    embps_status_t st[] = {EMBPS_NOT_FOUND};
    assert_false(retryable(st, 1));
  }
  {
    embps_status_t st[] = {EMBPS_RESOURCE_EXHAUSTED, EMBPS_DEADLINE_EXCEEDED};
    assert_false(retryable(st, 2));
  }
  assert_false(retryable(NULL, 0));
}

static void test_retry_at(void **state) {
  (void)state;
  /* attempts made vs max_attempts: 1 attempt of 1 never retries; 3 of 4 retries once more */
  assert_int_equal(embps__retry_at(1000, 0, 1, 1, 0), 0);
  assert_int_equal(embps__retry_at(1000, 0, 4, 4, 0), 0);
  assert_int_equal(embps__retry_at(1000, 0, 1, 4, 0), 1010); /* the first backoff, jitter low */
  assert_int_equal(embps__retry_at(1000, 0, 1, 4, 10), 1020);
  assert_int_equal(embps__retry_at(1000, 0, 3, 4, 40), 1080); /* the third step: 80 ms */
  /* the backoff must end before the call's deadline */
  assert_int_equal(embps__retry_at(1000, 1020, 1, 4, 10), 0);
  assert_int_equal(embps__retry_at(1000, 1021, 1, 4, 10), 1020);
  assert_int_equal(embps__retry_at(1000, 1000, 1, 4, 0), 0);
}

/* A whole schedule under one deadline: attempts of attempt_timeout_ms each, failing at their
 * timeout, with the real backoff in between; none outlives the deadline, the last one gets what
 * is left, and they stop at max_attempts. */
static void test_schedule_under_one_deadline(void **state) {
  uint64_t rng = 7;
  (void)state;
  for (int trial = 0; trial < 200; trial++) {
    const int64_t start = 5000, deadline = start + 1000, attempt_timeout = 300;
    const uint32_t max_attempts = 4;
    int64_t now = start, d, t;
    uint32_t attempts = 0;
    for (;;) {
      assert_int_equal(embps__attempt_bounds(now, deadline, attempt_timeout, &d, &t), 0);
      assert_true(d <= deadline);
      assert_true(t >= 1 && t <= attempt_timeout);
      assert_int_equal(now + t, d);
      attempts++;
      now = d; /* the attempt times out */
      int64_t at = embps__retry_at(now, deadline, attempts, max_attempts, embps__splitmix64(&rng));
      if (at == 0)
        break;
      assert_true(at > now && at < deadline);
      now = at;
    }
    assert_true(attempts >= 3 && attempts <= max_attempts); /* 3 x 300 + backoff fits 1000 */
    assert_true(now <= deadline);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_backoff_schedule),
      cmocka_unit_test(test_attempt_bounds),
      cmocka_unit_test(test_which_attempts_retry),
      cmocka_unit_test(test_retry_at),
      cmocka_unit_test(test_schedule_under_one_deadline),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
