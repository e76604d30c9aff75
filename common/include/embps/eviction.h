/* The eviction policies of a hash-keyed table: one enum for the client API and the server, and
 * part of the client library's public API (installed as <embps/eviction.h>, included by
 * <embps/embps.h>). */
#ifndef EMBPS_PUBLIC_EVICTION_H
#define EMBPS_PUBLIC_EVICTION_H

/** Which stored key a full hash-keyed table evicts for a new one, over the table's own clock (its
 * push steps, never a wall clock), ties broken by the smaller key; values equal embps.v1.Eviction.
 */
typedef enum embps_eviction {
  EMBPS_EVICTION_LRU = 1, /* the key pushed longest ago */
  EMBPS_EVICTION_LFU = 2, /* the key pushed least, with decay over half_life_steps */
  EMBPS_EVICTION_TTL = 3, /* LRU, and keys not pushed for ttl_steps expire */
} embps_eviction_t;

/** In a table spec: let the server choose (LRU); EVICTION_UNSPECIFIED on the wire. A request
 * value, not a policy, so it stays out of the enum (as EMBPS_OPTIMIZER_DEFAULT does). */
#define EMBPS_EVICTION_DEFAULT ((embps_eviction_t)0)

#endif
