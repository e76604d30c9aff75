/* gRPC and protobuf framing for the client, with no I/O in it.
 *
 * Requests for Lookup and PushGradients are encoded by hand around their bulk fields: the
 * small fields (table, batch id, shard index...) go into a few bytes of head, mid and tail,
 * and the transport sends head | tokens | mid | gradients | tail straight from the caller's
 * arrays, so a batch is never serialized into a second buffer. Replies of every other RPC
 * are small and go through protobuf-c; the LookupResponse is parsed here as its DATA frames
 * arrive by a small protobuf state machine that copies the `rows` bytes field directly into
 * the caller's output buffer (one memcpy from the socket buffer, none through protobuf-c:
 * unpacking a 2 MiB reply with protobuf-c would cost a malloc and a second full copy). The
 * parser keeps no reference to the input, so a field may be split across DATA frames at any
 * byte, and protobuf's rules hold: fields in any order, unknown fields skipped, last one
 * wins. Every field number is common/wire_fields.h's, which a test holds equal to the .proto. */
#include "client/wire.h"

#include <stdio.h>
#include <string.h>

#include "common/byteorder.h"
#include "common/dtype.h"
#include "common/wire_fields.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libembps sends int64 tokens and rows in host order and needs a little-endian host"
#endif

/* ---- protobuf encoding ---- */

/* Field key: number << 3 | wire type (EMBPS_WIRE_VARINT, EMBPS_WIRE_I64, EMBPS_WIRE_LEN). */
static size_t put_key(uint8_t *p, unsigned field, unsigned wire_type) {
  return embps_varint_put(p, (uint64_t)field << 3 | wire_type);
}

static size_t put_varint_field(uint8_t *p, unsigned field, uint64_t v) {
  size_t n;
  if (v == 0)
    return 0; /* proto3: a zero scalar is not encoded */
  n = put_key(p, field, EMBPS_WIRE_VARINT);
  return n + embps_varint_put(p + n, v);
}

static size_t put_fixed64_field(uint8_t *p, unsigned field, uint64_t v) {
  size_t n;
  if (v == 0)
    return 0;
  n = put_key(p, field, EMBPS_WIRE_I64);
  embps_put_le64(p + n, v); /* fixed64 is little-endian */
  return n + 8;
}

void embps__grpc_prefix(uint8_t out[5], uint32_t len) {
  out[0] = 0; /* not compressed */
  out[1] = (uint8_t)(len >> 24);
  out[2] = (uint8_t)(len >> 16);
  out[3] = (uint8_t)(len >> 8);
  out[4] = (uint8_t)len;
}

/* LookupRequest and PushGradientsRequest share their first fields, so one head encodes both. */
#define SAME_FIELD(f) (EMBPS_WIRE_LOOKUP_REQUEST_##f == EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_##f)
_Static_assert(SAME_FIELD(TABLE) && SAME_FIELD(BATCH_ID) && SAME_FIELD(SHARD_INDEX) &&
                   SAME_FIELD(SHARD_COUNT) && SAME_FIELD(TOKENS_PER_BATCH) && SAME_FIELD(TOKENS) &&
                   SAME_FIELD(DTYPE),
               "LookupRequest and PushGradientsRequest no longer share their head's fields");
#undef SAME_FIELD

