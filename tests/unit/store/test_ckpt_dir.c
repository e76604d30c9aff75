/* The checkpoint directory (server/store/ckpt_dir.c): names, listing (complete checkpoints only,
 * by round), pruning (retention per scope, chains kept, crash leftovers removed), and the
 * directory's check and lock. */
#include "tests/unit/store/ckpt_fixture.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_names(void **state) {
  char out[EMBPS_CKPT_PATH_MAX];
  (void)state;
  embps_ckpt_path(out, sizeof(out), "/x/y", 42);
  assert_string_equal(out, "/x/y/ckpt-00000000000000000042");
  embps_ckpt_path(out, sizeof(out), "d", UINT64_MAX);
  assert_string_equal(out, "d/ckpt-18446744073709551615");
  embps_ckpt_slice_name(out, sizeof(out), 3, "emb");
  assert_string_equal(out, "r3-emb.embps");
}

static void test_list_and_prune(void **state) {
  const fixture_t *fx = *state;
  char ck[EMBPS_CKPT_PATH_MAX], path[EMBPS_CKPT_PATH_MAX + 32];
  source_t a, t, a20;
  embps_ckpt_manifest_t *list, m;
  size_t n;
  embps_error_t err;
  uint64_t *d20 = dirty_range(70, 10, 20), *d30 = dirty_range(70, 60, 69);
  const source_t *tabs[1];
  const uint64_t *dirty[1];

  source_init(&a, "a", 70, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
  source_init(&t, "t", 70, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  tabs[0] = &a;

  source_fill(&a, 1, NULL);
  write_ckpt(fx->dir, 1, 0, "", 1, tabs, NULL, 1);
  write_incomplete(fx->dir, 3, &a);
  /* ...and one with a corrupt manifest: incomplete too */
  write_full(fx->dir, 4, 1, &a);
  ckpt_dir(ck, sizeof(ck), fx->dir, 4);
  snprintf(path, sizeof(path), "%s/MANIFEST", ck);
  flip_byte(path, 30);
  tabs[0] = &t;
  source_fill(&t, 5, NULL);
  write_ckpt(fx->dir, 5, 0, "t", 1, tabs, NULL, 1);
  /* a complete checkpoint copied under another round's name is not that round */
  write_full(fx->dir, 7, 1, &t);
  ckpt_dir(ck, sizeof(ck), fx->dir, 7);
  assert_int_equal(embps_ckpt_read_manifest(ck, &m, &err), EMBPS_OK);
  m.round = 8;
  assert_int_equal(embps_ckpt_write_manifest(ck, &m, &err), EMBPS_OK);
  embps_ckpt_manifest_free(&m);
  tabs[0] = &a;
  source_fill(&a, 10, NULL);
  write_ckpt(fx->dir, 10, 0, "", 1, tabs, NULL, 1);
  write_incomplete(fx->dir, 12, &a);
  tabs[0] = &t;
  source_fill(&t, 15, NULL);
  write_ckpt(fx->dir, 15, 0, "t", 1, tabs, NULL, 1);
  tabs[0] = &a;
  dirty[0] = d20;
  source_fill(&a, 20, d20);
  write_ckpt(fx->dir, 20, 10, "", 1, tabs, dirty, 1);
  source_copy(&a20, &a);
  tabs[0] = &t;
  source_fill(&t, 25, NULL);
  write_ckpt(fx->dir, 25, 0, "t", 1, tabs, NULL, 1);
  tabs[0] = &a;
  dirty[0] = d30;
  source_fill(&a, 30, d30);
  write_ckpt(fx->dir, 30, 20, "", 1, tabs, dirty, 1);
  write_incomplete(fx->dir, 40, &a); /* newer than every complete one: maybe being written */
  snprintf(path, sizeof(path), "%s/other", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  snprintf(path, sizeof(path), "%s/ckpt-0000000000000000000x", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);

  {
    static const uint64_t all[] = {1, 5, 10, 15, 20, 25, 30};
    expect_list(fx->dir, all, 7);
  }
  assert_int_equal(embps_ckpt_list(fx->dir, &list, &n, &err), EMBPS_OK);
  assert_int_equal(n, 7);
  assert_string_equal(list[1].scope, "t");
  assert_string_equal(list[4].scope, "");
  assert_int_equal(list[4].base_round, 10);
  assert_int_equal(list[6].base_round, 20);
  assert_int_equal(list[2].base_round, 0);
  assert_int_equal(list[6].group_size, 1);
  assert_int_equal(list[6].time_ms, UINT64_C(1700000000000) + 30);
  embps_ckpt_list_free(list, n);

  /* keep 2: rounds 30 and 20 of scope "", and 10 that they chain back to; 25 and 15 of "t";
   * the incomplete 3, 4, 7 and 12 go; 40 may still be being written and stays */
  assert_int_equal(embps_ckpt_prune(fx->dir, 2, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 15, 20, 25, 30};
    expect_list(fx->dir, kept, 5);
  }
  expect_dir(fx->dir, "ckpt-0000000000000000000x ckpt-00000000000000000010 "
                      "ckpt-00000000000000000015 ckpt-00000000000000000020 "
                      "ckpt-00000000000000000025 ckpt-00000000000000000030 "
                      "ckpt-00000000000000000040 other");
  expect_range(fx->dir, 30, &a, 0, 4);
  expect_range(fx->dir, 20, &a20, 1, 3);
  /* again: nothing more to do */
  assert_int_equal(embps_ckpt_prune(fx->dir, 2, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 15, 20, 25, 30};
    expect_list(fx->dir, kept, 5);
  }
  /* keep 1: 30 (and its chain 20, 10), 25 */
  assert_int_equal(embps_ckpt_prune(fx->dir, 1, &err), EMBPS_OK);
  {
    static const uint64_t kept[] = {10, 20, 25, 30};
    expect_list(fx->dir, kept, 4);
  }
  expect_range(fx->dir, 30, &a, 0, 4);

  /* a directory that does not exist */
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_list(path, &list, &n, &err), EMBPS_NOT_FOUND);
  assert_int_equal(n, 0);
  assert_true(has(err.message, path));

  source_free(&a);
  source_free(&a20);
  source_free(&t);
  free(d20);
  free(d30);
}

static void test_prune_keep_zero(void **state) {
  const fixture_t *fx = *state;
  char dir[128], empty[128];
  source_t a;
  embps_error_t err;
  source_init(&a, "a", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&a, 1, NULL);
  subdir(dir, sizeof(dir), fx->dir, "d");
  subdir(empty, sizeof(empty), fx->dir, "e");

  /* no complete checkpoint: nothing is removed, an incomplete one may be the first being
   * written */
  write_incomplete(dir, 2, &a);
  assert_int_equal(embps_ckpt_prune(dir, 2, &err), EMBPS_OK);
  expect_dir(dir, "ckpt-00000000000000000002");
  assert_int_equal(embps_ckpt_prune(empty, 2, &err), EMBPS_OK);
  expect_dir(empty, "");

  /* keep 0 keeps every complete checkpoint; what a crash left older than the newest complete
   * one is still removed (checkpoint.h: retention counts complete checkpoints) */
  write_full(dir, 1, 1, &a);
  write_full(dir, 3, 1, &a);
  write_full(dir, 5, 1, &a);
  write_full(dir, 6, 1, &a);
  assert_int_equal(embps_ckpt_prune(dir, 0, &err), EMBPS_OK);
  {
    static const uint64_t all[] = {1, 3, 5, 6};
    expect_list(dir, all, 4);
  }
  expect_dir(dir, "ckpt-00000000000000000001 ckpt-00000000000000000003 "
                  "ckpt-00000000000000000005 ckpt-00000000000000000006");
  source_free(&a);
}

static void test_dir_check(void **state) {
  fixture_t *fx = *state;
  char path[256];
  embps_error_t err;

  assert_int_equal(embps_ckpt_dir_check(fx->dir, &err), EMBPS_OK);
  expect_dir(fx->dir, ""); /* the probe is gone */

  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, path));
  assert_true(has(err.message, "does not exist"));

  snprintf(path, sizeof(path), "%s/file", fx->dir);
  restore_file(path, (const uint8_t *)"x", 1);
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, "not a directory"));
  assert_int_equal(unlink(path), 0);

  /* not writable: a read-only mount for root (whom permissions do not stop), else a mode */
  snprintf(path, sizeof(path), "%s/ro", fx->dir);
  assert_int_equal(mkdir(path, 0755), 0);
  if (geteuid() == 0) {
    if (mount("tmpfs", path, "tmpfs", MS_RDONLY, "size=16k") != 0) {
      print_message("SKIP test_dir_check (not writable): cannot mount a read-only tmpfs: %s\n",
                    strerror(errno));
      return;
    }
    strcpy(fx->mnt, path);
  } else {
    assert_int_equal(chmod(path, 0555), 0);
  }
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_FAILED_PRECONDITION);
  assert_true(has(err.message, path));
  assert_true(has(err.message, "not writable"));
  if (fx->mnt[0]) {
    assert_int_equal(umount2(path, 0), 0);
    fx->mnt[0] = '\0';
  } else {
    assert_int_equal(chmod(path, 0755), 0);
  }
  assert_int_equal(embps_ckpt_dir_check(path, &err), EMBPS_OK);
}

