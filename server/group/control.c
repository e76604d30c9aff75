/* The control protocol's codec (control.h has the formats).
 *
 * Encoders size a message first, reserve that many bytes at the end of the caller's buffer and
 * fill them through a cursor, so a failure leaves the buffer as it was. Decoders read through
 * a bounds-checked cursor whose error is sticky: every get past the end yields zeros and marks
 * the read as cut short, so a decoder checks once, after its last field, and then checks that
 * nothing is left over. A frame is accepted only when its bytes are exactly what its fields
 * say; the peer is the same version of embps, so anything else is a bug or a stranger and the
 * caller breaks the group rather than guess. */
#include "server/group/control.h"

#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"

/* Bytes of a table config on the wire besides its name: its settings (common/table_fields.h),
 * in the checkpoint header's layout (embps_table_config_put_settings). */
#define CONFIG_FIXED_LEN EMBPS_TABLE_FIELDS_WIRE_BYTES
/* Bytes of a round entry before its message: client_id, batch_id, attempt, action, kind, status
 * and the message's length. */
#define ENTRY_FIXED_LEN (8 + 8 + 4 + 4 + 4 + 4 + 2)
/* Bytes of a WITHDRAW payload: client_id, batch_id, attempt. */
#define WITHDRAW_LEN (8 + 8 + 4)

static const char *frame_name(unsigned type) {
  static const char *const names[] = {"?",       "NOTICE",     "ROUND",   "BROKEN",   "DEVICE",
                                      "NCCL_ID", "CHECKPOINT", "LEAVING", "WITHDRAW", "RELAY"};
  return type < sizeof(names) / sizeof(names[0]) ? names[type] : "unknown";
}

/* ---- writing ---- */

void embps__buf_free(embps__buf_t *b) {
  embps_free(b->data);
  b->data = NULL;
  b->len = b->cap = 0;
}

/* Reserves n bytes at the end of b; returns where they start, or NULL (b unchanged). */
static uint8_t *reserve(embps__buf_t *b, size_t n) {
  if (b->cap - b->len < n) {
    size_t cap = b->cap ? b->cap : 256;
    uint8_t *d;
    while (cap - b->len < n)
      cap *= 2;
    if (!(d = embps_realloc(b->data, cap)))
      return NULL;
    b->data = d;
    b->cap = cap;
  }
  b->len += n;
  return b->data + b->len - n;
}

static void put8(uint8_t **p, uint8_t v) { *(*p)++ = v; }

static void put16(uint8_t **p, uint16_t v) {
  put8(p, (uint8_t)v);
  put8(p, (uint8_t)(v >> 8));
}

static void put32(uint8_t **p, uint32_t v) {
  embps_put_le32(*p, v);
  *p += 4;
}

static void put64(uint8_t **p, uint64_t v) {
  embps_put_le64(*p, v);
  *p += 8;
}

static void put_bytes(uint8_t **p, const void *src, size_t n) {
  memcpy(*p, src, n);
  *p += n;
}

/* Reserves a frame of type with payload_len bytes of payload; *payload is where they start. */
static embps_status_t frame_begin(embps__buf_t *b, uint8_t type, size_t payload_len,
                                  uint8_t **payload, embps_error_t *err) {
  uint8_t *p = NULL;
  if (payload_len > EMBPS__FRAME_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a %zu-byte %s frame, more than %u",
                           payload_len, frame_name(type), EMBPS__FRAME_MAX);
  if (!(p = reserve(b, EMBPS__FRAME_HEADER_LEN + payload_len)))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte %s frame",
                           payload_len, frame_name(type));
  put32(&p, (uint32_t)(payload_len + 1));
  put8(&p, type);
  *payload = p;
  return EMBPS_OK;
}

/* ---- reading ---- */

typedef struct reader {
  const uint8_t *p;
  size_t left;
  int short_read; /* a get ran past the end */
} reader_t;

static const uint8_t *take(reader_t *r, size_t n) {
  static const uint8_t zeros[8];
  if (r->short_read || r->left < n) {
    r->short_read = 1;
    return n <= sizeof(zeros) ? zeros : NULL;
  }
  r->p += n;
  r->left -= n;
  return r->p - n;
}

