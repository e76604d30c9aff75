/* client/cli/main.c: the command table. Every command has a name, a summary, a handler and a
 * flag table; the names are distinct; `embps --help` lists every command and each command's
 * --help every flag; dispatch finds each command by name and refuses an unknown one. main.c is
 * included with its main() renamed, to reach the static table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define main embps_cli_main
#include "client/cli/main.c"
#undef main

/* What print(f) writes, as a new string (freed by the caller). */
static char *capture(void (*print)(FILE *f, const void *arg), const void *arg) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  print(f, arg);
  fclose(f);
  return text;
}

static void print_usage(FILE *f, const void *arg) {
  (void)arg;
  usage(f);
}

static void print_command_usage(FILE *f, const void *arg) { embps_cli_usage_command(f, arg); }

static void test_every_command_complete(void **state) {
  (void)state;
  assert_true(NUM_COMMANDS >= 10);
  for (size_t i = 0; i < NUM_COMMANDS; i++) {
    const embps_cli_command_t *c = &commands[i];
    assert_non_null(c->name);
    assert_non_null(c->run);
    assert_non_null(c->flags);
    assert_non_null(c->summary);
    assert_true(strlen(c->summary) > 10);
    for (size_t j = 0; j < i; j++)
      if (strcmp(commands[j].name, c->name) == 0)
        fail_msg("command %s is in the table twice", c->name);
    for (const embps_cli_flag_t *f = c->flags; f->name; f++) {
      assert_non_null(f->help);
      /* a flag, or a further positional argument (args.h): a placeholder in capitals */
      if (strncmp(f->name, "--", 2) != 0 && !(f->name[0] >= 'A' && f->name[0] <= 'Z' && !f->arg))
        fail_msg("%s: flag %s neither starts with -- nor is a positional's placeholder", c->name,
                 f->name);
    }
  }
}

static void test_usage_lists_every_command_and_flag(void **state) {
  char *text = capture(print_usage, NULL);
  (void)state;
  for (size_t i = 0; i < NUM_COMMANDS; i++) {
    char line[128];
    snprintf(line, sizeof(line), "\n  %-14s %s\n", commands[i].name, commands[i].summary);
    if (!strstr(text, line))
      fail_msg("embps --help lacks the line of %s", commands[i].name);
  }
  assert_non_null(strstr(text, "--servers VALUE"));
  assert_non_null(strstr(text, "EMBPS_SERVERS"));
  free(text);
  for (size_t i = 0; i < NUM_COMMANDS; i++) {
    text = capture(print_command_usage, &commands[i]);
    assert_non_null(strstr(text, commands[i].name));
    for (const embps_cli_flag_t *f = commands[i].flags; f->name; f++) {
      char line[96];
      snprintf(line, sizeof(line), "\n  %s", f->name);
      if (!strstr(text, line))
        fail_msg("embps %s --help lacks %s", commands[i].name, f->name);
    }
    free(text);
  }
}

/* Runs `embps WORDS...` through main.c's main, as a fresh process would (no flag values left
 * from an earlier run); returns its exit status. */
static int run(int argc, char **argv) {
  for (size_t i = 0; i < NUM_COMMANDS; i++)
    for (embps_cli_flag_t *f = commands[i].flags; f->name; f++)
      f->value = NULL;
  return embps_cli_main(argc, argv);
}

static void test_dispatch(void **state) {
  char *unknown[] = {"embps", "frobnicate"};
  char *none[] = {"embps"};
  char *bad_global[] = {"embps", "--colour", "tables"};
  char *help[] = {"embps", "--help"};
  char *missing_name[] = {"embps", "create-table", "--rows", "4", "--emb-width", "4"};
  char *missing_rows[] = {"embps", "create-table", "t", "--emb-width", "4"};
  char *bad_flag[] = {"embps", "lookup", "t", "--colour", "red"};
  (void)state;
  assert_int_equal(run(2, unknown), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(run(1, none), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(run(3, bad_global), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(run(2, help), 0);
  /* Each is refused by its own command before anything connects (no server listens here). */
  assert_int_equal(run(6, missing_name), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(run(5, missing_rows), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(run(5, bad_flag), EMBPS_CLI_EXIT_USAGE);
  /* Every command is found by its name: its --help exits 0. */
  for (size_t i = 0; i < NUM_COMMANDS; i++) {
    char *argv[] = {"embps", (char *)commands[i].name, "--help"};
    assert_int_equal(run(3, argv), 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_command_complete),
      cmocka_unit_test(test_usage_lists_every_command_and_flag),
      cmocka_unit_test(test_dispatch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
