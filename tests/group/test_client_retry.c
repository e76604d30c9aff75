/* The C library's retries against a real 2-rank group, with rank 0 behind a proxy that cuts a
 * connection after the group answered and before the client read the answer (cut_proxy.c): the
 * first attempt of the call is ambiguous, as after a reset connection in production.
 *
 *   - A push through the cut, with retries (max_attempts 4): the library reconnects and sends
 *     the whole batch again (same id and digest, attempt 1); the group answers with the first
 *     attempt's result, replayed. The table then holds bitwise what a twin table holds after the
 *     same push made once without a cut, and differs from its start: applied exactly once. The
 *     result (applied, grad_norm, num_unique) equals the twin's.
 *   - A push whose request to rank 0 is lost on the way (cut before its HEADERS): rank 1 holds
 *     its shard for a rank 0 shard that never comes, so the library withdraws it at once and
 *     sends the batch again; the push is applied once (not replayed: the first attempt was
 *     applied nowhere). The group's batch deadline is 5 minutes, far past the client's 30 s,
 *     so only that early withdrawal lets the call succeed.
 *   - A lookup through the cut returns the same rows as one without it.
 *   - A push through the cut with max_attempts 1 fails with UNAVAILABLE naming rank 0, and the
 *     table shows that the group had applied it: the failure the retry is there for.
 *   - Replies held back by the proxy: with attempt_timeout_ms each attempt of a lookup is
 *     cancelled at its own deadline and retried while the call's one deadline leaves room for
 *     the backoff; the call ends DEADLINE_EXCEEDED (each attempt having waited its own timeout,
 *     none past the call's deadline), says how many attempts it made, and the group served
 *     about that many (rank 1's lookup counter).
 *
 *   - The same for feature batches (embps_push_features, embps_lookup_features): a feature push
 *     through the cut is retried whole and answered replayed, its table bitwise its twin's; a
 *     feature lookup through the cut answers what one without it does.
 *
 * The twins are created with the same spec and seed, so they start equal (checked). Every wait
 * is bounded: a 30 s client deadline, 60 s to start the group, 20 s to stop it. */
#define _DEFAULT_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client/embps.h"
#include "common/clock.h"
#include "cut_proxy.h"
#include "group_proc.h"

#define RANKS 2
#define DEADLINE_MS 30000
#define READY_TIMEOUT_MS 60000
#define STOP_TIMEOUT_MS 20000
#define WIDTH 8
#define ROWS 64
#define BATCH 16

static group_proc_t g_group;
static cut_proxy_t g_proxy;
static int g_proxy_started;
static char g_servers[64];         /* "127.0.0.1:PROXY,127.0.0.1:RANK1" */
static embps_client_t *g_client;   /* 4 attempts */
static embps_client_t *g_no_retry; /* 1 attempt */
static int64_t g_tokens[BATCH];
static float g_grads[BATCH * WIDTH];

/* ---- helpers ----------------------------------------------------------------------------- */

static uint64_t g_rng = 0x452821e638d01377ull;

static uint32_t rnd(void) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33);
}

static void create_table(const char *name) {
  embps_table_spec_t s;
  embps_table_spec_init(&s);
  s.name = name;
  s.rows = ROWS;
  s.emb_width = WIDTH;
  s.dtype = EMBPS_DTYPE_F32;
  s.optimizer = EMBPS_OPTIMIZER_ROWWISE_ADAGRAD; /* applied twice is not applied once, bitwise */
  s.lr = 0.25f;
  s.seed = 1234;
  embps_status_t st = embps_create_table(g_client, &s);
  if (st != EMBPS_OK)
    fail_msg("create %s: %s: %s", name, embps_status_string(st), embps_client_last_error(g_client));
}

/* Every row of table into out (ROWS * WIDTH floats), through the client with retries. */
static void snapshot(const char *table, float *out) {
  int64_t tok[ROWS];
  for (int i = 0; i < ROWS; i++)
    tok[i] = i;
  embps_status_t st = embps_lookup(g_client, table, tok, ROWS, out, sizeof(float) * ROWS * WIDTH);
  if (st != EMBPS_OK)
    fail_msg("lookup %s: %s: %s", table, embps_status_string(st),
             embps_client_last_error(g_client));
}

static void push_ok(embps_client_t *c, const char *table, embps_push_result_t *res) {
  embps_status_t st = embps_push(c, table, g_tokens, BATCH, g_grads, sizeof(g_grads),
                                 EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, res);
  if (st != EMBPS_OK)
    fail_msg("push %s: %s: %s", table, embps_status_string(st), embps_client_last_error(c));
}

