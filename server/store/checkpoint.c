/* Checkpoint files (checkpoint.h).
 *
 * Byte layouts. Integers are little-endian, floats their IEEE-754 bits as a u32; a name is its
 * length (u32) and its bytes; a table spec is name | rows u64 | emb_width u32 | dtype u32 |
 * seed u64 | init_scale | optimizer u32 | lr | eps | half_life | initial_accumulator |
 * weight_decay | beta1 | beta2.
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
#include "server/store/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <isa-l/crc.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "common/cpus.h"
#include "common/dtype.h"

#define SLICE_MAGIC "EMBPSCKP"
#define TRAILER_MAGIC "EMBPSEND"
#define MANIFEST_MAGIC "EMBPSMAN"
#define BLOCK_HEADER 20u
#define TRAILER_BYTES 32u
#define HEADER_MAX 4096u
/* A block holds about this much payload: big enough that the per-block work vanishes, small
 * enough that a reader's buffer stays small. */
#define BLOCK_TARGET (1u << 20)
/* A manifest larger than this is not one (a million files is far beyond any group). */
#define MANIFEST_MAX (256u << 20)

/* The gzip/zlib crc32 (reflected 0x04C11DB7; zlib's crc32() gives the same values), from
 * ISA-L: its folding with carry-less multiplies ran at 28 GB/s on this project's 2-core VM
 * against zlib 1.2.13's 6 GB/s (256 MiB, 2026-12-03), and a restore verifies every byte. */
static uint32_t crc(uint32_t c, const void *p, size_t n) { return crc32_gzip_refl(c, p, n); }

/* ---- building and parsing byte strings ---------------------------------------------------------
 */

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

static void put_f32(wbuf_t *b, float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  put_u32(b, u);
}

static void put_name(wbuf_t *b, const char *s) {
  size_t n = strnlen(s, EMBPS_TABLE_NAME_MAX - 1);
  put_u32(b, (uint32_t)n);
  put(b, s, n);
}

static void put_crc(wbuf_t *b) { put_u32(b, b->oom ? 0 : crc(0, b->p, b->len)); }

static void put_config(wbuf_t *b, const embps_table_config_t *c) {
  put_name(b, c->name);
  put_u64(b, c->rows);
  put_u32(b, c->emb_width);
  put_u32(b, (uint32_t)c->dtype);
  put_u64(b, c->seed);
  put_f32(b, c->init_scale);
  put_u32(b, (uint32_t)c->optimizer);
  put_f32(b, c->lr);
  put_f32(b, c->eps);
  put_f32(b, c->half_life);
  put_f32(b, c->initial_accumulator);
  put_f32(b, c->weight_decay);
  put_f32(b, c->beta1);
  put_f32(b, c->beta2);
}

typedef struct rbuf {
  const uint8_t *p;
  size_t len, off;
  int bad; /* read past the end, or a name too long */
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

static float get_f32(rbuf_t *r) {
  uint32_t u = get_u32(r);
  float v;
  memcpy(&v, &u, 4);
  return v;
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

static void get_config(rbuf_t *r, embps_table_config_t *c) {
  memset(c, 0, sizeof(*c));
  get_name(r, c->name);
  c->rows = get_u64(r);
  c->emb_width = get_u32(r);
  c->dtype = (embps_dtype_t)get_u32(r);
  c->seed = get_u64(r);
  c->init_scale = get_f32(r);
  c->optimizer = (embps_optimizer_t)get_u32(r);
  c->lr = get_f32(r);
  c->eps = get_f32(r);
  c->half_life = get_f32(r);
  c->initial_accumulator = get_f32(r);
  c->weight_decay = get_f32(r);
  c->beta1 = get_f32(r);
  c->beta2 = get_f32(r);
}

/* Whether two specs describe the same table (compared as they were written, bit for bit). */
static int same_config(const embps_table_config_t *a, const embps_table_config_t *b) {
  wbuf_t x = {0}, y = {0};
  int same;
  put_config(&x, a);
  put_config(&y, b);
  same = !x.oom && !y.oom && x.len == y.len && memcmp(x.p, y.p, x.len) == 0;
  embps_free(x.p);
  embps_free(y.p);
  return same;
}

/* ---- files ----------------------------------------------------------------------------------- */

static embps_status_t io_error(embps_error_t *err, int e, const char *what, const char *path) {
  if (e == ENOSPC || e == EDQUOT)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "no space left on device writing %s",
                           path);
  return embps_error_set(err, EMBPS_INTERNAL, "cannot %s %s: %s", what, path, strerror(e));
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads exactly n bytes; returns 1, 0 at end of file before n bytes, -1 on error (errno). */
static int read_all(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n) {
    ssize_t r = read(fd, b, n);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    if (r == 0)
      return 0;
    b += r;
    n -= (size_t)r;
  }
  return 1;
}

/* A file written durably: to path.tmp, then finished by commit (fsync, close, rename) or
 * dropped by abandon (close, unlink). Small writes (an incremental slice's short runs of rows)
 * gather in a buffer, so that the file goes out in large write calls. */
typedef struct outfile {
  int fd;
  const char *path;
  char tmp[EMBPS_CKPT_PATH_MAX + 8];
  uint8_t *buf;
  size_t len;
  uint64_t written, kicked; /* bytes written; bytes whose writeback was started */
} outfile_t;

#define OUT_BUFFER (1u << 20)
/* Every this many bytes, writeback of what was written is started (sync_file_range), so the
 * disk works while the next blocks are checksummed and copied, and the final fsync finds
 * little left: a checkpoint then takes about as long as the disk needs, not CPU time plus that.
 * Advice only: the fsync at commit reports any error. */
#define OUT_KICK (8u << 20)

static embps_status_t out_open(outfile_t *f, const char *path, embps_error_t *err) {
  f->path = path;
  if (snprintf(f->tmp, sizeof(f->tmp), "%s.tmp", path) >= (int)sizeof(f->tmp))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "checkpoint path too long: %s", path);
  if (!(f->buf = embps_malloc(OUT_BUFFER)))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);
  f->len = 0;
  f->written = f->kicked = 0;
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0)
    return io_error(err, errno, "create", f->tmp);
  return EMBPS_OK;
}

static embps_status_t out_put(outfile_t *f, const void *p, size_t n, embps_error_t *err) {
  if (write_all(f->fd, p, n) != 0)
    return io_error(err, errno, "write", f->path);
  f->written += n;
  if (f->written - f->kicked >= OUT_KICK) {
    (void)sync_file_range(f->fd, (off_t)f->kicked, (off_t)(f->written - f->kicked),
                          SYNC_FILE_RANGE_WRITE);
    f->kicked = f->written;
  }
  return EMBPS_OK;
}

static embps_status_t out_flush(outfile_t *f, embps_error_t *err) {
  embps_status_t ret;
  if (f->len && (ret = out_put(f, f->buf, f->len, err)) != EMBPS_OK)
    return ret;
  f->len = 0;
  return EMBPS_OK;
}

