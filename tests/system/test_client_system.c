/* System tests of libembps against the real embps-server binary.
 *
 * The group setup starts one server on a free loopback port (server_proc.c) with small limits
 * (--max-message-bytes 1 MiB, requests and replies; --max-memory-bytes 64 MiB) so that the limits
 * can be hit with cheap requests, and every test drives it through the public C API only, as a
 * training worker would: tables of every optimizer and dtype, lookups, sync and async pushes,
 * pipelined calls, several concurrent clients, statistics, and every kind of bad input.
 * Expected values are computed here independently of the server: SGD results are checked bit
 * for bit with the same f32 arithmetic (sum duplicate gradients in position order, then
 * w - lr * sum), and the concurrent test keeps a sequential reference of each client's rows.
 * Where an exact reference is impractical (pipelining with row-wise Adagrad), the same
 * sequence is replayed one call at a time on a twin table with the same seed and the results
 * must be identical. Every bad request is checked for its status, a fragment of its message,
 * and a table that is bit for bit what it was before.
 *
 * Two tests start servers of their own (idle connections with --stall-timeout-ms 300, and
 * a --max-memory-bytes that holds two small tables). Every server is stopped with SIGTERM and must
 * exit with status 0; under AddressSanitizer a leak makes that status non-zero and fails the test.
 * All waits are bounded: clients use a 30 s deadline, sockets are polled with timeouts, and loops
 * have fixed trip counts. */
#define _DEFAULT_SOURCE
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/embps.h"
#include "common/alloc.h"
#include "server_proc.h"

#define DEADLINE_MS 30000
#define STOP_TIMEOUT_MS 20000

static server_proc_t g_main;  /* the shared server */
static server_proc_t g_extra; /* a test's own server, stopped by the group teardown on failure */

/* ---- helpers ----------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33);
}

/* A float in [-1, 1) with few significant bits, so sums of a few of them are exact. */
static float rnd_grad(void) { return (float)((int)(rnd() % 2048) - 1024) / 1024.0f; }

static embps_client_t *connect_to(const char *address) {
  embps_client_t *c = NULL;
  embps_client_options_t o;
  embps_error_t err;
  embps_client_options_init(&o);
  o.deadline_ms = DEADLINE_MS;
  o.connect_timeout_ms = 10000;
  embps_error_clear(&err);
  if (embps_client_connect(&c, address, &o, &err) != EMBPS_OK)
    fail_msg("connect to %s: %s: %s", address, embps_status_string(err.status), err.message);
  return c;
}

static void create_table(embps_client_t *c, const char *name, uint64_t rows, uint32_t width,
                         embps_dtype_t dtype, embps_optimizer_t opt, float lr, uint64_t seed) {
  embps_table_spec_t s;
  embps_table_spec_init(&s);
  s.name = name;
  s.rows = rows;
  s.emb_width = width;
  s.dtype = dtype;
  s.optimizer = opt;
  s.lr = lr;
  s.seed = seed;
  embps_status_t st = embps_create_table(c, &s);
  if (st != EMBPS_OK)
    fail_msg("create %s: %s: %s", name, embps_status_string(st), embps_client_last_error(c));
}

static size_t row_bytes(uint32_t width, embps_dtype_t dtype) {
  return (size_t)width * embps_dtype_size(dtype);
}

/* Looks up tokens; fails the test on error. out must hold n rows. */
static void lookup_ok(embps_client_t *c, const char *table, const int64_t *tokens, size_t n,
                      void *out, size_t rb) {
  embps_status_t st = embps_lookup(c, table, tokens, n, out, n * rb);
  if (st != EMBPS_OK)
    fail_msg("lookup %s: %s: %s", table, embps_status_string(st), embps_client_last_error(c));
}

/* The whole table (rows 0..rows-1), malloc'd. */
static void *snapshot(embps_client_t *c, const char *table, uint64_t rows, uint32_t width,
                      embps_dtype_t dtype) {
  size_t rb = row_bytes(width, dtype);
  int64_t *tok = malloc(rows * sizeof(*tok));
  void *out = malloc(rows * rb);
  assert_non_null(tok);
  assert_non_null(out);
  for (uint64_t i = 0; i < rows; i++)
    tok[i] = (int64_t)i;
  lookup_ok(c, table, tok, rows, out, rb);
  free(tok);
  return out;
}

static void push_ok(embps_client_t *c, const char *table, const int64_t *tokens, size_t n,
                    const void *grads, size_t bytes, embps_dtype_t dtype, embps_push_mode_t mode,
                    embps_push_result_t *res) {
  embps_status_t st = embps_push(c, table, tokens, n, grads, bytes, dtype, mode, res);
  if (st != EMBPS_OK)
    fail_msg("push %s: %s: %s", table, embps_status_string(st), embps_client_last_error(c));
}

/* Asserts a failed call: its status, the client's last status, and a message fragment. */
#define expect_fail(c, st, want, fragment) expect_fail_at(c, st, want, fragment, __FILE__, __LINE__)

static void expect_fail_at(embps_client_t *c, embps_status_t st, embps_status_t want,
                           const char *fragment, const char *file, int line) {
  const char *msg = embps_client_last_error(c);
  if (st != want || embps_client_last_status(c) != want || !strstr(msg, fragment))
    fail_msg("%s:%d: expected %s with \"%s\", got %s (last %s): \"%s\"", file, line,
             embps_status_string(want), fragment, embps_status_string(st),
             embps_status_string(embps_client_last_status(c)), msg);
}

/* The table spec of name in a listing, or NULL. */
static const embps_table_spec_t *find_spec(const embps_table_spec_t *t, size_t n,
                                           const char *name) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].name, name) == 0)
      return &t[i];
  return NULL;
}

static size_t count_tables(embps_client_t *c) {
  embps_table_spec_t *t = NULL;
  size_t n = 0;
  assert_int_equal(embps_list_tables(c, &t, &n), EMBPS_OK);
  embps_tables_free(t, n);
  return n;
}

/* The stats of table name on rank 0 (copied), and the rank's figures. */
typedef struct stats_view {
  embps_rank_stats_t rank;
  embps_table_stats_t table;
  int found;
} stats_view_t;

static stats_view_t get_stats(embps_client_t *c, const char *name) {
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  stats_view_t v;
  memset(&v, 0, sizeof(v));
  assert_int_equal(embps_stats(c, &s, &n), EMBPS_OK);
  assert_int_equal(n, 1);
  v.rank = s[0];
  v.rank.backend = v.rank.version = v.rank.address = NULL;
  v.rank.tables = NULL;
  for (size_t i = 0; i < s[0].num_tables; i++)
    if (name && strcmp(s[0].tables[i].name, name) == 0) {
      v.table = s[0].tables[i];
      v.table.name = NULL;
      v.found = 1;
    }
  embps_stats_free(s, n);
  return v;
}

/* w - lr * g with the server's f32 arithmetic; written as two statements so that no
 * compiler contracts it into an FMA the server would not use. */
static float sgd_f32(float w, float lr, float g) {
  volatile float step = lr * g;
  return w - step;
}

static uint16_t sgd_bf16(uint16_t w, float lr, float g) {
  return embps_f32_to_bf16(sgd_f32(embps_bf16_to_f32(w), lr, g));
}

/* Sums the gradient rows of duplicate tokens in position order: sums[t] for every token t of
 * [0, rows), zero where the token does not occur. */
static void sum_by_token(const int64_t *tokens, size_t n, const float *grads, uint32_t width,
                         uint64_t rows, float *sums, int *touched) {
  memset(sums, 0, rows * width * sizeof(float));
  memset(touched, 0, rows * sizeof(int));
  for (size_t i = 0; i < n; i++) {
    touched[tokens[i]] = 1;
    for (uint32_t j = 0; j < width; j++)
      sums[tokens[i] * width + j] += grads[i * width + j];
  }
}

/* ---- group setup ------------------------------------------------------------------------- */

static int group_setup(void **state) {
  /* --max-message-bytes bounds replies too: test_oversized_messages looks up 32 000 tokens (a
   * 256 KB request) of 32-byte rows, a reply just under 1 MiB, and 40 000, one just over. */
  static const char *const flags[] = {"--max-message-bytes", "1048576", "--max-memory-bytes",
                                      "67108864", NULL};
  (void)state;
  return server_proc_start(&g_main, flags) == 0 ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  if (g_extra.pid > 0)
    server_proc_stop(&g_extra, STOP_TIMEOUT_MS);
  if (g_main.pid > 0)
    server_proc_stop(&g_main, STOP_TIMEOUT_MS);
  return 0;
}

/* ---- health, tables, lookups ------------------------------------------------------------- */

/* DropTable: the table is gone from the listing, lookups and a second drop answer NOT_FOUND,
 * and the name can be created again. */
static void test_drop_table(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  const int64_t tokens[2] = {1, 2};
  float rows[2 * 8];
  size_t before = count_tables(c);

  create_table(c, "dropped", 10, 8, 0, EMBPS_OPTIMIZER_SGD, 0.1f, 0);
  assert_int_equal(count_tables(c), before + 1);
  assert_int_equal(embps_drop_table(c, "dropped"), EMBPS_OK);
  assert_int_equal(count_tables(c), before);
  expect_fail(c, embps_lookup(c, "dropped", tokens, 2, rows, sizeof(rows)), EMBPS_NOT_FOUND,
              "table 'dropped' not found");
  expect_fail(c, embps_drop_table(c, "dropped"), EMBPS_NOT_FOUND, "table 'dropped' not found");
  expect_fail(c, embps_drop_table(c, ""), EMBPS_INVALID_ARGUMENT, "no table name");
  create_table(c, "dropped", 10, 8, 0, EMBPS_OPTIMIZER_SGD, 0.1f, 0);
  assert_int_equal(embps_lookup(c, "dropped", tokens, 2, rows, sizeof(rows)), EMBPS_OK);
  assert_int_equal(embps_drop_table(c, "dropped"), EMBPS_OK);
  embps_client_free(c);
}

