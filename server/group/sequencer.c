/* The sequencer (see sequencer.h).
 *
 * Pending batches live in an array kept in first-arrival order; each has a per-rank arrival
 * flag and digest, and the descriptor of the first shard, against which later shards are
 * compared. A batch
 * that becomes complete moves to the ready queue, so rounds list batches in the order they
 * became complete: since every rank reports its shards in the order they arrived, a batch that
 * a client sent after another on the same connections completes after it, and rounds keep each
 * connection's order. A batch expires at its batch deadline (its first shard's arrival +
 * deadline_ms) or at the earliest of its shards' callers' deadlines, whichever comes first, and
 * is ordered only while that is still ahead. Failed batches (client, id and attempt) are
 * remembered in a ring (the most recent 4096) so that a shard arriving after its batch failed is
 * failed at once instead of waiting out a deadline; a retry is another attempt, never one of
 * them. Every notice looks its batch up in that ring, so the ring is indexed by a hash of the
 * batch's name (chains through the ring's slots): a linear search cost 4 to 8 us a notice once
 * the ring was full (tests/bench/sequencer_bench --failed 4096, 2 shared cores), which capped a
 * leader at 64 ranks near 3,600 batches/s.
 *
 * Pending counts are small (the batches in flight), so linear scans are cheaper than a map. */
#include "sequencer.h"

#include <stdio.h>
#include <string.h>

#include "common/alloc.h"
#include "common/mix64.h"

#define FAILED_RING 4096
#define FAILED_BUCKETS 8192 /* a power of two, twice the ring */
#define NO_SLOT UINT16_MAX

typedef struct pending {
  embps_batch_desc_t desc;
  uint64_t first_ms;
  uint64_t caller_due_ms; /* the earliest of its shards' callers' deadlines; UINT64_MAX: none */
  uint32_t arrived;
  uint64_t *digests;  /* group_size entries: each arrived shard's digest (one allocation with
                         ranks, which follows them) */
  uint8_t *ranks;     /* group_size flags: the rank's shard arrived */
  int failed;         /* disagreement found: fail once complete or expired */
  int digests_differ; /* two shards' digests differ: fail likewise (the message is made then) */
  char why[400];
} pending_t;

typedef struct failed {
  uint64_t client_id, batch_id;
  uint32_t attempt;
  uint32_t kind;
  uint16_t next; /* the next slot in its bucket's chain; NO_SLOT ends it */
  embps_status_t status;
  char message[400];
} failed_t;

struct embps_sequencer {
  uint32_t group_size;
  uint64_t deadline_ms;
  pending_t *pending;
  size_t num_pending, cap_pending;
  embps_round_entry_t *ready; /* queued entries not yet handed out */
  size_t num_ready, cap_ready;
  failed_t failed[FAILED_RING];
  size_t failed_next, failed_count;
  uint16_t bucket[FAILED_BUCKETS]; /* the first slot of each hash bucket's chain, or NO_SLOT */
  embps_sequencer_counts_t counts;
};

embps_status_t embps_sequencer_new(embps_sequencer_t **out, uint32_t group_size,
                                   uint64_t deadline_ms) {
  embps_sequencer_t *s = embps_calloc(1, sizeof(*s));
  if (!s)
    return EMBPS_RESOURCE_EXHAUSTED;
  s->group_size = group_size;
  s->deadline_ms = deadline_ms;
  for (size_t b = 0; b < FAILED_BUCKETS; b++)
    s->bucket[b] = NO_SLOT;
  *out = s;
  return EMBPS_OK;
}

void embps_sequencer_free(embps_sequencer_t *s) {
  if (!s)
    return;
  for (size_t i = 0; i < s->num_pending; i++)
    embps_free(s->pending[i].digests);
  embps_free(s->pending);
  embps_free(s->ready);
  embps_free(s);
}

/* Whether a and b name one batch: the same id and attempt from the same client (0: no client
 * id). */
static int same_batch(const embps_batch_desc_t *a, const embps_batch_desc_t *b) {
  return a->client_id == b->client_id && a->batch_id == b->batch_id && a->attempt == b->attempt;
}

/* Appends a round entry; on allocation failure the entry is dropped (the batch then expires). */
static void queue_entry(embps_sequencer_t *s, const embps_batch_desc_t *d, uint32_t action,
                        embps_status_t status, const char *message) {
  embps_round_entry_t *e;
  if (s->num_ready == s->cap_ready) {
    size_t cap = s->cap_ready ? 2 * s->cap_ready : 64;
    embps_round_entry_t *r = embps_realloc(s->ready, cap * sizeof(*r));
    if (!r)
      return;
    s->ready = r;
    s->cap_ready = cap;
  }
  e = &s->ready[s->num_ready++];
  memset(e, 0, sizeof(*e));
  e->client_id = d->client_id;
  e->batch_id = d->batch_id;
  e->attempt = d->attempt;
  e->action = action;
  e->kind = d->kind;
  e->status = status;
  if (message)
    snprintf(e->message, sizeof(e->message), "%s", message);
}

