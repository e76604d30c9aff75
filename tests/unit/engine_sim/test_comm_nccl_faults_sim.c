/* The failure paths of the real NCCL backend (server/comm/comm_nccl.c) on the simulated NCCL
 * library (sim_nccl_lib.c), which tests/gpu/test_comm_nccl.c does not reach: a rank that never
 * joins fails the creation with UNAVAILABLE within the timeout; a peer that frees its
 * communicator makes the next collective fail with UNAVAILABLE at once (NCCL reports a remote
 * error: the path through ncclCommGetAsyncError, not the timeout) and every later call fail at
 * once; two ranks on one device are refused; a rank whose all_reduce scratch allocation fails
 * gets RESOURCE_EXHAUSTED while its peer times out, and the group then fails instead of hanging.
 * Ranks run as threads of this process, each on its own simulated device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "server/comm/comm.h"
#include "sim_cuda.h"

#define RANKS 2

typedef enum scenario { PEER_EXITS, DUPLICATE_DEVICE, SCRATCH_EXHAUSTED } scenario_t;

typedef struct rank_args {
  uint32_t rank;
  int device;
  const uint8_t *id;
  uint64_t timeout_ms;
  scenario_t scenario;
  pthread_barrier_t *sync;
  /* results */
  embps_status_t create, first, second; /* creation, the failing call, the call after it */
  embps_error_t first_err, second_err;
  uint64_t first_ms, second_ms;
  char failure[700];
} rank_args_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#define RANK_CHECK(a, cond, ...)                                                                   \
  do {                                                                                             \
    if (!(cond) && !(a)->failure[0])                                                               \
      snprintf((a)->failure, sizeof((a)->failure), __VA_ARGS__);                                   \
  } while (0)

static void *rank_main(void *p) {
  rank_args_t *a = p;
  cudaStream_t stream = NULL;
  embps_comm_t *c = NULL;
  embps_error_t err;
  void *buf = NULL;
  RANK_CHECK(a, cudaSetDevice(a->device) == cudaSuccess, "cudaSetDevice");
  RANK_CHECK(a, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess,
             "cudaStreamCreateWithFlags");
  RANK_CHECK(a, cudaMalloc(&buf, 4000) == cudaSuccess, "cudaMalloc");
  RANK_CHECK(a, cudaMemsetAsync(buf, 0, 4000, stream) == cudaSuccess, "cudaMemsetAsync");
  a->create = embps_comm_nccl_new(&c, a->rank, RANKS, a->id, stream, a->timeout_ms, &err);
  if (a->create != EMBPS_OK) {
    snprintf(a->first_err.message, sizeof a->first_err.message, "%s", err.message);
    goto exit;
  }
  RANK_CHECK(a, embps_comm_barrier(c, &err) == EMBPS_OK, "first barrier: %s", err.message);
  if (a->scenario == PEER_EXITS) {
    if (a->rank == 1) {
      embps_comm_free(c);
      c = NULL;
    }
    pthread_barrier_wait(a->sync);
    if (a->rank == 0) {
      uint64_t t0 = now_ms();
      a->first = embps_comm_all_gather(c, buf, 1000, (uint8_t *)buf + 2000, &a->first_err);
      a->first_ms = now_ms() - t0;
    }
  } else if (a->scenario == SCRATCH_EXHAUSTED) {
    if (a->rank == 0) /* what is live, and not the 8000 bytes of scratch */
      sim_cuda_set_memory_limit(a->device, 4000 + 1 + 1000);
    uint64_t t0 = now_ms();
    a->first = embps_comm_all_reduce(c, buf, 1000, EMBPS_COMM_F32, EMBPS_COMM_SUM, &a->first_err);
    a->first_ms = now_ms() - t0;
    if (a->rank == 0)
      sim_cuda_set_memory_limit(a->device, 0);
    pthread_barrier_wait(a->sync);
  }
  if (c && a->rank == 0) {
    uint64_t t0 = now_ms();
    a->second = embps_comm_barrier(c, &a->second_err);
    a->second_ms = now_ms() - t0;
  }
exit:
  embps_comm_free(c);
  RANK_CHECK(a, cudaFree(buf) == cudaSuccess, "cudaFree");
  if (stream)
    RANK_CHECK(a, cudaStreamDestroy(stream) == cudaSuccess, "cudaStreamDestroy");
  return NULL;
}

static void run_ranks(rank_args_t *a, int n, scenario_t scenario, const int *devices,
                      uint64_t timeout_ms) {
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  embps_error_t err;
  pthread_t threads[RANKS];
  pthread_barrier_t sync;
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  pthread_barrier_init(&sync, NULL, (unsigned)n);
  for (int r = 0; r < n; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].rank = (uint32_t)r;
    a[r].device = devices[r];
    a[r].id = id;
    a[r].timeout_ms = timeout_ms;
    a[r].scenario = scenario;
    a[r].sync = &sync;
    assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &a[r]), 0);
  }
  for (int r = 0; r < n; r++)
    pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&sync);
  for (int r = 0; r < n; r++)
    if (a[r].failure[0])
      fail_msg("rank %d: %s", r, a[r].failure);
}

