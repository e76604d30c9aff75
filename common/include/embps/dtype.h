/* The storage dtypes of a table: part of the client library's public API (installed as
 * <embps/dtype.h>, included by <embps/embps.h>). Element sizes and the bf16 conversions are
 * internal helpers in common/dtype.h. */
#ifndef EMBPS_PUBLIC_DTYPE_H
#define EMBPS_PUBLIC_DTYPE_H

/** A table's element type; values equal embps.v1.DType on the wire. An f32 element is 4 bytes,
 * a bf16 element 2 (the high half of the f32 bits). */
typedef enum embps_dtype {
  EMBPS_DTYPE_F32 = 1,
  EMBPS_DTYPE_BF16 = 2,
} embps_dtype_t;

#endif