static void test_health(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  int serving = -1;
  assert_int_equal(embps_client_group_size(c), 1);
  assert_int_equal(embps_health(c, "", &serving), EMBPS_OK);
  assert_int_equal(serving, 1);
  assert_int_equal(embps_health(c, "embps.v1.EmbeddingService", &serving), EMBPS_OK);
  assert_int_equal(serving, 1);
  serving = -1;
  expect_fail(c, embps_health(c, "no.such.Service", &serving), EMBPS_NOT_FOUND, "unknown service");
  /* The connection still works after the error. */
  assert_int_equal(embps_health(c, "", &serving), EMBPS_OK);
  assert_int_equal(serving, 1);
  embps_client_free(c);

  /* A port nobody listens on: connecting fails, quickly and with UNAVAILABLE. */
  {
    server_proc_t tmp;
    embps_client_t *d = NULL;
    embps_client_options_t o;
    embps_error_t err;
    char addr[64];
    static const char *const none[] = {NULL};
    assert_int_equal(server_proc_start(&tmp, none), 0);
    snprintf(addr, sizeof(addr), "%s", tmp.address);
    assert_int_equal(server_proc_stop(&tmp, STOP_TIMEOUT_MS), 0);
    embps_client_options_init(&o);
    o.connect_timeout_ms = 5000;
    embps_error_clear(&err);
    assert_int_equal(embps_client_connect(&d, addr, &o, &err), EMBPS_UNAVAILABLE);
    assert_null(d);
    assert_int_equal(err.status, EMBPS_UNAVAILABLE);
  }
}

typedef struct table_case {
  const char *name;
  embps_dtype_t dtype;
  embps_optimizer_t opt;
  float lr, eps, half_life, weight_decay, beta1, beta2;
  uint64_t seed;
} table_case_t;

static const table_case_t k_tables[] = {
    {"opt_sgd_f32", EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.02f, 0, 0, 0, 0, 0, 101},
    {"opt_sgd_bf16", EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_SGD, 0.03f, 0, 0, 0, 0, 0, 102},
    {"opt_adagrad_f32", EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAGRAD, 0.04f, 1e-6f, 0, 0, 0, 0, 103},
    {"opt_adagrad_bf16", EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAGRAD, 0.05f, 1e-6f, 0, 0, 0, 0, 104},
    {"opt_rowwise_f32", EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, 0.06f, 1e-7f, 500.0f, 0,
     0, 0, 105},
    {"opt_rowwise_bf16", EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, 0.07f, 0, 0, 0.001f, 0,
     0, 106},
    {"opt_adam_f32", EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAM, 0.08f, 0, 0, 0, 0.8f, 0.99f, 107},
    {"opt_adam_bf16", EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAM, 0.09f, 0, 0, 0, 0, 0, 108},
};
#define NUM_TABLE_CASES (sizeof(k_tables) / sizeof(k_tables[0]))
#define OPT_ROWS 40
#define OPT_WIDTH 8

static void test_create_and_list_tables(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  embps_table_spec_t *t = NULL;
  size_t n = 0, before = count_tables(c);

  for (size_t i = 0; i < NUM_TABLE_CASES; i++) {
    const table_case_t *k = &k_tables[i];
    embps_table_spec_t s;
    embps_table_spec_init(&s);
    s.name = k->name;
    s.rows = OPT_ROWS;
    s.emb_width = OPT_WIDTH;
    s.dtype = k->dtype;
    s.optimizer = k->opt;
    s.lr = k->lr;
    s.eps = k->eps;
    s.half_life = k->half_life;
    s.weight_decay = k->weight_decay;
    s.beta1 = k->beta1;
    s.beta2 = k->beta2;
    s.seed = k->seed;
    assert_int_equal(embps_create_table(c, &s), EMBPS_OK);
  }
  /* All defaults: rowwise_adagrad, f32, lr 0.01, eps 1e-8, init_scale 1/sqrt(emb_width). */
  create_table(c, "opt_default", 10, 16, 0, EMBPS_OPTIMIZER_DEFAULT, 0.0f, 0);
  /* embps_create_table_answered hands back the table as the server made it: what was given,
   * and the defaults filled in for what was not. */
  {
    embps_table_spec_t s, *a = NULL, sentinel;
    embps_table_spec_init(&s);
    s.name = "opt_answered";
    s.rows = 10;
    s.emb_width = 16;
    s.optimizer = EMBPS_OPTIMIZER_ADAM;
    s.lr = 0.5f;
    assert_int_equal(embps_create_table_answered(c, &s, &a), EMBPS_OK);
    assert_non_null(a);
    assert_string_equal(a->name, "opt_answered");
    assert_int_equal(a->rows, 10);
    assert_int_equal(a->emb_width, 16);
    assert_int_equal(a->dtype, EMBPS_DTYPE_F32);
    assert_int_equal(a->optimizer, EMBPS_OPTIMIZER_ADAM);
    assert_true(a->lr == 0.5f);
    assert_true(a->eps == 1e-8f);
    assert_true(a->beta1 == 0.9f);
    assert_true(a->beta2 == 0.999f);
    assert_true(fabsf(a->init_scale - 0.25f) < 1e-7f);
    embps_tables_free(a, 1);
    /* A refused create leaves *created as it was. */
    a = &sentinel;
    assert_int_equal(embps_create_table_answered(c, &s, &a), EMBPS_ALREADY_EXISTS);
    assert_ptr_equal(a, &sentinel);
  }

  assert_int_equal(embps_list_tables(c, &t, &n), EMBPS_OK);
  assert_int_equal(n, before + NUM_TABLE_CASES + 2);
  for (size_t i = 0; i < NUM_TABLE_CASES; i++) {
    const table_case_t *k = &k_tables[i];
    const embps_table_spec_t *s = find_spec(t, n, k->name);
    assert_non_null(s);
    assert_int_equal(s->rows, OPT_ROWS);
    assert_int_equal(s->emb_width, OPT_WIDTH);
    assert_int_equal(s->dtype, k->dtype);
    assert_int_equal(s->optimizer, k->opt);
    assert_true(s->lr == k->lr);
    assert_true(s->eps == (k->eps != 0.0f ? k->eps : 1e-8f));
    assert_true(s->half_life == k->half_life);
    assert_true(s->weight_decay == k->weight_decay);
    assert_int_equal(s->seed, k->seed);
    if (k->opt == EMBPS_OPTIMIZER_ADAM) {
      assert_true(s->beta1 == (k->beta1 != 0.0f ? k->beta1 : 0.9f));
      assert_true(s->beta2 == (k->beta2 != 0.0f ? k->beta2 : 0.999f));
    }
  }
  {
    const embps_table_spec_t *s = find_spec(t, n, "opt_default");
    assert_non_null(s);
    assert_int_equal(s->optimizer, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD);
    assert_int_equal(s->dtype, EMBPS_DTYPE_F32);
    assert_true(s->lr == 0.01f);
    assert_true(s->eps == 1e-8f);
    assert_true(fabsf(s->init_scale - 0.25f) < 1e-7f);
  }
  embps_tables_free(t, n);
  embps_client_free(c);
}

/* Every optimizer and dtype: a sync and an async push move exactly the pushed rows, against
 * the gradient, by about lr on the first step (each adaptive optimizer normalizes the step to
 * lr for a constant gradient), and leave every other row and the padding row alone. */
static void test_every_optimizer_updates(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  const int64_t tokens[] = {3, 5, 3, 0};
  const size_t n = 4;

  for (size_t i = 0; i < NUM_TABLE_CASES; i++) {
    const table_case_t *k = &k_tables[i];
    size_t rb = row_bytes(OPT_WIDTH, k->dtype);
    uint8_t *before = snapshot(c, k->name, OPT_ROWS, OPT_WIDTH, k->dtype);
    uint8_t grads[4 * OPT_WIDTH * 4];
    embps_push_result_t res;

    for (size_t e = 0; e < n * OPT_WIDTH; e++) {
      if (k->dtype == EMBPS_DTYPE_BF16)
        ((uint16_t *)grads)[e] = embps_f32_to_bf16(0.5f);
      else
        ((float *)grads)[e] = 0.5f;
    }
    memset(&res, 0, sizeof(res));
    push_ok(c, k->name, tokens, n, grads, n * rb, k->dtype, EMBPS_PUSH_SYNC, &res);
    assert_int_equal(res.applied, 1);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.num_unique, 2);
    /* Row 3 sums to 1.0 per element, row 5 is 0.5: norm sqrt(8 * 1 + 8 * 0.25). */
    assert_true(fabs(res.grad_norm - sqrt(10.0)) < 1e-9);

    uint8_t *after = snapshot(c, k->name, OPT_ROWS, OPT_WIDTH, k->dtype);
    for (uint64_t r = 0; r < OPT_ROWS; r++) {
      if (r == 3 || r == 5) {
        for (uint32_t j = 0; j < OPT_WIDTH; j++) {
          size_t e = r * OPT_WIDTH + j;
          float w0, w1, want;
          if (k->dtype == EMBPS_DTYPE_BF16) {
            w0 = embps_bf16_to_f32(((uint16_t *)before)[e]);
            w1 = embps_bf16_to_f32(((uint16_t *)after)[e]);
          } else {
            w0 = ((float *)before)[e];
            w1 = ((float *)after)[e];
          }
          assert_true(w1 < w0);
          if (k->opt == EMBPS_OPTIMIZER_SGD)
            want = w0 - k->lr * (r == 3 ? 1.0f : 0.5f);
          else
            want = w0 - k->lr * (1.0f + k->weight_decay * w0);
          /* f32: close to the formula; bf16: within a rounding step of it. */
          float tol = k->dtype == EMBPS_DTYPE_BF16 ? 0.004f : 1e-5f;
          if (fabsf(w1 - want) > tol)
            fail_msg("%s row %llu col %u: %.9g -> %.9g, expected about %.9g", k->name,
                     (unsigned long long)r, j, w0, w1, want);
        }
      } else {
        assert_memory_equal(after + r * rb, before + r * rb, rb);
      }
    }
    free(after);

    /* Async: the reply says ordered; a lookup on the same connection sees the update. */
    memset(&res, 0, sizeof(res));
    push_ok(c, k->name, tokens, n, grads, n * rb, k->dtype, EMBPS_PUSH_ASYNC, &res);
    assert_int_equal(res.ordered, 1);
    assert_int_equal(res.skipped, 0);
    {
      uint8_t row3a[OPT_WIDTH * 4], row3b[OPT_WIDTH * 4];
      const int64_t t3 = 3;
      lookup_ok(c, k->name, &t3, 1, row3a, rb);
      memcpy(row3b, before + 3 * rb, rb);
      assert_memory_not_equal(row3a, row3b, rb);
    }
    free(before);
  }
  embps_client_free(c);
}

