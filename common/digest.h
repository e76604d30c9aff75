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

#endif
