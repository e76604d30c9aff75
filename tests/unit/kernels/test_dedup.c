/* embps_dedup_cpu against references: O(n^2) search for small batches, qsort + binary search
 * for large ones. A result is checked completely: `unique` strictly ascending and equal to the
 * reference's distinct set, and unique[segment_ids[i]] == tokens[i] for every position. The
 * workspace is exactly embps_dedup_workspace_bytes(n), so ASan catches any overrun. */
#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Reference distinct set: sort a copy and squeeze. */
static size_t ref_unique_sorted(const int64_t *tokens, size_t n, int64_t *out) {
  if (n == 0)
    return 0;
  memcpy(out, tokens, n * sizeof(int64_t));
  qsort(out, n, sizeof(int64_t), cmp_i64);
  size_t u = 1;
  for (size_t i = 1; i < n; i++)
    if (out[i] != out[u - 1])
      out[u++] = out[i];
  return u;
}

/* Reference for small n: distinct count and, for each position, the number of distinct tokens
 * smaller than it (its index in the ascending unique list), by brute force. */
static size_t ref_quadratic(const int64_t *tokens, size_t n, uint32_t *seg) {
  size_t count = 0;
  for (size_t i = 0; i < n; i++) {
    int seen = 0;
    for (size_t j = 0; j < i; j++)
      seen |= tokens[j] == tokens[i];
    count += !seen;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t smaller = 0;
    for (size_t j = 0; j < n; j++) {
      if (tokens[j] >= tokens[i])
        continue;
      int first = 1;
      for (size_t k = 0; k < j; k++)
        first &= tokens[k] != tokens[j];
      smaller += (uint32_t)first;
    }
    seg[i] = smaller;
  }
  return count;
}

/* Runs the kernel and checks it against the qsort reference (and the quadratic one when n is
 * small); returns the distinct count. Also checks that a second run gives identical output. */
static size_t check_dedup(const int64_t *tokens, size_t n) {
  size_t ws_bytes = embps_dedup_workspace_bytes(n);
  void *ws = kt_alloc(ws_bytes);
  int64_t *unique = kt_alloc(n * sizeof(int64_t));
  uint32_t *seg = kt_alloc(n * sizeof(uint32_t));
  int64_t *ref = kt_alloc(n * sizeof(int64_t));

  for (size_t i = 0; i < n; i++)
    seg[i] = UINT32_MAX;
  size_t u = embps_dedup_cpu(tokens, n, unique, seg, ws);
  size_t ru = ref_unique_sorted(tokens, n, ref);
  assert_int_equal(u, ru);
  for (size_t k = 0; k < u; k++) {
    assert_true(unique[k] == ref[k]);
    if (k > 0)
      assert_true(unique[k - 1] < unique[k]);
  }
  for (size_t i = 0; i < n; i++) {
    assert_true(seg[i] < u);
    assert_true(unique[seg[i]] == tokens[i]);
  }

  if (n <= 300) {
    uint32_t *rseg = kt_alloc(n * sizeof(uint32_t));
    assert_int_equal(ref_quadratic(tokens, n, rseg), u);
    assert_memory_equal(rseg, seg, n * sizeof(uint32_t));
    free(rseg);
  }

  /* Determinism: a second run, on a dirtied workspace, gives the same bytes; the sorted form
   * gives them too, and each token's positions, ascending, at order[starts[u] .. starts[u + 1]). */
  int64_t *unique2 = kt_alloc(n * sizeof(int64_t));
  uint32_t *seg2 = kt_alloc(n * sizeof(uint32_t)), *order = kt_alloc(n * sizeof(uint32_t));
  uint32_t *starts = kt_alloc((n + 1) * sizeof(uint32_t));
  memset(ws, 0xa5, ws_bytes);
  assert_int_equal(embps_dedup_cpu(tokens, n, unique2, seg2, ws), u);
  assert_memory_equal(unique2, unique, u * sizeof(int64_t));
  assert_memory_equal(seg2, seg, n * sizeof(uint32_t));
  memset(ws, 0x5a, ws_bytes);
  memset(seg2, 0xff, n * sizeof(uint32_t));
  assert_int_equal(embps_dedup_sorted_cpu(tokens, n, unique2, seg2, order, starts, ws), u);
  assert_memory_equal(unique2, unique, u * sizeof(int64_t));
  assert_memory_equal(seg2, seg, n * sizeof(uint32_t));
  assert_int_equal(starts[0], 0);
  assert_int_equal(starts[u], n);
  for (size_t k = 0; k < u; k++) {
    assert_true(starts[k] < starts[k + 1]);
    for (uint32_t j = starts[k]; j < starts[k + 1]; j++) {
      assert_int_equal(seg[order[j]], k);
      if (j > starts[k])
        assert_true(order[j - 1] < order[j]);
    }
  }
  free(order);
  free(starts);

  free(unique2);
  free(seg2);
  free(ref);
  free(seg);
  free(unique);
  free(ws);
  return u;
}