static embps_status_t out_write(outfile_t *f, const void *p, size_t n, embps_error_t *err) {
  embps_status_t ret;
  if (f->len + n > OUT_BUFFER && (ret = out_flush(f, err)) != EMBPS_OK)
    return ret;
  if (n >= OUT_BUFFER)
    return out_put(f, p, n, err);
  memcpy(f->buf + f->len, p, n);
  f->len += n;
  return EMBPS_OK;
}

static void out_abandon(outfile_t *f) {
  if (f->fd >= 0)
    close(f->fd);
  f->fd = -1;
  embps_free(f->buf);
  f->buf = NULL;
  unlink(f->tmp);
}

static embps_status_t out_commit(outfile_t *f, embps_error_t *err) {
  embps_status_t ret = out_flush(f, err);
  embps_free(f->buf);
  f->buf = NULL;
  if (ret != EMBPS_OK)
    return ret; /* the caller abandons the file */
  if (fsync(f->fd) != 0)
    ret = io_error(err, errno, "fsync", f->path);
  if (close(f->fd) != 0 && ret == EMBPS_OK)
    ret = io_error(err, errno, "close", f->path);
  f->fd = -1;
  if (ret == EMBPS_OK && rename(f->tmp, f->path) != 0)
    ret = io_error(err, errno, "rename onto", f->path);
  if (ret != EMBPS_OK)
    unlink(f->tmp);
  return ret;
}

embps_status_t embps_ckpt_sync_dir(const char *dir, embps_error_t *err) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  embps_status_t ret = EMBPS_OK;
  if (fd < 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open directory %s: %s", dir,
                           strerror(errno));
  if (fsync(fd) != 0)
    ret = io_error(err, errno, "fsync directory", dir);
  close(fd);
  return ret;
}

void embps_ckpt_slice_name(char *out, size_t cap, uint32_t rank, const char *table) {
  snprintf(out, cap, "r%" PRIu32 "-%s.embps", rank, table);
}

void embps_ckpt_path(char *out, size_t cap, const char *dir, uint64_t round) {
  snprintf(out, cap, "%s/ckpt-%020" PRIu64, dir, round);
}

/* ---- slices ---------------------------------------------------------------------------------- */

/* The bytes of one row in each of a slice's arrays (data, state0, state1). */
static void row_bytes(const embps_table_config_t *cfg, uint32_t shard_width, size_t out[3]) {
  const embps_optimizer_info_t *info = embps_optimizer_info(cfg->optimizer);
  out[0] = (size_t)shard_width * embps_dtype_size(cfg->dtype);
  out[1] = !info                     ? 0
           : info->state_per_row     ? sizeof(float)
           : info->state_per_element ? (size_t)shard_width * sizeof(float)
                                     : 0;
  out[2] = info && info->state_per_element >= 2 ? (size_t)shard_width * sizeof(float) : 0;
}

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
  if (!info || !embps_dtype_size(c->dtype) || !c->rows || c->rows > EMBPS_MAX_ROWS ||
      !s->shard_width || !c->emb_width || c->emb_width > EMBPS_MAX_EMB_WIDTH ||
      (uint64_t)s->col_begin + s->shard_width > c->emb_width || !s->group_size ||
      s->rank >= s->group_size || !s->data)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "checkpoint slice of table '%s' is not self-consistent", c->name);
  row_bytes(c, s->shard_width, rb);
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

embps_status_t embps_ckpt_write_slice(const char *path, const embps_ckpt_slice_t *s,
                                      uint64_t *bytes, embps_error_t *err) {
  size_t rb[3] = {0}, per_row; /* zeroed: -O3 cannot see check_slice set it */
  uint64_t nblocks = 0, nrows = 0, first, written = 0;
  uint32_t n, blocks_crc = 0;
  blocks_t it;
  wbuf_t h = {0};
  outfile_t f = {.fd = -1};
  uint8_t bh[BLOCK_HEADER], trailer[TRAILER_BYTES];
  embps_status_t ret;

  if ((ret = check_slice(s, rb, err)) != EMBPS_OK)
    return ret;
  per_row = rb[0] + rb[1] + rb[2];
  memset(&it, 0, sizeof(it));
  it.dirty = s->dirty;
  it.rows = s->config.rows;
  it.per_block = per_row >= BLOCK_TARGET ? 1 : BLOCK_TARGET / per_row;
  while (next_block(&it, &first, &n)) {
    nblocks++;
    nrows += n;
  }

  put(&h, SLICE_MAGIC, 8);
  put_u32(&h, EMBPS_CKPT_FORMAT_VERSION);
  put_u32(&h, 0); /* the header's length, set below */
  put_u32(&h, s->rank);
  put_u32(&h, s->group_size);
  put_u32(&h, s->col_begin);
  put_u32(&h, s->shard_width);
  put_u64(&h, s->round);
  put_u64(&h, s->step);
  put_u64(&h, s->base_round);
  put_u64(&h, nblocks);
  put_u64(&h, nrows);
  put_config(&h, &s->config);
  if (h.oom) {
    embps_free(h.p);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);
  }
  embps_put_le32(h.p + 12, (uint32_t)h.len + 4);
  put_crc(&h);

  if ((ret = out_open(&f, path, err)) != EMBPS_OK || (ret = out_write(&f, h.p, h.len, err)) != 0)
    goto fail;
  written = h.len;
  memset(&it, 0, sizeof(it));
  it.dirty = s->dirty;
  it.rows = s->config.rows;
  it.per_block = per_row >= BLOCK_TARGET ? 1 : BLOCK_TARGET / per_row;
  while (next_block(&it, &first, &n)) {
    const void *seg[3] = {(const uint8_t *)s->data + first * rb[0],
                          s->state0 ? (const uint8_t *)s->state0 + first * rb[1] : NULL,
                          s->state1 ? (const uint8_t *)s->state1 + first * rb[2] : NULL};
    uint32_t c;
    embps_put_le64(bh, first);
    embps_put_le32(bh + 8, n);
    embps_put_le32(bh + 12, (uint32_t)(n * per_row));
    c = crc(0, bh, 16);
    for (int a = 0; a < 3; a++)
      if (rb[a])
        c = crc(c, seg[a], n * rb[a]);
    embps_put_le32(bh + 16, c);
    embps_put_le32(trailer, c); /* scratch: the crc as the trailer sums it */
    blocks_crc = crc(blocks_crc, trailer, 4);
    if ((ret = out_write(&f, bh, sizeof(bh), err)) != EMBPS_OK)
      goto fail;
    for (int a = 0; a < 3; a++)
      if (rb[a] && (ret = out_write(&f, seg[a], n * rb[a], err)) != EMBPS_OK)
        goto fail;
    written += sizeof(bh) + n * per_row;
  }
  memcpy(trailer, TRAILER_MAGIC, 8);
  embps_put_le64(trailer + 8, nblocks);
  embps_put_le64(trailer + 16, nrows);
  embps_put_le32(trailer + 24, blocks_crc);
  embps_put_le32(trailer + 28, crc(0, trailer, 28));
  if ((ret = out_write(&f, trailer, sizeof(trailer), err)) != EMBPS_OK ||
      (ret = out_commit(&f, err)) != EMBPS_OK)
    goto fail;
  written += sizeof(trailer);
  embps_free(h.p);
  if (bytes)
    *bytes = written;
  return EMBPS_OK;
