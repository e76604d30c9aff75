/* The optimizer kinds: one enum for the client API, the kernels and the server, and part of the
 * client library's public API (installed as <embps/optimizer.h>, included by <embps/embps.h>). */
#ifndef EMBPS_PUBLIC_OPTIMIZER_H
#define EMBPS_PUBLIC_OPTIMIZER_H

/** The fused sparse optimizers; values equal embps.v1.OptimizerKind. */
typedef enum embps_optimizer {
  EMBPS_OPTIMIZER_SGD = 1,
  EMBPS_OPTIMIZER_ADAGRAD = 2,
  EMBPS_OPTIMIZER_ROWWISE_ADAGRAD = 3,
  EMBPS_OPTIMIZER_ADAM = 4,
} embps_optimizer_t;

/** In a table spec: let the server choose (rowwise_adagrad); OPTIMIZER_UNSPECIFIED on the wire.
 * A request value, not an optimizer, so it stays out of the enum: a switch over the optimizers
 * needs no case for it. */
#define EMBPS_OPTIMIZER_DEFAULT ((embps_optimizer_t)0)

#endif
