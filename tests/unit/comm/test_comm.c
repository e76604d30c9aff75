/* The dispatcher of the collectives (server/comm/comm.c) over a recording fake backend: a bad
 * argument or a broken communicator is refused before the backend sees the call, and every
 * call and its payload are counted once, by the dispatcher, whatever the backend does. */
#include <string.h>

/* cmocka.h needs these first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "server/comm/comm.h"

#define RANK 1
#define SIZE 4

/* A backend that moves nothing: it counts what reached it and answers `answer`. */
typedef struct fake_comm {
  embps_comm_t base;
  int gathers, to_alls, reduces, barriers, destroyed;
  embps_status_t answer;
} fake_comm_t;

static embps_status_t fake_answer(fake_comm_t *f, embps_error_t *err) {
  if (f->answer == EMBPS_OK)
    return EMBPS_OK;
  return embps__comm_break(&f->base, err, f->answer, __FILE__, __LINE__, "the fake peer left");
}

static embps_status_t fake_all_gather(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                      embps_error_t *err) {
  fake_comm_t *f = (fake_comm_t *)c;
  f->gathers++;
  return fake_answer(f, err);
}

static embps_status_t fake_all_to_all(embps_comm_t *c, const void *send, size_t bytes, void *recv,
                                      embps_error_t *err) {
  fake_comm_t *f = (fake_comm_t *)c;
  f->to_alls++;
  return fake_answer(f, err);
}

static embps_status_t fake_all_reduce(embps_comm_t *c, void *buf, size_t count,
                                      embps_comm_type_t type, embps_comm_op_t op,
                                      embps_error_t *err) {
  fake_comm_t *f = (fake_comm_t *)c;
  f->reduces++;
  return fake_answer(f, err);
}

static embps_status_t fake_barrier(embps_comm_t *c, embps_error_t *err) {
  fake_comm_t *f = (fake_comm_t *)c;
  f->barriers++;
  return fake_answer(f, err);
}

static void fake_destroy(embps_comm_t *c) { ((fake_comm_t *)c)->destroyed++; }

static const embps_comm_ops_t fake_ops = {
    .name = "fake",
    .all_gather = fake_all_gather,
    .all_to_all = fake_all_to_all,
    .all_reduce = fake_all_reduce,
    .barrier = fake_barrier,
    .destroy = fake_destroy,
};

static void fake_init(fake_comm_t *f) {
  memset(f, 0, sizeof *f);
  f->base.ops = &fake_ops;
  f->base.rank = RANK;
  f->base.size = SIZE;
}

static int backend_calls(const fake_comm_t *f) {
  return f->gathers + f->to_alls + f->reduces + f->barriers;
}

/* Asserts that the last call was refused with INVALID_ARGUMENT and words containing `words`. */
static void assert_refused(embps_status_t st, const embps_error_t *err, const char *words) {
  assert_int_equal(st, EMBPS_INVALID_ARGUMENT);
  assert_int_equal(err->status, EMBPS_INVALID_ARGUMENT);
  if (!strstr(err->message, words))
    fail_msg("refused with '%s', expected it to say '%s'", err->message, words);
}

static void test_bad_arguments_never_reach_the_backend(void **state) {
  (void)state;
  fake_comm_t f;
  fake_init(&f);
  embps_comm_t *c = &f.base;
  embps_error_t err;
  _Alignas(8) uint8_t buf[SIZE * 16];

  assert_refused(embps_comm_all_gather(c, NULL, 4, buf, &err), &err, "needs send and recv");
  assert_refused(embps_comm_all_gather(c, buf, 4, NULL, &err), &err, "needs send and recv");
  /* Overlapping recv anywhere but in place at recv + rank*bytes. */
  assert_refused(embps_comm_all_gather(c, buf + 1, 4, buf, &err), &err, "overlaps recv");
  assert_refused(embps_comm_all_gather(c, buf, SIZE_MAX / 2, buf, &err), &err, "overflows");

  assert_refused(embps_comm_all_to_all(c, buf, 4, NULL, &err), &err, "needs send and recv");
  assert_refused(embps_comm_all_to_all(c, buf, 4, buf + 2, &err), &err, "in place is not");
  assert_refused(embps_comm_all_to_all(c, buf, SIZE_MAX / 2, buf, &err), &err, "overflows");

  assert_refused(embps_comm_all_reduce(c, buf, 2, (embps_comm_type_t)9, EMBPS_COMM_SUM, &err), &err,
                 "unknown element type 9");
  assert_refused(embps_comm_all_reduce(c, buf, 2, EMBPS_COMM_F64, (embps_comm_op_t)9, &err), &err,
                 "unknown reduction 9");
  assert_refused(embps_comm_all_reduce(c, NULL, 2, EMBPS_COMM_F32, EMBPS_COMM_SUM, &err), &err,
                 "needs a buffer");
  assert_refused(embps_comm_all_reduce(c, buf + 4, 2, EMBPS_COMM_U64, EMBPS_COMM_MAX, &err), &err,
                 "not aligned to its 8-byte elements");
  assert_refused(embps_comm_all_reduce(c, buf, SIZE_MAX / 8, EMBPS_COMM_F64, EMBPS_COMM_SUM, &err),
                 &err, "overflows");

  assert_refused(embps_comm_barrier(NULL, &err), &err, "no communicator");

  /* None reached the backend, none was counted, and the communicator is still usable. */
  assert_int_equal(backend_calls(&f), 0);
  assert_int_equal(c->stats.calls, 0);
  assert_int_equal(c->stats.bytes_sent, 0);
  assert_int_equal(c->stats.bytes_received, 0);
  assert_int_equal(c->broken, EMBPS_OK);
  /* In place at recv + rank*bytes is not an overlap. */
  assert_int_equal(embps_comm_all_gather(c, buf + RANK * 4, 4, buf, &err), EMBPS_OK);
  assert_int_equal(f.gathers, 1);
}

