/* The NCCL collectives (server/comm/comm_nccl.c) against host references.
 *
 * With one visible device: a 1-rank communicator on device 0. With two or more: that, then 2
 * ranks in 2 threads (devices 0 and 1) with their own communicators (TEST_COMM_NCCL_RANKS ranks
 * on devices 0..TEST_COMM_NCCL_RANKS-1 when the build defines it, as the simulated build's
 * 4-rank variant does). Each rank checks every op against what the TCP backend's contract says
 * it must produce: all_gather (in and out of place, several sizes), all_to_all (equal blocks),
 * all_reduce for f32/f64/u64 sum and max compared BITWISE with a host reduction in rank order
 * 0..size-1 (inputs span many binades, so an f32 sum in another order would round differently
 * once there are 3 or more ranks), barrier, rejected arguments that leave the communicator
 * usable, and the payload stats. With several ranks the all_reduce results must also be
 * bitwise identical across ranks, and a communicator that rank 1 abandons must fail rank 0's
 * barrier with EMBPS_UNAVAILABLE naming rank 1 (with more ranks, the ranks it suspects) within
 * the timeout, and its next call at once.
 *
 * Device buffers are filled with a marker before every op, so a block the op forgot to write
 * shows up. All test-side copies run on the communicator's stream and are synchronized, so
 * they are ordered with the collectives.
 *
 * Without a visible CUDA device the program prints one "SKIP: ..." line and exits with 77,
 * which ctest reports as skipped (SKIP_RETURN_CODE). */
#include <cuda_runtime_api.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/gpu/gpu_test_util.h"
#include "server/comm/comm.h"

#ifndef TEST_COMM_NCCL_RANKS
#define TEST_COMM_NCCL_RANKS 2
#endif
#define MAX_RANKS TEST_COMM_NCCL_RANKS
#define TIMEOUT_MS 60000      /* a bound so a broken build fails instead of hanging */
#define FAULT_TIMEOUT_MS 5000 /* the abandoned communicator's bound */
#define MARK 0xEE             /* device bytes before an op writes them */

typedef struct rank_ctx {
  uint32_t rank, size;
  int device;
  const uint8_t *id;       /* the communicator every check uses */
  const uint8_t *fault_id; /* several ranks only: the communicator rank 1 abandons */
  pthread_barrier_t *sync; /* several ranks only */
  cudaStream_t stream;
  int failures;
  uint8_t *reduced; /* every all_reduce result, concatenated, for the cross-rank comparison */
  size_t reduced_len;
} rank_ctx_t;

#define CHECK(ctx, cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "FAIL rank %u/%u %s:%d: ", (ctx)->rank, (ctx)->size, __FILE__, __LINE__);    \
      fprintf(stderr, __VA_ARGS__);                                                                \
      fputc('\n', stderr);                                                                         \
      (ctx)->failures++;                                                                           \
    }                                                                                              \
  } while (0)

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "FATAL: out of host memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- device helpers (all on the rank's stream, synchronized) ------------------------------- */

static uint8_t *dev_alloc(size_t n) {
  void *p = NULL;
  CUDA_OK(cudaMalloc(&p, n ? n : 1));
  return p;
}

static void dev_fill(rank_ctx_t *ctx, void *d, int byte, size_t n) {
  CUDA_OK(cudaMemsetAsync(d, byte, n, ctx->stream));
  CUDA_OK(cudaStreamSynchronize(ctx->stream));
}

static void to_dev(rank_ctx_t *ctx, void *d, const void *h, size_t n) {
  CUDA_OK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, ctx->stream));
  CUDA_OK(cudaStreamSynchronize(ctx->stream));
}

static void to_host(rank_ctx_t *ctx, void *h, const void *d, size_t n) {
  CUDA_OK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, ctx->stream));
  CUDA_OK(cudaStreamSynchronize(ctx->stream));
}

/* ---- inputs every rank can compute for every rank ------------------------------------------ */

