/* gRPC's framing helpers on their own: the grpc-timeout parser, value by value against what the
 * gRPC protocol allows (1 to 8 digits and one unit of H, M, S, m, u, n, nothing else). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <string.h>

#include "server/net/h2conn_internal.h"

static int parse(const char *v, uint64_t *ns) {
  return embps__grpc_parse_timeout((const uint8_t *)v, strlen(v), ns);
}

static uint64_t parsed(const char *v) {
  uint64_t ns = 12345;
  assert_int_equal(parse(v, &ns), 0);
  return ns;
}

/* Each unit scales its digits to nanoseconds; 1 and 8 digits both parse. */
static void test_every_unit(void **state) {
  (void)state;
  assert_true(parsed("1H") == UINT64_C(3600000000000));
  assert_true(parsed("1M") == UINT64_C(60000000000));
  assert_true(parsed("1S") == UINT64_C(1000000000));
  assert_true(parsed("1m") == UINT64_C(1000000));
  assert_true(parsed("1u") == UINT64_C(1000));
  assert_true(parsed("1n") == UINT64_C(1));
  assert_true(parsed("0m") == 0);
  assert_true(parsed("300m") == UINT64_C(300000000));
  assert_true(parsed("99999999n") == UINT64_C(99999999));
  assert_true(parsed("12345678S") == UINT64_C(12345678000000000));
  assert_true(parsed("00000001u") == UINT64_C(1000));
  /* 99999999 hours pass 64 bits of nanoseconds: the largest value, never a wrapped small one */
  assert_true(parsed("99999999H") == UINT64_MAX);
  assert_true(parsed("99999999M") == UINT64_C(99999999) * UINT64_C(60000000000));
}

/* Everything else is malformed, and leaves the output alone. */
static void test_malformed(void **state) {
  static const char *const bad[] = {"",      "-1m", "1",     "m",   "1x",         "1mm",
                                    "bogus", "+1m", " 1m",   "1m ", "123456789m", "1.5S",
                                    "1h",    "1s",  "0x10m", "1 m", "999999999n", "S1"};
  (void)state;
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint64_t ns = 777;
    if (parse(bad[i], &ns) != -1)
      fail_msg("'%s' was accepted", bad[i]);
    assert_true(ns == 777);
  }
  /* a NUL inside the value is a bad byte too, not an end */
  uint64_t ns = 777;
  assert_int_equal(embps__grpc_parse_timeout((const uint8_t *)"1\0m", 3, &ns), -1);
  assert_int_equal(embps__grpc_parse_timeout((const uint8_t *)"5m\0", 3, &ns), -1);
  assert_true(ns == 777);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_unit),
      cmocka_unit_test(test_malformed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