fail:
  embps_free(h.p);
  out_abandon(&f);
  return ret;
}

/* One slice file opened for reading, its header parsed and verified. */
typedef struct infile {
  int fd;
  const char *path;
  uint64_t size, off;
  uint32_t rank, group_size, col_begin, shard_width;
  uint64_t round, step, base_round, blocks, rows_written;
  embps_table_config_t config;
} infile_t;

static embps_status_t truncated(embps_error_t *err, const char *path, const char *what) {
  return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s is truncated (in its %s)", path,
                         what);
}

static embps_status_t read_at(infile_t *f, void *p, size_t n, const char *what,
                              embps_error_t *err) {
  int r = read_all(f->fd, p, n);
  if (r < 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", f->path, strerror(errno));
  if (r == 0)
    return truncated(err, f->path, what);
  f->off += n;
  return EMBPS_OK;
}

static embps_status_t crc_mismatch(embps_error_t *err, const char *path, const char *what,
                                   uint32_t expected, uint32_t actual) {
  return embps_error_set(
      err, EMBPS_DATA_LOSS,
      "checkpoint file %s is corrupt: its %s fails its crc32 (expected %08" PRIx32
      ", actual %08" PRIx32 ")",
      path, what, expected, actual);
}

/* Checks magic and format version of the 16 bytes that start a slice file or a manifest. */
static embps_status_t check_preamble(const uint8_t *p, const char *magic, const char *path,
                                     embps_error_t *err) {
  uint32_t version = embps_get_le32(p + 8);
  if (memcmp(p, magic, 8) != 0)
    return embps_error_set(err, EMBPS_DATA_LOSS, "%s is not an embps checkpoint file (bad magic)",
                           path);
  if (version != EMBPS_CKPT_FORMAT_VERSION)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "%s has checkpoint format version %" PRIu32
                           "; this build reads version %u",
                           path, version, EMBPS_CKPT_FORMAT_VERSION);
  return EMBPS_OK;
}

static embps_status_t in_open(infile_t *f, const char *path, uint64_t want_bytes,
                              embps_error_t *err) {
  struct stat st;
  uint8_t pre[16], *h = NULL;
  uint32_t hlen, want, got;
  rbuf_t r;
  embps_status_t ret;

  memset(f, 0, sizeof(*f));
  f->path = path;
  if ((f->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
    if (errno == ENOENT)
      return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s is missing", path);
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open %s: %s", path, strerror(errno));
  }
  if (fstat(f->fd, &st) != 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot stat %s: %s", path, strerror(errno));
  f->size = (uint64_t)st.st_size;
  if (f->size != want_bytes)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s has %" PRIu64 " bytes, its manifest says %" PRIu64
                           ": it is truncated or was overwritten",
                           path, f->size, want_bytes);
  if ((ret = read_at(f, pre, sizeof(pre), "header", err)) != EMBPS_OK ||
      (ret = check_preamble(pre, SLICE_MAGIC, path, err)) != EMBPS_OK)
    return ret;
  hlen = embps_get_le32(pre + 12);
  if (hlen < sizeof(pre) + 4 || hlen > HEADER_MAX)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: header length %" PRIu32, path, hlen);
  if (!(h = embps_malloc(hlen)))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
  memcpy(h, pre, sizeof(pre));
  if ((ret = read_at(f, h + sizeof(pre), hlen - sizeof(pre), "header", err)) != EMBPS_OK)
    goto exit;
  want = embps_get_le32(h + hlen - 4);
  if ((got = crc(0, h, hlen - 4)) != want) {
    ret = crc_mismatch(err, path, "header", want, got);
    goto exit;
  }
  r = (rbuf_t){.p = h, .len = hlen - 4, .off = sizeof(pre)};
  f->rank = get_u32(&r);
  f->group_size = get_u32(&r);
  f->col_begin = get_u32(&r);
  f->shard_width = get_u32(&r);
  f->round = get_u64(&r);
  f->step = get_u64(&r);
  f->base_round = get_u64(&r);
  f->blocks = get_u64(&r);
  f->rows_written = get_u64(&r);
  get_config(&r, &f->config);
  if (r.bad || r.off != r.len)
    ret = embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s has a malformed header", path);
exit:
  embps_free(h);
  return ret;
}

static void in_close(infile_t *f) {
  if (f->fd >= 0)
    close(f->fd);
  f->fd = -1;
}

/* Where one file's columns land in the destination. */
typedef struct scatter {
  embps_ckpt_dest_t *dst;
  uint32_t from, width; /* the overlap, in the file's columns */
  uint32_t to;          /* the overlap's first column in dst */
  int per_row;          /* take the per-row state from this file */
} scatter_t;

/* Copies the overlapping columns of rows first..first+n-1 of one array from a block's payload
 * segment into a destination array (both rows-major; widths and offsets in elements). */
static void copy_columns(uint8_t *dst, uint32_t dst_width, const uint8_t *seg, uint32_t seg_width,
                         const scatter_t *sc, size_t esz, uint64_t first, uint32_t n) {
  if (sc->from == 0 && sc->to == 0 && sc->width == seg_width && seg_width == dst_width) {
    memcpy(dst + first * dst_width * esz, seg, (size_t)n * seg_width * esz);
    return;
  }
  for (uint32_t i = 0; i < n; i++)
    memcpy(dst + ((first + i) * dst_width + sc->to) * esz,
           seg + ((size_t)i * seg_width + sc->from) * esz, (size_t)sc->width * esz);
}

static void scatter_block(const scatter_t *sc, const infile_t *f, const size_t rb[3],
                          const uint8_t *payload, uint64_t first, uint32_t n) {
  const embps_ckpt_dest_t *d = sc->dst;
  const uint8_t *state0 = payload + (size_t)n * rb[0], *state1 = state0 + (size_t)n * rb[1];
  if (sc->width) {
    copy_columns(d->data, d->shard_width, payload, f->shard_width, sc,
                 embps_dtype_size(f->config.dtype), first, n);
    if (rb[1] && !embps_optimizer_info(f->config.optimizer)->state_per_row)
      copy_columns((uint8_t *)d->state0, d->shard_width, state0, f->shard_width, sc, sizeof(float),
                   first, n);
    if (rb[2])
      copy_columns((uint8_t *)d->state1, d->shard_width, state1, f->shard_width, sc, sizeof(float),
                   first, n);
  }
  if (rb[1] && sc->per_row && embps_optimizer_info(f->config.optimizer)->state_per_row)
    memcpy(d->state0 + first, state0, (size_t)n * sizeof(float));
}

/* Fills the cnt buffers of iov (which it consumes) from the bytes at off on; EMBPS_OK,
 * DATA_LOSS (the file ends first) or INTERNAL. */
static embps_status_t preadv_exact(const infile_t *f, struct iovec *iov, int cnt, uint64_t off,
                                   const char *what, embps_error_t *err) {
  for (; cnt > 0 && iov->iov_len == 0; iov++, cnt--) /* nothing to read into */
    ;
  while (cnt > 0) {
    ssize_t r = preadv(f->fd, iov, cnt, (off_t)off);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", f->path, strerror(errno));
    if (r == 0)
      return truncated(err, f->path, what);
    off += (uint64_t)r;
    for (; cnt > 0 && (size_t)r >= iov->iov_len; iov++, cnt--) /* the buffers it filled */
      r -= (ssize_t)iov->iov_len;
    if (cnt > 0) { /* and the part of the next */
      iov->iov_base = (uint8_t *)iov->iov_base + r;
      iov->iov_len -= (size_t)r;
    }
  }
  return EMBPS_OK;
}

/* Reads exactly n bytes at off; as preadv_exact. */
static embps_status_t pread_exact(const infile_t *f, void *p, size_t n, uint64_t off,
                                  const char *what, embps_error_t *err) {
  struct iovec iov = {.iov_base = p, .iov_len = n};
  return preadv_exact(f, &iov, 1, off, what, err);
}

static embps_status_t block_crc_mismatch(embps_error_t *err, const infile_t *f, uint64_t b,
                                         uint64_t first, uint32_t n, uint32_t want, uint32_t got) {
  return embps_error_set(err, EMBPS_DATA_LOSS,
                         "checkpoint file %s is corrupt: block %" PRIu64 " (rows %" PRIu64
                         "..%" PRIu64 ") fails its crc32 (expected %08" PRIx32 ", actual %08" PRIx32
                         ")",
                         f->path, b, first, first + n - 1, want, got);
}

/* One reader of blocks: its payload buffer, reused from block to block. */
typedef struct reader {
  const infile_t *f;
  const scatter_t *sc;
  size_t rb[3], per_row;
  uint8_t *payload;
  size_t cap;
} reader_t;

/* Reads block b at off (its first row at least min_row), verifies it and scatters its rows;
 * sets its crc, first row, row count and length. */
static embps_status_t read_block(reader_t *rd, uint64_t b, uint64_t off, uint64_t min_row,
                                 uint32_t *crc_out, uint64_t *first_out, uint32_t *n_out,
                                 uint32_t *len_out, embps_error_t *err) {
  const infile_t *f = rd->f;
  uint8_t bh[BLOCK_HEADER];
  uint64_t first;
  uint32_t n, len, want, got;
  embps_status_t ret;
  char what[48];

  snprintf(what, sizeof(what), "block %" PRIu64, b);
  if ((ret = pread_exact(f, bh, sizeof(bh), off, what, err)) != EMBPS_OK)
    return ret;
  first = embps_get_le64(bh);
  n = embps_get_le32(bh + 8);
  len = embps_get_le32(bh + 12);
  want = embps_get_le32(bh + 16);
  if (!n || first < min_row || first > f->config.rows || n > f->config.rows - first ||
      (uint64_t)len != (uint64_t)n * rd->per_row || len > f->size - off - sizeof(bh))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " claims rows %" PRIu64
                           "+%" PRIu32 " in %" PRIu32 " bytes (crc32 %08" PRIx32
                           "), which the table cannot hold",
                           f->path, b, first, n, len, want);
  if (len > rd->cap) {
    uint8_t *p = embps_realloc(rd->payload, len);
    if (!p)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", f->path);
    rd->payload = p;
    rd->cap = len;
  }
  if ((ret = pread_exact(f, rd->payload, len, off + sizeof(bh), what, err)) != EMBPS_OK)
    return ret;
  got = crc(crc(0, bh, 16), rd->payload, len);
  if (got != want)
    return block_crc_mismatch(err, f, b, first, n, want, got);
  scatter_block(rd->sc, f, rd->rb, rd->payload, first, n);
  *crc_out = want;
  *first_out = first;
  *n_out = n;
  *len_out = len;
  return EMBPS_OK;
}