static uint64_t mix(uint64_t z) {
  z += UINT64_C(0x9e3779b97f4a7c15);
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* The i-th random word of rank r's input for case c. */
static uint64_t word(uint32_t r, uint64_t c, size_t i) {
  return mix(mix(mix((uint64_t)r + 1) ^ c) ^ (uint64_t)i);
}

static uint8_t gather_byte(uint32_t r, size_t i, size_t bytes) {
  return (uint8_t)(r * 151u + i * 7u + bytes * 3u + 1u);
}

static uint8_t a2a_byte(uint32_t from, uint32_t to, size_t i) {
  return (uint8_t)(from * 97u + to * 31u + i * 5u + 11u);
}

/* Rank r's all_reduce input of count elements: finite f32/f64 over binades 2^-20..2^20 with
 * random signs (sums then round differently in different orders), full-range u64 (sums wrap). */
static void reduce_input(void *out, embps_comm_type_t type, uint64_t c, uint32_t r, size_t count) {
  for (size_t i = 0; i < count; i++) {
    uint64_t w = word(r, c, i);
    if (type == EMBPS_COMM_F32) {
      uint32_t e = (uint32_t)(127 - 20 + (w >> 32) % 41);
      uint32_t bits = (uint32_t)((w >> 63) << 31) | (e << 23) | (uint32_t)(w & 0x7fffffu);
      memcpy((uint8_t *)out + i * 4, &bits, 4);
    } else if (type == EMBPS_COMM_F64) {
      uint64_t e = 1023 - 20 + (mix(w) % 41);
      uint64_t bits = ((w >> 63) << 63) | (e << 52) | (w & ((UINT64_C(1) << 52) - 1));
      memcpy((uint8_t *)out + i * 8, &bits, 8);
    } else {
      memcpy((uint8_t *)out + i * 8, &w, 8);
    }
  }
}

/* The TCP backend's reduction: out = block 0, then out = out (op) block r for r = 1..size-1. */
#define DEFINE_REF(name, T, COMBINE)                                                               \
  static void name(T *out, const uint8_t *blocks, size_t count, uint32_t size) {                   \
    const T *b0 = (const T *)blocks;                                                               \
    for (size_t i = 0; i < count; i++)                                                             \
      out[i] = b0[i];                                                                              \
    for (uint32_t r = 1; r < size; r++) {                                                          \
      const T *br = (const T *)(blocks + (size_t)r * count * sizeof(T));                           \
      for (size_t i = 0; i < count; i++) {                                                         \
        T a = out[i], b = br[i];                                                                   \
        out[i] = COMBINE;                                                                          \
      }                                                                                            \
    }                                                                                              \
  }
DEFINE_REF(ref_f32_sum, float, a + b)
DEFINE_REF(ref_f32_max, float, b > a ? b : a)
DEFINE_REF(ref_f64_sum, double, a + b)
DEFINE_REF(ref_f64_max, double, b > a ? b : a)
DEFINE_REF(ref_u64_sum, uint64_t, a + b)
DEFINE_REF(ref_u64_max, uint64_t, b > a ? b : a)

static void reference(void *out, const uint8_t *blocks, size_t count, uint32_t size,
                      embps_comm_type_t type, embps_comm_op_t op) {
  bool sum = op == EMBPS_COMM_SUM;
  if (type == EMBPS_COMM_F32)
    (sum ? ref_f32_sum : ref_f32_max)(out, blocks, count, size);
  else if (type == EMBPS_COMM_F64)
    (sum ? ref_f64_sum : ref_f64_max)(out, blocks, count, size);
  else
    (sum ? ref_u64_sum : ref_u64_max)(out, blocks, count, size);
}

static const char *type_name(embps_comm_type_t t) {
  return t == EMBPS_COMM_F32 ? "f32" : t == EMBPS_COMM_F64 ? "f64" : "u64";
}

/* ---- the checks ----------------------------------------------------------------------------- */

typedef struct expect {
  uint64_t calls, bytes; /* bytes: sent and received alike */
} expect_t;

static void check_all_gather(rank_ctx_t *ctx, embps_comm_t *c, expect_t *x) {
  static const size_t sizes[] = {1, 13, 4099, 1 << 20};
  uint32_t me = ctx->rank, n = ctx->size;
  embps_error_t err;
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t bytes = sizes[k];
    uint8_t *h_send = xmalloc(bytes), *h_recv = xmalloc(bytes * n);
    for (size_t i = 0; i < bytes; i++)
      h_send[i] = gather_byte(me, i, bytes);
    uint8_t *d_send = dev_alloc(bytes), *d_recv = dev_alloc(bytes * n);
    for (int in_place = 0; in_place < 2; in_place++) {
      dev_fill(ctx, d_recv, MARK, bytes * n);
      const uint8_t *send = d_send;
      if (in_place) {
        to_dev(ctx, d_recv + (size_t)me * bytes, h_send, bytes);
        send = d_recv + (size_t)me * bytes;
      } else {
        to_dev(ctx, d_send, h_send, bytes);
      }
      embps_status_t st = embps_comm_all_gather(c, send, bytes, d_recv, &err);
      CHECK(ctx, st == EMBPS_OK, "all_gather(%zu bytes, in_place %d): %s: %s", bytes, in_place,
            embps_status_str(st), err.message);
      x->calls++;
      x->bytes += (uint64_t)(n - 1) * bytes;
      to_host(ctx, h_recv, d_recv, bytes * n);
      size_t bad = SIZE_MAX;
      for (uint32_t q = 0; q < n && bad == SIZE_MAX; q++)
        for (size_t i = 0; i < bytes; i++)
          if (h_recv[(size_t)q * bytes + i] != gather_byte(q, i, bytes)) {
            bad = (size_t)q * bytes + i;
            break;
          }
      CHECK(ctx, bad == SIZE_MAX, "all_gather(%zu bytes, in_place %d): recv[%zu] = 0x%02x", bytes,
            in_place, bad, bad == SIZE_MAX ? 0 : h_recv[bad]);
    }
    CUDA_OK(cudaFree(d_send));
    CUDA_OK(cudaFree(d_recv));
    free(h_send);
    free(h_recv);
  }
  /* Zero bytes: a call that moves nothing. */
  embps_status_t st = embps_comm_all_gather(c, NULL, 0, NULL, &err);
  CHECK(ctx, st == EMBPS_OK, "all_gather(0 bytes): %s", embps_status_str(st));
  x->calls++;
}

