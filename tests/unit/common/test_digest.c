/* The batch digest (common/digest.c) against its definition in docs/design.md ("A batch's
 * identity"), computed by another implementation: the test lays the defined bytes out itself
 * (magic, name length and name, T, tokens, all little-endian), writes them to a temporary file
 * and compares embps_batch_digest() with what `xxhsum -H3 FILE` (Debian's xxhash package, the
 * reference implementation's tool) prints for it. Also: a constant for an empty batch (so the
 * definition cannot drift even where xxhsum is missing), the padded variant equal to the digest
 * of the padded array, and sensitivity to every input. Without xxhsum the other tests run and
 * the program exits 77 (skipped) after them, saying why. The feature batch's digest
 * (embps_features_digest) is held to its definition the same way: its bytes laid out here,
 * padded samples' lengths as zeros, weights for weighted sum only. */
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

/* ---- feature batches (docs/design.md, "Feature batches", the digest) ---- */

/* Appends v as n little-endian bytes. */
static size_t put_le(uint8_t *out, uint64_t v, int n) {
  for (int i = 0; i < n; i++)
    out[i] = (uint8_t)(v >> (8 * i));
  return (size_t)n;
}

/* The defined input bytes of a feature batch, laid out here byte by byte: the lengths padded to
 * B with zeros, the weights only for weighted sum (pooling 3). */
static size_t defined_feature_bytes(uint8_t *out, uint32_t B, const embps_digest_feature_t *f,
                                    uint32_t n) {
  size_t at = 0;
  memcpy(out, "embps-features-v1", 17);
  at = 17;
  at += put_le(out + at, B, 4);
  at += put_le(out + at, n, 4);
  for (uint32_t k = 0; k < n; k++) {
    size_t nl = strlen(f[k].name), tl = strlen(f[k].table);
    at += put_le(out + at, nl, 4);
    memcpy(out + at, f[k].name, nl);
    at += nl;
    at += put_le(out + at, tl, 4);
    memcpy(out + at, f[k].table, tl);
    at += tl;
    at += put_le(out + at, f[k].pooling, 4);
    at += put_le(out + at, f[k].num_ids, 8);
    for (uint64_t i = 0; i < f[k].num_ids; i++)
      at += put_le(out + at, (uint64_t)f[k].ids[i], 8);
    for (uint32_t b = 0; b < B; b++)
      at += put_le(out + at, b < f[k].num_lengths ? f[k].lengths[b] : 0, 4);
    if (f[k].pooling == 3)
      for (uint64_t i = 0; i < f[k].num_ids; i++) {
        uint32_t w;
        memcpy(&w, &f[k].weights[i], 4);
        at += put_le(out + at, w, 4);
      }
  }
  return at;
}

/* Three features (sum, weighted sum, none; two on one table) of B samples, the last `pad` of them
 * padding: their lengths are not given (num_lengths = B - pad), and must hash as empty bags. */
static void test_features_against_xxhsum(void **state) {
  static const uint32_t Bs[] = {1, 4, 12, 300};
  int64_t *ids = malloc(8 * 4000);
  uint32_t *lengths = malloc(4 * 3 * 300);
  float *weights = malloc(4 * 4000);
  uint8_t *bytes = malloc(200 + 3 * (4 * 300 + 12 * 4000));
  (void)state;
  if (!g_have_xxhsum)
    skip();
  assert_non_null(ids);
  assert_non_null(lengths);
  assert_non_null(weights);
  assert_non_null(bytes);
  for (size_t bi = 0; bi < sizeof(Bs) / sizeof(Bs[0]); bi++)
    for (uint32_t pad = 0; pad < 3 && pad < Bs[bi]; pad++) {
      uint32_t B = Bs[bi];
      embps_digest_feature_t f[3] = {{"clicks", "dense", 1, NULL, 0, NULL, 0, NULL},
                                     {"cats", "half", 3, NULL, 0, NULL, 0, NULL},
                                     {"raw", "dense", 0, NULL, 0, NULL, 0, NULL}};
      uint64_t at = 0;
      for (int k = 0; k < 3; k++) {
        uint32_t *len = lengths + k * 300;
        uint64_t n = 0;
        for (uint32_t b = 0; b < B - pad; b++)
          n += len[b] = (uint32_t)(rnd_token() & 7) * (b % 5 != 3); /* empty bags too */
        for (uint64_t i = 0; i < n; i++) {
          ids[at + i] = i % 4 == 0 ? 0 : rnd_token(); /* padding ids, negative keys */
          weights[at + i] = (float)(rnd_token() % 1000) / 7.0f;
        }
        f[k].ids = ids + at;
        f[k].num_ids = n;
        f[k].lengths = len;
        f[k].num_lengths = B - pad;
        f[k].weights = f[k].pooling == 3 ? weights + at : NULL;
        at += n;
      }
      size_t nb = defined_feature_bytes(bytes, B, f, 3);
      uint64_t want = xxhsum(bytes, nb);
      if (want == 0)
        want = 1;
      if (embps_features_digest(B, f, 3) != want)
        fail_msg("B=%u pad=%u: the feature digest differs from xxhsum -H3", B, pad);
    }
  free(ids);
  free(lengths);
  free(weights);
  free(bytes);
}

/* Every input moves the feature digest; weights count for weighted sum only; lengths past the
 * given ones are zeros (the same as giving them). */
static void test_features_sensitivity(void **state) {
  int64_t ids[4] = {5, 0, 7, 9}, ids2[4] = {5, 0, 9, 7};
  uint32_t len[3] = {2, 0, 2}, len2[3] = {1, 1, 2}, len0[4] = {2, 0, 2, 0};
  float w[4] = {1, 2, 3, 4}, w2[4] = {1, 2, 3, 5};
  embps_digest_feature_t f = {"f", "t", 3, ids, 4, len, 3, w}, g;
  uint64_t d = embps_features_digest(3, &f, 1);
  (void)state;
  assert_true(d != 0 && d == embps_features_digest(3, &f, 1));
  g = f, g.name = "g";
  assert_true(d != embps_features_digest(3, &g, 1));
  g = f, g.table = "u";
  assert_true(d != embps_features_digest(3, &g, 1));
  g = f, g.ids = ids2;
  assert_true(d != embps_features_digest(3, &g, 1));
  g = f, g.lengths = len2;
  assert_true(d != embps_features_digest(3, &g, 1));
  g = f, g.weights = w2;
  assert_true(d != embps_features_digest(3, &g, 1));
  g = f, g.pooling = 1;
  assert_true(d != embps_features_digest(3, &g, 1));
  {
    uint64_t sum = embps_features_digest(3, &g, 1);
    g.weights = w2;
    assert_true(sum == embps_features_digest(3, &g, 1)); /* sum: weights unread */
  }
  assert_true(d != embps_features_digest(4, &f, 1)); /* B */
  g = f, g.lengths = len0, g.num_lengths = 4;
  assert_true(embps_features_digest(4, &f, 1) == embps_features_digest(4, &g, 1));
  assert_true(d != embps_features_digest(3, &f, 0));
  g = f, g.name = "ft", g.table = "";
  f.table = "tt";
  assert_true(embps_features_digest(3, &f, 1) != embps_features_digest(3, &g, 1));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty_batch_constant),
      cmocka_unit_test(test_against_xxhsum),
      cmocka_unit_test(test_padded_equals_padded_array),
      cmocka_unit_test(test_sensitivity),
      cmocka_unit_test(test_features_against_xxhsum),
      cmocka_unit_test(test_features_sensitivity),
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
