/* The engine: batches run against real tables through a real communicator. A group of one
 * checks the arithmetic (lookup, duplicates summed, padding, the non-finite gate); groups of
 * 2 to 8 ranks, one thread each over loopback sockets, check that a table fed the same lookups
 * and pushes holds the same values whatever the group's size: bitwise when the shard width is a
 * multiple of the row-statistics block, to rounding otherwise. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/cpus.h"
#include "common/dtype.h"
#include "kernels/embps_kernels.h"
#include "server/engine/engine.h"
#include "server/engine/engine_ops.h"
#include "server/engine/round_cost.h"

#define WIDTH 12
#define ROWS 40

static embps_table_config_t table_config(embps_optimizer_t opt) {
  embps_table_config_t c;
  embps_error_t err;
  memset(&c, 0, sizeof(c));
  strcpy(c.name, "t");
  c.rows = ROWS;
  c.emb_width = WIDTH;
  c.optimizer = opt;
  c.lr = 0.5f;
  c.seed = 3;
  c.half_life = 7.0f;
  c.weight_decay = 0.01f;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  return c;
}

typedef struct rank_ctx {
  embps_comm_t *comm;
  embps_store_t *store;
  embps_engine_t *engine;
} rank_ctx_t;

static void rank_init(rank_ctx_t *r, uint32_t rank, uint32_t size, const int *fds) {
  assert_int_equal(embps_comm_tcp_new(&r->comm, rank, size, fds, 10000), EMBPS_OK);
  assert_int_equal(embps_store_new(&r->store), EMBPS_OK);
  assert_int_equal(embps_engine_new(&r->engine, r->comm, r->store, EMBPS_BACKEND_CPU, NULL),
                   EMBPS_OK);
}

static void rank_fini(rank_ctx_t *r) {
  embps_engine_free(r->engine);
  embps_store_free(r->store);
  embps_comm_free(r->comm);
}

static void create(rank_ctx_t *r, const embps_table_config_t *c) {
  embps_op_t op;
  embps_error_t err;
  memset(&op, 0, sizeof(op));
  op.kind = EMBPS_OP_CREATE_TABLE;
  op.create = *c;
  assert_int_equal(embps_engine_run(r->engine, &op, &err), EMBPS_OK);
  assert_int_equal(op.error.status, EMBPS_OK);
  assert_non_null(op.created);
}

/* This rank's shard of a batch: n tokens (the engine needs no batch name or size; the group's
 * envelope carries those). */
static embps_op_t batch_op(embps_op_kind_t kind, embps_table_t *t, const int64_t *tokens,
                           size_t n) {
  embps_op_t op;
  memset(&op, 0, sizeof(op));
  op.kind = kind;
  op.table = t;
  op.tokens = tokens;
  op.num_tokens = n;
  return op;
}

/* ---- a group of one ------------------------------------------------------------------------ */

static void test_single_rank(void **state) {
  rank_ctx_t r;
  int fds[1] = {-1};
  embps_table_config_t c = table_config(EMBPS_OPTIMIZER_SGD);
  embps_table_t *t;
  int64_t tokens[] = {5, 0, 7, 5};
  float g[4 * WIDTH], before[ROWS * WIDTH], out[4 * WIDTH];
  double norm2 = 0.0;
  embps_op_t op;
  embps_error_t err;
  (void)state;
  c.weight_decay = 0.0f;
  rank_init(&r, 0, 1, fds);
  create(&r, &c);
  t = embps_store_find(r.store, "t");
  memcpy(before, embps_table_arrays(t).data, sizeof(before));

  op = batch_op(EMBPS_OP_LOOKUP, t, tokens, 4);
  op.rows_out = out;
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  for (int i = 0; i < 4; i++)
    for (int col = 0; col < WIDTH; col++)
      assert_true(out[i * WIDTH + col] ==
                  embps_init_value(3, (uint64_t)tokens[i], (uint64_t)col, c.init_scale));

  for (int i = 0; i < 4 * WIDTH; i++)
    g[i] = (float)(i % 7) - 3.0f;
  op = batch_op(EMBPS_OP_PUSH, t, tokens, 4);
  op.grads = g;
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  assert_true(op.applied);
  assert_int_equal(op.num_unique, 2);
  for (int col = 0; col < WIDTH; col++) {
    float g5 = g[col] + g[3 * WIDTH + col], g7 = g[2 * WIDTH + col];
    const float *w = embps_table_arrays(t).data;
    norm2 += (double)g5 * g5 + (double)g7 * g7;
    assert_true(fabsf(w[5 * WIDTH + col] - (before[5 * WIDTH + col] - 0.5f * g5)) < 1e-6f);
    assert_true(fabsf(w[7 * WIDTH + col] - (before[7 * WIDTH + col] - 0.5f * g7)) < 1e-6f);
    assert_true(w[col] == 0.0f);
  }
  assert_true(fabs(op.grad_norm - sqrt(norm2)) < 1e-5);
  assert_memory_equal((float *)embps_table_arrays(t).data + 8 * WIDTH, before + 8 * WIDTH,
                      32 * WIDTH * 4);

  /* The gate: one infinite gradient and nothing changes. */
  memcpy(before, embps_table_arrays(t).data, sizeof(before));
  g[WIDTH + 3] = INFINITY;
  op = batch_op(EMBPS_OP_PUSH, t, tokens, 4);
  op.grads = g;
  tokens[1] = 9; /* not padding any more, so its gradient counts */
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  assert_false(op.applied);
  assert_true(op.skipped);
  assert_memory_equal(embps_table_arrays(t).data, before, sizeof(before));
  assert_int_equal(embps_table_counters(t)->steps_skipped, 1);
  rank_fini(&r);
}

