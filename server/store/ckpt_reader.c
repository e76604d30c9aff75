/* The slice reader: one slice file read back, every byte verified, its rows scattered into the
 * columns a destination wants (ckpt_restore.c picks the files and the columns).
 *
 * An incremental slice's blocks are read one after another. A full slice's blocks all hold
 * rows_per_block rows but the last (the writer's rule, part of the format), so block b starts at
 * a known offset and threads read ranges of blocks at once: a restore is bound by the kernel's
 * copy, the crc32 and the first touch of the new table's pages, which one core alone does at
 * about half a disk's sequential read. When a file's slice is exactly the destination's columns,
 * each block is read with one preadv straight into the destination (no bounce buffer, no copy);
 * otherwise through a buffer per thread. A failure names the first failing block, as a serial
 * read would. */
#include "server/store/ckpt_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "common/cpus.h"
#include "common/dtype.h"

#define BLOCK_HEADER EMBPS__CKPT_BLOCK_HEADER

static embps_status_t truncated(embps_error_t *err, const char *path, const char *what) {
  return embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s is truncated (in its %s)", path,
                         what);
}

static embps_status_t read_at(embps__ckpt_in_t *f, void *p, size_t n, const char *what,
                              embps_error_t *err) {
  int r = embps__ckpt_read_all(f->fd, p, n);
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

/* Reads and verifies f's header from the start of the file into f->h. */
static embps_status_t read_header(embps__ckpt_in_t *f, embps_error_t *err) {
  uint8_t pre[EMBPS__CKPT_PREAMBLE], *h = NULL;
  uint32_t hlen, want, got;
  embps_status_t ret;

  f->off = 0;
  if (lseek(f->fd, 0, SEEK_SET) != 0)
    return embps_error_set(err, EMBPS_INTERNAL, "cannot seek in %s: %s", f->path, strerror(errno));
  if ((ret = read_at(f, pre, sizeof(pre), "header", err)) != EMBPS_OK ||
      (ret = embps__ckpt_check_preamble(pre, EMBPS__CKPT_SLICE_MAGIC, f->path, err)) != EMBPS_OK)
    return ret;
  hlen = embps_get_le32(pre + 12);
  if (hlen < sizeof(pre) + 4 || hlen > EMBPS__CKPT_HEADER_MAX)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: header length %" PRIu32, f->path, hlen);
  if (!(h = embps_malloc(hlen)))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", f->path);
  memcpy(h, pre, sizeof(pre));
  if ((ret = read_at(f, h + sizeof(pre), hlen - sizeof(pre), "header", err)) != EMBPS_OK)
    goto exit;
  want = embps_get_le32(h + hlen - 4);
  if ((got = embps__ckpt_crc(0, h, hlen - 4)) != want) {
    ret = crc_mismatch(err, f->path, "header", want, got);
    goto exit;
  }
  if (embps__ckpt_header_decode(h, hlen, &f->h) != 0)
    ret =
        embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s has a malformed header", f->path);
exit:
  embps_free(h);
  return ret;
}

/* Says where a file shorter than its manifest says ends, by its header and block headers: " (it
 * ends in block B, rows A..Z)", " (it ends in its header)" or " (it ends in its trailer)". */
static void locate_cut(embps__ckpt_in_t *f, char *out, size_t cap) {
  embps_error_t ignored;
  uint64_t off;
  if (read_header(f, &ignored) != EMBPS_OK) {
    snprintf(out, cap, " (it ends in its header)");
    return;
  }
  off = f->off;
  for (uint64_t b = 0; b < f->h.blocks; b++) {
    uint8_t bh[BLOCK_HEADER];
    embps__ckpt_block_t blk;
    if (off + sizeof(bh) > f->size || pread(f->fd, bh, sizeof(bh), (off_t)off) != sizeof(bh)) {
      snprintf(out, cap, " (it ends in block %" PRIu64 ", in its header)", b);
      return;
    }
    embps__ckpt_block_get(bh, &blk);
    if (off + sizeof(bh) + blk.bytes > f->size) {
      snprintf(out, cap, " (it ends in block %" PRIu64 ", rows %" PRIu64 "..%" PRIu64 ")", b,
               blk.first, blk.first + (blk.rows ? blk.rows - 1 : 0));
      return;
    }
    off += sizeof(bh) + blk.bytes;
  }
  snprintf(out, cap, " (it ends in its trailer)");
}

embps_status_t embps__ckpt_in_open(embps__ckpt_in_t *f, const char *path, uint64_t want_bytes,
                                   embps_error_t *err) {
  struct stat st;
  char where[96] = "";

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
  if (f->size != want_bytes) {
    if (f->size < want_bytes)
      locate_cut(f, where, sizeof(where));
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s has %" PRIu64 " bytes, its manifest says %" PRIu64
                           ": it is truncated%s or was overwritten",
                           path, f->size, want_bytes, where);
  }
  return read_header(f, err);
}

