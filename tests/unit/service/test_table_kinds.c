/* CreateTable with the table kinds (issue 31): every spec that mixes the kinds, or gives a
 * hash-keyed option the server refuses, is answered INVALID_ARGUMENT (RESOURCE_EXHAUSTED past the
 * memory budget) with docs/design.md's message, naming the field and the remedy; a valid
 * hash-keyed spec is answered UNIMPLEMENTED while the engine does not serve them. None of them
 * reaches the group (nothing is ordered, so no rank creates anything) or the store; a dense table
 * is created as before afterwards. The service runs over the fakes of fake_group.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/service/service_internal.h"
#include "tests/unit/service/fake_group.h"

static embps_store_t *store;
static embps_service_t *svc;

static int setup(void **state) {
  embps_service_config_t cfg = {0};
  (void)state;
  assert_int_equal(embps_store_new(&store), EMBPS_OK);
  embps_store_set_budget(store, 1 << 26, 0); /* --max-memory-bytes: 64 MiB */
  assert_int_equal(embps_service_new(&svc, NULL, store, &cfg), EMBPS_OK);
  fake_reset(store);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  embps_service_free(svc);
  embps_store_free(store);
  fake_reset(NULL);
  return 0;
}

/* A spec's hash-keyed part; every other setting is the test's dense default. */
typedef struct kind {
  uint64_t rows, capacity, half_life_steps, ttl_steps;
  uint32_t admit_after, sketch_width, emb_width;
  int eviction;
} kind_t;

/* Sends CreateTable for table `name` with kind k and runs the fake engine. */
static void create(embps_net_call_t *c, const char *name, const kind_t *k) {
  Embps__V1__CreateTableRequest req = EMBPS__V1__CREATE_TABLE_REQUEST__INIT;
  Embps__V1__TableSpec spec = EMBPS__V1__TABLE_SPEC__INIT;
  uint8_t *buf;
  size_t len;
  spec.name = (char *)name;
  spec.rows = k->rows;
  spec.emb_width = k->emb_width ? k->emb_width : 4;
  spec.seed = 3;
  spec.capacity = k->capacity;
  spec.admit_after = k->admit_after;
  spec.eviction = (Embps__V1__Eviction)k->eviction;
  spec.half_life_steps = k->half_life_steps;
  spec.ttl_steps = k->ttl_steps;
  spec.sketch_width = k->sketch_width;
  req.spec = &spec;
  len = protobuf_c_message_get_packed_size(&req.base);
  buf = malloc(len ? len : 1);
  protobuf_c_message_pack(&req.base, buf);
  memset(c, 0, sizeof(*c));
  embps_service_on_request(svc, c, "/embps.v1.EmbeddingService/CreateTable", buf, len);
  fake_run_engine();
}

typedef struct refusal {
  kind_t k;
  embps_status_t status;
  const char *message; /* the whole message */
} refusal_t;

static const refusal_t refusals[] = {
    /* the kinds mixed */
    {{.rows = 10, .capacity = 100},
     EMBPS_INVALID_ARGUMENT,
     "rows=10 and capacity=100 are both given: a table is dense (rows) or hash-keyed (capacity); "
     "set rows=0 for a hash-keyed table, or capacity=0 for a dense one"},
    {{.rows = 10, .admit_after = 3},
     EMBPS_INVALID_ARGUMENT,
     "admit_after=3 is an option of hash-keyed tables, and this table is dense (capacity=0): give "
     "a capacity (and rows=0) for a hash-keyed table, or leave admit_after 0"},
    {{.rows = 10, .eviction = 2},
     EMBPS_INVALID_ARGUMENT,
     "eviction=2 is an option of hash-keyed tables, and this table is dense (capacity=0): give a "
     "capacity (and rows=0) for a hash-keyed table, or leave eviction 0"},
    {{.rows = 10, .half_life_steps = 5},
     EMBPS_INVALID_ARGUMENT,
     "half_life_steps=5 is an option of hash-keyed tables, and this table is dense (capacity=0): "
     "give a capacity (and rows=0) for a hash-keyed table, or leave half_life_steps 0"},
    {{.rows = 10, .ttl_steps = 5},
     EMBPS_INVALID_ARGUMENT,
     "ttl_steps=5 is an option of hash-keyed tables, and this table is dense (capacity=0): give a "
     "capacity (and rows=0) for a hash-keyed table, or leave ttl_steps 0"},
    {{.rows = 10, .sketch_width = 64},
     EMBPS_INVALID_ARGUMENT,
     "sketch_width=64 is an option of hash-keyed tables, and this table is dense (capacity=0): "
     "give a capacity (and rows=0) for a hash-keyed table, or leave sketch_width 0"},
    /* the hash-keyed settings */
    {{.capacity = UINT64_C(1) << 32},
     EMBPS_INVALID_ARGUMENT,
     "capacity=4294967296 is out of range: a hash-keyed table holds 1 to 4294967295 keys; lower "
     "capacity"},
    {{.capacity = 100, .eviction = 7},
     EMBPS_INVALID_ARGUMENT,
     "eviction=7 is not a policy this server knows: use one of lru, lfu, ttl (0: lru)"},
    {{.capacity = 100, .admit_after = 256},
     EMBPS_INVALID_ARGUMENT,
     "admit_after=256 is out of range: give 1 (store a key at its first push) to 255"},
    {{.capacity = 100, .half_life_steps = 8},
     EMBPS_INVALID_ARGUMENT,
     "half_life_steps=8 is an option of lfu eviction, and this table's eviction is lru: set "
     "eviction=lfu, or leave half_life_steps 0"},
    {{.capacity = 100, .eviction = 3, .ttl_steps = 9, .half_life_steps = 8},
     EMBPS_INVALID_ARGUMENT,
     "half_life_steps=8 is an option of lfu eviction, and this table's eviction is ttl: set "
     "eviction=lfu, or leave half_life_steps 0"},
    {{.capacity = 100, .eviction = 2},
     EMBPS_INVALID_ARGUMENT,
     "half_life_steps=0 is out of range: lfu eviction needs 1 to 2147483648 push steps over which "
     "a push's weight halves"},
    {{.capacity = 100, .eviction = 2, .half_life_steps = (UINT64_C(1) << 31) + 1},
     EMBPS_INVALID_ARGUMENT,
     "half_life_steps=2147483649 is out of range: lfu eviction needs 1 to 2147483648 push steps "
     "over which a push's weight halves"},
    {{.capacity = 100, .ttl_steps = 9},
     EMBPS_INVALID_ARGUMENT,
     "ttl_steps=9 is an option of ttl eviction, and this table's eviction is lru: set "
     "eviction=ttl, or leave ttl_steps 0"},
    {{.capacity = 100, .eviction = 3},
     EMBPS_INVALID_ARGUMENT,
     "ttl_steps=0 is out of range: ttl eviction needs 1 to 4611686018427387904 push steps without "
     "a push before a key expires"},
    {{.capacity = 100, .sketch_width = 64},
     EMBPS_INVALID_ARGUMENT,
     "sketch_width=64 is given with admit_after=1, which counts nothing: leave sketch_width 0, or "
     "raise admit_after"},
    {{.capacity = 100, .admit_after = 2, .sketch_width = (UINT32_C(1) << 28) + 1},
     EMBPS_INVALID_ARGUMENT,
     "sketch_width=268435457 is out of range: give 1 to 268435456 counters per sketch row, or 0 "
     "for the server's default"},
    /* the budget: 2^22 slots of 4 f32 (64 MiB of rows alone) and the index */
    {{.capacity = UINT64_C(1) << 22}, EMBPS_RESOURCE_EXHAUSTED, NULL},
    /* the kinds' own checks come first: a bad width is still named */
    {{.capacity = 100, .emb_width = 0xFFFFFFFFu},
     EMBPS_INVALID_ARGUMENT,
     "emb_width=4294967295 is out of range: 1 to 65536"},
};