/* A lookup's rows go back in chunks of a sixth of the L2 (64 KiB to 1 MiB, 256 KiB when the L2 is
 * not known); each publish covers whole chunks in order, and the rows it covers are final. */
#define CHUNKED_WIDTH 128
#define CHUNKED_ROWS 5000

typedef struct chunk_seen {
  const embps_table_config_t *config;
  const int64_t *tokens;
  const float *out;
  size_t ready[64], publishes;
  int rows_wrong;
} chunk_seen_t;

static void on_publish(embps_op_t *op, void *arg) {
  chunk_seen_t *seen = arg;
  size_t ready = atomic_load(&op->rows_ready),
         from = seen->publishes ? seen->ready[seen->publishes - 1] : 0;
  if (seen->publishes < 64)
    seen->ready[seen->publishes] = ready;
  seen->publishes++;
  for (size_t i = from; i < ready; i++)
    for (size_t col = 0; col < CHUNKED_WIDTH; col++)
      seen->rows_wrong += seen->out[i * CHUNKED_WIDTH + col] !=
                          embps_init_value(seen->config->seed, (uint64_t)seen->tokens[i], col,
                                           seen->config->init_scale);
}

static void test_lookup_published_in_chunks(void **state) {
  rank_ctx_t r;
  int fds[1] = {-1};
  embps_table_config_t c = table_config(EMBPS_OPTIMIZER_SGD);
  embps_error_t err;
  const size_t row_bytes = CHUNKED_WIDTH * sizeof(float);
  const size_t chunk = embps__engine_cpu_chunk_bytes(embps_l2_cache_bytes()) / row_bytes;
  const size_t n = 4 * chunk + 7;
  (void)state;
  assert_int_equal(embps__engine_cpu_chunk_bytes(2u << 20), (2u << 20) / 6);
  assert_int_equal(embps__engine_cpu_chunk_bytes(0), 256u << 10);
  assert_int_equal(embps__engine_cpu_chunk_bytes(64u << 10), 64u << 10);
  assert_int_equal(embps__engine_cpu_chunk_bytes(256u << 20), 1u << 20);

  c.rows = CHUNKED_ROWS;
  c.emb_width = CHUNKED_WIDTH;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  assert_true(n < CHUNKED_ROWS && n <= 64 * chunk);
  int64_t *tokens = malloc(n * sizeof(int64_t));
  float *out = malloc(n * row_bytes);
  assert_non_null(tokens);
  assert_non_null(out);
  for (size_t i = 0; i < n; i++)
    tokens[i] = (int64_t)((i * 7919) % (CHUNKED_ROWS - 1)) + 1;
  rank_init(&r, 0, 1, fds);
  create(&r, &c);
  chunk_seen_t seen = {.config = &c, .tokens = tokens, .out = out};
  embps_op_t op = batch_op(EMBPS_OP_LOOKUP, embps_store_find(r.store, "t"), tokens, n);
  op.rows_out = out;
  op.publish = on_publish;
  op.publish_arg = &seen;
  assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
  assert_int_equal(seen.publishes, 5);
  for (size_t k = 0; k < 4; k++)
    assert_int_equal(seen.ready[k], (k + 1) * chunk);
  assert_int_equal(seen.ready[4], n);
  assert_int_equal(seen.rows_wrong, 0);
  rank_fini(&r);
  free(tokens);
  free(out);
}

