/* The retry window (see dedup.h).
 *
 * Clients are kept in an array sorted by id (binary search; a new client is inserted in
 * place, at most max_clients of them). Each client has a ring of its most recent pushes, oldest
 * at `head`, which grows by doubling up to `window` entries: while it grows it has never
 * wrapped (head 0), and it forgets its oldest entry only once it holds `window`. An open
 * addressing table (linear probing, backward-shift deletion) maps a batch id to its ring slot,
 * so a check or a record is O(1) per client and O(log clients) over them. Table names are
 * interned with a count of the entries that carry them, so an entry holds a small index.
 *
 * Every change depends only on the sequence of embps_dedup_record calls (and decodes), never
 * on an address or the time: windows fed the same records are the same. */
#include "server/group/dedup_internal.h"

#include <string.h>

#include "common/alloc.h"
#include "common/mix64.h"

#define SLOT_EMPTY UINT32_MAX
#define RING_FIRST 8u /* a new client's first ring */

embps_status_t embps_dedup_new(embps_dedup_t **out, uint32_t window, uint32_t max_clients) {
  embps_dedup_t *d;
  if (window == 0 || max_clients == 0)
    return EMBPS_INVALID_ARGUMENT;
  if (!(d = embps_calloc(1, sizeof(*d))))
    return EMBPS_RESOURCE_EXHAUSTED;
  d->window = window;
  d->max_clients = max_clients;
  *out = d;
  return EMBPS_OK;
}

static void client_free(embps__dd_client_t *c) {
  if (!c)
    return;
  embps_free(c->ring);
  embps_free(c->index);
  embps_free(c);
}

void embps_dedup_free(embps_dedup_t *d) {
  if (!d)
    return;
  for (uint32_t i = 0; i < d->nclients; i++)
    client_free(d->clients[i]);
  embps_free(d->clients);
  for (uint32_t i = 0; i < d->nnames; i++)
    embps_free(d->names[i].name);
  embps_free(d->names);
  embps_free(d);
}

uint32_t embps_dedup_window(const embps_dedup_t *d) { return d->window; }

size_t embps_dedup_size(const embps_dedup_t *d) { return d->entries; }

/* ---- clients --------------------------------------------------------------------------------- */

/* The position of client id in the sorted array: where it is (*found set) or would go. */
static uint32_t client_pos(const embps_dedup_t *d, uint64_t id, int *found) {
  uint32_t lo = 0, hi = d->nclients;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (d->clients[mid]->id < id)
      lo = mid + 1;
    else
      hi = mid;
  }
  *found = lo < d->nclients && d->clients[lo]->id == id;
  return lo;
}

embps__dd_client_t *embps__dedup_client(const embps_dedup_t *d, uint64_t id) {
  int found;
  uint32_t pos = client_pos(d, id, &found);
  return found ? d->clients[pos] : NULL;
}

/* The ring slot holding batch_id, or SLOT_EMPTY; *slot (if not NULL) gets its index slot, or
 * the empty index slot where it would go. */
static uint32_t find_batch(const embps__dd_client_t *c, uint64_t batch_id, uint32_t *slot) {
  /* splitmix64's finalizer: batch ids are sequential, slots must not be */
  uint32_t mask = c->index_cap - 1, i = (uint32_t)(embps_mix64(batch_id) & mask);
  while (c->index[i] != SLOT_EMPTY) {
    if (c->ring[c->index[i]].batch_id == batch_id)
      break;
    i = (i + 1) & mask;
  }
  if (slot)
    *slot = i;
  return c->index[i];
}

const embps__dd_entry_t *embps__dedup_find(const embps__dd_client_t *c, uint64_t batch_id) {
  uint32_t at = c && c->count ? find_batch(c, batch_id, NULL) : SLOT_EMPTY;
  return at == SLOT_EMPTY ? NULL : &c->ring[at];
}

/* Removes batch_id's index slot i, shifting back the entries of its probe run. */
static void index_remove(embps__dd_client_t *c, uint32_t i) {
  uint32_t mask = c->index_cap - 1, j = i;
  for (;;) {
    j = (j + 1) & mask;
    if (c->index[j] == SLOT_EMPTY)
      break;
    uint32_t home = (uint32_t)(embps_mix64(c->ring[c->index[j]].batch_id) & mask);
    /* j's entry may fill the hole at i unless its home lies cyclically in (i, j]. */
    if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
      c->index[i] = c->index[j];
      i = j;
    }
  }
  c->index[i] = SLOT_EMPTY;
}

/* Index slots for a ring of ring_cap: a power of two at least twice it. */
static uint32_t index_cap_for(uint32_t ring_cap) {
  uint32_t cap = 16;
  while (cap < 2 * (uint64_t)ring_cap)
    cap *= 2;
  return cap;
}

/* Rebuilds c's index over its ring (after growth, or a reset). */
static void index_rebuild(embps__dd_client_t *c) {
  uint32_t slot;
  for (uint32_t i = 0; i < c->index_cap; i++)
    c->index[i] = SLOT_EMPTY;
  for (uint32_t k = 0; k < c->count; k++) {
    uint32_t at = (c->head + k) % c->ring_cap;
    find_batch(c, c->ring[at].batch_id, &slot);
    c->index[slot] = at;
  }
}

