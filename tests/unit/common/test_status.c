/* The status table: names, texts and gRPC codes line up, and errors carry their message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/status.h"

static void test_grpc_codes_round_trip(void **state) {
  (void)state;
  for (int code = 0; code <= 16; code++) {
    embps_status_t s = embps_status_from_grpc(code);
    assert_int_equal(embps_status_grpc_code(s), code);
    assert_string_not_equal(embps_status_str(s), "unknown status");
  }
  assert_int_equal(embps_status_from_grpc(17), EMBPS_UNKNOWN);
  assert_int_equal(embps_status_from_grpc(-1), EMBPS_UNKNOWN);
  assert_int_equal(embps_status_grpc_code(EMBPS_INVALID_ARGUMENT), 3);
  assert_int_equal(embps_status_grpc_code(EMBPS_UNAVAILABLE), 14);
  assert_string_equal(embps_status_name(EMBPS_FAILED_PRECONDITION), "FAILED_PRECONDITION");
  assert_string_equal(embps_status_str(EMBPS_NOT_FOUND), "not found");
}

static void test_error_set(void **state) {
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_error_set(&err, EMBPS_NOT_FOUND, "table '%s' not found", "t1"),
                   EMBPS_NOT_FOUND);
  assert_int_equal(err.status, EMBPS_NOT_FOUND);
  assert_string_equal(err.message, "table 't1' not found");
  embps_error_clear(&err);
  assert_int_equal(err.status, EMBPS_OK);
  assert_string_equal(err.message, "");
  /* NULL error: only the status comes back. */
  assert_int_equal(embps_error_set(NULL, EMBPS_INTERNAL, "x"), EMBPS_INTERNAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grpc_codes_round_trip),
      cmocka_unit_test(test_error_set),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
