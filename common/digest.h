/* A batch's identity: the digest every shard of a Lookup or PushGradients carries, so that the
 * leader joins only shards of one and the same batch, and a retried push is recognised by
 * (client_id, batch_id, digest). docs/design.md ("A batch's identity") defines it; the Python
 * library computes the same value. Pure functions, no allocation. */
#ifndef EMBPS_DIGEST_H
#define EMBPS_DIGEST_H

#include <stdint.h>

/** The 14 bytes every digest's input starts with; a later definition changes them. */
#define EMBPS_DIGEST_MAGIC "embps-batch-v1"

/** The digest of a whole batch: XXH3-64 (seed 0) over EMBPS_DIGEST_MAGIC, the table name's
 * length as u32 little-endian and its bytes, tokens_per_batch (T, after padding) as u32 LE, and
 * the batch's T tokens in order (shard 0's, then shard 1's, ...) as int64 LE; a result of 0 is
 * replaced by 1, since 0 on the wire means "no digest". table is a NUL-terminated name (NULL
 * reads as ""); tokens holds T tokens (may be NULL when T is 0). Never fails. */
uint64_t embps_batch_digest(const char *table, uint32_t tokens_per_batch, const int64_t *tokens);

/** The same digest for a batch padded by its client: the first n tokens come from tokens and
 * the other tokens_per_batch - n are the padding token 0 (n > tokens_per_batch counts as
 * tokens_per_batch). Equal to embps_batch_digest() over the padded array, without building
 * it. */
uint64_t embps_batch_digest_padded(const char *table, uint32_t tokens_per_batch,
                                   const int64_t *tokens, uint64_t n);

/** The 17 bytes a feature batch's digest input starts with. */
#define EMBPS_FEATURES_DIGEST_MAGIC "embps-features-v1"

/** One feature of a feature batch, as the digest reads it: the caller's arrays, borrowed. */
typedef struct embps_digest_feature {
  const char *name;   /* NUL-terminated; NULL reads as "" */
  const char *table;  /* NUL-terminated; NULL reads as "" */
  uint32_t pooling;   /* embps.v1.Pooling's value; 3 (weighted sum) hashes the weights */
  const int64_t *ids; /* num_ids: every bag's ids, bag after bag (padded samples add none) */
  uint64_t num_ids;
  const uint32_t *lengths; /* num_lengths: the caller's samples' bags; the batch's others are
                              padding, empty bags (length 0) */
  uint64_t num_lengths;
  const float *weights; /* num_ids, read for pooling 3 only (NULL there reads as zeros) */
} embps_digest_feature_t;

/** The digest of a whole feature batch (docs/design.md, "Feature batches"): XXH3-64 (seed 0)
 * over EMBPS_FEATURES_DIGEST_MAGIC, batch_size (B, after padding) as u32 LE, the number of
 * features as u32 LE, then for each feature in order: its name and its table (each as a u32 LE
 * length and the bytes), its pooling as u32 LE, its ids' count as u64 LE, its ids as int64 LE
 * (shard 0's, then shard 1's...: the caller's order, since shards split by samples), its B
 * lengths as u32 LE (num_lengths from lengths, then zeros up to B; num_lengths > B counts as B),
 * and for weighted sum its weights as f32 LE. 0 becomes 1. Never fails; no allocation. */
uint64_t embps_features_digest(uint32_t batch_size, const embps_digest_feature_t *features,
                               uint32_t num_features);

#endif
