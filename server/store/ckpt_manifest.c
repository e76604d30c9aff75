/* The manifest: the file that makes a checkpoint exist. The leader writes it last, after every
 * rank's slices are durable, and fsyncs the checkpoint's directory after the rename, so a
 * checkpoint with a manifest that verifies is whole. Reading one takes the file in a single
 * read and hands it to the codec (ckpt_codec.c), which verifies its length and crc32 before it
 * trusts a field; a file larger than EMBPS__CKPT_MANIFEST_MAX is refused unread. */
#include "server/store/ckpt_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/alloc.h"

embps_status_t embps_ckpt_write_manifest(const char *ckpt_dir, const embps_ckpt_manifest_t *m,
                                         embps_error_t *err) {
  char path[EMBPS_CKPT_PATH_MAX];
  uint8_t *p = NULL;
  size_t len = 0;
  embps__ckpt_out_t f = {.fd = -1};
  embps_status_t ret;

  if (snprintf(path, sizeof(path), "%s/%s", ckpt_dir, EMBPS_CKPT_MANIFEST) >= (int)sizeof(path))
    return embps_error_set(err, EMBPS_INVALID_ARGUMENT, "checkpoint path too long: %s", ckpt_dir);
  if (embps__ckpt_manifest_encode(m, &p, &len) != 0)
    return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory writing %s", path);
  if ((ret = embps__ckpt_out_open(&f, path, err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_write(&f, p, len, err)) != EMBPS_OK ||
      (ret = embps__ckpt_out_commit(&f, err)) != EMBPS_OK) {
    embps__ckpt_out_abandon(&f);
    embps_free(p);
    return ret;
  }
  embps_free(p);
  return embps_ckpt_sync_dir(ckpt_dir, err);
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
  if ((uint64_t)st.st_size > EMBPS__CKPT_MANIFEST_MAX) {
    ret = embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is corrupt: %lld bytes",
                          path, (long long)st.st_size);
    goto exit;
  }
  if (!(p = embps_malloc(st.st_size ? (size_t)st.st_size : 1))) {
    ret = embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", path);
    goto exit;
  }
  if ((r = embps__ckpt_read_all(fd, p, (size_t)st.st_size)) <= 0) {
    ret = r < 0
              ? embps_error_set(err, EMBPS_INTERNAL, "cannot read %s: %s", path, strerror(errno))
              : embps_error_set(err, EMBPS_DATA_LOSS, "checkpoint manifest %s is truncated", path);
    goto exit;
  }
  ret = embps__ckpt_manifest_decode(path, p, (size_t)st.st_size, m, err);
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
