/* client/cli/cmd_tables.c and cmd_stats.c without a server: create-table's flags read into a
 * spec (dense with --rows, hash-keyed with --capacity and its options, and what is refused
 * before anything connects), and the lines and JSON that create-table, tables and stats print
 * for each kind of table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"
#include "common/eviction.h"

/* Sets the flags of create-table from "--flag", "value" pairs (a NULL-ended list) and parses
 * them into *spec; returns the parser's result. */
static int parse(embps_table_spec_t *spec, ...) {
  va_list ap;
  const char *name;
  for (embps_cli_flag_t *f = embps_cli_create_table_flags; f->name; f++)
    f->value = NULL;
  va_start(ap, spec);
  while ((name = va_arg(ap, const char *)) != NULL) {
    const char *value = va_arg(ap, const char *);
    embps_cli_flag_t *f = embps_cli_create_table_flags;
    while (f->name && strcmp(f->name, name) != 0)
      f++;
    if (!f->name)
      fail_msg("create-table has no flag %s", name);
    f->value = value;
  }
  va_end(ap);
  embps_table_spec_init(spec);
  return embps_cli_table_spec_from_flags("create-table", embps_cli_create_table_flags, spec);
}

static void test_dense_spec(void **state) {
  embps_table_spec_t s;
  (void)state;
  assert_int_equal(parse(&s, "--rows", "1000", "--emb-width", "16", NULL), 0);
  assert_true(s.rows == 1000 && s.capacity == 0 && s.emb_width == 16);
  assert_true(s.admit_after == 0 && s.eviction == EMBPS_EVICTION_DEFAULT);
  assert_true(s.half_life_steps == 0 && s.ttl_steps == 0 && s.sketch_width == 0);
}

static void test_hash_spec(void **state) {
  embps_table_spec_t s;
  (void)state;
  assert_int_equal(parse(&s, "--capacity", "4096", "--emb-width", "8", NULL), 0);
  assert_true(s.rows == 0 && s.capacity == 4096 && s.emb_width == 8);
  assert_true(s.eviction == EMBPS_EVICTION_DEFAULT && s.admit_after == 0);
  assert_int_equal(parse(&s, "--capacity", "4294967295", "--emb-width", "8", "--admit-after", "3",
                         "--eviction", "lfu", "--half-life-steps", "100", "--sketch-width", "512",
                         "--seed", "9", "--optimizer", "sgd", NULL),
                   0);
  assert_true(s.capacity == UINT32_MAX && s.admit_after == 3 && s.eviction == EMBPS_EVICTION_LFU);
  assert_true(s.half_life_steps == 100 && s.sketch_width == 512 && s.seed == 9);
  assert_true(s.optimizer == EMBPS_OPTIMIZER_SGD);
  assert_int_equal(parse(&s, "--capacity", "10", "--emb-width", "8", "--eviction", "ttl",
                         "--ttl-steps", "18446744073709551615", NULL),
                   0);
  assert_true(s.eviction == EMBPS_EVICTION_TTL && s.ttl_steps == UINT64_MAX);
  assert_int_equal(parse(&s, "--capacity", "10", "--emb-width", "8", "--eviction", "lru", NULL), 0);
  assert_true(s.eviction == EMBPS_EVICTION_LRU);
  /* Ranges the server owns (admit_after up to 255, capacity up to 2^32 - 1, the policy's steps)
   * go to it as given: its messages name the field and the remedy. */
  assert_int_equal(parse(&s, "--capacity", "18446744073709551615", "--emb-width", "8",
                         "--admit-after", "1000", NULL),
                   0);
  assert_true(s.capacity == UINT64_MAX && s.admit_after == 1000);
}

