/* The restore chain (server/store/ckpt_restore.c): incremental chains applied oldest first
 * (tables created since, a table whose first checkpoint is incremental, a missing base, a
 * chain that loops), refused column ranges and tables; and which checkpoint a starting rank
 * restores (embps_ckpt_restore_choose: the --restore setting's policy, once in server/main.c). */
#include "tests/unit/store/ckpt_fixture.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void test_read_refusals(void **state) {
  const fixture_t *fx = *state;
  source_t s;
  dest_buf_t b;
  embps_error_t err;
  (void)state;
  source_init(&s, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAGRAD);
  source_fill(&s, 1, NULL);
  write_full(fx->dir, 1, 2, &s);
  assert_int_equal(read_range(fx->dir, 1, &s, 4, 5, &b, &err), EMBPS_INVALID_ARGUMENT);
  assert_true(has(err.message, "outside table 't'"));
  dest_free(&b);
  assert_int_equal(read_range(fx->dir, 1, &s, 0, 0, &b, &err), EMBPS_INVALID_ARGUMENT);
  dest_free(&b);
  strcpy(s.cfg.name, "nope");
  assert_int_equal(read_range(fx->dir, 1, &s, 0, 8, &b, &err), EMBPS_NOT_FOUND);
  assert_true(has(err.message, "no table 'nope'"));
  dest_free(&b);
  source_free(&s);
}

static void test_incremental_chain(void **state) {
  const fixture_t *fx = *state;
  static const struct {
    embps_optimizer_t opt;
    embps_dtype_t dtype;
  } kinds[] = {{EMBPS_OPTIMIZER_ADAM, EMBPS_DTYPE_F32},
               {EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, EMBPS_DTYPE_BF16},
               {EMBPS_OPTIMIZER_SGD, EMBPS_DTYPE_BF16}};
  /* round 20: row 0, a run across the word boundary 63/64, the last row; rows 128..191 (a whole
   * word) stay clean. round 30: both sides of two word boundaries and the last row again. */
  static const uint64_t rows20[] = {0, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 100, 199},
                        rows30[] = {5, 63, 64, 127, 128, 199};
  for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
    char dir[128], full0[EMBPS_CKPT_PATH_MAX + 200], inc0[EMBPS_CKPT_PATH_MAX + 200];
    source_t t, at20, fresh, late;
    uint64_t *d20 = dirty_map(200, rows20, sizeof(rows20) / sizeof(rows20[0]));
    uint64_t *d30 = dirty_map(200, rows30, sizeof(rows30) / sizeof(rows30[0]));
    uint64_t *fresh_all = dirty_range(130, 0, 129), *fresh30 = dirty_range(130, 3, 70);
    uint64_t *late_part = dirty_range(90, 0, 88);
    snprintf(dir, sizeof(dir), "%s/k%zu", fx->dir, k);
    assert_int_equal(mkdir(dir, 0755), 0);
    source_init(&t, "t", 200, 12, kinds[k].dtype, kinds[k].opt);
    source_init(&fresh, "fresh", 130, 12, kinds[k].dtype, kinds[k].opt);
    source_init(&late, "late", 90, 12, kinds[k].dtype, kinds[k].opt);

    source_fill(&t, 10, NULL);
    write_full(dir, 10, 2, &t);

    /* round 20: t's dirty rows, and "fresh", created since round 10, with every row */
    source_fill(&t, 20, d20);
    source_fill(&fresh, 21, NULL);
    {
      const source_t *tabs[2] = {&t, &fresh};
      const uint64_t *dirty[2] = {d20, fresh_all};
      write_ckpt(dir, 20, 10, "", 2, tabs, dirty, 2);
    }
    source_copy(&at20, &t);

    /* round 30: t's and fresh's dirty rows, and "late" with only some of its rows */
    source_fill(&t, 30, d30);
    source_fill(&fresh, 31, fresh30);
    source_fill(&late, 32, NULL);
    {
      const source_t *tabs[3] = {&t, &fresh, &late};
      const uint64_t *dirty[3] = {d30, fresh30, late_part};
      write_ckpt(dir, 30, 20, "", 2, tabs, dirty, 3);
    }

    /* an incremental file holds only its dirty rows */
    slice_path(full0, sizeof(full0), dir, 10, 0, "t");
    slice_path(inc0, sizeof(inc0), dir, 20, 0, "t");
    assert_true(file_size(inc0) < file_size(full0) / 4);

    for (uint32_t n = 1; n <= 4; n++)
      for (uint32_t j = 0; j < n; j++) {
        expect_range(dir, 30, &t, j * (12 / n), 12 / n);
        expect_range(dir, 20, &at20, j * (12 / n), 12 / n);
      }
    expect_range(dir, 30, &t, 5, 4);
    expect_range(dir, 30, &fresh, 0, 12);
    expect_range(dir, 30, &fresh, 6, 6);
    /* a table whose first checkpoint is incremental must have all its rows there */
    expect_read_error(dir, 30, &late, EMBPS_DATA_LOSS, "chain is broken", "does not hold all");

    /* the base gone: the chain cannot be read */
    {
      char ck[EMBPS_CKPT_PATH_MAX];
      embps_error_t err;
      ckpt_dir(ck, sizeof(ck), dir, 10);
      assert_int_equal(embps_ckpt_remove(ck, &err), EMBPS_OK);
      assert_false(exists(ck));
    }
    expect_read_error(dir, 30, &t, EMBPS_DATA_LOSS, "incremental checkpoint of round 20",
                      "applies on round 10");
    expect_read_error(dir, 20, &at20, EMBPS_DATA_LOSS, "incremental checkpoint of round 20",
                      "applies on round 10");

    source_free(&t);
    source_free(&at20);
    source_free(&fresh);
    source_free(&late);
    free(d20);
    free(d30);
    free(fresh_all);
    free(fresh30);
    free(late_part);
  }
}

