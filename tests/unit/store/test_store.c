/* The store: config resolution and its refusals, the registry (growing as tables come, up to
 * EMBPS_STORE_MAX_TABLES), allocation, dirty-row bitmaps, and that a table split over N ranks
 * by columns holds exactly the columns of the unsplit table. The test includes store.c to fill
 * the registry to its cap without registering 65536 tables. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "common/alloc.h"
#include "server/store/store.c"

static embps_table_config_t config(const char *name, uint64_t rows, uint32_t width) {
  embps_table_config_t c;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, name);
  c.rows = rows;
  c.emb_width = width;
  c.seed = 42;
  return c;
}

static void test_resolve_defaults(void **state) {
  embps_table_config_t c = config("t", 100, 64);
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(c.dtype, EMBPS_DTYPE_F32);
  assert_int_equal(c.optimizer, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  assert_true(fabsf(c.lr - 0.01f) < 1e-9f);
  assert_true(fabsf(c.init_scale - 0.125f) < 1e-9f);
  /* 100 rows x 64 f32 + one accumulator per row */
  assert_int_equal(embps_table_config_bytes(&c, 1), 100 * 64 * 4 + 100 * 4);
  assert_int_equal(embps_table_config_bytes(&c, 4), 100 * 16 * 4 + 100 * 4);
}

static void test_resolve_refusals(void **state) {
  embps_error_t err;
  embps_table_config_t c;
  (void)state;
  c = config("t", 0, 8);
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "rows=0"));
  c = config("t", 10, 0);
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "emb_width=0"));
  c = config("t", 10, 6);
  assert_int_equal(embps_table_config_resolve(&c, 4, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "emb_width=6 does not shard evenly over the 4-rank"));
  c = config("t", 1ull << 30, 128);
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(err.message, "more than this rank's memory budget of 1073741824 "
                                      "(--max-memory-bytes)"));
  c = config("a/b", 10, 8);
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  c = config("t", 10, 8);
  c.lr = NAN;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  c = config("t", 10, 8);
  c.dtype = (embps_dtype_t)7;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
  c = config("t", 10, 8);
  c.optimizer = (embps_optimizer_t)9;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_INVALID_ARGUMENT);
}

