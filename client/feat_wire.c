/* A feature request's bytes as segments (docs/design.md, "Feature batches"): the bytes
 * protobuf_c_message_pack writes for a LookupFeaturesRequest or PushFeaturesRequest, gRPC prefix
 * first, without copying the bulk fields. Each FeatureShard's ids, lengths, weights and gradients
 * are sent from where they are (the caller's arrays, or the padded copies), and only the small
 * bytes between them (the request's scalars, each shard's name, table and pooling, and the keys
 * and lengths of the bulk fields) are written to a buffer of their own.
 *
 * Packing the whole request copied every id and gradient once: 29 MB a step for 2048 samples of
 * the DLRM-DCNv2 feature set at 128 f32, which was 43% of the bench client's CPU (perf, one
 * rank), page faults of the fresh buffer included.
 *
 * The small bytes still come from protobuf-c, so their encoding is its own: the request packed
 * with no features gives the scalars, split where the features' field number falls (protobuf-c
 * writes fields in field-number order), and each shard packed with its bulk fields empty gives
 * its small fields, which all precede the bulk ones (ids = 4 to gradients = 7). Empty bulk fields
 * are left out, as protobuf-c leaves out an empty proto3 bytes field. test_feat_wire holds the
 * joined segments equal to protobuf_c_message_pack's bytes. */
#include <string.h>

#include "client/client_internal.h"
#include "common/alloc.h"
#include "common/varint.h"
#include "common/wire_fields.h"

_Static_assert(EMBPS_WIRE_LOOKUP_FEATURES_REQUEST_FEATURES ==
                   EMBPS_WIRE_PUSH_FEATURES_REQUEST_FEATURES,
               "one features field number for both requests");

#define REF ((uint64_t)-1) /* small_at of a segment sent from where it is */

static int reserve(embps__feat_wire_t *w, size_t n) {
  if (w->small_len + n > w->small_cap) {
    size_t cap = 2 * (w->small_len + n) + 256;
    uint8_t *p = embps_realloc(w->small, cap);
    if (!p)
      return -1;
    w->small = p;
    w->small_cap = cap;
  }
  return 0;
}

static int seg_room(embps__feat_wire_t *w) {
  if (w->nsegs == w->seg_cap) {
    int cap = 2 * w->seg_cap + 16;
    embps__seg_t *s = embps_realloc(w->segs, (size_t)cap * sizeof(*s));
    uint64_t *at = embps_realloc(w->small_at, (size_t)cap * sizeof(*at));
    if (s)
      w->segs = s;
    if (at)
      w->small_at = at;
    if (!s || !at)
      return -1;
    w->seg_cap = cap;
  }
  return 0;
}

/* The last n bytes of the small buffer as a segment, merged with the one before when that ends
 * where they start. */
static int small_seg(embps__feat_wire_t *w, size_t n) {
  const size_t at = w->small_len - n;
  if (n == 0)
    return 0;
  if (w->nsegs && w->small_at[w->nsegs - 1] != REF &&
      w->small_at[w->nsegs - 1] + w->segs[w->nsegs - 1].len == at) {
    w->segs[w->nsegs - 1].len += n;
    return 0;
  }
  if (seg_room(w) != 0)
    return -1;
  w->segs[w->nsegs] = (embps__seg_t){NULL, n};
  w->small_at[w->nsegs++] = at;
  return 0;
}

static int put(embps__feat_wire_t *w, const void *p, size_t n) {
  if (reserve(w, n) != 0)
    return -1;
  memcpy(w->small + w->small_len, p, n);
  w->small_len += n;
  return small_seg(w, n);
}

static int put_key_len(embps__feat_wire_t *w, uint32_t field, uint64_t len) {
  uint8_t b[20];
  size_t n = embps_varint_put(b, ((uint64_t)field << 3) | EMBPS_WIRE_LEN);
  n += embps_varint_put(b + n, len);
  return put(w, b, n);
}

/* msg packed by protobuf-c into the small buffer. */
static int put_packed(embps__feat_wire_t *w, const ProtobufCMessage *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  if (reserve(w, n) != 0)
    return -1;
  protobuf_c_message_pack(msg, w->small + w->small_len);
  w->small_len += n;
  return small_seg(w, n);
}

/* A bulk bytes field: its key and length, then its bytes from where they are. */
static int put_bulk(embps__feat_wire_t *w, uint32_t field, const ProtobufCBinaryData *d) {
  if (d->len == 0)
    return 0;
  if (put_key_len(w, field, d->len) != 0 || seg_room(w) != 0)
    return -1;
  w->segs[w->nsegs] = (embps__seg_t){d->data, d->len};
  w->small_at[w->nsegs++] = REF;
  return 0;
}

/* Where the fields numbered below `field` end in the packed message p[0..n): the scalars of a
 * request packed without its features. */
static size_t split_before(const uint8_t *p, size_t n, uint32_t field) {
  size_t i = 0;
  while (i < n) {
    uint64_t key, v = 0;
    size_t k = embps_wire_next_field(p, n, i, &key, &v);
    if (!k || (key >> 3) > field)
      return i;
    i += k + ((key & 7) == EMBPS_WIRE_LEN ? (size_t)v : 0);
  }
  return n;
}

