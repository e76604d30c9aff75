/* The checkpoint codec: every byte a checkpoint puts on disk, and its checksums. The other
 * checkpoint modules move whole headers, blocks and manifests; only this file knows where a
 * field lies, so the format is read here, once (docs and the fuzz target point here).
 *
 * Byte layouts. Integers are little-endian, floats their IEEE-754 bits as a u32; a name is its
 * length (u32) and its bytes; a table spec is name | rows u64 | emb_width u32 | dtype u32 |
 * seed u64 | init_scale | optimizer u32 | lr | eps | half_life | initial_accumulator |
 * weight_decay | beta1 | beta2 | capacity u64 | admit_after u32 | eviction u32 |
 * half_life_steps u64 | ttl_steps u64 | sketch_width u32: its settings in the order
 * common/table_fields.h declares them, which embps_table_config_put_settings (here) writes for
 * the group's control frames too. Version 1 files end the spec at beta2 (EMBPS_TABLE_FIELDS_V1):
 * they are read with the later settings zero, a dense table, as they were written.
 *
 * A slice file (r<rank>-<table>.embps):
 *   header   "EMBPSCKP" | format version u32 | header bytes u32 (all of the header) | rank u32 |
 *            group_size u32 | col_begin u32 | shard_width u32 | round u64 | step u64 |
 *            base_round u64 | blocks u64 | rows written u64 | table spec |
 *            crc32 u32 of everything before it
 *   blocks   first row u64 | rows u32 | payload bytes u32 | crc32 u32 of the 16 bytes before it
 *            and of the payload | payload: the rows' data (rows x shard_width of dtype), then
 *            their state0 (rows x shard_width floats, or one float per row), then their state1
 *   trailer  "EMBPSEND" | blocks u64 | rows written u64 | crc32 u32 of the blocks' crc32s (each
 *            as a u32, in order) | crc32 u32 of the 28 bytes before it
 * A full slice's blocks cover every row in order, each floor(1 MiB / the payload bytes of one row)
 * rows (at least 1), the last one the rest: so block b starts at a known offset, and a restore
 * reads ranges of blocks with several threads. An incremental slice's blocks cover runs of the
 * dirty rows (at most as many rows each), read in order.
 *
 * A MANIFEST:
 *   "EMBPSMAN" | format version u32 | body bytes u32 | body | crc32 u32 of everything before it
 *   body: round u64 | base_round u64 | time_ms u64 | group_size u32 | scope (a name) |
 *         bytes u64 | tables u32 | table specs | files u32 | files: rank u32 | table (a name) |
 *         bytes u64 */
#include "server/store/ckpt_internal.h"

#include <inttypes.h>
#include <string.h>

#include <isa-l/crc.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "common/dtype.h"

/* The gzip/zlib crc32 (reflected 0x04C11DB7; zlib's crc32() gives the same values), from
 * ISA-L: its folding with carry-less multiplies ran at 28 GB/s on this project's 2-core VM
 * against zlib 1.2.13's 6 GB/s (256 MiB, 2026-12-03), and a restore verifies every byte. */
uint32_t embps__ckpt_crc(uint32_t c, const void *p, size_t n) { return crc32_gzip_refl(c, p, n); }

uint32_t embps__ckpt_blocks_crc_add(uint32_t blocks_crc, uint32_t block_crc) {
  uint8_t x[4];
  embps_put_le32(x, block_crc);
  return embps__ckpt_crc(blocks_crc, x, 4);
}

void embps__ckpt_row_bytes(const embps_table_config_t *cfg, uint32_t shard_width, size_t out[3]) {
  const embps_optimizer_info_t *info = embps_optimizer_info(cfg->optimizer);
  out[0] = (size_t)shard_width * embps_dtype_size(cfg->dtype);
  out[1] = !info                     ? 0
           : info->state_per_row     ? sizeof(float)
           : info->state_per_element ? (size_t)shard_width * sizeof(float)
                                     : 0;
  out[2] = info && info->state_per_element >= 2 ? (size_t)shard_width * sizeof(float) : 0;
}

uint64_t embps__ckpt_rows_per_block(size_t per_row) {
  return per_row >= EMBPS__CKPT_BLOCK_TARGET ? 1 : EMBPS__CKPT_BLOCK_TARGET / per_row;
}