/* ---- groups of N: results do not depend on N --------------------------------------------- */

#define STEPS 12
#define BATCH 24 /* divisible by 1, 2, 3, 4 and 8 */
#define MAX_RANKS 8
#define WIDE 256   /* 8 ranks x EMBPS_ROW_STATS_BLOCK */
#define NAN_STEP 7 /* a push with a NaN gradient: skipped by the gate on every rank */

typedef struct run_args {
  uint32_t rank, size;
  int fds[MAX_RANKS];
  embps_table_config_t config;
  uint8_t *final; /* ROWS x emb_width of dtype, filled by every rank's lookup of all rows */
  double norms[STEPS];
  int status;
} run_args_t;

/* The same deterministic workload for every N: STEPS pushes of BATCH tokens (duplicates and
 * padding included), then a lookup of every row. Rank r takes positions [r*n, (r+1)*n).
 * grads is BATCH x width of dtype. */
static void workload(int step, size_t width, embps_dtype_t dtype, int64_t *tokens, void *grads) {
  uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(step + 1);
  for (size_t i = 0; i < BATCH; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tokens[i] = (int64_t)(x % 16); /* heavy duplication, token 0 is padding */
    for (size_t col = 0; col < width; col++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      float v = (float)((double)(x % 2001) / 1000.0 - 1.0) * (col % 7 == 0 ? 30.0f : 1.0f);
      if (dtype == EMBPS_DTYPE_BF16)
        ((uint16_t *)grads)[i * width + col] = embps_f32_to_bf16(v);
      else
        ((float *)grads)[i * width + col] = v;
    }
  }
  if (step == NAN_STEP) { /* one NaN in a row that is not padding (token 0's rows are dropped) */
    size_t i = 0;
    while (tokens[i] == 0)
      i++;
    if (dtype == EMBPS_DTYPE_BF16)
      ((uint16_t *)grads)[i * width + 3] = embps_f32_to_bf16(NAN);
    else
      ((float *)grads)[i * width + 3] = NAN;
  }
}

static void *run_rank(void *p) {
  run_args_t *a = p;
  rank_ctx_t r;
  const embps_table_config_t *c = &a->config;
  const size_t width = c->emb_width, ds = embps_dtype_size(c->dtype), n = BATCH / a->size;
  embps_table_t *t;
  int64_t tokens[BATCH], all[ROWS];
  uint8_t *grads = calloc(BATCH * width, ds);
  embps_error_t err;

  rank_init(&r, a->rank, a->size, a->fds);
  create(&r, c);
  t = embps_store_find(r.store, "t");
  for (int step = 0; step < STEPS; step++) {
    const uint64_t sent = r.comm->stats.bytes_sent;
    const embps_round_shape_t rs = {.kind = EMBPS_OP_PUSH,
                                    .group_size = a->size,
                                    .T = BATCH,
                                    .w = width / a->size,
                                    .W = width,
                                    .ds = ds};
    embps_op_t op;
    int second;
    workload(step, width, c->dtype, tokens, grads);
    op = batch_op(EMBPS_OP_PUSH, t, tokens + a->rank * n, n);
    op.grads = grads + a->rank * n * width * ds;
    if (embps_engine_run(r.engine, &op, &err) != EMBPS_OK || op.applied != (step != NAN_STEP) ||
        op.skipped != (step == NAN_STEP))
      a->status = 1;
    a->norms[step] = op.grad_norm;
    /* The row statistics moved what round_cost.c says (by owner on 4 and 8 ranks of WIDE): the
     * bytes `embps plan` predicts are the engine's own. */
    second =
        op.applied && c->weight_decay != 0.0f && c->optimizer == EMBPS_OPTIMIZER_ROWWISE_ADAGRAD;
    if (r.comm->stats.bytes_sent - sent != embps_round_peer_bytes(&rs, op.num_unique, second))
      a->status = 2;
  }
  for (int i = 0; i < ROWS; i++)
    all[i] = i;
  {
    /* ROWS must split over the group: 40 over 1, 2, 4 and 8; for 3 ranks, look up 39 rows. */
    size_t rows = ROWS - ROWS % a->size, per = rows / a->size;
    uint8_t *out = calloc(per * width, ds);
    embps_op_t op = batch_op(EMBPS_OP_LOOKUP, t, all + a->rank * per, per);
    op.rows_out = out;
    if (embps_engine_run(r.engine, &op, &err) != EMBPS_OK)
      a->status = 1;
    memcpy(a->final + a->rank * per * width * ds, out, per * width * ds);
    free(out);
  }
  {
    /* Three lookups of 2, 1 and 3 tokens a rank fused into one (lookups.c), then the same one
     * by one: every op's rows are the same bytes (issue 34). */
    enum { K = 3 };
    const size_t sizes[K] = {2, 1, 3};
    int64_t tok[K][3];
    uint8_t *fused[K], *alone[K];
    embps_op_t ops[K], one;
    embps_op_t *ptrs[K];
    size_t so_far = 0;
    for (int i = 0; i < K; i++) {
      for (size_t j = 0; j < sizes[i]; j++)
        tok[i][j] = (int64_t)((a->rank * 7 + (uint32_t)i * 5 + j * 3) % 16); /* 0: padding */
      fused[i] = calloc(sizes[i] * width, ds);
      alone[i] = calloc(sizes[i] * width, ds);
      ops[i] = batch_op(EMBPS_OP_LOOKUP, t, tok[i], sizes[i]);
      ops[i].rows_out = fused[i];
      ptrs[i] = &ops[i];
      if (a->size > 1 && !embps_engine_lookups_fuse(r.engine, &ops[0], i ? &ops[i] : NULL, so_far))
        a->status = 1; /* lookups of one dense table fuse in a group */
      so_far += sizes[i];
    }
    if (embps_engine_run_lookups(r.engine, ptrs, K, &err) != EMBPS_OK)
      a->status = 1;
    for (int i = 0; i < K; i++) {
      one = batch_op(EMBPS_OP_LOOKUP, t, tok[i], sizes[i]);
      one.rows_out = alone[i];
      if (embps_engine_run(r.engine, &one, &err) != EMBPS_OK || ops[i].error.status != EMBPS_OK ||
          memcmp(fused[i], alone[i], sizes[i] * width * ds) != 0)
        a->status = 1;
      free(fused[i]);
      free(alone[i]);
    }
  }
  free(grads);
  rank_fini(&r);
  return NULL;
}