/* In a child process: tries to take dir's lock, reports status and message through the pipe. */
static void try_lock_in_child(const char *dir, embps_status_t *status, char *msg, size_t cap) {
  int p[2];
  pid_t pid;
  int wstatus;
  embps_error_t err;
  ssize_t r;
  assert_int_equal(pipe(p), 0);
  fflush(NULL);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int fd = -1;
    close(p[0]);
    memset(&err, 0, sizeof(err));
    err.status = embps_ckpt_dir_lock(dir, "the child", &fd, &err);
    if (write(p[1], &err, sizeof(err)) != (ssize_t)sizeof(err))
      _exit(2);
    _exit(0);
  }
  close(p[1]);
  r = read(p[0], &err, sizeof(err));
  close(p[0]);
  assert_int_equal(waitpid(pid, &wstatus, 0), pid);
  assert_true(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  assert_int_equal(r, sizeof(err));
  *status = err.status;
  snprintf(msg, cap, "%s", err.message);
}

static void test_dir_lock(void **state) {
  const fixture_t *fx = *state;
  char holder[64], path[256], msg[512];
  embps_status_t st;
  embps_error_t err;
  int fd = -1;
  uint8_t *text;
  size_t n;

  snprintf(holder, sizeof(holder), "pid %ld on host test, group of 4", (long)getpid());
  assert_int_equal(embps_ckpt_dir_lock(fx->dir, holder, &fd, &err), EMBPS_OK);
  assert_true(fd >= 0);
  snprintf(path, sizeof(path), "%s/LOCK", fx->dir);
  text = slurp(path, &n);
  assert_int_equal(n, strlen(holder) + 1);
  assert_memory_equal(text, holder, strlen(holder));
  assert_int_equal(text[n - 1], '\n');
  free(text);

  try_lock_in_child(fx->dir, &st, msg, sizeof(msg));
  assert_int_equal(st, EMBPS_FAILED_PRECONDITION);
  assert_true(has(msg, holder));
  assert_true(has(msg, fx->dir));
  /* the refused child did not overwrite the holder */
  text = slurp(path, &n);
  assert_memory_equal(text, holder, strlen(holder));
  free(text);

  /* released when closed: the next one takes it */
  close(fd);
  try_lock_in_child(fx->dir, &st, msg, sizeof(msg));
  assert_int_equal(st, EMBPS_OK);
  text = slurp(path, &n);
  assert_int_equal(n, strlen("the child\n"));
  assert_memory_equal(text, "the child\n", n);
  free(text);

  /* a directory that does not exist */
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_not_equal(embps_ckpt_dir_lock(path, holder, &fd, &err), EMBPS_OK);
  assert_true(has(err.message, path));
}