static uint8_t get8(reader_t *r) { return *take(r, 1); }

static uint16_t get16(reader_t *r) {
  const uint8_t *p = take(r, 2);
  return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t get32(reader_t *r) { return embps_get_le32(take(r, 4)); }
static uint64_t get64(reader_t *r) { return embps_get_le64(take(r, 8)); }

/* Copies an n-byte string into out (cap bytes) and NUL-terminates it; refuses n >= cap. */
static int get_string(reader_t *r, size_t n, char *out, size_t cap) {
  const uint8_t *p;
  if (n >= cap)
    return -1;
  p = take(r, n);
  if (p)
    memcpy(out, p, n);
  out[p ? n : 0] = '\0';
  return 0;
}

/* The verdict on a decoded payload: cut short, bytes left over, or whole. */
static embps_status_t finish(const reader_t *r, uint8_t type, embps_error_t *err) {
  if (r->short_read)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "malformed %s frame: cut short",
                           frame_name(type));
  if (r->left)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "malformed %s frame: %zu bytes after its last field", frame_name(type),
                           r->left);
  return EMBPS_OK;
}

static embps_status_t malformed(embps_error_t *err, uint8_t type, const char *what,
                                unsigned long value) {
  return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "malformed %s frame: %s %lu",
                         frame_name(type), what, value);
}

/* ---- bootstrap ---- */

embps_status_t embps__hello_encode(embps__buf_t *b, uint8_t kind, uint32_t rank, uint32_t size,
                                   const char *identity, size_t identity_len) {
  uint8_t *p = NULL;
  if (identity_len >= EMBPS__MAX_IDENTITY_LEN)
    return EMBPS_INVALID_ARGUMENT;
  if (!(p = reserve(b, EMBPS__HELLO_HEADER_LEN + identity_len)))
    return EMBPS_RESOURCE_EXHAUSTED;
  put_bytes(&p, EMBPS__HELLO_MAGIC, EMBPS__HELLO_MAGIC_LEN);
  put8(&p, kind);
  put32(&p, rank);
  put32(&p, size);
  put32(&p, (uint32_t)identity_len);
  put_bytes(&p, identity, identity_len);
  return EMBPS_OK;
}

int embps__hello_magic_ok(const uint8_t *p, size_t n) {
  return memcmp(p, EMBPS__HELLO_MAGIC, n < EMBPS__HELLO_MAGIC_LEN ? n : EMBPS__HELLO_MAGIC_LEN) ==
         0;
}

embps_status_t embps__hello_decode(const uint8_t *p, embps__hello_t *h, embps_error_t *err) {
  reader_t r = {p + EMBPS__HELLO_MAGIC_LEN, EMBPS__HELLO_HEADER_LEN - EMBPS__HELLO_MAGIC_LEN, 0};
  if (!embps__hello_magic_ok(p, EMBPS__HELLO_MAGIC_LEN))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "not an embps peer (no hello)");
  h->kind = get8(&r);
  h->rank = get32(&r);
  h->size = get32(&r);
  h->identity_len = get32(&r);
  if (h->identity_len >= EMBPS__MAX_IDENTITY_LEN)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "rank %u sent a %u-byte configuration, more than the %u allowed",
                           h->rank, h->identity_len, EMBPS__MAX_IDENTITY_LEN);
  return EMBPS_OK;
}

embps_status_t embps__verdict_encode(embps__buf_t *b, int accept, const char *message) {
  size_t len = strnlen(message, EMBPS__VERDICT_MESSAGE_MAX);
  uint8_t *p = reserve(b, EMBPS__VERDICT_HEADER_LEN + len);
  if (!p)
    return EMBPS_RESOURCE_EXHAUSTED;
  put8(&p, accept ? 0 : 1);
  put16(&p, (uint16_t)len);
  put_bytes(&p, message, len);
  return EMBPS_OK;
}