embps_status_t embps__batch_frame_build(embps__batch_frame_t *out, const embps__batch_fields_t *f,
                                        embps_error_t *err) {
  size_t name_len = f->table ? strlen(f->table) : 0;
  uint8_t *h = out->head + 5;
  uint64_t body;

  if (name_len > 1000)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "table name is %zu bytes, over 1000",
                           name_len);
  if (name_len > 0) {
    h += put_key(h, EMBPS_WIRE_LOOKUP_REQUEST_TABLE, EMBPS_WIRE_LEN);
    h += embps_varint_put(h, name_len);
    memcpy(h, f->table, name_len);
    h += name_len;
  }
  h += put_varint_field(h, EMBPS_WIRE_LOOKUP_REQUEST_BATCH_ID, f->batch_id);
  h += put_varint_field(h, EMBPS_WIRE_LOOKUP_REQUEST_SHARD_INDEX, f->shard_index);
  h += put_varint_field(h, EMBPS_WIRE_LOOKUP_REQUEST_SHARD_COUNT, f->shard_count);
  h += put_varint_field(h, EMBPS_WIRE_LOOKUP_REQUEST_TOKENS_PER_BATCH, f->tokens_per_batch);
  h += put_key(h, EMBPS_WIRE_LOOKUP_REQUEST_TOKENS, EMBPS_WIRE_LEN);
  h += embps_varint_put(h, f->tokens_bytes);
  out->head_len = (size_t)(h - out->head);

  out->mid_len = put_varint_field(out->mid, EMBPS_WIRE_LOOKUP_REQUEST_DTYPE, (uint64_t)f->dtype);
  out->tail_len = 0;
  if (f->is_push) {
    out->mid_len += put_key(out->mid + out->mid_len, EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_GRADIENTS,
                            EMBPS_WIRE_LEN);
    out->mid_len += embps_varint_put(out->mid + out->mid_len, f->grads_bytes);
    out->tail_len =
        put_varint_field(out->tail, EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_MODE, (uint64_t)f->mode);
  }
  out->tail_len += put_varint_field(out->tail + out->tail_len,
                                    f->is_push ? EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_CLIENT_ID
                                               : EMBPS_WIRE_LOOKUP_REQUEST_CLIENT_ID,
                                    f->client_id);
  out->tail_len += put_fixed64_field(out->tail + out->tail_len,
                                     f->is_push ? EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_DIGEST
                                                : EMBPS_WIRE_LOOKUP_REQUEST_DIGEST,
                                     f->digest);
  out->tail_len += put_varint_field(out->tail + out->tail_len,
                                    f->is_push ? EMBPS_WIRE_PUSH_GRADIENTS_REQUEST_ATTEMPT
                                               : EMBPS_WIRE_LOOKUP_REQUEST_ATTEMPT,
                                    f->attempt);
  body = (out->head_len - 5) + f->tokens_bytes + out->mid_len + (f->is_push ? f->grads_bytes : 0) +
         out->tail_len;
  if (body > UINT32_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "request of %llu bytes is over gRPC's 4 GiB message limit: split the "
                           "batch",
                           (unsigned long long)body);
  embps__grpc_prefix(out->head, (uint32_t)body);
  out->total = body + 5;
  return EMBPS_OK;
}

/* ---- gRPC metadata ---- */

static int hex_value(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

size_t embps__percent_decode(char *dst, const char *src, size_t len) {
  size_t i = 0, o = 0;
  while (i < len) {
    if (src[i] == '%' && i + 2 < len && hex_value(src[i + 1]) >= 0 && hex_value(src[i + 2]) >= 0) {
      dst[o++] = (char)(hex_value(src[i + 1]) << 4 | hex_value(src[i + 2]));
      i += 3;
    } else {
      dst[o++] = src[i++];
    }
  }
  dst[o] = '\0';
  return o;
}

size_t embps__grpc_timeout(char out[16], int64_t ms) {
  static const struct {
    char unit;
    int64_t ms;
  } units[] = {{'m', 1}, {'S', 1000}, {'M', 60000}, {'H', 3600000}};
  int64_t v = 0;
  char unit = 'H';
  if (ms < 1)
    ms = 1;
  for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
    v = (ms + units[i].ms - 1) / units[i].ms; /* round up: never shorten a deadline */
    unit = units[i].unit;
    if (v <= 99999999)
      break;
  }
  if (v > 99999999)
    v = 99999999;
  return (size_t)snprintf(out, 16, "%lld%c", (long long)v, unit);
}

embps_status_t embps__http_to_status(int http_status) {
  switch (http_status) {
  case 400:
    return EMBPS_INTERNAL;
  case 401:
    return EMBPS_UNAUTHENTICATED;
  case 403:
    return EMBPS_PERMISSION_DENIED;
  case 404:
    return EMBPS_UNIMPLEMENTED;
  case 429:
  case 502:
  case 503:
  case 504:
    return EMBPS_UNAVAILABLE;
  default:
    return EMBPS_UNKNOWN;
  }
}

/* ---- gRPC deframing ---- */

void embps__deframer_init(embps__deframer_t *d) { memset(d, 0, sizeof(*d)); }