static void test_lookup_rows(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  const uint32_t w = 16;
  const int64_t tokens[] = {0, 5, 99, 5, 0, 1};
  const size_t n = 6;
  float a[6 * 16], b[6 * 16], o[6 * 16], again[6 * 16];
  uint16_t h[6 * 16];
  float small[6 * 16];

  create_table(c, "look_a", 100, w, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 7);
  create_table(c, "look_twin", 100, w, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ADAM, 0.5f, 7);
  create_table(c, "look_other", 100, w, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 8);
  create_table(c, "look_bf16", 100, w, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_SGD, 0.1f, 7);
  {
    embps_table_spec_t s;
    embps_table_spec_init(&s);
    s.name = "look_small";
    s.rows = 100;
    s.emb_width = w;
    s.seed = 7;
    s.init_scale = 0.01f;
    assert_int_equal(embps_create_table(c, &s), EMBPS_OK);
  }

  lookup_ok(c, "look_a", tokens, n, a, w * 4);
  lookup_ok(c, "look_twin", tokens, n, b, w * 4);
  lookup_ok(c, "look_other", tokens, n, o, w * 4);
  lookup_ok(c, "look_a", tokens, n, again, w * 4);
  lookup_ok(c, "look_bf16", tokens, n, h, w * 2);
  lookup_ok(c, "look_small", tokens, n, small, w * 4);

  for (uint32_t j = 0; j < w; j++) {
    /* The padding row reads zero everywhere. */
    assert_true(a[0 * w + j] == 0.0f && a[4 * w + j] == 0.0f);
    assert_true(h[0 * w + j] == 0 && h[4 * w + j] == 0);
    assert_true(small[j] == 0.0f);
  }
  /* The same token gives the same row; different tokens different rows. */
  assert_memory_equal(&a[1 * w], &a[3 * w], w * 4);
  assert_memory_not_equal(&a[1 * w], &a[2 * w], w * 4);
  assert_memory_not_equal(&a[1 * w], &a[5 * w], w * 4);
  assert_memory_not_equal(&a[2 * w], &a[5 * w], w * 4);
  /* The seed alone decides the rows (not the optimizer); another seed gives other rows. */
  assert_memory_equal(a, b, sizeof(a));
  assert_memory_equal(a, again, sizeof(a));
  assert_memory_not_equal(&a[1 * w], &o[1 * w], w * 4);
  for (size_t i = 0; i < n; i++) {
    if (tokens[i] == 0)
      continue;
    int nonzero = 0;
    for (uint32_t j = 0; j < w; j++) {
      float v = a[i * w + j], hv = embps_bf16_to_f32(h[i * w + j]);
      /* Uniform in [-1/sqrt(16), 1/sqrt(16)) by default, [-0.01, 0.01) with init_scale. */
      assert_true(v >= -0.25f && v < 0.25f);
      assert_true(small[i * w + j] >= -0.01f && small[i * w + j] < 0.01f);
      nonzero += v != 0.0f;
      /* bf16 storage holds the same values, rounded. */
      if (fabsf(hv - v) > fabsf(v) * (1.0f / 256.0f) + 1e-30f)
        fail_msg("bf16 row %lld col %u: %.9g vs f32 %.9g", (long long)tokens[i], j, hv, v);
    }
    assert_true(nonzero > (int)w / 2);
  }
  embps_client_free(c);
}

/* ---- pushes ------------------------------------------------------------------------------ */

static void test_sgd_sync_push_exact(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  enum { ROWS = 32, W = 8, N = 6 };
  const int64_t tokens[N] = {3, 7, 3, 0, 3, 9};
  const float lr = 0.1f;
  float grads[N * W], sums[ROWS * W];
  uint16_t grads_h[N * W];
  int touched[ROWS];

  create_table(c, "sgd_f32", ROWS, W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, lr, 11);
  create_table(c, "sgd_bf16", ROWS, W, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_SGD, lr, 11);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < W; j++) {
      /* The padding row's gradient is huge: it must be ignored. */
      grads[i * W + j] = tokens[i] == 0 ? 1e30f : 0.37f * (float)(i + 1) - 0.11f * (float)j;
      grads[i * W + j] = embps_bf16_to_f32(embps_f32_to_bf16(grads[i * W + j]));
      grads_h[i * W + j] = embps_f32_to_bf16(grads[i * W + j]);
    }
  sum_by_token(tokens, N, grads, W, ROWS, sums, touched);

  for (int round = 0; round < 2; round++) {
    float *w0 = snapshot(c, "sgd_f32", ROWS, W, EMBPS_DTYPE_F32);
    uint16_t *h0 = snapshot(c, "sgd_bf16", ROWS, W, EMBPS_DTYPE_BF16);
    embps_push_result_t res, resh;
    double norm2 = 0.0;

    push_ok(c, "sgd_f32", tokens, N, grads, sizeof(grads), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
    push_ok(c, "sgd_bf16", tokens, N, grads_h, sizeof(grads_h), EMBPS_DTYPE_BF16, EMBPS_PUSH_SYNC,
            &resh);
    for (int r = 1; r < ROWS; r++)
      for (int j = 0; touched[r] && j < W; j++)
        norm2 += (double)sums[r * W + j] * sums[r * W + j];
    assert_int_equal(res.applied, 1);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.num_unique, 3);
    assert_true(fabs(res.grad_norm - sqrt(norm2)) <= 1e-5 * sqrt(norm2));
    assert_int_equal(resh.applied, 1);
    assert_int_equal(resh.num_unique, 3);

    float *w1 = snapshot(c, "sgd_f32", ROWS, W, EMBPS_DTYPE_F32);
    uint16_t *h1 = snapshot(c, "sgd_bf16", ROWS, W, EMBPS_DTYPE_BF16);
    for (int r = 0; r < ROWS; r++)
      for (int j = 0; j < W; j++) {
        int e = r * W + j;
        float want = r == 0 ? 0.0f : touched[r] ? sgd_f32(w0[e], lr, sums[e]) : w0[e];
        uint16_t want_h = r == 0 ? 0 : touched[r] ? sgd_bf16(h0[e], lr, sums[e]) : h0[e];
        if (memcmp(&w1[e], &want, 4) != 0)
          fail_msg("f32 row %d col %d: got %.9g, expected %.9g (was %.9g)", r, j, w1[e], want,
                   w0[e]);
        if (h1[e] != want_h)
          fail_msg("bf16 row %d col %d: got 0x%04x, expected 0x%04x", r, j, h1[e], want_h);
      }
    assert_true(w1[3 * W] != w0[3 * W]);
    free(w0);
    free(w1);
    free(h0);
    free(h1);
  }
  embps_client_free(c);
}

static void test_async_push_ordering(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  enum { ROWS = 16, W = 8 };
  const float lr = 0.1f;
  float *ref = NULL;

  create_table(c, "async_sgd", ROWS, W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, lr, 12);
  ref = snapshot(c, "async_sgd", ROWS, W, EMBPS_DTYPE_F32);
  for (int it = 0; it < 24; it++) {
    int64_t tok[2] = {1 + it % (ROWS - 1), 1 + (it * 7) % (ROWS - 1)};
    float g[2 * W], row[2 * W];
    embps_push_result_t res;
    for (int e = 0; e < 2 * W; e++)
      g[e] = rnd_grad();
    memset(&res, 0, sizeof(res));
    push_ok(c, "async_sgd", tok, 2, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_ASYNC, &res);
    assert_int_equal(res.ordered, 1);
    assert_int_equal(res.skipped, 0);
    for (int j = 0; j < W; j++) {
      if (tok[0] == tok[1]) {
        ref[tok[0] * W + j] = sgd_f32(ref[tok[0] * W + j], lr, g[j] + g[W + j]);
      } else {
        ref[tok[0] * W + j] = sgd_f32(ref[tok[0] * W + j], lr, g[j]);
        ref[tok[1] * W + j] = sgd_f32(ref[tok[1] * W + j], lr, g[W + j]);
      }
    }
    /* The very next call on the connection sees the update. */
    lookup_ok(c, "async_sgd", tok, 2, row, W * 4);
    assert_memory_equal(row, &ref[tok[0] * W], W * 4);
    assert_memory_equal(row + W, &ref[tok[1] * W], W * 4);
  }
  /* Pipelined: an async push then a lookup, both started before either is waited on, and
   * waited in reverse order. */
  {
    int64_t tok = 4;
    float g[W], row[W];
    embps_push_result_t res;
    embps_call_t *pc = NULL, *lc = NULL;
    for (int j = 0; j < W; j++)
      g[j] = 0.5f;
    assert_int_equal(embps_push_start(c, "async_sgd", &tok, 1, g, sizeof(g), EMBPS_DTYPE_F32,
                                      EMBPS_PUSH_ASYNC, &res, &pc),
                     EMBPS_OK);
    assert_int_equal(embps_lookup_start(c, "async_sgd", &tok, 1, row, sizeof(row), &lc), EMBPS_OK);
    assert_int_equal(embps_call_wait(lc), EMBPS_OK);
    assert_int_equal(embps_call_wait(pc), EMBPS_OK);
    for (int j = 0; j < W; j++)
      ref[4 * W + j] = sgd_f32(ref[4 * W + j], lr, 0.5f);
    assert_memory_equal(row, &ref[4 * W], sizeof(row));
  }
  float *all = snapshot(c, "async_sgd", ROWS, W, EMBPS_DTYPE_F32);
  assert_memory_equal(all, ref, ROWS * W * 4);
  free(all);
  free(ref);
  embps_client_free(c);
}