/* A rank that could not track a table's written rows (out of memory) writes the table whole in
 * an incremental checkpoint: its slice's base round is 0 where the manifest's is not. The chain
 * still reads back, through it and through increments above it, on any group size. */
static void test_full_slice_in_increment(void **state) {
  const fixture_t *fx = *state;
  static const uint64_t rows30[] = {1, 63, 64, 99};
  char dir[128];
  source_t t, u, at20;
  uint64_t *u20 = dirty_range(100, 10, 19), *d30 = dirty_map(100, rows30, 4);
  snprintf(dir, sizeof(dir), "%s/whole", fx->dir);
  assert_int_equal(mkdir(dir, 0755), 0);
  source_init(&t, "t", 100, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  source_init(&u, "u", 100, 8, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAM);
  source_fill(&t, 10, NULL);
  source_fill(&u, 11, NULL);
  {
    const source_t *tabs[2] = {&t, &u};
    write_ckpt(dir, 10, 0, "", 2, tabs, NULL, 2);
  }
  /* round 20: t untracked, so whole (every row new); u incremental */
  source_fill(&t, 20, NULL);
  source_fill(&u, 21, u20);
  {
    const source_t *tabs[2] = {&t, &u};
    const uint64_t *dirty[2] = {NULL, u20};
    write_ckpt(dir, 20, 10, "", 2, tabs, dirty, 2);
  }
  source_copy(&at20, &t);
  /* round 30: t tracked again, a few rows */
  source_fill(&t, 30, d30);
  {
    const source_t *tabs[2] = {&t, &u};
    const uint64_t *dirty[2] = {d30, d30};
    source_fill(&u, 31, d30);
    write_ckpt(dir, 30, 20, "", 2, tabs, dirty, 2);
  }
  for (uint32_t n = 1; n <= 4; n *= 2)
    for (uint32_t j = 0; j < n; j++) {
      expect_range(dir, 20, &at20, j * (8 / n), 8 / n);
      expect_range(dir, 30, &t, j * (8 / n), 8 / n);
      expect_range(dir, 30, &u, j * (8 / n), 8 / n);
    }
  source_free(&t);
  source_free(&u);
  source_free(&at20);
  free(u20);
  free(d30);
}

/* A manifest whose base round is not older than its own round is a broken chain, not a loop. */
static void test_chain_loop(void **state) {
  const fixture_t *fx = *state;
  source_t t;
  char ck[EMBPS_CKPT_PATH_MAX];
  embps_ckpt_manifest_t m;
  embps_error_t err;
  source_init(&t, "t", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&t, 1, NULL);
  write_full(fx->dir, 5, 1, &t);
  ckpt_dir(ck, sizeof(ck), fx->dir, 5);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  m.base_round = 5;
  assert_int_equal(embps_ckpt_write_manifest(ck, &m, &err), EMBPS_OK);
  embps_ckpt_manifest_free(&m);
  expect_read_error(fx->dir, 5, &t, EMBPS_DATA_LOSS, "chain is broken", "round 5");
  source_free(&t);
}

/* --restore none / auto / a checkpoint's path. */
static void test_restore_choose(void **state) {
  const fixture_t *fx = *state;
  char dir[128], empty[128], rdir[EMBPS_CKPT_PATH_MAX], ck[EMBPS_CKPT_PATH_MAX + 8], cwd[512];
  source_t a;
  uint64_t round = 99;
  embps_error_t err;
  const source_t *tabs[1];

  source_init(&a, "a", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&a, 1, NULL);
  tabs[0] = &a;
  subdir(dir, sizeof(dir), fx->dir, "d");
  subdir(empty, sizeof(empty), fx->dir, "e");
  write_full(dir, 5, 1, &a);
  write_full(dir, 9, 1, &a);
  write_ckpt(dir, 12, 0, "a", 1, tabs, NULL, 1); /* newer, but of one table only */
  write_incomplete(dir, 15, &a);                 /* newer, but incomplete */

  /* none: nothing, whatever the directory holds */
  strcpy(rdir, "x");
  assert_int_equal(embps_ckpt_restore_choose("none", dir, rdir, sizeof(rdir), &round, &err),
                   EMBPS_OK);
  assert_int_equal(round, 0);
  assert_string_equal(rdir, "");

  /* auto: the newest complete checkpoint of every table */
  assert_int_equal(embps_ckpt_restore_choose("auto", dir, rdir, sizeof(rdir), &round, &err),
                   EMBPS_OK);
  assert_int_equal(round, 9);
  assert_string_equal(rdir, dir);
  /* auto, none there: the group starts empty, the directory still named */
  round = 99;
  assert_int_equal(embps_ckpt_restore_choose("auto", empty, rdir, sizeof(rdir), &round, &err),
                   EMBPS_OK);
  assert_int_equal(round, 0);
  assert_string_equal(rdir, empty);
  /* auto with checkpoints off: nothing looked for */
  round = 99;
  assert_int_equal(embps_ckpt_restore_choose("auto", "", rdir, sizeof(rdir), &round, &err),
                   EMBPS_OK);
  assert_int_equal(round, 0);
  assert_string_equal(rdir, "");
  /* auto in a directory that does not exist */
  snprintf(ck, sizeof(ck), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_restore_choose("auto", ck, rdir, sizeof(rdir), &round, &err),
                   EMBPS_NOT_FOUND);
  assert_true(has(err.message, ck));

  /* a path: that checkpoint (even one of one table), its parent the directory; trailing slashes
   * ignored */
  ckpt_dir(ck, sizeof(ck), dir, 12);
  strcat(ck, "//");
  assert_int_equal(embps_ckpt_restore_choose(ck, "", rdir, sizeof(rdir), &round, &err), EMBPS_OK);
  assert_int_equal(round, 12);
  assert_string_equal(rdir, dir);
  /* relative to the working directory */
  assert_non_null(getcwd(cwd, sizeof(cwd)));
  assert_int_equal(chdir(dir), 0);
  round = 99;
  assert_int_equal(
      embps_ckpt_restore_choose("ckpt-00000000000000000005", dir, rdir, sizeof(rdir), &round, &err),
      EMBPS_OK);
  assert_int_equal(chdir(cwd), 0);
  assert_int_equal(round, 5);
  assert_string_equal(rdir, ".");
  /* an incomplete one, or none at all, is refused with the reason */
  ckpt_dir(ck, sizeof(ck), dir, 15);
  assert_int_equal(embps_ckpt_restore_choose(ck, dir, rdir, sizeof(rdir), &round, &err),
                   EMBPS_NOT_FOUND);
  assert_true(has(err.message, "not a complete checkpoint"));
  ckpt_dir(ck, sizeof(ck), dir, 77);
  assert_int_equal(embps_ckpt_restore_choose(ck, dir, rdir, sizeof(rdir), &round, &err),
                   EMBPS_NOT_FOUND);
  assert_true(has(err.message, ck));
  source_free(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_read_refusals), T(test_incremental_chain), T(test_full_slice_in_increment),
      T(test_chain_loop),    T(test_restore_choose),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