uint64_t embps_ckpt_slice_bytes(const embps_table_config_t *cfg, uint32_t group_size) {
  const uint64_t rows = embps_table_config_rows(cfg);
  const uint32_t shard_width = group_size ? cfg->emb_width / group_size : 0;
  embps__ckpt_header_t h;
  uint8_t *head = NULL;
  size_t rb[3], per_row, head_len = 0;
  uint64_t per_block;

  embps__ckpt_row_bytes(cfg, shard_width, rb);
  per_row = rb[0] + rb[1] + rb[2];
  if (!rows || !rb[0] || !embps_optimizer_info(cfg->optimizer))
    return 0;
  per_block = embps__ckpt_rows_per_block(per_row);
  /* The header's length is the encoder's (a name and the table's settings vary it). */
  memset(&h, 0, sizeof(h));
  h.group_size = group_size;
  h.shard_width = shard_width;
  h.blocks = (rows + per_block - 1) / per_block;
  h.rows_written = rows;
  h.config = *cfg;
  if (embps__ckpt_header_encode(&h, &head, &head_len) != 0)
    return 0;
  embps_free(head);
  return head_len + h.blocks * EMBPS__CKPT_BLOCK_HEADER + rows * per_row +
         EMBPS__CKPT_TRAILER_BYTES;
}

/* ---- building and parsing byte strings ------------------------------------------------------ */

typedef struct wbuf {
  uint8_t *p;
  size_t len, cap;
  int oom;
} wbuf_t;

static void put(wbuf_t *b, const void *src, size_t n) {
  if (b->oom)
    return;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    uint8_t *p;
    while (cap < b->len + n)
      cap *= 2;
    if (!(p = embps_realloc(b->p, cap))) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, src, n);
  b->len += n;
}

static void put_u32(wbuf_t *b, uint32_t v) {
  uint8_t x[4];
  embps_put_le32(x, v);
  put(b, x, 4);
}

static void put_u64(wbuf_t *b, uint64_t v) {
  uint8_t x[8];
  embps_put_le64(x, v);
  put(b, x, 8);
}

static void put_name(wbuf_t *b, const char *s) {
  size_t n = strnlen(s, EMBPS_TABLE_NAME_MAX - 1);
  put_u32(b, (uint32_t)n);
  put(b, s, n);
}

static void put_crc(wbuf_t *b) { put_u32(b, b->oom ? 0 : embps__ckpt_crc(0, b->p, b->len)); }

void embps_table_config_put_settings(uint8_t *p, const embps_table_config_t *c) {
#define PUT_SETTING(field, type, wire, message, pb_field) embps_table_wire_put_##wire(&p, c->field);
  EMBPS_TABLE_FIELDS(PUT_SETTING)
#undef PUT_SETTING
}

void embps_table_config_get_settings(const uint8_t *p, embps_table_config_t *c) {
#define GET_SETTING(field, type, wire, message, pb_field)                                          \
  c->field = (type)embps_table_wire_get_##wire(&p);
  EMBPS_TABLE_FIELDS(GET_SETTING)
#undef GET_SETTING
}

/* A table spec: its name, then its settings. */
static void put_config(wbuf_t *b, const embps_table_config_t *c) {
  uint8_t x[EMBPS_TABLE_FIELDS_WIRE_BYTES];
  put_name(b, c->name);
  embps_table_config_put_settings(x, c);
  put(b, x, sizeof(x));
}

/* Hands a finished buffer over: 0, or -1 (and frees it) when it ran out of memory. */
static int finish(wbuf_t *b, uint8_t **out, size_t *len) {
  if (b->oom) {
    embps_free(b->p);
    return -1;
  }
  *out = b->p;
  *len = b->len;
  return 0;
}

typedef struct rbuf {
  const uint8_t *p;
  size_t len, off;
  int bad;          /* read past the end, or a name too long */
  uint32_t version; /* the file's format version: which settings a table spec holds */
} rbuf_t;

static const uint8_t *get(rbuf_t *r, size_t n) {
  const uint8_t *p;
  if (r->bad || n > r->len - r->off) {
    r->bad = 1;
    return NULL;
  }
  p = r->p + r->off;
  r->off += n;
  return p;
}

static uint32_t get_u32(rbuf_t *r) {
  const uint8_t *p = get(r, 4);
  return p ? embps_get_le32(p) : 0;
}

static uint64_t get_u64(rbuf_t *r) {
  const uint8_t *p = get(r, 8);
  return p ? embps_get_le64(p) : 0;
}

static void get_name(rbuf_t *r, char out[EMBPS_TABLE_NAME_MAX]) {
  uint32_t n = get_u32(r);
  const uint8_t *p;
  out[0] = '\0';
  if (n >= EMBPS_TABLE_NAME_MAX) {
    r->bad = 1;
    return;
  }
  if ((p = get(r, n))) {
    memcpy(out, p, n);
    out[n] = '\0';
  }
}

/* Reads the settings of format version 1 at p into c (the later ones untouched). */
static void get_settings_v1(const uint8_t *p, embps_table_config_t *c) {
#define GET_SETTING(field, type, wire, message, pb_field)                                          \
  c->field = (type)embps_table_wire_get_##wire(&p);
  EMBPS_TABLE_FIELDS_V1(GET_SETTING)
#undef GET_SETTING
}