static void assert_tables_equal(const char *a, const char *b) {
  static float ra[ROWS * WIDTH], rb[ROWS * WIDTH];
  snapshot(a, ra);
  snapshot(b, rb);
  if (memcmp(ra, rb, sizeof(ra)) != 0)
    fail_msg("tables %s and %s differ", a, b);
}

static void assert_tables_differ(const char *a, const char *b) {
  static float ra[ROWS * WIDTH], rb[ROWS * WIDTH];
  snapshot(a, ra);
  snapshot(b, rb);
  if (memcmp(ra, rb, sizeof(ra)) == 0)
    fail_msg("tables %s and %s are equal", a, b);
}

/* ---- setup ------------------------------------------------------------------------------- */

static int connect_client(embps_client_t **out, uint32_t max_attempts) {
  embps_client_options_t o;
  embps_error_t err;
  embps_client_options_init(&o);
  o.deadline_ms = DEADLINE_MS;
  o.max_attempts = max_attempts;
  embps_error_clear(&err);
  if (embps_client_connect(out, g_servers, &o, &err) != EMBPS_OK) {
    fprintf(stderr, "connect to %s: %s: %s\n", g_servers, embps_status_string(err.status),
            err.message);
    return -1;
  }
  return 0;
}

static int group_teardown(void **state);

static int group_setup(void **state) {
  (void)state;
  static const char *const flags[] = {"--batch-deadline-ms", "300000", NULL};
  if (group_proc_start(&g_group, RANKS, flags, 3, READY_TIMEOUT_MS) != 0)
    return -1;
  if (cut_proxy_start(&g_proxy, g_group.ports[0]) != 0) {
    group_proc_stop(&g_group, STOP_TIMEOUT_MS, NULL);
    return -1;
  }
  g_proxy_started = 1;
  snprintf(g_servers, sizeof(g_servers), "127.0.0.1:%d,127.0.0.1:%d", g_proxy.port,
           g_group.ports[1]);
  if (connect_client(&g_client, 4) != 0 || connect_client(&g_no_retry, 1) != 0) {
    group_teardown(state);
    return -1;
  }
  for (int i = 0; i < BATCH; i++) {
    g_tokens[i] = 1 + (int64_t)(rnd() % (ROWS - 1));
    if (i % 5 == 4)
      g_tokens[i] = g_tokens[i - 1]; /* duplicates are summed */
  }
  for (int i = 0; i < BATCH * WIDTH; i++)
    g_grads[i] = (float)((int)(rnd() % 2048) - 1024) / 512.0f;
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  embps_client_free(g_client);
  embps_client_free(g_no_retry);
  g_client = g_no_retry = NULL;
  if (g_proxy_started)
    cut_proxy_stop(&g_proxy);
  g_proxy_started = 0;
  return group_proc_stop(&g_group, STOP_TIMEOUT_MS, NULL) == 0 ? 0 : -1;
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_push_retried_after_lost_reply_applies_once(void **state) {
  embps_push_result_t twin, cut;
  int cuts = cut_proxy_cuts(&g_proxy), accepted = cut_proxy_accepted(&g_proxy);
  (void)state;
  create_table("once_cut");
  create_table("once_twin");
  assert_tables_equal("once_cut", "once_twin");

  memset(&twin, 0, sizeof(twin));
  push_ok(g_client, "once_twin", &twin);
  assert_int_equal(twin.applied, 1);
  assert_int_equal(twin.replayed, 0);
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts);

  memset(&cut, 0xff, sizeof(cut));
  cut_proxy_arm(&g_proxy);
  push_ok(g_client, "once_cut", &cut);
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1); /* the first attempt's reply was cut */
  assert_true(cut_proxy_accepted(&g_proxy) > accepted); /* and the library reconnected */
  assert_int_equal(cut.applied, 1);
  assert_int_equal(cut.skipped, 0);
  assert_int_equal(cut.replayed, 1); /* the group answered the retry from its first attempt */
  assert_true(cut.num_unique == twin.num_unique);
  assert_memory_equal(&cut.grad_norm, &twin.grad_norm, sizeof(double));

  assert_tables_equal("once_cut", "once_twin"); /* applied exactly once, bitwise */
  {
    /* and applied at all: a fresh twin still differs */
    create_table("once_fresh");
    assert_tables_differ("once_cut", "once_fresh");
  }
  /* the next push is an ordinary one */
  push_ok(g_client, "once_cut", &cut);
  push_ok(g_client, "once_twin", &twin);
  assert_int_equal(cut.replayed, 0);
  assert_tables_equal("once_cut", "once_twin");
}

