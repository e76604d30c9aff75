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
  embps_bufpool_t *p = embps__bufpool_new(4, 1 << 24, NULL);
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
  embps_bufpool_t *p = embps__bufpool_new(2, 3 << 20, NULL);
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
  embps_bufpool_t *p = embps__bufpool_new(2, 1 << 20, NULL);
  (void)state;
  embps_alloc_fail_after(1);
  assert_null(embps__bufpool_get(p, 4096));
  embps_alloc_fail_after(0);
  embps__bufpool_free(p);
}

/* A backing allocator that counts what it hands out and checks each buffer comes back with the
 * kind it was given. */
typedef struct counting {
  int allocs, frees, bad_kinds;
  size_t held; /* bytes handed out and not yet back: free must be told each buffer's size */
} counting_t;

static void *counting_alloc(void *ctx, size_t bytes, int *kind) {
  counting_t *c = ctx;
  c->allocs++;
  c->held += bytes;
  *kind = 7;
  return embps_aligned_alloc(bytes);
}

static void counting_free(void *ctx, void *p, size_t bytes, int kind) {
  counting_t *c = ctx;
  c->frees++;
  c->held -= bytes;
  c->bad_kinds += kind != 7;
  embps_free(p);
}

static void test_backing(void **state) {
  counting_t c = {0, 0, 0, 0};
  embps_bufpool_backing_t b = {counting_alloc, counting_free, &c};
  embps_bufpool_t *p = embps__bufpool_new(4, 1 << 24, &b);
  void *small, *big, *again;
  (void)state;
  /* Small buffers (a protobuf message's struct, a table name) bypass the backing and are never
   * kept; large ones come from it and are reused. */
  small = embps__bufpool_get(p, 100);
  assert_non_null(small);
  assert_int_equal((uintptr_t)small % 64, 0);
  memset(small, 2, 100);
  embps__bufpool_put(small);
  assert_int_equal(c.allocs, 0);
  big = embps__bufpool_get(p, EMBPS_BUFPOOL_MIN_BYTES);
  assert_int_equal(c.allocs, 1);
  embps__bufpool_put(big);
  again = embps__bufpool_get(p, 60000); /* same 64 KiB class */
  assert_ptr_equal(again, big);
  assert_int_equal(c.allocs, 1);
  embps__bufpool_put(again);
  assert_int_equal(c.frees, 0);
  assert_true(c.held > 0);
  embps__bufpool_free(p);
  assert_int_equal(c.frees, 1);
  assert_int_equal(c.held, 0); /* freed with the size it was allocated with */
  assert_int_equal(c.bad_kinds, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reuse_and_fit),
      cmocka_unit_test(test_limits),
      cmocka_unit_test(test_allocation_failure),
      cmocka_unit_test(test_backing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
