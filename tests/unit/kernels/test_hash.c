/* The hash-keyed tables' kernels (kernels/hash.c): the gather by slot copies stored rows and
 * gives every key without a slot its initial row (computed here from embps_init_value, the
 * dense initializer's value of row number = key, and equal to embps_init_rows_cpu's row for
 * small keys), zeros for key 0, keys with the top bits set included, into an unaligned out
 * without writing past it; the reset writes the new keys' initial rows and state0 / state1 at
 * their slots, for state0 widths 0, 1 and width, and leaves every other slot untouched. f32 and
 * bf16, whole rows and column slices. */
#include "kernel_test_util.h"
#include "kernels/embps_kernels.h"

#define SLOTS 16
#define SEED UINT64_C(0x5eed0123456789ab)
#define SCALE 0.05f

/* Keys drawn from the whole 64-bit range: the top bit set (negative as int64), all ones, 0. */
static const int64_t special_keys[] = {0,
                                       1,
                                       2,
                                       7,
                                       -1,
                                       INT64_MIN,
                                       INT64_MIN + 1,
                                       INT64_MAX,
                                       (int64_t)UINT64_C(0xdeadbeefcafef00d),
                                       (int64_t)(UINT64_C(1) << 40)};
#define NUM_SPECIAL (sizeof(special_keys) / sizeof(special_keys[0]))

/* The stored element of dtype for value v: f32 as is, bf16 rounded. */
static void put_elem(unsigned char *p, embps_dtype_t dtype, float v) {
  if (dtype == EMBPS_DTYPE_BF16) {
    uint16_t h = embps_f32_to_bf16(v);
    memcpy(p, &h, sizeof(h));
  } else {
    memcpy(p, &v, sizeof(v));
  }
}

/* Key's initial row over columns [col_begin, col_begin + width), from embps_init_value. */
static void want_init_row(unsigned char *row, embps_dtype_t dtype, size_t width, uint64_t key,
                          uint64_t col_begin) {
  size_t es = embps_dtype_size(dtype);
  for (size_t j = 0; j < width; j++)
    put_elem(row + j * es, dtype, embps_init_value(SEED, key, col_begin + j, SCALE));
}

static void check_gather(embps_dtype_t dtype, size_t width, uint64_t col_begin) {
  const size_t es = embps_dtype_size(dtype), row_bytes = width * es;
  kt_rng_t r = {width * 31 + col_begin + (size_t)dtype};
  const size_t n = 64;
  unsigned char *table = kt_alloc(SLOTS * row_bytes);
  for (size_t k = 0; k < SLOTS * width; k++) /* stored rows: values no initial row has */
    put_elem(table + k * es, dtype, 2.0f + (float)k);
  int64_t keys[64], slots[64];
  for (size_t i = 0; i < n; i++) {
    keys[i] = i < NUM_SPECIAL ? special_keys[i] : (int64_t)kt_next(&r);
    /* Every special key without a slot, the rest half stored; slot of a stored row repeats. */
    slots[i] = i < NUM_SPECIAL || kt_below(&r, 2) ? -1 : (int64_t)kt_below(&r, SLOTS);
  }
  slots[n - 1] = SLOTS - 1; /* the last slot of the table */
  slots[n - 2] = 0;
  /* out 1 byte past an aligned address, with a guard of 0xee bytes after it. */
  unsigned char *buf = kt_alloc(1 + n * row_bytes + 32);
  memset(buf, 0xee, 1 + n * row_bytes + 32);
  unsigned char *out = buf + 1;
  embps_hash_gather_cpu(table, dtype, width, keys, slots, n, out, col_begin, SEED, SCALE);
  unsigned char *want = kt_alloc(row_bytes);
  size_t inits = 0, stored = 0;
  for (size_t i = 0; i < n; i++) {
    if (slots[i] >= 0) {
      memcpy(want, table + (size_t)slots[i] * row_bytes, row_bytes);
      stored++;
    } else {
      want_init_row(want, dtype, width, (uint64_t)keys[i], col_begin);
      inits++;
    }
    assert_memory_equal(out + i * row_bytes, want, row_bytes);
    if (keys[i] == 0 && slots[i] < 0)
      for (size_t b = 0; b < row_bytes; b++)
        assert_int_equal(out[i * row_bytes + b], 0);
    /* An initial row lies in [-scale, scale): not a stored row's value, and not all zero for a
     * key other than 0 (a width of 7 or more makes a zero row impossible in practice). */
    if (slots[i] < 0 && keys[i] != 0 && width >= 7) {
      int nonzero = 0;
      for (size_t b = 0; b < row_bytes; b++)
        nonzero |= out[i * row_bytes + b];
      assert_true(nonzero);
    }
  }
  assert_true(inits >= NUM_SPECIAL && stored >= 2);
  assert_int_equal(buf[0], 0xee);
  for (size_t b = 0; b < 32; b++)
    assert_int_equal(out[n * row_bytes + b], 0xee);
  free(want), free(buf), free(table);
}

