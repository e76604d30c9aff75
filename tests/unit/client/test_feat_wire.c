/* client/feat_wire.c: a feature request laid out as segments is, joined, the gRPC prefix and the
 * bytes protobuf_c_message_pack writes, for LookupFeaturesRequest and PushFeaturesRequest with
 * random scalars (zeros, which protobuf leaves out, and varints of every length), names, tables,
 * poolings and bulk fields (empty ones included); the bulk fields are sent from where they are,
 * not copied; a wire is reused from one encoding to the next. And a LookupFeaturesResponse read in
 * place (embps__feat_lookup_reply) gives what protobuf-c decodes, on random replies and on those
 * replies with bytes changed at random (accepted and rejected alike). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "client/client_internal.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) { /* splitmix64 */
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* 0, or a value of a random number of bits (every varint length). */
static uint64_t scalar(void) {
  if (next() % 4 == 0)
    return 0;
  uint64_t v = next(); /* two statements: the operands of >> are unsequenced */
  return v >> (next() % 64);
}

#define MAXF 12
static uint8_t pool[1 << 20];

/* A random bulk field of at most max bytes from pool (empty one time in four). */
static ProtobufCBinaryData bulk(size_t max) {
  ProtobufCBinaryData d = {0, NULL};
  if (next() % 4) {
    d.len = 1 + next() % max;
    d.data = pool + next() % (sizeof(pool) - d.len);
  }
  return d;
}

/* The joined segments against protobuf-c's packing, and every non-empty bulk field sent from
 * where it is. */
static void check(ProtobufCMessage *m, size_t *n_features, Embps__V1__FeatureShard **fs,
                  embps__feat_wire_t *w) {
  uint64_t total = 0, at = 0;
  size_t size = protobuf_c_message_get_packed_size(m), nf = *n_features;
  uint8_t *want = malloc(size + 5), *got = malloc(size + 5);
  assert_non_null(want);
  assert_non_null(got);
  want[0] = 0;
  want[1] = (uint8_t)(size >> 24);
  want[2] = (uint8_t)(size >> 16);
  want[3] = (uint8_t)(size >> 8);
  want[4] = (uint8_t)size;
  protobuf_c_message_pack(m, want + 5);
  assert_int_equal(embps__feat_encode(m, n_features, fs, w, &total), EMBPS_OK);
  assert_int_equal(*n_features, nf);
  assert_int_equal(total, size + 5);
  for (int i = 0; i < w->nsegs; i++) {
    assert_non_null(w->segs[i].p);
    assert_true(at + w->segs[i].len <= total);
    memcpy(got + at, w->segs[i].p, w->segs[i].len);
    at += w->segs[i].len;
  }
  assert_int_equal(at, total);
  assert_memory_equal(got, want, total);
  for (size_t f = 0; f < nf; f++) {
    const ProtobufCBinaryData *b[4] = {&fs[f]->ids, &fs[f]->lengths, &fs[f]->weights,
                                       &fs[f]->gradients};
    for (int k = 0; k < 4; k++) {
      int found = 0;
      for (int i = 0; b[k]->len && i < w->nsegs; i++)
        found |= w->segs[i].p == b[k]->data && w->segs[i].len == b[k]->len;
      assert_true(b[k]->len == 0 || found);
    }
  }
  free(want);
  free(got);
}

static void test_random_requests(void **state) {
  (void)state;
  static char names[MAXF][40], tables[MAXF][40];
  Embps__V1__FeatureShard shards[MAXF], *ptrs[MAXF];
  embps__feat_wire_t w;
  memset(&w, 0, sizeof(w));
  for (size_t i = 0; i < sizeof(pool); i++)
    pool[i] = (uint8_t)next();
  for (int iter = 0; iter < 400; iter++) {
    Embps__V1__LookupFeaturesRequest lr = EMBPS__V1__LOOKUP_FEATURES_REQUEST__INIT;
    Embps__V1__PushFeaturesRequest pr = EMBPS__V1__PUSH_FEATURES_REQUEST__INIT;
    const int push = iter % 2;
    const size_t nf = next() % (MAXF + 1);
    for (size_t f = 0; f < nf; f++) {
      Embps__V1__FeatureShard *s = &shards[f];
      embps__v1__feature_shard__init(s);
      snprintf(names[f], sizeof(names[f]), "%.*s", (int)(next() % 30),
               "feature_name_of_some_length_x");
      snprintf(tables[f], sizeof(tables[f]), "t%llu", (unsigned long long)(next() % 1000));
      s->name = names[f];
      s->table = tables[f];
      s->pooling = (Embps__V1__Pooling)(next() % 4);
      /* up to 300 bytes: lengths of 1 and 2 varint bytes; one in eight much larger */
      s->ids = bulk(next() % 8 ? 300 : 200000);
      s->lengths = bulk(300);
      s->weights = bulk(300);
      if (push)
        s->gradients = bulk(next() % 8 ? 300 : 400000);
      ptrs[f] = s;
    }
    if (push) {
      pr.batch_id = scalar();
      pr.shard_index = (uint32_t)scalar();
      pr.shard_count = (uint32_t)scalar();
      pr.batch_size = (uint32_t)scalar();
      pr.n_features = nf;
      pr.features = ptrs;
      pr.client_id = scalar();
      pr.digest = scalar();
      pr.attempt = (uint32_t)scalar();
      pr.mode = (Embps__V1__UpdateMode)(next() % 2);
      check(&pr.base, &pr.n_features, ptrs, &w);
    } else {
      lr.batch_id = scalar();
      lr.shard_index = (uint32_t)scalar();
      lr.shard_count = (uint32_t)scalar();
      lr.batch_size = (uint32_t)scalar();
      lr.n_features = nf;
      lr.features = ptrs;
      lr.client_id = scalar();
      lr.digest = scalar();
      lr.attempt = (uint32_t)scalar();
      check(&lr.base, &lr.n_features, ptrs, &w);
    }
  }
  embps__feat_wire_free(&w);
  embps__feat_wire_free(NULL);
}