static void test_push_retried_after_lost_request_applies_once(void **state) {
  embps_push_result_t twin, res;
  int cuts = cut_proxy_cuts(&g_proxy);
  (void)state;
  create_table("lost_cut");
  create_table("lost_twin");
  push_ok(g_client, "lost_twin", &twin);
  cut_proxy_arm_request(&g_proxy);
  memset(&res, 0xff, sizeof(res));
  push_ok(g_client, "lost_cut", &res);
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1);
  assert_int_equal(res.applied, 1);
  assert_int_equal(res.replayed, 0);
  assert_memory_equal(&res.grad_norm, &twin.grad_norm, sizeof(double));
  assert_tables_equal("lost_cut", "lost_twin");
}

static void test_lookup_retried_after_lost_reply(void **state) {
  float want[BATCH * WIDTH], got[BATCH * WIDTH];
  int cuts = cut_proxy_cuts(&g_proxy);
  (void)state;
  create_table("look");
  assert_int_equal(embps_lookup(g_client, "look", g_tokens, BATCH, want, sizeof(want)), EMBPS_OK);
  memset(got, 0, sizeof(got));
  cut_proxy_arm(&g_proxy);
  embps_status_t st = embps_lookup(g_client, "look", g_tokens, BATCH, got, sizeof(got));
  if (st != EMBPS_OK)
    fail_msg("lookup through the cut: %s: %s", embps_status_string(st),
             embps_client_last_error(g_client));
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1);
  assert_memory_equal(got, want, sizeof(want));
}

/* Without retries the same cut is a failure the client cannot read: UNAVAILABLE from rank 0,
 * while the group applied the push. */
static void test_no_retry_leaves_the_push_unknown(void **state) {
  embps_push_result_t res;
  int cuts = cut_proxy_cuts(&g_proxy);
  (void)state;
  create_table("unknown_cut");
  create_table("unknown_twin");
  push_ok(g_client, "unknown_twin", &res);
  cut_proxy_arm(&g_proxy);
  embps_status_t st = embps_push(g_no_retry, "unknown_cut", g_tokens, BATCH, g_grads,
                                 sizeof(g_grads), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res);
  assert_int_equal(st, EMBPS_UNAVAILABLE);
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1);
  assert_non_null(strstr(embps_client_last_error(g_no_retry), "rank 0"));
  assert_null(strstr(embps_client_last_error(g_no_retry), "attempts"));
  assert_tables_equal("unknown_cut", "unknown_twin"); /* it was applied all the same */
}

/* Rank 1's lookup counter of table (its connection does not pass through the proxy). */
static uint64_t rank1_lookups(const char *table) {
  embps_rank_stats_t *s = NULL;
  size_t n = 0;
  uint64_t v = 0;
  embps_status_t st = embps_stats(g_client, &s, &n);
  if (st != EMBPS_OK)
    fail_msg("stats: %s: %s", embps_status_string(st), embps_client_last_error(g_client));
  assert_int_equal(n, RANKS);
  for (size_t i = 0; i < s[1].num_tables; i++)
    if (strcmp(s[1].tables[i].name, table) == 0)
      v = s[1].tables[i].lookups;
  embps_stats_free(s, n);
  return v;
}

static void test_attempt_timeout_retries_within_one_deadline(void **state) {
  const int64_t deadline = 1500, attempt_timeout = 200;
  embps_client_options_t o;
  embps_client_t *c = NULL;
  embps_error_t err;
  float rows[BATCH * WIDTH];
  unsigned attempts = 0;
  const char *msg;
  (void)state;
  create_table("stall");
  embps_client_options_init(&o);
  o.deadline_ms = deadline;
  o.attempt_timeout_ms = attempt_timeout;
  o.max_attempts = 100;
  embps_error_clear(&err);
  assert_int_equal(embps_client_connect(&c, g_servers, &o, &err), EMBPS_OK);
  uint64_t before = rank1_lookups("stall");

  cut_proxy_hold(&g_proxy, 1);
  uint64_t t0 = embps_now_ms();
  embps_status_t st = embps_lookup(c, "stall", g_tokens, BATCH, rows, sizeof(rows));
  uint64_t took = embps_now_ms() - t0;
  cut_proxy_hold(&g_proxy, 0);

  assert_int_equal(st, EMBPS_DEADLINE_EXCEEDED);
  msg = embps_client_last_error(c);
  if (!strstr(msg, "(after ") ||
      sscanf(strstr(msg, "(after "), "(after %u attempts)", &attempts) != 1)
    fail_msg("the message does not count the attempts: %s", msg);
  /* 1500 ms of 200 ms attempts and backoffs of 10..160 ms: 4 to 7 attempts */
  assert_true(attempts >= 4 && attempts <= 7);
  /* each attempt waited out its own deadline, and none outlived the call's (a loose bound) */
  assert_true(took >= (uint64_t)attempts * (uint64_t)(attempt_timeout - 1));
  assert_true(took < (uint64_t)deadline + 10000);
  uint64_t served = rank1_lookups("stall") - before;
  assert_true(served + 1 >= attempts && served <= attempts); /* the last may be cut short */
  embps_client_free(c);
}

