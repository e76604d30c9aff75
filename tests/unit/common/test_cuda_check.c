/* common/cuda_check.h's EMBPS_CUDA_CHECK_GOTO, compiled as C against the simulated CUDA runtime
 * (tests/unit/engine_sim), so it runs in every build: a failing call sets ret to
 * EMBPS_INTERNAL, fills err with the call, the error's name and its description, and jumps to
 * the label; NULL err is allowed; a successful call falls through. */
#include <stdio.h>
#include <string.h>

/* cmocka.h needs these first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/cuda_check.h"

static cudaError_t answer(cudaError_t e) { return e; }

/* Runs two checked calls, the first answering first, the second answering second; *reached
 * counts the statements after each check that ran. */
static embps_status_t run(cudaError_t first, cudaError_t second, embps_error_t *err, int *reached) {
  embps_status_t ret = EMBPS_OK;
  *reached = 0;
  EMBPS_CUDA_CHECK_GOTO(answer(first), err, fail);
  (*reached)++;
  EMBPS_CUDA_CHECK_GOTO(answer(second), err, fail);
  (*reached)++;
exit:
  return ret;
fail:
  goto exit;
}

static void test_success_falls_through(void **state) {
  (void)state;
  embps_error_t err;
  int reached;
  embps_error_clear(&err);
  assert_int_equal(run(cudaSuccess, cudaSuccess, &err, &reached), EMBPS_OK);
  assert_int_equal(reached, 2);
  assert_int_equal(err.status, EMBPS_OK);
  assert_string_equal(err.message, "");
}

static void test_failure_reports_and_jumps(void **state) {
  (void)state;
  embps_error_t err;
  int reached;
  assert_int_equal(run(cudaSuccess, cudaErrorInvalidValue, &err, &reached), EMBPS_INTERNAL);
  assert_int_equal(reached, 1);
  assert_int_equal(err.status, EMBPS_INTERNAL);
  char want[256];
  snprintf(want, sizeof want, "CUDA: answer(second): cudaErrorInvalidValue (%s)",
           cudaGetErrorString(cudaErrorInvalidValue));
  assert_string_equal(err.message, want);
}

static void test_null_err(void **state) {
  (void)state;
  int reached;
  assert_int_equal(run(cudaErrorMemoryAllocation, cudaSuccess, NULL, &reached), EMBPS_INTERNAL);
  assert_int_equal(reached, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_success_falls_through),
      cmocka_unit_test(test_failure_reports_and_jumps),
      cmocka_unit_test(test_null_err),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
