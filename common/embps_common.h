/* The common module's face: what client and server share besides proto/ (status codes,
 * allocation, logging, dtypes, shape validation). */
#ifndef EMBPS_COMMON_H
#define EMBPS_COMMON_H

#include "alloc.h"
#include "dtype.h"
#include "log.h"
#include "shape.h"
#include "status.h"

#endif