embps_status_t embps__verdict_encode_bytes(embps__buf_t *b, int verdict, const uint8_t *bytes,
                                           size_t len) {
  uint8_t *p = NULL;
  if ((verdict != EMBPS__VERDICT_ACCEPTED && verdict != EMBPS__VERDICT_CHALLENGE) ||
      len > EMBPS__VERDICT_MESSAGE_MAX)
    return EMBPS_INVALID_ARGUMENT;
  if (!(p = reserve(b, EMBPS__VERDICT_HEADER_LEN + len)))
    return EMBPS_RESOURCE_EXHAUSTED;
  put8(&p, verdict == EMBPS__VERDICT_ACCEPTED ? 0 : 2);
  put16(&p, (uint16_t)len);
  put_bytes(&p, bytes, len);
  return EMBPS_OK;
}

embps_status_t embps__verdict_decode(const uint8_t *p, int *verdict, size_t *message_len,
                                     embps_error_t *err) {
  static const int of_byte[] = {EMBPS__VERDICT_ACCEPTED, EMBPS__VERDICT_REFUSED,
                                EMBPS__VERDICT_CHALLENGE};
  reader_t r = {p, EMBPS__VERDICT_HEADER_LEN, 0};
  uint8_t byte = get8(&r);
  size_t len = get16(&r);
  if (byte > 2)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a verdict of %u is not 0, 1 or 2", byte);
  if (of_byte[byte] == EMBPS__VERDICT_CHALLENGE && len != EMBPS__NONCE_LEN)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "a challenge carries a %zu-byte nonce, not %u", len, EMBPS__NONCE_LEN);
  *verdict = of_byte[byte];
  *message_len = len;
  return EMBPS_OK;
}

embps_status_t embps__auth_encode(embps__buf_t *b, const uint8_t *nonce, const uint8_t *proof) {
  uint8_t *p = reserve(b, EMBPS__AUTH_LEN);
  if (!p)
    return EMBPS_RESOURCE_EXHAUSTED;
  put_bytes(&p, nonce, EMBPS__NONCE_LEN);
  put_bytes(&p, proof, EMBPS__PROOF_LEN);
  return EMBPS_OK;
}

void embps__auth_decode(const uint8_t *p, uint8_t *nonce, uint8_t *proof) {
  memcpy(nonce, p, EMBPS__NONCE_LEN);
  memcpy(proof, p + EMBPS__NONCE_LEN, EMBPS__PROOF_LEN);
}

/* ---- frames ---- */

embps_status_t embps__frame_header(const uint8_t *p, uint8_t *type, size_t *payload_len,
                                   embps_error_t *err) {
  uint32_t len = embps_get_le32(p);
  if (len == 0 || len - 1 > EMBPS__FRAME_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "malformed control frame: length %u outside 1..%u", len,
                           EMBPS__FRAME_MAX + 1);
  if (p[4] < EMBPS__FRAME_NOTICE || p[4] > EMBPS__FRAME_RELAY)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "malformed control frame: unknown type %u",
                           p[4]);
  *type = p[4];
  *payload_len = len - 1;
  return EMBPS_OK;
}

embps_status_t embps__frame_next(const uint8_t *p, size_t avail, uint8_t *type,
                                 const uint8_t **payload, size_t *payload_len, size_t *frame_len,
                                 embps_error_t *err) {
  embps_status_t ret;
  *frame_len = 0;
  if (avail < EMBPS__FRAME_HEADER_LEN)
    return EMBPS_OK;
  if ((ret = embps__frame_header(p, type, payload_len, err)) != EMBPS_OK)
    return ret;
  if (avail - EMBPS__FRAME_HEADER_LEN < *payload_len)
    return EMBPS_OK;
  *payload = p + EMBPS__FRAME_HEADER_LEN;
  *frame_len = EMBPS__FRAME_HEADER_LEN + *payload_len;
  return EMBPS_OK;
}

embps_status_t embps__frame_notice(embps__buf_t *b, const embps_batch_desc_t *d,
                                   embps_error_t *err) {
  size_t tl = strnlen(d->table, sizeof(d->table));
  uint8_t *p = NULL;
  embps_status_t ret;
  if (tl >= sizeof(d->table))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a table name of %zu bytes or more", tl);
  if ((ret = frame_begin(b, EMBPS__FRAME_NOTICE, 8 + 8 + 4 + 4 + 1 + tl + 8 + 1 + 4 + 8 + 4, &p,
                         err)) != EMBPS_OK)
    return ret;
  put64(&p, d->client_id);
  put64(&p, d->batch_id);
  put32(&p, d->kind);
  put32(&p, d->tokens_per_batch);
  put8(&p, (uint8_t)tl);
  put_bytes(&p, d->table, tl);
  put64(&p, d->table_id);
  put8(&p, d->has_deadline ? 1 : 0);
  put32(&p, d->has_deadline ? d->deadline_left_ms : 0);
  put64(&p, d->digest);
  put32(&p, d->attempt);
  return EMBPS_OK;
}