void embps__ckpt_in_close(embps__ckpt_in_t *f) {
  if (f->fd >= 0)
    close(f->fd);
  f->fd = -1;
}

/* ---- blocks --------------------------------------------------------------------------------- */

/* Copies the overlapping columns of rows first..first+n-1 of one array from a block's payload
 * segment into a destination array (both rows-major; widths and offsets in elements). */
static void copy_columns(uint8_t *dst, uint32_t dst_width, const uint8_t *seg, uint32_t seg_width,
                         const embps__ckpt_scatter_t *sc, size_t esz, uint64_t first, uint32_t n) {
  if (sc->from == 0 && sc->to == 0 && sc->width == seg_width && seg_width == dst_width) {
    memcpy(dst + first * dst_width * esz, seg, (size_t)n * seg_width * esz);
    return;
  }
  for (uint32_t i = 0; i < n; i++)
    memcpy(dst + ((first + i) * dst_width + sc->to) * esz,
           seg + ((size_t)i * seg_width + sc->from) * esz, (size_t)sc->width * esz);
}

static void scatter_block(const embps__ckpt_scatter_t *sc, const embps__ckpt_in_t *f,
                          const size_t rb[3], const uint8_t *payload, uint64_t first, uint32_t n) {
  const embps_ckpt_dest_t *d = sc->dst;
  const embps_table_config_t *cfg = &f->h.config;
  const uint8_t *state0 = payload + (size_t)n * rb[0], *state1 = state0 + (size_t)n * rb[1];
  if (sc->width) {
    copy_columns(d->data, d->shard_width, payload, f->h.shard_width, sc,
                 embps_dtype_size(cfg->dtype), first, n);
    if (rb[1] && !embps_optimizer_info(cfg->optimizer)->state_per_row)
      copy_columns((uint8_t *)d->state0, d->shard_width, state0, f->h.shard_width, sc,
                   sizeof(float), first, n);
    if (rb[2])
      copy_columns((uint8_t *)d->state1, d->shard_width, state1, f->h.shard_width, sc,
                   sizeof(float), first, n);
  }
  if (rb[1] && sc->per_row && embps_optimizer_info(cfg->optimizer)->state_per_row)
    memcpy(d->state0 + first, state0, (size_t)n * sizeof(float));
}

/* Fills the cnt buffers of iov (which it consumes) from the bytes at off on; EMBPS_OK,
 * DATA_LOSS (the file ends first) or INTERNAL. */