/* A table spec of r's format version: a version 1 spec leaves the settings appended since at 0. */
static void get_config(rbuf_t *r, embps_table_config_t *c) {
  const uint8_t *p;
  memset(c, 0, sizeof(*c));
  get_name(r, c->name);
  if (r->version == 1) {
    if ((p = get(r, EMBPS_TABLE_FIELDS_V1_WIRE_BYTES)))
      get_settings_v1(p, c);
  } else if ((p = get(r, EMBPS_TABLE_FIELDS_WIRE_BYTES))) {
    embps_table_config_get_settings(p, c);
  }
}

int embps__ckpt_same_config(const embps_table_config_t *a, const embps_table_config_t *b) {
  wbuf_t x = {0}, y = {0};
  int same;
  put_config(&x, a);
  put_config(&y, b);
  same = !x.oom && !y.oom && x.len == y.len && memcmp(x.p, y.p, x.len) == 0;
  embps_free(x.p);
  embps_free(y.p);
  return same;
}

embps_status_t embps__ckpt_check_preamble(const uint8_t *p, const char *magic, const char *path,
                                          embps_error_t *err) {
  uint32_t version = embps_get_le32(p + 8);
  if (memcmp(p, magic, 8) != 0)
    return embps_error_set(err, EMBPS_DATA_LOSS, "%s is not an embps checkpoint file (bad magic)",
                           path);
  if (version < EMBPS_CKPT_FORMAT_VERSION_MIN || version > EMBPS_CKPT_FORMAT_VERSION)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "%s has checkpoint format version %" PRIu32
                           "; this build reads versions %u to %u",
                           path, version, EMBPS_CKPT_FORMAT_VERSION_MIN, EMBPS_CKPT_FORMAT_VERSION);
  return EMBPS_OK;
}

/* ---- slice files ---------------------------------------------------------------------------- */

int embps__ckpt_header_encode(const embps__ckpt_header_t *h, uint8_t **out, size_t *len) {
  wbuf_t b = {0};
  put(&b, EMBPS__CKPT_SLICE_MAGIC, 8);
  put_u32(&b, EMBPS_CKPT_FORMAT_VERSION);
  put_u32(&b, 0); /* the header's length, set below */
  put_u32(&b, h->rank);
  put_u32(&b, h->group_size);
  put_u32(&b, h->col_begin);
  put_u32(&b, h->shard_width);
  put_u64(&b, h->round);
  put_u64(&b, h->step);
  put_u64(&b, h->base_round);
  put_u64(&b, h->blocks);
  put_u64(&b, h->rows_written);
  put_config(&b, &h->config);
  if (!b.oom)
    embps_put_le32(b.p + 12, (uint32_t)b.len + 4);
  put_crc(&b);
  return finish(&b, out, len);
}

int embps__ckpt_header_decode(const uint8_t *p, size_t hlen, embps__ckpt_header_t *h) {
  rbuf_t r = {.p = p, .len = hlen - 4, .off = EMBPS__CKPT_PREAMBLE, .version = 0};
  r.version = embps_get_le32(p + 8); /* embps__ckpt_check_preamble accepted it */
  h->rank = get_u32(&r);
  h->group_size = get_u32(&r);
  h->col_begin = get_u32(&r);
  h->shard_width = get_u32(&r);
  h->round = get_u64(&r);
  h->step = get_u64(&r);
  h->base_round = get_u64(&r);
  h->blocks = get_u64(&r);
  h->rows_written = get_u64(&r);
  get_config(&r, &h->config);
  return r.bad || r.off != r.len ? -1 : 0;
}

uint32_t embps__ckpt_block_put(uint8_t *p, const embps__ckpt_block_t *b) {
  embps_put_le64(p, b->first);
  embps_put_le32(p + 8, b->rows);
  embps_put_le32(p + 12, b->bytes);
  embps_put_le32(p + 16, b->crc);
  return embps__ckpt_crc(0, p, 16);
}

void embps__ckpt_block_get(const uint8_t *p, embps__ckpt_block_t *b) {
  b->first = embps_get_le64(p);
  b->rows = embps_get_le32(p + 8);
  b->bytes = embps_get_le32(p + 12);
  b->crc = embps_get_le32(p + 16);
}

void embps__ckpt_trailer_put(uint8_t *p, uint64_t blocks, uint64_t rows, uint32_t blocks_crc) {
  memcpy(p, EMBPS__CKPT_TRAILER_MAGIC, 8);
  embps_put_le64(p + 8, blocks);
  embps_put_le64(p + 16, rows);
  embps_put_le32(p + 24, blocks_crc);
  embps_put_le32(p + 28, embps__ckpt_crc(0, p, 28));
}