static embps_table_t *new_table(const char *name, uint32_t rank, uint32_t group_size) {
  embps_table_config_t c = config(name, 10, 8);
  embps_table_t *t;
  embps_error_t err;
  assert_int_equal(embps_table_config_resolve(&c, group_size, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(embps_table_new(&t, &c, rank, group_size), EMBPS_OK);
  return t;
}

static void test_registry(void **state) {
  embps_store_t *s = NULL; /* set by embps_store_new (asserted); -O3 cannot see it */
  embps_table_t *t1 = new_table("one", 0, 1), *dup = new_table("one", 0, 1),
                *t2 = new_table("two", 0, 1), *t3 = new_table("three", 0, 1);
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_store_new(&s), EMBPS_OK);
  assert_int_equal(embps_store_add(s, t1, &err), EMBPS_OK);
  assert_int_equal(embps_store_add(s, dup, &err), EMBPS_ALREADY_EXISTS);
  assert_non_null(strstr(err.message, "table 'one' already exists"));
  assert_int_equal(embps_store_add(s, t2, &err), EMBPS_OK);
  assert_ptr_equal(embps_store_find(s, "two"), t2);
  assert_ptr_equal(embps_store_at(s, 0), t1);
  assert_null(embps_store_at(s, 2));
  assert_null(embps_store_find(s, "three"));
  assert_int_equal(embps_store_count(s), 2);
  embps_table_free(dup); /* refused tables stay the caller's */

  /* The registry grows as tables come (16 slots, then 32, 64), in registration order. */
  embps_table_t *more[70];
  char name[32];
  for (int i = 0; i < 70; i++) {
    snprintf(name, sizeof(name), "m%d", i);
    more[i] = new_table(name, 0, 1);
    assert_int_equal(embps_store_add(s, more[i], &err), EMBPS_OK);
  }
  assert_int_equal(embps_store_count(s), 72);
  assert_true(s->cap >= 72 && s->cap <= 128);
  for (int i = 0; i < 70; i++) {
    snprintf(name, sizeof(name), "m%d", i);
    assert_ptr_equal(embps_store_at(s, (size_t)i + 2), more[i]);
    assert_ptr_equal(embps_store_find(s, name), more[i]);
  }
  /* A failed growth refuses the table and keeps the registry as it was. */
  while (s->count < s->cap) {
    snprintf(name, sizeof(name), "f%zu", s->count);
    assert_int_equal(embps_store_add(s, new_table(name, 0, 1), &err), EMBPS_OK);
  }
  size_t full = s->count;
  embps_alloc_fail_after(1);
  assert_int_equal(embps_store_add(s, t3, &err), EMBPS_RESOURCE_EXHAUSTED);
  embps_alloc_fail_after(0);
  assert_non_null(strstr(err.message, "out of memory registering table 'three'"));
  assert_int_equal(embps_store_count(s), full);
  assert_ptr_equal(embps_store_at(s, full - 1), embps_store_find(s, name));

  /* The cap: a registry of EMBPS_STORE_MAX_TABLES refuses one more (its slots are filled here
   * with the one table t1, since no test should register 65536 tables). */
  embps_table_t **saved = s->tables;
  size_t saved_count = s->count, saved_cap = s->cap;
  s->tables = embps_calloc(EMBPS_STORE_MAX_TABLES, sizeof(*s->tables));
  assert_non_null(s->tables);
  for (size_t i = 0; i < EMBPS_STORE_MAX_TABLES; i++)
    s->tables[i] = t1;
  s->count = s->cap = EMBPS_STORE_MAX_TABLES;
  assert_int_equal(embps_store_add(s, t3, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(err.message, "already holds 65536 tables, the most a server holds"));
  embps_free(s->tables);
  s->tables = saved;
  s->count = saved_count;
  s->cap = saved_cap;
  embps_table_free(t3);
  embps_store_free(s);
}

/* Dropping unregisters the table, keeps its struct readable (marked dropped), gives its bytes
 * back to the budget, and a table registered under the same name later gets another id. */
static void test_drop_and_budget(void **state) {
  embps_store_t *s = NULL; /* set by embps_store_new (asserted); -O3 cannot see it */
  embps_table_t *a = new_table("a", 0, 1), *b = new_table("b", 0, 1), *a2 = new_table("a", 0, 1);
  embps_table_t *list[4];
  embps_error_t err;
  const uint64_t bytes = embps_table_bytes(a);
  (void)state;
  assert_int_equal(embps_store_new(&s), EMBPS_OK);
  embps_store_set_budget(s, 1000000, 1);
  assert_int_equal(embps_store_budget_cost(s, bytes), 2 * bytes);
  assert_int_equal(embps_store_add(s, a, &err), EMBPS_OK);
  assert_int_equal(embps_store_add(s, b, &err), EMBPS_OK);
  assert_int_equal(embps_store_budget_used(s), 4 * bytes);
  assert_int_equal(embps_store_budget_max(s), 1000000);
  assert_int_not_equal(embps_table_id(a), embps_table_id(b));
  assert_int_equal(embps_store_drop(s, a), EMBPS_OK);
  assert_int_equal(embps_store_drop(s, a), EMBPS_NOT_FOUND);
  assert_true(embps_table_dropped(a));
  assert_false(embps_table_dropped(b));
  assert_string_equal(embps_table_config(a)->name, "a"); /* still readable */
  assert_null(embps_table_arrays(a).data);
  assert_null(embps_store_find(s, "a"));
  assert_int_equal(embps_store_list(s, list, 4), 1);
  assert_ptr_equal(list[0], b);
  assert_int_equal(embps_store_budget_used(s), 2 * bytes);
  assert_int_equal(embps_store_add(s, a2, &err), EMBPS_OK);
  assert_int_not_equal(embps_table_id(a2), embps_table_id(a));
  assert_ptr_equal(embps_store_find(s, "a"), a2);
  embps_store_free(s); /* frees the dropped struct too (the sanitizer build checks) */
}

static void test_name_check_full_length(void **state) {
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_table_name_check("t1", 2, &err), EMBPS_OK);
  assert_int_equal(embps_table_name_check("t1\0x", 4, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "'t1\\x00x'"));
  assert_non_null(strstr(err.message, "byte 0x00 at position 2"));
  assert_int_equal(embps_table_name_check("a b", 3, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "byte 0x20 at position 1"));
  assert_int_equal(embps_table_name_check("", 0, &err), EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(err.message, "1 to 127 bytes"));
}

/* A table split by columns over N ranks holds, on rank r, exactly columns [r*D/N, (r+1)*D/N)
 * of the 1-rank table. */
static void test_column_split_matches(void **state) {
  const uint32_t width = 12;
  const uint64_t rows = 33;
  embps_table_t *tw, *tp;
  embps_table_config_t c = config("t", rows, width);
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(embps_table_new(&tw, &c, 0, 1), EMBPS_OK);
  for (uint32_t n = 2; n <= 4; n++) {
    if (width % n)
      continue;
    for (uint32_t r = 0; r < n; r++) {
      assert_int_equal(embps_table_new(&tp, &c, r, n), EMBPS_OK);
      assert_int_equal(embps_table_shard_width(tp), width / n);
      for (uint64_t row = 0; row < rows; row++)
        assert_memory_equal((float *)embps_table_arrays(tp).data + row * (width / n),
                            (float *)embps_table_arrays(tw).data + row * width + r * (width / n),
                            (width / n) * sizeof(float));
      embps_table_free(tp);
    }
  }
  for (uint32_t col = 0; col < width; col++)
    assert_true(((float *)embps_table_arrays(tw).data)[col] == 0.0f); /* padding row */
  embps_table_free(tw);
}

static void test_allocation_failure(void **state) {
  embps_table_t *t = NULL;
  embps_table_config_t c = config("adam", 10, 8);
  embps_error_t err;
  (void)state;
  c.optimizer = EMBPS_OPTIMIZER_ADAM;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  /* fail the table, the data, the m and the v allocation in turn: nothing comes back, and the
   * sanitizer build proves nothing leaks */
  for (long k = 1; k <= 4; k++) {
    embps_alloc_fail_after(k);
    assert_int_equal(embps_table_new(&t, &c, 0, 1), EMBPS_RESOURCE_EXHAUSTED);
    embps_alloc_fail_after(0);
    assert_null(t);
  }
  assert_int_equal(embps_table_new(&t, &c, 0, 1), EMBPS_OK);
  assert_non_null(embps_table_arrays(t).state1);
  embps_table_free(t);
}

/* A table's arrays in another memory (a stand-in for GPU memory that counts what it holds). */
static int other_live;
static void *other_alloc(size_t bytes) {
  other_live++;
  return embps_malloc(bytes);
}
static void other_release(void *p) {
  if (p) {
    other_live--;
    embps_free(p);
  }
}

/* Dirty rows: marks in the host bitmap; the second bitmap only in the table's own memory and
 * while tracking is on, from that memory, and given back there at a drop and at a free. */
static void test_dirty_rows(void **state) {
  static const embps_table_memory_t other = {other_alloc, other_release};
  const int64_t rows[] = {1, 64, 64, 129};
  embps_table_config_t c = config("t", 130, 4);
  embps_table_t *host, *t, *t2;
  embps_store_t *s = NULL; /* set by embps_store_new (asserted); -O3 cannot see it */
  embps_error_t err;
  uint64_t *dev = NULL;
  (void)state;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_int_equal(embps_table_new(&host, &c, 0, 1), EMBPS_OK);
  embps_table_mark_dirty(host, rows, 4); /* tracking off: a no-op */
  assert_null(embps_table_dirty(host));
  assert_int_equal(embps_table_track_dirty(host), EMBPS_OK);
  embps_table_mark_dirty(host, rows, 4);
  assert_true(embps_table_dirty(host)[0] == 2 && embps_table_dirty(host)[1] == 1 &&
              embps_table_dirty(host)[2] == 2);
  assert_int_equal(embps_table_device_dirty_new(host, &dev), EMBPS_FAILED_PRECONDITION);
  assert_null(dev);
  embps_table_free(host);

  assert_int_equal(embps_table_new_in(&t, &c, 0, 1, &other), EMBPS_OK);
  assert_int_equal(embps_table_new_in(&t2, &c, 0, 1, &other), EMBPS_OK);
  assert_int_equal(other_live, 4); /* two tables of data and accumulators */
  assert_int_equal(embps_table_device_dirty_new(t, &dev), EMBPS_FAILED_PRECONDITION);
  assert_int_equal(embps_table_track_dirty(t), EMBPS_OK);
  assert_int_equal(embps_table_track_dirty(t2), EMBPS_OK);
  assert_null(embps_table_device_dirty(t));
  assert_int_equal(embps_table_device_dirty_new(t, &dev), EMBPS_OK);
  assert_ptr_equal(dev, embps_table_device_dirty(t));
  assert_int_equal(embps_table_device_dirty_new(t, &dev), EMBPS_OK); /* the same one */
  assert_ptr_equal(dev, embps_table_device_dirty(t));
  assert_int_equal(embps_table_device_dirty_new(t2, &dev), EMBPS_OK);
  assert_int_equal(other_live, 6);
  assert_int_equal(embps_store_new(&s), EMBPS_OK);
  assert_int_equal(embps_store_add(s, t, &err), EMBPS_OK);
  assert_int_equal(embps_store_drop(s, t), EMBPS_OK);
  assert_null(embps_table_device_dirty(t));
  assert_null(embps_table_dirty(t));
  assert_int_equal(other_live, 3);
  embps_store_free(s);
  embps_table_free(t2);
  assert_int_equal(other_live, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_resolve_defaults),
      cmocka_unit_test(test_resolve_refusals),
      cmocka_unit_test(test_registry),
      cmocka_unit_test(test_column_split_matches),
      cmocka_unit_test(test_allocation_failure),
      cmocka_unit_test(test_drop_and_budget),
      cmocka_unit_test(test_name_check_full_length),
      cmocka_unit_test(test_dirty_rows),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