static embps_status_t preadv_exact(const embps__ckpt_in_t *f, struct iovec *iov, int cnt,
                                   uint64_t off, const char *what, embps_error_t *err) {
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
static embps_status_t pread_exact(const embps__ckpt_in_t *f, void *p, size_t n, uint64_t off,
                                  const char *what, embps_error_t *err) {
  struct iovec iov = {.iov_base = p, .iov_len = n};
  return preadv_exact(f, &iov, 1, off, what, err);
}

static embps_status_t block_crc_mismatch(embps_error_t *err, const embps__ckpt_in_t *f, uint64_t b,
                                         uint64_t first, uint32_t n, uint32_t want, uint32_t got) {
  return embps_error_set(err, EMBPS_DATA_LOSS,
                         "checkpoint file %s is corrupt: block %" PRIu64 " (rows %" PRIu64
                         "..%" PRIu64 ") fails its crc32 (expected %08" PRIx32 ", actual %08" PRIx32
                         ")",
                         f->path, b, first, first + n - 1, want, got);
}

embps_status_t embps__ckpt_read_block(const embps__ckpt_in_t *f, size_t per_row, uint64_t b,
                                      uint64_t off, uint64_t min_row, embps__ckpt_block_t *blk,
                                      uint8_t **payload, size_t *cap, embps_error_t *err) {
  const uint64_t rows = embps_table_config_rows(&f->h.config);
  uint8_t bh[BLOCK_HEADER];
  uint32_t got;
  embps_status_t ret;
  char what[48];

  snprintf(what, sizeof(what), "block %" PRIu64, b);
  if ((ret = pread_exact(f, bh, sizeof(bh), off, what, err)) != EMBPS_OK)
    return ret;
  embps__ckpt_block_get(bh, blk);
  if (!blk->rows || blk->first < min_row || blk->first > rows || blk->rows > rows - blk->first ||
      (uint64_t)blk->bytes != (uint64_t)blk->rows * per_row ||
      blk->bytes > f->size - off - sizeof(bh))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " claims rows %" PRIu64
                           "+%" PRIu32 " in %" PRIu32 " bytes (crc32 %08" PRIx32
                           "), which the table cannot hold",
                           f->path, b, blk->first, blk->rows, blk->bytes, blk->crc);
  if (blk->bytes > *cap) {
    uint8_t *p = embps_realloc(*payload, blk->bytes);
    if (!p)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", f->path);
    *payload = p;
    *cap = blk->bytes;
  }
  if ((ret = pread_exact(f, *payload, blk->bytes, off + sizeof(bh), what, err)) != EMBPS_OK)
    return ret;
  got = embps__ckpt_crc(embps__ckpt_crc(0, bh, 16), *payload, blk->bytes);
  if (got != blk->crc)
    return block_crc_mismatch(err, f, b, blk->first, blk->rows, blk->crc, got);
  return EMBPS_OK;
}

/* One reader of blocks: its payload buffer, reused from block to block. */
typedef struct reader {
  const embps__ckpt_in_t *f;
  const embps__ckpt_scatter_t *sc;
  size_t rb[3], per_row;
  uint8_t *payload;
  size_t cap;
} reader_t;

/* Reads block b at off (its first row at least min_row), verifies it and scatters its rows;
 * sets its crc, first row, row count and length. */
static embps_status_t read_block(reader_t *rd, uint64_t b, uint64_t off, uint64_t min_row,
                                 uint32_t *crc_out, uint64_t *first_out, uint32_t *n_out,
                                 uint32_t *len_out, embps_error_t *err) {
  embps__ckpt_block_t blk;
  embps_status_t ret = embps__ckpt_read_block(rd->f, rd->per_row, b, off, min_row, &blk,
                                              &rd->payload, &rd->cap, err);
  if (ret != EMBPS_OK)
    return ret;
  scatter_block(rd->sc, rd->f, rd->rb, rd->payload, blk.first, blk.rows);
  *crc_out = blk.crc;
  *first_out = blk.first;
  *n_out = blk.rows;
  *len_out = blk.bytes;
  return EMBPS_OK;
}

/* ---- a full slice, by several threads ------------------------------------------------------- */