static void test_gather(void **state) {
  (void)state;
  static const size_t widths[] = {1, 7, 16, 128};
  for (size_t d = 0; d < 2; d++)
    for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++) {
      embps_dtype_t dt = d ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
      check_gather(dt, widths[w], 0);
      check_gather(dt, widths[w], 3 * widths[w]); /* a column slice of rank 3 */
    }
}

/* Keys that repeat within one gather (a lookup's tokens): an absent key's row is computed once
 * and copied to its later places, so every place must still hold that key's own row, whatever
 * the repeat table's collisions (many more distinct keys than its entries, stored and absent
 * places of one key mixed, key 0 among them), at every call size. */
static void test_gather_repeats(void **state) {
  (void)state;
  const size_t sizes[] = {1, 2, 3, 700, 5000};
  for (size_t d = 0; d < 2; d++)
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
      const embps_dtype_t dtype = d ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
      const size_t width = 9, n = sizes[z], row_bytes = width * embps_dtype_size(dtype);
      kt_rng_t r = {77 + z};
      unsigned char *table = kt_alloc(SLOTS * row_bytes), *out = kt_alloc(n * row_bytes);
      unsigned char *want = kt_alloc(row_bytes);
      int64_t *keys = kt_alloc(n * sizeof(*keys)), *slots = kt_alloc(n * sizeof(*slots));
      for (size_t k = 0; k < SLOTS * width; k++)
        put_elem(table + k * embps_dtype_size(dtype), dtype, 2.0f + (float)k);
      for (size_t i = 0; i < n; i++) {
        const uint64_t u = kt_below(&r, 4);
        keys[i] = u == 0   ? (int64_t)kt_next(&r)               /* distinct: collisions */
                  : u == 1 ? (int64_t)kt_below(&r, 5)           /* hot, 0 among them */
                           : (int64_t)(kt_below(&r, 40) << 50); /* warm, wide */
        slots[i] = kt_below(&r, 8) == 0 ? (int64_t)kt_below(&r, SLOTS) : -1;
      }
      embps_hash_gather_cpu(table, dtype, width, keys, slots, n, out, 5, SEED, SCALE);
      for (size_t i = 0; i < n; i++) {
        if (slots[i] >= 0)
          memcpy(want, table + (size_t)slots[i] * row_bytes, row_bytes);
        else
          want_init_row(want, dtype, width, (uint64_t)keys[i], 5);
        assert_memory_equal(out + i * row_bytes, want, row_bytes);
      }
      free(table), free(out), free(want), free(keys), free(slots);
    }
}

/* A run of gathers sharing one memory (embps_hash_gather_seen_cpu: a lookup's chunks) copies a
 * key's row from an earlier call's rows and still gives every place its key's own row; a new run
 * (embps_hash_seen_restart) forgets the last one's rows, even when they were overwritten since,
 * and so does a restart that wraps the run counter. */
