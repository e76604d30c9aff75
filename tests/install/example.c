/* A program written as a user outside the tree writes it: it includes <embps/embps.h> only and
 * is built against an installed libembps (tests/install/test_install.py builds it with
 * pkg-config and with CMake's find_package(embps), shared and static).
 *
 * Usage: example HOST:PORT TABLE. Against a 1-rank group it creates TABLE (SGD, lr 0.5, 8 f32
 * columns), looks up tokens, pushes gradients and checks that the rows moved by exactly
 * -lr * (summed gradient), then drives the other calls of the API and the errors a user meets
 * (unknown table, wrong buffer size, duplicate table, bad address). Every check that fails is
 * printed; the exit status is 0 only when none did. */
#include <embps/embps.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WIDTH 8
#define N 4

static int failures;

#define CHECK(cond)                                                                                \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "example.c:%d: check failed: %s\n", __LINE__, #cond);                        \
      failures++;                                                                                  \
    }                                                                                              \
  } while (0)

/* Checks that a call returned the status expected, printing the client's message if not. */
static void expect(embps_client_t *c, embps_status_t got, embps_status_t want, const char *what) {
  if (got != want) {
    fprintf(stderr, "%s: got %s (%s), want %s\n", what, embps_status_string(got),
            embps_client_last_error(c), embps_status_string(want));
    failures++;
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s HOST:PORT TABLE\n", argv[0]);
    return 2;
  }
  const char *servers = argv[1], *table = argv[2];

  /* A bad address list fails at once, reports through err and leaves the output untouched. */
  static char sentinel;
  embps_client_t *c = NULL, *bad = (embps_client_t *)&sentinel;
  embps_error_t err;
  CHECK(embps_client_connect(&bad, "no-port-here", NULL, &err) == EMBPS_INVALID_ARGUMENT);
  CHECK(err.status == EMBPS_INVALID_ARGUMENT && err.message[0] != '\0');
  CHECK(bad == (embps_client_t *)&sentinel);

  embps_client_options_t opts;
  embps_client_options_init(&opts);
  opts.deadline_ms = 20000;
  embps_status_t st = embps_client_connect(&c, servers, &opts, &err);
  if (st != EMBPS_OK) {
    fprintf(stderr, "connect %s: %s: %s\n", servers, embps_status_string(st), err.message);
    return 1;
  }
  CHECK(embps_client_group_size(c) == 1);
  embps_client_set_deadline(c, 20000);
  embps_client_set_padding(c, 0);

  int serving = 0;
  expect(c, embps_health(c, "", &serving), EMBPS_OK, "health");
  CHECK(serving == 1);

  embps_table_spec_t spec;
  embps_table_spec_init(&spec);
  spec.name = table;
  spec.rows = 100;
  spec.emb_width = WIDTH;
  spec.dtype = EMBPS_DTYPE_F32;
  spec.optimizer = EMBPS_OPTIMIZER_SGD;
  spec.lr = 0.5f;
  spec.seed = 7;
  expect(c, embps_create_table(c, &spec), EMBPS_OK, "create_table");
  expect(c, embps_create_table(c, &spec), EMBPS_ALREADY_EXISTS, "create_table again");
  CHECK(embps_client_last_status(c) == EMBPS_ALREADY_EXISTS);
  CHECK(strcmp(embps_status_string(EMBPS_ALREADY_EXISTS), "ALREADY_EXISTS") == 0);

  embps_table_spec_t *tables = NULL;
  size_t num_tables = 0, found = 0;
  expect(c, embps_list_tables(c, &tables, &num_tables), EMBPS_OK, "list_tables");
  for (size_t i = 0; i < num_tables; i++)
    if (strcmp(tables[i].name, table) == 0) {
      found++;
      CHECK(tables[i].rows == 100 && tables[i].emb_width == WIDTH);
      CHECK(tables[i].dtype == EMBPS_DTYPE_F32 && tables[i].optimizer == EMBPS_OPTIMIZER_SGD);
    }
  CHECK(found == 1);
  embps_tables_free(tables, num_tables);

  /* Lookup: one full row per token, in token order; a repeated token gives the same row. */
  const int64_t tokens[N] = {3, 5, 3, 99};
  float before[N][WIDTH], after[N][WIDTH];
  expect(c, embps_lookup(c, table, tokens, N, before, sizeof(before)), EMBPS_OK, "lookup");
  CHECK(memcmp(before[0], before[2], sizeof(before[0])) == 0);
  int nonzero = 0;
  for (int i = 0; i < N; i++)
    for (int j = 0; j < WIDTH; j++) {
      CHECK(isfinite(before[i][j]));
      nonzero += before[i][j] != 0.0f;
    }
  CHECK(nonzero > 0);

  /* Push all-ones gradients: token 3 twice, so its row gets 2 per column. SGD moves each row by
   * -lr * its summed gradient; the norm is that of the summed gradients. */
  float grads[N][WIDTH];
  for (int i = 0; i < N; i++)
    for (int j = 0; j < WIDTH; j++)
      grads[i][j] = 1.0f;
  embps_push_result_t res;
  memset(&res, 0, sizeof(res));
  expect(
      c,
      embps_push(c, table, tokens, N, grads, sizeof(grads), EMBPS_DTYPE_F32, EMBPS_PUSH_SYNC, &res),
      EMBPS_OK, "push");
  CHECK(res.applied == 1 && res.skipped == 0 && res.ordered == 0);
  CHECK(res.num_unique == 3);
  CHECK(fabs(res.grad_norm - sqrt(WIDTH * (4.0 + 1.0 + 1.0))) < 1e-4);

  /* The same lookup, pipelined: started, then waited for. */
  embps_call_t *call = NULL;
  expect(c, embps_lookup_start(c, table, tokens, N, after, sizeof(after), &call), EMBPS_OK,
         "lookup_start");
  if (call)
    expect(c, embps_call_wait(call), EMBPS_OK, "call_wait");
  const float step[N] = {1.0f, 0.5f, 1.0f, 0.5f}; /* lr * summed gradient, per token */
  for (int i = 0; i < N; i++)
    for (int j = 0; j < WIDTH; j++)
      CHECK(after[i][j] == before[i][j] - step[i]);

  /* A pipelined push, polled with embps_call_test, then a call dropped with embps_call_cancel. */
  embps_push_result_t res2;
  call = NULL;
  expect(c,
         embps_push_start(c, table, tokens, N, grads, sizeof(grads), EMBPS_DTYPE_F32,
                          EMBPS_PUSH_SYNC, &res2, &call),
         EMBPS_OK, "push_start");
  if (call) {
    for (int spins = 0; !embps_call_test(call) && spins < 1000000; spins++)
      ;
    expect(c, embps_call_wait(call), EMBPS_OK, "call_wait (push)");
    CHECK(res2.applied == 1 && res2.num_unique == 3);
  }
  call = NULL;
  expect(c, embps_lookup_start(c, table, tokens, N, after, sizeof(after), &call), EMBPS_OK,
         "lookup_start (cancelled)");
  embps_call_cancel(call);

  /* The errors a user meets, each with a message. */
  expect(c, embps_lookup(c, "no-such-table", tokens, N, after, sizeof(after)), EMBPS_NOT_FOUND,
         "lookup of an unknown table");
  CHECK(embps_client_last_error(c)[0] != '\0');
  expect(c, embps_lookup(c, table, tokens, N, after, sizeof(after) - 4), EMBPS_INVALID_ARGUMENT,
         "lookup with a short buffer");
  expect(c, embps_checkpoint(c, NULL, NULL), EMBPS_FAILED_PRECONDITION,
         "checkpoint without --checkpoint-dir");
  embps_checkpoint_info_t *checkpoints = NULL;
  size_t num_checkpoints = 0;
  expect(c, embps_list_checkpoints(c, &checkpoints, &num_checkpoints), EMBPS_FAILED_PRECONDITION,
         "list_checkpoints without --checkpoint-dir");
  embps_checkpoints_free(checkpoints);

  embps_rank_stats_t *stats = NULL;
  size_t num_ranks = 0;
  expect(c, embps_stats(c, &stats, &num_ranks), EMBPS_OK, "stats");
  CHECK(num_ranks == 1);
  if (num_ranks == 1) {
    CHECK(stats[0].group_size == 1 && stats[0].ready == 1 && stats[0].num_tables >= 1);
    CHECK(stats[0].version != NULL && stats[0].version[0] != '\0');
  }
  embps_stats_free(stats, num_ranks);

  embps_client_free(c);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("ok: %s against %s\n", argv[0], servers);
  return 0;
}
