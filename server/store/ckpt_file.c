/* Durable checkpoint files. Every file of a checkpoint is written to a temporary name (path +
 * ".tmp"), fsynced, closed and renamed onto its name, so that a name on disk always holds a whole
 * file; a failure removes the temporary file and leaves the name as it was. The directory's own
 * fsync (embps_ckpt_sync_dir) makes the renames durable; the callers order it (the manifest
 * last). Errors name the file, and a full disk reads as such (EMBPS_RESOURCE_EXHAUSTED), since an
 * operator's fix for it differs from any other I/O error's. */
#include "server/store/ckpt_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/alloc.h"

embps_status_t embps__ckpt_io_error(embps_error_t *err, int e, const char *what, const char *path) {
  if (e == ENOSPC || e == EDQUOT)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "no space left on device writing %s",
                           path);
  return embps_error_set(err, EMBPS_INTERNAL, "cannot %s %s: %s", what, path, strerror(e));
}

int embps__ckpt_write_all(int fd, const void *p, size_t n) {
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

int embps__ckpt_read_all(int fd, void *p, size_t n) {
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

/* Small writes (an incremental slice's short runs of rows) gather in a buffer of this size, so
 * that the file goes out in large write calls. */
#define OUT_BUFFER (1u << 20)
/* Every this many bytes, writeback of what was written is started (sync_file_range), so the
 * disk works while the next blocks are checksummed and copied, and the final fsync finds
 * little left: a checkpoint then takes about as long as the disk needs, not CPU time plus that.
 * Advice only: the fsync at commit reports any error. */
#define OUT_KICK (8u << 20)

embps_status_t embps__ckpt_out_open(embps__ckpt_out_t *f, const char *path, embps_error_t *err) {
  f->path = path;
  if (snprintf(f->tmp, sizeof(f->tmp), "%s.tmp", path) >= (int)sizeof(f->tmp))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "checkpoint path too long: %s", path);
  if (!(f->buf = embps_malloc(OUT_BUFFER)))
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);
  f->len = 0;
  f->written = f->kicked = 0;
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0)
    return embps__ckpt_io_error(err, errno, "create", f->tmp);
  return EMBPS_OK;
}

static embps_status_t out_put(embps__ckpt_out_t *f, const void *p, size_t n, embps_error_t *err) {
  if (embps__ckpt_write_all(f->fd, p, n) != 0)
    return embps__ckpt_io_error(err, errno, "write", f->path);
  f->written += n;
  if (f->written - f->kicked >= OUT_KICK) {
    (void)sync_file_range(f->fd, (off_t)f->kicked, (off_t)(f->written - f->kicked),
                          SYNC_FILE_RANGE_WRITE);
    f->kicked = f->written;
  }
  return EMBPS_OK;
}

static embps_status_t out_flush(embps__ckpt_out_t *f, embps_error_t *err) {
  embps_status_t ret;
  if (f->len && (ret = out_put(f, f->buf, f->len, err)) != EMBPS_OK)
    return ret;
  f->len = 0;
  return EMBPS_OK;
}

embps_status_t embps__ckpt_out_write(embps__ckpt_out_t *f, const void *p, size_t n,
                                     embps_error_t *err) {
  embps_status_t ret;
  if (f->len + n > OUT_BUFFER && (ret = out_flush(f, err)) != EMBPS_OK)
    return ret;
  if (n >= OUT_BUFFER)
    return out_put(f, p, n, err);
  memcpy(f->buf + f->len, p, n);
  f->len += n;
  return EMBPS_OK;
}

void embps__ckpt_out_abandon(embps__ckpt_out_t *f) {
  if (f->fd >= 0)
    close(f->fd);
  f->fd = -1;
  embps_free(f->buf);
  f->buf = NULL;
  unlink(f->tmp);
}

