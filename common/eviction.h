/* The eviction registry: the one declaration of every eviction policy's name, which the server's
 * messages and the CLI read. The kinds (embps_eviction_t, EMBPS_EVICTION_DEFAULT) are public API,
 * declared in include/embps/eviction.h with the values of embps.v1.Eviction; every kind has one
 * row of EMBPS_EVICTIONS, and a kind without a row fails the build (eviction.c switches over the
 * enum with a case per row, and -Wswitch names a missing case). */
#ifndef EMBPS_EVICTION_H
#define EMBPS_EVICTION_H

#include "common/status.h"
#include "embps/eviction.h"

/**
 * X(KIND, name, server_default): one row per policy, in the order lists of them are printed.
 *  - KIND: the suffix of its EMBPS_EVICTION_ constant.
 *  - name: as the CLI, the server's messages and the docs spell it.
 *  - server_default: 1 for the one policy a spec's EMBPS_EVICTION_DEFAULT stands for.
 */
#define EMBPS_EVICTIONS(X)                                                                         \
  X(LRU, "lru", 1)                                                                                 \
  X(LFU, "lfu", 0)                                                                                 \
  X(TTL, "ttl", 0)

/** The policy the server gives a hash-keyed table whose spec says EMBPS_EVICTION_DEFAULT (a
 * constant expression). */
#define EMBPS_EVICTION_SERVER_DEFAULT                                                              \
  ((embps_eviction_t)(0 EMBPS_EVICTIONS(EMBPS__EVICTION_IF_DEFAULT)))
#define EMBPS__EVICTION_IF_DEFAULT(kind, name, dflt) +(dflt)*EMBPS_EVICTION_##kind

/** Every policy's name, in registry order and ", "-separated ("lru, lfu, ttl"): a constant. */
#define EMBPS_EVICTION_NAMES (&(EMBPS_EVICTIONS(EMBPS__EVICTION_LIST_ITEM))[2])
#define EMBPS__EVICTION_LIST_ITEM(kind, name, dflt) ", " name

/** The policy's name ("lfu", static); "unknown" for a value that is none, such as
 * EMBPS_EVICTION_DEFAULT or a number off the wire. */
const char *embps_eviction_name(embps_eviction_t kind);

/** 1 when kind is a policy of the registry (EMBPS_EVICTION_DEFAULT is not), else 0. */
int embps_eviction_known(embps_eviction_t kind);

/**
 * The policy called name (a registry name). Returns EMBPS_OK with *out set, or
 * EMBPS_INVALID_ARGUMENT with *out untouched for any other string (NULL included); the caller
 * words the message, with EMBPS_EVICTION_NAMES.
 */
embps_status_t embps_eviction_from_name(const char *name, embps_eviction_t *out);

#endif