/* embps__feat_lookup_reply against protobuf-c's decoding of the same bytes. */
static void check_reply(const uint8_t *b, size_t n) {
  embps__feat_rows_t rows[MAXF + 1];
  uint64_t batch_id;
  uint32_t shard_index;
  size_t count;
  Embps__V1__LookupFeaturesResponse *m = embps__v1__lookup_features_response__unpack(NULL, n, b);
  int ok = embps__feat_lookup_reply(b, n, &batch_id, &shard_index, rows, MAXF + 1, &count);
  assert_int_equal(ok, m != NULL);
  if (!m)
    return;
  assert_int_equal(batch_id, m->batch_id);
  assert_int_equal(shard_index, m->shard_index);
  assert_int_equal(count, m->n_features);
  for (size_t f = 0; f < count && f <= MAXF; f++) {
    const Embps__V1__FeatureRows *fr = m->features[f];
    /* protobuf-c copies a string's bytes and ends them with a NUL, so a name with a NUL inside
     * (a corrupted byte) reads shorter through strlen: compare the bytes and the terminator. */
    assert_memory_equal(rows[f].name, fr->name, rows[f].name_len);
    assert_int_equal(fr->name[rows[f].name_len], '\0');
    assert_int_equal(rows[f].emb_width, fr->emb_width);
    assert_int_equal(rows[f].dtype, (int)fr->dtype);
    assert_int_equal(rows[f].rows_len, fr->rows.len);
    if (fr->rows.len)
      assert_memory_equal(rows[f].rows, fr->rows.data, fr->rows.len);
  }
  embps__v1__lookup_features_response__free_unpacked(m, NULL);
}

static void test_lookup_replies(void **state) {
  (void)state;
  static char names[MAXF][40];
  Embps__V1__FeatureRows frs[MAXF], *ptrs[MAXF];
  for (size_t i = 0; i < sizeof(pool); i++)
    pool[i] = (uint8_t)next();
  for (int iter = 0; iter < 300; iter++) {
    Embps__V1__LookupFeaturesResponse m = EMBPS__V1__LOOKUP_FEATURES_RESPONSE__INIT;
    const size_t nf = next() % (MAXF + 1);
    size_t n;
    uint8_t *b;
    for (size_t f = 0; f < nf; f++) {
      embps__v1__feature_rows__init(&frs[f]);
      snprintf(names[f], sizeof(names[f]), "%.*s", (int)(next() % 30),
               "feature_name_of_some_length_x");
      frs[f].name = names[f];
      frs[f].emb_width = (uint32_t)scalar();
      frs[f].dtype = (Embps__V1__DType)(next() % 3);
      frs[f].rows = bulk(next() % 8 ? 300 : 100000);
      ptrs[f] = &frs[f];
    }
    m.batch_id = scalar();
    m.shard_index = (uint32_t)scalar();
    m.n_features = nf;
    m.features = ptrs;
    n = embps__v1__lookup_features_response__get_packed_size(&m);
    b = malloc(n + 16);
    assert_non_null(b);
    embps__v1__lookup_features_response__pack(&m, b);
    check_reply(b, n);
    /* a field neither knows (number 15, varint), skipped by both */
    b[n] = 15 << 3;
    b[n + 1] = 7;
    check_reply(b, n + 2);
    for (int k = 0; k < 8 && n; k++) { /* a byte changed, or the reply cut short */
      size_t at = next() % n;
      uint8_t was = b[at];
      b[at] = (uint8_t)next();
      check_reply(b, n);
      b[at] = was;
      check_reply(b, next() % n);
    }
    free(b);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_requests),
      cmocka_unit_test(test_lookup_replies),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
