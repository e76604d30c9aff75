/* The simulator's hash-keyed table launchers (sim_kernels.c), which the CUDA engine's hash tables
 * run on in every build: through the simulated runtime they give the CPU references' bits
 * (gather by slot with slots -1 among stored ones, reset with state0 and state1, key order in
 * place), return the real launchers' statuses for the same bad arguments (as
 * tests/gpu/test_kernels_gpu.c expects of kernels/cuda/hash.cu), and abort with a message on
 * what a GPU would do silently: a slot outside the table, a slot reset twice, keys in host
 * memory. */
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

#define SLOTS 32
#define N 24
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

static void make_keys(int64_t *keys, int64_t *slots) {
  for (size_t i = 0; i < N; i++) {
    keys[i] = i % 4 == 0 ? 0 : (int64_t)(UINT64_C(0x9e3779b97f4a7c15) * (i + 1)); /* high bits */
    slots[i] = i % 3 == 0 ? -1 : (int64_t)((i * 7) % SLOTS);
  }
}

static void check_dtype(embps_dtype_t dtype, size_t width) {
  const size_t es = embps_dtype_size(dtype), row_bytes = width * es;
  unsigned char table[SLOTS * 128 * 4], want[N * 128 * 4], got[SLOTS * 128 * 4]; /* SLOTS > N */
  float s0[SLOTS * 128], s1[SLOTS * 128], g0[SLOTS * 128], g1[SLOTS * 128];
  int64_t keys[N], slots[N], order[N];
  make_keys(keys, slots);
  for (size_t k = 0; k < SLOTS * row_bytes; k++)
    table[k] = (unsigned char)(k * 13 + 1);
  for (size_t k = 0; k < SLOTS * width; k++)
    s0[k] = 1.0f + (float)k, s1[k] = -1.0f - (float)k;
  void *d_table = dev_upload(table, SLOTS * row_bytes);
  int64_t *d_keys = dev_upload(keys, sizeof(keys)), *d_slots = dev_upload(slots, sizeof(slots));
  float *d_s0 = dev_upload(s0, SLOTS * width * sizeof(float));
  float *d_s1 = dev_upload(s1, SLOTS * width * sizeof(float));
  void *d_out = NULL;
  assert_int_equal(cudaMalloc(&d_out, N * row_bytes), cudaSuccess);

  embps_hash_gather_cpu(table, dtype, width, keys, slots, N, want, 5, SEED, SCALE);
  assert_int_equal(
      embps_hash_gather_cuda(d_table, dtype, width, d_keys, d_slots, N, d_out, 5, SEED, SCALE, 0),
      EMBPS_OK);
  download(got, d_out, N * row_bytes);
  assert_memory_equal(got, want, N * row_bytes);

  /* Reset of N / 2 distinct slots (every other one, from the top) to the first keys. */
  int64_t fresh[N / 2];
  for (size_t i = 0; i < N / 2; i++)
    fresh[i] = (int64_t)(SLOTS - 1 - 2 * i);
  int64_t *d_fresh = dev_upload(fresh, sizeof(fresh));
  embps_hash_reset_cpu(table, dtype, width, s0, width, s1, 0.5f, fresh, keys, N / 2, 5, SEED,
                       SCALE);
  assert_int_equal(embps_hash_reset_cuda(d_table, dtype, width, d_s0, width, d_s1, 0.5f, d_fresh,
                                         d_keys, N / 2, 5, SEED, SCALE, 0),
                   EMBPS_OK);
  download(got, d_table, SLOTS * row_bytes);
  download(g0, d_s0, SLOTS * width * sizeof(float));
  download(g1, d_s1, SLOTS * width * sizeof(float));
  assert_memory_equal(got, table, SLOTS * row_bytes);
  assert_memory_equal(g0, s0, SLOTS * width * sizeof(float));
  assert_memory_equal(g1, s1, SLOTS * width * sizeof(float));

  assert_int_equal(embps_hash_order_cuda(d_keys, N, d_keys, 0), EMBPS_OK);
  download(order, d_keys, sizeof(order));
  for (size_t i = 0; i < N; i++)
    assert_true((uint64_t)order[i] == ((uint64_t)keys[i] ^ (UINT64_C(1) << 63)));

  void *bufs[] = {d_table, d_keys, d_slots, d_s0, d_s1, d_out, d_fresh};
  for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
    assert_int_equal(cudaFree(bufs[i]), cudaSuccess);
}

static void test_launchers_match_cpu(void **state) {
  (void)state;
  check_dtype(EMBPS_DTYPE_F32, 7);
  check_dtype(EMBPS_DTYPE_F32, 128);
  check_dtype(EMBPS_DTYPE_BF16, 7);
  check_dtype(EMBPS_DTYPE_BF16, 128);
}

