/* Agreement between ranks (agreement.h).
 *
 * An identity is plain "key=value\n" text so that adding a key needs no protocol change: ranks
 * compare whatever keys they send. The comparison walks one side's lines and looks each key up
 * on the other side, both ways, and reports the first difference in the order of the side it
 * walks, so the message names one key with both values rather than a diff. Values quoted in a
 * message are clipped so the whole sentence fits an embps_error_t. */
#include "server/group/agreement.h"

#include <stdio.h>
#include <string.h>

#include "server/group/bootstrap.h"
#include "server/group/control.h"
#include "server/group/group.h"

/* Values quoted in a mismatch message are clipped to this many bytes. */
#define MAX_QUOTED 120

embps_status_t embps_group_identity_format(char *out, size_t cap, const char *version,
                                           const char *mesh, const char *table_axis,
                                           const char *data_axis, const char *peers) {
  int n =
      snprintf(out, cap, "version=%s\ncontrol=%u\nmesh=%s\ntable_axis=%s\ndata_axis=%s\npeers=%s\n",
               version, (unsigned)EMBPS__CONTROL_VERSION, mesh, table_axis, data_axis, peers);
  return n < 0 || (size_t)n >= cap ? EMBPS_INVALID_ARGUMENT : EMBPS_OK;
}

/* One "key=value" line of an identity; a line without '=' is a key with an empty value. */
typedef struct line {
  const char *key, *val;
  size_t len, klen, vlen; /* len 0: a blank line */
} line_t;

/* Reads the line at *p into l and advances *p past it. Returns 0 at the end of the text. */
static int next_line(const char **p, line_t *l) {
  if (!**p)
    return 0;
  const char *eol = strchr(*p, '\n');
  size_t len = eol ? (size_t)(eol - *p) : strlen(*p);
  const char *eq = memchr(*p, '=', len);
  l->key = *p;
  l->len = len;
  l->klen = eq ? (size_t)(eq - *p) : len;
  l->val = eq ? eq + 1 : *p + len;
  l->vlen = eq ? len - l->klen - 1 : 0;
  *p += len + (eol ? 1 : 0);
  return 1;
}

/* Finds key in text; the first occurrence wins. Returns 1 and sets *found when present. */
static int find_key(const char *text, const char *key, size_t klen, line_t *found) {
  line_t l;
  while (next_line(&text, &l))
    if (l.len > 0 && l.klen == klen && memcmp(l.key, key, klen) == 0) {
      *found = l;
      return 1;
    }
  return 0;
}

/* The first line of a (in a's order) that b lacks or gives another value. Returns 1 and sets
 * *in_a and, when b has the key, *in_b (*b_has says whether it does). */
static int first_difference(const char *a, const char *b, line_t *in_a, line_t *in_b, int *b_has) {
  line_t l;
  while (next_line(&a, &l)) {
    if (l.len == 0)
      continue; /* a blank line */
    *b_has = find_key(b, l.key, l.klen, in_b);
    if (!*b_has || in_b->vlen != l.vlen || memcmp(in_b->val, l.val, l.vlen) != 0) {
      *in_a = l;
      return 1;
    }
  }
  return 0;
}

static int clip(size_t n) { return n > MAX_QUOTED ? MAX_QUOTED : (int)n; }
static const char *ellipsis(size_t n) { return n > MAX_QUOTED ? "..." : ""; }

int embps__identity_differs(const char *here, uint32_t here_rank, const char *there,
                            uint32_t there_rank, char *why, size_t cap) {
  line_t h, t;
  int has;
  if (strcmp(here, there) == 0)
    return 0;
  if (first_difference(here, there, &h, &t, &has)) {
    if (has)
      snprintf(why, cap,
               "rank %u's configuration differs from rank %u's: %.*s is '%.*s%s' there and "
               "'%.*s%s' here",
               there_rank, here_rank, clip(h.klen), h.key, clip(t.vlen), t.val, ellipsis(t.vlen),
               clip(h.vlen), h.val, ellipsis(h.vlen));
    else
      snprintf(why, cap,
               "rank %u's configuration differs from rank %u's: %.*s is not set there and "
               "'%.*s%s' here",
               there_rank, here_rank, clip(h.klen), h.key, clip(h.vlen), h.val, ellipsis(h.vlen));
    return 1;
  }
  if (first_difference(there, here, &t, &h, &has)) {
    snprintf(why, cap,
             "rank %u's configuration differs from rank %u's: %.*s is '%.*s%s' there and not "
             "set here",
             there_rank, here_rank, clip(t.klen), t.key, clip(t.vlen), t.val, ellipsis(t.vlen));
    return 1;
  }
  return 0; /* same keys and values, in another order or with blank lines */
}

