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
  uint32_t last_name; /* the name found last (a hint) */
  size_t entries;
};

/** Client id's record, or NULL. */
embps__dd_client_t *embps__dedup_client(const embps_dedup_t *d, uint64_t id);

/** c's entry of batch_id, or NULL (c may be NULL). */
const embps__dd_entry_t *embps__dedup_find(const embps__dd_client_t *c, uint64_t batch_id);

/** Client id, made if new (replacing the least recent client when max_clients are held).
 * EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED (nothing changed). */
embps_status_t embps__dedup_client_get(embps_dedup_t *d, uint64_t id, embps__dd_client_t **out);

/** Records a push (client_id and digest nonzero, batch_id not held) of interned name `name`, as
 * embps_dedup_record does. EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED (nothing changed). */
embps_status_t embps__dedup_put(embps_dedup_t *d, uint64_t client_id, uint64_t batch_id,
                                uint64_t digest, uint32_t name, uint64_t round,
                                const embps_dedup_result_t *result);

/** Interned name i (an entry's table). */
const char *embps__dedup_name(const embps_dedup_t *d, uint32_t i);

#endif