/* Makes room in c's ring for one more entry when it is full and below the window: the ring has
 * never wrapped then (head 0), so it grows in place. EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED
 * (c unchanged). */
static embps_status_t ring_reserve(const embps_dedup_t *d, embps__dd_client_t *c) {
  uint32_t cap, icap;
  embps__dd_entry_t *ring;
  uint32_t *index;
  if (c->count < c->ring_cap || c->ring_cap >= d->window)
    return EMBPS_OK;
  cap = c->ring_cap ? (c->ring_cap > d->window / 2 ? d->window : c->ring_cap * 2)
                    : (d->window < RING_FIRST ? d->window : RING_FIRST);
  icap = index_cap_for(cap);
  if (!(index = embps_malloc((size_t)icap * sizeof(*index))))
    return EMBPS_RESOURCE_EXHAUSTED;
  if (!(ring = embps_realloc(c->ring, (size_t)cap * sizeof(*ring)))) {
    embps_free(index);
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  embps_free(c->index);
  c->ring = ring;
  c->ring_cap = cap;
  c->index = index;
  c->index_cap = icap;
  index_rebuild(c);
  return EMBPS_OK;
}

/* ---- table names ----------------------------------------------------------------------------- */

/* The index of name among the interned names, adding it (with no entries yet) if new; *added
 * says so, for undo. EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED. */
static embps_status_t name_get(embps_dedup_t *d, const char *name, uint32_t *out, int *added) {
  uint32_t free_at = UINT32_MAX;
  char *copy;
  size_t len = strnlen(name, EMBPS_DEDUP_NAME_MAX - 1);
  *added = 0;
  /* Pushes come in runs on one table: the last name found is looked at first. */
  if (d->last_name < d->nnames && d->names[d->last_name].name &&
      strncmp(d->names[d->last_name].name, name, len) == 0 &&
      d->names[d->last_name].name[len] == '\0') {
    *out = d->last_name;
    return EMBPS_OK;
  }
  for (uint32_t i = 0; i < d->nnames; i++) {
    if (!d->names[i].name) {
      if (free_at == UINT32_MAX)
        free_at = i;
    } else if (strncmp(d->names[i].name, name, len) == 0 && d->names[i].name[len] == '\0') {
      *out = d->last_name = i;
      return EMBPS_OK;
    }
  }
  if (!(copy = embps_malloc(len + 1)))
    return EMBPS_RESOURCE_EXHAUSTED;
  memcpy(copy, name, len);
  copy[len] = '\0';
  if (free_at == UINT32_MAX) {
    if (d->nnames == d->names_cap) {
      uint32_t cap = d->names_cap ? d->names_cap * 2 : 4;
      embps__dd_name_t *n = embps_realloc(d->names, (size_t)cap * sizeof(*n));
      if (!n) {
        embps_free(copy);
        return EMBPS_RESOURCE_EXHAUSTED;
      }
      d->names = n;
      d->names_cap = cap;
    }
    free_at = d->nnames++;
  }
  d->names[free_at].name = copy;
  d->names[free_at].refs = 0;
  *out = d->last_name = free_at;
  *added = 1;
  return EMBPS_OK;
}

/* One entry fewer carries name i: the last one frees it. */
static void name_unref(embps_dedup_t *d, uint32_t i) {
  if (--d->names[i].refs == 0) {
    embps_free(d->names[i].name);
    d->names[i].name = NULL;
  }
}

const char *embps__dedup_name(const embps_dedup_t *d, uint32_t i) { return d->names[i].name; }

/* ---- recording ------------------------------------------------------------------------------- */

/* Forgets c's oldest entry: it becomes the floor if above it. */
static void forget_oldest(embps_dedup_t *d, embps__dd_client_t *c) {
  embps__dd_entry_t *e = &c->ring[c->head];
  uint32_t slot;
  find_batch(c, e->batch_id, &slot);
  index_remove(c, slot);
  if (!c->has_floor || e->batch_id > c->floor)
    c->floor = e->batch_id;
  c->has_floor = 1;
  name_unref(d, e->table);
  c->head = (c->head + 1) % c->ring_cap;
  c->count--;
  d->entries--;
}

/* Forgets everything client c holds, for its struct to serve another client. */
static void client_reset(embps_dedup_t *d, embps__dd_client_t *c, uint64_t id) {
  for (uint32_t k = 0; k < c->count; k++)
    name_unref(d, c->ring[(c->head + k) % c->ring_cap].table);
  d->entries -= c->count;
  c->head = c->count = 0;
  for (uint32_t i = 0; i < c->index_cap; i++)
    c->index[i] = SLOT_EMPTY;
  c->id = id;
  c->floor = c->last_round = 0;
  c->has_floor = 0;
}

/* The client a new one replaces: the one whose last push is oldest, ties to the smaller id. */
static uint32_t least_recent(const embps_dedup_t *d) {
  uint32_t best = 0;
  for (uint32_t i = 1; i < d->nclients; i++)
    if (d->clients[i]->last_round < d->clients[best]->last_round)
      best = i; /* sorted by id: on a tie the earlier (smaller) one stays */
  return best;
}

embps_status_t embps__dedup_client_get(embps_dedup_t *d, uint64_t id, embps__dd_client_t **out) {
  int found;
  uint32_t pos = client_pos(d, id, &found), victim;
  embps__dd_client_t *c;
  if (found) {
    *out = d->clients[pos];
    return EMBPS_OK;
  }
  if (d->nclients < d->max_clients) {
    if (d->nclients == d->clients_cap) {
      uint32_t cap = d->clients_cap ? d->clients_cap * 2 : 16;
      embps__dd_client_t **a;
      if (cap > d->max_clients)
        cap = d->max_clients;
      if (!(a = embps_realloc(d->clients, (size_t)cap * sizeof(*a))))
        return EMBPS_RESOURCE_EXHAUSTED;
      d->clients = a;
      d->clients_cap = cap;
    }
    if (!(c = embps_calloc(1, sizeof(*c))))
      return EMBPS_RESOURCE_EXHAUSTED;
    c->id = id;
    if (ring_reserve(d, c) != EMBPS_OK) {
      client_free(c);
      return EMBPS_RESOURCE_EXHAUSTED;
    }
    memmove(&d->clients[pos + 1], &d->clients[pos], (size_t)(d->nclients - pos) * sizeof(c));
    d->clients[pos] = c;
    d->nclients++;
    *out = c;
    return EMBPS_OK;
  }
  /* Full: the least recent client's struct (its ring and index kept) moves to id's place. */
  victim = least_recent(d);
  c = d->clients[victim];
  client_reset(d, c, id);
  if (victim < pos) {
    pos--; /* id goes after the victim's old place, which closes up */
    memmove(&d->clients[victim], &d->clients[victim + 1], (size_t)(pos - victim) * sizeof(c));
  } else {
    memmove(&d->clients[pos + 1], &d->clients[pos], (size_t)(victim - pos) * sizeof(c));
  }
  d->clients[pos] = c;
  *out = c;
  return EMBPS_OK;
}

embps_status_t embps__dedup_put(embps_dedup_t *d, uint64_t client_id, uint64_t batch_id,
                                uint64_t digest, uint32_t name, uint64_t round,
                                const embps_dedup_result_t *result) {
  embps__dd_client_t *c = embps__dedup_client(d, client_id);
  embps__dd_entry_t *e;
  uint32_t at, slot;
  if ((c ? ring_reserve(d, c) : embps__dedup_client_get(d, client_id, &c)) != EMBPS_OK)
    return EMBPS_RESOURCE_EXHAUSTED;
  if (c->count == d->window)
    forget_oldest(d, c);
  at = (c->head + c->count) % c->ring_cap;
  e = &c->ring[at];
  e->batch_id = batch_id;
  e->digest = digest;
  e->round = round;
  e->table = name;
  e->result = *result;
  d->names[name].refs++;
  find_batch(c, batch_id, &slot);
  c->index[slot] = at;
  c->count++;
  d->entries++;
  c->last_round = round;
  return EMBPS_OK;
}

embps_status_t embps_dedup_record(embps_dedup_t *d, uint64_t client_id, uint64_t batch_id,
                                  uint64_t digest, const char *table, uint64_t round,
                                  const embps_dedup_result_t *result) {
  uint32_t name;
  int added;
  if (!client_id || !digest)
    return EMBPS_OK;
  if (embps__dedup_find(embps__dedup_client(d, client_id), batch_id))
    return EMBPS_OK; /* held already: the first attempt's answer stays */
  if (name_get(d, table ? table : "", &name, &added) != EMBPS_OK)
    return EMBPS_RESOURCE_EXHAUSTED;
  if (embps__dedup_put(d, client_id, batch_id, digest, name, round, result) != EMBPS_OK) {
    if (added) {
      embps_free(d->names[name].name);
      d->names[name].name = NULL;
    }
    return EMBPS_RESOURCE_EXHAUSTED;
  }
  return EMBPS_OK;
}

embps_dedup_verdict_t embps_dedup_check(const embps_dedup_t *d, uint64_t client_id,
                                        uint64_t batch_id, uint64_t digest,
                                        embps_dedup_result_t *result, uint64_t *first_digest) {
  const embps__dd_client_t *c;
  const embps__dd_entry_t *e;
  if (!client_id || !digest || !(c = embps__dedup_client(d, client_id)))
    return EMBPS_DEDUP_NEW;
  if (!(e = embps__dedup_find(c, batch_id)))
    return c->has_floor && batch_id <= c->floor ? EMBPS_DEDUP_FORGOTTEN : EMBPS_DEDUP_NEW;
  if (result)
    *result = e->result;
  if (first_digest)
    *first_digest = e->digest;
  return e->digest == digest ? EMBPS_DEDUP_REPLAY : EMBPS_DEDUP_CONFLICT;
}