embps_status_t embps__deframer_feed(embps__deframer_t *d, const uint8_t *p, size_t n,
                                    embps__body_sink sink, void *arg, embps_error_t *err) {
  while (n > 0) {
    if (d->prefix_have < 5) {
      if (d->nmsgs > 0)
        return embps_error_set(err, EMBPS_INTERNAL, "reply holds more than one message");
      size_t k = 5 - d->prefix_have < n ? 5 - d->prefix_have : n;
      memcpy(d->prefix + d->prefix_have, p, k);
      d->prefix_have += (uint32_t)k;
      p += k;
      n -= k;
      if (d->prefix_have < 5)
        return EMBPS_OK;
      if (d->prefix[0] != 0)
        return embps_error_set(err, EMBPS_INTERNAL,
                               "reply is compressed (flag %u), which this client never asks for",
                               d->prefix[0]);
      d->msg_len = (uint64_t)d->prefix[1] << 24 | (uint64_t)d->prefix[2] << 16 |
                   (uint64_t)d->prefix[3] << 8 | d->prefix[4];
      d->msg_have = 0;
      if (d->msg_len == 0) {
        d->nmsgs++;
        d->prefix_have = 0;
        continue;
      }
    }
    size_t k = d->msg_len - d->msg_have < n ? (size_t)(d->msg_len - d->msg_have) : n;
    if (k > 0) {
      embps_status_t st = sink(arg, p, k, err);
      if (st != EMBPS_OK)
        return st;
    }
    d->msg_have += k;
    p += k;
    n -= k;
    if (d->msg_have == d->msg_len) {
      d->nmsgs++;
      d->prefix_have = 0;
    }
  }
  return EMBPS_OK;
}

uint64_t embps__deframer_body_left(const embps__deframer_t *d) {
  return d->prefix_have == 5 ? d->msg_len - d->msg_have : 0;
}

embps_status_t embps__deframer_finish(const embps__deframer_t *d, embps_error_t *err) {
  if (d->prefix_have != 0)
    return embps_error_set(err, EMBPS_INTERNAL,
                           "reply message cut short (%llu of %llu bytes arrived)",
                           (unsigned long long)d->msg_have, (unsigned long long)d->msg_len);
  if (d->nmsgs != 1)
    return embps_error_set(err, EMBPS_INTERNAL, "reply holds no message");
  return EMBPS_OK;
}

/* ---- LookupResponse streaming parser ---- */

enum { P_KEY, P_VARINT, P_LEN, P_BYTES, P_SKIP };

void embps__lookup_parser_init(embps__lookup_parser_t *p, void *dst, size_t dst_cap,
                               uint64_t rows_bytes, uint64_t row_bytes) {
  memset(p, 0, sizeof(*p));
  p->dst = dst;
  p->dst_cap = dst_cap;
  p->rows_bytes = rows_bytes;
  p->row_bytes = row_bytes;
  p->state = P_KEY;
}

static embps_status_t malformed(embps_error_t *err, const char *what) {
  return embps_error_set(err, EMBPS_INTERNAL, "malformed LookupResponse: %s", what);
}

/* A complete varint value arrived for field p->field. */
static void set_varint_field(embps__lookup_parser_t *p, uint64_t v) {
  switch (p->field) {
  case EMBPS_WIRE_LOOKUP_RESPONSE_BATCH_ID:
    p->batch_id = v;
    break;
  case EMBPS_WIRE_LOOKUP_RESPONSE_SHARD_INDEX:
    p->shard_index = (uint32_t)v;
    break;
  case EMBPS_WIRE_LOOKUP_RESPONSE_EMB_WIDTH:
    p->emb_width = (uint32_t)v;
    break;
  case EMBPS_WIRE_LOOKUP_RESPONSE_DTYPE:
    p->dtype = (int)v;
    break;
  default:
    break; /* unknown: skipped */
  }
}

/* A key arrived: check the wire type of known fields and choose the next state. */
static embps_status_t on_key(embps__lookup_parser_t *p, uint64_t key, embps_error_t *err) {
  p->field = (int)(key >> 3);
  p->wire_type = (int)(key & 7);
  if (key >> 3 == 0 || key >> 3 > 536870911)
    return malformed(err, "field number 0 or out of range");
  if ((p->field == EMBPS_WIRE_LOOKUP_RESPONSE_BATCH_ID ||
       p->field == EMBPS_WIRE_LOOKUP_RESPONSE_SHARD_INDEX ||
       p->field == EMBPS_WIRE_LOOKUP_RESPONSE_EMB_WIDTH ||
       p->field == EMBPS_WIRE_LOOKUP_RESPONSE_DTYPE) &&
      p->wire_type != EMBPS_WIRE_VARINT)
    return malformed(err, "a scalar field has the wrong wire type");
  if (p->field == EMBPS_WIRE_LOOKUP_RESPONSE_ROWS && p->wire_type != EMBPS_WIRE_LEN)
    return malformed(err, "rows is not length-delimited");
  switch (p->wire_type) {
  case 0:
    p->state = P_VARINT;
    break;
  case 1:
    p->state = P_SKIP;
    p->left = 8;
    break;
  case 2:
    p->state = P_LEN;
    break;
  case 5:
    p->state = P_SKIP;
    p->left = 4;
    break;
  default:
    return malformed(err, "group or invalid wire type");
  }
  p->varint = 0;
  p->varint_shift = 0;
  return EMBPS_OK;
}