static void check_all_to_all(rank_ctx_t *ctx, embps_comm_t *c, expect_t *x) {
  static const size_t sizes[] = {1, 100, 65541};
  uint32_t me = ctx->rank, n = ctx->size;
  embps_error_t err;
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t bytes = sizes[k];
    uint8_t *h = xmalloc(bytes * n);
    for (uint32_t q = 0; q < n; q++)
      for (size_t i = 0; i < bytes; i++)
        h[(size_t)q * bytes + i] = a2a_byte(me, q, i);
    uint8_t *d_send = dev_alloc(bytes * n), *d_recv = dev_alloc(bytes * n);
    to_dev(ctx, d_send, h, bytes * n);
    dev_fill(ctx, d_recv, MARK, bytes * n);
    embps_status_t st = embps_comm_all_to_all(c, d_send, bytes, d_recv, &err);
    CHECK(ctx, st == EMBPS_OK, "all_to_all(%zu bytes): %s: %s", bytes, embps_status_str(st),
          err.message);
    x->calls++;
    x->bytes += (uint64_t)(n - 1) * bytes;
    to_host(ctx, h, d_recv, bytes * n);
    size_t bad = SIZE_MAX;
    for (uint32_t q = 0; q < n && bad == SIZE_MAX; q++)
      for (size_t i = 0; i < bytes; i++)
        if (h[(size_t)q * bytes + i] != a2a_byte(q, me, i)) {
          bad = (size_t)q * bytes + i;
          break;
        }
    CHECK(ctx, bad == SIZE_MAX, "all_to_all(%zu bytes): recv[%zu] = 0x%02x", bytes, bad,
          bad == SIZE_MAX ? 0 : h[bad]);
    /* In place is rejected before anything moves. */
    st = embps_comm_all_to_all(c, d_send, bytes, d_send, &err);
    CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_to_all in place: %s", embps_status_str(st));
    CUDA_OK(cudaFree(d_send));
    CUDA_OK(cudaFree(d_recv));
    free(h);
  }
}