/* The newest few of many, as ListCheckpoints shows them. */
static void test_list_newest(void **state) {
  const fixture_t *fx = *state;
  embps_ckpt_manifest_t *list;
  size_t n;
  embps_error_t err;
  source_t a;
  char path[256];
  source_init(&a, "a", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD);
  source_fill(&a, 1, NULL);
  for (uint64_t r = 1; r <= 6; r++)
    write_full(fx->dir, r * 10, 1, &a);
  write_incomplete(fx->dir, 70, &a);
  assert_int_equal(embps_ckpt_list_newest(fx->dir, 3, &list, &n, &err), EMBPS_OK);
  assert_int_equal(n, 3);
  assert_int_equal(list[0].round, 40);
  assert_int_equal(list[1].round, 50);
  assert_int_equal(list[2].round, 60);
  assert_int_equal(list[2].num_tables, 1);
  assert_string_equal(list[2].tables[0].name, "a");
  embps_ckpt_list_free(list, n);
  /* fewer than asked: all of them */
  assert_int_equal(embps_ckpt_list_newest(fx->dir, 64, &list, &n, &err), EMBPS_OK);
  assert_int_equal(n, 6);
  assert_int_equal(list[0].round, 10);
  embps_ckpt_list_free(list, n);
  assert_int_equal(embps_ckpt_list_newest(fx->dir, 0, &list, &n, &err), EMBPS_OK);
  assert_int_equal(n, 0);
  embps_ckpt_list_free(list, n);
  snprintf(path, sizeof(path), "%s/gone", fx->dir);
  assert_int_equal(embps_ckpt_list_newest(path, 3, &list, &n, &err), EMBPS_NOT_FOUND);
  assert_int_equal(n, 0);
  source_free(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_names), T(test_list_and_prune), T(test_prune_keep_zero),
      T(test_list_newest),          T(test_dir_check),      T(test_dir_lock),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
