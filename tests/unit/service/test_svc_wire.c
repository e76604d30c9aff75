/* The feature batches' wire shortcuts (server/service/svc_wire.c) against protobuf-c itself:
 * a PushFeaturesRequest stripped of its features' gradients unpacks to the same request without
 * them, with each feature's gradients found in place (a feature without any, too), and a
 * request the strip cannot take (a feature holding gradients twice, bytes that do not parse) is
 * left to the full unpack; a LookupFeaturesResponse laid out by the header writers unpacks to
 * the fields and rows written (batch_id and shard_index 0 or not, an empty name, empty rows). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire_fields.h"
#include "server/service/service_internal.h"

static uint8_t *pack_push(Embps__V1__FeatureShard **fs, size_t n, size_t *len) {
  Embps__V1__PushFeaturesRequest req = EMBPS__V1__PUSH_FEATURES_REQUEST__INIT;
  uint8_t *buf;
  req.batch_id = 77;
  req.shard_index = 1;
  req.shard_count = 2;
  req.batch_size = 8;
  req.client_id = 5;
  req.digest = 0x1234567890ULL;
  req.n_features = n;
  req.features = fs;
  *len = embps__v1__push_features_request__get_packed_size(&req);
  buf = malloc(*len + 1);
  assert_non_null(buf);
  assert_int_equal(embps__v1__push_features_request__pack(&req, buf), *len);
  return buf;
}

static void test_strip_push_gradients(void **state) {
  static uint8_t g0[300], g2[70000], ids[64];
  Embps__V1__FeatureShard f[3], *fs[3];
  ProtobufCBinaryData *bulk = NULL;
  size_t len, count = 0, rest_len = 0;
  (void)state;
  for (size_t i = 0; i < sizeof(g0); i++)
    g0[i] = (uint8_t)(i * 7);
  for (size_t i = 0; i < sizeof(g2); i++)
    g2[i] = (uint8_t)(i * 13 + 1);
  for (int k = 0; k < 3; k++) {
    embps__v1__feature_shard__init(&f[k]);
    f[k].name = k == 0 ? "a" : k == 1 ? "bb" : "ccc";
    f[k].table = "t";
    f[k].pooling = (Embps__V1__Pooling)(k + 1);
    f[k].ids.data = ids;
    f[k].ids.len = 8 * (size_t)(k + 1);
    fs[k] = &f[k];
  }
  f[0].gradients = (ProtobufCBinaryData){sizeof(g0), g0};
  f[2].gradients = (ProtobufCBinaryData){sizeof(g2), g2}; /* a length of 3 varint bytes */
  uint8_t *msg = pack_push(fs, 3, &len);
  uint8_t *rest =
      embps__svc_strip_nested_bytes(msg, len, EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
                                    EMBPS_WIRE_FEATURE_SHARD_GRADIENTS, &bulk, &count, &rest_len);
  assert_non_null(rest);
  assert_int_equal(count, 3);
  assert_true(rest_len + sizeof(g0) + sizeof(g2) < len);
  assert_int_equal(bulk[0].len, sizeof(g0));
  assert_memory_equal(bulk[0].data, g0, sizeof(g0));
  assert_true(bulk[0].data > msg && bulk[0].data < msg + len); /* in place */
  assert_null(bulk[1].data);
  assert_int_equal(bulk[1].len, 0);
  assert_int_equal(bulk[2].len, sizeof(g2));
  assert_memory_equal(bulk[2].data, g2, sizeof(g2));
  Embps__V1__PushFeaturesRequest *got =
      embps__v1__push_features_request__unpack(NULL, rest_len, rest);
  assert_non_null(got);
  assert_int_equal(got->batch_id, 77);
  assert_int_equal(got->digest, 0x1234567890ULL);
  assert_int_equal(got->n_features, 3);
  for (int k = 0; k < 3; k++) {
    assert_string_equal(got->features[k]->name, f[k].name);
    assert_int_equal(got->features[k]->pooling, f[k].pooling);
    assert_int_equal(got->features[k]->ids.len, f[k].ids.len);
    assert_int_equal(got->features[k]->gradients.len, 0);
  }
  embps__v1__push_features_request__free_unpacked(got, NULL);
  free(rest);
  free(bulk);

  /* A message cut short (its last field's bytes missing) does not parse: nothing is returned. */
  bulk = NULL;
  assert_null(embps__svc_strip_nested_bytes(msg, len - 1, EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
                                            EMBPS_WIRE_FEATURE_SHARD_GRADIENTS, &bulk, &count,
                                            &rest_len));
  assert_null(bulk);
  free(msg);

  /* A feature holding gradients twice (protobuf keeps the last): left to the full unpack. */
  uint8_t twice[] = {EMBPS_WIRE_KEY(PUSH_FEATURES_REQUEST_FEATURES),
                     8,
                     EMBPS_WIRE_KEY(FEATURE_SHARD_GRADIENTS),
                     2,
                     1,
                     2,
                     EMBPS_WIRE_KEY(FEATURE_SHARD_GRADIENTS),
                     2,
                     3,
                     4};
  assert_null(
      embps__svc_strip_nested_bytes(twice, sizeof(twice), EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
                                    EMBPS_WIRE_FEATURE_SHARD_GRADIENTS, &bulk, &count, &rest_len));
}

static void check_reply(uint64_t batch_id, uint32_t shard_index) {
  const char *names[] = {"user_id", "", "x"};
  const size_t rows_len[] = {512, 0, 200000};
  const int dtypes[] = {1, 2, 1};
  size_t len = embps__svc_put_features_head(NULL, batch_id, shard_index), at;
  for (int k = 0; k < 3; k++)
    len += embps__svc_put_feature_rows_header(NULL, names[k], 128, dtypes[k], rows_len[k]) +
           rows_len[k];
  uint8_t *buf = malloc(len + 1);
  assert_non_null(buf);
  at = embps__svc_put_features_head(buf, batch_id, shard_index);
  for (int k = 0; k < 3; k++) {
    at += embps__svc_put_feature_rows_header(buf + at, names[k], 128, dtypes[k], rows_len[k]);
    for (size_t i = 0; i < rows_len[k]; i++)
      buf[at + i] = (uint8_t)(i * 31 + (size_t)k);
    at += rows_len[k];
  }
  assert_int_equal(at, len);
  Embps__V1__LookupFeaturesResponse *r =
      embps__v1__lookup_features_response__unpack(NULL, len, buf);
  assert_non_null(r);
  assert_int_equal(r->batch_id, batch_id);
  assert_int_equal(r->shard_index, shard_index);
  assert_int_equal(r->n_features, 3);
  for (int k = 0; k < 3; k++) {
    assert_string_equal(r->features[k]->name, names[k]);
    assert_int_equal(r->features[k]->emb_width, 128);
    assert_int_equal(r->features[k]->dtype, dtypes[k]);
    assert_int_equal(r->features[k]->rows.len, rows_len[k]);
    for (size_t i = 0; i < rows_len[k]; i++)
      if (r->features[k]->rows.data[i] != (uint8_t)(i * 31 + (size_t)k))
        fail_msg("feature %d: row byte %zu differs", k, i);
  }
  embps__v1__lookup_features_response__free_unpacked(r, NULL);
  free(buf);
}

static void test_features_reply_layout(void **state) {
  (void)state;
  check_reply(0, 0);
  check_reply(UINT64_C(0xfedcba9876543210), 3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_strip_push_gradients),
      cmocka_unit_test(test_features_reply_layout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
