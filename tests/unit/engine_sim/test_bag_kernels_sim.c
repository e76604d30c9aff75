/* The simulator's launchers of the feature batches' bags (sim_kernels_tables.c), which the CUDA
 * engine's feature batches run on in every build: through the simulated runtime they give the
 * CPU references' bits (f32 and bf16, sum, weighted sum and mean, empty bags, padding ids, absent
 * hash keys, bags that start past position 0, and the expansion leaving positions in no bag
 * alone), return the real launchers' statuses for the same bad arguments (as
 * tests/gpu/test_kernels_gpu.c expects of kernels/cuda/pool.cu), and abort with a message on
 * what a GPU would do silently: a row outside the table, offsets that descend or run past the
 * ids, ids in host memory, an output too short for the bags. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/cuda/embps_kernels_cuda.h"
#include "sim_cuda.h"

#define ROWS 40
#define BAGS 24
#define MAXLEN 6
#define LEAD 3 /* positions before the first bag (offsets[0] = LEAD): in no bag */
#define SEED UINT64_C(77)
#define SCALE 0.05f

static void *dev_upload(const void *h, size_t bytes) {
  void *d = NULL;
  assert_int_equal(cudaMalloc(&d, bytes), cudaSuccess);
  assert_int_equal(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

static void download(void *h, const void *d, size_t bytes) {
  assert_int_equal(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

/* Bags of 0 to MAXLEN - 1 ids after LEAD positions in no bag: bag 2 empty, bag 5 padding only,
 * id 0 now and then inside the others, every third row -1 (an absent hash key). Returns the
 * positions, LEAD included. */
static size_t make_bags(int64_t *ids, int64_t *rows, float *weights, int64_t *offsets) {
  size_t n = LEAD;
  for (size_t i = 0; i < LEAD; i++)
    ids[i] = 1, rows[i] = 1, weights[i] = 1.0f;
  for (size_t k = 0; k < BAGS; k++) {
    const size_t len = k == 2 ? 0 : (k * 5 + 1) % MAXLEN;
    offsets[k] = (int64_t)n;
    for (size_t i = 0; i < len; i++, n++) {
      ids[n] = k == 5 || (k + i) % 7 == 3 ? 0 : (int64_t)((k * 11 + i * 3) % (ROWS - 1) + 1);
      rows[n] = n % 3 == 2 ? -1 : ids[n];
      weights[n] = (float)((int)((k + 2 * i) % 9) - 4) * 0.3125f + 0.1f;
    }
  }
  offsets[BAGS] = (int64_t)n;
  return n;
}

static void check_case(embps_dtype_t dtype, size_t width, int weighted, int mean) {
  const size_t es = embps_dtype_size(dtype);
  unsigned char table[ROWS * 128 * 4], want[BAGS * MAXLEN * 128 * 4 + LEAD * 128 * 4];
  unsigned char got[sizeof(want)];
  float g[BAGS * 128], pooled_want[BAGS * 128], pooled_got[BAGS * 128];
  float tmp[2 * 128], weights[LEAD + BAGS * MAXLEN];
  int64_t ids[LEAD + BAGS * MAXLEN], rows[LEAD + BAGS * MAXLEN], offsets[BAGS + 1];
  const size_t n = make_bags(ids, rows, weights, offsets);
  embps_init_rows_cpu(table, dtype, width, 0, ROWS, 2, SEED + 1, 0.5f);
  for (size_t k = 0; k < BAGS * width; k++)
    g[k] = (float)((int)(k % 23) - 11) * 0.0625f + 0.01f;
  void *d_table = dev_upload(table, ROWS * width * es);
  int64_t *d_ids = dev_upload(ids, n * sizeof(int64_t)), *d_rows = dev_upload(rows, n * 8);
  int64_t *d_offsets = dev_upload(offsets, sizeof(offsets));
  float *d_weights = dev_upload(weights, n * sizeof(float)), *d_g = dev_upload(g, sizeof(g));
  float *d_pooled = NULL;
  void *d_out = NULL;
  const float *w = weighted ? weights : NULL, *d_w = weighted ? d_weights : NULL;
  assert_int_equal(cudaMalloc((void **)&d_pooled, BAGS * width * sizeof(float)), cudaSuccess);

  embps_pool_bags_cpu(table, dtype, width, ids, rows, w, offsets, BAGS, mean, pooled_want, tmp, 5,
                      SEED, SCALE);
  assert_int_equal(embps_pool_bags_cuda(d_table, dtype, width, d_ids, d_rows, d_w, d_offsets, BAGS,
                                        mean, d_pooled, 5, SEED, SCALE, 0),
                   EMBPS_OK);
  download(pooled_got, d_pooled, BAGS * width * sizeof(float));
  assert_memory_equal(pooled_got, pooled_want, BAGS * width * sizeof(float));
  for (size_t j = 0; j < width; j++) /* the empty bag and the padding-only one pool to zeros */
    assert_true(pooled_got[2 * width + j] == 0.0f && pooled_got[5 * width + j] == 0.0f);

  /* The expansion: the LEAD positions in no bag keep the 0xAB both sides started from. */
  memset(want, 0xab, n * width * es);
  memset(got, 0xab, n * width * es);
  d_out = dev_upload(got, n * width * es);
  embps_expand_bags_cpu(g, width, ids, w, offsets, BAGS, mean, dtype, want);
  assert_int_equal(
      embps_expand_bags_cuda(d_g, width, d_ids, d_w, d_offsets, BAGS, mean, dtype, d_out, 0),
      EMBPS_OK);
  download(got, d_out, n * width * es);
  assert_memory_equal(got, want, n * width * es);
  for (size_t k = 0; k < LEAD * width * es; k++)
    assert_int_equal(got[k], 0xab);

  void *bufs[] = {d_table, d_ids, d_rows, d_offsets, d_weights, d_g, d_pooled, d_out};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    assert_int_equal(cudaFree(bufs[i]), cudaSuccess);
}

static void test_launchers_match_cpu(void **state) {
  static const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  static const size_t widths[] = {7, 128};
  (void)state;
  for (size_t d = 0; d < 2; d++)
    for (size_t wi = 0; wi < 2; wi++)
      for (int mode = 0; mode < 4; mode++) /* sum, weighted sum, mean, weighted mean */
        check_case(dtypes[d], widths[wi], mode & 1, mode >> 1);
}

/* The statuses of kernels/cuda/pool.cu for the same calls (nothing is enqueued, so the pointers
 * are never looked at). */
static void test_statuses(void **state) {
  (void)state;
  int64_t one[2] = {0, 0};
  float *f = (float *)(uintptr_t)4096;
  void *fake = (void *)(uintptr_t)4096;
  assert_int_equal(
      embps_pool_bags_cuda(fake, (embps_dtype_t)7, 4, one, one, NULL, one, 1, 0, f, 0, 1, 1.0f, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_pool_bags_cuda(fake, EMBPS_DTYPE_F32, 4, one, NULL, NULL, one, 1, 0, f, 0, 1, 1.0f, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_pool_bags_cuda(fake, EMBPS_DTYPE_F32, 4, one, one, NULL, NULL, 1, 0, f, 0, 1, 1.0f, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_pool_bags_cuda(fake, EMBPS_DTYPE_F32, 4, one, one, NULL, one, 1, 0, NULL,
                                        0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_pool_bags_cuda((char *)fake + 2, EMBPS_DTYPE_F32, 4, one, one, NULL, one,
                                        1, 0, f, 0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_pool_bags_cuda(NULL, EMBPS_DTYPE_F32, 4, NULL, NULL, NULL, NULL, 0, 0,
                                        NULL, 0, 1, 1.0f, 0),
                   EMBPS_OK);
  assert_int_equal(embps_pool_bags_cuda(NULL, EMBPS_DTYPE_BF16, 0, NULL, NULL, NULL, NULL, 3, 1,
                                        NULL, 0, 1, 1.0f, 0),
                   EMBPS_OK);
  assert_int_equal(embps_expand_bags_cuda(f, 4, one, NULL, one, 1, 0, (embps_dtype_t)0, fake, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_expand_bags_cuda(NULL, 4, one, NULL, one, 1, 0, EMBPS_DTYPE_F32, fake, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_expand_bags_cuda(f, 4, NULL, NULL, one, 1, 1, EMBPS_DTYPE_F32, fake, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_expand_bags_cuda(f, 4, one, NULL, one, 1, 0, EMBPS_DTYPE_BF16, (char *)fake + 1, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_expand_bags_cuda(NULL, 4, NULL, NULL, NULL, 0, 0, EMBPS_DTYPE_F32, NULL, 0), EMBPS_OK);
}

/* Runs fn in a child process and requires it to die with `message` on its stderr. */
static void expect_death(void (*fn)(void), const char *message) {
  int fds[2], status;
  char buf[4096];
  size_t have = 0;
  ssize_t got;
  pid_t pid;
  assert_int_equal(pipe(fds), 0);
  fflush(NULL);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    signal(SIGSEGV, SIG_DFL);
    fn();
    _exit(0);
  }
  close(fds[1]);
  while (have < sizeof(buf) - 1 && (got = read(fds[0], buf + have, sizeof(buf) - 1 - have)) > 0)
    have += (size_t)got;
  buf[have] = '\0';
  close(fds[0]);
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
    fail_msg("the simulator let this through (expected \"%s\"); child stderr: %s", message, buf);
  if (!strstr(buf, message))
    fail_msg("expected \"%s\" on the child's stderr, got: %s", message, buf);
}

/* Two bags over 4 positions (offsets as given) of a table of 4 rows of 8 floats on the device:
 * ids {1, 2, 0, 3}, rows {1, r, 7, 3} (row 7 is a padding id's: never read). */
static void pool_small(int64_t r, const int64_t h_offsets[3], int host_ids) {
  const int64_t h_ids[4] = {1, 2, 0, 3}, h_rows[4] = {1, r, 7, 3};
  float *table, *out;
  assert_int_equal(cudaMalloc((void **)&table, 4 * 8 * sizeof(float)), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&out, 2 * 8 * sizeof(float)), cudaSuccess);
  int64_t *ids = host_ids ? (int64_t *)h_ids : dev_upload(h_ids, sizeof(h_ids));
  int64_t *rows = dev_upload(h_rows, sizeof(h_rows)), *offsets = dev_upload(h_offsets, 24);
  embps_pool_bags_cuda(table, EMBPS_DTYPE_F32, 8, ids, rows, NULL, offsets, 2, 0, out, 0, 1, 1.0f,
                       0);
  cudaDeviceSynchronize();
  void *bufs[] = {table, out, host_ids ? NULL : ids, rows, offsets};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    cudaFree(bufs[i]);
}

static const int64_t good_offsets[3] = {0, 2, 4};

static void pool_row_outside(void) { pool_small(4, good_offsets, 0); }
static void pool_row_below(void) { pool_small(-2, good_offsets, 0); }
static void pool_offsets_descend(void) {
  const int64_t off[3] = {0, 3, 2};
  pool_small(2, off, 0);
}
static void pool_offsets_past_ids(void) {
  const int64_t off[3] = {0, 2, 5};
  pool_small(2, off, 0);
}
static void pool_host_ids(void) { pool_small(2, good_offsets, 1); }

static void expand_out_short(void) {
  const int64_t h_ids[4] = {1, 2, 0, 3};
  float *g, *out;
  assert_int_equal(cudaMalloc((void **)&g, 2 * 8 * sizeof(float)), cudaSuccess);
  assert_int_equal(cudaMalloc((void **)&out, 3 * 8 * sizeof(float)), cudaSuccess); /* 4 needed */
  int64_t *ids = dev_upload(h_ids, sizeof(h_ids)), *offsets = dev_upload(good_offsets, 24);
  embps_expand_bags_cuda(g, 8, ids, NULL, offsets, 2, 1, EMBPS_DTYPE_F32, out, 0);
  cudaDeviceSynchronize();
}

/* A padding id's row is never read: pool_small with good rows except the padding position's 7
 * (outside the table) goes through. */
static void test_padding_row_unread(void **state) {
  (void)state;
  pool_small(2, good_offsets, 0);
}

static void test_catches_misuse(void **state) {
  (void)state;
  expect_death(pool_row_outside, "rows[1] = 4 is neither -1 nor a row of the table");
  expect_death(pool_row_below, "rows[1] = -2 is neither -1 nor a row of the table");
  expect_death(pool_offsets_descend, "offsets[2] = 2 is below offsets[1] = 3");
  expect_death(pool_offsets_past_ids, "offsets[2] = 5 is beyond ids (4 ids)");
  expect_death(pool_host_ids, "not device memory");
  expect_death(expand_out_short, "offsets[2] = 4 is beyond out (3 rows of 32 bytes)");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_launchers_match_cpu),
      cmocka_unit_test(test_statuses),
      cmocka_unit_test(test_padding_row_unread),
      cmocka_unit_test(test_catches_misuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