static void test_refused_before_connecting(void **state) {
  embps_table_spec_t s;
  static const char *const hash_only[][2] = {{"--admit-after", "2"},
                                             {"--eviction", "lfu"},
                                             {"--half-life-steps", "5"},
                                             {"--ttl-steps", "5"},
                                             {"--sketch-width", "64"}};
  (void)state;
  /* neither kind, both kinds, no width */
  assert_int_equal(parse(&s, "--emb-width", "8", NULL), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--rows", "10", "--capacity", "10", "--emb-width", "8", NULL),
                   EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "10", NULL), EMBPS_CLI_EXIT_USAGE);
  /* capacity 0 is no table; not numbers; an unknown policy */
  assert_int_equal(parse(&s, "--capacity", "0", "--emb-width", "8", NULL), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "-1", "--emb-width", "8", NULL), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "1e6", "--emb-width", "8", NULL), EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "8", "--emb-width", "8", "--admit-after", "two", NULL),
                   EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(
      parse(&s, "--capacity", "8", "--emb-width", "8", "--sketch-width", "4294967296", NULL),
      EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "8", "--emb-width", "8", "--eviction", "fifo", NULL),
                   EMBPS_CLI_EXIT_USAGE);
  assert_int_equal(parse(&s, "--capacity", "8", "--emb-width", "8", "--eviction", "LRU", NULL),
                   EMBPS_CLI_EXIT_USAGE);
  /* every hash-keyed option beside --rows */
  for (size_t i = 0; i < sizeof(hash_only) / sizeof(hash_only[0]); i++)
    assert_int_equal(
        parse(&s, "--rows", "10", "--emb-width", "8", hash_only[i][0], hash_only[i][1], NULL),
        EMBPS_CLI_EXIT_USAGE);
}

/* What fn(f, arg) prints, as a new string. */
static char *capture_tables(const embps_table_spec_t *t, size_t n, int json) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  embps_cli_print_tables(f, t, n, json);
  fclose(f);
  return text;
}

static embps_table_spec_t two_tables[2];

static void fill_two(void) {
  memset(two_tables, 0, sizeof(two_tables));
  two_tables[0].name = "dense";
  two_tables[0].rows = 1000;
  two_tables[0].emb_width = 16;
  two_tables[0].dtype = EMBPS_DTYPE_BF16;
  two_tables[0].optimizer = EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
  two_tables[1].name = "keys";
  two_tables[1].capacity = 4096;
  two_tables[1].emb_width = 8;
  two_tables[1].dtype = EMBPS_DTYPE_F32;
  two_tables[1].optimizer = EMBPS_OPTIMIZER_SGD;
  two_tables[1].admit_after = 3;
  two_tables[1].eviction = EMBPS_EVICTION_LFU;
  two_tables[1].half_life_steps = 100;
}

static void test_tables_text_and_json(void **state) {
  char *text;
  (void)state;
  fill_two();
  text = capture_tables(two_tables, 2, 0);
  assert_true(strncmp(text, "name ", 5) == 0);
  assert_non_null(strstr(text, "rows/capacity"));
  assert_non_null(strstr(text, "\ndense                    dense           1000         16   bf16 "
                               "rowwise_adagrad  -\n"));
  assert_non_null(strstr(text, "\nkeys                      hash           4096          8    f32 "
                               "sgd              lfu,half_life_steps=100,admit_after=3\n"));
  free(text);
  text = capture_tables(two_tables, 2, 1);
  assert_non_null(strstr(text, "[{\"name\":\"dense\",\"kind\":\"dense\",\"rows\":1000,"
                               "\"capacity\":0,\"emb_width\":16,"));
  assert_non_null(strstr(text, "},{\"name\":\"keys\",\"kind\":\"hash\",\"rows\":0,"
                               "\"capacity\":4096,\"emb_width\":8,"));
  assert_non_null(strstr(text, "\"admit_after\":3,\"eviction\":\"lfu\",\"half_life_steps\":100,"
                               "\"ttl_steps\":0,\"sketch_width\":0}]\n"));
  /* the dense table's object carries no hash-keyed settings */
  assert_null(strstr(strstr(text, "\"dense\""), "admit_after\":0"));
  free(text);
  /* the default policy prints as the server's default, lru */
  two_tables[1].eviction = EMBPS_EVICTION_DEFAULT;
  two_tables[1].half_life_steps = 0;
  two_tables[1].admit_after = 0;
  text = capture_tables(&two_tables[1], 1, 0);
  assert_non_null(strstr(text, " sgd              lru\n"));
  free(text);
}

