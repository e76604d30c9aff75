/* A table of a checkpoint streamed in row order (ckpt_stream.h): what `embps export` reads.
 *
 * Every file of the chain that holds the table is open at once, each with a cursor: its next
 * block's offset and the block it holds, read and verified, until the rows asked for pass it.
 * Blocks are in ascending row order in every slice file, full or incremental, so one pass over
 * each file gives the rows in order: a read of rows [r0, r1) takes, checkpoint by checkpoint
 * oldest first and rank by rank, the overlap of each cursor's blocks with [r0, r1), so a later
 * checkpoint's rows overwrite an earlier one's as a restore applies them. Memory: one block per
 * file (a full slice's are about 1 MiB). A file's trailer is checked once its last block is read.
 *
 * When a single full slice file covers the whole table (a full checkpoint of one rank), blocks
 * lie at known offsets and a read of whole blocks goes straight into the caller's arrays with one
 * preadv each, verified there, as ckpt_reader.c's restore does. */
#include "server/store/ckpt_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/dtype.h"
#include "server/store/ckpt_internal.h"

#define BLOCK_HEADER EMBPS__CKPT_BLOCK_HEADER
#define PATH_CAP (EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40)

/* One slice file being read. */
typedef struct cursor {
  embps__ckpt_in_t f;
  char path[PATH_CAP];
  size_t rb[3], per_row;     /* the payload's bytes per row: data, state0, state1; their sum */
  uint32_t col_begin, width; /* the file's columns of the table */
  int per_row_state;         /* a per-row state is taken from this file (rank 0's) */
  uint64_t b, off;           /* the next block to read, and where it starts */
  uint64_t next_row;         /* the least first row the next block may have */
  uint64_t rows;             /* rows of the blocks read */
  uint32_t blocks_crc;       /* the crc32 of the blocks' crc32s, for the trailer */
  int have;                  /* blk and payload hold a verified block not yet passed */
  embps__ckpt_block_t blk;
  uint8_t *payload;
  size_t cap;
} cursor_t;

struct embps_ckpt_stream {
  embps_table_config_t cfg;
  uint64_t step, rows, pos, bytes, bytes_read;
  size_t n;
  cursor_t *cur;      /* oldest checkpoint first, then by rank */
  uint64_t per_block; /* in_place: a full slice's rows per block */
  int in_place;       /* one full slice covers the table: whole blocks are read in place */
  int failed;
};

static void cursor_close(cursor_t *c) {
  embps__ckpt_in_close(&c->f);
  embps_free(c->payload);
  c->payload = NULL;
}

void embps_ckpt_stream_close(embps_ckpt_stream_t *s) {
  if (!s)
    return;
  for (size_t i = 0; i < s->n; i++)
    cursor_close(&s->cur[i]);
  embps_free(s->cur);
  embps_free(s);
}

/* Opens the files of checkpoint c (which lists the table as tc) as cursors after s's others.
 * first: c is the oldest checkpoint read, whose files must hold every row. */
static embps_status_t open_layer(embps_ckpt_stream_t *s, const char *dir,
                                 const embps_ckpt_manifest_t *c, const embps_table_config_t *tc,
                                 int first, embps_error_t *err) {
  const uint32_t g = c->group_size, sw = g ? tc->emb_width / g : 0;
  cursor_t *more;
  embps_status_t ret;

  if (!sw || tc->emb_width % g)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint of round %" PRIu64 ": table '%s' of width %" PRIu32
                           " cannot have been written by %" PRIu32 " ranks",
                           c->round, tc->name, tc->emb_width, g);
  if (!(more = embps_realloc(s->cur, (s->n + g) * sizeof(*more))))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory opening a checkpoint");
  s->cur = more;
  for (size_t i = 0; i < s->n; i++) /* they moved: their files' names with them */
    s->cur[i].f.path = s->cur[i].path;
  for (uint32_t rank = 0; rank < g; rank++) {
    cursor_t *cu = &s->cur[s->n];
    memset(cu, 0, sizeof(*cu));
    ret = embps__ckpt_open_slice(dir, c, tc, rank, &cu->f, cu->path, sizeof(cu->path), err);
    s->n++;
    if (ret != EMBPS_OK)
      return ret;
    embps__ckpt_row_bytes(tc, sw, cu->rb);
    cu->per_row = cu->rb[0] + cu->rb[1] + cu->rb[2];
    cu->col_begin = rank * sw;
    cu->width = sw;
    cu->per_row_state = rank == 0;
    cu->off = cu->f.off;
    s->bytes += cu->f.size;
    s->bytes_read += cu->f.off; /* its header */
    s->step = cu->f.h.step;     /* the newest checkpoint's, as a restore takes it */
    (void)posix_fadvise(cu->f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    if (first && cu->f.h.rows_written != s->rows) {
      if (c->base_round)
        return embps_error_set(err, EMBPS_DATA_LOSS,
                               "the checkpoint chain is broken: the oldest checkpoint of round "
                               "%" PRIu64 " that holds table '%s' does not hold all of it",
                               c->round, tc->name);
      return embps_error_set(err, EMBPS_DATA_LOSS,
                             "checkpoint file %s is corrupt: a full checkpoint's slice holds "
                             "%" PRIu64 " of the table's %" PRIu64 " rows",
                             cu->path, cu->f.h.rows_written, s->rows);
    }
  }
  return EMBPS_OK;
}