static void test_refusals_create_nothing(void **state) {
  embps_net_call_t c;
  (void)state;
  for (size_t i = 0; i < sizeof(refusals) / sizeof(refusals[0]); i++) {
    const refusal_t *r = &refusals[i];
    create(&c, "kinds", &r->k);
    if (c.status != r->status)
      fail_msg("case %zu: %s (%s), expected %s", i, embps_status_name(c.status),
               c.message ? c.message : "", embps_status_name(r->status));
    if (r->message && strcmp(c.message, r->message) != 0)
      fail_msg("case %zu: message\n  %s\nexpected\n  %s", i, c.message, r->message);
    fake_call_release(&c);
    assert_int_equal(fake.num_queued, 0); /* never ordered: no rank creates anything */
    assert_null(embps_store_find(store, "kinds"));
  }
}

static void test_budget_message(void **state) {
  kind_t k = {.capacity = UINT64_C(1) << 22};
  embps_net_call_t c;
  (void)state;
  create(&c, "kinds", &k);
  assert_int_equal(c.status, EMBPS_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(c.message, "table 'kinds' needs "));
  assert_non_null(strstr(c.message, " bytes per rank (capacity=4194304 emb_width=4 f32, "
                                    "rowwise_adagrad state, and its key index), more than this "
                                    "rank's memory budget of 67108864 (--max-memory-bytes): lower "
                                    "capacity or raise the budget"));
  fake_call_release(&c);
  assert_int_equal(fake.num_queued, 0);
}

/* A valid hash-keyed table is ordered on either backend. */
static void test_hash_served_on_both_backends(void **state) {
  kind_t k = {.capacity = 1000, .admit_after = 4, .eviction = 2, .half_life_steps = 50};
  const embps_backend_t backends[] = {EMBPS_BACKEND_CUDA, EMBPS_BACKEND_CPU};
  const char *names[] = {"kinds_cuda", "kinds_cpu"};
  const embps_table_t *t;
  embps_net_call_t c;
  (void)state;
  for (int i = 0; i < 2; i++) {
    fake.backend = backends[i];
    create(&c, names[i], &k);
    assert_int_equal(c.status, EMBPS_OK);
    fake_call_release(&c);
    assert_non_null(t = embps_store_find(store, names[i]));
    assert_int_equal(embps_table_config(t)->capacity, 1000);
    assert_non_null(embps_table_hindex(t));
  }
  fake.backend = EMBPS_BACKEND_CPU;
}

/* Dense tables are as they were: admit_after 1 ("at once") is what they do, and is stored as 0. */
static void test_dense_still_created(void **state) {
  kind_t k = {.rows = 10, .admit_after = 1};
  const embps_table_t *t;
  embps_net_call_t c;
  (void)state;
  create(&c, "dense", &k);
  assert_int_equal(c.status, EMBPS_OK);
  fake_call_release(&c);
  assert_non_null(t = embps_store_find(store, "dense"));
  assert_int_equal(embps_table_config(t)->rows, 10);
  assert_int_equal(embps_table_config(t)->capacity, 0);
  assert_int_equal(embps_table_config(t)->admit_after, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_refusals_create_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(test_budget_message, setup, teardown),
      cmocka_unit_test_setup_teardown(test_dense_still_created, setup, teardown),
      cmocka_unit_test_setup_teardown(test_hash_served_on_both_backends, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
