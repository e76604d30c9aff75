/* The simulated NCCL backend (sim_nccl.c): what the CUDA server relies on when it runs on the
 * simulator. Ranks run as threads of this process, each on its own simulated device, and meet
 * through the unique id's loopback rendezvous: the collectives give the TCP backend's results on
 * device buffers, after the engine's stream has run (the inputs are written by copies still
 * queued on it when the call starts); a rank that never joins fails the others with
 * UNAVAILABLE within the timeout; two ranks on one device are refused as NCCL refuses them; ids
 * that are not the simulator's, or a rank 0 outside the process that made the id, are invalid;
 * a host pointer passed as a device buffer aborts with the simulator's message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "server/comm/comm.h"
#include "sim_cuda.h"

#define MAX_RANKS 4
#define COUNT 6 /* elements per rank and per block */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* A value that differs per rank, element and purpose, exact in f32. */
static float value(uint32_t rank, size_t i, int salt) {
  return (float)(rank * 100 + i) * 0.25f + (float)salt * 0.125f;
}

typedef struct rank_args {
  uint32_t rank, size;
  int device;
  const uint8_t *id;
  uint64_t timeout_ms;
  int run_collectives;
  /* results */
  embps_status_t status;
  embps_error_t err;
  char failure[640]; /* empty: the collectives gave the expected results */
} rank_args_t;

#define RANK_CHECK(a, cond, ...)                                                                   \
  do {                                                                                             \
    if (!(cond) && !(a)->failure[0])                                                               \
      snprintf((a)->failure, sizeof((a)->failure), __VA_ARGS__);                                   \
  } while (0)

/* Rank threads record the first failure instead of asserting (cmocka's assertions jump back
 * to the test on the main thread). */
#define CUDA_OK(a, call) RANK_CHECK(a, (call) == cudaSuccess, "%s failed", #call)

/* Copies host data to the device on `stream` without waiting: the communicator must run the
 * stream before it reads the buffer. */