/* Two readers per core keep the disk busy while the other computes. */
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
static int reads_in_place(const embps__ckpt_scatter_t *sc, const embps__ckpt_in_t *f,
                          const size_t rb[3]) {
  const embps_ckpt_dest_t *d = sc->dst;
  const int per_row_state = rb[1] && embps_optimizer_info(f->h.config.optimizer)->state_per_row;
  return sc->from == 0 && sc->to == 0 && sc->width == f->h.shard_width &&
         d->shard_width == f->h.shard_width && (!per_row_state || sc->per_row) &&
         (!rb[1] || d->state0) && (!rb[2] || d->state1);
}

/* Reads block b of a full slice (rows first..first+n-1) with one preadv: its header into bh and
 * its payload's arrays straight into the destination, then verifies both. A block that fails
 * leaves unverified rows in the destination; a failed restore discards the table. */
static embps_status_t read_block_in_place(const range_job_t *j, uint64_t b, uint64_t off,
                                          uint64_t first, uint32_t n, uint32_t *crc_out,
                                          embps_error_t *err) {
  const embps__ckpt_in_t *f = j->rd.f;
  const embps_ckpt_dest_t *d = j->rd.sc->dst;
  const size_t *rb = j->rd.rb;
  uint8_t bh[BLOCK_HEADER];
  uint8_t *arrays[3] = {(uint8_t *)d->data, (uint8_t *)d->state0, (uint8_t *)d->state1};
  struct iovec iov[4] = {{.iov_base = bh, .iov_len = sizeof(bh)}};
  size_t want_len = sizeof(bh);
  int cnt = 1;
  char what[48];
  embps__ckpt_block_t blk;
  uint32_t got;
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
  embps__ckpt_block_get(bh, &blk);
  if (blk.first != first || blk.rows != n || blk.bytes != want_len - sizeof(bh))
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: block %" PRIu64 " claims rows %" PRIu64
                           "+%" PRIu32 " in %" PRIu32 " bytes where a full slice's block holds "
                           "%" PRIu64 "+%" PRIu32 " in %zu",
                           f->path, b, blk.first, blk.rows, blk.bytes, first, n,
                           want_len - sizeof(bh));
  got = embps__ckpt_crc(0, bh, 16);
  for (int a = 0; a < 3; a++)
    if (rb[a])
      got = embps__ckpt_crc(got, arrays[a] + first * rb[a], (size_t)n * rb[a]);
  if (got != blk.crc)
    return block_crc_mismatch(err, f, b, first, n, blk.crc, got);
  *crc_out = blk.crc;
  return EMBPS_OK;
}