/* Only rank 0 of 2 starts: its creation fails with UNAVAILABLE after the timeout, not before
 * and not much after, and leaves *out untouched. */
static void test_rank_that_never_joins(void **state) {
  (void)state;
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  embps_error_t err;
  cudaStream_t stream;
  embps_comm_t *sentinel = (embps_comm_t *)(uintptr_t)0x1, *c = sentinel;
  assert_int_equal(embps_comm_nccl_unique_id(id, &err), EMBPS_OK);
  assert_int_equal(cudaSetDevice(0), cudaSuccess);
  assert_int_equal(cudaStreamCreate(&stream), cudaSuccess);
  uint64_t t0 = now_ms();
  embps_status_t st = embps_comm_nccl_new(&c, 0, 2, id, stream, 500, &err);
  uint64_t waited = now_ms() - t0;
  assert_int_equal(st, EMBPS_UNAVAILABLE);
  assert_ptr_equal(c, sentinel);
  assert_true(waited >= 500 && waited < 3000);
  assert_non_null(strstr(err.message, "initialization timed out after 500 ms"));
  assert_non_null(strstr(err.message, "rank 1"));
  size_t allocs = 1;
  sim_cuda_live(0, &allocs, NULL, NULL, NULL);
  assert_int_equal(allocs, 0); /* the barrier's token was freed */
  assert_int_equal(cudaStreamDestroy(stream), cudaSuccess);
}

/* Rank 1 frees its communicator; rank 0's next all_gather fails with UNAVAILABLE through
 * NCCL's remote error, long before the 30 s timeout, naming rank 1; its next call fails at
 * once with the same status. */
static void test_peer_exits(void **state) {
  (void)state;
  rank_args_t a[RANKS];
  static const int devices[RANKS] = {0, 1};
  run_ranks(a, RANKS, PEER_EXITS, devices, 30000);
  assert_int_equal(a[0].create, EMBPS_OK);
  assert_int_equal(a[1].create, EMBPS_OK);
  assert_int_equal(a[0].first, EMBPS_UNAVAILABLE);
  assert_true(a[0].first_ms < 5000);
  assert_non_null(strstr(a[0].first_err.message, "all_gather failed"));
  assert_non_null(strstr(a[0].first_err.message, "remote process exited"));
  assert_non_null(strstr(a[0].first_err.message, "rank 1"));
  assert_int_equal(a[0].second, EMBPS_UNAVAILABLE);
  assert_non_null(strstr(a[0].second_err.message, "earlier failure"));
  assert_true(a[0].second_ms < 1000);
}

/* Two ranks on one device: NCCL refuses the group, so both creations fail with UNAVAILABLE
 * (long before the timeout). */
static void test_duplicate_device(void **state) {
  (void)state;
  rank_args_t a[RANKS];
  static const int devices[RANKS] = {0, 0};
  uint64_t t0 = now_ms();
  run_ranks(a, RANKS, DUPLICATE_DEVICE, devices, 30000);
  assert_true(now_ms() - t0 < 5000);
  for (int r = 0; r < RANKS; r++) {
    assert_int_equal(a[r].create, EMBPS_UNAVAILABLE);
    assert_non_null(strstr(a[r].first_err.message, "Duplicate GPU"));
  }
}

/* Rank 0 cannot grow its all_reduce scratch: RESOURCE_EXHAUSTED for it, UNAVAILABLE for rank 1
 * after the timeout; rank 0's next call then fails too (its peer gave up) instead of hanging. */
static void test_scratch_exhausted(void **state) {
  (void)state;
  rank_args_t a[RANKS];
  static const int devices[RANKS] = {0, 1};
  run_ranks(a, RANKS, SCRATCH_EXHAUSTED, devices, 1000);
  assert_int_equal(a[0].first, EMBPS_RESOURCE_EXHAUSTED);
  assert_int_equal(a[1].first, EMBPS_UNAVAILABLE);
  assert_true(a[1].first_ms >= 1000 && a[1].first_ms < 4000);
  assert_int_equal(a[0].second, EMBPS_UNAVAILABLE);
  assert_true(a[0].second_ms < 4000);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rank_that_never_joins),
      cmocka_unit_test(test_peer_exits),
      cmocka_unit_test(test_duplicate_device),
      cmocka_unit_test(test_scratch_exhausted),
  };
  sim_cuda_set_device_count(RANKS);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