embps_status_t embps_ckpt_stream_open(const char *dir, const embps_ckpt_manifest_t *m,
                                      const char *table, embps_ckpt_stream_t **out,
                                      embps_error_t *err) {
  const embps_table_config_t *cfg = embps__ckpt_find_table(m, table);
  embps_ckpt_manifest_t *chain = NULL; /* chain[0] is m's base, chain[1] its base, ... */
  size_t depth = 0;
  embps_ckpt_stream_t *s;
  embps_status_t ret;
  int started = 0;

  if (!cfg)
    return embps_error_set(err, EMBPS_NOT_FOUND,
                           "the checkpoint of round %" PRIu64 " holds no table '%s'", m->round,
                           table);
  if (!(s = embps_calloc(1, sizeof(*s))))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory opening a checkpoint");
  s->cfg = *cfg;
  s->rows = embps_table_config_rows(cfg);
  if ((ret = embps__ckpt_chain_read(dir, m, &chain, &depth, err)) != EMBPS_OK)
    goto fail;
  for (size_t i = depth + 1; i-- > 0;) {
    const embps_ckpt_manifest_t *c = i == 0 ? m : &chain[i - 1];
    const embps_table_config_t *tc = embps__ckpt_find_table(c, table);
    if (!tc)
      continue;
    if ((ret = embps__ckpt_chain_same_table(tc, cfg, c->round, m->round, err)) != EMBPS_OK ||
        (ret = open_layer(s, dir, c, tc, !started, err)) != EMBPS_OK)
      goto fail;
    started = 1;
  }
  if (s->n == 1 && s->cur[0].width == cfg->emb_width) {
    const embps__ckpt_header_t *h = &s->cur[0].f.h;
    s->per_block = embps__ckpt_rows_per_block(s->cur[0].per_row);
    s->in_place = h->base_round == 0 && h->blocks == (s->rows + s->per_block - 1) / s->per_block;
  }
  embps__ckpt_chain_free(chain, depth);
  *out = s;
  return EMBPS_OK;
fail:
  embps__ckpt_chain_free(chain, depth);
  embps_ckpt_stream_close(s);
  return ret;
}

const embps_table_config_t *embps_ckpt_stream_config(const embps_ckpt_stream_t *s) {
  return &s->cfg;
}
uint64_t embps_ckpt_stream_step(const embps_ckpt_stream_t *s) { return s->step; }
uint64_t embps_ckpt_stream_rows(const embps_ckpt_stream_t *s) { return s->rows; }
uint64_t embps_ckpt_stream_bytes(const embps_ckpt_stream_t *s) { return s->bytes; }
uint64_t embps_ckpt_stream_bytes_read(const embps_ckpt_stream_t *s) { return s->bytes_read; }

uint64_t embps_ckpt_stream_chunk_rows(const embps_ckpt_stream_t *s, size_t target_bytes) {
  size_t rb[3], row;
  uint64_t n;
  embps__ckpt_row_bytes(&s->cfg, s->cfg.emb_width, rb);
  row = rb[0] + rb[1] + rb[2];
  n = row ? target_bytes / row : 1;
  if (s->in_place)
    n = (n / s->per_block ? n / s->per_block : 1) * s->per_block;
  return n ? n : 1;
}

