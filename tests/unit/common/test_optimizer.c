/* The optimizer registry: every kind of the public enum has its row, names and kinds map both
 * ways, anything else is refused, and the facts the store sizes its arrays by are the ones the
 * kernels keep. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "common/optimizer.h"

/* The public enum's kinds with the names the wire's users (CLI scripts, Python, checkpoints'
 * messages) know them by: a rename here is a break for them, so it is pinned. */
static const struct {
  embps_optimizer_t kind;
  const char *name;
  int per_element, per_row, accumulator;
} expected[] = {
    {EMBPS_OPTIMIZER_SGD, "sgd", 0, 0, 0},
    {EMBPS_OPTIMIZER_ADAGRAD, "adagrad", 1, 0, 1},
    {EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, "rowwise_adagrad", 0, 1, 1},
    {EMBPS_OPTIMIZER_ADAM, "adam", 2, 0, 0},
};
#define N_EXPECTED (sizeof(expected) / sizeof(expected[0]))

static void test_every_kind_round_trips(void **state) {
  (void)state;
  for (size_t i = 0; i < N_EXPECTED; i++) {
    const embps_optimizer_info_t *info = embps_optimizer_info(expected[i].kind);
    embps_optimizer_t back = EMBPS_OPTIMIZER_DEFAULT;
    assert_non_null(info);
    assert_int_equal(info->kind, expected[i].kind);
    assert_string_equal(info->name, expected[i].name);
    assert_string_equal(embps_optimizer_name(expected[i].kind), expected[i].name);
    assert_int_equal(embps_optimizer_from_name(expected[i].name, &back), EMBPS_OK);
    assert_int_equal(back, expected[i].kind);
    assert_int_equal(info->state_per_element, expected[i].per_element);
    assert_int_equal(info->state_per_row, expected[i].per_row);
    assert_int_equal(info->accumulator, expected[i].accumulator);
  }
}

static void test_only_the_enum_is_known(void **state) {
  size_t known = 0;
  (void)state;
  for (int k = -2; k < 300; k++) {
    const embps_optimizer_info_t *info = embps_optimizer_info((embps_optimizer_t)k);
    if (!info) {
      assert_string_equal(embps_optimizer_name((embps_optimizer_t)k), "unknown");
      continue;
    }
    known++;
    assert_int_equal(info->kind, k);
  }
  assert_int_equal(known, N_EXPECTED);
  /* The request value "let the server choose" is no optimizer. */
  assert_null(embps_optimizer_info(EMBPS_OPTIMIZER_DEFAULT));
}

static void test_unknown_names_refused(void **state) {
  static const char *bad[] = {"",
                              "lion",
                              "SGD",
                              "Adam",
                              "sgd ",
                              " sgd",
                              "sg",
                              "sgdx",
                              "rowwise",
                              "rowwise_",
                              "adam-",
                              "rowwise adagrad",
                              "rowwise__adagrad",
                              "rowwise_adagradd"};
  (void)state;
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    embps_optimizer_t out = (embps_optimizer_t)77;
    assert_int_equal(embps_optimizer_from_name(bad[i], &out), EMBPS_INVALID_ARGUMENT);
    assert_int_equal(out, 77); /* untouched */
  }
  embps_optimizer_t out = (embps_optimizer_t)77;
  assert_int_equal(embps_optimizer_from_name(NULL, &out), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(out, 77);
}

static void test_alternate_spelling(void **state) {
  embps_optimizer_t out = EMBPS_OPTIMIZER_DEFAULT;
  (void)state;
  /* The CLI has always taken "rowwise-adagrad"; '-' stands for '_' and for nothing else. */
  assert_int_equal(embps_optimizer_from_name("rowwise-adagrad", &out), EMBPS_OK);
  assert_int_equal(out, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  out = EMBPS_OPTIMIZER_DEFAULT;
  assert_int_equal(embps_optimizer_from_name("rowwise_adagrad", &out), EMBPS_OK);
  assert_int_equal(out, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  assert_int_equal(embps_optimizer_from_name("row-wise-adagrad", &out), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_optimizer_from_name("rowwise-adagrad-", &out), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_optimizer_from_name("sg-", &out), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_optimizer_from_name("rowwise_adagra-", &out), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_optimizer_from_name("rowwise-adagrad", &out), EMBPS_OK);
}

static void test_server_default_and_names_list(void **state) {
  char joined[256] = "";
  int defaults = 0;
  (void)state;
  assert_int_equal(EMBPS_OPTIMIZER_SERVER_DEFAULT, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  for (size_t i = 0; i < N_EXPECTED; i++) {
    const embps_optimizer_info_t *info = embps_optimizer_info(expected[i].kind);
    defaults += info->server_default;
    assert_int_equal(info->server_default, expected[i].kind == EMBPS_OPTIMIZER_SERVER_DEFAULT);
    snprintf(joined + strlen(joined), sizeof(joined) - strlen(joined), "%s%s", i ? ", " : "",
             info->name);
  }
  assert_int_equal(defaults, 1);
  assert_string_equal(EMBPS_OPTIMIZER_NAMES, joined);
  assert_string_equal(EMBPS_OPTIMIZER_NAMES, "sgd, adagrad, rowwise_adagrad, adam");
}

static void test_hyper_parameter_defaults(void **state) {
  (void)state;
  /* The store fills (float) of these; they must be the f32 values the kernels have always had,
   * and the help texts print them as written. */
  assert_true((float)EMBPS_OPTIMIZER_DEFAULT_LR == 0.01f);
  assert_true((float)EMBPS_OPTIMIZER_DEFAULT_EPS == 1e-8f);
  assert_true((float)EMBPS_OPTIMIZER_DEFAULT_BETA1 == 0.9f);
  assert_true((float)EMBPS_OPTIMIZER_DEFAULT_BETA2 == 0.999f);
  assert_string_equal(EMBPS_OPTIMIZER_STR(EMBPS_OPTIMIZER_DEFAULT_LR), "0.01");
  assert_string_equal(EMBPS_OPTIMIZER_STR(EMBPS_OPTIMIZER_DEFAULT_EPS), "1e-8");
  assert_string_equal(EMBPS_OPTIMIZER_STR(EMBPS_OPTIMIZER_DEFAULT_BETA1), "0.9");
  assert_string_equal(EMBPS_OPTIMIZER_STR(EMBPS_OPTIMIZER_DEFAULT_BETA2), "0.999");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_kind_round_trips),
      cmocka_unit_test(test_only_the_enum_is_known),
      cmocka_unit_test(test_unknown_names_refused),
      cmocka_unit_test(test_alternate_spelling),
      cmocka_unit_test(test_server_default_and_names_list),
      cmocka_unit_test(test_hyper_parameter_defaults),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