static void check_all_reduce(rank_ctx_t *ctx, embps_comm_t *c, expect_t *x) {
  /* Growing sizes, then a small one again (the scratch buffer is reused). */
  static const size_t counts[] = {1, 1000, 100003, 7};
  static const embps_comm_type_t types[] = {EMBPS_COMM_F32, EMBPS_COMM_F64, EMBPS_COMM_U64};
  static const embps_comm_op_t ops[] = {EMBPS_COMM_SUM, EMBPS_COMM_MAX};
  uint32_t me = ctx->rank, n = ctx->size;
  embps_error_t err;
  size_t total = 0;
  for (size_t t = 0; t < 3; t++)
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
      total += 2 * counts[k] * (types[t] == EMBPS_COMM_F32 ? 4 : 8);
  ctx->reduced = xmalloc(total);
  ctx->reduced_len = 0;
  for (size_t t = 0; t < 3; t++) {
    embps_comm_type_t type = types[t];
    size_t elem = type == EMBPS_COMM_F32 ? 4 : 8;
    for (size_t o = 0; o < 2; o++) {
      embps_comm_op_t op = ops[o];
      for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t count = counts[k], bytes = count * elem;
        uint64_t case_id = (uint64_t)type * 1000003u + (uint64_t)op * 1009u + count;
        uint8_t *blocks = xmalloc(bytes * n), *want = xmalloc(bytes), *got = xmalloc(bytes);
        for (uint32_t r = 0; r < n; r++)
          reduce_input(blocks + (size_t)r * bytes, type, case_id, r, count);
        reference(want, blocks, count, n, type, op);
        uint8_t *d = dev_alloc(bytes);
        to_dev(ctx, d, blocks + (size_t)me * bytes, bytes);
        embps_status_t st = embps_comm_all_reduce(c, d, count, type, op, &err);
        CHECK(ctx, st == EMBPS_OK, "all_reduce(%s %s, %zu): %s: %s", type_name(type),
              op == EMBPS_COMM_SUM ? "sum" : "max", count, embps_status_str(st), err.message);
        x->calls++;
        x->bytes += (uint64_t)(n - 1) * bytes;
        to_host(ctx, got, d, bytes);
        size_t bad = SIZE_MAX;
        for (size_t i = 0; i < count; i++)
          if (memcmp(got + i * elem, want + i * elem, elem) != 0) {
            bad = i;
            break;
          }
        if (bad != SIZE_MAX) {
          uint64_t g = 0, w = 0;
          memcpy(&g, got + bad * elem, elem);
          memcpy(&w, want + bad * elem, elem);
          CHECK(ctx, false,
                "all_reduce(%s %s, %zu): element %zu has bits 0x%" PRIx64 ", want 0x%" PRIx64,
                type_name(type), op == EMBPS_COMM_SUM ? "sum" : "max", count, bad, g, w);
        }
        memcpy(ctx->reduced + ctx->reduced_len, got, bytes);
        ctx->reduced_len += bytes;
        CUDA_OK(cudaFree(d));
        free(blocks);
        free(want);
        free(got);
      }
    }
  }
  /* Nothing to reduce: still a call. */
  embps_status_t st = embps_comm_all_reduce(c, NULL, 0, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err);
  CHECK(ctx, st == EMBPS_OK, "all_reduce(0 elements): %s", embps_status_str(st));
  x->calls++;
}

