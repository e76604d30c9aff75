/* The C client library against a real 2-rank shard group.
 *
 * The group setup starts two embps-server ranks on free loopback ports (group_proc.c: posix
 * spawn, logs in temporary files, bounded waits for "listening on" and for health SERVING
 * through libembps, retried with new ports when a start fails) and connects one client with
 * "A,B". The tests then use the public C API only:
 *   - the group size the client learned;
 *   - table creation, and the exact error-table message for an emb_width that does not shard;
 *   - a batch that does not shard: refused by the client before anything is sent (the servers'
 *     request counters do not move), then padded by the library, whose rows and SGD updates
 *     are checked bit for bit (f32 math done here) and whose padding row 0 stays zero;
 *   - 16 interleaved lookups and pushes in flight at once, replayed one call at a time on a
 *     twin table with the same seed: every result identical bit for bit;
 *   - assigns (rows read back bitwise, ordered between pipelined pushes, refusals);
 *   - the group's statistics (two ready ranks, mesh "shard=2", collective traffic).
 * The last test stops both ranks with SIGTERM and requires exit status 0 from each (under
 * AddressSanitizer a leak makes it non-zero). Every wait is bounded: a 30 s client deadline,
 * 60 s to start the group, 20 s to stop it. */
#define _DEFAULT_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client/embps.h"
#include "group_proc.h"

#define RANKS 2
#define DEADLINE_MS 30000
#define READY_TIMEOUT_MS 60000
#define STOP_TIMEOUT_MS 20000
#define WIDTH 8
#define ROWS 64

static group_proc_t g_group;
static embps_client_t *g_client;

/* ---- helpers ----------------------------------------------------------------------------- */

static uint64_t g_rng = 0x243f6a8885a308d3ull;

static uint32_t rnd(void) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33);
}

/* A float in [-1, 1) with few significant bits. */
static float rnd_grad(void) { return (float)((int)(rnd() % 2048) - 1024) / 1024.0f; }

/* w - lr * g in f32; two statements so that no compiler contracts it into an FMA. */
static float sgd_f32(float w, float lr, float g) {
  volatile float step = lr * g;
  return w - step;
}

static void create_table(embps_client_t *c, const char *name, uint32_t width, embps_optimizer_t opt,
                         float lr, uint64_t seed) {
  embps_table_spec_t s;
  embps_table_spec_init(&s);
  s.name = name;
  s.rows = ROWS;
  s.emb_width = width;
  s.dtype = EMBPS_DTYPE_F32;
  s.optimizer = opt;
  s.lr = lr;
  s.seed = seed;
  embps_status_t st = embps_create_table(c, &s);
  if (st != EMBPS_OK)
    fail_msg("create %s: %s: %s", name, embps_status_string(st), embps_client_last_error(c));
}

static void lookup_ok(embps_client_t *c, const char *table, const int64_t *tokens, size_t n,
                      float *out) {
  embps_status_t st = embps_lookup(c, table, tokens, n, out, n * WIDTH * sizeof(float));
  if (st != EMBPS_OK)
    fail_msg("lookup %s (%zu tokens): %s: %s", table, n, embps_status_string(st),
             embps_client_last_error(c));
}

/* Rows 0..ROWS-1 of a table into out (ROWS * WIDTH floats). */
static void snapshot(embps_client_t *c, const char *table, float *out) {
  int64_t tok[ROWS];
  for (int i = 0; i < ROWS; i++)
    tok[i] = i;
  lookup_ok(c, table, tok, ROWS, out);
}

/* Each rank's request counter and the lookups and pushes of table on it. */
typedef struct counters {
  uint64_t requests[RANKS];
  uint64_t lookups[RANKS];
  uint64_t pushes[RANKS];
} counters_t;

