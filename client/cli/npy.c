/* numpy's .npy format (npy.h), as numpy's format.py writes it: the 6 bytes "\x93NUMPY", a major
 * and minor version byte, the header's length (a little-endian u16 for version 1.0, u32 for 2.0
 * and 3.0), then the header: an ASCII (3.0: UTF-8) Python dict literal with the keys 'descr',
 * 'fortran_order' and 'shape', padded with spaces to a 64-byte boundary and ended by '\n'; the
 * data follows. The dict is read by a small scanner of exactly the literals numpy writes
 * (strings in single or double quotes, True/False, tuples of integers), keys in any order. */
#include "client/cli/npy.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const struct {
  const char *descr, *name;
  embps_npy_dtype_t dtype;
  size_t itemsize;
} dtypes[] = {
    {"<f4", "float32", EMBPS_NPY_F32, 4}, {"<u2", "uint16", EMBPS_NPY_U16, 2},
    {"<i8", "int64", EMBPS_NPY_I64, 8},   {"<u8", "uint64", EMBPS_NPY_U64, 8},
    {"<i4", "int32", EMBPS_NPY_I32, 4},   {"<u4", "uint32", EMBPS_NPY_U32, 4},
};

/* numpy's names of descrs it is not read, for messages. */
static const struct {
  const char *descr, *name;
} others[] = {{"<f8", "float64"},
              {"<f2", "float16"},
              {"|u1", "uint8"},
              {"|i1", "int8"},
              {"<i2", "int16"},
              {"|b1", "bool"},
              {">f4", "big-endian float32"},
              {">u2", "big-endian uint16"},
              {">i8", "big-endian int64"},
              {">f8", "big-endian float64"}};

const char *embps_npy_dtype_name(embps_npy_dtype_t dtype) {
  for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
    if (dtypes[i].dtype == dtype)
      return dtypes[i].name;
  return "unknown";
}

__attribute__((format(printf, 3, 4))) static int fail(char *err, size_t errlen, const char *fmt,
                                                      ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
  return -1;
}

/* ---- the header's dict ---- */

typedef struct scan {
  const char *p, *end;
} scan_t;

static void skip_space(scan_t *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
    s->p++;
}

static int eat(scan_t *s, char c) {
  skip_space(s);
  if (s->p < s->end && *s->p == c) {
    s->p++;
    return 1;
  }
  return 0;
}

/* A quoted string into out (cap bytes, NUL-terminated); 0 when there is none or it is too long. */
static int string(scan_t *s, char *out, size_t cap) {
  char q;
  size_t n = 0;
  skip_space(s);
  if (s->p >= s->end || (*s->p != '\'' && *s->p != '"'))
    return 0;
  q = *s->p++;
  while (s->p < s->end && *s->p != q) {
    if (*s->p == '\\' || n + 1 >= cap)
      return 0;
    out[n++] = *s->p++;
  }
  if (s->p >= s->end)
    return 0;
  s->p++;
  out[n] = '\0';
  return 1;
}

static int word(scan_t *s, const char *w) {
  size_t n = strlen(w);
  skip_space(s);
  if ((size_t)(s->end - s->p) >= n && memcmp(s->p, w, n) == 0) {
    s->p += n;
    return 1;
  }
  return 0;
}

/* A tuple of non-negative integers: "()", "(3,)", "(3, 4)", "(3L, 4L)". */
static int tuple(scan_t *s, uint64_t *dims, unsigned cap, unsigned *ndim) {
  *ndim = 0;
  if (!eat(s, '('))
    return 0;
  for (;;) {
    uint64_t v = 0;
    int digits = 0;
    if (eat(s, ')'))
      return 1;
    skip_space(s);
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
      if (v > (UINT64_MAX - 9) / 10)
        return 0;
      v = v * 10 + (uint64_t)(*s->p++ - '0');
      digits = 1;
    }
    if (!digits)
      return 0;
    if (s->p < s->end && *s->p == 'L')
      s->p++;
    if (*ndim < cap)
      dims[*ndim] = v;
    (*ndim)++;
    if (eat(s, ')'))
      return 1;
    if (!eat(s, ','))
      return 0;
  }
}