void embps__ckpt_trailer_get(const uint8_t *p, embps__ckpt_trailer_t *t) {
  t->magic_ok = memcmp(p, EMBPS__CKPT_TRAILER_MAGIC, 8) == 0;
  t->blocks = embps_get_le64(p + 8);
  t->rows = embps_get_le64(p + 16);
  t->blocks_crc = embps_get_le32(p + 24);
  t->crc = embps_get_le32(p + 28);
  t->crc_actual = embps__ckpt_crc(0, p, 28);
}

/* ---- manifests ------------------------------------------------------------------------------ */

int embps__ckpt_manifest_encode(const embps_ckpt_manifest_t *m, uint8_t **out, size_t *len) {
  wbuf_t b = {0};
  put(&b, EMBPS__CKPT_MANIFEST_MAGIC, 8);
  put_u32(&b, EMBPS_CKPT_FORMAT_VERSION);
  put_u32(&b, 0); /* the body's length, set below */
  put_u64(&b, m->round);
  put_u64(&b, m->base_round);
  put_u64(&b, m->time_ms);
  put_u32(&b, m->group_size);
  put_name(&b, m->scope);
  put_u64(&b, m->bytes);
  put_u32(&b, (uint32_t)m->num_tables);
  for (size_t i = 0; i < m->num_tables; i++)
    put_config(&b, &m->tables[i]);
  put_u32(&b, (uint32_t)m->num_files);
  for (size_t i = 0; i < m->num_files; i++) {
    put_u32(&b, m->files[i].rank);
    put_name(&b, m->files[i].table);
    put_u64(&b, m->files[i].bytes);
  }
  if (!b.oom)
    embps_put_le32(b.p + 12, (uint32_t)(b.len - 16));
  put_crc(&b);
  return finish(&b, out, len);
}

/* Releases what a manifest being decoded holds, and zeroes it. */
static void drop(embps_ckpt_manifest_t *m) {
  embps_free(m->tables);
  embps_free(m->files);
  memset(m, 0, sizeof(*m));
}

embps_status_t embps__ckpt_manifest_decode(const char *path, const uint8_t *p, size_t len,
                                           embps_ckpt_manifest_t *m, embps_error_t *err) {
  rbuf_t r;
  uint32_t body, want, got;
  embps_status_t ret;

  if (len < EMBPS__CKPT_PREAMBLE + 4)
    return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is truncated", path);
  if ((ret = embps__ckpt_check_preamble(p, EMBPS__CKPT_MANIFEST_MAGIC, path, err)) != EMBPS_OK)
    return ret;
  body = embps_get_le32(p + 12);
  if ((uint64_t)body + 20 != len)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint manifest %s is truncated or overlong (%zu bytes; its "
                           "header says %" PRIu64 ")",
                           path, len, (uint64_t)body + 20);
  want = embps_get_le32(p + len - 4);
  if ((got = embps__ckpt_crc(0, p, len - 4)) != want)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint manifest %s is corrupt: crc32 expected %08" PRIx32
                           ", actual %08" PRIx32,
                           path, want, got);
  r = (rbuf_t){.p = p, .len = len - 4, .off = EMBPS__CKPT_PREAMBLE, .version = 0};
  m->format_version = r.version = embps_get_le32(p + 8);
  m->round = get_u64(&r);
  m->base_round = get_u64(&r);
  m->time_ms = get_u64(&r);
  m->group_size = get_u32(&r);
  get_name(&r, m->scope);
  m->bytes = get_u64(&r);
  m->num_tables = get_u32(&r);
  /* each entry takes at least 4 bytes: a count beyond what is left is a lie */
  if (r.bad || m->num_tables > (r.len - r.off) / 4)
    goto bad;
  if (!(m->tables = embps_calloc(m->num_tables ? m->num_tables : 1, sizeof(*m->tables))))
    goto oom;
  for (size_t i = 0; i < m->num_tables; i++)
    get_config(&r, &m->tables[i]);
  m->num_files = get_u32(&r);
  if (r.bad || m->num_files > (r.len - r.off) / 4)
    goto bad;
  if (!(m->files = embps_calloc(m->num_files ? m->num_files : 1, sizeof(*m->files))))
    goto oom;
  for (size_t i = 0; i < m->num_files; i++) {
    m->files[i].rank = get_u32(&r);
    get_name(&r, m->files[i].table);
    m->files[i].bytes = get_u64(&r);
  }
  if (r.bad || r.off != r.len || !m->group_size)
    goto bad;
  return EMBPS_OK;
bad:
  drop(m);
  return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is malformed", path);
oom:
  drop(m);
  return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
}