/* Connected sockets for a full mesh of n ranks: fds[i][j] talks to rank j. */
static void mesh_sockets(uint32_t n, int fds[MAX_RANKS][MAX_RANKS]) {
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < n; j++)
      fds[i][j] = -1;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i + 1; j < n; j++) {
      int sv[2];
      assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
      fds[i][j] = sv[0];
      fds[j][i] = sv[1];
    }
}

/* Runs the workload on a group of `size` ranks; final gets the table, norms each push's norm. */
static void run_group(uint32_t size, const embps_table_config_t *c, uint8_t *final, double *norms) {
  run_args_t args[MAX_RANKS];
  pthread_t threads[MAX_RANKS];
  int fds[MAX_RANKS][MAX_RANKS];
  mesh_sockets(size, fds);
  for (uint32_t r = 0; r < size; r++) {
    memset(&args[r], 0, sizeof(args[r]));
    args[r].rank = r;
    args[r].size = size;
    memcpy(args[r].fds, fds[r], sizeof(args[r].fds));
    args[r].config = *c;
    args[r].final = final;
    assert_int_equal(pthread_create(&threads[r], NULL, run_rank, &args[r]), 0);
  }
  for (uint32_t r = 0; r < size; r++) {
    pthread_join(threads[r], NULL);
    assert_int_equal(args[r].status, 0); /* 2: peer bytes other than round_cost.c's */
    for (int s = 0; s < STEPS; s++)
      assert_true(args[r].norms[s] == args[0].norms[s]); /* every rank agrees bitwise */
  }
  memcpy(norms, args[0].norms, sizeof(args[0].norms));
}

static const embps_optimizer_t all_optimizers[] = {EMBPS_OPTIMIZER_SGD, EMBPS_OPTIMIZER_ADAGRAD,
                                                   EMBPS_OPTIMIZER_ROWWISE_ADAGRAD,
                                                   EMBPS_OPTIMIZER_ADAM};

/* The workload moved the pushed rows (so comparisons mean something) and the padding row
 * stayed zero. */
