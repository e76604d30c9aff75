/* The protobuf field numbers that embps's hand-written wire code uses, declared once for the
 * client and the server. Most messages go through protobuf-c, which takes its numbers from the
 * .proto; a few are walked or laid out by hand for speed (the client's batch requests and its
 * streaming LookupResponse parser, the server's LookupResponse header, its table-name checks on
 * a request's own bytes and its in-place read of a push's gradients). Those walkers use these
 * constants, and tests/unit/common/test_wire_fields.c holds every row equal to the descriptors
 * protoc-c generates from proto/embps/v1/embps.proto, so a renumbered field fails the tests. */
#ifndef EMBPS_WIRE_FIELDS_H
#define EMBPS_WIRE_FIELDS_H

#include <stddef.h>
#include <stdint.h>

#include "common/varint.h"

/** Protobuf wire types: a varint scalar (integers, enums, bools), a fixed 8-byte one (fixed64,
 * double) and a length-delimited field (string, bytes, message). */
#define EMBPS_WIRE_VARINT 0
#define EMBPS_WIRE_I64 1
#define EMBPS_WIRE_LEN 2
/** A fixed 4-byte scalar (fixed32, float): no field of embps's uses it, but a walker skips it. */
#define EMBPS_WIRE_I32 5

/** Reads the field whose key starts at p[i] of p[0..n): its key into *key and, for a varint, its
 * value into *v, for a length-delimited field its length (its bytes follow what is returned).
 * Returns the bytes of the key and the value, but of a length-delimited field only those of its
 * length; 0 when they do not parse, run past n, or the wire type is none of the four above. The
 * one walker of hand-read messages, client and server alike. */
static inline size_t embps_wire_next_field(const uint8_t *p, size_t n, size_t i, uint64_t *key,
                                           uint64_t *v) {
  size_t k = embps_varint_get(p + i, n - i, key), m;
  if (!k)
    return 0;
  i += k;
  switch (*key & 7) {
  case EMBPS_WIRE_VARINT:
    m = embps_varint_get(p + i, n - i, v);
    break;
  case EMBPS_WIRE_I64:
    m = n - i >= 8 ? 8 : 0;
    break;
  case EMBPS_WIRE_I32:
    m = n - i >= 4 ? 4 : 0;
    break;
  case EMBPS_WIRE_LEN:
    if ((m = embps_varint_get(p + i, n - i, v)) == 0 || *v > n - i - m)
      m = 0;
    break;
  default:
    m = 0;
  }
  return m ? k + m : 0;
}

/**
 * X(NAME, descriptor, message, field, number, wire_type): one row per field that hand-written
 * code reads or writes.
 *  - NAME: the suffix of its constants (EMBPS_WIRE_NAME, the number; EMBPS_WIRE_TYPE_NAME).
 *  - descriptor: the protobuf-c prefix of the message's C names (the test reaches
 *    descriptor##__descriptor); nothing else expands it.
 *  - message, field: the message's full name and the field's name as the .proto spells them.
 *  - number: the field number; wire_type: EMBPS_WIRE_VARINT, EMBPS_WIRE_I64 or EMBPS_WIRE_LEN.
 */