/* A full slice's blocks all hold per_block rows but the last (the writer's rule, part of the
 * format), so block b starts at a known offset and threads can read ranges of blocks at once:
 * a restore is bound by the kernel's copy, the crc32 and the first touch of the new table's
 * pages, which one core alone does at about half a disk's sequential read. Two readers per core
 * keep the disk busy while the other computes. */
#define READ_THREADS_MAX 4
#define READ_BLOCKS_PER_THREAD_MIN 8

typedef struct range_job {
  reader_t rd;
  uint64_t begin, end, per_block, base;
  uint32_t *crcs;
  embps_error_t err;
  uint64_t failed; /* the block that failed, or UINT64_MAX */
  int in_place;    /* read_block_in_place, not read_block */
  pthread_t thread;
} range_job_t;

/* Whether a block's payload can be read straight into sc's destination: the file's slice is
 * exactly the destination's columns, so each of the payload's arrays is one run of the
 * destination's (data, state0, state1 at the block's first row). */
static int reads_in_place(const scatter_t *sc, const infile_t *f, const size_t rb[3]) {
  const embps_ckpt_dest_t *d = sc->dst;
  const int per_row_state = rb[1] && embps_optimizer_info(f->config.optimizer)->state_per_row;
  return sc->from == 0 && sc->to == 0 && sc->width == f->shard_width &&
         d->shard_width == f->shard_width && (!per_row_state || sc->per_row) &&
         (!rb[1] || d->state0) && (!rb[2] || d->state1);
}

/* Reads block b of a full slice (rows first..first+n-1, len payload bytes) with one preadv: its
 * header into bh and its payload's arrays straight into the destination, then verifies both.
 * No bounce buffer and no copy: the restore's cost is the kernel's copy and the crc32. A block
 * that fails leaves unverified rows in the destination; a failed restore discards the table. */
static embps_status_t read_block_in_place(const range_job_t *j, uint64_t b, uint64_t off,
                                          uint64_t first, uint32_t n, uint32_t *crc_out,
                                          embps_error_t *err) {
  const infile_t *f = j->rd.f;
  const embps_ckpt_dest_t *d = j->rd.sc->dst;
  const size_t *rb = j->rd.rb;
  uint8_t bh[BLOCK_HEADER];
  uint8_t *arrays[3] = {(uint8_t *)d->data, (uint8_t *)d->state0, (uint8_t *)d->state1};
  struct iovec iov[4] = {{.iov_base = bh, .iov_len = sizeof(bh)}};
  size_t want_len = sizeof(bh);
  int cnt = 1;
  char what[48];
  uint32_t want, got;
  embps_status_t ret;

  for (int a = 0; a < 3; a++)
    if (rb[a]) {
      iov[cnt].iov_base = arrays[a] + first * rb[a];
      iov[cnt++].iov_len = (size_t)n * rb[a];
      want_len += (size_t)n * rb[a];
    }
  snprintf(what, sizeof(what), "block %" PRIu64, b);
  if ((ret = preadv_exact(f, iov, cnt, off, what, err)) != EMBPS_OK)
    return ret;
  want = embps_get_le32(bh + 16);
  if (embps_get_le64(bh) != first || embps_get_le32(bh + 8) != n ||
      embps_get_le32(bh + 12) != want_len - sizeof(bh))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " claims rows %" PRIu64
                           "+%" PRIu32 " in %" PRIu32 " bytes where a full slice's block holds "
                           "%" PRIu64 "+%" PRIu32 " in %zu",
                           f->path, b, embps_get_le64(bh), embps_get_le32(bh + 8),
                           embps_get_le32(bh + 12), first, n, want_len - sizeof(bh));
  got = crc(0, bh, 16);
  for (int a = 0; a < 3; a++)
    if (rb[a])
      got = crc(got, arrays[a] + first * rb[a], (size_t)n * rb[a]);
  if (got != want)
    return block_crc_mismatch(err, f, b, first, n, want, got);
  *crc_out = want;
  return EMBPS_OK;
}

