/* client/cli/args.c: strict number and list parsing for the command line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/args.h"

static char err[256];

static void test_u64(void **state) {
  uint64_t v = 7;
  static const char *bad[] = {"",
                              "-1",
                              " 1",
                              "1 ",
                              "1x",
                              "0x10",
                              "+5",
                              "1.0",
                              "1e3",
                              "18446744073709551616",
                              "99999999999999999999999"};
  (void)state;
  assert_int_equal(embps_cli_parse_u64("--rows", "0", 0, 10, &v, err, sizeof(err)), 0);
  assert_int_equal(v, 0);
  assert_int_equal(
      embps_cli_parse_u64("--rows", "18446744073709551615", 0, UINT64_MAX, &v, err, sizeof(err)),
      0);
  assert_true(v == UINT64_MAX);
  assert_int_equal(embps_cli_parse_u64("--rows", "4096", 1, 1 << 20, &v, err, sizeof(err)), 0);
  assert_int_equal(v, 4096);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = 7;
    assert_int_equal(embps_cli_parse_u64("--rows", bad[i], 0, UINT64_MAX, &v, err, sizeof(err)),
                     -1);
    assert_int_equal(v, 7);
    assert_non_null(strstr(err, "--rows"));
  }
  assert_int_equal(embps_cli_parse_u64("--batch", "0", 1, 10, &v, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "outside [1, 10]"));
  assert_int_equal(embps_cli_parse_u64("--batch", "11", 1, 10, &v, err, sizeof(err)), -1);
}

static void test_double(void **state) {
  double v = 3;
  static const char *bad[] = {"",      "nan", "inf", "-inf", "1.0x",  " 1",  "1 ",
                              "0x1p3", "1e",  ".",   "e5",   "1e999", "--1", "1,5"};
  (void)state;
  assert_int_equal(embps_cli_parse_double("--lr", "0.5", 0, 1, &v, err, sizeof(err)), 0);
  assert_true(v == 0.5);
  assert_int_equal(embps_cli_parse_double("--lr", "1e-3", 0, 1, &v, err, sizeof(err)), 0);
  assert_true(v == 1e-3);
  assert_int_equal(embps_cli_parse_double("--lr", ".25", 0, 1, &v, err, sizeof(err)), 0);
  assert_true(v == 0.25);
  assert_int_equal(embps_cli_parse_double("--x", "-2", -5, 5, &v, err, sizeof(err)), 0);
  assert_true(v == -2);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = 3;
    if (embps_cli_parse_double("--lr", bad[i], -1e300, 1e300, &v, err, sizeof(err)) != -1)
      fail_msg("'%s' was accepted", bad[i]);
    assert_true(v == 3);
  }
  assert_int_equal(embps_cli_parse_double("--push-ratio", "1.5", 0, 1, &v, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "--push-ratio"));
}

static void test_i64_list(void **state) {
  int64_t *v = NULL;
  size_t n = 0;
  static const char *bad[] = {"",
                              ",",
                              "1,",
                              ",1",
                              "1,,2",
                              "a",
                              "1,b",
                              "1.5",
                              "1 ,2",
                              "-",
                              "9223372036854775808",
                              "-9223372036854775809"};
  (void)state;
  assert_int_equal(
      embps_cli_parse_i64_list("--tokens", "1,2,-3,9223372036854775807", &v, &n, err, sizeof(err)),
      0);
  assert_int_equal(n, 4);
  assert_int_equal(v[0], 1);
  assert_int_equal(v[2], -3);
  assert_true(v[3] == INT64_MAX);
  free(v);
  assert_int_equal(
      embps_cli_parse_i64_list("--tokens", "-9223372036854775808", &v, &n, err, sizeof(err)), 0);
  assert_true(v[0] == INT64_MIN);
  free(v);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = NULL;
    if (embps_cli_parse_i64_list("--tokens", bad[i], &v, &n, err, sizeof(err)) != -1)
      fail_msg("'%s' was accepted", bad[i]);
    assert_null(v);
  }
  assert_int_equal(embps_cli_parse_i64_list("--tokens", "1,x,3", &v, &n, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "item 2 ('x')"));
}

static void test_f32_rows(void **state) {
  float *v = NULL;
  size_t n = 0, rows = 0;
  static const char *bad[] = {"", "1,", "1|", "|1", "1,2|3", "1|2,3", "a", "1,nan", "1e39"};
  (void)state;
  assert_int_equal(
      embps_cli_parse_f32_rows("--grads", "0.1,0.2|-1,2e-3", &v, &n, &rows, err, sizeof(err)), 0);
  assert_int_equal(n, 4);
  assert_int_equal(rows, 2);
  assert_true(v[0] == 0.1f && v[1] == 0.2f && v[2] == -1.0f && v[3] == 2e-3f);
  free(v);
  assert_int_equal(embps_cli_parse_f32_rows("--grads", "5", &v, &n, &rows, err, sizeof(err)), 0);
  assert_int_equal(n, 1);
  assert_int_equal(rows, 1);
  free(v);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = NULL;
    if (embps_cli_parse_f32_rows("--grads", bad[i], &v, &n, &rows, err, sizeof(err)) != -1)
      fail_msg("'%s' was accepted", bad[i]);
    assert_null(v);
  }
}

static void test_mix(void **state) {
  uint64_t *b = NULL;
  double *w = NULL;
  size_t n = 0;
  static const char *bad[] = {"",      ",",    "16,", ":3",     "16:",    "16:0",
                              "16:-1", "16:x", "0:1", "17:1,x", "16:1:2", "99999999999"};
  (void)state;
  assert_int_equal(
      embps_cli_parse_mix("--mix", "1024:3,4096", 1 << 24, &b, &w, &n, err, sizeof(err)), 0);
  assert_int_equal(n, 2);
  assert_int_equal(b[0], 1024);
  assert_int_equal(b[1], 4096);
  assert_true(w[0] == 3.0 && w[1] == 1.0);
  free(b);
  free(w);
  assert_int_equal(embps_cli_parse_mix("--mix", "8:0.25", 8, &b, &w, &n, err, sizeof(err)), 0);
  assert_int_equal(n, 1);
  assert_true(b[0] == 8 && w[0] == 0.25);
  free(b);
  free(w);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    b = NULL;
    n = 0;
    assert_int_equal(embps_cli_parse_mix("--mix", bad[i], 1 << 24, &b, &w, &n, err, sizeof(err)),
                     -1);
    assert_null(b);
    assert_int_equal(n, 0);
    assert_non_null(strstr(err, "--mix"));
  }
  /* The item named is the bad one. */
  assert_int_equal(embps_cli_parse_mix("--mix", "16:3,x", 64, &b, &w, &n, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "item 2"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_u64),      cmocka_unit_test(test_double),
      cmocka_unit_test(test_i64_list), cmocka_unit_test(test_f32_rows),
      cmocka_unit_test(test_mix),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
