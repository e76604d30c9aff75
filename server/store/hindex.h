/* The key -> slot index of a hash-keyed table (issue 31): which 64-bit keys a table stores, in
 * which of its `capacity` slots (rows), with admission (a key is stored once seen admit_after
 * times, counted in a count-min sketch) and eviction (LRU, LFU with decay, or LRU with expiry
 * after ttl_steps) over the table's own logical clock.
 *
 * The index is a pure, deterministic state machine: no I/O, no clock, no threads, no floating
 * point. Its state after any sequence of embps_hindex_step calls is a function of that sequence
 * and the configuration (its seed) alone, so every rank of a group, fed the same rounds, holds
 * the same index bit for bit, and a checkpoint (embps_hindex_encode) restores it exactly.
 *
 * The index also tracks what its steps changed since the last capture (embps_hindex_mark_captured:
 * at creation, at decode, and where a checkpoint takes it), so that an incremental checkpoint
 * writes a delta (embps_hindex_delta_encode) instead of the whole index, and a restore applies
 * it (embps_hindex_delta_apply) onto the index of the checkpoint before.
 *
 * Not thread-safe: one thread steps an index; embps_hindex_find may run on several threads at
 * once while no step runs. */
#ifndef EMBPS_HINDEX_H
#define EMBPS_HINDEX_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/** The format version of embps_hindex_encode's bytes. */
#define EMBPS_HINDEX_FORMAT_VERSION 1u
/** The format version of embps_hindex_delta_encode's bytes. */
#define EMBPS_HINDEX_DELTA_VERSION 1u
/** The most slots an index holds (slots are 32-bit). */
#define EMBPS_HINDEX_MAX_CAPACITY (UINT64_C(0xFFFFFFFF))
/** The highest admission threshold (the sketch's counters are 8-bit, saturating at 255). */
#define EMBPS_HINDEX_MAX_ADMIT_AFTER 255u
/** The widest sketch row (4 rows of this many one-byte counters: 1 GiB). */
#define EMBPS_HINDEX_MAX_SKETCH_WIDTH (UINT32_C(1) << 28)
/** The longest LFU half-life in steps (it bounds the scores: see hindex.c). */
#define EMBPS_HINDEX_MAX_HALF_LIFE (UINT64_C(1) << 31)
/** The longest time-to-live in steps. */
#define EMBPS_HINDEX_MAX_TTL_STEPS (UINT64_C(1) << 62)
/** The count-min sketch's rows. */
#define EMBPS_HINDEX_SKETCH_DEPTH 4u

/** Which stored key a full table evicts for a new one (always the one with the least (score,
 * key) among the keys not in the current step). */
typedef enum embps_hindex_policy {
  EMBPS_HINDEX_LRU = 1, /* score: the step of the last push */
  EMBPS_HINDEX_LFU = 2, /* score: pushes weighted 2^(step / half_life), decayed (hindex.c) */
  EMBPS_HINDEX_TTL = 3, /* LRU, and a key not pushed for ttl_steps steps expires */
} embps_hindex_policy_t;

/** An index's settings, fixed at creation. */
typedef struct embps_hindex_config {
  uint64_t capacity;            /* slots, 1 to EMBPS_HINDEX_MAX_CAPACITY */
  embps_hindex_policy_t policy; /* LRU, LFU or TTL */
  uint32_t admit_after;         /* K: stored at the K-th step that pushes it (1: at once) */
  uint32_t sketch_width;        /* counters per sketch row: >= 1 when K > 1, 0 when K == 1 */
  uint64_t half_life;           /* LFU only (else 0): steps over which a push's weight halves */
  uint64_t ttl_steps;           /* TTL only (else 0): steps without a push before expiry */
  uint64_t seed;                /* the table's seed: seeds the key hash and the sketch's rows */
} embps_hindex_config_t;

/** Counters of an index since its creation (kept across encode/decode). */
typedef struct embps_hindex_stats {
  uint64_t size;         /* keys stored now */
  uint64_t clock;        /* steps taken */
  uint64_t admitted;     /* keys given a slot (a key stored again after eviction counts again) */
  uint64_t evicted;      /* keys evicted for a new key */
  uint64_t expired;      /* keys expired (TTL) */
  uint64_t refused;      /* (key, step) pairs admitted but given no slot: every slot was held by
                            keys of that step; their gradients were dropped */
  uint64_t not_admitted; /* (key, step) pairs below admit_after: their gradients were dropped */
} embps_hindex_stats_t;