/* ---- pipelining -------------------------------------------------------------------------- */

#define PIPE_OPS 64
#define PIPE_ROWS 50
#define PIPE_W 16
#define PIPE_MAX_N 12

typedef struct pipe_op {
  int is_push;
  embps_push_mode_t mode;
  size_t n;
  int64_t tokens[PIPE_MAX_N];
  float grads[PIPE_MAX_N * PIPE_W];
  float out[PIPE_MAX_N * PIPE_W];
  embps_push_result_t res;
  embps_call_t *call;
} pipe_op_t;

static void test_pipelining(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  pipe_op_t *a = calloc(PIPE_OPS, sizeof(*a)), *b = calloc(PIPE_OPS, sizeof(*b));
  float *init, *fa, *fb;
  assert_non_null(a);
  assert_non_null(b);

  /* Row-wise Adagrad: each step depends on the accumulator, so any reordering shows. */
  create_table(c, "pipe_a", PIPE_ROWS, PIPE_W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD,
               0.1f, 77);
  create_table(c, "pipe_b", PIPE_ROWS, PIPE_W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_ROWWISE_ADAGRAD,
               0.1f, 77);
  init = snapshot(c, "pipe_a", PIPE_ROWS, PIPE_W, EMBPS_DTYPE_F32);
  for (int i = 0; i < PIPE_OPS; i++) {
    pipe_op_t *op = &a[i];
    op->is_push = i % 2 == 0;
    op->mode = i % 4 == 0 ? EMBPS_PUSH_SYNC : EMBPS_PUSH_ASYNC;
    op->n = 4 + (size_t)(i % (PIPE_MAX_N - 3));
    for (size_t k = 0; k < op->n; k++)
      op->tokens[k] = (int64_t)(rnd() % 12); /* few rows: many duplicates, token 0 included */
    for (size_t e = 0; e < op->n * PIPE_W; e++)
      op->grads[e] = rnd_grad();
    b[i] = *op;
  }

  /* Start all 64 calls before waiting on any. */
  for (int i = 0; i < PIPE_OPS; i++) {
    pipe_op_t *op = &a[i];
    embps_status_t st = op->is_push ? embps_push_start(c, "pipe_a", op->tokens, op->n, op->grads,
                                                       op->n * PIPE_W * 4, EMBPS_DTYPE_F32,
                                                       op->mode, &op->res, &op->call)
                                    : embps_lookup_start(c, "pipe_a", op->tokens, op->n, op->out,
                                                         op->n * PIPE_W * 4, &op->call);
    if (st != EMBPS_OK)
      fail_msg("start %d: %s: %s", i, embps_status_string(st), embps_client_last_error(c));
  }
  /* Wait in an order unlike the start order: lookups last to first, then pushes. */
  for (int i = PIPE_OPS - 1; i >= 0; i--)
    if (!a[i].is_push)
      assert_int_equal(embps_call_wait(a[i].call), EMBPS_OK);
  for (int i = 0; i < PIPE_OPS; i++)
    if (a[i].is_push)
      assert_int_equal(embps_call_wait(a[i].call), EMBPS_OK);

  /* The same sequence, one call at a time, on the twin table. */
  for (int i = 0; i < PIPE_OPS; i++) {
    pipe_op_t *op = &b[i];
    if (op->is_push)
      push_ok(c, "pipe_b", op->tokens, op->n, op->grads, op->n * PIPE_W * 4, EMBPS_DTYPE_F32,
              op->mode, &op->res);
    else
      lookup_ok(c, "pipe_b", op->tokens, op->n, op->out, PIPE_W * 4);
  }
  for (int i = 0; i < PIPE_OPS; i++) {
    if (a[i].is_push) {
      assert_int_equal(a[i].res.applied, b[i].res.applied);
      assert_int_equal(a[i].res.skipped, 0);
      assert_int_equal(a[i].res.ordered, b[i].res.ordered);
      if (a[i].mode == EMBPS_PUSH_SYNC) {
        assert_int_equal(a[i].res.applied, 1);
        assert_int_equal(a[i].res.num_unique, b[i].res.num_unique);
        assert_true(a[i].res.grad_norm == b[i].res.grad_norm);
      } else {
        assert_int_equal(a[i].res.ordered, 1);
      }
    } else if (memcmp(a[i].out, b[i].out, a[i].n * PIPE_W * 4) != 0) {
      fail_msg("pipelined lookup %d differs from the one-at-a-time run", i);
    }
  }
  fa = snapshot(c, "pipe_a", PIPE_ROWS, PIPE_W, EMBPS_DTYPE_F32);
  fb = snapshot(c, "pipe_b", PIPE_ROWS, PIPE_W, EMBPS_DTYPE_F32);
  assert_memory_equal(fa, fb, PIPE_ROWS * PIPE_W * 4);
  assert_memory_not_equal(fa, init, PIPE_ROWS * PIPE_W * 4);
  /* Rows never pushed stay as they were. */
  assert_memory_equal(fa + 12 * PIPE_W, init + 12 * PIPE_W, (PIPE_ROWS - 12) * PIPE_W * 4);
  free(init);
  free(fa);
  free(fb);
  free(a);
  free(b);
  embps_client_free(c);
}

/* ---- concurrent clients ------------------------------------------------------------------ */

#define CONC_THREADS 4
#define CONC_RANGE 32
#define CONC_ROWS (1 + CONC_THREADS * CONC_RANGE)
#define CONC_W 16
#define CONC_ITERS 40
#define CONC_BATCH 12

typedef struct conc_worker {
  pthread_t thread;
  int index;
  const float *init; /* the whole table before the test, shared read-only */
  float ref[CONC_RANGE * CONC_W];
  int failed;
  char error[640];
} conc_worker_t;

static const float k_conc_lr = 0.25f;

static void *conc_main(void *arg) {
  conc_worker_t *w = arg;
  const int64_t base = 1 + (int64_t)w->index * CONC_RANGE;
  embps_client_t *c = NULL;
  embps_client_options_t o;
  embps_error_t err;
  uint64_t rng = 1000 + (uint64_t)w->index;

  memcpy(w->ref, w->init + base * CONC_W, sizeof(w->ref));
  embps_client_options_init(&o);
  o.deadline_ms = DEADLINE_MS;
  embps_error_clear(&err);
  if (embps_client_connect(&c, g_main.address, &o, &err) != EMBPS_OK) {
    snprintf(w->error, sizeof(w->error), "connect: %s", err.message);
    w->failed = 1;
    return NULL;
  }
  for (int it = 0; it < CONC_ITERS && !w->failed; it++) {
    int64_t tok[CONC_BATCH];
    float g[CONC_BATCH * CONC_W], rows[CONC_BATCH * CONC_W];
    embps_push_result_t res;
    embps_status_t st;
    for (int k = 0; k < CONC_BATCH; k++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      tok[k] = base + (int64_t)((rng >> 33) % 8); /* 8 hot rows of the range: duplicates */
      if (it % 3 == 0)
        tok[k] += 8 * (k % 3);
      for (int j = 0; j < CONC_W; j++)
        g[k * CONC_W + j] = (float)((int)((rng >> (j + 8)) % 64) - 32) / 64.0f;
    }
    st = embps_push(c, "conc", tok, CONC_BATCH, g, sizeof(g), EMBPS_DTYPE_F32,
                    it % 2 ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC, &res);
    if (st != EMBPS_OK || res.skipped) {
      snprintf(w->error, sizeof(w->error), "push %d: %s: %s", it, embps_status_string(st),
               embps_client_last_error(c));
      w->failed = 1;
      break;
    }
    /* The reference: sum duplicates in position order, then one SGD step per row. */
    {
      float sums[CONC_RANGE * CONC_W];
      int touched[CONC_RANGE];
      memset(sums, 0, sizeof(sums));
      memset(touched, 0, sizeof(touched));
      for (int k = 0; k < CONC_BATCH; k++) {
        int r = (int)(tok[k] - base);
        touched[r] = 1;
        for (int j = 0; j < CONC_W; j++)
          sums[r * CONC_W + j] += g[k * CONC_W + j];
      }
      for (int r = 0; r < CONC_RANGE; r++)
        for (int j = 0; touched[r] && j < CONC_W; j++)
          w->ref[r * CONC_W + j] = sgd_f32(w->ref[r * CONC_W + j], k_conc_lr, sums[r * CONC_W + j]);
    }
    if (it % 4 == 3) {
      st = embps_lookup(c, "conc", tok, CONC_BATCH, rows, sizeof(rows));
      if (st != EMBPS_OK) {
        snprintf(w->error, sizeof(w->error), "lookup %d: %s: %s", it, embps_status_string(st),
                 embps_client_last_error(c));
        w->failed = 1;
        break;
      }
      for (int k = 0; k < CONC_BATCH; k++)
        if (memcmp(&rows[k * CONC_W], &w->ref[(tok[k] - base) * CONC_W], CONC_W * 4) != 0) {
          snprintf(w->error, sizeof(w->error), "iteration %d: row %lld differs from the reference",
                   it, (long long)tok[k]);
          w->failed = 1;
          break;
        }
    }
  }
  embps_client_free(c);
  return NULL;
}

