/* .npy files written in chunks (npy_out.h). The header's dictionary is what numpy itself
 * writes ("{'descr': '<f4', 'fortran_order': False, 'shape': (N, W), }"), padded so that the
 * data starts 64-byte aligned, which numpy.load and numpy.memmap (mode r) both read. */
#include "client/cli/npy_out.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

size_t embps_npy_header(char *out, const char *descr, const uint64_t *shape, int ndim) {
  char dict[EMBPS_NPY_HEADER_MAX];
  size_t len, total;
  int n;
  if (ndim == 1)
    n = snprintf(dict, sizeof(dict),
                 "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu64 ",), }", descr,
                 shape[0]);
  else if (ndim == 2)
    n = snprintf(dict, sizeof(dict),
                 "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu64 ", %" PRIu64 "), }",
                 descr, shape[0], shape[1]);
  else
    return 0;
  if (n < 0 || (size_t)n >= sizeof(dict) - 80)
    return 0;
  len = (size_t)n;
  total = (10 + len + 1 + 63) / 64 * 64; /* magic, version, length, dict, '\n': 64-aligned */
  memcpy(out, "\x93NUMPY\x01\x00", 8);
  out[8] = (char)((total - 10) & 0xff);
  out[9] = (char)((total - 10) >> 8);
  memcpy(out + 10, dict, len);
  memset(out + 10 + len, ' ', total - 10 - len - 1);
  out[total - 1] = '\n';
  return total;
}

static int fail(embps_npy_out_t *f, const char *what, int e, char *err, size_t errlen) {
  snprintf(err, errlen, "cannot %s %s: %s", what, f->path, strerror(e));
  embps_npy_out_abandon(f);
  return -1;
}

int embps_npy_out_open(embps_npy_out_t *f, const char *path, const char *descr, size_t elem,
                       const uint64_t *shape, int ndim, char *err, size_t errlen) {
  char h[EMBPS_NPY_HEADER_MAX];
  size_t hlen = embps_npy_header(h, descr, shape, ndim);
  f->fd = -1;
  f->bytes = 0;
  snprintf(f->path, sizeof(f->path), "%s", path);
  snprintf(f->tmp, sizeof(f->tmp), "%s.tmp", path);
  if (!hlen) {
    snprintf(err, errlen, "cannot write %s: an array of %d dimensions", path, ndim);
    return -1;
  }
  f->expected = hlen + shape[0] * (ndim == 2 ? shape[1] : 1) * elem;
  if ((f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
    return fail(f, "create", errno, err, errlen);
  return embps_npy_out_write(f, h, hlen, err, errlen);
}

int embps_npy_out_write(embps_npy_out_t *f, const void *p, size_t n, char *err, size_t errlen) {
  const char *b = p;
  while (n) {
    ssize_t w = write(f->fd, b, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return fail(f, "write", errno, err, errlen);
    b += w;
    n -= (size_t)w;
    f->bytes += (uint64_t)w;
  }
  return 0;
}

int embps_npy_out_commit(embps_npy_out_t *f, char *err, size_t errlen) {
  if (f->bytes != f->expected) {
    snprintf(err, errlen, "%s: %" PRIu64 " bytes written where its header promises %" PRIu64,
             f->path, f->bytes, f->expected);
    embps_npy_out_abandon(f);
    return -1;
  }
  if (close(f->fd) != 0) {
    f->fd = -1;
    unlink(f->tmp);
    snprintf(err, errlen, "cannot write %s: %s", f->path, strerror(errno));
    return -1;
  }
  f->fd = -1;
  if (rename(f->tmp, f->path) != 0) {
    int e = errno;
    unlink(f->tmp);
    snprintf(err, errlen, "cannot rename %s onto %s: %s", f->tmp, f->path, strerror(e));
    return -1;
  }
  return 0;
}

void embps_npy_out_abandon(embps_npy_out_t *f) {
  if (f->fd < 0)
    return;
  close(f->fd);
  f->fd = -1;
  unlink(f->tmp);
}
