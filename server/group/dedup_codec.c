/* The retry window's checkpoint encoding (dedup.h; docs/checkpoint-format.md, "The retry
 * window"). Every integer little-endian, every count checked against the bytes left before
 * anything is allocated for it, one crc32 over the whole file:
 *
 *   "EMBPSRTW" | format version u32 | round u64 | window u32 | names u32 | clients u32
 *   names    name: length u32 (below 128) | bytes
 *   clients  id u64 | last round u64 | floor u64 | flags u32 (bit 0: has a floor) | entries u32
 *            then entries, oldest first: batch id u64 | digest u64 | round u64 |
 *            grad_norm u64 (binary64 bits) | num_unique u64 | table u32 (a name's index) |
 *            flags u32 (bit 0 applied, bit 1 skipped)
 *   crc32 u32 of every byte before it
 *
 * Clients come from the least recent (ascending last round, then id), so a decode that records
 * them in file order rebuilds the same window, or, with fewer clients or a smaller window, the
 * one that recording the same pushes would have left. */
#include "server/group/dedup_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "common/byteorder.h"
#include "server/store/checkpoint.h"

#define MAGIC "EMBPSRTW"
#define HEADER_BYTES 32u
#define CLIENT_BYTES 32u
#define ENTRY_BYTES 48u
#define NO_NAME UINT32_MAX

static uint8_t *put_u32(uint8_t *p, uint32_t v) {
  embps_put_le32(p, v);
  return p + 4;
}

static uint8_t *put_u64(uint8_t *p, uint64_t v) {
  embps_put_le64(p, v);
  return p + 8;
}

/* Clients by recency: ascending last round, then id. */
static int cmp_recency(const void *a, const void *b) {
  const embps__dd_client_t *x = *(embps__dd_client_t *const *)a;
  const embps__dd_client_t *y = *(embps__dd_client_t *const *)b;
  if (x->last_round != y->last_round)
    return x->last_round < y->last_round ? -1 : 1;
  return x->id < y->id ? -1 : x->id > y->id;
}

static int in_scope(const embps_dedup_t *d, const embps__dd_entry_t *e, const char *scope) {
  return !scope || !scope[0] || strcmp(embps__dedup_name(d, e->table), scope) == 0;
}

static const embps__dd_entry_t *entry_at(const embps__dd_client_t *c, uint32_t k) {
  return &c->ring[(c->head + k) % c->ring_cap];
}

embps_status_t embps_dedup_encode(const embps_dedup_t *d, const char *scope, uint64_t round,
                                  uint8_t **out, size_t *len) {
  embps__dd_client_t **order = NULL;
  uint32_t *map = NULL, *order_names = NULL, *counts = NULL, nnames = 0, nclients = 0;
  size_t bytes = HEADER_BYTES + 4;
  uint8_t *buf = NULL, *p;
  embps_status_t ret = EMBPS_RESOURCE_EXHAUSTED;

  if (!(order = embps_malloc((d->nclients ? d->nclients : 1) * sizeof(*order))) ||
      !(counts = embps_calloc(d->nclients ? d->nclients : 1, sizeof(*counts))) ||
      !(map = embps_malloc((d->nnames ? d->nnames : 1) * sizeof(*map))) ||
      !(order_names = embps_malloc((d->nnames ? d->nnames : 1) * sizeof(*order_names))))
    goto exit;
  if (d->nclients)
    memcpy(order, d->clients, d->nclients * sizeof(*order));
  qsort(order, d->nclients, sizeof(*order), cmp_recency);
  for (uint32_t i = 0; i < d->nnames; i++)
    map[i] = NO_NAME;
  /* First pass: what is written, the names in order of first use, and the size. */
  for (uint32_t i = 0; i < d->nclients; i++) {
    const embps__dd_client_t *c = order[i];
    for (uint32_t k = 0; k < c->count; k++) {
      const embps__dd_entry_t *e = entry_at(c, k);
      if (!in_scope(d, e, scope))
        continue;
      counts[i]++;
      if (map[e->table] == NO_NAME) {
        map[e->table] = nnames++;
        bytes += 4 + strlen(embps__dedup_name(d, e->table));
      }
    }
    if (counts[i] || c->has_floor) {
      nclients++;
      bytes += CLIENT_BYTES + (size_t)counts[i] * ENTRY_BYTES;
    }
  }
  if (!(buf = embps_malloc(bytes)))
    goto exit;
  memcpy(buf, MAGIC, 8);
  p = put_u32(buf + 8, EMBPS_DEDUP_FORMAT_VERSION);
  p = put_u64(p, round);
  p = put_u32(p, d->window);
  p = put_u32(p, nnames);
  p = put_u32(p, nclients);
  for (uint32_t j = 0; j < d->nnames; j++) /* map[] numbers names by first use: invert it */
    if (map[j] != NO_NAME)
      order_names[map[j]] = j;
  for (uint32_t i = 0; i < nnames; i++) {
    const char *nm = embps__dedup_name(d, order_names[i]);
    size_t n = strlen(nm);
    p = put_u32(p, (uint32_t)n);
    memcpy(p, nm, n);
    p += n;
  }
  for (uint32_t i = 0; i < d->nclients; i++) {
    const embps__dd_client_t *c = order[i];
    if (!counts[i] && !c->has_floor)
      continue;
    p = put_u64(p, c->id);
    p = put_u64(p, c->last_round);
    p = put_u64(p, c->has_floor ? c->floor : 0);
    p = put_u32(p, c->has_floor ? 1u : 0u);
    p = put_u32(p, counts[i]);
    for (uint32_t k = 0; k < c->count; k++) {
      const embps__dd_entry_t *e = entry_at(c, k);
      uint64_t norm;
      if (!in_scope(d, e, scope))
        continue;
      memcpy(&norm, &e->result.grad_norm, sizeof(norm));
      p = put_u64(p, e->batch_id);
      p = put_u64(p, e->digest);
      p = put_u64(p, e->round);
      p = put_u64(p, norm);
      p = put_u64(p, e->result.num_unique);
      p = put_u32(p, map[e->table]);
      p = put_u32(p, (e->result.applied ? 1u : 0u) | (e->result.skipped ? 2u : 0u));
    }
  }
  put_u32(p, embps_ckpt_crc32(0, buf, bytes - 4));
  *out = buf;
  *len = bytes;
  buf = NULL;
  ret = EMBPS_OK;
exit:
  embps_free(buf);
  embps_free(order);
  embps_free(counts);
  embps_free(map);
  embps_free(order_names);
  return ret;
}

