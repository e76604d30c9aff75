/* Settings: defaults, environment, flags (which win), sizes, and clear refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/settings.h"

static void test_defaults(void **state) {
  embps_settings_t s;
  embps_error_t err;
  int help;
  char *argv[] = {"embps-server", NULL};
  (void)state;
  unsetenv("EMBPS_LISTEN");
  unsetenv("EMBPS_MAX_MESSAGE_BYTES");
  assert_int_equal(embps_settings_load(&s, 1, argv, &help, &err), EMBPS_OK);
  assert_string_equal(s.listen, ""); /* main picks this rank's --peers entry or 127.0.0.1:7070 */
  assert_string_equal(s.peers, "");
  assert_int_equal(s.rank, 0);
  assert_int_equal(s.peer_port_offset, 1000);
  assert_string_equal(s.table_axis, "shard");
  assert_int_equal(s.max_message_bytes, 256u << 20);
  assert_int_equal(help, 0);
}

static void test_env_then_flags(void **state) {
  embps_settings_t s;
  embps_error_t err;
  int help;
  char *argv[] = {"embps-server", "--listen", "0.0.0.0:9000", "--stall-timeout-ms=250", NULL};
  (void)state;
  setenv("EMBPS_LISTEN", "127.0.0.2:1", 1);
  setenv("EMBPS_MAX_MESSAGE_BYTES", "1G", 1);
  assert_int_equal(embps_settings_load(&s, 4, argv, &help, &err), EMBPS_OK);
  assert_string_equal(s.listen, "0.0.0.0:9000");     /* the flag wins */
  assert_int_equal(s.max_message_bytes, 1ull << 30); /* from the environment */
  assert_int_equal(s.stall_timeout_ms, 250);
  unsetenv("EMBPS_LISTEN");
  unsetenv("EMBPS_MAX_MESSAGE_BYTES");
}

static void test_refusals(void **state) {
  embps_settings_t s;
  embps_error_t err;
  int help;
  char *bad_size[] = {"x", "--max-message-bytes", "12Q", NULL};
  char *unknown[] = {"x", "--frobnicate", "1", NULL};
  char *missing[] = {"x", "--listen", NULL};
  char *helpv[] = {"x", "--help", NULL};
  (void)state;
  assert_int_equal(embps_settings_load(&s, 3, bad_size, &help, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "--max-message-bytes: '12Q' is not a size"));
  assert_int_equal(embps_settings_load(&s, 3, unknown, &help, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "unknown flag '--frobnicate'"));
  assert_int_equal(embps_settings_load(&s, 2, missing, &help, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "needs a value"));
  setenv("EMBPS_MAX_TABLES", "many", 1);
  assert_int_equal(embps_settings_load(&s, 1, helpv, &help, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "EMBPS_MAX_TABLES: 'many' is not a number"));
  unsetenv("EMBPS_MAX_TABLES");
  assert_int_equal(embps_settings_load(&s, 2, helpv, &help, &err), EMBPS_OK);
  assert_int_equal(help, 1);
}

static void test_sizes(void **state) {
  uint64_t v;
  (void)state;
  assert_int_equal(embps_settings_parse_size("4096", &v), EMBPS_OK);
  assert_int_equal(v, 4096);
  assert_int_equal(embps_settings_parse_size("256M", &v), EMBPS_OK);
  assert_int_equal(v, 256u << 20);
  assert_int_equal(embps_settings_parse_size("2GiB", &v), EMBPS_OK);
  assert_int_equal(v, 2ull << 30);
  assert_int_equal(embps_settings_parse_size("-1", &v), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_settings_parse_size("", &v), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_settings_parse_size("99999999999T", &v), EMBPS_INVALID_ARGUMENT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_env_then_flags),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_sizes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
