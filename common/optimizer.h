/* The optimizer kinds (embps_optimizer_t, EMBPS_OPTIMIZER_DEFAULT): public API, declared once in
 * include/embps/optimizer.h, which the installed <embps/embps.h> includes. This header is the
 * common layer's name for it, kept so that its users need not know where public API lives. */
#ifndef EMBPS_OPTIMIZER_H
#define EMBPS_OPTIMIZER_H

#include "embps/optimizer.h"

#endif
