/* The service's hand-written protobuf: the few places where it reads a request's own bytes or
 * lays out a reply itself instead of going through protobuf-c.
 *
 * Table names are checked on the request's bytes (embps__svc_check_names): protobuf-c hands a
 * `string` over as a NUL-terminated char*, so "t1\0x" would otherwise read as "t1". A push's
 * gradients are found in place (embps__svc_find_bytes_field) so that they need not be copied
 * out. Lookup replies are the bulk of the bytes a server sends, so the LookupResponse's small
 * fields and the rows field's header are laid out at the front of one buffer
 * (embps__svc_put_lookup_header) and the engine gathers the rows straight behind them. Every
 * field number comes from common/wire_fields.h, which a test holds equal to the .proto. */
#include "server/service/service_internal.h"

#include "common/varint.h"
#include "common/wire_fields.h"

/* Reads the field whose key starts at msg[i] (of msg[0..len)): its key and, for a length-
 * delimited field, its length into *v (whose bytes then follow). Returns the bytes of the key and
 * of the value, but for a length-delimited field only of its length; 0 when they do not parse. */
static size_t next_field(const uint8_t *msg, size_t len, size_t i, uint64_t *key, uint64_t *v) {
  size_t k = embps_varint_get(msg + i, len - i, key), n;
  if (!k)
    return 0;
  i += k;
  switch (*key & 7) {
  case 0:
    n = embps_varint_get(msg + i, len - i, v);
    break;
  case 1:
    n = len - i >= 8 ? 8 : 0;
    break;
  case 5:
    n = len - i >= 4 ? 4 : 0;
    break;
  case 2:
    if ((n = embps_varint_get(msg + i, len - i, v)) == 0 || *v > len - i - n)
      n = 0;
    break;
  default:
    n = 0;
  }
  return n ? k + n : 0;
}

int embps__svc_find_bytes_field(const uint8_t *msg, size_t len, uint32_t field, size_t *at,
                                size_t *data, size_t *n) {
  size_t i = 0, seen = 0;
  while (i < len) {
    uint64_t key, v = 0;
    size_t k = next_field(msg, len, i, &key, &v);
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

embps_status_t embps__svc_check_names(const uint8_t *msg, size_t len, const uint32_t *path,
                                      size_t depth, embps_error_t *err) {
  size_t i = 0;
  embps_status_t ret;
  while (i < len) {
    uint64_t key, v = 0;
    size_t n = next_field(msg, len, i, &key, &v);
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