/* The dict: descr, fortran_order and shape, each once; no other key. */
static int parse_dict(const char *h, size_t len, const char *name, char *descr, size_t dcap,
                      int *fortran, uint64_t *dims, unsigned *ndim, char *err, size_t errlen) {
  scan_t s = {h, h + len};
  int have_descr = 0, have_fortran = 0, have_shape = 0;
  char key[32];
  if (!eat(&s, '{'))
    return fail(err, errlen, "%s: its .npy header is malformed (it is not a dict)", name);
  for (;;) {
    if (eat(&s, '}'))
      break;
    if (!string(&s, key, sizeof(key)) || !eat(&s, ':'))
      return fail(err, errlen, "%s: its .npy header is malformed (a key of its dict)", name);
    if (strcmp(key, "descr") == 0 && !have_descr) {
      if (!string(&s, descr, dcap))
        return fail(err, errlen,
                    "%s: its .npy header's descr is not a plain type string (a structured or "
                    "object dtype): import takes float32, uint16, int64 or uint64 arrays",
                    name);
      have_descr = 1;
    } else if (strcmp(key, "fortran_order") == 0 && !have_fortran) {
      if (word(&s, "True"))
        *fortran = 1;
      else if (word(&s, "False"))
        *fortran = 0;
      else
        return fail(err, errlen, "%s: its .npy header's fortran_order is neither True nor False",
                    name);
      have_fortran = 1;
    } else if (strcmp(key, "shape") == 0 && !have_shape) {
      if (!tuple(&s, dims, 3, ndim))
        return fail(err, errlen, "%s: its .npy header's shape is not a tuple of integers", name);
      have_shape = 1;
    } else {
      return fail(err, errlen, "%s: its .npy header has an unknown or repeated key '%s'", name,
                  key);
    }
    if (!eat(&s, ',')) {
      if (eat(&s, '}'))
        break;
      return fail(err, errlen, "%s: its .npy header is malformed (after key '%s')", name, key);
    }
  }
  if (!have_descr || !have_fortran || !have_shape)
    return fail(err, errlen, "%s: its .npy header lacks '%s'", name,
                !have_descr     ? "descr"
                : !have_fortran ? "fortran_order"
                                : "shape");
  skip_space(&s);
  if (s.p != s.end)
    return fail(err, errlen, "%s: its .npy header holds more than its dict", name);
  return 0;
}