static void test_concurrent_clients(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  conc_worker_t *w = calloc(CONC_THREADS, sizeof(*w));
  float *init, *final;
  assert_non_null(w);

  create_table(c, "conc", CONC_ROWS, CONC_W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, k_conc_lr, 5);
  init = snapshot(c, "conc", CONC_ROWS, CONC_W, EMBPS_DTYPE_F32);
  for (int i = 0; i < CONC_THREADS; i++) {
    w[i].index = i;
    w[i].init = init;
    assert_int_equal(pthread_create(&w[i].thread, NULL, conc_main, &w[i]), 0);
  }
  for (int i = 0; i < CONC_THREADS; i++)
    pthread_join(w[i].thread, NULL);
  for (int i = 0; i < CONC_THREADS; i++)
    if (w[i].failed)
      fail_msg("client %d: %s", i, w[i].error);

  final = snapshot(c, "conc", CONC_ROWS, CONC_W, EMBPS_DTYPE_F32);
  for (int j = 0; j < CONC_W; j++)
    assert_true(final[j] == 0.0f);
  for (int i = 0; i < CONC_THREADS; i++) {
    const float *got = final + (1 + i * CONC_RANGE) * CONC_W;
    assert_memory_not_equal(got, init + (1 + i * CONC_RANGE) * CONC_W, sizeof(w[i].ref));
    for (int e = 0; e < CONC_RANGE * CONC_W; e++)
      if (memcmp(&got[e], &w[i].ref[e], 4) != 0)
        fail_msg("client %d: row %d col %d is %.9g, the sequential reference %.9g", i,
                 1 + i * CONC_RANGE + e / CONC_W, e % CONC_W, got[e], w[i].ref[e]);
  }
  {
    stats_view_t v = get_stats(c, "conc");
    assert_true(v.found);
    assert_int_equal(v.table.pushes, CONC_THREADS * CONC_ITERS);
    assert_int_equal(v.table.rows_pushed, CONC_THREADS * CONC_ITERS * CONC_BATCH);
    assert_int_equal(v.table.steps_applied, CONC_THREADS * CONC_ITERS);
  }
  free(init);
  free(final);
  free(w);
  embps_client_free(c);
}

/* ---- padding, empty batches, stats -------------------------------------------------------- */

static void test_padding_and_empty_batch(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  enum { ROWS = 16, W = 8 };
  const int64_t tok[3] = {1, 2, 3};
  float a[3 * W], b[3 * W], g[3 * W];
  float *before, *after;
  embps_push_result_t res;

  create_table(c, "pad_t", ROWS, W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.5f, 21);
  lookup_ok(c, "pad_t", tok, 3, a, W * 4);
  embps_client_set_padding(c, 1);
  lookup_ok(c, "pad_t", tok, 3, b, W * 4);
  assert_memory_equal(a, b, sizeof(a));

  /* A push with padding on a group of one is the plain push. */
  for (int e = 0; e < 3 * W; e++)
    g[e] = 0.25f;
  push_ok(c, "pad_t", tok, 3, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  assert_int_equal(res.applied, 1);
  assert_int_equal(res.num_unique, 3);
  lookup_ok(c, "pad_t", tok, 3, b, W * 4);
  for (int e = 0; e < 3 * W; e++)
    assert_true(b[e] == sgd_f32(a[e], 0.5f, 0.25f));

  /* Batches of zero tokens, with and without padding, work and change nothing. */
  before = snapshot(c, "pad_t", ROWS, W, EMBPS_DTYPE_F32);
  for (int pad = 1; pad >= 0; pad--) {
    embps_client_set_padding(c, pad);
    assert_int_equal(embps_lookup(c, "pad_t", NULL, 0, NULL, 0), EMBPS_OK);
    memset(&res, 0xff, sizeof(res));
    assert_int_equal(
        embps_push(c, "pad_t", NULL, 0, NULL, 0, EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res), EMBPS_OK);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.num_unique, 0);
    assert_true(res.grad_norm == 0.0);
    assert_int_equal(
        embps_push(c, "pad_t", NULL, 0, NULL, 0, EMBPS_DTYPE_F32, EMBPS_PUSH_ASYNC, &res),
        EMBPS_OK);
  }
  after = snapshot(c, "pad_t", ROWS, W, EMBPS_DTYPE_F32);
  assert_memory_equal(before, after, ROWS * W * 4);
  free(before);
  free(after);
  embps_client_free(c);
}

