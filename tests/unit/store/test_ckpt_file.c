/* Durable files (server/store/ckpt_file.c): a file appears whole under its name or not at all
 * (committed: its bytes, no temporary left; abandoned or failed: the name as it was), errors name
 * the file, and a full disk reads as RESOURCE_EXHAUSTED. */
#include "tests/unit/store/ckpt_fixture.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/store/ckpt_internal.h"

static void test_no_space(void **state) {
  fixture_t *fx = *state;
  char mnt[160], path[256];
  source_t small, big;
  embps_ckpt_slice_t sl;
  embps_error_t err;
  uint8_t *before;
  size_t before_len;

  if (geteuid() != 0) {
    print_message("SKIP test_no_space: not root, cannot mount a small tmpfs\n");
    skip();
  }
  snprintf(mnt, sizeof(mnt), "%s/full", fx->dir);
  assert_int_equal(mkdir(mnt, 0755), 0);
  if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k") != 0) {
    print_message("SKIP test_no_space: cannot mount a tmpfs on %s: %s\n", mnt, strerror(errno));
    skip();
  }
  strcpy(fx->mnt, mnt);

  source_init(&small, "t", 10, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&small, 1, NULL);
  /* 512 KiB of rows: eight times what the file system holds */
  source_init(&big, "t", 16384, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&big, 2, NULL);
  snprintf(path, sizeof(path), "%s/r0-t.embps", mnt);
  sl = slice_of(&small, 0, 1, 1, 0, NULL);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_OK);
  slice_free(&sl);
  before = slurp(path, &before_len);

  sl = slice_of(&big, 0, 1, 2, 0, NULL);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_RESOURCE_EXHAUSTED);
  assert_true(has(err.message, "no space left on device"));
  assert_true(has(err.message, path));
  expect_dir(mnt, "r0-t.embps");
  {
    size_t n;
    uint8_t *now = slurp(path, &n);
    assert_int_equal(n, before_len);
    assert_memory_equal(now, before, n);
    free(now);
  }
  /* a new name: nothing of it stays */
  snprintf(path, sizeof(path), "%s/r1-t.embps", mnt);
  assert_int_equal(embps_ckpt_write_slice(path, &sl, NULL, &err), EMBPS_RESOURCE_EXHAUSTED);
  expect_dir(mnt, "r0-t.embps");
  slice_free(&sl);
  free(before);
  source_free(&small);
  source_free(&big);

  assert_int_equal(umount2(mnt, 0), 0);
  fx->mnt[0] = '\0';
}

static void test_commit_and_abandon(void **state) {
  const fixture_t *fx = *state;
  char path[256], tmp[264];
  embps__ckpt_out_t f = {.fd = -1};
  embps_error_t err;
  uint8_t *big = malloc(3u << 20), *got;
  size_t n;
  assert_non_null(big);
  for (size_t i = 0; i < (3u << 20); i++)
    big[i] = (uint8_t)(i * 7 + (i >> 13));
  snprintf(path, sizeof(path), "%s/f", fx->dir);
  snprintf(tmp, sizeof(tmp), "%s.tmp", path);

  /* small writes gathered, a large one straight through: the bytes in order, under the name */
  assert_int_equal(embps__ckpt_out_open(&f, path, &err), EMBPS_OK);
  assert_true(exists(tmp));
  assert_false(exists(path));
  assert_int_equal(embps__ckpt_out_write(&f, "head", 4, &err), EMBPS_OK);
  assert_int_equal(embps__ckpt_out_write(&f, big, 3u << 20, &err), EMBPS_OK);
  assert_int_equal(embps__ckpt_out_write(&f, "tail", 4, &err), EMBPS_OK);
  assert_int_equal(embps__ckpt_out_commit(&f, &err), EMBPS_OK);
  embps__ckpt_out_abandon(&f); /* after a commit: harmless */
  expect_dir(fx->dir, "f");
  got = slurp(path, &n);
  assert_int_equal(n, 8 + (3u << 20));
  assert_memory_equal(got, "head", 4);
  assert_memory_equal(got + 4, big, 3u << 20);
  assert_memory_equal(got + 4 + (3u << 20), "tail", 4);
  free(got);
  assert_int_equal(embps_ckpt_sync_dir(fx->dir, &err), EMBPS_OK);

  /* abandoned: the file already at the name is untouched, no temporary stays */
  assert_int_equal(embps__ckpt_out_open(&f, path, &err), EMBPS_OK);
  assert_int_equal(embps__ckpt_out_write(&f, "other", 5, &err), EMBPS_OK);
  embps__ckpt_out_abandon(&f);
  expect_dir(fx->dir, "f");
  assert_int_equal(file_size(path), 8 + (3u << 20));
  free(big);

  /* a directory that does not exist: the temporary file cannot be created, named */
  snprintf(path, sizeof(path), "%s/gone/f", fx->dir);
  f = (embps__ckpt_out_t){.fd = -1};
  assert_int_equal(embps__ckpt_out_open(&f, path, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, "cannot create"));
  assert_true(has(err.message, "gone/f.tmp"));
  embps__ckpt_out_abandon(&f);
  assert_int_equal(embps_ckpt_sync_dir(path, &err), EMBPS_INTERNAL);
  assert_true(has(err.message, path));
  expect_dir(fx->dir, "f");
}

static void test_errors_and_reads(void **state) {
  const fixture_t *fx = *state;
  char path[EMBPS_CKPT_PATH_MAX + 64], buf[8];
  embps__ckpt_out_t f = {.fd = -1};
  embps_error_t err;
  int fd;

  assert_int_equal(embps__ckpt_io_error(&err, ENOSPC, "write", "/x/y"), EMBPS_RESOURCE_EXHAUSTED);
  assert_string_equal(err.message, "no space left on device writing /x/y");
  assert_int_equal(embps__ckpt_io_error(&err, EDQUOT, "write", "/x/y"), EMBPS_RESOURCE_EXHAUSTED);
  assert_int_equal(embps__ckpt_io_error(&err, EIO, "fsync", "/x/y"), EMBPS_INTERNAL);
  assert_true(has(err.message, "cannot fsync /x/y: "));
  assert_true(has(err.message, strerror(EIO)));

  /* a name too long for its temporary name */
  memset(path, 'a', sizeof(path) - 1);
  path[sizeof(path) - 1] = '\0';
  assert_int_equal(embps__ckpt_out_open(&f, path, &err), EMBPS_INVALID_ARGUMENT);
  assert_true(has(err.message, "too long"));
  embps__ckpt_out_abandon(&f);

  /* whole reads: every byte asked for, or 0 at an early end */
  snprintf(path, sizeof(path), "%s/r", fx->dir);
  restore_file(path, (const uint8_t *)"12345", 5);
  assert_true((fd = open(path, O_RDONLY)) >= 0);
  assert_int_equal(embps__ckpt_read_all(fd, buf, 3), 1);
  assert_memory_equal(buf, "123", 3);
  assert_int_equal(embps__ckpt_read_all(fd, buf, 3), 0);
  close(fd);
  assert_int_equal(embps__ckpt_read_all(-1, buf, 1), -1);
  assert_int_equal(embps__ckpt_write_all(-1, buf, 1), -1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_commit_and_abandon),
      T(test_errors_and_reads),
      T(test_no_space),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