static void check_moved(const embps_table_config_t *c, const uint8_t *table) {
  float first, initial = embps_init_value(c->seed, 1, 0, c->init_scale);
  if (c->dtype == EMBPS_DTYPE_BF16) {
    initial = embps_bf16_to_f32(embps_f32_to_bf16(initial));
    first = embps_bf16_to_f32(((const uint16_t *)table)[c->emb_width]);
    for (uint32_t col = 0; col < c->emb_width; col++)
      assert_true(((const uint16_t *)table)[col] == 0);
  } else {
    first = ((const float *)table)[c->emb_width];
    for (uint32_t col = 0; col < c->emb_width; col++)
      assert_true(((const float *)table)[col] == 0.0f);
  }
  assert_true(first != initial);
}

/* A table whose shard width is a multiple of the row-statistics block on every group size:
 * 1, 2, 4 and 8 ranks leave bitwise the same table and report bitwise the same norms, for every
 * optimizer and both dtypes (weight decay on, so rowwise Adagrad's second row statistics run
 * too; one step skipped by the gate), whether the row statistics are gathered whole (2 ranks)
 * or combined by owner (4 and 8); and two runs on one rank are bitwise equal. */
static void test_bitwise_independent_of_n(void **state) {
  const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  (void)state;
  /* Both ways of combining run below (the rule is round_cost.c's). */
  assert_false(embps_round_stats_by_owner(2, WIDE / 2 / EMBPS_ROW_STATS_BLOCK));
  assert_true(embps_round_stats_by_owner(4, WIDE / 4 / EMBPS_ROW_STATS_BLOCK));
  assert_true(embps_round_stats_by_owner(8, WIDE / 8 / EMBPS_ROW_STATS_BLOCK));
  for (size_t d = 0; d < 2; d++)
    for (size_t o = 0; o < 4; o++) {
      embps_table_config_t c = table_config(all_optimizers[o]);
      const size_t bytes = (size_t)ROWS * WIDE * embps_dtype_size(dtypes[d]);
      uint8_t *ref = calloc(1, bytes), *got = calloc(1, bytes);
      double ref_norms[STEPS], norms[STEPS];
      c.emb_width = WIDE;
      c.dtype = dtypes[d];
      c.init_scale = 1.0f / 16.0f;
      run_group(1, &c, ref, ref_norms);
      check_moved(&c, ref);
      for (uint32_t n = 1; n <= MAX_RANKS; n *= 2) {
        memset(got, 0xa5, bytes);
        run_group(n, &c, got, norms);
        if (memcmp(got, ref, bytes) != 0 || memcmp(norms, ref_norms, sizeof(norms)) != 0)
          fail_msg("%s %s on %u ranks: the table or the norms differ from 1 rank's",
                   embps_dtype_name(c.dtype), embps_optimizer_name(c.optimizer), n);
      }
      free(ref);
      free(got);
    }
}

/* A narrow table (12 columns over 1 to 4 ranks: slices of 12, 6, 4, 3 columns, narrower than a
 * block) gives the same table to rounding. */
static void test_close_for_narrow_slices(void **state) {
  (void)state;
  for (size_t o = 0; o < 4; o++) {
    embps_table_config_t c = table_config(all_optimizers[o]);
    float ref[ROWS * WIDTH], got[ROWS * WIDTH];
    double ref_norms[STEPS], norms[STEPS];
    run_group(1, &c, (uint8_t *)ref, ref_norms);
    check_moved(&c, (uint8_t *)ref);
    for (uint32_t n = 2; n <= 4; n++) {
      size_t rows = ROWS - ROWS % n;
      memset(got, 0, sizeof(got));
      run_group(n, &c, (uint8_t *)got, norms);
      for (int s = 0; s < STEPS; s++)
        assert_true(fabs(norms[s] - ref_norms[s]) <= 1e-6 * fabs(ref_norms[s]));
      for (size_t i = 0; i < rows * WIDTH; i++) {
        float tol = 1e-6f * fabsf(ref[i]) + 1e-7f;
        if (fabsf(got[i] - ref[i]) > tol)
          fail_msg("optimizer %zu, %u ranks: element %zu is %.9g, 1 rank says %.9g", o, n, i,
                   (double)got[i], (double)ref[i]);
      }
    }
  }
}

/* ---- threads: the same bits with any number ---------------------------------------------- */

#define T_ROWS 6000
#define T_WIDTH 64
#define T_BATCH 4096 /* 8 shares of the engine's 512-row minimum: every thread count splits */
#define T_STEPS 4

/* table_config(opt) at the threads tests' shape (T_ROWS x T_WIDTH of dtype), resolved. */
static embps_table_config_t threads_config(embps_optimizer_t opt, embps_dtype_t dtype) {
  embps_table_config_t c = table_config(opt);
  embps_error_t err;
  c.rows = T_ROWS;
  c.emb_width = T_WIDTH;
  c.dtype = dtype;
  assert_int_equal(embps_table_config_resolve(&c, 1, 1 << 30, &err), EMBPS_OK);
  return c;
}