static void test_stats(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  const int64_t tok[5] = {1, 2, 2, 3, 19};
  float out[5 * 4], g[5 * 4];
  embps_push_result_t res;
  stats_view_t v0, v1;

  create_table(c, "stats_t", 20, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 3);
  assert_int_equal(embps_stats(c, &s, &n), EMBPS_OK);
  assert_int_equal(n, 1);
  assert_int_equal(s[0].rank, 0);
  assert_int_equal(s[0].group_size, 1);
  assert_string_equal(s[0].backend, "cpu");
  assert_true(strlen(s[0].version) > 0);
  assert_string_equal(s[0].address, g_main.address);
  assert_true(s[0].uptime_s > 0.0);
  assert_true(s[0].connections >= 1);
  assert_true(s[0].num_tables >= 1);
  embps_stats_free(s, n);

  v0 = get_stats(c, "stats_t");
  assert_true(v0.found);
  assert_int_equal(v0.table.rows, 20);
  assert_int_equal(v0.table.emb_width, 4);
  assert_int_equal(v0.table.lookups, 0);
  assert_int_equal(v0.table.pushes, 0);
  assert_int_equal(v0.table.bytes, 20 * 4 * 4); /* SGD keeps no optimizer state */

  for (int i = 0; i < 3; i++)
    lookup_ok(c, "stats_t", tok, 4, out, 16);
  for (int e = 0; e < 20; e++)
    g[e] = 0.5f;
  push_ok(c, "stats_t", tok, 5, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  push_ok(c, "stats_t", tok, 5, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_ASYNC, &res);
  g[7] = NAN;
  push_ok(c, "stats_t", tok, 5, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  assert_int_equal(res.skipped, 1);
  {
    const int64_t bad = 20;
    expect_fail(c, embps_lookup(c, "stats_t", &bad, 1, out, 16), EMBPS_INVALID_ARGUMENT,
                "token 20");
  }
  lookup_ok(c, "stats_t", tok, 1, out, 16); /* after the async push, in order */

  v1 = get_stats(c, "stats_t");
  assert_int_equal(v1.table.lookups, 4);
  assert_int_equal(v1.table.rows_looked_up, 13);
  assert_int_equal(v1.table.pushes, 3);
  assert_int_equal(v1.table.rows_pushed, 15);
  assert_int_equal(v1.table.steps_applied, 2);
  assert_int_equal(v1.table.steps_skipped, 1);
  assert_int_equal(v1.table.bytes, v0.table.bytes);
  /* 8 calls between the two GetStats (the second may count itself), one of them failed. */
  assert_in_range(v1.rank.requests - v0.rank.requests, 8, 9);
  assert_int_equal(v1.rank.errors - v0.rank.errors, 1);
  assert_true(v1.rank.bytes_in > v0.rank.bytes_in);
  assert_true(v1.rank.bytes_out > v0.rank.bytes_out);
  assert_true(v1.rank.uptime_s >= v0.rank.uptime_s);
  embps_client_free(c);
}

/* ---- bad input --------------------------------------------------------------------------- */

#define V_ROWS 64
#define V_W 8

/* The victim tables' contents, to prove every rejected call changed nothing. */
static void *g_victim, *g_victim_h;

static void victim_setup(embps_client_t *c) {
  if (!g_victim) {
    create_table(c, "victim", V_ROWS, V_W, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.5f, 31);
    create_table(c, "victim_h", V_ROWS, V_W, EMBPS_DTYPE_BF16, EMBPS_OPTIMIZER_ADAM, 0.5f, 31);
    g_victim = snapshot(c, "victim", V_ROWS, V_W, EMBPS_DTYPE_F32);
    g_victim_h = snapshot(c, "victim_h", V_ROWS, V_W, EMBPS_DTYPE_BF16);
  }
}

#define assert_victims_unchanged(c) victims_unchanged_at(c, __LINE__)

static void victims_unchanged_at(embps_client_t *c, int line) {
  void *now = snapshot(c, "victim", V_ROWS, V_W, EMBPS_DTYPE_F32);
  void *now_h = snapshot(c, "victim_h", V_ROWS, V_W, EMBPS_DTYPE_BF16);
  int same = memcmp(now, g_victim, V_ROWS * V_W * 4) == 0 &&
             memcmp(now_h, g_victim_h, V_ROWS * V_W * 2) == 0;
  free(now);
  free(now_h);
  if (!same)
    fail_msg("line %d: a rejected call changed a table", line);
}

static void test_bad_lookups(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  float out[4 * V_W];
  victim_setup(c);
  {
    const int64_t t[2] = {1, 2};
    expect_fail(c, embps_lookup(c, "no_such_table", t, 2, out, 2 * V_W * 4), EMBPS_NOT_FOUND,
                "table 'no_such_table' not found");
  }
  {
    const int64_t t[3] = {1, -1, 2};
    expect_fail(c, embps_lookup(c, "victim", t, 3, out, 3 * V_W * 4), EMBPS_INVALID_ARGUMENT,
                "token -1 at position 1");
  }
  {
    const int64_t t[3] = {1, 2, V_ROWS};
    expect_fail(c, embps_lookup(c, "victim", t, 3, out, 3 * V_W * 4), EMBPS_INVALID_ARGUMENT,
                "token 64 at position 2 is outside [0, 64)");
  }
  {
    const int64_t t[1] = {INT64_MAX};
    expect_fail(c, embps_lookup(c, "victim_h", t, 1, out, V_W * 2), EMBPS_INVALID_ARGUMENT,
                "outside [0, 64)");
  }
  {
    const int64_t t[1] = {INT64_MIN};
    expect_fail(c, embps_lookup(c, "victim", t, 1, out, V_W * 4), EMBPS_INVALID_ARGUMENT,
                "outside [0, 64)");
  }
  {
    /* A buffer sized for another width: the reply's rows do not fit it. */
    const int64_t t[2] = {1, 2};
    expect_fail(c, embps_lookup(c, "victim", t, 2, out, 2 * (V_W + 1) * 4), EMBPS_INVALID_ARGUMENT,
                "");
    /* Wrong dtype's row size for the bf16 table. */
    expect_fail(c, embps_lookup(c, "victim_h", t, 2, out, 2 * V_W * 4), EMBPS_INVALID_ARGUMENT, "");
  }
  {
    /* Client-side checks: bytes not a whole number of rows, missing buffers or name. */
    const int64_t t[3] = {1, 2, 3};
    expect_fail(c, embps_lookup(c, "victim", t, 3, out, 3 * V_W * 4 - 1), EMBPS_INVALID_ARGUMENT,
                "whole rows");
    expect_fail(c, embps_lookup(c, "victim", t, 3, NULL, 3 * V_W * 4), EMBPS_INVALID_ARGUMENT,
                "NULL");
    expect_fail(c, embps_lookup(c, "", t, 3, out, 3 * V_W * 4), EMBPS_INVALID_ARGUMENT,
                "no table name");
  }
  /* The connection still serves. */
  {
    const int64_t t[2] = {1, 2};
    lookup_ok(c, "victim", t, 2, out, V_W * 4);
    assert_memory_equal(out, (float *)g_victim + V_W, 2 * V_W * 4);
  }
  assert_victims_unchanged(c);
  embps_client_free(c);
}

static void test_bad_pushes(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  float g[4 * (V_W + 1)];
  uint16_t gh[4 * V_W];
  embps_push_result_t res;
  const int64_t ok_tokens[4] = {1, 2, 2, 3};
  victim_setup(c);
  for (size_t e = 0; e < sizeof(g) / sizeof(g[0]); e++)
    g[e] = 0.5f;
  for (size_t e = 0; e < sizeof(gh) / sizeof(gh[0]); e++)
    gh[e] = embps_f32_to_bf16(0.5f);

  for (int m = 0; m < 2; m++) {
    embps_push_mode_t mode = m ? EMBPS_PUSH_ASYNC : EMBPS_PUSH_SYNC;
    expect_fail(
        c,
        embps_push(c, "no_such_table", ok_tokens, 4, g, 4 * V_W * 4, EMBPS_DTYPE_F32, mode, &res),
        EMBPS_NOT_FOUND, "table 'no_such_table' not found");
    {
      const int64_t t[4] = {1, 2, V_ROWS, 3};
      expect_fail(c, embps_push(c, "victim", t, 4, g, 4 * V_W * 4, EMBPS_DTYPE_F32, mode, &res),
                  EMBPS_INVALID_ARGUMENT, "token 64 at position 2 is outside [0, 64)");
    }
    {
      const int64_t t[4] = {-5, 1, 2, 3};
      expect_fail(c, embps_push(c, "victim", t, 4, g, 4 * V_W * 4, EMBPS_DTYPE_F32, mode, &res),
                  EMBPS_INVALID_ARGUMENT, "token -5");
    }
    /* Gradient rows one element too wide: a whole number of f32 values, but not the table's. */
    expect_fail(
        c, embps_push(c, "victim", ok_tokens, 4, g, 4 * (V_W + 1) * 4, EMBPS_DTYPE_F32, mode, &res),
        EMBPS_INVALID_ARGUMENT, "gradients hold 144 bytes");
    /* bf16 gradients for the f32 table, f32 gradients for the bf16 table. */
    expect_fail(
        c, embps_push(c, "victim", ok_tokens, 4, gh, 4 * V_W * 2, EMBPS_DTYPE_BF16, mode, &res),
        EMBPS_INVALID_ARGUMENT, "dtype mismatch");
    expect_fail(
        c, embps_push(c, "victim_h", ok_tokens, 4, g, 4 * V_W * 4, EMBPS_DTYPE_F32, mode, &res),
        EMBPS_INVALID_ARGUMENT, "dtype mismatch");
    /* Client-side checks. */
    expect_fail(c,
                embps_push(c, "victim", ok_tokens, 4, g, 4 * V_W * 4, (embps_dtype_t)7, mode, &res),
                EMBPS_INVALID_ARGUMENT, "neither f32 nor bf16");
    expect_fail(
        c, embps_push(c, "victim", ok_tokens, 4, g, 4 * V_W * 4 - 2, EMBPS_DTYPE_F32, mode, &res),
        EMBPS_INVALID_ARGUMENT, "whole rows");
    assert_victims_unchanged(c);
  }
  expect_fail(c,
              embps_push(c, "victim", ok_tokens, 4, g, 4 * V_W * 4, EMBPS_DTYPE_F32,
                         (embps_push_mode_t)5, &res),
              EMBPS_INVALID_ARGUMENT, "neither sync nor async");
  assert_victims_unchanged(c);
  embps_client_free(c);
}

static void test_non_finite_gradients(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  const int64_t t[3] = {4, 5, 4};
  float g[3 * V_W];
  uint16_t gh[3 * V_W];
  const float bad[3] = {NAN, INFINITY, -INFINITY};
  embps_push_result_t res;
  victim_setup(c);

  for (int b = 0; b < 3; b++) {
    for (int e = 0; e < 3 * V_W; e++)
      g[e] = 0.5f;
    g[V_W + 3] = bad[b]; /* one element of token 5 */
    for (int e = 0; e < 3 * V_W; e++)
      gh[e] = embps_f32_to_bf16(g[e]);
    memset(&res, 0, sizeof(res));
    push_ok(c, "victim", t, 3, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
    assert_int_equal(res.skipped, 1);
    assert_int_equal(res.applied, 0);
    push_ok(c, "victim_h", t, 3, gh, sizeof(gh), EMBPS_DTYPE_BF16, EMBPS_PUSH_SYNC, &res);
    assert_int_equal(res.skipped, 1);
    assert_int_equal(res.applied, 0);
    push_ok(c, "victim", t, 3, g, sizeof(g), EMBPS_DTYPE_F32, EMBPS_PUSH_ASYNC, &res);
    push_ok(c, "victim_h", t, 3, gh, sizeof(gh), EMBPS_DTYPE_BF16, EMBPS_PUSH_ASYNC, &res);
    assert_victims_unchanged(c);
  }
  {
    /* Finite gradients whose f32 sum over a duplicated token overflows are gated too. */
    const int64_t td[3] = {7, 8, 7};
    float gd[3 * V_W];
    for (int e = 0; e < 3 * V_W; e++)
      gd[e] = 3e38f;
    push_ok(c, "victim", td, 3, gd, sizeof(gd), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
    assert_int_equal(res.skipped, 1);
    assert_int_equal(res.applied, 0);
    assert_victims_unchanged(c);
  }
  {
    /* A non-finite gradient on the padding row is ignored with the row: the step applies. */
    const int64_t tp[2] = {0, 6};
    float gp[2 * V_W];
    float row[V_W];
    for (int e = 0; e < 2 * V_W; e++)
      gp[e] = e < V_W ? NAN : 0.5f;
    push_ok(c, "victim", tp, 2, gp, sizeof(gp), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.applied, 1);
    assert_int_equal(res.num_unique, 1);
    lookup_ok(c, "victim", &tp[1], 1, row, sizeof(row));
    for (int j = 0; j < V_W; j++) {
      float *w = (float *)g_victim + 6 * V_W + j;
      assert_true(row[j] == sgd_f32(*w, 0.5f, 0.5f));
      *w = row[j]; /* the new expected contents */
    }
    lookup_ok(c, "victim", &tp[0], 1, row, sizeof(row));
    for (int j = 0; j < V_W; j++)
      assert_true(row[j] == 0.0f);
  }
  assert_victims_unchanged(c);
  embps_client_free(c);
}

static void test_bad_create_table(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  embps_table_spec_t s, *t = NULL;
  size_t n = 0, before;
  victim_setup(c);
  before = count_tables(c);

#define SPEC(nm, r, w)                                                                             \
  do {                                                                                             \
    embps_table_spec_init(&s);                                                                     \
    s.name = (nm);                                                                                 \
    s.rows = (r);                                                                                  \
    s.emb_width = (w);                                                                             \
  } while (0)

  SPEC("bad_width0", 100, 0);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "emb_width=0");
  SPEC("bad_width_huge", 100, 1u << 20);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "emb_width=1048576");
  SPEC("bad_width_max", 100, UINT32_MAX);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "emb_width=4294967295");
  SPEC("bad_rows0", 0, 8);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "rows=0");
  SPEC("bad_rows1", 1, 8);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "rows=1");
  SPEC("bad_rows_huge", UINT64_MAX, 8);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "rows=18446744073709551615");
  /* The largest shape the server allows, far beyond memory: the memory budget refuses it. */
  SPEC("bad_absurd", UINT64_C(1) << 40, 65536);
  s.optimizer = EMBPS_OPTIMIZER_ADAM;
  expect_fail(c, embps_create_table(c, &s), EMBPS_RESOURCE_EXHAUSTED, "--max-memory-bytes");
  /* 2 Mi rows x 16 f32 = 128 MiB > --max-memory-bytes 64 MiB. */
  SPEC("too_big", UINT64_C(1) << 21, 16);
  s.optimizer = EMBPS_OPTIMIZER_SGD;
  expect_fail(c, embps_create_table(c, &s), EMBPS_RESOURCE_EXHAUSTED,
              "more than this rank's memory budget of 67108864 (--max-memory-bytes)");
  /* Optimizer state counts: 1 Mi rows x 16 f32 is 64 MiB of rows alone; Adagrad doubles it. */
  SPEC("too_big_state", UINT64_C(1) << 20, 16);
  s.optimizer = EMBPS_OPTIMIZER_ADAGRAD;
  expect_fail(c, embps_create_table(c, &s), EMBPS_RESOURCE_EXHAUSTED, "--max-memory-bytes");
  SPEC("bad name!", 10, 8);
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "may hold only letters");
  SPEC("bad_lr", 10, 8);
  s.lr = -1.0f;
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "finite and non-negative");
  SPEC("bad_lr_nan", 10, 8);
  s.lr = NAN;
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "finite and non-negative");
  SPEC("bad_beta", 10, 8);
  s.optimizer = EMBPS_OPTIMIZER_ADAM;
  s.beta1 = 1.5f;
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "adam betas");
  SPEC("bad_dtype", 10, 8);
  s.dtype = (embps_dtype_t)9;
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "dtype 9");
  SPEC("bad_opt", 10, 8);
  s.optimizer = (embps_optimizer_t)9;
  expect_fail(c, embps_create_table(c, &s), EMBPS_INVALID_ARGUMENT, "optimizer 9");
  /* A name taken: ALREADY_EXISTS, and the existing table keeps its shape and rows. */
  SPEC("victim", 1000, 4);
  expect_fail(c, embps_create_table(c, &s), EMBPS_ALREADY_EXISTS, "table 'victim' already exists");
