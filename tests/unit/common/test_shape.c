/* The shape checks say DESIGN.md's words, with the remedy, and accept what shards evenly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/shape.h"

static void test_tokens_per_batch(void **state) {
  embps_error_t err;
  (void)state;
  embps_error_clear(&err);
  assert_int_equal(embps_shape_check_tokens_per_batch(4096, 4, &err), EMBPS_OK);
  assert_int_equal(embps_shape_check_tokens_per_batch(7, 1, &err), EMBPS_OK);
  assert_int_equal(embps_shape_check_tokens_per_batch(10, 4, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message,
                         "tokens_per_batch=10 does not shard evenly over the 4-rank communicator"));
  assert_non_null(strstr(err.message, "pad the batch to 12 tokens"));
  assert_int_equal(embps_shape_padded_tokens(10, 4), 12);
  assert_int_equal(embps_shape_padded_tokens(12, 4), 12);
  assert_int_equal(embps_shape_padded_tokens(1, 3), 3);
}

static void test_emb_width(void **state) {
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_shape_check_emb_width(128, 4, &err), EMBPS_OK);
  assert_int_equal(embps_shape_check_emb_width(130, 4, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(
      strstr(err.message, "emb_width=130 does not shard evenly over the 4-rank communicator"));
}

static void test_batch_size(void **state) {
  embps_error_t err;
  (void)state;
  embps_error_clear(&err);
  assert_int_equal(embps_shape_check_batch_size(2048, 4, &err), EMBPS_OK);
  assert_int_equal(embps_shape_check_batch_size(7, 1, &err), EMBPS_OK);
  assert_int_equal(embps_shape_check_batch_size(10, 4, &err), EMBPS_INVALID_ARGUMENT);
  assert_string_equal(err.message,
                      "batch_size=10 does not shard evenly over the 4-rank communicator: pad the "
                      "batch to 12 samples (a multiple of 4) with empty bags");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tokens_per_batch),
      cmocka_unit_test(test_emb_width),
      cmocka_unit_test(test_batch_size),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
