/* The batch digest (common/digest.c) against its definition in docs/design.md ("A batch's
 * identity"), computed by another implementation: the test lays the defined bytes out itself
 * (magic, name length and name, T, tokens, all little-endian), writes them to a temporary file
 * and compares embps_batch_digest() with what `xxhsum -H3 FILE` (Debian's xxhash package, the
 * reference implementation's tool) prints for it. Also: a constant for an empty batch (so the
 * definition cannot drift even where xxhsum is missing), the padded variant equal to the digest
 * of the padded array, and sensitivity to every input. Without xxhsum the other tests run and
 * the program exits 77 (skipped) after them, saying why. */
#define _DEFAULT_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/digest.h"

static int g_have_xxhsum;

/* The defined input bytes of a batch, laid out here byte by byte (not by digest.c). */
static size_t defined_bytes(uint8_t *out, const char *table, uint32_t t, const int64_t *tokens) {
  size_t n = 0, len = strlen(table);
  memcpy(out, "embps-batch-v1", 14);
  n = 14;
  for (int i = 0; i < 4; i++)
    out[n++] = (uint8_t)(len >> (8 * i));
  memcpy(out + n, table, len);
  n += len;
  for (int i = 0; i < 4; i++)
    out[n++] = (uint8_t)(t >> (8 * i));
  for (uint32_t k = 0; k < t; k++)
    for (int i = 0; i < 8; i++)
      out[n++] = (uint8_t)((uint64_t)tokens[k] >> (8 * i));
  return n;
}

/* XXH3-64 of bytes[0, n) by `xxhsum -H3`. */
static uint64_t xxhsum(const uint8_t *bytes, size_t n) {
  char path[] = "/tmp/embps_digest_XXXXXX";
  char cmd[128], line[512];
  uint64_t v = 0;
  int found = 0;
  int fd = mkstemp(path);
  FILE *p;
  assert_true(fd >= 0);
  assert_int_equal(write(fd, bytes, n), (ssize_t)n);
  close(fd);
  snprintf(cmd, sizeof(cmd), "xxhsum -H3 %s", path);
  p = popen(cmd, "r");
  assert_non_null(p);
  /* 0.8.1 prints "XXH3 (FILE) = HEX", others "HEX  FILE": take the 16-hex-digit word. */
  while (fgets(line, sizeof(line), p)) {
    for (char *w = strtok(line, " \t\n()="); w; w = strtok(NULL, " \t\n()="))
      if (strlen(w) == 16 && strspn(w, "0123456789abcdef") == 16) {
        v = strtoull(w, NULL, 16);
        found = 1;
      }
  }
  assert_int_equal(pclose(p), 0);
  unlink(path);
  if (!found)
    fail_msg("xxhsum -H3 printed no 16-digit hash");
  return v;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int64_t rnd_token(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (int64_t)rng;
}

static void test_empty_batch_constant(void **state) {
  (void)state;
  /* xxhsum -H3 over "embps-batch-v1" 03000000 "emb" 00000000 (and python3-xxhash agrees) */
  assert_true(embps_batch_digest("emb", 0, NULL) == 0xba92092d252f55c3ull);
  assert_true(embps_batch_digest_padded("emb", 0, NULL, 0) == 0xba92092d252f55c3ull);
}

static void test_against_xxhsum(void **state) {
  static const char *tables[] = {"", "emb", "a-table-name-of-some-length_0123456789"};
  static const uint32_t sizes[] = {0, 1, 2, 3, 7, 16, 31, 100, 1000, 4096};
  uint8_t *bytes = malloc(64 + 8 * 4096);
  int64_t *tokens = malloc(8 * 4096);
  (void)state;
  if (!g_have_xxhsum)
    skip();
  assert_non_null(bytes);
  assert_non_null(tokens);
  for (size_t ti = 0; ti < sizeof(tables) / sizeof(tables[0]); ti++)
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
      uint32_t t = sizes[si];
      for (uint32_t k = 0; k < t; k++)
        tokens[k] = k % 3 == 0 ? (int64_t)k : rnd_token(); /* negative ones too */
      size_t n = defined_bytes(bytes, tables[ti], t, tokens);
      uint64_t want = xxhsum(bytes, n);
      if (want == 0)
        want = 1;
      if (embps_batch_digest(tables[ti], t, tokens) != want)
        fail_msg("table '%s' T=%u: digest differs from xxhsum -H3", tables[ti], t);
    }
  free(bytes);
  free(tokens);
}

/* Padding is token 0 after the caller's n tokens: the same digest as the padded array, for
 * padding longer than digest.c's block of zeros too. */
static void test_padded_equals_padded_array(void **state) {
  static const uint32_t sizes[] = {1, 4, 255, 256, 257, 3000};
  int64_t *tokens = calloc(3000, sizeof(int64_t));
  (void)state;
  assert_non_null(tokens);
  for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
    uint32_t t = sizes[si];
    for (uint64_t n = 0; n <= t; n += (t / 5) + 1) {
      memset(tokens, 0, sizeof(int64_t) * t);
      for (uint64_t k = 0; k < n; k++)
        tokens[k] = rnd_token();
      assert_true(embps_batch_digest_padded("p", t, tokens, n) ==
                  embps_batch_digest("p", t, tokens));
    }
    /* n past T counts as T */
    assert_true(embps_batch_digest_padded("p", t, tokens, (uint64_t)t + 9) ==
                embps_batch_digest("p", t, tokens));
  }
  free(tokens);
}

/* Every input moves the digest: a token, the order of two tokens, the table, T with the same
 * bytes (the name/length boundary), and the shard boundary does not exist in it. */
static void test_sensitivity(void **state) {
  int64_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 4, 3}, c[4] = {1, 2, 3, 5};
  uint64_t d = embps_batch_digest("t", 4, a);
  (void)state;
  assert_true(d != 0);
  assert_true(d != embps_batch_digest("t", 4, b));
  assert_true(d != embps_batch_digest("t", 4, c));
  assert_true(d != embps_batch_digest("u", 4, a));
  assert_true(d != embps_batch_digest("t", 3, a));
  assert_true(embps_batch_digest("ab", 0, NULL) != embps_batch_digest("a", 0, NULL));
  assert_true(embps_batch_digest(NULL, 0, NULL) == embps_batch_digest("", 0, NULL));
  assert_true(d == embps_batch_digest("t", 4, a)); /* deterministic */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty_batch_constant),
      cmocka_unit_test(test_against_xxhsum),
      cmocka_unit_test(test_padded_equals_padded_array),
      cmocka_unit_test(test_sensitivity),
  };
  int rc;
  g_have_xxhsum = system("xxhsum --version >/dev/null 2>&1") == 0;
  rc = cmocka_run_group_tests(tests, NULL, NULL);
  if (rc == 0 && !g_have_xxhsum) {
    fprintf(stderr, "skipped: xxhsum (Debian package xxhash) is not installed, so the digest "
                    "was not compared with the reference tool\n");
    return 77;
  }
  return rc;
}