#undef SPEC

  assert_int_equal(embps_list_tables(c, &t, &n), EMBPS_OK);
  assert_int_equal(n, before);
  {
    const embps_table_spec_t *v = find_spec(t, n, "victim");
    assert_non_null(v);
    assert_int_equal(v->rows, V_ROWS);
    assert_int_equal(v->emb_width, V_W);
    assert_int_equal(v->optimizer, EMBPS_OPTIMIZER_SGD);
    assert_null(find_spec(t, n, "too_big"));
    assert_null(find_spec(t, n, "bad_absurd"));
  }
  embps_tables_free(t, n);
  assert_victims_unchanged(c);
  embps_client_free(c);
}

static void test_oversized_messages(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  /* 140 000 tokens are 1.12 MB of request: over --max-message-bytes (1 MiB). */
  const size_t big = 140000;
  int64_t *tok = malloc(big * sizeof(*tok));
  float *buf = malloc(big * V_W * sizeof(float));
  embps_push_result_t res;
  assert_non_null(tok);
  assert_non_null(buf);
  victim_setup(c);
  for (size_t i = 0; i < big; i++) {
    tok[i] = (int64_t)(1 + i % (V_ROWS - 1));
  }
  for (size_t e = 0; e < big * V_W; e++)
    buf[e] = 0.5f;

  expect_fail(c, embps_lookup(c, "victim", tok, big, buf, big * V_W * 4), EMBPS_RESOURCE_EXHAUSTED,
              "larger than max");
  /* The same connection goes on working. */
  {
    float row[V_W];
    lookup_ok(c, "victim", tok, 1, row, sizeof(row));
    assert_memory_equal(row, (float *)g_victim + V_W, sizeof(row));
  }
  /* A push of 30 000 tokens: 240 KB of tokens and 960 KB of gradients. */
  for (size_t e = 0; e < big * V_W; e++)
    buf[e] = 0.5f;
  expect_fail(c,
              embps_push(c, "victim", tok, 30000, buf, 30000 * V_W * 4, EMBPS_DTYPE_F32,
                         EMBPS_PUSH_SYNC, &res),
              EMBPS_RESOURCE_EXHAUSTED, "larger than max");
  expect_fail(c,
              embps_push(c, "victim", tok, 30000, buf, 30000 * V_W * 4, EMBPS_DTYPE_F32,
                         EMBPS_PUSH_ASYNC, &res),
              EMBPS_RESOURCE_EXHAUSTED, "larger than max");
  /* Twice in a row, then interleaved with good calls (pipelined). */
  {
    embps_call_t *c1 = NULL, *c2 = NULL, *c3 = NULL;
    float row[2 * V_W];
    assert_int_equal(embps_lookup_start(c, "victim", tok, 2, row, sizeof(row), &c1), EMBPS_OK);
    assert_int_equal(embps_lookup_start(c, "victim", tok, big, buf, big * V_W * 4, &c2), EMBPS_OK);
    assert_int_equal(embps_lookup_start(c, "victim", tok, 2, row, sizeof(row), &c3), EMBPS_OK);
    assert_int_equal(embps_call_wait(c1), EMBPS_OK);
    assert_int_equal(embps_call_wait(c2), EMBPS_RESOURCE_EXHAUSTED);
    assert_int_equal(embps_call_wait(c3), EMBPS_OK);
    assert_memory_equal(row, (float *)g_victim + V_W, sizeof(row));
  }
  /* A new connection works too. */
  {
    embps_client_t *d = connect_to(g_main.address);
    int serving = 0;
    assert_int_equal(embps_health(d, "", &serving), EMBPS_OK);
    assert_int_equal(serving, 1);
    embps_client_free(d);
  }
  /* --max-message-bytes bounds the reply too: 40 000 tokens are a 320 KB request but 1.28 MB of
   * rows, refused before any work; 32 000 make 1 024 000 bytes of rows, just under, and pass. */
  expect_fail(c, embps_lookup(c, "victim", tok, 40000, buf, 40000 * V_W * 4),
              EMBPS_RESOURCE_EXHAUSTED, "more than --max-message-bytes=1048576");
  lookup_ok(c, "victim", tok, 32000, buf, V_W * 4);
  assert_memory_equal(buf, (float *)g_victim + V_W, V_W * 4);
  assert_victims_unchanged(c);
  free(tok);
  free(buf);
  embps_client_free(c);
}

/* This server has no --checkpoint-dir: a checkpoint is refused with the remedy, and so is the
 * listing. */
static void test_checkpoint_without_dir(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  embps_checkpoint_info_t info, *list = NULL;
  size_t n = 7;
  victim_setup(c);
  expect_fail(c, embps_checkpoint(c, "victim", &info), EMBPS_FAILED_PRECONDITION,
              "--checkpoint-dir");
  expect_fail(c, embps_checkpoint(c, NULL, NULL), EMBPS_FAILED_PRECONDITION, "--checkpoint-dir");
  expect_fail(c, embps_list_checkpoints(c, &list, &n), EMBPS_FAILED_PRECONDITION,
              "--checkpoint-dir");
  assert_null(list);
  assert_int_equal(n, 0);
  assert_victims_unchanged(c);
  embps_client_free(c);
}

/* After everything above, the server still serves: health, lookups, new connections. */
static void test_still_serving(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  int serving = 0;
  float row[V_W];
  const int64_t t = 9;
  victim_setup(c);
  assert_int_equal(embps_health(c, "", &serving), EMBPS_OK);
  assert_int_equal(serving, 1);
  lookup_ok(c, "victim", &t, 1, row, sizeof(row));
  assert_memory_equal(row, (float *)g_victim + 9 * V_W, sizeof(row));
  assert_victims_unchanged(c);
  assert_true(server_proc_alive(&g_main));
  embps_client_free(c);
}

/* ---- out of memory in the client --------------------------------------------------------- */

enum oom_call { OOM_CONNECT, OOM_LOOKUP, OOM_PUSH, OOM_LIST, OOM_STATS, OOM_HEALTH, OOM_CALLS };
static const char *const oom_call_names[] = {"connect",     "lookup", "push",
                                             "list tables", "stats",  "health"};