int embps_npy_parse(const uint8_t *buf, size_t len, const char *name, embps_npy_t *out, char *err,
                    size_t errlen) {
  static const uint8_t magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  size_t hlen, at;
  uint64_t dims[3] = {0, 0, 0}, elems = 1;
  unsigned ndim = 0;
  int fortran = 0;
  char descr[32];
  size_t k;

  memset(out, 0, sizeof(*out));
  if (len < sizeof(magic) || memcmp(buf, magic, sizeof(magic)) != 0)
    return fail(err, errlen,
                "%s is not a .npy file (it does not start with numpy's magic \"\\x93NUMPY\"): "
                "save the array with numpy.save",
                name);
  if (len < 10)
    return fail(err, errlen, "%s is cut short: %zu bytes, less than a .npy header's start", name,
                len);
  if (buf[6] < 1 || buf[6] > 3 || buf[7] != 0)
    return fail(err, errlen, "%s: .npy format version %u.%u is not one embps reads (1.0, 2.0, 3.0)",
                name, buf[6], buf[7]);
  if (buf[6] == 1) {
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
    at = 10;
  } else {
    if (len < 12)
      return fail(err, errlen, "%s is cut short: %zu bytes, less than a .npy header's start", name,
                  len);
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    at = 12;
  }
  if (hlen > len - at)
    return fail(err, errlen,
                "%s is cut short: its .npy header is %zu bytes, the file holds %zu after the "
                "header's length",
                name, hlen, len - at);
  if (parse_dict((const char *)buf + at, hlen, name, descr, sizeof(descr), &fortran, dims, &ndim,
                 err, errlen) != 0)
    return -1;
  for (k = 0; k < sizeof(dtypes) / sizeof(dtypes[0]); k++)
    if (strcmp(descr, dtypes[k].descr) == 0 ||
        (descr[0] == '=' && strcmp(descr + 1, dtypes[k].descr + 1) == 0))
      break;
  if (k == sizeof(dtypes) / sizeof(dtypes[0])) {
    const char *what = NULL;
    for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++)
      if (strcmp(descr, others[i].descr) == 0)
        what = others[i].name;
    return fail(err, errlen,
                "%s holds dtype '%s'%s%s%s, which embps does not read: rows must be float32 "
                "('<f4') or bf16 bits in uint16 ('<u2'), ids int64 ('<i8') or uint64 ('<u8'); "
                "convert it with array.astype(numpy.float32) (rows) or array.astype(numpy.int64) "
                "(ids)",
                name, descr, what ? " (" : "", what ? what : "", what ? ")" : "");
  }
  if (fortran)
    return fail(err, errlen,
                "%s is in Fortran order (fortran_order: True): save it in C order, "
                "numpy.save(path, numpy.ascontiguousarray(array))",
                name);
  if (ndim > 2)
    return fail(err, errlen,
                "%s holds an array of %u dimensions: embps reads 1-D (ids) and 2-D (rows, "
                "emb_width) arrays",
                name, ndim);
  for (unsigned d = 0; d < ndim; d++) {
    if (dims[d] && elems > UINT64_MAX / dims[d])
      return fail(err, errlen, "%s: its shape is too large", name);
    elems *= dims[d];
  }
  if (elems > UINT64_MAX / dtypes[k].itemsize)
    return fail(err, errlen, "%s: its shape is too large", name);
  out->dtype = dtypes[k].dtype;
  out->itemsize = dtypes[k].itemsize;
  out->ndim = ndim;
  out->shape[0] = ndim >= 1 ? dims[0] : 1;
  out->shape[1] = ndim == 2 ? dims[1] : 1;
  out->data = buf + at + hlen;
  out->data_bytes = elems * dtypes[k].itemsize;
  if (out->data_bytes > len - at - hlen)
    return fail(err, errlen,
                "%s is cut short: its header's shape (%llu, %llu) of %s needs %llu bytes of data, "
                "the file holds %zu",
                name, (unsigned long long)out->shape[0], (unsigned long long)out->shape[1],
                dtypes[k].name, (unsigned long long)out->data_bytes, len - at - hlen);
  if (out->data_bytes < len - at - hlen)
    return fail(err, errlen,
                "%s holds %zu bytes of data, more than the %llu its header's shape (%llu, %llu) of "
                "%s needs: it is not one array as numpy.save writes it",
                name, len - at - hlen, (unsigned long long)out->data_bytes,
                (unsigned long long)out->shape[0], (unsigned long long)out->shape[1],
                dtypes[k].name);
  return 0;
}

int embps_npy_open(const char *path, embps_npy_t *out, char *err, size_t errlen) {
  struct stat st;
  void *map;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  memset(out, 0, sizeof(*out));
  if (fd < 0)
    return fail(err, errlen, "%s cannot be opened: %s", path, strerror(errno));
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return fail(err, errlen, "%s is not a regular file", path);
  }
  if (st.st_size == 0) {
    close(fd);
    return fail(err, errlen, "%s is empty: it is not a .npy file (save the array with numpy.save)",
                path);
  }
  map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED)
    return fail(err, errlen, "%s cannot be mapped: %s", path, strerror(errno));
  if (embps_npy_parse(map, (size_t)st.st_size, path, out, err, errlen) != 0) {
    munmap(map, (size_t)st.st_size);
    memset(out, 0, sizeof(*out));
    return -1;
  }
  (void)madvise(map, (size_t)st.st_size, MADV_SEQUENTIAL);
  out->map = map;
  out->map_len = (size_t)st.st_size;
  return 0;
}

void embps_npy_close(embps_npy_t *npy) {
  if (npy->map)
    munmap(npy->map, npy->map_len);
  memset(npy, 0, sizeof(*npy));
}