/* A feature batch of g_tokens as two bags per sample (BATCH / 2 samples): a sum feature whose
 * pooled gradients are g_grads' first rows, and a feature of pooling none with g_grads per id. */
static void feature_batch(const char *table, embps_feature_t f[2], uint32_t lengths[BATCH / 2],
                          void *out0, void *out1) {
  for (int s = 0; s < BATCH / 2; s++)
    lengths[s] = 2;
  memset(f, 0, 2 * sizeof(*f));
  f[0].name = "pooled";
  f[0].pooling = EMBPS_POOLING_SUM;
  f[0].grad_bytes = f[0].out_bytes = BATCH / 2 * WIDTH * sizeof(float);
  f[1].name = "raw";
  f[1].pooling = EMBPS_POOLING_NONE;
  f[1].grad_bytes = f[1].out_bytes = BATCH * WIDTH * sizeof(float);
  for (int k = 0; k < 2; k++) {
    f[k].table = table;
    f[k].ids = g_tokens;
    f[k].num_ids = BATCH;
    f[k].lengths = lengths;
    f[k].grads = g_grads;
  }
  f[0].out = out0;
  f[1].out = out1;
}

/* A feature push whose reply was cut is sent again whole (same batch id, digest and client id,
 * the next attempt) and answered replayed: applied exactly once, as its twin without a cut. */
static void test_feature_push_retried_after_lost_reply_applies_once(void **state) {
  embps_feature_t f[2];
  uint32_t lengths[BATCH / 2];
  embps_feature_step_t twin[2], cut[2];
  size_t n = 0;
  int cuts = cut_proxy_cuts(&g_proxy);
  (void)state;
  create_table("feat_cut");
  create_table("feat_twin");
  feature_batch("feat_twin", f, lengths, NULL, NULL);
  assert_int_equal(embps_push_features(g_client, f, 2, BATCH / 2, EMBPS_PUSH_SYNC, twin, &n),
                   EMBPS_OK);
  assert_int_equal(n, 1);
  assert_int_equal(twin[0].result.replayed, 0);
  feature_batch("feat_cut", f, lengths, NULL, NULL);
  cut_proxy_arm(&g_proxy);
  embps_status_t st = embps_push_features(g_client, f, 2, BATCH / 2, EMBPS_PUSH_SYNC, cut, &n);
  if (st != EMBPS_OK)
    fail_msg("feature push through the cut: %s: %s", embps_status_string(st),
             embps_client_last_error(g_client));
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1);
  assert_int_equal(n, 1);
  assert_string_equal(cut[0].table, "feat_cut");
  assert_int_equal(cut[0].result.replayed, 1);
  assert_tables_equal("feat_cut", "feat_twin"); /* applied once, bitwise */
  create_table("feat_fresh");
  assert_tables_differ("feat_cut", "feat_fresh"); /* and applied */
}

/* A feature lookup through the cut answers what one without it does. */
static void test_feature_lookup_retried_after_lost_reply(void **state) {
  static float w0[BATCH / 2 * WIDTH], w1[BATCH * WIDTH], g0[BATCH / 2 * WIDTH], g1[BATCH * WIDTH];
  embps_feature_t f[2];
  uint32_t lengths[BATCH / 2];
  int cuts = cut_proxy_cuts(&g_proxy);
  (void)state;
  create_table("feat_look");
  feature_batch("feat_look", f, lengths, w0, w1);
  assert_int_equal(embps_lookup_features(g_client, f, 2, BATCH / 2), EMBPS_OK);
  feature_batch("feat_look", f, lengths, g0, g1);
  cut_proxy_arm(&g_proxy);
  embps_status_t st = embps_lookup_features(g_client, f, 2, BATCH / 2);
  if (st != EMBPS_OK)
    fail_msg("feature lookup through the cut: %s: %s", embps_status_string(st),
             embps_client_last_error(g_client));
  assert_int_equal(cut_proxy_cuts(&g_proxy), cuts + 1);
  assert_memory_equal(g0, w0, sizeof(w0));
  assert_memory_equal(g1, w1, sizeof(w1));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_feature_push_retried_after_lost_reply_applies_once),
      cmocka_unit_test(test_feature_lookup_retried_after_lost_reply),
      cmocka_unit_test(test_push_retried_after_lost_reply_applies_once),
      cmocka_unit_test(test_push_retried_after_lost_request_applies_once),
      cmocka_unit_test(test_lookup_retried_after_lost_reply),
      cmocka_unit_test(test_no_retry_leaves_the_push_unknown),
      cmocka_unit_test(test_attempt_timeout_retries_within_one_deadline),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