/* The identity's key for the group secret (server/main.c writes it): "none", or the check's
 * algorithm. */
#define SECRET_KEY "group_secret"
#define NO_SECRET "none"

/* Whether one side has a group secret and the other none; then why says so, in the words the
 * README gives for a rank that cannot pass the group secret check. */
static int secret_differs(const char *here, uint32_t here_rank, const char *there,
                          uint32_t there_rank, const char *addr, char *why, size_t cap) {
  line_t h, t;
  int here_none, there_none;
  if (!find_key(here, SECRET_KEY, strlen(SECRET_KEY), &h) ||
      !find_key(there, SECRET_KEY, strlen(SECRET_KEY), &t))
    return 0;
  here_none = h.vlen == strlen(NO_SECRET) && memcmp(h.val, NO_SECRET, h.vlen) == 0;
  there_none = t.vlen == strlen(NO_SECRET) && memcmp(t.val, NO_SECRET, t.vlen) == 0;
  if (here_none == there_none)
    return 0; /* both without, or both with (another algorithm is a plain difference) */
  snprintf(why, cap,
           "rank %u at %s failed the group secret check: it has %s group secret and rank %u has "
           "%s (" SECRET_KEY " is '%.*s%s' there and '%.*s%s' here); start every rank with the "
           "same --group-secret-file",
           there_rank, addr, there_none ? "no" : "a", here_rank, there_none ? "one" : "none",
           clip(t.vlen), t.val, ellipsis(t.vlen), clip(h.vlen), h.val, ellipsis(h.vlen));
  return 1;
}

int embps__judge_hello(uint32_t rank, uint32_t size, const char *here_identity,
                       const embps__hello_t *h, const char *identity, const char *addr,
                       const int *control_fds, const int *data_fds, char *why, size_t cap) {
  if (h->size != size) {
    snprintf(why, cap, "rank %u's group size differs from rank %u's: size is %u there and %u here",
             h->rank, rank, h->size, size);
    return 1;
  }
  if (h->kind > EMBPS_GROUP_CONN_DATA) {
    snprintf(why, cap, "a peer calling itself rank %u opened a connection of unknown kind %u",
             h->rank, h->kind);
    return 1;
  }
  if (h->rank <= rank || h->rank >= size) {
    snprintf(why, cap,
             "a peer calling itself rank %u connected to rank %u, where only ranks %u..%u "
             "connect; do two processes have the same rank?",
             h->rank, rank, rank + 1, size - 1);
    return 1;
  }
  const int *fds = h->kind == EMBPS_GROUP_CONN_CONTROL ? control_fds : data_fds;
  if (fds[h->rank] >= 0) {
    snprintf(why, cap,
             "rank %u opened a second %s connection to rank %u; is rank %u running twice?", h->rank,
             h->kind == EMBPS_GROUP_CONN_CONTROL ? "control" : "data", rank, h->rank);
    return 1;
  }
  if (secret_differs(here_identity, rank, identity, h->rank, addr, why, cap))
    return 1;
  return embps__identity_differs(here_identity, rank, identity, h->rank, why, cap);
}

int embps__claims_conflict(const embps__device_claim_t *claims, uint32_t n, char *why, size_t cap) {
  for (uint32_t a = 0; a < n; a++)
    for (uint32_t b = a + 1; b < n; b++)
      if (strcmp(claims[a].host, claims[b].host) == 0 &&
          strcmp(claims[a].bus_id, claims[b].bus_id) == 0) {
        snprintf(why, cap,
                 "ranks %u and %u both claim CUDA device %d (PCI %.32s) on host %.64s: give "
                 "each rank its own device with --device or EMBPS_DEVICE",
                 a, b, (int)claims[a].device, claims[a].bus_id, claims[a].host);
        return 1;
      }
  return 0;
}