embps_status_t embps__ckpt_out_commit(embps__ckpt_out_t *f, embps_error_t *err) {
  embps_status_t ret = out_flush(f, err);
  embps_free(f->buf);
  f->buf = NULL;
  if (ret != EMBPS_OK)
    return ret; /* the caller abandons the file */
  if (fsync(f->fd) != 0)
    ret = embps__ckpt_io_error(err, errno, "fsync", f->path);
  if (close(f->fd) != 0 && ret == EMBPS_OK)
    ret = embps__ckpt_io_error(err, errno, "close", f->path);
  f->fd = -1;
  if (ret == EMBPS_OK && rename(f->tmp, f->path) != 0)
    ret = embps__ckpt_io_error(err, errno, "rename onto", f->path);
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
    ret = embps__ckpt_io_error(err, errno, "fsync directory", dir);
  close(fd);
  return ret;
}

uint32_t embps_ckpt_crc32(uint32_t crc, const void *p, size_t n) {
  return embps__ckpt_crc(crc, p, n);
}

embps_status_t embps_ckpt_check_envelope(const uint8_t *p, size_t len, size_t header_bytes,
                                         const char *magic, uint32_t version, const char *what,
                                         const char *name, embps_error_t *err) {
  uint32_t got_version, want, got;
  if (len < header_bytes + 4)
    return embps_error_set(err, EMBPS_DATA_LOSS, "%s %s is truncated (%zu bytes)", what, name, len);
  if (memcmp(p, magic, 8) != 0)
    return embps_error_set(err, EMBPS_DATA_LOSS, "%s is not a %s (no %s)", name, what, magic);
  if ((got_version = embps_get_le32(p + 8)) != version)
    return embps_error_set(err, EMBPS_FAILED_PRECONDITION,
                           "%s %s is format version %" PRIu32 "; this build reads version %" PRIu32,
                           what, name, got_version, version);
  want = embps_get_le32(p + len - 4);
  if ((got = embps_ckpt_crc32(0, p, len - 4)) != want)
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "%s %s is corrupt: crc32 expected %08" PRIx32 ", actual %08" PRIx32,
                           what, name, want, got);
  return EMBPS_OK;
}

embps_status_t embps_ckpt_write_file(const char *path, const void *p, size_t len, uint64_t *bytes,
                                     embps_error_t *err) {
  embps__ckpt_out_t f = {.fd = -1};
  embps_status_t ret;
  if ((ret = embps__ckpt_out_open(&f, path, err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_write(&f, p, len, err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_commit(&f, err)) != EMBPS_OK) {
    embps__ckpt_out_abandon(&f);
    return ret;
  }
  if (bytes)
    *bytes = len;
  return EMBPS_OK;
}

embps_status_t embps_ckpt_read_file(const char *path, uint64_t want_bytes, uint8_t **out,
                                    size_t *len, embps_error_t *err) {
  struct stat st;
  uint8_t *p = NULL;
  int fd, r;
  embps_status_t ret = EMBPS_OK;

  if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
    if (errno == ENOENT || errno == ENOTDIR)
      return embps_error_set(err, EMBPS_DATA_LOSS,
                             "checkpoint file %s is missing, though its manifest lists it", path);
    return embps_error_set(err, EMBPS_INTERNAL, "cannot open %s: %s", path, strerror(errno));
  }
  if (fstat(fd, &st) != 0) {
    ret = embps_error_set(err, EMBPS_INTERNAL, "cannot stat %s: %s", path, strerror(errno));
    goto exit;
  }
  if ((uint64_t)st.st_size != want_bytes || want_bytes > SIZE_MAX - 1) {
    ret = embps_error_set(err, EMBPS_DATA_LOSS,
                          "checkpoint file %s is %" PRIu64 " bytes; its manifest says %" PRIu64,
                          path, (uint64_t)st.st_size, want_bytes);
    goto exit;
  }
  if (!(p = embps_malloc(want_bytes ? (size_t)want_bytes : 1))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
    goto exit;
  }
  if ((r = embps__ckpt_read_all(fd, p, (size_t)want_bytes)) <= 0 && want_bytes) {
    ret = r < 0 ? embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", path, strerror(errno))
                : embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint file %s is truncated", path);
    embps_free(p);
    goto exit;
  }
  *out = p;
  *len = (size_t)want_bytes;
exit:
  close(fd);
  return ret;
}
