/* The service's hand-written protobuf: the few places where it reads a request's own bytes or
 * lays out a reply itself instead of going through protobuf-c.
 *
 * Table names are checked on the request's bytes (embps__svc_check_names): protobuf-c hands a
 * `string` over as a NUL-terminated char*, so "t1\0x" would otherwise read as "t1". A push's
 * gradients are found in place (embps__svc_find_bytes_field) so that they need not be copied
 * out. Lookup replies are the bulk of the bytes a server sends, so the LookupResponse's small
 * fields and the rows field's header are laid out at the front of one buffer
 * (embps__svc_put_lookup_header) and the engine gathers the rows straight behind them; a
 * LookupFeaturesResponse likewise has each feature's header laid out before its rows
 * (embps__svc_put_features_head, embps__svc_put_feature_rows_header). Every
 * field number comes from common/wire_fields.h, which a test holds equal to the .proto. */
#include "server/service/service_internal.h"

#include <string.h>

#include "common/alloc.h"
#include "common/varint.h"
#include "common/wire_fields.h"

int embps__svc_find_bytes_field(const uint8_t *msg, size_t len, uint32_t field, size_t *at,
                                size_t *data, size_t *n) {
  size_t i = 0, seen = 0;
  while (i < len) {
    uint64_t key, v = 0;
    size_t k = embps_wire_next_field(msg, len, i, &key, &v);
    if (!k)
      return 0;
    if ((key >> 3) == field) {
      if ((key & 7) != EMBPS_WIRE_LEN || seen++)
        return 0;
      *at = i;
      *data = i + k;
      *n = (size_t)v;
    }
    i += k + ((key & 7) == EMBPS_WIRE_LEN ? (size_t)v : 0);
  }
  return seen == 1;
}

/* The field `inner` inside the message field whose value is sub[0..n): where its key starts and
 * its bytes begin, and its length; 0 when it is not there, -1 when it is there more than once or
 * sub does not parse. */
static int find_inner(const uint8_t *sub, size_t n, uint32_t inner, size_t *at, size_t *data,
                      size_t *len) {
  size_t i = 0;
  int seen = 0;
  while (i < n) {
    uint64_t key, v = 0;
    size_t k = embps_wire_next_field(sub, n, i, &key, &v);
    if (!k)
      return -1;
    if ((key >> 3) == inner) {
      if ((key & 7) != EMBPS_WIRE_LEN || seen++)
        return -1;
      *at = i;
      *data = i + k;
      *len = (size_t)v;
    }
    i += k + ((key & 7) == EMBPS_WIRE_LEN ? (size_t)v : 0);
  }
  return seen;
}

uint8_t *embps__svc_strip_nested_bytes(const uint8_t *msg, size_t len, uint32_t outer,
                                       uint32_t inner, ProtobufCBinaryData **bulk, size_t *count,
                                       size_t *rest_len) {
  ProtobufCBinaryData *found = NULL;
  uint8_t *rest = NULL;
  size_t i, n = 0, w = 0;

  for (int pass = 0; pass < 2; pass++) { /* count the occurrences, then write */
    for (i = 0, n = 0; i < len;) {
      uint64_t key, v = 0;
      size_t k = embps_wire_next_field(msg, len, i, &key, &v), kl, at = 0, data = 0, blen = 0;
      const size_t vlen = (key & 7) == EMBPS_WIRE_LEN ? (size_t)v : 0;
      int has;
      if (!k)
        goto fail;
      if ((key >> 3) != outer || (key & 7) != EMBPS_WIRE_LEN) {
        if (pass) {
          memcpy(rest + w, msg + i, k + vlen);
          w += k + vlen;
        }
        i += k + vlen;
        continue;
      }
      if ((has = find_inner(msg + i + k, vlen, inner, &at, &data, &blen)) < 0)
        goto fail;
      if (pass) {
        const uint8_t *sub = msg + i + k;
        const size_t cut = has ? data + blen - at : 0;
        kl = embps_varint_get(msg + i, len - i, &key);
        memcpy(rest + w, msg + i, kl); /* the key as it was, then the shorter length */
        w += kl;
        w += embps_varint_put(rest + w, vlen - cut);
        memcpy(rest + w, sub, has ? at : vlen);
        w += has ? at : vlen;
        if (has) {
          memcpy(rest + w, sub + data + blen, vlen - data - blen);
          w += vlen - data - blen;
          found[n].data = (uint8_t *)sub + data;
          found[n].len = blen;
        } else {
          found[n].data = NULL;
          found[n].len = 0;
        }
      }
      n++;
      i += k + vlen;
    }
    if (!pass &&
        (!(rest = embps_malloc(len + 1)) || !(found = embps_calloc(n + 1, sizeof(*found)))))
      goto fail;
  }
  *bulk = found;
  *count = n;
  *rest_len = w;
  return rest;
fail:
  embps_free(rest);
  embps_free(found);
  return NULL;
}