embps_status_t embps__parse_notice(const uint8_t *p, size_t len, embps_batch_desc_t *d,
                                   embps_error_t *err) {
  reader_t r = {p, len, 0};
  memset(d, 0, sizeof(*d));
  d->client_id = get64(&r);
  d->batch_id = get64(&r);
  d->kind = (embps_op_kind_t)get32(&r);
  d->tokens_per_batch = get32(&r);
  size_t tl = get8(&r);
  if (get_string(&r, tl, d->table, sizeof(d->table)) != 0)
    return malformed(err, EMBPS__FRAME_NOTICE, "table name length", tl);
  d->table_id = get64(&r);
  d->has_deadline = get8(&r);
  d->deadline_left_ms = get32(&r);
  d->digest = get64(&r);
  d->attempt = get32(&r);
  if (finish(&r, EMBPS__FRAME_NOTICE, err) != EMBPS_OK)
    return EMBPS_INVALID_ARGUMENT;
  if (d->has_deadline > 1 || (!d->has_deadline && d->deadline_left_ms))
    return malformed(err, EMBPS__FRAME_NOTICE, "deadline flag", d->has_deadline);
  return EMBPS_OK;
}

/* A create carries its table's config; a drop carries the same encoding, of which only the name
 * is read. */
static int runs_create(const embps_round_entry_t *e) {
  return e->action == EMBPS_ROUND_RUN &&
         (e->kind == EMBPS_OP_CREATE_TABLE || e->kind == EMBPS_OP_DROP_TABLE);
}

static int runs_checkpoint(const embps_round_entry_t *e) {
  return e->action == EMBPS_ROUND_RUN && e->kind == EMBPS_OP_CHECKPOINT;
}

/* Bytes of a checkpoint order on the wire besides its scope: round and base_round. */
#define CKPT_ORDER_FIXED_LEN (8 + 8)

embps_status_t embps__frame_round(embps__buf_t *b, const embps_round_entry_t *entries,
                                  const embps_table_config_t *configs,
                                  const embps__ckpt_order_t *ckpts, size_t n, embps_error_t *err) {
  size_t len = 4;
  uint8_t *p = NULL;
  embps_status_t ret;
  if (n > EMBPS__ROUND_MAX)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a round of %zu entries, more than %d", n,
                           EMBPS__ROUND_MAX);
  for (size_t i = 0; i < n; i++) {
    len += ENTRY_FIXED_LEN + strnlen(entries[i].message, sizeof(entries[i].message) - 1);
    if (runs_create(&entries[i])) {
      if (!configs)
        return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "a create in a round without configs");
      len += 1 + strnlen(configs[i].name, EMBPS_TABLE_NAME_MAX - 1) + CONFIG_FIXED_LEN;
    }
    if (runs_checkpoint(&entries[i])) {
      if (!ckpts)
        return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                               "a checkpoint in a round without its order");
      len += 1 + strnlen(ckpts[i].scope, EMBPS_TABLE_NAME_MAX - 1) + CKPT_ORDER_FIXED_LEN;
    }
  }
  if ((ret = frame_begin(b, EMBPS__FRAME_ROUND, len, &p, err)) != EMBPS_OK)
    return ret;
  put32(&p, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    const embps_round_entry_t *e = &entries[i];
    size_t ml = strnlen(e->message, sizeof(e->message) - 1);
    put64(&p, e->client_id);
    put64(&p, e->batch_id);
    put32(&p, e->attempt);
    put32(&p, e->action);
    put32(&p, e->kind);
    put32(&p, (uint32_t)e->status);
    put16(&p, (uint16_t)ml);
    put_bytes(&p, e->message, ml);
    if (runs_create(e)) {
      const embps_table_config_t *c = &configs[i];
      size_t nl = strnlen(c->name, EMBPS_TABLE_NAME_MAX - 1);
      put8(&p, (uint8_t)nl);
      put_bytes(&p, c->name, nl);
      embps_table_config_put_settings(p, c);
      p += CONFIG_FIXED_LEN;
    }
    if (runs_checkpoint(e)) {
      size_t sl = strnlen(ckpts[i].scope, EMBPS_TABLE_NAME_MAX - 1);
      put8(&p, (uint8_t)sl);
      put_bytes(&p, ckpts[i].scope, sl);
      put64(&p, ckpts[i].round);
      put64(&p, ckpts[i].base_round);
    }
  }
  return EMBPS_OK;
}