static void test_empty_and_single(void **state) {
  (void)state;
  assert_int_equal(embps_dedup_workspace_bytes(0), 0);
  int64_t unique[1] = {-7};
  uint32_t seg[1] = {99};
  assert_int_equal(embps_dedup_cpu(NULL, 0, unique, seg, NULL), 0);
  assert_true(unique[0] == -7 && seg[0] == 99); /* nothing written */

  int64_t one[1] = {123456789};
  assert_int_equal(check_dedup(one, 1), 1);
  int64_t zero[1] = {0};
  assert_int_equal(check_dedup(zero, 1), 1);
}

static void test_small_examples(void **state) {
  (void)state;
  int64_t t[] = {5, 0, 5, 3, 0, 9, 3, 5};
  int64_t unique[8];
  uint32_t seg[8];
  void *ws = kt_alloc(embps_dedup_workspace_bytes(8));
  assert_int_equal(embps_dedup_cpu(t, 8, unique, seg, ws), 4);
  int64_t want_u[] = {0, 3, 5, 9};
  uint32_t want_s[] = {2, 0, 2, 1, 0, 3, 1, 2};
  assert_memory_equal(unique, want_u, sizeof(want_u));
  assert_memory_equal(seg, want_s, sizeof(want_s));
  free(ws);

  int64_t two[] = {2, 1};
  assert_int_equal(check_dedup(two, 2), 2);
  int64_t same2[] = {1, 1};
  assert_int_equal(check_dedup(same2, 2), 1);
}

static void test_all_same(void **state) {
  (void)state;
  size_t n = 5000;
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    t[i] = INT64_C(1) << 40;
  assert_int_equal(check_dedup(t, n), 1);
  for (size_t i = 0; i < n; i++)
    t[i] = 0; /* a batch of padding only */
  assert_int_equal(check_dedup(t, n), 1);
  free(t);
}

static void test_all_distinct(void **state) {
  (void)state;
  kt_rng_t rng = {1};
  size_t n = 4096;
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  /* Descending, ascending, then a random permutation of distinct values. */
  for (size_t i = 0; i < n; i++)
    t[i] = (int64_t)(n - i) * 3;
  assert_int_equal(check_dedup(t, n), n);
  for (size_t i = 0; i < n; i++)
    t[i] = (int64_t)i;
  assert_int_equal(check_dedup(t, n), n);
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)kt_below(&rng, i + 1);
    int64_t x = t[i];
    t[i] = t[j];
    t[j] = x;
  }
  for (size_t i = 0; i < n; i++)
    t[i] = t[i] * 1000003 + 17; /* distinct, spread over more bytes */
  assert_int_equal(check_dedup(t, n), n);
  free(t);
}

static void test_heavy_duplication(void **state) {
  (void)state;
  kt_rng_t rng = {2};
  size_t n = 100000, distinct = 50;
  int64_t vocab[50];
  for (size_t k = 0; k < distinct; k++)
    vocab[k] = (int64_t)(kt_next(&rng) >> 24); /* 40-bit ids */
  vocab[7] = 0;                                /* padding among them */
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    t[i] = vocab[kt_below(&rng, distinct)];
  assert_int_equal(check_dedup(t, n), distinct);
  free(t);
}

