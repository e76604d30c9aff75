/* The client library's in-tree name, for the tests that include "client/embps.h": its public
 * header <embps/embps.h> (include/embps/embps.h, what is installed) and common/'s internal helpers
 * over the public types (dtype sizes and bf16 conversions, embps_error_set/clear). A program
 * outside the tree includes <embps/embps.h> only. */
#ifndef EMBPS_CLIENT_EMBPS_H
#define EMBPS_CLIENT_EMBPS_H

#include "common/dtype.h"
#include "common/status.h"
#include "embps/embps.h"

#endif
