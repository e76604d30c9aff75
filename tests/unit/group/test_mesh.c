/* Mesh validation: defaults, the four messages of DESIGN.md's table word for word, malformed
 * input, and canonical formatting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "server/group/mesh.h"

static void expect_error(const char *mesh, const char *ta, const char *da, uint32_t n,
                         const char *fragment) {
  embps_mesh_t m;
  embps_error_t err;
  embps_error_clear(&err);
  assert_int_equal(embps_mesh_parse(&m, mesh, ta, da, n, &err), EMBPS_INVALID_ARGUMENT);
  if (!strstr(err.message, fragment))
    fail_msg("message '%s' lacks '%s'", err.message, fragment);
}

static void test_defaults(void **state) {
  embps_mesh_t m;
  embps_error_t err;
  char text[64];
  (void)state;
  assert_int_equal(embps_mesh_parse(&m, "", "", "", 4, &err), EMBPS_OK);
  assert_int_equal(m.num_axes, 1);
  assert_string_equal(m.names[0], "shard");
  assert_int_equal(m.sizes[0], 4);
  assert_int_equal(embps_mesh_communicator_size(&m), 4);
  embps_mesh_format(&m, text, sizeof(text));
  assert_string_equal(text, "shard=4");
  assert_int_equal(embps_mesh_parse(&m, "shard=4", "shard", "shard", 4, &err), EMBPS_OK);
  assert_int_equal(embps_mesh_parse(&m, "a=2,b=2", "a,b", "b,a", 4, &err), EMBPS_OK);
  assert_int_equal(embps_mesh_communicator_size(&m), 4);
  embps_mesh_format_axes(&m, 1, text, sizeof(text));
  assert_string_equal(text, "b,a");
}

static void test_design_messages(void **state) {
  (void)state;
  expect_error("shard=4", "model", "shard", 4, "axis 'model' is not a mesh axis of (shard=4)");
  expect_error("shard=4", "shard", "tokens", 4, "axis 'tokens' is not a mesh axis of (shard=4)");
  expect_error("batch=2,shard=2", "batch,shard", "shard", 4,
               "requires token shards to vary across the communicator: table_axis (batch) "
               "missing from data_axis (shard)");
  expect_error("batch=8,replica=2", "replica", "batch,replica", 16,
               "requires exactly one token shard per communicator rank: data_axis "
               "(batch,replica) shards tokens over 8 positions outside table_axis (replica)");
}

static void test_malformed(void **state) {
  (void)state;
  expect_error("shard", "", "", 4, "is not a list of axis=size");
  expect_error("shard=0", "", "", 4, "axis sizes must be whole numbers");
  expect_error("shard=4x", "", "", 4, "axis sizes must be whole numbers");
  expect_error("shard=2,shard=2", "", "", 4, "names axis 'shard' twice");
  expect_error("shard=2", "", "", 4, "has 2 positions but --peers lists 4 ranks");
  expect_error("shard=4", "shard,shard", "shard", 4, "names axis 'shard' twice");
  expect_error("shard=4", "sh ard", "shard", 4, "is not a list of axis names");
  expect_error("batch=2,shard=2", "shard", "shard", 4, "would replicate every table");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_design_messages),
      cmocka_unit_test(test_malformed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