/* Rejected calls change nothing: no call counted, the communicator stays usable. */
static void check_rejected(rank_ctx_t *ctx, embps_comm_t *c, expect_t *x) {
  embps_error_t err;
  uint8_t *d = dev_alloc(64);
  embps_status_t st = embps_comm_all_reduce(c, d, 4, (embps_comm_type_t)99, EMBPS_COMM_SUM, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT && err.status == EMBPS_INVALID_ARGUMENT,
        "all_reduce with type 99: %s", embps_status_str(st));
  st = embps_comm_all_reduce(c, d, 4, EMBPS_COMM_F32, (embps_comm_op_t)99, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_reduce with op 99: %s", embps_status_str(st));
  st = embps_comm_all_reduce(c, d + 4, 4, EMBPS_COMM_F64, EMBPS_COMM_SUM, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_reduce of f64 at a 4-byte offset: %s",
        embps_status_str(st));
  st = embps_comm_all_reduce(c, NULL, 4, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_reduce without a buffer: %s", embps_status_str(st));
  st = embps_comm_all_gather(c, NULL, 8, d, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_gather without send: %s", embps_status_str(st));
  st = embps_comm_all_gather(c, d + 1, 8, d, &err); /* overlaps recv, not at recv + rank*8 */
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_gather overlapping out of place: %s",
        embps_status_str(st));
  st = embps_comm_all_to_all(c, d, 8, NULL, &err);
  CHECK(ctx, st == EMBPS_INVALID_ARGUMENT, "all_to_all without recv: %s", embps_status_str(st));
  CUDA_OK(cudaFree(d));
  for (int i = 0; i < 3; i++) {
    st = embps_comm_barrier(c, &err);
    CHECK(ctx, st == EMBPS_OK, "barrier %d: %s: %s", i, embps_status_str(st), err.message);
    x->calls++;
  }
}

/* A communicator rank 1 abandons: rank 0's barrier must fail with EMBPS_UNAVAILABLE naming
 * rank 1 within the timeout (plus slack for the abort), and its next call at once. */
static void check_abandoned(rank_ctx_t *ctx) {
  embps_comm_t *c = NULL;
  embps_error_t err;
  embps_status_t st = embps_comm_nccl_new(&c, ctx->rank, ctx->size, ctx->fault_id, ctx->stream,
                                          FAULT_TIMEOUT_MS, &err);
  CHECK(ctx, st == EMBPS_OK, "embps_comm_nccl_new (abandoned): %s: %s", embps_status_str(st),
        err.message);
  pthread_barrier_wait(ctx->sync);
  if (st == EMBPS_OK && ctx->rank == 0) {
    uint64_t t0 = now_ms();
    st = embps_comm_barrier(c, &err);
    uint64_t waited = now_ms() - t0;
    CHECK(ctx, st == EMBPS_UNAVAILABLE && err.status == EMBPS_UNAVAILABLE,
          "barrier with rank 1 absent: %s: %s", embps_status_str(st), err.message);
    CHECK(ctx, strstr(err.message, ctx->size == 2 ? "rank 1" : "ranks 0..") != NULL,
          "message does not name rank 1 (or the suspects): %s", err.message);
    CHECK(ctx, waited < FAULT_TIMEOUT_MS + 10000, "barrier failed only after %" PRIu64 " ms",
          waited);
    printf("rank 0: barrier with rank 1 absent failed after %" PRIu64 " ms: %s\n", waited,
           err.message);
    t0 = now_ms();
    uint8_t *d = dev_alloc(16);
    st = embps_comm_all_gather(c, d, 8, d, &err); /* would be invalid (overlap) if checked */
    waited = now_ms() - t0;
    CHECK(ctx, st == EMBPS_UNAVAILABLE, "call after the failure: %s", embps_status_str(st));
    CHECK(ctx, strstr(err.message, "earlier failure") != NULL, "call after the failure: %s",
          err.message);
    CHECK(ctx, waited < 1000, "call after the failure took %" PRIu64 " ms", waited);
    CUDA_OK(cudaFree(d));
  }
  pthread_barrier_wait(ctx->sync);
  uint64_t t0 = now_ms();
  embps_comm_free(c); /* rank 1: finalize against a gone peer is bounded by the timeout */
  uint64_t waited = now_ms() - t0;
  CHECK(ctx, waited < FAULT_TIMEOUT_MS + 10000,
        "freeing the abandoned communicator took %" PRIu64 " ms", waited);
}

static void run_rank(rank_ctx_t *ctx) {
  CUDA_OK(cudaSetDevice(ctx->device));
  CUDA_OK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
  embps_comm_t *c = NULL;
  embps_error_t err;
  uint64_t t0 = now_ms();
  embps_status_t st =
      embps_comm_nccl_new(&c, ctx->rank, ctx->size, ctx->id, ctx->stream, TIMEOUT_MS, &err);
  CHECK(ctx, st == EMBPS_OK, "embps_comm_nccl_new: %s: %s", embps_status_str(st), err.message);
  if (st == EMBPS_OK) {
    printf("rank %u/%u on device %d: communicator ready in %" PRIu64 " ms\n", ctx->rank, ctx->size,
           ctx->device, now_ms() - t0);
    CHECK(ctx, strcmp(c->ops->name, "nccl") == 0, "ops name %s", c->ops->name);
    CHECK(ctx, c->rank == ctx->rank && c->size == ctx->size, "rank/size %u/%u", c->rank, c->size);
    CHECK(ctx, c->stats.calls == 0 && c->stats.bytes_sent == 0 && c->stats.bytes_received == 0,
          "fresh stats not zero");
    expect_t x = {0, 0};
    check_all_gather(ctx, c, &x);
    check_all_to_all(ctx, c, &x);
    check_all_reduce(ctx, c, &x);
    check_rejected(ctx, c, &x);
    CHECK(ctx, c->stats.calls == x.calls, "stats.calls %" PRIu64 ", want %" PRIu64, c->stats.calls,
          x.calls);
    CHECK(ctx, c->stats.bytes_sent == x.bytes, "stats.bytes_sent %" PRIu64 ", want %" PRIu64,
          c->stats.bytes_sent, x.bytes);
    CHECK(ctx, c->stats.bytes_received == x.bytes,
          "stats.bytes_received %" PRIu64 ", want %" PRIu64, c->stats.bytes_received, x.bytes);
    embps_comm_free(c);
  }
  /* Run even when creation failed, so the other rank is not left waiting at the barriers. */
  if (ctx->fault_id)
    check_abandoned(ctx);
  CUDA_OK(cudaStreamDestroy(ctx->stream));
}

static void *rank_thread(void *arg) {
  run_rank(arg);
  return NULL;
}

/* Creation arguments are checked before anything is made, and *out is left untouched. */
static int check_bad_arguments(void) {
  int failures = 0;
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES] = {0};
  embps_comm_t *sentinel = (embps_comm_t *)(uintptr_t)0x1;
  embps_comm_t *c = sentinel;
  embps_error_t err;
  struct {
    uint32_t rank, size;
    const uint8_t *id;
  } bad[] = {{0, 0, id}, {1, 1, id}, {2, 2, id}, {0, 1, NULL}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    embps_status_t st =
        embps_comm_nccl_new(&c, bad[i].rank, bad[i].size, bad[i].id, NULL, 1000, &err);
    if (st != EMBPS_INVALID_ARGUMENT || c != sentinel) {
      fprintf(stderr, "FAIL: embps_comm_nccl_new(rank %u, size %u, id %p): %s, out %p\n",
              bad[i].rank, bad[i].size, (const void *)bad[i].id, embps_status_str(st), (void *)c);
      failures++;
    }
  }
  if (embps_comm_nccl_unique_id(NULL, &err) != EMBPS_INVALID_ARGUMENT) {
    fprintf(stderr, "FAIL: embps_comm_nccl_unique_id(NULL) accepted\n");
    failures++;
  }
  return failures;
}

int main(void) {
  int count = gpu_devices_or_skip();
  if (count == 0)
    return GPU_SKIP_CODE;
  printf("%d CUDA device(s) visible\n", count);
  fflush(stdout);
  int failures = check_bad_arguments();
  embps_error_t err;

  /* One rank on device 0. */
  uint8_t id[EMBPS_NCCL_UNIQUE_ID_BYTES];
  if (embps_comm_nccl_unique_id(id, &err) != EMBPS_OK) {
    fprintf(stderr, "FATAL: embps_comm_nccl_unique_id: %s\n", err.message);
    return 1;
  }
  rank_ctx_t one = {.rank = 0, .size = 1, .device = 0, .id = id};
  run_rank(&one);
  failures += one.failures;
  free(one.reduced);

  /* MAX_RANKS ranks (2 unless the build says otherwise), one thread and one device each. */
  if (count >= MAX_RANKS) {
    uint8_t id2[EMBPS_NCCL_UNIQUE_ID_BYTES], fault_id[EMBPS_NCCL_UNIQUE_ID_BYTES];
    if (embps_comm_nccl_unique_id(id2, &err) != EMBPS_OK ||
        embps_comm_nccl_unique_id(fault_id, &err) != EMBPS_OK) {
      fprintf(stderr, "FATAL: embps_comm_nccl_unique_id: %s\n", err.message);
      return 1;
    }
    pthread_barrier_t sync;
    pthread_barrier_init(&sync, NULL, MAX_RANKS);
    rank_ctx_t ctx[MAX_RANKS];
    pthread_t threads[MAX_RANKS];
    for (uint32_t r = 0; r < MAX_RANKS; r++) {
      ctx[r] = (rank_ctx_t){.rank = r,
                            .size = MAX_RANKS,
                            .device = (int)r,
                            .id = id2,
                            .fault_id = fault_id,
                            .sync = &sync};
      if (pthread_create(&threads[r], NULL, rank_thread, &ctx[r]) != 0) {
        fprintf(stderr, "FATAL: pthread_create\n");
        return 1;
      }
    }
    for (uint32_t r = 0; r < MAX_RANKS; r++) {
      pthread_join(threads[r], NULL);
      failures += ctx[r].failures;
    }
    pthread_barrier_destroy(&sync);
    /* Every rank holds bitwise the same all_reduce results. */
    for (uint32_t r = 1; r < MAX_RANKS; r++)
      if (ctx[0].reduced_len == 0 || ctx[0].reduced_len != ctx[r].reduced_len ||
          memcmp(ctx[0].reduced, ctx[r].reduced, ctx[0].reduced_len) != 0) {
        fprintf(stderr, "FAIL: all_reduce results differ between rank 0 and rank %u\n", r);
        failures++;
      }
    for (uint32_t r = 0; r < MAX_RANKS; r++)
      free(ctx[r].reduced);
  } else {
    printf("%d device(s): the %d-rank checks need %d and were not run\n", count, MAX_RANKS,
           MAX_RANKS);
  }
  printf("%s (%d failure%s)\n", failures ? "FAILED" : "OK", failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