static embps_status_t oom_call(embps_client_t *c, enum oom_call which) {
  const int64_t tok[4] = {0, 1, 2, 1};
  float rows[4 * 8] = {0};
  embps_push_result_t res;
  embps_table_spec_t *tables = NULL;
  embps_rank_stats_t *stats = NULL;
  size_t n = 0;
  int serving = 0;
  embps_status_t st = EMBPS_OK;
  switch (which) {
  case OOM_CONNECT: {
    embps_client_t *other = NULL;
    embps_client_options_t o;
    embps_error_t err;
    embps_client_options_init(&o);
    o.deadline_ms = DEADLINE_MS;
    st = embps_client_connect(&other, g_main.address, &o, &err);
    if (st != EMBPS_OK && st != EMBPS_RESOURCE_EXHAUSTED)
      print_error("connect: %s\n", err.message);
    embps_alloc_fail_after(0);
    embps_client_free(other);
    return st;
  }
  case OOM_LOOKUP:
    st = embps_lookup(c, "oom_t", tok, 4, rows, sizeof rows);
    break;
  case OOM_PUSH:
    st = embps_push(c, "oom_t", tok, 4, rows, sizeof rows, EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
    break;
  case OOM_LIST:
    st = embps_list_tables(c, &tables, &n);
    break;
  case OOM_STATS:
    st = embps_stats(c, &stats, &n);
    break;
  default:
    st = embps_health(c, "", &serving);
    break;
  }
  embps_alloc_fail_after(0);
  if (st != EMBPS_OK && st != EMBPS_RESOURCE_EXHAUSTED)
    print_error("%s: %s\n", oom_call_names[which], embps_client_last_error(c));
  if (st == EMBPS_OK && tables)
    embps_tables_free(tables, n);
  if (st == EMBPS_OK && stats)
    embps_stats_free(stats, n);
  return st;
}

/* Every allocation the client makes in a call fails in turn (with every one after it): the call
 * fails with RESOURCE_EXHAUSTED, whatever it was doing (sending, reading the reply, decoding it),
 * never with another status, and the client's next call works. */
static void test_client_out_of_memory(void **state) {
  (void)state;
  embps_client_t *c = connect_to(g_main.address);
  create_table(c, "oom_t", 4, 8, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.0f, 1);
  for (int which = 0; which < OOM_CALLS; which++) {
    int refused = 0;
    embps_status_t st = EMBPS_RESOURCE_EXHAUSTED;
    for (long k = 1; k < 1000 && st != EMBPS_OK; k++) {
      embps_alloc_fail_after(k);
      st = oom_call(c, (enum oom_call)which);
      if (st != EMBPS_OK && st != EMBPS_RESOURCE_EXHAUSTED)
        fail_msg("%s with allocation %ld failing: %s", oom_call_names[which], k,
                 embps_status_string(st));
      refused += st != EMBPS_OK;
    }
    assert_int_equal(st, EMBPS_OK);
    assert_true(refused > 0);
  }
  embps_client_free(c);
}

static void test_main_server_exits_cleanly(void **state) {
  (void)state;
  free(g_victim);
  free(g_victim_h);
  g_victim = g_victim_h = NULL;
  assert_int_equal(server_proc_stop(&g_main, STOP_TIMEOUT_MS), 0);
}

/* ---- raw connections: garbage, stalls ---------------------------------------------------- */

static int raw_connect(int port) {
  struct sockaddr_in a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  assert_true(fd >= 0);
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static void raw_send(int fd, const void *p, size_t n) {
  assert_int_equal(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* Reads (and drops) what the server sends until it closes the connection, serving the client
 * with a lookup every ~50 ms meanwhile. Returns the ms until the close, or -1 after
 * timeout_ms. */
static double wait_closed_while_serving(int fd, int timeout_ms, embps_client_t *c) {
  const int64_t tok[2] = {1, 2};
  float want[2 * 4], row[2 * 4];
  lookup_ok(c, "stall_t", tok, 2, want, 16);
  double t0 = server_proc_now_ms(), deadline = t0 + timeout_ms;
  while (server_proc_now_ms() < deadline) {
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, 50);
    if (r > 0) {
      char buf[4096];
      ssize_t got = recv(fd, buf, sizeof(buf), 0);
      if (got <= 0)
        return server_proc_now_ms() - t0;
    }
    lookup_ok(c, "stall_t", tok, 2, row, 16);
    assert_memory_equal(row, want, sizeof(row));
  }
  return -1;
}

/* Appends an HTTP/2 frame header. */
static size_t frame_header(uint8_t *p, size_t len, uint8_t type, uint8_t flags, uint32_t stream) {
  p[0] = (uint8_t)(len >> 16);
  p[1] = (uint8_t)(len >> 8);
  p[2] = (uint8_t)len;
  p[3] = type;
  p[4] = flags;
  p[5] = (uint8_t)(stream >> 24);
  p[6] = (uint8_t)(stream >> 16);
  p[7] = (uint8_t)(stream >> 8);
  p[8] = (uint8_t)stream;
  return 9;
}

/* An HPACK "literal header field without indexing, new name", no Huffman coding. */
static size_t hpack_literal(uint8_t *p, const char *name, const char *value) {
  size_t n = 0, nl = strlen(name), vl = strlen(value);
  p[n++] = 0x00;
  p[n++] = (uint8_t)nl;
  memcpy(p + n, name, nl);
  n += nl;
  p[n++] = (uint8_t)vl;
  memcpy(p + n, value, vl);
  return n + vl;
}

static const char k_preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

static void test_garbage_and_stalled_connections(void **state) {
  (void)state;
  static const char *const flags[] = {"--stall-timeout-ms", "300", NULL};
  embps_client_t *c;
  double ms;
  int fd;

  assert_int_equal(server_proc_start(&g_extra, flags), 0);
  c = connect_to(g_extra.address);
  create_table(c, "stall_t", 8, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 1);

  /* Garbage instead of the HTTP/2 preface: closed at once. */
  fd = raw_connect(g_extra.port);
  {
    static const char junk[] = "GET / HTTP/1.1\r\nHost: embps\r\n\r\n\x01\x02\x03garbage";
    raw_send(fd, junk, sizeof(junk) - 1);
  }
  ms = wait_closed_while_serving(fd, 5000, c);
  close(fd);
  assert_true(ms >= 0.0);
  assert_true(ms < 250.0); /* a protocol error, not the stall timer */

  /* A valid preface and SETTINGS, then a frame of random bytes. */
  fd = raw_connect(g_extra.port);
  {
    uint8_t b[64];
    size_t n = 0;
    memcpy(b, k_preface, 24);
    n = 24;
    n += frame_header(b + n, 0, 0x4, 0, 0);
    for (int i = 0; i < 20; i++)
      b[n++] = (uint8_t)(0xa5 ^ (i * 37));
    raw_send(fd, b, n);
  }
  ms = wait_closed_while_serving(fd, 5000, c);
  close(fd);
  assert_true(ms >= 0.0);

  /* The preface only, then silence: the stall timer closes it after ~300 ms. */
  fd = raw_connect(g_extra.port);
  raw_send(fd, k_preface, 24);
  ms = wait_closed_while_serving(fd, 5000, c);
  close(fd);
  if (!(ms >= 200.0 && ms < 3000.0))
    fail_msg("preface-only connection closed after %.0f ms (want ~300; -1: never)", ms);

  /* Connected and silent: the preface is overdue, same timer. */
  fd = raw_connect(g_extra.port);
  ms = wait_closed_while_serving(fd, 5000, c);
  close(fd);
  if (!(ms >= 200.0 && ms < 3000.0))
    fail_msg("silent connection closed after %.0f ms (want ~300; -1: never)", ms);

  /* A request stalled halfway: HEADERS, then a DATA frame with 10 of its 100 message bytes. */
  fd = raw_connect(g_extra.port);
  {
    uint8_t b[512], hb[256];
    size_t n = 0, hn = 0;
    hn += hpack_literal(hb + hn, ":method", "POST");
    hn += hpack_literal(hb + hn, ":scheme", "http");
    hn += hpack_literal(hb + hn, ":path", "/embps.v1.EmbeddingService/Lookup");
    hn += hpack_literal(hb + hn, ":authority", "embps");
    hn += hpack_literal(hb + hn, "content-type", "application/grpc");
    hn += hpack_literal(hb + hn, "te", "trailers");
    memcpy(b, k_preface, 24);
    n = 24;
    n += frame_header(b + n, 0, 0x4, 0, 0);    /* SETTINGS */
    n += frame_header(b + n, hn, 0x1, 0x4, 1); /* HEADERS, END_HEADERS */
    memcpy(b + n, hb, hn);
    n += hn;
    n += frame_header(b + n, 15, 0x0, 0, 1); /* DATA, no END_STREAM */
    memcpy(b + n, "\x00\x00\x00\x00\x64", 5);
    memset(b + n + 5, 0, 10);
    n += 15;
    raw_send(fd, b, n);
  }
  ms = wait_closed_while_serving(fd, 5000, c);
  close(fd);
  if (!(ms >= 200.0 && ms < 3000.0))
    fail_msg("stalled request closed after %.0f ms (want ~300; -1: never)", ms);

  /* The client's own connection, idle between calls, was never closed; the server counts only
   * it once the raw sockets are gone. */
  {
    uint32_t conns = 0;
    for (int i = 0; i < 100; i++) {
      stats_view_t v = get_stats(c, NULL);
      conns = v.rank.connections;
      if (conns == 1)
        break;
      server_proc_sleep_ms(20);
    }
    assert_int_equal(conns, 1);
    int serving = 0;
    server_proc_sleep_ms(500); /* longer than the stall timeout */
    assert_int_equal(embps_health(c, "", &serving), EMBPS_OK);
    assert_int_equal(serving, 1);
  }
  embps_client_free(c);
  assert_int_equal(server_proc_stop(&g_extra, STOP_TIMEOUT_MS), 0);
}

/* The memory budget bounds what tables take, so how many: 10 rows x 4 f32 (SGD) are 160 bytes,
 * and a budget of 400 holds two such tables, not three. */
static void test_memory_budget_bounds_tables(void **state) {
  (void)state;
  static const char *const flags[] = {"--max-memory-bytes", "400", NULL};
  embps_client_t *c;
  embps_table_spec_t s;

  assert_int_equal(server_proc_start(&g_extra, flags), 0);
  c = connect_to(g_extra.address);
  create_table(c, "t1", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 1);
  create_table(c, "t2", 10, 4, EMBPS_DTYPE_F32, EMBPS_OPTIMIZER_SGD, 0.1f, 1);
  embps_table_spec_init(&s);
  s.name = "t3";
  s.rows = 10;
  s.emb_width = 4;
  expect_fail(c, embps_create_table(c, &s), EMBPS_RESOURCE_EXHAUSTED,
              "rank 0 already holds 320 bytes of tables under its budget of 400 "
              "(--max-memory-bytes)");
  assert_int_equal(count_tables(c), 2);
  embps_client_free(c);
  assert_int_equal(server_proc_stop(&g_extra, STOP_TIMEOUT_MS), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_health),
      cmocka_unit_test(test_create_and_list_tables),
      cmocka_unit_test(test_drop_table),
      cmocka_unit_test(test_every_optimizer_updates),
      cmocka_unit_test(test_lookup_rows),
      cmocka_unit_test(test_sgd_sync_push_exact),
      cmocka_unit_test(test_async_push_ordering),
      cmocka_unit_test(test_pipelining),
      cmocka_unit_test(test_concurrent_clients),
      cmocka_unit_test(test_padding_and_empty_batch),
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_bad_lookups),
      cmocka_unit_test(test_bad_pushes),
      cmocka_unit_test(test_non_finite_gradients),
      cmocka_unit_test(test_bad_create_table),
      cmocka_unit_test(test_oversized_messages),
      cmocka_unit_test(test_checkpoint_without_dir),
      cmocka_unit_test(test_still_serving),
      cmocka_unit_test(test_client_out_of_memory),
      cmocka_unit_test(test_main_server_exits_cleanly),
      cmocka_unit_test(test_garbage_and_stalled_connections),
      cmocka_unit_test(test_memory_budget_bounds_tables),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