static size_t bucket_of(uint64_t client_id, uint64_t batch_id, uint32_t attempt) {
  return (size_t)(embps_mix64(client_id ^ embps_mix64(batch_id ^ embps_mix64(attempt))) &
                  (FAILED_BUCKETS - 1));
}

static void remember_failed(embps_sequencer_t *s, const embps_batch_desc_t *d,
                            embps_status_t status, const char *message) {
  const uint16_t slot = (uint16_t)s->failed_next;
  failed_t *f = &s->failed[slot];
  uint16_t *link;
  if (s->failed_count == FAILED_RING) { /* the ring is full: unchain the entry it overwrites */
    for (link = &s->bucket[bucket_of(f->client_id, f->batch_id, f->attempt)]; *link != slot;
         link = &s->failed[*link].next) {
    }
    *link = f->next;
  }
  link = &s->bucket[bucket_of(d->client_id, d->batch_id, d->attempt)];
  f->next = *link;
  *link = slot;
  f->client_id = d->client_id;
  f->batch_id = d->batch_id;
  f->attempt = d->attempt;
  f->kind = d->kind;
  f->status = status;
  snprintf(f->message, sizeof(f->message), "%s", message);
  s->failed_next = (s->failed_next + 1) % FAILED_RING;
  if (s->failed_count < FAILED_RING)
    s->failed_count++;
}

static const failed_t *find_failed(const embps_sequencer_t *s, const embps_batch_desc_t *d) {
  for (uint16_t i = s->bucket[bucket_of(d->client_id, d->batch_id, d->attempt)]; i != NO_SLOT;
       i = s->failed[i].next)
    if (s->failed[i].client_id == d->client_id && s->failed[i].batch_id == d->batch_id &&
        s->failed[i].attempt == d->attempt)
      return &s->failed[i];
  return NULL;
}

static void drop_pending(embps_sequencer_t *s, size_t i) {
  embps_free(s->pending[i].digests);
  if (i + 1 < s->num_pending)
    memmove(&s->pending[i], &s->pending[i + 1], (s->num_pending - i - 1) * sizeof(pending_t));
  s->num_pending--;
}

static void fail_pending(embps_sequencer_t *s, size_t i, embps_status_t status, const char *msg) {
  pending_t *p = &s->pending[i];
  queue_entry(s, &p->desc, EMBPS_ROUND_FAIL, status, msg);
  remember_failed(s, &p->desc, status, msg);
  drop_pending(s, i);
}

/* When batch p's own deadline (--batch-deadline-ms from its first shard) passes; UINT64_MAX with
 * none. */
static uint64_t batch_due_ms(const embps_sequencer_t *s, const pending_t *p) {
  return s->deadline_ms ? p->first_ms + s->deadline_ms : UINT64_MAX;
}

/* When batch p expires: its batch deadline or its callers' earliest deadline, whichever comes
 * first; UINT64_MAX when it has neither. */
static uint64_t due_ms(const embps_sequencer_t *s, const pending_t *p) {
  uint64_t due = batch_due_ms(s, p);
  return p->caller_due_ms < due ? p->caller_due_ms : due;
}

/* The message of batch p, expired while the shards of `missing` ("1,3"; may be empty) were not
 * in: which of its deadlines passed. */
static void expired_message(const embps_sequencer_t *s, const pending_t *p, const char *missing,
                            char *msg, size_t cap) {
  if (p->caller_due_ms <= batch_due_ms(s, p))
    snprintf(msg, cap,
             "batch %llu: the deadline its caller set (grpc-timeout) passed before it was ordered"
             "%s%s%s; it ran on no rank",
             (unsigned long long)p->desc.batch_id, missing[0] ? ": the shards for rank(s) " : "",
             missing, missing[0] ? " had not arrived" : "");
  else
    snprintf(msg, cap,
             "batch %llu: the shards for rank(s) %s did not arrive within %llu ms; send every "
             "shard of a batch, one to each rank",
             (unsigned long long)p->desc.batch_id, missing, (unsigned long long)s->deadline_ms);
}