/* ---- decoding -------------------------------------------------------------------------------- */

typedef struct rbuf {
  const uint8_t *p;
  size_t len, off;
} rbuf_t;

static int left(const rbuf_t *r, size_t n) { return r->len - r->off >= n; }

static uint32_t get_u32(rbuf_t *r) {
  uint32_t v = embps_get_le32(r->p + r->off);
  r->off += 4;
  return v;
}

static uint64_t get_u64(rbuf_t *r) {
  uint64_t v = embps_get_le64(r->p + r->off);
  r->off += 8;
  return v;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Reads the names section into d's interned names (index = the file's), each once. Returns 0,
 * or -1 for a malformed section, -2 when out of memory. */
static int read_names(embps_dedup_t *d, rbuf_t *r, uint32_t n) {
  char **sorted;
  int bad = 0;
  if (!(d->names = embps_calloc(n ? n : 1, sizeof(*d->names))))
    return -2;
  d->names_cap = n ? n : 1;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t len;
    if (!left(r, 4))
      return -1;
    len = get_u32(r);
    if (len >= EMBPS_DEDUP_NAME_MAX || !left(r, len) || memchr(r->p + r->off, 0, len))
      return -1;
    if (!(d->names[i].name = embps_malloc(len + 1)))
      return -2;
    memcpy(d->names[i].name, r->p + r->off, len);
    d->names[i].name[len] = '\0';
    d->names[i].refs = 1; /* the file's own, while its entries are read (see the end) */
    r->off += len;
    d->nnames++;
  }
  /* Two equal names would be one table under two indices. */
  if (!(sorted = embps_malloc((n ? n : 1) * sizeof(*sorted))))
    return -2;
  for (uint32_t i = 0; i < n; i++)
    sorted[i] = d->names[i].name;
  qsort(sorted, n, sizeof(*sorted), cmp_names);
  for (uint32_t i = 1; i < n && !bad; i++)
    bad = strcmp(sorted[i - 1], sorted[i]) == 0;
  embps_free(sorted);
  return bad ? -1 : 0;
}

/* Reads one client and records its entries. Returns 0, -1 (malformed), -2 (out of memory).
 * *prev_round and *prev_id are the previous client's (the order is checked). */
