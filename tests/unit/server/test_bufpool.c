/* The reply buffer pool: a put buffer comes back for a fitting size, misfits get fresh ones,
 * and the idle limits hold. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/alloc.h"
#include "server/service/bufpool.h"

static void test_reuse_and_fit(void **state) {
  embps_bufpool_t *p = embps__bufpool_new(4, 1 << 24);
  void *a, *b, *c;
  (void)state;
  a = embps__bufpool_get(p, 100000);
  assert_non_null(a);
  assert_int_equal((uintptr_t)a % 64, 0);
  memset(a, 1, 100000);
  embps__bufpool_put(a);
  b = embps__bufpool_get(p, 90000); /* fits: reused */
  assert_ptr_equal(a, b);
  embps__bufpool_put(b);
  c = embps__bufpool_get(p, 1000); /* would waste more than half: fresh */
  assert_ptr_not_equal(c, a);
  embps__bufpool_put(c);
  b = embps__bufpool_get(p, 200000); /* too small: fresh */
  assert_ptr_not_equal(b, a);
  embps__bufpool_put(b);
  embps__bufpool_free(p);
}

static void test_limits(void **state) {
  embps_bufpool_t *p = embps__bufpool_new(2, 3 << 20);
  void *bufs[4];
  (void)state;
  for (int i = 0; i < 4; i++)
    assert_non_null(bufs[i] = embps__bufpool_get(p, 1 << 20));
  for (int i = 0; i < 4; i++)
    embps__bufpool_put(bufs[i]); /* only two stay idle; the sanitizer build checks the rest
                                    were freed */
  /* Two come back reused, the third is new. */
  void *x = embps__bufpool_get(p, 1 << 20), *y = embps__bufpool_get(p, 1 << 20),
       *z = embps__bufpool_get(p, 1 << 20);
  int reused = 0;
  for (int i = 0; i < 4; i++)
    reused += (bufs[i] == x) + (bufs[i] == y);
  assert_int_equal(reused, 2);
  embps__bufpool_put(x);
  embps__bufpool_put(y);
  embps__bufpool_put(z);
  /* A buffer larger than the idle byte limit is never kept. */
  x = embps__bufpool_get(p, 4 << 20);
  embps__bufpool_put(x);
  embps__bufpool_free(p);
}

static void test_allocation_failure(void **state) {
  embps_bufpool_t *p = embps__bufpool_new(2, 1 << 20);
  (void)state;
  embps_alloc_fail_after(1);
  assert_null(embps__bufpool_get(p, 4096));
  embps_alloc_fail_after(0);
  embps__bufpool_free(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reuse_and_fit),
      cmocka_unit_test(test_limits),
      cmocka_unit_test(test_allocation_failure),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
