/* common/backend.h: every backend's name parses back to it, the names are the ones settings,
 * stats and metrics have always used, and anything else is refused without touching the out
 * argument. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "common/backend.h"

static void test_names_round_trip(void **state) {
  embps_backend_t b;
  int n = 0;
  (void)state;
#define ROUND_TRIP(NAME, value, name)                                                              \
  assert_string_equal(embps_backend_name(EMBPS_BACKEND_##NAME), name);                             \
  b = (embps_backend_t)-1;                                                                         \
  assert_int_equal(embps_backend_parse(name, &b), 0);                                              \
  assert_int_equal(b, EMBPS_BACKEND_##NAME);                                                       \
  n++;
  EMBPS_BACKEND_MAP(ROUND_TRIP)
#undef ROUND_TRIP
  assert_int_equal(n, 2);
  assert_int_equal(EMBPS_BACKEND_CPU, 0);
  assert_int_equal(EMBPS_BACKEND_CUDA, 1);
  assert_string_equal(embps_backend_name(EMBPS_BACKEND_CPU), "cpu");
  assert_string_equal(embps_backend_name(EMBPS_BACKEND_CUDA), "cuda");
}

static void test_unknown(void **state) {
  embps_backend_t b = EMBPS_BACKEND_CUDA;
  (void)state;
  assert_string_equal(embps_backend_name((embps_backend_t)7), "unknown");
  assert_int_equal(embps_backend_parse("auto", &b), -1); /* a setting's choice, not a backend */
  assert_int_equal(embps_backend_parse("CPU", &b), -1);
  assert_int_equal(embps_backend_parse("", &b), -1);
  assert_int_equal(embps_backend_parse("cud", &b), -1);
  assert_int_equal(b, EMBPS_BACKEND_CUDA); /* untouched */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_names_round_trip),
      cmocka_unit_test(test_unknown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