embps_status_t embps__svc_check_names(const uint8_t *msg, size_t len, const uint32_t *path,
                                      size_t depth, embps_error_t *err) {
  size_t i = 0;
  embps_status_t ret;
  while (i < len) {
    uint64_t key, v = 0;
    size_t n = embps_wire_next_field(msg, len, i, &key, &v);
    if (!n)
      break;
    i += n;
    if ((key & 7) != EMBPS_WIRE_LEN)
      continue;
    if ((key >> 3) == path[0]) {
      if (depth > 1)
        ret = embps__svc_check_names(msg + i, (size_t)v, path + 1, depth - 1, err);
      else
        ret = v ? embps_table_name_check((const char *)msg + i, (size_t)v, err) : EMBPS_OK;
      if (ret != EMBPS_OK)
        return ret;
    }
    i += (size_t)v; /* past the field's bytes */
  }
  if (i != len)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "malformed request message");
  return EMBPS_OK;
}

/* Every key of the header is one byte. */
_Static_assert(EMBPS_WIRE_KEY(LOOKUP_RESPONSE_BATCH_ID) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_RESPONSE_SHARD_INDEX) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_RESPONSE_EMB_WIDTH) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_RESPONSE_DTYPE) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_RESPONSE_ROWS) < 0x80,
               "a LookupResponse key no longer fits one byte");

size_t embps__svc_put_lookup_header(uint8_t *p, uint64_t batch_id, uint32_t shard_index,
                                    uint32_t emb_width, int dtype, size_t rows_bytes) {
  size_t n = 0;
  if (batch_id) { /* proto3: a zero scalar is not encoded */
    p[n++] = EMBPS_WIRE_KEY(LOOKUP_RESPONSE_BATCH_ID);
    n += embps_varint_put(p + n, batch_id);
  }
  if (shard_index) {
    p[n++] = EMBPS_WIRE_KEY(LOOKUP_RESPONSE_SHARD_INDEX);
    n += embps_varint_put(p + n, shard_index);
  }
  p[n++] = EMBPS_WIRE_KEY(LOOKUP_RESPONSE_EMB_WIDTH);
  n += embps_varint_put(p + n, emb_width);
  p[n++] = EMBPS_WIRE_KEY(LOOKUP_RESPONSE_DTYPE);
  n += embps_varint_put(p + n, (uint64_t)dtype);
  p[n++] = EMBPS_WIRE_KEY(LOOKUP_RESPONSE_ROWS);
  n += embps_varint_put(p + n, rows_bytes);
  return n;
}

/* ---- LookupFeaturesResponse, laid out around the rows ---- */

_Static_assert(EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_BATCH_ID) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_SHARD_INDEX) < 0x80 &&
                   EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_FEATURES) < 0x80 &&
                   EMBPS_WIRE_KEY(FEATURE_ROWS_NAME) < 0x80 &&
                   EMBPS_WIRE_KEY(FEATURE_ROWS_EMB_WIDTH) < 0x80 &&
                   EMBPS_WIRE_KEY(FEATURE_ROWS_DTYPE) < 0x80 &&
                   EMBPS_WIRE_KEY(FEATURE_ROWS_ROWS) < 0x80,
               "a LookupFeaturesResponse key no longer fits one byte");

/* Bytes written at p (or only counted, p NULL). */
typedef struct wout {
  uint8_t *p;
  size_t n;
} wout_t;

static void w_byte(wout_t *w, uint8_t b) {
  if (w->p)
    w->p[w->n] = b;
  w->n++;
}

static void w_varint(wout_t *w, uint64_t v) {
  uint8_t tmp[EMBPS_VARINT_MAX];
  w->n += embps_varint_put(w->p ? w->p + w->n : tmp, v);
}

/* FeatureRows' fields up to the rows' bytes (proto3: zero scalars and an empty name left out). */
static void feature_rows_fields(wout_t *w, const char *name, size_t name_len, uint32_t emb_width,
                                int dtype, size_t rows_bytes) {
  if (name_len) {
    w_byte(w, EMBPS_WIRE_KEY(FEATURE_ROWS_NAME));
    w_varint(w, name_len);
    if (w->p)
      memcpy(w->p + w->n, name, name_len);
    w->n += name_len;
  }
  if (emb_width) {
    w_byte(w, EMBPS_WIRE_KEY(FEATURE_ROWS_EMB_WIDTH));
    w_varint(w, emb_width);
  }
  if (dtype) {
    w_byte(w, EMBPS_WIRE_KEY(FEATURE_ROWS_DTYPE));
    w_varint(w, (uint64_t)dtype);
  }
  w_byte(w, EMBPS_WIRE_KEY(FEATURE_ROWS_ROWS));
  w_varint(w, rows_bytes);
}

size_t embps__svc_put_features_head(uint8_t *p, uint64_t batch_id, uint32_t shard_index) {
  wout_t w = {p, 0};
  if (batch_id) {
    w_byte(&w, EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_BATCH_ID));
    w_varint(&w, batch_id);
  }
  if (shard_index) {
    w_byte(&w, EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_SHARD_INDEX));
    w_varint(&w, shard_index);
  }
  return w.n;
}

size_t embps__svc_put_feature_rows_header(uint8_t *p, const char *name, uint32_t emb_width,
                                          int dtype, size_t rows_bytes) {
  const size_t name_len = name ? strlen(name) : 0;
  wout_t inner = {NULL, 0}, w = {p, 0};
  feature_rows_fields(&inner, name, name_len, emb_width, dtype, rows_bytes);
  w_byte(&w, EMBPS_WIRE_KEY(LOOKUP_FEATURES_RESPONSE_FEATURES));
  w_varint(&w, inner.n + rows_bytes);
  feature_rows_fields(&w, name, name_len, emb_width, dtype, rows_bytes);
  return w.n;
}