/** A slot (re)assigned by a step: the caller resets its row and optimizer state to the initial
 * state of `key`. */
typedef struct embps_hindex_fresh {
  uint64_t key;     /* the key now stored at slot */
  uint64_t evicted; /* the key evicted from slot by this assignment; 0 if the slot was free */
  uint32_t slot;
} embps_hindex_fresh_t;

typedef struct embps_hindex embps_hindex_t;

/** EMBPS_OK when c is a valid configuration; else EMBPS_INVALID_ARGUMENT with a message naming
 * the field and the remedy in err (may be NULL). */
embps_status_t embps_hindex_config_check(const embps_hindex_config_t *c, embps_error_t *err);

/** The exact bytes embps_hindex_new allocates for c (the struct, the hash map at load <= 0.5,
 * the per-slot arrays, the sketch, and the change tracking: one bit per slot and one bit per 64
 * bytes of sketch), for the memory budget. 0 for an invalid c. */
size_t embps_hindex_bytes(const embps_hindex_config_t *c);

/** Makes an empty index for c into *out (caller owns it; embps_hindex_free). Errors:
 * EMBPS_INVALID_ARGUMENT (as embps_hindex_config_check), EMBPS_RESOURCE_EXHAUSTED (no memory).
 * On failure *out is untouched. */
embps_status_t embps_hindex_new(embps_hindex_t **out, const embps_hindex_config_t *c,
                                embps_error_t *err);

/** Frees ix; NULL is a no-op. */
void embps_hindex_free(embps_hindex_t *ix);

/** ix's configuration. */
const embps_hindex_config_t *embps_hindex_config(const embps_hindex_t *ix);

/** ix's counters into *st. */
void embps_hindex_stats(const embps_hindex_t *ix, embps_hindex_stats_t *st);

/** The key each slot holds: capacity entries, slot by slot, 0 for a free slot (borrowed from ix:
 * valid until ix is stepped, applied a delta or freed). What `embps export` writes beside a
 * checkpoint's rows. */
const uint64_t *embps_hindex_slot_keys(const embps_hindex_t *ix);

/** Read-only lookup: slots[i] = the slot of keys[i], or -1 for a key not stored (key 0, the
 * padding, is never stored). Changes nothing: no recency, no admission count. */
void embps_hindex_find(const embps_hindex_t *ix, const uint64_t *keys, size_t n, int64_t *slots);

/**
 * One push step of the table: advances the clock by one, then, over the distinct nonzero keys of
 * keys[0..n) in ascending key order (so neither their order nor their repeats matter):
 * expires (TTL) the keys not pushed for ttl_steps steps; counts each absent key once in the
 * admission sketch; touches the stored keys (their score); gives each absent key that reached
 * admit_after a slot (the last freed slot, else the slot of the stored key with the least
 * (score, key) not in this step, evicted), or refuses it when every slot holds a key of this step.
 *
 * slots[i] (n entries, caller's) gets keys[i]'s slot after the step, or -1 when its gradient is
 * to be dropped (key 0, not admitted, refused). fresh (caller's, room for n entries; NULL when
 * n == 0) gets the slots assigned in this step in ascending key order, *nfresh their number.
 * Keys that already ascend strictly (a 0 only first), as a push's dedup gives them, are taken
 * as they are: no sort, and each key's slot comes from the step itself instead of a second
 * lookup (the result is the same as for any order of them).
 * The step's scratch (24 bytes per key) stays with ix, grown to the largest step's n, until
 * embps_hindex_free; it is not part of embps_hindex_bytes.
 * Errors: EMBPS_RESOURCE_EXHAUSTED when the scratch cannot be grown to n keys,
 * EMBPS_FAILED_PRECONDITION when the clock is at its end; either way ix is unchanged.
 */
embps_status_t embps_hindex_step(embps_hindex_t *ix, const uint64_t *keys, size_t n, int64_t *slots,
                                 embps_hindex_fresh_t *fresh, size_t *nfresh);