/* ---- reading ------------------------------------------------------------------------------- */

/* Copies rows [lo, hi) of cursor c's block (all verified) into the caller's arrays, whose row 0
 * is row r0 of the table. */
static void take(const embps_ckpt_stream_t *s, const cursor_t *c, uint64_t lo, uint64_t hi,
                 uint64_t r0, void *data, float *state0, float *state1) {
  const embps_optimizer_info_t *info = embps_optimizer_info(s->cfg.optimizer);
  const size_t esz[3] = {embps_dtype_size(s->cfg.dtype), sizeof(float), sizeof(float)};
  const uint32_t w = s->cfg.emb_width;
  const uint64_t k = hi - lo, i0 = lo - c->blk.first, j0 = lo - r0;
  uint8_t *dst[3] = {data, (uint8_t *)state0, (uint8_t *)state1};
  const uint8_t *src = c->payload;

  for (int a = 0; a < 3; src += (size_t)c->blk.rows * c->rb[a], a++) {
    if (!c->rb[a] || !dst[a])
      continue;
    if (a == 1 && info->state_per_row) { /* one float a row, the same on every rank */
      if (c->per_row_state)
        memcpy(dst[a] + j0 * sizeof(float), src + i0 * sizeof(float), k * sizeof(float));
      continue;
    }
    if (c->width == w) {
      memcpy(dst[a] + j0 * w * esz[a], src + i0 * c->rb[a], k * c->rb[a]);
      continue;
    }
    for (uint64_t i = 0; i < k; i++)
      memcpy(dst[a] + ((j0 + i) * w + c->col_begin) * esz[a], src + (i0 + i) * c->rb[a], c->rb[a]);
  }
}

/* Reads cursor c's next block (a full slice's, rows first..first+n-1, all inside the caller's
 * chunk starting at row r0) with one preadv straight into the caller's arrays (or the cursor's
 * buffer for an array not wanted), then verifies it. */
static embps_status_t read_in_place(embps_ckpt_stream_t *s, cursor_t *c, uint64_t first, uint32_t n,
                                    uint64_t r0, void *data, float *state0, float *state1,
                                    embps_error_t *err) {
  uint8_t bh[BLOCK_HEADER];
  uint8_t *dst[3] = {data, (uint8_t *)state0, (uint8_t *)state1};
  struct iovec iov[4] = {{.iov_base = bh, .iov_len = sizeof(bh)}};
  size_t want = 0, got_len = 0, scratch = 0;
  embps__ckpt_block_t blk;
  uint32_t crc;
  int cnt = 1;

  for (int a = 0; a < 3; a++)
    if (c->rb[a] && !dst[a] && (size_t)n * c->rb[a] > scratch)
      scratch = (size_t)n * c->rb[a];
  if (scratch > c->cap) {
    uint8_t *p = embps_realloc(c->payload, scratch);
    if (!p)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", c->path);
    c->payload = p;
    c->cap = scratch;
  }
  for (int a = 0; a < 3; a++)
    if (c->rb[a]) {
      iov[cnt].iov_base = dst[a] ? dst[a] + (first - r0) * c->rb[a] : c->payload;
      iov[cnt++].iov_len = (size_t)n * c->rb[a];
      want += (size_t)n * c->rb[a];
    }
  for (int i = 0; i < cnt;) {
    ssize_t r = preadv(c->f.fd, iov + i, cnt - i, (off_t)(c->off + got_len));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", c->path, strerror(errno));
    if (r == 0)
      return embps_error_set(err, EMBPS_DATA_LOSS,
                             "checkpoint file %s is truncated (in its block %" PRIu64 ")", c->path,
                             c->b);
    got_len += (size_t)r;
    for (; i < cnt && (size_t)r >= iov[i].iov_len; i++)
      r -= (ssize_t)iov[i].iov_len;
    if (i < cnt) {
      iov[i].iov_base = (uint8_t *)iov[i].iov_base + r;
      iov[i].iov_len -= (size_t)r;
    }
  }
  embps__ckpt_block_get(bh, &blk);
  if (blk.first != first || blk.rows != n || blk.bytes != want)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " claims rows %" PRIu64
                           "+%" PRIu32 " in %" PRIu32 " bytes where a full slice's block holds "
                           "%" PRIu64 "+%" PRIu32 " in %zu",
                           c->path, c->b, blk.first, blk.rows, blk.bytes, first, n, want);
  crc = embps__ckpt_crc(0, bh, 16);
  for (int a = 0; a < 3; a++)
    if (c->rb[a])
      crc = embps__ckpt_crc(crc, dst[a] ? dst[a] + (first - r0) * c->rb[a] : c->payload,
                            (size_t)n * c->rb[a]);
  if (crc != blk.crc)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " (rows %" PRIu64
                           "..%" PRIu64 ") fails its crc32 (expected %08" PRIx32
                           ", actual %08" PRIx32 ")",
                           c->path, c->b, first, first + n - 1, blk.crc, crc);
  c->blocks_crc = embps__ckpt_blocks_crc_add(c->blocks_crc, blk.crc);
  c->rows += n;
  c->next_row = first + n;
  c->off += got_len;
  c->b++;
  s->bytes_read += got_len;
  return EMBPS_OK;
}

