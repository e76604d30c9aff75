/* client/cli/npy.c: .npy files as numpy.save writes them (versions 1.0 and 2.0, every dtype read,
 * 1-D and 2-D, keys in any order, Python 2's long suffix) parse to their shape and data; and
 * every way a file can be wrong is refused with a sentence that names the file and the fault
 * (not .npy, a version not read, a malformed or cut header, a dtype not read, Fortran order, 3
 * dimensions, data cut short or too long), and a file that cannot be opened or is empty. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/cli/npy.h"

/* A .npy of version major.0 with header dict `dict` (padded as numpy pads it) and data_bytes of
 * data (bytes 0, 1, 2, ...); *len its length. The caller frees it. */
static uint8_t *make(unsigned major, const char *dict, size_t data_bytes, size_t *len) {
  const size_t pre = major == 1 ? 10 : 12, dl = strlen(dict);
  size_t hlen = dl + 1;
  uint8_t *b;
  while ((pre + hlen) % 64)
    hlen++;
  *len = pre + hlen + data_bytes;
  b = malloc(*len);
  assert_non_null(b);
  memcpy(b, "\x93NUMPY", 6);
  b[6] = (uint8_t)major;
  b[7] = 0;
  b[8] = (uint8_t)(hlen & 0xff);
  b[9] = (uint8_t)(hlen >> 8);
  if (major > 1)
    b[10] = b[11] = 0;
  memcpy(b + pre, dict, dl);
  memset(b + pre + dl, ' ', hlen - dl - 1);
  b[pre + hlen - 1] = '\n';
  for (size_t i = 0; i < data_bytes; i++)
    b[pre + hlen + i] = (uint8_t)i;
  return b;
}

static void parses(unsigned major, const char *dict, size_t data_bytes, embps_npy_dtype_t dtype,
                   unsigned ndim, uint64_t r, uint64_t c) {
  size_t len;
  uint8_t *b = make(major, dict, data_bytes, &len);
  embps_npy_t n;
  char err[512] = "";
  int rc = embps_npy_parse(b, len, "f.npy", &n, err, sizeof(err));
  if (rc != 0)
    fail_msg("%s: %s", dict, err);
  assert_int_equal(n.dtype, dtype);
  assert_int_equal(n.ndim, ndim);
  assert_int_equal(n.shape[0], r);
  assert_int_equal(n.shape[1], c);
  assert_int_equal(n.data_bytes, data_bytes);
  assert_ptr_equal(n.data, b + len - data_bytes);
  assert_int_equal((n.data - b) % 64, 0);
  free(b);
}

static void refused(const uint8_t *b, size_t len, const char *want) {
  embps_npy_t n;
  char err[512] = "";
  assert_int_equal(embps_npy_parse(b, len, "f.npy", &n, err, sizeof(err)), -1);
  if (!strstr(err, want))
    fail_msg("message \"%s\" lacks \"%s\"", err, want);
  assert_true(strncmp(err, "f.npy", 5) == 0);
}

static void refused_dict(const char *dict, size_t data_bytes, const char *want) {
  size_t len;
  uint8_t *b = make(1, dict, data_bytes, &len);
  refused(b, len, want);
  free(b);
}

static void test_parses(void **state) {
  (void)state;
  parses(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 48, EMBPS_NPY_F32, 2, 3,
         4);
  parses(2, "{'descr': '<u2', 'fortran_order': False, 'shape': (5, 2), }", 20, EMBPS_NPY_U16, 2, 5,
         2);
  parses(1, "{'shape': (7,), 'fortran_order': False, 'descr': '<i8'}", 56, EMBPS_NPY_I64, 1, 7, 1);
  parses(1, "{\"descr\": \"<u8\", \"fortran_order\": False, \"shape\": (2L,)}", 16, EMBPS_NPY_U64,
         1, 2, 1);
  parses(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (0,), }", 0, EMBPS_NPY_I32, 1, 0, 1);
  parses(1, "{'descr': '<u4', 'fortran_order': False, 'shape': (), }", 4, EMBPS_NPY_U32, 0, 1, 1);
}

static void test_refusals(void **state) {
  static const uint8_t not_npy[] = "hello, world";
  static const uint8_t v9[] = "\x93NUMPY\x09\x00\x10\x00{}";
  size_t len;
  uint8_t *b;
  (void)state;
  refused(not_npy, sizeof(not_npy), "f.npy is not a .npy file");
  refused(v9, sizeof(v9) - 1, ".npy format version 9.0 is not one embps reads");
  refused((const uint8_t *)"\x93NUMPY\x01", 7, "f.npy is cut short");
  refused_dict("{'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }", 96,
               "holds dtype '<f8' (float64), which embps does not read");
  refused_dict("{'descr': '>f4', 'fortran_order': False, 'shape': (3, 4), }", 48,
               "'>f4' (big-endian float32)");
  refused_dict("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", 12,
               "not a plain type string");
  refused_dict("{'descr': '<f4', 'fortran_order': True, 'shape': (3, 4), }", 48,
               "is in Fortran order (fortran_order: True): save it in C order");
  refused_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 4), }", 96,
               "an array of 3 dimensions");
  refused_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 47,
               "f.npy is cut short: its header's shape (3, 4) of float32 needs 48 bytes of data, "
               "the file holds 47");
  refused_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 52,
               "holds 52 bytes of data, more than the 48");
  refused_dict("{'descr': '<f4', 'shape': (3, 4), }", 48, "lacks 'fortran_order'");
  refused_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), 'x': 1}", 48,
               "unknown or repeated key 'x'");
  refused_dict("{'descr': '<f4', 'fortran_order': False, 'shape': [3, 4]}", 48,
               "shape is not a tuple of integers");
  refused_dict("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (3,)}", 12,
               "fortran_order is neither True nor False");
  refused_dict("['descr']", 0, "it is not a dict");
  /* a header length past the end of the file */
  b = make(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 0, &len);
  refused(b, 40, "its .npy header is 118 bytes, the file holds 30");
  free(b);
}

static void test_files(void **state) {
  char path[] = "/tmp/embps-npy-XXXXXX";
  embps_npy_t n;
  char err[512];
  size_t len;
  uint8_t *b;
  int fd = mkstemp(path);
  (void)state;
  assert_true(fd >= 0);
  assert_int_equal(embps_npy_open(path, &n, err, sizeof(err)), -1); /* empty */
  assert_non_null(strstr(err, "is empty: it is not a .npy file"));
  assert_non_null(strstr(err, path));
  b = make(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", 16, &len);
  assert_int_equal(write(fd, b, len), (ssize_t)len);
  close(fd);
  assert_int_equal(embps_npy_open(path, &n, err, sizeof(err)), 0);
  assert_int_equal(n.shape[0], 2);
  assert_memory_equal(n.data, b + len - 16, 16);
  embps_npy_close(&n);
  embps_npy_close(&n); /* closed: a no-op */
  unlink(path);
  assert_int_equal(embps_npy_open(path, &n, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "cannot be opened"));
  assert_null(n.map);
  assert_string_equal(embps_npy_dtype_name(EMBPS_NPY_U16), "uint16");
  free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parses),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_files),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
