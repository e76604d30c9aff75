/* common/table_fields.h against proto/embps/v1/embps.proto: every declared setting is a field of
 * the message the declaration names, of the protobuf type its wire kind carries, and every field
 * of TableSpec and OptimizerConfig (the name and the OptimizerConfig itself apart) is declared, so
 * a setting added to the .proto alone, or renumbered to another type, fails here. And the binary
 * layout's size is the sum of its settings' sizes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/table_fields.h"
#include "embps/v1/embps.pb-c.h"

typedef struct declared {
  const char *field, *message, *pb_field, *wire;
} declared_t;

#define DECLARED(field, type, wire, message, pb_field) {#field, #message, #pb_field, #wire},
static const declared_t declared[] = {EMBPS_TABLE_FIELDS(DECLARED)};
#undef DECLARED
#define NUM_DECLARED (sizeof(declared) / sizeof(declared[0]))

static const ProtobufCMessageDescriptor *message_of(const char *message) {
  if (strcmp(message, "SPEC") == 0)
    return &embps__v1__table_spec__descriptor;
  if (strcmp(message, "OPTIMIZER") == 0)
    return &embps__v1__optimizer_config__descriptor;
  fail_msg("setting in message '%s', neither SPEC nor OPTIMIZER", message);
  return NULL;
}

static ProtobufCType type_of(const char *wire) {
  if (strcmp(wire, "u64") == 0)
    return PROTOBUF_C_TYPE_UINT64;
  if (strcmp(wire, "u32") == 0)
    return PROTOBUF_C_TYPE_UINT32;
  if (strcmp(wire, "e32") == 0)
    return PROTOBUF_C_TYPE_ENUM;
  if (strcmp(wire, "f32") == 0)
    return PROTOBUF_C_TYPE_FLOAT;
  fail_msg("unknown wire kind '%s'", wire);
  return PROTOBUF_C_TYPE_BYTES;
}

static void test_declared_settings_are_in_the_proto(void **state) {
  (void)state;
  for (size_t i = 0; i < NUM_DECLARED; i++) {
    const declared_t *d = &declared[i];
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field_by_name(message_of(d->message), d->pb_field);
    if (!f)
      fail_msg("setting %s: no field '%s' in %s", d->field, d->pb_field, d->message);
    if (f->type != type_of(d->wire))
      fail_msg("setting %s: %s.%s has protobuf type %d, its wire kind %s wants %d", d->field,
               d->message, d->pb_field, (int)f->type, d->wire, (int)type_of(d->wire));
    if (f->label == PROTOBUF_C_LABEL_REPEATED)
      fail_msg("setting %s: %s.%s is repeated", d->field, d->message, d->pb_field);
  }
}

/* Whether msg's field named pb_field is declared (or carried apart: the name, the sub-message). */
static int is_declared(const char *message, const char *pb_field) {
  if (strcmp(message, "SPEC") == 0 && (!strcmp(pb_field, "name") || !strcmp(pb_field, "optimizer")))
    return 1;
  for (size_t i = 0; i < NUM_DECLARED; i++)
    if (!strcmp(declared[i].message, message) && !strcmp(declared[i].pb_field, pb_field))
      return 1;
  return 0;
}

static void test_every_proto_field_is_declared(void **state) {
  static const char *const messages[] = {"SPEC", "OPTIMIZER"};
  size_t fields = 0;
  (void)state;
  for (size_t m = 0; m < 2; m++) {
    const ProtobufCMessageDescriptor *d = message_of(messages[m]);
    for (unsigned i = 0; i < d->n_fields; i++)
      if (!is_declared(messages[m], d->fields[i].name))
        fail_msg("%s.%s (field %u) is not in EMBPS_TABLE_FIELDS", d->name, d->fields[i].name,
                 d->fields[i].id);
    fields += d->n_fields;
  }
  assert_int_equal(fields, NUM_DECLARED + 2); /* each declared once: + name and optimizer */
}

static void test_wire_bytes(void **state) {
  size_t sum = 0;
  (void)state;
  for (size_t i = 0; i < NUM_DECLARED; i++)
    sum += strcmp(declared[i].wire, "u64") == 0 ? 8 : 4;
  assert_int_equal(EMBPS_TABLE_FIELDS_WIRE_BYTES, sum);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_declared_settings_are_in_the_proto),
      cmocka_unit_test(test_every_proto_field_is_declared),
      cmocka_unit_test(test_wire_bytes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