static int read_client(embps_dedup_t *d, rbuf_t *r, uint64_t round, uint64_t *prev_round,
                       uint64_t *prev_id, int first) {
  uint64_t id, last, floor, prev_entry = 0;
  uint32_t flags, n;
  embps__dd_client_t *c;
  if (!left(r, CLIENT_BYTES))
    return -1;
  id = get_u64(r);
  last = get_u64(r);
  floor = get_u64(r);
  flags = get_u32(r);
  n = get_u32(r);
  if (!id || last > round || (flags & ~1u) || (!(flags & 1u) && floor) || (!n && !(flags & 1u)) ||
      n > EMBPS_DEDUP_WINDOW_MAX || !left(r, (size_t)n * ENTRY_BYTES))
    return -1;
  if (!first && (last < *prev_round || (last == *prev_round && id <= *prev_id)))
    return -1; /* out of order, or a client twice */
  *prev_round = last;
  *prev_id = id;
  for (uint32_t k = 0; k < n; k++) {
    embps_dedup_result_t res;
    uint64_t batch = get_u64(r), digest = get_u64(r), at = get_u64(r), norm = get_u64(r);
    uint64_t unique = get_u64(r);
    uint32_t table = get_u32(r), eflags = get_u32(r);
    if (!digest || table >= d->nnames || (eflags & ~3u) || at > last || at < prev_entry)
      return -1;
    if (embps__dedup_find(embps__dedup_client(d, id), batch))
      return -1; /* one batch twice */
    prev_entry = at;
    memset(&res, 0, sizeof(res));
    memcpy(&res.grad_norm, &norm, sizeof(norm));
    res.num_unique = unique;
    res.applied = (uint8_t)(eflags & 1u);
    res.skipped = (uint8_t)((eflags >> 1) & 1u);
    if (embps__dedup_put(d, id, batch, digest, table, at, &res) != EMBPS_OK)
      return -2;
  }
  if (!(c = embps__dedup_client(d, id)) && embps__dedup_client_get(d, id, &c) != EMBPS_OK)
    return -2;
  c->last_round = last;
  if (flags & 1u) {
    if (!c->has_floor || floor > c->floor)
      c->floor = floor;
    c->has_floor = 1;
  }
  return 0;
}

embps_status_t embps_dedup_decode(embps_dedup_t **out, uint32_t window, uint32_t max_clients,
                                  const uint8_t *p, size_t len, const char *name, uint64_t *round,
                                  embps_error_t *err) {
  rbuf_t r = {.p = p, .len = len >= 4 ? len - 4 : 0, .off = 8};
  embps_dedup_t *d = NULL;
  uint32_t nnames, nclients;
  uint64_t at, prev_round = 0, prev_id = 0, *ids = NULL;
  embps_status_t ret;
  int bad = 0;

  if ((ret = embps_ckpt_check_envelope(p, len, HEADER_BYTES, MAGIC, EMBPS_DEDUP_FORMAT_VERSION,
                                       "retry window file", name, err)) != EMBPS_OK)
    return ret;
  r.off = 12;
  at = get_u64(&r);
  (void)get_u32(&r); /* the writer's window: ours may differ */
  nnames = get_u32(&r);
  nclients = get_u32(&r);
  if (nclients > EMBPS_DEDUP_MAX_CLIENTS || nnames > (r.len - r.off) / 4 ||
      (size_t)nclients > (r.len - r.off) / CLIENT_BYTES)
    bad = -1;
  if ((ret = embps_dedup_new(&d, window, max_clients)) != EMBPS_OK)
    return embps_error_set(err, ret, "cannot make a retry window to read %s into", name);
  if (!bad)
    bad = read_names(d, &r, nnames);
  if (!bad && !(ids = embps_malloc((nclients ? nclients : 1) * sizeof(*ids))))
    bad = -2;
  for (uint32_t i = 0; i < nclients && !bad; i++) {
    bad = read_client(d, &r, at, &prev_round, &prev_id, i == 0);
    ids[i] = prev_id;
  }
  if (!bad) { /* a client twice (the order alone allows it at two last rounds) */
    qsort(ids, nclients, sizeof(*ids), cmp_u64);
    for (uint32_t i = 1; i < nclients && !bad; i++)
      bad = ids[i - 1] == ids[i] ? -1 : 0;
  }
  embps_free(ids);
  if (!bad && r.off != r.len)
    bad = -1;
  if (bad) {
    embps_dedup_free(d);
    if (bad == -2)
      return embps_error_set(err, EMBPS_RESOURCE_EXHAUSTED, "out of memory reading %s", name);
    return embps_error_set(err, EMBPS_DATA_LOSS,
                           "retry window file %s is malformed (near byte %zu of %zu)", name, r.off,
                           len);
  }
  /* The file's own references go: a name that only entries forgotten on the way (a smaller
   * window) carried, or none, is dropped. */
  for (uint32_t i = 0; i < d->nnames; i++)
    if (--d->names[i].refs == 0) {
      embps_free(d->names[i].name);
      d->names[i].name = NULL;
    }
  if (round)
    *round = at;
  *out = d;
  return EMBPS_OK;
}