static counters_t get_counters(embps_client_t *c, const char *table) {
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  counters_t k;
  memset(&k, 0, sizeof(k));
  embps_status_t st = embps_stats(c, &s, &n);
  if (st != EMBPS_OK)
    fail_msg("stats: %s: %s", embps_status_string(st), embps_client_last_error(c));
  assert_int_equal(n, RANKS);
  for (size_t r = 0; r < n; r++) {
    int found = 0;
    k.requests[r] = s[r].requests;
    for (size_t i = 0; i < s[r].num_tables; i++)
      if (strcmp(s[r].tables[i].name, table) == 0) {
        k.lookups[r] = s[r].tables[i].lookups;
        k.pushes[r] = s[r].tables[i].pushes;
        found = 1;
      }
    if (!found)
      fail_msg("rank %zu's stats have no table %s", r, table);
  }
  embps_stats_free(s, n);
  return k;
}

/* ---- setup ------------------------------------------------------------------------------- */

static int group_setup(void **state) {
  (void)state;
  embps_client_options_t o;
  embps_error_t err;
  if (group_proc_start(&g_group, RANKS, NULL, 3, READY_TIMEOUT_MS) != 0)
    return -1;
  embps_client_options_init(&o);
  o.deadline_ms = DEADLINE_MS;
  o.connect_timeout_ms = 10000;
  embps_error_clear(&err);
  /* group_size 0: the client learns it from the servers and checks the address count. */
  if (embps_client_connect(&g_client, g_group.servers, &o, &err) != EMBPS_OK) {
    fprintf(stderr, "connect to %s: %s: %s\n", g_group.servers, embps_status_string(err.status),
            err.message);
    group_proc_stop(&g_group, STOP_TIMEOUT_MS, NULL);
    return -1;
  }
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  embps_client_free(g_client);
  g_client = NULL;
  group_proc_stop(&g_group, STOP_TIMEOUT_MS, NULL); /* a no-op after test_clean_exit */
  return 0;
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_group_size(void **state) {
  (void)state;
  assert_int_equal(embps_client_group_size(g_client), RANKS);
}

static void test_create_table_and_width_check(void **state) {
  (void)state;
  embps_client_t *c = g_client;
  embps_table_spec_t s, *list = NULL;
  size_t n = 0;
  int found8 = 0;

  create_table(c, "width8", WIDTH, EMBPS_OPTIMIZER_SGD, 0.5f, 3);

  embps_table_spec_init(&s);
  s.name = "width5";
  s.rows = ROWS;
  s.emb_width = 5;
  s.optimizer = EMBPS_OPTIMIZER_SGD;
  s.lr = 0.5f;
  embps_status_t st = embps_create_table(c, &s);
  const char *msg = embps_client_last_error(c);
  if (st != EMBPS_INVALID_ARGUMENT || embps_client_last_status(c) != EMBPS_INVALID_ARGUMENT ||
      !strstr(msg, "emb_width=5 does not shard evenly over the 2-rank communicator"))
    fail_msg("create width 5: expected INVALID_ARGUMENT with the error-table message, got %s: "
             "\"%s\"",
             embps_status_string(st), msg);

  assert_int_equal(embps_list_tables(c, &list, &n), EMBPS_OK);
  for (size_t i = 0; i < n; i++) {
    if (strcmp(list[i].name, "width5") == 0)
      fail_msg("the rejected width-5 table exists");
    if (strcmp(list[i].name, "width8") == 0) {
      found8 = 1;
      assert_int_equal(list[i].emb_width, WIDTH);
      assert_int_equal(list[i].rows, ROWS);
      assert_int_equal(list[i].optimizer, EMBPS_OPTIMIZER_SGD);
      assert_true(list[i].lr == 0.5f);
    }
  }
  embps_tables_free(list, n);
  assert_true(found8);
}

static void test_uneven_batch_and_padding(void **state) {
  (void)state;
  embps_client_t *c = g_client;
  const char *t = "pad";
  const float lr = 0.5f;
  const int64_t tok3[3] = {5, 17, 42};
  const int64_t tok4[4] = {5, 17, 42, 9}; /* the same first 3 tokens, an even count */
  const int64_t tok_check[6] = {0, 5, 17, 42, 9, 1};
  float rows4[4 * WIDTH], rows3[4 * WIDTH], before[6 * WIDTH], after[6 * WIDTH];
  float grads[3 * WIDTH];
  embps_push_result_t res;
  counters_t k0, k1, k2;

  create_table(c, t, WIDTH, EMBPS_OPTIMIZER_SGD, lr, 21);
  embps_client_set_padding(c, 0);

  /* Refused before sending: the request counters move only by the GetStats calls
   * themselves (one per rank each), exactly as between two GetStats with nothing between. */
  k0 = get_counters(c, t);
  k1 = get_counters(c, t);
  embps_status_t st = embps_lookup(c, t, tok3, 3, rows3, sizeof(float) * 3 * WIDTH);
  const char *msg = embps_client_last_error(c);
  if (st != EMBPS_INVALID_ARGUMENT || embps_client_last_status(c) != EMBPS_INVALID_ARGUMENT ||
      !strstr(msg, "tokens_per_batch=3 does not shard evenly over the 2-rank communicator"))
    fail_msg("3-token lookup: expected INVALID_ARGUMENT with the error-table message, got %s: "
             "\"%s\"",
             embps_status_string(st), msg);
  st = embps_push(c, t, tok3, 3, grads, sizeof(grads), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  if (st != EMBPS_INVALID_ARGUMENT ||
      !strstr(embps_client_last_error(c),
              "tokens_per_batch=3 does not shard evenly over the 2-rank communicator"))
    fail_msg("3-token push: expected INVALID_ARGUMENT, got %s: \"%s\"", embps_status_string(st),
             embps_client_last_error(c));
  k2 = get_counters(c, t);
  for (int r = 0; r < RANKS; r++) {
    if (k2.requests[r] - k1.requests[r] != k1.requests[r] - k0.requests[r])
      fail_msg("rank %d received requests for the refused batches (%llu then %llu per stats "
               "interval)",
               r, (unsigned long long)(k1.requests[r] - k0.requests[r]),
               (unsigned long long)(k2.requests[r] - k1.requests[r]));
    assert_int_equal(k2.lookups[r], k0.lookups[r]);
    assert_int_equal(k2.pushes[r], k0.pushes[r]);
  }

  /* The 4-token lookup without padding, then the padded 3-token lookup into a buffer whose 4th
   * row is a sentinel that must stay untouched (the padding row is dropped). */
  lookup_ok(c, t, tok4, 4, rows4);
  embps_client_set_padding(c, 1);
  memset(rows3, 0xA5, sizeof(rows3));
  lookup_ok(c, t, tok3, 3, rows3);
  assert_memory_equal(rows3, rows4, sizeof(float) * 3 * WIDTH);
  {
    unsigned char sentinel[WIDTH * sizeof(float)];
    memset(sentinel, 0xA5, sizeof(sentinel));
    assert_memory_equal(rows3 + 3 * WIDTH, sentinel, sizeof(sentinel));
  }
  /* Rows are not all zero (so the equality above means something), and not all equal. */
  {
    int nonzero = 0;
    for (int i = 0; i < 3 * WIDTH; i++)
      nonzero += rows3[i] != 0.0f;
    assert_true(nonzero > 2 * WIDTH);
    assert_true(memcmp(rows3, rows3 + WIDTH, WIDTH * sizeof(float)) != 0);
  }

  /* A padded push of 3 tokens: exactly w - lr * g on those rows, nothing else moves, and the
   * padding row 0 stays zero. */
  embps_client_set_padding(c, 0);
  lookup_ok(c, t, tok_check, 6, before);
  for (int j = 0; j < WIDTH; j++)
    assert_true(before[j] == 0.0f && !signbit(before[j]));
  for (int i = 0; i < 3 * WIDTH; i++)
    grads[i] = rnd_grad();
  grads[0] = 0.75f; /* at least one non-zero gradient per row is certain below */
  grads[WIDTH] = -0.5f;
  grads[2 * WIDTH] = 0.25f;
  embps_client_set_padding(c, 1);
  memset(&res, 0, sizeof(res));
  st = embps_push(c, t, tok3, 3, grads, sizeof(grads), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  if (st != EMBPS_OK)
    fail_msg("padded push: %s: %s", embps_status_string(st), embps_client_last_error(c));
  assert_int_equal(res.applied, 1);
  assert_int_equal(res.skipped, 0);
  assert_int_equal(res.num_unique, 3); /* the padding token is not a unique token */
  {
    double ss = 0;
    for (int i = 0; i < 3 * WIDTH; i++)
      ss += (double)grads[i] * grads[i];
    if (fabs(res.grad_norm - sqrt(ss)) > 1e-5 * sqrt(ss))
      fail_msg("grad_norm %.9g, expected %.9g", res.grad_norm, sqrt(ss));
  }
  embps_client_set_padding(c, 0);
  lookup_ok(c, t, tok_check, 6, after);
  for (int j = 0; j < WIDTH; j++)
    if (after[j] != 0.0f || signbit(after[j]))
      fail_msg("padding row 0 changed: column %d is %.9g", j, after[j]);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < WIDTH; j++) {
      float want = sgd_f32(before[(1 + i) * WIDTH + j], lr, grads[i * WIDTH + j]);
      float got = after[(1 + i) * WIDTH + j];
      if (memcmp(&want, &got, sizeof(float)) != 0)
        fail_msg("token %lld column %d: %.9g, expected %.9g (w %.9g, g %.9g)", (long long)tok3[i],
                 j, got, want, before[(1 + i) * WIDTH + j], grads[i * WIDTH + j]);
    }
  assert_memory_equal(after + 4 * WIDTH, before + 4 * WIDTH, sizeof(float) * 2 * WIDTH);
  assert_true(memcmp(after + WIDTH, before + WIDTH, sizeof(float) * 3 * WIDTH) != 0);
}

/* ---- pipelining -------------------------------------------------------------------------- */

#define PIPE_CALLS 16
#define PIPE_MAX_TOKENS 12

typedef struct pipe_op {
  int is_push;
  embps_push_mode_t mode;
  size_t n;
  int64_t tokens[PIPE_MAX_TOKENS];
  float grads[PIPE_MAX_TOKENS * WIDTH];
  float out[PIPE_MAX_TOKENS * WIDTH];
  embps_push_result_t res;
} pipe_op_t;

static void run_pipeline(const char *table, embps_optimizer_t opt, float lr) {
  embps_client_t *c = g_client;
  char twin[64];
  static pipe_op_t ops[PIPE_CALLS], seq[PIPE_CALLS];
  embps_call_t *calls[PIPE_CALLS];
  float snap_a[ROWS * WIDTH], snap_b[ROWS * WIDTH], initial[ROWS * WIDTH];

  snprintf(twin, sizeof(twin), "%s_twin", table);
  create_table(c, table, WIDTH, opt, lr, 77);
  create_table(c, twin, WIDTH, opt, lr, 77);
  embps_client_set_padding(c, 0);
  snapshot(c, table, initial);
  snapshot(c, twin, snap_b);
  assert_memory_equal(initial, snap_b, sizeof(initial)); /* twins start equal */

  /* Interleaved lookups and pushes on few tokens (1..7), so nearly every lookup reads rows the
   * pushes before it changed: a reordering shows in the results. Even batch sizes 2..12. */
  memset(ops, 0, sizeof(ops));
  for (int i = 0; i < PIPE_CALLS; i++) {
    pipe_op_t *o = &ops[i];
    o->is_push = i % 2 == 1;
    o->mode = EMBPS_PUSH_SYNC;
    o->n = 2 * (1 + rnd() % (PIPE_MAX_TOKENS / 2));
    for (size_t k = 0; k < o->n; k++)
      o->tokens[k] = 1 + (int64_t)(rnd() % 7);
    for (size_t k = 0; k < o->n * WIDTH; k++)
      o->grads[k] = rnd_grad();
    memset(o->out, 0xA5, sizeof(o->out));
  }
  memcpy(seq, ops, sizeof(ops));

  for (int i = 0; i < PIPE_CALLS; i++) {
    pipe_op_t *o = &ops[i];
    embps_status_t st = o->is_push ? embps_push_start(c, table, o->tokens, o->n, o->grads,
                                                      o->n * WIDTH * sizeof(float), EMBPS_DTYPE_F32,
                                                      o->mode, &o->res, &calls[i])
                                   : embps_lookup_start(c, table, o->tokens, o->n, o->out,
                                                        o->n * WIDTH * sizeof(float), &calls[i]);
    if (st != EMBPS_OK)
      fail_msg("start call %d: %s: %s", i, embps_status_string(st), embps_client_last_error(c));
  }
  for (int i = 0; i < PIPE_CALLS; i++) {
    embps_status_t st = embps_call_wait(calls[i]);
    if (st != EMBPS_OK)
      fail_msg("pipelined call %d: %s: %s", i, embps_status_string(st), embps_client_last_error(c));
  }

  /* The same sequence, one call at a time, on the twin. */
  for (int i = 0; i < PIPE_CALLS; i++) {
    pipe_op_t *o = &seq[i];
    if (o->is_push) {
      embps_status_t st =
          embps_push(c, twin, o->tokens, o->n, o->grads, o->n * WIDTH * sizeof(float),
                     EMBPS_DTYPE_F32, o->mode, &o->res);
      if (st != EMBPS_OK)
        fail_msg("twin push %d: %s: %s", i, embps_status_string(st), embps_client_last_error(c));
    } else {
      lookup_ok(c, twin, o->tokens, o->n, o->out);
    }
  }

  for (int i = 0; i < PIPE_CALLS; i++) {
    if (ops[i].is_push) {
      assert_int_equal(ops[i].res.applied, 1);
      assert_int_equal(ops[i].res.skipped, 0);
      assert_int_equal(ops[i].res.num_unique, seq[i].res.num_unique);
      if (memcmp(&ops[i].res.grad_norm, &seq[i].res.grad_norm, sizeof(double)) != 0)
        fail_msg("push %d: grad_norm %.17g pipelined, %.17g one at a time", i, ops[i].res.grad_norm,
                 seq[i].res.grad_norm);
    } else if (memcmp(ops[i].out, seq[i].out, sizeof(ops[i].out)) != 0) {
      fail_msg("pipelined lookup %d differs from the one-at-a-time run", i);
    }
  }
  /* The pushes did something, and both tables end identical. */
  snapshot(c, table, snap_a);
  snapshot(c, twin, snap_b);
  assert_memory_equal(snap_a, snap_b, sizeof(snap_a));
  assert_true(memcmp(snap_a, initial, sizeof(initial)) != 0);
  /* A lookup that followed a push saw it: the last lookup differs from the initial rows. */
  {
    const pipe_op_t *last = &ops[PIPE_CALLS - 2];
    int differs = 0;
    for (size_t k = 0; k < last->n; k++)
      differs |= memcmp(last->out + k * WIDTH, initial + last->tokens[k] * WIDTH,
                        WIDTH * sizeof(float)) != 0;
    assert_true(differs);
  }
}

static void test_pipelined_calls_sgd(void **state) {
  (void)state;
  run_pipeline("pipe_sgd", EMBPS_OPTIMIZER_SGD, 0.5f);
}

static void test_pipelined_calls_rowwise_adagrad(void **state) {
  (void)state;
  run_pipeline("pipe_rwa", EMBPS_OPTIMIZER_ROWWISE_ADAGRAD, 0.1f);
}

/* embps_assign and embps_assign_start: rows read back bit for bit (the last of a repeated token,
 * padding 0 skipped), an assign pipelined between pushes applied in order, a bf16 table's bits
 * kept, and rows of the wrong dtype or a token out of range refused with nothing written. */
static void test_assign(void **state) {
  (void)state;
  embps_client_t *c = g_client;
  const int64_t tok[4] = {3, 9, 3, 0}, two[2] = {3, 9};
  float rows[4 * WIDTH], got[4 * WIDTH], g[2 * WIDTH], before[2 * WIDTH];
  uint16_t bf[4 * WIDTH], gotbf[4 * WIDTH];
  embps_assign_result_t res;
  embps_push_result_t pres;
  embps_call_t *calls[3];
  embps_table_spec_t s;

  create_table(c, "assign_sgd", WIDTH, EMBPS_OPTIMIZER_SGD, 0.5f, 3);
  for (int i = 0; i < 4 * WIDTH; i++)
    rows[i] = (float)i * 0.25f - 3.0f;
  memset(&res, 0xff, sizeof(res));
  assert_int_equal(
      embps_assign(c, "assign_sgd", tok, 4, rows, sizeof(rows), EMBPS_DTYPE_F32, 1, &res),
      EMBPS_OK);
  assert_int_equal(res.num_assigned, 2);
  assert_int_equal(res.num_refused, 0);
  assert_int_equal(res.replayed, 0);
  assert_int_equal(embps_lookup(c, "assign_sgd", two, 2, got, 2 * WIDTH * sizeof(float)), EMBPS_OK);
  assert_memory_equal(got, rows + 2 * WIDTH, WIDTH * sizeof(float)); /* 3: the last row */
  assert_memory_equal(got + WIDTH, rows + WIDTH, WIDTH * sizeof(float));

  /* push, assign, push pipelined: the rows end as the assign's minus one SGD step */
  for (int i = 0; i < 2 * WIDTH; i++)
    g[i] = 1.0f;
  assert_int_equal(embps_push_start(c, "assign_sgd", two, 2, g, sizeof(g), EMBPS_DTYPE_F32,
                                    EMBPS_PUSH_SYNC, &pres, &calls[0]),
                   EMBPS_OK);
  assert_int_equal(embps_assign_start(c, "assign_sgd", two, 2, rows, 2 * WIDTH * sizeof(float),
                                      EMBPS_DTYPE_F32, 0, &res, &calls[1]),
                   EMBPS_OK);
  assert_int_equal(embps_push_start(c, "assign_sgd", two, 2, g, sizeof(g), EMBPS_DTYPE_F32,
                                    EMBPS_PUSH_SYNC, &pres, &calls[2]),
                   EMBPS_OK);
  for (int i = 0; i < 3; i++)
    assert_int_equal(embps_call_wait(calls[i]), EMBPS_OK);
  assert_int_equal(embps_lookup(c, "assign_sgd", two, 2, got, 2 * WIDTH * sizeof(float)), EMBPS_OK);
  for (int i = 0; i < 2 * WIDTH; i++)
    assert_true(got[i] == rows[i] - 0.5f);

  /* refused: bf16 rows into an f32 table, a token past the rows; nothing written */
  memcpy(before, got, sizeof(before));
  assert_int_equal(embps_assign(c, "assign_sgd", two, 2, bf, 2 * WIDTH * sizeof(uint16_t),
                                EMBPS_DTYPE_BF16, 1, NULL),
                   EMBPS_INVALID_ARGUMENT);
  assert_non_null(strstr(embps_client_last_error(c), "dtype mismatch"));
  {
    const int64_t far[2] = {ROWS, ROWS + 1}; /* every rank refuses its shard at once */
    assert_int_equal(embps_assign(c, "assign_sgd", far, 2, rows, 2 * WIDTH * sizeof(float),
                                  EMBPS_DTYPE_F32, 1, NULL),
                     EMBPS_INVALID_ARGUMENT);
  }
  assert_int_equal(embps_lookup(c, "assign_sgd", two, 2, got, 2 * WIDTH * sizeof(float)), EMBPS_OK);
  assert_memory_equal(got, before, sizeof(before));

  /* a bf16 table keeps the bits given */
  embps_table_spec_init(&s);
  s.name = "assign_bf16";
  s.rows = ROWS;
  s.emb_width = WIDTH;
  s.dtype = EMBPS_DTYPE_BF16;
  assert_int_equal(embps_create_table(c, &s), EMBPS_OK);
  for (int i = 0; i < 4 * WIDTH; i++)
    bf[i] = (uint16_t)(0x3f80 + i * 37);
  assert_int_equal(
      embps_assign(c, "assign_bf16", tok, 4, bf, sizeof(bf), EMBPS_DTYPE_BF16, 1, &res), EMBPS_OK);
  assert_int_equal(embps_lookup(c, "assign_bf16", two, 2, gotbf, 2 * WIDTH * sizeof(uint16_t)),
                   EMBPS_OK);
  assert_memory_equal(gotbf, bf + 2 * WIDTH, WIDTH * sizeof(uint16_t));
  assert_memory_equal(gotbf + WIDTH, bf + WIDTH, WIDTH * sizeof(uint16_t));
}

static void test_stats(void **state) {
  (void)state;
  embps_client_t *c = g_client;
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  int64_t tok[4] = {1, 2, 3, 4};
  float out[4 * WIDTH];

  create_table(c, "stats", WIDTH, EMBPS_OPTIMIZER_SGD, 0.5f, 5);
  embps_client_set_padding(c, 0);
  lookup_ok(c, "stats", tok, 4, out); /* traffic, whatever ran before */
  embps_status_t st = embps_stats(c, &s, &n);
  if (st != EMBPS_OK)
    fail_msg("stats: %s: %s", embps_status_string(st), embps_client_last_error(c));
  assert_int_equal(n, RANKS);
  for (size_t r = 0; r < n; r++) {
    int found = 0;
    assert_int_equal(s[r].rank, r);
    assert_int_equal(s[r].group_size, RANKS);
    assert_int_equal(s[r].ready, 1);
    assert_non_null(s[r].mesh);
    assert_string_equal(s[r].mesh, "shard=2");
    assert_true(s[r].peer_bytes_sent > 0);
    assert_true(s[r].peer_bytes_received > 0);
    assert_true(s[r].collective_calls > 0);
    assert_true(s[r].requests > 0);
    assert_non_null(s[r].address);
    assert_non_null(strstr(g_group.servers, s[r].address));
    for (size_t i = 0; i < s[r].num_tables; i++)
      if (strcmp(s[r].tables[i].name, "stats") == 0) {
        found = 1;
        assert_int_equal(s[r].tables[i].emb_width, WIDTH);
        assert_int_equal(s[r].tables[i].rows, ROWS);
        assert_true(s[r].tables[i].lookups >= 1);
      }
    assert_true(found);
  }
  assert_true(strcmp(s[0].address, s[1].address) != 0);
  embps_stats_free(s, n);
}

static void test_clean_exit(void **state) {
  (void)state;
  int codes[RANKS] = {-2, -2};
  embps_client_free(g_client);
  g_client = NULL;
  int bad = group_proc_stop(&g_group, STOP_TIMEOUT_MS, codes);
  for (int r = 0; r < RANKS; r++)
    if (codes[r] != 0)
      fail_msg("rank %d exited with %d on SIGTERM", r, codes[r]);
  assert_int_equal(bad, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_group_size),
      cmocka_unit_test(test_create_table_and_width_check),
      cmocka_unit_test(test_uneven_batch_and_padding),
      cmocka_unit_test(test_pipelined_calls_sgd),
      cmocka_unit_test(test_pipelined_calls_rowwise_adagrad),
      cmocka_unit_test(test_assign),
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_clean_exit),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
