/* numpy's .npy files, read for `embps import` and `embps assign --rows-file`: the format's
 * header (magic, version, a Python dict of descr, fortran_order and shape) parsed strictly, the
 * data mapped read-only where it lies, and every way a file can be wrong refused with a
 * sentence that names the file and what is wrong before a byte of it is used.
 *
 * Read: versions 1.0, 2.0 and 3.0; little-endian (or byte-order-free) float32, uint16 (bf16
 * bits), int64, uint64, int32 and uint32; C order; 1-D or 2-D shapes. The data must be exactly
 * what the shape says: a file cut short or longer is refused. */
#ifndef EMBPS_CLI_NPY_H
#define EMBPS_CLI_NPY_H

#include <stddef.h>
#include <stdint.h>

/** The element types read. */
typedef enum embps_npy_dtype {
  EMBPS_NPY_F32 = 1, /* '<f4' */
  EMBPS_NPY_U16 = 2, /* '<u2': bf16 bits, by embps's convention */
  EMBPS_NPY_I64 = 3, /* '<i8' */
  EMBPS_NPY_U64 = 4, /* '<u8' */
  EMBPS_NPY_I32 = 5, /* '<i4' */
  EMBPS_NPY_U32 = 6, /* '<u4' */
} embps_npy_dtype_t;

/** A parsed .npy: its element type, its shape, where its data is. */
typedef struct embps_npy {
  embps_npy_dtype_t dtype;
  size_t itemsize;     /* bytes per element */
  unsigned ndim;       /* 0, 1 or 2 */
  uint64_t shape[2];   /* shape[0] rows (1 for 0-D), shape[1] columns (1 unless 2-D) */
  const uint8_t *data; /* shape[0] * shape[1] elements, C order */
  uint64_t data_bytes;
  void *map; /* embps_npy_open's mapping (NULL from embps_npy_parse), for embps_npy_close */
  size_t map_len;
} embps_npy_t;

/** numpy's name of the type ("float32", "uint16", ...). Static string. */
const char *embps_npy_dtype_name(embps_npy_dtype_t dtype);

/**
 * Parses the .npy bytes buf[0..len) into *out (its data points into buf). name names the bytes
 * in messages (the file's path). Returns 0, or -1 with a sentence in err (errlen bytes) that
 * starts with name: not a .npy file (magic), a version not read, a malformed or cut header, a
 * dtype not read (its descr and numpy's name), Fortran order, a shape of more than 2 dimensions
 * or too large, data cut short or longer than the shape says.
 */
int embps_npy_parse(const uint8_t *buf, size_t len, const char *name, embps_npy_t *out, char *err,
                    size_t errlen);

/** Maps the file at path read-only and parses it (embps_npy_parse, named by path); an empty or
 * unreadable file is refused naming it and why. On success the caller closes *out with
 * embps_npy_close; on failure nothing stays open. Returns 0 or -1 (err set). */
int embps_npy_open(const char *path, embps_npy_t *out, char *err, size_t errlen);

/** Unmaps what embps_npy_open mapped; a parse's or a zeroed struct is a no-op. */
void embps_npy_close(embps_npy_t *npy);

#endif