/* The ranks whose shards of p have not arrived, as "1,3" (empty when none). */
static void missing_ranks(const embps_sequencer_t *s, const pending_t *p, char *out, size_t cap) {
  size_t m = 0;
  out[0] = '\0';
  for (uint32_t r = 0; r < s->group_size && m + 12 < cap; r++)
    if (!p->ranks[r])
      m += (size_t)snprintf(out + m, cap - m, "%s%u", m ? "," : "", r);
}

/* When p's shards disagree, writes why to msg and returns 1: on what they are (kind, T, table),
 * else on their digests, against the lowest rank's shard in (rank 0's once every shard is), so
 * the ranks named are the same whatever order the shards came in. Else returns 0. */
static int disagreement(const embps_sequencer_t *s, const pending_t *p, char *msg, size_t cap) {
  uint32_t ref = 0;
  size_t m = 0;
  char others[96];
  if (p->failed) {
    snprintf(msg, cap, "%s", p->why);
    return 1;
  }
  if (!p->digests_differ)
    return 0;
  while (ref < s->group_size && !p->ranks[ref])
    ref++;
  others[0] = '\0';
  for (uint32_t r = ref + 1; r < s->group_size && m + 12 < sizeof(others); r++)
    if (p->ranks[r] && p->digests[r] != p->digests[ref])
      m += (size_t)snprintf(others + m, sizeof(others) - m, "%s%u", m ? "," : "", r);
  if (p->digests[ref])
    snprintf(msg, cap,
             "shards of batch %llu (client 0x%llx) disagree on the batch's content: rank %u's "
             "digest is 0x%016llx, rank(s) %s sent another; send every rank its shard of the "
             "same batch",
             (unsigned long long)p->desc.batch_id, (unsigned long long)p->desc.client_id, ref,
             (unsigned long long)p->digests[ref], others);
  else
    snprintf(msg, cap,
             "shards of batch %llu (client 0x%llx) disagree on the batch's content: rank %u's "
             "shard carries no digest, rank(s) %s sent one; send every rank its shard of the "
             "same batch",
             (unsigned long long)p->desc.batch_id, (unsigned long long)p->desc.client_id, ref,
             others);
  return 1;
}

/* Fails p, whose expiry has come, with DEADLINE_EXCEEDED; one whose shards disagree keeps
 * its INVALID_ARGUMENT. */
static void expire_pending(embps_sequencer_t *s, size_t i) {
  pending_t *p = &s->pending[i];
  char msg[400], missing[96];
  if (disagreement(s, p, msg, sizeof(msg))) {
    fail_pending(s, i, EMBPS_INVALID_ARGUMENT, msg);
    return;
  }
  missing_ranks(s, p, missing, sizeof(missing));
  expired_message(s, p, missing, msg, sizeof(msg));
  s->counts.expired++;
  fail_pending(s, i, EMBPS_DEADLINE_EXCEEDED, msg);
}