embps_status_t embps__feat_encode(ProtobufCMessage *m, size_t *n_features,
                                  Embps__V1__FeatureShard **features, embps__feat_wire_t *w,
                                  uint64_t *total) {
  const size_t nf = *n_features;
  const uint32_t field = EMBPS_WIRE_LOOKUP_FEATURES_REQUEST_FEATURES;
  size_t size = protobuf_c_message_get_packed_size(m), top, cut;
  uint8_t head[128]; /* the request's scalars (at most 64 bytes: 8 fields of 11 at most) */

  *total = 5 + size;
  w->small_len = 0;
  w->nsegs = 0;
  if (size > UINT32_MAX)
    return EMBPS_INVALID_ARGUMENT;
  embps__grpc_prefix(head, (uint32_t)size);
  if (put(w, head, 5) != 0)
    goto oom;
  /* the scalars numbered below the features, and (after the features) the rest */
  *n_features = 0;
  top = protobuf_c_message_get_packed_size(m);
  if (top <= sizeof(head))
    protobuf_c_message_pack(m, head);
  *n_features = nf;
  if (top > sizeof(head))
    return EMBPS_INTERNAL;
  cut = split_before(head, top, field);
  if (put(w, head, cut) != 0)
    goto oom;
  for (size_t f = 0; f < nf; f++) {
    Embps__V1__FeatureShard small = *features[f];
    size_t sub;
    small.ids.len = small.lengths.len = small.weights.len = small.gradients.len = 0;
    sub = protobuf_c_message_get_packed_size(&features[f]->base);
    if (put_key_len(w, field, sub) != 0 || put_packed(w, &small.base) != 0)
      goto oom;
    if (put_bulk(w, EMBPS_WIRE_FEATURE_SHARD_IDS, &features[f]->ids) != 0 ||
        put_bulk(w, EMBPS_WIRE_FEATURE_SHARD_LENGTHS, &features[f]->lengths) != 0 ||
        put_bulk(w, EMBPS_WIRE_FEATURE_SHARD_WEIGHTS, &features[f]->weights) != 0 ||
        put_bulk(w, EMBPS_WIRE_FEATURE_SHARD_GRADIENTS, &features[f]->gradients) != 0)
      goto oom;
  }
  /* the scalars numbered above the features */
  if (put(w, head + cut, top - cut) != 0)
    goto oom;
  for (int i = 0; i < w->nsegs; i++)
    if (w->small_at[i] != REF)
      w->segs[i].p = w->small + w->small_at[i];
  return EMBPS_OK;
oom:
  return EMBPS_RESOURCE_EXHAUSTED;
}

void embps__feat_wire_free(embps__feat_wire_t *w) {
  if (!w)
    return;
  embps_free(w->small);
  embps_free(w->segs);
  embps_free(w->small_at);
  memset(w, 0, sizeof(*w));
}

/* ---- the LookupFeaturesResponse, read in place ---- */

/* The field at p[*i..n): its key into *key and, for a varint, its value into *v; for a
 * length-delimited field its bytes' place into *at and their count into *v. Skips fixed fields.
 * 0 when it does not parse. */
static int field_at(const uint8_t *p, size_t n, size_t *i, uint64_t *key, uint64_t *v, size_t *at) {
  size_t k = embps_wire_next_field(p, n, *i, key, v);
  if (!k)
    return 0;
  *i += k;
  if ((*key & 7) == EMBPS_WIRE_LEN) {
    *at = *i;
    *i += (size_t)*v;
  }
  return 1;
}

/* One FeatureRows at p[0..n). */
static int feature_rows(const uint8_t *p, size_t n, embps__feat_rows_t *fr) {
  memset(fr, 0, sizeof(*fr));
  fr->name = "";
  for (size_t i = 0; i < n;) {
    uint64_t key, v = 0;
    size_t at = 0;
    if (!field_at(p, n, &i, &key, &v, &at))
      return 0;
    switch (key) {
    case EMBPS_WIRE_KEY(FEATURE_ROWS_NAME):
      fr->name = (const char *)p + at;
      fr->name_len = (size_t)v;
      break;
    case EMBPS_WIRE_KEY(FEATURE_ROWS_EMB_WIDTH):
      fr->emb_width = (uint32_t)v;
      break;
    case EMBPS_WIRE_KEY(FEATURE_ROWS_DTYPE):
      fr->dtype = (int)(int32_t)v;
      break;
    case EMBPS_WIRE_KEY(FEATURE_ROWS_ROWS):
      fr->rows = p + at;
      fr->rows_len = v;
      break;
    default: /* another field, or one of these with another wire type: as protobuf-c would */
      if ((key >> 3) >= EMBPS_WIRE_FEATURE_ROWS_NAME && (key >> 3) <= EMBPS_WIRE_FEATURE_ROWS_ROWS)
        return 0;
      break;
    }
  }
  return 1;
}

int embps__feat_lookup_reply(const uint8_t *p, size_t n, uint64_t *batch_id, uint32_t *shard_index,
                             embps__feat_rows_t *rows, size_t cap, size_t *count) {
  *batch_id = 0;
  *shard_index = 0;
  *count = 0;
  for (size_t i = 0; i < n;) {
    uint64_t key, v = 0;
    size_t at = 0;
    if (!field_at(p, n, &i, &key, &v, &at))
      return 0;
    switch (key) {
    case EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_BATCH_ID):
      *batch_id = v;
      break;
    case EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_SHARD_INDEX):
      *shard_index = (uint32_t)v;
      break;
    case EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_FEATURES):
      if (*count < cap && !feature_rows(p + at, (size_t)v, &rows[*count]))
        return 0;
      ++*count;
      break;
    default:
      if ((key >> 3) >= EMBPS_WIRE_LOOKUP_FEATURES_RESPONSE_BATCH_ID &&
          (key >> 3) <= EMBPS_WIRE_LOOKUP_FEATURES_RESPONSE_FEATURES)
        return 0;
      break;
    }
  }
  return 1;
}