static embps_status_t parse_config(reader_t *r, embps_table_config_t *c, embps_error_t *err) {
  size_t nl = get8(r);
  const uint8_t *p;
  memset(c, 0, sizeof(*c));
  if (get_string(r, nl, c->name, sizeof(c->name)) != 0)
    return malformed(err, EMBPS__FRAME_ROUND, "table name length", nl);
  if ((p = take(r, CONFIG_FIXED_LEN)) != NULL) /* NULL: cut short, which the caller reports */
    embps_table_config_get_settings(p, c);
  return EMBPS_OK;
}

embps_status_t embps__parse_round(const uint8_t *p, size_t len, embps_round_entry_t *entries,
                                  embps_table_config_t *configs, embps__ckpt_order_t *ckpts,
                                  size_t max, size_t *n, embps_error_t *err) {
  reader_t r = {p, len, 0};
  embps_status_t ret;
  uint32_t count = get32(&r);
  if (count > max)
    return malformed(err, EMBPS__FRAME_ROUND, "entry count", count);
  for (uint32_t i = 0; i < count && !r.short_read; i++) {
    embps_round_entry_t *e = &entries[i];
    memset(e, 0, sizeof(*e));
    e->client_id = get64(&r);
    e->batch_id = get64(&r);
    e->attempt = get32(&r);
    e->action = get32(&r);
    uint32_t kind = get32(&r);
    uint32_t status = get32(&r);
    size_t ml = get16(&r);
    if (r.short_read)
      break;
    if (e->action != EMBPS_ROUND_RUN && e->action != EMBPS_ROUND_FAIL)
      return malformed(err, EMBPS__FRAME_ROUND, "action", e->action);
    if (!embps_op_kind_valid(kind))
      return malformed(err, EMBPS__FRAME_ROUND, "batch kind", kind);
    e->kind = (embps_op_kind_t)kind;
    if (status > EMBPS_UNAUTHENTICATED)
      return malformed(err, EMBPS__FRAME_ROUND, "status", status);
    e->status = (embps_status_t)status;
    if (get_string(&r, ml, e->message, sizeof(e->message)) != 0)
      return malformed(err, EMBPS__FRAME_ROUND, "message length", ml);
    if (runs_create(e) && (ret = parse_config(&r, &configs[i], err)) != EMBPS_OK)
      return ret;
    if (runs_checkpoint(e)) {
      size_t sl = get8(&r);
      if (get_string(&r, sl, ckpts[i].scope, sizeof(ckpts[i].scope)) != 0)
        return malformed(err, EMBPS__FRAME_ROUND, "checkpoint scope length", sl);
      ckpts[i].round = get64(&r);
      ckpts[i].base_round = get64(&r);
    }
  }
  *n = count;
  return finish(&r, EMBPS__FRAME_ROUND, err);
}

/* A frame whose payload is a sentence (BROKEN, LEAVING). */
static embps_status_t frame_sentence(embps__buf_t *b, uint8_t type, const char *why,
                                     embps_error_t *err) {
  size_t len = strnlen(why, EMBPS__BROKEN_MAX);
  uint8_t *p = NULL;
  embps_status_t ret = frame_begin(b, type, len, &p, err);
  if (ret == EMBPS_OK)
    put_bytes(&p, why, len);
  return ret;
}

embps_status_t embps__frame_broken(embps__buf_t *b, const char *why, embps_error_t *err) {
  return frame_sentence(b, EMBPS__FRAME_BROKEN, why, err);
}