void embps_sequencer_arrive(embps_sequencer_t *s, uint32_t rank, const embps_batch_desc_t *desc,
                            uint64_t now_ms) {
  const failed_t *f;
  pending_t *p = NULL;
  size_t i;
  uint32_t needed =
      desc->kind == EMBPS_OP_CREATE_TABLE || desc->kind == EMBPS_OP_DROP_TABLE ? 1 : s->group_size;

  if ((f = find_failed(s, desc)) != NULL) {
    queue_entry(s, desc, EMBPS_ROUND_FAIL, f->status, f->message);
    return;
  }
  for (i = 0; i < s->num_pending; i++)
    if (same_batch(&s->pending[i].desc, desc)) {
      p = &s->pending[i];
      break;
    }
  if (!p) {
    if (s->num_pending == s->cap_pending) {
      size_t cap = s->cap_pending ? 2 * s->cap_pending : 64;
      pending_t *np = embps_realloc(s->pending, cap * sizeof(*np));
      if (!np)
        return; /* the shard's op stays parked until the group fails or the rank retries */
      s->pending = np;
      s->cap_pending = cap;
    }
    p = &s->pending[s->num_pending];
    memset(p, 0, sizeof(*p));
    p->digests = embps_calloc(s->group_size, sizeof(*p->digests) + 1);
    if (!p->digests)
      return;
    p->ranks = (uint8_t *)(p->digests + s->group_size);
    s->num_pending++;
    p->desc = *desc;
    p->first_ms = now_ms;
    p->caller_due_ms = UINT64_MAX;
  } else if (!p->failed &&
             (p->desc.kind != desc->kind || p->desc.tokens_per_batch != desc->tokens_per_batch ||
              strcmp(p->desc.table, desc->table) != 0)) {
    p->failed = 1;
    snprintf(p->why, sizeof(p->why),
             "shards of batch %llu disagree: one is a %s of table '%.40s' with "
             "tokens_per_batch=%u, rank %u's is a %s of table '%.40s' with tokens_per_batch=%u",
             (unsigned long long)desc->batch_id, embps_op_kind_name(p->desc.kind), p->desc.table,
             p->desc.tokens_per_batch, rank, embps_op_kind_name(desc->kind), desc->table,
             desc->tokens_per_batch);
  } else if (!p->failed && p->desc.table_id != desc->table_id) {
    p->failed = 1;
    snprintf(p->why, sizeof(p->why),
             "shards of batch %llu name two different tables called '%.40s': it was dropped and "
             "created again while the batch was on its way; send the batch again",
             (unsigned long long)desc->batch_id, desc->table);
  }
  if (rank >= s->group_size || p->ranks[rank])
    return; /* a duplicate report: the rank already refuses duplicate batch ids locally */
  p->ranks[rank] = 1;
  p->digests[rank] = desc->digest;
  if (desc->digest != p->desc.digest)
    p->digests_differ = 1;
  p->arrived++;
  if (desc->has_deadline && now_ms + desc->deadline_left_ms < p->caller_due_ms)
    p->caller_due_ms = now_ms + desc->deadline_left_ms;
  if (p->arrived == needed) {
    char msg[400];
    if (p->caller_due_ms <= now_ms)
      expire_pending(s, (size_t)(p - s->pending)); /* a caller's deadline is not still ahead */
    else if (disagreement(s, p, msg, sizeof(msg)))
      fail_pending(s, (size_t)(p - s->pending), EMBPS_INVALID_ARGUMENT, msg);
    else {
      queue_entry(s, &p->desc, EMBPS_ROUND_RUN, EMBPS_OK, NULL);
      drop_pending(s, (size_t)(p - s->pending));
    }
  }
}

size_t embps_sequencer_next_round(embps_sequencer_t *s, uint64_t now_ms, embps_round_entry_t *out,
                                  size_t max) {
  size_t n;

  /* Expire first, so that their failures go out in this round. */
  for (size_t i = 0; i < s->num_pending;) {
    if (now_ms >= due_ms(s, &s->pending[i]))
      expire_pending(s, i);
    else
      i++;
  }
  n = s->num_ready < max ? s->num_ready : max;
  if (n == 0)
    return 0;
  memcpy(out, s->ready, n * sizeof(*out));
  memmove(s->ready, s->ready + n, (s->num_ready - n) * sizeof(*out));
  s->num_ready -= n;
  return n;
}

uint64_t embps_sequencer_next_deadline(const embps_sequencer_t *s, uint64_t now_ms) {
  uint64_t best = UINT64_MAX;
  for (size_t i = 0; i < s->num_pending; i++) {
    uint64_t due = due_ms(s, &s->pending[i]);
    uint64_t left = due == UINT64_MAX ? UINT64_MAX : due > now_ms ? due - now_ms : 0;
    if (left < best)
      best = left;
  }
  return best;
}

int embps_sequencer_withdraw(embps_sequencer_t *s, uint32_t rank, uint64_t client_id,
                             uint64_t batch_id, uint32_t attempt, uint64_t now_ms) {
  embps_batch_desc_t key;
  char msg[400];
  memset(&key, 0, sizeof(key));
  key.client_id = client_id;
  key.batch_id = batch_id;
  key.attempt = attempt;
  for (size_t i = 0; i < s->num_pending; i++) {
    pending_t *p = &s->pending[i];
    if (!same_batch(&p->desc, &key))
      continue;
    if (disagreement(s, p, msg, sizeof(msg))) { /* it fails anyway: say why it was wrong */
      fail_pending(s, i, EMBPS_INVALID_ARGUMENT, msg);
      return 0;
    }
    if (now_ms >= due_ms(s, p)) { /* expired already, the leader just has not said so yet */
      expire_pending(s, i);
      return 0;
    }
    snprintf(msg, sizeof(msg),
             "batch %llu was cancelled before it was ordered: its caller on rank %u reset the "
             "stream (the client cancelled or gave up); it ran on no rank",
             (unsigned long long)batch_id, rank);
    s->counts.cancelled++;
    fail_pending(s, i, EMBPS_CANCELLED, msg);
    return 1;
  }
  return 0; /* not pending: already queued to run (it runs as ordered), failed, or unknown */
}

void embps_sequencer_counts(const embps_sequencer_t *s, embps_sequencer_counts_t *out) {
  *out = s->counts;
}

size_t embps_sequencer_pending(const embps_sequencer_t *s) { return s->num_pending; }