static void *read_range(void *arg) {
  range_job_t *j = arg;
  const uint64_t stride = BLOCK_HEADER + j->per_block * j->rd.per_row;
  const uint64_t rows = j->rd.f->config.rows;
  j->failed = UINT64_MAX;
  for (uint64_t b = j->begin; b < j->end; b++) {
    const uint64_t want_first = b * j->per_block;
    const uint64_t want_n = rows - want_first < j->per_block ? rows - want_first : j->per_block;
    uint64_t first;
    uint32_t n, len;
    if (j->in_place) {
      if (read_block_in_place(j, b, j->base + b * stride, want_first, (uint32_t)want_n, &j->crcs[b],
                              &j->err) != EMBPS_OK) {
        j->failed = b;
        break;
      }
      continue;
    }
    if (read_block(&j->rd, b, j->base + b * stride, want_first, &j->crcs[b], &first, &n, &len,
                   &j->err) != EMBPS_OK) {
      j->failed = b;
      break;
    }
    if (first != want_first || n != want_n) {
      embps_error_set(&j->err, EMBPS_DATA_LOSS,
                      "checkpoint file %s is corrupt: block %" PRIu64 " holds rows %" PRIu64
                      "+%" PRIu32 " where a full slice's block holds %" PRIu64 "+%" PRIu64,
                      j->rd.f->path, b, first, n, want_first, want_n);
      j->failed = b;
      break;
    }
  }
  return NULL;
}

/* Reads the blocks of full slice f with threads; returns where the trailer starts in *end_off
 * and the blocks' crc32s in crcs. Falls back to *parallel = 0 when f is not laid out as a full
 * slice or is too small to split. */
static embps_status_t read_parallel(infile_t *f, const scatter_t *sc, uint32_t *crcs,
                                    uint64_t *end_off, int *parallel, embps_error_t *err) {
  range_job_t jobs[READ_THREADS_MAX];
  reader_t proto = {.f = f, .sc = sc};
  uint64_t per_block, threads;
  const unsigned cpus = embps_usable_cpus();
  embps_status_t ret = EMBPS_OK;
  size_t started = 0;
  int in_place;

  row_bytes(&f->config, f->shard_width, proto.rb);
  proto.per_row = proto.rb[0] + proto.rb[1] + proto.rb[2];
  per_block = proto.per_row >= BLOCK_TARGET ? 1 : BLOCK_TARGET / proto.per_row;
  threads = cpus > 1 ? (uint64_t)cpus * 2 : 1; /* the CPUs the process may use, not the host's */
  if (threads > READ_THREADS_MAX)
    threads = READ_THREADS_MAX;
  if (threads > f->blocks / READ_BLOCKS_PER_THREAD_MIN)
    threads = f->blocks / READ_BLOCKS_PER_THREAD_MIN;
  *parallel = f->base_round == 0 && f->rows_written == f->config.rows &&
              f->blocks == (f->config.rows + per_block - 1) / per_block && threads > 1;
  if (!*parallel)
    return EMBPS_OK;
  in_place = reads_in_place(sc, f, proto.rb);
  for (uint64_t k = 0; k < threads; k++) {
    range_job_t *j = &jobs[k];
    memset(j, 0, sizeof(*j));
    j->rd = proto;
    j->begin = f->blocks * k / threads;
    j->end = f->blocks * (k + 1) / threads;
    j->per_block = per_block;
    j->base = f->off;
    j->crcs = crcs;
    j->failed = UINT64_MAX;
    j->in_place = in_place;
    if (k > 0 && pthread_create(&j->thread, NULL, read_range, j) != 0)
      break; /* the blocks of this range and the later ones are read below, in this thread */
    started = k + 1;
  }
  read_range(&jobs[0]);
  for (size_t k = 1; k < started; k++)
    pthread_join(jobs[k].thread, NULL);
  for (size_t k = started; k < threads; k++) /* ranges whose thread did not start */
    read_range(&jobs[k]);
  {
    uint64_t worst = UINT64_MAX;
    for (uint64_t k = 0; k < threads; k++) {
      if (jobs[k].failed < worst) { /* the first failing block, as a serial read reports it */
        worst = jobs[k].failed;
        *err = jobs[k].err;
        ret = err->status;
      }
      embps_free(jobs[k].rd.payload);
    }
  }
  *end_off = f->off + f->blocks * BLOCK_HEADER + f->config.rows * proto.per_row;
  return ret;
}

/* Reads every block of f (verifying each) and its trailer, scattering the rows into sc's
 * destination. *covered counts the rows the file held. */
static embps_status_t apply_file(infile_t *f, const scatter_t *sc, uint64_t *covered,
                                 embps_error_t *err) {
  reader_t rd = {.f = f, .sc = sc};
  uint8_t tr[TRAILER_BYTES];
  uint32_t blocks_crc = 0, *crcs = NULL;
  uint64_t rows = 0, next_row = 0, off = f->off;
  embps_status_t ret = EMBPS_OK;
  int parallel = 0;

  row_bytes(&f->config, f->shard_width, rd.rb);
  rd.per_row = rd.rb[0] + rd.rb[1] + rd.rb[2];
  if (f->blocks <= f->size / BLOCK_HEADER &&
      (crcs = embps_malloc((size_t)(f->blocks ? f->blocks : 1) * sizeof(*crcs))) != NULL) {
    if ((ret = read_parallel(f, sc, crcs, &off, &parallel, err)) != EMBPS_OK)
      goto exit;
    if (parallel) {
      for (uint64_t b = 0; b < f->blocks; b++) {
        embps_put_le32(tr, crcs[b]);
        blocks_crc = crc(blocks_crc, tr, 4);
      }
      rows = f->config.rows;
    }
  }
  for (uint64_t b = 0; !parallel && b < f->blocks; b++) {
    uint64_t first;
    uint32_t n, len, want;
    if ((ret = read_block(&rd, b, off, next_row, &want, &first, &n, &len, err)) != EMBPS_OK)
      goto exit;
    embps_put_le32(tr, want);
    blocks_crc = crc(blocks_crc, tr, 4);
    rows += n;
    next_row = first + n;
    off += BLOCK_HEADER + len;
  }
  if ((ret = pread_exact(f, tr, sizeof(tr), off, "trailer", err)) != EMBPS_OK)
    goto exit;
  f->off = off + sizeof(tr);
  {
    uint32_t want = embps_get_le32(tr + 28), got = crc(0, tr, 28);
    if (got != want) {
      ret = crc_mismatch(err, f->path, "trailer", want, got);
      goto exit;
    }
  }
  if (memcmp(tr, TRAILER_MAGIC, 8) != 0 || embps_get_le64(tr + 8) != f->blocks ||
      embps_get_le64(tr + 16) != rows || rows != f->rows_written ||
      embps_get_le32(tr + 24) != blocks_crc || f->off != f->size) {
    ret = embps_error_set(err, EMBPS_DATA_LOSS,
                          "checkpoint file %s is corrupt: its trailer does not match its blocks "
                          "(crc32 of the blocks' crc32s: expected %08" PRIx32 ", actual %08" PRIx32
                          ")",
                          f->path, embps_get_le32(tr + 24), blocks_crc);
    goto exit;
  }
  *covered = rows;
exit:
  embps_free(crcs);
  embps_free(rd.payload);
  return ret;
}