/* A length arrived for a length-delimited field. */
static void on_len(embps__lookup_parser_t *p, uint64_t len) {
  p->left = len;
  if (p->field != EMBPS_WIRE_LOOKUP_RESPONSE_ROWS) {
    p->state = P_SKIP;
    return;
  }
  p->seen_rows = 1;
  p->rows_have = 0;
  p->size_error = len != p->rows_bytes;
  p->bad_rows_len = len;
  p->state = p->size_error ? P_SKIP : P_BYTES;
}

embps_status_t embps__lookup_parser_feed(embps__lookup_parser_t *p, const uint8_t *data, size_t n,
                                         embps_error_t *err) {
  size_t i = 0;
  while (i < n) {
    switch (p->state) {
    case P_KEY:
    case P_VARINT:
    case P_LEN: {
      uint8_t b = data[i++];
      if (p->varint_shift >= 64 || (p->varint_shift == 63 && (b & 0x7e)))
        return malformed(err, "varint longer than 64 bits");
      p->varint |= (uint64_t)(b & 0x7f) << p->varint_shift;
      p->varint_shift += 7;
      if (b & 0x80)
        break;
      uint64_t v = p->varint;
      p->varint = 0;
      p->varint_shift = 0;
      if (p->state == P_KEY) {
        embps_status_t st = on_key(p, v, err);
        if (st != EMBPS_OK)
          return st;
      } else if (p->state == P_VARINT) {
        set_varint_field(p, v);
        p->state = P_KEY;
      } else {
        on_len(p, v);
        if (p->left == 0)
          p->state = P_KEY;
      }
      break;
    }
    case P_BYTES: {
      size_t k = (uint64_t)(n - i) < p->left ? n - i : (size_t)p->left;
      /* data + i is dst + rows_have when the transport read the bytes in place. */
      if (p->rows_have < p->dst_cap && data + i != p->dst + p->rows_have) {
        size_t room = p->dst_cap - (size_t)p->rows_have;
        memcpy(p->dst + p->rows_have, data + i, k < room ? k : room);
      }
      p->rows_have += k;
      p->left -= k;
      i += k;
      if (p->left == 0)
        p->state = P_KEY;
      break;
    }
    case P_SKIP: {
      size_t k = (uint64_t)(n - i) < p->left ? n - i : (size_t)p->left;
      p->left -= k;
      i += k;
      if (p->left == 0)
        p->state = P_KEY;
      break;
    }
    default:
      return malformed(err, "parser state");
    }
  }
  return EMBPS_OK;
}

uint8_t *embps__lookup_parser_direct(const embps__lookup_parser_t *p, size_t *n) {
  if (p->state != P_BYTES || p->left == 0 || p->rows_have >= p->dst_cap)
    return NULL;
  size_t room = p->dst_cap - (size_t)p->rows_have;
  *n = p->left < room ? (size_t)p->left : room;
  return p->dst + p->rows_have;
}

embps_status_t embps__lookup_parser_sink(void *arg, const uint8_t *data, size_t n,
                                         embps_error_t *err) {
  return embps__lookup_parser_feed(arg, data, n, err);
}

embps_status_t embps__lookup_parser_finish(const embps__lookup_parser_t *p, embps_error_t *err) {
  uint64_t tokens = p->row_bytes ? p->rows_bytes / p->row_bytes : 0;
  size_t dsize = embps_dtype_size(p->dtype);
  if (p->state != P_KEY || p->varint_shift != 0)
    return malformed(err, "message ends inside a field");
  if (p->emb_width != 0 && dsize != 0 && p->row_bytes != 0 &&
      (uint64_t)p->emb_width * dsize != p->row_bytes)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "rows of the table are %llu bytes (emb_width=%u, %s) but the output "
                           "buffer holds %llu bytes per token",
                           (unsigned long long)p->emb_width * dsize, p->emb_width,
                           embps_dtype_name(p->dtype), (unsigned long long)p->row_bytes);
  if (p->size_error)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "reply has %llu bytes of rows for %llu tokens, expected %llu (%llu "
                           "bytes per row, as the output buffer says)",
                           (unsigned long long)p->bad_rows_len, (unsigned long long)tokens,
                           (unsigned long long)p->rows_bytes, (unsigned long long)p->row_bytes);
  if (!p->seen_rows && p->rows_bytes != 0)
    return embps_error_set(err, EMBPS_INTERNAL, "reply has no rows for %llu tokens",
                           (unsigned long long)tokens);
  return EMBPS_OK;
}