embps_status_t embps__frame_leaving(embps__buf_t *b, const char *why, embps_error_t *err) {
  return frame_sentence(b, EMBPS__FRAME_LEAVING, why, err);
}

embps_status_t embps__parse_broken(const uint8_t *p, size_t len, char *why, size_t cap,
                                   embps_error_t *err) {
  if (len > EMBPS__BROKEN_MAX)
    return malformed(err, EMBPS__FRAME_BROKEN, "reason length", len);
  snprintf(why, cap, "%.*s", (int)len, (const char *)p);
  return EMBPS_OK;
}

embps_status_t embps__frame_withdraw(embps__buf_t *b, const embps__withdraw_t *w,
                                     embps_error_t *err) {
  uint8_t *p = NULL;
  embps_status_t ret = frame_begin(b, EMBPS__FRAME_WITHDRAW, WITHDRAW_LEN, &p, err);
  if (ret != EMBPS_OK)
    return ret;
  put64(&p, w->client_id);
  put64(&p, w->batch_id);
  put32(&p, w->attempt);
  return EMBPS_OK;
}

embps_status_t embps__parse_withdraw(const uint8_t *p, size_t len, embps__withdraw_t *w,
                                     embps_error_t *err) {
  reader_t r = {p, len, 0};
  memset(w, 0, sizeof(*w));
  w->client_id = get64(&r);
  w->batch_id = get64(&r);
  w->attempt = get32(&r);
  return finish(&r, EMBPS__FRAME_WITHDRAW, err);
}

embps_status_t embps__frame_relay(embps__buf_t *b, uint32_t rank, const uint8_t *frame,
                                  size_t frame_len, embps_error_t *err) {
  uint8_t *p = NULL, type = 0;
  size_t payload_len = 0;
  embps_status_t ret;
  if (frame_len < EMBPS__FRAME_HEADER_LEN ||
      embps__frame_header(frame, &type, &payload_len, err) != EMBPS_OK ||
      payload_len != frame_len - EMBPS__FRAME_HEADER_LEN || type == EMBPS__FRAME_RELAY)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "a RELAY frame carries one whole frame of another type");
  if ((ret = frame_begin(b, EMBPS__FRAME_RELAY, 4 + frame_len, &p, err)) != EMBPS_OK)
    return ret;
  put32(&p, rank);
  put_bytes(&p, frame, frame_len);
  return EMBPS_OK;
}

embps_status_t embps__parse_relay(const uint8_t *p, size_t len, uint32_t *rank, uint8_t *type,
                                  const uint8_t **payload, size_t *payload_len,
                                  const uint8_t **frame, size_t *frame_len, embps_error_t *err) {
  if (len < 4 + EMBPS__FRAME_HEADER_LEN)
    return malformed(err, EMBPS__FRAME_RELAY, "length", len);
  *rank = embps_get_le32(p);
  if (embps__frame_header(p + 4, type, payload_len, err) != EMBPS_OK)
    return EMBPS_INVALID_ARGUMENT;
  if (*payload_len != len - 4 - EMBPS__FRAME_HEADER_LEN)
    return malformed(err, EMBPS__FRAME_RELAY, "carried frame's payload length", *payload_len);
  if (*type == EMBPS__FRAME_RELAY)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "malformed RELAY frame: it carries another RELAY frame");
  *frame = p + 4;
  *frame_len = len - 4;
  *payload = p + 4 + EMBPS__FRAME_HEADER_LEN;
  return EMBPS_OK;
}

embps_status_t embps__frame_device(embps__buf_t *b, const embps__device_claim_t *c,
                                   embps_error_t *err) {
  size_t hl = strnlen(c->host, sizeof(c->host) - 1), bl = strnlen(c->bus_id, sizeof(c->bus_id) - 1);
  uint8_t *p = NULL;
  embps_status_t ret = frame_begin(b, EMBPS__FRAME_DEVICE, 1 + hl + 1 + bl + 4, &p, err);
  if (ret != EMBPS_OK)
    return ret;
  put8(&p, (uint8_t)hl);
  put_bytes(&p, c->host, hl);
  put8(&p, (uint8_t)bl);
  put_bytes(&p, c->bus_id, bl);
  put32(&p, (uint32_t)c->device);
  return EMBPS_OK;
}

