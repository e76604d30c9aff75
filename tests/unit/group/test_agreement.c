/* server/group/agreement.c: the configuration comparison, the acceptor's judgement of a hello
 * and the device-claim check, as pure functions, with the messages users see (the group tests
 * look for the same words from real processes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "server/group/agreement.h"
#include "server/group/bootstrap.h"
#include "server/group/control.h"
#include "server/group/group.h"

#define HERE "version=0.1.0\nmesh=shard=4\ntable_axis=shard\ndata_axis=shard\npeers=a:1,b:1\n"
#define ADDR "10.0.0.7:41234" /* where the judged connection comes from */

static void assert_contains(const char *msg, const char *part) {
  if (!strstr(msg, part))
    fail_msg("'%s' does not contain '%s'", msg, part);
}

static void test_identity_format(void **state) {
  char out[256];
  (void)state;
  char want[256];
  assert_int_equal(embps_group_identity_format(out, sizeof(out), "0.1.0", "shard=4", "shard",
                                               "shard", "a:1,b:1"),
                   EMBPS_OK);
  /* The control protocol's version is part of it: a rank whose frames differ is refused. */
  snprintf(want, sizeof(want),
           "version=0.1.0\ncontrol=%u\nmesh=shard=4\ntable_axis=shard\ndata_axis=shard\n"
           "peers=a:1,b:1\n",
           (unsigned)EMBPS__CONTROL_VERSION);
  assert_string_equal(out, want);
  assert_int_equal(
      embps_group_identity_format(out, 10, "0.1.0", "shard=4", "shard", "shard", "a:1"),
      EMBPS_INVALID_ARGUMENT);
}

static void test_identity_agrees(void **state) {
  char why[512] = "";
  (void)state;
  assert_int_equal(embps__identity_differs(HERE, 0, HERE, 1, why, sizeof(why)), 0);
  /* Other order, blank lines, no final newline: the same configuration. */
  assert_int_equal(embps__identity_differs(HERE, 0,
                                           "peers=a:1,b:1\n\ndata_axis=shard\nversion=0.1.0\n"
                                           "table_axis=shard\nmesh=shard=4",
                                           1, why, sizeof(why)),
                   0);
  assert_string_equal(why, "");
}

static void test_identity_differs(void **state) {
  char why[512];
  (void)state;
  assert_int_equal(
      embps__identity_differs(HERE, 0,
                              "version=0.1.0\nmesh=shard=2\ntable_axis=shard\ndata_axis=shard\n"
                              "peers=a:1,b:1\n",
                              1, why, sizeof(why)),
      1);
  assert_string_equal(why, "rank 1's configuration differs from rank 0's: mesh is 'shard=2' "
                           "there and 'shard=4' here");
  /* A key missing there, then a key only there. */
  assert_int_equal(embps__identity_differs(HERE, 0,
                                           "version=0.1.0\nmesh=shard=4\ntable_axis=shard\n"
                                           "peers=a:1,b:1\n",
                                           2, why, sizeof(why)),
                   1);
  assert_contains(why, "rank 2's configuration differs from rank 0's: data_axis is not set there "
                       "and 'shard' here");
  assert_int_equal(embps__identity_differs(HERE, 1, HERE "extra=1\n", 3, why, sizeof(why)), 1);
  assert_contains(why, "extra is '1' there and not set here");
  /* For a key given twice, the first line counts. */
  assert_int_equal(embps__identity_differs(HERE, 0, "mesh=shard=4\n" HERE, 1, why, sizeof(why)), 0);
  assert_int_equal(embps__identity_differs(HERE, 0, "mesh=x\n" HERE, 1, why, sizeof(why)), 1);
}

static void test_identity_values_clipped(void **state) {
  char there[1200], why[512];
  (void)state;
  int n = snprintf(there, sizeof(there),
                   "version=0.1.0\nmesh=shard=4\ntable_axis=shard\n"
                   "data_axis=shard\npeers=");
  memset(there + n, 'p', 900);
  there[n + 900] = '\0';
  assert_int_equal(embps__identity_differs(HERE, 0, there, 1, why, sizeof(why)), 1);
  assert_contains(why, "peers is 'pppp");
  assert_contains(why, "...' there and 'a:1,b:1' here");
  assert_true(strlen(why) < 300);
}