static void upload(rank_args_t *a, cudaStream_t stream, void *dev, const void *host, size_t bytes) {
  CUDA_OK(a, cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
}

static void download(rank_args_t *a, void *host, const void *dev, size_t bytes) {
  CUDA_OK(a, cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

static void collectives(rank_args_t *a, embps_comm_t *c, cudaStream_t stream) {
  const uint32_t me = a->rank, n = a->size;
  float h_send[MAX_RANKS * COUNT], h_recv[MAX_RANKS * COUNT], h_sum[COUNT], expect;
  uint64_t h_max[COUNT];
  float *send, *recv, *sum;
  uint64_t *max;
  embps_error_t err;
  embps_comm_stats_t before = c->stats;

  if (cudaMalloc((void **)&send, sizeof(h_send)) != cudaSuccess ||
      cudaMalloc((void **)&recv, sizeof(h_recv)) != cudaSuccess ||
      cudaMalloc((void **)&sum, sizeof(h_sum)) != cudaSuccess ||
      cudaMalloc((void **)&max, sizeof(h_max)) != cudaSuccess) {
    RANK_CHECK(a, 0, "cudaMalloc failed");
    return;
  }

  /* all_gather: recv[r] = rank r's block */
  for (size_t i = 0; i < COUNT; i++)
    h_send[i] = value(me, i, 1);
  upload(a, stream, send, h_send, COUNT * sizeof(float));
  RANK_CHECK(a, embps_comm_all_gather(c, send, COUNT * sizeof(float), recv, &err) == EMBPS_OK,
             "all_gather: %.300s", err.message);
  download(a, h_recv, recv, n * COUNT * sizeof(float));
  for (uint32_t r = 0; r < n; r++)
    for (size_t i = 0; i < COUNT; i++)
      RANK_CHECK(a, h_recv[r * COUNT + i] == value(r, i, 1),
                 "all_gather: rank %u element %zu is %g", r, i, (double)h_recv[r * COUNT + i]);

  /* all_to_all: recv[r] = rank r's send[me] */
  for (uint32_t p = 0; p < n; p++)
    for (size_t i = 0; i < COUNT; i++)
      h_send[p * COUNT + i] = value(me, p * COUNT + i, 2);
  upload(a, stream, send, h_send, n * COUNT * sizeof(float));
  RANK_CHECK(a, embps_comm_all_to_all(c, send, COUNT * sizeof(float), recv, &err) == EMBPS_OK,
             "all_to_all: %.300s", err.message);
  download(a, h_recv, recv, n * COUNT * sizeof(float));
  for (uint32_t r = 0; r < n; r++)
    for (size_t i = 0; i < COUNT; i++)
      RANK_CHECK(a, h_recv[r * COUNT + i] == value(r, me * COUNT + i, 2),
                 "all_to_all: from rank %u element %zu is %g", r, i, (double)h_recv[r * COUNT + i]);

  /* all_reduce: f32 sum in rank order (bitwise on every rank), u64 max */
  for (size_t i = 0; i < COUNT; i++) {
    h_sum[i] = value(me, i, 3) / 3.0f;
    h_max[i] = (uint64_t)(me + 1) << (i * 8);
  }
  upload(a, stream, sum, h_sum, sizeof(h_sum));
  upload(a, stream, max, h_max, sizeof(h_max));
  RANK_CHECK(a,
             embps_comm_all_reduce(c, sum, COUNT, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err) == EMBPS_OK,
             "all_reduce sum: %.300s", err.message);
  RANK_CHECK(a,
             embps_comm_all_reduce(c, max, COUNT, EMBPS_COMM_U64, EMBPS_COMM_MAX, &err) == EMBPS_OK,
             "all_reduce max: %.300s", err.message);
  download(a, h_sum, sum, sizeof(h_sum));
  download(a, h_max, max, sizeof(h_max));
  for (size_t i = 0; i < COUNT; i++) {
    expect = value(0, i, 3) / 3.0f;
    for (uint32_t r = 1; r < n; r++)
      expect += value(r, i, 3) / 3.0f;
    RANK_CHECK(a, memcmp(&h_sum[i], &expect, sizeof(float)) == 0,
               "all_reduce sum element %zu is %.9g, not %.9g", i, (double)h_sum[i], (double)expect);
    RANK_CHECK(a, h_max[i] == (uint64_t)n << (i * 8), "all_reduce max element %zu is %llu", i,
               (unsigned long long)h_max[i]);
  }
  RANK_CHECK(a, embps_comm_barrier(c, &err) == EMBPS_OK, "barrier: %.300s", err.message);

  /* Bad arguments are refused before anything moves, with the real backend's words. */
  RANK_CHECK(a, embps_comm_all_to_all(c, send, COUNT, send, &err) == EMBPS_INVALID_ARGUMENT,
             "an in-place all_to_all was accepted");
  RANK_CHECK(a, strstr(err.message, "in place is not supported"), "all_to_all said: %.300s",
             err.message);
  RANK_CHECK(a,
             embps_comm_all_reduce(c, (char *)sum + 1, 1, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err) ==
                 EMBPS_INVALID_ARGUMENT,
             "a misaligned all_reduce was accepted");

  /* Payload counted as the TCP backend counts it: (n-1) blocks each way per collective. */
  RANK_CHECK(a,
             c->stats.bytes_sent - before.bytes_sent ==
                 (uint64_t)(n - 1) * (2 * COUNT * sizeof(float) + COUNT * (sizeof(float) + 8)),
             "bytes_sent grew by %llu",
             (unsigned long long)(c->stats.bytes_sent - before.bytes_sent));
  RANK_CHECK(a, sim_cuda_pending_device(a->device) == 0, "work still queued on device %d",
             a->device);

  CUDA_OK(a, cudaFree(send));
  CUDA_OK(a, cudaFree(recv));
  CUDA_OK(a, cudaFree(sum));
  CUDA_OK(a, cudaFree(max));
}

static void *rank_main(void *arg) {
  rank_args_t *a = arg;
  cudaStream_t stream;
  embps_comm_t *c = NULL;
  embps_error_clear(&a->err);
  if (cudaSetDevice(a->device) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    a->status = EMBPS_INTERNAL;
    RANK_CHECK(a, 0, "cannot open device %d", a->device);
    return NULL;
  }
  a->status = embps_comm_nccl_new(&c, a->rank, a->size, a->id, stream, a->timeout_ms, &a->err);
  if (a->status == EMBPS_OK) {
    RANK_CHECK(a,
               c && strcmp(c->ops->name, "nccl") == 0 && c->rank == a->rank && c->size == a->size,
               "the communicator is not rank %u of %u", a->rank, a->size);
    if (c && a->run_collectives)
      collectives(a, c, stream);
    embps_comm_free(c);
  } else {
    RANK_CHECK(a, c == NULL, "a failed creation handed out a communicator");
  }
  CUDA_OK(a, cudaStreamDestroy(stream));
  return NULL;
}

/* Runs ranks [first, first + count) of a size-rank communicator on the id, rank r on devices[r],
 * each in its own thread; waits for all. */
static void run_ranks(rank_args_t *args, uint32_t size, uint32_t first, uint32_t count,
                      const uint8_t *id, const int *devices, uint64_t timeout_ms, int collect) {
  pthread_t threads[MAX_RANKS];
  for (uint32_t i = 0; i < count; i++) {
    rank_args_t *a = &args[first + i];
    memset(a, 0, sizeof(*a));
    a->rank = first + i;
    a->size = size;
    a->device = devices[first + i];
    a->id = id;
    a->timeout_ms = timeout_ms;
    a->run_collectives = collect;
    assert_int_equal(pthread_create(&threads[i], NULL, rank_main, a), 0);
  }
  for (uint32_t i = 0; i < count; i++)
    assert_int_equal(pthread_join(threads[i], NULL), 0);
}

static void test_groups_of_one_to_four(void **state) {
  static const int devices[MAX_RANKS] = {2, 0, 3, 1};
  (void)state;
  for (uint32_t n = 1; n <= MAX_RANKS; n++) {
    uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
    rank_args_t args[MAX_RANKS];
    embps_error_t err;
    assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
    run_ranks(args, n, 0, n, id, devices, 20000, 1);
    for (uint32_t r = 0; r < n; r++) {
      if (args[r].status != EMBPS_OK)
        fail_msg("%u ranks: rank %u: %s", n, r, args[r].err.message);
      if (args[r].failure[0])
        fail_msg("%u ranks: rank %u: %s", n, r, args[r].failure);
    }
  }
}

static void test_rank_that_never_joins(void **state) {
  static const int devices[MAX_RANKS] = {0, 1, 2, 3};
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  rank_args_t args[MAX_RANKS];
  embps_error_t err;
  double t0;
  (void)state;

  /* Ranks 0 and 1 of 3 come, rank 2 never does: both fail within the timeout. */
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  t0 = now_ms();
  run_ranks(args, 3, 0, 2, id, devices, 400, 0);
  assert_true(now_ms() - t0 < 5000);
  assert_string_equal(args[0].failure, "");
  assert_int_equal(args[0].status, EMBPS_UNAVAILABLE);
  assert_non_null(strstr(args[0].err.message, "rank(s) 2 of 3 did not join within 400 ms"));
  assert_int_equal(args[1].status, EMBPS_UNAVAILABLE);

  /* Rank 0 never comes: rank 1 waits for the root's table and gives up. */
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  t0 = now_ms();
  run_ranks(args, 2, 1, 1, id, devices, 300, 0);
  assert_true(now_ms() - t0 < 5000);
  assert_int_equal(args[1].status, EMBPS_UNAVAILABLE);
  assert_non_null(strstr(args[1].err.message, "waiting for the root (rank 0)"));
}

static void test_duplicate_device_refused(void **state) {
  static const int devices[MAX_RANKS] = {1, 1, 0, 0};
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  rank_args_t args[MAX_RANKS];
  embps_error_t err;
  (void)state;
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  run_ranks(args, 2, 0, 2, id, devices, 5000, 0);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(args[r].status, EMBPS_INTERNAL);
    assert_non_null(strstr(args[r].err.message, "ranks 0 and 1 are both on CUDA device 1"));
  }
}

static void test_bad_ids(void **state) {
  static const int devices[MAX_RANKS] = {0, 1, 2, 3};
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  rank_args_t args[MAX_RANKS];
  embps_comm_t *c = NULL;
  embps_error_t err;
  (void)state;

  memset(id, 0, sizeof(id));
  run_ranks(args, 1, 0, 1, id, devices, 1000, 0);
  assert_int_equal(args[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(args[0].err.message, "not a unique id from the simulator"));

  /* An id's root belongs to the first rank 0 that takes it. */
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  run_ranks(args, 1, 0, 1, id, devices, 1000, 0);
  assert_int_equal(args[0].status, EMBPS_OK);
  run_ranks(args, 1, 0, 1, id, devices, 1000, 0);
  assert_int_equal(args[0].status, EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(args[0].err.message, "in the process that made the unique id"));

  assert_int_equal(embps_comm_nccl_new(&c, 2, 2, id, NULL, 1000, &err), EMBPS_INVALID_ARGUMENT);
  assert_null(c);
  assert_int_equal(embps_comm_nccl_unique_id(NULL, &err), EMBPS_INVALID_ARGUMENT);
}

/* A host buffer handed to a collective is a bug of the caller (NCCL would fault on the device):
 * the simulator aborts naming it. Runs in a child process. */
static void host_buffer_child(void) {
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  float host[4] = {0}, *dev;
  embps_comm_t *c = NULL;
  embps_error_t err;
  cudaStream_t stream;
  cudaSetDevice(0);
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaMalloc((void **)&dev, sizeof(host));
  if (embps_comm_nccl_unique_id(id, &err) != EMBPS_OK ||
      embps_comm_nccl_new(&c, 0, 1, id, stream, 1000, &err) != EMBPS_OK)
    return;
  embps_comm_all_gather(c, host, sizeof(host), dev, &err);
}

static void test_host_buffer_aborts(void **state) {
  int fds[2], status;
  char buf[4096];
  size_t have = 0;
  ssize_t got;
  pid_t pid;
  (void)state;
  assert_int_equal(pipe(fds), 0);
  fflush(NULL);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    host_buffer_child();
    _exit(0);
  }
  close(fds[1]);
  while (have < sizeof(buf) - 1 && (got = read(fds[0], buf + have, sizeof(buf) - 1 - have)) > 0)
    have += (size_t)got;
  buf[have] = '\0';
  close(fds[0]);
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
    fail_msg("a host buffer went through the simulated NCCL; child stderr: %s", buf);
  assert_non_null(strstr(buf, "nccl all_gather: send"));
  assert_non_null(strstr(buf, "is pageable host memory, not device memory"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_groups_of_one_to_four),    cmocka_unit_test(test_rank_that_never_joins),
      cmocka_unit_test(test_duplicate_device_refused), cmocka_unit_test(test_bad_ids),
      cmocka_unit_test(test_host_buffer_aborts),
  };
  sim_cuda_set_device_count(MAX_RANKS);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