embps_status_t embps__parse_device(const uint8_t *p, size_t len, embps__device_claim_t *c,
                                   embps_error_t *err) {
  reader_t r = {p, len, 0};
  size_t hl = get8(&r), bl;
  if (get_string(&r, hl, c->host, sizeof(c->host)) != 0)
    return malformed(err, EMBPS__FRAME_DEVICE, "host length", hl);
  bl = get8(&r);
  if (get_string(&r, bl, c->bus_id, sizeof(c->bus_id)) != 0)
    return malformed(err, EMBPS__FRAME_DEVICE, "bus id length", bl);
  c->device = (int32_t)get32(&r);
  return finish(&r, EMBPS__FRAME_DEVICE, err);
}

embps_status_t embps__frame_nccl_id(embps__buf_t *b, const uint8_t *id, embps_error_t *err) {
  uint8_t *p = NULL;
  embps_status_t ret = frame_begin(b, EMBPS__FRAME_NCCL_ID, EMBPS__NCCL_ID_BYTES, &p, err);
  if (ret == EMBPS_OK)
    put_bytes(&p, id, EMBPS__NCCL_ID_BYTES);
  return ret;
}

embps_status_t embps__parse_nccl_id(const uint8_t *p, size_t len, uint8_t *id, embps_error_t *err) {
  if (len != EMBPS__NCCL_ID_BYTES)
    return malformed(err, EMBPS__FRAME_NCCL_ID, "length", len);
  memcpy(id, p, len);
  return EMBPS_OK;
}

/* A checkpoint message carries every field whatever its kind: they are few and small. */
embps_status_t embps__frame_checkpoint(embps__buf_t *b, const embps__ckpt_msg_t *m,
                                       embps_error_t *err) {
  size_t sl = strnlen(m->scope, sizeof(m->scope) - 1), pl = strnlen(m->path, sizeof(m->path) - 1),
         ml = strnlen(m->message, sizeof(m->message) - 1);
  uint8_t *p = NULL;
  embps_status_t ret = frame_begin(b, EMBPS__FRAME_CHECKPOINT,
                                   1 + 8 + 8 + 4 + 8 + 1 + 1 + sl + 2 + pl + 2 + ml, &p, err);
  if (ret != EMBPS_OK)
    return ret;
  put8(&p, m->what);
  put64(&p, m->seq);
  put64(&p, m->round);
  put32(&p, m->status);
  put64(&p, m->bytes);
  put8(&p, m->final);
  put8(&p, (uint8_t)sl);
  put_bytes(&p, m->scope, sl);
  put16(&p, (uint16_t)pl);
  put_bytes(&p, m->path, pl);
  put16(&p, (uint16_t)ml);
  put_bytes(&p, m->message, ml);
  return EMBPS_OK;
}

embps_status_t embps__parse_checkpoint(const uint8_t *p, size_t len, embps__ckpt_msg_t *m,
                                       embps_error_t *err) {
  reader_t r = {p, len, 0};
  size_t n;
  memset(m, 0, sizeof(*m));
  m->what = get8(&r);
  if (m->what < EMBPS__CKPT_REQUEST || m->what > EMBPS__CKPT_COMPLETE)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "kind", m->what);
  m->seq = get64(&r);
  m->round = get64(&r);
  m->status = get32(&r);
  if (m->status > EMBPS_UNAUTHENTICATED)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "status", m->status);
  m->bytes = get64(&r);
  m->final = get8(&r);
  if (m->final > 1)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "final flag", m->final);
  n = get8(&r);
  if (get_string(&r, n, m->scope, sizeof(m->scope)) != 0)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "scope length", n);
  n = get16(&r);
  if (get_string(&r, n, m->path, sizeof(m->path)) != 0)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "path length", n);
  n = get16(&r);
  if (get_string(&r, n, m->message, sizeof(m->message)) != 0)
    return malformed(err, EMBPS__FRAME_CHECKPOINT, "message length", n);
  return finish(&r, EMBPS__FRAME_CHECKPOINT, err);
}
