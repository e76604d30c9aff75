/* embps_hindex_assign (an Assign's step of a hash-keyed table's index): every absent key is
 * stored at once whatever admit_after says, nothing is counted in the admission sketch, the clock
 * advances as a push step's does, a full table evicts its least (score, key) not in the step, a
 * batch of more keys than slots refuses the rest, and the keys it returns slots for are the ones
 * embps_hindex_find then finds; two indexes fed the same steps encode to the same bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/store/hindex.h"
#include "server/store/hindex_internal.h"

static embps_hindex_t *make(uint32_t admit_after) {
  embps_hindex_config_t c = {.capacity = 4,
                             .policy = EMBPS_HINDEX_LRU,
                             .admit_after = admit_after,
                             .sketch_width = admit_after > 1 ? 64 : 0,
                             .seed = 7};
  embps_hindex_t *ix = NULL;
  assert_int_equal(embps_hindex_new(&ix, &c, NULL), EMBPS_OK);
  return ix;
}

static int sketch_zero(const embps_hindex_t *ix) {
  for (uint64_t i = 0; i < EMBPS_HINDEX_SKETCH_DEPTH * ix->cfg.sketch_width; i++)
    if (ix->sketch[i])
      return 0;
  return 1;
}

/* Runs the sequence of the test on ix and returns its stats. */
static void sequence(embps_hindex_t *ix, embps_hindex_stats_t *st) {
  uint64_t a[] = {5, 9, 0, 9}, push[] = {7}, b[] = {3, 1, 2}, big[] = {10, 11, 12, 13, 14};
  int64_t slots[5], found[5];
  embps_hindex_fresh_t fresh[5];
  size_t nf = 99;

  /* admit_after 3: stored at once, padding and a repeat ignored, no sketch count */
  assert_int_equal(embps_hindex_assign(ix, a, 4, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(nf, 2);
  assert_true(slots[0] >= 0 && slots[1] >= 0 && slots[2] == -1 && slots[3] == slots[1]);
  assert_true(sketch_zero(ix));
  embps_hindex_find(ix, a, 4, found);
  assert_memory_equal(found, slots, sizeof(found[0]) * 4);
  /* a push of an absent key counts it and stores nothing (admit_after 3) */
  assert_int_equal(embps_hindex_step(ix, push, 1, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(nf, 0);
  assert_false(sketch_zero(ix));
  /* three keys into the two free slots and one evicted: key 5 (score 1, less than 9) */
  assert_int_equal(embps_hindex_assign(ix, b, 3, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(nf, 3);
  assert_int_equal(fresh[0].key, 1); /* ascending key order */
  assert_int_equal(fresh[2].key, 3);
  assert_int_equal(fresh[2].evicted, 5);
  embps_hindex_find(ix, a, 2, found);
  assert_int_equal(found[0], -1);
  assert_true(found[1] >= 0);
  /* five keys into four slots: one refused, every stored key evicted */
  assert_int_equal(embps_hindex_assign(ix, big, 5, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(nf, 4);
  assert_int_equal(slots[4], -1);
  embps_hindex_stats(ix, st);
}

static void test_assign_steps(void **state) {
  embps_hindex_t *ix = make(3), *twin = make(3);
  embps_hindex_stats_t st, st2;
  uint8_t *e1, *e2;
  (void)state;
  sequence(ix, &st);
  assert_int_equal(st.clock, 4);
  assert_int_equal(st.size, 4);
  assert_int_equal(st.admitted, 9);
  assert_int_equal(st.evicted, 5);
  assert_int_equal(st.refused, 1);
  assert_int_equal(st.not_admitted, 1); /* the push's key 7 alone */
  sequence(twin, &st2);
  assert_memory_equal(&st, &st2, sizeof(st));
  assert_int_equal(embps_hindex_encoded_bytes(ix), embps_hindex_encoded_bytes(twin));
  e1 = malloc(embps_hindex_encoded_bytes(ix));
  e2 = malloc(embps_hindex_encoded_bytes(twin));
  assert_non_null(e1);
  assert_non_null(e2);
  embps_hindex_encode(ix, e1);
  embps_hindex_encode(twin, e2);
  assert_memory_equal(e1, e2, embps_hindex_encoded_bytes(ix));
  free(e1);
  free(e2);
  embps_hindex_free(ix);
  embps_hindex_free(twin);
}

/* After an assign, a push step admits again by the table's rule: the flag does not leak. */
static void test_push_after_assign_counts(void **state) {
  embps_hindex_t *ix = make(2);
  uint64_t k[] = {42}, other[] = {43};
  int64_t slots[1];
  embps_hindex_fresh_t fresh[1];
  size_t nf;
  (void)state;
  assert_int_equal(embps_hindex_assign(ix, k, 1, slots, fresh, &nf), EMBPS_OK);
  assert_true(slots[0] >= 0);
  assert_int_equal(embps_hindex_step(ix, other, 1, slots, fresh, &nf), EMBPS_OK);
  assert_int_equal(slots[0], -1); /* the first of admit_after 2 pushes */
  assert_int_equal(embps_hindex_step(ix, other, 1, slots, fresh, &nf), EMBPS_OK);
  assert_true(slots[0] >= 0);
  embps_hindex_free(ix);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_assign_steps),
      cmocka_unit_test(test_push_after_assign_counts),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