static void test_created_line(void **state) {
  char *text = NULL;
  size_t len = 0;
  FILE *f;
  (void)state;
  fill_two();
  f = open_memstream(&text, &len);
  embps_cli_print_created(f, &two_tables[0]);
  embps_cli_print_created(f, &two_tables[1]);
  fclose(f);
  assert_non_null(strstr(text, "created table dense: rows 1000, emb_width 16, dtype bf16, "));
  assert_null(strstr(text, "dense: rows 1000, emb_width 16, dtype bf16, optimizer "
                           "rowwise_adagrad, lr 0, eps 0, half_life 0, initial_accumulator 0, "
                           "weight_decay 0, beta1 0, beta2 0, seed 0, init_scale 0, admit"));
  assert_non_null(strstr(text, "created table keys: capacity 4096, emb_width 8, "
                               "dtype f32, optimizer sgd,"));
  assert_non_null(strstr(text, ", init_scale 0, admit_after 3, eviction lfu, half_life_steps 100, "
                               "ttl_steps 0, sketch_width 0\n"));
  free(text);
}

static void test_stats_lines(void **state) {
  embps_table_stats_t d, h;
  char *text = NULL;
  size_t len = 0;
  FILE *f;
  (void)state;
  memset(&d, 0, sizeof(d));
  memset(&h, 0, sizeof(h));
  d.name = "dense";
  d.rows = 20;
  d.emb_width = 4;
  d.lookups = 2;
  d.bytes = 320;
  h.name = "keys";
  h.capacity = 1000;
  h.keys = 250;
  h.emb_width = 8;
  h.pushes = 7;
  h.bytes = 99;
  h.keys_admitted = 300;
  h.keys_evicted = 40;
  h.keys_expired = 10;
  h.keys_refused = 2;
  h.gradients_dropped = 5;
  f = open_memstream(&text, &len);
  embps_cli_print_table_stats(f, &d, 0);
  embps_cli_print_table_stats(f, &h, 0);
  embps_cli_print_table_stats(f, &d, 1);
  fputc('\n', f);
  embps_cli_print_table_stats(f, &h, 1);
  fclose(f);
  /* the dense line as before */
  assert_non_null(strstr(text, "  table dense: rows 20, emb_width 4, lookups 2, pushes 0, rows "
                               "looked up 0, rows pushed 0, steps applied 0, steps skipped 0, "
                               "bytes 320\n"));
  assert_non_null(strstr(text, "  table keys: capacity 1000, keys 250, load 25.0%, "
                               "emb_width 8, lookups 0, pushes 7,"));
  assert_non_null(strstr(text, "bytes 99, keys admitted 300, evicted 40, expired 10, refused 2, "
                               "gradients dropped 5\n"));
  assert_non_null(strstr(text, "{\"name\":\"dense\",\"kind\":\"dense\",\"rows\":20,"));
  assert_non_null(strstr(text, "\"bytes\":320,\"capacity\":0,\"keys\":0,\"keys_admitted\":0,"));
  assert_non_null(strstr(text, "{\"name\":\"keys\",\"kind\":\"hash\",\"rows\":0,"));
  assert_non_null(strstr(text, "\"capacity\":1000,\"keys\":250,\"keys_admitted\":300,"
                               "\"keys_evicted\":40,\"keys_expired\":10,\"keys_refused\":2,"
                               "\"gradients_dropped\":5}"));
  free(text);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dense_spec),
      cmocka_unit_test(test_hash_spec),
      cmocka_unit_test(test_refused_before_connecting),
      cmocka_unit_test(test_tables_text_and_json),
      cmocka_unit_test(test_created_line),
      cmocka_unit_test(test_stats_lines),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
