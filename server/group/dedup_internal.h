/* The retry window's representation, shared by its bookkeeping (dedup.c) and its checkpoint
 * encoding (dedup_codec.c); internal to the group layer. */
#ifndef EMBPS_GROUP_DEDUP_INTERNAL_H
#define EMBPS_GROUP_DEDUP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "server/group/dedup.h"

/** Table names are store names: below this many bytes with their NUL. */
#define EMBPS_DEDUP_NAME_MAX 128

/* One push the window holds. */
typedef struct embps__dd_entry {
  uint64_t batch_id, digest, round;
  embps_dedup_result_t result;
  uint32_t table; /* index into the window's names */
} embps__dd_entry_t;

/* One client: a ring of its pushes, oldest at head, and a map from batch id to ring slot. */
typedef struct embps__dd_client {
  uint64_t id;
  uint64_t floor;      /* the highest batch id forgotten, if has_floor */
  uint64_t last_round; /* the round of its last recorded push */
  int has_floor;
  uint32_t head, count, ring_cap; /* ring_cap grows by doubling up to the window */
  embps__dd_entry_t *ring;
  uint32_t *index, index_cap; /* ring slots, UINT32_MAX empty; index_cap a power of two */
} embps__dd_client_t;

/* An interned table name and how many entries carry it (0: the slot is free, name NULL). */
typedef struct embps__dd_name {
  char *name;
  uint64_t refs;
} embps__dd_name_t;

struct embps_dedup {
  uint32_t window, max_clients;
  embps__dd_client_t **clients; /* nclients, sorted by id */
  uint32_t nclients, clients_cap;
  embps__dd_name_t *names;
  uint32_t nnames, names_cap;
  size_t entries;
};

/** Client id's record, or NULL. */
embps__dd_client_t *embps__dedup_client(const embps_dedup_t *d, uint64_t id);

/** c's entry of batch_id, or NULL (c may be NULL). */
const embps__dd_entry_t *embps__dedup_find(const embps__dd_client_t *c, uint64_t batch_id);

/** Interned name i (an entry's table). */
const char *embps__dedup_name(const embps_dedup_t *d, uint32_t i);

#endif
