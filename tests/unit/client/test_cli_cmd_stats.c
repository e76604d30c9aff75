/* client/cli/cmd_stats.c: the ranks' Prometheus texts merged into one exposition. Each family's
 * HELP and TYPE come once, then every rank's samples of it, labelled with the rank when there
 * are several ranks (with or without labels of their own); one rank's text comes out as it
 * came in. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

static char *merged(char **texts, size_t n) {
  char *out = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&out, &len);
  assert_non_null(f);
  embps_cli_print_prometheus(f, texts, n);
  fclose(f);
  return out;
}

static void test_two_ranks(void **state) {
  char r0[] = "# HELP embps_requests_total Requests.\n"
              "# TYPE embps_requests_total counter\n"
              "embps_requests_total{method=\"Lookup\"} 5\n"
              "embps_requests_total{method=\"Push\"} 2\n"
              "# HELP embps_up Up.\n"
              "# TYPE embps_up gauge\n"
              "embps_up 1\n";
  char r1[] = "# HELP embps_requests_total Requests.\n"
              "# TYPE embps_requests_total counter\n"
              "embps_requests_total{method=\"Lookup\"} 7\n"
              "# HELP embps_up Up.\n"
              "# TYPE embps_up gauge\n"
              "embps_up 0\n"
              "# HELP embps_only_one Only on rank 1.\n"
              "# TYPE embps_only_one gauge\n"
              "embps_only_one 3\n";
  char *texts[] = {r0, r1};
  char *out = merged(texts, 2);
  (void)state;
  assert_string_equal(out, "# HELP embps_requests_total Requests.\n"
                           "# TYPE embps_requests_total counter\n"
                           "embps_requests_total{rank=\"0\",method=\"Lookup\"} 5\n"
                           "embps_requests_total{rank=\"0\",method=\"Push\"} 2\n"
                           "embps_requests_total{rank=\"1\",method=\"Lookup\"} 7\n"
                           "# HELP embps_up Up.\n"
                           "# TYPE embps_up gauge\n"
                           "embps_up{rank=\"0\"} 1\n"
                           "embps_up{rank=\"1\"} 0\n"
                           "# HELP embps_only_one Only on rank 1.\n"
                           "# TYPE embps_only_one gauge\n"
                           "embps_only_one{rank=\"1\"} 3\n");
  free(out);
}

static void test_one_rank_unchanged(void **state) {
  char r0[] = "# HELP embps_up Up.\n"
              "# TYPE embps_up gauge\n"
              "embps_up 1\n"
              "# HELP embps_bytes Bytes.\n"
              "# TYPE embps_bytes counter\n"
              "embps_bytes{dir=\"in\"} 10\n";
  char *texts[] = {r0};
  char *out = merged(texts, 1);
  (void)state;
  assert_string_equal(out, r0);
  free(out);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_ranks),
      cmocka_unit_test(test_one_rank_unchanged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
