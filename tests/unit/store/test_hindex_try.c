/* A tried step of the hash-keyed table's index (embps_hindex_try_step, embps_hindex_settle):
 * over long random sequences for every policy, admit_after 1 and 3, with collisions, full
 * tables, expiry and LFU renormalisation, an index whose steps are tried (and then kept or
 * undone at random) stays bit for bit the index that took only the kept steps with
 * embps_hindex_step: the whole arena (map, keys, scores, victim order, free stack, sketch,
 * change tracking) and every header field, compared after every step, and the same slots and
 * fresh lists. A log call missing from any write of a step makes the undone index differ. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/store/hindex_internal.h"

#define MAXN 200
#define GOLDEN UINT64_C(0x9e3779b97f4a7c15)

static uint64_t rng_next(uint64_t *s) { return embps__hix_mix(*s += GOLDEN); }

static uint64_t key_of(uint64_t rank) {
  uint64_t k = embps__hix_mix(rank * 0x1234567ULL + 77);
  return k ? k : 1;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Every bit of state two indexes of one configuration hold. */
static void assert_same(const embps_hindex_t *a, const embps_hindex_t *b) {
  assert_int_equal(a->arena_bytes, b->arena_bytes);
  assert_memory_equal(a->arena, b->arena, a->arena_bytes);
  assert_memory_equal(&a->st, &b->st, sizeof(a->st));
  assert_int_equal(a->nheap, b->nheap);
  assert_int_equal(a->nfree, b->nfree);
  assert_int_equal(a->low_free, b->low_free);
  assert_int_equal(a->base, b->base);
  assert_int_equal(a->head, b->head);
  assert_int_equal(a->tail, b->tail);
  assert_memory_equal(&a->cap_st, &b->cap_st, sizeof(a->cap_st));
  assert_int_equal(a->cap_base, b->cap_base);
}

static embps_hindex_config_t config(uint64_t capacity, embps_hindex_policy_t policy, uint32_t k) {
  embps_hindex_config_t c;
  memset(&c, 0, sizeof(c));
  c.capacity = capacity;
  c.policy = policy;
  c.admit_after = k;
  c.sketch_width = k > 1 ? 16 : 0;
  c.half_life = policy == EMBPS_HINDEX_LFU ? 2 : 0; /* renormalises every ~60 steps */
  c.ttl_steps = policy == EMBPS_HINDEX_TTL ? 6 : 0;
  c.seed = 0x7e57 + (uint64_t)policy * 10 + k;
  return c;
}

