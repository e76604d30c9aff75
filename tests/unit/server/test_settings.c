/* Settings: defaults, environment, flags (which win), sizes, --device, and clear refusals. */
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
  assert_string_equal(s.device, "auto");
  assert_int_equal(s.checkpoint_full_every, 1); /* every checkpoint full */
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
  setenv("EMBPS_MAX_CONNECTIONS", "many", 1);
  assert_int_equal(embps_settings_load(&s, 1, helpv, &help, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "EMBPS_MAX_CONNECTIONS: 'many' is not a number"));
  unsetenv("EMBPS_MAX_CONNECTIONS");
  assert_int_equal(embps_settings_load(&s, 2, helpv, &help, &err), EMBPS_OK);
  assert_int_equal(help, 1);
}

/* The settings folded into others (issue 29) are gone: their flags are unknown. */
static void test_removed_flags_are_unknown(void **state) {
  static const char *const gone[] = {
      "--max-table-bytes",        "--max-reply-bytes", "--max-connection-reply-bytes",
      "--checkpoint-incremental", "--backend",         "--max-tables"};
  embps_settings_t s;
  embps_error_t err;
  int help;
  char msg[128];
  (void)state;
  for (size_t i = 0; i < sizeof(gone) / sizeof(gone[0]); i++) {
    char *argv[] = {"x", (char *)gone[i], "1", NULL};
    assert_int_equal(embps_settings_load(&s, 3, argv, &help, &err), EMBPS_INVALID_ARGUMENT);
    snprintf(msg, sizeof(msg), "unknown flag '%s'", gone[i]);
    assert_non_null(strstr(err.message, msg));
  }
}

/* --device: auto, cpu, cuda (the rank modulo the visible devices) and cuda:N. */
static void test_device(void **state) {
  embps_backend_t b;
  embps_error_t err;
  int d;
  (void)state;
  assert_int_equal(embps_settings_device("auto", 5, 0, &b, &d, &err), EMBPS_OK);
  assert_int_equal(b, EMBPS_BACKEND_CPU);
  assert_int_equal(embps_settings_device("auto", 5, 4, &b, &d, &err), EMBPS_OK);
  assert_int_equal(b, EMBPS_BACKEND_CUDA);
  assert_int_equal(d, 1);
  assert_int_equal(embps_settings_device("cpu", 5, 4, &b, &d, &err), EMBPS_OK);
  assert_int_equal(b, EMBPS_BACKEND_CPU);
  assert_int_equal(d, 0);
  assert_int_equal(embps_settings_device("cuda", 6, 4, &b, &d, &err), EMBPS_OK);
  assert_int_equal(b, EMBPS_BACKEND_CUDA);
  assert_int_equal(d, 2);
  assert_int_equal(embps_settings_device("cuda:3", 6, 4, &b, &d, &err), EMBPS_OK);
  assert_int_equal(b, EMBPS_BACKEND_CUDA);
  assert_int_equal(d, 3);

  /* Refusals name the flag and the value; *backend and *device stay as they were. */
  b = EMBPS_BACKEND_CPU;
  d = 7;
  static const char *const bad[] = {
      "abacus", "gpu", "cpu:1", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "", "cudacudacudacuda:1",
      "auto:0"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    char want[96];
    assert_int_equal(embps_settings_device(bad[i], 0, 4, &b, &d, &err), EMBPS_INVALID_ARGUMENT);
    snprintf(want, sizeof(want), "--device: '%s' is not auto, cpu, cuda or cuda:N", bad[i]);
    assert_string_equal(err.message, want);
  }
  assert_int_equal(embps_settings_device("cuda:4", 0, 4, &b, &d, &err), EMBPS_FAILED_PRECONDITION);
  assert_string_equal(err.message, "--device cuda:4: no such CUDA device; this process sees 4 "
                                   "(cuda:0 to cuda:3)");
  assert_int_equal(embps_settings_device("cuda", 0, 0, &b, &d, &err), EMBPS_FAILED_PRECONDITION);
  assert_string_equal(err.message, "--device cuda: no CUDA device is visible to this process");
  assert_int_equal(embps_settings_device("cuda:0", 0, 0, &b, &d, &err), EMBPS_FAILED_PRECONDITION);
  assert_int_equal(b, EMBPS_BACKEND_CPU);
  assert_int_equal(d, 7);
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
      cmocka_unit_test(test_defaults), cmocka_unit_test(test_env_then_flags),
      cmocka_unit_test(test_refusals), cmocka_unit_test(test_removed_flags_are_unknown),
      cmocka_unit_test(test_device),   cmocka_unit_test(test_sizes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