static void test_gather_runs(void **state) {
  (void)state;
  const size_t width = 16, n = 3000, row_bytes = width * sizeof(float);
  const size_t chunks[] = {1, 7, 300, 0}; /* 0: the rest */
  kt_rng_t r = {99};
  float table[SLOTS * 16];
  unsigned char *out = kt_alloc(n * row_bytes), *want = kt_alloc(row_bytes);
  int64_t *keys = kt_alloc(n * sizeof(*keys)), *slots = kt_alloc(n * sizeof(*slots));
  embps_hash_seen_t *seen = calloc(1, sizeof(*seen));
  assert_non_null(seen);
  for (size_t k = 0; k < SLOTS * width; k++)
    table[k] = 2.0f + (float)k;
  for (size_t i = 0; i < n; i++) {
    keys[i] = kt_below(&r, 3) ? (int64_t)kt_below(&r, 50) : (int64_t)kt_next(&r);
    slots[i] = kt_below(&r, 10) == 0 ? (int64_t)kt_below(&r, SLOTS) : -1;
  }
  for (int run = 0; run < 3; run++) {
    if (run == 2)
      seen->gen = UINT32_MAX; /* the next restart wraps */
    embps_hash_seen_restart(seen);
    for (size_t at = 0, c = 0; at < n; c++) {
      const size_t m = chunks[c % 4] && chunks[c % 4] < n - at ? chunks[c % 4] : n - at;
      embps_hash_gather_seen_cpu(table, EMBPS_DTYPE_F32, width, keys + at, slots + at, m,
                                 out + at * row_bytes, 0, SEED, SCALE, seen);
      at += m;
    }
    for (size_t i = 0; i < n; i++) {
      if (slots[i] >= 0)
        memcpy(want, table + (size_t)slots[i] * width, row_bytes);
      else
        want_init_row(want, EMBPS_DTYPE_F32, width, (uint64_t)keys[i], 0);
      assert_memory_equal(out + i * row_bytes, want, row_bytes);
    }
    memset(out, 0xab, n * row_bytes); /* the next run must not copy these */
    for (size_t i = 0; i < n; i++)    /* and gathers its keys in another order */
      keys[i] = keys[(i * 7 + 3) % n] ^ (run ? 0 : 1);
  }
  free(out), free(want), free(keys), free(slots), free(seen);
}

/* A key's initial row is the dense initializer's row numbered by the key, column slices of it
 * are slices of the whole row, and the row depends on the seed. */
static void test_key_row_is_dense_row(void **state) {
  (void)state;
  const size_t width = 24, rows = 40;
  for (size_t d = 0; d < 2; d++) {
    embps_dtype_t dt = d ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
    size_t es = embps_dtype_size(dt), row_bytes = width * es;
    unsigned char *dense = kt_alloc(rows * row_bytes), *out = kt_alloc(rows * row_bytes);
    int64_t keys[40], slots[40];
    embps_init_rows_cpu(dense, dt, width, 0, rows, 0, SEED, SCALE);
    for (size_t i = 0; i < rows; i++)
      keys[i] = (int64_t)(rows - 1 - i), slots[i] = -1;
    embps_hash_gather_cpu(NULL, dt, width, keys, slots, rows, out, 0, SEED, SCALE);
    for (size_t i = 0; i < rows; i++)
      assert_memory_equal(out + i * row_bytes, dense + (size_t)keys[i] * row_bytes, row_bytes);
    /* Columns [8, 16) of the same keys: the middle third of each row. */
    embps_hash_gather_cpu(NULL, dt, 8, keys, slots, rows, out, 8, SEED, SCALE);
    for (size_t i = 0; i < rows; i++)
      assert_memory_equal(out + i * 8 * es, dense + (size_t)keys[i] * row_bytes + 8 * es, 8 * es);
    /* Another seed, another row. */
    embps_hash_gather_cpu(NULL, dt, width, keys, slots, 1, out, 0, SEED + 1, SCALE);
    assert_memory_not_equal(out, dense + (size_t)keys[0] * row_bytes, row_bytes);
    free(dense), free(out);
  }
}

