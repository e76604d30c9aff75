/* The slice writer (server/store/ckpt_writer.c): slices written by any group size read back bit
 * for bit onto any column range, over every optimizer and dtype; refused slices leave nothing
 * behind, and the file already at the name untouched. */
#include "tests/unit/store/ckpt_fixture.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void test_optimizers_covered(void **state) {
  size_t known = 0;
  (void)state;
  /* the round trip covers every optimizer the table spec supports: a new one fails here */
  for (int k = 0; k < 64; k++)
    known += embps_optimizer_info((embps_optimizer_t)k) != NULL;
  assert_int_equal(known, sizeof(optimizers) / sizeof(optimizers[0]));
  for (size_t i = 0; i < known; i++)
    assert_non_null(embps_optimizer_info(optimizers[i]));
}

static void test_round_trip(void **state) {
  const fixture_t *fx = *state;
  static const uint32_t writers[] = {1, 2, 3}, readers[] = {1, 2, 3, 4, 6};
  uint64_t round = 0;
  for (size_t o = 0; o < sizeof(optimizers) / sizeof(optimizers[0]); o++)
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++)
      for (size_t wi = 0; wi < sizeof(writers) / sizeof(writers[0]); wi++) {
        const uint32_t g = writers[wi];
        const int big = optimizers[o] == EMBPS_OPTIMIZER_ADAM;
        source_t small, large;
        const source_t *tables[2] = {&small, &large};
        round++;
        /* 77 rows: not a whole number of 64-row words */
        source_init(&small, "small", 77, 12, dtypes[d], optimizers[o]);
        source_fill(&small, round * 10 + 1, NULL);
        if (big) {
          /* about 3 (f32) or 2.5 MiB (bf16) per slice of a 3-rank group: several blocks */
          source_init(&large, "large", 8000, 96, dtypes[d], optimizers[o]);
          source_fill(&large, round * 10 + 2, NULL);
        }
        write_ckpt(fx->dir, round, 0, "", g, tables, NULL, big ? 2 : 1);
        for (size_t t = 0; t < (big ? 2u : 1u); t++) {
          const source_t *s = tables[t];
          const uint32_t w = s->cfg.emb_width;
          for (size_t ri = 0; ri < sizeof(readers) / sizeof(readers[0]); ri++)
            for (uint32_t j = 0; j < readers[ri]; j++)
              expect_range(fx->dir, round, s, j * (w / readers[ri]), w / readers[ri]);
          /* a range that matches no split: a part of every writer's columns */
          expect_range(fx->dir, round, s, 1, w - 2);
          expect_range(fx->dir, round, s, w - 1, 1);
        }
        if (big)
          for (uint32_t rank = 0; rank < g; rank++) {
            char path[EMBPS_CKPT_PATH_MAX + 200];
            slice_path(path, sizeof(path), fx->dir, round, rank, "large");
            assert_true(file_size(path) > 2 * BLOCK_BYTES);
          }
        source_free(&small);
        if (big)
          source_free(&large);
      }
}

static void test_slice_refusals(void **state) {
  const fixture_t *fx = *state;
  char path[256], cmp[256];
  source_t s;
  embps_ckpt_slice_t good, bad;
  embps_error_t err;
  uint64_t dirty[1] = {1}, bytes = 0;
  float extra[80];
  uint8_t *before;
  size_t before_len;

  source_init(&s, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAGRAD);
  source_fill(&s, 1, NULL);
  good = slice_of(&s, 0, 2, 5, 0, NULL);
  snprintf(path, sizeof(path), "%s/r0-t.embps", fx->dir);
  assert_int_equal(embps_ckpt_write_slice(path, &good, &bytes, &err), EMBPS_OK);
  before = slurp(path, &before_len);
  assert_int_equal(before_len, bytes);

  for (int k = 0; k < 15; k++) {
    bad = good;
    switch (k) {
    case 0:
      bad.rank = 2;
      break;
    case 1:
      bad.group_size = 0;
      break;
    case 2:
      bad.shard_width = 0;
      break;
    case 3:
      bad.col_begin = 6; /* 6 + 4 > 8 */
      break;
    case 4:
      bad.data = NULL;
      break;
    case 5:
      bad.state0 = NULL; /* adagrad keeps accumulators */
      break;
    case 6:
      bad.state1 = extra; /* but no second moment */
      break;
    case 7:
      bad.dirty = dirty; /* a dirty map with no base */
      break;
    case 8:
      bad.base_round = 1; /* a base with no dirty map */
      break;
    case 9:
      bad.dirty = dirty;
      bad.base_round = 5; /* not older than its round */
      break;
    case 10:
      bad.config.rows = 0;
      break;
    case 11:
      bad.config.dtype = (embps_dtype_t)7;
      break;
    case 12:
      bad.config.optimizer = (embps_optimizer_t)9;
      break;
    case 13:
      bad.config.emb_width = 0;
      break;
    default:
      bad.config.emb_width = EMBPS_MAX_EMB_WIDTH + 8;
      break;
    }
    embps_error_clear(&err);
    if (embps_ckpt_write_slice(path, &bad, &bytes, &err) != EMBPS_INVALID_ARGUMENT)
      fail_msg("refusal %d: %s (%s)", k, embps_status_name(err.status), err.message);
    assert_true(has(err.message, "table 't'"));
    expect_dir(fx->dir, "r0-t.embps");
    /* the file already there is untouched */
    {
      size_t n;
      uint8_t *now = slurp(path, &n);
      assert_int_equal(n, before_len);
      assert_memory_equal(now, before, n);
      free(now);
    }
  }
  free(before);

  /* a directory that does not exist: an error naming the file, nothing created */
  snprintf(path, sizeof(path), "%s/nope/r0-t.embps", fx->dir);
  assert_int_equal(embps_ckpt_write_slice(path, &good, NULL, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "r0-t.embps");

  /* the rename fails (a non-empty directory holds the name): the temporary file is removed */
  snprintf(path, sizeof(path), "%s/r1-t.embps", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(cmp, sizeof(cmp), "%s/r1-t.embps/x", fx->dir);
  assert_int_equal(mkdir(cmp, 0755), 0);
  assert_int_equal(embps_ckpt_write_slice(path, &good, NULL, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "r0-t.embps r1-t.embps");
  expect_dir(path, "x");
  slice_free(&good);
  source_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optimizers_covered),
      T(test_round_trip),
      T(test_slice_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