static void *read_range(void *arg) {
  range_job_t *j = arg;
  const uint64_t stride = BLOCK_HEADER + j->per_block * j->rd.per_row;
  const uint64_t rows = embps_table_config_rows(&j->rd.f->h.config);
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
static embps_status_t read_parallel(embps__ckpt_in_t *f, const embps__ckpt_scatter_t *sc,
                                    uint32_t *crcs, uint64_t *end_off, int *parallel,
                                    embps_error_t *err) {
  const embps__ckpt_header_t *h = &f->h;
  range_job_t jobs[READ_THREADS_MAX];
  reader_t proto = {.f = f, .sc = sc};
  uint64_t per_block, threads;
  const unsigned cpus = embps_usable_cpus();
  embps_status_t ret = EMBPS_OK;
  size_t started = 0;
  int in_place;

  embps__ckpt_row_bytes(&h->config, h->shard_width, proto.rb);
  proto.per_row = proto.rb[0] + proto.rb[1] + proto.rb[2];
  per_block = embps__ckpt_rows_per_block(proto.per_row);
  threads = cpus > 1 ? (uint64_t)cpus * 2 : 1; /* the CPUs the process may use, not the host's */
  if (threads > READ_THREADS_MAX)
    threads = READ_THREADS_MAX;
  if (threads > h->blocks / READ_BLOCKS_PER_THREAD_MIN)
    threads = h->blocks / READ_BLOCKS_PER_THREAD_MIN;
  *parallel = h->base_round == 0 && h->rows_written == embps_table_config_rows(&h->config) &&
              h->blocks == (embps_table_config_rows(&h->config) + per_block - 1) / per_block &&
              threads > 1;
  if (!*parallel)
    return EMBPS_OK;
  in_place = reads_in_place(sc, f, proto.rb);
  for (uint64_t k = 0; k < threads; k++) {
    range_job_t *j = &jobs[k];
    memset(j, 0, sizeof(*j));
    j->rd = proto;
    j->begin = h->blocks * k / threads;
    j->end = h->blocks * (k + 1) / threads;
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
  *end_off =
      f->off + h->blocks * BLOCK_HEADER + embps_table_config_rows(&h->config) * proto.per_row;
  return ret;
}

embps_status_t embps__ckpt_check_trailer(embps__ckpt_in_t *f, uint64_t off, uint32_t blocks_crc,
                                         uint64_t rows, embps_error_t *err) {
  const embps__ckpt_header_t *h = &f->h;
  uint8_t tr[EMBPS__CKPT_TRAILER_BYTES];
  embps__ckpt_trailer_t t;
  embps_status_t ret;

  if ((ret = pread_exact(f, tr, sizeof(tr), off, "trailer", err)) != EMBPS_OK)
    return ret;
  f->off = off + sizeof(tr);
  embps__ckpt_trailer_get(tr, &t);
  if (t.crc_actual != t.crc)
    return crc_mismatch(err, f->path, "trailer", t.crc, t.crc_actual);
  if (!t.magic_ok || t.blocks != h->blocks || t.rows != rows || rows != h->rows_written ||
      t.blocks_crc != blocks_crc || f->off != f->size)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "checkpoint file %s is corrupt: its trailer does not match its blocks "
                           "(crc32 of the blocks' crc32s: expected %08" PRIx32 ", actual %08" PRIx32
                           ")",
                           f->path, t.blocks_crc, blocks_crc);
  return EMBPS_OK;
}

/* ---- a whole file --------------------------------------------------------------------------- */

embps_status_t embps__ckpt_apply_file(embps__ckpt_in_t *f, const embps__ckpt_scatter_t *sc,
                                      uint64_t *covered, embps_error_t *err) {
  const embps__ckpt_header_t *h = &f->h;
  reader_t rd = {.f = f, .sc = sc};
  uint32_t blocks_crc = 0, *crcs = NULL;
  uint64_t rows = 0, next_row = 0, off = f->off;
  embps_status_t ret = EMBPS_OK;
  int parallel = 0;

  embps__ckpt_row_bytes(&h->config, h->shard_width, rd.rb);
  rd.per_row = rd.rb[0] + rd.rb[1] + rd.rb[2];
  if (h->blocks <= f->size / BLOCK_HEADER &&
      (crcs = embps_malloc((size_t)(h->blocks ? h->blocks : 1) * sizeof(*crcs))) != NULL) {
    if ((ret = read_parallel(f, sc, crcs, &off, &parallel, err)) != EMBPS_OK)
      goto exit;
    if (parallel) {
      for (uint64_t b = 0; b < h->blocks; b++)
        blocks_crc = embps__ckpt_blocks_crc_add(blocks_crc, crcs[b]);
      rows = embps_table_config_rows(&h->config);
    }
  }
  for (uint64_t b = 0; !parallel && b < h->blocks; b++) {
    uint64_t first;
    uint32_t n, len, want;
    if ((ret = read_block(&rd, b, off, next_row, &want, &first, &n, &len, err)) != EMBPS_OK)
      goto exit;
    blocks_crc = embps__ckpt_blocks_crc_add(blocks_crc, want);
    rows += n;
    next_row = first + n;
    off += BLOCK_HEADER + len;
  }
  if ((ret = embps__ckpt_check_trailer(f, off, blocks_crc, rows, err)) != EMBPS_OK)
    goto exit;
  *covered = rows;
exit:
  embps_free(crcs);
  embps_free(rd.payload);
  return ret;
}