/* The statuses of kernels/cuda/hash.cu for the same calls (nothing is enqueued, so the pointers
 * are never looked at). */
static void test_statuses(void **state) {
  (void)state;
  int64_t one[1] = {0};
  void *fake = (void *)(uintptr_t)4096;
  assert_int_equal(
      embps_hash_gather_cuda(fake, (embps_dtype_t)7, 4, one, one, 1, fake, 0, 1, 1.0f, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_hash_gather_cuda(fake, EMBPS_DTYPE_F32, 4, NULL, one, 1, fake, 0, 1, 1.0f, 0),
      EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_hash_gather_cuda(fake, EMBPS_DTYPE_F32, 4, one, one, 1, (char *)fake + 2,
                                          0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(
      embps_hash_gather_cuda(NULL, EMBPS_DTYPE_F32, 4, NULL, NULL, 0, NULL, 0, 1, 1.0f, 0),
      EMBPS_OK);
  assert_int_equal(embps_hash_reset_cuda(fake, EMBPS_DTYPE_F32, 8, fake, 3, NULL, 0.0f, one, one, 1,
                                         0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_hash_reset_cuda(fake, EMBPS_DTYPE_F32, 8, NULL, 1, NULL, 0.0f, one, one, 1,
                                         0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_hash_reset_cuda(fake, (embps_dtype_t)0, 8, NULL, 0, NULL, 0.0f, one, one,
                                         1, 0, 1, 1.0f, 0),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_hash_reset_cuda(NULL, EMBPS_DTYPE_F32, 0, NULL, 0, NULL, 0.0f, one, one, 1,
                                         0, 1, 1.0f, 0),
                   EMBPS_OK);
  assert_int_equal(embps_hash_order_cuda(NULL, 1, fake, 0), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_hash_order_cuda(NULL, 0, NULL, 0), EMBPS_OK);
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

/* A table of 4 slots of 8 floats; slots {2, s} and keys {5, 6} on the device. */
static void setup_small(int64_t s, float **table, int64_t **slots, int64_t **keys) {
  const int64_t h_slots[2] = {2, s}, h_keys[2] = {5, 6};
  assert_int_equal(cudaMalloc((void **)table, 4 * 8 * sizeof(float)), cudaSuccess);
  *slots = dev_upload(h_slots, sizeof(h_slots));
  *keys = dev_upload(h_keys, sizeof(h_keys));
}

static void gather_slot_outside(void) {
  float *table, *out;
  int64_t *slots, *keys;
  setup_small(4, &table, &slots, &keys);
  cudaMalloc((void **)&out, 2 * 8 * sizeof(float));
  embps_hash_gather_cuda(table, EMBPS_DTYPE_F32, 8, keys, slots, 2, out, 0, 1, 1.0f, 0);
  cudaDeviceSynchronize();
}

static void reset_slot_twice(void) {
  float *table;
  int64_t *slots, *keys;
  setup_small(2, &table, &slots, &keys);
  embps_hash_reset_cuda(table, EMBPS_DTYPE_F32, 8, NULL, 0, NULL, 0.0f, slots, keys, 2, 0, 1, 1.0f,
                        0);
  cudaDeviceSynchronize();
}

static void reset_slot_outside_state0(void) {
  float *table, *state0;
  int64_t *slots, *keys;
  setup_small(3, &table, &slots, &keys);
  cudaMalloc((void **)&state0, 3 * sizeof(float)); /* one per row, for 3 rows only */
  embps_hash_reset_cuda(table, EMBPS_DTYPE_F32, 8, state0, 1, NULL, 0.0f, slots, keys, 2, 0, 1,
                        1.0f, 0);
  cudaDeviceSynchronize();
}

static void gather_host_keys(void) {
  float *table, *out;
  int64_t *slots, *keys, host_keys[2] = {5, 6};
  setup_small(1, &table, &slots, &keys);
  cudaMalloc((void **)&out, 2 * 8 * sizeof(float));
  embps_hash_gather_cuda(table, EMBPS_DTYPE_F32, 8, host_keys, slots, 2, out, 0, 1, 1.0f, 0);
}

static void test_catches_misuse(void **state) {
  (void)state;
  expect_death(gather_slot_outside, "slots[1] = 4 is outside the table");
  expect_death(reset_slot_twice, "row 2 appears twice");
  expect_death(reset_slot_outside_state0, "rows[1] = 3 is outside state0");
  expect_death(gather_host_keys, "hash gather: keys");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_launchers_match_cpu),
      cmocka_unit_test(test_statuses),
      cmocka_unit_test(test_catches_misuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