static void test_counted_once(void **state) {
  (void)state;
  fake_comm_t f;
  fake_init(&f);
  embps_comm_t *c = &f.base;
  embps_error_t err;
  _Alignas(8) uint8_t send[SIZE * 100] = {0}, recv[SIZE * 100];
  double d[10] = {0};

  assert_int_equal(embps_comm_all_gather(c, send, 100, recv, &err), EMBPS_OK);
  assert_int_equal(embps_comm_all_to_all(c, send, 30, recv, &err), EMBPS_OK);
  assert_int_equal(embps_comm_all_reduce(c, d, 10, EMBPS_COMM_F64, EMBPS_COMM_SUM, &err), EMBPS_OK);
  assert_int_equal(embps_comm_barrier(c, &err), EMBPS_OK);
  /* Nothing to move is still a call. */
  assert_int_equal(embps_comm_all_reduce(c, NULL, 0, EMBPS_COMM_F32, EMBPS_COMM_MAX, &err),
                   EMBPS_OK);
  assert_int_equal(f.gathers, 1);
  assert_int_equal(f.to_alls, 1);
  assert_int_equal(f.reduces, 2);
  assert_int_equal(f.barriers, 1);
  assert_int_equal(c->stats.calls, 5);
  /* (size-1) blocks each way; the barrier moves no payload. */
  uint64_t payload = (uint64_t)(SIZE - 1) * (100 + 30 + 10 * sizeof(double));
  assert_int_equal(c->stats.bytes_sent, payload);
  assert_int_equal(c->stats.bytes_received, payload);
}

static void test_broken_refused_before_the_backend(void **state) {
  (void)state;
  fake_comm_t f;
  fake_init(&f);
  embps_comm_t *c = &f.base;
  embps_error_t err;
  uint8_t send[SIZE * 8] = {0}, recv[SIZE * 8];

  /* A failing call is counted as a call, but moved no payload. */
  f.answer = EMBPS_UNAVAILABLE;
  assert_int_equal(embps_comm_all_gather(c, send, 8, recv, &err), EMBPS_UNAVAILABLE);
  assert_int_equal(c->stats.calls, 1);
  assert_int_equal(c->stats.bytes_sent, 0);
  assert_int_equal(c->broken, EMBPS_UNAVAILABLE);

  /* Every later call fails at once with the same status, before any argument check. */
  f.answer = EMBPS_OK;
  assert_int_equal(embps_comm_barrier(c, &err), EMBPS_UNAVAILABLE);
  assert_non_null(strstr(err.message, "earlier failure: the fake peer left"));
  assert_int_equal(embps_comm_all_to_all(c, send, 8, send, &err), EMBPS_UNAVAILABLE);
  assert_int_equal(embps_comm_all_reduce(c, NULL, 1, (embps_comm_type_t)9, EMBPS_COMM_SUM, &err),
                   EMBPS_UNAVAILABLE);
  assert_int_equal(f.gathers, 1);
  assert_int_equal(backend_calls(&f), 1);
  assert_int_equal(c->stats.calls, 1);
}

static void test_free_destroys(void **state) {
  (void)state;
  fake_comm_t f;
  fake_init(&f);
  embps_comm_free(NULL);
  embps_comm_free(&f.base);
  assert_int_equal(f.destroyed, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bad_arguments_never_reach_the_backend),
      cmocka_unit_test(test_counted_once),
      cmocka_unit_test(test_broken_refused_before_the_backend),
      cmocka_unit_test(test_free_destroys),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