static void test_padding_present(void **state) {
  (void)state;
  kt_rng_t rng = {3};
  size_t n = 1000;
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    t[i] = i % 3 == 0 ? 0 : (int64_t)(1 + kt_below(&rng, 200));
  size_t u = check_dedup(t, n);
  assert_true(u > 100);
  free(t);
}

static void test_large_tokens(void **state) {
  (void)state;
  kt_rng_t rng = {4};
  /* Ids up to 2^62 with small ones mixed in: the key range needs 62 bits, so with more than
   * a few positions the (key, position) pair no longer packs into 64 bits. Both sizes run. */
  size_t sizes[] = {3, 100, 20000};
  for (size_t s = 0; s < 3; s++) {
    size_t n = sizes[s];
    int64_t *t = kt_alloc(n * sizeof(int64_t));
    for (size_t i = 0; i < n; i++) {
      uint64_t r = kt_below(&rng, 4);
      t[i] = r == 0   ? (int64_t)kt_below(&rng, 16)
             : r == 1 ? (INT64_C(1) << 62) - (int64_t)kt_below(&rng, 3)
                      : (int64_t)(kt_next(&rng) >> 2) /* [0, 2^62) */;
    }
    t[0] = INT64_C(1) << 62;
    t[n - 1] = 0;
    check_dedup(t, n);
    free(t);
  }
  /* Values differing only in high bytes (low bytes equal): passes over the low bytes are
   * skipped and the high ones must still sort. */
  size_t n = 300;
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++)
    t[i] = ((int64_t)kt_below(&rng, 40) << 48) | 0x1234;
  check_dedup(t, n);
  free(t);
}

static void test_negative_and_extremes(void **state) {
  (void)state;
  int64_t t[] = {INT64_MAX, -1, 0, INT64_MIN, 1, -1, INT64_MAX, INT64_MIN, 42, -42};
  assert_int_equal(check_dedup(t, 10), 7);
}

static void test_random_small(void **state) {
  (void)state;
  kt_rng_t rng = {5};
  int64_t t[200];
  for (int iter = 0; iter < 300; iter++) {
    size_t n = 1 + (size_t)kt_below(&rng, 200);
    uint64_t alphabet = 1 + kt_below(&rng, 64);
    int shift = (int)kt_below(&rng, 50);
    for (size_t i = 0; i < n; i++)
      t[i] = (int64_t)(kt_below(&rng, alphabet) << shift);
    check_dedup(t, n);
  }
}

/* Hashed 64-bit ids, as a hash-keyed table's pushes carry: the pair of key and position does not
 * fit in 64 bits, so the kernel sorts on the keys' top bits and then orders each run of equal
 * top bits by the full keys. Runs here: repeats of one key (Zipf-like draws), and long runs of
 * keys that differ only in their low bits (a block of consecutive ids far from the others), in
 * and out of order. */
static void test_wide_keys(void **state) {
  (void)state;
  kt_rng_t rng = {8};
  const size_t sizes[] = {2, 17, 4096, 65536};
  for (size_t s = 0; s < 4; s++) {
    const size_t n = sizes[s];
    int64_t *t = kt_alloc(n * sizeof(int64_t));
    for (int shape = 0; shape < 3; shape++) {
      for (size_t i = 0; i < n; i++) {
        const double u = kt_unit(&rng);
        const uint64_t rank = (uint64_t)(1e6 * u * u * u * u);
        uint64_t k = kt_next(&(kt_rng_t){rank}); /* a hash of the rank */
        if (shape >= 1 && i % 3 == 0) /* consecutive ids near 2^63, descending or at random */
          k = (UINT64_C(1) << 63) + (shape == 1 ? n - i : kt_below(&rng, n / 2 + 1));
        t[i] = i % 11 == 5 ? 0 : (int64_t)k;
      }
      t[0] = INT64_MIN, t[n - 1] = INT64_MAX; /* the widest range */
      check_dedup(t, n);
    }
    free(t);
  }
}

/* A 1M-token batch with Zipf-like skew (token = floor(V * u^4)), the production shape. */
static void test_zipf_1m(void **state) {
  (void)state;
  kt_rng_t rng = {6};
  size_t n = 1u << 20;
  int64_t *t = kt_alloc(n * sizeof(int64_t));
  for (size_t i = 0; i < n; i++) {
    double u = kt_unit(&rng);
    t[i] = (int64_t)(1e8 * u * u * u * u);
  }
  size_t u = check_dedup(t, n);
  assert_true(u > 1000 && u < n);
  free(t);
}

