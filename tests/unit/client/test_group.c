/* client/group.c: address lists and the padding/splitting of a batch over a group. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "client/group.h"
#include "common/alloc.h"

static void test_parse_servers_ok(void **state) {
  embps__addr_t *a;
  size_t n;
  embps_error_t err;
  (void)state;
  assert_int_equal(embps__parse_servers("127.0.0.1:7070", &a, &n, &err), EMBPS_OK);
  assert_int_equal(n, 1);
  assert_string_equal(a[0].host, "127.0.0.1");
  assert_string_equal(a[0].port, "7070");
  assert_string_equal(a[0].authority, "127.0.0.1:7070");
  embps_free(a);

  assert_int_equal(embps__parse_servers(" host-a:1 , [::1]:65535,b.example.com:80 ", &a, &n, &err),
                   EMBPS_OK);
  assert_int_equal(n, 3);
  assert_string_equal(a[0].host, "host-a");
  assert_string_equal(a[0].port, "1");
  assert_string_equal(a[1].host, "::1");
  assert_string_equal(a[1].port, "65535");
  assert_string_equal(a[1].authority, "[::1]:65535");
  assert_string_equal(a[2].host, "b.example.com");
  assert_string_equal(a[2].authority, "b.example.com:80");
  embps_free(a);
}

static void test_parse_servers_bad(void **state) {
  static const struct {
    const char *in;
    const char *msg;
  } bad[] = {
      {"", "empty server address"},
      {"host", "has no port"},
      {"host:", "bad port"},
      {":80", "empty host"},
      {"host:0", "bad port"},
      {"host:65536", "bad port"},
      {"host:80x", "bad port"},
      {"host:-1", "bad port"},
      {"a:1,", "empty server address"},
      {"a:1,,b:2", "empty server address"},
      {"::1:80", "[addr]:port"},
      {"[::1]80", "[ipv6]:port"},
      {"[::1]", "[ipv6]:port"},
      {"a b:80", "bad character"},
  };
  (void)state;
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    embps__addr_t *a = NULL;
    size_t n = 99;
    embps_error_t err;
    embps_error_clear(&err);
    assert_int_equal(embps__parse_servers(bad[i].in, &a, &n, &err), EMBPS_INVALID_ARGUMENT);
    assert_null(a); /* untouched */
    assert_int_equal(n, 99);
    if (!strstr(err.message, bad[i].msg))
      fail_msg("'%s': message '%s' lacks '%s'", bad[i].in, err.message, bad[i].msg);
  }
}

static void test_plan_requires_multiple(void **state) {
  embps__batch_plan_t p;
  embps_error_t err;
  (void)state;
  embps_error_clear(&err);
  assert_int_equal(embps__batch_plan(&p, 10, 4, 0, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message,
                         "tokens_per_batch=10 does not shard evenly over the 4-rank communicator"));
  assert_int_equal(embps__batch_plan(&p, 12, 4, 0, &err), EMBPS_OK);
  assert_int_equal(p.tokens_per_batch, 12);
  assert_int_equal(p.shard_tokens, 3);
  assert_int_equal(embps__batch_plan(&p, 7, 1, 0, &err), EMBPS_OK);
  assert_int_equal(p.shard_tokens, 7);
  assert_int_equal(embps__batch_plan(&p, 1ull << 33, 1, 0, &err), EMBPS_INVALID_ARGUMENT);
}

/* Every (n, N): the shards tile [0, T) contiguously, real tokens are exactly [0, n) in order,
 * padding is exactly T - n, and T is the least multiple of N >= n. */
static void test_split_and_pad_tiles(void **state) {
  (void)state;
  for (uint32_t g = 1; g <= 9; g++) {
    for (uint64_t n = 0; n <= 40; n++) {
      embps__batch_plan_t p;
      embps_error_t err;
      uint64_t next_real = 0, pad_total = 0;
      int seen_pad = 0;
      assert_int_equal(embps__batch_plan(&p, n, g, 1, &err), EMBPS_OK);
      assert_int_equal(p.tokens_per_batch % g, 0);
      assert_true(p.tokens_per_batch >= n && p.tokens_per_batch < n + g);
      assert_int_equal(p.shard_tokens * g, p.tokens_per_batch);
      for (uint32_t r = 0; r < g; r++) {
        uint64_t first, real, pad;
        embps__shard_range(&p, r, &first, &real, &pad);
        assert_int_equal(first, (uint64_t)r * p.shard_tokens);
        assert_int_equal(real + pad, p.shard_tokens);
        if (real > 0) {
          assert_false(seen_pad); /* padding only at the end */
          assert_int_equal(first, next_real);
          next_real += real;
        }
        if (pad > 0)
          seen_pad = 1;
        pad_total += pad;
      }
      assert_int_equal(next_real, n);
      assert_int_equal(pad_total, p.tokens_per_batch - n);
    }
  }
  /* a concrete case: 10 tokens over 4 ranks -> 12, shards of 3, the last has 1 real + 2 pad */
  {
    embps__batch_plan_t p;
    embps_error_t err;
    uint64_t first, real, pad;
    assert_int_equal(embps__batch_plan(&p, 10, 4, 1, &err), EMBPS_OK);
    embps__shard_range(&p, 3, &first, &real, &pad);
    assert_int_equal(first, 9);
    assert_int_equal(real, 1);
    assert_int_equal(pad, 2);
    embps__shard_range(&p, 2, &first, &real, &pad);
    assert_int_equal(first, 6);
    assert_int_equal(real, 3);
    assert_int_equal(pad, 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_servers_ok),
      cmocka_unit_test(test_parse_servers_bad),
      cmocka_unit_test(test_plan_requires_multiple),
      cmocka_unit_test(test_split_and_pad_tiles),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