/* Takes cursor c's rows in [r0, r1), reading its blocks as far as they go. */
static embps_status_t advance(embps_ckpt_stream_t *s, cursor_t *c, uint64_t r0, uint64_t r1,
                              void *data, float *state0, float *state1, embps_error_t *err) {
  embps_status_t ret;
  for (;;) {
    if (!c->have) {
      if (c->b == c->f.h.blocks)
        return EMBPS_OK;
      if (s->in_place) {
        const uint64_t first = c->b * s->per_block;
        const uint64_t n = s->rows - first < s->per_block ? s->rows - first : s->per_block;
        if (first >= r1)
          return EMBPS_OK;
        if (first >= r0 && first + n <= r1) {
          if ((ret = read_in_place(s, c, first, (uint32_t)n, r0, data, state0, state1, err)) !=
              EMBPS_OK)
            return ret;
          continue;
        }
      }
      if ((ret = embps__ckpt_read_block(&c->f, c->per_row, c->b, c->off, c->next_row, &c->blk,
                                        &c->payload, &c->cap, err)) != EMBPS_OK)
        return ret;
      c->have = 1;
      c->blocks_crc = embps__ckpt_blocks_crc_add(c->blocks_crc, c->blk.crc);
      c->rows += c->blk.rows;
      c->next_row = c->blk.first + c->blk.rows;
      c->off += BLOCK_HEADER + (uint64_t)c->blk.bytes;
      c->b++;
      s->bytes_read += BLOCK_HEADER + (uint64_t)c->blk.bytes;
    }
    if (c->blk.first >= r1)
      return EMBPS_OK;
    take(s, c, c->blk.first > r0 ? c->blk.first : r0, c->next_row < r1 ? c->next_row : r1, r0, data,
         state0, state1);
    if (c->next_row > r1)
      return EMBPS_OK; /* the rest of the block belongs to the next read */
    c->have = 0;
  }
}

embps_status_t embps_ckpt_stream_read(embps_ckpt_stream_t *s, uint64_t n, void *data, float *state0,
                                      float *state1, embps_error_t *err) {
  const uint64_t r0 = s->pos;
  embps_status_t ret = EMBPS_OK;

  if (s->failed)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "the checkpoint stream of table '%s' failed before", s->cfg.name);
  if (n > s->rows - s->pos)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "%" PRIu64 " rows asked of table '%s', which has %" PRIu64 " left", n,
                           s->cfg.name, s->rows - s->pos);
  for (size_t i = 0; i < s->n && ret == EMBPS_OK; i++)
    ret = advance(s, &s->cur[i], r0, r0 + n, data, state0, state1, err);
  if (ret == EMBPS_OK)
    s->pos += n;
  for (size_t i = 0; ret == EMBPS_OK && s->pos == s->rows && i < s->n; i++) {
    cursor_t *c = &s->cur[i];
    if (c->have || c->b != c->f.h.blocks) /* cannot be: every block ends at or before the end */
      ret = embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s has blocks past its table",
                            c->path);
    else if (c->f.off != c->f.size) { /* not checked yet */
      ret = embps__ckpt_check_trailer(&c->f, c->off, c->blocks_crc, c->rows, err);
      s->bytes_read += EMBPS__CKPT_TRAILER_BYTES;
    }
  }
  if (ret != EMBPS_OK)
    s->failed = 1;
  return ret;
}
