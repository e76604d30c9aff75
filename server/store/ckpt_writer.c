/* The slice writer: one rank's columns of one table as a slice file (layout in ckpt_codec.c).
 * The slice is checked for consistency before anything is created, so a refused slice leaves
 * nothing behind. The rows go out as blocks of at most rows_per_block rows: every row in order
 * for a full slice, so a reader knows where each block starts; runs of dirty rows for an
 * incremental one. Each block's crc32 is computed from the caller's arrays as they are written,
 * with no copy of the table; the durable file (ckpt_file.c) gathers the small writes. */
#include "server/store/ckpt_internal.h"

#include <string.h>

#include "common/alloc.h"
#include "common/dtype.h"

/* Walks the rows a slice writes as blocks of at most per_block consecutive rows. */
typedef struct blocks {
  const uint64_t *dirty; /* NULL: every row */
  uint64_t rows, per_block, row;
} blocks_t;

static int dirty_bit(const uint64_t *d, uint64_t r) { return (int)((d[r / 64] >> (r % 64)) & 1u); }

static int next_block(blocks_t *it, uint64_t *first, uint32_t *n) {
  uint64_t count = 0;
  if (it->dirty) {
    while (it->row < it->rows && !dirty_bit(it->dirty, it->row))
      it->row = (it->row % 64 == 0 && it->dirty[it->row / 64] == 0) ? it->row + 64 : it->row + 1;
  }
  if (it->row >= it->rows)
    return 0;
  *first = it->row;
  while (it->row < it->rows && count < it->per_block &&
         (!it->dirty || dirty_bit(it->dirty, it->row))) {
    it->row++;
    count++;
  }
  *n = (uint32_t)count;
  return 1;
}

static embps_status_t check_slice(const embps_ckpt_slice_t *s, size_t rb[3], embps_error_t *err) {
  const embps_table_config_t *c = &s->config;
  const embps_optimizer_info_t *info = embps_optimizer_info(c->optimizer);
  if (!info || !embps_dtype_size(c->dtype) || !embps_table_config_rows(c) ||
      embps_table_config_rows(c) > EMBPS_MAX_ROWS || !s->shard_width || !c->emb_width ||
      c->emb_width > EMBPS_MAX_EMB_WIDTH ||
      (uint64_t)s->col_begin + s->shard_width > c->emb_width || !s->group_size ||
      s->rank >= s->group_size || !s->data)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "checkpoint slice of table '%s' is not self-consistent", c->name);
  embps__ckpt_row_bytes(c, s->shard_width, rb);
  if ((rb[1] != 0) != (s->state0 != NULL) || (rb[2] != 0) != (s->state1 != NULL))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "checkpoint slice of table '%s' lacks or has extra optimizer state",
                           c->name);
  if ((s->dirty != NULL) != (s->base_round != 0) || (s->base_round && s->base_round >= s->round))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "checkpoint slice of table '%s': an incremental slice needs both a "
                           "dirty-row map and an earlier base round",
                           c->name);
  return EMBPS_OK;
}

static void blocks_start(blocks_t *it, const embps_ckpt_slice_t *s, size_t per_row) {
  memset(it, 0, sizeof(*it));
  it->dirty = s->dirty;
  it->rows = embps_table_config_rows(&s->config);
  it->per_block = embps__ckpt_rows_per_block(per_row);
}

embps_status_t embps_ckpt_write_slice(const char *path, const embps_ckpt_slice_t *s,
                                      uint64_t *bytes, embps_error_t *err) {
  size_t rb[3] = {0}, per_row; /* zeroed: -O3 cannot see check_slice set it */
  uint64_t first, written = 0;
  uint32_t n, blocks_crc = 0;
  blocks_t it;
  embps__ckpt_header_t h;
  uint8_t *head = NULL;
  size_t head_len = 0;
  embps__ckpt_out_t f = {.fd = -1};
  uint8_t bh[EMBPS__CKPT_BLOCK_HEADER], trailer[EMBPS__CKPT_TRAILER_BYTES];
  embps_status_t ret;

  if ((ret = check_slice(s, rb, err)) != EMBPS_OK)
    return ret;
  per_row = rb[0] + rb[1] + rb[2];
  memset(&h, 0, sizeof(h));
  blocks_start(&it, s, per_row);
  while (next_block(&it, &first, &n)) {
    h.blocks++;
    h.rows_written += n;
  }
  h.rank = s->rank;
  h.group_size = s->group_size;
  h.col_begin = s->col_begin;
  h.shard_width = s->shard_width;
  h.round = s->round;
  h.step = s->step;
  h.base_round = s->base_round;
  h.config = s->config;
  if (embps__ckpt_header_encode(&h, &head, &head_len) != 0)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);

  if ((ret = embps__ckpt_out_open(&f, path, err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_write(&f, head, head_len, err)) != EMBPS_OK)
    goto fail;
  written = head_len;
  blocks_start(&it, s, per_row);
  while (next_block(&it, &first, &n)) {
    const void *seg[3] = {(const uint8_t *)s->data + first * rb[0],
                          s->state0 ? (const uint8_t *)s->state0 + first * rb[1] : NULL,
                          s->state1 ? (const uint8_t *)s->state1 + first * rb[2] : NULL};
    embps__ckpt_block_t b = {.first = first, .rows = n, .bytes = (uint32_t)(n * per_row)};
    uint32_t c = embps__ckpt_block_put(bh, &b);
    for (int a = 0; a < 3; a++)
      if (rb[a])
        c = embps__ckpt_crc(c, seg[a], n * rb[a]);
    b.crc = c;
    embps__ckpt_block_put(bh, &b);
    blocks_crc = embps__ckpt_blocks_crc_add(blocks_crc, c);
    if ((ret = embps__ckpt_out_write(&f, bh, sizeof(bh), err)) != EMBPS_OK)
      goto fail;
    for (int a = 0; a < 3; a++)
      if (rb[a] && (ret = embps__ckpt_out_write(&f, seg[a], n * rb[a], err)) != EMBPS_OK)
        goto fail;
    written += sizeof(bh) + n * per_row;
  }
  embps__ckpt_trailer_put(trailer, h.blocks, h.rows_written, blocks_crc);
  if ((ret = embps__ckpt_out_write(&f, trailer, sizeof(trailer), err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_commit(&f, err)) != EMBPS_OK)
    goto fail;
  written += sizeof(trailer);
  embps_free(head);
  if (bytes)
    *bytes = written;
  return EMBPS_OK;
fail:
  embps_free(head);
  embps__ckpt_out_abandon(&f);
  return ret;
}
