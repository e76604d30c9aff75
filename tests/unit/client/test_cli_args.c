/* client/cli/args.c: strict number and list parsing for the command line, a command's flags
 * and the global settings. */
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

static int run_ok(const char *cmd, embps_cli_flag_t *f, const char *pos) {
  (void)cmd, (void)f, (void)pos;
  return 0;
}

static embps_cli_flag_t demo_flags[] = {{"--rows", "R", "rows", NULL},
                                        {"--rate", "X", "rate", NULL},
                                        {"--json", NULL, "a switch", NULL},
                                        {NULL, NULL, NULL, NULL}};
static const embps_cli_command_t demo = {"demo", "NAME", "A demo.", run_ok, demo_flags};

/* Parses the words of line (at most 16) with demo's table, its values cleared first. */
static int parse(const char *line, const char **pos) {
  static char buf[256];
  char *argv[16], *save = NULL;
  int argc = 0;
  for (embps_cli_flag_t *f = demo_flags; f->name; f++)
    f->value = NULL;
  snprintf(buf, sizeof(buf), "%s", line);
  for (char *t = strtok_r(buf, " ", &save); t && argc < 16; t = strtok_r(NULL, " ", &save))
    argv[argc++] = t;
  return embps_cli_parse_flags(&demo, argc, argv, pos);
}

static void test_flags(void **state) {
  const char *pos = "x";
  uint64_t u = 0;
  double d = 0;
  float fl = 1;
  (void)state;
  assert_int_equal(parse("t1 --rows 12 --rate=0.5 --json", &pos), 0);
  assert_string_equal(pos, "t1");
  assert_string_equal(embps_cli_flag(demo_flags, "--rows"), "12");
  assert_string_equal(embps_cli_flag(demo_flags, "--rate"), "0.5");
  assert_string_equal(embps_cli_flag(demo_flags, "--json"), "1");
  assert_null(embps_cli_flag(demo_flags, "--nope"));
  assert_int_equal(embps_cli_flag_u64("demo", demo_flags, "--rows", 1, 100, 7, &u), 0);
  assert_int_equal(u, 12);
  assert_int_equal(embps_cli_flag_double("demo", demo_flags, "--rate", 0, 1, 9, &d), 0);
  assert_true(d == 0.5);
  assert_int_equal(embps_cli_flag_float("demo", demo_flags, "--rate", &fl), 0);
  assert_true(fl == 0.5f);
  /* Out of range, and absent: the default. */
  assert_int_equal(embps_cli_flag_u64("demo", demo_flags, "--rows", 13, 100, 7, &u),
                   EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("t1", &pos), 0);
  assert_null(embps_cli_flag(demo_flags, "--rows"));
  assert_int_equal(embps_cli_flag_u64("demo", demo_flags, "--rows", 1, 100, 7, &u), 0);
  assert_int_equal(u, 7);
  assert_int_equal(embps_cli_flag_float("demo", demo_flags, "--rate", &fl), 0);
  assert_true(fl == 0.0f);
  /* The positional may come after the flags. */
  assert_int_equal(parse("--rows 3 t2", &pos), 0);
  assert_string_equal(pos, "t2");
  /* Every usage error is EMBPS_CLI_EXIT_USAGE. */
  assert_int_equal(parse("t1 --colour red", &pos), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("t1 --rows", &pos), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("t1 --json=1", &pos), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("t1 t2", &pos), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("--rows 3", &pos), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse("--rowsx 3 t1", &pos), EMBPS_CLI_EXIT_USAGE);
  /* --help and -h print the usage and win over a missing positional. */
  assert_int_equal(parse("--help", &pos), -1);
  assert_int_equal(parse("--rows 3 -h", &pos), -1);
}

/* A further positional declared in the flag table (FILE): required, filled in order after the
 * command's own, anywhere among the flags, and shown in the usage line. */