/* ---- manifests ------------------------------------------------------------------------------- */

embps_status_t embps_ckpt_write_manifest(const char *ckpt_dir, const embps_ckpt_manifest_t *m,
                                         embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX];
  wbuf_t b = {0};
  outfile_t f = {.fd = -1};
  embps_status_t ret;

  if (snprintf(path, sizeof(path), "%s/%s", ckpt_dir, EMBPS_CKPT_MANIFEST) >= (int)sizeof(path))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "checkpoint path too long: %s", ckpt_dir);
  put(&b, MANIFEST_MAGIC, 8);
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
  if (b.oom) {
    embps_free(b.p);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);
  }
  embps_put_le32(b.p + 12, (uint32_t)(b.len - 16));
  put_crc(&b);
  if ((ret = out_open(&f, path, err)) != EMBPS_OK || (ret = out_write(&f, b.p, b.len, err)) != 0 ||
      (ret = out_commit(&f, err)) != EMBPS_OK) {
    out_abandon(&f);
    embps_free(b.p);
    return ret;
  }
  embps_free(b.p);
  return embps_ckpt_sync_dir(ckpt_dir, err);
}

static embps_status_t parse_manifest(const char *path, const uint8_t *p, size_t len,
                                     embps_ckpt_manifest_t *m, embps_error_t *err) {
  rbuf_t r;
  uint32_t body, want, got;
  embps_status_t ret;

  if (len < 16 + 4)
    return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is truncated", path);
  if ((ret = check_preamble(p, MANIFEST_MAGIC, path, err)) != EMBPS_OK)
    return ret;
  body = embps_get_le32(p + 12);
  if ((uint64_t)body + 20 != len)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint manifest %s is truncated or overlong (%zu bytes; its "
                           "header says %" PRIu64 ")",
                           path, len, (uint64_t)body + 20);
  want = embps_get_le32(p + len - 4);
  if ((got = crc(0, p, len - 4)) != want)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint manifest %s is corrupt: crc32 expected %08" PRIx32
                           ", actual %08" PRIx32,
                           path, want, got);
  r = (rbuf_t){.p = p, .len = len - 4, .off = 16};
  m->format_version = EMBPS_CKPT_FORMAT_VERSION;
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
  embps_ckpt_manifest_free(m);
  return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is malformed", path);
oom:
  embps_ckpt_manifest_free(m);
  return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
}

embps_status_t embps_ckpt_read_manifest(const char *ckpt_dir, embps_ckpt_manifest_t *m,
                                        embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX];
  struct stat st;
  uint8_t *p = NULL;
  int fd, r;
  embps_status_t ret;

  memset(m, 0, sizeof(*m));
  snprintf(path, sizeof(path), "%s/%s", ckpt_dir, EMBPS_CKPT_MANIFEST);
  if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
    if (errno == ENOENT || errno == ENOTDIR)
      return embps_error_set(err, EMBPS_NOT_FOUND,
                             "%s is not a complete checkpoint: it has no manifest", ckpt_dir);
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open %s: %s", path, strerror(errno));
  }
  if (fstat(fd, &st) != 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "cannot stat %s: %s", path, strerror(errno));
    goto exit;
  }
  if ((uint64_t)st.st_size > MANIFEST_MAX) {
    ret = embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is corrupt: %lld bytes",
                          path, (long long)st.st_size);
    goto exit;
  }
  if (!(p = embps_malloc(st.st_size ? (size_t)st.st_size : 1))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
    goto exit;
  }
  if ((r = read_all(fd, p, (size_t)st.st_size)) <= 0) {
    ret = r < 0
              ? embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", path, strerror(errno))
              : embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is truncated", path);
    goto exit;
  }
  ret = parse_manifest(path, p, (size_t)st.st_size, m, err);
exit:
  embps_free(p);
  close(fd);
  return ret;
}

void embps_ckpt_manifest_free(embps_ckpt_manifest_t *m) {
  if (!m)
    return;
  embps_free(m->tables);
  embps_free(m->files);
  memset(m, 0, sizeof(*m));
}

/* ---- the directory --------------------------------------------------------------------------- */

/* Whether name is a checkpoint's directory name ("ckpt-" and 20 digits); *round gets its round. */
static int ckpt_name(const char *name, uint64_t *round) {
  uint64_t v = 0;
  if (strncmp(name, "ckpt-", 5) != 0 || strlen(name) != 25)
    return 0;
  for (const char *c = name + 5; *c; c++) {
    if (*c < '0' || *c > '9' || v > (UINT64_MAX - 9) / 10)
      return 0;
    v = v * 10 + (uint64_t)(*c - '0');
  }
  *round = v;
  return 1;
}

static int by_round(const void *a, const void *b) {
  const embps_ckpt_manifest_t *x = a, *y = b;
  return x->round < y->round ? -1 : x->round > y->round;
}

/* Every checkpoint directory's round in dir (complete or not), unsorted. */
static embps_status_t scan_rounds(const char *dir, uint64_t **out, size_t *n, embps_error_t *err) {
  DIR *d = opendir(dir);
  struct dirent *e;
  uint64_t *v = NULL, round;
  size_t cap = 0;
  *out = NULL;
  *n = 0;
  if (!d) {
    if (errno == ENOENT)
      return embps_error_set(err, EMBPS_NOT_FOUND, "checkpoint directory %s does not exist", dir);
    return embps_error_set(err, EMBPS_INTERNAL, "cannot list %s: %s", dir, strerror(errno));
  }
  while ((e = readdir(d))) {
    if (!ckpt_name(e->d_name, &round))
      continue;
    if (*n == cap) {
      uint64_t *p = embps_realloc(v, (cap = cap ? cap * 2 : 16) * sizeof(*v));
      if (!p) {
        closedir(d);
        embps_free(v);
        *n = 0;
        return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory listing %s", dir);
      }
      v = p;
    }
    v[(*n)++] = round;
  }
  closedir(d);
  *out = v;
  return EMBPS_OK;
}

