/* The TCP collectives over a real loopback mesh: one thread per rank, each with its own
 * communicator, for groups of 1 to 4 ranks. Rank threads never call cmocka asserts (they would
 * longjmp across threads); they record the first failed check, and the main thread asserts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* cmocka.h needs these first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/alloc.h"
#include "server/comm/comm.h"

#define MAX_RANKS 4
#define TIMEOUT_MS 20000 /* a bound so a broken build fails instead of hanging */

typedef struct rank_ctx rank_ctx_t;
typedef void (*body_fn)(rank_ctx_t *);

struct rank_ctx {
  uint32_t rank, size;
  embps_comm_t *comm;
  body_fn body;
  void *shared;
  int failed_line; /* first failed CHECK, 0 if none */
  char failed_what[256];
  /* Outcomes the main thread looks at. */
  embps_status_t status;
  embps_error_t err;
  uint64_t elapsed_ms;
  double mb_per_s;
};

#define CHECK(ctx, cond)                                                                           \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      if (!(ctx)->failed_line) {                                                                   \
        (ctx)->failed_line = __LINE__;                                                             \
        snprintf((ctx)->failed_what, sizeof(ctx)->failed_what, "%s", #cond);                       \
      }                                                                                            \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

#define CHECK_OK(ctx, call)                                                                        \
  do {                                                                                             \
    embps_error_t e_;                                                                              \
    embps_status_t s_ = (call);                                                                    \
    if (s_ != EMBPS_OK) {                                                                          \
      if (!(ctx)->failed_line) {                                                                   \
        (ctx)->failed_line = __LINE__;                                                             \
        snprintf((ctx)->failed_what, sizeof(ctx)->failed_what, "%s", #call);                       \
      }                                                                                            \
      (void)e_;                                                                                    \
      return;                                                                                      \
    }                                                                                              \
  } while (0)

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* The byte at offset i of what src sends to dst in call k: distinct per (call, src, dst). */
static uint8_t pat(uint64_t k, uint32_t src, uint32_t dst, size_t i) {
  return (uint8_t)mix((k << 40) ^ ((uint64_t)src << 32) ^ ((uint64_t)dst << 24) ^ i);
}

/* A full mesh on 127.0.0.1: fds[i][j] is rank i's socket to rank j, fds[i][i] = -1. */
static void make_mesh(uint32_t n, int fds[MAX_RANKS][MAX_RANKS]) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(l >= 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  assert_int_equal(bind(l, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(l, 16), 0);
  socklen_t len = sizeof a;
  assert_int_equal(getsockname(l, (struct sockaddr *)&a, &len), 0);
  for (uint32_t i = 0; i < n; i++) {
    fds[i][i] = -1;
    for (uint32_t j = i + 1; j < n; j++) {
      int c = socket(AF_INET, SOCK_STREAM, 0);
      assert_true(c >= 0);
      assert_int_equal(connect(c, (struct sockaddr *)&a, sizeof a), 0);
      int s = accept(l, NULL, NULL);
      assert_true(s >= 0);
      fds[i][j] = c;
      fds[j][i] = s;
    }
  }
  close(l);
}

/* The mesh of the group run_group is running (the communicators own the sockets). */
static int g_mesh[MAX_RANKS][MAX_RANKS];

static void *rank_main(void *arg) {
  rank_ctx_t *ctx = arg;
  ctx->body(ctx);
  return NULL;
}

/* Runs body on n ranks (one thread each) over a fresh mesh; the contexts stay in ctx. */
static void run_group(uint32_t n, uint64_t timeout_ms, body_fn body, void *shared,
                      rank_ctx_t ctx[MAX_RANKS]) {
  int fds[MAX_RANKS][MAX_RANKS];
  make_mesh(n, fds);
  memcpy(g_mesh, fds, sizeof fds);
  memset(ctx, 0, sizeof(rank_ctx_t) * MAX_RANKS);
  for (uint32_t r = 0; r < n; r++) {
    ctx[r].rank = r;
    ctx[r].size = n;
    ctx[r].body = body;
    ctx[r].shared = shared;
    assert_int_equal(embps_comm_tcp_new(&ctx[r].comm, r, n, fds[r], timeout_ms), EMBPS_OK);
    assert_int_equal(ctx[r].comm->rank, r);
    assert_int_equal(ctx[r].comm->size, n);
    assert_string_equal(ctx[r].comm->ops->name, "tcp");
  }
  pthread_t th[MAX_RANKS];
  for (uint32_t r = 0; r < n; r++)
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  for (uint32_t r = 0; r < n; r++)
    pthread_join(th[r], NULL);
  for (uint32_t r = 0; r < n; r++) {
    embps_comm_free(ctx[r].comm);
    ctx[r].comm = NULL;
  }
}

static void expect_all_passed(rank_ctx_t ctx[MAX_RANKS], uint32_t n) {
  for (uint32_t r = 0; r < n; r++) {
    if (ctx[r].failed_line)
      fail_msg("rank %u of %u failed at line %d: %s", r, n, ctx[r].failed_line, ctx[r].failed_what);
  }
}

static void run_all_sizes(body_fn body, void *shared) {
  rank_ctx_t ctx[MAX_RANKS];
  for (uint32_t n = 1; n <= MAX_RANKS; n++) {
    run_group(n, TIMEOUT_MS, body, shared, ctx);
    expect_all_passed(ctx, n);
  }
}

/* ---- all_gather ---- */

static void check_all_gather(rank_ctx_t *ctx, uint64_t k, size_t bytes, int in_place) {
  uint32_t me = ctx->rank, n = ctx->size;
  uint8_t *send = malloc(bytes + 1);
  uint8_t *recv = malloc(bytes * n + 1);
  CHECK(ctx, send && recv);
  memset(send, 0, bytes + 1);
  memset(recv, 0xEE, bytes * n + 1);
  for (size_t i = 0; i < bytes; i++)
    send[i] = pat(k, me, 0, i);
  embps_error_t err;
  if (in_place) {
    memcpy(recv + me * bytes, send, bytes);
    CHECK_OK(ctx, embps_comm_all_gather(ctx->comm, recv + me * bytes, bytes, recv, &err));
  } else {
    CHECK_OK(ctx, embps_comm_all_gather(ctx->comm, send, bytes, recv, &err));
  }
  int good = 1;
  for (uint32_t r = 0; r < n; r++)
    for (size_t i = 0; i < bytes; i++)
      good &= recv[r * bytes + i] == pat(k, r, 0, i);
  good &= recv[bytes * n] == 0xEE; /* nothing written past the end */
  free(send);
  free(recv);
  CHECK(ctx, good);
}

static void body_all_gather(rank_ctx_t *ctx) {
  static const size_t sizes[] = {1, 7, 4096, 65537, 1 << 20};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    check_all_gather(ctx, s, sizes[s], 0);
    check_all_gather(ctx, 100 + s, sizes[s], 1);
  }
}

static void test_all_gather(void **state) {
  (void)state;
  run_all_sizes(body_all_gather, NULL);
}

/* ---- all_to_all ---- */

static void check_all_to_all(rank_ctx_t *ctx, uint64_t k, size_t bytes) {
  uint32_t me = ctx->rank, n = ctx->size;
  uint8_t *send = malloc(bytes * n + 1);
  uint8_t *recv = malloc(bytes * n + 1);
  CHECK(ctx, send && recv);
  memset(send, 0, bytes * n + 1);
  memset(recv, 0xEE, bytes * n + 1);
  for (uint32_t d = 0; d < n; d++)
    for (size_t i = 0; i < bytes; i++)
      send[d * bytes + i] = pat(k, me, d, i);
  embps_error_t err;
  CHECK_OK(ctx, embps_comm_all_to_all(ctx->comm, send, bytes, recv, &err));
  int good = 1;
  for (uint32_t s = 0; s < n; s++)
    for (size_t i = 0; i < bytes; i++)
      good &= recv[s * bytes + i] == pat(k, s, me, i);
  good &= recv[bytes * n] == 0xEE;
  free(send);
  free(recv);
  CHECK(ctx, good);
}

static void body_all_to_all(rank_ctx_t *ctx) {
  static const size_t sizes[] = {1, 13, 4096, 100003, 1 << 20};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
    check_all_to_all(ctx, s, sizes[s]);
}

static void test_all_to_all(void **state) {
  (void)state;
  run_all_sizes(body_all_to_all, NULL);
}

/* ---- all_reduce ---- */

/* Values with exponents far apart, so that any summation order but 0..size-1 rounds
 * differently somewhere. */
static float f32_val(uint32_t r, size_t i) {
  uint64_t h = mix(((uint64_t)r << 32) ^ i ^ 0xf32);
  float v = ldexpf((float)(h & 0xffffff), (int)((h >> 24) & 31) - 20);
  return (h >> 40) & 1 ? -v : v;
}
static double f64_val(uint32_t r, size_t i) {
  uint64_t h = mix(((uint64_t)r << 32) ^ i ^ 0xf64);
  double v = ldexp((double)(h & 0xfffffffffffffull), (int)((h >> 52) & 63) - 40);
  return (h >> 60) & 1 ? -v : v;
}
static uint64_t u64_val(uint32_t r, size_t i) { return mix(((uint64_t)r << 32) ^ i ^ 0x64); }

#define REDUCE_COUNT 3001 /* more than one reduction block, not a multiple of it */

typedef struct reduce_shared {
  /* Each rank's results, compared bitwise across ranks by the main thread. */
  float f32_sum[MAX_RANKS][REDUCE_COUNT];
  float f32_max[MAX_RANKS][REDUCE_COUNT];
  double f64_sum[MAX_RANKS][REDUCE_COUNT];
  uint64_t u64_sum[MAX_RANKS][REDUCE_COUNT];
  uint64_t u64_max[MAX_RANKS][REDUCE_COUNT];
} reduce_shared_t;

static void body_all_reduce(rank_ctx_t *ctx) {
  reduce_shared_t *sh = ctx->shared;
  uint32_t me = ctx->rank, n = ctx->size;
  embps_error_t err;
  float *f = sh->f32_sum[me];
  float *fm = sh->f32_max[me];
  double *d = sh->f64_sum[me];
  uint64_t *u = sh->u64_sum[me], *um = sh->u64_max[me];
  for (size_t i = 0; i < REDUCE_COUNT; i++) {
    f[i] = fm[i] = f32_val(me, i);
    d[i] = f64_val(me, i);
    u[i] = um[i] = u64_val(me, i);
  }
  CHECK_OK(ctx,
           embps_comm_all_reduce(ctx->comm, f, REDUCE_COUNT, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err));
  CHECK_OK(ctx, embps_comm_all_reduce(ctx->comm, fm, REDUCE_COUNT, EMBPS_COMM_F32, EMBPS_COMM_MAX,
                                      &err));
  CHECK_OK(ctx,
           embps_comm_all_reduce(ctx->comm, d, REDUCE_COUNT, EMBPS_COMM_F64, EMBPS_COMM_SUM, &err));
  CHECK_OK(ctx,
           embps_comm_all_reduce(ctx->comm, u, REDUCE_COUNT, EMBPS_COMM_U64, EMBPS_COMM_SUM, &err));
  CHECK_OK(ctx, embps_comm_all_reduce(ctx->comm, um, REDUCE_COUNT, EMBPS_COMM_U64, EMBPS_COMM_MAX,
                                      &err));
  (void)n;
}

static void test_all_reduce(void **state) {
  (void)state;
  reduce_shared_t *sh = calloc(1, sizeof *sh);
  assert_non_null(sh);
  rank_ctx_t ctx[MAX_RANKS];
  int order_matters = 0;
  for (uint32_t n = 1; n <= MAX_RANKS; n++) {
    run_group(n, TIMEOUT_MS, body_all_reduce, sh, ctx);
    expect_all_passed(ctx, n);
    for (size_t i = 0; i < REDUCE_COUNT; i++) {
      float fs = f32_val(0, i), fm = f32_val(0, i), fs_rev = f32_val(n - 1, i);
      double ds = f64_val(0, i);
      uint64_t us = u64_val(0, i), um = u64_val(0, i);
      for (uint32_t r = 1; r < n; r++) {
        fs += f32_val(r, i);
        fm = f32_val(r, i) > fm ? f32_val(r, i) : fm;
        ds += f64_val(r, i);
        us += u64_val(r, i);
        um = u64_val(r, i) > um ? u64_val(r, i) : um;
      }
      for (uint32_t r = n - 1; r-- > 0;)
        fs_rev += f32_val(r, i);
      order_matters |= memcmp(&fs, &fs_rev, sizeof fs) != 0;
      for (uint32_t r = 0; r < n; r++) {
        assert_memory_equal(&sh->f32_sum[r][i], &fs, sizeof fs);
        assert_memory_equal(&sh->f32_max[r][i], &fm, sizeof fm);
        assert_memory_equal(&sh->f64_sum[r][i], &ds, sizeof ds);
        assert_true(sh->u64_sum[r][i] == us);
        assert_true(sh->u64_max[r][i] == um);
      }
    }
  }
  /* The data is such that a reduction in another order would have been caught. */
  assert_true(order_matters);
  free(sh);
}

/* ---- barrier ---- */

typedef struct barrier_shared {
  atomic_uint arrived[3];
} barrier_shared_t;

static void body_barrier(rank_ctx_t *ctx) {
  barrier_shared_t *sh = ctx->shared;
  embps_error_t err;
  for (int round = 0; round < 3; round++) {
    if (ctx->rank == ctx->size - 1)
      usleep(30 * 1000); /* the last rank is late: nobody may leave before it arrives */
    atomic_fetch_add(&sh->arrived[round], 1);
    CHECK_OK(ctx, embps_comm_barrier(ctx->comm, &err));
    CHECK(ctx, atomic_load(&sh->arrived[round]) == ctx->size);
  }
}

static void test_barrier(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  for (uint32_t n = 1; n <= MAX_RANKS; n++) {
    barrier_shared_t sh;
    for (int i = 0; i < 3; i++)
      atomic_init(&sh.arrived[i], 0);
    run_group(n, TIMEOUT_MS, body_barrier, &sh, ctx);
    expect_all_passed(ctx, n);
  }
}

/* ---- mixed sequences ---- */

static void body_mixed(rank_ctx_t *ctx) {
  embps_error_t err;
  for (uint64_t k = 0; k < 200; k++) {
    uint64_t h = mix(k ^ 0xabc);
    size_t bytes = (size_t)(h >> 8) % 3000;
    switch (h % 4) {
    case 0:
      check_all_gather(ctx, k, bytes, 0);
      break;
    case 1:
      check_all_to_all(ctx, k, bytes);
      break;
    case 2: {
      uint64_t v[16], want[16];
      size_t count = bytes % 16;
      for (size_t i = 0; i < count; i++) {
        v[i] = mix(k * 100 + ctx->rank * 16 + i);
        want[i] = 0;
        for (uint32_t r = 0; r < ctx->size; r++)
          want[i] += mix(k * 100 + r * 16 + i);
      }
      CHECK_OK(ctx, embps_comm_all_reduce(ctx->comm, count ? v : NULL, count, EMBPS_COMM_U64,
                                          EMBPS_COMM_SUM, &err));
      CHECK(ctx, memcmp(v, want, count * sizeof *v) == 0);
      break;
    }
    default:
      CHECK_OK(ctx, embps_comm_barrier(ctx->comm, &err));
      break;
    }
    if (ctx->failed_line)
      return;
  }
  CHECK(ctx, ctx->comm->stats.calls == 200);
}

static void test_mixed_sequence(void **state) {
  (void)state;
  run_all_sizes(body_mixed, NULL);
}

/* ---- large all_to_all ---- */

#define LARGE_PER_RANK (32u << 20)

static void body_large(rank_ctx_t *ctx) {
  uint32_t me = ctx->rank, n = ctx->size;
  size_t block = (LARGE_PER_RANK / n) & ~(size_t)7;
  size_t words = block / 8;
  uint64_t *send = malloc(block * n), *recv = malloc(block * n);
  CHECK(ctx, send && recv);
  for (uint32_t d = 0; d < n; d++)
    for (size_t j = 0; j < words; j++)
      send[d * words + j] = ((uint64_t)me << 56) | ((uint64_t)d << 48) | j;
  memset(recv, 0, block * n);
  embps_error_t err;
  uint64_t t0 = now_ms();
  embps_status_t st = embps_comm_all_to_all(ctx->comm, send, block, recv, &err);
  uint64_t dt = now_ms() - t0;
  int good = st == EMBPS_OK;
  for (uint32_t s = 0; good && s < n; s++)
    for (size_t j = 0; j < words; j++)
      good &= recv[s * words + j] == (((uint64_t)s << 56) | ((uint64_t)me << 48) | j);
  free(send);
  free(recv);
  CHECK(ctx, good);
  CHECK(ctx, ctx->comm->stats.bytes_sent == (uint64_t)block * (n - 1));
  CHECK(ctx, ctx->comm->stats.bytes_received == (uint64_t)block * (n - 1));
  ctx->elapsed_ms = dt;
  ctx->mb_per_s = dt ? (double)block * (n - 1) / 1e6 / ((double)dt / 1000.0) : 0;
}

static void test_large_all_to_all(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  for (uint32_t n = 1; n <= MAX_RANKS; n++) {
    run_group(n, TIMEOUT_MS, body_large, NULL, ctx);
    expect_all_passed(ctx, n);
    if (n > 1)
      print_message("%u ranks, %u MiB per rank all_to_all, first call on new connections: %llu ms, "
                    "%.0f MB/s sent per rank\n",
                    n, LARGE_PER_RANK >> 20, (unsigned long long)ctx[0].elapsed_ms,
                    ctx[0].mb_per_s);
  }
}

/* ---- zero bytes and stats ---- */

static void body_zero(rank_ctx_t *ctx) {
  embps_error_t err;
  CHECK_OK(ctx, embps_comm_all_gather(ctx->comm, NULL, 0, NULL, &err));
  CHECK_OK(ctx, embps_comm_all_to_all(ctx->comm, NULL, 0, NULL, &err));
  CHECK_OK(ctx, embps_comm_all_reduce(ctx->comm, NULL, 0, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err));
  CHECK(ctx, ctx->comm->stats.calls == 3);
  CHECK(ctx, ctx->comm->stats.bytes_sent == 0);
  CHECK(ctx, ctx->comm->stats.bytes_received == 0);
  /* The group is still in step after them. */
  check_all_gather(ctx, 7, 100, 0);
}

static void test_zero_bytes(void **state) {
  (void)state;
  run_all_sizes(body_zero, NULL);
}

static void body_stats(rank_ctx_t *ctx) {
  uint32_t n = ctx->size;
  embps_error_t err;
  uint8_t send[4 * 1000], recv[4 * 1000];
  double d[250];
  memset(send, 1, sizeof send);
  memset(d, 0, sizeof d);
  CHECK_OK(ctx, embps_comm_all_gather(ctx->comm, send, 1000, recv, &err));
  CHECK(ctx, ctx->comm->stats.bytes_sent == 1000ull * (n - 1));
  CHECK(ctx, ctx->comm->stats.bytes_received == 1000ull * (n - 1));
  CHECK_OK(ctx, embps_comm_all_to_all(ctx->comm, send, 777, recv, &err));
  CHECK_OK(ctx, embps_comm_all_reduce(ctx->comm, d, 250, EMBPS_COMM_F64, EMBPS_COMM_SUM, &err));
  CHECK_OK(ctx, embps_comm_barrier(ctx->comm, &err));
  uint64_t per_peer = 1000 + 777 + 250 * 8;
  CHECK(ctx, ctx->comm->stats.bytes_sent == per_peer * (n - 1));
  CHECK(ctx, ctx->comm->stats.bytes_received == per_peer * (n - 1));
  CHECK(ctx, ctx->comm->stats.calls == 4);
}

static void test_stats(void **state) {
  (void)state;
  run_all_sizes(body_stats, NULL);
}

/* ---- failures ---- */

#define FAIL_TIMEOUT_MS 5000

/* The last rank closes its sockets while the others are inside an 8 MiB all_gather. */
static void body_peer_closes(rank_ctx_t *ctx) {
  uint32_t n = ctx->size;
  if (ctx->rank == n - 1) {
    usleep(100 * 1000);
    embps_comm_free(ctx->comm);
    ctx->comm = NULL;
    return;
  }
  size_t bytes = 8u << 20;
  uint8_t *send = calloc(1, bytes), *recv = calloc(n, bytes);
  CHECK(ctx, send && recv);
  uint64_t t0 = now_ms();
  ctx->status = embps_comm_all_gather(ctx->comm, send, bytes, recv, &ctx->err);
  ctx->elapsed_ms = now_ms() - t0;
  free(send);
  free(recv);
  /* Broken from now on: later calls fail at once with the same status. */
  embps_error_t err;
  t0 = now_ms();
  CHECK(ctx, embps_comm_barrier(ctx->comm, &err) == ctx->status);
  CHECK(ctx, now_ms() - t0 < 100);
  CHECK(ctx, strstr(err.message, ctx->err.message) != NULL);
  uint8_t b = 0, r[MAX_RANKS];
  CHECK(ctx, embps_comm_all_gather(ctx->comm, &b, 1, r, &err) == ctx->status);
}

static void test_peer_closes(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  for (uint32_t n = 2; n <= MAX_RANKS; n++) {
    run_group(n, FAIL_TIMEOUT_MS, body_peer_closes, NULL, ctx);
    expect_all_passed(ctx, n);
    char want[128];
    snprintf(want, sizeof want, "rank %u closed its connection during all_gather", n - 1);
    for (uint32_t r = 0; r + 1 < n; r++) {
      assert_int_equal(ctx[r].status, EMBPS_UNAVAILABLE);
      assert_int_equal(ctx[r].err.status, EMBPS_UNAVAILABLE);
      if (!strstr(ctx[r].err.message, want))
        fail_msg("rank %u: \"%s\" lacks \"%s\"", r, ctx[r].err.message, want);
      assert_true(ctx[r].elapsed_ms < FAIL_TIMEOUT_MS);
    }
  }
}

/* Rank 0 calls one thing, the others another. */
typedef struct mismatch_case {
  int rank0_kind, others_kind; /* indexes into call_kind's cases */
} mismatch_case_t;

static embps_status_t call_kind(rank_ctx_t *ctx, int kind, embps_error_t *err) {
  static _Thread_local uint8_t send[4 * 8192], recv[4 * 8192];
  switch (kind) {
  case 0:
    return embps_comm_all_gather(ctx->comm, send, 8192, recv, err);
  case 1:
    return embps_comm_all_to_all(ctx->comm, send, 4096, recv, err);
  case 2:
    return embps_comm_all_reduce(ctx->comm, send, 100, EMBPS_COMM_F32, EMBPS_COMM_SUM, err);
  case 4:
    return embps_comm_all_gather(ctx->comm, send, 4096, recv, err);
  default:
    return embps_comm_all_reduce(ctx->comm, send, 100, EMBPS_COMM_F32, EMBPS_COMM_MAX, err);
  }
}

static void body_mismatch(rank_ctx_t *ctx) {
  const mismatch_case_t *mc = ctx->shared;
  embps_error_t err;
  /* A good call first, so the failing one is not the first on the connection. */
  CHECK_OK(ctx, embps_comm_barrier(ctx->comm, &err));
  uint64_t t0 = now_ms();
  ctx->status = call_kind(ctx, ctx->rank == 0 ? mc->rank0_kind : mc->others_kind, &ctx->err);
  ctx->elapsed_ms = now_ms() - t0;
  CHECK(ctx, embps_comm_barrier(ctx->comm, &err) == ctx->status);
}

static void test_mismatch(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  static const char *names[] = {"all_gather of 8192 bytes", "all_to_all of 4096 bytes",
                                "all_reduce(f32 sum) of 400 bytes",
                                "all_reduce(f32 max) of 400 bytes", "all_gather of 4096 bytes"};
  static const mismatch_case_t cases[] = {{0, 1}, {1, 0}, {2, 3}, {0, 2}, {0, 4}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    for (uint32_t n = 2; n <= MAX_RANKS; n++) {
      run_group(n, FAIL_TIMEOUT_MS, body_mismatch, (void *)&cases[c], ctx);
      expect_all_passed(ctx, n);
      for (uint32_t r = 0; r < n; r++) {
        assert_true(ctx[r].elapsed_ms < FAIL_TIMEOUT_MS / 2); /* nobody waits for a timeout */
        if (r > 0 && n > 2 && ctx[r].status == EMBPS_UNAVAILABLE) {
          /* Another rank that saw the mismatch shut its connections down before rank 0's
           * header reached this one (possible if rank 0 was descheduled between sends). */
          assert_non_null(strstr(ctx[r].err.message, "closed its connection during"));
          continue;
        }
        assert_int_equal(ctx[r].status, EMBPS_INTERNAL);
        char want[256];
        if (r == 0) {
          /* Rank 0 may read any peer's header first; all of them disagree with it. */
          snprintf(want, sizeof want, " sent %s where this rank expected %s",
                   names[cases[c].others_kind], names[cases[c].rank0_kind]);
        } else {
          snprintf(want, sizeof want, "rank 0 sent %s where this rank expected %s",
                   names[cases[c].rank0_kind], names[cases[c].others_kind]);
        }
        if (!strstr(ctx[r].err.message, want))
          fail_msg("case %zu, %u ranks, rank %u: \"%s\" lacks \"%s\"", c, n, r, ctx[r].err.message,
                   want);
      }
    }
  }
}

/* The last rank never calls; the others time out naming it. */
static void body_silent_peer(rank_ctx_t *ctx) {
  if (ctx->rank == ctx->size - 1) {
    usleep(600 * 1000); /* never calls; its sockets close only after everyone joins */
    return;
  }
  uint8_t send[64] = {0}, recv[64 * MAX_RANKS];
  uint64_t t0 = now_ms();
  ctx->status = embps_comm_all_gather(ctx->comm, send, sizeof send, recv, &ctx->err);
  ctx->elapsed_ms = now_ms() - t0;
}

static void test_timeout(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  for (uint32_t n = 2; n <= 3; n++) {
    run_group(n, 200, body_silent_peer, NULL, ctx);
    expect_all_passed(ctx, n);
    char want[128];
    snprintf(want, sizeof want, "all_gather timed out after 200 ms waiting for rank %u", n - 1);
    for (uint32_t r = 0; r + 1 < n; r++) {
      assert_int_equal(ctx[r].status, EMBPS_UNAVAILABLE);
      if (!strstr(ctx[r].err.message, want))
        fail_msg("rank %u: \"%s\" lacks \"%s\"", r, ctx[r].err.message, want);
      assert_true(ctx[r].elapsed_ms >= 195);
      assert_true(ctx[r].elapsed_ms < 3000);
    }
  }
}

/* A peer whose frames are out of step or not embps frames at all, written by hand in the wire
 * format comm_tcp.c documents: magic, kind, call number, payload bytes (u32, u32, u64, u64,
 * little endian), then the payload. */
static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void raw_peer_case(uint32_t magic, uint64_t seq, const char *want) {
  int fds[MAX_RANKS][MAX_RANKS];
  make_mesh(2, fds);
  embps_comm_t *c = NULL;
  assert_int_equal(embps_comm_tcp_new(&c, 0, 2, fds[0], 2000), EMBPS_OK);
  uint8_t frame[24 + 8] = {0};
  put_le(frame, magic, 4);
  put_le(frame + 4, 1 /* all_gather */, 4);
  put_le(frame + 8, seq, 8);
  put_le(frame + 16, 8, 8);
  assert_int_equal(write(fds[1][0], frame, sizeof frame), (ssize_t)sizeof frame);
  uint8_t send[8] = {0}, recv[16];
  embps_error_t err;
  uint64_t t0 = now_ms();
  assert_int_equal(embps_comm_all_gather(c, send, 8, recv, &err), EMBPS_INTERNAL);
  assert_true(now_ms() - t0 < 1000);
  if (!strstr(err.message, want))
    fail_msg("\"%s\" lacks \"%s\"", err.message, want);
  embps_comm_free(c);
  close(fds[1][0]);
}

static void test_out_of_step_and_garbage(void **state) {
  (void)state;
  /* The frame a correct rank would send passes (a control for the two cases below). */
  int fds[MAX_RANKS][MAX_RANKS];
  make_mesh(2, fds);
  embps_comm_t *c = NULL;
  assert_int_equal(embps_comm_tcp_new(&c, 0, 2, fds[0], 2000), EMBPS_OK);
  uint8_t frame[24 + 8] = {0};
  put_le(frame, 0x43535045u, 4);
  put_le(frame + 4, 1, 4);
  put_le(frame + 8, 1, 8);
  put_le(frame + 16, 8, 8);
  memset(frame + 24, 0x5a, 8);
  assert_int_equal(write(fds[1][0], frame, sizeof frame), (ssize_t)sizeof frame);
  uint8_t send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[16];
  embps_error_t err;
  assert_int_equal(embps_comm_all_gather(c, send, 8, recv, &err), EMBPS_OK);
  assert_memory_equal(recv, send, 8);
  assert_memory_equal(recv + 8, frame + 24, 8);
  embps_comm_free(c);
  close(fds[1][0]);

  raw_peer_case(0x43535045u, 2,
                "rank 1 sent call 2 (all_gather of 8 bytes) where this rank expected call 1 "
                "(all_gather of 8 bytes): ranks are out of step");
  raw_peer_case(0x50545448u, 1, "rank 1 sent a frame with bad magic 0x50545448 during all_gather");
}

/* ---- construction and arguments ---- */

static int fd_is_open(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

static void test_new_rejects_and_closes(void **state) {
  (void)state;
  int fds[MAX_RANKS][MAX_RANKS];
  embps_comm_t *c = (embps_comm_t *)0x1;
  /* A missing socket: rejected, *out untouched, the given sockets closed. */
  make_mesh(3, fds);
  int bad[3] = {-1, fds[0][1], -1};
  assert_int_equal(embps_comm_tcp_new(&c, 0, 3, bad, 0), EMBPS_INVALID_ARGUMENT);
  assert_ptr_equal(c, (embps_comm_t *)0x1);
  assert_false(fd_is_open(fds[0][1]));
  close(fds[0][2]);
  for (int i = 1; i < 3; i++)
    for (int j = 0; j < 3; j++)
      if (fds[i][j] >= 0)
        close(fds[i][j]);
  assert_int_equal(embps_comm_tcp_new(&c, 2, 2, NULL, 0), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_comm_tcp_new(&c, 0, 0, NULL, 0), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_comm_tcp_new(&c, 0, 2, NULL, 0), EMBPS_INVALID_ARGUMENT);
  assert_ptr_equal(c, (embps_comm_t *)0x1);

  /* Every allocation failure is reported and leaks nothing (ASan checks the leaks). */
  for (long k = 1; k < 20; k++) {
    make_mesh(2, fds);
    embps_alloc_fail_after(k);
    embps_status_t st = embps_comm_tcp_new(&c, 0, 2, fds[0], 0);
    embps_alloc_fail_after(0);
    close(fds[1][0]);
    if (st == EMBPS_OK) {
      embps_comm_free(c);
      break;
    }
    assert_int_equal(st, EMBPS_RESOURCE_EXHAUSTED);
    assert_ptr_equal(c, (embps_comm_t *)0x1);
    assert_false(fd_is_open(fds[0][1]));
  }
  embps_comm_free(NULL);
}

static void test_bad_call_arguments(void **state) {
  (void)state;
  embps_comm_t *c = NULL;
  embps_error_t err;
  assert_int_equal(embps_comm_tcp_new(&c, 0, 1, NULL, 0), EMBPS_OK);
  uint8_t buf[16] = {0};
  assert_int_equal(embps_comm_all_gather(c, NULL, 4, buf, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_comm_all_to_all(c, buf, 4, buf + 2, &err), EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_comm_all_reduce(c, buf, 2, (embps_comm_type_t)9, EMBPS_COMM_SUM, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(embps_comm_all_reduce(c, buf, 2, EMBPS_COMM_F64, (embps_comm_op_t)9, &err),
                   EMBPS_INVALID_ARGUMENT);
  assert_int_equal(c->stats.calls, 0); /* rejected calls change nothing */
  /* A rejected call does not break the communicator. */
  uint8_t one = 42, out = 0;
  assert_int_equal(embps_comm_all_gather(c, &one, 1, &out, &err), EMBPS_OK);
  assert_int_equal(out, 42);
  embps_comm_free(c);
}

/* ---- the pairwise schedule ---- */

/* In every step each rank receives from exactly one peer, which sends to it in that same step;
 * over the size-1 steps every ordered pair of ranks meets exactly once; the window is between 1
 * and size-1 steps, all of them for header-only frames, one for frames that are large. */
static void test_schedule(void **state) {
  (void)state;
  static uint8_t met[70][70];
  for (uint32_t n = 1; n <= 70; n++) {
    memset(met, 0, sizeof met);
    for (uint32_t s = 1; s < n; s++) {
      uint32_t senders[70] = {0};
      for (uint32_t r = 0; r < n; r++) {
        uint32_t to = embps__comm_tcp_send_peer(r, n, s), from = embps__comm_tcp_recv_peer(r, n, s);
        if (to >= n || from >= n || to == r || from == r)
          fail_msg("%u ranks, step %u: rank %u sends to %u, receives from %u", n, s, r, to, from);
        if (embps__comm_tcp_recv_peer(to, n, s) != r)
          fail_msg("%u ranks, step %u: rank %u sends to %u, which receives from %u", n, s, r, to,
                   embps__comm_tcp_recv_peer(to, n, s));
        senders[to]++;
        if (met[r][to]++)
          fail_msg("%u ranks: rank %u sends to %u twice (again in step %u)", n, r, to, s);
      }
      for (uint32_t q = 0; q < n; q++)
        if (senders[q] != 1)
          fail_msg("%u ranks, step %u: %u peers send to rank %u at once", n, s, senders[q], q);
    }
    for (uint32_t r = 0; r < n; r++)
      for (uint32_t q = 0; q < n; q++)
        if (r != q && met[r][q] != 1)
          fail_msg("%u ranks: rank %u sends to %u %u times", n, r, q, met[r][q]);
    if (n == 1) {
      assert_int_equal(embps__comm_tcp_window(1, 100), 0);
      continue;
    }
    assert_int_equal(embps__comm_tcp_window(n, 0), n - 1);
    assert_int_equal(embps__comm_tcp_window(n, 1), n - 1);
    assert_int_equal(embps__comm_tcp_window(n, 1u << 20), 1);
    uint32_t last = n - 1;
    for (size_t b = 1; b <= (4u << 20); b = b * 3 / 2 + 1) {
      uint32_t w = embps__comm_tcp_window(n, b);
      assert_true(w >= 1 && w <= n - 1 && w <= last); /* fewer steps at once as frames grow */
      last = w;
    }
  }
}

/* A large exchange is paced: a rank does not send a later step's payload before its earlier
 * steps' frames have arrived. On 3 ranks with rank 2 late, rank 0's step 1 (send to 1, receive
 * from 2) cannot finish, so rank 2 gets only rank 0's header (step 2's payload waits), while
 * rank 1's step 1 payload to rank 2 flows. Then rank 2 calls and every block arrives intact. */
#define PACED_BYTES (1u << 20)

static void body_paced(rank_ctx_t *ctx) {
  uint32_t me = ctx->rank, n = ctx->size;
  embps__comm_tcp_set_pacing(ctx->comm, *(const embps__comm_tcp_pace_t *)ctx->shared);
  if (me == 2) {
    usleep(300 * 1000);
    int queued0 = -1, queued1 = -1;
    CHECK(ctx, ioctl(g_mesh[2][0], FIONREAD, &queued0) == 0);
    CHECK(ctx, ioctl(g_mesh[2][1], FIONREAD, &queued1) == 0);
    ctx->elapsed_ms = (uint64_t)queued0; /* bytes rank 0 had sent to rank 2 */
    ctx->mb_per_s = queued1;             /* bytes rank 1 had sent to rank 2 */
  }
  check_all_to_all(ctx, 77, PACED_BYTES);
  (void)n;
}

static void test_paced(void **state) {
  (void)state;
  rank_ctx_t ctx[MAX_RANKS];
  assert_int_equal(embps__comm_tcp_window(3, PACED_BYTES), 1);
  embps__comm_tcp_pace_t mode = EMBPS__COMM_TCP_PACE_ALWAYS;
  run_group(3, TIMEOUT_MS, body_paced, &mode, ctx);
  expect_all_passed(ctx, 3);
  if (ctx[2].elapsed_ms != 24)
    fail_msg("rank 0 had sent %llu bytes to the late rank 2: its step 2 payload went before its "
             "step 1 frame arrived (want the 24-byte header alone)",
             (unsigned long long)ctx[2].elapsed_ms);
  if (ctx[2].mb_per_s <= 24)
    fail_msg("rank 1 had sent only %.0f bytes to rank 2 in its step 1", ctx[2].mb_per_s);
  /* AUTO paces only after packets were lost, which loopback does not do: all frames go at once. */
  mode = EMBPS__COMM_TCP_PACE_AUTO;
  run_group(3, TIMEOUT_MS, body_paced, &mode, ctx);
  expect_all_passed(ctx, 3);
  if (ctx[2].elapsed_ms <= 24)
    fail_msg("AUTO paced on loopback: rank 0 had sent rank 2 its header alone");
}

/* The collectives' results through paced exchanges, bitwise, at every size (the tests above run
 * AUTO, which on loopback never paces). */
static void body_all_paced(rank_ctx_t *ctx) {
  embps__comm_tcp_set_pacing(ctx->comm, EMBPS__COMM_TCP_PACE_ALWAYS);
  body_all_gather(ctx);
  body_all_to_all(ctx);
  body_all_reduce(ctx);
}

static void test_all_paced(void **state) {
  (void)state;
  static reduce_shared_t sh;
  run_all_sizes(body_all_paced, &sh);
}

/* A peer that dies in a paced exchange fails every rank at once, also a rank that already has
 * the dead peer's frame and waits for another peer's, which waits on the dead one. On 4 ranks
 * with rank 3 a raw peer: it sends its frame to rank 0 (its step 1) and shuts its sockets. Rank 1
 * never gets rank 3's frame (its step 2), so never sends its step-3 frame to rank 0, and rank 0,
 * holding all it wanted from rank 3, must notice rank 3 went away instead of waiting for rank 1
 * until its deadline. */
static void body_chain(rank_ctx_t *ctx) {
  size_t bytes = PACED_BYTES;
  uint8_t *send = calloc(4, bytes), *recv = calloc(4, bytes);
  CHECK(ctx, send && recv);
  uint64_t t0 = now_ms();
  ctx->status = embps_comm_all_to_all(ctx->comm, send, bytes, recv, &ctx->err);
  ctx->elapsed_ms = now_ms() - t0;
  free(send);
  free(recv);
}

static void test_paced_peer_dies(void **state) {
  (void)state;
  int fds[MAX_RANKS][MAX_RANKS];
  make_mesh(4, fds);
  rank_ctx_t ctx[3];
  memset(ctx, 0, sizeof ctx);
  for (uint32_t r = 0; r < 3; r++) {
    ctx[r].rank = r;
    ctx[r].size = 4;
    ctx[r].body = body_chain;
    assert_int_equal(embps_comm_tcp_new(&ctx[r].comm, r, 4, fds[r], FAIL_TIMEOUT_MS), EMBPS_OK);
    embps__comm_tcp_set_pacing(ctx[r].comm, EMBPS__COMM_TCP_PACE_ALWAYS);
  }
  pthread_t th[3];
  for (uint32_t r = 0; r < 3; r++)
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  /* Rank 3: its frame to rank 0 (call 1, all_to_all), then a clean close of its sending side. */
  uint8_t *frame = calloc(1, 24 + PACED_BYTES);
  assert_non_null(frame);
  put_le(frame, 0x43535045u, 4);
  put_le(frame + 4, 2 /* all_to_all */, 4);
  put_le(frame + 8, 1, 8);
  put_le(frame + 16, PACED_BYTES, 8);
  for (size_t off = 0; off < 24 + PACED_BYTES;) {
    ssize_t k = write(fds[3][0], frame + off, 24 + PACED_BYTES - off);
    assert_true(k > 0);
    off += (size_t)k;
  }
  free(frame);
  for (uint32_t r = 0; r < 3; r++)
    assert_int_equal(shutdown(fds[3][r], SHUT_WR), 0);
  for (uint32_t r = 0; r < 3; r++)
    pthread_join(th[r], NULL);
  for (uint32_t r = 0; r < 3; r++) {
    if (ctx[r].failed_line)
      fail_msg("rank %u failed at line %d: %s", r, ctx[r].failed_line, ctx[r].failed_what);
    assert_int_equal(ctx[r].status, EMBPS_UNAVAILABLE);
    if (!strstr(ctx[r].err.message, "rank 3 closed its connection during all_to_all"))
      fail_msg("rank %u: \"%s\" does not name rank 3", r, ctx[r].err.message);
    if (ctx[r].elapsed_ms >= FAIL_TIMEOUT_MS / 2)
      fail_msg("rank %u waited %llu ms (its deadline is %d ms)", r,
               (unsigned long long)ctx[r].elapsed_ms, FAIL_TIMEOUT_MS);
    embps_comm_free(ctx[r].comm);
  }
  for (uint32_t r = 0; r < 3; r++)
    close(fds[3][r]);
}

int main(void) {
  alarm(600); /* a hang is a failure, not a stuck CI job */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_schedule),
      cmocka_unit_test(test_paced),
      cmocka_unit_test(test_all_paced),
      cmocka_unit_test(test_all_gather),
      cmocka_unit_test(test_all_to_all),
      cmocka_unit_test(test_all_reduce),
      cmocka_unit_test(test_barrier),
      cmocka_unit_test(test_mixed_sequence),
      cmocka_unit_test(test_large_all_to_all),
      cmocka_unit_test(test_zero_bytes),
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_peer_closes),
      cmocka_unit_test(test_mismatch),
      cmocka_unit_test(test_timeout),
      cmocka_unit_test(test_paced_peer_dies),
      cmocka_unit_test(test_out_of_step_and_garbage),
      cmocka_unit_test(test_new_rejects_and_closes),
      cmocka_unit_test(test_bad_call_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