static void test_further_positional(void **state) {
  static embps_cli_flag_t flags[] = {
      {"FILE", NULL, "the file", NULL}, {"--start", "N", "start", NULL}, {NULL, NULL, NULL, NULL}};
  static const embps_cli_command_t two = {"two", "NAME", "Two positionals.", run_ok, flags};
  char a0[] = "t", a1[] = "--start", a2[] = "5", a3[] = "f.npy", a4[] = "extra";
  char *argv[] = {a0, a1, a2, a3, a4};
  const char *pos = NULL;
  char *text = NULL;
  size_t len = 0;
  FILE *f;
  (void)state;
  assert_int_equal(embps_cli_parse_flags(&two, 4, argv, &pos), 0);
  assert_string_equal(pos, "t");
  assert_string_equal(embps_cli_flag(flags, "FILE"), "f.npy");
  assert_string_equal(embps_cli_flag(flags, "--start"), "5");
  flags[0].value = flags[1].value = NULL;
  assert_int_equal(embps_cli_parse_flags(&two, 5, argv, &pos), EMBPS_CLI_EXIT_USAGE); /* extra */
  flags[0].value = flags[1].value = NULL;
  assert_int_equal(embps_cli_parse_flags(&two, 3, argv, &pos), EMBPS_CLI_EXIT_USAGE); /* no FILE */
  f = open_memstream(&text, &len);
  embps_cli_usage_command(f, &two);
  fclose(f);
  assert_non_null(strstr(text, "usage: embps [GLOBAL OPTIONS] two NAME FILE [OPTIONS]"));
  assert_non_null(strstr(text, "\n  FILE "));
  free(text);
}

static void test_usage_command(void **state) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  (void)state;
  embps_cli_usage_command(f, &demo);
  fclose(f);
  assert_non_null(strstr(text, "usage: embps [GLOBAL OPTIONS] demo NAME [OPTIONS]"));
  assert_non_null(strstr(text, "A demo."));
  assert_non_null(strstr(text, "\n  --rows R "));
  assert_non_null(strstr(text, "\n  --json "));
  assert_non_null(strstr(text, "\n  --help "));
  free(text);
}

static void test_settings(void **state) {
  embps_cli_setting_t s[] = {
      {"--servers", "EMBPS_TEST_ARGS_SERVERS", "127.0.0.1:7070", "servers", 0, NULL},
      {"--pad", "EMBPS_TEST_ARGS_PAD", "0", "pad", 1, NULL},
      {"--token-file", "EMBPS_TEST_ARGS_TOKEN", "", "token", 0, NULL},
  };
  char *argv1[] = {"embps", "--servers", "a:1", "--pad", "tables", "--json"};
  char *argv2[] = {"embps", "--pad=0", "--servers=b:2", "--help", "tables"};
  char *argv3[] = {"embps", "--colour", "tables"};
  char *argv4[] = {"embps", "--servers"};
  char *argv5[] = {"embps"};
  char *text = NULL;
  size_t len = 0;
  FILE *f;
  int next = -1;
  (void)state;
  /* Defaults, the environment over them (an empty variable counts as unset), flags over both. */
  setenv("EMBPS_TEST_ARGS_SERVERS", "env:3", 1);
  setenv("EMBPS_TEST_ARGS_PAD", "", 1);
  assert_int_equal(embps_cli_parse_settings(s, 3, 1, argv5, &next), 0);
  assert_int_equal(next, 1);
  assert_string_equal(s[0].value, "env:3");
  assert_string_equal(s[1].value, "0");
  assert_string_equal(s[2].value, "");
  assert_int_equal(embps_cli_parse_settings(s, 3, 6, argv1, &next), 0);
  assert_int_equal(next, 4); /* the command */
  assert_string_equal(s[0].value, "a:1");
  assert_string_equal(s[1].value, "1"); /* a switch alone */
  assert_int_equal(embps_cli_parse_settings(s, 3, 5, argv2, &next), 0);
  assert_int_equal(next, 3); /* --help is left for the caller */
  assert_string_equal(s[0].value, "b:2");
  assert_string_equal(s[1].value, "0");
  assert_int_equal(embps_cli_parse_settings(s, 3, 3, argv3, &next), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(embps_cli_parse_settings(s, 3, 2, argv4, &next), EMBPS_CLI_EXIT_USAGE);
  unsetenv("EMBPS_TEST_ARGS_SERVERS");
  unsetenv("EMBPS_TEST_ARGS_PAD");
  /* The usage names each flag (a switch without VALUE), its variable and its default. */
  f = open_memstream(&text, &len);
  embps_cli_usage_settings(f, s, 3);
  fclose(f);
  assert_non_null(strstr(text, "  --servers VALUE "));
  assert_non_null(strstr(text, "(env EMBPS_TEST_ARGS_SERVERS, default 127.0.0.1:7070)"));
  assert_non_null(strstr(text, "  --pad "));
  assert_null(strstr(text, "--pad VALUE"));
  assert_non_null(strstr(text, "(env EMBPS_TEST_ARGS_TOKEN, default none)"));
  free(text);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_u64),
      cmocka_unit_test(test_double),
      cmocka_unit_test(test_i64_list),
      cmocka_unit_test(test_f32_rows),
      cmocka_unit_test(test_mix),
      cmocka_unit_test(test_flags),
      cmocka_unit_test(test_usage_command),
      cmocka_unit_test(test_settings),
      cmocka_unit_test(test_further_positional),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