embps_status_t embps_ckpt_list(const char *dir, embps_ckpt_manifest_t **out, size_t *n,
                               embps_error_t *err) {
  uint64_t *rounds;
  size_t count, k = 0;
  embps_ckpt_manifest_t *list;
  embps_status_t ret;
  char path[EMBPS_CKPT_PATH_MAX];

  *out = NULL;
  *n = 0;
  if ((ret = scan_rounds(dir, &rounds, &count, err)) != EMBPS_OK)
    return ret;
  if (!(list = embps_calloc(count ? count : 1, sizeof(*list)))) {
    embps_free(rounds);
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory listing %s", dir);
  }
  for (size_t i = 0; i < count; i++) {
    embps_error_t skip;
    embps_ckpt_path(path, sizeof(path), dir, rounds[i]);
    if (embps_ckpt_read_manifest(path, &list[k], &skip) != EMBPS_OK)
      continue;
    if (list[k].round != rounds[i]) { /* moved or copied by hand: not the one its name says */
      embps_ckpt_manifest_free(&list[k]);
      continue;
    }
    k++;
  }
  embps_free(rounds);
  qsort(list, k, sizeof(*list), by_round);
  *out = list;
  *n = k;
  return EMBPS_OK;
}

void embps_ckpt_list_free(embps_ckpt_manifest_t *list, size_t n) {
  for (size_t i = 0; list && i < n; i++)
    embps_ckpt_manifest_free(&list[i]);
  embps_free(list);
}

embps_status_t embps_ckpt_remove(const char *ckpt_dir, embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX + 300];
  DIR *d;
  struct dirent *e;
  embps_status_t ret = EMBPS_OK;

  /* The manifest goes first: a removal cut short leaves an incomplete checkpoint, never a
   * complete one with files missing. */
  snprintf(path, sizeof(path), "%s/%s", ckpt_dir, EMBPS_CKPT_MANIFEST);
  if (unlink(path) != 0 && errno != ENOENT)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", path, strerror(errno));
  if (!(d = opendir(ckpt_dir))) {
    if (errno == ENOENT)
      return EMBPS_OK;
    return embps_error_set(err, EMBPS_INTERNAL, "cannot list %s: %s", ckpt_dir, strerror(errno));
  }
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    snprintf(path, sizeof(path), "%s/%s", ckpt_dir, e->d_name);
    if (unlink(path) != 0 && errno != ENOENT && ret == EMBPS_OK)
      ret = embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", path, strerror(errno));
  }
  closedir(d);
  if (ret == EMBPS_OK && rmdir(ckpt_dir) != 0 && errno != ENOENT)
    ret = embps_error_set(err, EMBPS_INTERNAL, "cannot remove %s: %s", ckpt_dir, strerror(errno));
  return ret;
}

static const embps_ckpt_manifest_t *find_round(const embps_ckpt_manifest_t *list, size_t n,
                                               uint64_t round) {
  for (size_t i = 0; i < n; i++)
    if (list[i].round == round)
      return &list[i];
  return NULL;
}

