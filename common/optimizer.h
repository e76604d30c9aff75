/* The optimizer registry: the one declaration of every optimizer's name and of what it keeps,
 * which the server's store, its messages and the CLI read (the Python library keeps its own
 * mapping to the proto enum, and tests/python/test_optimizer_names.py holds it equal to this
 * one). The kinds themselves (embps_optimizer_t, EMBPS_OPTIMIZER_DEFAULT) are public API,
 * declared in include/embps/optimizer.h with the values of embps.v1.OptimizerKind; every kind has
 * one row of EMBPS_OPTIMIZERS, and a kind without a row fails the build (optimizer.c switches
 * over the enum with a case per row, and -Wswitch names a missing case). */
#ifndef EMBPS_OPTIMIZER_H
#define EMBPS_OPTIMIZER_H

#include "common/status.h"
#include "embps/optimizer.h"

/**
 * X(KIND, name, server_default, state_per_element, state_per_row, accumulator): one row per
 * optimizer, in the order lists of them are printed. Every optimizer has a fused table update
 * on every backend (the kernels' opt_<name> files), so async pushes take any of them.
 *  - KIND: the suffix of its EMBPS_OPTIMIZER_ constant.
 *  - name: as the CLI, the server's messages and the Python library spell it.
 *  - server_default: 1 for the one optimizer a spec's EMBPS_OPTIMIZER_DEFAULT stands for.
 *  - state_per_element, state_per_row: its float state arrays of rows x shard_width, of rows.
 *  - accumulator: 1 where its first state array is an accumulator that starts at the spec's
 *    initial_accumulator (other state starts at 0).
 */
#define EMBPS_OPTIMIZERS(X)                                                                        \
  X(SGD, "sgd", 0, 0, 0, 0)                                                                        \
  X(ADAGRAD, "adagrad", 0, 1, 0, 1)                                                                \
  X(ROWWISE_ADAGRAD, "rowwise_adagrad", 1, 0, 1, 1)                                                \
  X(ADAM, "adam", 0, 2, 0, 0)

/** The optimizer the server gives a table whose spec says EMBPS_OPTIMIZER_DEFAULT (the row of
 * EMBPS_OPTIMIZERS marked server_default; a constant expression). */
#define EMBPS_OPTIMIZER_SERVER_DEFAULT                                                             \
  ((embps_optimizer_t)(0 EMBPS_OPTIMIZERS(EMBPS__OPTIMIZER_IF_DEFAULT)))
#define EMBPS__OPTIMIZER_IF_DEFAULT(kind, name, dflt, ...) +(dflt)*EMBPS_OPTIMIZER_##kind

/** Every optimizer's name, in registry order and ", "-separated ("sgd, adagrad, ..."): a
 * constant, usable in a static initializer. */
#define EMBPS_OPTIMIZER_NAMES (&(EMBPS_OPTIMIZERS(EMBPS__OPTIMIZER_LIST_ITEM))[2])
#define EMBPS__OPTIMIZER_LIST_ITEM(kind, name, ...) ", " name

/**
 * The hyper-parameters a table gets where its spec says 0, the same for every optimizer (the
 * initial scale's, 1/sqrt(emb_width), is the store's). Written as unsuffixed decimal literals so
 * that help texts can print them as written (EMBPS_OPTIMIZER_STR); the float of each equals the
 * f-suffixed literal.
 */
#define EMBPS_OPTIMIZER_DEFAULT_LR 0.01
#define EMBPS_OPTIMIZER_DEFAULT_EPS 1e-8
#define EMBPS_OPTIMIZER_DEFAULT_BETA1 0.9
#define EMBPS_OPTIMIZER_DEFAULT_BETA2 0.999

/** A macro's expansion as a string literal: EMBPS_OPTIMIZER_STR(EMBPS_OPTIMIZER_DEFAULT_LR) is
 * "0.01". */
#define EMBPS_OPTIMIZER_STR(x) EMBPS__OPTIMIZER_STR(x)
#define EMBPS__OPTIMIZER_STR(x) #x

/** One row of the registry (see EMBPS_OPTIMIZERS for the fields). Untagged: a tag named like
 * embps_optimizer_info() would shadow it in the C++ (CUDA) files that include this header. */
typedef struct {
  embps_optimizer_t kind;
  const char *name;      /* static */
  int server_default;    /* 1 for EMBPS_OPTIMIZER_SERVER_DEFAULT */
  int state_per_element; /* float state arrays of rows x shard_width */
  int state_per_row;     /* float state arrays of rows */
  int accumulator;       /* state0 starts at initial_accumulator */
} embps_optimizer_info_t;

/** The registry's row for an optimizer (static); NULL for a kind that is none, such as
 * EMBPS_OPTIMIZER_DEFAULT. */
const embps_optimizer_info_t *embps_optimizer_info(embps_optimizer_t kind);

/** The optimizer's name ("rowwise_adagrad", static); "unknown" for a kind that is none. */
const char *embps_optimizer_name(embps_optimizer_t kind);

/**
 * The optimizer called name: a registry name, with '-' accepted for '_' ("rowwise-adagrad", as
 * the CLI has always taken it). Returns EMBPS_OK with *out set, or EMBPS_INVALID_ARGUMENT with
 * *out untouched for any other string (NULL included); the caller words the message, with
 * EMBPS_OPTIMIZER_NAMES.
 */
embps_status_t embps_optimizer_from_name(const char *name, embps_optimizer_t *out);

#endif
