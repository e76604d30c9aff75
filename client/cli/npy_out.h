/* Writing numpy .npy files (format 1.0: https://numpy.org/doc/stable/reference/generated/
 * numpy.lib.format.html) a chunk at a time, so that an array far larger than memory is written
 * with its header first and its rows streamed after it. Used by `embps export`. */
#ifndef EMBPS_CLI_NPY_OUT_H
#define EMBPS_CLI_NPY_OUT_H

#include <stddef.h>
#include <stdint.h>

/** The longest header embps_npy_header writes. */
#define EMBPS_NPY_HEADER_MAX 256

/**
 * Writes the header of a .npy file of format 1.0 for a C-order array of `ndim` (1 or 2)
 * dimensions `shape` whose elements numpy's `descr` names ("<f4", "<u2", "<i8") into out (at
 * least EMBPS_NPY_HEADER_MAX bytes): the magic, the version, the header's length and its
 * dictionary, padded with spaces and a newline so that the data starts at a multiple of 64
 * bytes. Returns the header's length, or 0 for an ndim other than 1 or 2.
 */
size_t embps_npy_header(char *out, const char *descr, const uint64_t *shape, int ndim);

/** A .npy file being written: to `<path>.tmp`, renamed onto path by embps_npy_out_commit. */
typedef struct embps_npy_out {
  int fd;
  char path[4096];
  char tmp[4096 + 8];
  uint64_t bytes, expected; /* bytes written; bytes the header's shape makes the whole file */
} embps_npy_out_t;

/**
 * Creates `<path>.tmp` and writes the header of an array of shape (ndim 1 or 2) with elements of
 * `elem` bytes described by descr. Returns 0, or -1 with a message naming the file in err
 * (errlen bytes); f is then closed.
 */
int embps_npy_out_open(embps_npy_out_t *f, const char *path, const char *descr, size_t elem,
                       const uint64_t *shape, int ndim, char *err, size_t errlen);

/** Appends n bytes of the array's elements. Returns 0, or -1 with a message naming the file. */
int embps_npy_out_write(embps_npy_out_t *f, const void *p, size_t n, char *err, size_t errlen);

/** Checks that every element the header promises was written, closes the file and renames it
 * onto its path. Returns 0, or -1 with a message naming the file (the temporary file is then
 * removed). */
int embps_npy_out_commit(embps_npy_out_t *f, char *err, size_t errlen);

/** Closes and removes the temporary file of an f that is not committed (f->fd < 0: nothing). */
void embps_npy_out_abandon(embps_npy_out_t *f);

#endif