#define EMBPS_WIRE_FIELDS(X)                                                                       \
  X(LOOKUP_REQUEST_TABLE, embps__v1__lookup_request, "embps.v1.LookupRequest", "table", 1,         \
    EMBPS_WIRE_LEN)                                                                                \
  X(LOOKUP_REQUEST_BATCH_ID, embps__v1__lookup_request, "embps.v1.LookupRequest", "batch_id", 2,   \
    EMBPS_WIRE_VARINT)                                                                             \
  X(LOOKUP_REQUEST_SHARD_INDEX, embps__v1__lookup_request, "embps.v1.LookupRequest",               \
    "shard_index", 3, EMBPS_WIRE_VARINT)                                                           \
  X(LOOKUP_REQUEST_SHARD_COUNT, embps__v1__lookup_request, "embps.v1.LookupRequest",               \
    "shard_count", 4, EMBPS_WIRE_VARINT)                                                           \
  X(LOOKUP_REQUEST_TOKENS_PER_BATCH, embps__v1__lookup_request, "embps.v1.LookupRequest",          \
    "tokens_per_batch", 5, EMBPS_WIRE_VARINT)                                                      \
  X(LOOKUP_REQUEST_TOKENS, embps__v1__lookup_request, "embps.v1.LookupRequest", "tokens", 6,       \
    EMBPS_WIRE_LEN)                                                                                \
  X(LOOKUP_REQUEST_DTYPE, embps__v1__lookup_request, "embps.v1.LookupRequest", "dtype", 7,         \
    EMBPS_WIRE_VARINT)                                                                             \
  X(LOOKUP_REQUEST_CLIENT_ID, embps__v1__lookup_request, "embps.v1.LookupRequest", "client_id", 8, \
    EMBPS_WIRE_VARINT)                                                                             \
  X(LOOKUP_REQUEST_DIGEST, embps__v1__lookup_request, "embps.v1.LookupRequest", "digest", 9,       \
    EMBPS_WIRE_I64)                                                                                \
  X(LOOKUP_REQUEST_ATTEMPT, embps__v1__lookup_request, "embps.v1.LookupRequest", "attempt", 10,    \
    EMBPS_WIRE_VARINT)                                                                             \
  X(PUSH_GRADIENTS_REQUEST_TABLE, embps__v1__push_gradients_request,                               \
    "embps.v1.PushGradientsRequest", "table", 1, EMBPS_WIRE_LEN)                                   \
  X(PUSH_GRADIENTS_REQUEST_BATCH_ID, embps__v1__push_gradients_request,                            \
    "embps.v1.PushGradientsRequest", "batch_id", 2, EMBPS_WIRE_VARINT)                             \
  X(PUSH_GRADIENTS_REQUEST_SHARD_INDEX, embps__v1__push_gradients_request,                         \
    "embps.v1.PushGradientsRequest", "shard_index", 3, EMBPS_WIRE_VARINT)                          \
  X(PUSH_GRADIENTS_REQUEST_SHARD_COUNT, embps__v1__push_gradients_request,                         \
    "embps.v1.PushGradientsRequest", "shard_count", 4, EMBPS_WIRE_VARINT)                          \
  X(PUSH_GRADIENTS_REQUEST_TOKENS_PER_BATCH, embps__v1__push_gradients_request,                    \
    "embps.v1.PushGradientsRequest", "tokens_per_batch", 5, EMBPS_WIRE_VARINT)                     \
  X(PUSH_GRADIENTS_REQUEST_TOKENS, embps__v1__push_gradients_request,                              \
    "embps.v1.PushGradientsRequest", "tokens", 6, EMBPS_WIRE_LEN)                                  \
  X(PUSH_GRADIENTS_REQUEST_DTYPE, embps__v1__push_gradients_request,                               \
    "embps.v1.PushGradientsRequest", "dtype", 7, EMBPS_WIRE_VARINT)                                \
  X(PUSH_GRADIENTS_REQUEST_GRADIENTS, embps__v1__push_gradients_request,                           \
    "embps.v1.PushGradientsRequest", "gradients", 8, EMBPS_WIRE_LEN)                               \
  X(PUSH_GRADIENTS_REQUEST_MODE, embps__v1__push_gradients_request,                                \
    "embps.v1.PushGradientsRequest", "mode", 9, EMBPS_WIRE_VARINT)                                 \
  X(PUSH_GRADIENTS_REQUEST_CLIENT_ID, embps__v1__push_gradients_request,                           \
    "embps.v1.PushGradientsRequest", "client_id", 10, EMBPS_WIRE_VARINT)                           \
  X(PUSH_GRADIENTS_REQUEST_DIGEST, embps__v1__push_gradients_request,                              \
    "embps.v1.PushGradientsRequest", "digest", 11, EMBPS_WIRE_I64)                                 \
  X(PUSH_GRADIENTS_REQUEST_ATTEMPT, embps__v1__push_gradients_request,                             \
    "embps.v1.PushGradientsRequest", "attempt", 12, EMBPS_WIRE_VARINT)                             \
  X(ASSIGN_REQUEST_TABLE, embps__v1__assign_request, "embps.v1.AssignRequest", "table", 1,         \
    EMBPS_WIRE_LEN)                                                                                \
  X(ASSIGN_REQUEST_TOKENS, embps__v1__assign_request, "embps.v1.AssignRequest", "tokens", 6,       \
    EMBPS_WIRE_LEN)                                                                                \
  X(ASSIGN_REQUEST_DTYPE, embps__v1__assign_request, "embps.v1.AssignRequest", "dtype", 7,         \
    EMBPS_WIRE_VARINT)                                                                             \
  X(ASSIGN_REQUEST_ROWS, embps__v1__assign_request, "embps.v1.AssignRequest", "rows", 8,           \
    EMBPS_WIRE_LEN)                                                                                \
  X(ASSIGN_REQUEST_RESET_STATE, embps__v1__assign_request, "embps.v1.AssignRequest",               \
    "reset_state", 9, EMBPS_WIRE_VARINT)                                                           \
  X(ASSIGN_REQUEST_CLIENT_ID, embps__v1__assign_request, "embps.v1.AssignRequest", "client_id",    \
    10, EMBPS_WIRE_VARINT)                                                                         \
  X(ASSIGN_REQUEST_DIGEST, embps__v1__assign_request, "embps.v1.AssignRequest", "digest", 11,      \
    EMBPS_WIRE_I64)                                                                                \
  X(ASSIGN_REQUEST_ATTEMPT, embps__v1__assign_request, "embps.v1.AssignRequest", "attempt", 12,    \
    EMBPS_WIRE_VARINT)                                                                             \
  X(PUSH_GRADIENTS_RESPONSE_REPLAYED, embps__v1__push_gradients_response,                          \
    "embps.v1.PushGradientsResponse", "replayed", 8, EMBPS_WIRE_VARINT)                            \
  X(LOOKUP_RESPONSE_BATCH_ID, embps__v1__lookup_response, "embps.v1.LookupResponse", "batch_id",   \
    1, EMBPS_WIRE_VARINT)                                                                          \
  X(LOOKUP_RESPONSE_SHARD_INDEX, embps__v1__lookup_response, "embps.v1.LookupResponse",            \
    "shard_index", 2, EMBPS_WIRE_VARINT)                                                           \
  X(LOOKUP_RESPONSE_EMB_WIDTH, embps__v1__lookup_response, "embps.v1.LookupResponse", "emb_width", \
    3, EMBPS_WIRE_VARINT)                                                                          \
  X(LOOKUP_RESPONSE_DTYPE, embps__v1__lookup_response, "embps.v1.LookupResponse", "dtype", 4,      \
    EMBPS_WIRE_VARINT)                                                                             \
  X(LOOKUP_RESPONSE_ROWS, embps__v1__lookup_response, "embps.v1.LookupResponse", "rows", 5,        \
    EMBPS_WIRE_LEN)                                                                                \
  X(CREATE_TABLE_REQUEST_SPEC, embps__v1__create_table_request, "embps.v1.CreateTableRequest",     \
    "spec", 1, EMBPS_WIRE_LEN)                                                                     \
  X(TABLE_SPEC_NAME, embps__v1__table_spec, "embps.v1.TableSpec", "name", 1, EMBPS_WIRE_LEN)       \
  X(DROP_TABLE_REQUEST_NAME, embps__v1__drop_table_request, "embps.v1.DropTableRequest", "name",   \
    1, EMBPS_WIRE_LEN)                                                                             \
  X(CHECKPOINT_REQUEST_TABLE, embps__v1__checkpoint_request, "embps.v1.CheckpointRequest",         \
    "table", 1, EMBPS_WIRE_LEN)                                                                    \
  X(LOOKUP_FEATURES_REQUEST_FEATURES, embps__v1__lookup_features_request,                          \
    "embps.v1.LookupFeaturesRequest", "features", 5, EMBPS_WIRE_LEN)                               \
  X(PUSH_FEATURES_REQUEST_FEATURES, embps__v1__push_features_request,                              \
    "embps.v1.PushFeaturesRequest", "features", 5, EMBPS_WIRE_LEN)                                 \
  X(FEATURE_SHARD_TABLE, embps__v1__feature_shard, "embps.v1.FeatureShard", "table", 2,            \
    EMBPS_WIRE_LEN)                                                                                \
  X(FEATURE_SHARD_IDS, embps__v1__feature_shard, "embps.v1.FeatureShard", "ids", 4,                \
    EMBPS_WIRE_LEN)                                                                                \
  X(FEATURE_SHARD_LENGTHS, embps__v1__feature_shard, "embps.v1.FeatureShard", "lengths", 5,        \
    EMBPS_WIRE_LEN)                                                                                \
  X(FEATURE_SHARD_WEIGHTS, embps__v1__feature_shard, "embps.v1.FeatureShard", "weights", 6,        \
    EMBPS_WIRE_LEN)                                                                                \
  X(FEATURE_SHARD_GRADIENTS, embps__v1__feature_shard, "embps.v1.FeatureShard", "gradients", 7,    \
    EMBPS_WIRE_LEN)                                                                                \
  X(LOOKUP_FEATURES_RESPONSE_BATCH_ID, embps__v1__lookup_features_response,                        \
    "embps.v1.LookupFeaturesResponse", "batch_id", 1, EMBPS_WIRE_VARINT)                           \
  X(LOOKUP_FEATURES_RESPONSE_SHARD_INDEX, embps__v1__lookup_features_response,                     \
    "embps.v1.LookupFeaturesResponse", "shard_index", 2, EMBPS_WIRE_VARINT)                        \
  X(LOOKUP_FEATURES_RESPONSE_FEATURES, embps__v1__lookup_features_response,                        \
    "embps.v1.LookupFeaturesResponse", "features", 3, EMBPS_WIRE_LEN)                              \
  X(FEATURE_ROWS_NAME, embps__v1__feature_rows, "embps.v1.FeatureRows", "name", 1, EMBPS_WIRE_LEN) \
  X(FEATURE_ROWS_EMB_WIDTH, embps__v1__feature_rows, "embps.v1.FeatureRows", "emb_width", 2,       \
    EMBPS_WIRE_VARINT)                                                                             \
  X(FEATURE_ROWS_DTYPE, embps__v1__feature_rows, "embps.v1.FeatureRows", "dtype", 3,               \
    EMBPS_WIRE_VARINT)                                                                             \
  X(FEATURE_ROWS_ROWS, embps__v1__feature_rows, "embps.v1.FeatureRows", "rows", 4, EMBPS_WIRE_LEN)

/** EMBPS_WIRE_<NAME>: each row's field number; EMBPS_WIRE_TYPE_<NAME>: its wire type. */
#define EMBPS__WIRE_NUMBER(name, desc, msg, field, number, type) EMBPS_WIRE_##name = (number),
#define EMBPS__WIRE_TYPE(name, desc, msg, field, number, type) EMBPS_WIRE_TYPE_##name = (type),
enum { EMBPS_WIRE_FIELDS(EMBPS__WIRE_NUMBER) };
enum { EMBPS_WIRE_FIELDS(EMBPS__WIRE_TYPE) };

/** The key that opens field NAME on the wire (number << 3 | wire type), a constant expression. */
#define EMBPS_WIRE_KEY(name) ((EMBPS_WIRE_##name << 3) | EMBPS_WIRE_TYPE_##name)

#endif