#define FILL_TABLE 0x5a
#define STATE0_OLD 7.0f
#define STATE1_OLD -3.0f

static void check_reset(embps_dtype_t dtype, size_t width, size_t state0_width, int with_state1,
                        uint64_t col_begin) {
  const size_t es = embps_dtype_size(dtype), row_bytes = width * es;
  const float state0_value = 0.125f;
  unsigned char *table = kt_alloc(SLOTS * row_bytes + 1);
  float *state0 = kt_alloc((SLOTS * state0_width + 1) * sizeof(float));
  float *state1 = kt_alloc((SLOTS * width + 1) * sizeof(float));
  memset(table, FILL_TABLE, SLOTS * row_bytes);
  for (size_t k = 0; k < SLOTS * state0_width; k++)
    state0[k] = STATE0_OLD;
  for (size_t k = 0; k < SLOTS * width; k++)
    state1[k] = STATE1_OLD;
  /* Five distinct slots, out of order, first and last included; keys with high bits and 0. */
  const int64_t slots[] = {9, 0, SLOTS - 1, 4, 5};
  const int64_t keys[] = {INT64_MIN, 0, -1, (int64_t)UINT64_C(0x0123456789abcdef), 12345};
  const size_t n = sizeof(slots) / sizeof(slots[0]);
  embps_hash_reset_cpu(table, dtype, width, state0_width ? state0 : NULL, state0_width,
                       with_state1 ? state1 : NULL, state0_value, slots, keys, n, col_begin, SEED,
                       SCALE);
  unsigned char *want = kt_alloc(row_bytes + 1);
  for (size_t s = 0; s < SLOTS; s++) {
    size_t i = 0;
    while (i < n && (size_t)slots[i] != s)
      i++;
    const int fresh = i < n;
    if (fresh)
      want_init_row(want, dtype, width, (uint64_t)keys[i], col_begin);
    else
      memset(want, FILL_TABLE, row_bytes);
    assert_memory_equal(table + s * row_bytes, want, row_bytes);
    for (size_t j = 0; j < state0_width; j++)
      assert_true(state0[s * state0_width + j] == (fresh ? state0_value : STATE0_OLD));
    for (size_t j = 0; j < width; j++)
      assert_true(state1[s * width + j] == (fresh && with_state1 ? 0.0f : STATE1_OLD));
    if (fresh && keys[i] == 0)
      for (size_t b = 0; b < row_bytes; b++)
        assert_int_equal(table[s * row_bytes + b], 0);
  }
  free(want), free(table), free(state0), free(state1);
}

static void test_reset(void **state) {
  (void)state;
  static const size_t widths[] = {1, 7, 128};
  for (size_t d = 0; d < 2; d++)
    for (size_t w = 0; w < sizeof(widths) / sizeof(widths[0]); w++)
      for (int s1 = 0; s1 < 2; s1++) {
        embps_dtype_t dt = d ? EMBPS_DTYPE_BF16 : EMBPS_DTYPE_F32;
        size_t width = widths[w];
        check_reset(dt, width, 0, s1, 0);
        check_reset(dt, width, 1, s1, 0);
        check_reset(dt, width, width, s1, width);
      }
}

/* A slice of width 0 (more ranks than columns) still resets a per-row state0. */
static void test_reset_width_zero(void **state) {
  (void)state;
  float state0[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  const int64_t slots[] = {2}, keys[] = {99};
  embps_hash_reset_cpu(NULL, EMBPS_DTYPE_F32, 0, state0, 1, NULL, 0.5f, slots, keys, 1, 0, SEED,
                       SCALE);
  assert_true(state0[0] == 1.0f && state0[1] == 1.0f && state0[2] == 0.5f && state0[3] == 1.0f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gather),      cmocka_unit_test(test_gather_repeats),
      cmocka_unit_test(test_gather_runs), cmocka_unit_test(test_key_row_is_dense_row),
      cmocka_unit_test(test_reset),       cmocka_unit_test(test_reset_width_zero),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