/* One rank with `threads` threads applies T_STEPS pushes of T_BATCH tokens (singletons,
 * duplicates, padding) and returns its table's three arrays, concatenated, and the norms. */
static uint8_t *pushed_with_threads(const embps_table_config_t *c, unsigned threads,
                                    double norms[T_STEPS], size_t *bytes) {
  rank_ctx_t r;
  int fds[1] = {-1};
  const size_t ds = embps_dtype_size(c->dtype);
  int64_t *tokens = calloc(T_BATCH, sizeof(int64_t));
  uint8_t *grads = calloc((size_t)T_BATCH * T_WIDTH, ds), *all;
  size_t sizes[3];
  embps_table_t *t;
  embps_error_t err;
  uint64_t x = 0x2545f4914f6cdd1dull;

  rank_init(&r, 0, 1, fds);
  assert_int_equal(embps_engine_set_threads(r.engine, threads), threads);
  create(&r, c);
  t = embps_store_find(r.store, "t");
  for (int step = 0; step < T_STEPS; step++) {
    embps_op_t op;
    for (size_t i = 0; i < T_BATCH; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      /* a quarter of the positions on 64 hot rows (0 among them), the rest over the table */
      tokens[i] = (int64_t)(x % 4 == 0 ? (x >> 8) % 64 : (x >> 8) % T_ROWS);
      for (size_t col = 0; col < T_WIDTH; col++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        float v = (float)((double)(x % 2001) / 1000.0 - 1.0);
        if (c->dtype == EMBPS_DTYPE_BF16)
          ((uint16_t *)grads)[i * T_WIDTH + col] = embps_f32_to_bf16(v);
        else
          ((float *)grads)[i * T_WIDTH + col] = v;
      }
    }
    op = batch_op(EMBPS_OP_PUSH, t, tokens, T_BATCH);
    op.grads = grads;
    assert_int_equal(embps_engine_run(r.engine, &op, &err), EMBPS_OK);
    assert_true(op.applied);
    norms[step] = op.grad_norm;
  }
  embps_table_array_bytes(t, sizes);
  *bytes = sizes[0] + sizes[1] + sizes[2];
  all = malloc(*bytes);
  {
    const embps_table_arrays_t a = embps_table_arrays(t);
    const void *arrays[3] = {a.data, a.state0, a.state1};
    size_t at = 0;
    for (int i = 0; i < 3; i++) {
      if (sizes[i])
        memcpy(all + at, arrays[i], sizes[i]);
      at += sizes[i];
    }
  }
  free(tokens);
  free(grads);
  rank_fini(&r);
  return all;
}

/* The cpu engine splits a push's segment sum and update over its threads: 2, 3 and 5 threads
 * leave the table (weights and optimizer state) and the norms bitwise as one thread does, for
 * every optimizer and both dtypes, weight decay on. */
static void test_threads_bitwise(void **state) {
  const embps_dtype_t dtypes[] = {EMBPS_DTYPE_F32, EMBPS_DTYPE_BF16};
  const unsigned counts[] = {2, 3, 5};
  (void)state;
  for (size_t d = 0; d < 2; d++)
    for (size_t o = 0; o < 4; o++) {
      const embps_table_config_t c = threads_config(all_optimizers[o], dtypes[d]);
      double ref_norms[T_STEPS], norms[T_STEPS];
      size_t ref_bytes, bytes;
      uint8_t *ref, *got;
      ref = pushed_with_threads(&c, 1, ref_norms, &ref_bytes);
      for (size_t k = 0; k < 3; k++) {
        got = pushed_with_threads(&c, counts[k], norms, &bytes);
        assert_int_equal(bytes, ref_bytes);
        if (memcmp(got, ref, bytes) != 0 || memcmp(norms, ref_norms, sizeof(norms)) != 0)
          fail_msg("%s %s on %u threads: the table or the norms differ from 1 thread's",
                   embps_dtype_name(c.dtype), embps_optimizer_name(c.optimizer), counts[k]);
        free(got);
      }
      free(ref);
    }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_rank),
      cmocka_unit_test(test_lookup_published_in_chunks),
      cmocka_unit_test(test_bitwise_independent_of_n),
      cmocka_unit_test(test_close_for_narrow_slices),
      cmocka_unit_test(test_threads_bitwise),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