/* The counting form in parts (the CPU engine's threads share a big push's dedup): for 1 to 4
 * parts, counted and placed in any order, the same unique, starts, segment ids and order as
 * embps_dedup_sorted_cpu, which check_dedup holds to the references; a span of 2n or more keys
 * does not take it. */
static void test_counting_parts(void **state) {
  (void)state;
  kt_rng_t rng = {11};
  const size_t sizes[] = {1, 2, 7, 300, 4096, 50000};
  for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
    const size_t n = sizes[si];
    int64_t *t = kt_alloc(n * sizeof(int64_t)), *u1 = kt_alloc(n * sizeof(int64_t));
    int64_t *u2 = kt_alloc(n * sizeof(int64_t));
    uint32_t *s1 = kt_alloc(n * sizeof(uint32_t)), *s2 = kt_alloc(n * sizeof(uint32_t));
    uint32_t *o1 = kt_alloc(n * sizeof(uint32_t)), *o2 = kt_alloc(n * sizeof(uint32_t));
    uint32_t *st1 = kt_alloc((n + 1) * sizeof(uint32_t)),
             *st2 = kt_alloc((n + 1) * sizeof(uint32_t));
    const size_t ws_bytes = embps_dedup_workspace_bytes(n);
    void *ws = kt_alloc(ws_bytes);
    const int64_t base = (int64_t)(kt_next(&rng) % 1000), span = 1 + (int64_t)(n + n / 2);
    uint64_t kmin;
    size_t range, u;
    for (size_t i = 0; i < n; i++)
      t[i] = base + (int64_t)(kt_next(&rng) % (uint64_t)span);
    check_dedup(t, n);
    u = embps_dedup_sorted_cpu(t, n, u1, s1, o1, st1, ws);
    for (size_t parts = 1; parts <= 4; parts++) {
      if (!embps_dedup_counting_cpu(t, n, parts, &kmin, &range))
        continue;
      assert_true(range <= 2 * n);
      uint32_t *counts = ws, *seg = counts + parts * range;
      memset(u2, 0, n * sizeof(int64_t));
      memset(s2, 0xff, n * sizeof(uint32_t));
      for (size_t p = parts; p-- > 0;)
        embps_dedup_count_cpu(t, n * p / parts, n * (p + 1) / parts, kmin, range,
                              counts + p * range);
      assert_int_equal(embps_dedup_buckets_cpu(counts, parts, range, kmin, u2, st2, seg), u);
      for (size_t p = parts; p-- > 0;)
        embps_dedup_place_cpu(t, n * p / parts, n * (p + 1) / parts, kmin, counts + p * range, seg,
                              s2, o2);
      assert_memory_equal(u2, u1, u * sizeof(int64_t));
      assert_memory_equal(st2, st1, (u + 1) * sizeof(uint32_t));
      assert_memory_equal(s2, s1, n * sizeof(uint32_t));
      assert_memory_equal(o2, o1, n * sizeof(uint32_t));
    }
    t[0] = base + 2 * (int64_t)n + 1; /* a span of more than 2n keys */
    t[n - 1] = n > 1 ? base : t[0];
    assert_int_equal(embps_dedup_counting_cpu(t, n, 1, &kmin, &range), n == 1);
    free(t), free(u1), free(u2), free(s1), free(s2), free(o1), free(o2), free(st1), free(st2);
    free(ws);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty_and_single),  cmocka_unit_test(test_small_examples),
      cmocka_unit_test(test_all_same),          cmocka_unit_test(test_all_distinct),
      cmocka_unit_test(test_heavy_duplication), cmocka_unit_test(test_padding_present),
      cmocka_unit_test(test_large_tokens),      cmocka_unit_test(test_negative_and_extremes),
      cmocka_unit_test(test_random_small),      cmocka_unit_test(test_zipf_1m),
      cmocka_unit_test(test_wide_keys),         cmocka_unit_test(test_counting_parts),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