embps_status_t embps_ckpt_prune(const char *dir, uint32_t keep, embps_error_t *err) {
  embps_ckpt_manifest_t *list;
  uint64_t *rounds = NULL;
  size_t n, count = 0;
  char *kept = NULL, path[EMBPS_CKPT_PATH_MAX];
  embps_status_t ret;
  int removed = 0;

  if ((ret = embps_ckpt_list(dir, &list, &n, err)) != EMBPS_OK)
    return ret;
  if (!n)
    goto exit;
  if (!(kept = embps_calloc(n, 1)) || (ret = scan_rounds(dir, &rounds, &count, err)) != EMBPS_OK) {
    if (!kept)
      ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory pruning %s", dir);
    goto exit;
  }
  /* The newest `keep` of each scope, newest first, and every checkpoint their chains need. */
  for (size_t i = n; i-- > 0;) {
    uint32_t newer = 0;
    if (!keep) {
      kept[i] = 1;
      continue;
    }
    for (size_t j = i + 1; j < n; j++)
      newer += strcmp(list[j].scope, list[i].scope) == 0;
    if (newer < keep)
      kept[i] = 1;
  }
  for (size_t i = n; i-- > 0;) {
    const embps_ckpt_manifest_t *m = &list[i];
    if (!kept[i])
      continue;
    while (m && m->base_round && (m = find_round(list, n, m->base_round)))
      kept[m - list] = 1;
  }
  for (size_t i = 0; i < n; i++) {
    embps_error_t e;
    if (kept[i])
      continue;
    embps_ckpt_path(path, sizeof(path), dir, list[i].round);
    if (embps_ckpt_remove(path, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
    removed = 1;
  }
  /* What a crash left half written, older than the newest complete checkpoint. */
  for (size_t i = 0; i < count; i++) {
    embps_error_t e;
    if (rounds[i] >= list[n - 1].round || find_round(list, n, rounds[i]))
      continue;
    embps_ckpt_path(path, sizeof(path), dir, rounds[i]);
    if (embps_ckpt_remove(path, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
    removed = 1;
  }
  if (removed) {
    embps_error_t e;
    if (embps_ckpt_sync_dir(dir, &e) != EMBPS_OK && ret == EMBPS_OK)
      ret = embps_error_set(err, e.status, "%s", e.message);
  }
exit:
  embps_free(kept);
  embps_free(rounds);
  embps_ckpt_list_free(list, n);
  return ret;
}

embps_status_t embps_ckpt_dir_check(const char *dir, embps_error_t *err) {
  struct stat st;
  char probe[EMBPS_CKPT_PATH_MAX + 64];
  int fd;
  if (stat(dir, &st) != 0) {
    if (errno == ENOENT)
      return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                             "checkpoint directory %s does not exist: create it, on storage that "
                             "every rank of the group shares",
                             dir);
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION, "checkpoint directory %s: %s", dir,
                           strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is not a directory", dir);
  /* Root passes every permission check, a read-only mount does not: try. */
  snprintf(probe, sizeof(probe), "%s/.embps-probe-%ld", dir, (long)getpid());
  if ((fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is not writable: %s", dir, strerror(errno));
  close(fd);
  unlink(probe);
  return EMBPS_OK;
}

embps_status_t embps_ckpt_dir_lock(const char *dir, const char *holder, int *fd,
                                   embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX + 8], text[256];
  int f;
  snprintf(path, sizeof(path), "%s/LOCK", dir);
  if ((f = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open %s: %s", path, strerror(errno));
  if (flock(f, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    ssize_t r;
    if (e != EWOULDBLOCK) {
      close(f);
      return embps_error_set(err, EMBPS_INTERNAL, "cannot lock %s: %s", path, strerror(e));
    }
    r = pread(f, text, sizeof(text) - 1, 0);
    text[r > 0 ? r : 0] = '\0';
    text[strcspn(text, "\n")] = '\0';
    close(f);
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "checkpoint directory %s is in use by another group (%s holds %s): "
                           "give each group its own directory, or stop the other group first",
                           dir, text[0] ? text : "another process", path);
  }
  snprintf(text, sizeof(text), "%s\n", holder);
  if (ftruncate(f, 0) != 0 || pwrite(f, text, strlen(text), 0) < 0) {
    int e = errno;
    close(f);
    return io_error(err, e, "write", path);
  }
  *fd = f;
  return EMBPS_OK;
}

/* ---- reading a table back ----------------------------------------------------------------------
 */

static const embps_table_config_t *find_table(const embps_ckpt_manifest_t *m, const char *t) {
  for (size_t i = 0; i < m->num_tables; i++)
    if (strcmp(m->tables[i].name, t) == 0)
      return &m->tables[i];
  return NULL;
}

static const embps_ckpt_file_t *find_file(const embps_ckpt_manifest_t *m, const char *t,
                                          uint32_t rank) {
  for (size_t i = 0; i < m->num_files; i++)
    if (m->files[i].rank == rank && strcmp(m->files[i].table, t) == 0)
      return &m->files[i];
  return NULL;
}

/* Applies one checkpoint's files of `table` (whose spec it lists as cfg) onto dst. *full is set
 * when the files held every row. */
static embps_status_t apply_checkpoint(const char *dir, const embps_ckpt_manifest_t *m,
                                       const embps_table_config_t *cfg, embps_ckpt_dest_t *dst,
                                       int *full, embps_error_t *err) {
  const uint32_t g = m->group_size, sw = cfg->emb_width / g;
  char ckpt[EMBPS_CKPT_PATH_MAX], name[EMBPS_TABLE_NAME_MAX + 32];
  char path[EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40];
  int per_row_taken = 0;

  if (!sw || cfg->emb_width % g)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint of round %" PRIu64 ": table '%s' of width %" PRIu32
                           " cannot have been written by %" PRIu32 " ranks",
                           m->round, cfg->name, cfg->emb_width, g);
  embps_ckpt_path(ckpt, sizeof(ckpt), dir, m->round);
  *full = 1;
  for (uint32_t rank = 0; rank < g; rank++) {
    const uint32_t fb = rank * sw, lo = fb > dst->col_begin ? fb : dst->col_begin;
    const uint32_t hi =
        fb + sw < dst->col_begin + dst->shard_width ? fb + sw : dst->col_begin + dst->shard_width;
    const embps_ckpt_file_t *fe = find_file(m, cfg->name, rank);
    scatter_t sc;
    infile_t f;
    uint64_t covered = 0;
    embps_status_t ret;

    if (lo >= hi)
      continue; /* none of our columns */
    embps_ckpt_slice_name(name, sizeof(name), rank, cfg->name);
    snprintf(path, sizeof(path), "%s/%s", ckpt, name);
    if (!fe)
      return embps_error_set(err, EMBPS_DATA_LOSS, "the manifest of %s does not list %s", ckpt,
                             name);
    ret = in_open(&f, path, fe->bytes, err);
    if (ret == EMBPS_OK &&
        (f.rank != rank || f.group_size != g || f.col_begin != fb || f.shard_width != sw ||
         f.round != m->round || f.base_round != m->base_round || !same_config(&f.config, cfg)))
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "checkpoint file %s does not match its manifest (rank, group size, "
                            "columns, round or table spec differ)",
                            path);
    if (ret == EMBPS_OK) {
      sc = (scatter_t){.dst = dst,
                       .from = lo - fb,
                       .width = hi - lo,
                       .to = lo - dst->col_begin,
                       .per_row = !per_row_taken};
      ret = apply_file(&f, &sc, &covered, err);
    }
    in_close(&f);
    if (ret != EMBPS_OK)
      return ret;
    per_row_taken = 1;
    dst->step = f.step;
    if (covered != cfg->rows)
      *full = 0;
  }
  return EMBPS_OK;
}

embps_status_t embps_ckpt_read_columns(const char *dir, const embps_ckpt_manifest_t *m,
                                       const char *table, embps_ckpt_dest_t *dst,
                                       embps_error_t *err) {
  const embps_table_config_t *cfg = find_table(m, table);
  embps_ckpt_manifest_t *chain = NULL; /* chain[0] is m's base, chain[1] its base, ... */
  size_t depth = 0, cap = 0;
  embps_status_t ret = EMBPS_OK;
  int started = 0;

  if (!cfg)
    return embps_error_set(err, EMBPS_NOT_FOUND,
                           "the checkpoint of round %" PRIu64 " holds no table '%s'", m->round,
                           table);
  if (!dst->shard_width || (uint64_t)dst->col_begin + dst->shard_width > cfg->emb_width)
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT,
                           "columns %" PRIu32 "+%" PRIu32 " are outside table '%s' (width %" PRIu32
                           ")",
                           dst->col_begin, dst->shard_width, table, cfg->emb_width);
  /* Back through the chain to its full checkpoint. */
  for (uint64_t base = m->base_round, above = m->round; base;
       above = base, base = chain[depth - 1].base_round) {
    char path[EMBPS_CKPT_PATH_MAX];
    embps_error_t why;
    if (base >= above) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the checkpoint chain is broken: round %" PRIu64
                            " claims to apply on round %" PRIu64,
                            above, base);
      goto exit;
    }
    if (depth == cap) {
      embps_ckpt_manifest_t *p = embps_realloc(chain, (cap = cap ? cap * 2 : 8) * sizeof(*p));
      if (!p) {
        ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading a chain");
        goto exit;
      }
      chain = p;
    }
    embps_ckpt_path(path, sizeof(path), dir, base);
    if (embps_ckpt_read_manifest(path, &chain[depth], &why) != EMBPS_OK) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the incremental checkpoint of round %" PRIu64
                            " applies on round %" PRIu64 ", which cannot be read: %s",
                            above, base, why.message);
      goto exit;
    }
    depth++;
  }
  /* Oldest first: the full checkpoint (or the first that held every row of a table created
   * since), then each increment. */
  for (size_t i = depth + 1; i-- > 0;) {
    const embps_ckpt_manifest_t *c = i == 0 ? m : &chain[i - 1];
    const embps_table_config_t *tc = find_table(c, table);
    int full = 0;
    if (!tc)
      continue;
    if (tc->rows != cfg->rows || tc->emb_width != cfg->emb_width || tc->dtype != cfg->dtype ||
        tc->optimizer != cfg->optimizer) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the checkpoint chain is broken: table '%s' differs between rounds "
                            "%" PRIu64 " and %" PRIu64,
                            table, c->round, m->round);
      goto exit;
    }
    if ((ret = apply_checkpoint(dir, c, tc, dst, &full, err)) != EMBPS_OK)
      goto exit;
    if (!started && !full && c->base_round) {
      ret = embps_error_set(err, EMBPS_DATA_LOSS,
                            "the checkpoint chain is broken: the oldest checkpoint of round "
                            "%" PRIu64 " that holds table '%s' does not hold all of it",
                            c->round, table);
      goto exit;
    }
    started = 1;
  }
exit:
  for (size_t i = 0; i < depth; i++)
    embps_ckpt_manifest_free(&chain[i]);
  embps_free(chain);
  return ret;
}
