/* client/admin.c: a table's specification to and from its protobuf TableSpec, through protobuf's
 * bytes, with every setting a value no other has, so a setting the client forgets or crosses
 * fails by name; and the defaults it fills in when the reply leaves them out. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "tests/unit/common/table_fields_fixture.h"

TABLE_FIELDS_FIXTURE(spec, embps_table_spec_t)

/* Packs ts and unpacks it again: what the other end would see. */
static Embps__V1__TableSpec *through_bytes(const Embps__V1__TableSpec *ts) {
  uint8_t buf[512];
  size_t len = protobuf_c_message_get_packed_size(&ts->base);
  assert_true(len <= sizeof(buf));
  protobuf_c_message_pack(&ts->base, buf);
  return embps__v1__table_spec__unpack(NULL, len, buf);
}

static void test_spec_round_trip(void **state) {
  Embps__V1__TableSpec ts = EMBPS__V1__TABLE_SPEC__INIT, *back;
  Embps__V1__OptimizerConfig oc = EMBPS__V1__OPTIMIZER_CONFIG__INIT;
  embps_table_spec_t spec, got;
  (void)state;
  memset(&spec, 0, sizeof(spec));
  spec.name = "settings";
  spec_fill(&spec);
  embps__table_spec_to_pb(&spec, &ts, &oc);
  assert_string_equal(ts.name, "settings");
  assert_true(ts.optimizer == &oc);
  back = through_bytes(&ts);
  assert_non_null(back);
  memset(&got, 0, sizeof(got));
  assert_int_equal(embps__table_spec_from_pb(back, &got), 0);
  assert_string_equal(got.name, "settings");
  assert_true(got.name != back->name); /* a copy, owned by got */
  spec_assert_same(&got, &spec);
  embps_free((char *)got.name);
  embps__v1__table_spec__free_unpacked(back, NULL);
}

/* A reply without a dtype means f32; without an OptimizerConfig, its settings stay as they
 * were (zero in a fresh spec: the server's defaults). */
static void test_spec_defaults(void **state) {
  Embps__V1__TableSpec ts = EMBPS__V1__TABLE_SPEC__INIT;
  embps_table_spec_t got;
  (void)state;
  ts.rows = 7;
  memset(&got, 0, sizeof(got));
  assert_int_equal(embps__table_spec_from_pb(&ts, &got), 0);
  assert_string_equal(got.name, "");
  assert_int_equal(got.rows, 7);
  assert_int_equal(got.dtype, EMBPS_DTYPE_F32);
  assert_int_equal(got.optimizer, EMBPS_OPTIMIZER_DEFAULT);
  assert_true(got.lr == 0.0f && got.beta2 == 0.0f);
  embps_free((char *)got.name);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_spec_round_trip),
      cmocka_unit_test(test_spec_defaults),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