static void run(embps_hindex_policy_t policy, uint32_t k, uint64_t capacity) {
  embps_hindex_config_t c = config(capacity, policy, k);
  embps_hindex_t *a = NULL, *b = NULL;
  uint64_t rng = c.seed ^ 0x77, keys[MAXN + 1];
  int64_t sa[MAXN + 1], sb[MAXN + 1];
  embps_hindex_fresh_t fa[MAXN + 1], fb[MAXN + 1];
  size_t nfa, nfb, kept = 0, undone = 0, refused = 0;
  assert_int_equal(embps_hindex_new(&a, &c, NULL), EMBPS_OK);
  assert_int_equal(embps_hindex_new(&b, &c, NULL), EMBPS_OK);
  for (uint64_t step = 0; step < 3000; step++) {
    size_t n = rng_next(&rng) % 8 == 0 ? rng_next(&rng) % MAXN : rng_next(&rng) % 24;
    for (size_t i = 0; i < n; i++) {
      uint64_t d = rng_next(&rng);
      keys[i] = d % 20 == 0 ? 0
                : i > 0 && d % 7 == 0
                    ? keys[rng_next(&rng) % i]
                    : key_of(rng_next(&rng) % (10 * capacity)); /* 10x the capacity */
    }
    if (rng_next(&rng) % 2) { /* as the engine's push gives them: distinct, ascending */
      size_t m = 0;
      qsort(keys, n, sizeof(*keys), cmp_u64);
      for (size_t i = 0; i < n; i++)
        if (m == 0 || keys[m - 1] != keys[i])
          keys[m++] = keys[i];
      n = m;
    }
    if (!embps_hindex_can_try(b, n)) { /* both take the step as it is */
      refused++;
      assert_int_equal(embps_hindex_try_step(b, keys, n, sb, fb, &nfb), EMBPS_FAILED_PRECONDITION);
      assert_same(a, b);
      assert_int_equal(embps_hindex_step(a, keys, n, sa, fa, &nfa), EMBPS_OK);
      assert_int_equal(embps_hindex_step(b, keys, n, sb, fb, &nfb), EMBPS_OK);
    } else {
      assert_int_equal(embps_hindex_try_step(b, keys, n, sb, fb, &nfb), EMBPS_OK);
      assert_int_equal(embps_hindex_can_try(b, n), 0); /* open until settled */
      if (rng_next(&rng) % 3 == 0) {
        undone++;
        assert_int_equal(embps_hindex_settle(b, 0), EMBPS_OK);
        assert_same(a, b);
        continue;
      }
      kept++;
      assert_int_equal(embps_hindex_settle(b, 1), EMBPS_OK);
      assert_int_equal(embps_hindex_step(a, keys, n, sa, fa, &nfa), EMBPS_OK);
    }
    assert_memory_equal(sa, sb, n * sizeof(*sa));
    assert_int_equal(nfa, nfb);
    for (size_t i = 0; i < nfa; i++)
      assert_true(fa[i].key == fb[i].key && fa[i].evicted == fb[i].evicted &&
                  fa[i].slot == fb[i].slot);
    assert_same(a, b);
    if (step % 500 == 499) { /* a capture, as a checkpoint takes one */
      embps_hindex_mark_captured(a);
      embps_hindex_mark_captured(b);
    }
  }
  assert_int_equal(embps_hindex_settle(b, 0), EMBPS_OK); /* none open: a no-op */
  assert_same(a, b);
  assert_true(kept > 500 && undone > 300);
  assert_true(a->st.evicted > 0 && (policy != EMBPS_HINDEX_TTL || a->st.expired > 0));
  if (policy == EMBPS_HINDEX_LFU)
    assert_true(refused > 0); /* the renormalising steps */
  else
    assert_int_equal(refused, 0);
  embps_hindex_free(a);
  embps_hindex_free(b);
}

static void test_lru(void **state) {
  (void)state;
  run(EMBPS_HINDEX_LRU, 1, 61);
  run(EMBPS_HINDEX_LRU, 3, 61);
  run(EMBPS_HINDEX_LRU, 1, 1);
}

static void test_lfu(void **state) {
  (void)state;
  run(EMBPS_HINDEX_LFU, 1, 61);
  run(EMBPS_HINDEX_LFU, 3, 61);
}

static void test_ttl(void **state) {
  (void)state;
  run(EMBPS_HINDEX_TTL, 1, 61);
  run(EMBPS_HINDEX_TTL, 3, 61);
}

/* A TTL step that would expire more than n + 1024 keys is not tried (its record would grow with
 * the table). */
static void test_ttl_mass_expiry_not_tried(void **state) {
  embps_hindex_config_t c = config(3000, EMBPS_HINDEX_TTL, 1);
  embps_hindex_t *ix = NULL;
  uint64_t keys[2000];
  int64_t slots[2000];
  embps_hindex_fresh_t fresh[2000];
  size_t nf;
  (void)state;
  c.ttl_steps = 1;
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  for (size_t i = 0; i < 2000; i++)
    keys[i] = i + 1;
  assert_int_equal(embps_hindex_step(ix, keys, 2000, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(embps_hindex_step(ix, NULL, 0, NULL, NULL, NULL), EMBPS_OK);
  assert_int_equal(embps_hindex_can_try(ix, 1000), 1); /* 2000 expire: <= 1000 + 1024 */
  assert_int_equal(embps_hindex_can_try(ix, 900), 0);
  assert_int_equal(embps_hindex_try_step(ix, keys, 900, slots, fresh, &nf),
                   EMBPS_FAILED_PRECONDITION);
  embps_hindex_free(ix);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lru),
      cmocka_unit_test(test_lfu),
      cmocka_unit_test(test_ttl),
      cmocka_unit_test(test_ttl_mass_expiry_not_tried),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