/**
 * One assign step of the table (an Assign RPC writing rows directly): embps_hindex_step's step,
 * with the clock, expiry, scores, eviction and refusal alike, except that every absent key is
 * given a slot at once, whatever admit_after says, and nothing is counted in the admission
 * sketch (not_admitted stays). So an assign is ordered with the pushes as one more step of the
 * same state machine, and every rank fed the same rounds still holds the same index. slots,
 * fresh and *nfresh as embps_hindex_step; errors alike, ix unchanged on error.
 */
embps_status_t embps_hindex_assign(embps_hindex_t *ix, const uint64_t *keys, size_t n,
                                   int64_t *slots, embps_hindex_fresh_t *fresh, size_t *nfresh);

/** The exact length embps_hindex_encode writes for ix. */
size_t embps_hindex_encoded_bytes(const embps_hindex_t *ix);

/**
 * Encodes ix (configuration, clock, counters, keys with their slots and scores, the free slots in
 * order, the sketch) as versioned little-endian bytes closed by a crc32 into out, which has room
 * for embps_hindex_encoded_bytes(ix). The encoding is canonical: equal indexes give equal bytes.
 */
void embps_hindex_encode(const embps_hindex_t *ix, uint8_t *out);

/**
 * Decodes len bytes at p (what embps_hindex_encode wrote) into a new index *out (caller owns it),
 * which behaves exactly as the encoded one. c is the table's configuration: bytes written for
 * another one are refused. name names the bytes in messages. Errors: EMBPS_DATA_LOSS (truncated,
 * corrupt, malformed), EMBPS_FAILED_PRECONDITION (another format version or configuration),
 * EMBPS_INVALID_ARGUMENT (c invalid), EMBPS_RESOURCE_EXHAUSTED; *out untouched on failure.
 */
embps_status_t embps_hindex_decode(embps_hindex_t **out, const embps_hindex_config_t *c,
                                   const uint8_t *p, size_t len, const char *name,
                                   embps_error_t *err);

/**
 * Makes ix's state as it is now its capture: the point the next embps_hindex_delta_encode counts
 * changes from. Clears the change tracking (O(capacity / 8) bytes written). An index is captured
 * when made (embps_hindex_new), decoded or applied a delta; a checkpoint of every table captures
 * it at its round on every rank, after the leader encoded it.
 */
void embps_hindex_mark_captured(embps_hindex_t *ix);

/** The exact length embps_hindex_delta_encode writes for ix (it counts the changed slots and
 * sketch blocks: O(capacity / 64)). */
size_t embps_hindex_delta_bytes(const embps_hindex_t *ix);

/**
 * Encodes the changes of ix since its last capture into out, which has room for
 * embps_hindex_delta_bytes(ix): the configuration, the header state (clock, counters, LFU base)
 * at the capture and now, the free stack's entries above its least depth since the capture, every
 * slot whose key or score changed (its key now, 0 for a free slot, and score), and every changed
 * block of the sketch. Versioned little-endian bytes closed by a crc32 (hindex_delta.c); equal
 * indexes with equal changes since equal captures give equal bytes. ix is not changed (call
 * embps_hindex_mark_captured to start the next delta).
 */
void embps_hindex_delta_encode(const embps_hindex_t *ix, uint8_t *out);

/**
 * Applies len bytes at p (what embps_hindex_delta_encode wrote) onto ix, which must be the index
 * as it was at that delta's capture (as decoded from the checkpoint before, or after the delta
 * before it was applied) with no step taken since: ix then is exactly the index that was encoded,
 * and is captured there (the next delta of a chain applies on it). name names the bytes in
 * messages. Errors: EMBPS_DATA_LOSS (truncated, corrupt, malformed, or a delta taken from
 * another state than ix's), EMBPS_FAILED_PRECONDITION (another format version or configuration),
 * EMBPS_RESOURCE_EXHAUSTED. On DATA_LOSS or RESOURCE_EXHAUSTED found after the checks of the
 * bytes' layout, ix may be partly changed: the caller frees it.
 */
embps_status_t embps_hindex_delta_apply(embps_hindex_t *ix, const uint8_t *p, size_t len,
                                        const char *name, embps_error_t *err);

#endif
