/* The field numbers of common/wire_fields.h, which the hand-written wire code of the client and
 * the server uses, against the descriptors protoc-c generates from proto/embps/v1/embps.proto:
 * each row's message is the one named, its field has the number and a type of the wire type the
 * row says, so a field renumbered or retyped in the .proto fails here, not in a user's call. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "common/wire_fields.h"
#include "embps/v1/embps.pb-c.h"

/* The wire type protobuf gives a singular field of this type. */
static int wire_type_of(ProtobufCType type) {
  switch (type) {
  case PROTOBUF_C_TYPE_INT32:
  case PROTOBUF_C_TYPE_SINT32:
  case PROTOBUF_C_TYPE_UINT32:
  case PROTOBUF_C_TYPE_INT64:
  case PROTOBUF_C_TYPE_SINT64:
  case PROTOBUF_C_TYPE_UINT64:
  case PROTOBUF_C_TYPE_BOOL:
  case PROTOBUF_C_TYPE_ENUM:
    return EMBPS_WIRE_VARINT;
  case PROTOBUF_C_TYPE_FIXED64:
  case PROTOBUF_C_TYPE_SFIXED64:
  case PROTOBUF_C_TYPE_DOUBLE:
    return EMBPS_WIRE_I64;
  case PROTOBUF_C_TYPE_STRING:
  case PROTOBUF_C_TYPE_BYTES:
  case PROTOBUF_C_TYPE_MESSAGE:
    return EMBPS_WIRE_LEN;
  default:
    return -1; /* 4-byte fixed-width: no row uses one */
  }
}

typedef struct row {
  const char *name;
  const ProtobufCMessageDescriptor *desc;
  const char *message, *field;
  unsigned number;
  int wire_type;
} row_t;

#define ROW(name, desc, message, field, number, type)                                              \
  {#name, &desc##__descriptor, message, field, number, type},
static const row_t rows[] = {EMBPS_WIRE_FIELDS(ROW)};
#undef ROW

static void test_every_row_matches_the_proto(void **state) {
  (void)state;
  assert_true(sizeof(rows) / sizeof(rows[0]) > 0);
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    const row_t *r = &rows[i];
    const ProtobufCFieldDescriptor *f;
    if (strcmp(r->desc->name, r->message) != 0)
      fail_msg("%s: the descriptor is %s's, not %s's", r->name, r->desc->name, r->message);
    f = protobuf_c_message_descriptor_get_field_by_name(r->desc, r->field);
    if (!f)
      fail_msg("%s: %s has no field %s", r->name, r->message, r->field);
    if (f->id != r->number)
      fail_msg("%s: %s.%s is field %u in the .proto, not %u", r->name, r->message, r->field, f->id,
               r->number);
    /* a repeated field travels as one record per element: the walkers handle that for
     * messages (a feature batch's features, whose tables embps__svc_check_names checks each) */
    if ((f->label == PROTOBUF_C_LABEL_REPEATED && f->type != PROTOBUF_C_TYPE_MESSAGE) ||
        wire_type_of(f->type) != r->wire_type)
      fail_msg("%s: %s.%s does not travel as wire type %d", r->name, r->message, r->field,
               r->wire_type);
  }
}

/* The constants are the rows' numbers (what the walkers use), and a key is number << 3 | type. */
static void test_constants(void **state) {
  (void)state;
  assert_int_equal(EMBPS_WIRE_LOOKUP_RESPONSE_ROWS,
                   protobuf_c_message_descriptor_get_field_by_name(
                       &embps__v1__lookup_response__descriptor, "rows")
                       ->id);
  assert_int_equal(EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_GRADIENTS,
                   protobuf_c_message_descriptor_get_field_by_name(
                       &embps__v1__push_gradients_request__descriptor, "gradients")
                       ->id);
  assert_int_equal(EMBPS_WIRE_KEY(LOOKUP_RESPONSE_ROWS), EMBPS_WIRE_LOOKUP_RESPONSE_ROWS << 3 | 2);
  assert_int_equal(EMBPS_WIRE_KEY(LOOKUP_RESPONSE_BATCH_ID),
                   EMBPS_WIRE_LOOKUP_RESPONSE_BATCH_ID << 3 | 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_row_matches_the_proto),
      cmocka_unit_test(test_constants),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