static void test_judge_hello(void **state) {
  int control[4] = {-1, -1, -1, -1}, data[4] = {-1, -1, -1, -1};
  embps__hello_t h = {
      .kind = EMBPS_GROUP_CONN_CONTROL, .rank = 2, .size = 4, .identity_len = sizeof(HERE) - 1};
  char why[512];
  (void)state;
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   0);
  h.size = 3;
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   1);
  assert_string_equal(why, "rank 2's group size differs from rank 1's: size is 3 there and 4 "
                           "here");
  h.size = 4;
  h.kind = 7;
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   1);
  assert_contains(why, "unknown kind 7");
  h.kind = EMBPS_GROUP_CONN_DATA;
  h.rank = 1; /* only higher ranks connect */
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   1);
  assert_contains(why, "where only ranks 2..3 connect; do two processes have the same rank?");
  h.rank = 4;
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   1);
  h.rank = 3;
  data[3] = 9; /* rank 3's data connection is already here */
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   1);
  assert_string_equal(why, "rank 3 opened a second data connection to rank 1; is rank 3 running "
                           "twice?");
  h.kind = EMBPS_GROUP_CONN_CONTROL; /* but not its control connection */
  assert_int_equal(embps__judge_hello(1, 4, HERE, &h, HERE, ADDR, control, data, why, sizeof(why)),
                   0);
  assert_int_equal(
      embps__judge_hello(1, 4, HERE, &h, "version=0.2.0\n", ADDR, control, data, why, sizeof(why)),
      1);
  assert_contains(why, "rank 3's configuration differs from rank 1's: version is '0.2.0' there");
}

/* One rank with a group secret and one without: the README's words ("rank 1 at HOST:PORT failed
 * the group secret check"), whichever side has it, with both values and the remedy, and ahead of
 * any other difference; two ranks with secrets are a plain difference. */
static void test_judge_hello_secret(void **state) {
  int control[2] = {-1, -1}, data[2] = {-1, -1};
  embps__hello_t h = {.kind = EMBPS_GROUP_CONN_CONTROL, .rank = 1, .size = 2};
  char why[512];
  (void)state;
  assert_int_equal(embps__judge_hello(0, 2, HERE "group_secret=hmac-sha256\n", &h,
                                      HERE "group_secret=none\n", ADDR, control, data, why,
                                      sizeof(why)),
                   1);
  assert_string_equal(why, "rank 1 at 10.0.0.7:41234 failed the group secret check: it has no "
                           "group secret and rank 0 has one (group_secret is 'none' there and "
                           "'hmac-sha256' here); start every rank with the same "
                           "--group-secret-file");
  assert_int_equal(embps__judge_hello(0, 2, HERE "group_secret=none\n", &h,
                                      "version=9\ngroup_secret=hmac-sha256\n", ADDR, control, data,
                                      why, sizeof(why)),
                   1);
  assert_string_equal(why, "rank 1 at 10.0.0.7:41234 failed the group secret check: it has a "
                           "group secret and rank 0 has none (group_secret is 'hmac-sha256' "
                           "there and 'none' here); start every rank with the same "
                           "--group-secret-file");
  assert_int_equal(embps__judge_hello(0, 2, HERE "group_secret=hmac-sha256\n", &h,
                                      HERE "group_secret=hmac-sha512\n", ADDR, control, data, why,
                                      sizeof(why)),
                   1);
  assert_contains(why, "rank 1's configuration differs from rank 0's: group_secret is "
                       "'hmac-sha512' there and 'hmac-sha256' here");
  assert_int_equal(embps__judge_hello(0, 2, HERE "group_secret=none\n", &h,
                                      HERE "group_secret=none\n", ADDR, control, data, why,
                                      sizeof(why)),
                   0);
}

static void test_claims(void **state) {
  embps__device_claim_t c[4] = {
      {.host = "node-a", .bus_id = "0000:18:00.0", .device = 0},
      {.host = "node-a", .bus_id = "0000:28:00.0", .device = 1},
      {.host = "node-b", .bus_id = "0000:18:00.0", .device = 0}, /* another host: fine */
      {.host = "node-b", .bus_id = "0000:28:00.0", .device = 1},
  };
  char why[512] = "";
  (void)state;
  assert_int_equal(embps__claims_conflict(c, 4, why, sizeof(why)), 0);
  assert_int_equal(embps__claims_conflict(c, 1, why, sizeof(why)), 0);
  c[3] = c[2];
  assert_int_equal(embps__claims_conflict(c, 4, why, sizeof(why)), 1);
  assert_string_equal(why, "ranks 2 and 3 both claim CUDA device 0 (PCI 0000:18:00.0) on host "
                           "node-b: give each rank its own device with --device or EMBPS_DEVICE");
  /* The first pair in rank order is named. */
  c[1] = c[0];
  assert_int_equal(embps__claims_conflict(c, 4, why, sizeof(why)), 1);
  assert_contains(why, "ranks 0 and 1 both claim");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_identity_format),  cmocka_unit_test(test_identity_agrees),
      cmocka_unit_test(test_identity_differs), cmocka_unit_test(test_identity_values_clipped),
      cmocka_unit_test(test_judge_hello),      cmocka_unit_test(test_judge_hello_secret),
      cmocka_unit_test(test_claims),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
